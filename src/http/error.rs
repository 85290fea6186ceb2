//! The one error type of the HTTP edge: every way a request can fail, with its status, its JSON
//! body and the client-generation rules (docs/protocol.md §5).
//!
//! Bodies are `{"error": "<message>"}` with `cache-control: no-store`; CORS headers are added by
//! the application's CORS layer around every response, errors included. Two exceptions to the
//! plain body, both taken from trigger.dev: a 403 carries `code`/`param`/`type` as the webapp's
//! scope check does, and a 409 is Electric's `must-refetch` control message with the fresh
//! handle in the Electric headers.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::auth::AuthError;
use crate::feeds::FeedError;
use crate::protocol::body::FragmentBody;
use crate::protocol::headers::{ClientGeneration, ElectricHeaders};
use crate::protocol::Handle;

/// `Retry-After` of every 503, seconds: a store or Redis failure is usually a restart or a
/// failover that lasts seconds (docs/faults.md). `@electric-sql/client` retries 5xx with its own
/// backoff whatever this says; other clients and proxies can honour it.
pub const RETRY_AFTER_S: &str = "1";

/// Why a request was not answered with a feed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Bad input (a parameter, the offset, a tag): 400, or 422 for [`ClientGeneration::Legacy`].
    #[error("{message}")]
    BadRequest {
        message: String,
        client: ClientGeneration,
    },
    /// Authentication failed: 401 with trigger.dev's text (a failed lookup is a 503).
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// No such route, run or batch in the authenticated environment: 404. `should_retry` sets
    /// `x-should-retry` (batches may appear a moment later; trigger.dev answers the same).
    #[error("Not found")]
    NotFound { should_retry: bool },
    /// The credential may not read this resource: 403.
    #[error("Unauthorized")]
    Forbidden,
    /// A method other than GET/HEAD/OPTIONS: 405.
    #[error("Method Not Allowed")]
    MethodNotAllowed,
    /// The request target is longer than `server.max_url_bytes`: 414.
    #[error("URI Too Long")]
    UriTooLong,
    /// More header bytes than `server.max_header_bytes`: 431.
    #[error("Request Header Fields Too Large")]
    HeadersTooLarge,
    /// The environment is at its live-poll concurrency limit: 429.
    #[error("Too many concurrent requests")]
    TooManyRequests,
    /// The handle was not issued by this server for this feed: 409 must-refetch with a new one.
    #[error("must refetch")]
    MustRefetch {
        handle: Handle,
        client: ClientGeneration,
    },
    /// The store failed or was too slow: 503 (clients retry with backoff). The cause is logged,
    /// never sent.
    #[error("Service Unavailable")]
    Unavailable(String),
    /// A request carrying a run token could not be forwarded to `auth.run_token_upstream` (the
    /// webapp refused the connection, or sent no response head in time): 503 with
    /// `Retry-After`. The cause is logged, never sent (nor the token).
    #[error("Service Unavailable: the webapp that serves run tokens did not answer")]
    RunTokenUpstream(String),
}

impl ApiError {
    /// Bad input from `client`.
    pub fn bad_request(client: ClientGeneration, message: impl Into<String>) -> ApiError {
        ApiError::BadRequest {
            message: message.into(),
            client,
        }
    }

    /// A store failure (logged here).
    pub fn unavailable(cause: &dyn std::fmt::Display) -> ApiError {
        ApiError::Unavailable(cause.to_string())
    }

    /// A feed's refusal, for `client`.
    pub fn from_feed(err: FeedError, client: ClientGeneration) -> ApiError {
        match err {
            FeedError::MustRefetch { handle } => ApiError::MustRefetch { handle, client },
            FeedError::HandleRequired(offset) => {
                ApiError::bad_request(client, format!("offset {offset} requires a handle"))
            }
            FeedError::Unavailable(err) => ApiError::unavailable(&err),
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest {
                client: ClientGeneration::Legacy,
                ..
            } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Auth(AuthError::Store(_))
            | ApiError::Unavailable(_)
            | ApiError::RunTokenUpstream(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Auth(_) => StatusCode::UNAUTHORIZED,
            ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::Forbidden => StatusCode::FORBIDDEN,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::UriTooLong => StatusCode::URI_TOO_LONG,
            ApiError::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
            ApiError::MustRefetch { .. } => StatusCode::CONFLICT,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = match &self {
            ApiError::MustRefetch { handle, client } => {
                let mut response =
                    Response::new(axum::body::Body::from(FragmentBody::must_refetch()));
                let headers = response.headers_mut();
                headers.insert("content-type", HeaderValue::from_static("application/json"));
                ElectricHeaders {
                    handle: handle.clone(),
                    ..ElectricHeaders::default()
                }
                .apply(headers, *client);
                response
            }
            ApiError::Forbidden => Json(json!({
                "error": "Unauthorized",
                "code": "unauthorized",
                "param": "access_token",
                "type": "authorization",
            }))
            .into_response(),
            ApiError::Auth(AuthError::RunToken) => Json(json!({
                "error": self.to_string(),
                "tokenType": crate::auth::jwt::RUN_TOKEN_TYP,
            }))
            .into_response(),
            ApiError::Auth(AuthError::Store(err)) => {
                tracing::error!(error = %err, "authentication lookup failed");
                Json(json!({ "error": "Service Unavailable" })).into_response()
            }
            ApiError::Unavailable(cause) => {
                tracing::error!(error = %cause, "store unavailable");
                Json(json!({ "error": "Service Unavailable" })).into_response()
            }
            ApiError::RunTokenUpstream(cause) => {
                tracing::warn!(error = %cause, "run token upstream unavailable");
                Json(json!({ "error": self.to_string() })).into_response()
            }
            other => Json(json!({ "error": other.to_string() })).into_response(),
        };
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert("cache-control", HeaderValue::from_static("no-store"));
        if status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert("retry-after", HeaderValue::from_static(RETRY_AFTER_S));
        }
        if let ApiError::NotFound { should_retry } = self {
            headers.insert(
                "x-should-retry",
                HeaderValue::from_static(if should_retry { "true" } else { "false" }),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_clients_get_422_for_bad_input_and_modern_ones_400() {
        let legacy = ApiError::bad_request(ClientGeneration::Legacy, "bad");
        let modern = ApiError::bad_request(ClientGeneration::Modern, "bad");
        assert_eq!(legacy.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(modern.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            ApiError::Auth(AuthError::Missing).status(),
            StatusCode::UNAUTHORIZED
        );
    }

    #[test]
    fn a_store_failure_is_a_json_503_with_retry_after() {
        let response = ApiError::unavailable(&"pool timed out").into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()["retry-after"], RETRY_AFTER_S);
        assert_eq!(response.headers()["content-type"], "application/json");
        let ok = ApiError::Forbidden.into_response();
        assert!(ok.headers().get("retry-after").is_none());
    }

    #[test]
    fn a_run_token_gets_a_401_naming_its_type() {
        let response = ApiError::Auth(AuthError::RunToken).into_response();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    }

    #[test]
    fn an_unreachable_run_token_upstream_is_a_json_503_with_retry_after() {
        let response = ApiError::RunTokenUpstream("connection refused".into()).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()["retry-after"], RETRY_AFTER_S);
        assert_eq!(response.headers()["content-type"], "application/json");
    }

    #[test]
    fn not_found_says_whether_to_retry() {
        let response = ApiError::NotFound { should_retry: true }.into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(response.headers()["x-should-retry"], "true");
        assert_eq!(response.headers()["cache-control"], "no-store");
    }
}
