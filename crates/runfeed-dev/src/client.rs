//! A reusable Electric shape-protocol follower, written from the client's side of
//! `docs/protocol.md`: it requests like `@electric-sql/client` 1.0.14 as the trigger.dev SDK
//! drives it, and keeps the same materialized view the client's `Shape` keeps.
//!
//! - First request `log=full&offset=-1` (§2.2); then, once a body ended in `up-to-date`
//!   (§3.5), live requests `cursor=…&handle=…&live=true&log=full&offset=…` echoing the last
//!   `electric-handle`, `electric-offset` and `electric-cursor` verbatim (§4.1–4.3).
//! - Non-live requests with a handle (catch-up / resume after a pause, §4.6) on demand.
//! - A 409 is must-refetch (§5.2): the handle current at the time becomes `expired_handle`, the
//!   409's `electric-handle` (or `<old>-next`) the new handle, the view is dropped and the next
//!   request is a snapshot again.
//! - The view: insert = set, update = shallow merge onto the previous row (or the whole value
//!   when the key is new), delete = remove (§3.4), keyed by the message `key`.
//! - Modern header names only (`x-trigger-electric-version` is always sent, §1).
//!
//! Sending and applying are separate ([`Follower::send`], [`Follower::apply`]), so a caller
//! can drop a response the server already sent (a lost response) and poll again with the old
//! offset, exactly as a client whose connection died after the answer would.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

/// The `x-trigger-electric-version` the current SDK sends (`docs/protocol.md` §1).
pub const ELECTRIC_VERSION: &str = "1.0.0-beta.1";
/// The current `x-trigger-api-version` (`docs/protocol.md` §2.3).
pub const API_VERSION: &str = "2025-07-16";

/// The feed a follower follows: a path and the SDK's own (fixed) query parameters
/// (`docs/protocol.md` §2.1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedUrl {
    /// `/realtime/v1/runs/<runId>`, `/realtime/v1/runs` or `/realtime/v1/batches/<batchId>`.
    pub path: String,
    /// `tags`, `createdAt`, `skipColumns` as the SDK sets them.
    pub params: Vec<(String, String)>,
}

impl FeedUrl {
    /// One run's feed (friendly id `run_…`).
    pub fn run(friendly_id: &str) -> FeedUrl {
        FeedUrl {
            path: format!("/realtime/v1/runs/{friendly_id}"),
            params: Vec::new(),
        }
    }

    /// The runs carrying all of `tags` (comma-joined), created inside `created_at` (e.g. `1h`).
    pub fn tags(tags: &[String], created_at: Option<&str>) -> FeedUrl {
        let mut params = vec![("tags".to_string(), tags.join(","))];
        if let Some(window) = created_at {
            params.push(("createdAt".to_string(), window.to_string()));
        }
        FeedUrl {
            path: "/realtime/v1/runs".to_string(),
            params,
        }
    }

    /// One batch's runs (friendly id `batch_…`).
    pub fn batch(friendly_id: &str) -> FeedUrl {
        FeedUrl {
            path: format!("/realtime/v1/batches/{friendly_id}"),
            params: Vec::new(),
        }
    }

    /// Adds `skipColumns=a,b`.
    pub fn skip_columns(mut self, columns: &[&str]) -> FeedUrl {
        if !columns.is_empty() {
            self.params
                .push(("skipColumns".to_string(), columns.join(",")));
        }
        self
    }

    /// The path and query for the given protocol parameters; every parameter sorted by name,
    /// as 1.0.14 sorts them (`docs/protocol.md` §2).
    pub fn render(&self, protocol: &[(&str, String)]) -> String {
        let mut all: Vec<(String, String)> = self.params.clone();
        all.extend(protocol.iter().map(|(k, v)| (k.to_string(), v.clone())));
        all.sort_by(|a, b| a.0.cmp(&b.0));
        let query = all
            .iter()
            .map(|(k, v)| format!("{}={}", encode_component(k), encode_component(v)))
            .collect::<Vec<_>>()
            .join("&");
        format!("{}?{query}", self.path)
    }
}

/// Percent-encodes a query component (RFC 3986 unreserved characters pass).
fn encode_component(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// What kind of request a follower sends next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RequestKind {
    /// `offset=-1` (initial, or after a 409).
    Snapshot,
    /// `live=true` at the last offset (held by the server until something changes).
    Live,
    /// Non-live with handle, offset and cursor (resume after a pause, `docs/protocol.md` §4.6).
    CatchUp,
    /// `live=true&live_sse=true` at the last offset: an SSE stream of live batches, each change
    /// messages then an `up-to-date` (`docs/protocol.md` §13.4, `@electric-sql/client` 1.5).
    Sse,
}

/// One request as built by [`Follower::request`].
#[derive(Clone, Debug)]
pub struct Request {
    pub kind: RequestKind,
    /// Path and query.
    pub path_and_query: String,
    /// The offset sent (`-1` for a snapshot).
    pub offset: String,
    /// The handle sent, if any.
    pub handle: Option<String>,
}

/// One change message (`docs/protocol.md` §3.4).
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    /// `insert`, `update` or `delete`.
    pub operation: String,
    /// The message key (`"public"."TaskRun"/"<id>"`).
    pub key: String,
    /// The row value as sent (columns → wire strings / null).
    pub value: Map<String, Value>,
}

/// A response as received (status, the protocol headers, the parsed body).
#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    pub handle: Option<String>,
    pub offset: Option<String>,
    pub cursor: Option<String>,
    /// `electric-schema` was present.
    pub has_schema: bool,
    /// `electric-up-to-date` was present.
    pub up_to_date_header: bool,
    /// The body's JSON messages (empty when the body is not a JSON array).
    pub messages: Vec<Value>,
    /// The raw body (for error reports).
    pub text: String,
    /// From sending the request to the end of the body.
    pub elapsed: Duration,
}

impl Response {
    /// The change messages (those with a `key`, `docs/protocol.md` §3.4), in body order.
    pub fn changes(&self) -> Vec<Change> {
        self.messages
            .iter()
            .filter_map(|m| {
                let key = m.get("key")?.as_str()?.to_string();
                let value = m.get("value")?.as_object()?.clone();
                let operation = m
                    .get("headers")
                    .and_then(|h| h.get("operation"))
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                Some(Change {
                    operation,
                    key,
                    value,
                })
            })
            .collect()
    }

    /// The last message is the `up-to-date` control message (`docs/protocol.md` §3.5).
    pub fn ends_up_to_date(&self) -> bool {
        self.messages
            .last()
            .and_then(|m| m.get("headers"))
            .and_then(|h| h.get("control"))
            .and_then(Value::as_str)
            == Some("up-to-date")
    }
}

/// Why a request produced no response.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connection refused or reset, or the body could not be read.
    #[error("transport: {0}")]
    Transport(String),
    /// No complete response within the caller's bound.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
}

/// What applying a response did to the follower.
#[derive(Clone, Debug, PartialEq)]
pub enum Applied {
    /// A 2xx: headers adopted, these changes applied to the view (in body order).
    Changes(Vec<Change>),
    /// A 409: the view was dropped; the next request is a snapshot under `new_handle`.
    MustRefetch { new_handle: String },
    /// Another status: nothing changed (a 5xx or 429 is retried by the caller with backoff;
    /// other 4xx are fatal for the real client, `docs/protocol.md` §5.1).
    Status(u16),
}

/// A follower of one feed: protocol state and the materialized view.
#[derive(Clone, Debug)]
pub struct Follower {
    pub url: FeedUrl,
    /// Request headers (`authorization`, `x-trigger-electric-version`, …).
    pub headers: Vec<(String, String)>,
    pub handle: Option<String>,
    pub offset: String,
    pub cursor: Option<String>,
    /// A body ended in `up-to-date` since the last reset (next request is live).
    pub up_to_date: bool,
    /// The handle a 409 expired (sent as `expired_handle` on the refetch).
    pub expired_handle: Option<String>,
    /// Rows by message key.
    pub view: HashMap<String, Map<String, Value>>,
    /// 409 resets so far.
    pub resets: usize,
    /// 2xx responses applied so far.
    pub responses: usize,
}

impl Follower {
    /// A follower of `url` authorized by `token` (secret key or public access token).
    pub fn new(url: FeedUrl, token: &str) -> Follower {
        Follower {
            url,
            headers: vec![
                ("authorization".to_string(), format!("Bearer {token}")),
                (
                    "x-trigger-electric-version".to_string(),
                    ELECTRIC_VERSION.to_string(),
                ),
                ("x-trigger-api-version".to_string(), API_VERSION.to_string()),
            ],
            handle: None,
            offset: "-1".to_string(),
            cursor: None,
            up_to_date: false,
            expired_handle: None,
            view: HashMap::new(),
            resets: 0,
            responses: 0,
        }
    }

    /// The next request as the 1.0.14 client would send it: a snapshot at offset -1, a live
    /// poll once up-to-date, otherwise a non-live request at the offset. `catch_up` forces the
    /// non-live resume form (cursor, handle, offset, no `live`) when a handle is known.
    pub fn request(&self, catch_up: bool) -> Request {
        let mut p: Vec<(&str, String)> = vec![("log", "full".to_string())];
        let kind = if self.offset == "-1" {
            if let Some(h) = &self.handle {
                p.push(("handle", h.clone()));
            }
            if let Some(e) = &self.expired_handle {
                p.push(("expired_handle", e.clone()));
            }
            p.push(("offset", "-1".to_string()));
            RequestKind::Snapshot
        } else {
            let handle = self.handle.clone().unwrap_or_default();
            p.push(("handle", handle));
            p.push(("offset", self.offset.clone()));
            if self.up_to_date {
                p.push(("cursor", self.cursor.clone().unwrap_or_default()));
            }
            if self.up_to_date && !catch_up {
                p.push(("live", "true".to_string()));
                RequestKind::Live
            } else {
                RequestKind::CatchUp
            }
        };
        Request {
            kind,
            path_and_query: self.url.render(&p),
            offset: self.offset.clone(),
            handle: self.handle.clone(),
        }
    }

    /// The SSE live request (`docs/protocol.md` §13.4) at the current handle, offset and
    /// cursor, as `@electric-sql/client` 1.5 sends it with `liveSse: true` (it also sends the
    /// deprecated `experimental_live_sse`, which runfeed ignores). Only once up-to-date.
    pub fn sse_request(&self) -> Request {
        let p: Vec<(&str, String)> = vec![
            ("cursor", self.cursor.clone().unwrap_or_default()),
            ("handle", self.handle.clone().unwrap_or_default()),
            ("live", "true".to_string()),
            ("live_sse", "true".to_string()),
            ("log", "full".to_string()),
            ("offset", self.offset.clone()),
        ];
        Request {
            kind: RequestKind::Sse,
            path_and_query: self.url.render(&p),
            offset: self.offset.clone(),
            handle: self.handle.clone(),
        }
    }

    /// Adopts the headers of a 200 SSE response (handle and cursor; its offset is the one
    /// requested).
    pub fn adopt_sse_headers(&mut self, handle: Option<&str>, cursor: Option<&str>) {
        if let Some(h) = handle.filter(|h| !h.is_empty()) {
            self.handle = Some(h.to_string());
        }
        if let Some(c) = cursor.filter(|c| !c.is_empty()) {
            self.cursor = Some(c.to_string());
        }
    }

    /// Applies one SSE batch (the messages of `data:` events up to and including an
    /// `up-to-date`) as the 1.5 client does: the changes onto the view, then the next offset
    /// `<global_last_seen_lsn>_0` when the `up-to-date` carries that field (else the offset
    /// stays, `docs/protocol.md` §13.4). Returns the changes, in order.
    pub fn apply_sse_batch(&mut self, messages: &[Value]) -> Vec<Change> {
        let batch = Response {
            status: 200,
            handle: None,
            offset: None,
            cursor: None,
            has_schema: false,
            up_to_date_header: false,
            messages: messages.to_vec(),
            text: String::new(),
            elapsed: Duration::ZERO,
        };
        let changes = batch.changes();
        for change in &changes {
            self.apply_change(change);
        }
        let lsn = messages
            .iter()
            .rev()
            .filter_map(|m| m.get("headers"))
            .find(|h| h.get("control").and_then(Value::as_str) == Some("up-to-date"))
            .and_then(|h| h.get("global_last_seen_lsn"))
            .and_then(Value::as_str);
        if let Some(lsn) = lsn {
            self.offset = format!("{lsn}_0");
        }
        self.up_to_date = true;
        self.responses += 1;
        changes
    }

    /// Sends `req` to `base` (e.g. `http://127.0.0.1:3030`) and reads the whole response,
    /// bounded by `limit`. Does not change the follower.
    ///
    /// # Errors
    /// [`ClientError::Transport`] when the connection fails, [`ClientError::Timeout`] past
    /// `limit`.
    pub async fn send(
        &self,
        http: &reqwest::Client,
        base: &str,
        req: &Request,
        limit: Duration,
    ) -> Result<Response, ClientError> {
        let started = Instant::now();
        let mut builder = http.get(format!("{base}{}", req.path_and_query));
        for (k, v) in &self.headers {
            builder = builder.header(k.as_str(), v.as_str());
        }
        let fetch = async {
            let resp = builder
                .send()
                .await
                .map_err(|e| ClientError::Transport(error_chain(&e)))?;
            let status = resp.status().as_u16();
            let header = |name: &str| {
                resp.headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            };
            let handle = header("electric-handle");
            let offset = header("electric-offset");
            let cursor = header("electric-cursor");
            let has_schema = resp.headers().contains_key("electric-schema");
            let up_to_date_header = resp.headers().contains_key("electric-up-to-date");
            let text = resp
                .text()
                .await
                .map_err(|e| ClientError::Transport(error_chain(&e)))?;
            let messages = match serde_json::from_str::<Value>(&text) {
                Ok(Value::Array(messages)) => messages,
                _ => Vec::new(),
            };
            Ok(Response {
                status,
                handle,
                offset,
                cursor,
                has_schema,
                up_to_date_header,
                messages,
                text,
                elapsed: started.elapsed(),
            })
        };
        match tokio::time::timeout(limit, fetch).await {
            Ok(result) => result,
            Err(_) => Err(ClientError::Timeout(limit)),
        }
    }

    /// Applies a response to `req` as the client does: a 2xx adopts the headers and applies
    /// the changes; a 409 resets (must-refetch); anything else changes nothing.
    pub fn apply(&mut self, req: &Request, resp: &Response) -> Applied {
        match resp.status {
            200..=299 => {
                if let Some(h) = resp.handle.as_ref().filter(|h| !h.is_empty()) {
                    self.handle = Some(h.clone());
                }
                if let Some(o) = resp.offset.as_ref().filter(|o| !o.is_empty()) {
                    self.offset = o.clone();
                }
                if let Some(c) = resp.cursor.as_ref().filter(|c| !c.is_empty()) {
                    self.cursor = Some(c.clone());
                }
                let changes = resp.changes();
                for change in &changes {
                    self.apply_change(change);
                }
                if resp.ends_up_to_date() {
                    self.up_to_date = true;
                }
                self.responses += 1;
                Applied::Changes(changes)
            }
            409 => {
                let old = req.handle.clone().or_else(|| self.handle.clone());
                let new_handle = resp
                    .handle
                    .clone()
                    .filter(|h| !h.is_empty())
                    .unwrap_or_else(|| format!("{}-next", old.clone().unwrap_or_default()));
                self.expired_handle = old;
                self.handle = Some(new_handle.clone());
                self.offset = "-1".to_string();
                self.cursor = None;
                self.up_to_date = false;
                self.view.clear();
                self.resets += 1;
                Applied::MustRefetch { new_handle }
            }
            other => Applied::Status(other),
        }
    }

    /// Applies one change message to the view (`docs/protocol.md` §3.4).
    pub fn apply_change(&mut self, change: &Change) {
        match change.operation.as_str() {
            "insert" => {
                self.view.insert(change.key.clone(), change.value.clone());
            }
            "delete" => {
                self.view.remove(&change.key);
            }
            _ => {
                let row = self.view.entry(change.key.clone()).or_default();
                for (k, v) in &change.value {
                    row.insert(k.clone(), v.clone());
                }
            }
        }
    }

    /// Sends the next request and applies its response.
    ///
    /// # Errors
    /// As [`Follower::send`].
    pub async fn step(
        &mut self,
        http: &reqwest::Client,
        base: &str,
        limit: Duration,
    ) -> Result<(Response, Applied), ClientError> {
        let req = self.request(false);
        let resp = self.send(http, base, &req, limit).await?;
        let applied = self.apply(&req, &resp);
        Ok((resp, applied))
    }

    /// The view's row of run `id` (by `value.id`).
    pub fn row(&self, id: &str) -> Option<&Map<String, Value>> {
        self.view
            .values()
            .find(|row| row.get("id").and_then(Value::as_str) == Some(id))
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn resp(status: u16, handle: &str, offset: &str, body: Value) -> Response {
        Response {
            status,
            handle: Some(handle.to_string()),
            offset: Some(offset.to_string()),
            cursor: Some("7".to_string()),
            has_schema: true,
            up_to_date_header: true,
            messages: body.as_array().cloned().unwrap_or_default(),
            text: body.to_string(),
            elapsed: Duration::ZERO,
        }
    }

    #[test]
    fn requests_follow_the_client_sequence() {
        let mut f = Follower::new(FeedUrl::tags(&["a".into(), "b".into()], Some("1h")), "tok");
        let r0 = f.request(false);
        assert_eq!(r0.kind, RequestKind::Snapshot);
        assert_eq!(
            r0.path_and_query,
            "/realtime/v1/runs?createdAt=1h&log=full&offset=-1&tags=a%2Cb"
        );
        let body = json!([
            {"key": "k1", "value": {"id": "r1", "status": "PENDING", "updatedAt": "x"}, "headers": {"operation": "insert"}},
            {"headers": {"control": "up-to-date"}}
        ]);
        f.apply(&r0, &resp(200, "H", "5_1", body));
        let r1 = f.request(false);
        assert_eq!(r1.kind, RequestKind::Live);
        assert_eq!(
            r1.path_and_query,
            "/realtime/v1/runs?createdAt=1h&cursor=7&handle=H&live=true&log=full&offset=5_1&tags=a%2Cb"
        );
        let r2 = f.request(true);
        assert_eq!(r2.kind, RequestKind::CatchUp);
        assert!(!r2.path_and_query.contains("live="));
        assert!(r2.path_and_query.contains("cursor=7"));
    }

    /// A follower of `run_1` after its snapshot: one row (`PENDING`, metadata `m0`), handle
    /// `H`, offset `5_1`, cursor `7`, up-to-date.
    fn followed_run() -> Follower {
        let mut f = Follower::new(FeedUrl::run("run_1"), "tok");
        let r0 = f.request(false);
        f.apply(
            &r0,
            &resp(
                200,
                "H",
                "5_1",
                json!([
                    {"key": "k", "value": {"id": "r", "status": "PENDING", "metadata": "m0"}, "headers": {"operation": "insert"}},
                    {"headers": {"control": "up-to-date"}}
                ]),
            ),
        );
        f
    }

    #[test]
    fn update_merges_and_409_resets() {
        let mut f = followed_run();
        let r1 = f.request(false);
        f.apply(
            &r1,
            &resp(
                200,
                "H",
                "6_2",
                json!([
                    {"key": "k", "value": {"id": "r", "status": "EXECUTING"}, "headers": {"operation": "update"}},
                    {"headers": {"control": "up-to-date"}}
                ]),
            ),
        );
        let row = f.row("r").expect("row");
        assert_eq!(row["status"], "EXECUTING");
        assert_eq!(row["metadata"], "m0", "shallow merge keeps other columns");
        let r2 = f.request(false);
        let applied = f.apply(
            &r2,
            &resp(
                409,
                "H2",
                "",
                json!([{"headers": {"control": "must-refetch"}}]),
            ),
        );
        assert_eq!(
            applied,
            Applied::MustRefetch {
                new_handle: "H2".into()
            }
        );
        assert!(f.view.is_empty());
        let r3 = f.request(false);
        assert_eq!(r3.kind, RequestKind::Snapshot);
        assert_eq!(
            r3.path_and_query,
            "/realtime/v1/runs/run_1?expired_handle=H&handle=H2&log=full&offset=-1"
        );
    }

    #[test]
    fn an_sse_batch_applies_and_moves_to_the_lsn_offset() {
        let mut f = followed_run();
        let sse = f.sse_request();
        assert_eq!(sse.kind, RequestKind::Sse);
        assert_eq!(
            sse.path_and_query,
            "/realtime/v1/runs/run_1?cursor=7&handle=H&live=true&live_sse=true&log=full&offset=5_1"
        );
        let changes = f.apply_sse_batch(&[
            json!({"key": "k", "value": {"id": "r", "status": "EXECUTING"}, "headers": {"operation": "update"}}),
            json!({"headers": {"control": "up-to-date", "global_last_seen_lsn": "42"}}),
        ]);
        assert_eq!(changes.len(), 1);
        assert_eq!(f.row("r").expect("row")["status"], "EXECUTING");
        assert_eq!(f.row("r").expect("row")["metadata"], "m0");
        assert_eq!(f.offset, "42_0");
        // Without the field the offset stays.
        f.apply_sse_batch(&[json!({"headers": {"control": "up-to-date"}})]);
        assert_eq!(f.offset, "42_0");
    }

    #[test]
    fn error_statuses_change_nothing() {
        let mut f = Follower::new(FeedUrl::batch("batch_1"), "tok");
        let r0 = f.request(false);
        let before = f.clone();
        assert_eq!(
            f.apply(&r0, &resp(503, "X", "9_9", json!({"error": "x"}))),
            Applied::Status(503)
        );
        assert_eq!(f.offset, before.offset);
        assert_eq!(f.handle, before.handle);
    }
}
