//! `runfeed-bench`: drives any server that speaks trigger.dev's realtime run-feed endpoints
//! (Electric shape protocol) and measures it . It seeds what it needs into the
//! server's database (an environment and runs, written like trigger.dev writes them), mints
//! public tokens, and publishes change records on Redis (Postgres update + change record).
//!
//! Scenarios: `held`, `fanout`, `churn`, `stampede`, `idle`, and `volume` on the data `gen`
//! writes (see BENCHMARKS.md "How to reproduce"); `held`,
//! `fanout` and `churn` take `--transport long-poll|sse|both` (SSE live mode, `live_sse=true`;
//! `both` measures the two in one run, on the same server, one after the other); plus
//! `bare`, a server that does nothing but hyper's HTTP/1.1 and a timer (the baseline of `held`,
//! and the floor of an ended live poll under `idle`: scripts/bench-floor.sh), and `check`,
//! the delivery checker (CORRECTNESS.md "The checker", `runfeed_dev::check`). Each scenario
//! prints a table and, with `--json FILE`, writes its figures as JSON.
//!
//! Server-side figures come from the admin `/metrics` (`--admin-url`) and, for CPU/RSS of a
//! local server, from `/proc/<pid>` (`--server-pid`).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use futures::stream::{self, StreamExt};
use rand::Rng;
use runfeed::auth::mint_public_token;
use runfeed::changes::ChangeRecord;
use runfeed::redis::{Publisher, RedisOptions};
use runfeed_dev::fixtures::{self, DemoEnv, RunSpec, RunUpdate};
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

const ELECTRIC_VERSION: &str = "1.0.0-beta.1";

mod bare;
mod churn;
mod conn;
mod fanout;
mod fleet;
mod gen;
mod harness;
mod held;
mod idle;
mod stampede;
mod volume;

use bare::BareArgs;
use churn::ChurnArgs;
use fanout::FanoutArgs;
use fleet::{FleetChangeArgs, FleetHoldArgs, FleetSetupArgs};
use gen::GenArgs;
use harness::*;
use held::HeldArgs;
use idle::IdleArgs;
use stampede::StampedeArgs;
use volume::VolumeArgs;

#[derive(Parser)]
#[command(
    name = "runfeed-bench",
    about = "Benchmarks a realtime run-feed server"
)]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand)]
enum Scenario {
    /// N live feeds parked: server RSS per held feed vs the bare server parking N requests.
    Held(HeldArgs),
    /// F feeds on one tag, one change: time until the last feed has its response.
    Fanout(FanoutArgs),
    /// R changes/s over E environments with H held feeds: publish → delivery latency.
    Churn(ChurnArgs),
    /// K distinct tag filters connect at once (cold): time to all snapshots.
    Stampede(StampedeArgs),
    /// H idle held feeds: requests/s, Postgres queries/s and CPU while nothing changes.
    Idle(IdleArgs),
    /// Writes N production-like runs (trigger.dev's schema, several environments, tags, batches,
    /// TOASTed payloads, `createdAt` over days) into a database, inside Postgres, from a seed.
    Gen(GenArgs),
    /// At the volume `gen` wrote: K distinct tag filters' cold stampede (with another
    /// environment's feeds probed meanwhile), then idle (and churn) long-polls: latency, runfeed
    /// and Postgres CPU, queries and rows read; `--explain` prints the set queries' plans.
    Volume(VolumeArgs),
    /// A bare hyper server: answers a snapshot at once and parks a `live=true` request for
    /// `--hold-ms`, both `up-to-date` with runfeed's headers; `/metrics` counts them (the
    /// baseline of `held` and of scripts/bench-floor.sh).
    Bare(BareArgs),
    /// Fleet, step 1: an environment with a hot run (tag `hot`) and a cold run, written as
    /// JSON to `--out` for the `fleet-hold` processes (scripts/fleet-bench.sh).
    FleetSetup(FleetSetupArgs),
    /// Fleet, step 2: park `--idle` run feeds (re-polled as holds expire) and `--hot` tag feeds
    /// over several instances (`--base-url a,b,c`), then time the hot feeds' responses to the
    /// change `fleet-change` announces in `--go-file`.
    FleetHold(FleetHoldArgs),
    /// Fleet, step 3: one change of the hot run; writes its publish time (Unix ms) to
    /// `--go-file`.
    FleetChange(FleetChangeArgs),
    /// The randomized, fault-injecting delivery checker (CORRECTNESS.md "The checker"): starts
    /// its own instances, database and Redis, writes, reads and injects faults, then checks
    /// six delivery properties. Exit status 1 on a violation not marked `--known`.
    Check(Box<runfeed_dev::check::CheckArgs>),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.scenario {
        Scenario::Held(a) => held::held(a).await,
        Scenario::Fanout(a) => fanout::fanout(a).await,
        Scenario::Churn(a) => churn::churn(a).await,
        Scenario::Stampede(a) => stampede::stampede(a).await,
        Scenario::Idle(a) => idle::idle(a).await,
        Scenario::Gen(a) => gen::gen(a).await,
        Scenario::Volume(a) => volume::volume(a).await,
        Scenario::Bare(a) => bare::bare(a).await,
        Scenario::FleetSetup(a) => fleet::setup(a).await,
        Scenario::FleetHold(a) => fleet::hold(a).await,
        Scenario::FleetChange(a) => fleet::change(a).await,
        Scenario::Check(a) => match runfeed_dev::check::run(*a).await {
            Ok(report) if report.passed => Ok(()),
            Ok(_) => return std::process::ExitCode::FAILURE,
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("runfeed-bench: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
