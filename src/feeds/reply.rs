//! The response every poll ends with. [`Feeds::respond`] closes out a poll's registration (its
//! cursor, then the rows that reached its inbox meanwhile), diffs what the poll gathered against
//! what the client has, and records the state for the offset the reply leaves the client at;
//! [`Feeds::reply`] builds the [`FeedReply`] itself (body and Electric headers), for snapshots
//! too (they record their own state). [`ReplyShape`] is what a response carries beyond its rows.

use crate::protocol::body::{FragmentBody, Operation};
use crate::protocol::cursor::{next_cursor, next_offset_seq, Gap};
use crate::protocol::encode::schema_header;
use crate::protocol::headers::ElectricHeaders;
use crate::protocol::offset::Offset;
use crate::protocol::{Handle, SerializedRow};
use crate::router::Registration;

use super::diff::{Known, Pending};
use super::state::ConnState;
use super::{FeedReply, FeedRequest, Feeds, Poll};

/// How a response is built beyond its rows.
#[derive(Clone, Copy)]
pub(super) struct ReplyShape {
    /// Carry `electric-schema` (non-live responses).
    pub(super) schema: bool,
    /// The cursor this reply records vouches for its gap (its `epoch` is not 0): the client's
    /// `electric-cursor` says so ([`Gap`]).
    pub(super) vouched: bool,
    /// Every store re-check of this poll succeeded. When one failed, the recorded cursor is one
    /// no later poll takes as covered, so that poll re-checks instead of trusting a stream that
    /// may have skipped this feed.
    pub(super) trusted: bool,
}

impl Feeds {
    /// Builds the response and records the state for its offset (see [`ReplyShape`]).
    pub(super) fn respond(
        &self,
        poll: Poll<'_>,
        known: &Known,
        mut pending: Pending,
        reg: &Registration,
        shape: ReplyShape,
    ) -> FeedReply {
        let Poll {
            req,
            handle,
            claims,
            offset,
            ..
        } = poll;
        let (mut cursor, late) = reg.settle();
        if late.recheck || !shape.trusted {
            cursor.epoch = 0;
        }
        let shape = ReplyShape {
            vouched: cursor.epoch != 0,
            ..shape
        };
        pending.extend(late.rows);
        let changes = pending.changes(known);
        let ws = pending.next_working_set(known);
        // The state recorded for the offset the client presented, as the poll read it when it
        // began (the one its claims came from).
        let presented = poll.state;
        let recent = Self::recent(presented.map(|s| &**s), known, &pending, &ws);
        if changes.is_empty() {
            // Nothing new: the offset stays what the client sent (docs/protocol.md §10); its
            // state keeps the same working set and moves the replay cursor forward.
            let prev = presented.and_then(|s| s.prev);
            // Nothing new: the shared store's value for this offset still holds, and the
            // client's cursor will carry how far it got.
            let shared_at_ms = presented.and_then(|s| s.shared_at_ms);
            self.record(
                req,
                handle,
                offset,
                ConnState {
                    ws,
                    cursor,
                    prev,
                    recent,
                    shared_at_ms,
                    claims: claims.clone(),
                    tags: req.target.tags(),
                },
            );
            return self.reply(req, handle.clone(), offset, &changes, shape);
        }
        let next = Offset {
            ms: max_ms(offset.ms, &changes),
            seq: next_offset_seq(req.sse),
        };
        self.record(
            req,
            handle,
            next,
            ConnState {
                ws,
                cursor,
                prev: Some(offset),
                recent,
                shared_at_ms: None,
                claims: claims.clone(),
                tags: req.target.tags(),
            },
        );
        self.reply(req, handle.clone(), next, &changes, shape)
    }

    /// The reply at `offset` carrying `changes`: the body, and the Electric headers `shape` asks
    /// for (the `electric-cursor` marked by whether it vouches for its gap).
    pub(super) fn reply(
        &self,
        req: &FeedRequest,
        handle: Handle,
        offset: Offset,
        changes: &[(Operation, SerializedRow)],
        shape: ReplyShape,
    ) -> FeedReply {
        let refs: Vec<(Operation, &SerializedRow)> =
            changes.iter().map(|(op, row)| (*op, row)).collect();
        let body = if refs.is_empty() {
            FragmentBody::up_to_date()
        } else {
            FragmentBody::changes_then_up_to_date(&refs, req.legacy_api_version)
        };
        FeedReply {
            offset,
            headers: ElectricHeaders {
                handle,
                offset: Some(offset.text()),
                cursor: Some(
                    itoa::Buffer::new()
                        .format(next_cursor(req.cursor.as_deref(), gap_of(shape)))
                        .to_owned(),
                ),
                schema: shape.schema.then(|| schema_header(req.cols)),
                up_to_date: true,
            },
            body,
            rows: changes.len(),
            newest_ms: changes.iter().map(|(_, r)| r.meta.updated_at_ms).max(),
        }
    }
}

/// The newest `updatedAt` (epoch ms) among `changes`, and never below `floor` (nor 0).
pub(super) fn max_ms(floor: i64, changes: &[(Operation, SerializedRow)]) -> i64 {
    changes
        .iter()
        .map(|(_, r)| r.meta.updated_at_ms)
        .fold(floor.max(0), i64::max)
}

/// The mark of a reply's `electric-cursor`.
fn gap_of(shape: ReplyShape) -> Gap {
    if shape.vouched {
        Gap::Vouched
    } else {
        Gap::Unvouched
    }
}
