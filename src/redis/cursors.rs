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
use fred::interfaces::KeysInterface;
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

/// The writer task: drains up to [`WRITE_BATCH_MAX`] queued writes and sends them as one
/// pipeline of `SET key value PX ttl`, bounded by 4 × [`READ_DEADLINE`]. Ends when every
/// [`CursorStore`] clone is gone.
async fn write_loop(
    client: Client,
    mut rx: tokio::sync::mpsc::Receiver<(String, String)>,
    ttl_ms: i64,
    stats: Arc<CursorStats>,
) {
    let mut batch = Vec::with_capacity(WRITE_BATCH_MAX);
    while rx.recv_many(&mut batch, WRITE_BATCH_MAX).await > 0 {
        let n = batch.len();
        let pipeline = client.pipeline();
        for (key, value) in batch.drain(..) {
            // Queued locally; the result arrives with `all()`.
            let _: Result<(), _> = pipeline
                .set(key, value, Some(Expiration::PX(ttl_ms)), None, false)
                .await;
        }
        // Sent now; the replies are awaited in a task of their own, so the next batch never
        // waits behind this one (a poll hopping to another instance right after its response
        // must find its cursor stored).
        let stats = stats.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(READ_DEADLINE * 4, pipeline.try_all::<()>()).await {
                Ok(results) => {
                    let failed = results.iter().filter(|r| r.is_err()).count();
                    bump_by(&stats.set_ok, n - failed);
                    bump_by(&stats.set_error, failed);
                    if failed > 0 {
                        tracing::debug!(failed, "replay cursor writes failed");
                    }
                }
                Err(_) => {
                    bump_by(&stats.set_error, n);
                    tracing::debug!(n, "replay cursor writes timed out");
                }
            }
        });
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
    stats: Arc<CursorStats>,
    /// `(key, value)` to the writer task; `None` outside a tokio runtime (writes are skipped).
    writes: Option<tokio::sync::mpsc::Sender<(String, String)>>,
}

fn key(env_id: &str, handle: &str, offset: &str) -> String {
    format!("{KEY_PREFIX}{env_id}:{handle}:{offset}")
}

impl CursorStore {
    /// A store on `client`; entries live `ttl_ms` (the working-set TTL).
    ///
    /// Writes go through one background task that sends whatever has queued up as a single
    /// pipeline (a fan-out to 10 000 feeds is ~20 round trips, not 10 000 tasks and commands).
    /// Must be called inside a tokio runtime for writes to happen.
    pub fn new(client: Client, ttl_ms: u64) -> CursorStore {
        let ttl_ms = i64::try_from(ttl_ms.max(1)).unwrap_or(i64::MAX);
        let stats: Arc<CursorStats> = Arc::default();
        let writes = tokio::runtime::Handle::try_current().ok().map(|rt| {
            let (tx, rx) = tokio::sync::mpsc::channel(WRITE_QUEUE_MAX);
            rt.spawn(write_loop(client.clone(), rx, ttl_ms, stats.clone()));
            tx
        });
        CursorStore {
            client,
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
            .try_send((key(env_id, handle, offset), value))
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
