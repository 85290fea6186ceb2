//! The change-record codec (trigger.dev `services/realtime/runChangeNotifier.server.ts`,
//! docs/trigger-dev.md §5, docs/behaviours.md NTF-01 and NTF-13..15).
//!
//! Wire form, as the webapp's `JSON.stringify` writes it:
//!
//! ```text
//! {"v":1,"runId":"<run>","envId":"<env>","tags":["a","b"],"batchId":"<batch>"|null,"updatedAtMs":1717750000000}
//! ```
//!
//! `tags`, `batchId` and `updatedAtMs` appear only when the publish site supplied them.

use std::borrow::Cow;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::protocol::{BatchId, EnvId, RunId};

/// One change record. Ids are INTERNAL ids (`"TaskRun".id`, `"RuntimeEnvironment".id`,
/// `"BatchTaskRun".id`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ChangeRecord {
    /// Record version; 1 for everything trigger publishes, 0 for degraded decodes.
    pub v: u32,
    /// Internal `"TaskRun".id`; for a degraded decode the whole raw message.
    pub run_id: RunId,
    /// May be `""` (degraded decode); the channel name is authoritative.
    pub env_id: EnvId,
    /// `Some` (even empty) = a "full" record whose membership can be classified locally;
    /// `None` = "partial": tag feeds must hydrate to classify.
    pub tags: Option<Vec<String>>,
    /// Internal batch id; `null` and absent both decode to `None`.
    pub batch_id: Option<BatchId>,
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
    /// A degraded ("partial", `v` 0, `env_id` "") record whose run id is the whole raw text
    /// (lossy UTF-8), as the webapp's decoder produces for a bare-string frame (NTF-14/15).
    fn degraded(payload: &[u8]) -> ChangeRecord {
        ChangeRecord {
            v: 0,
            run_id: RunId::from(String::from_utf8_lossy(payload).into_owned()),
            ..ChangeRecord::default()
        }
    }

    /// Decodes a wire message; never fails. A message that does not start with `{`, is not
    /// valid JSON, or lacks a string `runId` becomes a partial record whose `run_id` is the whole
    /// text, `v` 0 and `env_id` "" (NTF-13..15).
    ///
    /// For a JSON object: `v` is any JSON number (truncated, clamped to `u32`, default 0);
    /// `envId` a string (default ""); `tags` an array of strings (anything else, including an
    /// array holding a non-string, decodes as `None` = partial, so a tag feed hydrates rather than
    /// trusting a malformed list); `batchId` a string (`null`/absent/other → `None`);
    /// `updatedAtMs` any JSON number (floats truncated toward zero, saturating) else `None`.
    /// Unknown keys (`createdAtMs`, `status`) are ignored.
    pub fn decode(payload: &[u8]) -> ChangeRecord {
        if payload.first() != Some(&b'{') {
            return ChangeRecord::degraded(payload);
        }
        // Read straight into the fields (no `serde_json::Value` tree); every value is parsed
        // as `Value` would parse it, so what is valid JSON is the same.
        let Ok(fields) = serde_json::from_slice::<WireFields>(payload) else {
            return ChangeRecord::degraded(payload);
        };
        let Some(Wire::Str(run_id)) = fields.run_id else {
            return ChangeRecord::degraded(payload);
        };
        ChangeRecord {
            v: fields.v.as_ref().and_then(Wire::as_u32).unwrap_or(0),
            run_id: RunId::new(&run_id),
            env_id: EnvId::new(fields.env_id.as_ref().and_then(Wire::as_str).unwrap_or("")),
            tags: match fields.tags {
                Some(Wire::Strings(tags)) => Some(tags),
                _ => None,
            },
            batch_id: fields
                .batch_id
                .as_ref()
                .and_then(Wire::as_str)
                .map(BatchId::new),
            updated_at_ms: fields.updated_at_ms.as_ref().and_then(Wire::as_i64),
        }
    }

    /// Encodes exactly as the webapp's `JSON.stringify`: keys `v`, `runId`, `envId`, then
    /// `tags`, `batchId`, `updatedAtMs` when present (`batchId` written as `null` when the record
    /// is full and has no batch, as `run.batchId` would be).
    ///
    /// `v` is always written as `1`: the webapp's notifier stamps the version on publish
    /// (NTF-02), whatever the in-memory record says. Strings are escaped by `serde_json`.
    pub fn encode(&self) -> String {
        // `preserve_order` is enabled on serde_json, so the map keeps insertion order.
        let mut obj = Map::new();
        obj.insert("v".into(), Value::from(1u32));
        obj.insert("runId".into(), Value::from(self.run_id.as_str()));
        obj.insert("envId".into(), Value::from(self.env_id.as_str()));
        if let Some(tags) = &self.tags {
            obj.insert("tags".into(), Value::from(tags.clone()));
            obj.insert(
                "batchId".into(),
                self.batch_id.as_deref().map_or(Value::Null, Value::from),
            );
        } else if let Some(batch_id) = &self.batch_id {
            obj.insert("batchId".into(), Value::from(batch_id.as_str()));
        }
        if let Some(ms) = self.updated_at_ms {
            obj.insert("updatedAtMs".into(), Value::from(ms));
        }
        Value::Object(obj).to_string()
    }

    /// Merges another record for the same run into this one instead of replacing it, so the
    /// merged record is a candidate for every feed either one was: the highest watermark wins,
    /// tags are the union of two full sets and partial (`None`) when either record is partial, a
    /// known batch id is kept. Never loses what either record knew, whatever order the records
    /// arrived in (a late record of an earlier version may carry an older tag set).
    ///
    /// Precisely: `v` = max; `updated_at_ms` = max (`None` < any `Some`); `tags` = this one's
    /// then the other's new ones if both are full, else `None`; `batch_id` = later's if `Some`,
    /// else this one's; `env_id` = later's unless it is `""`. `run_id` is kept (the caller keys
    /// by run id). This refines the webapp's coalescer (docs/behaviours.md NTF-16), which
    /// replaces the pending record wholesale and so can drop a watermark, or the tag that made
    /// the run join a tag feed.
    pub fn merge_from(&mut self, later: ChangeRecord) {
        self.v = self.v.max(later.v);
        self.updated_at_ms = self.updated_at_ms.max(later.updated_at_ms);
        self.tags = match (self.tags.take(), later.tags) {
            (Some(mut tags), Some(more)) => {
                for tag in more {
                    if !tags.contains(&tag) {
                        tags.push(tag);
                    }
                }
                Some(tags)
            }
            _ => None,
        };
        if later.batch_id.is_some() {
            self.batch_id = later.batch_id;
        }
        if !later.env_id.is_empty() {
            self.env_id = later.env_id;
        }
    }

    /// Whether the record is "full" (carries its tag set, even empty) rather than "partial".
    pub fn is_full(&self) -> bool {
        self.tags.is_some()
    }
}

/// The known keys of a wire record, each the LAST value given for it (as a JSON object read
/// into a map keeps it); other keys are parsed and dropped.
#[derive(Default)]
struct WireFields<'a> {
    v: Option<Wire<'a>>,
    run_id: Option<Wire<'a>>,
    env_id: Option<Wire<'a>>,
    tags: Option<Wire<'a>>,
    batch_id: Option<Wire<'a>>,
    updated_at_ms: Option<Wire<'a>>,
}

/// What the decoder needs of one JSON value: a string (borrowed from the message when it has
/// no escapes), a number in serde_json's three kinds, an array of strings only, or anything
/// else (parsed, then dropped).
enum Wire<'a> {
    Str(Cow<'a, str>),
    U64(u64),
    I64(i64),
    F64(f64),
    Strings(Vec<String>),
    Other,
}

impl Wire<'_> {
    fn as_str(&self) -> Option<&str> {
        match self {
            Wire::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A JSON number as `u32`: truncated toward zero, clamped to `0..=u32::MAX` (negative
    /// integers and floats: `as` saturates).
    fn as_u32(&self) -> Option<u32> {
        match *self {
            Wire::U64(u) => Some(u32::try_from(u).unwrap_or(u32::MAX)),
            Wire::I64(i) => Some(i as f64 as u32),
            Wire::F64(f) => Some(f as u32),
            _ => None,
        }
    }

    /// A JSON number as `i64`: integers exactly, floats (and integers past `i64::MAX`)
    /// truncated toward zero, saturating.
    fn as_i64(&self) -> Option<i64> {
        match *self {
            Wire::U64(u) => Some(i64::try_from(u).unwrap_or(u as f64 as i64)),
            Wire::I64(i) => Some(i),
            Wire::F64(f) => Some(f as i64),
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for Wire<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(WireVisitor)
    }
}

struct WireVisitor;

impl<'de> Visitor<'de> for WireVisitor {
    type Value = Wire<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Wire::Other)
    }

    fn visit_u64<E: de::Error>(self, u: u64) -> Result<Self::Value, E> {
        Ok(Wire::U64(u))
    }

    fn visit_i64<E: de::Error>(self, i: i64) -> Result<Self::Value, E> {
        // serde_json hands non-negative integers to `visit_u64`; keep `Value`'s kinds anyway.
        Ok(u64::try_from(i).map_or(Wire::I64(i), Wire::U64))
    }

    fn visit_f64<E: de::Error>(self, f: f64) -> Result<Self::Value, E> {
        Ok(Wire::F64(f))
    }

    fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Wire::Str(Cow::Borrowed(s)))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Wire::Str(Cow::Owned(s.to_owned())))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
        Ok(Wire::Str(Cow::Owned(s)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Wire::Other)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Wire::Other)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        Wire::deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        // Only an array of strings is one; every element is parsed whatever it is.
        let mut strings = Some(Vec::new());
        while let Some(item) = seq.next_element::<Wire>()? {
            match (item, strings.as_mut()) {
                (Wire::Str(s), Some(list)) => list.push(s.into_owned()),
                _ => strings = None,
            }
        }
        Ok(strings.map_or(Wire::Other, Wire::Strings))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<Wire, Wire>()?.is_some() {}
        Ok(Wire::Other)
    }
}

impl<'de> Deserialize<'de> for WireFields<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(FieldsVisitor)
    }
}

struct FieldsVisitor;

impl<'de> Visitor<'de> for FieldsVisitor {
    type Value = WireFields<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a change record object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = WireFields::default();
        while let Some(key) = map.next_key::<Wire>()? {
            let value = map.next_value::<Wire>()?;
            let slot = match key.as_str() {
                Some("v") => &mut fields.v,
                Some("runId") => &mut fields.run_id,
                Some("envId") => &mut fields.env_id,
                Some("tags") => &mut fields.tags,
                Some("batchId") => &mut fields.batch_id,
                Some("updatedAtMs") => &mut fields.updated_at_ms,
                _ => continue,
            };
            *slot = Some(value);
        }
        Ok(fields)
    }
}

#[cfg(test)]
impl ChangeRecord {
    /// A record of run `run` on environment `e` with `tags`, no batch and the watermark
    /// `updated_at_ms` (unit tests of the replay buffer and the coalescer).
    pub(crate) fn test_record(
        run: &str,
        tags: Option<Vec<String>>,
        updated_at_ms: Option<i64>,
    ) -> ChangeRecord {
        ChangeRecord {
            v: 1,
            run_id: run.into(),
            env_id: "e".into(),
            tags,
            batch_id: None,
            updated_at_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn full(run: &str) -> ChangeRecord {
        ChangeRecord {
            v: 1,
            run_id: run.into(),
            env_id: "env_1".into(),
            tags: Some(vec!["a".into()]),
            batch_id: Some("batch_1".into()),
            updated_at_ms: Some(1_000),
        }
    }

    #[test]
    fn channel_name_and_back() {
        assert_eq!(channel_name("env_1"), "realtime:env:{env_1}");
        assert_eq!(env_of_channel("realtime:env:{env_1}"), Some("env_1"));
        assert_eq!(env_of_channel("realtime:env:env_1"), None);
        assert_eq!(env_of_channel("other:{env_1}"), None);
    }

    /// NTF-13: all known fields copied; missing `v` → 0, missing `envId` → "".
    #[test]
    fn ntf13_decode_copies_fields() {
        let r = ChangeRecord::decode(
            br#"{"v":1,"runId":"run_1","envId":"env_1","tags":["a","b"],"batchId":"batch_1","updatedAtMs":1717750000123}"#,
        );
        assert_eq!(
            r,
            ChangeRecord {
                v: 1,
                run_id: "run_1".into(),
                env_id: "env_1".into(),
                tags: Some(vec!["a".into(), "b".into()]),
                batch_id: Some("batch_1".into()),
                updated_at_ms: Some(1_717_750_000_123),
            }
        );

        let r = ChangeRecord::decode(br#"{"runId":"run_1"}"#);
        assert_eq!(
            r,
            ChangeRecord {
                run_id: "run_1".into(),
                ..Default::default()
            }
        );
        assert!(!r.is_full());
    }

    /// NTF-13: present-but-empty tags = full; `batchId: null` = None; float watermark truncated.
    #[test]
    fn ntf13_full_vs_partial_and_null_batch() {
        let r = ChangeRecord::decode(
            br#"{"v":1,"runId":"r","envId":"e","tags":[],"batchId":null,"updatedAtMs":12.9}"#,
        );
        assert_eq!(r.tags, Some(vec![]));
        assert!(r.is_full());
        assert_eq!(r.batch_id, None);
        assert_eq!(r.updated_at_ms, Some(12));

        // Wrong types degrade per field, not per record.
        let r = ChangeRecord::decode(
            br#"{"v":"1","runId":"r","envId":7,"tags":"a","batchId":3,"updatedAtMs":"5"}"#,
        );
        assert_eq!(
            r,
            ChangeRecord {
                run_id: "r".into(),
                ..Default::default()
            }
        );
        let r = ChangeRecord::decode(br#"{"runId":"r","tags":["a",1]}"#);
        assert_eq!(r.tags, None);
        let r = ChangeRecord::decode(br#"{"runId":"r","v":-3}"#);
        assert_eq!(r.v, 0);
        let r = ChangeRecord::decode(br#"{"runId":"r","v":1e20}"#);
        assert_eq!(r.v, u32::MAX);
    }

    /// NTF-13: tags containing commas (and quotes, unicode) survive a round trip.
    #[test]
    fn ntf13_tags_with_commas_round_trip() {
        let r = ChangeRecord {
            tags: Some(vec!["a,b".into(), "c\"d".into(), "é,ü".into(), "".into()]),
            ..full("run_1")
        };
        assert_eq!(ChangeRecord::decode(r.encode().as_bytes()), r);
    }

    /// NTF-14: a bare string degrades to a partial record with the whole text as run id.
    #[test]
    fn ntf14_bare_string() {
        let r = ChangeRecord::decode(b"run_abc");
        assert_eq!(
            r,
            ChangeRecord {
                v: 0,
                run_id: "run_abc".into(),
                ..Default::default()
            }
        );
        assert!(!r.is_full());
        // Leading whitespace is not `{`: bare string, like the webapp's `startsWith("{")`.
        assert_eq!(
            ChangeRecord::decode(b" {\"runId\":\"x\"}").run_id,
            " {\"runId\":\"x\"}"
        );
        assert_eq!(ChangeRecord::decode(b"").run_id, "");
        // Invalid UTF-8 is decoded lossily.
        assert_eq!(ChangeRecord::decode(b"r\xffn").run_id, "r\u{fffd}n");
    }

    /// NTF-15: `{`-prefixed but invalid JSON, or no string runId, degrades too.
    #[test]
    fn ntf15_invalid_json_or_missing_run_id() {
        for raw in [
            &br#"{"runId":"r""#[..],
            br#"{not json"#,
            br#"{"envId":"e"}"#,
            br#"{"runId":5,"envId":"e"}"#,
            br#"{"runId":null}"#,
            br#"{"runId":"r"} trailing"#,
        ] {
            let r = ChangeRecord::decode(raw);
            let text = String::from_utf8_lossy(raw).into_owned();
            assert_eq!(
                r,
                ChangeRecord {
                    v: 0,
                    run_id: text.into(),
                    ..Default::default()
                },
                "{raw:?}"
            );
        }
    }

    #[test]
    fn encode_key_order_like_json_stringify() {
        assert_eq!(
            full("run_1").encode(),
            r#"{"v":1,"runId":"run_1","envId":"env_1","tags":["a"],"batchId":"batch_1","updatedAtMs":1000}"#
        );
        // Lifecycle-bus record: full, no batch, no watermark (PUB-03).
        let r = ChangeRecord {
            batch_id: None,
            updated_at_ms: None,
            ..full("run_1")
        };
        assert_eq!(
            r.encode(),
            r#"{"v":1,"runId":"run_1","envId":"env_1","tags":["a"],"batchId":null}"#
        );
        // Partial record: only what is known.
        let r = ChangeRecord {
            v: 0,
            run_id: "r".into(),
            ..Default::default()
        };
        assert_eq!(r.encode(), r#"{"v":1,"runId":"r","envId":""}"#);
        let r = ChangeRecord {
            run_id: "r".into(),
            batch_id: Some("b".into()),
            updated_at_ms: Some(-5),
            ..Default::default()
        };
        assert_eq!(
            r.encode(),
            r#"{"v":1,"runId":"r","envId":"","batchId":"b","updatedAtMs":-5}"#
        );
    }

    #[test]
    fn merge_keeps_highest_watermark_and_known_fields() {
        // Terminal record (watermark) followed by a lifecycle-bus record (no watermark).
        let mut a = full("r");
        a.merge_from(ChangeRecord {
            updated_at_ms: None,
            batch_id: None,
            ..full("r")
        });
        assert_eq!(a.updated_at_ms, Some(1_000));
        assert_eq!(a.batch_id, Some("batch_1".into()));

        // Later watermark wins when higher.
        let mut a = full("r");
        a.merge_from(ChangeRecord {
            updated_at_ms: Some(2_000),
            ..full("r")
        });
        assert_eq!(a.updated_at_ms, Some(2_000));
        let mut a = ChangeRecord {
            updated_at_ms: Some(3_000),
            ..full("r")
        };
        a.merge_from(full("r"));
        assert_eq!(a.updated_at_ms, Some(3_000));
    }

    #[test]
    fn merged_tags_keep_every_feed_either_record_was_a_candidate_for() {
        // Two full sets: the union, in either arrival order (a late record of an earlier
        // version carries the older set).
        let mut a = full("r");
        a.merge_from(ChangeRecord {
            tags: Some(vec!["a".into(), "b".into()]),
            ..full("r")
        });
        assert_eq!(a.tags, Some(vec!["a".into(), "b".into()]));
        let mut a = ChangeRecord {
            tags: Some(vec!["a".into(), "b".into()]),
            ..full("r")
        };
        a.merge_from(full("r"));
        assert_eq!(a.tags, Some(vec!["a".into(), "b".into()]));
        // A partial record (no tags) makes the merge partial, in either order: every tag feed
        // stays a candidate and the hydrated row decides.
        let mut a = full("r");
        a.merge_from(ChangeRecord::decode(b"r"));
        assert_eq!(a.tags, None);
        assert_eq!(a.v, 1);
        assert_eq!(a.env_id, "env_1");
        let mut a = ChangeRecord::decode(b"r");
        a.merge_from(full("r"));
        assert_eq!(a.tags, None);
        assert_eq!(a.updated_at_ms, full("r").updated_at_ms);
        // Later known batch id wins; empty later tags are still a full set.
        let mut a = full("r");
        a.merge_from(ChangeRecord {
            tags: Some(vec![]),
            batch_id: Some("b2".into()),
            ..full("r")
        });
        assert_eq!(a.tags, Some(vec!["a".into()]));
        assert_eq!(a.batch_id, Some("b2".into()));
    }

    fn arb_record() -> impl Strategy<Value = ChangeRecord> {
        (
            any::<String>(),
            any::<String>(),
            proptest::option::of(proptest::collection::vec(any::<String>(), 0..4)),
            proptest::option::of(any::<String>()),
            proptest::option::of(any::<i64>()),
        )
            .prop_map(
                |(run_id, env_id, tags, batch_id, updated_at_ms)| ChangeRecord {
                    v: 1,
                    run_id: run_id.into(),
                    env_id: env_id.into(),
                    tags,
                    batch_id: batch_id.map(Into::into),
                    updated_at_ms,
                },
            )
    }

    /// The decoder as it read records through a `serde_json::Value` tree: the reference the
    /// field-by-field decoder must match on every input.
    fn decode_through_value(payload: &[u8]) -> ChangeRecord {
        fn number_as_u32(v: &Value) -> Option<u32> {
            if let Some(u) = v.as_u64() {
                return Some(u32::try_from(u).unwrap_or(u32::MAX));
            }
            v.as_f64().map(|f| f as u32)
        }
        fn number_as_i64(v: &Value) -> Option<i64> {
            v.as_i64().or_else(|| v.as_f64().map(|f| f as i64))
        }
        fn string_array(v: &Value) -> Option<Vec<String>> {
            v.as_array()?
                .iter()
                .map(|t| t.as_str().map(str::to_owned))
                .collect()
        }
        if payload.first() != Some(&b'{') {
            return ChangeRecord::degraded(payload);
        }
        let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(payload) else {
            return ChangeRecord::degraded(payload);
        };
        let Some(run_id) = obj.get("runId").and_then(Value::as_str) else {
            return ChangeRecord::degraded(payload);
        };
        ChangeRecord {
            v: obj.get("v").and_then(number_as_u32).unwrap_or(0),
            run_id: RunId::new(run_id),
            env_id: EnvId::new(obj.get("envId").and_then(Value::as_str).unwrap_or("")),
            tags: obj.get("tags").and_then(string_array),
            batch_id: obj.get("batchId").and_then(Value::as_str).map(BatchId::new),
            updated_at_ms: obj.get("updatedAtMs").and_then(number_as_i64),
        }
    }

    /// Edge cases of the field-by-field decoder, each as the `Value` reading decoded it: the
    /// last of repeated keys wins, escaped keys and values, numbers of every kind and range,
    /// nested values under unknown keys, and invalid JSON anywhere (even in an unknown key).
    #[test]
    fn decode_reads_each_field_as_a_json_value_would() {
        for raw in [
            &br#"{"runId":"a","runId":"b"}"#[..],
            br#"{"runId":"a","runId":5}"#,
            br#"{"runId":5,"runId":"a"}"#,
            br#"{"run\u0049d":"x\ny","envId":"e\"1"}"#,
            br#"{"runId":"r","v":18446744073709551615,"updatedAtMs":18446744073709551615}"#,
            br#"{"runId":"r","v":-0,"updatedAtMs":-0}"#,
            br#"{"runId":"r","v":4294967296,"updatedAtMs":-9223372036854775808}"#,
            br#"{"runId":"r","v":1.9,"updatedAtMs":-1.9e300}"#,
            br#"{"runId":"r","updatedAtMs":1e400}"#,
            br#"{"runId":"r","other":1e400}"#,
            br#"{"runId":"r","other":{"a":[1,{"b":null}],"c":"\ud800"}}"#,
            br#"{"runId":"r","other":"\x"}"#,
            br#"{"runId":"r","tags":["a",["b"]]}"#,
            br#"{"runId":"r","tags":["a","b"],"tags":[]}"#,
            br#"{"runId":"r","tags":{"a":"b"}}"#,
            br#"{"runId":"r","batchId":"b","batchId":null}"#,
            br#"{"runId":"r","envId":true}"#,
            br#"{"runId":"r"}  "#,
            br#"{"runId":"r"},"#,
            br#"{"runId":"r","#,
            br#"{}"#,
        ] {
            assert_eq!(
                ChangeRecord::decode(raw),
                decode_through_value(raw),
                "{}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn decode_matches_the_value_reading(s in r#"\{ ?(("(v|runId|envId|tags|batchId|updatedAtMs|x)"|"run\\u0049d") ?: ?(-?[0-9]{1,21}(\.[0-9]{1,3})?(e-?[0-9]{1,3})?|"([a-z,]|\\n|\\"|\\u00e9)*"|null|true|\[(("[a-z]*"|[0-9]|\{\}),?){0,3}\]|\{("k":[0-9],?)?\}),?){0,8}\}?"#) {
            prop_assert_eq!(ChangeRecord::decode(s.as_bytes()), decode_through_value(s.as_bytes()));
        }

        #[test]
        fn decode_matches_the_value_reading_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut framed = b"{\"runId\":\"r\",".to_vec();
            framed.extend_from_slice(&bytes);
            prop_assert_eq!(ChangeRecord::decode(&framed), decode_through_value(&framed));
        }

        #[test]
        fn decode_matches_the_value_reading_on_records(r in arb_record()) {
            let text = r.encode();
            prop_assert_eq!(ChangeRecord::decode(text.as_bytes()), decode_through_value(text.as_bytes()));
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let r = ChangeRecord::decode(&bytes);
            // Whatever came in, the result is a record we can re-encode.
            let _ = r.encode();
        }

        #[test]
        fn decode_never_panics_on_json_ish(s in r#"\{("(v|runId|envId|tags|batchId|updatedAtMs)":(-?[0-9.e]{1,6}|"[a-z,]*"|null|\[("[a-z]*",?)*\]|true),?){0,6}\}?"#) {
            let _ = ChangeRecord::decode(s.as_bytes());
        }

        #[test]
        fn encode_decode_round_trip(r in arb_record()) {
            prop_assert_eq!(ChangeRecord::decode(r.encode().as_bytes()), r);
        }
    }
}
