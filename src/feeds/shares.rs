//! Per-environment shares of the resolve admission gate (`feeds.resolve_admission_per_env`),
//! fair across environments.
//!
//! Each environment's tag resolves hold at most `per_env` permits at once; waiters beyond that
//! queue on their environment's share, not on the gate, so other environments and run feeds
//! still get permits. And while another environment has a tag resolve in flight (queued or
//! running), an environment runs **one** at a time: its others hold their share's permits but
//! wait for their turn. A stampede of one environment then claims one replica core beside
//! another environment's cold snapshot, not `per_env`: on 2 cores the other snapshot's set
//! query otherwise shares them with the stampede's two (BENCHMARKS.md, "At production data
//! volume", Windows). Alone, an environment uses its whole share again at once.
//!
//! Bounded: an environment's share is dropped after a minute unused (a permit still held keeps
//! its semaphore alive), and the in-flight table holds one entry per environment with a tag
//! resolve in flight (the entry leaves with its last one), so no more entries than resolves,
//! whose number the callers' deadlines bound.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::cache::TtlCache;
use crate::protocol::EnvId;

/// Per-environment shares of the resolve admission gate (module docs).
pub struct EnvShares {
    per_env: usize,
    /// Bound: 100 000 environments; each kept until unused for 60 s (an idle cache).
    shares: TtlCache<EnvId, Arc<Semaphore>>,
    flights: Arc<Flights>,
}

/// Tag resolves in flight, per environment.
struct Flights {
    /// Bound: one entry per environment with a resolve in flight (module docs).
    by_env: Mutex<HashMap<EnvId, Flight>>,
    /// Notified whenever a resolve stops running or leaves: a permit holder waiting for its
    /// turn checks again.
    changed: Notify,
}

/// One environment's tag resolves in flight: `entered` from the call to
/// [`EnvShares::acquire`] on (queued included), `running` those past their turn.
#[derive(Default)]
struct Flight {
    entered: usize,
    running: usize,
}

/// A tag resolve's claim on its environment's share, from [`EnvShares::acquire`]: a permit of
/// the share, and its turn. Dropping it frees both.
pub struct SharePermit {
    permit: OwnedSemaphorePermit,
    _flight: InFlight,
}

impl SharePermit {
    /// The share's permit alone, for a window build (`super::window`): it stays within the
    /// environment's share, but does not count as a resolve in flight, so that the seconds of
    /// a build never hold another environment's resolves back to one at a time.
    pub fn into_permit(self) -> OwnedSemaphorePermit {
        self.permit
    }
}

/// One resolve in its environment's [`Flight`] while it lives.
struct InFlight {
    flights: Arc<Flights>,
    env_id: EnvId,
    running: bool,
}

impl InFlight {
    fn enter(flights: &Arc<Flights>, env_id: &EnvId) -> InFlight {
        flights
            .by_env
            .lock()
            .entry(env_id.clone())
            .or_default()
            .entered += 1;
        InFlight {
            flights: flights.clone(),
            env_id: env_id.clone(),
            running: false,
        }
    }

    /// Takes this resolve's turn if its environment runs none, or no other environment has a
    /// resolve in flight.
    fn try_run(&mut self) -> bool {
        let mut by_env = self.flights.by_env.lock();
        let alone = by_env.len() == 1;
        let Some(flight) = by_env.get_mut(&self.env_id) else {
            return false;
        };
        if flight.running == 0 || alone {
            flight.running += 1;
            self.running = true;
        }
        self.running
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        {
            let mut by_env = self.flights.by_env.lock();
            if let Some(flight) = by_env.get_mut(&self.env_id) {
                flight.entered = flight.entered.saturating_sub(1);
                if self.running {
                    flight.running = flight.running.saturating_sub(1);
                }
                if flight.entered == 0 {
                    by_env.remove(&self.env_id);
                }
            }
        }
        self.flights.changed.notify_waiters();
    }
}

impl EnvShares {
    /// Shares of `per_env` permits each.
    pub fn new(per_env: usize) -> EnvShares {
        EnvShares {
            per_env,
            shares: TtlCache::idle(100_000, Duration::from_secs(60)),
            flights: Arc::new(Flights {
                by_env: Mutex::new(HashMap::new()),
                changed: Notify::new(),
            }),
        }
    }

    /// Whether `env_id`'s tag resolves hold every permit of its share, so that the next one
    /// waits (called by a holder of one).
    pub fn queued(&self, env_id: &EnvId) -> bool {
        self.shares
            .get(env_id)
            .is_some_and(|share| share.available_permits() == 0)
    }

    /// A permit of `env_id`'s share and its turn: waits while the environment holds all of
    /// its share, then, while another environment has a tag resolve in flight, until the
    /// environment runs no other. `None` only if the share was closed (never, here).
    pub async fn acquire(&self, env_id: &EnvId) -> Option<SharePermit> {
        // In flight from now on, queued included: other environments yield to this one while
        // it waits for its own share.
        let mut flight = InFlight::enter(&self.flights, env_id);
        let per_env = self.per_env;
        let share = self
            .shares
            .get_or_insert_with(env_id.clone(), || Arc::new(Semaphore::new(per_env)));
        let permit = share.acquire_owned().await.ok()?;
        loop {
            // Enabled before the check, so a change between the two wakes the wait.
            let changed = self.flights.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if flight.try_run() {
                break;
            }
            changed.await;
        }
        Some(SharePermit {
            permit,
            _flight: flight,
        })
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::{EnvId, EnvShares};

    /// One environment holding its whole share waits on its own share; another environment
    /// still gets a permit at once (admission is fair across environments).
    #[tokio::test]
    async fn one_environment_at_its_share_does_not_block_another() {
        let shares = EnvShares::new(2);
        let (a, b) = (EnvId::new("env_a"), EnvId::new("env_b"));
        let held = [shares.acquire(&a).await, shares.acquire(&a).await];
        assert!(held.iter().all(Option::is_some));
        assert!(
            shares.acquire(&a).now_or_never().is_none(),
            "a third permit for env_a waits"
        );
        assert!(
            shares.acquire(&b).now_or_never().flatten().is_some(),
            "env_b is admitted at once"
        );
        drop(held);
        assert!(shares.acquire(&a).now_or_never().flatten().is_some());
    }

    /// An environment whose tag resolves hold its whole share is in a stampede (no window build
    /// starts then); one permit free, it is not.
    #[tokio::test]
    async fn an_environment_holding_its_whole_share_counts_as_queued() {
        let shares = EnvShares::new(2);
        let a = EnvId::new("env_a");
        let first = shares.acquire(&a).await;
        assert!(!shares.queued(&a));
        let second = shares.acquire(&a).await;
        assert!(shares.queued(&a));
        drop(second);
        assert!(!shares.queued(&a));
        drop(first);
    }

    /// While another environment has a tag resolve in flight, an environment runs one at a
    /// time: its second resolve waits for its first, or for the other environment to finish,
    /// so that a stampede claims one replica core beside another environment's snapshot.
    #[tokio::test]
    async fn an_environment_runs_one_resolve_at_a_time_while_another_resolves() {
        let shares = EnvShares::new(2);
        let (a, b) = (EnvId::new("env_a"), EnvId::new("env_b"));
        let first_a = shares.acquire(&a).await;
        let only_b = shares.acquire(&b).await;
        assert!(only_b.is_some(), "env_b runs at once beside env_a's one");
        let mut second_a = Box::pin(shares.acquire(&a));
        assert!(
            (&mut second_a).now_or_never().is_none(),
            "env_a's second resolve waits while env_b resolves"
        );
        drop(only_b);
        let second_a = second_a.await;
        assert!(
            second_a.is_some(),
            "alone again, env_a uses its whole share"
        );
        drop(second_a);

        // And the other way round: env_a's first finishing gives its waiting second the turn.
        let only_b = shares.acquire(&b).await;
        let mut second_a = Box::pin(shares.acquire(&a));
        assert!((&mut second_a).now_or_never().is_none());
        drop(first_a);
        assert!(second_a.await.is_some());
        drop(only_b);
    }

    /// A resolve given up while it waits for its turn leaves the table: the environment it
    /// yielded to is alone again.
    #[tokio::test]
    async fn a_resolve_dropped_while_waiting_leaves_no_trace() {
        let shares = EnvShares::new(2);
        let (a, b) = (EnvId::new("env_a"), EnvId::new("env_b"));
        let first_a = shares.acquire(&a).await;
        let only_b = shares.acquire(&b).await;
        let mut waiting = Box::pin(shares.acquire(&b));
        assert!(
            (&mut waiting).now_or_never().is_none(),
            "env_b's second waits for its turn"
        );
        drop(waiting);
        drop(only_b);
        assert!(
            shares.acquire(&a).now_or_never().flatten().is_some(),
            "env_a alone takes its second permit at once"
        );
        drop(first_a);
        assert!(shares.flights.by_env.lock().is_empty());
    }
}
