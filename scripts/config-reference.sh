#!/usr/bin/env bash
# Regenerates the two references generated from the code:
#   - the configuration reference in docs/configuration.md (between `<!-- config-reference:start -->`
#     and `<!-- config-reference:end -->`), the output of `runfeed config-reference` (src/config.rs);
#   - the metric reference in docs/observability.md (between `<!-- metrics-reference:start -->` and
#     `<!-- metrics-reference:end -->`), the output of `runfeed metrics-reference` (src/telemetry).
# tests/it/docs.rs fails while either block is stale.
#
#   bash scripts/config-reference.sh           # rewrite both blocks in place
#   bash scripts/config-reference.sh --check   # exit 1 when a block is stale, change nothing
set -euo pipefail
cd "$(dirname "$0")/.."

CHECK=0
case "${1:-}" in
  --check) CHECK=1 ;;
  "") ;;
  *) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
stale=0

# rewrite FILE MARKER COMMAND: replace FILE's MARKER block with the output of `runfeed COMMAND`.
rewrite() {
  local file=$1 marker=$2 command=$3
  cargo run -q -- "$command" > "$tmp/$marker.md"
  awk -v ref="$tmp/$marker.md" -v start="<!-- $marker:start -->" -v end="<!-- $marker:end -->" '
    $0 == start {
      print; print ""
      while ((getline line < ref) > 0) print line
      print ""
      skip = 1; found_start = 1; next
    }
    $0 == end { skip = 0; found_end = 1 }
    !skip { print }
    END { if (!found_start || !found_end) exit 3 }
  ' "$file" > "$tmp/out.md" || {
    echo "$marker: $file lacks the $marker:start/end markers" >&2
    exit 1
  }
  if cmp -s "$file" "$tmp/out.md"; then
    echo "$marker: $file is up to date" >&2
  elif [ "$CHECK" = 1 ]; then
    echo "$marker: $file is stale; run bash scripts/config-reference.sh" >&2
    diff -u "$file" "$tmp/out.md" >&2 || true
    stale=1
  else
    cp "$tmp/out.md" "$file"
    echo "$marker: $file rewritten" >&2
  fi
}

rewrite docs/configuration.md config-reference config-reference
rewrite docs/observability.md metrics-reference metrics-reference
exit "$stale"
