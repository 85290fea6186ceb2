//! Wiring: configuration → store, change source, router, feeds → HTTP server.

use crate::cli::ServeArgs;

/// `runfeed serve`.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("not implemented yet")
}
