//! Value encoding: one [`RunRow`] → its `value` object for a column set, serialized once.
//!
//! The bytes produced here are what trigger.dev's `electricStreamProtocol.server.ts` emits for a
//! run (docs/trigger-dev.md §1.4, docs/behaviours.md SER-01…SER-11), and what `@electric-sql/client` 1.0.14
//! parses with the `electric-schema` header (docs/protocol.md §3.6–3.7).

use std::fmt::Write as _;
use std::sync::Arc;

use bytes::Bytes;
use chrono::{DateTime, Datelike, Timelike};

use super::{Column, ColumnSet, RunMeta, RunRow, SerializedRow};

/// Serializes `row` for `cols` into a [`SerializedRow`] (fragment, hash, dequeued flag).
/// Encoding rules: docs/protocol.md §3.6–3.7, docs/trigger-dev.md §1.4 (timestamps `YYYY-MM-DDTHH:MM:SS.mmm`
/// without zone, bool `t`/`f`, int4 decimal, float8 as JS `String(number)`, `text[]` as a quoted
/// array literal with `runTags` empty → null and `realtimeStreams` empty/null → `{}`, jsonb as
/// compact JSON, nulls as JSON null).
///
/// The fragment is
/// `{"key":"\"public\".\"TaskRun\"/\"<id>\"","value":{…},"headers":{"operation":"` — the body
/// builder ([`crate::protocol::body`]) appends the operation. `value_hash` is a 64-bit FNV-1a of
/// the `value` object's bytes (fixed key: stable across processes and restarts).
pub fn serialize_row(row: &RunRow, cols: ColumnSet) -> SerializedRow {
    let mut buf: Vec<u8> = Vec::with_capacity(
        256 + row.payload.len()
            + row.output.as_ref().map_or(0, String::len)
            + row.metadata.as_ref().map_or(0, String::len),
    );

    // The key `"public"."TaskRun"/"<id>"` as a JSON string, escaped as it is written.
    buf.extend_from_slice(br#"{"key":"\"public\".\"TaskRun\"/\""#);
    push_json_contents(&mut buf, &row.id);
    buf.extend_from_slice(br#"\"","value":"#);

    let value_start = buf.len();
    buf.push(b'{');
    let mut first = true;
    for col in cols.columns() {
        if !first {
            buf.push(b',');
        }
        first = false;
        buf.push(b'"');
        buf.extend_from_slice(col.name().as_bytes());
        buf.extend_from_slice(b"\":");
        push_column_value(&mut buf, row, col);
    }
    buf.push(b'}');
    let value_hash = fnv1a64(&buf[value_start..]);

    buf.extend_from_slice(b",\"headers\":{\"operation\":\"");

    SerializedRow {
        meta: Arc::new(RunMeta::of(row)),
        fragment: Bytes::from(buf),
        value_hash,
        dequeued: cols.contains(Column::Status) && row.status == "DEQUEUED",
    }
}

/// The `electric-schema` header value for `cols`: `{"id":{"type":"text"},…,"runTags":{"type":"text","dims":1},…}`.
///
/// Types come from [`Column::electric_type`] (trigger's `RUN_ELECTRIC_COLUMNS`); array columns add
/// `"dims":1`; `not_null` is never sent (a null under `not_null` is fatal in the client,
/// docs/protocol.md §3.6). Skipped columns are absent (SER-08/SER-09).
pub fn schema_header(cols: ColumnSet) -> String {
    let mut out = String::with_capacity(40 * 26);
    out.push('{');
    let mut first = true;
    for col in cols.columns() {
        if !first {
            out.push(',');
        }
        first = false;
        out.push('"');
        out.push_str(col.name());
        out.push_str("\":{\"type\":\"");
        out.push_str(col.electric_type());
        out.push('"');
        if let Some(dims) = col.dims() {
            let _ = write!(out, ",\"dims\":{dims}");
        }
        out.push('}');
    }
    out.push('}');
    out
}

/// Formats epoch milliseconds (UTC) as `YYYY-MM-DDTHH:MM:SS.mmm` — ISO-8601 with milliseconds and
/// **no zone suffix** (the SDK appends `Z` itself; SER-04, docs/protocol.md §3.7). `None` when the
/// instant is outside chrono's range (never for real `timestamp(3)` values).
pub fn format_timestamp_ms(ms: i64) -> Option<String> {
    let dt = DateTime::from_timestamp_millis(ms)?;
    if let Some(digits) = four_digit_year_timestamp(&dt) {
        return Some(digits.iter().map(|b| char::from(*b)).collect());
    }
    // Outside four-digit years: chrono's signed year form; no client can meet these anyway.
    Some(dt.format("%Y-%m-%dT%H:%M:%S%.3f").to_string())
}

/// `YYYY-MM-DD'T'HH:MM:SS.mmm` of `dt`, digits written in place (every serialized row has
/// several timestamps); `None` outside years 0..=9999.
fn four_digit_year_timestamp(dt: &DateTime<chrono::Utc>) -> Option<[u8; 23]> {
    let year = dt.year();
    if let Ok(year @ 0..=9999) = u32::try_from(year) {
        // `YYYY-MM-DD'T'HH:MM:SS.mmm`, digits written in place (every serialized row has
        // several timestamps).
        let mut out = *b"0000-00-00T00:00:00.000";
        for (range, value) in [
            (0..4, year),
            (5..7, dt.month()),
            (8..10, dt.day()),
            (11..13, dt.hour()),
            (14..16, dt.minute()),
            (17..19, dt.second()),
            (20..23, dt.timestamp_subsec_millis().min(999)),
        ] {
            let mut rest = value;
            for digit in out[range].iter_mut().rev() {
                *digit = b'0' + (rest % 10) as u8;
                rest /= 10;
            }
        }
        return Some(out);
    }
    None
}

/// Formats a float8 exactly like JavaScript `String(number)` (SER-02, docs/trigger-dev.md §1.4):
/// `0`, `0.55`, `1e-7`, `1e+21`, `-0` → `0`, `NaN`, `Infinity`.
pub fn format_js_number(f: f64) -> String {
    if f == 0.0 {
        // Covers -0: JS `String(-0)` is "0".
        return "0".to_string();
    }
    ryu_js::Buffer::new().format(f).to_string()
}

/// Builds the Postgres array literal trigger emits for a `text[]` column: every element
/// double-quoted, `\` → `\\`, `"` → `\"`, joined with `,`, wrapped in `{}` (docs/trigger-dev.md §1.4,
/// SER-07). An empty slice gives `{}`.
pub fn encode_text_array<S: AsRef<str>>(items: &[S]) -> String {
    let mut out =
        String::with_capacity(2 + items.iter().map(|s| s.as_ref().len() + 3).sum::<usize>());
    out.push('{');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push('"');
        for ch in item.as_ref().chars() {
            if ch == '\\' || ch == '"' {
                out.push('\\');
            }
            out.push(ch);
        }
        out.push('"');
    }
    out.push('}');
    out
}

/// Appends `s` as a JSON string literal, escaped like `JSON.stringify` (`"`, `\`, the short
/// escapes `\b \f \n \r \t`, other C0 controls as `\u00xx`; everything else raw UTF-8).
pub fn push_json_string(buf: &mut Vec<u8>, s: &str) {
    buf.push(b'"');
    push_json_contents(buf, s);
    buf.push(b'"');
}

/// What [`push_json_contents`] writes for each byte: 0 = the byte itself, `u` = `\u00xx`,
/// anything else = a backslash and that byte.
const ESCAPE: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut b = 0;
    while b < 0x20 {
        table[b] = b'u';
        b += 1;
    }
    table[0x08] = b'b';
    table[0x09] = b't';
    table[0x0a] = b'n';
    table[0x0c] = b'f';
    table[0x0d] = b'r';
    table[b'"' as usize] = b'"';
    table[b'\\' as usize] = b'\\';
    table
};

/// Whether any of the 8 bytes of `word` needs an escape: a C0 control, `"` or `\`
/// (word-at-a-time tests, exact for "any byte": bytes ≥ 0x80 never match).
fn word_needs_escape(word: u64) -> bool {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let has_zero = |x: u64| x.wrapping_sub(LO) & !x & HI;
    let below_space = word.wrapping_sub(LO * 0x20) & !word & HI;
    (below_space
        | has_zero(word ^ (LO * u64::from(b'"')))
        | has_zero(word ^ (LO * u64::from(b'\\'))))
        != 0
}

/// Appends the inside of `s`'s JSON string literal (no quotes), escaped as
/// [`push_json_string`] says. Runs without escapes are copied whole, found 8 bytes at a time.
fn push_json_contents(buf: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        if let Some(word) = bytes.get(i..i + 8) {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            if !word_needs_escape(u64::from_le_bytes(w)) {
                i += 8;
                continue;
            }
        }
        // A word with an escape (or the tail): byte by byte up to the next word boundary.
        let end = (i + 8).min(bytes.len());
        while i < end {
            let b = bytes[i];
            let esc = ESCAPE[usize::from(b)];
            if esc != 0 {
                buf.extend_from_slice(&bytes[start..i]);
                if esc == b'u' {
                    buf.extend_from_slice(b"\\u00");
                    buf.push(HEX[usize::from(b >> 4)]);
                    buf.push(HEX[usize::from(b & 0xf)]);
                } else {
                    buf.push(b'\\');
                    buf.push(esc);
                }
                start = i + 1;
            }
            i += 1;
        }
    }
    buf.extend_from_slice(&bytes[start..]);
}

/// Appends `n` as a JSON string of its decimal digits.
fn push_quoted_int(buf: &mut Vec<u8>, n: i32) {
    buf.push(b'"');
    buf.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    buf.push(b'"');
}

/// Appends `f` as a JSON string of [`format_js_number`]'s text (digits, `.`, `e`, signs,
/// `NaN`, `Infinity`: nothing to escape).
fn push_quoted_js_number(buf: &mut Vec<u8>, f: f64) {
    buf.push(b'"');
    if f == 0.0 {
        // Covers -0: JS `String(-0)` is "0".
        buf.push(b'0');
    } else {
        buf.extend_from_slice(ryu_js::Buffer::new().format(f).as_bytes());
    }
    buf.push(b'"');
}

fn push_opt_str(buf: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(s) => push_json_string(buf, s),
        None => buf.extend_from_slice(b"null"),
    }
}

fn push_timestamp(buf: &mut Vec<u8>, ms: Option<i64>) {
    let Some(dt) = ms.and_then(DateTime::from_timestamp_millis) else {
        buf.extend_from_slice(b"null");
        return;
    };
    match four_digit_year_timestamp(&dt) {
        Some(digits) => {
            buf.push(b'"');
            buf.extend_from_slice(&digits);
            buf.push(b'"');
        }
        None => push_opt_str(buf, ms.and_then(format_timestamp_ms).as_deref()),
    }
}

fn push_column_value(buf: &mut Vec<u8>, row: &RunRow, col: Column) {
    match col {
        Column::Id => push_json_string(buf, &row.id),
        Column::TaskIdentifier => push_json_string(buf, &row.task_identifier),
        Column::CreatedAt => push_timestamp(buf, Some(row.created_at_ms)),
        Column::UpdatedAt => push_timestamp(buf, Some(row.updated_at_ms)),
        Column::StartedAt => push_timestamp(buf, row.started_at_ms),
        Column::DelayUntil => push_timestamp(buf, row.delay_until_ms),
        Column::QueuedAt => push_timestamp(buf, row.queued_at_ms),
        Column::ExpiredAt => push_timestamp(buf, row.expired_at_ms),
        Column::CompletedAt => push_timestamp(buf, row.completed_at_ms),
        Column::FriendlyId => push_json_string(buf, &row.friendly_id),
        Column::Number => push_quoted_int(buf, row.number),
        Column::IsTest => buf.extend_from_slice(if row.is_test { b"\"t\"" } else { b"\"f\"" }),
        Column::Status => push_json_string(buf, &row.status),
        Column::UsageDurationMs => push_quoted_int(buf, row.usage_duration_ms),
        Column::CostInCents => push_quoted_js_number(buf, row.cost_in_cents),
        Column::BaseCostInCents => push_quoted_js_number(buf, row.base_cost_in_cents),
        Column::Ttl => push_opt_str(buf, row.ttl.as_deref()),
        Column::Payload => push_json_string(buf, &row.payload),
        Column::PayloadType => push_json_string(buf, &row.payload_type),
        Column::Metadata => push_opt_str(buf, row.metadata.as_deref()),
        Column::MetadataType => push_json_string(buf, &row.metadata_type),
        Column::Output => push_opt_str(buf, row.output.as_deref()),
        Column::OutputType => push_json_string(buf, &row.output_type),
        Column::RunTags => match row.run_tags.as_deref() {
            // `emptyArrayAsNull`: the column has no default, so empty and NULL are both null.
            None | Some([]) => buf.extend_from_slice(b"null"),
            Some(tags) => push_json_string(buf, &encode_text_array(tags)),
        },
        Column::Error => match &row.error {
            None => buf.extend_from_slice(b"null"),
            // serde_json (preserve_order) writes compact JSON in jsonb key order, like
            // `JSON.stringify`. Serializing a `Value` cannot fail; fall back to null regardless.
            Some(v) => match serde_json::to_string(v) {
                Ok(text) => push_json_string(buf, &text),
                Err(_) => buf.extend_from_slice(b"null"),
            },
        },
        Column::RealtimeStreams => {
            let streams: &[String] = row.realtime_streams.as_deref().unwrap_or(&[]);
            push_json_string(buf, &encode_text_array(streams));
        }
    }
}

/// 64-bit FNV-1a (fixed offset basis and prime: deterministic everywhere).
fn fnv1a64(bytes: &[u8]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    // Eight bytes a step (the same byte-serial hash, with less loop overhead).
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        for &b in chunk {
            h ^= u64::from(b);
            h = h.wrapping_mul(PRIME);
        }
    }
    for &b in chunks.remainder() {
        h ^= u64::from(b);
        h = h.wrapping_mul(PRIME);
    }
    h
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    /// A fully populated row for tests.
    pub(crate) fn sample_row() -> RunRow {
        RunRow {
            id: "cm_run_1".into(),
            task_identifier: "my-task".into(),
            created_at_ms: 1_735_689_602_000, // 2025-01-01T00:00:02.000Z
            updated_at_ms: 1_735_689_603_456,
            started_at_ms: Some(1_735_689_602_789),
            delay_until_ms: None,
            queued_at_ms: Some(0),
            expired_at_ms: None,
            completed_at_ms: None,
            friendly_id: "run_abc".into(),
            number: 42,
            is_test: false,
            status: "EXECUTING".into(),
            usage_duration_ms: 1234,
            cost_in_cents: 0.55,
            base_cost_in_cents: 0.0,
            ttl: Some("10m".into()),
            payload: "{\"hello\":\"world\"}".into(),
            payload_type: "application/json".into(),
            metadata: None,
            metadata_type: "application/json".into(),
            output: None,
            output_type: "application/json".into(),
            run_tags: Some(vec!["user:1".into(), "a,b".into()]),
            error: None,
            realtime_streams: None,
            batch_id: None,
        }
    }

    /// Parses `fragment + insert"}}` back as JSON.
    fn message(s: &SerializedRow) -> Value {
        let mut bytes = s.fragment.to_vec();
        bytes.extend_from_slice(b"insert\"}}");
        serde_json::from_slice(&bytes).expect("fragment is valid JSON")
    }

    /// The texts of `cols` in `v` (`?` for a column that is not a JSON string).
    fn texts<'a>(v: &'a serde_json::Map<String, Value>, cols: &[&str]) -> Vec<&'a str> {
        cols.iter()
            .map(|c| v.get(*c).and_then(Value::as_str).unwrap_or("?"))
            .collect()
    }

    fn value_of(row: &RunRow) -> serde_json::Map<String, Value> {
        match message(&serialize_row(row, ColumnSet::ALL)).get("value") {
            Some(Value::Object(m)) => m.clone(),
            other => panic!("no value object: {other:?}"),
        }
    }

    /// Electric client's `pgArrayParser` (`@electric-sql/client` parser.ts, docs/protocol.md §3.6),
    /// ported literally: quotes, `\` escapes the next char, unquoted `NULL` → null.
    fn electric_parse_array(x: &str) -> Option<Vec<Option<String>>> {
        let chars: Vec<char> = x.chars().collect();
        let mut quoted = false;
        let mut prev: Option<char> = None;
        let mut s = String::new();
        let extract = |start: usize, end: usize| -> Option<String> {
            let v: String = chars[start..end.min(chars.len())].iter().collect();
            (v != "NULL").then_some(v)
        };
        // Only flat arrays are produced by the encoder; the top level is `{ … }`.
        if chars.first() != Some(&'{') {
            return None;
        }
        let mut i = 1usize;
        let mut last = 1usize;
        let mut xs = Vec::new();
        while i < chars.len() {
            let c = chars[i];
            if quoted {
                if c == '\\' {
                    i += 1;
                    s.push(*chars.get(i)?);
                } else if c == '"' {
                    xs.push(Some(std::mem::take(&mut s)));
                    quoted = chars.get(i + 1) == Some(&'"');
                    last = i + 2;
                } else {
                    s.push(c);
                }
            } else if c == '"' {
                quoted = true;
            } else if c == '{' {
                return None; // nested arrays never produced
            } else if c == '}' {
                if last < i {
                    xs.push(extract(last, i));
                }
                return Some(xs);
            } else if c == ',' && prev != Some('}') && prev != Some('"') {
                xs.push(extract(last, i));
                last = i + 1;
            }
            prev = Some(c);
            i += 1;
        }
        None
    }

    #[test]
    fn ser_01_value_has_26_columns_in_wire_order() {
        let v = value_of(&sample_row());
        let keys: Vec<&str> = v.keys().map(String::as_str).collect();
        let expected: Vec<&str> = Column::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(keys, expected);
        assert!(v.values().all(|x| x.is_string() || x.is_null()));
    }

    #[test]
    fn ser_02_numbers_as_strings() {
        let v = value_of(&sample_row());
        let numbers = [
            "number",
            "usageDurationMs",
            "costInCents",
            "baseCostInCents",
        ];
        assert_eq!(texts(&v, &numbers), ["42", "1234", "0.55", "0"]);
        let mut row = sample_row();
        row.number = -7;
        assert_eq!(value_of(&row)["number"], json!("-7"));
    }

    #[test]
    fn ser_02_float8_matches_js_string() {
        assert_eq!(format_js_number(0.0), "0");
        assert_eq!(format_js_number(-0.0), "0");
        assert_eq!(format_js_number(0.55), "0.55");
        assert_eq!(format_js_number(1e-7), "1e-7");
        assert_eq!(format_js_number(1e21), "1e+21");
        assert_eq!(format_js_number(1e20), "100000000000000000000");
        assert_eq!(format_js_number(123.0), "123");
        assert_eq!(format_js_number(-1.5), "-1.5");
        assert_eq!(format_js_number(0.1 + 0.2), "0.30000000000000004");
        assert_eq!(format_js_number(f64::NAN), "NaN");
        assert_eq!(format_js_number(f64::INFINITY), "Infinity");
    }

    #[test]
    fn ser_03_booleans_t_f() {
        let mut row = sample_row();
        assert_eq!(value_of(&row)["isTest"], json!("f"));
        row.is_test = true;
        assert_eq!(value_of(&row)["isTest"], json!("t"));
    }

    #[test]
    fn ser_04_timestamps_without_zone() {
        let v = value_of(&sample_row());
        assert_eq!(
            texts(&v, &["createdAt", "updatedAt", "startedAt", "queuedAt"]),
            [
                "2025-01-01T00:00:02.000",
                "2025-01-01T00:00:03.456",
                "2025-01-01T00:00:02.789",
                "1970-01-01T00:00:00.000"
            ]
        );
        assert_eq!(
            format_timestamp_ms(-1).as_deref(),
            Some("1969-12-31T23:59:59.999")
        );
        assert_eq!(format_timestamp_ms(i64::MAX), None);
    }

    #[test]
    fn ser_05_nulls_are_json_null() {
        let v = value_of(&sample_row());
        for col in [
            "delayUntil",
            "expiredAt",
            "completedAt",
            "metadata",
            "output",
            "error",
        ] {
            assert_eq!(v[col], Value::Null, "{col}");
        }
        assert_eq!(v["ttl"], json!("10m"));
    }

    #[test]
    fn ser_06_error_is_compact_json_text_in_key_order() {
        let mut row = sample_row();
        row.error =
            Some(json!({"type": "STRING_ERROR", "raw": "boom", "nested": {"z": 1, "a": [1, 2]}}));
        let v = value_of(&row);
        assert_eq!(
            v["error"],
            json!(r#"{"type":"STRING_ERROR","raw":"boom","nested":{"z":1,"a":[1,2]}}"#)
        );
    }

    #[test]
    fn ser_07_runtags_empty_is_null() {
        let mut row = sample_row();
        row.run_tags = Some(vec![]);
        assert_eq!(value_of(&row)["runTags"], Value::Null);
        row.run_tags = None;
        assert_eq!(value_of(&row)["runTags"], Value::Null);
    }

    #[test]
    fn ser_07_realtime_streams_empty_is_braces() {
        let mut row = sample_row();
        assert_eq!(value_of(&row)["realtimeStreams"], json!("{}"));
        row.realtime_streams = Some(vec![]);
        assert_eq!(value_of(&row)["realtimeStreams"], json!("{}"));
        row.realtime_streams = Some(vec!["default".into(), "logs".into()]);
        assert_eq!(
            value_of(&row)["realtimeStreams"],
            json!(r#"{"default","logs"}"#)
        );
    }

    #[test]
    fn ser_07_array_literal_quotes_and_escapes() {
        let tags = ["a,b", "c\"d", "e\\f", "", "NULL"];
        let lit = encode_text_array(&tags);
        assert_eq!(lit, r#"{"a,b","c\"d","e\\f","","NULL"}"#);
        let parsed = electric_parse_array(&lit).expect("parses");
        let expected: Vec<Option<String>> = tags.iter().map(|t| Some(t.to_string())).collect();
        assert_eq!(parsed, expected);
        let mut row = sample_row();
        row.run_tags = Some(vec!["user:1".into(), "a,b".into()]);
        assert_eq!(value_of(&row)["runTags"], json!(r#"{"user:1","a,b"}"#));
    }

    #[test]
    fn ser_08_skipped_columns_absent_from_value_and_schema() {
        let cols = ColumnSet::from_skip_list(["payload", "output", "id"]);
        let s = serialize_row(&sample_row(), cols);
        let msg = message(&s);
        let v = msg["value"].as_object().expect("object");
        assert!(!v.contains_key("payload"));
        assert!(!v.contains_key("output"));
        assert!(v.contains_key("id"));
        assert_eq!(v.len(), 24);
        let schema: Value = serde_json::from_str(&schema_header(cols)).expect("json");
        let schema = schema.as_object().expect("object");
        assert!(!schema.contains_key("payload"));
        assert_eq!(schema.len(), 24);
    }

    #[test]
    fn ser_09_schema_header_types_and_dims() {
        let text = schema_header(ColumnSet::ALL);
        let schema: serde_json::Map<String, Value> = serde_json::from_str(&text).expect("json");
        let keys: Vec<&str> = schema.keys().map(String::as_str).collect();
        let expected: Vec<&str> = Column::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(keys, expected);
        assert_eq!(schema["id"], json!({"type": "text"}));
        assert_eq!(schema["createdAt"], json!({"type": "timestamp"}));
        assert_eq!(schema["number"], json!({"type": "int4"}));
        assert_eq!(schema["isTest"], json!({"type": "bool"}));
        assert_eq!(schema["costInCents"], json!({"type": "float8"}));
        assert_eq!(schema["error"], json!({"type": "jsonb"}));
        assert_eq!(schema["runTags"], json!({"type": "text", "dims": 1}));
        assert_eq!(
            schema["realtimeStreams"],
            json!({"type": "text", "dims": 1})
        );
        assert!(!text.contains("not_null"));
    }

    #[test]
    fn ser_11_key_is_quoted_relation_and_id() {
        let s = serialize_row(&sample_row(), ColumnSet::ALL);
        assert!(s.fragment.starts_with(
            br#"{"key":"\"public\".\"TaskRun\"/\"cm_run_1\"","value":{"id":"cm_run_1","#
        ));
        assert!(s.fragment.ends_with(br#"},"headers":{"operation":""#));
        assert_eq!(
            message(&s)["key"],
            json!("\"public\".\"TaskRun\"/\"cm_run_1\"")
        );
    }

    #[test]
    fn key_escapes_the_id_inside_the_quoted_relation_and_id() {
        let mut row = sample_row();
        row.id = "r\"1\\\n".into();
        let s = serialize_row(&row, ColumnSet::ALL);
        let key = format!("\"public\".\"TaskRun\"/\"{}\"", row.id);
        assert_eq!(message(&s)["key"], json!(key));
        let mut expected = b"{\"key\":".to_vec();
        push_json_string(&mut expected, &key);
        assert!(s.fragment.starts_with(&expected));
    }

    #[test]
    fn text_values_are_json_escaped_raw_text() {
        let mut row = sample_row();
        row.payload = "line1\nline2 \"q\" \\ \u{1} \u{7f} é 😀".into();
        assert_eq!(value_of(&row)["payload"], json!(row.payload));
    }

    #[test]
    fn dequeued_flag_and_hash() {
        let mut row = sample_row();
        let a = serialize_row(&row, ColumnSet::ALL);
        assert!(!a.dequeued);
        row.status = "DEQUEUED".into();
        let b = serialize_row(&row, ColumnSet::ALL);
        assert!(b.dequeued);
        assert_ne!(a.value_hash, b.value_hash);
        assert_eq!(b.value_hash, serialize_row(&row, ColumnSet::ALL).value_hash);
        assert_eq!(b.meta.id, "cm_run_1");
        assert_eq!(b.meta.tags, vec!["user:1".to_string(), "a,b".to_string()]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The in-place digits write what chrono's formatter writes, for every four-digit year.
        #[test]
        fn timestamps_match_chronos_format(ms in -62_167_219_200_000i64..253_402_300_800_000) {
            let dt = DateTime::from_timestamp_millis(ms).expect("in range");
            prop_assert_eq!(
                format_timestamp_ms(ms),
                Some(dt.format("%Y-%m-%dT%H:%M:%S%.3f").to_string())
            );
        }

        /// Escaping writes what serde_json (and `JSON.stringify`) writes, whatever run of
        /// escapes and plain bytes falls on the 8-byte steps.
        #[test]
        fn json_strings_are_escaped_like_serde_json(
            s in "[\\x00-\\x1f\"\\\\a-z\\x7fé😀]{0,40}",
            plain in "[a-z]{0,9}",
        ) {
            for text in [s.clone(), format!("{plain}{s}"), format!("{s}{plain}{s}")] {
                let mut buf = Vec::new();
                push_json_string(&mut buf, &text);
                let expected = serde_json::to_string(&text).expect("a string serializes");
                prop_assert_eq!(String::from_utf8(buf).expect("utf-8"), expected);
            }
        }

        /// Numbers are written in place as the text of their formatters.
        #[test]
        fn numbers_are_written_as_their_text(n in any::<i32>(), f in any::<f64>()) {
            let mut buf = Vec::new();
            push_quoted_int(&mut buf, n);
            prop_assert_eq!(String::from_utf8(buf).expect("utf-8"), format!("\"{n}\""));
            let mut buf = Vec::new();
            push_quoted_js_number(&mut buf, f);
            prop_assert_eq!(String::from_utf8(buf).expect("utf-8"), format!("\"{}\"", format_js_number(f)));
        }

        #[test]
        fn ser_07_array_literal_round_trips_through_electric_parser(
            tags in proptest::collection::vec(any::<String>(), 0..6)
        ) {
            let lit = encode_text_array(&tags);
            let parsed = electric_parse_array(&lit);
            let expected: Vec<Option<String>> = tags.iter().cloned().map(Some).collect();
            prop_assert_eq!(parsed, Some(expected));
        }

        #[test]
        fn fragment_is_always_valid_json(
            payload in any::<String>(),
            tags in proptest::collection::vec(any::<String>(), 0..4),
            cost in any::<f64>(),
        ) {
            let mut row = sample_row();
            row.payload = payload.clone();
            row.run_tags = Some(tags);
            row.cost_in_cents = cost;
            let v = value_of(&row);
            prop_assert_eq!(&v["payload"], &json!(payload));
        }
    }
}
