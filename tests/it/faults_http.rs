//! Faults at the HTTP edge, each against the real Postgres and Redis (docs/faults.md):
//!
//! - tokens during a hold: a public token that expires while its feed is held gets a JSON 401
//!   on the next poll; a run token (`typ: run+jwt`) gets a JSON 401 naming its type;
//! - Postgres faults: a stopped primary, a frozen one (SIGSTOP), and `max_connections`
//!   exhausted by another client, give a JSON 503 with `Retry-After` within the pool's acquire bound (never a hang),
//!   `/readyz` names `postgres`, and service resumes without restarting runfeed (an own
//!   PostgreSQL instance from scripts/pg-instance.sh, never the shared one);
//! - a read replica promoted while the primary keeps taking the writes (a streaming replica of
//!   that own instance, scripts/replica.sh): reads go to the primary, followers get every later
//!   change, `/readyz` stays 200 naming `postgres_replica`;
//! - descriptors exhausted: the real binary under a low `RLIMIT_NOFILE` closes what it cannot
//!   serve, does not spin, counts refused connections, and serves again once descriptors free;
//! - a stalled SSE reader: its stream ends once its queue stays full, the metric counts it, its
//!   hold is released, and a healthy reader of the same run gets every change.

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use common::*;
use runfeed::app;
use runfeed_dev::fixtures::{self, CreatedRun, DemoEnv, RunSpec, TestDb};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::time::Instant;

// ---------------------------------------------------------------------------------------------
// Tokens during a hold

/// A public token valid for 2–3 s, held for 5 s: the poll held across its expiry answers normally, the next poll
/// gets trigger.dev's JSON 401 at once (never a 5xx or a hang).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_public_token_that_expires_during_a_hold_gets_a_json_401_on_its_next_poll() {
    let (srv, env) = TestServer::with_env(5_000).await;
    let run = srv.run(&env, RunSpec::default()).await;
    let scope = format!("read:runs:{}", run.friendly_id);
    let token = mint(&env.api_key, &env.env_id, &[&scope], Duration::from_secs(3));
    let headers = modern(&token);
    let url = run_url(&run.friendly_id);
    let snap = srv.fetch(&url.snapshot(), &headers).await;
    snap.assert_status(200);
    let held = srv.fetch(&url.live_after(&snap), &headers).await;
    held.assert_status(200);
    assert!(
        held.elapsed >= Duration::from_millis(4_500),
        "the poll was held"
    );
    let next = srv.fetch(&url.live_after(&held), &headers).await;
    assert_eq!(next.status, 401, "{}", next.text);
    assert_eq!(
        next.json,
        json!({"error": "Public Access Token is invalid"})
    );
    assert!(next.elapsed < Duration::from_secs(2), "answered at once");
}

/// An SDK 4.8 run token (`TRIGGER_RUN_TOKEN`, header `typ: run+jwt`) cannot be verified: a JSON
/// 401 whose body names the token type, before any lookup — whatever its claims say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_token_gets_a_json_401_naming_the_token_type() {
    let (srv, env) = TestServer::with_env(1_000).await;
    let run = srv.run(&env, RunSpec::default()).await;
    let now = runfeed::auth::jwt::now_s();
    let sign = |claims: Value| {
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256);
        header.typ = Some("run+jwt".into());
        let key = jsonwebtoken::EncodingKey::from_secret(env.api_key.as_bytes()).expect("key");
        jsonwebtoken::encode(&header, &claims, &key).expect("sign")
    };
    let tokens = [
        sign(json!({"sub": run.id, "iat": now, "exp": now + 600})),
        // Even one that claims to be a public token.
        sign(
            json!({"pub": true, "sub": env.env_id, "scopes": ["read:all"],
            "iss": "https://id.trigger.dev", "aud": "https://api.trigger.dev", "iat": now, "exp": now + 600}),
        ),
    ];
    for token in tokens {
        for url in feed_urls(&run.friendly_id, "a", "batch_x") {
            let r = srv.fetch(&url.snapshot(), &modern(&token)).await;
            assert_eq!(r.status, 401, "{}: {}", url.path, r.text);
            assert_eq!(r.json["tokenType"], "run+jwt", "{}", r.text);
            let error = r.json["error"].as_str().expect("error text");
            assert!(
                error.contains("Run tokens") && error.contains("TRIGGER_RUN_TOKEN"),
                "{error}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Postgres faults (an own instance)

/// An own PostgreSQL primary on a free port (scripts/pg-instance.sh); destroyed on drop.
struct OwnPostgres {
    port: u16,
}

/// `bash scripts/<script> <args>`.
fn script_command(script: &str, args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new("bash");
    command
        .arg(format!("{}/scripts/{script}", env!("CARGO_MANIFEST_DIR")))
        .args(args);
    command
}

/// Runs `scripts/<script>` with `args`; asserts it succeeded.
fn run_script(script: &str, args: &[&str]) {
    let out = script_command(script, args)
        .output()
        .unwrap_or_else(|e| panic!("run scripts/{script}: {e}"));
    assert!(
        out.status.success(),
        "{script} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl OwnPostgres {
    fn script(args: &[&str]) {
        run_script("pg-instance.sh", args);
    }

    fn start(max_connections: u32) -> OwnPostgres {
        let port = free_port();
        let p = port.to_string();
        Self::script(&[
            "start",
            "--port",
            &p,
            "--max-connections",
            &max_connections.to_string(),
        ]);
        OwnPostgres { port }
    }

    fn admin(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    fn stop(&self) {
        Self::script(&["stop", "--port", &self.port.to_string()]);
    }

    fn resume(&self) {
        Self::script(&["resume", "--port", &self.port.to_string()]);
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let _ = script_command(
            "pg-instance.sh",
            &["destroy", "--port", &self.port.to_string()],
        )
        .output();
    }
}

/// An in-process runfeed on `db`, its HTTP client and base URL.
async fn serve_on(db: &TestDb, hold_ms: u64) -> (app::Running, reqwest::Client, String) {
    let mut config = test_config(&db.url, hold_ms);
    config.database.max_connections = 4;
    serve(config).await
}

/// An in-process runfeed with `config`, its HTTP client and base URL.
async fn serve(config: runfeed::config::Config) -> (app::Running, reqwest::Client, String) {
    let running = within(WAIT, "start runfeed", app::start(config))
        .await
        .expect("start runfeed");
    let base = format!("http://{}", running.addr);
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    (running, http, base)
}

async fn get(http: &reqwest::Client, url: &str, headers: &[(String, String)]) -> Resp {
    // A client timeout well above the pool's 5 s acquire bound: a hang shows up as an error.
    send(
        with_headers(http.get(url), headers),
        Duration::from_secs(12),
    )
    .await
    .unwrap_or_else(|e| panic!("GET {url}: {e}"))
}

/// The refusal every request gets while the database is unreachable.
fn assert_json_503(r: &Resp, what: &str) {
    assert_eq!(r.status, 503, "{what}: {}", r.text);
    assert_eq!(r.json, json!({"error": "Service Unavailable"}), "{what}");
    assert_eq!(r.header("retry-after"), Some("1"), "{what}");
    assert!(
        r.elapsed < Duration::from_secs(8),
        "{what}: answered within the acquire bound, took {:?}",
        r.elapsed
    );
}

/// `/readyz` is 503 and its failing check is `check`, the others (Redis) still `ok`.
async fn assert_not_ready_for(http: &reqwest::Client, admin: std::net::SocketAddr, check: &str) {
    let r = get(http, &format!("http://{admin}/readyz"), &[]).await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert_ne!(r.json["checks"][check], "ok", "{}", r.text);
    assert_eq!(r.json["checks"]["redis"], "ok", "{}", r.text);
}

/// Until a snapshot of `url` is a 200 again (bounded), without restarting runfeed.
async fn wait_served(http: &reqwest::Client, url: &str, headers: &[(String, String)]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = get(http, url, headers).await;
        if r.status == 200 {
            return;
        }
        assert!(
            r.status == 503,
            "only 503s while recovering: {} {}",
            r.status,
            r.text
        );
        assert!(Instant::now() < deadline, "service never resumed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_postgres_gets_a_json_503_with_retry_after_and_readyz_names_it_then_service_resumes(
) {
    let pg = OwnPostgres::start(50);
    let db = made("test db", TestDb::create(&pg.admin())).await;
    let (running, http, base) = serve_on(&db, 2_000).await;
    let env = made("env", fixtures::create_env(&db.pool, "DEVELOPMENT")).await;
    let run = made(
        "run",
        fixtures::create_run(&db.pool, &env, RunSpec::default()),
    )
    .await;
    let fresh = made(
        "run",
        fixtures::create_run(&db.pool, &env, RunSpec::default()),
    )
    .await;
    let headers = modern(&env.api_key);
    let snap = get(
        &http,
        &format!("{base}{}", run_url(&run.friendly_id).snapshot().render()),
        &headers,
    )
    .await;
    snap.assert_status(200);
    // A live poll held while the database goes away answers within its hold bound.
    let live = tokio::spawn({
        let (http, url, headers) = (
            http.clone(),
            format!(
                "{base}{}",
                run_url(&run.friendly_id).live_after(&snap).render()
            ),
            headers.clone(),
        );
        async move { get(&http, &url, &headers).await }
    });
    pg.stop();
    let held = live.await.expect("live poll task");
    assert!(
        held.status == 200 || held.status == 503,
        "{} {}",
        held.status,
        held.text
    );
    if held.status == 503 {
        assert_json_503(&held, "the held poll");
    }
    let fresh_url = format!("{base}{}", run_url(&fresh.friendly_id).snapshot().render());
    assert_json_503(&get(&http, &fresh_url, &headers).await, "a snapshot");
    assert_not_ready_for(&http, running.admin_addr.expect("admin"), "postgres").await;
    pg.resume();
    wait_served(&http, &fresh_url, &headers).await;
    running.stop().await;
    db.pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connections_exhausted_by_another_client_gets_a_json_503_then_service_resumes() {
    let pg = OwnPostgres::start(12);
    let db = made("test db", TestDb::create(&pg.admin())).await;
    let (running, http, base) = serve_on(&db, 2_000).await;
    let env = made("env", fixtures::create_env(&db.pool, "DEVELOPMENT")).await;
    let fresh = made(
        "run",
        fixtures::create_run(&db.pool, &env, RunSpec::default()),
    )
    .await;
    let headers = modern(&env.api_key);
    get(
        &http,
        &format!("{base}/realtime/v1/runs/run_none"),
        &headers,
    )
    .await
    .assert_status(404);
    // Another client takes every slot, then runfeed's own connections are cut: it must
    // reconnect and cannot.
    let url = format!("{}/{}", pg.admin(), db.name);
    let mut hog = Vec::new();
    let connect = || async {
        use sqlx::Connection;
        sqlx::PgConnection::connect(&url).await
    };
    while let Ok(conn) = connect().await {
        hog.push(conn);
        assert!(hog.len() < 20, "max_connections is 12");
    }
    // Cut runfeed's connections and take the freed slots, until none of runfeed's is left (its
    // pool may reconnect between the cut and the hog's next connect on a busy machine).
    for round in 0.. {
        assert!(round < 50, "runfeed kept a connection through 50 cuts");
        let first = hog.first_mut().expect("at least one hog connection");
        let left: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'runfeed'",
        )
        .fetch_one(&mut *first)
        .await
        .expect("cut runfeed's connections");
        while let Ok(conn) = connect().await {
            hog.push(conn);
        }
        if left == 0 {
            break;
        }
    }
    let fresh_url = format!("{base}{}", run_url(&fresh.friendly_id).snapshot().render());
    assert_json_503(&get(&http, &fresh_url, &headers).await, "a snapshot");
    assert_not_ready_for(&http, running.admin_addr.expect("admin"), "postgres").await;
    drop(hog);
    wait_served(&http, &fresh_url, &headers).await;
    running.stop().await;
    db.pool.close().await;
}

/// A frozen Postgres (the postmaster and every backend SIGSTOPped: no error comes back and no
/// connection closes) cannot enforce its own `statement_timeout`: runfeed bounds every query
/// itself, so each request that needs the store (a new API key, a cold snapshot of a run, a new
/// tag, a batch), on the connections its pool already holds or on new ones, is a JSON 503 with
/// `Retry-After` within the statement timeout plus the pool's acquire bound — never a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_postgres_answers_503_within_the_statement_timeout() {
    let pg = OwnPostgres::start(50);
    let db = made("test db", TestDb::create(&pg.admin())).await;
    let mut config = test_config(&db.url, 2_000);
    config.database.max_connections = 4;
    config.database.statement_timeout_ms = 2_000;
    let (running, http, base) = serve(config).await;
    let env = made("env", fixtures::create_env(&db.pool, "DEVELOPMENT")).await;
    let other = made("env", fixtures::create_env(&db.pool, "DEVELOPMENT")).await;
    let mut runs = Vec::new();
    for _ in 0..5 {
        runs.push(
            made(
                "run",
                fixtures::create_run(&db.pool, &env, RunSpec::default()),
            )
            .await,
        );
    }
    let other_run = made(
        "run",
        fixtures::create_run(&db.pool, &other, RunSpec::default()),
    )
    .await;
    let headers = modern(&env.api_key);
    // Open the pool's connections: concurrent snapshots of the first runs.
    let warm = runs[..4].iter().map(|run| {
        let (http, headers) = (http.clone(), headers.clone());
        let url = format!("{base}{}", run_url(&run.friendly_id).snapshot().render());
        tokio::spawn(async move { get(&http, &url, &headers).await })
    });
    for r in warm.collect::<Vec<_>>() {
        r.await.expect("warm-up task").assert_status(200);
    }
    // Queries in flight when the database freezes: held on a lock (server-side, within the
    // statement timeout) until every backend is stopped, so none can time out on its own.
    let mut lock = db.pool.begin().await.expect("begin");
    sqlx::query(r#"LOCK TABLE "RuntimeEnvironment", "TaskRun" IN ACCESS EXCLUSIVE MODE"#)
        .execute(&mut *lock)
        .await
        .expect("lock the tables");
    let ask = |what: &'static str, url: Url, headers: Vec<(String, String)>| {
        let http = http.clone();
        let url = format!("{base}{}", url.render());
        tokio::spawn(async move { (what, get(&http, &url, &headers).await) })
    };
    let mut asked = vec![
        ask(
            "a new API key",
            run_url(&other_run.friendly_id).snapshot(),
            modern(&other.api_key),
        ),
        ask(
            "a cold snapshot of a run",
            run_url(&runs[4].friendly_id).snapshot(),
            headers.clone(),
        ),
    ];
    within(
        Duration::from_secs(2),
        "runfeed's queries wait on the lock",
        wait_sql(
            &db.pool,
            "runfeed's queries wait on the lock",
            "SELECT count(*) >= 2 FROM pg_stat_activity WHERE application_name = 'runfeed' AND wait_event_type = 'Lock'",
            None,
        ),
    )
    .await;
    let frozen = runfeed_dev::faults::postgres::Frozen::stop(pg.port).expect("SIGSTOP postgres");
    // And requests that need the store once it is frozen.
    asked.extend([
        ask(
            "a new tag",
            tag_url("frozen-tag").snapshot(),
            headers.clone(),
        ),
        ask(
            "a batch",
            batch_url("batch_frozen").snapshot(),
            headers.clone(),
        ),
        ask(
            "a run that does not exist",
            run_url("run_frozen").snapshot(),
            headers.clone(),
        ),
    ]);
    for task in asked {
        let (what, r) = within(Duration::from_secs(20), "a request while frozen", task)
            .await
            .expect("request task");
        assert_json_503(&r, what);
    }
    // A second round on what the first round left in the pool.
    let again = get(
        &http,
        &format!("{base}{}", tag_url("frozen-tag-2").snapshot().render()),
        &headers,
    )
    .await;
    assert_json_503(&again, "a request after the first round");
    drop(frozen); // SIGCONT
    lock.rollback().await.expect("release the lock");
    let url = format!(
        "{base}{}",
        run_url(&runs[4].friendly_id).snapshot().render()
    );
    wait_served(&http, &url, &headers).await;
    running.stop().await;
    db.pool.close().await;
}

// ---------------------------------------------------------------------------------------------
// A read replica promoted while the primary keeps taking the writes

/// A streaming replica (scripts/replica.sh, no apply delay) of an [`OwnPostgres`] on a free
/// port; stopped and removed on drop.
struct OwnReplica {
    port: u16,
}

impl OwnReplica {
    fn start(primary: &OwnPostgres) -> OwnReplica {
        let port = free_port();
        run_script(
            "replica.sh",
            &[
                "start",
                "--port",
                &port.to_string(),
                "--primary-port",
                &primary.port.to_string(),
                "--delay-ms",
                "0",
            ],
        );
        OwnReplica { port }
    }

    fn admin(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    /// `pg_ctl promote` (on a blocking thread); returns once the replica left recovery.
    async fn promote(&self) {
        let port = self.port.to_string();
        tokio::task::spawn_blocking(move || {
            run_script("replica.sh", &["promote", "--port", &port])
        })
        .await
        .expect("promote task");
    }
}

impl Drop for OwnReplica {
    fn drop(&mut self) {
        let _ = script_command("replica.sh", &["stop", "--port", &self.port.to_string()]).output();
    }
}

/// `database.replica_url` is a streaming replica that gets promoted (`pg_is_in_recovery()`
/// false) while `database.url` keeps taking the writes: the promoted copy no longer receives
/// the primary's commits, so runfeed reads the primary instead. A follower of a run gets the
/// version committed on the primary after the promotion; `/readyz` stays 200 and names
/// `postgres_replica`; `runfeed_pg_replica_bypassed` is 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_is_not_read_while_the_primary_takes_writes() {
    let pg = OwnPostgres::start(50);
    let replica = OwnReplica::start(&pg);
    let replica_admin = replica.admin();
    let srv = TestServer::start_on(&pg.admin(), 2_000, |c| {
        let name = runfeed::store::setup::database_name(&c.database.url).expect("db name");
        c.database.replica_url = Some(fixtures::database_url(&replica_admin, &name));
    })
    .await;
    let env = srv.env().await;
    let run = srv.run(&env, RunSpec::default()).await;
    // The copy about to be promoted holds the environment and the run's first version.
    let on_replica = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy(
            srv.config
                .database
                .replica_url
                .as_deref()
                .expect("replica url"),
        )
        .expect("replica pool");
    // Replication signals nothing a test can await: poll the replica until the row is there.
    let streamed = async {
        loop {
            let found = sqlx::query(r#"SELECT 1 FROM "TaskRun" WHERE id = $1"#)
                .bind(&run.id)
                .fetch_optional(&on_replica)
                .await;
            if matches!(found, Ok(Some(_))) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    within(WAIT, "the run streamed to the replica", streamed).await;
    on_replica.close().await;
    let headers = modern(&srv.token(&env, &["read:runs"]));
    let url = run_url(&run.friendly_id);
    let snap = srv.fetch(&url.snapshot(), &headers).await;
    snap.assert_status(200);

    // A follower holds the run feed; the replica is promoted; the primary commits a new
    // version and publishes its change record.
    let ([mut last], ()) = srv
        .polls_during(
            [url.live_after(&snap)],
            &headers,
            |held| held.0 == 1,
            async {
                replica.promote().await;
                srv.change(&env, &run.id, &[], None, "COMPLETED_SUCCESSFULLY")
                    .await;
            },
        )
        .await;
    // The follower gets it (an answer at the hold's end without it is followed by the next
    // live poll, as a client does).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !last.text.contains("COMPLETED_SUCCESSFULLY") {
        last.assert_status(200);
        assert!(
            Instant::now() < deadline,
            "the follower never got the version committed after the promotion: {}",
            last.text
        );
        last = srv.fetch(&url.live_after(&last), &headers).await;
    }

    // Reads still work, so the server stays ready, but says why it reads the primary.
    let ready = get(&srv.http, &format!("{}/readyz", srv.admin_base()), &[]).await;
    assert_eq!(ready.status, 200, "{}", ready.text);
    let check = ready.json["checks"]["postgres_replica"]
        .as_str()
        .unwrap_or_default();
    assert!(check.contains("not in recovery"), "{}", ready.text);
    assert_eq!(ready.json["checks"]["postgres"], "ok", "{}", ready.text);
    let metrics = srv.scrape_text().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("runfeed_pg_replica_bypassed") && l.ends_with(" 1")),
        "runfeed_pg_replica_bypassed is 1"
    );
}

// ---------------------------------------------------------------------------------------------
// File descriptors exhausted (the real binary)

/// CPU seconds (user + system) `pid` has used, from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/<pid>/stat");
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 =
        fields[11].parse::<f64>().expect("utime") + fields[12].parse::<f64>().expect("stime");
    ticks / 100.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_descriptor_limit_connections_are_refused_without_a_busy_loop_and_service_resumes()
{
    let _ = rlimit::increase_nofile_limit(4096);
    let db = made("test db", TestDb::create(PG_ADMIN)).await;
    let admin = format!("127.0.0.1:{}", free_port());
    let mut child = tokio::process::Command::new("sh")
        .args(["-c", "ulimit -n 64 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_runfeed"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--database-url", &db.url, "--redis-url", &redis_url()])
        .env_remove("DATABASE_URL")
        .env_remove("DATABASE_READ_REPLICA_URL")
        .env_remove("REDIS_URL")
        .env("RUNFEED_TELEMETRY__ADMIN_LISTEN", &admin)
        .env("RUNFEED_SERVER__HEADER_READ_TIMEOUT_MS", "60000")
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn runfeed serve");
    let pid = child.id().expect("pid");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let addr = within(WAIT, "runfeed listening", async {
        loop {
            let line = lines
                .next_line()
                .await
                .expect("stdout")
                .expect("runfeed exited");
            if let Some(addr) = line.strip_prefix("runfeed listening on http://") {
                return addr.trim().to_string();
            }
        }
    })
    .await;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let healthz = || async {
        let mut s = TcpStream::connect(&addr).await?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await?;
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
            .await
            .map_err(|_| std::io::Error::other("no answer within 5 s"))??;
        Ok::<_, std::io::Error>(out)
    };
    assert!(healthz()
        .await
        .expect("healthz")
        .starts_with("HTTP/1.1 200"));
    // Idle connections (no request head yet) each pin a descriptor of the server.
    let mut idle = Vec::new();
    for _ in 0..100 {
        idle.push(TcpStream::connect(&addr).await.expect("connect"));
    }
    // Past the limit: the connection is closed unserved, quickly (not left in the backlog).
    let refused = healthz().await;
    assert!(
        !refused
            .as_ref()
            .is_ok_and(|r| r.starts_with("HTTP/1.1 200")),
        "served past the limit: {refused:?}"
    );
    // No busy loop while descriptors stay exhausted: well under a tenth of a core.
    let (cpu0, t0) = (cpu_seconds(pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let share = (cpu_seconds(pid) - cpu0) / t0.elapsed().as_secs_f64();
    assert!(
        share < 0.10,
        "the accept loop used {share:.2} of a core while out of descriptors"
    );
    drop(idle);
    // Service resumes by itself; the admin listener then reports the refusals.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if healthz().await.is_ok_and(|r| r.starts_with("HTTP/1.1 200")) {
            break;
        }
        assert!(Instant::now() < deadline, "service never resumed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metrics = reqwest::get(format!("http://{admin}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    let counter = |name: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert!(
        counter("runfeed_http_refused_connections_total") >= 1.0,
        "{metrics}"
    );
    let errors = counter("runfeed_http_accept_errors_total");
    assert!(
        (1.0..200.0).contains(&errors),
        "accept errors back off: {errors}"
    );
    let _ = child.kill().await;
    db.cleanup().await.expect("drop test db");
}

// ---------------------------------------------------------------------------------------------
// A stalled SSE reader

/// Whether the server's socket of the connection `server_port` ← `client_port` (loopback) is
/// closed by its process: absent from /proc/net/tcp, or orphaned (inode 0).
fn server_socket_closed(server_port: u16, client_port: u16) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let local = format!(":{server_port:04X}");
    let remote = format!(":{client_port:04X}");
    !table.lines().skip(1).any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        f.len() > 9 && f[1].ends_with(&local) && f[2].ends_with(&remote) && f[9] != "0"
    })
}

/// An SSE request for `target` on a socket with a small receive buffer that is never read.
async fn stalled_sse(addr: &str, target: &str, token: &str) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut stream = socket
        .connect(addr.parse().expect("addr"))
        .await
        .expect("connect");
    let head = format!(
        "GET {target} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         x-trigger-electric-version: {ELECTRIC_VERSION}\r\nAccept: text/event-stream\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.expect("send head");
    stream
}

/// A server configured by `tweak` (20 s holds), a run on it, a token for it, the SSE live URL
/// at the run's snapshot offset and the server's `host:port`.
async fn sse_run(
    tweak: impl FnOnce(&mut runfeed::config::Config),
) -> (TestServer, DemoEnv, CreatedRun, String, Url, String) {
    let (srv, env) = TestServer::start_with_env(20_000, tweak).await;
    let run = srv.run(&env, RunSpec::default()).await;
    let token = srv.token(&env, &["read:runs"]);
    let url = run_url(&run.friendly_id);
    let snap = srv.fetch(&url.snapshot(), &modern(&token)).await;
    snap.assert_status(200);
    let sse = url
        .live_at(&snap)
        .q("experimental_live_sse", "true")
        .q("live_sse", "true");
    let addr = srv.base.trim_start_matches("http://").to_string();
    (srv, env, run, token, sse, addr)
}

/// An SSE request for `sse` whose body the caller reads (status 200 checked).
async fn reading_sse(srv: &TestServer, sse: &Url, token: &str) -> reqwest::Response {
    let resp = srv
        .http
        .get(format!("{}{}", srv.base, sse.render()))
        .header("authorization", format!("Bearer {token}"))
        .header("x-trigger-electric-version", ELECTRIC_VERSION)
        .send()
        .await
        .expect("SSE request");
    assert_eq!(resp.status(), 200);
    resp
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_sse_reader_is_ended_past_its_queue_bound_and_a_reading_one_gets_every_change() {
    let (srv, env, run, token, sse, addr) = sse_run(|c| {
        c.feeds.sse_max_queued_bytes = 64 * 1024;
        c.feeds.sse_max_queued_events = 8;
        c.feeds.sse_stall_timeout_ms = 1_000;
        // The connection-level bound must not be what ends it.
        c.server.write_stall_timeout_ms = 120_000;
    })
    .await;
    let stalled = stalled_sse(&addr, &sse.render(), &token).await;
    let mut healthy = reading_sse(&srv, &sse, &token).await;
    wait_until(WAIT, "both streams hold the run", || {
        srv.running().router.held_feeds().0 == 2
    })
    .await;
    let stalled_before = runfeed::http::sse::stalled_streams();
    let big = "x".repeat(256 * 1024);
    let changes = 40;
    let reader = tokio::spawn(async move {
        let mut seen = String::new();
        let deadline = Instant::now() + WAIT;
        let last = format!("\\\"n\\\":{}", changes - 1);
        while !seen.contains(&last) {
            let chunk = tokio::time::timeout_at(deadline, healthy.chunk())
                .await
                .expect("the healthy stream got every change in time")
                .expect("healthy stream read");
            let Some(chunk) = chunk else {
                panic!("the healthy stream ended")
            };
            seen.push_str(&String::from_utf8_lossy(&chunk));
            if seen.contains(&last) {
                break;
            }
            // Keep only the tail (a marker split across chunks is rejoined).
            if seen.len() > 1 << 20 {
                seen.drain(..seen.len() - 4096);
            }
        }
    });
    for n in 0..changes {
        let output = format!("{{\"n\":{n},\"pad\":\"{big}\"}}");
        srv.change_output(&env, &run.id, output).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    reader.await.expect("healthy reader");
    wait_until(WAIT, "the stalled stream was ended", || {
        runfeed::http::sse::stalled_streams() > stalled_before
    })
    .await;
    wait_until(WAIT, "its hold was released", || {
        srv.running().router.held_feeds().0 <= 1
    })
    .await;
    // The server closed its end of the connection (long before its 120 s write-stall timeout),
    // though the client still reads nothing: the kernel lists the server's socket as orphaned
    // (inode 0) or not at all.
    let client_port = stalled.local_addr().expect("local addr").port();
    let server_port: u16 = addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    wait_until(WAIT, "the server closed the stalled connection", || {
        server_socket_closed(server_port, client_port)
    })
    .await;
    drop(stalled);
}

/// SSE streams that register behind a change of their run (a stalled stream between two holds,
/// here streams opened at an offset the change came after) replay it from the router's buffer:
/// one store read and one serialization of the row for all of them, so each keeps a reference
/// to the same bytes instead of a private copy of the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_streams_behind_a_change_share_one_store_read_of_its_row() {
    let (srv, env, run, token, sse, addr) = sse_run(|c| {
        // The streams open after the change: its record must still be replayable then, on a
        // slow machine too.
        c.router.replay_window_ms = 60_000;
    })
    .await;
    // The change reaches the router while no feed holds the run: nothing hydrates it then.
    let routed = srv.routed_batches();
    let marker = "shared-row-marker";
    let output = format!(
        "{{\"marker\":\"{marker}\",\"pad\":\"{}\"}}",
        "x".repeat(64 * 1024)
    );
    srv.change_output(&env, &run.id, output).await;
    srv.wait_routed(routed, "the change was routed").await;
    let stats = srv.running().router.stats();
    let (hydrates, replays) = (
        srv.hydrates(),
        stats
            .replays_delivered
            .load(std::sync::atomic::Ordering::SeqCst),
    );
    let streams = 8;
    let mut stalled = Vec::new();
    for _ in 0..streams {
        stalled.push(stalled_sse(&addr, &sse.render(), &token).await);
    }
    let mut reading = reading_sse(&srv, &sse, &token).await;
    let mut seen = String::new();
    while !seen.contains(marker) {
        let chunk = within(WAIT, "the reading stream got the change", reading.chunk())
            .await
            .expect("SSE read")
            .expect("the stream went on");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    wait_until(WAIT, "every stream replayed the change", || {
        stats
            .replays_delivered
            .load(std::sync::atomic::Ordering::SeqCst)
            > replays + streams
    })
    .await;
    assert_eq!(
        srv.hydrates() - hydrates,
        1,
        "{} streams replaying one change read its row once",
        streams + 1
    );
    drop(stalled);
}
