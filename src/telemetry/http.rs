//! HTTP observability: the feed listener's one middleware ([`instrument`]: request metrics, the
//! request span, the 5xx error log), and the same span and log as a tower-http layer for the
//! admin listener ([`trace_layer`]).
//!
//! The span, at `debug` level, carries method, route (the matched path pattern), path, `live`,
//! the environment id (recorded by the handler once authenticated, [`record_env_id`]), status,
//! outcome and latency. Headers and the query string are never recorded: bearer tokens stay out
//! of the logs. On the feed listener [`Track`] makes the span itself, from the start time it
//! keeps for the metrics anyway: a second layer would read the clock again, wrap the response
//! body and box it once more on every poll (BENCHMARKS.md "Cost per unit of work").

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::response::Response;
use http_body::{Body as _, Frame, SizeHint};
use tokio::time::Instant;
use tower_http::classify::{ServerErrorsAsFailures, SharedClassifier};
use tower_http::trace::{DefaultOnRequest, MakeSpan, OnResponse, TraceLayer};
use tracing::field::Empty;
use tracing::Span;

use super::{Liveness, Metrics};

/// Route label of requests outside every route (404 fallback).
pub const UNMATCHED: &str = "unmatched";

/// The `route` label of a request path: the route pattern that serves it, or [`UNMATCHED`]
/// (the HTTP layer knows its routes; the layers here run around the whole router, before it
/// matched anything).
pub type RouteOf = fn(&str) -> &'static str;

/// The request span layer (tower-http `TraceLayer` with runfeed's span and response log) for
/// listeners other than the feed listener (the admin listener); `route_of` names the route of a
/// request path. The feed listener's [`Track`] makes the same span and logs without a layer.
pub fn trace_layer(
    route_of: RouteOf,
) -> TraceLayer<SharedClassifier<ServerErrorsAsFailures>, RequestSpan, DefaultOnRequest, ResponseLog>
{
    TraceLayer::new_for_http()
        .make_span_with(RequestSpan(route_of))
        .on_response(ResponseLog)
}

/// Records the authenticated environment id on the current request span.
pub fn record_env_id(env_id: &str) {
    Span::current().record("env_id", env_id);
}

/// Whether the query asks for a live poll (`live=true`, last value wins like the feed parser).
/// One vectorised substring search for `live=` (`memchr::memmem`), no split of every pair: it
/// runs on every request.
fn is_live(query: Option<&str>) -> bool {
    let Some(query) = query else {
        return false;
    };
    // Built once: a searcher built per call cost more than the search.
    static LIVE: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"live="));
    let bytes = query.as_bytes();
    let mut live = false;
    for at in LIVE.find_iter(bytes) {
        if at == 0 || bytes[at - 1] == b'&' {
            let value = &bytes[at + b"live=".len()..];
            let end = memchr::memchr(b'&', value).unwrap_or(value.len());
            live = &value[..end] == b"true";
        }
    }
    live
}

/// Outcome label of a status.
fn outcome(status: u16) -> &'static str {
    match status {
        200..=299 => "ok",
        409 => "must_refetch",
        429 => "rejected",
        400..=499 => "client_error",
        _ => "server_error",
    }
}

/// Makes the `request` span, at `debug` level: at the default `info` filter no span is built
/// (building and formatting one cost about a fifth of an ended live poll's instructions,
/// BENCHMARKS.md "Cost per unit of work"); `RUST_LOG=info,runfeed::telemetry::http=debug` turns
/// them on. 5xx responses are logged at `error` either way (the layer's failure classifier).
#[derive(Clone, Copy, Debug)]
pub struct RequestSpan(RouteOf);

impl<B> MakeSpan<B> for RequestSpan {
    fn make_span(&mut self, req: &axum::http::Request<B>) -> Span {
        tracing::debug_span!(
            "request",
            method = %req.method(),
            route = (self.0)(req.uri().path()),
            path = req.uri().path(),
            live = is_live(req.uri().query()),
            env_id = Empty,
            status = Empty,
            outcome = Empty,
            latency_ms = Empty,
        )
    }
}

/// Records status, outcome and latency on the span and logs the response at debug level
/// (server errors are also logged at error level by the layer's failure classifier).
#[derive(Clone, Copy, Debug, Default)]
pub struct ResponseLog;

impl<B> OnResponse<B> for ResponseLog {
    fn on_response(self, response: &axum::http::Response<B>, latency: Duration, span: &Span) {
        let status = response.status().as_u16();
        let latency_ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
        span.record("status", status);
        span.record("outcome", outcome(status));
        span.record("latency_ms", latency_ms);
        tracing::debug!(parent: span, status, latency_ms, "response");
    }
}

/// Wraps `service` in the HTTP metrics middleware (requests by route, method and status;
/// duration by route, status and live; body bytes by route; `route_of` names the route). A
/// request whose client goes away first counts as status 499. A plain tower service whose
/// future is the inner one plus the request's [`Pending`] record (no box, no per-request
/// strings: memory per held feed).
pub fn instrument<S>(service: S, metrics: Arc<Metrics>, route_of: RouteOf) -> Track<S> {
    Track {
        metrics,
        route_of,
        inner: service,
    }
}

/// The service of [`instrument`].
#[derive(Clone)]
pub struct Track<S> {
    metrics: Arc<Metrics>,
    route_of: RouteOf,
    inner: S,
}

impl<S> tower::Service<Request> for Track<S>
where
    S: tower::Service<Request, Response = Response>,
    S::Future: Unpin,
{
    type Response = Response;
    type Error = S::Error;
    type Future = TrackFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let route = (self.route_of)(req.uri().path());
        // `Span::none()` unless `debug` is enabled for this module: no field is evaluated then.
        let span = RequestSpan(self.route_of).make_span(&req);
        let pending = Pending {
            route,
            method: req.method().clone(),
            live: if is_live(req.uri().query()) {
                Liveness::Live
            } else {
                Liveness::NotLive
            },
            started: Instant::now(),
            metrics: self.metrics.clone(),
            done: false,
        };
        let inner = {
            let _entered = span.enter();
            self.inner.call(req)
        };
        TrackFuture {
            inner,
            pending,
            span,
        }
    }
}

/// Response future of [`Track`]: polls the inner future inside the request span, then counts
/// the response (or a 499 if dropped first), logs it (5xx at `error`) and counts its body bytes.
pub struct TrackFuture<F> {
    inner: F,
    pending: Pending,
    span: Span,
}

impl<F, E> std::future::Future for TrackFuture<F>
where
    F: std::future::Future<Output = Result<Response, E>> + Unpin,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let response = {
            let _entered = this.span.enter();
            std::task::ready!(Pin::new(&mut this.inner).poll(cx))?
        };
        let (pending, span) = (&mut this.pending, &this.span);
        pending.done = true;
        let status = response.status().as_u16();
        let latency = pending.started.elapsed();
        let m = &pending.metrics;
        m.http_request(
            pending.route,
            pending.method.as_str(),
            status,
            pending.live,
            latency,
        );
        if !span.is_disabled() {
            ResponseLog.on_response(&response, latency, span);
        }
        if status >= 500 {
            let latency_ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
            tracing::error!(parent: span, status, latency_ms, route = pending.route, "response failed");
        }
        // A body of known length (every feed response but an SSE stream) is counted now, as
        // it is handed to the connection; only a stream is wrapped to count what it yields.
        if let Some(bytes) = response.body().size_hint().exact() {
            if bytes > 0 {
                m.http_bytes(pending.route, bytes);
            }
            return Poll::Ready(Ok(response));
        }
        let (parts, body) = response.into_parts();
        let counted = CountedBody {
            inner: body,
            bytes: 0,
            metrics: m.clone(),
            route: pending.route,
        };
        Poll::Ready(Ok(Response::from_parts(parts, Body::new(counted))))
    }
}

/// Counts the request as 499 if dropped before the response.
struct Pending {
    metrics: Arc<Metrics>,
    route: &'static str,
    method: axum::http::Method,
    live: Liveness,
    started: Instant,
    done: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.done {
            self.metrics.http_request(
                self.route,
                self.method.as_str(),
                499,
                self.live,
                self.started.elapsed(),
            );
        }
    }
}

/// A response body that adds the bytes it yielded to `runfeed.http.sent` when dropped.
struct CountedBody {
    inner: Body,
    bytes: u64,
    metrics: Arc<Metrics>,
    route: &'static str,
}

impl http_body::Body for CountedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                this.bytes += data.len() as u64;
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for CountedBody {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.metrics.http_bytes(self.route, self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_is_the_last_value() {
        assert!(is_live(Some("offset=1_2&live=true")));
        assert!(!is_live(Some("live=true&live=false")));
        assert!(!is_live(Some("live=1")));
        assert!(!is_live(None));
        assert!(is_live(Some("live=true")));
        assert!(!is_live(Some("olive=true&xlive=true")));
        assert!(is_live(Some("live_sse=false&live=true&cursor=1")));
        assert!(!is_live(Some("live=truer")));
        assert!(!is_live(Some("live=")));
    }

    /// A `Write` that appends to a shared buffer (captured log output).
    #[derive(Clone, Default)]
    struct Captured(Arc<parking_lot::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Log output (JSON lines) of `req` sent through `app` wrapped by [`instrument`], with
    /// `max_level` enabled.
    fn logged(
        app: axum::Router,
        req: axum::http::Request<Body>,
        max_level: tracing::Level,
    ) -> String {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_max_level(max_level)
            .with_current_span(true)
            .with_span_list(true)
            .with_writer(move || writer.clone())
            .finish();
        let service = instrument(app, Metrics::noop(), |path| {
            if path.starts_with("/feed/") {
                "/feed/{id}"
            } else {
                UNMATCHED
            }
        });
        tracing::subscriber::with_default(subscriber, || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                tower::ServiceExt::oneshot(service, req)
                    .await
                    .expect("response");
            });
        });
        let out = String::from_utf8(captured.0.lock().clone()).expect("utf-8");
        out
    }

    #[test]
    fn request_span_has_route_env_and_status_but_no_credentials() {
        let app = axum::Router::new().route(
            "/feed/{id}",
            axum::routing::get(|| async {
                record_env_id("env_123");
                "ok"
            }),
        );
        let req = axum::http::Request::builder()
            .uri("/feed/run_1?live=true&token=query-secret")
            .header("authorization", "Bearer header-secret")
            .body(Body::empty())
            .expect("request");
        let out = logged(app, req, tracing::Level::DEBUG);
        assert!(out.contains(r#""route":"/feed/{id}""#), "{out}");
        assert!(out.contains(r#""path":"/feed/run_1""#), "{out}");
        assert!(out.contains(r#""live":true"#), "{out}");
        assert!(out.contains(r#""env_id":"env_123""#), "{out}");
        assert!(
            out.contains(r#""status":200"#) && out.contains(r#""outcome":"ok""#),
            "{out}"
        );
        assert!(
            !out.contains("header-secret") && !out.contains("query-secret"),
            "credentials logged: {out}"
        );
    }

    #[test]
    fn a_server_error_is_logged_at_error_without_the_debug_span() {
        let app = axum::Router::new().route(
            "/feed/{id}",
            axum::routing::get(|| async { axum::http::StatusCode::SERVICE_UNAVAILABLE }),
        );
        let req = axum::http::Request::builder()
            .uri("/feed/run_1?token=query-secret")
            .body(Body::empty())
            .expect("request");
        let out = logged(app, req, tracing::Level::INFO);
        assert!(out.contains(r#""level":"ERROR""#), "{out}");
        assert!(out.contains(r#""status":503"#), "{out}");
        assert!(out.contains(r#""route":"/feed/{id}""#), "{out}");
        assert!(!out.contains("query-secret"), "credentials logged: {out}");
        assert_eq!(out.lines().count(), 1, "only the error line at info: {out}");
    }

    #[test]
    fn outcomes() {
        assert_eq!(outcome(200), "ok");
        assert_eq!(outcome(409), "must_refetch");
        assert_eq!(outcome(429), "rejected");
        assert_eq!(outcome(401), "client_error");
        assert_eq!(outcome(503), "server_error");
    }
}
