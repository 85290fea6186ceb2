//! Change records over a real local Redis Cluster (3 masters, `scripts/redis-cluster.sh start`):
//! sharded pub/sub (SSUBSCRIBE/SPUBLISH, NTF-04) across all three shards, isolation between
//! environments, a master killed and restarted, a slot migrated away, classic pub/sub through
//! the cluster, and a whole runfeed server in cluster mode whose held live poll is woken through
//! sharded pub/sub across a restart of the env's shard (needs the local Postgres, like
//! tests/it/feeds_http.rs).
//!
//! They need `RUNFEED_TEST_REDIS_CLUSTER_URL` and fail without it (never pass silently), e.g.
//! `redis-cluster://127.0.0.1:7100?node=127.0.0.1:7101&node=127.0.0.1:7102` as the script prints
//! it (`scripts/test.sh` starts one). The node-restart test drives that script (`restart-node`),
//! so it needs a cluster the script started.
//!
//! The tests run one at a time (they restart nodes and move slots) and use fresh random env ids,
//! picked so that they hash to the shard a test wants. Every wait is bounded.

use crate::common;

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{op, within, FollowedRun, Resp, TestServer};
use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};
use fred::util::redis_keyslot;
use runfeed::changes::{channel_name, ChangeRecord, ChangeSource, SourceEvent};
use runfeed::redis::{
    publish_once, Publisher, RedisChangeSource, RedisOptions, SubscriberSettings,
};
use tokio::time::{sleep, timeout, Instant};

const WAIT: Duration = Duration::from_secs(20);

/// The cluster tests restart nodes and move slots: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The cluster URL; panics when it is not set (the test needs the cluster and never passes
/// without it).
fn cluster_url(test: &str) -> Option<String> {
    match std::env::var("RUNFEED_TEST_REDIS_CLUSTER_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => panic!(
            "{test} needs a Redis Cluster: RUNFEED_TEST_REDIS_CLUSTER_URL is not set \
             (start one with `bash scripts/redis-cluster.sh start`, or run `bash scripts/test.sh`)"
        ),
    }
}

fn sharded(url: &str) -> RedisOptions {
    RedisOptions::cluster(url, true)
}

fn classic(url: &str) -> RedisOptions {
    RedisOptions::cluster(url, false)
}

fn record(env_id: &str, run_id: &str) -> ChangeRecord {
    ChangeRecord {
        v: 1,
        run_id: run_id.into(),
        env_id: env_id.into(),
        tags: Some(vec!["a".into()]),
        batch_id: None,
        updated_at_ms: Some(1_717_750_000_123),
    }
}

/// A plain cluster client for inspecting and steering the cluster.
async fn admin(url: &str) -> Client {
    let config = Config::from_url(url).expect("cluster url");
    let client = Builder::from_config(config)
        .set_policy(ReconnectPolicy::new_constant(0, 100))
        .with_performance_config(|perf| perf.default_command_timeout = Duration::from_secs(5))
        .build()
        .expect("admin client");
    timeout(WAIT, client.init())
        .await
        .expect("admin connect in time")
        .expect("admin connect");
    client
}

/// The slot ranges and their primaries' ports, from `CLUSTER SLOTS`.
async fn slot_owners(admin: &Client) -> Vec<(u16, u16, u16)> {
    let reply: Value = admin
        .custom(
            CustomCommand::new_static("CLUSTER", ClusterHash::Random, false),
            vec!["SLOTS"],
        )
        .await
        .expect("CLUSTER SLOTS");
    let mut out = Vec::new();
    for range in reply.into_array() {
        let fields = range.into_array();
        let start = fields[0].as_u64().expect("start") as u16;
        let end = fields[1].as_u64().expect("end") as u16;
        let node = fields[2].clone().into_array();
        let port = node[1].as_u64().expect("port") as u16;
        out.push((start, end, port));
    }
    out
}

/// The port of the primary owning `env_id`'s channel.
fn owner_port(owners: &[(u16, u16, u16)], env_id: &str) -> u16 {
    let slot = redis_keyslot(channel_name(env_id).as_bytes());
    owners
        .iter()
        .find(|(start, end, _)| *start <= slot && slot <= *end)
        .map(|(_, _, port)| *port)
        .expect("slot covered")
}

/// The primaries' ports, sorted.
fn ports(owners: &[(u16, u16, u16)]) -> Vec<u16> {
    owners
        .iter()
        .map(|(_, _, port)| *port)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// A fresh env id whose channel lives on the primary at `port`.
fn env_on(owners: &[(u16, u16, u16)], port: u16) -> String {
    loop {
        let env_id = format!("env_{}", uuid::Uuid::new_v4().simple());
        if owner_port(owners, &env_id) == port {
            return env_id;
        }
    }
}

/// What every cluster test starts with: the cluster's URL, the serial lock (one test at a time),
/// an admin client, the slot owners and the primaries' ports.
struct Cluster {
    url: String,
    admin: Client,
    owners: Vec<(u16, u16, u16)>,
    ports: Vec<u16>,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

impl Cluster {
    /// `None` (with a note) when the cluster tests are not enabled.
    async fn start(test: &str) -> Option<Cluster> {
        let url = cluster_url(test)?;
        let serial = SERIAL.lock().await;
        init_logs();
        let admin = admin(&url).await;
        let owners = slot_owners(&admin).await;
        let ports = ports(&owners);
        Some(Cluster {
            url,
            admin,
            owners,
            ports,
            _serial: serial,
        })
    }

    /// A fresh env id on each primary, in port order.
    fn env_per_shard(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|port| env_on(&self.owners, *port))
            .collect()
    }

    async fn quit(self) {
        let _ = self.admin.quit().await;
    }

    /// Closes `publisher`, shuts `sources` down, then the admin client.
    async fn finish(self, publisher: Publisher, sources: Vec<RedisChangeSource>) {
        publisher.close().await;
        for source in sources {
            source.shutdown().await;
        }
        self.quit().await;
    }
}

/// Publishes `rec` to its one subscriber and asserts it is the next record on `rx`.
async fn delivered(
    publisher: &Publisher,
    rx: &mut runfeed::changes::EventReceiver,
    rec: ChangeRecord,
    skip_gaps: bool,
) {
    publish_to(publisher, &rec, 1).await;
    let env_id = rec.env_id.to_string();
    assert_eq!(next_record(rx, skip_gaps).await, (env_id, rec));
}

/// Exactly one subscriber of `env_id`'s channel on the node at `port`.
async fn assert_one_subscriber(admin: &Client, port: u16, env_id: &str, what: &str) {
    assert_eq!(shard_subscribers(admin, port, env_id).await, 1, "{what}");
}

/// Subscribes `source` to every env of `envs` and waits until Redis confirmed them all.
async fn subscribe_all(source: &RedisChangeSource, envs: &[String]) {
    for env in envs {
        source.subscribe(&runfeed::protocol::EnvId::from(env));
    }
    let envs: Vec<&str> = envs.iter().map(String::as_str).collect();
    wait_confirmed(source, &envs).await;
}

/// Re-checks `cond` every `every` until it holds, at most [`WAIT`]; panics with `what`.
async fn eventually<F: std::future::Future<Output = bool>>(
    what: &str,
    every: Duration,
    mut cond: impl FnMut() -> F,
) {
    let deadline = Instant::now() + WAIT;
    while !cond().await {
        assert!(Instant::now() < deadline, "{what}");
        sleep(every).await;
    }
}

/// Publishes `rec`; asserts how many subscribers received it.
async fn publish_to(publisher: &Publisher, rec: &ChangeRecord, receivers: u64) {
    assert_eq!(publisher.publish(rec).await.expect("spublish"), receivers);
}

/// Logs to the test output when `RUST_LOG` is set (e.g. `RUST_LOG=runfeed=debug`).
fn init_logs() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

async fn source(options: &RedisOptions) -> (RedisChangeSource, runfeed::changes::EventReceiver) {
    init_logs();
    let (tx, rx) = runfeed::changes::event_channel();
    let source = RedisChangeSource::connect(options, tx, SubscriberSettings::default())
        .await
        .expect("connect subscriber");
    assert!(
        source.is_connected(),
        "subscriber connected to every primary"
    );
    (source, rx)
}

async fn publisher(options: &RedisOptions) -> Publisher {
    Publisher::connect(options)
        .await
        .expect("connect publisher")
}

/// Waits until Redis confirmed the subscription of every env in `envs`.
async fn wait_confirmed(source: &RedisChangeSource, envs: &[&str]) {
    let deadline = Instant::now() + WAIT;
    loop {
        let confirmed = source.confirmed();
        if envs.iter().all(|env| confirmed.iter().any(|c| c == env)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "subscriptions of {envs:?} never confirmed"
        );
        sleep(Duration::from_millis(5)).await;
    }
}

/// The next record, skipping subscription confirmations and (with `skip_gaps`) `Reconnected`.
async fn next_record(
    rx: &mut runfeed::changes::EventReceiver,
    skip_gaps: bool,
) -> (String, ChangeRecord) {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match timeout(left, rx.recv()).await {
            Ok(Some(SourceEvent::Record { env_id, record })) => {
                return (env_id.to_string(), record)
            }
            Ok(Some(SourceEvent::Subscribed { .. })) => continue,
            Ok(Some(SourceEvent::Reconnected)) if skip_gaps => continue,
            Ok(Some(SourceEvent::Reconnected)) => panic!("unexpected Reconnected"),
            Ok(None) => panic!("source closed"),
            Err(_) => panic!("no record within {WAIT:?}"),
        }
    }
}

/// Waits for `Reconnected`, skipping confirmations (and records, which are returned).
async fn wait_reconnected(
    rx: &mut runfeed::changes::EventReceiver,
    within: Duration,
) -> Vec<ChangeRecord> {
    let deadline = Instant::now() + within;
    let mut records = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match timeout(left, rx.recv()).await {
            Ok(Some(SourceEvent::Reconnected)) => return records,
            Ok(Some(SourceEvent::Record { record, .. })) => records.push(record),
            Ok(Some(SourceEvent::Subscribed { .. })) => continue,
            Ok(None) => panic!("source closed"),
            Err(_) => panic!("no Reconnected within {within:?}"),
        }
    }
}

/// Publishes until Redis takes it (a node may still be coming back); returns the receivers.
async fn publish_retrying(publisher: &Publisher, record: &ChangeRecord) -> u64 {
    let deadline = Instant::now() + WAIT;
    loop {
        match publisher.publish(record).await {
            Ok(receivers) => return receivers,
            Err(e) => {
                assert!(Instant::now() < deadline, "publish kept failing: {e}");
                sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// `PUBSUB SHARDNUMSUB <channel>` on the node at `port` (retried while the admin client
/// reconnects after a node restart).
async fn shard_subscribers(admin: &Client, port: u16, env_id: &str) -> i64 {
    let deadline = Instant::now() + WAIT;
    loop {
        let reply: Result<Value, Error> = admin
            .with_cluster_node(Server::new("127.0.0.1", port))
            .custom(
                CustomCommand::new_static("PUBSUB", ClusterHash::Random, false),
                vec!["SHARDNUMSUB".to_owned(), channel_name(env_id)],
            )
            .await;
        match reply {
            Ok(reply) => {
                return reply
                    .into_array()
                    .get(1)
                    .and_then(Value::as_i64)
                    .expect("count")
            }
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "PUBSUB SHARDNUMSUB on {port}: {e}"
                );
                sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Whether the node at `port` has a pub/sub connection named `name`.
async fn has_subscriber_connection(admin: &Client, port: u16, name: &str) -> bool {
    let list: String = admin
        .with_cluster_node(Server::new("127.0.0.1", port))
        .custom(
            CustomCommand::new_static("CLIENT", ClusterHash::Random, false),
            vec!["LIST", "TYPE", "pubsub"],
        )
        .await
        .expect("CLIENT LIST");
    list.lines()
        .any(|line| line.split(' ').any(|f| f == format!("name={name}")))
}

/// NTF-04: envs on each of the three shards are SSUBSCRIBEd on their own shard (one subscriber
/// connection per node) and receive their SPUBLISHed records through the same message stream.
#[tokio::test]
async fn sharded_records_reach_subscribers_on_every_shard() {
    let Some(c) = Cluster::start("sharded_records_reach_subscribers_on_every_shard").await else {
        return;
    };
    assert_eq!(c.ports.len(), 3, "a 3-master cluster: {:?}", c.owners);
    let envs = c.env_per_shard();

    let (source, mut rx) = source(&sharded(&c.url)).await;
    assert!(source.is_sharded());
    let publisher = publisher(&sharded(&c.url)).await;
    assert!(publisher.is_sharded());
    subscribe_all(&source, &envs).await;
    for (env, port) in envs.iter().zip(&c.ports) {
        let what = format!("{env} subscribed on its shard {port}");
        assert_one_subscriber(&c.admin, *port, env, &what).await;
        assert!(
            has_subscriber_connection(&c.admin, *port, source.client_name()).await,
            "a subscriber connection on node {port}"
        );
    }

    let mut expected = BTreeSet::new();
    for (i, env) in envs.iter().enumerate() {
        let rec = record(env, &format!("run_{i}"));
        // One receiver on the env's shard.
        publish_to(&publisher, &rec, 1).await;
        expected.insert((env.clone(), rec.encode()));
    }
    let mut got = BTreeSet::new();
    for _ in 0..envs.len() {
        let (env_id, rec) = next_record(&mut rx, false).await;
        assert_eq!(rec.env_id, env_id);
        got.insert((env_id, rec.encode()));
    }
    assert_eq!(got, expected);
    let received = source.stats().received.load(Ordering::Relaxed);
    assert_eq!(received, 3);

    // publish_once speaks sharded too.
    let once = record(&envs[0], "once");
    let sent = publish_once(&sharded(&c.url), &once).await;
    assert_eq!(sent.expect("publish once"), 1);
    assert_eq!(next_record(&mut rx, false).await, (envs[0].clone(), once));

    c.finish(publisher, vec![source]).await;
}

/// NTF-06 on a cluster: a record for env B never reaches a subscriber of env A only, whether B
/// lives on A's shard or another one (fenced by a record on A).
#[tokio::test]
async fn sharded_record_reaches_only_its_subscribers() {
    let Some(c) = Cluster::start("sharded_record_reaches_only_its_subscribers").await else {
        return;
    };
    let env_a = env_on(&c.owners, c.ports[0]);
    let env_b_same_shard = env_on(&c.owners, c.ports[0]);
    let env_b_other_shard = env_on(&c.owners, c.ports[1]);

    let (source_a, mut rx_a) = source(&sharded(&c.url)).await;
    let (source_b, mut rx_b) = source(&sharded(&c.url)).await;
    let publisher = publisher(&sharded(&c.url)).await;
    subscribe_all(&source_a, std::slice::from_ref(&env_a)).await;
    subscribe_all(&source_b, std::slice::from_ref(&env_b_other_shard)).await;

    publish_to(&publisher, &record(&env_b_same_shard, "b_same"), 0).await;
    let b_other = record(&env_b_other_shard, "b_other");
    publish_to(&publisher, &b_other, 1).await;
    let fence = record(&env_a, "fence");
    publish_to(&publisher, &fence, 1).await;
    assert_eq!(next_record(&mut rx_a, false).await, (env_a.clone(), fence));
    let got = next_record(&mut rx_b, false).await;
    assert_eq!(got, (env_b_other_shard.clone(), b_other));
    // And B's subscriber saw nothing of A: the fence for B comes next.
    let fence_b = record(&env_b_other_shard, "fence_b");
    publisher.publish(&fence_b).await.expect("spublish fence b");
    let got = next_record(&mut rx_b, false).await;
    assert_eq!(got, (env_b_other_shard.clone(), fence_b));

    // Unsubscribe (SUNSUBSCRIBE) stops delivery.
    let a = runfeed::protocol::EnvId::from(&env_a);
    source_a.unsubscribe(&a);
    let every = Duration::from_millis(5);
    eventually("unsubscribe never confirmed", every, || async {
        !source_a.confirmed().contains(&a)
    })
    .await;
    let owner = owner_port(&c.owners, &env_a);
    let what = format!("SUNSUBSCRIBE never reached {owner}");
    eventually(&what, Duration::from_millis(20), || async {
        shard_subscribers(&c.admin, owner, &env_a).await == 0
    })
    .await;
    publish_to(&publisher, &record(&env_a, "after"), 0).await;

    c.finish(publisher, vec![source_a, source_b]).await;
}

/// `scripts/redis-cluster.sh restart-node <port>`: `SHUTDOWN NOSAVE`, start again from its
/// directory (same nodes.conf), wait for cluster_state:ok.
async fn restart_node(base_port: u16, port: u16) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/redis-cluster.sh");
    let output = timeout(
        Duration::from_secs(60),
        tokio::process::Command::new("bash")
            .args([
                script,
                "restart-node",
                &port.to_string(),
                "--base-port",
                &base_port.to_string(),
            ])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("restart-node finished in time")
    .expect("run scripts/redis-cluster.sh");
    assert!(
        output.status.success(),
        "restart-node failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A master killed (`SHUTDOWN NOSAVE`) and restarted with its nodes.conf: the source re-subscribes
/// the channels of that node by itself and announces the gap with `Reconnected`; every shard
/// delivers again.
#[tokio::test]
async fn sharded_subscriptions_come_back_after_node_restart() {
    let Some(c) = Cluster::start("sharded_subscriptions_come_back_after_node_restart").await else {
        return;
    };
    let base_port = c.ports[0];
    let envs = c.env_per_shard();
    let (source, mut rx) = source(&sharded(&c.url)).await;
    let publisher = publisher(&sharded(&c.url)).await;
    subscribe_all(&source, &envs).await;
    delivered(&publisher, &mut rx, record(&envs[1], "before"), false).await;

    // Restart the second master (the script waits for cluster_state:ok again).
    let victim = c.ports[1];
    let started = Instant::now();
    restart_node(base_port, victim).await;
    let stray = wait_reconnected(&mut rx, Duration::from_secs(30)).await;
    assert!(
        stray.is_empty(),
        "nothing was published meanwhile: {stray:?}"
    );
    eprintln!(
        "node {victim} restarted; Reconnected after {:?}",
        started.elapsed()
    );
    assert_one_subscriber(
        &c.admin,
        victim,
        &envs[1],
        "re-subscribed on the restarted node",
    )
    .await;

    for (i, env) in envs.iter().enumerate() {
        let rec = record(env, &format!("after_{i}"));
        assert_eq!(
            publish_retrying(&publisher, &rec).await,
            1,
            "{env} has its subscriber back"
        );
        assert_eq!(next_record(&mut rx, true).await, (env.clone(), rec));
    }
    c.finish(publisher, vec![source]).await;
}

/// `CLUSTER SETSLOT` on every node of the cluster, the owner last (`IMPORTING`/`MIGRATING`,
/// then `NODE`): moves an empty slot from the node at `from` to the node at `to`.
async fn move_slot(admin: &Client, ports: &[u16], slot: u16, from: u16, to: u16) {
    async fn id_of(admin: &Client, port: u16) -> String {
        admin
            .with_cluster_node(Server::new("127.0.0.1", port))
            .custom(
                CustomCommand::new_static("CLUSTER", ClusterHash::Random, false),
                vec!["MYID"],
            )
            .await
            .expect("CLUSTER MYID")
    }
    async fn setslot(admin: &Client, port: u16, args: Vec<String>) {
        let mut all = vec!["SETSLOT".to_owned()];
        all.extend(args);
        let _: String = admin
            .with_cluster_node(Server::new("127.0.0.1", port))
            .custom(
                CustomCommand::new_static("CLUSTER", ClusterHash::Random, false),
                all,
            )
            .await
            .expect("CLUSTER SETSLOT");
    }
    let (from_id, to_id) = (id_of(admin, from).await, id_of(admin, to).await);
    let slot = slot.to_string();
    setslot(admin, to, vec![slot.clone(), "IMPORTING".into(), from_id]).await;
    setslot(
        admin,
        from,
        vec![slot.clone(), "MIGRATING".into(), to_id.clone()],
    )
    .await;
    setslot(admin, to, vec![slot.clone(), "NODE".into(), to_id.clone()]).await;
    setslot(
        admin,
        from,
        vec![slot.clone(), "NODE".into(), to_id.clone()],
    )
    .await;
    for port in ports.iter().filter(|p| **p != from && **p != to) {
        setslot(
            admin,
            *port,
            vec![slot.clone(), "NODE".into(), to_id.clone()],
        )
        .await;
    }
}

/// A slot migration drops our sharded subscription on the old owner (its `sunsubscribe` push is
/// discarded by fred): the periodic shard check notices (the slot's owner changed), re-subscribes
/// on the new owner and announces the gap; records flow again. Then the slot goes away and comes
/// back between two checks: noticed by the subscriber count. The slot is moved back at the end.
#[tokio::test]
async fn sharded_subscription_follows_a_slot_migration() {
    let Some(c) = Cluster::start("sharded_subscription_follows_a_slot_migration").await else {
        return;
    };
    let (admin, ports) = (&c.admin, &c.ports);
    let (from, to) = (ports[0], ports[2]);
    let env_id = env_on(&c.owners, from);
    let other = env_on(&c.owners, ports[1]);
    let slot = redis_keyslot(channel_name(&env_id).as_bytes());

    let (tx, mut rx) = runfeed::changes::event_channel();
    let settings = SubscriberSettings {
        shard_check_interval: Duration::from_millis(500),
        ..SubscriberSettings::default()
    };
    let source = RedisChangeSource::connect(&sharded(&c.url), tx, settings)
        .await
        .expect("connect subscriber");
    let publisher = publisher(&sharded(&c.url)).await;
    subscribe_all(&source, &[env_id.clone(), other.clone()]).await;
    let lost = || source.stats().lost_subscriptions.load(Ordering::Relaxed);

    move_slot(admin, ports, slot, from, to).await;
    let started = Instant::now();
    let stray = wait_reconnected(&mut rx, Duration::from_secs(15)).await;
    assert!(stray.is_empty(), "{stray:?}");
    eprintln!(
        "slot {slot} moved {from} -> {to}; Reconnected after {:?}",
        started.elapsed()
    );
    assert!(lost() >= 1);
    assert_one_subscriber(admin, to, &env_id, "re-subscribed on the new owner").await;

    // The publisher follows the MOVED to the new owner.
    delivered(&publisher, &mut rx, record(&env_id, "moved"), true).await;
    // The env on the untouched shard never lost anything.
    delivered(&publisher, &mut rx, record(&other, "untouched"), true).await;

    // Away and back between two checks: the owner is the same again, but it dropped our
    // subscription when the slot left (PUBSUB SHARDNUMSUB says 0): re-subscribed as well.
    move_slot(admin, ports, slot, to, from).await;
    move_slot(admin, ports, slot, from, to).await;
    let stray = wait_reconnected(&mut rx, Duration::from_secs(15)).await;
    assert!(stray.is_empty(), "{stray:?}");
    assert_one_subscriber(admin, to, &env_id, "re-subscribed after the round trip").await;
    delivered(&publisher, &mut rx, record(&env_id, "round_trip"), true).await;
    assert!(lost() >= 2);

    source.shutdown().await;
    move_slot(admin, ports, slot, to, from).await;
    c.finish(publisher, vec![]).await;
}

/// On a Cluster, replay cursor writes queued together are one command per environment (its
/// keys share the environment's hash tag, so one slot), every cursor readable afterwards.
#[tokio::test]
async fn cursor_writes_on_a_cluster_are_one_command_per_environment() {
    let Some(c) =
        Cluster::start("cursor_writes_on_a_cluster_are_one_command_per_environment").await
    else {
        return;
    };
    let envs = c.env_per_shard();
    let redis = runfeed::redis::Redis::connect(classic(&c.url)).expect("client");
    let store = redis.cursor_store(60_000);
    let stats = store.stats().clone();
    // Until the client knows the cluster's slots, writes fail (and are counted): write one
    // until it is stored.
    eventually(
        "the cluster client never connected",
        Duration::from_millis(100),
        || {
            store.set(&envs[0], "warm", "0_0", "warm".to_string());
            let stored = stats.set_ok.load(Ordering::Relaxed) > 0;
            async move { stored }
        },
    )
    .await;
    let commands_before = redis.command_counts().cursor_write.load(Ordering::Relaxed);
    let (ok_before, errors_before) = (
        stats.set_ok.load(Ordering::Relaxed),
        stats.set_error.load(Ordering::Relaxed),
    );
    // Queued without yielding (this test's runtime has one thread): the writer takes them as
    // one batch.
    for env in &envs {
        for i in 0..10 {
            store.set(env, "h", &format!("{i}_0"), format!("{env}/{i}"));
        }
    }
    let writes = 10 * envs.len() as u64;
    // The writer acknowledges in a task of its own and signals nothing: poll its counter.
    common::wait_until(WAIT, "cursor writes acknowledged", || {
        stats.set_ok.load(Ordering::Relaxed) >= ok_before + writes
    })
    .await;
    assert_eq!(stats.set_error.load(Ordering::Relaxed), errors_before);
    assert_eq!(
        redis.command_counts().cursor_write.load(Ordering::Relaxed) - commands_before,
        envs.len() as u64,
        "one command per environment"
    );
    for env in &envs {
        for i in 0..10 {
            let got = store
                .get(env, "h", &format!("{i}_0"), |v| Some(v.to_string()))
                .await;
            assert_eq!(got, Some(format!("{env}/{i}")));
        }
    }
    c.quit().await;
}

/// Cluster with sharded pub/sub off: classic SUBSCRIBE/PUBLISH through the cluster (classic
/// messages reach every node), for envs on every shard; SPUBLISH does not reach a classic
/// subscriber.
#[tokio::test]
async fn classic_pubsub_over_the_cluster() {
    let Some(c) = Cluster::start("classic_pubsub_over_the_cluster").await else {
        return;
    };
    let envs = c.env_per_shard();
    let (source, mut rx) = source(&classic(&c.url)).await;
    assert!(!source.is_sharded());
    let publisher = publisher(&classic(&c.url)).await;
    assert!(!publisher.is_sharded());
    subscribe_all(&source, &envs).await;

    let sharded_publisher = Publisher::connect(&sharded(&c.url))
        .await
        .expect("sharded publisher");
    publish_to(&sharded_publisher, &record(&envs[0], "sharded"), 0).await;
    for (i, env) in envs.iter().enumerate() {
        let rec = record(env, &format!("classic_{i}"));
        // PUBLISH counts the receivers on the node that took it only: 0 or 1.
        assert!(publisher.publish(&rec).await.expect("publish") <= 1);
        assert_eq!(next_record(&mut rx, false).await, (env.clone(), rec));
    }
    sharded_publisher.close().await;
    c.finish(publisher, vec![source]).await;
}

/// The whole server in cluster + sharded mode (`[redis] cluster = true`): a held live poll on a
/// run feed is woken by an SPUBLISHed change record; then the master owning the env's channel is
/// killed and restarted while another live poll is held, the server's subscription comes back by
/// itself, and the next change record wakes that same held poll promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_poll_woken_over_sharded_pubsub_across_a_node_restart() {
    let Some(c) = Cluster::start("live_poll_woken_over_sharded_pubsub_across_a_node_restart").await
    else {
        return;
    };
    let srv = TestServer::start_with(20_000, |config| {
        config.redis.url = c.url.clone();
        config.redis.cluster = true;
        config.redis.sharded = true;
    })
    .await;
    let publisher = publisher(&sharded(&c.url)).await;
    let FollowedRun {
        env,
        run,
        headers: h,
        url: feed,
        snap,
    } = srv.follow_new_run().await;
    let owner = owner_port(&c.owners, &env.env_id);
    let what = format!("the server never SSUBSCRIBEd on node {owner}");
    let subscribed = || {
        eventually(&what, Duration::from_millis(10), || async {
            shard_subscribers(&c.admin, owner, &env.env_id).await >= 1
        })
    };
    subscribed().await;
    // Woken by the record (published `at`), not by the hold.
    let assert_woken = |r: &Resp, at: Instant| {
        r.assert_status(200);
        assert_eq!(r.ops(), vec![op("update", &run.id)], "{}", r.text);
        let waited = at.elapsed();
        assert!(waited < Duration::from_secs(2), "woken after {waited:?}");
    };

    // A change record wakes the held poll.
    let change = async {
        let ms = srv.set_status(&run.id, "EXECUTING").await;
        let published = Instant::now();
        let rec = TestServer::record(&env, &run.id, &[], None, ms);
        publish_to(&publisher, &rec, 1).await;
        published
    };
    let live = [feed.live_after(&snap)];
    let ([first], published) = srv.polls_during(live, &h, |h| h.0 == 1, change).await;
    assert_woken(&first, published);

    // Hold another poll, restart the env's shard under it, then change the run again.
    let poll = srv.fetch(&feed.live_after(&first), &h);
    let restart_and_change = async {
        srv.wait_held("run feed held again", |held| held.0 == 1)
            .await;
        restart_node(c.ports[0], owner).await;
        subscribed().await;
        let ms = srv.set_status(&run.id, "COMPLETED_SUCCESSFULLY").await;
        let rec = TestServer::record(&env, &run.id, &[], None, ms);
        let published = Instant::now();
        assert_eq!(
            publish_retrying(&publisher, &rec).await,
            1,
            "the server's subscription is back"
        );
        published
    };
    let (second, published) = within(Duration::from_secs(60), "live wake after restart", async {
        tokio::join!(poll, restart_and_change)
    })
    .await;
    assert_woken(&second, published);
    assert_eq!(
        second.row(&run.id).expect("row")["value"]["status"],
        "COMPLETED_SUCCESSFULLY"
    );

    c.finish(publisher, vec![]).await;
}
