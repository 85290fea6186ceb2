// The current Electric client generation, @electric-sql/client 1.5.x (npm alias electric-1-5),
// against runfeed: run, tag and batch feeds in long-poll AND SSE mode, offset=now, changes_only,
// subset snapshots refused, and the client's own watchdogs never tripped (docs/protocol.md §13;
// Electric's HTTP API, https://electric-sql.com/docs/api/http).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { setupEnvWorld, runPath, qs, openShape, raw, isUpToDate, sleep } from "./lib.mjs";

const HOLD_MS = 3000;
// Short streams, so that a test sees the server end one and the client resume at <lsn>_0.
const SSE_MAX_MS = 2500;
let world, fx, env, token, base;

before(async () => {
  ({ world, fx, env, token, base } = await setupEnvWorld({
    main: { holdMs: HOLD_MS, env: { RUNFEED_FEEDS__SSE_MAX_DURATION_MS: String(SSE_MAX_MS) } },
  }));
});

after(() => world?.teardown());

/** The three feeds of one new run (tagged `tag`, in a new batch): [name, path, run]. */
async function threeFeeds(tag) {
  const batch = await fx.createBatch(env);
  const run = await fx.createRun(env, { status: "PENDING", tags: [tag], batchId: batch.id });
  return {
    run,
    batch,
    feeds: [
      ["run", runPath(run)],
      ["tag", `/realtime/v1/runs${qs({ tags: tag })}`],
      ["batch", `/realtime/v1/batches/${batch.friendlyId}`],
    ],
  };
}

const statusOf = (c, id) => [...c.rows.values()].find((r) => r.id === id)?.status;
const sseRequests = (c) => c.requests.filter((r) => r.query.live_sse === "true");
const clientErrors = (c) => [...c.subscriberErrors, ...c.streamErrors];

for (const mode of ["long-poll", "SSE"]) {
  test(`1.5 client follows run, tag and batch feeds (${mode})`, async () => {
    const sse = mode === "SSE";
    const { run, batch, feeds } = await threeFeeds(`cur-${sse ? "sse" : "lp"}`);
    const clients = [];
    for (const [name, path] of feeds) {
      const c = await openShape({ baseUrl: base, path, token, client: "current", streamOptions: { liveSse: sse } });
      world.track(() => c.close());
      clients.push([name, c]);
    }
    for (const [name, c] of clients) {
      await c.waitFor(() => c.rows.size === 1, { what: `${name}: snapshot`, timeoutMs: 10000 });
      if (sse) {
        await c.waitFor(() => sseRequests(c).some((r) => r.status === 200), { what: `${name}: SSE stream open`, timeoutMs: 10000 });
      } else {
        await c.waitLive();
      }
    }
    await fx.updateAndPublish(run, { status: "EXECUTING" });
    for (const [name, c] of clients) {
      await c.waitFor(() => statusOf(c, run.id) === "EXECUTING", { what: `${name}: update (${mode})`, timeoutMs: 5000 });
    }
    const fresh = await fx.createAndPublish(env, { status: "PENDING", tags: [`cur-${sse ? "sse" : "lp"}`], batchId: batch.id });
    for (const [name, c] of clients.slice(1)) {
      await c.waitFor(() => statusOf(c, fresh.id) === "PENDING", { what: `${name}: new run (${mode})`, timeoutMs: 5000 });
    }
    if (sse) {
      // The server ends the streams (feeds.sse_max_duration_ms): the client reconnects at the
      // offset it built from global_last_seen_lsn, and the next change still arrives once.
      for (const [name, c] of clients) {
        await c.waitFor(() => sseRequests(c).some((r) => /^\d+_0$/.test(r.query.offset)), { what: `${name}: reconnected after the stream ended`, timeoutMs: SSE_MAX_MS * 3 });
      }
      await fx.updateAndPublish(run, { status: "COMPLETED_SUCCESSFULLY" });
      for (const [name, c] of clients) {
        await c.waitFor(() => statusOf(c, run.id) === "COMPLETED_SUCCESSFULLY", { what: `${name}: update after reconnect`, timeoutMs: 8000 });
        const streams = sseRequests(c);
        assert.ok(streams.length >= 2, `${name}: reconnected after the server ended the stream\n${c.describe()}`);
        assert.ok(streams.every((r) => r.status === 200 || r.status === null), c.describe());
        const resumed = streams.find((r) => /^\d+_0$/.test(r.query.offset));
        assert.ok(resumed, `${name}: a reconnect at <lsn>_0\n${c.describe()}`);
        assert.match(streams[0].headers["content-type"], /text\/event-stream/);
        assert.equal(streams[0].query.experimental_live_sse, "true");
        // Never fell back to long-polling (3 short SSE connections would make it).
        const lastSse = Math.max(...streams.map((r) => r.n));
        const longPollsAfter = c.liveRequests().filter((r) => r.n > streams[0].n && r.query.live_sse !== "true");
        assert.deepEqual(longPollsAfter, [], `${name}: no fallback (last SSE #${lastSse})\n${c.describe()}`);
        // Each change arrived once: one EXECUTING update in the published changes.
        const executing = c.changes().filter((m) => m.value?.id === run.id && m.value?.status === "EXECUTING");
        assert.equal(executing.length, 1, `${name}: no duplicate delivery\n${c.describe()}`);
      }
    }
    for (const [name, c] of clients) {
      assert.deepEqual(clientErrors(c).map(String), [], `${name}: ${c.describe()}`);
      assert.ok(!c.requests.some((r) => "cache-buster" in r.query), `${name}: no stale-handle retry\n${c.describe()}`);
      c.close();
    }
  });
}

test("1.5 client: offset=now goes live at once without history", async () => {
  const run = await fx.createRun(env, { status: "PENDING", tags: ["now"] });
  const c = await openShape({ baseUrl: base, path: runPath(run), token, client: "current", offset: "now", withShape: false });
  world.track(() => c.close());
  await c.waitLive();
  assert.equal(c.requests[0].query.offset, "now");
  assert.equal(c.requests[0].status, 200);
  assert.ok(c.requests[0].t1 - c.requests[0].t0 < 2000, "answered at once");
  assert.deepEqual(c.changes(), [], "no history");
  await fx.updateAndPublish(run, { status: "EXECUTING" });
  await c.waitFor(() => c.changes().some((m) => m.value?.status === "EXECUTING"), { what: "later change", timeoutMs: 5000 });
  assert.deepEqual(clientErrors(c).map(String), []);
  c.close();
});

test("1.5 client: log=changes_only starts without rows, then delivers changes", async () => {
  const run = await fx.createRun(env, { status: "PENDING", tags: ["co"] });
  for (const liveSse of [false, true]) {
    const c = await openShape({
      baseUrl: base,
      path: `/realtime/v1/runs${qs({ tags: "co" })}`,
      token,
      client: "current",
      withShape: false,
      streamOptions: { log: "changes_only", liveSse },
    });
    world.track(() => c.close());
    await c.waitFor(() => c.requests.some((r) => r.query.live === "true" && (r.status === null || r.query.live_sse)), {
      what: "live",
      timeoutMs: 10000,
    });
    assert.equal(c.requests[0].query.log, "changes_only");
    assert.deepEqual(c.changes(), [], "the snapshot carries no rows");
    const status = liveSse ? "COMPLETED_SUCCESSFULLY" : "EXECUTING";
    await fx.updateAndPublish(run, { status });
    await c.waitFor(() => c.changes().some((m) => m.value?.status === status), { what: `change (sse ${liveSse})`, timeoutMs: 5000 });
    assert.deepEqual(clientErrors(c).map(String), []);
    c.close();
  }
});

test("1.5 client: subset snapshots (GET and POST) are refused with a 400 naming the parameter", async () => {
  const run = await fx.createRun(env, { status: "PENDING", tags: ["sub"] });
  for (const subsetMethod of ["GET", "POST"]) {
    const c = await openShape({
      baseUrl: base,
      path: runPath(run),
      token,
      client: "current",
      withShape: false,
      streamOptions: { log: "changes_only", subsetMethod },
    });
    world.track(() => c.close());
    await c.waitLive();
    await assert.rejects(
      c.stream.fetchSnapshot({ where: `"status" = 'PENDING'`, limit: 1 }),
      (e) => {
        assert.equal(e.status, 400, `${subsetMethod}: ${e}`);
        assert.match(JSON.stringify(e.json ?? e.text ?? e.message), /subset__/, `${subsetMethod}: names the parameter`);
        return true;
      }
    );
    const req = c.requests.find((r) => r.status === 400);
    assert.ok(req, c.describe());
    c.close();
  }
  // Raw: the response is a JSON error, never a shape.
  const res = await raw(base, runPath(run, { log: "changes_only", offset: "-1", subset__limit: "1" }), { token });
  assert.equal(res.status, 400);
  assert.match(res.json.error, /^subset__limit/);
});

test("1.5 client's watchdogs never fire: no fast loop, no stale-handle retry, live requests answered before 45 s", async () => {
  const run = await fx.createRun(env, { status: "PENDING", tags: ["wd"] });
  // Starts with a handle this server never issued: 409, then the refetch must not repeat it.
  const c = await openShape({ baseUrl: base, path: runPath(run), token, client: "current", handle: "bogus", offset: "5_0" });
  world.track(() => c.close());
  await c.waitFor(() => c.rows.size === 1, { what: "refetched after 409", timeoutMs: 10000 });
  await c.waitLive();
  assert.equal(c.requests[0].status, 409);
  const refetch = c.requests[1];
  assert.equal(refetch.query.expired_handle, "bogus");
  assert.notEqual(refetch.headers["electric-handle"], "bogus", "never answers with the expired handle");
  // Quiet for two holds (two live requests answered without a change), then a burst of changes.
  const quietFrom = c.requests.length;
  await c.waitFor(() => c.requests.slice(quietFrom).filter((r) => r.query.live === "true" && r.t1).length >= 2, {
    what: "two quiet holds",
    timeoutMs: HOLD_MS * 4,
  });
  for (const status of ["EXECUTING", "PENDING", "EXECUTING"]) await fx.updateAndPublish(run, { status });
  await c.waitFor(() => statusOf(c, run.id) === "EXECUTING", { what: "burst delivered", timeoutMs: 5000 });
  // Not a wait for an event: the assertions below are about what does NOT happen (a fast loop
  // re-requesting the same offset within 500 ms), so the client gets that long to show one.
  await sleep(500);
  const done = c.requests.filter((r) => r.t1);
  for (const r of done.filter((r) => r.query.live === "true")) {
    assert.ok(r.t1 - r.t0 < HOLD_MS * 1.5 + HOLD_MS / 4 + 1000, `live request held ${r.t1 - r.t0} ms`);
  }
  for (let i = 0; i < c.requests.length; i++) {
    const same = c.requests.filter((r) => r.query.offset === c.requests[i].query.offset && r.t0 >= c.requests[i].t0 && r.t0 - c.requests[i].t0 < 500);
    assert.ok(same.length < 5, `fast loop at offset ${c.requests[i].query.offset}\n${c.describe()}`);
  }
  // 1.5 adds a cache-buster to the one request after a 409 (unconditionally); any other one
  // would be a stale-handle retry (a response repeating the expired handle).
  const busted = c.requests.filter((r) => "cache-buster" in r.query).map((r) => r.n);
  assert.deepEqual(busted, [2], c.describe());
  assert.deepEqual(clientErrors(c).filter((e) => e?.status !== 409).map(String), [], c.describe());
  assert.ok(c.batches.every((b) => b.messages?.length), "no empty batches");
  assert.ok(isUpToDate(c.batches.at(-1).messages.at(-1)));
  c.close();
});
