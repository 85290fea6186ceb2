//! The feed routes' handlers: the common start of every feed request ([`Begun`]: authenticate,
//! then parse the query and the offset), one handler per route (run, tag and batch feeds; the
//! refused subset `POST`), serving the feed request (admission, then an SSE stream or one reply)
//! and the 200 it answers with.
//!
//! Memory per held feed: an async fn's state is as large as its largest await, and a live poll
//! keeps its handler's state for the whole hold (~20 s). So every await before the hold
//! (authentication, lookups, the limiter) is boxed: its state is freed when it completes
//! instead of sizing the held future (`future_sizes` below prints the sizes; BENCHMARKS.md "Held
//! feeds").

use axum::extract::State;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use bytes::Bytes;

use crate::auth::{
    batch_route_resources, run_route_resources, runs_list_resources, AuthError, Principal,
};
use crate::clock::now_ms;
use crate::feeds::{issued_offset, FeedReply, FeedRequest, Freshness, Target};
use crate::protocol::electric::{self, LogMode};
use crate::protocol::headers::ClientGeneration;
use crate::protocol::offset::OffsetParam;
use crate::protocol::params::{parse_duration_ms, parse_tags};
use crate::protocol::{ColumnSet, FriendlyBatchId, FriendlyRunId, Handle};
use crate::store::RunResource;

use super::params::Params;
use super::{cors, sse, ApiError, AppState, CREATED_AT_CLAMPED_HEADER, CURRENT_API_VERSION};

/// What every feed request carries besides its path.
struct Ctx {
    /// Legacy header names and 422 instead of 400, or not.
    client: ClientGeneration,
    /// `x-trigger-api-version` is not the current one: `DEQUEUED` is rewritten to `EXECUTING`.
    legacy_api_version: bool,
    /// The query's parameters (read once authentication passed).
    params: Params,
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

/// Authenticates the request (401 otherwise) and reads what its headers say about the client.
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
    // Before any lookup (a 400 comes before a 404), by the feeds' own rule.
    issued_offset(offset, ctx.params.handle.as_deref())
        .map_err(|err| ApiError::from_feed(err, ctx.client))?;
    Ok(offset)
}

/// The columns the feed carries: the token's `skipColumns` claim, else the query's.
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
pub(super) struct Begun {
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
pub(super) async fn run_feed_at(
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

/// The tag feed: `tags` and `createdAt` checked against the request limits and the lookback
/// ceiling (a longer window is served clamped, and the response says so).
pub(super) async fn tag_feed(
    State(state): State<AppState>,
    begun: Begun,
) -> Result<Response, ApiError> {
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
pub(super) async fn subset_post(begun: Begun, body: axum::body::Body) -> ApiError {
    let read = axum::body::to_bytes(body, SUBSET_BODY_MAX_BYTES);
    let body = match tokio::time::timeout(SUBSET_BODY_READ, read).await {
        Ok(Ok(body)) => body,
        _ => Bytes::new(),
    };
    let param = electric::subset_body_param(&body);
    ApiError::bad_request(begun.ctx.client, electric::subset_refusal(&param))
}

/// A batch's feed; `batch_id` is the path segment, `None` when it is not UTF-8 once decoded.
pub(super) async fn batch_feed_at(
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
        let routed = size3(super::super::dispatch::serve_feed);
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
