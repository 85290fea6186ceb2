//! HTTP-level integration tests of the three feeds (run, tag, batch) against the real server
//! started in-process (`runfeed::app::start`) on a fresh Postgres database and the local Redis.
//!
//! Specs: docs/behaviours.md §1.9–§1.15 (REQ-*, RUN-*, TAG-*, BAT-*, LIVE-*, SER/TOK/HDR-*, HYD-*),
//! docs/protocol.md §3–§5, §10, §11 (scenario numbers), docs/trigger-dev.md §2–§3 (auth order, scopes,
//! request parsing), docs/behaviours.md §5.1.
//!
//! Every test owns its server and database; environment ids are random, so Redis channels never
//! collide and tests run in parallel. Every await that could hang is bounded.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use runfeed_dev::fixtures::{CreatedRun, DemoEnv, RunSpec, RunUpdate};
use serde_json::json;
use tokio::time::Instant;

// ---------------------------------------------------------------------------------------------
// Snapshots
// ---------------------------------------------------------------------------------------------

/// RUN-01, SER-11, SER-12, HDR-01/02: snapshot = [insert, up-to-date] with handle, offset
/// `<updatedAtMs>_<seq>`, schema and up-to-date headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_01_snapshot_insert_then_up_to_date() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let spec = RunSpec {
        status: "EXECUTING".into(),
        ..tagged(&["x"])
    };
    let run = srv.run(&env, spec).await;
    let tok = srv.token(&env, &["read:runs"]);

    let r = srv
        .fetch(&run_url(&run.friendly_id).snapshot(), &modern(&tok))
        .await;
    assert_feed_headers(&r, true);
    assert_eq!(
        r.offset_ms(),
        run.updated_at_ms,
        "offset carries the run's updatedAt"
    );
    let msgs = r.messages();
    assert_eq!(msgs.len(), 2, "insert + up-to-date: {}", r.text);
    let row = &msgs[0];
    assert_eq!(row["key"], key_of(&run.id));
    assert_eq!(row["headers"]["operation"], "insert");
    assert_eq!(row["value"]["id"], run.id);
    assert_eq!(row["value"]["friendlyId"], run.friendly_id);
    assert_eq!(row["value"]["status"], "EXECUTING");
    assert_eq!(row["value"]["updatedAt"], ts(run.updated_at_ms));
    assert_eq!(row["value"]["createdAt"], ts(run.created_at_ms));
    assert_eq!(row["value"]["runTags"], "{\"x\"}");
    assert_eq!(msgs[1], json!({"headers": {"control": "up-to-date"}}));
    let schema = r.schema();
    assert_eq!(schema["id"], json!({"type": "text"}));
    assert_eq!(schema["runTags"], json!({"type": "text", "dims": 1}));
    assert_eq!(schema["number"], json!({"type": "int4"}));
    assert_eq!(
        schema.as_object().unwrap().len(),
        26,
        "all 26 columns without skipColumns"
    );
}

/// RUN-01 / ROUTE-01: an unknown run is a 404 JSON with `x-should-retry: false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_01_missing_run_is_404() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let r = srv
        .fetch(
            &run_url("run_doesnotexist0000000000").snapshot(),
            &modern(&env.api_key),
        )
        .await;
    r.assert_status(404);
    assert_eq!(r.json, json!({"error": "Not found"}));
    assert_eq!(r.header("x-should-retry"), Some("false"));
    assert!(r
        .header("content-type")
        .unwrap_or("")
        .contains("application/json"));
}

/// TAG-03, BAT-02, SER-12: every feed kind's snapshot has the same header set; tag and batch
/// snapshots carry one `insert` per run, newest first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_headers_for_each_feed_kind() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let (batch_id, batch_fid) = srv.batch(&env).await;
    let now = runfeed::clock::now_ms();
    let aged = |age_ms: i64| RunSpec {
        created_at_ms: Some(now - age_ms),
        ..tagged_in_batch(&["k"], &batch_id)
    };
    let older = srv.run(&env, aged(60_000)).await;
    let newer = srv.run(&env, aged(1_000)).await;
    let h = modern(&env.api_key);

    let run = srv.fetch(&run_url(&older.friendly_id).snapshot(), &h).await;
    assert_feed_headers(&run, true);
    assert_eq!(run.ops(), vec![op("insert", &older.id)]);

    let tag = srv.fetch(&tag_url("k").snapshot(), &h).await;
    assert_feed_headers(&tag, true);
    assert_eq!(
        tag.ops(),
        vec![op("insert", &newer.id), op("insert", &older.id)],
        "newest createdAt first"
    );
    assert_eq!(
        tag.offset_ms(),
        older.updated_at_ms.max(newer.updated_at_ms)
    );

    let batch = srv.fetch(&batch_url(&batch_fid).snapshot(), &h).await;
    assert_feed_headers(&batch, true);
    assert_eq!(
        batch.ops(),
        vec![op("insert", &newer.id), op("insert", &older.id)]
    );

    // Handles of different feeds differ.
    assert_ne!(run.handle(), tag.handle());
    assert_ne!(tag.handle(), batch.handle());
}

/// TAG-03, SER-12: a tag feed with no matching run is a bare up-to-date with offset `0_…`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_03_empty_tag_feed_is_bare_up_to_date_offset_zero() {
    let (srv, env) = TestServer::with_env(1_500).await;
    srv.tagged_run(&env, &["other"]).await;
    let r = srv
        .fetch(&tag_url("nomatch").snapshot(), &modern(&env.api_key))
        .await;
    assert_feed_headers(&r, true);
    assert!(r.is_bare_up_to_date(), "{}", r.text);
    assert!(r.offset().starts_with("0_"), "offset {}", r.offset());

    // The same for an empty batch.
    let (_, batch_fid) = srv.batch(&env).await;
    let b = srv
        .fetch(&batch_url(&batch_fid).snapshot(), &modern(&env.api_key))
        .await;
    assert_feed_headers(&b, true);
    assert!(b.is_bare_up_to_date(), "{}", b.text);
    assert!(b.offset().starts_with("0_"), "offset {}", b.offset());
}

// ---------------------------------------------------------------------------------------------
// Live
// ---------------------------------------------------------------------------------------------

/// Scenario 4, RUN-06, LIVE-07: a live poll without change is held for the hold, then answers
/// `[up-to-date]` with an `electric-cursor` strictly greater than the request's, the same
/// handle and the same offset watermark — for all three feed kinds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_04_live_hold_without_change_answers_up_to_date_after_hold() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let (run, _, batch_fid) = srv.batched_run(&env, &["h"]).await;
    let h = modern(&env.api_key);
    for url in feed_urls(&run.friendly_id, "h", &batch_fid) {
        let snap = srv.fetch(&url.snapshot(), &h).await;
        snap.assert_status(200);
        let cursor = "100";
        let live = srv
            .fetch(&url.live(&snap.handle(), &snap.offset(), Some(cursor)), &h)
            .await;
        assert_feed_headers(&live, false);
        assert!(live.is_bare_up_to_date(), "{}: {}", url.path, live.text);
        assert!(
            live.elapsed >= Duration::from_millis(1_450),
            "{}: held only {:?}",
            url.path,
            live.elapsed
        );
        assert!(
            live.elapsed < Duration::from_millis(4_000),
            "{}: held {:?}",
            url.path,
            live.elapsed
        );
        assert_eq!(live.handle(), snap.handle(), "{}: handle kept", url.path);
        assert_eq!(
            live.offset_ms(),
            snap.offset_ms(),
            "{}: offset watermark unchanged",
            url.path
        );
        let c: u64 = live.cursor().unwrap().parse().expect("numeric cursor");
        assert!(c > 100, "cursor strictly greater than the request's");
        println!("{}: live hold answered after {:?}", url.path, live.elapsed);
    }
}

/// Scenario 5, RUN-05, LIVE-03: a held live poll answers promptly after the row changes and the
/// change record is published — ONE `update` row, advanced offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_05_live_wake_on_change_answers_promptly_with_one_update() {
    let srv = TestServer::start(10_000).await;
    let FollowedRun {
        env,
        run,
        headers: h,
        url,
        snap,
    } = srv.follow_new_run().await;
    srv.wait_subscribed(&env.env_id).await;

    let poll = async {
        let r = srv.fetch(&url.live_after(&snap), &h).await;
        (r, Instant::now())
    };
    let change = async {
        srv.wait_held("run feed held", |h| h.0 == 1).await;
        let ms = srv.set_status(&run.id, "EXECUTING").await;
        let rec = TestServer::record(&env, &run.id, &[], None, ms);
        srv.wait_subscribed(&env.env_id).await;
        let t = Instant::now();
        srv.publish(&rec).await;
        (t, ms)
    };
    let ((r, done), (published, ms)) =
        within(WAIT, "live wake", async { tokio::join!(poll, change) }).await;
    let latency = done.duration_since(published);
    println!("scenario_05 run feed wake latency: {latency:?} (hold 10 s)");
    assert_feed_headers(&r, false);
    assert_eq!(r.ops(), vec![op("update", &run.id)], "{}", r.text);
    assert_eq!(r.row(&run.id).unwrap()["value"]["status"], "EXECUTING");
    assert_eq!(r.offset_ms(), ms, "offset advanced to the new updatedAt");
    assert!(r.offset_ms() > snap.offset_ms());
    assert_eq!(r.handle(), snap.handle());
    assert!(
        latency < Duration::from_millis(1_000),
        "wake latency {latency:?}"
    );
}

/// LIVE-03: on a tag feed, an advanced known run arrives as `update`, a run the client never
/// saw arrives as `insert`; unchanged runs are not re-sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_03_tag_wake_diffs_insert_vs_update() {
    let (srv, env) = TestServer::uncoalesced_with_env(10_000).await;
    let [known, quiet] = srv.tagged_runs(&env, &["t"]).await;
    let h = modern(&srv.token(&env, &["read:tags:t"]));
    let url = tag_url("t");
    let snap = srv.fetch(&url.snapshot(), &h).await;
    assert_eq!(
        sorted(snap.ops()),
        sorted(vec![op("insert", &known.id), op("insert", &quiet.id)])
    );
    srv.wait_subscribed(&env.env_id).await;

    // 1. The known run changes → update.
    let poll = srv.fetch(&url.live_after(&snap), &h);
    let change = async {
        srv.wait_held("tag feed held", |h| h.1 == 1).await;
        let t = Instant::now();
        srv.change(&env, &known.id, &["t"], None, "EXECUTING").await;
        t
    };
    let (r1, t1) = tokio::join!(poll, change);
    println!(
        "live_03 tag wake (update) answered {:?} after the change started",
        t1.elapsed()
    );
    assert!(
        t1.elapsed() < Duration::from_secs(2),
        "the change must wake the poll, not the 10 s backstop"
    );
    assert_feed_headers(&r1, false);
    assert_eq!(r1.ops(), vec![op("update", &known.id)], "{}", r1.text);
    assert_eq!(r1.row(&known.id).unwrap()["value"]["status"], "EXECUTING");

    // 2. A new run with the tag → insert.
    let poll = srv.fetch(&url.live_after(&r1), &h);
    let create = async {
        srv.wait_held("tag feed held again", |h| h.1 == 1).await;
        let fresh = srv.tagged_run(&env, &["t"]).await;
        srv.publish_created(&env, &fresh, &["t"]).await;
        fresh
    };
    let (r2, fresh) = tokio::join!(poll, create);
    assert!(
        r2.elapsed < Duration::from_secs(5),
        "the new run must wake the poll: {:?}",
        r2.elapsed
    );
    assert_feed_headers(&r2, false);
    assert_eq!(r2.ops(), vec![op("insert", &fresh.id)], "{}", r2.text);
    assert!(
        r2.offset_ms() >= r1.offset_ms(),
        "offsets never move backwards"
    );
}

/// docs/behaviours.md §5.1 item 1 / docs/behaviours.md §4 item 1: the diff is decided by the offset the client
/// ECHOES. A live response that is lost in transit (the client re-polls with the OLD offset)
/// must deliver the change again; polling with the new offset then re-sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_lost_response_is_redelivered_when_the_old_offset_is_echoed() {
    let (srv, env) = TestServer::with_env(3_000).await;
    let run = srv.tagged_run(&env, &["w"]).await;
    let h = modern(&env.api_key);
    let url = tag_url("w");
    let snap = srv.fetch(&url.snapshot(), &h).await;
    let (handle, o0) = (snap.handle(), snap.offset());
    srv.wait_subscribed(&env.env_id).await;

    let poll = srv.fetch(&url.live(&handle, &o0, Some("1")), &h);
    let change = async {
        srv.wait_held("held", |h| h.1 == 1).await;
        srv.change(&env, &run.id, &["w"], None, "EXECUTING").await
    };
    let (r1, ms) = tokio::join!(poll, change);
    assert_eq!(r1.ops(), vec![op("update", &run.id)], "{}", r1.text);
    let o1 = r1.offset();
    assert_eq!(r1.offset_ms(), ms);

    // R1 is "lost": re-poll with O0. The change must come again, at once.
    let again = srv.fetch(&url.live(&handle, &o0, Some("2")), &h).await;
    let what = "redelivery when the old offset was echoed (not after the hold)";
    assert_woken_by_update(&again, &run.id, Duration::from_millis(1_500), what);
    assert_eq!(again.row(&run.id).unwrap()["value"]["status"], "EXECUTING");

    // With O1 the client has the change: nothing is re-sent (held to the timeout).
    let next = srv.fetch(&url.live(&handle, &o1, Some("3")), &h).await;
    let what = "no change re-sent to a client that has it";
    assert_quiet_hold(&next, Duration::from_millis(2_900), what);
}

/// Scenarios 8 and 9, docs/protocol.md §4.5–4.6: a non-live request with a handle (resume after pause,
/// prefetch at the tip) is answered immediately — never held — with `electric-schema` and a body
/// ending in up-to-date; a change missed in between is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_08_09_non_live_catch_up_is_immediate_with_schema() {
    let srv = TestServer::start(10_000).await;
    let snapshots = srv.run_and_tag_snapshots("c", modern).await;
    let (env, run, h) = (&snapshots.env, &snapshots.run, &snapshots.headers);
    for (url, snap) in &snapshots.feeds {
        // Scenario 8: resume with cursor, no live.
        let resume = url
            .clone()
            .q("cursor", "5")
            .q("handle", &snap.handle())
            .q("log", "full")
            .q("offset", &snap.offset());
        let resume = srv.fetch(&resume, h).await;
        assert_immediate(&resume, &format!("{}: resume", url.path));
        assert!(
            resume.has("electric-cursor"),
            "cursor sent on every response"
        );
        // Scenario 9: prefetch at the tip.
        let prefetch = url.catch_up(&snap.handle(), &snap.offset());
        let prefetch = srv.fetch(&prefetch, h).await;
        assert_immediate(&prefetch, &format!("{}: prefetch", url.path));
    }

    // A change published while no poll was held reaches a catch-up at the old offset.
    let url = tag_url("c");
    let snap = srv.fetch(&url.snapshot(), h).await;
    let batches = srv.routed_batches();
    let ms = srv.change(env, &run.id, &["c"], None, "EXECUTING").await;
    srv.wait_routed(batches, "record routed").await;
    let catch_up = srv
        .fetch(&url.catch_up(&snap.handle(), &snap.offset()), h)
        .await;
    assert_immediate(&catch_up, "catch-up after a missed change");
    let row = catch_up
        .row(&run.id)
        .unwrap_or_else(|| panic!("missed change not in catch-up: {}", catch_up.text));
    assert_eq!(row["value"]["status"], "EXECUTING");
    assert_eq!(row["headers"]["operation"], "update");
    assert_eq!(catch_up.offset_ms(), ms);
}

/// Scenario 13: extra protocol params (`log`, empty `cursor`, `expired_handle`, `live=false`,
/// `table`) never cause an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_13_extra_protocol_params_tolerated() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let run = srv.run(&env, RunSpec::default()).await;
    let url = run_url(&run.friendly_id)
        .q("log", "full")
        .q("cursor", "")
        .q("expired_handle", "x")
        .q("live", "false")
        .q("table", "TaskRun")
        .q("offset", "-1");
    let r = srv.fetch(&url, &modern(&env.api_key)).await;
    assert_feed_headers(&r, true);
    assert_eq!(r.ops(), vec![op("insert", &run.id)]);
}

// ---------------------------------------------------------------------------------------------
// Tag feed
// ---------------------------------------------------------------------------------------------

/// TAG-03, LST-01: contains-ALL — a run with only tag `a` is not in `tags=a,b`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_03_contains_all_requested_tags() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let ab = srv.tagged_run(&env, &["a", "b"]).await;
    let abc = srv.tagged_run(&env, &["c", "b", "a"]).await;
    let a_only = srv.tagged_run(&env, &["a"]).await;
    let _untagged = srv.run(&env, RunSpec::default()).await;
    let r = srv
        .fetch(&tag_url("a,b").snapshot(), &modern(&env.api_key))
        .await;
    assert_feed_headers(&r, true);
    let ids: Vec<String> = sorted(r.ops()).into_iter().map(|(_, id)| id).collect();
    let mut want = vec![ab.id.clone(), abc.id.clone()];
    want.sort();
    assert_eq!(ids, want);
    assert!(r.row(&a_only.id).is_none());
    // The single tag "a,b" (percent-encoded comma would still split: trigger splits the decoded
    // value) — tags=a alone includes all three tagged runs.
    let a = srv
        .fetch(&tag_url("a").snapshot(), &modern(&env.api_key))
        .await;
    assert_eq!(a.changes().len(), 3, "{}", a.text);
}

/// TAG-01: the `createdAt` lookback floor — a run created 2 h ago is not in `createdAt=1h`, but
/// is in the default 24 h window and in `createdAt=3h`; older than 24 h is never included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_01_created_at_floor_excludes_older_runs() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let now = runfeed::clock::now_ms();
    let fresh = srv.run(&env, tagged_aged(&["f"], now, 5 * 60_000)).await;
    let two_h = srv.run(&env, tagged_aged(&["f"], now, 2 * 3_600_000)).await;
    let two_days = srv
        .run(&env, tagged_aged(&["f"], now, 48 * 3_600_000))
        .await;
    let h = modern(&env.api_key);
    let window = |created_at: &str| tag_url("f").q("createdAt", created_at).snapshot();

    let one_h = srv.fetch(&window("1h"), &h).await;
    assert_feed_headers(&one_h, true);
    assert_eq!(ids_of(&one_h), vec![fresh.id.clone()]);

    let default = srv.fetch(&tag_url("f").snapshot(), &h).await;
    assert_eq!(ids_of(&default), vec![fresh.id.clone(), two_h.id.clone()]);

    let three_h = srv.fetch(&window("3h"), &h).await;
    assert_eq!(ids_of(&three_h), vec![fresh.id.clone(), two_h.id.clone()]);

    let week = srv.fetch(&window("1w"), &h).await;
    assert!(
        week.row(&two_days.id).is_none(),
        "clamped to the 24 h maximum age"
    );
}

/// ROUTE-02, docs/trigger-dev.md §3: an empty tag or one with `"`, `\` or a control character → 400
/// for modern clients, 422 for legacy clients (which loop on 400); JSON `{"error":…}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_02_bad_tag_is_400_modern_422_legacy() {
    let (srv, env) = TestServer::with_env(1_500).await;
    for bad in ["a,,b", "a,", ",a", "a\"b", "a\\b", "a\u{1}b", "a\u{7f}"] {
        let url = tag_url(bad).snapshot();
        srv.assert_bad_input(&url, &env.api_key, &format!("{bad:?}"))
            .await;
    }
    // Single quotes and non-ASCII are fine.
    let ok = srv
        .fetch(&tag_url("it's,ünï").snapshot(), &modern(&env.api_key))
        .await;
    ok.assert_status(200);
}

/// Bad `createdAt` (not the duration grammar) → 400 modern / 422 legacy (scenario 17).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_01_bad_created_at_is_400_modern_422_legacy() {
    let (srv, env) = TestServer::with_env(1_500).await;
    for bad in ["abc", "1y", "1.5h", "1 h", "-1h", "1H"] {
        let url = tag_url("a").q("createdAt", bad).snapshot();
        srv.assert_bad_input(&url, &env.api_key, &format!("createdAt={bad}"))
            .await;
    }
    for good in ["1hr30m", "90m", "1w2d", "0h", "30s"] {
        srv.fetch(
            &tag_url("a").q("createdAt", good).snapshot(),
            &modern(&env.api_key),
        )
        .await
        .assert_status(200);
    }
}

/// TAG-07, docs/trigger-dev.md §2.5: no `tags` = every run of the environment inside the window; a
/// `read:tags` token grants it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_07_unfiltered_tag_feed_with_read_tags_token() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let other_env = srv.env().await;
    let r1 = srv.tagged_run(&env, &["a"]).await;
    let r2 = srv.run(&env, RunSpec::default()).await;
    let foreign = srv.tagged_run(&other_env, &["a"]).await;
    let tok = srv.token(&env, &["read:tags"]);
    let r = srv
        .fetch(&Url::new("/realtime/v1/runs").snapshot(), &modern(&tok))
        .await;
    assert_feed_headers(&r, true);
    let ids: Vec<String> = sorted(r.ops()).into_iter().map(|(_, id)| id).collect();
    let want = sorted(vec![op("insert", &r1.id), op("insert", &r2.id)]);
    assert_eq!(ids, want.into_iter().map(|(_, id)| id).collect::<Vec<_>>());
    assert!(
        !r.text.contains(&foreign.id),
        "other environment's run leaked"
    );
    // `tags=` (empty) is the same unfiltered feed.
    let e = srv.fetch(&tag_url("").snapshot(), &modern(&tok)).await;
    assert_eq!(e.changes().len(), 2);
}

/// Scenario 22: while a live poll on `tags=a,b` is held, a new run tagged `a` and `b` arrives
/// as `insert`; a run tagged only `a` never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_22_new_run_with_all_tags_arrives_as_insert_partial_match_never() {
    let (srv, env) = TestServer::uncoalesced_with_env(2_000).await;
    let existing = srv.tagged_run(&env, &["a", "b"]).await;
    let h = modern(&srv.token(&env, &["read:tags:b"]));
    let url = tag_url("a,b");
    let snap = srv.fetch(&url.snapshot(), &h).await;
    assert_eq!(snap.ops(), vec![op("insert", &existing.id)]);
    srv.wait_subscribed(&env.env_id).await;

    let poll = srv.fetch(&url.live_after(&snap), &h);
    let create = async {
        srv.wait_held("held", |h| h.1 == 1).await;
        // The partial match first: if it were wrongly delivered it would be in this response.
        let only_a = srv.tagged_run(&env, &["a"]).await;
        srv.publish_created(&env, &only_a, &["a"]).await;
        let both = srv.tagged_run(&env, &["b", "a"]).await;
        srv.publish_created(&env, &both, &["b", "a"]).await;
        (only_a, both)
    };
    let (r, (only_a, both)) = tokio::join!(poll, create);
    assert_feed_headers(&r, false);
    assert_eq!(r.ops(), vec![op("insert", &both.id)], "{}", r.text);
    assert!(
        r.elapsed < Duration::from_millis(1_900),
        "the insert must wake the poll: {:?}",
        r.elapsed
    );

    // Next poll: the partial match never arrives, unchanged runs are not re-sent.
    let next = srv.fetch(&url.live_after(&r), &h).await;
    assert_quiet_hold(&next, Duration::ZERO, "the poll after the insert");
    assert!(!next.text.contains(&only_a.id));
}

// ---------------------------------------------------------------------------------------------
// Batch feed
// ---------------------------------------------------------------------------------------------

/// BAT-02, scenario 23: two subscribers of the same batch get distinct handles and both
/// receive a change (one subscriber's delivery never suppresses the other's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_23_two_batch_subscribers_both_receive_change() {
    let (srv, env) = TestServer::with_env(10_000).await;
    let (batch_id, batch_fid) = srv.batch(&env).await;
    let r1 = srv.batch_run(&env, &batch_id).await;
    let r2 = srv.batch_run(&env, &batch_id).await;
    let _outside = srv.run(&env, RunSpec::default()).await;
    let h = modern(&srv.token(&env, &[&format!("read:batch:{batch_fid}")]));
    let url = batch_url(&batch_fid);
    let s1 = srv.fetch(&url.snapshot(), &h).await;
    let s2 = srv.fetch(&url.snapshot(), &h).await;
    assert_feed_headers(&s1, true);
    assert_eq!(
        sorted(s1.ops()),
        sorted(vec![op("insert", &r1.id), op("insert", &r2.id)])
    );
    assert_eq!(sorted(s2.ops()), sorted(s1.ops()));
    assert_ne!(
        s1.handle(),
        s2.handle(),
        "subscribers of one batch must not share a handle"
    );
    srv.wait_subscribed(&env.env_id).await;

    let change = srv.change(&env, &r2.id, &[], Some(&batch_id), "COMPLETED_SUCCESSFULLY");
    let live = [url.live_at(&s1), url.live_at(&s2)];
    let ([a, b], ms) = srv.polls_during(live, &h, |h| h.2 == 2, change).await;
    for (name, r, s) in [("first", &a, &s1), ("second", &b, &s2)] {
        assert_woken_by_update(r, &r2.id, Duration::from_millis(5_000), name);
        let status = &r.row(&r2.id).unwrap()["value"]["status"];
        assert_eq!(status, "COMPLETED_SUCCESSFULLY");
        assert_eq!(r.offset_ms(), ms);
        assert_eq!(r.handle(), s.handle());
    }
}

/// ROUTE-03: an unknown batch (or another environment's) → 404 with `x-should-retry: true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_03_unknown_batch_is_404_should_retry() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let other = srv.env().await;
    let (_, foreign_fid) = srv.batch(&other).await;
    for fid in ["batch_doesnotexist000000000", foreign_fid.as_str()] {
        let r = srv
            .fetch(&batch_url(fid).snapshot(), &modern(&env.api_key))
            .await;
        r.assert_status(404);
        assert_eq!(r.json, json!({"error": "Not found"}));
        assert_eq!(r.header("x-should-retry"), Some("true"));
    }
}

// ---------------------------------------------------------------------------------------------
// Handles
// ---------------------------------------------------------------------------------------------

/// docs/behaviours.md §5.1 item 3, scenario 15: a handle minted for env A's tag feed presented with env B's
/// token → 409 must-refetch; the body carries neither A's nor B's rows; the refetch with the new
/// handle returns B's rows only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_15_handle_of_env_a_with_token_of_env_b_is_409() {
    let srv = TestServer::start(1_500).await;
    let env_a = srv.env().await;
    let env_b = srv.env().await;
    let run_a = srv.tagged_run(&env_a, &["s"]).await;
    let run_b = srv.tagged_run(&env_b, &["s"]).await;
    let url = tag_url("s");
    let snap_a = srv
        .fetch(&url.snapshot(), &modern(&srv.token(&env_a, &["read:runs"])))
        .await;
    assert_eq!(snap_a.ops(), vec![op("insert", &run_a.id)]);
    let hb = modern(&srv.token(&env_b, &["read:runs"]));

    for req in [
        url.live(&snap_a.handle(), &snap_a.offset(), Some("1")),
        url.catch_up(&snap_a.handle(), &snap_a.offset()),
    ] {
        let r = srv.fetch(&req, &hb).await;
        assert_must_refetch(&r, "A's handle with B's token");
        assert!(!r.text.contains(&run_a.id) && !r.text.contains(&run_b.id));
        let fresh = r.handle();
        assert_ne!(fresh, snap_a.handle());
        let refetch = srv
            .fetch(
                &url.clone()
                    .q("expired_handle", &snap_a.handle())
                    .q("handle", &fresh)
                    .q("log", "full")
                    .q("offset", "-1"),
                &hb,
            )
            .await;
        assert_feed_headers(&refetch, true);
        assert_eq!(
            refetch.ops(),
            vec![op("insert", &run_b.id)],
            "B sees only B's rows"
        );
    }

    // Same for a run feed handle of A presented on B's run with B's token.
    let ra = srv
        .fetch(
            &run_url(&run_a.friendly_id).snapshot(),
            &modern(&env_a.api_key),
        )
        .await;
    let r = srv
        .fetch(&run_url(&run_b.friendly_id).live_at(&ra), &hb)
        .await;
    r.assert_status(409);
    assert!(!r.text.contains(&run_a.id) && !r.text.contains(&run_b.id));
}

/// Scenario 11, docs/protocol.md §5.2: an unknown or tampered handle at offset ≠ -1 → 409,
/// `content-type: application/json`, body `[must-refetch]`, a fresh `electric-handle`; the
/// refetch `offset=-1&handle=<new>&expired_handle=<old>` → 200 (not another 409).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_11_unknown_handle_is_409_must_refetch() {
    let srv = TestServer::start(1_500).await;
    let snapshots = srv.run_and_tag_snapshots("u", modern).await;
    let (run, h) = (&snapshots.run, &snapshots.headers);
    for (url, snap) in &snapshots.feeds {
        let good = snap.handle();
        // Tamper with one payload character.
        let mut bytes = good.clone().into_bytes();
        let i = 4;
        bytes[i] = if bytes[i] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(bytes).unwrap();
        for bad in ["bogus", tampered.as_str()] {
            let r = srv
                .fetch(
                    &url.clone()
                        .q("offset", "5_0")
                        .q("handle", bad)
                        .q("live", "true")
                        .q("cursor", "x"),
                    h,
                )
                .await;
            r.assert_status(409);
            assert_eq!(r.header("content-type"), Some("application/json"));
            assert_eq!(r.text, r#"[{"headers":{"control":"must-refetch"}}]"#);
            let fresh = r.handle();
            assert!(!fresh.is_empty() && fresh != bad);
            assert!(
                r.header("access-control-expose-headers").is_some(),
                "409 handle must be exposed"
            );
            let refetch = srv
                .fetch(
                    &url.clone()
                        .q("offset", "-1")
                        .q("handle", &fresh)
                        .q("expired_handle", bad),
                    h,
                )
                .await;
            assert_feed_headers(&refetch, true);
            assert_eq!(refetch.ops(), vec![op("insert", &run.id)]);
            // …and the refetched handle resumes.
            let resume = srv
                .fetch(&url.catch_up(&refetch.handle(), &refetch.offset()), h)
                .await;
            assert_feed_headers(&resume, true);
        }
    }
}

/// Scenario 12: `offset=-1` with a stale handle is an initial snapshot (200), not 400/409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_12_initial_request_with_stale_handle_is_snapshot() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let (run, _, batch_fid) = srv.batched_run(&env, &["z"]).await;
    for url in feed_urls(&run.friendly_id, "z", &batch_fid) {
        let r = srv
            .fetch(
                &url.clone()
                    .q("offset", "-1")
                    .q("handle", "old")
                    .q("expired_handle", "older"),
                &modern(&env.api_key),
            )
            .await;
        assert_feed_headers(&r, true);
        assert_eq!(r.ops(), vec![op("insert", &run.id)], "{}", url.path);
        assert_ne!(r.handle(), "old");
    }
}

/// Scenario 17: `offset=abc` → 400; an offset other than -1 without a handle → 400; both 422
/// for legacy clients (no `x-trigger-electric-version`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_17_malformed_offset_and_offset_without_handle() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let (_, batch_fid) = srv.batch(&env).await;
    let run = srv.tagged_run(&env, &["o"]).await;
    for url in feed_urls(&run.friendly_id, "o", &batch_fid) {
        let snap = srv.fetch(&url.snapshot(), &modern(&env.api_key)).await;
        for (req, what) in [
            (
                url.clone().q("offset", "abc").q("handle", &snap.handle()),
                "offset=abc",
            ),
            // (`offset=now` is valid since the 1.5 client: tests/it/electric_current.rs.)
            (
                url.clone().q("offset", "later").q("handle", &snap.handle()),
                "offset=later",
            ),
            (
                url.clone().q("offset", &snap.offset()),
                "offset without handle",
            ),
            (
                url.clone().q("offset", &snap.offset()).q("live", "true"),
                "live offset without handle",
            ),
        ] {
            let what = format!("{} {what}", url.path);
            srv.assert_bad_input(&req, &env.api_key, &what).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Auth
// ---------------------------------------------------------------------------------------------

/// Scenario 14, docs/trigger-dev.md §2.2–2.3: no token, malformed, expired, wrong signature → 401 JSON
/// `{"error": …}` with CORS headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_14_missing_malformed_expired_wrong_signature_are_401() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let run = srv.run(&env, RunSpec::default()).await;
    let scopes = ["read:runs"];
    let expired = mint(&env.api_key, &env.env_id, &scopes, Duration::ZERO);
    let wrong_sig = mint(
        "tr_dev_notthekey000000000000",
        &env.env_id,
        &scopes,
        TOKEN_TTL,
    );
    let origin = ("origin".to_string(), "https://app.example".to_string());
    let version = (
        "x-trigger-electric-version".to_string(),
        ELECTRIC_VERSION.to_string(),
    );
    let cases: Vec<(Option<String>, &str)> = vec![
        (None, "Invalid or Missing API key"),
        // HTTP strips trailing whitespace from header values: `Bearer ` arrives as `Bearer`,
        // a non-empty key (as behind Node's parser in trigger.dev).
        (Some("Bearer ".into()), "Invalid API key"),
        (Some("Bearer    ".into()), "Invalid API key"),
        (Some("Bearer garbage".into()), "Invalid API key"),
        (Some("Bearer a.b.c".into()), "Invalid API key"),
        (
            Some(format!("Bearer {expired}")),
            "Public Access Token is invalid",
        ),
        (
            Some(format!("Bearer {wrong_sig}")),
            "Public Access Token is invalid",
        ),
        (Some(format!("Bearer {}x", env.api_key)), "Invalid API key"),
    ];
    for url in feed_urls(&run.friendly_id, "a", "batch_x") {
        for (auth, message) in &cases {
            let mut h = vec![origin.clone(), version.clone()];
            if let Some(a) = auth {
                h.push(("authorization".into(), a.clone()));
            }
            let r = srv.fetch(&url.snapshot(), &h).await;
            assert_eq!(r.status, 401, "{} {auth:?}: {}", url.path, r.text);
            assert_eq!(r.json, json!({"error": message}), "{} {auth:?}", url.path);
            assert!(r
                .header("content-type")
                .unwrap_or("")
                .contains("application/json"));
            assert_eq!(
                r.header("access-control-allow-origin"),
                Some("*"),
                "CORS on 401"
            );
        }
    }
}

/// Secret (root) keys read every feed (permissive ability).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_secret_key_reads_every_feed() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let (run, _, batch_fid) = srv.batched_run(&env, &["k"]).await;
    for url in [
        run_url(&run.friendly_id),
        tag_url("k"),
        Url::new("/realtime/v1/runs"),
        batch_url(&batch_fid),
    ] {
        let r = srv.fetch(&url.snapshot(), &modern(&env.api_key)).await;
        assert_feed_headers(&r, true);
        assert_eq!(r.ops(), vec![op("insert", &run.id)], "{}", url.path);
    }
}

/// Scenario 15, docs/trigger-dev.md §2.1: env A's credentials for env B's run → 404 (the lookup is
/// scoped to the authenticated environment), with no row data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_15_token_of_env_a_for_run_of_env_b_is_404() {
    let srv = TestServer::start(1_500).await;
    let env_a = srv.env().await;
    let env_b = srv.env().await;
    let run_b = srv.run(&env_b, RunSpec::default()).await;
    for cred in [
        srv.token(&env_a, &["read:runs"]),
        srv.run_token(&env_a, &run_b),
        env_a.api_key.clone(),
    ] {
        let r = srv
            .fetch(&run_url(&run_b.friendly_id).snapshot(), &modern(&cred))
            .await;
        r.assert_status(404);
        assert_eq!(r.json, json!({"error": "Not found"}));
        assert!(!r.text.contains(&run_b.id));
    }
}

/// Scenario 15, docs/trigger-dev.md §2.1 step 7: a JWT scoped to another run → 403 with trigger's body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_15_jwt_scoped_to_another_run_is_403() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let [r1, r2] = srv.default_runs(&env).await;
    let tok = srv.run_token(&env, &r2);
    let r = srv
        .fetch(&run_url(&r1.friendly_id).snapshot(), &modern(&tok))
        .await;
    r.assert_status(403);
    assert_eq!(
        r.json,
        json!({"error": "Unauthorized", "code": "unauthorized", "param": "access_token", "type": "authorization"})
    );
    assert!(!r.text.contains(&r1.id));
    srv.fetch(&run_url(&r2.friendly_id).snapshot(), &modern(&tok))
        .await
        .assert_status(200);
}

/// docs/trigger-dev.md §2.4–2.5: which scopes grant the run, tag and batch routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_scope_matrix_for_run_tag_and_batch_routes() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let (batch_id, batch_fid) = srv.batch(&env).await;
    let spec = RunSpec {
        task_identifier: "my-task".into(),
        ..tagged_in_batch(&["a", "b"], &batch_id)
    };
    let run = srv.run(&env, spec).await;
    let other = srv.run(&env, RunSpec::default()).await;
    let (_, other_batch) = srv.batch(&env).await;
    let rf = run.friendly_id.clone();
    // In the scopes below, {run}, {batch}, {other_run} and {other_batch} stand for the ids.
    let ids = |scope: &str| {
        scope
            .replace("{run}", &rf)
            .replace("{batch}", &batch_fid)
            .replace("{other_run}", &other.friendly_id)
            .replace("{other_batch}", &other_batch)
    };
    let run_route = run_url(&rf);
    let tag_route = tag_url("a,b");
    let list = Url::new("/realtime/v1/runs");
    let batch_route = batch_url(&batch_fid);

    for (url, scope, want) in [
        // Run route (ROUTE-01).
        (&run_route, "read:runs:{run}", 200),
        (&run_route, "read:runs", 200),
        (&run_route, "read:tasks", 200),
        (&run_route, "read:tasks:my-task", 200),
        (&run_route, "read:tags", 200),
        (&run_route, "read:tags:b", 200),
        (&run_route, "read:batch", 200),
        (&run_route, "read:batch:{batch}", 200),
        (&run_route, "read:all", 200),
        (&run_route, "admin", 200),
        (&run_route, "read:runs:{other_run}", 403),
        (&run_route, "read:tasks:other-task", 403),
        (&run_route, "read:tags:c", 403),
        (&run_route, "read:batch:{other_batch}", 403),
        (&run_route, "write:runs", 403),
        (&run_route, "read", 403),
        (&run_route, "admin:runs", 403),
        // Tag route (ROUTE-02): runs, type-level tags, or one of the filter's tags.
        (&tag_route, "read:runs", 200),
        (&tag_route, "read:tags", 200),
        (&tag_route, "read:tags:a", 200),
        (&tag_route, "read:tags:b", 200),
        (&tag_route, "read:all", 200),
        (&tag_route, "admin", 200),
        (&tag_route, "read:tags:c", 403),
        (&tag_route, "read:runs:{run}", 403),
        (&tag_route, "read:tasks", 403),
        (&tag_route, "read:batch", 403),
        (&tag_route, "write:tags", 403),
        // Unfiltered list: read:tags or read:runs; a tag-scoped token does not grant it.
        (&list, "read:tags", 200),
        (&list, "read:runs", 200),
        (&list, "read:tags:a", 403),
        (&list, "read:runs:{run}", 403),
        // Batch route (ROUTE-03): batch (type or id) or runs.
        (&batch_route, "read:batch", 200),
        (&batch_route, "read:batch:{batch}", 200),
        (&batch_route, "read:runs", 200),
        (&batch_route, "read:all", 200),
        (&batch_route, "read:batch:{other_batch}", 403),
        (&batch_route, "read:runs:{run}", 403),
        (&batch_route, "read:tags", 403),
        (&batch_route, "read:tasks", 403),
    ] {
        let scope = ids(scope);
        let tok = srv.token(&env, &[scope.as_str()]);
        let r = srv.fetch(&url.snapshot(), &modern(&tok)).await;
        let what = format!("{} with scope {scope:?}", url.render());
        assert_eq!(r.status, want, "{what}: {}", r.text);
    }
}

/// docs/trigger-dev.md §2.1: the check order is authenticate (401) → parse (400) → find (404) →
/// scopes (403).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_order_401_then_400_then_404_then_403() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let [run, elsewhere] = srv.default_runs(&env).await;
    let scoped = modern(&srv.run_token(&env, &elsewhere));
    let unknown = run_url("run_unknown000000000000000");
    let bad_offset = unknown.clone().q("offset", "abc");
    let batch_scope = modern(&srv.token(&env, &["read:batch"]));
    let unknown_batch = batch_url("batch_unknown00000000000000").snapshot();
    for (what, url, headers, status) in [
        (
            "bad credentials beat everything",
            &bad_offset,
            &modern("garbage"),
            401,
        ),
        ("then parsing beats the lookup", &bad_offset, &scoped, 400),
        (
            "… on the tag route too",
            &tag_url("a,,b").q("offset", "abc"),
            &batch_scope,
            400,
        ),
        (
            "then the lookup beats the scope check",
            &unknown.snapshot(),
            &scoped,
            404,
        ),
        ("… on the batch route too", &unknown_batch, &scoped, 404),
        (
            "finally scopes",
            &run_url(&run.friendly_id).snapshot(),
            &scoped,
            403,
        ),
    ] {
        let r = srv.fetch(url, headers).await;
        assert_eq!(r.status, status, "{what}: {}", r.text);
    }
}

// ---------------------------------------------------------------------------------------------
// Legacy clients and API versions
// ---------------------------------------------------------------------------------------------

/// HDR-02, scenario 25: without `x-trigger-electric-version` the handle/offset go out as
/// `electric-shape-id` / `electric-chunk-last-offset` (never the modern names), and `shape_id`
/// is accepted as the handle parameter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hdr_02_legacy_client_gets_shape_id_and_chunk_last_offset() {
    let srv = TestServer::start(1_500).await;
    let RunAndTagSnapshots {
        run,
        headers: h,
        feeds,
        ..
    } = srv.run_and_tag_snapshots("l", legacy).await;
    for (url, snap) in feeds {
        snap.assert_status(200);
        let shape_id = snap
            .header("electric-shape-id")
            .expect("electric-shape-id")
            .to_string();
        let offset = snap
            .header("electric-chunk-last-offset")
            .expect("electric-chunk-last-offset")
            .to_string();
        assert!(
            !snap.has("electric-handle") && !snap.has("electric-offset"),
            "{:?}",
            snap.headers
        );
        assert!(snap.has("electric-schema"));
        assert!(
            snap.has("electric-chunk-up-to-date"),
            "0.6.3 prefetcher stops on electric-chunk-up-to-date"
        );
        assert!(snap.ends_up_to_date());
        assert_eq!(snap.ops(), vec![op("insert", &run.id)]);

        // `shape_id` is the handle: catch-up …
        let catch_up = srv
            .fetch(
                &url.clone().q("offset", &offset).q("shape_id", &shape_id),
                &h,
            )
            .await;
        catch_up.assert_status(200);
        assert_eq!(
            catch_up.header("electric-shape-id"),
            Some(shape_id.as_str())
        );
        // … and live (held to the timeout).
        let live = srv
            .fetch(
                &url.clone()
                    .q("offset", &offset)
                    .q("shape_id", &shape_id)
                    .q("live", "true"),
                &h,
            )
            .await;
        live.assert_status(200);
        assert!(live.is_bare_up_to_date(), "{}", live.text);
        assert!(live.has("electric-cursor"));
        assert!(live.has("electric-chunk-last-offset") && !live.has("electric-offset"));
        // A bogus shape_id → 409 with the new handle under the legacy name.
        let conflict = srv
            .fetch(&url.clone().q("offset", &offset).q("shape_id", "bogus"), &h)
            .await;
        conflict.assert_status(409);
        assert!(conflict.has("electric-shape-id") && !conflict.has("electric-handle"));
    }
}

/// HDR-04: a missing or old `x-trigger-api-version` rewrites `"status":"DEQUEUED"` to
/// `EXECUTING` (not inside string columns); the current version `2025-07-16` keeps `DEQUEUED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hdr_04_legacy_api_version_rewrites_dequeued() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let meta = r#"{"status":"DEQUEUED"}"#;
    let spec = RunSpec {
        status: "DEQUEUED".into(),
        metadata: Some(meta.into()),
        ..tagged(&["d"])
    };
    let run = srv.run(&env, spec).await;
    for url in [run_url(&run.friendly_id), tag_url("d")] {
        for (version, want) in [
            (None, "EXECUTING"),
            (Some("2024-01-01"), "EXECUTING"),
            (Some(CURRENT_API_VERSION), "DEQUEUED"),
        ] {
            let mut h = modern(&env.api_key);
            if let Some(v) = version {
                h = with(h, "x-trigger-api-version", v);
            }
            let r = srv.fetch(&url.snapshot(), &h).await;
            r.assert_status(200);
            let row = r.row(&run.id).expect("row");
            assert_eq!(
                row["value"]["status"], want,
                "{} api version {version:?}",
                url.path
            );
            assert_eq!(
                row["value"]["metadata"], meta,
                "string columns are never rewritten"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// skipColumns
// ---------------------------------------------------------------------------------------------

/// REQ-01, SER-08, scenario 24: `skipColumns` removes columns from the values and the schema
/// header; entries are trimmed; reserved columns (id, taskIdentifier, friendlyId, status,
/// createdAt) are never skipped; unknown names are ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn req_01_skip_columns_param_removes_columns_from_value_and_schema() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let run = srv.tagged_run(&env, &["s"]).await;
    let skip = "payload, output,id,status,createdAt,taskIdentifier,friendlyId,nope, metadata ";
    for url in [run_url(&run.friendly_id), tag_url("s")] {
        let r = srv
            .fetch(
                &url.clone().q("skipColumns", skip).snapshot(),
                &modern(&env.api_key),
            )
            .await;
        assert_feed_headers(&r, true);
        let value = r.row(&run.id).expect("row")["value"]
            .as_object()
            .unwrap()
            .clone();
        let schema = r.schema();
        for gone in ["payload", "output", "metadata"] {
            assert!(!value.contains_key(gone), "{gone} in value");
            assert!(schema.get(gone).is_none(), "{gone} in schema");
        }
        for kept in "id status createdAt taskIdentifier friendlyId updatedAt runTags".split(' ') {
            assert!(value.contains_key(kept), "{kept} missing from value");
            assert!(schema.get(kept).is_some(), "{kept} missing from schema");
        }
        assert_eq!(value.len(), 23);
        assert_eq!(schema.as_object().unwrap().len(), 23);
    }
}

/// REQ-01, docs/trigger-dev.md §3: the JWT's `realtime.skipColumns` claim — present, even `[]` —
/// REPLACES the URL parameter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn req_01_skip_columns_from_claim_replace_param() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let run = srv.run(&env, RunSpec::default()).await;
    let url = run_url(&run.friendly_id).q("skipColumns", "payload");

    let claim = srv.token_skip(&env, &["read:runs"], &["metadata", "id"]);
    let r = srv.fetch(&url.snapshot(), &modern(&claim)).await;
    assert_feed_headers(&r, true);
    let v = &r.row(&run.id).unwrap()["value"];
    assert!(
        v.get("payload").is_some(),
        "the claim replaces the param: payload kept"
    );
    assert!(v.get("metadata").is_none(), "claim's column skipped");
    assert!(v.get("id").is_some(), "reserved column kept");
    assert!(r.schema().get("metadata").is_none() && r.schema().get("payload").is_some());

    let empty_claim = srv.token_skip(&env, &["read:runs"], &[]);
    let r = srv.fetch(&url.snapshot(), &modern(&empty_claim)).await;
    assert!(
        r.row(&run.id).unwrap()["value"].get("payload").is_some(),
        "an empty claim still replaces the param"
    );
    assert_eq!(r.schema().as_object().unwrap().len(), 26);

    let no_claim = srv.token(&env, &["read:runs"]);
    let r = srv.fetch(&url.snapshot(), &modern(&no_claim)).await;
    assert!(
        r.row(&run.id).unwrap()["value"].get("payload").is_none(),
        "without a claim the param applies"
    );
}

/// A handle is bound to its column set: resuming it with other `skipColumns` → 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn req_01_changing_skip_columns_under_a_handle_is_409() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let run = srv.tagged_run(&env, &["q"]).await;
    let url = tag_url("q");
    let h = modern(&env.api_key);
    let snap = srv
        .fetch(&url.clone().q("skipColumns", "payload").snapshot(), &h)
        .await;
    // Other columns → 409 (and no rows); the same columns resume.
    for (skip, status) in [("output", 409), ("payload", 200)] {
        let resume = url
            .clone()
            .q("skipColumns", skip)
            .q("handle", &snap.handle())
            .q("offset", &snap.offset());
        let r = srv.fetch(&resume, &h).await;
        r.assert_status(status);
        if status == 409 {
            assert!(!r.text.contains(&run.id));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// CORS
// ---------------------------------------------------------------------------------------------

/// Scenario 27, docs/protocol.md §6: the preflight succeeds and allows GET and the SDK's headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_27_cors_preflight_allows_sdk_headers() {
    let srv = TestServer::start(1_500).await;
    let requested = "authorization, trigger-version, x-trigger-electric-version, x-trigger-api-version, x-trigger-branch";
    for path in [
        "/realtime/v1/runs/run_x",
        "/realtime/v1/runs?tags=a",
        "/realtime/v1/batches/batch_x",
    ] {
        let h = vec![
            ("origin".to_string(), "https://app.example".to_string()),
            (
                "access-control-request-method".to_string(),
                "GET".to_string(),
            ),
            (
                "access-control-request-headers".to_string(),
                requested.to_string(),
            ),
        ];
        let r = srv.request(reqwest::Method::OPTIONS, path, &h).await;
        assert!(
            (200..300).contains(&r.status),
            "{path}: preflight status {}",
            r.status
        );
        let origin = r
            .header("access-control-allow-origin")
            .expect("allow-origin");
        assert!(origin == "*" || origin == "https://app.example");
        let methods = r
            .header("access-control-allow-methods")
            .expect("allow-methods")
            .to_ascii_uppercase();
        assert!(methods.contains("GET") || methods == "*", "{methods}");
        let allowed = r
            .header("access-control-allow-headers")
            .expect("allow-headers")
            .to_ascii_lowercase();
        for name in requested.split(", ") {
            assert!(
                allowed == "*" || allowed.contains(name),
                "{path}: {name} not allowed by {allowed:?}"
            );
        }
    }
}

/// HDR-01, scenario 27: every GET response (200, 400, 401, 403, 404, 409) carries
/// `access-control-allow-origin` and exposes the electric headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hdr_01_every_get_response_has_cors_headers() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let [run, other] = srv.default_runs(&env).await;
    let scoped = srv.run_token(&env, &other);
    let url = run_url(&run.friendly_id);
    type Case = (Url, Vec<(String, String)>, u16);
    let cases: Vec<Case> = vec![
        (url.snapshot(), modern(&env.api_key), 200),
        (url.clone().q("offset", "abc"), modern(&env.api_key), 400),
        (url.snapshot(), modern("garbage"), 401),
        (url.snapshot(), modern(&scoped), 403),
        (
            run_url("run_nope000000000000000000").snapshot(),
            modern(&env.api_key),
            404,
        ),
        (
            url.clone().q("offset", "1_1").q("handle", "bogus"),
            modern(&env.api_key),
            409,
        ),
        (Url::new("/nowhere"), modern(&env.api_key), 404),
    ];
    for with_origin in [true, false] {
        for (u, h, status) in &cases {
            let mut h = h.clone();
            if with_origin {
                h.push(("origin".into(), "https://app.example".into()));
            }
            let r = srv.fetch(u, &h).await;
            assert_eq!(r.status, *status, "{}: {}", u.render(), r.text);
            assert_eq!(
                r.header("access-control-allow-origin"),
                Some("*"),
                "{} (origin sent: {with_origin})",
                u.render()
            );
            let expose = r
                .header("access-control-expose-headers")
                .unwrap_or_else(|| panic!("{}: no expose-headers", u.render()));
            assert!(
                expose == "*" || expose.contains("electric-handle"),
                "{expose}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Disconnects
// ---------------------------------------------------------------------------------------------

/// Scenario 20, docs/protocol.md §4.7, docs/behaviours.md §5.1 item 4: a client that goes away mid-poll releases
/// the held feed (router index) within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_20_client_disconnect_frees_the_hold() {
    let srv = Arc::new(TestServer::start(20_000).await);
    let env = srv.env().await;
    let (run, _, batch_fid) = srv.batched_run(&env, &["g"]).await;
    let h = modern(&env.api_key);

    // Run feed: a client-side timeout of 300 ms.
    let snap = srv.fetch(&run_url(&run.friendly_id).snapshot(), &h).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let live = run_url(&run.friendly_id).live_at(&snap).render();
    let req = with_headers(impatient.get(format!("{}{}", srv.base, live)), &h);
    let router = srv.running().router.clone();
    // Every hold released within a second of the client going away.
    let released = |what: &'static str| {
        let router = router.clone();
        async move {
            let t = Instant::now();
            let gone = || router.held_feeds() == (0, 0, 0);
            wait_until(Duration::from_secs(1), what, gone).await;
            println!("scenario_20: {what} {:?}", t.elapsed());
        }
    };
    let probe = {
        let srv = srv.clone();
        async move {
            srv.wait_held("run poll held", |h| h.0 == 1).await;
        }
    };
    let (result, ()) = within(WAIT, "impatient poll", async {
        tokio::join!(req.send(), probe)
    })
    .await;
    assert!(
        result.is_err(),
        "the poll should have timed out client-side"
    );
    released("run hold released after the client timed out").await;

    // Tag and batch feeds: the polling task is aborted.
    let mut tasks = Vec::new();
    for url in [tag_url("g"), batch_url(&batch_fid)] {
        let snap = srv.fetch(&url.snapshot(), &h).await;
        tasks.push(spawn_fetch(&srv, &url.live_at(&snap), &h));
    }
    srv.wait_held("tag and batch polls held", |h| h == (0, 1, 1))
        .await;
    for t in &tasks {
        t.abort();
    }
    released("tag/batch holds released after abort").await;
}

// ---------------------------------------------------------------------------------------------
// Fan-out cost
// ---------------------------------------------------------------------------------------------

/// docs/behaviours.md §5.1 item 5: 1 000 held live tag feeds on the same tag (same column set) in one
/// environment; ONE change → every feed gets the row, and the store runs exactly ONE query
/// (one hydrate) for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fanout_1000_held_tag_feeds_cost_one_query_per_change() {
    const N: usize = 1_000;
    let test_started = Instant::now();
    let srv = Arc::new(
        TestServer::start_with(20_000, |c| {
            c.feeds.default_concurrency_limit = 100_000;
            c.caches.working_set_max_entries = 10_000;
        })
        .await,
    );
    let env = srv.env().await;
    let hot = srv.tagged_run(&env, &["hot"]).await;
    let _cold = srv.tagged_run(&env, &["hot", "other"]).await;
    let h = modern(&srv.token(&env, &["read:tags:hot"]));
    let url = tag_url("hot");

    // Subscribe the environment first (one snapshot touches it) so the 1 000 snapshots carry
    // cursors of a confirmed subscription and their live polls need no cold re-check.
    srv.fetch(&url.snapshot(), &h).await.assert_status(200);
    srv.wait_subscribed(&env.env_id).await;
    let store = srv.running().store.clone();

    // 1 000 snapshots, 32 at a time.
    use futures::stream::{self, StreamExt};
    let snaps: Vec<(String, String)> = within(Duration::from_secs(60), "1000 snapshots", async {
        stream::iter(0..N)
            .map(|_| {
                let srv = srv.clone();
                let h = h.clone();
                let url = url.clone();
                async move {
                    let r = srv.fetch(&url.snapshot(), &h).await;
                    r.assert_status(200);
                    assert_eq!(r.changes().len(), 2);
                    (r.handle(), r.offset())
                }
            })
            .buffer_unordered(32)
            .collect()
            .await
    })
    .await;
    println!("fan-out: {N} snapshots in {:?}", test_started.elapsed());
    srv.wait_subscribed(&env.env_id).await;

    // 1 000 concurrent live polls.
    let polls_started = Instant::now();
    let queries_at_polls = store.query_count();
    let mut tasks = Vec::with_capacity(N);
    for (handle, offset) in snaps {
        let srv = srv.clone();
        let h = h.clone();
        let live = url.live(&handle, &offset, None);
        tasks.push(tokio::spawn(async move {
            let r = srv
                .get_with(&srv.http, &live.render(), &h, Duration::from_secs(60))
                .await;
            (r, Instant::now())
        }));
    }
    let router = srv.running().router.clone();
    wait_until(Duration::from_secs(30), "1000 tag feeds held", || {
        router.held_feeds().1 == N
    })
    .await;
    println!(
        "fan-out: {N} live polls held after {:?}",
        polls_started.elapsed()
    );

    // A poll counts as held once registered; an uncovered one (snapshot cursor predating the
    // subscription's confirmation) then runs a cold re-check. Let those finish before the
    // baseline: the query counter must stay unchanged for 200 ms.
    let settled = settle_queries(&store).await;
    println!(
        "fan-out: registering {N} live polls cost {} store queries (cold re-checks)",
        settled - queries_at_polls
    );
    let queries_before = store.query_count();
    let hydrates_before = srv.hydrates();
    let ms = srv.set_status(&hot.id, "EXECUTING").await;
    let record = TestServer::record(&env, &hot.id, &["hot"], None, ms);
    let published = Instant::now();
    srv.publish(&record).await;

    let mut done = Vec::with_capacity(N);
    for t in tasks {
        let (r, at) = within(Duration::from_secs(60), "fan-out response", t)
            .await
            .expect("poll task");
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.ops(), vec![op("update", &hot.id)], "{}", r.text);
        assert_eq!(r.row(&hot.id).unwrap()["value"]["status"], "EXECUTING");
        assert_eq!(r.offset_ms(), ms);
        done.push(at);
    }
    let first = done.iter().min().unwrap().duration_since(published);
    let last = done.iter().max().unwrap().duration_since(published);
    let queries = store.query_count() - queries_before;
    let hydrates = srv.hydrates() - hydrates_before;
    println!("fan-out: {N} feeds answered: first {first:?}, last {last:?} after publish; queries for the change: {queries}; hydrates: {hydrates}");
    assert_eq!(
        queries, 1,
        "store queries for one change fanned out to {N} feeds"
    );
    assert_eq!(hydrates, 1, "router hydrates for one change");
    assert!(
        test_started.elapsed() < Duration::from_secs(60),
        "fan-out test took {:?}",
        test_started.elapsed()
    );
}

// ---------------------------------------------------------------------------------------------
// Burst convergence
// ---------------------------------------------------------------------------------------------

/// Behaviours §4 items 1–2, architecture "fault tests": 50 random updates over several runs
/// while a tag feed and a batch feed are followed by a client loop (re-polling with the returned
/// handle/offset/cursor like the real client); the clients' views converge to the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn burst_50_updates_client_views_converge_to_db() {
    burst_converges(None).await;
}

/// The same burst with coalescing off: every record is routed on its own, so followers re-poll
/// many times and records regularly arrive while a follower is between polls (replay path).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn burst_50_updates_without_coalescing_client_views_converge_to_db() {
    burst_converges(Some(0)).await;
}

async fn burst_converges(coalesce_ms: Option<u64>) {
    use rand::Rng;
    // A 20 s hold: convergence (bounded at 10 s below) must come from the change stream, not
    // from backstop re-reads.
    let srv = Arc::new(
        TestServer::start_with(20_000, |c| {
            if let Some(ms) = coalesce_ms {
                c.router.coalesce_ceiling_ms = ms;
            }
        })
        .await,
    );
    let env = srv.env().await;
    let (batch_id, batch_fid) = srv.batch(&env).await;
    let mut runs = Vec::new();
    for _ in 0..6 {
        runs.push(srv.run(&env, tagged_in_batch(&["burst"], &batch_id)).await);
    }
    let headers = with(
        modern(&env.api_key),
        "x-trigger-api-version",
        CURRENT_API_VERSION,
    );

    // Followers: snapshot, then live-poll forever, publishing their view after each response.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut views = Vec::new();
    let mut followers = Vec::new();
    for url in [tag_url("burst"), batch_url(&batch_fid)] {
        let (view_tx, view_rx) =
            tokio::sync::watch::channel(HashMap::<String, (String, String)>::new());
        views.push(view_rx);
        let mut f = Follower::new(url, headers.clone());
        let srv = srv.clone();
        let mut stop = stop_rx.clone();
        followers.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            loop {
                let step = f.step(&srv.base, &client);
                tokio::select! {
                    r = step => {
                        r.unwrap_or_else(|e| panic!("follower of {}: {e}", f.url.path));
                        let view = f.view.iter().map(|(id, row)| {
                            (id.clone(), (row["status"].as_str().unwrap_or("").to_string(), row["updatedAt"].as_str().unwrap_or("").to_string()))
                        }).collect();
                        let _ = view_tx.send(view);
                    }
                    _ = stop.changed() => return f.responses,
                }
            }
        }));
    }
    // Both followers hold a live poll before the burst starts.
    srv.wait_held("both followers live", |h| h.1 == 1 && h.2 == 1)
        .await;

    let statuses = [
        "EXECUTING",
        "WAITING_TO_RESUME",
        "RETRYING_AFTER_FAILURE",
        "PAUSED",
        "COMPLETED_SUCCESSFULLY",
        "PENDING",
    ];
    let burst_started = Instant::now();
    for i in 0..50 {
        let (run_ix, status_ix, gap) = {
            let mut rng = rand::rng();
            (
                rng.random_range(0..runs.len()),
                rng.random_range(0..statuses.len()),
                rng.random_range(0..15u64),
            )
        };
        let run = &runs[run_ix];
        let ms = srv
            .update(
                &run.id,
                RunUpdate {
                    status: Some(statuses[status_ix].into()),
                    metadata: Some(format!("{{\"i\":{i}}}")),
                    ..RunUpdate::default()
                },
            )
            .await;
        srv.publish(&TestServer::record(
            &env,
            &run.id,
            &["burst"],
            Some(&batch_id),
            ms,
        ))
        .await;
        tokio::time::sleep(Duration::from_millis(gap)).await;
    }
    println!(
        "burst (coalesce {coalesce_ms:?}): 50 updates published in {:?}",
        burst_started.elapsed()
    );

    // Expected final state from the database.
    let mut expected = HashMap::new();
    for run in &runs {
        let query = sqlx::query_as::<_, (String, i64)>(
            r#"SELECT status::text, (extract(epoch from "updatedAt") * 1000)::int8 FROM "TaskRun" WHERE id = $1"#,
        )
        .bind(&run.id)
        .fetch_one(srv.pool());
        let row = within(WAIT, "read run", query).await.expect("read run");
        expected.insert(run.id.clone(), (row.0, ts(row.1)));
    }
    for (i, view) in views.iter_mut().enumerate() {
        let waited = Instant::now();
        let result =
            tokio::time::timeout(Duration::from_secs(10), view.wait_for(|v| *v == expected))
                .await
                .map(|_| ());
        let last = view.borrow().clone();
        assert!(
            result.is_ok(),
            "follower {i} never converged:\n got {last:?}\nwant {expected:?}"
        );
        println!(
            "burst (coalesce {coalesce_ms:?}): follower {i} converged {:?} after the last publish",
            waited.elapsed()
        );
    }
    let _ = stop_tx.send(true);
    for f in followers {
        let n = within(WAIT, "follower stop", f)
            .await
            .expect("follower task");
        println!("burst (coalesce {coalesce_ms:?}): follower made {n} responses");
    }
}

// ---------------------------------------------------------------------------------------------
// Probes of the "better than the reference" items
// ---------------------------------------------------------------------------------------------

/// docs/behaviours.md §5.1 item 3 / docs/behaviours.md §4 item 4: a handle resumes on ANY
/// instance sharing the handle secret (no local state). The snapshot's versions travel with its
/// shared replay cursor, so the peer knows what the client has: nothing is re-sent, the poll
/// holds (the reference re-sends every row of a tag feed on a state miss). A run feed diffs
/// against the offset watermark. A peer with another secret answers 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_hop_handle_resumes_on_a_peer_with_the_same_secret() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let [r1, _r2] = srv.tagged_runs(&env, &["p"]).await;
    let h = modern(&env.api_key);
    let peer = srv.peer(|_| {}).await;

    let url = tag_url("p");
    let snap = srv.fetch(&url.snapshot(), &h).await;
    let hop = srv.fetch_at(&peer.base, &url.live_at(&snap), &h).await;
    assert_feed_headers(&hop, false);
    assert_quiet_hold(
        &hop,
        Duration::from_millis(1_450),
        "the peer knows the snapshot's versions: no re-sync",
    );
    assert_eq!(hop.handle(), snap.handle());
    let catch_up = srv
        .fetch_at(
            &peer.base,
            &url.catch_up(&snap.handle(), &snap.offset()),
            &h,
        )
        .await;
    assert_feed_headers(&catch_up, true);

    let run = run_url(&r1.friendly_id);
    let rs = srv.fetch(&run.snapshot(), &h).await;
    let held = srv.fetch_at(&peer.base, &run.live_at(&rs), &h).await;
    let what = "nothing newer than the offset watermark";
    assert_quiet_hold(&held, Duration::from_millis(1_450), what);

    let other = srv
        .peer(|c| c.server.handle_secret = Some("another-secret".into()))
        .await;
    let r = srv.fetch_at(&other.base, &url.live_at(&snap), &h).await;
    assert_must_refetch(&r, "a peer with another secret");
    drop((peer, other));
}

/// TAG-04: the `createdAt` floor pinned in the handle wins over a later request's `createdAt`:
/// a run older than the pinned window never appears, even when it changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_04_floor_pinned_in_the_handle_wins_over_created_at_param() {
    let (srv, env) = TestServer::uncoalesced_with_env(1_500).await;
    let now = runfeed::clock::now_ms();
    let old = srv.run(&env, tagged_aged(&["f"], now, 2 * 3_600_000)).await;
    let fresh = srv.run(&env, tagged_aged(&["f"], now, 60_000)).await;
    let h = modern(&env.api_key);
    let snap = srv
        .fetch(&tag_url("f").q("createdAt", "1h").snapshot(), &h)
        .await;
    assert_eq!(snap.ops(), vec![op("insert", &fresh.id)]);
    srv.wait_subscribed(&env.env_id).await;

    let live = [tag_url("f").q("createdAt", "3h").live_at(&snap)];
    let change = srv.change(&env, &old.id, &["f"], None, "EXECUTING");
    let ([r], _) = srv.polls_during(live, &h, |h| h.1 == 1, change).await;
    let what = "no run from outside the pinned window";
    assert_quiet_hold(&r, Duration::from_millis(1_450), what);
    let catch_up = srv
        .fetch(
            &tag_url("f")
                .q("createdAt", "24h")
                .catch_up(&snap.handle(), &r.offset()),
            &h,
        )
        .await;
    assert_feed_headers(&catch_up, true);
    assert!(catch_up.row(&old.id).is_none(), "{}", catch_up.text);
}

/// TAG-08 / LST-01: a list feed is capped at `max_list_results`, newest `createdAt` first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tag_08_list_feed_is_capped_newest_first() {
    let srv = TestServer::start_with(1_500, |c| c.feeds.max_list_results = 2).await;
    let env = srv.env().await;
    let now = runfeed::clock::now_ms();
    let mut runs = Vec::new();
    for age in [30_000, 20_000, 10_000] {
        runs.push(srv.run(&env, tagged_aged(&["cap"], now, age)).await);
    }
    let r = srv
        .fetch(&tag_url("cap").snapshot(), &modern(&env.api_key))
        .await;
    assert_feed_headers(&r, true);
    assert_eq!(
        r.ops(),
        vec![op("insert", &runs[2].id), op("insert", &runs[1].id)]
    );
}

/// Behaviours §4 item 6: two versions written in the same millisecond are still told apart —
/// a same-`updatedAt` change with new content wakes run and tag feeds with an `update`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_same_millisecond_update_with_new_content_is_delivered() {
    let (srv, env) = TestServer::uncoalesced_with_env(10_000).await;
    let run = srv.tagged_run(&env, &["m"]).await;
    let h = modern(&env.api_key);
    let (run_feed, tag_feed) = (run_url(&run.friendly_id), tag_url("m"));
    let rs = srv.fetch(&run_feed.snapshot(), &h).await;
    let ts_ = srv.fetch(&tag_feed.snapshot(), &h).await;
    srv.wait_subscribed(&env.env_id).await;

    let same_ms_change = async {
        let set = RunUpdate {
            status: Some("EXECUTING".into()),
            updated_at_ms: Some(run.updated_at_ms),
            ..RunUpdate::default()
        };
        let ms = srv.update(&run.id, set).await;
        assert_eq!(ms, run.updated_at_ms);
        srv.publish(&TestServer::record(&env, &run.id, &["m"], None, ms))
            .await;
    };
    let live = [run_feed.live_at(&rs), tag_feed.live_at(&ts_)];
    let ([a, b], ()) = srv
        .polls_during(live, &h, |h| h == (1, 1, 0), same_ms_change)
        .await;
    for (name, r) in [("run", &a), ("tag", &b)] {
        let what = format!("{name}: a same-ms change");
        assert_woken_by_update(r, &run.id, Duration::from_secs(5), &what);
        let status = &r.row(&run.id).unwrap()["value"]["status"];
        assert_eq!(status, "EXECUTING", "{name}");
    }
}

/// Behaviours §4 items 3 and 10: a partial record (no tags, no batch id, no watermark) still
/// reaches tag AND batch feeds (the hydrated row decides membership).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_record_without_tags_or_watermark_wakes_tag_and_batch_feeds() {
    let (srv, env) = TestServer::with_env(10_000).await;
    let (run, _, batch_fid) = srv.batched_run(&env, &["pt"]).await;
    let h = modern(&env.api_key);
    let (tag_feed, batch_feed) = (tag_url("pt"), batch_url(&batch_fid));
    let st = srv.fetch(&tag_feed.snapshot(), &h).await;
    let sb = srv.fetch(&batch_feed.snapshot(), &h).await;
    srv.wait_subscribed(&env.env_id).await;

    let partial_change = async {
        srv.set_status(&run.id, "EXECUTING").await;
        srv.publish(&TestServer::partial_record(&env, &run.id))
            .await;
    };
    let live = [tag_feed.live_at(&st), batch_feed.live_at(&sb)];
    let (answers, ()) = srv
        .polls_during(live, &h, |h| h == (0, 1, 1), partial_change)
        .await;
    for (name, r) in ["tag", "batch"].into_iter().zip(&answers) {
        assert_woken_by_update(r, &run.id, Duration::from_secs(5), name);
    }
}

/// LIVE-04, RUN-05, LIVE-06 (hold on empty): a change that does not match the feed, or a
/// replayed record the client already has, does not end the hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_04_non_matching_or_already_seen_changes_keep_holding() {
    let (srv, env) = TestServer::uncoalesced_with_env(2_000).await;
    let mine = srv.tagged_run(&env, &["n"]).await;
    let other = srv.tagged_run(&env, &["x"]).await;
    let h = modern(&env.api_key);
    let (tag_feed, run_feed) = (tag_url("n"), run_url(&mine.friendly_id));
    let st = srv.fetch(&tag_feed.snapshot(), &h).await;
    let sr = srv.fetch(&run_feed.snapshot(), &h).await;
    srv.wait_subscribed(&env.env_id).await;
    let batches_before = srv.routed_batches();

    let noise = async {
        // A change of a run with another tag (full and partial record).
        let ms = srv.set_status(&other.id, "EXECUTING").await;
        srv.publish(&TestServer::record(&env, &other.id, &["x"], None, ms))
            .await;
        srv.publish(&TestServer::partial_record(&env, &other.id))
            .await;
        // A replay of the version the clients already have.
        srv.publish_created(&env, &mine, &["n"]).await;
        srv.wait_routed(batches_before, "noise routed").await;
    };
    let live = [tag_feed.live_at(&st), run_feed.live_at(&sr)];
    let ([a, b], ()) = srv.polls_during(live, &h, |h| h == (1, 1, 0), noise).await;
    for (name, r) in [("tag", &a), ("run", &b)] {
        let what = format!("{name}: the hold must not end early");
        assert_quiet_hold(r, Duration::from_millis(1_950), &what);
    }
}

/// Tenant isolation on the change stream: a record naming another environment's run,
/// published on this environment's channel, never puts that run into this environment's feeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_env_record_never_leaks_another_envs_row() {
    let srv = TestServer::start_with(1_500, |c| c.router.coalesce_ceiling_ms = 0).await;
    let env_a = srv.env().await;
    let env_b = srv.env().await;
    let _run_a = srv.tagged_run(&env_a, &["t"]).await;
    let run_b = srv.tagged_run(&env_b, &["t"]).await;
    let h = modern(&env_a.api_key);
    let snap = srv.fetch(&tag_url("t").snapshot(), &h).await;
    srv.wait_subscribed(&env_a.env_id).await;
    let inject = async {
        let ms = srv.set_status(&run_b.id, "EXECUTING").await;
        // On A's channel, naming B's run.
        srv.publish(&TestServer::record(&env_a, &run_b.id, &["t"], None, ms))
            .await;
    };
    let live = [tag_url("t").live_at(&snap)];
    let ([r], ()) = srv.polls_during(live, &h, |h| h.1 == 1, inject).await;
    assert_quiet_hold(&r, Duration::ZERO, "B's run on A's channel");
    assert!(!r.text.contains(&run_b.id));
}

/// docs/behaviours.md §5.1 item 3: a handle only resumes the feed it was minted for — another run, tag
/// filter, batch or feed kind (same environment) → 409 must-refetch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handle_of_another_feed_in_the_same_env_is_409() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let (r1, _, b1_fid) = srv.batched_run(&env, &["a", "b"]).await;
    let (_, b2_fid) = srv.batch(&env).await;
    let r2 = srv.tagged_run(&env, &["a"]).await;
    let h = modern(&env.api_key);
    let run1 = srv.fetch(&run_url(&r1.friendly_id).snapshot(), &h).await;
    let tag_a = srv.fetch(&tag_url("a").snapshot(), &h).await;
    let batch1 = srv.fetch(&batch_url(&b1_fid).snapshot(), &h).await;
    for (url, from, what) in [
        (run_url(&r2.friendly_id), &run1, "run handle on another run"),
        (tag_url("a,b"), &tag_a, "tag handle on another filter"),
        (
            tag_url("b,a,a"),
            &tag_a,
            "tag handle on another filter (permuted)",
        ),
        (batch_url(&b2_fid), &batch1, "batch handle on another batch"),
        (batch_url(&b1_fid), &tag_a, "tag handle on the batch route"),
        (tag_url("a"), &batch1, "batch handle on the tag route"),
        (
            run_url(&r1.friendly_id),
            &tag_a,
            "tag handle on the run route",
        ),
    ] {
        for req in [
            url.live_at(from),
            url.catch_up(&from.handle(), &from.offset()),
        ] {
            assert_must_refetch(&srv.fetch(&req, &h).await, what);
        }
    }
    // The tag filter digest is order-insensitive: `b,a` resumes an `a,b` handle.
    let ab = srv.fetch(&tag_url("a,b").snapshot(), &h).await;
    srv.fetch(&tag_url("b,a").catch_up(&ab.handle(), &ab.offset()), &h)
        .await
        .assert_status(200);
}

/// HYD-04, LIVE-03, docs/behaviours.md §5.1 item 5: live feeds on the same tag with different column sets
/// are hydrated once PER column set, and each gets rows in its own shape (skipped columns absent
/// from live `update` rows too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_feeds_with_different_skip_columns_get_their_own_rows() {
    let (srv, env) = TestServer::uncoalesced_with_env(10_000).await;
    let run = srv.tagged_run(&env, &["sc"]).await;
    let h = modern(&env.api_key);
    let slim_url = tag_url("sc").q("skipColumns", "payload,output");
    let full_url = tag_url("sc");
    // Snapshots after the subscription is confirmed carry usable cursors, so the live polls
    // below take no cold path (whose reads could race the change and add a hydrate).
    assert_eq!(
        srv.fetch(&run_url(&run.friendly_id).snapshot(), &h)
            .await
            .status,
        200
    );
    let router = &srv.running().router;
    wait_confirmed(router, &env.env_id, "subscription confirmed").await;
    let slim = srv.fetch(&slim_url.snapshot(), &h).await;
    let full = srv.fetch(&full_url.snapshot(), &h).await;
    let full2 = srv.fetch(&full_url.snapshot(), &h).await;
    srv.wait_subscribed(&env.env_id).await;
    let store = srv.running().store.clone();

    let change = async {
        let (q, hy) = (store.query_count(), srv.hydrates());
        srv.change(&env, &run.id, &["sc"], None, "EXECUTING").await;
        (q, hy)
    };
    let live = [
        slim_url.live_at(&slim),
        full_url.live_at(&full),
        full_url.live_at(&full2),
    ];
    let ([a, b, c], (q, hy)) = srv.polls_during(live, &h, |h| h.1 == 3, change).await;
    for r in [&a, &b, &c] {
        assert_woken_by_update(r, &run.id, WAIT, "a tag feed");
    }
    let slim_row = &a.row(&run.id).unwrap()["value"];
    assert!(
        slim_row.get("payload").is_none() && slim_row.get("output").is_none(),
        "skipped columns in a live row: {slim_row}"
    );
    assert!(slim_row.get("status").is_some());
    assert!(b.row(&run.id).unwrap()["value"].get("payload").is_some());
    let queries = store.query_count() - q;
    let hydrates = srv.hydrates() - hy;
    println!("two column sets, three feeds: {queries} queries, {hydrates} hydrates for one change");
    assert_eq!(hydrates, 2, "one hydrate per column set");
    assert_eq!(queries, 2, "one query per column set");
}

/// HDR-02: an EMPTY `x-trigger-electric-version` counts as absent (legacy names, 422).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hdr_02_empty_electric_version_header_is_legacy() {
    let (srv, env) = TestServer::with_env(1_500).await;
    let run = srv.run(&env, RunSpec::default()).await;
    let h = with(legacy(&env.api_key), "x-trigger-electric-version", "");
    let r = srv.fetch(&run_url(&run.friendly_id).snapshot(), &h).await;
    r.assert_status(200);
    assert!(
        r.has("electric-shape-id") && !r.has("electric-handle"),
        "{:?}",
        r.headers
    );
    srv.fetch(&run_url(&run.friendly_id).q("offset", "abc"), &h)
        .await
        .assert_status(422);
}

/// docs/behaviours.md §5.1 item 5 at subscription start: once the environment's subscription is
/// confirmed, N clients that snapshot a hot tag and go live must not cost one store query EACH.
///
/// Today the first snapshot's run-set read (taken before confirmation, cursor epoch 0) stays in
/// the run-set cache for `runset_cache_ttl_ms`; every snapshot served from it hands out that
/// unusable cursor, so every first live poll is "not covered" and runs its own uncoalesced cold
/// `read_fresh` — N feeds → N queries (200 here; 1 000 in the fan-out test). Snapshots taken
/// after the cache entry expired cost 0 queries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fanout_first_live_polls_after_confirmation_do_not_cost_a_query_each() {
    const N: usize = 200;
    let srv = Arc::new(TestServer::start(20_000).await);
    let env = srv.env().await;
    srv.tagged_run(&env, &["e"]).await;
    let h = modern(&env.api_key);
    let url = tag_url("e");
    // The first snapshot subscribes the environment; wait for Redis to have the subscription.
    srv.fetch(&url.snapshot(), &h).await.assert_status(200);
    srv.wait_subscribed(&env.env_id).await;
    let snaps: Vec<Resp> = within(
        WAIT,
        "snapshots",
        futures::future::join_all((0..N).map(|_| srv.fetch(&url.snapshot(), &h))),
    )
    .await;
    let store = srv.running().store.clone();
    let before = settle_queries(&store).await;
    let tasks: Vec<_> = snaps
        .iter()
        .map(|s| spawn_fetch(&srv, &url.live_at(s), &h))
        .collect();
    srv.wait_held("all held", |h| h.1 == N).await;
    let cost = settle_queries(&store).await - before;
    for t in &tasks {
        t.abort();
    }
    println!("registering {N} live polls right after confirmation cost {cost} store queries");
    assert!(
        cost <= 1,
        "{N} first live polls cost {cost} store queries (one per feed)"
    );
}

/// Graceful shutdown : stopping an instance answers every held live poll
/// at once with a 200 `up-to-date` (clients re-poll elsewhere) instead of holding the shutdown
/// for the ~20 s hold or resetting connections.
#[tokio::test]
async fn shutdown_answers_every_held_poll_with_up_to_date() {
    let (srv, env) = TestServer::with_env(20_000).await;
    let run = srv.tagged_run(&env, &["s"]).await;
    let peer = srv.peer(|_| {}).await;
    let h = modern(&env.api_key);
    let snap = srv
        .fetch_at(&peer.base, &run_url(&run.friendly_id).snapshot(), &h)
        .await;
    let live = run_url(&run.friendly_id).live_at(&snap);
    let full = format!("{}{}", peer.base, live.render());
    let polls: Vec<_> = (0..200)
        .map(|_| {
            let req = with_headers(srv.http.get(&full), &h);
            tokio::spawn(async move { send(req, WAIT).await.map(|r| (r.status, r.text)) })
        })
        .collect();
    let router = peer.running.router.clone();
    wait_until(WAIT, "200 polls held on the peer", || {
        router.held_feeds().0 == 200
    })
    .await;
    let t = Instant::now();
    within(WAIT, "peer shutdown", peer.running.stop()).await;
    for poll in polls {
        let (status, body) = within(WAIT, "poll answered", poll)
            .await
            .expect("join")
            .expect("poll got a response, not a reset");
        assert_eq!(status, 200);
        assert_eq!(body, r#"[{"headers":{"control":"up-to-date"}}]"#);
    }
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "drained in {:?}",
        t.elapsed()
    );
    println!("shutdown: 200 held polls answered in {:?}", t.elapsed());
}

/// REQ-02..05 / scenario 18 groundwork: with a limit of 2 live polls per environment, the third
/// concurrent live poll is a 429 `{"error":"Too many concurrent requests"}` (with CORS), a
/// snapshot is never limited, and aborting a held poll frees its slot at once.
#[tokio::test]
async fn req_04_live_polls_over_the_env_limit_are_429_and_slots_free_on_abort() {
    let srv =
        Arc::new(TestServer::start_with(20_000, |c| c.feeds.default_concurrency_limit = 2).await);
    let env = srv.env().await;
    let run = srv.tagged_run(&env, &["l"]).await;
    let h = modern(&env.api_key);
    let snap = srv.fetch(&run_url(&run.friendly_id).snapshot(), &h).await;
    let live = run_url(&run.friendly_id).live_at(&snap);
    let spawn_poll = || spawn_fetch(&srv, &live, &h);
    let a = spawn_poll();
    let b = spawn_poll();
    srv.wait_held("two live polls held", |held| held.0 == 2)
        .await;
    let third = srv
        .fetch(&live, &with(h.clone(), "origin", "https://app.example"))
        .await;
    assert_eq!(third.status, 429);
    assert_eq!(third.json, json!({"error": "Too many concurrent requests"}));
    assert!(third.has("access-control-allow-origin"));
    assert_eq!(
        srv.fetch(&run_url(&run.friendly_id).snapshot(), &h)
            .await
            .status,
        200,
        "snapshots are not limited"
    );
    a.abort();
    srv.wait_held("aborted poll released", |held| held.0 == 1)
        .await;
    let c = spawn_poll();
    srv.wait_held("a new poll takes the freed slot", |held| held.0 == 2)
        .await;
    b.abort();
    c.abort();
}

/// Fleet: with shared replay cursors, a live poll that hops to another instance whose
/// change stream already covers the client's gap costs no store read (no cold resolve), and a
/// change made between the two polls is still delivered (replayed from the other instance's
/// buffer by wall time).
#[tokio::test]
async fn hop_with_shared_cursor_replays_the_gap_without_a_cold_resolve() {
    let srv = TestServer::start_with(20_000, |c| c.router.hop_margin_ms = 200).await;
    let env = srv.env().await;
    let [r1, r2] = srv.tagged_runs(&env, &["hop"]).await;
    let h = modern(&env.api_key);
    let peer = srv.peer(|c| c.router.hop_margin_ms = 200).await;
    let url = tag_url("hop");
    // Both instances already serve this environment (other clients), so their streams are warm.
    let warm = run_url(&r2.friendly_id).snapshot();
    srv.warm_with_peer(&peer, &env.env_id, &warm, &h).await;
    let peer_router = peer.running.router.clone();
    tokio::time::sleep(Duration::from_millis(250)).await; // let the peer's stream age past the hop margin

    // The client's previous response comes from instance A …
    let snap = srv.fetch(&url.snapshot(), &h).await;
    // … a change lands between its polls …
    srv.change(&env, &r1.id, &["hop"], None, "EXECUTING").await;
    wait_until(WAIT, "peer routed the change", || {
        peer_router
            .stats()
            .batches
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 1
    })
    .await;
    // … and its next live poll lands on the peer.
    let queries_before = peer.running.store.query_count();
    let hop = srv.fetch_at(&peer.base, &url.live_at(&snap), &h).await;
    let what = "exactly the gap, not via the backstop";
    assert_woken_by_update(&hop, &r1.id, Duration::from_millis(1_000), what);
    let hop_queries = peer.running.store.query_count() - queries_before;
    assert!(
        hop_queries <= 1,
        "the replay hydrate at most, no full resolve: {hop_queries} queries"
    );
}

// ---------------------------------------------------------------------------------------------
// Shared backstops (idle cost, BENCHMARKS.md)
// ---------------------------------------------------------------------------------------------

/// Three quiet holds on one tag (two connections) → store queries spent by their backstops.
async fn backstop_queries_for_three_quiet_holds(share_ms: u64) -> u64 {
    let (srv, env) = TestServer::start_with_env(400, |c| {
        c.caches.backstop_share_ms = share_ms;
        // The reference's rule: every backstop re-reads the whole filter.
        if share_ms == 0 {
            c.caches.full_reread_ms = 0;
        }
        // Snapshot reads must not be what the backstops reuse.
        c.caches.runset_cache_ttl_ms = 50;
        // Count feed reads only: the key → environment lookup stays cached.
        c.caches.lookup_cache_ttl_ms = 60_000;
    })
    .await;
    srv.tagged_run(&env, &["quiet"]).await;
    let h = modern(&env.api_key);
    // The first snapshot subscribes the environment; snapshots after the subscription is
    // confirmed hand out cursors that resume without a cold read.
    srv.fetch(&tag_url("quiet").snapshot(), &h).await;
    srv.wait_subscribed(&env.env_id).await;
    tokio::time::sleep(Duration::from_millis(100)).await; // the pre-subscription read expires (50 ms TTL)
    let a = srv.fetch(&tag_url("quiet").snapshot(), &h).await;
    let b = srv.fetch(&tag_url("quiet").snapshot(), &h).await;
    let store = srv.running().store.clone();
    let before = settle_queries(&store).await;
    for at in [&a, &b, &a] {
        let r = srv.fetch(&tag_url("quiet").live_after(at), &h).await;
        r.assert_status(200);
        assert!(r.is_bare_up_to_date(), "a quiet hold answers up-to-date");
    }
    store.query_count() - before
}

/// Idle cost: backstops of one filter share their view for `caches.backstop_share_ms`, and the
/// snapshot's own read of the filter seeds that view, so quiet holds of many feeds on a tag
/// within the window never re-read the filter: the first backstop brings the seeded view forward
/// with two small reads (the set's unfinished runs by primary key, the environment's newest
/// runs), the others share its result. The reference re-resolves every held multi-run feed at
/// every backstop (`share_ms = 0` here): three whole reads for three quiet holds.
#[tokio::test]
async fn backstops_of_one_filter_share_one_read() {
    let shared = backstop_queries_for_three_quiet_holds(60_000).await;
    let reference = backstop_queries_for_three_quiet_holds(0).await;
    assert_eq!(
        shared, 2,
        "three quiet holds with shared backstops: one probe and one tail read"
    );
    assert_eq!(reference, 3, "three quiet holds, every backstop reading");
}

/// A server with 300 ms holds whose backstops share their reads for `share_ms` (snapshot reads
/// are cached only 50 ms, so backstops never reuse them as such).
async fn shared_backstop_server(share_ms: u64) -> (TestServer, DemoEnv) {
    TestServer::start_with_env(300, move |c| {
        c.caches.backstop_share_ms = share_ms;
        c.caches.runset_cache_ttl_ms = 50;
    })
    .await
}

/// A shared backstop still finds a change whose publish was lost: once the window of the read
/// that predates it ends, the next backstop reads again and delivers it as an `update`.
#[tokio::test]
async fn a_lost_publish_surfaces_after_the_backstop_share_window() {
    let (srv, env) = shared_backstop_server(1_000).await;
    let run = srv.tagged_run(&env, &["lost"]).await;
    let h = modern(&env.api_key);
    let mut at = srv.fetch(&tag_url("lost").snapshot(), &h).await;
    // One quiet hold: its backstop read is now shared for 1 s.
    at = srv.fetch(&tag_url("lost").live_after(&at), &h).await;
    // Committed, never published.
    srv.set_status(&run.id, "EXECUTING").await;
    let t = Instant::now();
    let delivered = loop {
        let r = srv.fetch(&tag_url("lost").live_after(&at), &h).await;
        r.assert_status(200);
        if let Some(row) = r.row(&run.id) {
            break (r.ops(), row["value"]["status"].clone());
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the lost change never surfaced"
        );
        at = r;
    };
    assert_eq!(delivered.0, vec![op("update", &run.id)]);
    assert_eq!(delivered.1, json!("EXECUTING"));
    // Window (1 s) + at most two holds (0.3 s + 15 %), with slack for a loaded machine.
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "surfaced after {:?}",
        t.elapsed()
    );
}

// ---------------------------------------------------------------------------------------------
// Backstops that read only what can have changed (production data volume, docs/operations.md)
// ---------------------------------------------------------------------------------------------

/// A server whose backstops share for 300 ms and re-read whole filters every `full_reread_ms`.
async fn backstop_server(full_reread_ms: u64) -> (TestServer, DemoEnv) {
    TestServer::start_with_env(300, move |c| {
        c.caches.backstop_share_ms = 300;
        c.caches.full_reread_ms = full_reread_ms;
        c.caches.runset_cache_ttl_ms = 50;
    })
    .await
}

/// Live polls on `url` from `at` until one carries `run_id`, for at most `within`; the rows
/// that poll carried (`None`: it never came).
async fn poll_until_row(
    srv: &TestServer,
    url: &Url,
    headers: &[(String, String)],
    mut at: Resp,
    run_id: &str,
    within: Duration,
) -> Option<Resp> {
    let t = Instant::now();
    while t.elapsed() < within {
        let r = srv.fetch(&url.live_after(&at), headers).await;
        r.assert_status(200);
        if r.row(run_id).is_some() {
            return Some(r);
        }
        at = r;
    }
    None
}

/// A change to an unfinished run whose publish was lost surfaces through the backstop's
/// primary-key probe of the set's unfinished runs, long before the full re-read (10 min).
#[tokio::test]
async fn a_lost_change_to_an_unfinished_run_surfaces_before_the_full_reread() {
    let (srv, env) = backstop_server(600_000).await;
    let run = srv.tagged_run(&env, &["probe"]).await; // PENDING: not final
    let h = modern(&env.api_key);
    let url = tag_url("probe");
    let snap = srv.fetch(&url.snapshot(), &h).await;
    // One quiet hold: its backstop reads the filter fully and keeps its view.
    let at = srv.fetch(&url.live_after(&snap), &h).await;
    srv.set_status(&run.id, "EXECUTING").await; // committed, never published
    let r = poll_until_row(&srv, &url, &h, at, &run.id, Duration::from_secs(10))
        .await
        .expect("the lost change surfaced");
    assert_eq!(r.ops(), vec![op("update", &run.id)]);
    assert_eq!(
        r.row(&run.id).expect("row")["value"]["status"],
        json!("EXECUTING")
    );
}

/// A lost change made during the first hold after a snapshot surfaces at that hold's backstop,
/// even when backstops share their reads for a minute: the snapshot's read seeds the filter's
/// view (so the backstop need not re-read the whole filter) but is not shared as a backstop
/// read, since the client was just sent it.
#[tokio::test]
async fn a_lost_change_in_the_first_hold_after_a_snapshot_surfaces_at_its_backstop() {
    let (srv, env) = shared_backstop_server(60_000).await;
    let run = srv.tagged_run(&env, &["seeded"]).await; // PENDING: not final
    let h = modern(&env.api_key);
    let url = tag_url("seeded");
    let snap = srv.fetch(&url.snapshot(), &h).await;
    snap.assert_status(200);
    srv.set_status(&run.id, "EXECUTING").await; // committed, never published
    let r = srv.fetch(&url.live_after(&snap), &h).await;
    r.assert_status(200);
    assert_eq!(r.ops(), vec![op("update", &run.id)], "{}", r.text);
}

/// A run created without a publish surfaces through the environment's tail (the runs created
/// since the view was read), before the full re-read.
#[tokio::test]
async fn a_run_created_without_a_publish_surfaces_from_the_tail() {
    let (srv, env) = backstop_server(600_000).await;
    srv.tagged_run(&env, &["tail"]).await;
    let h = modern(&env.api_key);
    let url = tag_url("tail");
    let snap = srv.fetch(&url.snapshot(), &h).await;
    let at = srv.fetch(&url.live_after(&snap), &h).await;
    let late = srv.tagged_run(&env, &["tail"]).await; // never published
    let r = poll_until_row(&srv, &url, &h, at, &late.id, Duration::from_secs(10))
        .await
        .expect("the new run surfaced");
    assert_eq!(r.ops(), vec![op("insert", &late.id)]);
}

/// A tag added without a publish to a recent run that is not finished (trigger.dev's
/// `tags.add()` inside a running task) surfaces before the full re-read: the environment's tail
/// probes its unfinished runs again at each read.
#[tokio::test]
async fn a_tag_added_to_a_recent_unfinished_run_surfaces_before_the_full_reread() {
    let (srv, env) = backstop_server(600_000).await;
    srv.tagged_run(&env, &["joined"]).await;
    let running = srv.tagged_run(&env, &["other"]).await; // PENDING
    let h = modern(&env.api_key);
    let url = tag_url("joined");
    let snap = srv.fetch(&url.snapshot(), &h).await;
    assert!(snap.row(&running.id).is_none());
    let mut at = srv.fetch(&url.live_after(&snap), &h).await;
    // Two more quiet holds: the environment's tail has now been read and holds the run.
    for _ in 0..2 {
        at = srv.fetch(&url.live_after(&at), &h).await;
    }
    let retagged = RunUpdate {
        tags: Some(vec!["other".into(), "joined".into()]),
        ..RunUpdate::default()
    };
    srv.update(&running.id, retagged).await; // never published
    let r = poll_until_row(&srv, &url, &h, at, &running.id, Duration::from_secs(10))
        .await
        .expect("the run that joined the tag surfaced");
    assert_eq!(r.ops(), vec![op("insert", &running.id)]);
}

/// A tag added to a FINISHED run without a publish is the one change a backstop between full
/// re-reads cannot see (finished runs are not probed): it surfaces at the next full re-read of
/// the filter (`caches.full_reread_ms`, here 1.5 s ± 25 %).
#[tokio::test]
async fn a_tag_added_to_a_finished_run_surfaces_after_the_full_reread() {
    let (srv, env) = backstop_server(1_500).await;
    srv.tagged_run(&env, &["late-tag"]).await;
    let finished = srv
        .run(
            &env,
            RunSpec {
                status: "COMPLETED_SUCCESSFULLY".into(),
                ..tagged(&["other"])
            },
        )
        .await;
    let h = modern(&env.api_key);
    let url = tag_url("late-tag");
    let snap = srv.fetch(&url.snapshot(), &h).await;
    assert!(snap.row(&finished.id).is_none());
    let at = srv.fetch(&url.live_after(&snap), &h).await;
    let t = Instant::now();
    let retagged = RunUpdate {
        tags: Some(vec!["other".into(), "late-tag".into()]),
        ..RunUpdate::default()
    };
    srv.update(&finished.id, retagged).await; // never published
    let r = poll_until_row(&srv, &url, &h, at, &finished.id, Duration::from_secs(10))
        .await
        .expect("the retagged run surfaced after the full re-read");
    // New to the client: an insert.
    assert_eq!(r.ops(), vec![op("insert", &finished.id)]);
    assert!(t.elapsed() < Duration::from_secs(10));
}

/// A run that leaves the `createdAt` window (the tag feed's floor moves up with the maximum
/// age) is dropped by the backstop: a lost change to it is not delivered, while one to a run
/// still inside the window is.
#[tokio::test]
async fn a_run_that_leaves_the_window_is_not_delivered_by_the_backstop() {
    let (srv, env) = TestServer::start_with_env(300, |c| {
        c.caches.backstop_share_ms = 300;
        c.caches.full_reread_ms = 600_000;
        c.feeds.maximum_created_at_filter_age_ms = 60_000;
        c.feeds.runset_created_at_bucket_ms = 0;
    })
    .await;
    let now = runfeed::clock::now_ms();
    let leaving = srv
        .run(
            &env,
            RunSpec {
                created_at_ms: Some(now - 57_000),
                ..tagged(&["window"])
            },
        )
        .await;
    let staying = srv.tagged_run(&env, &["window"]).await;
    let h = modern(&env.api_key);
    let url = tag_url("window");
    let snap = srv.fetch(&url.snapshot(), &h).await;
    assert!(
        snap.row(&leaving.id).is_some(),
        "inside the window at first"
    );
    let mut at = srv.fetch(&url.live_after(&snap), &h).await;
    // Past the window's edge for `leaving` (created 57 s ago, 60 s maximum age).
    while runfeed::clock::now_ms() < now + 4_000 {
        at = srv.fetch(&url.live_after(&at), &h).await;
    }
    srv.set_status(&leaving.id, "EXECUTING").await; // never published
    srv.set_status(&staying.id, "EXECUTING").await; // never published
    let r = poll_until_row(&srv, &url, &h, at, &staying.id, Duration::from_secs(10))
        .await
        .expect("the run inside the window surfaced");
    assert!(
        r.row(&leaving.id).is_none(),
        "a run below the floor is not delivered: {:?}",
        r.ops()
    );
}

// ---------------------------------------------------------------------------------------------
// Busy environments' windows (feeds.window_after_resolves, docs/operations.md "Windows")
// ---------------------------------------------------------------------------------------------

/// A server whose environments build their window after two cold tag resolves in a minute and
/// rebuild it every `full_reread_ms`.
async fn window_server(full_reread_ms: u64) -> (TestServer, DemoEnv) {
    TestServer::start_with_env(300, move |c| {
        c.feeds.window_after_resolves = 2;
        c.caches.full_reread_ms = full_reread_ms;
        c.caches.runset_cache_ttl_ms = 1;
    })
    .await
}

/// A finished run tagged `tag`, created 5 minutes ago: older than the tail each window refresh
/// reads again (30 s), so only a change record (or a rebuild) tells the window about it.
async fn finished_older_run(srv: &TestServer, env: &DemoEnv, tag: &str) -> CreatedRun {
    let spec = RunSpec {
        status: "COMPLETED_SUCCESSFULLY".into(),
        created_at_ms: Some(runfeed::clock::now_ms() - 300_000),
        ..tagged(&[tag])
    };
    srv.run(env, spec).await
}

/// Runs held by the server's windows (`runfeed_feeds_window_runs`).
async fn window_runs(srv: &TestServer) -> u64 {
    let text = srv.scrape_text().await;
    text.lines()
        .find_map(|line| line.strip_prefix("runfeed_feeds_window_runs"))
        .and_then(|rest| rest.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Two cold tag resolves (`window_server` builds the environment's window after two), then
/// waits until the window holds `runs` runs.
async fn build_window(srv: &TestServer, h: &[(String, String)], tags: [&str; 2], runs: u64) {
    for tags in tags {
        srv.fetch(&tag_url(tags).snapshot(), h)
            .await
            .assert_status(200);
    }
    let t = Instant::now();
    while window_runs(srv).await != runs {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the window was never built"
        );
    }
}

/// Cold snapshots of `tags` until one carries `run_id`, for at most `within` (`false`: none
/// did).
async fn cold_snapshot_carries(
    srv: &TestServer,
    headers: &[(String, String)],
    tags: &str,
    run_id: &str,
    within: Duration,
) -> bool {
    let t = Instant::now();
    while t.elapsed() < within {
        let r = srv.fetch(&tag_url(tags).snapshot(), headers).await;
        r.assert_status(200);
        if r.row(run_id).is_some() {
            return true;
        }
    }
    false
}

/// Once an environment has its window, its cold tag snapshots take their runs from it: every
/// tag (`@>`), newest first, runs older than the maximum age left out, as the store's query
/// would. A publish that adds a tag to a finished run reaches them through the change record;
/// a tag added in the store with no publish does not (the window is not the store), until the
/// window's rebuild (the next test).
#[tokio::test]
async fn a_busy_environments_tag_snapshots_come_from_its_window() {
    let (srv, env) = window_server(600_000).await;
    let both = srv.tagged_run(&env, &["w", "x"]).await;
    let w_only = srv.tagged_run(&env, &["w"]).await;
    let x_only = srv.tagged_run(&env, &["x"]).await;
    let done = finished_older_run(&srv, &env, "x").await;
    let old = srv
        .run(
            &env,
            RunSpec {
                created_at_ms: Some(runfeed::clock::now_ms() - 2 * 86_400_000),
                ..tagged(&["w"])
            },
        )
        .await;
    let h = modern(&env.api_key);
    // The older run left out.
    build_window(&srv, &h, ["w", "x"], 4).await;
    // Newest first (the order of the store's query), compared as sets: runs made in one
    // millisecond tie on `createdAt`.
    let ids = |r: &Resp| {
        let mut ids = ids_of(r);
        ids.sort();
        ids
    };
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let w = srv.fetch(&tag_url("w").snapshot(), &h).await;
    assert_eq!(ids(&w), sorted(vec![w_only.id.clone(), both.id.clone()]));
    let wx = srv.fetch(&tag_url("w,x").snapshot(), &h).await;
    assert_eq!(ids(&wx), vec![both.id.clone()]);
    let x = srv.fetch(&tag_url("x").snapshot(), &h).await;
    assert_eq!(
        ids(&x),
        sorted(vec![done.id.clone(), x_only.id.clone(), both.id.clone()])
    );
    assert!(ids(&srv.fetch(&tag_url("nobody").snapshot(), &h).await).is_empty());
    assert!(w.row(&old.id).is_none());

    // Tagged in the store, never published: the window does not see it.
    let retag = RunUpdate {
        tags: Some(vec!["x".into(), "w".into()]),
        ..RunUpdate::default()
    };
    let ms = srv.update(&done.id, retag).await;
    assert!(
        !cold_snapshot_carries(&srv, &h, "w", &done.id, Duration::from_secs(2)).await,
        "a cold snapshot read the store, not the window"
    );
    // Published: the window applies the record.
    srv.publish(&TestServer::record(&env, &done.id, &["x", "w"], None, ms))
        .await;
    assert!(
        cold_snapshot_carries(&srv, &h, "w", &done.id, Duration::from_secs(10)).await,
        "the published tag never reached a cold snapshot"
    );
}

/// A tag added to a finished run with no publish reaches cold snapshots served by a window
/// once the window is rebuilt (`caches.full_reread_ms`, here 1.5 s ± 25 %), as it reaches a
/// held feed at its full re-read.
#[tokio::test]
async fn a_lost_publish_reaches_window_snapshots_after_the_windows_rebuild() {
    let (srv, env) = window_server(1_500).await;
    srv.tagged_run(&env, &["late"]).await;
    let done = finished_older_run(&srv, &env, "other").await;
    let h = modern(&env.api_key);
    build_window(&srv, &h, ["late", "other"], 2).await;
    let retag = RunUpdate {
        tags: Some(vec!["other".into(), "late".into()]),
        ..RunUpdate::default()
    };
    srv.update(&done.id, retag).await; // never published
    assert!(
        cold_snapshot_carries(&srv, &h, "late", &done.id, Duration::from_secs(10)).await,
        "the retagged run never reached a cold snapshot"
    );
}

// ---------------------------------------------------------------------------------------------
// Run lookups cached by their immutable part (idle cost, BENCHMARKS.md)
// ---------------------------------------------------------------------------------------------

/// A run feed's URL lookup is cached for `caches.resource_cache_ttl_ms` (5 min): re-polls with
/// a run-scoped token cost no query. A tag-scoped token is decided on the run's CURRENT tags:
/// adding the tag grants access at once and removing it revokes it at once, even though the
/// cached lookup still holds the old tags.
#[tokio::test]
async fn run_lookups_are_cached_but_tag_grants_follow_the_current_tags() {
    let (srv, env) = TestServer::start_with_env(20_000, |c| {
        // Authentication lookups expire fast, run reads never (within the test): what is left
        // to count is the run URL lookup.
        c.caches.lookup_cache_ttl_ms = 100;
        c.caches.public_token_env_ttl_ms = 100;
        c.caches.run_cache_ttl_ms = 60_000;
    })
    .await;
    let run = srv.run(&env, RunSpec::default()).await;
    let by_id = modern(&srv.run_token(&env, &run));
    let by_tag = modern(&srv.token(&env, &["read:tags:vip"]));
    let url = run_url(&run.friendly_id).snapshot();
    let store = srv.running().store.clone();

    srv.fetch(&url, &by_id).await.assert_status(200);
    let before = settle_queries(&store).await;
    for _ in 0..3 {
        // Past the authentication cache's TTL (and the reference's 1 s lookup TTL scaled
        // down): each snapshot re-authenticates (one query) but must not look the run up again.
        tokio::time::sleep(Duration::from_millis(150)).await;
        srv.fetch(&url, &by_id).await.assert_status(200);
    }
    let spent = store.query_count() - before;
    assert_eq!(
        spent, 3,
        "3 snapshots: one authentication query each, no run lookup"
    );

    srv.fetch(&url, &by_tag).await.assert_status(403);
    let tagged = RunUpdate {
        tags: Some(vec!["vip".into()]),
        ..RunUpdate::default()
    };
    srv.update(&run.id, tagged).await;
    srv.fetch(&url, &by_tag).await.assert_status(200);
    let untagged = RunUpdate {
        tags: Some(vec![]),
        ..RunUpdate::default()
    };
    srv.update(&run.id, untagged).await;
    srv.fetch(&url, &by_tag).await.assert_status(403);
    // The id-scoped token is unaffected by the tag change.
    srv.fetch(&url, &by_id).await.assert_status(200);
}

/// Found by a fresh-clone trial: one request of environment A with a cursor 12 days ahead pushed
/// the process-wide cursor counter, so environment B's next cursor claimed a future wall time;
/// B's live poll, echoing it, trusted it as "up to date as of now" and skipped the replay of a
/// change made in between (held until a backstop). A client's cursor must move no other
/// client's: B's poll gets the change from the replay at once.
#[tokio::test]
async fn a_forged_future_cursor_of_one_environment_delays_no_other_environments_change() {
    let srv = TestServer::start(4_000).await;
    let (a, b) = (srv.env().await, srv.env().await);
    let run_a = srv.tagged_run(&a, &["fa"]).await;
    let run_b = srv.tagged_run(&b, &["fb"]).await;
    let forged = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as u64
        + (1 << 40)
        - 2)
    .to_string();
    let pushed = srv
        .fetch(
            &run_url(&run_a.friendly_id).snapshot().q("cursor", &forged),
            &modern(&a.api_key),
        )
        .await;
    pushed.assert_status(200);

    let hb = modern(&b.api_key);
    let url = run_url(&run_b.friendly_id);
    let snap = srv.fetch(&url.snapshot(), &hb).await;
    snap.assert_status(200);
    srv.change(&b, &run_b.id, &["fb"], None, "EXECUTING").await;
    // The condition under test, not a wait for an event: B's next poll comes more than
    // `HOP_BACK_AFTER_MS` (1 s) after its last response, so a future cursor would be taken as a
    // newer position; still inside the 2 s replay window, so the replay alone must deliver.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let live = srv.fetch(&url.live_after(&snap), &hb).await;
    live.assert_status(200);
    assert_eq!(
        live.ops(),
        vec![("update".to_string(), run_b.id.clone())],
        "{}",
        live.text
    );
    assert!(
        live.elapsed < Duration::from_millis(1_000),
        "replayed at once, not held until the backstop: {:?}",
        live.elapsed
    );
}
