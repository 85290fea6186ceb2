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
//! - [`faults`]: fault scenarios under load (`runfeed-faults`, docs/faults.md).
//!
//! Binaries: `runfeed-demo` (seed + live workload), `runfeed-bench` (benchmarks, see
//! BENCHMARKS.md, and the checker) and `runfeed-faults` (docs/faults.md).

pub mod check;
pub mod client;
pub mod demo;
pub mod faults;
pub mod fixtures;
pub mod measure;
