//! Change records over a real Redis (127.0.0.1:6379): publish like the webapp, receive through
//! `RedisChangeSource` (NTF-05, NTF-06, NTF-13..15 on the wire, unsubscribe, reconnect).
//!
//! Every test uses fresh random env ids, so tests (and other suites on the same Redis) never
//! see each other's records. Every receive is bounded by a timeout.

use crate::common;

use std::time::Duration;

use common::{free_port, redis_server};
use fred::prelude::*;
use fred::types::CustomCommand;
use runfeed::changes::{channel_name, ChangeRecord, ChangeSource, SourceEvent};
use runfeed::protocol::{EnvId, OrgId};
use runfeed::redis::{
    publish_once, Publisher, RedisChangeSource, RedisOptions, SubscriberSettings,
};

fn standalone(url: &str) -> RedisOptions {
    RedisOptions::standalone(url)
}
use tokio::time::{sleep, timeout, Instant};

const REDIS_URL: &str = "redis://127.0.0.1:6379";
const WAIT: Duration = Duration::from_secs(10);

fn env() -> String {
    format!("env_{}", uuid::Uuid::new_v4().simple())
}

fn full_record(env_id: &str, run_id: &str) -> ChangeRecord {
    ChangeRecord {
        v: 1,
        run_id: run_id.into(),
        env_id: env_id.into(),
        tags: Some(vec!["a".into(), "with,comma".into()]),
        batch_id: Some("batch_1".into()),
        updated_at_ms: Some(1_717_750_000_123),
    }
}

async fn source() -> (RedisChangeSource, runfeed::changes::EventReceiver) {
    let (tx, rx) = runfeed::changes::event_channel();
    let source =
        RedisChangeSource::connect(&standalone(REDIS_URL), tx, SubscriberSettings::default())
            .await
            .expect("connect subscriber");
    assert!(source.is_connected());
    (source, rx)
}

async fn publisher() -> Publisher {
    Publisher::connect(&standalone(REDIS_URL))
        .await
        .expect("connect publisher")
}

/// Waits until Redis confirmed exactly the wanted subscription state of `env_id`.
async fn wait_confirmed(source: &RedisChangeSource, env_id: &str, subscribed: bool) {
    let deadline = Instant::now() + WAIT;
    while source.confirmed().iter().any(|e| e == env_id) != subscribed {
        assert!(
            Instant::now() < deadline,
            "subscription of {env_id} never became {subscribed}"
        );
        sleep(Duration::from_millis(5)).await;
    }
}

/// A fresh env id `source` is subscribed to, confirmed by Redis.
async fn subscribed_env(source: &RedisChangeSource) -> String {
    let env_id = env();
    subscribe_confirmed(source, &env_id).await;
    env_id
}

/// Subscribes `source` to `env_id` and waits until Redis confirmed it.
async fn subscribe_confirmed(source: &RedisChangeSource, env_id: &str) {
    source.subscribe(&runfeed::protocol::EnvId::from(env_id));
    wait_confirmed(source, env_id, true).await;
}

/// Asserts that the next event is `record`, received on `env_id`'s channel.
async fn expect_record(
    rx: &mut runfeed::changes::EventReceiver,
    env_id: &str,
    record: ChangeRecord,
) {
    let env_id = env_id.into();
    assert_eq!(next_event(rx).await, SourceEvent::Record { env_id, record });
}

/// Publishes `record` on a subscribed channel: exactly one receiver (ours), and it is the next
/// event (so nothing published before it on other channels was delivered).
async fn delivered(
    publisher: &Publisher,
    rx: &mut runfeed::changes::EventReceiver,
    record: ChangeRecord,
) {
    publish_to(publisher, &record, 1).await;
    let env_id = record.env_id.to_string();
    expect_record(rx, &env_id, record).await;
}

/// The change source and a publisher on the shared Redis.
async fn connected() -> (
    RedisChangeSource,
    runfeed::changes::EventReceiver,
    Publisher,
) {
    let (source, rx) = source().await;
    (source, rx, publisher().await)
}

/// Publishes `record`; asserts how many subscribers received it.
async fn publish_to(publisher: &Publisher, record: &ChangeRecord, receivers: u64) {
    assert_eq!(publisher.publish(record).await.expect("publish"), receivers);
}

/// The next event other than a subscription confirmation (those are checked with
/// `wait_confirmed`).
async fn next_event(rx: &mut runfeed::changes::EventReceiver) -> SourceEvent {
    loop {
        match timeout(WAIT, rx.recv()).await {
            Ok(Some(SourceEvent::Subscribed { .. })) => continue,
            Ok(Some(event)) => return event,
            Ok(None) => panic!("source closed"),
            Err(_) => panic!("no event within {WAIT:?}"),
        }
    }
}

/// NTF-05: a subscriber on an env receives a published record with tags and batchId intact.
#[tokio::test]
async fn ntf05_record_with_tags_and_batch_delivered() {
    let (source, mut rx, publisher) = connected().await;
    let env_id = subscribed_env(&source).await;

    delivered(&publisher, &mut rx, full_record(&env_id, "run_1")).await;

    // A lifecycle-bus record: full, `batchId: null`, no watermark.
    let record = ChangeRecord {
        batch_id: None,
        updated_at_ms: None,
        tags: Some(vec![]),
        ..full_record(&env_id, "r2")
    };
    delivered(&publisher, &mut rx, record).await;
}

/// NTF-06: a record for another env is not delivered (fenced by a record on the subscribed env).
#[tokio::test]
async fn ntf06_other_env_not_delivered() {
    let (source, mut rx, publisher) = connected().await;
    let (env_a, env_b) = (env(), env());
    subscribe_confirmed(&source, &env_a).await;

    publish_to(&publisher, &full_record(&env_b, "run_b"), 0).await;
    delivered(&publisher, &mut rx, full_record(&env_a, "fence")).await;
}

/// PUBLISH returns the receiver count: 0 without a subscriber, 1 with ours.
#[tokio::test]
async fn publish_returns_receiver_count() {
    let (source, _rx) = source().await;
    let env_id = env();
    let record = full_record(&env_id, "run_1");
    for (subscribed, receivers) in [(false, 0), (true, 1)] {
        if subscribed {
            subscribe_confirmed(&source, &env_id).await;
        }
        let sent = publish_once(&standalone(REDIS_URL), &record).await;
        assert_eq!(sent.expect("publish"), receivers);
    }
}

/// NTF-14/15 on the wire: a bare string (and invalid JSON) published raw decodes as a partial
/// record; the env id comes from the channel.
#[tokio::test]
async fn bare_string_message_decodes_as_partial() {
    let (source, mut rx) = source().await;
    let env_id = subscribed_env(&source).await;

    // A separate plain fred client issuing the raw PUBLISH, as any other producer would.
    let raw = plain_client().await;
    for payload in ["run_bare", "{\"runId\":"] {
        let receivers: i64 = raw
            .publish(channel_name(&env_id), payload)
            .await
            .expect("publish");
        assert_eq!(receivers, 1);
        let expected = ChangeRecord {
            v: 0,
            run_id: payload.into(),
            ..ChangeRecord::default()
        };
        expect_record(&mut rx, &env_id, expected).await;
    }
    let _ = raw.quit().await;
}

/// After `unsubscribe`, records of that env stop (fenced by a record on a still-subscribed env);
/// subscribe/unsubscribe are idempotent.
#[tokio::test]
async fn unsubscribe_stops_delivery() {
    let (source, mut rx, publisher) = connected().await;
    let (env_a, env_b) = (env(), env());
    source.subscribe(&runfeed::protocol::EnvId::from(&env_a));
    subscribe_confirmed(&source, &env_a).await;
    subscribe_confirmed(&source, &env_b).await;
    delivered(&publisher, &mut rx, full_record(&env_a, "before")).await;

    source.unsubscribe(&runfeed::protocol::EnvId::from(&env_a));
    source.unsubscribe(&runfeed::protocol::EnvId::from(&env_a));
    assert_eq!(source.subscribed(), vec![env_b.clone()]);
    wait_confirmed(&source, &env_a, false).await;
    publish_to(&publisher, &full_record(&env_a, "after"), 0).await;
    delivered(&publisher, &mut rx, full_record(&env_b, "fence")).await;
}

/// Subscribe then unsubscribe before the reconciler runs: nothing stays subscribed.
#[tokio::test]
async fn subscribe_unsubscribe_burst_converges() {
    let (source, _rx, publisher) = connected().await;
    let env_id = env();
    for _ in 0..10 {
        source.subscribe(&runfeed::protocol::EnvId::from(&env_id));
        source.unsubscribe(&runfeed::protocol::EnvId::from(&env_id));
    }
    let other = env();
    subscribe_confirmed(&source, &other).await;
    assert!(source.confirmed().iter().all(|e| e != &env_id));
    publish_to(&publisher, &full_record(&env_id, "x"), 0).await;
}

/// A plain fred client of the shared Redis, connected.
async fn plain_client() -> Client {
    let client = Builder::from_config(Config::from_url(REDIS_URL).expect("url"))
        .build()
        .expect("client");
    client.init().await.expect("connect");
    client
}

/// The subscriber connection's id in `CLIENT LIST`, found by its name.
async fn client_id_by_name(admin: &Client, name: &str) -> Option<String> {
    let list: String = admin
        .custom(
            CustomCommand::new_static("CLIENT", None, false),
            vec!["LIST", "TYPE", "pubsub"],
        )
        .await
        .expect("CLIENT LIST");
    list.lines().find_map(|line| {
        let mut fields = line.split(' ');
        let id = fields.next()?.strip_prefix("id=")?.to_owned();
        line.split(' ')
            .any(|f| f == format!("name={name}"))
            .then_some(id)
    })
}

/// A killed subscriber connection reconnects, reports `Reconnected` (only after re-subscribing,
/// not for the first connect), and the subscription works again.
#[tokio::test]
async fn reconnected_after_client_kill() {
    let (source, mut rx, publisher) = connected().await;
    let env_id = subscribed_env(&source).await;
    // No event for the initial connection.
    delivered(&publisher, &mut rx, full_record(&env_id, "first")).await;

    // Kill only our subscriber connection (by id, found by its CLIENT SETNAME), so other
    // suites' pub/sub clients on this Redis are unaffected, unlike `CLIENT KILL TYPE pubsub`.
    let admin = plain_client().await;
    let id = client_id_by_name(&admin, source.client_name())
        .await
        .expect("subscriber in CLIENT LIST");
    let killed: i64 = admin
        .custom(
            CustomCommand::new_static("CLIENT", None, false),
            vec!["KILL", "ID", id.as_str()],
        )
        .await
        .expect("CLIENT KILL");
    assert_eq!(killed, 1);

    // The next event is the announcement: nothing else was published meanwhile.
    assert_eq!(next_event(&mut rx).await, SourceEvent::Reconnected);
    // Re-subscribed before the announcement: a publish right away is delivered.
    assert!(source
        .confirmed()
        .contains(&runfeed::protocol::EnvId::from(&env_id)));
    delivered(&publisher, &mut rx, full_record(&env_id, "after")).await;
    let new_id = client_id_by_name(&admin, source.client_name())
        .await
        .expect("reconnected subscriber");
    assert_ne!(new_id, id);
    let _ = admin.quit().await;
    source.shutdown().await;
}

/// With nothing listening, `connect` returns after its bounded wait (fred keeps connecting in
/// the background) and `subscribe` does not block; the publisher fails instead.
#[tokio::test]
async fn unreachable_redis_does_not_hang() {
    let url = format!("redis://127.0.0.1:{}", free_port());
    let (tx, _rx) = runfeed::changes::event_channel();
    let started = Instant::now();
    let options = standalone(&url);
    let (source, publisher) = tokio::join!(
        timeout(
            Duration::from_secs(15),
            RedisChangeSource::connect(&options, tx, SubscriberSettings::default())
        ),
        timeout(Duration::from_secs(15), Publisher::connect(&options)),
    );
    let source = source
        .expect("connect returned")
        .expect("connect is Ok while Redis is down");
    assert!(publisher.expect("publisher returned").is_err());
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(!source.is_connected());
    source.subscribe(&runfeed::protocol::EnvId::from("env_x"));
    assert_eq!(source.subscribed(), vec!["env_x".to_string()]);
    assert!(source.confirmed().is_empty());
    source.shutdown().await;
}

/// A `redis-server` child on a private port, killed on drop.
struct RedisServer(std::process::Child);

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Redis comes up after `connect` returned: the source connects in the background, subscribes
/// what was asked meanwhile, announces the gap with `Reconnected`, then delivers.
#[tokio::test]
async fn late_redis_is_connected_in_background() {
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let (tx, mut rx) = runfeed::changes::event_channel();
    let source = RedisChangeSource::connect(
        &standalone(&url),
        tx,
        SubscriberSettings {
            initial_wait: Duration::from_millis(100),
            ..SubscriberSettings::default()
        },
    )
    .await
    .expect("connect is Ok while Redis is down");
    let env_id = env();
    source.subscribe(&runfeed::protocol::EnvId::from(&env_id));

    let _server = RedisServer(redis_server(port).spawn().expect("spawn redis-server"));
    assert_eq!(next_event(&mut rx).await, SourceEvent::Reconnected);
    assert!(source
        .confirmed()
        .contains(&runfeed::protocol::EnvId::from(&env_id)));
    let publisher = Publisher::connect(&standalone(&url))
        .await
        .expect("publisher");
    delivered(&publisher, &mut rx, full_record(&env_id, "late")).await;
    publisher.close().await;
    source.shutdown().await;
}

/// The concurrency script is sent by its SHA-1; when Redis no longer has it (a restarted or new
/// node, `SCRIPT FLUSH`), it is loaded again, and admission keeps counting in Redis.
#[tokio::test]
async fn the_concurrency_script_is_loaded_again_when_redis_forgot_it() {
    let redis = runfeed::redis::Redis::connect(standalone(REDIS_URL)).expect("client");
    let script = redis.concurrency();
    let env_id = env();
    let admin = Client::new(Config::from_url(REDIS_URL).expect("url"), None, None, None);
    admin.init().await.expect("admin connect");
    let _: () = admin
        .custom(
            CustomCommand::new_static("SCRIPT", None, false),
            vec!["FLUSH"],
        )
        .await
        .expect("SCRIPT FLUSH");
    let now = runfeed::clock::now_ms();
    let first = timeout(WAIT, script.admit(&env_id, "a", 1, now)).await;
    assert!(
        matches!(first, Ok(Ok(true))),
        "admitted after a flush: {first:?}"
    );
    let second = timeout(WAIT, script.admit(&env_id, "b", 1, now)).await;
    assert!(
        matches!(second, Ok(Ok(false))),
        "the limit of 1 still holds: {second:?}"
    );
    let key = format!("{}{env_id}", runfeed::redis::limit::KEY_PREFIX);
    let members: Vec<String> = admin
        .zrange(&key, 0, -1, None, false, None, false)
        .await
        .expect("zrange");
    assert_eq!(members, vec!["a".to_string()]);
    let _: i64 = admin.del(&key).await.expect("del");
    admin.quit().await.expect("quit");
}

/// A `redis-server` of the test's own (killed when dropped), its URL, and a connected client.
async fn own_redis() -> (RedisServer, String, Client) {
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let server = RedisServer(redis_server(port).spawn().expect("spawn redis-server"));
    let admin = Client::new(Config::from_url(&url).expect("url"), None, None, None);
    timeout(WAIT, async {
        while admin.init().await.is_err() {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("redis-server up");
    (server, url, admin)
}

/// One change can end thousands of live polls of one environment at once: their concurrency
/// slots are released in a burst, and the burst reaches Redis as a pipeline with one `ZREM` per
/// environment, not one command per poll (BENCHMARKS.md "Fan-out"). Every slot is freed.
#[tokio::test]
async fn a_burst_of_slot_releases_frees_every_slot_in_a_few_commands() {
    let (_server, url, admin) = own_redis().await;
    let redis = runfeed::redis::Redis::connect(standalone(&url)).expect("client");
    let script = redis.concurrency();
    let env_id = env();
    let now = runfeed::clock::now_ms();
    const POLLS: usize = 300;
    for i in 0..POLLS {
        let admitted = timeout(WAIT, script.admit(&env_id, &format!("poll{i}"), 1000, now)).await;
        assert!(matches!(admitted, Ok(Ok(true))), "poll {i}: {admitted:?}");
    }
    let zrem_calls = |info: String| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_zrem:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let info = |admin: Client| async move {
        admin
            .custom::<String, _>(
                CustomCommand::new_static("INFO", None, false),
                vec!["commandstats"],
            )
            .await
            .expect("INFO commandstats")
    };
    let before = zrem_calls(info(admin.clone()).await);
    for i in 0..POLLS {
        script.release(&env_id, format!("poll{i}"));
    }
    let key = format!("{}{env_id}", runfeed::redis::limit::KEY_PREFIX);
    let deadline = Instant::now() + WAIT;
    loop {
        let left: u64 = admin.zcard(&key).await.expect("zcard");
        if left == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{left} slots still taken");
        sleep(Duration::from_millis(5)).await;
    }
    let commands = zrem_calls(info(admin.clone()).await) - before;
    assert!(
        (1..=3).contains(&commands),
        "{POLLS} releases took {commands} ZREM commands"
    );
    admin.quit().await.expect("quit");
}

/// A live poll's admission can be abandoned while Redis is still to run it: the client goes away
/// (the request future is dropped), or Redis answers after the 250 ms deadline (the poll is
/// then counted locally). Either way the member the script adds when it does run must be
/// removed again, not left to the 300 s sweep: found by a fresh-clone trial, where 500 aborted
/// live polls left 579 members and a later legitimate poll got a 429.
///
/// Redis is paused (`CLIENT PAUSE`) so the script is sent but not yet run when the admission is
/// abandoned. A second poll at a limit of 1 then proves the slot came free: it goes to Redis on
/// the same connection after the abandoned script, so it cannot be admitted before that ran.
#[tokio::test]
async fn a_live_poll_abandoned_while_redis_admits_it_leaves_no_slot_behind() {
    use runfeed::feeds::admit::{Limiter, LimiterConfig};
    let (_server, url, admin) = own_redis().await;
    let redis = runfeed::redis::Redis::connect(standalone(&url)).expect("client");
    let cfg = LimiterConfig {
        default_limit: 1,
        ..LimiterConfig::default()
    };
    let limiter = Limiter::new(Some(redis.concurrency()), cfg);
    let pause = |ms: u64| {
        let admin = admin.clone();
        async move {
            let _: () = admin
                .custom(
                    CustomCommand::new_static("CLIENT", None, false),
                    vec!["PAUSE".to_string(), ms.to_string(), "ALL".to_string()],
                )
                .await
                .expect("CLIENT PAUSE");
        }
    };
    let env_id = env();
    let script = redis.concurrency();
    let key = format!("{}{env_id}", runfeed::redis::limit::KEY_PREFIX);
    // The one slot is free in Redis: a probe member is admitted at a limit of 1 (then removed).
    let slot_comes_free = |what: &'static str| {
        let (script, env_id, admin, key) = (&script, &env_id, &admin, &key);
        async move {
            let deadline = Instant::now() + WAIT;
            loop {
                let now = runfeed::clock::now_ms();
                let probe = timeout(WAIT, script.admit(env_id, "probe", 1, now)).await;
                if matches!(probe, Ok(Ok(true))) {
                    let _: i64 = admin.zrem(key, "probe").await.expect("zrem probe");
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "{what}: the slot never came free ({probe:?})"
                );
                sleep(Duration::from_millis(20)).await;
            }
        }
    };

    // The script is loaded (an abandoned first `EVALSHA` would only get `NOSCRIPT`).
    slot_comes_free("warm-up").await;

    // 1. The client goes away while the script waits in Redis.
    pause(300).await;
    let abandoned = timeout(
        Duration::from_millis(50),
        limiter.acquire(&EnvId::new(&env_id), &OrgId::new("org")),
    )
    .await;
    assert!(
        abandoned.is_err(),
        "the admission was still waiting for Redis"
    );
    slot_comes_free("client gone").await;

    // 2. Redis answers after the deadline: the poll is counted locally, and the member the
    //    script adds later is removed again.
    pause(400).await;
    let local = limiter
        .acquire(&EnvId::new(&env_id), &OrgId::new("org"))
        .await;
    assert!(local.is_some(), "admitted locally after the deadline");
    slot_comes_free("deadline passed").await;
    drop(local);
    admin.quit().await.expect("quit");
}

/// Leased concurrency slots (`feeds.concurrency_lease_slots`, docs/operations.md "Concurrency
/// limit"), two instances on one environment's sorted set: the fleet never admits past the
/// limit; an instance refuses at most the other instances' unused blocks early; polls that end
/// and come back cost no Redis call; trimmed and returned slots free the set for the other
/// instance.
#[tokio::test]
async fn leased_slots_never_admit_past_the_limit_and_refuse_at_most_a_block_early() {
    use runfeed::feeds::admit::{Limiter, LimiterConfig, IDLE_RETURN};
    const LIMIT: u64 = 64;
    let redis = runfeed::redis::Redis::connect(standalone(REDIS_URL)).expect("client");
    let admin = Client::new(Config::from_url(REDIS_URL).expect("url"), None, None, None);
    admin.init().await.expect("admin connect");
    let cfg = LimiterConfig {
        default_limit: LIMIT,
        lease_slots: 4,
        ..LimiterConfig::default()
    };
    let (a, b) = (
        Limiter::new(Some(redis.concurrency()), cfg.clone()),
        Limiter::new(Some(redis.concurrency()), cfg),
    );
    let block = a.lease_block(LIMIT) as usize;
    assert_eq!(block, 4);
    let env_id = env();
    let key = format!("{}{env_id}", runfeed::redis::limit::KEY_PREFIX);
    let zcard = || {
        let (admin, key) = (admin.clone(), key.clone());
        async move { admin.zcard::<u64, _>(&key).await.expect("zcard") }
    };

    // Instance A takes 30 polls; instance B takes polls until it is refused.
    let mut on_a = Vec::new();
    for _ in 0..30 {
        on_a.push(
            a.acquire(&EnvId::new(&env_id), &OrgId::new("org"))
                .await
                .expect("a admits below the limit"),
        );
    }
    let mut on_b = Vec::new();
    while let Some(slot) = b.acquire(&EnvId::new(&env_id), &OrgId::new("org")).await {
        on_b.push(slot);
        assert!(
            on_a.len() + on_b.len() <= LIMIT as usize,
            "admitted past the limit"
        );
    }
    let admitted = on_a.len() + on_b.len();
    println!("admitted {admitted} of {LIMIT} over two instances (block {block})");
    assert!(
        admitted >= LIMIT as usize - block,
        "refused {} early; at most A's unused block ({block}) may be",
        LIMIT as usize - admitted
    );
    assert!(
        zcard().await <= LIMIT,
        "the set never holds more than the limit"
    );
    assert!(
        a.acquire(&EnvId::new(&env_id), &OrgId::new("org"))
            .await
            .is_some()
            || admitted == LIMIT as usize
    );

    // A poll that ends and comes back reuses the instance's lease: no Redis call.
    let calls = b
        .stats
        .script_calls
        .load(std::sync::atomic::Ordering::Relaxed);
    for _ in 0..100 {
        drop(on_b.pop());
        on_b.push(
            b.acquire(&EnvId::new(&env_id), &OrgId::new("org"))
                .await
                .expect("the freed slot is taken again"),
        );
    }
    assert_eq!(
        b.stats
            .script_calls
            .load(std::sync::atomic::Ordering::Relaxed),
        calls,
        "re-polls on a lease cost no Redis call"
    );

    // A's polls end: the trim keeps one block, an idle environment none; B gets the rest.
    let a_leased = a.leased_slots();
    on_a.clear();
    a.trim(tokio::time::Instant::now());
    assert_eq!(
        a.leased_slots(),
        block,
        "A keeps one unused block ({a_leased} leased before)"
    );
    a.trim(tokio::time::Instant::now() + IDLE_RETURN);
    assert_eq!(
        a.leased_slots(),
        0,
        "an idle environment returns everything"
    );
    let deadline = Instant::now() + WAIT;
    while zcard().await > b.leased_slots() as u64 {
        assert!(Instant::now() < deadline, "A's slots never left the set");
        sleep(Duration::from_millis(10)).await;
    }
    while let Some(slot) = b.acquire(&EnvId::new(&env_id), &OrgId::new("org")).await {
        on_b.push(slot);
    }
    assert_eq!(
        on_b.len(),
        LIMIT as usize,
        "B reaches the limit once A gave its slots back"
    );

    // Shutdown returns every slot.
    on_b.clear();
    b.return_all();
    while zcard().await > 0 {
        assert!(Instant::now() < deadline, "slots left behind at shutdown");
        sleep(Duration::from_millis(10)).await;
    }
    admin.quit().await.expect("quit");
}

/// A delivery to N feeds writes N replay cursors at once: on a standalone server they reach
/// Redis as ONE command (`SET_MANY`), whatever their environments, every cursor readable
/// afterwards (on a Cluster, one command per environment: `changes_cluster.rs`).
#[tokio::test]
async fn cursor_writes_queued_together_are_one_command_on_a_standalone_server() {
    let redis = runfeed::redis::Redis::connect(standalone(REDIS_URL)).expect("client");
    let store = redis.cursor_store(60_000);
    let (env_a, env_b) = (env(), env());
    // Queued without yielding (this test's runtime has one thread): the writer takes them as
    // one batch.
    for i in 0..40 {
        store.set(&env_a, "h", &format!("{i}_0"), format!("a{i}"));
    }
    store.set(&env_b, "h", "0_0", "b".to_string());
    let stats = store.stats().clone();
    // The writer acknowledges in a task of its own and signals nothing: poll its counter.
    let deadline = Instant::now() + WAIT;
    while stats.set_ok.load(std::sync::atomic::Ordering::Relaxed) < 41 {
        assert!(
            Instant::now() < deadline,
            "cursor writes never acknowledged"
        );
        sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        redis
            .command_counts()
            .cursor_write
            .load(std::sync::atomic::Ordering::Relaxed),
        1,
        "one command for both environments"
    );
    assert_eq!(
        stats.set_error.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    for i in 0..40 {
        let got = store
            .get(&env_a, "h", &format!("{i}_0"), |v| Some(v.to_string()))
            .await;
        assert_eq!(got.as_deref(), Some(format!("a{i}").as_str()));
    }
    let got = store.get(&env_b, "h", "0_0", |v| Some(v.to_string())).await;
    assert_eq!(got.as_deref(), Some("b"));
}
