//! Connection state: what each response left its client with, recorded per offset locally and in
//! the fleet-shared store, and what a poll knows when it resumes from the offset its client echoes.

use super::*;

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
/// number (`caches.working_set_max_entries` × 2, least useful first) and expiring
/// `caches.working_set_ttl_ms` after they were recorded.
///
/// A `quick_cache` map rather than moka's: every poll reads one state and records one, and
/// moka's bookkeeping per operation (its access log, expiry timer wheel and housekeeping) cost
/// about a tenth of an ended poll's instructions (BENCHMARKS.md "Cost per unit of work").
/// Expiry is checked when a state is read; the expired states nobody reads again are swept
/// out by the first record after each half TTL, so their memory comes back without a
/// background task.
pub(super) struct ConnStates {
    states: quick_cache::sync::Cache<
        ConnKey,
        Recorded,
        quick_cache::UnitWeighter,
        foldhash::fast::RandomState,
    >,
    /// How long a state lives after it was recorded, ms.
    ttl_ms: i64,
    /// When expired states were last swept out (epoch ms).
    swept_ms: std::sync::atomic::AtomicI64,
}

/// A state and when it was recorded.
#[derive(Clone)]
struct Recorded {
    state: Arc<ConnState>,
    at_ms: i64,
}

/// The map's initial size: it grows to the bound as states are recorded.
const CONN_STATES_INITIAL: u64 = 1024;

impl ConnStates {
    /// At most `max_entries` states, each kept `ttl_ms` after it was recorded.
    pub(super) fn new(max_entries: u64, ttl_ms: u64) -> ConnStates {
        let max_entries = max_entries.max(1);
        let options = quick_cache::OptionsBuilder::new()
            .estimated_items_capacity(
                usize::try_from(max_entries.min(CONN_STATES_INITIAL)).unwrap_or(1024),
            )
            .weight_capacity(max_entries)
            .build();
        let states = match options {
            Ok(options) => quick_cache::sync::Cache::with_options(
                options,
                quick_cache::UnitWeighter,
                foldhash::fast::RandomState::default(),
                Default::default(),
            ),
            // The builder only refuses a missing capacity, which is set above.
            Err(_) => quick_cache::sync::Cache::with(
                usize::try_from(max_entries.min(CONN_STATES_INITIAL)).unwrap_or(1024),
                max_entries,
                quick_cache::UnitWeighter,
                foldhash::fast::RandomState::default(),
                Default::default(),
            ),
        };
        ConnStates {
            states,
            ttl_ms: i64::try_from(ttl_ms.max(1)).unwrap_or(i64::MAX),
            swept_ms: std::sync::atomic::AtomicI64::new(now_ms()),
        }
    }

    /// The state recorded for `key`, unless it expired.
    pub(super) fn get(&self, key: &ConnKey) -> Option<Arc<ConnState>> {
        self.get_at(key, now_ms())
    }

    /// [`ConnStates::get`] at `now` (epoch ms).
    fn get_at(&self, key: &ConnKey, now: i64) -> Option<Arc<ConnState>> {
        let recorded = self.states.get(key)?;
        (now.saturating_sub(recorded.at_ms) < self.ttl_ms).then_some(recorded.state)
    }

    /// Records `state` for `key` (replacing what was there).
    pub(super) fn insert(&self, key: ConnKey, state: Arc<ConnState>) {
        self.insert_at(key, state, now_ms());
    }

    /// [`ConnStates::insert`] at `now` (epoch ms).
    fn insert_at(&self, key: ConnKey, state: Arc<ConnState>, now: i64) {
        self.states.insert(key, Recorded { state, at_ms: now });
        let swept = self.swept_ms.load(std::sync::atomic::Ordering::Relaxed);
        if now.saturating_sub(swept) >= self.ttl_ms / 2
            && self
                .swept_ms
                .compare_exchange(
                    swept,
                    now,
                    std::sync::atomic::Ordering::Relaxed,
                    std::sync::atomic::Ordering::Relaxed,
                )
                .is_ok()
        {
            self.sweep(now);
        }
    }

    /// Forgets the state of `key`.
    pub(super) fn invalidate(&self, key: &ConnKey) {
        self.states.remove(key);
    }

    /// States kept now, expired ones included until they are swept or read.
    pub(super) fn len(&self) -> u64 {
        self.states.len() as u64
    }

    /// Drops every state that expired by `now` (epoch ms).
    fn sweep(&self, now: i64) {
        self.states
            .retain(|_, recorded| now.saturating_sub(recorded.at_ms) < self.ttl_ms);
    }
}

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
                self.conns.invalidate(&poll.key(prev));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::handle::FeedKind;

    fn state() -> Arc<ConnState> {
        Arc::new(ConnState {
            ws: WorkingSet::default(),
            cursor: ReplayCursor::at_wall(1, 0),
            prev: None,
            recent: Vec::new(),
            shared_at_ms: None,
            claims: Arc::new(HandleClaims {
                kind: FeedKind::Run,
                env_id: EnvId::from("env"),
                target: "run".into(),
                floor_ms: None,
                columns: 1,
                nonce: 1,
            }),
            tags: None,
        })
    }

    fn key(n: i64) -> ConnKey {
        (EnvId::from("env"), Handle::from(format!("h{n}")), Offset { ms: n, seq: 1 })
    }

    #[test]
    fn a_connection_state_expires_its_ttl_after_it_was_recorded() {
        let states = ConnStates::new(100, 1_000);
        let t0 = now_ms();
        states.insert_at(key(1), state(), t0);
        assert!(states.get_at(&key(1), t0 + 999).is_some());
        assert!(states.get_at(&key(1), t0 + 1_000).is_none());
        // Recording it again starts its TTL again.
        states.insert_at(key(1), state(), t0 + 1_500);
        assert!(states.get_at(&key(1), t0 + 2_000).is_some());
        states.invalidate(&key(1));
        assert!(states.get_at(&key(1), t0 + 2_000).is_none());
    }

    #[test]
    fn expired_connection_states_are_swept_out_by_a_record_after_half_the_ttl() {
        let states = ConnStates::new(100, 1_000);
        let t0 = states.swept_ms.load(std::sync::atomic::Ordering::Relaxed);
        for n in 0..10 {
            states.insert_at(key(n), state(), t0);
        }
        assert_eq!(states.len(), 10);
        // Half a TTL later the record sweeps, but nothing has expired yet.
        states.insert_at(key(10), state(), t0 + 500);
        assert_eq!(states.len(), 11);
        // The next sweep (half a TTL after the last) drops the ten expired ones.
        states.insert_at(key(11), state(), t0 + 1_000);
        assert_eq!(states.len(), 2);
    }

    #[test]
    fn connection_states_stay_within_their_bound() {
        let states = ConnStates::new(64, 60_000);
        let t0 = now_ms();
        for n in 0..1_000 {
            states.insert_at(key(n), state(), t0);
        }
        assert!(states.len() <= 64, "{}", states.len());
        assert!(states.get_at(&key(999), t0).is_some(), "the newest state is kept");
    }
}
