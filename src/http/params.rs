//! Query parsing: the parameters of a feed request's query string that runfeed reads, decoded
//! as `URLSearchParams` does (WHATWG `application/x-www-form-urlencoded`, the `form_urlencoded`
//! crate), and the `log` mode they ask for. What the values mean (offsets, tags, durations) is
//! parsed by `protocol`.

use std::borrow::Cow;

use crate::protocol::electric::{self, LogMode};
use crate::protocol::headers::ClientGeneration;

use super::ApiError;

/// The query parameters of a feed request, as sent (validated by the handlers).
#[derive(Default)]
pub(super) struct Params {
    /// `offset`.
    pub(super) offset: Option<String>,
    /// `handle`, else the legacy `shape_id`; `None` when empty.
    pub(super) handle: Option<String>,
    /// `live=true`.
    pub(super) live: bool,
    /// `cursor`.
    pub(super) cursor: Option<String>,
    /// `tags` (tag feeds).
    pub(super) tags: Option<String>,
    /// `createdAt` (tag feeds).
    pub(super) created_at: Option<String>,
    /// `skipColumns`.
    pub(super) skip_columns: Option<String>,
    /// `log` as sent (`full`, `changes_only`, or something refused).
    pub(super) log: Option<String>,
    /// `live_sse=true` or `experimental_live_sse=true`.
    pub(super) sse: bool,
    /// The first `subset__*` parameter, which is refused (docs/protocol.md §13.1).
    pub(super) subset: Option<String>,
}

/// The `(key, value)` pairs of `raw`, percent- and `+`-decoded, invalid UTF-8 replaced (WHATWG
/// `application/x-www-form-urlencoded` parsing, as `URLSearchParams` does; empty pairs skipped,
/// a pair without `=` has an empty value).
///
/// A query without `%` or `+` (what the clients send: ids, offsets and handles are URL-safe)
/// decodes to itself, so its pairs are split and borrowed without the decoder, which costs
/// about 800 instructions per key or value (BENCHMARKS.md "Cost per unit of work"); any other
/// query goes through `form_urlencoded`.
fn pairs(raw: &str) -> impl Iterator<Item = (Cow<'_, str>, Cow<'_, str>)> {
    let plain = memchr::memchr2(b'%', b'+', raw.as_bytes()).is_none();
    let (mut rest, decoded) = if plain {
        (raw, None)
    } else {
        ("", Some(form_urlencoded::parse(raw.as_bytes())))
    };
    // Split at `&` and the first `=` (ASCII, so every cut is a char boundary).
    let split = std::iter::from_fn(move || loop {
        if rest.is_empty() {
            return None;
        }
        let end = memchr::memchr(b'&', rest.as_bytes()).unwrap_or(rest.len());
        let pair = &rest[..end];
        rest = rest.get(end + 1..).unwrap_or("");
        if !pair.is_empty() {
            let (k, v) = match memchr::memchr(b'=', pair.as_bytes()) {
                Some(at) => (&pair[..at], &pair[at + 1..]),
                None => (pair, ""),
            };
            return Some((Cow::Borrowed(k), Cow::Borrowed(v)));
        }
    });
    split.chain(decoded.into_iter().flatten())
}

impl Params {
    /// Query parameters; a repeated key keeps its last value (`Object.fromEntries`); unknown
    /// keys (`expired_handle`, `table`, `cache-buster`, …) are ignored.
    pub(super) fn parse(raw: Option<&str>) -> Params {
        let mut p = Params::default();
        let mut shape_id = None;
        for (k, v) in pairs(raw.unwrap_or("")) {
            let slot = match &*k {
                "offset" => &mut p.offset,
                "handle" => &mut p.handle,
                "shape_id" => &mut shape_id,
                "live" => {
                    p.live = v == "true";
                    continue;
                }
                "cursor" => &mut p.cursor,
                "tags" => &mut p.tags,
                "createdAt" => &mut p.created_at,
                "skipColumns" => &mut p.skip_columns,
                "log" => &mut p.log,
                k if electric::LIVE_SSE_PARAMS.contains(&k) => {
                    p.sse |= v == "true";
                    continue;
                }
                k if electric::is_subset_param(k) => {
                    p.subset.get_or_insert_with(|| k.chars().take(64).collect());
                    continue;
                }
                _ => continue,
            };
            *slot = Some(v.into_owned());
        }
        p.handle = p.handle.or(shape_id).filter(|h| !h.is_empty());
        p
    }

    /// The `log` mode; an unknown value is a 400 naming it.
    pub(super) fn log_mode(&self, client: ClientGeneration) -> Result<LogMode, ApiError> {
        match self.log.as_deref() {
            None => Ok(LogMode::Full),
            Some(raw) => LogMode::parse(raw).ok_or_else(|| {
                ApiError::bad_request(
                    client,
                    format!(
                        "Invalid log {:?}: expected full or changes_only",
                        raw.chars().take(64).collect::<String>()
                    ),
                )
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decoded value of the last `key=` pair of `raw`, by the reference decoder.
    fn last(raw: &str, key: &str) -> Option<String> {
        form_urlencoded::parse(raw.as_bytes())
            .filter(|(k, _)| k == key)
            .last()
            .map(|(_, v)| v.into_owned())
    }

    proptest::proptest! {
        /// Every parameter is decoded exactly as `URLSearchParams` (the `form_urlencoded`
        /// crate) decodes it, the last of repeated keys winning: percent-escapes (partial and
        /// invalid ones too), `+` as a space, empty pairs and pairs without `=`.
        #[test]
        fn query_params_decode_like_url_search_params(
            parts in proptest::collection::vec(
                proptest::sample::select(vec![
                    "offset=", "cursor=", "tags=", "log=", "createdAt=", "skipColumns=",
                    "offs%65t=", "&", "=", "+", "%", "%2", "%20", "%2B", "%26", "%3D", "%C3%A9",
                    "%FF", "a", "é", "_", "-1", "0_0",
                ]),
                0..24,
            ),
        ) {
            let raw = parts.concat();
            let p = Params::parse(Some(&raw));
            proptest::prop_assert_eq!(p.offset, last(&raw, "offset"));
            proptest::prop_assert_eq!(p.cursor, last(&raw, "cursor"));
            proptest::prop_assert_eq!(p.tags, last(&raw, "tags"));
            proptest::prop_assert_eq!(p.log, last(&raw, "log"));
            proptest::prop_assert_eq!(p.created_at, last(&raw, "createdAt"));
            proptest::prop_assert_eq!(p.skip_columns, last(&raw, "skipColumns"));
        }
    }

    proptest::proptest! {
        /// A query without `%` or `+` is split without the decoder: its pairs equal the
        /// decoder's, in order (empty pairs, pairs without `=`, `=` inside a value, non-ASCII).
        #[test]
        fn a_plain_query_splits_into_the_decoders_pairs(
            parts in proptest::collection::vec(
                proptest::sample::select(vec![
                    "offset=", "handle=", "live=", "&", "=", "a", "é", "_", "-1", "0_0", "true",
                ]),
                0..24,
            ),
        ) {
            let raw = parts.concat();
            let ours: Vec<(String, String)> =
                pairs(&raw).map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
            let reference: Vec<(String, String)> = form_urlencoded::parse(raw.as_bytes())
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect();
            proptest::prop_assert_eq!(ours, reference);
        }
    }

    #[test]
    fn query_params_are_percent_and_plus_decoded() {
        let p = Params::parse(Some("tags=a%2Cb+c&cursor=%F0%9F%98%80&log=%FF&&offset"));
        assert_eq!(p.tags.as_deref(), Some("a,b c"));
        assert_eq!(p.cursor.as_deref(), Some("\u{1F600}"));
        assert_eq!(p.log.as_deref(), Some("\u{FFFD}"));
        assert_eq!(p.offset.as_deref(), Some(""));
    }

    #[test]
    fn req_01_params_last_value_wins_and_shape_id_is_the_legacy_handle() {
        let p = Params::parse(Some(
            "offset=1_2&offset=3_4&shape_id=h&live=true&cursor=&log=full&expired_handle=x",
        ));
        assert_eq!(p.offset.as_deref(), Some("3_4"));
        assert_eq!(p.handle.as_deref(), Some("h"));
        assert!(p.live);
        assert_eq!(p.cursor.as_deref(), Some(""));
        let p = Params::parse(Some("live=1&handle="));
        assert!(!p.live, "live only when exactly true");
        assert_eq!(p.handle, None);
    }
}
