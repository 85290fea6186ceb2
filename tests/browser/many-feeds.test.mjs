// Many live feeds in one browser tab, over HTTP/2 through a proxy recipe.
//
// Browsers open at most 6 HTTP/1.1 connections per origin, and a live poll holds one for up to
// the hold, so a page following more runs than that stalls. Here Debian's chromium (playwright-core)
// opens many-feeds.html through the SHIPPED nginx recipe (deploy/proxies/nginx/runfeed.conf, only
// its addresses and certificate paths rewritten, as tests/e2e/proxies/ does) on its TLS listener
// with a self-signed certificate made by openssl: the page follows 12 runs with one long-poll loop
// each, from the same origin as the feeds. Asserts: runfeed holds all 12 live polls at once; each
// run, updated in Postgres and its change record published, shows up on the page within 1 s of
// its publish; every feed request went over h2 (PerformanceResourceTiming.nextHopProtocol).
//
// Run by `bash scripts/browser.sh` (which installs chromium and nginx if they are missing).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import http from "node:http";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { CHROMIUM, launchChromium } from "./chromium.mjs";
import { createDatabase, dropDatabase, Fixture, startServer, mintToken, publish, freePort, freePorts, waitFor } from "../e2e/lib.mjs";
import { render, startProxy, makeCert } from "../e2e/proxies/suite.mjs";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const FEEDS = 12;
const LATENCY_MS = 1000;

let db, fixture, server, adminBase, webapp, proxy, dir, browser, page, env, token, runs;
const consoleLog = [];

/**
 * The stand-in webapp behind the proxy: serves many-feeds.html at /many-feeds (so the page and
 * its feeds share one origin, as on trigger.dev's dashboard), 404 JSON elsewhere.
 */
function startWebapp() {
  const html = fs.readFileSync(path.join(HERE, "many-feeds.html"));
  const srv = http.createServer((req, res) => {
    if (new URL(req.url, "http://x").pathname === "/many-feeds") {
      res.writeHead(200, { "content-type": "text/html; charset=utf-8", "cache-control": "no-store" });
      return res.end(html);
    }
    // What the proxy suite's readiness check looks for.
    res.writeHead(req.url === "/__proxy_ready" ? 200 : 404, { "content-type": "application/json", "x-stub": "webapp" });
    res.end('{"error":"Not found"}');
  });
  return new Promise((resolve) => srv.listen(0, "127.0.0.1", () => resolve({ server: srv, addr: `127.0.0.1:${srv.address().port}` })));
}

/** The sum of runfeed's gauge `name` over the series whose labels include `label`. */
async function metric(name, label) {
  const text = await (await fetch(`${adminBase}/metrics`)).text();
  return text
    .split("\n")
    .filter((l) => l.startsWith(`${name}{`) && l.includes(label))
    .reduce((n, l) => n + Number(l.slice(l.lastIndexOf(" ") + 1)), 0);
}

before(async () => {
  assert.ok(fs.existsSync(CHROMIUM), `no ${CHROMIUM}: apt-get install chromium (scripts/browser.sh does)`);
  db = await createDatabase("runfeed_browser");
  fixture = new Fixture(db.url);
  const adminPort = await freePort();
  adminBase = `http://127.0.0.1:${adminPort}`;
  server = await startServer({
    databaseUrl: db.url,
    holdMs: 20000,
    label: "many-feeds",
    env: { RUNFEED_TELEMETRY__ADMIN_LISTEN: `127.0.0.1:${adminPort}` },
  });
  env = await fixture.createEnv();
  token = await mintToken(db.url, env.id, ["read:runs"]);
  runs = [];
  for (let i = 0; i < FEEDS; i++) runs.push(await fixture.createRun(env, { status: "EXECUTING", startedAt: Date.now() }));

  webapp = await startWebapp();
  dir = fs.mkdtempSync(path.join(os.tmpdir(), "runfeed-many-feeds-"));
  const tls = makeCert(dir);
  const [port, tlsPort] = await freePorts(2);
  const ports = { port, tlsPort };
  const config = render("nginx", { ...ports, tls, runfeed: new URL(server.baseUrl).host, webapp: webapp.addr });
  proxy = await startProxy("nginx", config, ports, "nginx (many feeds)");

  browser = await launchChromium(["--ignore-certificate-errors"]); // the test's self-signed certificate
  const context = await browser.newContext();
  page = await context.newPage();
  page.on("console", (m) => consoleLog.push(`${m.type()}: ${m.text()}`));
  page.on("pageerror", (e) => consoleLog.push(`pageerror: ${e?.stack ?? e}`));
});

after(async () => {
  const steps = [() => browser?.close(), () => proxy?.stop(), () => webapp?.server.close(), () => server?.stop(), () => fixture?.close()];
  for (const step of steps) {
    try {
      await step();
    } catch {}
  }
  if (dir) fs.rmSync(dir, { recursive: true, force: true });
  if (db) await dropDatabase(db.name).catch(() => {});
});

// The last page state and held count read (waitFor's diag is synchronous).
let lastFeeds = null;
let lastHeld = null;
const feedsState = async () => (lastFeeds = await page.evaluate(() => window.feeds));
const heldRunFeeds = async () => (lastHeld = await metric("runfeed_router_held_feeds", 'kind="run"'));

function diag() {
  return [
    `runfeed holds ${lastHeld} run feeds`,
    `page: ${JSON.stringify(lastFeeds)}`,
    `console:\n${consoleLog.slice(-20).join("\n")}`,
    `nginx:\n${proxy.logs().slice(-2000)}`,
    `runfeed:\n${server.logs().slice(-2000)}`,
  ].join("\n");
}

test(`browser: ${FEEDS} live run feeds on one page over HTTP/2 each see their update within ${LATENCY_MS} ms`, async () => {
  const url = `${proxy.tlsBase}/many-feeds?token=${encodeURIComponent(token)}&runs=${runs.map((r) => r.friendlyId).join(",")}`;
  const t0 = Date.now();
  await page.goto(url);

  // All 12 live at once: each loop has a live request out, and runfeed holds 12 run feeds (over
  // HTTP/1.1 the browser would send at most 6 and queue the rest).
  await waitFor(
    async () => {
      const feeds = await feedsState();
      return runs.every((r) => feeds?.[r.friendlyId]?.live && feeds[r.friendlyId].status === "EXECUTING");
    },
    { what: `all ${FEEDS} feeds snapshotted and live on the page`, timeoutMs: 15000, intervalMs: 20, diag }
  );
  await waitFor(async () => (await heldRunFeeds()) === FEEDS, {
    what: `runfeed holding all ${FEEDS} live polls at once`,
    timeoutMs: 5000,
    intervalMs: 20,
    diag,
  });
  const liveAfterMs = Date.now() - t0;

  // Update every run: committed to Postgres, then its change record published.
  const published = [];
  for (const run of runs) {
    const row = await fixture.updateRun(run.id, { status: "COMPLETED_SUCCESSFULLY", completedAt: Date.now() });
    await publish({ envId: env.id, runId: row.id, tags: row.runTags ?? [], batchId: row.batchId ?? undefined, updatedAtMs: row.updatedAtMs });
    published.push({ id: run.friendlyId, at: Date.now() });
  }
  await waitFor(
    async () => {
      const feeds = await feedsState();
      return runs.every((r) => feeds[r.friendlyId].status === "COMPLETED_SUCCESSFULLY");
    },
    { what: `all ${FEEDS} updates on the page`, timeoutMs: 10000, intervalMs: 20, diag }
  );
  const feeds = await feedsState();
  const latencies = published.map(({ id, at }) => ({ id, ms: feeds[id].seen.find((s) => s.status === "COMPLETED_SUCCESSFULLY").at - at }));
  const late = latencies.filter((l) => l.ms > LATENCY_MS);
  const sorted = latencies.map((l) => l.ms).sort((a, b) => a - b);
  console.log(`# ${FEEDS} feeds live ${liveAfterMs} ms after the page opened; update seen after publish: median ${sorted[FEEDS >> 1]} ms, max ${sorted.at(-1)} ms`);
  assert.deepEqual(late, [], `updates seen later than ${LATENCY_MS} ms after their publish: ${JSON.stringify(late)}`);
  for (const r of runs) assert.deepEqual(feeds[r.friendlyId].errors, [], `${r.friendlyId}: errors on the page`);

  // Every feed request went over HTTP/2 (the page and its feeds: one h2 connection's worth).
  const protocols = await page.evaluate(() =>
    performance
      .getEntriesByType("resource")
      .filter((e) => new URL(e.name).pathname.startsWith("/realtime/v1/runs/"))
      .map((e) => e.nextHopProtocol)
  );
  assert.ok(protocols.length >= 2 * FEEDS, `${protocols.length} feed requests in the resource timings, expected at least ${2 * FEEDS}`);
  assert.deepEqual([...new Set(protocols)], ["h2"], `nextHopProtocol of the feed requests: ${JSON.stringify(protocols)}`);
});
