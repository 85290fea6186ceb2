// End-to-end browser test of the live-runs page (tests/browser/src) against a real runfeed.
//
// Debian's chromium (/usr/bin/chromium), driven by playwright-core, opens the page built by Vite
// (tests/browser/dist) from a tiny static server on its own loopback port, a different origin
// from runfeed's, so every realtime request is a real cross-origin fetch with CORS. The page uses
// the real @trigger.dev/react-hooks (useRealtimeRun, useRealtimeRunsWithTag, useRealtimeBatch).
//
// Asserts: rows appear; an update committed to Postgres and then published shows up in the page
// within 1 s; a bad token (401) and a token without access (403) are shown as errors rather than
// hanging; hiding and showing the page (visibilitychange) resumes the feeds; no MissingHeadersError
// or CORS message appears in the console. Saves a screenshot to target/test-logs/browser.png
// (and to tests/browser/screenshot.png when BROWSER_UPDATE_SCREENSHOT=1).
//
// Run it with `bash scripts/browser.sh` (installs chromium, builds the page, runs this file).
// Env: BROWSER_CHROMIUM (default /usr/bin/chromium), E2E_RUNFEED_BIN etc. as in ../e2e/lib.mjs.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { CHROMIUM, launchChromium } from "./chromium.mjs";
import { startStatic, pageUrl as makePageUrl, DIST } from "./serve.mjs";
import { createDatabase, dropDatabase, Fixture, startServer, mintToken, signJwt, jwtClaims, publish, ROOT, sleep } from "../e2e/lib.mjs";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const LOG_DIR = path.join(process.env.CARGO_TARGET_DIR ? path.resolve(process.env.CARGO_TARGET_DIR) : path.join(ROOT, "target"), "test-logs");
const SHOT = path.join(LOG_DIR, "browser.png");
const LATENCY_MS = 1000;

// ---------------------------------------------------------------------------------------------
// world: database, runfeed, fixtures, static server, browser

let db, server, fixture, base, env, token, tag, batch, runA, runB, runC, web, browser, context;
const consoleLog = []; // every console message / page error of every page: {page, type, text}

before(async () => {
  assert.ok(fs.existsSync(path.join(DIST, "index.html")), `no ${DIST}/index.html: run \`npx vite build\` in tests/browser (scripts/browser.sh does)`);
  assert.ok(fs.existsSync(CHROMIUM), `no ${CHROMIUM}: apt-get install chromium (scripts/browser.sh does)`);
  // Its own database prefix: scripts/test.sh drops stale runfeed_e2e_* databases when it starts,
  // which would pull this one from under a browser run going on at the same time.
  db = await createDatabase("runfeed_browser");
  fixture = new Fixture(db.url);
  server = await startServer({ databaseUrl: db.url, holdMs: 20000, label: "browser" });
  base = server.baseUrl;
  env = await fixture.createEnv();
  token = await mintToken(db.url, env.id, ["read:runs"]);
  tag = `browser-${Date.now().toString(36)}`;
  batch = await fixture.createBatch(env);
  const t = Date.now();
  runA = await fixture.createRun(env, { tags: [tag], batchId: batch.id, taskIdentifier: "resize-image", createdAt: t - 3000, metadata: '{"progress":0}' });
  runB = await fixture.createRun(env, { tags: [tag], batchId: batch.id, taskIdentifier: "resize-image", createdAt: t - 2000, status: "EXECUTING", startedAt: t - 1500 });
  runC = await fixture.createRun(env, { tags: [tag, "other"], batchId: batch.id, taskIdentifier: "send-email", createdAt: t - 1000 });
  web = await startStatic(DIST);
  assert.notEqual(new URL(web.origin).origin, new URL(base).origin, "the page must be served from another origin than runfeed");
  browser = await launchChromium();
  context = await browser.newContext({ viewport: { width: 1100, height: 900 } });
});

after(async () => {
  // Every step runs, whichever of them fails.
  const steps = [() => context?.close(), () => browser?.close(), () => web?.server.close(), () => server?.stop(), () => fixture?.close()];
  for (const step of steps) {
    try {
      await step();
    } catch {}
  }
  if (db) await dropDatabase(db.name).catch(() => {});
});

const pageUrl = (params) => makePageUrl(web.origin, params);

/** A new page that records its console and its realtime requests. */
async function openPage(name, params) {
  const page = await context.newPage();
  const requests = []; // realtime requests: {url, live, done, status, failed}
  page.on("console", (m) => consoleLog.push({ page: name, type: m.type(), text: m.text() }));
  page.on("pageerror", (e) => consoleLog.push({ page: name, type: "pageerror", text: String(e?.stack ?? e) }));
  page.on("request", (r) => {
    if (!r.url().startsWith(base)) return;
    const u = new URL(r.url());
    requests.push({ req: r, path: u.pathname, live: u.searchParams.get("live") === "true", done: false, status: null, failed: null });
  });
  const rec = (r) => requests.find((x) => x.req === r);
  page.on("requestfinished", async (r) => {
    const x = rec(r);
    if (!x) return;
    x.done = true;
    x.status = (await r.response().catch(() => null))?.status() ?? null;
  });
  page.on("requestfailed", (r) => {
    const x = rec(r);
    if (!x) return;
    x.done = true;
    x.failed = r.failure()?.errorText ?? "failed";
  });
  await page.goto(pageUrl(params));
  return { page, requests };
}

const describeRequests = (requests) =>
  requests.map((r) => `${r.req.url().slice(base.length)} → ${r.status ?? r.failed ?? "pending"}`).join("\n");

/** True once each of `paths` has a live request in flight (the hooks are up to date and waiting). */
function allLive(requests, paths) {
  return paths.every((p) => requests.some((r) => r.path === p && r.live && !r.done));
}

async function waitAllLive(requests, paths, timeoutMs = 10000) {
  const deadline = Date.now() + timeoutMs;
  while (!allLive(requests, paths)) {
    if (Date.now() > deadline) throw new Error(`no live request in flight for each of ${paths.join(", ")} within ${timeoutMs} ms:\n${describeRequests(requests)}`);
    await sleep(20);
  }
}

/** Updates a run in Postgres (committed), publishes its change record, and returns the timings. */
async function commitAndPublish(run, set) {
  const row = await fixture.updateRun(run.id, set);
  const committedAt = Date.now();
  await publish({ envId: env.id, runId: row.id, tags: row.runTags ?? [], batchId: row.batchId ?? undefined, updatedAtMs: row.updatedAtMs });
  return { row, committedAt, publishedAt: Date.now() };
}

/** Waits until `fn` (run in the page) is true; returns the ms it took from `since`. */
async function visibleWithin(page, since, fn, arg, what) {
  await page.waitForFunction(fn, arg, { timeout: 10000, polling: 10 }).catch((e) => {
    throw new Error(`${what}: not in the page within 10 s (${e.message})`);
  });
  return Date.now() - since;
}

const FEEDS = () => [`/realtime/v1/runs/${runA.friendlyId}`, "/realtime/v1/runs", `/realtime/v1/batches/${batch.friendlyId}`];

function corsOrHeaderMessages() {
  return consoleLog.filter((m) => /MissingHeadersError|CORS|Access-Control|cross-origin|blocked by/i.test(m.text));
}

// ---------------------------------------------------------------------------------------------

let main; // the main page, shared by the tests below (they run in order)

test("browser: the page shows the run, the tag's runs and the batch (rows appear)", async () => {
  main = await openPage("main", { baseURL: base, token, run: runA.friendlyId, tag, batch: batch.friendlyId });
  const { page } = main;
  const diag = async (e) => {
    const alerts = await page.locator('[role="alert"]').allTextContents().catch(() => []);
    throw new Error(`${e.message}\nerrors shown: ${JSON.stringify(alerts)}\nrequests:\n${describeRequests(main.requests)}\nserver log:\n${server.logs().slice(-3000)}`);
  };
  // The SDK maps the stored PENDING to its public status QUEUED.
  await page.waitForSelector('[data-testid="run"][data-status="QUEUED"]', { timeout: 15000 }).catch(diag);
  await page.waitForFunction(() => document.querySelectorAll('[data-testid="tag-table"] tbody tr').length === 3, null, { timeout: 15000 }).catch(diag);
  await page.waitForFunction(() => document.querySelector('[data-testid="batch-progress"]')?.dataset.total === "3", null, { timeout: 15000 }).catch(diag);
  assert.equal(await page.textContent('[data-testid="run-metadata"]'), '{"progress":0}');
  const ids = await page.$$eval('[data-testid="tag-table"] tbody tr', (trs) => trs.map((tr) => tr.dataset.runId));
  assert.deepEqual(new Set(ids), new Set([runA.friendlyId, runB.friendlyId, runC.friendlyId]));
  assert.equal(await page.locator('[role="alert"]').count(), 0, "no error shown");
  await waitAllLive(main.requests, FEEDS());
});

test("browser: an update committed to Postgres and published appears within 1 s", async () => {
  const { page, requests } = main;
  await waitAllLive(requests, FEEDS());
  // A run that is in every feed: status + metadata.
  const u1 = await commitAndPublish(runA, { status: "EXECUTING", startedAt: Date.now(), metadata: '{"progress":50}' });
  const ms1 = await visibleWithin(
    page,
    u1.publishedAt,
    () =>
      document.querySelector('[data-testid="run"]')?.dataset.status === "EXECUTING" &&
      document.querySelector('[data-testid="run-metadata"]')?.textContent === '{"progress":50}',
    null,
    "run A EXECUTING with progress 50"
  );
  const ms1tag = await visibleWithin(
    page,
    u1.publishedAt,
    (id) => document.querySelector(`[data-testid="tag-table"] tr[data-run-id="${id}"]`)?.dataset.status === "EXECUTING",
    runA.friendlyId,
    "run A EXECUTING in the tag table"
  );
  // A run that finishes: the batch's progress moves.
  await waitAllLive(requests, FEEDS());
  const u2 = await commitAndPublish(runB, { status: "COMPLETED_SUCCESSFULLY", completedAt: Date.now() });
  const ms2 = await visibleWithin(
    page,
    u2.publishedAt,
    () => document.querySelector('[data-testid="batch-progress"]')?.dataset.done === "1",
    null,
    "batch progress 1/3"
  );
  // A new run with the tag: a new row.
  await waitAllLive(requests, FEEDS());
  const t0 = Date.now();
  const runD = await fixture.createAndPublish(env, { tags: [tag], taskIdentifier: "new-task" });
  const ms3 = await visibleWithin(
    page,
    Date.now(),
    (id) => !!document.querySelector(`[data-testid="tag-table"] tr[data-run-id="${id}"]`),
    runD.friendlyId,
    "new run D in the tag table"
  );
  console.log(`# latencies after publish: run card ${ms1} ms, tag row ${ms1tag} ms, batch ${ms2} ms, new row ${ms3} ms (create+publish took ${Date.now() - t0 - ms3} ms)`);
  for (const [what, ms] of [["run card", ms1], ["tag row", ms1tag], ["batch progress", ms2], ["new tag row", ms3]]) {
    assert.ok(ms <= LATENCY_MS, `${what}: ${ms} ms after publish (limit ${LATENCY_MS} ms)\n${describeRequests(requests)}`);
  }
  assert.equal(await page.locator('[role="alert"]').count(), 0, "no error shown");
});

test("browser: hiding and showing the page (visibilitychange) resumes the feeds", async () => {
  const { page, requests } = main;
  await waitAllLive(requests, FEEDS());
  const setHidden = (hidden) =>
    page.evaluate((h) => {
      Object.defineProperty(document, "hidden", { configurable: true, get: () => h });
      Object.defineProperty(document, "visibilityState", { configurable: true, get: () => (h ? "hidden" : "visible") });
      document.dispatchEvent(new Event("visibilitychange"));
    }, hidden);

  await setHidden(true);
  // @electric-sql/client pauses: it aborts its in-flight requests and makes no new ones.
  const deadline = Date.now() + 5000;
  while (requests.some((r) => !r.done)) {
    if (Date.now() > deadline) throw new Error(`requests still in flight 5 s after hiding:\n${describeRequests(requests)}`);
    await sleep(20);
  }
  const countHidden = requests.length;
  // A change while hidden: not delivered now, but caught up on when the page is shown again.
  await commitAndPublish(runC, { status: "EXECUTING", startedAt: Date.now(), metadata: '{"step":"hidden"}' });
  await sleep(700);
  assert.equal(requests.length, countHidden, `no realtime request while hidden:\n${describeRequests(requests.slice(countHidden))}`);
  assert.notEqual(await page.getAttribute(`[data-testid="tag-table"] tr[data-run-id="${runC.friendlyId}"]`, "data-status"), "EXECUTING");

  const shownAt = Date.now();
  await setHidden(false);
  const catchUp = await visibleWithin(
    page,
    shownAt,
    (id) => document.querySelector(`[data-testid="tag-table"] tr[data-run-id="${id}"]`)?.dataset.status === "EXECUTING",
    runC.friendlyId,
    "the change made while hidden"
  );
  await waitAllLive(requests, FEEDS());
  // And live updates flow again.
  const u = await commitAndPublish(runA, { metadata: '{"progress":100}', status: "COMPLETED_SUCCESSFULLY", completedAt: Date.now() });
  const ms = await visibleWithin(
    page,
    u.publishedAt,
    () =>
      document.querySelector('[data-testid="run"]')?.dataset.status === "COMPLETED" &&
      document.querySelector('[data-testid="run-metadata"]')?.textContent === '{"progress":100}' &&
      document.querySelector('[data-testid="batch-progress"]')?.dataset.done === "2",
    null,
    "run A COMPLETED after resume"
  );
  console.log(`# after show: caught up in ${catchUp} ms; next update ${ms} ms after publish`);
  assert.ok(ms <= LATENCY_MS, `update after resume: ${ms} ms after publish\n${describeRequests(requests)}`);
  assert.equal(await page.locator('[role="alert"]').count(), 0, "no error shown");

  fs.mkdirSync(LOG_DIR, { recursive: true });
  await page.screenshot({ path: SHOT, fullPage: true });
  if (process.env.BROWSER_UPDATE_SCREENSHOT === "1") fs.copyFileSync(SHOT, path.join(HERE, "screenshot.png"));
  console.log(`# screenshot: ${SHOT}`);
});

test("browser: a 401 (bad token) and a 403 (no access) are shown as errors, not hanging", async () => {
  const other = await fixture.createEnv();
  const cases = [
    ["401", signJwt(jwtClaims(env.id, ["read:runs"]), other.apiKey), 401],
    ["403", await mintToken(db.url, env.id, ["read:runs:run_nosuchrun000000000000000"]), 403],
  ];
  for (const [name, badToken, status] of cases) {
    const t0 = Date.now();
    const { page, requests } = await openPage(`bad-${name}`, { baseURL: base, token: badToken, run: runA.friendlyId, tag, batch: batch.friendlyId });
    for (const what of ["run", "tag", "batch"]) {
      await page.waitForSelector(`[data-testid="${what}-error"]`, { timeout: 10000 }).catch((e) => {
        throw new Error(`${name}: no ${what} error shown within 10 s (${e.message})\n${describeRequests(requests)}`);
      });
    }
    const statuses = new Set(requests.filter((r) => r.done).map((r) => r.status));
    assert.ok(statuses.has(status), `${name}: the server answered ${[...statuses].join(", ")}`);
    const text = await page.textContent('[data-testid="run-error"]');
    console.log(`# ${name}: errors shown after ${Date.now() - t0} ms: ${text}`);
    assert.equal(await page.locator('[data-testid="run"]').count(), 0, `${name}: no run data shown`);
    await page.close();
  }
});

test("browser: the SSE switch (@electric-sql/client 1.5, liveSse) follows the run over text/event-stream", async () => {
  const runS = await fixture.createRun(env, { tags: [tag], taskIdentifier: "sse-task", status: "PENDING" });
  const streams = []; // responses of live_sse requests: {contentType, status}
  let streamOpened;
  const opened = new Promise((resolve) => (streamOpened = resolve));
  const page = await context.newPage();
  page.on("console", (m) => consoleLog.push({ page: "sse", type: m.type(), text: m.text() }));
  page.on("pageerror", (e) => consoleLog.push({ page: "sse", type: "pageerror", text: String(e?.stack ?? e) }));
  page.on("response", (r) => {
    if (r.url().startsWith(base) && new URL(r.url()).searchParams.get("live_sse") === "true") {
      streams.push({ status: r.status(), contentType: r.headers()["content-type"] ?? "" });
      if (r.status() === 200) streamOpened();
    }
  });
  const requests = [];
  page.on("request", (r) => r.url().startsWith(base) && requests.push(`${r.method()} ${r.url().slice(base.length)}`));
  await page.goto(pageUrl({ baseURL: base, token, run: runS.friendlyId, sse: "1" }));
  await page.waitForSelector('[data-testid="sse-run"][data-status="PENDING"]', { timeout: 10000 }).catch(async (e) => {
    const text = await page.textContent("main").catch(() => "?");
    const log = consoleLog.filter((m) => m.page === "sse").map((m) => `${m.type}: ${m.text}`);
    throw new Error(`SSE run card not shown (${e.message})\npage: ${text}\nrequests: ${requests.join("\n")}\nconsole: ${log.join("\n")}`);
  });
  // The client goes live over SSE once up to date: wait for the stream's headers.
  let timer;
  const timedOut = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`no SSE stream opened: ${JSON.stringify(streams)}`)), 10000);
  });
  await Promise.race([opened, timedOut]).finally(() => clearTimeout(timer));
  assert.match(streams.find((s) => s.status === 200).contentType, /^text\/event-stream/);
  // No wait for the hold itself: a change published before the stream registers on the router
  // is replayed to it from the offset it resumes.
  const u = await commitAndPublish(runS, { status: "EXECUTING" });
  const ms = await visibleWithin(
    page,
    u.publishedAt,
    () => document.querySelector('[data-testid="sse-run"]')?.dataset.status === "EXECUTING",
    null,
    "SSE run card EXECUTING"
  );
  console.log(`# SSE: update visible ${ms} ms after publish; streams: ${JSON.stringify(streams)}`);
  assert.ok(ms <= LATENCY_MS, `SSE update after ${ms} ms`);
  assert.equal(await page.locator('[role="alert"]').count(), 0, "no error shown");
  await page.close();
});

test("browser: no MissingHeadersError or CORS error in the console", async () => {
  const bad = corsOrHeaderMessages();
  assert.deepEqual(bad, [], `console:\n${consoleLog.map((m) => `[${m.page}] ${m.type}: ${m.text}`).join("\n")}`);
  const pageErrors = consoleLog.filter((m) => m.type === "pageerror");
  assert.deepEqual(pageErrors, [], "no uncaught page errors");
});
