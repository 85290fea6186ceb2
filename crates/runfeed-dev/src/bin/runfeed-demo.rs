//! `runfeed-demo`: seeds a demo environment into a trigger.dev database, prints a token and
//! copy-paste commands to watch its feeds, then keeps a realistic workload going until Ctrl-C
//! (see [`runfeed_dev::demo`]).

use clap::Parser;
use runfeed_dev::demo::DemoArgs;

/// Seed a demo environment, print how to watch it, and keep a realistic workload going.
#[derive(Parser)]
#[command(name = "runfeed-demo", version, about)]
struct Cli {
    #[command(flatten)]
    args: DemoArgs,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    runfeed::telemetry::init_logging();
    match runfeed_dev::demo::run(cli.args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("runfeed-demo: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
