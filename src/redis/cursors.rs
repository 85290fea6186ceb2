//! Fleet-shared replay cursors in Redis (reference `SHARED_REPLAY_CURSORS`, docs/behaviours.md
//! CUR-02..06): one small value per (environment, handle, offset), expiring with the working-set
//! TTL, so a poll that lands on another instance can replay exactly its gap.
//!
//! Writes are fire-and-forget through one pipelined writer task; reads have a hard deadline
//! ([`READ_DEADLINE`]); any Redis trouble reads as "unknown". The value's format belongs to the
//! caller (`feeds` encodes the cursor and the recent run versions).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::{ClientLike, KeysInterface};
use fred::types::scripts::Script;
use fred::types::Expiration;

/// Key prefix (runfeed's own: the value format differs from the reference's timestamp).
pub const KEY_PREFIX: &str = "runfeed:replay-cursor:";
/// How long a read waits before the cursor counts as unknown.
pub const READ_DEADLINE: Duration = Duration::from_millis(250);

/// Counters of the cursor store (exported as `runfeed.feeds.cursor_store_ops`).
#[derive(Debug, Default)]
pub struct CursorStats {
    /// Reads that found a cursor.
    pub get_hit: AtomicU64,
    /// Reads that found nothing (never stored, expired).
    pub get_miss: AtomicU64,
    /// Reads that failed, timed out or found a malformed value (the poll re-checks cold).
    pub get_error: AtomicU64,
    /// Writes Redis acknowledged.
    pub set_ok: AtomicU64,
    /// Writes that failed or timed out.
    pub set_error: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

fn bump_by(counter: &AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Ordering::Relaxed);
}

/// Stores every `(key, value)` pair it is given with `PX ARGV[1]` (`ARGV[i + 1]` is the value of
/// `KEYS[i]`): the cursor writes queued together, as ONE command. On a Cluster a call carries
/// one environment's keys, which share its hash tag, so one slot; on a standalone server, the
/// whole batch.
pub const SET_MANY: &str = r#"
for i, key in ipairs(KEYS) do
  redis.call('SET', key, ARGV[i + 1], 'PX', ARGV[1])
end
return #KEYS
"#;

/// [`SET_MANY`] with its SHA-1 (sent as `EVALSHA`).
static SET_MANY_SCRIPT: std::sync::LazyLock<Arc<Script>> =
    std::sync::LazyLock::new(|| Arc::new(Script::from_lua(SET_MANY)));

/// One queued cursor write.
struct Write {
    /// Length of `key`'s prefix up to and including its environment's hash tag.
    env_end: usize,
    key: String,
    value: String,
}

/// The writer task: drains up to [`WRITE_BATCH_MAX`] queued writes and sends them as one
/// command per group (a lone write is a plain `SET key value PX ttl`, a group one [`SET_MANY`]
/// call), bounded by 4 × [`READ_DEADLINE`]: one group per environment on a Cluster
/// (`clustered`), the whole batch on a standalone server. A delivery to N feeds writes N cursors
/// at once, so Redis sees one command for them instead of N (BENCHMARKS.md "Cost per unit of
/// work"). Ends when every [`CursorStore`] clone is gone.
async fn write_loop(
    client: Client,
    mut rx: tokio::sync::mpsc::Receiver<Write>,
    ttl_ms: i64,
    stats: Arc<CursorStats>,
    commands: Arc<super::CommandCounts>,
) {
    let clustered = client.is_clustered();
    let mut batch = Vec::with_capacity(WRITE_BATCH_MAX);
    while rx.recv_many(&mut batch, WRITE_BATCH_MAX).await > 0 {
        // One change delivered to several feeds of an environment wakes their responses
        // together, as tasks queued behind this one: letting them run first (a yield, not a
        // timer) puts their cursors in this batch, so they share one command.
        tokio::task::yield_now().await;
        while batch.len() < WRITE_BATCH_MAX {
            match rx.try_recv() {
                Ok(write) => batch.push(write),
                Err(_) => break,
            }
        }
        let n = batch.len();
        // Sent now; the replies are awaited in a task of their own, so the next batch never
        // waits behind this one (a poll hopping to another instance right after its response
        // must find its cursor stored).
        let writes = std::mem::take(&mut batch);
        let groups = if clustered {
            group_by_env(writes)
        } else {
            vec![writes]
        };
        let sends: Vec<_> = groups
            .into_iter()
            .map(|group| send_group(&client, group, ttl_ms))
            .collect();
        super::CommandCounts::sent(&commands.cursor_write, sends.len());
        let stats = stats.clone();
        tokio::spawn(async move {
            let sent = futures::future::join_all(sends);
            match tokio::time::timeout(READ_DEADLINE * 4, sent).await {
                Ok(results) => {
                    let failed: usize = results.iter().filter_map(|r| r.err()).sum();
                    bump_by(&stats.set_ok, n - failed);
                    // Each failed group logged its error (`send_group`).
                    bump_by(&stats.set_error, failed);
                }
                Err(_) => {
                    bump_by(&stats.set_error, n);
                    tracing::debug!(n, "replay cursor writes timed out");
                }
            }
        });
        batch = Vec::with_capacity(WRITE_BATCH_MAX);
    }
}

/// `writes` grouped by environment, in order of first appearance.
fn group_by_env(writes: Vec<Write>) -> Vec<Vec<Write>> {
    let mut groups: Vec<Vec<Write>> = Vec::new();
    for write in writes {
        let env = &write.key[..write.env_end];
        match groups.iter_mut().find(|g| &g[0].key[..g[0].env_end] == env) {
            Some(group) => group.push(write),
            None => groups.push(vec![write]),
        }
    }
    groups
}

/// Sends one environment's writes as one command; `Err(n)` = `n` writes failed.
fn send_group(
    client: &Client,
    group: Vec<Write>,
    ttl_ms: i64,
) -> impl std::future::Future<Output = Result<(), usize>> + Send + 'static {
    let client = client.clone();
    async move {
        let n = group.len();
        let result = match <[Write; 1]>::try_from(group) {
            Ok([Write { key, value, .. }]) => {
                client
                    .set::<(), _, _>(key, value, Some(Expiration::PX(ttl_ms)), None, false)
                    .await
            }
            Err(group) => {
                let mut keys = Vec::with_capacity(n);
                let mut args = Vec::with_capacity(n + 1);
                args.push(ttl_ms.to_string());
                for Write { key, value, .. } in group {
                    keys.push(key);
                    args.push(value);
                }
                SET_MANY_SCRIPT
                    .evalsha_with_reload::<i64, _, _>(&client, keys, args)
                    .await
                    .map(drop)
            }
        };
        result.map_err(|e| {
            tracing::debug!(error = %e, n, "replay cursor write failed");
            n
        })
    }
}

/// Cursor writes waiting for the writer task at most; beyond that (Redis slow or down) writes
/// are dropped and counted as `set_error` (the next poll then re-checks cold).
pub const WRITE_QUEUE_MAX: usize = 16_384;
/// Most writes sent to Redis in one pipeline.
const WRITE_BATCH_MAX: usize = 512;

/// The Redis-backed cursor store.
#[derive(Clone)]
pub struct CursorStore {
    client: Client,
    commands: Arc<super::CommandCounts>,
    stats: Arc<CursorStats>,
    /// `(key, value)` to the writer task; `None` outside a tokio runtime (writes are skipped).
    writes: Option<tokio::sync::mpsc::Sender<Write>>,
}

/// The key of one cursor: the environment in a hash tag (`{…}`), so one environment's cursors
/// share a Cluster slot and can be written by one [`SET_MANY`] call.
fn key(env_id: &str, handle: &str, offset: &str) -> String {
    // Pushed rather than `format!`ed: one allocation of the exact size (every response that
    // records a state writes one).
    let mut key =
        String::with_capacity(KEY_PREFIX.len() + env_id.len() + handle.len() + offset.len() + 4);
    key.push_str(KEY_PREFIX);
    key.push('{');
    key.push_str(env_id);
    key.push_str("}:");
    key.push_str(handle);
    key.push(':');
    key.push_str(offset);
    key
}

/// Length of the part of a [`key`] up to and including the environment's hash tag.
fn env_end(env_id: &str) -> usize {
    KEY_PREFIX.len() + env_id.len() + 2
}

impl CursorStore {
    /// A store on `client`; entries live `ttl_ms` (the working-set TTL).
    ///
    /// Writes go through one background task that sends whatever has queued up as a single
    /// pipeline (a fan-out to 10 000 feeds is ~20 round trips, not 10 000 tasks and commands).
    /// Must be called inside a tokio runtime for writes to happen.
    pub fn new(client: Client, ttl_ms: u64, commands: Arc<super::CommandCounts>) -> CursorStore {
        let ttl_ms = i64::try_from(ttl_ms.max(1)).unwrap_or(i64::MAX);
        let stats: Arc<CursorStats> = Arc::default();
        let writes = tokio::runtime::Handle::try_current().ok().map(|rt| {
            let (tx, rx) = tokio::sync::mpsc::channel(WRITE_QUEUE_MAX);
            rt.spawn(write_loop(
                client.clone(),
                rx,
                ttl_ms,
                stats.clone(),
                commands.clone(),
            ));
            tx
        });
        CursorStore {
            client,
            commands,
            stats,
            writes,
        }
    }

    /// Read and write outcomes so far.
    pub fn stats(&self) -> &Arc<CursorStats> {
        &self.stats
    }

    /// Stores `value` for the cursor key `(env_id, handle, offset)` (in the background; failures
    /// are counted).
    pub fn set(&self, env_id: &str, handle: &str, offset: &str, value: String) {
        let Some(writes) = &self.writes else {
            return;
        };
        if writes
            .try_send(Write {
                env_end: env_end(env_id),
                key: key(env_id, handle, offset),
                value,
            })
            .is_err()
        {
            // Queue full (Redis slow or down) or the writer is gone.
            bump(&self.stats.set_error);
        }
    }

    /// The value stored for `(env_id, handle, offset)`, decoded by `decode`; `None` when unknown,
    /// expired, undecodable (counted as an error), or Redis is slow or down.
    pub async fn get<T>(
        &self,
        env_id: &str,
        handle: &str,
        offset: &str,
        decode: impl FnOnce(&str) -> Option<T>,
    ) -> Option<T> {
        super::CommandCounts::sent(&self.commands.cursor_read, 1);
        let read = self
            .client
            .get::<Option<String>, _>(key(env_id, handle, offset));
        match tokio::time::timeout(READ_DEADLINE, read).await {
            Ok(Ok(Some(value))) => {
                let decoded = decode(&value);
                bump(if decoded.is_some() {
                    &self.stats.get_hit
                } else {
                    &self.stats.get_error
                });
                decoded
            }
            Ok(Ok(None)) => {
                bump(&self.stats.get_miss);
                None
            }
            Ok(Err(err)) => {
                bump(&self.stats.get_error);
                tracing::debug!(error = %err, "replay cursor read failed; cold re-check");
                None
            }
            Err(_) => {
                bump(&self.stats.get_error);
                tracing::debug!("replay cursor read timed out; cold re-check");
                None
            }
        }
    }
}
