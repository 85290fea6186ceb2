// Shared helpers of the runfeed end-to-end tests (node:test, Node >= 20).
//
// One test FILE = one fresh Postgres database (`runfeed_e2e_<random>`, created by `runfeed migrate`)
// and one or more `runfeed serve --listen 127.0.0.1:0` processes on it. Fixtures are written with
// node-postgres in trigger.dev's own tables; change records are published with `runfeed publish`
// AFTER the database change is committed (trigger.dev's order); tokens come from `runfeed token`
// (or are signed here when a test needs a deliberately broken one).
//
// Nothing here reads outside the repository: a fresh clone has only this directory and the binary.
//
// Env overrides (deliberately NOT named RUNFEED_*: the server reads every RUNFEED_* variable as
// configuration): E2E_RUNFEED_BIN (default <repo>/target/debug/runfeed),
// E2E_PG_URL (default postgres://postgres@127.0.0.1:5432, no database name),
// E2E_REDIS_URL (default redis://127.0.0.1:6379), E2E_VERBOSE=1 (echo server logs).

import { spawn, execFile } from "node:child_process";
import net from "node:net";
import crypto from "node:crypto";
import path from "node:path";
import { fileURLToPath } from "node:url";
import pg from "pg";

export const E2E_DIR = path.dirname(fileURLToPath(import.meta.url));
export const ROOT = path.resolve(E2E_DIR, "..", "..");
export const BIN = process.env.E2E_RUNFEED_BIN
  ? path.resolve(process.env.E2E_RUNFEED_BIN)
  : path.join(ROOT, "target", "debug", "runfeed");
export const PG_BASE = (process.env.E2E_PG_URL ?? "postgres://postgres@127.0.0.1:5432").replace(/\/+$/, "");
export const REDIS_URL = process.env.E2E_REDIS_URL ?? "redis://127.0.0.1:6379";
const VERBOSE = process.env.E2E_VERBOSE === "1";

/** What the trigger.dev SDK sends on every realtime request (besides Authorization). */
export const SDK_HEADERS = Object.freeze({
  "x-trigger-electric-version": "1.0.0-beta.1",
  "x-trigger-api-version": "2025-07-16",
});

/** `YYYY-MM-DDTHH:MM:SS.mmm`, no zone: how timestamps must look on the wire. */
export const WIRE_TS = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}$/;

// The global fetch as it was before anything (the SDK wrapper below) replaced it.
const realFetch = globalThis.fetch.bind(globalThis);

// ---------------------------------------------------------------------------------------------
// small utilities

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export function randomId(len = 24) {
  const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789";
  const bytes = crypto.randomBytes(len);
  let s = "";
  for (const b of bytes) s += alphabet[b % alphabet.length];
  return s;
}

function randomAlnum(len) {
  const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  const bytes = crypto.randomBytes(len);
  let s = "";
  for (const b of bytes) s += alphabet[b % alphabet.length];
  return s;
}

/** A cuid-like internal id (`c` + 24 chars). */
export const cuid = () => `c${randomId(24)}`;

/** Epoch ms → `YYYY-MM-DD HH:MM:SS.mmm` (UTC wall clock, what `timestamp(3)` stores). */
export function pgTs(ms) {
  return new Date(ms).toISOString().replace("T", " ").replace("Z", "");
}

/** Epoch ms → the wire form `YYYY-MM-DDTHH:MM:SS.mmm`. */
export function wireTs(ms) {
  return new Date(ms).toISOString().replace("Z", "");
}

/**
 * Polls `fn` (sync or async) until it returns a truthy value; returns that value.
 * Rejects after `timeoutMs` with `what` and, if given, `diag()` in the message.
 */
export async function waitFor(fn, { timeoutMs = 5000, intervalMs = 20, what = "condition", diag } = {}) {
  const deadline = Date.now() + timeoutMs;
  let lastErr;
  for (;;) {
    try {
      const v = await fn();
      if (v) return v;
    } catch (e) {
      lastErr = e;
    }
    if (Date.now() >= deadline) {
      let extra = "";
      if (lastErr) extra += `\nlast error: ${lastErr?.stack ?? lastErr}`;
      if (diag) {
        try {
          extra += `\n${typeof diag === "function" ? diag() : diag}`;
        } catch {}
      }
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}${extra}`);
    }
    await sleep(intervalMs);
  }
}

/** Resolves with `promise`, or rejects after `ms`. */
export function withTimeout(promise, ms, what = "operation") {
  let timer;
  return Promise.race([
    promise.finally(() => clearTimeout(timer)),
    new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what}`)), ms);
    }),
  ]);
}

// ---------------------------------------------------------------------------------------------
// the runfeed binary

/** Runs `runfeed <args>`; resolves with trimmed stdout; rejects with stderr on failure. */
export function runCli(args, { timeoutMs = 30000, env = {} } = {}) {
  return new Promise((resolve, reject) => {
    execFile(
      BIN,
      args,
      { timeout: timeoutMs, env: { ...process.env, ...env }, maxBuffer: 4 * 1024 * 1024 },
      (err, stdout, stderr) => {
        if (err) {
          const shown = args.map((a) => (a.startsWith("postgres://") || a.length > 80 ? "…" : a)).join(" ");
          reject(new Error(`runfeed ${shown} failed (${err.code ?? err.signal}): ${stderr || err.message}`));
        } else resolve(stdout.trim());
      }
    );
  });
}

/** `runfeed token`: a public access token (JWT) for `envId` with `scopes`. */
export async function mintToken(databaseUrl, envId, scopes = ["read:runs"], { ttl, skipColumns } = {}) {
  const args = ["token", "--database-url", databaseUrl, "--env", envId];
  for (const s of scopes) args.push("--scope", s);
  if (ttl) args.push("--ttl", ttl);
  if (skipColumns) args.push("--skip-columns", skipColumns.join(","));
  const out = await runCli(args);
  const token = out.split(/\s+/).pop();
  if (!/^[\w-]+\.[\w-]+\.[\w-]+$/.test(token)) throw new Error(`runfeed token printed no JWT: ${out}`);
  return token;
}

/**
 * `runfeed publish`: one change record, exactly as trigger.dev publishes it. Call it only after
 * the database change is committed. `tags` undefined = a partial record (no tags key).
 */
export async function publish({ envId, runId, tags, batchId, updatedAtMs }) {
  const args = ["publish", "--redis-url", REDIS_URL, "--env", envId, "--run", runId];
  if (tags !== undefined) args.push("--tags", tags.join(","));
  if (batchId) args.push("--batch", batchId);
  if (updatedAtMs !== undefined && updatedAtMs !== null) args.push("--updated-at-ms", String(updatedAtMs));
  await runCli(args, { timeoutMs: 10000 });
}

/**
 * Signs an HS256 JWT with the UTF-8 bytes of `key` (how trigger.dev signs public access tokens
 * with an environment's secret key). Used for deliberately broken tokens; good ones come from
 * `runfeed token`.
 */
export function signJwt(payload, key, { alg = "HS256" } = {}) {
  const b64 = (obj) => Buffer.from(JSON.stringify(obj)).toString("base64url");
  const head = b64({ alg, typ: "JWT" });
  const body = b64(payload);
  const hash = { HS256: "sha256", HS384: "sha384", HS512: "sha512" }[alg];
  const sig = crypto.createHmac(hash, Buffer.from(key, "utf8")).update(`${head}.${body}`).digest("base64url");
  return `${head}.${body}.${sig}`;
}

/** Standard public-access-token claims for `envId`. */
export function jwtClaims(envId, scopes, extra = {}) {
  const now = Math.floor(Date.now() / 1000);
  return {
    sub: envId,
    pub: true,
    scopes,
    iss: "https://id.trigger.dev",
    aud: "https://api.trigger.dev",
    iat: now,
    exp: now + 900,
    ...extra,
  };
}

// ---------------------------------------------------------------------------------------------
// databases

/** Creates a fresh database with the trigger.dev tables (`runfeed migrate`). */
export async function createDatabase(prefix = "runfeed_e2e") {
  const name = `${prefix}_${randomId(10)}`;
  const url = `${PG_BASE}/${name}`;
  await runCli(["migrate", "--database-url", url], { timeoutMs: 60000 });
  return { name, url };
}

export async function dropDatabase(name) {
  const client = new pg.Client({ connectionString: `${PG_BASE}/postgres` });
  await client.connect();
  try {
    await client.query(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
  } finally {
    await client.end();
  }
}

function newPool(url) {
  // timestamp without time zone (1114) comes back as the raw string: no local-time guessing.
  const types = {
    getTypeParser(oid, format) {
      if (oid === 1114) return (s) => s;
      return pg.types.getTypeParser(oid, format);
    },
  };
  const pool = new pg.Pool({ connectionString: url, max: 4, types });
  pool.on("connect", (c) => c.query("SET TIME ZONE 'UTC'").catch(() => {}));
  // An idle client the teardown's DROP DATABASE … WITH (FORCE) terminates emits "terminating
  // connection due to administrator command" on the pool; without a listener Node throws it
  // after the test has ended (node-postgres: "you must handle the pool's error event").
  pool.on("error", () => {});
  return pool;
}

// ---------------------------------------------------------------------------------------------
// runfeed serve

// The server treats every RUNFEED_* variable as a configuration key and rejects unknown ones; keep
// only RUNFEED_<SECTION>__<KEY> overrides from the caller's environment.
function serverBaseEnv() {
  const env = {};
  for (const [k, v] of Object.entries(process.env)) {
    if (k.startsWith("RUNFEED_") && !k.includes("__")) continue;
    env[k] = v;
  }
  return env;
}

/**
 * Starts `runfeed serve --listen 127.0.0.1:0` and waits for its `runfeed listening on URL` line.
 * `holdMs` sets RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS (the live long-poll hold).
 */
export async function startServer({ databaseUrl, holdMs = 20000, env = {}, args = [], label = "server", listen = "127.0.0.1:0" } = {}) {
  const child = spawn(
    BIN,
    ["serve", "--listen", listen, "--database-url", databaseUrl, "--redis-url", REDIS_URL, ...args],
    {
      env: {
        ...serverBaseEnv(),
        RUST_LOG: process.env.RUST_LOG ?? "info",
        NO_COLOR: "1",
        RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS: String(holdMs),
        RUNFEED_TELEMETRY__ADMIN_LISTEN: "127.0.0.1:0", // several servers at once: no fixed admin port
        ...env,
      },
      stdio: ["ignore", "pipe", "pipe"],
    }
  );
  const logLines = [];
  const keep = (line) => {
    logLines.push(line);
    if (logLines.length > 400) logLines.shift();
    if (VERBOSE) process.stderr.write(`[${label}] ${line}\n`);
  };
  let exited = null;
  const exitPromise = new Promise((resolve) =>
    child.on("exit", (code, signal) => {
      exited = { code, signal };
      resolve(exited);
    })
  );
  const baseUrl = await new Promise((resolve, reject) => {
    let buf = "";
    const timer = setTimeout(
      () => reject(new Error(`${label}: no "runfeed listening on" line within 20 s\n${logLines.join("\n")}`)),
      20000
    );
    const onData = (stream) => (chunk) => {
      buf = stream === "out" ? buf + chunk : buf;
      for (const line of String(chunk).split("\n")) if (line) keep(line);
      const m = /^runfeed listening on (http:\/\/\S+)\s*$/m.exec(buf);
      if (m) {
        clearTimeout(timer);
        resolve(m[1].replace(/\/+$/, ""));
      }
    };
    child.stdout.on("data", onData("out"));
    child.stderr.on("data", onData("err"));
    exitPromise.then((e) => {
      clearTimeout(timer);
      reject(new Error(`${label} exited before listening (${JSON.stringify(e)}):\n${logLines.join("\n")}`));
    });
  });
  const server = {
    baseUrl,
    holdMs,
    child,
    logs: () => logLines.join("\n"),
    /** Stops this process and starts a fresh one on the same address (same options + `envOverrides`). */
    async restart(envOverrides = {}) {
      await server.stop();
      const port = new URL(baseUrl).port;
      return startServer({ databaseUrl, holdMs, env: { ...env, ...envOverrides }, args, label: `${label}'`, listen: `127.0.0.1:${port}` });
    },
    get exited() {
      return exited;
    },
    async stop() {
      if (exited) return exited;
      child.kill("SIGTERM");
      const killer = setTimeout(() => child.kill("SIGKILL"), 5000);
      const e = await exitPromise;
      clearTimeout(killer);
      return e;
    },
  };
  return server;
}

/** A TCP port that was free a moment ago on 127.0.0.1 (for a server that must keep its address). */
export function freePort() {
  return freePorts(1).then(([port]) => port);
}

/**
 * `n` distinct free ports on 127.0.0.1: all `n` are held open together before any is released, so
 * the kernel cannot hand the same one out twice (one `freePort()` after another can: a port
 * released by the first may come back from the second, e.g. a proxy's plain and TLS listeners).
 */
export async function freePorts(n) {
  const servers = [];
  try {
    for (let i = 0; i < n; i++) {
      const srv = net.createServer();
      servers.push(srv);
      await new Promise((resolve, reject) => {
        srv.once("error", reject);
        srv.listen(0, "127.0.0.1", resolve);
      });
    }
    return servers.map((srv) => srv.address().port);
  } finally {
    await Promise.all(servers.map((srv) => new Promise((resolve) => srv.close(() => resolve()))));
  }
}

// ---------------------------------------------------------------------------------------------
// fixtures in trigger.dev's tables

const RUN_COLUMNS_SQL = `id, "friendlyId", "taskIdentifier", status::text AS status,
  to_char("createdAt", 'YYYY-MM-DD"T"HH24:MI:SS.MS') AS "createdAt",
  to_char("updatedAt", 'YYYY-MM-DD"T"HH24:MI:SS.MS') AS "updatedAt",
  (extract(epoch from "updatedAt") * 1000)::bigint::text AS "updatedAtMs",
  to_char("completedAt", 'YYYY-MM-DD"T"HH24:MI:SS.MS') AS "completedAt",
  "usageDurationMs", "runTags", "batchId", metadata, output, "runtimeEnvironmentId"`;

/**
 * Test fixture for one database: organizations, projects, environments, batches and runs in
 * trigger.dev's own tables, plus updates that bump `updatedAt` the way Prisma does.
 */
export class Fixture {
  constructor(databaseUrl) {
    this.databaseUrl = databaseUrl;
    this.pool = newPool(databaseUrl);
  }

  async close() {
    await this.pool.end();
  }

  query(sql, params) {
    return this.pool.query(sql, params);
  }

  /** Organization + Project + RuntimeEnvironment. Returns {id, apiKey, orgId, projectId, type}. */
  async createEnv({ type = "DEVELOPMENT" } = {}) {
    const orgId = cuid();
    const projectId = cuid();
    const id = cuid();
    const prefix = { DEVELOPMENT: "dev", STAGING: "stg", PRODUCTION: "prod", PREVIEW: "preview" }[type];
    const apiKey = `tr_${prefix}_${randomAlnum(24)}`;
    const now = pgTs(Date.now());
    await this.query(
      `INSERT INTO "Organization" (id, slug, title, "updatedAt") VALUES ($1, $2, $3, $4)`,
      [orgId, `org-${orgId}`, "E2E Org", now]
    );
    await this.query(
      `INSERT INTO "Project" (id, name, "organizationId", "updatedAt", slug, "externalRef")
       VALUES ($1, $2, $3, $4, $5, $6)`,
      [projectId, "E2E Project", orgId, now, `proj-${projectId}`, `proj_${randomId(20)}`]
    );
    await this.query(
      `INSERT INTO "RuntimeEnvironment" (id, slug, "apiKey", "organizationId", "updatedAt", "projectId",
         "pkApiKey", shortcode, type)
       VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::"RuntimeEnvironmentType")`,
      [id, prefix, apiKey, orgId, now, projectId, `pk_${prefix}_${randomAlnum(20)}`, randomId(8), type]
    );
    return { id, apiKey, orgId, projectId, type };
  }

  /** A "BatchTaskRun". Returns {id, friendlyId}. */
  async createBatch(env) {
    const id = cuid();
    const friendlyId = `batch_${id}`;
    await this.query(
      `INSERT INTO "BatchTaskRun" (id, "friendlyId", "runtimeEnvironmentId", "updatedAt") VALUES ($1, $2, $3, $4)`,
      [id, friendlyId, env.id, pgTs(Date.now())]
    );
    return { id, friendlyId };
  }

  /**
   * A "TaskRun" with the 10 required columns plus whatever `o` sets. Timestamps in `o` are epoch
   * ms (or null). Returns the stored row (see RUN_COLUMNS_SQL) plus `updatedAtMs` as a number.
   */
  async createRun(env, o = {}) {
    const id = o.id ?? cuid();
    const now = Date.now();
    const createdAt = o.createdAt ?? now;
    const updatedAt = o.updatedAt ?? Math.max(now, createdAt);
    const ts = (v) => (v === undefined || v === null ? null : pgTs(v));
    const cols = {
      id,
      friendlyId: o.friendlyId ?? `run_${id}`,
      taskIdentifier: o.taskIdentifier ?? "e2e-task",
      runtimeEnvironmentId: env.id,
      projectId: env.projectId,
      organizationId: env.orgId,
      payload: o.payload ?? '{"hello":"world"}',
      payloadType: o.payloadType ?? "application/json",
      spanId: randomId(16),
      traceId: randomId(32),
      queue: o.queue ?? "task/e2e-task",
      status: o.status ?? "PENDING",
      number: o.number ?? 1,
      isTest: o.isTest ?? false,
      usageDurationMs: o.usageDurationMs ?? 0,
      costInCents: o.costInCents ?? 0,
      baseCostInCents: o.baseCostInCents ?? 0,
      ttl: o.ttl ?? null,
      metadata: o.metadata ?? null,
      metadataType: o.metadataType ?? "application/json",
      output: o.output ?? null,
      outputType: o.outputType ?? "application/json",
      runTags: o.tags === undefined ? null : o.tags,
      error: o.error === undefined || o.error === null ? null : JSON.stringify(o.error),
      realtimeStreams: o.realtimeStreams ?? [],
      batchId: o.batchId ?? null,
      createdAt: ts(createdAt),
      updatedAt: ts(updatedAt),
      startedAt: ts(o.startedAt),
      delayUntil: ts(o.delayUntil),
      queuedAt: ts(o.queuedAt),
      expiredAt: ts(o.expiredAt),
      completedAt: ts(o.completedAt),
    };
    const casts = { status: '::"TaskRunStatus"', error: "::jsonb", runTags: "::text[]", realtimeStreams: "::text[]" };
    const names = Object.keys(cols);
    const sql = `INSERT INTO "TaskRun" (${names.map((n) => `"${n}"`).join(", ")})
      VALUES (${names.map((n, i) => `$${i + 1}${casts[n] ?? ""}`).join(", ")})
      RETURNING ${RUN_COLUMNS_SQL}`;
    const { rows } = await this.query(sql, names.map((n) => cols[n]));
    return withMs(rows[0]);
  }

  /**
   * Updates a run like Prisma does (`updatedAt` = now, but strictly later than before so every
   * change is visible to offset comparisons) and returns the stored row with `updatedAtMs`.
   * `set` maps column → value; timestamp columns take epoch ms; `error` takes an object.
   */
  async updateRun(runId, set = {}) {
    const assigns = [];
    const params = [runId];
    for (const [col, value] of Object.entries(set)) {
      let v = value;
      let cast = "";
      if (["startedAt", "completedAt", "delayUntil", "queuedAt", "expiredAt", "createdAt"].includes(col)) {
        v = value === null ? null : pgTs(value);
      } else if (col === "status") cast = '::"TaskRunStatus"';
      else if (col === "error") {
        v = value === null ? null : JSON.stringify(value);
        cast = "::jsonb";
      } else if (col === "runTags") cast = "::text[]";
      params.push(v);
      assigns.push(`"${col}" = $${params.length}${cast}`);
    }
    assigns.push(
      `"updatedAt" = GREATEST(date_trunc('milliseconds', clock_timestamp() AT TIME ZONE 'UTC'),
                              "updatedAt" + interval '1 millisecond')`
    );
    const { rows } = await this.query(
      `UPDATE "TaskRun" SET ${assigns.join(", ")} WHERE id = $1 RETURNING ${RUN_COLUMNS_SQL}`,
      params
    );
    if (!rows[0]) throw new Error(`updateRun: no run ${runId}`);
    return withMs(rows[0]);
  }

  /** Updates a run and publishes its change record (tags, batch, updatedAtMs), in that order. */
  async updateAndPublish(run, set = {}, { partial = false } = {}) {
    const row = await this.updateRun(run.id, set);
    await publish({
      envId: row.runtimeEnvironmentId,
      runId: row.id,
      tags: partial ? undefined : row.runTags ?? [],
      batchId: row.batchId ?? undefined,
      updatedAtMs: row.updatedAtMs,
    });
    return row;
  }

  /** Creates a run and publishes its record (as the engine's runCreated handler does). */
  async createAndPublish(env, o = {}) {
    const row = await this.createRun(env, o);
    await publish({
      envId: env.id,
      runId: row.id,
      tags: row.runTags ?? [],
      batchId: row.batchId ?? undefined,
      updatedAtMs: row.updatedAtMs,
    });
    return row;
  }

  /** Stored rows (RUN_COLUMNS_SQL) of `ids`, keyed by internal id. */
  async runsById(ids) {
    const { rows } = await this.query(`SELECT ${RUN_COLUMNS_SQL} FROM "TaskRun" WHERE id = ANY($1)`, [ids]);
    return new Map(rows.map((r) => [r.id, withMs(r)]));
  }

  /** Stored rows of a query's `WHERE` clause (`$1…` params), keyed by internal id. */
  async runsWhere(where, params = []) {
    const { rows } = await this.query(`SELECT ${RUN_COLUMNS_SQL} FROM "TaskRun" WHERE ${where}`, params);
    return new Map(rows.map((r) => [r.id, withMs(r)]));
  }
}

function withMs(row) {
  return { ...row, updatedAtMs: Number(row.updatedAtMs) };
}

// ---------------------------------------------------------------------------------------------
// one test file's world: database + fixture + servers + every client, torn down in after()

/**
 * Creates the database and fixture; `servers` maps a name to startServer options
 * (e.g. `{ short: { holdMs: 2500 }, long: { holdMs: 20000 } }`).
 */
export async function setupWorld({ servers = { main: {} } } = {}) {
  const db = await createDatabase();
  const world = {
    db,
    fixture: new Fixture(db.url),
    servers: {},
    closers: [],
    /** Registers something to close in teardown (clients, subscriptions). */
    track(closeFn) {
      this.closers.push(closeFn);
      return closeFn;
    },
    token(envId, scopes, opts) {
      return mintToken(db.url, envId, scopes, opts);
    },
    async teardown() {
      for (const c of this.closers.splice(0).reverse()) {
        try {
          await c();
        } catch {}
      }
      for (const s of Object.values(this.servers)) {
        try {
          await s.stop();
        } catch {}
      }
      try {
        await this.fixture.close();
      } catch {}
      try {
        await dropDatabase(db.name);
      } catch {}
    },
  };
  try {
    for (const [name, opts] of Object.entries(servers)) {
      world.servers[name] = await startServer({ databaseUrl: db.url, label: name, ...opts });
    }
  } catch (e) {
    await world.teardown();
    throw e;
  }
  return world;
}

/**
 * setupWorld with one environment and a `read:runs` token for it:
 * `{ world, fx, env, token, bases, base }` (`bases`: server name → base URL; `base`: the
 * first server's).
 */
export async function setupEnvWorld(servers) {
  const world = await setupWorld({ servers });
  const fx = world.fixture;
  const bases = Object.fromEntries(Object.entries(world.servers).map(([name, s]) => [name, s.baseUrl]));
  const env = await fx.createEnv();
  const token = await world.token(env.id, ["read:runs"]);
  return { world, fx, env, token, bases, base: Object.values(bases)[0] };
}

// ---------------------------------------------------------------------------------------------
// raw HTTP (exact status/header checks)

/**
 * One raw request. `token` → `Authorization: Bearer`; `sdk` (default true) adds the SDK's
 * x-trigger-* headers (false = a legacy client). Returns {status, headers, text, json, ms}.
 */
export async function raw(baseUrl, pathAndQuery, { token, sdk = true, headers = {}, method = "GET", timeoutMs = 30000 } = {}) {
  const h = { ...(sdk ? SDK_HEADERS : {}), ...headers };
  if (token !== undefined && token !== null) h.Authorization = `Bearer ${token}`;
  const t0 = Date.now();
  const res = await realFetch(`${baseUrl}${pathAndQuery}`, { method, headers: h, signal: AbortSignal.timeout(timeoutMs) });
  const text = await res.text();
  let json;
  try {
    json = text ? JSON.parse(text) : undefined;
  } catch {}
  return { status: res.status, headers: res.headers, text, json, ms: Date.now() - t0 };
}

/** `?a=b&…` from an object (values used verbatim, including empty strings). */
export function qs(params) {
  const u = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined) u.set(k, v);
  const s = u.toString();
  return s ? `?${s}` : "";
}

/** The run feed of `run` (friendly id) with the query `params`. */
export const runPath = (run, params = {}) => `/realtime/v1/runs/${run.friendlyId}${qs(params)}`;

export const isUpToDate = (m) => m?.headers?.control === "up-to-date";
export const isChange = (m) => m && typeof m === "object" && "key" in m;

// ---------------------------------------------------------------------------------------------
// @electric-sql/client ShapeStream + Shape (1.0.14, 1.0.0-beta.1 or 0.6.3)

/** A fetch wrapper that records every request the client makes (incl. prefetches). */
export function makeFetchLog() {
  const requests = [];
  const listeners = new Set();
  const fetchClient = async (input, init = {}) => {
    const url = typeof input === "string" ? input : input.url ?? String(input);
    const rec = {
      n: requests.length + 1,
      url,
      query: Object.fromEntries(new URL(url).searchParams),
      t0: Date.now(),
      t1: null,
      status: null,
      headers: null,
      aborted: false,
      error: null,
    };
    requests.push(rec);
    listeners.forEach((l) => l());
    try {
      const res = await realFetch(input, init);
      rec.status = res.status;
      rec.headers = Object.fromEntries(res.headers.entries());
      rec.t1 = Date.now();
      return res;
    } catch (e) {
      rec.t1 = Date.now();
      rec.aborted = e?.name === "AbortError" || !!init?.signal?.aborted;
      rec.error = String(e?.message ?? e);
      throw e;
    } finally {
      listeners.forEach((l) => l());
    }
  };
  return { requests, fetchClient, listeners };
}

export function describeRequests(requests) {
  return requests
    .map((r) => {
      const q = { ...r.query };
      const dur = r.t1 ? `${r.t1 - r.t0}ms` : "pending";
      return `#${r.n} ${JSON.stringify(q)} → ${r.status ?? (r.aborted ? "aborted" : r.error ?? "…")} (${dur})`;
    })
    .join("\n");
}

const CLIENTS = {
  modern: () => import("@electric-sql/client"),
  current: () => import("electric-1-5"),
  beta: () => import("electric-beta"),
  legacy: () => import("electric-legacy"),
};

/**
 * Subscribes with a real ShapeStream (+ Shape). `client`: "modern" (1.0.14), "current" (1.5.x),
 * "beta" (1.0.0-beta.1) or "legacy" (0.6.3). `sdkHeaders` (default: not legacy) adds the SDK's
 * x-trigger-* headers; `streamOptions` are extra ShapeStream options (e.g. `{ liveSse: true }`
 * or `{ log: "changes_only" }` for 1.5). Everything the client does is recorded on the returned
 * object.
 */
export async function openShape({
  baseUrl,
  path: urlPath,
  token,
  client = "modern",
  sdkHeaders = client !== "legacy",
  headers = {},
  offset,
  handle,
  withShape = true,
  onError = true,
  streamOptions = {},
}) {
  const mod = await CLIENTS[client]();
  const log = makeFetchLog();
  const controller = new AbortController();
  const h = { ...(sdkHeaders ? SDK_HEADERS : {}), ...headers };
  if (token) h.Authorization = `Bearer ${token}`;
  const state = {
    client,
    requests: log.requests,
    batches: [], // every batch the stream published, in order
    subscriberErrors: [], // errors given to subscribe(cb, onError)
    streamErrors: [], // errors given to the stream-level onError option
    rows: new Map(), // Shape rows by key (last notification)
    shapeNotifications: 0,
    stream: null,
    shape: null,
  };
  const options = {
    url: `${baseUrl}${urlPath}`,
    headers: h,
    fetchClient: log.fetchClient,
    signal: controller.signal,
    ...streamOptions,
  };
  if (onError) {
    options.onError = (e) => {
      state.streamErrors.push(e);
    };
  }
  if (offset !== undefined) options.offset = offset;
  if (handle !== undefined) {
    if (client === "legacy") options.shapeId = handle;
    else options.handle = handle;
  }
  const stream = new mod.ShapeStream(options);
  state.stream = stream;
  stream.subscribe(
    (messages) => {
      state.batches.push({ at: Date.now(), messages: messages ?? null });
    },
    (e) => state.subscriberErrors.push(e)
  );
  if (withShape) {
    const shape = new mod.Shape(stream);
    state.shape = shape;
    shape.subscribe((data) => {
      state.shapeNotifications++;
      // 1.x: {value, rows}; 0.6.3: the Map itself
      const map = data instanceof Map ? data : data?.value;
      state.rows = new Map(map);
    });
  }

  const api = {
    ...state,
    get rows() {
      return state.rows;
    },
    get shapeNotifications() {
      return state.shapeNotifications;
    },
    /** Change messages received so far (flattened). */
    changes() {
      return state.batches.flatMap((b) => (b.messages ?? []).filter(isChange));
    },
    /** The request currently in flight with live=true, if any. */
    pendingLive() {
      return state.requests.find((r) => r.query.live === "true" && r.status === null && !r.error);
    },
    liveRequests() {
      return state.requests.filter((r) => r.query.live === "true");
    },
    nonLiveRequests() {
      return state.requests.filter((r) => r.query.live !== "true");
    },
    /** Rows whose value satisfies `pred`. */
    rowValues() {
      return [...state.rows.values()];
    },
    describe() {
      return `client ${client} ${urlPath}\nrequests:\n${describeRequests(state.requests)}\nbatches: ${JSON.stringify(
        state.batches.map((b) => b.messages)
      ).slice(0, 3000)}\nerrors: ${[...state.subscriberErrors, ...state.streamErrors]
        .map((e) => `${e?.status ?? ""} ${e?.message ?? e}`)
        .join("; ")}`;
    },
    waitFor(fn, opts = {}) {
      return waitFor(() => fn(api), { diag: () => api.describe(), ...opts });
    },
    /** Waits until the client has a live request in flight (it is up to date and long-polling). */
    waitLive(opts = {}) {
      return api.waitFor(() => api.pendingLive(), { what: "a live request in flight", timeoutMs: 10000, ...opts });
    },
    close() {
      if (!controller.signal.aborted) controller.abort();
    },
    controller,
  };
  return api;
}

// ---------------------------------------------------------------------------------------------
// @trigger.dev/sdk

// The SDK gives the Electric client no fetchClient of ours, so it calls the global fetch: wrap it
// once and keep a log of every realtime request it makes.
export const sdkRequests = [];
let sdkModule;

async function loadSdk() {
  if (!sdkModule) {
    globalThis.fetch = async (input, init = {}) => {
      const url = typeof input === "string" ? input : input.url ?? String(input);
      const rec = { url, query: Object.fromEntries(new URL(url).searchParams), t0: Date.now(), t1: null, status: null, aborted: false };
      sdkRequests.push(rec);
      try {
        const res = await realFetch(input, init);
        rec.status = res.status;
        rec.t1 = Date.now();
        return res;
      } catch (e) {
        rec.t1 = Date.now();
        rec.aborted = e?.name === "AbortError" || !!init?.signal?.aborted;
        throw e;
      }
    };
    sdkModule = await import("@trigger.dev/sdk");
  }
  return sdkModule;
}

/**
 * Subscribes through the trigger.dev SDK: `kind` "run" (id = run friendly id), "tag" (id = tag
 * or array of tags; `createdAt` filter) or "batch" (id = batch friendly id). Every yielded run
 * object is recorded; the returned object can wait for conditions and close the subscription.
 */
export async function sdkSubscribe({ baseUrl, token, kind, id, createdAt, skipColumns, stopOnCompletion }) {
  const { configure, runs } = await loadSdk();
  configure({ baseURL: baseUrl, accessToken: token });
  let sub;
  if (kind === "run") {
    const opts = {};
    if (skipColumns) opts.skipColumns = skipColumns;
    if (stopOnCompletion !== undefined) opts.stopOnCompletion = stopOnCompletion;
    sub = runs.subscribeToRun(id, opts);
  } else if (kind === "tag") {
    const filters = {};
    if (createdAt) filters.createdAt = createdAt;
    if (skipColumns) filters.skipColumns = skipColumns;
    sub = runs.subscribeToRunsWithTag(id, filters);
  } else if (kind === "batch") {
    sub = runs.subscribeToBatch(id);
  } else throw new Error(`unknown kind ${kind}`);

  const urlPart =
    kind === "run" ? `/realtime/v1/runs/${id}` : kind === "batch" ? `/realtime/v1/batches/${id}` : `/realtime/v1/runs?`;
  const state = { runs: [], latest: new Map(), error: null, ended: false, endedAt: null };
  const done = (async () => {
    try {
      for await (const run of sub) {
        state.runs.push(run);
        state.latest.set(run.id, run);
      }
      state.ended = true;
      state.endedAt = Date.now();
    } catch (e) {
      state.error = e;
    }
  })();
  const api = {
    state,
    get runs() {
      return state.runs;
    },
    get latest() {
      return state.latest;
    },
    done,
    requests() {
      return sdkRequests.filter((r) => r.url.startsWith(baseUrl) && r.url.includes(urlPart));
    },
    pendingLive() {
      return api.requests().find((r) => r.query.live === "true" && r.status === null && !r.aborted);
    },
    describe() {
      return `sdk ${kind} ${id}\nrequests:\n${describeRequests(api.requests().map((r, i) => ({ ...r, n: i + 1 })))}\nruns: ${JSON.stringify(
        state.runs.map((r) => ({ id: r.id, status: r.status, updatedAt: r.updatedAt, finishedAt: r.finishedAt }))
      ).slice(0, 3000)}\nerror: ${state.error?.message ?? "none"}`;
    },
    waitFor(fn, opts = {}) {
      return waitFor(() => {
        if (state.error) throw state.error;
        return fn(api);
      }, { diag: () => api.describe(), ...opts });
    },
    waitLive(opts = {}) {
      return api.waitFor(() => api.pendingLive(), { what: "an SDK live request in flight", timeoutMs: 10000, ...opts });
    },
    close() {
      try {
        sub.unsubscribe();
      } catch {}
    },
  };
  return api;
}
