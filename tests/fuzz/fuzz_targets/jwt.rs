//! Bearer-token parsing: `bearer_token`, `is_public_jwt`, `unverified_payload` and
//! `verify_public_token` with a fixed key never panic; nothing the fuzzer builds verifies.
#![no_main]
use libfuzzer_sys::fuzz_target;
use runfeed::auth::jwt::{is_public_jwt, unverified_payload, verify_public_token};
use runfeed::auth::{bearer_token, is_additional_api_key, sanitize_branch_name};

fuzz_target!(|data: &[u8]| {
    let s = String::from_utf8_lossy(data);
    let _ = bearer_token(Some(&s));
    let _ = sanitize_branch_name(Some(&s));
    let _ = is_additional_api_key(&s);
    let _ = is_public_jwt(&s);
    let _ = unverified_payload(&s);
    let verified = verify_public_token(&s, "tr_dev_fuzzkey0000000000000", 1_700_000_000);
    assert!(verified.is_err(), "a fuzzed token verified: {s:?}");
});
