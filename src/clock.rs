//! Time, in one place. A leaf: imports nothing of runfeed.
//!
//! runfeed has one clock: tokio's ([`tokio::time::Instant`]). Durations and deadlines are read
//! from it directly. The values that are compared with timestamps from elsewhere (Postgres
//! `"updatedAt"`, change records' `updatedAtMs`, cursors shared between instances, `createdAt`
//! floors) are wall-clock epoch milliseconds from [`now_ms`], which follows the same clock: in
//! production it is the system's wall clock, and in a test that pauses tokio's time
//! (`#[tokio::test(start_paused = true)]`, `tokio::time::advance`) it moves exactly as far as
//! tokio's clock was advanced, so cursors and caches age together.

/// Wall-clock time as epoch milliseconds (UTC). 0 if the system clock is before 1970.
///
/// It is the system clock plus how far tokio's clock stands from the monotonic clock: nothing
/// unless tokio's time is paused (only possible with tokio's `test-util` feature), so in a
/// paused test it moves with `tokio::time::advance` and the runtime's auto-advance.
pub fn now_ms() -> i64 {
    let tokio_now = tokio::time::Instant::now().into_std();
    let real_now = std::time::Instant::now();
    let wall_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX));
    // Read before `real_now`, an unpaused tokio clock stands a few nanoseconds behind it.
    let paused_offset_ns = match tokio_now.checked_duration_since(real_now) {
        Some(ahead) => i128::try_from(ahead.as_nanos()).unwrap_or(i128::MAX),
        None => -i128::try_from(real_now.duration_since(tokio_now).as_nanos()).unwrap_or(i128::MAX),
    };
    let ms = wall_ns
        .saturating_add(paused_offset_ns)
        .div_euclid(1_000_000);
    i64::try_from(ms.max(0)).unwrap_or(i64::MAX)
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
