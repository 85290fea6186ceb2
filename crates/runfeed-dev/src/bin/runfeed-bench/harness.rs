//! The harness every scenario shares: the CLI options common to all, the HTTP client, seeding,
//! change publishing, metric scrapes, /proc readings and the report table.

use super::*;
pub(crate) use runfeed_dev::measure::{metric_sum, pct, proc_cpu_s, proc_rss};

#[derive(Args, Clone)]
pub(crate) struct Common {
    /// The server's base URL (e.g. http://127.0.0.1:3030).
    #[arg(long, env = "BENCH_BASE_URL")]
    pub(crate) base_url: String,
    /// The database the server reads (the tool writes environments and runs into it).
    #[arg(long, env = "DATABASE_URL")]
    pub(crate) database_url: String,
    /// The Redis the server subscribes to (change records are published there).
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub(crate) redis_url: String,
    /// The server's admin listener (/metrics), e.g. http://127.0.0.1:9464.
    #[arg(long, env = "BENCH_ADMIN_URL")]
    pub(crate) admin_url: Option<String>,
    /// The server's pid, for CPU seconds and RSS from /proc (local servers only).
    #[arg(long)]
    pub(crate) server_pid: Option<u32>,
    /// Spread client connections over this many source addresses 127.0.0.1.. (≈ 28 000
    /// connections per address).
    #[arg(long, default_value_t = 1)]
    pub(crate) source_addrs: u8,
    /// The first source address is 127.0.0.(1 + this): several bench processes can use
    /// disjoint addresses (`fleet-hold`).
    #[arg(long, default_value_t = 0)]
    pub(crate) first_source: u8,
    /// Write the figures as JSON to this file.
    #[arg(long)]
    pub(crate) json: Option<String>,
}

/// How a held feed waits: a live long-poll, or an SSE stream (`live_sse=true`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Transport {
    LongPoll,
    Sse,
    Both,
}

impl Transport {
    /// The passes to run: `false` = long-poll, `true` = SSE.
    pub(crate) fn passes(self) -> Vec<bool> {
        match self {
            Transport::LongPoll => vec![false],
            Transport::Sse => vec![true],
            Transport::Both => vec![false, true],
        }
    }
}

/// `"<figure>"`, or `"<figure> [sse]"` / `"… [long-poll]"` when several passes share a table.
pub(crate) fn label(figure: &str, sse: bool, several: bool) -> String {
    match (several, sse) {
        (false, _) => figure.to_string(),
        (true, true) => format!("{figure} [sse]"),
        (true, false) => format!("{figure} [long-poll]"),
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum FeedKind {
    Run,
    Tag,
}

pub(crate) struct Bench {
    pub(crate) c: Common,
    pub(crate) base: String,
    pub(crate) pool: PgPool,
    pub(crate) publisher: Publisher,
    pub(crate) clients: Vec<reqwest::Client>,
    pub(crate) next_client: AtomicUsize,
    pub(crate) probe: reqwest::Client,
}

/// A parsed feed response.
pub(crate) struct Resp {
    pub(crate) status: u16,
    pub(crate) handle: Option<String>,
    pub(crate) offset: Option<String>,
    pub(crate) cursor: Option<String>,
    pub(crate) body: Value,
}

impl Resp {
    /// A response from its parts; a body that is not JSON is `Null`.
    pub(crate) fn parse(
        status: hyper::StatusCode,
        headers: &hyper::HeaderMap,
        body: &[u8],
    ) -> Resp {
        let h = |n: &str| {
            headers
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        Resp {
            status: status.as_u16(),
            handle: h("electric-handle"),
            offset: h("electric-offset"),
            cursor: h("electric-cursor"),
            body: serde_json::from_slice(body).unwrap_or(Value::Null),
        }
    }

    /// `(run id, updatedAt)` of every change message.
    pub(crate) fn changed_ids(&self) -> Vec<String> {
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

/// What a feed follows: a tag (`/realtime/v1/runs?tags=`), one run (`/realtime/v1/runs/<id>`),
/// several tags within a `createdAt` window, or one batch (`/realtime/v1/batches/<id>`).
#[derive(Clone, Debug)]
pub(crate) enum Feed {
    Tag(String),
    /// A run's friendly id (`run_…`).
    Run(String),
    /// `tags=a,b` (runs carrying every tag) and `createdAt=<created_at>` when given (`24h`).
    Tags {
        tags: Vec<String>,
        created_at: Option<String>,
    },
    /// A batch's friendly id (`batch_…`).
    Batch(String),
}

impl Feed {
    pub(crate) fn tag(tag: &str) -> Feed {
        Feed::Tag(tag.to_string())
    }

    /// The path and the query parameters that select the feed.
    pub(crate) fn path_and_params(&self) -> (String, Vec<(&'static str, String)>) {
        match self {
            Feed::Tag(tag) => (
                "/realtime/v1/runs".into(),
                vec![("tags", tag.clone()), ("log", "full".into())],
            ),
            Feed::Run(id) => (format!("/realtime/v1/runs/{id}"), Vec::new()),
            Feed::Tags { tags, created_at } => {
                let mut params = vec![("tags", tags.join(",")), ("log", "full".into())];
                if let Some(window) = created_at {
                    params.push(("createdAt", window.clone()));
                }
                ("/realtime/v1/runs".into(), params)
            }
            Feed::Batch(id) => (format!("/realtime/v1/batches/{id}"), Vec::new()),
        }
    }

    /// The first request: the snapshot (`offset=-1`).
    pub(crate) fn snapshot_request(&self) -> (String, Vec<(&'static str, String)>) {
        let (path, mut params) = self.path_and_params();
        params.push(("offset", "-1".into()));
        (path, params)
    }

    /// The live long-poll that follows response `at`.
    pub(crate) fn live_request(&self, at: &Resp) -> (String, Vec<(&'static str, String)>) {
        let (path, mut params) = self.path_and_params();
        params.extend([
            ("cursor", at.cursor.clone().unwrap_or_default()),
            ("handle", at.handle.clone().unwrap_or_default()),
            ("live", "true".into()),
            ("offset", at.offset.clone().unwrap_or_else(|| "-1".into())),
        ]);
        (path, params)
    }

    /// The public-token scopes that read it.
    pub(crate) fn scopes(&self) -> Vec<String> {
        match self {
            Feed::Tag(tag) => vec![format!("read:tags:{tag}")],
            Feed::Run(id) => vec![format!("read:runs:{id}")],
            Feed::Tags { tags, .. } => tags.iter().map(|t| format!("read:tags:{t}")).collect(),
            Feed::Batch(id) => vec![format!("read:batch:{id}")],
        }
    }
}

/// An SSE response being read (`data:` events; comments skipped).
pub(crate) struct SseReader {
    pub(crate) status: u16,
    pub(crate) resp: reqwest::Response,
    pub(crate) buf: String,
}

impl SseReader {
    /// The next event's data; `None` when the stream ended (or failed).
    pub(crate) async fn next_data(&mut self) -> Option<String> {
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

/// Source address `i` of `--source-addrs`: 127.0.0.(1 + i).
pub(crate) fn source_ip(i: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1 + i))
}

pub(crate) fn client_for(i: u8) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(100_000)
        .local_address(source_ip(i))
        .timeout(Duration::from_secs(300))
        .build()?)
}

impl Bench {
    pub(crate) async fn new(c: Common) -> anyhow::Result<Bench> {
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

    /// Where follower connections ([`conn::Conn`]) go: the server of `--base-url`, once from
    /// each source address of `--source-addrs`.
    pub(crate) async fn conn_targets(&self) -> anyhow::Result<Vec<conn::Target>> {
        let mut targets = Vec::new();
        for i in 0..self.c.source_addrs.max(1) {
            let ip = source_ip(self.c.first_source.saturating_add(i));
            targets.push(conn::Target::resolve(&self.base, ip).await?);
        }
        Ok(targets)
    }

    pub(crate) fn client(&self) -> &reqwest::Client {
        let i = self.next_client.fetch_add(1, Ordering::Relaxed);
        &self.clients[i % self.clients.len()]
    }

    pub(crate) async fn env(&self) -> anyhow::Result<DemoEnv> {
        fixtures::create_env(&self.pool, "DEVELOPMENT").await
    }

    pub(crate) async fn tagged_run(&self, env: &DemoEnv, tag: &str) -> anyhow::Result<String> {
        let spec = RunSpec {
            tags: Some(vec![tag.to_string()]),
            ..RunSpec::default()
        };
        Ok(fixtures::create_run(&self.pool, env, spec).await?.id)
    }

    /// Updates a run (Postgres) and publishes its change record (Redis), like trigger.dev.
    pub(crate) async fn change(
        &self,
        env: &DemoEnv,
        run_id: &str,
        tag: &str,
    ) -> anyhow::Result<()> {
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

    pub(crate) fn token(env: &DemoEnv, feed: &Feed) -> String {
        mint_public_token(
            &env.api_key,
            &env.env_id,
            &feed.scopes(),
            Duration::from_secs(3600),
            None,
        )
        .expect("mint token")
    }

    pub(crate) async fn get(
        &self,
        client: &reqwest::Client,
        token: &str,
        path: &str,
        params: &[(&str, String)],
    ) -> anyhow::Result<Resp> {
        self.get_at(&self.base, client, token, path, params).await
    }

    /// [`Bench::get`] against another instance (`base`, e.g. `http://127.0.0.1:3101`).
    pub(crate) async fn get_at(
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
        let mut resp = resp;
        let (status, headers) = (resp.status(), std::mem::take(resp.headers_mut()));
        let body = resp.bytes().await?;
        Ok(Resp::parse(status, &headers, &body))
    }

    /// Like [`Bench::get`], without parsing the body (a cold snapshot of 1 000 runs with their
    /// payloads is megabytes): the response's headers and status, `Null` as its body, and the
    /// body's length in bytes.
    pub(crate) async fn get_lean(
        &self,
        client: &reqwest::Client,
        token: &str,
        path: &str,
        params: &[(&str, String)],
    ) -> anyhow::Result<(Resp, usize)> {
        let mut resp = client
            .get(format!("{}{path}", self.base))
            .query(params)
            .header("authorization", format!("Bearer {token}"))
            .header("x-trigger-electric-version", ELECTRIC_VERSION)
            .send()
            .await
            .with_context(|| format!("GET {path}"))?;
        let (status, headers) = (resp.status(), std::mem::take(resp.headers_mut()));
        let body = resp.bytes().await?;
        Ok((Resp::parse(status, &headers, b""), body.len()))
    }

    /// The snapshot (`offset=-1`) of `feed`, read with [`Bench::get_lean`]: any status.
    pub(crate) async fn snapshot_lean(
        &self,
        token: &str,
        feed: &Feed,
    ) -> anyhow::Result<(Resp, usize)> {
        let (path, params) = feed.snapshot_request();
        self.get_lean(self.client(), token, &path, &params).await
    }

    pub(crate) async fn snapshot(&self, token: &str, feed: &Feed) -> anyhow::Result<Resp> {
        let (path, params) = feed.snapshot_request();
        let r = self.get(self.client(), token, &path, &params).await?;
        if r.status != 200 {
            bail!("snapshot of {feed:?}: status {}", r.status);
        }
        Ok(r)
    }

    pub(crate) async fn live(
        &self,
        client: &reqwest::Client,
        token: &str,
        feed: &Feed,
        at: &Resp,
    ) -> anyhow::Result<Resp> {
        let (path, params) = feed.live_request(at);
        self.get(client, token, &path, &params).await
    }

    /// Opens an SSE stream (`live=true&live_sse=true`) at response `at`'s handle and offset.
    pub(crate) async fn open_sse(
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
    pub(crate) async fn wait_released(&self, n: usize, limit: Duration) {
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
    pub(crate) async fn scrape(&self) -> String {
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
    pub(crate) async fn metric(&self, name: &str) -> Option<f64> {
        metric_sum(&self.scrape().await, name)
    }

    /// Waits until the server holds at least `n` feeds (router gauge), at most `limit`.
    pub(crate) async fn wait_held(&self, n: usize, limit: Duration) -> bool {
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
    pub(crate) async fn server_rss(&self) -> Option<f64> {
        match self.c.server_pid {
            Some(pid) => proc_rss(pid),
            None => self.metric("runfeed_process_resident_memory_bytes").await,
        }
    }

    pub(crate) fn server_cpu(&self) -> Option<f64> {
        self.c.server_pid.and_then(proc_cpu_s)
    }

    /// Commands a server sends to Redis for its feeds, so far: its `runfeed_redis_commands_total`
    /// when it exports one, else the calls of the commands runfeed sends outside scripts
    /// (`EVALSHA`, `SET`, `GET`, `ZREM`) from `INFO commandstats` of `--redis-url`, exact only on
    /// a Redis no one else uses (scripts/bench-report.sh starts one; the bench's own `PUBLISH`
    /// and `INFO` are not among them).
    pub(crate) async fn redis_commands(&self) -> Option<f64> {
        use fred::prelude::*;
        // The server's own count, taken where it sends them (a script call counts once, whatever
        // it runs inside: `INFO commandstats` counts the SETs of a cursor script one by one).
        // Servers without that metric: the calls Redis saw.
        if let Some(sent) = self.metric("runfeed_redis_commands_total").await {
            return Some(sent);
        }
        let client = Client::new(Config::from_url(&self.c.redis_url).ok()?, None, None, None);
        client.init().await.ok()?;
        let info: String = client
            .custom(
                fred::types::CustomCommand::new_static("INFO", None, false),
                vec!["commandstats"],
            )
            .await
            .ok()?;
        let _ = client.quit().await;
        Some(redis_sent_calls(&info))
    }
}

/// The calls of the commands runfeed sends outside scripts, in an `INFO commandstats` text.
pub(crate) fn redis_sent_calls(info: &str) -> f64 {
    const SENT: [&str; 5] = ["evalsha", "set", "get", "zrem", "mget"];
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| l.split_once(":calls="))
        .filter(|(name, _)| SENT.contains(name))
        .filter_map(|(_, rest)| rest.split(',').next()?.parse::<f64>().ok())
        .sum()
}

/// `(b − a) / n` per unit, scaled by `scale` (e.g. 1e6 for µs from seconds).
pub(crate) fn per_unit(a: Option<f64>, b: Option<f64>, n: f64, scale: f64) -> Value {
    opt(delta(a, b).filter(|_| n > 0.0).map(|d| d * scale / n))
}

/// This process's CPU time (user + system), s.
pub(crate) fn own_cpu_s() -> Option<f64> {
    proc_cpu_s(std::process::id())
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub(crate) fn opt(v: Option<f64>) -> Value {
    v.map(|x| json!(x)).unwrap_or(Value::Null)
}

pub(crate) fn delta(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(b? - a?)
}

/// Prints `rows` as a two-column table and writes `{scenario, params, figures}` JSON to
/// `--json`.
pub(crate) fn report<K: AsRef<str>>(
    c: &Common,
    scenario: &str,
    params: Value,
    rows: Vec<(K, Value)>,
) -> anyhow::Result<()> {
    report_to(c.json.as_deref(), scenario, params, rows)
}

/// [`report`], writing the JSON to `json` when given.
pub(crate) fn report_to<K: AsRef<str>>(
    json: Option<&str>,
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
    if let Some(path) = json {
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
pub(crate) struct Park<'a> {
    pub(crate) n: usize,
    pub(crate) token: &'a str,
    pub(crate) feed: &'a Feed,
    pub(crate) at: &'a Arc<Resp>,
    pub(crate) sse: bool,
}

/// Parks live requests (long-polls, or SSE streams); each task ends with the
/// status and the time of the response (SSE: of the stream's first event).
pub(crate) fn park(
    b: &Arc<Bench>,
    p: Park<'_>,
) -> Vec<tokio::task::JoinHandle<(Option<u16>, Instant)>> {
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

/// Samples the server's `runfeed_runset_admission_in_use` every `every` until stopped, keeping
/// the peak: the admission gate's busiest moment during a phase.
pub struct AdmissionPeak {
    peak: Arc<AtomicU64>,
    done: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl AdmissionPeak {
    /// Starts sampling `b`'s admin metrics.
    pub fn start(b: &Arc<Bench>, every: Duration) -> AdmissionPeak {
        let peak = Arc::new(AtomicU64::new(0));
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let task = {
            let (b, peak, done) = (b.clone(), peak.clone(), done.clone());
            tokio::spawn(async move {
                while !done.load(Ordering::Relaxed) {
                    if let Some(v) = b.metric("runfeed_runset_admission_in_use").await {
                        peak.fetch_max(v as u64, Ordering::Relaxed);
                    }
                    tokio::time::sleep(every).await;
                }
            })
        };
        AdmissionPeak { peak, done, task }
    }

    /// Stops sampling; the peak seen.
    pub async fn stop(self) -> u64 {
        self.done.store(true, Ordering::Relaxed);
        let _ = self.task.await;
        self.peak.load(Ordering::Relaxed)
    }
}
