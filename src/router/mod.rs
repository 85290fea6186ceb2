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

mod batch;
mod buffer;
mod filter;
pub mod gate;
mod tripwire;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify};

pub use buffer::{Buffered, Eviction, ReplayBuffer};
pub use filter::FeedFilter;
pub use gate::{Gate, GateOutcome};

use crate::changes::{ChangeRecord, ChangeSource, SourceEvent};
use crate::config::RouterConfig;
use crate::protocol::encode::serialize_row;
use crate::protocol::{BatchId, ColumnSet, EnvId, RunId, SerializedRow};
use crate::store::RunStore;
use crate::telemetry::metrics::Metrics;
use batch::{Arrival, BatchLimits, Batcher, Routed};

/// Rows of one hydrate, by environment and run.
type HydratedRows = HashMap<(EnvId, RunId), SerializedRow>;

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
    pub events: mpsc::UnboundedReceiver<SourceEvent>,
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
    fn push(&self, rows: Vec<SerializedRow>, recheck: bool) {
        let mut inbox = lock(&self.inbox);
        inbox.rows.extend(rows);
        inbox.recheck |= recheck;
    }

    fn take(&self) -> Wake {
        std::mem::take(&mut *lock(&self.inbox))
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
    feeds: HashMap<u64, Arc<Slot>>,
    by_run: HashMap<RunId, HashSet<u64>>,
    by_tag: HashMap<String, HashSet<u64>>,
    by_batch: HashMap<BatchId, HashSet<u64>>,
    tag_feeds: HashSet<u64>,
    unfiltered_tag_feeds: HashSet<u64>,
    batch_feeds: HashSet<u64>,
    linger_generation: u64,
}

impl EnvState {
    fn routed_through(&self) -> u64 {
        match self.in_flight.keys().next() {
            Some(first) => first - 1,
            None => self.last_seq,
        }
    }

    fn cursor(&self, instance: u64) -> ReplayCursor {
        ReplayCursor {
            epoch: if self.active { self.epoch } else { 0 },
            seq: self.routed_through(),
            instance,
            wall_ms: crate::clock::now_ms(),
        }
    }

    /// Where the buffer can replay `cursor`'s gap from, if it covers it.
    fn replay_from(
        &self,
        cursor: &ReplayCursor,
        instance: u64,
        hop_margin_ms: i64,
    ) -> Option<ReplayFrom> {
        if !self.active || cursor.epoch == 0 {
            return None;
        }
        if cursor.instance == instance {
            return (cursor.epoch == self.epoch && self.buffer.covers(cursor.seq))
                .then_some(ReplayFrom::Seq(cursor.seq));
        }
        let from = cursor.wall_ms - hop_margin_ms;
        (self.active_since_wall_ms <= from && self.buffer.covers_wall(from))
            .then_some(ReplayFrom::Wall(from))
    }

    fn replay_candidates(&self, from: Option<&ReplayFrom>, filter: &FeedFilter) -> Vec<Buffered> {
        let pick = |b: &&Buffered| filter.is_candidate(&b.record);
        match from {
            Some(ReplayFrom::Seq(seq)) => self.buffer.since(*seq).filter(pick).cloned().collect(),
            Some(ReplayFrom::Wall(ms)) => {
                self.buffer.since_wall(*ms).filter(pick).cloned().collect()
            }
            None => self.buffer.since(0).filter(pick).cloned().collect(),
        }
    }

    fn index(&mut self, id: u64, filter: &FeedFilter) {
        match filter {
            FeedFilter::Run { run_id } => {
                self.by_run.entry(run_id.clone()).or_default().insert(id);
            }
            FeedFilter::Batch { batch_id } => {
                self.by_batch
                    .entry(batch_id.clone())
                    .or_default()
                    .insert(id);
                self.batch_feeds.insert(id);
            }
            FeedFilter::Tag { tags, .. } => {
                self.tag_feeds.insert(id);
                if tags.is_empty() {
                    self.unfiltered_tag_feeds.insert(id);
                }
                for tag in tags {
                    self.by_tag.entry(tag.clone()).or_default().insert(id);
                }
            }
        }
    }

    fn deindex(&mut self, id: u64, filter: &FeedFilter) {
        fn remove<K: std::hash::Hash + Eq>(index: &mut HashMap<K, HashSet<u64>>, key: &K, id: u64) {
            if let Some(set) = index.get_mut(key) {
                set.remove(&id);
                if set.is_empty() {
                    index.remove(key);
                }
            }
        }
        match filter {
            FeedFilter::Run { run_id } => remove(&mut self.by_run, run_id, id),
            FeedFilter::Batch { batch_id } => {
                remove(&mut self.by_batch, batch_id, id);
                self.batch_feeds.remove(&id);
            }
            FeedFilter::Tag { tags, .. } => {
                self.tag_feeds.remove(&id);
                self.unfiltered_tag_feeds.remove(&id);
                for tag in tags {
                    remove(&mut self.by_tag, tag, id);
                }
            }
        }
    }

    /// Feed ids that are candidates for `record` (deduplicated).
    fn candidates(&self, record: &ChangeRecord) -> HashSet<u64> {
        let mut out = HashSet::new();
        if let Some(ids) = self.by_run.get(&record.run_id) {
            out.extend(ids);
        }
        match (&record.batch_id, &record.tags) {
            (Some(batch), _) => {
                if let Some(ids) = self.by_batch.get(batch) {
                    out.extend(ids);
                }
            }
            (None, None) => out.extend(&self.batch_feeds),
            (None, Some(_)) => {}
        }
        match &record.tags {
            Some(tags) => {
                for tag in tags {
                    if let Some(ids) = self.by_tag.get(tag) {
                        out.extend(ids);
                    }
                }
                out.extend(&self.unfiltered_tag_feeds);
            }
            None => out.extend(&self.tag_feeds),
        }
        out
    }
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
    /// The hydrate stage's queue (set once, right after construction).
    batcher: std::sync::OnceLock<Batcher>,
    metrics: Arc<Metrics>,
    envs: Mutex<HashMap<EnvId, Arc<Env>>>,
    next_epoch: AtomicU64,
    next_feed_id: AtomicU64,
    /// This router's identity in cursors (random, non-zero).
    instance: u64,
    stats: RouterStats,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another task panicked mid-update; the state is still the best
    // we have, and refusing to serve would turn one bug into an outage.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The router. Cheap to clone.
#[derive(Clone)]
pub struct Router {
    inner: Arc<Inner>,
}

impl Router {
    /// Starts a router (see [`RouterParts`]). Spawns its pump and its hydrate dispatcher on the
    /// current tokio runtime; both end when the last clone of the router is dropped.
    pub fn start(parts: RouterParts) -> Router {
        let RouterParts {
            cfg,
            source,
            store,
            mut events,
            gate,
            metrics,
        } = parts;
        let limits = BatchLimits {
            ceiling: Duration::from_millis(cfg.coalesce_ceiling_ms),
            max_runs: cfg.hydrate_batch_max_runs,
        };
        let inner = Arc::new(Inner {
            cfg,
            source,
            store,
            gate,
            batcher: std::sync::OnceLock::new(),
            metrics,
            envs: Mutex::new(HashMap::new()),
            next_epoch: AtomicU64::new(1),
            next_feed_id: AtomicU64::new(1),
            instance: rand::random::<u64>() | 1,
            stats: RouterStats::default(),
        });
        let _ = inner
            .batcher
            .set(Batcher::start(Arc::downgrade(&inner), limits));
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                let Some(inner) = weak.upgrade() else { break };
                match event {
                    SourceEvent::Record { env_id, record } => {
                        inner.arrive(&env_id, vec![record], 0, tokio::time::Instant::now());
                    }
                    SourceEvent::Subscribed { env_id, generation } => {
                        if let Some(env) = inner.env(&env_id) {
                            let mut state = lock(&env.state);
                            // A late confirmation of an earlier incarnation's subscription
                            // must not vouch for this one.
                            if state.generation == generation && !state.active {
                                state.active = true;
                                state.active_since_wall_ms = crate::clock::now_ms();
                                state.complete_since = Some(Instant::now());
                            }
                        }
                    }
                    SourceEvent::Reconnected => inner.on_gap(),
                }
            }
        });
        Router { inner }
    }

    /// Registers a held feed and replays the buffered records it has not seen (those after
    /// `cursor`; everything buffered when the cursor is unknown or from another subscription).
    /// The replay is awaited, so its rows are in the inbox when this returns.
    ///
    /// [`Registration::covered`] tells whether the change stream provably covers the gap since
    /// `cursor`; when false the caller must re-check from the store (cold path).
    pub async fn register(&self, feed: Feed) -> Registration {
        let Feed {
            env_id,
            filter,
            cols,
            since: cursor,
        } = feed;
        let env_id = &env_id;
        let env = self.inner.ensure_env(env_id);
        let id = self.inner.next_feed_id.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot {
            filter: filter.clone(),
            cols,
            inbox: Mutex::new(Wake::default()),
            notify: Notify::new(),
        });
        let replay_enabled = self.inner.cfg.replay_window_ms > 0;
        let (mut covered, replay_ids) = {
            let mut state = lock(&env.state);
            state.feeds.insert(id, slot.clone());
            state.index(id, &filter);
            state.pending -= 1;
            let from = cursor.as_ref().and_then(|c| {
                state.replay_from(c, self.inner.instance, self.inner.hop_margin_ms())
            });
            let covered = !replay_enabled || from.is_some();
            (covered, state.replay_candidates(from.as_ref(), &filter))
        };
        let mut registration = Registration {
            inner: self.inner.clone(),
            env,
            id,
            slot,
            covered: false,
        };
        if replay_enabled && !replay_ids.is_empty() {
            match self.inner.replay(env_id, &filter, cols, &replay_ids).await {
                Ok(rows) => {
                    let counter = if rows.is_empty() {
                        &self.inner.stats.replays_empty
                    } else {
                        &self.inner.stats.replays_delivered
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    registration.slot.push(rows, false);
                }
                Err(()) => covered = false,
            }
        }
        registration.covered = covered;
        registration
    }

    /// Makes sure `env_id` is subscribed (a snapshot's next live poll will need it) and returns
    /// the cursor a snapshot taken NOW may hand out. Take it before reading the store.
    pub fn touch(&self, env_id: &EnvId) -> ReplayCursor {
        let env = self.inner.ensure_env(env_id);
        let cursor = {
            let mut state = lock(&env.state);
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
    pub async fn routed(&self, env_id: &EnvId, received: u64, deadline: tokio::time::Instant) {
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
            let state = lock(&env.state);
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
        let arrived = tokio::time::Instant::from_std(newest);
        !matches!(gate.wait(&records, arrived).await, GateOutcome::GaveUp)
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
        let envs: Vec<Arc<Env>> = lock(&self.inner.envs).values().cloned().collect();
        let mut counts = (0, 0, 0);
        for env in envs {
            let state = lock(&env.state);
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
        let envs: Vec<Arc<Env>> = lock(&self.inner.envs).values().cloned().collect();
        envs.iter()
            .map(|env| lock(&env.state).in_flight.len())
            .sum()
    }

    /// Environments currently routed (including lingering ones).
    pub fn active_envs(&self) -> usize {
        lock(&self.inner.envs).len()
    }
}

impl Inner {
    fn hop_margin_ms(&self) -> i64 {
        i64::try_from(self.cfg.hop_margin_ms).unwrap_or(i64::MAX / 4)
    }

    fn env(&self, env_id: &EnvId) -> Option<Arc<Env>> {
        lock(&self.envs).get(env_id).cloned()
    }

    /// The env's state, created and subscribed if needed, with one `pending` mark the caller
    /// must release ([`EnvState::pending`]).
    fn ensure_env(&self, env_id: &EnvId) -> Arc<Env> {
        let mut envs = lock(&self.envs);
        if let Some(env) = envs.get(env_id) {
            let mut state = lock(&env.state);
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
        lock(&env.state).generation = self.source.subscribe(env_id);
        envs.insert(env_id.clone(), env.clone());
        env
    }

    fn on_gap(&self) {
        let envs: Vec<Arc<Env>> = lock(&self.envs).values().cloned().collect();
        for env in envs {
            let slots: Vec<Arc<Slot>> = {
                let mut state = lock(&env.state);
                state.epoch = self.next_epoch.fetch_add(1, Ordering::Relaxed);
                state.active_since_wall_ms = crate::clock::now_ms();
                state.complete_since = Some(Instant::now());
                state.feeds.values().cloned().collect()
            };
            for slot in slots {
                slot.push(Vec::new(), true);
                slot.notify.notify_one();
            }
        }
    }

    fn deregister(self: &Arc<Self>, env: &Arc<Env>, id: u64) {
        let idle = {
            let mut state = lock(&env.state);
            if let Some(slot) = state.feeds.remove(&id) {
                state.deindex(id, &slot.filter);
            }
            state.feeds.is_empty()
        };
        if idle {
            self.schedule_teardown_if_idle(env);
        }
    }

    fn schedule_teardown_if_idle(self: &Arc<Self>, env: &Arc<Env>) {
        let generation = {
            let mut state = lock(&env.state);
            if !state.feeds.is_empty() || state.pending > 0 {
                return;
            }
            state.linger_generation += 1;
            state.linger_generation
        };
        let linger = Duration::from_millis(self.cfg.unsubscribe_linger_ms);
        let weak = Arc::downgrade(self);
        let env = env.clone();
        let teardown = move |inner: &Inner| {
            let mut envs = lock(&inner.envs);
            let still_idle = {
                let state = lock(&env.state);
                state.feeds.is_empty()
                    && state.pending == 0
                    && state.linger_generation == generation
            };
            if still_idle && envs.get(&env.id).is_some_and(|e| Arc::ptr_eq(e, &env)) {
                envs.remove(&env.id);
                drop(envs);
                inner.source.unsubscribe(&env.id);
            }
        };
        if linger.is_zero() {
            teardown(self);
            return;
        }
        tokio::spawn(async move {
            tokio::time::sleep(linger).await;
            if let Some(inner) = weak.upgrade() {
                teardown(&inner);
            }
        });
    }

    /// Hydrates buffered records for one feed: behind the read-your-writes gate like the live
    /// path (a record still in its batch's gate wait must not be read early from the replica),
    /// then the feed's authoritative filter (REP-06/07).
    async fn replay(
        &self,
        env_id: &EnvId,
        filter: &FeedFilter,
        cols: ColumnSet,
        buffered: &[Buffered],
    ) -> Result<Vec<SerializedRow>, ()> {
        if let Some(gate) = &self.gate {
            let newest = buffered.iter().map(|b| b.received_at).max();
            if let Some(newest) = newest {
                let records: Vec<ChangeRecord> =
                    buffered.iter().map(|b| b.record.clone()).collect();
                gate.wait(&records, tokio::time::Instant::from_std(newest))
                    .await;
            }
        }
        let ids: Vec<RunId> = buffered.iter().map(|b| b.record.run_id.clone()).collect();
        let rows = self.hydrate(env_id, &ids, cols).await?;
        Ok(rows
            .into_values()
            .filter(|r| filter.accepts(&r.meta))
            .collect())
    }

    /// One store query for `ids`, each row serialized once. `Err(())` after logging a failure.
    async fn hydrate(
        &self,
        env_id: &EnvId,
        ids: &[RunId],
        cols: ColumnSet,
    ) -> Result<HashMap<RunId, SerializedRow>, ()> {
        self.stats.hydrates.fetch_add(1, Ordering::Relaxed);
        match self.store.hydrate(env_id, ids, cols).await {
            Ok(rows) => {
                self.stats
                    .hydrated_rows
                    .fetch_add(rows.len() as u64, Ordering::Relaxed);
                Ok(rows
                    .iter()
                    .map(|row| (row.id.clone(), serialize_row(row, cols)))
                    .collect())
            }
            Err(err) => {
                self.stats.hydrate_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%env_id, error = %err, "router hydrate failed; feeds fall back to their backstop");
                Err(())
            }
        }
    }

    /// Records of `env_id` arrived: queue them for the hydrate stage ([`batch`]), which routes
    /// them when their batch starts — at once when no hydrate is in flight. `attempt` > 0: a
    /// re-hydrate of records the stale tripwire withheld (or an echo pass after giving up).
    fn arrive(
        self: &Arc<Self>,
        env_id: &EnvId,
        records: Vec<ChangeRecord>,
        attempt: u32,
        arrived: tokio::time::Instant,
    ) {
        let Some(env) = self.env(env_id) else { return };
        env.received.fetch_add(1, Ordering::SeqCst);
        if let Some(batcher) = self.batcher.get() {
            batcher.push(Arrival {
                env_id: env_id.clone(),
                records,
                attempt,
                arrived,
            });
        }
    }

    /// Routes an arrival as its batch starts: sequences its records, buffers them for replay
    /// and matches them against the feeds held NOW (under the environment's lock, no awaits).
    /// `None` when no held feed wants them (they stay replayable; nothing to hydrate).
    ///
    /// Records are sequenced here and not on arrival: a feed that registers while its records
    /// wait for the batch is matched when the batch starts, instead of replaying them itself
    /// with a hydrate of its own.
    fn route(&self, arrival: Arrival) -> Option<Routed> {
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
        let mut state = lock(&env.state);
        let first_seq = state.last_seq + 1;
        let mut matches: HashMap<u64, (Arc<Slot>, BTreeSet<RunId>)> = HashMap::new();
        let mut groups: HashMap<ColumnSet, BTreeSet<RunId>> = HashMap::new();
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
    async fn hydrate_batch(self: Arc<Self>, arrivals: Vec<Routed>) {
        // Whatever happens below, every arrival leaves the in-flight set.
        struct Done(Arc<Env>, u64);
        impl Drop for Done {
            fn drop(&mut self) {
                lock(&self.0.state).in_flight.remove(&self.1);
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
        let mut wanted: HashMap<ColumnSet, BTreeSet<(EnvId, RunId)>> = HashMap::new();
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
        let hydrated: HashMap<ColumnSet, Option<HydratedRows>> = hydrated.into_iter().collect();
        // 3. Per arrival: tripwire, then deliver.
        let mut woken = Vec::new();
        let mut deliveries = 0u64;
        for arrival in arrivals {
            let env_id = &arrival.env.id;
            // A failed hydrate must not pass silently under the cursors: its feeds re-check
            // from the store (and answer with an untrusted cursor if that fails too).
            let view: HashMap<ColumnSet, Option<HashMap<RunId, SerializedRow>>> = arrival
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
                    slot.push(Vec::new(), true);
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
                    slot.push(rows, false);
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
    async fn hydrate_many(
        &self,
        runs: &[(EnvId, RunId)],
        cols: ColumnSet,
    ) -> Result<HashMap<(EnvId, RunId), SerializedRow>, ()> {
        self.stats.hydrates.fetch_add(1, Ordering::Relaxed);
        self.metrics.hydrated_batch(runs.len());
        match self.store.hydrate_many(runs, cols).await {
            Ok(rows) => {
                self.stats
                    .hydrated_rows
                    .fetch_add(rows.len() as u64, Ordering::Relaxed);
                Ok(rows
                    .iter()
                    .map(|(env, row)| ((env.clone(), row.id.clone()), serialize_row(row, cols)))
                    .collect())
            }
            Err(err) => {
                self.stats.hydrate_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(runs = runs.len(), error = %err, "router hydrate failed; feeds re-check from the store");
                Err(())
            }
        }
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

impl Registration {
    /// Whether the change stream provably covers the gap since the presented cursor (else the
    /// caller must re-check from the store).
    pub fn covered(&self) -> bool {
        self.covered
    }

    /// Waits until the inbox holds rows or a re-check request, and drains it.
    pub async fn wait(&self) -> Wake {
        loop {
            let wake = self.slot.take();
            if !wake.is_empty() {
                return wake;
            }
            self.slot.notify.notified().await;
        }
    }

    /// Replays into the inbox the buffered records after `cursor` that this feed is a
    /// candidate for (a store read taken at `cursor` plus this replay = the state now).
    /// Returns false when the stream cannot vouch for the gap since `cursor` (another
    /// subscription epoch, evicted records, a failed hydrate): the caller must read again.
    pub async fn replay_since(&self, cursor: ReplayCursor) -> bool {
        if self.inner.cfg.replay_window_ms == 0 {
            return true;
        }
        let replay: Vec<Buffered> = {
            let state = lock(&self.env.state);
            let Some(from) =
                state.replay_from(&cursor, self.inner.instance, self.inner.hop_margin_ms())
            else {
                return false;
            };
            state.replay_candidates(Some(&from), &self.slot.filter)
        };
        if replay.is_empty() {
            return true;
        }
        match self
            .inner
            .replay(&self.env.id, &self.slot.filter, self.slot.cols, &replay)
            .await
        {
            Ok(rows) => {
                self.slot.push(rows, false);
                true
            }
            Err(()) => false,
        }
    }

    /// Drains the inbox without waiting.
    pub fn take(&self) -> Wake {
        self.slot.take()
    }

    /// Whether no change record of this environment was routed since `cursor` was handed out
    /// by this router (nothing to replay, even where [`Self::covered`] cannot vouch for the
    /// stream: a cursor taken before the subscription was confirmed).
    pub fn quiet_since(&self, cursor: &ReplayCursor) -> bool {
        cursor.instance == self.inner.instance && lock(&self.env.state).last_seq == cursor.seq
    }

    /// Closes out a response built now: the cursor it may hand out, then what reached the inbox
    /// up to that moment. In this order, a row delivered in between is either in the response or
    /// after the cursor; never neither.
    pub fn settle(&self) -> (ReplayCursor, Wake) {
        let cursor = self.cursor();
        (cursor, self.slot.take())
    }

    /// The cursor a response built now may hand out (without draining the inbox).
    fn cursor(&self) -> ReplayCursor {
        lock(&self.env.state).cursor(self.inner.instance)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.inner.deregister(&self.env, self.id);
    }
}

#[cfg(test)]
mod tests;
