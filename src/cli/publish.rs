//! `runfeed publish`. STUB (cli helper).

use clap::Args;

/// `runfeed publish --env ENV_ID --run RUN_ID [--tags a,b] [--batch BATCH_ID] [--updated-at-ms N]`.
#[derive(Debug, Args, Clone)]
pub struct PublishArgs {
    #[command(flatten)]
    pub redis: super::RedisArgs,
    /// Internal environment id.
    #[arg(long)]
    pub env: String,
    /// Internal run id.
    #[arg(long)]
    pub run: String,
    /// The run's tags, comma-separated (absent = a partial record without tags).
    #[arg(long)]
    pub tags: Option<String>,
    /// Internal batch id.
    #[arg(long)]
    pub batch: Option<String>,
    /// Committed `updatedAt`, epoch ms (the read-your-writes watermark).
    #[arg(long)]
    pub updated_at_ms: Option<i64>,
}

/// Publishes one record.
pub async fn run(args: PublishArgs) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("not implemented yet")
}
