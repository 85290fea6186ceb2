// Live long-polls of the single-run feed: holds, wakes, completion, request rates, latency, and a
// plain Node consumer (docs/protocol.md §4, §5.3, §9; §11 scenarios 4, 5, 6, 10, 29).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import path from "node:path";
import { performance } from "node:perf_hooks";
import { setupEnvWorld, raw, runPath, openShape, sdkSubscribe, isUpToDate, isChange, sleep, waitFor, E2E_DIR, SDK_HEADERS } from "./lib.mjs";

const SHORT_HOLD_MS = 2500;
const LONG_HOLD_MS = 20000; // the production default: a change that only arrived through the backstop would take ~20 s
let world, fx, env, token, short, long;

before(async () => {
  let bases;
  ({ world, fx, env, token, bases } = await setupEnvWorld({ short: { holdMs: SHORT_HOLD_MS }, long: { holdMs: LONG_HOLD_MS } }));
  ({ short, long } = bases);
});

after(() => world?.teardown());

/** A Shape and an SDK subscription of `run` on the long-hold server; the Shape holds a live request. */
async function followLive(run) {
  const c = await openShape({ baseUrl: long, path: runPath(run), token });
  world.track(() => c.close());
  const s = await sdkSubscribe({ baseUrl: long, token, kind: "run", id: run.friendlyId });
  world.track(() => s.close());
  await c.waitLive();
  return { c, s };
}

test("scenario 04: live hold with no change", async (t) => {
  const run = await fx.createRun(env, { status: "EXECUTING" });
  const snap = await raw(short, runPath(run, { log: "full", offset: "-1" }), { token });
  assert.equal(snap.status, 200, snap.text);
  const handle = snap.headers.get("electric-handle");
  const offset = snap.headers.get("electric-offset");

  const live = await raw(short, runPath(run, { cursor: "", handle, live: "true", log: "full", offset }), { token });
  t.diagnostic(`live request with no change held ${live.ms} ms (hold ${SHORT_HOLD_MS} ms ±15%)`);
  assert.ok(live.status === 200 || live.status === 204, `${live.status} ${live.text}`);
  assert.ok(live.ms >= SHORT_HOLD_MS * 0.85 - 100, `held ${live.ms} ms < hold - 15%`);
  assert.ok(live.ms <= SHORT_HOLD_MS * 1.15 + 1000, `held ${live.ms} ms > hold + 15%`);
  assert.equal(live.headers.get("electric-offset"), offset, "offset unchanged");
  assert.ok(live.headers.has("electric-cursor"), "electric-cursor on a live response");
  if (live.status === 200) {
    assert.equal(live.json.length, 1, live.text);
    assert.ok(isUpToDate(live.json[0]), live.text);
  }

  // Real clients over two holds: the Shape and the SDK see nothing new.
  const c = await openShape({ baseUrl: short, path: runPath(run), token });
  world.track(() => c.close());
  const s = await sdkSubscribe({ baseUrl: short, token, kind: "run", id: run.friendlyId });
  world.track(() => s.close());
  await c.waitFor(() => c.rows.size === 1 && c.pendingLive(), { what: "Shape up to date and live" });
  await s.waitFor(() => s.runs.length === 1 && s.pendingLive(), { what: "SDK's first run and a live request" });
  const t0 = Date.now();
  const notifications = c.shapeNotifications;
  await c.waitFor(() => c.liveRequests().filter((r) => r.status !== null).length >= 2, {
    what: "two live requests answered",
    timeoutMs: SHORT_HOLD_MS * 3 + 5000,
  });
  const elapsed = Date.now() - t0;
  const answered = c.liveRequests().filter((r) => r.status !== null);
  for (const r of answered) {
    assert.ok(r.status === 200 || r.status === 204, `live status ${r.status}`);
    assert.ok(r.t1 - r.t0 >= SHORT_HOLD_MS * 0.85 - 100, `live request answered after ${r.t1 - r.t0} ms:\n${c.describe()}`);
    // The Shape took its own snapshot (its own offset): a timeout echoes the offset it sent.
    assert.equal(r.headers["electric-offset"], r.query.offset, "offset unchanged");
    assert.ok("electric-cursor" in r.headers);
  }
  const maxLive = Math.ceil(elapsed / (SHORT_HOLD_MS * 0.85)) + 1;
  assert.ok(c.liveRequests().length <= maxLive, `${c.liveRequests().length} live requests in ${elapsed} ms:\n${c.describe()}`);
  assert.equal(c.shapeNotifications, notifications, "Shape subscribers not notified by empty live responses");
  assert.equal(s.runs.length, 1, `SDK yields nothing new:\n${s.describe()}`);
  c.close();
  s.close();
});

test("scenario 05: live wake on change", async () => {
  const run = await fx.createRun(env, { status: "PENDING", tags: ["user:bob"] });
  const { c, s } = await followLive(run);
  await s.waitFor(() => s.runs.length === 1 && s.pendingLive(), { what: "SDK first run + live request" });
  const held = c.pendingLive();
  const key = [...c.rows.keys()][0];
  const notifications = c.shapeNotifications;

  const t0 = Date.now();
  await fx.updateAndPublish(run, { status: "EXECUTING", startedAt: Date.now() });
  await c.waitFor(() => c.rows.get(key)?.status === "EXECUTING", { what: "Shape row EXECUTING", timeoutMs: 5000 });
  assert.equal(held.status, 200, c.describe());
  assert.ok(held.t1 - t0 < 2000, `the held request returned ${held.t1 - t0} ms after the change (hold ${LONG_HOLD_MS} ms)`);
  assert.notEqual(held.headers["electric-offset"], held.query.offset, "offset advanced");
  assert.ok("electric-cursor" in held.headers);
  const batch = c.batches.find((b) => b.at >= t0 && (b.messages ?? []).some(isChange));
  assert.ok(batch, c.describe());
  const changes = batch.messages.filter(isChange);
  assert.equal(changes.length, 1, c.describe());
  assert.equal(changes[0].headers.operation, "update", c.describe());
  assert.equal(changes[0].value.status, "EXECUTING");
  assert.ok(isUpToDate(batch.messages.at(-1)), "ends with up-to-date");
  assert.equal(c.shapeNotifications, notifications + 1, "Shape notified once with the merged row");
  assert.equal(c.rows.get(key).friendlyId, run.friendlyId, "merged row keeps the other columns");
  await s.waitFor(() => s.runs.at(-1)?.status === "EXECUTING", { what: "SDK run EXECUTING", timeoutMs: 5000 });
  assert.ok(s.runs.at(-1).startedAt instanceof Date);
  c.close();
  s.close();
});

test("latency: a committed + published change reaches the client well under a second", async (t) => {
  const run = await fx.createRun(env, { status: "EXECUTING", tags: ["latency"] });
  const { c, s } = await followLive(run);
  await s.waitFor(() => s.runs.length >= 1 && s.pendingLive(), { what: "SDK live" });
  const key = [...c.rows.keys()][0];
  const shapeMs = [];
  const sdkMs = [];
  for (let i = 1; i <= 5; i++) {
    await c.waitLive();
    await s.waitLive();
    const t0 = performance.now();
    await fx.updateAndPublish(run, { metadata: JSON.stringify({ step: i }) });
    const tPublished = performance.now();
    await waitFor(() => c.rows.get(key)?.metadata === JSON.stringify({ step: i }), {
      what: `Shape sees step ${i}`,
      timeoutMs: 5000,
      intervalMs: 2,
      diag: () => c.describe(),
    });
    shapeMs.push({ total: performance.now() - t0, afterPublish: performance.now() - tPublished });
    await waitFor(() => s.runs.at(-1)?.metadata?.step === i, { what: `SDK sees step ${i}`, timeoutMs: 5000, intervalMs: 2, diag: () => s.describe() });
    sdkMs.push(performance.now() - t0);
  }
  const fmt = (xs) => xs.map((x) => x.toFixed(0)).join(", ");
  t.diagnostic(`Shape latency, DB write start → Shape row (ms): ${fmt(shapeMs.map((x) => x.total))}`);
  t.diagnostic(`Shape latency, publish done → Shape row (ms): ${fmt(shapeMs.map((x) => x.afterPublish))}`);
  t.diagnostic(`SDK latency, DB write start → SDK run (ms): ${fmt(sdkMs)}`);
  for (const x of shapeMs) assert.ok(x.total < 1000, `latency ${x.total.toFixed(0)} ms ≥ 1000 ms`);
  for (const x of sdkMs) assert.ok(x < 1000, `SDK latency ${x.toFixed(0)} ms ≥ 1000 ms`);
  c.close();
  s.close();
});

test("scenario 06: completion", async () => {
  const run = await fx.createRun(env, { status: "EXECUTING", startedAt: Date.now() - 5000 });
  const s = await sdkSubscribe({ baseUrl: long, token, kind: "run", id: run.friendlyId });
  world.track(() => s.close());
  await s.waitFor(() => s.runs.length === 1 && s.pendingLive(), { what: "SDK first run + live request" });
  assert.equal(s.runs[0].finishedAt, undefined);

  await fx.updateAndPublish(run, { status: "COMPLETED_SUCCESSFULLY", completedAt: Date.now(), output: '{"done":true}' });
  await s.waitFor(() => s.runs.at(-1)?.finishedAt, { what: "a run with finishedAt", timeoutMs: 5000 });
  const last = s.runs.at(-1);
  assert.ok(last.finishedAt instanceof Date);
  assert.equal(last.status, "COMPLETED");
  assert.deepEqual(last.output, { done: true });
  assert.equal(last.isCompleted, true);
  // The SDK ends the subscription itself (stopOnCompletion) and aborts its next poll.
  await s.waitFor(() => s.state.ended, { what: "the subscribeToRun iterator to end", timeoutMs: 5000 });
  await s.waitFor(() => s.requests().every((r) => r.status !== null || r.aborted), {
    what: "no SDK request left in flight",
    timeoutMs: 3000,
  });
  // The server survives the abort and still serves the finished run. A snapshot may come from
  // the single-run read cache (run_cache_ttl_ms, 250 ms: it collapses refetch bursts), so it can
  // trail a change by that much — its cursor makes the next live poll deliver the change.
  await waitFor(
    async () => {
      const res = await raw(long, runPath(run, { log: "full", offset: "-1" }), { token });
      assert.equal(res.status, 200);
      return res.json.find(isChange).value.status === "COMPLETED_SUCCESSFULLY";
    },
    { what: "a snapshot of the finished run", timeoutMs: 2000, intervalMs: 50 }
  );
});

test("scenario 10: no tight loops", async (t) => {
  const run = await fx.createRun(env, { status: "EXECUTING" });
  const c = await openShape({ baseUrl: long, path: runPath(run), token });
  world.track(() => c.close());
  await c.waitFor(() => c.rows.size === 1, { what: "snapshot" });
  // Absence of traffic can only be observed by letting time pass: 10 s of an unchanged run.
  await sleep(10000);
  const nonLive = c.nonLiveRequests().length;
  const live = c.liveRequests().length;
  t.diagnostic(`10 s on an unchanged run (hold ${LONG_HOLD_MS} ms): ${nonLive} non-live, ${live} live requests`);
  assert.ok(nonLive <= 2, `≤ 2 non-live requests, got ${nonLive}:\n${c.describe()}`);
  assert.ok(live <= 1, `≤ 1 live request, got ${live}:\n${c.describe()}`);
  assert.ok(c.pendingLive(), "the live request is still held");
  c.close();
});

test("scenario 29: node consumer without onError", async (t) => {
  const run = await fx.createRun(env, { status: "EXECUTING", tags: ["plain"] });
  const seconds = 9; // compressed from 5 minutes: snapshot + 3 short holds + a change
  const child = spawn(
    process.execPath,
    [path.join(E2E_DIR, "support", "plain-consumer.mjs"), `${short}${runPath(run)}`, token, String(seconds)],
    { stdio: ["ignore", "pipe", "pipe"], env: { ...process.env, SDK_HEADERS: JSON.stringify(SDK_HEADERS) } }
  );
  world.track(() => child.kill("SIGKILL"));
  const lines = [];
  let stderr = "";
  child.stdout.on("data", (d) => lines.push(...String(d).split("\n").filter(Boolean).map((l) => JSON.parse(l))));
  child.stderr.on("data", (d) => (stderr += d));
  const exited = new Promise((resolve) => child.on("exit", (code, signal) => resolve({ code, signal })));
  await waitFor(() => lines.some((l) => l.kind === "rows"), { what: "the consumer's first rows", timeoutMs: 8000, diag: () => stderr });
  await fx.updateAndPublish(run, { status: "COMPLETED_SUCCESSFULLY", completedAt: Date.now() });
  const { code, signal } = await waitFor(() => Promise.race([exited, sleep(50).then(() => null)]), {
    what: "the consumer to exit",
    timeoutMs: (seconds + 10) * 1000,
  });
  t.diagnostic(`consumer: ${lines.filter((l) => l.kind === "batch").length} batches, exit ${code ?? signal}`);
  assert.equal(code, 0, `consumer crashed (exit ${code ?? signal}):\n${stderr}\n${JSON.stringify(lines)}`);
  assert.ok(lines.some((l) => l.kind === "rows" && l.statuses.includes("COMPLETED_SUCCESSFULLY")), JSON.stringify(lines));
  assert.ok(lines.filter((l) => l.kind === "batch").length >= 3, `snapshot + live batches: ${JSON.stringify(lines)}`);
});
