//! The `runfeed` binary: parses the command line and runs one command ([`runfeed::cli::run`]).

#![deny(unsafe_code)]

use clap::Parser;
use runfeed::cli::Cli;

/// jemalloc keeps its metadata outside the allocations: hyper reserves an 8 KiB read and an
/// 8 KiB write buffer per connection and a held poll touches a few hundred bytes of them, so
/// with jemalloc the rest stays non-resident (glibc's in-band chunk headers touch it). See
/// BENCHMARKS.md, "Held feeds".
///
/// Its options are compiled in (no `unsafe` here): the `background_threads` feature starts a
/// thread that purges dirty pages on its own, and `.cargo/config.toml` sets
/// `JEMALLOC_SYS_WITH_MALLOC_CONF=dirty_decay_ms:1000`, so memory freed after a burst (aborted
/// polls, a large fan-out) goes back to the kernel within about a second even while the server is
/// idle (docs/faults.md "Memory after bursts"). `_RJEM_MALLOC_CONF` in the environment overrides
/// them at run time (<https://jemalloc.net/jemalloc.3.html>).
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
