//! `HandleKey::verify` on arbitrary handles: never panics, never accepts a handle it did not
//! mint (the fuzzer cannot forge a 128-bit MAC); minted handles verify to their claims.
#![no_main]
use libfuzzer_sys::fuzz_target;
use runfeed::protocol::handle::{FeedKind, HandleClaims, HandleKey};

fuzz_target!(|data: &[u8]| {
    let key = HandleKey::new(b"fuzz-secret");
    let s = String::from_utf8_lossy(data);
    let _ = key.verify(&s);
    // Round trip with fuzzed claims.
    let mid = (0..=s.len() / 2)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0);
    let (a, b) = s.split_at(mid);
    let claims = HandleClaims {
        kind: match data.first().map(|b| b % 3) {
            Some(0) => FeedKind::Run,
            Some(1) => FeedKind::Tag,
            _ => FeedKind::Batch,
        },
        env_id: a.to_string(),
        target: b.to_string(),
        floor_ms: data.get(1).map(|&x| i64::from(x) * 1_000),
        columns: data.len() as u32,
        nonce: data.len() as u64,
    };
    let handle = key.mint(&claims);
    if let Ok(back) = key.verify(&handle) {
        assert_eq!(back, claims);
    }
    assert!(HandleKey::new(b"other").verify(&handle).is_err());
});
