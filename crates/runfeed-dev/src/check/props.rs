//! The six delivery properties, checked per subscription against the writers' log. Pure: the
//! inputs are a [`History`] and the [`SubLog`]s, the output every [`Violation`] found.
//!
//! 1. **Monotonic**: a client never sees a version of a run older than one it already saw (and
//!    every version it sees is one the writers committed, with that version's content).
//! 2. **Fresh start**: a snapshot never starts older than a version committed and announced
//!    (published) before its request, except within the replica-lag bound.
//! 3. **Convergent**: after writes stop, every client's view equals the database within one hold
//!    plus one backstop.
//! 4. **Timely**: outside outages, every version that is not superseded reaches every subscribed
//!    client within the bound (1 s) at the quantile (p99); a version whose publish was lost
//!    within the lost-publish bound (the backstop).
//! 5. **Isolated**: no client sees a row of another environment or outside its filter.
//! 6. **No server errors**: no 5xx, no other unexpected status; a 409 only for a foreign handle;
//!    no failed connection outside an injected outage.

use std::collections::HashMap;

use serde::Serialize;

use super::model::{Clock, Event, FeedSpec, History, Ms, RowObs, SubLog};
use crate::client::RequestKind;

/// Replay-lag samples are taken every 50 ms: a version counts as applied on the replica before
/// a request only when a sample at least this long before the request shows it.
const REPLICA_SAMPLE_SLACK_MS: Ms = 60.0;

/// The six properties.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Property {
    Monotonic,
    FreshStart,
    Convergent,
    Timely,
    Isolated,
    NoServerErrors,
}

impl Property {
    /// All six, in report order.
    pub const ALL: [Property; 6] = [
        Property::Monotonic,
        Property::FreshStart,
        Property::Convergent,
        Property::Timely,
        Property::Isolated,
        Property::NoServerErrors,
    ];

    /// The name used in reports and in `--known`.
    pub fn name(self) -> &'static str {
        match self {
            Property::Monotonic => "monotonic",
            Property::FreshStart => "fresh-start",
            Property::Convergent => "convergent",
            Property::Timely => "timely",
            Property::Isolated => "isolated",
            Property::NoServerErrors => "no-server-errors",
        }
    }

    /// Parses [`Property::name`].
    pub fn parse(s: &str) -> Option<Property> {
        Property::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// The bounds the properties allow, in ms.
#[derive(Clone, Debug, Serialize)]
pub struct Bounds {
    /// Fresh start: a version must have been announced at least this long before the request
    /// to be required in the snapshot (0 without a replica; the replica-lag bound with one).
    pub fresh_slack_ms: Ms,
    /// Timely: the delivery bound for announced versions (1 000). With a replica it counts
    /// from when the replica had applied the version (replay-lag samples), or else it is
    /// extended by the apply delay in effect.
    pub timely_ms: Ms,
    /// Timely: the share of samples that must be within `timely_ms` (0.99).
    pub timely_quantile: f64,
    /// Timely: the bound for versions whose publish was lost (one hold plus one backstop).
    pub lost_ms: Ms,
    /// Convergent: how long after writes stop every view must equal the database.
    pub converge_ms: Ms,
    /// Outage windows are widened by this much on both sides.
    pub fault_margin_ms: Ms,
    /// The `createdAt` floor may be rounded down by up to this much (the minute bucket plus
    /// slack) before a row counts as outside a windowed tag feed.
    pub window_slack_ms: i64,
}

/// One violation.
#[derive(Clone, Debug, Serialize)]
pub struct Violation {
    pub property: Property,
    /// A short machine name (`stale-snapshot`, `late`, …).
    pub kind: &'static str,
    /// The subscription ([`SubLog::id`]).
    pub sub: usize,
    /// The run concerned (index into [`History::runs`]).
    pub run: Option<usize>,
    pub at: Ms,
    pub what: String,
    /// Counted against the property (false: inside the timely quantile's budget).
    pub counted: bool,
}

/// Figures of one check.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Figures {
    /// Snapshot responses checked for freshness.
    pub snapshots: usize,
    /// Rows checked for isolation.
    pub rows: usize,
    /// Timely samples measured (latency ms; `f64::INFINITY` = never delivered).
    #[serde(skip)]
    pub timely_samples: Vec<Ms>,
    /// Timely samples excused (outage, reader pause or failure).
    pub timely_excused: usize,
    /// Of those, excused by an injected outage.
    pub timely_excused_outage: usize,
    /// Lost-publish samples measured.
    pub lost_samples: usize,
    /// Subscriptions checked for convergence.
    pub converge_subs: usize,
    /// Per converged subscription: ms after writes stopped until its view was final.
    #[serde(skip)]
    pub converge_ms: Vec<Ms>,
    /// Fresh-start: announced-before-request ages of the stale snapshots (ms).
    #[serde(skip)]
    pub stale_ages: Vec<Ms>,
}

impl Figures {
    /// The `q` quantile of the timely samples (ms; infinity when a sample never arrived).
    pub fn timely_quantile(&self, q: f64) -> Option<Ms> {
        quantile(&self.timely_samples, q)
    }
}

/// The `q` quantile of `samples` (nearest rank).
pub fn quantile(samples: &[Ms], q: f64) -> Option<Ms> {
    if samples.is_empty() {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    Some(s[rank - 1])
}

/// The result of a check.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Outcome {
    pub violations: Vec<Violation>,
    pub figures: Figures,
}

impl Outcome {
    /// Counted violations of `p`.
    pub fn count(&self, p: Property) -> usize {
        self.violations
            .iter()
            .filter(|v| v.property == p && v.counted)
            .count()
    }
}

/// One row applied to a subscription's view.
#[derive(Clone, Copy, Debug)]
struct Applied {
    at: Ms,
    run: usize,
    /// The version (None: not a version the writers committed).
    ver: Option<u32>,
}

/// A subscription's view over time.
struct Timeline {
    applied: Vec<Applied>,
    resets: Vec<Ms>,
    /// (request time, pinned floor epoch ms) of each snapshot request.
    snapshots: Vec<Ms>,
    /// First 2xx response (or npm rows) after the first snapshot request.
    live_from: Option<Ms>,
    /// Intervals during which the reader itself was not polling: its pauses, and from a failed
    /// request (or a 5xx / 429) to the next request after its backoff.
    impaired: Vec<(Ms, Ms)>,
}

impl Timeline {
    /// The snapshot request that governs time `t` (the last one before it).
    fn pinned_at(&self, t: Ms) -> Option<Ms> {
        self.snapshots.iter().rev().find(|s| **s <= t).copied()
    }

    /// The view at time `t`: run → version.
    fn view_at(&self, t: Ms) -> HashMap<usize, Option<u32>> {
        let mut view = HashMap::new();
        let mut resets = self.resets.iter().peekable();
        for a in self.applied.iter().filter(|a| a.at <= t) {
            while resets.peek().is_some_and(|r| **r <= a.at) {
                view.clear();
                resets.next();
            }
            view.insert(a.run, a.ver);
        }
        if resets.any(|r| *r <= t) {
            view.clear();
        }
        view
    }

    /// The first time at or after `from` when the view held `run` at version ≥ `ver`.
    fn first_seen(&self, run: usize, ver: u32, from: Ms) -> Option<Ms> {
        // A version applied before `from` that is still in the view also counts.
        let mut current: Option<u32> = None;
        let mut resets = self.resets.iter().peekable();
        for a in &self.applied {
            while resets.peek().is_some_and(|r| **r <= a.at) {
                current = None;
                resets.next();
            }
            if a.run != run {
                continue;
            }
            current = a.ver.or(current);
            if current.is_some_and(|v| v >= ver) {
                return Some(a.at.max(from));
            }
        }
        None
    }

    fn impaired_during(&self, from: Ms, to: Ms) -> bool {
        self.impaired.iter().any(|(a, b)| from <= *b && to >= *a)
    }
}

/// Checks every subscription in `subs` against `h`. `end` is when the readers stopped.
pub fn check(h: &History, subs: &[SubLog], b: &Bounds, clock: &Clock, end: Ms) -> Outcome {
    let mut out = Outcome::default();
    let mut timelines = Vec::with_capacity(subs.len());
    for sub in subs {
        timelines.push(walk(h, sub, b, clock, &mut out));
    }
    timely(h, subs, &timelines, b, clock, &mut out);
    convergent(h, subs, &timelines, b, clock, end, &mut out);
    out
}

fn violation(
    out: &mut Outcome,
    property: Property,
    kind: &'static str,
    sub: &SubLog,
    run: Option<usize>,
    at: Ms,
    what: String,
) {
    out.violations.push(Violation {
        property,
        kind,
        sub: sub.id,
        run,
        at,
        what,
        counted: true,
    });
}

/// Properties 1, 2, 5 and 6 in one pass over a subscription's events; returns its timeline.
fn walk(h: &History, sub: &SubLog, b: &Bounds, clock: &Clock, out: &mut Outcome) -> Timeline {
    let mut tl = Timeline {
        applied: Vec::new(),
        resets: Vec::new(),
        snapshots: Vec::new(),
        live_from: None,
        impaired: Vec::new(),
    };
    let env = sub.feed.env(h);
    let mut requests: HashMap<u32, (Ms, RequestKind, bool)> = HashMap::new();
    // Highest version seen per run, and when.
    let mut max_seen: HashMap<usize, (u32, Ms)> = HashMap::new();
    let mut impaired_since: Option<Ms> = None;
    for e in &sub.events {
        match e {
            Event::Request {
                id,
                at,
                kind,
                foreign,
                ..
            } => {
                requests.insert(*id, (*at, *kind, *foreign));
                // A failed request's backoff ends with the next request.
                if let Some(since) = impaired_since.take() {
                    tl.impaired.push((since, *at));
                }
                if *kind == RequestKind::Snapshot && !*foreign {
                    tl.snapshots.push(*at);
                }
            }
            Event::Response {
                req,
                at,
                status,
                rows,
                dropped,
                ..
            } => {
                let (req_at, kind, foreign) =
                    requests
                        .get(req)
                        .copied()
                        .unwrap_or((*at, RequestKind::Live, false));
                statuses(sub, *at, *status, foreign, out);
                if *status >= 500 || *status == 429 {
                    impaired_since = Some(req_at);
                }
                let pinned = tl.pinned_at(req_at).unwrap_or(req_at);
                for row in rows {
                    isolated(h, sub, env, row, *at, pinned, b, clock, out);
                }
                if !(200..300).contains(status) || foreign {
                    continue;
                }
                // npm readers report a response's rows separately (`Event::Rows`).
                if kind == RequestKind::Snapshot && sub.client.is_rust() {
                    fresh_start(h, sub, rows, req_at, *at, true, b, clock, out);
                }
                if !*dropped {
                    tl.live_from.get_or_insert(*at);
                    apply(h, sub, &mut tl, &mut max_seen, rows, *at, b, out);
                }
            }
            Event::Rows {
                at,
                rows,
                snapshot_of,
                complete,
            } => {
                let req_at = snapshot_of
                    .and_then(|r| requests.get(&r).map(|x| x.0))
                    .unwrap_or(*at);
                let pinned = tl.pinned_at(*at).unwrap_or(req_at);
                for row in rows {
                    isolated(h, sub, env, row, *at, pinned, b, clock, out);
                }
                if snapshot_of.is_some() {
                    fresh_start(h, sub, rows, req_at, *at, *complete, b, clock, out);
                }
                tl.live_from.get_or_insert(*at);
                apply(h, sub, &mut tl, &mut max_seen, rows, *at, b, out);
            }
            Event::Failed {
                req, at, aborted, ..
            } => {
                let req_at = requests.get(req).map_or(*at, |x| x.0);
                // A reader's own abort re-polls at once; a failure backs off until the next
                // request (or, for npm readers, the client's own retry).
                if !*aborted {
                    impaired_since = Some(req_at.min(*at));
                }
                if !*aborted && !h.in_outage(req_at, *at, b.fault_margin_ms) {
                    if let Event::Failed { error, .. } = e {
                        violation(
                            out,
                            Property::NoServerErrors,
                            "failed-request",
                            sub,
                            None,
                            *at,
                            format!("request failed outside any injected outage: {error}"),
                        );
                    }
                }
            }
            Event::Reset { at } => tl.resets.push(*at),
            Event::Paused { from, to } => tl.impaired.push((*from, *to)),
            // A stream's end is no failure: one the server broke after the reader's own stall
            // follows a pause, and the reader reopens at once (a broken stream without such a
            // stall is logged as `Event::Failed`).
            Event::StreamEnded { .. } => {}
        }
    }
    if let Some(since) = impaired_since {
        tl.impaired.push((since, f64::INFINITY));
    }
    tl
}

fn statuses(sub: &SubLog, at: Ms, status: u16, foreign: bool, out: &mut Outcome) {
    let problem = match (status, foreign) {
        (409, true) => None,
        (_, true) => Some((
            "foreign-handle-accepted",
            format!("a request with another feed's handle got {status}, not 409"),
        )),
        (200..=299, false) => None,
        (409, false) => Some((
            "unexpected-409",
            "409 must-refetch for a handle this fleet issued for this feed".to_string(),
        )),
        (500..=599, false) => Some(("5xx", format!("server error {status}"))),
        (other, false) => Some(("unexpected-status", format!("unexpected status {other}"))),
    };
    if let Some((kind, what)) = problem {
        out.violations.push(Violation {
            property: Property::NoServerErrors,
            kind,
            sub: sub.id,
            run: None,
            at,
            what,
            counted: true,
        });
    }
}

#[allow(clippy::too_many_arguments)]
fn isolated(
    h: &History,
    sub: &SubLog,
    env: usize,
    row: &RowObs,
    at: Ms,
    pinned: Ms,
    b: &Bounds,
    clock: &Clock,
    out: &mut Outcome,
) {
    out.figures.rows += 1;
    let Some(run) = h.run_index(&row.run_id) else {
        violation(
            out,
            Property::Isolated,
            "unknown-row",
            sub,
            None,
            at,
            format!("row {:?} is no run the writers created", row.run_id),
        );
        return;
    };
    let r = &h.runs[run];
    if r.env != env {
        violation(
            out,
            Property::Isolated,
            "other-environment",
            sub,
            Some(run),
            at,
            format!(
                "row of environment {} on a feed of environment {}",
                h.envs[r.env].label, h.envs[env].label
            ),
        );
        return;
    }
    let Some(v) = row.updated_at_ms.and_then(|ms| r.version_at(ms)) else {
        return; // an unknown version is reported by `apply` (monotonic)
    };
    if !sub
        .feed
        .matches(h, run, v, clock.to_epoch_ms(pinned), b.window_slack_ms)
    {
        violation(
            out,
            Property::Isolated,
            "outside-filter",
            sub,
            Some(run),
            at,
            format!(
                "v{} (tags {:?}, created {} ms before the pinned floor's request) is outside the filter",
                v.ver,
                v.tags,
                clock.to_epoch_ms(pinned) - r.created_at_ms
            ),
        );
    }
}

#[allow(clippy::too_many_arguments)]
fn fresh_start(
    h: &History,
    sub: &SubLog,
    rows: &[RowObs],
    req_at: Ms,
    at: Ms,
    complete: bool,
    b: &Bounds,
    clock: &Clock,
    out: &mut Outcome,
) {
    out.figures.snapshots += 1;
    let env = sub.feed.env(h);
    let got: HashMap<usize, Option<u32>> = rows
        .iter()
        .filter_map(|row| {
            let run = h.run_index(&row.run_id)?;
            let ver = row
                .updated_at_ms
                .and_then(|ms| h.runs[run].version_at(ms))
                .map(|v| v.ver);
            Some((run, ver))
        })
        .collect();
    let pinned_epoch = clock.to_epoch_ms(req_at);
    for (run, r) in h.runs.iter().enumerate() {
        if r.env != env {
            continue;
        }
        // Required: announced before the request, and either announced more than the slack
        // (the replica-lag bound) before it, or already applied on the replica at the request
        // (a fresh read from the replica would have it).
        let required = r.versions.iter().rev().find(|v| {
            v.committed < req_at
                && v.announced().is_some_and(|a| {
                    a < req_at - b.fresh_slack_ms
                        || (a < req_at
                            && !h.replica_lag.is_empty()
                            && h.replica_visible_at(v.committed)
                                .is_some_and(|t| t + REPLICA_SAMPLE_SLACK_MS <= req_at))
                })
        });
        let Some(required) = required else { continue };
        if !sub.feed.matches(h, run, required, pinned_epoch, 0) {
            continue;
        }
        let announced = required.announced().unwrap_or(req_at);
        let replica = if h.replica_lag.is_empty() {
            String::new()
        } else {
            match h.replica_visible_at(required.committed) {
                Some(t) if t <= req_at => format!(
                    "; the replica had applied it {:.0} ms before the request",
                    req_at - t
                ),
                _ => "; the replica had NOT applied it yet at the request".to_string(),
            }
        };
        match got.get(&run) {
            None if complete => {
                out.figures.stale_ages.push(req_at - announced);
                violation(
                    out,
                    Property::FreshStart,
                    "missing-from-snapshot",
                    sub,
                    Some(run),
                    at,
                    format!(
                        "snapshot lacks the run, although v{} was committed {:.0} ms and announced {:.0} ms before the request{replica}",
                        required.ver,
                        req_at - required.committed,
                        req_at - announced
                    ),
                );
            }
            Some(Some(ver)) if *ver < required.ver => {
                out.figures.stale_ages.push(req_at - announced);
                violation(
                    out,
                    Property::FreshStart,
                    "stale-snapshot",
                    sub,
                    Some(run),
                    at,
                    format!(
                        "snapshot starts at v{ver}, older than v{} committed {:.0} ms and announced {:.0} ms before the request{replica}",
                        required.ver,
                        req_at - required.committed,
                        req_at - announced
                    ),
                );
            }
            _ => {}
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn apply(
    h: &History,
    sub: &SubLog,
    tl: &mut Timeline,
    max_seen: &mut HashMap<usize, (u32, Ms)>,
    rows: &[RowObs],
    at: Ms,
    b: &Bounds,
    out: &mut Outcome,
) {
    for row in rows {
        let Some(run) = h.run_index(&row.run_id) else {
            continue;
        };
        let r = &h.runs[run];
        let version = row.updated_at_ms.and_then(|ms| r.version_at(ms));
        let Some(v) = version else {
            violation(
                out,
                Property::Monotonic,
                "unknown-version",
                sub,
                Some(run),
                at,
                format!(
                    "row with updatedAt {:?} is no committed version of the run",
                    row.updated_at_ms
                ),
            );
            tl.applied.push(Applied { at, run, ver: None });
            continue;
        };
        if row.ck.is_some_and(|ck| Some(ck) != v.ck) {
            violation(
                out,
                Property::Monotonic,
                "torn-row",
                sub,
                Some(run),
                at,
                format!(
                    "row has updatedAt of v{} (metadata ck {:?}) but metadata ck {:?}",
                    v.ver, v.ck, row.ck
                ),
            );
        }
        if let Some((seen, seen_at)) = max_seen.get(&run).copied() {
            if v.ver < seen {
                // After a 409 reset the new snapshot may trail within the replica-lag bound.
                let snapshot = tl.snapshots.last().copied().unwrap_or(at);
                let reset_between = tl.resets.iter().any(|t| *t > seen_at && *t <= at);
                let seen_committed = r.versions[seen as usize].committed;
                let excused = reset_between && seen_committed >= snapshot - b.fresh_slack_ms;
                if !excused {
                    violation(
                        out,
                        Property::Monotonic,
                        "regressed",
                        sub,
                        Some(run),
                        at,
                        format!(
                            "saw v{}, then v{seen} was already seen at +{:.3}s",
                            v.ver,
                            seen_at / 1000.0
                        ),
                    );
                }
            }
        }
        let entry = max_seen.entry(run).or_insert((v.ver, at));
        if v.ver > entry.0 {
            *entry = (v.ver, at);
        }
        tl.applied.push(Applied {
            at,
            run,
            ver: Some(v.ver),
        });
    }
}

/// Property 4.
fn timely(
    h: &History,
    subs: &[SubLog],
    timelines: &[Timeline],
    b: &Bounds,
    clock: &Clock,
    out: &mut Outcome,
) {
    let mut late: Vec<Violation> = Vec::new();
    for (run, r) in h.runs.iter().enumerate() {
        for (i, v) in r.versions.iter().enumerate() {
            let (from, bound, lost) = match v.announced() {
                // Nothing can be delivered before the replica applied it: from the replay-lag
                // samples when there are some, else the configured apply delay.
                Some(a) if !h.replica_lag.is_empty() => match h.replica_visible_at(v.committed) {
                    Some(visible) => (a.max(visible), b.timely_ms, false),
                    None => continue,
                },
                Some(a) => (a, b.timely_ms + h.replica_delay_at(a) as Ms, false),
                None => (v.committed, b.lost_ms, true),
            };
            // Superseded: the next version was committed before this one's bound ran out.
            if r.versions
                .get(i + 1)
                .is_some_and(|next| next.committed < from + bound)
            {
                continue;
            }
            for (sub, tl) in subs.iter().zip(timelines) {
                if sub.feed.env(h) != r.env {
                    continue;
                }
                // Subscribed: its snapshot was in before the version was announced, and it
                // was still subscribed when the bound ran out.
                if tl.live_from.is_none_or(|t| t > from) {
                    continue;
                }
                let ended = sub.ended.unwrap_or(f64::INFINITY);
                if ended < from + bound {
                    continue;
                }
                let Some(pinned) = tl.pinned_at(from) else {
                    continue;
                };
                if !sub.feed.matches(h, run, v, clock.to_epoch_ms(pinned), 0) {
                    continue;
                }
                let seen = tl.first_seen(run, v.ver, from);
                let latency = seen.map_or(f64::INFINITY, |t| t - from);
                let until = (from + latency.min(bound)).min(ended);
                if h.in_outage(from, until, b.fault_margin_ms) {
                    out.figures.timely_excused += 1;
                    out.figures.timely_excused_outage += 1;
                    continue;
                }
                if tl.impaired_during(from, until) {
                    out.figures.timely_excused += 1;
                    continue;
                }
                if lost {
                    out.figures.lost_samples += 1;
                } else {
                    out.figures.timely_samples.push(latency);
                }
                if latency > bound {
                    let what = match seen {
                        Some(_) => format!(
                            "v{} arrived {:.0} ms after {} (bound {:.0} ms)",
                            v.ver,
                            latency,
                            match (lost, h.replica_lag.is_empty()) {
                                (true, _) => "its commit (publish lost)",
                                (false, true) => "its publish",
                                (false, false) => "its publish and its replay on the replica",
                            },
                            bound
                        ),
                        None => format!(
                            "v{} never arrived ({} at +{:.3}s, bound {:.0} ms)",
                            v.ver,
                            if lost {
                                "committed, publish lost,"
                            } else {
                                "published"
                            },
                            from / 1000.0,
                            bound
                        ),
                    };
                    let violation = Violation {
                        property: Property::Timely,
                        kind: if lost { "lost-publish-late" } else { "late" },
                        sub: sub.id,
                        run: Some(run),
                        at: from,
                        what,
                        counted: true,
                    };
                    if lost {
                        out.violations.push(violation);
                    } else {
                        late.push(violation);
                    }
                }
            }
        }
    }
    // The quantile's budget: the slowest (1 − q) share of samples is tolerated.
    let budget =
        ((1.0 - b.timely_quantile) * out.figures.timely_samples.len() as f64).floor() as usize;
    let counted = late.len().saturating_sub(budget);
    // Tolerate the least late ones; count the worst.
    late.sort_by(|a, b| a.at.partial_cmp(&b.at).unwrap_or(std::cmp::Ordering::Equal));
    for (i, mut v) in late.into_iter().enumerate() {
        v.counted = i < counted;
        out.violations.push(v);
    }
}

/// Property 3.
fn convergent(
    h: &History,
    subs: &[SubLog],
    timelines: &[Timeline],
    b: &Bounds,
    clock: &Clock,
    end: Ms,
    out: &mut Outcome,
) {
    let deadline = h.writes_stopped + b.converge_ms;
    if end < deadline {
        return; // the readers stopped too early to judge
    }
    for (sub, tl) in subs.iter().zip(timelines) {
        if sub.ended.is_some_and(|e| e < deadline) || tl.live_from.is_none() {
            continue;
        }
        out.figures.converge_subs += 1;
        let Some(pinned) = tl.pinned_at(deadline) else {
            continue;
        };
        let view = tl.view_at(deadline);
        let mut converged_at = h.writes_stopped;
        let mut ok = true;
        for (run, r) in h.runs.iter().enumerate() {
            let Some(last) = r.last() else { continue };
            if r.env != sub.feed.env(h)
                || !sub.feed.matches(h, run, last, clock.to_epoch_ms(pinned), 0)
            {
                continue;
            }
            match view.get(&run).copied().flatten() {
                Some(ver) if ver == last.ver => {
                    if let Some(t) = tl.first_seen(run, last.ver, 0.0) {
                        converged_at = converged_at.max(t);
                    }
                }
                other => {
                    ok = false;
                    violation(
                        out,
                        Property::Convergent,
                        "not-converged",
                        sub,
                        Some(run),
                        deadline,
                        format!(
                            "{:.1} s after writes stopped the view has {}, the database v{}",
                            b.converge_ms / 1000.0,
                            other.map_or("no row".to_string(), |v| format!("v{v}")),
                            last.ver
                        ),
                    );
                }
            }
        }
        if ok {
            out.figures
                .converge_ms
                .push((converged_at - h.writes_stopped).max(0.0));
        }
    }
}

/// Describes a feed for a violation heading.
pub fn feed_label(h: &History, feed: &FeedSpec) -> String {
    feed.describe(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::model::*;

    fn clock() -> Clock {
        Clock {
            t0_epoch_ms: 1_700_000_000_000.0,
        }
    }

    fn version(ver: u32, updated: i64, committed: Ms, announced: Option<Ms>) -> Version {
        Version {
            ver,
            updated_at_ms: updated,
            op: WriteOp::Status,
            status: "EXECUTING".into(),
            tags: vec!["t".into()],
            metadata: format!("{{\"ck\":{ver}}}"),
            ck: Some(ver),
            commit_started: committed - 1.0,
            committed,
            fate: if announced.is_some() {
                Fate::Normal
            } else {
                Fate::Lost
            },
            publishes: announced
                .map(|at| Publish {
                    at,
                    ok: true,
                    receivers: 1,
                    full: true,
                    watermark: true,
                })
                .into_iter()
                .collect(),
        }
    }

    /// One run in env A with versions at 100 ms (v0), 1 000 ms (v1) and 2 000 ms (v2).
    fn history() -> History {
        let mut h = History {
            envs: vec![
                EnvLog {
                    id: "ea".into(),
                    label: "A".into(),
                },
                EnvLog {
                    id: "eb".into(),
                    label: "B".into(),
                },
            ],
            ..History::default()
        };
        h.add_run(RunLog {
            id: "r".into(),
            friendly_id: "run_r".into(),
            env: 0,
            batch: None,
            created_at_ms: 1_700_000_000_000,
            versions: vec![
                version(0, 10, 100.0, Some(101.0)),
                version(1, 20, 1_000.0, Some(1_001.0)),
                version(2, 30, 2_000.0, Some(2_001.0)),
            ],
        });
        h.add_run(RunLog {
            id: "other".into(),
            friendly_id: "run_other".into(),
            env: 1,
            batch: None,
            created_at_ms: 1_700_000_000_000,
            versions: vec![version(0, 10, 100.0, Some(101.0))],
        });
        h.writes_stopped = 2_500.0;
        h
    }

    fn bounds() -> Bounds {
        Bounds {
            fresh_slack_ms: 0.0,
            timely_ms: 1_000.0,
            timely_quantile: 0.99,
            lost_ms: 5_000.0,
            converge_ms: 3_000.0,
            fault_margin_ms: 500.0,
            window_slack_ms: 65_000,
        }
    }

    fn row(id: &str, updated: i64, ck: u32) -> RowObs {
        RowObs {
            run_id: id.into(),
            op: "update".into(),
            updated_at_ms: Some(updated),
            ck: Some(ck),
            status: None,
        }
    }

    fn sub(events: Vec<Event>) -> SubLog {
        SubLog {
            id: 1,
            reader: "r0".into(),
            client: ClientKind::Rust,
            feed: FeedSpec::Run { run: 0 },
            url: String::new(),
            started: 0.0,
            ended: None,
            events,
        }
    }

    fn req(id: u32, at: Ms, kind: RequestKind) -> Event {
        Event::Request {
            id,
            at,
            instance: 0,
            kind,
            offset: "-1".into(),
            foreign: false,
        }
    }

    fn resp(req: u32, at: Ms, rows: Vec<RowObs>) -> Event {
        Event::Response {
            req,
            at,
            status: 200,
            offset: None,
            rows,
            dropped: false,
        }
    }

    #[test]
    fn a_clean_subscription_has_no_violations() {
        let h = history();
        let s = sub(vec![
            req(1, 500.0, RequestKind::Snapshot),
            resp(1, 510.0, vec![row("r", 10, 0)]),
            req(2, 511.0, RequestKind::Live),
            resp(2, 1_050.0, vec![row("r", 20, 1)]),
            req(3, 1_051.0, RequestKind::Live),
            resp(3, 2_100.0, vec![row("r", 30, 2)]),
        ]);
        let o = check(&h, &[s], &bounds(), &clock(), 6_000.0);
        assert!(o.violations.is_empty(), "{:#?}", o.violations);
        assert_eq!(o.figures.timely_samples.len(), 1, "v1 is superseded by v2");
        assert_eq!(o.figures.converge_subs, 1);
    }

    #[test]
    fn a_stale_snapshot_and_a_regression_are_found() {
        let h = history();
        let s = sub(vec![
            req(1, 1_500.0, RequestKind::Snapshot),
            resp(1, 1_510.0, vec![row("r", 10, 0)]),
            req(2, 1_511.0, RequestKind::Live),
            resp(2, 1_520.0, vec![row("r", 20, 1)]),
            req(3, 1_521.0, RequestKind::Live),
            resp(3, 1_530.0, vec![row("r", 10, 0)]),
        ]);
        let o = check(&h, &[s], &bounds(), &clock(), 1_600.0);
        assert_eq!(o.count(Property::FreshStart), 1, "{:#?}", o.violations);
        assert_eq!(o.count(Property::Monotonic), 1, "{:#?}", o.violations);
    }

    #[test]
    fn other_environments_rows_and_server_errors_are_found() {
        let h = history();
        let s = sub(vec![
            req(1, 500.0, RequestKind::Snapshot),
            resp(1, 510.0, vec![row("r", 10, 0), row("other", 10, 0)]),
            req(2, 511.0, RequestKind::Live),
            Event::Response {
                req: 2,
                at: 520.0,
                status: 503,
                offset: None,
                rows: vec![],
                dropped: false,
            },
        ]);
        let o = check(&h, &[s], &bounds(), &clock(), 600.0);
        assert_eq!(o.count(Property::Isolated), 1, "{:#?}", o.violations);
        assert_eq!(o.count(Property::NoServerErrors), 1, "{:#?}", o.violations);
    }

    #[test]
    fn a_late_delivery_and_a_stale_final_view_are_found() {
        let h = history();
        let s = sub(vec![
            req(1, 500.0, RequestKind::Snapshot),
            resp(1, 510.0, vec![row("r", 10, 0)]),
            req(2, 511.0, RequestKind::Live),
            resp(2, 2_900.0, vec![row("r", 20, 1)]),
        ]);
        let o = check(&h, &[s], &bounds(), &clock(), 6_000.0);
        // v1 superseded by v2 within the bound → not sampled; v2 never arrives.
        assert_eq!(o.count(Property::Timely), 1, "{:#?}", o.violations);
        assert_eq!(o.count(Property::Convergent), 1, "{:#?}", o.violations);
    }

    #[test]
    fn with_a_replica_only_applied_or_overdue_versions_are_required() {
        let mut h = history();
        // v1 (committed 1 000 ms) is applied on the replica at 1 300 ms.
        h.replica_lag = (0..40).map(|i| (i as Ms * 50.0, 300.0)).collect();
        let b = Bounds {
            fresh_slack_ms: 1_000.0,
            ..bounds()
        };
        let stale_at = |req_at: Ms| {
            sub(vec![
                req(1, req_at, RequestKind::Snapshot),
                resp(1, req_at + 5.0, vec![row("r", 10, 0)]),
            ])
        };
        // Requested before the replica applied v1, inside the bound: allowed.
        let o = check(&h, &[stale_at(1_200.0)], &b, &clock(), 1_300.0);
        assert_eq!(o.count(Property::FreshStart), 0, "{:#?}", o.violations);
        // Requested after the replica applied v1: a stale snapshot is a violation.
        let o = check(&h, &[stale_at(1_500.0)], &b, &clock(), 1_600.0);
        assert_eq!(o.count(Property::FreshStart), 1, "{:#?}", o.violations);
    }

    #[test]
    fn sse_batches_are_checked_like_responses_and_a_stalled_out_stream_is_no_failure() {
        let h = history();
        let mut s = sub(vec![
            req(1, 500.0, RequestKind::Snapshot),
            resp(1, 510.0, vec![row("r", 10, 0)]),
            req(2, 511.0, RequestKind::Sse),
            resp(2, 1_050.0, vec![row("r", 20, 1)]),
            Event::Paused {
                from: 1_100.0,
                to: 2_600.0,
            },
            Event::StreamEnded {
                req: 2,
                at: 2_601.0,
                how: StreamEnd::StalledOut,
            },
            req(3, 2_602.0, RequestKind::Sse),
            resp(3, 2_610.0, vec![row("r", 30, 2)]),
        ]);
        s.client = ClientKind::RustSse;
        let o = check(&h, &[s.clone()], &bounds(), &clock(), 6_000.0);
        assert!(o.violations.is_empty(), "{:#?}", o.violations);
        assert_eq!(o.figures.timely_excused, 1, "v2 came during the stall");
        // A stream that breaks without such a stall is a failed request.
        s.events[5] = Event::Failed {
            req: 2,
            at: 2_601.0,
            error: "connection reset".into(),
            aborted: false,
        };
        let o = check(&h, &[s], &bounds(), &clock(), 6_000.0);
        assert_eq!(o.count(Property::NoServerErrors), 1, "{:#?}", o.violations);
        // An SSE batch that goes back is a regression.
        let mut s = sub(vec![
            req(1, 500.0, RequestKind::Snapshot),
            resp(1, 2_100.0, vec![row("r", 30, 2)]),
            req(2, 2_101.0, RequestKind::Sse),
            resp(2, 2_200.0, vec![row("r", 20, 1)]),
        ]);
        s.client = ClientKind::RustSse;
        let o = check(&h, &[s], &bounds(), &clock(), 2_300.0);
        assert_eq!(o.count(Property::Monotonic), 1, "{:#?}", o.violations);
    }

    #[test]
    fn quantile_is_nearest_rank() {
        let s: Vec<Ms> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&s, 0.99), Some(99.0));
        assert_eq!(quantile(&s, 0.5), Some(50.0));
        assert_eq!(quantile(&[], 0.5), None);
    }
}
