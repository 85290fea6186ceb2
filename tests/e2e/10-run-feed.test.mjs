// Single-run feed: snapshot, value encoding, header rules per request kind, tolerated params,
// skipColumns, timestamps (docs/protocol.md §2–§4, §11 scenarios 1, 2, 3, 7, 8, 9, 12, 13, 24, 28).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import {
  setupEnvWorld,
  raw,
  runPath,
  openShape,
  sdkSubscribe,
  isUpToDate,
  isChange,
  WIRE_TS,
  wireTs,
} from "./lib.mjs";

const HOLD_MS = 3000;
let world, fx, env, token, short;

before(async () => {
  ({ world, fx, env, token, base: short } = await setupEnvWorld({ short: { holdMs: HOLD_MS } }));
});

after(() => world?.teardown());

function assertEndsUpToDate(res) {
  assert.ok(Array.isArray(res.json), `body is not a JSON array: ${res.text.slice(0, 300)}`);
  assert.ok(isUpToDate(res.json.at(-1)), `body does not end with up-to-date: ${res.text.slice(0, 300)}`);
}

function assertHeaders(res, names, what) {
  const missing = names.filter((h) => !res.headers.has(h));
  assert.deepEqual(missing, [], `${what}: missing ${missing.join(", ")} (status ${res.status}, headers ${JSON.stringify([...res.headers])})`);
}

/** Initial snapshot of `run` on `base`: returns {res, handle, offset}. */
async function snapshot(base, run, params = {}) {
  const res = await raw(base, runPath(run, { log: "full", offset: "-1", ...params }), { token });
  assert.equal(res.status, 200, `snapshot: ${res.status} ${res.text}`);
  return { res, handle: res.headers.get("electric-handle"), offset: res.headers.get("electric-offset") };
}

test("scenario 01: initial snapshot, one run", async () => {
  const run = await fx.createRun(env, { tags: ["user:alice"] });
  const res = await raw(short, runPath(run, { log: "full", offset: "-1" }), { token });
  assert.equal(res.status, 200, res.text);
  assertHeaders(res, ["electric-handle", "electric-offset", "electric-schema", "electric-up-to-date"], "initial");
  assert.match(res.headers.get("content-type") ?? "", /application\/json/);
  assert.ok(Array.isArray(res.json), res.text);
  assert.equal(res.json.length, 2, `want [insert, up-to-date], got ${res.text}`);
  const [insert, upToDate] = res.json;
  assert.ok(isChange(insert));
  assert.equal(insert.headers.operation, "insert");
  assert.equal(insert.value.friendlyId, run.friendlyId);
  assert.equal(insert.value.id, run.id);
  assert.ok(isUpToDate(upToDate));

  const c = await openShape({ baseUrl: short, path: runPath(run), token });
  world.track(() => c.close());
  await c.waitFor(() => c.rows.size === 1 && c.pendingLive(), { what: "1 row in Shape and a live request", timeoutMs: 10000 });
  const [first, second] = c.requests;
  assert.equal(first.query.offset, "-1");
  assert.equal(first.query.log, "full");
  assert.equal(first.query.live, undefined);
  assert.equal(first.status, 200);
  assert.equal(second.query.live, "true", c.describe());
  assert.equal(second.query.handle, first.headers["electric-handle"]);
  assert.equal(second.query.offset, first.headers["electric-offset"]);
  assert.ok("cursor" in second.query, "the live request carries cursor");
  assert.equal(c.nonLiveRequests().length, 1, `no prefetch/catch-up request may follow the snapshot:\n${c.describe()}`);
  const nonEmpty = c.batches.filter((b) => b.messages?.length);
  assert.equal(nonEmpty.length, 1, `one batch:\n${c.describe()}`);
  assert.deepEqual([...c.rows.values()].map((r) => r.friendlyId), [run.friendlyId]);
  assert.deepEqual(c.streamErrors, []);
  c.close();
});

test("scenario 02: typed values", async () => {
  const now = Date.now();
  const tags = ["a,b", 'quo"te', "back\\slash", "NULL", "plain"];
  const error = { type: "STRING_ERROR", raw: "boom" };
  const run = await fx.createRun(env, {
    tags,
    status: "COMPLETED_SUCCESSFULLY",
    number: 42,
    usageDurationMs: 1234,
    isTest: true,
    costInCents: 0.55,
    baseCostInCents: 1e-7,
    ttl: "10m",
    payload: '{"hello":"world"}',
    metadata: '{"progress":0.5}',
    output: '{"ok":true}',
    error,
    realtimeStreams: ["default"],
    createdAt: now - 60000,
    queuedAt: now - 59000,
    delayUntil: now - 58000,
    startedAt: now - 50000,
    completedAt: now - 1000,
    expiredAt: now - 500,
  });

  const res = await raw(short, runPath(run, { log: "full", offset: "-1" }), { token });
  assert.equal(res.status, 200, res.text);
  const schema = JSON.parse(res.headers.get("electric-schema"));
  assert.equal(schema.runTags?.dims, 1, `runTags is an array column: ${JSON.stringify(schema)}`);
  assert.notEqual(schema.number?.type, "int8", "number must not be int8 (bigint breaks the SDK)");

  const c = await openShape({ baseUrl: short, path: runPath(run), token });
  world.track(() => c.close());
  await c.waitFor(() => c.rows.size === 1, { what: "the row in Shape" });
  const row = [...c.rows.values()][0];
  c.close();
  assert.equal(typeof row.number, "number");
  assert.equal(row.number, 42);
  assert.equal(typeof row.usageDurationMs, "number");
  assert.equal(row.usageDurationMs, 1234);
  assert.equal(row.isTest, true);
  assert.equal(row.costInCents, 0.55);
  assert.equal(row.baseCostInCents, 1e-7);
  assert.deepEqual(row.runTags, tags);
  assert.deepEqual(row.error, error);
  assert.deepEqual(row.realtimeStreams, ["default"]);
  assert.equal(row.payload, '{"hello":"world"}');
  assert.equal(row.status, "COMPLETED_SUCCESSFULLY");
  for (const col of ["createdAt", "updatedAt", "startedAt", "completedAt", "queuedAt", "delayUntil", "expiredAt"]) {
    assert.equal(typeof row[col], "string", `${col} stays a string`);
    assert.match(row[col], WIRE_TS, `${col} has no zone`);
  }
  assert.equal(row.createdAt, run.createdAt);
  assert.deepEqual(c.streamErrors, []);

  // SDK: the row validates and converts (a completed run: one yield, then the iterator ends).
  const s = await sdkSubscribe({ baseUrl: short, token, kind: "run", id: run.friendlyId });
  world.track(() => s.close());
  await s.waitFor(() => s.runs.length >= 1, { what: "the SDK run" });
  const r = s.runs[0];
  assert.equal(r.id, run.friendlyId);
  assert.ok(r.createdAt instanceof Date);
  assert.equal(r.createdAt.getTime(), now - 60000);
  assert.deepEqual(r.tags, tags);
  assert.deepEqual(r.payload, { hello: "world" });
  assert.deepEqual(r.output, { ok: true });
  assert.deepEqual(r.metadata, { progress: 0.5 });
  assert.equal(r.isTest, true);
  assert.equal(r.costInCents, 0.55);
  assert.equal(r.durationMs, 1234);
  assert.equal(r.status, "COMPLETED");
  assert.ok(r.error, "error is mapped");
  assert.ok(r.finishedAt instanceof Date);
  assert.equal(s.state.error, null);
  s.close();
});

test("scenario 03: nulls", async () => {
  const nullTags = await fx.createRun(env, { tags: null });
  const emptyTags = await fx.createRun(env, { tags: [] });
  for (const run of [nullTags, emptyTags]) {
    const res = await raw(short, runPath(run, { log: "full", offset: "-1" }), { token });
    assert.equal(res.status, 200, res.text);
    const value = res.json.find(isChange)?.value;
    assert.ok(value, res.text);
    for (const col of ["startedAt", "completedAt", "output", "error", "runTags", "delayUntil", "expiredAt", "ttl", "metadata"]) {
      assert.ok(col in value, `${col} present`);
      assert.equal(value[col], null, `${col} is JSON null (tags ${JSON.stringify(run.runTags)}), got ${JSON.stringify(value[col])}`);
    }
    assert.ok(!res.text.includes('"NULL"'), `never the string "NULL": ${res.text}`);

    const s = await sdkSubscribe({ baseUrl: short, token, kind: "run", id: run.friendlyId });
    world.track(() => s.close());
    await s.waitFor(() => s.runs.length >= 1, { what: "the SDK run" });
    const r = s.runs[0];
    assert.deepEqual(r.tags, []);
    assert.equal(r.finishedAt, undefined);
    assert.equal(r.startedAt, undefined);
    assert.equal(r.output, undefined);
    assert.equal(r.error, undefined);
    assert.equal(s.state.error, null);
    s.close();
  }
});

test("scenario 07: header presence by request kind", async () => {
  const run = await fx.createRun(env, {});
  const { res: initial, handle, offset } = await snapshot(short, run);
  assertHeaders(initial, ["electric-offset", "electric-handle", "electric-schema"], "initial");

  const live = await raw(short, runPath(run, { cursor: "", handle, live: "true", log: "full", offset }), { token });
  assert.equal(live.status === 200 || live.status === 204, true, `live: ${live.status} ${live.text}`);
  assertHeaders(live, ["electric-offset", "electric-handle", "electric-cursor"], "live");
  const cursor = live.headers.get("electric-cursor");

  const catchUp = await raw(short, runPath(run, { handle, log: "full", offset }), { token });
  assert.equal(catchUp.status, 200, catchUp.text);
  assertHeaders(catchUp, ["electric-offset", "electric-handle", "electric-schema"], "catch-up (handle, no live)");

  const resume = await raw(short, runPath(run, { cursor, handle, log: "full", offset }), { token });
  assert.equal(resume.status, 200, resume.text);
  assertHeaders(resume, ["electric-offset", "electric-handle", "electric-schema"], "resume (cursor, no live)");

  // The real client through snapshot + one full live cycle: no MissingHeadersError.
  const c = await openShape({ baseUrl: short, path: runPath(run), token });
  world.track(() => c.close());
  await c.waitFor(() => c.liveRequests().some((r) => r.status !== null) && c.pendingLive(), {
    what: "one answered live request and the next one in flight",
    timeoutMs: HOLD_MS * 2 + 5000,
  });
  assert.deepEqual(c.streamErrors.map(String), []);
  assert.deepEqual(c.subscriberErrors.map(String), []);
  c.close();
});

test("scenario 08: resume after pause", async () => {
  const run = await fx.createRun(env, {});
  const { handle, offset } = await snapshot(short, run);
  const live = await raw(short, runPath(run, { cursor: "", handle, live: "true", log: "full", offset }), { token });
  const cursor = live.headers.get("electric-cursor") ?? "0";
  const res = await raw(short, runPath(run, { cursor, handle, log: "full", offset }), { token });
  assert.equal(res.status, 200, res.text);
  assert.ok(res.ms < HOLD_MS / 2, `answered immediately, not held (took ${res.ms} ms, hold ${HOLD_MS} ms)`);
  assertHeaders(res, ["electric-schema", "electric-offset", "electric-handle"], "resume");
  assertEndsUpToDate(res);
});

test("scenario 09: prefetch tolerance", async () => {
  const run = await fx.createRun(env, {});
  const { handle, offset } = await snapshot(short, run);
  const res = await raw(short, runPath(run, { handle, log: "full", offset }), { token });
  assert.equal(res.status, 200, res.text);
  assert.ok(res.ms < HOLD_MS / 2, `answered immediately (took ${res.ms} ms)`);
  assertHeaders(res, ["electric-up-to-date", "electric-offset", "electric-handle"], "tip request");
  assertEndsUpToDate(res);
});

test("scenario 12: initial request carrying a stale handle", async () => {
  const run = await fx.createRun(env, {});
  const res = await raw(short, runPath(run, { expired_handle: "older", handle: "old", log: "full", offset: "-1" }), { token });
  assert.equal(res.status, 200, `offset=-1 with a stale handle is a snapshot: ${res.status} ${res.text}`);
  assertEndsUpToDate(res);
  const inserts = res.json.filter(isChange);
  assert.equal(inserts.length, 1);
  assert.equal(inserts[0].value.friendlyId, run.friendlyId);
  assertHeaders(res, ["electric-handle", "electric-offset", "electric-schema"], "snapshot");
});

test("scenario 13: extra protocol params tolerated", async () => {
  const run = await fx.createRun(env, {});
  const initials = [
    { log: "full", offset: "-1" },
    { cursor: "", log: "full", offset: "-1" },
    { expired_handle: "x", log: "full", offset: "-1" },
    { live: "false", log: "full", offset: "-1" },
    { offset: "-1" },
    { cursor: "", expired_handle: "x", live: "false", log: "full", offset: "-1" },
  ];
  for (const params of initials) {
    const res = await raw(short, runPath(run, params), { token });
    assert.equal(res.status, 200, `${JSON.stringify(params)}: ${res.status} ${res.text}`);
    assertEndsUpToDate(res);
  }
  const { handle, offset } = await snapshot(short, run);
  for (const params of [
    { cursor: "", handle, live: "false", log: "full", offset },
    { cursor: "", expired_handle: "x", handle, log: "full", offset },
  ]) {
    const res = await raw(short, runPath(run, params), { token });
    assert.equal(res.status, 200, `${JSON.stringify(params)}: ${res.status} ${res.text}`);
    assert.ok(res.ms < HOLD_MS / 2, `${JSON.stringify(params)} is not live: answered in ${res.ms} ms`);
    assertEndsUpToDate(res);
  }
});

test("scenario 24: skipColumns", async () => {
  const run = await fx.createRun(env, { payload: '{"secret":1}', output: '{"out":2}', status: "EXECUTING", metadata: '{"m":1}' });
  const res = await raw(short, runPath(run, { log: "full", offset: "-1", skipColumns: "payload,output,id" }), { token });
  assert.equal(res.status, 200, res.text);
  const value = res.json.find(isChange)?.value;
  assert.ok(value, res.text);
  assert.ok(!("payload" in value), "payload skipped");
  assert.ok(!("output" in value), "output skipped");
  assert.equal(value.id, run.id, "id is reserved: never skipped");
  for (const col of ["friendlyId", "taskIdentifier", "status", "createdAt"]) assert.ok(col in value, `${col} kept`);
  const schema = JSON.parse(res.headers.get("electric-schema"));
  assert.ok(!("payload" in schema) && !("output" in schema), `schema without payload/output: ${JSON.stringify(schema)}`);
  assert.ok("id" in schema);

  // The token's realtime.skipColumns claim replaces the URL parameter.
  const claimToken = await world.token(env.id, ["read:runs"], { skipColumns: ["metadata"] });
  const res2 = await raw(short, runPath(run, { log: "full", offset: "-1", skipColumns: "payload" }), { token: claimToken });
  assert.equal(res2.status, 200, res2.text);
  const value2 = res2.json.find(isChange)?.value;
  assert.ok(!("metadata" in value2), "claim skipColumns applies");
  assert.ok("payload" in value2, "the URL skipColumns is replaced by the claim");

  const s = await sdkSubscribe({ baseUrl: short, token, kind: "run", id: run.friendlyId, skipColumns: ["payload", "output"] });
  world.track(() => s.close());
  await s.waitFor(() => s.runs.length >= 1, { what: "the SDK run" });
  const r = s.runs[0];
  assert.equal(r.id, run.friendlyId);
  assert.equal(r.payload, undefined);
  assert.equal(r.output, undefined);
  assert.equal(r.status, "EXECUTING");
  assert.equal(s.state.error, null);
  s.close();
});

test("scenario 28: timestamps", async () => {
  const base = Date.now() - 120000;
  const ms = (k) => base - (base % 1000) + k;
  const expected = {
    createdAt: ms(123),
    updatedAt: ms(5456),
    queuedAt: ms(1001),
    startedAt: ms(2789),
    completedAt: ms(4999),
    delayUntil: ms(7),
    expiredAt: ms(90),
  };
  const run = await fx.createRun(env, { ...expected });
  const res = await raw(short, runPath(run, { log: "full", offset: "-1" }), { token });
  assert.equal(res.status, 200, res.text);
  const value = res.json.find(isChange).value;
  for (const [col, v] of Object.entries(expected)) {
    assert.match(value[col], WIRE_TS, `${col}=${value[col]}`);
    assert.equal(value[col], wireTs(v), col);
  }
  const s = await sdkSubscribe({ baseUrl: short, token, kind: "run", id: run.friendlyId });
  world.track(() => s.close());
  await s.waitFor(() => s.runs.length >= 1, { what: "the SDK run" });
  const r = s.runs[0];
  assert.equal(r.createdAt.getTime(), ms(123));
  assert.equal(r.updatedAt.getTime(), ms(5456));
  assert.equal(r.startedAt.getTime(), ms(2789));
  assert.equal(r.finishedAt.getTime(), ms(4999));
  s.close();
});
