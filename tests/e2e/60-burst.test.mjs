// Burst: several real clients (Shape and SDK) on run, tag and batch feeds while 100 random
// updates (and a few new runs) are committed and published over ~3 s. Afterwards every client's
// view must equal the database. The live hold is 20 s, so nothing may rely on the backstop.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { setupEnvWorld, openShape, sdkSubscribe, publish, qs, waitFor, withTimeout, sleep } from "./lib.mjs";

const HOLD_MS = 20000;
const UPDATES = 100;
const SPREAD_MS = 3000;
let world, fx, env, token, base;

before(async () => {
  ({ world, fx, env, token, base } = await setupEnvWorld({ main: { holdMs: HOLD_MS } }));
});

after(() => world?.teardown());

// A deterministic PRNG so a failure can be replayed (seed printed in the test output).
function prng(seed) {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const STATUSES = ["PENDING", "DEQUEUED", "EXECUTING", "WAITING_TO_RESUME", "RETRYING_AFTER_FAILURE", "DELAYED"];

test("burst: 100 random updates, every client's final view equals the database", { timeout: 90000 }, async (t) => {
  const seed = Number(process.env.BURST_SEED ?? Date.now() % 1e9);
  t.diagnostic(`seed ${seed} (BURST_SEED=${seed} replays it)`);
  const rand = prng(seed);
  const pick = (xs) => xs[Math.floor(rand() * xs.length)];

  const batch = await fx.createBatch(env);
  const runs = [];
  for (let i = 0; i < 6; i++) runs.push(await fx.createRun(env, { tags: ["burst", `n:${i}`], batchId: i % 2 ? batch.id : null }));
  for (let i = 0; i < 2; i++) runs.push(await fx.createRun(env, { tags: null, batchId: batch.id }));
  const quiet = await fx.createRun(env, { tags: ["quiet"] });

  const tagPath = `/realtime/v1/runs${qs({ createdAt: "1h", tags: "burst" })}`;
  const batchPath = `/realtime/v1/batches/${batch.friendlyId}`;
  const runPath = (r) => `/realtime/v1/runs/${r.friendlyId}`;

  // [name, client, expected-set query]
  const tagWhere = [`"runtimeEnvironmentId" = $1 AND "runTags" @> ARRAY['burst']`, [env.id]];
  const batchWhere = [`"batchId" = $1`, [batch.id]];
  const runWhere = (r) => [`id = $1`, [r.id]];
  const shapes = [
    ["shape tag #1", await openShape({ baseUrl: base, path: tagPath, token }), tagWhere],
    ["shape tag #2", await openShape({ baseUrl: base, path: tagPath, token }), tagWhere],
    ["shape batch", await openShape({ baseUrl: base, path: batchPath, token }), batchWhere],
    ["shape run 0", await openShape({ baseUrl: base, path: runPath(runs[0]), token }), runWhere(runs[0])],
    ["shape run 7", await openShape({ baseUrl: base, path: runPath(runs[7]), token }), runWhere(runs[7])],
    ["shape run quiet", await openShape({ baseUrl: base, path: runPath(quiet), token }), runWhere(quiet)],
  ];
  const sdks = [
    ["sdk tag", await sdkSubscribe({ baseUrl: base, token, kind: "tag", id: ["burst"], createdAt: "1h" }), tagWhere],
    ["sdk batch", await sdkSubscribe({ baseUrl: base, token, kind: "batch", id: batch.friendlyId }), batchWhere],
    ["sdk run 1", await sdkSubscribe({ baseUrl: base, token, kind: "run", id: runs[1].friendlyId }), runWhere(runs[1])],
  ];
  for (const [, c] of [...shapes, ...sdks]) world.track(() => c.close());
  for (const [name, c] of shapes) await c.waitFor(() => c.rows.size > 0 && c.pendingLive(), { what: `${name} live`, timeoutMs: 15000 });
  for (const [name, s] of sdks) await s.waitFor(() => s.latest.size > 0 && s.pendingLive(), { what: `${name} live`, timeoutMs: 15000 });

  // The burst: each change is committed, then its record is published (trigger.dev's order).
  // Commits are sequential and paced over ~SPREAD_MS; each publish starts right after its commit
  // without waiting for earlier publishes (as several webapp instances would), so records of one
  // run may reach Redis out of order.
  const t0 = Date.now();
  const inFlight = new Set();
  const publishLater = (p) => {
    const tracked = p.finally(() => inFlight.delete(tracked));
    inFlight.add(tracked);
  };
  for (let i = 1; i <= UPDATES; i++) {
    if (i % 30 === 0) {
      const row = await fx.createRun(env, { tags: ["burst", `new:${i}`], batchId: batch.id, usageDurationMs: i });
      runs.push(row);
      publishLater(publish({ envId: env.id, runId: row.id, tags: row.runTags, batchId: batch.id, updatedAtMs: row.updatedAtMs }));
    } else {
      const run = pick(runs);
      const row = await fx.updateRun(run.id, { status: pick(STATUSES), usageDurationMs: i, metadata: JSON.stringify({ i }) });
      const partial = rand() < 0.2;
      publishLater(
        publish({
          envId: env.id,
          runId: row.id,
          tags: partial ? undefined : row.runTags ?? [],
          batchId: row.batchId ?? undefined,
          updatedAtMs: row.updatedAtMs,
        })
      );
    }
    const due = t0 + (i * SPREAD_MS) / UPDATES;
    if (Date.now() < due) await sleep(due - Date.now()); // pacing of the writer, not synchronisation
  }
  await withTimeout(Promise.all([...inFlight]), 20000, "the last publishes");
  const burstMs = Date.now() - t0;
  const tLast = Date.now();

  const mismatches = async () => {
    const out = [];
    for (const [name, c, [where, params]] of shapes) {
      const want = await fx.runsWhere(where, params);
      const got = new Map([...c.rows.values()].map((r) => [r.id, r]));
      for (const [id, row] of want) {
        const g = got.get(id);
        if (!g) out.push(`${name}: missing ${id}`);
        else if (g.updatedAt !== row.updatedAt || g.status !== row.status || g.usageDurationMs !== row.usageDurationMs)
          out.push(`${name}: ${id} has ${g.status}/${g.updatedAt}/${g.usageDurationMs}, db ${row.status}/${row.updatedAt}/${row.usageDurationMs}`);
      }
      for (const id of got.keys()) if (!want.has(id)) out.push(`${name}: extra ${id}`);
    }
    for (const [name, s, [where, params]] of sdks) {
      const want = await fx.runsWhere(where, params);
      const byFriendly = new Map([...want.values()].map((r) => [r.friendlyId, r]));
      for (const [fid, row] of byFriendly) {
        const g = s.latest.get(fid);
        if (!g) out.push(`${name}: missing ${fid}`);
        else if (g.updatedAt.getTime() !== row.updatedAtMs || g.durationMs !== row.usageDurationMs)
          out.push(`${name}: ${fid} has ${g.updatedAt.toISOString()}/${g.durationMs}, db ${row.updatedAt}/${row.usageDurationMs}`);
      }
      for (const fid of s.latest.keys()) if (!byFriendly.has(fid)) out.push(`${name}: extra ${fid}`);
      if (s.state.error) out.push(`${name}: iterator threw ${s.state.error.message}`);
    }
    return out;
  };

  let last = [];
  await waitFor(
    async () => {
      last = await mismatches();
      return last.length === 0;
    },
    { what: "every client to equal the database", timeoutMs: 8000, intervalMs: 100, diag: () => last.join("\n") }
  );
  const convergeMs = Date.now() - tLast;
  const requests = shapes.reduce((n, [, c]) => n + c.requests.length, 0);
  t.diagnostic(`${UPDATES} changes committed and published in ${burstMs} ms; all ${shapes.length + sdks.length} clients equal the database ${convergeMs} ms after the last publish; ${requests} Shape requests in total`);
  for (const [name, c] of shapes) {
    assert.deepEqual(c.streamErrors, [], `${name} errors`);
    const rate = c.requests.length / ((Date.now() - t0) / 1000 + 2);
    assert.ok(rate < 20, `${name}: ${c.requests.length} requests, no tight loop`);
  }
  // The quiet run's feed saw no change at all during the burst.
  const quietShape = shapes.find(([n]) => n === "shape run quiet")[1];
  assert.equal(quietShape.changes().length, 1, `the quiet run's feed only has its snapshot:\n${quietShape.describe()}`);
  for (const [, c] of [...shapes, ...sdks]) c.close();
});
