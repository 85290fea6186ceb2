//! Connection state: what each response left its client with, recorded per offset locally and in
//! the fleet-shared store, and what a poll knows when it resumes from the offset its client echoes.

use std::sync::Arc;

use crate::cache::TtlCache;
use crate::clock::now_ms;
use crate::protocol::cursor::vouched_wall_ms;
use crate::protocol::handle::HandleClaims;
use crate::protocol::offset::Offset;
use crate::protocol::{EnvId, Handle, RunId};
use crate::router::ReplayCursor;

use super::cursors;
use super::diff::{Known, Pending, Version, WorkingSet};
use super::read::Target;
use super::{FeedRequest, Feeds, Poll};

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
    /// The claims of the handle this state was recorded under (minted by this instance or
    /// verified by it). A poll that presents the same handle at this offset, for the same feed,
    /// is answered without verifying the handle's HMAC again: only a handle this instance
    /// accepted can name a state of its (see `Feeds::serve`).
    pub claims: Arc<HandleClaims>,
    /// Tag feeds: the tag filter, as the request sent it, that `claims` were checked against.
    /// A poll sending the very same list is for the same filter without hashing it again
    /// (`Feeds::same_feed`, on every poll otherwise).
    pub tags: Option<Arc<[String]>>,
}

/// A client cursor this much newer than the local state's own cursor means the client was
/// answered elsewhere since (it hopped and came back): the poll replays from the cursor's wall
/// time, like a hop, instead of from this instance's older position.
pub const HOP_BACK_AFTER_MS: i64 = 1_000;
/// An offset's shared state is written again after this fraction of the working-set TTL, so it
/// never expires in Redis while its client keeps polling at that offset.
pub const SHARED_REWRITE_AFTER: f64 = 0.5;

pub(super) type ConnKey = (EnvId, Handle, Offset);

/// The per-connection states of this instance, by (environment, handle, offset): bounded in
/// number (`caches.working_set_max_entries` × 2) and expiring `caches.working_set_ttl_ms` after
/// they were recorded.
pub(super) type ConnStates = TtlCache<ConnKey, Arc<ConnState>>;

/// What a poll knows about the offset its client echoed.
pub(super) struct Resume {
    /// This instance's state for it (working set + cursor).
    pub(super) state: Option<Arc<ConnState>>,
    /// The replay cursor: from the local state, else from the fleet-shared store.
    pub(super) cursor: Option<ReplayCursor>,
    /// From the shared store: the versions the client's latest responses carried.
    pub(super) recent: Option<WorkingSet>,
}

impl Feeds {
    /// Records `state` for `offset`, locally and (unless its `shared_at_ms` says the shared
    /// store already has an equivalent, fresh value) in the fleet-shared store.
    pub(super) fn record(
        &self,
        req: &FeedRequest,
        handle: &Handle,
        offset: Offset,
        mut state: ConnState,
    ) {
        if let Some(store) = &self.cursors {
            let now = now_ms();
            let rewrite_after = (self.working_set_ttl_ms as f64 * SHARED_REWRITE_AFTER) as i64;
            let fresh = state.cursor.epoch != 0
                && state
                    .shared_at_ms
                    .is_some_and(|at| now.saturating_sub(at) < rewrite_after);
            if !fresh {
                let value = cursors::encode(&state.cursor, &state.recent);
                store.set(&req.env_id, handle, &offset.text(), value);
                state.shared_at_ms = (state.cursor.epoch != 0).then_some(now);
            }
        }
        self.conns.insert(
            (req.env_id.clone(), handle.clone(), offset),
            Arc::new(state),
        );
    }

    /// What the poll knows about the offset its client echoed: this instance's state for it
    /// (dropping the one before it), else the replay cursor and recent versions the fleet-shared
    /// store holds.
    pub(super) async fn lookup(&self, poll: Poll<'_>) -> Resume {
        let Poll {
            req,
            handle,
            offset,
            ..
        } = poll;
        let state = poll.state.cloned();
        if let Some(state) = &state {
            if let Some(prev) = state.prev {
                // The client has moved past `prev`: its state can go.
                self.conns.remove(&poll.key(prev));
            }
        }
        let (cursor, recent) = match (&state, &self.cursors) {
            (Some(state), _) => (Some(self.hop_back(state.cursor, req)), None),
            // Another instance answered the previous poll (or this one forgot it).
            // Boxed: a poll with a local state never carries, or moves, the Redis read.
            (None, Some(store)) => {
                match Box::pin(store.get(&req.env_id, handle, &offset.text(), cursors::decode))
                    .await
                {
                    Some((cursor, recent)) => (
                        Some(Self::caught_up(cursor, req, 0)),
                        Some(recent.into_iter().collect::<WorkingSet>()),
                    ),
                    None => (None, None),
                }
            }
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
    pub(super) fn caught_up(
        cursor: ReplayCursor,
        req: &FeedRequest,
        after_ms: i64,
    ) -> ReplayCursor {
        match vouched_wall_ms(req.cursor.as_deref(), now_ms()) {
            Some(wall_ms) if cursor.epoch != 0 && wall_ms > cursor.wall_ms + after_ms => {
                ReplayCursor::at_wall(cursor.epoch, wall_ms)
            }
            _ => cursor,
        }
    }

    /// This instance's own cursor for the offset, unless the client was answered elsewhere
    /// since ([`HOP_BACK_AFTER_MS`]).
    pub(super) fn hop_back(&self, cursor: ReplayCursor, req: &FeedRequest) -> ReplayCursor {
        if self.cursors.is_none() {
            return cursor;
        }
        Self::caught_up(cursor, req, HOP_BACK_AFTER_MS)
    }

    /// What the client has, as far as the poll knows: the state's working set, a run feed's
    /// offset as a floor, the shared store's recent versions, or nothing.
    pub(super) fn known(&self, poll: Poll<'_>, resume: &Resume) -> Known {
        match (&resume.state, &resume.recent, poll.target) {
            (Some(s), _, _) => Known::Set(s.ws.clone()),
            (None, _, Target::Run { .. }) => Known::Floor(poll.offset.ms),
            (None, Some(recent), _) => Known::Partial(recent.clone()),
            (None, None, _) => Known::Nothing,
        }
    }

    /// Versions of the runs this response considered, then those carried from the state it
    /// answers (bounded by [`cursors::RECENT_MAX`]).
    pub(super) fn recent(
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
}
