//! The readers: reader slots that subscribe and unsubscribe at random to run, tag
//! (contains-all, `createdAt` windows) and batch feeds of both environments, speak the real
//! protocol — mostly through the Rust [`Follower`], a fraction through the real npm clients
//! (`tests/e2e/check-reader.mjs`) — hop between instances, drop responses the server already
//! sent, abort held polls, pause between polls, and log everything as [`SubLog`]s.

use std::collections::VecDeque;
use std::ops::ControlFlow;
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
use super::model::{ClientKind, Clock, Event, FeedSpec, History, Ms, RowObs, StreamEnd, SubLog};
use super::sse::{self, Opened};
use super::world::TAG_POOL;
use crate::client::{Applied, Change, ClientError, FeedUrl, Follower, Request, RequestKind};
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
    /// Share of slots that follow in SSE live mode (slow readers), after the npm slots.
    pub sse_fraction: f64,
    /// Per SSE stream: the reader stops reading it once, within its first 2 s.
    pub sse_stall: f64,
    /// How long a stall lasts, ms (uniform).
    pub sse_stall_ms: (u64, u64),
    /// The instances' `feeds.sse_stall_timeout_ms`: a stream that breaks after a stall at
    /// least this long was ended by the server's stall bound.
    pub stall_timeout_ms: u64,
    /// The bulk run (large versions), and the share of SSE subscriptions that follow it.
    pub bulk: Option<(usize, f64)>,
}

/// The error text of a request a reconnect storm aborted.
pub const STORM: &str = "reconnect storm";

/// What a reader does after a request or stream.
enum Flow {
    /// The next request of the subscription.
    Next,
    /// The subscription is over (its lifetime, a fatal status, or the check ended).
    Stop,
}

/// One Rust subscription in progress.
struct SubState {
    f: Follower,
    log: SubLog,
    /// The instance the next request goes to.
    instance: usize,
    req_id: u32,
    /// The wait after a failure (grows ×1.3 up to 2 s; reset by a success).
    backoff: Duration,
    stop: watch::Receiver<bool>,
    storm: watch::Receiver<usize>,
    /// The subscription ends after this (while the churn lasts).
    until: Ms,
    /// Bound of one request (and of opening a stream).
    limit: Duration,
}

impl SubState {
    /// Logs `req` as sent now to the current instance; returns its id.
    fn push_request(&mut self, at: Ms, req: &Request, foreign: bool) -> u32 {
        self.req_id += 1;
        self.log.events.push(Event::Request {
            id: self.req_id,
            at,
            instance: self.instance,
            kind: req.kind,
            offset: req.offset.clone(),
            foreign,
        });
        self.req_id
    }

    fn failed(&mut self, req: u32, at: Ms, error: &str, aborted: bool) {
        self.log.events.push(Event::Failed {
            req,
            at,
            error: error.to_string(),
            aborted,
        });
    }

    fn ended(&mut self, req: u32, at: Ms, how: StreamEnd) {
        self.log.events.push(Event::StreamEnded { req, at, how });
    }

    /// The rows of `changes` as the view holds them now.
    fn observe(&self, changes: &[Change]) -> Vec<RowObs> {
        changes
            .iter()
            .map(|ch| match self.f.view.get(&ch.key) {
                Some(row) => RowObs::from_wire(&ch.operation, row),
                None => RowObs::from_wire(&ch.operation, &ch.value),
            })
            .collect()
    }
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
    /// The instance of the last reconnect storm ([`Readers::storm`]).
    storm: watch::Sender<usize>,
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
            storm: watch::Sender::new(0),
        })
    }

    /// A reconnect storm on `instance`: every Rust reader with a request or stream open there
    /// drops it and reconnects to another instance within 1 s.
    pub fn storm(&self, instance: usize) {
        self.storm.send_replace(instance);
    }

    /// Runs every slot until the stop signal; returns every subscription's log.
    pub async fn run(self: Arc<Self>, seed: u64) -> Vec<SubLog> {
        let npm = (self.cfg.readers as f64 * self.cfg.npm_fraction).round() as usize;
        let sse = (self.cfg.readers as f64 * self.cfg.sse_fraction).round() as usize;
        let mut tasks = Vec::new();
        for slot in 0..self.cfg.readers {
            let me = self.clone();
            let is_npm = slot < npm;
            let is_sse = !is_npm && slot < npm + sse;
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
                        me.rust_sub(&mut rng, slot, is_sse).await
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

    /// A subscription for a slot; an SSE slot follows the bulk run at the configured share.
    fn choose(&self, rng: &mut StdRng, sse: bool) -> Choice {
        if let Some((bulk, share)) = self.cfg.bulk.filter(|_| sse) {
            if rng.random_bool(share) {
                return self.choose_run(rng, bulk);
            }
        }
        let h = lock(&self.history);
        let env = if rng.random_bool(0.85) { 0 } else { 1 };
        let demo = &self.envs[env];
        let skip = rng.random_bool(0.2).then(|| "payload,output".to_string());
        let roll: f64 = rng.random();
        let (feed, url, scope, key, node_feed) = if roll < 0.4 {
            let bulk = self.cfg.bulk.map(|(b, _)| b);
            let runs: Vec<usize> = (0..h.runs.len())
                .filter(|i| h.runs[*i].env == env && Some(*i) != bulk)
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

    /// A run feed of run `run`, read with the secret key.
    fn choose_run(&self, rng: &mut StdRng, run: usize) -> Choice {
        let h = lock(&self.history);
        let env = h.runs[run].env;
        let fid = h.runs[run].friendly_id.clone();
        let skip = rng.random_bool(0.2).then(|| "payload".to_string());
        let url = FeedUrl::run(&fid);
        Choice {
            feed: FeedSpec::Run { run },
            url: match &skip {
                Some(cols) => url.skip_columns(&[cols.as_str()]),
                None => url,
            },
            token: self.envs[env].api_key.clone(),
            key: format!("run:{env}:{run}:{}", skip.clone().unwrap_or_default()),
            node_feed: format!("run:{fid}"),
            skip,
        }
    }

    fn new_log(&self, slot: usize, client: ClientKind, c: &Choice) -> SubLog {
        SubLog {
            id: self.next_sub.fetch_add(1, Ordering::Relaxed),
            reader: format!(
                "{}{slot}",
                match client {
                    ClientKind::Rust => "r",
                    ClientKind::RustSse => "s",
                    ClientKind::NpmShape | ClientKind::NpmSdk => "n",
                }
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

    /// One subscription through the Rust follower: long-polls, or with `sse` an SSE stream
    /// once up-to-date.
    async fn rust_sub(&self, rng: &mut StdRng, slot: usize, sse: bool) -> SubLog {
        let c = self.choose(rng, sse);
        let client = if sse {
            ClientKind::RustSse
        } else {
            ClientKind::Rust
        };
        let log = self.new_log(slot, client, &c);
        let lifetime = rng.random_range(self.cfg.lifetime_s.0..self.cfg.lifetime_s.1) * 1000.0;
        let mut st = SubState {
            f: Follower::new(c.url.clone(), &c.token),
            until: log.started + lifetime,
            log,
            instance: rng.random_range(0..self.bases.len()),
            req_id: 0,
            backoff: Duration::from_millis(100),
            stop: self.stop.clone(),
            storm: self.storm.subscribe(),
            limit: Duration::from_millis(self.cfg.hold_ms * 13 / 10 + 10_000),
        };
        let n = self.bases.len();
        let mut catch_up = false;
        let mut probed = false;
        loop {
            if *st.stop.borrow() {
                break;
            }
            let churn = self.churning();
            if churn && self.clock.now() > st.until {
                st.log.ended = Some(self.clock.now());
                break;
            }
            if churn && n > 1 && rng.random_bool(self.cfg.hop) {
                st.instance = rng.random_range(0..n);
            }
            // Storms that came while this reader held no connection are not its own.
            st.storm.borrow_and_update();
            if churn && !probed && st.f.up_to_date && rng.random_bool(self.cfg.foreign) {
                probed = true;
                if let Some(foreign) = self.foreign_handle(rng, &c.key) {
                    if self.foreign_probe(&mut st, foreign).await.is_break() {
                        break;
                    }
                }
            }
            if sse && st.f.up_to_date && !catch_up {
                match self.sse_stream(rng, &mut st, &c).await {
                    Flow::Next => {}
                    Flow::Stop => break,
                }
            } else {
                let req = st.f.request(catch_up);
                catch_up = false;
                let id = st.push_request(self.clock.now(), &req, false);
                let abort_after = (churn
                    && req.kind == RequestKind::Live
                    && rng.random_bool(self.cfg.abort))
                .then(|| Duration::from_millis(rng.random_range(20..self.cfg.hold_ms.max(40))));
                enum Outcome {
                    Done(Result<crate::client::Response, ClientError>),
                    Aborted,
                    Storm,
                    Stopped,
                }
                let outcome = tokio::select! {
                    r = st.f.send(&self.http, &self.bases[st.instance], &req, st.limit) => Outcome::Done(r),
                    _ = sleep_opt(abort_after) => Outcome::Aborted,
                    _ = storm_hit(&mut st.storm, st.instance) => Outcome::Storm,
                    _ = st.stop.changed() => Outcome::Stopped,
                };
                let flow = match outcome {
                    Outcome::Stopped => {
                        st.failed(id, self.clock.now(), "check ended", true);
                        Flow::Stop
                    }
                    Outcome::Aborted => {
                        st.failed(id, self.clock.now(), "aborted by the reader", true);
                        Flow::Next
                    }
                    Outcome::Storm => self.storm_reconnect(rng, &mut st, id).await,
                    Outcome::Done(Err(e)) => {
                        self.failure(rng, &mut st, id, e.to_string()).await;
                        Flow::Next
                    }
                    Outcome::Done(Ok(resp)) => {
                        let drop = churn && resp.status == 200 && rng.random_bool(self.cfg.drop);
                        self.response(&mut st, &c, &req, id, &resp, drop).await
                    }
                };
                if let Flow::Stop = flow {
                    break;
                }
            }
            if self.churning() && rng.random_bool(self.cfg.pause) {
                let from = self.clock.now();
                let d = Duration::from_millis(rng.random_range(200..2_500));
                tokio::select! {
                    _ = tokio::time::sleep(d) => {}
                    _ = st.stop.changed() => {}
                }
                st.log.events.push(Event::Paused {
                    from,
                    to: self.clock.now(),
                });
                catch_up = rng.random_bool(0.5);
            }
        }
        st.log
    }

    /// One request with another feed's handle (must be a 409); logged as a dropped response.
    async fn foreign_probe(&self, st: &mut SubState, foreign: String) -> ControlFlow<()> {
        let mut g = st.f.clone();
        g.handle = Some(foreign);
        let req = g.request(false);
        let id = st.push_request(self.clock.now(), &req, true);
        let sent = tokio::select! {
            r = g.send(&self.http, &self.bases[st.instance], &req, st.limit) => Some(r),
            _ = st.stop.changed() => None,
        };
        match sent {
            Some(Ok(resp)) => st.log.events.push(Event::Response {
                req: id,
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
            Some(Err(e)) => st.failed(id, self.clock.now(), &e.to_string(), false),
            None => return ControlFlow::Break(()),
        }
        ControlFlow::Continue(())
    }

    /// A request that produced no response: logged; like a load balancer taking a dead
    /// instance out, the next request goes to another instance after a backoff.
    async fn failure(&self, rng: &mut StdRng, st: &mut SubState, id: u32, error: String) {
        st.failed(id, self.clock.now(), &error, false);
        let n = self.bases.len();
        if n > 1 {
            st.instance = (st.instance + 1 + rng.random_range(0..n - 1)) % n;
        }
        tokio::time::sleep(st.backoff).await;
        st.backoff = (st.backoff.mul_f64(1.3)).min(Duration::from_secs(2));
    }

    /// A response to request `id`: applied (unless `drop`), logged with the rows the view
    /// holds after it; backs off after a 5xx or 429; a 4xx other than 409 ends the
    /// subscription, as it does for the real client (`docs/protocol.md` §5.1).
    async fn response(
        &self,
        st: &mut SubState,
        c: &Choice,
        req: &crate::client::Request,
        id: u32,
        resp: &crate::client::Response,
        drop: bool,
    ) -> Flow {
        let at = self.clock.now();
        let rows: Vec<RowObs> = if drop {
            resp.changes()
                .iter()
                .map(|ch| RowObs::from_wire(&ch.operation, &ch.value))
                .collect()
        } else {
            match st.f.apply(req, resp) {
                Applied::Changes(changes) => st.observe(&changes),
                _ => Vec::new(),
            }
        };
        st.log.events.push(Event::Response {
            req: id,
            at,
            status: resp.status,
            offset: resp.offset.clone(),
            rows,
            dropped: drop,
        });
        if resp.status == 409 && !drop {
            st.log.events.push(Event::Reset { at });
        }
        if let Some(h) = &resp.handle {
            if (200..300).contains(&resp.status) {
                self.remember_handle(&c.key, h);
            }
        }
        if resp.status >= 500 || resp.status == 429 {
            tokio::time::sleep(st.backoff).await;
            st.backoff = (st.backoff.mul_f64(1.3)).min(Duration::from_secs(2));
        } else if (400..500).contains(&resp.status) && resp.status != 409 {
            st.log.ended = Some(at);
            return Flow::Stop;
        } else {
            st.backoff = Duration::from_millis(100);
        }
        Flow::Next
    }

    /// A reconnect storm hit request `id`: the connection is dropped (the request aborted),
    /// and the reader reconnects to another instance after 0–1 s (its own pause).
    async fn storm_reconnect(&self, rng: &mut StdRng, st: &mut SubState, id: u32) -> Flow {
        st.failed(id, self.clock.now(), STORM, true);
        let from = self.clock.now();
        let d = Duration::from_millis(rng.random_range(0..1_000));
        let stopped = tokio::select! {
            _ = tokio::time::sleep(d) => false,
            _ = st.stop.changed() => true,
        };
        st.log.events.push(Event::Paused {
            from,
            to: self.clock.now(),
        });
        let n = self.bases.len();
        if n > 1 {
            st.instance = (st.instance + 1 + rng.random_range(0..n - 1)) % n;
        }
        if stopped {
            Flow::Stop
        } else {
            Flow::Next
        }
    }

    /// One SSE stream at the follower's offset: each batch is applied and logged as a response
    /// to the stream's request. With `--sse-stall` the reader stops reading it once, for a
    /// random while (sometimes longer than the server's stall timeout, which then ends the
    /// stream); it then reads on, and reconnects at its last offset when the stream ends.
    async fn sse_stream(&self, rng: &mut StdRng, st: &mut SubState, c: &Choice) -> Flow {
        let req = st.f.sse_request();
        let id = st.push_request(self.clock.now(), &req, false);
        let opened = tokio::select! {
            r = sse::open(&self.bases[st.instance], &req, &st.f.headers, st.limit) => Some(r),
            _ = st.stop.changed() => None,
        };
        let mut stream = match opened {
            None => {
                st.failed(id, self.clock.now(), "check ended", true);
                return Flow::Stop;
            }
            Some(Err(e)) => {
                self.failure(rng, st, id, e.to_string()).await;
                return Flow::Next;
            }
            Some(Ok(Opened::Status(resp))) => {
                return self.response(st, c, &req, id, &resp, false).await;
            }
            Some(Ok(Opened::Stream {
                stream,
                handle,
                cursor,
            })) => {
                st.f.adopt_sse_headers(handle.as_deref(), cursor.as_deref());
                if let Some(h) = &st.f.handle {
                    self.remember_handle(&c.key, h);
                }
                st.backoff = Duration::from_millis(100);
                stream
            }
        };
        let now = tokio::time::Instant::now();
        let churn = self.churning();
        let (lo, hi) = self.cfg.sse_stall_ms;
        let mut stall = (churn && rng.random_bool(self.cfg.sse_stall)).then(|| {
            (
                now + Duration::from_millis(rng.random_range(0..2_000)),
                Duration::from_millis(rng.random_range(lo..hi.max(lo + 1))),
            )
        });
        let mut close_at = churn
            .then(|| now + Duration::from_millis((st.until - self.clock.now()).max(0.0) as u64));
        let mut stalled_out = false;
        loop {
            let stall_at = stall.map(|(at, _)| at);
            // What was received is taken first: a stream that broke is seen as broken.
            tokio::select! {
                biased;
                batch = stream.next_batch() => match batch {
                    Ok(Some(messages)) => {
                        let changes = st.f.apply_sse_batch(&messages);
                        let rows = st.observe(&changes);
                        st.log.events.push(Event::Response {
                            req: id,
                            at: self.clock.now(),
                            status: 200,
                            offset: Some(st.f.offset.clone()),
                            rows,
                            dropped: false,
                        });
                    }
                    Ok(None) => {
                        st.ended(id, self.clock.now(), StreamEnd::Closed);
                        return Flow::Next;
                    }
                    Err(_) if stalled_out => {
                        st.ended(id, self.clock.now(), StreamEnd::StalledOut);
                        return Flow::Next;
                    }
                    Err(e) => {
                        self.failure(rng, st, id, e.to_string()).await;
                        return Flow::Next;
                    }
                },
                _ = sleep_until_opt(stall_at) => {
                    let d = stall.take().map_or(Duration::ZERO, |(_, d)| d);
                    let from = self.clock.now();
                    enum Woken { Slept, Storm, Stopped }
                    let woken = tokio::select! {
                        _ = tokio::time::sleep(d) => Woken::Slept,
                        _ = storm_hit(&mut st.storm, st.instance) => Woken::Storm,
                        _ = st.stop.changed() => Woken::Stopped,
                    };
                    let to = self.clock.now();
                    st.log.events.push(Event::Paused { from, to });
                    stalled_out = to - from >= self.cfg.stall_timeout_ms as f64;
                    match woken {
                        // Read on for a second at least: a stream the server ended during the
                        // stall is then seen to break (the end arrives through hyper's
                        // connection task, after the reader resumed).
                        Woken::Slept => {
                            let read_on = tokio::time::Instant::now() + Duration::from_secs(1);
                            close_at = close_at.map(|c| c.max(read_on));
                        }
                        Woken::Storm => return self.storm_reconnect(rng, st, id).await,
                        Woken::Stopped => {
                            st.failed(id, to, "check ended", true);
                            return Flow::Stop;
                        }
                    }
                }
                _ = sleep_until_opt(close_at) => {
                    let at = self.clock.now();
                    st.ended(id, at, StreamEnd::ReaderClosed);
                    st.log.ended = Some(at);
                    return Flow::Stop;
                }
                _ = storm_hit(&mut st.storm, st.instance) => {
                    return self.storm_reconnect(rng, st, id).await;
                }
                _ = st.stop.changed() => {
                    st.failed(id, self.clock.now(), "check ended", true);
                    return Flow::Stop;
                }
            }
        }
    }

    /// One subscription through the real npm clients (a node process).
    async fn npm_sub(&self, rng: &mut StdRng, slot: usize) -> SubLog {
        let c = self.choose(rng, false);
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

/// Returns when a storm hits `instance` (storms on other instances are passed over).
async fn storm_hit(rx: &mut watch::Receiver<usize>, instance: usize) {
    loop {
        if rx.changed().await.is_err() {
            return std::future::pending().await;
        }
        if *rx.borrow_and_update() == instance {
            return;
        }
    }
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn sleep_opt(d: Option<Duration>) {
    match d {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}
