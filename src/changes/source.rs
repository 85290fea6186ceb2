//! Change sources: Redis pub/sub (classic) and an in-memory source for tests.
//!
//! trigger.dev's webapp subscribes one shared, multiplexed subscriber connection per process to
//! `realtime:env:{<envId>}` for every environment that has a listener (NTF-07..12). The Redis
//! source here does the same with a fred [`SubscriberClient`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use fred::clients::SubscriberClient;
use fred::prelude::*;
use fred::socket2::TcpKeepalive;
use fred::types::ConnectHandle;
use tokio::sync::{broadcast, mpsc, Notify};
use tokio::task::JoinHandle;

use super::conn;
use super::record::{channel_name, env_of_channel};
use super::ChangeRecord;

/// What a change source reports to its consumer (the router).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// A record arrived on `realtime:env:{env_id}` (`env_id` taken from the channel name).
    Record {
        env_id: String,
        record: ChangeRecord,
    },
    /// The subscription of `env_id` requested by the [`ChangeSource::subscribe`] call that
    /// returned `generation` is confirmed by Redis: records published from now on are delivered.
    /// Replay coverage starts here, not at the subscribe call (a record published between the
    /// two would otherwise be lost while a cursor claims it was covered). The generation lets a
    /// consumer ignore a late confirmation of an earlier subscription of the same env.
    Subscribed { env_id: String, generation: u64 },
    /// The subscriber connection was re-established: records published while it was down are
    /// lost, so every subscribed environment has a gap.
    Reconnected,
}

/// Per-environment subscription management. Implementations deliver [`SourceEvent`]s on the
/// sender they were built with. Both calls are idempotent and never block; failures are
/// retried/logged inside the source (a missed record only costs latency: the backstop covers it).
pub trait ChangeSource: Send + Sync + 'static {
    /// Start receiving records of `env_id`. Returns this request's generation (unique per
    /// source, increasing); the matching [`SourceEvent::Subscribed`] carries it.
    fn subscribe(&self, env_id: &str) -> u64;
    /// Stop receiving records of `env_id`.
    fn unsubscribe(&self, env_id: &str);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

// ---------------------------------------------------------------------------------------------
// In-memory source
// ---------------------------------------------------------------------------------------------

/// In-memory source: [`MemoryChangeSource::push`] delivers a record iff its env is subscribed.
pub struct MemoryChangeSource {
    tx: mpsc::UnboundedSender<SourceEvent>,
    subscribed: Mutex<BTreeSet<String>>,
    generations: AtomicU64,
}

impl MemoryChangeSource {
    /// A source delivering to `tx`.
    pub fn new(tx: mpsc::UnboundedSender<SourceEvent>) -> Self {
        MemoryChangeSource {
            tx,
            subscribed: Mutex::default(),
            generations: AtomicU64::new(0),
        }
    }

    /// Delivers `record` on env `env_id` if subscribed; returns whether it was delivered
    /// (`false` also when the consumer is gone).
    pub fn push(&self, env_id: &str, record: ChangeRecord) -> bool {
        if !lock(&self.subscribed).contains(env_id) {
            return false;
        }
        self.tx
            .send(SourceEvent::Record {
                env_id: env_id.to_owned(),
                record,
            })
            .is_ok()
    }

    /// Simulates a subscriber reconnect.
    pub fn reconnect(&self) {
        let _ = self.tx.send(SourceEvent::Reconnected);
    }

    /// Currently subscribed environments (sorted).
    pub fn subscribed(&self) -> Vec<String> {
        lock(&self.subscribed).iter().cloned().collect()
    }
}

impl ChangeSource for MemoryChangeSource {
    fn subscribe(&self, env_id: &str) -> u64 {
        // In memory a subscription is active at once.
        let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        lock(&self.subscribed).insert(env_id.to_owned());
        let _ = self.tx.send(SourceEvent::Subscribed { env_id: env_id.to_owned(), generation });
        generation
    }
    fn unsubscribe(&self, env_id: &str) {
        lock(&self.subscribed).remove(env_id);
    }
}

// ---------------------------------------------------------------------------------------------
// Redis source
// ---------------------------------------------------------------------------------------------

/// How long [`RedisChangeSource::connect`] waits for the first connection before returning and
/// letting fred keep connecting in the background.
pub const INITIAL_CONNECT_WAIT: Duration = Duration::from_secs(5);

/// Reconnect backoff of the subscriber connection: exponential from 100 ms, capped at 2 s,
/// retried forever (the webapp's ioredis default retries forever too).
const RECONNECT_MIN_MS: u32 = 100;
const RECONNECT_MAX_MS: u32 = 2_000;

/// Capacity of fred's pub/sub broadcast channel (fred's default is 32). The reader task only
/// decodes and forwards, so this only absorbs scheduling hiccups; an overflow is reported as
/// [`SourceEvent::Reconnected`] (a gap), never silently.
const MESSAGE_BUFFER: usize = 16_384;

/// Backoff after a failed SUBSCRIBE/UNSUBSCRIBE before the reconciler retries.
const RETRY_MIN: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// Which pub/sub flavour the subscriber speaks. Only classic is implemented; a sharded mode
/// (`SSUBSCRIBE`/`SUNSUBSCRIBE`, cluster + `SHARDED_ENABLED` in the webapp, NTF-04) slots in here:
/// group channels by hash slot (all of an env's traffic shares one slot thanks to the `{env}`
/// hash tag) and issue one call per slot. Incoming messages are handled the same way for both
/// (fred reports classic and sharded messages on the same stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Classic,
}

impl Mode {
    async fn subscribe(
        self,
        client: &SubscriberClient,
        channels: Vec<String>,
    ) -> Result<(), Error> {
        match self {
            Mode::Classic => client.subscribe(channels).await,
        }
    }

    async fn unsubscribe(
        self,
        client: &SubscriberClient,
        channels: Vec<String>,
    ) -> Result<(), Error> {
        match self {
            Mode::Classic => client.unsubscribe(channels).await,
        }
    }
}

/// State shared between the handle and its background tasks.
struct Shared {
    /// Environments the consumer wants (what `subscribe`/`unsubscribe` edit).
    desired: Mutex<BTreeMap<String, u64>>,
    /// Environments Redis confirmed on the current connection, with the generation last
    /// announced for each (kept by the reconciler).
    confirmed: Mutex<BTreeMap<String, u64>>,
    /// Source of subscribe generations.
    generations: AtomicU64,
    /// Wakes the reconciler.
    wake: Notify,
    /// A (re)connect the reconciler has not handled yet.
    resync: Mutex<Resync>,
    /// Set once `connect` returned: a connection established after that (including a first
    /// connection that came up in the background) leaves a gap and is announced.
    connect_returned: AtomicBool,
}

/// A pending resync: the server forgot every subscription (`pending`), and whether the consumer
/// must be told about the gap once everything is subscribed again (`announce`).
#[derive(Default)]
struct Resync {
    pending: bool,
    announce: bool,
}

/// Redis classic pub/sub source (fred `SubscriberClient`; subscriptions restored on reconnect).
///
/// Design:
/// * One subscriber connection, RESP2, reconnecting forever (exponential backoff up to 2 s), TCP
///   keepalive on, connection named with fred's client id (`CLIENT SETNAME`, see
///   [`RedisChangeSource::client_name`]).
/// * [`ChangeSource::subscribe`]/[`ChangeSource::unsubscribe`] only edit a *desired* set and
///   wake a single reconciler task, which issues SUBSCRIBE/UNSUBSCRIBE for the difference with
///   what Redis confirmed. One task keeps commands ordered (a subscribe followed by an
///   unsubscribe of the same env can never be reordered), batches bursts into one command, and
///   retries failures with backoff (NTF-10..12 without their edge cases).
/// * On every reconnect the reconciler re-subscribes the whole desired set (fred's own
///   `manage_subscriptions` is not used: it only restores channels whose SUBSCRIBE had
///   succeeded and gives up on error), and only then emits [`SourceEvent::Reconnected`], so a
///   consumer re-reading on that event cannot miss a record published afterwards.
/// * A reader task turns fred messages into [`SourceEvent::Record`] (env id from the channel
///   name; other channels ignored; payload decoded tolerantly). If fred's message buffer
///   overflows, the reader emits [`SourceEvent::Reconnected`] since records were lost.
///
/// Dropping the handle stops the tasks and closes the connection.
pub struct RedisChangeSource {
    client: SubscriberClient,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    /// fred's connection task; `None` once closed.
    connection: Option<ConnectHandle>,
}

/// Could not connect the subscriber.
#[derive(Debug, thiserror::Error)]
#[error("redis change source: {0}")]
pub struct SourceError(pub String);

impl RedisChangeSource {
    /// Connects to `redis_url` and starts delivering to `tx`.
    ///
    /// Waits at most [`INITIAL_CONNECT_WAIT`] for the first connection. If Redis is unreachable
    /// by then, this still returns `Ok` and fred keeps connecting in the background (a warning
    /// is logged): subscriptions requested meanwhile are issued once connected, and that first
    /// connection is announced as [`SourceEvent::Reconnected`] because records may have been
    /// missed. A connection made within the wait is not announced.
    ///
    /// # Errors
    /// [`SourceError`] for an unparsable URL or a configuration fred refuses, including one
    /// detected during the initial wait (e.g. an unsupported scheme).
    pub async fn connect(
        redis_url: &str,
        tx: mpsc::UnboundedSender<SourceEvent>,
    ) -> Result<Self, SourceError> {
        Self::connect_with_wait(redis_url, tx, INITIAL_CONNECT_WAIT).await
    }

    /// [`RedisChangeSource::connect`] with an explicit bound on the wait for the first
    /// connection (`Duration::ZERO` returns at once and connects in the background).
    ///
    /// # Errors
    /// As [`RedisChangeSource::connect`].
    pub async fn connect_with_wait(
        redis_url: &str,
        tx: mpsc::UnboundedSender<SourceEvent>,
        initial_wait: Duration,
    ) -> Result<Self, SourceError> {
        let mut config = Config::from_url(redis_url).map_err(|e| SourceError(e.to_string()))?;
        if !matches!(config.server, ServerConfig::Centralized { .. }) {
            // Cluster/sentinel would need the sharded mode (SSUBSCRIBE) and per-shard
            // connections; not implemented yet.
            return Err(SourceError(format!(
                "only a single Redis server is supported, got {redis_url}"
            )));
        }
        // Keep retrying the first connection too instead of failing `init`.
        config.fail_fast = false;
        let client = Builder::from_config(config)
            .set_policy(ReconnectPolicy::new_exponential(
                0,
                RECONNECT_MIN_MS,
                RECONNECT_MAX_MS,
                2,
            ))
            .with_performance_config(|perf| perf.broadcast_channel_capacity = MESSAGE_BUFFER)
            .with_connection_config(|conn| {
                conn.auto_client_setname = true;
                conn.tcp = TcpConfig {
                    nodelay: Some(true),
                    keepalive: Some(
                        TcpKeepalive::new()
                            .with_time(Duration::from_secs(30))
                            .with_interval(Duration::from_secs(10)),
                    ),
                    ..TcpConfig::default()
                };
            })
            .build_subscriber_client()
            .map_err(|e| SourceError(e.to_string()))?;

        let shared = Arc::new(Shared {
            desired: Mutex::default(),
            confirmed: Mutex::default(),
            generations: AtomicU64::new(0),
            wake: Notify::new(),
            resync: Mutex::default(),
            connect_returned: AtomicBool::new(false),
        });

        // Listen before connecting so neither the first connect nor an early message is missed.
        let messages = client.message_rx();
        let reconnects = client.reconnect_rx();
        let mut tasks = vec![
            tokio::spawn(read_messages(messages, tx.clone())),
            tokio::spawn(watch_reconnects(reconnects, Arc::clone(&shared))),
            tokio::spawn(reconcile(
                client.clone(),
                Mode::Classic,
                Arc::clone(&shared),
                tx,
            )),
        ];

        let connection = client.connect();
        match tokio::time::timeout(initial_wait, client.wait_for_connect()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                for task in tasks.drain(..) {
                    task.abort();
                }
                conn::close(&client, connection).await;
                return Err(SourceError(e.to_string()));
            }
            Err(_) => tracing::warn!(
                redis_url = %redact(redis_url),
                "redis change source not connected after {initial_wait:?}; connecting in the background"
            ),
        }
        shared.connect_returned.store(true, Ordering::SeqCst);
        Ok(RedisChangeSource {
            client,
            shared,
            tasks,
            connection: Some(connection),
        })
    }

    /// Environments the consumer asked for (sorted), confirmed by Redis or not.
    pub fn subscribed(&self) -> Vec<String> {
        lock(&self.shared.desired).keys().cloned().collect()
    }

    /// Environments whose SUBSCRIBE Redis confirmed on the current connection (sorted). Lags
    /// [`RedisChangeSource::subscribed`] by a round trip; its length is the "active
    /// subscriptions" figure (NTF-07/09).
    pub fn confirmed(&self) -> Vec<String> {
        lock(&self.shared.confirmed).keys().cloned().collect()
    }

    /// Whether the subscriber connection is currently up.
    pub fn is_connected(&self) -> bool {
        self.client.is_connected()
    }

    /// The subscriber connection's `CLIENT SETNAME` (fred's client id), to find it in
    /// `CLIENT LIST`.
    pub fn client_name(&self) -> &str {
        self.client.id()
    }

    /// Stops the background tasks and closes the connection (NTF-20; errors ignored).
    pub async fn shutdown(mut self) {
        for task in self.tasks.drain(..) {
            task.abort();
        }
        if let Some(connection) = self.connection.take() {
            conn::close(&self.client, connection).await;
        }
    }
}

impl Drop for RedisChangeSource {
    fn drop(&mut self) {
        for task in self.tasks.drain(..) {
            task.abort();
        }
        if let Some(connection) = self.connection.take() {
            conn::close_in_background(self.client.clone(), connection);
        }
    }
}

impl ChangeSource for RedisChangeSource {
    fn subscribe(&self, env_id: &str) -> u64 {
        let generation = self.shared.generations.fetch_add(1, Ordering::Relaxed) + 1;
        lock(&self.shared.desired).insert(env_id.to_owned(), generation);
        self.shared.wake.notify_one();
        generation
    }
    fn unsubscribe(&self, env_id: &str) {
        if lock(&self.shared.desired).remove(env_id).is_some() {
            self.shared.wake.notify_one();
        }
    }
}

/// The URL without credentials, for logs.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

/// Forwards fred pub/sub messages as [`SourceEvent::Record`]s until the consumer or fred goes.
async fn read_messages(
    mut rx: broadcast::Receiver<fred::types::Message>,
    tx: mpsc::UnboundedSender<SourceEvent>,
) {
    loop {
        let event = match rx.recv().await {
            Ok(message) => {
                let Some(env_id) = env_of_channel(&message.channel) else {
                    continue;
                };
                let record = match message.value.as_bytes() {
                    Some(bytes) => ChangeRecord::decode(bytes),
                    None => match message.value.as_str() {
                        // Numbers and the like: decode their text like the webapp would.
                        Some(text) => ChangeRecord::decode(text.as_bytes()),
                        None => {
                            tracing::warn!(channel = %message.channel, "ignoring non-string pub/sub payload");
                            continue;
                        }
                    },
                };
                SourceEvent::Record {
                    env_id: env_id.to_owned(),
                    record,
                }
            }
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                tracing::warn!(missed, "redis change source fell behind; reporting a gap");
                SourceEvent::Reconnected
            }
            Err(broadcast::error::RecvError::Closed) => return,
        };
        if tx.send(event).is_err() {
            return;
        }
    }
}

/// Turns fred's (re)connect notifications into a resync of the reconciler. fred also reports
/// the very first connection here; it is announced to the consumer only if it happened after
/// `connect` returned.
async fn watch_reconnects(mut rx: broadcast::Receiver<Server>, shared: Arc<Shared>) {
    loop {
        let announce = match rx.recv().await {
            Ok(server) => {
                let announce = shared.connect_returned.load(Ordering::SeqCst);
                tracing::info!(%server, announce, "redis change source connected");
                announce
            }
            // Missed notifications still mean "reconnected since".
            Err(broadcast::error::RecvError::Lagged(_)) => true,
            Err(broadcast::error::RecvError::Closed) => return,
        };
        {
            let mut resync = lock(&shared.resync);
            resync.pending = true;
            resync.announce |= announce;
        }
        shared.wake.notify_one();
    }
}

/// The single task that issues SUBSCRIBE/UNSUBSCRIBE: brings what Redis has in line with what
/// the consumer wants, retrying failures with backoff; after a reconnect, re-subscribes
/// everything and then emits [`SourceEvent::Reconnected`].
async fn reconcile(
    client: SubscriberClient,
    mode: Mode,
    shared: Arc<Shared>,
    tx: mpsc::UnboundedSender<SourceEvent>,
) {
    let mut backoff = RETRY_MIN;
    // A reconnect to announce once every desired env is subscribed again.
    let mut announce = false;
    loop {
        {
            let mut resync = lock(&shared.resync);
            if resync.pending {
                lock(&shared.confirmed).clear();
                announce |= resync.announce;
                *resync = Resync::default();
            }
        }
        let (to_subscribe, to_unsubscribe, to_announce) = {
            let desired = lock(&shared.desired);
            let mut confirmed = lock(&shared.confirmed);
            let to_subscribe: Vec<(String, u64)> = desired
                .iter()
                .filter(|(env, _)| !confirmed.contains_key(*env))
                .map(|(env, generation)| (env.clone(), *generation))
                .collect();
            let to_unsubscribe: Vec<String> =
                confirmed.keys().filter(|env| !desired.contains_key(*env)).cloned().collect();
            // Still subscribed at Redis (an unsubscribe never reached it), but a newer subscribe
            // asked: the subscription never lapsed, so the new generation is confirmed as is.
            let mut to_announce = Vec::new();
            for (env, generation) in desired.iter() {
                if let Some(announced) = confirmed.get_mut(env) {
                    if announced != generation {
                        *announced = *generation;
                        to_announce.push((env.clone(), *generation));
                    }
                }
            }
            (to_subscribe, to_unsubscribe, to_announce)
        };
        for (env_id, generation) in to_announce {
            if tx.send(SourceEvent::Subscribed { env_id, generation }).is_err() {
                return;
            }
        }

        let mut failed = false;
        if !to_unsubscribe.is_empty() {
            let channels = to_unsubscribe.iter().map(|env| channel_name(env)).collect();
            match mode.unsubscribe(&client, channels).await {
                Ok(()) => {
                    let mut confirmed = lock(&shared.confirmed);
                    for env in &to_unsubscribe {
                        confirmed.remove(env);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, envs = to_unsubscribe.len(), "redis UNSUBSCRIBE failed; will retry");
                    failed = true;
                }
            }
        }
        if !to_subscribe.is_empty() {
            let channels = to_subscribe.iter().map(|(env, _)| channel_name(env)).collect();
            match mode.subscribe(&client, channels).await {
                Ok(()) => {
                    lock(&shared.confirmed).extend(to_subscribe.iter().cloned());
                    for (env_id, generation) in to_subscribe.iter().cloned() {
                        if tx.send(SourceEvent::Subscribed { env_id, generation }).is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, envs = to_subscribe.len(), "redis SUBSCRIBE failed; will retry");
                    failed = true;
                }
            }
        }

        if failed {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(RETRY_MAX);
            continue;
        }
        backoff = RETRY_MIN;
        if to_subscribe.is_empty() && to_unsubscribe.is_empty() {
            // In sync: every desired env is subscribed on the current connection, so a consumer
            // reacting to the announcement cannot miss a later record. (If the connection dropped
            // again meanwhile, that reconnect is announced in turn.)
            if std::mem::take(&mut announce) && tx.send(SourceEvent::Reconnected).is_err() {
                return;
            }
            if tx.is_closed() {
                return;
            }
            shared.wake.notified().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(run: &str) -> ChangeRecord {
        ChangeRecord {
            v: 1,
            run_id: run.into(),
            env_id: "e".into(),
            ..Default::default()
        }
    }

    #[test]
    fn memory_source_delivers_only_subscribed() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let s = MemoryChangeSource::new(tx);
        assert!(!s.push("e", rec("r0")));
        s.subscribe("e");
        s.subscribe("e"); // idempotent
        s.subscribe("a");
        assert_eq!(s.subscribed(), vec!["a".to_string(), "e".to_string()]);
        assert!(s.push("e", rec("r1")));
        assert!(!s.push("b", rec("r2")));
        for (generation, env) in ["e", "e", "a"].into_iter().enumerate() {
            let generation = generation as u64 + 1;
            assert_eq!(rx.try_recv().ok(), Some(SourceEvent::Subscribed { env_id: env.into(), generation }));
        }
        assert_eq!(
            rx.try_recv().ok(),
            Some(SourceEvent::Record {
                env_id: "e".into(),
                record: rec("r1")
            })
        );
        assert!(rx.try_recv().is_err());
        s.unsubscribe("e");
        s.unsubscribe("e");
        assert!(!s.push("e", rec("r3")));
        s.reconnect();
        assert_eq!(rx.try_recv().ok(), Some(SourceEvent::Reconnected));
        assert_eq!(s.subscribed(), vec!["a".to_string()]);
    }

    #[test]
    fn redact_hides_credentials() {
        assert_eq!(
            redact("redis://user:pw@host:6379/0"),
            "redis://***@host:6379/0"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }

    #[tokio::test]
    async fn bad_url_is_an_error() {
        let (tx, _rx) = mpsc::unbounded_channel();
        assert!(RedisChangeSource::connect("not a url", tx).await.is_err());
    }
}
