//! Admission of live polls: the per-environment concurrency limit, compatible with trigger.dev's
//! (docs/trigger-dev.md §4; docs/behaviours.md REQ-02..05, LIM-01..03).
//!
//! Fleet-wide count: the Redis script of [`crate::redis::limit`]. A slot is released the moment
//! the poll ends — including when the client disconnects, since the [`Slot`] guard is dropped
//! with the request future. The guard exists from before the script is sent, so an admission
//! abandoned while Redis has yet to run it (client gone, deadline passed) is released too.
//!
//! When the limiter's Redis is unreachable or slow (250 ms deadline), the reference fails
//! closed (HTTP 500 for every live poll). runfeed degrades instead: it counts locally, per
//! instance, against the same limit — a fleet of N instances may then admit up to N × limit
//! during the outage, but no poll fails because of the limiter.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::redis::ConcurrencyScript;

/// How long admission waits for Redis before counting locally.
pub const REDIS_DEADLINE: Duration = Duration::from_millis(250);

/// Counters of the limiter (metrics read them).
#[derive(Debug, Default)]
pub struct LimiterStats {
    /// Polls refused with 429.
    pub rejections: AtomicU64,
    /// Admissions decided locally because Redis failed or was slow.
    pub degraded: AtomicU64,
}

/// The limiter. `script == None`: local counting only (tests, single instance without Redis).
pub struct Limiter {
    script: Option<ConcurrencyScript>,
    default_limit: u64,
    overrides: HashMap<String, u64>,
    local: Arc<Mutex<HashMap<String, u64>>>,
    next_id: AtomicU64,
    instance: u64,
    /// Counters.
    pub stats: LimiterStats,
}

/// A held concurrency slot; dropping it releases the slot (in Redis: a fire-and-forget ZREM).
pub struct Slot {
    release: Option<Release>,
}

enum Release {
    Redis {
        script: ConcurrencyScript,
        env_id: String,
        member: String,
    },
    Local {
        local: Arc<Mutex<HashMap<String, u64>>>,
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
            Some(Release::Local { local, env_id }) => {
                let mut counts = local.lock().unwrap_or_else(|p| p.into_inner());
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

impl Limiter {
    /// A limiter with `default_limit` live polls per environment and per-organization
    /// `overrides` (org id → limit; 0 is a real limit that refuses every live poll).
    pub fn new(
        script: Option<ConcurrencyScript>,
        default_limit: u64,
        overrides: HashMap<String, u64>,
    ) -> Limiter {
        Limiter {
            script,
            default_limit,
            overrides,
            local: Arc::default(),
            next_id: AtomicU64::new(0),
            instance: rand::random(),
            stats: LimiterStats::default(),
        }
    }

    /// The limit that applies to an organization.
    pub fn limit_for(&self, organization_id: &str) -> u64 {
        self.overrides
            .get(organization_id)
            .copied()
            .unwrap_or(self.default_limit)
    }

    /// Takes a slot for a live poll of `env_id`, or `None` when the environment is at its limit
    /// (answer 429 `{"error":"Too many concurrent requests"}`).
    pub async fn acquire(&self, env_id: &str, organization_id: &str) -> Option<Slot> {
        let limit = self.limit_for(organization_id);
        if let Some(script) = &self.script {
            let member = format!(
                "{:x}-{}",
                self.instance,
                self.next_id.fetch_add(1, Ordering::Relaxed)
            );
            // Armed before the script is sent: if this future is dropped (the client went away)
            // or the deadline passes while Redis has yet to run the script, the member the
            // script then adds is removed again (queued after it on the same connection).
            let mut pending = Slot {
                release: Some(Release::Redis {
                    script: script.clone(),
                    env_id: env_id.to_string(),
                    member: member.clone(),
                }),
            };
            let admit = script.admit(env_id, &member, limit, crate::clock::now_ms());
            match tokio::time::timeout(REDIS_DEADLINE, admit).await {
                Ok(Ok(true)) => return Some(pending),
                Ok(Ok(false)) => {
                    // The script removed the member itself.
                    pending.release = None;
                    self.stats.rejections.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                Ok(Err(err)) => {
                    tracing::warn!(env_id, error = %err, "concurrency limiter unavailable; counting locally")
                }
                Err(_) => tracing::warn!(env_id, "concurrency limiter timed out; counting locally"),
            }
            self.stats.degraded.fetch_add(1, Ordering::Relaxed);
        }
        let mut counts = self.local.lock().unwrap_or_else(|p| p.into_inner());
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn req_04_local_limit_rejects_over_the_limit_and_release_frees_at_once() {
        let limiter = Limiter::new(None, 2, HashMap::from([("small".to_string(), 0)]));
        let a = limiter.acquire("e", "org").await;
        let b = limiter.acquire("e", "org").await;
        assert!(a.is_some() && b.is_some());
        let third = limiter.acquire("e", "org").await;
        assert!(third.is_none(), "third live poll over a limit of 2");
        let other_env = limiter.acquire("other", "org").await;
        assert!(other_env.is_some(), "counted per environment");
        drop(a);
        let freed = limiter.acquire("e", "org").await;
        assert!(freed.is_some(), "a released slot is free at once");
        let zero = limiter.acquire("e2", "small").await;
        assert!(zero.is_none(), "REQ-03: a limit of 0 is a real limit");
        assert_eq!(limiter.stats.rejections.load(Ordering::Relaxed), 2);
    }
}
