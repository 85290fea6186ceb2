//! The change-source seam: what a source reports ([`SourceEvent`]), the per-environment
//! subscription interface the router drives ([`ChangeSource`]), and an in-memory source for
//! tests ([`MemoryChangeSource`]). The Redis source is `redis::RedisChangeSource`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::ChangeRecord;
use crate::protocol::EnvId;

/// What a change source reports to its consumer (the router).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// A record arrived on `realtime:env:{env_id}` (`env_id` taken from the channel name).
    Record { env_id: EnvId, record: ChangeRecord },
    /// The subscription of `env_id` requested by the [`ChangeSource::subscribe`] call that
    /// returned `generation` is confirmed by Redis: records published from now on are delivered.
    /// Replay coverage starts here, not at the subscribe call (a record published between the
    /// two would otherwise be lost while a cursor claims it was covered). The generation lets a
    /// consumer ignore a late confirmation of an earlier subscription of the same env.
    Subscribed { env_id: EnvId, generation: u64 },
    /// The subscriber connection was re-established: records published while it was down are
    /// lost, so every subscribed environment has a gap.
    Reconnected,
}

/// Most [`SourceEvent`]s waiting for their consumer. The router's batch dispatcher takes them
/// without waiting for anything (its hydrates run on tasks of their own), so this only absorbs
/// scheduling hiccups and a turn spent routing a batch. When it is full the Redis
/// reader waits; fred's message buffer behind it then overflows, which the reader reports as a
/// gap ([`SourceEvent::Reconnected`]): the feeds re-read. The in-memory source refuses a
/// record instead.
pub const EVENT_QUEUE: usize = 8_192;

/// The sending side of a source's events (bounded by [`EVENT_QUEUE`]).
pub type EventSender = mpsc::Sender<SourceEvent>;
/// The receiving side of a source's events.
pub type EventReceiver = mpsc::Receiver<SourceEvent>;

/// A channel for a source's events, bounded by [`EVENT_QUEUE`].
pub fn event_channel() -> (EventSender, EventReceiver) {
    mpsc::channel(EVENT_QUEUE)
}

/// Per-environment subscription management. Implementations deliver [`SourceEvent`]s on the
/// sender they were built with. Both calls are idempotent and never block; failures are
/// retried/logged inside the source (a missed record only costs latency: the backstop covers it).
pub trait ChangeSource: Send + Sync + 'static {
    /// Start receiving records of `env_id`. Returns this request's generation (unique per
    /// source, increasing); the matching [`SourceEvent::Subscribed`] carries it.
    fn subscribe(&self, env_id: &EnvId) -> u64;
    /// Stop receiving records of `env_id`.
    fn unsubscribe(&self, env_id: &EnvId);
}

// ---------------------------------------------------------------------------------------------
// In-memory source
// ---------------------------------------------------------------------------------------------

/// In-memory source: [`MemoryChangeSource::push`] delivers a record iff its env is subscribed.
pub struct MemoryChangeSource {
    tx: EventSender,
    subscribed: Mutex<BTreeSet<EnvId>>,
    generations: AtomicU64,
}

impl MemoryChangeSource {
    /// A source delivering to `tx`.
    pub fn new(tx: EventSender) -> Self {
        MemoryChangeSource {
            tx,
            subscribed: Mutex::default(),
            generations: AtomicU64::new(0),
        }
    }

    /// Delivers `record` on env `env_id` if subscribed; returns whether it was delivered
    /// (`false` also when the consumer is gone or [`EVENT_QUEUE`] events wait).
    pub fn push(&self, env_id: &EnvId, record: ChangeRecord) -> bool {
        if !self.subscribed.lock().contains(env_id) {
            return false;
        }
        self.tx
            .try_send(SourceEvent::Record {
                env_id: env_id.clone(),
                record,
            })
            .is_ok()
    }

    /// Simulates a subscriber reconnect.
    pub fn reconnect(&self) {
        let _ = self.tx.try_send(SourceEvent::Reconnected);
    }

    /// Currently subscribed environments (sorted).
    pub fn subscribed(&self) -> Vec<EnvId> {
        self.subscribed.lock().iter().cloned().collect()
    }
}

impl ChangeSource for MemoryChangeSource {
    fn subscribe(&self, env_id: &EnvId) -> u64 {
        // In memory a subscription is active at once.
        let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        self.subscribed.lock().insert(env_id.clone());
        let _ = self.tx.try_send(SourceEvent::Subscribed {
            env_id: env_id.clone(),
            generation,
        });
        generation
    }
    fn unsubscribe(&self, env_id: &EnvId) {
        self.subscribed.lock().remove(env_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(run: &str) -> ChangeRecord {
        ChangeRecord {
            v: 1,
            run_id: run.into(),
            env_id: "e".into(),
            ..Default::default()
        }
    }

    #[test]
    fn memory_source_delivers_only_subscribed() {
        let (tx, mut rx) = event_channel();
        let s = MemoryChangeSource::new(tx);
        assert!(!s.push(&crate::protocol::EnvId::from("e"), rec("r0")));
        s.subscribe(&crate::protocol::EnvId::from("e"));
        s.subscribe(&crate::protocol::EnvId::from("e")); // idempotent
        s.subscribe(&crate::protocol::EnvId::from("a"));
        assert_eq!(s.subscribed(), vec!["a".to_string(), "e".to_string()]);
        assert!(s.push(&crate::protocol::EnvId::from("e"), rec("r1")));
        assert!(!s.push(&crate::protocol::EnvId::from("b"), rec("r2")));
        for (generation, env) in ["e", "e", "a"].into_iter().enumerate() {
            let generation = generation as u64 + 1;
            assert_eq!(
                rx.try_recv().ok(),
                Some(SourceEvent::Subscribed {
                    env_id: env.into(),
                    generation
                })
            );
        }
        assert_eq!(
            rx.try_recv().ok(),
            Some(SourceEvent::Record {
                env_id: "e".into(),
                record: rec("r1")
            })
        );
        assert!(rx.try_recv().is_err());
        s.unsubscribe(&crate::protocol::EnvId::from("e"));
        s.unsubscribe(&crate::protocol::EnvId::from("e"));
        assert!(!s.push(&crate::protocol::EnvId::from("e"), rec("r3")));
        s.reconnect();
        assert_eq!(rx.try_recv().ok(), Some(SourceEvent::Reconnected));
        assert_eq!(s.subscribed(), vec!["a".to_string()]);
    }
}
