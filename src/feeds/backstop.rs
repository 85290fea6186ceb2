//! Backstops that read only what can have changed.
//!
//! A backstop (the store read at the end of a quiet hold) finds the changes whose publish was
//! lost. Re-reading a tag filter's whole set for that costs the database a set query over
//! trigger.dev's indexes, whose cost grows with the table's history (a GIN posting list over all
//! time, a BRIN on `createdAt`). Between full re-reads, a filter's [`View`] is brought forward
//! instead by what can have changed since it was read:
//!
//! - its runs whose status is not final: their heads by primary key;
//! - the runs created since: the environment's [`Tail`], one bounded range of the
//!   `(runtimeEnvironmentId, createdAt)` index shared by every filter of the environment;
//! - runs leaving the `createdAt` window: worked out locally from the heads.
//!
//! A full re-read of the filter happens at most every `caches.full_reread_ms` (jittered ±25 %
//! per filter, so filters do not align); it catches what the rest cannot see, such as a lost
//! publish that added a tag to a finished run. docs/operations.md ("Backstops") states how late
//! each kind of lost publish surfaces.
//!
//! The caller compares a view's heads with what its client has and hydrates only the runs that
//! moved ([`super::sets::Sets::read_backstop`]).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::read::{ReadError, RunSet, Target};
use crate::cache::TtlCache;
use crate::clock::now_ms;
use crate::protocol::{BatchId, EnvId, RunId, RunMeta};
use crate::router::{FeedFilter, ReplayCursor, Router};
use crate::store::{HeadScope, RunStore};

/// Runs created (by their `createdAt`) this long before a read started are read again by the
/// next read, ms: a row becomes visible when its transaction commits, after its `createdAt`,
/// and on a replica later still. A run committed later than this after its `createdAt` is found
/// by the next full re-read.
pub const COMMIT_MARGIN_MS: i64 = 30_000;

/// Most heads one tail read returns. A busier environment's tail covers less time, and the
/// filters it no longer covers re-read fully.
pub const TAIL_READ_LIMIT: usize = 20_000;

/// Environments whose tail is kept (least recently used beyond that are dropped).
const MAX_TAILS: u64 = 10_000;

/// What a view is about: a filter without its `createdAt` floor (a tag feed's floor moves with
/// time; one view serves every floor at or above its own).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Subject {
    Run(RunId),
    Batch(BatchId),
    Tag(Arc<[String]>),
}

impl Subject {
    /// The subject of `target` and its floor (`i64::MIN` for run and batch feeds).
    fn of(target: &Target) -> (Subject, i64) {
        match target {
            Target::Run { run_id } => (Subject::Run(run_id.clone()), i64::MIN),
            Target::Batch { batch_id } => (Subject::Batch(batch_id.clone()), i64::MIN),
            Target::Tag { tags, floor_ms } => (Subject::Tag(tags.clone()), *floor_ms),
        }
    }

    /// The membership predicate of this subject at `floor_ms`.
    fn filter(&self, floor_ms: i64) -> FeedFilter {
        match self {
            Subject::Run(run_id) => FeedFilter::Run {
                run_id: run_id.clone(),
            },
            Subject::Batch(batch_id) => FeedFilter::Batch {
                batch_id: batch_id.clone(),
            },
            Subject::Tag(tags) => FeedFilter::Tag {
                tags: tags.clone(),
                floor_ms,
            },
        }
    }
}

/// One filter's runs as of a read: their heads, never their payload.
#[derive(Debug)]
pub struct View {
    /// The runs in the filter (at most the list cap), newest first.
    heads: Vec<Arc<RunMeta>>,
    /// The `createdAt` floor the view was read at: it serves feeds whose floor is at or above.
    floor_ms: i64,
    /// Backstops until this reuse it as it is; later ones bring it forward. A view seeded by a
    /// snapshot is not shared at all: the client has just been sent that read, so its first
    /// backstop must look again (cheaply, by [`Backstops::advance`]).
    share_until: Instant,
    /// The same, wall time (epoch ms).
    read_ms: i64,
    /// When the next backstop re-reads the filter fully.
    full_due: Instant,
    /// Every matching run created at or after this (epoch ms) and committed before the read is
    /// in `heads`.
    covered_from_ms: i64,
    /// The router cursor taken before the read.
    pub cursor: ReplayCursor,
    /// The replica had applied what the records before `cursor` announced.
    pub settled: bool,
}

impl View {
    /// The heads of the runs a feed of `target` carries (those at or above its floor).
    pub fn heads_for<'a>(&'a self, target: &Target) -> impl Iterator<Item = &'a Arc<RunMeta>> {
        let floor = Subject::of(target).1;
        self.heads.iter().filter(move |h| h.created_at_ms >= floor)
    }
}

/// What [`Backstops::current`] found.
pub enum Current {
    /// The filter was re-read fully (its rows, for the caller to diff as they are).
    Full(Arc<RunSet>),
    /// A view brought forward (or read by another poll within `caches.backstop_share_ms`).
    View(Arc<View>),
}

/// An environment's recently created runs: what one bounded range read of the
/// `(runtimeEnvironmentId, createdAt)` index returned, kept for the filters that need it.
#[derive(Debug, Default)]
struct Tail {
    /// Heads of the runs created at or after `covered_from_ms`, in no particular order.
    heads: HashMap<RunId, Arc<RunMeta>>,
    /// Every run created at or after this and committed before `read_start_ms` is in `heads`
    /// (`i64::MAX` until the first read).
    covered_from_ms: i64,
    /// Wall time (epoch ms) the last read started.
    read_start_ms: i64,
    /// When the last read ran (`None`: never).
    read_at: Option<Instant>,
}

/// A filter's current view (`None` until its first read); its lock single-flights the reads.
type ViewSlot = Arc<Mutex<Option<Arc<View>>>>;

/// The views of the filters that backstops read, and the tails of their environments.
pub struct Backstops {
    store: Arc<dyn RunStore>,
    router: Router,
    cap: usize,
    /// A view (or tail) younger than this is used as it is (`caches.backstop_share_ms`).
    share: Duration,
    /// `caches.full_reread_ms` (> 0).
    full_reread: Duration,
    /// One slot per filter: the lock single-flights its reads. Bound: `caches.runset_cache_max_entries`
    /// filters; each dropped once unused for two full periods plus the share time (an idle
    /// cache: its feeds are gone).
    views: TtlCache<(EnvId, Subject), ViewSlot>,
    /// One tail per environment. Bound: [`MAX_TAILS`] environments; dropped once unused for
    /// two full periods plus the share time (an idle cache).
    tails: TtlCache<EnvId, Arc<Mutex<Tail>>>,
}

/// Settings of [`Backstops::new`].
pub struct BackstopSettings {
    /// The list cap (`feeds.max_list_results`).
    pub cap: usize,
    /// `caches.backstop_share_ms`.
    pub share: Duration,
    /// `caches.full_reread_ms` (must be > 0).
    pub full_reread: Duration,
    /// Filters whose views are kept (`caches.runset_cache_max_entries`).
    pub max_views: u64,
}

impl Backstops {
    /// Views over `store`, sequenced by `router`.
    pub fn new(store: Arc<dyn RunStore>, router: Router, settings: BackstopSettings) -> Backstops {
        // A view unused for two full periods is dropped: its feeds are gone.
        let idle = settings.full_reread.saturating_mul(2) + settings.share;
        Backstops {
            store,
            router,
            cap: settings.cap,
            share: settings.share,
            full_reread: settings.full_reread,
            views: TtlCache::idle(settings.max_views, idle),
            tails: TtlCache::idle(MAX_TAILS, idle),
        }
    }

    /// How long a tail keeps runs: long enough to bring forward a view read fully at most one
    /// (jittered) full period ago.
    fn keep_ms(&self) -> i64 {
        let keep = self.full_reread.mul_f64(1.25) + self.share.saturating_mul(2);
        i64::try_from(keep.as_millis()).unwrap_or(i64::MAX / 4) + COMMIT_MARGIN_MS
    }

    /// When a view read now is next re-read fully.
    fn full_due(&self, now: Instant) -> Instant {
        now + self
            .full_reread
            .mul_f64(rand::rng().random_range(0.75..1.25))
    }

    /// The current view of `target` in `env_id`: the shared one while it is younger than
    /// `caches.backstop_share_ms`, else brought forward, else (first read, full period over,
    /// a floor below the view's, or the store cannot read heads) `full()`, the whole filter.
    /// Concurrent callers for one filter wait for one read.
    ///
    /// # Errors
    /// The store failed (or `full()` did).
    pub async fn current<F, Fut>(
        &self,
        env_id: &EnvId,
        target: &Target,
        full: F,
    ) -> Result<Current, ReadError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Arc<RunSet>, ReadError>>,
    {
        let (subject, floor) = Subject::of(target);
        let slot = self
            .views
            .get_or_insert_with((env_id.clone(), subject.clone()), || {
                Arc::new(Mutex::new(None))
            });
        let mut guard = slot.lock().await;
        let now = Instant::now();
        if let Some(view) = guard
            .as_ref()
            .filter(|v| floor >= v.floor_ms && now < v.full_due)
        {
            if now < view.share_until {
                return Ok(Current::View(view.clone()));
            }
            if let Some(next) = Box::pin(self.advance(env_id, &subject, view)).await? {
                *guard = Some(next.clone());
                return Ok(Current::View(next));
            }
        }
        let set = full().await?;
        *guard = Some(self.whole(&set, floor, now, now + self.share));
        Ok(Current::Full(set))
    }

    /// Keeps a whole-filter read made for another reason (a cold snapshot, a re-check) as the
    /// filter's view, so its first backstop brings that view forward instead of re-reading the
    /// whole filter. A view whose floor is lower, or that is newer, stays; a slot busy with a
    /// read is left alone.
    pub async fn seed(&self, env_id: &EnvId, target: &Target, set: &Arc<RunSet>) {
        if !set.settled {
            return;
        }
        let (subject, floor) = Subject::of(target);
        let slot = self
            .views
            .get_or_insert_with((env_id.clone(), subject), || Arc::new(Mutex::new(None)));
        let Ok(mut guard) = slot.try_lock() else {
            return;
        };
        let keep = guard
            .as_ref()
            .is_some_and(|v| v.floor_ms < floor || v.read_ms >= set.read_ms);
        if keep {
            return;
        }
        let now = Instant::now();
        *guard = Some(self.whole(set, floor, now, now));
    }

    /// The view of a whole-filter read at `floor_ms`, made at `now` (its full re-read falls due
    /// from then), shared by backstops until
    /// `share_until`.
    fn whole(&self, set: &RunSet, floor_ms: i64, now: Instant, share_until: Instant) -> Arc<View> {
        Arc::new(View {
            heads: set.rows.iter().map(|row| row.meta.clone()).collect(),
            floor_ms,
            share_until,
            read_ms: set.read_ms,
            full_due: self.full_due(now),
            covered_from_ms: set.read_ms - COMMIT_MARGIN_MS,
            cursor: set.cursor,
            settled: set.settled,
        })
    }

    /// `view` brought forward: its unfinished runs probed by primary key, the runs created
    /// since read from the environment's tail. `None`: it cannot be (the tail no longer reaches
    /// back far enough, or the store reads no heads); the caller re-reads fully.
    async fn advance(
        &self,
        env_id: &EnvId,
        subject: &Subject,
        view: &View,
    ) -> Result<Option<Arc<View>>, ReadError> {
        let cursor = self.router.touch(env_id);
        let settled = self.router.settle_replica(env_id).await;
        let started = Instant::now();
        let started_ms = now_ms();
        let probe: Vec<RunId> = view
            .heads
            .iter()
            .filter(|h| !h.finished)
            .map(|h| h.id.clone())
            .collect();
        let Some(probed) = self
            .store
            .run_heads(env_id, HeadScope::Ids(&probe))
            .await
            .map_err(ReadError::from)?
        else {
            return Ok(None);
        };
        let (created, covered_from_ms) = match subject {
            // A run feed's run exists before its feed does: nothing new to find.
            Subject::Run(_) => (Vec::new(), view.covered_from_ms),
            _ => match self
                .tail_since(
                    env_id,
                    view.covered_from_ms,
                    view.read_ms - COMMIT_MARGIN_MS,
                )
                .await?
            {
                Some(found) => found,
                None => return Ok(None),
            },
        };
        let filter = subject.filter(view.floor_ms);
        // The newest head read of each run, from the probe or the tail.
        let mut fresh: HashMap<RunId, Arc<RunMeta>> = HashMap::new();
        for head in probed.into_iter().map(Arc::new).chain(created) {
            match fresh.get(&head.id) {
                Some(have) if have.updated_at_ms >= head.updated_at_ms => {}
                _ => {
                    fresh.insert(head.id.clone(), head);
                }
            }
        }
        let mut heads: HashMap<RunId, Arc<RunMeta>> = view
            .heads
            .iter()
            .map(|h| (h.id.clone(), h.clone()))
            .collect();
        // A probed run that is gone from the store leaves the set.
        heads.retain(|id, _| fresh.contains_key(id) || !probe.contains(id));
        for head in fresh.into_values() {
            let newer = heads
                .get(&head.id)
                .is_none_or(|have| have.updated_at_ms <= head.updated_at_ms);
            if !newer {
                continue;
            }
            if filter.accepts(&head) {
                heads.insert(head.id.clone(), head);
            } else {
                // It no longer matches (a tag removed, below the floor).
                heads.remove(&head.id);
            }
        }
        let mut heads: Vec<Arc<RunMeta>> = heads.into_values().collect();
        heads.sort_unstable_by(|a, b| (b.created_at_ms, &b.id).cmp(&(a.created_at_ms, &a.id)));
        heads.truncate(self.cap);
        Ok(Some(Arc::new(View {
            heads,
            floor_ms: view.floor_ms,
            share_until: started + self.share,
            read_ms: started_ms,
            full_due: view.full_due,
            covered_from_ms,
            cursor,
            settled,
        })))
    }

    /// The heads of `env_id`'s runs created at or after `from_ms` or updated at or after
    /// `updated_from_ms` (the tail's unfinished runs are probed again at each read, so a tag
    /// added to a recent run is seen), and the time (epoch ms) the tail they came from covers
    /// from, as of its last read (read again when older than the share time). `None`: the tail
    /// does not reach back to `from_ms`.
    async fn tail_since(
        &self,
        env_id: &EnvId,
        from_ms: i64,
        updated_from_ms: i64,
    ) -> Result<Option<(Vec<Arc<RunMeta>>, i64)>, ReadError> {
        let slot = self.tails.get_or_insert_with(env_id.clone(), || {
            Arc::new(Mutex::new(Tail {
                covered_from_ms: i64::MAX,
                ..Tail::default()
            }))
        });
        let mut tail = slot.lock().await;
        if tail.read_at.is_none_or(|at| at.elapsed() >= self.share) {
            let started_ms = now_ms();
            let keep_from = started_ms - self.keep_ms();
            let read_from = match tail.read_at {
                Some(_) => (tail.read_start_ms - COMMIT_MARGIN_MS).max(keep_from),
                None => keep_from,
            };
            let scope = HeadScope::CreatedSince {
                from_ms: read_from,
                limit: TAIL_READ_LIMIT,
            };
            let Some(read) = self
                .store
                .run_heads(env_id, scope)
                .await
                .map_err(ReadError::from)?
            else {
                return Ok(None);
            };
            // Newest first: a full page covers only from just above its oldest row.
            let truncated = read.len() >= TAIL_READ_LIMIT;
            let read_covers = match read.last() {
                Some(oldest) if truncated => oldest.created_at_ms + 1,
                _ => read_from,
            };
            if truncated || tail.read_at.is_none() {
                tail.heads.clear();
                tail.covered_from_ms = read_covers;
            }
            // The tail's unfinished runs created before this read's range: probed again.
            let reprobe: Vec<RunId> = tail
                .heads
                .values()
                .filter(|h| !h.finished && h.created_at_ms < read_from)
                .map(|h| h.id.clone())
                .collect();
            if !reprobe.is_empty() {
                let probed = self
                    .store
                    .run_heads(env_id, HeadScope::Ids(&reprobe))
                    .await
                    .map_err(ReadError::from)?
                    .unwrap_or_default();
                for id in &reprobe {
                    tail.heads.remove(id);
                }
                for head in probed {
                    tail.heads.insert(head.id.clone(), Arc::new(head));
                }
            }
            for head in read {
                tail.heads.insert(head.id.clone(), Arc::new(head));
            }
            tail.heads.retain(|_, h| h.created_at_ms >= keep_from);
            tail.covered_from_ms = tail.covered_from_ms.max(keep_from);
            tail.read_start_ms = started_ms;
            tail.read_at = Some(Instant::now());
        }
        if from_ms < tail.covered_from_ms {
            return Ok(None);
        }
        let heads = tail
            .heads
            .values()
            .filter(|h| h.created_at_ms >= from_ms || h.updated_at_ms >= updated_from_ms)
            .cloned()
            .collect();
        Ok(Some((heads, tail.read_start_ms - COMMIT_MARGIN_MS)))
    }
}
