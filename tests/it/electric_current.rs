//! The current Electric client generation (`@electric-sql/client` 1.5.x) against the real
//! server started in-process on a fresh Postgres database and the local Redis: SSE live mode,
//! `offset=now`, `log=changes_only`, `cache-buster`, subset requests refused, the `createdAt`
//! clamp header, and the 1.5 client's watchdogs (docs/protocol.md §13; Electric's HTTP API,
//! <https://electric-sql.com/docs/api/http>).
//!
//! The SSE reader here parses the byte stream as the client does (`data:` events, comments
//! ignored) and, like the 1.5 client, resumes at `<global_last_seen_lsn>_0`.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use runfeed::protocol::sse::parse_events;
use serde_json::{json, Value};
use tokio::time::Instant;

/// A streaming SSE response being read.
struct Sse {
    status: u16,
    headers: reqwest::header::HeaderMap,
    resp: reqwest::Response,
    buf: String,
    /// Keep-alive comments seen so far.
    comments: usize,
    ended: bool,
}

impl Sse {
    /// `GET url` with `live_sse=true&experimental_live_sse=true` (what 1.5 sends) on `base`.
    async fn open(base: &str, url: &Url, headers: &[(String, String)]) -> Sse {
        let url = url
            .clone()
            .q("experimental_live_sse", "true")
            .q("live_sse", "true");
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("client");
        let req = with_headers(http.get(format!("{base}{}", url.render())), headers)
            .header("accept", "text/event-stream");
        let resp = within(WAIT, "SSE response headers", req.send())
            .await
            .expect("SSE request");
        Sse {
            status: resp.status().as_u16(),
            headers: resp.headers().clone(),
            resp,
            buf: String::new(),
            comments: 0,
            ended: false,
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The next event's data (comments counted and skipped); `None` when the stream ended.
    async fn next_event(&mut self, limit: Duration) -> Option<String> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(at) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..at + 2).collect();
                if block.starts_with(':') {
                    self.comments += 1;
                    continue;
                }
                let mut events = parse_events(&block);
                return Some(events.remove(0));
            }
            if self.ended {
                return None;
            }
            let chunk = tokio::time::timeout_at(deadline, self.resp.chunk())
                .await
                .unwrap_or_else(|_| {
                    panic!("no SSE event within {limit:?}; buffered {:?}", self.buf)
                });
            match chunk {
                Ok(Some(bytes)) => self
                    .buf
                    .push_str(std::str::from_utf8(&bytes).expect("utf-8")),
                Ok(None) | Err(_) => self.ended = true,
            }
        }
    }

    /// The messages up to and including the next `up-to-date` (one client batch).
    async fn next_batch(&mut self, limit: Duration) -> Vec<Value> {
        let mut batch = Vec::new();
        loop {
            let data = self
                .next_event(limit)
                .await
                .unwrap_or_else(|| panic!("stream ended mid-batch after {batch:?}"));
            let msg: Value = serde_json::from_str(&data).expect("each event is one JSON message");
            let done = msg["headers"]["control"] == "up-to-date";
            batch.push(msg);
            if done {
                return batch;
            }
        }
    }

    /// Reads until the stream ends, bounded by `limit`; returns the events seen.
    async fn until_end(&mut self, limit: Duration) -> Vec<String> {
        let mut events = Vec::new();
        while let Some(e) = self.next_event(limit).await {
            events.push(e);
        }
        events
    }
}

/// The offset the 1.5 client moves to after an SSE batch: `<global_last_seen_lsn>_0`.
fn next_offset(batch: &[Value]) -> String {
    let last = batch.last().expect("batch");
    let lsn = last["headers"]["global_last_seen_lsn"]
        .as_str()
        .unwrap_or_else(|| panic!("up-to-date without global_last_seen_lsn: {last}"));
    assert!(
        lsn.bytes().all(|b| b.is_ascii_digit()),
        "BigInt-parsable: {lsn}"
    );
    format!("{lsn}_0")
}

fn ops_of(batch: &[Value]) -> Vec<(String, String)> {
    batch
        .iter()
        .filter(|m| m.get("key").is_some())
        .map(|m| {
            (
                m["headers"]["operation"].as_str().unwrap_or("").to_string(),
                m["value"]["id"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// SSE on a run feed: the response is `text/event-stream` with the live Electric headers; each
/// change arrives as one `data:` event followed by `up-to-date` carrying `global_last_seen_lsn`;
/// two changes arrive on the same stream; a reconnect at `<lsn>_0` resumes exactly there
/// (nothing re-sent, the next change arrives).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_follows_a_run_feed_and_resumes_at_the_lsn_offset() {
    let (srv, env) = TestServer::with_env(1_000).await;
    let run = srv.tagged_run(&env, &["s"]).await;
    let h = modern(&env.api_key);
    let url = run_url(&run.friendly_id);
    let snap = srv.fetch(&url.snapshot(), &h).await;
    srv.wait_subscribed(&env.env_id).await;

    let mut sse = Sse::open(&srv.base, &url.live_after(&snap), &h).await;
    assert_eq!(sse.status, 200);
    assert_eq!(sse.header("content-type"), Some("text/event-stream"));
    assert_eq!(sse.header("x-accel-buffering"), Some("no"));
    assert_eq!(sse.header("electric-handle"), Some(snap.handle().as_str()));
    assert_eq!(sse.header("electric-offset"), Some(snap.offset().as_str()));
    assert!(sse.header("electric-cursor").is_some());
    srv.wait_held("SSE stream holds", |h| h.0 == 1).await;

    let ms = srv.change(&env, &run.id, &["s"], None, "EXECUTING").await;
    let first = sse.next_batch(WAIT).await;
    assert_eq!(ops_of(&first), vec![op("update", &run.id)], "{first:?}");
    assert_eq!(first[0]["value"]["status"], "EXECUTING");
    let o1 = next_offset(&first);
    let lsn1: u64 = o1.trim_end_matches("_0").parse().expect("lsn");
    assert_eq!(
        lsn1 / 1_000_000,
        ms as u64,
        "the lsn carries the updatedAt ms"
    );

    // A second change on the same stream (after at least one hold ended quietly).
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    srv.change(&env, &run.id, &["s"], None, "COMPLETED_SUCCESSFULLY")
        .await;
    let second = sse.next_batch(WAIT).await;
    assert_eq!(ops_of(&second), vec![op("update", &run.id)]);
    assert_eq!(second[0]["value"]["status"], "COMPLETED_SUCCESSFULLY");
    let o2 = next_offset(&second);
    assert!(o2 > o1, "offsets advance: {o1} then {o2}");
    drop(sse);
    srv.wait_held("closed stream released", |h| h.0 == 0).await;

    // Reconnect where the client is: nothing is re-sent (a long-poll holds to its timeout) …
    let quiet = srv
        .fetch(&url.live(&snap.handle(), &o2, Some("1")), &h)
        .await;
    quiet.assert_status(200);
    assert!(
        quiet.is_bare_up_to_date(),
        "nothing re-sent: {}",
        quiet.text
    );
    assert!(
        quiet.elapsed >= Duration::from_millis(900),
        "{:?}",
        quiet.elapsed
    );
    // … and an SSE reconnect at the same offset gets the next change only.
    let mut again = Sse::open(&srv.base, &url.live(&snap.handle(), &o2, Some("2")), &h).await;
    assert_eq!(again.status, 200);
    srv.wait_held("reconnected stream holds", |h| h.0 == 1)
        .await;
    srv.change(&env, &run.id, &["s"], None, "CANCELED").await;
    let third = again.next_batch(WAIT).await;
    assert_eq!(ops_of(&third), vec![op("update", &run.id)]);
    assert_eq!(third[0]["value"]["status"], "CANCELED");
}

/// SSE on tag and batch feeds: a new run carrying the tags (in the batch) arrives as an
/// `insert` on both streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_follows_tag_and_batch_feeds() {
    let (srv, env) = TestServer::with_env(5_000).await;
    let (first, batch_id, batch_fid) = srv.batched_run(&env, &["t1"]).await;
    let h = modern(&env.api_key);
    let mut streams = Vec::new();
    for url in [tag_url("t1"), batch_url(&batch_fid)] {
        let snap = srv.fetch(&url.snapshot(), &h).await;
        assert_eq!(ids_of(&snap), vec![first.id.clone()]);
        streams.push(Sse::open(&srv.base, &url.live_after(&snap), &h).await);
    }
    srv.wait_subscribed(&env.env_id).await;
    srv.wait_held("tag and batch streams hold", |h| h.1 == 1 && h.2 == 1)
        .await;
    let fresh = srv.run(&env, tagged_in_batch(&["t1"], &batch_id)).await;
    srv.publish_created(&env, &fresh, &["t1"]).await;
    for (what, sse) in ["tag", "batch"].iter().zip(streams.iter_mut()) {
        let batch = sse.next_batch(WAIT).await;
        assert_eq!(
            ops_of(&batch),
            vec![op("insert", &fresh.id)],
            "{what}: {batch:?}"
        );
        next_offset(&batch);
    }
}

/// Keep-alive comments while idle, and the server ends the stream after
/// `feeds.sse_max_duration_ms` (the client reconnects), releasing its hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_keepalive_then_the_server_ends_the_stream() {
    let (srv, env) = TestServer::start_with_env(5_000, |c| {
        c.feeds.sse_keepalive_ms = 150;
        c.feeds.sse_max_duration_ms = 1_000;
    })
    .await;
    let run = srv.tagged_run(&env, &["k"]).await;
    let h = modern(&env.api_key);
    let url = run_url(&run.friendly_id);
    let snap = srv.fetch(&url.snapshot(), &h).await;
    let started = Instant::now();
    let mut sse = Sse::open(&srv.base, &url.live_after(&snap), &h).await;
    let events = sse.until_end(Duration::from_secs(5)).await;
    let lasted = started.elapsed();
    assert!(events.is_empty(), "no change, no event: {events:?}");
    assert!(
        sse.comments >= 4,
        "keep-alives every 150 ms: {}",
        sse.comments
    );
    assert!(
        lasted >= Duration::from_millis(950) && lasted < Duration::from_millis(3_000),
        "ended after the max duration: {lasted:?}"
    );
    srv.wait_held("ended stream released", |h| h.0 == 0).await;
}

/// A stream is one live request against the per-environment limit for its whole life, and a
/// client that goes away frees the slot at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_takes_one_concurrency_slot_until_the_client_goes_away() {
    let srv =
        Arc::new(TestServer::start_with(20_000, |c| c.feeds.default_concurrency_limit = 1).await);
    let env = srv.env().await;
    let run = srv.tagged_run(&env, &["c"]).await;
    let h = modern(&env.api_key);
    let url = run_url(&run.friendly_id);
    let snap = srv.fetch(&url.snapshot(), &h).await;
    let live = url.live_after(&snap);
    let sse = Sse::open(&srv.base, &live, &h).await;
    assert_eq!(sse.status, 200);
    srv.wait_held("stream holds", |h| h.0 == 1).await;
    let over = srv.fetch(&live, &h).await;
    assert_eq!(over.status, 429, "{}", over.text);
    let second = Sse::open(&srv.base, &live, &h).await;
    assert_eq!(second.status, 429, "a second stream is over the limit too");
    drop(sse);
    srv.wait_held("aborted stream released", |h| h.0 == 0).await;
    let poll = spawn_fetch(&srv, &live, &h);
    srv.wait_held("the freed slot is taken", |h| h.0 == 1).await;
    poll.abort();
}

/// A handle this server did not issue is an ordinary 409 must-refetch with a new handle, never
/// a stream (`must-refetch` is not sent over SSE), and the new handle is not the expired one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_with_a_stale_handle_is_an_ordinary_409() {
    let (srv, env) = TestServer::with_env(1_000).await;
    let run = srv.tagged_run(&env, &["x"]).await;
    let h = modern(&env.api_key);
    let url = run_url(&run.friendly_id);
    let sse = Sse::open(&srv.base, &url.live("bogus", "5_0", Some("1")), &h).await;
    assert_eq!(sse.status, 409);
    assert_ne!(sse.header("content-type"), Some("text/event-stream"));
    let fresh = sse
        .header("electric-handle")
        .expect("new handle")
        .to_string();
    assert_ne!(fresh, "bogus");
    let body = within(WAIT, "409 body", sse.resp.text())
        .await
        .expect("body");
    assert_eq!(
        serde_json::from_str::<Value>(&body).expect("JSON"),
        json!([{"headers": {"control": "must-refetch"}}])
    );
}

/// On shutdown a stream ends (after the hold in progress answers) within the grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_streams_end_on_shutdown() {
    let (srv, env) = TestServer::with_env(20_000).await;
    let peer = srv.peer(|_| {}).await;
    let run = srv.tagged_run(&env, &["d"]).await;
    let h = modern(&env.api_key);
    let url = run_url(&run.friendly_id);
    let snap = srv.fetch_at(&peer.base, &url.snapshot(), &h).await;
    let mut sse = Sse::open(&peer.base, &url.live_after(&snap), &h).await;
    assert_eq!(sse.status, 200);
    let router = peer.running.router.clone();
    wait_until(WAIT, "peer holds the stream", || router.held_feeds().0 == 1).await;
    let started = Instant::now();
    let stop = tokio::spawn(peer.running.stop());
    sse.until_end(Duration::from_secs(5)).await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    within(WAIT, "peer stopped", stop).await.expect("stop");
}

/// `offset=now`: an immediate 200 with the current handle and offset, no rows, `up-to-date`
/// and the non-live headers; going live from there delivers later changes as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offset_now_answers_at_once_without_rows_then_goes_live() {
    let (srv, env) = TestServer::with_env(5_000).await;
    let run = srv.tagged_run(&env, &["n"]).await;
    let h = modern(&env.api_key);
    for url in [run_url(&run.friendly_id), tag_url("n")] {
        let now = srv
            .fetch(&url.clone().q("log", "full").q("offset", "now"), &h)
            .await;
        now.assert_status(200);
        assert_immediate(&now, "offset=now");
        assert_feed_headers(&now, true);
        assert!(now.is_bare_up_to_date(), "no rows: {}", now.text);
        assert!(now.has("electric-up-to-date"));
        srv.wait_subscribed(&env.env_id).await;
        let live = srv.fetch(&url.live_after(&now), &h);
        let change = async {
            srv.wait_held("held after offset=now", |h| h.0 + h.1 == 1)
                .await;
            srv.change(&env, &run.id, &["n"], None, "EXECUTING").await
        };
        let (r, _) = tokio::join!(live, change);
        assert_woken_by_update(&r, &run.id, Duration::from_secs(3), "live after offset=now");
        srv.set_status(&run.id, "PENDING").await;
    }
}

/// `log=changes_only`: the snapshot carries no rows (but a handle and an offset); changes after
/// it are delivered as usual, and rows that did not change are never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_only_snapshot_has_no_rows_then_changes_arrive() {
    let (srv, env) = TestServer::with_env(1_000).await;
    let [a, b] = srv.tagged_runs(&env, &["co"]).await;
    let h = modern(&env.api_key);
    let url = tag_url("co");
    let snap = srv
        .fetch(&url.clone().q("log", "changes_only").q("offset", "-1"), &h)
        .await;
    snap.assert_status(200);
    assert_feed_headers(&snap, true);
    assert!(snap.is_bare_up_to_date(), "no rows: {}", snap.text);
    srv.wait_subscribed(&env.env_id).await;
    let live_url = url
        .clone()
        .q("cursor", "")
        .q("handle", &snap.handle())
        .q("live", "true")
        .q("log", "changes_only")
        .q("offset", &snap.offset());
    let live = srv.fetch(&live_url, &h);
    let change = async {
        srv.wait_held("held", |h| h.1 == 1).await;
        srv.change(&env, &a.id, &["co"], None, "EXECUTING").await
    };
    let (r, _) = tokio::join!(live, change);
    assert_eq!(
        r.ops(),
        vec![op("update", &a.id)],
        "only the change: {}",
        r.text
    );
    assert!(r.row(&b.id).is_none());
    // `log` takes only Electric's two values.
    srv.assert_bad_input(&url.clone().q("log", "everything"), &env.api_key, "bad log")
        .await;
}

/// `cache-buster` is accepted and ignored: the same answer as without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_buster_is_accepted_and_ignored() {
    let (srv, env) = TestServer::with_env(1_000).await;
    let run = srv.tagged_run(&env, &["cb"]).await;
    let h = modern(&env.api_key);
    let url = run_url(&run.friendly_id);
    let busted = srv
        .fetch(&url.snapshot().q("cache-buster", "x7f3k"), &h)
        .await;
    busted.assert_status(200);
    assert_eq!(busted.ops(), vec![op("insert", &run.id)]);
    let catch_up = srv
        .fetch(
            &url.catch_up(&busted.handle(), &busted.offset())
                .q("cache-buster", "abc"),
            &h,
        )
        .await;
    catch_up.assert_status(200);
    assert!(catch_up.is_bare_up_to_date(), "{}", catch_up.text);
}

/// `subset__*` (GET) and the POST form are refused with a 400 `{"error": …}` that names the
/// parameter — never a different shape served silently; a legacy client gets 422. The CORS
/// preflight allows POST, so a browser can read the refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subset_requests_are_refused_naming_the_parameter() {
    let (srv, env) = TestServer::with_env(1_000).await;
    let run = srv.tagged_run(&env, &["sub"]).await;
    let h = modern(&env.api_key);
    for url in [run_url(&run.friendly_id), tag_url("sub")] {
        let get = srv
            .fetch(
                &url.snapshot()
                    .q("subset__limit", "1")
                    .q("subset__where", "true"),
                &h,
            )
            .await;
        assert_eq!(get.status, 400, "{}", get.text);
        let msg = get.json["error"].as_str().expect("error string");
        assert!(msg.starts_with("subset__limit"), "{msg}");
        let legacy_get = srv
            .fetch(
                &url.snapshot().q("subset__where", "x"),
                &legacy(&env.api_key),
            )
            .await;
        assert_eq!(legacy_get.status, 422, "{}", legacy_get.text);

        let post = srv
            .http
            .post(format!("{}{}", srv.base, url.snapshot().render()))
            .header("authorization", format!("Bearer {}", env.api_key))
            .header("x-trigger-electric-version", ELECTRIC_VERSION)
            .header("origin", "https://app.example")
            .header("content-type", "application/json")
            .body(r#"{"where":"\"status\" = $1","params":{"1":"x"},"limit":1}"#);
        let post = send(post, WAIT).await.expect("POST");
        assert_eq!(post.status, 400, "{}", post.text);
        let msg = post.json["error"].as_str().expect("error string");
        assert!(msg.starts_with("subset__limit"), "{msg}");
        assert!(post.has("access-control-allow-origin"));
    }
    let unauthenticated = srv
        .http
        .post(format!("{}/realtime/v1/runs?tags=sub", srv.base))
        .body("{}");
    let r = send(unauthenticated, WAIT).await.expect("POST");
    assert_eq!(r.status, 401, "authentication comes first: {}", r.text);
    let preflight = srv
        .request(
            reqwest::Method::OPTIONS,
            "/realtime/v1/runs?tags=sub",
            &[
                ("origin".into(), "https://app.example".into()),
                ("access-control-request-method".into(), "POST".into()),
                (
                    "access-control-request-headers".into(),
                    "authorization, content-type".into(),
                ),
            ],
        )
        .await;
    assert!(preflight.status < 300, "{}", preflight.status);
    let methods = preflight
        .header("access-control-allow-methods")
        .unwrap_or("")
        .to_string();
    assert!(methods.contains("POST"), "{methods}");
}

/// trigger.dev#3018: a `createdAt` window longer than `feeds.maximum_created_at_filter_age_ms`
/// is served clamped and the response says so (`x-runfeed-created-at-clamped: <ms served>`); a
/// window within the maximum is served as asked, without the header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clamped_created_at_window_is_announced() {
    let (srv, env) = TestServer::start_with_env(1_000, |c| {
        c.feeds.maximum_created_at_filter_age_ms = 2 * 3_600_000;
    })
    .await;
    let now = runfeed::clock::now_ms();
    let recent = srv.run(&env, tagged_aged(&["w"], now, 30 * 60_000)).await;
    let old = srv.run(&env, tagged_aged(&["w"], now, 5 * 3_600_000)).await;
    let h = modern(&env.api_key);
    let week = srv
        .fetch(&tag_url("w").q("createdAt", "1w").snapshot(), &h)
        .await;
    week.assert_status(200);
    assert_eq!(
        week.header(runfeed::http::CREATED_AT_CLAMPED_HEADER),
        Some("7200000")
    );
    assert_eq!(ids_of(&week), vec![recent.id.clone()], "{}", week.text);
    assert!(week.row(&old.id).is_none());
    // The live polls of the clamped request say so too.
    let live = srv
        .fetch(&tag_url("w").q("createdAt", "1w").live_after(&week), &h)
        .await;
    assert_eq!(
        live.header(runfeed::http::CREATED_AT_CLAMPED_HEADER),
        Some("7200000")
    );
    for within_max in ["1h", "2h"] {
        let r = srv
            .fetch(&tag_url("w").q("createdAt", within_max).snapshot(), &h)
            .await;
        r.assert_status(200);
        assert!(
            !r.has(runfeed::http::CREATED_AT_CLAMPED_HEADER),
            "{within_max}"
        );
    }
}

/// The 1.5 client aborts a live request at 45 s: start-up refuses a configuration whose hold
/// (with jitter and the backstop read) could come close, and the default stays well under.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_hold_reaches_the_1_5_clients_live_request_watchdog() {
    let mut config = test_config("postgres://postgres@127.0.0.1:5432/unused", 40_000);
    let err = runfeed::app::start(config.clone())
        .await
        .err()
        .expect("a 40 s hold is refused at start-up");
    assert!(err.to_string().contains("45 s"), "{err}");
    config.feeds = runfeed::config::FeedsConfig::default();
    assert!(
        config.feeds.max_hold_ms() < runfeed::protocol::electric::CLIENT_LIVE_REQUEST_TIMEOUT_MS,
        "default hold {} ms",
        config.feeds.max_hold_ms()
    );
}

/// The 1.5 client resets after 5 requests within 500 ms at one offset. Following a feed as it
/// does (non-live until `up-to-date`, then live; `offset=now` and `changes_only` starts) never
/// produces that pattern, neither while quiet nor while the run changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn following_a_feed_never_trips_the_fast_loop_detector() {
    let (srv, env) = TestServer::with_env(300).await;
    let run = srv.tagged_run(&env, &["fl"]).await;
    let h = modern(&env.api_key);
    let url = run_url(&run.friendly_id);
    for start in ["-1", "now"] {
        let mut requests: Vec<(Instant, String)> = Vec::new();
        let mut offset = start.to_string();
        let mut handle: Option<String> = None;
        let mut cursor: Option<String> = None;
        let mut up_to_date = false;
        let until = Instant::now() + Duration::from_millis(1_500);
        let mut n = 0;
        while Instant::now() < until {
            let mut u = url.clone().q("log", "full").q("offset", &offset);
            if let Some(hd) = &handle {
                u = u.q("handle", hd);
            }
            if up_to_date {
                u = u
                    .q("live", "true")
                    .q("cursor", cursor.as_deref().unwrap_or(""));
            }
            requests.push((Instant::now(), offset.clone()));
            let r = srv.fetch(&u, &h).await;
            r.assert_status(200);
            handle = Some(r.handle());
            offset = r.offset();
            cursor = r.cursor();
            up_to_date = r.ends_up_to_date();
            n += 1;
            if n % 2 == 0 {
                srv.change(
                    &env,
                    &run.id,
                    &["fl"],
                    None,
                    if n % 4 == 0 { "EXECUTING" } else { "PENDING" },
                )
                .await;
            }
        }
        for (i, (t, o)) in requests.iter().enumerate() {
            let same = requests[i..]
                .iter()
                .filter(|(t2, o2)| o2 == o && *t2 - *t < Duration::from_millis(500))
                .count();
            assert!(
                same < 5,
                "start {start}: {same} requests at {o} within 500 ms"
            );
        }
    }
}

/// A subset POST whose body never finishes (a large `Content-Length`, a few bytes, then
/// nothing), or runs past the small cap a refusal needs, is still refused with the JSON 400 —
/// promptly — instead of holding the connection open or answering a plain-text 413.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subset_post_whose_body_stalls_or_overflows_is_refused_with_json_not_held() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (srv, env) = TestServer::with_env(1_000).await;
    let run = srv.tagged_run(&env, &["stall"]).await;
    let path = run_url(&run.friendly_id).snapshot().render();
    let addr = srv.base.trim_start_matches("http://").to_string();
    for (declared, sent) in [(10_000_000usize, 10usize), (3 * 1024 * 1024, 100 * 1024)] {
        let mut stream = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\
             x-trigger-electric-version: {ELECTRIC_VERSION}\r\ncontent-type: application/json\r\n\
             content-length: {declared}\r\n\r\n",
            env.api_key
        );
        stream.write_all(head.as_bytes()).await.expect("head");
        stream.write_all(&vec![b' '; sent]).await.expect("body");
        let mut response = Vec::new();
        let read = async {
            let mut buf = [0u8; 4096];
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => response.extend_from_slice(&buf[..n]),
                }
                if response.windows(4).any(|w| w == b"\r\n\r\n") && response.ends_with(b"}") {
                    break;
                }
            }
        };
        within(
            WAIT,
            "the refusal of a stalled or oversized subset body",
            read,
        )
        .await;
        let text = String::from_utf8_lossy(&response);
        assert!(
            text.starts_with("HTTP/1.1 400"),
            "{declared}/{sent}: {text}"
        );
        assert!(text.contains("application/json"), "{text}");
        assert!(text.contains("{\"error\":\"subset__"), "{text}");
    }
}
