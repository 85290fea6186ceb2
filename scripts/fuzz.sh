#!/usr/bin/env bash
# cargo-fuzz targets of tests/fuzz : request params, change-record decoding, handle
# verification, bearer/JWT parsing. Runs each target for a bounded time; exits non-zero on a crash
# (the crashing input is left in tests/fuzz/artifacts/<target>/ — pin it as a regression case in
# tests/fuzz_props.rs).
#   bash scripts/fuzz.sh [target ...]        FUZZ_SECONDS=20 per target by default
# Only the stable toolchain exists here: libFuzzer's -Z flags are enabled with RUSTC_BOOTSTRAP=1.
# scripts/test.sh runs it last. FUZZ_SANITIZER (default none: coverage-guided libFuzzer without
# ASan, which builds and runs several times faster; runfeed has no unsafe code of its own)
# may be set to address for a deeper local run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECONDS_PER_TARGET="${FUZZ_SECONDS:-20}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}/fuzz"
export RUSTC_BOOTSTRAP=1
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(params change_record handle jwt)
SANITIZER="${FUZZ_SANITIZER:-none}"
cargo fuzz build --fuzz-dir tests/fuzz -O --sanitizer "$SANITIZER"
failed=0
for t in "${targets[@]}"; do
  echo "==> fuzz $t (${SECONDS_PER_TARGET}s)"
  if ! timeout --kill-after=10 $((SECONDS_PER_TARGET + 600)) \
      cargo fuzz run --fuzz-dir tests/fuzz -O --sanitizer "$SANITIZER" "$t" -- \
        -max_total_time="$SECONDS_PER_TARGET" -max_len=4096 -timeout=5 -rss_limit_mb=2048; then
    echo "FAIL: fuzz target $t (artifacts: tests/fuzz/artifacts/$t/)"
    failed=1
  fi
done
[ "$failed" -eq 0 ] && echo "fuzz: all targets ran without a crash"
exit "$failed"
