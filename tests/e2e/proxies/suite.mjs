// The reverse-proxy recipes tested for real (run by scripts/proxies.sh; one test file per proxy,
// all in parallel): deploy/proxies/ (nginx, Caddy, HAProxy) and the Traefik router of
// deploy/trigger.dev/compose/docker-compose.runfeed.traefik.yml (its Docker labels turned into
// Traefik's file-provider configuration, beside trigger.dev's webapp router). Each file starts,
// on its own database:
//
//   - a real `runfeed serve` (20 s holds without jitter; a per-organization concurrency limit of 2
//     for the environment of the abort check);
//   - a stub "webapp" that answers every path with JSON naming itself and echoing the request;
//   - a stub "feed upstream" that stands in for runfeed where runfeed cannot yet show a behaviour
//     (an SSE stream) and echoes what reaches it;
//   - the proxy with its SHIPPED configuration in front of runfeed + the webapp stub, and a second
//     instance of it in front of the feed stub + the webapp stub. Only the listen addresses, the
//     upstream addresses and the certificate paths are rewritten (`render`, which fails if one is
//     not found exactly once); the certificate is a self-signed one made here with openssl
//     (Caddy's comes from its own local CA: the recipe gets its certificate itself).
//
// Through the proxy it checks the routing (the three feed routes on GET/HEAD/OPTIONS to runfeed;
// /realtime/v1/streams/…, /realtime/v1/sessions/… and everything else to the webapp), the SDK
// following a run, a tag and a batch, a live poll held the full 20 s, a client abort freeing its
// concurrency slot, a 409 that is not cached, CORS from runfeed only, the client's address
// forwarded, an SSE stream passed on unbuffered, and — once runfeed serves SSE — runfeed's own;
// and on the TLS listener, HTTP/2 negotiated by ALPN with a feed followed over it while the
// upstream request stays HTTP/1.1.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import http2 from "node:http2";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { spawn, spawnSync } from "node:child_process";
import {
  ROOT,
  REDIS_URL,
  SDK_HEADERS,
  setupWorld,
  startServer,
  freePort,
  freePorts,
  raw,
  qs,
  sdkSubscribe,
  waitFor,
  withTimeout,
  isUpToDate,
} from "../lib.mjs";

const HOLD_MS = 20000;
const FEED_ROUTE = /^\/realtime\/v1\/(runs|runs\/[^/]+|batches\/[^/]+)$/;

// ---------------------------------------------------------------------------------------------
// the shipped configurations, with this test's addresses

const SHIPPED = {
  nginx: "deploy/proxies/nginx/runfeed.conf",
  caddy: "deploy/proxies/caddy/Caddyfile",
  haproxy: "deploy/proxies/haproxy/haproxy.cfg",
  traefik: "deploy/trigger.dev/compose/docker-compose.runfeed.traefik.yml",
};

/**
 * trigger.dev v4.5.12's Traefik set-up (hosting/docker/docker-compose.traefik.yml): the webapp's
 * router `webapp` with rule Host(`webapp.localhost`), entrypoint ${TRAEFIK_ENTRYPOINT:-web},
 * service port 3000, no explicit priority; entry points `web` (:80) and `websecure` (:443). The test puts its host on 127.0.0.1 for both
 * routers (the webapp's rule names the real host; TRAEFIK_WEBAPP_HOST must equal it).
 */
const TRIGGER_TRAEFIK = { host: "webapp.localhost", entrypoint: "web", tlsEntrypoint: "websecure" };
const TEST_HOST = "127.0.0.1";

/**
 * A self-signed certificate for 127.0.0.1 and localhost (openssl, EC P-256, 2 days) in `dir`:
 * {cert, key, pem} paths, `pem` being the certificate followed by its key (HAProxy's form).
 */
export function makeCert(dir) {
  const cert = path.join(dir, "cert.pem");
  const key = path.join(dir, "key.pem");
  const out = spawnSync(
    "openssl",
    ["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
      "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", key, "-out", cert],
    { encoding: "utf8" }
  );
  if (out.status !== 0) throw new Error(`openssl req failed: ${out.stderr}`);
  fs.mkdirSync(path.join(dir, "pem"));
  const pem = path.join(dir, "pem", "runfeed.pem");
  fs.writeFileSync(pem, fs.readFileSync(cert, "utf8") + fs.readFileSync(key, "utf8"));
  for (const f of [cert, key, pem]) fs.chmodSync(f, 0o644); // nginx workers read it as nobody
  return { cert, key, pem };
}

/** Compose's interpolation for the overlay's labels: ${VAR:-default}, $$. */
function composeInterpolate(text, vars) {
  return text.replace(/\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}/g, (m, name, dflt) =>
    m === "$$" ? "$" : vars[name] ?? dflt ?? ""
  );
}

/**
 * Traefik's file-provider configuration (JSON, which Traefik reads as YAML) made from the SHIPPED
 * overlay's Docker labels — the Docker provider reads the same keys from labels — plus the webapp's
 * router as trigger.dev ships it. Only the upstream addresses and the host are the test's.
 */
function renderTraefik({ runfeed, runfeedAdminPort, webapp, tls }) {
  const text = fs.readFileSync(path.join(ROOT, SHIPPED.traefik), "utf8");
  const vars = { TRAEFIK_WEBAPP_HOST: TEST_HOST, TRAEFIK_ENTRYPOINT: TRIGGER_TRAEFIK.entrypoint };
  const labels = [...text.matchAll(/^\s*-\s*"(traefik\.[^=]+)=(.*)"\s*$/gm)].map((m) => [m[1], composeInterpolate(m[2], vars)]);
  if (labels.length < 5) throw new Error(`${SHIPPED.traefik}: no Traefik labels found`);
  const dyn = {
    http: {
      routers: {
        webapp: { rule: `Host(\`${TEST_HOST}\`)`, entryPoints: [TRIGGER_TRAEFIK.entrypoint], service: "webapp" },
      },
      services: { webapp: { loadBalancer: { servers: [{ url: `http://${webapp}` }] } } },
    },
  };
  for (const [key, value] of labels) {
    let m;
    if ((m = /^traefik\.http\.routers\.([\w-]+)\.(rule|priority|entrypoints|service|tls)$/.exec(key))) {
      const r = (dyn.http.routers[m[1]] ??= {});
      if (m[2] === "rule") r.rule = value;
      else if (m[2] === "priority") r.priority = Number(value);
      else if (m[2] === "entrypoints") r.entryPoints = value.split(",");
      else if (m[2] === "tls") {
        if (value !== "true") throw new Error(`${SHIPPED.traefik}: ${key}=${value}, expected true`);
        r.tls = {};
      } else r.service = value;
    } else if ((m = /^traefik\.http\.services\.([\w-]+)\.loadbalancer\.(server\.port|healthcheck\.(path|port|interval))$/.exec(key))) {
      const lb = ((dyn.http.services[m[1]] ??= {}).loadBalancer ??= {});
      if (m[2] === "server.port") {
        if (value !== "3030") throw new Error(`${SHIPPED.traefik}: server port ${value}, expected runfeed's 3030`);
        lb.servers = [{ url: `http://${runfeed}` }];
      } else if (m[3] === "port") {
        if (value !== "9464") throw new Error(`${SHIPPED.traefik}: health check port ${value}, expected runfeed's admin 9464`);
        (lb.healthCheck ??= {}).port = runfeedAdminPort;
      } else (lb.healthCheck ??= {})[m[3]] = value;
    } else if (key !== "traefik.enable" && key !== "traefik.docker.network") {
      throw new Error(`${SHIPPED.traefik}: label ${key} is not translated by this test`);
    }
  }
  // The certificate: where the compose set-up has a certresolver, the test has its own file.
  const pair = { certFile: tls.cert, keyFile: tls.key };
  dyn.tls = { certificates: [pair], stores: { default: { defaultCertificate: pair } } };
  return JSON.stringify(dyn, null, 2);
}

/**
 * The shipped file of `kind` with only its listen addresses (plain `port`, TLS `tlsPort`), upstreams
 * and certificate paths (`tls` from makeCert) replaced.
 */
export function render(kind, { port, tlsPort, tls, runfeed, runfeedAdminPort, webapp }) {
  if (kind === "traefik") return renderTraefik({ runfeed, runfeedAdminPort, webapp, tls });
  let text = fs.readFileSync(path.join(ROOT, SHIPPED[kind]), "utf8");
  const subs = {
    nginx: [
      ["server 127.0.0.1:3030;", `server ${runfeed};`],
      ["server 127.0.0.1:8030;", `server ${webapp};`],
      ["listen 80;", `listen 127.0.0.1:${port};`],
      ["listen 443 ssl http2;", `listen 127.0.0.1:${tlsPort} ssl http2;`],
      ["ssl_certificate     /etc/ssl/runfeed/fullchain.pem;", `ssl_certificate     ${tls.cert};`],
      ["ssl_certificate_key /etc/ssl/runfeed/privkey.pem;", `ssl_certificate_key ${tls.key};`],
    ],
    caddy: [
      // The site on both listeners; Caddy's local CA issues the TLS one's certificate.
      ["trigger.example.com {", `http://127.0.0.1:${port}, https://127.0.0.1:${tlsPort} {`],
      ["reverse_proxy 127.0.0.1:3030 {", `reverse_proxy ${runfeed} {`],
      ["reverse_proxy 127.0.0.1:8030 {", `reverse_proxy ${webapp} {`],
    ],
    haproxy: [
      ["bind :80\n", `bind 127.0.0.1:${port}\n`],
      ["bind :443 ssl crt /etc/haproxy/certs/ alpn", `bind 127.0.0.1:${tlsPort} ssl crt ${path.dirname(tls.pem)}/ alpn`],
      // The health check goes to the serving port (the compose overlay publishes no other).
      ["server runfeed1 127.0.0.1:3030 check inter", `server runfeed1 ${runfeed} check inter`],
      ["server webapp 127.0.0.1:8030", `server webapp ${webapp}`],
    ],
  }[kind];
  if (kind === "haproxy" && /check[^\n]*\bport\b/.test(text.replace(/^\s*#.*$/gm, ""))) {
    throw new Error(`${SHIPPED.haproxy}: a health check on another port than the serving one (the compose overlay publishes only 3030)`);
  }
  for (const [from, to] of subs) {
    const n = text.split(from).length - 1;
    if (n !== 1) throw new Error(`${SHIPPED[kind]}: expected "${from}" exactly once, found ${n} (update tests/e2e/proxies/suite.mjs with the file)`);
    text = text.replace(from, to);
  }
  return text;
}

/**
 * Starts `kind` with `config` in a temp dir; resolves once its plain listener answers (the stub
 * webapp behind it, at /__proxy_ready). {base, tlsBase, logs(), stop()}.
 */
export async function startProxy(kind, config, { port, tlsPort }, label) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), `runfeed-${kind}-`));
  fs.chmodSync(dir, 0o777); // nginx workers run as nobody when the master is root
  let cmd;
  if (kind === "nginx") {
    fs.writeFileSync(path.join(dir, "runfeed.conf"), config);
    const temp = (n) => `${n} ${path.join(dir, n.replace(/_path$/, ""))};`;
    fs.writeFileSync(
      path.join(dir, "nginx.conf"),
      [
        "daemon off;",
        `pid ${path.join(dir, "nginx.pid")};`,
        "error_log stderr notice;",
        "worker_processes 1;",
        "events { worker_connections 1024; }",
        "http {",
        "  access_log off;",
        ...["client_body_temp_path", "proxy_temp_path", "fastcgi_temp_path", "uwsgi_temp_path", "scgi_temp_path"].map((n) => `  ${temp(n)}`),
        `  include ${path.join(dir, "runfeed.conf")};`,
        "}",
        "",
      ].join("\n")
    );
    cmd = ["/usr/sbin/nginx", "-c", path.join(dir, "nginx.conf"), "-p", dir, "-e", "stderr"];
  } else if (kind === "caddy") {
    // The test-only global options (the shipped file has none): no admin endpoint (three Caddys
    // at once would fight over :2019), certificates from Caddy's local CA instead of ACME (kept
    // in this temp dir, not installed in the system's trust store), no redirect listener on :80.
    fs.writeFileSync(
      path.join(dir, "Caddyfile"),
      `{\n\tadmin off\n\tlocal_certs\n\tskip_install_trust\n\tauto_https disable_redirects\n}\n\n${config}`
    );
    cmd = ["/usr/bin/caddy", "run", "--config", path.join(dir, "Caddyfile"), "--adapter", "caddyfile"];
  } else if (kind === "traefik") {
    // Static configuration: trigger.dev's entrypoint name on the test's port, the file provider
    // instead of Docker's (same dynamic configuration), nothing else.
    fs.writeFileSync(path.join(dir, "dynamic.yml"), config);
    cmd = [
      process.env.PROXY_TRAEFIK_BIN || "traefik",
      `--entryPoints.${TRIGGER_TRAEFIK.entrypoint}.address=127.0.0.1:${port}`,
      `--entryPoints.${TRIGGER_TRAEFIK.tlsEntrypoint}.address=127.0.0.1:${tlsPort}`,
      `--providers.file.filename=${path.join(dir, "dynamic.yml")}`,
      "--global.checkNewVersion=false",
      "--global.sendAnonymousUsage=false",
      "--log.level=INFO",
    ];
  } else {
    fs.writeFileSync(path.join(dir, "haproxy.cfg"), config);
    cmd = ["/usr/sbin/haproxy", "-db", "-f", path.join(dir, "haproxy.cfg")];
  }
  // `timeout` ends a proxy this process failed to stop (a crash, a killed test run).
  const child = spawn("timeout", ["--kill-after=5", "240", ...cmd], {
    env: { ...process.env, HOME: dir, XDG_DATA_HOME: dir, XDG_CONFIG_HOME: dir },
    stdio: ["ignore", "pipe", "pipe"],
  });
  const logs = [];
  const keep = (d) => {
    for (const line of String(d).split("\n")) if (line) logs.push(line);
    if (logs.length > 300) logs.splice(0, logs.length - 300);
    if (process.env.E2E_VERBOSE === "1") process.stderr.write(`[${label}] ${d}`);
  };
  child.stdout.on("data", keep);
  child.stderr.on("data", keep);
  let exited = null;
  const exit = new Promise((resolve) => child.on("exit", (code, signal) => resolve((exited = { code, signal }))));
  const base = `http://127.0.0.1:${port}`;
  const proxy = {
    kind,
    base,
    tlsBase: `https://127.0.0.1:${tlsPort}`,
    logs: () => logs.join("\n"),
    async stop() {
      if (!exited) {
        child.kill("SIGTERM");
        const t = setTimeout(() => child.kill("SIGKILL"), 5000);
        await exit;
        clearTimeout(t);
      }
      fs.rmSync(dir, { recursive: true, force: true });
    },
  };
  await waitFor(
    async () => {
      if (exited) throw new Error(`${label} exited ${JSON.stringify(exited)}:\n${proxy.logs()}`);
      const r = await request(`${base}/__proxy_ready`, { timeoutMs: 1000 });
      return r.status === 200 && r.headers["x-stub"] === "webapp";
    },
    { what: `${label} to answer`, timeoutMs: 15000, intervalMs: 50, diag: () => proxy.logs() }
  );
  return proxy;
}

// ---------------------------------------------------------------------------------------------
// plain HTTP with raw headers (duplicates visible), streaming and aborts

/**
 * One HTTP/1.1 request with node:http. Resolves {status, headers, rawHeaders, text, json, ms}.
 * `onChunk(text, res)` sees the body as it arrives; `signal` aborts.
 */
function request(url, { method = "GET", headers = {}, token, sdk = false, timeoutMs = 30000, signal, onChunk } = {}) {
  const h = { ...(sdk ? SDK_HEADERS : {}), ...headers };
  if (token) h.Authorization = `Bearer ${token}`;
  const t0 = Date.now();
  return new Promise((resolve, reject) => {
    const req = http.request(url, { method, headers: h, agent: false, signal, timeout: timeoutMs }, (res) => {
      let text = "";
      res.setEncoding("utf8");
      res.on("data", (d) => {
        text += d;
        onChunk?.(d, res);
      });
      res.on("end", () => {
        let json;
        try {
          json = text ? JSON.parse(text) : undefined;
        } catch {}
        resolve({ status: res.statusCode, headers: res.headers, rawHeaders: res.rawHeaders, text, json, ms: Date.now() - t0 });
      });
      res.on("error", reject);
    });
    req.on("timeout", () => req.destroy(new Error(`timed out after ${timeoutMs} ms: ${method} ${url}`)));
    req.on("error", reject);
    req.end();
  });
}

/**
 * An HTTP/2 session to `base` (https, the test's self-signed certificate accepted); resolves once
 * TLS and ALPN are done. `session.alpnProtocol` is what was negotiated.
 */
function h2connect(base) {
  return new Promise((resolve, reject) => {
    const session = http2.connect(base, { rejectUnauthorized: false });
    session.once("connect", () => resolve(session));
    session.once("error", reject);
  });
}

/** One GET on an HTTP/2 session. Resolves {status, headers, text, json}. */
function h2get(session, pathAndQuery, { token, timeoutMs = 30000 } = {}) {
  return new Promise((resolve, reject) => {
    const headers = { ":method": "GET", ":path": pathAndQuery, ...SDK_HEADERS };
    if (token) headers.authorization = `Bearer ${token}`;
    const req = session.request(headers);
    const timer = setTimeout(() => req.close(http2.constants.NGHTTP2_CANCEL), timeoutMs);
    let head;
    let text = "";
    req.setEncoding("utf8");
    req.on("response", (h) => (head = h));
    req.on("data", (d) => (text += d));
    req.on("end", () => {
      clearTimeout(timer);
      let json;
      try {
        json = text ? JSON.parse(text) : undefined;
      } catch {}
      if (!head) return reject(new Error(`no response to ${pathAndQuery} within ${timeoutMs} ms`));
      resolve({ status: head[":status"], headers: head, text, json });
    });
    req.on("error", (e) => {
      clearTimeout(timer);
      reject(e);
    });
    req.end();
  });
}

/** How many times `name` appears among the raw response headers. */
const headerCount = (res, name) => res.rawHeaders.filter((h, i) => i % 2 === 0 && h.toLowerCase() === name).length;

// ---------------------------------------------------------------------------------------------
// the stubs

function listen(server) {
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve(server)));
}

function echo(req) {
  return { method: req.method, url: req.url, httpVersion: req.httpVersion, headers: req.headers };
}

/** The stub webapp: every request → 200 JSON {via: "webapp", method, url, headers}. */
async function startWebappStub() {
  const server = await listen(
    http.createServer((req, res) => {
      req.resume();
      req.on("end", () => {
        res.writeHead(200, { "content-type": "application/json", "x-stub": "webapp" });
        res.end(req.method === "HEAD" ? undefined : JSON.stringify({ via: "webapp", ...echo(req) }));
      });
    })
  );
  return { server, addr: `127.0.0.1:${server.address().port}` };
}

/**
 * The stub feed upstream (in runfeed's place behind the second proxy instance):
 *   GET /healthz, GET /readyz         → 200 (HAProxy's and Traefik's health checks)
 *   GET /realtime/v1/runs/echo        → 200 JSON echo of the request
 *   GET /realtime/v1/runs/sse-<id>    → an SSE stream: event "one", then waits until the test
 *                                       reports that its client received "one" (or 5 s), then
 *                                       event "two" and the end.
 */
async function startFeedStub() {
  const streams = new Map(); // id → {clientSawOne: resolve fn, endedBeforeClientSawOne}
  const server = await listen(
    http.createServer(async (req, res) => {
      const url = new URL(req.url, "http://stub");
      if (url.pathname === "/readyz" || url.pathname === "/healthz") {
        res.writeHead(200, { "content-type": "application/json" });
        return res.end('{"status":"ready"}');
      }
      if (url.pathname === "/realtime/v1/runs/echo") {
        res.writeHead(200, { "content-type": "application/json", "x-stub": "feed" });
        return res.end(JSON.stringify({ via: "feed", ...echo(req) }));
      }
      const m = /^\/realtime\/v1\/runs\/sse-(\w+)$/.exec(url.pathname);
      if (m) {
        const s = streams.get(m[1]);
        res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-store", "x-stub": "feed" });
        res.write("event: message\ndata: one\n\n");
        const seen = await Promise.race([s.clientSawOne, new Promise((r) => setTimeout(() => r(false), 5000))]);
        s.result = seen ? "client saw the first event while the stream was open" : "the client saw nothing for 5 s";
        res.end("event: message\ndata: two\n\n");
        return;
      }
      res.writeHead(404, { "content-type": "application/json", "x-stub": "feed" });
      res.end('{"error":"Not found"}');
    })
  );
  return {
    server,
    addr: `127.0.0.1:${server.address().port}`,
    port: server.address().port,
    /** Registers stream `id`; returns {seen(): call when the client got "one", result()}. */
    stream(id) {
      let resolve;
      const s = { clientSawOne: new Promise((r) => (resolve = r)), result: null };
      streams.set(id, s);
      return { seen: () => resolve(true), result: () => s.result };
    },
  };
}

// ---------------------------------------------------------------------------------------------
// runfeed metrics and the limiter's Redis set

async function metricSum(adminBase, name, labelFilter) {
  const text = (await request(`${adminBase}/metrics`)).text;
  let sum = 0;
  for (const line of text.split("\n")) {
    if (!line.startsWith(`${name}{`)) continue;
    if (!labelFilter.every((l) => line.includes(l))) continue;
    sum += Number(line.slice(line.lastIndexOf(" ") + 1));
  }
  return sum;
}

function slotsInUse(envId) {
  const url = new URL(REDIS_URL);
  const out = spawnSync("redis-cli", ["-h", url.hostname, "-p", url.port || "6379", "ZCARD", `tr:realtime:native:concurrency:${envId}`], {
    encoding: "utf8",
  });
  if (out.status !== 0) throw new Error(`redis-cli: ${out.stderr}`);
  return Number(out.stdout.trim());
}

// ---------------------------------------------------------------------------------------------
// the suite

const runPath = (run, params = {}) => `/realtime/v1/runs/${run.friendlyId}${qs(params)}`;

/** Snapshot of a run feed: {handle, offset}. */
async function snapshot(base, run, token) {
  const snap = await raw(base, runPath(run, { offset: "-1" }), { token });
  assert.equal(snap.status, 200, snap.text);
  return { handle: snap.headers.get("electric-handle"), offset: snap.headers.get("electric-offset") };
}

export function proxySuite(kind) {
  let world, fx, rf, adminBase, webapp, feedStub, proxy, stubProxy, base;
  let sdkEnv, sdkToken, slotEnv, slotToken, holdEnv, holdToken;
  let hold; // {t0, promise}

  before(async () => {
    webapp = await startWebappStub();
    feedStub = await startFeedStub();
    world = await setupWorld({ servers: {} });
    fx = world.fixture;
    sdkEnv = await fx.createEnv();
    slotEnv = await fx.createEnv();
    holdEnv = await fx.createEnv();
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "runfeed-proxies-"));
    world.track(() => fs.rmSync(dir, { recursive: true, force: true }));
    const configFile = path.join(dir, "runfeed.toml");
    fs.writeFileSync(configFile, `[feeds.concurrency_limit_overrides]\n"${slotEnv.orgId}" = 2\n`);
    const adminPort = await freePort();
    adminBase = `http://127.0.0.1:${adminPort}`;
    rf = await startServer({
      databaseUrl: world.db.url,
      holdMs: HOLD_MS,
      label: `runfeed (${kind})`,
      args: ["--config", configFile],
      env: {
        RUNFEED_FEEDS__LIVE_POLL_JITTER_RATIO: "0", // exactly 20 s: the hold check's bounds are tight
        RUNFEED_TELEMETRY__ADMIN_LISTEN: `127.0.0.1:${adminPort}`, // Traefik's health check port
      },
    });
    world.servers.main = rf;
    const rfAddr = new URL(rf.baseUrl).host;
    const tls = makeCert(dir);
    const [port, tlsPort] = await freePorts(2);
    const ports = { port, tlsPort };
    proxy = await startProxy(kind, render(kind, { ...ports, tls, runfeed: rfAddr, runfeedAdminPort: adminPort, webapp: webapp.addr }), ports, kind);
    world.track(() => proxy.stop());
    const [stubPort, stubTlsPort] = await freePorts(2);
    const stubPorts = { port: stubPort, tlsPort: stubTlsPort };
    stubProxy = await startProxy(
      kind,
      render(kind, { ...stubPorts, tls, runfeed: feedStub.addr, runfeedAdminPort: feedStub.port, webapp: webapp.addr }),
      stubPorts,
      `${kind} (feed stub)`
    );
    world.track(() => stubProxy.stop());
    base = proxy.base;
    // runfeed behind the proxy (HAProxy's health check must pass first).
    await waitFor(async () => (await request(`${base}/realtime/v1/runs`)).headers["x-stub"] === undefined, {
      what: `${kind} to route a feed request to runfeed`,
      timeoutMs: 15000,
      intervalMs: 100,
      diag: () => proxy.logs(),
    });
    [sdkToken, slotToken, holdToken] = await Promise.all([
      world.token(sdkEnv.id, ["read:runs"]),
      world.token(slotEnv.id, ["read:runs"]),
      world.token(holdEnv.id, ["read:runs"]),
    ]);
    // The 20 s hold starts now and is checked last, so it overlaps the other checks.
    const holdRun = await fx.createRun(holdEnv, { status: "EXECUTING" });
    const { handle, offset } = await snapshot(base, holdRun, holdToken);
    const t0 = Date.now();
    hold = {
      t0,
      promise: raw(base, runPath(holdRun, { handle, offset, live: "true" }), { token: holdToken, timeoutMs: 60000 }).then(
        (r) => ({ ...r, elapsed: Date.now() - t0 }),
        (e) => ({ error: e, elapsed: Date.now() - t0 })
      ),
    };
  });

  after(async () => {
    await world?.teardown();
    webapp?.server.close();
    feedStub?.server.close();
  });

  test(`${kind}: the three feed routes reach runfeed; streams, sessions and everything else reach the webapp`, async () => {
    // [method, path, where it must land]
    const cases = [
      ["GET", "/realtime/v1/runs", "runfeed"],
      ["GET", "/realtime/v1/runs?tags=a,b&createdAt=1h", "runfeed"],
      ["GET", "/realtime/v1/runs/run_abc", "runfeed"],
      ["GET", "/realtime/v1/runs/run_abc?offset=-1", "runfeed"],
      ["HEAD", "/realtime/v1/runs/run_abc", "runfeed"],
      ["GET", "/realtime/v1/batches/batch_abc", "runfeed"],
      ["GET", "/realtime/v1/streams/run_abc/default", "webapp"],
      ["GET", "/realtime/v1/streams/run_abc/self/default", "webapp"],
      ["POST", "/realtime/v1/streams/run_abc/self/default/append", "webapp"],
      ["GET", "/realtime/v1/streams/run_abc/input/chat", "webapp"],
      ["GET", "/realtime/v1/sessions/session_abc/out", "webapp"],
      ["POST", "/realtime/v1/sessions/session_abc/in/append", "webapp"],
      ["POST", "/realtime/v1/runs/run_abc", "webapp"],
      ["DELETE", "/realtime/v1/runs", "webapp"],
      ["PUT", "/realtime/v1/batches/batch_abc", "webapp"],
      ["GET", "/realtime/v1/runs/run_abc/extra", "webapp"],
      ["GET", "/realtime/v1/runsx", "webapp"],
      ["GET", "/realtime/v1/batches", "webapp"],
      ["GET", "/realtime/v1/batches/", "webapp"],
      ["GET", "/api/v1/runs/run_abc", "webapp"],
      ["POST", "/api/v1/tasks/hello/trigger", "webapp"],
      ["GET", "/", "webapp"],
    ];
    const wrong = [];
    for (const [method, p, want] of cases) {
      const res = await request(`${base}${p}`, { method });
      const got =
        res.headers["x-stub"] === "webapp"
          ? "webapp"
          : res.headers["x-stub"] === undefined && res.status === 401 && (method === "HEAD" || res.json?.error)
            ? "runfeed"
            : `unknown (${res.status} ${res.text.slice(0, 80)})`;
      if (method !== "HEAD" && got === "webapp") {
        // The webapp got the request unchanged.
        assert.equal(res.json.method, method);
        assert.equal(res.json.url, p);
      }
      if (got !== want) wrong.push(`${method} ${p}: ${got}, expected ${want}`);
      assert.equal(FEED_ROUTE.test(p.split("?")[0]) && ["GET", "HEAD"].includes(method), want === "runfeed", `case table: ${method} ${p}`);
    }
    assert.deepEqual(wrong, [], wrong.join("\n"));
  });

  test(`${kind}: the SDK follows a run, a tag and a batch through the proxy`, async () => {
    // A run, to completion (subscribeToRun ends by itself).
    const run = await fx.createRun(sdkEnv, { status: "PENDING" });
    const s = await sdkSubscribe({ baseUrl: base, token: sdkToken, kind: "run", id: run.friendlyId });
    world.track(() => s.close());
    await s.waitFor(() => s.runs.length >= 1 && s.pendingLive(), { what: "SDK: the run + a live request" });
    await fx.updateAndPublish(run, { status: "EXECUTING", startedAt: Date.now() });
    await s.waitFor(() => s.latest.get(run.friendlyId)?.status === "EXECUTING", { what: "SDK: EXECUTING", timeoutMs: 5000 });
    await fx.updateAndPublish(run, { status: "COMPLETED_SUCCESSFULLY", completedAt: Date.now(), output: '{"done":true}' });
    await s.waitFor(() => s.state.ended, { what: "SDK: the run completes and the subscription ends", timeoutMs: 5000 });
    assert.deepEqual(s.runs.at(-1).output, { done: true });

    // A tag: the existing run, then a new one.
    const tag = `proxy-${kind}`;
    const tagged = await fx.createRun(sdkEnv, { tags: [tag] });
    const t = await sdkSubscribe({ baseUrl: base, token: sdkToken, kind: "tag", id: tag, createdAt: "1h" });
    world.track(() => t.close());
    await t.waitFor(() => t.latest.has(tagged.friendlyId) && t.pendingLive(), { what: "SDK: the tagged run + a live request" });
    const fresh = await fx.createAndPublish(sdkEnv, { tags: [tag] });
    await t.waitFor(() => t.latest.has(fresh.friendlyId), { what: "SDK: the new tagged run", timeoutMs: 5000 });
    t.close();

    // A batch: a run of it changes.
    const batch = await fx.createBatch(sdkEnv);
    const member = await fx.createRun(sdkEnv, { batchId: batch.id });
    const b = await sdkSubscribe({ baseUrl: base, token: sdkToken, kind: "batch", id: batch.friendlyId });
    world.track(() => b.close());
    await b.waitFor(() => b.latest.has(member.friendlyId) && b.pendingLive(), { what: "SDK: the batch's run + a live request" });
    await fx.updateAndPublish(member, { status: "EXECUTING" });
    await b.waitFor(() => b.latest.get(member.friendlyId)?.status === "EXECUTING", { what: "SDK: the batch run EXECUTING", timeoutMs: 5000 });
    b.close();
    for (const sub of [s, t, b]) assert.equal(sub.state.error, null, sub.describe());
    assert.ok(s.requests().every((r) => r.status === null || r.status < 400), s.describe());
  });

  // When an aborted poll's slot is free again: at once, or (HAProxy 2.6, which keeps a request
  // whose client left until the server answers) when runfeed answers it at the end of the hold.
  const releasedBy = kind === "haproxy" ? "by the end of the hold" : "at once";
  const releaseWithinMs = kind === "haproxy" ? HOLD_MS + 5000 : 2000;

  test(`${kind}: a client that aborts its live poll frees its concurrency slot ${releasedBy}`, async () => {
    // The slot environment's organization may hold 2 live polls (runfeed.toml above).
    const run = await fx.createRun(slotEnv, { status: "EXECUTING" });
    const { handle, offset } = await snapshot(base, run, slotToken);
    const livePath = runPath(run, { handle, offset, live: "true" });
    const held = [new AbortController(), new AbortController()];
    const polls = held.map((c) => request(`${base}${livePath}`, { token: slotToken, sdk: true, signal: c.signal }).catch((e) => e));
    await waitFor(() => slotsInUse(slotEnv.id) === 2, { what: "both polls admitted (2 slots in Redis)", timeoutMs: 5000 });
    const third = await request(`${base}${livePath}`, { token: slotToken, sdk: true });
    assert.equal(third.status, 429, `a third poll is over the limit: ${third.status} ${third.text}`);
    assert.deepEqual(third.json, { error: "Too many concurrent requests" });

    // HAProxy answers both held polls at the same moment (their holds end together), so there
    // both are aborted and both slots must come back; elsewhere the second stays held.
    const t0 = Date.now();
    held[0].abort();
    if (kind === "haproxy") held[1].abort();
    const left = kind === "haproxy" ? 0 : 1;
    await waitFor(() => slotsInUse(slotEnv.id) === left, {
      what: `the aborted poll's slot released (${releasedBy})`,
      timeoutMs: releaseWithinMs + 1000,
      intervalMs: 10,
    });
    const releasedMs = Date.now() - t0;
    // The next poll is admitted (held, not 429).
    const next = new AbortController();
    const nextPoll = request(`${base}${livePath}`, { token: slotToken, sdk: true, signal: next.signal }).catch((e) => e);
    await waitFor(() => slotsInUse(slotEnv.id) === left + 1, { what: "the next poll admitted", timeoutMs: 3000 });
    held[1].abort();
    next.abort();
    for (const p of [...polls, nextPoll]) {
      const r = await withTimeout(p, 5000, "an aborted poll to settle");
      assert.ok(r instanceof Error, `aborted polls end with an abort, got ${r.status}`);
    }
    if (kind !== "haproxy") {
      await waitFor(() => slotsInUse(slotEnv.id) === 0, { what: "every slot released", timeoutMs: 3000 });
    }
    assert.ok(releasedMs < releaseWithinMs, `slot released ${releasedMs} ms after the abort (${releasedBy})`);
  });

  test(`${kind}: a 409 must-refetch is passed through and never cached`, async () => {
    const run = await fx.createRun(sdkEnv, { status: "EXECUTING" });
    const { offset } = await snapshot(base, run, sdkToken);
    const p = runPath(run, { handle: "not-a-handle-of-this-feed", offset });
    const label = 'status="409"';
    const before = await metricSum(adminBase, "runfeed_http_requests_total", [label]);
    for (let i = 0; i < 2; i++) {
      const res = await request(`${base}${p}`, { token: sdkToken, sdk: true });
      assert.equal(res.status, 409, res.text);
      assert.deepEqual(res.json, [{ headers: { control: "must-refetch" } }]);
      assert.equal(res.headers["cache-control"], "no-store");
      assert.equal(res.headers.age, undefined, "no cache answered");
    }
    // Both requests reached runfeed: nothing in between answered the second from a cache.
    const after = await metricSum(adminBase, "runfeed_http_requests_total", [label]);
    assert.equal(after - before, 2, `runfeed answered ${after - before} of the 2 requests`);
  });

  test(`${kind}: CORS comes from runfeed, once, on feeds and their preflights`, async () => {
    const origin = "https://app.example.com";
    const pre = await request(`${base}/realtime/v1/runs/run_abc`, {
      method: "OPTIONS",
      headers: { origin, "access-control-request-method": "GET", "access-control-request-headers": "authorization,x-trigger-electric-version" },
    });
    assert.equal(pre.headers["x-stub"], undefined, "the preflight reached runfeed");
    assert.ok(pre.status >= 200 && pre.status < 300, `preflight ${pre.status}`);
    assert.equal(headerCount(pre, "access-control-allow-origin"), 1, JSON.stringify(pre.rawHeaders));
    assert.equal(pre.headers["access-control-allow-origin"], "*");
    assert.match(pre.headers["access-control-allow-headers"], /authorization/i);
    assert.match(pre.headers["access-control-allow-headers"], /x-trigger-electric-version/i);
    const run = await fx.createRun(sdkEnv);
    const get = await request(`${base}${runPath(run, { offset: "-1" })}`, { token: sdkToken, sdk: true, headers: { origin } });
    assert.equal(get.status, 200);
    assert.equal(headerCount(get, "access-control-allow-origin"), 1, JSON.stringify(get.rawHeaders));
    assert.equal(get.headers["access-control-allow-origin"], "*");
    assert.match(get.headers["access-control-expose-headers"] ?? "", /\*|electric-handle/i);
  });

  test(`${kind}: the client's address reaches both upstreams`, async () => {
    const check = (res, via) => {
      assert.equal(res.status, 200, res.text);
      assert.equal(res.json.via, via);
      const h = res.json.headers;
      assert.match(h["x-forwarded-for"] ?? "", /(^|,\s*)127\.0\.0\.1$/, JSON.stringify(h));
      assert.equal(h["x-real-ip"], "127.0.0.1", JSON.stringify(h));
      assert.equal(h["x-forwarded-proto"], "http", JSON.stringify(h));
      assert.equal(h.authorization, "Bearer tok", "Authorization passes");
    };
    check(await request(`${base}/api/v1/runs/run_abc`, { token: "tok" }), "webapp");
    const viaFeed = await request(`${stubProxy.base}/realtime/v1/runs/echo`, { token: "tok" });
    check(viaFeed, "feed");
    assert.equal(viaFeed.json.headers.host, new URL(stubProxy.base).host, "Host is the public one");
  });

  test(`${kind}: an SSE stream on a feed route is passed on unbuffered`, async () => {
    const id = `s${Date.now()}`;
    const stream = feedStub.stream(id);
    let text = "";
    const res = await request(`${stubProxy.base}/realtime/v1/runs/sse-${id}?live=true&live_sse=true`, {
      timeoutMs: 15000,
      // What browsers send (EventSource, fetch): a proxy that compresses the stream buffers it.
      headers: { accept: "text/event-stream", "accept-encoding": "gzip, deflate, br" },
      onChunk: (d) => {
        text += d;
        if (text.includes("data: one")) stream.seen();
      },
    });
    assert.equal(res.status, 200);
    assert.match(res.headers["content-type"], /^text\/event-stream/);
    assert.equal(
      stream.result(),
      "client saw the first event while the stream was open",
      `${kind} held the first event back until the stream ended (buffered)`
    );
    assert.match(res.text, /data: one[\s\S]*data: two/);
  });

  test(`${kind}: runfeed's own SSE feed (live_sse=true) flows unbuffered`, async (t) => {
    await runfeedSseFlowsUnbuffered(t, { base, fx, env: sdkEnv, token: sdkToken });
  });

  test(`${kind}: HTTP/2 over TLS (ALPN h2) to the client; a feed's snapshot and live poll over it`, async () => {
    const session = await h2connect(proxy.tlsBase);
    world.track(() => session.destroy());
    assert.equal(session.alpnProtocol, "h2", `${kind} negotiated ${session.alpnProtocol} on its TLS listener`);
    const run = await fx.createRun(sdkEnv, { status: "EXECUTING" });
    const snap = await h2get(session, runPath(run, { offset: "-1" }), { token: sdkToken });
    assert.equal(snap.status, 200, snap.text);
    const handle = snap.headers["electric-handle"];
    const offset = snap.headers["electric-offset"];
    assert.ok(handle && offset, `snapshot headers: ${JSON.stringify(snap.headers)}`);
    assert.ok(snap.json.some((m) => "key" in m), `the run's row in the snapshot: ${snap.text}`);
    // Two live polls on the one connection at once: the run's and an untouched run's.
    const heldBefore = await metricSum(adminBase, "runfeed_router_held_feeds", ['kind="run"']);
    const other = await fx.createRun(sdkEnv, { status: "EXECUTING" });
    const otherSnap = await h2get(session, runPath(other, { offset: "-1" }), { token: sdkToken });
    const held = h2get(
      session,
      runPath(other, { handle: otherSnap.headers["electric-handle"], offset: otherSnap.headers["electric-offset"], live: "true" }),
      { token: sdkToken, timeoutMs: 60000 }
    );
    const live = h2get(session, runPath(run, { handle, offset, live: "true" }), { token: sdkToken });
    await waitFor(() => metricSum(adminBase, "runfeed_router_held_feeds", ['kind="run"']).then((n) => n >= heldBefore + 2), {
      what: "both live polls held by runfeed",
      timeoutMs: 5000,
    });
    const t0 = Date.now();
    await fx.updateAndPublish(run, { status: "WAITING_TO_RESUME" });
    const res = await live;
    assert.equal(res.status, 200, res.text);
    assert.match(res.text, /WAITING_TO_RESUME/);
    assert.ok(Date.now() - t0 < 5000, `the change arrived after ${Date.now() - t0} ms`);
    session.destroy(); // ends the other poll at once (close() would wait for its hold)
    await held.catch(() => {});
  });

  test(`${kind}: over TLS the upstream request is HTTP/1.1 with X-Forwarded-Proto https`, async () => {
    const session = await h2connect(stubProxy.tlsBase);
    world.track(() => session.destroy());
    try {
      const res = await h2get(session, "/realtime/v1/runs/echo", { token: "tok" });
      assert.equal(res.status, 200, res.text);
      assert.equal(res.json.via, "feed");
      assert.equal(res.json.httpVersion, "1.1", "runfeed is reached over HTTP/1.1");
      assert.equal(res.json.headers["x-forwarded-proto"], "https", JSON.stringify(res.json.headers));
      assert.equal(res.json.headers.authorization, "Bearer tok");
    } finally {
      session.close();
    }
  });

  test(`${kind}: a live poll held the full 20 s is not cut`, async () => {
    const res = await hold.promise;
    assert.equal(res.error, undefined, `the held poll failed after ${res.elapsed} ms: ${res.error}\n${proxy.logs()}`);
    assert.equal(res.status, 200, `${res.status} after ${res.elapsed} ms: ${res.text}`);
    assert.ok(isUpToDate(res.json.at(-1)), res.text);
    assert.notEqual(res.headers.get("electric-up-to-date"), null, "electric-up-to-date header");
    assert.ok(res.elapsed >= HOLD_MS - 500, `answered after ${res.elapsed} ms, before runfeed's ${HOLD_MS} ms hold ended`);
    assert.ok(res.elapsed < HOLD_MS + 5000, `answered after ${res.elapsed} ms`);
  });
}

/**
 * Runfeed's SSE mode (`live=true&live_sse=true` → `text/event-stream`) through the proxy: the
 * first events arrive while the stream stays open, and a change published meanwhile arrives on
 * it. Skipped while runfeed answers such a request with a JSON long-poll (no SSE yet): the
 * request is answered by the change published right after it, so the skip costs no hold.
 */
async function runfeedSseFlowsUnbuffered(t, { base, fx, env, token }) {
  const run = await fx.createRun(env, { status: "EXECUTING" });
  const { handle, offset } = await snapshot(base, run, token);
  const controller = new AbortController();
  let text = "";
  let ended = false;
  let resolveHeaders;
  const headers = new Promise((r) => (resolveHeaders = r));
  const done = new Promise((resolve) => {
    const req = http.request(
      `${base}${runPath(run, { handle, offset, live: "true", live_sse: "true" })}`,
      {
        headers: { ...SDK_HEADERS, authorization: `Bearer ${token}`, accept: "text/event-stream", "accept-encoding": "gzip, deflate, br" },
        agent: false,
        signal: controller.signal,
      },
      (res) => {
        resolveHeaders(res);
        res.setEncoding("utf8");
        res.on("data", (d) => (text += d));
        res.on("end", () => {
          ended = true;
          resolve();
        });
        res.on("error", () => resolve());
      }
    );
    req.on("error", () => resolve());
    req.end();
  });
  try {
    await fx.updateAndPublish(run, { status: "WAITING_TO_RESUME" });
    const res = await withTimeout(headers, 10000, "the live_sse=true response headers");
    if (!/^text\/event-stream/.test(res.headers["content-type"] ?? "")) {
      t.skip(`runfeed answered live_sse=true with ${res.statusCode} ${res.headers["content-type"]}: no SSE mode yet`);
      return;
    }
    assert.equal(res.statusCode, 200);
    await waitFor(() => text.includes("WAITING_TO_RESUME"), { what: "the first change as an SSE event", timeoutMs: 5000, diag: () => text });
    assert.equal(ended, false, "the stream stays open after its first events");
    const seen = text.length;
    await fx.updateAndPublish(run, { status: "EXECUTING" });
    await waitFor(() => text.slice(seen).includes("EXECUTING"), { what: "a later change on the open stream", timeoutMs: 5000, diag: () => text });
    assert.equal(ended, false, "still open");
  } finally {
    controller.abort();
    await withTimeout(done, 5000, "the SSE request to close").catch(() => {});
  }
}
