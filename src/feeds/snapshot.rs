//! The snapshot (`offset=-1`, `offset=now`): everything the feed carries, under a new handle.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::protocol::cursor::next_offset_seq;
use crate::protocol::electric::LogMode;
use crate::protocol::offset::{Offset, OffsetParam};
use crate::router::Feed;

use super::diff::{Known, Pending, WorkingSet};
use super::read::Target;
use super::reply::{max_ms, ReplyShape};
use super::state::ConnState;
use super::{bucket, filter_of, FeedError, FeedReply, FeedRequest, Feeds};

impl Feeds {
    /// `offset=-1`: everything the feed carries as `insert`, under a new handle (RUN-01,
    /// TAG-01..03, BAT-02).
    ///
    /// `offset=now` and `log=changes_only` (Electric's semantics,
    /// <https://electric-sql.com/docs/api/http>): the same snapshot is taken and recorded as the
    /// client's working set, but the reply carries no rows — only `up-to-date` at the current
    /// offset — so the client goes live from here and receives later changes as usual.
    ///
    /// Never older than a version whose change record this instance received before the
    /// request: the read may come from the shared cache, taken before such records, so the
    /// records routed since its cursor are replayed on top of it (through the read-your-writes
    /// gate), after waiting for the ones received but still queued for their batch. Where the
    /// stream cannot vouch for the gap since the read, the feed is read again.
    pub(super) async fn snapshot(&self, req: &FeedRequest) -> Result<FeedReply, FeedError> {
        let received = self.router.received(&req.env_id);
        let target = match &req.target {
            Target::Tag { tags, floor_ms } => Target::Tag {
                tags: tags.clone(),
                floor_ms: bucket(*floor_ms, self.cfg.runset_created_at_bucket_ms),
            },
            other => other.clone(),
        };
        let floor = match &target {
            Target::Tag { floor_ms, .. } => Some(*floor_ms),
            _ => None,
        };
        let claims = Arc::new(self.claims_for(req, floor));
        let handle = self.handles.mint(&claims);
        let deadline = Instant::now() + Duration::from_millis(self.cfg.live_poll_timeout_ms);
        let read = req.read(&target, deadline);
        let set = self.sets.read_shared(read).await?;
        self.router.routed(&req.env_id, received, deadline).await;
        let reg = self
            .router
            .register(Feed {
                env_id: req.env_id.clone(),
                filter: filter_of(&target),
                cols: req.cols,
                since: Some(set.cursor),
            })
            .await;
        let mut pending = Pending::default();
        pending.extend(set.rows.iter().cloned());
        if !reg.covered() && !reg.quiet_since(&set.cursor) {
            let fresh = self.sets.read_covered(read, &reg).await?;
            pending.extend(fresh.rows.iter().cloned());
        }
        let (mut cursor, late) = reg.settle();
        if late.recheck || !set.settled {
            // The read may miss commits the stream already announced: the next poll re-checks.
            cursor.epoch = 0;
        }
        pending.extend(late.rows);
        let changes: Vec<_> = pending.changes(&Known::Set(WorkingSet::new()));
        let offset = Offset {
            ms: max_ms(0, &changes),
            seq: next_offset_seq(req.sse),
        };
        let rowless = req.offset == OffsetParam::Now || req.log == LogMode::ChangesOnly;
        let changes = if rowless { Vec::new() } else { changes };
        let ws = pending.next_working_set(&Known::Nothing);
        // The versions the snapshot carried travel with its shared cursor: an instance the
        // next poll lands on must not send an older version of them.
        let recent = Self::recent(None, &Known::Nothing, &pending, &ws);
        self.record(
            req,
            &handle,
            offset,
            ConnState {
                ws,
                cursor,
                prev: None,
                recent,
                shared_at_ms: None,
                claims,
                tags: req.target.tags(),
            },
        );
        let shape = ReplyShape {
            schema: true,
            vouched: cursor.epoch != 0,
            trusted: true,
        };
        Ok(self.reply(req, handle, offset, &changes, shape))
    }
}
