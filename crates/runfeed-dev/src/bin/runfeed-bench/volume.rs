//! `volume`: feeds at production data volume, against a database `gen` filled. K distinct tag
//! filters of the busy environment (`createdAt` window, tags picked by how many runs they match)
//! take their cold snapshots at once while another environment's tag feeds, run feeds and batch
//! feeds are probed; then every filter long-polls while nothing changes (idle), and optionally
//! while runs change (`--churn-per-sec`). Beside runfeed's own CPU it reports what Postgres spends:
//! CPU from `/proc/<pid>/stat` of runfeed's backends (`application_name` `runfeed`) and of every
//! `postgres` process, transactions and rows read from `pg_stat_database`, the `"TaskRun"` scans
//! of `pg_stat_user_tables`, and `pg_stat_statements` where it is loaded. `--explain` adds
//! `EXPLAIN (ANALYZE, BUFFERS)` of runfeed's set queries (`src/store/sql.rs`).

use std::sync::atomic::AtomicBool;

use chrono::NaiveDateTime;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use runfeed::protocol::{Column, ColumnSet};
use runfeed_dev::measure::{metric_sum_labelled, postgres_pids, CpuTally};
use sqlx::Row;

use super::gen::{GenMeta, ENV_SLUG_PREFIX};
use super::*;

#[derive(Args, Clone)]
pub(crate) struct VolumeArgs {
    #[command(flatten)]
    common: Common,
    /// Distinct tag filters of the busy environment.
    #[arg(long, default_value_t = 1000)]
    k: usize,
    /// `createdAt` of every tag feed (`24h`, `1500m`); `auto`: the 24 h of data before `gen`
    /// ran, i.e. 24 h plus the time since, rounded up to a minute (the server's
    /// `feeds.maximum_created_at_filter_age_ms` must allow it).
    #[arg(long, default_value = "auto")]
    window: String,
    /// Share of the filters drawn from the mid band (0.1–2 % of the window's runs each).
    #[arg(long, default_value_t = 0.15)]
    mid_share: f64,
    /// Share of the filters that are two-tag pairs (`plan:…` and a mid or rare `user:…`).
    #[arg(long, default_value_t = 0.05)]
    pair_share: f64,
    /// Seed of the filter draw.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Fairness probe rounds during the stampede (each: another environment's tag snapshot, a
    /// run-feed snapshot, a batch-feed snapshot, all cold).
    #[arg(long, default_value_t = 20)]
    probes: usize,
    /// Time between the starts of two probe rounds (ms).
    #[arg(long, default_value_t = 500)]
    probe_interval_ms: u64,
    /// The idle measurement (s): every filter long-polls while nothing changes.
    #[arg(long, default_value_t = 150.0)]
    idle_s: f64,
    /// Also measure `--idle-s` while this many runs per second change (UPDATE + change record).
    #[arg(long, default_value_t = 0.0)]
    churn_per_sec: f64,
    /// The server's log file: its lines (and those naming a backstop) are counted per phase.
    #[arg(long)]
    server_log: Option<String>,
    /// After the phases, print `EXPLAIN (ANALYZE, BUFFERS)` of the set queries.
    #[arg(long)]
    explain: bool,
    /// Only the plans: no server phases (`--base-url` is not used).
    #[arg(long)]
    explain_only: bool,
    /// The `LIMIT` of the explained set queries.
    #[arg(long, default_value_t = 1000)]
    set_limit: i64,
    /// After the cold stampede, a second one of this many other filters (drawn with the next
    /// seed, the first stampede's left out), once the busy environment's window
    /// (`feeds.window_after_resolves`) has had `--warm-after-ms` to be built: what a cold
    /// snapshot costs while the environment is busy. 0: none.
    #[arg(long, default_value_t = 0)]
    warm_k: usize,
    /// Wait before the second stampede (ms).
    #[arg(long, default_value_t = 10_000)]
    warm_after_ms: u64,
}

/// Bands of tags by the share of the window's runs they match.
const COMMON_SHARE: f64 = 0.02;
const MID_SHARE: f64 = 0.001;

/// One tag filter of the stampede.
#[derive(Clone, Debug)]
struct Filter {
    band: &'static str,
    tags: Vec<String>,
    /// Runs it matches in the window (a pair: unknown).
    matches: Option<i64>,
}

/// What the phases share: the bench, the environments, the window.
struct Volume {
    b: Arc<Bench>,
    /// A pool on the maintenance database `postgres`: the samplers' queries do not count in the
    /// measured database's statistics.
    stats: PgPool,
    db_name: String,
    envs: Vec<DemoEnv>,
    window: String,
    floor: NaiveDateTime,
    server_log: Option<String>,
}

fn naive(ms: i64) -> NaiveDateTime {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|d| d.naive_utc())
        .unwrap_or_default()
}

/// The environments `gen` wrote, in order (`vol-000` first: the busy one).
async fn load_envs(pool: &PgPool) -> anyhow::Result<Vec<DemoEnv>> {
    let rows = sqlx::query(
        r#"SELECT id, "apiKey", "organizationId", "projectId" FROM "RuntimeEnvironment"
           WHERE slug LIKE $1 ORDER BY slug"#,
    )
    .bind(format!("{ENV_SLUG_PREFIX}%"))
    .fetch_all(pool)
    .await
    .context("read the environments")?;
    rows.iter()
        .map(|r| {
            Ok(DemoEnv {
                env_id: r.try_get(0)?,
                api_key: r.try_get(1)?,
                org_id: r.try_get(2)?,
                project_id: r.try_get(3)?,
            })
        })
        .collect()
}

/// `(tag, runs)` of `env` in the window, most frequent first.
async fn tag_counts(v: &Volume, env: &DemoEnv) -> anyhow::Result<Vec<(String, i64)>> {
    let rows = sqlx::query(
        r#"SELECT t, count(*)::int8 AS n FROM "TaskRun", unnest("runTags") AS t
           WHERE "runtimeEnvironmentId" = $1 AND "createdAt" >= $2
           GROUP BY t ORDER BY n DESC, t"#,
    )
    .bind(&env.env_id)
    .bind(v.floor)
    .fetch_all(&v.b.pool)
    .await
    .context("count tags in the window")?;
    rows.iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect()
}

/// K filters from `counts`: every common tag, `mid_share` of K from the mid band, `pair_share`
/// pairs, the rest rare (topped up from the mid band when the rare one runs out).
fn pick_filters(a: &VolumeArgs, counts: &[(String, i64)]) -> Vec<Filter> {
    let runs: i64 = counts
        .iter()
        .filter(|(t, _)| t.starts_with("user:"))
        .map(|(_, n)| n)
        .sum();
    let common_min = (runs as f64 * COMMON_SHARE).max(1.0) as i64;
    let mid_min = (runs as f64 * MID_SHARE).max(1.0) as i64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    let single = |band, (t, n): &(String, i64)| Filter {
        band,
        tags: vec![t.clone()],
        matches: Some(*n),
    };
    let common: Vec<_> = counts.iter().filter(|(_, n)| *n >= common_min).collect();
    let mut mid: Vec<_> = counts
        .iter()
        .filter(|(t, n)| t.starts_with("user:") && *n >= mid_min && *n < common_min)
        .collect();
    let mut rare: Vec<_> = counts
        .iter()
        .filter(|(t, n)| t.starts_with("user:") && *n < mid_min)
        .collect();
    let plans: Vec<_> = counts
        .iter()
        .filter(|(t, _)| t.starts_with("plan:"))
        .collect();
    mid.shuffle(&mut rng);
    rare.shuffle(&mut rng);
    let mut out: Vec<Filter> = common
        .iter()
        .take(a.k)
        .map(|c| single("common", c))
        .collect();
    let left = a.k - out.len();
    let n_pairs = ((a.k as f64 * a.pair_share).round() as usize).min(left);
    let n_mid = ((a.k as f64 * a.mid_share).round() as usize)
        .min(left - n_pairs)
        .min(mid.len());
    out.extend(mid.drain(..n_mid).map(|c| single("mid", c)));
    // Pairs take their user tag from what is left of the mid and rare bands.
    let mut pair_users: Vec<_> = mid.iter().chain(rare.iter()).copied().collect();
    pair_users.shuffle(&mut rng);
    let n_pairs = if plans.is_empty() { 0 } else { n_pairs };
    let paired: Vec<String> = pair_users
        .iter()
        .take(n_pairs)
        .map(|(t, _)| t.clone())
        .collect();
    for (i, user) in paired.iter().enumerate() {
        let plan = &plans[i % plans.len()].0;
        out.push(Filter {
            band: "pair",
            tags: vec![plan.clone(), user.clone()],
            matches: None,
        });
    }
    // The rest: rare tags not used by a pair, then the remaining mid ones.
    let unused = |c: &&&(String, i64)| !paired.contains(&c.0);
    let rest: Vec<_> = rare
        .iter()
        .filter(unused)
        .map(|c| single("rare", c))
        .chain(mid.iter().filter(unused).map(|c| single("mid", c)))
        .take(a.k - out.len())
        .collect();
    out.extend(rest);
    out
}

/// Figures of a set of filters: how many, and the median of their matches.
fn mix_rows(filters: &[Filter]) -> Vec<(String, Value)> {
    let mut rows = Vec::new();
    for band in ["common", "mid", "rare", "pair"] {
        let of: Vec<&Filter> = filters.iter().filter(|f| f.band == band).collect();
        rows.push((format!("filters: {band}"), json!(of.len())));
        let mut m: Vec<f64> = of
            .iter()
            .filter_map(|f| f.matches)
            .map(|n| n as f64)
            .collect();
        if !m.is_empty() {
            m.sort_by(f64::total_cmp);
            rows.push((
                format!("filters: {band}, runs matched (min / median / max)"),
                json!(format!("{} / {} / {}", m[0], pct(&m, 50.0), m[m.len() - 1])),
            ));
        }
    }
    rows
}

/// Postgres CPU over a window, sampled every 500 ms in a task of its own: runfeed's backends
/// on the measured database, and every `postgres` process of the machine.
struct PgCpu {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(CpuTally, CpuTally)>,
    started: Instant,
}

/// Pids of the backends of `db` whose `application_name` is `runfeed` (what `src/store/pg.rs`
/// sets).
async fn runfeed_backends(stats: &PgPool, db: &str) -> Vec<u32> {
    sqlx::query_scalar::<_, i32>(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'runfeed' AND datname = $1",
    )
    .bind(db)
    .fetch_all(stats)
    .await
    .unwrap_or_default()
    .into_iter()
    .filter_map(|p| u32::try_from(p).ok())
    .collect()
}

impl PgCpu {
    async fn start(v: &Volume) -> PgCpu {
        let (stats, db) = (v.stats.clone(), v.db_name.clone());
        let mut runfeed = CpuTally::start(&runfeed_backends(&stats, &db).await);
        let mut all = CpuTally::start(&postgres_pids());
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            loop {
                let last = stopped.load(Ordering::Relaxed);
                runfeed.sample(&runfeed_backends(&stats, &db).await);
                all.sample(&postgres_pids());
                if last {
                    return (runfeed, all);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        PgCpu {
            stop,
            task,
            started: Instant::now(),
        }
    }

    /// CPU seconds of runfeed's backends and of every postgres process, and the window (s).
    async fn finish(self) -> (Option<f64>, Option<f64>, f64) {
        self.stop.store(true, Ordering::Relaxed);
        let secs = self.started.elapsed().as_secs_f64();
        match self.task.await {
            Ok((runfeed, all)) => (Some(runfeed.total_s()), Some(all.total_s()), secs),
            Err(_) => (None, None, secs),
        }
    }
}

/// Counters read at both ends of a phase.
#[derive(Default)]
struct Counters {
    xacts: Option<f64>,
    tup_returned: Option<f64>,
    tup_fetched: Option<f64>,
    blks: Option<f64>,
    blks_read: Option<f64>,
    seq_tup_read: Option<f64>,
    idx_scan: Option<f64>,
    idx_tup_fetch: Option<f64>,
    stmt_calls: Option<f64>,
    stmt_rows: Option<f64>,
    stmt_ms: Option<f64>,
    pg_queries: Option<f64>,
    backstops: Option<f64>,
    /// Live polls the change stream could not vouch for (`path="cold-resolve"`): each re-reads
    /// its filter.
    cold_polls: Option<f64>,
    requests: Option<f64>,
    server_cpu: Option<f64>,
    log_lines: Option<f64>,
    log_backstop_lines: Option<f64>,
}

impl Volume {
    async fn counters(&self) -> Counters {
        let mut c = Counters::default();
        if let Ok(r) = sqlx::query(
            r#"SELECT (xact_commit + xact_rollback)::float8, tup_returned::float8, tup_fetched::float8,
                      (blks_hit + blks_read)::float8, blks_read::float8
               FROM pg_stat_database WHERE datname = $1"#,
        )
        .bind(&self.db_name)
        .fetch_one(&self.stats)
        .await
        {
            c.xacts = r.try_get(0).ok();
            c.tup_returned = r.try_get(1).ok();
            c.tup_fetched = r.try_get(2).ok();
            c.blks = r.try_get(3).ok();
            c.blks_read = r.try_get(4).ok();
        }
        if let Ok(r) = sqlx::query(
            r#"SELECT COALESCE(seq_tup_read, 0)::float8, COALESCE(idx_scan, 0)::float8,
                      COALESCE(idx_tup_fetch, 0)::float8
               FROM pg_stat_user_tables WHERE relname = 'TaskRun'"#,
        )
        .fetch_one(&self.b.pool)
        .await
        {
            c.seq_tup_read = r.try_get(0).ok();
            c.idx_scan = r.try_get(1).ok();
            c.idx_tup_fetch = r.try_get(2).ok();
        }
        // Only where the extension is loaded (`shared_preload_libraries`) and created.
        if let Ok(r) = sqlx::query(
            r#"SELECT sum(calls)::float8, sum(rows)::float8, sum(total_exec_time)::float8
               FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"#,
        )
        .fetch_one(&self.b.pool)
        .await
        {
            c.stmt_calls = r.try_get(0).ok();
            c.stmt_rows = r.try_get(1).ok();
            c.stmt_ms = r.try_get(2).ok();
        }
        let text = self.b.scrape().await;
        c.pg_queries = metric_sum(&text, "runfeed_pg_queries_total");
        c.backstops = metric_sum(&text, "runfeed_feeds_backstops_total");
        c.cold_polls = metric_sum_labelled(
            &text,
            "runfeed_feeds_live_polls_total",
            "path=\"cold-resolve\"",
        );
        c.requests = metric_sum(&text, "runfeed_http_requests_total");
        c.server_cpu = self.b.server_cpu();
        if let Some(log) = &self.server_log {
            if let Ok(text) = std::fs::read_to_string(log) {
                c.log_lines = Some(text.lines().count() as f64);
                c.log_backstop_lines =
                    Some(text.lines().filter(|l| l.contains("backstop")).count() as f64);
            }
        }
        c
    }
}

/// One snapshot task of a stampede: the response (and its body's length), and when it came.
type SnapshotTask = tokio::task::JoinHandle<(Option<(Resp, usize)>, Instant)>;

/// A cold snapshot of each of `feeds` in `busy`, all started at once.
fn spawn_snapshots(b: &Arc<Bench>, busy: &Arc<DemoEnv>, feeds: &[Feed]) -> Vec<SnapshotTask> {
    feeds
        .iter()
        .map(|feed| {
            let (b, env, feed) = (b.clone(), busy.clone(), feed.clone());
            tokio::spawn(async move {
                let token = Bench::token(&env, &feed);
                let r = b.snapshot_lean(&token, &feed).await;
                (r.ok(), Instant::now())
            })
        })
        .collect()
}

/// A second stampede of `feeds` (cold snapshots of filters not read before), its figures
/// labelled `warm: …`.
async fn warm_stampede(v: &Volume, busy: &Arc<DemoEnv>, feeds: &[Feed]) -> Vec<(String, Value)> {
    let b = &v.b;
    let c0 = v.counters().await;
    let cpu = PgCpu::start(v).await;
    let started = Instant::now();
    let (mut lat, mut failed) = (Vec::new(), 0usize);
    for t in spawn_snapshots(b, busy, feeds) {
        match t.await {
            Ok((Some((r, _)), at)) if r.status == 200 => lat.push(ms(at.duration_since(started))),
            _ => failed += 1,
        }
    }
    let pg_cpu = cpu.finish().await;
    let c1 = v.counters().await;
    lat.sort_by(f64::total_cmp);
    let mut rows = vec![
        ("warm: snapshots".to_string(), json!(feeds.len())),
        (
            "warm: time to the last snapshot (ms)".into(),
            json!(lat.last().copied().unwrap_or(0.0)),
        ),
        ("warm: snapshot p50 (ms)".into(), json!(pct(&lat, 50.0))),
        ("warm: snapshot p99 (ms)".into(), json!(pct(&lat, 99.0))),
        ("warm: snapshots not 200".into(), json!(failed)),
        (
            "warm: postgres CPU per snapshot, runfeed backends (ms)".into(),
            opt(pg_cpu.0.map(|s| s * 1000.0 / feeds.len().max(1) as f64)),
        ),
    ];
    rows.extend(phase_rows("warm", &c0, &c1, pg_cpu, false));
    rows
}

/// The figures of a phase between `c0` and `c1`: totals (`per_s` false, a stampede) or rates
/// (per second of `secs`, a steady window), each labelled `<phase>: …`.
fn phase_rows(
    phase: &str,
    c0: &Counters,
    c1: &Counters,
    cpu: (Option<f64>, Option<f64>, f64),
    per_s: bool,
) -> Vec<(String, Value)> {
    let (pg_runfeed, pg_all, secs) = cpu;
    let d = |a: Option<f64>, b: Option<f64>| {
        delta(a, b).map(|x| if per_s { x / secs.max(1e-9) } else { x })
    };
    let (cpu_unit, rate) = if per_s { ("cores", "/s") } else { ("s", "") };
    let cpu_of = |x: Option<f64>| opt(x.map(|s| if per_s { s / secs.max(1e-9) } else { s }));
    let rows_read = match (
        d(c0.tup_returned, c1.tup_returned),
        d(c0.tup_fetched, c1.tup_fetched),
    ) {
        (Some(r), Some(f)) => Some(r + f),
        _ => None,
    };
    let l = |s: &str| format!("{phase}: {s}");
    vec![
        (
            l(&format!("postgres CPU, runfeed backends ({cpu_unit})")),
            cpu_of(pg_runfeed),
        ),
        (
            l(&format!(
                "postgres CPU, all postgres processes ({cpu_unit})"
            )),
            cpu_of(pg_all),
        ),
        (
            l(&format!("runfeed CPU ({cpu_unit})")),
            opt(d(c0.server_cpu, c1.server_cpu)),
        ),
        (
            l(&format!("runfeed queries{rate} (metric)")),
            opt(d(c0.pg_queries, c1.pg_queries)),
        ),
        (
            l(&format!("transactions{rate} (pg_stat_database)")),
            opt(d(c0.xacts, c1.xacts)),
        ),
        (
            l(&format!("rows read{rate} (tup_returned + tup_fetched)")),
            opt(rows_read),
        ),
        (
            l(&format!("buffers{rate} (hit + read)")),
            opt(d(c0.blks, c1.blks)),
        ),
        (
            l(&format!("buffers read{rate} (not in shared_buffers)")),
            opt(d(c0.blks_read, c1.blks_read)),
        ),
        (
            l(&format!("TaskRun index scans{rate}")),
            opt(d(c0.idx_scan, c1.idx_scan)),
        ),
        (
            l(&format!("TaskRun rows fetched by index{rate}")),
            opt(d(c0.idx_tup_fetch, c1.idx_tup_fetch)),
        ),
        (
            l(&format!("TaskRun rows read by seq scans{rate}")),
            opt(d(c0.seq_tup_read, c1.seq_tup_read)),
        ),
        (
            l(&format!("statements{rate} (pg_stat_statements)")),
            opt(d(c0.stmt_calls, c1.stmt_calls)),
        ),
        (
            l(&format!("statement rows{rate} (pg_stat_statements)")),
            opt(d(c0.stmt_rows, c1.stmt_rows)),
        ),
        (
            l(&format!("statement time ms{rate} (pg_stat_statements)")),
            opt(d(c0.stmt_ms, c1.stmt_ms)),
        ),
        (
            l(&format!("backstops{rate} (runfeed_feeds_backstops_total)")),
            opt(d(c0.backstops, c1.backstops)),
        ),
        (
            l(&format!(
                "live polls on the cold path{rate} (no replay coverage)"
            )),
            opt(d(c0.cold_polls, c1.cold_polls)),
        ),
        (
            l(&format!("server requests{rate}")),
            opt(d(c0.requests, c1.requests)),
        ),
        (
            l("server log lines"),
            opt(delta(c0.log_lines, c1.log_lines)),
        ),
        (
            l("server log lines naming a backstop"),
            opt(delta(c0.log_backstop_lines, c1.log_backstop_lines)),
        ),
        (l("window (s)"), json!(secs)),
    ]
}

/// Waits until runfeed has read no set (`runfeed_runset_query_duration_milliseconds`) for a
/// second, at most `limit`; whether it did.
async fn settle_reads(b: &Bench, limit: Duration) -> bool {
    let count = || b.metric("runfeed_runset_query_duration_milliseconds_count");
    let deadline = Instant::now() + limit;
    let mut last = count().await;
    let mut quiet_since = Instant::now();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = count().await;
        if now != last {
            last = now;
            quiet_since = Instant::now();
        } else if quiet_since.elapsed() >= Duration::from_secs(1) {
            return true;
        }
    }
    false
}

/// Latencies (ms) of one kind of probe, and its failures.
#[derive(Default)]
struct Probed {
    ms: Vec<f64>,
    /// (round, ms) of each answered probe, to tell which rounds were slow.
    by_round: Vec<(usize, f64)>,
    failed: usize,
}

impl Probed {
    fn rows(&mut self, what: &str) -> Vec<(String, Value)> {
        self.ms.sort_by(f64::total_cmp);
        self.by_round.sort_by(|a, b| b.1.total_cmp(&a.1));
        let slowest: Vec<String> = self
            .by_round
            .iter()
            .take(3)
            .map(|(round, ms)| format!("#{round} {ms:.0}"))
            .collect();
        vec![
            (
                format!("probe: {what} slowest rounds (round, ms)"),
                json!(slowest.join(", ")),
            ),
            (
                format!("probe: {what} snapshot p50 (ms)"),
                json!(pct(&self.ms, 50.0)),
            ),
            (
                format!("probe: {what} snapshot p99 (ms)"),
                json!(pct(&self.ms, 99.0)),
            ),
            (
                format!("probe: {what} snapshots not 200"),
                json!(self.failed),
            ),
        ]
    }
}

/// The feeds the probe rounds take, one of each per round, all cold.
struct ProbeFeeds {
    /// Another environment's tag feeds, with that environment.
    other: Vec<(Arc<DemoEnv>, Feed)>,
    runs: Vec<Feed>,
    batches: Vec<Feed>,
}

/// Times one cold snapshot of `feed` through `client` (any status); `None` on a transport error.
async fn timed_snapshot(
    b: &Bench,
    client: &reqwest::Client,
    env: &DemoEnv,
    feed: &Feed,
) -> (Option<u16>, f64) {
    let token = Bench::token(env, feed);
    let (path, params) = feed.snapshot_request();
    let t = Instant::now();
    let r = b.get_lean(client, &token, &path, &params).await;
    (r.ok().map(|(r, _)| r.status), ms(t.elapsed()))
}

/// [`probe`] on a thread and runtime of its own, with its own connections: a probe's request
/// then never waits behind the stampede's thousand tasks in this process's runtime, so what it
/// measures is the server's latency, not the load generator's queue.
fn probe_apart(plan: ProbePlan) -> std::thread::JoinHandle<(usize, [Probed; 3])> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
        match rt {
            Ok(rt) => rt.block_on(probe(plan)),
            Err(err) => {
                eprintln!("probe runtime: {err}");
                (0, Default::default())
            }
        }
    })
}

/// What the fairness probe takes: up to `n` rounds, one every `interval`, until `done`; the run
/// and batch feeds belong to `busy`.
struct ProbePlan {
    b: Arc<Bench>,
    busy: Arc<DemoEnv>,
    feeds: ProbeFeeds,
    n: usize,
    interval: Duration,
    done: Arc<AtomicBool>,
}

/// Probe rounds ([`ProbePlan`]): each round snapshots one of each probe feed at once, in a task
/// of its own (a slow round does not delay the next).
async fn probe(plan: ProbePlan) -> (usize, [Probed; 3]) {
    let ProbePlan {
        b,
        busy,
        feeds,
        n,
        interval,
        done,
    } = plan;
    let client = match reqwest::Client::builder().no_proxy().build() {
        Ok(client) => client,
        Err(err) => {
            eprintln!("probe client: {err}");
            return (0, Default::default());
        }
    };
    let mut rounds = Vec::new();
    while rounds.len() < n && !done.load(Ordering::Relaxed) {
        let i = rounds.len();
        let round = [
            feeds.other.get(i).cloned(),
            feeds.runs.get(i).map(|f| (busy.clone(), f.clone())),
            feeds.batches.get(i).map(|f| (busy.clone(), f.clone())),
        ];
        let (b, client) = (b.clone(), client.clone());
        rounds.push(tokio::spawn(async move {
            let timed = round.map(|probe| {
                let (b, client) = (b.clone(), client.clone());
                async move {
                    match probe {
                        Some((env, feed)) => Some(timed_snapshot(&b, &client, &env, &feed).await),
                        None => None,
                    }
                }
            });
            let [o, r, bt] = timed;
            let (o, r, bt) = tokio::join!(o, r, bt);
            [o, r, bt]
        }));
        tokio::time::sleep(interval).await;
    }
    let mut out: [Probed; 3] = Default::default();
    let n = rounds.len();
    for (i, round) in rounds.into_iter().enumerate() {
        let Ok(got) = round.await else { continue };
        for (slot, got) in out.iter_mut().zip(got) {
            match got {
                Some((Some(200), t)) => {
                    slot.ms.push(t);
                    slot.by_round.push((i, t));
                }
                Some(_) => slot.failed += 1,
                None => {}
            }
        }
    }
    (n, out)
}

/// The other environment's probe snapshots again, one at a time while nothing else runs: the
/// baseline of the stampede's probe. Each filter's `createdAt` is one minute longer, so runfeed
/// reads it cold (a filter it has not cached) over the same rows, give or take a minute's.
async fn probe_alone(b: &Bench, feeds: &[(Arc<DemoEnv>, Feed)]) -> Vec<(String, Value)> {
    let mut alone = Probed::default();
    for (i, (env, feed)) in feeds.iter().enumerate() {
        let feed = match feed {
            Feed::Tags {
                tags,
                created_at: Some(window),
            } => Feed::Tags {
                tags: tags.clone(),
                created_at: Some(one_minute_longer(window)),
            },
            other => other.clone(),
        };
        match timed_snapshot(b, &b.probe, env, &feed).await {
            (Some(200), t) => {
                alone.ms.push(t);
                alone.by_round.push((i, t));
            }
            _ => alone.failed += 1,
        }
    }
    alone.rows("alone, other environment's tag")
}

/// A `createdAt` window (`<n>m`, as `--window` gives it) one minute longer; other forms as
/// they are.
fn one_minute_longer(window: &str) -> String {
    match window.strip_suffix('m').and_then(|n| n.parse::<u64>().ok()) {
        Some(n) => format!("{}m", n + 1),
        None => window.to_string(),
    }
}

/// What the followers of the idle and churn phases count.
#[derive(Default)]
struct Follow {
    polls: AtomicU64,
    errors: AtomicU64,
    resnapshots: AtomicU64,
    changes: AtomicU64,
    stop: AtomicBool,
}

/// One filter's follower: live long-polls from `at` (a snapshot, or none when the cold one
/// failed: it takes one first) until stopped.
async fn follow(b: Arc<Bench>, s: Arc<Follow>, env: Arc<DemoEnv>, feed: Feed, at: Option<Resp>) {
    let token = Bench::token(&env, &feed);
    let client = b.client().clone();
    let mut at = at;
    while !s.stop.load(Ordering::Relaxed) {
        let Some(cur) = &at else {
            match b.snapshot_lean(&token, &feed).await {
                Ok((r, _)) if r.status == 200 => {
                    s.resnapshots.fetch_add(1, Ordering::Relaxed);
                    at = Some(r);
                }
                _ => {
                    s.errors.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            continue;
        };
        match b.live(&client, &token, &feed, cur).await {
            Ok(r) if r.status == 200 || r.status == 204 => {
                s.polls.fetch_add(1, Ordering::Relaxed);
                s.changes
                    .fetch_add(r.changed_ids().len() as u64, Ordering::Relaxed);
                if r.handle.is_some() {
                    at = Some(r);
                }
            }
            Ok(r) if r.status == 409 => at = None,
            _ => {
                s.errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// A run the churn changes: internal id, tags, internal batch id.
struct Target {
    id: String,
    tags: Vec<String>,
    batch: Option<String>,
}

/// Runs of the busy environment in the window to change (up to 5 000, the newest).
async fn churn_targets(v: &Volume) -> anyhow::Result<Vec<Target>> {
    let rows = sqlx::query(
        r#"SELECT id, COALESCE("runTags", '{}'), "batchId" FROM "TaskRun"
           WHERE "runtimeEnvironmentId" = $1 AND "createdAt" >= $2
           ORDER BY "createdAt" DESC LIMIT 5000"#,
    )
    .bind(&v.envs[0].env_id)
    .bind(v.floor)
    .fetch_all(&v.b.pool)
    .await
    .context("read churn targets")?;
    let mut out: Vec<Target> = rows
        .iter()
        .map(|r| {
            Ok(Target {
                id: r.try_get(0)?,
                tags: r.try_get(1)?,
                batch: r.try_get(2)?,
            })
        })
        .collect::<anyhow::Result<_>>()?;
    out.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));
    Ok(out)
}

/// Changes `rate` runs per second of `targets` for `secs` (one UPDATE per 100 ms tick, then
/// their change records); returns (changes published, failures).
async fn churn(v: &Volume, targets: &[Target], rate: f64, secs: f64) -> (u64, u64) {
    let (mut sent, mut failed) = (0u64, 0u64);
    if targets.is_empty() {
        return (0, 0);
    }
    let start = Instant::now();
    let env_id = v.envs[0].env_id.clone();
    while start.elapsed().as_secs_f64() < secs {
        let due = (start.elapsed().as_secs_f64() * rate) as u64;
        let n = due.saturating_sub(sent).min(targets.len() as u64) as usize;
        if n > 0 {
            let picked: Vec<&Target> = (0..n)
                .map(|j| &targets[(sent as usize + j) % targets.len()])
                .collect();
            let ids: Vec<String> = picked.iter().map(|t| t.id.clone()).collect();
            match fixtures::update_runs_status(&v.b.pool, &ids, "EXECUTING").await {
                Ok(rows) => {
                    let at: HashMap<String, i64> = rows.into_iter().collect();
                    let records: Vec<ChangeRecord> = picked
                        .iter()
                        .filter_map(|t| {
                            Some(ChangeRecord {
                                v: 1,
                                run_id: t.id.as_str().into(),
                                env_id: env_id.as_str().into(),
                                tags: Some(t.tags.clone()),
                                batch_id: t.batch.as_deref().map(Into::into),
                                updated_at_ms: Some(*at.get(&t.id)?),
                            })
                        })
                        .collect();
                    failed += (n - records.len()) as u64;
                    let results =
                        futures::future::join_all(records.iter().map(|r| v.b.publisher.publish(r)))
                            .await;
                    failed += results.iter().filter(|r| r.is_err()).count() as u64;
                }
                Err(_) => failed += n as u64,
            }
            sent += n as u64;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (sent, failed)
}

/// runfeed's select list for every column (`ALWAYS` then the other columns in wire order, as
/// `select_list` of `src/store/sql.rs` writes it).
fn select_all() -> String {
    let always = [
        Column::Id,
        Column::UpdatedAt,
        Column::CreatedAt,
        Column::RunTags,
        Column::FriendlyId,
        Column::TaskIdentifier,
        Column::Status,
    ];
    let mut out = String::from(
        r#"id, "updatedAt", "createdAt", "runTags", "batchId", "friendlyId", "taskIdentifier", status::text AS status"#,
    );
    for col in ColumnSet::ALL.columns().filter(|c| !always.contains(c)) {
        out.push_str(&format!(", \"{}\"", col.name()));
    }
    out
}

/// One explained set query.
enum SetQuery {
    Tags(Vec<String>),
    /// The ordered formulation runfeed sends for a tag frequent in a small environment
    /// (`src/store/tag_plan.rs`).
    TagsOrdered(Vec<String>),
    Unfiltered,
    Batch(String),
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of runfeed's set query `q` in `env` (the text of
/// `src/store/sql.rs`): the plan's lines.
async fn explain(
    v: &Volume,
    env: &DemoEnv,
    q: &SetQuery,
    limit: i64,
) -> anyhow::Result<Vec<String>> {
    let select = select_all();
    let sql = match q {
        SetQuery::Tags(_) => format!(
            r#"EXPLAIN (ANALYZE, BUFFERS) SELECT {select} FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "runTags" @> $2 AND "createdAt" >= $3 ORDER BY "createdAt" DESC, id DESC LIMIT $4"#
        ),
        SetQuery::TagsOrdered(_) => format!(
            r#"EXPLAIN (ANALYZE, BUFFERS) SELECT {select} FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND ("runTags" @> $2) IS TRUE AND "createdAt" >= $3 ORDER BY "createdAt" DESC, id DESC LIMIT $4"#
        ),
        SetQuery::Unfiltered => format!(
            r#"EXPLAIN (ANALYZE, BUFFERS) SELECT {select} FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "createdAt" >= $2 ORDER BY "createdAt" DESC, id DESC LIMIT $3"#
        ),
        SetQuery::Batch(_) => format!(
            r#"EXPLAIN (ANALYZE, BUFFERS) SELECT {select} FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "batchId" = $2 ORDER BY "createdAt" DESC, id DESC LIMIT $3"#
        ),
    };
    // Unprepared, as runfeed sends the tag set (a custom plan for these parameters).
    let query = sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(sql))
        .persistent(false)
        .bind(&env.env_id);
    let query = match q {
        SetQuery::Tags(tags) | SetQuery::TagsOrdered(tags) => {
            query.bind(tags).bind(v.floor).bind(limit)
        }
        SetQuery::Unfiltered => query.bind(v.floor).bind(limit),
        SetQuery::Batch(id) => query.bind(id).bind(limit),
    };
    query.fetch_all(&v.b.pool).await.context("EXPLAIN")
}

/// "Execution Time: X ms" of a plan.
fn execution_ms(plan: &[String]) -> Option<f64> {
    plan.iter()
        .find_map(|l| l.trim().strip_prefix("Execution Time: "))
        .and_then(|rest| rest.trim_end_matches(" ms").parse().ok())
}

/// The plans of the set queries: a rare, a mid and a common tag, `plan:free`, a pair,
/// unfiltered, another environment's most frequent `user:` tag, and the busy environment's
/// largest batch.
async fn explain_all(
    v: &Volume,
    a: &VolumeArgs,
    filters: &[Filter],
) -> anyhow::Result<(Vec<(String, Value)>, Value)> {
    let median = |band: &str| {
        let mut of: Vec<&Filter> = filters.iter().filter(|f| f.band == band).collect();
        of.sort_by_key(|f| f.matches);
        of.get(of.len() / 2).map(|f| (f.tags.clone(), f.matches))
    };
    let busy = &v.envs[0];
    let mut cases: Vec<(String, &DemoEnv, SetQuery)> = Vec::new();
    for band in ["rare", "mid"] {
        if let Some((tags, n)) = median(band) {
            cases.push((
                format!("{band} tag {} ({} runs)", tags.join(","), n.unwrap_or(0)),
                busy,
                SetQuery::Tags(tags),
            ));
        }
    }
    for f in filters.iter().filter(|f| f.band == "common") {
        let is_top_user = f.tags[0].starts_with("user:")
            && !filters.iter().any(|g| {
                g.band == "common" && g.tags[0].starts_with("user:") && g.matches > f.matches
            });
        if is_top_user || f.tags[0] == "plan:free" {
            cases.push((
                format!("common tag {} ({} runs)", f.tags[0], f.matches.unwrap_or(0)),
                busy,
                SetQuery::Tags(f.tags.clone()),
            ));
        }
    }
    if let Some(f) = filters.iter().find(|f| f.band == "pair") {
        cases.push((
            format!("pair {}", f.tags.join(",")),
            busy,
            SetQuery::Tags(f.tags.clone()),
        ));
    }
    cases.push(("unfiltered".into(), busy, SetQuery::Unfiltered));
    // The fairness probe's first feed: another (smaller) environment's most frequent `user:` tag.
    let other = v.envs.get(1).unwrap_or(busy);
    if let Some((tag, n)) = tag_counts(v, other)
        .await?
        .into_iter()
        .find(|(t, _)| t.starts_with("user:"))
    {
        cases.push((
            format!("another environment's tag {tag} ({n} runs)"),
            other,
            SetQuery::Tags(vec![tag.clone()]),
        ));
        cases.push((
            format!("another environment's tag {tag}, ordered (as runfeed sends it)"),
            other,
            SetQuery::TagsOrdered(vec![tag]),
        ));
    }
    let batch: Option<(String, i32)> = sqlx::query_as(
        r#"SELECT id, "runCount" FROM "BatchTaskRun" WHERE "runtimeEnvironmentId" = $1 ORDER BY "runCount" DESC LIMIT 1"#,
    )
    .bind(&v.envs[0].env_id)
    .fetch_optional(&v.b.pool)
    .await
    .context("find the largest batch")?;
    if let Some((id, n)) = batch {
        cases.push((format!("batch of {n} runs"), busy, SetQuery::Batch(id)));
    }
    let mut rows = Vec::new();
    let mut plans = serde_json::Map::new();
    for (name, env, q) in &cases {
        let plan = explain(v, env, q, a.set_limit).await?;
        println!("\n-- EXPLAIN (ANALYZE, BUFFERS): {name}");
        for line in &plan {
            println!("{line}");
        }
        rows.push((format!("explain: {name} (ms)"), opt(execution_ms(&plan))));
        plans.insert(name.clone(), json!(plan));
    }
    Ok((rows, Value::Object(plans)))
}

/// Adds `key: value` to the JSON object in `path` (the report `report_to` wrote).
fn add_to_json(path: &str, key: &str, value: Value) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {path}"))?;
    let mut doc: Value = serde_json::from_str(&text).with_context(|| format!("parse {path}"))?;
    if let Some(obj) = doc.as_object_mut() {
        obj.insert(key.to_string(), value);
    }
    std::fs::write(path, serde_json::to_string_pretty(&doc)?)
        .with_context(|| format!("write {path}"))
}

/// The probe feeds: the other environment's most frequent `user:` tags, runs and the largest
/// batches of the busy environment.
async fn probe_feeds(v: &Volume, n: usize) -> anyhow::Result<ProbeFeeds> {
    let other_env = Arc::new(v.envs.get(1).unwrap_or(&v.envs[0]).clone());
    let other: Vec<(Arc<DemoEnv>, Feed)> = tag_counts(v, &other_env)
        .await?
        .into_iter()
        .filter(|(t, _)| t.starts_with("user:"))
        .take(n)
        .map(|(t, _)| {
            (
                other_env.clone(),
                Feed::Tags {
                    tags: vec![t],
                    created_at: Some(v.window.clone()),
                },
            )
        })
        .collect();
    let runs: Vec<String> = sqlx::query_scalar(
        r#"SELECT "friendlyId" FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "createdAt" >= $2
           ORDER BY "createdAt" DESC LIMIT $3"#,
    )
    .bind(&v.envs[0].env_id)
    .bind(v.floor)
    .bind(i64::try_from(n * 97).unwrap_or(i64::MAX))
    .fetch_all(&v.b.pool)
    .await
    .context("pick probe runs")?;
    let batches: Vec<String> = sqlx::query_scalar(
        r#"SELECT "friendlyId" FROM "BatchTaskRun" WHERE "runtimeEnvironmentId" = $1 ORDER BY "runCount" DESC LIMIT $2"#,
    )
    .bind(&v.envs[0].env_id)
    .bind(i64::try_from(n).unwrap_or(i64::MAX))
    .fetch_all(&v.b.pool)
    .await
    .context("pick probe batches")?;
    Ok(ProbeFeeds {
        other,
        runs: runs.into_iter().step_by(97).map(Feed::Run).collect(),
        batches: batches.into_iter().map(Feed::Batch).collect(),
    })
}

pub(crate) async fn volume(a: VolumeArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let meta = GenMeta::read(&b.pool).await?;
    let Some(meta) = meta else {
        bail!(
            "{}: no `runfeed-bench gen` data (TaskRun has no gen comment)",
            a.common.database_url
        );
    };
    let envs = load_envs(&b.pool).await?;
    if envs.is_empty() {
        bail!("no {ENV_SLUG_PREFIX}* environments: run `runfeed-bench gen` first");
    }
    let now_ms = chrono::Utc::now().timestamp_millis();
    let window = if a.window == "auto" {
        let age = (now_ms - meta.end_ms).max(0);
        format!("{}m", (86_400_000 + age + 59_999) / 60_000)
    } else {
        a.window.clone()
    };
    let window_ms = humantime::parse_duration(&window)
        .with_context(|| format!("--window {window}"))?
        .as_millis();
    let floor = naive(now_ms - i64::try_from(window_ms).unwrap_or(i64::MAX / 2));
    let db_name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&b.pool)
        .await
        .context("current_database()")?;
    // pg_stat_statements where the server loads it: its view needs the extension in this
    // database (left out silently where it cannot be created).
    let preloaded: bool = sqlx::query_scalar(
        "SELECT current_setting('shared_preload_libraries') LIKE '%pg_stat_statements%'",
    )
    .fetch_one(&b.pool)
    .await
    .unwrap_or(false);
    if preloaded {
        let _ = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&b.pool)
            .await;
    }
    let stats = PgPoolOptions::new()
        .max_connections(2)
        .connect(&fixtures::database_url(&a.common.database_url, "postgres"))
        .await
        .context("connect to the postgres database (statistics)")?;
    let v = Volume {
        b: b.clone(),
        stats,
        db_name,
        envs,
        window: window.clone(),
        floor,
        server_log: a.server_log.clone(),
    };
    let busy = Arc::new(v.envs[0].clone());
    let t = Instant::now();
    let counts = tag_counts(&v, &busy).await?;
    let filters = pick_filters(&a, &counts);
    eprintln!(
        "volume: {} filters picked from {} tags in {:.1} s (window {window})",
        filters.len(),
        counts.len(),
        t.elapsed().as_secs_f64()
    );
    let params = json!({
        "k": a.k, "window": window, "idle_s": a.idle_s, "churn_per_sec": a.churn_per_sec,
        "probes": a.probes, "gen": meta, "database": v.db_name,
    });
    let mut rows: Vec<(String, Value)> = vec![(
        "busy environment: runs in the window".into(),
        json!(counts
            .iter()
            .filter(|(t, _)| t.starts_with("user:"))
            .map(|(_, n)| n)
            .sum::<i64>()),
    )];
    rows.extend(mix_rows(&filters));
    if a.explain_only {
        let (explained, plans) = explain_all(&v, &a, &filters).await?;
        rows.extend(explained);
        report(&a.common, "volume", params, rows)?;
        if let Some(path) = &a.common.json {
            add_to_json(path, "plans", plans)?;
        }
        return Ok(());
    }
    let probes = probe_feeds(&v, a.probes).await?;
    // Taken again after the idle phase, alone: what each snapshot costs without the stampede.
    let alone: Vec<(Arc<DemoEnv>, Feed)> = probes.other.clone();
    let targets = if a.churn_per_sec > 0.0 {
        churn_targets(&v).await?
    } else {
        Vec::new()
    };
    let feeds: Vec<Feed> = filters
        .iter()
        .map(|f| Feed::Tags {
            tags: f.tags.clone(),
            created_at: Some(window.clone()),
        })
        .collect();

    // Cold stampede, with the fairness probe beside it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c0 = v.counters().await;
    let cpu = PgCpu::start(&v).await;
    let done = Arc::new(AtomicBool::new(false));
    let sampler = AdmissionPeak::start(&b, Duration::from_millis(20));
    let started = Instant::now();
    let prober = probe_apart(ProbePlan {
        b: b.clone(),
        busy: busy.clone(),
        feeds: probes,
        n: a.probes,
        interval: Duration::from_millis(a.probe_interval_ms),
        done: done.clone(),
    });
    let tasks = spawn_snapshots(&b, &busy, &feeds);
    let mut lat = Vec::new();
    let mut snaps: Vec<Option<Resp>> = Vec::new();
    let (mut non_200, mut n_503, mut transport, mut bytes) = (0usize, 0usize, 0usize, 0usize);
    for t in tasks {
        match t.await {
            Ok((Some((r, len)), at)) => {
                if r.status == 200 {
                    lat.push(ms(at.duration_since(started)));
                    bytes += len;
                    snaps.push(Some(r));
                } else {
                    non_200 += 1;
                    n_503 += usize::from(r.status == 503);
                    snaps.push(None);
                }
            }
            _ => {
                transport += 1;
                snaps.push(None);
            }
        }
    }
    let stampede_ms = ms(started.elapsed());
    done.store(true, Ordering::Relaxed);
    let peak = sampler.stop().await;
    let pg_cpu = cpu.finish().await;
    let c1 = v.counters().await;
    let (rounds, mut probed) = tokio::task::spawn_blocking(move || prober.join())
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    lat.sort_by(f64::total_cmp);
    let answered = lat.len();
    rows.extend([
        (
            "cold: time to the last snapshot (ms)".to_string(),
            json!(stampede_ms),
        ),
        ("cold: snapshot p50 (ms)".into(), json!(pct(&lat, 50.0))),
        ("cold: snapshot p99 (ms)".into(), json!(pct(&lat, 99.0))),
        ("cold: snapshots answered 200".into(), json!(answered)),
        ("cold: snapshots not 200".into(), json!(non_200)),
        ("cold: snapshots answered 503".into(), json!(n_503)),
        ("cold: transport errors".into(), json!(transport)),
        (
            "cold: snapshot body mean (KB)".into(),
            json!(bytes as f64 / answered.max(1) as f64 / 1000.0),
        ),
        ("cold: peak admission in use".into(), json!(peak)),
        (
            "cold: postgres CPU per snapshot, runfeed backends (ms)".into(),
            opt(pg_cpu.0.map(|s| s * 1000.0 / feeds.len().max(1) as f64)),
        ),
    ]);
    rows.extend(phase_rows("cold", &c0, &c1, pg_cpu, false));
    if a.warm_k > 0 {
        tokio::time::sleep(Duration::from_millis(a.warm_after_ms)).await;
        let first: std::collections::HashSet<&Vec<String>> =
            filters.iter().map(|f| &f.tags).collect();
        let second = VolumeArgs {
            seed: a.seed + 1,
            k: a.warm_k + a.k,
            ..a.clone()
        };
        let warm: Vec<Feed> = pick_filters(&second, &counts)
            .into_iter()
            .filter(|f| !first.contains(&f.tags))
            .take(a.warm_k)
            .map(|f| Feed::Tags {
                tags: f.tags,
                created_at: Some(window.clone()),
            })
            .collect();
        rows.extend(warm_stampede(&v, &busy, &warm).await);
    }
    // What the busy environment's window (feeds.window_after_resolves) holds, and the process.
    rows.push((
        "windows: runs held after the stampedes".into(),
        opt(b.metric("runfeed_feeds_window_runs").await),
    ));
    rows.push((
        "windows: runfeed RSS after the stampedes (MiB)".into(),
        opt(b
            .metric("runfeed_process_resident_memory_bytes")
            .await
            .map(|v| v / 1_048_576.0)),
    ));
    rows.push(("probe: rounds".into(), json!(rounds)));
    let [other, run, batch] = &mut probed;
    rows.extend(other.rows("other environment's tag"));
    rows.extend(run.rows("run feed"));
    rows.extend(batch.rows("batch feed"));

    // Idle: every filter long-polls while nothing changes.
    let s = Arc::new(Follow::default());
    let held_before = b.metric("runfeed_router_held_feeds").await.unwrap_or(0.0) as usize;
    let followers: Vec<_> = feeds
        .iter()
        .zip(snaps)
        .map(|(feed, at)| {
            tokio::spawn(follow(b.clone(), s.clone(), busy.clone(), feed.clone(), at))
        })
        .collect();
    let all_held = b
        .wait_held(held_before + feeds.len(), Duration::from_secs(120))
        .await;
    // A follower counts as held once registered; one whose first live poll came after the
    // replay window (`router.replay_window_ms`: the warm stampede keeps the first stampede's
    // followers waiting) re-reads its filter after that. The idle phase starts once those
    // re-reads are done: no set read for a second.
    let settled = settle_reads(&b, Duration::from_secs(120)).await;
    rows.push(("idle: every feed held".into(), json!(all_held)));
    rows.push((
        "idle: set reads settled before the phase".into(),
        json!(settled),
    ));
    let mut phases = vec![("idle", 0.0)];
    if a.churn_per_sec > 0.0 {
        phases.push(("churn", a.churn_per_sec));
    }
    for (phase, rate) in phases {
        let (p0, e0, ch0) = (
            s.polls.load(Ordering::Relaxed),
            s.errors.load(Ordering::Relaxed),
            s.changes.load(Ordering::Relaxed),
        );
        eprintln!(
            "[volume] {phase} phase from {}",
            chrono::Utc::now().to_rfc3339()
        );
        let c0 = v.counters().await;
        let cpu = PgCpu::start(&v).await;
        let (sent, failed) = if rate > 0.0 {
            churn(&v, &targets, rate, a.idle_s).await
        } else {
            tokio::time::sleep(Duration::from_secs_f64(a.idle_s)).await;
            (0, 0)
        };
        let pg_cpu = cpu.finish().await;
        let c1 = v.counters().await;
        let secs = pg_cpu.2;
        let polls = s.polls.load(Ordering::Relaxed) - p0;
        rows.push((
            format!("{phase}: ended polls/s"),
            json!(polls as f64 / secs),
        ));
        rows.push((
            format!("{phase}: client errors"),
            json!(s.errors.load(Ordering::Relaxed) - e0),
        ));
        if rate > 0.0 {
            rows.push((
                format!("{phase}: changes published/s"),
                json!(sent as f64 / secs),
            ));
            rows.push((format!("{phase}: change failures"), json!(failed)));
            rows.push((
                format!("{phase}: rows delivered/s"),
                json!((s.changes.load(Ordering::Relaxed) - ch0) as f64 / secs),
            ));
        }
        rows.extend(phase_rows(phase, &c0, &c1, pg_cpu, true));
    }
    rows.push((
        "snapshots retaken by followers".into(),
        json!(s.resnapshots.load(Ordering::Relaxed)),
    ));
    s.stop.store(true, Ordering::Relaxed);
    for f in &followers {
        f.abort();
    }
    rows.extend(probe_alone(&b, &alone[..rounds.min(alone.len())]).await);
    let plans = if a.explain {
        let (explained, plans) = explain_all(&v, &a, &filters).await?;
        rows.extend(explained);
        Some(plans)
    } else {
        None
    };
    report(&a.common, "volume", params, rows)?;
    if let (Some(path), Some(plans)) = (&a.common.json, plans) {
        add_to_json(path, "plans", plans)?;
    }
    Ok(())
}
