//! A bounded, stable-toolchain fuzz loop (proptest) over the same surfaces as the
//! cargo-fuzz targets in `tests/fuzz/` (request params, change records, handles, bearer tokens),
//! so every `cargo test` exercises them; crashes found by `scripts/fuzz.sh` are pinned here as
//! regression cases.

#[path = "../common/fuzz_checks.rs"]
mod fuzz_checks;

use fuzz_checks::{check_handle, check_params, check_record, check_token};
use proptest::prelude::*;
use runfeed::auth::jwt::is_public_jwt;
use runfeed::protocol::handle::FeedKind;

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
        let kind = [FeedKind::Run, FeedKind::Tag, FeedKind::Batch][s.len() % 3];
        let floor_ms = s.len().is_multiple_of(2).then_some(s.len() as i64);
        assert!(check_handle(&s, kind, floor_ms, s.len() as u32), "a minted handle verifies");
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
