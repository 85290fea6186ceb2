//! What the benchmarks and fault scenarios read off a server: Prometheus samples of its admin
//! `/metrics`, its RSS and CPU time from `/proc`, and percentiles of what they timed.

/// Sum of every sample of the Prometheus family `name` in `text` (None when absent).
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        if let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// Resident set size of `pid`, bytes (`/proc/<pid>/statm`, in pages of 4 KiB: the machines these
/// tools run on).
pub fn proc_rss(pid: u32) -> Option<f64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let resident: f64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(resident * 4096.0)
}

/// CPU time (user + system) of `pid` so far, s (`/proc/<pid>/stat`, 100 ticks per second).
pub fn proc_cpu_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the ")" of the command name: state is field 3; utime 14, stime 15.
    let after = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Memory the kernel holds for every TCP socket of the machine, bytes (`/proc/net/sockstat`,
/// `TCP: … mem <pages>`, pages of 4 KiB): the send and receive queues the processes' own RSS
/// does not show.
pub fn tcp_kernel_memory() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/net/sockstat").ok()?;
    let tcp = stat.lines().find(|l| l.starts_with("TCP:"))?;
    let mut words = tcp.split_whitespace();
    words.find(|w| *w == "mem")?;
    let pages: f64 = words.next()?.parse().ok()?;
    Some(pages * 4096.0)
}

/// The `p`-th percentile (0–100) of `sorted`; NaN when empty.
pub fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
