//! Signed shape handles. STUB: signatures fixed; the protocol helper implements them.
//!
//! A handle carries what any instance needs to resume a feed — kind, environment, target and
//! (tag feeds) the pinned `createdAt` floor — plus an HMAC-SHA256 tag under a server secret, so a
//! crafted or foreign handle is detected (→ 409 must-refetch) without shared state.

/// Which feed a handle belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FeedKind {
    Run,
    Tag,
    Batch,
}

/// The signed content of a handle.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HandleClaims {
    pub kind: FeedKind,
    /// Internal environment id.
    pub env_id: String,
    /// What the feed is bound to: run feed → internal run id; batch feed → internal batch id;
    /// tag feed → a digest of the tag filter (see [`filter_digest`]).
    pub target: String,
    /// Tag feed: the pinned `createdAt` floor, epoch ms. `None` for other kinds.
    pub floor_ms: Option<i64>,
    /// The emitted column set ([`crate::protocol::ColumnSet::bits`]).
    pub columns: u32,
    /// Random per-connection nonce: two subscribers of the same feed never share a handle.
    pub nonce: u64,
}

/// Why a presented handle was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandleError {
    #[error("handle is malformed")]
    Malformed,
    #[error("handle signature does not verify")]
    BadSignature,
}

/// The server secret handles are signed with.
#[derive(Clone)]
pub struct HandleKey {
    _key: Vec<u8>,
}

impl HandleKey {
    /// A key from secret bytes (any length; configure the same secret on every instance).
    pub fn new(secret: &[u8]) -> HandleKey {
        HandleKey { _key: secret.to_vec() }
    }

    /// A random key (single-instance development; handles die with the process).
    pub fn random() -> HandleKey {
        unimplemented!("protocol helper")
    }

    /// Mints the URL-safe handle string for `claims`.
    pub fn mint(&self, claims: &HandleClaims) -> String {
        let _ = claims;
        unimplemented!("protocol helper")
    }

    /// Verifies and decodes a handle minted by [`HandleKey::mint`] under the same secret.
    pub fn verify(&self, handle: &str) -> Result<HandleClaims, HandleError> {
        let _ = handle;
        unimplemented!("protocol helper")
    }
}

/// Stable digest of a tag filter (the tag list as given, order-insensitive, duplicates
/// removed; `["a,b"]` and `["a","b"]` differ) — hex string.
pub fn filter_digest(tags: &[String]) -> String {
    let _ = tags;
    unimplemented!("protocol helper")
}
