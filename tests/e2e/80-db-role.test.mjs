// runfeed connected as the least-privilege role of deploy/trigger.dev/runfeed-role.sql (SELECT on
// the columns it reads, read-only transactions): the real SDK follows a run, a tag and a batch
// with a public access token, a secret key authenticates, and /readyz reports the grants ok.
// The role file is applied with psql, as an operator would; the role name is unique per run.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { promisify } from "node:util";
import path from "node:path";
import { ROOT, PG_BASE, setupWorld, startServer, freePort, raw, qs, sdkSubscribe, randomId } from "./lib.mjs";

const run = promisify(execFile);
let world, fx, env, token, base, adminBase, role;

/** psql as the superuser on the test database (PG_BASE's user and host). */
async function psql(args) {
  const url = new URL(`${PG_BASE}/${world.db.name}`);
  return run("psql", ["-X", "-q", "-v", "ON_ERROR_STOP=1", url.toString(), ...args], { cwd: ROOT });
}

before(async () => {
  world = await setupWorld({ servers: {} });
  fx = world.fixture;
  role = `runfeed_e2e_role_${randomId(10)}`;
  await psql(["-v", `role=${role}`, "-f", path.join(ROOT, "deploy/trigger.dev/runfeed-role.sql")]);
  const roleUrl = new URL(`${PG_BASE}/${world.db.name}`);
  roleUrl.username = role;
  roleUrl.password = "";
  const adminPort = await freePort();
  adminBase = `http://127.0.0.1:${adminPort}`;
  world.servers.role = await startServer({
    databaseUrl: roleUrl.toString(),
    holdMs: 20000,
    label: "runfeed as the role",
    env: { RUNFEED_TELEMETRY__ADMIN_LISTEN: `127.0.0.1:${adminPort}` },
  });
  base = world.servers.role.baseUrl;
  env = await fx.createEnv();
  token = await world.token(env.id, ["read:runs"]);
});

after(async () => {
  await world?.teardown(); // drops the database, and with it the role's grants
  if (role) {
    const url = new URL(`${PG_BASE}/postgres`);
    await run("psql", ["-X", "-q", url.toString(), "-c", `DROP ROLE IF EXISTS "${role}"`]).catch(() => {});
  }
});

test("db role: /readyz reports every grant present", async () => {
  const res = await raw(adminBase, "/readyz");
  assert.equal(res.status, 200, res.text);
  assert.deepEqual(res.json.checks, { postgres: "ok", redis: "ok", grants: "ok" });
});

test("db role: the SDK follows a run, a tag and a batch; a secret key authenticates", async () => {
  const r = await fx.createRun(env, { status: "PENDING", tags: ["role-check"] });
  const s = await sdkSubscribe({ baseUrl: base, token, kind: "run", id: r.friendlyId });
  world.track(() => s.close());
  await s.waitFor(() => s.runs.length >= 1 && s.pendingLive(), { what: "SDK: the run + a live request" });
  await fx.updateAndPublish(r, { status: "EXECUTING", startedAt: Date.now() });
  await s.waitFor(() => s.latest.get(r.friendlyId)?.status === "EXECUTING", { what: "SDK: EXECUTING", timeoutMs: 5000 });

  const t = await sdkSubscribe({ baseUrl: base, token, kind: "tag", id: "role-check", createdAt: "1h" });
  world.track(() => t.close());
  await t.waitFor(() => t.latest.has(r.friendlyId) && t.pendingLive(), { what: "SDK: the tag's run + a live request" });
  const fresh = await fx.createAndPublish(env, { tags: ["role-check"] });
  await t.waitFor(() => t.latest.has(fresh.friendlyId), { what: "SDK: a new tagged run", timeoutMs: 5000 });

  const batch = await fx.createBatch(env);
  const member = await fx.createRun(env, { batchId: batch.id });
  const b = await sdkSubscribe({ baseUrl: base, token, kind: "batch", id: batch.friendlyId });
  world.track(() => b.close());
  await b.waitFor(() => b.latest.has(member.friendlyId) && b.pendingLive(), { what: "SDK: the batch's run + a live request" });
  await fx.updateAndPublish(member, { status: "COMPLETED_SUCCESSFULLY", completedAt: Date.now() });
  await b.waitFor(() => b.latest.get(member.friendlyId)?.status === "COMPLETED", { what: "SDK: the batch run completed", timeoutMs: 5000 });
  for (const sub of [s, t, b]) assert.equal(sub.state.error, null, sub.describe());

  // A secret key (the environment's apiKey) on a raw snapshot.
  const snap = await raw(base, `/realtime/v1/runs/${r.friendlyId}${qs({ offset: "-1" })}`, { token: env.apiKey });
  assert.equal(snap.status, 200, snap.text);
});
