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
use crate::feeds::cursors::CursorStore;
use crate::feeds::limit::Limiter;
use crate::feeds::Feeds;
use crate::http::{app, AppState};
use crate::protocol::handle::HandleKey;
use crate::router::{Gate, Router};
use crate::store::{EnvStore, PgStore, ReplicaProbe, RunStore};
use crate::telemetry::admin::{Admin, Check};
use crate::telemetry::metrics::Sources;
use crate::telemetry::Telemetry;

/// A running server (tests start it in-process on port 0).
pub struct Running {
    /// The bound address.
    pub addr: SocketAddr,
    pub router: Router,
    pub store: Arc<PgStore>,
    /// The admin listener's address (`/metrics`, `/healthz`, `/readyz`); `None` when
    /// `telemetry.admin_listen` is empty.
    pub admin_addr: Option<SocketAddr>,
    /// The metrics pipeline (instruments and the Prometheus registry).
    pub telemetry: Arc<Telemetry>,
    admin: Option<Admin>,
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
        if let Some(admin) = self.admin.take() {
            admin.stop().await;
        }
        // Final OTLP export, if this was the last handle on the pipeline.
        if let Ok(telemetry) = Arc::try_unwrap(self.telemetry) {
            telemetry.shutdown().await;
        }
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
    crate::store::grants::check_at_startup(&store).await?;
    let telemetry = Arc::new(Telemetry::new(&config.telemetry).context("telemetry")?);
    let (tx, rx) = mpsc::unbounded_channel();
    let redis_source = Arc::new(
        RedisChangeSource::connect_with(&(&config.redis).into(), tx)
            .await
            .context("connecting the Redis change source")?,
    );
    let source: Arc<dyn ChangeSource> = redis_source.clone();
    // Read-your-writes gate: only when hydrates read a distinct replica (reference
    // REPLICA_LAG_GATE_ENABLED, disabled by RUN_READS_FROM_PRIMARY).
    let gate = (config.replica_lag.gate_enabled
        && !db.run_reads_from_primary
        && store.has_distinct_replica())
    .then(|| {
        Arc::new(Gate::new(
            store.clone() as Arc<dyn ReplicaProbe>,
            config.replica_lag.clone(),
        ))
    });
    let router = Router::start_with_gate(
        config.router.clone(),
        source,
        store.clone() as Arc<dyn RunStore>,
        rx,
        gate,
    );
    let handles = match &config.server.handle_secret {
        Some(secret) if !secret.is_empty() => HandleKey::new(secret.as_bytes()),
        _ => {
            tracing::warn!("server.handle_secret is not set: handles are signed with a random per-process secret (clients re-snapshot after a restart; set it for fleets)");
            HandleKey::random()
        }
    };
    let kv = kv_client(&(&config.redis).into()).context("building the key/value Redis client")?;
    let mut feeds = Feeds::new(
        config.feeds.clone(),
        &config.caches,
        store.clone() as Arc<dyn RunStore>,
        router.clone(),
        handles,
    )
    .with_metrics(telemetry.metrics().clone());
    if config.router.shared_replay_cursors {
        feeds = feeds.with_cursor_store(CursorStore::new(
            kv.clone(),
            config.caches.working_set_ttl_ms,
        ));
    }
    let feeds = Arc::new(feeds);
    let auth = Arc::new(Authenticator::with_found_env_ttl(
        store.clone() as Arc<dyn EnvStore>,
        Duration::from_millis(config.caches.lookup_cache_ttl_ms),
        Duration::from_millis(config.caches.public_token_env_ttl_ms),
    ));
    let limiter = Arc::new(Limiter::new(
        Some(kv),
        config.feeds.default_concurrency_limit,
        config
            .feeds
            .concurrency_limit_overrides
            .clone()
            .into_iter()
            .collect(),
    ));
    let state = AppState {
        feeds: feeds.clone(),
        auth,
        limiter,
        max_created_at_age_ms: config.feeds.maximum_created_at_filter_age_ms,
        limits: crate::http::RequestLimits::of(&config),
    };
    telemetry.metrics().observe(Sources {
        router: router.clone(),
        feeds: Arc::downgrade(&feeds),
        store: Arc::downgrade(&store),
        source: Arc::downgrade(&redis_source),
        limiter: Arc::downgrade(&state.limiter),
    });
    let admin = match config.telemetry.admin_listen.as_str() {
        "" => None,
        listen => Some(
            Admin::start(
                listen,
                telemetry.registry().clone(),
                readiness_checks(&store, &redis_source),
            )
            .await?,
        ),
    };
    let admin_addr = admin.as_ref().map(|a| a.addr);
    let listener = TcpListener::bind(&config.server.listen)
        .await
        .with_context(|| format!("binding {}", config.server.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let (shutdown_tx, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
    let grace = Duration::from_millis(config.server.shutdown_grace_ms);
    let service = crate::telemetry::http::instrument(app(state), telemetry.metrics().clone());
    let limits = crate::http::serve::ConnLimits::of(&config);
    let task = tokio::spawn(async move {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let server = crate::http::serve::serve(listener, service, limits, async move {
            let _ = shutdown_rx.await;
            // Held polls answer up-to-date at once; connections then finish their in-flight
            // responses and close.
            feeds.drain();
            let _ = stop_tx.send(true);
        });
        let mut stop_rx = stop_rx;
        tokio::select! {
            () = server => {}
            _ = async {
                // A response a client does not read would keep the drain waiting: cut the
                // remaining connections off after the grace period (clients retry).
                let _ = stop_rx.wait_for(|stopped| *stopped).await;
                tokio::time::sleep(grace).await;
            } => tracing::info!("shutdown grace period over; closing the remaining connections"),
        }
    });
    Ok(Running {
        addr,
        router,
        store,
        admin_addr,
        telemetry,
        admin,
        shutdown: Some(shutdown_tx),
        task,
    })
}

/// `/readyz`: Postgres answers `SELECT 1` (both pools), the Redis subscriber is connected, and
/// the database role may read what runfeed reads (`store::grants`).
fn readiness_checks(
    store: &Arc<PgStore>,
    source: &Arc<RedisChangeSource>,
) -> Vec<(&'static str, Check)> {
    let grants = crate::store::grants::readiness_check(store);
    let store = Arc::downgrade(store);
    let source = Arc::downgrade(source);
    let postgres: Check = Arc::new(move || {
        let store = store.clone();
        Box::pin(async move {
            match store.upgrade() {
                Some(store) => store.ping().await.map_err(|e| e.to_string()),
                None => Err("stopped".into()),
            }
        })
    });
    let redis: Check = Arc::new(move || {
        let connected = source.upgrade().is_some_and(|s| s.is_connected());
        Box::pin(async move {
            if connected {
                Ok(())
            } else {
                Err("subscriber not connected".into())
            }
        })
    });
    vec![("postgres", postgres), ("redis", redis), ("grants", grants)]
}

/// A Redis client for small key/value work (limiter, shared cursors): connects in the
/// background and keeps reconnecting; callers bound every command with their own deadline.
fn kv_client(options: &crate::changes::RedisOptions) -> anyhow::Result<fred::clients::Client> {
    use fred::interfaces::ClientLike;
    let mut config = options.fred_config().map_err(|e| anyhow::anyhow!(e))?;
    config.fail_fast = false;
    let client = fred::types::Builder::from_config(config)
        .set_policy(fred::prelude::ReconnectPolicy::new_exponential(
            0, 100, 2_000, 2,
        ))
        .with_connection_config(|conn| conn.max_command_attempts = 1)
        .build()?;
    let _connection = client.connect();
    Ok(client)
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
    crate::telemetry::init_logging_with(&config.telemetry.log_format);
    let running = start(config).await?;
    if let Some(admin) = running.admin_addr {
        tracing::info!("admin listening on http://{admin} (/metrics, /healthz, /readyz)");
    }
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
