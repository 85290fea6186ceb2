//! Every metric runfeed exports, in one place (the reference's instruments, docs/behaviours.md §2.1, plus
//! what an operator of this server needs).
//!
//! Names are `runfeed.<area>.<name>` with UCUM units; the Prometheus exporter turns dots into
//! underscores, appends the unit (`ms` → `_milliseconds`, `By` → `_bytes`; annotations such as
//! `{feed}` add nothing) and `_total` to counters. The Prometheus name of each instrument is
//! given in its doc line.
//!
//! Two kinds of instruments:
//! - **synchronous** ones, recorded through the methods of [`Metrics`] from small hooks in the
//!   feeds, the run-set readers and the HTTP middleware;
//! - **observable** ones, declared in [`observed`] and registered through [`Metrics::observe`]
//!   by the wiring (`app::observe`), whose callbacks read counters the code keeps anyway (router
//!   stats, the gate, the Postgres store, the Redis source) at collection time, so nothing is
//!   counted twice. This module imports nothing above it.
//!
//! Counters with a fixed label set are created with every label combination at zero, so their
//! series exist (and `rate()` works) from the first scrape.

use std::borrow::Cow;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use opentelemetry::metrics::{
    AsyncInstrument, BoundHistogram, Counter, Histogram, Meter, MeterProvider,
};
use opentelemetry::KeyValue;

use crate::cache::FastMap;

/// Meter (instrumentation scope) name: the `otel_scope_name` label of every series.
pub const METER_NAME: &str = "runfeed";

/// runfeed's version (Cargo.toml's `version`): `runfeed --version` and the `version` label of
/// `runfeed_build_info`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit the binary was built from, when the build set the `RUNFEED_BUILD_COMMIT`
/// environment variable (the Dockerfile's build argument of that name); `"unknown"` otherwise.
/// The `commit` label of `runfeed_build_info`.
pub const BUILD_COMMIT: &str = match option_env!("RUNFEED_BUILD_COMMIT") {
    Some(commit) if !commit.is_empty() => commit,
    _ => "unknown",
};

/// Bucket bounds for latencies of writes reaching clients, ms (the hold is ~20 s).
const LAG_BOUNDS_MS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1_000.0, 2_500.0, 5_000.0, 10_000.0,
    20_000.0, 30_000.0,
];
/// Bucket bounds for HTTP request durations, ms (snapshots: ms; live polls: up to the hold).
const HTTP_BOUNDS_MS: &[f64] = &[
    1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1_000.0, 2_500.0, 5_000.0, 10_000.0, 15_000.0,
    20_000.0, 25_000.0, 30_000.0,
];
/// Bucket bounds for store query latencies, ms.
const QUERY_BOUNDS_MS: &[f64] = &[
    0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1_000.0, 2_500.0, 5_000.0, 10_000.0,
];
/// Bucket bounds for rows per emission.
const ROW_BOUNDS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1_000.0,
];

/// Which path a live response's rows came through (`path` label of delivery lag and emitted
/// rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeliveryPath {
    /// Replayed from the router's buffer when the poll registered (a change between polls).
    Replay,
    /// The cold re-check at registration (the change stream could not vouch for the gap).
    Cold,
    /// A router wake (change record → hydrate once → inbox): the fast path.
    Notify,
    /// A store re-check during the hold (a gap was reported: reconnect, failed hydrate).
    Recheck,
    /// The backstop re-read at the end of the hold (a change nobody announced).
    Backstop,
    /// Answered early because the server is draining.
    Drain,
}

impl DeliveryPath {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryPath::Replay => "replay",
            DeliveryPath::Cold => "cold",
            DeliveryPath::Notify => "notify",
            DeliveryPath::Recheck => "recheck",
            DeliveryPath::Backstop => "backstop",
            DeliveryPath::Drain => "drain",
        }
    }
}

/// Path events of the live loop (`path` label of `runfeed.feeds.live_polls`, reference names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LivePath {
    /// A wake carrying rows the router hydrated for the changed runs only.
    FastHydrate,
    /// The store re-read at registration (no cursor the stream can vouch for).
    ColdResolve,
    /// A store re-read of the whole set during the hold (gap reported).
    FullResolve,
}

impl LivePath {
    const ALL: [LivePath; 3] = [
        LivePath::FastHydrate,
        LivePath::ColdResolve,
        LivePath::FullResolve,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            LivePath::FastHydrate => "fast-hydrate",
            LivePath::ColdResolve => "cold-resolve",
            LivePath::FullResolve => "full-resolve",
        }
    }
}

/// How a live poll's wait ended (`reason` label of `runfeed.feeds.wakeups`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WakeReason {
    /// The router woke the feed.
    Notify,
    /// The hold expired (the backstop follows).
    Timeout,
    /// The client went away, or the server is draining.
    Abort,
}

impl WakeReason {
    const ALL: [WakeReason; 3] = [WakeReason::Notify, WakeReason::Timeout, WakeReason::Abort];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            WakeReason::Notify => "notify",
            WakeReason::Timeout => "timeout",
            WakeReason::Abort => "abort",
        }
    }
}

/// Outcome of a run-set read through the shared cache (`result` label of
/// `runfeed.runset.resolves`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResolveResult {
    /// Served from the cache.
    Hit,
    /// This caller ran the query.
    Miss,
    /// Joined a query another caller had in flight.
    Coalesced,
}

impl ResolveResult {
    const ALL: [ResolveResult; 3] = [
        ResolveResult::Hit,
        ResolveResult::Miss,
        ResolveResult::Coalesced,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ResolveResult::Hit => "hit",
            ResolveResult::Miss => "miss",
            ResolveResult::Coalesced => "coalesced",
        }
    }
}

/// What became of a feed request carrying a run token while `auth.run_token_upstream` is set
/// (`outcome` label of `runfeed.http.run_token_forwards`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardOutcome {
    /// The webapp answered (any status); its answer was streamed back.
    Answered,
    /// The webapp could not be reached, or sent no response head in time: a JSON 503.
    Unavailable,
    /// Not forwarded: the path is not a canonical feed route (an id outside
    /// `[A-Za-z0-9_-]{1,128}`, or a query that cannot be rebuilt): a JSON 404.
    Refused,
}

impl ForwardOutcome {
    const ALL: [ForwardOutcome; 3] = [
        ForwardOutcome::Answered,
        ForwardOutcome::Unavailable,
        ForwardOutcome::Refused,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ForwardOutcome::Answered => "answered",
            ForwardOutcome::Unavailable => "unavailable",
            ForwardOutcome::Refused => "refused",
        }
    }
}

/// The three feed routes (`route` label of `runfeed.http.run_token_forwards`), as the HTTP
/// layer names them.
pub const FEED_ROUTES: [&str; 3] = [
    "/realtime/v1/runs/{run_id}",
    "/realtime/v1/runs",
    "/realtime/v1/batches/{batch_id}",
];

/// Feed kinds (`kind` label).
pub const FEED_KINDS: [&str; 3] = ["run", "tag", "batch"];

/// The synchronous instruments, and the registration of the observable ones.
///
/// Cheap to share (`Arc<Metrics>`); [`Metrics::noop`] records nothing (for services built
/// without telemetry, e.g. in unit tests).
pub struct Metrics {
    /// `runfeed.feeds.delivery_lag` (ms; Prometheus `runfeed_feeds_delivery_lag_milliseconds`):
    /// now − the newest emitted row's `updatedAt` per live emission, by `path`
    /// ([`DeliveryPath`]); app clock vs the writer's clock, negatives clamped to 0. The
    /// end-to-end SLI.
    pub delivery_lag: KeyedHistogram<DeliveryPath, f64>,
    /// `runfeed.feeds.emitted_rows` (`{row}`; `runfeed_feeds_emitted_rows`): rows per live
    /// emission, by `path`.
    pub emitted_rows: KeyedHistogram<DeliveryPath, u64>,
    /// `runfeed.feeds.live_polls` (`runfeed_feeds_live_polls_total`): live-loop path events by
    /// `path` ([`LivePath`]); one poll can add several.
    pub live_polls: FixedCounter,
    /// `runfeed.feeds.wakeups` (`runfeed_feeds_wakeups_total`): how live waits ended, by
    /// `reason` ([`WakeReason`]). A rising `timeout` share means publishes are not reaching
    /// feeds.
    pub wakeups: FixedCounter,
    /// `runfeed.feeds.backstops` (`runfeed_feeds_backstops_total`): backstop re-reads at the
    /// end of a hold by `result` = `delivered` | `empty`. Sustained `delivered` = the
    /// notify/replay path leaks.
    pub backstops: FixedCounter,
    /// `runfeed.feeds.state_lookups` (`runfeed_feeds_state_lookups_total`): lookups of this
    /// instance's per-connection state (working set + replay cursor of the offset the client
    /// echoes) by `result` = `hit` | `miss` (instance hop, expired, or never handed out; the
    /// shared cursor store is asked next).
    pub state_lookups: FixedCounter,
    /// `runfeed.runset.resolves` (`runfeed_runset_resolves_total`): reads through the shared
    /// run-set cache by `result` ([`ResolveResult`]) and feed `kind`.
    pub resolves: FixedCounter,
    /// `runfeed.runset.query_duration` (ms; `runfeed_runset_query_duration_milliseconds`):
    /// store resolve + hydrate latency of run-set reads that reached Postgres, by `kind` and
    /// `result` = `ok` | `error`.
    pub query_duration: Histogram<f64>,
    /// `runfeed.runset.admission_waits` (`runfeed_runset_admission_waits_total`): fresh
    /// resolves that waited ≥ 1 ms for an admission permit.
    pub admission_waits: Counter<u64>,
    /// `runfeed.http.requests` (`runfeed_http_requests_total`): HTTP requests by `route`
    /// (matched path, `unmatched` for 404s outside the routes), `method` and `status` (`499`
    /// = the client went away before the response).
    pub http_requests: KeyedCounter<(Cow<'static, str>, Cow<'static, str>, u16)>,
    /// `runfeed.http.duration` (ms; `runfeed_http_duration_milliseconds`): time to the response
    /// head by `route`, `status` and `live` (`true` = the poll hold duration).
    pub http_duration: KeyedHistogram<(&'static str, u16, Liveness), f64>,
    /// `runfeed.http.sent` (By; `runfeed_http_sent_bytes_total`): response body bytes by
    /// `route`.
    pub http_sent: KeyedCounter<Cow<'static, str>>,
    /// `runfeed.http.run_token_forwards` (`runfeed_http_run_token_forwards_total`): feed
    /// requests carrying a run token, forwarded to `auth.run_token_upstream`, by `route`
    /// ([`FEED_ROUTES`]) and `outcome` ([`ForwardOutcome`]).
    pub run_token_forwards: FixedCounter,
    /// `runfeed.pg.acquire_wait` (ms; `runfeed_pg_acquire_wait_milliseconds`): how long a
    /// store read waited for a pooled connection. Growing = the pool is the bottleneck.
    pub pg_acquire_wait: Histogram<f64>,
    /// `runfeed.router.hydrate_batch` (`{run}`; `runfeed_router_hydrate_batch`): runs per router
    /// hydrate query (all environments of a batch, one query per column set).
    pub hydrate_batch: Histogram<u64>,
    meter: Meter,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// `result` label values of `runfeed.feeds.backstops`, in [`Metrics::backstop`]'s index order.
const BACKSTOP_RESULTS: [&str; 2] = ["delivered", "empty"];
/// `result` label values of `runfeed.feeds.state_lookups`, in [`Metrics::state_lookup`]'s order.
const LOOKUP_RESULTS: [&str; 2] = ["hit", "miss"];

/// A counter whose label sets are all known up front (an enum's values): counted with one
/// relaxed atomic add per event and reported at collection as an OTel observable counter, every
/// label set from zero. A synchronous OTel counter looks its attribute set up on every `add`;
/// these count on every live poll (BENCHMARKS.md "Cost per unit of work").
pub struct FixedCounter {
    counts: Arc<[std::sync::atomic::AtomicU64]>,
}

impl FixedCounter {
    /// The instrument `spec`, one series per entry of `labels` (indexed as [`FixedCounter::add`]
    /// takes them).
    fn new(meter: &Meter, spec: &Recorded, labels: Vec<Vec<KeyValue>>) -> FixedCounter {
        let counts: Arc<[std::sync::atomic::AtomicU64]> =
            labels.iter().map(|_| Default::default()).collect();
        let read = counts.clone();
        observable_counter(meter, spec, move |o| {
            for (count, attrs) in read.iter().zip(&labels) {
                o.observe(count.load(std::sync::atomic::Ordering::Relaxed), attrs);
            }
        });
        FixedCounter { counts }
    }

    /// One event of the label set at `index`.
    fn add(&self, index: usize) {
        if let Some(count) = self.counts.get(index) {
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Events counted for the label set at `index` so far.
    pub fn get(&self, index: usize) -> u64 {
        self.counts
            .get(index)
            .map_or(0, |c| c.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// A counter whose label sets are not all known up front but few (route × method × status):
/// counted with a read-locked lookup and one relaxed atomic add per event, reported at
/// collection as an OTel observable counter (a label set appears once counted). A synchronous
/// OTel counter hashes and sorts its attributes on every `add`; these count on every request
/// (BENCHMARKS.md "Cost per unit of work").
pub struct KeyedCounter<K> {
    counts: Arc<parking_lot::RwLock<FastMap<K, std::sync::atomic::AtomicU64>>>,
}

impl<K> KeyedCounter<K>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
{
    /// The instrument `spec`; `attrs` names a key's label set at collection.
    fn new(
        meter: &Meter,
        spec: &Recorded,
        attrs: impl Fn(&K) -> Vec<KeyValue> + Send + Sync + 'static,
    ) -> KeyedCounter<K> {
        let counts: Arc<parking_lot::RwLock<FastMap<K, std::sync::atomic::AtomicU64>>> =
            Arc::default();
        let read = counts.clone();
        observable_counter(meter, spec, move |o| {
            let counts = read.read();
            for (key, count) in counts.iter() {
                o.observe(
                    count.load(std::sync::atomic::Ordering::Relaxed),
                    &attrs(key),
                );
            }
        });
        KeyedCounter { counts }
    }

    /// Adds `n` to the label set `key`.
    fn add(&self, key: K, n: u64) {
        let counts = self.counts.read();
        if let Some(count) = counts.get(&key) {
            count.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        drop(counts);
        let mut counts = self.counts.write();
        counts
            .entry(key)
            .or_default()
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A histogram whose label sets are not all known up front but few (an enum's values, route ×
/// status × liveness): each label set is bound once, on its first record, to the OTel SDK's
/// bound instrument (`Histogram::bind`), found again by a read-locked lookup of its key. An
/// unbound OTel histogram hashes, and on a miss sorts, its attributes on every record
/// (≈ 1 400 instructions each); these record on every request and delivery (BENCHMARKS.md
/// "Cost per unit of work"). A label set appears at collection once recorded.
pub struct KeyedHistogram<K, T> {
    histogram: Histogram<T>,
    attrs: fn(&K) -> Vec<KeyValue>,
    bound: parking_lot::RwLock<FastMap<K, BoundHistogram<T>>>,
}

impl<K, T> KeyedHistogram<K, T>
where
    K: std::hash::Hash + Eq + Clone,
{
    /// Records into `histogram`; `attrs` names a key's label set (called once per key).
    fn new(histogram: Histogram<T>, attrs: fn(&K) -> Vec<KeyValue>) -> KeyedHistogram<K, T> {
        KeyedHistogram {
            histogram,
            attrs,
            bound: parking_lot::RwLock::default(),
        }
    }

    /// Records `value` for the label set `key`.
    fn record(&self, key: K, value: T) {
        if let Some(bound) = self.bound.read().get(&key) {
            bound.record(value);
            return;
        }
        let mut bound = self.bound.write();
        let histogram = &self.histogram;
        let attrs = self.attrs;
        bound
            .entry(key)
            .or_insert_with_key(|key| histogram.bind(&attrs(key)))
            .record(value);
    }
}

/// The `path` label of a delivery's histograms.
fn delivery_path_attrs(path: &DeliveryPath) -> Vec<KeyValue> {
    vec![kv("path", path.as_str())]
}

/// Whether a request was a live poll (`live=true`): the `live` label of `runfeed.http.duration`
/// (a live poll's duration is its hold).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Liveness {
    /// `live=true`.
    Live,
    /// Any other request (a snapshot, a catch-up, `/healthz`).
    NotLive,
}

/// Registers the observable counter `spec`; `report` observes its series at each collection.
fn observable_counter<K>(
    meter: &Meter,
    spec: &Instrument<K>,
    report: impl Fn(&dyn AsyncInstrument<u64>) + Send + Sync + 'static,
) {
    meter
        .u64_observable_counter(spec.name)
        .with_unit(spec.unit)
        .with_description(spec.description)
        .with_callback(move |o| report(o))
        .build();
}

fn counter(meter: &Meter, spec: &Recorded) -> Counter<u64> {
    meter
        .u64_counter(spec.name)
        .with_unit(spec.unit)
        .with_description(spec.description)
        .build()
}

fn f64_histogram(meter: &Meter, spec: &Recorded, bounds: &[f64]) -> Histogram<f64> {
    meter
        .f64_histogram(spec.name)
        .with_unit(spec.unit)
        .with_description(spec.description)
        .with_boundaries(bounds.to_vec())
        .build()
}

fn u64_histogram(meter: &Meter, spec: &Recorded, bounds: &[f64]) -> Histogram<u64> {
    meter
        .u64_histogram(spec.name)
        .with_unit(spec.unit)
        .with_description(spec.description)
        .with_boundaries(bounds.to_vec())
        .build()
}

/// Route patterns and methods runfeed serves: their labels are static strings, so a request's
/// metrics allocate nothing. Anything else (a route added later) is copied.
const STATIC_LABELS: &[&str] = &[
    "/realtime/v1/runs/{run_id}",
    "/realtime/v1/runs",
    "/realtime/v1/batches/{batch_id}",
    "/healthz",
    crate::telemetry::http::UNMATCHED,
    "GET",
    "POST",
    "OPTIONS",
    "HEAD",
];

/// `value` as a label, static when it is one of [`STATIC_LABELS`].
fn label(value: &str) -> Cow<'static, str> {
    match STATIC_LABELS.iter().find(|known| **known == value) {
        Some(known) => Cow::Borrowed(known),
        None => Cow::Owned(value.to_string()),
    }
}

/// A [`label`] as an OTel value (no copy for a static one: the variant matters, so the `Cow`
/// itself is taken).
#[allow(clippy::ptr_arg)]
fn label_value(label: &Cow<'static, str>) -> opentelemetry::Value {
    match label {
        Cow::Borrowed(known) => opentelemetry::Value::from(*known),
        Cow::Owned(other) => opentelemetry::Value::from(other.clone()),
    }
}

fn kv(key: &'static str, value: &'static str) -> KeyValue {
    KeyValue::new(key, value)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

impl Metrics {
    /// Creates every synchronous instrument on `meter` (fixed label sets start at zero).
    pub fn new(meter: &Meter) -> Metrics {
        let m = Metrics {
            delivery_lag: KeyedHistogram::new(
                f64_histogram(meter, &recorded::FEEDS_DELIVERY_LAG, LAG_BOUNDS_MS),
                delivery_path_attrs,
            ),
            emitted_rows: KeyedHistogram::new(
                u64_histogram(meter, &recorded::FEEDS_EMITTED_ROWS, ROW_BOUNDS),
                delivery_path_attrs,
            ),
            live_polls: FixedCounter::new(
                meter,
                &recorded::FEEDS_LIVE_POLLS,
                LivePath::ALL.map(|p| vec![kv("path", p.as_str())]).to_vec(),
            ),
            wakeups: FixedCounter::new(
                meter,
                &recorded::FEEDS_WAKEUPS,
                WakeReason::ALL
                    .map(|r| vec![kv("reason", r.as_str())])
                    .to_vec(),
            ),
            backstops: FixedCounter::new(
                meter,
                &recorded::FEEDS_BACKSTOPS,
                BACKSTOP_RESULTS.map(|r| vec![kv("result", r)]).to_vec(),
            ),
            state_lookups: FixedCounter::new(
                meter,
                &recorded::FEEDS_STATE_LOOKUPS,
                LOOKUP_RESULTS.map(|r| vec![kv("result", r)]).to_vec(),
            ),
            resolves: FixedCounter::new(
                meter,
                &recorded::RUNSET_RESOLVES,
                ResolveResult::ALL
                    .iter()
                    .flat_map(|result| {
                        FEED_KINDS.map(|kind| vec![kv("result", result.as_str()), kv("kind", kind)])
                    })
                    .collect(),
            ),
            query_duration: f64_histogram(meter, &recorded::RUNSET_QUERY_DURATION, QUERY_BOUNDS_MS),
            admission_waits: counter(meter, &recorded::RUNSET_ADMISSION_WAITS),
            http_requests: KeyedCounter::new(
                meter,
                &recorded::HTTP_REQUESTS,
                |(route, method, status)| {
                    vec![
                        KeyValue::new("route", label_value(route)),
                        KeyValue::new("method", label_value(method)),
                        KeyValue::new("status", i64::from(*status)),
                    ]
                },
            ),
            http_duration: KeyedHistogram::new(
                f64_histogram(meter, &recorded::HTTP_DURATION, HTTP_BOUNDS_MS),
                |(route, status, live)| {
                    vec![
                        KeyValue::new("route", *route),
                        KeyValue::new("status", i64::from(*status)),
                        KeyValue::new("live", *live == Liveness::Live),
                    ]
                },
            ),
            http_sent: KeyedCounter::new(meter, &recorded::HTTP_SENT, |route| {
                vec![KeyValue::new("route", label_value(route))]
            }),
            run_token_forwards: FixedCounter::new(
                meter,
                &recorded::HTTP_RUN_TOKEN_FORWARDS,
                FEED_ROUTES
                    .iter()
                    .flat_map(|route| {
                        ForwardOutcome::ALL.map(|outcome| {
                            vec![kv("route", route), kv("outcome", outcome.as_str())]
                        })
                    })
                    .collect(),
            ),
            pg_acquire_wait: f64_histogram(meter, &recorded::PG_ACQUIRE_WAIT, QUERY_BOUNDS_MS),
            hydrate_batch: u64_histogram(meter, &recorded::ROUTER_HYDRATE_BATCH, ROW_BOUNDS),
            meter: meter.clone(),
        };
        m.admission_waits.add(0, &[]);
        m
    }

    /// A shared instance that records nothing.
    pub fn noop() -> Arc<Metrics> {
        static NOOP: OnceLock<Arc<Metrics>> = OnceLock::new();
        NOOP.get_or_init(|| {
            let provider = opentelemetry::metrics::NoopMeterProvider::new();
            Arc::new(Metrics::new(&provider.meter(METER_NAME)))
        })
        .clone()
    }

    /// One live emission of `rows` rows (nothing when 0) whose newest row was updated at
    /// `newest_ms` (epoch ms): records `emitted_rows` and `delivery_lag` for `path`.
    pub fn emitted(&self, path: DeliveryPath, rows: usize, newest_ms: Option<i64>) {
        if rows == 0 {
            return;
        }
        self.emitted_rows
            .record(path, u64::try_from(rows).unwrap_or(u64::MAX));
        if let Some(newest) = newest_ms {
            let lag = (crate::clock::now_ms() - newest).max(0);
            self.delivery_lag.record(path, lag as f64);
        }
    }

    /// A live-loop path event.
    pub fn live_poll(&self, path: LivePath) {
        self.live_polls.add(path as usize);
    }

    /// A live wait ended.
    pub fn wakeup(&self, reason: WakeReason) {
        self.wakeups.add(reason as usize);
    }

    /// A backstop re-read; `delivered` = it found changes the client did not have.
    pub fn backstop(&self, delivered: bool) {
        self.backstops.add(usize::from(!delivered));
    }

    /// A lookup of this instance's per-connection state.
    pub fn state_lookup(&self, hit: bool) {
        self.state_lookups.add(usize::from(!hit));
    }

    /// A read through the shared run-set cache.
    pub fn resolve(&self, kind: &'static str, result: ResolveResult) {
        let kind = FEED_KINDS.iter().position(|k| *k == kind).unwrap_or(0);
        self.resolves.add(result as usize * FEED_KINDS.len() + kind);
    }

    /// A run-set store read took `took`.
    pub fn run_set_query(&self, kind: &'static str, ok: bool, took: Duration) {
        self.query_duration.record(
            ms(took),
            &[
                kv("kind", kind),
                kv("result", if ok { "ok" } else { "error" }),
            ],
        );
    }

    /// A fresh resolve waited `waited` for its admission permit (counted from 1 ms).
    pub fn admission_waited(&self, waited: Duration) {
        if waited >= Duration::from_millis(1) {
            self.admission_waits.add(1, &[]);
        }
    }

    /// A [`LiveGuard`] for one live poll: counts a `abort` wakeup unless
    /// [`LiveGuard::finish`]ed (the poll's future was dropped: the client went away).
    pub fn live_guard(self: &Arc<Self>) -> LiveGuard {
        LiveGuard {
            metrics: Some(self.clone()),
        }
    }

    /// One finished HTTP request on `route` (a route pattern, `unmatched` for any other path),
    /// answered `status` after `took`.
    pub fn http_request(
        &self,
        route: &'static str,
        method: &str,
        status: u16,
        live: Liveness,
        took: Duration,
    ) {
        self.http_requests
            .add((Cow::Borrowed(route), label(method), status), 1);
        self.http_duration.record((route, status, live), ms(took));
    }

    /// A feed request with a run token on `route` (one of [`FEED_ROUTES`]) ended `outcome`.
    pub fn run_token_forward(&self, route: &str, outcome: ForwardOutcome) {
        let route = FEED_ROUTES.iter().position(|r| *r == route).unwrap_or(0);
        self.run_token_forwards
            .add(route * ForwardOutcome::ALL.len() + outcome as usize);
    }

    /// A store read waited `took` for its pooled connection.
    pub fn pg_acquired(&self, took: Duration) {
        self.pg_acquire_wait.record(ms(took), &[]);
    }

    /// One router hydrate query for `runs` runs.
    pub fn hydrated_batch(&self, runs: usize) {
        self.hydrate_batch
            .record(u64::try_from(runs).unwrap_or(u64::MAX), &[]);
    }

    /// `bytes` of response body sent on `route`.
    pub fn http_bytes(&self, route: &str, bytes: u64) {
        self.http_sent.add(label(route), bytes);
    }

    /// Registers the observable instrument `spec`; `callback` reports its current value(s) at
    /// every collection (`o.observe(value, &labels)`). The wiring attaches one callback per
    /// instrument of [`observed`] (`app::observe`).
    pub fn observe(
        &self,
        spec: &'static Observed,
        callback: impl Fn(&dyn AsyncInstrument<u64>) + Send + Sync + 'static,
    ) {
        match spec.kind {
            ObservedKind::Counter => observable_counter(&self.meter, spec, callback),
            ObservedKind::Gauge => {
                self.meter
                    .u64_observable_gauge(spec.name)
                    .with_unit(spec.unit)
                    .with_description(spec.description)
                    .with_callback(callback)
                    .build();
            }
        }
    }
}

/// An instrument's declaration: a [`Recorded`] or an [`Observed`], told apart by its kind.
#[derive(Clone, Copy, Debug)]
pub struct Instrument<K> {
    /// Instrument name (`runfeed.<area>.<name>`).
    pub name: &'static str,
    /// Counter or histogram ([`RecordedKind`]), counter or gauge ([`ObservedKind`]).
    pub kind: K,
    /// UCUM unit.
    pub unit: &'static str,
    /// Names of the labels its series carry (besides `otel_scope_name`).
    pub labels: &'static [&'static str],
    /// Description (the Prometheus HELP text).
    pub description: &'static str,
}

/// The kind of an [`Instrument`], as the metric reference names it.
pub trait InstrumentKind: Copy {
    /// `counter`, `histogram` or `gauge`.
    fn as_str(self) -> &'static str;
}

impl<K: InstrumentKind> Instrument<K> {
    /// The instrument as the metric reference lists it.
    fn exported(&self) -> Exported {
        let kind = self.kind.as_str();
        Exported {
            prometheus: prometheus_name(self.name, self.unit, kind == "counter"),
            name: self.name,
            kind,
            unit: self.unit,
            labels: self.labels,
            description: self.description,
        }
    }
}

/// Whether a synchronous instrument is a counter or a histogram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordedKind {
    /// Monotonic sum (Prometheus `_total`).
    Counter,
    /// Distribution (Prometheus `_bucket`, `_sum`, `_count`).
    Histogram,
}

impl InstrumentKind for RecordedKind {
    fn as_str(self) -> &'static str {
        match self {
            RecordedKind::Counter => "counter",
            RecordedKind::Histogram => "histogram",
        }
    }
}

/// A synchronous instrument, declared here once; [`Metrics::new`] builds it and the metric
/// reference (`runfeed metrics-reference`) lists it.
pub type Recorded = Instrument<RecordedKind>;

/// Every synchronous instrument of [`Metrics`].
pub mod recorded {
    use super::{Recorded, RecordedKind};

    /// `runfeed.feeds.delivery_lag` (histogram).
    pub const FEEDS_DELIVERY_LAG: Recorded = Recorded {
        name: "runfeed.feeds.delivery_lag",
        kind: RecordedKind::Histogram,
        unit: "ms",
        labels: &["path"],
        description:
            "Now minus the newest emitted row's updatedAt, per live emission, by delivery path",
    };

    /// `runfeed.feeds.emitted_rows` (histogram).
    pub const FEEDS_EMITTED_ROWS: Recorded = Recorded {
        name: "runfeed.feeds.emitted_rows",
        kind: RecordedKind::Histogram,
        unit: "{row}",
        labels: &["path"],
        description: "Rows per live emission, by delivery path",
    };

    /// `runfeed.feeds.live_polls` (counter).
    pub const FEEDS_LIVE_POLLS: Recorded = Recorded {
        name: "runfeed.feeds.live_polls",
        kind: RecordedKind::Counter,
        unit: "{event}",
        labels: &["path"],
        description: "Live-loop path events: fast-hydrate (router wake), cold-resolve (registration re-read), full-resolve (re-read on a gap)",
    };

    /// `runfeed.feeds.wakeups` (counter).
    pub const FEEDS_WAKEUPS: Recorded = Recorded {
        name: "runfeed.feeds.wakeups",
        kind: RecordedKind::Counter,
        unit: "{wakeup}",
        labels: &["reason"],
        description: "How live waits ended: notify, timeout (backstop follows) or abort (client gone, draining)",
    };

    /// `runfeed.feeds.backstops` (counter).
    pub const FEEDS_BACKSTOPS: Recorded = Recorded {
        name: "runfeed.feeds.backstops",
        kind: RecordedKind::Counter,
        unit: "{backstop}",
        labels: &["result"],
        description: "Backstop re-reads at the end of a hold: delivered (a missed change; should be ~0) or empty",
    };

    /// `runfeed.feeds.state_lookups` (counter).
    pub const FEEDS_STATE_LOOKUPS: Recorded = Recorded {
        name: "runfeed.feeds.state_lookups",
        kind: RecordedKind::Counter,
        unit: "{lookup}",
        labels: &["result"],
        description:
            "Lookups of this instance's per-connection state (working set, replay cursor) by result",
    };

    /// `runfeed.runset.resolves` (counter).
    pub const RUNSET_RESOLVES: Recorded = Recorded {
        name: "runfeed.runset.resolves",
        kind: RecordedKind::Counter,
        unit: "{resolve}",
        labels: &["result", "kind"],
        description: "Run-set reads through the shared cache: hit, miss (ran the query) or coalesced (joined one in flight)",
    };

    /// `runfeed.runset.query_duration` (histogram).
    pub const RUNSET_QUERY_DURATION: Recorded = Recorded {
        name: "runfeed.runset.query_duration",
        kind: RecordedKind::Histogram,
        unit: "ms",
        labels: &["kind", "result"],
        description:
            "Latency of run-set store reads (resolve and hydrate), by feed kind and result",
    };

    /// `runfeed.runset.admission_waits` (counter).
    pub const RUNSET_ADMISSION_WAITS: Recorded = Recorded {
        name: "runfeed.runset.admission_waits",
        kind: RecordedKind::Counter,
        unit: "{wait}",
        labels: &[],
        description: "Fresh resolves that waited at least 1 ms for an admission permit",
    };

    /// `runfeed.http.requests` (counter).
    pub const HTTP_REQUESTS: Recorded = Recorded {
        name: "runfeed.http.requests",
        kind: RecordedKind::Counter,
        unit: "{request}",
        labels: &["route", "method", "status"],
        description: "HTTP requests by route, method and status (499: client went away)",
    };

    /// `runfeed.http.duration` (histogram).
    pub const HTTP_DURATION: Recorded = Recorded {
        name: "runfeed.http.duration",
        kind: RecordedKind::Histogram,
        unit: "ms",
        labels: &["route", "status", "live"],
        description:
            "Time to the response head by route, status and live (live=true: the poll hold)",
    };

    /// `runfeed.http.sent` (counter).
    pub const HTTP_SENT: Recorded = Recorded {
        name: "runfeed.http.sent",
        kind: RecordedKind::Counter,
        unit: "By",
        labels: &["route"],
        description: "Response body bytes sent, by route",
    };

    /// `runfeed.http.run_token_forwards` (counter).
    pub const HTTP_RUN_TOKEN_FORWARDS: Recorded = Recorded {
        name: "runfeed.http.run_token_forwards",
        kind: RecordedKind::Counter,
        unit: "{request}",
        labels: &["route", "outcome"],
        description: "Feed requests carrying a run token forwarded to auth.run_token_upstream, by route and outcome: answered (the webapp's answer streamed back), unavailable (503) or refused (not a canonical feed path: 404)",
    };

    /// `runfeed.pg.acquire_wait` (histogram).
    pub const PG_ACQUIRE_WAIT: Recorded = Recorded {
        name: "runfeed.pg.acquire_wait",
        kind: RecordedKind::Histogram,
        unit: "ms",
        labels: &[],
        description: "Time a store read waited for a pooled Postgres connection",
    };

    /// `runfeed.router.hydrate_batch` (histogram).
    pub const ROUTER_HYDRATE_BATCH: Recorded = Recorded {
        name: "runfeed.router.hydrate_batch",
        kind: RecordedKind::Histogram,
        unit: "{run}",
        labels: &[],
        description:
            "Runs per router hydrate query (all environments of a batch, one query per column set)",
    };

    /// All of them, in declaration order.
    pub const ALL: [&Recorded; 15] = [
        &FEEDS_DELIVERY_LAG,
        &FEEDS_EMITTED_ROWS,
        &FEEDS_LIVE_POLLS,
        &FEEDS_WAKEUPS,
        &FEEDS_BACKSTOPS,
        &FEEDS_STATE_LOOKUPS,
        &RUNSET_RESOLVES,
        &RUNSET_QUERY_DURATION,
        &RUNSET_ADMISSION_WAITS,
        &HTTP_REQUESTS,
        &HTTP_DURATION,
        &HTTP_SENT,
        &HTTP_RUN_TOKEN_FORWARDS,
        &PG_ACQUIRE_WAIT,
        &ROUTER_HYDRATE_BATCH,
    ];
}

/// Whether an observable instrument is a monotonic counter or a gauge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObservedKind {
    /// Monotonic sum (Prometheus `_total`).
    Counter,
    /// Current value.
    Gauge,
}

impl InstrumentKind for ObservedKind {
    fn as_str(self) -> &'static str {
        match self {
            ObservedKind::Counter => "counter",
            ObservedKind::Gauge => "gauge",
        }
    }
}

/// An instrument whose value is read at collection time, declared here once; the wiring
/// (`app::observe`) attaches the callback that reads it.
pub type Observed = Instrument<ObservedKind>;

/// Every observable instrument, and what the wiring reads into it (`app::observe`).
///
/// | Instrument | Prometheus | Source |
/// |---|---|---|
/// | `runfeed.router.held_feeds` {feed}, `kind` | `runfeed_router_held_feeds` | `Router::held_feeds` |
/// | `runfeed.router.active_envs` | `runfeed_router_active_envs` | `Router::active_envs` (incl. lingering) |
/// | `runfeed.router.hydrates`, `result` = ok \| error | `runfeed_router_hydrates_total` | `RouterStats::hydrates`, `hydrate_errors` |
/// | `runfeed.router.hydrated_runs` | `runfeed_router_hydrated_runs_total` | `RouterStats::hydrated_rows` |
/// | `runfeed.router.deliveries` | `runfeed_router_deliveries_total` | `RouterStats::deliveries` (Σ feed × row) |
/// | `runfeed.router.distinct_runs` | `runfeed_router_distinct_runs_total` | `RouterStats::distinct_runs` (Σ column set × run) |
/// | `runfeed.router.replays`, `result` | `runfeed_router_replays_total` | `RouterStats::replays_*` |
/// | `runfeed.router.replay_evictions`, `reason` = window \| cap | `runfeed_router_replay_evictions_total` | `RouterStats::evictions_*` |
/// | `runfeed.router.stale_hydrates` {run}, `outcome` = recovered \| gave_up | `runfeed_router_stale_hydrates_total` | `RouterStats::stale_*` |
/// | `runfeed.notifier.batches_delivered` | `runfeed_notifier_batches_delivered_total` | `RouterStats::coalesced_batches` (hydrate batches) |
/// | `runfeed.router.arrivals` | `runfeed_router_arrivals_total` | `RouterStats::batches` (arrivals routed) |
/// | `runfeed.router.queue_overflows` {record} | `runfeed_router_queue_overflows_total` | `RouterStats::overflows` |
/// | `runfeed.notifier.messages_received` | `runfeed_notifier_messages_received_total` | Redis source |
/// | `runfeed.notifier.active_subscriptions` | `runfeed_notifier_active_subscriptions` | Redis source (confirmed channels) |
/// | `runfeed.notifier.publishes`, `result` = ok \| error | `runfeed_notifier_publishes_total` | this process's `redis::Publisher`s |
/// | `runfeed.replica.lag_estimate` (ms) | `runfeed_replica_lag_estimate_milliseconds` | `router::Gate::estimate_ms` (only with a gate) |
/// | `runfeed.replica.gate_waits`, `outcome` = waited \| gave_up | `runfeed_replica_gate_waits_total` | `Gate::waited`, `gave_up` (only with a gate) |
/// | `runfeed.feeds.cursor_store_ops`, `op`, `result` | `runfeed_feeds_cursor_store_ops_total` | `redis::CursorStats` (only with shared cursors) |
/// | `runfeed.feeds.concurrency_rejections` | `runfeed_feeds_concurrency_rejections_total` | `feeds::admit::LimiterStats` (429s) |
/// | `runfeed.feeds.working_set_size` {entry} | `runfeed_feeds_working_set_size` | `Feeds::working_set_size` |
/// | `runfeed.feeds.window_runs` {run} | `runfeed_feeds_window_runs` | `Feeds::window_runs` |
/// | `runfeed.runset.admission_in_use` {permit} | `runfeed_runset_admission_in_use` | `Feeds::admission_in_use` |
/// | `runfeed.feeds.stalled_streams` | `runfeed_feeds_stalled_streams_total` | `http::sse::stalled_streams` (process-wide) |
/// | `runfeed.http.refused_connections` | `runfeed_http_refused_connections_total` | `http::serve::refused_connections` (process-wide) |
/// | `runfeed.http.accept_errors` | `runfeed_http_accept_errors_total` | `http::serve::accept_errors` (process-wide) |
/// | `runfeed.pg.queries` | `runfeed_pg_queries_total` | `PgStore::query_count` |
/// | `runfeed.pg.errors`, `kind` | `runfeed_pg_errors_total` | `PgStore::error_counts` (process-wide) |
/// | `runfeed.pg.tag_set_plans`, `plan` = planner \| ordered | `runfeed_pg_tag_set_plans_total` | `PgStore::tag_plan_counts` |
/// | `runfeed.pg.replica_bypassed` | `runfeed_pg_replica_bypassed` | `PgStore::replica_bypassed` (1 = replica reads go to the primary) |
/// | `runfeed.redis.errors`, `kind` = connection \| command \| lagged \| lost_subscription \| limiter_fallback | `runfeed_redis_errors_total` | Redis source |
/// | `runfeed.redis.connected` | `runfeed_redis_connected` | Redis source (1 = up) |
/// | `runfeed.redis.commands`, `purpose` = cursor_read \| cursor_write \| concurrency | `runfeed_redis_commands_total` | `redis::CommandCounts` |
/// | `runfeed.process.resident_memory` (By) | `runfeed_process_resident_memory_bytes` | `/proc/self/status` VmRSS |
/// | `runfeed.build_info`, `version`, `commit` | `runfeed_build_info` (always 1) | [`VERSION`], [`BUILD_COMMIT`] |
pub mod observed {
    use super::{Observed, ObservedKind};

    /// `runfeed.router.held_feeds` (gauge).
    pub const ROUTER_HELD_FEEDS: Observed = Observed {
        name: "runfeed.router.held_feeds",
        kind: ObservedKind::Gauge,
        unit: "{feed}",
        labels: &["kind"],
        description: "Feeds held by a live poll now, by kind: the capacity unit",
    };

    /// `runfeed.router.active_envs` (gauge).
    pub const ROUTER_ACTIVE_ENVS: Observed = Observed {
        name: "runfeed.router.active_envs",
        kind: ObservedKind::Gauge,
        unit: "{environment}",
        labels: &[],
        description: "Environments routed now (including lingering ones)",
    };

    /// `runfeed.replica.lag_estimate` (gauge).
    pub const REPLICA_LAG_ESTIMATE: Observed = Observed {
        name: "runfeed.replica.lag_estimate",
        kind: ObservedKind::Gauge,
        unit: "ms",
        labels: &[],
        description: "Current replica-lag estimate of the read-your-writes gate (clock rule)",
    };

    /// `runfeed.replica.gate_waits` (counter).
    pub const REPLICA_GATE_WAITS: Observed = Observed {
        name: "runfeed.replica.gate_waits",
        kind: ObservedKind::Counter,
        unit: "{wait}",
        labels: &["outcome"],
        description: "Read-your-writes gate waits that actually waited for the replica, or gave up at max_delay_ms",
    };

    /// `runfeed.feeds.working_set_size` (gauge).
    pub const FEEDS_WORKING_SET_SIZE: Observed = Observed {
        name: "runfeed.feeds.working_set_size",
        kind: ObservedKind::Gauge,
        unit: "{entry}",
        labels: &[],
        description: "Per-connection feed states kept (working sets and replay cursors), including expired but unswept",
    };

    /// `runfeed.feeds.window_runs` (gauge).
    pub const FEEDS_WINDOW_RUNS: Observed = Observed {
        name: "runfeed.feeds.window_runs",
        kind: ObservedKind::Gauge,
        unit: "{run}",
        labels: &[],
        description: "Runs held by busy environments' windows (feeds.window_after_resolves), from which tag snapshots take their run ids; bounded by feeds.window_max_runs",
    };

    /// `runfeed.feeds.cursor_store_ops` (counter).
    pub const FEEDS_CURSOR_STORE_OPS: Observed = Observed {
        name: "runfeed.feeds.cursor_store_ops",
        kind: ObservedKind::Counter,
        unit: "{operation}",
        labels: &["op", "result"],
        description: "Fleet-shared replay cursor store (Redis) operations: get hit/miss/error, set ok/error; errors degrade instance hops into cold resolves",
    };

    /// `runfeed.redis.commands` (counter).
    pub const REDIS_COMMANDS: Observed = Observed {
        name: "runfeed.redis.commands",
        kind: ObservedKind::Counter,
        unit: "{command}",
        labels: &["purpose"],
        description: "Commands sent to Redis on behalf of feeds, counted where sent (a script call counts once): cursor_read, cursor_write (one per batch of responses; on a Cluster one per environment and batch), concurrency (admission and lease scripts, re-stamps, releases)",
    };

    /// `runfeed.feeds.concurrency_rejections` (counter).
    pub const FEEDS_CONCURRENCY_REJECTIONS: Observed = Observed {
        name: "runfeed.feeds.concurrency_rejections",
        kind: ObservedKind::Counter,
        unit: "{request}",
        labels: &[],
        description: "Live polls rejected with 429 by the per-environment concurrency limit",
    };

    /// `runfeed.runset.admission_in_use` (gauge).
    pub const RUNSET_ADMISSION_IN_USE: Observed = Observed {
        name: "runfeed.runset.admission_in_use",
        kind: ObservedKind::Gauge,
        unit: "{permit}",
        labels: &[],
        description: "Resolve admission permits held now",
    };

    /// `runfeed.feeds.stalled_streams` (counter).
    pub const FEEDS_STALLED_STREAMS: Observed = Observed {
        name: "runfeed.feeds.stalled_streams",
        kind: ObservedKind::Counter,
        unit: "{stream}",
        labels: &[],
        description: "SSE streams ended because their client stopped reading: the queue stayed full (feeds.sse_max_queued_bytes / _events) with nothing taken for feeds.sse_stall_timeout_ms; process-wide",
    };

    /// `runfeed.http.refused_connections` (counter).
    pub const HTTP_REFUSED_CONNECTIONS: Observed = Observed {
        name: "runfeed.http.refused_connections",
        kind: ObservedKind::Counter,
        unit: "{connection}",
        labels: &[],
        description: "Connections accepted only to be closed unserved because the process was out of file descriptors (EMFILE/ENFILE); process-wide",
    };

    /// `runfeed.http.accept_errors` (counter).
    pub const HTTP_ACCEPT_ERRORS: Observed = Observed {
        name: "runfeed.http.accept_errors",
        kind: ObservedKind::Counter,
        unit: "{error}",
        labels: &[],
        description: "Failed accepts (out of descriptors, aborted connections); with descriptors exhausted one per backoff step (5 ms doubling to 1 s); process-wide",
    };

    /// `runfeed.pg.queries` (counter).
    pub const PG_QUERIES: Observed = Observed {
        name: "runfeed.pg.queries",
        kind: ObservedKind::Counter,
        unit: "{query}",
        labels: &[],
        description: "Postgres queries issued",
    };

    /// `runfeed.pg.errors` (counter).
    pub const PG_ERRORS: Observed = Observed {
        name: "runfeed.pg.errors",
        kind: ObservedKind::Counter,
        unit: "{error}",
        labels: &["kind"],
        description: "Postgres errors by kind: connection (also a query with no answer within database.statement_timeout_ms + 1 s), pool_timeout, database (SQL, statement timeout), other (decoding); process-wide",
    };

    /// `runfeed.pg.tag_set_plans` (counter).
    pub const PG_TAG_SET_PLANS: Observed = Observed {
        name: "runfeed.pg.tag_set_plans",
        kind: ObservedKind::Counter,
        unit: "{read}",
        labels: &["plan"],
        description: "Tag set reads by plan: planner (the plain statement, planned by Postgres), ordered (the ordered scan of a small environment's window, chosen from the planner's own estimates)",
    };

    /// `runfeed.pg.replica_bypassed` (gauge).
    pub const PG_REPLICA_BYPASSED: Observed = Observed {
        name: "runfeed.pg.replica_bypassed",
        kind: ObservedKind::Gauge,
        unit: "",
        labels: &[],
        description: "Whether replica reads go to the primary (1) because database.replica_url is not in recovery (promoted), or to the replica (0)",
    };

    /// `runfeed.notifier.messages_received` (counter).
    pub const NOTIFIER_MESSAGES_RECEIVED: Observed = Observed {
        name: "runfeed.notifier.messages_received",
        kind: ObservedKind::Counter,
        unit: "{message}",
        labels: &[],
        description: "Raw change-record messages received from Redis, before coalescing",
    };

    /// `runfeed.notifier.active_subscriptions` (gauge).
    pub const NOTIFIER_ACTIVE_SUBSCRIPTIONS: Observed = Observed {
        name: "runfeed.notifier.active_subscriptions",
        kind: ObservedKind::Gauge,
        unit: "{channel}",
        labels: &[],
        description: "Environment channels Redis confirmed on the current subscriber connection",
    };

    /// `runfeed.notifier.publishes` (counter).
    pub const NOTIFIER_PUBLISHES: Observed = Observed {
        name: "runfeed.notifier.publishes",
        kind: ObservedKind::Counter,
        unit: "{publish}",
        labels: &["result"],
        description: "Change-record publishes by this process (tooling, demo) by result; errors make feeds fall back to backstops",
    };

    /// `runfeed.redis.errors` (counter).
    pub const REDIS_ERRORS: Observed = Observed {
        name: "runfeed.redis.errors",
        kind: ObservedKind::Counter,
        unit: "{error}",
        labels: &["kind"],
        description: "Redis errors: connection (drops, failed connects), command (SUBSCRIBE/UNSUBSCRIBE), lagged (messages lost to a full buffer), lost_subscription (sharded subscriptions found gone), limiter_fallback (concurrency admissions decided locally because Redis failed or was slow)",
    };

    /// `runfeed.redis.connected` (gauge).
    pub const REDIS_CONNECTED: Observed = Observed {
        name: "runfeed.redis.connected",
        kind: ObservedKind::Gauge,
        unit: "{connection}",
        labels: &[],
        description: "Whether the Redis subscriber connection is up (1) or not (0)",
    };

    /// `runfeed.process.resident_memory` (gauge).
    pub const PROCESS_RESIDENT_MEMORY: Observed = Observed {
        name: "runfeed.process.resident_memory",
        kind: ObservedKind::Gauge,
        unit: "By",
        labels: &[],
        description: "Resident set size of this process (VmRSS)",
    };

    /// `runfeed.build_info` (gauge, always 1): which build is running, as labels `version`
    /// ([`super::VERSION`]) and `commit` ([`super::BUILD_COMMIT`]), for joining onto other series
    /// and spotting a fleet running mixed versions.
    pub const BUILD_INFO: Observed = Observed {
        name: "runfeed.build_info",
        kind: ObservedKind::Gauge,
        unit: "",
        labels: &["version", "commit"],
        description: "Always 1; the labels say which runfeed build is running (version, commit)",
    };

    /// `runfeed.router.hydrates` (counter).
    pub const ROUTER_HYDRATES: Observed = Observed {
        name: "runfeed.router.hydrates",
        kind: ObservedKind::Counter,
        unit: "{query}",
        labels: &["result"],
        description: "Router hydrate queries (live and replay) by result",
    };

    /// `runfeed.router.hydrated_runs` (counter).
    pub const ROUTER_HYDRATED_RUNS: Observed = Observed {
        name: "runfeed.router.hydrated_runs",
        kind: ObservedKind::Counter,
        unit: "{run}",
        labels: &[],
        description: "Rows returned by router hydrates (live and replay)",
    };

    /// `runfeed.router.deliveries` (counter).
    pub const ROUTER_DELIVERIES: Observed = Observed {
        name: "runfeed.router.deliveries",
        kind: ObservedKind::Counter,
        unit: "{delivery}",
        labels: &[],
        description: "Sum of (feed, row) deliveries per routed batch",
    };

    /// `runfeed.router.distinct_runs` (counter).
    pub const ROUTER_DISTINCT_RUNS: Observed = Observed {
        name: "runfeed.router.distinct_runs",
        kind: ObservedKind::Counter,
        unit: "{run}",
        labels: &[],
        description: "Sum of distinct (column set, run) per routed batch; deliveries / distinct_runs = fan-out",
    };

    /// `runfeed.router.replays` (counter).
    pub const ROUTER_REPLAYS: Observed = Observed {
        name: "runfeed.router.replays",
        kind: ObservedKind::Counter,
        unit: "{replay}",
        labels: &["result"],
        description: "Replays that hydrated: delivered rows or found nothing for the feed",
    };

    /// `runfeed.router.replay_evictions` (counter).
    pub const ROUTER_REPLAY_EVICTIONS: Observed = Observed {
        name: "runfeed.router.replay_evictions",
        kind: ObservedKind::Counter,
        unit: "{record}",
        labels: &["reason"],
        description: "Replay-buffer evictions: window (aged out) or cap (an env churns more runs than the buffer holds)",
    };

    /// `runfeed.router.stale_hydrates` (counter).
    pub const ROUTER_STALE_HYDRATES: Observed = Observed {
        name: "runfeed.router.stale_hydrates",
        kind: ObservedKind::Counter,
        unit: "{run}",
        labels: &["outcome"],
        description: "Runs the stale tripwire withheld: recovered by a retry, or delivered stale after the retries (gave_up)",
    };

    /// `runfeed.notifier.batches_delivered` (counter).
    pub const NOTIFIER_BATCHES_DELIVERED: Observed = Observed {
        name: "runfeed.notifier.batches_delivered",
        kind: ObservedKind::Counter,
        unit: "{batch}",
        labels: &[],
        description: "Hydrate batches the router started (records of every environment that arrived together or while a hydrate was in flight); messages_received / batches_delivered = coalesce ratio",
    };

    /// `runfeed.router.arrivals` (counter).
    pub const ROUTER_ARRIVALS: Observed = Observed {
        name: "runfeed.router.arrivals",
        kind: ObservedKind::Counter,
        unit: "{arrival}",
        labels: &[],
        description: "Change-record arrivals routed through the index of held feeds (sequenced and buffered for replay, whether or not a feed matched)",
    };

    /// `runfeed.router.queue_overflows` (counter).
    pub const ROUTER_QUEUE_OVERFLOWS: Observed = Observed {
        name: "runfeed.router.queue_overflows",
        kind: ObservedKind::Counter,
        unit: "{record}",
        labels: &[],
        description: "Change records dropped because router.max_queued_records were already waiting for a hydrate (the store is slow or down); each drop makes its environment's feeds re-read from the store",
    };

    /// All of them, in declaration order.
    pub const ALL: [&Observed; 34] = [
        &ROUTER_HELD_FEEDS,
        &ROUTER_ACTIVE_ENVS,
        &REPLICA_LAG_ESTIMATE,
        &REPLICA_GATE_WAITS,
        &FEEDS_WORKING_SET_SIZE,
        &FEEDS_WINDOW_RUNS,
        &FEEDS_CURSOR_STORE_OPS,
        &FEEDS_CONCURRENCY_REJECTIONS,
        &RUNSET_ADMISSION_IN_USE,
        &PG_QUERIES,
        &PG_ERRORS,
        &PG_TAG_SET_PLANS,
        &PG_REPLICA_BYPASSED,
        &NOTIFIER_MESSAGES_RECEIVED,
        &NOTIFIER_ACTIVE_SUBSCRIPTIONS,
        &NOTIFIER_PUBLISHES,
        &REDIS_ERRORS,
        &REDIS_CONNECTED,
        &REDIS_COMMANDS,
        &PROCESS_RESIDENT_MEMORY,
        &BUILD_INFO,
        &FEEDS_STALLED_STREAMS,
        &HTTP_REFUSED_CONNECTIONS,
        &HTTP_ACCEPT_ERRORS,
        &ROUTER_HYDRATES,
        &ROUTER_HYDRATED_RUNS,
        &ROUTER_DELIVERIES,
        &ROUTER_DISTINCT_RUNS,
        &ROUTER_REPLAYS,
        &ROUTER_REPLAY_EVICTIONS,
        &ROUTER_STALE_HYDRATES,
        &NOTIFIER_BATCHES_DELIVERED,
        &ROUTER_ARRIVALS,
        &ROUTER_QUEUE_OVERFLOWS,
    ];
}

/// One instrument as Prometheus sees it: a row of the metric reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exported {
    /// The Prometheus metric family name (`runfeed_…`; histograms add `_bucket`, `_sum`,
    /// `_count` to it).
    pub prometheus: String,
    /// The OpenTelemetry instrument name (`runfeed.<area>.<name>`).
    pub name: &'static str,
    /// `counter`, `histogram` or `gauge`.
    pub kind: &'static str,
    /// UCUM unit.
    pub unit: &'static str,
    /// Label names.
    pub labels: &'static [&'static str],
    /// What it means.
    pub description: &'static str,
}

/// The Prometheus family name of an instrument: dots become underscores, the unit is appended
/// (`ms` → `_milliseconds`, `By` → `_bytes`, `{…}` annotations add nothing) and counters end in
/// `_total`, as the OpenTelemetry Prometheus exporter names them.
pub fn prometheus_name(name: &str, unit: &str, counter: bool) -> String {
    let mut out = name.replace('.', "_");
    match unit {
        "ms" => out.push_str("_milliseconds"),
        "By" => out.push_str("_bytes"),
        "s" => out.push_str("_seconds"),
        _ => {}
    }
    if counter {
        out.push_str("_total");
    }
    out
}

/// Every instrument runfeed exports (synchronous and observable), sorted by Prometheus name:
/// the source of the generated metric reference.
pub fn exported() -> Vec<Exported> {
    let mut out: Vec<Exported> = recorded::ALL
        .iter()
        .map(|r| r.exported())
        .chain(observed::ALL.iter().map(|o| o.exported()))
        .collect();
    out.sort_by(|a, b| a.prometheus.cmp(&b.prometheus));
    out
}

/// Counts an `abort` wakeup when dropped unfinished (see [`Metrics::live_guard`]).
pub struct LiveGuard {
    metrics: Option<Arc<Metrics>>,
}

impl LiveGuard {
    /// The poll answered: nothing to count.
    pub fn finish(mut self) {
        self.metrics = None;
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        if let Some(m) = self.metrics.take() {
            m.wakeup(WakeReason::Abort);
        }
    }
}

/// This process's resident set size in bytes (`VmRSS` of `/proc/self/status`); `None` where
/// that file does not exist (non-Linux) or does not parse.
pub fn resident_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each fixed counter's series is the one its event names: the index an event is counted at
    /// is the position of its label set.
    #[test]
    fn fixed_counters_count_each_event_under_its_own_labels() {
        for (i, p) in LivePath::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i, "{}", p.as_str());
        }
        for (i, r) in WakeReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{}", r.as_str());
        }
        for (i, r) in ResolveResult::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{}", r.as_str());
        }
        // Its own instance: the shared no-op one counts for every test running beside this one.
        let provider = opentelemetry::metrics::NoopMeterProvider::new();
        let m = Metrics::new(&provider.meter(METER_NAME));
        let before = |m: &Metrics| {
            (
                m.backstops.get(0),
                m.backstops.get(1),
                m.state_lookups.get(0),
                m.state_lookups.get(1),
                m.resolves.get(2 * FEED_KINDS.len() + 1),
            )
        };
        let (delivered, empty, hit, miss, coalesced_tag) = before(&m);
        m.backstop(true);
        m.state_lookup(false);
        m.resolve("tag", ResolveResult::Coalesced);
        assert_eq!(m.backstops.get(0), delivered + 1);
        assert_eq!(m.backstops.get(1), empty);
        assert_eq!(m.state_lookups.get(0), hit);
        assert_eq!(m.state_lookups.get(1), miss + 1);
        assert_eq!(m.resolves.get(2 * FEED_KINDS.len() + 1), coalesced_tag + 1);
        assert_eq!(BACKSTOP_RESULTS[0], "delivered");
        assert_eq!(LOOKUP_RESULTS[1], "miss");
    }

    #[test]
    fn resident_memory_is_read() {
        let rss = resident_memory_bytes().expect("VmRSS on Linux");
        assert!(rss > 1024 * 1024, "rss {rss}");
    }

    #[test]
    fn every_instrument_is_declared_once_with_a_prometheus_name() {
        let all = exported();
        assert_eq!(all.len(), recorded::ALL.len() + observed::ALL.len());
        let mut names: Vec<&str> = all.iter().map(|e| e.prometheus.as_str()).collect();
        names.dedup();
        assert_eq!(
            names.len(),
            all.len(),
            "a Prometheus name is declared twice"
        );
        assert!(all
            .iter()
            .any(|e| e.prometheus == "runfeed_feeds_delivery_lag_milliseconds"));
        assert!(all
            .iter()
            .any(|e| e.prometheus == "runfeed_http_sent_bytes_total"));
        assert!(all
            .iter()
            .any(|e| e.prometheus == "runfeed_router_held_feeds"));
    }

    #[test]
    fn noop_records_nothing_and_does_not_panic() {
        let m = Metrics::noop();
        m.emitted(DeliveryPath::Notify, 3, Some(0));
        m.live_guard().finish();
        drop(m.live_guard());
    }
}
