//! Signed shape handles.
//!
//! A handle carries what any instance needs to resume a feed — kind, environment, target and
//! (tag feeds) the pinned `createdAt` floor — plus an HMAC-SHA256 tag under a server secret, so a
//! crafted or foreign handle is detected (→ 409 must-refetch) without shared state.
//!
//! Format: `<k>.<payload>.<mac>` where `k` is `r` (run), `t` (tag) or `b` (batch), `payload` is
//! base64url (no padding) of the compact JSON array `[env_id, target, floor_ms|null, columns,
//! nonce]`, and `mac` is base64url (no padding) of the first 16 bytes of
//! HMAC-SHA256(secret, `<k>.<payload>`). Only `[A-Za-z0-9._-]` appear, so handles are URL- and
//! header-safe. (trigger's own handles are unsigned `run-<id>` / `runs_<floor>_<seq>_<uuid8>`,
//! docs/trigger-dev.md §3; clients treat handles as opaque, docs/protocol.md §4.3.)

use super::ids::{EnvId, Handle};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::digest::Key;
use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// Longest handle `verify` looks at; longer input is [`HandleError::Malformed`] without work.
pub const MAX_HANDLE_LEN: usize = 1024;

/// Bytes of the HMAC-SHA256 tag kept in a handle (128 bits).
const MAC_LEN: usize = 16;

/// SHA-256 block size: HMAC keys are hashed down (if longer) and zero-padded to this (RFC 2104).
const BLOCK_LEN: usize = 64;

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
    pub env_id: EnvId,
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
///
/// Holds the keyed HMAC state (the secret itself is not kept); `Debug` is deliberately absent.
#[derive(Clone)]
pub struct HandleKey {
    mac: HmacSha256,
}

/// The wire form of the claims (kind travels as the prefix letter).
type Payload = (String, String, Option<i64>, u32, u64);

impl FeedKind {
    fn letter(self) -> &'static str {
        match self {
            FeedKind::Run => "r",
            FeedKind::Tag => "t",
            FeedKind::Batch => "b",
        }
    }

    fn from_letter(s: &str) -> Option<FeedKind> {
        match s {
            "r" => Some(FeedKind::Run),
            "t" => Some(FeedKind::Tag),
            "b" => Some(FeedKind::Batch),
            _ => None,
        }
    }
}

impl HandleKey {
    /// A key from secret bytes (any length; configure the same secret on every instance).
    pub fn new(secret: &[u8]) -> HandleKey {
        // RFC 2104 key preparation done here so construction is infallible: a key longer than
        // the block is replaced by its hash, then zero-padded. Same MAC as keying with `secret`.
        let mut block = [0u8; BLOCK_LEN];
        if secret.len() > BLOCK_LEN {
            let digest = Sha256::digest(secret);
            block[..digest.len()].copy_from_slice(&digest);
        } else {
            block[..secret.len()].copy_from_slice(secret);
        }
        let key = Key::<HmacSha256>::from(block);
        HandleKey {
            mac: HmacSha256::new(&key),
        }
    }

    /// A random key (single-instance development; handles die with the process).
    pub fn random() -> HandleKey {
        let secret: [u8; 32] = rand::random();
        HandleKey::new(&secret)
    }

    /// Mints the URL-safe handle string for `claims`.
    ///
    /// About 80 + 4/3 × (env id + target) characters; claims whose handle would exceed
    /// [`MAX_HANDLE_LEN`] (kilobyte-long ids) would not verify, so keep targets short (digests).
    pub fn mint(&self, claims: &HandleClaims) -> Handle {
        let payload: (&str, &str, Option<i64>, u32, u64) = (
            &claims.env_id,
            &claims.target,
            claims.floor_ms,
            claims.columns,
            claims.nonce,
        );
        // Serializing strings and integers into a Vec cannot fail; an empty payload would only
        // produce a handle that later fails to decode.
        let json = serde_json::to_vec(&payload).unwrap_or_default();
        let mut out = String::with_capacity(2 + json.len() * 4 / 3 + 4 + 23);
        out.push_str(claims.kind.letter());
        out.push('.');
        URL_SAFE_NO_PAD.encode_string(&json, &mut out);
        let tag = self
            .mac
            .clone()
            .chain_update(out.as_bytes())
            .finalize()
            .into_bytes();
        out.push('.');
        URL_SAFE_NO_PAD.encode_string(&tag[..MAC_LEN], &mut out);
        Handle::from(out)
    }

    /// Verifies and decodes a handle minted by [`HandleKey::mint`] under the same secret.
    ///
    /// Structural problems (empty, longer than [`MAX_HANDLE_LEN`], not three `.`-separated parts,
    /// unknown kind letter, undecodable MAC or payload) → [`HandleError::Malformed`]; a MAC that
    /// does not match (tampering, another secret) → [`HandleError::BadSignature`]. The MAC is
    /// checked in constant time before the payload is decoded. Never panics.
    pub fn verify(&self, handle: &str) -> Result<HandleClaims, HandleError> {
        if handle.is_empty() || handle.len() > MAX_HANDLE_LEN {
            return Err(HandleError::Malformed);
        }
        let (signed, mac_b64) = handle.rsplit_once('.').ok_or(HandleError::Malformed)?;
        let (letter, payload_b64) = signed.split_once('.').ok_or(HandleError::Malformed)?;
        if payload_b64.contains('.') {
            return Err(HandleError::Malformed);
        }
        let kind = FeedKind::from_letter(letter).ok_or(HandleError::Malformed)?;
        let tag = URL_SAFE_NO_PAD
            .decode(mac_b64)
            .map_err(|_| HandleError::Malformed)?;
        if tag.len() != MAC_LEN {
            return Err(HandleError::Malformed);
        }
        self.mac
            .clone()
            .chain_update(signed.as_bytes())
            .verify_truncated_left(&tag)
            .map_err(|_| HandleError::BadSignature)?;
        let json = URL_SAFE_NO_PAD
            .decode(payload_b64)
            .map_err(|_| HandleError::Malformed)?;
        let (env_id, target, floor_ms, columns, nonce): Payload =
            serde_json::from_slice(&json).map_err(|_| HandleError::Malformed)?;
        Ok(HandleClaims {
            kind,
            env_id: EnvId::from(env_id),
            target,
            floor_ms,
            columns,
            nonce,
        })
    }
}

/// Stable digest of a tag filter (the tag list as given, order-insensitive, duplicates
/// removed; `["a,b"]` and `["a","b"]` differ) — hex string.
///
/// Sorted, deduplicated tags are JSON-encoded as an array (so no separator ambiguity), hashed
/// with SHA-256; the result is the lowercase hex of the first 16 bytes (32 characters).
pub fn filter_digest(tags: &[String]) -> String {
    filter_digest_hex(tags)
        .iter()
        .map(|b| char::from(*b))
        .collect()
}

/// Whether `digest` is [`filter_digest`]`(tags)`, computed without allocating for the usual
/// one-tag filter (every poll of a tag feed checks its handle's filter).
pub fn filter_digest_is(tags: &[String], digest: &str) -> bool {
    filter_digest_hex(tags) == digest.as_bytes()
}

/// The [`filter_digest`] as ASCII hex bytes: the JSON is written straight into the hash.
fn filter_digest_hex(tags: &[String]) -> [u8; 32] {
    /// Feeds what the JSON serializer writes to the hash (nothing to fail).
    struct Sink(Sha256);
    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.update(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut sink = Sink(Sha256::new());
    // Serializing a list of strings into an infallible writer cannot fail.
    let _ = match tags {
        [one] => serde_json::to_writer(&mut sink, &[one.as_str()]),
        _ => {
            let mut sorted: Vec<&str> = tags.iter().map(String::as_str).collect();
            sorted.sort_unstable();
            sorted.dedup();
            serde_json::to_writer(&mut sink, &sorted)
        }
    };
    let digest = sink.0.finalize();
    let mut out = [0u8; 32];
    for (pair, b) in out.chunks_exact_mut(2).zip(&digest[..16]) {
        pair[0] = HEX[usize::from(b >> 4)];
        pair[1] = HEX[usize::from(b & 0xf)];
    }
    out
}

const HEX: &[u8; 16] = b"0123456789abcdef";

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn claims() -> HandleClaims {
        HandleClaims {
            kind: FeedKind::Tag,
            env_id: "cm_env_123".into(),
            target: filter_digest(&["user:1".into()]),
            floor_ms: Some(1_735_689_600_000),
            columns: (1 << 26) - 1,
            nonce: 0xdead_beef_cafe_f00d,
        }
    }

    fn url_safe(s: &str) -> bool {
        s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
    }

    #[test]
    fn mint_verify_round_trip_and_url_safe() {
        let key = HandleKey::new(b"secret");
        for kind in [FeedKind::Run, FeedKind::Tag, FeedKind::Batch] {
            let c = HandleClaims { kind, ..claims() };
            let h = key.mint(&c);
            assert!(url_safe(&h), "{h}");
            assert!(h.len() < 200, "{h}");
            assert_eq!(key.verify(&h), Ok(c));
        }
    }

    #[test]
    fn same_secret_other_instance_verifies() {
        let h = HandleKey::new(b"shared").mint(&claims());
        assert_eq!(HandleKey::new(b"shared").verify(&h), Ok(claims()));
        let long = vec![7u8; 200];
        let h = HandleKey::new(&long).mint(&claims());
        assert_eq!(HandleKey::new(&long).verify(&h), Ok(claims()));
    }

    #[test]
    fn matches_rfc2104_hmac_for_any_key_length() {
        for len in [0usize, 1, 32, 64, 65, 200] {
            let secret: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let ours = HandleKey::new(&secret)
                .mac
                .chain_update(b"msg")
                .finalize()
                .into_bytes();
            let reference = <HmacSha256 as KeyInit>::new_from_slice(&secret)
                .expect("any length")
                .chain_update(b"msg")
                .finalize()
                .into_bytes();
            assert_eq!(ours, reference, "len {len}");
        }
    }

    #[test]
    fn rejects_wrong_key_and_tampering() {
        let key = HandleKey::new(b"secret");
        let h = key.mint(&claims());
        assert_eq!(
            HandleKey::new(b"other").verify(&h),
            Err(HandleError::BadSignature)
        );
        assert!(HandleKey::random().verify(&h).is_err());

        let parts: Vec<&str> = h.split('.').collect();
        // tampered payload: other claims, re-encoded
        let forged =
            serde_json::to_vec(&("cm_env_evil", "x", None::<i64>, 1u32, 1u64)).expect("json");
        let tampered = format!(
            "{}.{}.{}",
            parts[0],
            URL_SAFE_NO_PAD.encode(forged),
            parts[2]
        );
        assert_eq!(key.verify(&tampered), Err(HandleError::BadSignature));
        // tampered kind
        let tampered = format!("r.{}.{}", parts[1], parts[2]);
        assert_eq!(key.verify(&tampered), Err(HandleError::BadSignature));
        // tampered mac
        let mut mac = URL_SAFE_NO_PAD.decode(parts[2]).expect("b64");
        mac[0] ^= 1;
        let tampered = format!("{}.{}.{}", parts[0], parts[1], URL_SAFE_NO_PAD.encode(mac));
        assert_eq!(key.verify(&tampered), Err(HandleError::BadSignature));
        // truncated mac
        let tampered = format!("{}.{}.{}", parts[0], parts[1], &parts[2][..10]);
        assert_eq!(key.verify(&tampered), Err(HandleError::Malformed));
    }

    #[test]
    fn rejects_garbage() {
        let key = HandleKey::new(b"secret");
        let long = "a".repeat(MAX_HANDLE_LEN + 1);
        for bad in [
            "",
            ".",
            "..",
            "...",
            "run-abc",
            "runs_1_2_abcdefgh",
            "x.e30.AAAAAAAAAAAAAAAAAAAAAA",
            "r..",
            "r.!!.??",
            "r.a.b.c",
            &long,
        ] {
            assert!(key.verify(bad).is_err(), "{bad:?}");
        }
        assert_eq!(key.verify(&long), Err(HandleError::Malformed));
    }

    #[test]
    fn filter_digest_is_checks_without_recomputing_the_string() {
        let s = |v: &[&str]| v.iter().map(|t| t.to_string()).collect::<Vec<_>>();
        for tags in [
            s(&["a"]),
            s(&["b", "a", "a"]),
            s(&[]),
            s(&[""]),
            s(&["a,b"]),
        ] {
            let d = filter_digest(&tags);
            assert_eq!(d.len(), 32);
            assert!(filter_digest_is(&tags, &d));
            assert!(!filter_digest_is(&tags, &filter_digest(&s(&["other"]))));
        }
        // Pinned: SHA-256 of the compact JSON array, first 16 bytes in hex (handles minted by
        // other instances and versions must keep verifying).
        assert_eq!(
            filter_digest(&s(&["a"])),
            "0eb5b8d6f81bc677da8a08567cc4fa9a"
        );
        assert_eq!(
            filter_digest(&s(&["b", "a", "b"])),
            "0473ef2dc0d324ab659d3580c1134e9d"
        );
        assert_eq!(filter_digest(&s(&[])), "4f53cda18c2baa0c0354bb5f9a3ecbe5");
    }

    #[test]
    fn filter_digest_is_order_insensitive_and_unambiguous() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let d = filter_digest(&s(&["a", "b"]));
        assert_eq!(d.len(), 32);
        assert!(d.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(d, filter_digest(&s(&["b", "a", "a"])));
        assert_ne!(d, filter_digest(&s(&["a,b"])));
        assert_ne!(filter_digest(&s(&[])), filter_digest(&s(&[""])));
    }

    fn arb_claims() -> impl Strategy<Value = HandleClaims> {
        (
            prop_oneof![
                Just(FeedKind::Run),
                Just(FeedKind::Tag),
                Just(FeedKind::Batch)
            ],
            any::<String>(),
            any::<String>(),
            any::<Option<i64>>(),
            any::<u32>(),
            any::<u64>(),
        )
            .prop_map(
                |(kind, env_id, target, floor_ms, columns, nonce)| HandleClaims {
                    kind,
                    env_id: env_id.into(),
                    target,
                    floor_ms,
                    columns,
                    nonce,
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn verify_never_panics(s in any::<String>()) {
            let key = HandleKey::new(b"k");
            let _ = key.verify(&s);
        }

        #[test]
        fn verify_never_panics_on_handle_like_input(s in "[rtb]?\\.?[A-Za-z0-9_.-]{0,60}") {
            let key = HandleKey::new(b"k");
            let _ = key.verify(&s);
        }

        #[test]
        fn mint_verify_round_trips(c in arb_claims()) {
            let key = HandleKey::new(b"k");
            let h = key.mint(&c);
            prop_assert!(url_safe(&h));
            if h.len() <= MAX_HANDLE_LEN {
                prop_assert_eq!(key.verify(&h), Ok(c));
            }
        }
    }
}
