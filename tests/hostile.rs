//! The bad-input matrix and tenant isolation, against the real server started
//! in-process ([`TestServer`]).
//!
//! Every hostile request must be answered with the class its table row names (mostly 4xx; some
//! protocol-mandated 200 snapshots and 409 must-refetch answers), never a 5xx; every 4xx has a
//! JSON body; every answer has CORS headers; a legacy client (no `x-trigger-electric-version`)
//! never gets a 400 (docs/protocol.md §8); and no answer made with environment A's credentials contains
//! an id of environment B. The server runs in this process, so its memory is this process's RSS:
//! after warm-up rounds, repeating the matrix must leave RSS near its baseline.

mod common;

use std::time::Duration;

use common::*;
use runfeed::protocol::handle::{FeedKind, HandleClaims, HandleKey};
use runfeed_dev::fixtures::{self, DemoEnv, RunSpec};
use serde_json::Value;

const REQUESTED_WITH: &str = "https://app.example";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Exp {
    /// Exactly this status.
    Is(u16),
    /// Any 4xx.
    Client,
    /// 200 or 409 (protocol: a stale/foreign handle is either ignored for a snapshot or refused).
    OkOr409,
}

struct Case {
    name: String,
    method: reqwest::Method,
    path: String,
    headers: Vec<(String, String)>,
    exp: Exp,
}

fn case(
    name: impl Into<String>,
    path: impl Into<String>,
    headers: Vec<(String, String)>,
    exp: Exp,
) -> Case {
    Case {
        name: name.into(),
        method: reqwest::Method::GET,
        path: path.into(),
        headers,
        exp,
    }
}

fn is_legacy(headers: &[(String, String)]) -> bool {
    !headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("x-trigger-electric-version") && !v.is_empty())
}

fn enc(s: &str) -> String {
    serde_urlencoded::to_string([("x", s)])
        .expect("encode")
        .trim_start_matches("x=")
        .to_string()
}

/// Fixtures of one environment: a tagged run in a batch, its feed handles.
struct EnvFx {
    env: DemoEnv,
    run_id: String,
    run_fid: String,
    batch_id: String,
    batch_fid: String,
    run_handle: String,
    run_offset: String,
    tag_handle: String,
    tag_offset: String,
    batch_handle: String,
}

async fn env_fx(srv: &TestServer, env: DemoEnv) -> EnvFx {
    let (batch_id, batch_fid) = srv.batch(&env).await;
    let run = srv
        .run(
            &env,
            RunSpec {
                tags: Some(vec!["shared".into(), "x'y".into(), "ünï".into()]),
                batch_id: Some(batch_id.clone()),
                ..RunSpec::default()
            },
        )
        .await;
    let h = modern(&env.api_key);
    let r = srv
        .fetch(
            &Url::new(&format!("/realtime/v1/runs/{}", run.friendly_id)).snapshot(),
            &h,
        )
        .await;
    r.assert_status(200);
    let t = srv
        .fetch(
            &Url::new("/realtime/v1/runs").q("tags", "shared").snapshot(),
            &h,
        )
        .await;
    t.assert_status(200);
    let b = srv
        .fetch(
            &Url::new(&format!("/realtime/v1/batches/{batch_fid}")).snapshot(),
            &h,
        )
        .await;
    b.assert_status(200);
    EnvFx {
        run_id: run.id,
        run_fid: run.friendly_id,
        batch_id,
        batch_fid,
        run_handle: r.handle(),
        run_offset: r.offset(),
        tag_handle: t.handle(),
        tag_offset: t.offset(),
        batch_handle: b.handle(),
        env,
    }
}

fn b_secrets(b: &EnvFx) -> Vec<String> {
    vec![
        b.env.env_id.clone(),
        b.env.api_key.clone(),
        b.run_id.clone(),
        b.run_fid.clone(),
        b.batch_id.clone(),
        b.batch_fid.clone(),
    ]
}

/// A JWT with an arbitrary header and payload (signature as given).
fn raw_jwt(header: &Value, payload: &Value, sig: &str) -> String {
    use base64::Engine;
    let e = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    format!(
        "{}.{}.{}",
        e.encode(header.to_string()),
        e.encode(payload.to_string()),
        sig
    )
}

fn forged_handle(secret: &str, kind: FeedKind, env_id: &str, target: &str) -> String {
    HandleKey::new(secret.as_bytes())
        .mint(&HandleClaims {
            kind,
            env_id: env_id.to_string().into(),
            target: target.to_string(),
            floor_ms: None,
            columns: 0,
            nonce: 7,
        })
        .to_string()
}

/// The matrix under construction: every request is sent with A's credentials.
struct Cases {
    list: Vec<Case>,
    /// A's secret key as a modern client sends it.
    modern: Vec<(String, String)>,
    /// A's secret key as a legacy client sends it.
    legacy: Vec<(String, String)>,
}

impl Cases {
    fn push(
        &mut self,
        name: impl Into<String>,
        path: impl Into<String>,
        headers: Vec<(String, String)>,
        exp: Exp,
    ) {
        self.list.push(case(name, path, headers, exp));
    }

    /// The request from a modern client.
    fn modern(&mut self, name: impl Into<String>, path: impl Into<String>, exp: Exp) {
        let headers = self.modern.clone();
        self.push(name, path, headers, exp);
    }

    /// The request from a modern client (`exp`) and from a legacy one (`legacy_exp`).
    fn both(&mut self, name: &str, path: &str, (exp, legacy_exp): (Exp, Exp)) {
        self.modern(name, path, exp);
        let headers = self.legacy.clone();
        self.push(format!("{name} legacy"), path, headers, legacy_exp);
    }
}

/// Bad input: 400 for a modern client, 422 for a legacy one (docs/protocol.md §8).
const BAD_INPUT: (Exp, Exp) = (Exp::Is(400), Exp::Is(422));
/// The same answer for both client generations.
const fn same(exp: Exp) -> (Exp, Exp) {
    (exp, exp)
}

/// `?` or `&`, whichever appends a parameter to `path`.
fn sep(path: &str) -> char {
    if path.contains('?') {
        '&'
    } else {
        '?'
    }
}

/// `route` at `offset` with `handle` (URL-encoded).
fn at(route: &str, offset: &str, handle: &str) -> String {
    format!(
        "{route}{}offset={offset}&handle={}",
        sep(route),
        enc(handle)
    )
}

fn matrix(a: &EnvFx, b: &EnvFx) -> Vec<Case> {
    let run_a = format!("/realtime/v1/runs/{}", a.run_fid);
    let run_b = format!("/realtime/v1/runs/{}", b.run_fid);
    let tags = "/realtime/v1/runs";
    let batch_a = format!("/realtime/v1/batches/{}", a.batch_fid);
    let batch_b = format!("/realtime/v1/batches/{}", b.batch_fid);
    let ka = a.env.api_key.as_str();
    let mut cases = Cases {
        list: Vec::new(),
        modern: modern(ka),
        legacy: legacy(ka),
    };
    let routes: Vec<(&str, String)> = vec![
        ("run", run_a.clone()),
        ("tag", format!("{tags}?tags=shared")),
        ("batch", batch_a.clone()),
    ];

    // ---- offsets (per route, modern 400 / legacy 422) ----
    let bad_offsets = [
        "abc",
        "later",
        "5",
        "5_",
        "_5",
        "-2_0",
        "+1_2",
        "1_2_3",
        "99999999999999999999_0",
        "0_99999999999999999999",
        "-0",
        "1%C3%A9_2",
        "%00",
        "1_2%20",
    ];
    for (route, p) in &routes {
        let p = p.as_str();
        let s = sep(p);
        for o in bad_offsets {
            let path = format!("{p}{s}offset={o}&handle=h");
            cases.both(&format!("{route} offset={o}"), &path, BAD_INPUT);
        }
        // A valid-looking offset without a handle.
        let path = format!("{p}{s}offset=1_0");
        cases.both(&format!("{route} offset w/o handle"), &path, BAD_INPUT);
        // Huge offset value (10 KiB of digits).
        let path = format!("{p}{s}offset={}_0&handle=h", "9".repeat(10_000));
        cases.modern(format!("{route} huge offset"), &path, Exp::Client);
        // Junk handle at -1 is a fresh snapshot (docs/protocol.md §4.2).
        cases.modern(
            format!("{route} -1 with junk handle"),
            at(p, "-1", "junk"),
            Exp::Is(200),
        );
        // Junk handle at a real offset → 409 must-refetch.
        cases.both(
            &format!("{route} junk handle"),
            &at(p, "1_0", "junk"),
            same(Exp::Is(409)),
        );
        // Repeated params: last value wins.
        let path = format!("{p}{s}offset=-1&offset=zzz");
        cases.modern(
            format!("{route} repeated offset last bad"),
            &path,
            Exp::Is(400),
        );
        let path = format!("{p}{s}offset=zzz&offset=-1&live=true&live=false");
        cases.modern(
            format!("{route} repeated offset last ok"),
            &path,
            Exp::Is(200),
        );
        // Odd skipColumns: unknown names are ignored (trigger forwards them to Electric).
        for sc in ["", ",,,", "id", "nope", "%22%3Bdrop", &"x,".repeat(2000)] {
            let path = format!("{p}{s}offset=-1&skipColumns={sc}");
            let name = format!(
                "{route} skipColumns={}",
                sc.chars().take(12).collect::<String>()
            );
            cases.modern(name, &path, Exp::OkOr409);
        }
        // POST is how `@electric-sql/client` 1.5 sends subset snapshots: refused with a 400 that
        // names the subset parameter (docs/protocol.md §13.6).
        cases.modern(format!("{route} POST"), p, Exp::Is(400));
        cases.list.last_mut().expect("just pushed").method = reqwest::Method::POST;
        // Wrong methods.
        for method in [
            reqwest::Method::PUT,
            reqwest::Method::DELETE,
            reqwest::Method::PATCH,
        ] {
            cases.modern(format!("{route} {method}"), p, Exp::Is(405));
            cases.list.last_mut().expect("just pushed").method = method;
        }
        // Credentials.
        let jwt_b = mint(&b.env.api_key, &b.env.env_id, &["read:all"], TOKEN_TTL);
        let expired = mint(ka, &a.env.env_id, &["read:all"], Duration::ZERO);
        let wrong_key = mint(&b.env.api_key, &a.env.env_id, &["read:all"], TOKEN_TTL);
        let payload = serde_json::json!({"pub": true, "sub": a.env.env_id, "scopes": ["read:all"], "exp": 4_000_000_000u64});
        let alg = |alg: &str| serde_json::json!({ "alg": alg });
        let none = raw_jwt(
            &serde_json::json!({"alg": "none", "typ": "JWT"}),
            &payload,
            "",
        );
        let none2 = raw_jwt(&alg("none"), &payload, "AAAA");
        let hs512 = raw_jwt(&alg("HS512"), &payload, "AAAA");
        let rs = raw_jwt(&alg("RS256"), &payload, "AAAA");
        let claims_b =
            serde_json::json!({"pub": true, "sub": b.env.env_id, "scopes": ["read:all"]});
        let sub_b = raw_jwt(&alg("HS256"), &claims_b, "AAAA");
        let no_sub = raw_jwt(&alg("HS256"), &serde_json::json!({"pub": true}), "x");
        for (what, auth) in [
            ("no auth", None),
            ("empty bearer", Some("Bearer ".to_string())),
            ("basic", Some("Basic dXNlcjpwYXNz".to_string())),
            ("garbage", Some("Bearer garbage".to_string())),
            ("jwt of B", Some(format!("Bearer {jwt_b}"))),
            ("expired", Some(format!("Bearer {expired}"))),
            ("wrong key", Some(format!("Bearer {wrong_key}"))),
            ("alg none", Some(format!("Bearer {none}"))),
            ("alg none sig", Some(format!("Bearer {none2}"))),
            ("hs512 forged", Some(format!("Bearer {hs512}"))),
            ("rs256 forged", Some(format!("Bearer {rs}"))),
            ("sub B forged", Some(format!("Bearer {sub_b}"))),
            ("no sub", Some(format!("Bearer {no_sub}"))),
            ("huge token", Some(format!("Bearer {}", "a".repeat(6000)))),
            (
                "additional key",
                Some("Bearer tr_dev_sk_0123456789abcdef".to_string()),
            ),
            ("key + junk", Some(format!("Bearer {ka}\u{1}"))),
        ] {
            let mut h = vec![(
                "x-trigger-electric-version".to_string(),
                ELECTRIC_VERSION.to_string(),
            )];
            if let Some(v) = auth {
                // Header values must be visible ASCII; the \u{1} case becomes unsendable, so
                // substitute a tab-free variant.
                let v = v.replace('\u{1}', "%01");
                h.push(("authorization".into(), v));
            }
            let path = format!("{p}{s}offset=-1");
            // Auth failures are 401 (alg-none/forged/wrong key never authenticate) — except a
            // valid JWT of B, which authenticates as B: 404 on A's run/batch, 200 (B's own
            // rows) on the tag feed — checked by the leak assertion being skipped for it.
            let exp = if what == "jwt of B" {
                Exp::Client
            } else {
                Exp::Is(401)
            };
            if what == "jwt of B" && *route == "tag" {
                continue; // B reading B's own tag feed is legitimate.
            }
            cases.push(format!("{route} auth {what}"), &path, h, exp);
        }
        // Scopes for other resources → 403.
        for scope in [
            format!("read:runs:{}", b.run_fid),
            format!("read:batch:{}", b.batch_fid),
            "read:tags:other".to_string(),
            "write:all".to_string(),
            "read:runs:".to_string(),
            "read:*".to_string(),
        ] {
            let tok = mint(ka, &a.env.env_id, &[&scope], TOKEN_TTL);
            let path = format!("{p}{s}offset=-1");
            cases.push(
                format!("{route} scope {scope}"),
                &path,
                modern(&tok),
                Exp::Is(403),
            );
        }
    }

    // ---- cross-environment handles and ids (A's credentials) ----
    for (what, path) in [
        ("run of B", format!("{run_b}?offset=-1")),
        ("batch of B", format!("{batch_b}?offset=-1")),
        (
            "run by B internal id",
            format!("/realtime/v1/runs/{}?offset=-1", b.run_id),
        ),
        (
            "batch by B internal id",
            format!("/realtime/v1/batches/{}?offset=-1", b.batch_id),
        ),
    ] {
        cases.both(&format!("A reads {what}"), &path, same(Exp::Is(404)));
    }
    // Handles of B, of A's other feeds and forged ones, at A's offsets → 409 must-refetch.
    let tags_a = format!("{tags}?tags=shared");
    let (ea, eb) = (a.env.env_id.as_str(), b.env.env_id.as_str());
    let (ra, ro) = (run_a.as_str(), a.run_offset.as_str());
    let forged = |kind, env: &str, target: &str| forged_handle(HANDLE_SECRET, kind, env, target);
    let b_run = at(ra, &b.run_offset, &b.run_handle);
    let b_run_live = format!("{b_run}&live=true");
    let b_tag = at(&tags_a, &b.tag_offset, &b.tag_handle);
    let b_batch = at(&batch_a, &b.run_offset, &b.batch_handle);
    let a_run_on_tags = at(&tags_a, ro, &a.run_handle);
    let a_tag_on_batch = at(&batch_a, &a.tag_offset, &a.tag_handle);
    let other_tags = format!("{tags}?tags=other");
    let a_tag_other_tags = at(&other_tags, &a.tag_offset, &a.tag_handle);
    let claims_b = at(ra, ro, &forged(FeedKind::Run, eb, &b.run_id));
    let target_b = at(ra, ro, &forged(FeedKind::Run, ea, &b.run_id));
    let batch_b_target = at(&batch_a, ro, &forged(FeedKind::Batch, ea, &b.batch_id));
    let other_secret = forged_handle("not-the-secret", FeedKind::Run, ea, &a.run_id);
    let wrong_secret = at(ra, ro, &other_secret);
    let truncated = at(ra, ro, &a.run_handle[..a.run_handle.len() / 2]);
    let huge = at(ra, ro, &"h".repeat(7000));
    let shape_id_b = format!(
        "{ra}?offset={}&shape_id={}",
        b.run_offset,
        enc(&b.run_handle)
    );
    for (what, path) in [
        ("B run handle on A run", &b_run),
        ("B run handle on A run live", &b_run_live),
        ("B tag handle on A tags", &b_tag),
        ("B batch handle on A batch", &b_batch),
        ("A run handle on A tags", &a_run_on_tags),
        ("A tag handle on A batch", &a_tag_on_batch),
        ("A tag handle other tags", &a_tag_other_tags),
        ("forged env B claims", &claims_b),
        ("forged A env, B target", &target_b),
        ("forged batch A env B target", &batch_b_target),
        ("wrong-secret handle", &wrong_secret),
        ("truncated handle", &truncated),
        ("huge handle", &huge),
        ("shape_id B", &shape_id_b),
    ] {
        cases.both(&format!("handle: {what}"), path, same(Exp::Is(409)));
    }
    // B's handle at -1 on A is a fresh snapshot.
    let b_at_start = at(ra, "-1", &b.run_handle);
    let ok = Exp::Is(200);
    cases.both("handle: B handle at -1 on A", &b_at_start, same(ok));

    // ---- tags and createdAt ----
    let sql_dquote = "%27%3B%20DROP%20TABLE%20%22TaskRun%22%3B--";
    let sql_union = "x%27)%20UNION%20SELECT%20*%20FROM%20%27TaskRun";
    let (at_byte_limit, over_byte_limit) = ("t".repeat(256), "t".repeat(257));
    let tag_list = |n: usize| vec!["t"; n].join(",");
    let (tags_100, tags_101, tags_1000) = (tag_list(100), tag_list(101), tag_list(1000));
    let bad_tags = [
        ("ctl", "a%01b"),
        ("nul", "a%00"),
        ("newline", "a%0Ab"),
        ("del", "a%7F"),
        ("dquote", "a%22b"),
        ("backslash", "a%5Cb"),
        ("empty in list", "a,,b"),
        ("trailing comma", "a,"),
        ("sql dquote", sql_dquote),
        ("pg array", "%7B%22a%22%7D"),
        ("tag over the byte limit", &over_byte_limit),
        ("101 tags", &tags_101),
        ("1000 tags", &tags_1000),
    ];
    let good_tags = [
        ("squote", "x%27y"),
        ("sql", "%27%3B%20DROP%20TABLE%20TaskRun%3B--"),
        ("sql union", sql_union),
        ("sql or", "a%27%20OR%20%271%27%3D%271"),
        ("unicode", "%C3%BCn%C3%AF"),
        ("emoji", "%F0%9F%92%A9"),
        ("rtl", "%E2%80%AEabc"),
        ("percent", "100%25"),
        ("plus", "a+b"),
        ("braces", "%7Ba%7D"),
        // Decoded lossily to U+FFFD, as URLSearchParams does: a tag that matches nothing.
        ("invalid utf8", "%FF%FE"),
        ("tag at the byte limit", &at_byte_limit),
        ("100 tags", &tags_100),
    ];
    let ok = same(Exp::Is(200));
    let tag_cases = bad_tags.map(|c| (c, BAD_INPUT));
    for ((what, t), exps) in tag_cases.into_iter().chain(good_tags.map(|c| (c, ok))) {
        let path = format!("{tags}?tags={t}&offset=-1");
        cases.both(&format!("tags {what}"), &path, exps);
    }
    for (what, c, exp) in [
        // Saturates, then is clamped to the lookback ceiling.
        ("huge number", "99999999999999999999999h", Exp::OkOr409),
        ("u64 overflow", "18446744073709551615w", Exp::OkOr409),
        ("max-ish", "9999999999w", Exp::OkOr409),
        ("negative", "-1h", Exp::Client),
        ("no unit", "10", Exp::Client),
        ("sql", "1h%27%3B--", Exp::Client),
        ("unicode digits", "%D9%A1h", Exp::Client),
        ("empty", "", Exp::Client),
        ("long", &"1h".repeat(3000), Exp::Client),
    ] {
        let path = format!("{tags}?tags=shared&createdAt={c}&offset=-1");
        cases.both(&format!("createdAt {what}"), &path, same(exp));
    }

    // ---- paths, branches, misc ----
    let (runs, batches) = ("/realtime/v1/runs", "/realtime/v1/batches");
    let run_sql = format!("{runs}/run_%27%20OR%201%3D1--?offset=-1");
    let run_huge = format!("{runs}/{}?offset=-1", "r".repeat(4000));
    let batch_huge = format!("{batches}/{}?offset=-1", "b".repeat(4000));
    let double_slash = format!("{runs}//{}", a.run_fid);
    let url_8k = format!("{run_a}?offset=-1&pad={}", "p".repeat(8200));
    let url_64k = format!("{tags}?tags={}", "t,".repeat(32_000));
    let unknown_9k = format!("/x?{}", "q".repeat(9000));
    for (what, path, exp) in [
        ("unknown route", "/realtime/v1/nope", Exp::Is(404)),
        ("run id sql", &run_sql, Exp::Is(404)),
        (
            "run id unicode",
            &format!("{runs}/%C3%BC?offset=-1"),
            Exp::Is(404),
        ),
        ("run id huge", &run_huge, Exp::Is(404)),
        (
            "batch id nul",
            &format!("{batches}/b%00?offset=-1"),
            Exp::Is(404),
        ),
        (
            "run id nul",
            &format!("{runs}/run_%00x?offset=-1"),
            Exp::Is(404),
        ),
        ("batch id huge", &batch_huge, Exp::Is(404)),
        ("url over 8 KiB", &url_8k, Exp::Is(414)),
        ("url 64 KiB", &url_64k, Exp::Is(414)),
        ("unknown route over limit", &unknown_9k, Exp::Is(414)),
        ("double slash", &double_slash, Exp::Is(404)),
        ("trailing slash", &format!("{run_a}/"), Exp::Is(404)),
        (
            "bad query encoding",
            &format!("{run_a}?offset=%ZZ"),
            Exp::Client,
        ),
        (
            "bare percent",
            &format!("{run_a}?offset=-1&handle=%"),
            Exp::OkOr409,
        ),
    ] {
        cases.both(&format!("path {what}"), path, same(exp));
    }
    for (what, branch) in [
        ("unknown branch", "nope"),
        ("sql branch", "x'; DROP TABLE x;--"),
        ("long branch", &"b".repeat(3000)),
    ] {
        let h = with(modern(ka), "x-trigger-branch", branch);
        cases.push(
            format!("branch {what}"),
            format!("{run_a}?offset=-1"),
            h,
            Exp::Client,
        );
    }
    // Header bytes over `max_header_bytes` (32 KiB) → 431 JSON, modern and legacy.
    for (what, h) in [("modern", modern(ka)), ("legacy", legacy(ka))] {
        let h = with(h, "x-pad", &"p".repeat(40_000));
        let name = format!("headers over 32 KiB {what}");
        cases.push(name, format!("{run_a}?offset=-1"), h, Exp::Is(431));
    }
    cases.list
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

async fn run_matrix(
    srv: &TestServer,
    cases: &[Case],
    secrets: &[String],
    check: bool,
) -> Vec<String> {
    let mut failures = Vec::new();
    for c in cases {
        let mut h = c.headers.clone();
        h.push(("origin".into(), REQUESTED_WITH.into()));
        let r = srv.request(c.method.clone(), &c.path, &h).await;
        if !check {
            continue;
        }
        let mut bad = Vec::new();
        if r.status >= 500 {
            bad.push(format!("5xx {}", r.status));
        }
        let ok = match c.exp {
            Exp::Is(s) => r.status == s,
            Exp::Client => (400..500).contains(&r.status),
            Exp::OkOr409 => r.status == 200 || r.status == 409,
        };
        if !ok {
            bad.push(format!("expected {:?}, got {}", c.exp, r.status));
        }
        if (400..500).contains(&r.status) && !r.json.is_object() && !r.json.is_array() {
            bad.push("4xx without a JSON body".into());
        }
        if (400..500).contains(&r.status)
            && !r
                .header("content-type")
                .unwrap_or("")
                .contains("application/json")
        {
            bad.push("4xx without JSON content-type".into());
        }
        if r.header("access-control-allow-origin") != Some("*") {
            bad.push("no CORS".into());
        }
        if is_legacy(&c.headers) && r.status == 400 {
            bad.push("400 to a legacy client".into());
        }
        for s in secrets {
            if !c.path.contains(s.as_str()) && r.text.contains(s.as_str()) {
                bad.push(format!("leaked B id {s}"));
            }
            if r.headers
                .iter()
                .any(|(_, v)| v.to_str().unwrap_or("").contains(s.as_str()))
                && !c.path.contains(s.as_str())
            {
                bad.push(format!("leaked B id {s} in a header"));
            }
        }
        if !bad.is_empty() {
            let body: String = r.text.chars().take(200).collect();
            failures.push(format!(
                "{} [{} {}]: {} — body {body}",
                c.name,
                c.method,
                c.path.chars().take(120).collect::<String>(),
                bad.join("; ")
            ));
        }
    }
    failures
}

/// The RSS check measures this process: the other tests of this file take the lock shared, the
/// RSS test exclusively, so their servers never grow the process while it measures.
static RSS_QUIET: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_matrix_is_4xx_json_cors_and_never_leaks_or_grows() {
    let _alone = RSS_QUIET.write().await;
    let srv = TestServer::start(200).await;
    let a = env_fx(&srv, srv.env().await).await;
    let b = env_fx(&srv, srv.env().await).await;
    let cases = matrix(&a, &b);
    assert!(cases.len() >= 100, "matrix has {} cases", cases.len());
    let secrets = b_secrets(&b);
    // Warm-up rounds (allocator pools, caches, connection pools), then the baseline.
    let failures = run_matrix(&srv, &cases, &secrets, true).await;
    assert!(
        failures.is_empty(),
        "{} of {} hostile requests misbehaved:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    for _ in 0..3 {
        run_matrix(&srv, &cases, &secrets, false).await;
    }
    let base = rss_bytes();
    for _ in 0..6 {
        run_matrix(&srv, &cases, &secrets, false).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_bytes();
    eprintln!(
        "matrix: {} cases; rss baseline {} KiB, after 6 more rounds {} KiB",
        cases.len(),
        base / 1024,
        after / 1024
    );
    assert!(
        after < base + 20 * 1024 * 1024,
        "RSS grew from {base} to {after} bytes over 6 rounds of the matrix"
    );
}

// ---------------------------------------------------------------------------------------------
// Tenant isolation per route
// ---------------------------------------------------------------------------------------------

async fn revoke(srv: &TestServer, env_id: &str, key: &str) {
    sqlx::query(
        r#"INSERT INTO "RevokedApiKey" (id, "apiKey", "runtimeEnvironmentId", "expiresAt")
           VALUES ($1, $2, $3, (now() AT TIME ZONE 'UTC') + interval '1 hour')"#,
    )
    .bind(fixtures::new_id())
    .bind(key)
    .bind(env_id)
    .execute(srv.pool())
    .await
    .expect("revoke");
}

/// For each route, every credential of A (secret key, JWT, a revoked key within its grace, a JWT
/// signed with the revoked key, a branch env of A's project) and crafted handles read only A's
/// rows, never B's — B has runs with the same tags and its own batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_isolation_for_every_route_and_credential() {
    let _shared = RSS_QUIET.read().await;
    let srv = TestServer::start(200).await;
    let a = env_fx(&srv, srv.env().await).await;
    let b = env_fx(&srv, srv.env().await).await;
    let secrets = b_secrets(&b);

    // A's key is rotated: the old key stays valid during its grace period (RevokedApiKey).
    let old_key = a.env.api_key.clone();
    let new_key = fixtures::new_api_key("DEVELOPMENT");
    sqlx::query(r#"UPDATE "RuntimeEnvironment" SET "apiKey" = $1 WHERE id = $2"#)
        .bind(&new_key)
        .bind(&a.env.env_id)
        .execute(srv.pool())
        .await
        .expect("rotate");
    revoke(&srv, &a.env.env_id, &old_key).await;
    let jwt_old = mint(
        &old_key,
        &a.env.env_id,
        &["read:all"],
        Duration::from_secs(900),
    );
    let jwt_new = mint(
        &new_key,
        &a.env.env_id,
        &["read:all"],
        Duration::from_secs(900),
    );
    // A token claiming A's env but signed with B's key must not authenticate.
    let jwt_b_signed = mint(
        &b.env.api_key,
        &a.env.env_id,
        &["read:all"],
        Duration::from_secs(900),
    );

    // A branch env of a PREVIEW parent in A's org/project has its own rows.
    let parent = fixtures::create_env(srv.pool(), "PREVIEW")
        .await
        .expect("preview env");
    let branch = fixtures::create_branch_env(srv.pool(), &parent, "PREVIEW", "feat-x")
        .await
        .expect("branch env");
    let branch_run = srv.tagged_run(&branch, &["shared"]).await;
    let branch_hdrs = with(modern(&parent.api_key), "x-trigger-branch", "feat-x");

    let run_a = format!("/realtime/v1/runs/{}", a.run_fid);
    let run_b = format!("/realtime/v1/runs/{}", b.run_fid);
    let batch_a = format!("/realtime/v1/batches/{}", a.batch_fid);
    let batch_b = format!("/realtime/v1/batches/{}", b.batch_fid);
    let tags = "/realtime/v1/runs?tags=shared&offset=-1";
    let unfiltered = "/realtime/v1/runs?offset=-1";

    let creds: Vec<(&str, Vec<(String, String)>)> = vec![
        ("secret key", modern(&new_key)),
        ("revoked key in grace", modern(&old_key)),
        ("jwt", modern(&jwt_new)),
        ("jwt signed with revoked key", modern(&jwt_old)),
        ("legacy secret key", legacy(&new_key)),
    ];
    for (what, h) in &creds {
        // Own rows: 200 with A's run only.
        for path in [
            format!("{run_a}?offset=-1"),
            tags.to_string(),
            unfiltered.to_string(),
            format!("{batch_a}?offset=-1"),
        ] {
            let r = srv.get(&path, h).await;
            assert_eq!(r.status, 200, "{what} {path}: {}", r.text);
            let ids: Vec<String> = r.ops().into_iter().map(|(_, id)| id).collect();
            assert_eq!(ids, vec![a.run_id.clone()], "{what} {path}");
            for s in &secrets {
                assert!(!r.text.contains(s.as_str()), "{what} {path} leaked {s}");
            }
            assert!(
                !r.text.contains(&branch_run.id),
                "{what} {path} leaked the branch env's run"
            );
        }
        // B's resources: 404, nothing of B.
        for path in [
            format!("{run_b}?offset=-1"),
            format!("{batch_b}?offset=-1"),
            format!("/realtime/v1/runs/{}?offset=-1", branch_run.friendly_id),
        ] {
            let r = srv.get(&path, h).await;
            assert_eq!(r.status, 404, "{what} {path}: {}", r.text);
            for s in &secrets {
                assert!(!r.text.contains(s.as_str()), "{what} {path} leaked {s}");
            }
        }
        // B's handles (and handles forged for B's env with the real secret) at live offsets.
        for path in [
            format!(
                "{run_a}?offset={}&handle={}",
                b.run_offset,
                enc(&b.run_handle)
            ),
            format!(
                "/realtime/v1/runs?tags=shared&offset={}&handle={}",
                b.tag_offset,
                enc(&b.tag_handle)
            ),
            format!(
                "{batch_a}?offset={}&handle={}",
                b.run_offset,
                enc(&b.batch_handle)
            ),
            format!(
                "{run_a}?offset={}&handle={}&live=true",
                a.run_offset,
                enc(&forged_handle(
                    HANDLE_SECRET,
                    FeedKind::Run,
                    &b.env.env_id,
                    &b.run_id
                ))
            ),
            format!(
                "{batch_a}?offset={}&handle={}&live=true",
                a.run_offset,
                enc(&forged_handle(
                    HANDLE_SECRET,
                    FeedKind::Batch,
                    &b.env.env_id,
                    &b.batch_id
                ))
            ),
        ] {
            let r = srv.get(&path, h).await;
            assert_eq!(r.status, 409, "{what} {path}: {}", r.text);
            for s in &secrets {
                assert!(!r.text.contains(s.as_str()), "{what} {path} leaked {s}");
            }
        }
    }
    // Forged/foreign-signed tokens never authenticate.
    for path in [
        format!("{run_a}?offset=-1"),
        tags.to_string(),
        format!("{batch_a}?offset=-1"),
    ] {
        let r = srv.get(&path, &modern(&jwt_b_signed)).await;
        assert_eq!(r.status, 401, "{path}: {}", r.text);
    }
    // The branch env (via parent key + branch header) sees only its own rows.
    let r = srv.get(tags, &branch_hdrs).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let ids: Vec<String> = r.ops().into_iter().map(|(_, id)| id).collect();
    assert_eq!(ids, vec![branch_run.id.clone()]);
    for path in [
        format!("{run_a}?offset=-1"),
        format!("{run_b}?offset=-1"),
        format!("{batch_a}?offset=-1"),
    ] {
        let r = srv.get(&path, &branch_hdrs).await;
        assert_eq!(r.status, 404, "branch {path}: {}", r.text);
        assert!(!r.text.contains(&a.run_id) && !r.text.contains(&b.run_id));
    }
    // An expired revocation no longer authenticates.
    sqlx::query(r#"UPDATE "RevokedApiKey" SET "expiresAt" = (now() AT TIME ZONE 'UTC') - interval '1 minute' WHERE "apiKey" = $1"#)
        .bind(&old_key)
        .execute(srv.pool())
        .await
        .expect("expire revocation");
    // The lookup cache may hold the old answer for its TTL.
    tokio::time::sleep(Duration::from_millis(
        srv.config.caches.lookup_cache_ttl_ms + 50,
    ))
    .await;
    let r = srv
        .get(&format!("{run_a}?offset=-1"), &modern(&old_key))
        .await;
    assert_eq!(r.status, 401, "expired revoked key: {}", r.text);
}

// ---------------------------------------------------------------------------------------------
// Request limits (config keys `[server] max_url_bytes`, `max_header_bytes`, `[feeds] max_tags`,
// `max_tag_bytes`)
// ---------------------------------------------------------------------------------------------

fn assert_json_4xx(r: &Resp, status: u16, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.text);
    assert!(
        r.json["error"].is_string(),
        "{what}: JSON error body, got {}",
        r.text
    );
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("*"),
        "{what}: CORS"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_limits_follow_their_config_keys() {
    let _shared = RSS_QUIET.read().await;
    let srv = TestServer::start_with(200, |c| {
        c.server.max_url_bytes = 300;
        c.server.max_header_bytes = 2_000;
        c.feeds.max_tags = 3;
        c.feeds.max_tag_bytes = 5;
    })
    .await;
    let env = srv.env().await;
    let run = srv.tagged_run(&env, &["abcde"]).await;
    let origin = || ("origin".to_string(), REQUESTED_WITH.to_string());
    let m = with(modern(&env.api_key), "origin", REQUESTED_WITH);
    let l = with(legacy(&env.api_key), "origin", REQUESTED_WITH);

    // Tags: at the limits → 200; over → 400 modern, 422 legacy.
    let ok = srv
        .get("/realtime/v1/runs?tags=abcde,b,c&offset=-1", &m)
        .await;
    assert_eq!(ok.status, 200, "{}", ok.text);
    assert_eq!(ok.ops().len(), 0, "no run has all three tags");
    let ok = srv.get("/realtime/v1/runs?tags=abcde&offset=-1", &m).await;
    assert_eq!(ok.ops().len(), 1);
    for (path, what) in [
        ("/realtime/v1/runs?tags=a,b,c,d&offset=-1", "4 tags"),
        ("/realtime/v1/runs?tags=abcdef&offset=-1", "6-byte tag"),
        (
            "/realtime/v1/runs?tags=%C3%BC%C3%BC%C3%BC&offset=-1",
            "3 chars, 6 bytes",
        ),
    ] {
        assert_json_4xx(&srv.get(path, &m).await, 400, what);
        assert_json_4xx(&srv.get(path, &l).await, 422, what);
    }

    // URL: at the limit passes the limit check; one byte more → 414 on every route.
    let base = format!("/realtime/v1/runs/{}?offset=-1&pad=", run.friendly_id);
    let at = format!("{base}{}", "p".repeat(300 - base.len()));
    assert_eq!(srv.get(&at, &m).await.status, 200);
    let over = format!("{at}p");
    assert_json_4xx(&srv.get(&over, &m).await, 414, "URL one byte over");
    assert_json_4xx(&srv.get(&over, &l).await, 414, "URL one byte over, legacy");
    assert_json_4xx(
        &srv.get(&format!("/nope?{}", "x".repeat(400)), &[origin()])
            .await,
        414,
        "unknown route",
    );

    // Header bytes.
    let big = with(m.clone(), "x-pad", &"p".repeat(2_000));
    assert_json_4xx(
        &srv.get(
            &format!("/realtime/v1/runs/{}?offset=-1", run.friendly_id),
            &big,
        )
        .await,
        431,
        "header bytes",
    );
}

/// hyper refuses more than 100 header fields itself (before the service runs, so without a JSON
/// body); the point here is that the answer is a 4xx, not a hang or a 5xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_100_headers_is_a_4xx_from_hyper() {
    let _shared = RSS_QUIET.read().await;
    let (srv, env) = TestServer::with_env(200).await;
    let mut h = modern(&env.api_key);
    for i in 0..120 {
        h.push((format!("x-h{i}"), "v".into()));
    }
    let url = format!("{}/realtime/v1/runs?offset=-1", srv.base);
    let mut req = srv.http.get(&url);
    for (k, v) in &h {
        req = req.header(k.as_str(), v.as_str());
    }
    match within(WAIT, "120 headers", req.send()).await {
        Ok(resp) => assert!(
            resp.status().is_client_error(),
            "120 headers: {}",
            resp.status()
        ),
        // hyper may also just close the connection.
        Err(e) => eprintln!("120 headers: connection closed ({e})"),
    }
    // The server still answers.
    let r = srv
        .get("/realtime/v1/runs?offset=-1", &modern(&env.api_key))
        .await;
    assert_eq!(r.status, 200);
}

/// A run or batch id that is not UTF-8 once percent-decoded is answered like any other id that
/// cannot exist: a JSON 404 with CORS, never axum's plain-text path rejection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_that_is_not_utf8_is_a_json_404_not_plain_text() {
    let _shared = RSS_QUIET.read().await;
    let (srv, env) = TestServer::with_env(200).await;
    for path in [
        "/realtime/v1/runs/run_%FF%FE?offset=-1",
        "/realtime/v1/batches/batch_%FF?offset=-1",
    ] {
        let r = srv.get(path, &modern(&env.api_key)).await;
        assert_eq!(r.status, 404, "{path}: {}", r.text);
        assert!(r.json["error"].is_string(), "{path}: {}", r.text);
        assert!(r.has("access-control-allow-origin"), "{path}");
    }
}
