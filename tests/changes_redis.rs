//! Change records over a real Redis (127.0.0.1:6379): publish like the webapp, receive through
//! `RedisChangeSource` (NTF-05, NTF-06, NTF-13..15 on the wire, unsubscribe, reconnect).
//!
//! Every test uses fresh random env ids, so tests (and other suites on the same Redis) never
//! see each other's records. Every receive is bounded by a timeout.

use std::time::Duration;

use fred::prelude::*;
use fred::types::CustomCommand;
use runfeed::changes::{channel_name, ChangeRecord, ChangeSource, SourceEvent};
use runfeed::redis::{
    publish_once, Publisher, RedisChangeSource, RedisOptions, SubscriberSettings,
};

fn standalone(url: &str) -> RedisOptions {
    RedisOptions::standalone(url)
}
use tokio::sync::mpsc;
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

async fn source() -> (RedisChangeSource, mpsc::UnboundedReceiver<SourceEvent>) {
    let (tx, rx) = mpsc::unbounded_channel();
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

/// The next event other than a subscription confirmation (those are checked with
/// `wait_confirmed`).
async fn next_event(rx: &mut mpsc::UnboundedReceiver<SourceEvent>) -> SourceEvent {
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
    let (source, mut rx) = source().await;
    let publisher = publisher().await;
    let env_id = env();
    source.subscribe(&runfeed::protocol::EnvId::from(&env_id));
    wait_confirmed(&source, &env_id, true).await;

    let record = full_record(&env_id, "run_1");
    assert_eq!(publisher.publish(&record).await.expect("publish"), 1);
    assert_eq!(
        next_event(&mut rx).await,
        SourceEvent::Record {
            env_id: env_id.clone().into(),
            record
        }
    );

    // A lifecycle-bus record: full, `batchId: null`, no watermark.
    let record = ChangeRecord {
        batch_id: None,
        updated_at_ms: None,
        tags: Some(vec![]),
        ..full_record(&env_id, "r2")
    };
    assert_eq!(publisher.publish(&record).await.expect("publish"), 1);
    assert_eq!(
        next_event(&mut rx).await,
        SourceEvent::Record {
            env_id: env_id.into(),
            record
        }
    );
}

/// NTF-06: a record for another env is not delivered (fenced by a record on the subscribed env).
#[tokio::test]
async fn ntf06_other_env_not_delivered() {
    let (source, mut rx) = source().await;
    let publisher = publisher().await;
    let (env_a, env_b) = (env(), env());
    source.subscribe(&runfeed::protocol::EnvId::from(&env_a));
    wait_confirmed(&source, &env_a, true).await;

    assert_eq!(
        publisher
            .publish(&full_record(&env_b, "run_b"))
            .await
            .expect("publish"),
        0
    );
    let fence = full_record(&env_a, "fence");
    publisher.publish(&fence).await.expect("publish fence");
    assert_eq!(
        next_event(&mut rx).await,
        SourceEvent::Record {
            env_id: env_a.into(),
            record: fence
        }
    );
}

/// PUBLISH returns the receiver count: 0 without a subscriber, 1 with ours.
#[tokio::test]
async fn publish_returns_receiver_count() {
    let (source, _rx) = source().await;
    let env_id = env();
    let record = full_record(&env_id, "run_1");
    assert_eq!(
        publish_once(&standalone(REDIS_URL), &record)
            .await
            .expect("publish"),
        0
    );
    source.subscribe(&runfeed::protocol::EnvId::from(&env_id));
    wait_confirmed(&source, &env_id, true).await;
    assert_eq!(
        publish_once(&standalone(REDIS_URL), &record)
            .await
            .expect("publish"),
        1
    );
}

/// NTF-14/15 on the wire: a bare string (and invalid JSON) published raw decodes as a partial
/// record; the env id comes from the channel.
#[tokio::test]
async fn bare_string_message_decodes_as_partial() {
    let (source, mut rx) = source().await;
    let env_id = env();
    source.subscribe(&runfeed::protocol::EnvId::from(&env_id));
    wait_confirmed(&source, &env_id, true).await;

    // A separate plain fred client issuing the raw PUBLISH, as any other producer would.
    let raw = Builder::from_config(Config::from_url(REDIS_URL).expect("url"))
        .build()
        .expect("client");
    raw.init().await.expect("connect");
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
        assert_eq!(
            next_event(&mut rx).await,
            SourceEvent::Record {
                env_id: env_id.clone().into(),
                record: expected
            }
        );
    }
    let _ = raw.quit().await;
}

/// After `unsubscribe`, records of that env stop (fenced by a record on a still-subscribed env);
/// subscribe/unsubscribe are idempotent.
#[tokio::test]
async fn unsubscribe_stops_delivery() {
    let (source, mut rx) = source().await;
    let publisher = publisher().await;
    let (env_a, env_b) = (env(), env());
    source.subscribe(&runfeed::protocol::EnvId::from(&env_a));
    source.subscribe(&runfeed::protocol::EnvId::from(&env_a));
    source.subscribe(&runfeed::protocol::EnvId::from(&env_b));
    wait_confirmed(&source, &env_a, true).await;
    wait_confirmed(&source, &env_b, true).await;
    let before = full_record(&env_a, "before");
    assert_eq!(publisher.publish(&before).await.expect("publish"), 1);
    assert_eq!(
        next_event(&mut rx).await,
        SourceEvent::Record {
            env_id: env_a.clone().into(),
            record: before
        }
    );

    source.unsubscribe(&runfeed::protocol::EnvId::from(&env_a));
    source.unsubscribe(&runfeed::protocol::EnvId::from(&env_a));
    assert_eq!(source.subscribed(), vec![env_b.clone()]);
    wait_confirmed(&source, &env_a, false).await;
    assert_eq!(
        publisher
            .publish(&full_record(&env_a, "after"))
            .await
            .expect("publish"),
        0
    );
    let fence = full_record(&env_b, "fence");
    publisher.publish(&fence).await.expect("publish fence");
    assert_eq!(
        next_event(&mut rx).await,
        SourceEvent::Record {
            env_id: env_b.into(),
            record: fence
        }
    );
}

/// Subscribe then unsubscribe before the reconciler runs: nothing stays subscribed.
#[tokio::test]
async fn subscribe_unsubscribe_burst_converges() {
    let (source, _rx) = source().await;
    let publisher = publisher().await;
    let env_id = env();
    for _ in 0..10 {
        source.subscribe(&runfeed::protocol::EnvId::from(&env_id));
        source.unsubscribe(&runfeed::protocol::EnvId::from(&env_id));
    }
    let other = env();
    source.subscribe(&runfeed::protocol::EnvId::from(&other));
    wait_confirmed(&source, &other, true).await;
    assert!(source.confirmed().iter().all(|e| e != &env_id));
    assert_eq!(
        publisher
            .publish(&full_record(&env_id, "x"))
            .await
            .expect("publish"),
        0
    );
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
    let (source, mut rx) = source().await;
    let publisher = publisher().await;
    let env_id = env();
    source.subscribe(&runfeed::protocol::EnvId::from(&env_id));
    wait_confirmed(&source, &env_id, true).await;
    // No event for the initial connection.
    let first = full_record(&env_id, "first");
    publisher.publish(&first).await.expect("publish");
    assert_eq!(
        next_event(&mut rx).await,
        SourceEvent::Record {
            env_id: env_id.clone().into(),
            record: first
        }
    );

    // Kill only our subscriber connection (by id, found by its CLIENT SETNAME), so other
    // suites' pub/sub clients on this Redis are unaffected, unlike `CLIENT KILL TYPE pubsub`.
    let admin = Builder::from_config(Config::from_url(REDIS_URL).expect("url"))
        .build()
        .expect("client");
    admin.init().await.expect("connect admin");
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
    let after = full_record(&env_id, "after");
    assert_eq!(publisher.publish(&after).await.expect("publish"), 1);
    assert_eq!(
        next_event(&mut rx).await,
        SourceEvent::Record {
            env_id: env_id.clone().into(),
            record: after
        }
    );
    let new_id = client_id_by_name(&admin, source.client_name())
        .await
        .expect("reconnected subscriber");
    assert_ne!(new_id, id);
    let _ = admin.quit().await;
    source.shutdown().await;
}

/// A TCP port nothing listens on (bound, read, released).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// With nothing listening, `connect` returns after its bounded wait (fred keeps connecting in
/// the background) and `subscribe` does not block; the publisher fails instead.
#[tokio::test]
async fn unreachable_redis_does_not_hang() {
    let url = format!("redis://127.0.0.1:{}", free_port());
    let (tx, _rx) = mpsc::unbounded_channel();
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
    let (tx, mut rx) = mpsc::unbounded_channel();
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

    let _server = RedisServer(
        std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn redis-server"),
    );
    assert_eq!(next_event(&mut rx).await, SourceEvent::Reconnected);
    assert!(source
        .confirmed()
        .contains(&runfeed::protocol::EnvId::from(&env_id)));
    let publisher = Publisher::connect(&standalone(&url))
        .await
        .expect("publisher");
    let record = full_record(&env_id, "late");
    assert_eq!(publisher.publish(&record).await.expect("publish"), 1);
    assert_eq!(
        next_event(&mut rx).await,
        SourceEvent::Record {
            env_id: env_id.into(),
            record
        }
    );
    publisher.close().await;
    source.shutdown().await;
}
