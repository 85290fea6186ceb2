//! Observability: the admin listener's `/metrics` during a real workload (every instrument is
//! exported and moves the way the workload implies), `/healthz` + `/readyz`, and the Grafana
//! dashboard's and alert rules' queries against a real Prometheus (Debian's package, started by
//! `scripts/prometheus-check.sh`, scraping the in-process server on loopback).
//!
//! Each test starts its own in-process server (tests/common) with the read-your-writes gate on
//! (a second URL for the same database counts as a distinct replica), so the replica-lag
//! instruments exist too.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use runfeed_dev::fixtures::RunSpec;
use serde_json::Value;
use tokio::time::Instant;

/// Every sample family the Prometheus endpoint must expose (histograms by their `_bucket`).
/// A new instrument must be added here (the test also fails on unknown `runfeed_` families).
const FAMILIES: &[&str] = &[
    // feeds
    "runfeed_feeds_delivery_lag_milliseconds",
    "runfeed_feeds_emitted_rows",
    "runfeed_feeds_live_polls_total",
    "runfeed_feeds_wakeups_total",
    "runfeed_feeds_backstops_total",
    "runfeed_feeds_cursor_store_ops_total",
    "runfeed_feeds_state_lookups_total",
    "runfeed_feeds_concurrency_rejections_total",
    "runfeed_feeds_working_set_size",
    "runfeed_feeds_window_runs",
    "runfeed_feeds_stalled_streams_total",
    // run sets
    "runfeed_runset_resolves_total",
    "runfeed_runset_query_duration_milliseconds",
    "runfeed_runset_admission_waits_total",
    "runfeed_runset_admission_in_use",
    // router
    "runfeed_router_held_feeds",
    "runfeed_router_active_envs",
    "runfeed_router_hydrates_total",
    "runfeed_router_hydrated_runs_total",
    "runfeed_router_deliveries_total",
    "runfeed_router_distinct_runs_total",
    "runfeed_router_replays_total",
    "runfeed_router_replay_evictions_total",
    "runfeed_router_stale_hydrates_total",
    "runfeed_router_arrivals_total",
    "runfeed_router_queue_overflows_total",
    "runfeed_router_hydrate_batch",
    "runfeed_pg_acquire_wait_milliseconds",
    // notifier
    "runfeed_notifier_publishes_total",
    "runfeed_notifier_messages_received_total",
    "runfeed_notifier_batches_delivered_total",
    "runfeed_notifier_active_subscriptions",
    // replica-lag gate
    "runfeed_replica_lag_estimate_milliseconds",
    "runfeed_replica_gate_waits_total",
    // HTTP, dependencies, process
    "runfeed_http_requests_total",
    "runfeed_http_duration_milliseconds",
    "runfeed_http_sent_bytes_total",
    // Moved by tests/it/run_tokens.rs (a stand-in webapp), every outcome; exported at zero here.
    "runfeed_http_run_token_forwards_total",
    "runfeed_http_refused_connections_total",
    "runfeed_http_accept_errors_total",
    "runfeed_pg_queries_total",
    "runfeed_pg_errors_total",
    "runfeed_pg_tag_set_plans_total",
    "runfeed_pg_replica_bypassed",
    "runfeed_redis_errors_total",
    "runfeed_redis_connected",
    "runfeed_redis_commands_total",
    "runfeed_process_resident_memory_bytes",
    "runfeed_build_info",
];

const RUN_ROUTE: &str = "/realtime/v1/runs/{run_id}";
const TAG_ROUTE: &str = "/realtime/v1/runs";

// ---------------------------------------------------------------------------------------------
// Prometheus text parsing

/// One scrape: `(sample name, labels, value)` and the `# TYPE` families.
#[derive(Debug, Default)]
struct Scrape {
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
    families: BTreeSet<String>,
}

impl Scrape {
    fn parse(text: &str) -> Scrape {
        let mut samples = Vec::new();
        let mut families = BTreeSet::new();
        for line in text.lines() {
            let line = line.trim();
            if let Some(decl) = line.strip_prefix("# TYPE ") {
                families.insert(
                    decl.split_whitespace()
                        .next()
                        .expect("family name")
                        .to_string(),
                );
                continue;
            }
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, labels, rest) = match line.find('{') {
                Some(open) => {
                    let (labels, after) = parse_labels(&line[open + 1..]);
                    (&line[..open], labels, after)
                }
                None => {
                    let (name, rest) = line.split_once(' ').expect("sample line has a value");
                    (name, BTreeMap::new(), rest)
                }
            };
            let value = rest.split_whitespace().next().expect("value");
            let value = match value {
                "NaN" => f64::NAN,
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v
                    .parse()
                    .unwrap_or_else(|_| panic!("bad value in {line:?}")),
            };
            samples.push((name.to_string(), labels, value));
        }
        Scrape { samples, families }
    }

    /// Whether a sample matches `series`: `name` or `name{label=value,…}` (the labels it must
    /// include; values unquoted).
    fn has(&self, series: &str) -> bool {
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => (name, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let labels: Vec<(&str, &str)> = labels
            .split(',')
            .filter(|l| !l.is_empty())
            .map(|l| l.split_once('=').expect("label=value"))
            .collect();
        self.try_get(name, &labels).is_some()
    }

    /// Sum of the samples named `name` whose labels include `labels`; `None` if there is none.
    fn try_get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut found = None;
        for (n, l, v) in &self.samples {
            if n == name
                && labels
                    .iter()
                    .all(|(k, want)| l.get(*k).is_some_and(|have| have == want))
            {
                *found.get_or_insert(0.0) += v;
            }
        }
        found
    }

    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.try_get(name, labels)
            .unwrap_or_else(|| panic!("no sample {name}{labels:?} in the scrape"))
    }

    /// The `runfeed_` families declared by `# TYPE` lines.
    fn families(&self) -> BTreeSet<String> {
        self.families
            .iter()
            .filter(|f| f.starts_with("runfeed_"))
            .cloned()
            .collect()
    }
}

/// Parses `k="v",k2="v2"} rest` (after the `{`): the labels and what follows the `}`.
fn parse_labels(s: &str) -> (BTreeMap<String, String>, &str) {
    let mut labels = BTreeMap::new();
    let bytes = s.as_bytes();
    let mut i = 0;
    loop {
        while i < bytes.len() && (bytes[i] == b',' || bytes[i] == b' ') {
            i += 1;
        }
        if bytes.get(i) == Some(&b'}') {
            return (labels, &s[i + 1..]);
        }
        let eq = s[i..].find('=').expect("label =") + i;
        let key = s[i..eq].to_string();
        assert_eq!(
            bytes.get(eq + 1),
            Some(&b'"'),
            "label value quoted in {s:?}"
        );
        let mut j = eq + 2;
        let mut value = String::new();
        while bytes[j] != b'"' {
            if bytes[j] == b'\\' {
                j += 1;
                value.push(match bytes[j] {
                    b'n' => '\n',
                    other => other as char,
                });
            } else {
                let ch = s[j..].chars().next().expect("char");
                value.push(ch);
                j += ch.len_utf8() - 1;
            }
            j += 1;
        }
        labels.insert(key, value);
        i = j + 1;
    }
}

async fn scrape(srv: &TestServer) -> Scrape {
    Scrape::parse(&srv.scrape_text().await)
}

/// Scrapes until `cond` holds (observables and drop-time counters settle asynchronously).
async fn scrape_until(srv: &TestServer, what: &str, cond: impl Fn(&Scrape) -> bool) -> Scrape {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = scrape(srv).await;
        if cond(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "never observed: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Fixtures

/// A second URL for the same database: runfeed treats it as a distinct replica, so the
/// read-your-writes gate (and its instruments) is on; the "replica" is not in recovery, so
/// replica reads go to the primary (`runfeed_pg_replica_bypassed` 1) and the gate never waits.
fn gate_on(config: &mut runfeed::config::Config) {
    let sep = if config.database.url.contains('?') {
        '&'
    } else {
        '?'
    };
    config.database.replica_url = Some(format!(
        "{}{sep}application_name=runfeed-replica",
        config.database.url
    ));
}

// ---------------------------------------------------------------------------------------------
// Tests

/// Every instrument is exported with units in its name, and each moves as the workload implies:
/// a wake on a held run feed adds exactly one `notify` wakeup and one delivery-lag sample on the
/// `notify` path; a change between polls is replayed; an idle hold times out into an empty
/// backstop; a silent update (no publish) is found by a delivering backstop; a client that goes
/// away is an `abort` and a 499; a tag snapshot misses then hits the run-set cache; an offset
/// the server never handed out takes the cold path; a burst larger than the replay buffer evicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_instrument_is_exported_and_moves_with_the_workload() {
    let srv = TestServer::start_with(2_500, |c| {
        gate_on(c);
        c.router.replay_max_runs = 3;
    })
    .await;
    let env = srv.env().await;
    let r1 = srv.run(&env, RunSpec::default()).await;
    let r2 = srv.run(&env, RunSpec::default()).await;
    let tagged: Vec<_> =
        futures::future::join_all((0..4).map(|_| srv.tagged_run(&env, &["m"]))).await;
    let h = modern(&srv.token(&env, &["read:runs", "read:tags:m"]));
    // Warm-up: a first snapshot subscribes the environment; once the router has the
    // confirmation, snapshots hand out cursors the change stream vouches for (no cold path).
    srv.fetch(&run_url(&r2.friendly_id).snapshot(), &h)
        .await
        .assert_status(200);
    srv.wait_subscribed(&env.env_id).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let s0 = scrape(&srv).await;
    let d0 = |s: &Scrape, name: &str, labels: &[(&str, &str)]| {
        s.get(name, labels) - s0.get(name, labels)
    };

    // A. Snapshot of a run feed: one cache miss, one state recorded, one 200 with a body.
    let u1 = run_url(&r1.friendly_id);
    let snap = srv.fetch(&u1.snapshot(), &h).await;
    snap.assert_status(200);
    let s1 = scrape(&srv).await;
    assert_eq!(
        d0(
            &s1,
            "runfeed_runset_resolves_total",
            &[("kind", "run"), ("result", "miss")]
        ),
        1.0
    );
    assert!(
        s1.get(
            "runfeed_runset_query_duration_milliseconds_count",
            &[("kind", "run"), ("result", "ok")]
        ) >= 1.0
    );
    // The fleet-shared cursor of that response is written to Redis in the background.
    scrape_until(&srv, "shared cursor written", |s| {
        d0(
            s,
            "runfeed_feeds_cursor_store_ops_total",
            &[("op", "set"), ("result", "ok")],
        ) == 1.0
    })
    .await;
    assert_eq!(
        d0(
            &s1,
            "runfeed_http_requests_total",
            &[("route", RUN_ROUTE), ("status", "200"), ("method", "GET")]
        ),
        1.0
    );
    assert!(
        s1.get("runfeed_http_sent_bytes_total", &[("route", RUN_ROUTE)]) >= snap.text.len() as f64
    );
    assert!(s1.get("runfeed_feeds_working_set_size", &[]) >= 1.0);
    assert!(s1.get("runfeed_pg_queries_total", &[]) > s0.get("runfeed_pg_queries_total", &[]));

    // B. One wake on a held run feed.
    srv.wait_subscribed(&env.env_id).await;
    let poll = srv.fetch(&u1.live_after(&snap), &h);
    let change = async {
        srv.wait_held("run feed held", |h| h.0 == 1).await;
        let held = scrape(&srv).await;
        srv.change(&env, &r1.id, &[], None, "EXECUTING").await;
        held
    };
    let (live_b, held) = within(WAIT, "notify wake", async { tokio::join!(poll, change) }).await;
    live_b.assert_status(200);
    assert_eq!(live_b.changes().len(), 1, "{}", live_b.text);
    assert_eq!(
        held.get("runfeed_router_held_feeds", &[("kind", "run")]),
        1.0
    );
    assert_eq!(
        held.get("runfeed_router_held_feeds", &[("kind", "tag")]),
        0.0
    );
    assert!(held.get("runfeed_router_active_envs", &[]) >= 1.0);
    assert!(held.get("runfeed_notifier_active_subscriptions", &[]) >= 1.0);
    let s2 = scrape_until(&srv, "held feed released", |s| {
        s.get("runfeed_router_held_feeds", &[("kind", "run")]) == 0.0
    })
    .await;
    let d = |name: &str, labels: &[(&str, &str)]| s2.get(name, labels) - s1.get(name, labels);
    assert_eq!(
        d("runfeed_feeds_wakeups_total", &[("reason", "notify")]),
        1.0,
        "one notify wakeup"
    );
    assert_eq!(
        s2.get(
            "runfeed_feeds_delivery_lag_milliseconds_count",
            &[("path", "notify")]
        ),
        1.0,
        "one delivery-lag sample on the notify path"
    );
    assert_eq!(
        s2.get("runfeed_feeds_emitted_rows_sum", &[("path", "notify")]),
        1.0
    );
    assert_eq!(
        d(
            "runfeed_feeds_live_polls_total",
            &[("path", "fast-hydrate")]
        ),
        1.0
    );
    assert_eq!(
        d("runfeed_feeds_state_lookups_total", &[("result", "hit")]),
        1.0
    );
    assert_eq!(d("runfeed_notifier_messages_received_total", &[]), 1.0);
    assert_eq!(d("runfeed_notifier_batches_delivered_total", &[]), 1.0);
    assert!(d("runfeed_notifier_publishes_total", &[("result", "ok")]) >= 1.0);
    assert!(d("runfeed_router_hydrates_total", &[("result", "ok")]) >= 1.0);
    assert!(d("runfeed_router_hydrated_runs_total", &[]) >= 1.0);
    assert_eq!(d("runfeed_router_deliveries_total", &[]), 1.0);
    assert_eq!(d("runfeed_router_distinct_runs_total", &[]), 1.0);
    assert_eq!(
        s2.get(
            "runfeed_http_duration_milliseconds_count",
            &[("route", RUN_ROUTE), ("live", "true"), ("status", "200")]
        ),
        1.0
    );
    let lag = s2.get(
        "runfeed_feeds_delivery_lag_milliseconds_sum",
        &[("path", "notify")],
    );
    assert!((0.0..5_000.0).contains(&lag), "notify lag {lag} ms");

    // C. A change between two polls is replayed when the next poll registers.
    let arrivals = s2.get("runfeed_router_arrivals_total", &[]);
    srv.change(&env, &r1.id, &[], None, "COMPLETED_SUCCESSFULLY")
        .await;
    scrape_until(&srv, "record routed", |s| {
        s.get("runfeed_router_arrivals_total", &[]) > arrivals
    })
    .await;
    let live_c = srv.fetch(&u1.live_after(&live_b), &h).await;
    live_c.assert_status(200);
    assert_eq!(live_c.changes().len(), 1, "{}", live_c.text);
    let s3 = scrape(&srv).await;
    assert_eq!(
        s3.get("runfeed_router_replays_total", &[("result", "delivered")])
            - s2.get("runfeed_router_replays_total", &[("result", "delivered")]),
        1.0
    );
    assert_eq!(
        s3.get(
            "runfeed_feeds_delivery_lag_milliseconds_count",
            &[("path", "replay")]
        ),
        1.0
    );

    // D + E (concurrently, one hold): an idle hold times out into an empty backstop; a silent
    // update (no publish) is found by a delivering backstop.
    let u2 = run_url(&r2.friendly_id);
    let snap2 = srv.fetch(&u2.snapshot(), &h).await;
    snap2.assert_status(200);
    let s4 = scrape(&srv).await;
    let idle = srv.fetch(&u1.live_after(&live_c), &h);
    let leak = srv.fetch(&u2.live_after(&snap2), &h);
    let silent_update = async {
        srv.wait_held("both feeds held", |h| h.0 == 2).await;
        srv.set_status(&r2.id, "EXECUTING").await; // no change record
    };
    let (live_d, live_e, ()) = within(WAIT, "backstops", async {
        tokio::join!(idle, leak, silent_update)
    })
    .await;
    assert!(live_d.is_bare_up_to_date(), "{}", live_d.text);
    assert_eq!(
        live_e.changes().len(),
        1,
        "backstop found the silent update: {}",
        live_e.text
    );
    let s5 = scrape(&srv).await;
    let d = |name: &str, labels: &[(&str, &str)]| s5.get(name, labels) - s4.get(name, labels);
    assert_eq!(
        d("runfeed_feeds_wakeups_total", &[("reason", "timeout")]),
        2.0
    );
    assert_eq!(
        d("runfeed_feeds_backstops_total", &[("result", "empty")]),
        1.0
    );
    assert_eq!(
        d("runfeed_feeds_backstops_total", &[("result", "delivered")]),
        1.0
    );
    assert_eq!(
        s5.get(
            "runfeed_feeds_delivery_lag_milliseconds_count",
            &[("path", "backstop")]
        ),
        1.0
    );
    assert!(
        s5.get(
            "runfeed_feeds_delivery_lag_milliseconds_sum",
            &[("path", "backstop")]
        ) >= 1_000.0,
        "a backstop delivers a hold late"
    );

    // F. A client that goes away mid-hold: an abort wakeup and a 499.
    let short = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .no_proxy()
        .build()
        .expect("client");
    let abandoned = format!("{}{}", srv.base, u1.live_after(&live_d).render());
    let mut req = short.get(&abandoned);
    for (k, v) in &h {
        req = req.header(k.as_str(), v.as_str());
    }
    assert!(req.send().await.is_err(), "the client gave up first");
    let s6 = scrape_until(&srv, "abort counted", |s| {
        s.get("runfeed_feeds_wakeups_total", &[("reason", "abort")]) >= 1.0
            && s.try_get("runfeed_http_requests_total", &[("status", "499")])
                .is_some()
    })
    .await;
    assert_eq!(
        s6.get(
            "runfeed_http_requests_total",
            &[("route", RUN_ROUTE), ("status", "499")]
        ),
        1.0
    );

    // G. Tag feed: a snapshot misses, the same snapshot right after hits; an offset this server
    // never handed out (instance hop) takes the cold path.
    let ut = tag_url("m");
    let tag_snap = srv.fetch(&ut.snapshot(), &h).await;
    tag_snap.assert_status(200);
    assert_eq!(tag_snap.changes().len(), 4, "{}", tag_snap.text);
    srv.fetch(&ut.snapshot(), &h).await.assert_status(200);
    let s7 = scrape(&srv).await;
    for result in ["miss", "hit"] {
        let tag_resolves = [("kind", "tag"), ("result", result)];
        let n = s7.get("runfeed_runset_resolves_total", &tag_resolves);
        assert!(n >= 1.0, "tag resolves {result}: {n}");
    }
    let tag_queries = (
        "runfeed_runset_query_duration_milliseconds_count",
        [("kind", "tag")],
    );
    assert!(s7.get(tag_queries.0, &tag_queries.1) >= 1.0);
    let hop = ut.live(
        &tag_snap.handle(),
        &format!("{}_999999999", tag_snap.offset_ms()),
        tag_snap.cursor().as_deref(),
    );
    let cold = srv.fetch(&hop, &h).await;
    cold.assert_status(200);
    assert_eq!(
        cold.changes().len(),
        4,
        "cold re-check sends the whole set: {}",
        cold.text
    );
    let s8 = scrape(&srv).await;
    let cold_polls = |s: &Scrape| {
        s.get(
            "runfeed_feeds_live_polls_total",
            &[("path", "cold-resolve")],
        )
    };
    assert_eq!(cold_polls(&s8) - cold_polls(&s7), 1.0);
    // Neither this instance nor the shared store knows that offset.
    assert!(s8.get("runfeed_feeds_state_lookups_total", &[("result", "miss")]) >= 1.0);
    let cursor_misses = [("op", "get"), ("result", "miss")];
    assert!(s8.get("runfeed_feeds_cursor_store_ops_total", &cursor_misses) >= 1.0);
    assert_eq!(
        s8.get(
            "runfeed_feeds_delivery_lag_milliseconds_count",
            &[("path", "cold")]
        ),
        1.0
    );
    assert_eq!(
        s8.get("runfeed_feeds_emitted_rows_sum", &[("path", "cold")]),
        4.0
    );
    assert_eq!(
        s8.get(
            "runfeed_http_requests_total",
            &[("route", TAG_ROUTE), ("status", "200")]
        ),
        3.0
    );

    // H. A burst of more runs than the replay buffer holds (cap 3) evicts by cap; the records
    // from steps B/C (over the 2 s window old by now) go by window.
    for run in &tagged {
        let rec = TestServer::record(&env, &run.id, &["m"], None, run.updated_at_ms);
        srv.publish(&rec).await;
    }
    let s9 = scrape_until(&srv, "evictions", |s| {
        s.get(
            "runfeed_router_replay_evictions_total",
            &[("reason", "cap")],
        ) >= 1.0
            && s.get(
                "runfeed_router_replay_evictions_total",
                &[("reason", "window")],
            ) >= 1.0
    })
    .await;

    // Present and sane without a workload of their own.
    assert_eq!(
        s9.get("runfeed_feeds_concurrency_rejections_total", &[]),
        0.0,
        "no 429 in this workload"
    );
    assert_eq!(s9.get("runfeed_runset_admission_in_use", &[]), 0.0);
    for series in [
        "runfeed_runset_admission_waits_total",
        "runfeed_feeds_window_runs",
        "runfeed_runset_resolves_total{result=coalesced}",
        "runfeed_router_stale_hydrates_total{outcome=gave_up}",
        "runfeed_router_stale_hydrates_total{outcome=recovered}",
        "runfeed_replica_gate_waits_total{outcome=gave_up}",
        "runfeed_pg_errors_total{kind=connection}",
        "runfeed_pg_errors_total{kind=pool_timeout}",
        "runfeed_pg_errors_total{kind=database}",
        "runfeed_pg_errors_total{kind=other}",
        "runfeed_pg_tag_set_plans_total{plan=ordered}",
        "runfeed_redis_errors_total{kind=connection}",
        "runfeed_redis_errors_total{kind=command}",
        "runfeed_redis_errors_total{kind=lagged}",
        "runfeed_redis_errors_total{kind=lost_subscription}",
        "runfeed_feeds_delivery_lag_milliseconds_bucket{le=+Inf}",
    ] {
        assert!(s9.has(series), "{series} is exported");
    }
    assert!(
        s9.get("runfeed_pg_tag_set_plans_total", &[("plan", "planner")]) >= 1.0,
        "the tag feed's cold read, planned by Postgres on this small table"
    );
    assert!(s9.get("runfeed_replica_lag_estimate_milliseconds", &[]) >= 0.0);
    assert_eq!(
        s9.get("runfeed_pg_replica_bypassed", &[]),
        1.0,
        "the second URL's server is not in recovery: replica reads go to the primary"
    );
    assert_eq!(s9.get("runfeed_redis_connected", &[]), 1.0);
    assert!(s9.get("runfeed_process_resident_memory_bytes", &[]) > 1_000_000.0);
    assert_eq!(
        s9.get(
            "runfeed_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0,
        "the build-info gauge names this build's version"
    );
    assert_eq!(
        s9.try_get(
            "runfeed_feeds_wakeups_total",
            &[("otel_scope_name", "runfeed")]
        )
        .map(|v| v > 0.0),
        Some(true),
        "instrumentation scope label"
    );

    // Every instrument present; nothing unlisted.
    let families = s9.families();
    let expected: BTreeSet<String> = FAMILIES.iter().map(|f| f.to_string()).collect();
    let missing: Vec<_> = expected.difference(&families).collect();
    let unknown: Vec<_> = families.difference(&expected).collect();
    assert!(
        missing.is_empty(),
        "instruments missing from /metrics: {missing:?}"
    );
    assert!(
        unknown.is_empty(),
        "instruments not listed in FAMILIES: {unknown:?}"
    );
    // Help text (descriptions) for every family.
    let text = srv.scrape_text().await;
    for family in FAMILIES {
        assert!(
            text.contains(&format!("# HELP {family} ")),
            "no description for {family}"
        );
    }
}

/// `/healthz` is 200; `/readyz` is 200 with Postgres and Redis reachable, and 503 naming
/// Postgres when the database is unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_and_readyz_on_the_admin_listener() {
    let srv = TestServer::start(1_000).await;
    let get = |url: String| {
        let http = srv.http.clone();
        async move {
            let resp = within(WAIT, &url, http.get(&url).send())
                .await
                .expect("send");
            let status = resp.status().as_u16();
            let body: Value = within(WAIT, &url, resp.json()).await.expect("json body");
            (status, body)
        }
    };
    let (status, body) = get(format!("{}/healthz", srv.admin_base())).await;
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")));
    let (status, body) = get(format!("{}/readyz", srv.admin_base())).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["checks"]["postgres"], "ok");
    assert_eq!(body["checks"]["redis"], "ok");

    // A peer whose database does not exist: not ready, and the Postgres error is counted.
    let peer = srv
        .peer(|c| {
            c.database.url = format!("{PG_ADMIN}/runfeed_no_such_database");
            c.database.replica_url = None;
        })
        .await;
    let admin = peer.running.admin_addr.expect("peer admin");
    let (status, body) = get(format!("http://{admin}/readyz")).await;
    assert_eq!(status, 503, "{body}");
    assert_ne!(body["checks"]["postgres"], "ok", "{body}");
    assert_eq!(body["checks"]["redis"], "ok", "{body}");
    let text = within(WAIT, "peer metrics", async {
        srv.http
            .get(format!("http://{admin}/metrics"))
            .send()
            .await
            .expect("send")
            .text()
            .await
            .expect("body")
    })
    .await;
    let errors: f64 = Scrape::parse(&text).get("runfeed_pg_errors_total", &[]);
    assert!(errors >= 1.0, "postgres errors counted: {errors}");
    peer.running.stop().await;
}

/// A live poll over the environment's concurrency limit is answered 429 and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_rejections_count_429s() {
    let srv = TestServer::start_with(5_000, |c| c.feeds.default_concurrency_limit = 1).await;
    let FollowedRun {
        env,
        run,
        headers: h,
        url: u,
        snap,
    } = srv.follow_new_run().await;
    let live = u.live_after(&snap);
    let held = srv.fetch(&live, &h);
    let second = async {
        srv.wait_held("first poll held", |h| h.0 == 1).await;
        let r = srv.fetch(&live, &h).await;
        srv.change(&env, &run.id, &[], None, "EXECUTING").await; // let the first poll go
        r
    };
    let (first, rejected) = within(WAIT, "429", async { tokio::join!(held, second) }).await;
    first.assert_status(200);
    rejected.assert_status(429);
    let s = scrape(&srv).await;
    assert_eq!(
        s.get("runfeed_feeds_concurrency_rejections_total", &[]),
        1.0
    );
    assert_eq!(
        s.get(
            "runfeed_http_requests_total",
            &[("route", RUN_ROUTE), ("status", "429")]
        ),
        1.0
    );
}

/// With `telemetry.otlp_endpoint` set, the server pushes OTLP/HTTP protobuf to
/// `<endpoint>/v1/metrics` every `otlp_interval_ms`, carrying the runfeed instruments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_export_pushes_metrics_to_the_configured_endpoint() {
    use std::sync::{Arc, Mutex};
    /// `(path, content type, body)` of each request the stub collector got.
    type Received = Arc<Mutex<Vec<(String, String, Vec<u8>)>>>;
    let received: Received = Arc::default();
    let sink = received.clone();
    let collector = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let sink = sink.clone();
        async move {
            let path = req.uri().path().to_string();
            let content_type = req
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let body = axum::body::to_bytes(req.into_body(), 16 * 1024 * 1024)
                .await
                .map(|b| b.to_vec())
                .unwrap_or_default();
            sink.lock().expect("sink").push((path, content_type, body));
            axum::http::StatusCode::OK
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind collector");
    let endpoint = format!("http://{}", listener.local_addr().expect("collector addr"));
    let server = tokio::spawn(async move { axum::serve(listener, collector).await });

    let srv = TestServer::start_with(1_000, |c| {
        c.telemetry.otlp_endpoint = Some(endpoint.clone());
        c.telemetry.otlp_interval_ms = 200;
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    // Exports repeat every 200 ms; an early one may precede the first data points, so wait
    // for one that carries the instruments.
    let contains =
        |body: &[u8], needle: &str| body.windows(needle.len()).any(|w| w == needle.as_bytes());
    let (path, content_type, body) = loop {
        let found = received
            .lock()
            .expect("sink")
            .iter()
            .find(|(_, _, b)| {
                contains(b, "runfeed.feeds.wakeups") && contains(b, "runfeed.router.held_feeds")
            })
            .cloned();
        if let Some(export) = found {
            break export;
        }
        assert!(
            Instant::now() < deadline,
            "no OTLP export with the instruments within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(path, "/v1/metrics");
    assert_eq!(content_type, "application/x-protobuf");
    let has = |needle: &str| contains(&body, needle);
    assert!(
        has("runfeed.feeds.wakeups") && has("runfeed.router.held_feeds"),
        "instrument names in the export"
    );
    assert!(has("runfeed"), "service.name resource attribute");
    drop(srv);
    server.abort();
}

// ---------------------------------------------------------------------------------------------
// Dashboard queries against a real Prometheus

/// A Prometheus started by `scripts/prometheus-check.sh`; killed on drop.
struct Prometheus {
    url: String,
    pid: u32,
}

impl Prometheus {
    fn start(target: &str) -> Prometheus {
        let root = env!("CARGO_MANIFEST_DIR");
        let out = std::process::Command::new("bash")
            .arg(format!("{root}/scripts/prometheus-check.sh"))
            .args(["start", target, "120"])
            .stderr(std::process::Stdio::inherit())
            .output()
            .expect("run scripts/prometheus-check.sh");
        assert!(
            out.status.success(),
            "scripts/prometheus-check.sh start failed"
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let field = |key: &str| {
            stdout
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .unwrap_or_else(|| panic!("no {key} in {stdout:?}"))
                .to_string()
        };
        Prometheus {
            url: field("PROMETHEUS_URL="),
            pid: field("PROMETHEUS_PID=").parse().expect("pid"),
        }
    }

    /// Runs an instant query; `Err` with the API's error for a query that does not evaluate.
    async fn query(&self, http: &reqwest::Client, expr: &str) -> Result<Vec<Value>, String> {
        let resp = within(
            WAIT,
            "prometheus query",
            http.post(format!("{}/api/v1/query", self.url))
                .form(&[("query", expr)])
                .send(),
        )
        .await
        .map_err(|e| e.to_string())?;
        let body: Value = within(WAIT, "prometheus answer", resp.json())
            .await
            .map_err(|e| e.to_string())?;
        if body["status"] != "success" {
            return Err(format!("{}: {}", body["errorType"], body["error"]));
        }
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .arg(self.pid.to_string())
            .status();
    }
}

/// Grafana's interval variables, as a panel would render them.
fn render(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "15s")
        .replace("$__range", "5m")
}

/// Every `expr` of the dashboard's panels (rows' nested panels too), with the panel title.
fn dashboard_queries() -> Vec<(String, String)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/grafana/dashboards/runfeed.json"
    );
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("read dashboard"))
        .expect("dashboard JSON");
    fn walk(panels: &Value, out: &mut Vec<(String, String)>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("?").to_string();
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = t["expr"].as_str() {
                    out.push((title.clone(), expr.to_string()));
                }
            }
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dash["panels"], &mut out);
    assert_eq!(dash["uid"], "runfeed");
    assert!(out.len() >= 20, "dashboard has {} queries", out.len());
    out
}

/// Every `expr:` of the provisioned alert rules.
fn alert_queries() -> Vec<String> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/grafana/provisioning/alerting/runfeed-alerts.yml"
    );
    let text = std::fs::read_to_string(path).expect("read alert rules");
    let exprs: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr:"))
        .map(|e| e.trim().trim_matches('\'').to_string())
        .collect();
    assert!(exprs.len() >= 3, "alert rules: {exprs:?}");
    exprs
}

/// After a workload, every dashboard panel's query (and every alert rule's) returns at least one
/// series from a real Prometheus scraping this server's admin listener every second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_panels_return_series() {
    let queries = dashboard_queries();
    let alerts = alert_queries();
    let srv = TestServer::start_with(1_000, gate_on).await;
    let admin = srv
        .running()
        .admin_addr
        .expect("admin listener")
        .to_string();
    let prom = Prometheus::start(&admin);

    // Workload: a snapshot, a held poll woken by a change, an idle hold into its backstop, a
    // tag snapshot (resolve latency, cache hit on the second), a client that goes away.
    let env = srv.env().await;
    let run = srv.run(&env, RunSpec::default()).await;
    srv.tagged_run(&env, &["d"]).await;
    let h = modern(&srv.token(&env, &["read:runs", "read:tags:d"]));
    let u = run_url(&run.friendly_id);
    let snap = srv.fetch(&u.snapshot(), &h).await;
    snap.assert_status(200);
    srv.wait_subscribed(&env.env_id).await;
    let poll = srv.fetch(&u.live_after(&snap), &h);
    let change = async {
        srv.wait_held("held", |h| h.0 == 1).await;
        srv.change(&env, &run.id, &[], None, "EXECUTING").await;
    };
    let (live, ()) = within(WAIT, "wake", async { tokio::join!(poll, change) }).await;
    live.assert_status(200);
    let idle = srv.fetch(&u.live_after(&live), &h).await;
    idle.assert_status(200);
    for _ in 0..2 {
        srv.fetch(&tag_url("d").snapshot(), &h)
            .await
            .assert_status(200);
    }

    // Wait until Prometheus has two scrapes with the series the workload created last (so
    // every earlier series has two samples too, enough for rate()).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = prom
            .query(&srv.http, r#"count_over_time(runfeed_runset_query_duration_milliseconds_count{kind="tag"}[1m]) >= 2"#)
            .await;
        if ready.as_ref().is_ok_and(|r| !r.is_empty()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus never scraped runfeed twice after the workload: {ready:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let mut failures = Vec::new();
    for (title, expr) in &queries {
        let rendered = render(expr);
        match prom.query(&srv.http, &rendered).await {
            Ok(series) if !series.is_empty() => {}
            Ok(_) => failures.push(format!("panel {title:?}: no series for {rendered}")),
            Err(err) => failures.push(format!("panel {title:?}: {err} in {rendered}")),
        }
    }
    for expr in &alerts {
        match prom.query(&srv.http, expr).await {
            Ok(series) if !series.is_empty() => {}
            Ok(_) => failures.push(format!("alert rule: no series for {expr}")),
            Err(err) => failures.push(format!("alert rule: {err} in {expr}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} queries failed:\n{}",
        failures.len(),
        queries.len() + alerts.len(),
        failures.join("\n")
    );
    println!(
        "dashboard: {} panel queries and {} alert queries returned series",
        queries.len(),
        alerts.len()
    );
}

#[test]
fn label_parser_handles_braces_and_escapes() {
    let s = Scrape::parse(
        "# HELP x y\nx_total{route=\"/a/{id}\",q=\"say \\\"hi\\\"\",otel_scope_name=\"runfeed\"} 3\nplain 1.5\nh_bucket{le=\"+Inf\"} 2\n",
    );
    assert_eq!(s.get("x_total", &[("route", "/a/{id}")]), 3.0);
    assert_eq!(s.get("x_total", &[("q", "say \"hi\"")]), 3.0);
    assert_eq!(s.get("plain", &[]), 1.5);
    assert_eq!(s.get("h_bucket", &[("le", "+Inf")]), 2.0);
}

/// The metric reference (docs/observability.md, `runfeed metrics-reference`) is generated from
/// the instrument declarations; its Prometheus names must be exactly the families the exporter
/// exposes (checked against a real scrape by `every_instrument_is_exported_and_moves_with_the_workload`).
#[test]
fn the_declared_instruments_are_exactly_the_exported_families() {
    let declared: BTreeSet<String> = runfeed::telemetry::metrics::exported()
        .into_iter()
        .map(|e| e.prometheus)
        .collect();
    let exported: BTreeSet<String> = FAMILIES.iter().map(|f| f.to_string()).collect();
    assert_eq!(
        declared, exported,
        "src/telemetry/metrics.rs declarations vs FAMILIES (the scraped families)"
    );
}

/// The dashboard imports into any Grafana: every panel and query picks its Prometheus through
/// the `datasource` template variable, never a fixed datasource uid.
#[test]
fn the_dashboard_takes_its_datasource_from_a_variable() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/grafana/dashboards/runfeed.json"
    );
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("read dashboard"))
        .expect("dashboard JSON");
    let vars = dash["templating"]["list"]
        .as_array()
        .expect("templating.list");
    assert!(
        vars.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "no `datasource` variable of type datasource (prometheus): {vars:?}"
    );
    fn walk(v: &Value, uses: &mut usize, fixed: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                if let Some(uid) = map.get("datasource").and_then(|d| d.get("uid")) {
                    if uid == "${datasource}" {
                        *uses += 1;
                    } else {
                        fixed.push(uid.to_string());
                    }
                }
                map.values().for_each(|v| walk(v, uses, fixed));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, uses, fixed)),
            _ => {}
        }
    }
    let (mut uses, mut fixed) = (0, Vec::new());
    walk(&dash["panels"], &mut uses, &mut fixed);
    assert!(fixed.is_empty(), "fixed datasource uids: {fixed:?}");
    assert!(
        uses >= 20,
        "only {uses} datasource references use the variable"
    );
}
