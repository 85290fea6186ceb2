//! One hydrated run and its serialized wire form.

use std::sync::Arc;

use bytes::Bytes;

use super::ids::{BatchId, FriendlyRunId, RunId};

/// One `"TaskRun"` row as read from Postgres, typed. Timestamps are epoch milliseconds (UTC;
/// the columns are `timestamp(3) without time zone` holding UTC, docs/trigger-dev.md §1.1).
///
/// Columns that the reader did not fetch because the feed skips them hold their type's default
/// (empty string, 0, `None`); the serializer never emits them (see [`crate::protocol::ColumnSet`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RunRow {
    pub id: RunId,
    pub task_identifier: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub started_at_ms: Option<i64>,
    pub delay_until_ms: Option<i64>,
    pub queued_at_ms: Option<i64>,
    pub expired_at_ms: Option<i64>,
    pub completed_at_ms: Option<i64>,
    pub friendly_id: FriendlyRunId,
    pub number: i32,
    pub is_test: bool,
    /// `"TaskRunStatus"` enum label, e.g. `EXECUTING`.
    pub status: String,
    pub usage_duration_ms: i32,
    pub cost_in_cents: f64,
    pub base_cost_in_cents: f64,
    pub ttl: Option<String>,
    pub payload: String,
    pub payload_type: String,
    pub metadata: Option<String>,
    pub metadata_type: String,
    pub output: Option<String>,
    pub output_type: String,
    /// `text[]`, nullable with no default: `None` and `Some(vec![])` both go on the wire as null.
    pub run_tags: Option<Vec<String>>,
    /// `jsonb`; emitted as compact JSON text in jsonb key order.
    pub error: Option<serde_json::Value>,
    pub realtime_streams: Option<Vec<String>>,
    /// Internal `"BatchTaskRun".id` (not a wire column; used for routing and scope checks).
    pub batch_id: Option<BatchId>,
}

/// What the router and the feeds need to know about a run regardless of the column set:
/// identity, version, and membership (for the tag feed's authoritative re-check).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunMeta {
    /// Internal run id (`"TaskRun".id`).
    pub id: RunId,
    pub updated_at_ms: i64,
    pub created_at_ms: i64,
    /// `runTags`, `[]` when null.
    pub tags: Vec<String>,
    /// Internal batch id.
    pub batch_id: Option<BatchId>,
    /// The run's `status` is final ([`is_final_status`]): a backstop stops probing it between
    /// full re-reads.
    pub finished: bool,
}

impl RunMeta {
    /// The meta of a hydrated row.
    pub fn of(row: &RunRow) -> Self {
        RunMeta {
            id: row.id.clone(),
            updated_at_ms: row.updated_at_ms,
            created_at_ms: row.created_at_ms,
            tags: row.run_tags.clone().unwrap_or_default(),
            batch_id: row.batch_id.clone(),
            finished: is_final_status(&row.status),
        }
    }
}

/// Whether a `"TaskRun".status` is final: the run will not execute again (trigger.dev's
/// `FINAL_RUN_STATUSES`, `apps/webapp/app/v3/taskStatus.ts`). A final run can still change
/// (tags, metadata), but rarely: its lost publishes surface at the next full re-read.
pub fn is_final_status(status: &str) -> bool {
    matches!(
        status,
        "CANCELED"
            | "INTERRUPTED"
            | "COMPLETED_SUCCESSFULLY"
            | "COMPLETED_WITH_ERRORS"
            | "SYSTEM_FAILURE"
            | "CRASHED"
            | "EXPIRED"
            | "TIMED_OUT"
    )
}

/// A run serialized ONCE for one column set and shared (by `Arc`) by every feed that carries it.
///
/// `fragment` is the change message up to the operation value:
/// `{"key":"\"public\".\"TaskRun\"/\"<id>\"","value":{…},"headers":{"operation":"` —
/// the body builder appends `insert"}}` or `update"}}` from static bytes, so the row's bytes are
/// never copied per feed.
#[derive(Debug, Clone)]
pub struct SerializedRow {
    pub meta: Arc<RunMeta>,
    pub fragment: Bytes,
    /// 64-bit hash of the serialized value: two versions with the same `updatedAt` millisecond
    /// but different content are still told apart (the reference suppresses the second).
    pub value_hash: u64,
    /// The value contains `"status":"DEQUEUED"`, so legacy API versions need the
    /// `DEQUEUED → EXECUTING` rewrite (docs/trigger-dev.md §3, `rewriteBodyForLegacyApiVersion`).
    pub dequeued: bool,
}

/// What serialized rows held in a cache weigh against its byte bound: each row's fragment plus
/// 128 bytes (its metadata and map entry), plus 64 for the holder.
pub fn held_bytes<'a>(rows: impl IntoIterator<Item = &'a SerializedRow>) -> u64 {
    let bytes: usize = rows.into_iter().map(|r| r.fragment.len() + 128).sum();
    u64::try_from(bytes + 64).unwrap_or(u64::MAX)
}
