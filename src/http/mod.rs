//! HTTP: axum routes, request parsing, admission, status mapping and CORS (docs/trigger-dev.md
//! §2.1, docs/protocol.md §5–§6, §10). This file holds the shared state ([`AppState`]) and the
//! router wiring ([`app`]); every handler returns [`ApiError`] on failure.
//!
//! Check order per trigger.dev's `createLoaderApiRoute`: authenticate (401) → parse (400; 422
//! for clients without `x-trigger-electric-version`, which loop on 400) → find the resource in
//! the authenticated environment (404) → scopes (403) → feed (200 / 409 / 503).
//!
//! The other concerns, one file each: `handlers` (the feed routes' handlers: authentication,
//! the checks, serving the feed and its 200), `params` (query parsing), `limits` (request
//! limits), `dispatch` (the feed routes' `GET`s without the router), `route` (which feed route a
//! path is), [`error`], [`cors`], [`sse`], [`forward`] and [`serve`] (the accept loop).
//! Admission (the live-poll concurrency limit) is `feeds::admit`'s.

pub mod cors;
mod dispatch;
pub mod error;
pub mod forward;
mod h1;
mod handlers;
mod limits;
mod params;
mod route;
pub mod serve;
pub mod sse;

use std::sync::Arc;

use axum::response::Response;
use axum::routing::get;
use axum::Json;
use serde_json::json;

use crate::auth::Authenticator;
use crate::feeds::admit::Limiter;
use crate::feeds::Feeds;
pub use error::ApiError;
pub use handlers::{SUBSET_BODY_MAX_BYTES, SUBSET_BODY_READ};
pub use limits::RequestLimits;
use limits::RequestLimitsLayer;

/// The current trigger.dev API version (`x-trigger-api-version`); any other value gets the
/// legacy `DEQUEUED → EXECUTING` rewrite (docs/trigger-dev.md §3).
pub const CURRENT_API_VERSION: &str = "2025-07-16";

/// Response header of a tag feed whose `createdAt` asked for more than
/// `feeds.maximum_created_at_filter_age_ms`: its value is the window served, ms
/// (docs/http-api.md "`createdAt` clamp (tag feeds)"). Without it, the requested window was
/// served as asked.
pub const CREATED_AT_CLAMPED_HEADER: &str = "x-runfeed-created-at-clamped";

/// Shared state of the HTTP layer.
#[derive(Clone)]
pub struct AppState {
    pub feeds: Arc<Feeds>,
    pub auth: Arc<Authenticator>,
    /// Per-environment live-poll limit.
    pub limiter: Arc<Limiter>,
    /// Tag feed lookback ceiling, ms.
    pub max_created_at_age_ms: u64,
    /// Request size limits.
    pub limits: RequestLimits,
    /// Where feed requests carrying a run token go (`auth.run_token_upstream`); `None` = they
    /// get a JSON 401 naming the token type.
    pub forwarder: Option<Arc<forward::Forwarder>>,
}

/// Route pattern of one run's feed (also its `route` metric label).
pub const RUN_ROUTE: &str = "/realtime/v1/runs/{run_id}";
/// Route pattern of the tag feed.
pub const RUNS_ROUTE: &str = "/realtime/v1/runs";
/// Route pattern of a batch's feed.
pub const BATCH_ROUTE: &str = "/realtime/v1/batches/{batch_id}";
/// Route pattern of the liveness probe on the public port.
pub const HEALTH_ROUTE: &str = "/healthz";

/// The route pattern the router serves `path` with (what axum's `MatchedPath` says: a
/// `{param}` is one non-empty segment), or `unmatched`. The layers around the router name a
/// request's route with it before the router runs.
pub fn route_of(path: &str) -> &'static str {
    let one_segment = |rest: &str| !rest.is_empty() && !rest.contains('/');
    match path {
        HEALTH_ROUTE => HEALTH_ROUTE,
        RUNS_ROUTE => RUNS_ROUTE,
        _ if path
            .strip_prefix("/realtime/v1/runs/")
            .is_some_and(one_segment) =>
        {
            RUN_ROUTE
        }
        _ if path
            .strip_prefix("/realtime/v1/batches/")
            .is_some_and(one_segment) =>
        {
            BATCH_ROUTE
        }
        _ => crate::telemetry::http::UNMATCHED,
    }
}

/// The HTTP application: the three feed routes (their `GET`s served by [`dispatch`], the rest
/// by axum's router), `/healthz`, JSON 404s, with CORS and the request limits around them. The
/// layers wrap the routes once (not each route, as `Router::layer` does), so a request clones
/// and boxes no layered route service. The wiring wraps it in
/// [`crate::telemetry::http::instrument`] (metrics, the request span and its log).
pub fn app(
    state: AppState,
) -> impl tower::Service<
    axum::extract::Request,
    Response = Response,
    Error = std::convert::Infallible,
    Future: Send + Unpin + 'static,
> + Clone
       + Send
       + Sync
       + 'static {
    let limits = state.limits;
    let router = axum::Router::new()
        .route(
            HEALTH_ROUTE,
            get(|| async { Json(json!({"status": "ok"})) }),
        )
        .route(RUN_ROUTE, get(dispatch::routed).post(handlers::subset_post))
        .route(
            RUNS_ROUTE,
            get(dispatch::routed).post(handlers::subset_post),
        )
        .route(
            BATCH_ROUTE,
            get(dispatch::routed).post(handlers::subset_post),
        )
        .fallback(|| async {
            ApiError::NotFound {
                should_retry: false,
            }
        })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .with_state(state.clone());
    let router = dispatch::FeedRoutes { state, router };
    tower::ServiceBuilder::new()
        // Any origin; preflights mirror the requested headers (`Authorization` cannot be
        // wildcarded, Fetch spec); pre-encoded values, nothing allocated per request.
        .layer(cors::CorsLayer)
        .layer(RequestLimitsLayer(limits))
        .service(router)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `route_of` names the route axum's router matches (its `MatchedPath`), for every route
    /// pattern and the paths around them.
    #[tokio::test]
    async fn route_of_agrees_with_the_routers_matched_path() {
        use axum::extract::MatchedPath;
        use tower::ServiceExt;
        let echo = || {
            async |path: Option<MatchedPath>| {
                path.map_or(crate::telemetry::http::UNMATCHED.to_string(), |p| {
                    p.as_str().to_string()
                })
            }
        };
        let router = axum::Router::new()
            .route(HEALTH_ROUTE, get(echo()))
            .route(RUN_ROUTE, get(echo()))
            .route(RUNS_ROUTE, get(echo()))
            .route(BATCH_ROUTE, get(echo()))
            .fallback(echo());
        for path in [
            "/healthz",
            "/healthz/",
            "/realtime/v1/runs",
            "/realtime/v1/runs/",
            "/realtime/v1/runs/run_1",
            "/realtime/v1/runs/run_1/",
            "/realtime/v1/runs/run_1/x",
            "/realtime/v1/runs/run%2F1",
            "/realtime/v1/batches",
            "/realtime/v1/batches/batch_1",
            "/realtime/v1/batches/",
            "/realtime/v1",
            "/",
            "/realtime/v1/runsx",
        ] {
            let request = axum::http::Request::builder()
                .uri(path)
                .body(axum::body::Body::empty())
                .expect("request");
            let response = router.clone().oneshot(request).await.expect("response");
            let body = axum::body::to_bytes(response.into_body(), 1024)
                .await
                .expect("body");
            assert_eq!(
                route_of(path),
                std::str::from_utf8(&body).expect("utf-8"),
                "{path}"
            );
        }
    }
}
