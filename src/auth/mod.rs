//! Bearer → environment + ability (docs/trigger-dev.md §2; `internal-packages/rbac/src/bearerCredentials.ts`
//! `BearerCredentialResolver.authenticate`).
//!
//! - [`Authenticator`]: `Authorization` (+ `x-trigger-branch`) → [`Principal`], with a short-lived
//!   cache of environment lookups.
//! - [`scope`]: the scope grammar ([`parse_scope`]), the ability, and each route's resources.
//! - [`jwt`]: public access token probe, verification (jose semantics) and minting.

use std::sync::Arc;
use std::time::Duration;

use crate::cache::TtlCache;

use crate::protocol::{EnvId, OrgId};
use crate::store::{EnvRecord, EnvStore, Found, StoreError};

pub mod jwt;
pub mod scope;

pub use jwt::{is_public_jwt, verify_public_token, VerifyFailure, JWT_AUDIENCE, JWT_ISSUER};
pub use scope::{batch_route_resources, parse_scope, run_route_resources, runs_list_resources};

/// The authenticated environment. For a branch environment reached with the parent's secret key
/// and `x-trigger-branch`, this is the CHILD (its id and type; organization and project from the
/// parent, which are the same).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthedEnv {
    /// Internal `"RuntimeEnvironment".id`; every run/batch lookup is scoped to it.
    pub id: EnvId,
    pub organization_id: OrgId,
    pub project_id: String,
    /// `PRODUCTION` | `STAGING` | `DEVELOPMENT` | `PREVIEW`.
    pub env_type: String,
}

impl AuthedEnv {
    fn of(env: &EnvRecord) -> Self {
        AuthedEnv {
            id: env.id.clone(),
            organization_id: env.organization_id.clone(),
            project_id: env.project_id.clone(),
            env_type: env.env_type.clone(),
        }
    }
}

/// One parsed scope `action:type[:id]` (only the first two colons separate; see [`parse_scope`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    /// `read`, `write`, `*`, `admin`, … (never empty).
    pub action: String,
    /// Resource type (`runs`, `tasks`, `tags`, `batch`, `all`, …); `None` when absent or empty.
    pub kind: Option<String>,
    /// Resource id (friendly id, raw tag, task identifier); may contain colons.
    pub id: Option<String>,
}

/// What a credential may do: a secret key may do anything; a public token only its scopes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ability {
    /// Secret (root) key: `permissiveAbility`, every check passes.
    All,
    /// Public token: the parsed `scopes` claim ([`Ability::from_scopes`]); shared, so a
    /// principal rebuilt from a verified token's cache entry copies no scope.
    Scopes(Arc<[Scope]>),
}

/// A resource a route asks to read: `{type}` or `{type, id}` (ids are friendly ids / raw tags /
/// task identifiers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resource<'a> {
    /// `runs` | `tasks` | `tags` | `batch`.
    pub kind: &'a str,
    /// `None` = the type as a whole (e.g. `{runs}` on the list route).
    pub id: Option<&'a str>,
}

impl Ability {
    /// Whether any of `resources` may be read (`checkAuth(ability, "read", anyResource([...]))`;
    /// for scopes an empty list → false; [`Ability::All`] → always true). See [`Scope::grants`].
    pub fn can_read_any(&self, resources: &[Resource<'_>]) -> bool {
        self.can_any("read", resources)
    }
}

/// An authenticated request.
#[derive(Clone, Debug)]
pub struct Principal {
    /// The environment every lookup is scoped to.
    pub env: AuthedEnv,
    /// What the credential may read.
    pub ability: Ability,
    /// The JWT's `realtime.skipColumns` claim; when present it REPLACES the URL parameter.
    pub skip_columns: Option<Vec<String>>,
}

/// Why authentication failed. Every variant except [`AuthError::Store`] is a 401 whose body is
/// `{"error": <Display text>}` (the exact trigger.dev strings); `Store` is a database failure
/// (503 `{"error":"Service Unavailable"}`, see `http::ApiError`).
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization` header, or nothing left after stripping `Bearer ` and trimming.
    #[error("Invalid or Missing API key")]
    Missing,
    /// Secret-key path: no environment for the key (nor an unexpired revoked key), or the
    /// project is deleted. Also any non-`pub` JWT, `pk_…` and additional (`tr_*_sk_…`) keys.
    #[error("Invalid API key")]
    InvalidApiKey,
    /// Public token failed verification (signature, even after the revoked-key retry; expiry;
    /// `iss`/`aud`; malformed).
    #[error("Public Access Token is invalid")]
    InvalidPublicToken,
    /// Public token whose `sub` is not a non-empty string, or names no environment / an
    /// environment of a deleted project (bearerCredentials.ts returns this different text before
    /// verification).
    #[error("Invalid Public Access Token")]
    PublicTokenEnvNotFound,
    /// PREVIEW secret key without a usable `x-trigger-branch` header.
    #[error("x-trigger-branch header required for preview env")]
    BranchRequired,
    /// PREVIEW (or DEVELOPMENT with a non-`default` branch) and no non-archived child env has
    /// that `branchName`.
    #[error("No matching branch env")]
    NoMatchingBranch,
    /// A run token (header `typ: run+jwt`, what trigger.dev SDK 4.8 gives a task in
    /// `TRIGGER_RUN_TOKEN`): trigger.dev has not published how it is verified, so this server
    /// never accepts it itself. The HTTP layer forwards its request to the webapp when
    /// `auth.run_token_upstream` is set; otherwise it is a 401 that names the kind
    /// (docs/faults.md "401 for a run token").
    #[error("Run tokens (typ run+jwt, TRIGGER_RUN_TOKEN) cannot be verified by this server, and no webapp to forward them to is configured (auth.run_token_upstream): read realtime feeds with a Public Access Token or a secret API key")]
    RunToken,
    /// The environment lookup itself failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub use jwt::mint_public_token;

/// Upper bound on entries per lookup cache (keys are bearer-controlled, so the caches must be
/// bounded).
const CACHE_MAX_ENTRIES: u64 = 10_000;

/// The per-lookup caches, one per lookup (found AND not-found results are cached; errors are
/// not, and are shared by the callers that waited on the failing lookup: [`TtlCache::get_or_load`]).
/// Bound: each holds at most [`CACHE_MAX_ENTRIES`] entries; TTLs per field.
struct Caches {
    /// Environments by secret key: `cache_ttl`.
    by_api_key: TtlCache<String, Option<Arc<EnvRecord>>>,
    /// Environments by revoked key: `cache_ttl`.
    by_revoked_key: TtlCache<String, Option<Arc<EnvRecord>>>,
    /// Environments by id (the public-token path; every poll of a public token looks its
    /// environment up): found ones for the found-env TTL (the longer of it and `cache_ttl`),
    /// misses for `cache_ttl` (a just-created environment is not refused for long).
    by_id: TtlCache<EnvId, Option<Arc<EnvRecord>>>,
    /// Branch environments by parent and branch name: `cache_ttl`.
    branch: TtlCache<(EnvId, String), Option<Arc<EnvRecord>>>,
    /// The unexpired revoked keys of an environment: `cache_ttl`.
    revoked_keys: TtlCache<EnvId, Vec<String>>,
    /// Public tokens already verified with their environment's current signing key, for the
    /// found-env TTL (the longer of it and `cache_ttl`): a live poll re-presents the same token
    /// every ~20 s, and decoding plus HMAC verification was the largest single cost of a
    /// delivery (BENCHMARKS.md "Cost per unit of work"). Not a loading cache.
    verified: TtlCache<String, Arc<VerifiedToken>>,
    /// How long `by_id` keeps a found environment.
    found_by_id_ttl: Duration,
    /// `cache_ttl`: how long `by_id` keeps a miss.
    lookup_ttl: Duration,
}

/// What a verified public token grants, kept so the next request with the same token skips the
/// base64 + JSON decoding and the HMAC. Reused only while the environment's signing key is the
/// one it was verified with and the token's own `nbf`/`exp` (seconds) allow it.
#[derive(Clone)]
struct VerifiedToken {
    env_id: EnvId,
    signing_key: Arc<str>,
    not_before_s: Option<f64>,
    expires_s: Option<f64>,
    ability: Ability,
    skip_columns: Option<Vec<String>>,
}

impl VerifiedToken {
    fn usable_at(&self, now_s: u64) -> bool {
        let now = now_s as f64;
        self.not_before_s.is_none_or(|nbf| nbf <= now) && self.expires_s.is_none_or(|exp| exp > now)
    }
}

impl Caches {
    fn new(ttl: Duration, found_by_id_ttl: Duration) -> Self {
        let found_by_id_ttl = found_by_id_ttl.max(ttl);
        Caches {
            by_api_key: TtlCache::new(CACHE_MAX_ENTRIES, ttl),
            by_revoked_key: TtlCache::new(CACHE_MAX_ENTRIES, ttl),
            by_id: TtlCache::new(CACHE_MAX_ENTRIES, ttl),
            branch: TtlCache::new(CACHE_MAX_ENTRIES, ttl),
            revoked_keys: TtlCache::new(CACHE_MAX_ENTRIES, ttl),
            verified: TtlCache::new(CACHE_MAX_ENTRIES, found_by_id_ttl),
            found_by_id_ttl,
            lookup_ttl: ttl,
        }
    }
}

/// A store error shared by the waiters of one failed lookup, handed back to this caller
/// (rebuilt when other waiters share it).
fn unshared(shared: Arc<StoreError>) -> StoreError {
    Arc::try_unwrap(shared).unwrap_or_else(|shared| StoreError {
        op: shared.op,
        source: sqlx::Error::Protocol(shared.source.to_string()),
    })
}

/// A cached lookup ([`TtlCache::get_or_load`]: single-flighted; an error is not cached and is
/// handed back to the caller).
async fn cached<K, V, F>(cache: Option<&TtlCache<K, V>>, key: K, fetch: F) -> Result<V, StoreError>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
    F: std::future::Future<Output = Result<V, StoreError>>,
{
    match cache {
        None => fetch.await,
        Some(cache) => cache.get_or_load(key, fetch).await.map_err(unshared),
    }
}

/// An environment lookup through `cache` ([`cached`]) whose found record is shared: cache hits
/// hand out the same record instead of copying its strings on every request.
async fn cached_env<K>(
    cache: Option<&TtlCache<K, Option<Arc<EnvRecord>>>>,
    key: K,
    lookup: impl std::future::Future<Output = Found<EnvRecord>>,
) -> Result<Option<Arc<EnvRecord>>, StoreError>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
{
    cached(cache, key, async { Ok(lookup.await?.map(Arc::new)) }).await
}

/// `sanitizeBranchName` (`packages/core/src/v3/utils/gitBranch.ts`): empty → `None`; strips
/// `refs/heads/`, `refs/remotes/`, `refs/tags/`, `refs/pull/`, `refs/merge/`, `refs/release/`;
/// any other `refs/…` → `None`; anything else is kept verbatim (no trimming).
pub fn sanitize_branch_name(raw: Option<&str>) -> Option<&str> {
    let raw = raw.filter(|r| !r.is_empty())?;
    for prefix in [
        "refs/heads/",
        "refs/remotes/",
        "refs/tags/",
        "refs/pull/",
        "refs/merge/",
        "refs/release/",
    ] {
        if let Some(rest) = raw.strip_prefix(prefix) {
            return Some(rest);
        }
    }
    if raw.starts_with("refs/") {
        return None;
    }
    Some(raw)
}

/// `isAdditionalApiKey` (`packages/core/src/v3/apiKeys.ts`): `^tr_(dev|stg|prod|preview)_sk_[0-9a-zA-Z]{24}$`.
pub fn is_additional_api_key(token: &str) -> bool {
    ["tr_dev_sk_", "tr_stg_sk_", "tr_prod_sk_", "tr_preview_sk_"]
        .iter()
        .any(|prefix| {
            token.strip_prefix(prefix).is_some_and(|rest| {
                rest.len() == 24 && rest.bytes().all(|b| b.is_ascii_alphanumeric())
            })
        })
}

/// The bearer token of an `Authorization` value: a leading `Bearer ` (case-sensitive, exactly one
/// space) stripped, then trimmed; empty → `None`.
pub fn bearer_token(authorization: Option<&str>) -> Option<&str> {
    let raw = authorization?;
    let token = raw.strip_prefix("Bearer ").unwrap_or(raw).trim();
    (!token.is_empty()).then_some(token)
}

/// Authenticates bearers against an [`EnvStore`], caching environment lookups briefly.
pub struct Authenticator {
    store: Arc<dyn EnvStore>,
    caches: Option<Caches>,
}

impl Authenticator {
    /// `cache_ttl`: how long environment/key lookups (by api key, by revoked key, by env id, by
    /// branch, revoked keys of an env) are reused, found or not (0 disables caching). At most
    /// 10 000 entries per lookup kind. Environments FOUND by id (public tokens) are kept
    /// [`Authenticator::with_found_env_ttl`] instead (the longer of the two).
    pub fn new(store: Arc<dyn EnvStore>, cache_ttl: Duration) -> Self {
        Self::with_found_env_ttl(store, cache_ttl, cache_ttl)
    }

    /// [`Authenticator::new`], keeping environments found by id (the public-token path: one
    /// lookup per environment, whatever the number of feeds) for `found_env_ttl`
    /// (`caches.public_token_env_ttl_ms`).
    pub fn with_found_env_ttl(
        store: Arc<dyn EnvStore>,
        cache_ttl: Duration,
        found_env_ttl: Duration,
    ) -> Self {
        let caches = (!cache_ttl.is_zero()).then(|| Caches::new(cache_ttl, found_env_ttl));
        Authenticator { store, caches }
    }

    /// Authenticates the raw `Authorization` header value and optional `x-trigger-branch`
    /// (docs/trigger-dev.md §2.2–2.3):
    ///
    /// 1. [`bearer_token`]; none → [`AuthError::Missing`].
    /// 2. A JWT whose unverified payload has `pub: true` → public token path: `sub` → env by id
    ///    (none / deleted project → [`AuthError::PublicTokenEnvNotFound`]), verify with the
    ///    signing key (`parent_api_key ?? api_key`), on a signature mismatch only retry each
    ///    unexpired revoked key of the signing env; failure → [`AuthError::InvalidPublicToken`].
    ///    Ability = the `scopes` claim; `realtime.skipColumns` → [`Principal::skip_columns`].
    ///    The branch header is ignored (`sub` already names the branch env).
    /// 3. Otherwise a secret key: env by `apiKey`, else by an unexpired `RevokedApiKey`; none or
    ///    deleted project → [`AuthError::InvalidApiKey`]; then branch resolution (PREVIEW needs a
    ///    branch; PREVIEW, or DEVELOPMENT with a branch other than `default`, pivots to the
    ///    non-archived child with that `branchName`). Ability = [`Ability::All`].
    ///
    /// A run token (header `typ: run+jwt`) is refused with [`AuthError::RunToken`] before any
    /// lookup, whatever its claims.
    ///
    /// Additional API keys (`tr_*_sk_…`, the `api_keys` table) are rejected with
    /// [`AuthError::InvalidApiKey`], as trigger.dev does while its `additionalApiKeyLookupEnabled`
    /// flag is off (the default).
    pub async fn authenticate(
        &self,
        authorization: Option<&str>,
        branch: Option<&str>,
    ) -> Result<Principal, AuthError> {
        let token = bearer_token(authorization).ok_or(AuthError::Missing)?;
        if let Some(principal) = self.reverify_public_token(token).await? {
            return Ok(principal);
        }
        if jwt::is_run_token(token) {
            return Err(AuthError::RunToken);
        }
        if let Some(payload) = jwt::unverified_payload(token) {
            if payload.get("pub") == Some(&serde_json::Value::Bool(true)) {
                let sub = payload
                    .get("sub")
                    .and_then(|v| v.as_str())
                    .unwrap_or_default();
                // Boxed (here and below): a request whose token was verified before never
                // carries, or moves, the store reads of the full paths.
                return Box::pin(self.authenticate_public_token(token, sub)).await;
            }
        }
        Box::pin(self.authenticate_secret_key(token, branch)).await
    }

    async fn authenticate_public_token(
        &self,
        token: &str,
        sub: &str,
    ) -> Result<Principal, AuthError> {
        if sub.is_empty() {
            return Err(AuthError::PublicTokenEnvNotFound);
        }
        // The token's `sub` names the environment: parsed here, once.
        let env = match self.env_by_id(&EnvId::new(sub)).await? {
            Some(env) if !env.project_deleted => env,
            _ => return Err(AuthError::PublicTokenEnvNotFound),
        };
        let signing_key = env.parent_api_key.as_deref().unwrap_or(&env.api_key);
        let now = jwt::now_s();
        let claims = match jwt::verify_public_token(token, signing_key, now) {
            Ok(claims) => {
                self.remember_verified(token, &env, signing_key, &claims)
                    .await;
                claims
            }
            Err(VerifyFailure::Invalid) => return Err(AuthError::InvalidPublicToken),
            Err(VerifyFailure::Signature) => {
                let signing_env_id = match (&env.parent_api_key, &env.parent_environment_id) {
                    (Some(_), Some(parent_id)) => parent_id,
                    _ => &env.id,
                };
                let mut verified = None;
                for key in self.revoked_keys(signing_env_id).await? {
                    if let Ok(claims) = jwt::verify_public_token(token, &key, now) {
                        verified = Some(claims);
                        break;
                    }
                }
                verified.ok_or(AuthError::InvalidPublicToken)?
            }
        };
        Ok(Principal {
            env: AuthedEnv::of(&env),
            ability: Ability::from_scopes(&jwt::scopes_claim(&claims)),
            skip_columns: jwt::skip_columns_claim(&claims),
        })
    }

    /// A public token verified earlier with its environment's current signing key, still inside
    /// its `nbf`/`exp`: the same [`Principal`] without decoding or verifying again. `None` when
    /// the token was not verified before (or is no longer usable): the full path decides.
    async fn reverify_public_token(&self, token: &str) -> Result<Option<Principal>, AuthError> {
        let Some(caches) = &self.caches else {
            return Ok(None);
        };
        if !token.contains('.') {
            return Ok(None);
        }
        let Some(verified) = caches.verified.get(token) else {
            return Ok(None);
        };
        if !verified.usable_at(jwt::now_s()) {
            return Ok(None);
        }
        let env = match self.env_by_id(&verified.env_id).await? {
            Some(env) if !env.project_deleted => env,
            _ => return Ok(None),
        };
        let signing_key = env.parent_api_key.as_deref().unwrap_or(&env.api_key);
        if signing_key != &*verified.signing_key {
            return Ok(None);
        }
        Ok(Some(Principal {
            env: AuthedEnv::of(&env),
            ability: verified.ability.clone(),
            skip_columns: verified.skip_columns.clone(),
        }))
    }

    /// Keeps what `claims` (verified with `signing_key`, the current key of `env`) grant.
    async fn remember_verified(
        &self,
        token: &str,
        env: &EnvRecord,
        signing_key: &str,
        claims: &serde_json::Map<String, serde_json::Value>,
    ) {
        let Some(caches) = &self.caches else {
            return;
        };
        let seconds = |name: &str| claims.get(name).and_then(serde_json::Value::as_f64);
        let verified = VerifiedToken {
            env_id: env.id.clone(),
            signing_key: Arc::from(signing_key),
            not_before_s: seconds("nbf"),
            expires_s: seconds("exp"),
            ability: Ability::from_scopes(&jwt::scopes_claim(claims)),
            skip_columns: jwt::skip_columns_claim(claims),
        };
        caches
            .verified
            .insert(token.to_string(), Arc::new(verified));
    }

    async fn authenticate_secret_key(
        &self,
        token: &str,
        branch: Option<&str>,
    ) -> Result<Principal, AuthError> {
        if is_additional_api_key(token) {
            return Err(AuthError::InvalidApiKey);
        }
        let env = match self.env_by_api_key(token).await? {
            Some(env) => Some(env),
            None => self.env_by_revoked_key(token).await?,
        };
        let env = match env {
            Some(env) if !env.project_deleted => env,
            _ => return Err(AuthError::InvalidApiKey),
        };
        let branch = sanitize_branch_name(branch);
        let is_preview = env.env_type == "PREVIEW";
        let is_dev = env.env_type == "DEVELOPMENT";
        if is_preview && branch.is_none() {
            return Err(AuthError::BranchRequired);
        }
        let mut authed = AuthedEnv::of(&env);
        if is_preview || is_dev {
            if let Some(branch) = branch.filter(|b| !(is_dev && *b == "default")) {
                let child = self
                    .branch_env(&env.id, branch)
                    .await?
                    .ok_or(AuthError::NoMatchingBranch)?;
                authed.id = child.id.clone();
                authed.env_type = child.env_type.clone();
            }
        }
        Ok(Principal {
            env: authed,
            ability: Ability::All,
            skip_columns: None,
        })
    }

    async fn env_by_api_key(&self, key: &str) -> Result<Option<Arc<EnvRecord>>, StoreError> {
        let cache = self.caches.as_ref().map(|c| &c.by_api_key);
        cached_env(cache, key.to_string(), self.store.env_by_api_key(key)).await
    }

    async fn env_by_revoked_key(&self, key: &str) -> Result<Option<Arc<EnvRecord>>, StoreError> {
        let cache = self.caches.as_ref().map(|c| &c.by_revoked_key);
        cached_env(cache, key.to_string(), self.store.env_by_revoked_key(key)).await
    }

    async fn env_by_id(&self, id: &EnvId) -> Result<Option<Arc<EnvRecord>>, StoreError> {
        let Some(caches) = &self.caches else {
            return Ok(self.store.env_by_id(id).await?.map(Arc::new));
        };
        let (found_ttl, missing_ttl) = (caches.found_by_id_ttl, caches.lookup_ttl);
        let ttl_of = |env: &Option<Arc<EnvRecord>>| match env {
            Some(_) => found_ttl,
            None => missing_ttl,
        };
        let lookup = async { Ok(self.store.env_by_id(id).await?.map(Arc::new)) };
        caches
            .by_id
            .get_or_load_for(id.clone(), ttl_of, lookup)
            .await
            .map_err(unshared)
    }

    async fn branch_env(
        &self,
        parent_id: &EnvId,
        branch: &str,
    ) -> Result<Option<Arc<EnvRecord>>, StoreError> {
        let cache = self.caches.as_ref().map(|c| &c.branch);
        let key = (parent_id.clone(), branch.to_string());
        cached_env(cache, key, self.store.branch_env(parent_id, branch)).await
    }

    async fn revoked_keys(&self, env_id: &EnvId) -> Result<Vec<String>, StoreError> {
        let cache = self.caches.as_ref().map(|c| &c.revoked_keys);
        cached(cache, env_id.clone(), self.store.revoked_keys(env_id)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use parking_lot::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn bearer_token_strips_exact_prefix_and_trims() {
        assert_eq!(bearer_token(Some("Bearer tr_dev_x")), Some("tr_dev_x"));
        assert_eq!(bearer_token(Some("Bearer   tr_dev_x  ")), Some("tr_dev_x"));
        assert_eq!(bearer_token(Some("tr_dev_x")), Some("tr_dev_x"));
        // Case-sensitive prefix: `bearer x` is kept whole (and then fails as a key).
        assert_eq!(bearer_token(Some("bearer x")), Some("bearer x"));
        assert_eq!(bearer_token(Some("Bearer ")), None);
        assert_eq!(bearer_token(Some("Bearer    ")), None);
        assert_eq!(bearer_token(Some("")), None);
        assert_eq!(bearer_token(None), None);
    }

    #[test]
    fn sanitize_branch_name_matches_git_branch_ts() {
        assert_eq!(
            sanitize_branch_name(Some("refs/heads/feature/x")),
            Some("feature/x")
        );
        assert_eq!(
            sanitize_branch_name(Some("refs/pull/12/merge")),
            Some("12/merge")
        );
        assert_eq!(sanitize_branch_name(Some("refs/other/x")), None);
        assert_eq!(sanitize_branch_name(Some("main")), Some("main"));
        assert_eq!(sanitize_branch_name(Some("")), None);
        assert_eq!(sanitize_branch_name(None), None);
    }

    #[test]
    fn additional_api_key_shape() {
        assert!(is_additional_api_key("tr_dev_sk_abcdefghijklmnopqrstuvwx"));
        assert!(is_additional_api_key(
            "tr_preview_sk_ABCDEFGHIJKLMNOPQRSTUV12"
        ));
        assert!(!is_additional_api_key("tr_dev_abcdefghijklmnopqrstuvwx"));
        assert!(!is_additional_api_key("tr_dev_sk_short"));
    }

    /// In-memory [`EnvStore`] counting lookups.
    #[derive(Default)]
    struct MemEnvs {
        envs: Mutex<Vec<EnvRecord>>,
        revoked: Mutex<Vec<(String, String)>>,
        lookups: AtomicUsize,
    }

    impl MemEnvs {
        /// Counts one lookup and finds the first environment matching `pred`.
        fn lookup(&self, pred: impl Fn(&EnvRecord) -> bool) -> Found<EnvRecord> {
            self.lookups.fetch_add(1, Ordering::SeqCst);
            Ok(self.envs.lock().iter().find(|e| pred(e)).cloned())
        }
    }

    #[async_trait]
    impl EnvStore for MemEnvs {
        async fn env_by_api_key(&self, key: &str) -> Found<EnvRecord> {
            self.lookup(|e| e.api_key == key)
        }
        async fn env_by_revoked_key(&self, key: &str) -> Found<EnvRecord> {
            let revoked = self.revoked.lock();
            let env_id = revoked.iter().find(|(_, k)| k == key).map(|(e, _)| e);
            self.lookup(|e| env_id.is_some_and(|id| e.id == *id))
        }
        async fn env_by_id(&self, id: &EnvId) -> Found<EnvRecord> {
            self.lookup(|e| &e.id == id)
        }
        async fn branch_env(&self, parent_id: &EnvId, branch: &str) -> Found<EnvRecord> {
            self.lookup(|e| {
                e.parent_environment_id.as_deref() == Some(parent_id)
                    && e.branch_name.as_deref() == Some(branch)
                    && !e.archived
            })
        }
        async fn revoked_keys(&self, env_id: &EnvId) -> Result<Vec<String>, StoreError> {
            self.lookups.fetch_add(1, Ordering::SeqCst);
            Ok(self
                .revoked
                .lock()
                .iter()
                .filter(|(e, _)| e == env_id.as_str())
                .map(|(_, k)| k.clone())
                .collect())
        }
    }

    fn env(id: &str, env_type: &str, key: &str) -> EnvRecord {
        EnvRecord {
            id: id.into(),
            env_type: env_type.into(),
            organization_id: OrgId::new("org"),
            project_id: "proj".into(),
            api_key: key.into(),
            parent_environment_id: None,
            parent_api_key: None,
            branch_name: None,
            archived: false,
            project_deleted: false,
        }
    }

    fn store_with(envs: Vec<EnvRecord>) -> Arc<MemEnvs> {
        let store = MemEnvs::default();
        *store.envs.lock() = envs;
        Arc::new(store)
    }

    /// A store with `env_1` (PRODUCTION, key `tr_prod_key`) and an authenticator over it whose
    /// cache keeps lookups for `ttl`.
    fn prod_auth(ttl: Duration) -> (Arc<MemEnvs>, Authenticator) {
        let store = store_with(vec![env("env_1", "PRODUCTION", "tr_prod_key")]);
        let auth = Authenticator::new(store.clone(), ttl);
        (store, auth)
    }

    /// Authenticates `tr_prod_key` three times; returns the store's lookups so far.
    async fn authenticate_thrice(auth: &Authenticator, store: &MemEnvs) -> usize {
        for _ in 0..3 {
            let p = auth.authenticate(Some("Bearer tr_prod_key"), None).await;
            assert!(p.is_ok(), "{p:?}");
        }
        store.lookups.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn cache_reuses_found_and_not_found_lookups() {
        let (store, auth) = prod_auth(Duration::from_secs(60));
        assert_eq!(authenticate_thrice(&auth, &store).await, 1);
        for _ in 0..3 {
            assert!(matches!(
                auth.authenticate(Some("Bearer nope"), None).await,
                Err(AuthError::InvalidApiKey)
            ));
        }
        // by api key + by revoked key, once each.
        assert_eq!(store.lookups.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn zero_ttl_disables_the_cache() {
        let (store, auth) = prod_auth(Duration::ZERO);
        assert_eq!(authenticate_thrice(&auth, &store).await, 3);
    }

    #[tokio::test]
    async fn missing_bearer_is_missing() {
        let auth = Authenticator::new(store_with(vec![]), Duration::ZERO);
        assert!(matches!(
            auth.authenticate(None, None).await,
            Err(AuthError::Missing)
        ));
        assert!(matches!(
            auth.authenticate(Some("Bearer  "), None).await,
            Err(AuthError::Missing)
        ));
    }

    #[tokio::test]
    async fn development_branch_pivots_except_default() {
        let mut child = env("env_child", "PREVIEW", "tr_dev_childkey");
        child.parent_environment_id = Some("env_dev".into());
        child.branch_name = Some("feat".into());
        let store = store_with(vec![env("env_dev", "DEVELOPMENT", "tr_dev_key"), child]);
        let auth = Authenticator::new(store, Duration::ZERO);
        let p = auth
            .authenticate(Some("Bearer tr_dev_key"), None)
            .await
            .unwrap();
        assert_eq!(p.env.id, "env_dev");
        let p = auth
            .authenticate(Some("Bearer tr_dev_key"), Some("default"))
            .await
            .unwrap();
        assert_eq!(p.env.id, "env_dev");
        let p = auth
            .authenticate(Some("Bearer tr_dev_key"), Some("refs/heads/feat"))
            .await
            .unwrap();
        assert_eq!(p.env.id, "env_child");
        assert_eq!(p.env.env_type, "PREVIEW");
        assert!(matches!(
            auth.authenticate(Some("Bearer tr_dev_key"), Some("nope"))
                .await,
            Err(AuthError::NoMatchingBranch)
        ));
    }

    #[tokio::test]
    async fn production_ignores_branch_header() {
        let store = store_with(vec![env("env_p", "PRODUCTION", "tr_prod_key")]);
        let auth = Authenticator::new(store, Duration::ZERO);
        let p = auth
            .authenticate(Some("Bearer tr_prod_key"), Some("whatever"))
            .await
            .unwrap();
        assert_eq!(p.env.id, "env_p");
        assert_eq!(p.ability, Ability::All);
        assert_eq!(p.skip_columns, None);
    }

    #[tokio::test]
    async fn public_token_with_unknown_sub_is_invalid_public_access_token() {
        let auth = Authenticator::new(store_with(vec![]), Duration::ZERO);
        let token = mint_public_token(
            "tr_dev_key",
            "env_missing",
            &[],
            Duration::from_secs(60),
            None,
        )
        .unwrap();
        let err = auth
            .authenticate(Some(&format!("Bearer {token}")), None)
            .await
            .unwrap_err();
        assert!(matches!(err, AuthError::PublicTokenEnvNotFound));
        assert_eq!(err.to_string(), "Invalid Public Access Token");
    }

    /// Environments found by id (public tokens) outlive the short lookup TTL; misses do not
    /// (a just-created environment is not refused for long).
    #[tokio::test(start_paused = true)]
    async fn found_environments_by_id_are_kept_longer_than_misses() {
        let store = store_with(vec![env("env_1", "PRODUCTION", "tr_prod_key")]);
        let auth = Authenticator::with_found_env_ttl(
            store.clone(),
            Duration::from_millis(20),
            Duration::from_secs(60),
        );
        let token = |sub: &str| {
            mint_public_token("tr_prod_key", sub, &[], Duration::from_secs(60), None).unwrap()
        };
        let found = format!("Bearer {}", token("env_1"));
        let missing = format!("Bearer {}", token("env_missing"));
        assert!(auth.authenticate(Some(&found), None).await.is_ok());
        assert!(auth.authenticate(Some(&missing), None).await.is_err());
        let after_first = store.lookups.load(Ordering::SeqCst);
        tokio::time::advance(Duration::from_millis(60)).await; // past the short TTL
        assert!(auth.authenticate(Some(&found), None).await.is_ok());
        assert!(auth.authenticate(Some(&missing), None).await.is_err());
        assert_eq!(
            store.lookups.load(Ordering::SeqCst) - after_first,
            1,
            "only the miss is looked up again"
        );
    }

    /// A public token verified once is not decoded again, and grants exactly what it did.
    #[tokio::test]
    async fn a_reused_public_token_grants_what_it_granted_without_a_second_verification() {
        let (_store, auth) = prod_auth(Duration::from_secs(60));
        let skip = vec!["payload".to_string()];
        let token = mint_public_token(
            "tr_prod_key",
            "env_1",
            &["read:runs:run_1".to_string()],
            Duration::from_secs(60),
            Some(&skip),
        )
        .unwrap();
        assert!(auth.reverify_public_token(&token).await.unwrap().is_none());
        let first = auth
            .authenticate(Some(&format!("Bearer {token}")), None)
            .await
            .unwrap();
        let reused = auth
            .reverify_public_token(&token)
            .await
            .unwrap()
            .expect("the verified token is reused");
        assert_eq!(reused.env.id, first.env.id);
        assert_eq!(reused.ability, first.ability);
        assert_eq!(reused.skip_columns, Some(skip));
        let again = auth
            .authenticate(Some(&format!("Bearer {token}")), None)
            .await
            .unwrap();
        assert_eq!(again.ability, first.ability);
    }

    /// A token verified with a key that has since been rotated away is verified again (and
    /// refused), not reused.
    #[tokio::test]
    async fn a_reused_public_token_is_refused_once_its_signing_key_rotates() {
        let (store, auth) = prod_auth(Duration::from_secs(60));
        let token =
            mint_public_token("tr_prod_key", "env_1", &[], Duration::from_secs(60), None).unwrap();
        let bearer = format!("Bearer {token}");
        assert!(auth.authenticate(Some(&bearer), None).await.is_ok());
        store.envs.lock()[0].api_key = "tr_prod_rotated".into();
        let caches = auth.caches.as_ref().unwrap();
        caches.by_id.clear();
        assert!(auth.reverify_public_token(&token).await.unwrap().is_none());
        assert!(matches!(
            auth.authenticate(Some(&bearer), None).await,
            Err(AuthError::InvalidPublicToken)
        ));
    }

    /// A remembered token is usable only inside its own `nbf`..`exp` (seconds).
    #[test]
    fn a_remembered_token_is_usable_only_inside_its_nbf_and_exp() {
        let verified = VerifiedToken {
            env_id: EnvId::new("env_1"),
            signing_key: Arc::from("k"),
            not_before_s: Some(100.0),
            expires_s: Some(200.0),
            ability: Ability::All,
            skip_columns: None,
        };
        assert!(!verified.usable_at(99));
        assert!(verified.usable_at(100));
        assert!(verified.usable_at(199));
        assert!(
            !verified.usable_at(200),
            "exp is exclusive, as in check_claims"
        );
    }
}
