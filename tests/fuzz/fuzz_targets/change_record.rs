//! `ChangeRecord::decode` on arbitrary Redis payloads: never panics; a decoded record
//! re-encodes to a payload that decodes to the same record.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../../common/fuzz_checks.rs"]
mod fuzz_checks;

fuzz_target!(|data: &[u8]| fuzz_checks::check_record(data));
