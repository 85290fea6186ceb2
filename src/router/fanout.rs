//! The fan-out of change records: sequencing and buffering each arrival, matching it against the
//! index, hydrating the matched runs with ONE store query per column set, serializing each ONCE,
//! and pushing the shared rows into every matching feed's inbox.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use super::batch::{Arrival, Routed};
use super::{Buffered, Env, Eviction, FeedFilter, GateOutcome, HydratedRows, Inner, Slot};
use crate::cache::{FastMap, TtlCache};
use crate::changes::ChangeRecord;
use crate::protocol::encode::serialize_row;
use crate::protocol::{ColumnSet, EnvId, RunId, SerializedRow};
use crate::store::StoreError;

/// Most bytes of replayed rows kept for sharing ([`SharedReplays`]): a few hundred large rows.
const SHARED_REPLAY_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// The buffered records one replay hydrates: the environment's incarnation (`epoch`, unique
/// per process) and each record's run and sequence. A sequence names one merged record of
/// its run, so two replays with the same key read the same versions' worth of records.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ReplayKey {
    env_id: EnvId,
    epoch: u64,
    cols: ColumnSet,
    runs: Vec<(RunId, u64)>,
}

/// The rows one replay hydrated, and whether the read-your-writes gate let it through (a read
/// the gate gave up on is handed to the feeds waiting for it, but not kept).
struct ReplayRows {
    rows: FastMap<RunId, SerializedRow>,
    settled: bool,
}

/// Replay hydrates shared by every registration replaying the same buffered records within
/// the replay window: one store read and one serialization per row version, however many
/// feeds replay it (identical concurrent replays share the read in flight). Without it, feeds
/// that register just after a change of their run — an SSE stream between two holds, a
/// long-poll between its response and its next poll — each hydrate and keep a private copy
/// of the same row.
pub(super) struct SharedReplays {
    /// Bound: [`SHARED_REPLAY_MAX_BYTES`] of rows ([`replay_weight`]); TTL: the replay window
    /// (at least 1 ms). Single-flighted loads ([`TtlCache::get_or_load`]).
    cache: TtlCache<ReplayKey, Arc<ReplayRows>>,
}

/// What a shared replay weighs against [`SHARED_REPLAY_MAX_BYTES`], bytes (its rows' serialized
/// bytes plus a fixed overhead per row and per replay).
fn replay_weight(replay: &Arc<ReplayRows>) -> u64 {
    crate::protocol::held_bytes(replay.rows.values())
}

impl SharedReplays {
    /// Kept for `window` (the replay window: older records are no longer replayed), at most
    /// [`SHARED_REPLAY_MAX_BYTES`] of rows.
    pub(super) fn new(window: Duration) -> SharedReplays {
        SharedReplays {
            cache: TtlCache::weighted(
                SHARED_REPLAY_MAX_BYTES,
                window.max(Duration::from_millis(1)),
                replay_weight,
            ),
        }
    }
}

impl Inner {
    /// Hydrates buffered records for one feed: behind the read-your-writes gate like the live
    /// path (a record still in its batch's gate wait must not be read early from the replica),
    /// then the feed's authoritative filter (REP-06/07). Feeds replaying the same records
    /// share one gate wait, read and serialization ([`SharedReplays`]).
    pub(super) async fn replay(
        &self,
        env: &Env,
        filter: &FeedFilter,
        cols: ColumnSet,
        buffered: &[Buffered],
    ) -> Result<Vec<SerializedRow>, ()> {
        let key = ReplayKey {
            env_id: env.id.clone(),
            epoch: env.state.lock().epoch,
            cols,
            runs: buffered
                .iter()
                .map(|b| (b.record.run_id.clone(), b.seq))
                .collect(),
        };
        let read = async {
            let mut settled = true;
            if let Some(gate) = &self.gate {
                let newest = buffered.iter().map(|b| b.received_at).max();
                if let Some(newest) = newest {
                    let records: Vec<ChangeRecord> =
                        buffered.iter().map(|b| b.record.clone()).collect();
                    let outcome = gate.wait(&records, newest).await;
                    settled = matches!(outcome, GateOutcome::Applied | GateOutcome::NoReplica);
                }
            }
            let ids: Vec<RunId> = buffered.iter().map(|b| b.record.run_id.clone()).collect();
            let rows = self.hydrate(&env.id, &ids, cols).await?;
            Ok::<_, ()>(Arc::new(ReplayRows { rows, settled }))
        };
        let shared = self
            .replays
            .cache
            .get_or_load(key.clone(), read)
            .await
            .map_err(|_| ())?;
        if !shared.settled {
            self.replays.cache.remove(&key);
        }
        Ok(shared
            .rows
            .values()
            .filter(|r| filter.accepts(&r.meta))
            .cloned()
            .collect())
    }

    /// One store query for `ids`, each row serialized once. `Err(())` after logging a failure.
    pub(super) async fn hydrate(
        &self,
        env_id: &EnvId,
        ids: &[RunId],
        cols: ColumnSet,
    ) -> Result<FastMap<RunId, SerializedRow>, ()> {
        let result = self.store.hydrate(env_id, ids, cols).await;
        let rows = self.counted(result, format_args!("environment {env_id}"))?;
        Ok(rows
            .iter()
            .map(|row| (row.id.clone(), serialize_row(row, cols)))
            .collect())
    }

    /// Counts one hydrate's outcome in the router's stats; on a failure logs it with `scope`
    /// (the environment, or the number of runs) and gives `Err(())`: the feeds fall back to
    /// their backstop or re-check from the store.
    fn counted<T>(
        &self,
        result: Result<Vec<T>, StoreError>,
        scope: std::fmt::Arguments<'_>,
    ) -> Result<Vec<T>, ()> {
        self.stats.hydrates.fetch_add(1, Ordering::Relaxed);
        match result {
            Ok(rows) => {
                self.stats
                    .hydrated_rows
                    .fetch_add(rows.len() as u64, Ordering::Relaxed);
                Ok(rows)
            }
            Err(err) => {
                self.stats.hydrate_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%scope, error = %err, "router hydrate failed; feeds fall back to their backstop or re-read");
                Err(())
            }
        }
    }

    /// Records of `env_id` arrived: counts them as received and makes them an arrival for the
    /// hydrate queue ([`batch`](super::batch)), which routes them when their batch starts — at
    /// once when no hydrate is in flight. `None` when the environment is not routed. A non-zero
    /// `attempt` is a re-hydrate of records the stale tripwire withheld (or an echo pass after
    /// giving up).
    pub(super) fn arrival(
        &self,
        env_id: &EnvId,
        records: Vec<ChangeRecord>,
        attempt: u32,
        arrived: Instant,
    ) -> Option<Arrival> {
        let env = self.env(env_id)?;
        env.received.fetch_add(1, Ordering::SeqCst);
        Some(Arrival {
            env_id: env_id.clone(),
            records,
            attempt,
            arrived,
        })
    }

    /// A re-hydrate of records of `env_id` the stale tripwire withheld, arriving now: handed to
    /// the batch dispatcher (`batch::REHYDRATES` at most wait); one that finds no room is a gap
    /// in its environment ([`Inner::overflow`]).
    pub(super) fn rehydrate(&self, env_id: &EnvId, records: Vec<ChangeRecord>, attempt: u32) {
        let arrived = Instant::now();
        if let Some(arrival) = self.arrival(env_id, records, attempt, arrived) {
            if let Err(arrival) = self.rehydrates.push(arrival) {
                self.overflow(arrival);
            }
        }
    }

    /// Routes an arrival as its batch starts: sequences its records, buffers them for replay
    /// and matches them against the feeds held NOW (under the environment's lock, no awaits).
    /// `None` when no held feed wants them (they stay replayable; nothing to hydrate).
    ///
    /// Records are sequenced here and not on arrival: a feed that registers while its records
    /// wait for the batch is matched when the batch starts, instead of replaying them itself
    /// with a hydrate of its own.
    pub(super) fn route(&self, arrival: Arrival) -> Option<Routed> {
        let env = self.env(&arrival.env_id)?;
        // Counted routed once sequenced below (the guard runs after the lock is released).
        struct CountRouted(Arc<Env>);
        impl Drop for CountRouted {
            fn drop(&mut self) {
                self.0.routed.fetch_add(1, Ordering::SeqCst);
                self.0.routed_changed.notify_waiters();
            }
        }
        let _routed = CountRouted(env.clone());
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        let window = Duration::from_millis(self.cfg.replay_window_ms);
        let now = Instant::now();
        let records = arrival.records;
        let mut state = env.state.lock();
        let first_seq = state.last_seq + 1;
        let mut matches: FastMap<u64, (Arc<Slot>, BTreeSet<RunId>)> = FastMap::default();
        let mut groups: FastMap<ColumnSet, BTreeSet<RunId>> = FastMap::default();
        for record in &records {
            state.last_seq += 1;
            for id in state.candidates(record) {
                if let Some(slot) = state.feeds.get(&id) {
                    groups
                        .entry(slot.cols)
                        .or_default()
                        .insert(record.run_id.clone());
                    matches
                        .entry(id)
                        .or_insert_with(|| (slot.clone(), BTreeSet::new()))
                        .1
                        .insert(record.run_id.clone());
                }
            }
        }
        if !window.is_zero() {
            let cap = self.cfg.replay_max_runs;
            for (seq, record) in (first_seq..).zip(records.iter().cloned()) {
                for eviction in state.buffer.insert(seq, record, now, window, cap) {
                    let counter = match eviction {
                        Eviction::Window => &self.stats.evictions_window,
                        Eviction::Cap => &self.stats.evictions_cap,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if matches.is_empty() {
            return None;
        }
        let last = state.last_seq;
        state.in_flight.insert(first_seq, last);
        drop(state);
        Some(Routed {
            env,
            records,
            first_seq,
            matches,
            groups,
            attempt: arrival.attempt,
            arrived: arrival.arrived,
        })
    }

    /// Hydrates one batch of arrivals (any environments): waits for the read-your-writes gate,
    /// reads every matched run in ONE query per column set, serializes each row ONCE per column
    /// set, lets the tripwire withhold stale rows, delivers to the matched feeds' inboxes, marks
    /// the arrivals routed, then wakes the feeds (so a woken feed's response cursor already
    /// covers its arrival and its next poll does not replay it).
    pub(super) async fn hydrate_batch(self: Arc<Self>, arrivals: Vec<Routed>) {
        // Whatever happens below, every arrival leaves the in-flight set.
        struct Done(Arc<Env>, u64);
        impl Drop for Done {
            fn drop(&mut self) {
                self.0.state.lock().in_flight.remove(&self.1);
            }
        }
        let done: Vec<Done> = arrivals
            .iter()
            .map(|a| Done(a.env.clone(), a.first_seq))
            .collect();
        // 1. Read-your-writes: hydrate only what the replica has applied (first passes only;
        //    retries were already delayed).
        let first_pass: Vec<ChangeRecord> = arrivals
            .iter()
            .filter(|a| a.attempt == 0)
            .flat_map(|a| a.records.iter().cloned())
            .collect();
        let newest = arrivals
            .iter()
            .filter(|a| a.attempt == 0)
            .map(|a| a.arrived)
            .max();
        let outcome = match (&self.gate, newest) {
            (Some(gate), Some(arrived)) => Some(gate.wait(&first_pass, arrived).await),
            _ => None,
        };
        // 2. One query per column set over every environment's runs.
        let mut wanted: FastMap<ColumnSet, BTreeSet<(EnvId, RunId)>> = FastMap::default();
        for arrival in &arrivals {
            for (cols, ids) in &arrival.groups {
                let set = wanted.entry(*cols).or_default();
                set.extend(ids.iter().map(|id| (arrival.env.id.clone(), id.clone())));
            }
        }
        self.stats.distinct_runs.fetch_add(
            wanted.values().map(|runs| runs.len() as u64).sum(),
            Ordering::Relaxed,
        );
        let inner = &self;
        let hydrated = futures::future::join_all(wanted.into_iter().map(|(cols, runs)| {
            let runs: Vec<(EnvId, RunId)> = runs.into_iter().collect();
            async move { (cols, inner.hydrate_many(&runs, cols).await.ok()) }
        }))
        .await;
        let hydrated: FastMap<ColumnSet, Option<HydratedRows>> = hydrated.into_iter().collect();
        // 3. Per arrival: tripwire, then deliver.
        let mut woken = Vec::new();
        let mut deliveries = 0u64;
        for arrival in arrivals {
            let env_id = &arrival.env.id;
            // A failed hydrate must not pass silently under the cursors: its feeds re-check
            // from the store (and answer with an untrusted cursor if that fails too).
            let view: FastMap<ColumnSet, Option<FastMap<RunId, SerializedRow>>> = arrival
                .groups
                .iter()
                .map(|(cols, ids)| {
                    let rows = hydrated.get(cols).and_then(Option::as_ref).map(|rows| {
                        ids.iter()
                            .filter_map(|id| {
                                rows.get(&(env_id.clone(), id.clone()))
                                    .map(|row| (id.clone(), row.clone()))
                            })
                            .collect()
                    });
                    (*cols, rows)
                })
                .collect();
            let outcome = outcome.filter(|_| arrival.attempt == 0);
            let withheld = self.tripwire(env_id, &arrival.records, &view, outcome, arrival.attempt);
            for (_, (slot, run_ids)) in arrival.matches {
                let Some(rows_by_id) = view.get(&slot.cols).and_then(Option::as_ref) else {
                    slot.push_recheck();
                    woken.push(slot);
                    continue;
                };
                let rows: Vec<SerializedRow> = run_ids
                    .iter()
                    .filter(|id| !withheld.contains(*id))
                    .filter_map(|id| rows_by_id.get(id))
                    .filter(|row| slot.filter.accepts(&row.meta))
                    .cloned()
                    .collect();
                if !rows.is_empty() {
                    deliveries += rows.len() as u64;
                    slot.push(rows);
                    woken.push(slot);
                }
            }
        }
        self.stats
            .deliveries
            .fetch_add(deliveries, Ordering::Relaxed);
        drop(done);
        for slot in woken {
            slot.notify.notify_one();
        }
    }

    /// One store query for `runs` (any environments), each row serialized once. `Err(())`
    /// after logging a failure.
    pub(super) async fn hydrate_many(
        &self,
        runs: &[(EnvId, RunId)],
        cols: ColumnSet,
    ) -> Result<FastMap<(EnvId, RunId), SerializedRow>, ()> {
        self.metrics.hydrated_batch(runs.len());
        let result = self.store.hydrate_many(runs, cols).await;
        let rows = self.counted(result, format_args!("{} runs", runs.len()))?;
        Ok(rows
            .iter()
            .map(|(env, row)| ((env.clone(), row.id.clone()), serialize_row(row, cols)))
            .collect())
    }
}
