//! Request-parameter grammars taken from trigger.dev (trigger-facts §3). STUB.

/// Parses trigger's natural-language duration (`safeParseNaturalLanguageDurationAgo`):
/// `^(\d+(w|d|hr|h|m|s))+$`, lowercase, ≤ 100 chars, only the first occurrence of each unit
/// counts (`1h1h` = 1h, `30m2h` = 2h30m). Returns the duration in ms, `None` if invalid.
pub fn parse_duration_ms(raw: &str) -> Option<u64> {
    let _ = raw;
    unimplemented!("protocol helper")
}

/// A tag that trigger refuses: empty, or containing `[\x00-\x1f\x7f\\"]`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("Invalid tag: {0:?}")]
pub struct InvalidTag(pub String);

/// Splits the `tags` parameter on `,` (no trimming, case-sensitive). Absent or empty → no
/// filter (`Ok(vec![])`). Reports the first invalid tag.
pub fn parse_tags(raw: Option<&str>) -> Result<Vec<String>, InvalidTag> {
    let _ = raw;
    unimplemented!("protocol helper")
}
