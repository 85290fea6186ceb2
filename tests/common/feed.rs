//! Assertions on feed responses shared by the HTTP-level tests (docs/protocol.md §3–§5).

use std::time::Duration;

use runfeed::protocol::encode::format_timestamp_ms;

use super::Resp;

/// The Electric key of run `run_id`'s row.
pub fn key_of(run_id: &str) -> String {
    format!("\"public\".\"TaskRun\"/\"{run_id}\"")
}

/// `ms` as the wire timestamp.
pub fn ts(ms: i64) -> String {
    format_timestamp_ms(ms).unwrap()
}

pub fn sorted(mut v: Vec<(String, String)>) -> Vec<(String, String)> {
    v.sort();
    v
}

/// `(operation, run id)` as [`Resp::ops`] lists it.
pub fn op(o: &str, id: &str) -> (String, String) {
    (o.to_string(), id.to_string())
}

/// The run ids of `r`'s change messages, in body order.
pub fn ids_of(r: &Resp) -> Vec<String> {
    r.ops().into_iter().map(|(_, id)| id).collect()
}

/// Headers every 200 feed response carries (HDR-01, docs/protocol.md §3.2, §10).
pub fn assert_feed_headers(r: &Resp, non_live: bool) {
    r.assert_status(200);
    assert_eq!(
        r.header("content-type"),
        Some("application/json"),
        "content-type"
    );
    assert_eq!(r.header("cache-control"), Some("no-store"), "cache-control");
    assert!(
        r.header("electric-handle").is_some_and(|h| !h.is_empty()),
        "electric-handle: {:?}",
        r.headers
    );
    let offset = r.header("electric-offset").expect("electric-offset");
    let (ms, seq) = offset.split_once('_').expect("offset is <ms>_<seq>");
    assert!(
        ms.parse::<i64>().is_ok() && seq.parse::<u64>().is_ok(),
        "offset {offset:?}"
    );
    assert!(r.has("electric-up-to-date"), "electric-up-to-date");
    assert!(
        r.ends_up_to_date(),
        "body must end with up-to-date: {}",
        r.text
    );
    if non_live {
        assert!(
            r.has("electric-schema"),
            "electric-schema on non-live responses"
        );
    } else {
        assert!(
            r.has("electric-cursor"),
            "electric-cursor on live responses"
        );
    }
    for legacy in ["electric-shape-id", "electric-chunk-last-offset"] {
        assert!(!r.has(legacy), "modern client must not get {legacy}");
    }
}

/// A non-live answer given at once: the non-live feed headers, answered in under 2 s.
pub fn assert_immediate(r: &Resp, what: &str) {
    assert_feed_headers(r, true);
    assert!(
        r.elapsed < Duration::from_millis(2_000),
        "{what}: held {:?}",
        r.elapsed
    );
}

/// A live answer that carries nothing: the live feed headers, a bare `up-to-date`, and held for
/// at least `min`.
pub fn assert_quiet_hold(r: &Resp, min: Duration, what: &str) {
    assert_feed_headers(r, false);
    assert!(r.is_bare_up_to_date(), "{what}: {}", r.text);
    assert!(r.elapsed >= min, "{what}: held only {:?}", r.elapsed);
}

/// A live answer carrying exactly one `update` of `run_id`, within `limit` of the request.
pub fn assert_woken_by_update(r: &Resp, run_id: &str, limit: Duration, what: &str) {
    assert_feed_headers(r, false);
    assert_eq!(r.ops(), vec![op("update", run_id)], "{what}: {}", r.text);
    assert!(
        r.elapsed < limit,
        "{what}: waited {:?} (the backstop?)",
        r.elapsed
    );
}

/// A 409 whose body is exactly `[must-refetch]`.
pub fn assert_must_refetch(r: &Resp, what: &str) {
    assert_eq!(r.status, 409, "{what}: {}", r.text);
    assert_eq!(
        r.json,
        serde_json::json!([{"headers": {"control": "must-refetch"}}]),
        "{what}"
    );
}
