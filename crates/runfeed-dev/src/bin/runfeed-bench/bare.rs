//! `bare`: the floor of a feed request. A server that does nothing but hyper's HTTP/1.1 and a
//! timer, served the way runfeed serves (`src/http/serve.rs`: hyper's `http1::Builder` with
//! keep-alive, `writev`, the same header-read timeout, `TCP_NODELAY`, one task per connection),
//! so the CPU a request cycle costs it is the floor of what the same cycle costs runfeed.
//!
//! - A feed request with `live=true` is parked for `--hold-ms`, then answered `up-to-date`; any
//!   other feed request (the snapshot, `offset=-1`) is answered at once. Both answers carry the
//!   headers and body of runfeed's (the Electric headers `Bench::snapshot` and `Bench::live`
//!   parse, CORS, `cache-control`; static values, about as many bytes), so the two put the same
//!   bytes through the kernel. No authentication, routing or state.
//! - `/metrics` exports the parked requests as `runfeed_router_held_feeds` and the answered feed
//!   requests as `runfeed_http_requests_total`: with `--admin-url` set to the bare server's own
//!   URL, `idle` and `held` read it like runfeed's admin listener. `/count` is the parked count
//!   alone. Neither counts as an answered request.
//!
//! It is the baseline of `held` (RSS per parked request) and of `scripts/bench-floor.sh` (CPU per
//! ended live poll under `idle`).
//!
//! `--engine raw` serves the same answers without hyper: a hand-written HTTP/1.1 keep-alive loop
//! per connection that reads into one scratch buffer per thread (so a parked connection holds no
//! read buffer at all, and nothing is handed back with `madvise`), parses the head with
//! `httparse`, and writes each answer as one pre-built byte string (`date` fixed, same length as
//! hyper's). No header-read timeout, no pipelining beyond keeping the extra bytes. It measures
//! what a connection layer of runfeed's own could cost against hyper's (BENCHMARKS.md "Cost per
//! unit of work").

use super::*;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderName, HeaderValue};
use hyper_util::rt::{TokioIo, TokioTimer};

#[derive(Args)]
pub(crate) struct BareArgs {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// How long a `live=true` request is parked before its `up-to-date` answer (ms).
    #[arg(long, default_value_t = 600_000)]
    hold_ms: u64,
    /// hyper's header-read timeout (ms, 0 disables): runfeed's `server.header_read_timeout_ms`.
    #[arg(long, default_value_t = 10_000)]
    header_read_timeout_ms: u64,
    /// The HTTP/1.1 connection layer: hyper's, as runfeed serves, or a hand-written one.
    #[arg(long, value_enum, default_value_t = Engine::Hyper)]
    engine: Engine,
}

/// Which HTTP/1.1 connection layer serves the requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Engine {
    /// hyper's `http1::Builder`, configured as runfeed's `src/http/serve.rs`.
    Hyper,
    /// A hand-written keep-alive loop (see the module docs).
    Raw,
}

/// The body of every feed answer.
const UP_TO_DATE: &[u8] = br#"[{"headers":{"control":"up-to-date"}}]"#;

/// The headers of a feed answer, as runfeed sends them (values of the same length).
const FEED_HEADERS: [(&str, &str); 9] = [
    ("content-type", "application/json"),
    ("cache-control", "no-store"),
    (
        "vary",
        "origin, access-control-request-method, access-control-request-headers",
    ),
    ("access-control-allow-origin", "*"),
    ("access-control-expose-headers", "*"),
    (
        "electric-handle",
        "t.WyJiYXJlYmFyZWJhcmViYXJlYmFyZWJhcmUiLCJiYXJlYmFyZWJhcmViYXJlYmFyZWJhcmViYXJlYmFyZSIsMTc5NjM1NDU4MDAwMCw2NzEwODg2MywwXQ.YmFyZWJhcmViYXJlYmFyZQ",
    ),
    ("electric-offset", "1796441017416_1796441017431510"),
    ("electric-cursor", "1796441018688764"),
    ("electric-up-to-date", "true"),
];

/// The schema header of a snapshot answer.
const SCHEMA: &str =
    r#"{"id":{"type":"text"},"status":{"type":"text"},"runTags":{"type":"text","dims":1}}"#;

/// What the server counts.
#[derive(Default)]
struct Counts {
    /// Feed requests parked now.
    parked: AtomicUsize,
    /// Feed requests answered since the start.
    answered: AtomicU64,
}

impl Counts {
    /// The text answer of `/count` (the parked count) or `/metrics` (both counts, under the
    /// names runfeed exports); `None` for any other path.
    fn text(&self, path: &str) -> Option<String> {
        let parked = self.parked.load(Ordering::Relaxed);
        match path {
            "/count" => Some(parked.to_string()),
            "/metrics" => Some(format!(
                "# runfeed-bench bare: parked and answered feed requests\n\
                 runfeed_router_held_feeds {parked}\nrunfeed_http_requests_total {}\n",
                self.answered.load(Ordering::Relaxed),
            )),
            _ => None,
        }
    }
}

/// Takes a request off the parked count when its hold ends or its connection goes.
struct Parked<'a>(&'a AtomicUsize);

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

type Response = hyper::Response<Full<Bytes>>;

fn text(body: String) -> Response {
    let mut r = hyper::Response::new(Full::new(Bytes::from(body)));
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    r
}

/// A feed answer (`up-to-date`); the snapshot's also carries `electric-schema`.
fn feed_answer(snapshot: bool) -> Response {
    let mut r = hyper::Response::new(Full::new(Bytes::from_static(UP_TO_DATE)));
    let headers = r.headers_mut();
    for (name, value) in FEED_HEADERS {
        headers.insert(
            HeaderName::from_static(name),
            HeaderValue::from_static(value),
        );
    }
    if snapshot {
        headers.insert(
            HeaderName::from_static("electric-schema"),
            HeaderValue::from_static(SCHEMA),
        );
    }
    r
}

/// Whether the query asks for a live answer (`live=true`).
fn is_live(query: Option<&str>) -> bool {
    query.is_some_and(|q| q.split('&').any(|kv| kv == "live=true"))
}

async fn handle(
    req: hyper::Request<hyper::body::Incoming>,
    counts: Arc<Counts>,
    hold: Duration,
) -> Result<Response, std::convert::Infallible> {
    if let Some(body) = counts.text(req.uri().path()) {
        return Ok(text(body));
    }
    let live = is_live(req.uri().query());
    drop(req);
    if live {
        counts.parked.fetch_add(1, Ordering::Relaxed);
        let _parked = Parked(&counts.parked);
        tokio::time::sleep(hold).await;
    }
    counts.answered.fetch_add(1, Ordering::Relaxed);
    Ok(feed_answer(!live))
}

pub(crate) async fn bare(a: BareArgs) -> anyhow::Result<()> {
    let counts = Arc::new(Counts::default());
    let hold = Duration::from_millis(a.hold_ms);
    if a.engine == Engine::Raw {
        return raw::serve(&a.listen, counts, hold).await;
    }
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .keep_alive(true)
        .half_close(false)
        .writev(true)
        .header_read_timeout(
            (a.header_read_timeout_ms > 0).then(|| Duration::from_millis(a.header_read_timeout_ms)),
        );
    accept_loop(&a.listen, |stream| {
        let counts = counts.clone();
        let service = hyper::service::service_fn(move |req| handle(req, counts.clone(), hold));
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    })
    .await
}

/// Listens on `listen`, prints the banner the scripts wait for, and hands every accepted
/// connection (`TCP_NODELAY` set) to `serve`. Accept errors are printed and retried.
async fn accept_loop(
    listen: &str,
    mut serve: impl FnMut(tokio::net::TcpStream),
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("bare listening on http://{}", listener.local_addr()?);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                eprintln!("bare: accept: {err}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        serve(stream);
    }
}

/// The hand-written connection layer of `--engine raw`.
mod raw {
    use std::cell::RefCell;
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, LazyLock};
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpStream;

    use super::{feed_answer, is_live, text, Counts, Parked};

    /// Bytes read per `read` call, in one buffer per thread.
    const SCRATCH: usize = 16 * 1024;
    /// A head larger than this closes the connection.
    const MAX_HEAD: usize = 64 * 1024;

    thread_local! {
        static BUF: RefCell<Vec<u8>> = RefCell::new(vec![0; SCRATCH]);
    }

    /// A whole response (head and body) as bytes: hyper's head for the same `Response`, with a
    /// fixed `date` of the length hyper writes.
    fn encode(r: &super::Response, body: &[u8]) -> Vec<u8> {
        let mut out = b"HTTP/1.1 200 OK\r\n".to_vec();
        for (name, value) in r.headers() {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
        out.extend_from_slice(b"date: Mon, 07 Dec 2026 22:00:00 GMT\r\n\r\n");
        out.extend_from_slice(body);
        out
    }

    static LIVE: LazyLock<Vec<u8>> =
        LazyLock::new(|| encode(&feed_answer(false), super::UP_TO_DATE));
    static SNAPSHOT: LazyLock<Vec<u8>> =
        LazyLock::new(|| encode(&feed_answer(true), super::UP_TO_DATE));

    /// What a complete head asks for.
    enum Ask {
        Live,
        Snapshot,
        Text(String),
    }

    /// Parses `buf` as a request head: `Some((ask, head length))` once complete, `Ok(None)`
    /// while partial.
    fn parse(buf: &[u8], counts: &Counts) -> Result<Option<(Ask, usize)>, httparse::Error> {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        let httparse::Status::Complete(len) = req.parse(buf)? else {
            return Ok(None);
        };
        let target = req.path.unwrap_or("/");
        let (path, query) = match target.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (target, None),
        };
        let ask = match counts.text(path) {
            Some(body) => Ask::Text(body),
            None if is_live(query) => Ask::Live,
            None => Ask::Snapshot,
        };
        Ok(Some((ask, len)))
    }

    /// How one read ended.
    enum Read {
        /// A complete head (its bytes consumed from the connection's pending bytes).
        Head(Ask),
        /// Nothing more to read now.
        Again,
        /// The client closed, sent garbage or too large a head.
        Close,
    }

    /// Reads what the socket has into the thread's scratch buffer and parses the head from it
    /// (or from `pending`, the bytes of a head that spans reads, or pipelined after one).
    fn read_head(stream: &TcpStream, pending: &mut Vec<u8>, counts: &Counts) -> Read {
        if !pending.is_empty() {
            if let Some(read) = parse_pending(pending, counts) {
                return read;
            }
        }
        BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            let n = match stream.try_read(&mut buf) {
                Ok(0) => return Read::Close,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Read::Again,
                Err(_) => return Read::Close,
            };
            if pending.is_empty() {
                match parse(&buf[..n], counts) {
                    Ok(Some((ask, len))) => {
                        pending.extend_from_slice(&buf[len..n]);
                        Read::Head(ask)
                    }
                    Ok(None) => {
                        pending.extend_from_slice(&buf[..n]);
                        Read::Again
                    }
                    Err(_) => Read::Close,
                }
            } else {
                pending.extend_from_slice(&buf[..n]);
                parse_pending(pending, counts).unwrap_or(Read::Again)
            }
        })
    }

    fn parse_pending(pending: &mut Vec<u8>, counts: &Counts) -> Option<Read> {
        match parse(pending, counts) {
            Ok(Some((ask, len))) => {
                pending.drain(..len);
                if pending.is_empty() {
                    *pending = Vec::new();
                }
                Some(Read::Head(ask))
            }
            Ok(None) if pending.len() > MAX_HEAD => Some(Read::Close),
            Ok(None) => None,
            Err(_) => Some(Read::Close),
        }
    }

    /// One connection: heads in, answers out, until the client closes.
    async fn connection(mut stream: TcpStream, counts: Arc<Counts>, hold: Duration) {
        let mut pending = Vec::new();
        loop {
            let ask = match read_head(&stream, &mut pending, &counts) {
                Read::Head(ask) => ask,
                Read::Again => {
                    if stream.readable().await.is_err() {
                        return;
                    }
                    continue;
                }
                Read::Close => return,
            };
            let written = match ask {
                Ask::Text(body) => {
                    stream
                        .write_all(&encode(&text(body.clone()), body.as_bytes()))
                        .await
                }
                Ask::Snapshot => {
                    counts.answered.fetch_add(1, Ordering::Relaxed);
                    stream.write_all(&SNAPSHOT).await
                }
                Ask::Live => {
                    counts.parked.fetch_add(1, Ordering::Relaxed);
                    let parked = Parked(&counts.parked);
                    // Held: the hold's timer, or the client closing (bytes sent meanwhile are
                    // kept for the next head, at most MAX_HEAD of them).
                    let sleep = tokio::time::sleep(hold);
                    tokio::pin!(sleep);
                    loop {
                        tokio::select! {
                            () = &mut sleep => break,
                            ready = stream.readable() => {
                                if ready.is_err() { return; }
                                let mut byte = [0u8; 1];
                                match stream.try_read(&mut byte) {
                                    Ok(0) => return,
                                    Ok(_) if pending.len() >= MAX_HEAD => return,
                                    Ok(_) => pending.push(byte[0]),
                                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                                    Err(_) => return,
                                }
                            }
                        }
                    }
                    drop(parked);
                    counts.answered.fetch_add(1, Ordering::Relaxed);
                    stream.write_all(&LIVE).await
                }
            };
            if written.is_err() {
                return;
            }
        }
    }

    /// Accepts connections on `listen` and serves each on a task of its own.
    pub(super) async fn serve(
        listen: &str,
        counts: Arc<Counts>,
        hold: Duration,
    ) -> anyhow::Result<()> {
        super::accept_loop(listen, |stream| {
            tokio::spawn(connection(stream, counts.clone(), hold));
        })
        .await
    }

    #[cfg(test)]
    mod tests {
        use tokio::io::AsyncReadExt;

        use super::*;

        /// Reads one whole answer (head and its `content-length` body) off `client`.
        async fn answer(client: &mut TcpStream) -> String {
            let mut got = Vec::new();
            loop {
                let mut chunk = [0u8; 4096];
                let n = client.read(&mut chunk).await.expect("read");
                assert!(n > 0, "the server closed before answering");
                got.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&got).to_string();
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .and_then(|v| v.parse().ok())
                        .expect("content-length");
                    if body.len() >= len {
                        return text;
                    }
                }
            }
        }

        /// A client connected to one raw connection task (20 ms holds): the client, the
        /// server's counts, and the task, which ends when the connection does.
        async fn one_connection() -> (TcpStream, Arc<Counts>, tokio::task::JoinHandle<()>) {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("addr");
            let counts = Arc::new(Counts::default());
            let server = {
                let counts = counts.clone();
                tokio::spawn(async move {
                    let (stream, _) = listener.accept().await.expect("accept");
                    connection(stream, counts, Duration::from_millis(20)).await;
                })
            };
            let client = TcpStream::connect(addr).await.expect("connect");
            (client, counts, server)
        }

        /// A head split over two reads is answered once complete, and a second request on the
        /// same connection (sent with the first, pipelined) is answered after it.
        #[tokio::test]
        async fn a_raw_connection_answers_split_and_pipelined_heads_in_order() {
            let (mut client, counts, server) = one_connection().await;
            client
                .write_all(b"GET /v1/shape?offset=-1 HTTP/1.1\r\nhost: x\r")
                .await
                .expect("write");
            client.flush().await.expect("flush");
            tokio::task::yield_now().await;
            client
                .write_all(b"\n\r\nGET /v1/shape?live=true&offset=1_2 HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .expect("write");
            let first = answer(&mut client).await;
            assert!(
                first.contains("electric-schema"),
                "the snapshot first: {first}"
            );
            let second = answer(&mut client).await;
            assert!(
                !second.contains("electric-schema"),
                "then the live answer: {second}"
            );
            assert!(second.contains("up-to-date"));
            assert_eq!(counts.answered.load(Ordering::Relaxed), 2);
            assert_eq!(counts.parked.load(Ordering::Relaxed), 0, "the hold ended");
            drop(client);
            server
                .await
                .expect("the connection ends when the client closes");
        }

        /// A malformed head closes the connection without an answer.
        #[tokio::test]
        async fn a_raw_connection_closes_on_a_malformed_head() {
            let (mut client, _counts, server) = one_connection().await;
            client
                .write_all(b"\x01\x02 nonsense\r\n\r\n")
                .await
                .expect("write");
            let mut rest = Vec::new();
            client.read_to_end(&mut rest).await.expect("read");
            assert!(rest.is_empty(), "no answer to garbage");
            server.await.expect("server task");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_live_true_is_live() {
        assert!(is_live(Some("tags=a&live=true&offset=1_2")));
        assert!(is_live(Some("live=true")));
        assert!(!is_live(Some("tags=a&offset=-1")));
        assert!(!is_live(Some("live=false&offset=1_2")));
        assert!(!is_live(Some("live_sse=true")));
        assert!(!is_live(None));
    }

    #[test]
    fn a_snapshot_answer_carries_the_schema_and_a_live_one_does_not() {
        let snap = feed_answer(true);
        let live = feed_answer(false);
        for name in [
            "electric-handle",
            "electric-offset",
            "electric-cursor",
            "electric-up-to-date",
        ] {
            assert!(snap.headers().contains_key(name), "{name}");
            assert!(live.headers().contains_key(name), "{name}");
        }
        assert!(snap.headers().contains_key("electric-schema"));
        assert!(!live.headers().contains_key("electric-schema"));
    }
}
