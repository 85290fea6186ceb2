//! `ChangeRecord::decode` on arbitrary Redis payloads: never panics; a decoded record
//! re-encodes to a payload that decodes to the same record.
#![no_main]
use libfuzzer_sys::fuzz_target;
use runfeed::changes::ChangeRecord;

fuzz_target!(|data: &[u8]| {
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
});
