//! Which formulation of the tag set query runfeed sends: the plain one, whose plan Postgres
//! chooses, or the **ordered scan** of the environment's `(runtimeEnvironmentId, createdAt)`
//! range, newest first, that stops at the list cap. Pure: the estimates come from Postgres'
//! own planner (`EXPLAIN`, read in `super::pg`).
//!
//! Why second-guess the planner here: for a tag that is frequent in a **small** environment,
//! Postgres picks the GIN on `runTags` ANDed with the BRIN on `"createdAt"` and the
//! environment's btree. The BRIN's bitmap is lossy page ranges, and it comes first in the AND,
//! so the whole result is lossy: every page of the window holding any run of the environment
//! with any of the tag's matches across every environment is read and every row on it
//! rechecked. A small environment's runs are spread thinly over the window's pages, which the
//! cost model does not see. Measured on 2.5 M runs, for another environment's most frequent
//! tag (≈ 3 700 of its 61 000 runs in 24 h): 16 600 lossy pages and 97 000 rows rechecked,
//! 210–255 ms, where the ordered scan reads 16 000 rows and stops, 31–89 ms, independent of
//! the table's history (BENCHMARKS.md, "At production data volume"). For rarer tags the GIN
//! plan wins (the ordered scan would read the whole window), and in a large environment the
//! planner already picks the ordered scan for its common tags: the choice is left to
//! Postgres there.

/// Estimated rows of an environment's window: `$1` env, `$2` floor timestamp. A plan only.
pub(crate) const WINDOW_ESTIMATE: &str = r#"EXPLAIN (FORMAT JSON) SELECT 1 FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "createdAt" >= $2"#;

/// Estimated runs of an environment's window carrying the tags: `$1` env, `$2` text[] tags,
/// `$3` floor timestamp. A plan only.
pub(crate) const MATCHES_ESTIMATE: &str = r#"EXPLAIN (FORMAT JSON) SELECT 1 FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "runTags" @> $2 AND "createdAt" >= $3"#;

/// The largest window (estimated runs of the environment since the floor) for which the
/// ordered scan is considered: were the tag estimate wrong, the scan reads at most this many
/// rows.
pub(crate) const ORDERED_MAX_WINDOW: f64 = 100_000.0;

/// The most rows the ordered scan is expected to read.
pub(crate) const ORDERED_MAX_ROWS: f64 = 25_000.0;

/// How many rows the ordered scan may read per match the GIN plan would read at least (its
/// heap pages hold the matches, and the rest of what a lossy bitmap brings in).
pub(crate) const ORDERED_ROWS_PER_MATCH: f64 = 8.0;

/// How the tag set is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TagPlan {
    /// The plain statement, planned by Postgres for its parameters.
    Planner = 0,
    /// The ordered scan of the environment's `(runtimeEnvironmentId, createdAt)` range.
    Ordered = 1,
}

/// The plan for a tag set of at most `cap` runs, from the planner's estimates of the
/// environment's runs since the floor (`window`) and of those carrying the tags (`matches`).
///
/// The ordered scan stops after about `window × cap / matches` rows when the tags match at
/// least `cap` runs. It is chosen when that is at most [`ORDERED_MAX_ROWS`] and
/// [`ORDERED_ROWS_PER_MATCH`] rows per match, in a window of at most [`ORDERED_MAX_WINDOW`].
pub(crate) fn choose(window: f64, matches: f64, cap: usize) -> TagPlan {
    let cap = cap as f64;
    if !(window.is_finite() && matches.is_finite())
        || window > ORDERED_MAX_WINDOW
        || cap < 1.0
        || matches < cap
    {
        return TagPlan::Planner;
    }
    let reads = window * cap / matches;
    if reads <= ORDERED_MAX_ROWS && reads <= ORDERED_ROWS_PER_MATCH * matches {
        TagPlan::Ordered
    } else {
        TagPlan::Planner
    }
}

/// The top node's estimated rows in the output of `EXPLAIN (FORMAT JSON)`.
pub(crate) fn plan_rows(explain: &serde_json::Value) -> Option<f64> {
    explain.get(0)?.get("Plan")?.get("Plan Rows")?.as_f64()
}

#[cfg(test)]
mod tests {
    use super::{choose, plan_rows, TagPlan};

    /// The measured case: ≈ 3 500 of 61 000 runs of a small environment's window carry the tag;
    /// the ordered scan reads ≈ 17 000 rows and stops.
    #[test]
    fn a_frequent_tag_of_a_small_environment_takes_the_ordered_scan() {
        assert_eq!(choose(61_000.0, 3_533.0, 1_000), TagPlan::Ordered);
    }

    /// Rarer tags, fewer matches than the cap, a large environment, a tiny environment's rare
    /// tag, and estimates that are not numbers: Postgres chooses.
    #[test]
    fn otherwise_postgres_chooses() {
        assert_eq!(
            choose(61_000.0, 2_046.0, 1_000),
            TagPlan::Planner,
            "mid tag"
        );
        assert_eq!(choose(61_000.0, 136.0, 1_000), TagPlan::Planner, "rare tag");
        assert_eq!(
            choose(1_000_000.0, 62_000.0, 1_000),
            TagPlan::Planner,
            "large env"
        );
        assert_eq!(
            choose(5_000.0, 2.0, 1_000),
            TagPlan::Planner,
            "tiny env, rare tag"
        );
        assert_eq!(choose(f64::NAN, 3_533.0, 1_000), TagPlan::Planner);
        assert_eq!(choose(61_000.0, 3_533.0, 0), TagPlan::Planner);
    }

    #[test]
    fn plan_rows_reads_the_top_node() {
        let explain = serde_json::json!([{"Plan": {"Node Type": "Seq Scan", "Plan Rows": 3533}}]);
        assert_eq!(plan_rows(&explain), Some(3533.0));
        assert_eq!(plan_rows(&serde_json::json!({})), None);
    }
}
