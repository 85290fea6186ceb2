// Client generations: the legacy 0.6.3 client (no x-trigger-electric-version header, legacy header
// and param names) and the modern naming used by 1.0.0-beta.1 and 1.0.14
// (docs/protocol.md §1, §8, §10; §11 scenarios 25, 26).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { setupEnvWorld, raw, qs, runPath, openShape, isUpToDate, isChange } from "./lib.mjs";

const HOLD_MS = 20000;
let world, fx, env, token, base;

before(async () => {
  ({ world, fx, env, token, base } = await setupEnvWorld({ main: { holdMs: HOLD_MS } }));
});

after(() => world?.teardown());

test("scenario 25: legacy 0.6.3 client", async () => {
  const run = await fx.createRun(env, { status: "PENDING", tags: ["legacy"] });
  const snap = await raw(base, runPath(run, { offset: "-1" }), { token, sdk: false });
  assert.equal(snap.status, 200, snap.text);
  for (const h of ["electric-shape-id", "electric-chunk-last-offset", "electric-schema"]) {
    assert.ok(snap.headers.has(h), `legacy snapshot header ${h}: ${JSON.stringify([...snap.headers])}`);
  }
  assert.ok(isUpToDate(snap.json.at(-1)));
  assert.equal(snap.json.filter(isChange)[0].value.friendlyId, run.friendlyId);
  const shapeId = snap.headers.get("electric-shape-id");
  const offset = snap.headers.get("electric-chunk-last-offset");
  const tip = await raw(base, runPath(run, { offset, shape_id: shapeId }), { token, sdk: false });
  assert.equal(tip.status, 200, `legacy catch-up with shape_id: ${tip.status} ${tip.text}`);
  assert.ok(tip.ms < 2000, "catch-up is not held");
  assert.ok(tip.headers.has("electric-shape-id") && tip.headers.has("electric-chunk-last-offset"));

  // The real 0.6.3 ShapeStream + Shape: up to date, then a live update.
  const c = await openShape({ baseUrl: base, path: runPath(run), token, client: "legacy" });
  world.track(() => c.close());
  await c.waitFor(() => c.rows.size === 1 && c.pendingLive(), { what: "legacy client up to date and live" });
  const second = c.requests[1];
  assert.equal(second.query.live, "true");
  assert.ok(second.query.shape_id, `the legacy client sends shape_id: ${JSON.stringify(second.query)}`);
  assert.equal(second.query.offset, c.requests[0].headers["electric-chunk-last-offset"]);
  assert.equal(second.query.handle, undefined);
  const key = [...c.rows.keys()][0];
  await fx.updateAndPublish(run, { status: "EXECUTING" });
  await c.waitFor(() => c.rows.get(key)?.status === "EXECUTING", { what: "legacy Shape sees the update", timeoutMs: 5000 });
  c.close();

  // Error paths never answer 400 to a header-less client (0.6.3 loops on 400 without delay).
  const errorCases = [
    ["bad token", runPath(run, { offset: "-1" }), "garbage", [401]],
    ["unknown run", "/realtime/v1/runs/run_nope00000000000000000?offset=-1", token, [404]],
    ["malformed offset", runPath(run, { offset: "abc" }), token, [401, 403, 404, 422]],
    ["offset without shape_id", runPath(run, { offset: "5_0" }), token, [401, 403, 404, 422]],
    ["bad tag", `/realtime/v1/runs${qs({ offset: "-1", tags: "a,,b" })}`, token, [401, 403, 404, 422]],
  ];
  for (const [what, path, t, statuses] of errorCases) {
    const res = await raw(base, path, { token: t, sdk: false });
    assert.ok(statuses.includes(res.status), `legacy ${what}: want ${statuses.join("/")}, got ${res.status} ${res.text}`);
    assert.match(res.headers.get("content-type") ?? "", /application\/json/);
  }
  const conflict = await raw(base, runPath(run, { offset: "5_0", shape_id: "bogus" }), { token, sdk: false });
  assert.equal(conflict.status, 409, conflict.text);
  assert.ok(conflict.headers.get("electric-shape-id"), "a legacy 409 names the new shape in electric-shape-id");
  assert.deepEqual(conflict.json, [{ headers: { control: "must-refetch" } }]);
});

test("scenario 26: modern client naming", async () => {
  const run = await fx.createRun(env, { status: "PENDING" });
  const snap = await raw(base, runPath(run, { log: "full", offset: "-1" }), { token });
  assert.equal(snap.status, 200);
  assert.ok(snap.headers.get("electric-handle"), "electric-handle");
  assert.ok(snap.headers.get("electric-offset"), "electric-offset");

  const beta = await openShape({ baseUrl: base, path: runPath(run), token, client: "beta" });
  world.track(() => beta.close());
  const modern = await openShape({ baseUrl: base, path: runPath(run), token, client: "modern" });
  world.track(() => modern.close());
  for (const c of [beta, modern]) {
    await c.waitFor(() => c.rows.size === 1 && c.pendingLive(), { what: `${c.client} client live` });
    assert.ok(c.pendingLive().query.handle, "live requests carry handle");
  }
  await fx.updateAndPublish(run, { status: "EXECUTING" });
  for (const c of [beta, modern]) {
    await c.waitFor(() => [...c.rows.values()][0]?.status === "EXECUTING", { what: `${c.client} sees the update`, timeoutMs: 5000 });
    assert.deepEqual(c.streamErrors, []);
  }
  beta.close();
  modern.close();
});
