//! Each busy environment's recent window of runs, kept in memory, so that a cold tag snapshot
//! costs the database a primary-key read of the runs it returns instead of a set query.
//!
//! trigger.dev's indexes cannot bound a tag query's work by the window it asks for: the GIN
//! index on `runTags` holds every run of every environment and day, and the BRIN on
//! `"createdAt"` narrows only to lossy page ranges (docs/trigger-dev.md), so a cold tag
//! snapshot's cost grows with the table's history. trigger.dev's own backend resolves tags in
//! ClickHouse for that reason (`clickHouseRunListResolver.server.ts`). runfeed, which may add no
//! index to the replica, keeps its own: once an environment takes
//! `feeds.window_after_resolves` cold tag resolves within a minute, one bounded range read of
//! the `(runtimeEnvironmentId, createdAt)` index loads the heads (id, `createdAt`, tags) of its
//! runs created since the oldest `createdAt` floor those resolves asked for (at most
//! `feeds.maximum_created_at_filter_age_ms` plus the floor's bucket back). A tag snapshot whose
//! floor the window reaches then finds its run ids in memory, newest first, and hydrates only
//! those ([`super::sets::Sets`]); an older floor reads the store, and counts towards the
//! next rebuild reaching back to it.
//!
//! **Kept current** by a task that refreshes the window every [`REFRESH`] while it is in use:
//! the heads of the runs named by the change records routed since its last refresh (by primary
//! key) and of the runs created since (a bounded range of the same index). An answer carries
//! the router cursor taken before its refresh read anything, so the records after it are
//! replayed to the feed as for any store read. When the change stream cannot vouch for the gap
//! since the last refresh (a reconnect, records evicted from the replay buffer), the window is
//! dropped and tag snapshots go to the store until it is rebuilt. It is rebuilt from the store
//! every `caches.full_reread_ms` (jittered ±25 %), which bounds how late a lost publish that
//! changed a finished run's tags is seen, as for a held feed's backstop (docs/operations.md,
//! "Backstops").
//!
//! **Bounded:** all windows together hold at most `feeds.window_max_runs` runs (a build that
//! would pass it is not made); a window unused for [`IDLE`] is dropped with its task.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::Rng;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::backstop::{COMMIT_MARGIN_MS, TAIL_READ_LIMIT};
use super::read::ReadError;
use super::shares::SharePermit;
use crate::cache::TtlCache;
use crate::clock::now_ms;
use crate::protocol::{EnvId, RunId, RunMeta};
use crate::router::{ReplayCursor, Router};
use crate::store::{HeadScope, RunStore};

/// How often a window in use is brought current. Below the router's replay window
/// (`router.replay_window_ms`, 2 s by default), so the change records since the last refresh
/// are still buffered.
pub const REFRESH: Duration = Duration::from_millis(500);

/// A window no tag snapshot has used for this long is dropped.
pub const IDLE: Duration = Duration::from_secs(60);

/// Environments whose demand is tracked (least recently used beyond that are dropped).
const MAX_ENVS: u64 = 10_000;

/// Settings of [`Windows::new`].
#[derive(Clone, Debug)]
pub struct WindowSettings {
    /// Cold tag resolves of one environment within a minute that build its window
    /// (`feeds.window_after_resolves`; 0: never).
    pub after_resolves: u32,
    /// How far back a window reaches, ms: the oldest floor a tag feed can have
    /// (`feeds.maximum_created_at_filter_age_ms` plus `feeds.runset_created_at_bucket_ms`).
    pub span_ms: i64,
    /// Runs all windows hold at most (`feeds.window_max_runs`).
    pub max_runs: usize,
    /// A window is rebuilt from the store this often (`caches.full_reread_ms`, jittered ±25 %).
    pub rebuild: Duration,
}

/// Whether a cold resolve may start its environment's window build.
pub enum MayBuild<'a> {
    /// The environment's tag resolves hold every permit of its share of the admission gate (a
    /// stampede under way): not now. A build is a read of every run of the window (seconds of
    /// a replica core for a million runs); during a stampede it would slow every other feed's
    /// snapshot, and could help only the stampede's last few. It starts once the queue drains.
    NotNow,
    /// The queue is empty: a build started takes this permit of the environment's share
    /// (`feeds.resolve_admission_per_env`) until its read is done, so the environment's claim
    /// on the replica stays within its share.
    Yes(&'a mut Option<SharePermit>),
}

/// What a window answered for a tag filter.
#[derive(Debug)]
pub struct Found {
    /// The matching runs, newest first (by `createdAt`, then id), at most the limit asked for.
    pub ids: Vec<RunId>,
    /// The router cursor taken before the window's last refresh read anything.
    pub cursor: ReplayCursor,
    /// Wall time (epoch ms) that refresh started.
    pub read_ms: i64,
}

/// The windows of the environments that need one.
#[derive(Clone)]
pub struct Windows {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn RunStore>,
    router: Router,
    settings: WindowSettings,
    /// One slot per environment that resolved a tag feed recently. Bound: [`MAX_ENVS`]; each
    /// dropped once unused for [`IDLE`] (an idle cache); its window's task ends then too.
    slots: TtlCache<EnvId, Arc<Slot>>,
    /// Runs held by all windows (against `settings.max_runs`).
    held: Arc<AtomicUsize>,
    /// Windows' tasks end when it is cancelled ([`Windows::set_shutdown`]).
    shutdown: Mutex<CancellationToken>,
}

/// One environment: its demand and its window.
struct Slot {
    /// The window, once built.
    window: Mutex<Option<Arc<Mutex<Window>>>>,
    /// The cold tag resolves counted within the current minute.
    demand: Mutex<Demand>,
    /// A build is under way (one per environment at a time).
    building: AtomicBool,
    /// When a tag snapshot last used the window.
    used: Mutex<Instant>,
    /// No build is tried before this (one was refused or failed): a window too large for
    /// `feeds.window_max_runs` is not read again at every minute of demand.
    retry_at: Mutex<Instant>,
}

impl Windows {
    /// Windows over `store`, sequenced by `router`.
    pub fn new(store: Arc<dyn RunStore>, router: Router, settings: WindowSettings) -> Windows {
        Windows {
            inner: Arc::new(Inner {
                store,
                router,
                settings,
                slots: TtlCache::idle(MAX_ENVS, IDLE),
                held: Arc::new(AtomicUsize::new(0)),
                shutdown: Mutex::new(CancellationToken::new()),
            }),
        }
    }

    /// The windows' tasks end when `shutdown` is cancelled (the server's one shutdown signal).
    pub fn set_shutdown(&self, shutdown: CancellationToken) {
        *self.inner.shutdown.lock() = shutdown;
    }

    /// Runs held by all windows now.
    pub fn held_runs(&self) -> usize {
        self.inner.held.load(Ordering::Relaxed)
    }

    /// The runs of `env_id` carrying every one of `tags` (non-empty) created at or after
    /// `floor_ms`, newest first, at most `limit`, from the environment's window. Counts a cold
    /// resolve towards building the window. `None`: the environment has no window (yet), or
    /// its window does not reach back to `floor_ms`; the caller reads the store.
    ///
    /// A build starts only when `build` allows it ([`MayBuild`]).
    pub fn find(
        &self,
        env_id: &EnvId,
        tags: &[String],
        floor_ms: i64,
        limit: usize,
        build: MayBuild<'_>,
    ) -> Option<Found> {
        let inner = &self.inner;
        if inner.settings.after_resolves == 0 || tags.is_empty() {
            return None;
        }
        let slot = inner
            .slots
            .get_or_insert_with(env_id.clone(), || Arc::new(Slot::new()));
        slot.count_demand(floor_ms);
        let window = slot.window.lock().clone();
        let Some(window) = window else {
            inner.build_if_wanted(env_id, &slot, build);
            return None;
        };
        *slot.used.lock() = Instant::now();
        let window = window.lock();
        // The window's task drops it at its next refresh when the stream has a gap; until
        // then its answers must not hand out a cursor whose gap cannot be replayed.
        if floor_ms < window.covered_from_ms || !inner.router.vouches_for(env_id, &window.cursor) {
            return None;
        }
        Some(Found {
            ids: window.find(tags, floor_ms, limit),
            cursor: window.cursor,
            read_ms: window.read_start_ms,
        })
    }
}

impl Windows {
    /// After a cold tag resolve of `env_id` read the store: starts the environment's build when
    /// it has the demand for one and `build` allows it now. A stampede's resolves hold the
    /// environment's whole share until its last ones, so its window is built as it drains.
    pub fn resolved(&self, env_id: &EnvId, build: MayBuild<'_>) {
        if let Some(slot) = self.inner.slots.get(env_id) {
            self.inner.build_if_wanted(env_id, &slot, build);
        }
    }
}

impl Slot {
    fn new() -> Slot {
        Slot {
            window: Mutex::new(None),
            demand: Mutex::new(Demand::new()),
            building: AtomicBool::new(false),
            used: Mutex::new(Instant::now()),
            retry_at: Mutex::new(Instant::now()),
        }
    }

    /// Counts one cold resolve at `floor_ms`.
    fn count_demand(&self, floor_ms: i64) {
        let mut demand = self.demand.lock();
        if demand.since.elapsed() >= Duration::from_secs(60) {
            *demand = Demand::new();
        }
        demand.resolves = demand.resolves.saturating_add(1);
        demand.oldest_floor_ms = demand.oldest_floor_ms.min(floor_ms);
    }

    /// The oldest floor among the resolves counted within the current minute (epoch ms).
    fn oldest_floor_ms(&self) -> i64 {
        self.demand.lock().oldest_floor_ms
    }
}

/// Cold tag resolves of an environment since an instant (a minute at most).
struct Demand {
    since: Instant,
    resolves: u32,
    /// The oldest `createdAt` floor they asked for (epoch ms): a window reaches back that far.
    oldest_floor_ms: i64,
}

impl Demand {
    fn new() -> Demand {
        Demand {
            since: Instant::now(),
            resolves: 0,
            oldest_floor_ms: i64::MAX,
        }
    }
}

impl Inner {
    /// Starts building `env_id`'s window when it has none, the demand for one (its count
    /// within the minute at `feeds.window_after_resolves`), no refused build to wait out, and
    /// `build` allows it now.
    fn build_if_wanted(self: &Arc<Self>, env_id: &EnvId, slot: &Arc<Slot>, build: MayBuild<'_>) {
        let MayBuild::Yes(share) = build else {
            return;
        };
        let demanded = slot.demand.lock().resolves >= self.settings.after_resolves;
        let due = Instant::now() >= *slot.retry_at.lock();
        if self.settings.after_resolves > 0 && demanded && due && slot.window.lock().is_none() {
            self.start_build(
                env_id,
                slot,
                slot.oldest_floor_ms(),
                share.take().map(SharePermit::into_permit),
            );
        }
    }

    /// Starts building `env_id`'s window back to `floor_ms` (at most the span) unless a build
    /// is under way; the build's task then keeps it current until it is idle.
    fn start_build(
        self: &Arc<Self>,
        env_id: &EnvId,
        slot: &Arc<Slot>,
        floor_ms: i64,
        share: Option<OwnedSemaphorePermit>,
    ) {
        if slot.building.swap(true, Ordering::AcqRel) {
            return;
        }
        let (inner, env_id, slot) = (self.clone(), env_id.clone(), slot.clone());
        tokio::spawn(async move {
            let built = inner.build(&env_id, floor_ms).await;
            drop(share);
            match built {
                Ok(Built::Window(window)) => {
                    let window = Arc::new(Mutex::new(window));
                    *slot.used.lock() = Instant::now();
                    *slot.window.lock() = Some(window.clone());
                    slot.building.store(false, Ordering::Release);
                    inner.keep_current(&env_id, &slot, window).await;
                }
                Ok(Built::NotNow(why)) => {
                    tracing::debug!(%env_id, why, "environment's window not built; tried again on demand");
                    slot.building.store(false, Ordering::Release);
                }
                Ok(Built::TooLarge) => {
                    tracing::info!(%env_id, "environment's window would pass feeds.window_max_runs; not built");
                    inner.refused(&slot);
                }
                Err(error) => {
                    tracing::warn!(%env_id, %error, "building the environment's window failed");
                    inner.refused(&slot);
                }
            }
        });
    }

    /// A build of `slot`'s window was refused or failed: none is tried for a rebuild period.
    fn refused(&self, slot: &Slot) {
        *slot.retry_at.lock() = Instant::now() + self.settings.rebuild;
        slot.building.store(false, Ordering::Release);
    }

    /// A new window of `env_id`, read from the store and brought current.
    ///
    /// The range read can take seconds on a large environment, longer than the router buffers
    /// change records for: while it runs, the runs the records name are collected every
    /// [`REFRESH`], then read again with the first refresh.
    async fn build(&self, env_id: &EnvId, floor_ms: i64) -> Result<Built, ReadError> {
        let mut last = self.router.touch(env_id);
        if !self.router.vouches_for(env_id, &last) {
            return Ok(Built::NotNow("the change stream is not confirmed yet"));
        }
        if !self.router.settle_replica(env_id).await {
            return Ok(Built::NotNow("the replica is behind"));
        }
        let (started, started_ms) = (Instant::now(), now_ms());
        let covered_from_ms = floor_ms.max(started_ms - self.settings.span_ms);
        let room = self
            .settings
            .max_runs
            .saturating_sub(self.held.load(Ordering::Relaxed));
        let scope = HeadScope::CreatedSince {
            from_ms: covered_from_ms,
            limit: room.saturating_add(1),
        };
        // A million rows take seconds of CPU to receive and decode: on a blocking thread, so
        // the async workers keep answering polls meanwhile.
        let (store, env) = (self.store.clone(), env_id.clone());
        let runtime = tokio::runtime::Handle::current();
        let mut read = tokio::task::spawn_blocking(move || {
            runtime.block_on(async move { store.run_heads(&env, scope).await })
        });
        let mut changed: HashSet<RunId> = HashSet::new();
        let heads = loop {
            tokio::select! {
                heads = &mut read => match heads {
                    Ok(heads) => break heads.map_err(ReadError::from)?,
                    Err(_) => return Ok(Built::NotNow("the read panicked")),
                },
                () = tokio::time::sleep(REFRESH) => {
                    let now = self.router.touch(env_id);
                    let Some(ids) = self.router.changed_since(env_id, &last) else {
                        return Ok(Built::NotNow("the change stream had a gap during the read"));
                    };
                    changed.extend(ids);
                    last = now;
                }
            }
        };
        let Some(heads) = heads else {
            return Ok(Built::NotNow("the store reads no heads"));
        };
        if heads.len() > room {
            tokio::task::spawn_blocking(move || drop(heads));
            return Ok(Built::TooLarge);
        }
        let read_for = started.elapsed();
        // Loading a million runs takes a few hundred ms of CPU: off the async workers. (Read
        // whole, not streamed: streaming the rows into the window made the read twice as long,
        // 8.6 instead of 4.5 s for 1 M runs, for 40 MiB less at the peak; BENCHMARKS.md.)
        let held = Held::new(self.held.clone());
        let load = tokio::task::spawn_blocking(move || {
            let mut window = Window::new(covered_from_ms, held);
            heads.into_iter().for_each(|head| window.add(head));
            window.sort_postings();
            window
        });
        let Ok(mut window) = load.await else {
            return Ok(Built::NotNow("loading the window panicked"));
        };
        window.cursor = last;
        window.read_start_ms = started_ms;
        let window = Mutex::new(window);
        let changed: Vec<RunId> = changed.into_iter().collect();
        if let Refreshed::Gap(why) = self.refresh(env_id, &window, changed).await? {
            return Ok(Built::NotNow(why));
        }
        let window = window.into_inner();
        tracing::info!(
            %env_id,
            runs = window.runs.len(),
            read_ms = read_for.as_millis() as u64,
            built_ms = started.elapsed().as_millis() as u64,
            "environment's window built"
        );
        Ok(Built::Window(window))
    }

    /// Refreshes `window` every [`REFRESH`] until it is idle, the stream cannot vouch for a gap,
    /// its rebuild falls due (a new build replaces it), or shutdown.
    async fn keep_current(
        self: &Arc<Self>,
        env_id: &EnvId,
        slot: &Arc<Slot>,
        window: Arc<Mutex<Window>>,
    ) {
        let shutdown = self.shutdown.lock().clone();
        let jitter = rand::rng().random_range(0.75..1.25);
        let mut rebuild_at = Instant::now() + self.settings.rebuild.mul_f64(jitter);
        let why = loop {
            tokio::select! {
                () = shutdown.cancelled() => break "shutdown",
                () = tokio::time::sleep(REFRESH) => {}
            }
            if slot.used.lock().elapsed() >= IDLE {
                break "idle";
            }
            if Instant::now() >= rebuild_at {
                // The new build replaces this window when it is ready; until then this one
                // keeps serving, brought current below. Refused, it is tried again a period
                // later.
                // It reaches back to the oldest floor asked for within the last minute.
                let floor = match slot.oldest_floor_ms() {
                    i64::MAX => window.lock().covered_from_ms,
                    floor => floor,
                };
                self.start_build(env_id, slot, floor, None);
                rebuild_at += self.settings.rebuild;
            }
            match self.refresh(env_id, &window, Vec::new()).await {
                Ok(Refreshed::Current) => {}
                Ok(Refreshed::Gap(why)) => break why,
                Err(error) => {
                    tracing::warn!(%env_id, %error, "refreshing the environment's window failed");
                    break "a refresh failed";
                }
            }
            let replaced = !slot
                .window
                .lock()
                .as_ref()
                .is_some_and(|w| Arc::ptr_eq(w, &window));
            if replaced {
                break "replaced by a rebuild";
            }
        };
        // Dropped: tag snapshots read the store until a new build.
        tracing::info!(%env_id, why, "environment's window dropped");
        {
            let mut current = slot.window.lock();
            if current.as_ref().is_some_and(|w| Arc::ptr_eq(w, &window)) {
                *current = None;
            }
        }
        // Freeing a million runs takes a while too: off the async workers.
        tokio::task::spawn_blocking(move || drop(window));
    }

    /// Brings `window` current: the runs named by the records routed since its last refresh
    /// (and `also`), and the runs created since its last read.
    async fn refresh(
        &self,
        env_id: &EnvId,
        window: &Mutex<Window>,
        also: Vec<RunId>,
    ) -> Result<Refreshed, ReadError> {
        let started_ms = now_ms();
        let (last, read_start_ms) = {
            let w = window.lock();
            (w.cursor, w.read_start_ms)
        };
        let cursor = self.router.touch(env_id);
        let Some(mut changed) = self.router.changed_since(env_id, &last) else {
            return Ok(Refreshed::Gap(
                "the change stream cannot vouch for the records since the last refresh",
            ));
        };
        if !self.router.settle_replica(env_id).await {
            return Ok(Refreshed::Gap("the replica is behind"));
        }
        changed.extend(also);
        changed.sort_unstable();
        changed.dedup();
        let Some(changed_heads) = self.read_heads(env_id, HeadScope::Ids(&changed)).await? else {
            return Ok(Refreshed::Gap("the store reads no heads"));
        };
        let scope = HeadScope::CreatedSince {
            from_ms: read_start_ms - COMMIT_MARGIN_MS,
            limit: TAIL_READ_LIMIT,
        };
        let Some(created) = self.read_heads(env_id, scope).await? else {
            return Ok(Refreshed::Gap("the store reads no heads"));
        };
        if created.len() >= TAIL_READ_LIMIT {
            return Ok(Refreshed::Gap(
                "more runs were created since the last refresh than one read returns",
            ));
        }
        let mut window = window.lock();
        let found: HashSet<&RunId> = changed_heads.iter().map(|h| &h.id).collect();
        for gone in changed.iter().filter(|id| !found.contains(id)) {
            window.remove(gone);
        }
        for head in changed_heads.into_iter().chain(created) {
            window.upsert(head);
        }
        window.cursor = cursor;
        window.read_start_ms = started_ms;
        Ok(Refreshed::Current)
    }

    /// `store.run_heads`, its error as a [`ReadError`].
    async fn read_heads(
        &self,
        env_id: &EnvId,
        scope: HeadScope<'_>,
    ) -> Result<Option<Vec<RunMeta>>, ReadError> {
        self.store
            .run_heads(env_id, scope)
            .await
            .map_err(ReadError::from)
    }
}

/// What a build came to.
enum Built {
    Window(Window),
    /// Not now (the reason); tried again at the next cold resolve.
    NotNow(&'static str),
    /// The window would pass `feeds.window_max_runs`: not tried again for a rebuild period.
    TooLarge,
}

/// What a refresh came to.
enum Refreshed {
    Current,
    /// The window cannot be brought current (the reason): it is dropped.
    Gap(&'static str),
}

/// Counts a window's runs in the shared total while it lives.
#[derive(Debug)]
struct Held {
    runs: usize,
    total: Arc<AtomicUsize>,
}

impl Held {
    fn new(total: Arc<AtomicUsize>) -> Held {
        Held { runs: 0, total }
    }

    fn set(&mut self, runs: usize) {
        if runs >= self.runs {
            self.total.fetch_add(runs - self.runs, Ordering::Relaxed);
        } else {
            self.total.fetch_sub(self.runs - runs, Ordering::Relaxed);
        }
        self.runs = runs;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.total.fetch_sub(self.runs, Ordering::Relaxed);
    }
}

/// One run of a window: when it was created and its tags (as ids of [`Window::tag_ids`]).
#[derive(Debug)]
struct Entry {
    created_at_ms: i64,
    tags: Box<[u32]>,
}

/// An environment's runs created at or after `covered_from_ms`, by tag (each id shared by the
/// map and its postings). About 250 bytes of resident memory per run, measured with the build's
/// read (BENCHMARKS.md).
#[derive(Debug)]
struct Window {
    runs: HashMap<RunId, Entry>,
    /// Per tag id, its runs as `(createdAt, id)`, ascending.
    postings: HashMap<u32, Vec<(i64, RunId)>>,
    tag_ids: HashMap<Box<str>, u32>,
    /// Every run created at or after this (epoch ms) and committed before the last read is here.
    covered_from_ms: i64,
    /// The router cursor taken before the last refresh (or the build) read anything.
    cursor: ReplayCursor,
    /// Wall time (epoch ms) the last refresh (or the build) started.
    read_start_ms: i64,
    held: Held,
}

impl Window {
    fn new(covered_from_ms: i64, held: Held) -> Window {
        Window {
            runs: HashMap::new(),
            postings: HashMap::new(),
            tag_ids: HashMap::new(),
            covered_from_ms,
            cursor: ReplayCursor::default(),
            read_start_ms: covered_from_ms,
            held,
        }
    }

    /// The id of `tag`, given one if it has none.
    fn tag_id(&mut self, tag: &str) -> u32 {
        if let Some(id) = self.tag_ids.get(tag) {
            return *id;
        }
        let id = u32::try_from(self.tag_ids.len()).unwrap_or(u32::MAX);
        self.tag_ids.insert(tag.into(), id);
        id
    }

    /// Adds `head` to a window being loaded (a build): its postings are sorted once, by
    /// [`Window::sort_postings`], not kept sorted run by run (a read returns a million runs
    /// newest first).
    fn add(&mut self, head: RunMeta) {
        if head.created_at_ms < self.covered_from_ms || self.runs.contains_key(&head.id) {
            return;
        }
        let tags = self.tag_ids_of(&head.tags);
        for tag in &tags {
            self.postings
                .entry(*tag)
                .or_default()
                .push((head.created_at_ms, head.id.clone()));
        }
        self.runs.insert(
            head.id,
            Entry {
                created_at_ms: head.created_at_ms,
                tags,
            },
        );
    }

    /// Ends a load: every posting sorted, the runs counted.
    fn sort_postings(&mut self) {
        for posting in self.postings.values_mut() {
            posting.sort_unstable();
            posting.shrink_to_fit();
        }
        self.held.set(self.runs.len());
    }

    /// The ids of `tags`, sorted, without repeats.
    fn tag_ids_of(&mut self, tags: &[String]) -> Box<[u32]> {
        let mut ids: Vec<u32> = tags.iter().map(|t| self.tag_id(t)).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.into_boxed_slice()
    }

    /// Adds `head`, or updates its tags; a run created before the window is left out.
    fn upsert(&mut self, head: RunMeta) {
        if head.created_at_ms < self.covered_from_ms {
            return;
        }
        let tags = self.tag_ids_of(&head.tags);
        if let Some(entry) = self.runs.get(&head.id) {
            if *entry.tags == *tags && entry.created_at_ms == head.created_at_ms {
                return;
            }
            self.remove(&head.id);
        }
        let key = (head.created_at_ms, head.id.clone());
        for tag in &tags {
            let posting = self.postings.entry(*tag).or_default();
            let at = posting.partition_point(|p| *p < key);
            posting.insert(at, key.clone());
        }
        self.runs.insert(
            head.id,
            Entry {
                created_at_ms: head.created_at_ms,
                tags,
            },
        );
        self.held.set(self.runs.len());
    }

    /// Removes run `id` (a run deleted from the store).
    fn remove(&mut self, id: &RunId) {
        let Some(entry) = self.runs.remove(id) else {
            return;
        };
        let key = (entry.created_at_ms, id.clone());
        for tag in entry.tags.iter() {
            if let Some(posting) = self.postings.get_mut(tag) {
                if let Ok(at) = posting.binary_search(&key) {
                    posting.remove(at);
                }
            }
        }
        self.held.set(self.runs.len());
    }

    /// The runs carrying every one of `tags` created at or after `floor_ms`, newest first (by
    /// `createdAt`, then id), at most `limit`.
    fn find(&self, tags: &[String], floor_ms: i64, limit: usize) -> Vec<RunId> {
        let Some(mut wanted) = tags
            .iter()
            .map(|t| self.tag_ids.get(t.as_str()).copied())
            .collect::<Option<Vec<u32>>>()
        else {
            // A tag no run of the window carries.
            return Vec::new();
        };
        wanted.sort_unstable();
        wanted.dedup();
        let empty = Vec::new();
        let posting = |tag: &u32| self.postings.get(tag).unwrap_or(&empty);
        let Some(rarest) = wanted.iter().min_by_key(|t| posting(t).len()) else {
            return Vec::new();
        };
        posting(rarest)
            .iter()
            .rev()
            .take_while(|(created, _)| *created >= floor_ms)
            .filter(|(_, id)| {
                self.runs
                    .get(id)
                    .is_some_and(|e| wanted.iter().all(|t| e.tags.binary_search(t).is_ok()))
            })
            .map(|(_, id)| id.clone())
            .take(limit)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(id: &str, created: i64, tags: &[&str]) -> RunMeta {
        RunMeta {
            id: RunId::from(id.to_string()),
            updated_at_ms: created,
            created_at_ms: created,
            tags: tags.iter().map(|t| (*t).to_string()).collect(),
            batch_id: None,
            finished: true,
        }
    }

    /// A window of `heads`, loaded as a build loads it (`add`, then `sort_postings`) or run by run as refreshes
    /// add them (`upsert`).
    fn window_by(heads: Vec<RunMeta>, bulk: bool) -> (Window, Arc<AtomicUsize>) {
        let total = Arc::new(AtomicUsize::new(0));
        let mut w = Window::new(100, Held::new(total.clone()));
        if bulk {
            heads.into_iter().for_each(|h| w.add(h));
            w.sort_postings();
        } else {
            for h in heads {
                w.upsert(h);
            }
        }
        (w, total)
    }

    fn window(heads: Vec<RunMeta>) -> (Window, Arc<AtomicUsize>) {
        window_by(heads, true)
    }

    fn ids(found: Vec<RunId>) -> Vec<String> {
        found.iter().map(|id| id.to_string()).collect()
    }

    fn tags(t: &[&str]) -> Vec<String> {
        t.iter().map(|t| (*t).to_string()).collect()
    }

    /// As the store's tag query: every tag (`@>`), at or above the floor, newest first (ties
    /// by id, descending), capped; whether the runs were loaded at once or one by one.
    #[test]
    fn a_window_finds_runs_with_every_tag_above_the_floor_newest_first() {
        for bulk in [true, false] {
            finds_runs_with_every_tag(bulk);
        }
    }

    fn finds_runs_with_every_tag(bulk: bool) {
        let (w, _) = window_by(
            vec![
                head("a", 200, &["x", "y"]),
                head("b", 300, &["x"]),
                head("c", 300, &["y", "x"]),
                head("d", 400, &["y"]),
                head("e", 150, &["x", "y"]),
                head("old", 50, &["x", "y"]),
            ],
            bulk,
        );
        assert_eq!(ids(w.find(&tags(&["x", "y"]), 0, 10)), ["c", "a", "e"]);
        assert_eq!(ids(w.find(&tags(&["x"]), 200, 10)), ["c", "b", "a"]);
        assert_eq!(ids(w.find(&tags(&["x"]), 0, 2)), ["c", "b"]);
        assert!(w.find(&tags(&["x", "nobody"]), 0, 10).is_empty());
        assert!(
            w.find(&tags(&["x", "x"]), 0, 10).len() == 4,
            "a repeated tag is one tag"
        );
    }

    /// A run whose tags changed moves between postings; a removed run leaves them all; the
    /// shared total follows, and a dropped window gives its runs back.
    #[test]
    fn a_window_follows_tag_changes_and_removals() {
        let (mut w, total) = window(vec![head("a", 200, &["x"]), head("b", 250, &["x"])]);
        assert_eq!(total.load(Ordering::Relaxed), 2);
        w.upsert(head("a", 200, &["y"]));
        assert_eq!(ids(w.find(&tags(&["x"]), 0, 10)), ["b"]);
        assert_eq!(ids(w.find(&tags(&["y"]), 0, 10)), ["a"]);
        w.remove(&RunId::from("b".to_string()));
        assert!(w.find(&tags(&["x"]), 0, 10).is_empty());
        assert_eq!(total.load(Ordering::Relaxed), 1);
        drop(w);
        assert_eq!(total.load(Ordering::Relaxed), 0);
    }
}
