//! Replica replay-position probes for the read-your-writes gate.
//!
//! A vanilla streaming replica reports how far it has replayed the primary's WAL
//! (`pg_last_wal_replay_lsn()`); the primary reports how far it has written
//! (`pg_current_wal_lsn()`). A change record is published after its commit, so once the
//! replica's replay position passes a primary position read AFTER the record arrived, every row
//! the record announces is visible on the replica. No clocks are involved.
//!
//! A configured replica that reports it is NOT in recovery (`pg_is_in_recovery()` false) was
//! promoted: it no longer receives the primary's commits (unless `database.url` followed the
//! failover too, and then the primary is just as right to read). Either way it cannot be trusted
//! to have what the change records announce, so every probe of it ([`PgStore::check_replica`]:
//! the gate's, `/readyz`'s and [`PgStore::watch_replica`]'s) routes replica reads to the primary
//! while it is out of recovery, and back to it once it is in recovery again.
//!
//! These probes are not counted in [`PgStore::query_count`] (that counts feed data reads).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::Row;
use tokio_util::sync::CancellationToken;

use super::{Found, PgStore, StoreError};

/// A WAL position in bytes (`pg_lsn - '0/0'`).
pub type Lsn = u64;

/// Where the primary and the replica are in the WAL.
#[async_trait]
pub trait ReplicaProbe: Send + Sync + 'static {
    /// The primary's current WAL write position.
    async fn primary_lsn(&self) -> Result<Lsn, StoreError>;
    /// The replica's replay position; `Ok(None)` when reads are not served by a replica in
    /// recovery (no distinct replica, or it was promoted and reads go to the primary): every
    /// commit is visible.
    async fn replica_replay_lsn(&self) -> Found<Lsn>;
    /// Whether replica reads go to the primary now (known without a query): nothing to wait
    /// for. `false` unless the implementation routes reads away from its replica.
    fn reads_primary(&self) -> bool {
        false
    }
}

/// How often [`PgStore::watch_replica`] asks the replica whether it is in recovery.
pub const REPLICA_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// What a distinct replica says about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// `pg_is_in_recovery()`: a standby replaying the primary's WAL. `false`: promoted.
    pub in_recovery: bool,
    /// `pg_last_wal_replay_lsn()`, bytes (`None` before anything was replayed, or when it was
    /// never a standby).
    pub replay_lsn: Option<Lsn>,
}

fn lag_err(op: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| {
        super::pg::count_error(&source);
        StoreError { op, source }
    }
}

#[async_trait]
impl ReplicaProbe for PgStore {
    async fn primary_lsn(&self) -> Result<Lsn, StoreError> {
        let query = || sqlx::query("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8 AS lsn");
        let row = self
            .fetch_first_on(self.primary(), "primary_lsn", query)
            .await?
            .ok_or(sqlx::Error::RowNotFound)
            .map_err(lag_err("primary_lsn"))?;
        let lsn: i64 = row.try_get("lsn").map_err(lag_err("primary_lsn"))?;
        Ok(u64::try_from(lsn).unwrap_or(0))
    }

    async fn replica_replay_lsn(&self) -> Found<Lsn> {
        Ok(match self.check_replica().await? {
            Some(ReplicaStatus {
                in_recovery: true,
                replay_lsn,
            }) => Some(replay_lsn.unwrap_or(0)), // nothing replayed yet: everything is ahead
            Some(ReplicaStatus {
                in_recovery: false, ..
            })
            | None => None,
        })
    }

    fn reads_primary(&self) -> bool {
        self.replica_bypassed()
    }
}

impl PgStore {
    /// Asks the distinct replica whether it is in recovery and how far it replayed, and routes
    /// replica reads by the answer (out of recovery: to the primary). `Ok(None)` without a
    /// distinct replica.
    ///
    /// Errors: `StoreError { op: "replica_replay_lsn" }` (the replica unreachable; the routing
    /// stays as it was).
    pub async fn check_replica(&self) -> Found<ReplicaStatus> {
        if !self.has_distinct_replica() {
            return Ok(None);
        }
        let query = || {
            sqlx::query(
                "SELECT pg_is_in_recovery() AS recovering, (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::int8 AS lsn",
            )
        };
        let row = self
            .fetch_first_on(self.replica(), "replica_replay_lsn", query)
            .await?
            .ok_or(sqlx::Error::RowNotFound)
            .map_err(lag_err("replica_replay_lsn"))?;
        let in_recovery: bool = row
            .try_get("recovering")
            .map_err(lag_err("replica_replay_lsn"))?;
        let lsn: Option<i64> = row.try_get("lsn").map_err(lag_err("replica_replay_lsn"))?;
        self.note_replica_recovery(in_recovery);
        Ok(Some(ReplicaStatus {
            in_recovery,
            replay_lsn: lsn.map(|lsn| u64::try_from(lsn).unwrap_or(0)),
        }))
    }

    /// Runs [`PgStore::check_replica`] every [`REPLICA_CHECK_INTERVAL`] until `shutdown`, so
    /// reads leave a promoted replica (and come back) even while no change record arrives.
    /// Returns at once without a distinct replica.
    pub async fn watch_replica(self: Arc<Self>, shutdown: CancellationToken) {
        if !self.has_distinct_replica() {
            return;
        }
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(REPLICA_CHECK_INTERVAL) => {}
            }
            // Raced against shutdown too: a replica that does not answer must not hold up the
            // drain for the pool's acquire timeout.
            tokio::select! {
                () = shutdown.cancelled() => return,
                checked = self.check_replica() => {
                    if let Err(err) = checked {
                        tracing::debug!(error = %err, "replica recovery check failed");
                    }
                }
            }
        }
    }
}
