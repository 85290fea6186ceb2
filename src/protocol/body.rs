//! Response bodies as lists of shared `Bytes` fragments.
//!
//! A body is `[` + per row (shared fragment + static `insert"}},`/`update"}},`) + the static
//! `{"headers":{"control":"up-to-date"}}]` (docs/behaviours.md SER-12/SER-13, docs/protocol.md §3.4/§10).
//! Row fragments are cloned `Bytes` (a refcount bump), so fan-out to many feeds never copies a
//! row; the only per-feed copy is the legacy `DEQUEUED → EXECUTING` rewrite (HDR-04).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};

use super::SerializedRow;

const OPEN: &[u8] = b"[";
const INSERT_SEP: &[u8] = b"insert\"}},";
const UPDATE_SEP: &[u8] = b"update\"}},";
const INSERT_END: &[u8] = b"insert\"}}";
const UPDATE_END: &[u8] = b"update\"}}";
const UP_TO_DATE_CLOSE: &[u8] = b"{\"headers\":{\"control\":\"up-to-date\"}}]";
const UP_TO_DATE_BODY: &[u8] = b"[{\"headers\":{\"control\":\"up-to-date\"}}]";
const MUST_REFETCH_BODY: &[u8] = b"[{\"headers\":{\"control\":\"must-refetch\"}}]";
const DEQUEUED: &[u8] = b"\"status\":\"DEQUEUED\"";
const EXECUTING: &[u8] = b"\"status\":\"EXECUTING\"";

/// Change operation of one emitted row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Insert,
    Update,
}

/// A JSON array body made of fragments; `len()` is the exact byte length.
#[derive(Clone, Debug, Default)]
pub struct FragmentBody {
    pub chunks: Vec<Bytes>,
}

impl FragmentBody {
    /// `[change…, {"headers":{"control":"up-to-date"}}]`. When `legacy_api_version` is true,
    /// rows whose value contains `"status":"DEQUEUED"` are rewritten to `EXECUTING` (the only
    /// per-feed copy).
    ///
    /// With no rows this is exactly [`FragmentBody::up_to_date`]. Rows keep the given order.
    pub fn changes_then_up_to_date(
        rows: &[(Operation, &SerializedRow)],
        legacy_api_version: bool,
    ) -> FragmentBody {
        if rows.is_empty() {
            return FragmentBody::up_to_date();
        }
        let mut chunks = Vec::with_capacity(rows.len() * 2 + 2);
        chunks.push(Bytes::from_static(OPEN));
        for (op, row) in rows {
            if legacy_api_version && row.dequeued {
                chunks.push(rewrite_dequeued(&row.fragment));
            } else {
                chunks.push(row.fragment.clone());
            }
            chunks.push(Bytes::from_static(match op {
                Operation::Insert => INSERT_SEP,
                Operation::Update => UPDATE_SEP,
            }));
        }
        chunks.push(Bytes::from_static(UP_TO_DATE_CLOSE));
        FragmentBody { chunks }
    }

    /// `[{"headers":{"control":"up-to-date"}}]`.
    pub fn up_to_date() -> FragmentBody {
        FragmentBody {
            chunks: vec![Bytes::from_static(UP_TO_DATE_BODY)],
        }
    }

    /// `[{"headers":{"control":"must-refetch"}}]` (the 409 body, docs/protocol.md §5.2).
    pub fn must_refetch() -> FragmentBody {
        FragmentBody {
            chunks: vec![Bytes::from_static(MUST_REFETCH_BODY)],
        }
    }

    /// An `http_body::Body` over the chunks that yields one frame per non-empty chunk in O(1) and
    /// reports the exact remaining length (so hyper sets `content-length`).
    pub fn into_stream(self) -> FragmentStream {
        let remaining = self.len() as u64;
        FragmentStream {
            chunks: self.chunks.into_iter(),
            remaining,
        }
    }

    /// The change messages of a body built by [`FragmentBody::changes_then_up_to_date`], each as
    /// its shared row fragment and the static end of its message (`insert"}}` / `update"}}`),
    /// without the trailing `up-to-date`. Concatenated, each pair is one JSON message: the SSE
    /// mode sends it as one `data:` event without copying the row.
    pub fn change_messages(&self) -> Vec<(Bytes, &'static [u8])> {
        let n = self.chunks.len();
        if n < 4 || self.chunks[0].as_ref() != OPEN {
            return Vec::new();
        }
        self.chunks[1..n - 1]
            .chunks_exact(2)
            .map(|pair| {
                let end = if pair[1].as_ref() == INSERT_SEP {
                    INSERT_END
                } else {
                    UPDATE_END
                };
                (pair[0].clone(), end)
            })
            .collect()
    }

    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.chunks.iter().map(Bytes::len).sum()
    }

    /// Whether the body has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The body as one contiguous buffer (tests, small bodies).
    pub fn to_bytes(&self) -> Bytes {
        let mut out = Vec::with_capacity(self.len());
        for c in &self.chunks {
            out.extend_from_slice(c);
        }
        Bytes::from(out)
    }
}

/// `"status":"DEQUEUED"` → `"status":"EXECUTING"` in one fragment (trigger's
/// `rewriteBodyForLegacyApiVersion`, docs/behaviours.md HDR-04). Inside JSON string values every `"` is
/// escaped, so the first (and only) structural match is the `status` member itself.
fn rewrite_dequeued(fragment: &Bytes) -> Bytes {
    let src: &[u8] = fragment;
    match src.windows(DEQUEUED.len()).position(|w| w == DEQUEUED) {
        Some(at) => {
            let mut out = Vec::with_capacity(src.len() + EXECUTING.len() - DEQUEUED.len());
            out.extend_from_slice(&src[..at]);
            out.extend_from_slice(EXECUTING);
            out.extend_from_slice(&src[at + DEQUEUED.len()..]);
            Bytes::from(out)
        }
        None => fragment.clone(),
    }
}

/// Streams a [`FragmentBody`] as `http_body` frames (see [`FragmentBody::into_stream`]).
#[derive(Debug)]
pub struct FragmentStream {
    chunks: std::vec::IntoIter<Bytes>,
    remaining: u64,
}

impl http_body::Body for FragmentStream {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        for chunk in this.chunks.by_ref() {
            if !chunk.is_empty() {
                this.remaining = this.remaining.saturating_sub(chunk.len() as u64);
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

impl From<FragmentBody> for axum::body::Body {
    fn from(body: FragmentBody) -> axum::body::Body {
        axum::body::Body::new(body.into_stream())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::protocol::encode::serialize_row;
    use crate::protocol::encode::tests::sample_row;
    use crate::protocol::ColumnSet;
    use http_body::Body as _;
    use serde_json::{json, Value};

    /// A body of an insert of `a` then an update of `b` (current API version).
    pub(crate) fn insert_then_update(a: &SerializedRow, b: &SerializedRow) -> FragmentBody {
        FragmentBody::changes_then_up_to_date(
            &[(Operation::Insert, a), (Operation::Update, b)],
            false,
        )
    }

    fn parse(body: &FragmentBody) -> Value {
        serde_json::from_slice(&body.to_bytes()).expect("body is JSON")
    }

    async fn collect<B>(mut body: B) -> Vec<u8>
    where
        B: http_body::Body<Data = Bytes> + Unpin,
        B::Error: std::fmt::Debug,
    {
        let mut out = Vec::new();
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
        {
            if let Ok(data) = frame.expect("infallible").into_data() {
                out.extend_from_slice(&data);
            }
        }
        out
    }

    #[test]
    fn ser_12_bare_up_to_date_and_must_refetch() {
        assert_eq!(
            &FragmentBody::up_to_date().to_bytes()[..],
            br#"[{"headers":{"control":"up-to-date"}}]"#
        );
        assert_eq!(
            &FragmentBody::must_refetch().to_bytes()[..],
            br#"[{"headers":{"control":"must-refetch"}}]"#
        );
        let empty = FragmentBody::changes_then_up_to_date(&[], false);
        assert_eq!(empty.to_bytes(), FragmentBody::up_to_date().to_bytes());
    }

    #[test]
    fn ser_12_changes_then_up_to_date() {
        let a = serialize_row(&sample_row(), ColumnSet::ALL);
        let mut row_b = sample_row();
        row_b.id = "cm_run_2".into();
        let b = serialize_row(&row_b, ColumnSet::ALL);
        let body = insert_then_update(&a, &b);
        let v = parse(&body);
        let arr = v.as_array().expect("array");
        assert_eq!(arr.len(), 3);
        assert_eq!(arr[0]["headers"], json!({"operation": "insert"}));
        assert_eq!(arr[0]["value"]["id"], json!("cm_run_1"));
        assert_eq!(arr[1]["headers"], json!({"operation": "update"}));
        assert_eq!(arr[1]["key"], json!("\"public\".\"TaskRun\"/\"cm_run_2\""));
        assert_eq!(arr[2], json!({"headers": {"control": "up-to-date"}}));
        assert_eq!(body.len(), body.to_bytes().len());
    }

    #[test]
    fn change_messages_are_the_bodys_messages_without_up_to_date() {
        let a = serialize_row(&sample_row(), ColumnSet::ALL);
        let body = insert_then_update(&a, &a);
        let messages = body.change_messages();
        assert_eq!(messages.len(), 2);
        let whole = parse(&body);
        for (i, (fragment, end)) in messages.iter().enumerate() {
            assert_eq!(fragment.as_ptr(), a.fragment.as_ptr(), "shared, not copied");
            let mut one = fragment.to_vec();
            one.extend_from_slice(end);
            let v: Value = serde_json::from_slice(&one).expect("one JSON message");
            assert_eq!(v, whole[i]);
        }
        assert!(FragmentBody::up_to_date().change_messages().is_empty());
    }

    #[test]
    fn ser_13_fragments_shared_not_copied() {
        let a = serialize_row(&sample_row(), ColumnSet::ALL);
        let body = FragmentBody::changes_then_up_to_date(&[(Operation::Insert, &a)], true);
        assert_eq!(body.chunks[1].as_ptr(), a.fragment.as_ptr());
    }

    #[test]
    fn hdr_04_legacy_rewrites_dequeued() {
        let mut row = sample_row();
        row.status = "DEQUEUED".into();
        row.payload = r#"{"status":"DEQUEUED"}"#.into();
        let s = serialize_row(&row, ColumnSet::ALL);
        let legacy = parse(&FragmentBody::changes_then_up_to_date(
            &[(Operation::Update, &s)],
            true,
        ));
        assert_eq!(legacy[0]["value"]["status"], json!("EXECUTING"));
        // escaped occurrence inside a text column is untouched
        assert_eq!(
            legacy[0]["value"]["payload"],
            json!(r#"{"status":"DEQUEUED"}"#)
        );
        let modern = parse(&FragmentBody::changes_then_up_to_date(
            &[(Operation::Update, &s)],
            false,
        ));
        assert_eq!(modern[0]["value"]["status"], json!("DEQUEUED"));
        // non-dequeued rows are shared as-is even for legacy
        let e = serialize_row(&sample_row(), ColumnSet::ALL);
        let body = FragmentBody::changes_then_up_to_date(&[(Operation::Update, &e)], true);
        assert_eq!(body.chunks[1].as_ptr(), e.fragment.as_ptr());
    }

    #[tokio::test]
    async fn http_body_frames_and_exact_size_hint() {
        let a = serialize_row(&sample_row(), ColumnSet::ALL);
        let body = insert_then_update(&a, &a);
        let expected = body.to_bytes();
        let stream = body.clone().into_stream();
        assert_eq!(stream.size_hint().exact(), Some(expected.len() as u64));
        assert_eq!(collect(stream).await, expected.to_vec());
        let axum_body: axum::body::Body = body.into();
        assert_eq!(axum_body.size_hint().exact(), Some(expected.len() as u64));
        let bytes = axum::body::to_bytes(axum_body, usize::MAX)
            .await
            .expect("collect");
        assert_eq!(bytes, expected);
    }
}
