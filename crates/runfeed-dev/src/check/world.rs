//! The writers: environments, runs and batches written like trigger.dev writes them, then a
//! seeded stream of writes — status transitions up to a final status, metadata updates, tags
//! added, new runs, batch members, runs of another environment — each committed to Postgres,
//! logged with its commit time, and announced by a change record (`docs/trigger-dev.md` §5)
//! that is, at set rates, lost, sent twice or sent late.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::PgPool;

use super::io::{Publisher, Record};
use super::model::{
    BatchLog, Clock, EnvLog, Fate, History, Ms, Publish, RunLog, Version, WriteOp, FINAL_STATUSES,
};
use crate::fixtures::{self, DemoEnv, RunSpec, RunUpdate};

/// Tags the writers use (runs carry one or two at creation; more are added later).
pub const TAG_POOL: &[&str] = &["t0", "t1", "t2", "t3"];

/// The tag of the bulk run ([`WriterConfig::bulk`]); no reader's tag feed follows it.
pub const BULK_TAG: &str = "bulk";

/// A run to create.
struct NewRun {
    env: usize,
    batch: Option<usize>,
    created_at_ms: Option<i64>,
    tags: Vec<String>,
    publish: bool,
}

/// Non-final statuses a run moves through.
const LIVE_STATUSES: &[&str] = &[
    "EXECUTING",
    "WAITING_TO_RESUME",
    "RETRYING_AFTER_FAILURE",
    "PAUSED",
    "DEQUEUED",
];

/// How the writers behave.
#[derive(Clone, Debug)]
pub struct WriterConfig {
    /// Writes per second over all writers.
    pub rate: f64,
    /// Concurrent writer tasks.
    pub writers: usize,
    /// Runs of environment A at the start.
    pub runs: usize,
    /// Share of publishes lost / sent twice / sent late.
    pub lose: f64,
    pub duplicate: f64,
    pub late: f64,
    /// A late publish is sent this much after the commit, ms (uniform in the range).
    pub late_ms: (u64, u64),
    /// Share of records published without `tags` (partial records).
    pub partial: f64,
    /// Share of environment B writes that also publish a misrouted record on A's channel.
    pub misroute: f64,
    /// The bulk run: one run of environment A (tag `bulk`, which no tag feed follows) whose
    /// versions carry a large `output`, written by a writer of its own, so that an SSE reader
    /// that stops reading it fills the server's buffers within seconds. `None`: no bulk run.
    pub bulk: Option<BulkConfig>,
}

/// The bulk run's writes.
#[derive(Clone, Copy, Debug)]
pub struct BulkConfig {
    /// `output` size of each version, KiB.
    pub kb: usize,
    /// Writes per second.
    pub rate: f64,
}

/// Shared state of the writers.
pub struct World {
    pub pool: PgPool,
    /// `[A, B]`.
    pub envs: Vec<DemoEnv>,
    pub history: Arc<Mutex<History>>,
    pub clock: Clock,
    publisher: Arc<Publisher>,
    cfg: WriterConfig,
    /// Per-run write locks (a run's versions are committed and logged in order).
    locks: Mutex<Vec<Arc<tokio::sync::Mutex<()>>>>,
    /// Late publishes still pending.
    late: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// The bulk run (index into [`History::runs`]), when configured.
    pub bulk_run: Option<usize>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a write needs to know about its run.
#[derive(Clone, Debug)]
struct RunRef {
    id: String,
    env: usize,
    batch: Option<String>,
    tags: Vec<String>,
    status: String,
    ck: Option<u32>,
    metadata: String,
    next_ver: u32,
}

impl World {
    /// Creates environments A and B, their batches (2 in A, 1 in B) and the initial runs.
    ///
    /// # Errors
    /// When a fixture write fails.
    pub async fn create(
        pool: PgPool,
        publisher: Arc<Publisher>,
        clock: Clock,
        cfg: WriterConfig,
        seed: u64,
    ) -> anyhow::Result<World> {
        let a = fixtures::create_env(&pool, "DEVELOPMENT").await?;
        let b = fixtures::create_env(&pool, "PRODUCTION").await?;
        let mut h = History {
            envs: vec![
                EnvLog {
                    id: a.env_id.clone(),
                    label: "A".into(),
                },
                EnvLog {
                    id: b.env_id.clone(),
                    label: "B".into(),
                },
            ],
            ..History::default()
        };
        for env in [0usize, 0, 1] {
            let demo = if env == 0 { &a } else { &b };
            let (id, friendly_id) = fixtures::create_batch(&pool, demo).await?;
            h.batches.push(BatchLog {
                id,
                friendly_id,
                env,
            });
        }
        let mut world = World {
            pool,
            envs: vec![a, b],
            history: Arc::new(Mutex::new(h)),
            clock,
            publisher,
            cfg,
            locks: Mutex::new(Vec::new()),
            late: Mutex::new(Vec::new()),
            bulk_run: None,
        };
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_0001);
        let now = chrono::Utc::now().timestamp_millis();
        for i in 0..world.cfg.runs {
            // Created now, 30 min or 2 h ago: inside or clearly outside the `createdAt` windows
            // the readers use (10m, 1h; none = 24 h).
            let age = match i % 5 {
                3 => 30 * 60_000,
                4 => 2 * 60 * 60_000,
                _ => 0,
            };
            let batch = (i % 3 == 0).then_some(i % 2);
            world
                .create_run(&mut rng, 0, batch, Some(now - age), false)
                .await?;
        }
        for i in 0..4 {
            let batch = (i == 0).then_some(2);
            world.create_run(&mut rng, 1, batch, None, false).await?;
        }
        if world.cfg.bulk.is_some() {
            let tags = vec![BULK_TAG.to_string()];
            world.bulk_run = Some(world.create_run_with(&mut rng, 0, tags, false).await?);
        }
        Ok(world)
    }

    /// Runs `writers` tasks until `until` (on the check's clock); waits for late publishes.
    pub async fn write_until(self: &Arc<Self>, until: Ms, seed: u64) {
        let mut tasks = Vec::new();
        for w in 0..self.cfg.writers.max(1) {
            let world = self.clone();
            let interval =
                Duration::from_secs_f64(self.cfg.writers.max(1) as f64 / self.cfg.rate.max(0.01));
            tasks.push(tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(seed ^ (0x717e_0000 + w as u64));
                let mut next = tokio::time::Instant::now();
                while world.clock.now() < until {
                    if let Err(e) = world.write_one(&mut rng).await {
                        eprintln!("check: writer {w}: {e:#}");
                    }
                    // Poisson-ish pacing around the mean interval.
                    let jitter = rng.random_range(0.5..1.5);
                    next += interval.mul_f64(jitter);
                    tokio::time::sleep_until(next).await;
                }
            }));
        }
        if let (Some(bulk), Some(run)) = (self.cfg.bulk, self.bulk_run) {
            let world = self.clone();
            let interval = Duration::from_secs_f64(1.0 / bulk.rate.max(0.01));
            tasks.push(tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(seed ^ 0xb01c);
                let mut next = tokio::time::Instant::now();
                while world.clock.now() < until {
                    if let Err(e) = world.update(&mut rng, run, WriteOp::Output).await {
                        eprintln!("check: bulk writer: {e:#}");
                    }
                    next += interval;
                    tokio::time::sleep_until(next).await;
                }
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
        let pending: Vec<_> = std::mem::take(&mut *lock(&self.late));
        for t in pending {
            let _ = t.await;
        }
        lock(&self.history).writes_stopped = self.clock.now();
    }

    fn run_lock(&self, index: usize) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = lock(&self.locks);
        while locks.len() <= index {
            locks.push(Arc::new(tokio::sync::Mutex::new(())));
        }
        locks[index].clone()
    }

    /// One random write.
    async fn write_one(&self, rng: &mut StdRng) -> anyhow::Result<()> {
        let roll: f64 = rng.random();
        if roll < 0.08 {
            let batch = rng.random_bool(0.4).then(|| rng.random_range(0..2));
            self.create_run(rng, 0, batch, None, true).await?;
            return Ok(());
        }
        if roll < 0.11 {
            let batch = rng.random_bool(0.3).then_some(2);
            self.create_run(rng, 1, batch, None, true).await?;
            return Ok(());
        }
        let env = if roll < 0.2 { 1 } else { 0 };
        let Some(run) = self.pick_run(rng, env) else {
            return Ok(());
        };
        let op_roll: f64 = rng.random();
        let op = if op_roll < 0.5 {
            WriteOp::Status
        } else if op_roll < 0.85 {
            WriteOp::Metadata
        } else {
            WriteOp::AddTag
        };
        self.update(rng, run, op).await
    }

    /// A random run of `env` that is not final yet.
    fn pick_run(&self, rng: &mut StdRng, env: usize) -> Option<usize> {
        let h = lock(&self.history);
        let open: Vec<usize> = h
            .runs
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                r.env == env && r.last().is_some_and(|v| !v.is_final()) && self.bulk_run != Some(*i)
            })
            .map(|(i, _)| i)
            .collect();
        if open.is_empty() {
            return None;
        }
        Some(open[rng.random_range(0..open.len())])
    }

    fn run_ref(&self, index: usize) -> Option<RunRef> {
        let h = lock(&self.history);
        let r = h.runs.get(index)?;
        let last = r.last()?;
        Some(RunRef {
            id: r.id.clone(),
            env: r.env,
            batch: r.batch.map(|b| h.batches[b].id.clone()),
            tags: last.tags.clone(),
            status: last.status.clone(),
            ck: last.ck,
            metadata: last.metadata.clone(),
            next_ver: r.versions.len() as u32,
        })
    }

    async fn create_run(
        &self,
        rng: &mut StdRng,
        env: usize,
        batch: Option<usize>,
        created_at_ms: Option<i64>,
        publish: bool,
    ) -> anyhow::Result<usize> {
        let n = rng.random_range(1..=2);
        let mut tags: Vec<String> = Vec::new();
        while tags.len() < n {
            let t = TAG_POOL[rng.random_range(0..TAG_POOL.len())].to_string();
            if !tags.contains(&t) {
                tags.push(t);
            }
        }
        self.create_run_in(
            rng,
            NewRun {
                env,
                batch,
                created_at_ms,
                tags,
                publish,
            },
        )
        .await
    }

    /// A set-up run of `env` with exactly `tags`, created now, in no batch.
    async fn create_run_with(
        &self,
        rng: &mut StdRng,
        env: usize,
        tags: Vec<String>,
        publish: bool,
    ) -> anyhow::Result<usize> {
        self.create_run_in(
            rng,
            NewRun {
                env,
                batch: None,
                created_at_ms: None,
                tags,
                publish,
            },
        )
        .await
    }

    async fn create_run_in(&self, rng: &mut StdRng, new: NewRun) -> anyhow::Result<usize> {
        let NewRun {
            env,
            batch,
            created_at_ms,
            tags,
            publish,
        } = new;
        let metadata = format!("{{\"ck\":0,\"n\":{}}}", rng.random_range(0..1_000_000));
        let batch_id = batch.map(|b| lock(&self.history).batches[b].id.clone());
        let spec = RunSpec {
            tags: Some(tags.clone()),
            batch_id: batch_id.clone(),
            created_at_ms,
            metadata: Some(metadata.clone()),
            ..RunSpec::default()
        };
        let started = self.clock.now();
        let created = fixtures::create_run(&self.pool, &self.envs[env], spec).await?;
        let committed = self.clock.now();
        let index = {
            let mut h = lock(&self.history);
            h.add_run(RunLog {
                id: created.id.clone(),
                friendly_id: created.friendly_id.clone(),
                env,
                batch,
                created_at_ms: created.created_at_ms,
                versions: vec![Version {
                    ver: 0,
                    updated_at_ms: created.updated_at_ms,
                    op: WriteOp::Create,
                    status: "PENDING".into(),
                    tags: tags.clone(),
                    metadata,
                    ck: Some(0),
                    commit_started: started,
                    committed,
                    fate: Fate::Normal,
                    publishes: Vec::new(),
                }],
            })
        };
        // The run-engine bus's runCreated carries no watermark (`docs/trigger-dev.md` §5).
        let record = Record {
            run_id: created.id,
            env_id: self.envs[env].env_id.clone(),
            tags: Some(tags),
            batch_id,
            updated_at_ms: rng.random_bool(0.5).then_some(created.updated_at_ms),
        };
        if publish {
            self.announce(rng, index, 0, record).await;
        } else {
            // Set-up runs: published once, before any reader starts.
            let at_ok = self.publisher.publish(&record).await;
            self.log_publish(index, 0, at_ok, &record, Fate::Normal);
        }
        Ok(index)
    }

    async fn update(&self, rng: &mut StdRng, index: usize, op: WriteOp) -> anyhow::Result<()> {
        let guard = self.run_lock(index);
        let _g = guard.lock().await;
        let Some(run) = self.run_ref(index) else {
            return Ok(());
        };
        if FINAL_STATUSES.contains(&run.status.as_str()) {
            return Ok(());
        }
        let mut set = RunUpdate::default();
        let mut status = run.status.clone();
        let mut tags = run.tags.clone();
        let mut metadata = run.metadata.clone();
        let mut ck = run.ck;
        match op {
            WriteOp::Status => {
                status = if rng.random_bool(0.25) {
                    FINAL_STATUSES[rng.random_range(0..FINAL_STATUSES.len())].to_string()
                } else {
                    LIVE_STATUSES[rng.random_range(0..LIVE_STATUSES.len())].to_string()
                };
                set.status = Some(status.clone());
            }
            WriteOp::Output => {
                metadata = format!("{{\"ck\":{},\"n\":0}}", run.next_ver);
                ck = Some(run.next_ver);
                set.metadata = Some(metadata.clone());
                let kb = self.cfg.bulk.map_or(1, |b| b.kb);
                set.output = Some(format!(
                    "{{\"v\":{},\"pad\":\"{}\"}}",
                    run.next_ver,
                    "x".repeat(kb * 1024)
                ));
            }
            WriteOp::Metadata => {
                metadata = format!(
                    "{{\"ck\":{},\"n\":{}}}",
                    run.next_ver,
                    rng.random_range(0..1_000_000)
                );
                ck = Some(run.next_ver);
                set.metadata = Some(metadata.clone());
            }
            WriteOp::AddTag | WriteOp::Create => {
                let missing: Vec<&&str> = TAG_POOL
                    .iter()
                    .filter(|t| !tags.iter().any(|have| have == **t))
                    .collect();
                if missing.is_empty() {
                    // Nothing to add: a metadata write instead.
                    metadata = format!(
                        "{{\"ck\":{},\"n\":{}}}",
                        run.next_ver,
                        rng.random_range(0..1_000_000)
                    );
                    ck = Some(run.next_ver);
                    set.metadata = Some(metadata.clone());
                } else {
                    tags.push(missing[rng.random_range(0..missing.len())].to_string());
                    set.tags = Some(tags.clone());
                }
            }
        }
        let started = self.clock.now();
        let updated_at_ms = fixtures::update_run(&self.pool, &run.id, set)
            .await
            .with_context(|| format!("update run {}", run.id))?;
        let committed = self.clock.now();
        let ver = {
            let mut h = lock(&self.history);
            let r = &mut h.runs[index];
            let ver = r.versions.len() as u32;
            r.versions.push(Version {
                ver,
                updated_at_ms,
                op,
                status: status.clone(),
                tags: tags.clone(),
                metadata,
                ck,
                commit_started: started,
                committed,
                fate: Fate::Normal,
                publishes: Vec::new(),
            });
            ver
        };
        drop(_g);
        // Lifecycle-bus status records carry no watermark; final statuses, metadata and tag
        // writes do (`docs/trigger-dev.md` §5).
        let watermark = match op {
            WriteOp::Status => FINAL_STATUSES.contains(&status.as_str()) || rng.random_bool(0.5),
            _ => true,
        };
        let record = Record {
            run_id: run.id.clone(),
            env_id: self.envs[run.env].env_id.clone(),
            tags: Some(tags),
            batch_id: run.batch.clone(),
            updated_at_ms: watermark.then_some(updated_at_ms),
        };
        if run.env == 1 && rng.random_bool(self.cfg.misroute) {
            // A record naming B's run on A's channel: must never surface on A's feeds.
            let mut misrouted = record.clone();
            misrouted.env_id = self.envs[0].env_id.clone();
            let _ = self.publisher.publish(&misrouted).await;
        }
        self.announce(rng, index, ver, record).await;
        Ok(())
    }

    /// Publishes `record` for version `ver` of run `index` with a random fate.
    async fn announce(&self, rng: &mut StdRng, index: usize, ver: u32, mut record: Record) {
        if rng.random_bool(self.cfg.partial) {
            record.tags = None;
        }
        let roll: f64 = rng.random();
        let fate = if roll < self.cfg.lose {
            Fate::Lost
        } else if roll < self.cfg.lose + self.cfg.duplicate {
            Fate::Duplicated
        } else if roll < self.cfg.lose + self.cfg.duplicate + self.cfg.late {
            Fate::Late
        } else {
            Fate::Normal
        };
        match fate {
            Fate::Lost => self.set_fate(index, ver, Fate::Lost),
            Fate::Normal => {
                let result = self.publisher.publish(&record).await;
                self.log_publish(index, ver, result, &record, fate);
            }
            Fate::Duplicated => {
                let result = self.publisher.publish(&record).await;
                self.log_publish(index, ver, result, &record, fate);
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..50))).await;
                let result = self.publisher.publish(&record).await;
                self.log_publish(index, ver, result, &record, fate);
            }
            Fate::Late => {
                self.set_fate(index, ver, Fate::Late);
                let delay = Duration::from_millis(
                    rng.random_range(self.cfg.late_ms.0..=self.cfg.late_ms.1),
                );
                let publisher = self.publisher.clone();
                let history = self.history.clone();
                let clock = self.clock;
                let task = tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let result = publisher.publish(&record).await;
                    push_publish(&history, clock, index, ver, result, &record, Fate::Late);
                });
                lock(&self.late).push(task);
            }
        }
    }

    fn set_fate(&self, index: usize, ver: u32, fate: Fate) {
        if let Some(v) = lock(&self.history).runs[index]
            .versions
            .get_mut(ver as usize)
        {
            v.fate = fate;
        }
    }

    fn log_publish(
        &self,
        index: usize,
        ver: u32,
        result: anyhow::Result<u64>,
        record: &Record,
        fate: Fate,
    ) {
        push_publish(&self.history, self.clock, index, ver, result, record, fate);
    }

    /// The final `"updatedAt"` of every logged run, read from the database, compared with the
    /// log (a mismatch means the log is wrong, not the server).
    ///
    /// # Errors
    /// When a query fails or the database disagrees with the log.
    pub async fn verify_log(&self) -> anyhow::Result<()> {
        let expected: Vec<(String, i64)> = lock(&self.history)
            .runs
            .iter()
            .filter_map(|r| r.last().map(|v| (r.id.clone(), v.updated_at_ms)))
            .collect();
        for (id, ms) in expected {
            let got: i64 = sqlx::query_scalar(
                r#"SELECT (extract(epoch from "updatedAt") * 1000)::int8 FROM "TaskRun" WHERE id = $1"#,
            )
            .bind(&id)
            .fetch_one(&self.pool)
            .await
            .with_context(|| format!("read run {id}"))?;
            if got != ms {
                anyhow::bail!("the writers' log is wrong: run {id} has updatedAt {got} in the database, {ms} in the log");
            }
        }
        Ok(())
    }
}

fn push_publish(
    history: &Mutex<History>,
    clock: Clock,
    index: usize,
    ver: u32,
    result: anyhow::Result<u64>,
    record: &Record,
    fate: Fate,
) {
    let at = clock.now();
    let mut h = lock(history);
    if let Some(v) = h.runs[index].versions.get_mut(ver as usize) {
        v.fate = fate;
        v.publishes.push(Publish {
            at,
            ok: result.is_ok(),
            receivers: result.as_ref().copied().unwrap_or(0),
            full: record.tags.is_some(),
            watermark: record.updated_at_ms.is_some(),
        });
    }
}
