//! Fleet integration tests : several runfeed instances on one database and one Redis
//! behind a non-sticky balancer — hops between instances, a Redis restart under held polls,
//! the fleet-wide live-poll limit, and the resolve admission gate under a distinct-filter
//! stampede.
//!
//! The cluster-node restart case is covered by
//! `tests/it/changes_cluster.rs::live_poll_woken_over_sharded_pubsub_across_a_node_restart`
//! (whole server in cluster + sharded mode, a held live poll woken after the env's master was
//! restarted); it is not duplicated here.
//!
//! Every await is bounded; the Redis-restart test runs its OWN `redis-server` on a free port
//! (never the shared one at 127.0.0.1:6379), killed when the test ends, also on failure.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::process::Child;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use runfeed::changes::channel_name;
use runfeed::protocol::encode::format_timestamp_ms;
use runfeed_dev::fixtures::DemoEnv;
use sqlx::Row;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// `id → (status, updatedAt)` of a follower's materialized view.
fn view_of(f: &Follower) -> BTreeMap<String, (String, String)> {
    f.view
        .iter()
        .map(|(id, row)| {
            let s = |k: &str| {
                row.get(k)
                    .and_then(|v| v.as_str())
                    .unwrap_or("?")
                    .to_string()
            };
            (id.clone(), (s("status"), s("updatedAt")))
        })
        .collect()
}

/// `id → (status, updatedAt)` of the env's runs in the database matching `filter` (SQL on
/// `"TaskRun"`, `$1` = env id, `$2` = the filter's text argument).
async fn db_view(
    pool: &sqlx::PgPool,
    env: &DemoEnv,
    filter: &str,
    arg: &str,
) -> BTreeMap<String, (String, String)> {
    let sql = format!(
        r#"SELECT id, status::text AS status, (extract(epoch from "updatedAt") * 1000)::int8 AS ms
           FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND {filter}"#
    );
    let rows = within(
        WAIT,
        "read the runs back",
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&env.env_id)
            .bind(arg)
            .fetch_all(pool),
    )
    .await
    .expect("read the runs back");
    rows.iter()
        .map(|r| {
            let ms: i64 = r.get("ms");
            (
                r.get::<String, _>("id"),
                (
                    r.get::<String, _>("status"),
                    format_timestamp_ms(ms).unwrap(),
                ),
            )
        })
        .collect()
}

/// The sum over both instances' `/metrics` of the sample lines whose series name (before `{`)
/// is `name` and whose labels contain `label` (e.g. `result="miss"`; "" = any).
async fn scrape_sum(
    srv: &TestServer,
    admins: [std::net::SocketAddr; 2],
    name: &str,
    label: &str,
) -> u64 {
    let mut total = 0.0;
    for addr in admins {
        let get = srv.http.get(format!("http://{addr}/metrics")).send();
        let text = within(WAIT, "scrape", async {
            get.await
                .expect("scrape")
                .text()
                .await
                .expect("scrape body")
        })
        .await;
        total += text
            .lines()
            .filter(|l| l.split(['{', ' ']).next() == Some(name) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum::<f64>();
    }
    total as u64
}

/// Run-set reads (snapshots, cold and full resolves, backstops) and shared-cursor read misses
/// so far on both instances.
async fn reads_and_cursor_misses(
    srv: &TestServer,
    admins: [std::net::SocketAddr; 2],
) -> (u64, u64) {
    (
        scrape_sum(
            srv,
            admins,
            "runfeed_runset_resolves_total",
            "result=\"miss\"",
        )
        .await,
        scrape_sum(
            srv,
            admins,
            "runfeed_feeds_cursor_store_ops_total",
            "result=\"miss\"",
        )
        .await,
    )
}

fn hydrates(running: &runfeed::app::Running) -> u64 {
    running.router.stats().hydrates.load(Ordering::SeqCst)
}

/// Fleet: a follower whose successive live polls alternate between two instances (same
/// handle secret, database and Redis; shared replay cursors) misses no update — neither one
/// made while a poll is held nor one made in the gap between two polls — each arrives well
/// under the hold, the hops cost no full run-set resolve (only the router's hydrates), and the
/// final view equals the database.
///
/// Re-deliveries of rows the client already has (see
/// `hop_right_after_a_change_holds_instead_of_redelivering`) are tolerated here: they are not
/// misses (the client just polls on); they are counted and printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hops_alternating_instances_miss_no_update() {
    const RUNS: usize = 4;
    const CHANGES: usize = 20;
    let srv = TestServer::start_with(20_000, |c| c.router.hop_margin_ms = 200).await;
    let peer = srv.peer(|_| {}).await;
    let env = srv.env().await;
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        runs.push(srv.tagged_run(&env, &["fleet"]).await);
    }
    let h = modern(&env.api_key);
    // Both instances already serve this environment (other clients): their streams are warm.
    let warm = run_url(&runs[0].friendly_id).snapshot();
    srv.warm_with_peer(&peer, &env.env_id, &warm, &h).await;
    // Let both streams age past the hop margin (a replay from another instance's cursor starts
    // `hop_margin_ms` before its wall time; the stream must cover that). No observable for it.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let bases = [srv.base.clone(), peer.base.clone()];
    let instances = [srv.running(), &peer.running];
    let mut f = Follower::new(tag_url("fleet"), h.clone());
    within(WAIT, "snapshot", f.step(&bases[0], &srv.http))
        .await
        .expect("snapshot");
    assert_eq!(f.view.len(), RUNS);

    let queries = |i: usize| instances[i].store.query_count();
    let q0 = queries(0) + queries(1);
    let hy0 = hydrates(instances[0]) + hydrates(instances[1]);
    let admins = [
        srv.running().admin_addr.unwrap(),
        peer.running.admin_addr.unwrap(),
    ];
    let (rs0, cm0) = reads_and_cursor_misses(&srv, admins).await;
    let phase = Instant::now();
    let statuses = [
        "EXECUTING",
        "WAITING_TO_RESUME",
        "RETRYING_AFTER_FAILURE",
        "EXECUTING",
        "PAUSED",
    ];
    let mut latencies = Vec::new();
    // Live polls strictly alternate: poll n goes to instance n % 2 (the snapshot was poll 0).
    let mut n = 1usize;
    // Responses that came back at once without the change being waited for (a re-delivery of
    // something the client already had): not a miss, but an extra round trip.
    let mut redundant = Vec::new();
    for k in 0..CHANGES {
        let run = &runs[k % RUNS];
        let status = statuses[(k / RUNS) % statuses.len()];
        let published;
        if k % 2 == 0 {
            // In the gap: committed and published before the poll is sent (the polls below
            // fetch it).
            srv.change(&env, &run.id, &["fleet"], None, status).await;
            published = Instant::now();
        } else {
            // While the poll is held.
            loop {
                let i = n % 2;
                n += 1;
                let router = instances[i].router.clone();
                let before = f.view.clone();
                let mut poll = Box::pin(f.step(&bases[i], &srv.http));
                let held = wait_until(WAIT, "poll held", || router.held_feeds().1 == 1);
                let early = within(Duration::from_secs(5), "poll held or answered", async {
                    tokio::select! {
                        r = &mut poll => Some(r),
                        () = held => None,
                    }
                })
                .await;
                if let Some(r) = early {
                    drop(poll);
                    r.unwrap_or_else(|e| panic!("poll {k} on instance {i}: {e}"));
                    let changed: Vec<_> = f
                        .view
                        .iter()
                        .filter(|(id, row)| before.get(*id) != Some(*row))
                        .map(|(id, _)| id.clone())
                        .collect();
                    redundant.push((k, i, changed));
                    continue;
                }
                srv.change(&env, &run.id, &["fleet"], None, status).await;
                published = Instant::now();
                within(Duration::from_secs(5), "held poll", poll)
                    .await
                    .unwrap_or_else(|e| panic!("poll {k} on instance {i}: {e}"));
                break;
            }
        }
        // The poll that was held may have been answered with a re-delivery it registered with
        // (see `redundant`): a client simply polls on; a change made in the gap is polled for.
        while f.view[&run.id]["status"] != status && published.elapsed() < Duration::from_secs(5) {
            let i = n % 2;
            n += 1;
            within(Duration::from_secs(5), "poll", f.step(&bases[i], &srv.http))
                .await
                .unwrap_or_else(|e| panic!("poll {k} on instance {i}: {e}"));
        }
        let latency = published.elapsed();
        assert_eq!(
            f.view[&run.id]["status"], status,
            "change {k} missed: {:?}",
            f.view[&run.id]
        );
        assert!(
            latency < Duration::from_secs(2),
            "poll {k}: delivered {latency:?} after the publish"
        );
        latencies.push(latency);
    }
    let dq = queries(0) + queries(1) - q0;
    let dhy = hydrates(instances[0]) + hydrates(instances[1]) - hy0;
    latencies.sort();
    println!(
        "{CHANGES} changes over {} alternating live polls: delivery median {:?}, max {:?}; {dq} store queries, {dhy} router hydrates; redundant responses {}",
        n - 1,
        latencies[CHANGES / 2],
        latencies[CHANGES - 1],
        redundant.len()
    );
    let (rs1, cm1) = reads_and_cursor_misses(&srv, admins).await;
    let (resolves, cursor_misses) = (rs1 - rs0, cm1 - cm0);
    // Every store query of the hopping phase is a router hydrate, bar the authentication's
    // environment lookups (cached `lookup_cache_ttl_ms` = 1 s per instance); no run-set read.
    // The only run-set reads allowed are cold resolves after a shared-cursor miss: the cursor is
    // written fire-and-forget after the response, so a poll re-sent at once to the other
    // instance can read before the write lands (with the re-delivery ping-pong, up to ~2 % of
    // the polls).
    println!("hopping phase: {resolves} run-set reads, {cursor_misses} shared-cursor misses over {} polls", n - 1);
    assert!(
        resolves <= cursor_misses,
        "hops ran run-set reads without a cursor miss: {resolves} reads, {cursor_misses} misses"
    );
    assert!(
        dq - dhy - resolves <= 2 * (phase.elapsed().as_secs() + 1),
        "{dq} store queries vs {dhy} hydrates + {resolves} run-set reads"
    );
    let db = db_view(srv.pool(), &env, r#"$2 = ANY("runTags")"#, "fleet").await;
    assert_eq!(view_of(&f), db, "the follower's view equals the database");
}

// ----- a private redis-server -----

/// A standalone `redis-server` of this test on a free port (no persistence), killed on drop.
struct OwnRedis {
    port: u16,
    dir: std::path::PathBuf,
    child: Option<Child>,
}

impl OwnRedis {
    fn start() -> OwnRedis {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("runfeed-fleet-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("redis dir");
        let mut r = OwnRedis {
            port,
            dir,
            child: None,
        };
        r.spawn();
        r
    }

    fn spawn(&mut self) {
        let child = redis_server(self.port)
            .arg("--dir")
            .arg(&self.dir)
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
    }

    /// SIGKILL, then reap.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis-cli -p <port> args…` (2 s bound); stdout when it exited 0.
    async fn cli(&self, args: &[&str]) -> Option<String> {
        let out = tokio::process::Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .kill_on_drop(true)
            .output();
        match tokio::time::timeout(Duration::from_secs(2), out).await {
            Ok(Ok(o)) if o.status.success() => {
                Some(String::from_utf8_lossy(&o.stdout).trim().to_string())
            }
            _ => None,
        }
    }

    async fn up(&self) -> bool {
        self.cli(&["PING"]).await.as_deref() == Some("PONG")
    }

    /// Waits until `PING` answers `PONG` (`want`) or fails (`!want`).
    async fn wait_ping(&self, want: bool, what: &str) {
        let deadline = Instant::now() + WAIT;
        while self.up().await != want {
            assert!(Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits (at most `limit`) until a client is subscribed to `env_id`'s channel.
    async fn wait_subscriber(&self, env_id: &str, limit: Duration, what: &str) {
        let deadline = Instant::now() + limit;
        while self.numsub(env_id).await < 1 {
            assert!(Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn numsub(&self, env_id: &str) -> i64 {
        let out = self
            .cli(&["PUBSUB", "NUMSUB", &channel_name(env_id)])
            .await
            .unwrap_or_default();
        out.lines()
            .last()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or(0)
    }

    /// `PUBLISH` of a change record; the receiver count (0 when Redis failed).
    async fn publish(&self, record: &runfeed::changes::ChangeRecord) -> i64 {
        let out = self
            .cli(&["PUBLISH", &channel_name(&record.env_id), &record.encode()])
            .await;
        out.and_then(|o| o.parse().ok()).unwrap_or(0)
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Drives `f` against `base` until `done(view)`; every status is logged in `statuses` (0 =
/// transport error); after each response the view's `(status)` per id is sent on `tx`.
/// Behaves like the Electric client: 409 → re-snapshot, other errors → back off and retry.
fn spawn_follower(
    base: String,
    http: reqwest::Client,
    mut f: Follower,
    done: impl Fn(&Follower) -> bool + Send + 'static,
    statuses: Arc<Mutex<Vec<u16>>>,
    tx: tokio::sync::watch::Sender<HashMap<String, String>>,
) -> JoinHandle<Follower> {
    tokio::spawn(async move {
        while !done(&f) {
            match f.step(&base, &http).await {
                Ok(s) => statuses.lock().unwrap().push(s),
                Err(e) => {
                    let code = e
                        .strip_prefix("status ")
                        .and_then(|r| r.get(..3))
                        .and_then(|c| c.parse().ok())
                        .unwrap_or(0);
                    statuses.lock().unwrap().push(code);
                    if code == 409 {
                        f.handle = None;
                        f.offset = "-1".into();
                        f.view.clear();
                    } else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            let view = f
                .view
                .iter()
                .map(|(id, row)| {
                    (
                        id.clone(),
                        row["status"].as_str().unwrap_or("?").to_string(),
                    )
                })
                .collect();
            let _ = tx.send(view);
        }
        f
    })
}

/// Fleet: the Redis carrying the change stream (and the limiter, and the shared cursors) is
/// killed under held live polls of a run, a tag and a batch feed and restarted ~1 s later.
/// No request is answered 5xx, the polls complete, the server re-subscribes by itself (a record
/// published after the restart wakes a held poll within a few seconds, not via the backstop),
/// and every follower's view ends equal to the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_restart_during_live_polls_no_5xx_and_views_converge() {
    let mut redis = OwnRedis::start();
    redis
        .wait_ping(true, "own redis-server never answered PING")
        .await;
    let url = redis.url();
    let srv = TestServer::start_with(20_000, |c| c.redis.url = url.clone()).await;
    let env = srv.env().await;
    let (batch_id, batch_fid) = srv.batch(&env).await;
    let r1 = srv.run(&env, tagged_in_batch(&["rr"], &batch_id)).await;
    let r2 = srv.run(&env, tagged_in_batch(&["rr"], &batch_id)).await;
    let h = modern(&env.api_key);

    let statuses = Arc::new(Mutex::new(Vec::new()));
    let feeds = [
        ("run", run_url(&r1.friendly_id), 1usize),
        ("tag", tag_url("rr"), 2),
        ("batch", batch_url(&batch_fid), 2),
    ];
    let mut tasks = Vec::new();
    let mut watches = Vec::new();
    for (_, url, n) in &feeds {
        let (tx, rx) = tokio::sync::watch::channel(HashMap::new());
        let (r1, r2, n) = (r1.id.clone(), r2.id.clone(), *n);
        let done = move |f: &Follower| {
            f.view
                .get(&r1)
                .is_some_and(|row| row["status"] == "COMPLETED_SUCCESSFULLY")
                && (n == 1
                    || f.view
                        .get(&r2)
                        .is_some_and(|row| row["status"] == "EXECUTING"))
        };
        tasks.push(spawn_follower(
            srv.base.clone(),
            srv.http.clone(),
            Follower::new(url.clone(), h.clone()),
            done,
            statuses.clone(),
            tx,
        ));
        watches.push(rx);
    }
    let router = srv.running().router.clone();
    wait_until(WAIT, "three live polls held", || {
        router.held_feeds() == (1, 1, 1)
    })
    .await;
    let what = "the server never subscribed on the own redis";
    redis.wait_subscriber(&env.env_id, WAIT, what).await;

    // Kill Redis under the held polls; change the runs while it is down (commit only).
    redis.kill();
    redis
        .wait_ping(false, "redis still answers after SIGKILL")
        .await;
    let down = Instant::now();
    let ms1 = srv.set_status(&r1.id, "EXECUTING").await;
    let ms2 = srv.set_status(&r2.id, "EXECUTING").await;
    tokio::time::sleep(Duration::from_millis(1_000)).await; // the outage itself
    redis.spawn();
    redis
        .wait_ping(true, "restarted redis-server never answered PING")
        .await;
    let up = Instant::now();
    let what = "the server did not re-subscribe within 10 s of Redis coming back";
    redis
        .wait_subscriber(&env.env_id, Duration::from_secs(10), what)
        .await;
    let resubscribed = up.elapsed();
    // Publish the outage's changes now that Redis is back (trigger.dev's publish needs it).
    for (id, ms) in [(&r1.id, ms1), (&r2.id, ms2)] {
        let rec = TestServer::record(&env, id, &["rr"], Some(&batch_id), ms);
        assert!(
            redis.publish(&rec).await >= 1,
            "no subscriber for the record after the restart"
        );
    }
    for (rx, (name, _, n)) in watches.iter_mut().zip(&feeds) {
        let ids: Vec<&String> = if *n == 1 {
            vec![&r1.id]
        } else {
            vec![&r1.id, &r2.id]
        };
        within(
            Duration::from_secs(5),
            &format!("{name} feed got the outage's changes"),
            rx.wait_for(|v| {
                ids.iter()
                    .all(|id| v.get(*id).is_some_and(|s| s == "EXECUTING"))
            }),
        )
        .await
        .expect("follower alive");
    }
    let converged = down.elapsed();

    // The subscription is back: a record published now wakes the held polls at once.
    wait_until(WAIT, "three live polls held again", || {
        router.held_feeds() == (1, 1, 1)
    })
    .await;
    let ms = srv.set_status(&r1.id, "COMPLETED_SUCCESSFULLY").await;
    let published = Instant::now();
    assert!(
        redis
            .publish(&TestServer::record(
                &env,
                &r1.id,
                &["rr"],
                Some(&batch_id),
                ms
            ))
            .await
            >= 1
    );
    let mut followers = Vec::new();
    for t in tasks {
        followers.push(
            within(Duration::from_secs(5), "followers finish", t)
                .await
                .expect("follower task"),
        );
    }
    let woken = published.elapsed();
    println!("redis restart: re-subscribed {resubscribed:?} after PING came back; outage changes in views {converged:?} after the kill; post-restart record delivered in {woken:?}");
    assert!(
        woken < Duration::from_secs(3),
        "post-restart record took {woken:?} (backstop?)"
    );
    let seen = statuses.lock().unwrap().clone();
    assert!(
        seen.iter().all(|s| *s < 500 && *s != 0),
        "a 5xx or transport error: {seen:?}"
    );

    let run_db = db_view(srv.pool(), &env, "id = $2", &r1.id).await;
    let list_db = db_view(srv.pool(), &env, r#"$2 = ANY("runTags")"#, "rr").await;
    assert_eq!(view_of(&followers[0]), run_db, "run feed view");
    assert_eq!(view_of(&followers[1]), list_db, "tag feed view");
    assert_eq!(view_of(&followers[2]), list_db, "batch feed view");
    drop(srv);
    drop(redis);
}

/// REQ-04 fleet-wide: with a limit of L = 5 live polls per environment, L + 3
/// concurrent live polls spread over TWO instances (one Redis sorted set per environment)
/// yield exactly 3 × 429; aborting a held poll lets a new one in at once, on either instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_limit_live_polls_get_exactly_n_429s() {
    const L: usize = 5;
    let srv = Arc::new(
        TestServer::start_with(20_000, |c| c.feeds.default_concurrency_limit = L as u64).await,
    );
    let peer = srv.peer(|_| {}).await;
    let env = srv.env().await; // a fresh env id: a fresh sorted-set key
    let run = srv.tagged_run(&env, &["l"]).await;
    let h = modern(&env.api_key);
    let snap = srv.fetch(&run_url(&run.friendly_id).snapshot(), &h).await;
    snap.assert_status(200);
    let live = run_url(&run.friendly_id).live_after(&snap);
    let bases = [srv.base.clone(), peer.base.clone()];
    let spawn_poll = |i: usize| {
        let (srv, live, h, base) = (srv.clone(), live.clone(), h.clone(), bases[i].clone());
        tokio::spawn(async move { srv.fetch_at(&base, &live, &h).await.status })
    };
    let routers = [srv.running().router.clone(), peer.running.router.clone()];
    let held = || routers[0].held_feeds().0 + routers[1].held_feeds().0;

    let polls: Vec<(usize, JoinHandle<u16>)> =
        (0..L + 3).map(|k| (k % 2, spawn_poll(k % 2))).collect();
    wait_until(WAIT, "L polls held and 3 answered", || {
        held() == L && polls.iter().filter(|(_, p)| p.is_finished()).count() == 3
    })
    .await;
    let (done, mut waiting): (Vec<_>, Vec<_>) =
        polls.into_iter().partition(|(_, p)| p.is_finished());
    for (_, p) in done {
        assert_eq!(within(WAIT, "answered poll", p).await.expect("join"), 429);
    }
    let on = |i: usize| waiting.iter().filter(|(j, _)| *j == i).count();
    println!(
        "over the limit: held {} on srv + {} on peer, 3 × 429",
        on(0),
        on(1)
    );
    assert_eq!(held(), L, "the limit is fleet-wide");

    // Free one slot on one instance; a new poll on the OTHER instance gets in at once.
    let (freed_on, victim) = waiting.remove(0);
    victim.abort();
    wait_until(WAIT, "aborted poll released", || held() == L - 1).await;
    let t = Instant::now();
    let newcomer = spawn_poll(1 - freed_on);
    wait_until(
        Duration::from_secs(2),
        "the new poll takes the freed slot",
        || held() == L || newcomer.is_finished(),
    )
    .await;
    assert!(
        !newcomer.is_finished(),
        "the new poll was refused: {:?}",
        within(WAIT, "refused poll", newcomer).await
    );
    println!(
        "freed slot taken by a poll on the other instance after {:?}",
        t.elapsed()
    );
    // Still at the limit: one more is refused.
    assert_eq!(srv.fetch_at(&bases[freed_on], &live, &h).await.status, 429);
    newcomer.abort();
    for (_, p) in waiting {
        p.abort();
    }
    drop(peer);
}

/// docs/behaviours.md §1.19 (the admission gate): 1 000 DISTINCT tag filters snapshotted at
/// once (every one a run-set cache miss) never run more than `resolve_admission_limit` run-set
/// resolves at a time, and every snapshot still succeeds with its run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn distinct_filter_stampede_respects_admission_limit() {
    const A: usize = 4;
    const TAGS: usize = 1_000;
    const PER_RUN: usize = 10;
    let srv =
        Arc::new(TestServer::start_with(20_000, |c| c.feeds.resolve_admission_limit = A).await);
    let env = srv.env().await;
    let mut owner = Vec::new();
    for r in 0..TAGS / PER_RUN {
        let tags: Vec<String> = (r * PER_RUN..(r + 1) * PER_RUN)
            .map(|t| format!("t{t}"))
            .collect();
        let refs: Vec<&str> = tags.iter().map(String::as_str).collect();
        let run = srv.tagged_run(&env, &refs).await;
        owner.extend(std::iter::repeat_n(run.id, PER_RUN));
    }
    let h = modern(&env.api_key);
    let started = Instant::now();
    let snaps: Vec<JoinHandle<Resp>> = (0..TAGS)
        .map(|t| {
            let (srv, h) = (srv.clone(), h.clone());
            tokio::spawn(async move { srv.fetch(&tag_url(&format!("t{t}")).snapshot(), &h).await })
        })
        .collect();
    // The permits in use, as the admin endpoint reports them, sampled until the stampede ends.
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (srv, done) = (srv.clone(), done.clone());
        tokio::spawn(async move {
            let mut peak = 0.0_f64;
            while !done.load(Ordering::SeqCst) {
                let text = srv.scrape_text().await;
                let in_use =
                    runfeed_dev::measure::metric_sum(&text, "runfeed_runset_admission_in_use")
                        .unwrap_or(0.0);
                peak = peak.max(in_use);
            }
            peak
        })
    };
    for (t, s) in snaps.into_iter().enumerate() {
        let r = within(WAIT, "snapshot", s).await.expect("join");
        r.assert_status(200);
        assert_eq!(
            r.ops(),
            vec![("insert".to_string(), owner[t].clone())],
            "t{t}: {}",
            r.text
        );
    }
    done.store(true, Ordering::SeqCst);
    let peak = sampler.await.expect("sampler");
    let waits = runfeed_dev::measure::metric_sum(
        &srv.scrape_text().await,
        "runfeed_runset_admission_waits_total",
    )
    .unwrap_or(0.0);
    println!(
        "{TAGS} distinct-filter snapshots in {:?}; peak permits in use seen {peak}, {waits} resolves waited (limit {A})",
        started.elapsed()
    );
    assert!(waits >= 1.0, "no resolve ever waited for a permit");
    assert!(
        peak <= A as f64,
        "{peak} run-set resolves at once over an admission limit of {A}"
    );
}

/// The admission gate covers run feeds too: 200 DISTINCT run feeds snapshotted at once (every
/// one a cold resolve, as after a reconnect storm) queue for the instance's one admission permit
/// (`runfeed_runset_admission_waits_total` moves), and every snapshot still succeeds with its run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_feed_cold_resolves_wait_for_the_admission_gate() {
    const RUNS: usize = 200;
    let srv =
        Arc::new(TestServer::start_with(20_000, |c| c.feeds.resolve_admission_limit = 1).await);
    let env = srv.env().await;
    let mut runs = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        runs.push(
            srv.run(&env, runfeed_dev::fixtures::RunSpec::default())
                .await,
        );
    }
    let h = modern(&env.api_key);
    let snaps: Vec<JoinHandle<Resp>> = runs
        .iter()
        .map(|run| {
            let (srv, h, url) = (srv.clone(), h.clone(), run_url(&run.friendly_id));
            tokio::spawn(async move { srv.fetch(&url.snapshot(), &h).await })
        })
        .collect();
    for (run, s) in runs.iter().zip(snaps) {
        let r = within(WAIT, "snapshot", s).await.expect("join");
        r.assert_status(200);
        assert_eq!(
            r.ops(),
            vec![("insert".to_string(), run.id.clone())],
            "{}",
            r.text
        );
    }
    let waits = runfeed_dev::measure::metric_sum(
        &srv.scrape_text().await,
        "runfeed_runset_admission_waits_total",
    )
    .unwrap_or(0.0);
    println!("{RUNS} distinct run-feed snapshots; {waits} waited for the one admission permit");
    assert!(
        waits >= 1.0,
        "no run-feed resolve waited for the admission gate (limit 1, {RUNS} at once)"
    );
}

/// Fleet: after a change was delivered by instance A, the client's next live poll landing on
/// instance B (within `hop_margin_ms` of the change) must HOLD — the client already has that
/// row. B replays the record (its replay starts `hop_margin_ms` before A's cursor) but has no
/// working set for a connection it never served; the shared cursor carries the versions of the
/// runs A's recent responses carried, so B drops the row instead of re-sending it (without
/// them a client alternating between instances would ping-pong until the margin passed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hop_right_after_a_change_holds_instead_of_redelivering() {
    let (srv, peer, env, run, h) = warm_pair(3_000, "pp").await;
    tokio::time::sleep(Duration::from_millis(300)).await; // streams older than the hop margin
    let url = tag_url("pp");
    let snap = srv.fetch(&url.snapshot(), &h).await;
    // A held poll on A is woken by the change …
    let router = srv.running().router.clone();
    let poll = srv.fetch(&url.live_after(&snap), &h);
    let change = async {
        wait_until(WAIT, "held on A", || router.held_feeds().1 == 1).await;
        srv.change(&env, &run.id, &["pp"], None, "EXECUTING").await;
    };
    let (woken, ()) = within(WAIT, "wake on A", async { tokio::join!(poll, change) }).await;
    woken.assert_status(200);
    assert_eq!(
        woken.ops(),
        vec![("update".to_string(), run.id.clone())],
        "{}",
        woken.text
    );
    // … and the client's next poll lands on B at once: nothing new, so it must hold.
    let next = srv.fetch_at(&peer.base, &url.live_after(&woken), &h).await;
    next.assert_status(200);
    assert!(
        next.is_bare_up_to_date() && next.elapsed >= Duration::from_millis(2_900),
        "answered after {:?} with {} (offset {} -> {})",
        next.elapsed,
        next.text,
        woken.offset(),
        next.offset()
    );
}

/// Fleet: a quiet hold (nothing new) is answered without writing the shared cursor; its
/// `electric-cursor` carries the response's wall time and that it vouched for its gap
/// (docs/operations.md "Fleet"). Once the offset's stored cursor is older than the replay
/// buffer, a client's next poll landing on the other instance replays from the echoed time: it
/// holds without reading the store, and a change made during its hold reaches it from the
/// router. The same poll with an unvouched (odd) cursor cannot be trusted that far: it re-reads
/// the feed from the store before holding.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hop_after_a_quiet_hold_replays_from_the_echoed_cursor_without_a_store_read() {
    let (srv, peer, env, run, h) = warm_pair(500, "quiet").await;
    let url = tag_url("quiet");
    // Two clients of the feed (two handles), each polling A through quiet holds until the
    // state stored at their snapshot is older than the replay buffer (2 s).
    let (trusting, distrusting) = tokio::join!(
        quiet_holds(&srv, &url, &h, Duration::from_millis(2_600)),
        quiet_holds(&srv, &url, &h, Duration::from_millis(2_600)),
    );
    let cursor: u64 = trusting
        .cursor()
        .expect("cursor")
        .parse()
        .expect("numeric cursor");
    assert_eq!(
        cursor % 2,
        0,
        "a trusted quiet hold's cursor vouches (even)"
    );

    let b_queries = || peer.running.store.query_count();
    let router = peer.running.router.clone();
    // The unvouched cursor first: B reads the store before it holds.
    let q0 = b_queries();
    let odd = (distrusting
        .cursor()
        .expect("cursor")
        .parse::<u64>()
        .expect("numeric")
        | 1)
    .to_string();
    let distrusted = url.live(&distrusting.handle(), &distrusting.offset(), Some(&odd));
    let held_before = router.held_feeds().1;
    let poll = srv.fetch_at(&peer.base, &distrusted, &h);
    let check = async {
        wait_until(WAIT, "held on B", || router.held_feeds().1 > held_before).await;
        assert!(
            b_queries() > q0,
            "an unvouched cursor is re-checked against the store"
        );
    };
    let (r, ()) = within(WAIT, "distrusted poll", async { tokio::join!(poll, check) }).await;
    r.assert_status(200);

    // The vouched cursor: B holds without a store read, and a change during the hold reaches it.
    let q1 = b_queries();
    let held_before = router.held_feeds().1;
    let trusted = url.live_after(&trusting);
    let poll = srv.fetch_at(&peer.base, &trusted, &h);
    let change = async {
        wait_until(WAIT, "held on B", || router.held_feeds().1 > held_before).await;
        assert_eq!(
            b_queries() - q1,
            0,
            "B trusted the echoed cursor: no store read"
        );
        srv.change(&env, &run.id, &["quiet"], None, "EXECUTING")
            .await;
    };
    let (woken, ()) = within(WAIT, "wake on B", async { tokio::join!(poll, change) }).await;
    woken.assert_status(200);
    assert_eq!(
        woken.ops(),
        vec![("update".to_string(), run.id.clone())],
        "{}",
        woken.text
    );
}

/// Two instances (hold `hold_ms`, hop margin 200 ms) that both already serve a fresh
/// environment with one run tagged `tag`: the server, its peer, the environment, the run and the
/// client's headers.
async fn warm_pair(
    hold_ms: u64,
    tag: &str,
) -> (
    TestServer,
    Peer,
    DemoEnv,
    runfeed_dev::fixtures::CreatedRun,
    Vec<(String, String)>,
) {
    let srv = TestServer::start_with(hold_ms, |c| c.router.hop_margin_ms = 200).await;
    let peer = srv.peer(|_| {}).await;
    let env = srv.env().await;
    let run = srv.tagged_run(&env, &[tag]).await;
    let h = modern(&env.api_key);
    let warm = run_url(&run.friendly_id).snapshot();
    srv.warm_with_peer(&peer, &env.env_id, &warm, &h).await;
    (srv, peer, env, run, h)
}

/// A snapshot of `url` on `srv`, then quiet live holds there until `at_least` has passed; the
/// last response (its offset still the snapshot's).
async fn quiet_holds(
    srv: &TestServer,
    url: &Url,
    h: &[(String, String)],
    at_least: Duration,
) -> Resp {
    let started = Instant::now();
    let snap = srv.fetch(&url.snapshot(), h).await;
    snap.assert_status(200);
    let offset = snap.offset();
    let mut last = snap;
    while started.elapsed() < at_least {
        let next = srv.fetch(&url.live_after(&last), h).await;
        next.assert_status(200);
        assert!(next.is_bare_up_to_date(), "{}", next.text);
        assert_eq!(next.offset(), offset, "nothing new: the offset stays");
        last = next;
    }
    last
}
