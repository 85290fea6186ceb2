//! `runfeed-bench`: drives any server that speaks trigger.dev's realtime run-feed endpoints
//! (Electric shape protocol) and measures it . It seeds what it needs into the
//! server's database (an environment and runs, written like trigger.dev writes them), mints
//! public tokens, and publishes change records on Redis (Postgres update + change record).
//!
//! Scenarios: `held`, `fanout`, `churn`, `stampede`, `idle` (see README "Benchmarks"); `held`,
//! `fanout` and `churn` take `--transport long-poll|sse|both` (SSE live mode, `live_sse=true`;
//! `both` measures the two in one run, on the same server, one after the other); plus
//! `bare`, a tiny axum server that parks every request (the baseline of `held`), and `check`,
//! the delivery checker (README "Correctness checker", `runfeed_dev::check`). Each scenario
//! prints a table and, with `--json FILE`, writes its figures as JSON.
//!
//! Server-side figures come from the admin `/metrics` (`--admin-url`) and, for CPU/RSS of a
//! local server, from `/proc/<pid>` (`--server-pid`).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use futures::stream::{self, StreamExt};
use rand::Rng;
use runfeed::auth::mint_public_token;
use runfeed::changes::ChangeRecord;
use runfeed::redis::{Publisher, RedisOptions};
use runfeed_dev::fixtures::{self, DemoEnv, RunSpec, RunUpdate};
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

const ELECTRIC_VERSION: &str = "1.0.0-beta.1";

#[derive(Parser)]
#[command(
    name = "runfeed-bench",
    about = "Benchmarks a realtime run-feed server"
)]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand)]
enum Scenario {
    /// N live feeds parked: server RSS per held feed vs a bare axum server parking N requests.
    Held(HeldArgs),
    /// F feeds on one tag, one change: time until the last feed has its response.
    Fanout(FanoutArgs),
    /// R changes/s over E environments with H held feeds: publish → delivery latency.
    Churn(ChurnArgs),
    /// K distinct tag filters connect at once (cold): time to all snapshots.
    Stampede(StampedeArgs),
    /// H idle held feeds: requests/s, Postgres queries/s and CPU while nothing changes.
    Idle(IdleArgs),
    /// A bare axum server that parks every request for `--hold-ms` (the `held` baseline).
    Bare(BareArgs),
    /// Fleet, step 1: an environment with a hot run (tag `hot`) and a cold run, written as
    /// JSON to `--out` for the `fleet-hold` processes (scripts/fleet-bench.sh).
    FleetSetup(FleetSetupArgs),
    /// Fleet, step 2: park `--idle` run feeds (re-polled as holds expire) and `--hot` tag feeds
    /// over several instances (`--base-url a,b,c`), then time the hot feeds' responses to the
    /// change `fleet-change` announces in `--go-file`.
    FleetHold(FleetHoldArgs),
    /// Fleet, step 3: one change of the hot run; writes its publish time (Unix ms) to
    /// `--go-file`.
    FleetChange(FleetChangeArgs),
    /// The randomized, fault-injecting delivery checker (README "Correctness checker"): starts
    /// its own instances, database and Redis, writes, reads and injects faults, then checks
    /// six delivery properties. Exit status 1 on a violation not marked `--known`.
    Check(Box<runfeed_dev::check::CheckArgs>),
}

#[derive(Args, Clone)]
struct Common {
    /// The server's base URL (e.g. http://127.0.0.1:3030).
    #[arg(long, env = "BENCH_BASE_URL")]
    base_url: String,
    /// The database the server reads (the tool writes environments and runs into it).
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// The Redis the server subscribes to (change records are published there).
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// The server's admin listener (/metrics), e.g. http://127.0.0.1:9464.
    #[arg(long, env = "BENCH_ADMIN_URL")]
    admin_url: Option<String>,
    /// The server's pid, for CPU seconds and RSS from /proc (local servers only).
    #[arg(long)]
    server_pid: Option<u32>,
    /// Spread client connections over this many source addresses 127.0.0.1.. (≈ 28 000
    /// connections per address).
    #[arg(long, default_value_t = 1)]
    source_addrs: u8,
    /// The first source address is 127.0.0.(1 + this): several bench processes can use
    /// disjoint addresses (`fleet-hold`).
    #[arg(long, default_value_t = 0)]
    first_source: u8,
    /// Write the figures as JSON to this file.
    #[arg(long)]
    json: Option<String>,
}

#[derive(Args)]
struct HeldArgs {
    #[command(flatten)]
    common: Common,
    /// Held feeds.
    #[arg(long, default_value_t = 2000)]
    n: usize,
    /// How long to keep them parked after all are held (ms).
    #[arg(long, default_value_t = 1000)]
    settle_ms: u64,
    /// Skip the bare-axum baseline.
    #[arg(long)]
    no_bare: bool,
    /// Which feeds to park: one run's feed (the issue's unit) or one tag's.
    #[arg(long, value_enum, default_value_t = FeedKind::Run)]
    kind: FeedKind,
    /// Long-polls, SSE streams, or both (one pass each).
    #[arg(long, value_enum, default_value_t = Transport::LongPoll)]
    transport: Transport,
}

/// How a held feed waits: a live long-poll, or an SSE stream (`live_sse=true`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Transport {
    LongPoll,
    Sse,
    Both,
}

impl Transport {
    /// The passes to run: `false` = long-poll, `true` = SSE.
    fn passes(self) -> Vec<bool> {
        match self {
            Transport::LongPoll => vec![false],
            Transport::Sse => vec![true],
            Transport::Both => vec![false, true],
        }
    }
}

/// `"<figure>"`, or `"<figure> [sse]"` / `"… [long-poll]"` when several passes share a table.
fn label(figure: &str, sse: bool, several: bool) -> String {
    match (several, sse) {
        (false, _) => figure.to_string(),
        (true, true) => format!("{figure} [sse]"),
        (true, false) => format!("{figure} [long-poll]"),
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum FeedKind {
    Run,
    Tag,
}

#[derive(Args)]
struct FanoutArgs {
    #[command(flatten)]
    common: Common,
    /// Feeds on the hot tag.
    #[arg(long, default_value_t = 1000)]
    f: usize,
    /// Long-polls, SSE streams, or both (one pass each).
    #[arg(long, value_enum, default_value_t = Transport::LongPoll)]
    transport: Transport,
    /// Pause between "all held" and the change, ms (time to zero a profiler's counters, e.g.
    /// `callgrind_control -z`).
    #[arg(long, default_value_t = 300)]
    settle_ms: u64,
    /// Keep the connections open this long after printing the figures, ms (a profiler can stop
    /// before their teardown, e.g. `callgrind_control -d`).
    #[arg(long, default_value_t = 0)]
    linger_ms: u64,
}

#[derive(Args)]
struct ChurnArgs {
    #[command(flatten)]
    common: Common,
    /// Changes per second.
    #[arg(long, default_value_t = 50.0)]
    rate: f64,
    /// Environments.
    #[arg(long, default_value_t = 4)]
    envs: usize,
    /// Held feeds (spread over the environments; each follows one run's tag).
    #[arg(long, default_value_t = 200)]
    held: usize,
    /// Runs per environment (each with its own tag).
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Duration of the churn (s).
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// What each held feed follows: one run's tag (default) or the run itself.
    #[arg(long, value_enum, default_value_t = FeedKind::Tag)]
    kind: FeedKind,
    /// Long-polls, SSE streams, or both (one pass each).
    #[arg(long, value_enum, default_value_t = Transport::LongPoll)]
    transport: Transport,
}

#[derive(Args)]
struct StampedeArgs {
    #[command(flatten)]
    common: Common,
    /// Distinct tag filters connecting at once.
    #[arg(long, default_value_t = 1000)]
    k: usize,
}

#[derive(Args)]
struct IdleArgs {
    #[command(flatten)]
    common: Common,
    /// Idle held feeds.
    #[arg(long, default_value_t = 1000)]
    held: usize,
    /// Distinct feeds they are spread over: tags (`--kind tag`) or runs (`--kind run`).
    #[arg(long, default_value_t = 50)]
    distinct: usize,
    /// Tag feeds (re-resolved by the reference at every backstop) or run feeds.
    #[arg(long, value_enum, default_value_t = FeedKind::Tag)]
    kind: FeedKind,
    /// Measurement window (s); longer than a hold (20 s) to include the backstops.
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
}

#[derive(Args)]
struct BareArgs {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    #[arg(long, default_value_t = 600_000)]
    hold_ms: u64,
}

#[derive(Args)]
struct FleetSetupArgs {
    #[command(flatten)]
    common: Common,
    /// Where to write the environment and runs (JSON).
    #[arg(long)]
    out: String,
}

#[derive(Args)]
struct FleetHoldArgs {
    #[command(flatten)]
    common: Common,
    /// The JSON `fleet-setup` wrote.
    #[arg(long)]
    setup: String,
    /// Idle run feeds (the cold run), spread round-robin over the instances.
    #[arg(long, default_value_t = 1000)]
    idle: usize,
    /// Hot tag feeds (tag `hot`), spread round-robin over the instances.
    #[arg(long, default_value_t = 100)]
    hot: usize,
    /// The file `fleet-change` writes the publish time into.
    #[arg(long)]
    go_file: String,
    /// Give up waiting for the change after this long (s).
    #[arg(long, default_value_t = 300.0)]
    max_wait_s: f64,
}

#[derive(Args)]
struct FleetChangeArgs {
    #[command(flatten)]
    common: Common,
    /// The JSON `fleet-setup` wrote.
    #[arg(long)]
    setup: String,
    /// Where to write the publish time (Unix ms).
    #[arg(long)]
    go_file: String,
}

// ---------------------------------------------------------------- harness

struct Bench {
    c: Common,
    base: String,
    pool: PgPool,
    publisher: Publisher,
    clients: Vec<reqwest::Client>,
    next_client: AtomicUsize,
    probe: reqwest::Client,
}

/// A parsed feed response.
struct Resp {
    status: u16,
    handle: Option<String>,
    offset: Option<String>,
    cursor: Option<String>,
    body: Value,
}

impl Resp {
    /// `(run id, updatedAt)` of every change message.
    fn changed_ids(&self) -> Vec<String> {
        self.body
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|m| m.get("key").is_some())
                    .filter_map(|m| m["value"]["id"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// What a feed follows: a tag (`/realtime/v1/runs?tags=`) or one run (`/realtime/v1/runs/<id>`).
#[derive(Clone, Debug)]
enum Feed {
    Tag(String),
    /// A run's friendly id (`run_…`).
    Run(String),
}

impl Feed {
    fn tag(tag: &str) -> Feed {
        Feed::Tag(tag.to_string())
    }

    /// The path and the query parameters that select the feed.
    fn path_and_params(&self) -> (String, Vec<(&'static str, String)>) {
        match self {
            Feed::Tag(tag) => (
                "/realtime/v1/runs".into(),
                vec![("tags", tag.clone()), ("log", "full".into())],
            ),
            Feed::Run(id) => (format!("/realtime/v1/runs/{id}"), Vec::new()),
        }
    }

    /// The public-token scope that reads it.
    fn scope(&self) -> String {
        match self {
            Feed::Tag(tag) => format!("read:tags:{tag}"),
            Feed::Run(id) => format!("read:runs:{id}"),
        }
    }
}

/// An SSE response being read (`data:` events; comments skipped).
struct SseReader {
    status: u16,
    resp: reqwest::Response,
    buf: String,
}

impl SseReader {
    /// The next event's data; `None` when the stream ended (or failed).
    async fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(at) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..at + 2).collect();
                let data: Vec<&str> = block
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if data.is_empty() {
                    continue; // a comment (keep-alive)
                }
                return Some(data.join("\n"));
            }
            match self.resp.chunk().await {
                Ok(Some(bytes)) => self.buf.push_str(&String::from_utf8_lossy(&bytes)),
                _ => return None,
            }
        }
    }
}

fn client_for(i: u8) -> anyhow::Result<reqwest::Client> {
    let ip = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1 + i));
    Ok(reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(100_000)
        .local_address(ip)
        .timeout(Duration::from_secs(300))
        .build()?)
}

impl Bench {
    async fn new(c: Common) -> anyhow::Result<Bench> {
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(&c.database_url)
            .await
            .context("connect to --database-url")?;
        let publisher = Publisher::connect(&RedisOptions::standalone(&c.redis_url))
            .await
            .map_err(|e| anyhow::anyhow!("connect to --redis-url: {e}"))?;
        let clients = (0..c.source_addrs.max(1))
            .map(|i| client_for(c.first_source.saturating_add(i)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Bench {
            base: c.base_url.trim_end_matches('/').to_string(),
            c,
            pool,
            publisher,
            clients,
            next_client: AtomicUsize::new(0),
            probe: reqwest::Client::builder().no_proxy().build()?,
        })
    }

    fn client(&self) -> &reqwest::Client {
        let i = self.next_client.fetch_add(1, Ordering::Relaxed);
        &self.clients[i % self.clients.len()]
    }

    async fn env(&self) -> anyhow::Result<DemoEnv> {
        fixtures::create_env(&self.pool, "DEVELOPMENT").await
    }

    async fn tagged_run(&self, env: &DemoEnv, tag: &str) -> anyhow::Result<String> {
        let spec = RunSpec {
            tags: Some(vec![tag.to_string()]),
            ..RunSpec::default()
        };
        Ok(fixtures::create_run(&self.pool, env, spec).await?.id)
    }

    /// Updates a run (Postgres) and publishes its change record (Redis), like trigger.dev.
    async fn change(&self, env: &DemoEnv, run_id: &str, tag: &str) -> anyhow::Result<()> {
        let status = if rand::rng().random_bool(0.5) {
            "EXECUTING"
        } else {
            "PENDING"
        };
        let ms = fixtures::update_run(
            &self.pool,
            run_id,
            RunUpdate {
                status: Some(status.into()),
                ..RunUpdate::default()
            },
        )
        .await?;
        let record = ChangeRecord {
            v: 1,
            run_id: run_id.into(),
            env_id: env.env_id.as_str().into(),
            tags: Some(vec![tag.to_string()]),
            batch_id: None,
            updated_at_ms: Some(ms),
        };
        self.publisher
            .publish(&record)
            .await
            .map_err(|e| anyhow::anyhow!("publish: {e}"))?;
        Ok(())
    }

    fn token(env: &DemoEnv, feed: &Feed) -> String {
        mint_public_token(
            &env.api_key,
            &env.env_id,
            &[feed.scope()],
            Duration::from_secs(3600),
            None,
        )
        .expect("mint token")
    }

    async fn get(
        &self,
        client: &reqwest::Client,
        token: &str,
        path: &str,
        params: &[(&str, String)],
    ) -> anyhow::Result<Resp> {
        self.get_at(&self.base, client, token, path, params).await
    }

    /// [`Bench::get`] against another instance (`base`, e.g. `http://127.0.0.1:3101`).
    async fn get_at(
        &self,
        base: &str,
        client: &reqwest::Client,
        token: &str,
        path: &str,
        params: &[(&str, String)],
    ) -> anyhow::Result<Resp> {
        let resp = client
            .get(format!("{base}{path}"))
            .query(params)
            .header("authorization", format!("Bearer {token}"))
            .header("x-trigger-electric-version", ELECTRIC_VERSION)
            .send()
            .await?;
        let status = resp.status().as_u16();
        let h = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let (handle, offset, cursor) = (
            h("electric-handle"),
            h("electric-offset"),
            h("electric-cursor"),
        );
        let text = resp.text().await?;
        Ok(Resp {
            status,
            handle,
            offset,
            cursor,
            body: serde_json::from_str(&text).unwrap_or(Value::Null),
        })
    }

    async fn snapshot(&self, token: &str, feed: &Feed) -> anyhow::Result<Resp> {
        let (path, mut params) = feed.path_and_params();
        params.push(("offset", "-1".into()));
        let r = self.get(self.client(), token, &path, &params).await?;
        if r.status != 200 {
            bail!("snapshot of {feed:?}: status {}", r.status);
        }
        Ok(r)
    }

    async fn live(
        &self,
        client: &reqwest::Client,
        token: &str,
        feed: &Feed,
        at: &Resp,
    ) -> anyhow::Result<Resp> {
        let (path, mut params) = feed.path_and_params();
        params.extend([
            ("cursor", at.cursor.clone().unwrap_or_default()),
            ("handle", at.handle.clone().unwrap_or_default()),
            ("live", "true".into()),
            ("offset", at.offset.clone().unwrap_or_else(|| "-1".into())),
        ]);
        self.get(client, token, &path, &params).await
    }

    /// Opens an SSE stream (`live=true&live_sse=true`) at response `at`'s handle and offset.
    async fn open_sse(
        &self,
        client: &reqwest::Client,
        token: &str,
        feed: &Feed,
        at: &Resp,
        offset: Option<&str>,
    ) -> anyhow::Result<SseReader> {
        let (path, mut params) = feed.path_and_params();
        let offset = offset
            .map(str::to_string)
            .or_else(|| at.offset.clone())
            .unwrap_or_else(|| "-1".into());
        params.extend([
            ("cursor", at.cursor.clone().unwrap_or_default()),
            ("handle", at.handle.clone().unwrap_or_default()),
            ("live", "true".into()),
            ("live_sse", "true".into()),
            ("offset", offset),
        ]);
        let resp = client
            .get(format!("{}{path}", self.base))
            .query(&params)
            .header("authorization", format!("Bearer {token}"))
            .header("x-trigger-electric-version", ELECTRIC_VERSION)
            .header("accept", "text/event-stream")
            .send()
            .await?;
        Ok(SseReader {
            status: resp.status().as_u16(),
            resp,
            buf: String::new(),
        })
    }

    /// Waits until the server holds at most `n` feeds (router gauge), at most `limit`.
    async fn wait_released(&self, n: usize, limit: Duration) {
        if self.c.admin_url.is_none() {
            tokio::time::sleep(Duration::from_millis(500)).await;
            return;
        }
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let held = self
                .metric("runfeed_router_held_feeds")
                .await
                .unwrap_or(0.0);
            if held <= n as f64 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The admin /metrics text ("" without --admin-url).
    async fn scrape(&self) -> String {
        let Some(admin) = &self.c.admin_url else {
            return String::new();
        };
        let url = format!("{}/metrics", admin.trim_end_matches('/'));
        match self.probe.get(url).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Sum of every sample of `name` (None when absent).
    async fn metric(&self, name: &str) -> Option<f64> {
        metric_sum(&self.scrape().await, name)
    }

    /// Waits until the server holds at least `n` feeds (router gauge), at most `limit`.
    async fn wait_held(&self, n: usize, limit: Duration) -> bool {
        if self.c.admin_url.is_none() {
            tokio::time::sleep(Duration::from_millis(500)).await;
            return true;
        }
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self
                .metric("runfeed_router_held_feeds")
                .await
                .unwrap_or(0.0)
                >= n as f64
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// Server RSS: /proc/<pid> if given, else the process metric.
    async fn server_rss(&self) -> Option<f64> {
        match self.c.server_pid {
            Some(pid) => proc_rss(pid),
            None => self.metric("runfeed_process_resident_memory_bytes").await,
        }
    }

    fn server_cpu(&self) -> Option<f64> {
        self.c.server_pid.and_then(proc_cpu_s)
    }
}

fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        if let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

fn page_size() -> f64 {
    4096.0
}

fn proc_rss(pid: u32) -> Option<f64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let resident: f64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(resident * page_size())
}

fn proc_cpu_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the ")" of the command name: state is field 3; utime 14, stime 15.
    let after = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// This process's CPU time (user + system), s.
fn own_cpu_s() -> Option<f64> {
    proc_cpu_s(std::process::id())
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn opt(v: Option<f64>) -> Value {
    v.map(|x| json!(x)).unwrap_or(Value::Null)
}

fn delta(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(b? - a?)
}

/// Prints `rows` as a two-column table and writes `{scenario, params, figures}` JSON.
fn report<K: AsRef<str>>(
    c: &Common,
    scenario: &str,
    params: Value,
    rows: Vec<(K, Value)>,
) -> anyhow::Result<()> {
    println!("\n{scenario}  {params}");
    println!("{:<44} {:>16}", "figure", "value");
    println!("{:-<44} {:->16}", "", "");
    let mut figures = serde_json::Map::new();
    for (k, v) in rows {
        let k = k.as_ref();
        let shown = match &v {
            Value::Number(n) => {
                let f = n.as_f64().unwrap_or(0.0);
                if f.fract() == 0.0 && f.abs() < 1e15 {
                    format!("{}", f as i64)
                } else {
                    format!("{f:.3}")
                }
            }
            Value::Null => "n/a".to_string(),
            other => other.to_string(),
        };
        println!("{k:<44} {shown:>16}");
        figures.insert(k.to_string(), v);
    }
    if let Some(path) = &c.json {
        let out = json!({
            "scenario": scenario,
            "params": params,
            "figures": figures,
            "at": chrono::Utc::now().to_rfc3339(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("write {path}"))?;
    }
    Ok(())
}

/// Parks `n` live polls of `tag` at `at` (one task each); returns their handles and the
/// time each finished (with its response status).
/// What [`park`] parks: `n` live requests of `feed` at response `at`, long-polls or (`sse`) SSE
/// streams.
struct Park<'a> {
    n: usize,
    token: &'a str,
    feed: &'a Feed,
    at: &'a Arc<Resp>,
    sse: bool,
}

/// Parks live requests (long-polls, or SSE streams); each task ends with the
/// status and the time of the response (SSE: of the stream's first event).
fn park(b: &Arc<Bench>, p: Park<'_>) -> Vec<tokio::task::JoinHandle<(Option<u16>, Instant)>> {
    let sse = p.sse;
    (0..p.n)
        .map(|_| {
            let b = b.clone();
            let token = p.token.to_string();
            let feed = p.feed.clone();
            let at = p.at.clone();
            tokio::spawn(async move {
                let client = b.client().clone();
                if sse {
                    let Ok(mut reader) = b.open_sse(&client, &token, &feed, &at, None).await else {
                        return (None, Instant::now());
                    };
                    let status = reader.status;
                    let got = reader.next_data().await;
                    return (got.map(|_| status), Instant::now());
                }
                let r = b.live(&client, &token, &feed, &at).await;
                (r.ok().map(|r| r.status), Instant::now())
            })
        })
        .collect()
}

// ---------------------------------------------------------------- scenarios

async fn held(a: HeldArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let passes = a.transport.passes();
    let several = passes.len() > 1;
    let mut rows: Vec<(String, Value)> = Vec::new();
    for sse in passes {
        let env = b.env().await?;
        let run_id = b.tagged_run(&env, "held").await?;
        let feed = match a.kind {
            FeedKind::Run => Feed::Run(format!("run_{run_id}")),
            FeedKind::Tag => Feed::tag("held"),
        };
        let token = Bench::token(&env, &feed);
        let snap = Arc::new(b.snapshot(&token, &feed).await?);
        // Let the environment's subscription confirm, then measure before/after.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let rss_before = b.server_rss().await;
        let held_before = b.metric("runfeed_router_held_feeds").await.unwrap_or(0.0) as usize;
        let started = Instant::now();
        let park_what = Park {
            n: a.n,
            token: &token,
            feed: &feed,
            at: &snap,
            sse,
        };
        let tasks = park(&b, park_what);
        let all_held = b
            .wait_held(held_before + a.n, Duration::from_secs(60))
            .await;
        let time_to_hold = started.elapsed();
        tokio::time::sleep(Duration::from_millis(a.settle_ms)).await;
        let rss_after = b.server_rss().await;
        for t in &tasks {
            t.abort();
        }
        b.wait_released(held_before, Duration::from_secs(30)).await;
        let per_feed = delta(rss_before, rss_after).map(|d| d / a.n as f64);
        let l = |figure: &str| label(figure, sse, several);
        rows.extend([
            (l("all feeds held"), json!(all_held)),
            (l("time to hold all (ms)"), json!(ms(time_to_hold))),
            (
                l("server RSS before (MiB)"),
                opt(rss_before.map(|x| x / 1048576.0)),
            ),
            (
                l("server RSS held (MiB)"),
                opt(rss_after.map(|x| x / 1048576.0)),
            ),
            (
                l("server RSS per held feed (KiB)"),
                opt(per_feed.map(|x| x / 1024.0)),
            ),
        ]);
    }

    // Bare axum baseline: a child process parking the same number of requests.
    let mut bare_per_feed = None;
    if !a.no_bare {
        bare_per_feed = bare_baseline(&b, a.n, a.settle_ms).await.ok();
    }
    rows.push((
        "bare axum RSS per parked request (KiB)".into(),
        opt(bare_per_feed.map(|x| x / 1024.0)),
    ));
    report(
        &a.common,
        "held",
        json!({"n": a.n, "kind": format!("{:?}", a.kind).to_lowercase(), "transport": format!("{:?}", a.transport).to_lowercase()}),
        rows,
    )
}

async fn bare_baseline(b: &Arc<Bench>, n: usize, settle_ms: u64) -> anyhow::Result<f64> {
    use tokio::io::AsyncBufReadExt;
    let exe = std::env::current_exe()?;
    let mut child = tokio::process::Command::new(exe)
        .args(["bare", "--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().context("bare pid")?;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await??
        .context("bare server printed nothing")?;
    let base = line
        .strip_prefix("bare listening on ")
        .context("bare server banner")?
        .to_string();
    let counter = format!("{base}/count");
    let rss_before = proc_rss(pid).context("bare rss")?;
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let client = b.client().clone();
            let url = format!("{base}/realtime/v1/runs?live=true");
            tokio::spawn(async move { client.get(url).send().await.map(|r| r.status()) })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let parked: usize = b
            .probe
            .get(&counter)
            .send()
            .await?
            .text()
            .await?
            .trim()
            .parse()
            .unwrap_or(0);
        if parked >= n || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(settle_ms)).await;
    let rss_after = proc_rss(pid).context("bare rss")?;
    for t in tasks {
        t.abort();
    }
    let _ = child.kill().await;
    Ok((rss_after - rss_before) / n as f64)
}

async fn bare(a: BareArgs) -> anyhow::Result<()> {
    use axum::routing::get;
    let parked = Arc::new(AtomicUsize::new(0));
    let hold = Duration::from_millis(a.hold_ms);
    let p1 = parked.clone();
    let p2 = parked.clone();
    let app = axum::Router::new()
        .route(
            "/count",
            get(move || {
                let p = p2.clone();
                async move { p.load(Ordering::Relaxed).to_string() }
            }),
        )
        .fallback(move || {
            let p = p1.clone();
            async move {
                p.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(hold).await;
                p.fetch_sub(1, Ordering::Relaxed);
                r#"[{"headers":{"control":"up-to-date"}}]"#
            }
        });
    let listener = tokio::net::TcpListener::bind(&a.listen).await?;
    println!("bare listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

async fn fanout(a: FanoutArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let passes = a.transport.passes();
    let several = passes.len() > 1;
    let mut rows: Vec<(String, Value)> = Vec::new();
    for sse in passes {
        let env = b.env().await?;
        let hot = b.tagged_run(&env, "hot").await?;
        let token = Bench::token(&env, &Feed::tag("hot"));
        let snap = Arc::new(b.snapshot(&token, &Feed::tag("hot")).await?);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let held_before = b.metric("runfeed_router_held_feeds").await.unwrap_or(0.0) as usize;
        let park_what = Park {
            n: a.f,
            token: &token,
            feed: &Feed::tag("hot"),
            at: &snap,
            sse,
        };
        let tasks = park(&b, park_what);
        let all_held = b
            .wait_held(held_before + a.f, Duration::from_secs(60))
            .await;
        // New connections while nothing happens, then while the change wakes every feed: the
        // accept loop must keep its turn.
        let idle_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let idle_probe = accept_probe(b.base.clone(), idle_stop.clone());
        tokio::time::sleep(Duration::from_millis(200)).await;
        idle_stop.store(true, Ordering::Relaxed);
        let mut idle_probe = idle_probe.join().unwrap_or_default();
        // Let any cold re-checks finish before the baseline.
        tokio::time::sleep(Duration::from_millis(a.settle_ms)).await;
        let q0 = b.metric("runfeed_pg_queries_total").await;
        let s0 = b.metric("runfeed_router_distinct_runs_total").await;
        let d0 = b.metric("runfeed_router_deliveries_total").await;
        let cpu0 = b.server_cpu();
        let client_cpu0 = own_cpu_s();
        let probe_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let probe = accept_probe(b.base.clone(), probe_stop.clone());
        let published = Instant::now();
        b.change(&env, &hot, "hot").await?;
        let mut lat = Vec::with_capacity(a.f);
        let mut errors = 0usize;
        for t in tasks {
            match tokio::time::timeout(Duration::from_secs(120), t).await {
                Ok(Ok((Some(200), at))) => lat.push(ms(at.duration_since(published))),
                _ => errors += 1,
            }
        }
        // CPU from the publish to the last response (the server's includes the hydrate).
        let server_cpu = delta(cpu0, b.server_cpu());
        let client_cpu = delta(client_cpu0, own_cpu_s());
        let per_response_us = |cpu: Option<f64>| opt(cpu.map(|s| s * 1e6 / a.f.max(1) as f64));
        probe_stop.store(true, Ordering::Relaxed);
        let mut during = probe.join().unwrap_or_default();
        during.sort_by(f64::total_cmp);
        idle_probe.sort_by(f64::total_cmp);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let q1 = b.metric("runfeed_pg_queries_total").await;
        let s1 = b.metric("runfeed_router_distinct_runs_total").await;
        let d1 = b.metric("runfeed_router_deliveries_total").await;
        // SSE streams stay open after their first event: end them before the next pass.
        b.wait_released(held_before + a.f, Duration::from_secs(1))
            .await;
        lat.sort_by(f64::total_cmp);
        let l = |figure: &str| label(figure, sse, several);
        rows.extend([
            (l("all feeds held"), json!(all_held)),
            (l("responses"), json!(lat.len())),
            (l("errors"), json!(errors)),
            (l("last response p50 (ms)"), json!(pct(&lat, 50.0))),
            (l("last response p99 (ms)"), json!(pct(&lat, 99.0))),
            (
                l("last response max (ms)"),
                json!(lat.last().copied().unwrap_or(f64::NAN)),
            ),
            (l("postgres queries for the change"), opt(delta(q0, q1))),
            (
                l("serializations (router distinct runs)"),
                opt(delta(s0, s1)),
            ),
            (l("router deliveries"), opt(delta(d0, d1))),
            (l("server CPU for the change (s)"), opt(server_cpu)),
            (
                l("server CPU per response (us)"),
                per_response_us(server_cpu),
            ),
            (
                l("bench client CPU per response (us)"),
                per_response_us(client_cpu),
            ),
            (
                l("new connection answered, idle p50 (ms)"),
                json!(pct(&idle_probe, 50.0)),
            ),
            (
                l("new connections answered during the wake"),
                json!(during.len()),
            ),
            (
                l("new connection answered during the wake, p50 (ms)"),
                json!(pct(&during, 50.0)),
            ),
            (
                l("new connection answered during the wake, max (ms)"),
                json!(during.last().copied().unwrap_or(f64::NAN)),
            ),
        ]);
    }
    report(
        &a.common,
        "fanout",
        json!({"f": a.f, "transport": format!("{:?}", a.transport).to_lowercase()}),
        rows,
    )?;
    tokio::time::sleep(Duration::from_millis(a.linger_ms)).await;
    Ok(())
}

/// One fresh TCP connection's `GET /healthz` (connect → first response byte), ms; `None` when it
/// fails.
async fn answer_new_connection(base: &str) -> Option<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.strip_prefix("http://")?.trim_end_matches('/');
    let started = Instant::now();
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET /healthz HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut first = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut first)).await;
    matches!(read, Ok(Ok(1))).then(|| ms(started.elapsed()))
}

/// New-connection answer times (ms), one probe every 2 ms until `stop` is set. The probe runs on
/// a thread and runtime of its own, so the bench's own busy workers (reading thousands of
/// responses) do not delay it.
fn accept_probe(
    base: String,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<f64>> {
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return Vec::new();
        };
        rt.block_on(async {
            let mut times = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                times.extend(answer_new_connection(&base).await);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            times
        })
    })
}

async fn churn(a: ChurnArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let passes = a.transport.passes();
    let several = passes.len() > 1;
    let mut rows = Vec::new();
    for sse in passes {
        rows.extend(churn_pass(&b, &a, sse, several).await?);
    }
    report(
        &a.common,
        "churn",
        json!({"rate": a.rate, "envs": a.envs, "held": a.held, "runs_per_env": a.runs, "duration_s": a.duration_s, "transport": format!("{:?}", a.transport).to_lowercase()}),
        rows,
    )
}

/// One churn pass (long-polls, or SSE streams when `sse`); its figures, labelled by transport
/// when `several` passes share the table.
async fn churn_pass(
    b: &Arc<Bench>,
    a: &ChurnArgs,
    sse: bool,
    several: bool,
) -> anyhow::Result<Vec<(String, Value)>> {
    let b = b.clone();
    // E environments × runs, each run with its own tag.
    let mut targets: Vec<(Arc<DemoEnv>, String, String)> = Vec::new();
    for _ in 0..a.envs.max(1) {
        let env = Arc::new(b.env().await?);
        for r in 0..a.runs.max(1) {
            let tag = format!("churn{r}");
            let id = b.tagged_run(&env, &tag).await?;
            targets.push((env.clone(), id, tag));
        }
    }
    let published: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let latencies: Arc<Mutex<Vec<f64>>> = Arc::default();
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));

    let held_before = b.metric("runfeed_router_held_feeds").await.unwrap_or(0.0) as usize;
    // Followers: snapshot, then live polls in a loop, recording delivery latency.
    let mut followers = Vec::new();
    for i in 0..a.held {
        let (env, run_id, tag) = targets[i % targets.len()].clone();
        let feed = match a.kind {
            FeedKind::Run => Feed::Run(format!("run_{run_id}")),
            FeedKind::Tag => Feed::tag(&tag),
        };
        let (b, published, latencies, errors, stop) = (
            b.clone(),
            published.clone(),
            latencies.clone(),
            errors.clone(),
            stop.clone(),
        );
        followers.push(tokio::spawn(async move {
            let feed = &feed;
            let token = Bench::token(&env, feed);
            let client = b.client().clone();
            let mut at = match b.snapshot(&token, feed).await {
                Ok(r) => r,
                Err(_) => {
                    errors.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            };
            if sse {
                // One stream at a time; a server-ended stream is reopened at `<lsn>_0` (what
                // the 1.5 client does), a 409 starts over.
                let mut offset: Option<String> = None;
                while !stop.load(Ordering::Relaxed) {
                    let reader = b
                        .open_sse(&client, &token, feed, &at, offset.as_deref())
                        .await;
                    let mut reader = match reader {
                        Ok(r) if r.status == 200 => r,
                        Ok(r) if r.status == 409 => {
                            match b.snapshot(&token, feed).await {
                                Ok(r) => at = r,
                                Err(_) => return,
                            }
                            offset = None;
                            continue;
                        }
                        _ => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    while let Some(data) = reader.next_data().await {
                        let Ok(msg) = serde_json::from_str::<Value>(&data) else {
                            continue;
                        };
                        if let Some(id) = msg["value"]["id"].as_str() {
                            let now = Instant::now();
                            let p = published.lock().unwrap_or_else(|p| p.into_inner());
                            if let Some(t) = p.get(id) {
                                latencies
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .push(ms(now.duration_since(*t)));
                            }
                        }
                        if let Some(lsn) = msg["headers"]["global_last_seen_lsn"].as_str() {
                            offset = Some(format!("{lsn}_0"));
                        }
                    }
                }
                return;
            }
            while !stop.load(Ordering::Relaxed) {
                match b.live(&client, &token, feed, &at).await {
                    Ok(r) if r.status == 200 => {
                        let now = Instant::now();
                        let ids = r.changed_ids();
                        if !ids.is_empty() {
                            let p = published.lock().unwrap_or_else(|p| p.into_inner());
                            let mut l = latencies.lock().unwrap_or_else(|p| p.into_inner());
                            for id in ids {
                                if let Some(t) = p.get(&id) {
                                    l.push(ms(now.duration_since(*t)));
                                }
                            }
                        }
                        at = r;
                    }
                    Ok(r) if r.status == 409 => {
                        // Must refetch: start over.
                        match b.snapshot(&token, feed).await {
                            Ok(r) => at = r,
                            Err(_) => return,
                        }
                    }
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }));
    }
    // Wait until the followers are parked.
    let all_held = b
        .wait_held(held_before + a.held, Duration::from_secs(60))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let bs0 = b.metric("runfeed_feeds_backstops_total").await;
    let cpu0 = b.server_cpu();
    let start = Instant::now();
    let total = (a.rate * a.duration_s).round() as u64;
    let interval = Duration::from_secs_f64(1.0 / a.rate.max(0.001));
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut publishes = Vec::new();
    for i in 0..total {
        ticker.tick().await;
        let (env, id, tag) = targets[(i as usize * 7919) % targets.len()].clone();
        let (b, published, errors) = (b.clone(), published.clone(), errors.clone());
        publishes.push(tokio::spawn(async move {
            // Stamp the publish time between the Postgres update and the Redis publish.
            let ms = fixtures::update_run(
                &b.pool,
                &id,
                RunUpdate {
                    status: Some("EXECUTING".into()),
                    ..RunUpdate::default()
                },
            )
            .await;
            let Ok(ms) = ms else {
                errors.fetch_add(1, Ordering::Relaxed);
                return;
            };
            published
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id.clone(), Instant::now());
            let record = ChangeRecord {
                v: 1,
                run_id: id.into(),
                env_id: env.env_id.as_str().into(),
                tags: Some(vec![tag]),
                batch_id: None,
                updated_at_ms: Some(ms),
            };
            if b.publisher.publish(&record).await.is_err() {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for p in publishes {
        let _ = p.await;
    }
    let publish_s = start.elapsed().as_secs_f64();
    // Drain: give the last deliveries time to arrive.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let cpu1 = b.server_cpu();
    let bs1 = b.metric("runfeed_feeds_backstops_total").await;
    stop.store(true, Ordering::Relaxed);
    for f in &followers {
        f.abort();
    }
    let mut lat = latencies.lock().unwrap_or_else(|p| p.into_inner()).clone();
    lat.sort_by(f64::total_cmp);
    let deliveries = lat.len();
    let cpu_per_1k = delta(cpu0, cpu1).map(|c| c / (deliveries.max(1) as f64) * 1000.0);
    b.wait_released(held_before, Duration::from_secs(30)).await;
    let l = |figure: &str| label(figure, sse, several);
    Ok(vec![
        (l("all feeds held"), json!(all_held)),
        (l("changes published"), json!(total)),
        (l("achieved changes/s"), json!(total as f64 / publish_s)),
        (l("deliveries (feed × change)"), json!(deliveries)),
        (l("delivery latency p50 (ms)"), json!(pct(&lat, 50.0))),
        (l("delivery latency p99 (ms)"), json!(pct(&lat, 99.0))),
        (l("delivery latency p99.9 (ms)"), json!(pct(&lat, 99.9))),
        (l("server CPU s per 1000 deliveries"), opt(cpu_per_1k)),
        (l("backstop deliveries"), opt(delta(bs0, bs1))),
        (l("client errors"), json!(errors.load(Ordering::Relaxed))),
    ])
}

async fn stampede(a: StampedeArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let env = Arc::new(b.env().await?);
    // K runs, each with its own tag (written in parallel, 8 at a time).
    let tags: Vec<String> = (0..a.k).map(|i| format!("cold{i}")).collect();
    let created: Vec<anyhow::Result<String>> = stream::iter(tags.iter())
        .map(|t| {
            let (b, env) = (b.clone(), env.clone());
            async move { b.tagged_run(&env, t).await }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    for c in created {
        c?;
    }
    let q0 = b.metric("runfeed_pg_queries_total").await;
    let peak = Arc::new(AtomicU64::new(0));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (b, peak, done) = (b.clone(), peak.clone(), done.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                if let Some(v) = b.metric("runfeed_runset_admission_in_use").await {
                    peak.fetch_max(v as u64, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let started = Instant::now();
    let tasks: Vec<_> = tags
        .iter()
        .map(|t| {
            let (b, env, t) = (b.clone(), env.clone(), t.clone());
            tokio::spawn(async move {
                let token = Bench::token(&env, &Feed::tag(&t));
                let r = b.snapshot(&token, &Feed::tag(&t)).await;
                (r.is_ok(), Instant::now())
            })
        })
        .collect();
    let mut lat = Vec::new();
    let mut errors = 0;
    for t in tasks {
        match t.await {
            Ok((true, at)) => lat.push(ms(at.duration_since(started))),
            _ => errors += 1,
        }
    }
    let total = started.elapsed();
    done.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let q1 = b.metric("runfeed_pg_queries_total").await;
    lat.sort_by(f64::total_cmp);
    report(
        &a.common,
        "stampede",
        json!({"k": a.k}),
        vec![
            ("time to all snapshots (ms)", json!(ms(total))),
            ("snapshot p50 (ms)", json!(pct(&lat, 50.0))),
            ("snapshot p99 (ms)", json!(pct(&lat, 99.0))),
            ("errors", json!(errors)),
            (
                "peak concurrent resolves (admission in use)",
                json!(peak.load(Ordering::Relaxed)),
            ),
            ("postgres queries", opt(delta(q0, q1))),
        ],
    )
}

async fn idle(a: IdleArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let env = Arc::new(b.env().await?);
    // The distinct feeds, each with its own token and snapshot.
    let mut feeds = Vec::new();
    for i in 0..a.distinct.max(1) {
        let tag = format!("idle{i}");
        let run_id = b.tagged_run(&env, &tag).await?;
        let feed = match a.kind {
            FeedKind::Run => Feed::Run(format!("run_{run_id}")),
            FeedKind::Tag => Feed::Tag(tag),
        };
        let token = Bench::token(&env, &feed);
        let snap = Arc::new(b.snapshot(&token, &feed).await?);
        feeds.push((feed, token, snap));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held_before = b.metric("runfeed_router_held_feeds").await.unwrap_or(0.0) as usize;
    let errors = Arc::new(AtomicU64::new(0));
    let client_requests = Arc::new(AtomicU64::new(0));
    let mut followers = Vec::new();
    for i in 0..a.held {
        let (feed, token, at) = feeds[i % feeds.len()].clone();
        let (b, errors, reqs) = (b.clone(), errors.clone(), client_requests.clone());
        followers.push(tokio::spawn(async move {
            let client = b.client().clone();
            let mut at = Resp {
                status: at.status,
                handle: at.handle.clone(),
                offset: at.offset.clone(),
                cursor: at.cursor.clone(),
                body: Value::Null,
            };
            loop {
                reqs.fetch_add(1, Ordering::Relaxed);
                match b.live(&client, &token, &feed, &at).await {
                    Ok(r) if r.status == 200 || r.status == 204 => {
                        if r.handle.is_some() {
                            at = r;
                        }
                    }
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }));
    }
    let all_held = b
        .wait_held(held_before + a.held, Duration::from_secs(60))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r0 = b.metric("runfeed_http_requests_total").await;
    let q0 = b.metric("runfeed_pg_queries_total").await;
    let c0 = b.server_cpu();
    let cr0 = client_requests.load(Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(a.duration_s)).await;
    let secs = t0.elapsed().as_secs_f64();
    let r1 = b.metric("runfeed_http_requests_total").await;
    let q1 = b.metric("runfeed_pg_queries_total").await;
    let c1 = b.server_cpu();
    let cr1 = client_requests.load(Ordering::Relaxed);
    for f in &followers {
        f.abort();
    }
    report(
        &a.common,
        "idle",
        json!({"held": a.held, "distinct": a.distinct, "kind": format!("{:?}", a.kind).to_lowercase(), "duration_s": a.duration_s}),
        vec![
            ("all feeds held", json!(all_held)),
            ("client requests/s", json!((cr1 - cr0) as f64 / secs)),
            (
                "server requests/s (metric)",
                opt(delta(r0, r1).map(|d| d / secs)),
            ),
            ("postgres queries/s", opt(delta(q0, q1).map(|d| d / secs))),
            (
                "server CPU (% of one core)",
                opt(delta(c0, c1).map(|d| d / secs * 100.0)),
            ),
            ("client errors", json!(errors.load(Ordering::Relaxed))),
        ],
    )
}

mod fleet {
    //! The fleet scenario (scripts/fleet-bench.sh): more held feeds than one process may open
    //! files for, so several `fleet-hold` processes share one environment written by
    //! `fleet-setup`, and `fleet-change` announces the one change through a file.
    use super::*;

    fn unix_ms() -> f64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    }

    struct Setup {
        env: DemoEnv,
        hot_run: String,
        cold_run: String,
    }

    fn read_setup(path: &str) -> anyhow::Result<Setup> {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        let s = |k: &str| -> anyhow::Result<String> {
            Ok(v[k].as_str().context(format!("{k} in {path}"))?.to_string())
        };
        Ok(Setup {
            env: DemoEnv {
                env_id: s("env_id")?,
                api_key: s("api_key")?,
                org_id: s("org_id")?,
                project_id: s("project_id")?,
            },
            hot_run: s("hot_run")?,
            cold_run: s("cold_run")?,
        })
    }

    pub(super) async fn setup(a: FleetSetupArgs) -> anyhow::Result<()> {
        let b = Bench::new(a.common.clone()).await?;
        let env = b.env().await?;
        let hot_run = b.tagged_run(&env, "hot").await?;
        let cold_run = b.tagged_run(&env, "cold").await?;
        let out = json!({
            "env_id": env.env_id, "api_key": env.api_key, "org_id": env.org_id,
            "project_id": env.project_id, "hot_run": hot_run, "cold_run": cold_run,
        });
        std::fs::write(&a.out, serde_json::to_string_pretty(&out)?)?;
        Ok(())
    }

    pub(super) async fn change(a: FleetChangeArgs) -> anyhow::Result<()> {
        let b = Bench::new(a.common.clone()).await?;
        let setup = read_setup(&a.setup)?;
        let published = unix_ms();
        b.change(&setup.env, &setup.hot_run, "hot").await?;
        std::fs::write(&a.go_file, format!("{published}"))?;
        Ok(())
    }

    /// One feed a `fleet-hold` process follows.
    struct Follower {
        b: Arc<Bench>,
        /// The instance it polls.
        base: String,
        token: Arc<String>,
        feed: Feed,
        /// Hot: stops at the first response that carries a change.
        hot: bool,
        stop: Arc<std::sync::atomic::AtomicBool>,
    }

    /// One feed's loop: re-polls as holds expire (like a client) until `stop`; a hot feed
    /// returns the Unix ms of the first response that carries a change.
    async fn follow(f: Follower, mut at: Arc<Resp>) -> Option<f64> {
        let Follower {
            b,
            base,
            token,
            feed,
            hot,
            stop,
        } = f;
        let client = b.client().clone();
        let (path, params) = feed.path_and_params();
        while !stop.load(Ordering::Relaxed) {
            let mut p = params.clone();
            p.extend([
                ("cursor", at.cursor.clone().unwrap_or_default()),
                ("handle", at.handle.clone().unwrap_or_default()),
                ("live", "true".into()),
                ("offset", at.offset.clone().unwrap_or_else(|| "-1".into())),
            ]);
            match b.get_at(&base, &client, &token, &path, &p).await {
                Ok(r) if r.status == 200 => {
                    if hot && !r.changed_ids().is_empty() {
                        return Some(unix_ms());
                    }
                    at = Arc::new(r);
                }
                _ => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
        None
    }

    pub(super) async fn hold(a: FleetHoldArgs) -> anyhow::Result<()> {
        let b = Arc::new(Bench::new(a.common.clone()).await?);
        let setup = read_setup(&a.setup)?;
        let bases: Vec<String> = a
            .common
            .base_url
            .split(',')
            .map(|u| u.trim_end_matches('/').to_string())
            .collect();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut idle = Vec::with_capacity(a.idle);
        let mut hot = Vec::with_capacity(a.hot);
        // Both snapshots first, then the feeds in steps of 200 every 20 ms: a burst of
        // thousands of connects at once overflows the instances' accept queues.
        let mut kinds = Vec::new();
        for (n, is_hot) in [(a.idle, false), (a.hot, true)] {
            let feed = if is_hot {
                Feed::tag("hot")
            } else {
                Feed::Run(format!("run_{}", setup.cold_run))
            };
            let token = Arc::new(Bench::token(&setup.env, &feed));
            let (path, mut params) = feed.path_and_params();
            params.push(("offset", "-1".into()));
            let at = b
                .get_at(&bases[0], b.client(), &token, &path, &params)
                .await?;
            if at.status != 200 {
                bail!("snapshot of {feed:?}: status {}", at.status);
            }
            kinds.push((n, is_hot, feed, token, Arc::new(at)));
        }
        for (n, is_hot, feed, token, at) in kinds {
            for i in 0..n {
                if i % 200 == 199 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let follower = Follower {
                    b: b.clone(),
                    base: bases[i % bases.len()].clone(),
                    token: token.clone(),
                    feed: feed.clone(),
                    hot: is_hot,
                    stop: stop.clone(),
                };
                let task = tokio::spawn(follow(follower, at.clone()));
                if is_hot {
                    hot.push(task)
                } else {
                    idle.push(task)
                }
            }
        }
        eprintln!("fleet-hold: {} idle + {} hot feeds started", a.idle, a.hot);
        let deadline = Instant::now() + Duration::from_secs_f64(a.max_wait_s);
        let published = loop {
            if let Some(ms) = std::fs::read_to_string(&a.go_file)
                .ok()
                .and_then(|t| t.trim().parse::<f64>().ok())
            {
                break ms;
            }
            if Instant::now() > deadline {
                bail!("no change announced in {}", a.go_file);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let mut lat = Vec::with_capacity(a.hot);
        let mut errors = 0usize;
        for t in hot {
            match tokio::time::timeout(Duration::from_secs(60), t).await {
                Ok(Ok(Some(at))) => lat.push(at - published),
                _ => errors += 1,
            }
        }
        stop.store(true, Ordering::Relaxed);
        for t in idle {
            t.abort();
        }
        lat.sort_by(f64::total_cmp);
        report(
            &a.common,
            "fleet-hold",
            json!({"idle": a.idle, "hot": a.hot, "instances": bases.len()}),
            vec![
                ("hot responses", json!(lat.len())),
                ("hot errors", json!(errors)),
                ("publish -> response p50 (ms)", json!(pct(&lat, 50.0))),
                ("publish -> response p99 (ms)", json!(pct(&lat, 99.0))),
                (
                    "publish -> response max (ms)",
                    json!(lat.last().copied().unwrap_or(f64::NAN)),
                ),
            ],
        )
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.scenario {
        Scenario::Held(a) => held(a).await,
        Scenario::Fanout(a) => fanout(a).await,
        Scenario::Churn(a) => churn(a).await,
        Scenario::Stampede(a) => stampede(a).await,
        Scenario::Idle(a) => idle(a).await,
        Scenario::Bare(a) => bare(a).await,
        Scenario::FleetSetup(a) => fleet::setup(a).await,
        Scenario::FleetHold(a) => fleet::hold(a).await,
        Scenario::FleetChange(a) => fleet::change(a).await,
        Scenario::Check(a) => match runfeed_dev::check::run(*a).await {
            Ok(report) if report.passed => Ok(()),
            Ok(_) => return std::process::ExitCode::FAILURE,
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("runfeed-bench: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
