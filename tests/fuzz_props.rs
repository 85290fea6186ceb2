//! A bounded, stable-toolchain fuzz loop (proptest) over the same surfaces as the
//! cargo-fuzz targets in `tests/fuzz/` (request params, change records, handles, bearer tokens),
//! so every `cargo test` exercises them; crashes found by `scripts/fuzz.sh` are pinned here as
//! regression cases.

use proptest::prelude::*;
use runfeed::auth::jwt::{is_public_jwt, unverified_payload, verify_public_token};
use runfeed::auth::{bearer_token, sanitize_branch_name};
use runfeed::changes::ChangeRecord;
use runfeed::protocol::handle::{FeedKind, HandleClaims, HandleKey};
use runfeed::protocol::offset::{Offset, OffsetParam};
use runfeed::protocol::params::{is_valid_tag, parse_duration_ms, parse_tags};
use runfeed::protocol::ColumnSet;

fn check_params(raw: &str) {
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

fn check_record(data: &[u8]) {
    let record = ChangeRecord::decode(data);
    // `encode` always stamps `v: 1` (NTF-02); everything else round-trips.
    let again = ChangeRecord::decode(record.encode().as_bytes());
    assert_eq!(again.v, 1);
    assert_eq!(
        ChangeRecord {
            v: record.v,
            ..again
        },
        record
    );
}

fn check_handle(s: &str) {
    let key = HandleKey::new(b"fuzz-secret");
    let _ = key.verify(s);
    let mid = (0..=s.len() / 2)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0);
    let (a, b) = s.split_at(mid);
    let claims = HandleClaims {
        kind: [FeedKind::Run, FeedKind::Tag, FeedKind::Batch][s.len() % 3],
        env_id: a.to_string().into(),
        target: b.to_string(),
        floor_ms: s.len().is_multiple_of(2).then_some(s.len() as i64),
        columns: s.len() as u32,
        nonce: s.len() as u64,
    };
    let handle = key.mint(&claims);
    assert_eq!(key.verify(&handle).ok(), Some(claims));
    assert!(HandleKey::new(b"other").verify(&handle).is_err());
}

fn check_token(s: &str) {
    let _ = bearer_token(Some(s));
    let _ = sanitize_branch_name(Some(s));
    let _ = is_public_jwt(s);
    let _ = unverified_payload(s);
    assert!(verify_public_token(s, "tr_dev_fuzzkey0000000000000", 1_700_000_000).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    #[test]
    fn params_never_panic(raw in "(offset|tags|createdAt|skipColumns|handle|live|[a-z%=&,_0-9-]){0,12}[ -~\\PC]{0,40}") {
        check_params(&raw);
    }

    #[test]
    fn change_records_round_trip(data in proptest::collection::vec(any::<u8>(), 0..200)) {
        check_record(&data);
    }

    #[test]
    fn json_change_records_round_trip(
        run in "\\PC{0,20}", env in "\\PC{0,20}", ms in any::<f64>(), v in any::<f64>(),
        tags in proptest::collection::vec("\\PC{0,8}", 0..4),
    ) {
        let payload = serde_json::json!({"v": v, "runId": run, "envId": env, "tags": tags, "updatedAtMs": ms});
        check_record(payload.to_string().as_bytes());
    }

    #[test]
    fn handles_never_panic_and_round_trip(s in "\\PC{0,120}") {
        check_handle(&s);
    }

    #[test]
    fn tokens_never_panic_or_verify(s in "(Bearer )?[A-Za-z0-9_=+/-]{0,40}\\.?[A-Za-z0-9_=+/-]{0,80}\\.?[A-Za-z0-9_=+/.-]{0,40}") {
        check_token(&s);
    }
}

#[test]
fn crafted_tokens_never_verify() {
    use base64::Engine;
    let e = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let payload = r#"{"pub":true,"sub":"env","iss":"https://id.trigger.dev","aud":"https://api.trigger.dev","scopes":["read:all"]}"#;
    for header in [
        r#"{"alg":"none"}"#,
        r#"{"alg":"None","typ":"JWT"}"#,
        r#"{"alg":"RS256"}"#,
        r#"{"alg":"HS256","crit":["x"]}"#,
        "{}",
        "[]",
        "null",
    ] {
        for sig in ["", "AAAA", "=", "."] {
            let t = format!("{}.{}.{}", e.encode(header), e.encode(payload), sig);
            check_token(&t);
            assert!(is_public_jwt(&t) || sig == ".");
        }
    }
}
