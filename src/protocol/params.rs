//! Request-parameter grammars taken from trigger.dev (docs/trigger-dev.md §3).

/// Parses trigger's natural-language duration (`safeParseNaturalLanguageDurationAgo`):
/// `^(\d+(w|d|hr|h|m|s))+$`, lowercase, ≤ 100 chars, only the first occurrence of each unit
/// counts (`1h1h` = 1h, `30m2h` = 2h30m). Returns the duration in ms, `None` if invalid.
///
/// Mirrors `parseNaturalLanguageDurationAgo` (`packages/core/src/v3/isomorphic/duration.ts`):
/// units are `w` (7 d), `d`, `h`/`hr` (one unit, hours), `m` (minutes), `s`; `0h` → `Some(0)`;
/// no spaces, signs, decimals, upper case, `ms`, `mo` or `y`. Numbers too large for `u64`
/// milliseconds saturate to `u64::MAX` (the caller clamps to its maximum age anyway).
pub fn parse_duration_ms(raw: &str) -> Option<u64> {
    const MAX_LEN: usize = 100;
    if raw.is_empty() || raw.len() > MAX_LEN {
        return None;
    }
    // unit slots: weeks, days, hours, minutes, seconds
    const UNIT_MS: [u64; 5] = [7 * 24 * 3_600_000, 24 * 3_600_000, 3_600_000, 60_000, 1_000];
    let mut first: [Option<u64>; 5] = [None; 5];
    let bytes = raw.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        let mut n: u64 = 0;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            n = n
                .saturating_mul(10)
                .saturating_add(u64::from(bytes[i] - b'0'));
            i += 1;
        }
        if i == start {
            return None; // a unit without digits, or a stray character
        }
        let slot = match bytes.get(i) {
            Some(b'w') => 0,
            Some(b'd') => 1,
            Some(b'h') => {
                if bytes.get(i + 1) == Some(&b'r') {
                    i += 1;
                }
                2
            }
            Some(b'm') => 3,
            Some(b's') => 4,
            _ => return None,
        };
        i += 1;
        // Only the first occurrence of each unit counts (`String.match` without /g).
        first[slot].get_or_insert(n);
    }
    let mut total: u64 = 0;
    for (value, unit) in first.iter().zip(UNIT_MS) {
        if let Some(v) = value {
            total = total.saturating_add(v.saturating_mul(unit));
        }
    }
    Some(total)
}

/// A tag that trigger refuses: empty, or containing `[\x00-\x1f\x7f\\"]`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("Invalid tag: {0:?}")]
pub struct InvalidTag(pub String);

/// Splits the `tags` parameter on `,` (no trimming, case-sensitive). Absent or empty → no
/// filter (`Ok(vec![])`). Reports the first invalid tag.
///
/// Source: the list route's `tags` schema, which applies `UNSAFE_REALTIME_TAG_CHARS =
/// /[\x00-\x1f\x7f\\"]/` (`v3/electricShape.server.ts`); single quotes and non-ASCII pass.
pub fn parse_tags(raw: Option<&str>) -> Result<Vec<String>, InvalidTag> {
    let raw = match raw {
        None | Some("") => return Ok(Vec::new()),
        Some(raw) => raw,
    };
    let mut tags = Vec::new();
    for tag in raw.split(',') {
        if !is_valid_tag(tag) {
            return Err(InvalidTag(tag.to_string()));
        }
        tags.push(tag.to_string());
    }
    Ok(tags)
}

/// Whether trigger accepts `tag` in a tag filter: non-empty and free of C0 controls, DEL,
/// backslash and double quote.
pub fn is_valid_tag(tag: &str) -> bool {
    !tag.is_empty()
        && !tag
            .bytes()
            .any(|b| b <= 0x1f || b == 0x7f || b == b'\\' || b == b'"')
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const H: u64 = 3_600_000;
    const M: u64 = 60_000;

    #[test]
    fn duration_examples() {
        assert_eq!(parse_duration_ms("2h"), Some(2 * H));
        assert_eq!(parse_duration_ms("1hr30m"), Some(H + 30 * M));
        assert_eq!(parse_duration_ms("1w2d"), Some(9 * 24 * H));
        assert_eq!(parse_duration_ms("90m"), Some(90 * M));
        assert_eq!(parse_duration_ms("45s"), Some(45_000));
        assert_eq!(parse_duration_ms("0h"), Some(0));
        assert_eq!(parse_duration_ms("24h"), Some(86_400_000));
        assert_eq!(parse_duration_ms("007m"), Some(7 * M));
    }

    #[test]
    fn duration_first_occurrence_of_each_unit_counts() {
        assert_eq!(parse_duration_ms("1h1h"), Some(H));
        assert_eq!(parse_duration_ms("30m2h"), Some(2 * H + 30 * M));
        assert_eq!(parse_duration_ms("1hr2h"), Some(H));
        assert_eq!(parse_duration_ms("2h1hr"), Some(2 * H));
        assert_eq!(parse_duration_ms("1s2s3m"), Some(1_000 + 3 * M));
    }

    #[test]
    fn duration_rejects_outside_grammar() {
        let long = "1h".repeat(51);
        for bad in [
            "", "h", "1", "1H", "1 h", " 1h", "1h ", "1.5h", "-1h", "+1h", "1y", "1ms", "1mo",
            "1hrr", "1h,", "１h", "1x", &long,
        ] {
            assert_eq!(parse_duration_ms(bad), None, "{bad:?}");
        }
        assert_eq!(parse_duration_ms(&"1h".repeat(50)), Some(H));
    }

    #[test]
    fn duration_huge_numbers_saturate() {
        assert_eq!(
            parse_duration_ms("99999999999999999999999999w"),
            Some(u64::MAX)
        );
        assert_eq!(parse_duration_ms("18446744073709551615s1w"), Some(u64::MAX));
    }

    #[test]
    fn tags_absent_or_empty_means_no_filter() {
        assert_eq!(parse_tags(None), Ok(vec![]));
        assert_eq!(parse_tags(Some("")), Ok(vec![]));
    }

    #[test]
    fn tags_split_without_trimming() {
        assert_eq!(
            parse_tags(Some("a, b")),
            Ok(vec!["a".to_string(), " b".to_string()])
        );
        assert_eq!(parse_tags(Some("user:1")), Ok(vec!["user:1".to_string()]));
        assert_eq!(
            parse_tags(Some("it's,é,A")),
            Ok(vec!["it's".into(), "é".into(), "A".into()])
        );
    }

    #[test]
    fn tags_reject_empty_and_unsafe_reporting_first() {
        assert_eq!(parse_tags(Some("a,,b")), Err(InvalidTag(String::new())));
        assert_eq!(parse_tags(Some("a,")), Err(InvalidTag(String::new())));
        assert_eq!(parse_tags(Some(",")), Err(InvalidTag(String::new())));
        assert_eq!(
            parse_tags(Some("ok,x\"y,z\\w")),
            Err(InvalidTag("x\"y".into()))
        );
        assert_eq!(parse_tags(Some("a\\b")), Err(InvalidTag("a\\b".into())));
        assert_eq!(
            parse_tags(Some("tab\there")),
            Err(InvalidTag("tab\there".into()))
        );
        assert_eq!(
            parse_tags(Some("del\u{7f}")),
            Err(InvalidTag("del\u{7f}".into()))
        );
        assert_eq!(
            parse_tags(Some("nul\u{0}")),
            Err(InvalidTag("nul\u{0}".into()))
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn duration_never_panics(s in any::<String>()) {
            let _ = parse_duration_ms(&s);
        }

        #[test]
        fn duration_never_panics_on_grammar_like_input(s in "([0-9]{0,25}(w|d|hr|h|m|s|r|x)?){0,8}") {
            let _ = parse_duration_ms(&s);
        }

        #[test]
        fn duration_single_token_matches_unit(n in 0u64..1_000_000, unit in prop_oneof![
            Just(("w", 604_800_000u64)), Just(("d", 86_400_000)), Just(("h", H)), Just(("hr", H)),
            Just(("m", M)), Just(("s", 1_000)),
        ]) {
            prop_assert_eq!(parse_duration_ms(&format!("{n}{}", unit.0)), Some(n * unit.1));
        }

        #[test]
        fn tags_never_panic(s in any::<String>()) {
            let _ = parse_tags(Some(&s));
        }
    }
}
