//! Bearer → environment + ability (trigger-facts §2). STUB: the auth helper implements.

use std::sync::Arc;
use std::time::Duration;

use crate::store::{EnvStore, StoreError};

/// The authenticated environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthedEnv {
    pub id: String,
    pub organization_id: String,
    pub project_id: String,
    pub env_type: String,
}

/// One parsed scope `action:type[:id]` (only the first two colons separate).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    pub action: String,
    pub kind: Option<String>,
    pub id: Option<String>,
}

/// What a credential may do: a secret key may do anything; a public token only its scopes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ability {
    All,
    Scopes(Vec<Scope>),
}

/// A resource a route asks to read: `{type}` or `{type, id}` (ids are friendly ids / raw tags /
/// task identifiers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resource<'a> {
    pub kind: &'a str,
    pub id: Option<&'a str>,
}

impl Ability {
    /// Whether any of `resources` may be read (`anyResource` semantics; empty → false).
    pub fn can_read_any(&self, resources: &[Resource<'_>]) -> bool {
        let _ = resources;
        unimplemented!("auth helper")
    }
}

/// An authenticated request.
#[derive(Clone, Debug)]
pub struct Principal {
    pub env: AuthedEnv,
    pub ability: Ability,
    /// The JWT's `realtime.skipColumns` claim; when present it REPLACES the URL parameter.
    pub skip_columns: Option<Vec<String>>,
}

/// Why authentication failed; every variant is a 401 with [`AuthError::message`] as the body.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("Invalid or Missing API key")]
    Missing,
    #[error("Invalid API key")]
    InvalidApiKey,
    #[error("Public Access Token is invalid")]
    InvalidPublicToken,
    #[error("x-trigger-branch header required for preview env")]
    BranchRequired,
    #[error("No matching branch env")]
    NoMatchingBranch,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Authenticates bearers against an [`EnvStore`], caching environment lookups briefly.
pub struct Authenticator {
    _store: Arc<dyn EnvStore>,
}

impl Authenticator {
    /// `cache_ttl`: how long environment/key lookups are reused (0 disables).
    pub fn new(store: Arc<dyn EnvStore>, cache_ttl: Duration) -> Self {
        let _ = cache_ttl;
        Authenticator { _store: store }
    }

    /// Authenticates the raw `Authorization` header value and optional `x-trigger-branch`.
    pub async fn authenticate(&self, authorization: Option<&str>, branch: Option<&str>) -> Result<Principal, AuthError> {
        let _ = (authorization, branch);
        unimplemented!("auth helper")
    }
}

/// Mints a public access token as the trigger.dev SDK does (HS256 with the environment's
/// signing key, `pub: true`, `sub` = env id, `iss`/`aud`, `exp` = now + ttl, `scopes`, optional
/// `realtime.skipColumns`).
pub fn mint_public_token(signing_key: &str, env_id: &str, scopes: &[String], ttl: Duration, skip_columns: Option<&[String]>) -> String {
    let _ = (signing_key, env_id, scopes, ttl, skip_columns);
    unimplemented!("auth helper")
}
