//! Per-environment leading-edge coalescing (NTF-16..19; the webapp's per-channel pending map and
//! window timer in `runChangeNotifier.server.ts`, `ENV_WAKE_COALESCE_WINDOW_MS`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use super::ChangeRecord;
use crate::protocol::{EnvId, RunId};

/// What a coalescer delivers: `(env_id, batch)`.
pub type Batch = (EnvId, Vec<ChangeRecord>);

/// Coalesces records per environment: the first record on an idle env is delivered at once and
/// opens a window; records inside the window accumulate (merged per run, first position kept,
/// see [`ChangeRecord::merge_from`]) and are delivered when it closes, which opens a new window.
/// `window == 0` delivers every record as its own batch. Delivered as `(env_id, batch)` on `out`.
///
/// An env whose window closes with nothing pending goes idle (its timer task ends), so idle
/// environments cost nothing. Dropping the coalescer aborts every window timer and discards
/// pending records (NTF-20); timers never keep the runtime alive. If `out`'s receiver is gone,
/// deliveries are silently dropped.
pub struct Coalescer {
    window: Duration,
    out: mpsc::UnboundedSender<Batch>,
    state: Arc<Mutex<HashMap<EnvId, EnvWindow>>>,
    runtime: Handle,
}

/// An open window of one environment: what arrived since the last delivery, and its timer.
struct EnvWindow {
    pending: Pending,
    timer: Option<AbortHandle>,
}

/// Insertion-ordered records keyed by run id (a `Vec` plus an index, so a burst of one run keeps
/// the position of its first record, NTF-16).
#[derive(Default)]
struct Pending {
    records: Vec<ChangeRecord>,
    index: HashMap<RunId, usize>,
}

impl Pending {
    fn add(&mut self, record: ChangeRecord) {
        match self.index.get(&record.run_id) {
            Some(&i) => self.records[i].merge_from(record),
            None => {
                self.index.insert(record.run_id.clone(), self.records.len());
                self.records.push(record);
            }
        }
    }

    fn take(&mut self) -> Vec<ChangeRecord> {
        self.index.clear();
        std::mem::take(&mut self.records)
    }
}

/// Locks the state, recovering from poisoning (the map stays consistent: every mutation is a
/// single insert/remove/take).
fn lock(state: &Mutex<HashMap<EnvId, EnvWindow>>) -> MutexGuard<'_, HashMap<EnvId, EnvWindow>> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Coalescer {
    /// A coalescer delivering to `out`. Must be created inside a tokio runtime (it keeps a
    /// handle to spawn window timers on, so [`Coalescer::push`] may be called from any thread).
    ///
    /// # Panics
    /// When called outside a tokio runtime.
    pub fn new(window: Duration, out: mpsc::UnboundedSender<Batch>) -> Self {
        Coalescer {
            window,
            out,
            state: Arc::default(),
            runtime: Handle::current(),
        }
    }

    /// Adds one record of `env_id`: delivered at once if the env is idle (or the window is 0),
    /// otherwise merged into the env's pending batch.
    pub fn push(&self, env_id: &EnvId, record: ChangeRecord) {
        if self.window.is_zero() {
            let _ = self.out.send((env_id.to_owned(), vec![record]));
            return;
        }
        let mut state = lock(&self.state);
        if let Some(open) = state.get_mut(env_id) {
            open.pending.add(record);
            return;
        }
        // Leading edge: deliver now (under the lock, so it is ordered before any window batch)
        // and open a window.
        let _ = self.out.send((env_id.to_owned(), vec![record]));
        let timer = self.runtime.spawn(run_window(
            env_id.to_owned(),
            self.window,
            Arc::clone(&self.state),
            self.out.clone(),
        ));
        state.insert(
            env_id.to_owned(),
            EnvWindow {
                pending: Pending::default(),
                timer: Some(timer.abort_handle()),
            },
        );
    }

    /// Environments with an open window (sorted).
    #[cfg(test)]
    fn open_windows(&self) -> Vec<String> {
        let mut envs: Vec<String> = lock(&self.state).keys().map(EnvId::to_string).collect();
        envs.sort();
        envs
    }
}

impl Drop for Coalescer {
    fn drop(&mut self) {
        for (_, open) in lock(&self.state).drain() {
            if let Some(timer) = open.timer {
                timer.abort();
            }
        }
    }
}

/// The timer of one env's windows: at each close, deliver what is pending and open a new window,
/// or go idle (remove the env) when nothing arrived.
async fn run_window(
    env_id: EnvId,
    window: Duration,
    state: Arc<Mutex<HashMap<EnvId, EnvWindow>>>,
    out: mpsc::UnboundedSender<Batch>,
) {
    loop {
        tokio::time::sleep(window).await;
        let mut guard = lock(&state);
        let Some(open) = guard.get_mut(&env_id) else {
            return; // dropped / shut down
        };
        let batch = open.pending.take();
        if batch.is_empty() {
            guard.remove(&env_id);
            return;
        }
        let _ = out.send((env_id.clone(), batch));
    }
}

#[cfg(test)]
mod tests {
    //! Real-time tests with short windows (tokio `test-util` is not enabled for this crate, so
    //! `start_paused` is unavailable); margins are generous for a loaded CI machine.
    use super::*;
    use std::collections::HashSet;
    use tokio::time::{timeout, Instant};

    fn rec(run: &str, ms: Option<i64>) -> ChangeRecord {
        ChangeRecord::test_record(run, None, ms)
    }

    async fn recv(rx: &mut mpsc::UnboundedReceiver<Batch>) -> Batch {
        match timeout(Duration::from_secs(5), rx.recv()).await {
            Ok(Some(b)) => b,
            other => panic!("no batch: {other:?}"),
        }
    }

    /// NTF-17: the first record on an idle env is delivered synchronously (leading edge).
    #[tokio::test]
    async fn leading_edge_is_immediate() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let c = Coalescer::new(Duration::from_millis(50), tx);
        c.push(&crate::protocol::EnvId::from("e"), rec("r1", None));
        assert_eq!(
            rx.try_recv().ok(),
            Some(("e".into(), vec![rec("r1", None)]))
        );
        // A different env is independent: also immediate.
        c.push(&crate::protocol::EnvId::from("f"), rec("r2", None));
        assert_eq!(
            rx.try_recv().ok(),
            Some(("f".into(), vec![rec("r2", None)]))
        );
        assert_eq!(c.open_windows(), vec!["e".to_string(), "f".to_string()]);
        // Nothing pending: both windows close and the envs go idle; the next record is immediate.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(rx.try_recv().is_err());
        assert!(c.open_windows().is_empty());
        c.push(&crate::protocol::EnvId::from("e"), rec("r3", None));
        assert_eq!(
            rx.try_recv().ok(),
            Some(("e".into(), vec![rec("r3", None)]))
        );
    }

    /// NTF-16/17: a burst inside the window becomes one batch, merged per run, first position
    /// kept; then the window closes idle.
    #[tokio::test]
    async fn burst_inside_window_is_one_merged_batch() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let c = Coalescer::new(Duration::from_millis(50), tx);
        let started = Instant::now();
        c.push(&crate::protocol::EnvId::from("e"), rec("lead", None));
        c.push(&crate::protocol::EnvId::from("e"), rec("a", Some(10)));
        c.push(&crate::protocol::EnvId::from("e"), rec("b", None));
        c.push(&crate::protocol::EnvId::from("e"), rec("a", None)); // later, no watermark: merged, keeps 10 and position 0
        c.push(
            &crate::protocol::EnvId::from("e"),
            ChangeRecord {
                tags: Some(vec!["t".into()]),
                ..rec("b", Some(5))
            },
        );
        assert_eq!(recv(&mut rx).await, ("e".into(), vec![rec("lead", None)]));
        let (env, batch) = recv(&mut rx).await;
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert_eq!(env, "e");
        assert_eq!(
            batch,
            vec![
                rec("a", Some(10)),
                ChangeRecord {
                    tags: Some(vec!["t".into()]),
                    ..rec("b", Some(5))
                },
            ]
        );
        // The delivery opened a new window; nothing arrives in it, so the env goes idle.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(rx.try_recv().is_err());
        assert!(c.open_windows().is_empty());
    }

    /// NTF-17 burst check: publishing every 5 ms for 1 s with W=100 → >100 pushes, fewer than
    /// pushes/4 batches, and no record lost (every run id delivered).
    #[tokio::test]
    async fn long_burst_loses_nothing() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let c = Coalescer::new(Duration::from_millis(100), tx);
        let mut pushed = HashSet::new();
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        let started = Instant::now();
        let mut n = 0u32;
        while started.elapsed() < Duration::from_secs(1) {
            tick.tick().await;
            let run = format!("run_{n}");
            pushed.insert(run.clone().into());
            c.push(
                &crate::protocol::EnvId::from("e"),
                rec(&run, Some(i64::from(n))),
            );
            n += 1;
        }
        // Let the last window close and the env go idle.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let mut batches = 0usize;
        let mut delivered = HashSet::new();
        while let Ok((env, batch)) = rx.try_recv() {
            assert_eq!(env, "e");
            assert!(!batch.is_empty());
            batches += 1;
            for r in batch {
                assert!(delivered.insert(r.run_id), "a run delivered twice");
            }
        }
        assert!(pushed.len() > 100, "only {} pushes", pushed.len());
        assert!(
            batches < pushed.len() / 4,
            "{batches} batches for {} pushes",
            pushed.len()
        );
        assert_eq!(delivered, pushed);
        assert!(c.open_windows().is_empty());
    }

    /// NTF-18: W=0 delivers every record immediately as its own batch.
    #[tokio::test]
    async fn zero_window_delivers_each() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let c = Coalescer::new(Duration::ZERO, tx);
        for run in ["a", "a", "b"] {
            c.push(&crate::protocol::EnvId::from("e"), rec(run, None));
            assert_eq!(rx.try_recv().ok(), Some(("e".into(), vec![rec(run, None)])));
        }
        assert!(c.open_windows().is_empty());
    }

    /// NTF-20: dropping the coalescer aborts timers and discards pending records.
    #[tokio::test]
    async fn drop_discards_pending() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let c = Coalescer::new(Duration::from_millis(30), tx);
        c.push(&crate::protocol::EnvId::from("e"), rec("a", None));
        c.push(&crate::protocol::EnvId::from("e"), rec("b", None));
        assert_eq!(recv(&mut rx).await.1, vec![rec("a", None)]);
        drop(c);
        // Every sender is gone once the aborted timer task is dropped: the channel closes
        // without delivering "b".
        assert_eq!(
            timeout(Duration::from_secs(5), rx.recv()).await.ok(),
            Some(None)
        );
    }
}
