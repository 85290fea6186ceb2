//! Live cursors (`electric-cursor`) and response sequence numbers.
//!
//! The cursor only makes consecutive live URLs distinct for HTTP caches (docs/protocol.md §4.3); per
//! Electric 1.6.4 each response's cursor must be strictly greater than the request's. runfeed's
//! cursors are also the response's wall clock in microseconds, with the lowest bit telling
//! whether the response vouched for the change stream up to then ([`Gap`]): clients echo the
//! cursor on their next live request, so an instance that did not answer the previous poll
//! learns from it when the client was last up to date ([`vouched_wall_ms`]). Sequence
//! numbers are the `seq` part of offsets (docs/behaviours.md TOK-03). Both counters start at the wall
//! clock in microseconds (≈ 1.7e15, below 2^53 so JavaScript reads them exactly) so a restarted
//! process does not reissue recent values.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// 2^40 µs ≈ 12.7 days: a client cursor this far ahead (the tests' crafted value; no client
/// cursor of any size moves the process-wide counter).
#[cfg(test)]
const MAX_RATCHET: u64 = 1 << 40;

static SEQ: LazyLock<AtomicU64> = LazyLock::new(|| AtomicU64::new(now_micros()));
static CURSOR: LazyLock<AtomicU64> = LazyLock::new(|| AtomicU64::new(now_micros()));

fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2))
        .unwrap_or(0)
}

/// Whether a response vouches for the change stream up to the moment it was made: every record
/// routed before then either reached the feed or did not concern it. A response whose store
/// re-check failed, or whose environment's subscription was not confirmed, does not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gap {
    /// Even cursor.
    Vouched,
    /// Odd cursor.
    Unvouched,
}

/// `v`, or the next value above it, whose lowest bit marks `gap`.
fn marked(v: u64, gap: Gap) -> u64 {
    let odd = v & 1 == 1;
    match (gap, odd) {
        (Gap::Vouched, true) | (Gap::Unvouched, false) => v.saturating_add(1),
        _ => v,
    }
}

/// Returns the next cursor value, its lowest bit marking `gap`: the wall clock in µs (strictly
/// greater than every value this process minted before), or, when the client's cursor
/// (`client_cursor`, an integer) is not below that, the client's plus one: each response's cursor
/// is strictly greater than the request's (Electric 1.6.4 rule).
///
/// A client's cursor never moves the process-wide counter: a cursor from the future raises that
/// client's own answer only, so no request can push the wall time other clients' cursors carry
/// (which instances trust on a hop, [`vouched_wall_ms`]). A cursor of `u64::MAX` is answered with
/// `u64::MAX`. Negative or non-integer client cursors are ignored.
pub fn next_cursor(client_cursor: Option<&str>, gap: Gap) -> u64 {
    let client = client_cursor.and_then(|c| c.trim().parse::<u64>().ok());
    let now = now_micros();
    let mut prev = CURSOR.load(Ordering::Relaxed);
    let own = loop {
        let next = marked(prev.saturating_add(1).max(now), gap);
        match CURSOR.compare_exchange_weak(prev, next, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => break next,
            Err(actual) => prev = actual,
        }
    };
    match client {
        Some(c) if c >= own => marked(c.saturating_add(1), gap),
        _ => own,
    }
}

/// How far ahead of this instance's clock an echoed cursor may be and still count as the wall
/// time of a response (another instance's clock may run a little ahead), ms.
pub const MAX_CLOCK_SKEW_MS: i64 = 1_000;

/// The wall time (epoch ms) of the response whose cursor a client echoes, when that response
/// vouched for its gap ([`Gap::Vouched`]) and the time is not more than [`MAX_CLOCK_SKEW_MS`]
/// ahead of `now_ms`; `None` for anything else. Never later than `now_ms`. A client can only
/// claim to be less up to date than it is, which costs it a replay, or up to date as of a moment
/// within the last replay window, which can cost only its own feed the changes it skipped (it
/// never shows it rows it may not read, and it moves no other client's cursor).
pub fn vouched_wall_ms(client_cursor: Option<&str>, now_ms: i64) -> Option<i64> {
    let c = client_cursor?.trim().parse::<u64>().ok()?;
    if c & 1 == 1 {
        return None;
    }
    let ms = i64::try_from(c / 1000).ok()?;
    (ms <= now_ms.saturating_add(MAX_CLOCK_SKEW_MS)).then_some(ms.min(now_ms))
}

/// Returns a fresh response sequence number (strictly increasing per process, seeded from the
/// wall clock so restarts do not reuse recent values). Used as the `seq` part of offsets.
pub fn next_seq() -> u64 {
    SEQ.fetch_add(1, Ordering::AcqRel).wrapping_add(1)
}

/// A `seq` for an offset that SSE clients receive (in `1..10⁶`, so the offset has an LSN form,
/// [`crate::protocol::offset::Offset::lsn`]). Taken from the same counter as [`next_seq`]; two
/// responses of one connection that share a `ms` would need 10⁶ responses in between to collide.
pub fn next_lsn_seq() -> u64 {
    next_seq() % (super::offset::LSN_SEQ_SPAN - 1) + 1
}

/// The `seq` of an offset minted for a reply: [`next_lsn_seq`] when it feeds an SSE stream,
/// [`next_seq`] otherwise.
pub fn next_offset_seq(sse: bool) -> u64 {
    if sse {
        next_lsn_seq()
    } else {
        next_seq()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tok_03_seq_strictly_increasing_and_clock_seeded() {
        let a = next_seq();
        let b = next_seq();
        assert!(b > a);
        // seeded from µs since epoch: after 2020-01-01, below 2^53
        assert!(a > 1_577_836_800_000_000);
        assert!(a < 1 << 53);
    }

    #[test]
    fn tok_03_seq_unique_across_threads() {
        let handles: Vec<_> = (0..4)
            .map(|_| std::thread::spawn(|| (0..1000).map(|_| next_seq()).collect::<Vec<_>>()))
            .collect();
        let mut all = Vec::new();
        for h in handles {
            let v = h.join().expect("thread");
            assert!(v.windows(2).all(|w| w[1] > w[0]));
            all.extend(v);
        }
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n);
    }

    #[test]
    fn lsn_seq_is_never_zero_and_below_a_million() {
        for _ in 0..10_000 {
            let s = next_lsn_seq();
            assert!((1..1_000_000).contains(&s), "{s}");
        }
    }

    #[test]
    fn cursor_strictly_greater_than_previous_and_client() {
        let a = next_cursor(None, Gap::Vouched);
        let b = next_cursor(Some("not-a-number"), Gap::Unvouched);
        assert!(b > a);
        let c = next_cursor(Some(&(b + 1000).to_string()), Gap::Vouched);
        assert!(c > b + 1000);
        let d = next_cursor(Some("5"), Gap::Vouched);
        assert!(d > b, "the process's own cursors only grow");
        let e = next_cursor(Some("-3"), Gap::Unvouched);
        assert!(e > d);
    }

    #[test]
    fn a_cursor_is_the_wall_clock_and_marks_whether_its_response_vouched() {
        let before = crate::clock::now_ms();
        let vouched = next_cursor(None, Gap::Vouched);
        let unvouched = next_cursor(None, Gap::Unvouched);
        let after = crate::clock::now_ms();
        let wall = vouched_wall_ms(Some(&vouched.to_string()), after).expect("vouched");
        assert!(
            (before..=after).contains(&wall),
            "{before} <= {wall} <= {after}"
        );
        assert_eq!(vouched_wall_ms(Some(&unvouched.to_string()), after), None);
        assert_eq!(vouched_wall_ms(Some("x"), after), None);
        assert_eq!(vouched_wall_ms(None, after), None);
        // A claim from the future is not a wall time.
        let future = (after as u64 + 3_600_000) * 1000;
        assert_eq!(vouched_wall_ms(Some(&future.to_string()), after), None);
    }

    /// Found by a fresh-clone trial: one request with a cursor 12 days ahead pushed the
    /// process-wide counter, so every other client's later cursor claimed a future wall time and
    /// their hops trusted it as "up to date as of now", skipping their replay.
    #[test]
    fn a_client_cursor_from_the_future_moves_no_other_clients_cursor() {
        let now_us = now_micros();
        let forged = now_us + MAX_RATCHET - 2;
        let answered = next_cursor(Some(&forged.to_string()), Gap::Vouched);
        assert!(
            answered > forged,
            "still strictly greater than the request's"
        );
        let other = next_cursor(None, Gap::Vouched);
        assert!(
            other < now_micros() + 1_000_000,
            "another client's cursor stays at the wall clock: {other} vs {now_us}"
        );
        let now_ms = crate::clock::now_ms();
        let echoed = next_cursor(Some(&other.to_string()), Gap::Vouched);
        let wall = vouched_wall_ms(Some(&echoed.to_string()), now_ms + 10);
        assert!(wall.is_some_and(|w| (now_ms - 1_000..=now_ms + 10).contains(&w)));
    }

    #[test]
    fn a_cursor_from_beyond_the_clock_skew_is_not_trusted() {
        let now_ms = crate::clock::now_ms();
        let ahead = |ms: i64| ((((now_ms + ms) as u64) * 1000) & !1).to_string();
        assert_eq!(vouched_wall_ms(Some(&ahead(60_000)), now_ms), None);
        assert_eq!(vouched_wall_ms(Some(&ahead(400)), now_ms), Some(now_ms));
    }

    #[test]
    fn huge_client_cursor_does_not_ratchet() {
        let before = next_cursor(None, Gap::Vouched);
        let huge = next_cursor(Some(&u64::MAX.to_string()), Gap::Vouched);
        assert_eq!(huge, u64::MAX);
        let big = u64::MAX / 2;
        assert_eq!(next_cursor(Some(&big.to_string()), Gap::Vouched), big + 1);
        let after = next_cursor(None, Gap::Vouched);
        assert!(after > before);
        assert!(after < before + MAX_RATCHET);
    }
}
