//! The change-record codec (`runChangeNotifier.server.ts`). STUB: the changes helper implements.

/// One change record. Ids are INTERNAL ids (`"TaskRun".id`, `"RuntimeEnvironment".id`,
/// `"BatchTaskRun".id`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ChangeRecord {
    /// Record version; 1 for everything trigger publishes, 0 for degraded decodes.
    pub v: u32,
    pub run_id: String,
    /// May be `""` (degraded decode); the channel name is authoritative.
    pub env_id: String,
    /// `Some` (even empty) = a "full" record whose membership can be classified locally;
    /// `None` = "partial": tag feeds must hydrate to classify.
    pub tags: Option<Vec<String>>,
    /// Internal batch id; `null` and absent both decode to `None`.
    pub batch_id: Option<String>,
    /// Epoch ms of the committed `updatedAt` (read-your-writes watermark), when the publish site
    /// supplied it.
    pub updated_at_ms: Option<i64>,
}

/// The Redis channel of an environment: `realtime:env:{<envId>}` (braces literal: a cluster
/// hash tag).
pub fn channel_name(env_id: &str) -> String {
    format!("realtime:env:{{{env_id}}}")
}

/// The environment id of a channel name, if it is one of ours.
pub fn env_of_channel(channel: &str) -> Option<&str> {
    channel.strip_prefix("realtime:env:{")?.strip_suffix('}')
}

impl ChangeRecord {
    /// Decodes a wire message; never fails. A message that does not start with `{`, is not
    /// valid JSON, or lacks a string `runId` becomes a partial record whose `run_id` is the whole
    /// text, `v` 0 and `env_id` "" (NTF-13..15).
    pub fn decode(payload: &[u8]) -> ChangeRecord {
        let _ = payload;
        unimplemented!("changes helper")
    }

    /// Encodes exactly as the webapp's `JSON.stringify`: keys `v`, `runId`, `envId`, then
    /// `tags`, `batchId`, `updatedAtMs` when present (`batchId` written as `null` when the record
    /// is full and has no batch, as `run.batchId` would be).
    pub fn encode(&self) -> String {
        unimplemented!("changes helper")
    }

    /// Merges a later record for the same run into this one instead of replacing it: the
    /// highest watermark wins, a full record's tags beat a partial's (later full beats earlier
    /// full), a known batch id is kept. Never loses what either record knew.
    pub fn merge_from(&mut self, later: ChangeRecord) {
        let _ = later;
        unimplemented!("changes helper")
    }
}
