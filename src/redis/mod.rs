//! All of runfeed's Redis I/O, behind one type that hides the topology.
//!
//! [`Redis`] is one Redis deployment as [`RedisOptions`] (the `[redis]` section) describe it: a
//! single server, or a Cluster with classic or sharded pub/sub. [`Redis::connect`] builds the
//! key/value client; everything else is made from it:
//!
//! - [`subscribe`]: the change source (one subscriber connection per node, `SUBSCRIBE` or
//!   `SSUBSCRIBE` to `realtime:env:{<envId>}`, reconcile after reconnects), with [`slots`]
//!   tracking which Cluster node owns each channel;
//! - [`publish`]: publishing change records the way trigger.dev's webapp does;
//! - [`limit`]: the per-environment live-poll concurrency script (trigger.dev-compatible keys);
//! - [`cursors`]: fleet-shared replay cursors (pipelined writes, reads with a deadline).
//!
//! Nothing outside this module speaks to Redis.

pub mod cursors;
pub mod limit;
pub mod publish;
mod shard_check;
mod slots;
mod state;
pub mod subscribe;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use fred::prelude::*;
use fred::types::ConnectHandle;

pub use cursors::{CursorStats, CursorStore};
pub use limit::ConcurrencyScript;
pub use publish::{publish_counts, publish_once, Publisher};
pub use subscribe::{RedisChangeSource, SourceStats, SubscriberSettings};

/// A Redis failure, with what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// The URL or options do not describe a supported deployment.
    #[error("redis configuration: {0}")]
    Config(String),
    /// Connecting failed (or did not succeed in time).
    #[error("redis connect to {url}: {reason}")]
    Connect { url: String, reason: String },
    /// A command failed.
    #[error("redis {op}: {source}")]
    Command {
        op: &'static str,
        #[source]
        source: fred::error::Error,
    },
}

/// One Redis deployment: the key/value client (limiter, shared cursors) plus what it takes to
/// open subscriber and publisher connections of the same topology. Cheap to clone.
#[derive(Clone)]
pub struct Redis {
    options: RedisOptions,
    kv: Client,
    commands: Arc<CommandCounts>,
}

/// Commands runfeed sent on the key/value client on behalf of feeds, by purpose, counted where
/// they are sent (`runfeed.redis.commands`): a script call counts once, whatever it runs inside.
/// Divided by polls, deliveries or changes, they are what each costs Redis (BENCHMARKS.md "Cost
/// per unit of work").
#[derive(Debug, Default)]
pub struct CommandCounts {
    /// Replay cursor reads (`GET`).
    pub cursor_read: AtomicU64,
    /// Replay cursor writes (a `SET`, or one `SET_MANY` script call per environment and batch).
    pub cursor_write: AtomicU64,
    /// The concurrency limit: admission and lease script calls, re-stamps, releases (one `ZREM`
    /// per environment and batch).
    pub concurrency: AtomicU64,
}

impl CommandCounts {
    /// Counts `n` commands sent for `counter`'s purpose.
    pub(crate) fn sent(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Redis {
    /// Builds the key/value client as `options` say. It connects in the background and keeps
    /// reconnecting; callers bound every command with their own deadline.
    ///
    /// Errors: [`RedisError::Config`] for a URL that does not fit `options.cluster`.
    pub fn connect(options: RedisOptions) -> Result<Redis, RedisError> {
        let mut config = options.fred_config().map_err(RedisError::Config)?;
        config.fail_fast = false;
        let kv = Builder::from_config(config)
            .set_policy(ReconnectPolicy::new_exponential(0, 100, 2_000, 2))
            .with_connection_config(|conn| conn.max_command_attempts = 1)
            .build()
            .map_err(|e| RedisError::Config(e.to_string()))?;
        let _connection = kv.connect();
        Ok(Redis {
            options,
            kv,
            commands: Arc::default(),
        })
    }

    /// How this deployment is reached.
    pub fn options(&self) -> &RedisOptions {
        &self.options
    }

    /// The change source on this deployment (see [`RedisChangeSource`]).
    ///
    /// Errors: as [`RedisChangeSource::connect`].
    pub async fn change_source(
        &self,
        tx: crate::changes::EventSender,
        settings: SubscriberSettings,
    ) -> Result<RedisChangeSource, RedisError> {
        RedisChangeSource::connect(&self.options, tx, settings).await
    }

    /// The fleet-shared replay cursor store; entries live `ttl_ms`.
    pub fn cursor_store(&self, ttl_ms: u64) -> CursorStore {
        CursorStore::new(self.kv.clone(), ttl_ms, self.commands.clone())
    }

    /// The live-poll concurrency script on the key/value client.
    pub fn concurrency(&self) -> ConcurrencyScript {
        ConcurrencyScript::new(self.kv.clone(), self.commands.clone())
    }

    /// Commands sent on behalf of feeds so far (shared by every cursor store and concurrency
    /// script made from this deployment).
    pub fn command_counts(&self) -> &Arc<CommandCounts> {
        &self.commands
    }
}

/// How long a `QUIT` may take when closing a connected client.
const QUIT_WAIT: Duration = Duration::from_secs(1);

/// Closes `client` for good: a bounded `QUIT` when connected, then aborts the connection task
/// (which otherwise keeps reconnecting forever, and whose `QUIT` never answers while it is
/// disconnected).
pub(crate) async fn close<C: ClientLike>(client: &C, connection: ConnectHandle) {
    if client.is_connected() {
        let _ = tokio::time::timeout(QUIT_WAIT, client.quit()).await;
    }
    connection.abort();
}

/// Closes `client` from a `Drop`: spawns [`close`] if a tokio runtime is around, else just
/// aborts the connection task.
pub(crate) fn close_in_background<C: ClientLike + Send + 'static>(
    client: C,
    connection: ConnectHandle,
) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move { close(&client, connection).await });
        }
        Err(_) => connection.abort(),
    }
}

/// Where and how to reach the Redis carrying change records (the `[redis]` section:
/// [`crate::config::RedisConfig`]).
///
/// * `cluster = false`: a single Redis server, classic `PUBLISH`/`SUBSCRIBE`. `url` is a plain
///   `redis://[user:pw@]host[:port][/db]` (or `rediss://`) URL; a cluster URL is refused.
/// * `cluster = true`: a Redis Cluster. `url` lists one or more seed nodes (the rest are discovered
///   with `CLUSTER SLOTS`), in any of these forms:
///   - `redis-cluster://[user:pw@]host:port?node=host2:port2&node=host3:port3` (fred's form;
///     `rediss-cluster://` for TLS, and a plain `redis://`/`rediss://` scheme works too),
///   - a comma-separated list `redis://[user:pw@]host1:port1,host2:port2,host3:port3` (later
///     entries may repeat the scheme and credentials, which are ignored there),
///   - the same without a scheme: `host1:port1,host2:port2` (`redis://` is assumed).
///
///   With `sharded = true` (the default, reference `PUBSUB_REDIS_SHARDED_ENABLED`) records go over
///   sharded pub/sub (`SPUBLISH`/`SSUBSCRIBE`), else over classic pub/sub through the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisOptions {
    /// The server URL, or the cluster seed nodes (see the type docs).
    pub url: String,
    /// Connect to a Redis Cluster (reference `PUBSUB_REDIS_CLUSTER_MODE_ENABLED`).
    pub cluster: bool,
    /// In cluster mode, use sharded pub/sub (reference `PUBSUB_REDIS_SHARDED_ENABLED`); ignored
    /// without `cluster`.
    pub sharded: bool,
}

impl RedisOptions {
    /// A single Redis server at `url` (classic pub/sub).
    pub fn standalone(url: impl Into<String>) -> Self {
        RedisOptions {
            url: url.into(),
            cluster: false,
            sharded: false,
        }
    }

    /// A Redis Cluster reachable through the seed nodes in `url`; `sharded` selects sharded pub/sub.
    pub fn cluster(url: impl Into<String>, sharded: bool) -> Self {
        RedisOptions {
            url: url.into(),
            cluster: true,
            sharded,
        }
    }

    /// Whether sharded pub/sub is in effect (`cluster` and `sharded`).
    pub fn uses_sharded(&self) -> bool {
        self.cluster && self.sharded
    }

    /// The fred configuration these options describe.
    ///
    /// # Errors
    /// A description of what is wrong with the URL (unparsable, a cluster or sentinel URL without
    /// `cluster`, …).
    pub fn fred_config(&self) -> Result<Config, String> {
        if !self.cluster {
            let config = Config::from_url(&self.url).map_err(|e| e.to_string())?;
            return match config.server {
                ServerConfig::Centralized { .. } => Ok(config),
                ServerConfig::Clustered { .. } => Err(format!(
                    "{} is a Redis Cluster URL: set redis.cluster = true (`--cluster`)",
                    redact(&self.url)
                )),
                _ => Err(format!(
                    "only a single Redis server or a Redis Cluster is supported, got {}",
                    redact(&self.url)
                )),
            };
        }
        let url = cluster_url(&self.url)?;
        let config = Config::from_url_clustered(&url).map_err(|e| e.to_string())?;
        if !matches!(config.server, ServerConfig::Clustered { .. }) {
            return Err(format!("{} is not a cluster URL", redact(&self.url)));
        }
        Ok(config)
    }

    /// The first seed host (used for `CLUSTER SLOTS` entries that leave the host out).
    pub(crate) fn seed_host(config: &Config) -> String {
        match &config.server {
            ServerConfig::Clustered { hosts, .. } => hosts
                .first()
                .map(|server| server.host.to_string())
                .unwrap_or_else(|| "127.0.0.1".into()),
            ServerConfig::Centralized { server } => server.host.to_string(),
            _ => "127.0.0.1".into(),
        }
    }
}

impl From<&crate::config::RedisConfig> for RedisOptions {
    fn from(config: &crate::config::RedisConfig) -> Self {
        RedisOptions {
            url: config.url.clone(),
            cluster: config.cluster,
            sharded: config.sharded,
        }
    }
}

/// Rewrites the accepted cluster URL forms (see [`RedisOptions`]) into fred's
/// `scheme://[cred@]host:port[/path]?node=h:p&node=…[&query]` form.
fn cluster_url(url: &str) -> Result<String, String> {
    let url = url.trim();
    if url.is_empty() {
        return Err("redis.url is empty".into());
    }
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (scheme, rest),
        None => ("redis", url),
    };
    if !rest.contains(',') {
        return Ok(format!("{scheme}://{rest}"));
    }
    let (body, query) = match rest.split_once('?') {
        Some((body, query)) => (body, Some(query)),
        None => (rest, None),
    };
    let mut entries = body.split(',').map(str::trim).filter(|e| !e.is_empty());
    let first = entries
        .next()
        .ok_or_else(|| format!("no cluster node in {}", redact(url)))?;
    let mut nodes = Vec::new();
    for entry in entries {
        // Later entries: optional scheme and credentials, then host:port (a path is ignored).
        let entry = entry.split_once("://").map_or(entry, |(_, e)| e);
        let entry = entry.rsplit_once('@').map_or(entry, |(_, e)| e);
        let entry = entry.split_once('/').map_or(entry, |(e, _)| e);
        if !entry.contains(':') {
            return Err(format!("cluster node {entry:?} needs host:port"));
        }
        nodes.push(format!("node={entry}"));
    }
    if let Some(query) = query.filter(|q| !q.is_empty()) {
        nodes.push(query.to_owned());
    }
    Ok(format!("{scheme}://{first}?{}", nodes.join("&")))
}

/// The URL without credentials, for logs and errors.
pub(crate) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(options: &RedisOptions) -> Vec<String> {
        match options.fred_config().expect("config").server {
            ServerConfig::Clustered { hosts, .. } => {
                let mut hosts: Vec<String> = hosts.iter().map(|s| s.to_string()).collect();
                hosts.sort();
                hosts
            }
            other => panic!("not clustered: {other:?}"),
        }
    }

    #[test]
    fn standalone_urls() {
        let config = RedisOptions::standalone("redis://127.0.0.1:6379")
            .fred_config()
            .expect("ok");
        assert!(matches!(config.server, ServerConfig::Centralized { .. }));
        let err = RedisOptions::standalone("redis-cluster://127.0.0.1:7000")
            .fred_config()
            .unwrap_err();
        assert!(err.contains("redis.cluster = true"), "{err}");
        assert!(RedisOptions::standalone("not a url").fred_config().is_err());
    }

    #[test]
    fn cluster_url_forms() {
        let three = vec!["127.0.0.1:7100", "127.0.0.1:7101", "127.0.0.1:7102"];
        for url in [
            "redis-cluster://127.0.0.1:7100?node=127.0.0.1:7101&node=127.0.0.1:7102",
            "redis://127.0.0.1:7100?node=127.0.0.1:7101&node=127.0.0.1:7102",
            "redis://127.0.0.1:7100,127.0.0.1:7101,127.0.0.1:7102",
            "redis://127.0.0.1:7100, redis://127.0.0.1:7101 ,127.0.0.1:7102",
            "127.0.0.1:7100,127.0.0.1:7101,127.0.0.1:7102",
        ] {
            assert_eq!(hosts(&RedisOptions::cluster(url, true)), three, "{url}");
        }
        assert_eq!(
            hosts(&RedisOptions::cluster("redis://10.0.0.1:7000", false)),
            vec!["10.0.0.1:7000"]
        );
        let config = RedisOptions::cluster("redis://user:pw@h1:1,user:pw@h2:2", true)
            .fred_config()
            .expect("ok");
        assert_eq!(config.username.as_deref(), Some("user"));
        assert_eq!(config.password.as_deref(), Some("pw"));
        assert!(RedisOptions::cluster("redis://h1:1,h2", true)
            .fred_config()
            .is_err());
        assert!(RedisOptions::cluster("", true).fred_config().is_err());
    }
}
