#!/usr/bin/env bash
# The end-to-end browser test: the live-runs page (tests/browser/src, React + Vite, the real
# @trigger.dev/react-hooks) in Debian's headless chromium, driven by playwright-core, against a real
# `runfeed serve`, from another loopback origin (so CORS is real).
#   bash scripts/browser.sh
# Then many feeds on one page over HTTP/2: tests/browser/many-feeds.test.mjs, 12 live run feeds
# through the nginx recipe's TLS listener (deploy/proxies/nginx/runfeed.conf).
# Installs what it needs: Debian's chromium (if /usr/bin/chromium is missing) and nginx (through
# scripts/proxies.sh install), the npm packages of tests/browser and tests/e2e (npm ci), the runfeed
# debug binary (cargo build, if missing); builds the page (vite build); runs
# tests/browser/browser.test.mjs and tests/browser/many-feeds.test.mjs. Screenshot:
# target/test-logs/browser.png.
# Env: BROWSER_TIMEOUT (seconds for the test run, default 180), BROWSER_UPDATE_SCREENSHOT=1 (also
# refresh tests/browser/screenshot.png, the README's picture), E2E_RUNFEED_BIN (runfeed binary).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
LOG_DIR="$TARGET_DIR/test-logs"
mkdir -p "$LOG_DIR"
say() { printf -- '--> %s\n' "$*"; }

if [ ! -x /usr/bin/chromium ]; then
  say "apt-get install chromium (Debian)"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO=sudo
  $SUDO apt-get update -qq || exit 1
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >"$LOG_DIR/apt-chromium.log" 2>&1 ||
    { tail -20 "$LOG_DIR/apt-chromium.log"; exit 1; }
fi
/usr/bin/chromium --version 2>/dev/null || true
PROXIES=nginx bash scripts/proxies.sh install || exit 1

npm_ci() { # dir
  if [ ! -d "$1/node_modules" ] || [ "$1/package-lock.json" -nt "$1/node_modules/.package-lock.json" ]; then
    say "npm ci ($1)"
    npm ci --prefix "$1" --no-audit --no-fund --loglevel=error || return 1
  fi
}
npm_ci tests/e2e || exit 1     # ../e2e/lib.mjs (pg) is shared with the e2e suite
npm_ci tests/browser || exit 1

BIN="${E2E_RUNFEED_BIN:-$TARGET_DIR/debug/runfeed}"
if [ ! -x "$BIN" ]; then
  say "cargo build --locked (no $BIN)"
  cargo build --locked || exit 1
fi

say "vite build (tests/browser -> tests/browser/dist)"
(cd tests/browser && npx --no-install vite build) || exit 1

say "node --test tests/browser/browser.test.mjs tests/browser/many-feeds.test.mjs"
cd tests/browser || exit 1
E2E_RUNFEED_BIN="$BIN" timeout --kill-after=15 "${BROWSER_TIMEOUT:-180}" \
  node --test --test-concurrency=1 --test-timeout=120000 --test-force-exit --test-reporter=spec browser.test.mjs many-feeds.test.mjs 2>&1 |
  tee "$LOG_DIR/browser.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 124 ] && echo "browser: the test run exceeded ${BROWSER_TIMEOUT:-180}s and was killed"
[ -f "$LOG_DIR/browser.png" ] && echo "screenshot: $LOG_DIR/browser.png"
exit "$rc"
