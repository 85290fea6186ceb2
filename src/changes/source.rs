//! Change sources: Redis pub/sub (classic) and an in-memory source for tests. STUB.

use tokio::sync::mpsc;

use super::ChangeRecord;

/// What a change source reports to its consumer (the router).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// A record arrived on `realtime:env:{env_id}` (`env_id` taken from the channel name).
    Record { env_id: String, record: ChangeRecord },
    /// The subscriber connection was re-established: records published while it was down are
    /// lost, so every subscribed environment has a gap.
    Reconnected,
}

/// Per-environment subscription management. Implementations deliver [`SourceEvent`]s on the
/// sender they were built with. Both calls are idempotent and never block; failures are
/// retried/logged inside the source (a missed record only costs latency: the backstop covers it).
pub trait ChangeSource: Send + Sync + 'static {
    /// Start receiving records of `env_id`.
    fn subscribe(&self, env_id: &str);
    /// Stop receiving records of `env_id`.
    fn unsubscribe(&self, env_id: &str);
}

/// In-memory source: [`MemoryChangeSource::push`] delivers a record iff its env is subscribed.
pub struct MemoryChangeSource {
    _tx: mpsc::UnboundedSender<SourceEvent>,
}

impl MemoryChangeSource {
    /// A source delivering to `tx`.
    pub fn new(tx: mpsc::UnboundedSender<SourceEvent>) -> Self {
        MemoryChangeSource { _tx: tx }
    }

    /// Delivers `record` on env `env_id` if subscribed; returns whether it was delivered.
    pub fn push(&self, env_id: &str, record: ChangeRecord) -> bool {
        let _ = (env_id, record);
        unimplemented!("changes helper")
    }

    /// Simulates a subscriber reconnect.
    pub fn reconnect(&self) {
        unimplemented!("changes helper")
    }

    /// Currently subscribed environments (sorted).
    pub fn subscribed(&self) -> Vec<String> {
        unimplemented!("changes helper")
    }
}

impl ChangeSource for MemoryChangeSource {
    fn subscribe(&self, env_id: &str) {
        let _ = env_id;
        unimplemented!("changes helper")
    }
    fn unsubscribe(&self, env_id: &str) {
        let _ = env_id;
        unimplemented!("changes helper")
    }
}

/// Redis classic pub/sub source (fred `SubscriberClient`; subscriptions restored on reconnect).
pub struct RedisChangeSource {
    _priv: (),
}

/// Could not connect the subscriber.
#[derive(Debug, thiserror::Error)]
#[error("redis change source: {0}")]
pub struct SourceError(pub String);

impl RedisChangeSource {
    /// Connects to `redis_url` and starts delivering to `tx`.
    pub async fn connect(redis_url: &str, tx: mpsc::UnboundedSender<SourceEvent>) -> Result<Self, SourceError> {
        let _ = (redis_url, tx);
        unimplemented!("changes helper")
    }
}

impl ChangeSource for RedisChangeSource {
    fn subscribe(&self, env_id: &str) {
        let _ = env_id;
        unimplemented!("changes helper")
    }
    fn unsubscribe(&self, env_id: &str) {
        let _ = env_id;
        unimplemented!("changes helper")
    }
}
