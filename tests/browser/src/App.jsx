// The live-runs page: the real @trigger.dev/react-hooks against a runfeed server.
// Everything comes from the query string:
//   ?baseURL=http://127.0.0.1:3030&token=<public access token>&run=run_…&tag=…&batch=batch_…
// With &sse=1 the run card follows the run with the current Electric client instead
// (@electric-sql/client 1.5, `liveSse: true`: live updates over one text/event-stream).
import React, { useEffect, useState } from "react";
import { useRealtimeRun, useRealtimeRunsWithTag, useRealtimeBatch } from "@trigger.dev/react-hooks";
import { ShapeStream, Shape } from "electric-1-5";

const params = new URLSearchParams(window.location.search);
const CONFIG = {
  baseURL: (params.get("baseURL") ?? params.get("base") ?? "").replace(/\/+$/, ""),
  token: params.get("token") ?? "",
  run: params.get("run") ?? "",
  tag: params.get("tag") ?? "",
  batch: params.get("batch") ?? "",
  sse: params.get("sse") === "1",
};

const FINAL = new Set(["COMPLETED", "CANCELED", "FAILED", "CRASHED", "SYSTEM_FAILURE", "EXPIRED", "TIMED_OUT"]);

function fmtTime(d) {
  if (!d) return "–";
  const date = d instanceof Date ? d : new Date(d);
  return Number.isNaN(date.getTime()) ? String(d) : date.toISOString().replace("T", " ").replace("Z", "");
}

function ErrorBox({ error, what }) {
  if (!error) return null;
  const status = error.status ?? error.statusCode ?? "";
  return (
    <div className="error" data-testid={`${what}-error`} role="alert">
      {what} feed error{status ? ` (${status})` : ""}: {error.message || String(error)}
    </div>
  );
}

function Status({ status }) {
  return <span className={`status status-${String(status ?? "").toLowerCase()}`}>{status ?? "–"}</span>;
}

function RunCard() {
  const { run, error } = useRealtimeRun(CONFIG.run, {
    accessToken: CONFIG.token,
    baseURL: CONFIG.baseURL,
    stopOnCompletion: false,
    enabled: Boolean(CONFIG.run),
  });
  return (
    <section data-testid="run-section">
      <h2>Run {CONFIG.run}</h2>
      <ErrorBox error={error} what="run" />
      {run ? (
        <dl className="run" data-testid="run" data-status={run.status} data-updated-at={fmtTime(run.updatedAt)}>
          <dt>task</dt>
          <dd>{run.taskIdentifier}</dd>
          <dt>status</dt>
          <dd data-testid="run-status">
            <Status status={run.status} />
          </dd>
          <dt>updated</dt>
          <dd>{fmtTime(run.updatedAt)}</dd>
          <dt>metadata</dt>
          <dd>
            <pre data-testid="run-metadata">{JSON.stringify(run.metadata ?? null)}</pre>
          </dd>
        </dl>
      ) : error ? null : (
        <p className="loading" data-testid="run-loading">connecting…</p>
      )}
    </section>
  );
}

/** The run card over SSE: a 1.5 ShapeStream with `liveSse: true` on the run feed. */
function SseRunCard() {
  const [run, setRun] = useState(null);
  const [error, setError] = useState(null);
  useEffect(() => {
    const controller = new AbortController();
    const stream = new ShapeStream({
      url: `${CONFIG.baseURL}/realtime/v1/runs/${CONFIG.run}`,
      headers: { Authorization: `Bearer ${CONFIG.token}`, "x-trigger-electric-version": "1.5.28" },
      liveSse: true,
      signal: controller.signal,
      onError: (e) => {
        setError(e);
      },
    });
    const shape = new Shape(stream);
    const unsubscribe = shape.subscribe(({ rows }) => setRun(rows[0] ?? null));
    return () => {
      unsubscribe();
      controller.abort();
    };
  }, []);
  return (
    <section data-testid="sse-section">
      <h2>Run {CONFIG.run} (SSE, @electric-sql/client 1.5)</h2>
      <ErrorBox error={error} what="sse" />
      {run ? (
        <dl className="run" data-testid="sse-run" data-status={run.status}>
          <dt>task</dt>
          <dd>{run.taskIdentifier}</dd>
          <dt>status</dt>
          <dd>
            <Status status={run.status} />
          </dd>
        </dl>
      ) : error ? null : (
        <p className="loading">connecting…</p>
      )}
    </section>
  );
}

function RunsTable({ runs, testid }) {
  return (
    <table data-testid={testid}>
      <thead>
        <tr>
          <th>run</th>
          <th>task</th>
          <th>status</th>
          <th>tags</th>
          <th>metadata</th>
          <th>updated</th>
        </tr>
      </thead>
      <tbody>
        {runs.map((r) => (
          <tr key={r.id} data-run-id={r.id} data-status={r.status}>
            <td className="mono">{r.id}</td>
            <td>{r.taskIdentifier}</td>
            <td>
              <Status status={r.status} />
            </td>
            <td>{(r.tags ?? []).join(", ")}</td>
            <td className="mono">{JSON.stringify(r.metadata ?? null)}</td>
            <td className="mono">{fmtTime(r.updatedAt)}</td>
          </tr>
        ))}
      </tbody>
    </table>
  );
}

function TagTable() {
  const { runs, error } = useRealtimeRunsWithTag(CONFIG.tag, {
    accessToken: CONFIG.token,
    baseURL: CONFIG.baseURL,
    enabled: Boolean(CONFIG.tag),
  });
  return (
    <section data-testid="tag-section">
      <h2>
        Runs tagged <code>{CONFIG.tag}</code> <span className="count" data-testid="tag-count">{runs.length}</span>
      </h2>
      <ErrorBox error={error} what="tag" />
      <RunsTable runs={runs} testid="tag-table" />
    </section>
  );
}

function BatchProgress() {
  const { runs, error } = useRealtimeBatch(CONFIG.batch, {
    accessToken: CONFIG.token,
    baseURL: CONFIG.baseURL,
    enabled: Boolean(CONFIG.batch),
  });
  const done = runs.filter((r) => FINAL.has(r.status)).length;
  const pct = runs.length ? Math.round((100 * done) / runs.length) : 0;
  return (
    <section data-testid="batch-section">
      <h2>Batch {CONFIG.batch}</h2>
      <ErrorBox error={error} what="batch" />
      <div className="progress" data-testid="batch-progress" data-done={done} data-total={runs.length}>
        <div className="bar" style={{ width: `${pct}%` }} />
        <span>
          {done} / {runs.length} finished ({pct}%)
        </span>
      </div>
      <RunsTable runs={runs} testid="batch-table" />
    </section>
  );
}

export function App() {
  const missing = ["baseURL", "token"].filter((k) => !CONFIG[k]);
  return (
    <main>
      <h1>runfeed · live runs</h1>
      <p className="sub">
        {CONFIG.baseURL || "(no baseURL)"} · {CONFIG.sse ? "@electric-sql/client 1.5 (SSE)" : "@trigger.dev/react-hooks"}
      </p>
      {missing.length ? (
        <div className="error" data-testid="config-error" role="alert">
          Missing query parameters: {missing.join(", ")} (expected ?baseURL=…&amp;token=…&amp;run=…&amp;tag=…&amp;batch=…)
        </div>
      ) : (
        <>
          {CONFIG.run && (CONFIG.sse ? <SseRunCard /> : <RunCard />)}
          {CONFIG.tag && <TagTable />}
          {CONFIG.batch && <BatchProgress />}
        </>
      )}
    </main>
  );
}
