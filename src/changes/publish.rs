//! Publishing change records like trigger.dev's webapp (`PUBLISH realtime:env:{env}`,
//! `runChangeNotifier.server.ts` `publish`, NTF-01..03). Used by tests and tooling; runfeed
//! itself only consumes.

use std::time::Duration;

use fred::prelude::*;
use fred::types::ConnectHandle;

use super::conn;
use super::record::channel_name;
use super::ChangeRecord;

/// How long [`Publisher::connect`] waits for the connection.
pub const CONNECT_WAIT: Duration = Duration::from_secs(5);

/// Per-publish timeout: during an outage a publish fails after this instead of buffering
/// (the webapp caps per-command retries for the same reason, NTF-03).
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

/// Publishing failed.
#[derive(Debug, thiserror::Error)]
#[error("publish: {0}")]
pub struct PublishError(pub String);

impl From<Error> for PublishError {
    fn from(e: Error) -> Self {
        PublishError(e.to_string())
    }
}

/// A publisher connection (fred client).
///
/// Reconnects forever in the background once connected; a command in flight when the
/// connection drops is attempted once only (`max_command_attempts = 1`, like the webapp's
/// `maxRetriesPerRequest: 1`, NTF-03), and every publish is bounded by [`PUBLISH_TIMEOUT`].
/// Dropping the publisher closes the connection.
pub struct Publisher {
    client: Client,
    /// fred's connection task; `None` once closed.
    connection: Option<ConnectHandle>,
}

impl Publisher {
    /// Connects to `redis_url`, waiting at most [`CONNECT_WAIT`].
    ///
    /// # Errors
    /// [`PublishError`] for an invalid URL, a refused configuration, or no connection within
    /// [`CONNECT_WAIT`].
    pub async fn connect(redis_url: &str) -> Result<Publisher, PublishError> {
        let mut config = Config::from_url(redis_url)?;
        config.fail_fast = false;
        let client = Builder::from_config(config)
            .set_policy(ReconnectPolicy::new_exponential(0, 100, 2_000, 2))
            .with_connection_config(|conn| conn.max_command_attempts = 1)
            .with_performance_config(|perf| perf.default_command_timeout = PUBLISH_TIMEOUT)
            .build()?;
        let connection = client.connect();
        let error = match tokio::time::timeout(CONNECT_WAIT, client.wait_for_connect()).await {
            Ok(Ok(())) => {
                return Ok(Publisher {
                    client,
                    connection: Some(connection),
                });
            }
            Ok(Err(e)) => e.into(),
            Err(_) => PublishError(format!("not connected after {CONNECT_WAIT:?}")),
        };
        conn::close(&client, connection).await;
        Err(error)
    }

    /// Publishes `record` on its env's channel (`record.env_id`); returns the receiver count.
    ///
    /// Sends `PUBLISH realtime:env:{<env_id>} <record.encode()>` (so `v` is stamped `1`).
    ///
    /// # Errors
    /// [`PublishError`] when Redis rejects the command, the connection is down, or no reply
    /// arrives within [`PUBLISH_TIMEOUT`].
    pub async fn publish(&self, record: &ChangeRecord) -> Result<u64, PublishError> {
        self.publish_raw(&record.env_id, record.encode()).await
    }

    /// Publishes an arbitrary payload on `env_id`'s channel (for tests of tolerant decoding);
    /// returns the receiver count.
    ///
    /// # Errors
    /// As [`Publisher::publish`].
    pub async fn publish_raw(
        &self,
        env_id: &str,
        payload: impl Into<String>,
    ) -> Result<u64, PublishError> {
        let receivers: i64 = self
            .client
            .publish(channel_name(env_id), payload.into())
            .await?;
        Ok(u64::try_from(receivers).unwrap_or(0))
    }

    /// Closes the connection (bounded `QUIT`, errors ignored).
    pub async fn close(mut self) {
        if let Some(connection) = self.connection.take() {
            conn::close(&self.client, connection).await;
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Some(connection) = self.connection.take() {
            conn::close_in_background(self.client.clone(), connection);
        }
    }
}

/// Connects, publishes `record` once (see [`Publisher::publish`]) and disconnects; returns the
/// receiver count.
///
/// # Errors
/// As [`Publisher::connect`] and [`Publisher::publish`].
pub async fn publish_once(redis_url: &str, record: &ChangeRecord) -> Result<u64, PublishError> {
    let publisher = Publisher::connect(redis_url).await?;
    let result = publisher.publish(record).await;
    publisher.close().await;
    result
}
