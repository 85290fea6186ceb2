//! The workload every fault runs under: `feeds` long-poll followers over `runs` run feeds of one
//! environment, and a writer committing `rate` changes/s (each change writes `metadata =
//! {"n": <counter>}` and publishes its change record, as trigger.dev does). Followers keep the
//! highest `n` they saw per feed, so "0 lost updates" is checked as every follower converging to
//! the last committed `n` of its run; publish → delivery latency is recorded per delivery.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use runfeed::auth::mint_public_token;
use runfeed::changes::ChangeRecord;
use runfeed::redis::{Publisher, RedisOptions};
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::time::Instant;

use super::Target;
use crate::fixtures::{self, DemoEnv, RunSpec, RunUpdate};

/// The workload's size (flattened into each scenario's arguments).
#[derive(clap::Args, Clone, Debug)]
pub struct LoadArgs {
    /// Live feeds (long-poll followers).
    #[arg(long, default_value_t = 1_000)]
    pub feeds: usize,
    /// Runs they follow.
    #[arg(long, default_value_t = 100)]
    pub runs: usize,
    /// Changes per second.
    #[arg(long, default_value_t = 200)]
    pub rate: u32,
}

/// `x-trigger-electric-version` the followers send.
const ELECTRIC_VERSION: &str = "1.0.0-beta.1";

/// What a follower's last response left it at.
#[derive(Clone, Debug, Default)]
pub struct Position {
    pub handle: String,
    pub offset: String,
    pub cursor: String,
}

/// Counters of what the followers met.
#[derive(Default, Debug)]
pub struct Outcomes {
    /// Responses with a 5xx status.
    pub server_errors: AtomicU64,
    /// Requests that failed without a response (refused, reset, timed out).
    pub transport_errors: AtomicU64,
    /// 409 must-refetch (followed by a new snapshot).
    pub refetches: AtomicU64,
    /// Live polls answered 200.
    pub live_ok: AtomicU64,
    /// The longest time a 5xx took to arrive, ms.
    pub slowest_5xx_ms: AtomicU64,
    /// 5xx responses that had no `Retry-After` or no JSON `error`.
    pub bare_5xx: AtomicU64,
}

/// A running workload.
pub struct Load {
    pub pool: PgPool,
    pub env: DemoEnv,
    /// `(internal id, friendly id)` per run.
    pub runs: Vec<(String, String)>,
    base: String,
    publisher: Publisher,
    clients: Vec<reqwest::Client>,
    /// Last committed `n` per run.
    latest: Vec<AtomicU64>,
    /// Highest `n` seen per follower (follower `i` follows run `i % runs`).
    seen: Vec<AtomicU64>,
    /// Publish time of `(run, n)`.
    published: Mutex<HashMap<(usize, u64), Instant>>,
    latencies: Mutex<Vec<f64>>,
    pub outcomes: Outcomes,
    /// Publishes that failed (the update is committed; only a backstop can deliver it).
    pub publish_errors: AtomicU64,
    stop_followers: AtomicBool,
    stop_writer: AtomicBool,
    /// Followers whose current request is a live poll that reached the server.
    pub live_now: AtomicU64,
}

impl Load {
    /// Creates one environment with `runs` runs and starts `feeds` followers (snapshot, then
    /// live polls); returns once every follower had its snapshot.
    pub async fn start(t: &Target, feeds: usize, runs: usize) -> anyhow::Result<Arc<Load>> {
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(&t.database_url)
            .await
            .context("connect to --database-url")?;
        let options = if t.redis_url.starts_with("redis-cluster://") {
            RedisOptions::cluster(&t.redis_url, true)
        } else {
            RedisOptions::standalone(&t.redis_url)
        };
        let publisher = Publisher::connect(&options)
            .await
            .map_err(|e| anyhow::anyhow!("connect to --redis-url: {e}"))?;
        let env = fixtures::create_env(&pool, "DEVELOPMENT").await?;
        let mut created = Vec::new();
        for _ in 0..runs.max(1) {
            let run = fixtures::create_run(&pool, &env, RunSpec::default()).await?;
            created.push((run.id, run.friendly_id));
        }
        let clients = (0..8)
            .map(|_| {
                reqwest::Client::builder()
                    .no_proxy()
                    .pool_max_idle_per_host(100_000)
                    .timeout(Duration::from_secs(60))
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let load = Arc::new(Load {
            pool,
            latest: (0..created.len()).map(|_| AtomicU64::new(0)).collect(),
            seen: (0..feeds).map(|_| AtomicU64::new(0)).collect(),
            runs: created,
            env,
            base: t.base_url.trim_end_matches('/').to_string(),
            publisher,
            clients,
            published: Mutex::default(),
            latencies: Mutex::default(),
            outcomes: Outcomes::default(),
            publish_errors: AtomicU64::new(0),
            stop_followers: AtomicBool::new(false),
            stop_writer: AtomicBool::new(false),
            live_now: AtomicU64::new(0),
        });
        let (ready_tx, mut ready_rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..feeds {
            let (load, ready) = (load.clone(), ready_tx.clone());
            tokio::spawn(async move { load.follow(i, ready).await });
        }
        drop(ready_tx);
        let mut ready = 0;
        let deadline = Instant::now() + Duration::from_secs(120);
        while ready < feeds {
            match tokio::time::timeout_at(deadline, ready_rx.recv()).await {
                Ok(Some(())) => ready += 1,
                _ => anyhow::bail!("only {ready} of {feeds} followers got their snapshot"),
            }
        }
        Ok(load)
    }

    fn token(&self, run: usize) -> String {
        mint_public_token(
            &self.env.api_key,
            &self.env.env_id,
            &[format!("read:runs:{}", self.runs[run].1)],
            Duration::from_secs(3600),
            None,
        )
        .expect("mint token")
    }

    /// One request of follower `i`; `Ok(None)` = a transport error (counted).
    async fn get(
        &self,
        i: usize,
        token: &str,
        run: usize,
        at: Option<&Position>,
    ) -> Option<(u16, Position, Value)> {
        let client = &self.clients[i % self.clients.len()];
        let mut params: Vec<(&str, String)> = vec![("log", "full".into())];
        match at {
            None => params.push(("offset", "-1".into())),
            Some(p) => params.extend([
                ("cursor", p.cursor.clone()),
                ("handle", p.handle.clone()),
                ("live", "true".into()),
                ("offset", p.offset.clone()),
            ]),
        }
        let started = Instant::now();
        let sent = client
            .get(format!(
                "{}/realtime/v1/runs/{}",
                self.base, self.runs[run].1
            ))
            .query(&params)
            .header("authorization", format!("Bearer {token}"))
            .header("x-trigger-electric-version", ELECTRIC_VERSION)
            .send()
            .await;
        let resp = match sent {
            Ok(resp) => resp,
            Err(_) => {
                self.outcomes
                    .transport_errors
                    .fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        let status = resp.status().as_u16();
        let retry_after = resp.headers().contains_key("retry-after");
        let h = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        let pos = Position {
            handle: h("electric-handle"),
            offset: h("electric-offset"),
            cursor: h("electric-cursor"),
        };
        let body = match resp.text().await {
            Ok(text) => serde_json::from_str(&text).unwrap_or(Value::Null),
            Err(_) => {
                self.outcomes
                    .transport_errors
                    .fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        if status >= 500 {
            self.outcomes.server_errors.fetch_add(1, Ordering::Relaxed);
            let took = started.elapsed().as_millis() as u64;
            self.outcomes
                .slowest_5xx_ms
                .fetch_max(took, Ordering::Relaxed);
            if !retry_after || !body["error"].is_string() {
                self.outcomes.bare_5xx.fetch_add(1, Ordering::Relaxed);
            }
        }
        Some((status, pos, body))
    }

    /// Records the `n`s of `body`'s change messages for follower `i` (run `run`).
    fn saw(&self, i: usize, run: usize, body: &Value) {
        let Some(messages) = body.as_array() else {
            return;
        };
        for m in messages {
            let Some(meta) = m["value"]["metadata"].as_str() else {
                continue;
            };
            let Some(n) = serde_json::from_str::<Value>(meta)
                .ok()
                .and_then(|v| v["n"].as_u64())
            else {
                continue;
            };
            let before = self.seen[i].fetch_max(n, Ordering::Relaxed);
            if n > before {
                if let Some(at) = self.lock_published().get(&(run, n)) {
                    let took = at.elapsed().as_secs_f64() * 1000.0;
                    self.latencies
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(took);
                }
            }
        }
    }

    fn lock_published(&self) -> std::sync::MutexGuard<'_, HashMap<(usize, u64), Instant>> {
        self.published
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Follower `i`: snapshot, then live polls until stopped; 5xx and transport errors are
    /// retried with the Electric client's backoff (100 ms × 1.3, capped at 10 s).
    async fn follow(self: Arc<Self>, i: usize, ready: tokio::sync::mpsc::UnboundedSender<()>) {
        let run = i % self.runs.len();
        let token = self.token(run);
        let mut at: Option<Position> = None;
        let mut backoff = Duration::from_millis(100);
        let mut announced = false;
        while !self.stop_followers.load(Ordering::Relaxed) {
            let live = at.is_some();
            if live {
                self.live_now.fetch_add(1, Ordering::Relaxed);
            }
            let got = self.get(i, &token, run, at.as_ref()).await;
            if live {
                self.live_now.fetch_sub(1, Ordering::Relaxed);
            }
            match got {
                Some((200, pos, body)) => {
                    backoff = Duration::from_millis(100);
                    self.saw(i, run, &body);
                    if live {
                        self.outcomes.live_ok.fetch_add(1, Ordering::Relaxed);
                    }
                    at = Some(pos);
                    if !announced {
                        announced = true;
                        let _ = ready.send(());
                    }
                }
                Some((409, _, _)) => {
                    self.outcomes.refetches.fetch_add(1, Ordering::Relaxed);
                    at = None;
                }
                _ => {
                    tokio::time::sleep(backoff).await;
                    backoff = backoff.mul_f64(1.3).min(Duration::from_secs(10));
                }
            }
        }
    }

    /// Starts the writer: `rate` changes/s round-robin over the runs until [`Load::stop_writer`].
    pub fn start_writer(self: &Arc<Self>, rate: u32) -> tokio::task::JoinHandle<u64> {
        let load = self.clone();
        tokio::spawn(async move {
            let mut tick =
                tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate.max(1))));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut written = 0u64;
            let mut r = 0usize;
            while !load.stop_writer.load(Ordering::Relaxed) {
                tick.tick().await;
                let run = r % load.runs.len();
                r += 1;
                if load.commit(run).await.is_ok() {
                    written += 1;
                }
            }
            written
        })
    }

    /// Stops the writer (the last committed versions stay as they are).
    pub fn stop_writer(&self) {
        self.stop_writer.store(true, Ordering::Relaxed);
    }

    /// Stops the followers (each ends after its request in progress).
    pub fn stop(&self) {
        self.stop_writer();
        self.stop_followers.store(true, Ordering::Relaxed);
    }

    /// Followers that have not yet seen the last committed `n` of their run.
    pub fn behind(&self) -> usize {
        (0..self.seen.len())
            .filter(|&i| {
                let run = i % self.runs.len();
                self.seen[i].load(Ordering::Relaxed) < self.latest[run].load(Ordering::Relaxed)
            })
            .count()
    }

    /// Waits until every follower converged (or `limit`); returns `(still behind, waited)`.
    pub async fn converge(&self, limit: Duration) -> (usize, Duration) {
        let started = Instant::now();
        loop {
            let behind = self.behind();
            if behind == 0 || started.elapsed() >= limit {
                return (behind, started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The delivery latencies recorded since the last call, sorted (ms).
    pub fn take_latencies(&self) -> Vec<f64> {
        let mut v = std::mem::take(
            &mut *self
                .latencies
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        v.sort_by(f64::total_cmp);
        v
    }

    /// Commits one change of run `run` now and publishes its change record from a task of its
    /// own (a paused or restarting Redis must not slow the writer; failed publishes are
    /// counted); returns its `n`.
    pub async fn commit(self: &Arc<Self>, run: usize) -> anyhow::Result<u64> {
        let n = self.latest[run].load(Ordering::Relaxed) + 1;
        let set = RunUpdate {
            metadata: Some(format!("{{\"n\":{n}}}")),
            ..RunUpdate::default()
        };
        let ms = fixtures::update_run(&self.pool, &self.runs[run].0, set).await?;
        self.latest[run].store(n, Ordering::Relaxed);
        self.lock_published().insert((run, n), Instant::now());
        let record = ChangeRecord {
            v: 1,
            run_id: self.runs[run].0.as_str().into(),
            env_id: self.env.env_id.as_str().into(),
            tags: Some(Vec::new()),
            batch_id: None,
            updated_at_ms: Some(ms),
        };
        let load = self.clone();
        tokio::spawn(async move {
            let published =
                tokio::time::timeout(Duration::from_secs(2), load.publisher.publish(&record)).await;
            if !matches!(published, Ok(Ok(_))) {
                load.publish_errors.fetch_add(1, Ordering::Relaxed);
            }
        });
        Ok(n)
    }

    /// Publishes `record` as trigger.dev does (bounded by 2 s); whether Redis took it. Failures
    /// are not counted here (the caller decides what a failed publish means).
    pub async fn publish(&self, record: &ChangeRecord) -> bool {
        let published =
            tokio::time::timeout(Duration::from_secs(2), self.publisher.publish(record)).await;
        matches!(published, Ok(Ok(_)))
    }

    /// One snapshot of run `i % runs` (a probe; its 5xx are counted); its status.
    pub async fn snapshot_probe(&self, i: usize) -> Option<u16> {
        let run = i % self.runs.len();
        let token = self.token(run);
        self.get(i, &token, run, None)
            .await
            .map(|(status, _, _)| status)
    }

    /// Whether every follower of `run` has seen `n`.
    pub fn all_saw(&self, run: usize, n: u64) -> bool {
        (run..self.seen.len())
            .step_by(self.runs.len())
            .all(|i| self.seen[i].load(Ordering::Relaxed) >= n)
    }
}
