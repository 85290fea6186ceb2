//! Graceful shutdown of the real binary : `runfeed serve` gets SIGTERM while 1 000 live
//! polls are held. Every client must get a complete `200` with `up-to-date` (clients re-poll on
//! another instance), none a reset, and the process must exit 0 within a bounded time.
//!
//! Also the slow-client bounds of the accept loop (`src/http/serve.rs`): a client that never
//! finishes its request head is disconnected after the header-read timeout, while a held live
//! poll (head complete, waiting for a change) is not.
//!
//! Postgres: `RUNFEED_TEST_PG` (default `postgres://postgres@127.0.0.1:5432`), a fresh
//! `runfeed_t_<random>` database per test. Redis: `RUNFEED_TEST_REDIS` (default
//! `redis://127.0.0.1:6379`).

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use common::{free_port, redis_url, with_test_db, TestServer};
use runfeed::redis::{Publisher, RedisOptions};
use runfeed_dev::fixtures::{self, CreatedRun, DemoEnv, TestDb};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

const POLLS: usize = 1_000;

/// A `runfeed serve` child on a random port; returns it with its `host:port` and admin
/// `host:port`.
async fn spawn_server(
    db_url: &str,
    extra_env: &[(&str, &str)],
) -> anyhow::Result<(Child, String, String)> {
    let admin = format!("127.0.0.1:{}", free_port());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_runfeed"));
    cmd.args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--database-url", db_url, "--redis-url", &redis_url()])
        .env_remove("DATABASE_URL")
        .env_remove("DATABASE_READ_REPLICA_URL")
        .env_remove("REDIS_URL")
        .env("RUNFEED_TELEMETRY__ADMIN_LISTEN", &admin)
        // Holds longer than any step of these tests, yet under the limit start-up enforces for
        // `@electric-sql/client` 1.5's 45 s watchdog (31 s, no jitter, + backstop ≤ 40 s).
        .env("RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS", "31000")
        .env("RUNFEED_FEEDS__LIVE_POLL_JITTER_RATIO", "0")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().context("spawning runfeed serve")?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let addr = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await? {
            if let Some(url) = line.strip_prefix("runfeed listening on http://") {
                return Ok(url.trim().to_string());
            }
        }
        anyhow::bail!("runfeed serve exited before listening")
    })
    .await
    .context("runfeed serve did not start within 30 s")??;
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, addr, admin))
}

/// One raw HTTP/1.1 exchange read to EOF: `Ok((status line, whole response text))`, or the I/O
/// error (a reset shows up here).
async fn raw_get(addr: &str, target: &str, api_key: &str) -> std::io::Result<(String, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    let head = format!(
        "GET {target} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {api_key}\r\n\
         x-trigger-electric-version: 1.0.0-beta.1\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await?;
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text.lines().next().unwrap_or_default().to_string();
    Ok((status, text))
}

/// The `runfeed_router_held_feeds{kind="run"}` gauge from the admin listener.
async fn held_run_feeds(http: &reqwest::Client, admin: &str) -> anyhow::Result<u64> {
    let text = http
        .get(format!("http://{admin}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("runfeed_router_held_feeds") && l.contains("kind=\"run\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum())
}

/// Takes a run feed's snapshot; returns its `(electric-handle, electric-offset)`.
async fn snapshot_position(
    http: &reqwest::Client,
    addr: &str,
    run_friendly_id: &str,
    api_key: &str,
) -> anyhow::Result<(String, String)> {
    let snapshot = http
        .get(format!("http://{addr}/realtime/v1/runs/{run_friendly_id}"))
        .bearer_auth(api_key)
        .header("x-trigger-electric-version", "1.0.0-beta.1")
        .send()
        .await?;
    anyhow::ensure!(snapshot.status() == 200, "snapshot: {}", snapshot.status());
    let header = |name: &str| -> anyhow::Result<String> {
        Ok(snapshot
            .headers()
            .get(name)
            .with_context(|| format!("snapshot without {name}"))?
            .to_str()?
            .to_string())
    };
    Ok((header("electric-handle")?, header("electric-offset")?))
}

/// A `runfeed serve` child (with `extra_env`) on `db` serving one run of a new environment,
/// and the target of a live poll at the run feed's snapshot: `(child, addr, admin, env, run,
/// target)`.
async fn serve_one_run(
    db: &TestDb,
    extra_env: &[(&str, &str)],
) -> anyhow::Result<(Child, String, String, DemoEnv, CreatedRun, String)> {
    let env = fixtures::create_env(&db.pool, "DEVELOPMENT").await?;
    let run = fixtures::create_run(&db.pool, &env, fixtures::RunSpec::default()).await?;
    let (child, addr, admin) = spawn_server(&db.url, extra_env).await?;
    let http = reqwest::Client::new();
    let (handle, offset) = snapshot_position(&http, &addr, &run.friendly_id, &env.api_key).await?;
    let target = format!(
        "/realtime/v1/runs/{}?live=true&handle={handle}&offset={offset}",
        run.friendly_id
    );
    Ok((child, addr, admin, env, run, target))
}

/// Waits (≤ 60 s) until exactly `n` run feeds are held.
async fn wait_held(http: &reqwest::Client, admin: &str, n: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let held = held_run_feeds(http, admin).await?;
        if held == n {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{held} of {n} polls held after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn sigterm(child: &Child) -> anyhow::Result<()> {
    let pid = child.id().context("child already reaped")?;
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await?;
    anyhow::ensure!(status.success(), "kill -TERM {pid} failed");
    Ok(())
}

/// Scenario: SIGTERM with 1 000 held live polls → 1 000 × `200 up-to-date`, no reset, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_1000_held_polls_with_up_to_date_and_exits() -> anyhow::Result<()> {
    // 1 000 client sockets here and 1 000 in the child (which inherits the limit).
    // Process-wide, but it only ever raises the soft limit (to the hard one): the tests running
    // beside this one in the same binary can only gain from it.
    rlimit::increase_nofile_limit(u64::MAX).context("raising RLIMIT_NOFILE")?;
    with_test_db(async |db| {
        let (mut child, addr, admin, env, _, target) = serve_one_run(db, &[]).await?;
        let http = reqwest::Client::new();
        let polls: Vec<_> = (0..POLLS)
            .map(|_| {
                let (addr, target, key) = (addr.clone(), target.clone(), env.api_key.clone());
                tokio::spawn(async move { raw_get(&addr, &target, &key).await })
            })
            .collect();
        wait_held(&http, &admin, POLLS as u64).await?;
        let t = Instant::now();
        sigterm(&child).await?;
        let exit = tokio::time::timeout(Duration::from_secs(15), child.wait())
            .await
            .context("runfeed did not exit within 15 s of SIGTERM")??;
        let exited_after = t.elapsed();
        let (mut ok, mut failures) = (0usize, Vec::new());
        for poll in polls {
            match tokio::time::timeout(Duration::from_secs(15), poll).await {
                Ok(Ok(Ok((status, text)))) => {
                    if status.starts_with("HTTP/1.1 200")
                        && text.contains(r#"{"headers":{"control":"up-to-date"}}"#)
                    {
                        ok += 1;
                    } else {
                        failures.push(format!("unexpected response: {text:?}"));
                    }
                }
                Ok(Ok(Err(err))) => failures.push(format!("I/O error (reset?): {err}")),
                Ok(Err(join)) => failures.push(format!("join: {join}")),
                Err(_) => failures.push("no answer within 15 s".into()),
            }
        }
        assert!(
            failures.is_empty(),
            "{ok} of {POLLS} polls answered 200 up-to-date; first failures: {:?}",
            &failures[..failures.len().min(5)]
        );
        assert!(exit.success(), "runfeed exited with {exit}");
        assert!(
            exited_after < Duration::from_secs(10),
            "exit took {exited_after:?}"
        );
        println!("SIGTERM: {POLLS} held polls answered, exit after {exited_after:?}");
        Ok(())
    })
    .await
}

/// Slowloris: a client that sends half a request head and stalls is disconnected after the
/// header-read timeout; a held live poll on the same server outlives that timeout and is
/// still answered (by a change).
#[tokio::test]
async fn a_stalled_request_head_is_cut_off_but_a_held_poll_is_not() -> anyhow::Result<()> {
    with_test_db(async |db| {
        let header_timeout = [("RUNFEED_SERVER__HEADER_READ_TIMEOUT_MS", "1000")];
        let (child, addr, admin, env, run, target) = serve_one_run(db, &header_timeout).await?;
        // Half a head, then silence.
        let mut slow = TcpStream::connect(&addr).await?;
        slow.write_all(b"GET /realtime/v1/runs/x HTTP/1.1\r\nHost: a\r\nX-Slow: ")
            .await?;
        // An idle connection that never sends a byte.
        let mut idle = TcpStream::connect(&addr).await?;
        let http = reqwest::Client::new();
        let key = env.api_key.clone();
        let poll_addr = addr.clone();
        let poll = tokio::spawn(async move { raw_get(&poll_addr, &target, &key).await });
        let started = Instant::now();
        let mut sink = Vec::new();
        // Cut off = the server closes the connection (EOF or reset), without a response.
        let _ = tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut sink))
            .await
            .context("the stalled head was not cut off within 10 s")?;
        let _ = tokio::time::timeout(Duration::from_secs(10), idle.read_to_end(&mut sink))
            .await
            .context("the idle connection was not cut off within 10 s")?;
        let cut_after = started.elapsed();
        assert!(
            sink.is_empty(),
            "a stalled head got a response: {:?}",
            String::from_utf8_lossy(&sink)
        );
        // The held poll is still waiting well past the header timeout; a change answers it.
        assert!(
            !poll.is_finished(),
            "the held poll ended with the slow ones"
        );
        wait_held(&http, &admin, 1).await?;
        let executing = fixtures::RunUpdate {
            status: Some("EXECUTING".into()),
            ..Default::default()
        };
        fixtures::update_run(&db.pool, &run.id, executing).await?;
        let publisher = Publisher::connect(&RedisOptions::standalone(redis_url())).await?;
        publisher
            .publish(&TestServer::partial_record(&env, &run.id))
            .await?;
        let (status, text) = tokio::time::timeout(Duration::from_secs(15), poll)
            .await
            .context("the held poll got no change")???;
        assert!(status.starts_with("HTTP/1.1 200"), "{text}");
        assert!(text.contains("EXECUTING"), "{text}");
        println!("slowloris: stalled and idle connections closed after {cut_after:?}");
        drop(child);
        Ok(())
    })
    .await
}
