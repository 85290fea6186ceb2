//! `runfeed publish`: publishes one change record exactly as trigger.dev's webapp does
//! (`PUBLISH realtime:env:{<envId>} <json>`, `SPUBLISH` on a cluster with sharded pub/sub,
//! docs/trigger-dev.md §5).

use anyhow::Context;
use clap::Args;

use crate::changes::record::channel_name;
use crate::changes::ChangeRecord;
use crate::protocol::{BatchId, EnvId, RunId};
use crate::redis::{Publisher, RedisOptions};

/// `runfeed publish --env ENV_ID --run RUN_ID [--tags a,b] [--batch BATCH_ID] [--updated-at-ms N]`.
#[derive(Debug, Args, Clone)]
pub struct PublishArgs {
    #[command(flatten)]
    pub redis: super::RedisArgs,
    /// The Redis is a cluster (`--redis-url` lists seed nodes), like `redis.cluster`.
    #[arg(long, env = "RUNFEED_REDIS__CLUSTER")]
    pub cluster: bool,
    /// With `--cluster`: SPUBLISH (sharded pub/sub, the default, like `redis.sharded`);
    /// `--sharded=false` for classic PUBLISH through the cluster.
    #[arg(long, env = "RUNFEED_REDIS__SHARDED", default_value_t = true, num_args = 0..=1,
          default_missing_value = "true", action = clap::ArgAction::Set)]
    pub sharded: bool,
    /// Internal environment id.
    #[arg(long)]
    pub env: String,
    /// Internal run id.
    #[arg(long)]
    pub run: String,
    /// The run's tags, comma-separated (absent = a partial record without tags; `--tags ''` = a
    /// full record with no tags).
    #[arg(long)]
    pub tags: Option<String>,
    /// Internal batch id.
    #[arg(long)]
    pub batch: Option<String>,
    /// Committed `updatedAt`, epoch ms (the read-your-writes watermark).
    #[arg(long)]
    pub updated_at_ms: Option<i64>,
}

/// Splits a `--tags` value: `""` is the empty tag list, otherwise the value split on `,`.
pub fn parse_tags(value: &str) -> Vec<String> {
    if value.is_empty() {
        Vec::new()
    } else {
        value.split(',').map(str::to_string).collect()
    }
}

/// The record `args` describe (`v` 1, as every webapp publish site stamps it).
pub fn record_of(args: &PublishArgs) -> ChangeRecord {
    ChangeRecord {
        v: 1,
        run_id: RunId::new(&args.run),
        env_id: EnvId::new(&args.env),
        tags: args.tags.as_deref().map(parse_tags),
        batch_id: args.batch.as_deref().map(BatchId::new),
        updated_at_ms: args.updated_at_ms,
    }
}

/// Publishes one record and reports the channel, payload and receiver count on stderr.
pub async fn run(args: PublishArgs) -> anyhow::Result<()> {
    let record = record_of(&args);
    let options = RedisOptions {
        url: args.redis.redis_url.clone(),
        cluster: args.cluster,
        sharded: args.sharded,
    };
    let publisher = Publisher::connect(&options)
        .await
        .with_context(|| format!("connect to Redis at {}", args.redis.redis_url))?;
    let receivers = publisher
        .publish(&record)
        .await
        .with_context(|| format!("publish to {}", channel_name(&record.env_id)))?;
    eprintln!(
        "runfeed publish: {} <- {} ({receivers} receiver{})",
        channel_name(&record.env_id),
        record.encode(),
        if receivers == 1 { "" } else { "s" }
    );
    Ok(())
}
