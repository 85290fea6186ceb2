// Error paths: 409 must-refetch, authentication, tenancy, not found, bad input, CORS
// (docs/protocol.md §5, §6, §10; docs/trigger-dev.md §2; §11 scenarios 11, 14, 15, 16, 17, 27).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { setupWorld, startServer, freePort, raw, qs, openShape, sdkSubscribe, sdkRequests, signJwt, jwtClaims, isUpToDate, isChange, sleep } from "./lib.mjs";

const HOLD_MS = 3000;
let world, fx, envA, envB, tokenA, tokenB, base;
let runA, runB, batchA, batchB;

before(async () => {
  world = await setupWorld({ servers: { main: { holdMs: HOLD_MS } } });
  fx = world.fixture;
  base = world.servers.main.baseUrl;
  envA = await fx.createEnv();
  envB = await fx.createEnv({ type: "PRODUCTION" });
  tokenA = await world.token(envA.id, ["read:runs"]);
  tokenB = await world.token(envB.id, ["read:runs"]);
  batchA = await fx.createBatch(envA);
  batchB = await fx.createBatch(envB);
  runA = await fx.createRun(envA, { tags: ["shared", "only-a"], batchId: batchA.id, payload: '{"tenant":"A-secret"}' });
  runB = await fx.createRun(envB, { tags: ["shared"], batchId: batchB.id, payload: '{"tenant":"B-secret"}' });
});

after(async () => {
  await world?.teardown();
});

const runPath = (run, params = {}) => `/realtime/v1/runs/${run.friendlyId}${qs(params)}`;
const ORIGIN = "http://app.example.test";

function assertJsonError(res, statuses, what) {
  assert.ok(statuses.includes(res.status), `${what}: want ${statuses.join("/")}, got ${res.status} ${res.text.slice(0, 300)}`);
  assert.match(res.headers.get("content-type") ?? "", /application\/json/, `${what}: content-type`);
  assert.ok(res.json && typeof res.json === "object" && !Array.isArray(res.json), `${what}: a JSON object body, got ${res.text}`);
  assert.equal(typeof res.json.error, "string", `${what}: {"error": …}, got ${res.text}`);
  assert.ok(res.headers.has("access-control-allow-origin"), `${what}: CORS header on ${res.status}`);
}

/** A 1.0.14 client hitting a fatal 4xx: exactly one request, the error to both callbacks, no retry. */
async function assertFatalOnce(c, status) {
  await c.waitFor(() => c.subscriberErrors.length >= 1 && c.streamErrors.length >= 1, {
    what: `a fatal ${status} reported to the subscriber and onError`,
  });
  assert.equal(c.subscriberErrors[0].status, status, c.describe());
  assert.equal(c.subscriberErrors[0].name, "FetchError");
  assert.equal(c.streamErrors[0].status, status);
  // The client's first retry would come after 100 ms; allow several times that.
  await sleep(600);
  assert.equal(c.requests.length, 1, `exactly one request, no retry:\n${c.describe()}`);
  assert.equal(c.rows.size, 0);
}

test("scenario 11: unknown handle → 409", async () => {
  const run = await fx.createRun(envA, { status: "EXECUTING" });
  const res = await raw(base, runPath(run, { cursor: "x", handle: "bogus", live: "true", log: "full", offset: "5_0" }), { token: tokenA });
  assert.equal(res.status, 409, `${res.status} ${res.text}`);
  assert.match(res.headers.get("content-type") ?? "", /application\/json/);
  assert.deepEqual(res.json, [{ headers: { control: "must-refetch" } }]);
  assert.ok(res.headers.get("electric-handle"), "409 carries the new electric-handle");
  const nonLive = await raw(base, runPath(run, { handle: "bogus", log: "full", offset: "5_0" }), { token: tokenA });
  assert.equal(nonLive.status, 409, `non-live with a bogus handle: ${nonLive.status} ${nonLive.text}`);

  const c = await openShape({ baseUrl: base, path: runPath(run), token: tokenA, offset: "5_0", handle: "bogus" });
  world.track(() => c.close());
  await c.waitFor(() => c.rows.size === 1 && c.requests.some((r) => r.status === 200), { what: "refetch after 409", timeoutMs: 10000 });
  const [first, second] = c.requests;
  assert.equal(first.status, 409, c.describe());
  assert.equal(second.query.offset, "-1");
  assert.equal(second.query.handle, first.headers["electric-handle"]);
  assert.equal(second.query.expired_handle, "bogus");
  assert.equal(second.status, 200, `the refetch must succeed, not 409 again:\n${c.describe()}`);
  assert.equal(c.requests.filter((r) => r.status === 409).length, 1);
  assert.ok(c.batches.some((b) => (b.messages ?? []).some((m) => m?.headers?.control === "must-refetch")), "must-refetch published");
  assert.equal([...c.rows.values()][0].friendlyId, run.friendlyId);
  assert.deepEqual(c.streamErrors, []);
  c.close();
});

test("scenario 11b: handles from before a server restart → 409, Shape and SDK repopulate", async () => {
  // The instance comes back with another handle secret (as after a restart with no configured
  // secret, or a rotation), so every handle the clients hold is unknown to it: the real clients
  // must go through 409 must-refetch and come back with the row (the SDK re-yields it).
  const port = await freePort();
  let server = await startServer({
    databaseUrl: world.db.url,
    holdMs: 20000,
    label: "restartable",
    listen: `127.0.0.1:${port}`,
    env: { RUNFEED_SERVER__HANDLE_SECRET: "e2e-secret-before-restart" },
  });
  world.track(() => server.stop());
  const run = await fx.createRun(envA, { status: "EXECUTING" });
  const c = await openShape({ baseUrl: server.baseUrl, path: runPath(run), token: tokenA });
  world.track(() => c.close());
  const s = await sdkSubscribe({ baseUrl: server.baseUrl, token: tokenA, kind: "run", id: run.friendlyId });
  world.track(() => s.close());
  await c.waitFor(() => c.rows.size === 1 && c.pendingLive(), { what: "Shape live" });
  await s.waitFor(() => s.runs.length === 1 && s.pendingLive(), { what: "SDK live" });

  server = await server.restart({ RUNFEED_SERVER__HANDLE_SECRET: "e2e-secret-after-restart" });
  await fx.updateAndPublish(run, { status: "COMPLETED_SUCCESSFULLY", completedAt: Date.now() });
  await c.waitFor(() => c.requests.some((r) => r.status === 409) && [...c.rows.values()][0]?.status === "COMPLETED_SUCCESSFULLY", {
    what: "409 then the refetched row",
    timeoutMs: 15000,
  });
  const i409 = c.requests.findIndex((r) => r.status === 409);
  const refetch = c.requests[i409 + 1];
  assert.equal(refetch.query.offset, "-1");
  assert.equal(refetch.status, 200, c.describe());
  assert.ok(c.batches.some((b) => (b.messages ?? []).some((m) => m?.headers?.control === "must-refetch")));
  await s.waitFor(() => s.runs.at(-1)?.finishedAt, { what: "SDK re-yields the (now finished) run", timeoutMs: 15000 });
  assert.equal(s.runs.at(-1).id, run.friendlyId);
  assert.deepEqual(c.streamErrors, []);
  c.close();
  s.close();
});

test("scenario 14: auth missing / bad", async () => {
  const now = Math.floor(Date.now() / 1000);
  // Controls: the root secret key and a token signed here the way trigger.dev signs them both work,
  // so the failures below are about the token and nothing else.
  const good = signJwt(jwtClaims(envA.id, ["read:runs"]), envA.apiKey);
  for (const [what, token] of [
    ["secret key", envA.apiKey],
    ["self-signed JWT", good],
  ]) {
    const ok = await raw(base, runPath(runA, { log: "full", offset: "-1" }), { token });
    assert.equal(ok.status, 200, `${what}: ${ok.status} ${ok.text}`);
  }
  const bad = [
    ["no Authorization header", undefined],
    ["empty bearer", ""],
    ["garbage", "not-a-token"],
    ["malformed JWT", "aaa.bbb.ccc"],
    ["expired JWT", signJwt(jwtClaims(envA.id, ["read:runs"], { iat: now - 3600, exp: now - 60 }), envA.apiKey)],
    ["JWT signed with another key", signJwt(jwtClaims(envA.id, ["read:runs"]), envB.apiKey)],
    ["JWT without pub:true", signJwt({ ...jwtClaims(envA.id, ["read:runs"]), pub: undefined }, envA.apiKey)],
    ["JWT with a wrong audience", signJwt(jwtClaims(envA.id, ["read:runs"], { aud: "https://evil.example" }), envA.apiKey)],
    ["JWT without issuer", signJwt({ ...jwtClaims(envA.id, ["read:runs"]), iss: undefined }, envA.apiKey)],
    ["JWT for an unknown environment", signJwt(jwtClaims("cnosuchenvironment000000", ["read:runs"]), envA.apiKey)],
    ["unknown secret key", "tr_dev_AAAAAAAAAAAAAAAAAAAAAAAA"],
  ];
  for (const [what, token] of bad) {
    const headers = token === "" ? { Authorization: "Bearer " } : {};
    const res = await raw(base, runPath(runA, { log: "full", offset: "-1" }), { token: token === "" ? undefined : token, headers });
    assertJsonError(res, [401], what);
    assert.ok(!res.text.includes("A-secret"), `${what}: no row data`);
  }
  for (const path of [`/realtime/v1/runs${qs({ log: "full", offset: "-1", tags: "shared" })}`, `/realtime/v1/batches/${batchA.friendlyId}?log=full&offset=-1`]) {
    assertJsonError(await raw(base, path, {}), [401], `no token on ${path}`);
  }

  const expired = bad.find(([w]) => w === "expired JWT")[1];
  const c = await openShape({ baseUrl: base, path: runPath(runA), token: expired });
  world.track(() => c.close());
  await assertFatalOnce(c, 401);
  c.close();

  // SDK: no run is yielded; the 401 stops the feed after one request.
  const before = sdkRequests.length;
  const s = await sdkSubscribe({ baseUrl: base, token: expired, kind: "run", id: runA.friendlyId });
  world.track(() => s.close());
  await s.waitFor(() => sdkRequests.slice(before).some((r) => r.status === 401), { what: "the SDK's 401" });
  await sleep(600);
  assert.equal(s.runs.length, 0);
  assert.equal(sdkRequests.slice(before).filter((r) => r.url.includes(runA.friendlyId)).length, 1, s.describe());
  s.close();
});

test("scenario 15: forbidden / other tenant", async () => {
  // A's token for B's run, batch and (same tag) list.
  const cross = await raw(base, runPath(runB, { log: "full", offset: "-1" }), { token: tokenA });
  assertJsonError(cross, [403, 404], "env A token on env B run");
  assert.ok(!cross.text.includes("B-secret") && !cross.text.includes(runB.id), `no row data: ${cross.text}`);
  const crossBatch = await raw(base, `/realtime/v1/batches/${batchB.friendlyId}?log=full&offset=-1`, { token: tokenA });
  assertJsonError(crossBatch, [403, 404], "env A token on env B batch");
  const list = await raw(base, `/realtime/v1/runs${qs({ log: "full", offset: "-1", tags: "shared" })}`, { token: tokenA });
  assert.equal(list.status, 200, list.text);
  const ids = list.json.filter(isChange).map((m) => m.value.id);
  assert.deepEqual(ids, [runA.id], "the tag feed only ever lists the token's environment");

  // Scoped tokens of the right environment that do not cover the resource.
  const otherRun = await fx.createRun(envA, {});
  const wrongRun = await world.token(envA.id, [`read:runs:${otherRun.friendlyId}`]);
  const wrongTag = await world.token(envA.id, ["read:tags:nope"]);
  const writeOnly = await world.token(envA.id, ["write:runs"]);
  for (const [what, token] of [
    ["read:runs:<other run>", wrongRun],
    ["read:tags:<absent tag>", wrongTag],
    ["write:runs", writeOnly],
  ]) {
    const res = await raw(base, runPath(runA, { log: "full", offset: "-1" }), { token });
    assertJsonError(res, [403, 404], what);
    assert.ok(!res.text.includes("A-secret"), `${what}: no row data`);
  }
  const wrongListTag = await world.token(envA.id, ["read:tags:shared"]);
  assertJsonError(
    await raw(base, `/realtime/v1/runs${qs({ log: "full", offset: "-1", tags: "only-a" })}`, { token: wrongListTag }),
    [403],
    "read:tags:shared on tags=only-a"
  );
  assertJsonError(
    await raw(base, `/realtime/v1/runs${qs({ log: "full", offset: "-1", tags: "shared" })}`, { token: wrongRun }),
    [403],
    "read:runs:<id> does not grant the list route"
  );
  // Controls: the matching scopes do grant access.
  for (const scope of [`read:runs:${runA.friendlyId}`, "read:tags:only-a", `read:batch:${batchA.friendlyId}`, "read:tasks", "read:all"]) {
    const t = await world.token(envA.id, [scope]);
    const res = await raw(base, runPath(runA, { log: "full", offset: "-1" }), { token: t });
    assert.equal(res.status, 200, `${scope} grants the run: ${res.status} ${res.text}`);
  }

  // One request, no retry, for the real client.
  const c = await openShape({ baseUrl: base, path: runPath(runA), token: wrongRun });
  world.track(() => c.close());
  const status = (await raw(base, runPath(runA, { log: "full", offset: "-1" }), { token: wrongRun })).status;
  await assertFatalOnce(c, status);
  c.close();

  // A handle minted for B's feed never yields B's rows on A's feed.
  const snapB = await raw(base, runPath(runB, { log: "full", offset: "-1" }), { token: tokenB });
  assert.equal(snapB.status, 200, snapB.text);
  const handleB = snapB.headers.get("electric-handle");
  const offsetB = snapB.headers.get("electric-offset");
  for (const params of [
    { handle: handleB, log: "full", offset: offsetB },
    { cursor: "", handle: handleB, live: "true", log: "full", offset: offsetB },
  ]) {
    const res = await raw(base, runPath(runA, params), { token: tokenA });
    assert.ok([409, 403].includes(res.status), `B's handle on A's run (${JSON.stringify(params)}): ${res.status} ${res.text}`);
    assert.ok(!res.text.includes("B-secret") && !res.text.includes(runB.id), `no B rows: ${res.text}`);
  }
  const tagB = await raw(base, `/realtime/v1/runs${qs({ log: "full", offset: "-1", tags: "shared" })}`, { token: tokenB });
  assert.equal(tagB.status, 200);
  const res = await raw(
    base,
    `/realtime/v1/runs${qs({ handle: tagB.headers.get("electric-handle"), log: "full", offset: tagB.headers.get("electric-offset"), tags: "shared" })}`,
    { token: tokenA }
  );
  assert.ok([200, 403, 409].includes(res.status), `B's tag handle with A's token: ${res.status}`);
  assert.ok(!res.text.includes("B-secret") && !res.text.includes(runB.id), `B's tag handle never yields B's rows to A: ${res.text}`);
});

test("scenario 16: not found", async () => {
  for (const path of [
    "/realtime/v1/runs/run_doesnotexist0000000000?log=full&offset=-1",
    "/realtime/v1/batches/batch_doesnotexist00000000?log=full&offset=-1",
  ]) {
    assertJsonError(await raw(base, path, { token: tokenA }), [404], path);
  }
  const c = await openShape({ baseUrl: base, path: "/realtime/v1/runs/run_doesnotexist0000000000", token: tokenA });
  world.track(() => c.close());
  await assertFatalOnce(c, 404);
  c.close();
  const b = await openShape({ baseUrl: base, path: "/realtime/v1/batches/batch_doesnotexist00000000", token: tokenA });
  world.track(() => b.close());
  await assertFatalOnce(b, 404);
  b.close();
});

test("scenario 17: bad input", async () => {
  const run = await fx.createRun(envA, {});
  const cases = [
    ["malformed offset", runPath(run, { log: "full", offset: "abc" })],
    ["offset ≠ -1 without a handle", runPath(run, { log: "full", offset: "5_0" })],
    ["empty tag", `/realtime/v1/runs${qs({ log: "full", offset: "-1", tags: "a,,b" })}`],
    ["tag with a double quote", `/realtime/v1/runs${qs({ log: "full", offset: "-1", tags: 'a"b' })}`],
    ["bad createdAt", `/realtime/v1/runs${qs({ createdAt: "yesterday", log: "full", offset: "-1", tags: "shared" })}`],
  ];
  for (const [what, path] of cases) {
    const res = await raw(base, path, { token: tokenA });
    assertJsonError(res, [400, 422], what);
  }
  // Nothing changed: the same run still serves normally.
  const ok = await raw(base, runPath(run, { log: "full", offset: "-1" }), { token: tokenA });
  assert.equal(ok.status, 200);
  assert.ok(isUpToDate(ok.json.at(-1)));
});

test("scenario 27: CORS", async () => {
  const requestHeaders = "authorization, trigger-version, x-trigger-electric-version, x-trigger-api-version, x-trigger-branch";
  for (const path of [runPath(runA), "/realtime/v1/runs?tags=shared", `/realtime/v1/batches/${batchA.friendlyId}`]) {
    const pre = await raw(base, path, {
      method: "OPTIONS",
      sdk: false,
      headers: { Origin: ORIGIN, "Access-Control-Request-Method": "GET", "Access-Control-Request-Headers": requestHeaders },
    });
    assert.ok(pre.status >= 200 && pre.status < 300, `preflight ${path}: ${pre.status}`);
    const allowOrigin = pre.headers.get("access-control-allow-origin");
    assert.ok(allowOrigin === "*" || allowOrigin === ORIGIN, `preflight allow-origin: ${allowOrigin}`);
    const methods = (pre.headers.get("access-control-allow-methods") ?? "").toLowerCase();
    assert.ok(methods === "*" || methods.split(/\s*,\s*/).includes("get"), `preflight allow-methods: ${methods}`);
    const allowed = (pre.headers.get("access-control-allow-headers") ?? "").toLowerCase().split(/\s*,\s*/);
    if (!allowed.includes("*")) {
      for (const h of requestHeaders.split(/\s*,\s*/)) assert.ok(allowed.includes(h), `preflight allows ${h}: ${allowed}`);
    }
  }

  const electric = ["electric-offset", "electric-handle", "electric-schema", "electric-cursor", "electric-up-to-date"];
  const checkCors = (res, what) => {
    const allowOrigin = res.headers.get("access-control-allow-origin");
    assert.ok(allowOrigin === "*" || allowOrigin === ORIGIN, `${what} (${res.status}): allow-origin ${allowOrigin}`);
    const exposed = (res.headers.get("access-control-expose-headers") ?? "").toLowerCase().split(/\s*,\s*/);
    if (!exposed.includes("*")) {
      for (const h of electric) assert.ok(exposed.includes(h), `${what} (${res.status}): exposes ${h}: ${exposed}`);
    }
  };
  const get = (path, token) => raw(base, path, { token, headers: { Origin: ORIGIN } });
  const snap = await get(runPath(runA, { log: "full", offset: "-1" }), tokenA);
  assert.equal(snap.status, 200);
  checkCors(snap, "snapshot");
  const live = await get(
    runPath(runA, { cursor: "", handle: snap.headers.get("electric-handle"), live: "true", log: "full", offset: snap.headers.get("electric-offset") }),
    tokenA
  );
  assert.ok([200, 204].includes(live.status));
  checkCors(live, "live timeout");
  const wrongRun = await world.token(envA.id, ["read:tags:nope"]);
  const cases = [
    ["401", runPath(runA, { log: "full", offset: "-1" }), "garbage", 401],
    ["403", runPath(runA, { log: "full", offset: "-1" }), wrongRun, 403],
    ["404", "/realtime/v1/runs/run_nope00000000000000000?log=full&offset=-1", tokenA, 404],
    ["409", runPath(runA, { handle: "bogus", log: "full", offset: "5_0" }), tokenA, 409],
  ];
  for (const [what, path, token, status] of cases) {
    const res = await get(path, token);
    assert.equal(res.status, status, `${what}: ${res.status} ${res.text}`);
    checkCors(res, what);
  }
});
