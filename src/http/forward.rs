//! Run tokens served by forwarding (`auth.run_token_upstream`, docs/http-api.md "Run tokens").
//!
//! trigger.dev SDK 4.8 authenticates the realtime subscriptions a task makes with the run's own
//! token (`TRIGGER_RUN_TOKEN`, a JWT whose header says `typ: run+jwt`). trigger.dev has not
//! published how the webapp verifies those tokens, so runfeed does not guess: when the setting is
//! present, a feed request whose bearer is a run token is sent to the webapp's same route and the
//! webapp's answer is streamed back (long-polls and SSE included, never buffered).
//!
//! What reaches the webapp is rebuilt, never copied:
//! - **the path** from the parsed route only: `/realtime/v1/runs`, `/realtime/v1/runs/<id>` or
//!   `/realtime/v1/batches/<id>`, with `<id>` 1–128 characters of `[A-Za-z0-9_-]` once
//!   percent-decoded; anything else is a JSON 404 and nothing is sent;
//! - **the query** as the client sent it (it cannot change the path);
//! - **the headers** of [`FORWARDED_REQUEST_HEADERS`] only, and [`FORWARDED_MARK`] (a request
//!   that comes back with it is a loop, refused with a 503).
//!
//! The request limits of the HTTP layer (`server.max_url_bytes`, `server.max_header_bytes`, and
//! hyper's own) apply before anything is forwarded. The token goes to the configured upstream
//! only and is never logged. An unreachable or silent upstream is a JSON 503 with `Retry-After`
//! ([`ApiError::RunTokenUpstream`]).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::header::{ACCEPT, AUTHORIZATION, CONNECTION, USER_AGENT};
use axum::http::uri::{Authority, Scheme};
use axum::http::{HeaderMap, HeaderName, Request, Uri};
use axum::response::{IntoResponse, Response};
use std::future::Future;

use http_body::{Frame, SizeHint};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::route::FeedRoute;
use super::{ApiError, BATCH_ROUTE, RUNS_ROUTE, RUN_ROUTE};
use crate::telemetry::metrics::ForwardOutcome;
use crate::telemetry::Metrics;

/// The request headers sent on to the webapp: the credential, what the SDK and the Electric
/// clients send (`trigger-version`, the `x-trigger-*` headers, `accept`) and `user-agent`.
/// Cookies, `host`, `origin`, proxy and hop-by-hop headers are not forwarded.
pub const FORWARDED_REQUEST_HEADERS: [HeaderName; 7] = [
    AUTHORIZATION,
    HeaderName::from_static("trigger-version"),
    HeaderName::from_static("x-trigger-electric-version"),
    HeaderName::from_static("x-trigger-api-version"),
    HeaderName::from_static("x-trigger-branch"),
    ACCEPT,
    USER_AGENT,
];

/// Marks a request runfeed forwarded. A run-token request that already carries it came back
/// from the upstream (`auth.run_token_upstream` names runfeed or a proxy in front of it instead
/// of the webapp): it is refused with a 503 instead of being forwarded again.
pub const FORWARDED_MARK: HeaderName = HeaderName::from_static("x-runfeed-forwarded");

/// Response headers that describe one connection, not the response (RFC 9110 §7.6.1), dropped
/// from the webapp's answer; so is every header its `connection` header names.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The longest id a forwarded run or batch route may carry, bytes (friendly ids are ~30).
pub const MAX_FORWARDED_ID_BYTES: usize = 128;

/// How long the forwarder waits on the webapp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardTimeouts {
    /// To open a TCP connection (5 s).
    pub connect: Duration,
    /// For the response head once the request is sent (40 s: a live long-poll is held ~20 s
    /// by the webapp, and `@electric-sql/client` 1.5 gives up at 45 s).
    pub head: Duration,
    /// For the next body frame once the head arrived (40 s: Electric's SSE keep-alives come
    /// every 21 s); longer ends the response, and the client reconnects.
    pub body_pause: Duration,
}

impl Default for ForwardTimeouts {
    fn default() -> Self {
        ForwardTimeouts {
            connect: Duration::from_secs(5),
            head: Duration::from_secs(40),
            body_pause: Duration::from_secs(40),
        }
    }
}

/// `auth.run_token_upstream` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// Not an absolute `http://` URL with a host (the configuration check refuses it first).
    #[error("auth.run_token_upstream {0:?} is not an http:// URL with a host")]
    InvalidUpstream(String),
}

/// Sends run-token feed requests to the webapp and streams its answers back (see the module
/// docs). Cheap to share; one connection pool for every request.
pub struct Forwarder {
    client: Client<HttpConnector, axum::body::Body>,
    authority: Authority,
    /// The upstream URL's path without its trailing `/` (usually empty).
    prefix: String,
    timeouts: ForwardTimeouts,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("authority", &self.authority)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl Forwarder {
    /// A forwarder to `upstream` (`http://host:port`, optionally with a path prefix), counting
    /// its outcomes in `metrics`.
    ///
    /// Errors: [`ForwardError::InvalidUpstream`] when `upstream` is not an `http://` URL with
    /// a host.
    pub fn new(
        upstream: &str,
        timeouts: ForwardTimeouts,
        metrics: Arc<Metrics>,
    ) -> Result<Forwarder, ForwardError> {
        let invalid = || ForwardError::InvalidUpstream(upstream.to_string());
        let uri: Uri = upstream.parse().map_err(|_| invalid())?;
        if uri.scheme() != Some(&Scheme::HTTP) || uri.query().is_some() {
            return Err(invalid());
        }
        let authority = uri.authority().cloned().ok_or_else(invalid)?;
        let prefix = uri.path().trim_end_matches('/').to_string();
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeouts.connect));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Forwarder {
            client,
            authority,
            prefix,
            timeouts,
            metrics,
        })
    }

    /// Forwards the run-token request `parts` (a `GET` or `HEAD` on `route`) and answers with
    /// the webapp's response, its body streamed; a JSON 404 when the route is not canonical, a
    /// JSON 503 when the webapp does not answer.
    pub(super) async fn forward(
        self: Arc<Self>,
        route: FeedRoute,
        parts: axum::http::request::Parts,
    ) -> Response {
        let label = match route {
            FeedRoute::Run(_) => RUN_ROUTE,
            FeedRoute::Tags => RUNS_ROUTE,
            FeedRoute::Batch(_) => BATCH_ROUTE,
        };
        if parts.headers.contains_key(FORWARDED_MARK) {
            return self.unavailable(
                label,
                "forwarding loop: the request came back from auth.run_token_upstream, which must \
                 name the webapp itself, not runfeed or the proxy in front of it"
                    .into(),
            );
        }
        let Some(request) = self.request(&route, &parts) else {
            self.metrics
                .run_token_forward(label, ForwardOutcome::Refused);
            return ApiError::NotFound {
                should_retry: false,
            }
            .into_response();
        };
        drop(parts);
        let sent = tokio::time::timeout(self.timeouts.head, self.client.request(request)).await;
        let response = match sent {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => return self.unavailable(label, error_chain(&err)),
            Err(_) => {
                return self.unavailable(
                    label,
                    format!("no response head within {:?}", self.timeouts.head),
                )
            }
        };
        self.metrics
            .run_token_forward(label, ForwardOutcome::Answered);
        let (mut head, body) = response.into_parts();
        strip_hop_by_hop(&mut head.headers);
        let body = PausingBody::new(body, self.timeouts.body_pause);
        Response::from_parts(head, axum::body::Body::new(body))
    }

    fn unavailable(&self, label: &'static str, cause: String) -> Response {
        self.metrics
            .run_token_forward(label, ForwardOutcome::Unavailable);
        ApiError::RunTokenUpstream(format!("{} ({label}): {cause}", self.authority)).into_response()
    }

    /// The request sent to the webapp: the canonical path of `route` under the upstream's
    /// prefix, the client's query, the [`FORWARDED_REQUEST_HEADERS`] and no body. `None` when
    /// the route is not canonical.
    fn request(
        &self,
        route: &FeedRoute,
        parts: &axum::http::request::Parts,
    ) -> Option<Request<axum::body::Body>> {
        let path = canonical_path(route)?;
        let query = parts.uri.query();
        let mut target = String::with_capacity(
            self.prefix.len() + path.len() + query.map_or(0, |q| q.len() + 1),
        );
        target.push_str(&self.prefix);
        target.push_str(&path);
        if let Some(query) = query {
            target.push('?');
            target.push_str(query);
        }
        let uri = Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(self.authority.clone())
            .path_and_query(target)
            .build()
            .ok()?;
        let mut request = Request::builder()
            .method(parts.method.clone())
            .uri(uri)
            .body(axum::body::Body::empty())
            .ok()?;
        let headers = request.headers_mut();
        headers.insert(FORWARDED_MARK, axum::http::HeaderValue::from_static("1"));
        for name in &FORWARDED_REQUEST_HEADERS {
            for value in parts.headers.get_all(name) {
                headers.append(name.clone(), value.clone());
            }
        }
        Some(request)
    }
}

/// The path a run-token request on `route` is forwarded to, rebuilt from the parsed route
/// (never the raw path); `None` when its id is not 1–[`MAX_FORWARDED_ID_BYTES`] characters of
/// `[A-Za-z0-9_-]` once percent-decoded (or not UTF-8).
fn canonical_path(route: &FeedRoute) -> Option<String> {
    match route {
        FeedRoute::Tags => Some(RUNS_ROUTE.to_string()),
        FeedRoute::Run(run) => canonical_id(run).map(|id| format!("/realtime/v1/runs/{id}")),
        FeedRoute::Batch(batch) => {
            canonical_id(batch).map(|id| format!("/realtime/v1/batches/{id}"))
        }
    }
}

/// `id` when it is 1–[`MAX_FORWARDED_ID_BYTES`] characters of `[A-Za-z0-9_-]`.
fn canonical_id(id: &Option<String>) -> Option<&str> {
    id.as_deref().filter(|id| {
        (1..=MAX_FORWARDED_ID_BYTES).contains(&id.len())
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    })
}

/// Drops the hop-by-hop headers of a response, and those its `connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// `err` and its sources, `: `-separated (hyper's top-level error says only "client error").
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The webapp sent nothing for longer than [`ForwardTimeouts::body_pause`] in the middle of a
/// response body.
#[derive(Debug, thiserror::Error)]
#[error("the run token upstream sent nothing for {0:?}")]
pub struct BodyPaused(Duration);

/// A response body passed through frame by frame, ended with [`BodyPaused`] when the next frame
/// takes longer than `pause`.
struct PausingBody<B> {
    inner: B,
    pause: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl<B> PausingBody<B> {
    fn new(inner: B, pause: Duration) -> Self {
        PausingBody {
            inner,
            pause,
            deadline: Box::pin(tokio::time::sleep(pause)),
        }
    }
}

impl<B> http_body::Body for PausingBody<B>
where
    B: http_body::Body + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = B::Data;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                let next = tokio::time::Instant::now() + this.pause;
                this.deadline.as_mut().reset(next);
                Poll::Ready(frame.map(|frame| frame.map_err(Into::into)))
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(BodyPaused(this.pause).into()))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_canonical_ids_make_a_path() {
        let run = |id: &str| canonical_path(&FeedRoute::Run(Some(id.to_string())));
        assert_eq!(
            run("run_1a-B").as_deref(),
            Some("/realtime/v1/runs/run_1a-B")
        );
        for hostile in ["", "..", ".", "a/b", "a%2fb", "a b", "run_1?x", "é", "a\\b"] {
            assert_eq!(run(hostile), None, "{hostile:?}");
        }
        assert!(run(&"a".repeat(MAX_FORWARDED_ID_BYTES)).is_some());
        assert_eq!(run(&"a".repeat(MAX_FORWARDED_ID_BYTES + 1)), None);
        assert_eq!(canonical_path(&FeedRoute::Run(None)), None);
        assert_eq!(
            canonical_path(&FeedRoute::Batch(Some("batch_1".into()))).as_deref(),
            Some("/realtime/v1/batches/batch_1")
        );
        assert_eq!(
            canonical_path(&FeedRoute::Tags).as_deref(),
            Some("/realtime/v1/runs")
        );
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_dropped() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "close, x-private"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("x-private", "1"),
            ("electric-handle", "h"),
            ("content-type", "application/json"),
        ] {
            headers.insert(
                HeaderName::from_static(name),
                axum::http::HeaderValue::from_static(value),
            );
        }
        strip_hop_by_hop(&mut headers);
        let mut left: Vec<&str> = headers.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        assert_eq!(left, ["content-type", "electric-handle"]);
    }

    #[test]
    fn the_upstream_must_be_an_http_url() {
        let metrics = Metrics::noop();
        let ok = |url: &str| Forwarder::new(url, ForwardTimeouts::default(), metrics.clone());
        let prefixed = ok("http://webapp:3030/base/").expect("prefix");
        assert_eq!(prefixed.prefix, "/base");
        assert_eq!(ok("http://webapp:3030").expect("plain").prefix, "");
        for bad in ["https://webapp", "webapp:3030", "http://webapp/?q=1"] {
            assert!(ok(bad).is_err(), "{bad}");
        }
    }

    /// A webapp that accepts the connection but never answers: a JSON 503 once the head
    /// timeout passes (the client gets `Retry-After` and retries), counted `unavailable`.
    #[tokio::test]
    async fn a_silent_upstream_is_a_503_after_the_head_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let silent = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        let timeouts = ForwardTimeouts {
            head: Duration::from_millis(200),
            ..ForwardTimeouts::default()
        };
        let metrics = Metrics::noop();
        let forwarder = Arc::new(
            Forwarder::new(&format!("http://{addr}"), timeouts, metrics).expect("forwarder"),
        );
        let (parts, ()) = Request::get("/realtime/v1/runs/run_1?offset=-1")
            .body(())
            .expect("request")
            .into_parts();
        let response = forwarder
            .forward(FeedRoute::Run(Some("run_1".into())), parts)
            .await;
        assert_eq!(response.status(), 503);
        assert_eq!(
            response.headers()["retry-after"],
            super::super::error::RETRY_AFTER_S
        );
        silent.abort();
    }
}
