// The test harness's own port helper: ports asked for together are distinct and free, so a proxy's
// plain and TLS listeners never get the same one (nginx refuses "a duplicate listen").
import { test } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import { freePorts } from "./lib.mjs";

test("ports asked for together are distinct and each can be listened on", async () => {
  const ports = await freePorts(32);
  assert.equal(new Set(ports).size, ports.length, `duplicates in ${ports}`);
  const servers = [];
  try {
    for (const port of ports) {
      const srv = net.createServer();
      servers.push(srv);
      await new Promise((resolve, reject) => {
        srv.once("error", reject);
        srv.listen(port, "127.0.0.1", resolve);
      });
    }
  } finally {
    await Promise.all(servers.map((srv) => new Promise((resolve) => srv.close(() => resolve()))));
  }
});
