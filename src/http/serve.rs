//! The HTTP/1.1 accept loop: one tokio task per connection, with the per-connection bounds
//! axum's own `serve` does not expose (README "Request limits").
//!
//! - **Slow clients (slowloris):** a request head must arrive complete within
//!   `header_read_timeout` (hyper's `header_read_timeout`, measured from the first poll of an
//!   idle connection, so it also closes idle keep-alive connections); a response write that
//!   makes no progress for `write_stall_timeout` closes the connection (a client that stops
//!   reading cannot pin a response in memory).
//! - **Bytes buffered per connection:** hyper's read and write buffers are capped at
//!   `max_buf_bytes`; a request head larger than that is refused by hyper with a bare 431.
//! - **Memory per held feed:** HTTP/1 only (no HTTP/2 state per connection; runfeed sits
//!   behind a load balancer that speaks HTTP/1.1 to it), `TCP_NODELAY` set, no per-connection
//!   clone of the make-service machinery.
//! - **Graceful shutdown:** when the shutdown token is cancelled the listener is closed at once,
//!   every connection is told to finish its in-flight response and close (no reset), and the
//!   returned future completes when all connections are gone, or after the grace period, when
//!   the remaining connections are cut off (a client that does not read its response cannot
//!   hold the process).

use std::time::Duration;

use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_io_timeout::TimeoutStream;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Per-connection bounds of [`serve`] (`[server]` in the configuration).
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Time allowed for a complete request head (request line + headers) from the moment the
    /// connection waits for one, including idle keep-alive time, ms. 0 disables.
    pub header_read_timeout_ms: u64,
    /// A pending response write that makes no progress for this long closes the connection,
    /// ms. 0 disables.
    pub write_stall_timeout_ms: u64,
    /// Cap of hyper's read and write buffers per connection, bytes (hyper's minimum is 8 192).
    pub max_buf_bytes: usize,
    /// After shutdown starts, connections still open this long are cut off, ms.
    pub shutdown_grace_ms: u64,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_read_timeout_ms: 10_000,
            write_stall_timeout_ms: 30_000,
            max_buf_bytes: 160 * 1024,
            shutdown_grace_ms: 2_000,
        }
    }
}

/// Serves `app` on `listener` until `shutdown` is cancelled, then drains: see the module docs.
/// Accept errors (e.g. `EMFILE` when out of file descriptors) are logged and retried after a
/// short pause instead of ending the server.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    shutdown: CancellationToken,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .keep_alive(true)
        .half_close(false)
        .max_buf_size(limits.max_buf_bytes.max(8192))
        .header_read_timeout(
            (limits.header_read_timeout_ms > 0)
                .then(|| Duration::from_millis(limits.header_read_timeout_ms)),
        );
    let write_stall = (limits.write_stall_timeout_ms > 0)
        .then(|| Duration::from_millis(limits.write_stall_timeout_ms));
    let service = TowerToHyperService::new(
        app.map_request(|req: http::Request<Incoming>| req.map(Body::new)),
    );
    let graceful = GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.cancelled() => break,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(err) => {
                // Per-connection errors (ECONNABORTED…) and resource exhaustion (EMFILE):
                // pause briefly so a full fd table does not become a busy loop.
                tracing::warn!(error = %err, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let mut stream = TimeoutStream::new(stream);
        stream.set_write_timeout(write_stall);
        let conn = builder.serve_connection(TokioIo::new(Box::pin(stream)), service.clone());
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(err) = conn.await {
                tracing::trace!(error = %err, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let grace = Duration::from_millis(limits.shutdown_grace_ms);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        // The connection tasks end with the runtime, or when their clients close.
        tracing::info!("shutdown grace period over; closing the remaining connections");
    }
}

impl ConnLimits {
    /// The bounds from `[server]`. The read/write buffer cap is 4 × (`max_url_bytes` +
    /// `max_header_bytes`) (160 KiB by default, hyper's own default is ~400 KiB): heads up to
    /// that size still reach the router and get the JSON 414/431 with CORS; only larger ones
    /// get hyper's bare 431.
    pub fn of(config: &crate::config::Config) -> ConnLimits {
        ConnLimits {
            header_read_timeout_ms: config.server.header_read_timeout_ms,
            write_stall_timeout_ms: config.server.write_stall_timeout_ms,
            max_buf_bytes: 4 * (config.server.max_url_bytes + config.server.max_header_bytes),
            shutdown_grace_ms: config.server.shutdown_grace_ms,
        }
    }
}
