//! Publishing change records like trigger.dev's webapp (`PUBLISH realtime:env:{env}`). STUB.

use super::ChangeRecord;

/// Publishing failed.
#[derive(Debug, thiserror::Error)]
#[error("publish: {0}")]
pub struct PublishError(pub String);

/// A publisher connection (fred client).
pub struct Publisher {
    _priv: (),
}

impl Publisher {
    /// Connects to `redis_url`.
    pub async fn connect(redis_url: &str) -> Result<Publisher, PublishError> {
        let _ = redis_url;
        unimplemented!("changes helper")
    }

    /// Publishes `record` on its env's channel (`record.env_id`); returns the receiver count.
    pub async fn publish(&self, record: &ChangeRecord) -> Result<u64, PublishError> {
        let _ = record;
        unimplemented!("changes helper")
    }
}
