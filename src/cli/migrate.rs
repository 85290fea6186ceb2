//! `runfeed migrate`. STUB (cli helper).

/// Runs the migrations against `--database-url`, creating the database if it does not exist.
pub async fn run(args: super::DbArgs) -> anyhow::Result<()> {
    let _ = args;
    anyhow::bail!("not implemented yet")
}
