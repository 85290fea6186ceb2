//! `runfeed token`. STUB (cli helper).

use clap::Args;

/// `runfeed token --env ENV_ID --scope SCOPE… [--ttl 15m]`.
#[derive(Debug, Args, Clone)]
pub struct TokenArgs {
    #[command(flatten)]
    pub db: super::DbArgs,
    /// Internal environment id.
    #[arg(long)]
    pub env: String,
    /// Scopes, e.g. `read:runs` or `read:tags:user_1` (repeatable).
    #[arg(long = "scope", required = true, num_args = 1..)]
    pub scopes: Vec<String>,
    /// Lifetime, e.g. `15m`, `1h`.
    #[arg(long, default_value = "15m")]
    pub ttl: String,
    /// `realtime.skipColumns` claim, comma-separated.
    #[arg(long)]
    pub skip_columns: Option<String>,
}

/// Prints a token.
pub async fn run(args: TokenArgs) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("not implemented yet")
}
