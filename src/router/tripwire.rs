//! The stale tripwire, beside the read-your-writes gate ([`super::gate`]): after a batch is
//! hydrated, rows older than their record's watermark (or missing although a record vouches for
//! the run) are withheld and re-hydrated shortly, then delivered with echo passes if the
//! replica never catches up (docs/behaviours.md GATE-04..09, done better per §4 item 3).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{GateOutcome, Inner};
use crate::cache::FastMap;
use crate::changes::ChangeRecord;
use crate::protocol::{ColumnSet, EnvId, RunId, SerializedRow};

impl Inner {
    /// Decides which runs of a hydrated batch are stale, schedules their re-hydrate, and
    /// returns the ones to withhold now (GATE-04..09, better per docs/behaviours.md §4 item 3).
    ///
    /// A run is stale when a hydrated row is older than the newest watermark of its records, or
    /// when no row came back although a record vouches for the run: a watermark, or — when the
    /// gate gave up before the replica caught up — any record (a just-created run that is not
    /// replicated yet must not be lost; the reference drops it silently).
    pub(super) fn tripwire(
        self: &Arc<Self>,
        env_id: &EnvId,
        records: &[ChangeRecord],
        hydrated: &FastMap<ColumnSet, Option<FastMap<RunId, SerializedRow>>>,
        outcome: Option<GateOutcome>,
        attempt: u32,
    ) -> HashSet<RunId> {
        let Some(gate) = self.gate.clone() else {
            return HashSet::new();
        };
        let unsure =
            matches!(outcome, Some(GateOutcome::GaveUp | GateOutcome::Clock)) || attempt > 0;
        let now_ms = crate::clock::now_ms();
        let mut stale: FastMap<RunId, ChangeRecord> = FastMap::default();
        for record in records {
            let rows: Vec<Option<&SerializedRow>> = hydrated
                .values()
                .flatten()
                .map(|rows| rows.get(&record.run_id))
                .collect();
            if rows.is_empty() {
                continue; // every hydrate of this batch failed: the feeds re-check instead
            }
            let is_stale = match record.updated_at_ms {
                Some(wm) => rows
                    .iter()
                    .any(|r| r.is_none_or(|row| row.meta.updated_at_ms < wm)),
                None => unsure && rows.iter().all(Option::is_none),
            };
            if is_stale {
                if let Some(wm) = record.updated_at_ms {
                    gate.observe_stale(u64::try_from(now_ms - wm).unwrap_or(0));
                }
                stale
                    .entry(record.run_id.clone())
                    .and_modify(|r| r.merge_from(record.clone()))
                    .or_insert_with(|| record.clone());
            }
        }
        if attempt > 0 && attempt <= gate.retries() {
            let recovered = records
                .iter()
                .filter(|r| !stale.contains_key(&r.run_id))
                .count() as u64;
            self.stats
                .stale_recovered
                .fetch_add(recovered, Ordering::Relaxed);
        }
        if stale.is_empty() {
            return HashSet::new();
        }
        let withhold = attempt < gate.retries();
        if attempt == gate.retries() {
            self.stats
                .stale_gave_up
                .fetch_add(stale.len() as u64, Ordering::Relaxed);
            tracing::warn!(%env_id,
                runs = stale.len(),
                "rows still stale after retries; delivering them (echo passes follow)"
            );
        }
        // Retry while within the budget; afterwards echo (deliver-and-recheck) while the change
        // is recent, so the fresh version still arrives once the replica catches up.
        let horizon_ms = i64::try_from(gate.echo_horizon().as_millis()).unwrap_or(i64::MAX);
        let newest = stale.values().filter_map(|r| r.updated_at_ms).max();
        let within_horizon = match newest {
            Some(wm) => now_ms - wm < horizon_ms,
            None => attempt < gate.retries() + 10,
        };
        if withhold || within_horizon {
            let retry: Vec<ChangeRecord> = stale.values().cloned().collect();
            let delay = gate.retry_delay();
            let inner = self.clone();
            let env_id = env_id.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                inner.rehydrate(&env_id, retry, attempt + 1);
            });
        }
        if withhold {
            stale.into_keys().collect()
        } else {
            HashSet::new()
        }
    }
}
