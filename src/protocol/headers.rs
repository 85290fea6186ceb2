//! Electric response headers, modern vs legacy names (protocol §1, §3.2, §8). STUB.

use http::HeaderMap;

/// The Electric headers of one 2xx (or 409) response.
#[derive(Clone, Debug, Default)]
pub struct ElectricHeaders {
    pub handle: String,
    pub offset: Option<String>,
    /// Sent on every response (harmless on non-live; required on live).
    pub cursor: Option<String>,
    /// `electric-schema` JSON; sent on non-live responses.
    pub schema: Option<String>,
    /// Body ends with `up-to-date` → `electric-up-to-date` (and legacy `electric-chunk-up-to-date`).
    pub up_to_date: bool,
}

impl ElectricHeaders {
    /// Writes the headers. `legacy` = the request had no `x-trigger-electric-version`: then
    /// `electric-shape-id`/`electric-chunk-last-offset`/`electric-next-cursor`/
    /// `electric-chunk-up-to-date` replace the modern `electric-handle`/`electric-offset` (the
    /// modern names are absent), cursor is sent under both names.
    pub fn apply(&self, headers: &mut HeaderMap, legacy: bool) {
        let _ = (headers, legacy);
        unimplemented!("protocol helper")
    }
}
