//! Request-parameter parsing: the query string as the HTTP layer decodes it, then offset, tags,
//! createdAt and skipColumns parsing. Must never panic; accepted values must round-trip.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../../common/fuzz_checks.rs"]
mod fuzz_checks;

fuzz_target!(|data: &[u8]| {
    if let Ok(raw) = std::str::from_utf8(data) {
        fuzz_checks::check_params(raw);
    }
});
