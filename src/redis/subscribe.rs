//! The Redis change source: subscriptions to `realtime:env:{<envId>}` kept in line with what the
//! router wants, on a single server or a Cluster (classic or sharded pub/sub).
//!
//! trigger.dev's webapp subscribes one shared, multiplexed subscriber connection per process to
//! `realtime:env:{<envId>}` for every environment that has a listener (docs/behaviours.md
//! NTF-07..12), with `SSUBSCRIBE` on a cluster with sharded pub/sub (one connection per shard,
//! NTF-04). This source does the same with a fred [`SubscriberClient`]; [`super::slots`] tracks
//! which node owns each sharded channel.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fred::clients::SubscriberClient;
use fred::prelude::*;
use fred::socket2::TcpKeepalive;
use fred::types::ConnectHandle;
use fred::util::redis_keyslot;
use parking_lot::Mutex;
use tokio::sync::{broadcast, Notify};
use tokio::task::JoinHandle;

use super::shard_check::check_shards;
pub use super::state::SourceStats;
use super::state::{Confirmed, Resync, Shared, SHARD_CHECK_TIMEOUT};
use super::{close, close_in_background, redact, RedisError, RedisOptions};
use crate::changes::record::{channel_name, env_of_channel};
use crate::changes::{ChangeRecord, ChangeSource, EventSender, SourceEvent};
use crate::protocol::EnvId;

/// How long [`RedisChangeSource::connect`] waits for the first connection before returning and
/// letting fred keep connecting in the background.
pub const INITIAL_CONNECT_WAIT: Duration = Duration::from_secs(5);

/// How often, in sharded mode, the source verifies that every confirmed subscription still lives
/// on the node owning its slot (see [`RedisChangeSource`]: fred drops the server's unsolicited
/// `sunsubscribe` after a slot migration, so nothing else would notice).
pub const SHARD_CHECK_INTERVAL: Duration = Duration::from_secs(5);

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

/// Which pub/sub flavour the subscriber speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// `SUBSCRIBE`/`UNSUBSCRIBE`: a single server, or a cluster with sharded pub/sub off (fred
    /// sends every classic subscription to one node; classic messages reach every node).
    Classic,
    /// `SSUBSCRIBE`/`SUNSUBSCRIBE` (cluster + sharded, NTF-04): a channel lives on the node
    /// owning its hash slot (one slot per env thanks to the `{env}` hash tag). fred reports these
    /// messages on the same stream as classic ones.
    Sharded,
}

impl Mode {
    /// Subscribes `channels` in order; returns how many of them (a prefix) Redis confirmed and
    /// the error that stopped the rest, if any.
    async fn subscribe(
        self,
        client: &SubscriberClient,
        channels: &[String],
    ) -> (usize, Option<Error>) {
        match self {
            Mode::Classic => match client.subscribe(channels.to_vec()).await {
                Ok(()) => (channels.len(), None),
                Err(e) => (0, Some(e)),
            },
            // One channel per SSUBSCRIBE: fred routes the call by its first channel and takes
            // exactly one reply frame per call (awaiting that reply is also how it follows a
            // MOVED for it), so a multi-channel call would leave stray replies behind. fred
            // builds SSUBSCRIBE with a single write attempt and redirection, which a MOVED
            // (slot migrated) uses up before the redirected write: allow a few.
            Mode::Sharded => {
                let client = client.with_options(&Options {
                    max_attempts: Some(3),
                    max_redirections: Some(3),
                    ..Options::default()
                });
                for (done, channel) in channels.iter().enumerate() {
                    if let Err(e) = client.ssubscribe(channel.as_str()).await {
                        return (done, Some(e));
                    }
                }
                (channels.len(), None)
            }
        }
    }

    /// Unsubscribes `channels`.
    async fn unsubscribe(
        self,
        client: &SubscriberClient,
        channels: Vec<String>,
    ) -> Result<(), Error> {
        match self {
            Mode::Classic => client.unsubscribe(channels).await,
            // A multi-channel SUNSUBSCRIBE must stay within one slot (CROSSSLOT otherwise).
            Mode::Sharded => {
                let mut by_slot: BTreeMap<u16, Vec<String>> = BTreeMap::new();
                for channel in channels {
                    by_slot
                        .entry(redis_keyslot(channel.as_bytes()))
                        .or_default()
                        .push(channel);
                }
                for (_, group) in by_slot {
                    client.sunsubscribe(group).await?;
                }
                Ok(())
            }
        }
    }
}

/// Redis pub/sub source: classic pub/sub on a single server or a cluster, sharded pub/sub on a
/// cluster (fred `SubscriberClient`; subscriptions restored after reconnects and slot moves).
///
/// Design:
/// * One subscriber connection per server (fred's cluster client keeps one per primary), RESP2,
///   reconnecting forever (exponential backoff up to 2 s), TCP keepalive on, connections named
///   with fred's client id (`CLIENT SETNAME`, see [`RedisChangeSource::client_name`]).
/// * [`ChangeSource::subscribe`]/[`ChangeSource::unsubscribe`] only edit a *desired* set and
///   wake a single reconciler task, which issues (S)SUBSCRIBE/(S)UNSUBSCRIBE for the difference
///   with what Redis confirmed. One task keeps commands ordered (a subscribe followed by an
///   unsubscribe of the same env can never be reordered), batches bursts (classic: one command;
///   sharded: one SSUBSCRIBE per channel, one SUNSUBSCRIBE per slot), and retries failures with
///   backoff (NTF-10..12 without their edge cases).
/// * On a reconnect the reconciler re-subscribes what the server forgot (single server or
///   classic mode: everything; sharded mode: the channels placed on the node that reconnected)
///   and only then emits [`SourceEvent::Reconnected`], so a consumer re-reading on that event
///   cannot miss a record published afterwards. fred's own `manage_subscriptions` is not used:
///   it only restores channels whose SUBSCRIBE had succeeded and gives up on error.
/// * Sharded mode, slot moves: after a slot migration the old owner drops our subscription and
///   pushes an unsolicited `sunsubscribe`, which fred discards, and fred's own slot map only
///   changes on a MOVED or reconnect. So a *shard check* runs every [`SHARD_CHECK_INTERVAL`]
///   (and right after any reconnect) on a separate plain cluster client: `CLUSTER SLOTS`, then
///   every confirmed channel whose slot now has another owner than the node it was subscribed on
///   — or for which `PUBSUB SHARDNUMSUB` on its owner says 0 subscribers — is re-subscribed (fred
///   follows the MOVED to the new owner) and a [`SourceEvent::Reconnected`] announces the gap.
///   Such a loss is therefore repaired within about one interval.
/// * A reader task turns fred messages (classic `message` and sharded `smessage` alike) into
///   [`SourceEvent::Record`] (env id from the channel name; other channels ignored; payload
///   decoded tolerantly). If fred's message buffer overflows, the reader emits
///   [`SourceEvent::Reconnected`] since records were lost.
///
/// Dropping the handle stops the tasks and closes the connections.
pub struct RedisChangeSource {
    client: SubscriberClient,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    /// fred's connection task; `None` once closed.
    connection: Option<ConnectHandle>,
    /// Sharded mode: the shard check's client and its connection task.
    control: Option<(Client, ConnectHandle)>,
    /// The pub/sub flavour in use.
    mode: Mode,
}

/// How [`RedisChangeSource::connect`] behaves beyond what [`RedisOptions`] say.
#[derive(Clone, Copy, Debug)]
pub struct SubscriberSettings {
    /// How long `connect` waits for the first connection (in a cluster: to every primary)
    /// before returning and letting fred keep connecting in the background
    /// (`Duration::ZERO` returns at once). Default [`INITIAL_CONNECT_WAIT`].
    pub initial_wait: Duration,
    /// Sharded mode: how often the shard check runs. Default [`SHARD_CHECK_INTERVAL`].
    pub shard_check_interval: Duration,
}

impl Default for SubscriberSettings {
    fn default() -> Self {
        SubscriberSettings {
            initial_wait: INITIAL_CONNECT_WAIT,
            shard_check_interval: SHARD_CHECK_INTERVAL,
        }
    }
}

impl RedisChangeSource {
    /// Connects as `options` say (a single server, or a cluster with classic or sharded pub/sub,
    /// see [`RedisOptions`]) and starts delivering to `tx`.
    ///
    /// Waits at most `settings.initial_wait` for the first connection. If Redis is unreachable
    /// by then, this still returns `Ok` and fred keeps connecting in the background (a warning
    /// is logged): subscriptions requested meanwhile are issued once connected, and that first
    /// connection is announced as [`SourceEvent::Reconnected`] because records may have been
    /// missed. A connection made within the wait is not announced.
    ///
    /// # Errors
    /// [`RedisError`] for an unparsable URL, a URL that does not fit `options.cluster`, or a
    /// configuration fred refuses, including one detected during the initial wait.
    pub async fn connect(
        options: &RedisOptions,
        tx: EventSender,
        settings: SubscriberSettings,
    ) -> Result<Self, RedisError> {
        Self::start(
            options,
            tx,
            settings.initial_wait,
            settings.shard_check_interval,
        )
        .await
    }

    async fn start(
        options: &RedisOptions,
        tx: EventSender,
        initial_wait: Duration,
        check_interval: Duration,
    ) -> Result<Self, RedisError> {
        let mut config = options.fred_config().map_err(RedisError::Config)?;
        let mode = if options.uses_sharded() {
            Mode::Sharded
        } else {
            Mode::Classic
        };
        let seed_host = RedisOptions::seed_host(&config);
        // Keep retrying the first connection too instead of failing `init`.
        config.fail_fast = false;
        let client = Builder::from_config(config.clone())
            .set_policy(reconnect_policy())
            .with_performance_config(|perf| perf.broadcast_channel_capacity = MESSAGE_BUFFER)
            .with_connection_config(|conn| {
                conn.auto_client_setname = true;
                conn.tcp = tcp_config();
            })
            .build_subscriber_client()
            .map_err(|e| RedisError::Config(e.to_string()))?;

        let shared = Arc::new(Shared {
            stats: SourceStats::default(),
            desired: Mutex::default(),
            confirmed: Mutex::default(),
            generations: AtomicU64::new(0),
            wake: Notify::new(),
            resync: Mutex::default(),
            connect_returned: AtomicBool::new(false),
            routing: Mutex::default(),
            check_now: Notify::new(),
        });

        // Listen before connecting so neither the first connect nor an early message is missed.
        let messages = client.message_rx();
        let reconnects = client.reconnect_rx();
        let errors = client.error_rx();
        let mut tasks = vec![
            tokio::spawn(read_messages(messages, tx.clone(), Arc::clone(&shared))),
            tokio::spawn(count_errors(errors, Arc::clone(&shared))),
            tokio::spawn(watch_reconnects(reconnects, Arc::clone(&shared), mode)),
            tokio::spawn(reconcile(client.clone(), mode, Arc::clone(&shared), tx)),
        ];

        // Sharded mode: a plain cluster client for the shard check (a RESP2 subscriber
        // connection cannot run CLUSTER SLOTS or PUBSUB SHARDNUMSUB).
        let control = if mode == Mode::Sharded {
            let control = Builder::from_config(config)
                .set_policy(reconnect_policy())
                .with_performance_config(|perf| perf.default_command_timeout = SHARD_CHECK_TIMEOUT)
                .with_connection_config(|conn| {
                    conn.max_command_attempts = 1;
                    conn.tcp = tcp_config();
                })
                .build()
                .map_err(|e| RedisError::Config(e.to_string()))?;
            let handle = control.connect();
            tasks.push(tokio::spawn(check_shards(
                control.clone(),
                Arc::clone(&shared),
                seed_host,
                check_interval,
            )));
            Some((control, handle))
        } else {
            None
        };

        let connection = client.connect();
        let url = redact(&options.url);
        match tokio::time::timeout(initial_wait, client.wait_for_connect()).await {
            Ok(Ok(())) => {}
            // With `fail_fast` off, fred only reports a connect error it will not retry.
            Ok(Err(e)) => {
                for task in &tasks {
                    task.abort();
                }
                close(&client, connection).await;
                if let Some((control, handle)) = control {
                    close(&control, handle).await;
                }
                return Err(RedisError::Connect {
                    url: redact(&options.url),
                    reason: e.to_string(),
                });
            }
            Err(_) => tracing::warn!(
                url = %url,
                "redis not reachable within {initial_wait:?}; the change source keeps connecting in the background"
            ),
        }
        tracing::info!(url = %url, ?mode, cluster = options.cluster, "redis change source started");
        shared.connect_returned.store(true, Ordering::SeqCst);
        Ok(RedisChangeSource {
            client,
            shared,
            tasks,
            connection: Some(connection),
            control,
            mode,
        })
    }

    /// Environments the consumer asked for (sorted), confirmed by Redis or not.
    pub fn subscribed(&self) -> Vec<EnvId> {
        self.shared.desired.lock().keys().cloned().collect()
    }

    /// Environments whose subscription Redis confirmed on the current connection(s) (sorted).
    /// Lags [`RedisChangeSource::subscribed`] by a round trip; its length is the "active
    /// subscriptions" figure (NTF-07/09).
    pub fn confirmed(&self) -> Vec<EnvId> {
        self.shared.confirmed.lock().keys().cloned().collect()
    }

    /// Counters (messages received, errors).
    pub fn stats(&self) -> &SourceStats {
        &self.shared.stats
    }

    /// Whether the subscriber is connected (in a cluster: to every primary).
    pub fn is_connected(&self) -> bool {
        self.client.is_connected()
    }

    /// Whether records arrive over sharded pub/sub (`SSUBSCRIBE`).
    pub fn is_sharded(&self) -> bool {
        self.mode == Mode::Sharded
    }

    /// The subscriber connection's `CLIENT SETNAME` (fred's client id; the same on every node of
    /// a cluster), to find it in `CLIENT LIST`.
    pub fn client_name(&self) -> &str {
        self.client.id()
    }

    /// Stops the background tasks and closes the connection(s) (NTF-20; errors ignored).
    pub async fn shutdown(mut self) {
        for task in self.tasks.drain(..) {
            task.abort();
        }
        if let Some(connection) = self.connection.take() {
            close(&self.client, connection).await;
        }
        if let Some((control, handle)) = self.control.take() {
            close(&control, handle).await;
        }
    }
}

impl Drop for RedisChangeSource {
    fn drop(&mut self) {
        for task in self.tasks.drain(..) {
            task.abort();
        }
        if let Some(connection) = self.connection.take() {
            close_in_background(self.client.clone(), connection);
        }
        if let Some((control, handle)) = self.control.take() {
            close_in_background(control, handle);
        }
    }
}

impl ChangeSource for RedisChangeSource {
    fn subscribe(&self, env_id: &EnvId) -> u64 {
        let generation = self.shared.generations.fetch_add(1, Ordering::Relaxed) + 1;
        self.shared
            .desired
            .lock()
            .insert(env_id.clone(), generation);
        self.shared.wake.notify_one();
        generation
    }
    fn unsubscribe(&self, env_id: &EnvId) {
        if self.shared.desired.lock().remove(env_id).is_some() {
            self.shared.wake.notify_one();
        }
    }
}

/// The reconnect policy of every connection here (see [`RECONNECT_MIN_MS`]).
fn reconnect_policy() -> ReconnectPolicy {
    ReconnectPolicy::new_exponential(0, RECONNECT_MIN_MS, RECONNECT_MAX_MS, 2)
}

/// TCP settings: no Nagle, keepalive after 30 s idle, probes every 10 s.
fn tcp_config() -> TcpConfig {
    TcpConfig {
        nodelay: Some(true),
        keepalive: Some(
            TcpKeepalive::new()
                .with_time(Duration::from_secs(30))
                .with_interval(Duration::from_secs(10)),
        ),
        ..TcpConfig::default()
    }
}

/// Forwards fred pub/sub messages as [`SourceEvent::Record`]s until the consumer or fred goes.
async fn read_messages(
    mut rx: broadcast::Receiver<fred::types::Message>,
    tx: EventSender,
    shared: Arc<Shared>,
) {
    loop {
        let event = match rx.recv().await {
            Ok(message) => {
                // Classic `message` and sharded `smessage` alike.
                let Some(env_id) = env_of_channel(&message.channel) else {
                    continue;
                };
                shared.stats.received.fetch_add(1, Ordering::Relaxed);
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
                    env_id: EnvId::new(env_id),
                    record,
                }
            }
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                shared.stats.lagged.fetch_add(missed, Ordering::Relaxed);
                tracing::warn!(missed, "redis change source fell behind; reporting a gap");
                SourceEvent::Reconnected
            }
            Err(broadcast::error::RecvError::Closed) => return,
        };
        if tx.send(event).await.is_err() {
            return;
        }
    }
}

/// Counts the connection errors fred reports (for metrics; fred reconnects by itself).
async fn count_errors(mut rx: broadcast::Receiver<(Error, Option<Server>)>, shared: Arc<Shared>) {
    loop {
        match rx.recv().await {
            Ok((error, server)) => {
                shared
                    .stats
                    .connection_errors
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%error, server = ?server.map(|s| s.to_string()), "redis change source connection error");
            }
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                shared
                    .stats
                    .connection_errors
                    .fetch_add(missed, Ordering::Relaxed);
            }
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// Turns fred's (re)connect notifications (one per server connection) into a resync of the
/// reconciler: everything in classic mode, the subscriptions placed on that node in sharded mode
/// (everything if the node is not in the known slot map). fred also reports the very first
/// connection(s) here; they are announced to the consumer only if they happened after `connect`
/// returned.
async fn watch_reconnects(mut rx: broadcast::Receiver<Server>, shared: Arc<Shared>, mode: Mode) {
    loop {
        let (announce, server) = match rx.recv().await {
            Ok(server) => {
                let announce = shared.connect_returned.load(Ordering::SeqCst);
                tracing::info!(%server, announce, "redis change source connected");
                (announce, Some(server))
            }
            // Missed notifications still mean "reconnected since".
            Err(broadcast::error::RecvError::Lagged(_)) => (true, None),
            Err(broadcast::error::RecvError::Closed) => return,
        };
        let known = match (&server, mode) {
            (Some(server), Mode::Sharded) => shared
                .routing
                .lock()
                .as_ref()
                .is_none_or(|routing| routing.has_primary(server)),
            _ => false,
        };
        {
            let mut resync = shared.resync.lock();
            match server {
                Some(server) if known => {
                    resync.servers.insert(server);
                }
                _ => resync.all = true,
            }
            resync.announce |= announce;
        }
        shared.wake.notify_one();
        shared.check_now.notify_one();
    }
}

/// The single task that issues (S)SUBSCRIBE/(S)UNSUBSCRIBE: brings what Redis has in line with
/// what the consumer wants, retrying failures with backoff; after a reconnect or a lost
/// subscription, re-subscribes what is missing and then emits [`SourceEvent::Reconnected`].
async fn reconcile(client: SubscriberClient, mode: Mode, shared: Arc<Shared>, tx: EventSender) {
    let mut backoff = RETRY_MIN;
    // A gap to announce once every desired env is subscribed again.
    let mut announce = false;
    let mut epochs: u64 = 0;
    loop {
        {
            let mut resync = shared.resync.lock();
            let mut confirmed = shared.confirmed.lock();
            if resync.all {
                confirmed.clear();
            } else if !resync.servers.is_empty() {
                // Unknown placement: assume it was on a reconnected node.
                confirmed.retain(|_, c| {
                    c.server
                        .as_ref()
                        .is_some_and(|s| !resync.servers.contains(s))
                });
            }
            for (env, epoch) in resync.lost.drain(..) {
                if confirmed.get(&env).is_some_and(|c| c.epoch == epoch) {
                    confirmed.remove(&env);
                }
            }
            announce |= resync.announce;
            *resync = Resync::default();
        }
        let (to_subscribe, to_unsubscribe, to_announce) = {
            let routing = shared.routing.lock();
            let desired = shared.desired.lock();
            let mut confirmed = shared.confirmed.lock();
            let to_subscribe: Vec<(EnvId, u64)> = desired
                .iter()
                .filter(|(env, _)| !confirmed.contains_key(*env))
                .map(|(env, generation)| (env.clone(), *generation))
                .collect();
            let mut to_unsubscribe: Vec<EnvId> = confirmed
                .keys()
                .filter(|env| !desired.contains_key(*env))
                .cloned()
                .collect();
            if let Some(routing) = routing.as_ref().filter(|_| mode == Mode::Sharded) {
                // Its slot moved away: the old owner already dropped the subscription (and would
                // answer SUNSUBSCRIBE with a MOVED that fred does not expect).
                to_unsubscribe.retain(|env| {
                    let moved = confirmed
                        .get(env)
                        .and_then(|c| c.server.as_ref())
                        .zip(routing.owner_of_env(env))
                        .is_some_and(|(placed, owner)| placed != owner);
                    if moved {
                        confirmed.remove(env);
                    }
                    !moved
                });
            }
            // Still subscribed at Redis (an unsubscribe never reached it), but a newer subscribe
            // asked: the subscription never lapsed, so the new generation is confirmed as is.
            let mut to_announce = Vec::new();
            for (env, generation) in desired.iter() {
                if let Some(c) = confirmed.get_mut(env) {
                    if c.generation != *generation {
                        c.generation = *generation;
                        to_announce.push((env.clone(), *generation));
                    }
                }
            }
            (to_subscribe, to_unsubscribe, to_announce)
        };
        for (env_id, generation) in to_announce {
            if tx
                .send(SourceEvent::Subscribed { env_id, generation })
                .await
                .is_err()
            {
                return;
            }
        }

        let mut failed = false;
        if !to_unsubscribe.is_empty() {
            let channels = to_unsubscribe.iter().map(|env| channel_name(env)).collect();
            match mode.unsubscribe(&client, channels).await {
                Ok(()) => {
                    let mut confirmed = shared.confirmed.lock();
                    for env in &to_unsubscribe {
                        confirmed.remove(env);
                    }
                }
                Err(e) => {
                    shared.stats.command_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, envs = to_unsubscribe.len(), "redis UNSUBSCRIBE failed; will retry");
                    failed = true;
                }
            }
        }
        if !to_subscribe.is_empty() {
            let channels: Vec<String> = to_subscribe
                .iter()
                .map(|(env, _)| channel_name(env))
                .collect();
            let (done, error) = mode.subscribe(&client, &channels).await;
            let done = &to_subscribe[..done.min(to_subscribe.len())];
            {
                let routing = shared.routing.lock();
                let mut confirmed = shared.confirmed.lock();
                for (env, generation) in done {
                    epochs += 1;
                    let server = match mode {
                        Mode::Sharded => {
                            routing.as_ref().and_then(|r| r.owner_of_env(env)).cloned()
                        }
                        Mode::Classic => None,
                    };
                    confirmed.insert(
                        env.clone(),
                        Confirmed {
                            generation: *generation,
                            epoch: epochs,
                            server,
                        },
                    );
                }
            }
            for (env_id, generation) in done.iter().cloned() {
                if tx
                    .send(SourceEvent::Subscribed { env_id, generation })
                    .await
                    .is_err()
                {
                    return;
                }
            }
            if let Some(e) = error {
                shared.stats.command_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, envs = to_subscribe.len() - done.len(), "redis SUBSCRIBE failed; will retry");
                failed = true;
            }
        }

        if failed {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(RETRY_MAX);
            continue;
        }
        backoff = RETRY_MIN;
        if to_subscribe.is_empty() && to_unsubscribe.is_empty() {
            // In sync: every desired env is subscribed on the current connection(s), so a
            // consumer reacting to the announcement cannot miss a later record. (If a connection
            // dropped again meanwhile, that reconnect is announced in turn.)
            if std::mem::take(&mut announce) && tx.send(SourceEvent::Reconnected).await.is_err() {
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

    #[test]
    fn redact_hides_credentials() {
        assert_eq!(
            redact("redis://user:pw@host:6379/0"),
            "redis://***@host:6379/0"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }

    #[tokio::test]
    async fn cluster_url_needs_cluster_mode() {
        let (tx, _rx) = crate::changes::event_channel();
        let url = "redis-cluster://127.0.0.1:1?node=127.0.0.1:2";
        let settings = SubscriberSettings {
            initial_wait: Duration::ZERO,
            ..SubscriberSettings::default()
        };
        let err = RedisChangeSource::connect(&RedisOptions::standalone(url), tx.clone(), settings)
            .await
            .err()
            .expect("refused");
        assert!(err.to_string().contains("redis.cluster"), "{err}");
        // Cluster mode accepts it (and keeps connecting in the background).
        let source = RedisChangeSource::connect(&RedisOptions::cluster(url, true), tx, settings)
            .await
            .expect("cluster mode");
        assert!(source.is_sharded());
        source.shutdown().await;
    }

    #[tokio::test]
    async fn bad_url_is_an_error() {
        let (tx, _rx) = crate::changes::event_channel();
        let options = RedisOptions::standalone("not a url");
        assert!(
            RedisChangeSource::connect(&options, tx, SubscriberSettings::default())
                .await
                .is_err()
        );
    }
}
