// A tiny static server for the built page (tests/browser/dist) on its own loopback origin.
// Used by browser.test.mjs, and by hand next to `bash scripts/dev.sh`:
//   (cd tests/browser && npm ci && npx vite build)
//   node tests/browser/serve.mjs --base-url http://127.0.0.1:3030 --token PUBLIC_TOKEN \
//     --run RUN_ID --tag TAG --batch BATCH_ID [--port 5173]
// prints the page's URL (with its query string) and serves until Ctrl-C.
import http from "node:http";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const HERE = path.dirname(fileURLToPath(import.meta.url));
export const DIST = path.join(HERE, "dist");
const TYPES = { ".html": "text/html; charset=utf-8", ".js": "text/javascript", ".css": "text/css", ".png": "image/png", ".svg": "image/svg+xml" };

/** Serves `dir` on 127.0.0.1:`port` (0 = any); resolves with {server, origin}. */
export function startStatic(dir = DIST, port = 0) {
  const root = path.resolve(dir);
  const server = http.createServer((req, res) => {
    const url = new URL(req.url, "http://x");
    let file = path.normalize(path.join(root, decodeURIComponent(url.pathname)));
    if (file !== root && !file.startsWith(root + path.sep)) {
      res.writeHead(403).end();
      return;
    }
    if (url.pathname.endsWith("/")) file = path.join(file, "index.html");
    fs.readFile(file, (err, body) => {
      if (err) {
        res.writeHead(404, { "content-type": "text/plain" }).end("not found");
        return;
      }
      res.writeHead(200, { "content-type": TYPES[path.extname(file)] ?? "application/octet-stream", "cache-control": "no-store" });
      res.end(body);
    });
  });
  return new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, "127.0.0.1", () => resolve({ server, origin: `http://127.0.0.1:${server.address().port}` }));
  });
}

/** The page's URL for a runfeed base URL, token, run id, tag and batch id. */
export function pageUrl(origin, { baseURL, token, run, tag, batch, sse }) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries({ baseURL, token, run, tag, batch, sse })) if (v) q.set(k, v);
  return `${origin}/index.html?${q}`;
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const args = {};
  const argv = process.argv.slice(2);
  for (let i = 0; i < argv.length; i++) {
    const m = /^--([\w-]+)$/.exec(argv[i]);
    if (!m || argv[i + 1] === undefined) {
      console.error(`usage: node serve.mjs --base-url URL --token T [--run ID] [--tag T] [--batch ID] [--sse 1] [--port N]`);
      process.exit(2);
    }
    args[m[1]] = argv[++i];
  }
  if (!fs.existsSync(path.join(DIST, "index.html"))) {
    console.error(`no ${DIST}/index.html: run \`npm ci && npx vite build\` in ${HERE} first`);
    process.exit(1);
  }
  const { origin } = await startStatic(DIST, Number(args.port ?? 5173));
  console.log(`live runs page: ${pageUrl(origin, { baseURL: args["base-url"], token: args.token, run: args.run, tag: args.tag, batch: args.batch, sse: args.sse })}`);
}
