//! `runfeed-demo`: seeds a demo organization/project/DEVELOPMENT environment with runs, tags and
//! a batch, prints machine-readable `KEY=value` lines and copy-paste commands to watch the feeds,
//! then keeps a realistic workload going until Ctrl-C (or SIGTERM).
//!
//! Seeding is idempotent-ish: the database is created and migrated if needed, and the demo
//! environment (project slug `runfeed-demo`, environment slug `dev`) is REUSED when it exists
//! (same environment id and secret key across runs), otherwise created. Every invocation adds a
//! fresh set of runs and a fresh batch to it, so `RUN_ID` always names a new `PENDING` run that the
//! workload moves first.
//!
//! Every workload write goes to Postgres first (committed), then its change record is published
//! the way trigger.dev's webapp does (docs/trigger-dev.md §5): lifecycle-bus events (`runCreated`,
//! `runAttemptStarted`) WITHOUT `updatedAtMs`; `runSucceeded`, `runFailed` and metadata updates
//! WITH `updatedAtMs` = the committed `"updatedAt"`.

use std::collections::VecDeque;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde_json::json;
use sqlx::{PgPool, Row};

use crate::fixtures::{self, DemoEnv, RunSpec, RunUpdate, Stamp};
use runfeed::changes::ChangeRecord;
use runfeed::clock::now_ms;
use runfeed::redis::{Publisher, RedisOptions};

/// Project slug that identifies the demo environment's project.
pub const DEMO_PROJECT_SLUG: &str = "runfeed-demo";
/// Organization slug of the demo (suffixed when taken by something else).
pub const DEMO_ORG_SLUG: &str = "runfeed-demo";
/// Slug of the demo environment inside its project.
pub const DEMO_ENV_SLUG: &str = "dev";
/// Scopes of the printed public token.
pub const DEMO_SCOPES: [&str; 3] = ["read:runs", "read:tags", "read:batch"];
/// The tag the printed tag-feed example filters on.
pub const DEMO_TAG: &str = "user:alice";
/// Tags of the wire-format torture run: a quote, a backslash, the word NULL and a comma.
pub const WEIRD_TAGS: [&str; 4] = ["demo", "weird \"quoted\" \\ tag", "NULL", "with,comma"];

/// `runfeed-demo`.
#[derive(Debug, Args, Clone)]
pub struct DemoArgs {
    /// The trigger.dev database (created and migrated when missing).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/runfeed_demo"
    )]
    pub database_url: String,
    /// The Redis the server subscribes to (change records are published there).
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub redis_url: String,
    /// Base URL of the runfeed server to print in the instructions.
    #[arg(long, default_value = "http://127.0.0.1:3030")]
    pub base_url: String,
    /// Seed and print, then exit instead of running the workload.
    #[arg(long)]
    pub seed_only: bool,
    /// Milliseconds between workload steps.
    #[arg(long, default_value_t = 1000)]
    pub interval_ms: u64,
    /// Lifetime of the printed public access token (humantime, e.g. `15m`, `24h`).
    #[arg(long, default_value = "24h")]
    pub token_ttl: String,
}

/// What seeding produced.
#[derive(Clone, Debug)]
pub struct Seeded {
    /// The demo environment.
    pub env: DemoEnv,
    /// Whether an existing demo environment was reused.
    pub reused: bool,
    /// `(internal id, friendly id)` of the batch seeded this time.
    pub batch: (String, String),
    /// Friendly id of the `PENDING` run the workload moves first.
    pub watch_run: String,
    /// Friendly id of a `COMPLETED_SUCCESSFULLY` run (output, fractional costs).
    pub succeeded_run: String,
    /// Friendly id of a `COMPLETED_WITH_ERRORS` run (`error` jsonb).
    pub failed_run: String,
    /// Friendly id of the run tagged [`WEIRD_TAGS`] (`isTest` true).
    pub weird_run: String,
    /// Every run seeded this time: `(internal id, tags, internal batch id)`.
    pub runs: Vec<(String, Option<Vec<String>>, Option<String>)>,
}

/// Seeds and runs the workload.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let token_ttl = humantime::parse_duration(&args.token_ttl).context("invalid --token-ttl")?;
    let (pool, _created) = runfeed::store::setup::connect_migrated(&args.database_url).await?;
    let seeded = seed(&pool).await.context("seed the demo environment")?;
    let scopes: Vec<String> = DEMO_SCOPES.iter().map(|s| s.to_string()).collect();
    let token = runfeed::auth::mint_public_token(
        &seeded.env.api_key,
        &seeded.env.env_id,
        &scopes,
        token_ttl,
        None,
    )
    .context("mint the public token")?;

    print_summary(&args, &seeded, &token);

    let publisher = connect_publisher(&args.redis_url).await;
    let publisher = match (publisher, args.seed_only) {
        (Ok(p), _) => Some(p),
        (Err(e), true) => {
            eprintln!("runfeed-demo: warning: not publishing the seeded runs: {e:#}");
            None
        }
        (Err(e), false) => return Err(e),
    };
    if let Some(publisher) = &publisher {
        // The seeded runs were "created": publish them like the engine's runCreated handler.
        for (id, tags, batch) in &seeded.runs {
            publish(
                publisher,
                lifecycle_record(&seeded.env.env_id, id, tags, batch, None),
            )
            .await;
        }
    }
    if args.seed_only {
        println!("--seed-only: exiting without running the workload.");
        pool.close().await;
        return Ok(());
    }
    let publisher = publisher.context("no Redis publisher")?;
    let result = workload(
        &pool,
        &publisher,
        &seeded,
        Duration::from_millis(args.interval_ms.max(1)),
    )
    .await;
    pool.close().await;
    result
}

async fn connect_publisher(redis_url: &str) -> anyhow::Result<Publisher> {
    tokio::time::timeout(
        Duration::from_secs(5),
        Publisher::connect(&RedisOptions::standalone(redis_url)),
    )
    .await
    .map_err(|_| anyhow::anyhow!("timed out"))
    .and_then(|r| r.map_err(anyhow::Error::from))
    .with_context(|| format!("connect to Redis at {redis_url}"))
}

fn print_summary(args: &DemoArgs, seeded: &Seeded, token: &str) {
    let env = &seeded.env;
    let base = args.base_url.trim_end_matches('/');
    let (batch_id, batch_friendly) = &seeded.batch;
    println!("runfeed-demo: environment {} seeded", env.env_id);
    println!("ENV_ID={}", env.env_id);
    println!("SECRET_KEY={}", env.api_key);
    println!("PUBLIC_TOKEN={token}");
    println!("RUN_ID={}", seeded.watch_run);
    println!("BATCH_ID={batch_friendly}");
    println!("TAG={DEMO_TAG}");
    println!("BATCH_INTERNAL_ID={batch_id}");
    println!("SUCCEEDED_RUN_ID={}", seeded.succeeded_run);
    println!("FAILED_RUN_ID={}", seeded.failed_run);
    println!("WEIRD_RUN_ID={}", seeded.weird_run);
    println!("BASE_URL={base}");
    println!();
    println!(
        "{} demo environment (project slug `{DEMO_PROJECT_SLUG}`, env slug `{DEMO_ENV_SLUG}`, DEVELOPMENT); added {} runs and batch {batch_friendly}.",
        if seeded.reused { "Reused the existing" } else { "Created a new" },
        seeded.runs.len()
    );
    println!(
        "The public token has scopes {} and lasts {}.",
        DEMO_SCOPES.join(" "),
        args.token_ttl
    );
    println!();
    println!("scripts/dev.sh has started the server. Running this demo on its own, start the server in another terminal:");
    println!(
        "  cargo run --release --bin runfeed -- serve --database-url '{}' --redis-url '{}'",
        args.database_url, args.redis_url
    );
    println!();
    println!("Then watch the feeds:");
    println!("  export PUBLIC_TOKEN='{token}' TAG='{DEMO_TAG}'");
    println!("  # one run: snapshot, then long-poll with the electric-handle / electric-offset response headers");
    println!(
        "  curl -sS -D - -H \"Authorization: Bearer $PUBLIC_TOKEN\" -H 'x-trigger-electric-version: 1.0.0-beta.1' '{base}/realtime/v1/runs/{}?offset=-1'",
        seeded.watch_run
    );
    println!(
        "  curl -sS -D - -H \"Authorization: Bearer $PUBLIC_TOKEN\" -H 'x-trigger-electric-version: 1.0.0-beta.1' '{base}/realtime/v1/runs/{}?offset=<electric-offset>&handle=<electric-handle>&live=true'",
        seeded.watch_run
    );
    println!("  # runs tagged {DEMO_TAG} created in the last hour");
    println!(
        "  curl -sS -D - -H \"Authorization: Bearer $PUBLIC_TOKEN\" -H 'x-trigger-electric-version: 1.0.0-beta.1' '{base}/realtime/v1/runs?tags={DEMO_TAG}&createdAt=1h&offset=-1'"
    );
    println!("  # the batch");
    println!(
        "  curl -sS -D - -H \"Authorization: Bearer $PUBLIC_TOKEN\" -H 'x-trigger-electric-version: 1.0.0-beta.1' '{base}/realtime/v1/batches/{batch_friendly}?offset=-1'"
    );
    println!("  # the secret key works too (it may read everything in the environment)");
    println!(
        "  curl -sS -H 'Authorization: Bearer {}' '{base}/realtime/v1/runs/{}?offset=-1'",
        env.api_key, seeded.weird_run
    );
    println!("  # with the real Electric client (node >= 20; run it in tests/e2e after `npm ci --prefix tests/e2e`, or after `npm i @electric-sql/client@1.0.14`)");
    println!(
        "  node --input-type=module -e \"import {{ShapeStream}} from '@electric-sql/client'; new ShapeStream({{url: '{base}/realtime/v1/runs?tags={DEMO_TAG}&createdAt=1h', headers: {{Authorization: 'Bearer ' + process.env.PUBLIC_TOKEN, 'x-trigger-electric-version': '1.0.14'}}}}).subscribe((ms) => console.log(JSON.stringify(ms)))\""
    );
    println!();
    if !args.seed_only {
        println!(
            "Workload: every {} ms runs are created (PENDING), started (EXECUTING), get metadata updates and complete (COMPLETED_SUCCESSFULLY / COMPLETED_WITH_ERRORS). Ctrl-C to stop.",
            args.interval_ms
        );
    }
}

/// A record as the run-engine lifecycle handlers / runEngineHandlers publish it: full (tags as
/// Prisma reads them, NULL = `[]`), `batchId` (internal or null), and `updatedAtMs` when given.
fn lifecycle_record(
    env_id: &str,
    run_id: &str,
    tags: &Option<Vec<String>>,
    batch_id: &Option<String>,
    updated_at_ms: Option<i64>,
) -> ChangeRecord {
    ChangeRecord {
        v: 1,
        run_id: run_id.into(),
        env_id: env_id.into(),
        tags: Some(tags.clone().unwrap_or_default()),
        batch_id: batch_id.as_deref().map(Into::into),
        updated_at_ms,
    }
}

/// Publishes fire-and-forget: a failure is logged, never fatal (like the webapp).
async fn publish(publisher: &Publisher, record: ChangeRecord) {
    if let Err(e) = publisher.publish(&record).await {
        eprintln!(
            "runfeed-demo: publish for run {} failed: {e}",
            record.run_id
        );
    }
}

/// Finds or creates the demo environment under a session advisory lock (so concurrent demos
/// against one database do not create two), then seeds this invocation's runs and batch.
pub async fn seed(pool: &PgPool) -> anyhow::Result<Seeded> {
    let mut lock_conn = pool.acquire().await.context("acquire a connection")?;
    sqlx::query("SELECT pg_advisory_lock(hashtext('runfeed demo seed')::int8)")
        .execute(&mut *lock_conn)
        .await
        .context("take the demo seeding lock")?;
    let found = find_or_create_env(pool).await;
    let unlock = sqlx::query("SELECT pg_advisory_unlock(hashtext('runfeed demo seed')::int8)")
        .execute(&mut *lock_conn)
        .await;
    drop(lock_conn);
    let (env, reused) = found?;
    unlock.context("release the demo seeding lock")?;
    seed_runs(pool, env, reused).await
}

async fn find_or_create_env(pool: &PgPool) -> anyhow::Result<(DemoEnv, bool)> {
    let existing = sqlx::query(
        r#"SELECT e.id, e."apiKey", e."organizationId", e."projectId"
           FROM "RuntimeEnvironment" e JOIN "Project" p ON p.id = e."projectId"
           WHERE p.slug = $1 AND p."deletedAt" IS NULL AND e.slug = $2
             AND e."parentEnvironmentId" IS NULL AND e.type = 'DEVELOPMENT'
           ORDER BY e."createdAt" LIMIT 1"#,
    )
    .bind(DEMO_PROJECT_SLUG)
    .bind(DEMO_ENV_SLUG)
    .fetch_optional(pool)
    .await
    .context("look up the demo environment")?;
    if let Some(row) = existing {
        let env = DemoEnv {
            env_id: row.try_get(0)?,
            api_key: row.try_get(1)?,
            org_id: row.try_get(2)?,
            project_id: row.try_get(3)?,
        };
        return Ok((env, true));
    }
    let org_slug = free_slug(pool, "Organization", DEMO_ORG_SLUG).await?;
    let project_slug = free_slug(pool, "Project", DEMO_PROJECT_SLUG).await?;
    let env =
        fixtures::create_env_named(pool, "DEVELOPMENT", &org_slug, &project_slug, DEMO_ENV_SLUG)
            .await?;
    Ok((env, false))
}

/// `base` if no row of `table` has that slug, else `base-<random>`.
async fn free_slug(pool: &PgPool, table: &'static str, base: &str) -> anyhow::Result<String> {
    let sql = match table {
        "Organization" => r#"SELECT EXISTS (SELECT 1 FROM "Organization" WHERE slug = $1)"#,
        _ => r#"SELECT EXISTS (SELECT 1 FROM "Project" WHERE slug = $1)"#,
    };
    let taken: bool = sqlx::query_scalar(sql)
        .bind(base)
        .fetch_one(pool)
        .await
        .context("check slug")?;
    if taken {
        Ok(format!("{base}-{}", &fixtures::new_id()[1..9]))
    } else {
        Ok(base.to_string())
    }
}

fn tags(list: &[&str]) -> Option<Vec<String>> {
    Some(list.iter().map(|t| t.to_string()).collect())
}

async fn seed_runs(pool: &PgPool, env: DemoEnv, reused: bool) -> anyhow::Result<Seeded> {
    let mut number: i32 = sqlx::query_scalar(
        r#"SELECT COALESCE(MAX(number), 0) FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1"#,
    )
    .bind(&env.env_id)
    .fetch_one(pool)
    .await
    .context("read the last run number")?;
    let mut next_number = || {
        number += 1;
        number
    };
    let now = now_ms();
    let batch = fixtures::create_batch(pool, &env).await?;
    let mut runs = Vec::new();
    let mut create = async |mut spec: RunSpec| -> anyhow::Result<String> {
        // A historical run was last updated at its latest lifecycle timestamp.
        if spec.updated_at_ms.is_none() && spec.created_at_ms.is_some() {
            spec.updated_at_ms = [
                spec.created_at_ms,
                spec.queued_at_ms,
                spec.started_at_ms,
                spec.completed_at_ms,
            ]
            .into_iter()
            .flatten()
            .max();
        }
        let tags = spec.tags.clone();
        let batch_id = spec.batch_id.clone();
        let run = fixtures::create_run(pool, &env, spec).await?;
        runs.push((run.id, tags, batch_id));
        Ok(run.friendly_id)
    };

    // Old runs first (createdAt order), the run to watch last so it is the newest.
    // An old alice run that `createdAt=1h` excludes.
    create(RunSpec {
        tags: tags(&[DEMO_TAG]),
        status: "COMPLETED_SUCCESSFULLY".into(),
        task_identifier: "order.process".into(),
        created_at_ms: Some(now - 2 * 3_600_000),
        started_at_ms: Some(now - 2 * 3_600_000 + 150),
        completed_at_ms: Some(now - 2 * 3_600_000 + 2_150),
        queued_at_ms: Some(now - 2 * 3_600_000),
        payload: r#"{"orderId":"ord_0999","amount":10,"currency":"USD"}"#.into(),
        output: Some(r#"{"charged":true}"#.into()),
        usage_duration_ms: 2_000,
        cost_in_cents: 0.2,
        base_cost_in_cents: 0.0025,
        number: next_number(),
        ..RunSpec::default()
    })
    .await?;
    let succeeded_run = create(RunSpec {
        tags: tags(&["user:bob"]),
        status: "COMPLETED_SUCCESSFULLY".into(),
        task_identifier: "email.send".into(),
        created_at_ms: Some(now - 300_000),
        queued_at_ms: Some(now - 300_000),
        started_at_ms: Some(now - 299_800),
        completed_at_ms: Some(now - 298_458),
        payload: r#"{"to":"bob@example.com","template":"welcome"}"#.into(),
        metadata: Some(r#"{"progress":1,"attempts":[1]}"#.into()),
        output: Some(r#"{"messageId":"msg_8f2a","accepted":true}"#.into()),
        usage_duration_ms: 1_342,
        cost_in_cents: 0.55,
        base_cost_in_cents: 0.0025,
        number: next_number(),
        ..RunSpec::default()
    })
    .await?;
    let failed_run = create(RunSpec {
        tags: tags(&[DEMO_TAG]),
        status: "COMPLETED_WITH_ERRORS".into(),
        task_identifier: "order.process".into(),
        created_at_ms: Some(now - 180_000),
        queued_at_ms: Some(now - 180_000),
        started_at_ms: Some(now - 179_500),
        completed_at_ms: Some(now - 178_000),
        payload: r#"{"orderId":"ord_1000","amount":99.99,"currency":"EUR"}"#.into(),
        error: Some(json!({
            "type": "BUILT_IN_ERROR",
            "name": "TypeError",
            "message": "Cannot read properties of undefined (reading 'id')",
            "stackTrace": "TypeError: Cannot read properties of undefined (reading 'id')\n    at processOrder (src/trigger/order.ts:12:20)"
        })),
        usage_duration_ms: 1_500,
        // JS String(0.1 + 0.2) and String(1e-7): exercises float formatting on the wire.
        cost_in_cents: 0.1 + 0.2,
        base_cost_in_cents: 1e-7,
        number: next_number(),
        ..RunSpec::default()
    })
    .await?;
    create(RunSpec {
        tags: tags(&["user:bob", "demo"]),
        status: "COMPLETED_WITH_ERRORS".into(),
        task_identifier: "email.send".into(),
        created_at_ms: Some(now - 120_000),
        started_at_ms: Some(now - 119_000),
        completed_at_ms: Some(now - 118_800),
        error: Some(json!({"type": "STRING_ERROR", "raw": "boom"})),
        usage_duration_ms: 200,
        cost_in_cents: 0.02,
        number: next_number(),
        ..RunSpec::default()
    })
    .await?;
    // Empty (not NULL) tag array, canceled.
    create(RunSpec {
        tags: Some(Vec::new()),
        status: "CANCELED".into(),
        task_identifier: "report.generate".into(),
        created_at_ms: Some(now - 90_000),
        completed_at_ms: Some(now - 60_000),
        number: next_number(),
        ..RunSpec::default()
    })
    .await?;
    // Legacy API-version rewrite: DEQUEUED reads as EXECUTING without x-trigger-api-version.
    create(RunSpec {
        tags: tags(&["user:bob"]),
        status: "DEQUEUED".into(),
        task_identifier: "email.send".into(),
        created_at_ms: Some(now - 60_000),
        queued_at_ms: Some(now - 60_000),
        number: next_number(),
        ..RunSpec::default()
    })
    .await?;
    // No tags at all (NULL), delayed, ttl, null startedAt.
    create(RunSpec {
        status: "DELAYED".into(),
        task_identifier: "reminder.send".into(),
        created_at_ms: Some(now - 30_000),
        delay_until_ms: Some(now + 3_600_000),
        ttl: Some("10m".into()),
        payload: r#"{"remindAt":"in one hour"}"#.into(),
        number: next_number(),
        ..RunSpec::default()
    })
    .await?;
    let weird_run = create(RunSpec {
        tags: Some(WEIRD_TAGS.iter().map(|t| t.to_string()).collect()),
        status: "EXECUTING".into(),
        task_identifier: "weird.tags".into(),
        created_at_ms: Some(now - 20_000),
        queued_at_ms: Some(now - 20_000),
        started_at_ms: Some(now - 19_000),
        is_test: true,
        payload: "{\"text\":\"ünïcødé ✓ 🚀\\nnew line\",\"quote\":\"\\\"\",\"backslash\":\"\\\\\"}"
            .into(),
        metadata: Some(
            r#"{"note":"quotes \" and backslash \\","nothing":null,"nested":{"a":[1,2.5,"x"]}}"#
                .into(),
        ),
        realtime_streams: tags(&["default"]),
        ttl: Some("1h".into()),
        number: next_number(),
        ..RunSpec::default()
    })
    .await?;
    // The batch: one done, one executing, one pending.
    let (batch_id, _) = &batch;
    for (i, status) in ["COMPLETED_SUCCESSFULLY", "EXECUTING", "PENDING"]
        .into_iter()
        .enumerate()
    {
        let created = now - 10_000 + i as i64 * 100;
        let done = status == "COMPLETED_SUCCESSFULLY";
        create(RunSpec {
            tags: tags(&["demo", "batch"]),
            batch_id: Some(batch_id.clone()),
            status: status.into(),
            task_identifier: "image.resize".into(),
            created_at_ms: Some(created),
            queued_at_ms: Some(created),
            started_at_ms: (status != "PENDING").then_some(created + 500),
            completed_at_ms: done.then_some(created + 2_500),
            payload: format!(r#"{{"image":"img_{i}.png","width":{}}}"#, 320 * (i + 1)),
            output: done.then(|| r#"{"url":"https://cdn.example.com/img_0_320.png"}"#.to_string()),
            usage_duration_ms: if done { 2_000 } else { 0 },
            cost_in_cents: if done { 0.125 } else { 0.0 },
            number: next_number(),
            ..RunSpec::default()
        })
        .await?;
    }
    let watch_run = create(RunSpec {
        tags: tags(&[DEMO_TAG, "demo"]),
        status: "PENDING".into(),
        task_identifier: "order.process".into(),
        queued_at_ms: Some(now),
        payload: r#"{"orderId":"ord_1001","amount":42.5,"currency":"EUR"}"#.into(),
        number: next_number(),
        ..RunSpec::default()
    })
    .await?;
    sqlx::query(r#"UPDATE "BatchTaskRun" SET "runCount" = 3, status = 'PROCESSING' WHERE id = $1"#)
        .bind(batch_id)
        .execute(pool)
        .await
        .context("update the batch run count")?;
    Ok(Seeded {
        env,
        reused,
        batch,
        watch_run,
        succeeded_run,
        failed_run,
        weird_run,
        runs,
    })
}

/// A run the workload is moving along.
#[derive(Clone, Debug)]
struct Tracked {
    id: String,
    friendly_id: String,
    tags: Option<Vec<String>>,
    batch_id: Option<String>,
    metadata_updates: u32,
}

/// The workload's view of the environment's unfinished runs.
struct Workload<'a> {
    pool: &'a PgPool,
    publisher: &'a Publisher,
    env: &'a DemoEnv,
    /// Internal id of the seeded batch (a quarter of the new runs join it).
    batch_id: String,
    pending: VecDeque<Tracked>,
    executing: VecDeque<Tracked>,
    number: i32,
}

/// Runs the workload until Ctrl-C / SIGTERM. Picks up every PENDING/EXECUTING run of the
/// environment (including those left by an earlier demo), the watch run first.
async fn workload(
    pool: &PgPool,
    publisher: &Publisher,
    seeded: &Seeded,
    interval: Duration,
) -> anyhow::Result<()> {
    let rows = sqlx::query(
        r#"SELECT id, "friendlyId", status::text, "runTags", "batchId" FROM "TaskRun"
           WHERE "runtimeEnvironmentId" = $1 AND status IN ('PENDING', 'EXECUTING')
           ORDER BY "createdAt", id LIMIT 200"#,
    )
    .bind(&seeded.env.env_id)
    .fetch_all(pool)
    .await
    .context("load unfinished runs")?;
    let number: i32 = sqlx::query_scalar(
        r#"SELECT COALESCE(MAX(number), 0) FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1"#,
    )
    .bind(&seeded.env.env_id)
    .fetch_one(pool)
    .await
    .context("read the last run number")?;
    let mut w = Workload {
        pool,
        publisher,
        env: &seeded.env,
        batch_id: seeded.batch.0.clone(),
        pending: VecDeque::new(),
        executing: VecDeque::new(),
        number,
    };
    for row in rows {
        let status: String = row.try_get(2)?;
        let tracked = Tracked {
            id: row.try_get(0)?,
            friendly_id: row.try_get(1)?,
            tags: row.try_get(3)?,
            batch_id: row.try_get(4)?,
            metadata_updates: 0,
        };
        if status == "PENDING" {
            if tracked.friendly_id == seeded.watch_run {
                w.pending.push_front(tracked);
            } else {
                w.pending.push_back(tracked);
            }
        } else {
            w.executing.push_back(tracked);
        }
    }

    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await; // the first tick is immediate
    let mut steps: u64 = 0;
    let stop = shutdown_signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = ticker.tick() => {
                w.step().await;
                steps += 1;
            }
        }
    }
    eprintln!("runfeed-demo: stopped after {steps} steps");
    Ok(())
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

const USERS: [&str; 3] = ["user:alice", "user:bob", "user:carol"];
const TASKS: [&str; 3] = ["order.process", "email.send", "image.resize"];
const STEPS: [&str; 3] = ["validating", "charging card", "sending receipt"];

impl Workload<'_> {
    /// One step: advance the two oldest executing runs (metadata update, or completion after
    /// two updates), start the oldest pending run, and create a run when few are in flight.
    async fn step(&mut self) {
        for _ in 0..2 {
            if let Some(run) = self.executing.pop_front() {
                if let Err(e) = self.advance(run).await {
                    eprintln!("runfeed-demo: {e:#}");
                }
            }
        }
        if let Some(run) = self.pending.pop_front() {
            if let Err(e) = self.start(run).await {
                eprintln!("runfeed-demo: {e:#}");
            }
        }
        let in_flight = self.pending.len() + self.executing.len();
        if in_flight < 3 || (in_flight < 8 && rand::random_bool(0.5)) {
            if let Err(e) = self.create().await {
                eprintln!("runfeed-demo: {e:#}");
            }
        }
    }

    async fn create(&mut self) -> anyhow::Result<()> {
        let user = USERS[rand::random_range(0..USERS.len())];
        let task = TASKS[rand::random_range(0..TASKS.len())];
        let tags = if rand::random_bool(0.2) {
            None
        } else if rand::random_bool(0.5) {
            Some(vec![user.to_string(), "demo".to_string()])
        } else {
            Some(vec![user.to_string()])
        };
        let batch_id = rand::random_bool(0.25).then(|| self.batch_id.clone());
        self.number += 1;
        let amount = rand::random_range(100..100_000) as f64 / 100.0;
        let spec = RunSpec {
            tags: tags.clone(),
            batch_id: batch_id.clone(),
            status: "PENDING".into(),
            task_identifier: task.into(),
            queued_at_ms: Some(now_ms()),
            payload: json!({"orderId": format!("ord_{}", 1000 + self.number), "amount": amount})
                .to_string(),
            number: self.number,
            ..RunSpec::default()
        };
        let run = fixtures::create_run(self.pool, self.env, spec)
            .await
            .context("create a run")?;
        // runCreated: no updatedAtMs.
        publish(
            self.publisher,
            lifecycle_record(&self.env.env_id, &run.id, &tags, &batch_id, None),
        )
        .await;
        eprintln!(
            "runfeed-demo: {} created (PENDING, tags {:?}{})",
            run.friendly_id,
            tags.clone().unwrap_or_default(),
            if batch_id.is_some() {
                ", in the batch"
            } else {
                ""
            }
        );
        self.pending.push_back(Tracked {
            id: run.id,
            friendly_id: run.friendly_id,
            tags,
            batch_id,
            metadata_updates: 0,
        });
        Ok(())
    }

    async fn start(&mut self, run: Tracked) -> anyhow::Result<()> {
        let set = RunUpdate {
            status: Some("EXECUTING".into()),
            started_at: Some(Stamp::Now),
            ..RunUpdate::default()
        };
        match fixtures::update_run_if_exists(self.pool, &run.id, set).await {
            Ok(Some(_)) => {
                // runStatusChanged / runAttemptStarted: no updatedAtMs.
                publish(
                    self.publisher,
                    lifecycle_record(&self.env.env_id, &run.id, &run.tags, &run.batch_id, None),
                )
                .await;
                eprintln!("runfeed-demo: {} PENDING -> EXECUTING", run.friendly_id);
                self.executing.push_back(run);
                Ok(())
            }
            Ok(None) => Ok(()), // deleted meanwhile: forget it
            Err(e) => {
                self.pending.push_front(run);
                Err(e)
            }
        }
    }

    async fn advance(&mut self, mut run: Tracked) -> anyhow::Result<()> {
        let (set, what, done) = if run.metadata_updates < 2 {
            let n = run.metadata_updates + 1;
            let metadata =
                json!({"progress": n as f64 / 3.0, "step": STEPS[n as usize % STEPS.len()]})
                    .to_string();
            (
                RunUpdate {
                    metadata: Some(metadata),
                    ..RunUpdate::default()
                },
                format!("metadata update {n}"),
                false,
            )
        } else if rand::random_bool(0.75) {
            let usage = rand::random_range(200..5_000);
            let set = RunUpdate {
                status: Some("COMPLETED_SUCCESSFULLY".into()),
                completed_at: Some(Stamp::Now),
                output: Some(json!({"ok": true, "durationMs": usage}).to_string()),
                metadata: Some(json!({"progress": 1, "step": "done"}).to_string()),
                usage_duration_ms: Some(usage),
                cost_in_cents: Some(usage as f64 * 0.000_169),
                base_cost_in_cents: Some(0.0025),
                ..RunUpdate::default()
            };
            (set, "EXECUTING -> COMPLETED_SUCCESSFULLY".to_string(), true)
        } else {
            let usage = rand::random_range(200..5_000);
            let set = RunUpdate {
                status: Some("COMPLETED_WITH_ERRORS".into()),
                completed_at: Some(Stamp::Now),
                error: Some(json!({"type": "STRING_ERROR", "raw": "boom"})),
                usage_duration_ms: Some(usage),
                cost_in_cents: Some(usage as f64 * 0.000_169),
                base_cost_in_cents: Some(0.0025),
                ..RunUpdate::default()
            };
            (set, "EXECUTING -> COMPLETED_WITH_ERRORS".to_string(), true)
        };
        match fixtures::update_run_if_exists(self.pool, &run.id, set).await {
            Ok(Some(updated_at_ms)) => {
                // runSucceeded / runFailed / runMetadataUpdated: WITH the committed updatedAt.
                publish(
                    self.publisher,
                    lifecycle_record(
                        &self.env.env_id,
                        &run.id,
                        &run.tags,
                        &run.batch_id,
                        Some(updated_at_ms),
                    ),
                )
                .await;
                eprintln!(
                    "runfeed-demo: {} {what} (updatedAtMs {updated_at_ms})",
                    run.friendly_id
                );
                if !done {
                    run.metadata_updates += 1;
                    self.executing.push_back(run);
                }
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) => {
                self.executing.push_front(run);
                Err(e)
            }
        }
    }
}
