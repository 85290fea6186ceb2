//! The per-environment index of held feeds (by run id, tag and batch id), the replay positions it
//! hands out, and which buffered records a cursor's gap needs replayed.

use super::{Buffered, EnvState, FastMap, FastSet, FeedFilter, ReplayCursor, ReplayFrom};
use crate::changes::ChangeRecord;

impl EnvState {
    /// The sequence through which every record of the environment was routed (the records of
    /// batches still in flight excluded).
    fn routed_through(&self) -> u64 {
        match self.in_flight.keys().next() {
            Some(first) => first - 1,
            None => self.last_seq,
        }
    }

    /// The replay cursor a response built now may hand out (`epoch` 0 until the subscription is
    /// confirmed).
    pub(super) fn cursor(&self, instance: u64) -> ReplayCursor {
        ReplayCursor {
            epoch: if self.active { self.epoch } else { 0 },
            seq: self.routed_through(),
            instance,
            wall_ms: crate::clock::now_ms(),
        }
    }

    /// Where the buffer can replay `cursor`'s gap from, if it covers it.
    pub(super) fn replay_from(
        &self,
        cursor: &ReplayCursor,
        instance: u64,
        hop_margin_ms: i64,
    ) -> Option<ReplayFrom> {
        if !self.active || cursor.epoch == 0 {
            return None;
        }
        if cursor.instance == instance {
            return (cursor.epoch == self.epoch && self.buffer.covers(cursor.seq))
                .then_some(ReplayFrom::Seq(cursor.seq));
        }
        let from = cursor.wall_ms - hop_margin_ms;
        (self.active_since_wall_ms <= from && self.buffer.covers_wall(from))
            .then_some(ReplayFrom::Wall(from))
    }

    /// The buffered records `filter` is a candidate for, from `from` (everything buffered when
    /// `None`).
    pub(super) fn replay_candidates(
        &self,
        from: Option<&ReplayFrom>,
        filter: &FeedFilter,
    ) -> Vec<Buffered> {
        let pick = |b: &&Buffered| filter.is_candidate(&b.record);
        match from {
            Some(ReplayFrom::Seq(seq)) => self.buffer.since(*seq).filter(pick).cloned().collect(),
            Some(ReplayFrom::Wall(ms)) => {
                self.buffer.since_wall(*ms).filter(pick).cloned().collect()
            }
            None => self.buffer.since(0).filter(pick).cloned().collect(),
        }
    }

    /// Adds feed `id` to the index under what `filter` watches.
    pub(super) fn index(&mut self, id: u64, filter: &FeedFilter) {
        match filter {
            FeedFilter::Run { run_id } => {
                self.by_run.entry(run_id.clone()).or_default().insert(id);
            }
            FeedFilter::Batch { batch_id } => {
                self.by_batch
                    .entry(batch_id.clone())
                    .or_default()
                    .insert(id);
                self.batch_feeds.insert(id);
            }
            FeedFilter::Tag { tags, .. } => {
                self.tag_feeds.insert(id);
                if tags.is_empty() {
                    self.unfiltered_tag_feeds.insert(id);
                }
                for tag in tags.iter() {
                    self.by_tag.entry(tag.clone()).or_default().insert(id);
                }
            }
        }
    }

    /// Removes feed `id` from the index (the reverse of [`EnvState::index`]).
    pub(super) fn deindex(&mut self, id: u64, filter: &FeedFilter) {
        fn remove<K: std::hash::Hash + Eq>(index: &mut FastMap<K, FastSet<u64>>, key: &K, id: u64) {
            if let Some(set) = index.get_mut(key) {
                set.remove(&id);
                if set.is_empty() {
                    index.remove(key);
                }
            }
        }
        match filter {
            FeedFilter::Run { run_id } => remove(&mut self.by_run, run_id, id),
            FeedFilter::Batch { batch_id } => {
                remove(&mut self.by_batch, batch_id, id);
                self.batch_feeds.remove(&id);
            }
            FeedFilter::Tag { tags, .. } => {
                self.tag_feeds.remove(&id);
                self.unfiltered_tag_feeds.remove(&id);
                for tag in tags.iter() {
                    remove(&mut self.by_tag, tag, id);
                }
            }
        }
    }

    /// Feed ids that are candidates for `record` (deduplicated).
    pub(super) fn candidates(&self, record: &ChangeRecord) -> FastSet<u64> {
        let mut out = FastSet::default();
        if let Some(ids) = self.by_run.get(&record.run_id) {
            out.extend(ids);
        }
        match (&record.batch_id, &record.tags) {
            (Some(batch), _) => {
                if let Some(ids) = self.by_batch.get(batch) {
                    out.extend(ids);
                }
            }
            (None, None) => out.extend(&self.batch_feeds),
            (None, Some(_)) => {}
        }
        match &record.tags {
            Some(tags) => {
                for tag in tags {
                    if let Some(ids) = self.by_tag.get(tag) {
                        out.extend(ids);
                    }
                }
                out.extend(&self.unfiltered_tag_feeds);
            }
            None => out.extend(&self.tag_feeds),
        }
        out
    }
}
