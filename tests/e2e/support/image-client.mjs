// scripts/image.sh's client: follows one run's feed through the container with the real
// @electric-sql/client 1.0.14 ShapeStream (the SDK's headers), and checks the two halves of a
// subscription: the snapshot (the run, then up-to-date), then a live poll that delivers a change.
// Once the snapshot is up to date it runs IMAGE_CHANGE_CMD (a shell command that changes the run
// and publishes its change record) and waits for the update, which only a live request can carry.
// Prints one line per check (`ok …` / `not ok …`); exits 0 when both pass.
//   IMAGE_CHANGE_CMD='…' node tests/e2e/support/image-client.mjs --base-url URL --token TOKEN --run RUN_ID
import { execFile } from "node:child_process";
import { parseArgs } from "node:util";
import { ShapeStream } from "@electric-sql/client";

const { values: opts } = parseArgs({
  options: {
    "base-url": { type: "string" },
    token: { type: "string" },
    run: { type: "string" },
    "timeout-ms": { type: "string", default: "25000" },
  },
});
const changeCmd = process.env.IMAGE_CHANGE_CMD;
if (!opts["base-url"] || !opts.token || !opts.run || !changeCmd) {
  console.error("usage: IMAGE_CHANGE_CMD=… node image-client.mjs --base-url URL --token TOKEN --run RUN_ID");
  process.exit(2);
}
const timeoutMs = Number(opts["timeout-ms"]);

// Which requests the client made, to tell the live poll from the snapshot.
const requests = [];
const fetchClient = (input, init) => {
  const url = new URL(input instanceof Request ? input.url : String(input));
  requests.push({ live: url.searchParams.get("live") === "true", offset: url.searchParams.get("offset") });
  return fetch(input, init);
};

const controller = new AbortController();
const stream = new ShapeStream({
  url: `${opts["base-url"].replace(/\/+$/, "")}/realtime/v1/runs/${opts.run}`,
  headers: {
    Authorization: `Bearer ${opts.token}`,
    "x-trigger-electric-version": "1.0.0-beta.1",
    "x-trigger-api-version": "2025-07-16",
  },
  signal: controller.signal,
  fetchClient,
  onError: (e) => finish(false, `client error: ${e?.message ?? e}`),
});

let phase = "snapshot";
let snapshotStatus;
let failed = false;
const timer = setTimeout(() => finish(false, `timed out after ${timeoutMs} ms in the ${phase} phase`), timeoutMs);

function finish(ok, detail) {
  if (!ok) {
    console.log(`not ok ${phase}: ${detail}`);
    failed = true;
  }
  clearTimeout(timer);
  controller.abort();
  process.exit(failed ? 1 : 0);
}

stream.subscribe(
  (messages) => {
    const rows = messages.filter((m) => m && "key" in m);
    const upToDate = messages.some((m) => m?.headers?.control === "up-to-date");
    if (phase === "snapshot") {
      const run = rows.find((m) => m.headers?.operation === "insert");
      if (run) snapshotStatus = run.value?.status;
      if (!upToDate) return;
      if (!snapshotStatus) return finish(false, "up-to-date without the run");
      console.log(`ok snapshot: ${opts.run} ${snapshotStatus}, then up-to-date (offset=-1, not live)`);
      phase = "live";
      execFile("bash", ["-c", changeCmd], { timeout: 30000 }, (err, _stdout, stderr) => {
        if (err) finish(false, `the change command failed: ${stderr || err.message}`);
      });
      return;
    }
    const update = rows.find((m) => m.headers?.operation === "update");
    if (!update) return;
    const last = requests[requests.length - 1];
    if (!last?.live) return finish(false, "the update came on a request without live=true");
    if (update.value?.status === snapshotStatus) return finish(false, `the status is still ${snapshotStatus}`);
    console.log(`ok live poll: ${opts.run} ${snapshotStatus} -> ${update.value?.status} (live=true, offset=${last.offset})`);
    finish(true);
  },
  (e) => finish(false, `subscription error: ${e?.message ?? e}`)
);
