//! Request-parameter parsing: the query string as the HTTP layer decodes it, then offset, tags,
//! createdAt and skipColumns parsing. Must never panic; accepted values must round-trip.
#![no_main]
use libfuzzer_sys::fuzz_target;
use runfeed::protocol::offset::{Offset, OffsetParam};
use runfeed::protocol::params::{is_valid_tag, parse_duration_ms, parse_tags};
use runfeed::protocol::ColumnSet;

fuzz_target!(|data: &[u8]| {
    let Ok(raw) = std::str::from_utf8(data) else {
        return;
    };
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw).unwrap_or_default();
    for (k, v) in pairs
        .iter()
        .chain(std::iter::once(&("raw".to_string(), raw.to_string())))
    {
        let _ = k;
        if let Ok(OffsetParam::At(o)) = OffsetParam::parse(Some(v)) {
            let back: Offset = o.to_string().parse().expect("an accepted offset re-parses");
            assert_eq!(back, o);
        }
        if let Ok(tags) = parse_tags(Some(v)) {
            assert!(tags.iter().all(|t| is_valid_tag(t)));
        }
        let _ = parse_duration_ms(v);
        let list: Vec<&str> = v.split(',').collect();
        let _ = ColumnSet::from_skip_list(&list);
    }
});
