// Fleet : two runfeed instances behind a tiny round-robin proxy — every request of a
// real client lands on the other instance than the one before (a non-sticky load balancer).
// With the same handle secret and the fleet-shared replay cursors, no update may be missed or
// wait for the 20 s backstop, and every client's final view must equal the database.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import { spawnSync } from "node:child_process";
import { setupWorld, openShape, sdkSubscribe, raw, qs, waitFor, REDIS_URL } from "./lib.mjs";

const HOLD_MS = 20000;
const FLEET_ENV = {
  RUNFEED_SERVER__HANDLE_SECRET: "e2e-fleet-secret",
  RUNFEED_ROUTER__HOP_MARGIN_MS: "200",
};
let world, fx, env, token, proxy, proxyBase;
const hits = [0, 0];

/** Round-robin HTTP proxy over `upstreams` (streams bodies, forwards aborts). */
function roundRobin(upstreams) {
  let next = 0;
  const server = http.createServer((req, res) => {
    const i = next++ % upstreams.length;
    hits[i]++;
    const target = new URL(req.url, upstreams[i]);
    const up = http.request(target, { method: req.method, headers: { ...req.headers, host: target.host } }, (r) => {
      res.writeHead(r.statusCode, r.headers);
      r.pipe(res);
    });
    up.on("error", () => res.destroy());
    res.on("close", () => up.destroy()); // the client went away: so does the upstream poll
    req.pipe(up);
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve(server)));
}

/** Subscribers of an env's channel on Redis (both instances must be subscribed). */
function numsub(envId) {
  const url = new URL(REDIS_URL);
  const out = spawnSync("redis-cli", ["-h", url.hostname, "-p", url.port || "6379", "PUBSUB", "NUMSUB", `realtime:env:{${envId}}`], {
    encoding: "utf8",
  });
  return Number(out.stdout.trim().split("\n")[1] ?? 0);
}

before(async () => {
  world = await setupWorld({
    servers: { a: { holdMs: HOLD_MS, env: FLEET_ENV }, b: { holdMs: HOLD_MS, env: FLEET_ENV } },
  });
  fx = world.fixture;
  env = await fx.createEnv();
  token = await world.token(env.id, ["read:runs"]);
  proxy = await roundRobin([world.servers.a.baseUrl, world.servers.b.baseUrl]);
  proxyBase = `http://127.0.0.1:${proxy.address().port}`;
});

after(async () => {
  await world?.teardown();
  proxy?.close();
});

test("fleet: real clients alternating between two instances miss no update", { timeout: 90000 }, async (t) => {
  const batch = await fx.createBatch(env);
  const runs = [];
  for (let i = 0; i < 4; i++) runs.push(await fx.createRun(env, { tags: ["fleet"], batchId: i % 2 ? batch.id : null }));
  // Both instances already serve this environment (other clients), so their streams are warm.
  for (const s of [world.servers.a, world.servers.b]) {
    const warm = await raw(s.baseUrl, `/realtime/v1/runs/${runs[0].friendlyId}${qs({ offset: "-1" })}`, { token });
    assert.equal(warm.status, 200, warm.text);
  }
  await waitFor(() => numsub(env.id) >= 2, { what: "both instances subscribed", timeoutMs: 10000 });

  const tagPath = `/realtime/v1/runs${qs({ createdAt: "1h", tags: "fleet" })}`;
  const batchPath = `/realtime/v1/batches/${batch.friendlyId}`;
  const shape = await openShape({ baseUrl: proxyBase, path: tagPath, token });
  const shapeBatch = await openShape({ baseUrl: proxyBase, path: batchPath, token });
  const sdkRun = await sdkSubscribe({ baseUrl: proxyBase, token, kind: "run", id: runs[0].friendlyId });
  const sdkTag = await sdkSubscribe({ baseUrl: proxyBase, token, kind: "tag", id: ["fleet"], createdAt: "1h" });
  for (const c of [shape, shapeBatch, sdkRun, sdkTag]) world.track(() => c.close());
  await shape.waitFor(() => shape.rows.size === 4 && shape.pendingLive(), { what: "Shape tag live", timeoutMs: 15000 });
  await shapeBatch.waitFor(() => shapeBatch.rows.size === 2 && shapeBatch.pendingLive(), { what: "Shape batch live", timeoutMs: 15000 });
  await sdkTag.waitFor(() => sdkTag.latest.size === 4 && sdkTag.pendingLive(), { what: "SDK tag live", timeoutMs: 15000 });
  await sdkRun.waitFor(() => sdkRun.latest.size === 1 && sdkRun.pendingLive(), { what: "SDK run live", timeoutMs: 15000 });

  const latencies = [];
  for (let i = 1; i <= 12; i++) {
    const run = i % 3 === 0 ? runs[0] : runs[i % runs.length];
    const row = await fx.updateAndPublish(run, { usageDurationMs: 1000 + i, metadata: JSON.stringify({ i }) });
    const t0 = Date.now();
    const seen = () => {
      const byKey = [...shape.rows.values()].find((r) => r.id === row.id);
      const sdk = sdkTag.latest.get(row.friendlyId);
      return byKey?.usageDurationMs === row.usageDurationMs && sdk?.durationMs === row.usageDurationMs;
    };
    await waitFor(seen, { what: `update ${i} through the proxy`, timeoutMs: 3000, intervalMs: 5 });
    latencies.push(Date.now() - t0);
  }
  latencies.sort((x, y) => x - y);
  t.diagnostic(`publish → Shape and SDK (tag feed) through the round-robin proxy: p50 ${latencies[6]} ms, max ${latencies.at(-1)} ms; requests per instance ${hits.join(" / ")}`);
  assert.ok(latencies.at(-1) < 3000, "no update waited for the 20 s backstop");
  assert.ok(hits[0] > 10 && hits[1] > 10, `both instances served polls: ${hits}`);

  // Final views equal the database.
  const want = await fx.runsById(runs.map((r) => r.id));
  await waitFor(
    () =>
      [...want.values()].every((row) => {
        const s = [...shape.rows.values()].find((r) => r.id === row.id);
        const k = sdkTag.latest.get(row.friendlyId);
        return s?.updatedAt === row.updatedAt && k?.updatedAt?.getTime() === row.updatedAtMs;
      }) &&
      sdkRun.latest.get(runs[0].friendlyId)?.updatedAt?.getTime() === want.get(runs[0].id).updatedAtMs &&
      [...want.values()]
        .filter((row) => row.batchId === batch.id)
        .every((row) => [...shapeBatch.rows.values()].find((r) => r.id === row.id)?.updatedAt === row.updatedAt),
    { what: "every client equals the database", timeoutMs: 5000, intervalMs: 50 }
  );
  for (const c of [shape, shapeBatch]) assert.deepEqual(c.streamErrors, []);
  for (const s of [sdkRun, sdkTag]) assert.equal(s.state.error, null);
});
