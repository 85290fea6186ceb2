//! The admin listener: `/metrics` (Prometheus text exposition of the server's meter provider),
//! `/healthz` (the process is alive) and `/readyz` (Postgres and Redis reachable). On its own
//! address (`telemetry.admin_listen`) so it never shares the public port.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Json;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A readiness check: `Ok` when the dependency answers (with how it serves), `Err(reason)`
/// otherwise.
pub type Check =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<Health, String>> + Send>> + Send + Sync>;

/// What a passing readiness check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// The dependency answers and serves as configured (`"ok"` in the body).
    Ok,
    /// The dependency answers, but runfeed works around it and requests are still served:
    /// `/readyz` stays 200, its status is `"degraded"` and the check's entry is this reason.
    Degraded(String),
}

/// Each `/readyz` check is bounded by this.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone)]
struct AdminState {
    registry: prometheus::Registry,
    checks: Arc<Vec<(&'static str, Check)>>,
}

/// A running admin listener.
#[derive(Debug)]
pub struct Admin {
    /// The bound address.
    pub addr: SocketAddr,
}

impl Admin {
    /// Binds `listen` and serves `registry` and the readiness `checks` (named, e.g.
    /// `"postgres"`) on a task of `tasks` until `shutdown` is cancelled.
    ///
    /// Errors: the address does not parse or is in use.
    pub async fn start(
        listen: &str,
        registry: prometheus::Registry,
        checks: Vec<(&'static str, Check)>,
        shutdown: CancellationToken,
        tasks: &TaskTracker,
    ) -> anyhow::Result<Admin> {
        let listener = TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding the admin listener {listen}"))?;
        let addr = listener.local_addr().context("reading the admin address")?;
        let router = router(AdminState {
            registry,
            checks: Arc::new(checks),
        });
        tasks.spawn(async move {
            let served = axum::serve(listener, router)
                .with_graceful_shutdown(async move { shutdown.cancelled().await });
            if let Err(err) = served.await {
                tracing::error!(error = %err, "admin listener stopped with an error");
            }
        });
        Ok(Admin { addr })
    }
}

fn router(state: AdminState) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/readyz", get(readyz))
        .with_state(state)
        // The request span and the 5xx log, as on the feed listener.
        .layer(super::http::trace_layer(admin_route))
}

/// The `route` of an admin request path.
fn admin_route(path: &str) -> &'static str {
    match path {
        "/metrics" => "/metrics",
        "/healthz" => "/healthz",
        "/readyz" => "/readyz",
        _ => super::http::UNMATCHED,
    }
}

async fn metrics(State(state): State<AdminState>) -> Response {
    match super::encode_prometheus(&state.registry) {
        Ok(text) => ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], text).into_response(),
        Err(err) => {
            tracing::error!(error = %err, "encoding metrics failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "encoding metrics failed\n",
            )
                .into_response()
        }
    }
}

/// 200 `{"status":"ready","checks":{…:"ok"}}` when every check passes, 200 with status
/// `"degraded"` when some only pass degraded (their entries give the reason), else 503 with
/// status `"not ready"` and the failing checks' reasons.
async fn readyz(State(state): State<AdminState>) -> Response {
    let results = futures::future::join_all(state.checks.iter().map(|(name, check)| async move {
        let result = match tokio::time::timeout(CHECK_TIMEOUT, check()).await {
            Ok(result) => result,
            Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
        };
        (*name, result)
    }))
    .await;
    let (status, body) = verdict(results);
    (status, Json(body)).into_response()
}

/// The `/readyz` status and body for the checks' `results`.
fn verdict(
    results: Vec<(&'static str, Result<Health, String>)>,
) -> (StatusCode, serde_json::Value) {
    let ready = results.iter().all(|(_, r)| r.is_ok());
    let degraded = results
        .iter()
        .any(|(_, r)| matches!(r, Ok(Health::Degraded(_))));
    let checks: serde_json::Map<String, serde_json::Value> = results
        .into_iter()
        .map(|(name, r)| {
            let text = match r {
                Ok(Health::Ok) => "ok".to_string(),
                Ok(Health::Degraded(reason)) | Err(reason) => reason,
            };
            (name.to_string(), json!(text))
        })
        .collect();
    let (status, word) = match (ready, degraded) {
        (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "not ready"),
        (true, true) => (StatusCode::OK, "degraded"),
        (true, false) => (StatusCode::OK, "ready"),
    };
    (status, json!({"status": word, "checks": checks}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(result: Result<Health, String>) -> Check {
        Arc::new(move || {
            let result = result.clone();
            Box::pin(async move { result })
        })
    }

    #[test]
    fn a_degraded_check_keeps_readyz_200_and_names_its_reason() {
        let (status, body) = verdict(vec![
            ("postgres", Ok(Health::Ok)),
            ("postgres_replica", Ok(Health::Degraded("bypassed".into()))),
        ]);
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            body,
            json!({"status": "degraded", "checks": {"postgres": "ok", "postgres_replica": "bypassed"}})
        );
        let (status, body) = verdict(vec![("postgres", Ok(Health::Ok))]);
        assert_eq!((status, &body["status"]), (StatusCode::OK, &json!("ready")));
    }

    #[tokio::test]
    async fn readyz_reports_each_check() {
        let (shutdown, tasks) = (CancellationToken::new(), TaskTracker::new());
        let admin = Admin::start(
            "127.0.0.1:0",
            prometheus::Registry::new(),
            vec![
                ("postgres", check(Ok(Health::Ok))),
                (
                    "postgres_replica",
                    check(Ok(Health::Degraded("bypassed".into()))),
                ),
                ("redis", check(Err("down".into()))),
            ],
            shutdown.clone(),
            &tasks,
        )
        .await
        .expect("admin");
        let addr = admin.addr;
        let get = |path: &'static str| async move {
            let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let (mut r, mut w) = stream.into_split();
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            w.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .expect("write");
            let mut out = String::new();
            r.read_to_string(&mut out).await.expect("read");
            out
        };
        let ready = get("/readyz").await;
        assert!(ready.starts_with("HTTP/1.0 503"), "{ready}");
        assert!(
            ready.contains(r#""redis":"down""#)
                && ready.contains(r#""postgres":"ok""#)
                && ready.contains(r#""postgres_replica":"bypassed""#),
            "{ready}"
        );
        assert!(get("/healthz").await.starts_with("HTTP/1.0 200"));
        let metrics = get("/metrics").await;
        assert!(
            metrics.starts_with("HTTP/1.0 200") && metrics.contains("text/plain"),
            "{metrics}"
        );
        shutdown.cancel();
        tasks.close();
        tokio::time::timeout(std::time::Duration::from_secs(5), tasks.wait())
            .await
            .expect("the admin listener stops when the token is cancelled");
    }
}
