//! The randomized, fault-injecting delivery checker behind `runfeed-bench check` (CORRECTNESS.md
//! "The checker"), in the spirit of Jepsen and of Electric's client invariants.
//!
//! A check runs for a bounded time against 1–3 `runfeed serve` instances sharing one fresh
//! Postgres database (optionally read through a lagging streaming replica) and one Redis (its
//! own `redis-server`, a given Redis, or a Redis Cluster):
//!
//! - [`world`]: writers commit versions like trigger.dev and publish change records
//!   (`docs/trigger-dev.md` §5), losing, duplicating or delaying some;
//! - [`readers`]: readers follow run, tag and batch feeds with the Rust
//!   [`crate::client::Follower`] and the real npm clients, hopping between instances,
//!   dropping responses, aborting and pausing;
//! - faults: Redis restart, pause and freeze, Redis Cluster node restart and primary failover,
//!   replica apply-delay changes, instance restart with SIGTERM while polls are held, reconnect
//!   storms; [`sse`]: slow readers in SSE live mode that stop reading their stream;
//! - [`props`]: the six properties checked per subscription from the writers' log;
//! - [`report`]: figures, violations, and the minimal history of each violation.
//!
//! [`io`] is the only place that uses the `runfeed` library.

pub mod io;
pub mod model;
pub mod procs;
pub mod props;
pub mod readers;
pub mod report;
pub mod sse;
pub mod world;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use model::{Clock, FaultKind, FaultWindow, History};
use procs::{Instance, InstanceConfig, RedisServer, ReplicaControl};
use props::{Bounds, Property};
use report::{Known, Report};

/// `runfeed-bench check`: options (every duration in ms unless named `_s`).
#[derive(Debug, Args, Clone, Serialize)]
pub struct CheckArgs {
    /// Seed of every random choice (printed first; default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Seconds of writes and reader churn (the check then waits for convergence).
    #[arg(long, default_value_t = 30.0)]
    pub seconds: f64,
    /// runfeed instances (1..3) sharing the database and Redis.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=3))]
    pub instances: u8,
    /// The `runfeed` binary.
    #[arg(long, default_value = "target/debug/runfeed")]
    pub runfeed: PathBuf,
    /// Postgres server (admin URL); a fresh database `runfeed_t_<random>` is created on it.
    #[arg(
        long,
        env = "CHECK_PG_ADMIN",
        default_value = "postgres://postgres@127.0.0.1:5432"
    )]
    pub database_url: String,
    /// A lagging streaming replica of that server (e.g. `scripts/replica.sh start --port 5533`
    /// → `postgres://postgres@127.0.0.1:5533/postgres`); instances hydrate from it.
    #[arg(long)]
    pub replica: Option<String>,
    /// Apply delays (ms) the replica-delay fault switches between.
    #[arg(long, value_delimiter = ',', default_value = "50,150,300,500")]
    pub replica_delays_ms: Vec<u64>,
    /// Fresh start with a replica: a version the replica had not applied at a snapshot request
    /// is required in it only when announced this long before the request (the server's
    /// `replica_lag.max_delay_ms`, 1 000; a version the replica had applied is always required).
    #[arg(long, default_value_t = 1_000)]
    pub replica_lag_bound_ms: u64,
    /// Use this (standalone) Redis instead of starting one; disables Redis restarts.
    #[arg(long)]
    pub redis_url: Option<String>,
    /// A Redis Cluster (`redis-cluster://127.0.0.1:7300?node=…`, from
    /// `scripts/redis-cluster.sh start --base-port 7300`): sharded pub/sub.
    #[arg(long)]
    pub redis_cluster: Option<String>,
    /// Reader slots (each runs one subscription at a time).
    #[arg(long, default_value_t = 24)]
    pub readers: usize,
    /// A subscription lasts this long, s (uniform between the two; then the slot starts
    /// another). Shorter lifetimes mean more snapshots.
    #[arg(long, value_delimiter = ',', default_value = "2,12")]
    pub sub_seconds: Vec<f64>,
    /// Share of reader slots that use the real npm clients (`tests/e2e/check-reader.mjs`).
    #[arg(long, default_value_t = 0.1)]
    pub npm_fraction: f64,
    /// Writes per second (all writers together).
    #[arg(long, default_value_t = 20.0)]
    pub write_rate: f64,
    /// Concurrent writers.
    #[arg(long, default_value_t = 3)]
    pub writers: usize,
    /// Runs of environment A at the start.
    #[arg(long, default_value_t = 16)]
    pub runs: usize,
    /// The instances' live hold (`feeds.live_poll_timeout_ms`).
    #[arg(long, default_value_t = 5_000)]
    pub hold_ms: u64,
    /// The instances' `caches.backstop_share_ms` (default: the hold).
    #[arg(long)]
    pub backstop_share_ms: Option<u64>,
    /// Share of publishes lost.
    #[arg(long, default_value_t = 0.02)]
    pub lose_rate: f64,
    /// Share of publishes sent twice.
    #[arg(long, default_value_t = 0.03)]
    pub dup_rate: f64,
    /// Share of publishes sent late (200–1 500 ms after the commit).
    #[arg(long, default_value_t = 0.03)]
    pub late_rate: f64,
    /// Share of records published without tags (partial).
    #[arg(long, default_value_t = 0.05)]
    pub partial_rate: f64,
    /// Per request: hop to another instance.
    #[arg(long, default_value_t = 0.3)]
    pub hop_rate: f64,
    /// Per 200 response: drop it after reading it (the server already sent it).
    #[arg(long, default_value_t = 0.05)]
    pub drop_rate: f64,
    /// Per live poll: abort it while held.
    #[arg(long, default_value_t = 0.05)]
    pub abort_rate: f64,
    /// Per response: pause 0.2–2.5 s before the next poll.
    #[arg(long, default_value_t = 0.05)]
    pub pause_rate: f64,
    /// Per subscription: one request with another feed's handle (must be a 409).
    #[arg(long, default_value_t = 0.1)]
    pub foreign_rate: f64,
    /// Instance restarts (SIGTERM while polls are held).
    #[arg(long, default_value_t = 1)]
    pub instance_restarts: usize,
    /// Restarts of the check's own Redis (ignored with --redis-url / --redis-cluster).
    #[arg(long, default_value_t = 1)]
    pub redis_restarts: usize,
    /// `CLIENT PAUSE` windows of the check's own Redis, each `--redis-fault-ms` (ignored with
    /// --redis-url / --redis-cluster).
    #[arg(long, default_value_t = 0)]
    pub redis_pauses: usize,
    /// SIGSTOP windows of the check's own redis-server, each `--redis-fault-ms` (ignored with
    /// --redis-url / --redis-cluster).
    #[arg(long, default_value_t = 0)]
    pub redis_freezes: usize,
    /// How long a Redis pause or freeze lasts, ms.
    #[arg(long, default_value_t = 3_000)]
    pub redis_fault_ms: u64,
    /// Restarts of a Redis Cluster node (with --redis-cluster).
    #[arg(long, default_value_t = 1)]
    pub cluster_node_restarts: usize,
    /// Primary failovers of the Redis Cluster (with --redis-cluster started with `--replicas
    /// 1`): the master serving environment A's channel is failed over with
    /// `scripts/redis-cluster.sh failover`.
    #[arg(long, default_value_t = 0)]
    pub cluster_failovers: usize,
    /// How a failover happens: `kill` (the master shut down, its replica promoted after the
    /// cluster's node timeout), `takeover` (`CLUSTER FAILOVER TAKEOVER` on its replica), or
    /// `mixed` (a seeded choice per failover).
    #[arg(long, value_enum, default_value = "mixed")]
    pub cluster_failover_mode: FailoverMode,
    /// Reconnect storms: every Rust reader slot with a request or stream open on one instance
    /// drops it and reconnects to another instance within 1 s (as after a deploy).
    #[arg(long, default_value_t = 0)]
    pub storms: usize,
    /// Share of reader slots (after the npm ones) that follow in SSE live mode
    /// (`live_sse=true`) over sockets with a 4 KiB receive buffer: slow readers.
    #[arg(long, default_value_t = 0.0)]
    pub sse_fraction: f64,
    /// Per SSE stream: the reader stops reading it once, within its first 2 s.
    #[arg(long, default_value_t = 0.5)]
    pub sse_stall_rate: f64,
    /// How long an SSE reader stops reading, ms (uniform between the two).
    #[arg(long, value_delimiter = ',', default_value = "300,6000")]
    pub sse_stall_ms: Vec<u64>,
    /// With SSE readers: the instances' `feeds.sse_stall_timeout_ms` (a stream whose client
    /// takes nothing this long with a full queue is ended).
    #[arg(long, default_value_t = 1_000)]
    pub sse_stall_timeout_ms: u64,
    /// With SSE readers: the instances' `feeds.sse_max_duration_ms` (streams end and readers
    /// reconnect at their offset).
    #[arg(long, default_value_t = 10_000)]
    pub sse_max_duration_ms: u64,
    /// With SSE readers: the bulk run's `output` per version, KiB (a stalled stream only ends
    /// once the kernel's buffers, about 3 MiB per loopback connection, are full).
    #[arg(long, default_value_t = 256)]
    pub bulk_kb: usize,
    /// With SSE readers: the bulk run's writes per second.
    #[arg(long, default_value_t = 8.0)]
    pub bulk_rate: f64,
    /// With SSE readers: the share of SSE subscriptions that follow the bulk run.
    #[arg(long, default_value_t = 0.5)]
    pub bulk_share: f64,
    /// Changes of the replica's apply delay (with --replica).
    #[arg(long, default_value_t = 3)]
    pub replica_delay_changes: usize,
    /// No faults at all: every rate and count above is 0.
    #[arg(long)]
    pub no_faults: bool,
    /// Timely: delivery bound, ms.
    #[arg(long, default_value_t = 1_000.0)]
    pub timely_ms: f64,
    /// Timely: share of deliveries within the bound.
    #[arg(long, default_value_t = 0.99)]
    pub timely_quantile: f64,
    /// A property whose violations are known and pinned by an ignored regression test:
    /// `PROPERTY=TEST` (e.g. `fresh-start=tests/it/correctness.rs::a_snapshot_…`); reported as
    /// KNOWN, not failed. Repeatable.
    #[arg(long = "known", value_name = "PROPERTY=TEST")]
    pub known: Vec<String>,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the writers' log and every subscription's log as JSON to this file (for analysis).
    #[arg(long)]
    pub dump: Option<PathBuf>,
    /// Minimal histories printed per property.
    #[arg(long, default_value_t = 2)]
    pub explain: usize,
    /// Where instance and Redis logs go (default `target/check/<seed>`).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Keep the database afterwards.
    #[arg(long)]
    pub keep_db: bool,
    /// The repository root (scripts, node reader).
    #[arg(long, default_value = ".")]
    pub repo: PathBuf,
}

impl CheckArgs {
    /// The defaults of the command line (for tests and the CI run).
    pub fn defaults() -> CheckArgs {
        use clap::Parser;
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            a: CheckArgs,
        }
        P::parse_from(["check"]).a
    }

    fn zero_faults(&mut self) {
        self.lose_rate = 0.0;
        self.dup_rate = 0.0;
        self.late_rate = 0.0;
        self.drop_rate = 0.0;
        self.abort_rate = 0.0;
        self.pause_rate = 0.0;
        self.foreign_rate = 0.0;
        self.instance_restarts = 0;
        self.redis_restarts = 0;
        self.redis_pauses = 0;
        self.redis_freezes = 0;
        self.cluster_node_restarts = 0;
        self.cluster_failovers = 0;
        self.replica_delay_changes = 0;
        self.storms = 0;
        self.sse_stall_rate = 0.0;
    }

    fn parse_known(&self) -> anyhow::Result<Vec<Known>> {
        self.known
            .iter()
            .map(|k| {
                let (p, test) = k.split_once('=').unwrap_or((k.as_str(), "?"));
                let property = Property::parse(p).with_context(|| {
                    format!(
                        "--known {k}: unknown property (one of {})",
                        Property::ALL.map(Property::name).join(", ")
                    )
                })?;
                Ok(Known {
                    property,
                    test: test.to_string(),
                })
            })
            .collect()
    }
}

/// How `--cluster-failovers` fail a master over (`scripts/redis-cluster.sh failover --mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailoverMode {
    /// `SHUTDOWN NOSAVE` on the master; its replica is promoted after the node timeout.
    Kill,
    /// `CLUSTER FAILOVER TAKEOVER` on its replica; no node goes down.
    Takeover,
    /// A seeded choice per failover.
    Mixed,
}

/// Runs a check and prints its report; returns it (and whether it passed in
/// [`Report::passed`]).
///
/// # Errors
/// When the set-up fails (database, Redis, instances); violations are not errors.
pub async fn run(mut args: CheckArgs) -> anyhow::Result<Report> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64 % 1_000_000_000)
            .unwrap_or(1)
    });
    println!("check: seed={seed}");
    if args.no_faults {
        args.zero_faults();
    }
    let known = args.parse_known()?;
    let wall = Instant::now();
    let repo = std::fs::canonicalize(&args.repo).unwrap_or(args.repo.clone());
    let binary = if args.runfeed.is_absolute() {
        args.runfeed.clone()
    } else {
        repo.join(&args.runfeed)
    };
    if !binary.exists() {
        bail!(
            "no runfeed binary at {} (cargo build --bin runfeed, or --runfeed PATH)",
            binary.display()
        );
    }
    let log_dir = args
        .log_dir
        .clone()
        .unwrap_or_else(|| repo.join("target/check").join(seed.to_string()));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("create {}", log_dir.display()))?;

    // Redis: a cluster, a given server, or our own (restartable).
    let mut own_redis = None;
    let (redis_url, cluster) = match (&args.redis_cluster, &args.redis_url) {
        (Some(url), _) => (url.clone(), true),
        (None, Some(url)) => (url.clone(), false),
        (None, None) => {
            let r = RedisServer::start(&log_dir).await?;
            let url = r.url();
            own_redis = Some(r);
            (url, false)
        }
    };
    if own_redis.is_none() {
        args.redis_restarts = 0;
        args.redis_pauses = 0;
        args.redis_freezes = 0;
    }
    if !cluster {
        args.cluster_node_restarts = 0;
        args.cluster_failovers = 0;
    }
    if args.cluster_failovers > 0 {
        let base = args
            .redis_cluster
            .as_deref()
            .and_then(procs::cluster_base_port)
            .context("--cluster-failovers: no port in --redis-cluster")?;
        if procs::cluster_replicas(base).await? == 0 {
            bail!(
                "--cluster-failovers needs replicas: bash scripts/redis-cluster.sh start --base-port {base} --replicas 1"
            );
        }
    }
    if args.replica.is_none() {
        args.replica_delay_changes = 0;
    }

    // Database (and its replica copy).
    let db = crate::fixtures::TestDb::create(&args.database_url)
        .await
        .context("create the check's database")?;
    println!(
        "check: database {} (logs in {})",
        db.name,
        log_dir.display()
    );
    let mut replica_ctl = None;
    let mut replica_url = None;
    let mut original_delay = None;
    if let Some(replica) = &args.replica {
        let ctl = ReplicaControl::connect(replica).await?;
        original_delay = Some(ctl.delay_ms().await?);
        replica_url =
            Some(procs::wait_replicated(replica, &db.name, Duration::from_secs(60)).await?);
        replica_ctl = Some(ctl);
    }
    let result = check_with(
        &args,
        seed,
        &known,
        &db,
        &redis_url,
        cluster,
        replica_url,
        replica_ctl.as_ref(),
        own_redis.take(),
        &binary,
        &repo,
        &log_dir,
        wall,
    )
    .await;
    if let (Some(ctl), Some(ms)) = (&replica_ctl, original_delay) {
        let _ = ctl.set_delay_ms(ms).await;
    }
    if !args.keep_db {
        let _ = db.cleanup().await;
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn check_with(
    args: &CheckArgs,
    seed: u64,
    known: &[Known],
    db: &crate::fixtures::TestDb,
    redis_url: &str,
    cluster: bool,
    replica_url: Option<String>,
    replica_ctl: Option<&ReplicaControl>,
    own_redis: Option<RedisServer>,
    binary: &Path,
    repo: &Path,
    log_dir: &Path,
    wall: Instant,
) -> anyhow::Result<Report> {
    let hold = args.hold_ms;
    let share = args.backstop_share_ms.unwrap_or(hold);
    let publisher = Arc::new(io::Publisher::connect(redis_url, cluster).await?);
    let clock = Clock::start();
    let world = Arc::new(
        world::World::create(
            db.pool.clone(),
            publisher.clone(),
            clock,
            world::WriterConfig {
                rate: args.write_rate,
                writers: args.writers,
                runs: args.runs,
                lose: args.lose_rate,
                duplicate: args.dup_rate,
                late: args.late_rate,
                late_ms: (200, 1_500),
                partial: args.partial_rate,
                misroute: if args.no_faults { 0.0 } else { 0.05 },
                bulk: (args.sse_fraction > 0.0 && args.bulk_rate > 0.0).then_some(
                    world::BulkConfig {
                        kb: args.bulk_kb,
                        rate: args.bulk_rate,
                    },
                ),
            },
            seed,
        )
        .await?,
    );
    // Instances.
    let mut env = vec![
        (
            "RUNFEED_SERVER__HANDLE_SECRET".to_string(),
            format!("check-secret-{seed}"),
        ),
        (
            "RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS".into(),
            hold.to_string(),
        ),
        (
            "RUNFEED_CACHES__BACKSTOP_SHARE_MS".into(),
            share.to_string(),
        ),
    ];
    if args.sse_fraction > 0.0 {
        env.push((
            "RUNFEED_FEEDS__SSE_STALL_TIMEOUT_MS".into(),
            args.sse_stall_timeout_ms.to_string(),
        ));
        env.push((
            "RUNFEED_FEEDS__SSE_MAX_DURATION_MS".into(),
            args.sse_max_duration_ms.to_string(),
        ));
    }
    let cfg = InstanceConfig {
        binary: binary.to_path_buf(),
        database_url: db.url.clone(),
        replica_url,
        redis_url: redis_url.to_string(),
        cluster,
        env,
        log_dir: log_dir.to_path_buf(),
    };
    let mut instances = Vec::new();
    for i in 0..usize::from(args.instances) {
        instances.push(Instance::start(cfg.clone(), i).await?);
    }
    let bases: Vec<String> = instances.iter().map(Instance::base).collect();
    let instances = Arc::new(tokio::sync::Mutex::new(instances));
    println!(
        "check: {} instance(s) at {}; redis {}{}; replica {}",
        bases.len(),
        bases.join(", "),
        redis_url,
        if cluster { " (cluster)" } else { "" },
        cfg.replica_url.as_deref().unwrap_or("-")
    );

    let churn_ms = args.seconds * 1000.0;
    let start = clock.now();
    let churn_until = start + churn_ms;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stop_rx_sampler = stop_rx.clone();
    let readers = Arc::new(readers::Readers::new(
        clock,
        world.history.clone(),
        world.envs.clone(),
        bases.clone(),
        readers::ReaderConfig {
            readers: args.readers,
            npm_fraction: args.npm_fraction,
            hop: if bases.len() > 1 { args.hop_rate } else { 0.0 },
            drop: args.drop_rate,
            abort: args.abort_rate,
            pause: args.pause_rate,
            foreign: args.foreign_rate,
            lifetime_s: range_arg(&args.sub_seconds, 0.001, (2.0, 12.0)),
            hold_ms: hold,
            sse_fraction: args.sse_fraction,
            sse_stall: args.sse_stall_rate,
            sse_stall_ms: range_arg(&args.sse_stall_ms, 1, (300, 6_000)),
            stall_timeout_ms: args.sse_stall_timeout_ms,
            bulk: world.bulk_run.map(|run| (run, args.bulk_share)),
        },
        churn_until,
        stop_rx,
        repo.to_path_buf(),
    )?);
    let readers_task = tokio::spawn(readers.clone().run(seed));

    // Faults, spread over the middle of the churn, injected while the writers write.
    let faults = run_faults(FaultCtx {
        plan: fault_plan(args, seed, churn_ms, start),
        clock,
        instances: &instances,
        history: &world.history,
        repo,
        cluster_url: args.redis_cluster.as_deref(),
        delays: &args.replica_delays_ms,
        replica: replica_ctl,
        redis: own_redis,
        redis_fault_ms: args.redis_fault_ms,
        readers: &readers,
        failover_slot: io::channel_slot(&world.envs[0].env_id),
        failover_mode: args.cluster_failover_mode,
        seed,
    });
    // With a replica: sample its replay lag every 50 ms until the check ends.
    let sampler = replica_ctl.cloned().map(|ctl| {
        let history = world.history.clone();
        let mut stop = stop_rx_sampler.clone();
        tokio::spawn(async move {
            loop {
                if let Ok(lag) = ctl.replay_lag_ms().await {
                    let at = clock.now();
                    history
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .replica_lag
                        .push((at, lag));
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                    _ = stop.changed() => break,
                }
            }
        })
    });
    // Our Redis lives until the end of the check (dropping it kills it).
    let (_redis, ()) = tokio::join!(faults, world.write_until(churn_until, seed));
    let writes_stopped = world
        .history
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .writes_stopped;
    println!(
        "check: writes stopped at +{:.1}s; waiting for convergence",
        writes_stopped / 1000.0
    );
    let bounds = bounds(args, hold, share);
    let end_at = writes_stopped + bounds.converge_ms + 500.0;
    let wait = end_at - clock.now();
    if wait > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(wait / 1000.0)).await;
    }
    let end = clock.now();
    let _ = stop_tx.send(true);
    let subs = readers_task.await.unwrap_or_default();
    if let Some(sampler) = sampler {
        let _ = sampler.await;
    }
    world.verify_log().await?;
    let mut stalled_streams = 0.0;
    {
        let mut guard = instances.lock().await;
        for inst in guard.iter_mut() {
            let _ = inst.stop(Duration::from_secs(10)).await;
            stalled_streams += inst.stalled_streams().await;
        }
    }
    let history: History = world
        .history
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    if let Some(path) = &args.dump {
        let dump = serde_json::json!({ "history": &history, "subs": &subs, "bounds": &bounds });
        std::fs::write(path, serde_json::to_string(&dump)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    let outcome = props::check(&history, &subs, &bounds, &clock, end);
    let mut figures = report::figures(
        seed,
        &history,
        &subs,
        &outcome,
        wall.elapsed().as_secs_f64(),
        args.seconds,
        usize::from(args.instances),
    );
    figures.sse_server_stalled_streams = stalled_streams as usize;
    report::count_stalls(&mut figures, &subs, args.sse_stall_timeout_ms);
    let mut violations = BTreeMap::new();
    for p in Property::ALL {
        violations.insert(p.name().to_string(), outcome.count(p));
    }
    let passed = Property::ALL
        .iter()
        .all(|p| outcome.count(*p) == 0 || known.iter().any(|k| k.property == *p));
    let mut details: Vec<props::Violation> = outcome.violations.clone();
    details.sort_by_key(|v| (!v.counted, v.property));
    // Minimal histories: the first few of each property.
    for p in Property::ALL {
        for v in details
            .iter()
            .filter(|v| v.property == p && v.counted)
            .take(args.explain)
        {
            println!("{}", report::explain(&history, &subs, v));
        }
    }
    details.truncate(200);
    let report = Report {
        figures,
        violations,
        known: known.to_vec(),
        passed,
        details,
        options: serde_json::to_value(args).unwrap_or_default(),
    };
    print!("{}", report::summary(&report));
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    Ok(report)
}

/// Where and what the fault injector acts on.
struct FaultCtx<'a> {
    plan: Vec<(model::Ms, FaultKind)>,
    clock: Clock,
    instances: &'a tokio::sync::Mutex<Vec<Instance>>,
    history: &'a Mutex<History>,
    repo: &'a Path,
    cluster_url: Option<&'a str>,
    delays: &'a [u64],
    replica: Option<&'a ReplicaControl>,
    redis: Option<RedisServer>,
    /// How long a Redis pause or freeze lasts, ms.
    redis_fault_ms: u64,
    /// The readers (reconnect storms).
    readers: &'a readers::Readers,
    /// The Cluster slot of environment A's channel (its master is the one failed over).
    failover_slot: u16,
    failover_mode: FailoverMode,
    seed: u64,
}

/// When each fault fires: every requested fault, in a seeded random order, spread evenly over
/// 15–75 % of the churn (with jitter).
fn fault_plan(
    args: &CheckArgs,
    seed: u64,
    churn_ms: f64,
    start: model::Ms,
) -> Vec<(model::Ms, FaultKind)> {
    let mut kinds = Vec::new();
    kinds.extend(std::iter::repeat_n(
        FaultKind::InstanceRestart,
        args.instance_restarts,
    ));
    kinds.extend(std::iter::repeat_n(
        FaultKind::RedisRestart,
        args.redis_restarts,
    ));
    kinds.extend(std::iter::repeat_n(
        FaultKind::RedisPause,
        args.redis_pauses,
    ));
    kinds.extend(std::iter::repeat_n(
        FaultKind::RedisFreeze,
        args.redis_freezes,
    ));
    kinds.extend(std::iter::repeat_n(
        FaultKind::ClusterNodeRestart,
        args.cluster_node_restarts,
    ));
    kinds.extend(std::iter::repeat_n(
        FaultKind::ReplicaDelay,
        args.replica_delay_changes,
    ));
    kinds.extend(std::iter::repeat_n(
        FaultKind::ClusterFailover,
        args.cluster_failovers,
    ));
    kinds.extend(std::iter::repeat_n(FaultKind::ReconnectStorm, args.storms));
    let mut rng = StdRng::seed_from_u64(seed ^ 0xfa_u64);
    kinds.shuffle(&mut rng);
    let n = kinds.len().max(1) as f64;
    let span = churn_ms * 0.6;
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, kind)| {
            let slot = span / n;
            let at = start + churn_ms * 0.15 + slot * i as f64 + rng.random_range(0.0..slot * 0.5);
            (at, kind)
        })
        .collect()
}

/// Waits until every instance is ready again (Redis subscriber reconnected), 30 s at most.
async fn wait_all_ready(instances: &tokio::sync::Mutex<Vec<Instance>>) -> anyhow::Result<()> {
    let guard = instances.lock().await;
    for inst in guard.iter() {
        inst.wait_ready(Duration::from_secs(30)).await?;
    }
    Ok(())
}

/// Injects the planned faults; records each as a [`FaultWindow`]. Returns the check's own
/// Redis (so it lives until the end).
async fn run_faults(mut ctx: FaultCtx<'_>) -> Option<RedisServer> {
    let mut rng = StdRng::seed_from_u64(ctx.seed ^ 0xfa17);
    let mut delay_now: Option<u64> = None;
    if let Some(ctl) = ctx.replica {
        delay_now = ctl.delay_ms().await.ok();
    }
    if let Some(d) = delay_now {
        ctx.history
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replica_delays
            .push((ctx.clock.now(), d));
    }
    let plan = std::mem::take(&mut ctx.plan);
    for (at, kind) in plan {
        let wait = at - ctx.clock.now();
        if wait > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(wait / 1000.0)).await;
        }
        let from = ctx.clock.now();
        let detail: anyhow::Result<String> = match kind {
            FaultKind::InstanceRestart => {
                let mut guard = ctx.instances.lock().await;
                let i = rng.random_range(0..guard.len());
                guard[i]
                    .restart(Duration::from_millis(200))
                    .await
                    .map(|()| format!("instance {i}: SIGTERM while polls are held, 200 ms down"))
            }
            FaultKind::RedisRestart => match ctx.redis.as_mut() {
                Some(r) => {
                    let res = r.restart(Duration::from_millis(500)).await;
                    let ready = wait_all_ready(ctx.instances).await;
                    res.and(ready)
                        .map(|()| "the check's redis-server killed, 500 ms down".to_string())
                }
                None => Ok("skipped (no own Redis)".to_string()),
            },
            FaultKind::RedisPause | FaultKind::RedisFreeze => match ctx.redis.as_ref() {
                Some(r) => {
                    let window = Duration::from_millis(ctx.redis_fault_ms);
                    let res = if kind == FaultKind::RedisPause {
                        r.pause(window).await
                    } else {
                        r.freeze(window).await
                    };
                    let ready = wait_all_ready(ctx.instances).await;
                    res.and(ready).map(|()| {
                        format!(
                            "the check's redis-server {} for {} ms",
                            kind.name(),
                            ctx.redis_fault_ms
                        )
                    })
                }
                None => Ok("skipped (no own Redis)".to_string()),
            },
            FaultKind::ClusterNodeRestart => {
                let node = rng.random_range(1..=3);
                match ctx.cluster_url.and_then(procs::cluster_base_port) {
                    Some(base) => {
                        let res = procs::restart_cluster_node(
                            ctx.repo,
                            base,
                            node,
                            Duration::from_millis(500),
                        )
                        .await;
                        let ready = wait_all_ready(ctx.instances).await;
                        res.and(ready).map(|()| {
                            format!("cluster node {node} (base port {base}), 500 ms down")
                        })
                    }
                    None => Ok("skipped (no cluster)".to_string()),
                }
            }
            FaultKind::ClusterFailover => {
                match ctx.cluster_url.and_then(procs::cluster_base_port) {
                    Some(base) => {
                        let mode = match ctx.failover_mode {
                            FailoverMode::Kill => "kill",
                            FailoverMode::Takeover => "takeover",
                            FailoverMode::Mixed if rng.random_bool(0.5) => "kill",
                            FailoverMode::Mixed => "takeover",
                        };
                        let res =
                            procs::cluster_failover(ctx.repo, base, ctx.failover_slot, mode).await;
                        let ready = wait_all_ready(ctx.instances).await;
                        res.and_then(|detail| ready.map(|()| detail))
                    }
                    None => Ok("skipped (no cluster)".to_string()),
                }
            }
            FaultKind::ReconnectStorm => {
                let n = ctx.instances.lock().await.len();
                let i = rng.random_range(0..n);
                ctx.readers.storm(i);
                // The window of the reconnects (each reader waits 0–1 s).
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok(format!(
                    "instance {i}: every Rust reader's request or stream there dropped, reconnecting within 1 s"
                ))
            }
            FaultKind::ReplicaDelay => match ctx.replica {
                Some(ctl) => {
                    let next = ctx.delays.choose(&mut rng).copied().unwrap_or(300);
                    let before = delay_now;
                    delay_now = Some(next);
                    let set = ctl.set_delay_ms(next).await;
                    if set.is_ok() {
                        ctx.history
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .replica_delays
                            .push((ctx.clock.now(), next));
                    }
                    set.map(|()| format!("apply delay {} → {next} ms", before.unwrap_or(0)))
                }
                None => Ok("skipped (no replica)".to_string()),
            },
        };
        let detail = detail.unwrap_or_else(|e| format!("FAILED: {e:#}"));
        println!(
            "check: fault {} at +{:.1}s: {detail}",
            kind.name(),
            from / 1000.0
        );
        ctx.history
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .faults
            .push(FaultWindow {
                kind,
                from,
                to: ctx.clock.now(),
                detail,
            });
    }
    ctx.redis
}

/// The bounds of the properties for these options.
fn bounds(args: &CheckArgs, hold: u64, share: u64) -> Bounds {
    let max_delay = args.replica_delays_ms.iter().copied().max().unwrap_or(0);
    let lag_bound = args.replica_lag_bound_ms as f64;
    let replica_extra = if args.replica.is_some() {
        max_delay as f64
    } else {
        0.0
    };
    // One hold (with its +15 % jitter) plus one shared backstop, plus slack.
    let backstop = hold as f64 * 1.15 + share as f64 + 1_500.0 + replica_extra;
    Bounds {
        fresh_slack_ms: if args.replica.is_some() {
            lag_bound
        } else {
            0.0
        },
        timely_ms: args.timely_ms,
        timely_quantile: args.timely_quantile,
        lost_ms: backstop,
        converge_ms: backstop,
        fault_margin_ms: 1_000.0,
        window_slack_ms: 65_000,
    }
}

/// A `[low, high]` command-line range: both given (in order), one value (then `[v, v + step)`),
/// or none (`default`).
fn range_arg<T>(given: &[T], step: T, default: (T, T)) -> (T, T)
where
    T: Copy + PartialOrd + std::ops::Add<Output = T>,
{
    match given {
        [a, b, ..] if a < b => (*a, *b),
        [a, ..] => (*a, *a + step),
        [] => default,
    }
}
