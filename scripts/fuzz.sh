#!/usr/bin/env bash
# cargo-fuzz targets of tests/fuzz : request params, change-record decoding, handle
# verification, bearer/JWT parsing. Runs each target for a bounded time; exits non-zero on a crash
# (the crashing input is left in tests/fuzz/artifacts/<target>/ — pin it as a regression case in
# tests/it/fuzz_props.rs).
#   bash scripts/fuzz.sh [target ...]        FUZZ_SECONDS=20 per target by default
#   FUZZ_BUILD_ONLY=1 bash scripts/fuzz.sh   install cargo-fuzz if missing and build, run nothing
# scripts/test.sh builds in the background during its end-to-end steps and runs the targets last.
#
# What keeps a cold run short (a clean clone builds the instrumented crate from nothing):
# - cargo-fuzz is installed only when missing, at a pinned version (CARGO_FUZZ_VERSION).
# - Only the stable toolchain is needed: libFuzzer's -Z flags are enabled with RUSTC_BOOTSTRAP=1.
# - One `cargo fuzz build` builds every target; each `cargo fuzz run` then finds them fresh
#   (the same flags: other flags would rebuild).
# - Only the code the targets run is optimized; the rest of runfeed's dependency tree is
#   compiled at opt-level 0 (tests/fuzz/Cargo.toml, [profile.release.package]).
# - FUZZ_SANITIZER (default none: coverage-guided libFuzzer without ASan, which builds and runs
#   several times faster; runfeed's only unsafe code is the madvise call in src/http/serve.rs,
#   which no target reaches) may be set to address for a deeper local run.
# - Debug assertions are on (-a): integer overflow and debug_assert! failures count as crashes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECONDS_PER_TARGET="${FUZZ_SECONDS:-20}"
CARGO_FUZZ_VERSION="${CARGO_FUZZ_VERSION:-0.13.2}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}/fuzz"
export RUSTC_BOOTSTRAP=1
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(params change_record handle jwt)
FLAGS=(--fuzz-dir tests/fuzz -O -a --sanitizer "${FUZZ_SANITIZER:-none}")
t0=$SECONDS
cargo fuzz build "${FLAGS[@]}"
echo "fuzz: targets built in $((SECONDS - t0)) s"
[ "${FUZZ_BUILD_ONLY:-0}" = 1 ] && exit 0
failed=0
for t in "${targets[@]}"; do
  echo "==> fuzz $t (${SECONDS_PER_TARGET}s)"
  if ! timeout --kill-after=10 $((SECONDS_PER_TARGET + 600)) \
      cargo fuzz run "${FLAGS[@]}" "$t" -- \
        -max_total_time="$SECONDS_PER_TARGET" -max_len=4096 -timeout=5 -rss_limit_mb=2048; then
    echo "FAIL: fuzz target $t (artifacts: tests/fuzz/artifacts/$t/)"
    failed=1
  fi
done
[ "$failed" -eq 0 ] && echo "fuzz: all targets ran without a crash"
exit "$failed"
