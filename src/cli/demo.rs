//! `runfeed demo`. STUB (cli helper).

use clap::Args;

/// `runfeed demo`.
#[derive(Debug, Args, Clone)]
pub struct DemoArgs {
    #[command(flatten)]
    pub db: super::DbArgs,
    #[command(flatten)]
    pub redis: super::RedisArgs,
    /// Base URL of the runfeed server to print in the instructions.
    #[arg(long, default_value = "http://127.0.0.1:3030")]
    pub base_url: String,
    /// Seed and print, then exit instead of running the workload.
    #[arg(long)]
    pub seed_only: bool,
    /// Milliseconds between workload steps.
    #[arg(long, default_value_t = 1000)]
    pub interval_ms: u64,
}

/// Seeds and runs the workload.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("not implemented yet")
}
