#!/usr/bin/env bash
# shellcheck disable=SC2317  # the check functions are invoked through check
# The container image, built and run: builds the Dockerfile's runtime image and its `demo` target
# with podman (as `docker build` would, no daemon), runs them against the local Postgres and Redis
# with host networking, and checks what a user of the image relies on. Also validates
# docker-compose.yml and the trigger.dev overlay with a compose implementation (podman-compose).
#   bash scripts/image.sh           # everything below
#   bash scripts/image.sh build     # the base images and the two builds only (scripts/test.sh
#                                   # runs this in the background, then the whole script)
#   bash scripts/image.sh compose   # the compose checks only (seconds)
# What it prints: one PASS/FAIL line per check, the image sizes and the time of each phase; exits
# non-zero on any FAIL. Logs: target/test-logs/image-*.log.
#
# Base images: Docker Hub is out of reach here, so the two images the Dockerfile starts FROM are
# made locally and kept in podman's store between runs (skipped when present):
#   docker.io/library/debian:bookworm-slim  debootstrap --variant=minbase bookworm, imported;
#   docker.io/library/rust:<v>-bookworm     that base + the Debian packages of the official rust
#                                           image that the build uses + this machine's Rust
#                                           toolchain of the same version (`rustc --version`),
#                                           laid out like the official image (RUSTUP_HOME,
#                                           CARGO_HOME, PATH), and this machine's CA bundle
#                                           (IMAGE_HOST_CA) so that cargo reaches crates.io.
# The Dockerfile itself builds unchanged (`podman build --format docker`, which keeps HEALTHCHECK;
# its cache mounts persist between runs). Not exercised here: the arm64 cross build and pulling
# the real base images (docs/releases.md, "How the image is checked").
# Installs podman, debootstrap and runc with apt-get when missing, and podman-compose from PyPI
# into target/image-venv. Runs containers with runc and cgroupfs, with a containers.conf of its
# own (target/image/containers.conf: no default rlimits, which this machine refuses).
# Env: IMAGE_HOST_CA (CA bundle trusted inside the builder, default
# /etc/ssl/certs/ca-certificates.crt), IMAGE_REBUILD_BASE=1 (remake both base images),
# IMAGE_COLD=1 (first drop every podman image, base images included, and the build's cache mounts:
# what a cold machine builds),
# IMAGE_STOP_GRACE (seconds `podman stop` waits before SIGKILL, default 10, Docker's default),
# IMAGE_KEEP=1 (leave the test container and database behind for a look).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
LOG_DIR="$TARGET_DIR/test-logs"
WORK="$TARGET_DIR/image"
mkdir -p "$LOG_DIR" "$WORK"

BASE_IMAGE=docker.io/library/debian:bookworm-slim
# The builder's tag and Rust version, from the Dockerfile's FROM line (rust:<version>-bookworm).
RUST_VERSION=$(sed -n 's/^FROM .*rust:\([0-9.]*\)-bookworm .*/\1/p' Dockerfile | head -n 1)
BUILDER_IMAGE="docker.io/library/rust:${RUST_VERSION}-bookworm"
IMAGE=localhost/runfeed:test
DEMO_IMAGE=localhost/runfeed-demo:test
HOST_CA="${IMAGE_HOST_CA:-/etc/ssl/certs/ca-certificates.crt}"
STOP_GRACE="${IMAGE_STOP_GRACE:-10}"
PODMAN_COMPOSE_PYPI="podman-compose==1.6.0"
PG_BASE=postgres://postgres@127.0.0.1:5432
REDIS_URL=redis://127.0.0.1:6379
NAME="runfeed-image-$$"
DB="runfeed_image_$$"
SDK_HEADERS=(-H 'x-trigger-electric-version: 1.0.0-beta.1' -H 'x-trigger-api-version: 2025-07-16')

say() { printf -- '--> %s\n' "$*"; }
die() { printf -- '--> ERROR: %s\n' "$*" >&2; exit 1; }

FAILED=0
pass() { printf 'PASS  %s\n' "$*"; }
fail() { printf 'FAIL  %s\n' "$*"; FAILED=1; }
# check NAME COMMAND...: PASS when the command succeeds.
check() {
  local name=$1; shift
  if "$@"; then pass "$name"; else fail "$name"; fi
}

T0=$SECONDS
TIMES=()
phase_done() { TIMES+=("$1: $((SECONDS - PHASE_T0))s"); PHASE_T0=$SECONDS; }
PHASE_T0=$SECONDS

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
  else "$@"
  fi
}

# ---------------------------------------------------------------------------------------------
# tools

install_tools() {
  local missing=() t
  for t in podman debootstrap runc; do command -v "$t" >/dev/null 2>&1 || missing+=("$t"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die "${missing[*]} missing and no apt-get; install them yourself"
  say "apt-get install ${missing[*]} (Debian)"
  if ! as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" \
      >"$LOG_DIR/image-apt.log" 2>&1; then
    if ! { as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq "${missing[@]}"; } >>"$LOG_DIR/image-apt.log" 2>&1; then
      tail -20 "$LOG_DIR/image-apt.log"; die "apt-get install ${missing[*]} failed"
    fi
  fi
}

install_podman_compose() {
  local venv="$TARGET_DIR/image-venv"
  if [ ! -x "$venv/bin/podman-compose" ]; then
    say "pip install $PODMAN_COMPOSE_PYPI (into $venv)"
    if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q "$PODMAN_COMPOSE_PYPI"; } \
        >"$LOG_DIR/image-pip.log" 2>&1; then
      tail -20 "$LOG_DIR/image-pip.log"; return 1
    fi
  fi
  PODMAN_COMPOSE="$venv/bin/podman-compose"
}

# runc (crun fails on this machine's hybrid cgroups) and cgroupfs (no systemd); the default
# rlimits of containers.conf are refused here, so none are set.
printf '[containers]\ndefault_ulimits = []\n' >"$WORK/containers.conf"
export CONTAINERS_CONF="$WORK/containers.conf"
pm() { podman --runtime runc --cgroup-manager cgroupfs "$@"; }

# ---------------------------------------------------------------------------------------------
# base images

make_base_image() {
  local dir="$WORK/debootstrap"
  say "base image $BASE_IMAGE: debootstrap --variant=minbase bookworm"
  rm -rf "$dir"
  as_root debootstrap --variant=minbase bookworm "$dir" http://deb.debian.org/debian \
    >"$LOG_DIR/image-debootstrap.log" 2>&1 ||
    { tail -20 "$LOG_DIR/image-debootstrap.log"; return 1; }
  # What the official image has beyond minbase: the security and updates suites, no apt caches.
  printf '%s\n' "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main" >"$dir/etc/apt/sources.list"
  rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/archives/*.deb
  # Slim like the official image: no documentation, manual pages or translations, now or later.
  printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
    'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' \
    'path-exclude /usr/share/locale/*' 'path-include /usr/share/locale/locale.alias' \
    >"$dir/etc/dpkg/dpkg.cfg.d/docker"
  find "$dir/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  rm -rf "$dir"/usr/share/man/* "$dir"/usr/share/info/* "$dir"/var/cache/debconf/*-old
  find "$dir/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
  tar -C "$dir" -c . | pm import --change 'CMD ["bash"]' - "$BASE_IMAGE" >>"$LOG_DIR/image-debootstrap.log" 2>&1 ||
    { tail -5 "$LOG_DIR/image-debootstrap.log"; return 1; }
  rm -rf "$dir"
}

# The host's rustup toolchain of RUST_VERSION (the Dockerfile's, e.g. 1.95): the default one's
# directory or, failing that, any installed toolchain whose rustc has that version.
host_toolchain() {
  local dir home
  home=$(rustup show home 2>/dev/null || echo "${RUSTUP_HOME:-$HOME/.rustup}")
  for dir in "$(rustc --print sysroot 2>/dev/null)" "$home"/toolchains/*; do
    [ -x "$dir/bin/rustc" ] || continue
    case $("$dir/bin/rustc" --version) in
      "rustc $RUST_VERSION "* | "rustc $RUST_VERSION."*) readlink -f "$dir"; return 0 ;;
    esac
  done
  echo "no Rust $RUST_VERSION toolchain on this machine (rustup toolchain install $RUST_VERSION)" >&2
  return 1
}

make_builder_image() {
  local ctx="$WORK/builder" toolchain rustup triple version
  toolchain=$(host_toolchain) || return 1
  version=$("$toolchain/bin/rustc" --version | cut -d' ' -f2)
  rustup=$(command -v rustup) || { echo "rustup not found" >&2; return 1; }
  triple=$("$toolchain/bin/rustc" -vV | sed -n 's/^host: //p')
  [ -r "$HOST_CA" ] || { echo "IMAGE_HOST_CA $HOST_CA is not readable" >&2; return 1; }
  say "builder image $BUILDER_IMAGE: $BASE_IMAGE + gcc, make, pkg-config, libc6-dev, git + $toolchain"
  rm -rf "$ctx"
  mkdir -p "$ctx/toolchain"
  # The toolchain without its documentation (share/doc: most of its size).
  tar -C "$toolchain" --exclude=./share/doc -c . | tar -C "$ctx/toolchain" -x || return 1
  cp "$(readlink -f "$rustup")" "$ctx/rustup" && cp "$HOST_CA" "$ctx/host-ca.crt" || return 1
  cat >"$ctx/Containerfile" <<EOF
FROM $BASE_IMAGE
RUN apt-get update \\
 && apt-get install -y --no-install-recommends gcc make pkg-config libc6-dev git ca-certificates \\
 && rm -rf /var/lib/apt/lists/*
COPY host-ca.crt /etc/ssl/certs/ca-certificates.crt
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo \\
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    RUST_VERSION=$version
COPY toolchain /usr/local/rustup/toolchains/$version-$triple
COPY rustup /usr/local/cargo/bin/rustup
RUN set -eu; cd /usr/local/cargo/bin; \\
    for t in cargo cargo-clippy cargo-fmt clippy-driver rustc rustdoc rustfmt rust-gdb rust-gdbgui rust-lldb; do ln -s rustup "\$t"; done; \\
    printf 'version = "12"\\ndefault_toolchain = "$version-$triple"\\nprofile = "minimal"\\n' > "\$RUSTUP_HOME/settings.toml"; \\
    chmod -R a+w "\$RUSTUP_HOME" "\$CARGO_HOME"; \\
    rustup --version; cargo --version; rustc --version
EOF
  nice -n 10 podman build --format docker --isolation chroot --network host -t "$BUILDER_IMAGE" "$ctx" \
    >"$LOG_DIR/image-builder.log" 2>&1 || { tail -30 "$LOG_DIR/image-builder.log"; return 1; }
  rm -rf "$ctx"
}

base_images() {
  if [ "${IMAGE_REBUILD_BASE:-0}" = 1 ]; then
    pm rmi -f "$BUILDER_IMAGE" "$BASE_IMAGE" >/dev/null 2>&1 || true
  fi
  if ! pm image exists "$BASE_IMAGE"; then make_base_image || return 1; else say "$BASE_IMAGE: present"; fi
  if ! pm image exists "$BUILDER_IMAGE"; then make_builder_image || return 1; else say "$BUILDER_IMAGE: present"; fi
}

# ---------------------------------------------------------------------------------------------
# build

# A cold machine: no images at all (the base images included), no cached layers, no cache mounts
# (buildah keeps them under /var/tmp/buildah-cache for root, buildah-cache-<uid> otherwise).
drop_build_cache() {
  say "IMAGE_COLD=1: dropping every image, the layer cache and the build's cache mounts"
  pm rmi -a -f >/dev/null 2>&1 || true
  as_root rm -rf /var/tmp/buildah-cache /var/tmp/buildah-cache-"$(id -u)"
}

# The build a user runs (`docker build [--target demo] .`), through podman: --format docker keeps
# HEALTHCHECK (the OCI format has none), chroot isolation needs no user namespace or cgroups.
build() { # tag, log, extra args...
  local tag=$1 log=$2; shift 2
  say "podman build $* -t $tag . (log: $log)"
  nice -n 10 podman build --format docker --isolation chroot --network host \
    --build-arg RUNFEED_BUILD_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
    "$@" -t "$tag" . >"$log" 2>&1 || { tail -40 "$log"; return 1; }
}

# ---------------------------------------------------------------------------------------------
# run

psql_q() { psql -h 127.0.0.1 -U postgres -X -v ON_ERROR_STOP=1 -qAt "$@"; }

# A TCP port on 127.0.0.1 that nothing listens on now.
free_port() {
  local p
  for _ in $(seq 50); do
    p=$((20000 + RANDOM % 20000))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return 0; }
  done
  return 1
}

cleanup() {
  [ "${IMAGE_KEEP:-0}" = 1 ] && { say "IMAGE_KEEP=1: container $NAME and database $DB left behind"; return; }
  pm rm -f -i -t 0 "$NAME" "$NAME-migrate" "$NAME-demo" >/dev/null 2>&1 || true
  psql_q -d postgres -c "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)" >/dev/null 2>&1 || true
}

http_status() { curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$@"; }

wait_listening() {
  local deadline=$((SECONDS + 30))
  until [ "$(http_status "http://127.0.0.1:$PORT/healthz")" = 200 ]; do
    if [ "$(pm inspect --format '{{.State.Running}}' "$NAME" 2>/dev/null)" != true ]; then
      echo "the container exited:" >&2; pm logs "$NAME" 2>&1 | tail -20 >&2; return 1
    fi
    [ "$SECONDS" -ge "$deadline" ] && { echo "not serving after 30 s" >&2; return 1; }
    sleep 0.2
  done
}

check_migrate() {
  psql_q -d postgres -c "CREATE DATABASE \"$DB\"" || return 1
  pm run --rm --name "$NAME-migrate" --network host "$IMAGE" migrate --database-url "$PG_BASE/$DB" \
    >"$LOG_DIR/image-migrate.log" 2>&1 || { cat "$LOG_DIR/image-migrate.log"; return 1; }
  [ "$(psql_q -d "$DB" -c 'SELECT count(*) FROM "TaskRun"')" = 0 ]
}

# The demo image seeds an environment, a token and runs (--seed-only: no workload).
SEEDED=""
check_demo_seed() {
  pm run --rm --name "$NAME-demo" --network host "$DEMO_IMAGE" --database-url "$PG_BASE/$DB" \
    --redis-url "$REDIS_URL" --base-url "http://127.0.0.1:$PORT" --seed-only \
    >"$LOG_DIR/image-demo.log" 2>&1 || { tail -20 "$LOG_DIR/image-demo.log"; return 1; }
  SEEDED=$(grep -E '^(ENV_ID|PUBLIC_TOKEN|RUN_ID|TAG)=' "$LOG_DIR/image-demo.log")
  [ "$(printf '%s\n' "$SEEDED" | wc -l)" -eq 4 ]
}
seeded() { printf '%s\n' "$SEEDED" | sed -n "s/^$1=//p"; }

check_serves() {
  # (podman's complaints that there is no systemd to schedule health checks go to the log.)
  pm run -d --name "$NAME" --network host \
    -e DATABASE_URL="$PG_BASE/$DB" -e REDIS_URL="$REDIS_URL" \
    -e RUNFEED_TELEMETRY__ADMIN_LISTEN="127.0.0.1:$ADMIN_PORT" \
    "$IMAGE" serve --listen "127.0.0.1:$PORT" >/dev/null 2>"$LOG_DIR/image-podman.log" || return 1
  wait_listening
}

check_admin() { # route
  [ "$(http_status "http://127.0.0.1:$ADMIN_PORT$1")" = 200 ]
}

check_non_root() {
  local pid uid
  pid=$(pm inspect --format '{{.State.Pid}}' "$NAME") && [ "$pid" -gt 0 ] || return 1
  uid=$(stat -c %u "/proc/$pid") || return 1
  echo "    pid $pid runs as uid $uid ($(tr '\0' ' ' <"/proc/$pid/cmdline"))"
  [ "$uid" = 10001 ]
}

check_healthcheck() {
  local hc
  hc=$(pm image inspect --format '{{json .Config.Healthcheck}}' "$IMAGE")
  case $hc in *'"Test":'*) ;; *) echo "    the image has no HEALTHCHECK ($hc)"; return 1 ;; esac
  pm healthcheck run "$NAME" 2>>"$LOG_DIR/image-podman.log"
}

# The version and build commit the image reports.
check_build_info() {
  local metrics commit
  commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
  metrics=$(curl -sS --max-time 5 "http://127.0.0.1:$ADMIN_PORT/metrics") || return 1
  printf '%s\n' "$metrics" | grep -q "^runfeed_build_info{.*commit=\"$commit\"" || {
    printf '%s\n' "$metrics" | grep '^runfeed_build_info' >&2; return 1; }
}

# A change to the seeded run, as trigger.dev makes it: the row first, then its change record,
# published with the image's own `runfeed publish`.
change_run() {
  local row id env ms
  row=$(psql_q -d "$DB" -F ' ' -c "UPDATE \"TaskRun\" SET status = 'EXECUTING',
      \"startedAt\" = now() AT TIME ZONE 'UTC',
      \"updatedAt\" = GREATEST(date_trunc('milliseconds', clock_timestamp() AT TIME ZONE 'UTC'),
                               \"updatedAt\" + interval '1 millisecond')
    WHERE \"friendlyId\" = '$(seeded RUN_ID)'
    RETURNING id, \"runtimeEnvironmentId\", (extract(epoch FROM \"updatedAt\") * 1000)::bigint") || return 1
  read -r id env ms <<<"$row"
  [ -n "$ms" ] || return 1
  pm run --rm --network host "$IMAGE" publish --redis-url "$REDIS_URL" --env "$env" --run "$id" \
    --updated-at-ms "$ms" >/dev/null
}

# A snapshot and a live poll of the seeded run's feed with @electric-sql/client, through the
# container; the change is made once the client is up to date.
check_client() {
  if [ ! -d tests/e2e/node_modules ] || [ tests/e2e/package-lock.json -nt tests/e2e/node_modules/.package-lock.json ]; then
    npm ci --prefix tests/e2e --no-audit --no-fund --loglevel=error || return 1
  fi
  IMAGE_CHANGE_CMD="bash $ROOT/scripts/image.sh --change-run" IMAGE_DB="$DB" IMAGE_RUN_ID="$(seeded RUN_ID)" \
    timeout 60 node tests/e2e/support/image-client.mjs --base-url "http://127.0.0.1:$PORT" \
      --token "$(seeded PUBLIC_TOKEN)" --run "$(seeded RUN_ID)" 2>&1 | tee "$LOG_DIR/image-client.log" |
    sed 's/^/    /'
  [ "${PIPESTATUS[0]}" -eq 0 ]
}

# SIGTERM while a live poll is held: the poll is answered (200, up-to-date) and the container
# exits 0 before `podman stop`'s grace period runs out.
check_drain() {
  local url headers handle offset held t0 dt code
  url="http://127.0.0.1:$PORT/realtime/v1/runs?tags=$(seeded TAG)&createdAt=1h"
  headers=$(curl -sS -o /dev/null -D - --max-time 10 "${SDK_HEADERS[@]}" \
    -H "Authorization: Bearer $(seeded PUBLIC_TOKEN)" "$url&offset=-1") || return 1
  handle=$(printf '%s' "$headers" | tr -d '\r' | sed -n 's/^electric-handle: //Ip')
  offset=$(printf '%s' "$headers" | tr -d '\r' | sed -n 's/^electric-offset: //Ip')
  if [ -z "$handle" ] || [ -z "$offset" ]; then echo "    no handle/offset in the snapshot" >&2; return 1; fi
  curl -sS -o "$WORK/drain-body" -w '%{http_code}' --max-time 60 "${SDK_HEADERS[@]}" \
    -H "Authorization: Bearer $(seeded PUBLIC_TOKEN)" \
    "$url&offset=$offset&handle=$handle&live=true" >"$WORK/drain-code" 2>"$WORK/drain-err" &
  local curl_pid=$!
  held=0
  for _ in $(seq 100); do
    if curl -s --max-time 2 "http://127.0.0.1:$ADMIN_PORT/metrics" |
        awk '/^runfeed_router_held_feeds/ { n += $NF } END { exit !(n > 0) }'; then held=1; break; fi
    sleep 0.1
  done
  [ "$held" = 1 ] || { echo "    the live poll was never held" >&2; kill "$curl_pid" 2>/dev/null; return 1; }
  t0=$(date +%s%N)
  pm stop -t "$STOP_GRACE" "$NAME" >/dev/null 2>>"$LOG_DIR/image-podman.log" || return 1
  dt=$((($(date +%s%N) - t0) / 1000000))
  wait "$curl_pid"
  code=$(cat "$WORK/drain-code")
  local exit_code
  exit_code=$(pm inspect --format '{{.State.ExitCode}}' "$NAME")
  echo "    stopped in ${dt} ms (grace ${STOP_GRACE} s), exit code $exit_code; the held poll: HTTP $code $(head -c 200 "$WORK/drain-body")"
  pm logs "$NAME" >"$LOG_DIR/image-serve.log" 2>&1
  [ "$code" = 200 ] && grep -q 'up-to-date' "$WORK/drain-body" && [ "$exit_code" = 0 ] &&
    [ "$dt" -lt $((STOP_GRACE * 1000)) ]
}

report_size() { # image
  local bytes base
  bytes=$(pm image inspect --format '{{.Size}}' "$1") || return 1
  base=$(pm image inspect --format '{{.Size}}' "$BASE_IMAGE") || return 1
  printf 'size  %s: %s MB (%s MB above the base image, which is %s MB here)\n' "$1" \
    "$((bytes / 1000000))" "$(((bytes - base) / 1000000))" "$((base / 1000000))"
}

# ---------------------------------------------------------------------------------------------
# compose

# `podman-compose config` of FILES… (run from the first file's directory, as compose resolves
# relative paths against it), with ENV… (NAME=value words) before `--`; the merged file on stdout.
compose_config() { # env… -- files…
  local envs=() args=() f
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  for f in "$@"; do args+=(-f "$f"); done
  (cd "$(dirname "$1")" && env "${envs[@]}" "$PODMAN_COMPOSE" --podman-path "$(command -v podman)" "${args[@]}" config)
}

# Asserts on a merged compose file (stdin): Python expressions over `s`, its services.
compose_assert() { # expressions…
  "$(dirname "$PODMAN_COMPOSE")/python" -c '
import sys, yaml
s = yaml.safe_load(sys.stdin)["services"]
bad = [e for e in sys.argv[1:] if not eval(e)]
for e in bad: print("    not true:", e)
sys.exit(1 if bad else 0)' "$@"
}

check_compose_local() {
  local out="$LOG_DIR/image-compose-local.log"
  compose_config -- "$ROOT/docker-compose.yml" >"$out" 2>"$out.err" || { tail -20 "$out.err"; return 1; }
  compose_assert \
    'set(s) == {"postgres", "postgres-replica", "redis", "migrate", "runfeed", "demo", "prometheus", "grafana"}' \
    's["runfeed"]["image"] == "runfeed:local" and s["runfeed"]["build"]' \
    's["demo"]["build"]["target"] == "demo" and s["demo"]["image"] == "runfeed-demo:local"' \
    's["migrate"]["command"] == ["migrate"] and s["migrate"]["healthcheck"]["disable"]' \
    's["runfeed"]["command"] == ["serve", "--listen", "0.0.0.0:3030"]' \
    's["runfeed"]["environment"]["DATABASE_READ_REPLICA_URL"].startswith("postgres://postgres@postgres-replica:5432/")' \
    's["runfeed"]["environment"]["RUNFEED_TELEMETRY__ADMIN_LISTEN"] == "0.0.0.0:9464"' \
    's["runfeed"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"' \
    <"$out"
}

# trigger.dev's own compose files are not in this repository: stand-ins with the parts the overlays
# build on, as tests/deploy/deploy_trigger.rs records them for trigger.dev v4.5.12 (services,
# networks and their names, the webapp's database and Redis; hosting/docker/webapp/docker-compose.yml
# and hosting/docker/docker-compose.traefik.yml).
write_trigger_stand_ins() { # dir
  mkdir -p "$1/webapp"
  cat >"$1/webapp/docker-compose.yml" <<'EOF'
name: trigger
services:
  webapp:
    image: ghcr.io/triggerdotdev/trigger.dev:v4.5.12
    restart: ${RESTART_POLICY:-unless-stopped}
    depends_on: [postgres, redis, clickhouse, s2]
    networks: [webapp, supervisor]
    environment:
      ELECTRIC_ORIGIN: http://electric:3000
      DATABASE_URL: postgresql://postgres:${POSTGRES_PASSWORD:-pw}@postgres:5432/main?schema=public&sslmode=disable
      REDIS_HOST: redis
      REDIS_PORT: 6379
      REDIS_TLS_DISABLED: true
  postgres:
    image: postgres:14
    command: [-c, wal_level=logical]
    networks: [webapp]
  redis:
    image: redis:7
    networks: [webapp]
  electric:
    image: electricsql/electric:1.2.4
    depends_on: [postgres]
    networks: [webapp]
  clickhouse:
    image: clickhouse/clickhouse-server:25.3
    networks: [webapp]
  s2:
    image: ghcr.io/s2-streamstore/s2:latest
    networks: [webapp]
networks:
  docker-proxy:
    name: docker-proxy
  supervisor:
    name: supervisor
  webapp:
    name: webapp
EOF
  cat >"$1/docker-compose.traefik.yml" <<'EOF'
services:
  webapp:
    networks: [traefik]
    labels:
      - traefik.enable=true
      - traefik.http.routers.webapp.rule=Host(`webapp.localhost`)
      - traefik.http.routers.webapp.entrypoints=${TRAEFIK_ENTRYPOINT:-web}
      - traefik.http.services.webapp.loadbalancer.server.port=3000
  traefik:
    image: traefik:v3.4
    command: [--providers.docker.network=traefik, --entrypoints.web.address=:80, --entrypoints.websecure.address=:443]
    networks: [traefik]
networks:
  traefik:
    name: traefik
EOF
}

# The overlays on the stand-ins, with the -f list of docs/install-compose.md (plus the optional
# no-electric file, whose profile leaves `electric` out of the merged file).
check_compose_trigger() {
  local dir="$WORK/compose/hosting/docker" overlays="$ROOT/deploy/trigger.dev/compose"
  local out="$LOG_DIR/image-compose-trigger.log"
  local files=("$dir/webapp/docker-compose.yml" "$dir/docker-compose.traefik.yml"
    "$overlays/docker-compose.runfeed.yml" "$overlays/docker-compose.runfeed.traefik.yml"
    "$overlays/docker-compose.no-electric.yml")
  write_trigger_stand_ins "$dir"
  compose_config RUNFEED_DB_PASSWORD=pw RUNFEED_HANDLE_SECRET=secret RUNFEED_IMAGE=registry.example.com/runfeed:9.9.9 \
    -- "${files[@]}" >"$out" 2>"$out.err" || { tail -20 "$out.err"; return 1; }
  # shellcheck disable=SC2016  # backquotes of Traefik's rule syntax, not the shell's
  compose_assert \
    's["runfeed"]["image"] == "registry.example.com/runfeed:9.9.9"' \
    's["runfeed"]["command"] == ["serve", "--listen", "0.0.0.0:3030"]' \
    'set(s["runfeed"]["networks"]) == {"webapp", "traefik"}' \
    's["runfeed"]["environment"]["DATABASE_URL"] == "postgresql://runfeed:pw@postgres:5432/main?sslmode=disable"' \
    's["runfeed"]["environment"]["RUNFEED_SERVER__HANDLE_SECRET"] == "secret"' \
    's["runfeed"]["environment"]["REDIS_URL"] == "redis://redis:6379"' \
    'str(s["webapp"]["environment"]["REALTIME_BACKEND_NATIVE_ENABLED"]) == "1"' \
    's["webapp"]["environment"]["DATABASE_URL"].startswith("postgresql://postgres:")' \
    's["runfeed"]["labels"]["traefik.http.routers.runfeed.rule"].endswith("PathRegexp(`^/realtime/v1/(runs|runs/[^/]+|batches/[^/]+)$`)")' \
    's["runfeed"]["labels"]["traefik.http.services.runfeed.loadbalancer.server.port"] == "3030"' \
    '"electric" not in s and "traefik" in s' \
    <"$out" || return 1
  # Without the role's password the overlay stops with its message.
  if compose_config RUNFEED_HANDLE_SECRET=secret -- "${files[@]}" >"$out.unset" 2>&1; then
    echo "    config passed without RUNFEED_DB_PASSWORD"; return 1
  fi
  grep -q 'Set RUNFEED_DB_PASSWORD' "$out.unset" || { tail -5 "$out.unset"; return 1; }
}

# ---------------------------------------------------------------------------------------------

MODE=${1:-all}
case $MODE in
  all | build | compose) ;;
  --change-run)
    # Called by tests/e2e/support/image-client.mjs once its client is up to date.
    DB=$IMAGE_DB
    SEEDED="RUN_ID=$IMAGE_RUN_ID"
    change_run
    exit $? ;;
  *) die "usage: bash scripts/image.sh [all | build | compose]" ;;
esac

summary() {
  local t all=""
  for t in "${TIMES[@]}"; do all+="${all:+, }$t"; done
  printf 'times: %s; total %ss\n' "$all" "$((SECONDS - T0))"
  if [ "$FAILED" -ne 0 ]; then echo "image: FAILED"; else echo "image: OK"; fi
}

if [ "$MODE" != build ]; then
  if install_podman_compose; then
    check "podman-compose config: docker-compose.yml" check_compose_local
    check "podman-compose config: trigger.dev's compose + the runfeed overlays" check_compose_trigger
  else
    fail "pip install $PODMAN_COMPOSE_PYPI"
  fi
  phase_done "compose"
  [ "$MODE" = compose ] && { summary; exit "$FAILED"; }
fi

install_tools
trap cleanup EXIT
[ -n "$RUST_VERSION" ] || die "no rust:<version>-bookworm FROM line in the Dockerfile"
[ "${IMAGE_COLD:-0}" = 1 ] && drop_build_cache
if ! base_images; then fail "base images"; summary; exit 1; fi
phase_done "base images"

check "build: the runtime image (default target)" build "$IMAGE" "$LOG_DIR/image-build.log"
phase_done "build runtime"
check "build: the demo image (--target demo)" build "$DEMO_IMAGE" "$LOG_DIR/image-build-demo.log" --target demo
phase_done "build demo"
report_size "$IMAGE"
report_size "$DEMO_IMAGE"
if [ "$MODE" = build ] || [ "$FAILED" -ne 0 ]; then summary; exit "$FAILED"; fi

PORT=$(free_port) || die "no free port"
ADMIN_PORT=$(free_port) || die "no free port"
check "runfeed migrate from the image, on an empty database" check_migrate
check "the demo image seeds an environment, a token and runs" check_demo_seed
check "serve: the container answers on --listen 127.0.0.1:$PORT" check_serves
check "admin listener: /healthz 200" check_admin /healthz
check "admin listener: /readyz 200 (Postgres and Redis reached)" check_admin /readyz
check "the server process runs as the non-root user (uid 10001)" check_non_root
check "the image's HEALTHCHECK passes inside the container (listen port $PORT)" check_healthcheck
check "/metrics: runfeed_build_info carries the build commit" check_build_info
check "a feed snapshot and a live poll with @electric-sql/client" check_client
check "SIGTERM answers the held poll and the container exits 0 within ${STOP_GRACE} s" check_drain
phase_done "run checks"

summary
exit "$FAILED"
