//! The fleet scenario (scripts/fleet-bench.sh): more held feeds than one process may open
//! files for, so several `fleet-hold` processes share one environment written by
//! `fleet-setup`, and `fleet-change` announces the one change through a file.

use super::*;

#[derive(Args)]
pub(crate) struct FleetSetupArgs {
    #[command(flatten)]
    common: Common,
    /// Where to write the environment and runs (JSON).
    #[arg(long)]
    out: String,
}

#[derive(Args)]
pub(crate) struct FleetHoldArgs {
    #[command(flatten)]
    common: Common,
    /// The JSON `fleet-setup` wrote.
    #[arg(long)]
    setup: String,
    /// Idle run feeds (the cold run), spread round-robin over the instances.
    #[arg(long, default_value_t = 1000)]
    idle: usize,
    /// Hot tag feeds (tag `hot`), spread round-robin over the instances.
    #[arg(long, default_value_t = 100)]
    hot: usize,
    /// The file `fleet-change` writes the publish time into.
    #[arg(long)]
    go_file: String,
    /// Give up waiting for the change after this long (s).
    #[arg(long, default_value_t = 300.0)]
    max_wait_s: f64,
}

#[derive(Args)]
pub(crate) struct FleetChangeArgs {
    #[command(flatten)]
    common: Common,
    /// The JSON `fleet-setup` wrote.
    #[arg(long)]
    setup: String,
    /// Where to write the publish time (Unix ms).
    #[arg(long)]
    go_file: String,
}

fn unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

struct Setup {
    env: DemoEnv,
    hot_run: String,
    cold_run: String,
}

fn read_setup(path: &str) -> anyhow::Result<Setup> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let s = |k: &str| -> anyhow::Result<String> {
        Ok(v[k].as_str().context(format!("{k} in {path}"))?.to_string())
    };
    Ok(Setup {
        env: DemoEnv {
            env_id: s("env_id")?,
            api_key: s("api_key")?,
            org_id: s("org_id")?,
            project_id: s("project_id")?,
        },
        hot_run: s("hot_run")?,
        cold_run: s("cold_run")?,
    })
}

pub(crate) async fn setup(a: FleetSetupArgs) -> anyhow::Result<()> {
    let b = Bench::new(a.common.clone()).await?;
    let env = b.env().await?;
    let hot_run = b.tagged_run(&env, "hot").await?;
    let cold_run = b.tagged_run(&env, "cold").await?;
    let out = json!({
        "env_id": env.env_id, "api_key": env.api_key, "org_id": env.org_id,
        "project_id": env.project_id, "hot_run": hot_run, "cold_run": cold_run,
    });
    std::fs::write(&a.out, serde_json::to_string_pretty(&out)?)?;
    Ok(())
}

pub(crate) async fn change(a: FleetChangeArgs) -> anyhow::Result<()> {
    let b = Bench::new(a.common.clone()).await?;
    let setup = read_setup(&a.setup)?;
    let published = unix_ms();
    b.change(&setup.env, &setup.hot_run, "hot").await?;
    std::fs::write(&a.go_file, format!("{published}"))?;
    Ok(())
}

/// One feed a `fleet-hold` process follows.
struct Follower {
    b: Arc<Bench>,
    /// The instance it polls.
    base: String,
    token: Arc<String>,
    feed: Feed,
    /// Hot: stops at the first response that carries a change.
    hot: bool,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

/// One feed's loop: re-polls as holds expire (like a client) until `stop`; a hot feed
/// returns the Unix ms of the first response that carries a change.
async fn follow(f: Follower, mut at: Arc<Resp>) -> Option<f64> {
    let Follower {
        b,
        base,
        token,
        feed,
        hot,
        stop,
    } = f;
    let client = b.client().clone();
    let (path, params) = feed.path_and_params();
    while !stop.load(Ordering::Relaxed) {
        let mut p = params.clone();
        p.extend([
            ("cursor", at.cursor.clone().unwrap_or_default()),
            ("handle", at.handle.clone().unwrap_or_default()),
            ("live", "true".into()),
            ("offset", at.offset.clone().unwrap_or_else(|| "-1".into())),
        ]);
        match b.get_at(&base, &client, &token, &path, &p).await {
            Ok(r) if r.status == 200 => {
                if hot && !r.changed_ids().is_empty() {
                    return Some(unix_ms());
                }
                at = Arc::new(r);
            }
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    None
}

pub(crate) async fn hold(a: FleetHoldArgs) -> anyhow::Result<()> {
    let b = Arc::new(Bench::new(a.common.clone()).await?);
    let setup = read_setup(&a.setup)?;
    let bases: Vec<String> = a
        .common
        .base_url
        .split(',')
        .map(|u| u.trim_end_matches('/').to_string())
        .collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut idle = Vec::with_capacity(a.idle);
    let mut hot = Vec::with_capacity(a.hot);
    // Both snapshots first, then the feeds in steps of 200 every 20 ms: a burst of
    // thousands of connects at once overflows the instances' accept queues.
    let mut kinds = Vec::new();
    for (n, is_hot) in [(a.idle, false), (a.hot, true)] {
        let feed = if is_hot {
            Feed::tag("hot")
        } else {
            Feed::Run(format!("run_{}", setup.cold_run))
        };
        let token = Arc::new(Bench::token(&setup.env, &feed));
        let (path, mut params) = feed.path_and_params();
        params.push(("offset", "-1".into()));
        let at = b
            .get_at(&bases[0], b.client(), &token, &path, &params)
            .await?;
        if at.status != 200 {
            bail!("snapshot of {feed:?}: status {}", at.status);
        }
        kinds.push((n, is_hot, feed, token, Arc::new(at)));
    }
    for (n, is_hot, feed, token, at) in kinds {
        for i in 0..n {
            if i % 200 == 199 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let follower = Follower {
                b: b.clone(),
                base: bases[i % bases.len()].clone(),
                token: token.clone(),
                feed: feed.clone(),
                hot: is_hot,
                stop: stop.clone(),
            };
            let task = tokio::spawn(follow(follower, at.clone()));
            if is_hot {
                hot.push(task)
            } else {
                idle.push(task)
            }
        }
    }
    eprintln!("fleet-hold: {} idle + {} hot feeds started", a.idle, a.hot);
    let deadline = Instant::now() + Duration::from_secs_f64(a.max_wait_s);
    let published = loop {
        if let Some(ms) = std::fs::read_to_string(&a.go_file)
            .ok()
            .and_then(|t| t.trim().parse::<f64>().ok())
        {
            break ms;
        }
        if Instant::now() > deadline {
            bail!("no change announced in {}", a.go_file);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut lat = Vec::with_capacity(a.hot);
    let mut errors = 0usize;
    for t in hot {
        match tokio::time::timeout(Duration::from_secs(60), t).await {
            Ok(Ok(Some(at))) => lat.push(at - published),
            _ => errors += 1,
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in idle {
        t.abort();
    }
    lat.sort_by(f64::total_cmp);
    report(
        &a.common,
        "fleet-hold",
        json!({"idle": a.idle, "hot": a.hot, "instances": bases.len()}),
        vec![
            ("hot responses", json!(lat.len())),
            ("hot errors", json!(errors)),
            ("publish -> response p50 (ms)", json!(pct(&lat, 50.0))),
            ("publish -> response p99 (ms)", json!(pct(&lat, 99.0))),
            (
                "publish -> response max (ms)",
                json!(lat.last().copied().unwrap_or(f64::NAN)),
            ),
        ],
    )
}
