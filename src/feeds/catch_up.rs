//! Catch-up (a non-live request with a handle) and the response every poll ends with.

use std::time::Duration;

use tokio::time::Instant;

use crate::protocol::cursor::next_offset_seq;
use crate::protocol::offset::Offset;
use crate::router::Registration;

use super::diff::{Known, Pending};
use super::state::ConnState;
use super::{max_ms, FeedError, FeedReply, Feeds, Poll, ReplyShape};

impl Feeds {
    /// Non-live request with a handle (catch-up, prefetch, resume after pause): answered at
    /// once with what the client is missing, never held (docs/protocol.md §4.5–4.6).
    pub(super) async fn catch_up(&self, poll: Poll<'_>) -> Result<FeedReply, FeedError> {
        let req = poll.req;
        // Every await but the hold is boxed: this future lives for the whole hold, and an
        // inline read would size it (memory per held feed).
        let resume = Box::pin(self.lookup(poll)).await;
        let known = self.known(poll, &resume);
        let deadline = Instant::now() + Duration::from_millis(self.cfg.live_poll_timeout_ms);
        let set = self
            .sets
            .read_shared(&req.env_id, poll.target, req.cols, deadline)
            .await?;
        // The cached read may predate records the client has not seen: replay them too.
        let reg = self.router.register(poll.feed(Some(set.cursor))).await;
        let mut pending = Pending::default();
        pending.extend(set.rows.iter().cloned());
        let mut trusted = set.settled;
        if !reg.covered() {
            let fresh = self
                .sets
                .read_covered(&req.env_id, poll.target, req.cols, deadline, &reg)
                .await?;
            trusted &= fresh.settled;
            pending.extend(fresh.rows.iter().cloned());
        }
        let shape = ReplyShape {
            schema: true,
            vouched: false,
            trusted,
        };
        Ok(self.respond(poll, &known, pending, &reg, shape))
    }

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
}
