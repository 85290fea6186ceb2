//! The live-poll concurrency count in Redis, compatible with trigger.dev's (docs/trigger-dev.md
//! §4; docs/behaviours.md REQ-02..05, LIM-01..03): a sorted set per environment, key
//! `tr:realtime:native:concurrency:<envId>`, members = poll ids scored by start time (ms). One
//! atomic script drops members older than [`ENTRY_TTL_S`], adds this poll, refreshes the key
//! TTL, and rejects (removing the member again) when the cardinality exceeds the limit.
//!
//! A second script leases a block of slots at once ([`ConcurrencyScript::lease`]): it adds up to
//! as many members as there are slots left under the limit, so an instance can admit many live
//! polls from one round trip. Leased members count exactly like polls, so trigger.dev's native
//! backend sharing the key sees the same total. The admission policy around both (leases,
//! fallback, slot guards) is `feeds::admit`.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::SortedSetsInterface;
use fred::types::scripts::Script;
use tokio::sync::mpsc;

use super::RedisError;

/// Key prefix of the per-environment sorted sets (trigger.dev's native backend uses the same).
pub const KEY_PREFIX: &str = "tr:realtime:native:concurrency:";
/// Members older than this are swept (a crashed instance's slots free themselves), seconds.
pub const ENTRY_TTL_S: i64 = 300;

const ADMIT: &str = r#"
local key = KEYS[1]
local now = tonumber(ARGV[1])
local id = ARGV[2]
local limit = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now - ttl * 1000)
redis.call('ZADD', key, now, id)
redis.call('EXPIRE', key, ttl)
if redis.call('ZCARD', key) > limit then
  redis.call('ZREM', key, id)
  return 0
end
return 1
"#;

const LEASE: &str = r#"
local key = KEYS[1]
local now = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now - ttl * 1000)
local room = limit - redis.call('ZCARD', key)
local want = #ARGV - 3
if room > want then room = want end
if room <= 0 then return 0 end
local args = {}
for i = 1, room do
  args[#args + 1] = now
  args[#args + 1] = ARGV[3 + i]
end
redis.call('ZADD', key, unpack(args))
redis.call('EXPIRE', key, ttl)
return room
"#;

/// [`LEASE`] with its SHA-1 (sent as `EVALSHA`, like [`ADMIT_SCRIPT`]).
static LEASE_SCRIPT: LazyLock<Arc<Script>> = LazyLock::new(|| Arc::new(Script::from_lua(LEASE)));

/// [`ADMIT`] with its SHA-1: sent as `EVALSHA` (40 bytes instead of the body, and Redis does not
/// hash the body per call), loaded again on `NOSCRIPT` (a restarted or new node).
static ADMIT_SCRIPT: LazyLock<Arc<Script>> = LazyLock::new(|| Arc::new(Script::from_lua(ADMIT)));

/// Releases waiting for the release task at most; beyond that (Redis slow or down) a release
/// is dropped, and its member is swept after [`ENTRY_TTL_S`].
pub const RELEASE_QUEUE_MAX: usize = 16_384;
/// Most releases sent to Redis in one pipeline.
const RELEASE_BATCH_MAX: usize = 1024;

/// The concurrency script on a key/value client (see [`super::Redis::concurrency`]).
#[derive(Clone)]
pub struct ConcurrencyScript {
    client: Client,
    /// What this script's calls count as (`concurrency`).
    commands: Arc<super::CommandCounts>,
    script: Arc<Script>,
    /// `(env_id, member)` to the release task; `None` outside a tokio runtime (releases are
    /// then left to the sweep).
    releases: Option<mpsc::Sender<(String, String)>>,
}

impl ConcurrencyScript {
    /// The script on `client`. Inside a tokio runtime it starts the release task (see
    /// [`ConcurrencyScript::release`]), which ends when the last clone is dropped.
    pub fn new(client: Client, commands: Arc<super::CommandCounts>) -> ConcurrencyScript {
        let releases = tokio::runtime::Handle::try_current().ok().map(|rt| {
            let (tx, rx) = mpsc::channel(RELEASE_QUEUE_MAX);
            rt.spawn(release_loop(client.clone(), rx, commands.clone()));
            tx
        });
        ConcurrencyScript {
            client,
            commands,
            script: ADMIT_SCRIPT.clone(),
            releases,
        }
    }

    /// Adds `member` to `env_id`'s set at `now_ms` unless the set then holds more than `limit`
    /// members: `Ok(true)` admitted, `Ok(false)` at the limit. Unbounded in time: the caller
    /// bounds it.
    ///
    /// Errors: [`RedisError::Command`] when Redis fails.
    pub async fn admit(
        &self,
        env_id: &str,
        member: &str,
        limit: u64,
        now_ms: i64,
    ) -> Result<bool, RedisError> {
        let args = vec![
            now_ms.to_string(),
            member.to_string(),
            limit.to_string(),
            ENTRY_TTL_S.to_string(),
        ];
        let admitted = self
            .call(&self.script, "concurrency admit", env_id, args)
            .await?;
        Ok(admitted == 1)
    }

    /// Adds the first of `members` to `env_id`'s set at `now_ms`, as many as fit under `limit`
    /// (members older than [`ENTRY_TTL_S`] are swept first): the number added, 0 when the
    /// environment is at its limit. Unbounded in time: the caller bounds it.
    ///
    /// Errors: [`RedisError::Command`] when Redis fails.
    pub async fn lease(
        &self,
        env_id: &str,
        members: &[String],
        limit: u64,
        now_ms: i64,
    ) -> Result<usize, RedisError> {
        let mut args = Vec::with_capacity(3 + members.len());
        args.extend([
            now_ms.to_string(),
            limit.to_string(),
            ENTRY_TTL_S.to_string(),
        ]);
        args.extend(members.iter().cloned());
        let added = self
            .call(&LEASE_SCRIPT, "concurrency lease", env_id, args)
            .await?;
        Ok(usize::try_from(added).unwrap_or(0))
    }

    /// Runs `script` on `env_id`'s set with `args` (one command counted as `concurrency`):
    /// its integer answer.
    ///
    /// Errors: [`RedisError::Command`] named `op` when Redis fails.
    async fn call(
        &self,
        script: &Script,
        op: &'static str,
        env_id: &str,
        args: Vec<String>,
    ) -> Result<i64, RedisError> {
        super::CommandCounts::sent(&self.commands.concurrency, 1);
        script
            .evalsha_with_reload(&self.client, vec![format!("{KEY_PREFIX}{env_id}")], args)
            .await
            .map_err(|source| RedisError::Command { op, source })
    }

    /// Re-stamps leased `members` of `env_id` at `now_ms` (only those still in the set) and
    /// refreshes the key's TTL, so the [`ENTRY_TTL_S`] sweep never takes a slot that is still
    /// leased. One pipeline of two commands.
    ///
    /// Errors: [`RedisError::Command`] when Redis fails.
    pub async fn refresh(
        &self,
        env_id: &str,
        members: &[String],
        now_ms: i64,
    ) -> Result<(), RedisError> {
        use fred::interfaces::KeysInterface;
        if members.is_empty() {
            return Ok(());
        }
        let key = format!("{KEY_PREFIX}{env_id}");
        let scored: Vec<(f64, String)> =
            members.iter().map(|m| (now_ms as f64, m.clone())).collect();
        super::CommandCounts::sent(&self.commands.concurrency, 2);
        let pipeline = self.client.pipeline();
        let _: Result<(), _> = pipeline
            .zadd(
                key.as_str(),
                Some(fred::types::SetOptions::XX),
                None,
                false,
                false,
                scored,
            )
            .await;
        let _: Result<(), _> = pipeline.expire(key.as_str(), ENTRY_TTL_S, None).await;
        pipeline
            .all::<()>()
            .await
            .map_err(|source| RedisError::Command {
                op: "concurrency refresh",
                source,
            })
    }

    /// Removes `member` from `env_id`'s set in the background (fire and forget: a lost release
    /// is swept after [`ENTRY_TTL_S`]).
    ///
    /// Releases queue for one task that sends whatever has queued up as one pipeline with one
    /// `ZREM key member…` per environment: one change that answers 10 000 live polls of one
    /// environment costs about ten commands, not 10 000 tasks and commands (BENCHMARKS.md "Fan-out").
    pub fn release(&self, env_id: &str, member: String) {
        if let Some(releases) = &self.releases {
            if releases.try_send((env_id.to_string(), member)).is_err() {
                tracing::debug!("concurrency release queue full; the sweep will free the slot");
            }
        }
    }
}

/// The release task: drains up to [`RELEASE_BATCH_MAX`] queued releases and sends them as one
/// pipeline of `ZREM` commands, one per environment, bounded by [`RELEASE_WAIT`].
async fn release_loop(
    client: Client,
    mut rx: mpsc::Receiver<(String, String)>,
    commands: Arc<super::CommandCounts>,
) {
    let mut batch = Vec::with_capacity(RELEASE_BATCH_MAX);
    while rx.recv_many(&mut batch, RELEASE_BATCH_MAX).await > 0 {
        let pipeline = client.pipeline();
        for (env_id, members) in members_by_env(batch.drain(..)) {
            super::CommandCounts::sent(&commands.concurrency, 1);
            // Queued locally; the replies arrive with `try_all()`.
            let _: Result<(), _> = pipeline
                .zrem(format!("{KEY_PREFIX}{env_id}"), members)
                .await;
        }
        // The replies are awaited in a task of their own: the next batch never waits behind
        // this one.
        tokio::spawn(async move {
            let sent = tokio::time::timeout(RELEASE_WAIT, pipeline.try_all::<i64>()).await;
            if !matches!(&sent, Ok(replies) if replies.iter().all(Result::is_ok)) {
                tracing::debug!("concurrency releases failed; the sweep will free the slots");
            }
        });
    }
}

/// How long one pipeline of releases may take before its replies are abandoned.
const RELEASE_WAIT: Duration = Duration::from_secs(1);

/// `(env_id, member)` pairs grouped by environment, environments in order of first appearance.
fn members_by_env(pairs: impl Iterator<Item = (String, String)>) -> Vec<(String, Vec<String>)> {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for (env_id, member) in pairs {
        match index.get(&env_id) {
            Some(&i) => groups[i].1.push(member),
            None => {
                index.insert(env_id.clone(), groups.len());
                groups.push((env_id, vec![member]));
            }
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_of_one_environment_go_out_as_one_command() {
        let pairs = [
            ("e1", "a"),
            ("e2", "b"),
            ("e1", "c"),
            ("e1", "d"),
            ("e2", "e"),
        ]
        .map(|(e, m)| (e.to_string(), m.to_string()));
        let groups = members_by_env(pairs.into_iter());
        let want = [("e1", vec!["a", "c", "d"]), ("e2", vec!["b", "e"])].map(|(e, ms)| {
            (
                e.to_string(),
                ms.into_iter().map(String::from).collect::<Vec<_>>(),
            )
        });
        assert_eq!(groups, want.to_vec());
    }
}
