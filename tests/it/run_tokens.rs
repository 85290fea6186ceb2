//! Run tokens served by forwarding (`auth.run_token_upstream`, docs/http-api.md "Run tokens"),
//! against the real Postgres and Redis and a stand-in webapp on 127.0.0.1:0 that records every
//! request it receives and answers as the Electric protocol does:
//!
//! - a feed request carrying a run token reaches the webapp's same route unchanged (canonical
//!   path, query, credential and the SDK's headers; nothing else), and the answer comes back;
//!   the same request with a secret key is served by runfeed itself;
//! - a forwarded long-poll is held until the webapp answers, and a forwarded SSE stream reaches
//!   the client event by event (never buffered);
//! - an unreachable webapp is a JSON 503 with `Retry-After` for run tokens only; without the
//!   setting, the JSON 401 naming the token type;
//! - hostile paths (`//realtime`, `..`, percent-encoding, encoded slashes, other routes) and
//!   oversized requests never reach the webapp;
//! - a handle the webapp issued that later reaches runfeed gets the protocol's 409.

use crate::common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use common::*;
use runfeed_dev::fixtures::{self, CreatedRun, DemoEnv, RunSpec};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

/// A handle and offset the webapp's Electric issues (`<shape id>-<ms>`, `<lsn>_<op>`).
const WEBAPP_HANDLE: &str = "38338211-1721812114261";
const WEBAPP_OFFSET: &str = "26800584_4";

/// One request the stand-in webapp received.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    /// Path and query, exactly as received.
    target: String,
    headers: HeaderMap,
}

/// The stand-in webapp: records every request; answers a snapshot at once, and a live request
/// (`live=true`) with the body chunks the test sends through [`Webapp::stream`] (SSE when the
/// request asks for it).
struct Webapp {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    /// The number of requests received so far (awaitable).
    received: watch::Receiver<usize>,
    bodies: Arc<Mutex<Vec<mpsc::UnboundedReceiver<Bytes>>>>,
    server: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct WebappState {
    seen: Arc<Mutex<Vec<Seen>>>,
    received: Arc<watch::Sender<usize>>,
    bodies: Arc<Mutex<Vec<mpsc::UnboundedReceiver<Bytes>>>>,
}

/// What the webapp answers a snapshot with: Electric's up-to-date control message.
const SNAPSHOT_BODY: &str = r#"[{"headers":{"control":"up-to-date"}}]"#;

async fn webapp_answer(State(state): State<WebappState>, req: Request) -> Response {
    let target = req
        .uri()
        .path_and_query()
        .map_or_else(String::new, |pq| pq.as_str().to_string());
    state.seen.lock().expect("seen").push(Seen {
        method: req.method().to_string(),
        target: target.clone(),
        headers: req.headers().clone(),
    });
    state.received.send_modify(|n| *n += 1);
    let live = target.contains("live=true");
    let sse = target.contains("live_sse=true");
    let electric = |builder: axum::http::response::Builder| {
        builder
            .header("electric-handle", WEBAPP_HANDLE)
            .header("electric-offset", WEBAPP_OFFSET)
            .header("electric-schema", r#"{"id":{"type":"text"}}"#)
            .header("access-control-allow-origin", "*")
            .header("access-control-expose-headers", "*")
            .header("x-webapp", "1")
    };
    if !live {
        return electric(Response::builder())
            .header("content-type", "application/json")
            .header("electric-up-to-date", "")
            .body(Body::from(SNAPSHOT_BODY))
            .expect("snapshot");
    }
    let body = state.bodies.lock().expect("bodies").pop();
    let Some(mut chunks) = body else {
        return Response::builder()
            .status(StatusCode::INTERNAL_SERVER_ERROR)
            .body(Body::from("no body queued"))
            .expect("500");
    };
    let content_type = if sse {
        "text/event-stream"
    } else {
        "application/json"
    };
    if !sse {
        // A long-poll: the head waits for the first chunk (the change), as Electric holds it.
        let Some(first) = chunks.recv().await else {
            return Response::new(Body::empty());
        };
        let stream = futures::StreamExt::chain(
            futures::stream::once(async move { Ok::<_, std::convert::Infallible>(first) }),
            chunk_stream(chunks),
        );
        return electric(Response::builder())
            .header("content-type", content_type)
            .body(Body::from_stream(stream))
            .expect("long-poll");
    }
    electric(Response::builder())
        .header("content-type", content_type)
        .header("cache-control", "no-cache")
        .body(Body::from_stream(chunk_stream(chunks)))
        .expect("sse")
}

/// The chunks the test sends, as a response body stream (ends when the sender is dropped).
fn chunk_stream(
    chunks: mpsc::UnboundedReceiver<Bytes>,
) -> impl futures::Stream<Item = Result<Bytes, std::convert::Infallible>> {
    futures::stream::unfold(chunks, |mut chunks| async move {
        chunks.recv().await.map(|chunk| (Ok(chunk), chunks))
    })
}

/// The rest of `response`'s body, chunk by chunk, each bounded by [`WAIT`].
async fn rest_of(response: &mut reqwest::Response) -> Vec<u8> {
    let mut rest = Vec::new();
    while let Some(chunk) = within(WAIT, "the rest of the body", response.chunk())
        .await
        .expect("chunk")
    {
        rest.extend_from_slice(&chunk);
    }
    rest
}

impl Webapp {
    async fn start() -> Webapp {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the webapp");
        let addr = listener.local_addr().expect("webapp address");
        let (received_tx, received) = watch::channel(0);
        let state = WebappState {
            seen: Arc::default(),
            received: Arc::new(received_tx),
            bodies: Arc::default(),
        };
        let (seen, bodies) = (state.seen.clone(), state.bodies.clone());
        let app = axum::Router::new()
            .fallback(webapp_answer)
            .with_state(state);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Webapp {
            addr,
            seen,
            received,
            bodies,
            server,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }

    /// The body of the next live request: the test sends its chunks.
    fn stream(&self) -> mpsc::UnboundedSender<Bytes> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.bodies.lock().expect("bodies").push(rx);
        tx
    }

    /// Waits until the webapp has received `n` requests in all.
    async fn wait_received(&self, n: usize) {
        let mut received = self.received.clone();
        within(
            WAIT,
            "the webapp receives the request",
            received.wait_for(|r| *r >= n),
        )
        .await
        .expect("webapp alive");
    }
}

impl Drop for Webapp {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A run token as trigger.dev SDK 4.8 hands a task in `TRIGGER_RUN_TOKEN`: header
/// `typ: run+jwt`; `aud: trigger:api`, `token_use: run`, an `admin` scope. Signed with a key
/// runfeed does not know (the webapp's rule is not published).
fn run_token(run_id: &str) -> String {
    let now = runfeed::auth::jwt::now_s();
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256);
    header.typ = Some("run+jwt".into());
    let claims = json!({
        "sub": run_id, "aud": "trigger:api", "token_use": "run", "scopes": ["admin"],
        "iat": now, "exp": now + 600,
    });
    let key = jsonwebtoken::EncodingKey::from_secret(b"the webapp's own secret").expect("key");
    jsonwebtoken::encode(&header, &claims, &key).expect("sign")
}

/// Exactly the headers the SDK sends on a realtime request from a task, plus a few a proxy or
/// browser adds that must not reach the webapp.
fn sdk_headers(token: &str) -> Vec<(String, String)> {
    let headers = modern(token);
    let headers = with(headers, "trigger-version", "4.8.3");
    let headers = with(headers, "cookie", "session=secret");
    let headers = with(headers, "x-forwarded-for", "10.1.2.3");
    with(headers, "origin", "https://evil.example")
}

/// A runfeed server forwarding run tokens to `upstream`, with an environment and a run tagged
/// `forwarded` in a batch.
struct Forwarding {
    srv: TestServer,
    env: DemoEnv,
    run: CreatedRun,
    /// The batch's friendly id.
    batch: String,
}

async fn server_forwarding_to(upstream: &str) -> Forwarding {
    let upstream = upstream.to_string();
    let (srv, env) =
        TestServer::start_with_env(1_000, |c| c.auth.run_token_upstream = Some(upstream)).await;
    let (batch_id, batch) = made("create batch", fixtures::create_batch(srv.pool(), &env)).await;
    let run = srv
        .run(&env, tagged_in_batch(&["forwarded"], &batch_id))
        .await;
    Forwarding {
        srv,
        env,
        run,
        batch,
    }
}

fn count(text: &str, route: &str, outcome: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with("runfeed_http_run_token_forwards_total{"))
        .filter(|l| l.contains(&format!("route=\"{route}\"")))
        .filter(|l| l.contains(&format!("outcome=\"{outcome}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// The three feed routes with a run token: each reaches the webapp's same route, with the query
/// as sent, the credential and the SDK's headers and nothing else; the webapp's status, Electric
/// headers and body come back. A percent-encoded id is forwarded in its canonical form. The same
/// requests with a secret key are served by runfeed itself: the webapp sees none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_token_request_reaches_the_webapp_unchanged_and_its_answer_comes_back() {
    let webapp = Webapp::start().await;
    let Forwarding {
        srv,
        env,
        run,
        batch,
    } = server_forwarding_to(&webapp.url()).await;
    let token = run_token(&run.id);
    let headers = sdk_headers(&token);
    let urls = feed_urls(&run.friendly_id, "forwarded", &batch);
    for (i, url) in urls.iter().enumerate() {
        let url = url.snapshot().q("skipColumns", "payload,output");
        let r = srv.fetch(&url, &headers).await;
        assert_eq!(r.status, 200, "{}: {}", url.path, r.text);
        assert_eq!(r.text, SNAPSHOT_BODY);
        assert_eq!(r.header("electric-handle"), Some(WEBAPP_HANDLE));
        assert_eq!(r.header("electric-offset"), Some(WEBAPP_OFFSET));
        assert_eq!(r.header("x-webapp"), Some("1"));
        let seen = webapp.seen();
        assert_eq!(seen.len(), i + 1, "one request each");
        let got = &seen[i];
        assert_eq!(got.method, "GET");
        assert_eq!(got.target, url.render(), "path and query unchanged");
        assert_eq!(got.headers["authorization"], format!("Bearer {token}"));
        assert_eq!(got.headers["trigger-version"], "4.8.3");
        assert_eq!(got.headers["x-trigger-electric-version"], ELECTRIC_VERSION);
        assert_eq!(got.headers["x-runfeed-forwarded"], "1");
        for private in ["cookie", "x-forwarded-for", "origin"] {
            assert!(!got.headers.contains_key(private), "{private} forwarded");
        }
    }
    // The id as a client may encode it: forwarded rebuilt from the parsed route.
    let encoded = run.friendly_id.replacen('_', "%5F", 1);
    let r = srv
        .get(&format!("/realtime/v1/runs/{encoded}?offset=-1"), &headers)
        .await;
    r.assert_status(200);
    let last = webapp.seen().pop().expect("forwarded");
    assert_eq!(
        last.target,
        format!("/realtime/v1/runs/{}?offset=-1", run.friendly_id)
    );
    // A secret key on the same routes: runfeed's own answer, the webapp sees nothing more.
    let before = webapp.seen().len();
    for url in &urls {
        let r = srv.fetch(&url.snapshot(), &modern(&env.api_key)).await;
        r.assert_status(200);
        assert_ne!(r.header("electric-handle"), Some(WEBAPP_HANDLE));
        assert!(r.header("x-webapp").is_none());
    }
    assert_eq!(
        webapp.seen().len(),
        before,
        "secret keys are never forwarded"
    );
    let metrics = srv.scrape_text().await;
    assert_eq!(count(&metrics, "/realtime/v1/runs/{run_id}", "answered"), 2);
    assert_eq!(count(&metrics, "/realtime/v1/runs", "answered"), 1);
    assert_eq!(
        count(&metrics, "/realtime/v1/batches/{batch_id}", "answered"),
        1
    );
}

/// A forwarded live long-poll is held while the webapp holds it, and answered with what the
/// webapp sends when its change comes; the body is streamed through as it arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_long_poll_is_held_until_the_webapp_answers() {
    let webapp = Webapp::start().await;
    let Forwarding { srv, run, .. } = server_forwarding_to(&webapp.url()).await;
    let headers = sdk_headers(&run_token(&run.id));
    let body = webapp.stream();
    let url = run_url(&run.friendly_id).live(WEBAPP_HANDLE, WEBAPP_OFFSET, Some("1"));
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let req = with_headers(
        client.get(format!("{}{}", srv.base, url.render())),
        &headers,
    );
    let pending = tokio::spawn(async move { req.send().await });
    webapp.wait_received(1).await;
    assert!(!pending.is_finished(), "held while the webapp holds it");
    body.send(Bytes::from_static(
        b"[{\"headers\":{\"operation\":\"update\"},",
    ))
    .expect("first chunk");
    let mut response = within(WAIT, "the head", pending)
        .await
        .expect("task")
        .expect("response");
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["electric-handle"], WEBAPP_HANDLE);
    let first = within(WAIT, "the first chunk", response.chunk())
        .await
        .expect("chunk")
        .expect("a chunk before the webapp sent the rest");
    assert!(first.starts_with(b"[{\"headers\""));
    body.send(Bytes::from_static(b"\"value\":{\"id\":\"r\"}}]"))
        .expect("second chunk");
    drop(body);
    let mut text = first.to_vec();
    text.extend(rest_of(&mut response).await);
    let parsed: Value = serde_json::from_slice(&text).expect("the whole answer");
    assert_eq!(parsed[0]["value"]["id"], "r");
    assert!(webapp.seen()[0].target.contains("live=true"));
}

/// A forwarded SSE stream (`live_sse=true`) reaches the client event by event: the webapp sends
/// its second event only once the client has the first, so a buffering forwarder would hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_sse_stream_reaches_the_client_event_by_event() {
    let webapp = Webapp::start().await;
    let Forwarding { srv, run, .. } = server_forwarding_to(&webapp.url()).await;
    let headers = sdk_headers(&run_token(&run.id));
    let events = webapp.stream();
    let url = run_url(&run.friendly_id)
        .live(WEBAPP_HANDLE, WEBAPP_OFFSET, None)
        .q("live_sse", "true");
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let req = with_headers(
        client.get(format!("{}{}", srv.base, url.render())),
        &headers,
    );
    let mut response = within(WAIT, "the SSE head", req.send())
        .await
        .expect("response");
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let first_event = "data: {\"headers\":{\"operation\":\"update\"},\"value\":{\"id\":\"r\"}}\n\n";
    events.send(Bytes::from(first_event)).expect("first event");
    let mut got = String::new();
    while !got.ends_with("\n\n") {
        let chunk = within(WAIT, "the first event", response.chunk())
            .await
            .expect("chunk")
            .expect("the first event before the last is sent");
        got.push_str(std::str::from_utf8(&chunk).expect("utf-8"));
    }
    assert_eq!(got, first_event);
    let last_event = "data: {\"headers\":{\"control\":\"up-to-date\"}}\n\n";
    events.send(Bytes::from(last_event)).expect("last event");
    drop(events);
    let rest = rest_of(&mut response).await;
    assert_eq!(String::from_utf8_lossy(&rest), last_event);
}

/// A webapp that cannot be reached: a run token gets a JSON 503 with `Retry-After: 1` (the
/// clients retry), counted `unavailable`; every other request is served as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_webapp_is_a_json_503_with_retry_after_for_run_tokens_only() {
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr")
    };
    let Forwarding { srv, env, run, .. } = server_forwarding_to(&format!("http://{closed}")).await;
    let url = run_url(&run.friendly_id).snapshot();
    let r = srv.fetch(&url, &sdk_headers(&run_token(&run.id))).await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    let error = r.json["error"].as_str().expect("a JSON error");
    assert!(error.contains("Service Unavailable"), "{error}");
    assert!(
        !r.text.contains(&closed.to_string()),
        "the upstream's address is not sent"
    );
    srv.fetch(&url, &modern(&env.api_key))
        .await
        .assert_status(200);
    let public = srv.token(&env, &["read:runs"]);
    srv.fetch(&url, &modern(&public)).await.assert_status(200);
    let metrics = srv.scrape_text().await;
    assert_eq!(
        count(&metrics, "/realtime/v1/runs/{run_id}", "unavailable"),
        1
    );
}

/// A request that already went through a runfeed (`auth.run_token_upstream` pointing back at
/// runfeed or its proxy) is refused with the JSON 503, never forwarded a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_comes_back_from_the_upstream_is_not_forwarded_again() {
    let webapp = Webapp::start().await;
    let Forwarding { srv, run, .. } = server_forwarding_to(&webapp.url()).await;
    let headers = with(sdk_headers(&run_token(&run.id)), "x-runfeed-forwarded", "1");
    let r = srv
        .fetch(&run_url(&run.friendly_id).snapshot(), &headers)
        .await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(webapp.seen().is_empty());
}

/// Without `auth.run_token_upstream`: the JSON 401 naming the token type, and the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_upstream_a_run_token_gets_the_json_401_naming_its_type() {
    let (srv, env) = TestServer::with_env(1_000).await;
    let run = srv.run(&env, RunSpec::default()).await;
    let r = srv
        .fetch(
            &run_url(&run.friendly_id).snapshot(),
            &sdk_headers(&run_token(&run.id)),
        )
        .await;
    assert_eq!(r.status, 401, "{}", r.text);
    assert_eq!(r.json["tokenType"], "run+jwt");
    let error = r.json["error"].as_str().expect("error text");
    assert!(error.contains("auth.run_token_upstream"), "{error}");
}

/// `request` sent as is on a new connection to `addr`; the status of the answer.
async fn raw_status(addr: SocketAddr, request: &[u8]) -> u16 {
    let mut stream = within(WAIT, "connect", tokio::net::TcpStream::connect(addr))
        .await
        .expect("connect");
    // A request hyper refuses may be answered (and the connection closed) before it is sent
    // in full: a failed write is fine, the answer is read below.
    let _ = stream.write_all(request).await;
    let mut answer = Vec::new();
    let _ = within(WAIT, "the answer", stream.read_to_end(&mut answer)).await;
    let text = String::from_utf8_lossy(&answer);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"))
}

/// Path tricks and oversized requests carrying a run token never reach the webapp: `//realtime`,
/// `..` (plain and percent-encoded), encoded slashes, over-long ids, routes other than the three
/// feed routes, other methods, and heads over the request limits are all answered by runfeed
/// (4xx) and the webapp sees nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_paths_and_oversized_requests_never_reach_the_webapp() {
    let webapp = Webapp::start().await;
    let Forwarding { srv, run, .. } = server_forwarding_to(&webapp.url()).await;
    let token = run_token(&run.id);
    let addr = srv.running().addr;
    let long_id = "a".repeat(129);
    let paths = [
        "//realtime/v1/runs/run_1".to_string(),
        "//realtime/v1/runs".to_string(),
        "/realtime/v1/runs/..".to_string(),
        "/realtime/v1/runs/.".to_string(),
        "/realtime/v1/runs/%2e%2e".to_string(),
        "/realtime/v1/runs/%2E%2E".to_string(),
        "/realtime/v1/runs/..%2f..%2fapi%2fv1%2fruns".to_string(),
        "/realtime/v1/runs/run_1%2f..%2f..%2fapi".to_string(),
        "/realtime/v1/runs/run_1%2Fx".to_string(),
        "/realtime/v1/runs/run_1%3Fx=1".to_string(),
        "/realtime/v1/runs/run_1%23x".to_string(),
        "/realtime/v1/runs/run%00".to_string(),
        "/realtime/v1/runs/../../api/v1/runs".to_string(),
        "/realtime/v1/runs/run_1/../../../api/v1/runs".to_string(),
        "/realtime/v1/batches/%2e%2e%2f%2e%2e%2fruns".to_string(),
        "/realtime/v1/batches/../runs".to_string(),
        "/realtime/v1/runs/run_1/extra".to_string(),
        "/realtime/v1/runs/".to_string(),
        format!("/realtime/v1/runs/{long_id}"),
        "/realtime/v1/streams/run_1/default".to_string(),
        "/api/v1/runs/run_1".to_string(),
        "/realtime/v2/runs/run_1".to_string(),
        "/healthz".to_string(),
        "/".to_string(),
    ];
    for path in &paths {
        let request = format!(
            "GET {path}?offset=-1 HTTP/1.1\r\nHost: runfeed\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
        );
        let status = raw_status(addr, request.as_bytes()).await;
        assert!(
            (400..500).contains(&status) || (path == "/healthz" && status == 200),
            "{path}: {status}"
        );
    }
    // Other methods on a feed route.
    for method in ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"] {
        let request = format!(
            "{method} /realtime/v1/runs/{} HTTP/1.1\r\nHost: runfeed\r\nAuthorization: Bearer {token}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}",
            run.friendly_id
        );
        let status = raw_status(addr, request.as_bytes()).await;
        assert!(status != 200 || method == "OPTIONS", "{method}: {status}");
    }
    // Over the request limits (431, 414): refused before anything is forwarded.
    let big = "x".repeat(40 * 1024);
    let oversized = [
        format!(
            "GET /realtime/v1/runs/{}?offset=-1 HTTP/1.1\r\nHost: runfeed\r\nAuthorization: Bearer {token}\r\nX-Big: {big}\r\nConnection: close\r\n\r\n",
            run.friendly_id
        ),
        format!(
            "GET /realtime/v1/runs/{}?offset=-1&pad={} HTTP/1.1\r\nHost: runfeed\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n",
            run.friendly_id,
            "y".repeat(9 * 1024)
        ),
        format!(
            "GET /realtime/v1/runs/{}?offset=-1 HTTP/1.1\r\nHost: runfeed\r\n{}Authorization: Bearer {token}\r\nConnection: close\r\n\r\n",
            run.friendly_id,
            (0..120).map(|i| format!("X-H{i}: v\r\n")).collect::<String>()
        ),
    ];
    for request in &oversized {
        let status = raw_status(addr, request.as_bytes()).await;
        assert!(matches!(status, 414 | 431), "{status}");
    }
    assert!(
        webapp.seen().is_empty(),
        "the webapp saw {:?}",
        webapp.seen().iter().map(|s| &s.target).collect::<Vec<_>>()
    );
    // The control: the same connection handling forwards a canonical request.
    let request = format!(
        "GET /realtime/v1/runs/{}?offset=-1 HTTP/1.1\r\nHost: runfeed\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n",
        run.friendly_id
    );
    assert_eq!(raw_status(addr, request.as_bytes()).await, 200);
    assert_eq!(webapp.seen().len(), 1);
    let metrics = srv.scrape_text().await;
    assert!(
        count(&metrics, "/realtime/v1/runs/{run_id}", "refused") >= 5,
        "{metrics}"
    );
}

/// The SDK falls back to the secret key near the run token's expiry and keeps the handle and
/// offset the webapp issued: runfeed answers them with the protocol's 409 must-refetch and a
/// handle of its own, and the refetch is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_the_webapp_issued_gets_a_409_must_refetch() {
    let webapp = Webapp::start().await;
    let Forwarding {
        srv,
        env,
        run,
        batch,
    } = server_forwarding_to(&webapp.url()).await;
    let headers = modern(&env.api_key);
    for url in feed_urls(&run.friendly_id, "forwarded", &batch) {
        for live in [false, true] {
            let mut request = url.catch_up(WEBAPP_HANDLE, WEBAPP_OFFSET);
            if live {
                request = url.live(WEBAPP_HANDLE, WEBAPP_OFFSET, Some("12345"));
            }
            let r = srv.fetch(&request, &headers).await;
            assert_must_refetch(&r, &request.render());
            let fresh = r.handle();
            assert!(!fresh.is_empty() && fresh != WEBAPP_HANDLE);
            let refetch = srv
                .fetch(
                    &url.clone()
                        .q("offset", "-1")
                        .q("handle", &fresh)
                        .q("expired_handle", WEBAPP_HANDLE),
                    &headers,
                )
                .await;
            refetch.assert_status(200);
        }
    }
    assert!(webapp.seen().is_empty(), "secret keys are never forwarded");
}

/// A run token that claims to be a public token (`pub: true`) is still a run token: forwarded,
/// never verified here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_token_mimicking_a_public_token_is_forwarded_not_verified() {
    let webapp = Webapp::start().await;
    let Forwarding { srv, env, run, .. } = server_forwarding_to(&webapp.url()).await;
    let now = runfeed::auth::jwt::now_s();
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256);
    header.typ = Some("run+jwt".into());
    let claims = json!({"pub": true, "sub": env.env_id, "scopes": ["read:all"],
        "iss": "https://id.trigger.dev", "aud": "https://api.trigger.dev", "iat": now, "exp": now + 600});
    let key = jsonwebtoken::EncodingKey::from_secret(env.api_key.as_bytes()).expect("key");
    let token = jsonwebtoken::encode(&header, &claims, &key).expect("sign");
    let r = srv
        .fetch(&run_url(&run.friendly_id).snapshot(), &modern(&token))
        .await;
    r.assert_status(200);
    assert_eq!(r.header("x-webapp"), Some("1"));
    assert_eq!(webapp.seen().len(), 1);
}
