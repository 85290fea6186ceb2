//! Static checks of what runfeed ships besides the binary, one test binary
//! (`cargo test --test deploy`): the Dockerfile and compose files (`deploy`), the trigger.dev
//! compose overlay (`deploy_trigger`) and the Helm chart (`helm_chart`). No Docker, no cluster and
//! no services: the files are parsed, and runfeed's command lines and `RUNFEED_*` variables go
//! through the real CLI parser and configuration loader.
//!
//! These stand apart from tests/it because loading a configuration from a given environment swaps
//! the whole process's environment and working directory (figment's `Jail`), which would leak
//! into tests running beside them. Adding a file: `tests/deploy/<name>.rs`, `mod <name>;` below,
//! and `use crate::common;` at its top.

#[path = "../common/mod.rs"]
mod common;

mod deploy;
mod deploy_trigger;
mod helm_chart;
