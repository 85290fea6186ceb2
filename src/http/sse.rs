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

use std::convert::Infallible;
use std::sync::Arc;

use axum::http::HeaderValue;
use axum::response::Response;
use futures::StreamExt;

use super::admit::Slot;
use super::ClientGeneration;
use crate::feeds::stream::{sse_frames, StreamTiming};
use crate::feeds::{FeedRequest, Feeds};
use crate::protocol::cursor::{next_cursor, Gap};
use crate::protocol::headers::ElectricHeaders;
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
    let frames = sse_frames(feeds, req, timing).map(move |frame| {
        let _held = &slot;
        Ok::<_, Infallible>(frame)
    });
    let mut response = Response::new(axum::body::Body::from_stream(frames));
    let h = response.headers_mut();
    h.insert("content-type", HeaderValue::from_static(CONTENT_TYPE));
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    headers.apply(h, client == ClientGeneration::Legacy);
    response
}
