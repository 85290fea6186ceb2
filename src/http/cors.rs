//! CORS for every route, with pre-encoded header values (memory per held feed).
//!
//! Same headers as tower-http's `CorsLayer` configured with any origin, `GET, HEAD, OPTIONS, POST`,
//! mirrored request headers, any exposed header and a one-day max age. tower-http builds a
//! `HeaderMap` (and re-joins the `vary` list) per request and keeps it in the response future,
//! so a held live poll kept those allocations for its whole hold (~20 s); here the values are
//! static and the response future is the inner one plus nothing.
//!
//! - `OPTIONS` (preflight) is answered here with 200, an empty body, `access-control-allow-origin: *`,
//!   `-allow-methods`, `-allow-headers` (the request's `access-control-request-headers`),
//!   `-max-age` and `vary`.
//! - Any other method: the inner response gets `access-control-allow-origin: *`,
//!   `access-control-expose-headers: *` and `vary` (appended, never replacing), unless its
//!   handler already added them ([`add_response_headers`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::http::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    ACCESS_CONTROL_EXPOSE_HEADERS, ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_HEADERS, VARY,
};
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response};

/// `vary` of every CORS response (tower-http's default list).
const VARY_VALUE: HeaderValue = HeaderValue::from_static(
    "origin, access-control-request-method, access-control-request-headers",
);
const ANY: HeaderValue = HeaderValue::from_static("*");
/// POST: `@electric-sql/client` 1.5 may POST subset snapshots (`subsetMethod: 'POST'`); the
/// preflight must pass for the browser to show the 400 that refuses them.
const METHODS: HeaderValue = HeaderValue::from_static("GET,HEAD,OPTIONS,POST");
/// Preflight cache lifetime, s (one day).
const MAX_AGE_S: HeaderValue = HeaderValue::from_static("86400");

/// The CORS layer (see the module docs).
#[derive(Clone, Copy, Debug, Default)]
pub struct CorsLayer;

impl<S> tower::Layer<S> for CorsLayer {
    type Service = Cors<S>;

    fn layer(&self, inner: S) -> Cors<S> {
        Cors { inner }
    }
}

/// The CORS service (see the module docs).
#[derive(Clone, Debug)]
pub struct Cors<S> {
    inner: S,
}

impl<S, ReqBody, ResBody> tower::Service<Request<ReqBody>> for Cors<S>
where
    S: tower::Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Unpin,
    ResBody: Default,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = CorsFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        if req.method() == Method::OPTIONS {
            return CorsFuture::Preflight(preflight_headers(req.headers()));
        }
        CorsFuture::Call(self.inner.call(req))
    }
}

fn preflight_headers(request: &HeaderMap) -> Option<HeaderMap> {
    let mut headers = HeaderMap::with_capacity(6);
    headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, ANY);
    headers.insert(VARY, VARY_VALUE);
    headers.insert(ACCESS_CONTROL_ALLOW_METHODS, METHODS);
    if let Some(asked) = request.get(ACCESS_CONTROL_REQUEST_HEADERS) {
        headers.insert(ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
    }
    headers.insert(ACCESS_CONTROL_MAX_AGE, MAX_AGE_S);
    Some(headers)
}

/// Adds the CORS headers of an actual (non-preflight) response: `vary` (appended),
/// `access-control-allow-origin: *` and `access-control-expose-headers: *`. A handler that adds
/// them itself while it builds its headers (a feed's 200, `ok` in this module's parent) spares
/// the layer a second pass; the layer adds them to every response that lacks
/// `access-control-allow-origin`.
pub fn add_response_headers(headers: &mut HeaderMap) {
    headers.append(VARY, VARY_VALUE);
    headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, ANY);
    headers.insert(ACCESS_CONTROL_EXPOSE_HEADERS, ANY);
}

/// Response future of [`Cors`]: the inner future, or a ready preflight answer.
pub enum CorsFuture<F> {
    Call(F),
    /// The preflight's headers (taken when answered).
    Preflight(Option<HeaderMap>),
}

impl<F, B, E> Future for CorsFuture<F>
where
    F: Future<Output = Result<Response<B>, E>> + Unpin,
    B: Default,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            CorsFuture::Call(future) => {
                let mut response = std::task::ready!(Pin::new(future).poll(cx))?;
                let headers = response.headers_mut();
                if !headers.contains_key(ACCESS_CONTROL_ALLOW_ORIGIN) {
                    add_response_headers(headers);
                }
                Poll::Ready(Ok(response))
            }
            CorsFuture::Preflight(headers) => {
                let mut response = Response::new(B::default());
                *response.headers_mut() = headers.take().unwrap_or_default();
                Poll::Ready(Ok(response))
            }
        }
    }
}
