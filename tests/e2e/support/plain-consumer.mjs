// Scenario 29's consumer: a plain @electric-sql/client 1.0.14 ShapeStream + Shape in a Node
// process with NO onError. Any fatal client error (MissingHeadersError, a parse error, a 4xx)
// becomes an unhandled rejection and kills the process with a non-zero exit code; surviving
// until the deadline exits 0. Prints one JSON line per batch / Shape notification.
//   node plain-consumer.mjs URL TOKEN SECONDS
import { ShapeStream, Shape } from "@electric-sql/client";

const [url, token, seconds] = process.argv.slice(2);
const headers = { ...JSON.parse(process.env.SDK_HEADERS ?? "{}"), Authorization: `Bearer ${token}` };
const out = (o) => process.stdout.write(JSON.stringify(o) + "\n");

const stream = new ShapeStream({ url, headers });
stream.subscribe((messages) =>
  out({
    kind: "batch",
    count: messages.length,
    upToDate: messages.some((m) => m?.headers?.control === "up-to-date"),
    statuses: messages.filter((m) => m && "key" in m).map((m) => m.value?.status),
  })
);
new Shape(stream).subscribe(({ rows }) => out({ kind: "rows", statuses: rows.map((r) => r.status) }));
setTimeout(() => process.exit(0), Number(seconds) * 1000);
