//! `fanout`: F feeds on one tag, one change; time until the last feed has its response, and new-connection answer times during the wake.

use super::*;

#[derive(Args)]
pub(crate) struct FanoutArgs {
    #[command(flatten)]
    common: Common,
    /// Feeds on the hot tag.
    #[arg(long, default_value_t = 1000)]
    f: usize,
    /// Long-polls, SSE streams, or both (one pass each).
    #[arg(long, value_enum, default_value_t = Transport::LongPoll)]
    transport: Transport,
    /// Pause between "all held" and the change, ms (time to zero a profiler's counters, e.g.
    /// `callgrind_control -z`).
    #[arg(long, default_value_t = 300)]
    settle_ms: u64,
    /// Keep the connections open this long after printing the figures, ms (a profiler can stop
    /// before their teardown, e.g. `callgrind_control -d`).
    #[arg(long, default_value_t = 0)]
    linger_ms: u64,
}

pub(crate) async fn fanout(a: FanoutArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let passes = a.transport.passes();
    let several = passes.len() > 1;
    let mut rows: Vec<(String, Value)> = Vec::new();
    for sse in passes {
        let env = b.env().await?;
        let hot = b.tagged_run(&env, "hot").await?;
        let token = Bench::token(&env, &Feed::tag("hot"));
        let snap = Arc::new(b.snapshot(&token, &Feed::tag("hot")).await?);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let held_before = b.metric("runfeed_router_held_feeds").await.unwrap_or(0.0) as usize;
        let park_what = Park {
            n: a.f,
            token: &token,
            feed: &Feed::tag("hot"),
            at: &snap,
            sse,
        };
        let tasks = park(&b, park_what);
        let all_held = b
            .wait_held(held_before + a.f, Duration::from_secs(60))
            .await;
        // New connections while nothing happens, then while the change wakes every feed: the
        // accept loop must keep its turn.
        let idle_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let idle_probe = accept_probe(b.base.clone(), idle_stop.clone());
        tokio::time::sleep(Duration::from_millis(200)).await;
        idle_stop.store(true, Ordering::Relaxed);
        let mut idle_probe = idle_probe.join().unwrap_or_default();
        // Let any cold re-checks finish before the baseline.
        tokio::time::sleep(Duration::from_millis(a.settle_ms)).await;
        let q0 = b.metric("runfeed_pg_queries_total").await;
        let s0 = b.metric("runfeed_router_distinct_runs_total").await;
        let d0 = b.metric("runfeed_router_deliveries_total").await;
        let cpu0 = b.server_cpu();
        let client_cpu0 = own_cpu_s();
        let probe_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let probe = accept_probe(b.base.clone(), probe_stop.clone());
        let published = Instant::now();
        b.change(&env, &hot, "hot").await?;
        let mut lat = Vec::with_capacity(a.f);
        let mut errors = 0usize;
        for t in tasks {
            match tokio::time::timeout(Duration::from_secs(120), t).await {
                Ok(Ok((Some(200), at))) => lat.push(ms(at.duration_since(published))),
                _ => errors += 1,
            }
        }
        // CPU from the publish to the last response (the server's includes the hydrate).
        let server_cpu = delta(cpu0, b.server_cpu());
        let client_cpu = delta(client_cpu0, own_cpu_s());
        let per_response_us = |cpu: Option<f64>| opt(cpu.map(|s| s * 1e6 / a.f.max(1) as f64));
        probe_stop.store(true, Ordering::Relaxed);
        let mut during = probe.join().unwrap_or_default();
        during.sort_by(f64::total_cmp);
        idle_probe.sort_by(f64::total_cmp);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let q1 = b.metric("runfeed_pg_queries_total").await;
        let s1 = b.metric("runfeed_router_distinct_runs_total").await;
        let d1 = b.metric("runfeed_router_deliveries_total").await;
        // SSE streams stay open after their first event: end them before the next pass.
        b.wait_released(held_before + a.f, Duration::from_secs(1))
            .await;
        lat.sort_by(f64::total_cmp);
        let l = |figure: &str| label(figure, sse, several);
        rows.extend([
            (l("all feeds held"), json!(all_held)),
            (l("responses"), json!(lat.len())),
            (l("errors"), json!(errors)),
            (l("last response p50 (ms)"), json!(pct(&lat, 50.0))),
            (l("last response p99 (ms)"), json!(pct(&lat, 99.0))),
            (
                l("last response max (ms)"),
                json!(lat.last().copied().unwrap_or(f64::NAN)),
            ),
            (l("postgres queries for the change"), opt(delta(q0, q1))),
            (
                l("serializations (router distinct runs)"),
                opt(delta(s0, s1)),
            ),
            (l("router deliveries"), opt(delta(d0, d1))),
            (l("server CPU for the change (s)"), opt(server_cpu)),
            (
                l("server CPU per response (us)"),
                per_response_us(server_cpu),
            ),
            (
                l("bench client CPU per response (us)"),
                per_response_us(client_cpu),
            ),
            (
                l("new connection answered, idle p50 (ms)"),
                json!(pct(&idle_probe, 50.0)),
            ),
            (
                l("new connections answered during the wake"),
                json!(during.len()),
            ),
            (
                l("new connection answered during the wake, p50 (ms)"),
                json!(pct(&during, 50.0)),
            ),
            (
                l("new connection answered during the wake, max (ms)"),
                json!(during.last().copied().unwrap_or(f64::NAN)),
            ),
        ]);
    }
    report(
        &a.common,
        "fanout",
        json!({"f": a.f, "transport": format!("{:?}", a.transport).to_lowercase()}),
        rows,
    )?;
    tokio::time::sleep(Duration::from_millis(a.linger_ms)).await;
    Ok(())
}

/// One fresh TCP connection's `GET /healthz` (connect → first response byte), ms; `None` when it
/// fails.
async fn answer_new_connection(base: &str) -> Option<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.strip_prefix("http://")?.trim_end_matches('/');
    let started = Instant::now();
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET /healthz HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut first = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut first)).await;
    matches!(read, Ok(Ok(1))).then(|| ms(started.elapsed()))
}

/// New-connection answer times (ms), one probe every 2 ms until `stop` is set. The probe runs on
/// a thread and runtime of its own, so the bench's own busy workers (reading thousands of
/// responses) do not delay it.
fn accept_probe(
    base: String,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<f64>> {
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return Vec::new();
        };
        rt.block_on(async {
            let mut times = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                times.extend(answer_new_connection(&base).await);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            times
        })
    })
}
