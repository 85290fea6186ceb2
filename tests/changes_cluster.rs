//! Change records over a real local Redis Cluster (3 masters, `scripts/redis-cluster.sh start`):
//! sharded pub/sub (SSUBSCRIBE/SPUBLISH, NTF-04) across all three shards, isolation between
//! environments, a master killed and restarted, a slot migrated away, classic pub/sub through
//! the cluster, and a whole runfeed server in cluster mode whose held live poll is woken through
//! sharded pub/sub across a restart of the env's shard (needs the local Postgres, like
//! tests/feeds_http.rs).
//!
//! Skipped (passing, with a note on stderr) unless `RUNFEED_TEST_REDIS_CLUSTER_URL` is set, e.g.
//! `redis-cluster://127.0.0.1:7100?node=127.0.0.1:7101&node=127.0.0.1:7102` as the script prints
//! it (`scripts/test.sh` starts one). The node-restart test drives that script (`restart-node`),
//! so it needs a cluster the script started.
//!
//! The tests run one at a time (they restart nodes and move slots) and use fresh random env ids,
//! picked so that they hash to the shard a test wants. Every wait is bounded.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{modern, within, TestServer, Url};
use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};
use fred::util::redis_keyslot;
use runfeed::changes::{channel_name, ChangeRecord, ChangeSource, SourceEvent};
use runfeed::redis::{
    publish_once, Publisher, RedisChangeSource, RedisOptions, SubscriberSettings,
};
use runfeed_dev::fixtures::RunSpec;
use tokio::sync::mpsc;
use tokio::time::{sleep, timeout, Instant};

const WAIT: Duration = Duration::from_secs(20);

/// The cluster tests restart nodes and move slots: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The cluster URL, or `None` (with a note) when the cluster tests are not enabled.
fn cluster_url(test: &str) -> Option<String> {
    match std::env::var("RUNFEED_TEST_REDIS_CLUSTER_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            eprintln!(
                "skipping {test}: RUNFEED_TEST_REDIS_CLUSTER_URL is not set \
                 (start a cluster with `bash scripts/redis-cluster.sh start`)"
            );
            None
        }
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

/// Logs to the test output when `RUST_LOG` is set (e.g. `RUST_LOG=runfeed=debug`).
fn init_logs() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

async fn source(
    options: &RedisOptions,
) -> (RedisChangeSource, mpsc::UnboundedReceiver<SourceEvent>) {
    init_logs();
    let (tx, rx) = mpsc::unbounded_channel();
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
    rx: &mut mpsc::UnboundedReceiver<SourceEvent>,
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
    rx: &mut mpsc::UnboundedReceiver<SourceEvent>,
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
    let Some(url) = cluster_url("sharded_records_reach_subscribers_on_every_shard") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let admin = admin(&url).await;
    let owners = slot_owners(&admin).await;
    let ports = ports(&owners);
    assert_eq!(ports.len(), 3, "a 3-master cluster: {owners:?}");
    let envs: Vec<String> = ports.iter().map(|port| env_on(&owners, *port)).collect();

    let (source, mut rx) = source(&sharded(&url)).await;
    assert!(source.is_sharded());
    let publisher = publisher(&sharded(&url)).await;
    assert!(publisher.is_sharded());
    for env in &envs {
        source.subscribe(&runfeed::protocol::EnvId::from(env));
    }
    wait_confirmed(
        &source,
        &envs.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    for (env, port) in envs.iter().zip(&ports) {
        assert_eq!(
            shard_subscribers(&admin, *port, env).await,
            1,
            "{env} subscribed on its shard {port}"
        );
        assert!(
            has_subscriber_connection(&admin, *port, source.client_name()).await,
            "a subscriber connection on node {port}"
        );
    }

    let mut expected = BTreeSet::new();
    for (i, env) in envs.iter().enumerate() {
        let rec = record(env, &format!("run_{i}"));
        assert_eq!(
            publisher.publish(&rec).await.expect("spublish"),
            1,
            "one receiver on {env}'s shard"
        );
        expected.insert((env.clone(), rec.encode()));
    }
    let mut got = BTreeSet::new();
    for _ in 0..envs.len() {
        let (env_id, rec) = next_record(&mut rx, false).await;
        assert_eq!(rec.env_id, env_id);
        got.insert((env_id, rec.encode()));
    }
    assert_eq!(got, expected);
    assert_eq!(
        source
            .stats()
            .received
            .load(std::sync::atomic::Ordering::Relaxed),
        3
    );

    // publish_once speaks sharded too.
    let once = record(&envs[0], "once");
    assert_eq!(
        publish_once(&sharded(&url), &once)
            .await
            .expect("publish once"),
        1
    );
    assert_eq!(next_record(&mut rx, false).await, (envs[0].clone(), once));

    publisher.close().await;
    source.shutdown().await;
    let _ = admin.quit().await;
}

/// NTF-06 on a cluster: a record for env B never reaches a subscriber of env A only, whether B
/// lives on A's shard or another one (fenced by a record on A).
#[tokio::test]
async fn sharded_record_reaches_only_its_subscribers() {
    let Some(url) = cluster_url("sharded_record_reaches_only_its_subscribers") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let admin = admin(&url).await;
    let owners = slot_owners(&admin).await;
    let ports = ports(&owners);
    let env_a = env_on(&owners, ports[0]);
    let env_b_same_shard = env_on(&owners, ports[0]);
    let env_b_other_shard = env_on(&owners, ports[1]);

    let (source_a, mut rx_a) = source(&sharded(&url)).await;
    let (source_b, mut rx_b) = source(&sharded(&url)).await;
    let publisher = publisher(&sharded(&url)).await;
    source_a.subscribe(&runfeed::protocol::EnvId::from(&env_a));
    source_b.subscribe(&runfeed::protocol::EnvId::from(&env_b_other_shard));
    wait_confirmed(&source_a, &[&env_a]).await;
    wait_confirmed(&source_b, &[&env_b_other_shard]).await;

    assert_eq!(
        publisher
            .publish(&record(&env_b_same_shard, "b_same"))
            .await
            .expect("spublish"),
        0
    );
    assert_eq!(
        publisher
            .publish(&record(&env_b_other_shard, "b_other"))
            .await
            .expect("spublish"),
        1
    );
    let fence = record(&env_a, "fence");
    assert_eq!(publisher.publish(&fence).await.expect("spublish fence"), 1);
    assert_eq!(next_record(&mut rx_a, false).await, (env_a.clone(), fence));
    assert_eq!(
        next_record(&mut rx_b, false).await,
        (
            env_b_other_shard.clone(),
            record(&env_b_other_shard, "b_other")
        )
    );
    // And B's subscriber saw nothing of A: the fence for B comes next.
    let fence_b = record(&env_b_other_shard, "fence_b");
    publisher.publish(&fence_b).await.expect("spublish fence b");
    assert_eq!(
        next_record(&mut rx_b, false).await,
        (env_b_other_shard.clone(), fence_b)
    );

    // Unsubscribe (SUNSUBSCRIBE) stops delivery.
    source_a.unsubscribe(&runfeed::protocol::EnvId::from(&env_a));
    let deadline = Instant::now() + WAIT;
    while source_a
        .confirmed()
        .contains(&runfeed::protocol::EnvId::from(&env_a))
    {
        assert!(Instant::now() < deadline, "unsubscribe never confirmed");
        sleep(Duration::from_millis(5)).await;
    }
    let owner = owner_port(&owners, &env_a);
    let deadline = Instant::now() + WAIT;
    while shard_subscribers(&admin, owner, &env_a).await != 0 {
        assert!(
            Instant::now() < deadline,
            "SUNSUBSCRIBE never reached {owner}"
        );
        sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        publisher
            .publish(&record(&env_a, "after"))
            .await
            .expect("spublish"),
        0
    );

    publisher.close().await;
    source_a.shutdown().await;
    source_b.shutdown().await;
    let _ = admin.quit().await;
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
    let Some(url) = cluster_url("sharded_subscriptions_come_back_after_node_restart") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let admin = admin(&url).await;
    let owners = slot_owners(&admin).await;
    let ports = ports(&owners);
    let base_port = ports[0];
    let envs: Vec<String> = ports.iter().map(|port| env_on(&owners, *port)).collect();
    let (source, mut rx) = source(&sharded(&url)).await;
    let publisher = publisher(&sharded(&url)).await;
    for env in &envs {
        source.subscribe(&runfeed::protocol::EnvId::from(env));
    }
    wait_confirmed(
        &source,
        &envs.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    let before = record(&envs[1], "before");
    assert_eq!(publisher.publish(&before).await.expect("spublish"), 1);
    assert_eq!(next_record(&mut rx, false).await, (envs[1].clone(), before));

    // Restart the second master (the script waits for cluster_state:ok again).
    let victim = ports[1];
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
    assert_eq!(
        shard_subscribers(&admin, victim, &envs[1]).await,
        1,
        "re-subscribed on the restarted node"
    );

    for (i, env) in envs.iter().enumerate() {
        let rec = record(env, &format!("after_{i}"));
        assert_eq!(
            publish_retrying(&publisher, &rec).await,
            1,
            "{env} has its subscriber back"
        );
        assert_eq!(next_record(&mut rx, true).await, (env.clone(), rec));
    }
    publisher.close().await;
    source.shutdown().await;
    let _ = admin.quit().await;
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
    let Some(url) = cluster_url("sharded_subscription_follows_a_slot_migration") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let admin = admin(&url).await;
    let owners = slot_owners(&admin).await;
    let ports = ports(&owners);
    let (from, to) = (ports[0], ports[2]);
    let env_id = env_on(&owners, from);
    let other = env_on(&owners, ports[1]);
    let slot = redis_keyslot(channel_name(&env_id).as_bytes());

    init_logs();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let settings = SubscriberSettings {
        shard_check_interval: Duration::from_millis(500),
        ..SubscriberSettings::default()
    };
    let source = RedisChangeSource::connect(&sharded(&url), tx, settings)
        .await
        .expect("connect subscriber");
    let publisher = publisher(&sharded(&url)).await;
    source.subscribe(&runfeed::protocol::EnvId::from(&env_id));
    source.subscribe(&runfeed::protocol::EnvId::from(&other));
    wait_confirmed(&source, &[&env_id, &other]).await;

    move_slot(&admin, &ports, slot, from, to).await;
    let started = Instant::now();
    let stray = wait_reconnected(&mut rx, Duration::from_secs(15)).await;
    assert!(stray.is_empty(), "{stray:?}");
    eprintln!(
        "slot {slot} moved {from} -> {to}; Reconnected after {:?}",
        started.elapsed()
    );
    assert!(
        source
            .stats()
            .lost_subscriptions
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    assert_eq!(
        shard_subscribers(&admin, to, &env_id).await,
        1,
        "re-subscribed on the new owner"
    );

    // The publisher follows the MOVED to the new owner.
    let moved = record(&env_id, "moved");
    assert_eq!(
        publisher
            .publish(&moved)
            .await
            .expect("spublish after the move"),
        1
    );
    assert_eq!(next_record(&mut rx, true).await, (env_id.clone(), moved));
    // The env on the untouched shard never lost anything.
    let untouched = record(&other, "untouched");
    assert_eq!(publisher.publish(&untouched).await.expect("spublish"), 1);
    assert_eq!(next_record(&mut rx, true).await, (other.clone(), untouched));

    // Away and back between two checks: the owner is the same again, but it dropped our
    // subscription when the slot left (PUBSUB SHARDNUMSUB says 0): re-subscribed as well.
    move_slot(&admin, &ports, slot, to, from).await;
    move_slot(&admin, &ports, slot, from, to).await;
    let stray = wait_reconnected(&mut rx, Duration::from_secs(15)).await;
    assert!(stray.is_empty(), "{stray:?}");
    assert_eq!(
        shard_subscribers(&admin, to, &env_id).await,
        1,
        "re-subscribed after the round trip"
    );
    let back = record(&env_id, "round_trip");
    assert_eq!(
        publisher
            .publish(&back)
            .await
            .expect("spublish after the round trip"),
        1
    );
    assert_eq!(next_record(&mut rx, true).await, (env_id.clone(), back));
    assert!(
        source
            .stats()
            .lost_subscriptions
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2
    );

    source.shutdown().await;
    move_slot(&admin, &ports, slot, to, from).await;
    publisher.close().await;
    let _ = admin.quit().await;
}

/// Cluster with sharded pub/sub off: classic SUBSCRIBE/PUBLISH through the cluster (classic
/// messages reach every node), for envs on every shard; SPUBLISH does not reach a classic
/// subscriber.
#[tokio::test]
async fn classic_pubsub_over_the_cluster() {
    let Some(url) = cluster_url("classic_pubsub_over_the_cluster") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let admin = admin(&url).await;
    let owners = slot_owners(&admin).await;
    let envs: Vec<String> = ports(&owners)
        .iter()
        .map(|port| env_on(&owners, *port))
        .collect();
    let (source, mut rx) = source(&classic(&url)).await;
    assert!(!source.is_sharded());
    let publisher = publisher(&classic(&url)).await;
    assert!(!publisher.is_sharded());
    for env in &envs {
        source.subscribe(&runfeed::protocol::EnvId::from(env));
    }
    wait_confirmed(
        &source,
        &envs.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;

    let sharded_publisher = Publisher::connect(&sharded(&url))
        .await
        .expect("sharded publisher");
    assert_eq!(
        sharded_publisher
            .publish(&record(&envs[0], "sharded"))
            .await
            .expect("spublish"),
        0
    );
    for (i, env) in envs.iter().enumerate() {
        let rec = record(env, &format!("classic_{i}"));
        // PUBLISH counts the receivers on the node that took it only: 0 or 1.
        assert!(publisher.publish(&rec).await.expect("publish") <= 1);
        assert_eq!(next_record(&mut rx, false).await, (env.clone(), rec));
    }
    sharded_publisher.close().await;
    publisher.close().await;
    source.shutdown().await;
    let _ = admin.quit().await;
}

/// The whole server in cluster + sharded mode (`[redis] cluster = true`): a held live poll on a
/// run feed is woken by an SPUBLISHed change record; then the master owning the env's channel is
/// killed and restarted while another live poll is held, the server's subscription comes back by
/// itself, and the next change record wakes that same held poll promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_poll_woken_over_sharded_pubsub_across_a_node_restart() {
    let Some(url) = cluster_url("live_poll_woken_over_sharded_pubsub_across_a_node_restart") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    init_logs();
    let admin = admin(&url).await;
    let owners = slot_owners(&admin).await;
    let srv = TestServer::start_with(20_000, |c| {
        c.redis.url = url.clone();
        c.redis.cluster = true;
        c.redis.sharded = true;
    })
    .await;
    let publisher = publisher(&sharded(&url)).await;
    let env = srv.env().await;
    let owner = owner_port(&owners, &env.env_id);
    let run = srv.run(&env, RunSpec::default()).await;
    let h = modern(&srv.token(&env, &["read:runs"]));
    let feed = Url::new(&format!("/realtime/v1/runs/{}", run.friendly_id));
    let snap = srv.fetch(&feed.snapshot(), &h).await;
    snap.assert_status(200);
    let subscribed = || async {
        let deadline = Instant::now() + WAIT;
        while shard_subscribers(&admin, owner, &env.env_id).await < 1 {
            assert!(
                Instant::now() < deadline,
                "the server never SSUBSCRIBEd on node {owner}"
            );
            sleep(Duration::from_millis(10)).await;
        }
    };
    subscribed().await;

    // A change record wakes the held poll.
    let poll = srv.fetch(
        &feed.live(&snap.handle(), &snap.offset(), snap.cursor().as_deref()),
        &h,
    );
    let change = async {
        srv.wait_held("run feed held", |held| held.0 == 1).await;
        let ms = srv.set_status(&run.id, "EXECUTING").await;
        let published = Instant::now();
        let rec = TestServer::record(&env, &run.id, &[], None, ms);
        assert_eq!(publisher.publish(&rec).await.expect("spublish"), 1);
        published
    };
    let (first, published) = within(WAIT, "live wake", async { tokio::join!(poll, change) }).await;
    first.assert_status(200);
    assert_eq!(
        first.ops(),
        vec![("update".to_owned(), run.id.clone())],
        "{}",
        first.text
    );
    assert!(
        published.elapsed() < Duration::from_secs(2),
        "woken by the record, not the hold"
    );

    // Hold another poll, restart the env's shard under it, then change the run again.
    let poll = srv.fetch(
        &feed.live(&first.handle(), &first.offset(), first.cursor().as_deref()),
        &h,
    );
    let restart_and_change = async {
        srv.wait_held("run feed held again", |held| held.0 == 1)
            .await;
        restart_node(ports(&owners)[0], owner).await;
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
    second.assert_status(200);
    assert_eq!(
        second.ops(),
        vec![("update".to_owned(), run.id.clone())],
        "{}",
        second.text
    );
    assert_eq!(
        second.row(&run.id).expect("row")["value"]["status"],
        "COMPLETED_SUCCESSFULLY"
    );
    assert!(
        published.elapsed() < Duration::from_secs(2),
        "woken by the record, not the hold"
    );

    publisher.close().await;
    let _ = admin.quit().await;
}
