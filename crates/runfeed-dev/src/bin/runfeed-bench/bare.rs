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
    match req.uri().path() {
        "/count" => return Ok(text(counts.parked.load(Ordering::Relaxed).to_string())),
        "/metrics" => {
            return Ok(text(format!(
                "# runfeed-bench bare: parked and answered feed requests\n\
                 runfeed_router_held_feeds {}\nrunfeed_http_requests_total {}\n",
                counts.parked.load(Ordering::Relaxed),
                counts.answered.load(Ordering::Relaxed),
            )))
        }
        _ => {}
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
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .keep_alive(true)
        .half_close(false)
        .writev(true)
        .header_read_timeout(
            (a.header_read_timeout_ms > 0).then(|| Duration::from_millis(a.header_read_timeout_ms)),
        );
    let listener = tokio::net::TcpListener::bind(&a.listen).await?;
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
        let counts = counts.clone();
        let service = hyper::service::service_fn(move |req| handle(req, counts.clone(), hold));
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            let _ = conn.await;
        });
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
