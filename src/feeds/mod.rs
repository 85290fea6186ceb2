//! The three feed kinds (run, tag, batch) behind one request path: snapshot, catch-up, live
//! long-poll with router wakes, cold re-check and backstop (docs/behaviours.md §1.9–1.13).
//!
//! Read it top to bottom: this file holds the request and reply types and [`Feeds::serve`],
//! which sends a poll to [`snapshot`] (`offset=-1`), [`catch_up`] (a handle, not live) or
//! [`live`] (the hold), each of which ends in [`reply`] (the response every poll ends with);
//! [`handles`] checks the handle a poll presents, and [`state`] records and resumes what each
//! response left its client with.
//! Before a live poll is served, [`admit`] takes its slot of the environment's concurrency limit.
//!
//! Per connection (environment + handle) the server records, for every offset it hands out,
//! what that response left the client with: a working set and a replay cursor
//! ([`ConnState`]). The next poll looks up the offset the client ECHOES, so a lost response is
//! simply answered again. States expire (working-set TTL) and are bounded in number.

pub mod admit;
pub mod backstop;
pub mod cursors;
pub mod diff;
pub mod read;
pub mod sets;
pub mod shares;
pub mod stream;
pub mod window;

mod catch_up;
mod handles;
mod live;
mod reply;
mod snapshot;
mod state;

use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{CachesConfig, FeedsConfig};
use crate::protocol::body::FragmentBody;
use crate::protocol::electric::LogMode;
use crate::protocol::handle::{HandleClaims, HandleKey};
use crate::protocol::headers::ElectricHeaders;
use crate::protocol::offset::{Offset, OffsetParam};
use crate::protocol::{ColumnSet, EnvId, Handle};
use crate::redis::{CursorStats, CursorStore};
use crate::router::{Feed, FeedFilter, ReplayCursor, Router};
use crate::store::RunStore;
use crate::telemetry::metrics::{DeliveryPath, Metrics};

pub use diff::{Known, Pending, Version, WorkingSet};
pub use handles::issued_offset;
pub use read::{ReadError, RunSet, SetRead, Target};
pub use sets::{Freshness, Sets};
use state::{ConnKey, ConnStates};
pub use state::{ConnState, HOP_BACK_AFTER_MS, SHARED_REWRITE_AFTER};

/// What a feed request asks for, after authentication, resource lookup and scope checks.
#[derive(Clone, Debug)]
pub struct FeedRequest {
    /// Internal environment id.
    pub env_id: EnvId,
    pub target: Target,
    pub cols: ColumnSet,
    pub offset: OffsetParam,
    /// `handle` (or legacy `shape_id`).
    pub handle: Option<Handle>,
    /// `live=true`.
    pub live: bool,
    /// The client's `cursor` parameter.
    pub cursor: Option<String>,
    /// `x-trigger-api-version` is not the current one: rewrite `DEQUEUED` to `EXECUTING`.
    pub legacy_api_version: bool,
    /// `log=full` or `log=changes_only` (a `changes_only` snapshot carries no rows).
    pub log: LogMode,
    /// The reply feeds an SSE stream: the offsets it mints have an LSN form
    /// (`Offset::lsn`), because the SSE client builds its next offset from the LSN.
    pub sse: bool,
}

impl FeedRequest {
    /// A read of `target` for this request, with its columns, given up at `deadline`.
    fn read<'a>(&'a self, target: &'a Target, deadline: Instant) -> SetRead<'a> {
        SetRead {
            env_id: &self.env_id,
            target,
            cols: self.cols,
            deadline,
        }
    }
}

/// A successful (2xx) feed answer.
#[derive(Debug)]
pub struct FeedReply {
    pub headers: ElectricHeaders,
    /// The offset the reply leaves the client at (also in `headers`).
    pub offset: Offset,
    pub body: FragmentBody,
    /// Rows carried (for logs and metrics).
    pub rows: usize,
    /// The newest `updatedAt` (epoch ms) among the rows carried (delivery-lag metric).
    pub newest_ms: Option<i64>,
}

/// Why a feed request did not produce a 200.
#[derive(Debug, thiserror::Error)]
pub enum FeedError {
    /// The handle was not issued by this server for this feed and environment (or the state
    /// it needs is gone): 409 must-refetch with a fresh handle.
    #[error("must refetch")]
    MustRefetch { handle: Handle },
    /// `offset` other than -1 (or `now`) without a handle ([`issued_offset`]): 400.
    #[error("offset {0} requires a handle")]
    HandleRequired(String),
    /// The store failed or was too slow: 503 (the client retries with backoff).
    #[error("store unavailable: {0}")]
    Unavailable(#[from] ReadError),
}

/// The feeds service.
pub struct Feeds {
    cfg: FeedsConfig,
    router: Router,
    handles: HandleKey,
    sets: Sets,
    conns: ConnStates,
    /// Cancelled when the server shuts down: held polls answer at once, new live polls are not
    /// held.
    shutdown: CancellationToken,
    /// Instruments (no-op unless [`Feeds::with_metrics`]).
    metrics: Arc<Metrics>,
    /// Fleet-shared replay cursors (None: per-instance only).
    cursors: Option<CursorStore>,
    /// `caches.working_set_ttl_ms`: how long shared states live in Redis.
    working_set_ttl_ms: u64,
}

/// One poll of a known feed: the request, the handle it verified, the target it resumes, and
/// the offset its client echoed.
#[derive(Clone, Copy)]
struct Poll<'a> {
    req: &'a FeedRequest,
    handle: &'a Handle,
    /// What the handle says (verified, or taken from `state`).
    claims: &'a Arc<HandleClaims>,
    target: &'a Target,
    offset: Offset,
    /// This instance's state for the offset the client echoed, read once when the poll began.
    state: Option<&'a Arc<ConnState>>,
}

impl Poll<'_> {
    /// The key of the state recorded for `offset` of this connection.
    fn key(&self, offset: Offset) -> ConnKey {
        (self.req.env_id.clone(), self.handle.clone(), offset)
    }

    /// The router feed this poll holds, replaying from `since`.
    fn feed(&self, since: Option<ReplayCursor>) -> Feed {
        Feed {
            env_id: self.req.env_id.clone(),
            filter: filter_of(self.target),
            cols: self.req.cols,
            since,
        }
    }
}

impl Feeds {
    /// The service over `store` and `router`, handles signed with `handles`.
    pub fn new(
        cfg: FeedsConfig,
        caches: &CachesConfig,
        store: Arc<dyn RunStore>,
        router: Router,
        handles: HandleKey,
    ) -> Feeds {
        let conns = ConnStates::new(
            caches.working_set_max_entries.saturating_mul(2),
            Duration::from_millis(caches.working_set_ttl_ms.max(1)),
        );
        Feeds {
            sets: Sets::new(store, router.clone(), &cfg, caches),
            cfg,
            router,
            handles,
            conns,
            shutdown: CancellationToken::new(),
            metrics: Metrics::noop(),
            cursors: None,
            working_set_ttl_ms: caches.working_set_ttl_ms,
        }
    }

    /// Shares replay cursors through `store`, so a poll landing on another instance replays its
    /// gap instead of re-reading the whole feed.
    pub fn with_cursor_store(mut self, store: CursorStore) -> Feeds {
        self.cursors = Some(store);
        self
    }

    /// Records into `metrics` (feeds and run-set instruments) instead of the no-op default.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Feeds {
        self.sets.set_metrics(metrics.clone());
        self.metrics = metrics;
        self
    }

    /// Per-connection states kept now (working sets with replay cursors), expired ones
    /// included until they are swept out (at most half the working-set TTL after expiry).
    pub fn working_set_size(&self) -> u64 {
        self.conns.len() as u64
    }

    /// Runs held by busy environments' windows now (`feeds.window_max_runs` at most).
    pub fn window_runs(&self) -> usize {
        self.sets.window_runs()
    }

    /// The shared cursor store's counters (`None` when cursors are per-instance only).
    pub fn cursor_store_stats(&self) -> Option<Arc<CursorStats>> {
        self.cursors.as_ref().map(|c| c.stats().clone())
    }

    /// Resolve admission permits held now (0 when admission is unbounded).
    pub fn admission_in_use(&self) -> usize {
        self.sets.admission_available().map_or(0, |free| {
            self.cfg.resolve_admission_limit.saturating_sub(free)
        })
    }

    /// Records a live emission of `reply` through `path` and passes it on.
    fn emitted(&self, path: DeliveryPath, reply: FeedReply) -> FeedReply {
        self.metrics.emitted(path, reply.rows, reply.newest_ms);
        reply
    }

    /// Drains on `shutdown` (graceful shutdown): once it is cancelled every held live poll
    /// answers `up-to-date` at once, and live polls arriving from then on are not held (clients
    /// re-poll elsewhere).
    pub fn with_shutdown(mut self, shutdown: CancellationToken) -> Feeds {
        self.sets.set_shutdown(&shutdown);
        self.shutdown = shutdown;
        self
    }

    /// The readers (resource lookups for the HTTP layer).
    pub fn sets(&self) -> &Sets {
        &self.sets
    }

    /// The router.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Answers one feed request. Live polls hold up to the configured hold (±jitter); dropping
    /// the future (client gone) releases everything at once.
    pub async fn serve(&self, req: FeedRequest) -> Result<FeedReply, FeedError> {
        let (offset, handle) = match issued_offset(req.offset, req.handle.as_ref())? {
            // Boxed: only the live path's state may size the future a held poll keeps.
            None => return Box::pin(self.snapshot(&req)).await,
            Some(issued) => issued,
        };
        // A state this instance recorded for exactly this handle and offset exists only if it
        // minted or verified the handle: its claims stand in for a second HMAC check, once
        // they are checked against this request's feed (a handle reused on another feed's URL
        // is still refused).
        let state = self
            .conns
            .get(&(req.env_id.clone(), handle.clone(), offset));
        let claims = match state.as_ref().filter(|s| self.same_feed_as(&req, s)) {
            Some(state) => state.claims.clone(),
            None => Arc::new(self.verify(&req, handle)?),
        };
        let target = self.resume_target(&req.target, &claims);
        let poll = Poll {
            req: &req,
            handle,
            claims: &claims,
            target: &target,
            offset,
            state: state.as_ref(),
        };
        if req.live {
            // Dropped unfinished (client gone) = an `abort` wakeup.
            let guard = self.metrics.live_guard();
            let reply = self.live(poll).await;
            guard.finish();
            reply
        } else {
            Box::pin(self.catch_up(poll)).await
        }
    }

    /// Checks, without holding, what [`Feeds::serve`] would refuse before holding a live
    /// request at an issued offset: a missing handle, or one not issued for this feed
    /// (409 must-refetch). The SSE mode checks this before it sends its 200 headers, so that a
    /// must-refetch stays an ordinary 409 (docs/protocol.md §13.4).
    pub fn check(&self, req: &FeedRequest) -> Result<(), FeedError> {
        if let Some((_, handle)) = issued_offset(req.offset, req.handle.as_ref())? {
            self.verify(req, handle)?;
        }
        Ok(())
    }

    /// The shutdown signal (cancelled when the server starts draining).
    pub fn shutdown_token(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// The feeds configuration.
    pub fn config(&self) -> &FeedsConfig {
        &self.cfg
    }

    fn hold(&self) -> Duration {
        let base = self.cfg.live_poll_timeout_ms as f64;
        let r = self.cfg.live_poll_jitter_ratio;
        let factor = 1.0 - r + rand::rng().random::<f64>() * 2.0 * r;
        Duration::from_millis((base * factor).max(1.0) as u64)
    }

    /// When a live poll held from now expires: now plus its jittered hold, rounded up to the
    /// next [`expiry_tick`]. Polls expiring within one tick then wake the runtime once and
    /// are answered together (their clients' re-polls arrive together too), instead of one
    /// timer wake, one `epoll_wait` and one worker unpark per poll (BENCHMARKS.md "Cost per
    /// unit of work").
    fn hold_deadline(&self) -> Instant {
        let tick = expiry_tick(self.cfg.live_poll_timeout_ms);
        align_up(Instant::now() + self.hold(), tick)
    }
}

/// Longest rounding of a hold's expiry ([`Feeds::hold_deadline`]), ms.
pub const MAX_EXPIRY_TICK_MS: u64 = 25;

/// The grid hold expiries are rounded up to for a configured hold of `hold_ms`:
/// [`MAX_EXPIRY_TICK_MS`], or a twentieth of a shorter hold (whole ms; 0 = no rounding).
pub fn expiry_tick(hold_ms: u64) -> Duration {
    Duration::from_millis(MAX_EXPIRY_TICK_MS.min(hold_ms / 20))
}

/// `at` rounded up to a multiple of `tick` counted from a fixed instant of this process (the
/// first call), so every poll shares one grid.
fn align_up(at: Instant, tick: Duration) -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let tick_ns = tick.as_nanos();
    if tick_ns == 0 {
        return at;
    }
    let origin = *ORIGIN.get_or_init(Instant::now);
    let since = at.saturating_duration_since(origin).as_nanos();
    let up = since.div_ceil(tick_ns) * tick_ns - since;
    at + Duration::from_nanos(u64::try_from(up).unwrap_or(0))
}

fn filter_of(target: &Target) -> FeedFilter {
    match target {
        Target::Run { run_id } => FeedFilter::Run {
            run_id: run_id.clone(),
        },
        Target::Tag { tags, floor_ms } => FeedFilter::Tag {
            tags: tags.clone(),
            floor_ms: *floor_ms,
        },
        Target::Batch { batch_id } => FeedFilter::Batch {
            batch_id: batch_id.clone(),
        },
    }
}

/// Rounds `ms` down to a multiple of `bucket_ms` (0 = unchanged) (TAG-01).
pub fn bucket(ms: i64, bucket_ms: u64) -> i64 {
    match i64::try_from(bucket_ms) {
        Ok(b) if b > 0 => ms - ms.rem_euclid(b),
        _ => ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_expiries_share_a_grid_and_are_never_early() {
        let tick = expiry_tick(20_000);
        assert_eq!(tick, Duration::from_millis(MAX_EXPIRY_TICK_MS));
        assert_eq!(expiry_tick(200), Duration::from_millis(10));
        assert_eq!(expiry_tick(10), Duration::ZERO);
        let now = Instant::now();
        let a = align_up(now + Duration::from_millis(3), tick);
        let b = align_up(now + Duration::from_millis(7), tick);
        assert!(a >= now + Duration::from_millis(3) && a < now + Duration::from_millis(3) + tick);
        assert!(b >= now + Duration::from_millis(7));
        // Expiries within one tick of each other land on one or two grid points, a tick apart.
        let gap = b.max(a) - b.min(a);
        assert!(gap == Duration::ZERO || gap == tick, "{gap:?}");
        let later = now + Duration::from_secs(3);
        assert_eq!(align_up(later, Duration::ZERO), later);
        assert_eq!(align_up(align_up(later, tick), tick), align_up(later, tick));
    }

    #[test]
    fn an_issued_offset_needs_a_handle() {
        let at = Offset { ms: 1, seq: 2 };
        let handle = Handle::new("h");
        assert!(matches!(
            issued_offset(OffsetParam::Initial, None::<&Handle>),
            Ok(None)
        ));
        assert!(matches!(
            issued_offset(OffsetParam::Now, Some(&handle)),
            Ok(None)
        ));
        assert!(matches!(
            issued_offset(OffsetParam::At(at), Some(&handle)),
            Ok(Some((o, h))) if o == at && *h == handle
        ));
        assert!(matches!(
            issued_offset(OffsetParam::At(at), None::<&str>),
            Err(FeedError::HandleRequired(o)) if o == at.to_string()
        ));
    }

    #[test]
    fn tag_01_floor_is_bucketed_to_whole_minutes() {
        let t = 1_700_000_030_500; // …:30.500
        assert_eq!(bucket(t, 60_000) % 60_000, 0);
        assert!(bucket(t, 60_000) <= t && t - bucket(t, 60_000) < 60_000);
        assert_eq!(bucket(t, 0), t);
    }
}

#[cfg(test)]
mod future_sizes {
    //! Sizes of the futures a held live poll keeps alive (memory per held feed, BENCHMARKS.md
    //! "Held feeds").
    use super::*;

    fn size1<'a, A: 'a, B, F: std::future::Future + 'a>(_: fn(&'a A, B) -> F) -> usize {
        std::mem::size_of::<F>()
    }
    fn size_poll<'a, F: std::future::Future + 'a>(_: fn(&'a Feeds, Poll<'a>) -> F) -> usize {
        std::mem::size_of::<F>()
    }
    fn size_snap<'a, F: std::future::Future + 'a>(_: fn(&'a Feeds, &'a FeedRequest) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// A held live poll keeps `Feeds::serve`'s future for the whole hold: the reads before
    /// and after the hold are boxed so they do not size it (5 832 bytes for `live` before, in
    /// a debug build, because `lookup`'s 5 368 were inline).
    #[test]
    fn held_poll_futures_stay_small() {
        let (serve, live) = (size1(Feeds::serve), size_poll(Feeds::live));
        println!(
            "bytes: Feeds::serve {serve}, live {live}, snapshot {}, lookup {}",
            size_snap(Feeds::snapshot),
            size_poll(Feeds::lookup)
        );
        assert!(live <= 1024, "Feeds::live future is {live} bytes");
        assert!(serve <= 1536, "Feeds::serve future is {serve} bytes");
    }
}
