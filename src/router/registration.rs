//! Registering a held feed: its index entry, the replay of its gap, its inbox and wake, and what
//! happens when its poll ends (deregistration, the lingering unsubscribe).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::{Buffered, Env, Feed, Inner, Registration, ReplayCursor, Router, Slot, Wake};

impl Router {
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
            let mut state = env.state.lock();
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
            // Boxed: a poll with nothing to replay (the common case) does not carry, or move,
            // the hydrate's future.
            match Box::pin(
                self.inner
                    .replay(&registration.env, &filter, cols, &replay_ids),
            )
            .await
            {
                Ok(rows) => {
                    let counter = if rows.is_empty() {
                        &self.inner.stats.replays_empty
                    } else {
                        &self.inner.stats.replays_delivered
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    registration.slot.push(rows);
                }
                Err(()) => covered = false,
            }
        }
        registration.covered = covered;
        registration
    }
}

impl Inner {
    /// Drops feed `id` of `env` (its poll ended); an environment left without feeds lingers,
    /// then unsubscribes.
    pub(super) fn deregister(self: &Arc<Self>, env: &Arc<Env>, id: u64) {
        let idle = {
            let mut state = env.state.lock();
            if let Some(slot) = state.feeds.remove(&id) {
                state.deindex(id, &slot.filter);
            }
            state.feeds.is_empty()
        };
        if idle {
            self.schedule_teardown_if_idle(env);
        }
    }

    /// Unsubscribes `env` after `router.unsubscribe_linger_ms` if it still has no feed and no
    /// caller pending then (at once when the linger is 0).
    pub(super) fn schedule_teardown_if_idle(self: &Arc<Self>, env: &Arc<Env>) {
        let generation = {
            let mut state = env.state.lock();
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
            let mut envs = inner.envs.lock();
            let still_idle = {
                let state = env.state.lock();
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
            let state = self.env.state.lock();
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
            .replay(&self.env, &self.slot.filter, self.slot.cols, &replay)
            .await
        {
            Ok(rows) => {
                self.slot.push(rows);
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
        cursor.instance == self.inner.instance && self.env.state.lock().last_seq == cursor.seq
    }

    /// Closes out a response built now: the cursor it may hand out, then what reached the inbox
    /// up to that moment. In this order, a row delivered in between is either in the response or
    /// after the cursor; never neither.
    pub fn settle(&self) -> (ReplayCursor, Wake) {
        let cursor = self.cursor();
        (cursor, self.slot.take())
    }

    /// The cursor a response built now may hand out (without draining the inbox).
    pub(super) fn cursor(&self) -> ReplayCursor {
        self.env.state.lock().cursor(self.inner.instance)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.inner.deregister(&self.env, self.id);
    }
}
