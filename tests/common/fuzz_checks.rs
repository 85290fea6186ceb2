//! The properties checked on every input by both the cargo-fuzz targets (`tests/fuzz/`) and the
//! bounded proptest loop (`tests/it/fuzz_props.rs`): request params, change records, handles and
//! bearer tokens must never panic, and what they accept must round-trip.

#![allow(dead_code)] // each fuzz target uses one of these

use runfeed::auth::jwt::{is_public_jwt, unverified_payload, verify_public_token};
use runfeed::auth::{bearer_token, is_additional_api_key, sanitize_branch_name};
use runfeed::changes::ChangeRecord;
use runfeed::protocol::handle::{FeedKind, HandleClaims, HandleKey};
use runfeed::protocol::offset::{Offset, OffsetParam};
use runfeed::protocol::params::{is_valid_tag, parse_duration_ms, parse_tags};
use runfeed::protocol::ColumnSet;

/// `raw` and every value of it decoded as a query string, through offset, tags, createdAt and
/// skipColumns parsing: an accepted offset re-parses to itself, accepted tags are valid.
pub fn check_params(raw: &str) {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw).unwrap_or_default();
    for v in pairs.iter().map(|(_, v)| v.as_str()).chain([raw]) {
        if let Ok(OffsetParam::At(o)) = OffsetParam::parse(Some(v)) {
            let back: Offset = o.to_string().parse().expect("accepted offset re-parses");
            assert_eq!(back, o);
        }
        if let Ok(tags) = parse_tags(Some(v)) {
            assert!(tags.iter().all(|t| is_valid_tag(t)));
        }
        let _ = parse_duration_ms(v);
        let list: Vec<&str> = v.split(',').collect();
        let _ = ColumnSet::from_skip_list(&list);
    }
}

/// `ChangeRecord::decode` of a Redis payload: a decoded record re-encodes to a payload that
/// decodes to the same record.
pub fn check_record(data: &[u8]) {
    let record = ChangeRecord::decode(data);
    // `encode` always stamps `v: 1` (NTF-02); everything else round-trips.
    let again = ChangeRecord::decode(record.encode().as_bytes());
    assert_eq!(again.v, 1);
    assert_eq!(
        ChangeRecord {
            v: record.v,
            ..again
        },
        record,
        "decode(encode(r)) == r"
    );
}

/// `HandleKey::verify` of `s`; then a handle minted for claims whose env id and target are the
/// two halves of `s`: it verifies to exactly those claims if at all, and never under another key.
/// Returns whether it verified under its own key.
pub fn check_handle(s: &str, kind: FeedKind, floor_ms: Option<i64>, columns: u32) -> bool {
    let key = HandleKey::new(b"fuzz-secret");
    let _ = key.verify(s);
    let mid = (0..=s.len() / 2)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0);
    let (a, b) = s.split_at(mid);
    let claims = HandleClaims {
        kind,
        env_id: a.to_string().into(),
        target: b.to_string(),
        floor_ms,
        columns,
        nonce: columns as u64,
    };
    let handle = key.mint(&claims);
    assert!(HandleKey::new(b"other").verify(&handle).is_err());
    match key.verify(&handle) {
        Ok(back) => {
            assert_eq!(back, claims);
            true
        }
        Err(_) => false,
    }
}

/// Bearer-token parsing: nothing built from `s` verifies with a fixed key.
pub fn check_token(s: &str) {
    let _ = bearer_token(Some(s));
    let _ = sanitize_branch_name(Some(s));
    let _ = is_additional_api_key(s);
    let _ = is_public_jwt(s);
    let _ = unverified_payload(s);
    let verified = verify_public_token(s, "tr_dev_fuzzkey0000000000000", 1_700_000_000);
    assert!(verified.is_err(), "a fuzzed token verified: {s:?}");
}
