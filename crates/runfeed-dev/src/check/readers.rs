//! The readers: reader slots that subscribe and unsubscribe at random to run, tag
//! (contains-all, `createdAt` windows) and batch feeds of both environments, speak the real
//! protocol — mostly through the Rust [`Follower`], a fraction through the real npm clients
//! (`tests/e2e/check-reader.mjs`) — hop between instances, drop responses the server already
//! sent, abort held polls, pause between polls, and log everything as [`SubLog`]s.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::watch;

use super::io::mint_token;
use super::model::{ClientKind, Clock, Event, FeedSpec, History, Ms, RowObs, SubLog};
use super::world::TAG_POOL;
use crate::client::{Applied, ClientError, FeedUrl, Follower, RequestKind};
use crate::fixtures::DemoEnv;

/// How readers behave.
#[derive(Clone, Debug)]
pub struct ReaderConfig {
    /// Reader slots (each runs one subscription at a time).
    pub readers: usize,
    /// Share of slots that use the npm clients.
    pub npm_fraction: f64,
    /// Per request: go to another instance.
    pub hop: f64,
    /// Per 200 response: drop it after reading it completely (a lost response).
    pub drop: f64,
    /// Per live poll: abort it while held.
    pub abort: f64,
    /// Per response: pause before the next poll (0.2–2.5 s).
    pub pause: f64,
    /// Per subscription: one request with another feed's handle (must be a 409).
    pub foreign: f64,
    /// Subscription lifetime, seconds (uniform).
    pub lifetime_s: (f64, f64),
    /// The server's live hold, ms (bounds request timeouts and aborts).
    pub hold_ms: u64,
}

/// What every reader shares.
pub struct Readers {
    pub clock: Clock,
    pub history: Arc<Mutex<History>>,
    pub envs: Vec<DemoEnv>,
    pub bases: Vec<String>,
    pub cfg: ReaderConfig,
    /// Subscriptions started after this are not started (churn ends).
    pub churn_until: Ms,
    /// Set when the check ends.
    pub stop: watch::Receiver<bool>,
    /// The repository root (for the node reader script).
    pub repo: PathBuf,
    pub http: reqwest::Client,
    subs: Mutex<Vec<SubLog>>,
    next_sub: AtomicUsize,
    /// Recently issued handles by feed key, for foreign-handle probes.
    handles: Mutex<VecDeque<(String, String)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A chosen subscription.
struct Choice {
    feed: FeedSpec,
    url: FeedUrl,
    token: String,
    /// kind:env:target:columns — equal keys accept each other's handles.
    key: String,
    /// `--feed` argument of the node reader.
    node_feed: String,
    skip: Option<String>,
}

impl Readers {
    /// Readers over the given instances.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        clock: Clock,
        history: Arc<Mutex<History>>,
        envs: Vec<DemoEnv>,
        bases: Vec<String>,
        cfg: ReaderConfig,
        churn_until: Ms,
        stop: watch::Receiver<bool>,
        repo: PathBuf,
    ) -> anyhow::Result<Readers> {
        Ok(Readers {
            clock,
            history,
            envs,
            bases,
            cfg,
            churn_until,
            stop,
            repo,
            http: reqwest::Client::builder()
                .no_proxy()
                .pool_max_idle_per_host(64)
                .build()?,
            subs: Mutex::new(Vec::new()),
            next_sub: AtomicUsize::new(1),
            handles: Mutex::new(VecDeque::new()),
        })
    }

    /// Runs every slot until the stop signal; returns every subscription's log.
    pub async fn run(self: Arc<Self>, seed: u64) -> Vec<SubLog> {
        let npm = (self.cfg.readers as f64 * self.cfg.npm_fraction).round() as usize;
        let mut tasks = Vec::new();
        for slot in 0..self.cfg.readers {
            let me = self.clone();
            let is_npm = slot < npm;
            tasks.push(tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(seed ^ (0x4ead_0000 + slot as u64));
                // Stagger the start.
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..500))).await;
                loop {
                    if *me.stop.borrow() {
                        break;
                    }
                    let log = if is_npm {
                        me.npm_sub(&mut rng, slot).await
                    } else {
                        me.rust_sub(&mut rng, slot).await
                    };
                    let ended = log.ended.is_none();
                    lock(&me.subs).push(log);
                    if ended {
                        break;
                    }
                }
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
        let mut subs = std::mem::take(&mut *lock(&self.subs));
        subs.sort_by_key(|s| s.id);
        subs
    }

    fn choose(&self, rng: &mut StdRng) -> Choice {
        let h = lock(&self.history);
        let env = if rng.random_bool(0.85) { 0 } else { 1 };
        let demo = &self.envs[env];
        let skip = rng.random_bool(0.2).then(|| "payload,output".to_string());
        let roll: f64 = rng.random();
        let (feed, url, scope, key, node_feed) = if roll < 0.4 {
            let runs: Vec<usize> = (0..h.runs.len())
                .filter(|i| h.runs[*i].env == env)
                .collect();
            let run = runs[rng.random_range(0..runs.len())];
            let fid = h.runs[run].friendly_id.clone();
            (
                FeedSpec::Run { run },
                FeedUrl::run(&fid),
                format!("read:runs:{fid}"),
                format!("run:{env}:{run}"),
                format!("run:{fid}"),
            )
        } else if roll < 0.8 {
            let n = rng.random_range(1..=2);
            let mut tags: Vec<String> = Vec::new();
            while tags.len() < n {
                let t = TAG_POOL[rng.random_range(0..TAG_POOL.len())].to_string();
                if !tags.contains(&t) {
                    tags.push(t);
                }
            }
            let (created_at, window_ms) = match rng.random_range(0..10) {
                0..=4 => (None, None),
                5..=7 => (Some("1h".to_string()), Some(3_600_000)),
                _ => (Some("10m".to_string()), Some(600_000)),
            };
            let mut sorted = tags.clone();
            sorted.sort();
            let scope = format!("read:tags:{}", tags[0]);
            let node_feed = format!(
                "tag:{}{}",
                tags.join(","),
                created_at
                    .as_ref()
                    .map(|c| format!("|{c}"))
                    .unwrap_or_default()
            );
            (
                FeedSpec::Tag {
                    env,
                    tags: tags.clone(),
                    created_at: created_at.clone(),
                    window_ms,
                },
                FeedUrl::tags(&tags, created_at.as_deref()),
                scope,
                format!("tag:{env}:{}", sorted.join(",")),
                node_feed,
            )
        } else {
            let batches: Vec<usize> = (0..h.batches.len())
                .filter(|i| h.batches[*i].env == env)
                .collect();
            let batch = batches[rng.random_range(0..batches.len())];
            let fid = h.batches[batch].friendly_id.clone();
            (
                FeedSpec::Batch { batch },
                FeedUrl::batch(&fid),
                format!("read:batch:{fid}"),
                format!("batch:{env}:{batch}"),
                format!("batch:{fid}"),
            )
        };
        let url = match &skip {
            Some(cols) => url.skip_columns(&cols.split(',').collect::<Vec<_>>()),
            None => url,
        };
        let token = if rng.random_bool(0.7) {
            demo.api_key.clone()
        } else {
            mint_token(
                &demo.api_key,
                &demo.env_id,
                &[scope],
                Duration::from_secs(3600),
            )
            .unwrap_or_else(|_| demo.api_key.clone())
        };
        Choice {
            feed,
            url,
            token,
            key: format!("{key}:{}", skip.clone().unwrap_or_default()),
            node_feed,
            skip,
        }
    }

    fn new_log(&self, slot: usize, client: ClientKind, c: &Choice) -> SubLog {
        SubLog {
            id: self.next_sub.fetch_add(1, Ordering::Relaxed),
            reader: format!(
                "{}{slot}",
                if client == ClientKind::Rust { "r" } else { "n" }
            ),
            client,
            feed: c.feed.clone(),
            url: c.url.render(&[]),
            started: self.clock.now(),
            ended: None,
            events: Vec::new(),
        }
    }

    fn remember_handle(&self, key: &str, handle: &str) {
        let mut hs = lock(&self.handles);
        if hs.iter().any(|(_, h)| h == handle) {
            return;
        }
        hs.push_back((key.to_string(), handle.to_string()));
        while hs.len() > 256 {
            hs.pop_front();
        }
    }

    fn foreign_handle(&self, rng: &mut StdRng, key: &str) -> Option<String> {
        let hs = lock(&self.handles);
        let others: Vec<&String> = hs
            .iter()
            .filter(|(k, _)| k != key)
            .map(|(_, h)| h)
            .collect();
        (!others.is_empty()).then(|| others[rng.random_range(0..others.len())].clone())
    }

    fn churning(&self) -> bool {
        self.clock.now() < self.churn_until
    }

    /// One subscription through the Rust follower.
    async fn rust_sub(&self, rng: &mut StdRng, slot: usize) -> SubLog {
        let c = self.choose(rng);
        let mut log = self.new_log(slot, ClientKind::Rust, &c);
        let mut f = Follower::new(c.url.clone(), &c.token);
        let lifetime = rng.random_range(self.cfg.lifetime_s.0..self.cfg.lifetime_s.1) * 1000.0;
        let until = log.started + lifetime;
        let n = self.bases.len();
        let mut instance = rng.random_range(0..n);
        let mut req_id = 0u32;
        let mut backoff = Duration::from_millis(100);
        let mut catch_up = false;
        let mut probed = false;
        let mut stop = self.stop.clone();
        let limit = Duration::from_millis(self.cfg.hold_ms * 13 / 10 + 10_000);
        loop {
            if *stop.borrow() {
                break;
            }
            let churn = self.churning();
            if churn && self.clock.now() > until {
                log.ended = Some(self.clock.now());
                break;
            }
            if churn && n > 1 && rng.random_bool(self.cfg.hop) {
                instance = rng.random_range(0..n);
            }
            if churn && !probed && f.up_to_date && rng.random_bool(self.cfg.foreign) {
                probed = true;
                if let Some(foreign) = self.foreign_handle(rng, &c.key) {
                    let mut g = f.clone();
                    g.handle = Some(foreign);
                    let req = g.request(false);
                    req_id += 1;
                    log.events.push(Event::Request {
                        id: req_id,
                        at: self.clock.now(),
                        instance,
                        kind: req.kind,
                        offset: req.offset.clone(),
                        foreign: true,
                    });
                    let sent = tokio::select! {
                        r = g.send(&self.http, &self.bases[instance], &req, limit) => Some(r),
                        _ = stop.changed() => None,
                    };
                    match sent {
                        Some(Ok(resp)) => log.events.push(Event::Response {
                            req: req_id,
                            at: self.clock.now(),
                            status: resp.status,
                            offset: resp.offset.clone(),
                            rows: resp
                                .changes()
                                .iter()
                                .map(|ch| RowObs::from_wire(&ch.operation, &ch.value))
                                .collect(),
                            dropped: true,
                        }),
                        Some(Err(e)) => log.events.push(Event::Failed {
                            req: req_id,
                            at: self.clock.now(),
                            error: e.to_string(),
                            aborted: false,
                        }),
                        None => break,
                    }
                }
            }
            let req = f.request(catch_up);
            catch_up = false;
            req_id += 1;
            log.events.push(Event::Request {
                id: req_id,
                at: self.clock.now(),
                instance,
                kind: req.kind,
                offset: req.offset.clone(),
                foreign: false,
            });
            let abort_after =
                (churn && req.kind == RequestKind::Live && rng.random_bool(self.cfg.abort))
                    .then(|| Duration::from_millis(rng.random_range(20..self.cfg.hold_ms.max(40))));
            enum Outcome {
                Done(Result<crate::client::Response, ClientError>),
                Aborted,
                Stopped,
            }
            let outcome = tokio::select! {
                r = f.send(&self.http, &self.bases[instance], &req, limit) => Outcome::Done(r),
                _ = sleep_opt(abort_after) => Outcome::Aborted,
                _ = stop.changed() => Outcome::Stopped,
            };
            match outcome {
                Outcome::Stopped => {
                    log.events.push(Event::Failed {
                        req: req_id,
                        at: self.clock.now(),
                        error: "check ended".into(),
                        aborted: true,
                    });
                    break;
                }
                Outcome::Aborted => {
                    log.events.push(Event::Failed {
                        req: req_id,
                        at: self.clock.now(),
                        error: "aborted by the reader".into(),
                        aborted: true,
                    });
                }
                Outcome::Done(Err(e)) => {
                    log.events.push(Event::Failed {
                        req: req_id,
                        at: self.clock.now(),
                        error: e.to_string(),
                        aborted: false,
                    });
                    // Like a load balancer taking a dead instance out: try another.
                    if n > 1 {
                        instance = (instance + 1 + rng.random_range(0..n - 1)) % n;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff.mul_f64(1.3)).min(Duration::from_secs(2));
                }
                Outcome::Done(Ok(resp)) => {
                    let at = self.clock.now();
                    let drop = churn && resp.status == 200 && rng.random_bool(self.cfg.drop);
                    let rows: Vec<RowObs> = if drop {
                        resp.changes()
                            .iter()
                            .map(|ch| RowObs::from_wire(&ch.operation, &ch.value))
                            .collect()
                    } else {
                        match f.apply(&req, &resp) {
                            Applied::Changes(changes) => changes
                                .iter()
                                .map(|ch| match f.view.get(&ch.key) {
                                    Some(row) => RowObs::from_wire(&ch.operation, row),
                                    None => RowObs::from_wire(&ch.operation, &ch.value),
                                })
                                .collect(),
                            _ => Vec::new(),
                        }
                    };
                    log.events.push(Event::Response {
                        req: req_id,
                        at,
                        status: resp.status,
                        offset: resp.offset.clone(),
                        rows,
                        dropped: drop,
                    });
                    if resp.status == 409 && !drop {
                        log.events.push(Event::Reset { at });
                    }
                    if let Some(h) = &resp.handle {
                        if (200..300).contains(&resp.status) {
                            self.remember_handle(&c.key, h);
                        }
                    }
                    if resp.status >= 500 || resp.status == 429 {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff.mul_f64(1.3)).min(Duration::from_secs(2));
                    } else if (400..500).contains(&resp.status) && resp.status != 409 {
                        // Fatal for the real client (`docs/protocol.md` §5.1): give up.
                        log.ended = Some(at);
                        break;
                    } else {
                        backoff = Duration::from_millis(100);
                    }
                }
            }
            if self.churning() && rng.random_bool(self.cfg.pause) {
                let from = self.clock.now();
                let d = Duration::from_millis(rng.random_range(200..2_500));
                tokio::select! {
                    _ = tokio::time::sleep(d) => {}
                    _ = stop.changed() => {}
                }
                log.events.push(Event::Paused {
                    from,
                    to: self.clock.now(),
                });
                catch_up = rng.random_bool(0.5);
            }
        }
        log
    }

    /// One subscription through the real npm clients (a node process).
    async fn npm_sub(&self, rng: &mut StdRng, slot: usize) -> SubLog {
        let c = self.choose(rng);
        let sdk = rng.random_bool(0.4);
        let client = if sdk {
            ClientKind::NpmSdk
        } else {
            ClientKind::NpmShape
        };
        let mut log = self.new_log(slot, client, &c);
        let lifetime =
            rng.random_range(self.cfg.lifetime_s.0..self.cfg.lifetime_s.1) * 1000.0 + 3_000.0; // node's start-up
        let until = log.started + lifetime;
        let script = self.repo.join("tests/e2e/check-reader.mjs");
        let mut cmd = Command::new("node");
        cmd.arg(&script)
            .arg("--bases")
            .arg(self.bases.join(","))
            .arg("--token")
            .arg(&c.token)
            .arg("--feed")
            .arg(&c.node_feed)
            .arg("--mode")
            .arg(if sdk { "sdk" } else { "shape" })
            .arg("--hop")
            .arg(self.cfg.hop.to_string())
            .arg("--seed")
            .arg(rng.random::<u32>().to_string());
        if let Some(skip) = &c.skip {
            cmd.arg("--skip-columns").arg(skip);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                eprintln!("check: cannot start node ({e}); npm reader {slot} idles");
                log.ended = Some(self.clock.now());
                let mut stop = self.stop.clone();
                let _ = tokio::time::timeout(Duration::from_secs(5), stop.changed()).await;
                return log;
            }
        };
        let Some(stdout) = child.stdout.take() else {
            log.ended = Some(self.clock.now());
            return log;
        };
        let mut lines = BufReader::new(stdout).lines();
        let mut stop = self.stop.clone();
        loop {
            let remaining = if self.churning() {
                Duration::from_millis((until - self.clock.now()).max(0.0) as u64)
            } else {
                Duration::from_secs(3600)
            };
            tokio::select! {
                line = lines.next_line() => match line {
                    Ok(Some(line)) => {
                        if let Some(event) = self.node_event(&line) {
                            log.events.push(event);
                        } else if line.contains("\"k\":\"error\"") {
                            eprintln!("check: npm reader {slot} ({}): {line}", c.node_feed);
                            log.ended = Some(self.clock.now());
                            break;
                        }
                    }
                    _ => {
                        log.ended = Some(self.clock.now());
                        break;
                    }
                },
                _ = tokio::time::sleep(remaining) => {
                    if self.churning() {
                        log.ended = Some(self.clock.now());
                        break;
                    }
                }
                _ = stop.changed() => break,
            }
        }
        let _ = child.kill().await;
        log
    }

    /// One line of the node reader as an event.
    fn node_event(&self, line: &str) -> Option<Event> {
        let v: Value = serde_json::from_str(line).ok()?;
        let at = self.clock.from_epoch_ms(v.get("t")?.as_f64()?);
        let id = v
            .get("id")
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok());
        match v.get("k")?.as_str()? {
            "req" => {
                let offset = v
                    .get("offset")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                let live = v.get("live").and_then(Value::as_bool).unwrap_or(false);
                Some(Event::Request {
                    id: id?,
                    at,
                    instance: v.get("inst").and_then(Value::as_u64).unwrap_or(0) as usize,
                    kind: if offset == "-1" {
                        RequestKind::Snapshot
                    } else if live {
                        RequestKind::Live
                    } else {
                        RequestKind::CatchUp
                    },
                    offset,
                    foreign: false,
                })
            }
            "resp" => Some(Event::Response {
                req: id?,
                at,
                status: u16::try_from(v.get("status")?.as_u64()?).ok()?,
                offset: v.get("offset").and_then(Value::as_str).map(str::to_string),
                rows: Vec::new(),
                dropped: false,
            }),
            "fail" => Some(Event::Failed {
                req: id?,
                at,
                error: v
                    .get("error")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                aborted: v.get("aborted").and_then(Value::as_bool).unwrap_or(false),
            }),
            "reset" => Some(Event::Reset { at }),
            "rows" => {
                let sdk = v.get("sdk").and_then(Value::as_bool).unwrap_or(false);
                let h = lock(&self.history);
                let rows = v
                    .get("rows")?
                    .as_array()?
                    .iter()
                    .map(|r| {
                        let raw_id = r.get("id").and_then(Value::as_str).unwrap_or("");
                        // The SDK's run id is the friendly id.
                        let run_id = if sdk {
                            h.by_friendly_id
                                .get(raw_id)
                                .map(|i| h.runs[*i].id.clone())
                                .unwrap_or_else(|| raw_id.to_string())
                        } else {
                            raw_id.to_string()
                        };
                        RowObs {
                            run_id,
                            op: r
                                .get("op")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_string(),
                            updated_at_ms: r.get("u").and_then(Value::as_f64).map(|x| x as i64),
                            ck: r
                                .get("ck")
                                .and_then(Value::as_u64)
                                .and_then(|n| u32::try_from(n).ok()),
                            status: r.get("status").and_then(Value::as_str).map(str::to_string),
                        }
                    })
                    .collect();
                Some(Event::Rows {
                    at,
                    rows,
                    snapshot_of: v
                        .get("snap")
                        .and_then(Value::as_u64)
                        .and_then(|n| u32::try_from(n).ok()),
                    complete: v.get("complete").and_then(Value::as_bool).unwrap_or(false),
                })
            }
            _ => None,
        }
    }
}

async fn sleep_opt(d: Option<Duration>) {
    match d {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}
