#!/usr/bin/env node
// Watch a runfeed feed the way a trigger.dev user does: with the real @trigger.dev/sdk 4.8.3
// (runs.subscribeToRun / subscribeToRunsWithTag / subscribeToBatch), printing each run object the
// SDK yields as one JSON line. With --shape, use the raw @electric-sql/client 1.0.14 ShapeStream
// instead and print every message batch the client receives.
//
//   node tests/e2e/watch.mjs --base-url http://127.0.0.1:3030 --token TOKEN --run run_…
//   node tests/e2e/watch.mjs --base-url http://127.0.0.1:3030 --token TOKEN --tag user:alice [--created-at 1h]
//   node tests/e2e/watch.mjs --base-url http://127.0.0.1:3030 --token TOKEN --batch batch_… [--shape]
//
// Needs `npm ci` in tests/e2e. Runs until Ctrl-C (or --seconds N).
import { parseArgs } from "node:util";

const USAGE = `usage: node tests/e2e/watch.mjs --base-url URL --token TOKEN (--run ID | --tag T[,T] | --batch ID)
  [--created-at 1h] [--skip-columns a,b] [--shape] [--seconds N]`;

let opts;
try {
  ({ values: opts } = parseArgs({
    options: {
      "base-url": { type: "string", default: "http://127.0.0.1:3030" },
      token: { type: "string" },
      run: { type: "string" },
      tag: { type: "string" },
      batch: { type: "string" },
      "created-at": { type: "string" },
      "skip-columns": { type: "string" },
      shape: { type: "boolean", default: false },
      seconds: { type: "string" },
      help: { type: "boolean", short: "h", default: false },
    },
  }));
} catch (e) {
  console.error(`${e.message}\n${USAGE}`);
  process.exit(2);
}
if (opts.help) {
  console.log(USAGE);
  process.exit(0);
}
const picked = ["run", "tag", "batch"].filter((k) => opts[k]);
if (!opts.token || picked.length !== 1) {
  console.error(USAGE);
  process.exit(2);
}

const baseUrl = opts["base-url"].replace(/\/+$/, "");
const skipColumns = opts["skip-columns"]?.split(",").filter(Boolean);
const print = (kind, data) =>
  console.log(JSON.stringify({ ts: new Date().toISOString(), kind, ...data }, (_k, v) => (typeof v === "bigint" ? String(v) : v)));

if (opts.seconds) setTimeout(() => process.exit(0), Number(opts.seconds) * 1000).unref();
process.on("SIGINT", () => process.exit(0));

if (opts.shape) {
  const { ShapeStream } = await import("@electric-sql/client");
  const params = new URLSearchParams();
  let path;
  if (opts.run) path = `/realtime/v1/runs/${encodeURIComponent(opts.run)}`;
  else if (opts.batch) path = `/realtime/v1/batches/${encodeURIComponent(opts.batch)}`;
  else {
    path = "/realtime/v1/runs";
    params.set("tags", opts.tag);
    if (opts["created-at"]) params.set("createdAt", opts["created-at"]);
  }
  if (skipColumns) params.set("skipColumns", skipColumns.join(","));
  const query = params.toString();
  const stream = new ShapeStream({
    url: `${baseUrl}${path}${query ? `?${query}` : ""}`,
    headers: {
      Authorization: `Bearer ${opts.token}`,
      "x-trigger-electric-version": "1.0.0-beta.1",
      "x-trigger-api-version": "2025-07-16",
    },
    onError: (e) => {
      print("error", { status: e?.status, message: String(e?.message ?? e) });
      process.exit(1);
    },
  });
  stream.subscribe((messages) => print("batch", { offset: stream.lastOffset, handle: stream.shapeHandle, messages }));
} else {
  const { configure, runs } = await import("@trigger.dev/sdk");
  configure({ baseURL: baseUrl, accessToken: opts.token });
  let subscription;
  if (opts.run) subscription = runs.subscribeToRun(opts.run, { skipColumns, stopOnCompletion: false });
  else if (opts.tag) {
    const filters = {};
    if (opts["created-at"]) filters.createdAt = opts["created-at"];
    if (skipColumns) filters.skipColumns = skipColumns;
    subscription = runs.subscribeToRunsWithTag(opts.tag.split(","), filters);
  } else subscription = runs.subscribeToBatch(opts.batch);
  print("subscribed", { feed: picked[0], id: opts[picked[0]], baseUrl });
  try {
    for await (const run of subscription) print("run", { run });
    print("end", {});
  } catch (e) {
    print("error", { message: String(e?.message ?? e) });
    process.exit(1);
  }
}
