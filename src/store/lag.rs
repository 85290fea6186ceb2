//! Replica replay-position probes for the read-your-writes gate.
//!
//! A vanilla streaming replica reports how far it has replayed the primary's WAL
//! (`pg_last_wal_replay_lsn()`); the primary reports how far it has written
//! (`pg_current_wal_lsn()`). A change record is published after its commit, so once the
//! replica's replay position passes a primary position read AFTER the record arrived, every row
//! the record announces is visible on the replica. No clocks are involved.
//!
//! These probes are not counted in [`PgStore::query_count`] (that counts feed data reads).

use async_trait::async_trait;
use sqlx::Row;

use super::{PgStore, StoreError};

/// A WAL position in bytes (`pg_lsn - '0/0'`).
pub type Lsn = u64;

/// Where the primary and the replica are in the WAL.
#[async_trait]
pub trait ReplicaProbe: Send + Sync + 'static {
    /// The primary's current WAL write position.
    async fn primary_lsn(&self) -> Result<Lsn, StoreError>;
    /// The replica's replay position; `Ok(None)` when reads are not served by a replica in
    /// recovery (no distinct replica, or it was promoted): every commit is visible.
    async fn replica_replay_lsn(&self) -> Result<Option<Lsn>, StoreError>;
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
        let row = sqlx::query("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8 AS lsn")
            .fetch_one(self.primary())
            .await
            .map_err(lag_err("primary_lsn"))?;
        let lsn: i64 = row.try_get("lsn").map_err(lag_err("primary_lsn"))?;
        Ok(u64::try_from(lsn).unwrap_or(0))
    }

    async fn replica_replay_lsn(&self) -> Result<Option<Lsn>, StoreError> {
        if !self.has_distinct_replica() {
            return Ok(None);
        }
        let row = sqlx::query(
            "SELECT pg_is_in_recovery() AS recovering, (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::int8 AS lsn",
        )
        .fetch_one(self.replica())
        .await
        .map_err(lag_err("replica_replay_lsn"))?;
        let recovering: bool = row
            .try_get("recovering")
            .map_err(lag_err("replica_replay_lsn"))?;
        let lsn: Option<i64> = row.try_get("lsn").map_err(lag_err("replica_replay_lsn"))?;
        Ok(match (recovering, lsn) {
            (true, Some(lsn)) => Some(u64::try_from(lsn).unwrap_or(0)),
            // In recovery but nothing replayed yet: position 0 (everything is ahead).
            (true, None) => Some(0),
            (false, _) => None,
        })
    }
}
