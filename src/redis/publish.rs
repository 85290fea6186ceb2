//! Publishing change records like trigger.dev's webapp (`PUBLISH realtime:env:{env}`, or
//! `SPUBLISH` on a Redis Cluster with sharded pub/sub; `runChangeNotifier.server.ts` `publish`,
//! NTF-01..04). Used by tests and tooling; runfeed itself only consumes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fred::prelude::*;
use fred::types::ConnectHandle;

use super::{close, close_in_background, redact, RedisError, RedisOptions};
use crate::changes::record::channel_name;
use crate::changes::ChangeRecord;

/// How long [`Publisher::connect`] waits for the connection.
pub const CONNECT_WAIT: Duration = Duration::from_secs(5);

/// Per-publish timeout: during an outage a publish fails after this instead of buffering
/// (the webapp caps per-command retries for the same reason, NTF-03).
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

static PUBLISHED: AtomicU64 = AtomicU64::new(0);
static PUBLISH_ERRORS: AtomicU64 = AtomicU64::new(0);

/// `(ok, error)` publish outcomes of every [`Publisher`] in this process (the
/// `runfeed.notifier.publishes` metric).
pub fn publish_counts() -> (u64, u64) {
    (
        PUBLISHED.load(Ordering::Relaxed),
        PUBLISH_ERRORS.load(Ordering::Relaxed),
    )
}

/// A publisher connection (fred client; a cluster client in cluster mode).
///
/// Reconnects forever in the background once connected; a command in flight when the
/// connection drops is attempted once only (`max_command_attempts = 1`, like the webapp's
/// `maxRetriesPerRequest: 1`, NTF-03), and every publish is bounded by [`PUBLISH_TIMEOUT`].
/// In cluster mode a command gets a second write so that a MOVED (slot migrated) is followed at
/// once (fred counts the redirected write as an attempt; ioredis follows redirections apart from
/// its retries). Dropping the publisher closes the connection.
pub struct Publisher {
    client: Client,
    /// `SPUBLISH` instead of `PUBLISH`.
    sharded: bool,
    /// fred's connection task; `None` once closed.
    connection: Option<ConnectHandle>,
}

impl Publisher {
    /// Connects as `options` say (a single server, or a cluster; `SPUBLISH` when sharded, see
    /// [`RedisOptions`]), waiting at most [`CONNECT_WAIT`] (in a cluster: for every primary).
    ///
    /// # Errors
    /// [`RedisError`] for an invalid URL or one that does not fit `options.cluster`, a refused
    /// configuration, or no connection within [`CONNECT_WAIT`].
    pub async fn connect(options: &RedisOptions) -> Result<Publisher, RedisError> {
        let mut config = options.fred_config().map_err(RedisError::Config)?;
        config.fail_fast = false;
        let client = Builder::from_config(config)
            .set_policy(ReconnectPolicy::new_exponential(0, 100, 2_000, 2))
            .with_connection_config(|conn| {
                conn.max_command_attempts = if options.cluster { 2 } else { 1 };
            })
            .with_performance_config(|perf| perf.default_command_timeout = PUBLISH_TIMEOUT)
            .build()
            .map_err(|e| RedisError::Config(e.to_string()))?;
        let connection = client.connect();
        let error = match tokio::time::timeout(CONNECT_WAIT, client.wait_for_connect()).await {
            Ok(Ok(())) => {
                return Ok(Publisher {
                    client,
                    sharded: options.uses_sharded(),
                    connection: Some(connection),
                });
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("not connected after {CONNECT_WAIT:?}"),
        };
        close(&client, connection).await;
        let error = RedisError::Connect {
            url: redact(&options.url),
            reason: error,
        };
        Err(error)
    }

    /// Publishes `record` on its env's channel (`record.env_id`); returns the receiver count
    /// (for classic pub/sub on a cluster: the receivers on the node that took the PUBLISH only;
    /// for SPUBLISH: the receivers on the channel's shard).
    ///
    /// Sends `PUBLISH realtime:env:{<env_id>} <record.encode()>`, or `SPUBLISH` in sharded mode
    /// (so `v` is stamped `1`).
    ///
    /// # Errors
    /// [`RedisError`] when Redis rejects the command, the connection is down, or no reply
    /// arrives within [`PUBLISH_TIMEOUT`].
    pub async fn publish(&self, record: &ChangeRecord) -> Result<u64, RedisError> {
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
    ) -> Result<u64, RedisError> {
        let channel = channel_name(env_id);
        let result: Result<i64, Error> = if self.sharded {
            self.client.spublish(channel, payload.into()).await
        } else {
            self.client.publish(channel, payload.into()).await
        };
        let counter = if result.is_ok() {
            &PUBLISHED
        } else {
            &PUBLISH_ERRORS
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let receivers = result.map_err(|source| RedisError::Command {
            op: "publish",
            source,
        })?;
        Ok(u64::try_from(receivers).unwrap_or(0))
    }

    /// Whether this publisher sends `SPUBLISH` (cluster + sharded).
    pub fn is_sharded(&self) -> bool {
        self.sharded
    }

    /// Closes the connection (bounded `QUIT`, errors ignored).
    pub async fn close(mut self) {
        if let Some(connection) = self.connection.take() {
            close(&self.client, connection).await;
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Some(connection) = self.connection.take() {
            close_in_background(self.client.clone(), connection);
        }
    }
}

/// Connects, publishes `record` once (see [`Publisher::publish`]) and disconnects; returns the
/// receiver count.
///
/// # Errors
/// As [`Publisher::connect`] and [`Publisher::publish`].
pub async fn publish_once(
    options: &RedisOptions,
    record: &ChangeRecord,
) -> Result<u64, RedisError> {
    let publisher = Publisher::connect(options).await?;
    let result = publisher.publish(record).await;
    publisher.close().await;
    result
}
