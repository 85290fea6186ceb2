//! Catch-up: a non-live request with a handle, answered at once with what its client is missing.

use std::time::Duration;

use tokio::time::Instant;

use super::diff::Pending;
use super::reply::ReplyShape;
use super::{FeedError, FeedReply, Feeds, Poll};

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
        let read = req.read(poll.target, deadline);
        let set = self.sets.read_shared(read).await?;
        // The cached read may predate records the client has not seen: replay them too.
        let reg = self.router.register(poll.feed(Some(set.cursor))).await;
        let mut pending = Pending::default();
        pending.extend(set.rows.iter().cloned());
        let mut trusted = set.settled;
        if !reg.covered() {
            let fresh = self.sets.read_covered(read, &reg).await?;
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
}
