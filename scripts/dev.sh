#!/usr/bin/env bash
# Local demo: services, build, migrate, `runfeed serve` on 127.0.0.1:3030 in the background and
# `runfeed-demo` in the foreground (a seeded environment plus a live workload). Ctrl-C stops both.
#   bash scripts/dev.sh
# Env: RUNFEED_DEV_PORT (default 3030), RUNFEED_DEV_DB (default runfeed_demo),
#      RUNFEED_PROFILE=release for an optimised build (default: debug, which builds much faster
#      on a fresh machine and shares its artifacts with scripts/test.sh).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
PORT="${RUNFEED_DEV_PORT:-3030}"
BASE_URL="http://127.0.0.1:${PORT}"
DATABASE_URL="postgres://postgres@127.0.0.1:5432/${RUNFEED_DEV_DB:-runfeed_demo}"
REDIS_URL="redis://127.0.0.1:6379"
PROFILE="${RUNFEED_PROFILE:-debug}"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
LOG="$TARGET_DIR/dev-serve.log"

say() { printf '\n==> %s\n' "$*"; }

say "services (postgres, redis)"
bash scripts/services.sh

say "cargo build ($PROFILE)"
if [ "$PROFILE" = release ]; then cargo build --release --locked; else cargo build --locked; fi
BIN="$TARGET_DIR/$PROFILE/runfeed"
DEMO_BIN="$TARGET_DIR/$PROFILE/runfeed-demo"

say "npm ci (tests/e2e: the real clients, for tests/e2e/watch.mjs)"
if [ ! -d tests/e2e/node_modules ] || [ tests/e2e/package-lock.json -nt tests/e2e/node_modules/.package-lock.json ]; then
  npm ci --prefix tests/e2e --no-audit --no-fund --loglevel=error
else
  echo "up to date"
fi

say "live runs page (tests/browser: React + @trigger.dev/react-hooks, built with vite)"
PAGE_OK=0
if (cd tests/browser && { [ -d node_modules ] && [ package-lock.json -ot node_modules/.package-lock.json ] || npm ci --no-audit --no-fund --loglevel=error; } && npx vite build --logLevel error); then
  PAGE_OK=1
else
  echo "could not build the page (the feeds still work; see tests/browser)" >&2
fi
PAGE_PID_FILE="$TARGET_DIR/dev-page.pid"

say "runfeed migrate ($DATABASE_URL)"
"$BIN" migrate --database-url "$DATABASE_URL"

if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
  echo "port $PORT is already in use (another runfeed?); stop it or set RUNFEED_DEV_PORT" >&2
  exit 1
fi

say "runfeed serve on $BASE_URL (log: $LOG)"
mkdir -p "$(dirname "$LOG")"
"$BIN" serve --listen "127.0.0.1:$PORT" --database-url "$DATABASE_URL" --redis-url "$REDIS_URL" >"$LOG" 2>&1 &
SERVER_PID=$!
cleanup() {
  if [ -f "$PAGE_PID_FILE" ]; then kill "$(cat "$PAGE_PID_FILE")" 2>/dev/null || true; rm -f "$PAGE_PID_FILE"; fi
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

deadline=$((SECONDS + 30))
until grep -q '^runfeed listening on ' "$LOG" 2>/dev/null; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "runfeed serve exited early:" >&2; cat "$LOG" >&2; exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "runfeed serve did not start within 30s:" >&2; cat "$LOG" >&2; exit 1
  fi
  sleep 0.2
done
grep -m1 '^runfeed listening on ' "$LOG"

say "runfeed-demo (Ctrl-C to stop the workload and the server)"
# The demo prints ENV_ID= / PUBLIC_TOKEN= / RUN_ID= / BATCH_ID= / TAG= lines first; once they are
# all there, add the commands that watch the same feeds through the real trigger.dev SDK.
"$DEMO_BIN" --database-url "$DATABASE_URL" --redis-url "$REDIS_URL" --base-url "$BASE_URL" |
  {
    token="" run="" batch="" tag="" shown=0
    while IFS= read -r line; do
      printf '%s\n' "$line"
      case $line in
        PUBLIC_TOKEN=*) token=${line#PUBLIC_TOKEN=} ;;
        RUN_ID=*) run=${line#RUN_ID=} ;;
        BATCH_ID=*) batch=${line#BATCH_ID=} ;;
        TAG=*) tag=${line#TAG=} ;;
      esac
      if [ "$shown" -eq 0 ] && [ -n "$token" ] && [ -n "$run" ] && [ -n "$batch" ] && [ -n "$tag" ]; then
        shown=1
        if [ "$PAGE_OK" = 1 ]; then
          PAGE_LOG="$TARGET_DIR/dev-page.log"
          node tests/browser/serve.mjs --base-url "$BASE_URL" --token "$token" --run "$run" --tag "$tag" --batch "$batch" --port "${RUNFEED_DEV_PAGE_PORT:-5173}" >"$PAGE_LOG" 2>&1 &
          echo $! >"$PAGE_PID_FILE"
          for _ in $(seq 50); do grep -q '^live runs page:' "$PAGE_LOG" 2>/dev/null && break; sleep 0.1; done
          printf '\n--- open in a browser: the runs changing live ---\n  %s\n' "$(grep -m1 '^live runs page:' "$PAGE_LOG" | sed 's/^live runs page: //')"
        fi
        cat <<HINT

--- watch with the real @trigger.dev/sdk (in another terminal, from $ROOT) ---
  node tests/e2e/watch.mjs --base-url $BASE_URL --token $token --run $run
  node tests/e2e/watch.mjs --base-url $BASE_URL --token $token --tag $tag
  node tests/e2e/watch.mjs --base-url $BASE_URL --token $token --batch $batch
  (add --shape to print raw @electric-sql/client messages instead of SDK run objects)
------------------------------------------------------------------------------

HINT
      fi
    done
  }
