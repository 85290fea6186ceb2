//! The per-environment replay buffer: the latest (merged) record per run, ordered by the
//! environment's arrival sequence, bounded by age and count (REP-01..03).
//!
//! Unlike the reference, entries are ordered by a per-environment monotonic sequence number
//! assigned on arrival (docs/behaviours.md §4 item 2): a connection's replay cursor is "everything up to
//! sequence N was routed or answered", so no record that arrived before a response but was not
//! in it can be skipped by the next poll.

use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

use crate::cache::FastMap;
use crate::changes::ChangeRecord;
use crate::protocol::RunId;

/// One buffered record.
#[derive(Clone, Debug)]
pub struct Buffered {
    pub seq: u64,
    pub received_at: Instant,
    /// Arrival wall-clock time, epoch ms (for cursors handed out by other instances).
    pub received_wall_ms: i64,
    pub record: ChangeRecord,
}

/// Why an entry left the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eviction {
    /// Older than the replay window.
    Window,
    /// The buffer exceeded its cap.
    Cap,
}

/// Latest record per run, by arrival sequence.
#[derive(Debug, Default)]
pub struct ReplayBuffer {
    by_run: FastMap<RunId, Buffered>,
    by_seq: BTreeMap<u64, RunId>,
    /// Every sequence ≤ this has left the buffer (or been superseded by a later record of the
    /// same run, which is still buffered). A cursor ≥ this is fully covered.
    evicted_through: u64,
    /// Newest arrival wall time (epoch ms) that left the buffer.
    evicted_wall_ms: i64,
}

impl ReplayBuffer {
    /// Buffers `record` under `seq`, merging it into an earlier buffered record of the same run
    /// (the merged entry moves to `seq`). Returns the evictions it caused.
    pub fn insert(
        &mut self,
        seq: u64,
        record: ChangeRecord,
        now: Instant,
        window: Duration,
        cap: usize,
    ) -> Vec<Eviction> {
        let wall_ms =
            crate::clock::now_ms() - i64::try_from(now.elapsed().as_millis()).unwrap_or(0);
        let merged = match self.by_run.remove(&record.run_id) {
            Some(mut earlier) => {
                self.by_seq.remove(&earlier.seq);
                earlier.record.merge_from(record);
                earlier.record
            }
            None => record,
        };
        self.by_seq.insert(seq, merged.run_id.clone());
        self.by_run.insert(
            merged.run_id.clone(),
            Buffered {
                seq,
                received_at: now,
                received_wall_ms: wall_ms,
                record: merged,
            },
        );
        self.evict(now, window, cap)
    }

    fn evict(&mut self, now: Instant, window: Duration, cap: usize) -> Vec<Eviction> {
        let mut evictions = Vec::new();
        while let Some((&seq, run_id)) = self.by_seq.iter().next() {
            let Some(entry) = self.by_run.get(run_id) else {
                self.by_seq.remove(&seq);
                continue;
            };
            let expired = now.saturating_duration_since(entry.received_at) > window;
            if !expired && self.by_seq.len() <= cap {
                break;
            }
            evictions.push(if expired {
                Eviction::Window
            } else {
                Eviction::Cap
            });
            let entry_wall = entry.received_wall_ms;
            let run_id = run_id.clone();
            self.by_seq.remove(&seq);
            self.by_run.remove(&run_id);
            self.evicted_through = self.evicted_through.max(seq);
            self.evicted_wall_ms = self.evicted_wall_ms.max(entry_wall);
        }
        evictions
    }

    /// Whether every record with a sequence greater than `cursor` is still buffered.
    pub fn covers(&self, cursor: u64) -> bool {
        cursor >= self.evicted_through
    }

    /// Whether every record that arrived at or after `from_ms` (wall clock) is still buffered.
    pub fn covers_wall(&self, from_ms: i64) -> bool {
        self.evicted_wall_ms < from_ms
    }

    /// Buffered records that arrived at or after `from_ms` (wall clock), oldest first.
    pub fn since_wall(&self, from_ms: i64) -> impl Iterator<Item = &Buffered> {
        self.by_seq
            .values()
            .filter_map(|run_id| self.by_run.get(run_id))
            .filter(move |b| b.received_wall_ms >= from_ms)
    }

    /// Buffered records with a sequence greater than `cursor`, oldest first.
    pub fn since(&self, cursor: u64) -> impl Iterator<Item = &Buffered> {
        self.by_seq
            .range(cursor.saturating_add(1)..)
            .filter_map(|(_, run_id)| self.by_run.get(run_id))
    }

    /// Number of buffered runs.
    pub fn len(&self) -> usize {
        self.by_seq.len()
    }

    /// Whether nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.by_seq.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(run: &str, ms: Option<i64>) -> ChangeRecord {
        ChangeRecord::test_record(run, Some(vec![]), ms)
    }

    #[test]
    fn rep_01_latest_record_per_run_moves_to_the_tail() {
        let mut b = ReplayBuffer::default();
        let now = Instant::now();
        let w = Duration::from_secs(2);
        b.insert(1, rec("r1", Some(10)), now, w, 10);
        b.insert(2, rec("r2", None), now, w, 10);
        b.insert(3, rec("r1", None), now, w, 10);
        let order: Vec<_> = b
            .since(0)
            .map(|e| (e.seq, e.record.run_id.clone()))
            .collect();
        assert_eq!(order, vec![(2, "r2".into()), (3, "r1".into())]);
        // Merged, not replaced: the watermark of the earlier record survives.
        let r1 = b.since(2).next().map(|e| e.record.updated_at_ms);
        assert_eq!(r1, Some(Some(10)));
        assert!(b.covers(0), "superseding is not eviction");
    }

    #[test]
    fn rep_02_cap_evicts_oldest_and_uncovers_old_cursors() {
        let mut b = ReplayBuffer::default();
        let now = Instant::now();
        let w = Duration::from_secs(2);
        let mut ev = Vec::new();
        for (i, r) in ["r1", "r2", "r3"].iter().enumerate() {
            ev.extend(b.insert(i as u64 + 1, rec(r, None), now, w, 2));
        }
        assert_eq!(ev, vec![Eviction::Cap]);
        let runs: Vec<_> = b.since(0).map(|e| e.record.run_id.clone()).collect();
        assert_eq!(runs, vec!["r2", "r3"]);
        assert!(!b.covers(0));
        assert!(b.covers(1));
    }

    #[test]
    fn rep_02_window_evicts_expired_entries() {
        let mut b = ReplayBuffer::default();
        let t0 = Instant::now();
        let w = Duration::from_millis(50);
        b.insert(1, rec("r1", None), t0, w, 10);
        let ev = b.insert(2, rec("r2", None), t0 + Duration::from_millis(60), w, 10);
        assert_eq!(ev, vec![Eviction::Window]);
        assert_eq!(b.len(), 1);
    }
}
