//! What the checker records: the writers' log of every committed version (with commit and
//! publish times) and, per subscription, every request, response and row a reader saw.
//!
//! Times are [`Ms`]: milliseconds since the check started (one clock for writers, Rust readers
//! and npm readers; the npm readers print wall-clock epoch milliseconds, converted with
//! [`Clock::from_epoch_ms`]).

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{Map, Value};

use crate::client::RequestKind;

/// Milliseconds since the check started.
pub type Ms = f64;

/// The check's clock: wall-clock milliseconds relative to its start.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    /// Epoch milliseconds at the start.
    pub t0_epoch_ms: f64,
}

impl Clock {
    /// A clock starting now.
    pub fn start() -> Clock {
        Clock {
            t0_epoch_ms: epoch_ms_f64(),
        }
    }

    /// Milliseconds since the start.
    pub fn now(&self) -> Ms {
        epoch_ms_f64() - self.t0_epoch_ms
    }

    /// An epoch-milliseconds time (e.g. printed by a node reader) on this clock.
    pub fn from_epoch_ms(&self, epoch_ms: f64) -> Ms {
        epoch_ms - self.t0_epoch_ms
    }

    /// This clock's time as epoch milliseconds (for comparisons with `createdAt` values).
    pub fn to_epoch_ms(&self, t: Ms) -> i64 {
        (self.t0_epoch_ms + t) as i64
    }
}

/// Wall-clock epoch milliseconds (fractional).
pub fn epoch_ms_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// How a version's change record was published.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fate {
    /// Published once, right after the commit.
    Normal,
    /// Never published (a lost publish).
    Lost,
    /// Published twice.
    Duplicated,
    /// Published after a delay.
    Late,
}

/// One publish of a version's change record.
#[derive(Clone, Debug, Serialize)]
pub struct Publish {
    /// When the PUBLISH returned (or failed).
    pub at: Ms,
    /// Redis accepted it.
    pub ok: bool,
    /// Subscribers that received it (0 when not ok).
    pub receivers: u64,
    /// The record carried `tags` (else a partial record).
    pub full: bool,
    /// The record carried `updatedAtMs`.
    pub watermark: bool,
}

/// What a write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WriteOp {
    Create,
    Status,
    Metadata,
    AddTag,
    /// A metadata write that also sets a large `output` (the bulk run of the slow readers).
    Output,
}

/// One committed version of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Version {
    /// 0 for the created run, then 1, 2, … (also written into `metadata` as `ck`).
    pub ver: u32,
    /// The committed `"updatedAt"`, epoch ms (strictly increasing per run).
    pub updated_at_ms: i64,
    pub op: WriteOp,
    pub status: String,
    pub tags: Vec<String>,
    /// `metadata` as written (JSON text).
    pub metadata: String,
    /// The `ck` counter inside `metadata`: the version that last wrote the metadata.
    pub ck: Option<u32>,
    /// When the write was sent.
    pub commit_started: Ms,
    /// When the commit returned.
    pub committed: Ms,
    pub fate: Fate,
    pub publishes: Vec<Publish>,
}

impl Version {
    /// When the fleet first received this version's record: the first publish that Redis
    /// delivered to at least one subscriber (`None` when it was lost, every publish failed, or
    /// no instance was subscribed to the environment).
    pub fn announced(&self) -> Option<Ms> {
        self.publishes
            .iter()
            .filter(|p| p.ok && p.receivers > 0)
            .map(|p| p.at)
            .fold(None, |acc: Option<Ms>, t| Some(acc.map_or(t, |a| a.min(t))))
    }

    /// Whether the status is final (no further status transitions follow).
    pub fn is_final(&self) -> bool {
        FINAL_STATUSES.contains(&self.status.as_str())
    }
}

/// trigger.dev's final run statuses (`docs/trigger-dev.md` §1.2) that the writers use.
pub const FINAL_STATUSES: &[&str] = &[
    "COMPLETED_SUCCESSFULLY",
    "COMPLETED_WITH_ERRORS",
    "CANCELED",
    "SYSTEM_FAILURE",
    "CRASHED",
    "EXPIRED",
    "TIMED_OUT",
];

/// One run and all its versions.
#[derive(Clone, Debug, Serialize)]
pub struct RunLog {
    /// Internal id.
    pub id: String,
    pub friendly_id: String,
    /// Index into [`History::envs`].
    pub env: usize,
    /// Index into [`History::batches`].
    pub batch: Option<usize>,
    /// `"createdAt"`, epoch ms.
    pub created_at_ms: i64,
    pub versions: Vec<Version>,
}

impl RunLog {
    /// The version whose `updatedAt` is `ms`.
    pub fn version_at(&self, ms: i64) -> Option<&Version> {
        self.versions
            .binary_search_by_key(&ms, |v| v.updated_at_ms)
            .ok()
            .map(|i| &self.versions[i])
    }

    /// The newest version.
    pub fn last(&self) -> Option<&Version> {
        self.versions.last()
    }
}

/// An environment the writers use.
#[derive(Clone, Debug, Serialize)]
pub struct EnvLog {
    /// Internal id.
    pub id: String,
    /// A label for reports (`A`, `B`).
    pub label: String,
}

/// A batch.
#[derive(Clone, Debug, Serialize)]
pub struct BatchLog {
    pub id: String,
    pub friendly_id: String,
    pub env: usize,
}

/// An injected fault and the time it lasted.
#[derive(Clone, Debug, Serialize)]
pub struct FaultWindow {
    pub kind: FaultKind,
    pub from: Ms,
    pub to: Ms,
    pub detail: String,
}

/// The kinds of faults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    RedisRestart,
    ClusterNodeRestart,
    ReplicaDelay,
    InstanceRestart,
    /// `CLIENT PAUSE <ms> ALL` on the check's own Redis: every connection kept, nothing served.
    RedisPause,
    /// SIGSTOP of the check's own redis-server, then SIGCONT: a partition neither side sees.
    RedisFreeze,
    /// A Redis Cluster primary failed over: the master serving environment A's channel killed
    /// (its replica promoted) or replaced by `CLUSTER FAILOVER TAKEOVER` on its replica.
    ClusterFailover,
    /// Every Rust reader slot connected to one instance drops its connection and reconnects
    /// to another instance within 1 s (as after a deploy). Not an outage: the server keeps
    /// serving, each reader's own reconnect delay is its pause.
    ReconnectStorm,
}

impl FaultKind {
    /// The name used in reports and options.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::RedisRestart => "redis-restart",
            FaultKind::ClusterNodeRestart => "cluster-node-restart",
            FaultKind::ReplicaDelay => "replica-delay",
            FaultKind::InstanceRestart => "instance-restart",
            FaultKind::RedisPause => "redis-pause",
            FaultKind::RedisFreeze => "redis-freeze",
            FaultKind::ClusterFailover => "cluster-failover",
            FaultKind::ReconnectStorm => "reconnect-storm",
        }
    }

    /// Whether the fault is an outage (deliveries during it are excused from timeliness).
    pub fn is_outage(self) -> bool {
        !matches!(self, FaultKind::ReplicaDelay | FaultKind::ReconnectStorm)
    }
}

/// The writers' log.
#[derive(Clone, Debug, Default, Serialize)]
pub struct History {
    pub envs: Vec<EnvLog>,
    pub batches: Vec<BatchLog>,
    pub runs: Vec<RunLog>,
    #[serde(skip)]
    pub by_id: HashMap<String, usize>,
    #[serde(skip)]
    pub by_friendly_id: HashMap<String, usize>,
    pub faults: Vec<FaultWindow>,
    /// When the last write (and late publish) finished.
    pub writes_stopped: Ms,
    /// The replica's apply delay over time: (from, delay ms); empty without a replica.
    pub replica_delays: Vec<(Ms, u64)>,
    /// Sampled replay lag of the replica: (when, lag ms); empty without a replica.
    pub replica_lag: Vec<(Ms, f64)>,
}

impl History {
    /// Adds a run; returns its index.
    pub fn add_run(&mut self, run: RunLog) -> usize {
        let i = self.runs.len();
        self.by_id.insert(run.id.clone(), i);
        self.by_friendly_id.insert(run.friendly_id.clone(), i);
        self.runs.push(run);
        i
    }

    /// The run with internal id `id`.
    pub fn run_index(&self, id: &str) -> Option<usize> {
        self.by_id.get(id).copied()
    }

    /// Versions committed in total.
    pub fn version_count(&self) -> usize {
        self.runs.iter().map(|r| r.versions.len()).sum()
    }

    /// The replica's apply delay in effect at `t`, ms (0 without a replica).
    pub fn replica_delay_at(&self, t: Ms) -> u64 {
        self.replica_delays
            .iter()
            .rev()
            .find(|(from, _)| *from <= t)
            .or(self.replica_delays.first())
            .map_or(0, |(_, d)| *d)
    }

    /// When a commit made at `committed` had been replayed on the replica, per the lag samples:
    /// the first sample at `t` with `t − lag(t) ≥ committed` (`None` without samples, or when
    /// no sample shows it replayed).
    pub fn replica_visible_at(&self, committed: Ms) -> Option<Ms> {
        let start = self.replica_lag.partition_point(|(t, _)| *t < committed);
        self.replica_lag[start..]
            .iter()
            .find(|(t, lag)| t - lag >= committed)
            .map(|(t, _)| *t)
    }

    /// Whether `t` lies in an outage window widened by `margin` ms on both sides.
    pub fn in_outage(&self, from: Ms, to: Ms, margin: Ms) -> bool {
        self.faults
            .iter()
            .filter(|f| f.kind.is_outage())
            .any(|f| from <= f.to + margin && to >= f.from - margin)
    }
}

/// What a subscription follows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum FeedSpec {
    /// One run's feed.
    Run { run: usize },
    /// Runs of `env` carrying all `tags`, created inside `window_ms` (the `createdAt` param).
    Tag {
        env: usize,
        tags: Vec<String>,
        created_at: Option<String>,
        window_ms: Option<i64>,
    },
    /// One batch's runs.
    Batch { batch: usize },
}

impl FeedSpec {
    /// The environment of the feed.
    pub fn env(&self, h: &History) -> usize {
        match self {
            FeedSpec::Run { run } => h.runs[*run].env,
            FeedSpec::Tag { env, .. } => *env,
            FeedSpec::Batch { batch } => h.batches[*batch].env,
        }
    }

    /// A short description for reports.
    pub fn describe(&self, h: &History) -> String {
        match self {
            FeedSpec::Run { run } => format!("run feed {}", h.runs[*run].friendly_id),
            FeedSpec::Tag {
                env,
                tags,
                created_at,
                ..
            } => format!(
                "tag feed tags={}{} (env {})",
                tags.join(","),
                created_at
                    .as_ref()
                    .map(|c| format!("&createdAt={c}"))
                    .unwrap_or_default(),
                h.envs[*env].label
            ),
            FeedSpec::Batch { batch } => format!("batch feed {}", h.batches[*batch].friendly_id),
        }
    }

    /// Whether run `run` at version `v` belongs to the feed for a subscription whose `createdAt`
    /// floor was pinned at `pinned_epoch_ms` (the snapshot request's wall time); `slack_ms`
    /// widens the window downwards (the server rounds the floor down to a minute bucket).
    pub fn matches(
        &self,
        h: &History,
        run: usize,
        v: &Version,
        pinned_epoch_ms: i64,
        slack_ms: i64,
    ) -> bool {
        let r = &h.runs[run];
        match self {
            FeedSpec::Run { run: want } => *want == run,
            FeedSpec::Tag {
                env,
                tags,
                window_ms,
                ..
            } => {
                r.env == *env
                    && tags.iter().all(|t| v.tags.contains(t))
                    && window_ms.is_none_or(|w| r.created_at_ms >= pinned_epoch_ms - w - slack_ms)
            }
            FeedSpec::Batch { batch } => r.batch == Some(*batch),
        }
    }
}

/// The client a subscription used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClientKind {
    /// The Rust follower ([`crate::client::Follower`]), long-polling.
    Rust,
    /// The Rust follower in SSE live mode (`live_sse=true`, [`crate::check::sse`]), a slow
    /// reader that sometimes stops reading its stream.
    RustSse,
    /// `@electric-sql/client` 1.0.14 `ShapeStream` in node.
    NpmShape,
    /// `@trigger.dev/sdk` 4.8.3 `runs.subscribeTo…` in node.
    NpmSdk,
}

impl ClientKind {
    /// The Rust follower (long-poll or SSE): its responses carry the rows it saw.
    pub fn is_rust(self) -> bool {
        matches!(self, ClientKind::Rust | ClientKind::RustSse)
    }

    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            ClientKind::Rust => "rust",
            ClientKind::RustSse => "rust-sse",
            ClientKind::NpmShape => "npm-shape",
            ClientKind::NpmSdk => "npm-sdk",
        }
    }
}

/// A row as a reader saw it (after applying the message to its view).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RowObs {
    /// `value.id` (internal run id); for SDK rows mapped back from the friendly id.
    pub run_id: String,
    /// `insert` / `update` (`run` for SDK yields).
    pub op: String,
    /// The row's `updatedAt`, epoch ms.
    pub updated_at_ms: Option<i64>,
    /// `ck` from the row's `metadata`.
    pub ck: Option<u32>,
    pub status: Option<String>,
}

impl RowObs {
    /// Reads a view row (wire values: timestamps `YYYY-MM-DDTHH:MM:SS.mmm`, metadata text).
    pub fn from_wire(op: &str, row: &Map<String, Value>) -> RowObs {
        RowObs {
            run_id: row
                .get("id")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            op: op.to_string(),
            updated_at_ms: row
                .get("updatedAt")
                .and_then(Value::as_str)
                .and_then(parse_wire_timestamp),
            ck: row.get("metadata").and_then(metadata_ck),
            status: row
                .get("status")
                .and_then(Value::as_str)
                .map(str::to_string),
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SS.mmm` (UTC, no zone; `docs/protocol.md` §3.7) → epoch ms.
pub fn parse_wire_timestamp(s: &str) -> Option<i64> {
    chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S%.f")
        .ok()
        .map(|dt| dt.and_utc().timestamp_millis())
}

/// The `ck` counter from a `metadata` value: JSON text (wire) or an object (SDK).
pub fn metadata_ck(v: &Value) -> Option<u32> {
    let obj = match v {
        Value::String(s) => serde_json::from_str::<Value>(s).ok()?,
        other => other.clone(),
    };
    obj.get("ck")?.as_u64().and_then(|n| u32::try_from(n).ok())
}

/// One thing that happened to a subscription.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum Event {
    /// A request was sent.
    Request {
        id: u32,
        at: Ms,
        instance: usize,
        kind: RequestKind,
        offset: String,
        /// Sent with another feed's handle on purpose (must be a 409).
        foreign: bool,
    },
    /// A response arrived (Rust: with the rows it carried; npm: status only).
    Response {
        req: u32,
        at: Ms,
        status: u16,
        offset: Option<String>,
        /// Rows (Rust readers; the view's row after applying each change).
        rows: Vec<RowObs>,
        /// Read completely, then discarded without applying (a lost response).
        dropped: bool,
    },
    /// A request produced no response (aborted by the reader, refused, timed out).
    Failed {
        req: u32,
        at: Ms,
        error: String,
        /// The reader aborted it on purpose.
        aborted: bool,
    },
    /// Rows an npm reader's client delivered (a `ShapeStream` batch or SDK yields).
    Rows {
        at: Ms,
        rows: Vec<RowObs>,
        /// The snapshot request these rows answer, when they are the snapshot's rows.
        snapshot_of: Option<u32>,
        /// The rows are all the snapshot carried (absent runs were absent).
        complete: bool,
    },
    /// The client dropped its view (409 must-refetch).
    Reset { at: Ms },
    /// The reader paused between polls, or stopped reading its SSE stream (a slow reader).
    Paused { from: Ms, to: Ms },
    /// An SSE stream (a [`RequestKind::Sse`] request answered 200) ended; its batches were
    /// logged as [`Event::Response`]s to that request. A stream that failed for any other
    /// reason is an [`Event::Failed`].
    StreamEnded { req: u32, at: Ms, how: StreamEnd },
}

/// How an SSE stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StreamEnd {
    /// The server ended it cleanly (`feeds.sse_max_duration_ms`, a drain, a failed hold).
    Closed,
    /// It broke after the reader had stopped reading for longer than the server's
    /// `feeds.sse_stall_timeout_ms`: the server's stall bound ended it (expected).
    StalledOut,
    /// The reader closed it (its subscription ended).
    ReaderClosed,
}

impl Event {
    /// When it happened.
    pub fn at(&self) -> Ms {
        match self {
            Event::Request { at, .. }
            | Event::Response { at, .. }
            | Event::Failed { at, .. }
            | Event::Rows { at, .. }
            | Event::StreamEnded { at, .. }
            | Event::Reset { at } => *at,
            Event::Paused { from, .. } => *from,
        }
    }
}

/// Everything one subscription did.
#[derive(Clone, Debug, Serialize)]
pub struct SubLog {
    pub id: usize,
    /// The reader slot that ran it (`r3`, `n1`).
    pub reader: String,
    pub client: ClientKind,
    pub feed: FeedSpec,
    /// The request parameters, as sent (`skipColumns` …) for reports.
    pub url: String,
    pub started: Ms,
    pub ended: Option<Ms>,
    pub events: Vec<Event>,
}

impl SubLog {
    /// The request with id `id`.
    pub fn request(&self, id: u32) -> Option<&Event> {
        self.events
            .iter()
            .find(|e| matches!(e, Event::Request { id: i, .. } if *i == id))
    }

    /// Requests sent to a different instance than the previous request.
    pub fn hops(&self) -> usize {
        let mut last = None;
        let mut hops = 0;
        for e in &self.events {
            if let Event::Request { instance, .. } = e {
                if last.is_some_and(|l| l != *instance) {
                    hops += 1;
                }
                last = Some(*instance);
            }
        }
        hops
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn wire_rows_parse() {
        let row = json!({"id": "r", "updatedAt": "2025-01-01T00:00:02.005", "metadata": "{\"ck\":7,\"n\":1}", "status": "EXECUTING"});
        let obs = RowObs::from_wire("update", row.as_object().unwrap());
        assert_eq!(obs.updated_at_ms, Some(1_735_689_602_005));
        assert_eq!(obs.ck, Some(7));
        assert_eq!(obs.status.as_deref(), Some("EXECUTING"));
        assert_eq!(metadata_ck(&json!({"ck": 3})), Some(3));
    }
}
