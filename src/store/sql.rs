//! SQL text for the `"TaskRun"` reads and decoding of their rows into [`RunRow`].
//!
//! Every statement is built from static column names only (never from request data), so handing
//! the text to sqlx via [`sqlx::AssertSqlSafe`] is sound; all values go through bind parameters.
//! The text for one `(query kind, column set)` pair is built once and reused ([`SqlCache`]), so
//! each pooled connection prepares it once.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use chrono::NaiveDateTime;
use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::protocol::{is_final_status, Column, ColumnSet, RunMeta, RunRow};

/// The `"TaskRun"` reads whose select list depends on the column set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum RunQuery {
    /// `$1` env, `$2` text[] of ids.
    Hydrate,
    /// `$1` text[] of ids, `$2` text[] of environments (any environment's runs in one query;
    /// the caller keeps only the (environment, id) pairs it asked for).
    HydrateMany,
    /// `$1` env, `$2` id.
    ReadOne,
    /// `$1` env, `$2` text[] tags (non-empty), `$3` floor timestamp, `$4` limit.
    ///
    /// Sent unprepared ([`RunQuery::custom_plan`]): its best plan depends on how rare the tags
    /// are and how large the environment is, which a cached generic plan cannot see. With the
    /// parameters in view Postgres picks, on trigger.dev's indexes (docs/trigger-dev.md): a
    /// common tag, the ordered scan of `TaskRun_runtimeEnvironmentId_createdAt_idx`; a rarer tag
    /// of a large environment, its GIN bitmap ANDed with the BRIN on `"createdAt"`, which keeps
    /// the heap pages read to the window; a tag of a small environment, the GIN bitmap ANDed
    /// with that environment's `(runtimeEnvironmentId, createdAt)` range. Writing the window as
    /// the row comparison `("runtimeEnvironmentId", "createdAt") >= ($1, $3)` keeps the BRIN out
    /// (a rare tag 7 → 0.7 ms on 10 M runs) but lets the planner read a mid tag's whole history
    /// and a small environment's through its `(runtimeEnvironmentId, batchId)` btree: slower
    /// overall (BENCHMARKS.md, "At production data volume").
    TagSet,
    /// [`RunQuery::TagSet`] as the ordered scan of `TaskRun_runtimeEnvironmentId_createdAt_idx`,
    /// newest first, that stops at the limit (`super::tag_plan`): the tag test is written
    /// `("runTags" @> $2) IS TRUE`, which the GIN cannot serve and which is true exactly when
    /// `"runTags" @> $2` is, while Postgres still estimates it from the tag's statistics. Same
    /// parameters, same rows.
    TagSetOrdered,
    /// `$1` env, `$2` floor timestamp, `$3` limit (no tag filter).
    TagSetUnfiltered,
    /// `$1` env, `$2` internal batch id, `$3` limit.
    BatchSet,
}

impl RunQuery {
    /// Whether the statement is sent unprepared, so that Postgres plans it for its parameters
    /// each time instead of settling on a generic plan after five executions: the tag set,
    /// whose best plan depends on how rare its tags are and how large the environment is
    /// (prepared, it cost Postgres 19.6–31.4 ms of CPU per cold snapshot on 2.5 M runs instead
    /// of 10.1; BENCHMARKS.md, "At production data volume"). A cold read, so the extra parse is
    /// cheap beside it.
    pub(crate) fn custom_plan(self) -> bool {
        matches!(self, RunQuery::TagSet | RunQuery::TagSetOrdered)
    }
}

/// Columns every run read fetches whatever the column set: the router needs identity, version
/// and membership (id, updatedAt, createdAt, runTags, batchId), and the reserved columns can never
/// be skipped (trigger's `RESERVED_COLUMNS`; behaviour HYD-04).
const ALWAYS: &str = r#"id, "updatedAt", "createdAt", "runTags", "batchId", "friendlyId", "taskIdentifier", status::text AS status"#;

/// Whether `col` is already part of [`ALWAYS`].
fn always_fetched(col: Column) -> bool {
    matches!(
        col,
        Column::Id
            | Column::UpdatedAt
            | Column::CreatedAt
            | Column::RunTags
            | Column::FriendlyId
            | Column::TaskIdentifier
            | Column::Status
    )
}

/// The select list for `cols`: [`ALWAYS`] then the other emitted columns in wire order.
pub(crate) fn select_list(cols: ColumnSet) -> String {
    let mut out = String::from(ALWAYS);
    for col in cols.columns().filter(|c| !always_fetched(*c)) {
        out.push_str(", \"");
        out.push_str(col.name());
        out.push('"');
    }
    out
}

/// The full statement for `kind` and `cols`.
pub(crate) fn run_query_sql(kind: RunQuery, cols: ColumnSet) -> String {
    let select = select_list(cols);
    match kind {
        RunQuery::Hydrate => format!(
            r#"SELECT {select} FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND id = ANY($2)"#
        ),
        RunQuery::HydrateMany => format!(
            r#"SELECT "runtimeEnvironmentId" AS "envId", {select} FROM "TaskRun" WHERE id = ANY($1) AND "runtimeEnvironmentId" = ANY($2)"#
        ),
        RunQuery::ReadOne => format!(
            r#"SELECT {select} FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND id = $2 LIMIT 1"#
        ),
        RunQuery::TagSet => format!(
            r#"SELECT {select} FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "runTags" @> $2 AND "createdAt" >= $3 ORDER BY "createdAt" DESC, id DESC LIMIT $4"#
        ),
        RunQuery::TagSetOrdered => format!(
            r#"SELECT {select} FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND ("runTags" @> $2) IS TRUE AND "createdAt" >= $3 ORDER BY "createdAt" DESC, id DESC LIMIT $4"#
        ),
        RunQuery::TagSetUnfiltered => format!(
            r#"SELECT {select} FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "createdAt" >= $2 ORDER BY "createdAt" DESC, id DESC LIMIT $3"#
        ),
        RunQuery::BatchSet => format!(
            r#"SELECT {select} FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "batchId" = $2 ORDER BY "createdAt" DESC, id DESC LIMIT $3"#
        ),
    }
}

/// Heads of runs by id: `$1` env, `$2` text[] ids (the primary key). A head is what a backstop
/// compares ([`decode_head`]): id, version, membership and status, never the payload.
pub(crate) const HEADS_BY_ID: &str = r#"SELECT id, "updatedAt", "createdAt", "runTags", "batchId", status::text AS status FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND id = ANY($2)"#;

/// Heads of the runs created at or after `$2` in env `$1`, newest first, at most `$3`: a
/// bounded range of `TaskRun_runtimeEnvironmentId_createdAt_idx` (docs/trigger-dev.md).
pub(crate) const HEADS_CREATED_SINCE: &str = r#"SELECT id, "updatedAt", "createdAt", "runTags", "batchId", status::text AS status FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "createdAt" >= $2 ORDER BY "createdAt" DESC, id DESC LIMIT $3"#;

/// Decodes a row of [`HEADS_BY_ID`] or [`HEADS_CREATED_SINCE`].
pub(crate) fn decode_head(row: &PgRow) -> Result<RunMeta, sqlx::Error> {
    let tags: Option<Vec<String>> = row.try_get(3)?;
    let status: String = row.try_get(5)?;
    Ok(RunMeta {
        id: row.try_get(0)?,
        updated_at_ms: ts_ms(row.try_get::<NaiveDateTime, _>(1)?),
        created_at_ms: ts_ms(row.try_get::<NaiveDateTime, _>(2)?),
        tags: tags.unwrap_or_default(),
        batch_id: row.try_get(4)?,
        finished: is_final_status(&status),
    })
}

/// Statement text per `(kind, column set bits)`, built on first use. At most 5 × (distinct
/// column sets in use) entries; column sets come from `skipColumns`, which only removes
/// non-reserved columns, so the key space is bounded by the 2^21 subsets but in practice a
/// handful.
#[derive(Default)]
pub(crate) struct SqlCache {
    map: RwLock<HashMap<(RunQuery, u32), Arc<str>>>,
}

impl SqlCache {
    /// The statement for `kind` and `cols` (shared text).
    pub(crate) fn get(&self, kind: RunQuery, cols: ColumnSet) -> Arc<str> {
        let key = (kind, cols.bits());
        if let Ok(map) = self.map.read() {
            if let Some(sql) = map.get(&key) {
                return Arc::clone(sql);
            }
        }
        let sql: Arc<str> = Arc::from(run_query_sql(kind, cols));
        if let Ok(mut map) = self.map.write() {
            // Bounded: stop caching rather than grow without limit on pathological input.
            if map.len() < 4096 {
                map.insert(key, Arc::clone(&sql));
            }
        }
        sql
    }
}

/// Epoch milliseconds of a `timestamp(3) without time zone` value holding UTC (docs/trigger-dev.md §1.1).
pub(crate) fn ts_ms(ts: NaiveDateTime) -> i64 {
    ts.and_utc().timestamp_millis()
}

/// The `timestamp without time zone` (UTC wall clock) for epoch milliseconds, clamped to
/// 1970-01-01 .. 9999-12-31 so it is always representable by both chrono and Postgres.
pub(crate) fn ms_to_ts(ms: i64) -> NaiveDateTime {
    const MAX_MS: i64 = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z
    let clamped = ms.clamp(0, MAX_MS);
    chrono::DateTime::from_timestamp_millis(clamped)
        .map(|dt| dt.naive_utc())
        .unwrap_or_default()
}

fn opt_ts(row: &PgRow, index: usize) -> Result<Option<i64>, sqlx::Error> {
    Ok(row.try_get::<Option<NaiveDateTime>, _>(index)?.map(ts_ms))
}

/// Positions of the [`ALWAYS`] columns in a row selected with [`select_list`] (after `first`
/// leading columns, such as [`RunQuery::HydrateMany`]'s environment id).
const ID: usize = 0;
const UPDATED_AT: usize = 1;
const CREATED_AT: usize = 2;
const RUN_TAGS: usize = 3;
const BATCH_ID: usize = 4;
const FRIENDLY_ID: usize = 5;
const TASK_IDENTIFIER: usize = 6;
const STATUS: usize = 7;
/// How many columns [`ALWAYS`] selects: the other emitted columns follow, in wire order.
const ALWAYS_COUNT: usize = 8;

/// Decodes one row selected with [`select_list`]`(cols)`, whose select list starts after `first`
/// leading columns (0, or 1 for [`RunQuery::HydrateMany`]'s environment id). Columns are read
/// by position, in the order [`select_list`] writes them. Columns outside `cols` (and not in the
/// always-fetched set) are not in the row and get their type's default.
///
/// `error` (jsonb) is decoded by serde_json with `preserve_order`, so object keys keep jsonb's
/// storage order; a JSON `null` reads as `None`, as Prisma reads it (docs/trigger-dev.md §1.4).
pub(crate) fn decode_run(
    row: &PgRow,
    cols: ColumnSet,
    first: usize,
) -> Result<RunRow, sqlx::Error> {
    let mut run = RunRow {
        id: row.try_get(first + ID)?,
        task_identifier: row.try_get(first + TASK_IDENTIFIER)?,
        created_at_ms: ts_ms(row.try_get::<NaiveDateTime, _>(first + CREATED_AT)?),
        updated_at_ms: ts_ms(row.try_get::<NaiveDateTime, _>(first + UPDATED_AT)?),
        started_at_ms: None,
        delay_until_ms: None,
        queued_at_ms: None,
        expired_at_ms: None,
        completed_at_ms: None,
        friendly_id: row.try_get(first + FRIENDLY_ID)?,
        number: 0,
        is_test: false,
        status: row.try_get(first + STATUS)?,
        usage_duration_ms: 0,
        cost_in_cents: 0.0,
        base_cost_in_cents: 0.0,
        ttl: None,
        payload: String::new(),
        payload_type: String::new(),
        metadata: None,
        metadata_type: String::new(),
        output: None,
        output_type: String::new(),
        run_tags: row.try_get(first + RUN_TAGS)?,
        error: None,
        realtime_streams: None,
        batch_id: row.try_get(first + BATCH_ID)?,
    };
    let rest = cols.columns().filter(|c| !always_fetched(*c));
    for (i, col) in (first + ALWAYS_COUNT..).zip(rest) {
        match col {
            Column::StartedAt => run.started_at_ms = opt_ts(row, i)?,
            Column::DelayUntil => run.delay_until_ms = opt_ts(row, i)?,
            Column::QueuedAt => run.queued_at_ms = opt_ts(row, i)?,
            Column::ExpiredAt => run.expired_at_ms = opt_ts(row, i)?,
            Column::CompletedAt => run.completed_at_ms = opt_ts(row, i)?,
            Column::Number => run.number = row.try_get(i)?,
            Column::IsTest => run.is_test = row.try_get(i)?,
            Column::UsageDurationMs => run.usage_duration_ms = row.try_get(i)?,
            Column::CostInCents => run.cost_in_cents = row.try_get(i)?,
            Column::BaseCostInCents => run.base_cost_in_cents = row.try_get(i)?,
            Column::Ttl => run.ttl = row.try_get(i)?,
            Column::Payload => run.payload = row.try_get(i)?,
            Column::PayloadType => run.payload_type = row.try_get(i)?,
            Column::Metadata => run.metadata = row.try_get(i)?,
            Column::MetadataType => run.metadata_type = row.try_get(i)?,
            Column::Output => run.output = row.try_get(i)?,
            Column::OutputType => run.output_type = row.try_get(i)?,
            Column::Error => {
                let value: Option<sqlx::types::Json<serde_json::Value>> = row.try_get(i)?;
                run.error = value.map(|j| j.0).filter(|v| !v.is_null());
            }
            Column::RealtimeStreams => run.realtime_streams = row.try_get(i)?,
            // Selected by ALWAYS, never among the rest.
            Column::Id
            | Column::TaskIdentifier
            | Column::CreatedAt
            | Column::UpdatedAt
            | Column::FriendlyId
            | Column::Status
            | Column::RunTags => {}
        }
    }
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyd_04_select_list_keeps_router_and_reserved_columns_when_skipping() {
        let cols =
            ColumnSet::from_skip_list(["payload", "output", "updatedAt", "runTags", "error"]);
        let sql = select_list(cols);
        for needed in [
            "id",
            "\"updatedAt\"",
            "\"createdAt\"",
            "\"runTags\"",
            "\"batchId\"",
            "\"friendlyId\"",
            "\"taskIdentifier\"",
            "status::text AS status",
        ] {
            assert!(sql.contains(needed), "{needed} missing from {sql}");
        }
        assert!(!sql.contains("\"payload\""));
        assert!(!sql.contains("\"output\""));
        assert!(!sql.contains("\"error\""));
        assert!(sql.contains("\"payloadType\""));
    }

    #[test]
    fn select_list_for_all_columns_names_each_column_once() {
        let sql = select_list(ColumnSet::ALL);
        for col in Column::ALL {
            let quoted = format!("\"{}\"", col.name());
            let n = sql.matches(&quoted).count();
            match col {
                Column::Id | Column::Status => assert_eq!(n, 0, "{sql}"),
                _ => assert_eq!(n, 1, "{} in {sql}", col.name()),
            }
        }
    }

    #[test]
    fn ms_to_ts_round_trips_and_clamps() {
        let ms = 1_722_000_123_456;
        assert_eq!(ts_ms(ms_to_ts(ms)), ms);
        assert_eq!(ts_ms(ms_to_ts(-5)), 0);
        assert_eq!(ts_ms(ms_to_ts(i64::MAX)), 253_402_300_799_999);
    }

    /// The tag set's window stays a plain bound on `"createdAt"`, planned per execution: the row
    /// comparison `("runtimeEnvironmentId", "createdAt") >= ($1, $3)` read a mid tag's and a small
    /// environment's whole history on 10 M runs (BENCHMARKS.md, "At production data volume").
    #[test]
    fn tag_set_window_is_a_plain_created_at_bound_planned_per_execution() {
        let sql = run_query_sql(RunQuery::TagSet, ColumnSet::ALL);
        assert!(sql.contains(r#"AND "createdAt" >= $3 ORDER BY"#), "{sql}");
        assert!(
            !sql.contains(r#"("runtimeEnvironmentId", "createdAt")"#),
            "{sql}"
        );
        assert!(RunQuery::TagSet.custom_plan());
        assert!(RunQuery::TagSetOrdered.custom_plan());
        for kind in [
            RunQuery::Hydrate,
            RunQuery::HydrateMany,
            RunQuery::ReadOne,
            RunQuery::TagSetUnfiltered,
            RunQuery::BatchSet,
        ] {
            assert!(!kind.custom_plan(), "{kind:?}");
        }
    }

    #[test]
    fn sql_cache_returns_same_text() {
        let cache = SqlCache::default();
        let a = cache.get(RunQuery::Hydrate, ColumnSet::ALL);
        let b = cache.get(RunQuery::Hydrate, ColumnSet::ALL);
        assert!(Arc::ptr_eq(&a, &b));
        assert!(a.contains("id = ANY($2)"));
    }
}
