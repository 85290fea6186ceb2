//! The `runfeed` binary: parses the command line and runs one command.

use clap::Parser;
use runfeed::cli::{Cli, Command};

/// jemalloc keeps its metadata outside the allocations: hyper reserves an 8 KiB read and an
/// 8 KiB write buffer per connection and a held poll touches a few hundred bytes of them, so
/// with jemalloc the rest stays non-resident (glibc's in-band chunk headers touch it). See
/// BENCHMARKS.md, "Held feeds".
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // `serve` installs logging once its configuration (telemetry.log_format) is loaded.
    if !matches!(cli.command, Command::Serve(_) | Command::ConfigReference) {
        runfeed::telemetry::init_logging();
    }
    let result = match cli.command {
        Command::Serve(args) => runfeed::app::serve(args).await,
        Command::Migrate(args) => runfeed::cli::migrate::run(args).await,
        Command::Publish(args) => runfeed::cli::publish::run(args).await,
        Command::Token(args) => runfeed::cli::token::run(args).await,
        Command::ConfigReference => {
            print!("{}", runfeed::config::reference_markdown());
            Ok(())
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("runfeed: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
