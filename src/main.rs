//! The `runfeed` binary: parses the command line and runs one command ([`runfeed::cli::run`]).

use clap::Parser;
use runfeed::cli::Cli;

/// jemalloc keeps its metadata outside the allocations: hyper reserves an 8 KiB read and an
/// 8 KiB write buffer per connection and a held poll touches a few hundred bytes of them, so
/// with jemalloc the rest stays non-resident (glibc's in-band chunk headers touch it). See
/// BENCHMARKS.md, "Held feeds".
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read before `main` (`malloc_conf`, <https://jemalloc.net/jemalloc.3.html>):
/// a background thread purges dirty pages on its own, so memory freed after a burst (aborted
/// polls, a large fan-out) goes back to the kernel within `dirty_decay_ms` even while the server
/// is idle; without it jemalloc only purges during later allocations and an idle server keeps
/// the burst's pages resident. `_RJEM_MALLOC_CONF` in the environment overrides these at run
/// time (docs/faults.md "Memory after bursts").
#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: Option<&'static std::ffi::c_char> =
    // SAFETY: the pointer comes from a `'static` NUL-terminated C string literal.
    Some(unsafe { &*c"background_thread:true,dirty_decay_ms:1000".as_ptr() });

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
