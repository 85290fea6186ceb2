//! `runfeed-faults`: fault scenarios under load against a running server (docs/faults.md);
//! one subcommand per fault, each printing its figures (`runfeed_dev::faults`).

use clap::{Parser, Subcommand};
use runfeed_dev::faults;

#[derive(Parser)]
#[command(about = "Fault scenarios under load against a running runfeed (docs/faults.md)")]
struct Cli {
    #[command(subcommand)]
    fault: Fault,
}

#[derive(Subcommand)]
enum Fault {
    /// SSE clients that stop reading while large rows change.
    Stalled(faults::stalled::StalledArgs),
    /// Bursts of aborted live polls and a large fan-out: does RSS come back?
    Memory(faults::memory::MemoryArgs),
    /// Every client reconnects within a second.
    Storm(faults::storm::StormArgs),
    /// A Redis restart, pause or freeze under load.
    Redis(faults::redis::RedisArgs),
    /// A Redis Cluster master failed over to its replica under load.
    RedisFailover(faults::cluster::FailoverArgs),
    /// A Postgres restart, exhausted max_connections or a frozen database under load.
    Postgres(faults::postgres::PostgresArgs),
    /// The read replica restarted or promoted under load.
    Replica(faults::replica::ReplicaArgs),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let outcome = match Cli::parse().fault {
        Fault::Stalled(a) => faults::stalled::run(a).await,
        Fault::Memory(a) => faults::memory::run(a).await,
        Fault::Storm(a) => faults::storm::run(a).await,
        Fault::Redis(a) => faults::redis::run(a).await,
        Fault::RedisFailover(a) => faults::cluster::run(a).await,
        Fault::Postgres(a) => faults::postgres::run(a).await,
        Fault::Replica(a) => faults::replica::run(a).await,
    };
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("runfeed-faults: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
