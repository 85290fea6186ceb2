//! Electric response headers, modern vs legacy names (docs/protocol.md §1, §3.2, §8).
//!
//! Modern clients (request carried `x-trigger-electric-version`, docs/trigger-dev.md §3) get
//! `electric-handle` / `electric-offset` / `electric-cursor` / `electric-schema` /
//! `electric-up-to-date`; legacy clients get `electric-shape-id` / `electric-chunk-last-offset` /
//! `electric-cursor` + `electric-next-cursor` / `electric-schema` / `electric-chunk-up-to-date`
//! (+ `electric-up-to-date`), and never the modern handle/offset names (docs/behaviours.md HDR-02).

use super::ids::Handle;
use http::header::{HeaderName, HeaderValue, InvalidHeaderValue};
use http::HeaderMap;

/// `electric-handle` (modern).
pub const ELECTRIC_HANDLE: HeaderName = HeaderName::from_static("electric-handle");
/// `electric-offset` (modern).
pub const ELECTRIC_OFFSET: HeaderName = HeaderName::from_static("electric-offset");
/// `electric-cursor` (both).
pub const ELECTRIC_CURSOR: HeaderName = HeaderName::from_static("electric-cursor");
/// `electric-schema` (both).
pub const ELECTRIC_SCHEMA: HeaderName = HeaderName::from_static("electric-schema");
/// `electric-up-to-date` (both; only presence matters to clients, docs/protocol.md §3.3).
pub const ELECTRIC_UP_TO_DATE: HeaderName = HeaderName::from_static("electric-up-to-date");
/// `electric-shape-id` (legacy handle).
pub const ELECTRIC_SHAPE_ID: HeaderName = HeaderName::from_static("electric-shape-id");
/// `electric-chunk-last-offset` (legacy offset).
pub const ELECTRIC_CHUNK_LAST_OFFSET: HeaderName =
    HeaderName::from_static("electric-chunk-last-offset");
/// `electric-next-cursor` (legacy cursor, 0.6.3).
pub const ELECTRIC_NEXT_CURSOR: HeaderName = HeaderName::from_static("electric-next-cursor");
/// `electric-chunk-up-to-date` (legacy up-to-date, read by the 0.6.3 prefetcher).
pub const ELECTRIC_CHUNK_UP_TO_DATE: HeaderName =
    HeaderName::from_static("electric-chunk-up-to-date");

/// Value of the up-to-date headers. Clients test presence only; a non-empty value survives
/// proxies that drop empty headers.
const UP_TO_DATE_VALUE: HeaderValue = HeaderValue::from_static("true");

fn put(headers: &mut HeaderMap, name: HeaderName, value: Result<HeaderValue, InvalidHeaderValue>) {
    match value {
        Ok(v) => {
            headers.insert(name, v);
        }
        Err(_) => {
            tracing::debug!(header = %name, "skipping electric header with a non-visible-ASCII value")
        }
    }
}

/// A header value that takes `text`'s buffer as it is (no copy).
fn owned(text: String) -> Result<HeaderValue, InvalidHeaderValue> {
    HeaderValue::from_maybe_shared(bytes::Bytes::from(text))
}

/// Which header names and error statuses a client understands: clients that send no
/// `x-trigger-electric-version` (`@electric-sql/client` 0.6.3, trigger SDK 3.1.x) read the
/// legacy Electric header names and loop on a 400, so they get 422 instead
/// (docs/protocol.md §8).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ClientGeneration {
    /// Sends `x-trigger-electric-version`: modern header names, 400 for bad input.
    #[default]
    Modern,
    /// Sends none: legacy header names, 422 for bad input.
    Legacy,
}

/// The Electric headers of one 2xx (or 409) response.
#[derive(Clone, Debug, Default)]
pub struct ElectricHeaders {
    pub handle: Handle,
    pub offset: Option<String>,
    /// Sent on every response (harmless on non-live; required on live).
    pub cursor: Option<String>,
    /// `electric-schema` JSON; sent on non-live responses.
    pub schema: Option<String>,
    /// Body ends with `up-to-date` → `electric-up-to-date` (and legacy `electric-chunk-up-to-date`).
    pub up_to_date: bool,
}

impl ElectricHeaders {
    /// Writes the headers. For a [`ClientGeneration::Legacy`] client (no
    /// `x-trigger-electric-version`), `electric-shape-id`/`electric-chunk-last-offset`/`electric-next-cursor`/
    /// `electric-chunk-up-to-date` replace the modern `electric-handle`/`electric-offset` (the
    /// modern names are absent), cursor is sent under both names.
    ///
    /// Existing values under the same names are replaced. A value that is not a valid header
    /// value (never the case for handles/offsets/cursors this server mints) is skipped with a
    /// debug log instead of panicking.
    pub fn apply(self, headers: &mut HeaderMap, client: ClientGeneration) {
        let handle = HeaderValue::from_str(&self.handle);
        let offset = self.offset.map(owned);
        let cursor = self.cursor.map(owned);
        if client == ClientGeneration::Legacy {
            headers.remove(&ELECTRIC_HANDLE);
            headers.remove(&ELECTRIC_OFFSET);
            put(headers, ELECTRIC_SHAPE_ID, handle);
            if let Some(offset) = offset {
                put(headers, ELECTRIC_CHUNK_LAST_OFFSET, offset);
            }
            if let Some(cursor) = cursor {
                if let Ok(value) = &cursor {
                    headers.insert(ELECTRIC_NEXT_CURSOR, value.clone());
                }
                put(headers, ELECTRIC_CURSOR, cursor);
            }
        } else {
            put(headers, ELECTRIC_HANDLE, handle);
            if let Some(offset) = offset {
                put(headers, ELECTRIC_OFFSET, offset);
            }
            if let Some(cursor) = cursor {
                put(headers, ELECTRIC_CURSOR, cursor);
            }
        }
        if let Some(schema) = self.schema {
            put(headers, ELECTRIC_SCHEMA, owned(schema));
        }
        if self.up_to_date {
            headers.insert(ELECTRIC_UP_TO_DATE, UP_TO_DATE_VALUE);
            if client == ClientGeneration::Legacy {
                headers.insert(ELECTRIC_CHUNK_UP_TO_DATE, UP_TO_DATE_VALUE);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ElectricHeaders {
        ElectricHeaders {
            handle: "t.abc.def".into(),
            offset: Some("1717667130123_7".into()),
            cursor: Some("42".into()),
            schema: Some(SCHEMA.into()),
            up_to_date: true,
        }
    }

    fn get<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
        h.get(name).and_then(|v| v.to_str().ok())
    }

    /// The values of `names` in `h` (`None` where absent).
    fn values<'a, const N: usize>(h: &'a HeaderMap, names: [&str; N]) -> [Option<&'a str>; N] {
        names.map(|name| get(h, name))
    }

    const SCHEMA: &str = r#"{"id":{"type":"text"}}"#;

    #[test]
    fn hdr_02_modern_names() {
        let mut h = HeaderMap::new();
        sample().apply(&mut h, ClientGeneration::Modern);
        let modern = [
            "electric-handle",
            "electric-offset",
            "electric-cursor",
            "electric-schema",
        ];
        let want = ["t.abc.def", "1717667130123_7", "42", SCHEMA].map(Some);
        assert_eq!(values(&h, modern), want);
        assert!(h.contains_key("electric-up-to-date"));
        for legacy in [
            "electric-shape-id",
            "electric-chunk-last-offset",
            "electric-next-cursor",
            "electric-chunk-up-to-date",
        ] {
            assert!(!h.contains_key(legacy), "{legacy}");
        }
    }

    #[test]
    fn hdr_02_legacy_names() {
        let mut h = HeaderMap::new();
        h.insert("electric-handle", HeaderValue::from_static("stale"));
        sample().apply(&mut h, ClientGeneration::Legacy);
        let handle_and_offset = values(&h, ["electric-shape-id", "electric-chunk-last-offset"]);
        assert_eq!(
            handle_and_offset,
            [Some("t.abc.def"), Some("1717667130123_7")]
        );
        let cursors = values(&h, ["electric-cursor", "electric-next-cursor"]);
        assert_eq!(cursors, [Some("42"), Some("42")]);
        assert_eq!(get(&h, "electric-schema"), Some(SCHEMA));
        assert!(h.contains_key("electric-chunk-up-to-date"));
        assert!(h.contains_key("electric-up-to-date"));
        assert!(!h.contains_key("electric-handle"));
        assert!(!h.contains_key("electric-offset"));
    }

    #[test]
    fn optional_headers_absent_when_none() {
        let mut h = HeaderMap::new();
        ElectricHeaders {
            handle: "h".into(),
            ..Default::default()
        }
        .apply(&mut h, ClientGeneration::Modern);
        assert_eq!(get(&h, "electric-handle"), Some("h"));
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn invalid_values_are_skipped_not_panicking() {
        let mut h = HeaderMap::new();
        ElectricHeaders {
            handle: "bad\nvalue".into(),
            offset: Some("0_0".into()),
            cursor: Some("\u{0}".into()),
            schema: None,
            up_to_date: false,
        }
        .apply(&mut h, ClientGeneration::Modern);
        assert!(!h.contains_key("electric-handle"));
        assert!(!h.contains_key("electric-cursor"));
        assert_eq!(get(&h, "electric-offset"), Some("0_0"));
    }
}
