//! Request limits: the bounds on what a request may carry (`[server] max_url_bytes`,
//! `max_header_bytes`, `[feeds] max_tags`, `max_tag_bytes`) and the layer that refuses a request
//! over the first two (414 / 431, as JSON) before it reaches a route.

use axum::response::{IntoResponse, Response};

use super::ApiError;

/// Bounds on what a request may carry (`[server] max_url_bytes`, `max_header_bytes`,
/// `[feeds] max_tags`, `max_tag_bytes`).
#[derive(Clone, Copy, Debug)]
pub struct RequestLimits {
    /// Longest request target (path and query), bytes: 414 beyond.
    pub max_url_bytes: usize,
    /// Most header bytes (names and values): 431 beyond.
    pub max_header_bytes: usize,
    /// Most tags a tag feed may filter on (more are refused like any bad parameter).
    pub max_tags: usize,
    /// Longest tag, bytes (a longer one is refused like any bad parameter).
    pub max_tag_bytes: usize,
}

impl RequestLimits {
    /// The limits `config` sets.
    pub fn of(config: &crate::config::Config) -> RequestLimits {
        RequestLimits {
            max_url_bytes: config.server.max_url_bytes,
            max_header_bytes: config.server.max_header_bytes,
            max_tags: config.feeds.max_tags,
            max_tag_bytes: config.feeds.max_tag_bytes,
        }
    }
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits::of(&crate::config::Config::default())
    }
}

/// 414 for an over-long request target, 431 for too many header bytes — as JSON, inside the
/// CORS layer (hyper's own 431 for >100 headers has no body). A plain tower layer: its future
/// is the inner one, with no box or per-request state of its own (memory per held feed).
#[derive(Clone, Copy, Debug)]
pub(super) struct RequestLimitsLayer(pub(super) RequestLimits);

impl<S> tower::Layer<S> for RequestLimitsLayer {
    type Service = RequestLimitsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestLimitsService {
            limits: self.0,
            inner,
        }
    }
}

/// The service [`RequestLimitsLayer`] wraps a service in.
#[derive(Clone, Debug)]
pub(super) struct RequestLimitsService<S> {
    limits: RequestLimits,
    inner: S,
}

impl<S> tower::Service<axum::extract::Request> for RequestLimitsService<S>
where
    S: tower::Service<axum::extract::Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future =
        futures::future::Either<std::future::Ready<Result<Response, S::Error>>, S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: axum::extract::Request) -> Self::Future {
        use futures::future::Either;
        match over_limits(&request, &self.limits) {
            Some(refusal) => Either::Left(std::future::ready(Ok(refusal.into_response()))),
            None => Either::Right(self.inner.call(request)),
        }
    }
}

/// The refusal of a request over `limits`, if it is.
fn over_limits(request: &axum::extract::Request, limits: &RequestLimits) -> Option<ApiError> {
    let target = request
        .uri()
        .path_and_query()
        .map_or(0, |pq| pq.as_str().len());
    if target > limits.max_url_bytes {
        return Some(ApiError::UriTooLong);
    }
    let header_bytes: usize = request
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    (header_bytes > limits.max_header_bytes).then_some(ApiError::HeadersTooLarge)
}
