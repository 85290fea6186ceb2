#!/usr/bin/env node
// One reader of the delivery checker (`runfeed-bench check`, CORRECTNESS.md "The checker") that
// uses the REAL npm clients: `@electric-sql/client` 1.0.14 (`ShapeStream`, --mode shape) or
// `@trigger.dev/sdk` 4.8.3 (`runs.subscribeTo…`, --mode sdk). It follows one feed until it is
// killed and prints one JSON line per event on stdout:
//
//   {"k":"req","id":N,"t":EPOCH_MS,"inst":I,"offset":"-1","live":false}   a request was sent
//   {"k":"resp","id":N,"t":…,"status":200,"offset":"…"}                   its response arrived
//   {"k":"fail","id":N,"t":…,"error":"…","aborted":false}                 no response
//   {"k":"rows","t":…,"rows":[{"id":…,"op":…,"u":MS,"ck":N}],"snap":N|null,"complete":bool}
//   {"k":"reset","t":…}                                                   must-refetch (view dropped)
//   {"k":"error","t":…,"message":"…"}                                     the client gave up
//
// Requests go through a fetch wrapper that sends each one to one of --bases (sticky, hopping to
// another instance with probability --hop), like clients behind a non-sticky load balancer.
//
//   node tests/e2e/check-reader.mjs --bases http://127.0.0.1:3030,http://127.0.0.1:3031 \
//     --token TOKEN --feed run:run_… | tag:t1,t2[|1h] | batch:batch_… [--skip-columns a,b] \
//     [--mode shape|sdk] [--hop 0.3] [--seed N]
import { parseArgs } from "node:util";

const { values: opts } = parseArgs({
  options: {
    bases: { type: "string" },
    token: { type: "string" },
    feed: { type: "string" },
    "skip-columns": { type: "string" },
    mode: { type: "string", default: "shape" },
    hop: { type: "string", default: "0" },
    seed: { type: "string", default: "1" },
  },
});
const bases = (opts.bases ?? "").split(",").filter(Boolean).map((b) => b.replace(/\/+$/, ""));
if (!bases.length || !opts.token || !opts.feed) {
  console.error("usage: check-reader.mjs --bases URL[,URL] --token T --feed run:ID|tag:T[,T][|W]|batch:ID");
  process.exit(2);
}
const hop = Number(opts.hop);
const skipColumns = opts["skip-columns"]?.split(",").filter(Boolean);

// A small seeded PRNG (mulberry32) for the hop choices.
let seed = Number(opts.seed) >>> 0;
const random = () => {
  seed = (seed + 0x6d2b79f5) >>> 0;
  let t = seed;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
};

const now = () => performance.timeOrigin + performance.now();
const print = (obj) => process.stdout.write(JSON.stringify({ t: now(), ...obj }) + "\n");

// --- the fetch wrapper: instance choice, request/response log, snapshot attribution ---------
let instance = Math.floor(random() * bases.length);
let nextId = 0;
let snapshotReq = null; // id of the latest offset=-1 request answered 200, until its rows print
let lastResp = 0;
const realFetch = globalThis.fetch;
globalThis.fetch = async (input, init) => {
  const url = new URL(typeof input === "string" ? input : input.url);
  if (random() < hop) instance = Math.floor(random() * bases.length);
  const target = new URL(bases[instance]);
  url.protocol = target.protocol;
  url.host = target.host;
  const id = ++nextId;
  const offset = url.searchParams.get("offset");
  print({ k: "req", id, inst: instance, offset, live: url.searchParams.get("live") === "true" });
  try {
    const resp = await realFetch(url.toString(), init);
    lastResp = id;
    if (offset === "-1" && resp.status === 200) snapshotReq = id;
    print({ k: "resp", id, status: resp.status, offset: resp.headers.get("electric-offset") });
    return resp;
  } catch (e) {
    const aborted = e?.name === "AbortError";
    print({ k: "fail", id, error: String(e?.message ?? e), aborted });
    // Let the client's backoff retry elsewhere.
    if (!aborted) instance = (instance + 1) % bases.length;
    throw e;
  }
};

// --- the feed ---------------------------------------------------------------------------------
const [kind, ...rest] = opts.feed.split(":");
const spec = rest.join(":");
const headers = {
  Authorization: `Bearer ${opts.token}`,
  "x-trigger-electric-version": "1.0.0-beta.1",
  "x-trigger-api-version": "2025-07-16",
};

const ckOf = (metadata) => {
  try {
    const m = typeof metadata === "string" ? JSON.parse(metadata) : metadata;
    return typeof m?.ck === "number" ? m.ck : null;
  } catch {
    return null;
  }
};

if (opts.mode === "shape") {
  const { ShapeStream } = await import("@electric-sql/client");
  const params = new URLSearchParams();
  let path;
  if (kind === "run") path = `/realtime/v1/runs/${encodeURIComponent(spec)}`;
  else if (kind === "batch") path = `/realtime/v1/batches/${encodeURIComponent(spec)}`;
  else {
    const [tags, createdAt] = spec.split("|");
    path = "/realtime/v1/runs";
    params.set("tags", tags);
    if (createdAt) params.set("createdAt", createdAt);
  }
  if (skipColumns) params.set("skipColumns", skipColumns.join(","));
  const query = params.toString();
  const view = new Map();
  const stream = new ShapeStream({
    url: `${bases[0]}${path}${query ? `?${query}` : ""}`,
    headers,
    onError: (e) => {
      print({ k: "error", message: String(e?.message ?? e), status: e?.status ?? null });
      process.exit(1);
    },
  });
  stream.subscribe((messages) => {
    const rows = [];
    for (const m of messages) {
      if (m.headers?.control === "must-refetch") {
        view.clear();
        print({ k: "reset" });
        continue;
      }
      if (!("key" in m)) continue;
      const op = m.headers?.operation;
      if (op === "delete") {
        view.delete(m.key);
        continue;
      }
      const row = op === "insert" || !view.has(m.key) ? { ...m.value } : { ...view.get(m.key), ...m.value };
      view.set(m.key, row);
      const u = row.updatedAt ? Date.parse(`${row.updatedAt}Z`) : null;
      rows.push({ id: row.id, op, u, ck: ckOf(row.metadata), status: row.status ?? null });
    }
    // ShapeStream publishes one batch per response: the batch after a snapshot's 200 is the
    // snapshot, complete.
    const snap = snapshotReq;
    snapshotReq = null;
    print({ k: "rows", rows, snap, complete: snap !== null });
  });
} else {
  const { configure, runs } = await import("@trigger.dev/sdk");
  configure({ baseURL: bases[0], accessToken: opts.token });
  let subscription;
  if (kind === "run") subscription = runs.subscribeToRun(spec, { skipColumns, stopOnCompletion: false });
  else if (kind === "batch") subscription = runs.subscribeToBatch(spec, { skipColumns });
  else {
    const [tags, createdAt] = spec.split("|");
    const filters = {};
    if (createdAt) filters.createdAt = createdAt;
    if (skipColumns) filters.skipColumns = skipColumns;
    subscription = runs.subscribeToRunsWithTag(tags.split(","), filters);
  }
  try {
    for await (const run of subscription) {
      // Rows yielded while the snapshot's response is the latest one are the snapshot's
      // (not necessarily all of them: the SDK yields one run at a time).
      const snap = snapshotReq !== null && lastResp === snapshotReq ? snapshotReq : null;
      const u = run.updatedAt instanceof Date ? run.updatedAt.getTime() : null;
      print({ k: "rows", rows: [{ id: run.id, op: "run", u, ck: ckOf(run.metadata), status: run.status ?? null }], snap, complete: false, sdk: true });
    }
    print({ k: "error", message: "subscription ended" });
  } catch (e) {
    print({ k: "error", message: String(e?.message ?? e) });
    process.exit(1);
  }
}
