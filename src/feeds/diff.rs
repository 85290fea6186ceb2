//! The working-set diff: which rows a response carries, and as `insert` or `update`.
//!
//! What the client has is decided by what the client ECHOES (architecture "better than the
//! reference" item 1): the working set used for a poll is the one recorded for the exact
//! offset the client presented, so a response lost in transit can never hide a change — the
//! client re-presents the older offset and gets the change again.

use crate::cache::FastMap;

use crate::protocol::body::Operation;
use crate::protocol::{RunId, SerializedRow};

/// The version of a run a client has: `updatedAt` ms plus the serialized value's hash, so two
/// different versions written in the same millisecond are still told apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Version {
    pub ms: i64,
    pub hash: u64,
}

impl Version {
    /// The version of a serialized row.
    pub fn of(row: &SerializedRow) -> Version {
        Version {
            ms: row.meta.updated_at_ms,
            hash: row.value_hash,
        }
    }

    /// Whether `self` is newer than `known`: a later `updatedAt`, or the same millisecond with
    /// different content. An OLDER row (a lagging replica) is never "advanced".
    pub fn advances(self, known: Version) -> bool {
        self.ms > known.ms || (self.ms == known.ms && self.hash != known.hash)
    }
}

/// Run id → version: what a connection's client has. Every recorded per-connection state keeps
/// one, so its size is memory per held feed: up to [`SMALL_WORKING_SET`] runs (a run feed, a
/// quiet tag feed) it is a short list of `(run, version)` pairs of a few dozen bytes; larger
/// sets are an `imbl` map shared structurally between a connection's successive responses (one
/// map node is about 1.5 KiB, too much for a set of one).
#[derive(Clone, Debug, Default)]
pub struct WorkingSet(Repr);

/// Runs a [`WorkingSet`] keeps as a list before it becomes a map.
pub const SMALL_WORKING_SET: usize = 8;

#[derive(Clone, Debug)]
enum Repr {
    Small(Vec<(RunId, Version)>),
    Large(imbl::HashMap<RunId, Version>),
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Small(Vec::new())
    }
}

impl WorkingSet {
    /// An empty set.
    pub fn new() -> WorkingSet {
        WorkingSet::default()
    }

    /// The version of `id` the client has.
    pub fn get<Q>(&self, id: &Q) -> Option<&Version>
    where
        RunId: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        use std::borrow::Borrow;
        match &self.0 {
            Repr::Small(list) => list
                .iter()
                .find(|(have, _)| Borrow::<Q>::borrow(have) == id)
                .map(|(_, v)| v),
            Repr::Large(map) => map.get(id),
        }
    }

    /// Sets the version of `id`.
    pub fn insert(&mut self, id: RunId, version: Version) {
        match &mut self.0 {
            Repr::Small(list) => {
                if let Some((_, have)) = list.iter_mut().find(|(have, _)| *have == id) {
                    *have = version;
                } else if list.len() < SMALL_WORKING_SET {
                    list.push((id, version));
                } else {
                    let mut map: imbl::HashMap<RunId, Version> = list.drain(..).collect();
                    map.insert(id, version);
                    self.0 = Repr::Large(map);
                }
            }
            Repr::Large(map) => {
                map.insert(id, version);
            }
        }
    }

    /// Runs in the set.
    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Small(list) => list.len(),
            Repr::Large(map) => map.len(),
        }
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every `(run, version)` of the set, in no particular order.
    pub fn iter(&self) -> Box<dyn Iterator<Item = (&RunId, &Version)> + '_> {
        match &self.0 {
            Repr::Small(list) => Box::new(list.iter().map(|(id, v)| (id, v))),
            Repr::Large(map) => Box::new(map.iter()),
        }
    }
}

impl FromIterator<(RunId, Version)> for WorkingSet {
    fn from_iter<I: IntoIterator<Item = (RunId, Version)>>(iter: I) -> WorkingSet {
        let mut set = WorkingSet::new();
        for (id, version) in iter {
            set.insert(id, version);
        }
        set
    }
}

/// What the server knows the client has.
#[derive(Clone, Debug)]
pub enum Known {
    /// Exactly these runs at these versions (the state recorded for the presented offset).
    Set(WorkingSet),
    /// Only the presented offset's millisecond (state lost: restart, eviction, another
    /// instance). Single-run feeds: a row is new iff `updatedAt` > floor.
    Floor(i64),
    /// Nothing usable: multi-run feeds re-send every row they carry (a full re-sync, labelled
    /// `update`) rather than risk hiding rows at or below the floor the client never saw.
    Nothing,
    /// Only the versions of the runs the client's last responses carried (a hop: another
    /// instance shared them with the replay cursor). A listed run is skipped unless it
    /// advanced; an unlisted one is sent as `update`.
    Partial(WorkingSet),
}

impl Known {
    /// Whether the client's version of every run it has is known ([`Known::Set`], or
    /// [`Known::Floor`] for a single run): then an older row is never news, and a read that may
    /// be older than the store (a cache) cannot make the client go back.
    pub fn versions_known(&self) -> bool {
        matches!(self, Known::Set(_) | Known::Floor(_))
    }

    /// Whether the client may lack the version of `id` written at `updated_at_ms` (a run it
    /// has not got, or an older version of it). Two versions written in the same millisecond
    /// are not told apart here (a backstop's full re-read tells them apart by content).
    pub fn may_lack(&self, id: &RunId, updated_at_ms: i64) -> bool {
        match self {
            Known::Set(ws) | Known::Partial(ws) => {
                ws.get(id).is_none_or(|have| updated_at_ms > have.ms)
            }
            Known::Floor(floor) => updated_at_ms > *floor,
            Known::Nothing => true,
        }
    }
}

/// Rows a poll has collected, deduplicated by run (the newest version wins).
#[derive(Debug, Default)]
pub struct Pending {
    rows: FastMap<RunId, SerializedRow>,
}

impl Pending {
    /// Adds rows (router deliveries, replays, store re-checks).
    pub fn extend<I: IntoIterator<Item = SerializedRow>>(&mut self, rows: I) {
        for row in rows {
            match self.rows.get(&row.meta.id) {
                Some(existing) if !Version::of(&row).advances(Version::of(existing)) => {}
                _ => {
                    self.rows.insert(row.meta.id.clone(), row);
                }
            }
        }
    }

    /// The rows that are news to a client that has `known`, with their operation, newest
    /// `createdAt` first (stable order for tests and clients).
    pub fn changes(&self, known: &Known) -> Vec<(Operation, SerializedRow)> {
        let mut out: Vec<(Operation, SerializedRow)> = self
            .rows
            .values()
            .filter_map(|row| {
                let version = Version::of(row);
                match known {
                    Known::Set(ws) => match ws.get(&row.meta.id) {
                        None => Some((Operation::Insert, row.clone())),
                        Some(have) if version.advances(*have) => {
                            Some((Operation::Update, row.clone()))
                        }
                        Some(_) => None,
                    },
                    Known::Floor(ms) => {
                        (row.meta.updated_at_ms > *ms).then(|| (Operation::Update, row.clone()))
                    }
                    Known::Nothing => Some((Operation::Update, row.clone())),
                    Known::Partial(ws) => match ws.get(&row.meta.id) {
                        Some(have) if !version.advances(*have) => None,
                        _ => Some((Operation::Update, row.clone())),
                    },
                }
            })
            .collect();
        out.sort_by(|a, b| {
            b.1.meta
                .created_at_ms
                .cmp(&a.1.meta.created_at_ms)
                .then_with(|| b.1.meta.id.cmp(&a.1.meta.id))
        });
        out
    }

    /// The runs collected.
    pub fn run_ids(&self) -> impl Iterator<Item = &RunId> {
        self.rows.keys()
    }

    /// Whether nothing was collected.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The working set after a response carrying `emitted`: `known` (or empty) plus every
    /// collected row, never moving a run back to an older `updatedAt`.
    pub fn next_working_set(&self, known: &Known) -> WorkingSet {
        let mut ws = match known {
            Known::Set(ws) | Known::Partial(ws) => ws.clone(),
            _ => WorkingSet::new(),
        };
        for row in self.rows.values() {
            let version = Version::of(row);
            match ws.get(&row.meta.id) {
                Some(have) if have.ms > version.ms => {}
                _ => {
                    ws.insert(row.meta.id.clone(), version);
                }
            }
        }
        ws
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;

    use super::*;
    use crate::protocol::RunMeta;

    #[test]
    fn a_working_set_keeps_every_version_as_it_grows_from_a_list_into_a_map() {
        let v = |ms| Version { ms, hash: 1 };
        let mut ws = WorkingSet::new();
        for i in 0..(SMALL_WORKING_SET as i64 * 3) {
            ws.insert(RunId::from(format!("run{i}").as_str()), v(i));
            ws.insert(RunId::from("run0"), v(100 + i));
            assert_eq!(ws.len(), (i + 1) as usize);
            assert_eq!(ws.get("run0"), Some(&v(100 + i)));
            for j in 1..=i {
                assert_eq!(
                    ws.get(format!("run{j}").as_str()),
                    Some(&v(j)),
                    "{j} of {i}"
                );
            }
            assert_eq!(ws.get("missing"), None);
            assert_eq!(ws.iter().count(), ws.len());
        }
        let copied: WorkingSet = ws.iter().map(|(id, v)| (id.clone(), *v)).collect();
        assert_eq!(copied.len(), ws.len());
    }

    fn row(id: &str, ms: i64, hash: u64) -> SerializedRow {
        SerializedRow {
            meta: Arc::new(RunMeta {
                id: id.into(),
                updated_at_ms: ms,
                created_at_ms: 0,
                tags: vec![],
                batch_id: None,
                finished: false,
            }),
            fragment: Bytes::new(),
            value_hash: hash,
            dequeued: false,
        }
    }

    /// A working set of `(run, ms, hash)` versions.
    fn working_set(versions: &[(&str, i64, u64)]) -> WorkingSet {
        let mut ws = WorkingSet::new();
        for &(id, ms, hash) in versions {
            ws.insert(id.into(), Version { ms, hash });
        }
        ws
    }

    /// The rows a poll collected.
    fn pending<const N: usize>(rows: [SerializedRow; N]) -> Pending {
        let mut p = Pending::default();
        p.extend(rows);
        p
    }

    #[test]
    fn live_03_insert_for_new_rows_update_for_advanced_skip_unchanged() {
        let ws = working_set(&[("a", 10, 1), ("b", 10, 1)]);
        let p = pending([row("a", 11, 2), row("b", 10, 1), row("c", 5, 3)]);
        let mut got: Vec<_> = p
            .changes(&Known::Set(ws))
            .into_iter()
            .map(|(op, r)| (r.meta.id.clone(), op))
            .collect();
        got.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(
            got,
            vec![
                ("a".into(), Operation::Update),
                ("c".into(), Operation::Insert)
            ]
        );
    }

    #[test]
    fn same_millisecond_different_content_is_still_a_change() {
        // The reference compares updatedAt ms only and suppresses this (docs/behaviours.md §4 item 6).
        let ws = working_set(&[("a", 10, 1)]);
        let p = pending([row("a", 10, 2)]);
        assert_eq!(p.changes(&Known::Set(ws)).len(), 1);
    }

    #[test]
    fn an_older_row_from_a_lagging_replica_is_not_a_change() {
        let ws = working_set(&[("a", 10, 1)]);
        let p = pending([row("a", 9, 7)]);
        assert!(p.changes(&Known::Set(ws.clone())).is_empty());
        assert_eq!(
            p.next_working_set(&Known::Set(ws)).get("a"),
            Some(&Version { ms: 10, hash: 1 })
        );
    }

    #[test]
    fn live_11_unknown_state_floor_for_run_feeds_full_resync_for_lists() {
        let p = pending([row("a", 10, 1), row("b", 5, 1)]);
        assert_eq!(p.changes(&Known::Floor(7)).len(), 1);
        let all = p.changes(&Known::Nothing);
        assert_eq!(all.len(), 2);
        assert!(all.iter().all(|(op, _)| *op == Operation::Update));
    }

    #[test]
    fn hop_partial_knowledge_skips_listed_unchanged_rows_and_sends_the_rest() {
        let recent = working_set(&[("a", 10, 1)]);
        let p = pending([row("a", 10, 1), row("b", 5, 1)]);
        let got: Vec<_> = p
            .changes(&Known::Partial(recent))
            .into_iter()
            .map(|(op, r)| (r.meta.id.clone(), op))
            .collect();
        assert_eq!(got, vec![("b".into(), Operation::Update)]);
    }

    #[test]
    fn newest_version_of_a_run_wins_inside_one_poll() {
        let p = pending([row("a", 12, 2), row("a", 11, 1)]);
        let changes = p.changes(&Known::Nothing);
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].1.meta.updated_at_ms, 12);
    }
}
