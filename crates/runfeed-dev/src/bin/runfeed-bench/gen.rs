//! `gen`: a production-like `"TaskRun"` table for `volume`. N runs are written into trigger.dev's
//! schema (the repository's `migrations/`) inside Postgres, with set-based
//! `INSERT … SELECT … FROM generate_series` statements of `--chunk` runs each. Every random draw is
//! `hashint8extended(row, seed · 1000 + draw)`, so the same `--seed` writes the same table.
//!
//! What a run gets:
//! - its environment: 80 % in environment 0 (the busy one), the rest spread over the others;
//! - `createdAt` rising with the row number over the last `--days` days up to now (rows land in
//!   the heap in `createdAt` order, as a table filled over time does); ids cuid-like, prefixed by
//!   the creation time;
//! - tags: `user:<k>`, k log-uniform over 1..100 000, and for half of the runs also
//!   `plan:free|pro|team|enterprise` (55 / 30 / 10 / 5 %);
//! - batches: the row numbers are cut into blocks of 5 000; `--batch-share` of the blocks start
//!   with a batch of 10–5 000 runs (log-uniform) of one environment (`"BatchTaskRun"` rows too);
//! - 3 % of runs not in a final status (`EXECUTING`, `PENDING`, `WAITING_TO_RESUME`, `DELAYED`,
//!   `DEQUEUED`, `RETRYING_AFTER_FAILURE`), the others final with `completedAt`; failures get an
//!   `error`;
//! - payload, output (successful runs) and metadata (40 % of runs): JSON around hex text cut from a
//!   128 KiB random pool (incompressible, so TOAST stores it as written), sized log-uniform over
//!   100 B–2 KB, and for 0.5 % of values over 10–200 KB (TOASTed).
//!
//! The environments (`vol-000`, `vol-001`, …, each with its organization and project) have ids
//! and keys derived from the seed; `volume` finds them by slug. The parameters and the time of
//! generation are kept as JSON in the comment of the `"TaskRun"` table ([`GenMeta`]).

use std::time::Instant;

use runfeed::store::setup;
use runfeed_dev::fixtures::{create_env_exact, EnvSlugs};
use sqlx::Row;

use super::*;

/// Rows per block of the row numbers; a batch starts at the beginning of a block.
const BLOCK: u64 = 5_000;
/// Bytes of the random pool the text values are cut from (hex-encoded: up to 256 KB of text).
const POOL_MD5S: u32 = 8_192;
/// The share of runs in environment 0.
const BUSY_SHARE: f64 = 0.8;
/// The slug prefix of the environments `gen` writes.
pub(crate) const ENV_SLUG_PREFIX: &str = "vol-";
/// Task identifiers runs are spread over (uniformly).
const TASKS: [&str; 8] = [
    "send-email",
    "process-video",
    "sync-user",
    "generate-report",
    "webhook-delivery",
    "llm-summarize",
    "resize-image",
    "daily-digest",
];

#[derive(Args)]
pub(crate) struct GenArgs {
    /// The database to fill (created and migrated when missing); its `"TaskRun"` must be empty.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// Runs to write.
    #[arg(long, default_value_t = 2_500_000)]
    runs: u64,
    /// `createdAt` spread over this many days, up to now.
    #[arg(long, default_value_t = 2.0)]
    days: f64,
    /// Environments; environment 0 gets 80 % of the runs.
    #[arg(long, default_value_t = 5)]
    envs: usize,
    /// Seed of every random draw (same seed, same table).
    #[arg(long, default_value_t = 1)]
    seed: u32,
    /// Share of the 5 000-run blocks that start with a batch (10–5 000 runs).
    #[arg(long, default_value_t = 0.5)]
    batch_share: f64,
    /// Runs per `INSERT` statement (a multiple of 5 000).
    #[arg(long, default_value_t = 250_000)]
    chunk: u64,
    /// Write the figures as JSON to this file.
    #[arg(long)]
    json: Option<String>,
}

/// What `gen` wrote, kept as JSON in the comment of the `"TaskRun"` table.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct GenMeta {
    pub(crate) runs: u64,
    pub(crate) days: f64,
    pub(crate) envs: usize,
    pub(crate) seed: u32,
    pub(crate) batch_share: f64,
    /// The newest `createdAt` written (the time of generation), epoch ms.
    pub(crate) end_ms: i64,
}

impl GenMeta {
    /// The parameters `gen` left in `pool`'s database, if it wrote them.
    pub(crate) async fn read(pool: &PgPool) -> anyhow::Result<Option<GenMeta>> {
        let comment: Option<String> =
            sqlx::query_scalar(r#"SELECT obj_description('"TaskRun"'::regclass, 'pg_class')"#)
                .fetch_one(pool)
                .await
                .context("read the comment of TaskRun")?;
        Ok(comment.and_then(|c| serde_json::from_str(&c).ok()))
    }
}

/// A deterministic lowercase alphanumeric string of `len` characters from `(seed, salt)`
/// (splitmix64).
fn det_alnum(seed: u32, salt: u64, len: usize) -> String {
    const CHARS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mix = |x: u64| {
        let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut x = mix((u64::from(seed) << 32) ^ mix(salt));
    (0..len)
        .map(|_| {
            x = mix(x);
            CHARS[(x % CHARS.len() as u64) as usize] as char
        })
        .collect()
}

/// Environment `i` of seed `seed`: its ids and root key.
pub(crate) fn volume_env(seed: u32, i: usize) -> DemoEnv {
    let salt = |k: u64| (i as u64) * 16 + k;
    DemoEnv {
        env_id: format!("c{}", det_alnum(seed, salt(1), 24)),
        api_key: format!(
            "{}{}",
            fixtures::api_key_prefix("PRODUCTION"),
            det_alnum(seed, salt(2), 24)
        ),
        org_id: format!("c{}", det_alnum(seed, salt(3), 24)),
        project_id: format!("c{}", det_alnum(seed, salt(4), 24)),
    }
}

/// The slug of environment `i`.
pub(crate) fn env_slug(i: usize) -> String {
    format!("{ENV_SLUG_PREFIX}{i:03}")
}

/// SQL for a uniform draw in [0, 1) of row `row` (an int8 expression), draw number `k`.
fn u(seed: u32, row: &str, k: u32) -> String {
    format!(
        "((hashint8extended({row}, {salt}) >> 11) & 9007199254740991)::float8 / 9007199254740992.0",
        salt = u64::from(seed) * 1000 + u64::from(k)
    )
}

/// SQL for a draw log-uniform over [lo, hi) from the uniform draw `unit`.
fn log_uniform(unit: &str, lo: f64, hi: f64) -> String {
    format!(
        "exp(ln({lo}::float8) + ({unit}) * (ln({hi}::float8) - ln({lo}::float8)))",
        lo = lo,
        hi = hi
    )
}

/// SQL for the environment index (0-based) of draw `unit`: 0 with [`BUSY_SHARE`], else one of
/// the others uniformly.
fn env_index(unit: &str, envs: usize) -> String {
    if envs <= 1 {
        return "0".into();
    }
    let others = envs - 1;
    format!(
        "(CASE WHEN ({unit}) < {BUSY_SHARE} THEN 0 ELSE LEAST({last}, 1 + floor((({unit}) - {BUSY_SHARE}) / {rest} * {others})::int) END)",
        last = envs - 1,
        rest = 1.0 - BUSY_SHARE,
    )
}

/// SQL, over a block number `blk`: whether the block starts with a batch, its size, its
/// environment index.
struct BlockSql {
    has_batch: String,
    size: String,
    env: String,
}

fn block_sql(a: &GenArgs, blk: &str) -> BlockSql {
    BlockSql {
        has_batch: format!("({}) < {}", u(a.seed, blk, 50), a.batch_share),
        // Capped to the runs that exist after the block's start.
        size: format!(
            "LEAST(floor({})::int8, $3::int8 - ({blk}) * {BLOCK})",
            log_uniform(&u(a.seed, blk, 51), 10.0, 5001.0)
        ),
        env: env_index(&u(a.seed, blk, 52), a.envs),
    }
}

/// SQL for the epoch ms `createdAt` of row `row`: `$4` (start) + row × `$5` (span) / `$3` (runs).
fn created_ms(row: &str) -> String {
    format!("($4::int8 + floor(({row})::float8 * $5::float8 / $3::float8)::int8)")
}

/// SQL for a `timestamp(3)` (UTC wall clock) of the epoch-ms expression `ms`.
fn ts(ms: &str) -> String {
    format!("(timestamp '1970-01-01 00:00:00' + ({ms}) * interval '1 millisecond')")
}

/// SQL for the internal id of the batch of block `blk`: `c`, the creation ms in hex, `b`, the
/// block number, 5 hex digits of hash (25 characters).
fn batch_id(seed: u32, blk: &str) -> String {
    format!(
        "('c' || lpad(to_hex({created}), 12, '0') || 'b' || lpad(to_hex({blk}), 6, '0') || lpad(to_hex(hashint8extended({blk}, {salt}) & 1048575), 5, '0'))",
        created = created_ms(&format!("({blk}) * {BLOCK}")),
        salt = u64::from(seed) * 1000 + 53,
    )
}

/// The `INSERT` of the runs `$1 <= i < $2` (`$3` runs in all, `$4` start ms, `$5` span ms, `$6`
/// the text pool, `$7`/`$8`/`$9` environment, project and organization ids by index).
fn insert_runs_sql(a: &GenArgs) -> String {
    let s = a.seed;
    let ui = |k: u32| u(s, "g.i", k);
    let blk = block_sql(a, "(g.i / 5000)");
    let size = |k: u32| {
        // 0.5 % of values 10–200 KB, the rest 100 B–2 KB; even (hex pairs).
        format!(
            "(2 * floor((CASE WHEN ({}) < 0.005 THEN {} ELSE {} END) / 2))::int",
            ui(k),
            log_uniform(&ui(k + 1), 10_000.0, 200_000.0),
            log_uniform(&ui(k + 1), 100.0, 2_000.0),
        )
    };
    let statuses = [
        (0.012, "EXECUTING"),
        (0.018, "PENDING"),
        (0.022, "WAITING_TO_RESUME"),
        (0.025, "DELAYED"),
        (0.027, "DEQUEUED"),
        (0.030, "RETRYING_AFTER_FAILURE"),
        (0.930, "COMPLETED_SUCCESSFULLY"),
        (0.970, "COMPLETED_WITH_ERRORS"),
        (0.980, "SYSTEM_FAILURE"),
        (0.985, "CRASHED"),
        (0.993, "CANCELED"),
        (0.997, "EXPIRED"),
    ];
    let mut status = String::from("CASE");
    for (below, name) in statuses {
        status.push_str(&format!(" WHEN ({}) < {below} THEN '{name}'", ui(5)));
    }
    status.push_str(" ELSE 'TIMED_OUT' END");
    let tasks = TASKS
        .iter()
        .map(|t| format!("'{t}'"))
        .collect::<Vec<_>>()
        .join(",");
    // `len` characters of hex from the pool, at the position of the uniform draw `pos`.
    let text = |len: &str, pos: &str| {
        format!(
            r#"'{{"data":"' || encode(substring($6::bytea from 1 + floor({pos} * (octet_length($6::bytea) - {len} / 2))::int for {len} / 2), 'hex') || '"}}'"#,
        )
    };
    format!(
        r#"INSERT INTO "TaskRun" (
             id, "friendlyId", "runtimeEnvironmentId", "projectId", "organizationId", engine,
             "taskIdentifier", queue, payload, "payloadType", "traceId", "spanId",
             "createdAt", "updatedAt", "queuedAt", "startedAt", "completedAt", "delayUntil", "expiredAt",
             status, "runTags", "batchId", metadata, "metadataType", output, "outputType", error,
             number, "usageDurationMs", "costInCents", "baseCostInCents", "isTest")
           SELECT
             r.id, 'run_' || r.id, ($7::text[])[r.env + 1], ($8::text[])[r.env + 1], ($9::text[])[r.env + 1], 'V2',
             r.task, 'task/' || r.task, {payload}, 'application/json', r.trace, substr(r.trace, 1, 16),
             {created}, {updated}, {created},
             CASE WHEN r.started THEN {started} END,
             CASE WHEN r.final THEN {completed} END,
             CASE WHEN r.status = 'DELAYED' THEN {delay_until} END,
             CASE WHEN r.status = 'EXPIRED' THEN {completed} END,
             r.status::"TaskRunStatus",
             CASE WHEN r.has_plan THEN ARRAY['user:' || r.usr, 'plan:' || r.plan] ELSE ARRAY['user:' || r.usr] END,
             r.batch, CASE WHEN r.has_meta THEN {metadata} END, 'application/json',
             CASE WHEN r.status = 'COMPLETED_SUCCESSFULLY' THEN {output} END, 'application/json',
             CASE WHEN r.status IN ('COMPLETED_WITH_ERRORS', 'SYSTEM_FAILURE', 'CRASHED', 'TIMED_OUT')
               THEN jsonb_build_object('type', 'BUILT_IN_ERROR', 'name', 'Error',
                      'message', 'task failed for user:' || r.usr, 'stackTrace', E'Error: task failed\n    at run (src/trigger/' || r.task || '.ts:42:11)') END,
             (r.i % 1000000)::int, CASE WHEN r.started THEN r.duration ELSE 0 END,
             CASE WHEN r.started THEN r.duration * 0.00034 ELSE 0 END, CASE WHEN r.started THEN 0.0025 ELSE 0 END, false
           FROM (
             SELECT q.*,
               'c' || lpad(to_hex(q.created_ms), 12, '0') || lpad(to_hex(q.i), 7, '0')
                   || lpad(to_hex(hashint8extended(q.i, {id_salt}) & 1048575), 5, '0') AS id,
               q.status NOT IN ('EXECUTING', 'PENDING', 'WAITING_TO_RESUME', 'DELAYED', 'DEQUEUED', 'RETRYING_AFTER_FAILURE') AS final,
               q.status NOT IN ('PENDING', 'DELAYED', 'EXPIRED') AS started
             FROM (
               SELECT g.i,
                 {created_i} AS created_ms,
                 CASE WHEN q0.in_batch THEN q0.batch_env ELSE {env_i} END AS env,
                 CASE WHEN q0.in_batch THEN {batch_id} END AS batch,
                 (ARRAY[{tasks}])[1 + floor(({u_task}) * {ntasks})::int] AS task,
                 md5(g.i::text || ':{s}') AS trace,
                 floor({user})::int AS usr,
                 ({u_has_plan}) < 0.5 AS has_plan,
                 CASE WHEN ({u_plan}) < 0.55 THEN 'free' WHEN ({u_plan}) < 0.85 THEN 'pro'
                      WHEN ({u_plan}) < 0.95 THEN 'team' ELSE 'enterprise' END AS plan,
                 {status} AS status,
                 floor({duration})::int AS duration,
                 floor(({u_delay}) * 3000)::int8 AS start_delay,
                 ({u_has_meta}) < 0.4 AS has_meta,
                 {payload_len} AS payload_len, {output_len} AS output_len, {metadata_len} AS metadata_len,
                 {payload_pos} AS payload_pos, {output_pos} AS output_pos, {metadata_pos} AS metadata_pos
               FROM generate_series($1::int8, $2::int8 - 1) AS g(i)
               CROSS JOIN LATERAL (
                 SELECT ({has_batch}) AND (g.i % {BLOCK}) < {bsize} AS in_batch, {benv} AS batch_env
               ) q0
               OFFSET 0
             ) q
             OFFSET 0
           ) r"#,
        payload = text("r.payload_len", "r.payload_pos"),
        output = text("r.output_len", "r.output_pos"),
        metadata = text("r.metadata_len", "r.metadata_pos"),
        payload_pos = ui(11),
        output_pos = ui(13),
        metadata_pos = ui(15),
        created = ts("r.created_ms"),
        started = ts("LEAST(r.created_ms + r.start_delay, $4::int8 + $5::int8)"),
        completed = ts("LEAST(r.created_ms + r.start_delay + r.duration, $4::int8 + $5::int8)"),
        updated = ts(
            "LEAST(r.created_ms + CASE WHEN r.final THEN r.start_delay + r.duration WHEN r.started THEN r.start_delay ELSE 0 END, $4::int8 + $5::int8)"
        ),
        delay_until = ts("r.created_ms + 3600000"),
        id_salt = u64::from(s) * 1000 + 20,
        created_i = created_ms("g.i"),
        env_i = env_index(&ui(1), a.envs),
        batch_id = batch_id(s, "(g.i / 5000)"),
        u_task = ui(9),
        ntasks = TASKS.len(),
        user = log_uniform(&ui(2), 1.0, 100_001.0),
        u_has_plan = ui(3),
        u_plan = ui(4),
        duration = log_uniform(&ui(6), 100.0, 600_000.0),
        u_delay = ui(7),
        u_has_meta = ui(8),
        payload_len = size(20),
        output_len = size(22),
        metadata_len = size(24),
        has_batch = blk.has_batch,
        bsize = blk.size,
        benv = blk.env,
    )
}

/// The `INSERT` of the batches of the blocks starting in `$1 <= i < $2` (same parameters as
/// [`insert_runs_sql`], without the pool).
fn insert_batches_sql(a: &GenArgs) -> String {
    let blk = block_sql(a, "b.blk");
    format!(
        r#"INSERT INTO "BatchTaskRun" (id, "friendlyId", "runtimeEnvironmentId", status, "runtimeEnvironmentType",
             "runCount", "batchVersion", "completedAt", "createdAt", "updatedAt")
           SELECT x.id, 'batch_' || x.id, ($6::text[])[x.env + 1], 'COMPLETED', 'PRODUCTION',
             x.size, 'runengine:v2', {created}, {created}, {created}
           FROM (
             SELECT {batch_id} AS id, {env} AS env, {size} AS size, {created_ms} AS created_ms
             FROM generate_series($1::int8 / {BLOCK}, ($2::int8 - 1) / {BLOCK}) AS b(blk)
             WHERE {has_batch}
           ) x"#,
        created = ts("x.created_ms"),
        batch_id = batch_id(a.seed, "b.blk"),
        env = blk.env,
        size = blk.size,
        has_batch = blk.has_batch,
        created_ms = created_ms(&format!("b.blk * {BLOCK}")),
    )
}

pub(crate) async fn gen(a: GenArgs) -> anyhow::Result<()> {
    if a.chunk == 0 || !a.chunk.is_multiple_of(BLOCK) {
        bail!("--chunk must be a positive multiple of {BLOCK}");
    }
    if a.envs == 0 || a.runs == 0 || a.days <= 0.0 {
        bail!("--runs, --envs and --days must be positive");
    }
    let started = Instant::now();
    let (pool, _) = setup::connect_migrated(&a.database_url)
        .await
        .context("create or migrate --database-url")?;
    let existing: i64 =
        sqlx::query_scalar(r#"SELECT count(*) FROM (SELECT 1 FROM "TaskRun" LIMIT 1) x"#)
            .fetch_one(&pool)
            .await
            .context("look for runs")?;
    if existing > 0 {
        bail!(
            "{} already holds runs: gen writes into an empty TaskRun (drop the database first)",
            a.database_url
        );
    }
    let envs: Vec<DemoEnv> = (0..a.envs).map(|i| volume_env(a.seed, i)).collect();
    for (i, env) in envs.iter().enumerate() {
        // Left by an earlier attempt with the same seed: kept.
        let exists: bool = sqlx::query_scalar(
            r#"SELECT EXISTS (SELECT 1 FROM "RuntimeEnvironment" WHERE id = $1)"#,
        )
        .bind(&env.env_id)
        .fetch_one(&pool)
        .await
        .context("look for the environment")?;
        if exists {
            continue;
        }
        let slug = env_slug(i);
        let org = format!("volume-{}-{slug}", a.seed);
        let slugs = EnvSlugs {
            org: &org,
            project: &org,
            env: &slug,
        };
        create_env_exact(&pool, "PRODUCTION", slugs, env).await?;
    }
    let end_ms = chrono::Utc::now().timestamp_millis();
    let span_ms = (a.days * 86_400_000.0) as i64;
    let start_ms = end_ms - span_ms;
    let pool_bytes: Vec<u8> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT decode(string_agg(md5('{seed}:' || j), '' ORDER BY j), 'hex') FROM generate_series(1, {POOL_MD5S}) AS j",
        seed = a.seed
    )))
    .fetch_one(&pool)
    .await
    .context("build the text pool")?;
    let env_ids: Vec<&str> = envs.iter().map(|e| e.env_id.as_str()).collect();
    let project_ids: Vec<&str> = envs.iter().map(|e| e.project_id.as_str()).collect();
    let org_ids: Vec<&str> = envs.iter().map(|e| e.org_id.as_str()).collect();
    let runs_sql = insert_runs_sql(&a);
    let batches_sql = insert_batches_sql(&a);
    let runs = i64::try_from(a.runs).context("--runs")?;
    let chunk = i64::try_from(a.chunk).context("--chunk")?;
    let mut from = 0i64;
    while from < runs {
        let to = (from + chunk).min(runs);
        let t = Instant::now();
        let mut conn = pool.acquire().await.context("acquire a connection")?;
        sqlx::query("SET synchronous_commit = off")
            .execute(&mut *conn)
            .await
            .context("SET synchronous_commit")?;
        sqlx::query(sqlx::AssertSqlSafe(batches_sql.clone()))
            .bind(from)
            .bind(to)
            .bind(runs)
            .bind(start_ms)
            .bind(span_ms)
            .bind(&env_ids)
            .execute(&mut *conn)
            .await
            .context("insert BatchTaskRun rows")?;
        sqlx::query(sqlx::AssertSqlSafe(runs_sql.clone()))
            .bind(from)
            .bind(to)
            .bind(runs)
            .bind(start_ms)
            .bind(span_ms)
            .bind(&pool_bytes)
            .bind(&env_ids)
            .bind(&project_ids)
            .bind(&org_ids)
            .execute(&mut *conn)
            .await
            .with_context(|| format!("insert runs {from}..{to}"))?;
        eprintln!(
            "gen: runs {from}..{to} of {runs} in {:.1} s ({:.0} s so far)",
            t.elapsed().as_secs_f64(),
            started.elapsed().as_secs_f64()
        );
        from = to;
    }
    let insert_s = started.elapsed().as_secs_f64();
    let meta = GenMeta {
        runs: a.runs,
        days: a.days,
        envs: a.envs,
        seed: a.seed,
        batch_share: a.batch_share,
        end_ms,
    };
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"COMMENT ON TABLE "TaskRun" IS '{}'"#,
        serde_json::to_string(&meta)?.replace('\'', "''")
    )))
    .execute(&pool)
    .await
    .context("comment TaskRun")?;
    let t = Instant::now();
    for table in ["TaskRun", "BatchTaskRun"] {
        sqlx::query(sqlx::AssertSqlSafe(format!(r#"VACUUM ANALYZE "{table}""#)))
            .execute(&pool)
            .await
            .with_context(|| format!("VACUUM ANALYZE {table}"))?;
    }
    let vacuum_s = t.elapsed().as_secs_f64();
    let mut rows: Vec<(String, Value)> = Vec::new();
    for (i, env) in envs.iter().enumerate() {
        let n: i64 = sqlx::query_scalar(
            r#"SELECT count(*) FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1"#,
        )
        .bind(&env.env_id)
        .fetch_one(&pool)
        .await
        .context("count runs")?;
        rows.push((
            format!("runs in {} ({})", env_slug(i), env.env_id),
            json!(n),
        ));
    }
    let busy_24h: i64 = sqlx::query_scalar(
        r#"SELECT count(*) FROM "TaskRun" WHERE "runtimeEnvironmentId" = $1 AND "createdAt" >= (timestamp '1970-01-01' + ($2::int8 - 86400000) * interval '1 millisecond')"#,
    )
    .bind(&envs[0].env_id)
    .bind(end_ms)
    .fetch_one(&pool)
    .await
    .context("count the busy environment's last 24 h")?;
    rows.push(("runs in vol-000, last 24 h".into(), json!(busy_24h)));
    let batches = sqlx::query(r#"SELECT count(*), COALESCE(sum("runCount"), 0)::int8, COALESCE(max("runCount"), 0) FROM "BatchTaskRun""#)
        .fetch_one(&pool)
        .await
        .context("count batches")?;
    rows.push(("batches".into(), json!(batches.try_get::<i64, _>(0)?)));
    rows.push((
        "runs in batches".into(),
        json!(batches.try_get::<i64, _>(1)?),
    ));
    rows.push((
        "largest batch (runs)".into(),
        json!(batches.try_get::<i32, _>(2)?),
    ));
    let sizes = sqlx::query(
        r#"SELECT pg_total_relation_size('"TaskRun"'), pg_relation_size('"TaskRun"'),
                  pg_indexes_size('"TaskRun"'),
                  COALESCE(pg_total_relation_size(reltoastrelid), 0)
           FROM pg_class WHERE oid = '"TaskRun"'::regclass"#,
    )
    .fetch_one(&pool)
    .await
    .context("table sizes")?;
    let mb = |i: usize| -> anyhow::Result<Value> {
        Ok(json!((sizes.try_get::<i64, _>(i)? as f64 / 1e6).round()))
    };
    rows.push(("TaskRun with indexes and TOAST (MB)".into(), mb(0)?));
    rows.push(("TaskRun heap (MB)".into(), mb(1)?));
    rows.push(("TaskRun indexes (MB)".into(), mb(2)?));
    rows.push(("TaskRun TOAST (MB)".into(), mb(3)?));
    rows.push(("insert (s)".into(), json!(insert_s)));
    rows.push(("VACUUM ANALYZE (s)".into(), json!(vacuum_s)));
    rows.push(("total (s)".into(), json!(started.elapsed().as_secs_f64())));
    report_to(
        a.json.as_deref(),
        "gen",
        json!({"runs": a.runs, "days": a.days, "envs": a.envs, "seed": a.seed, "batch_share": a.batch_share, "chunk": a.chunk}),
        rows,
    )
}
