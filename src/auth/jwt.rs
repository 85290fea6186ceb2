//! Public access tokens (docs/trigger-dev.md §2.3): the unverified `pub: true` probe (`isPublicJWT`,
//! `packages/core/src/v3/jwt.ts`), verification with jose 5.x `jwtVerify` semantics, and minting
//! as the SDK's `generateJWT` does.

use std::time::Duration;

use base64::alphabet::URL_SAFE;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use base64::engine::DecodePaddingMode;
use base64::Engine as _;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde_json::{Map, Value};

/// `JWT_ISSUER`: the required `iss`.
pub const JWT_ISSUER: &str = "https://id.trigger.dev";
/// `JWT_AUDIENCE`: `aud` must be this string or an array containing it.
pub const JWT_AUDIENCE: &str = "https://api.trigger.dev";

/// Lenient base64url (padding optional, trailing bits tolerated), like Node's `Buffer.from(…,
/// "base64url")` that jose uses in `decodeJwt`.
const LENIENT_B64URL: GeneralPurpose = GeneralPurpose::new(
    &URL_SAFE,
    GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true),
);

/// The unverified payload of a compact JWS if it is a JSON object (jose `decodeJwt`: exactly three
/// `.`-separated segments, non-empty payload, base64url JSON object). `None` otherwise.
pub fn unverified_payload(token: &str) -> Option<Map<String, Value>> {
    let mut parts = token.split('.');
    let (_, payload, _) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || payload.is_empty() {
        return None;
    }
    let normalized: String = payload
        .chars()
        .map(|c| match c {
            '+' => '-',
            '/' => '_',
            c => c,
        })
        .collect();
    let bytes = LENIENT_B64URL
        .decode(normalized.trim_end_matches('='))
        .ok()?;
    match serde_json::from_str::<Value>(&String::from_utf8_lossy(&bytes)).ok()? {
        Value::Object(map) => Some(map),
        _ => None,
    }
}

/// The `typ` of a compact JWS's protected header (`None` when the token is not three
/// `.`-separated segments, the header is not a base64url JSON object, or it has no string
/// `typ`). Unverified: only used to tell token kinds apart before verification.
pub fn unverified_typ(token: &str) -> Option<String> {
    let mut parts = token.split('.');
    let (header, _, _) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let bytes = LENIENT_B64URL.decode(header.trim_end_matches('=')).ok()?;
    match serde_json::from_slice::<Value>(&bytes).ok()? {
        Value::Object(map) => map.get("typ")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// The header `typ` of the run tokens trigger.dev SDK 4.8 hands a task in `TRIGGER_RUN_TOKEN`
/// (compared case-insensitively, as media types are). trigger.dev has not published how they
/// are verified, so this server cannot accept them.
pub const RUN_TOKEN_TYP: &str = "run+jwt";

/// Whether `token` is a run token ([`RUN_TOKEN_TYP`] in its unverified header).
pub fn is_run_token(token: &str) -> bool {
    unverified_typ(token).is_some_and(|typ| typ.eq_ignore_ascii_case(RUN_TOKEN_TYP))
}

/// `isPublicJWT`: the unverified payload has the literal `pub: true`. A JWT without it is treated
/// as an API key (and gets "Invalid API key").
pub fn is_public_jwt(token: &str) -> bool {
    unverified_payload(token).is_some_and(|p| p.get("pub") == Some(&Value::Bool(true)))
}

/// Why a public token failed verification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyFailure {
    /// The HMAC did not match (jose `ERR_JWS_SIGNATURE_VERIFICATION_FAILED`): the only failure
    /// that is retried with the environment's revoked keys.
    Signature,
    /// Anything else: malformed, unsupported algorithm, expired, not yet valid, wrong `iss`/`aud`.
    Invalid,
}

/// Verifies `token` with the HMAC key `key` (the UTF-8 bytes of the raw root key string, never a
/// hash) at `now_s` (epoch seconds), as jose 5.x `jwtVerify(token, key, {issuer, audience})`:
///
/// - `alg` HS256, HS384 or HS512 (a byte-array key allows every HMAC algorithm);
/// - signature first ([`VerifyFailure::Signature`] on mismatch);
/// - then the payload must be a JSON object with `iss == "https://id.trigger.dev"` and `aud`
///   equal to, or an array containing, `"https://api.trigger.dev"`;
/// - `iat`, if present, must be a number; `nbf`, if present, a number `<= now`; `exp` is
///   optional and, if present, must be a number `> now` (`exp <= now` is expired; no tolerance).
///
/// Returns the verified claims.
pub fn verify_public_token(
    token: &str,
    key: &str,
    now_s: u64,
) -> Result<Map<String, Value>, VerifyFailure> {
    let decoding_key =
        DecodingKey::from_secret(key.as_bytes()).map_err(|_| VerifyFailure::Invalid)?;
    let mut validation = Validation::new(Algorithm::HS256);
    validation.algorithms = vec![Algorithm::HS256, Algorithm::HS384, Algorithm::HS512];
    validation.required_spec_claims.clear();
    validation.validate_exp = false;
    validation.validate_nbf = false;
    validation.validate_aud = false;
    validation.leeway = 0;
    let data =
        jsonwebtoken::decode::<Value>(token, &decoding_key, &validation).map_err(|e| {
            match e.kind() {
                ErrorKind::InvalidSignature => VerifyFailure::Signature,
                _ => VerifyFailure::Invalid,
            }
        })?;
    let Value::Object(claims) = data.claims else {
        return Err(VerifyFailure::Invalid);
    };
    check_claims(&claims, now_s)?;
    Ok(claims)
}

/// jose `JWTClaimsSet` validation for `{issuer, audience}` with zero clock tolerance.
fn check_claims(claims: &Map<String, Value>, now_s: u64) -> Result<(), VerifyFailure> {
    let now = now_s as f64;
    let iss_ok = matches!(claims.get("iss"), Some(Value::String(s)) if s == JWT_ISSUER);
    let aud_ok = match claims.get("aud") {
        Some(Value::String(s)) => s == JWT_AUDIENCE,
        Some(Value::Array(items)) => items.iter().any(|v| v.as_str() == Some(JWT_AUDIENCE)),
        _ => false,
    };
    if !iss_ok || !aud_ok {
        return Err(VerifyFailure::Invalid);
    }
    let number = |name: &str| -> Result<Option<f64>, VerifyFailure> {
        match claims.get(name) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or(VerifyFailure::Invalid),
        }
    };
    number("iat")?;
    if let Some(nbf) = number("nbf")? {
        if nbf > now {
            return Err(VerifyFailure::Invalid);
        }
    }
    if let Some(exp) = number("exp")? {
        if exp <= now {
            return Err(VerifyFailure::Invalid);
        }
    }
    Ok(())
}

/// The `scopes` claim: an array of strings (non-string entries dropped); anything else → `[]`.
pub fn scopes_claim(claims: &Map<String, Value>) -> Vec<String> {
    match claims.get("scopes") {
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect(),
        _ => Vec::new(),
    }
}

/// The `realtime.skipColumns` claim when it is an array (string entries kept), else `None`.
/// Present (even `[]`) it REPLACES the URL `skipColumns` parameter (docs/trigger-dev.md §3).
pub fn skip_columns_claim(claims: &Map<String, Value>) -> Option<Vec<String>> {
    match claims.get("realtime")?.get("skipColumns")? {
        Value::Array(items) => Some(
            items
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect(),
        ),
        _ => None,
    }
}

/// Current time in epoch seconds (`Math.floor(Date.now() / 1000)`).
pub fn now_s() -> u64 {
    u64::try_from(chrono::Utc::now().timestamp()).unwrap_or(0)
}

/// Mints a public access token as the trigger.dev SDK does (`generateJWT` +
/// `auth.createPublicToken`): header `{"alg":"HS256"}`, claims `pub: true`, `sub` = env id,
/// `scopes`, `realtime.skipColumns` when given, then `iss`, `aud`, `iat` = now and
/// `exp` = now + `ttl` (seconds). Signed with the UTF-8 bytes of `signing_key` (the env's root
/// key, or the PARENT's key for a branch env, `resolveJwtSigningKey`).
///
/// Errors: `InvalidKeyFormat` for an empty key (the only way HMAC signing can fail).
pub fn mint_public_token(
    signing_key: &str,
    env_id: &str,
    scopes: &[String],
    ttl: Duration,
    skip_columns: Option<&[String]>,
) -> Result<String, jsonwebtoken::errors::Error> {
    let now = now_s();
    let mut claims = Map::new();
    claims.insert("pub".into(), Value::Bool(true));
    claims.insert("sub".into(), Value::String(env_id.to_string()));
    claims.insert("scopes".into(), Value::from(scopes.to_vec()));
    if let Some(skip) = skip_columns {
        let mut realtime = Map::new();
        realtime.insert("skipColumns".into(), Value::from(skip.to_vec()));
        claims.insert("realtime".into(), Value::Object(realtime));
    }
    claims.insert("iss".into(), Value::String(JWT_ISSUER.into()));
    claims.insert("aud".into(), Value::String(JWT_AUDIENCE.into()));
    claims.insert("iat".into(), Value::from(now));
    claims.insert("exp".into(), Value::from(now.saturating_add(ttl.as_secs())));
    let mut header = Header::new(Algorithm::HS256);
    header.typ = None;
    let key = EncodingKey::from_secret(signing_key.as_bytes())?;
    jsonwebtoken::encode(&header, &Value::Object(claims), &key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const KEY: &str = "tr_dev_abcdefghijklmnopqrstuvwx";

    fn sign(alg: Algorithm, claims: &Value, key: &str) -> String {
        let mut header = Header::new(alg);
        header.typ = None;
        sign_with(&header, claims, key)
    }

    fn sign_with(header: &Header, claims: &Value, key: &str) -> String {
        jsonwebtoken::encode(
            header,
            claims,
            &EncodingKey::from_secret(key.as_bytes()).unwrap(),
        )
        .unwrap()
    }

    fn base(now: u64) -> Value {
        json!({"pub": true, "sub": "env_1", "scopes": ["read:runs"], "iss": JWT_ISSUER, "aud": JWT_AUDIENCE, "iat": now, "exp": now + 60})
    }

    #[test]
    fn minted_token_verifies_and_is_public() {
        let skip = vec!["payload".to_string()];
        let token = mint_public_token(
            KEY,
            "env_1",
            &["read:runs".into()],
            Duration::from_secs(900),
            Some(&skip),
        )
        .unwrap();
        assert!(is_public_jwt(&token));
        let claims = verify_public_token(&token, KEY, now_s()).unwrap();
        assert_eq!(claims["sub"], "env_1");
        assert_eq!(scopes_claim(&claims), vec!["read:runs".to_string()]);
        assert_eq!(skip_columns_claim(&claims), Some(skip));
        // jose-style header: no `typ`.
        let header = LENIENT_B64URL
            .decode(token.split('.').next().unwrap())
            .unwrap();
        assert_eq!(String::from_utf8(header).unwrap(), r#"{"alg":"HS256"}"#);
    }

    #[test]
    fn exp_equal_to_now_is_expired_no_leeway() {
        let now = 1_800_000_000;
        let mut c = base(now);
        c["exp"] = json!(now);
        assert_eq!(
            verify_public_token(&sign(Algorithm::HS256, &c, KEY), KEY, now),
            Err(VerifyFailure::Invalid)
        );
        c["exp"] = json!(now + 1);
        assert!(verify_public_token(&sign(Algorithm::HS256, &c, KEY), KEY, now).is_ok());
    }

    #[test]
    fn exp_is_optional_but_must_be_numeric() {
        let now = 1_800_000_000;
        let mut c = base(now);
        c.as_object_mut().unwrap().remove("exp");
        assert!(verify_public_token(&sign(Algorithm::HS256, &c, KEY), KEY, now).is_ok());
        c["exp"] = json!("soon");
        assert_eq!(
            verify_public_token(&sign(Algorithm::HS256, &c, KEY), KEY, now),
            Err(VerifyFailure::Invalid)
        );
    }

    #[test]
    fn nbf_in_future_rejected() {
        let now = 1_800_000_000;
        let mut c = base(now);
        c["nbf"] = json!(now + 1);
        assert_eq!(
            verify_public_token(&sign(Algorithm::HS256, &c, KEY), KEY, now),
            Err(VerifyFailure::Invalid)
        );
        c["nbf"] = json!(now);
        assert!(verify_public_token(&sign(Algorithm::HS256, &c, KEY), KEY, now).is_ok());
    }

    #[test]
    fn hs384_and_hs512_accepted() {
        let now = 1_800_000_000;
        for alg in [Algorithm::HS384, Algorithm::HS512] {
            assert!(verify_public_token(&sign(alg, &base(now), KEY), KEY, now).is_ok());
        }
    }

    #[test]
    fn iss_and_aud_required_and_exact() {
        let now = 1_800_000_000;
        let check = |edit: &dyn Fn(&mut Value)| {
            let mut c = base(now);
            edit(&mut c);
            verify_public_token(&sign(Algorithm::HS256, &c, KEY), KEY, now)
        };
        assert_eq!(
            check(&|c| c["iss"] = json!("https://evil")),
            Err(VerifyFailure::Invalid)
        );
        assert_eq!(
            check(&|c| c["iss"] = json!([JWT_ISSUER])),
            Err(VerifyFailure::Invalid)
        );
        assert_eq!(
            check(&|c| {
                c.as_object_mut().unwrap().remove("iss");
            }),
            Err(VerifyFailure::Invalid)
        );
        assert_eq!(
            check(&|c| {
                c.as_object_mut().unwrap().remove("aud");
            }),
            Err(VerifyFailure::Invalid)
        );
        assert_eq!(
            check(&|c| c["aud"] = json!("https://other")),
            Err(VerifyFailure::Invalid)
        );
        assert!(check(&|c| c["aud"] = json!(["x", JWT_AUDIENCE])).is_ok());
        assert_eq!(
            check(&|c| c["iat"] = json!("now")),
            Err(VerifyFailure::Invalid)
        );
    }

    #[test]
    fn wrong_key_is_a_signature_failure_and_garbage_is_invalid() {
        let now = 1_800_000_000;
        let token = sign(Algorithm::HS256, &base(now), KEY);
        assert_eq!(
            verify_public_token(&token, "tr_dev_other", now),
            Err(VerifyFailure::Signature)
        );
        assert_eq!(
            verify_public_token("a.b.c", KEY, now),
            Err(VerifyFailure::Invalid)
        );
        assert_eq!(
            verify_public_token("not a jwt", KEY, now),
            Err(VerifyFailure::Invalid)
        );
    }

    #[test]
    fn is_public_jwt_requires_literal_true() {
        let now = 1_800_000_000;
        assert!(is_public_jwt(&sign(Algorithm::HS256, &base(now), KEY)));
        let mut c = base(now);
        c["pub"] = json!("true");
        assert!(!is_public_jwt(&sign(Algorithm::HS256, &c, KEY)));
        c.as_object_mut().unwrap().remove("pub");
        assert!(!is_public_jwt(&sign(Algorithm::HS256, &c, KEY)));
        assert!(!is_public_jwt("tr_dev_abcdefghijklmnopqrstuvwx"));
        assert!(!is_public_jwt("a.b.c.d.e"));
        assert!(!is_public_jwt("a..c"));
    }

    #[test]
    fn run_tokens_are_told_apart_by_their_header_typ() {
        let now = 1_800_000_000;
        let mut header = Header::new(Algorithm::HS256);
        header.typ = Some("run+jwt".into());
        let claims = json!({"sub": "run_1", "iat": now});
        assert!(is_run_token(&sign_with(&header, &claims, KEY)));
        header.typ = Some("RUN+JWT".into());
        assert!(is_run_token(&sign_with(&header, &claims, KEY)));
        assert!(!is_run_token(&sign(Algorithm::HS256, &base(now), KEY)));
        assert!(!is_run_token("tr_dev_abcdefghijklmnopqrstuvwx"));
        assert!(!is_run_token("a.b.c"));
    }

    #[test]
    fn claims_helpers_tolerate_odd_shapes() {
        let claims = json!({"scopes": "read:runs", "realtime": {"skipColumns": "payload"}});
        let claims = claims.as_object().unwrap();
        assert!(scopes_claim(claims).is_empty());
        assert_eq!(skip_columns_claim(claims), None);
        let claims = json!({"scopes": ["read:runs", 5], "realtime": {"skipColumns": []}});
        let claims = claims.as_object().unwrap();
        assert_eq!(scopes_claim(claims), vec!["read:runs".to_string()]);
        assert_eq!(skip_columns_claim(claims), Some(vec![]));
    }
}
