//! The per-instance change router (trigger.dev's `EnvChangeRouter`, apps/webapp/app/services/realtime/envChangeRouter.server.ts; docs/behaviours.md §0).
//!
//! Per environment it keeps an inverted index of the feeds currently held by a poll (by run id,
//! tag and batch id), a replay buffer of recent change records and a lingering subscription.
//! Each coalesced batch of records is routed through the index; the matched runs are hydrated
//! with ONE store query per column set and serialized ONCE per (run, column set); the shared
//! rows are pushed into each matching feed's inbox and the feed is woken.
//!
//! Where it differs from the reference (docs/behaviours.md §4):
//! - records get a per-environment arrival sequence; a connection's replay cursor is the
//!   sequence through which every record was routed ([`ReplayCursor`]), so nothing that arrived
//!   before a response but was not in it is skipped (item 2);
//! - replay coverage starts when the source confirms the subscription, and a subscriber
//!   reconnect invalidates every cursor and asks held feeds to re-check (items 5, 6);
//! - a match for a feed that is registered but busy (cold re-check, building a response) is
//!   parked in its inbox instead of dropped;
//! - partial records are classified for batch feeds too (item 10).
//!
//! **Queues on the change path**, each bounded, and what overflow means. One task, the batch
//! dispatcher ([`batch`]), reads the source and feeds the hydrates; nothing sits between them:
//! 1. the source's events ([`crate::changes::EVENT_QUEUE`], 8 192 events), taken by the
//!    dispatcher, which waits for nothing (hydrates run on tasks of their own): when full, the
//!    Redis reader waits, fred's buffer behind it overflows, and the reader reports a gap
//!    (every environment's feeds re-read);
//! 2. the stale tripwire's re-hydrates (`batch::REHYDRATES`, 1 024 arrivals), the only other
//!    way into the dispatcher: a re-hydrate that finds it full is a gap in its environment;
//! 3. the records waiting for a hydrate batch (`router.max_queued_records`, 100 000 by
//!    default): an arrival that finds it full is dropped, a gap in its environment (a new
//!    epoch, every feed held there re-reads from the store).
//!
//! Every gap of 2. and 3. counts in `runfeed_router_queue_overflows_total` and still counts as
//! routed ([`Router::routed`] waiters go on).

mod batch;
mod buffer;
mod fanout;
mod filter;
pub mod gate;
mod index;
mod registration;
mod tripwire;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use parking_lot::Mutex;
use tokio::sync::Notify;

pub use buffer::{Buffered, Eviction, ReplayBuffer};
pub use filter::FeedFilter;
pub use gate::{Gate, GateOutcome};

use crate::cache::{FastMap, FastSet};
use crate::changes::{ChangeRecord, ChangeSource, SourceEvent};
use crate::config::RouterConfig;
use crate::protocol::{BatchId, ColumnSet, EnvId, RunId, SerializedRow};
use crate::store::RunStore;
use crate::telemetry::metrics::Metrics;
use batch::{Arrival, BatchLimits, Rehydrates};

/// Rows of one hydrate, by environment and run.
type HydratedRows = FastMap<(EnvId, RunId), SerializedRow>;

/// Where a connection's view of an environment's change stream ends: every record with a
/// sequence ≤ `seq` in subscription `epoch` was routed to it or answered. `epoch == 0` means
/// "no usable position" (subscription not confirmed yet, or unknown).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ReplayCursor {
    pub epoch: u64,
    pub seq: u64,
    /// The router instance that handed it out (random per process).
    pub instance: u64,
    /// Wall-clock time it was handed out, epoch ms. Another instance (a hop behind a
    /// non-sticky load balancer) replays what arrived since `wall_ms − router.hop_margin_ms`:
    /// clocks and each instance's copy of the change stream may differ by that much.
    /// Replaying a little more is harmless (the feed's diff drops what the client has).
    pub wall_ms: i64,
}

impl ReplayCursor {
    /// A cursor that replays what the router received since `wall_ms` (less
    /// `router.hop_margin_ms`), as after a hop between instances: instance 0 is no router's
    /// (theirs are odd). `epoch` 0 makes it unusable, as for any cursor.
    pub fn at_wall(epoch: u64, wall_ms: i64) -> ReplayCursor {
        ReplayCursor {
            epoch,
            seq: 0,
            instance: 0,
            wall_ms,
        }
    }
}

/// What a router is built from.
pub struct RouterParts {
    /// `[router]`.
    pub cfg: RouterConfig,
    /// Per-environment subscriptions (the router subscribes an environment while it has feeds).
    pub source: Arc<dyn ChangeSource>,
    /// Where matched runs are hydrated from.
    pub store: Arc<dyn RunStore>,
    /// What `source` reports.
    pub events: crate::changes::EventReceiver,
    /// The read-your-writes gate, when hydrates read a lagging replica: wake-path hydrates wait
    /// until the replica applied the announced commits, and rows still read stale are withheld
    /// and re-hydrated (see [`gate`]).
    pub gate: Option<Arc<Gate>>,
    /// Instruments (hydrate batch sizes).
    pub metrics: Arc<Metrics>,
}

/// A feed a poll holds: what it watches, in which column set, and where its client's view of
/// the change stream ends.
#[derive(Clone, Debug)]
pub struct Feed {
    /// The environment (every record and row is scoped to it).
    pub env_id: EnvId,
    /// What the feed watches.
    pub filter: FeedFilter,
    /// The columns its responses carry (one hydrate per column set).
    pub cols: ColumnSet,
    /// The replay cursor of the client's last response: records after it are replayed into the
    /// inbox at registration (`None`: the client's position is unknown, nothing is covered).
    pub since: Option<ReplayCursor>,
}

/// Where a replay starts.
enum ReplayFrom {
    /// After this arrival sequence (a cursor of this instance and subscription).
    Seq(u64),
    /// From this arrival wall time (a cursor of another instance).
    Wall(i64),
}

/// Counters the router keeps (tests, benchmarks and, later, metrics read them).
#[derive(Debug, Default)]
pub struct RouterStats {
    /// Store hydrate calls made by the router (live and replay).
    pub hydrates: AtomicU64,
    /// Rows those hydrates returned.
    pub hydrated_rows: AtomicU64,
    /// Arrivals routed through the index (each change record as it arrives, and each stale
    /// re-hydrate pass).
    pub batches: AtomicU64,
    /// Hydrate batches started (each reads its runs of every environment in one query per
    /// column set).
    pub coalesced_batches: AtomicU64,
    /// Arrivals that waited for a hydrate in flight before theirs could start (0 while the
    /// router is idle: nothing waits for a timer).
    pub coalesce_waits: AtomicU64,
    /// Σ distinct (column set, run) per routed batch (deliveries / this = fan-out).
    pub distinct_runs: AtomicU64,
    /// Σ (feed, row) deliveries.
    pub deliveries: AtomicU64,
    /// Replays that delivered rows / found nothing to deliver after hydrating.
    pub replays_delivered: AtomicU64,
    pub replays_empty: AtomicU64,
    /// Replay-buffer evictions by reason.
    pub evictions_window: AtomicU64,
    pub evictions_cap: AtomicU64,
    /// Hydrate failures (logged; the feeds re-check from the store).
    pub hydrate_errors: AtomicU64,
    /// Runs the stale tripwire withheld and a retry then found fresh.
    pub stale_recovered: AtomicU64,
    /// Runs delivered stale after the retry budget (echo passes follow).
    pub stale_gave_up: AtomicU64,
    /// Change records dropped because the hydrate queue was full (each a gap in its
    /// environment: its feeds re-read).
    pub overflows: AtomicU64,
}

/// What a woken feed finds in its inbox.
#[derive(Debug, Default)]
pub struct Wake {
    /// Matched rows (already checked against the feed's filter), in arrival order; a run may
    /// appear more than once (the later version last).
    pub rows: Vec<SerializedRow>,
    /// The change stream had a gap (subscriber reconnect): re-check from the store.
    pub recheck: bool,
}

impl Wake {
    fn is_empty(&self) -> bool {
        self.rows.is_empty() && !self.recheck
    }
}

struct Slot {
    filter: FeedFilter,
    cols: ColumnSet,
    inbox: Mutex<Wake>,
    notify: Notify,
}

impl Slot {
    /// Rows for the feed's next wake.
    fn push(&self, rows: Vec<SerializedRow>) {
        self.inbox.lock().rows.extend(rows);
    }

    /// The feed's next wake re-reads its filter (a gap: what it missed is unknown).
    fn push_recheck(&self) {
        self.inbox.lock().recheck = true;
    }

    fn take(&self) -> Wake {
        std::mem::take(&mut *self.inbox.lock())
    }
}

#[derive(Default)]
struct EnvState {
    epoch: u64,
    /// The change source's generation of this incarnation's subscribe request.
    generation: u64,
    /// The source confirmed that subscription (replay coverage starts here).
    active: bool,
    /// Wall time (epoch ms) since which the stream has been complete: confirmation or the last
    /// gap (reconnect).
    active_since_wall_ms: i64,
    /// When the stream last became complete (confirmation or reconnect). Records published
    /// before then may never arrive here, so store reads wait for the replica as if a record
    /// had arrived at this instant ([`Router::settle_replica`]).
    complete_since: Option<Instant>,
    /// Callers between `ensure_env` and inserting their feed (or finishing a touch): the env
    /// must not be torn down under them.
    pending: usize,
    last_seq: u64,
    /// Batches being routed: first seq → last seq.
    in_flight: BTreeMap<u64, u64>,
    buffer: ReplayBuffer,
    feeds: FastMap<u64, Arc<Slot>>,
    by_run: FastMap<RunId, FastSet<u64>>,
    by_tag: FastMap<String, FastSet<u64>>,
    by_batch: FastMap<BatchId, FastSet<u64>>,
    tag_feeds: FastSet<u64>,
    unfiltered_tag_feeds: FastSet<u64>,
    batch_feeds: FastSet<u64>,
    linger_generation: u64,
}

struct Env {
    id: EnvId,
    state: Mutex<EnvState>,
    /// Arrivals received (queued for their batch) and routed so far; a request can wait until
    /// every record received before it is routed ([`Router::received`], [`Router::routed`]).
    received: AtomicU64,
    routed: AtomicU64,
    routed_changed: Notify,
}

struct Inner {
    cfg: RouterConfig,
    source: Arc<dyn ChangeSource>,
    store: Arc<dyn RunStore>,
    gate: Option<Arc<Gate>>,
    /// The stale tripwire's way into the batch dispatcher (bounded: `batch::REHYDRATES`).
    rehydrates: Rehydrates,
    metrics: Arc<Metrics>,
    envs: Mutex<FastMap<EnvId, Arc<Env>>>,
    next_epoch: AtomicU64,
    next_feed_id: AtomicU64,
    /// This router's identity in cursors (random, non-zero).
    instance: u64,
    stats: RouterStats,
    /// Replay hydrates shared by the registrations replaying the same buffered records.
    replays: fanout::SharedReplays,
}

/// The router. Cheap to clone.
#[derive(Clone)]
pub struct Router {
    inner: Arc<Inner>,
}

impl Router {
    /// Starts a router (see [`RouterParts`]). Spawns its batch dispatcher on the current tokio
    /// runtime, which takes the source's events itself ([`batch`]); it ends when the last clone
    /// of the router is dropped.
    pub fn start(parts: RouterParts) -> Router {
        let RouterParts {
            cfg,
            source,
            store,
            events,
            gate,
            metrics,
        } = parts;
        let limits = BatchLimits {
            ceiling: Duration::from_millis(cfg.coalesce_ceiling_ms),
            max_runs: cfg.hydrate_batch_max_runs,
            max_queued: cfg.max_queued_records,
        };
        let (rehydrates, rehydrates_rx) = Rehydrates::channel();
        let inner = Arc::new(Inner {
            source,
            store,
            gate,
            rehydrates,
            metrics,
            envs: Mutex::new(FastMap::default()),
            next_epoch: AtomicU64::new(1),
            next_feed_id: AtomicU64::new(1),
            replays: fanout::SharedReplays::new(Duration::from_millis(cfg.replay_window_ms)),
            instance: rand::random::<u64>() | 1,
            stats: RouterStats::default(),
            cfg,
        });
        let inputs = batch::Inputs {
            events,
            rehydrates: rehydrates_rx,
        };
        tokio::spawn(batch::dispatch(Arc::downgrade(&inner), inputs, limits));
        Router { inner }
    }

    /// Makes sure `env_id` is subscribed (a snapshot's next live poll will need it) and returns
    /// the cursor a snapshot taken NOW may hand out. Take it before reading the store.
    pub fn touch(&self, env_id: &EnvId) -> ReplayCursor {
        let env = self.inner.ensure_env(env_id);
        let cursor = {
            let mut state = env.state.lock();
            state.pending -= 1;
            state.cursor(self.inner.instance)
        };
        self.inner.schedule_teardown_if_idle(&env);
        cursor
    }

    /// How many change records of `env_id` this router has received so far (0 when the
    /// environment is not routed). With [`Router::routed`], a request waits until every record
    /// received before it is routed, so what it reads or replays accounts for all of them.
    pub fn received(&self, env_id: &EnvId) -> u64 {
        self.inner
            .env(env_id)
            .map_or(0, |env| env.received.load(Ordering::SeqCst))
    }

    /// Waits until at least `received` records of `env_id` are routed (sequenced and buffered
    /// for replay), or `deadline`. Returns at once when the router is idle.
    pub async fn routed(&self, env_id: &EnvId, received: u64, deadline: Instant) {
        let Some(env) = self.inner.env(env_id) else {
            return;
        };
        loop {
            let changed = env.routed_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if env.routed.load(Ordering::SeqCst) >= received {
                return;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return;
            }
        }
    }

    /// Holds a store read of `env_id` behind the read-your-writes gate: when change records of
    /// the environment are buffered, waits until the replica has applied the commits they
    /// announce, at most until `max_delay_ms` after the newest arrived (one probe when that has
    /// passed). Returns whether the read may be trusted to reflect them (false: the replica is
    /// still behind; the caller re-reads, or hands out a cursor later polls re-check). Without
    /// a gate, or with nothing buffered, returns `true` at once.
    ///
    /// The instant the stream last became complete (subscription confirmed, or back after a
    /// reconnect) counts as an arrival for `max_delay_ms` after it: records published while this
    /// instance was not listening never arrive, but the commits they announced are before the
    /// primary's position at that instant (CORRECTNESS.md, checker seed 1504). Without this, a
    /// read right after a reconnect could come from a replica that had not applied them, count
    /// as settled, and be cached past the moment the replica had them.
    pub async fn settle_replica(&self, env_id: &EnvId) -> bool {
        let Some(gate) = &self.inner.gate else {
            return true;
        };
        let Some(env) = self.inner.env(env_id) else {
            return true;
        };
        let (recent, complete_since): (Vec<(Instant, ChangeRecord)>, _) = {
            let state = env.state.lock();
            let recent = state
                .buffer
                .since(0)
                .map(|b| (b.received_at, b.record.clone()))
                .collect();
            (recent, state.complete_since)
        };
        let gap = complete_since.filter(|at| at.elapsed() < gate.max_delay());
        let Some(newest) = recent.iter().map(|(at, _)| *at).chain(gap).max() else {
            return true;
        };
        let records: Vec<ChangeRecord> = recent.into_iter().map(|(_, r)| r).collect();
        !matches!(gate.wait(&records, newest).await, GateOutcome::GaveUp)
    }

    /// How long to wait before re-reading a store read [`Router::settle_replica`] did not
    /// settle (`None` without a gate).
    pub fn replica_retry_delay(&self) -> Option<Duration> {
        self.inner.gate.as_ref().map(|gate| gate.retry_delay())
    }

    /// The gate's `max_delay_ms` (`None` without a gate).
    pub fn replica_max_delay(&self) -> Option<Duration> {
        self.inner.gate.as_ref().map(|gate| gate.max_delay())
    }

    /// The runs named by `env_id`'s change records routed after `cursor` (one id per run), for
    /// a reader that keeps its own copy of runs current (`feeds::window`). `None`: the stream
    /// cannot vouch for that gap (another subscription epoch, records evicted from the replay
    /// buffer, replay turned off); the caller must read afresh.
    pub fn changed_since(&self, env_id: &EnvId, cursor: &ReplayCursor) -> Option<Vec<RunId>> {
        if self.inner.cfg.replay_window_ms == 0 {
            return None;
        }
        let env = self.inner.env(env_id)?;
        let state = env.state.lock();
        let from = state.replay_from(cursor, self.inner.instance, self.inner.hop_margin_ms())?;
        let ids = match from {
            ReplayFrom::Seq(seq) => state
                .buffer
                .since(seq)
                .map(|b| b.record.run_id.clone())
                .collect(),
            ReplayFrom::Wall(ms) => state
                .buffer
                .since_wall(ms)
                .map(|b| b.record.run_id.clone())
                .collect(),
        };
        Some(ids)
    }

    /// Whether the records of `env_id` routed after `cursor` can still be replayed (the same
    /// rule as [`Registration::replay_since`], without replaying anything).
    pub fn vouches_for(&self, env_id: &EnvId, cursor: &ReplayCursor) -> bool {
        if self.inner.cfg.replay_window_ms == 0 {
            return true;
        }
        self.inner.env(env_id).is_some_and(|env| {
            env.state
                .lock()
                .replay_from(cursor, self.inner.instance, self.inner.hop_margin_ms())
                .is_some()
        })
    }

    /// Router counters.
    pub fn stats(&self) -> &RouterStats {
        &self.inner.stats
    }

    /// The read-your-writes gate, when one is active.
    pub fn gate(&self) -> Option<&Arc<Gate>> {
        self.inner.gate.as_ref()
    }

    /// Held feeds by kind `(run, tag, batch)`.
    pub fn held_feeds(&self) -> (usize, usize, usize) {
        let envs: Vec<Arc<Env>> = self.inner.envs.lock().values().cloned().collect();
        let mut counts = (0, 0, 0);
        for env in envs {
            let state = env.state.lock();
            for slot in state.feeds.values() {
                match slot.filter {
                    FeedFilter::Run { .. } => counts.0 += 1,
                    FeedFilter::Tag { .. } => counts.1 += 1,
                    FeedFilter::Batch { .. } => counts.2 += 1,
                }
            }
        }
        counts
    }

    /// Arrivals still waiting for (or in) their hydrate, over every environment.
    #[cfg(test)]
    fn inner_in_flight(&self) -> usize {
        let envs: Vec<Arc<Env>> = self.inner.envs.lock().values().cloned().collect();
        envs.iter()
            .map(|env| env.state.lock().in_flight.len())
            .sum()
    }

    /// Environments currently routed (including lingering ones).
    pub fn active_envs(&self) -> usize {
        self.inner.envs.lock().len()
    }
}

impl Inner {
    fn hop_margin_ms(&self) -> i64 {
        i64::try_from(self.cfg.hop_margin_ms).unwrap_or(i64::MAX / 4)
    }

    fn env(&self, env_id: &EnvId) -> Option<Arc<Env>> {
        self.envs.lock().get(env_id).cloned()
    }

    /// The env's state, created and subscribed if needed, with one `pending` mark the caller
    /// must release ([`EnvState::pending`]).
    fn ensure_env(&self, env_id: &EnvId) -> Arc<Env> {
        let mut envs = self.envs.lock();
        if let Some(env) = envs.get(env_id) {
            let mut state = env.state.lock();
            // New interest cancels a pending teardown.
            state.linger_generation += 1;
            state.pending += 1;
            return env.clone();
        }
        let env = Arc::new(Env {
            id: env_id.clone(),
            state: Mutex::new(EnvState {
                epoch: self.next_epoch.fetch_add(1, Ordering::Relaxed),
                pending: 1,
                ..EnvState::default()
            }),
            received: AtomicU64::new(0),
            routed: AtomicU64::new(0),
            routed_changed: Notify::new(),
        });
        // Subscribe under the locks: the confirmation cannot be applied before the generation
        // is recorded (`subscribe` never blocks).
        env.state.lock().generation = self.source.subscribe(env_id);
        envs.insert(env_id.clone(), env.clone());
        env
    }

    /// One event of the change source, as the batch dispatcher takes it: a record becomes an
    /// arrival for the hydrate queue (counted as received; `None` when its environment is not
    /// routed), a confirmation activates its subscription, a reconnect is a gap everywhere.
    fn receive(&self, event: SourceEvent) -> Option<Arrival> {
        match event {
            SourceEvent::Record { env_id, record } => {
                self.arrival(&env_id, vec![record], 0, Instant::now())
            }
            SourceEvent::Subscribed { env_id, generation } => {
                if let Some(env) = self.env(&env_id) {
                    let mut state = env.state.lock();
                    // A late confirmation of an earlier incarnation's subscription must not
                    // vouch for this one.
                    if state.generation == generation && !state.active {
                        state.active = true;
                        state.active_since_wall_ms = crate::clock::now_ms();
                        state.complete_since = Some(Instant::now());
                    }
                }
                None
            }
            SourceEvent::Reconnected => {
                self.on_gap();
                None
            }
        }
    }

    /// The change stream lost records of every environment (the subscriber reconnected).
    fn on_gap(&self) {
        let envs: Vec<Arc<Env>> = self.envs.lock().values().cloned().collect();
        for env in envs {
            self.gap(&env);
        }
    }

    /// The change stream lost records of `env`: a new epoch (no replay cursor handed out before
    /// vouches for what follows), and every feed held there re-reads from the store.
    fn gap(&self, env: &Env) {
        let slots: Vec<Arc<Slot>> = {
            let mut state = env.state.lock();
            state.epoch = self.next_epoch.fetch_add(1, Ordering::Relaxed);
            state.active_since_wall_ms = crate::clock::now_ms();
            state.complete_since = Some(Instant::now());
            state.feeds.values().cloned().collect()
        };
        for slot in slots {
            slot.push_recheck();
            slot.notify.notify_one();
        }
    }

    /// An arrival the hydrate queue had no room for (`router.max_queued_records`), or a
    /// re-hydrate the dispatcher's channel had none for (`batch::REHYDRATES`): a gap in its
    /// environment. It still counts as routed, so requests waiting for it go on.
    fn overflow(&self, arrival: Arrival) {
        let Some(env) = self.env(&arrival.env_id) else {
            return;
        };
        self.stats
            .overflows
            .fetch_add(arrival.records.len() as u64, Ordering::Relaxed);
        self.gap(&env);
        env.routed.fetch_add(1, Ordering::SeqCst);
        env.routed_changed.notify_waiters();
    }
}

/// A feed held by one poll. Dropping it deregisters the feed (client gone, poll answered).
pub struct Registration {
    inner: Arc<Inner>,
    env: Arc<Env>,
    id: u64,
    slot: Arc<Slot>,
    covered: bool,
}

#[cfg(test)]
mod tests;
