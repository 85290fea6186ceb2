//! Development tooling for runfeed, kept out of the server crate: nothing here ships in the
//! `runfeed` binary.
//!
//! - [`fixtures`]: environments, runs and batches written the way trigger.dev writes them, and
//!   throwaway test databases ([`fixtures::TestDb`]).
//! - [`demo`]: the demo environment and workload behind `runfeed-demo` (README "set-up").
//!
//! Binaries: `runfeed-demo` (seed + live workload) and `runfeed-bench` (benchmarks, see
//! BENCHMARKS.md).

pub mod demo;
pub mod fixtures;
