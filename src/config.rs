//! One typed configuration: defaults (identical to `config/default.toml`) ← TOML file ←
//! `RUNFEED_<SECTION>__<KEY>` environment variables ← command-line flags.
//!
//! Every tunable of trigger.dev's native realtime backend is a key here with the reference
//! default (docs/behaviours.md §0.2; `REALTIME_BACKEND_NATIVE_<NAME>` → `[section] name`).

use std::path::Path;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `@electric-sql/client` 1.5 aborts a live long-poll after this long, ms (`liveRequestTimeoutMs`,
/// default 45 000, the package's `src/client.ts`); start-up refuses holds that could reach it.
pub const CLIENT_LIVE_REQUEST_TIMEOUT_MS: u64 = 45_000;

/// The whole configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[server]`
    pub server: ServerConfig,
    /// `[auth]`
    pub auth: AuthConfig,
    /// `[database]`
    pub database: DatabaseConfig,
    /// `[redis]`
    pub redis: RedisConfig,
    /// `[feeds]`
    pub feeds: FeedsConfig,
    /// `[router]`
    pub router: RouterConfig,
    /// `[caches]`
    pub caches: CachesConfig,
    /// `[replica_lag]`
    pub replica_lag: ReplicaLagConfig,
    /// `[telemetry]`
    pub telemetry: TelemetryConfig,
}

/// `[server]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Listen address, `host:port` (`--listen`, `RUNFEED_LISTEN`).
    pub listen: String,
    /// Secret that signs shape handles. Set the same value on every instance of a fleet; unset
    /// = a random secret per process (handles then die with the process: clients get a 409
    /// must-refetch and re-snapshot after a restart).
    pub handle_secret: Option<String>,
    /// How long in-flight polls get to finish on shutdown, ms.
    pub shutdown_grace_ms: u64,
    /// Longest accepted request target (path + query), bytes; longer → 414 JSON (8 KiB).
    pub max_url_bytes: usize,
    /// Most request header bytes (names + values) accepted; more → 431 JSON (32 KiB). hyper
    /// itself refuses more than 100 headers, and a head larger than 4 × (`max_url_bytes` +
    /// `max_header_bytes`) (the per-connection buffer cap) with a bare 431.
    pub max_header_bytes: usize,
    /// Time a connection gets to deliver a complete request head, ms, counted from when it
    /// starts waiting for one (so it also closes idle keep-alive connections); slower clients
    /// (slowloris) are disconnected. Held live polls are not affected. 0 disables.
    pub header_read_timeout_ms: u64,
    /// A response write that makes no progress for this long closes the connection, ms (a
    /// client that stops reading cannot pin a response in memory). 0 disables.
    pub write_stall_timeout_ms: u64,
    /// `SO_SNDBUF` of the accepted connections, bytes (Linux doubles it for its own overhead):
    /// the most response bytes the kernel holds for a client that reads nothing, each copied
    /// in by a server thread (with autotuning up to `net.ipv4.tcp_wmem`'s maximum, 4 MiB by
    /// default: docs/faults.md note 1). A reading client still gets about twice this per round
    /// trip (5 MiB/s at 100 ms with 262 144). 0 = the kernel's autotuning.
    pub socket_send_buffer_bytes: usize,
    /// On a connection handed to hyper (an SSE stream, a `HEAD`, `POST` or `OPTIONS`, a
    /// request runfeed's own `GET` path does not take: docs/http-api.md "Connections"), hand
    /// the pages of hyper's 8 KiB read buffer back to the kernel when it goes idle
    /// (`madvise(MADV_DONTNEED)`, once per request): ≈ 4 KiB less memory per held SSE stream,
    /// at a system-CPU price per request (about 10 µs on the VM of BENCHMARKS.md). Polls on
    /// runfeed's own path hold no read buffer, so this does not apply to them.
    /// `false` keeps that page resident: less CPU per request, more memory per held stream.
    pub release_idle_read_buffers: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:3030".into(),
            handle_secret: None,
            shutdown_grace_ms: 2_000,
            max_url_bytes: 8_192,
            max_header_bytes: 32_768,
            header_read_timeout_ms: 10_000,
            write_stall_timeout_ms: 30_000,
            socket_send_buffer_bytes: 262_144,
            release_idle_read_buffers: true,
        }
    }
}

/// `[auth]`: credentials runfeed does not verify itself.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// The webapp's internal URL, `http://host:port` (an optional path prefix is kept), that
    /// feed requests carrying a run token (header `typ: run+jwt`, trigger.dev SDK 4.8's
    /// `TRIGGER_RUN_TOKEN`) are forwarded to, unchanged, on the same feed route; its answer is
    /// streamed back (docs/http-api.md "Run tokens"). Unset = such requests get a JSON 401
    /// naming the token type. Plain HTTP only.
    pub run_token_upstream: Option<String>,
}

/// `[database]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseConfig {
    /// The primary (`--database-url`, `DATABASE_URL`).
    pub url: String,
    /// The read replica (`--replica-url`, `DATABASE_READ_REPLICA_URL`); defaults to the primary.
    pub replica_url: Option<String>,
    /// Hydrate from the primary and skip the replica-lag gate (`--run-reads-from-primary`;
    /// reference `RUN_READS_FROM_PRIMARY`, default off).
    pub run_reads_from_primary: bool,
    /// Connections per pool (the primary's and the replica's each).
    pub max_connections: u32,
    /// Per-query timeout, ms: the server's `statement_timeout` on runfeed's connections, and
    /// runfeed's own bound on each query's answer, this plus 1 000 ms (a frozen server cannot
    /// enforce its timeout; the connection of a query that got no answer in time is closed and
    /// the request gets a 503). 0: the server's setting applies (use 0 behind PgBouncer) and
    /// runfeed waits at most 30 000 ms for an answer.
    pub statement_timeout_ms: u64,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: "postgres://postgres@127.0.0.1:5432/runfeed_demo".into(),
            replica_url: None,
            run_reads_from_primary: false,
            max_connections: 16,
            statement_timeout_ms: 10_000,
        }
    }
}

/// `[redis]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// The Redis carrying change records (`--redis-url`, `REDIS_URL`). With `cluster`, the seed
    /// nodes: `redis-cluster://host:port?node=host2:port2&node=…` or a comma-separated
    /// `redis://host1:port1,host2:port2` (see `redis::RedisOptions`).
    pub url: String,
    /// Connect to a Redis Cluster (reference `PUBSUB_REDIS_CLUSTER_MODE_ENABLED`, default off).
    pub cluster: bool,
    /// In cluster mode, carry records over sharded pub/sub, `SPUBLISH`/`SSUBSCRIBE` (reference
    /// `PUBSUB_REDIS_SHARDED_ENABLED`, default on); ignored without `cluster`.
    pub sharded: bool,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            url: "redis://127.0.0.1:6379".into(),
            cluster: false,
            sharded: true,
        }
    }
}

/// `[feeds]`: the HTTP feeds (reference `LIVE_POLL_*`, `MAX_LIST_RESULTS`, …).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct FeedsConfig {
    /// Live long-poll hold before the backstop re-read, ms (`LIVE_POLL_TIMEOUT_MS`, 20 000).
    pub live_poll_timeout_ms: u64,
    /// Uniform ± jitter ratio on the hold (`LIVE_POLL_JITTER_RATIO`, 0.15 → 17–23 s).
    pub live_poll_jitter_ratio: f64,
    /// Cap on runs in a tag or batch feed (`MAX_LIST_RESULTS`, 1 000).
    pub max_list_results: usize,
    /// A wake that yields no delta keeps holding (`HOLD_ON_EMPTY`, true).
    pub hold_on_empty: bool,
    /// Tag feed `createdAt` lookback ceiling, ms (`REALTIME_MAXIMUM_CREATED_AT_FILTER_AGE_IN_MS`, 24 h).
    pub maximum_created_at_filter_age_ms: u64,
    /// The `createdAt` floor is rounded down to this bucket, ms; 0 = exact (`RUNSET_CREATED_AT_BUCKET_MS`, 60 000).
    pub runset_created_at_bucket_ms: u64,
    /// Concurrent cold resolves (run, tag and batch feeds) per instance; 0 = unbounded (`RESOLVE_ADMISSION_LIMIT`, 16).
    pub resolve_admission_limit: usize,
    /// Of those, the most one environment's tag resolves may hold at once (2); 0 =
    /// no per-environment share. One environment's stampede then leaves the rest of the gate to
    /// other environments and to run feeds; the gate stays bounded in total by
    /// `resolve_admission_limit`. While another environment has a tag resolve in flight, an
    /// environment runs one at a time, so that a stampede leaves the replica's cores to the
    /// other's query (`src/feeds/shares.rs`; BENCHMARKS.md, "At production data volume"). Raise
    /// it with the replica's cores.
    pub resolve_admission_per_env: usize,
    /// Cold tag resolves of one environment within a minute that build its window, an in-memory
    /// index (id, `createdAt`, tags) of its runs since the oldest floor they asked for (at most
    /// `maximum_created_at_filter_age_ms` back), from which later tag snapshots of the
    /// environment take their run ids instead of a set query whose cost grows with the table's
    /// history (docs/operations.md, "Windows"); 0 = never (runfeed; 64). Needs
    /// `caches.full_reread_ms` > 0 (a window is rebuilt that often).
    pub window_after_resolves: u32,
    /// Runs all windows of this instance hold at most, about 250 bytes of resident memory each
    /// (BENCHMARKS.md); a build that would pass it is not made (runfeed; 2 000 000).
    pub window_max_runs: u64,
    /// Live polls per environment (`DEFAULT_CONCURRENCY_LIMIT`, 100 000).
    pub default_concurrency_limit: u64,
    /// Per-organization live-poll limits (org id → limit), replacing the default for that
    /// organization's environments (trigger.dev's plan limit `realtimeConcurrentConnections`).
    pub concurrency_limit_overrides: std::collections::BTreeMap<String, u64>,
    /// Most concurrency slots an instance leases from Redis at once per environment, so that
    /// live polls are admitted without a Redis round trip each (32). The block is
    /// `min(this, limit / 16)`; 0, or a limit under 16, counts every live poll exactly with one
    /// Redis script call. Tolerance: an environment may be refused up to
    /// `(instances − 1) × block` polls before its limit, never admitted past it
    /// (docs/operations.md "Concurrency limit").
    pub concurrency_lease_slots: u64,
    /// Most tags in one tag-feed filter; more → 400 (422 legacy) (100).
    pub max_tags: usize,
    /// Longest tag in a tag-feed filter, bytes; longer → 400 (422 legacy) (256).
    pub max_tag_bytes: usize,
    /// SSE live mode (`live_sse=true`): a keep-alive comment is sent after this long without
    /// any other event, ms (15 000; Electric sends one every 21 s, under common proxy idle
    /// timeouts of 30–60 s).
    pub sse_keepalive_ms: u64,
    /// SSE live mode: the server ends a stream after this long, ms, so that proxies and CDNs
    /// recycle it; the client reconnects at its last offset (60 000, Electric's value).
    pub sse_max_duration_ms: u64,
    /// SSE live mode: most event bytes one stream queues for a client that has not taken
    /// them yet (one event larger than this is still queued alone), bytes (262 144). When the
    /// queue is full, the stream stops reading changes until the client takes an event.
    pub sse_max_queued_bytes: usize,
    /// SSE live mode: most events one stream queues for a client that has not taken them yet
    /// (64).
    pub sse_max_queued_events: usize,
    /// SSE live mode: a stream whose queue is full and whose client takes nothing for this
    /// long is ended (the connection is closed; the client reconnects at its last offset) and
    /// counted in `runfeed_feeds_stalled_streams_total`, ms (10 000).
    pub sse_stall_timeout_ms: u64,
}

impl FeedsConfig {
    /// The longest a live long-poll can be held, ms: the hold with its largest jitter, the
    /// rounding of its expiry (at most 25 ms, `feeds::expiry_tick`) and the backstop read's
    /// bound (`live_poll_timeout_ms / 4 + 1`, `feeds::Feeds::live`). Must stay under the 45 s
    /// after which `@electric-sql/client` 1.5 aborts a live request.
    pub fn max_hold_ms(&self) -> u64 {
        let t = self.live_poll_timeout_ms as f64;
        let tick = 25.min(self.live_poll_timeout_ms / 20);
        (t * (1.0 + self.live_poll_jitter_ratio)).ceil() as u64
            + tick
            + self.live_poll_timeout_ms / 4
            + 1
    }
}

impl Default for FeedsConfig {
    fn default() -> Self {
        FeedsConfig {
            live_poll_timeout_ms: 20_000,
            live_poll_jitter_ratio: 0.15,
            max_list_results: 1_000,
            hold_on_empty: true,
            maximum_created_at_filter_age_ms: 86_400_000,
            runset_created_at_bucket_ms: 60_000,
            resolve_admission_limit: 16,
            resolve_admission_per_env: 2,
            window_after_resolves: 64,
            window_max_runs: 2_000_000,
            default_concurrency_limit: 100_000,
            concurrency_lease_slots: 32,
            concurrency_limit_overrides: std::collections::BTreeMap::new(),
            max_tags: 100,
            max_tag_bytes: 256,
            sse_keepalive_ms: 15_000,
            sse_max_duration_ms: 60_000,
            sse_max_queued_bytes: 256 * 1024,
            sse_max_queued_events: 64,
            sse_stall_timeout_ms: 10_000,
        }
    }
}

/// `[router]`: change routing (reference `ENV_WAKE_COALESCE_WINDOW_MS`, `REPLAY_*`, `UNSUBSCRIBE_LINGER_MS`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Longest a change record waits behind hydrates already in flight before another
    /// hydrate batch starts in parallel, ms (25). No record ever waits while the router is
    /// idle: the first one starts a hydrate at once, and records that arrive meanwhile join the
    /// next batch. Replaces trigger.dev's fixed `ENV_WAKE_COALESCE_WINDOW_MS` (also accepted
    /// under its old name `env_wake_coalesce_window_ms`).
    #[serde(alias = "env_wake_coalesce_window_ms")]
    pub coalesce_ceiling_ms: u64,
    /// Most runs one hydrate batch reads, over all environments and column sets (1 000).
    pub hydrate_batch_max_runs: usize,
    /// Most change records waiting for a hydrate batch (100 000; ≈ 0.9 KiB of resident memory
    /// each, measured in docs/faults.md). While the store is too slow or down, records beyond
    /// this are dropped, and each drop is a gap in its environment: the feeds held there re-read
    /// from the store, as after a lost Redis connection. Bounds the router's memory whatever the
    /// rate of records.
    pub max_queued_records: usize,
    /// How long buffered change records stay replayable, ms; 0 disables replay (2 000).
    pub replay_window_ms: u64,
    /// Cap on buffered records per environment (512).
    pub replay_max_runs: usize,
    /// Keep an environment subscribed this long after its last feed leaves, ms (5 000).
    pub unsubscribe_linger_ms: u64,
    /// Store each response's replay cursor in Redis so a poll landing on another instance
    /// replays its gap instead of re-reading the feed (`SHARED_REPLAY_CURSORS`, true).
    pub shared_replay_cursors: bool,
    /// Slack for cursors handed out by another instance (clock skew, stream skew), ms: the
    /// replay starts this much before the cursor's wall time (1 000).
    pub hop_margin_ms: u64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            coalesce_ceiling_ms: 25,
            hydrate_batch_max_runs: 1_000,
            max_queued_records: 100_000,
            replay_window_ms: 2_000,
            replay_max_runs: 512,
            unsubscribe_linger_ms: 5_000,
            shared_replay_cursors: true,
            hop_margin_ms: 1_000,
        }
    }
}

/// `[caches]`: read-through caches and per-connection feed state (reference `RUN_CACHE_*`,
/// `RUNSET_CACHE_*`, `WORKING_SET_*`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct CachesConfig {
    /// Single-run read-through cache TTL, ms (250); 0 disables (single-flight remains).
    pub run_cache_ttl_ms: u64,
    /// Single-run cache entries (5 000).
    pub run_cache_max_entries: u64,
    /// Run-set resolve cache TTL, ms (1 000).
    pub runset_cache_ttl_ms: u64,
    /// Run-set resolve cache entries (5 000).
    pub runset_cache_max_entries: u64,
    /// Run-set resolve cache budget, bytes of serialized rows (64 MiB). Bounds memory where the
    /// reference only bounds entry counts.
    pub runset_cache_max_bytes: u64,
    /// Per-connection feed state TTL (working sets, replay cursors), ms (300 000).
    pub working_set_ttl_ms: u64,
    /// Per-connection feed states kept (10 000).
    pub working_set_max_entries: u64,
    /// Resource / environment lookup cache TTL for authentication and URL ids, ms (1 000).
    pub lookup_cache_ttl_ms: u64,
    /// A backstop (the store read at the end of a quiet hold, which finds changes whose
    /// publish was lost) reuses a backstop read of the same feed filter taken by another poll
    /// within this window, ms (60 000); 0 = every backstop reads, like the reference. Only
    /// polls that know their client's versions share (a stale shared read can then never
    /// regress a row). Idle cost: one read per distinct filter per window instead of one per
    /// feed per hold; a lost publish surfaces within this window plus one hold.
    pub backstop_share_ms: u64,
    /// A backstop re-reads its feed's whole filter at most this often, ms (600 000, jittered
    /// ±25 % per filter); in between it reads only what can have changed: the heads of the
    /// filter's unfinished runs by primary key and the runs created since, then hydrates the
    /// runs that moved. The full re-read finds a lost publish on a finished run (a tag added
    /// to it, say), so that is how late one surfaces at worst. 0 = every backstop re-reads the
    /// whole filter (shared for `backstop_share_ms`).
    pub full_reread_ms: u64,
    /// Run and batch lookups of the feed URLs (ids, task, batch: immutable) are cached this
    /// long, ms (300 000), so a re-poll costs no query. A run's tags can change: when only its
    /// tags could grant the request (a tag-scoped token on a run feed) they are read fresh.
    pub resource_cache_ttl_ms: u64,
    /// Environments found by id for public tokens (JWT `sub`) are reused this long, ms
    /// (10 000; misses follow `lookup_cache_ttl_ms`). Idle feeds re-poll every ~20 s each, so
    /// with the 1 s lookup TTL every environment cost a query per second. A rotated API key
    /// stops verifying public tokens within this long.
    pub public_token_env_ttl_ms: u64,
}

impl Default for CachesConfig {
    fn default() -> Self {
        CachesConfig {
            run_cache_ttl_ms: 250,
            run_cache_max_entries: 5_000,
            runset_cache_ttl_ms: 1_000,
            runset_cache_max_entries: 5_000,
            runset_cache_max_bytes: 64 * 1024 * 1024,
            working_set_ttl_ms: 300_000,
            working_set_max_entries: 10_000,
            lookup_cache_ttl_ms: 1_000,
            backstop_share_ms: 60_000,
            full_reread_ms: 600_000,
            resource_cache_ttl_ms: 300_000,
            public_token_env_ttl_ms: 10_000,
        }
    }
}

/// `[replica_lag]`: read-your-writes gate (reference `REPLICA_LAG_*`, `STALE_HYDRATE_RETRIES`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicaLagConfig {
    /// Hold each batch of change records until the read replica has applied the commits it
    /// announces (`REPLICA_LAG_GATE_ENABLED`, true). Only with a replica distinct from the
    /// primary and without `database.run_reads_from_primary`.
    pub gate_enabled: bool,
    /// The reference's periodic lag-sampling interval, ms (`REPLICA_LAG_SAMPLE_INTERVAL_MS`,
    /// 250). Accepted for compatibility and unused: runfeed samples the lag per waiting batch.
    pub sample_interval_ms: u64,
    /// The reference stops sampling after this long without traffic, ms
    /// (`REPLICA_LAG_IDLE_AFTER_MS`, 30 000). Accepted for compatibility and unused: runfeed
    /// only probes while batches wait.
    pub idle_after_ms: u64,
    /// The lag estimate is the largest sample of this trailing window, ms
    /// (`REPLICA_LAG_WINDOW_MS`, 5 000).
    pub window_ms: u64,
    /// Lag estimate while the window holds no sample, ms (`REPLICA_LAG_DEFAULT_MS`, 30).
    pub default_ms: u64,
    /// Added to the lag estimate when waiting by the clock (replica positions unavailable) and
    /// before re-hydrating stale rows, ms (`REPLICA_LAG_MARGIN_MS`, 10).
    pub margin_ms: u64,
    /// Longest a batch waits for the replica before hydrating anyway (a sick replica costs
    /// freshness, never liveness), ms (`REPLICA_LAG_MAX_DELAY_MS`, 1 000).
    pub max_delay_ms: u64,
    /// Re-hydrate attempts for rows the stale tripwire caught before they are delivered anyway
    /// (`STALE_HYDRATE_RETRIES`, 3).
    pub stale_hydrate_retries: u32,
    /// A stale hydrate observed at lag L keeps the estimate at L or more for this long, ms
    /// (`REPLICA_LAG_OBSERVED_FLOOR_TTL_MS`, 60 000).
    pub observed_floor_ttl_ms: u64,
}

impl Default for ReplicaLagConfig {
    fn default() -> Self {
        ReplicaLagConfig {
            gate_enabled: true,
            sample_interval_ms: 250,
            idle_after_ms: 30_000,
            window_ms: 5_000,
            default_ms: 30,
            margin_ms: 10,
            max_delay_ms: 1_000,
            stale_hydrate_retries: 3,
            observed_floor_ttl_ms: 60_000,
        }
    }
}

/// `[telemetry]`: metrics export, the admin listener and log format (runfeed's own; the
/// reference exports through the webapp's OTel setup, docs/behaviours.md §2.2).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Admin listener address, `host:port`, serving `/metrics` (Prometheus text), `/healthz`
    /// and `/readyz`; an empty string disables it. Keep it off the public network.
    pub admin_listen: String,
    /// OTLP/HTTP (protobuf) metrics endpoint, e.g. `http://otel-collector:4318/v1/metrics`
    /// (a bare `http://host:4318` gets `/v1/metrics` appended); unset = no OTLP export.
    pub otlp_endpoint: Option<String>,
    /// OTLP export interval, ms.
    pub otlp_interval_ms: u64,
    /// `pretty` (human-readable) or `json` (one JSON object per line, for containers).
    /// `RUNFEED_LOG_FORMAT=json` also selects JSON.
    pub log_format: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            admin_listen: "127.0.0.1:9464".into(),
            otlp_endpoint: None,
            otlp_interval_ms: 30_000,
            log_format: "pretty".into(),
        }
    }
}

/// The configuration could not be loaded or is invalid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// figment's error already names the key and the source; it is not also reported as a
    /// `source()` (an error chain would print it twice).
    #[error("config: {0}")]
    Load(Box<figment::Error>),
    #[error("config: {0}")]
    Invalid(String),
}

impl From<Box<figment::Error>> for ConfigError {
    fn from(err: Box<figment::Error>) -> ConfigError {
        ConfigError::Load(err)
    }
}

impl Config {
    /// Defaults ← `file` (if given) ← `RUNFEED_<SECTION>__<KEY>` env vars, then validated.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        let mut fig = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            if !path.exists() {
                return Err(ConfigError::Invalid(format!(
                    "config file {} not found",
                    path.display()
                )));
            }
            fig = fig.merge(Toml::file(path));
        }
        // Only `RUNFEED_<SECTION>__<KEY>` names are configuration; other RUNFEED_* variables
        // (RUNFEED_LISTEN, RUNFEED_CONFIG, RUNFEED_LOG_FORMAT, …) belong to the CLI.
        fig = fig.merge(
            Env::prefixed("RUNFEED_")
                .filter(|key| key.as_str().contains("__"))
                .split("__"),
        );
        let config: Config = fig.extract().map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges that would make the server misbehave.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let f = &self.feeds;
        if !(0.0..1.0).contains(&f.live_poll_jitter_ratio) {
            return Err(ConfigError::Invalid(
                "feeds.live_poll_jitter_ratio must be in [0, 1)".into(),
            ));
        }
        if f.live_poll_timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "feeds.live_poll_timeout_ms must be > 0".into(),
            ));
        }
        // `@electric-sql/client` 1.5 aborts a live request after 45 s (`liveRequestTimeoutMs`);
        // keep 5 s of margin for the network and the response.
        let hold_limit = crate::config::CLIENT_LIVE_REQUEST_TIMEOUT_MS - 5_000;
        if f.max_hold_ms() > hold_limit {
            return Err(ConfigError::Invalid(format!(
                "feeds.live_poll_timeout_ms with its jitter and backstop can hold a live poll {} ms; \
                 at most {hold_limit} ms, because @electric-sql/client 1.5 aborts a live request after 45 s",
                f.max_hold_ms()
            )));
        }
        if f.sse_keepalive_ms == 0 || f.sse_max_duration_ms == 0 {
            return Err(ConfigError::Invalid(
                "feeds.sse_keepalive_ms and feeds.sse_max_duration_ms must be > 0".into(),
            ));
        }
        if f.sse_max_queued_bytes == 0
            || f.sse_max_queued_events == 0
            || f.sse_stall_timeout_ms == 0
        {
            return Err(ConfigError::Invalid(
                "feeds.sse_max_queued_bytes, feeds.sse_max_queued_events and feeds.sse_stall_timeout_ms must be > 0".into(),
            ));
        }
        // A stream holds its concurrency slot for its whole life; the limiter sweeps slots
        // older than 300 s (`redis::limit::ENTRY_TTL_S`), so a stream must end well before.
        if f.sse_max_duration_ms > 240_000 {
            return Err(ConfigError::Invalid(
                "feeds.sse_max_duration_ms must be at most 240000 (concurrency slots are swept after 300 s)".into(),
            ));
        }
        if f.max_list_results == 0 {
            return Err(ConfigError::Invalid(
                "feeds.max_list_results must be > 0".into(),
            ));
        }
        if self.router.max_queued_records == 0 {
            return Err(ConfigError::Invalid(
                "router.max_queued_records must be > 0".into(),
            ));
        }
        let t = &self.telemetry;
        if !t.admin_listen.is_empty() && t.admin_listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(ConfigError::Invalid(format!(
                "telemetry.admin_listen {:?} is not an address (empty disables it)",
                t.admin_listen
            )));
        }
        if t.otlp_interval_ms == 0 {
            return Err(ConfigError::Invalid(
                "telemetry.otlp_interval_ms must be > 0".into(),
            ));
        }
        if !matches!(t.log_format.as_str(), "pretty" | "json") {
            return Err(ConfigError::Invalid(format!(
                "telemetry.log_format {:?} must be \"pretty\" or \"json\"",
                t.log_format
            )));
        }
        if let Some(upstream) = &self.auth.run_token_upstream {
            check_run_token_upstream(upstream)?;
        }
        if self.server.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(ConfigError::Invalid(format!(
                "server.listen {:?} is not an address",
                self.server.listen
            )));
        }
        Ok(())
    }
}

/// `auth.run_token_upstream` must be an absolute `http://` URL with a host and no query.
fn check_run_token_upstream(upstream: &str) -> Result<(), ConfigError> {
    let invalid = |why: &str| {
        ConfigError::Invalid(format!(
            "auth.run_token_upstream {upstream:?} {why} (expected the webapp's internal URL, e.g. http://webapp:3000)"
        ))
    };
    let uri: http::Uri = upstream.parse().map_err(|_| invalid("is not a URL"))?;
    if uri.scheme_str() != Some("http") {
        return Err(invalid("must use http://"));
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(invalid("has no host"));
    }
    if uri.query().is_some() {
        return Err(invalid("must not have a query"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_toml_equals_builtin_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/default.toml");
        let from_file: Config = Figment::new()
            .merge(Toml::file(&path))
            .extract()
            .expect("config/default.toml parses");
        assert_eq!(from_file, Config::default());
    }

    #[test]
    // figment's `Jail` closure returns its own (large) error type.
    #[allow(clippy::result_large_err)]
    fn only_section_key_env_vars_are_configuration() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("RUNFEED_CONFIG", "config/default.toml");
            jail.set_env("RUNFEED_LOG_FORMAT", "json");
            jail.set_env("RUNFEED_LISTEN", "127.0.0.1:1");
            jail.set_env("RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS", "3000");
            let config = Config::load(None).map_err(|e| e.to_string())?;
            assert_eq!(config.feeds.live_poll_timeout_ms, 3000);
            Ok(())
        });
    }

    /// An unknown key is named once: the error is not also its own `source()`, which an error
    /// chain (`runfeed: config: …: …`) printed a second time.
    #[test]
    #[allow(clippy::result_large_err)]
    fn an_unknown_key_is_reported_once() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("RUNFEED_SERVER__FOO", "1");
            let err = Config::load(None).expect_err("unknown key");
            let chain = format!("{:#}", anyhow::Error::from(err));
            assert_eq!(chain.matches("SERVER.FOO").count(), 1, "{chain}");
            Ok(())
        });
    }

    /// `@electric-sql/client` 1.5 aborts a live request at 45 s: a hold that could reach it is
    /// refused at start-up.
    #[test]
    fn a_hold_the_1_5_client_would_abort_is_rejected() {
        let mut c = Config::default();
        assert_eq!(c.feeds.max_hold_ms(), 28_026);
        c.feeds.live_poll_timeout_ms = 30_000;
        let err = c.validate().expect_err("30 s ± 15 % + backstop > 40 s");
        assert!(err.to_string().contains("45 s"), "{err}");
        c.feeds.live_poll_timeout_ms = 25_000;
        c.feeds.live_poll_jitter_ratio = 0.5;
        assert!(c.validate().is_err(), "{}", c.feeds.max_hold_ms());
        c.feeds.live_poll_jitter_ratio = 0.15;
        assert!(c.validate().is_ok(), "{}", c.feeds.max_hold_ms());
        c.feeds.sse_keepalive_ms = 0;
        assert!(c.validate().is_err());
    }

    #[test]
    fn a_run_token_upstream_must_be_an_http_url_with_a_host() {
        let mut c = Config::default();
        for ok in [
            "http://webapp:3030",
            "http://10.0.0.1:3000/",
            "http://webapp/prefix",
        ] {
            c.auth.run_token_upstream = Some(ok.into());
            assert!(c.validate().is_ok(), "{ok}");
        }
        for bad in [
            "webapp:3030",
            "https://webapp",
            "ftp://webapp",
            "http://webapp/?a=1",
            "/x",
            "",
        ] {
            c.auth.run_token_upstream = Some(bad.into());
            let err = c.validate().expect_err(bad);
            assert!(err.to_string().contains("auth.run_token_upstream"), "{err}");
        }
    }

    #[test]
    fn invalid_jitter_is_rejected() {
        let mut c = Config::default();
        c.feeds.live_poll_jitter_ratio = 1.5;
        assert!(c.validate().is_err());
    }
}
