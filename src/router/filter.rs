//! A held feed's membership predicate over its environment's change stream.

use std::sync::Arc;

use crate::changes::ChangeRecord;
use crate::protocol::{BatchId, RunId, RunMeta};

/// What a feed watches (internal ids).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum FeedFilter {
    /// One run.
    Run { run_id: RunId },
    /// Runs carrying ALL `tags` (none = every run) created at or after `floor_ms`.
    Tag { tags: Arc<[String]>, floor_ms: i64 },
    /// Runs of one batch.
    Batch { batch_id: BatchId },
}

impl FeedFilter {
    /// Whether a record is a candidate for this feed before hydration (RTR-10..13, REP-05).
    /// Partial records (no tags) are candidates for every tag feed, and — unlike the
    /// reference (docs/behaviours.md §4 item 10) — for every batch feed too: the hydrated row decides.
    pub fn is_candidate(&self, record: &ChangeRecord) -> bool {
        match self {
            FeedFilter::Run { run_id } => &record.run_id == run_id,
            FeedFilter::Batch { batch_id } => match (&record.batch_id, &record.tags) {
                (Some(b), _) => b == batch_id,
                (None, None) => true,
                (None, Some(_)) => false,
            },
            FeedFilter::Tag { tags, .. } => match &record.tags {
                None => true,
                Some(_) if tags.is_empty() => true,
                Some(record_tags) => record_tags.iter().any(|t| tags.contains(t)),
            },
        }
    }

    /// Authoritative check against the hydrated row (RTR-17): run feed → same run; batch feed →
    /// same batch; tag feed → the row carries ALL the filter's tags and `createdAt >= floor`.
    pub fn accepts(&self, meta: &RunMeta) -> bool {
        match self {
            FeedFilter::Run { run_id } => &meta.id == run_id,
            FeedFilter::Batch { batch_id } => meta.batch_id.as_ref() == Some(batch_id),
            FeedFilter::Tag { tags, floor_ms } => {
                meta.created_at_ms >= *floor_ms && tags.iter().all(|t| meta.tags.contains(t))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(tags: &[&str], created: i64, batch: Option<&str>) -> RunMeta {
        RunMeta {
            id: "r".into(),
            updated_at_ms: 1,
            created_at_ms: created,
            tags: tags.iter().map(|t| t.to_string()).collect(),
            batch_id: batch.map(BatchId::new),
            finished: false,
        }
    }

    fn rec(tags: Option<&[&str]>, batch: Option<&str>) -> ChangeRecord {
        ChangeRecord {
            v: 1,
            run_id: "r".into(),
            env_id: "e".into(),
            tags: tags.map(|t| t.iter().map(|s| s.to_string()).collect()),
            batch_id: batch.map(BatchId::new),
            updated_at_ms: None,
        }
    }

    #[test]
    fn rtr_17_tag_feed_is_contains_all_with_floor() {
        let f = FeedFilter::Tag {
            tags: vec!["a".into(), "b".into()].into(),
            floor_ms: 100,
        };
        assert!(!f.accepts(&meta(&["a"], 200, None)));
        assert!(f.accepts(&meta(&["a", "b", "c"], 200, None)));
        assert!(!f.accepts(&meta(&["a", "b"], 99, None)));
        let unfiltered = FeedFilter::Tag {
            tags: Vec::new().into(),
            floor_ms: 100,
        };
        assert!(unfiltered.accepts(&meta(&[], 100, None)));
        assert!(!unfiltered.accepts(&meta(&[], 99, None)));
    }

    #[test]
    fn rtr_12_13_tag_candidates_any_overlap_or_partial() {
        let f = FeedFilter::Tag {
            tags: vec!["a".into(), "b".into()].into(),
            floor_ms: 0,
        };
        assert!(f.is_candidate(&rec(Some(&["b"]), None)));
        assert!(!f.is_candidate(&rec(Some(&["z"]), None)));
        assert!(
            f.is_candidate(&rec(None, None)),
            "partial record is hydrate-to-classify"
        );
        let unfiltered = FeedFilter::Tag {
            tags: Vec::new().into(),
            floor_ms: 0,
        };
        assert!(unfiltered.is_candidate(&rec(Some(&[]), None)));
    }

    #[test]
    fn rtr_11_batch_feed_by_exact_batch_and_partial_records_classified_by_row() {
        let f = FeedFilter::Batch {
            batch_id: "b1".into(),
        };
        assert!(f.is_candidate(&rec(Some(&[]), Some("b1"))));
        assert!(!f.is_candidate(&rec(Some(&[]), Some("other"))));
        assert!(
            !f.is_candidate(&rec(Some(&[]), None)),
            "full record without batch"
        );
        assert!(
            f.is_candidate(&rec(None, None)),
            "partial record: hydrate decides"
        );
        assert!(f.accepts(&meta(&[], 0, Some("b1"))));
        assert!(!f.accepts(&meta(&[], 0, None)));
    }
}
