//! The SSE transport of the checker's slow readers: one HTTP/1.1 connection per stream on a
//! socket with a small receive buffer ([`RECV_BUFFER`]), so that a reader that stops reading
//! makes the server's kernel and queue fill up as a slow client's would, and an incremental
//! parser of the `data:` events into Electric messages (`docs/protocol.md` §13.4), grouped
//! into batches that end with an `up-to-date`.
//!
//! hyper reads the body only while it is polled: a reader that does not call
//! [`SseStream::next_batch`] reads nothing, and what the server sends piles up in the kernel's
//! buffers, then in the server's own queue.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpSocket;
use tokio::task::JoinHandle;

use super::io::sse_event_data;
use crate::client::{ClientError, Request, Response};

/// `SO_RCVBUF` of a stream's socket, bytes (the kernel doubles it).
pub const RECV_BUFFER: u32 = 4096;

/// What opening a stream answered.
pub enum Opened {
    /// `200 text/event-stream`: the stream, and its `electric-handle` and `electric-cursor`.
    Stream {
        stream: SseStream,
        handle: Option<String>,
        cursor: Option<String>,
    },
    /// Any other status, with its whole body (a 409's must-refetch, an error).
    Status(Response),
}

/// One open SSE stream.
pub struct SseStream {
    body: Incoming,
    /// hyper's connection task (aborted when the stream is dropped).
    driver: JoinHandle<()>,
    /// Bytes received and not yet parsed into complete events.
    buf: Vec<u8>,
    /// Messages of the batch in progress (before its `up-to-date`).
    pending: Vec<Value>,
}

impl Drop for SseStream {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// Opens `req` (a [`RequestKind::Sse`](crate::client::RequestKind::Sse) request) on `base`
/// with `headers`; the head must arrive within `limit`.
///
/// # Errors
/// [`ClientError::Transport`] when the connection fails, [`ClientError::Timeout`] past `limit`.
pub async fn open(
    base: &str,
    req: &Request,
    headers: &[(String, String)],
    limit: Duration,
) -> Result<Opened, ClientError> {
    let started = tokio::time::Instant::now();
    let host = base.trim_start_matches("http://").trim_end_matches('/');
    let addr: SocketAddr = host
        .parse()
        .map_err(|e| ClientError::Transport(format!("{base}: {e}")))?;
    let transport = |e: &dyn std::fmt::Display| ClientError::Transport(e.to_string());
    let connect = async {
        let socket = TcpSocket::new_v4().map_err(|e| transport(&e))?;
        socket
            .set_recv_buffer_size(RECV_BUFFER)
            .map_err(|e| transport(&e))?;
        let stream = socket.connect(addr).await.map_err(|e| transport(&e))?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| transport(&e))?;
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut builder = hyper::Request::get(req.path_and_query.as_str())
            .header(hyper::header::HOST, host)
            .header(hyper::header::ACCEPT, "text/event-stream");
        for (k, v) in headers {
            builder = builder.header(k.as_str(), v.as_str());
        }
        let request = builder
            .body(Empty::<Bytes>::new())
            .map_err(|e| transport(&e))?;
        let response = match send.send_request(request).await {
            Ok(r) => r,
            Err(e) => {
                driver.abort();
                return Err(transport(&e));
            }
        };
        Ok::<_, ClientError>((response, driver))
    };
    let (response, driver) = tokio::time::timeout(limit, connect)
        .await
        .map_err(|_| ClientError::Timeout(limit))??;
    let (parts, body) = response.into_parts();
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let status = parts.status.as_u16();
    if status == 200 {
        return Ok(Opened::Stream {
            stream: SseStream {
                body,
                driver,
                buf: Vec::new(),
                pending: Vec::new(),
            },
            handle: header("electric-handle"),
            cursor: header("electric-cursor"),
        });
    }
    let text = tokio::time::timeout(limit, body.collect())
        .await
        .map_err(|_| ClientError::Timeout(limit))?
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .unwrap_or_default();
    driver.abort();
    let messages = match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(messages)) => messages,
        _ => Vec::new(),
    };
    Ok(Opened::Status(Response {
        status,
        handle: header("electric-handle"),
        offset: header("electric-offset"),
        cursor: header("electric-cursor"),
        has_schema: parts.headers.contains_key("electric-schema"),
        up_to_date_header: parts.headers.contains_key("electric-up-to-date"),
        messages,
        text,
        elapsed: started.elapsed(),
    }))
}

impl SseStream {
    /// The next complete batch: the messages up to and including an `up-to-date`. `Ok(None)`
    /// when the server ended the stream cleanly (an unfinished batch is dropped, as the client
    /// drops it). Cancel-safe: what was received stays buffered.
    ///
    /// # Errors
    /// [`ClientError::Transport`] when the connection breaks (or the server aborts it).
    pub async fn next_batch(&mut self) -> Result<Option<Vec<Value>>, ClientError> {
        loop {
            while let Some(end) = find_event_end(&self.buf) {
                let event: Vec<u8> = self.buf.drain(..end + 2).collect();
                let Some(data) = sse_event_data(&String::from_utf8_lossy(&event[..end])) else {
                    continue; // a comment (keep-alive)
                };
                let Ok(message) = serde_json::from_str::<Value>(&data) else {
                    return Err(ClientError::Transport(format!(
                        "an SSE event that is not JSON: {data:.200}"
                    )));
                };
                let up_to_date = message
                    .get("headers")
                    .and_then(|h| h.get("control"))
                    .and_then(Value::as_str)
                    == Some("up-to-date");
                self.pending.push(message);
                if up_to_date {
                    return Ok(Some(std::mem::take(&mut self.pending)));
                }
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(ClientError::Transport(e.to_string())),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

/// The index of the blank line (`\n\n`) that ends the first complete event of `buf`.
fn find_event_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_parse_and_comments_are_skipped() {
        let buf = b": keepalive\n\ndata: {\"a\":1}\n\ndata: {\"b\"";
        let end = find_event_end(buf).expect("an event");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        assert_eq!(sse_event_data(&text(&buf[..end])), None);
        let rest = &buf[end + 2..];
        let end = find_event_end(rest).expect("a second event");
        assert_eq!(
            sse_event_data(&text(&rest[..end])).as_deref(),
            Some("{\"a\":1}")
        );
        assert_eq!(find_event_end(&rest[end + 2..]), None, "unfinished");
        assert_eq!(sse_event_data("data: a\ndata: b").as_deref(), Some("a\nb"));
    }
}
