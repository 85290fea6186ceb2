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
//! - **Memory per held feed:** the pages of hyper's 8 KiB read buffer that a request head
//!   touched are handed back to the kernel when the connection goes idle (see [`IdleRelease`]),
//!   so a held poll keeps none of them resident for its ~20 s; HTTP/1 only (no HTTP/2 state per connection; runfeed sits
//!   behind a load balancer that speaks HTTP/1.1 to it), `TCP_NODELAY` set, no per-connection
//!   clone of the make-service machinery.
//! - **Graceful shutdown:** when the shutdown token is cancelled the listener is closed at once,
//!   every connection is told to finish its in-flight response and close (no reset), and the
//!   returned future completes when all connections are gone, or after the grace period, when
//!   the remaining connections are cut off (a client that does not read its response cannot
//!   hold the process).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
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
        // The response body `Bytes` is handed to the socket as is (no copy into the write
        // buffer): one shared body, N connections.
        .writev(true)
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
        let io = IdleRelease {
            inner: Box::pin(stream),
            touched: false,
        };
        let conn = builder.serve_connection(TokioIo::new(io), service.clone());
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

/// The connection's stream, which releases the pages of hyper's read buffer while the
/// connection has nothing to read (a held poll, an idle keep-alive connection).
///
/// hyper reads into one 8 KiB buffer per connection (not configurable) and keeps it for the
/// connection's life; a request head dirties its first page, which would stay resident for the
/// whole hold (~4 KiB per held feed, the largest single item; BENCHMARKS.md "Held feeds"). When
/// a read finds nothing (`Pending`) after bytes arrived since the last release, the whole pages
/// inside the buffer's unfilled part are given back with `madvise(MADV_DONTNEED)`: they read
/// as zeros afterwards, which is a valid content for the unfilled (writable, not yet read) part
/// of a `ReadBuf`. One syscall per request; none while the connection stays idle.
struct IdleRelease {
    inner: Pin<Box<TimeoutStream<TcpStream>>>,
    /// Bytes were read since the last release.
    touched: bool,
}

impl IdleRelease {
    /// Page size assumed for the release; pages are only released when whole (4 KiB).
    const PAGE: usize = 4096;

    fn release(buf: &mut ReadBuf<'_>) {
        // SAFETY: only the address and length of the unfilled part are read here; the pages
        // released in it read as zeros afterwards, so nothing initialized is de-initialized.
        let unfilled = unsafe { buf.unfilled_mut() };
        let start = unfilled.as_mut_ptr() as usize;
        let end = start + unfilled.len();
        let first = start.next_multiple_of(Self::PAGE);
        let last = end - end % Self::PAGE;
        if last > first {
            release_pages(first, last - first);
        }
    }
}

#[cfg(target_os = "linux")]
fn release_pages(addr: usize, len: usize) {
    // SAFETY: [addr, addr + len) is whole pages inside the unfilled part of the caller's
    // `ReadBuf`, memory this reader may overwrite and nobody else uses; MADV_DONTNEED on
    // private anonymous memory only replaces its content with zeros.
    unsafe {
        libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED);
    }
}

#[cfg(not(target_os = "linux"))]
fn release_pages(_addr: usize, _len: usize) {}

impl AsyncRead for IdleRelease {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = self.inner.as_mut().poll_read(cx, buf);
        match polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => self.touched = true,
            Poll::Pending if self.touched => {
                self.touched = false;
                IdleRelease::release(buf);
            }
            _ => {}
        }
        polled
    }
}

impl AsyncWrite for IdleRelease {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.inner.as_mut().poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.inner.as_mut().poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.inner.as_mut().poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.inner.as_mut().poll_shutdown(cx)
    }
}
