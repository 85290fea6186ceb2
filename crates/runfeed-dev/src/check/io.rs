//! The checker's adapter to the `runfeed` library: the ONLY file of the checker that names a
//! `runfeed::` item, so a module move in the server crate is rewired here in minutes.
//!
//! Everything else the checker does is black-box: HTTP to the `runfeed` binary, SQL to
//! Postgres (through [`crate::fixtures`]), process control.
//!
//! Used: `runfeed::changes::{Publisher, RedisOptions, ChangeRecord}` (publishing a change
//! record exactly as trigger.dev does, `docs/trigger-dev.md` §5) and
//! `runfeed::auth::mint_public_token` (public access tokens, `docs/trigger-dev.md` §2.3) and
//! `runfeed::changes::channel_name` (the slot of an environment's channel on a Cluster),
//! `runfeed::protocol::sse::parse_events` (an SSE event's `data`, as the server frames it).
//! The database is created and migrated by [`crate::fixtures::TestDb`].

use std::time::Duration;

use anyhow::Context;

/// A change record to publish (internal ids; `docs/trigger-dev.md` §5).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Internal `"TaskRun".id`.
    pub run_id: String,
    /// Internal `"RuntimeEnvironment".id`; also selects the channel `realtime:env:{<env>}`.
    pub env_id: String,
    /// `Some` = a full record (its tags), `None` = partial.
    pub tags: Option<Vec<String>>,
    /// Internal batch id.
    pub batch_id: Option<String>,
    /// The committed `updatedAt`, epoch ms (the read-your-writes watermark).
    pub updated_at_ms: Option<i64>,
}

/// A publisher connection: `PUBLISH`, or `SPUBLISH` on a Redis Cluster (sharded pub/sub).
pub struct Publisher {
    inner: runfeed::redis::Publisher,
}

impl Publisher {
    /// Connects to `url` (a cluster's seed nodes when `cluster`, e.g.
    /// `redis-cluster://127.0.0.1:7100?node=127.0.0.1:7101`).
    ///
    /// # Errors
    /// When no connection is up within the library's connect wait (5 s).
    pub async fn connect(url: &str, cluster: bool) -> anyhow::Result<Publisher> {
        let options = if cluster {
            runfeed::redis::RedisOptions::cluster(url, true)
        } else {
            runfeed::redis::RedisOptions::standalone(url)
        };
        let inner = runfeed::redis::Publisher::connect(&options)
            .await
            .map_err(|e| anyhow::anyhow!("connect publisher to {url}: {e}"))?;
        Ok(Publisher { inner })
    }

    /// Publishes `record`; returns how many subscribers received it.
    ///
    /// # Errors
    /// When Redis rejects it, the connection is down, or no reply arrives within 5 s.
    pub async fn publish(&self, record: &Record) -> anyhow::Result<u64> {
        let record = runfeed::changes::ChangeRecord {
            v: 1,
            run_id: record.run_id.as_str().into(),
            env_id: record.env_id.as_str().into(),
            tags: record.tags.clone(),
            batch_id: record.batch_id.as_deref().map(Into::into),
            updated_at_ms: record.updated_at_ms,
        };
        self.inner
            .publish(&record)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))
    }
}

/// A public access token for environment `env_id` signed with `api_key`, with `scopes`
/// (e.g. `read:runs`, `read:tags:t1`), valid for `ttl`.
///
/// # Errors
/// When signing fails.
pub fn mint_token(
    api_key: &str,
    env_id: &str,
    scopes: &[String],
    ttl: Duration,
) -> anyhow::Result<String> {
    runfeed::auth::mint_public_token(api_key, env_id, scopes, ttl, None).context("mint token")
}

/// The Redis Cluster hash slot of environment `env_id`'s channel (`realtime:env:{<env>}`).
pub fn channel_slot(env_id: &str) -> u16 {
    fred::util::redis_keyslot(runfeed::changes::channel_name(env_id).as_bytes())
}

/// The `data` of one complete SSE event (its text, without the blank line that ends it): its
/// `data:` lines joined with `\n`; `None` for a comment (keep-alive).
pub fn sse_event_data(event: &str) -> Option<String> {
    runfeed::protocol::sse::parse_events(&format!("{event}\n\n")).pop()
}
