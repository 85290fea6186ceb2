//! The read-your-writes gate: a batch of change records is hydrated only once the read
//! replica has applied the commits the records announce (trigger.dev fix 954ee5c;
//! docs/behaviours.md §1.7–1.8), bounded by `replica_lag.max_delay_ms` so a sick replica costs freshness, never
//! liveness.
//!
//! Better than the reference (docs/behaviours.md §4 items 3 and 6): where the replica reports its replay
//! position, the gate waits on WAL positions, not on clocks. A record is published after its
//! commit, so a primary position read after the batch arrived is at or past every announced
//! commit; when the replica's replay position passes it, every announced row — including a run
//! created by a record without `updatedAtMs` — is visible. Two cheap probe queries per busy
//! moment, shared by every batch that needs them ([`SharedRead`]).
//!
//! When positions are unavailable (a replica that cannot report them, e.g. Aurora readers), the
//! gate falls back to the reference's clock rule: wait until `updatedAtMs` (or the arrival time
//! for records without one) + estimated lag + margin. Clock assumptions that remain there: the
//! writer's clock (which stamped `updatedAt`) and ours agree to within the margin; the estimate
//! comes from observed stale hydrates (tripwire) and the default.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::{FutureExt, Shared};
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::changes::ChangeRecord;
use crate::config::ReplicaLagConfig;
use crate::store::{Lsn, ReplicaProbe};

type ProbeFuture = Shared<Pin<Box<dyn Future<Output = Result<Option<Lsn>, String>> + Send>>>;

/// One probe query shared by every caller that needs a reading taken after a given instant.
#[derive(Default)]
struct SharedRead {
    latest: Mutex<Option<(Instant, ProbeFuture)>>,
}

impl SharedRead {
    /// A reading whose query started at or after `after` (joining one in flight or done, or
    /// starting one).
    async fn read_after<F>(&self, after: Instant, start: F) -> Result<Option<Lsn>, String>
    where
        F: FnOnce() -> Pin<Box<dyn Future<Output = Result<Option<Lsn>, String>> + Send>>,
    {
        let fut = {
            let mut latest = self.latest.lock();
            match &*latest {
                Some((started, fut)) if *started >= after => fut.clone(),
                _ => {
                    let fut = start().shared();
                    *latest = Some((Instant::now(), fut.clone()));
                    fut
                }
            }
        };
        fut.await
    }
}

/// How a gate wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateOutcome {
    /// The replica replayed past the batch's primary position: every announced row is visible.
    Applied,
    /// Reads are not served by a replica in recovery (none is, or it was promoted and reads go
    /// to the primary): nothing to wait for.
    NoReplica,
    /// `max_delay_ms` passed first: hydrate anyway (rows may be stale; the tripwire decides).
    GaveUp,
    /// Positions unavailable: waited by the clock rule.
    Clock,
}

/// Lag estimate (ms): the maximum sample inside the window, floored by recent stale
/// observations (LAG-01..06).
struct Estimator {
    /// Samples inside `replica_lag.window_ms`, one per sample interval: older ones are pruned
    /// as each is added, so the window bounds it; nothing overflows.
    samples: VecDeque<(Instant, u64)>,
    floor: Option<(Instant, u64)>,
}

/// The gate. Shared by the router's batch tasks.
pub struct Gate {
    probe: Arc<dyn ReplicaProbe>,
    cfg: ReplicaLagConfig,
    primary: SharedRead,
    replica: SharedRead,
    estimator: Mutex<Estimator>,
    /// Positions failed once: use the clock rule from now on.
    clock_mode: AtomicBool,
    /// Waits that ended [`GateOutcome::GaveUp`].
    pub gave_up: AtomicU64,
    /// Waits that ended [`GateOutcome::Applied`] after actually waiting (replica was behind).
    pub waited: AtomicU64,
}

/// Poll interval of the replica's replay position while a batch waits, ms.
const REPLAY_POLL: Duration = Duration::from_millis(3);
/// Accepted lag samples are clamped to this (LAG-04), ms.
const MAX_LAG_SAMPLE_MS: u64 = 60_000;

impl Gate {
    /// A gate over `probe` with the `[replica_lag]` settings.
    pub fn new(probe: Arc<dyn ReplicaProbe>, cfg: ReplicaLagConfig) -> Gate {
        Gate {
            probe,
            cfg,
            primary: SharedRead::default(),
            replica: SharedRead::default(),
            estimator: Mutex::new(Estimator {
                samples: VecDeque::new(),
                floor: None,
            }),
            clock_mode: AtomicBool::new(false),
            gave_up: AtomicU64::new(0),
            waited: AtomicU64::new(0),
        }
    }

    /// The longest the gate holds a batch (`replica_lag.max_delay_ms`).
    pub fn max_delay(&self) -> Duration {
        Duration::from_millis(self.cfg.max_delay_ms)
    }

    /// Waits until the replica has applied every commit announced by `records`, which arrived
    /// (all of them) before `arrived`. Never longer than `max_delay_ms` after `arrived`.
    pub async fn wait(&self, records: &[ChangeRecord], arrived: Instant) -> GateOutcome {
        if self.probe.reads_primary() {
            return GateOutcome::NoReplica;
        }
        let deadline = arrived + self.max_delay();
        if !self.clock_mode.load(Ordering::Relaxed) {
            match self.wait_positions(arrived, deadline).await {
                Ok(outcome) => return outcome,
                Err(err) => {
                    if !self.clock_mode.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %err, "replica positions unavailable; the read-your-writes gate falls back to the clock rule");
                    }
                }
            }
        }
        let now_ms = crate::clock::now_ms();
        let lag = i64::try_from(self.estimate_ms() + self.cfg.margin_ms).unwrap_or(i64::MAX / 4);
        let elapsed = i64::try_from(arrived.elapsed().as_millis()).unwrap_or(0);
        let arrival_ms = now_ms - elapsed;
        let safe_at = records
            .iter()
            .map(|r| r.updated_at_ms.unwrap_or(arrival_ms))
            .max()
            .unwrap_or(arrival_ms)
            + lag;
        let delay = u64::try_from(safe_at - now_ms).unwrap_or(0);
        let until = (Instant::now() + Duration::from_millis(delay)).min(deadline);
        tokio::time::sleep_until(until).await;
        GateOutcome::Clock
    }

    async fn wait_positions(
        &self,
        arrived: Instant,
        deadline: Instant,
    ) -> Result<GateOutcome, String> {
        let probe = self.probe.clone();
        let target = self
            .primary
            .read_after(arrived, move || {
                Box::pin(async move {
                    probe
                        .primary_lsn()
                        .await
                        .map(Some)
                        .map_err(|e| e.to_string())
                })
            })
            .await?
            .unwrap_or(0);
        let mut waited = false;
        loop {
            let probe = self.probe.clone();
            let replayed = self
                .replica
                .read_after(Instant::now(), move || {
                    Box::pin(
                        async move { probe.replica_replay_lsn().await.map_err(|e| e.to_string()) },
                    )
                })
                .await?;
            let Some(replayed) = replayed else {
                return Ok(GateOutcome::NoReplica);
            };
            if replayed >= target {
                let lag_ms = u64::try_from(arrived.elapsed().as_millis()).unwrap_or(u64::MAX);
                self.sample(lag_ms);
                if waited {
                    self.waited.fetch_add(1, Ordering::Relaxed);
                }
                return Ok(GateOutcome::Applied);
            }
            if Instant::now() >= deadline {
                self.gave_up.fetch_add(1, Ordering::Relaxed);
                return Ok(GateOutcome::GaveUp);
            }
            waited = true;
            tokio::time::sleep(REPLAY_POLL.min(deadline.saturating_duration_since(Instant::now())))
                .await;
        }
    }

    fn sample(&self, lag_ms: u64) {
        let now = Instant::now();
        let window = Duration::from_millis(self.cfg.window_ms);
        let mut est = self.estimator.lock();
        est.samples.push_back((now, lag_ms.min(MAX_LAG_SAMPLE_MS)));
        while est
            .samples
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > window)
        {
            est.samples.pop_front();
        }
    }

    /// A hydrate provably read this far (ms) behind the primary (stale tripwire): widens the
    /// estimate at once and floors it for `observed_floor_ttl_ms` (LAG-04..06).
    pub fn observe_stale(&self, lag_ms: u64) {
        let lag_ms = lag_ms.min(MAX_LAG_SAMPLE_MS);
        self.sample(lag_ms);
        let now = Instant::now();
        let ttl = Duration::from_millis(self.cfg.observed_floor_ttl_ms);
        let mut est = self.estimator.lock();
        let keep = est
            .floor
            .is_some_and(|(at, v)| now.saturating_duration_since(at) <= ttl && v >= lag_ms);
        if !keep {
            est.floor = Some((now, lag_ms));
        }
    }

    /// The current lag estimate, ms: max sample in the window, else the default; never below
    /// a live stale-observation floor.
    pub fn estimate_ms(&self) -> u64 {
        let now = Instant::now();
        let window = Duration::from_millis(self.cfg.window_ms);
        let ttl = Duration::from_millis(self.cfg.observed_floor_ttl_ms);
        let est = self.estimator.lock();
        let windowed = est
            .samples
            .iter()
            .filter(|(t, _)| now.saturating_duration_since(*t) <= window)
            .map(|(_, v)| *v)
            .max()
            .unwrap_or(self.cfg.default_ms);
        let floor = est
            .floor
            .filter(|(at, _)| now.saturating_duration_since(*at) <= ttl)
            .map(|(_, v)| v)
            .unwrap_or(0);
        windowed.max(floor)
    }

    /// Delay before re-hydrating rows the tripwire found stale: max(25 ms, min(estimate +
    /// margin, max delay)) (GATE-05).
    pub fn retry_delay(&self) -> Duration {
        let ms = (self.estimate_ms() + self.cfg.margin_ms)
            .min(self.cfg.max_delay_ms)
            .max(25);
        Duration::from_millis(ms)
    }

    /// Re-hydrate attempts before stale rows are delivered anyway.
    pub fn retries(&self) -> u32 {
        self.cfg.stale_hydrate_retries
    }

    /// How long after a record's watermark echo passes keep re-hydrating rows delivered stale
    /// (10 × max delay, GATE-09).
    pub fn echo_horizon(&self) -> Duration {
        self.max_delay() * 10
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use async_trait::async_trait;

    use super::*;
    use crate::store::{Found, StoreError};

    struct FakeProbe {
        primary: AtomicU64,
        replica: AtomicU64,
        primary_reads: AtomicU64,
        fail: bool,
        reads_primary: AtomicBool,
    }

    #[async_trait]
    impl ReplicaProbe for FakeProbe {
        async fn primary_lsn(&self) -> Result<Lsn, StoreError> {
            self.primary_reads.fetch_add(1, Ordering::Relaxed);
            if self.fail {
                return Err(StoreError {
                    op: "primary_lsn",
                    source: sqlx::Error::PoolTimedOut,
                });
            }
            Ok(self.primary.load(Ordering::Relaxed))
        }
        async fn replica_replay_lsn(&self) -> Found<Lsn> {
            Ok(Some(self.replica.load(Ordering::Relaxed)))
        }
        fn reads_primary(&self) -> bool {
            self.reads_primary.load(Ordering::Relaxed)
        }
    }

    fn cfg() -> ReplicaLagConfig {
        ReplicaLagConfig {
            max_delay_ms: 200,
            ..ReplicaLagConfig::default()
        }
    }

    fn probe(primary: u64, replica: u64, fail: bool) -> Arc<FakeProbe> {
        Arc::new(FakeProbe {
            primary: AtomicU64::new(primary),
            replica: AtomicU64::new(replica),
            primary_reads: AtomicU64::new(0),
            fail,
            reads_primary: AtomicBool::new(false),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn gate_waits_until_the_replica_replays_past_the_primary_position() {
        let p = probe(100, 50, false);
        let gate = Arc::new(Gate::new(p.clone(), cfg()));
        let g = gate.clone();
        let waiter = tokio::spawn(async move { g.wait(&[], Instant::now()).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "replica behind: still waiting");
        p.replica.store(100, Ordering::Relaxed);
        let outcome = tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("gate wait ends")
            .expect("join");
        assert_eq!(outcome, GateOutcome::Applied);
        assert_eq!(gate.waited.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn gate_gives_up_at_max_delay_liveness_over_freshness() {
        let gate = Gate::new(probe(100, 0, false), cfg());
        let t0 = Instant::now();
        assert_eq!(gate.wait(&[], t0).await, GateOutcome::GaveUp);
        assert!(t0.elapsed() >= Duration::from_millis(200));
        assert!(t0.elapsed() < Duration::from_millis(600));
    }

    #[tokio::test]
    async fn concurrent_batches_share_one_primary_position_read() {
        let p = probe(10, 10, false);
        let gate = Arc::new(Gate::new(p.clone(), cfg()));
        let arrived = Instant::now();
        let waits = (0..50).map(|_| {
            let g = gate.clone();
            async move { g.wait(&[], arrived).await }
        });
        let outcomes = futures::future::join_all(waits).await;
        assert!(outcomes.iter().all(|o| *o == GateOutcome::Applied));
        assert_eq!(p.primary_reads.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn gate_01_unavailable_positions_fall_back_to_the_clock_rule() {
        let gate = Gate::new(
            probe(0, 0, true),
            ReplicaLagConfig {
                default_ms: 40,
                margin_ms: 10,
                ..cfg()
            },
        );
        let record = ChangeRecord {
            run_id: "r".into(),
            updated_at_ms: Some(crate::clock::now_ms()),
            ..ChangeRecord::default()
        };
        let t0 = Instant::now();
        assert_eq!(
            gate.wait(std::slice::from_ref(&record), t0).await,
            GateOutcome::Clock
        );
        assert!(
            t0.elapsed() >= Duration::from_millis(40),
            "fresh watermark waits lag + margin"
        );
        // GATE-03: an old watermark does not wait.
        let old = ChangeRecord {
            updated_at_ms: Some(crate::clock::now_ms() - 5_000),
            ..record
        };
        let t1 = Instant::now();
        gate.wait(&[old], t1).await;
        assert!(t1.elapsed() < Duration::from_millis(30));
    }

    /// Reads on the primary (a promoted replica bypassed) wait for nothing, in the clock mode
    /// too; once reads are back on a replica in recovery, the gate waits for it again.
    #[tokio::test]
    async fn with_reads_on_the_primary_the_gate_does_not_wait() {
        let p = probe(100, 0, true);
        p.reads_primary.store(true, Ordering::Relaxed);
        let gate = Gate::new(p.clone(), cfg());
        let record = ChangeRecord {
            run_id: "r".into(),
            updated_at_ms: Some(crate::clock::now_ms()),
            ..ChangeRecord::default()
        };
        let t0 = Instant::now();
        let outcome = gate.wait(std::slice::from_ref(&record), t0).await;
        assert_eq!(outcome, GateOutcome::NoReplica);
        assert_eq!(
            p.primary_reads.load(Ordering::Relaxed),
            0,
            "no probe needed"
        );
        p.reads_primary.store(false, Ordering::Relaxed);
        assert_eq!(
            gate.wait(std::slice::from_ref(&record), Instant::now())
                .await,
            GateOutcome::Clock,
            "back on the replica: the gate waits again"
        );
    }

    #[test]
    fn lag_01_05_estimate_default_window_max_and_observed_floor() {
        let gate = Gate::new(
            probe(0, 0, false),
            ReplicaLagConfig {
                default_ms: 42,
                ..cfg()
            },
        );
        assert_eq!(gate.estimate_ms(), 42);
        gate.sample(10);
        gate.sample(60);
        gate.sample(20);
        assert_eq!(gate.estimate_ms(), 60);
        gate.observe_stale(250);
        assert_eq!(gate.estimate_ms(), 250);
        gate.observe_stale(100);
        assert_eq!(
            gate.estimate_ms(),
            250,
            "a smaller observation does not lower an active floor"
        );
        assert_eq!(
            gate.retry_delay(),
            Duration::from_millis(200),
            "capped at max delay"
        );
    }
}
