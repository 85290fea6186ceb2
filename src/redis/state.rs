//! The state the change source's tasks share: what the router wants, what Redis confirmed, the
//! work queued for the reconciler, and the Cluster slot map (see [`super::subscribe`] for the
//! design).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use fred::prelude::Server;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::slots::SlotMap;
use crate::protocol::EnvId;

/// Bound on each command of the shard check (`CLUSTER SLOTS`, `PUBSUB SHARDNUMSUB`).
pub(super) const SHARD_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Channels per `PUBSUB SHARDNUMSUB` call of the shard check.
pub(super) const SHARDNUMSUB_BATCH: usize = 256;

/// Counters of a [`super::RedisChangeSource`] (exported as metrics, see [`crate::telemetry::metrics`]).
#[derive(Debug, Default)]
pub struct SourceStats {
    /// Change-record messages received on `realtime:env:*` channels (before coalescing).
    pub received: AtomicU64,
    /// Connection errors fred reported (drops, failed (re)connects).
    pub connection_errors: AtomicU64,
    /// SUBSCRIBE / UNSUBSCRIBE commands that failed (retried).
    pub command_errors: AtomicU64,
    /// Messages lost because the reader fell behind fred's buffer.
    pub lagged: AtomicU64,
    /// Sharded subscriptions the periodic shard check found gone (slot migrated, or dropped by
    /// the server) and had re-subscribed.
    pub lost_subscriptions: AtomicU64,
}

/// A subscription Redis confirmed.
#[derive(Clone, Debug)]
pub(super) struct Confirmed {
    /// The generation last announced for the env.
    pub(super) generation: u64,
    /// Unique per confirmation (the shard check names the confirmation it found lost).
    pub(super) epoch: u64,
    /// Sharded mode: the node that owned the channel's slot when it was confirmed (`None` when
    /// the slot map was unknown then; the shard check fills it in).
    pub(super) server: Option<Server>,
}

/// State shared between the handle and its background tasks.
pub(super) struct Shared {
    /// Counters (metrics).
    pub(super) stats: SourceStats,
    /// Environments the consumer wants (what `subscribe`/`unsubscribe` edit).
    pub(super) desired: Mutex<BTreeMap<EnvId, u64>>,
    /// Environments Redis confirmed on the current connection(s) (kept by the reconciler).
    pub(super) confirmed: Mutex<BTreeMap<EnvId, Confirmed>>,
    /// Source of subscribe generations.
    pub(super) generations: AtomicU64,
    /// Wakes the reconciler.
    pub(super) wake: Notify,
    /// A (re)connect or lost subscriptions the reconciler has not handled yet.
    pub(super) resync: Mutex<Resync>,
    /// Set once `connect` returned: a connection established after that (including a first
    /// connection that came up in the background) leaves a gap and is announced.
    pub(super) connect_returned: AtomicBool,
    /// Sharded mode: slot owners from the last `CLUSTER SLOTS` of the shard check.
    pub(super) routing: Mutex<Option<SlotMap>>,
    /// Runs the shard check now (after a reconnect) instead of at its next tick.
    pub(super) check_now: Notify,
}

/// Work for the reconciler: subscriptions the server(s) forgot, and whether the consumer must be
/// told about the gap once everything is subscribed again (`announce`).
#[derive(Default)]
pub(super) struct Resync {
    /// Every subscription is gone (single server or classic mode reconnected; missed events).
    pub(super) all: bool,
    /// Sharded mode: nodes that (re)connected; the subscriptions placed on them are gone.
    pub(super) servers: BTreeSet<Server>,
    /// Sharded mode: subscriptions the shard check found gone, with the `epoch` it checked.
    pub(super) lost: Vec<(EnvId, u64)>,
    pub(super) announce: bool,
}
