//! Wiring: configuration → store, change source, router, feeds → HTTP server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::auth::Authenticator;
use crate::changes::source::RedisChangeSource;
use crate::changes::ChangeSource;
use crate::cli::ServeArgs;
use crate::config::Config;
use crate::feeds::Feeds;
use crate::http::{app, AppState};
use crate::protocol::handle::HandleKey;
use crate::router::{Gate, Router};
use crate::store::{EnvStore, PgStore, ReplicaProbe, RunStore};

/// A running server (tests start it in-process on port 0).
pub struct Running {
    /// The bound address.
    pub addr: SocketAddr,
    pub router: Router,
    pub store: Arc<PgStore>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops accepting, gives in-flight polls the grace period, and waits for the server task.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
    }
}

/// Builds everything from `config` and starts serving on `config.server.listen`.
/// Errors: an unparsable database URL, Redis unreachable at start, the address in use.
pub async fn start(config: Config) -> anyhow::Result<Running> {
    let db = &config.database;
    let store = Arc::new(
        PgStore::connect_lazy_with(
            &db.url,
            db.replica_url.as_deref(),
            db.max_connections,
            db.statement_timeout_ms,
            db.run_reads_from_primary,
        )
        .context("database configuration")?,
    );
    let (tx, rx) = mpsc::unbounded_channel();
    let source: Arc<dyn ChangeSource> =
        Arc::new(RedisChangeSource::connect(&config.redis.url, tx).await.context("connecting the Redis change source")?);
    // Read-your-writes gate: only when hydrates read a distinct replica (reference
    // REPLICA_LAG_GATE_ENABLED, disabled by RUN_READS_FROM_PRIMARY).
    let gate = (config.replica_lag.gate_enabled && !db.run_reads_from_primary && store.has_distinct_replica())
        .then(|| Arc::new(Gate::new(store.clone() as Arc<dyn ReplicaProbe>, config.replica_lag.clone())));
    let router = Router::start_with_gate(config.router.clone(), source, store.clone() as Arc<dyn RunStore>, rx, gate);
    let handles = match &config.server.handle_secret {
        Some(secret) if !secret.is_empty() => HandleKey::new(secret.as_bytes()),
        _ => {
            tracing::warn!("server.handle_secret is not set: handles are signed with a random per-process secret (clients re-snapshot after a restart; set it for fleets)");
            HandleKey::random()
        }
    };
    let feeds = Arc::new(Feeds::new(
        config.feeds.clone(),
        &config.caches,
        store.clone() as Arc<dyn RunStore>,
        router.clone(),
        handles,
    ));
    let auth = Arc::new(Authenticator::new(
        store.clone() as Arc<dyn EnvStore>,
        Duration::from_millis(config.caches.lookup_cache_ttl_ms),
    ));
    let state = AppState { feeds: feeds.clone(), auth, max_created_at_age_ms: config.feeds.maximum_created_at_filter_age_ms };
    let listener = TcpListener::bind(&config.server.listen)
        .await
        .with_context(|| format!("binding {}", config.server.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let (shutdown_tx, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
    let grace = Duration::from_millis(config.server.shutdown_grace_ms);
    let service = app(state).into_make_service();
    let task = tokio::spawn(async move {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let server = axum::serve(listener, service).with_graceful_shutdown(async move {
            let _ = shutdown_rx.await;
            // Held polls answer up-to-date at once; the server then finishes in-flight responses.
            feeds.drain();
            let _ = stop_tx.send(true);
        });
        let mut stop_rx = stop_rx;
        tokio::select! {
            result = server => {
                if let Err(err) = result {
                    tracing::error!(error = %err, "server stopped with an error");
                }
            }
            _ = async {
                // Held long-polls would keep a graceful shutdown waiting for ~20 s: cut them
                // off after the grace period (clients retry).
                let _ = stop_rx.wait_for(|stopped| *stopped).await;
                tokio::time::sleep(grace).await;
            } => tracing::info!("shutdown grace period over; closing held polls"),
        }
    });
    Ok(Running { addr, router, store, shutdown: Some(shutdown_tx), task })
}

/// `runfeed serve`: loads the configuration (file ← env ← flags), serves until SIGINT/SIGTERM.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = Config::load(args.config.as_deref())?;
    if let Some(listen) = args.listen {
        config.server.listen = listen;
    }
    if let Some(url) = args.database_url {
        config.database.url = url;
    }
    if let Some(url) = args.replica_url {
        config.database.replica_url = Some(url);
    }
    if let Some(url) = args.redis_url {
        config.redis.url = url;
    }
    if args.run_reads_from_primary {
        config.database.run_reads_from_primary = true;
    }
    config.validate()?;
    let running = start(config).await?;
    // The one stdout line scripts and tests wait for.
    println!("runfeed listening on http://{}", running.addr);
    tracing::info!(addr = %running.addr, "runfeed serving");
    shutdown_signal().await;
    tracing::info!("shutting down");
    running.stop().await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
