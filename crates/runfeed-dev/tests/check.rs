//! The seconds-long seeded delivery check of the test command (CORRECTNESS.md "How
//! to reproduce"): `runfeed-bench check` in-process against two `runfeed serve` instances of the
//! workspace's own binary, its own Redis and a fresh database, with small fault rates, one
//! SIGTERM restart and one Redis restart.
//!
//! Properties with violations that a known, ignored regression test in `tests/it/correctness.rs`
//! pins are listed in [`KNOWN`]: they are reported (`KNOWN: … violated N×`) but do not fail the
//! test. Remove an entry once its regression test passes; `CHECK_STRICT=1` ignores the list.
//!
//! Environment: `SKIP_CHECK=1` skips it; `CHECK_SEED`, `CHECK_SECONDS` override the seed (14)
//! and the churn (20 s). Needs `target/debug/runfeed` (built by `cargo test` / `cargo build`),
//! `redis-server`, Postgres on 127.0.0.1:5432, and for the npm readers `npm ci --prefix
//! tests/e2e` (without it the check runs with Rust readers only).

use std::path::PathBuf;

use runfeed_dev::check::{self, CheckArgs};

/// Properties violated today, each with the ignored regression test that pins the bug, as
/// `property=tests/it/correctness.rs::test_name`. Empty: every bug the checker found is fixed and its
/// regression test runs (CORRECTNESS.md). A new finding goes here only with its ignored test.
const KNOWN: &[&str] = &[];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repository root")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seeded_delivery_check_finds_no_unknown_violation() {
    if std::env::var("SKIP_CHECK").is_ok_and(|v| v == "1") {
        println!("SKIP_CHECK=1: delivery check skipped");
        return;
    }
    let repo = repo();
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo.join("target"));
    let binary = target.join("debug/runfeed");
    assert!(
        binary.exists(),
        "no {} (cargo build --bin runfeed)",
        binary.display()
    );
    let npm = repo
        .join("tests/e2e/node_modules/@electric-sql/client")
        .exists()
        && std::process::Command::new("node")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
    if !npm {
        println!(
            "no node or no tests/e2e/node_modules: Rust readers only (npm ci --prefix tests/e2e)"
        );
    }
    let mut args = CheckArgs::defaults();
    args.seed = Some(
        std::env::var("CHECK_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(14),
    );
    args.seconds = std::env::var("CHECK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20.0);
    args.instances = 2;
    args.readers = 12;
    args.sub_seconds = vec![1.0, 6.0];
    args.npm_fraction = if npm { 2.0 / 12.0 } else { 0.0 };
    args.write_rate = 15.0;
    args.hold_ms = 3_000;
    args.instance_restarts = 1;
    args.redis_restarts = 1;
    args.runfeed = binary;
    args.repo = repo.clone();
    args.log_dir = Some(target.join("check/ci"));
    args.json = Some(target.join("check/ci/report.json"));
    args.explain = 1;
    if !std::env::var("CHECK_STRICT").is_ok_and(|v| v == "1") {
        args.known = KNOWN.iter().map(|k| k.to_string()).collect();
    }
    let report = check::run(args).await.expect("the check ran");
    assert!(
        report.passed,
        "delivery check failed (seed {}): {:?}; see the minimal histories above and {}",
        report.figures.seed,
        report.violations,
        target.join("check/ci/report.json").display()
    );
}
