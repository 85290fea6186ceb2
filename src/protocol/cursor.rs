//! Live cursors (`electric-cursor`): strictly increasing per process, only cache-busting. STUB.

/// Returns the next cursor value, strictly greater than every value returned before by this
/// process and than `client_cursor` when that parses as an integer (Electric 1.6.4 rule).
pub fn next_cursor(client_cursor: Option<&str>) -> u64 {
    let _ = client_cursor;
    unimplemented!("protocol helper")
}

/// Returns a fresh response sequence number (strictly increasing per process, seeded from the
/// wall clock so restarts do not reuse recent values). Used as the `seq` part of offsets.
pub fn next_seq() -> u64 {
    unimplemented!("protocol helper")
}
