//! Server-sent events framing for Electric's SSE live mode (pure).
//!
//! Framing per the WHATWG HTML standard, "Server-sent events" (§9.2): an event is one or more
//! `data:` lines ended by a blank line; a line starting with `:` is a comment that clients
//! ignore (used as the keep-alive). Electric's SSE mode sends one JSON message per `data:`
//! event (<https://electric-sql.com/docs/api/http>, electric-sql/electric PR #2544), and its
//! `up-to-date` control message carries `headers.global_last_seen_lsn`, from which
//! `@electric-sql/client` 1.5 builds its next offset (`<lsn>_0`, docs/protocol.md §13.4).
//!
//! JSON text never contains a raw line break (serde escapes them inside strings), so every
//! message fits on one `data:` line.

use bytes::Bytes;

use super::body::FragmentBody;

/// `data: `: the start of an event's only line.
const DATA: &[u8] = b"data: ";
/// The blank line that ends an event.
const END: &[u8] = b"\n\n";
/// A comment clients ignore, sent while nothing else is, so that idle proxies keep the
/// connection open.
pub const KEEPALIVE: &[u8] = b": keepalive\n\n";

/// `Content-Type` of an SSE response.
pub const CONTENT_TYPE: &str = "text/event-stream";

/// The events of the change messages of `body` (a body from
/// `FragmentBody::changes_then_up_to_date`), one `data:` event per message, in order, without
/// the `up-to-date`. The row bytes are the body's shared fragments (no copy): each event is
/// four `Bytes`, three of them static.
pub fn change_events(body: &FragmentBody) -> Vec<Bytes> {
    let messages = body.change_messages();
    let mut out = Vec::with_capacity(messages.len() * 4);
    for (fragment, end) in messages {
        out.push(Bytes::from_static(DATA));
        out.push(fragment);
        out.push(Bytes::from_static(end));
        out.push(Bytes::from_static(END));
    }
    out
}

/// The `up-to-date` control event. With `lsn` it carries `headers.global_last_seen_lsn` (a
/// decimal string, which the 1.5 client passes to `BigInt` and turns into its next offset
/// `<lsn>_0`); without it, the client keeps the offset it has.
pub fn up_to_date_event(lsn: Option<u64>) -> Bytes {
    match lsn {
        Some(lsn) => Bytes::from(format!(
            "data: {{\"headers\":{{\"control\":\"up-to-date\",\"global_last_seen_lsn\":\"{lsn}\"}}}}\n\n"
        )),
        None => Bytes::from_static(b"data: {\"headers\":{\"control\":\"up-to-date\"}}\n\n"),
    }
}

/// Parses an SSE byte stream into the `data` of its events (tests and tools): comments are
/// skipped, multi-line data is joined with `\n`, an unfinished last event is dropped.
pub fn parse_events(text: &str) -> Vec<String> {
    let mut events = Vec::new();
    let mut data: Option<String> = None;
    let normalized = text.replace("\r\n", "\n");
    let mut lines = normalized.split('\n').peekable();
    while let Some(line) = lines.next() {
        if lines.peek().is_none() {
            break; // the text after the last newline is not a complete line
        }
        if line.is_empty() {
            if let Some(d) = data.take() {
                events.push(d);
            }
        } else if let Some(value) = line.strip_prefix("data:") {
            let value = value.strip_prefix(' ').unwrap_or(value);
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            }
        }
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::body::tests::insert_then_update;
    use crate::protocol::encode::serialize_row;
    use crate::protocol::encode::tests::sample_row;
    use crate::protocol::ColumnSet;
    use serde_json::{json, Value};

    fn concat(parts: &[Bytes]) -> String {
        let mut out = Vec::new();
        for p in parts {
            out.extend_from_slice(p);
        }
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn one_data_event_per_message_sharing_the_row_bytes() {
        let mut row = sample_row();
        row.payload = "line one\nline two".into();
        let a = serialize_row(&row, ColumnSet::ALL);
        let body = insert_then_update(&a, &a);
        let parts = change_events(&body);
        assert_eq!(parts[1].as_ptr(), a.fragment.as_ptr());
        let mut text = concat(&parts);
        text.push_str(std::str::from_utf8(&up_to_date_event(Some(17))).unwrap());
        let events = parse_events(&text);
        assert_eq!(events.len(), 3);
        let whole: Value = serde_json::from_slice(&body.to_bytes()).unwrap();
        for (i, e) in events.iter().take(2).enumerate() {
            assert!(!e.contains('\n'), "one line per event");
            assert_eq!(serde_json::from_str::<Value>(e).unwrap(), whole[i]);
        }
        assert_eq!(
            serde_json::from_str::<Value>(&events[2]).unwrap(),
            json!({"headers": {"control": "up-to-date", "global_last_seen_lsn": "17"}})
        );
    }

    #[test]
    fn up_to_date_without_lsn_and_keepalive_is_a_comment() {
        let e = parse_events(std::str::from_utf8(&up_to_date_event(None)).unwrap());
        assert_eq!(
            e,
            vec![r#"{"headers":{"control":"up-to-date"}}"#.to_string()]
        );
        assert!(parse_events(std::str::from_utf8(KEEPALIVE).unwrap()).is_empty());
        assert!(change_events(&FragmentBody::up_to_date()).is_empty());
    }

    #[test]
    fn parser_joins_lines_and_drops_unfinished_events() {
        assert_eq!(
            parse_events("data: a\ndata: b\n\n: c\n\ndata: d"),
            vec!["a\nb".to_string()]
        );
    }
}
