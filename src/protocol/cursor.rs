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

/// Client cursors further than this ahead of our own counter are answered (still strictly
/// greater) but do not ratchet the process-wide counter, so a crafted huge cursor cannot push
/// every later cursor to `u64::MAX`. 2^40 µs ≈ 12.7 days: far more than any clock skew between
/// instances whose cursors a client might carry over.
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

/// Returns the next cursor value: at least the wall clock in µs, strictly greater than every
/// value returned before by this process and than `client_cursor` when that parses as an
/// integer (Electric 1.6.4 rule), its lowest bit marking `gap`.
///
/// Exception (anti-abuse): a client cursor more than ~12.7 days (2^40) ahead of the process
/// counter gets `client + 1` (saturating) without advancing the counter for later calls.
/// Negative or non-integer client cursors are ignored.
pub fn next_cursor(client_cursor: Option<&str>, gap: Gap) -> u64 {
    let client = client_cursor.and_then(|c| c.trim().parse::<u64>().ok());
    let now = now_micros();
    let mut prev = CURSOR.load(Ordering::Relaxed);
    loop {
        let base = match client {
            Some(c) if c > prev && c - prev > MAX_RATCHET => return c.saturating_add(1),
            Some(c) => c.max(prev),
            None => prev,
        };
        let next = marked(base.saturating_add(1).max(now), gap);
        match CURSOR.compare_exchange_weak(prev, next, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(actual) => prev = actual,
        }
    }
}

/// The wall time (epoch ms) of the response whose cursor a client echoes, when that response
/// vouched for its gap ([`Gap::Vouched`]); `None` for anything else. Never later than `now_ms`:
/// a client can only claim to be less up to date than it is, which costs it a replay, or as up
/// to date as now, which can cost only its own feed the changes it skipped until its next
/// backstop read (it never shows it rows it may not read).
pub fn vouched_wall_ms(client_cursor: Option<&str>, now_ms: i64) -> Option<i64> {
    let c = client_cursor?.trim().parse::<u64>().ok()?;
    if c & 1 == 1 {
        return None;
    }
    let ms = i64::try_from(c / 1000).ok()?;
    Some(ms.min(now_ms))
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
        assert!(d > c);
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
        // A claim from the future reads as now.
        let future = (after as u64 + 3_600_000) * 1000;
        assert_eq!(
            vouched_wall_ms(Some(&future.to_string()), after),
            Some(after)
        );
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
