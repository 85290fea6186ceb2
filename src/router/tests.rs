//! Router tests (in-memory source and store).
//!
//! Every test drives the public router API through a [`MemoryChangeSource`] and an in-memory
//! [`FakeStore`] that records each `hydrate` call (env, ids, column set) and can be told to fail
//! or to block on a gate, so races are staged deterministically. Tests run on tokio's
//! current-thread runtime (the `#[tokio::test]` default): a routed batch whose hydrate is not
//! gated completes in one poll, so "the router has processed N batches" is observable with
//! [`wait_until`] (a bounded `yield_now` loop, never a timer). Awaits that could hang are wrapped
//! in `timeout`; "nothing happened" is asserted after a fence (a later record that does match).
//!
//! Behaviour ids refer to docs/behaviours.md §1.3–§1.6; `better_*` tests pin where the
//! router must beat the reference (§4 items 2, 5, 10).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::timeout;

use super::*;
use crate::changes::{ChangeRecord, MemoryChangeSource};
use crate::config::RouterConfig;
use crate::protocol::{ColumnSet, FriendlyBatchId, FriendlyRunId, RunRow, SerializedRow};
use crate::store::{BatchResource, Found, RunResource, RunStore, StoreError};

const ENV: &str = "env_1";
const WAIT: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------------
// Fake store
// ---------------------------------------------------------------------------------------------

/// One recorded `hydrate` call.
#[derive(Clone, Debug)]
struct HydrateCall {
    env: String,
    ids: Vec<String>,
    cols: ColumnSet,
}

/// A hydrate that blocks until released: `entered` fires when the call starts (after it took
/// its snapshot of the rows), the call returns once `release` fires (or its sender is dropped).
struct Gate {
    entered: oneshot::Sender<()>,
    release: oneshot::Receiver<()>,
}

/// In-memory [`RunStore`]: rows by (env, run id); counts and records `hydrate` calls.
#[derive(Default)]
struct FakeStore {
    rows: Mutex<HashMap<(String, String), RunRow>>,
    calls: Mutex<Vec<HydrateCall>>,
    /// The next N hydrate calls fail.
    fail_next: AtomicUsize,
    /// Gates for the next hydrate calls, in call order.
    gates: Mutex<VecDeque<Gate>>,
}

impl FakeStore {
    fn put(&self, row: RunRow) {
        self.put_in(ENV, row);
    }

    fn put_in(&self, env: &str, row: RunRow) {
        self.rows
            .lock()
            .insert((env.to_string(), row.id.to_string()), row);
    }

    fn calls(&self) -> Vec<HydrateCall> {
        self.calls.lock().clone()
    }

    fn hydrate_count(&self) -> usize {
        self.calls.lock().len()
    }

    /// The id lists of every hydrate call, in call order.
    fn id_lists(&self) -> Vec<Vec<String>> {
        self.calls().into_iter().map(|c| c.ids).collect()
    }

    fn fail_next(&self, n: usize) {
        self.fail_next.store(n, Ordering::SeqCst);
    }

    /// Gates the next (not yet gated) hydrate call. Returns (entered, release).
    fn gate_next(&self) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (entered_tx, entered_rx) = oneshot::channel();
        let (release_tx, release_rx) = oneshot::channel();
        self.gates.lock().push_back(Gate {
            entered: entered_tx,
            release: release_rx,
        });
        (entered_rx, release_tx)
    }
}

/// What the store's set reads return.
type Rows = Result<Vec<RunRow>, StoreError>;
/// What the store's single lookups return.

#[async_trait]
impl RunStore for FakeStore {
    async fn hydrate(&self, env_id: &EnvId, run_ids: &[RunId], cols: ColumnSet) -> Rows {
        self.calls.lock().push(HydrateCall {
            env: env_id.to_string(),
            ids: run_ids.iter().map(RunId::to_string).collect(),
            cols,
        });
        // Snapshot semantics: the rows as they are when the query starts.
        let snapshot: Vec<RunRow> = {
            let rows = self.rows.lock();
            run_ids
                .iter()
                .filter_map(|id| rows.get(&(env_id.to_string(), id.to_string())).cloned())
                .collect()
        };
        let fail = self
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let gate = self.gates.lock().pop_front();
        if let Some(gate) = gate {
            let _ = gate.entered.send(());
            let _ = gate.release.await;
        }
        if fail {
            return Err(StoreError {
                op: "hydrate",
                source: sqlx::Error::PoolTimedOut,
            });
        }
        Ok(snapshot)
    }

    async fn read_run(&self, _: &EnvId, _: &RunId, _: ColumnSet) -> Found<RunRow> {
        unreachable!("the router only hydrates")
    }

    async fn resolve_tag_set(
        &self,
        _: &EnvId,
        _: &[String],
        _: i64,
        _: usize,
        _: ColumnSet,
    ) -> Rows {
        unreachable!("the router only hydrates")
    }

    async fn resolve_batch_set(&self, _: &EnvId, _: &BatchId, _: usize, _: ColumnSet) -> Rows {
        unreachable!("the router only hydrates")
    }

    async fn find_run(&self, _: &EnvId, _: &FriendlyRunId) -> Found<RunResource> {
        unreachable!("the router only hydrates")
    }

    async fn find_batch(&self, _: &EnvId, _: &FriendlyBatchId) -> Found<BatchResource> {
        unreachable!("the router only hydrates")
    }
}

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

fn row(id: &str, tags: &[&str], batch: Option<&str>) -> RunRow {
    RunRow {
        id: id.to_string().into(),
        task_identifier: "task".into(),
        created_at_ms: 1_000,
        updated_at_ms: 2_000,
        started_at_ms: None,
        delay_until_ms: None,
        queued_at_ms: None,
        expired_at_ms: None,
        completed_at_ms: None,
        friendly_id: format!("run_{id}").into(),
        number: 1,
        is_test: false,
        status: "EXECUTING".into(),
        usage_duration_ms: 0,
        cost_in_cents: 0.0,
        base_cost_in_cents: 0.0,
        ttl: None,
        payload: "{\"big\":\"payload\"}".into(),
        payload_type: "application/json".into(),
        metadata: None,
        metadata_type: "application/json".into(),
        output: None,
        output_type: "application/json".into(),
        run_tags: Some(tags.iter().map(|t| t.to_string()).collect()),
        error: None,
        realtime_streams: None,
        batch_id: batch.map(str::to_string).map(Into::into),
    }
}

/// Run `id` (no tags, no batch) at version `updated_at_ms`.
fn version(id: &str, updated_at_ms: i64) -> RunRow {
    RunRow {
        updated_at_ms,
        ..row(id, &[], None)
    }
}

/// A full record (tags known) without a batch.
fn full(run: &str, tags: &[&str]) -> ChangeRecord {
    ChangeRecord {
        v: 1,
        run_id: run.into(),
        env_id: ENV.into(),
        tags: Some(tags.iter().map(|t| t.to_string()).collect()),
        batch_id: None,
        updated_at_ms: None,
    }
}

/// A full record of a batch member.
fn in_batch(run: &str, batch: &str) -> ChangeRecord {
    ChangeRecord {
        batch_id: Some(batch.into()),
        ..full(run, &[])
    }
}

/// A partial record (no tags, no batch): membership unknown until hydrated.
fn partial(run: &str) -> ChangeRecord {
    ChangeRecord {
        v: 1,
        run_id: run.into(),
        env_id: ENV.into(),
        ..ChangeRecord::default()
    }
}

fn run_feed(run: &str) -> FeedFilter {
    FeedFilter::Run { run_id: run.into() }
}

fn tag_feed(tags: &[&str]) -> FeedFilter {
    FeedFilter::Tag {
        tags: tags.iter().map(|t| t.to_string()).collect(),
        floor_ms: 0,
    }
}

fn batch_feed(batch: &str) -> FeedFilter {
    FeedFilter::Batch {
        batch_id: batch.into(),
    }
}

fn cfg() -> RouterConfig {
    RouterConfig {
        coalesce_ceiling_ms: 0,
        replay_window_ms: 2_000,
        replay_max_runs: 512,
        unsubscribe_linger_ms: 5_000,
        ..RouterConfig::default()
    }
}

/// [`cfg`] with a replay window of `ms`.
fn replay_window(ms: u64) -> RouterConfig {
    RouterConfig {
        replay_window_ms: ms,
        ..cfg()
    }
}

/// [`cfg`] with an unsubscribe linger of `ms`.
fn linger(ms: u64) -> RouterConfig {
    RouterConfig {
        unsubscribe_linger_ms: ms,
        ..cfg()
    }
}

/// A registration of `filter` on [`ENV`] with all columns, since `cursor`.
fn feed(filter: FeedFilter, cursor: Option<ReplayCursor>) -> Feed {
    feed_cols(filter, ColumnSet::ALL, cursor)
}

fn feed_cols(filter: FeedFilter, cols: ColumnSet, cursor: Option<ReplayCursor>) -> Feed {
    Feed {
        env_id: crate::protocol::EnvId::from(ENV),
        filter,
        cols,
        since: cursor,
    }
}

/// A tag feed on `tags` with the `createdAt` floor `floor_ms`.
fn floored_tag_feed(tags: &[&str], floor_ms: i64) -> FeedFilter {
    FeedFilter::Tag {
        tags: strings(tags).into(),
        floor_ms,
    }
}

/// `(batches, hydrates, hydrated rows, deliveries)` counted by the router.
fn fan_out(s: &RouterStats) -> (u64, u64, u64, u64) {
    let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::SeqCst);
    (
        n(&s.batches),
        n(&s.hydrates),
        n(&s.hydrated_rows),
        n(&s.deliveries),
    )
}

fn ids(rows: &[SerializedRow]) -> Vec<String> {
    rows.iter().map(|r| r.meta.id.to_string()).collect()
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn load(counter: &std::sync::atomic::AtomicU64) -> u64 {
    counter.load(Ordering::SeqCst)
}

/// Polls `cond` between scheduler yields (no timers: safe with a paused clock).
async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..100_000 {
        if cond() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("timed out waiting until {what}");
}

/// The next wake of `reg`, or a panic after [`WAIT`].
async fn wake(reg: &Registration) -> Wake {
    timeout(WAIT, reg.wait()).await.expect("feed was not woken")
}

/// Awaits a gate's `entered` signal.
async fn entered(rx: oneshot::Receiver<()>) {
    timeout(WAIT, rx)
        .await
        .expect("gated hydrate never started")
        .expect("gate dropped");
}

/// A router over test parts (no metrics).
fn start(
    cfg: RouterConfig,
    source: Arc<dyn ChangeSource>,
    store: Arc<FakeStore>,
    events: crate::changes::EventReceiver,
    gate: Option<Arc<gate::Gate>>,
) -> Router {
    Router::start(RouterParts {
        cfg,
        source,
        store,
        events,
        gate,
        metrics: crate::telemetry::metrics::Metrics::noop(),
    })
}

struct Harness {
    router: Router,
    source: Arc<MemoryChangeSource>,
    store: Arc<FakeStore>,
}

impl Harness {
    fn new(cfg: RouterConfig) -> Harness {
        let (tx, rx) = crate::changes::event_channel();
        let source = Arc::new(MemoryChangeSource::new(tx));
        let store = Arc::new(FakeStore::default());
        let router = start(cfg, source.clone(), store.clone(), rx, None);
        Harness {
            router,
            source,
            store,
        }
    }

    /// A harness whose store holds `rows` (of [`ENV`]).
    fn with_rows(cfg: RouterConfig, rows: impl IntoIterator<Item = RunRow>) -> Harness {
        let h = Harness::new(cfg);
        for row in rows {
            h.store.put(row);
        }
        h
    }

    async fn reg(&self, filter: FeedFilter, cursor: Option<ReplayCursor>) -> Registration {
        self.reg_cols(filter, ColumnSet::ALL, cursor).await
    }

    async fn reg_cols(
        &self,
        filter: FeedFilter,
        cols: ColumnSet,
        cursor: Option<ReplayCursor>,
    ) -> Registration {
        let registering = self.router.register(feed_cols(filter, cols, cursor));
        let reg = timeout(WAIT, registering).await.expect("register hung");
        self.confirmed().await;
        reg
    }

    /// A feed that only holds [`ENV`] (it never matches), and its cursor at registration.
    async fn holder(&self) -> (Registration, ReplayCursor) {
        let holder = self.reg(run_feed("holder"), None).await;
        let c0 = holder.cursor();
        (holder, c0)
    }

    /// Waits until [`ENV`]'s current subscription is confirmed (the source reports `Subscribed`
    /// through the router's batch dispatcher; until then cursors carry no usable position).
    async fn confirmed(&self) {
        wait_until("subscription confirmed", || env_active(&self.router, ENV)).await;
    }

    /// Pushes a record on [`ENV`]; panics if the env is not subscribed.
    fn push(&self, record: ChangeRecord) {
        assert!(
            self.source.push(&crate::protocol::EnvId::from(ENV), record),
            "env not subscribed"
        );
    }

    fn batches(&self) -> u64 {
        load(&self.router.stats().batches)
    }

    /// Waits until the router has routed `n` batches (for batches without a gated hydrate, that
    /// means fully processed: routing runs in one poll on the current-thread runtime).
    async fn routed(&self, n: u64) {
        wait_until(&format!("{n} batches routed"), || self.batches() >= n).await;
    }

    fn subscribed(&self) -> bool {
        self.source
            .subscribed()
            .contains(&crate::protocol::EnvId::from(&ENV.to_string()))
    }
}

/// Whether `env` is routed and its subscription confirmed (router internals).
fn env_active(router: &Router, env: &str) -> bool {
    router
        .inner
        .env(&crate::protocol::EnvId::from(env))
        .is_some_and(|e| e.state.lock().active)
}

/// Lets spawned tasks run (a just-armed linger timer starts its sleep when first polled),
/// advances the paused clock, and lets woken tasks run.
async fn advance(ms: u64) {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    tokio::time::advance(Duration::from_millis(ms)).await;
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

// ---------------------------------------------------------------------------------------------
// §1.3 Registration, index
// ---------------------------------------------------------------------------------------------

/// RTR-01: the first registration creates the env and subscribes it; a second registration
/// reuses it (same subscription epoch); records of an unsubscribed env never reach the router.
#[tokio::test]
async fn rtr_01_first_registration_subscribes_env() {
    let h = Harness::new(cfg());
    assert!(
        !h.source
            .push(&crate::protocol::EnvId::from(ENV), full("r0", &[])),
        "not subscribed before any registration"
    );
    assert_eq!(h.router.active_envs(), 0);
    let a = h.reg(run_feed("r1"), None).await;
    assert_eq!(h.source.subscribed(), vec![ENV.to_string()]);
    assert_eq!(h.router.active_envs(), 1);
    let b = h.reg(run_feed("r2"), None).await;
    assert_eq!(h.router.active_envs(), 1);
    assert_eq!(
        a.cursor().epoch,
        b.cursor().epoch,
        "state reused, not recreated"
    );
    assert_ne!(a.cursor().epoch, 0);
}

/// RTR-01 (touch): `touch` subscribes an env without a feed and hands out a usable cursor.
#[tokio::test]
async fn rtr_01_touch_subscribes_and_returns_cursor() {
    let h = Harness::new(cfg());
    let unconfirmed = h.router.touch(&crate::protocol::EnvId::from(ENV));
    assert!(h.subscribed());
    assert_eq!(
        unconfirmed.epoch, 0,
        "no usable position before the source confirms"
    );
    h.confirmed().await;
    let c = h.router.touch(&crate::protocol::EnvId::from(ENV));
    assert_ne!(c.epoch, 0);
    assert_eq!(c.seq, 0);
    h.store.put(row("r1", &[], None));
    h.push(full("r1", &[]));
    h.routed(1).await;
    let reg = h.reg(run_feed("r1"), Some(c)).await;
    assert!(
        reg.covered(),
        "touch cursor of a live subscription is covered"
    );
    assert_eq!(
        ids(&reg.take().rows),
        vec!["r1"],
        "record after the touch cursor is replayed"
    );
}

/// RTR-02/05: every kind is indexed and counted (waiting or not); dropping de-indexes; the
/// active-env count includes a lingering env.
#[tokio::test]
async fn rtr_05_held_feed_counts_and_deregistration() {
    let h = Harness::new(cfg());
    let r = h.reg(run_feed("r1"), None).await;
    let t1 = h.reg(tag_feed(&["a"]), None).await;
    let t0 = h.reg(tag_feed(&[]), None).await;
    let b = h.reg(batch_feed("b1"), None).await;
    assert_eq!(h.router.held_feeds(), (1, 2, 1));
    drop(t1);
    assert_eq!(h.router.held_feeds(), (1, 1, 1));
    drop((r, t0, b));
    assert_eq!(h.router.held_feeds(), (0, 0, 0));
    assert_eq!(h.router.active_envs(), 1, "lingering env still counted");

    // A de-indexed feed is no longer a candidate: nothing is hydrated for it.
    let fence = h.reg(run_feed("fence"), None).await;
    h.store.put(row("r1", &["a"], Some("b1")));
    h.store.put(row("fence", &[], None));
    h.push(ChangeRecord {
        batch_id: Some("b1".into()),
        ..full("r1", &["a"])
    });
    h.push(full("fence", &[]));
    assert_eq!(ids(&wake(&fence).await.rows), vec!["fence"]);
    assert_eq!(h.store.id_lists(), vec![strings(&["fence"])]);
}

// ---------------------------------------------------------------------------------------------
// §1.4 Live routing
// ---------------------------------------------------------------------------------------------

/// RTR-10: a run feed gets only its run; the other run is not even hydrated.
#[tokio::test]
async fn rtr_10_run_feed_routes_by_exact_run_id() {
    let h = Harness::with_rows(cfg(), [row("r1", &[], None), row("r2", &[], None)]);
    let f = h.reg(run_feed("r1"), None).await;
    h.push(full("r2", &[]));
    h.push(full("r1", &[]));
    let w = wake(&f).await;
    assert_eq!(ids(&w.rows), vec!["r1"]);
    assert!(!w.recheck);
    assert_eq!(h.store.id_lists(), vec![strings(&["r1"])]);
    assert!(f.take().rows.is_empty());
}

/// RTR-11: a batch feed gets only runs of its batch; a full record without a batch never
/// reaches it (no hydrate).
#[tokio::test]
async fn rtr_11_batch_feed_routes_by_exact_batch_id() {
    let h = Harness::with_rows(
        cfg(),
        [
            row("r1", &[], Some("other")),
            row("r2", &[], None),
            row("r3", &[], Some("b1")),
        ],
    );
    let f = h.reg(batch_feed("b1"), None).await;
    h.push(in_batch("r1", "other"));
    h.push(full("r2", &[]));
    h.push(in_batch("r3", "b1"));
    assert_eq!(ids(&wake(&f).await.rows), vec!["r3"]);
    assert_eq!(h.store.id_lists(), vec![strings(&["r3"])]);
}

/// RTR-12: full records reach tag feeds whose tags overlap (deduplicated per record); a
/// non-matching tag causes no hydrate; an unfiltered tag feed gets every full record.
#[tokio::test]
async fn rtr_12_tag_overlap_and_unfiltered_tag_feed() {
    let h = Harness::with_rows(
        cfg(),
        [row("rz", &["z"], None), row("rab", &["a", "b"], None)],
    );
    let ab = h.reg(tag_feed(&["a", "b"]), None).await;
    h.push(full("rz", &["z"]));
    // Both tags match the feed: still one candidate, one row.
    h.push(full("rab", &["a", "b"]));
    let w = wake(&ab).await;
    assert_eq!(
        ids(&w.rows),
        vec!["rab"],
        "no duplicate row for a two-tag overlap"
    );
    assert_eq!(
        h.store.id_lists(),
        vec![strings(&["rab"])],
        "the [z] record was not hydrated"
    );

    let all = h.reg(tag_feed(&[]), Some(ab.cursor())).await;
    h.push(full("rz", &["z"]));
    assert_eq!(ids(&wake(&all).await.rows), vec!["rz"]);
    assert!(ab.take().rows.is_empty());
}

/// RTR-13: a partial record makes every tag feed a candidate; the hydrated row decides
/// (one hydrate for both feeds).
#[tokio::test]
async fn rtr_13_partial_record_hydrate_to_classify() {
    let h = Harness::with_rows(cfg(), [row("r1", &["a"], None), row("r2", &["z"], None)]);
    let a = h.reg(tag_feed(&["a"]), None).await;
    let z = h.reg(tag_feed(&["z"]), None).await;
    h.push(partial("r1"));
    assert_eq!(ids(&wake(&a).await.rows), vec!["r1"]);
    assert_eq!(
        h.store.id_lists(),
        vec![strings(&["r1"])],
        "one hydrate to classify for both feeds"
    );
    // Fence: a record that does match [z]; only it reaches z.
    h.push(full("r2", &["z"]));
    assert_eq!(ids(&wake(&z).await.rows), vec!["r2"]);
    assert!(a.take().rows.is_empty());
}

/// RTR-15: a batch without candidate feeds hydrates nothing.
#[tokio::test]
async fn rtr_15_no_candidate_no_hydrate() {
    let h = Harness::with_rows(
        cfg(),
        [row("r1", &["a"], Some("b1")), row("fence", &[], None)],
    );
    let fence = h.reg(run_feed("fence"), None).await;
    let _tag = h.reg(tag_feed(&["x"]), None).await;
    let _batch = h.reg(batch_feed("b2"), None).await;
    h.push(ChangeRecord {
        batch_id: Some("b1".into()),
        ..full("r1", &["a"])
    });
    h.push(full("fence", &[]));
    assert_eq!(ids(&wake(&fence).await.rows), vec!["fence"]);
    assert_eq!(h.store.hydrate_count(), 1);
    assert_eq!(load(&h.router.stats().hydrates), 1);
    assert_eq!(load(&h.router.stats().batches), 2);
}

/// RTR-15 (lingering env): records buffered while no feed is registered hydrate nothing.
#[tokio::test]
async fn rtr_15_no_feed_no_hydrate() {
    let h = Harness::new(cfg());
    drop(h.reg(run_feed("r1"), None).await);
    h.push(full("r1", &[]));
    h.push(partial("r2"));
    h.routed(2).await;
    assert_eq!(h.store.hydrate_count(), 0);
}

/// RTR-16: two tag feeds on the same tag and column set → one hydrate, and both get the SAME
/// serialized bytes (serialized once, shared).
#[tokio::test]
async fn rtr_16_two_tag_feeds_same_tag_one_hydrate_shared_bytes() {
    let h = Harness::with_rows(cfg(), [row("r1", &["t"], None)]);
    let a = h.reg(tag_feed(&["t"]), None).await;
    let b = h.reg(tag_feed(&["t"]), None).await;
    h.push(full("r1", &["t"]));
    let wa = wake(&a).await;
    let wb = wake(&b).await;
    assert_eq!(h.store.hydrate_count(), 1);
    assert_eq!(load(&h.router.stats().hydrates), 1);
    assert_eq!((wa.rows.len(), wb.rows.len()), (1, 1));
    assert_eq!(
        wa.rows[0].fragment.as_ptr(),
        wb.rows[0].fragment.as_ptr(),
        "one serialization shared by both feeds"
    );
    assert!(Arc::ptr_eq(&wa.rows[0].meta, &wb.rows[0].meta));
}

/// RTR-16, natural batching: records that arrive while a hydrate is in flight wait for it and
/// then go together: the union of their matched runs is hydrated in ONE query.
#[tokio::test]
async fn rtr_16_records_arriving_during_a_hydrate_go_together_in_the_next() {
    let h = Harness::new(cfg());
    h.store.put(row("r1", &["t"], None));
    h.store.put(row("r2", &["t"], None));
    let f = h.reg(tag_feed(&["t"]), None).await;
    let (gate_in, release) = h.store.gate_next();
    h.push(full("r1", &["t"]));
    entered(gate_in).await; // the first hydrate is in flight
    h.push(full("lead", &["other"])); // queued too; no candidate when routed
    h.push(full("r2", &["t"]));
    h.push(full("r1", &["t"]));
    h.push(full("r2", &["t"]));
    wait_until("four arrivals queued", || {
        load(&h.router.stats().coalesce_waits) == 4
    })
    .await;
    let _ = release.send(());
    let mut seen = ids(&wake(&f).await.rows);
    while seen.len() < 3 {
        seen.extend(ids(&wake(&f).await.rows));
    }
    let calls = h.store.calls();
    assert_eq!(
        calls.len(),
        2,
        "one hydrate in flight, then one for everything queued"
    );
    assert_eq!(calls[0].ids, strings(&["r1"]));
    assert_eq!(sorted(calls[1].ids.clone()), strings(&["r1", "r2"]));
    assert_eq!(load(&h.router.stats().coalesced_batches), 2);
}

/// The hydrate queue is bounded (`router.max_queued_records`): while a hydrate is stuck (the
/// store down), records beyond the bound are dropped instead of queued, each drop is a gap
/// (the environment's held feeds are told to re-read), and requests waiting for those records
/// to be routed are not left waiting.
#[tokio::test]
async fn records_beyond_the_queue_bound_are_dropped_as_a_gap_that_rechecks_the_feeds() {
    let h = Harness::new(RouterConfig {
        max_queued_records: 3,
        coalesce_ceiling_ms: 60_000, // queued records wait for the stuck hydrate
        ..cfg()
    });
    h.store.put(row("r0", &["t"], None));
    let f = h.reg(tag_feed(&["t"]), None).await;
    let (gate_in, release) = h.store.gate_next();
    h.push(full("r0", &["t"]));
    entered(gate_in).await; // the first hydrate is stuck
    for i in 1..=10 {
        h.push(full(&format!("n{i}"), &["other"]));
    }
    wait_until("7 records dropped", || {
        load(&h.router.stats().overflows) == 7
    })
    .await;
    let w = wake(&f).await;
    assert!(w.recheck, "a dropped record is a gap: the feed re-reads");
    let env = crate::protocol::EnvId::from(ENV);
    let received = h.router.received(&env);
    assert_eq!(received, 11);
    let _ = release.send(());
    wait_until("every record routed or dropped", || {
        h.router
            .inner
            .env(&env)
            .is_some_and(|e| e.routed.load(Ordering::SeqCst) == 11)
    })
    .await;
}

/// With every hydrate slot taken ([`batch::MAX_IN_FLIGHT`] batches stuck on a hung store) and
/// records queued past the ceiling, the dispatcher waits for a batch to end: it must not spin
/// on a ceiling that already passed (one core burnt for as long as the store hangs). On
/// tokio's paused clock a spinning task keeps the runtime busy, so the clock never moves and
/// the sleep below never ends; the test's own thread sees that.
#[test]
fn a_dispatcher_with_every_hydrate_stuck_waits_instead_of_spinning() {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime");
        rt.block_on(async {
            let h = Harness::new(RouterConfig {
                coalesce_ceiling_ms: 25,
                ..cfg()
            });
            let f = h.reg(tag_feed(&["t"]), None).await;
            let mut releases = Vec::new();
            for i in 0..batch::MAX_IN_FLIGHT {
                let (gate_in, release) = h.store.gate_next();
                h.store.put(row(&format!("r{i}"), &["t"], None));
                h.push(full(&format!("r{i}"), &["t"]));
                entered(gate_in).await; // each batch starts past the ceiling and sticks
                releases.push(release);
            }
            h.store.put(row("queued", &["t"], None));
            h.push(full("queued", &["t"]));
            // Past the queued record's ceiling, with no slot free.
            tokio::time::sleep(Duration::from_secs(1)).await;
            let _ = done_tx.send(());
            for release in releases {
                let _ = release.send(());
            }
            let mut seen = Vec::new();
            while !seen.contains(&"queued".to_string()) {
                seen.extend(ids(&wake(&f).await.rows));
            }
        });
    });
    assert!(
        done_rx.recv_timeout(Duration::from_secs(30)).is_ok(),
        "the clock never moved: the dispatcher spins while every hydrate is stuck"
    );
    worker
        .join()
        .expect("the queued record is delivered once the batches end");
}

/// No record waits for a window while the router is idle: on tokio's paused clock, time only
/// moves when something sleeps, and the delivery of a lone record leaves the clock where it
/// was (trigger.dev's fixed `ENV_WAKE_COALESCE_WINDOW_MS` delays every second record of an
/// environment by up to the window).
#[tokio::test(start_paused = true)]
async fn an_idle_router_hydrates_each_record_at_once_without_a_timer() {
    let h = Harness::new(RouterConfig {
        coalesce_ceiling_ms: 250,
        ..cfg()
    });
    h.store.put(row("r1", &["t"], None));
    let f = h.reg(tag_feed(&["t"]), None).await;
    let started = tokio::time::Instant::now();
    for _ in 0..3 {
        h.push(full("r1", &["t"]));
        assert_eq!(ids(&wake(&f).await.rows), vec!["r1"]);
    }
    assert_eq!(started.elapsed(), Duration::ZERO, "no timer ran");
    assert_eq!(load(&h.router.stats().coalesce_waits), 0);
    assert_eq!(h.store.hydrate_count(), 3);
}

/// A burst of 100 records on one run costs at most 3 hydrates (one per batch, not one per
/// record).
#[tokio::test]
async fn a_burst_of_100_records_on_one_run_costs_at_most_3_hydrates() {
    let h = Harness::new(cfg());
    h.store.put(row("r1", &["t"], None));
    let f = h.reg(run_feed("r1"), None).await;
    for _ in 0..100 {
        h.push(full("r1", &["t"]));
    }
    wait_until("every arrival routed", || {
        load(&h.router.stats().batches) == 100 && h.router.inner_in_flight() == 0
    })
    .await;
    assert_eq!(ids(&wake(&f).await.rows)[0], "r1");
    let hydrates = h.store.hydrate_count();
    assert!(
        (1..=3).contains(&hydrates),
        "{hydrates} hydrates for 100 records"
    );
}

/// RTR-16 fan-out: 1000 tag feeds on one tag, one record → exactly one hydrate, 1000
/// deliveries, every feed is woken (the last as surely as the first) with the (shared) row.
/// They are all woken from the hydrate task at once: that does not starve new connections,
/// because tokio polls the I/O driver every 61 task polls and runs what it wakes next
/// (`runfeed-bench fanout` reports new-connection answer times during the wake; batching the
/// wakes made them worse, BENCHMARKS.md "Fan-out").
#[tokio::test]
async fn rtr_16_thousand_tag_feeds_one_hydrate_thousand_deliveries() {
    let h = Harness::with_rows(cfg(), [row("r1", &["t"], None)]);
    let mut feeds = Vec::new();
    for _ in 0..1000 {
        feeds.push(h.reg(tag_feed(&["t"]), None).await);
    }
    assert_eq!(h.router.held_feeds(), (0, 1000, 0));
    h.push(full("r1", &["t"]));
    // Every inbox is filled before any feed is woken: one wake proves all deliveries.
    let first = wake(&feeds[0]).await.rows;
    assert_eq!(ids(&first), vec!["r1"]);
    let ptr = first[0].fragment.as_ptr();
    for f in feeds[1..].iter().rev() {
        let rows = wake(f).await.rows;
        assert_eq!(ids(&rows), vec!["r1"]);
        assert_eq!(rows[0].fragment.as_ptr(), ptr);
    }
    assert_eq!(h.store.hydrate_count(), 1);
    assert_eq!(fan_out(h.router.stats()), (1, 1, 1, 1000));
}

/// RTR-03/16: feeds with different column sets → one hydrate per column set (each with its own
/// columns), one serialization per set shared inside the set.
#[tokio::test]
async fn rtr_03_16_one_hydrate_per_column_set() {
    let h = Harness::with_rows(cfg(), [row("r1", &["t"], None)]);
    let lean = ColumnSet::from_skip_list(["payload"]);
    let a = h.reg(tag_feed(&["t"]), None).await;
    let b = h.reg_cols(tag_feed(&["t"]), lean, None).await;
    let c = h.reg(run_feed("r1"), None).await;
    let d = h.reg_cols(batch_feed("nope"), lean, None).await; // not a candidate
    h.push(full("r1", &["t"]));
    let (ra, rb, rc) = (
        wake(&a).await.rows,
        wake(&b).await.rows,
        wake(&c).await.rows,
    );
    let calls = h.store.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    let mut sets: Vec<u32> = calls.iter().map(|c| c.cols.bits()).collect();
    sets.sort();
    let mut want = vec![ColumnSet::ALL.bits(), lean.bits()];
    want.sort();
    assert_eq!(sets, want);
    assert!(calls.iter().all(|c| c.ids == strings(&["r1"])));
    assert_eq!(
        ra[0].fragment.as_ptr(),
        rc[0].fragment.as_ptr(),
        "same column set: shared bytes"
    );
    assert_ne!(ra[0].fragment.as_ptr(), rb[0].fragment.as_ptr());
    let text = |r: &SerializedRow| String::from_utf8(r.fragment.to_vec()).unwrap();
    assert!(text(&ra[0]).contains("\"payload\""));
    assert!(
        !text(&rb[0]).contains("\"payload\""),
        "lean feed does not carry skipped columns"
    );
    assert!(d.take().rows.is_empty());
    assert_eq!(load(&h.router.stats().deliveries), 3);
}

/// RTR-17: the hydrated row is re-checked: contains-ALL tags, and createdAt ≥ floor.
#[tokio::test]
async fn rtr_17_tag_feed_contains_all_and_floor() {
    let h = Harness::with_rows(
        cfg(),
        [
            row("only_a", &["a"], None),
            row("abc", &["a", "b", "c"], None),
        ],
    );
    let ab = h.reg(tag_feed(&["a", "b"]), None).await;
    h.push(full("only_a", &["a"]));
    h.push(full("abc", &["a", "b", "c"]));
    assert_eq!(ids(&wake(&ab).await.rows), vec!["abc"]);
    assert!(ab.take().rows.is_empty());
    drop(ab);

    // Floor: a row created before the floor does not wake the feed.
    let mut old = row("old", &["f"], None);
    old.created_at_ms = 1_000;
    let mut new = row("new", &["f"], None);
    new.created_at_ms = 11_000;
    h.store.put(old);
    h.store.put(new);
    let floored = h.reg(floored_tag_feed(&["f"], 11_000), None).await;
    let unfiltered = h.reg(floored_tag_feed(&[], 11_000), None).await;
    h.push(full("old", &["f"]));
    h.push(full("new", &["f"]));
    assert_eq!(ids(&wake(&floored).await.rows), vec!["new"]);
    assert_eq!(
        ids(&wake(&unfiltered).await.rows),
        vec!["new"],
        "unfiltered feed gets the floor check"
    );
    assert!(floored.take().rows.is_empty());
}

/// RTR-18/19: a candidate whose row the hydrate does not return is skipped; a feed with no
/// surviving rows is not woken (no empty wake).
#[tokio::test]
async fn rtr_18_19_missing_row_skipped_no_empty_wake() {
    let h = Harness::new(cfg());
    let f = h.reg(tag_feed(&["t"]), None).await;
    h.push(full("ghost", &["t"])); // no row in the store
    h.routed(1).await;
    wait_until("ghost hydrated", || h.store.hydrate_count() == 1).await;
    assert!(f.take().rows.is_empty());
    h.store.put(row("real", &["t"], None));
    h.push(full("real", &["t"]));
    let w = wake(&f).await;
    assert_eq!(
        ids(&w.rows),
        vec!["real"],
        "the first wake carries only the fence row"
    );
    assert_eq!(load(&h.router.stats().deliveries), 1);
}

/// RTR-20 (ours): a feed that goes away while its batch hydrates is harmless, and a feed that
/// registers while that batch is in flight gets the record by replay — its cursor never passes
/// an in-flight batch.
#[tokio::test]
async fn rtr_20_feed_registered_during_in_flight_batch_gets_it_by_replay() {
    let h = Harness::with_rows(cfg(), [row("r1", &[], None)]);
    let f = h.reg(run_feed("r1"), None).await;
    let (gate_in, release) = h.store.gate_next();
    h.push(full("r1", &[]));
    entered(gate_in).await;
    let c = f.cursor();
    assert_eq!(c.seq, 0, "cursor stops before the in-flight batch");
    drop(f); // gone while its batch hydrates

    let g = h.reg(run_feed("r1"), Some(c)).await;
    assert!(g.covered());
    assert_eq!(
        ids(&g.take().rows),
        vec!["r1"],
        "replayed, not lost to the in-flight batch"
    );
    assert_eq!(g.cursor().seq, 0);

    release.send(()).unwrap();
    wait_until("in-flight batch done", || g.cursor().seq == 1).await;
    assert_eq!(h.store.hydrate_count(), 2);
    assert!(
        g.take().rows.is_empty(),
        "the in-flight batch's matches were computed before g registered"
    );
}

/// RTR-21: a hydrate failure is contained (counted, feed not woken, routing continues).
#[tokio::test]
async fn rtr_21_hydrate_failure_is_contained() {
    let h = Harness::with_rows(cfg(), [row("r1", &[], None)]);
    let f = h.reg(run_feed("r1"), None).await;
    h.store.fail_next(1);
    h.push(full("r1", &[]));
    wait_until("hydrate failed", || {
        load(&h.router.stats().hydrate_errors) == 1
    })
    .await;
    assert!(f.take().rows.is_empty());
    h.push(full("r1", &[]));
    let w = wake(&f).await;
    assert_eq!(ids(&w.rows), vec!["r1"]);
    assert_eq!(h.store.hydrate_count(), 2);
    assert_eq!(load(&h.router.stats().hydrate_errors), 1);
    assert_eq!(load(&h.router.stats().deliveries), 1);
}

/// RTR-21 / §4 item 2: a live hydrate failure must not leave the record behind the feed's
/// cursor. After the failure the feed answers with another row; its cursor then claims the
/// failed record was "routed or answered", so the next poll neither replays it nor re-checks —
/// the change is invisible until the run changes again or a full hold hits the backstop.
/// Acceptable outcomes: the feed is told to re-check (`recheck`), or the next registration
/// with its cursor replays the record or reports the gap as not covered.
#[tokio::test]
async fn rtr_21_failed_hydrate_is_not_skipped_by_the_cursor() {
    let h = Harness::with_rows(cfg(), [row("r1", &["t"], None), row("r2", &["t"], None)]);
    let f = h.reg(tag_feed(&["t"]), None).await;
    h.store.fail_next(1);
    h.push(full("r1", &["t"]));
    wait_until("hydrate failed", || {
        load(&h.router.stats().hydrate_errors) == 1
    })
    .await;
    h.push(full("r2", &["t"]));
    let mut recheck = false;
    let mut got = Vec::new();
    for _ in 0..3 {
        let w = wake(&f).await;
        recheck |= w.recheck;
        got.extend(ids(&w.rows));
        if got.contains(&"r2".to_string()) {
            break;
        }
    }
    // The response is built: cursor first, then the final drain.
    let c = f.cursor();
    let rest = f.take();
    recheck |= rest.recheck;
    got.extend(ids(&rest.rows));
    drop(f);
    let g = h.reg(tag_feed(&["t"]), Some(c)).await;
    let replayed = ids(&g.take().rows);
    let recovered = recheck
        || got.contains(&"r1".to_string())
        || !g.covered()
        || replayed.contains(&"r1".to_string());
    assert!(
        recovered,
        "r1 lost: recheck={recheck}, got={got:?}, covered={}, replayed={replayed:?}",
        g.covered()
    );
}

/// RTR-22/23: fan-out and hydrate counters.
#[tokio::test]
async fn rtr_22_23_fan_out_and_hydrate_counters() {
    let h = Harness::with_rows(cfg(), [row("r1", &["t"], None), row("r2", &["t"], None)]);
    let a = h.reg(tag_feed(&["t"]), None).await;
    let b = h.reg(run_feed("r1"), None).await;
    h.push(full("r1", &["t"]));
    wake(&a).await;
    wake(&b).await;
    h.push(full("r2", &["t"]));
    wake(&a).await;
    assert_eq!(fan_out(h.router.stats()), (2, 2, 2, 3));
    assert_eq!(load(&h.router.stats().hydrate_errors), 0);
}

/// Better than the reference (RTR-14): a match for a registered feed that is not awaiting
/// `wake()` (building a response, cold re-check) is parked in its inbox, not dropped.
#[tokio::test]
async fn better_parked_match_for_busy_feed() {
    let h = Harness::with_rows(cfg(), [row("r1", &[], None)]);
    let busy = h.reg(run_feed("r1"), None).await;
    let witness = h.reg(run_feed("r1"), None).await;
    h.push(full("r1", &[]));
    // Inboxes are filled before anyone is woken: the witness's wake proves busy's delivery.
    assert_eq!(ids(&wake(&witness).await.rows), vec!["r1"]);
    assert_eq!(h.store.hydrate_count(), 1);
    // The busy feed now waits: the parked row is returned at once.
    let w = wake(&busy).await;
    assert_eq!(ids(&w.rows), vec!["r1"]);
    assert!(busy.take().rows.is_empty(), "drained once");

    // And with take() (the final drain of a response being built).
    h.push(full("r1", &[]));
    assert_eq!(ids(&wake(&witness).await.rows), vec!["r1"]);
    assert_eq!(ids(&busy.take().rows), vec!["r1"]);
}

/// Better than the reference (§4 item 10): a partial record reaches a batch feed when the
/// hydrated row is in its batch (live and by replay); one whose row is elsewhere does not.
#[tokio::test]
async fn better_10_partial_record_reaches_batch_feed_when_row_is_in_batch() {
    let h = Harness::with_rows(
        cfg(),
        [row("in", &[], Some("b1")), row("out", &[], Some("b2"))],
    );
    let f = h.reg(batch_feed("b1"), None).await;
    let c0 = f.cursor();
    h.push(partial("out"));
    h.push(partial("in"));
    assert_eq!(ids(&wake(&f).await.rows), vec!["in"]);
    assert!(f.take().rows.is_empty());
    // Both arrived before their hydrate started: one query for both.
    let lists: Vec<Vec<String>> = h.store.id_lists().into_iter().map(sorted).collect();
    assert_eq!(lists, vec![strings(&["in", "out"])]);

    // Replay: a batch feed registering later classifies the buffered partial records too.
    let g = h.reg(batch_feed("b1"), Some(c0)).await;
    assert!(g.covered());
    assert_eq!(ids(&g.take().rows), vec!["in"]);
    assert_eq!(
        sorted(h.store.id_lists()[1].clone()),
        strings(&["in", "out"])
    );
}

// ---------------------------------------------------------------------------------------------
// §1.5 Replay buffer
// ---------------------------------------------------------------------------------------------

/// REP-01: one buffered entry per run (merged), moved to the tail by its latest arrival.
#[tokio::test]
async fn rep_01_latest_record_per_run_moves_to_tail() {
    let h = Harness::with_rows(cfg(), [row("r1", &[], None), row("r2", &[], None)]);
    let (holder, c0) = h.holder().await;
    h.push(full("r1", &[]));
    h.push(full("r2", &[]));
    h.routed(2).await;
    let c2 = holder.cursor();
    assert_eq!(c2.seq, 2);
    h.push(full("r1", &[]));
    h.routed(3).await;

    let from_c2 = h.reg(tag_feed(&[]), Some(c2)).await;
    assert_eq!(
        h.store.id_lists(),
        vec![strings(&["r1"])],
        "only r1 arrived after c2"
    );
    assert_eq!(ids(&from_c2.take().rows), vec!["r1"]);

    let from_c0 = h.reg(tag_feed(&[]), Some(c0)).await;
    assert_eq!(
        h.store.id_lists()[1],
        strings(&["r2", "r1"]),
        "one entry per run, in arrival order of the latest"
    );
    assert_eq!(sorted(ids(&from_c0.take().rows)), strings(&["r1", "r2"]));
}

/// REP-02 + GAP-04: the cap evicts the oldest entry; a cursor before it is no longer covered
/// and the replay hydrates exactly what is left.
#[tokio::test]
async fn gap_04_evicted_cursor_not_covered() {
    let h = Harness::new(RouterConfig {
        replay_max_runs: 2,
        ..cfg()
    });
    for r in ["r1", "r2", "r3"] {
        h.store.put(row(r, &[], None));
    }
    let (holder, c0) = h.holder().await;
    h.push(full("r1", &[]));
    h.routed(1).await;
    let c1 = holder.cursor();
    h.push(full("r2", &[]));
    h.push(full("r3", &[]));
    h.routed(3).await;
    assert_eq!(load(&h.router.stats().evictions_cap), 1);

    let g = h.reg(tag_feed(&[]), Some(c0)).await;
    assert!(
        !g.covered(),
        "r1 was evicted: the gap since c0 is not provable"
    );
    assert_eq!(h.store.id_lists(), vec![strings(&["r2", "r3"])]);
    assert_eq!(sorted(ids(&g.take().rows)), strings(&["r2", "r3"]));

    let g1 = h.reg(tag_feed(&[]), Some(c1)).await;
    assert!(g1.covered(), "everything after c1 is still buffered");
    assert_eq!(sorted(ids(&g1.take().rows)), strings(&["r2", "r3"]));
    assert_eq!(
        h.store.id_lists().len(),
        1,
        "the same buffered records: g's read is shared"
    );
    drop(g1);
}

/// REP-02 (window) + GAP-04: an entry older than the window is evicted on the next insert and
/// uncovers cursors before it. (The buffer ages on tokio's clock, paused here.)
#[tokio::test(start_paused = true)]
async fn gap_04_window_eviction_uncovers_old_cursor() {
    let h = Harness::with_rows(replay_window(5), [row("r2", &[], None)]);
    let (_holder, c0) = h.holder().await;
    h.push(full("r1", &[]));
    h.routed(1).await;
    tokio::time::advance(Duration::from_millis(20)).await; // ages r1 past the 5 ms window
    h.push(full("r2", &[]));
    h.routed(2).await;
    assert_eq!(load(&h.router.stats().evictions_window), 1);
    let g = h.reg(tag_feed(&[]), Some(c0)).await;
    assert!(!g.covered());
    assert_eq!(ids(&g.take().rows), vec!["r2"]);
}

/// REP-03 / GAP-01: with replay disabled nothing is buffered or replayed, and (like the
/// reference) every registration reports the gap as covered.
#[tokio::test]
async fn rep_03_zero_window_disables_replay() {
    let h = Harness::with_rows(replay_window(0), [row("r1", &[], None)]);
    let a = h.reg(run_feed("r1"), None).await;
    assert!(a.covered(), "replay disabled: always covered (GAP-01)");
    let c = a.cursor();
    drop(a);
    h.push(full("r1", &[]));
    h.routed(1).await;
    let b = h.reg(run_feed("r1"), Some(c)).await;
    assert!(b.covered());
    assert!(b.take().rows.is_empty());
    let fresh = h.reg(run_feed("r1"), None).await;
    assert!(fresh.take().rows.is_empty());
    assert_eq!(h.store.hydrate_count(), 0);
}

/// REP-05/11: replay candidates per feed kind (run: same id; batch: same batch or partial;
/// tag: overlap or partial; unfiltered tag: everything), one hydrate per distinct set of
/// buffered records (registrations replaying the same records share it).
#[tokio::test]
async fn rep_05_replay_candidates_per_feed_kind() {
    let h = Harness::with_rows(
        cfg(),
        [
            row("r1", &["a"], Some("b1")),
            row("r2", &["b"], None),
            row("r3", &["a"], Some("b1")),
        ],
    );
    let (_holder, c0) = h.holder().await;
    h.push(ChangeRecord {
        batch_id: Some("b1".into()),
        ..full("r1", &["a"])
    });
    h.push(full("r2", &["b"]));
    h.push(partial("r3"));
    h.routed(3).await;
    assert_eq!(h.store.hydrate_count(), 0);

    let run = h.reg(run_feed("r2"), Some(c0)).await;
    assert_eq!(ids(&run.take().rows), vec!["r2"]);
    let batch = h.reg(batch_feed("b1"), Some(c0)).await;
    assert_eq!(sorted(ids(&batch.take().rows)), strings(&["r1", "r3"]));
    let tag = h.reg(tag_feed(&["a"]), Some(c0)).await;
    assert_eq!(sorted(ids(&tag.take().rows)), strings(&["r1", "r3"]));
    let other_tag = h.reg(tag_feed(&["b"]), Some(c0)).await;
    assert_eq!(
        ids(&other_tag.take().rows),
        vec!["r2"],
        "partial r3 hydrated, rejected by its row"
    );
    let unfiltered = h.reg(tag_feed(&[]), Some(c0)).await; // REP-11
    assert_eq!(
        sorted(ids(&unfiltered.take().rows)),
        strings(&["r1", "r2", "r3"])
    );

    assert_eq!(
        h.store.id_lists(),
        vec![
            strings(&["r2"]),
            strings(&["r1", "r3"]),
            strings(&["r2", "r3"]),
            strings(&["r1", "r2", "r3"]),
        ]
    );
    assert!(h
        .store
        .calls()
        .iter()
        .all(|c| c.env == ENV && c.cols == ColumnSet::ALL));
}

/// REP-07 + RTR-23: replay stats (delivered / empty) and hydrated-row counts; a replayed row
/// is authoritatively re-checked (floor) per feed, also when its read is shared, and the replay
/// uses the feed's own column set.
#[tokio::test]
async fn rep_07_replay_stats_and_authoritative_check() {
    let h = Harness::new(cfg());
    h.store.put(row("r1", &["t"], None)); // created 1 000
    let (_holder, c0) = h.holder().await;
    h.push(full("r1", &["t"]));
    h.routed(1).await;
    let lean = ColumnSet::from_skip_list(["payload"]);
    let late = h
        .reg_cols(floored_tag_feed(&["t"], 5_000), lean, Some(c0))
        .await;
    assert!(
        late.take().rows.is_empty(),
        "row below the floor is not replayed"
    );
    let s = h.router.stats();
    assert_eq!((load(&s.replays_delivered), load(&s.replays_empty)), (0, 1));
    let ok = h.reg_cols(tag_feed(&["t"]), lean, Some(c0)).await;
    assert_eq!(ids(&ok.take().rows), vec!["r1"]);
    assert_eq!((load(&s.replays_delivered), load(&s.replays_empty)), (1, 1));
    assert_eq!(load(&s.hydrates), 1, "both replays of r1 share one read");
    assert_eq!(load(&s.hydrated_rows), 1);
    assert!(h.store.calls().iter().all(|c| c.cols == lean));
}

/// REP-07 (race): a replay hydrate that returns AFTER a live delivery of a newer version does
/// not cost the feed the newer version (both are in the inbox; the feed keeps the newest).
#[tokio::test]
async fn rep_07_replay_racing_live_delivery_keeps_newer_version() {
    let h = Harness::new(cfg());
    h.store.put(version("r1", 1));
    let (_holder, c0) = h.holder().await;
    h.push(full("r1", &[]));
    h.routed(1).await;

    let (gate_in, release) = h.store.gate_next();
    let router = h.router.clone();
    let pending =
        tokio::spawn(async move { router.register(feed(run_feed("r1"), Some(c0))).await });
    entered(gate_in).await; // the replay hydrate read v1 and is blocked

    h.store.put(version("r1", 2));
    h.push(full("r1", &[]));
    wait_until("live delivery", || load(&h.router.stats().deliveries) == 1).await;
    release.send(()).unwrap();
    let g = timeout(WAIT, pending)
        .await
        .expect("register hung")
        .unwrap();
    let versions: Vec<i64> = g.take().rows.iter().map(|r| r.meta.updated_at_ms).collect();
    assert!(
        versions.contains(&2),
        "newer live version kept: {versions:?}"
    );
    assert!(versions.iter().all(|&v| v == 1 || v == 2));
}

/// REP-08: a record that arrives between polls (no feed registered) is replayed to the next
/// registration with the previous cursor: it is in the inbox when `register` returns.
#[tokio::test]
async fn rep_08_record_between_polls_is_replayed_on_next_register() {
    let h = Harness::with_rows(cfg(), [row("r1", &[], None)]);
    let a = h.reg(run_feed("r1"), None).await;
    let c = a.cursor();
    assert!(a.take().rows.is_empty());
    drop(a);
    h.push(full("r1", &[]));
    h.routed(1).await;
    assert_eq!(
        h.store.hydrate_count(),
        0,
        "no feed: nothing hydrated on arrival"
    );
    let b = h.reg(run_feed("r1"), Some(c)).await;
    assert!(b.covered());
    assert_eq!(ids(&b.take().rows), vec!["r1"]);
    assert_eq!(h.store.hydrate_count(), 1);
    assert_eq!(load(&h.router.stats().replays_delivered), 1);
}

/// REP-09: a record already replayed to a connection is not replayed again with the cursor
/// handed out after the replay.
#[tokio::test]
async fn rep_09_replayed_record_not_replayed_again() {
    let h = Harness::with_rows(cfg(), [row("r1", &["t"], None), row("r2", &["t"], None)]);
    let (_holder, c0) = h.holder().await;
    h.push(full("r1", &["t"]));
    h.routed(1).await;
    let a = h.reg(tag_feed(&["t"]), Some(c0)).await;
    let c1 = a.cursor();
    assert_eq!(ids(&a.take().rows), vec!["r1"]);
    drop(a);
    let b = h.reg(tag_feed(&["t"]), Some(c1)).await;
    assert!(b.covered());
    assert!(b.take().rows.is_empty());
    assert_eq!(h.store.hydrate_count(), 1);
    // Fence: a new record does arrive, alone.
    h.push(full("r2", &["t"]));
    assert_eq!(ids(&wake(&b).await.rows), vec!["r2"]);
    assert_eq!(h.store.id_lists(), vec![strings(&["r1"]), strings(&["r2"])]);
}

/// REP-10: the cursor bounds the replay: only records after it are replayed; an earlier cursor
/// replays more.
#[tokio::test]
async fn rep_10_cursor_bounds_replay() {
    let h = Harness::with_rows(cfg(), [row("r1", &[], None), row("r2", &[], None)]);
    let (holder, c0) = h.holder().await;
    h.push(full("r1", &[]));
    h.routed(1).await;
    let c1 = holder.cursor();
    h.push(full("r2", &[]));
    h.routed(2).await;
    let c2 = holder.cursor();

    let none = h.reg(tag_feed(&[]), Some(c2)).await;
    assert!(none.take().rows.is_empty());
    assert_eq!(h.store.hydrate_count(), 0, "nothing after c2: no hydrate");
    let one = h.reg(tag_feed(&[]), Some(c1)).await;
    assert_eq!(ids(&one.take().rows), vec!["r2"]);
    let both = h.reg(tag_feed(&[]), Some(c0)).await;
    assert_eq!(sorted(ids(&both.take().rows)), strings(&["r1", "r2"]));
    assert_eq!(
        h.store.id_lists(),
        vec![strings(&["r2"]), strings(&["r1", "r2"])]
    );
    assert!(none.covered() && one.covered() && both.covered());
}

/// REP-12: a replay hydrate failure is contained and reported as "not covered" (the caller
/// re-checks from the store).
#[tokio::test]
async fn rep_12_replay_failure_is_not_covered() {
    let h = Harness::with_rows(cfg(), [row("r1", &[], None)]);
    let (_holder, c0) = h.holder().await;
    h.push(full("r1", &[]));
    h.routed(1).await;
    h.store.fail_next(1);
    let g = h.reg(run_feed("r1"), Some(c0)).await;
    assert!(!g.covered());
    assert!(g.take().rows.is_empty());
    assert_eq!(load(&h.router.stats().hydrate_errors), 1);
    // Still registered and routed live.
    h.push(full("r1", &[]));
    assert_eq!(ids(&wake(&g).await.rows), vec!["r1"]);
}

// ---------------------------------------------------------------------------------------------
// Better than the reference: the arrival-sequence cursor (§4 item 2)
// ---------------------------------------------------------------------------------------------

/// §4 item 2: batch X (r1) is still hydrating when feed F is woken by batch Y (r2) and builds
/// its response (cursor, then final drain). F goes; X completes. The next registration with
/// F's cursor must get r1 by replay (the reference's wall-clock cursor skips it).
#[tokio::test]
async fn better_2_record_routed_while_response_built_is_not_skipped() {
    let h = Harness::with_rows(cfg(), [row("r1", &["t"], None), row("r2", &["t"], None)]);
    let f = h.reg(tag_feed(&["t"]), None).await;
    let witness = h.reg(run_feed("r1"), None).await; // observes X's completion

    let (gate_in, release) = h.store.gate_next();
    h.push(full("r1", &["t"])); // X
    entered(gate_in).await;
    h.push(full("r2", &["t"])); // Y
    let w = wake(&f).await;
    assert_eq!(ids(&w.rows), vec!["r2"]);
    // Build F's response: cursor first, then the final drain.
    let c = f.cursor();
    let rest = f.take();
    assert!(rest.rows.is_empty());
    assert_eq!(c.seq, 0, "the cursor cannot pass X while X is in flight");
    drop(f);

    release.send(()).unwrap();
    assert_eq!(ids(&wake(&witness).await.rows), vec!["r1"], "X completed");

    let g = h.reg(tag_feed(&["t"]), Some(c)).await;
    assert!(g.covered());
    let replayed = ids(&g.take().rows);
    assert!(
        replayed.contains(&"r1".to_string()),
        "r1 skipped: {replayed:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// §1.6 Linger and gap coverage
// ---------------------------------------------------------------------------------------------

/// LNG-01: the env stays subscribed and buffering during the linger; a record in that gap is
/// replayed to the next registration (one hydrate); after the linger it is unsubscribed.
#[tokio::test(start_paused = true)]
async fn lng_01_linger_keeps_subscription_and_buffer() {
    let h = Harness::with_rows(linger(60), [row("r1", &[], None)]);
    let a = h.reg(run_feed("r1"), None).await;
    let c = a.cursor();
    drop(a);
    assert!(
        h.subscribed(),
        "still subscribed right after the last feed left"
    );
    assert_eq!(h.router.active_envs(), 1);
    h.push(full("r1", &[]));
    h.routed(1).await;
    let b = h.reg(run_feed("r1"), Some(c)).await;
    assert!(b.covered());
    assert_eq!(ids(&b.take().rows), vec!["r1"]);
    assert_eq!(h.store.hydrate_count(), 1);
    drop(b);
    advance(59).await;
    assert!(h.subscribed(), "linger not over yet");
    advance(2).await;
    assert!(!h.subscribed(), "unsubscribed after the linger");
    assert_eq!(h.router.active_envs(), 0);
    assert!(!h
        .source
        .push(&crate::protocol::EnvId::from(ENV), full("r1", &[])));
}

/// LNG-02/04: a registration during the linger cancels the pending teardown and keeps the
/// buffer and subscription epoch; the timer is re-armed at the next drop to zero feeds.
#[tokio::test(start_paused = true)]
async fn lng_02_04_registration_cancels_teardown_and_timer_rearms() {
    let h = Harness::with_rows(linger(60), [row("r1", &[], None)]);
    let a = h.reg(run_feed("r1"), None).await;
    let c = a.cursor();
    drop(a); // teardown armed for t=60
    h.push(full("r1", &[]));
    h.routed(1).await;
    advance(30).await;
    let b = h.reg(run_feed("r1"), Some(c)).await;
    assert!(b.covered(), "same subscription: the buffer survived");
    assert_eq!(b.cursor().epoch, c.epoch);
    assert_eq!(ids(&b.take().rows), vec!["r1"]);
    drop(b); // re-armed for t=90
    advance(40).await; // t=70: the first timer fired but is stale
    assert!(h.subscribed());
    assert_eq!(h.router.active_envs(), 1);
    advance(21).await; // t=91
    assert!(!h.subscribed());
    assert_eq!(h.router.active_envs(), 0);
}

/// LNG-01 (touch): `touch` on an idle env arms the linger too.
#[tokio::test(start_paused = true)]
async fn lng_01_touch_arms_linger() {
    let h = Harness::new(linger(60));
    h.router.touch(&crate::protocol::EnvId::from(ENV));
    assert!(h.subscribed());
    advance(61).await;
    assert!(!h.subscribed());
    assert_eq!(h.router.active_envs(), 0);
}

/// LNG-03: with zero linger the env is torn down as the last feed leaves; the next
/// registration is a new subscription (old cursors are not covered).
#[tokio::test]
async fn lng_03_zero_linger_unsubscribes_at_once() {
    let h = Harness::new(linger(0));
    let a = h.reg(run_feed("r1"), None).await;
    let b = h.reg(run_feed("r2"), None).await;
    let c = a.cursor();
    drop(a);
    assert!(h.subscribed(), "one feed left");
    drop(b);
    assert!(!h.subscribed());
    assert_eq!(h.router.active_envs(), 0);
    assert!(!h
        .source
        .push(&crate::protocol::EnvId::from(ENV), full("r1", &[])));
    let again = h.reg(run_feed("r1"), Some(c)).await;
    assert!(
        !again.covered(),
        "a new subscription cannot vouch for the gap"
    );
    assert_ne!(again.cursor().epoch, c.epoch);
}

/// LNG-03 race: with zero linger, a registration that found the env just before the last other
/// feed left must not end up on a torn-down (unsubscribed, unrouted) env.
///
/// `register` calls `ensure_env` (envs lock released) and only later inserts the feed under the
/// env's state lock. If the last feed's `Drop` runs its immediate teardown in between, the env
/// is removed from the router and unsubscribed although the new registration then inserts
/// itself into the orphaned `EnvState`: it never receives a record (until its backstop) and,
/// holding a cursor of the old epoch, even reports the gap as covered. With linger > 0 the
/// generation check plus the later timer avoid this; with zero linger the teardown is immediate.
/// Staged by observing (from another thread) the `linger_generation` bump of `ensure_env` and
/// dropping the last feed while the registration clones a large tag filter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lng_03_zero_linger_teardown_does_not_orphan_concurrent_registration() {
    let h = Harness::new(linger(0));
    let many: Vec<String> = (0..20_000).map(|i| format!("tag_{i}")).collect();
    for _ in 0..20 {
        let a = h.reg(run_feed("a"), None).await;
        let env = h
            .router
            .inner
            .env(&crate::protocol::EnvId::from(ENV))
            .expect("env exists");
        let gen0 = env.state.lock().linger_generation;
        let dropper = std::thread::spawn(move || {
            // Wait for the registration's ensure_env (it bumps the generation), then leave.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while env.state.lock().linger_generation == gen0 && std::time::Instant::now() < deadline
            {
                std::hint::spin_loop();
            }
            drop(a);
        });
        let filter = FeedFilter::Tag {
            tags: many.clone().into(),
            floor_ms: 0,
        };
        let b = h.router.register(feed(filter, None)).await;
        dropper.join().unwrap();
        let ok = h.subscribed() && h.router.active_envs() == 1;
        assert!(
            ok,
            "registration held but env torn down: subscribed={:?} envs={}",
            h.source.subscribed(),
            h.router.active_envs()
        );
        drop(b);
        assert!(!h.subscribed());
    }
}

/// GAP-02: a fresh subscription with an unknown cursor is not covered; a registration with a
/// cursor of the live subscription is.
#[tokio::test]
async fn gap_02_fresh_subscription_not_covered_with_unknown_cursor() {
    let h = Harness::new(cfg());
    let a = h.reg(run_feed("r1"), None).await;
    assert!(!a.covered());
    let b = h.reg(run_feed("r1"), None).await;
    assert!(
        !b.covered(),
        "an unknown cursor is never covered, even on an older subscription"
    );
    let c = h.reg(run_feed("r1"), Some(a.cursor())).await;
    assert!(c.covered(), "GAP-03: the subscription predates the cursor");
    let zero = h.reg(run_feed("r1"), Some(ReplayCursor::default())).await;
    assert!(!zero.covered(), "epoch 0 = no usable position");
}

/// GAP-02: a cursor from another env (another subscription) is not covered there.
#[tokio::test]
async fn gap_02_cursor_of_another_env_not_covered() {
    let h = Harness::new(cfg());
    let other = h.router.touch(&crate::protocol::EnvId::from("env_other"));
    let a = h.reg(run_feed("r1"), Some(other)).await;
    assert!(!a.covered());
}

/// §4 item 5: a subscriber reconnect wakes every held feed with `recheck` (busy ones find it
/// parked), invalidates every earlier cursor, and routing continues under the new epoch.
#[tokio::test]
async fn gap_reconnect_rechecks_held_feeds_and_invalidates_cursors() {
    let h = Harness::with_rows(cfg(), [row("r1", &[], None)]);
    let held = h.reg(run_feed("r1"), None).await;
    let busy = h.reg(tag_feed(&["t"]), None).await;
    let old = held.cursor();
    assert!(h.reg(run_feed("r1"), Some(old)).await.covered());

    h.source.reconnect();
    let w = wake(&held).await;
    assert!(w.recheck);
    assert!(w.rows.is_empty());
    let parked = busy.take();
    assert!(parked.recheck, "a busy feed finds the re-check parked");
    assert!(!busy.take().recheck, "drained once");

    let new = held.cursor();
    assert_ne!(new.epoch, old.epoch);
    let stale = h.reg(run_feed("r1"), Some(old)).await;
    assert!(
        !stale.covered(),
        "records may have been lost before the reconnect"
    );
    let fresh = h.reg(run_feed("r1"), Some(new)).await;
    assert!(fresh.covered());

    h.push(full("r1", &[]));
    let w = wake(&held).await;
    assert_eq!(ids(&w.rows), vec!["r1"]);
    assert!(!w.recheck);
}

// ---------------------------------------------------------------------------------------------
// Subscription confirmation (hand-driven source)
// ---------------------------------------------------------------------------------------------

/// A source whose events the test sends by hand: it only records subscribe/unsubscribe calls,
/// so confirmations (`Subscribed`) can be delayed or reordered like a real Redis round trip.
#[derive(Default)]
struct ManualSource {
    calls: Mutex<Vec<String>>,
}

impl ManualSource {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().clone()
    }
}

impl ChangeSource for ManualSource {
    /// Generation = number of subscribe calls so far (1, 2, …).
    fn subscribe(&self, env_id: &EnvId) -> u64 {
        let mut calls = self.calls.lock();
        calls.push(format!("sub:{env_id}"));
        calls.iter().filter(|c| c.starts_with("sub:")).count() as u64
    }
    fn unsubscribe(&self, env_id: &EnvId) {
        self.calls.lock().push(format!("unsub:{env_id}"));
    }
}

fn manual(
    cfg: RouterConfig,
) -> (
    Router,
    Arc<ManualSource>,
    Arc<FakeStore>,
    crate::changes::EventSender,
) {
    let (tx, rx) = crate::changes::event_channel();
    let source = Arc::new(ManualSource::default());
    let store = Arc::new(FakeStore::default());
    let router = start(cfg, source.clone(), store.clone(), rx, None);
    (router, source, store, tx)
}

fn record_event(record: ChangeRecord) -> SourceEvent {
    SourceEvent::Record {
        env_id: ENV.into(),
        record,
    }
}

fn subscribed_event(env: &str, generation: u64) -> SourceEvent {
    SourceEvent::Subscribed {
        env_id: env.into(),
        generation,
    }
}

/// GAP-01/02 (ours, §4 item 5): replay coverage starts when the source confirms the
/// subscription, not at the subscribe call: a cursor handed out before the confirmation has no
/// usable position (epoch 0) and is never covered; records are routed live meanwhile. A
/// confirmation for an env the router does not route is ignored.
#[tokio::test]
async fn gap_01_coverage_starts_at_subscription_confirmation() {
    let (router, source, store, tx) = manual(cfg());
    store.put(row("r1", &[], None));
    let a = router.register(feed(run_feed("r1"), None)).await;
    assert_eq!(source.calls(), vec![format!("sub:{ENV}")]);
    let early = a.cursor();
    assert_eq!(
        early.epoch, 0,
        "unconfirmed subscription: no usable position"
    );
    assert_eq!(router.touch(&crate::protocol::EnvId::from(ENV)).epoch, 0);

    // Routed live even before the confirmation.
    tx.try_send(record_event(full("r1", &[]))).unwrap();
    assert_eq!(ids(&wake(&a).await.rows), vec!["r1"]);

    tx.try_send(subscribed_event("env_unknown", 1)).unwrap();
    tx.try_send(subscribed_event(ENV, 1)).unwrap();
    wait_until("confirmed", || a.cursor().epoch != 0).await;
    assert_eq!(
        router.active_envs(),
        1,
        "a confirmation never creates an env"
    );
    let b = router.register(feed(run_feed("r1"), Some(early))).await;
    assert!(
        !b.covered(),
        "a cursor from before the confirmation is not covered"
    );
    let c = router
        .register(feed(run_feed("r1"), Some(a.cursor())))
        .await;
    assert!(c.covered());
}

/// GAP-01 (ours): a confirmation of an EARLIER subscription must not activate a re-created
/// env whose own subscribe is not confirmed yet.
///
/// Sequence (Redis source, dispatcher lagging behind a burst): SUBSCRIBE #1 confirmed → `Subscribed`
/// queued; the env is torn down (UNSUBSCRIBE) and re-created (SUBSCRIBE #2 in flight); the
/// dispatcher then sees the stale confirmation. It carries generation 1, the new env waits for 2.
#[tokio::test]
async fn gap_01_stale_confirmation_does_not_activate_recreated_env() {
    let (router, source, store, tx) = manual(linger(0));
    store.put(row("r1", &[], None));
    // No await point below lets the dispatcher run until the fence: the confirmation of subscription
    // #1 is queued while the env is torn down and re-created.
    let a = router.register(feed(run_feed("zz"), None)).await;
    tx.try_send(subscribed_event(ENV, 1)).unwrap(); // confirms subscribe #1
    drop(a);
    let b = router.register(feed(run_feed("r1"), None)).await;
    assert_eq!(
        source.calls(),
        vec![
            format!("sub:{ENV}"),
            format!("unsub:{ENV}"),
            format!("sub:{ENV}")
        ]
    );
    // Fence: the dispatcher has processed the stale confirmation once it routes this record.
    tx.try_send(record_event(full("r1", &[]))).unwrap();
    assert_eq!(ids(&wake(&b).await.rows), vec!["r1"]);
    assert_eq!(b.cursor().epoch, 0, "subscribe #2 was never confirmed");
}

// ---------------------------------------------------------------------------------------------
// §1.7 Read-your-writes gate and stale tripwire (with a fake replica probe)
// ---------------------------------------------------------------------------------------------

/// A replica whose replay position the test moves by hand.
struct FakeReplica {
    primary: std::sync::atomic::AtomicU64,
    replayed: std::sync::atomic::AtomicU64,
}

#[async_trait]
impl crate::store::ReplicaProbe for FakeReplica {
    async fn primary_lsn(&self) -> Result<crate::store::Lsn, StoreError> {
        Ok(self.primary.load(Ordering::SeqCst))
    }
    async fn replica_replay_lsn(&self) -> Result<Option<crate::store::Lsn>, StoreError> {
        Ok(Some(self.replayed.load(Ordering::SeqCst)))
    }
}

fn gated(max_delay_ms: u64, retries: u32) -> (Harness, Arc<FakeReplica>) {
    let (tx, rx) = crate::changes::event_channel();
    let source = Arc::new(MemoryChangeSource::new(tx));
    let store = Arc::new(FakeStore::default());
    let replica = Arc::new(FakeReplica {
        primary: 10.into(),
        replayed: 10.into(),
    });
    let lag = crate::config::ReplicaLagConfig {
        max_delay_ms,
        stale_hydrate_retries: retries,
        ..Default::default()
    };
    let gate = Arc::new(gate::Gate::new(replica.clone(), lag));
    let router = start(cfg(), source.clone(), store.clone(), rx, Some(gate));
    (
        Harness {
            router,
            source,
            store,
        },
        replica,
    )
}

/// Polls `cond` every millisecond for up to [`WAIT`] (real time: gate waits use timers).
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn watermarked(run: &str, ms: i64) -> ChangeRecord {
    ChangeRecord {
        updated_at_ms: Some(ms),
        ..full(run, &[])
    }
}

/// GATE-02 (positions): a wake-path hydrate waits until the replica replayed past the primary
/// position read after the record arrived, so the row read is the committed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_02_hydrate_waits_for_the_replica_to_replay_the_commit() {
    let (h, replica) = gated(5_000, 3);
    let f = h.reg(run_feed("r1"), None).await;
    replica.primary.store(20, Ordering::SeqCst); // the commit the record announces
    h.store.put(row("r1", &[], None)); // … is on the primary; the replica (at 10) lags
    h.push(watermarked("r1", 2_000));
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(
        h.store.hydrate_count(),
        0,
        "no hydrate before the replica caught up"
    );
    replica.replayed.store(20, Ordering::SeqCst);
    assert_eq!(ids(&wake(&f).await.rows), vec!["r1"]);
    assert_eq!(h.store.hydrate_count(), 1);
}

/// GATE-05/06: a row older than its record's watermark is withheld and re-hydrated; the fresh
/// version is delivered ("recovered"), the stale one never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_06_stale_row_is_withheld_and_the_fresh_version_delivered() {
    let (h, _replica) = gated(1_000, 3);
    let f = h.reg(run_feed("r1"), None).await;
    h.store.put(version("r1", 1_000)); // stale copy
    h.push(watermarked("r1", 2_000));
    eventually("first hydrate", || h.store.hydrate_count() >= 1).await;
    assert!(f.take().rows.is_empty(), "stale row withheld");
    h.store.put(version("r1", 2_000));
    let w = wake(&f).await;
    assert_eq!(
        w.rows
            .iter()
            .map(|r| r.meta.updated_at_ms)
            .collect::<Vec<_>>(),
        vec![2_000]
    );
    assert_eq!(load(&h.router.stats().stale_recovered), 1);
}

/// Better than the reference (§4 item 3): a run created by a record WITHOUT a watermark whose
/// row is not on the replica when the gate gave up is retried, not silently dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn better_3_missing_row_without_watermark_is_retried_when_the_gate_gave_up() {
    let (h, replica) = gated(50, 3);
    let f = h.reg(tag_feed(&["t"]), None).await;
    replica.primary.store(30, Ordering::SeqCst); // replica stuck at 10: the gate gives up
    h.push(full("new", &["t"])); // runCreated: no updatedAtMs
    eventually("first hydrate", || h.store.hydrate_count() >= 1).await;
    assert!(f.take().rows.is_empty());
    h.store.put(row("new", &["t"], None)); // the insert replicates
    let w = wake(&f).await;
    assert_eq!(ids(&w.rows), vec!["new"]);
}

/// GATE-08/09: after the retry budget the stale row is delivered (liveness), and an echo pass
/// still delivers the fresh version once the replica catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_09_gave_up_delivers_stale_then_echo_delivers_fresh() {
    let (h, _replica) = gated(1_000, 0);
    let f = h.reg(run_feed("r1"), None).await;
    let now = crate::clock::now_ms();
    h.store.put(version("r1", now - 10));
    h.push(watermarked("r1", now));
    let first = wake(&f).await;
    assert_eq!(
        first.rows[0].meta.updated_at_ms,
        now - 10,
        "liveness: stale row delivered"
    );
    assert_eq!(load(&h.router.stats().stale_gave_up), 1);
    h.store.put(version("r1", now));
    let echo = wake(&f).await;
    assert_eq!(echo.rows[0].meta.updated_at_ms, now);
}

/// GATE-10: records without a watermark pass the tripwire when the gate saw the replica catch
/// up (one hydrate, nothing withheld).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_10_applied_gate_trusts_records_without_watermark() {
    let (h, _replica) = gated(1_000, 3);
    let f = h.reg(run_feed("r1"), None).await;
    h.store.put(version("r1", 1));
    h.push(full("r1", &[]));
    assert_eq!(ids(&wake(&f).await.rows), vec!["r1"]);
    assert_eq!(h.store.hydrate_count(), 1);
}

/// Replays share their read only when the read-your-writes gate let it through: a replay the
/// gate gave up on (the replica still behind) is handed to its feed but not kept, so the next
/// feed reads again; once the replica caught up, one read serves every later replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_the_gate_gave_up_on_is_not_shared() {
    let (h, replica) = gated(50, 0);
    let (_holder, c0) = h.holder().await;
    replica.primary.store(20, Ordering::SeqCst); // the replica (at 10) lags the commit
    h.store.put(row("r1", &[], None));
    h.push(full("r1", &[]));
    h.routed(1).await;
    assert_eq!(h.store.hydrate_count(), 0, "no held feed wanted r1");
    for _ in 0..2 {
        let f = h.reg(run_feed("r1"), Some(c0)).await;
        assert_eq!(ids(&f.take().rows), vec!["r1"]);
    }
    assert_eq!(h.store.hydrate_count(), 2, "unsettled reads are not kept");
    replica.replayed.store(20, Ordering::SeqCst);
    for _ in 0..3 {
        let f = h.reg(run_feed("r1"), Some(c0)).await;
        assert_eq!(ids(&f.take().rows), vec!["r1"]);
    }
    assert_eq!(h.store.hydrate_count(), 3, "a settled read is shared");
}
