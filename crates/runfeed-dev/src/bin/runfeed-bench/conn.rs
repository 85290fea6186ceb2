//! One kept-alive HTTP/1.1 connection per follower: hyper's client connection driven inside the
//! follower's own task (no pool, no connection task, no checkout per request). A follower
//! polls again the moment a response ends, so its connection never idles long enough for the
//! server's idle keep-alive cut-off (`server.header_read_timeout_ms`).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::{Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpSocket, TcpStream};

use super::*;

type Io = TokioIo<TcpStream>;
/// hyper's half of a connection: the future that does its I/O.
type Driver = Connection<Io, Empty<Bytes>>;
/// The half that sends requests.
type Sender = SendRequest<Empty<Bytes>>;

/// Where a [`Conn`] connects: the server, the `Host` header it is sent, and the source address
/// it binds (`--source-addrs`).
#[derive(Clone, Debug)]
pub(crate) struct Target {
    pub(crate) server: SocketAddr,
    pub(crate) host: String,
    pub(crate) source: IpAddr,
}

impl Target {
    /// The server of `base` (`http://host:port`, resolved once), from source address `source`.
    pub(crate) async fn resolve(base: &str, source: IpAddr) -> anyhow::Result<Target> {
        let host = base
            .strip_prefix("http://")
            .with_context(|| format!("{base}: only http:// base URLs"))?
            .split('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let server = tokio::net::lookup_host(&host)
            .await
            .with_context(|| format!("resolve {host}"))?
            .next()
            .with_context(|| format!("{host}: no address"))?;
        Ok(Target {
            server,
            host,
            source,
        })
    }
}

/// A follower's connection, opened on first use and again after it fails.
pub(crate) struct Conn {
    target: Target,
    open: Option<(Sender, Pin<Box<Driver>>)>,
}

impl Conn {
    pub(crate) fn new(target: Target) -> Conn {
        Conn { target, open: None }
    }

    async fn connect(&self) -> anyhow::Result<(Sender, Driver)> {
        let t = &self.target;
        let socket = if t.server.is_ipv4() {
            TcpSocket::new_v4()
        } else {
            TcpSocket::new_v6()
        }?;
        socket
            .bind(SocketAddr::new(t.source, 0))
            .with_context(|| format!("bind {}", t.source))?;
        let stream = socket
            .connect(t.server)
            .await
            .with_context(|| format!("connect to {}", t.server))?;
        stream.set_nodelay(true)?;
        Ok(hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?)
    }

    /// `GET path?params` with the token; the parsed response. A failed request closes the
    /// connection (the next one opens a new one).
    pub(crate) async fn get(
        &mut self,
        token: &str,
        path: &str,
        params: &[(&str, String)],
    ) -> anyhow::Result<Resp> {
        let result = self.exchange(token, path, params).await;
        if result.is_err() {
            self.open = None;
        }
        result
    }

    async fn exchange(
        &mut self,
        token: &str,
        path: &str,
        params: &[(&str, String)],
    ) -> anyhow::Result<Resp> {
        if self.open.as_ref().is_none_or(|(send, _)| send.is_closed()) {
            let (send, conn) = self.connect().await?;
            self.open = Some((send, Box::pin(conn)));
        }
        let Some((send, conn)) = self.open.as_mut() else {
            bail!("no connection");
        };
        let mut uri = String::with_capacity(path.len() + 128);
        uri.push_str(path);
        for (i, (k, v)) in params.iter().enumerate() {
            uri.push(if i == 0 { '?' } else { '&' });
            uri.push_str(k);
            uri.push('=');
            encode_into(&mut uri, v);
        }
        drive(conn, send.ready())
            .await?
            .context("connection not ready")?;
        let req = hyper::Request::get(uri)
            .header(hyper::header::HOST, &self.target.host)
            .header(hyper::header::AUTHORIZATION, format!("Bearer {token}"))
            .header("x-trigger-electric-version", ELECTRIC_VERSION)
            .body(Empty::<Bytes>::new())?;
        let resp = drive(conn, send.send_request(req))
            .await?
            .context("send request")?;
        let (parts, body) = resp.into_parts();
        let body = drive(conn, body.collect())
            .await?
            .context("read response body")?
            .to_bytes();
        Ok(Resp::parse(parts.status, &parts.headers, &body))
    }
}

/// Runs `f` while driving the connection's I/O in the same task; an error if the connection
/// ends first.
async fn drive<F: Future>(conn: &mut Pin<Box<Driver>>, f: F) -> anyhow::Result<F::Output> {
    tokio::select! {
        biased;
        out = f => Ok(out),
        ended = conn.as_mut() => match ended {
            Ok(()) => bail!("connection closed"),
            Err(e) => Err(anyhow::Error::new(e).context("connection")),
        },
    }
}

/// Percent-encodes a query value (everything but RFC 3986's unreserved characters).
fn encode_into(out: &mut String, v: &str) {
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
}
