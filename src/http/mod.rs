//! HTTP: axum routes, request parsing, admission, status mapping and CORS (docs/trigger-dev.md
//! §2.1, docs/protocol.md §5–§6, §10). Every handler returns [`ApiError`] on failure.
//!
//! Check order per trigger.dev's `createLoaderApiRoute`: authenticate (401) → parse (400; 422
//! for clients without `x-trigger-electric-version`, which loop on 400) → find the resource in
//! the authenticated environment (404) → scopes (403) → feed (200 / 409 / 503).
//!
//! Memory per held feed: an async fn's state is as large as its largest await, and a live poll
//! keeps its handler's state for the whole hold (~20 s). So every await before the hold
//! (authentication, lookups, the limiter) is boxed: its state is freed when it completes
//! instead of sizing the held future (`future_sizes` below prints the sizes; BENCHMARKS.md "Held
//! feeds").

pub mod admit;
pub mod cors;
mod dispatch;
pub mod error;
pub mod forward;
mod route;
pub mod serve;
pub mod sse;

use std::borrow::Cow;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Json;
use bytes::Bytes;
use serde_json::json;

use crate::auth::{
    batch_route_resources, run_route_resources, runs_list_resources, AuthError, Authenticator,
    Principal,
};
use crate::clock::now_ms;
use crate::feeds::{FeedReply, FeedRequest, Feeds, Freshness, Target};
use crate::protocol::electric::{self, LogMode};
use crate::protocol::headers::ClientGeneration;
use crate::protocol::offset::OffsetParam;
use crate::protocol::params::{parse_duration_ms, parse_tags};
use crate::protocol::{ColumnSet, FriendlyBatchId, FriendlyRunId, Handle};
use crate::store::RunResource;
use admit::Limiter;
pub use error::ApiError;

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

/// Bounds on what a request may carry (`[server] max_url_bytes`, `max_header_bytes`,
/// `[feeds] max_tags`, `max_tag_bytes`).
#[derive(Clone, Copy, Debug)]
pub struct RequestLimits {
    pub max_url_bytes: usize,
    pub max_header_bytes: usize,
    pub max_tags: usize,
    pub max_tag_bytes: usize,
}

impl RequestLimits {
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
struct RequestLimitsLayer(RequestLimits);

impl<S> tower::Layer<S> for RequestLimitsLayer {
    type Service = RequestLimitsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestLimitsService {
            limits: self.0,
            inner,
        }
    }
}

#[derive(Clone, Debug)]
struct RequestLimitsService<S> {
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
        .route(RUN_ROUTE, get(dispatch::routed).post(subset_post))
        .route(RUNS_ROUTE, get(dispatch::routed).post(subset_post))
        .route(BATCH_ROUTE, get(dispatch::routed).post(subset_post))
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

/// What every feed request carries besides its path.
struct Ctx {
    /// Legacy header names and 422 instead of 400, or not.
    client: ClientGeneration,
    /// `x-trigger-api-version` is not the current one: `DEQUEUED` is rewritten to `EXECUTING`.
    legacy_api_version: bool,
    params: Params,
}

#[derive(Default)]
struct Params {
    offset: Option<String>,
    handle: Option<String>,
    live: bool,
    cursor: Option<String>,
    tags: Option<String>,
    created_at: Option<String>,
    skip_columns: Option<String>,
    /// `log` as sent (`full`, `changes_only`, or something refused).
    log: Option<String>,
    /// `live_sse=true` or `experimental_live_sse=true`.
    sse: bool,
    /// The first `subset__*` parameter, which is refused (docs/protocol.md §13.1).
    subset: Option<String>,
}

impl Params {
    /// Query parameters; a repeated key keeps its last value (`Object.fromEntries`); unknown
    /// keys (`expired_handle`, `table`, `cache-buster`, …) are ignored.
    fn parse(raw: Option<&str>) -> Params {
        let mut p = Params::default();
        let mut shape_id = None;
        // Percent- and `+`-decoded, invalid UTF-8 replaced (WHATWG `application/x-www-form-urlencoded`
        // parsing, as `URLSearchParams` does); only the keys read here are copied.
        for (k, v) in query_pairs(raw.unwrap_or("")) {
            let slot = match &*k {
                "offset" => &mut p.offset,
                "handle" => &mut p.handle,
                "shape_id" => &mut shape_id,
                "live" => {
                    p.live = v == "true";
                    continue;
                }
                "cursor" => &mut p.cursor,
                "tags" => &mut p.tags,
                "createdAt" => &mut p.created_at,
                "skipColumns" => &mut p.skip_columns,
                "log" => &mut p.log,
                k if electric::LIVE_SSE_PARAMS.contains(&k) => {
                    p.sse |= v == "true";
                    continue;
                }
                k if electric::is_subset_param(k) => {
                    p.subset.get_or_insert_with(|| k.chars().take(64).collect());
                    continue;
                }
                _ => continue,
            };
            *slot = Some(v.into_owned());
        }
        p.handle = p.handle.or(shape_id).filter(|h| !h.is_empty());
        p
    }

    /// The `log` mode; an unknown value is a 400 naming it.
    fn log_mode(&self, client: ClientGeneration) -> Result<LogMode, ApiError> {
        match self.log.as_deref() {
            None => Ok(LogMode::Full),
            Some(raw) => LogMode::parse(raw).ok_or_else(|| {
                ApiError::bad_request(
                    client,
                    format!(
                        "Invalid log {:?}: expected full or changes_only",
                        raw.chars().take(64).collect::<String>()
                    ),
                )
            }),
        }
    }
}

/// The `key=value` pairs of a query string, decoded as `URLSearchParams` does (WHATWG
/// `application/x-www-form-urlencoded`: `+` is a space, percent-escapes decoded, invalid UTF-8
/// replaced). A pair without `%` or `+` is borrowed as is: what the clients send (offsets,
/// handles, cursors, `live=true`) needs no decoding, so nothing is copied for it.
fn query_pairs(raw: &str) -> impl Iterator<Item = (Cow<'_, str>, Cow<'_, str>)> {
    // Vectorised searches (`memchr`): one over the whole query for `%` and `+` (what clients
    // send has neither), one for the `&`s, and one short one per pair for its `=`.
    let bytes = raw.as_bytes();
    let encoded = memchr::memchr2(b'%', b'+', bytes).is_some();
    let ends = memchr::memchr_iter(b'&', bytes).chain(std::iter::once(bytes.len()));
    let mut start = 0;
    ends.filter_map(move |end| {
        // `&` is ASCII: both ends are character boundaries.
        let pair = raw.get(start..end);
        start = end + 1;
        let pair = pair?;
        if pair.is_empty() {
            return None;
        }
        if encoded && memchr::memchr2(b'%', b'+', pair.as_bytes()).is_some() {
            // One pair (no `&` inside): the decoder yields exactly it.
            return Some(
                form_urlencoded::parse(pair.as_bytes())
                    .next()
                    .unwrap_or_default(),
            );
        }
        let (k, v) = match memchr::memchr(b'=', pair.as_bytes()) {
            // `=` is ASCII: both sides are character boundaries.
            Some(at) => (&pair[..at], &pair[at + 1..]),
            None => (pair, ""),
        };
        Some((Cow::Borrowed(k), Cow::Borrowed(v)))
    })
}

/// `x-trigger-electric-version`: present (non-empty) on requests of the modern clients.
const ELECTRIC_VERSION: HeaderName = HeaderName::from_static("x-trigger-electric-version");
/// `x-trigger-api-version`.
const API_VERSION: HeaderName = HeaderName::from_static("x-trigger-api-version");
/// `x-trigger-branch`: the preview branch a secret key addresses.
const BRANCH: HeaderName = HeaderName::from_static("x-trigger-branch");

/// A request header's value as text (`None` when absent or not visible ASCII). The names are
/// constants, so a lookup hashes them without parsing them first.
fn header<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

async fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<(Principal, Ctx), ApiError> {
    let client = if header(headers, &ELECTRIC_VERSION).is_none_or(str::is_empty) {
        ClientGeneration::Legacy
    } else {
        ClientGeneration::Modern
    };
    let legacy_api_version = header(headers, &API_VERSION) != Some(CURRENT_API_VERSION);
    let principal = state
        .auth
        .authenticate(
            header(headers, &http::header::AUTHORIZATION),
            header(headers, &BRANCH),
        )
        .await?;
    crate::telemetry::http::record_env_id(&principal.env.id);
    Ok((
        principal,
        Ctx {
            client,
            legacy_api_version,
            params: Params::default(),
        },
    ))
}

/// Offset/handle validity shared by the three routes.
fn parse_offset(ctx: &Ctx) -> Result<OffsetParam, ApiError> {
    let offset = OffsetParam::parse(ctx.params.offset.as_deref())
        .map_err(|e| ApiError::bad_request(ctx.client, e.to_string()))?;
    if let OffsetParam::At(o) = offset {
        if ctx.params.handle.is_none() {
            return Err(ApiError::bad_request(
                ctx.client,
                format!("offset {o} requires a handle"),
            ));
        }
    }
    Ok(offset)
}

fn columns(principal: &Principal, ctx: &Ctx) -> ColumnSet {
    match &principal.skip_columns {
        Some(claim) => ColumnSet::from_skip_list(claim),
        None => match ctx.params.skip_columns.as_deref() {
            None | Some("") => ColumnSet::ALL,
            Some(raw) => ColumnSet::from_skip_list(raw.split(',')),
        },
    }
}

/// The common start of the three feed routes, as an extractor: authenticate (401), then parse
/// the query and the offset (400/422), in trigger.dev's order. It runs before the handler's
/// future exists, and it takes the request headers out of the request: the header values share
/// hyper's 8 KiB read buffer, and dropping them here frees that buffer before a live poll's hold
/// instead of pinning it for ~20 s (memory per held feed).
struct Begun {
    principal: Principal,
    ctx: Ctx,
    offset: OffsetParam,
    log: LogMode,
}

impl axum::extract::FromRequestParts<AppState> for Begun {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Begun, ApiError> {
        let headers = std::mem::take(&mut parts.headers);
        let query = parts.uri.query().map(str::to_owned);
        // Boxed: the authentication's state would otherwise size the handler's box for the
        // whole hold (memory per held feed).
        let (principal, mut ctx) = match Box::pin(authenticate(state, &headers)).await {
            Ok(authenticated) => authenticated,
            Err(refusal) => {
                // A run token's request may be forwarded as it came (`forward`): its headers
                // are put back.
                if matches!(refusal, ApiError::Auth(AuthError::RunToken)) {
                    parts.headers = headers;
                }
                return Err(refusal);
            }
        };
        drop(headers);
        ctx.params = Params::parse(query.as_deref());
        if let Some(param) = &ctx.params.subset {
            return Err(ApiError::bad_request(
                ctx.client,
                electric::subset_refusal(param),
            ));
        }
        let offset = parse_offset(&ctx)?;
        let log = ctx.params.log_mode(ctx.client)?;
        Ok(Begun {
            principal,
            ctx,
            offset,
            log,
        })
    }
}

/// A run's feed; `run_id` is the path segment, `None` when it is not UTF-8 once decoded.
async fn run_feed_at(
    state: AppState,
    run_id: Option<String>,
    begun: Begun,
) -> Result<Response, ApiError> {
    let env_id = &begun.principal.env.id;
    // An id that is not UTF-8 once decoded cannot exist either: the same JSON 404.
    let run_id = run_id.and_then(|id| FriendlyRunId::parse(&id));
    let run_id = run_id.ok_or(ApiError::NotFound {
        should_retry: false,
    })?;
    let (sets, run_id) = (state.feeds.sets(), &run_id);
    let find = |freshness| async move {
        found(
            Box::pin(sets.find_run(env_id, run_id, freshness)).await,
            ApiError::NotFound {
                should_retry: false,
            },
        )
    };
    let run = find(Freshness::Cached).await?;
    // The cached lookup's ids, task and batch are immutable; its tags may be stale, so a
    // grant that only the tags could give is decided on a fresh read.
    let untagged = RunResource {
        tags: Vec::new(),
        ..(*run).clone()
    };
    let ability = &begun.principal.ability;
    if !ability.can_read_any(&run_route_resources(&untagged))
        && !ability.can_read_any(&run_route_resources(&*find(Freshness::Fresh).await?))
    {
        return Err(ApiError::Forbidden);
    }
    let target = Target::Run {
        run_id: run.id.clone(),
    };
    serve(&state, begun, target).await
}

/// A URL-id lookup's outcome: the resource, `missing` (the route's 404) when it is not in the
/// environment, or a 503 when the store failed.
fn found<T>(
    lookup: Result<Option<T>, crate::store::StoreError>,
    missing: ApiError,
) -> Result<T, ApiError> {
    lookup
        .map_err(|err| ApiError::unavailable(&err))?
        .ok_or(missing)
}

async fn tag_feed(State(state): State<AppState>, begun: Begun) -> Result<Response, ApiError> {
    let bad = |message: String| ApiError::bad_request(begun.ctx.client, message);
    let tags = parse_tags(begun.ctx.params.tags.as_deref()).map_err(|err| bad(err.to_string()))?;
    if tags.len() > state.limits.max_tags {
        return Err(bad(format!(
            "Too many tags: at most {} allowed",
            state.limits.max_tags
        )));
    }
    if tags.iter().any(|t| t.len() > state.limits.max_tag_bytes) {
        return Err(bad(format!(
            "Tag too long: at most {} bytes",
            state.limits.max_tag_bytes
        )));
    }
    let max_age = state.max_created_at_age_ms;
    // A window longer than the maximum is served clamped, and the response says so.
    let mut clamped = false;
    let lookback = match begun.ctx.params.created_at.as_deref() {
        None => max_age,
        Some(raw) => match parse_duration_ms(raw) {
            Some(ms) => {
                clamped = ms > max_age;
                ms.min(max_age)
            }
            None => {
                return Err(bad(format!(
                    "Invalid createdAt {:?}: expected a duration like 1h, 30m, 2d",
                    raw.chars().take(64).collect::<String>()
                )))
            }
        },
    };
    let floor_ms = now_ms() - i64::try_from(lookback).unwrap_or(i64::MAX / 2);
    if !begun
        .principal
        .ability
        .can_read_any(&runs_list_resources(&tags))
    {
        return Err(ApiError::Forbidden);
    }
    let target = Target::Tag {
        tags: tags.into(),
        floor_ms,
    };
    let mut response = serve(&state, begun, target).await?;
    if clamped {
        response
            .headers_mut()
            .insert(CREATED_AT_CLAMPED_HEADER, HeaderValue::from(max_age));
    }
    Ok(response)
}

/// The most of a subset POST body read to name its first parameter, bytes (the 1.5 client's
/// subset bodies are a few hundred bytes).
pub const SUBSET_BODY_MAX_BYTES: usize = 64 * 1024;
/// How long a subset POST body may take to arrive before it is refused unread.
pub const SUBSET_BODY_READ: std::time::Duration = std::time::Duration::from_secs(2);

/// `POST` to a feed route: `@electric-sql/client` 1.5 sends subset snapshots this way
/// (`subsetMethod: 'POST'`, a JSON body). runfeed serves no subsets: after authentication and
/// the query checks, a 400 names the first body parameter (docs/protocol.md §13.1).
///
/// The body is read only as far as naming the parameter needs: at most
/// [`SUBSET_BODY_MAX_BYTES`] within [`SUBSET_BODY_READ`]. A body that is larger, slower or
/// broken is still refused with the same JSON 400 (naming `subset__*`), never held open or
/// answered with a plain-text 413.
async fn subset_post(begun: Begun, body: axum::body::Body) -> ApiError {
    let read = axum::body::to_bytes(body, SUBSET_BODY_MAX_BYTES);
    let body = match tokio::time::timeout(SUBSET_BODY_READ, read).await {
        Ok(Ok(body)) => body,
        _ => Bytes::new(),
    };
    let param = electric::subset_body_param(&body);
    ApiError::bad_request(begun.ctx.client, electric::subset_refusal(&param))
}

/// A batch's feed; `batch_id` is the path segment, `None` when it is not UTF-8 once decoded.
async fn batch_feed_at(
    state: AppState,
    batch_id: Option<String>,
    begun: Begun,
) -> Result<Response, ApiError> {
    let batch_id = batch_id.and_then(|id| FriendlyBatchId::parse(&id));
    let batch_id = batch_id.ok_or(ApiError::NotFound { should_retry: true })?;
    let lookup = state
        .feeds
        .sets()
        .find_batch(&begun.principal.env.id, &batch_id);
    let batch = found(
        Box::pin(lookup).await,
        ApiError::NotFound { should_retry: true },
    )?;
    if !begun
        .principal
        .ability
        .can_read_any(&batch_route_resources(&batch.friendly_id))
    {
        return Err(ApiError::Forbidden);
    }
    let target = Target::Batch {
        batch_id: batch.id.clone(),
    };
    serve(&state, begun, target).await
}

/// Answers the feed request. What the reply needs (the client generation) is copied out and
/// the rest of `begun` (principal, query strings) is dropped before the poll is served, so a
/// held live poll does not keep it for its hold (memory per held feed).
async fn serve(state: &AppState, begun: Begun, target: Target) -> Result<Response, ApiError> {
    let Begun {
        principal,
        ctx,
        offset,
        log,
    } = begun;
    let client = ctx.client;
    let req = FeedRequest {
        env_id: principal.env.id.clone(),
        target,
        cols: columns(&principal, &ctx),
        offset,
        handle: ctx.params.handle.as_deref().map(Handle::new),
        live: ctx.params.live,
        cursor: ctx.params.cursor.clone(),
        legacy_api_version: ctx.legacy_api_version,
        log,
        sse: false,
    };
    let sse = req.live && ctx.params.sse && matches!(req.offset, OffsetParam::At(_));
    if sse {
        // A stale handle stays an ordinary 409 (checked before the stream's 200).
        state
            .feeds
            .check(&req)
            .map_err(|err| ApiError::from_feed(err, client))?;
    }
    drop(ctx);
    // Only live polls take a concurrency slot (REQ-02); it is released when this future ends,
    // whether answered or dropped because the client went away.
    let slot = if req.live && matches!(req.offset, OffsetParam::At(_)) {
        let acquire = state
            .limiter
            .acquire(&principal.env.id, &principal.env.organization_id);
        Some(Box::pin(acquire).await.ok_or(ApiError::TooManyRequests)?)
    } else {
        None
    };
    if sse {
        // The stream keeps the slot for its whole life.
        return Ok(sse::response(state.feeds.clone(), req, slot, client));
    }
    drop(principal);
    let reply = state
        .feeds
        .serve(req)
        .await
        .map_err(|err| ApiError::from_feed(err, client))?;
    Ok(ok(reply, client))
}

/// Room for every header of a feed's 200 (content type, cache-control, three CORS, at most
/// seven Electric, the `createdAt` clamp): the map is sized once, never grown while it is filled.
const FEED_RESPONSE_HEADERS: usize = 13;
const JSON: HeaderValue = HeaderValue::from_static("application/json");
const NO_STORE: HeaderValue = HeaderValue::from_static("no-store");

/// The static headers of every feed 200 (content type, cache-control, CORS), in a map sized for
/// all of them: a response clones it (static values, one allocation) instead of hashing each
/// name in again.
static FEED_HEADERS: std::sync::LazyLock<HeaderMap> = std::sync::LazyLock::new(|| {
    let mut headers = HeaderMap::with_capacity(FEED_RESPONSE_HEADERS);
    headers.insert(CONTENT_TYPE, JSON);
    headers.insert(CACHE_CONTROL, NO_STORE);
    cors::add_response_headers(&mut headers);
    headers
});

/// A feed's 200: its headers are built in one map sized once, from static values plus the
/// reply's Electric values (whose strings become header values without a copy), CORS included
/// (the layer then leaves the response alone). This is the fan-out write path: one change to
/// N feeds builds N of these (BENCHMARKS.md "Fan-out").
fn ok(reply: FeedReply, client: ClientGeneration) -> Response {
    let mut headers = FEED_HEADERS.clone();
    reply.headers.apply(&mut headers, client);
    let mut response = Response::new(axum::body::Body::from(reply.body));
    *response.headers_mut() = headers;
    response
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

    proptest::proptest! {
        /// The borrowing fast path decodes every query exactly as `URLSearchParams` (the
        /// `form_urlencoded` crate) does.
        #[test]
        fn query_pairs_decode_like_url_search_params(raw in "[a-z=&%+2AF0é_. -]{0,40}") {
            let ours: Vec<(String, String)> =
                query_pairs(&raw).map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
            let reference: Vec<(String, String)> = form_urlencoded::parse(raw.as_bytes())
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect();
            proptest::prop_assert_eq!(ours, reference);
        }
    }

    #[test]
    fn req_01_params_last_value_wins_and_shape_id_is_the_legacy_handle() {
        let p = Params::parse(Some(
            "offset=1_2&offset=3_4&shape_id=h&live=true&cursor=&log=full&expired_handle=x",
        ));
        assert_eq!(p.offset.as_deref(), Some("3_4"));
        assert_eq!(p.handle.as_deref(), Some("h"));
        assert!(p.live);
        assert_eq!(p.cursor.as_deref(), Some(""));
        let p = Params::parse(Some("live=1&handle="));
        assert!(!p.live, "live only when exactly true");
        assert_eq!(p.handle, None);
    }
}

#[cfg(test)]
mod future_sizes {
    //! Sizes of the futures a held live poll keeps alive (memory per held feed).
    use super::*;

    fn size3<A, B, C, F: std::future::Future>(_: fn(A, B, C) -> F) -> usize {
        std::mem::size_of::<F>()
    }
    fn size2<A, B, F: std::future::Future>(_: fn(A, B) -> F) -> usize {
        std::mem::size_of::<F>()
    }
    fn size_serve<'a, F: std::future::Future + 'a>(
        _: fn(&'a AppState, Begun, Target) -> F,
    ) -> usize {
        std::mem::size_of::<F>()
    }

    /// The feed route's future is what a held poll keeps (boxed) for ~20 s: 7 160 bytes (debug
    /// build) before the pre-hold awaits were boxed. The bound is 3.25 KiB since `serve` also
    /// opens SSE streams and takes `Begun` by value (its query strings are dropped before the
    /// hold): 3 152 bytes for a run feed in a debug build. `dispatch::serve_feed` is the box
    /// of a `GET` (and, through the router, of a `HEAD`).
    #[test]
    fn held_poll_handler_futures_stay_small() {
        let (run, tag, batch, serve) = (
            size3(run_feed_at),
            size2(tag_feed),
            size3(batch_feed_at),
            size_serve(serve),
        );
        let routed = size3(dispatch::serve_feed);
        println!("bytes: run_feed_at {run}, tag_feed {tag}, batch_feed_at {batch}, serve {serve}, dispatch::serve_feed {routed}");
        for (name, size) in [
            ("run_feed_at", run),
            ("tag_feed", tag),
            ("batch_feed_at", batch),
            ("dispatch::serve_feed", routed),
        ] {
            assert!(size <= 3328, "{name} future is {size} bytes");
        }
    }
}
