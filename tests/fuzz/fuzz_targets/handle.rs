//! `HandleKey::verify` on arbitrary handles: never panics, never accepts a handle it did not
//! mint (the fuzzer cannot forge a 128-bit MAC); minted handles verify to their claims.
#![no_main]
use libfuzzer_sys::fuzz_target;
use runfeed::protocol::handle::FeedKind;

#[path = "../../common/fuzz_checks.rs"]
mod fuzz_checks;

fuzz_target!(|data: &[u8]| {
    // Claims fuzzed from the bytes too: the kind and the floor.
    let kind = match data.first().map(|b| b % 3) {
        Some(0) => FeedKind::Run,
        Some(1) => FeedKind::Tag,
        _ => FeedKind::Batch,
    };
    let floor_ms = data.get(1).map(|&x| i64::from(x) * 1_000);
    let s = String::from_utf8_lossy(data);
    fuzz_checks::check_handle(&s, kind, floor_ms, data.len() as u32);
});
