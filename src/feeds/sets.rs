//! Reading what a feed carries from the store: single runs and run sets, with single-flight,
//! short-TTL caches and the admission gate.
//!
//! Every cached result carries the router cursor taken BEFORE its query ran, so whoever uses
//! a cached (older) result replays the change records that arrived after it: a cache can delay
//! nothing and hide nothing.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::backstop::{BackstopSettings, Backstops, Current};
use super::diff::Known;
use super::read::{ReadError, RunSet, SetRead, Target};
use super::shares::{EnvShares, SharePermit};
use super::window::{MayBuild, WindowSettings, Windows};
use crate::cache::TtlCache;
use crate::clock::now_ms;
use crate::config::{CachesConfig, FeedsConfig};
use crate::protocol::encode::serialize_row;
use crate::protocol::{ColumnSet, EnvId, FriendlyBatchId, FriendlyRunId, RunId, RunMeta, RunRow};
use crate::router::{Registration, ReplayCursor, Router};
use crate::store::{BatchResource, Found, RunResource, RunStore, StoreError};
use crate::telemetry::metrics::{Metrics, ResolveResult};

/// Whether a URL-id lookup may be served from the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freshness {
    /// A cached result will do (its immutable part: ids, task, batch).
    Cached,
    /// Read the store now (its mutable part, the tags, decides something).
    Fresh,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SetKey {
    env_id: EnvId,
    target: Target,
    cap: usize,
    cols: ColumnSet,
}

/// The readers.
pub struct Sets {
    store: Arc<dyn RunStore>,
    router: Router,
    cap: usize,
    /// Shared reads ([`Sets::read_shared`], single-flighted): bound `caches.runset_cache_max_bytes`
    /// ([`set_weight`]); TTL `caches.run_cache_ttl_ms` for a run feed's read, else
    /// `caches.runset_cache_ttl_ms` ([`Sets::set_ttl`]).
    sets: TtlCache<SetKey, Arc<RunSet>>,
    /// `caches.run_cache_ttl_ms`.
    run_ttl: Duration,
    /// `caches.runset_cache_ttl_ms`.
    list_ttl: Duration,
    /// Backstop reads of whole filters shared for `caches.backstop_share_ms` (`None` when 0),
    /// single-flighted; bound `caches.runset_cache_max_bytes` ([`set_weight`]). Each loads
    /// through [`Sets::read_shared`] (see [`Sets::read_backstop_whole`]).
    backstops: Option<TtlCache<SetKey, Arc<RunSet>>>,
    /// Backstops that read only what can have changed (`None` when `caches.full_reread_ms` is 0).
    views: Option<Backstops>,
    /// Busy environments' windows, where tag snapshots take their run ids (`None` when
    /// `feeds.window_after_resolves` or `caches.full_reread_ms` is 0).
    windows: Option<Windows>,
    runs: Lookups<FriendlyRunId, RunResource>,
    batches: Lookups<FriendlyBatchId, BatchResource>,
    admission: Option<Arc<Semaphore>>,
    /// Per-environment shares of the gate for tag resolves (`None`: no share).
    env_shares: Option<EnvShares>,
    /// Instruments (no-op unless set through [`crate::feeds::Feeds::with_metrics`]).
    metrics: Arc<Metrics>,
}

/// The `kind` label of a target.
fn target_kind(target: &Target) -> &'static str {
    match target {
        Target::Run { .. } => "run",
        Target::Tag { .. } => "tag",
        Target::Batch { .. } => "batch",
    }
}

impl Sets {
    /// Readers over `store`; caches sized from `caches`, cap and admission from `feeds`.
    pub fn new(
        store: Arc<dyn RunStore>,
        router: Router,
        feeds: &FeedsConfig,
        caches: &CachesConfig,
    ) -> Sets {
        // Single runs use the run cache TTL, run sets the run-set TTL (`Sets::set_ttl`).
        let run_ttl = Duration::from_millis(caches.run_cache_ttl_ms);
        let list_ttl = Duration::from_millis(caches.runset_cache_ttl_ms);
        let sets = TtlCache::weighted(caches.runset_cache_max_bytes, list_ttl, set_weight);
        let lookup_ttl = Duration::from_millis(caches.resource_cache_ttl_ms.max(1));
        let backstops = (caches.backstop_share_ms > 0).then(|| {
            let share = Duration::from_millis(caches.backstop_share_ms);
            TtlCache::weighted(caches.runset_cache_max_bytes, share, set_weight)
        });
        let views = (caches.full_reread_ms > 0).then(|| {
            Backstops::new(
                store.clone(),
                router.clone(),
                BackstopSettings {
                    cap: feeds.max_list_results,
                    share: Duration::from_millis(caches.backstop_share_ms),
                    full_reread: Duration::from_millis(caches.full_reread_ms),
                    max_views: caches.runset_cache_max_entries,
                },
            )
        });
        let windows = (feeds.window_after_resolves > 0 && caches.full_reread_ms > 0).then(|| {
            let span = feeds
                .maximum_created_at_filter_age_ms
                .saturating_add(feeds.runset_created_at_bucket_ms);
            Windows::new(
                store.clone(),
                router.clone(),
                WindowSettings {
                    after_resolves: feeds.window_after_resolves,
                    span_ms: i64::try_from(span).unwrap_or(i64::MAX / 4),
                    max_runs: usize::try_from(feeds.window_max_runs).unwrap_or(usize::MAX),
                    rebuild: Duration::from_millis(caches.full_reread_ms),
                },
            )
        });
        Sets {
            store,
            router,
            cap: feeds.max_list_results,
            sets,
            run_ttl,
            list_ttl,
            backstops,
            views,
            windows,
            runs: Lookups::new(lookup_ttl),
            batches: Lookups::new(lookup_ttl),
            admission: (feeds.resolve_admission_limit > 0)
                .then(|| Arc::new(Semaphore::new(feeds.resolve_admission_limit))),
            env_shares: (feeds.resolve_admission_limit > 0 && feeds.resolve_admission_per_env > 0)
                .then(|| EnvShares::new(feeds.resolve_admission_per_env)),
            metrics: Metrics::noop(),
        }
    }

    /// Records into `metrics` from now on.
    pub fn set_metrics(&mut self, metrics: Arc<Metrics>) {
        self.metrics = metrics;
    }

    /// Background work (the windows' refreshes) ends when `shutdown` is cancelled.
    pub fn set_shutdown(&self, shutdown: &tokio_util::sync::CancellationToken) {
        if let Some(windows) = &self.windows {
            windows.set_shutdown(shutdown.clone());
        }
    }

    /// Runs held by the environments' windows now.
    pub fn window_runs(&self) -> usize {
        self.windows.as_ref().map_or(0, Windows::held_runs)
    }

    /// The cache key of `read` (its deadline aside).
    fn set_key(&self, read: SetRead<'_>) -> SetKey {
        SetKey {
            env_id: read.env_id.clone(),
            target: read.target.clone(),
            cap: self.cap,
            cols: read.cols,
        }
    }

    /// How long the shared read of `target` is kept: a run feed's for `caches.run_cache_ttl_ms`,
    /// a run set's for `caches.runset_cache_ttl_ms`.
    fn set_ttl(&self, target: &Target) -> Duration {
        match target {
            Target::Run { .. } => self.run_ttl,
            _ => self.list_ttl,
        }
    }

    /// Free admission permits (`None`: admission is unbounded).
    pub fn admission_available(&self) -> Option<usize> {
        self.admission.as_ref().map(|sem| sem.available_permits())
    }

    /// The run named by a friendly id (replica, then primary). [`Freshness::Cached`]: served
    /// from the cache when it can be (found runs are cached for `caches.resource_cache_ttl_ms`,
    /// misses never: a just-created run must not 404), but the cached tags may be stale;
    /// [`Freshness::Fresh`] reads now and refreshes the cache, for decisions that depend on the
    /// tags. The batch named by a friendly id follows the cached rule ([`Sets::find_batch`]).
    pub async fn find_run(
        &self,
        env_id: &EnvId,
        id: &FriendlyRunId,
        freshness: Freshness,
    ) -> Result<Option<Arc<RunResource>>, StoreError> {
        let read = || self.store.find_run(env_id, id);
        self.runs.find(env_id, id, freshness, read).await
    }

    /// The batch named by a friendly id (cached like [`Sets::find_run`]).
    pub async fn find_batch(
        &self,
        env_id: &EnvId,
        id: &FriendlyBatchId,
    ) -> Result<Option<Arc<BatchResource>>, StoreError> {
        let read = || self.store.find_batch(env_id, id);
        self.batches.find(env_id, id, Freshness::Cached, read).await
    }

    /// What the feed carries, through the single-flight cache (identical concurrent reads share
    /// one query; a miss takes an admission permit).
    pub async fn read_shared(&self, read: SetRead<'_>) -> Result<Arc<RunSet>, ReadError> {
        let key = self.set_key(read);
        // A settled cached read is returned before the single-flight future (and the store
        // read inside it) is even built: that future is several KiB, moved on every call.
        if let Some(set) = self.sets.get(&key).filter(|set| set.settled) {
            self.metrics
                .resolve(target_kind(read.target), ResolveResult::Hit);
            return Ok(set);
        }
        Box::pin(self.read_shared_slow(key, read)).await
    }

    /// [`Sets::read_shared`] past its cache hit: joins or runs the single-flight read (boxed
    /// by the caller, so a hit neither builds nor moves this future).
    async fn read_shared_slow(
        &self,
        key: SetKey,
        read: SetRead<'_>,
    ) -> Result<Arc<RunSet>, ReadError> {
        // Metrics: hit (cached), miss (this call ran the query) or coalesced (joined one).
        let cached = self.sets.get(&key).is_some();
        let ran = std::sync::atomic::AtomicBool::new(false);
        let init = async {
            ran.store(true, std::sync::atomic::Ordering::Relaxed);
            self.read_fresh_inner(read.env_id, read.target, read.cols)
                .await
        };
        let ttl = self.set_ttl(read.target);
        let fut = self.sets.get_or_load_for(key.clone(), move |_| ttl, init);
        let result = shared_by_deadline(read.deadline, fut).await;
        if let Ok(set) = &result {
            // A read the gate gave up on is served (the replica lags) but not kept: the next
            // reader tries again.
            if !set.settled {
                self.drop_cached(&key, set);
            }
        }
        let outcome = match (ran.load(std::sync::atomic::Ordering::Relaxed), cached) {
            (true, _) => ResolveResult::Miss,
            (false, true) => ResolveResult::Hit,
            (false, false) => ResolveResult::Coalesced,
        };
        self.metrics.resolve(target_kind(read.target), outcome);
        result
    }

    /// A backstop read for a poll whose client has `known`: the rows of the feed that its
    /// client may lack. With `caches.full_reread_ms` > 0 only what can have changed is read
    /// ([`Backstops`]): the filter's view, brought forward, then a hydrate of the runs whose
    /// `updatedAt` is past the client's; the whole filter at most every full period. With 0,
    /// the whole filter each time, shared for `caches.backstop_share_ms` ([`Sets::read_shared`]).
    /// The caller must diff the result against its client's known versions, since it may
    /// predate changes the client already has.
    pub async fn read_backstop(
        &self,
        read: SetRead<'_>,
        known: &Known,
    ) -> Result<Arc<RunSet>, ReadError> {
        let Some(views) = &self.views else {
            return self.read_backstop_whole(read).await;
        };
        let SetRead {
            env_id,
            target,
            cols,
            deadline,
        } = read;
        let full = || self.read_backstop_whole(read);
        let current = views.current(env_id, target, full);
        let view = match tokio::time::timeout_at(deadline, current).await {
            Err(_) => return Err(ReadError::Deadline),
            Ok(Err(err)) => return Err(err),
            Ok(Ok(Current::Full(set))) => return Ok(set),
            Ok(Ok(Current::View(view))) => view,
        };
        let moved: Vec<RunId> = view
            .heads_for(target)
            .filter(|head| known.may_lack(&head.id, head.updated_at_ms))
            .map(|head| head.id.clone())
            .collect();
        let read_ms = now_ms();
        let rows = if moved.is_empty() {
            Vec::new()
        } else {
            let hydrate = self.store.hydrate(env_id, &moved, cols);
            let rows = tokio::time::timeout_at(deadline, hydrate)
                .await
                .map_err(|_| ReadError::Deadline)?
                .map_err(ReadError::from)?;
            let filter = super::filter_of(target);
            rows.iter()
                .filter(|row| filter.accepts(&RunMeta::of(row)))
                .map(|row| serialize_row(row, cols))
                .collect()
        };
        Ok(Arc::new(RunSet {
            cursor: view.cursor,
            rows,
            settled: view.settled,
            read_ms,
        }))
    }

    /// A backstop's read of the whole filter: [`Sets::read_shared`], reused by every backstop
    /// of the same key for `caches.backstop_share_ms`.
    async fn read_backstop_whole(&self, read: SetRead<'_>) -> Result<Arc<RunSet>, ReadError> {
        let Some(backstops) = &self.backstops else {
            return self.read_shared(read).await;
        };
        let key = self.set_key(read);
        // The common case, a backstop of a filter read in the last `backstop_share_ms`, never
        // builds the single-flight future (see `read_shared`).
        if let Some(set) = backstops.get(&key) {
            return Ok(set);
        }
        // Only the read that went to the store keeps its result: an entry is never older than
        // the share time.
        let shared = self.read_shared(read);
        shared_by_deadline(read.deadline, Box::pin(backstops.get_or_load(key, shared))).await
    }

    /// What the feed carries as of now, for a feed registered as `reg`: the shared read (one
    /// query for every identical caller) plus a replay of the records that arrived after it was
    /// taken. A shared result whose cursor the stream cannot vouch for (taken before the
    /// subscription was confirmed, before a reconnect, or evicted) is dropped and read again —
    /// once for all callers; only if that fails too does this caller read alone.
    pub async fn read_covered(
        &self,
        read: SetRead<'_>,
        reg: &Registration,
    ) -> Result<Arc<RunSet>, ReadError> {
        let key = self.set_key(read);
        for _ in 0..2 {
            let set = self.read_shared(read).await?;
            if set.settled && reg.replay_since(set.cursor).await {
                return Ok(set);
            }
            self.drop_cached(&key, &set);
        }
        self.read_fresh(read).await
    }

    /// Drops `set` from the shared cache if it is still the entry for `key`.
    fn drop_cached(&self, key: &SetKey, set: &Arc<RunSet>) {
        if self
            .sets
            .get(key)
            .is_some_and(|cached| Arc::ptr_eq(&cached, set))
        {
            self.sets.remove(key);
        }
    }

    /// What the feed carries, read now (no cache): for re-checks that must see the store as it
    /// is after a feed registered.
    pub async fn read_fresh(&self, read: SetRead<'_>) -> Result<Arc<RunSet>, ReadError> {
        let fresh = self.read_fresh_inner(read.env_id, read.target, read.cols);
        match tokio::time::timeout_at(read.deadline, fresh).await {
            Ok(result) => result,
            Err(_) => Err(ReadError::Deadline),
        }
    }

    async fn read_fresh_inner(
        &self,
        env_id: &EnvId,
        target: &Target,
        cols: ColumnSet,
    ) -> Result<Arc<RunSet>, ReadError> {
        let admission_started = Instant::now();
        // A tag resolve first takes a permit of its environment's share: one environment's tag
        // stampede cannot hold the whole gate (run and batch reads, by primary key and by the
        // batch index, take only the gate).
        let mut share = match (&self.env_shares, target) {
            (Some(shares), Target::Tag { .. }) => shares.acquire(env_id).await,
            _ => None,
        };
        // Every cold resolve takes a permit, a run feed's too: after a reconnect storm the
        // single-run reads are the many.
        let _permit = match &self.admission {
            Some(sem) => sem.clone().acquire_owned().await.ok(),
            None => None,
        };
        if _permit.is_some() {
            self.metrics.admission_waited(admission_started.elapsed());
        }
        let query_started = Instant::now();
        let read = match target {
            Target::Tag { tags, floor_ms } => {
                self.read_window(env_id, tags, *floor_ms, cols, &mut share)
                    .await
            }
            _ => Ok(None),
        };
        let read = match read {
            Ok(Some(read)) => Ok(read),
            Ok(None) => self.read_store(env_id, target, cols, &mut share).await,
            Err(e) => Err(e),
        };
        let ok = read.is_ok();
        self.metrics
            .run_set_query(target_kind(target), ok, query_started.elapsed());
        let StoreRead {
            rows,
            cursor,
            settled,
            read_ms,
        } = read.map_err(ReadError::from)?;
        if rows.len() >= self.cap && !matches!(target, Target::Run { .. }) {
            tracing::warn!(%env_id, cap = self.cap, "run set truncated at the list cap");
        }
        let set = Arc::new(RunSet {
            cursor,
            rows: rows.iter().map(|row| serialize_row(row, cols)).collect(),
            settled,
            read_ms,
        });
        // A whole-filter read is also the filter's backstop view: its first backstop brings it
        // forward instead of reading the whole filter again.
        if let Some(views) = &self.views {
            views.seed(env_id, target, &set).await;
        }
        Ok(set)
    }
}

/// Rows read for a feed, with the router cursor taken before the read.
struct StoreRead {
    rows: Vec<RunRow>,
    cursor: ReplayCursor,
    /// See [`RunSet::settled`].
    settled: bool,
    /// Wall time the read started, epoch ms.
    read_ms: i64,
}

impl Sets {
    /// What `target` carries, read from the store now. A tag read done, the environment's
    /// window build may start ([`Windows::resolved`]).
    async fn read_store(
        &self,
        env_id: &EnvId,
        target: &Target,
        cols: ColumnSet,
        share: &mut Option<SharePermit>,
    ) -> Result<StoreRead, StoreError> {
        let read_ms = now_ms();
        let cursor = self.router.touch(env_id);
        let settled = self.router.settle_replica(env_id).await;
        let rows = match target {
            Target::Run { run_id } => self
                .store
                .read_run(env_id, run_id, cols)
                .await
                .map(|r| r.into_iter().collect::<Vec<_>>())?,
            Target::Tag { tags, floor_ms } => {
                let rows = self
                    .store
                    .resolve_tag_set(env_id, tags, *floor_ms, self.cap, cols)
                    .await?;
                if let Some(windows) = &self.windows {
                    windows.resolved(env_id, self.may_build(env_id, share));
                }
                rows
            }
            Target::Batch { batch_id } => {
                self.store
                    .resolve_batch_set(env_id, batch_id, self.cap, cols)
                    .await?
            }
        };
        Ok(StoreRead {
            rows,
            cursor,
            settled,
            read_ms,
        })
    }

    /// Whether a resolve holding `share` may start `env_id`'s window build now: not while the
    /// environment's tag resolves hold its whole share (a stampede).
    fn may_build<'a>(&self, env_id: &EnvId, share: &'a mut Option<SharePermit>) -> MayBuild<'a> {
        let queued = self
            .env_shares
            .as_ref()
            .is_some_and(|shares| share.is_some() && shares.queued(env_id));
        if queued {
            MayBuild::NotNow
        } else {
            MayBuild::Yes(share)
        }
    }

    /// A tag set read through `env_id`'s window: the run ids from memory, their rows by
    /// primary key. `None`: the environment has no window reaching back to `floor_ms` (the
    /// caller runs the set query), or a run the window named no longer matches and the list
    /// may be short (the same). A window build this call starts takes its `share` of the
    /// environment's admission, and none starts while the environment's resolves queue
    /// ([`MayBuild`]).
    async fn read_window(
        &self,
        env_id: &EnvId,
        tags: &Arc<[String]>,
        floor_ms: i64,
        cols: ColumnSet,
        share: &mut Option<SharePermit>,
    ) -> Found<StoreRead> {
        let build = self.may_build(env_id, share);
        let Some(found) = self
            .windows
            .as_ref()
            .and_then(|w| w.find(env_id, tags, floor_ms, self.cap, build))
        else {
            return Ok(None);
        };
        let asked = found.ids.len();
        let mut rows = self.store.hydrate(env_id, &found.ids, cols).await?;
        // A run whose tags changed after the window's refresh: its record, after the cursor,
        // is replayed; but a list at the cap would then be short of a run the store has.
        let filter = crate::router::FeedFilter::Tag {
            tags: tags.clone(),
            floor_ms,
        };
        rows.retain(|row| filter.accepts(&RunMeta::of(row)));
        if rows.len() < asked && asked >= self.cap {
            return Ok(None);
        }
        rows.sort_unstable_by(|a, b| (b.created_at_ms, &b.id).cmp(&(a.created_at_ms, &a.id)));
        Ok(Some(StoreRead {
            rows,
            cursor: found.cursor,
            // The window's last refresh passed the read-your-writes gate.
            settled: true,
            read_ms: found.read_ms,
        }))
    }
}

/// A cache-shared read bounded by `deadline`: the shared error is cloned out, a timeout is
/// [`ReadError::Deadline`].
async fn shared_by_deadline(
    deadline: Instant,
    read: impl std::future::Future<Output = Result<Arc<RunSet>, Arc<ReadError>>>,
) -> Result<Arc<RunSet>, ReadError> {
    match tokio::time::timeout_at(deadline, read).await {
        Ok(Ok(set)) => Ok(set),
        Ok(Err(err)) => Err((*err).clone()),
        Err(_) => Err(ReadError::Deadline),
    }
}

/// URL-id lookups of one resource kind: hits are served from the cache, found resources are
/// cached, misses are not (they may exist a moment later). A [`TtlCache`]: run feeds look
/// their run up on every poll, and nothing here needs a loading cache's single flight.
struct Lookups<I, T> {
    /// Bound: 100 000 resources; TTL: `caches.resource_cache_ttl_ms` (at least 1 ms).
    cache: TtlCache<(EnvId, I), Arc<T>>,
}

impl<I, T> Lookups<I, T>
where
    I: Clone + Eq + std::hash::Hash + Send + Sync + 'static,
    T: Send + Sync + 'static,
{
    fn new(ttl: Duration) -> Self {
        Lookups {
            cache: TtlCache::new(100_000, ttl),
        }
    }

    /// [`Freshness::Cached`]: the cached resource, else `read()`; [`Freshness::Fresh`]:
    /// `read()` now. What `read()` finds is cached, a miss drops the cached entry. The read's
    /// future is built only on a miss: a store future is several KiB, and a hit should not
    /// move one.
    async fn find<F>(
        &self,
        env_id: &EnvId,
        id: &I,
        freshness: Freshness,
        read: impl FnOnce() -> F,
    ) -> Result<Option<Arc<T>>, StoreError>
    where
        F: std::future::Future<Output = Found<T>>,
    {
        let key = (env_id.clone(), id.clone());
        if freshness == Freshness::Cached {
            if let Some(hit) = self.cache.get(&key) {
                return Ok(Some(hit));
            }
        }
        let found = Box::pin(read()).await?.map(Arc::new);
        match &found {
            Some(resource) => self.cache.insert(key, resource.clone()),
            None => self.cache.remove(&key),
        }
        Ok(found)
    }
}

/// What a shared run set weighs against `caches.runset_cache_max_bytes`, bytes (an estimate:
/// its rows' serialized bytes plus a fixed overhead per row and per set).
fn set_weight(set: &Arc<RunSet>) -> u64 {
    crate::protocol::held_bytes(&set.rows)
}
