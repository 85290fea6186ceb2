//! The `runfeed` binary: parses the command line and runs one command ([`runfeed::cli::run`]).

#![deny(unsafe_code)]

use clap::Parser;
use runfeed::cli::Cli;

/// jemalloc keeps its metadata outside the allocations: hyper reserves an 8 KiB read and an
/// 8 KiB write buffer per connection and a held poll touches a few hundred bytes of them, so
/// with jemalloc the rest stays non-resident (glibc's in-band chunk headers touch it). See
/// BENCHMARKS.md, "Held feeds".
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match runfeed::cli::run(Cli::parse().command).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("runfeed: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
