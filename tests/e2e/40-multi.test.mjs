// Multi-run feeds: tag list and batch (docs/trigger-dev.md §3, §5; §11 scenarios 21, 22, 23).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { setupWorld, raw, qs, openShape, sdkSubscribe, isUpToDate, isChange } from "./lib.mjs";

const HOLD_MS = 20000; // long: a change must arrive through its record, not the backstop
let world, fx, env, otherEnv, token, base;
const TAGS = ["org:acme", "user:alice"];
let inWindow1, inWindow2, onlyA, onlyB, tooOld, otherEnvRun;

before(async () => {
  world = await setupWorld({ servers: { main: { holdMs: HOLD_MS } } });
  fx = world.fixture;
  base = world.servers.main.baseUrl;
  env = await fx.createEnv();
  otherEnv = await fx.createEnv();
  token = await world.token(env.id, ["read:runs"]);
  const now = Date.now();
  inWindow1 = await fx.createRun(env, { tags: TAGS, createdAt: now - 10 * 60000 });
  inWindow2 = await fx.createRun(env, { tags: [...TAGS, "extra"], createdAt: now - 30 * 60000 });
  onlyA = await fx.createRun(env, { tags: [TAGS[0]], createdAt: now - 5 * 60000 });
  onlyB = await fx.createRun(env, { tags: [TAGS[1]], createdAt: now - 5 * 60000 });
  tooOld = await fx.createRun(env, { tags: TAGS, createdAt: now - 2 * 3600000 });
  otherEnvRun = await fx.createRun(otherEnv, { tags: TAGS, createdAt: now - 60000 });
});

after(async () => {
  await world?.teardown();
});

const tagPath = (params = {}) => `/realtime/v1/runs${qs({ createdAt: "1h", tags: TAGS.join(","), ...params })}`;
const idsOf = (messages) => messages.filter(isChange).map((m) => m.value.id);

test("scenario 21: tag feed snapshot", async () => {
  const res = await raw(base, tagPath({ log: "full", offset: "-1" }), { token });
  assert.equal(res.status, 200, res.text);
  for (const h of ["electric-handle", "electric-offset", "electric-schema", "electric-up-to-date"]) assert.ok(res.headers.has(h), h);
  assert.ok(isUpToDate(res.json.at(-1)));
  assert.ok(res.json.filter(isChange).every((m) => m.headers.operation === "insert"));
  assert.deepEqual(idsOf(res.json).sort(), [inWindow1.id, inWindow2.id].sort(), "runs carrying ALL tags, inside the window, this env only");

  const s = await sdkSubscribe({ baseUrl: base, token, kind: "tag", id: TAGS, createdAt: "1h" });
  world.track(() => s.close());
  await s.waitFor(() => s.latest.size >= 2 && s.pendingLive(), { what: "both runs and a live request" });
  assert.deepEqual([...s.latest.keys()].sort(), [inWindow1.friendlyId, inWindow2.friendlyId].sort());
  assert.equal(s.runs.length, 2, `each run yielded once:\n${s.describe()}`);
  assert.equal(s.state.error, null);
  s.close();
});

test("scenario 22: tag feed live", async () => {
  const c = await openShape({ baseUrl: base, path: tagPath(), token });
  world.track(() => c.close());
  const s = await sdkSubscribe({ baseUrl: base, token, kind: "tag", id: TAGS, createdAt: "1h" });
  world.track(() => s.close());
  await c.waitFor(() => c.rows.size === 2 && c.pendingLive(), { what: "snapshot + live" });
  await s.waitFor(() => s.latest.size === 2 && s.pendingLive(), { what: "SDK snapshot + live" });
  const batchesBefore = c.batches.length;
  const sdkBefore = s.runs.length;

  // Records that must NOT reach the feed go first; the matching run last. Records are applied in
  // order, so once the last one arrived the others have been considered and rejected.
  await fx.updateAndPublish(tooOld, { status: "EXECUTING" });
  await fx.updateAndPublish(otherEnvRun, { status: "EXECUTING" });
  const onlyOneTag = await fx.createAndPublish(env, { tags: [TAGS[0]] });
  const match = await fx.createAndPublish(env, { tags: TAGS });
  await c.waitFor(() => [...c.rows.values()].some((r) => r.id === match.id), { what: "the new matching run", timeoutMs: 5000 });
  await s.waitFor(() => s.latest.has(match.friendlyId), { what: "SDK: the new matching run", timeoutMs: 5000 });

  const live = c.batches.slice(batchesBefore).map((b) => b.messages ?? []);
  const liveIds = live.flatMap(idsOf);
  assert.deepEqual(liveIds, [match.id], `only the new matching run is sent (unchanged runs are not re-sent):\n${c.describe()}`);
  const carrying = live.find((m) => idsOf(m).includes(match.id));
  assert.ok(isUpToDate(carrying.at(-1)), "change + up-to-date");
  assert.deepEqual(
    [...c.rows.values()].map((r) => r.id).sort(),
    [inWindow1.id, inWindow2.id, match.id].sort()
  );
  for (const never of [onlyOneTag, tooOld, otherEnvRun]) {
    assert.ok(![...c.rows.values()].some((r) => r.id === never.id), `${never.id} never appears`);
    assert.ok(!s.latest.has(never.friendlyId), `SDK: ${never.friendlyId} never appears`);
  }
  assert.deepEqual(s.runs.slice(sdkBefore).map((r) => r.id), [match.friendlyId], s.describe());
  assert.deepEqual(c.streamErrors, []);
  c.close();
  s.close();
});

test("scenario 23: batch feed", async () => {
  const batch = await fx.createBatch(env);
  const otherBatch = await fx.createBatch(env);
  const b1 = await fx.createRun(env, { batchId: batch.id, status: "PENDING" });
  const b2 = await fx.createRun(env, { batchId: batch.id, status: "PENDING" });
  const elsewhere = await fx.createRun(env, { batchId: otherBatch.id });
  const unbatched = await fx.createRun(env, {});
  const path = `/realtime/v1/batches/${batch.friendlyId}`;

  const res = await raw(base, `${path}?log=full&offset=-1`, { token });
  assert.equal(res.status, 200, res.text);
  assert.ok(isUpToDate(res.json.at(-1)));
  assert.deepEqual(idsOf(res.json).sort(), [b1.id, b2.id].sort());

  const c1 = await openShape({ baseUrl: base, path, token });
  world.track(() => c1.close());
  const c2 = await openShape({ baseUrl: base, path, token });
  world.track(() => c2.close());
  const s = await sdkSubscribe({ baseUrl: base, token, kind: "batch", id: batch.friendlyId });
  world.track(() => s.close());
  for (const c of [c1, c2]) await c.waitFor(() => c.rows.size === 2 && c.pendingLive(), { what: "snapshot + live" });
  await s.waitFor(() => s.latest.size === 2 && s.pendingLive(), { what: "SDK snapshot + live" });

  await fx.updateAndPublish(elsewhere, { status: "EXECUTING" });
  await fx.updateAndPublish(unbatched, { status: "EXECUTING" });
  await fx.updateAndPublish(b1, { status: "EXECUTING" });
  const b3 = await fx.createAndPublish(env, { batchId: batch.id });

  const done = (c) => {
    const rows = [...c.rows.values()];
    return rows.length === 3 && rows.find((r) => r.id === b1.id)?.status === "EXECUTING" && rows.some((r) => r.id === b3.id);
  };
  for (const c of [c1, c2]) await c.waitFor(() => done(c), { what: "b1 EXECUTING and b3 present", timeoutMs: 5000 });
  await s.waitFor(() => s.latest.get(b1.friendlyId)?.status === "EXECUTING" && s.latest.has(b3.friendlyId), {
    what: "SDK: b1 EXECUTING and b3",
    timeoutMs: 5000,
  });
  for (const c of [c1, c2]) {
    const ids = [...c.rows.values()].map((r) => r.id).sort();
    assert.deepEqual(ids, [b1.id, b2.id, b3.id].sort(), "both subscribers hold exactly the batch's runs");
    assert.ok(!c.changes().some((m) => m.value?.id === elsewhere.id || m.value?.id === unbatched.id));
  }
  assert.ok(!s.latest.has(elsewhere.friendlyId) && !s.latest.has(unbatched.friendlyId));
  c1.close();
  c2.close();
  s.close();
});
