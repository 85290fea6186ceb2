//! The feed routes' `GET`s, served without axum's router: every live poll and its re-poll come
//! this way, so they skip the router's per-request work (route matching a second time after
//! [`super::route_of`], the `MatchedPath` extension, a clone of the boxed route service, three future
//! wrappers) and go straight to the same handlers, extractors and responses. Everything else
//! (`HEAD`, `POST`, `OPTIONS` outside the CORS layer, `/healthz`, unknown paths) goes to the
//! router, which still declares every route and answers a feed route's `HEAD` with [`routed`],
//! the same path as a `GET` (BENCHMARKS.md "Cost per unit of work").

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::{FromRequestParts, State};
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use futures::future::Either;
use futures::FutureExt;

use super::forward::Forwarder;
use super::handlers::{batch_feed_at, run_feed_at, tag_feed, Begun};
use super::route::FeedRoute;
use super::{ApiError, AppState};
use crate::auth::AuthError;

/// The response future of a feed route served here.
type FeedFuture = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

/// Serves `GET` on the three feed routes itself and hands every other request to `router`.
#[derive(Clone)]
pub(super) struct FeedRoutes<R> {
    pub(super) state: AppState,
    pub(super) router: R,
}

impl<R> tower::Service<axum::extract::Request> for FeedRoutes<R>
where
    R: tower::Service<axum::extract::Request, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Either<FeedFuture, R::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.router.poll_ready(cx)
    }

    fn call(&mut self, req: axum::extract::Request) -> Self::Future {
        let route = (req.method() == Method::GET)
            .then(|| FeedRoute::of(req.uri().path()))
            .flatten();
        let Some(route) = route else {
            return Either::Right(self.router.call(req));
        };
        Either::Left(Box::pin(serve_feed(self.state.clone(), route, req)))
    }
}

/// Answers a `GET` on a feed route: [`Begun`] (authentication, query, offset), then the route's
/// handler. This future is what a held poll keeps, boxed, for its hold (memory per held feed):
/// chained rather than one `async fn`, so the extraction's state and the handler's share their
/// bytes instead of sitting side by side. A request carrying a run token goes to the webapp
/// instead when `auth.run_token_upstream` is set ([`super::forward`]; its future is boxed).
pub(super) fn serve_feed(
    state: AppState,
    route: FeedRoute,
    req: axum::extract::Request,
) -> impl Future<Output = Result<Response, Infallible>> + Send {
    begin(state, req).then(move |(state, begun)| {
        let begun = match begun {
            Begin::Begun(begun) => begun,
            Begin::Refused(refusal) => {
                return Either::Left(Either::Left(std::future::ready(
                    Ok(refusal.into_response()),
                )))
            }
            Begin::RunToken(forwarder, parts) => {
                let forwarded = Box::pin(forwarder.forward(route, *parts));
                return Either::Left(Either::Right(forwarded.map(Ok)));
            }
        };
        let served = match route {
            FeedRoute::Run(id) => Either::Left(run_feed_at(state, id, begun)),
            FeedRoute::Tags => Either::Right(Either::Left(tag_feed(State(state), begun))),
            FeedRoute::Batch(id) => Either::Right(Either::Right(batch_feed_at(state, id, begun))),
        };
        Either::Right(served.map(|served| Ok(served.into_response())))
    })
}

/// How a feed request starts: [`Begun`], a refusal, or a run token to forward with the request
/// it came in (boxed: its parts are large and rare). [`Begun`] is not boxed: it moves straight
/// into the handler, as the `Result` it replaced did, with no allocation per poll.
#[allow(clippy::large_enum_variant)]
enum Begin {
    Begun(Begun),
    Refused(super::ApiError),
    RunToken(Arc<Forwarder>, Box<axum::http::request::Parts>),
}

/// [`Begun`] of `req`. The request's parts (headers, URI) are dropped once it has read them,
/// before the handler holds (memory per held feed), as axum's extractors do; only a run token's
/// request keeps them, to be forwarded when `auth.run_token_upstream` is set.
async fn begin(state: AppState, req: axum::extract::Request) -> (AppState, Begin) {
    let (mut parts, _body) = req.into_parts();
    let begun = Begun::from_request_parts(&mut parts, &state).await;
    let begin = match (begun, &state.forwarder) {
        (Ok(begun), _) => Begin::Begun(begun),
        (Err(ApiError::Auth(AuthError::RunToken)), Some(forwarder)) => {
            Begin::RunToken(forwarder.clone(), Box::new(parts))
        }
        (Err(refusal), _) => Begin::Refused(refusal),
    };
    (state, begin)
}

/// The router's handler of the feed routes (a `HEAD`, which axum answers as a `GET` without its
/// body): the same [`serve_feed`] as a `GET` served here.
pub(super) async fn routed(State(state): State<AppState>, req: axum::extract::Request) -> Response {
    match FeedRoute::of(req.uri().path()) {
        Some(route) => match serve_feed(state, route, req).await {
            Ok(response) => response,
            Err(never) => match never {},
        },
        None => super::ApiError::NotFound {
            should_retry: false,
        }
        .into_response(),
    }
}
