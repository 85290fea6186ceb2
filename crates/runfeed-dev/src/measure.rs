//! What the benchmarks and fault scenarios read off a server: Prometheus samples of its admin
//! `/metrics`, its RSS and CPU time from `/proc`, and percentiles of what they timed.

/// Sum of every sample of the Prometheus family `name` in `text` (None when absent).
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    metric_sum_where(text, name, |_| true)
}

/// [`metric_sum`] over the samples whose labels include `label` (`key="value"`).
pub fn metric_sum_labelled(text: &str, name: &str, label: &str) -> Option<f64> {
    metric_sum_where(text, name, |labels| labels.split(',').any(|l| l == label))
}

/// Sum of the samples of `name` whose label set (between the braces; empty without) `keep`
/// accepts.
fn metric_sum_where(text: &str, name: &str, keep: impl Fn(&str) -> bool) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let labels = match rest.strip_prefix('{') {
            Some(inner) => inner.split_once('}').map_or("", |(labels, _)| labels),
            None if rest.starts_with(' ') => "",
            None => continue,
        };
        if !keep(labels) {
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

/// Pids of every process named `postgres` on this machine (the postmaster, its background
/// workers and every backend), from `/proc/<pid>/comm`.
pub fn postgres_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim_end() == "postgres")
        })
        .collect()
}

/// CPU seconds spent by a changing set of processes over a window (Postgres backends come and
/// go): each process counts from its CPU time when first seen (0 for one that appeared after
/// [`CpuTally::start`], so its whole life counts) to its CPU time when last seen. Sample often
/// (≈ 0.5 s): what a process spends between its last sample and its exit is lost.
#[derive(Debug, Default)]
pub struct CpuTally {
    started: bool,
    /// pid → (CPU s when first seen, CPU s when last seen).
    seen: std::collections::HashMap<u32, (f64, f64)>,
}

impl CpuTally {
    /// Starts the window with the processes `pids` running now.
    pub fn start(pids: &[u32]) -> CpuTally {
        let mut t = CpuTally::default();
        t.sample(pids);
        t.started = true;
        t
    }

    /// Reads the CPU time of `pids` now.
    pub fn sample(&mut self, pids: &[u32]) {
        for &pid in pids {
            let Some(cpu) = proc_cpu_s(pid) else { continue };
            let base = if self.started { 0.0 } else { cpu };
            let entry = self.seen.entry(pid).or_insert((base, cpu));
            entry.1 = cpu.max(entry.1);
        }
    }

    /// CPU seconds spent in the window so far, over every process seen.
    pub fn total_s(&self) -> f64 {
        self.seen.values().map(|(first, last)| last - first).sum()
    }

    /// Processes seen in the window.
    pub fn processes(&self) -> usize {
        self.seen.len()
    }
}

#[cfg(test)]
mod tests {
    use super::{metric_sum, metric_sum_labelled};

    const TEXT: &str = "# HELP x_total x\nx_total{path=\"a\",kind=\"k\"} 2\nx_total{path=\"b\"} 3\nx_total_other 7\ny 1\n";

    #[test]
    fn a_family_sums_every_sample_and_a_label_only_its_own() {
        assert_eq!(metric_sum(TEXT, "x_total"), Some(5.0));
        assert_eq!(
            metric_sum_labelled(TEXT, "x_total", "path=\"a\""),
            Some(2.0)
        );
        assert_eq!(metric_sum_labelled(TEXT, "x_total", "path=\"c\""), None);
        assert_eq!(metric_sum(TEXT, "y"), Some(1.0));
        assert_eq!(metric_sum(TEXT, "z"), None);
    }
}
