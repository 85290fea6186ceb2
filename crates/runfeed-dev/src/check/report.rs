//! The checker's report: figures, violations per property (with the known ones marked), and
//! for the first violations of each property the minimal history that shows it — the writer's
//! versions of that run with commit and publish times, and the client's requests and
//! responses around it.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::model::{Event, Fate, FaultKind, History, Ms, StreamEnd, SubLog};
use super::props::{quantile, Outcome, Property, Violation};
use super::readers::STORM;
use crate::client::RequestKind;

/// A property whose violations are known (a regression test pins them; `--known`).
#[derive(Clone, Debug, Serialize)]
pub struct Known {
    pub property: Property,
    /// The test that pins it, e.g. `tests/it/correctness.rs::a_snapshot_…`.
    pub test: String,
}

/// Figures of a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Figures {
    pub seed: u64,
    /// Wall time of the whole check, s.
    pub duration_s: f64,
    /// Seconds of writes and reader churn.
    pub churn_s: f64,
    pub instances: usize,
    pub runs: usize,
    pub versions: usize,
    pub subscriptions: usize,
    /// Subscriptions by client kind.
    pub subscriptions_by_client: BTreeMap<String, usize>,
    pub requests: usize,
    pub hops: usize,
    pub dropped_responses: usize,
    pub aborted_polls: usize,
    pub pauses: usize,
    pub foreign_probes: usize,
    pub resets: usize,
    pub failed_requests: usize,
    /// SSE streams opened (slow readers, `--sse-fraction`).
    pub sse_streams: usize,
    /// Times an SSE reader stopped reading an open stream.
    pub sse_stalls: usize,
    /// Of those, stalls at least as long as the server's stall timeout.
    pub sse_stalls_over_timeout: usize,
    /// Streams that broke after such a stall (ended by the server's stall bound); the
    /// reader reconnected at its last offset.
    pub sse_stalled_out: usize,
    /// Streams the server ended cleanly (`feeds.sse_max_duration_ms`, a drain).
    pub sse_closed_by_server: usize,
    /// `runfeed_feeds_stalled_streams_total` summed over every instance process.
    pub sse_server_stalled_streams: usize,
    /// Requests and streams a reconnect storm dropped (each reopened within 1 s).
    pub storm_reconnects: usize,
    /// Injected faults by kind.
    pub faults: BTreeMap<String, usize>,
    pub publishes_lost: usize,
    pub publishes_duplicated: usize,
    pub publishes_late: usize,
    pub publishes_failed: usize,
    pub snapshots_checked: usize,
    pub rows_checked: usize,
    pub timely_samples: usize,
    /// Samples over the bound (counted or tolerated by the quantile's budget).
    pub timely_late: usize,
    pub timely_excused: usize,
    pub timely_excused_outage: usize,
    pub timely_p50_ms: Option<f64>,
    pub timely_p99_ms: Option<f64>,
    pub timely_max_ms: Option<f64>,
    pub lost_samples: usize,
    pub converge_subs: usize,
    pub converge_p50_ms: Option<f64>,
    pub converge_max_ms: Option<f64>,
    /// The replica's sampled replay lag, ms (with a replica).
    pub replica_lag_p50_ms: Option<f64>,
    pub replica_lag_p99_ms: Option<f64>,
    pub replica_lag_max_ms: Option<f64>,
    /// Stale snapshots: how long before the request the newer version was announced (ms).
    pub stale_age_min_ms: Option<f64>,
    pub stale_age_max_ms: Option<f64>,
}

/// The whole report (`--json`).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub figures: Figures,
    /// Counted violations per property.
    pub violations: BTreeMap<String, usize>,
    pub known: Vec<Known>,
    /// True when every property without a known entry has 0 violations.
    pub passed: bool,
    /// Up to 200 violations, counted ones first.
    pub details: Vec<Violation>,
    pub options: serde_json::Value,
}

/// Builds the figures from the logs and the outcome.
pub fn figures(
    seed: u64,
    h: &History,
    subs: &[SubLog],
    outcome: &Outcome,
    duration_s: f64,
    churn_s: f64,
    instances: usize,
) -> Figures {
    let mut f = Figures {
        seed,
        duration_s,
        churn_s,
        instances,
        runs: h.runs.len(),
        versions: h.version_count(),
        subscriptions: subs.len(),
        ..Figures::default()
    };
    for s in subs {
        *f.subscriptions_by_client
            .entry(s.client.name().to_string())
            .or_default() += 1;
        f.hops += s.hops();
        for e in &s.events {
            match e {
                Event::Request { foreign, kind, .. } => {
                    f.requests += 1;
                    if *foreign {
                        f.foreign_probes += 1;
                    }
                    if *kind == RequestKind::Sse {
                        f.sse_streams += 1;
                    }
                }
                Event::Response { dropped, .. } => {
                    if *dropped {
                        f.dropped_responses += 1;
                    }
                }
                Event::Failed { aborted, error, .. } => {
                    if error == STORM {
                        f.storm_reconnects += 1;
                    } else if *aborted && error != "check ended" {
                        f.aborted_polls += 1;
                    } else if !*aborted {
                        f.failed_requests += 1;
                    }
                }
                Event::Paused { .. } => f.pauses += 1,
                Event::Reset { .. } => f.resets += 1,
                Event::StreamEnded { how, .. } => match how {
                    StreamEnd::StalledOut => f.sse_stalled_out += 1,
                    StreamEnd::Closed => f.sse_closed_by_server += 1,
                    StreamEnd::ReaderClosed => {}
                },
                Event::Rows { .. } => {}
            }
        }
    }
    // Foreign probes are logged as dropped responses; do not count them twice.
    f.dropped_responses = f.dropped_responses.saturating_sub(f.foreign_probes);
    for fault in &h.faults {
        *f.faults.entry(fault.kind.name().to_string()).or_default() += 1;
    }
    for r in &h.runs {
        for v in &r.versions {
            match v.fate {
                Fate::Lost => f.publishes_lost += 1,
                Fate::Duplicated => f.publishes_duplicated += 1,
                Fate::Late => f.publishes_late += 1,
                Fate::Normal => {}
            }
            f.publishes_failed += v.publishes.iter().filter(|p| !p.ok).count();
        }
    }
    let o = &outcome.figures;
    f.snapshots_checked = o.snapshots;
    f.rows_checked = o.rows;
    f.timely_samples = o.timely_samples.len();
    f.timely_late = outcome
        .violations
        .iter()
        .filter(|v| v.property == Property::Timely && v.kind == "late")
        .count();
    f.timely_excused = o.timely_excused;
    f.timely_excused_outage = o.timely_excused_outage;
    f.timely_p50_ms = quantile(&o.timely_samples, 0.5);
    f.timely_p99_ms = quantile(&o.timely_samples, 0.99);
    f.timely_max_ms = quantile(&o.timely_samples, 1.0);
    f.lost_samples = o.lost_samples;
    f.converge_subs = o.converge_subs;
    f.converge_p50_ms = quantile(&o.converge_ms, 0.5);
    f.converge_max_ms = quantile(&o.converge_ms, 1.0);
    let lags: Vec<f64> = h.replica_lag.iter().map(|(_, l)| *l).collect();
    f.replica_lag_p50_ms = quantile(&lags, 0.5);
    f.replica_lag_p99_ms = quantile(&lags, 0.99);
    f.replica_lag_max_ms = quantile(&lags, 1.0);
    f.stale_age_min_ms = quantile(&o.stale_ages, 0.0);
    f.stale_age_max_ms = quantile(&o.stale_ages, 1.0);
    f
}

/// Counts the SSE readers' stalls: pauses while a stream was open, and those at least
/// `stall_timeout_ms` long.
pub fn count_stalls(f: &mut Figures, subs: &[SubLog], stall_timeout_ms: u64) {
    for s in subs {
        let mut open = false;
        for e in &s.events {
            match e {
                Event::Request { kind, .. } => open = *kind == RequestKind::Sse,
                Event::StreamEnded { .. } | Event::Failed { .. } => open = false,
                Event::Paused { from, to } if open => {
                    f.sse_stalls += 1;
                    if to - from >= stall_timeout_ms as f64 {
                        f.sse_stalls_over_timeout += 1;
                    }
                }
                _ => {}
            }
        }
    }
}

fn ms(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.0} ms"),
        Some(_) => "never".to_string(),
        None => "-".to_string(),
    }
}

fn t(at: Ms) -> String {
    format!("+{:.3}s", at / 1000.0)
}

/// The summary printed at the end of a check.
pub fn summary(r: &Report) -> String {
    let f = &r.figures;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "check: seed={} — {:.1} s ({:.1} s of writes and churn), {} instance(s)",
        f.seed, f.duration_s, f.churn_s, f.instances
    );
    let _ = writeln!(
        out,
        "  versions checked: {} over {} runs; subscriptions: {} ({}); requests {}, hops {}",
        f.versions,
        f.runs,
        f.subscriptions,
        f.subscriptions_by_client
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", "),
        f.requests,
        f.hops
    );
    let _ = writeln!(
        out,
        "  reader faults: {} dropped responses, {} aborted polls, {} pauses, {} foreign-handle probes, {} 409 resets, {} failed requests",
        f.dropped_responses, f.aborted_polls, f.pauses, f.foreign_probes, f.resets, f.failed_requests
    );
    if f.sse_streams > 0 {
        let _ = writeln!(
            out,
            "  SSE readers: {} streams, {} stalls ({} at least the stall timeout), {} streams ended by the server's stall bound and reopened (the instances counted {}), {} closed by the server",
            f.sse_streams,
            f.sse_stalls,
            f.sse_stalls_over_timeout,
            f.sse_stalled_out,
            f.sse_server_stalled_streams,
            f.sse_closed_by_server
        );
    }
    if f.storm_reconnects > 0 || f.faults.contains_key(FaultKind::ReconnectStorm.name()) {
        let _ = writeln!(
            out,
            "  reconnect storms: {} requests and streams dropped and reopened on another instance",
            f.storm_reconnects
        );
    }
    let _ = writeln!(
        out,
        "  injected faults: {}; publishes lost {}, duplicated {}, late {}, failed {}",
        if f.faults.is_empty() {
            "none".to_string()
        } else {
            f.faults
                .iter()
                .map(|(k, v)| format!("{k} ×{v}"))
                .collect::<Vec<_>>()
                .join(", ")
        },
        f.publishes_lost,
        f.publishes_duplicated,
        f.publishes_late,
        f.publishes_failed
    );
    let _ = writeln!(
        out,
        "  snapshots checked {}, rows checked {}; timely: {} samples (p50 {}, p99 {}, max {}; {} over the bound), {} excused ({} by outages), {} lost-publish samples; converged: {} subscriptions (p50 {}, max {} after writes stopped)",
        f.snapshots_checked,
        f.rows_checked,
        f.timely_samples,
        ms(f.timely_p50_ms),
        ms(f.timely_p99_ms),
        ms(f.timely_max_ms),
        f.timely_late,
        f.timely_excused,
        f.timely_excused_outage,
        f.lost_samples,
        f.converge_subs,
        ms(f.converge_p50_ms),
        ms(f.converge_max_ms)
    );
    if f.replica_lag_max_ms.is_some() {
        let _ = writeln!(
            out,
            "  replica replay lag: p50 {}, p99 {}, max {}",
            ms(f.replica_lag_p50_ms),
            ms(f.replica_lag_p99_ms),
            ms(f.replica_lag_max_ms)
        );
    }
    let _ = writeln!(out, "  property            violations");
    for p in Property::ALL {
        let n = r.violations.get(p.name()).copied().unwrap_or(0);
        let known = r.known.iter().find(|k| k.property == p);
        let note = match (n, known) {
            (0, _) => String::new(),
            (_, Some(k)) => format!("   KNOWN (see {})", k.test),
            (_, None) => "   FAILED".to_string(),
        };
        let _ = writeln!(out, "  {:<18}  {n}{note}", p.name());
    }
    for k in &r.known {
        let n = r.violations.get(k.property.name()).copied().unwrap_or(0);
        if n > 0 {
            let _ = writeln!(
                out,
                "KNOWN: {} violated {n}× (see {})",
                k.property.name(),
                k.test
            );
        }
    }
    let _ = writeln!(
        out,
        "check: {} (seed {})",
        if r.passed { "PASSED" } else { "FAILED" },
        f.seed
    );
    out
}

/// The minimal history of one violation: the writer's versions of its run and the client's
/// requests and responses around it.
pub fn explain(h: &History, subs: &[SubLog], v: &Violation) -> String {
    let mut out = String::new();
    let sub = subs.iter().find(|s| s.id == v.sub);
    let run = v.run.map(|i| &h.runs[i]);
    let _ = writeln!(
        out,
        "--- {} / {} at {}: sub #{} ({}, {}, {}){}",
        v.property.name(),
        v.kind,
        t(v.at),
        v.sub,
        sub.map_or("?", |s| s.reader.as_str()),
        sub.map_or("?", |s| s.client.name()),
        sub.map_or("?".to_string(), |s| format!(
            "{} {}",
            s.feed.describe(h),
            s.url
        )),
        run.map_or(String::new(), |r| format!(
            ", run {} ({})",
            r.friendly_id, h.envs[r.env].label
        ))
    );
    let _ = writeln!(out, "    {}", v.what);
    let (from, to) = (v.at - 4_000.0, v.at + 2_500.0);
    if let Some(r) = run {
        let _ = writeln!(out, "  writer, run {} (id {}):", r.friendly_id, r.id);
        for ver in &r.versions {
            let near = ver.committed >= from - 2_000.0 && ver.committed <= to;
            if !near && ver.ver != 0 && r.versions.len() > 12 {
                continue;
            }
            let pubs = ver
                .publishes
                .iter()
                .map(|p| {
                    format!(
                        "{} {}{}{}",
                        t(p.at),
                        if p.ok {
                            format!("ok→{}", p.receivers)
                        } else {
                            "FAILED".to_string()
                        },
                        if p.full { "" } else { " partial" },
                        if p.watermark { "" } else { " no-watermark" }
                    )
                })
                .collect::<Vec<_>>()
                .join(", ");
            let _ = writeln!(
                out,
                "    v{:<3} committed {} (sent {})  {:?} {:<22} tags {:?} updatedAt {}  fate {:?}  publish: {}",
                ver.ver,
                t(ver.committed),
                t(ver.commit_started),
                ver.op,
                ver.status,
                ver.tags,
                ver.updated_at_ms,
                ver.fate,
                if pubs.is_empty() { "-".to_string() } else { pubs }
            );
        }
    }
    if let Some(s) = sub {
        let _ = writeln!(
            out,
            "  client sub #{} (started {}, ended {}):",
            s.id,
            t(s.started),
            s.ended.map_or("-".to_string(), t)
        );
        let describe_rows = |rows: &[super::model::RowObs]| -> String {
            let mine: Vec<String> = rows
                .iter()
                .filter(|row| run.is_none_or(|r| r.id == row.run_id))
                .map(|row| {
                    let ver = h
                        .run_index(&row.run_id)
                        .and_then(|i| row.updated_at_ms.and_then(|ms| h.runs[i].version_at(ms)))
                        .map_or("v?".to_string(), |v| format!("v{}", v.ver));
                    format!("{} {} (updatedAt {:?})", row.op, ver, row.updated_at_ms)
                })
                .collect();
            let others = rows.len() - mine.len();
            format!(
                "{}{}",
                if mine.is_empty() {
                    "run absent".to_string()
                } else {
                    mine.join(", ")
                },
                if others > 0 {
                    format!(" (+{others} other rows)")
                } else {
                    String::new()
                }
            )
        };
        // Minimal: the snapshot requests, every response or row batch that carries the run (and
        // the request it answers), resets, failures and pauses; other traffic is collapsed.
        let carries = |rows: &[super::model::RowObs]| {
            run.is_none_or(|r| rows.iter().any(|row| row.run_id == r.id))
        };
        let in_window: Vec<&Event> = s
            .events
            .iter()
            .filter(|e| e.at() >= from && e.at() <= to)
            .collect();
        let mut keep = vec![false; in_window.len()];
        let mut wanted_requests = std::collections::HashSet::new();
        for (i, e) in in_window.iter().enumerate() {
            keep[i] = match e {
                Event::Request { id, kind, .. } => {
                    let snapshot = *kind == crate::client::RequestKind::Snapshot;
                    if snapshot {
                        wanted_requests.insert(*id);
                    }
                    snapshot
                }
                Event::Response {
                    req, rows, status, ..
                } => {
                    let relevant = carries(rows) && !rows.is_empty() || *status != 200;
                    if relevant {
                        wanted_requests.insert(*req);
                    }
                    relevant
                }
                Event::Rows { rows, .. } => carries(rows) && !rows.is_empty(),
                Event::Failed { req, .. } => {
                    wanted_requests.insert(*req);
                    true
                }
                Event::Reset { .. } | Event::Paused { .. } | Event::StreamEnded { .. } => true,
            };
        }
        for (i, e) in in_window.iter().enumerate() {
            let wanted = match e {
                // A request whose response or failure is kept.
                Event::Request { id, .. } => wanted_requests.contains(id),
                // The response to a kept snapshot request.
                Event::Response { req, .. } => wanted_requests.contains(req),
                _ => false,
            };
            keep[i] |= wanted;
        }
        let mut skipped = 0usize;
        let mut shown = 0usize;
        for (i, e) in in_window.iter().enumerate() {
            if !keep[i] {
                skipped += 1;
                continue;
            }
            if skipped > 0 {
                let _ = writeln!(out, "    … {skipped} requests/responses without the run …");
                skipped = 0;
            }
            let at = e.at();
            shown += 1;
            if shown > 40 {
                let _ = writeln!(out, "    …");
                break;
            }
            let line = match *e {
                Event::Request {
                    id,
                    instance,
                    kind,
                    offset,
                    foreign,
                    ..
                } => format!(
                    "req#{id} → instance {instance} {kind:?} offset={offset}{}",
                    if *foreign { " (foreign handle)" } else { "" }
                ),
                Event::Response {
                    req,
                    status,
                    offset,
                    rows,
                    dropped,
                    ..
                } => format!(
                    "resp#{req} {status} offset={} {}{}",
                    offset.as_deref().unwrap_or("-"),
                    if s.client.is_rust() {
                        describe_rows(rows)
                    } else {
                        String::new()
                    },
                    if *dropped {
                        " [DROPPED by the reader]"
                    } else {
                        ""
                    }
                ),
                Event::Failed {
                    req,
                    error,
                    aborted,
                    ..
                } => format!(
                    "req#{req} failed{}: {error}",
                    if *aborted { " (aborted)" } else { "" }
                ),
                Event::Rows {
                    rows, snapshot_of, ..
                } => format!(
                    "rows{}: {}",
                    snapshot_of.map_or(String::new(), |r| format!(" (snapshot of req#{r})")),
                    describe_rows(rows)
                ),
                Event::Reset { .. } => "must-refetch: view dropped".to_string(),
                Event::StreamEnded { req, how, .. } => format!("stream req#{req} ended: {how:?}"),
                Event::Paused { to, .. } => format!("paused until {}", t(*to)),
            };
            let _ = writeln!(out, "    {} {line}", t(at));
        }
        if skipped > 0 {
            let _ = writeln!(out, "    … {skipped} requests/responses without the run …");
        }
    }
    let faults: Vec<String> = h
        .faults
        .iter()
        .filter(|f| f.to >= from - 2_000.0 && f.from <= to)
        .map(|f| format!("{} {}–{} {}", f.kind.name(), t(f.from), t(f.to), f.detail))
        .collect();
    if !faults.is_empty() {
        let _ = writeln!(out, "  faults nearby: {}", faults.join("; "));
    }
    out
}

/// Fault kinds in report order.
pub const FAULT_KINDS: [FaultKind; 8] = [
    FaultKind::InstanceRestart,
    FaultKind::RedisRestart,
    FaultKind::RedisPause,
    FaultKind::RedisFreeze,
    FaultKind::ClusterNodeRestart,
    FaultKind::ClusterFailover,
    FaultKind::ReplicaDelay,
    FaultKind::ReconnectStorm,
];
