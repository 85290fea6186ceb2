//! Time, in one place. A leaf: imports nothing of runfeed.
//!
//! runfeed has one clock: tokio's ([`tokio::time::Instant`]). Durations and deadlines are read
//! from it directly. The values that are compared with timestamps from elsewhere (Postgres
//! `"updatedAt"`, change records' `updatedAtMs`, cursors shared between instances, `createdAt`
//! floors) are wall-clock epoch milliseconds from [`now_ms`], which follows the same clock: in
//! production it is the system's wall clock, and in a unit test that pauses tokio's time
//! (`#[tokio::test(start_paused = true)]`, `tokio::time::advance`) it moves exactly as far as
//! tokio's clock was advanced, so cursors and caches age together.

/// Wall-clock time as epoch milliseconds (UTC). 0 if the system clock is before 1970.
///
/// In the crate's unit tests (the only code that pauses tokio's time; a test against a real
/// Postgres or Redis cannot) it is the system clock plus how far tokio's clock stands from the
/// monotonic one, so in a paused test it moves with `tokio::time::advance` and the runtime's
/// auto-advance. Every other build reads the system clock alone: nothing there pauses tokio's
/// time, and two clock reads fewer suit a value read on every poll.
pub fn now_ms() -> i64 {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    #[cfg(test)]
    let since_epoch = shifted_by_paused_time(since_epoch);
    i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
}

/// `since_epoch` moved by how far tokio's clock stands from the monotonic clock: what a paused
/// test advanced, less the real time that passed while it was paused.
#[cfg(test)]
fn shifted_by_paused_time(since_epoch: std::time::Duration) -> std::time::Duration {
    let tokio_now = tokio::time::Instant::now().into_std();
    let real_now = std::time::Instant::now();
    // Read before `real_now`, an unpaused tokio clock stands a few nanoseconds behind it.
    match tokio_now.checked_duration_since(real_now) {
        Some(ahead) => since_epoch.saturating_add(ahead),
        None => since_epoch.saturating_sub(real_now.duration_since(tokio_now)),
    }
}

#[cfg(test)]
mod tests {
    use super::now_ms;
    use std::time::Duration;

    #[test]
    fn outside_a_runtime_it_is_the_system_clock() {
        let system = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        assert!((now_ms() - system).abs() < 1_000);
    }

    #[tokio::test]
    async fn an_unpaused_runtime_reads_the_system_clock() {
        let system = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        assert!((now_ms() - system).abs() < 1_000);
    }

    #[tokio::test(start_paused = true)]
    async fn paused_time_moves_the_wall_clock_by_what_was_advanced() {
        let before = now_ms();
        tokio::time::advance(Duration::from_secs(3_600)).await;
        let after = now_ms();
        assert!(
            (3_600_000..3_601_000).contains(&(after - before)),
            "moved {} ms",
            after - before
        );
    }
}
