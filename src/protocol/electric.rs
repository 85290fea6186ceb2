//! What the current Electric client (`@electric-sql/client` 1.5.x) sends and expects, beyond
//! what 1.0.14 does (docs/protocol.md §13). Pure.
//!
//! Sources: the 1.5.28 package (`npm pack @electric-sql/client@1.5.28`): `src/constants.ts`
//! (parameter names), `src/client.ts` (`#checkFastLoop`, `#withRequestTimeout`,
//! `#buildSubsetBody`), `src/shape-stream-state.ts` (`checkStaleResponse`); Electric's HTTP API
//! documentation, <https://electric-sql.com/docs/api/http>.

/// `live_sse=true` (1.5) or the deprecated `experimental_live_sse=true` (1.0.x, still sent by
/// 1.5 alongside): answer a live request as a server-sent event stream.
pub const LIVE_SSE_PARAMS: [&str; 2] = ["live_sse", "experimental_live_sse"];

/// `cache-buster=<random>`: sent when a response repeated a handle the client saw expire;
/// only there to make the URL unique for caches. Accepted and ignored.
pub const CACHE_BUSTER_PARAM: &str = "cache-buster";

/// Prefix of the subset-snapshot parameters (`subset__where`, `subset__limit`, …), which
/// runfeed does not serve.
pub const SUBSET_PREFIX: &str = "subset__";

/// The 1.5 client aborts a live long-poll after this long, ms (declared with the configuration
/// that must respect it).
pub use crate::config::CLIENT_LIVE_REQUEST_TIMEOUT_MS;

/// The 1.5 client's fast-loop detector: this many requests at one offset …
pub const FAST_LOOP_THRESHOLD: usize = 5;
/// … within this window, ms, make it clear its caches and reset (`#checkFastLoop`).
pub const FAST_LOOP_WINDOW_MS: u64 = 500;

/// The `log` parameter (sent by 1.0.14 and 1.5 on every request).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogMode {
    /// `log=full` (or absent): the snapshot carries every row.
    #[default]
    Full,
    /// `log=changes_only`: the snapshot carries no rows; changes after it are delivered as
    /// usual (Electric's semantics).
    ChangesOnly,
}

impl LogMode {
    /// `full` / `changes_only`; anything else is `None`.
    pub fn parse(raw: &str) -> Option<LogMode> {
        match raw {
            "full" => Some(LogMode::Full),
            "changes_only" => Some(LogMode::ChangesOnly),
            _ => None,
        }
    }
}

/// Whether the query parameter `key` asks for a subset snapshot.
pub fn is_subset_param(key: &str) -> bool {
    key.starts_with(SUBSET_PREFIX)
}

/// The parameter named in the 400 for a subset request sent as a POST body (`subsetMethod:
/// 'POST'`: a JSON object with `where`, `params`, `limit`, `offset`, `order_by`,
/// `where_expr`, `order_by_expr`): `subset__<first key>` in sorted order, or `subset__*` when
/// the body is empty or not a JSON object.
pub fn subset_body_param(body: &[u8]) -> String {
    let first = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.as_object().and_then(|o| {
                let mut keys: Vec<&String> = o.keys().collect();
                keys.sort();
                keys.first().map(|k| k.chars().take(64).collect::<String>())
            })
        });
    format!("{SUBSET_PREFIX}{}", first.as_deref().unwrap_or("*"))
}

/// The 400 message for a subset request naming `param`.
pub fn subset_refusal(param: &str) -> String {
    format!(
        "{param}: subset snapshots are not supported by this server; request the whole feed \
         (without subset__* parameters)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_modes() {
        assert_eq!(LogMode::parse("full"), Some(LogMode::Full));
        assert_eq!(LogMode::parse("changes_only"), Some(LogMode::ChangesOnly));
        assert_eq!(LogMode::parse("FULL"), None);
        assert_eq!(LogMode::default(), LogMode::Full);
    }

    #[test]
    fn subset_params_and_bodies_are_named() {
        assert!(is_subset_param("subset__where"));
        assert!(!is_subset_param("where"));
        assert_eq!(
            subset_body_param(br#"{"where":"x","limit":1}"#),
            "subset__limit"
        );
        assert_eq!(subset_body_param(b"{}"), "subset__*");
        assert_eq!(subset_body_param(b"not json"), "subset__*");
        assert!(subset_refusal("subset__limit").starts_with("subset__limit"));
    }

    #[test]
    fn the_client_watchdog_is_longer_than_any_default_hold() {
        let f = crate::config::FeedsConfig::default();
        assert!(f.max_hold_ms() < CLIENT_LIVE_REQUEST_TIMEOUT_MS);
    }
}
