//! Admission of live polls: the per-environment concurrency limit, compatible with trigger.dev's
//! (docs/trigger-dev.md §4; docs/behaviours.md REQ-02..05, LIM-01..03).
//!
//! Fleet-wide count: the sorted set of [`crate::redis::limit`], one member per slot. A slot is
//! released the moment the poll ends — including when the client disconnects, since the
//! [`Slot`] guard is dropped with the request future.
//!
//! **Leased slots** (`feeds.concurrency_lease_slots`, docs/operations.md "Concurrency limit"): an
//! instance takes slots from Redis in blocks and admits live polls from them locally, so a live
//! poll that ends and is re-polled costs no Redis command. The instance keeps at most one block
//! of unused slots per environment (trimmed every [`TRIM_EVERY`]; all of them
//! [`IDLE_RETURN`] after the environment's last poll ends) and re-stamps what it holds every
//! [`REFRESH_EVERY`], before the sweep would take it. Leased slots count in Redis like polls, so
//! the fleet never admits more than the limit; the tolerance is the other way: an environment
//! may be refused up to `(instances − 1) × block` polls before its limit while other instances
//! hold unused leased slots. The block is `min(concurrency_lease_slots, limit / 16)`, so it is
//! never more than 1/16 of the limit per instance, and a limit under 16 (or
//! `concurrency_lease_slots = 0`) is counted exactly: one script call per live poll, released
//! when it ends.
//!
//! Every lease or admission is guarded from before its script is sent, so one abandoned while
//! Redis has yet to run it (client gone, deadline passed) is released too.
//!
//! When the limiter's Redis is unreachable or slow (250 ms deadline), the reference fails
//! closed (HTTP 500 for every live poll). runfeed degrades instead: it counts locally, per
//! instance, against the same limit — a fleet of N instances may then admit up to N × limit
//! during the outage, but no poll fails because of the limiter.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cache::FastMap;
use crate::protocol::{EnvId, OrgId};
use crate::redis::ConcurrencyScript;

/// How long admission waits for Redis before counting locally.
pub const REDIS_DEADLINE: Duration = Duration::from_millis(250);
/// How often unused leased slots beyond one block are returned.
pub const TRIM_EVERY: Duration = Duration::from_secs(1);
/// An environment with no live poll on this instance for this long returns all its slots.
pub const IDLE_RETURN: Duration = Duration::from_secs(5);
/// How often leased slots are re-stamped in Redis (well inside the 300 s sweep).
pub const REFRESH_EVERY: Duration = Duration::from_secs(60);
/// A limit is counted exactly (no leases) unless the block, `limit / LEASE_DIVISOR`, is ≥ 1.
pub const LEASE_DIVISOR: u64 = 16;

/// Counters of the limiter (metrics read them).
#[derive(Debug, Default)]
pub struct LimiterStats {
    /// Polls refused with 429.
    pub rejections: AtomicU64,
    /// Admissions decided locally because Redis failed or was slow.
    pub degraded: AtomicU64,
    /// Redis script calls made to admit polls (one per poll in the exact mode, one per block
    /// with leases).
    pub script_calls: AtomicU64,
}

/// The limits the limiter applies.
#[derive(Clone, Debug, Default)]
pub struct LimiterConfig {
    /// Live polls per environment (`feeds.default_concurrency_limit`).
    pub default_limit: u64,
    /// Per-organization limits (org id → limit; 0 is a real limit that refuses every poll).
    pub overrides: HashMap<String, u64>,
    /// Most slots leased at once per environment (`feeds.concurrency_lease_slots`); 0 = exact.
    pub lease_slots: u64,
}

impl LimiterConfig {
    /// The limits of `config`'s `[feeds]`.
    pub fn of(feeds: &crate::config::FeedsConfig) -> LimiterConfig {
        LimiterConfig {
            default_limit: feeds.default_concurrency_limit,
            overrides: feeds
                .concurrency_limit_overrides
                .clone()
                .into_iter()
                .collect(),
            lease_slots: feeds.concurrency_lease_slots,
        }
    }
}

/// The limiter. `script == None`: local counting only (tests, single instance without Redis).
pub struct Limiter {
    script: Option<ConcurrencyScript>,
    cfg: LimiterConfig,
    local: Arc<Mutex<FastMap<String, u64>>>,
    leases: Arc<Leases>,
    next_id: AtomicU64,
    instance: u64,
    /// Counters.
    pub stats: LimiterStats,
}

/// Slots this instance holds in Redis, per environment.
#[derive(Default)]
struct Leases {
    envs: Mutex<FastMap<Arc<str>, EnvLease>>,
}

struct EnvLease {
    /// The environment (its map key, shared with the slots taken from it).
    env_id: Arc<str>,
    /// Members added to the environment's set (each one slot).
    members: Vec<String>,
    /// Slots taken by live polls now (≤ `members.len()`).
    in_use: usize,
    /// Unused slots kept between trims.
    block: usize,
    /// When `in_use` last fell to 0.
    idle_since: Instant,
    /// One lease call in flight per environment; the others wait for its slots.
    leasing: Arc<tokio::sync::Mutex<()>>,
}

impl Leases {
    /// A free leased slot of `env_id`, taken, if there is one (one map lookup: the hot path of
    /// every admission).
    fn take(self: &Arc<Self>, env_id: &str) -> Option<Slot> {
        let mut envs = self.envs.lock();
        let lease = envs.get_mut(env_id)?;
        if lease.in_use >= lease.members.len() {
            return None;
        }
        lease.in_use += 1;
        Some(Slot {
            release: Some(Release::Leased {
                leases: self.clone(),
                env_id: lease.env_id.clone(),
            }),
        })
    }
}

/// A held concurrency slot; dropping it releases the slot (to this instance's lease, or in
/// Redis a fire-and-forget ZREM, or the local count).
pub struct Slot {
    release: Option<Release>,
}

enum Release {
    Redis {
        script: ConcurrencyScript,
        env_id: String,
        member: String,
    },
    Leased {
        leases: Arc<Leases>,
        env_id: Arc<str>,
    },
    Local {
        local: Arc<Mutex<FastMap<String, u64>>>,
        env_id: String,
    },
}

impl Drop for Slot {
    fn drop(&mut self) {
        match self.release.take() {
            Some(Release::Redis {
                script,
                env_id,
                member,
            }) => script.release(&env_id, member),
            Some(Release::Leased { leases, env_id }) => {
                let mut envs = leases.envs.lock();
                if let Some(lease) = envs.get_mut(&env_id) {
                    lease.in_use = lease.in_use.saturating_sub(1);
                    if lease.in_use == 0 {
                        lease.idle_since = Instant::now();
                    }
                }
            }
            Some(Release::Local { local, env_id }) => {
                let mut counts = local.lock();
                if let Some(n) = counts.get_mut(&env_id) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        counts.remove(&env_id);
                    }
                }
            }
            None => {}
        }
    }
}

/// Members sent in a script call that Redis may add after the caller stopped waiting: removed
/// again on drop unless [`Pending::settle`]d.
struct Pending<'a> {
    script: &'a ConcurrencyScript,
    env_id: &'a str,
    members: Vec<String>,
}

impl Pending<'_> {
    /// Redis answered: none of these members needs removing.
    fn settle(mut self) -> Vec<String> {
        std::mem::take(&mut self.members)
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        for member in self.members.drain(..) {
            self.script.release(self.env_id, member);
        }
    }
}

/// What a leased admission came to.
enum Leased {
    Slot(Slot),
    AtLimit,
    /// Redis failed or was slow: count locally.
    Unavailable,
}

/// Redis failed (`err`) or timed out: the poll is counted locally (logged).
fn unavailable(env_id: &str, err: Option<&crate::redis::RedisError>) -> Leased {
    match err {
        Some(err) => {
            tracing::warn!(env_id, error = %err, "concurrency limiter unavailable; counting locally")
        }
        None => tracing::warn!(env_id, "concurrency limiter timed out; counting locally"),
    }
    Leased::Unavailable
}

impl Limiter {
    /// A limiter applying `cfg`, counting in Redis through `script` (locally when `None`).
    pub fn new(script: Option<ConcurrencyScript>, cfg: LimiterConfig) -> Limiter {
        Limiter {
            script,
            cfg,
            local: Arc::default(),
            leases: Arc::default(),
            next_id: AtomicU64::new(0),
            instance: rand::random(),
            stats: LimiterStats::default(),
        }
    }

    /// The limit that applies to an organization.
    pub fn limit_for(&self, organization_id: &OrgId) -> u64 {
        self.cfg
            .overrides
            .get(organization_id.as_str())
            .copied()
            .unwrap_or(self.cfg.default_limit)
    }

    /// Slots leased per call for `limit` (0: counted exactly, one script call per poll).
    pub fn lease_block(&self, limit: u64) -> u64 {
        self.cfg.lease_slots.min(limit / LEASE_DIVISOR)
    }

    /// Slots this instance holds in Redis now, over all environments (leased, used or not).
    pub fn leased_slots(&self) -> usize {
        self.leases
            .envs
            .lock()
            .values()
            .map(|l| l.members.len())
            .sum()
    }

    fn member(&self) -> String {
        format!(
            "{:x}-{}",
            self.instance,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// Takes a slot for a live poll of `env_id`, or `None` when the environment is at its limit
    /// (answer 429 `{"error":"Too many concurrent requests"}`).
    pub async fn acquire(&self, env_id: &EnvId, organization_id: &OrgId) -> Option<Slot> {
        let limit = self.limit_for(organization_id);
        let env_id = env_id.as_str();
        if let Some(script) = &self.script {
            let block = self.lease_block(limit);
            // A free slot of this instance's lease is taken without an await; the Redis paths
            // are boxed so the common case neither carries nor moves their futures.
            if block > 0 {
                if let Some(slot) = self.leases.take(env_id) {
                    return Some(slot);
                }
            }
            let outcome = if block > 0 {
                Box::pin(self.acquire_leased(script, env_id, limit, block as usize)).await
            } else {
                Box::pin(self.acquire_exact(script, env_id, limit)).await
            };
            match outcome {
                Leased::Slot(slot) => return Some(slot),
                Leased::AtLimit => {
                    self.stats.rejections.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                Leased::Unavailable => {
                    self.stats.degraded.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let mut counts = self.local.lock();
        let held = counts.entry(env_id.to_string()).or_insert(0);
        if *held >= limit {
            if *held == 0 {
                counts.remove(env_id);
            }
            self.stats.rejections.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *held += 1;
        Some(Slot {
            release: Some(Release::Local {
                local: self.local.clone(),
                env_id: env_id.to_string(),
            }),
        })
    }

    /// One script call for this poll alone; its member is removed when the poll ends.
    async fn acquire_exact(&self, script: &ConcurrencyScript, env_id: &str, limit: u64) -> Leased {
        let member = self.member();
        // Guarded before the script is sent: if this future is dropped (the client went away)
        // or the deadline passes while Redis has yet to run the script, the member the script
        // then adds is removed again (queued after it on the same connection).
        let pending = Pending {
            script,
            env_id,
            members: vec![member.clone()],
        };
        self.stats.script_calls.fetch_add(1, Ordering::Relaxed);
        let admit = script.admit(env_id, &member, limit, crate::clock::now_ms());
        match tokio::time::timeout(REDIS_DEADLINE, admit).await {
            Ok(Ok(true)) => {
                pending.settle();
                Leased::Slot(Slot {
                    release: Some(Release::Redis {
                        script: script.clone(),
                        env_id: env_id.to_string(),
                        member,
                    }),
                })
            }
            // The script removed the member itself.
            Ok(Ok(false)) => {
                pending.settle();
                Leased::AtLimit
            }
            Ok(Err(err)) => unavailable(env_id, Some(&err)),
            Err(_) => unavailable(env_id, None),
        }
    }

    /// A slot from this instance's lease, leasing another block when none is free.
    async fn acquire_leased(
        &self,
        script: &ConcurrencyScript,
        env_id: &str,
        limit: u64,
        block: usize,
    ) -> Leased {
        if let Some(slot) = self.leases.take(env_id) {
            return Leased::Slot(slot);
        }
        let leasing = {
            let mut envs = self.leases.envs.lock();
            let key: Arc<str> = Arc::from(env_id);
            let lease = envs.entry(key.clone()).or_insert_with(|| EnvLease {
                env_id: key,
                members: Vec::new(),
                in_use: 0,
                block,
                idle_since: Instant::now(),
                leasing: Arc::default(),
            });
            lease.leasing.clone()
        };
        let _turn = leasing.lock().await;
        // Another poll's lease may have brought slots while this one waited.
        if let Some(slot) = self.leases.take(env_id) {
            return Leased::Slot(slot);
        }
        let members: Vec<String> = (0..block).map(|_| self.member()).collect();
        let pending = Pending {
            script,
            env_id,
            members: members.clone(),
        };
        self.stats.script_calls.fetch_add(1, Ordering::Relaxed);
        let lease = script.lease(env_id, &members, limit, crate::clock::now_ms());
        match tokio::time::timeout(REDIS_DEADLINE, lease).await {
            Ok(Ok(0)) => {
                pending.settle();
                Leased::AtLimit
            }
            Ok(Ok(added)) => {
                let mut members = pending.settle();
                members.truncate(added);
                let mut envs = self.leases.envs.lock();
                if let Some(lease) = envs.get_mut(env_id) {
                    lease.members.extend(members);
                } else {
                    // Trimmed away meanwhile (cannot happen while `leasing` is held): give back.
                    drop(envs);
                    for member in members {
                        script.release(env_id, member);
                    }
                    return Leased::Unavailable;
                }
                drop(envs);
                match self.leases.take(env_id) {
                    Some(slot) => Leased::Slot(slot),
                    None => Leased::Unavailable,
                }
            }
            Ok(Err(err)) => unavailable(env_id, Some(&err)),
            Err(_) => unavailable(env_id, None),
        }
    }

    /// Returns unused leased slots, as of `now`: beyond one block per environment, and all of
    /// them for an environment idle for [`IDLE_RETURN`]. Returns how many were given back.
    pub fn trim(&self, now: Instant) -> usize {
        self.give_back(now, false)
    }

    /// Returns every unused leased slot (at shutdown). Returns how many were given back.
    pub fn return_all(&self) -> usize {
        self.give_back(Instant::now(), true)
    }

    fn give_back(&self, now: Instant, all: bool) -> usize {
        let Some(script) = &self.script else {
            return 0;
        };
        let mut returned = Vec::new();
        {
            let mut envs = self.leases.envs.lock();
            envs.retain(|env_id, lease| {
                let idle = lease.in_use == 0
                    && now.saturating_duration_since(lease.idle_since) >= IDLE_RETURN;
                let keep = if all || idle { 0 } else { lease.block };
                let free = lease.members.len() - lease.in_use.min(lease.members.len());
                if free > keep {
                    let cut = lease.members.len() - (free - keep);
                    returned.extend(lease.members.drain(cut..).map(|m| (env_id.clone(), m)));
                }
                // An entry whose lease call is in flight stays: the call adds to it.
                !(lease.members.is_empty()
                    && lease.in_use == 0
                    && Arc::strong_count(&lease.leasing) == 1)
            });
        }
        let n = returned.len();
        for (env_id, member) in returned {
            script.release(&env_id, member);
        }
        n
    }

    /// Re-stamps every leased slot in Redis (one pipeline per environment); see [`REFRESH_EVERY`].
    pub async fn refresh(&self) {
        let Some(script) = &self.script else {
            return;
        };
        let held: Vec<(Arc<str>, Vec<String>)> = self
            .leases
            .envs
            .lock()
            .iter()
            .filter(|(_, l)| !l.members.is_empty())
            .map(|(env, l)| (env.clone(), l.members.clone()))
            .collect();
        let now_ms = crate::clock::now_ms();
        for (env_id, members) in held {
            let refresh = script.refresh(&env_id, &members, now_ms);
            match tokio::time::timeout(REDIS_DEADLINE * 4, refresh).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => {
                    tracing::warn!(env_id = %env_id, error = %err, "leased slots not re-stamped")
                }
                Err(_) => {
                    tracing::warn!(env_id = %env_id, "leased slots not re-stamped: Redis timed out")
                }
            }
        }
    }

    /// Trims leases every [`TRIM_EVERY`] and re-stamps them every [`REFRESH_EVERY`] until
    /// `shutdown`, then returns every leased slot.
    pub async fn maintain(self: Arc<Self>, shutdown: CancellationToken) {
        let mut trim = tokio::time::interval(TRIM_EVERY);
        let mut refresh = tokio::time::interval(REFRESH_EVERY);
        trim.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        refresh.tick().await;
        loop {
            tokio::select! {
                _ = trim.tick() => { self.trim(Instant::now()); }
                _ = refresh.tick() => self.refresh().await,
                _ = shutdown.cancelled() => break,
            }
        }
        self.return_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn req_04_local_limit_rejects_over_the_limit_and_release_frees_at_once() {
        let cfg = LimiterConfig {
            default_limit: 2,
            overrides: HashMap::from([("small".to_string(), 0)]),
            lease_slots: 32,
        };
        let limiter = Limiter::new(None, cfg);
        let (e, org) = (EnvId::new("e"), OrgId::new("org"));
        let a = limiter.acquire(&e, &org).await;
        let b = limiter.acquire(&e, &org).await;
        assert!(a.is_some() && b.is_some());
        let third = limiter.acquire(&e, &org).await;
        assert!(third.is_none(), "third live poll over a limit of 2");
        let other_env = limiter.acquire(&EnvId::new("other"), &org).await;
        assert!(other_env.is_some(), "counted per environment");
        drop(a);
        let freed = limiter.acquire(&e, &org).await;
        assert!(freed.is_some(), "a released slot is free at once");
        let zero = limiter
            .acquire(&EnvId::new("e2"), &OrgId::new("small"))
            .await;
        assert!(zero.is_none(), "REQ-03: a limit of 0 is a real limit");
        assert_eq!(limiter.stats.rejections.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_lease_block_is_at_most_a_sixteenth_of_the_limit_and_small_limits_are_exact() {
        let limiter = Limiter::new(
            None,
            LimiterConfig {
                lease_slots: 32,
                ..LimiterConfig::default()
            },
        );
        assert_eq!(limiter.lease_block(100_000), 32);
        assert_eq!(limiter.lease_block(160), 10);
        assert_eq!(limiter.lease_block(15), 0, "exact: one script per poll");
        assert_eq!(limiter.lease_block(0), 0);
        let exact = Limiter::new(None, LimiterConfig::default());
        assert_eq!(exact.lease_block(100_000), 0, "concurrency_lease_slots = 0");
    }
}
