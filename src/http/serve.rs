//! The HTTP/1.1 accept loop: one tokio task per connection, with the per-connection bounds
//! axum's own `serve` does not expose (docs/http-api.md "Request limits", "Connections").
//!
//! Each connection starts on runfeed's own path for plain `GET`s ([`super::h1`]: no buffer of
//! its own while a poll is held, one write per answer); the first request that is anything
//! else hands the connection, with the bytes already read, to hyper for the rest of its life.
//! The bounds below hold on both.
//!
//! - **Slow clients (slowloris):** a request head must arrive complete within
//!   `header_read_timeout` (measured from the moment an idle connection waits for one, so it
//!   also closes idle keep-alive connections; hyper's `header_read_timeout` once handed over);
//!   a response write that makes no progress for `write_stall_timeout` closes the connection
//!   (a client that stops reading cannot pin a response in memory).
//! - **Bytes buffered per connection:** hyper's read and write buffers are capped at
//!   `max_buf_bytes`; a request head larger than that is refused by hyper with a bare 431.
//!   runfeed's own path reads heads into one scratch buffer per worker thread.
//! - **Memory per held feed:** a poll held on runfeed's own path keeps no read or write
//!   buffer. On a connection handed to hyper, the pages of hyper's 8 KiB read buffer that a
//!   request head touched are handed back to the kernel when the connection goes idle (see
//!   [`IdleRelease`]). HTTP/1 only (no HTTP/2 state per connection; runfeed sits behind a load
//!   balancer that speaks HTTP/1.1 to it), `TCP_NODELAY` set, no per-connection clone of the
//!   make-service machinery.
//! - **Kernel memory per connection:** the listener ([`bind`]) sets `SO_SNDBUF`
//!   (`server.socket_send_buffer_bytes`), which the accepted connections inherit: a client that
//!   stops reading pins at most that much in the kernel, and the tokio workers copy at most
//!   that much into its socket, instead of the up to 4 MiB send-buffer autotuning allows.
//! - **Out of file descriptors (`EMFILE`/`ENFILE`):** the loop keeps one spare descriptor
//!   (`/dev/null`); when accept fails for lack of descriptors it gives the spare back, accepts
//!   the connections waiting in the backlog and closes them at once (the client sees a closed
//!   connection instead of hanging in the backlog; counted by [`refused_connections`],
//!   `runfeed_http_refused_connections_total`), takes the spare again and pauses with an
//!   exponential backoff (5 ms doubling to 1 s, reset by the next accepted connection) so a
//!   full descriptor table never becomes a busy loop. Service resumes by itself once
//!   descriptors free up.
//! - **Closing a connection from its response:** every connection carries a [`ConnAbort`]
//!   (reachable from the handlers running on it through [`current_connection`]); a response
//!   that gives up on its client (an SSE stream whose client stopped reading, `http::sse`)
//!   aborts it, and the connection's next or pending write fails at once, so hyper drops the
//!   connection and every buffer it pinned instead of waiting for the write-stall timeout
//!   (SSE streams are always hyper's).
//! - **Graceful shutdown:** when the shutdown token is cancelled the listener is closed at once,
//!   every connection is told to finish its in-flight response and close (no reset), and the
//!   returned future completes when all connections are gone, or after the grace period, when
//!   the remaining connections are cut off (a client that does not read its response cannot
//!   hold the process).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use futures::FutureExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Connections accepted only to be closed unserved because the process was out of file
/// descriptors, since the process started (all listeners of the process).
static REFUSED_CONNECTIONS: AtomicU64 = AtomicU64::new(0);

/// Failed accepts of any kind since the process started (all listeners of the process).
static ACCEPT_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Connections closed unserved for lack of file descriptors since the process started
/// (`runfeed.http.refused_connections`, read by the wiring).
pub fn refused_connections() -> u64 {
    REFUSED_CONNECTIONS.load(Ordering::Relaxed)
}

/// Failed accepts since the process started (`runfeed.http.accept_errors`, read by the
/// wiring); with descriptors exhausted, one per backoff step, not per retry of a busy loop.
pub fn accept_errors() -> u64 {
    ACCEPT_ERRORS.load(Ordering::Relaxed)
}

/// Lets what runs on a connection close it (see the module docs): once [`ConnAbort::abort`]ed,
/// the connection's writes fail with `ConnectionAborted` and a pending write is woken to fail.
#[derive(Debug, Default)]
pub struct ConnAbort {
    aborted: std::sync::atomic::AtomicBool,
    waker: futures::task::AtomicWaker,
}

impl ConnAbort {
    /// Closes the connection: its pending or next write fails.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        self.waker.wake();
    }

    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }
}

tokio::task_local! {
    /// The connection whose task is running (set around each connection's future).
    static CONNECTION: std::sync::Arc<ConnAbort>;
}

/// The [`ConnAbort`] of the connection the caller runs on (`None` outside [`serve`], e.g. in
/// tests that call the router directly).
pub fn current_connection() -> Option<std::sync::Arc<ConnAbort>> {
    CONNECTION.try_with(std::sync::Arc::clone).ok()
}

/// First pause after a failed accept.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
/// Longest pause between accepts while they keep failing.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Most backlog connections closed per failed accept (bounds the time the loop spends there).
const SHED_MAX: usize = 4096;

/// Whether `err` means the process or the system ran out of file descriptors.
fn out_of_descriptors(err: &std::io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE))
}

/// The spare descriptor the accept loop gives back when descriptors run out.
fn spare_descriptor() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

/// Out of descriptors: frees `spare`, accepts and closes what waits in `listener`'s backlog
/// (at most [`SHED_MAX`]), takes a spare again. Returns how many connections were closed.
fn shed_backlog(listener: &TcpListener, spare: &mut Option<std::fs::File>) -> u64 {
    if spare.take().is_none() {
        *spare = spare_descriptor();
        return 0;
    }
    let mut closed = 0;
    while closed < SHED_MAX as u64 {
        match listener.accept().now_or_never() {
            Some(Ok((stream, _))) => {
                drop(stream);
                closed += 1;
            }
            _ => break,
        }
    }
    *spare = spare_descriptor();
    closed
}

/// A listener on `addr` (`host:port`, resolved like [`TcpListener::bind`]: the first address
/// that binds) whose accepted connections have an `SO_SNDBUF` of `send_buffer_bytes` (0: the
/// kernel's autotuning). Accepted sockets inherit the listener's send buffer size (Linux and
/// the BSDs), so no connection pays a system call for it.
///
/// The cap bounds what a client that stops reading costs in the kernel and, above all, the
/// bytes the server's threads copy into its socket: with autotuning each such socket takes
/// up to `net.ipv4.tcp_wmem`'s maximum (4 MiB by default) before a write would block, every
/// byte copied by a tokio worker while other feeds wait for it (docs/faults.md, note 1).
pub async fn bind(addr: &str, send_buffer_bytes: usize) -> std::io::Result<TcpListener> {
    let mut last = None;
    for addr in tokio::net::lookup_host(addr).await? {
        match bind_one(addr, send_buffer_bytes) {
            Ok(listener) => return Ok(listener),
            Err(err) => last = Some(err),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the listen address resolved to no address",
        )
    }))
}

/// Backlog of the listening socket (what [`TcpListener::bind`] uses).
const LISTEN_BACKLOG: u32 = 1024;

fn bind_one(addr: std::net::SocketAddr, send_buffer_bytes: usize) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As TcpListener::bind does on Unix: a restarted server can bind while old connections
    // linger in TIME_WAIT.
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    if send_buffer_bytes > 0 {
        socket.set_send_buffer_size(u32::try_from(send_buffer_bytes).unwrap_or(u32::MAX))?;
    }
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

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
    /// Whether an idle connection's read buffer pages are handed back ([`IdleRelease`]).
    pub read_buffers: ReadBuffers,
}

/// What happens to an idle connection's read buffer (`server.release_idle_read_buffers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadBuffers {
    /// Its whole unfilled pages are handed back when the connection goes idle.
    ReleaseWhenIdle,
    /// Its pages stay resident.
    Keep,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_read_timeout_ms: 10_000,
            write_stall_timeout_ms: 30_000,
            max_buf_bytes: 160 * 1024,
            shutdown_grace_ms: 2_000,
            read_buffers: ReadBuffers::ReleaseWhenIdle,
        }
    }
}

/// What [`serve`] serves: the app's tower service, cloned per connection and per request.
pub trait App:
    tower::Service<
        axum::extract::Request,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S> App for S where
    S: tower::Service<
            axum::extract::Request,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// Serves `app` on `listener` until `shutdown` is cancelled, then drains: see the module docs.
/// Accept errors (e.g. `EMFILE` when out of file descriptors) are logged and retried after a
/// short pause instead of ending the server.
pub async fn serve<S: App>(
    listener: TcpListener,
    app: S,
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
    let shared = std::sync::Arc::new(Shared {
        builder,
        bounds: super::h1::Bounds {
            header_read: (limits.header_read_timeout_ms > 0)
                .then(|| Duration::from_millis(limits.header_read_timeout_ms)),
            write_stall,
        },
        read_buffers: limits.read_buffers,
    });
    let connections = tokio_util::task::TaskTracker::new();
    let mut spare = spare_descriptor();
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.cancelled() => break,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => {
                backoff = ACCEPT_BACKOFF_MIN;
                stream
            }
            Err(err) => {
                // Per-connection errors (ECONNABORTED…) and resource exhaustion (EMFILE):
                // shed the backlog when out of descriptors, then pause with a growing backoff
                // so a full fd table does not become a busy loop.
                ACCEPT_ERRORS.fetch_add(1, Ordering::Relaxed);
                let refused = if out_of_descriptors(&err) {
                    shed_backlog(&listener, &mut spare)
                } else {
                    0
                };
                REFUSED_CONNECTIONS.fetch_add(refused, Ordering::Relaxed);
                if backoff == ACCEPT_BACKOFF_MIN || refused > 0 {
                    tracing::warn!(error = %err, refused, backoff_ms = backoff.as_millis() as u64, "accept failed");
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = shutdown.cancelled() => break,
                }
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                continue;
            }
        };
        if spare.is_none() {
            spare = spare_descriptor();
        }
        let _ = stream.set_nodelay(true);
        let abort = std::sync::Arc::new(ConnAbort::default());
        connections.spawn(CONNECTION.scope(
            abort.clone(),
            connection(stream, app.clone(), shared.clone(), shutdown.clone(), abort),
        ));
    }
    drop(listener);
    connections.close();
    let grace = Duration::from_millis(limits.shutdown_grace_ms);
    if tokio::time::timeout(grace, connections.wait())
        .await
        .is_err()
    {
        // The connection tasks end with the runtime, or when their clients close.
        tracing::info!("shutdown grace period over; closing the remaining connections");
    }
}

/// What every connection of one [`serve`] shares.
struct Shared {
    /// hyper's connection settings, for the connections handed to it.
    builder: hyper::server::conn::http1::Builder,
    /// The bounds of runfeed's own path (`http::h1`).
    bounds: super::h1::Bounds,
    /// What hyper's read buffer does while its connection is idle.
    read_buffers: ReadBuffers,
}

/// One connection's life: runfeed's own path ([`super::h1::drive`]) for as long as its
/// requests are plain `GET`s, then hyper for the rest, given the bytes already read. Both end
/// gracefully on `shutdown` (the answer in flight is completed, then the connection closes).
async fn connection<S: App>(
    stream: TcpStream,
    mut app: S,
    shared: std::sync::Arc<Shared>,
    shutdown: CancellationToken,
    abort: std::sync::Arc<ConnAbort>,
) {
    let mut stream = stream;
    let rewound = match super::h1::drive(&mut stream, &mut app, shared.bounds, &shutdown).await {
        super::h1::Ended::Closed => return,
        super::h1::Ended::HandOff(bytes) => bytes,
    };
    let io = IdleRelease {
        inner: stream,
        rewound,
        touched: false,
        read_buffers: shared.read_buffers,
        write_stall: shared.bounds.write_stall,
        stall: None,
        abort,
    };
    let service = TowerToHyperService::new(
        app.map_request(|req: http::Request<Incoming>| req.map(Body::new)),
    );
    let conn = shared.builder.serve_connection(TokioIo::new(io), service);
    let mut conn = std::pin::pin!(conn);
    let ended = tokio::select! {
        ended = conn.as_mut() => ended,
        () = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(err) = ended {
        tracing::trace!(error = %err, "connection ended with an error");
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
            read_buffers: if config.server.release_idle_read_buffers {
                ReadBuffers::ReleaseWhenIdle
            } else {
                ReadBuffers::Keep
            },
        }
    }
}

/// A connection's stream once handed to hyper: the bytes runfeed's own path already read
/// (replayed first), the write-stall timeout, and the release of hyper's read buffer pages
/// while the connection has nothing to read (a held request, an idle keep-alive connection).
///
/// **Write stall:** a write, flush or shutdown that stays pending for `write_stall` fails with
/// `TimedOut` (hyper then closes the connection); any progress disarms the timer. The timer is
/// only allocated while a write is pending, so a held poll carries none (memory per held feed;
/// `tokio-io-timeout`'s stream kept two timers inline in a boxed stream).
///
/// hyper reads into one 8 KiB buffer per connection (not configurable) and keeps it for the
/// connection's life; a request head dirties its first page, which would stay resident for the
/// whole hold (~4 KiB per held feed, the largest single item; BENCHMARKS.md "Held feeds"). When
/// a read finds nothing (`Pending`) after bytes arrived since the last release, the whole pages
/// inside the buffer's unfilled part are given back with `madvise(MADV_DONTNEED)`: they read
/// as zeros afterwards, which is a valid content for the unfilled (writable, not yet read) part
/// of a `ReadBuf`. One syscall per request; none while the connection stays idle.
struct IdleRelease {
    inner: TcpStream,
    /// Bytes runfeed's own path read before handing the connection over: read first.
    rewound: bytes::Bytes,
    /// Bytes were read since the last release.
    touched: bool,
    /// Whether the release happens at all (`server.release_idle_read_buffers`).
    read_buffers: ReadBuffers,
    /// How long a pending write may make no progress (None: forever).
    write_stall: Option<Duration>,
    /// Armed while a write is pending.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Set by a response that gives up on this connection.
    abort: std::sync::Arc<ConnAbort>,
}

impl IdleRelease {
    /// Arms the write-stall timer (if not yet) and fails once it has run out.
    fn check_stall(&mut self, cx: &mut Context<'_>) -> std::io::Result<()> {
        let Some(limit) = self.write_stall else {
            return Ok(());
        };
        let timer = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if timer.as_mut().poll(cx).is_ready() {
            self.stall = None;
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        Ok(())
    }

    /// A write-side poll's result, with the stall timer armed while it is pending and
    /// disarmed on progress.
    fn stalled<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        if polled.is_pending() {
            self.abort.waker.register(cx.waker());
            if self.abort.is_aborted() {
                return Poll::Ready(Err(std::io::ErrorKind::ConnectionAborted.into()));
            }
            if let Err(err) = self.check_stall(cx) {
                return Poll::Ready(Err(err));
            }
        } else {
            self.stall = None;
        }
        polled
    }

    /// Gives back the whole pages inside `buf`'s unfilled part (see [`pages`]).
    fn release(buf: &mut ReadBuf<'_>) {
        // The unfilled part starts where the filled part ends; only its address and length are
        // taken, no byte is read or written here.
        let start = buf.filled().as_ptr() as usize + buf.filled().len();
        let Some(page) = pages::size() else {
            return;
        };
        if let Some((addr, len)) = whole_pages(start, buf.remaining(), page) {
            pages::release(addr, len);
        }
    }
}

/// The whole pages inside `[start, start + len)` for a page size of `page` bytes, as
/// `(address, length)`: the range shrunk inward to page boundaries, `None` when it holds no
/// whole page. Nothing outside the range is ever included, whatever the page size (4 KiB on
/// x86-64, 4, 16 or 64 KiB on arm64 kernels).
fn whole_pages(start: usize, len: usize, page: usize) -> Option<(usize, usize)> {
    if page == 0 {
        return None;
    }
    let end = start.checked_add(len)?;
    let first = start.checked_next_multiple_of(page)?;
    let last = end - end % page;
    (last > first).then(|| (first, last - first))
}

/// The only `unsafe` code in runfeed: the page size and `madvise(MADV_DONTNEED)`.
#[allow(unsafe_code)]
mod pages {
    /// The kernel's page size in bytes (`sysconf(_SC_PAGESIZE)`, read once), `None` if it
    /// cannot be read, in which case nothing is released.
    #[cfg(target_os = "linux")]
    pub(super) fn size() -> Option<usize> {
        static PAGE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
        *PAGE.get_or_init(|| {
            // SAFETY: sysconf only reads a system constant; it has no memory preconditions.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
            usize::try_from(page).ok().filter(|p| p.is_power_of_two())
        })
    }

    #[cfg(not(target_os = "linux"))]
    pub(super) fn size() -> Option<usize> {
        None
    }

    /// Replaces the content of the whole pages `[addr, addr + len)` with zeros, handing their
    /// memory back to the kernel. A failure is logged (the first one as a warning) and
    /// otherwise ignored: the pages simply stay resident.
    #[cfg(target_os = "linux")]
    pub(super) fn release(addr: usize, len: usize) {
        use std::sync::atomic::{AtomicBool, Ordering};
        static WARNED: AtomicBool = AtomicBool::new(false);
        // SAFETY: [addr, addr + len) is whole pages (`whole_pages` with the real page size)
        // inside the unfilled part of a `ReadBuf` the caller holds mutably: memory this reader
        // may overwrite and nobody reads before it is filled again. MADV_DONTNEED on private
        // anonymous memory only replaces its content with zeros, a valid content for it.
        let rc = unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if WARNED.swap(true, Ordering::Relaxed) {
                tracing::debug!(%err, addr, len, "madvise(MADV_DONTNEED) of a read buffer failed");
            } else {
                tracing::warn!(%err, addr, len, "madvise(MADV_DONTNEED) of a read buffer failed; idle connections keep their read buffer pages");
            }
        }
    }

    #[cfg(not(target_os = "linux"))]
    pub(super) fn release(_addr: usize, _len: usize) {}
}

impl AsyncRead for IdleRelease {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.rewound.is_empty() && buf.remaining() > 0 {
            let n = self.rewound.len().min(buf.remaining());
            buf.put_slice(&self.rewound.split_to(n));
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        match polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => self.touched = true,
            Poll::Pending if self.touched => {
                self.touched = false;
                if self.read_buffers == ReadBuffers::ReleaseWhenIdle {
                    IdleRelease::release(buf);
                }
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
        if self.abort.is_aborted() {
            return Poll::Ready(Err(std::io::ErrorKind::ConnectionAborted.into()));
        }
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.stalled(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.abort.is_aborted() {
            return Poll::Ready(Err(std::io::ErrorKind::ConnectionAborted.into()));
        }
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.stalled(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.stalled(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.stalled(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn pair(write_stall: Option<Duration>) -> (IdleRelease, TcpStream) {
        pair_with(write_stall, ReadBuffers::ReleaseWhenIdle).await
    }

    async fn pair_with(
        write_stall: Option<Duration>,
        read_buffers: ReadBuffers,
    ) -> (IdleRelease, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        let io = IdleRelease {
            inner: server,
            rewound: bytes::Bytes::new(),
            touched: false,
            read_buffers,
            write_stall,
            stall: None,
            abort: std::sync::Arc::default(),
        };
        (io, client)
    }

    /// A client that stops reading: the server's pending write fails with `TimedOut` after the
    /// stall limit instead of pinning the response.
    #[tokio::test]
    async fn a_write_that_makes_no_progress_times_out() {
        let (mut io, _client) = pair(Some(Duration::from_millis(200))).await;
        let chunk = vec![7u8; 1 << 20];
        let started = std::time::Instant::now();
        let err = loop {
            if let Err(err) = io.write_all(&chunk).await {
                break err;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the kernel never stopped taking bytes"
            );
        };
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(io.stall.is_none(), "the timer is dropped once it fired");
    }

    /// The send buffer size of a socket the kernel accepted (`SO_SNDBUF`, as the kernel reports
    /// it: Linux doubles what was set).
    fn send_buffer_of(stream: TcpStream) -> u32 {
        let std = stream.into_std().expect("into_std");
        tokio::net::TcpSocket::from_std_stream(std)
            .send_buffer_size()
            .expect("SO_SNDBUF")
    }

    /// An accepted connection carries the configured `SO_SNDBUF` (inherited from the listener);
    /// 0 leaves it to the kernel, as a plain `TcpListener::bind` does.
    #[tokio::test]
    async fn an_accepted_connection_gets_the_configured_send_buffer() {
        let capped = bind("127.0.0.1:0", 65_536).await.expect("bind");
        let _client = TcpStream::connect(capped.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = capped.accept().await.expect("accept");
        let size = send_buffer_of(server);
        if cfg!(target_os = "linux") {
            assert_eq!(size, 2 * 65_536, "Linux reports twice the size set");
        } else {
            assert!((65_536..=2 * 65_536).contains(&size), "{size}");
        }

        let plain = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let auto = bind("127.0.0.1:0", 0).await.expect("bind");
        let mut sizes = Vec::new();
        for listener in [&plain, &auto] {
            let _client = TcpStream::connect(listener.local_addr().expect("addr"))
                .await
                .expect("connect");
            let (server, _) = listener.accept().await.expect("accept");
            sizes.push(send_buffer_of(server));
        }
        assert_eq!(sizes[0], sizes[1], "0 = the kernel's own choice");
    }

    /// A client that reads nothing: the kernel takes at most about the capped send buffer (plus
    /// what the client's receive buffer holds) before the server's writes would block, instead
    /// of up to `net.ipv4.tcp_wmem`'s maximum (4 MiB by default) with autotuning.
    #[tokio::test]
    async fn a_capped_send_buffer_bounds_what_a_stalled_client_takes() {
        let listener = bind("127.0.0.1:0", 65_536).await.expect("bind");
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        let _client = socket
            .connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        let chunk = vec![7u8; 64 * 1024];
        let mut taken = 0usize;
        loop {
            server.writable().await.expect("writable");
            match server.try_write(&chunk) {
                Ok(n) => taken += n,
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(err) => panic!("write: {err}"),
            }
            assert!(taken < 8 << 20, "the kernel never stopped taking bytes");
        }
        assert!(
            taken <= 512 * 1024,
            "{taken} bytes taken by a stalled client"
        );
    }

    /// The released range never leaves the buffer and covers only whole pages, for the page
    /// sizes of x86-64 (4 KiB) and arm64 kernels (4, 16 and 64 KiB).
    #[test]
    fn whole_pages_stay_inside_the_range_for_4_16_and_64_kib_pages() {
        for page in [4096usize, 16 << 10, 64 << 10] {
            // An 8 KiB buffer (hyper's) that does not start on a page boundary.
            let start = 5 * page + 100;
            let got = whole_pages(start, 8192, page);
            if page == 4096 {
                // 8 KiB from an unaligned start holds exactly one whole 4 KiB page.
                assert_eq!(got, Some((6 * page, page)));
            } else {
                assert_eq!(got, None, "no whole {page}-byte page inside 8 KiB");
            }
            // A range of three pages from an unaligned start: the two inside it.
            assert_eq!(
                whole_pages(start, 3 * page, page),
                Some((6 * page, 2 * page))
            );
            // Aligned on both ends: all of it.
            assert_eq!(
                whole_pages(2 * page, 2 * page, page),
                Some((2 * page, 2 * page))
            );
            // One byte short of a page on either side: nothing.
            assert_eq!(whole_pages(2 * page + 1, page, page), None);
            assert_eq!(whole_pages(2 * page, page - 1, page), None);
            // Whatever the start and length, the result is whole pages inside the range.
            for (s, l) in [
                (1, 10 * page),
                (page - 1, 2 * page + 1),
                (7 * page + 3, 4 * page),
            ] {
                if let Some((a, n)) = whole_pages(s, l, page) {
                    assert!(a >= s && a + n <= s + l, "{a}+{n} outside {s}+{l}");
                    assert_eq!(a % page, 0);
                    assert_eq!(n % page, 0);
                    assert!(n > 0);
                }
            }
        }
        assert_eq!(
            whole_pages(usize::MAX - 10, 20, 4096),
            None,
            "overflow is no range"
        );
        assert_eq!(whole_pages(0, 8192, 0), None);
    }

    /// The page size comes from the kernel, and is one of the sizes the release handles.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_page_size_is_read_from_the_kernel() {
        let page = pages::size().expect("sysconf(_SC_PAGESIZE)");
        assert!(page.is_power_of_two() && page >= 4096, "{page}");
    }

    /// A pending write of a connection whose response gave up on it fails at once (woken),
    /// long before the stall limit.
    #[tokio::test]
    async fn an_aborted_connection_fails_its_pending_write_at_once() {
        let (mut io, _client) = pair(Some(Duration::from_secs(60))).await;
        let abort = io.abort.clone();
        let chunk = vec![7u8; 1 << 20];
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            abort.abort();
        });
        let started = std::time::Instant::now();
        let err = loop {
            if let Err(err) = io.write_all(&chunk).await {
                break err;
            }
        };
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionAborted);
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    /// Reads still see every byte after the idle release, and a write that progresses leaves
    /// no timer behind.
    #[tokio::test]
    async fn reads_after_an_idle_release_see_every_byte() {
        let (mut io, mut client) = pair(Some(Duration::from_millis(200))).await;
        let mut buf = vec![0u8; 8192];
        for round in 0..3u8 {
            // Nothing to read: Pending, which releases the buffer's pages after round 0.
            let idle = tokio::time::timeout(Duration::from_millis(20), io.read(&mut buf)).await;
            assert!(idle.is_err(), "nothing was sent yet");
            assert!(!io.touched);
            let sent = vec![round + 1; 1000];
            client.write_all(&sent).await.expect("client write");
            let mut got = Vec::new();
            while got.len() < sent.len() {
                let n = io.read(&mut buf).await.expect("read");
                got.extend_from_slice(&buf[..n]);
            }
            assert_eq!(got, sent);
            io.write_all(b"ok").await.expect("write");
            assert!(io.stall.is_none());
            let mut ok = [0u8; 2];
            client.read_exact(&mut ok).await.expect("client read");
        }
    }

    /// The release replaces the whole unfilled pages of the read buffer with zeros when the
    /// connection goes idle; with `server.release_idle_read_buffers = false` they keep their
    /// content (they stay resident).
    #[tokio::test]
    async fn an_idle_read_buffer_is_released_only_when_configured() {
        use tokio::io::ReadBuf;
        for (mode, zeroed) in [
            (ReadBuffers::ReleaseWhenIdle, true),
            (ReadBuffers::Keep, false),
        ] {
            let (mut io, mut client) = pair_with(None, mode).await;
            let page = pages::size().unwrap_or(4096);
            let mut storage = vec![0xAAu8; 4 * page];
            client.write_all(b"head").await.expect("client write");
            // Read the head, then poll again with nothing to read: the connection is idle.
            let unfilled_at = {
                let mut buf = ReadBuf::new(&mut storage);
                tokio::time::timeout(Duration::from_secs(5), async {
                    loop {
                        std::future::poll_fn(|cx| {
                            let _ = Pin::new(&mut io).poll_read(cx, &mut buf);
                            Poll::Ready(())
                        })
                        .await;
                        if !buf.filled().is_empty() {
                            break;
                        }
                        tokio::task::yield_now().await;
                    }
                })
                .await
                .expect("the head arrives");
                std::future::poll_fn(|cx| {
                    assert!(Pin::new(&mut io).poll_read(cx, &mut buf).is_pending());
                    Poll::Ready(())
                })
                .await;
                buf.filled().len()
            };
            let start = storage.as_ptr() as usize + unfilled_at;
            let (first, len) =
                whole_pages(start, storage.len() - unfilled_at, page).expect("whole pages");
            let at = first - storage.as_ptr() as usize;
            let page_bytes = &storage[at..at + len];
            assert_eq!(
                page_bytes.iter().all(|b| *b == 0),
                zeroed && cfg!(target_os = "linux"),
                "{mode:?}"
            );
            assert!(zeroed || page_bytes.iter().all(|b| *b == 0xAA), "{mode:?}");
        }
    }

    /// A `serve` of its own: `/` answers `hello`; `/hold` reports its start on `started`, waits
    /// for `release`, and reports on `dropped` when its future is dropped (answered or not).
    struct Served {
        addr: std::net::SocketAddr,
        shutdown: CancellationToken,
        done: tokio::task::JoinHandle<()>,
        started: tokio::sync::mpsc::Receiver<()>,
        dropped: tokio::sync::mpsc::Receiver<()>,
        release: std::sync::Arc<tokio::sync::Notify>,
    }

    /// Sends on its channel when dropped.
    struct DropSignal(tokio::sync::mpsc::Sender<()>);

    impl Drop for DropSignal {
        fn drop(&mut self) {
            let _ = self.0.try_send(());
        }
    }

    async fn served(limits: ConnLimits) -> Served {
        use axum::routing::get;
        let (started_tx, started) = tokio::sync::mpsc::channel(8);
        let (dropped_tx, dropped) = tokio::sync::mpsc::channel(8);
        let release = std::sync::Arc::new(tokio::sync::Notify::new());
        let notify = release.clone();
        let app = axum::Router::new()
            .route("/", get(|| async { "hello" }))
            .route(
                "/stream",
                get(|| async {
                    let chunks = ["a", "", "bc"].map(Ok::<_, std::convert::Infallible>);
                    Body::from_stream(futures::stream::iter(chunks))
                }),
            )
            .route(
                "/hold",
                get(move || {
                    let (started, dropped, release) =
                        (started_tx.clone(), dropped_tx.clone(), notify.clone());
                    async move {
                        let _signal = DropSignal(dropped);
                        let _ = started.send(()).await;
                        release.notified().await;
                        "held"
                    }
                }),
            );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let shutdown = CancellationToken::new();
        let done = tokio::spawn(serve(listener, app, limits, shutdown.clone()));
        Served {
            addr,
            shutdown,
            done,
            started,
            dropped,
            release,
        }
    }

    /// A client connection to `addr` that has sent `sent`.
    async fn client(addr: std::net::SocketAddr, sent: &[u8]) -> tokio::io::BufReader<TcpStream> {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(sent).await.expect("write");
        tokio::io::BufReader::new(stream)
    }

    /// Reads one response head (status line and headers, lowercased).
    async fn head_of<R: tokio::io::AsyncBufRead + Unpin>(reader: &mut R) -> String {
        use tokio::io::AsyncBufReadExt;
        let mut head = String::new();
        loop {
            let mut line = String::new();
            let n = tokio::time::timeout(Duration::from_secs(10), reader.read_line(&mut line))
                .await
                .expect("a response in time")
                .expect("read");
            assert!(n > 0, "the connection closed mid-head: {head:?}");
            if line == "\r\n" {
                return head;
            }
            head.push_str(&line.to_ascii_lowercase());
        }
    }

    /// Reads one response: its head ([`head_of`]) and its body (`content-length` bytes).
    async fn response<R: tokio::io::AsyncBufRead + Unpin>(reader: &mut R) -> (String, String) {
        let head = head_of(reader).await;
        let len = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length:"))
            .map_or(0, |value| value.trim().parse().expect("a length"));
        let mut body = vec![0u8; len];
        reader.read_exact(&mut body).await.expect("body");
        (head, String::from_utf8(body).expect("utf-8"))
    }

    /// Whether the peer closed `reader`'s connection (EOF within 10 s).
    async fn closed<R: tokio::io::AsyncRead + Unpin>(reader: &mut R) -> bool {
        let mut byte = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(10), reader.read(&mut byte)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    /// Plain `GET`s on one kept-alive connection, one at a time and pipelined, each answered
    /// in order with `content-length` and `date`.
    #[tokio::test]
    async fn plain_gets_are_answered_in_order_on_a_kept_alive_connection() {
        let srv = served(ConnLimits::default()).await;
        let mut reader = client(srv.addr, b"").await;
        for _ in 0..2 {
            reader
                .get_mut()
                .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .expect("write");
            let (head, body) = response(&mut reader).await;
            assert!(head.starts_with("http/1.1 200 ok\r\n"), "{head}");
            assert!(head.contains("content-length: 5\r\n"), "{head}");
            assert!(head.contains("\r\ndate: "), "{head}");
            assert!(!head.contains("connection: close"), "{head}");
            assert_eq!(body, "hello");
        }
        reader
            .get_mut()
            .write_all(b"GET / HTTP/1.1\r\n\r\nGET /nowhere HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n")
            .await
            .expect("write");
        let statuses = [
            response(&mut reader).await.0,
            response(&mut reader).await.0,
            response(&mut reader).await.0,
        ];
        assert!(statuses[0].starts_with("http/1.1 200"), "{statuses:?}");
        assert!(statuses[1].starts_with("http/1.1 404"), "{statuses:?}");
        assert!(statuses[2].starts_with("http/1.1 200"), "{statuses:?}");
    }

    /// A body of unknown length goes out chunked, and the connection stays usable after it.
    #[tokio::test]
    async fn a_body_of_unknown_length_is_sent_chunked() {
        use tokio::io::AsyncBufReadExt;
        let srv = served(ConnLimits::default()).await;
        let mut reader = client(
            srv.addr,
            b"GET /stream HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n",
        )
        .await;
        let head = head_of(&mut reader).await;
        assert!(head.contains("transfer-encoding: chunked\r\n"), "{head}");
        assert!(!head.contains("content-length"), "{head}");
        let mut body = Vec::new();
        loop {
            let mut size = String::new();
            reader.read_line(&mut size).await.expect("size line");
            let size = usize::from_str_radix(size.trim_end(), 16).expect("hex size");
            let mut chunk = vec![0u8; size + 2];
            reader.read_exact(&mut chunk).await.expect("chunk");
            assert_eq!(&chunk[size..], b"\r\n");
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
        assert_eq!(body, b"abc");
        assert_eq!(response(&mut reader).await.1, "hello");
    }

    /// A request that is not a plain `GET` (here `HEAD`, then a head split over two reads)
    /// hands the connection to hyper with the bytes already read, and hyper answers it and the
    /// requests after it.
    #[tokio::test]
    async fn other_requests_are_answered_by_hyper_with_the_bytes_already_read() {
        let srv = served(ConnLimits::default()).await;
        let mut reader = client(
            srv.addr,
            b"GET / HTTP/1.1\r\n\r\nHEAD / HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n",
        )
        .await;
        assert_eq!(response(&mut reader).await.1, "hello");
        // HEAD: hyper's answer carries the length but no body.
        let head = head_of(&mut reader).await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert_eq!(
            response(&mut reader).await.1,
            "hello",
            "no HEAD body in between"
        );

        let mut reader = client(srv.addr, b"GET / HT").await;
        reader.get_mut().flush().await.expect("flush");
        // The first part is read alone when the server is faster than this gap; either way the
        // answer is the same.
        tokio::time::sleep(Duration::from_millis(50)).await;
        reader
            .get_mut()
            .write_all(b"TP/1.1\r\n\r\n")
            .await
            .expect("write");
        assert_eq!(response(&mut reader).await.1, "hello");
    }

    /// A client that closes its connection while its `GET` is held ends the request: its future
    /// (the hold) is dropped at once, not when it would have been answered.
    #[tokio::test]
    async fn a_client_that_leaves_during_a_held_get_drops_its_request() {
        let mut srv = served(ConnLimits::default()).await;
        let mut stream = TcpStream::connect(srv.addr).await.expect("connect");
        stream
            .write_all(b"GET /hold HTTP/1.1\r\n\r\n")
            .await
            .expect("write");
        srv.started.recv().await.expect("the hold started");
        assert!(srv.dropped.try_recv().is_err(), "still held");
        drop(stream);
        tokio::time::timeout(Duration::from_secs(10), srv.dropped.recv())
            .await
            .expect("the hold is dropped when its client leaves")
            .expect("signal");
    }

    /// On shutdown an idle connection is closed, and a request in flight is answered with
    /// `connection: close` before its connection closes; `serve` then returns.
    #[tokio::test]
    async fn shutdown_answers_the_request_in_flight_then_closes_every_connection() {
        let mut srv = served(ConnLimits::default()).await;
        let mut idle = client(srv.addr, b"GET / HTTP/1.1\r\n\r\n").await;
        assert_eq!(response(&mut idle).await.1, "hello");
        let mut held = client(srv.addr, b"GET /hold HTTP/1.1\r\n\r\n").await;
        srv.started.recv().await.expect("the hold started");
        srv.shutdown.cancel();
        assert!(closed(&mut idle).await, "the idle connection closes");
        srv.release.notify_waiters();
        let (head, body) = response(&mut held).await;
        assert_eq!(body, "held");
        assert!(head.contains("connection: close\r\n"), "{head}");
        assert!(closed(&mut held).await, "then the connection closes");
        tokio::time::timeout(Duration::from_secs(10), srv.done)
            .await
            .expect("serve returns")
            .expect("no panic");
    }

    /// A connection that sends no request head within `header_read_timeout` is closed, on a
    /// fresh connection and after an answered request alike.
    #[tokio::test]
    async fn an_idle_connection_is_closed_after_the_header_read_timeout() {
        let srv = served(ConnLimits {
            header_read_timeout_ms: 200,
            ..ConnLimits::default()
        })
        .await;
        let mut fresh = client(srv.addr, b"").await;
        assert!(closed(&mut fresh).await, "a fresh idle connection closes");
        let mut used = client(srv.addr, b"GET / HTTP/1.1\r\n\r\n").await;
        assert_eq!(response(&mut used).await.1, "hello");
        assert!(
            closed(&mut used).await,
            "a kept-alive idle connection closes"
        );
    }
}
