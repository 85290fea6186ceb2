//! Wall-clock time, in one place. A leaf: imports nothing of runfeed.
//!
//! Durations and deadlines use tokio's monotonic clock (so tests can pause it); only values that
//! are compared with timestamps from elsewhere (Postgres `"updatedAt"`, change records'
//! `updatedAtMs`, cursors shared between instances, `createdAt` floors) use [`now_ms`].

/// Wall-clock time as epoch milliseconds (UTC). 0 if the system clock is before 1970.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
