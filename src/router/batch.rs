//! Natural batching of change records across environments: the hydrate stage of the change
//! path, and the one task that reads the change source.
//!
//! The dispatcher ([`dispatch`]) takes the source's events itself: a record is counted as
//! received and queued here ([`super::Inner::arrival`]), a subscription confirmation or a
//! reconnect is applied at once ([`super::Inner::receive`]). When no hydrate is in
//! flight, the first arrival starts one AT ONCE: an idle router adds no delay. A batch routes
//! its arrivals as it starts ([`super::Inner::route`]: sequence, buffer, match against the feeds
//! held then), so a feed that registers while records wait is simply matched.
//! Arrivals that come while a hydrate is in flight queue up and go together in the next one,
//! which starts the moment the previous one ends: under load, batches grow by themselves (a
//! burst of records on one run costs one hydrate per batch, not one per record). A queued
//! arrival never waits longer than `router.coalesce_ceiling_ms` behind a slow hydrate: past
//! that, another batch starts in parallel (at most [`MAX_IN_FLIGHT`]). A batch holds at most
//! `router.hydrate_batch_max_runs` runs, from any number of environments: the store reads them
//! in one query per column set.
//!
//! The only other producer is the stale tripwire ([`super::tripwire`]): its re-hydrates reach
//! the dispatcher through a channel of at most [`REHYDRATES`] arrivals ([`Rehydrates`]); one
//! that finds it full is a gap in its environment, like a record the queue has no room for.
//!
//! **The queue is bounded:** at most `router.max_queued_records` records wait (an arrival
//! weighs its records). An arrival that does not fit is dropped, and the drop is a gap in its
//! environment ([`super::Inner::overflow`]): the feeds held there re-read from the store, as
//! after a lost Redis connection, and the environment's replay cursors stop vouching for it.
//! So a store that is down or slow under a high rate of records costs a bounded amount of
//! memory, and correctness rests on the re-reads once it is back. Routing and hydrating never
//! block the dispatcher (hydrates run on tasks of their own), so it keeps taking the source's
//! events while the store hangs, and the source's queue does not fill behind it.
//!
//! The fixed leading-edge window of trigger.dev's notifier (`ENV_WAKE_COALESCE_WINDOW_MS`,
//! docs/behaviours.md NTF-16..19) delayed every second change of an environment by up to the
//! window, even when nothing else was happening; here no record waits for a timer.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Env, Inner, Slot};
use crate::cache::FastMap;
use crate::changes::{ChangeRecord, EventReceiver, EVENT_QUEUE};
use crate::protocol::{ColumnSet, EnvId, RunId};

/// Most hydrate batches in flight at once (only the ceiling starts more than one).
pub const MAX_IN_FLIGHT: usize = 4;

/// Most stale re-hydrates ([`super::tripwire`]) handed to the dispatcher and not yet taken into
/// its queue. The dispatcher takes them all at every turn, so this only absorbs a turn spent
/// routing a batch; a re-hydrate that finds it full is a gap in its environment, like an
/// arrival the queue has no room for. Each carries at most `router.hydrate_batch_max_runs`
/// records (one batch's stale runs of one environment).
pub(super) const REHYDRATES: usize = 1_024;

/// Most source events the dispatcher takes in one turn before it routes what it took (the
/// source's queue holds no more, so one turn empties it unless the source keeps refilling it).
const EVENTS_PER_TURN: usize = EVENT_QUEUE;

/// Records of one environment waiting for their batch.
pub(super) struct Arrival {
    pub env_id: EnvId,
    pub records: Vec<ChangeRecord>,
    /// 0 for a first pass; > 0 for a stale re-hydrate (see [`super::tripwire`]).
    pub attempt: u32,
    /// When its records arrived (the read-your-writes gate waits for commits before this).
    pub arrived: Instant,
}

/// An arrival routed as its batch started ([`super::Inner::route`]): sequenced, buffered,
/// matched against the feeds held then, and in its environment's in-flight set until delivered.
pub(super) struct Routed {
    pub env: Arc<Env>,
    pub records: Vec<ChangeRecord>,
    /// The first sequence of its records (its key in the environment's in-flight set).
    pub first_seq: u64,
    /// Matched feeds → the runs each is a candidate for.
    pub matches: FastMap<u64, (Arc<Slot>, BTreeSet<RunId>)>,
    /// Column set → the matched runs needing that projection.
    pub groups: FastMap<ColumnSet, BTreeSet<RunId>>,
    /// 0 for a first pass; > 0 for a stale re-hydrate (see [`super::tripwire`]).
    pub attempt: u32,
    /// When its records arrived (the read-your-writes gate waits for commits before this).
    pub arrived: Instant,
}

impl Arrival {
    /// Its weight toward [`BatchLimits::max_runs`] (an upper bound on the runs it adds).
    fn runs(&self) -> usize {
        self.records.len()
    }
}

/// How batches are formed (`[router]`).
#[derive(Clone, Copy, Debug)]
pub(super) struct BatchLimits {
    /// Longest a queued arrival waits behind in-flight hydrates before another batch starts.
    pub ceiling: Duration,
    /// Most runs (summed over column sets) in one batch.
    pub max_runs: usize,
    /// Most records queued (`router.max_queued_records`); see the module doc for overflow.
    pub max_queued: usize,
}

/// The stale tripwire's way into the dispatcher: a channel of at most [`REHYDRATES`] arrivals
/// (cheap to clone). Its receiver goes to [`dispatch`].
#[derive(Clone)]
pub(super) struct Rehydrates {
    tx: mpsc::Sender<Arrival>,
}

impl Rehydrates {
    /// The sending side, and the receiving side for [`dispatch`].
    pub fn channel() -> (Rehydrates, mpsc::Receiver<Arrival>) {
        let (tx, rx) = mpsc::channel(REHYDRATES);
        (Rehydrates { tx }, rx)
    }

    /// Hands `arrival` to the dispatcher; gives it back when [`REHYDRATES`] already wait (or
    /// the dispatcher is gone): the caller treats it as a gap.
    pub fn push(&self, arrival: Arrival) -> Result<(), Arrival> {
        self.tx.try_send(arrival).map_err(|err| match err {
            mpsc::error::TrySendError::Full(a) | mpsc::error::TrySendError::Closed(a) => a,
        })
    }
}

/// What the dispatcher reads: the change source's events and the tripwire's re-hydrates.
pub(super) struct Inputs {
    /// The source's events (bounded by [`EVENT_QUEUE`]; see [`crate::changes::EVENT_QUEUE`]
    /// for what a full queue means).
    pub events: EventReceiver,
    /// The re-hydrates of [`Rehydrates`] (bounded by [`REHYDRATES`]).
    pub rehydrates: mpsc::Receiver<Arrival>,
}

/// Takes the next batch off the front of `queue`: whole arrivals, until `max_runs` is reached
/// (always at least one).
fn take_batch(queue: &mut VecDeque<(Instant, Arrival)>, max_runs: usize) -> Vec<Arrival> {
    let mut batch = Vec::new();
    let mut runs = 0;
    while let Some((_, front)) = queue.front() {
        if !batch.is_empty() && runs + front.runs() > max_runs {
            break;
        }
        runs += front.runs();
        if let Some((_, arrival)) = queue.pop_front() {
            batch.push(arrival);
        }
    }
    batch
}

/// The dispatcher: takes the source's events and the tripwire's re-hydrates, queues the
/// arrivals (at most `limits.max_queued` records) and starts hydrate batches. Ends when the
/// router is gone (its `inner` dropped: the re-hydrates' sender goes with it).
pub(super) async fn dispatch(inner: Weak<Inner>, inputs: Inputs, limits: BatchLimits) {
    let Inputs {
        mut events,
        mut rehydrates,
    } = inputs;
    // The source may end before the router (its sender dropped); re-hydrates still come.
    let mut events_open = true;
    // At most `limits.max_queued` records (`router.max_queued_records`); an arrival beyond that
    // is a gap in its environment (module doc).
    let mut queue: VecDeque<(Instant, Arrival)> = VecDeque::new();
    // Records in `queue`, against `limits.max_queued`.
    let mut queued_records = 0usize;
    let mut running: JoinSet<()> = JoinSet::new();
    loop {
        // The ceiling can start a batch only while a slot is free: with every slot taken, the
        // next start waits for a batch to end (a ceiling already past would wake this loop at
        // once, again and again, for as long as the store hangs).
        let ceiling_at = queue
            .front()
            .filter(|_| !running.is_empty() && running.len() < MAX_IN_FLIGHT)
            .map(|(queued, _)| *queued + limits.ceiling);
        // What this turn took from the source (already counted as received).
        let mut taken: Vec<Arrival> = Vec::new();
        tokio::select! {
            biased;
            event = events.recv(), if events_open => {
                let Some(event) = event else {
                    events_open = false;
                    continue;
                };
                let Some(inner) = inner.upgrade() else { break };
                let more = std::iter::from_fn(|| events.try_recv().ok());
                for event in std::iter::once(event).chain(more).take(EVENTS_PER_TURN) {
                    taken.extend(inner.receive(event));
                }
            }
            next = rehydrates.recv() => {
                let Some(arrival) = next else { break };
                taken.push(arrival);
            }
            Some(_) = running.join_next(), if !running.is_empty() => {}
            () = tokio::time::sleep_until(ceiling_at.unwrap_or_else(Instant::now)), if ceiling_at.is_some() => {}
        }
        // Re-hydrates are taken at every turn, whatever woke it (a busy source cannot starve them).
        taken.extend(std::iter::from_fn(|| rehydrates.try_recv().ok()).take(REHYDRATES));
        let Some(inner) = inner.upgrade() else { break };
        if !taken.is_empty() {
            let now = Instant::now();
            let before = queue.len();
            for arrival in taken {
                if queued_records + arrival.runs() > limits.max_queued && !queue.is_empty() {
                    inner.overflow(arrival);
                    continue;
                }
                queued_records += arrival.runs();
                queue.push_back((now, arrival));
            }
            if !running.is_empty() {
                // These arrivals wait for a hydrate in flight (the only wait there is).
                let waited = (queue.len() - before) as u64;
                inner
                    .stats
                    .coalesce_waits
                    .fetch_add(waited, Ordering::Relaxed);
            }
        }
        while let Some((queued, _)) = queue.front() {
            let overdue = queued.elapsed() >= limits.ceiling;
            if !(running.is_empty() || (overdue && running.len() < MAX_IN_FLIGHT)) {
                break;
            }
            let taken = take_batch(&mut queue, limits.max_runs.max(1));
            queued_records -= taken.iter().map(Arrival::runs).sum::<usize>();
            let batch: Vec<Routed> = taken
                .into_iter()
                .filter_map(|arrival| inner.route(arrival))
                .collect();
            if batch.is_empty() {
                continue; // no held feed wanted any of it
            }
            inner
                .stats
                .coalesced_batches
                .fetch_add(1, Ordering::Relaxed);
            let inner = inner.clone();
            running.spawn(async move { inner.hydrate_batch(batch).await });
        }
    }
    // The router is gone: let the batches in flight finish their deliveries.
    while running.join_next().await.is_some() {}
}
