//! Wiring: configuration → Postgres store, Redis, router, feeds, HTTP server, admin listener,
//! metrics. The one place that knows every part; nothing below imports it.
//!
//! Shutdown is one [`CancellationToken`] passed down to whatever must react (the accept loop, the
//! held polls, the admin listener) and one [`TaskTracker`] holding the tasks it stops;
//! [`Running::stop`] cancels and awaits them in one place.

pub mod observe;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::Authenticator;
use crate::changes::ChangeSource;
use crate::config::Config;
use crate::feeds::admit::{Limiter, LimiterConfig};
use crate::feeds::Feeds;
use crate::http::forward::{ForwardTimeouts, Forwarder};
use crate::http::{app, AppState};
use crate::protocol::handle::HandleKey;
use crate::redis::{Redis, RedisChangeSource, RedisOptions, SubscriberSettings};
use crate::router::{Gate, Router, RouterParts};
use crate::store::{EnvStore, PgStore, ReplicaProbe, RunStore};
use crate::telemetry::admin::{Admin, Check, Health};
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
    shutdown: CancellationToken,
    tasks: TaskTracker,
}

impl Running {
    /// Stops accepting, answers held polls at once, gives in-flight responses the grace period
    /// (`server.shutdown_grace_ms`), and waits for the server and admin tasks.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        // Final OTLP export, if this was the last handle on the pipeline.
        if let Ok(telemetry) = Arc::try_unwrap(self.telemetry) {
            telemetry.shutdown().await;
        }
    }
}

/// Builds everything from `config` and starts serving on `config.server.listen`.
///
/// Errors: an unparsable database URL, a Redis configuration fred refuses, the address in use.
pub async fn start(config: Config) -> anyhow::Result<Running> {
    // Refused here too, not only when loaded: e.g. a hold the 1.5 client's watchdog would abort.
    config.validate()?;
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
    let redis = Redis::connect(RedisOptions::from(&config.redis)).context("redis")?;
    let (tx, rx) = crate::changes::event_channel();
    let redis_source = Arc::new(
        redis
            .change_source(tx, SubscriberSettings::default())
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
    store.set_metrics(telemetry.metrics().clone());
    let router = Router::start(RouterParts {
        cfg: config.router.clone(),
        source,
        store: store.clone() as Arc<dyn RunStore>,
        events: rx,
        gate,
        metrics: telemetry.metrics().clone(),
    });
    let handles = match &config.server.handle_secret {
        Some(secret) if !secret.is_empty() => HandleKey::new(secret.as_bytes()),
        _ => {
            tracing::warn!("server.handle_secret is not set: handles are signed with a random per-process secret (clients re-snapshot after a restart; set it for fleets)");
            HandleKey::random()
        }
    };
    let shutdown = CancellationToken::new();
    let tasks = TaskTracker::new();
    let mut feeds = Feeds::new(
        config.feeds.clone(),
        &config.caches,
        store.clone() as Arc<dyn RunStore>,
        router.clone(),
        handles,
    )
    .with_metrics(telemetry.metrics().clone())
    .with_shutdown(shutdown.clone());
    if config.router.shared_replay_cursors {
        feeds = feeds.with_cursor_store(redis.cursor_store(config.caches.working_set_ttl_ms));
    }
    let feeds = Arc::new(feeds);
    let auth = Arc::new(Authenticator::with_found_env_ttl(
        store.clone() as Arc<dyn EnvStore>,
        Duration::from_millis(config.caches.lookup_cache_ttl_ms),
        Duration::from_millis(config.caches.public_token_env_ttl_ms),
    ));
    let limiter = Arc::new(Limiter::new(
        Some(redis.concurrency()),
        LimiterConfig::of(&config.feeds),
    ));
    tasks.spawn(limiter.clone().maintain(shutdown.clone()));
    tasks.spawn(store.clone().watch_replica(shutdown.clone()));
    let state = AppState {
        feeds: feeds.clone(),
        auth,
        limiter,
        max_created_at_age_ms: config.feeds.maximum_created_at_filter_age_ms,
        limits: crate::http::RequestLimits::of(&config),
        forwarder: match &config.auth.run_token_upstream {
            Some(upstream) => Some(Arc::new(
                Forwarder::new(
                    upstream,
                    ForwardTimeouts::default(),
                    telemetry.metrics().clone(),
                )
                .context("auth.run_token_upstream")?,
            )),
            None => None,
        },
    };
    observe::register(
        telemetry.metrics(),
        observe::Sources {
            router: router.clone(),
            feeds: Arc::downgrade(&feeds),
            store: Arc::downgrade(&store),
            source: Arc::downgrade(&redis_source),
            limiter: Arc::downgrade(&state.limiter),
            redis_commands: redis.command_counts().clone(),
        },
    );
    let admin_addr = match config.telemetry.admin_listen.as_str() {
        "" => None,
        listen => Some(
            Admin::start(
                listen,
                telemetry.registry().clone(),
                readiness_checks(&store, &redis_source),
                shutdown.clone(),
                &tasks,
            )
            .await?
            .addr,
        ),
    };
    let listener = crate::http::serve::bind(
        &config.server.listen,
        config.server.socket_send_buffer_bytes,
    )
    .await
    .with_context(|| format!("binding {}", config.server.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let service = crate::telemetry::http::instrument(
        app(state),
        telemetry.metrics().clone(),
        crate::http::route_of,
    );
    let limits = crate::http::serve::ConnLimits::of(&config);
    tasks.spawn(crate::http::serve::serve(
        listener,
        service,
        limits,
        shutdown.clone(),
    ));
    Ok(Running {
        addr,
        router,
        store,
        admin_addr,
        telemetry,
        shutdown,
        tasks,
    })
}

/// `/readyz`: the Postgres primary (`postgres`) and, when distinct, the replica
/// (`postgres_replica`) answer, the Redis subscriber is connected (`redis`), and the
/// database role may read what runfeed reads (`grants`, [`crate::store::grants`]). Each failing
/// check names its dependency in the body (docs/faults.md). A replica out of recovery (promoted)
/// is degraded, not failing: reads go to the primary and still work.
fn readiness_checks(
    store: &Arc<PgStore>,
    source: &Arc<RedisChangeSource>,
) -> Vec<(&'static str, Check)> {
    let postgres = store_check(store, |store| async move {
        store.ping_primary().await.map_err(|e| e.to_string())?;
        Ok(Health::Ok)
    });
    let replica = store.has_distinct_replica().then(|| {
        store_check(store, |store| async move {
            match store.check_replica().await.map_err(|e| e.to_string())? {
                Some(status) if !status.in_recovery => Ok(Health::Degraded(
                    "not in recovery (promoted): reads go to the primary".into(),
                )),
                _ => Ok(Health::Ok),
            }
        })
    });
    let grants = store_check(store, |store| async move {
        crate::store::grants::check(&store)
            .await
            .map_err(|e| e.to_string())?;
        Ok(Health::Ok)
    });
    let source = Arc::downgrade(source);
    let redis: Check = Arc::new(move || {
        let connected = source.upgrade().is_some_and(|s| s.is_connected());
        Box::pin(async move {
            if connected {
                Ok(Health::Ok)
            } else {
                Err("subscriber not connected".into())
            }
        })
    });
    let mut checks = vec![("postgres", postgres)];
    checks.extend(replica.map(|check| ("postgres_replica", check)));
    checks.extend([("redis", redis), ("grants", grants)]);
    checks
}

/// A readiness check that runs `check` on the store while the server lives ("stopped" after).
fn store_check<F, Fut>(store: &Arc<PgStore>, check: F) -> Check
where
    F: Fn(Arc<PgStore>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Health, String>> + Send + 'static,
{
    let store = Arc::downgrade(store);
    let check = Arc::new(check);
    Arc::new(move || {
        let store = store.upgrade();
        let check = check.clone();
        Box::pin(async move {
            match store {
                Some(store) => check(store).await,
                None => Err("stopped".into()),
            }
        })
    })
}

/// `runfeed serve`: serves `config` until SIGINT/SIGTERM, then drains gracefully.
///
/// Errors: as [`start`].
pub async fn serve(config: Config) -> anyhow::Result<()> {
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

/// Resolves on SIGINT or SIGTERM.
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
