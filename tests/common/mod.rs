//! Harness for HTTP-level integration tests: one in-process runfeed server per test, on its own
//! throwaway database (`runfeed_t_<random>` on postgres://postgres@127.0.0.1:5432) and the shared
//! Redis at 127.0.0.1:6379 (environment ids are random, so Redis channels never collide between
//! tests running in parallel).
//!
//! Every network await is bounded by a timeout. The database is dropped when the [`TestServer`]
//! is dropped (best effort, also when the test panicked).

#![allow(dead_code)]

pub mod checks;
pub mod feed;
#[allow(unused_imports)] // not every test binary asserts on feeds
pub use feed::*;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fred::interfaces::{ClientLike, PubsubInterface};
use reqwest::header::HeaderMap;
use runfeed::app::{self, Running};
use runfeed::auth::mint_public_token;
use runfeed::changes::{channel_name, ChangeRecord};
use runfeed::config::Config;
use runfeed::protocol::EnvId;
use runfeed::redis::{Publisher, RedisOptions};
use runfeed::router::Router;
use runfeed_dev::fixtures::{self, CreatedRun, DemoEnv, RunSpec, RunUpdate, TestDb};
use serde_json::Value;
use tokio::time::Instant;

pub const PG_ADMIN: &str = "postgres://postgres@127.0.0.1:5432";
pub const REDIS_URL: &str = "redis://127.0.0.1:6379";
pub const HANDLE_SECRET: &str = "feeds-http-test-secret";
/// The `x-trigger-electric-version` the SDK sends (modern client).
pub const ELECTRIC_VERSION: &str = "1.0.0-beta.1";
/// The current `x-trigger-api-version`.
pub const CURRENT_API_VERSION: &str = "2025-07-16";
/// Bound on any single awaited operation that is not a deliberate long hold.
pub const WAIT: Duration = Duration::from_secs(30);

/// The Postgres server of tests that drive the binary: `RUNFEED_TEST_PG`, else [`PG_ADMIN`].
pub fn pg_base() -> String {
    std::env::var("RUNFEED_TEST_PG").unwrap_or_else(|_| PG_ADMIN.to_string())
}

/// The Redis of tests that drive the binary: `RUNFEED_TEST_REDIS`, else [`REDIS_URL`].
pub fn redis_url() -> String {
    std::env::var("RUNFEED_TEST_REDIS").unwrap_or_else(|_| REDIS_URL.to_string())
}

/// Runs `test` on a fresh database of [`pg_base`] and drops the database afterwards (also when
/// `test` returned an error).
pub async fn with_test_db(
    test: impl AsyncFnOnce(&TestDb) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let db = TestDb::create(&pg_base()).await?;
    let result = test(&db).await;
    db.cleanup().await?;
    result
}

/// Awaits `fut` for at most `limit`, panicking with `what` otherwise.
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {limit:?}: {what}"),
    }
}

/// Awaits a fixture step (bounded by [`WAIT`]), panicking with `what` if it fails.
pub async fn made<T>(what: &str, fut: impl Future<Output = anyhow::Result<T>>) -> T {
    within(WAIT, what, fut)
        .await
        .unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// Waits until the store's query counter stops moving (unchanged for 200 ms, at most 10 s);
/// returns the settled count.
pub async fn settle_queries(store: &runfeed::store::PgStore) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = store.query_count();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = store.query_count();
        if now == last {
            return now;
        }
        assert!(Instant::now() < deadline, "store queries never settled");
        last = now;
    }
}

/// A TCP port on 127.0.0.1 nothing listens on (bound, read, released).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local address").port()
}

/// A `redis-server` command for 127.0.0.1:`port` without persistence, its output discarded; the
/// caller adds arguments and spawns it.
pub fn redis_server(port: u16) -> std::process::Command {
    let mut cmd = std::process::Command::new("redis-server");
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    cmd
}

/// Polls `sql` (a `bool` query, with `bind` as its `$1`) on `pool` every 20 ms until it returns
/// true, at most [`WAIT`]: a database state that has no event to await.
pub async fn wait_sql(pool: &sqlx::PgPool, what: &str, sql: &str, bind: Option<&str>) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut q = sqlx::query_scalar::<_, bool>(sqlx::AssertSqlSafe(sql.to_string()));
        if let Some(b) = bind {
            q = q.bind(b.to_string());
        }
        if q.fetch_one(pool).await.unwrap_or(false) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never true within {WAIT:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `cond` every 5 ms until it holds or `limit` passes (waiting on an observable).
pub async fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "condition never held within {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A config for tests: port 0, the test database, the local Redis, a fixed handle secret, no
/// jitter, and the given live hold.
pub fn test_config(db_url: &str, hold_ms: u64) -> Config {
    let mut c = Config::default();
    c.server.listen = "127.0.0.1:0".into();
    c.server.handle_secret = Some(HANDLE_SECRET.into());
    c.server.shutdown_grace_ms = 200;
    c.database.url = db_url.into();
    c.redis.url = REDIS_URL.into();
    c.feeds.live_poll_timeout_ms = hold_ms;
    c.feeds.live_poll_jitter_ratio = 0.0;
    // Every in-process server gets its own admin listener (/metrics, /readyz) on a free port.
    c.telemetry.admin_listen = "127.0.0.1:0".into();
    c
}

/// One HTTP response: status, headers, body text and (if it parses) JSON.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub text: String,
    pub json: Value,
    pub elapsed: Duration,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn has(&self, name: &str) -> bool {
        self.headers.contains_key(name)
    }

    /// `electric-handle` (modern) or `electric-shape-id` (legacy).
    pub fn handle(&self) -> String {
        self.header("electric-handle")
            .or_else(|| self.header("electric-shape-id"))
            .unwrap_or_else(|| panic!("no handle header in {self:?}"))
            .to_string()
    }

    /// `electric-offset` (modern) or `electric-chunk-last-offset` (legacy).
    pub fn offset(&self) -> String {
        self.header("electric-offset")
            .or_else(|| self.header("electric-chunk-last-offset"))
            .unwrap_or_else(|| panic!("no offset header in {self:?}"))
            .to_string()
    }

    /// The millisecond part of the offset.
    pub fn offset_ms(&self) -> i64 {
        let o = self.offset();
        o.split('_')
            .next()
            .unwrap()
            .parse()
            .unwrap_or_else(|_| panic!("bad offset {o:?}"))
    }

    pub fn cursor(&self) -> Option<String> {
        self.header("electric-cursor").map(str::to_string)
    }

    /// The body's messages (panics unless the body is a JSON array).
    pub fn messages(&self) -> &Vec<Value> {
        self.json
            .as_array()
            .unwrap_or_else(|| panic!("body is not a JSON array: {}", self.text))
    }

    /// Change messages (those with a `key`).
    pub fn changes(&self) -> Vec<&Value> {
        self.messages()
            .iter()
            .filter(|m| m.get("key").is_some())
            .collect()
    }

    /// `(operation, run id)` of every change message, in body order.
    pub fn ops(&self) -> Vec<(String, String)> {
        self.changes()
            .iter()
            .map(|m| {
                (
                    m["headers"]["operation"]
                        .as_str()
                        .unwrap_or("?")
                        .to_string(),
                    m["value"]["id"].as_str().unwrap_or("?").to_string(),
                )
            })
            .collect()
    }

    /// The change message of run `id`, if present.
    pub fn row(&self, id: &str) -> Option<&Value> {
        self.changes().into_iter().find(|m| m["value"]["id"] == id)
    }

    /// Whether the last message is the `up-to-date` control message.
    pub fn ends_up_to_date(&self) -> bool {
        self.messages()
            .last()
            .is_some_and(|m| m["headers"]["control"] == "up-to-date")
    }

    /// Body is exactly `[{"headers":{"control":"up-to-date"}}]`.
    pub fn is_bare_up_to_date(&self) -> bool {
        self.json == serde_json::json!([{"headers": {"control": "up-to-date"}}])
    }

    /// The parsed `electric-schema` header.
    pub fn schema(&self) -> Value {
        serde_json::from_str(
            self.header("electric-schema")
                .expect("electric-schema header"),
        )
        .expect("schema is JSON")
    }

    pub fn assert_status(&self, status: u16) -> &Self {
        assert_eq!(
            self.status, status,
            "unexpected status; body: {} headers: {:?}",
            self.text, self.headers
        );
        self
    }
}

/// A feed request URL builder.
#[derive(Clone, Debug)]
pub struct Url {
    pub path: String,
    pub params: Vec<(String, String)>,
}

impl Url {
    pub fn new(path: &str) -> Url {
        Url {
            path: path.to_string(),
            params: Vec::new(),
        }
    }

    pub fn q(mut self, k: &str, v: &str) -> Url {
        self.params.push((k.to_string(), v.to_string()));
        self
    }

    pub fn render(&self) -> String {
        if self.params.is_empty() {
            return self.path.clone();
        }
        let qs = serde_urlencoded::to_string(&self.params).expect("query string");
        format!("{}?{}", self.path, qs)
    }

    /// The initial snapshot request the 1.0.14 client sends.
    pub fn snapshot(&self) -> Url {
        self.clone().q("log", "full").q("offset", "-1")
    }

    /// The live request the client sends after response `r`: its handle, offset and cursor.
    pub fn live_after(&self, r: &Resp) -> Url {
        self.live(&r.handle(), &r.offset(), r.cursor().as_deref())
    }

    /// A live request at response `r`'s handle and offset, without a cursor.
    pub fn live_at(&self, r: &Resp) -> Url {
        self.live(&r.handle(), &r.offset(), None)
    }

    /// The live request following a response with (`handle`, `offset`, `cursor`).
    pub fn live(&self, handle: &str, offset: &str, cursor: Option<&str>) -> Url {
        self.clone()
            .q("cursor", cursor.unwrap_or(""))
            .q("handle", handle)
            .q("live", "true")
            .q("log", "full")
            .q("offset", offset)
    }

    /// A non-live catch-up request at (`handle`, `offset`).
    pub fn catch_up(&self, handle: &str, offset: &str) -> Url {
        self.clone()
            .q("handle", handle)
            .q("log", "full")
            .q("offset", offset)
    }
}

/// The run feed of run `friendly_id` (`/realtime/v1/runs/:runId`).
pub fn run_url(friendly_id: &str) -> Url {
    Url::new(&format!("/realtime/v1/runs/{friendly_id}"))
}

/// The tag feed of the comma-separated `tags` (`/realtime/v1/runs?tags=…`).
pub fn tag_url(tags: &str) -> Url {
    Url::new("/realtime/v1/runs").q("tags", tags)
}

/// The batch feed of batch `friendly_id` (`/realtime/v1/batches/:batchId`).
pub fn batch_url(friendly_id: &str) -> Url {
    Url::new(&format!("/realtime/v1/batches/{friendly_id}"))
}

/// The run, tag and batch feeds of one run: `[run_url, tag_url, batch_url]`.
pub fn feed_urls(run_fid: &str, tags: &str, batch_fid: &str) -> [Url; 3] {
    [run_url(run_fid), tag_url(tags), batch_url(batch_fid)]
}

/// A run spec with `tags` and otherwise the fixture defaults.
pub fn tagged(tags: &[&str]) -> RunSpec {
    RunSpec {
        tags: Some(tags.iter().map(|t| t.to_string()).collect()),
        ..RunSpec::default()
    }
}

/// A run spec with `tags`, in the batch with internal id `batch_id`.
pub fn tagged_in_batch(tags: &[&str], batch_id: &str) -> RunSpec {
    RunSpec {
        batch_id: Some(batch_id.to_string()),
        ..tagged(tags)
    }
}

/// A run spec with `tags`, created `age_ms` before `now_ms`.
pub fn tagged_aged(tags: &[&str], now_ms: i64, age_ms: i64) -> RunSpec {
    RunSpec {
        created_at_ms: Some(now_ms - age_ms),
        ..tagged(tags)
    }
}

/// Request headers a modern SDK client sends with `token`.
pub fn modern(token: &str) -> Vec<(String, String)> {
    vec![
        ("authorization".into(), format!("Bearer {token}")),
        ("x-trigger-electric-version".into(), ELECTRIC_VERSION.into()),
    ]
}

/// Request headers of a legacy (0.6.3-era) client: no `x-trigger-electric-version`.
pub fn legacy(token: &str) -> Vec<(String, String)> {
    vec![("authorization".into(), format!("Bearer {token}"))]
}

pub fn with(mut headers: Vec<(String, String)>, name: &str, value: &str) -> Vec<(String, String)> {
    headers.push((name.to_string(), value.to_string()));
    headers
}

/// Sends `url` with `headers` to `srv` from a task of its own (abort the task to have the client
/// go away mid-request).
pub fn spawn_fetch(
    srv: &std::sync::Arc<TestServer>,
    url: &Url,
    headers: &[(String, String)],
) -> tokio::task::JoinHandle<Resp> {
    let (srv, url, headers) = (srv.clone(), url.clone(), headers.to_vec());
    tokio::spawn(async move { srv.fetch(&url, &headers).await })
}

/// `req` with `headers` added.
pub fn with_headers(
    mut req: reqwest::RequestBuilder,
    headers: &[(String, String)],
) -> reqwest::RequestBuilder {
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    req
}

/// Sends `req` and reads the whole response, each step bounded by `limit`.
pub async fn send(req: reqwest::RequestBuilder, limit: Duration) -> Result<Resp, String> {
    let started = Instant::now();
    let resp = tokio::time::timeout(limit, req.send())
        .await
        .map_err(|_| format!("no response within {limit:?}"))?
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = tokio::time::timeout(limit, resp.text())
        .await
        .map_err(|_| format!("no body within {limit:?}"))?
        .map_err(|e| e.to_string())?;
    let json = serde_json::from_str(&text).unwrap_or(Value::Null);
    Ok(Resp {
        status,
        headers,
        text,
        json,
        elapsed: started.elapsed(),
    })
}

/// One in-process runfeed server with its own database.
pub struct TestServer {
    running: Option<Running>,
    db: Option<TestDb>,
    pub base: String,
    pub http: reqwest::Client,
    publisher: Option<Publisher>,
    redis: Option<fred::clients::Client>,
    db_name: String,
    /// The admin URL of the Postgres server holding the database (dropped there at the end).
    db_admin: String,
    /// The configuration the server was started with.
    pub config: Config,
}

/// One run of a new environment, followed on its run feed by a modern client with a
/// `read:runs` token: the headers, the feed and its (200) snapshot.
pub struct FollowedRun {
    pub env: DemoEnv,
    pub run: CreatedRun,
    pub headers: Vec<(String, String)>,
    pub url: Url,
    pub snap: Resp,
}

/// One run tagged `tag` of a new environment and the snapshots of its run feed and of the tag
/// feed, taken by a client with `headers`.
pub struct RunAndTagSnapshots {
    pub env: DemoEnv,
    pub run: CreatedRun,
    pub headers: Vec<(String, String)>,
    /// `(run feed, its snapshot)`, then `(tag feed, its snapshot)`.
    pub feeds: Vec<(Url, Resp)>,
}

/// Another runfeed instance on the same database (instance hop, restart).
pub struct Peer {
    pub running: Running,
    pub base: String,
}

impl TestServer {
    /// A server with the given live hold (ms) and otherwise [`test_config`] defaults.
    pub async fn start(hold_ms: u64) -> TestServer {
        Self::start_with(hold_ms, |_| {}).await
    }

    /// A server with the given live hold and a new environment on it.
    pub async fn with_env(hold_ms: u64) -> (TestServer, DemoEnv) {
        let srv = Self::start(hold_ms).await;
        let env = srv.env().await;
        (srv, env)
    }

    /// A server that routes every change record on its own (no coalescing window), with the
    /// given live hold, and a new environment on it.
    pub async fn uncoalesced_with_env(hold_ms: u64) -> (TestServer, DemoEnv) {
        Self::start_with_env(hold_ms, |c| c.router.coalesce_ceiling_ms = 0).await
    }

    /// [`TestServer::start_with`] and a new environment on the server.
    pub async fn start_with_env(
        hold_ms: u64,
        tweak: impl FnOnce(&mut Config),
    ) -> (TestServer, DemoEnv) {
        let srv = Self::start_with(hold_ms, tweak).await;
        let env = srv.env().await;
        (srv, env)
    }

    /// A server with the given live hold; `tweak` edits the config before start.
    pub async fn start_with(hold_ms: u64, tweak: impl FnOnce(&mut Config)) -> TestServer {
        Self::start_on(PG_ADMIN, hold_ms, tweak).await
    }

    /// [`TestServer::start_with`] on a new database of the Postgres server at `admin` (e.g. an
    /// own instance of scripts/pg-instance.sh); the database is dropped there at the end.
    pub async fn start_on(
        admin: &str,
        hold_ms: u64,
        tweak: impl FnOnce(&mut Config),
    ) -> TestServer {
        let db = within(WAIT, "create test database", TestDb::create(admin))
            .await
            .expect("create test database");
        let mut config = test_config(&db.url, hold_ms);
        tweak(&mut config);
        let db_name = db.name.clone();
        let running = within(WAIT, "start runfeed", app::start(config.clone()))
            .await
            .expect("start runfeed");
        let base = format!("http://{}", running.addr);
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(4096)
            .no_proxy()
            .build()
            .expect("reqwest client");
        let publisher = within(
            WAIT,
            "connect publisher",
            Publisher::connect(&RedisOptions::standalone(REDIS_URL)),
        )
        .await
        .expect("connect publisher");
        let redis = fred::types::Builder::from_config(
            fred::types::config::Config::from_url(REDIS_URL).expect("redis url"),
        )
        .build()
        .expect("redis probe client");
        within(WAIT, "connect redis probe client", redis.init())
            .await
            .expect("connect redis probe client");
        TestServer {
            running: Some(running),
            db: Some(db),
            base,
            http,
            publisher: Some(publisher),
            redis: Some(redis),
            db_name,
            db_admin: admin.to_string(),
            config,
        }
    }

    /// Starts another instance on the same database and Redis; `tweak` edits a copy of this
    /// server's configuration first (e.g. another handle secret).
    pub async fn peer(&self, tweak: impl FnOnce(&mut Config)) -> Peer {
        let mut config = self.config.clone();
        tweak(&mut config);
        let running = within(WAIT, "start peer", app::start(config))
            .await
            .expect("start peer");
        let base = format!("http://{}", running.addr);
        Peer { running, base }
    }

    /// Has this server and `peer` both serve `env_id` (a 200 for `warm` from each), then waits
    /// until both routers have a confirmed subscription and Redis counts the subscriber.
    pub async fn warm_with_peer(
        &self,
        peer: &Peer,
        env_id: &str,
        warm: &Url,
        headers: &[(String, String)],
    ) {
        self.fetch(warm, headers).await.assert_status(200);
        self.fetch_at(&peer.base, warm, headers)
            .await
            .assert_status(200);
        wait_confirmed(&self.running().router, env_id, "subscription confirmed").await;
        wait_confirmed(&peer.running.router, env_id, "peer subscription confirmed").await;
        self.wait_subscribed(env_id).await;
    }

    /// `GET url` on another instance.
    pub async fn fetch_at(&self, base: &str, url: &Url, headers: &[(String, String)]) -> Resp {
        let full = format!("{base}{}", url.render());
        let req = with_headers(self.http.get(&full), headers);
        send(req, WAIT)
            .await
            .unwrap_or_else(|e| panic!("GET {full}: {e}"))
    }

    pub fn running(&self) -> &Running {
        self.running.as_ref().expect("server running")
    }

    pub fn pool(&self) -> &sqlx::PgPool {
        &self.db.as_ref().expect("db").pool
    }

    /// `GET path` with `headers`, bounded by [`WAIT`].
    pub async fn get(&self, path: &str, headers: &[(String, String)]) -> Resp {
        self.get_with(&self.http, path, headers, WAIT).await
    }

    /// `GET url` with `headers`.
    pub fn fetch<'a>(
        &'a self,
        url: &Url,
        headers: &'a [(String, String)],
    ) -> impl Future<Output = Resp> + 'a {
        let path = url.render();
        async move { self.get(&path, headers).await }
    }

    /// `GET path` through `client`, bounded by `limit`.
    pub async fn get_with(
        &self,
        client: &reqwest::Client,
        path: &str,
        headers: &[(String, String)],
        limit: Duration,
    ) -> Resp {
        let req = with_headers(client.get(format!("{}{}", self.base, path)), headers);
        send(req, limit)
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// An arbitrary request (e.g. `OPTIONS`).
    pub async fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        headers: &[(String, String)],
    ) -> Resp {
        let url = format!("{}{}", self.base, path);
        let req = with_headers(self.http.request(method.clone(), &url), headers);
        send(req, WAIT)
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    // ----- fixtures -----

    pub async fn env(&self) -> DemoEnv {
        made(
            "create env",
            fixtures::create_env(self.pool(), "DEVELOPMENT"),
        )
        .await
    }

    pub async fn run(&self, env: &DemoEnv, spec: RunSpec) -> CreatedRun {
        made("create run", fixtures::create_run(self.pool(), env, spec)).await
    }

    /// A new environment's run and its run feed's snapshot (see [`FollowedRun`]).
    pub async fn follow_new_run(&self) -> FollowedRun {
        let env = self.env().await;
        let run = self.run(&env, RunSpec::default()).await;
        let headers = modern(&self.token(&env, &["read:runs"]));
        let url = run_url(&run.friendly_id);
        let snap = self.fetch(&url.snapshot(), &headers).await;
        snap.assert_status(200);
        FollowedRun {
            env,
            run,
            headers,
            url,
            snap,
        }
    }

    /// See [`RunAndTagSnapshots`]; `headers_of` builds the client's headers from the
    /// environment's secret key ([`modern`] or [`legacy`]).
    pub async fn run_and_tag_snapshots(
        &self,
        tag: &str,
        headers_of: fn(&str) -> Vec<(String, String)>,
    ) -> RunAndTagSnapshots {
        let env = self.env().await;
        let run = self.tagged_run(&env, &[tag]).await;
        let headers = headers_of(&env.api_key);
        let mut feeds = Vec::new();
        for url in [run_url(&run.friendly_id), tag_url(tag)] {
            let snap = self.fetch(&url.snapshot(), &headers).await;
            feeds.push((url, snap));
        }
        RunAndTagSnapshots {
            env,
            run,
            headers,
            feeds,
        }
    }

    /// `N` runs of `env` with the fixture defaults.
    pub async fn default_runs<const N: usize>(&self, env: &DemoEnv) -> [CreatedRun; N] {
        let mut runs = Vec::with_capacity(N);
        for _ in 0..N {
            runs.push(self.run(env, RunSpec::default()).await);
        }
        runs.try_into().expect("N runs")
    }

    /// A public access token of `env` scoped to `run` alone (`read:runs:<friendly id>`).
    pub fn run_token(&self, env: &DemoEnv, run: &CreatedRun) -> String {
        token(env, &[&format!("read:runs:{}", run.friendly_id)])
    }

    /// A PENDING run with `tags`.
    pub async fn tagged_run(&self, env: &DemoEnv, tags: &[&str]) -> CreatedRun {
        self.run(env, tagged(tags)).await
    }

    /// `N` PENDING runs, each with `tags`.
    pub async fn tagged_runs<const N: usize>(
        &self,
        env: &DemoEnv,
        tags: &[&str],
    ) -> [CreatedRun; N] {
        let mut runs = Vec::with_capacity(N);
        for _ in 0..N {
            runs.push(self.tagged_run(env, tags).await);
        }
        runs.try_into().expect("N runs")
    }

    /// A run without tags in the batch with internal id `batch_id`.
    pub async fn batch_run(&self, env: &DemoEnv, batch_id: &str) -> CreatedRun {
        let spec = RunSpec {
            batch_id: Some(batch_id.to_string()),
            ..RunSpec::default()
        };
        self.run(env, spec).await
    }

    /// A new batch with one run carrying `tags` in it: `(run, internal batch id, friendly batch id)`.
    pub async fn batched_run(&self, env: &DemoEnv, tags: &[&str]) -> (CreatedRun, String, String) {
        let (batch_id, batch_fid) = self.batch(env).await;
        let run = self.run(env, tagged_in_batch(tags, &batch_id)).await;
        (run, batch_id, batch_fid)
    }

    /// `(internal id, friendly id)`.
    pub async fn batch(&self, env: &DemoEnv) -> (String, String) {
        made("create batch", fixtures::create_batch(self.pool(), env)).await
    }

    /// Applies `set`; returns the committed `updatedAt` ms.
    pub async fn update(&self, run_id: &str, set: RunUpdate) -> i64 {
        made("update run", fixtures::update_run(self.pool(), run_id, set)).await
    }

    pub async fn set_status(&self, run_id: &str, status: &str) -> i64 {
        let set = RunUpdate {
            status: Some(status.into()),
            ..RunUpdate::default()
        };
        self.update(run_id, set).await
    }

    /// `url` is refused as bad input: 400 for a modern client, 422 for a legacy one (which
    /// loops on 400), each with a JSON `{"error": …}` (docs/protocol.md §8).
    pub async fn assert_bad_input(&self, url: &Url, key: &str, what: &str) {
        for (headers, status) in [(modern(key), 400), (legacy(key), 422)] {
            let r = self.fetch(url, &headers).await;
            assert_eq!(r.status, status, "{what}: {}", r.text);
            assert!(r.json["error"].is_string(), "{what}: {}", r.text);
        }
    }

    // ----- change records -----

    /// Waits until the server's subscriber is on `env_id`'s channel (PUBSUB NUMSUB ≥ 1), so a
    /// publish cannot be lost to a subscription still in flight.
    pub async fn wait_subscribed(&self, env_id: &str) {
        let redis = self.redis.as_ref().unwrap();
        let channel = channel_name(env_id);
        let deadline = Instant::now() + WAIT;
        loop {
            let counts: Vec<fred::types::Value> =
                within(WAIT, "PUBSUB NUMSUB", redis.pubsub_numsub(channel.clone()))
                    .await
                    .unwrap_or_default();
            let n = counts.get(1).and_then(|v| v.as_i64()).unwrap_or(0);
            if n >= 1 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "server never subscribed to {channel}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Publishes `record` like trigger.dev's webapp (after the server subscribed); asserts that
    /// the server's subscriber received it.
    pub async fn publish(&self, record: &ChangeRecord) {
        self.wait_subscribed(&record.env_id).await;
        let receivers = within(
            WAIT,
            "publish",
            self.publisher.as_ref().unwrap().publish(record),
        )
        .await
        .expect("publish");
        assert!(receivers >= 1, "no subscriber received the record");
    }

    /// A full record for `run` (tags and batch as given) with its committed `updatedAtMs`.
    pub fn record(
        env: &DemoEnv,
        run_id: &str,
        tags: &[&str],
        batch_id: Option<&str>,
        updated_at_ms: i64,
    ) -> ChangeRecord {
        ChangeRecord {
            v: 1,
            run_id: run_id.to_string().into(),
            env_id: env.env_id.clone().into(),
            tags: Some(tags.iter().map(|t| t.to_string()).collect()),
            batch_id: batch_id.map(str::to_string).map(Into::into),
            updated_at_ms: Some(updated_at_ms),
        }
    }

    /// A record naming only the run (no tags, no batch id, no `updatedAtMs`): docs/trigger-dev.md §5's
    /// partial records.
    pub fn partial_record(env: &DemoEnv, run_id: &str) -> ChangeRecord {
        ChangeRecord {
            v: 1,
            run_id: run_id.to_string().into(),
            env_id: env.env_id.clone().into(),
            ..ChangeRecord::default()
        }
    }

    /// Publishes the record of `run` as it was created (tags as given, its `updatedAt`).
    pub async fn publish_created(&self, env: &DemoEnv, run: &CreatedRun, tags: &[&str]) {
        self.publish(&Self::record(env, &run.id, tags, None, run.updated_at_ms))
            .await;
    }

    /// Updates the status of a run and publishes its change record.
    pub async fn change(
        &self,
        env: &DemoEnv,
        run_id: &str,
        tags: &[&str],
        batch_id: Option<&str>,
        status: &str,
    ) -> i64 {
        let ms = self.set_status(run_id, status).await;
        self.publish(&Self::record(env, run_id, tags, batch_id, ms))
            .await;
        ms
    }

    /// Sets the output of a run (untagged, no batch) and publishes its change record.
    pub async fn change_output(&self, env: &DemoEnv, run_id: &str, output: String) -> i64 {
        let set = RunUpdate {
            output: Some(output),
            ..RunUpdate::default()
        };
        let ms = self.update(run_id, set).await;
        self.publish(&Self::record(env, run_id, &[], None, ms))
            .await;
        ms
    }

    // ----- credentials -----

    /// A public access token for `env` with `scopes` (15 min).
    pub fn token(&self, env: &DemoEnv, scopes: &[&str]) -> String {
        token(env, scopes)
    }

    /// A public access token with a `realtime.skipColumns` claim.
    pub fn token_skip(&self, env: &DemoEnv, scopes: &[&str], skip: &[&str]) -> String {
        mint_with(&env.api_key, &env.env_id, scopes, TOKEN_TTL, Some(skip))
    }

    /// `http://<admin listener>` (`/metrics`, `/healthz`, `/readyz`).
    pub fn admin_base(&self) -> String {
        let addr = self.running().admin_addr.expect("admin listener enabled");
        format!("http://{addr}")
    }

    /// The Prometheus text the admin listener serves at `/metrics`.
    pub async fn scrape_text(&self) -> String {
        let url = format!("{}/metrics", self.admin_base());
        let resp = within(WAIT, "GET /metrics", self.http.get(&url).send())
            .await
            .expect("GET /metrics");
        assert_eq!(resp.status().as_u16(), 200, "GET /metrics status");
        within(WAIT, "/metrics body", resp.text())
            .await
            .expect("/metrics body")
    }

    /// Record batches the router has routed so far.
    pub fn routed_batches(&self) -> u64 {
        self.running().router.stats().batches.load(Ordering::SeqCst)
    }

    /// Waits until the router has routed more than `before` record batches.
    pub async fn wait_routed(&self, before: u64, what: &str) {
        let router = self.running().router.clone();
        wait_until(WAIT, what, || {
            router.stats().batches.load(Ordering::SeqCst) > before
        })
        .await;
    }

    /// Store hydrates the router has made so far.
    pub fn hydrates(&self) -> u64 {
        self.running()
            .router
            .stats()
            .hydrates
            .load(Ordering::SeqCst)
    }

    /// Held feeds `(run, tag, batch)`.
    pub fn held(&self) -> (usize, usize, usize) {
        self.running().router.held_feeds()
    }

    /// Sends the `live` requests, runs `act` once the router's held feeds `(run, tag, batch)`
    /// satisfy `held`, and returns the answers (in order) with `act`'s result; bounded by [`WAIT`].
    pub async fn polls_during<const N: usize, T>(
        &self,
        live: [Url; N],
        headers: &[(String, String)],
        held: impl Fn((usize, usize, usize)) -> bool,
        act: impl Future<Output = T>,
    ) -> ([Resp; N], T) {
        let polls = futures::future::join_all(live.iter().map(|u| self.fetch(u, headers)));
        let act = async {
            self.wait_held("the live polls held", held).await;
            act.await
        };
        let (answers, out) =
            within(WAIT, "held live polls", async { tokio::join!(polls, act) }).await;
        (answers.try_into().expect("one answer per poll"), out)
    }

    /// Waits until `held()` satisfies `cond`.
    pub async fn wait_held(&self, what: &str, cond: impl Fn((usize, usize, usize)) -> bool) {
        let router = self.running().router.clone();
        wait_until(WAIT, what, || cond(router.held_feeds())).await;
    }
}

/// Waits until `router` has a confirmed subscription for `env_id` (a touch then hands out a
/// usable cursor).
pub async fn wait_confirmed(router: &Router, env_id: &str, what: &str) {
    let env_id = EnvId::from(env_id);
    wait_until(WAIT, what, || router.touch(&env_id).epoch != 0).await;
}

/// The lifetime of the tests' public access tokens.
pub const TOKEN_TTL: Duration = Duration::from_secs(900);

/// A public access token for `env` with `scopes` ([`TOKEN_TTL`]).
pub fn token(env: &DemoEnv, scopes: &[&str]) -> String {
    mint(&env.api_key, &env.env_id, scopes, TOKEN_TTL)
}

/// A public access token for `env_id` signed with `key`, valid for `ttl`.
pub fn mint(key: &str, env_id: &str, scopes: &[&str], ttl: Duration) -> String {
    mint_with(key, env_id, scopes, ttl, None)
}

/// [`mint`] with an optional `realtime.skipColumns` claim.
pub fn mint_with(
    key: &str,
    env_id: &str,
    scopes: &[&str],
    ttl: Duration,
    skip: Option<&[&str]>,
) -> String {
    let scopes: Vec<String> = scopes.iter().map(|s| s.to_string()).collect();
    let skip: Option<Vec<String>> = skip.map(|s| s.iter().map(|c| c.to_string()).collect());
    mint_public_token(key, env_id, &scopes, ttl, skip.as_deref()).expect("mint token")
}

impl Drop for TestServer {
    fn drop(&mut self) {
        // Stop serving (the task ends when the runtime does), close clients, then drop the
        // database from a separate thread with its own runtime (works while panicking, too).
        drop(self.running.take());
        drop(self.publisher.take());
        drop(self.redis.take());
        let (name, admin) = (self.db_name.clone(), self.db_admin.clone());
        drop(self.db.take());
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                let _ = rt.block_on(async {
                    tokio::time::timeout(
                        Duration::from_secs(20),
                        runfeed::store::setup::drop_database(&admin, &name),
                    )
                    .await
                });
            }
        })
        .join();
    }
}

/// A minimal Electric client: follows one feed like `@electric-sql/client` (snapshot, then live
/// polls echoing handle/offset/cursor) and keeps a materialized view (insert = set, update =
/// shallow merge).
#[derive(Debug)]
pub struct Follower {
    pub url: Url,
    pub headers: Vec<(String, String)>,
    pub handle: Option<String>,
    pub offset: String,
    pub cursor: Option<String>,
    pub view: HashMap<String, serde_json::Map<String, Value>>,
    pub responses: usize,
}

impl Follower {
    pub fn new(url: Url, headers: Vec<(String, String)>) -> Follower {
        Follower {
            url,
            headers,
            handle: None,
            offset: "-1".into(),
            cursor: None,
            view: HashMap::new(),
            responses: 0,
        }
    }

    /// Applies a response's messages to the view.
    pub fn apply(&mut self, resp: &Resp) {
        for m in resp.changes() {
            let id = m["value"]["id"].as_str().expect("row id").to_string();
            let value = m["value"].as_object().expect("value object").clone();
            match m["headers"]["operation"].as_str() {
                Some("insert") => {
                    self.view.insert(id, value);
                }
                Some("update") => {
                    let row = self.view.entry(id).or_default();
                    for (k, v) in value {
                        row.insert(k, v);
                    }
                }
                Some("delete") => {
                    self.view.remove(&id);
                }
                other => panic!("unexpected operation {other:?}"),
            }
        }
    }

    /// One request (snapshot if no handle yet, else live); applies the response.
    pub async fn step(&mut self, srv_base: &str, client: &reqwest::Client) -> Result<u16, String> {
        let url = match &self.handle {
            None => self.url.snapshot(),
            Some(h) => self.url.live(h, &self.offset, self.cursor.as_deref()),
        };
        let req = with_headers(
            client.get(format!("{srv_base}{}", url.render())),
            &self.headers,
        );
        let r = send(req, WAIT).await?;
        let status = r.status;
        if status != 200 {
            return Err(format!("status {status}: {}", r.text));
        }
        self.apply(&r);
        self.handle = Some(r.handle());
        self.offset = r.offset();
        self.cursor = r.cursor();
        self.responses += 1;
        Ok(status)
    }
}

/// The streaming replica of the test run (`RUNFEED_TEST_REPLICA_URL`) serves one test at a time:
/// some tests pause its replay, which would stall any other test reading from it. Every test that
/// reads from the replica holds this lock (`REPLICA.lock().await`, or `REPLICA.blocking_lock()`
/// outside a runtime); a test that panics releases it.
pub static REPLICA: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
