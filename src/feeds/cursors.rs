//! Fleet-shared replay cursors (reference `SHARED_REPLAY_CURSORS`, behaviours CUR-02..06).
//!
//! Behind a non-sticky load balancer a connection's next poll may land on another instance,
//! which has no local state for the offset the client echoes. Each response therefore also
//! stores its [`ReplayCursor`] in Redis — one small value per (environment, handle, offset),
//! expiring with the working-set TTL — so the next instance can replay exactly the gap instead
//! of re-reading the whole feed from Postgres (a cold resolve).
//!
//! Writes are fire-and-forget; reads have a hard deadline ([`READ_DEADLINE`]); any Redis
//! trouble reads as "unknown", which degrades that poll to the cold re-check, never to an error.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::KeysInterface;
use fred::types::Expiration;

use crate::feeds::diff::Version;
use crate::protocol::offset::Offset;
use crate::router::ReplayCursor;

/// Key prefix (runfeed's own: the value format differs from the reference's timestamp).
pub const KEY_PREFIX: &str = "runfeed:replay-cursor:";
/// How long a poll waits for its cursor before treating it as unknown.
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

fn key(env_id: &str, handle: &str, offset: Offset) -> String {
    format!("{KEY_PREFIX}{env_id}:{handle}:{offset}")
}

/// At most this many recent run versions travel with a cursor.
pub const RECENT_MAX: usize = 64;

/// `instance:epoch:seq:wall_ms` (instance in hex), then `;run,ms,hash` per recent run version
/// (runs whose id contains `;` or `,` are left out).
fn encode(cursor: &ReplayCursor, recent: &[(String, Version)]) -> String {
    let mut out = format!(
        "{:x}:{}:{}:{}",
        cursor.instance, cursor.epoch, cursor.seq, cursor.wall_ms
    );
    for (id, v) in recent.iter().take(RECENT_MAX) {
        if !id.contains([';', ',']) {
            out.push_str(&format!(";{id},{},{:x}", v.ms, v.hash));
        }
    }
    out
}

fn decode(value: &str) -> Option<(ReplayCursor, Vec<(String, Version)>)> {
    let mut sections = value.split(';');
    let cursor = decode_cursor(sections.next()?)?;
    let mut recent = Vec::new();
    for entry in sections.take(RECENT_MAX) {
        let mut f = entry.split(',');
        let (Some(id), Some(ms), Some(hash), None) = (f.next(), f.next(), f.next(), f.next())
        else {
            return None;
        };
        let version = Version {
            ms: ms.parse().ok()?,
            hash: u64::from_str_radix(hash, 16).ok()?,
        };
        recent.push((id.to_string(), version));
    }
    Some((cursor, recent))
}

fn decode_cursor(value: &str) -> Option<ReplayCursor> {
    let mut parts = value.split(':');
    let instance = u64::from_str_radix(parts.next()?, 16).ok()?;
    let epoch = parts.next()?.parse().ok()?;
    let seq = parts.next()?.parse().ok()?;
    let wall_ms = parts.next()?.parse().ok()?;
    if parts.next().is_some() || wall_ms <= 0 {
        return None;
    }
    Some(ReplayCursor {
        epoch,
        seq,
        instance,
        wall_ms,
    })
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

    /// Stores the cursor a response handed out (in the background; failures are logged).
    pub fn set(
        &self,
        env_id: &str,
        handle: &str,
        offset: Offset,
        cursor: &ReplayCursor,
        recent: &[(String, Version)],
    ) {
        let Some(writes) = &self.writes else {
            return;
        };
        let write = (key(env_id, handle, offset), encode(cursor, recent));
        if writes.try_send(write).is_err() {
            // Queue full (Redis slow or down) or the writer is gone.
            bump(&self.stats.set_error);
        }
    }

    /// The cursor stored for this offset, or `None` (unknown, expired, malformed, Redis slow or
    /// down).
    pub async fn get(
        &self,
        env_id: &str,
        handle: &str,
        offset: Offset,
    ) -> Option<(ReplayCursor, Vec<(String, Version)>)> {
        let read = self
            .client
            .get::<Option<String>, _>(key(env_id, handle, offset));
        match tokio::time::timeout(READ_DEADLINE, read).await {
            Ok(Ok(Some(value))) => {
                let cursor = decode(&value);
                bump(if cursor.is_some() {
                    &self.stats.get_hit
                } else {
                    &self.stats.get_error
                });
                cursor
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cur_05_cursor_round_trips_and_garbage_is_unknown() {
        let c = ReplayCursor {
            epoch: 3,
            seq: 42,
            instance: 0xdead_beef,
            wall_ms: 1_700_000_000_000,
        };
        assert_eq!(decode(&encode(&c, &[])), Some((c, vec![])));
        let recent = vec![
            ("run1".to_string(), Version { ms: 5, hash: 0xabc }),
            ("bad;id".to_string(), Version { ms: 1, hash: 1 }),
        ];
        assert_eq!(
            decode(&encode(&c, &recent)),
            Some((c, vec![recent[0].clone()]))
        );
        for bad in [
            "",
            "x",
            "1:2:3",
            "zz:1:2:3",
            "1:2:3:0",
            "1:2:3:4:5",
            "1:-2:3:4",
            "1:2:3:4;r,1",
            "1:2:3:4;r,x,1",
        ] {
            assert_eq!(decode(bad), None, "{bad:?}");
        }
    }
}
