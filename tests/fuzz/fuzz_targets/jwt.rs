//! Bearer-token parsing: `bearer_token`, `is_public_jwt`, `unverified_payload` and
//! `verify_public_token` with a fixed key never panic; nothing the fuzzer builds verifies.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../../common/fuzz_checks.rs"]
mod fuzz_checks;

fuzz_target!(|data: &[u8]| fuzz_checks::check_token(&String::from_utf8_lossy(data)));
