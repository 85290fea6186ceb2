//! runfeed's own HTTP/1.1 path for plain `GET`s, the feed polls above all
//! (docs/http-api.md "Connections"). [`drive`] serves a connection's requests for as long as
//! each one is a complete, body-less `GET` over HTTP/1.1 that arrived in one read; the first
//! request that is anything else hands the connection, with the bytes already read, to hyper
//! for the rest of its life (`http::serve`).
//!
//! Why: a held poll is a parked connection. hyper keeps an 8 KiB read buffer and a write
//! buffer per connection for its whole life, and its generic state machine costs a large
//! share of an ended poll's CPU (BENCHMARKS.md "Cost per unit of work"). Here a request head
//! is read into one scratch buffer per worker thread and parsed there (`httparse`, the parser
//! hyper uses); a parked poll holds no buffer at all, and each answer is one vectored write of
//! its head and its shared body `Bytes`.
//!
//! What goes to hyper instead (it has the full HTTP/1.1 semantics for them): any method other
//! than `GET`; HTTP/1.0; a request with a body (`content-length`, `transfer-encoding`) or an
//! `expect` or `upgrade` header; a `connection` header with a token other than `keep-alive` or
//! `close`; a head split over reads, larger than [`SCRATCH_BYTES`] or with more than
//! [`MAX_HEADERS`] headers; anything `httparse` or `http` refuses (hyper answers the 400/431);
//! and the SSE live mode (a query naming `live_sse`), whose streaming answer is hyper's.
//!
//! The bounds hyper applied hold here too: a head must arrive within `header_read_timeout`
//! (from the moment the connection waits for one, so idle keep-alive connections close); a
//! write that makes no progress for `write_stall_timeout` closes the connection; bytes a client
//! sends while its request is held are kept up to [`SCRATCH_BYTES`], and a client that sends
//! more is disconnected. A client that closes its connection while its poll is held ends the
//! request at once (its future, and with it the hold, is dropped), as hyper does.
//!
//! On shutdown an idle connection closes at once; a request in flight is answered with
//! `connection: close`, then the connection closes.

use std::cell::RefCell;
use std::convert::Infallible;
use std::future::Future;
use std::io::IoSlice;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{StatusCode, Uri, Version};
use http_body::Body as _;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::TcpStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tower::ServiceExt;

/// Size of each worker thread's scratch buffer, bytes: the largest request head this path
/// reads, and the most bytes a client may send while its request is held.
pub(super) const SCRATCH_BYTES: usize = 16 * 1024;

/// Most header lines a request head may carry on this path (more: hyper's).
pub(super) const MAX_HEADERS: usize = 64;

thread_local! {
    /// The worker thread's read buffer: filled and parsed without an `.await` in between, so
    /// no connection holds it across a suspension.
    static SCRATCH: RefCell<Box<[u8]>> = RefCell::new(vec![0; SCRATCH_BYTES].into_boxed_slice());

    /// The `date` header value of the current second, and that second (epoch seconds).
    static DATE: RefCell<(i64, [u8; 29])> = const { RefCell::new((-1, [0; 29])) };
}

/// The time bounds of [`drive`] (see the module docs).
#[derive(Clone, Copy, Debug)]
pub(super) struct Bounds {
    /// Time allowed for a complete request head, from the moment the connection waits for one.
    pub(super) header_read: Option<Duration>,
    /// How long a pending write may make no progress.
    pub(super) write_stall: Option<Duration>,
}

/// How [`drive`] let go of a connection.
#[derive(Debug)]
pub(super) enum Ended {
    /// Done with it: the caller drops (closes) it.
    Closed,
    /// The next request is hyper's: these bytes were read from the connection and are its
    /// first bytes.
    HandOff(Bytes),
}

/// What the connection sent next.
#[expect(
    clippy::large_enum_variant,
    reason = "almost every value is a request; boxing would cost an allocation per request"
)]
enum Next {
    /// A request for this path, and whether the client asked to close after it.
    Request(Request, Close),
    HandOff(Bytes),
    Closed,
}

/// Whether the connection closes after the current answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Close {
    AfterAnswer,
    No,
}

/// Serves `stream`'s requests with `service` until one is not for this path (handed off), the
/// client leaves, a bound is broken, or `shutdown` ends it (see the module docs).
pub(super) async fn drive<S>(
    stream: &mut TcpStream,
    service: &mut S,
    bounds: Bounds,
    shutdown: &CancellationToken,
) -> Ended
where
    S: tower::Service<Request, Response = Response, Error = Infallible> + Clone,
{
    // Bytes read beyond the current request (pipelined heads); usually empty, unallocated.
    let mut pending = Vec::new();
    // One wait for shutdown for the connection's life: registered with the token once, not
    // once per request (a lock shared by every connection).
    let mut cancelled = std::pin::pin!(shutdown.cancelled());
    loop {
        let next = next_head(stream, &mut pending, bounds, cancelled.as_mut()).await;
        let (request, close) = match next {
            Next::Request(request, close) => (request, close),
            Next::HandOff(bytes) => return Ended::HandOff(bytes),
            Next::Closed => return Ended::Closed,
        };
        let Some(response) = answer(stream, service.clone().oneshot(request), &mut pending).await
        else {
            return Ended::Closed;
        };
        let close = if shutdown.is_cancelled() {
            Close::AfterAnswer
        } else {
            close
        };
        match write_response(stream, response, close, bounds.write_stall).await {
            Ok(Close::No) => {}
            Ok(Close::AfterAnswer) | Err(_) => return Ended::Closed,
        }
    }
}

/// Waits for the next request head (see [`Next`]).
async fn next_head(
    stream: &mut TcpStream,
    pending: &mut Vec<u8>,
    bounds: Bounds,
    mut cancelled: Pin<&mut WaitForCancellationFuture<'_>>,
) -> Next {
    if !pending.is_empty() {
        return take_head(Bytes::from(std::mem::take(pending)), pending);
    }
    let deadline = bounds
        .header_read
        .map(|limit| tokio::time::Instant::now() + limit);
    let read = read_with(stream, |read| match read {
        [] => Next::Closed,
        // One copy of what was read: the request's path and header values are slices of it.
        read => take_head(Bytes::copy_from_slice(read), pending),
    });
    tokio::select! {
        biased;
        () = &mut cancelled => Next::Closed,
        next = read => next,
        () = until(deadline) => Next::Closed,
    }
}

/// Reads what the client sent into the thread's scratch buffer and returns what `take` makes
/// of it; `take` sees no bytes when the client closed the connection or the read failed.
///
/// The read goes through `AsyncRead::poll_read`, which, after a read that took less than the
/// buffer, marks the socket drained (tokio's edge-triggered readiness, race-free): the next
/// wait parks at once instead of spending a system call on a read that finds nothing.
async fn read_with<T>(stream: &mut TcpStream, mut take: impl FnMut(&[u8]) -> T) -> T {
    std::future::poll_fn(|cx| {
        SCRATCH.with_borrow_mut(|scratch| {
            let mut buf = ReadBuf::new(scratch);
            match Pin::new(&mut *stream).poll_read(cx, &mut buf) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Ok(())) => Poll::Ready(take(buf.filled())),
                Poll::Ready(Err(_)) => Poll::Ready(take(&[])),
            }
        })
    })
    .await
}

/// The request at the start of `bytes` (read from the connection, `pending` empty), what
/// follows it kept in `pending`; or the hand-off of all of `bytes`.
fn take_head(bytes: Bytes, pending: &mut Vec<u8>) -> Next {
    match parse(&bytes) {
        Parsed::Request(request, close, len) => {
            pending.extend_from_slice(&bytes[len..]);
            Next::Request(request, close)
        }
        Parsed::Other => Next::HandOff(bytes),
    }
}

/// Sleeps until `deadline`; forever when there is none.
async fn until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Runs `answering` to its response while watching the connection: `None` when the client
/// closed it (or sent more than [`SCRATCH_BYTES`] meanwhile), which drops `answering`.
async fn answer(
    stream: &mut TcpStream,
    answering: impl Future<Output = Result<Response, Infallible>>,
    pending: &mut Vec<u8>,
) -> Option<Response> {
    tokio::select! {
        biased;
        response = answering => {
            let Ok(response) = response;
            Some(response)
        }
        () = left(stream, pending) => None,
    }
}

/// Completes when the client has closed `stream` or sent more than [`SCRATCH_BYTES`] beyond
/// its current request (kept in `pending`, the next heads). Its own loop absorbs spurious
/// readiness, so the request's future is not polled again for it.
async fn left(stream: &mut TcpStream, pending: &mut Vec<u8>) {
    loop {
        let gone = read_with(stream, |read| {
            pending.extend_from_slice(read);
            read.is_empty() || pending.len() > SCRATCH_BYTES
        })
        .await;
        if gone {
            return;
        }
    }
}

/// A parsed head.
#[expect(
    clippy::large_enum_variant,
    reason = "almost every value is a request; boxing would cost an allocation per request"
)]
enum Parsed {
    /// A request for this path, whether it asks to close, and the head's length in bytes.
    Request(Request, Close, usize),
    /// Anything else: hyper's (see the module docs).
    Other,
}

/// Parses `buf`'s first request head (see the module docs for what is [`Parsed::Other`]). The
/// request's path and header values share `buf`'s memory (no copy, no allocation each).
fn parse(buf: &Bytes) -> Parsed {
    let mut lines = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut head = httparse::Request::new(&mut lines);
    let Ok(httparse::Status::Complete(len)) = head.parse(buf) else {
        return Parsed::Other;
    };
    if head.method != Some("GET") || head.version != Some(1) {
        return Parsed::Other;
    }
    let Some(path) = head.path.filter(|path| path.starts_with('/')) else {
        return Parsed::Other;
    };
    if path
        .split_once('?')
        .is_some_and(|(_, query)| maybe_sse(query))
    {
        return Parsed::Other;
    }
    let Ok(uri) = Uri::from_maybe_shared(buf.slice_ref(path.as_bytes())) else {
        return Parsed::Other;
    };
    let mut close = Close::No;
    let mut headers = HeaderMap::with_capacity(head.headers.len());
    for line in head.headers.iter() {
        let value = if line.value.is_empty() {
            Ok(HeaderValue::from_static(""))
        } else {
            HeaderValue::from_maybe_shared(buf.slice_ref(line.value))
        };
        let (Ok(name), Ok(value)) = (HeaderName::from_bytes(line.name.as_bytes()), value) else {
            return Parsed::Other;
        };
        if name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            || name == header::EXPECT
            || name == header::UPGRADE
        {
            return Parsed::Other;
        }
        if name == header::CONNECTION {
            for token in line.value.split(|b| *b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    close = Close::AfterAnswer;
                } else if !token.eq_ignore_ascii_case(b"keep-alive") && !token.is_empty() {
                    return Parsed::Other;
                }
            }
        }
        headers.append(name, value);
    }
    let mut request = Request::new(Body::empty());
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = headers;
    Parsed::Request(request, close, len)
}

/// Whether `query` may ask for the SSE live mode (a key among
/// [`crate::protocol::electric::LIVE_SSE_PARAMS`]): it names `live_sse` anywhere, or holds a
/// percent- or `+`-encoding, which this check does not decode. Conservative: a value naming
/// it goes to hyper too, which answers it the same.
fn maybe_sse(query: &str) -> bool {
    let query = query.as_bytes();
    memchr::memchr2(b'%', b'+', query).is_some()
        || memchr::memchr_iter(b'_', query)
            .any(|at| query[at + 1..].starts_with(b"sse") && query[..at].ends_with(b"live"))
}

/// Writes `response` (head, then body) and says whether the connection closes after it: when
/// `close` says so, or the response carries `connection: close`. A body of known length goes
/// out with `content-length` in one vectored write with the head; any other body as chunks.
async fn write_response(
    stream: &TcpStream,
    response: Response,
    close: Close,
    stall: Option<Duration>,
) -> std::io::Result<Close> {
    let (parts, mut body) = response.into_parts();
    let close = if parts
        .headers
        .get(header::CONNECTION)
        .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"close"))
    {
        Close::AfterAnswer
    } else {
        close
    };
    // A feed answer's head is 500–900 bytes (the Electric headers, CORS): one allocation.
    let mut head = Vec::with_capacity(1024);
    head.extend_from_slice(b"HTTP/1.1 ");
    head.extend_from_slice(parts.status.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(
        parts
            .status
            .canonical_reason()
            .unwrap_or_default()
            .as_bytes(),
    );
    head.extend_from_slice(b"\r\n");
    for (name, value) in &parts.headers {
        if name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            || name == header::CONNECTION
        {
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    if !parts.headers.contains_key(header::DATE) {
        head.extend_from_slice(b"date: ");
        date(&mut head);
        head.extend_from_slice(b"\r\n");
    }
    if close == Close::AfterAnswer {
        head.extend_from_slice(b"connection: close\r\n");
    }
    let bodiless = parts.status.is_informational()
        || parts.status == StatusCode::NO_CONTENT
        || parts.status == StatusCode::NOT_MODIFIED;
    if bodiless {
        head.extend_from_slice(b"\r\n");
        write_all(stream, &mut [IoSlice::new(&head)], stall).await?;
        return Ok(close);
    }
    if let Some(len) = body.size_hint().exact() {
        head.extend_from_slice(b"content-length: ");
        head.extend_from_slice(itoa::Buffer::new().format(len).as_bytes());
        head.extend_from_slice(b"\r\n\r\n");
        // Head and body go in one write: usually the body is one frame (a shared `Bytes`).
        let first = next_data(&mut body).await?;
        if let Some(data) = first.as_ref().filter(|data| data.len() as u64 == len) {
            write_all(
                stream,
                &mut [IoSlice::new(&head), IoSlice::new(data)],
                stall,
            )
            .await?;
            return Ok(close);
        }
        let mut chunks: Vec<Bytes> = first.into_iter().collect();
        while let Some(data) = next_data(&mut body).await? {
            chunks.push(data);
        }
        if chunks.iter().map(|chunk| chunk.len() as u64).sum::<u64>() != len {
            // A body that broke its own length: the answer cannot be framed.
            return Err(std::io::ErrorKind::InvalidData.into());
        }
        let mut slices = Vec::with_capacity(1 + chunks.len());
        slices.push(IoSlice::new(&head));
        slices.extend(chunks.iter().map(|chunk| IoSlice::new(chunk)));
        write_all(stream, &mut slices, stall).await?;
        return Ok(close);
    }
    head.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
    write_all(stream, &mut [IoSlice::new(&head)], stall).await?;
    while let Some(data) = next_data(&mut body).await? {
        if data.is_empty() {
            continue;
        }
        let size = format!("{:x}\r\n", data.len());
        write_all(
            stream,
            &mut [
                IoSlice::new(size.as_bytes()),
                IoSlice::new(&data),
                IoSlice::new(b"\r\n"),
            ],
            stall,
        )
        .await?;
    }
    write_all(stream, &mut [IoSlice::new(b"0\r\n\r\n")], stall).await?;
    Ok(close)
}

/// The body's next data frame (trailers are skipped); `None` at its end. A body error ends the
/// connection: the answer cannot be completed.
async fn next_data(body: &mut Body) -> std::io::Result<Option<Bytes>> {
    loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await;
        match frame {
            None => return Ok(None),
            Some(Err(err)) => return Err(std::io::Error::other(err)),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    return Ok(Some(data));
                }
            }
        }
    }
}

/// Writes all of `slices`, waiting for the socket when it is full; fails with `TimedOut` when a
/// wait lasts longer than `stall`.
async fn write_all(
    stream: &TcpStream,
    mut slices: &mut [IoSlice<'_>],
    stall: Option<Duration>,
) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match stream.try_write_vectored(slices) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => match stall {
                Some(limit) => tokio::time::timeout(limit, stream.writable())
                    .await
                    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??,
                None => stream.writable().await?,
            },
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// Appends the current `date` header value (RFC 9110 §5.6.7, formatted by `httpdate`, the crate
/// hyper uses), rendered once per second per thread.
fn date(out: &mut Vec<u8>) {
    let now = crate::clock::now_ms().div_euclid(1000);
    DATE.with_borrow_mut(|(second, text)| {
        if *second != now {
            let at = std::time::UNIX_EPOCH + Duration::from_secs(u64::try_from(now).unwrap_or(0));
            let rendered = httpdate::fmt_http_date(at);
            if rendered.len() == text.len() {
                text.copy_from_slice(rendered.as_bytes());
                *second = now;
            } else {
                out.extend_from_slice(rendered.as_bytes());
                return;
            }
        }
        out.extend_from_slice(&text[..]);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(head: &str) -> Option<(Request, Close, usize)> {
        match parse(&Bytes::copy_from_slice(head.as_bytes())) {
            Parsed::Request(request, close, len) => Some((request, close, len)),
            Parsed::Other => None,
        }
    }

    /// A plain feed poll is this path's, with its path, query and headers as sent.
    #[test]
    fn a_feed_poll_head_is_parsed_here() {
        let head = "GET /realtime/v1/runs/run_1?offset=0_0&live=true HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\nConnection: keep-alive\r\n\r\nGET";
        let (request, close, len) = parsed(head).expect("this path's");
        assert_eq!(
            len,
            head.len() - 3,
            "the pipelined bytes are not the head's"
        );
        assert_eq!(close, Close::No);
        assert_eq!(request.uri().path(), "/realtime/v1/runs/run_1");
        assert_eq!(request.uri().query(), Some("offset=0_0&live=true"));
        assert_eq!(request.headers()["authorization"], "Bearer t");
        assert_eq!(request.version(), Version::HTTP_11);
        let (_, close, _) = parsed("GET / HTTP/1.1\r\nconnection: Close\r\n\r\n").expect("here");
        assert!(
            parsed("GET /r?offset=12_3&handle=h_1&cursor=4_5&live=true HTTP/1.1\r\n\r\n").is_some(),
            "underscores elsewhere"
        );
        assert_eq!(close, Close::AfterAnswer);
    }

    /// Everything whose semantics are hyper's is handed over (see the module docs).
    #[test]
    fn heads_with_other_semantics_are_handed_to_hyper() {
        for head in [
            "POST /realtime/v1/runs HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}",
            "HEAD / HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.0\r\n\r\n",
            "GET / HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            "GET / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n",
            "GET / HTTP/1.1\r\nexpect: 100-continue\r\n\r\n",
            "GET / HTTP/1.1\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
            "GET /realtime/v1/runs/r?live=true&live_sse=true HTTP/1.1\r\n\r\n",
            "GET /realtime/v1/runs/r?experimental_live_sse=true HTTP/1.1\r\n\r\n",
            "GET /realtime/v1/runs/r?live_sse HTTP/1.1\r\n\r\n",
            "GET /realtime/v1/runs/r?live%5Fsse=true HTTP/1.1\r\n\r\n",
            "GET /realtime/v1/runs?tags=live_sse HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nhost: x\r\n",
            "GET http://x/ HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nbad header\r\n\r\n",
        ] {
            assert!(parsed(head).is_none(), "{head:?}");
        }
        let many = format!(
            "GET / HTTP/1.1\r\n{}\r\n",
            "x-a: 1\r\n".repeat(MAX_HEADERS + 1)
        );
        assert!(parsed(&many).is_none(), "more than MAX_HEADERS");
    }

    proptest::proptest! {
        /// Whatever bytes arrive, parsing never panics; a head it takes is a `GET` whose target
        /// is what the request line says, and what it leaves is hyper's.
        #[test]
        fn any_bytes_are_parsed_or_handed_over_without_a_panic(
            line in "GET /[a-z0-9_=&?%+/-]{0,40} HTTP/1\\.[01]",
            headers in proptest::collection::vec("[a-zA-Z-]{1,12}: [ -~]{0,20}", 0..6),
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            cut in 0usize..200,
        ) {
            let mut head = format!("{line}\r\n{}\r\n", headers.iter().map(|h| format!("{h}\r\n")).collect::<String>()).into_bytes();
            let whole = head.len();
            head.extend_from_slice(&noise);
            for bytes in [head.clone(), head[..cut.min(head.len())].to_vec(), noise.clone()] {
                if let Parsed::Request(request, _, len) = parse(&Bytes::from(bytes.clone())) {
                    proptest::prop_assert!(len <= bytes.len());
                    proptest::prop_assert_eq!(request.method(), http::Method::GET);
                    let target = line.split(' ').nth(1).unwrap_or_default();
                    proptest::prop_assert_eq!(request.uri().to_string(), target);
                    proptest::prop_assert_eq!(len, whole);
                }
            }
        }
    }

    /// The `date` value is an IMF-fixdate of now.
    #[test]
    fn the_date_header_is_an_imf_fixdate() {
        let mut out = Vec::new();
        date(&mut out);
        let text = std::str::from_utf8(&out).expect("ascii");
        assert_eq!(text.len(), 29, "{text}");
        assert!(text.ends_with(" GMT"), "{text}");
        let parsed = httpdate::parse_http_date(text).expect("a date");
        let age = std::time::SystemTime::now()
            .duration_since(parsed)
            .unwrap_or_default();
        assert!(age < Duration::from_secs(5), "{age:?}");
    }
}
