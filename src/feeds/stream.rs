//! SSE live mode (`live=true&live_sse=true`, docs/protocol.md §13.4): one stream is a sequence
//! of live holds ([`Feeds::serve`]) of the same feed, on the same router wake path as a
//! long-poll: no per-connection polling, and the rows are the ones every feed shares (the
//! reply's row fragments, serialized once, are wrapped as SSE events without a copy).
//!
//! Each hold that yields changes is sent as its change messages followed by an `up-to-date`
//! carrying `global_last_seen_lsn`, the LSN form of the reply's offset, so the client's next
//! offset (`<lsn>_0`) resumes exactly there. A hold that ends without changes (its backstop
//! re-read found nothing) sends nothing and the next hold starts at the same offset. A
//! keep-alive comment goes out after `feeds.sse_keepalive_ms` without any event. The stream
//! ends after `feeds.sse_max_duration_ms` (the client reconnects at its last offset), when the
//! server drains (after the hold in progress has answered), or when a hold fails (the client
//! retries). Dropping the stream (client gone) drops the hold in progress at once. A hold
//! dropped that way, or because the stream reached its maximum duration, counts as an `abort`
//! wakeup, as a long-poll whose client left does.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use tokio::time::Instant;

use super::{FeedError, FeedReply, FeedRequest, Feeds};
use crate::config::FeedsConfig;
use crate::protocol::offset::OffsetParam;
use crate::protocol::sse::{change_events, up_to_date_event, KEEPALIVE};

/// Timing of one SSE stream.
#[derive(Clone, Copy, Debug)]
pub struct StreamTiming {
    /// Keep-alive comment after this long without an event.
    pub keepalive: Duration,
    /// The stream ends after this long.
    pub max_duration: Duration,
}

impl StreamTiming {
    /// `feeds.sse_keepalive_ms` and `feeds.sse_max_duration_ms`.
    pub fn of(cfg: &FeedsConfig) -> StreamTiming {
        StreamTiming {
            keepalive: Duration::from_millis(cfg.sse_keepalive_ms.max(1)),
            max_duration: Duration::from_millis(cfg.sse_max_duration_ms.max(1)),
        }
    }
}

type Hold = Pin<Box<dyn Future<Output = Result<FeedReply, FeedError>> + Send>>;

struct State {
    feeds: Arc<Feeds>,
    req: FeedRequest,
    /// The frames of one reply (its rows, at most `feeds.max_list_results`, and its up-to-date)
    /// or one keep-alive: filled only when empty, so bounded by one reply; nothing overflows.
    queue: VecDeque<Bytes>,
    hold: Option<Hold>,
    last_sent: Instant,
    ends_at: Instant,
    keepalive: Duration,
    done: bool,
}

impl State {
    fn hold(&mut self) -> &mut Hold {
        let (feeds, req) = (&self.feeds, &self.req);
        self.hold.get_or_insert_with(|| {
            let (feeds, req) = (feeds.clone(), req.clone());
            Box::pin(async move { feeds.serve(req).await })
        })
    }

    /// Queues the events of one hold's reply and moves the stream to its offset.
    fn answered(&mut self, reply: FeedReply) {
        if reply.rows > 0 {
            self.queue.extend(change_events(&reply.body));
            self.queue.push_back(up_to_date_event(reply.offset.lsn()));
            self.req.offset = OffsetParam::At(reply.offset);
        }
    }
}

/// The byte frames of one SSE stream for `req` (a live request at an issued offset, already
/// authorised, admitted and checked with [`Feeds::check`]). `req.sse` is set so that the
/// offsets the holds mint have an LSN form.
pub fn sse_frames(
    feeds: Arc<Feeds>,
    mut req: FeedRequest,
    timing: StreamTiming,
) -> impl Stream<Item = Bytes> + Send + 'static {
    req.live = true;
    req.sse = true;
    let now = Instant::now();
    let state = State {
        feeds,
        req,
        queue: VecDeque::new(),
        hold: None,
        last_sent: now,
        ends_at: now + timing.max_duration,
        keepalive: timing.keepalive,
        done: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(frame) = st.queue.pop_front() {
                st.last_sent = Instant::now();
                return Some((frame, st));
            }
            if st.done {
                return None;
            }
            let keepalive_at = st.last_sent + st.keepalive;
            let ends_at = st.ends_at;
            tokio::select! {
                reply = st.hold() => {
                    st.hold = None;
                    match reply {
                        Ok(reply) => st.answered(reply),
                        Err(err) => {
                            tracing::warn!(error = %err, "SSE hold failed; ending the stream");
                            st.done = true;
                        }
                    }
                    if st.feeds.shutdown_token().is_cancelled() {
                        st.done = true;
                    }
                }
                _ = tokio::time::sleep_until(keepalive_at) => {
                    st.queue.push_back(Bytes::from_static(KEEPALIVE));
                }
                _ = tokio::time::sleep_until(ends_at) => {
                    st.hold = None;
                    st.done = true;
                }
            }
        }
    })
}
