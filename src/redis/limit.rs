//! The live-poll concurrency count in Redis, compatible with trigger.dev's (docs/trigger-dev.md
//! §4; docs/behaviours.md REQ-02..05, LIM-01..03): a sorted set per environment, key
//! `tr:realtime:native:concurrency:<envId>`, members = poll ids scored by start time (ms). One
//! atomic script drops members older than [`ENTRY_TTL_S`], adds this poll, refreshes the key
//! TTL, and rejects (removing the member again) when the cardinality exceeds the limit. The
//! admission policy around it (fallback, slot guards) is `http::admit`.

use std::sync::{Arc, LazyLock};

use fred::clients::Client;
use fred::interfaces::SortedSetsInterface;
use fred::types::scripts::Script;

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

/// [`ADMIT`] with its SHA-1: sent as `EVALSHA` (40 bytes instead of the body, and Redis does not
/// hash the body per call), loaded again on `NOSCRIPT` (a restarted or new node).
static ADMIT_SCRIPT: LazyLock<Arc<Script>> = LazyLock::new(|| Arc::new(Script::from_lua(ADMIT)));

/// The concurrency script on a key/value client (see [`super::Redis::concurrency`]).
#[derive(Clone)]
pub struct ConcurrencyScript {
    client: Client,
    script: Arc<Script>,
}

impl ConcurrencyScript {
    /// The script on `client`.
    pub fn new(client: Client) -> ConcurrencyScript {
        ConcurrencyScript {
            client,
            script: ADMIT_SCRIPT.clone(),
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
        let admitted: i64 = self
            .script
            .evalsha_with_reload(&self.client, vec![format!("{KEY_PREFIX}{env_id}")], args)
            .await
            .map_err(|source| RedisError::Command {
                op: "concurrency admit",
                source,
            })?;
        Ok(admitted == 1)
    }

    /// Removes `member` from `env_id`'s set in the background (fire and forget: a lost release
    /// is swept after [`ENTRY_TTL_S`]).
    pub fn release(&self, env_id: &str, member: String) {
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let client = self.client.clone();
            let key = format!("{KEY_PREFIX}{env_id}");
            handle.spawn(async move {
                let _: Result<i64, _> = client.zrem(key, member).await;
            });
        }
    }
}
