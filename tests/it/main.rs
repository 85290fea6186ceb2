//! runfeed's integration tests, one test binary for all of them (`cargo test --test it`): a cold
//! build compiles and links runfeed into one test executable instead of one per file. Each file
//! of this directory is a module; a test's full name is `<file>::<test>`, e.g.
//! `cargo test --test it feeds_http::` runs tests/it/feeds_http.rs, and
//! `cargo test --test it -- --exact replica::paused_replica_degrades_freshness_not_liveness` one
//! test.
//!
//! **Adding a test file:** create `tests/it/<name>.rs`, add `mod <name>;` to the list below, and
//! start the file with `use crate::common;` where a standalone test file would say `mod common;`
//! (then `use common::*;` etc. work as before). A new file directly in `tests/` is a binary of its
//! own: `every_test_file_is_a_module_of_a_test_binary` below fails until it is moved here, unless
//! it truly needs a process of its own.
//!
//! **Tests share this process**, so a test must not change process-wide state that another
//! test could see: environment variables, the working directory, resource limits a test lowers,
//! the global tracing subscriber (`try_init` only, as `changes_cluster` does), or the panic hook
//! without scoping it (`replica` counts panics on its own runtime's threads only). Tests that
//! need exclusive use of a shared service take a lock in `common` (the streaming replica:
//! [`common::REPLICA`]). The binaries that exist for that reason:
//! - `tests/deploy/`: the static deployment checks, which swap the process environment and
//!   working directory (figment's `Jail`) to load configurations;
//! - `tests/hostile.rs`: its RSS check measures the whole process while the hostile matrix runs.

#[path = "../common/mod.rs"]
mod common;

mod changes_cluster;
mod changes_redis;
mod cli;
mod correctness;
mod docs;
mod electric_current;
mod faults_http;
mod feeds_http;
mod fleet;
mod fuzz_props;
mod grants;
mod replica;
mod run_tokens;
mod shutdown;
mod store_auth;
mod telemetry;

/// The test binaries this repository has on purpose: this one, `tests/deploy/` and
/// `tests/hostile.rs` (see the module docs for why those two stand alone).
const STANDALONE: &[&str] = &["hostile.rs"];
/// Directories under tests/ that are no test binary.
const NOT_TESTS: &[&str] = &["common", "browser", "e2e", "fuzz"];
/// Directories under tests/ that are test binaries (`<dir>/main.rs`).
const BINARIES: &[&str] = &["it", "deploy"];

/// Every Rust file in tests/ is a module of this binary or of `tests/deploy/`, or one of the
/// standalone binaries above: a test file added directly to tests/ is folded in here.
#[test]
fn every_test_file_is_a_module_of_a_test_binary() {
    let tests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let mut stray = Vec::new();
    for entry in std::fs::read_dir(&tests).expect("tests/") {
        let entry = entry.expect("tests/ entry");
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_dir = entry.file_type().expect("file type").is_dir();
        if is_dir {
            let known = NOT_TESTS.contains(&name.as_str()) || BINARIES.contains(&name.as_str());
            if !known && entry.path().join("main.rs").exists() {
                stray.push(format!("tests/{name}/main.rs"));
            }
        } else if name.ends_with(".rs") && !STANDALONE.contains(&name.as_str()) {
            stray.push(format!("tests/{name}"));
        }
    }
    assert!(
        stray.is_empty(),
        "{stray:?} would each build and link a test binary of their own: move tests/<name>.rs to \
         tests/it/<name>.rs, add `mod <name>;` to tests/it/main.rs and replace its `mod common;` \
         with `use crate::common;` (tests/it/main.rs says when a file needs a binary of its own)"
    );
    for dir in BINARIES {
        assert!(
            tests.join(dir).join("main.rs").exists(),
            "tests/{dir}/main.rs"
        );
    }
}
