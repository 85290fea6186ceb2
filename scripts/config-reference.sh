#!/usr/bin/env bash
# Regenerates the configuration reference in README.md ("Deploy", between
# `<!-- config-reference:start -->` and `<!-- config-reference:end -->`) from the config struct
# (src/config.rs doc comments and defaults), i.e. the output of `runfeed config-reference`.
# tests/deploy/deploy.rs (readme_config_reference_is_current) fails while the README block is stale.
#
#   bash scripts/config-reference.sh           # rewrite README.md in place
#   bash scripts/config-reference.sh --check   # exit 1 when README.md is stale, change nothing
set -euo pipefail
cd "$(dirname "$0")/.."

CHECK=0
case "${1:-}" in
  --check) CHECK=1 ;;
  "") ;;
  *) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cargo run -q -- config-reference > "$tmp/reference.md"

awk -v ref="$tmp/reference.md" '
  /<!-- config-reference:start -->/ {
    print; print ""
    while ((getline line < ref) > 0) print line
    print ""
    skip = 1; start = 1; next
  }
  /<!-- config-reference:end -->/ { skip = 0; end = 1 }
  !skip { print }
  END { if (!start || !end) exit 3 }
' README.md > "$tmp/README.md" || {
  echo "config-reference: README.md lacks the config-reference:start/end markers" >&2
  exit 1
}

if cmp -s README.md "$tmp/README.md"; then
  echo "config-reference: README.md is up to date" >&2
elif [ "$CHECK" = 1 ]; then
  echo "config-reference: README.md is stale; run bash scripts/config-reference.sh" >&2
  diff -u README.md "$tmp/README.md" >&2 || true
  exit 1
else
  cp "$tmp/README.md" README.md
  echo "config-reference: README.md rewritten" >&2
fi
