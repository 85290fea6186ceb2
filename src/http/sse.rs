//! The SSE live mode's HTTP response (docs/protocol.md §13.4): `200 text/event-stream` with the
//! Electric headers a live response needs (`electric-handle`, `electric-offset`,
//! `electric-cursor`, checked by `@electric-sql/client` 1.5 for `live=true` requests), no
//! caching and no proxy buffering (`x-accel-buffering: no`, as Electric's docs ask of proxies,
//! <https://electric-sql.com/docs/guides/troubleshooting>), and a body that is the stream of
//! `feeds::stream`.
//!
//! The body owns the request's concurrency slot, so a stream counts as one live request for its
//! whole life. When the client goes away hyper drops the body, which drops the hold in
//! progress and releases the slot at once; on shutdown the stream ends after the hold in
//! progress has answered (the one `CancellationToken` of `app`).
//!
//! **A client that stops reading** (docs/faults.md "Stalled SSE streams"): hyper polls a body
//! only while its write buffer has room, so a body that ran its holds itself would stop being
//! polled once the client stalls, with a hold still registered and its inbox growing with every
//! change. Instead the holds run on a task of their own that hands the events over through a
//! bounded queue ([`QueueBound`]: `feeds.sse_max_queued_bytes`, `feeds.sse_max_queued_events`).
//! When the queue is full the task stops reading changes (no hold is registered while it
//! waits); when the client then takes nothing for `feeds.sse_stall_timeout_ms` the stream is
//! ended: the queue is emptied (its events freed at once), the hold dropped, the connection
//! aborted (`http::serve::ConnAbort`: its pending write fails, hyper drops the connection and the
//! events in its write buffer) and [`stalled_streams`] counts it
//! (`runfeed_feeds_stalled_streams_total`). What a stalled stream can pin is the queue bound
//! plus hyper's write buffer (`server` buffer cap, `http::serve`), for at most the stall
//! timeout. A client that reads again before that
//! never notices: the queue only applies back-pressure.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::Response;
use bytes::Bytes;
use futures::task::AtomicWaker;
use futures::{Stream, StreamExt};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::feeds::admit::Slot;
use crate::feeds::stream::{sse_frames, StreamTiming};
use crate::feeds::{FeedRequest, Feeds};
use crate::protocol::cursor::{next_cursor, Gap};
use crate::protocol::headers::{ClientGeneration, ElectricHeaders};
use crate::protocol::offset::OffsetParam;
use crate::protocol::sse::CONTENT_TYPE;

/// The streaming response for `req` (a live request at an issued offset whose handle
/// `Feeds::check` accepted), holding `slot` until the stream ends.
pub fn response(
    feeds: Arc<Feeds>,
    req: FeedRequest,
    slot: Option<Slot>,
    client: ClientGeneration,
) -> Response {
    let offset = match req.offset {
        OffsetParam::At(offset) => Some(offset.to_string()),
        _ => None,
    };
    let headers = ElectricHeaders {
        handle: req.handle.clone().unwrap_or_default(),
        offset,
        cursor: Some(next_cursor(req.cursor.as_deref(), Gap::Unvouched).to_string()),
        schema: None,
        up_to_date: false,
    };
    let timing = StreamTiming::of(feeds.config());
    let bound = QueueBound::of(feeds.config());
    let frames = sse_frames(feeds, req, timing);
    let body = bounded(frames, bound, slot, super::serve::current_connection());
    let mut response = Response::new(axum::body::Body::from_stream(body));
    let h = response.headers_mut();
    h.insert("content-type", HeaderValue::from_static(CONTENT_TYPE));
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    headers.apply(h, client);
    response
}

/// SSE streams ended because their client stopped reading, since the process started
/// (`runfeed.feeds.stalled_streams`, read by the wiring).
static STALLED_STREAMS: AtomicU64 = AtomicU64::new(0);

/// SSE streams ended because their queue stayed full with the client taking nothing for
/// `feeds.sse_stall_timeout_ms`, since the process started (all servers of the process).
pub fn stalled_streams() -> u64 {
    STALLED_STREAMS.load(Ordering::Relaxed)
}

/// What one SSE stream may queue for its client (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct QueueBound {
    /// Most queued event bytes (one larger event is still queued alone).
    pub max_bytes: usize,
    /// Most queued events.
    pub max_events: usize,
    /// A full queue whose client takes nothing for this long ends the stream.
    pub stall: Duration,
}

impl QueueBound {
    /// `feeds.sse_max_queued_bytes`, `feeds.sse_max_queued_events`, `feeds.sse_stall_timeout_ms`.
    pub fn of(cfg: &crate::config::FeedsConfig) -> QueueBound {
        QueueBound {
            max_bytes: cfg.sse_max_queued_bytes.max(1),
            max_events: cfg.sse_max_queued_events.max(1),
            stall: Duration::from_millis(cfg.sse_stall_timeout_ms.max(1)),
        }
    }
}

/// How the producer side ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// The stream of events ended (maximum duration, shutdown, a failed hold).
    Finished,
    /// The client stopped reading: the body answers an error, hyper closes the connection.
    Stalled,
}

#[derive(Default)]
struct Queue {
    /// At most [`QueueBound`]'s `max_events` frames and `max_bytes` bytes (a single larger frame
    /// still enters an empty queue: [`Pipe::try_push`]). A producer that finds
    /// it full waits for room, and once the client takes nothing for `stall` the stream ends
    /// ([`End::Stalled`]); nothing is dropped from a running stream.
    frames: VecDeque<Bytes>,
    bytes: usize,
    end: Option<End>,
}

/// The queue between the task running the holds and the response body.
struct Pipe {
    queue: Mutex<Queue>,
    /// Woken when the body takes an event (room for the producer).
    taken: Notify,
    /// The body's waker (an event was queued, or the producer ended).
    ready: AtomicWaker,
}

impl Pipe {
    /// Queues `frame` if it fits within `bound` (always when the queue is empty); gives it
    /// back otherwise.
    fn try_push(&self, frame: Bytes, bound: QueueBound) -> Result<(), Bytes> {
        let mut q = self.queue.lock();
        let fits = q.frames.is_empty()
            || (q.frames.len() < bound.max_events && q.bytes + frame.len() <= bound.max_bytes);
        if !fits {
            return Err(frame);
        }
        q.bytes += frame.len();
        q.frames.push_back(frame);
        drop(q);
        self.ready.wake();
        Ok(())
    }

    /// Ends the stream; a stall also frees what was queued.
    fn end(&self, end: End) {
        let mut q = self.queue.lock();
        if end == End::Stalled {
            q.frames.clear();
            q.bytes = 0;
        }
        q.end = Some(end);
        drop(q);
        self.ready.wake();
    }
}

/// Runs `frames` (the holds) on a task of its own, handing its events to the returned body
/// through a queue bounded by `bound`; the body keeps `slot` until it is dropped, and dropping
/// it stops the task (and the hold in progress) at once.
fn bounded<S>(
    frames: S,
    bound: QueueBound,
    slot: Option<Slot>,
    conn: Option<Arc<super::serve::ConnAbort>>,
) -> BoundedBody
where
    S: Stream<Item = Bytes> + Send + 'static,
{
    let pipe = Arc::new(Pipe {
        queue: Mutex::new(Queue::default()),
        taken: Notify::new(),
        ready: AtomicWaker::new(),
    });
    let gone = CancellationToken::new();
    tokio::spawn(produce(frames, pipe.clone(), bound, gone.clone(), conn));
    BoundedBody {
        pipe,
        _gone: gone.drop_guard(),
        _slot: slot,
        failed: false,
    }
}

/// The producer task: moves events from `frames` into `pipe` while they fit, ending the stream
/// when the client takes nothing for `bound.stall` while the queue is full.
async fn produce<S>(
    frames: S,
    pipe: Arc<Pipe>,
    bound: QueueBound,
    gone: CancellationToken,
    conn: Option<Arc<super::serve::ConnAbort>>,
) where
    S: Stream<Item = Bytes> + Send + 'static,
{
    let mut frames = std::pin::pin!(frames);
    loop {
        let next = tokio::select! {
            next = frames.next() => next,
            () = gone.cancelled() => return,
        };
        let Some(mut frame) = next else {
            pipe.end(End::Finished);
            return;
        };
        loop {
            let taken = pipe.taken.notified();
            let mut taken = std::pin::pin!(taken);
            taken.as_mut().enable();
            match pipe.try_push(frame, bound) {
                Ok(()) => break,
                Err(back) => frame = back,
            }
            tokio::select! {
                () = taken => {}
                () = tokio::time::sleep(bound.stall) => {
                    STALLED_STREAMS.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!("SSE client took nothing for the stall timeout with a full queue; ending the stream");
                    pipe.end(End::Stalled);
                    if let Some(conn) = &conn {
                        conn.abort();
                    }
                    return;
                }
                () = gone.cancelled() => return,
            }
        }
    }
}

/// The response body: takes events from the pipe.
struct BoundedBody {
    pipe: Arc<Pipe>,
    /// Stops the producer when the body is dropped (client gone).
    _gone: DropGuard,
    /// The concurrency slot, held for the stream's life.
    _slot: Option<Slot>,
    /// The stall error was answered: the stream is over.
    failed: bool,
}

impl Stream for BoundedBody {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.failed {
            return Poll::Ready(None);
        }
        self.pipe.ready.register(cx.waker());
        let mut q = self.pipe.queue.lock();
        if let Some(frame) = q.frames.pop_front() {
            q.bytes -= frame.len();
            drop(q);
            self.pipe.taken.notify_one();
            return Poll::Ready(Some(Ok(frame)));
        }
        match q.end {
            None => Poll::Pending,
            Some(End::Finished) => Poll::Ready(None),
            Some(End::Stalled) => {
                drop(q);
                self.failed = true;
                Poll::Ready(Some(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the SSE client stopped reading",
                ))))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound() -> QueueBound {
        QueueBound {
            max_bytes: 100,
            max_events: 3,
            stall: Duration::from_millis(500),
        }
    }

    /// A client that takes nothing: the queue stops at its bound, the producer stops reading
    /// changes, and after the stall timeout the queue is freed and the body errors.
    #[tokio::test(start_paused = true)]
    async fn a_stream_whose_client_stops_reading_is_bounded_then_ended() {
        let produced = Arc::new(AtomicU64::new(0));
        let counter = produced.clone();
        let frames = futures::stream::iter(0..1_000u32).map(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
            Bytes::from(vec![b'x'; 10])
        });
        let before = stalled_streams();
        let body = bounded(frames, bound(), None, None);
        let mut body = std::pin::pin!(body);
        tokio::time::sleep(Duration::from_millis(100)).await;
        {
            let q = body.pipe.queue.lock();
            assert_eq!(q.frames.len(), 3, "the events bound holds");
            assert!(q.bytes <= 100);
        }
        // One more event was read from the holds and waits for room: nothing else.
        assert!(produced.load(Ordering::SeqCst) <= 4);
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(
            body.pipe.queue.lock().frames.is_empty(),
            "the queue was freed"
        );
        assert!(stalled_streams() > before);
        let err = body
            .next()
            .await
            .expect("an item")
            .expect_err("the stall error");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(body.next().await.is_none());
    }

    /// A client that keeps reading gets every event in order, however many there are, and
    /// the stream ends normally.
    #[tokio::test(start_paused = true)]
    async fn a_reading_client_gets_every_event_past_the_bound() {
        let frames = futures::stream::iter(0..500u32).map(|i| Bytes::from(i.to_string()));
        let body = bounded(frames, bound(), None, None);
        let got: Vec<_> = body.map(|f| f.expect("no error")).collect().await;
        assert_eq!(got.len(), 500);
        assert!(got.iter().enumerate().all(|(i, f)| *f == i.to_string()));
    }

    /// One event larger than the bytes bound still goes out (alone).
    #[tokio::test(start_paused = true)]
    async fn an_event_larger_than_the_bound_is_sent_alone() {
        let frames =
            futures::stream::iter([Bytes::from(vec![1u8; 1_000]), Bytes::from_static(b"a")]);
        let body = bounded(frames, bound(), None, None);
        let got: Vec<_> = body.map(|f| f.expect("no error").len()).collect().await;
        assert_eq!(got, vec![1_000, 1]);
    }

    /// Dropping the body (client gone) stops the producer, which drops the hold.
    #[tokio::test(start_paused = true)]
    async fn dropping_the_body_stops_the_holds() {
        struct Dropped(Arc<AtomicU64>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicU64::new(0));
        let guard = Dropped(dropped.clone());
        let frames = futures::stream::pending::<Bytes>().map(move |f| {
            let _ = &guard;
            f
        });
        let body = bounded(frames, bound(), None, None);
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(body);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
    }
}
