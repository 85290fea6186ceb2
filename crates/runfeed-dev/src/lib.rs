//! Development tooling for runfeed, kept out of the server crate: nothing here ships in the
//! `runfeed` binary.
//!
//! - [`fixtures`]: environments, runs and batches written the way trigger.dev writes them, and
//!   throwaway test databases ([`fixtures::TestDb`]).
//! - [`demo`]: the demo environment and workload behind `runfeed-demo` (`scripts/dev.sh` runs it).
//! - [`client`]: an Electric shape-protocol follower (snapshot, live polls, 409 must-refetch,
//!   materialized view), as the npm client behaves.
//! - [`check`]: the randomized, fault-injecting delivery checker (`runfeed-bench check`,
//!   CORRECTNESS.md "The checker").
//!
//! Binaries: `runfeed-demo` (seed + live workload) and `runfeed-bench` (benchmarks, see
//! BENCHMARKS.md, and the checker).

pub mod check;
pub mod client;
pub mod demo;
pub mod fixtures;
