//! The three feed kinds (run, tag, batch) behind one request path: snapshot, catch-up, live
//! long-poll with router wakes, cold re-check and backstop (docs/behaviours.md §1.9–1.13).
//!
//! Per connection (environment + handle) the server records, for every offset it hands out,
//! what that response left the client with: a working set and a replay cursor
//! ([`ConnState`]). The next poll looks up the offset the client ECHOES, so a lost response is
//! simply answered again. States expire (working-set TTL) and are bounded in number.

pub mod cursors;
pub mod diff;
pub mod sets;
pub mod stream;

use std::sync::Arc;
use std::time::Duration;

use moka::sync::Cache;
use rand::Rng;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::clock::now_ms;
use crate::config::{CachesConfig, FeedsConfig};
use crate::protocol::body::{FragmentBody, Operation};
use crate::protocol::cursor::{next_cursor, next_offset_seq, vouched_wall_ms, Gap};
use crate::protocol::electric::LogMode;
use crate::protocol::encode::schema_header;
use crate::protocol::handle::{filter_digest, FeedKind, HandleClaims, HandleKey};
use crate::protocol::headers::ElectricHeaders;
use crate::protocol::offset::{Offset, OffsetParam};
use crate::protocol::{ColumnSet, EnvId, Handle, RunId, SerializedRow};
use crate::redis::{CursorStats, CursorStore};
use crate::router::{Feed, FeedFilter, Registration, ReplayCursor, Router};
use crate::store::RunStore;
use crate::telemetry::metrics::{DeliveryPath, LivePath, Metrics, WakeReason};

pub use diff::{Known, Pending, Version, WorkingSet};
pub use sets::{Freshness, ReadError, RunSet, Sets, Target};

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
    /// `offset` other than -1 without a handle.
    #[error("offset {0} requires a handle")]
    HandleRequired(String),
    /// The store failed or was too slow: 503 (the client retries with backoff).
    #[error("store unavailable: {0}")]
    Unavailable(#[from] ReadError),
}

/// What the server recorded for one offset it handed out.
#[derive(Debug)]
pub struct ConnState {
    /// What the client has after that response.
    pub ws: WorkingSet,
    /// Where the client's view of the change stream ends.
    pub cursor: ReplayCursor,
    /// The offset this response answered; dropped once the client presents this one.
    pub prev: Option<Offset>,
    /// Versions of the runs the latest responses carried (shared with the cursor, so another
    /// instance does not re-send them on a hop).
    pub recent: Vec<(RunId, Version)>,
    /// When this offset's state was last written to the fleet-shared store with a cursor that
    /// vouches for its gap (epoch ms); `None` when it was not. A later response at the same
    /// offset that carries nothing new needs no write while this is fresh (see
    /// [`SHARED_REWRITE_AFTER`]): another instance learns how far the client got from the
    /// cursor it echoes ([`vouched_wall_ms`]).
    pub shared_at_ms: Option<i64>,
}

/// A client cursor this much newer than the local state's own cursor means the client was
/// answered elsewhere since (it hopped and came back): the poll replays from the cursor's wall
/// time, like a hop, instead of from this instance's older position.
pub const HOP_BACK_AFTER_MS: i64 = 1_000;
/// An offset's shared state is written again after this fraction of the working-set TTL, so it
/// never expires in Redis while its client keeps polling at that offset.
pub const SHARED_REWRITE_AFTER: f64 = 0.5;

type ConnKey = (EnvId, Handle, Offset);

/// The feeds service.
pub struct Feeds {
    cfg: FeedsConfig,
    router: Router,
    handles: HandleKey,
    sets: Sets,
    conns: Cache<ConnKey, Arc<ConnState>>,
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
    target: &'a Target,
    offset: Offset,
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

/// How a response is built beyond its rows.
#[derive(Clone, Copy)]
struct ReplyShape {
    /// Carry `electric-schema` (non-live responses).
    schema: bool,
    /// The cursor this reply records vouches for its gap (its `epoch` is not 0): the client's
    /// `electric-cursor` says so ([`Gap`]).
    vouched: bool,
    /// Every store re-check of this poll succeeded. When one failed, the recorded cursor is one
    /// no later poll takes as covered, so that poll re-checks instead of trusting a stream that
    /// may have skipped this feed.
    trusted: bool,
}

/// What a poll knows about the offset its client echoed.
struct Resume {
    /// This instance's state for it (working set + cursor).
    state: Option<Arc<ConnState>>,
    /// The replay cursor: from the local state, else from the fleet-shared store.
    cursor: Option<ReplayCursor>,
    /// From the shared store: the versions the client's latest responses carried.
    recent: Option<WorkingSet>,
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
        let conns = Cache::builder()
            .max_capacity(caches.working_set_max_entries.saturating_mul(2))
            .time_to_live(Duration::from_millis(caches.working_set_ttl_ms.max(1)))
            .build();
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

    /// Per-connection states kept now (working sets with replay cursors). Runs the cache's
    /// pending housekeeping first (metrics read it once per collection), so the count is exact.
    pub fn working_set_size(&self) -> u64 {
        self.conns.run_pending_tasks();
        self.conns.entry_count()
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
        let offset = match req.offset {
            // Boxed: only the live path's state may size the future a held poll keeps.
            OffsetParam::Initial | OffsetParam::Now => return Box::pin(self.snapshot(&req)).await,
            OffsetParam::At(offset) => offset,
        };
        let Some(handle) = req.handle.as_ref() else {
            return Err(FeedError::HandleRequired(offset.to_string()));
        };
        let claims = self.verify(&req, handle)?;
        let target = self.resume_target(&req.target, &claims);
        let poll = Poll {
            req: &req,
            handle,
            target: &target,
            offset,
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
        if let OffsetParam::At(offset) = req.offset {
            let handle = req
                .handle
                .as_ref()
                .ok_or_else(|| FeedError::HandleRequired(offset.to_string()))?;
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

    fn claims_for(&self, req: &FeedRequest, floor_ms: Option<i64>) -> HandleClaims {
        let (kind, target) = match &req.target {
            Target::Run { run_id } => (FeedKind::Run, run_id.to_string()),
            Target::Tag { tags, .. } => (FeedKind::Tag, filter_digest(tags)),
            Target::Batch { batch_id } => (FeedKind::Batch, batch_id.to_string()),
        };
        HandleClaims {
            kind,
            env_id: req.env_id.clone(),
            target,
            floor_ms,
            columns: req.cols.bits(),
            nonce: rand::rng().random(),
        }
    }

    fn verify(&self, req: &FeedRequest, handle: &Handle) -> Result<HandleClaims, FeedError> {
        let expected = self.claims_for(req, None);
        match self.handles.verify(handle) {
            Ok(claims)
                if claims.kind == expected.kind
                    && claims.env_id == expected.env_id
                    && claims.target == expected.target
                    && claims.columns == expected.columns =>
            {
                Ok(claims)
            }
            _ => {
                let floor = match &req.target {
                    Target::Tag { floor_ms, .. } => Some(*floor_ms),
                    _ => None,
                };
                Err(FeedError::MustRefetch {
                    handle: self.handles.mint(&self.claims_for(req, floor)),
                })
            }
        }
    }

    /// Tag feeds resume with the floor pinned in the handle, re-clamped to the max age (TAG-04).
    fn resume_target(&self, target: &Target, claims: &HandleClaims) -> Target {
        match (target, claims.floor_ms) {
            (Target::Tag { tags, .. }, Some(pinned)) => {
                // The pinned floor wins over the request's `createdAt` (the client resends the
                // same URL), unless it is older than the max age (a stale or crafted handle).
                let min_floor = self.min_floor_ms();
                Target::Tag {
                    tags: tags.clone(),
                    floor_ms: bucket(pinned.max(min_floor), self.cfg.runset_created_at_bucket_ms),
                }
            }
            _ => target.clone(),
        }
    }

    fn min_floor_ms(&self) -> i64 {
        now_ms() - i64::try_from(self.cfg.maximum_created_at_filter_age_ms).unwrap_or(i64::MAX / 2)
    }

    fn hold(&self) -> Duration {
        let base = self.cfg.live_poll_timeout_ms as f64;
        let r = self.cfg.live_poll_jitter_ratio;
        let factor = 1.0 - r + rand::rng().random::<f64>() * 2.0 * r;
        Duration::from_millis((base * factor).max(1.0) as u64)
    }

    fn reply(
        &self,
        req: &FeedRequest,
        handle: Handle,
        offset: Offset,
        changes: &[(Operation, SerializedRow)],
        shape: ReplyShape,
    ) -> FeedReply {
        let refs: Vec<(Operation, &SerializedRow)> =
            changes.iter().map(|(op, row)| (*op, row)).collect();
        let body = if refs.is_empty() {
            FragmentBody::up_to_date()
        } else {
            FragmentBody::changes_then_up_to_date(&refs, req.legacy_api_version)
        };
        FeedReply {
            offset,
            headers: ElectricHeaders {
                handle,
                offset: Some(offset.to_string()),
                cursor: Some(next_cursor(req.cursor.as_deref(), gap_of(shape)).to_string()),
                schema: shape.schema.then(|| schema_header(req.cols)),
                up_to_date: true,
            },
            body,
            rows: changes.len(),
            newest_ms: changes.iter().map(|(_, r)| r.meta.updated_at_ms).max(),
        }
    }

    /// Records `state` for `offset`, locally and (unless its `shared_at_ms` says the shared
    /// store already has an equivalent, fresh value) in the fleet-shared store.
    fn record(&self, req: &FeedRequest, handle: &Handle, offset: Offset, mut state: ConnState) {
        if let Some(store) = &self.cursors {
            let now = now_ms();
            let rewrite_after = (self.working_set_ttl_ms as f64 * SHARED_REWRITE_AFTER) as i64;
            let fresh = state.cursor.epoch != 0
                && state
                    .shared_at_ms
                    .is_some_and(|at| now.saturating_sub(at) < rewrite_after);
            if !fresh {
                let value = cursors::encode(&state.cursor, &state.recent);
                store.set(&req.env_id, handle, &offset.to_string(), value);
                state.shared_at_ms = (state.cursor.epoch != 0).then_some(now);
            }
        }
        self.conns.insert(
            (req.env_id.clone(), handle.clone(), offset),
            Arc::new(state),
        );
    }

    async fn lookup(&self, poll: Poll<'_>) -> Resume {
        let Poll {
            req,
            handle,
            offset,
            ..
        } = poll;
        let state = self.conns.get(&poll.key(offset));
        if let Some(state) = &state {
            if let Some(prev) = state.prev {
                // The client has moved past `prev`: its state can go.
                self.conns.invalidate(&poll.key(prev));
            }
        }
        let (cursor, recent) = match (&state, &self.cursors) {
            (Some(state), _) => (Some(self.hop_back(state.cursor, req)), None),
            // Another instance answered the previous poll (or this one forgot it).
            (None, Some(store)) => match store
                .get(&req.env_id, handle, &offset.to_string(), cursors::decode)
                .await
            {
                Some((cursor, recent)) => (
                    Some(Self::caught_up(cursor, req, 0)),
                    Some(recent.into_iter().collect::<WorkingSet>()),
                ),
                None => (None, None),
            },
            (None, None) => (None, None),
        };
        self.metrics.state_lookup(state.is_some());
        Resume {
            state,
            cursor,
            recent,
        }
    }

    /// `cursor`, or one that replays from the wall time of the client's latest response when
    /// that response vouched for its gap and is more than `after_ms` newer than `cursor` (it was
    /// answered without writing the shared store: nothing was new). Never upgrades a cursor
    /// that does not vouch for its own gap (`epoch == 0`).
    fn caught_up(cursor: ReplayCursor, req: &FeedRequest, after_ms: i64) -> ReplayCursor {
        match vouched_wall_ms(req.cursor.as_deref(), now_ms()) {
            Some(wall_ms) if cursor.epoch != 0 && wall_ms > cursor.wall_ms + after_ms => {
                ReplayCursor::at_wall(cursor.epoch, wall_ms)
            }
            _ => cursor,
        }
    }

    /// This instance's own cursor for the offset, unless the client was answered elsewhere
    /// since ([`HOP_BACK_AFTER_MS`]).
    fn hop_back(&self, cursor: ReplayCursor, req: &FeedRequest) -> ReplayCursor {
        if self.cursors.is_none() {
            return cursor;
        }
        Self::caught_up(cursor, req, HOP_BACK_AFTER_MS)
    }

    fn known(&self, poll: Poll<'_>, resume: &Resume) -> Known {
        match (&resume.state, &resume.recent, poll.target) {
            (Some(s), _, _) => Known::Set(s.ws.clone()),
            (None, _, Target::Run { .. }) => Known::Floor(poll.offset.ms),
            (None, Some(recent), _) => Known::Partial(recent.clone()),
            (None, None, _) => Known::Nothing,
        }
    }

    /// Versions of the runs this response considered, then those carried from the state it
    /// answers (bounded by [`cursors::RECENT_MAX`]).
    fn recent(
        presented: Option<&ConnState>,
        known: &Known,
        pending: &Pending,
        ws: &WorkingSet,
    ) -> Vec<(RunId, Version)> {
        let mut out: Vec<(RunId, Version)> = pending
            .run_ids()
            .filter_map(|id| ws.get(id).map(|v| (id.clone(), *v)))
            .collect();
        let carried: Vec<(RunId, Version)> = match known {
            Known::Partial(map) => map.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            _ => presented.map(|s| s.recent.clone()).unwrap_or_default(),
        };
        for (id, v) in carried {
            if out.len() >= cursors::RECENT_MAX {
                break;
            }
            if !out.iter().any(|(have, _)| *have == id) {
                let version = ws.get(&id).copied().unwrap_or(v);
                out.push((id, version));
            }
        }
        out.truncate(cursors::RECENT_MAX);
        out
    }

    /// `offset=-1`: everything the feed carries as `insert`, under a new handle (RUN-01,
    /// TAG-01..03, BAT-02).
    ///
    /// `offset=now` and `log=changes_only` (Electric's semantics,
    /// <https://electric-sql.com/docs/api/http>): the same snapshot is taken and recorded as the
    /// client's working set, but the reply carries no rows — only `up-to-date` at the current
    /// offset — so the client goes live from here and receives later changes as usual.
    ///
    /// Never older than a version whose change record this instance received before the
    /// request: the read may come from the shared cache, taken before such records, so the
    /// records routed since its cursor are replayed on top of it (through the read-your-writes
    /// gate), after waiting for the ones received but still queued for their batch. Where the
    /// stream cannot vouch for the gap since the read, the feed is read again.
    async fn snapshot(&self, req: &FeedRequest) -> Result<FeedReply, FeedError> {
        let received = self.router.received(&req.env_id);
        let target = match &req.target {
            Target::Tag { tags, floor_ms } => Target::Tag {
                tags: tags.clone(),
                floor_ms: bucket(*floor_ms, self.cfg.runset_created_at_bucket_ms),
            },
            other => other.clone(),
        };
        let floor = match &target {
            Target::Tag { floor_ms, .. } => Some(*floor_ms),
            _ => None,
        };
        let handle = self.handles.mint(&self.claims_for(req, floor));
        let deadline = Instant::now() + Duration::from_millis(self.cfg.live_poll_timeout_ms);
        let set = self
            .sets
            .read_shared(&req.env_id, &target, req.cols, deadline)
            .await?;
        self.router.routed(&req.env_id, received, deadline).await;
        let reg = self
            .router
            .register(Feed {
                env_id: req.env_id.clone(),
                filter: filter_of(&target),
                cols: req.cols,
                since: Some(set.cursor),
            })
            .await;
        let mut pending = Pending::default();
        pending.extend(set.rows.iter().cloned());
        if !reg.covered() && !reg.quiet_since(&set.cursor) {
            let fresh = self
                .sets
                .read_covered(&req.env_id, &target, req.cols, deadline, &reg)
                .await?;
            pending.extend(fresh.rows.iter().cloned());
        }
        let (mut cursor, late) = reg.settle();
        if late.recheck || !set.settled {
            // The read may miss commits the stream already announced: the next poll re-checks.
            cursor.epoch = 0;
        }
        pending.extend(late.rows);
        let changes: Vec<_> = pending.changes(&Known::Set(WorkingSet::new()));
        let offset = Offset {
            ms: max_ms(0, &changes),
            seq: next_offset_seq(req.sse),
        };
        let rowless = req.offset == OffsetParam::Now || req.log == LogMode::ChangesOnly;
        let changes = if rowless { Vec::new() } else { changes };
        let ws = pending.next_working_set(&Known::Nothing);
        // The versions the snapshot carried travel with its shared cursor: an instance the
        // next poll lands on must not send an older version of them.
        let recent = Self::recent(None, &Known::Nothing, &pending, &ws);
        self.record(
            req,
            &handle,
            offset,
            ConnState {
                ws,
                cursor,
                prev: None,
                recent,
                shared_at_ms: None,
            },
        );
        let shape = ReplyShape {
            schema: true,
            vouched: cursor.epoch != 0,
            trusted: true,
        };
        Ok(self.reply(req, handle, offset, &changes, shape))
    }

    /// Non-live request with a handle (catch-up, prefetch, resume after pause): answered at
    /// once with what the client is missing, never held (docs/protocol.md §4.5–4.6).
    async fn catch_up(&self, poll: Poll<'_>) -> Result<FeedReply, FeedError> {
        let req = poll.req;
        // Every await but the hold is boxed: this future lives for the whole hold, and an
        // inline read would size it (memory per held feed).
        let resume = Box::pin(self.lookup(poll)).await;
        let known = self.known(poll, &resume);
        let deadline = Instant::now() + Duration::from_millis(self.cfg.live_poll_timeout_ms);
        let set = self
            .sets
            .read_shared(&req.env_id, poll.target, req.cols, deadline)
            .await?;
        // The cached read may predate records the client has not seen: replay them too.
        let reg = self.router.register(poll.feed(Some(set.cursor))).await;
        let mut pending = Pending::default();
        pending.extend(set.rows.iter().cloned());
        let mut trusted = set.settled;
        if !reg.covered() {
            let fresh = self
                .sets
                .read_covered(&req.env_id, poll.target, req.cols, deadline, &reg)
                .await?;
            trusted &= fresh.settled;
            pending.extend(fresh.rows.iter().cloned());
        }
        let shape = ReplyShape {
            schema: true,
            vouched: false,
            trusted,
        };
        Ok(self.respond(poll, &known, pending, &reg, shape))
    }

    /// Builds the response and records the state for its offset (see [`ReplyShape`]).
    fn respond(
        &self,
        poll: Poll<'_>,
        known: &Known,
        mut pending: Pending,
        reg: &Registration,
        shape: ReplyShape,
    ) -> FeedReply {
        let Poll {
            req,
            handle,
            offset,
            ..
        } = poll;
        let (mut cursor, late) = reg.settle();
        if late.recheck || !shape.trusted {
            cursor.epoch = 0;
        }
        let shape = ReplyShape {
            vouched: cursor.epoch != 0,
            ..shape
        };
        pending.extend(late.rows);
        let changes = pending.changes(known);
        let ws = pending.next_working_set(known);
        // The state recorded for the offset the client presented (read once).
        let presented = self.conns.get(&poll.key(offset));
        let recent = Self::recent(presented.as_deref(), known, &pending, &ws);
        if changes.is_empty() {
            // Nothing new: the offset stays what the client sent (docs/protocol.md §10); its
            // state keeps the same working set and moves the replay cursor forward.
            let prev = presented.as_ref().and_then(|s| s.prev);
            // Nothing new: the shared store's value for this offset still holds, and the
            // client's cursor will carry how far it got.
            let shared_at_ms = presented.as_ref().and_then(|s| s.shared_at_ms);
            self.record(
                req,
                handle,
                offset,
                ConnState {
                    ws,
                    cursor,
                    prev,
                    recent,
                    shared_at_ms,
                },
            );
            return self.reply(req, handle.clone(), offset, &changes, shape);
        }
        let next = Offset {
            ms: max_ms(offset.ms, &changes),
            seq: next_offset_seq(req.sse),
        };
        self.record(
            req,
            handle,
            next,
            ConnState {
                ws,
                cursor,
                prev: Some(offset),
                recent,
                shared_at_ms: None,
            },
        );
        self.reply(req, handle.clone(), next, &changes, shape)
    }

    /// `live=true`: hold until the router delivers a change the client does not have, or the
    /// hold expires (then the backstop re-reads).
    async fn live(&self, poll: Poll<'_>) -> Result<FeedReply, FeedError> {
        let req = poll.req;
        let drained = self.shutdown.cancelled();
        tokio::pin!(drained);
        let deadline = if self.shutdown.is_cancelled() {
            Instant::now()
        } else {
            Instant::now() + self.hold()
        };
        // Every await but the hold is boxed: this future lives for the whole hold, and an
        // inline read would size it (memory per held feed).
        let resume = Box::pin(self.lookup(poll)).await;
        let known = self.known(poll, &resume);
        let reg = Box::pin(self.router.register(poll.feed(resume.cursor))).await;
        let mut pending = Pending::default();
        let first = reg.take();
        pending.extend(first.rows);
        let mut shape = ReplyShape {
            schema: false,
            vouched: false,
            trusted: true,
        };
        let mut path = DeliveryPath::Replay;
        // Without this instance's working set but with a covered cursor (a hop), the replay is
        // exactly what changed since the client's last response: no store read needed.
        if !reg.covered() || first.recheck {
            // Cold path: the change stream cannot vouch for the gap; read the store now that
            // the feed is registered (anything after this read reaches the inbox).
            self.metrics.live_poll(LivePath::ColdResolve);
            path = DeliveryPath::Cold;
            shape.trusted &=
                Box::pin(self.recheck(poll, &known, deadline, &reg, &mut pending)).await;
        }
        loop {
            if !pending.changes(&known).is_empty() {
                return Ok(self.emitted(path, self.respond(poll, &known, pending, &reg, shape)));
            }
            tokio::select! {
                wake = reg.wait() => {
                    self.metrics.wakeup(WakeReason::Notify);
                    if !wake.rows.is_empty() {
                        self.metrics.live_poll(LivePath::FastHydrate);
                        path = DeliveryPath::Notify;
                    }
                    pending.extend(wake.rows);
                    if wake.recheck {
                        self.metrics.live_poll(LivePath::FullResolve);
                        path = DeliveryPath::Recheck;
                        shape.trusted &= Box::pin(self.recheck(poll, &known, deadline, &reg, &mut pending)).await;
                    }
                    if !self.cfg.hold_on_empty && pending.changes(&known).is_empty() {
                        return Ok(self.emitted(path, self.respond(poll, &known, pending, &reg, shape)));
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    self.metrics.wakeup(WakeReason::Timeout);
                    break;
                }
                _ = &mut drained => {
                    // Shutting down: answer what we have now, no backstop read.
                    self.metrics.wakeup(WakeReason::Abort);
                    return Ok(self.emitted(DeliveryPath::Drain, self.respond(poll, &known, pending, &reg, shape)));
                }
            }
        }
        // Backstop: a change the stream never announced (lost publish) surfaces here.
        let backstop_deadline =
            Instant::now() + Duration::from_millis(self.cfg.live_poll_timeout_ms / 4 + 1);
        // Polls that know their client's versions share backstop reads of the same filter
        // (`caches.backstop_share_ms`): an older shared read cannot regress a known row. The
        // others (another instance answered the client's last response) read fresh: an older
        // cached row would be sent as an update the client might already be past.
        let target = poll.target;
        let backstop = if known.versions_known() {
            Box::pin(
                self.sets
                    .read_backstop(&req.env_id, target, req.cols, backstop_deadline),
            )
            .await
        } else {
            Box::pin(
                self.sets
                    .read_fresh(&req.env_id, target, req.cols, backstop_deadline),
            )
            .await
        };
        match backstop {
            Ok(set) => {
                shape.trusted &= set.settled;
                pending.extend(set.rows.iter().cloned());
            }
            Err(err) => {
                tracing::warn!(env_id = %req.env_id, error = %err, "backstop read failed; answering up-to-date");
                shape.trusted = false;
            }
        }
        let reply = self.respond(poll, &known, pending, &reg, shape);
        self.metrics.backstop(reply.rows > 0);
        Ok(self.emitted(DeliveryPath::Backstop, reply))
    }

    /// Reads what the feed carries as of now; false if that failed (logged). A poll that knows
    /// its client's versions may use the shared read plus a replay ([`Sets::read_covered`]):
    /// the diff drops whatever the client is already past. One that does not reads fresh.
    async fn recheck(
        &self,
        poll: Poll<'_>,
        known: &Known,
        deadline: Instant,
        reg: &Registration,
        pending: &mut Pending,
    ) -> bool {
        let req = poll.req;
        let (env_id, target, cols) = (&req.env_id, poll.target, req.cols);
        // Bounded by the poll's deadline (a replay may wait on the read-your-writes gate).
        let read = async {
            let mut covered = known.versions_known();
            // A read the replica was still behind for is read again, within the gate's bound,
            // so the version it missed follows as soon as the replica has it.
            let settle_by = Instant::now() + self.router.replica_max_delay().unwrap_or_default();
            loop {
                let set = if covered {
                    self.sets
                        .read_covered(env_id, target, cols, deadline, reg)
                        .await?
                } else {
                    self.sets.read_fresh(env_id, target, cols, deadline).await?
                };
                let retry = self.router.replica_retry_delay();
                match retry {
                    Some(delay) if !set.settled && Instant::now() + delay < settle_by => {
                        covered = false;
                        tokio::time::sleep(delay).await;
                    }
                    _ => return Ok::<_, ReadError>(set),
                }
            }
        };
        match tokio::time::timeout_at(deadline, read)
            .await
            .unwrap_or(Err(ReadError::Deadline))
        {
            Ok(set) => {
                pending.extend(set.rows.iter().cloned());
                set.settled
            }
            Err(err) => {
                tracing::warn!(env_id = %req.env_id, error = %err, "store re-check failed; holding");
                false
            }
        }
    }
}

/// The mark of a reply's `electric-cursor`.
fn gap_of(shape: ReplyShape) -> Gap {
    if shape.vouched {
        Gap::Vouched
    } else {
        Gap::Unvouched
    }
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

fn max_ms(floor: i64, changes: &[(Operation, SerializedRow)]) -> i64 {
    changes
        .iter()
        .map(|(_, r)| r.meta.updated_at_ms)
        .fold(floor.max(0), i64::max)
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
