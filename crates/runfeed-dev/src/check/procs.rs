//! The processes a check runs: `runfeed serve` instances, its own `redis-server`, and the
//! controls for a lagging replica and a Redis Cluster node. Only processes started here are
//! ever signalled, always by their own pid.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// A free TCP port on 127.0.0.1 (bound once, then released).
///
/// # Errors
/// When no port can be bound.
pub fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("bind a free port")?;
    Ok(l.local_addr()?.port())
}

/// Sends SIGTERM to `pid` (a child of this process).
async fn sigterm(pid: u32) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status()
        .await
        .context("run kill -TERM")?;
    if !status.success() {
        bail!("kill -TERM {pid} failed");
    }
    Ok(())
}

/// How to start a `runfeed serve` instance.
#[derive(Clone, Debug)]
pub struct InstanceConfig {
    /// The `runfeed` binary.
    pub binary: PathBuf,
    pub database_url: String,
    pub replica_url: Option<String>,
    pub redis_url: String,
    /// `redis.cluster = true` (sharded pub/sub).
    pub cluster: bool,
    /// Extra `RUNFEED_*` configuration variables.
    pub env: Vec<(String, String)>,
    /// Where instance logs go (`instance-<n>.log`).
    pub log_dir: PathBuf,
}

/// One running (or restarting) `runfeed serve`.
pub struct Instance {
    /// 0-based.
    pub index: usize,
    /// The HTTP port (kept across restarts, so clients' base URLs stay valid).
    pub port: u16,
    /// The admin port (`/readyz`).
    pub admin_port: u16,
    child: Option<Child>,
    cfg: InstanceConfig,
    /// Starts so far.
    pub starts: usize,
    /// `runfeed_feeds_stalled_streams_total` of the processes stopped so far (read before
    /// each stop).
    stalled_streams: f64,
}

impl Instance {
    /// `http://127.0.0.1:<port>`.
    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts instance `index` on free ports and waits for its "listening" line (30 s).
    ///
    /// # Errors
    /// When the process cannot be spawned or does not listen in time.
    pub async fn start(cfg: InstanceConfig, index: usize) -> anyhow::Result<Instance> {
        let mut inst = Instance {
            index,
            port: free_port()?,
            admin_port: free_port()?,
            child: None,
            cfg,
            starts: 0,
            stalled_streams: 0.0,
        };
        inst.spawn().await?;
        Ok(inst)
    }

    fn log_path(&self) -> PathBuf {
        self.cfg
            .log_dir
            .join(format!("instance-{}.log", self.index))
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .with_context(|| format!("open {}", self.log_path().display()))?;
        let mut cmd = Command::new(&self.cfg.binary);
        cmd.arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--database-url")
            .arg(&self.cfg.database_url)
            .arg("--redis-url")
            .arg(&self.cfg.redis_url);
        if let Some(replica) = &self.cfg.replica_url {
            cmd.arg("--replica-url").arg(replica);
        }
        cmd.env(
            "RUNFEED_TELEMETRY__ADMIN_LISTEN",
            format!("127.0.0.1:{}", self.admin_port),
        )
        .env("RUNFEED_REDIS__CLUSTER", self.cfg.cluster.to_string())
        .env("RUST_LOG", "warn,runfeed=info")
        .envs(self.cfg.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env_remove("DATABASE_URL")
        .env_remove("DATABASE_READ_REPLICA_URL")
        .env_remove("REDIS_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", self.cfg.binary.display()))?;
        let stdout = child.stdout.take().context("instance stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let listening = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await? {
                if line.starts_with("runfeed listening on ") {
                    return Ok::<bool, std::io::Error>(true);
                }
            }
            Ok(false)
        })
        .await;
        match listening {
            Ok(Ok(true)) => {}
            other => {
                let _ = child.kill().await;
                bail!(
                    "instance {} did not start listening ({other:?}); see {}",
                    self.index,
                    self.log_path().display()
                );
            }
        }
        // Keep draining stdout so the process never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        self.child = Some(child);
        self.starts += 1;
        self.wait_ready(Duration::from_secs(30)).await?;
        Ok(())
    }

    /// Waits until `/readyz` answers 200 (Postgres answers, Redis subscriber connected).
    ///
    /// # Errors
    /// When it does not within `limit`.
    pub async fn wait_ready(&self, limit: Duration) -> anyhow::Result<()> {
        let url = format!("http://127.0.0.1:{}/readyz", self.admin_port);
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(2))
            .build()?;
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Ok(r) = http.get(&url).send().await {
                if r.status().as_u16() == 200 {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() > deadline {
                bail!("instance {} not ready within {limit:?}", self.index);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM (graceful drain), wait for the exit (SIGKILL after 15 s), start again on the
    /// same port. Returns the time the instance was down for.
    ///
    /// # Errors
    /// When the restart fails.
    pub async fn restart(&mut self, down: Duration) -> anyhow::Result<()> {
        self.stop(Duration::from_secs(15)).await?;
        tokio::time::sleep(down).await;
        self.spawn().await
    }

    /// SSE streams the server ended because their client stopped reading
    /// (`runfeed_feeds_stalled_streams_total`), over every process of this instance so far
    /// (the running one read now).
    pub async fn stalled_streams(&self) -> f64 {
        self.stalled_streams + self.read_stalled_streams().await
    }

    async fn read_stalled_streams(&self) -> f64 {
        if self.child.is_none() {
            return 0.0;
        }
        let url = format!("http://127.0.0.1:{}/metrics", self.admin_port);
        let scrape = async {
            let text = reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(2))
                .build()?
                .get(&url)
                .send()
                .await?
                .text()
                .await?;
            Ok::<String, reqwest::Error>(text)
        };
        scrape.await.ok().map_or(0.0, |text| {
            crate::measure::metric_sum(&text, "runfeed_feeds_stalled_streams_total").unwrap_or(0.0)
        })
    }

    /// SIGTERM and wait for the exit (SIGKILL after `limit`).
    ///
    /// # Errors
    /// When the signal cannot be sent.
    pub async fn stop(&mut self, limit: Duration) -> anyhow::Result<()> {
        self.stalled_streams += self.read_stalled_streams().await;
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if let Some(pid) = child.id() {
            sigterm(pid).await?;
        }
        match tokio::time::timeout(limit, child.wait()).await {
            Ok(_) => Ok(()),
            Err(_) => {
                let _ = child.kill().await;
                Ok(())
            }
        }
    }
}

/// A `redis-server` this check started (never the shared one).
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    log: PathBuf,
}

impl RedisServer {
    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts `redis-server` on a free port (no persistence), waits for PING.
    ///
    /// # Errors
    /// When it does not start.
    pub async fn start(log_dir: &Path) -> anyhow::Result<RedisServer> {
        let mut r = RedisServer {
            port: free_port()?,
            child: None,
            log: log_dir.join("redis.log"),
        };
        r.spawn().await?;
        Ok(r)
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .context("spawn redis-server")?;
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while !ping(self.port).await {
            if tokio::time::Instant::now() > deadline {
                bail!("redis-server on {} did not answer PING", self.port);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// `CLIENT PAUSE <for_ms> ALL`: the server keeps every connection and answers nothing
    /// (commands and published messages wait) for `for_ms`; returns once the pause is over.
    ///
    /// # Errors
    /// When the server does not accept the command.
    pub async fn pause(&self, pause: Duration) -> anyhow::Result<()> {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
        let ms = pause.as_millis().to_string();
        let cmd = format!(
            "*4\r\n$6\r\nCLIENT\r\n$5\r\nPAUSE\r\n${}\r\n{ms}\r\n$3\r\nALL\r\n",
            ms.len()
        );
        s.write_all(cmd.as_bytes()).await?;
        let mut ok = [0u8; 5];
        s.read_exact(&mut ok).await?;
        anyhow::ensure!(
            &ok == b"+OK\r\n",
            "CLIENT PAUSE: {:?}",
            String::from_utf8_lossy(&ok)
        );
        tokio::time::sleep(pause).await;
        Ok(())
    }

    /// SIGSTOP for `frozen`, then SIGCONT: connections stay open, the process answers nothing
    /// and the kernel keeps accepting bytes until its buffers fill.
    ///
    /// # Errors
    /// When the process cannot be signalled.
    pub async fn freeze(&self, frozen: Duration) -> anyhow::Result<()> {
        let pid = self
            .child
            .as_ref()
            .and_then(Child::id)
            .context("redis-server is not running")?
            .to_string();
        let status = Command::new("kill").args(["-STOP", &pid]).status().await?;
        anyhow::ensure!(status.success(), "kill -STOP {pid}");
        tokio::time::sleep(frozen).await;
        let status = Command::new("kill").args(["-CONT", &pid]).status().await?;
        anyhow::ensure!(status.success(), "kill -CONT {pid}");
        Ok(())
    }

    /// Kills the server (a crash: SIGKILL), waits `down`, starts it again on the same port.
    ///
    /// # Errors
    /// When it does not come back.
    pub async fn restart(&mut self, down: Duration) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
        tokio::time::sleep(down).await;
        self.spawn().await
    }
}

/// Whether a Redis on `port` answers `PING` with `+PONG`.
async fn ping(port: u16) -> bool {
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"PING\r\n").await?;
        let mut buf = [0u8; 7];
        s.read_exact(&mut buf).await?;
        Ok::<bool, std::io::Error>(&buf == b"+PONG\r\n")
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), attempt).await,
        Ok(Ok(true))
    )
}

/// Controls a streaming replica's apply delay (`recovery_min_apply_delay`) and samples how far
/// its replay trails.
#[derive(Clone)]
pub struct ReplicaControl {
    pool: sqlx::PgPool,
}

impl ReplicaControl {
    /// Connects to the replica's `postgres` database at `replica_admin_url`.
    ///
    /// # Errors
    /// When the replica does not answer or is not in recovery.
    pub async fn connect(replica_admin_url: &str) -> anyhow::Result<ReplicaControl> {
        let url = crate::fixtures::database_url(replica_admin_url, "postgres");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&url)
            .await
            .with_context(|| format!("connect to the replica {url}"))?;
        let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
            .fetch_one(&pool)
            .await?;
        if !in_recovery {
            bail!("{url} is not a replica (pg_is_in_recovery() is false)");
        }
        Ok(ReplicaControl { pool })
    }

    /// The current `recovery_min_apply_delay`, ms.
    ///
    /// # Errors
    /// When the query fails.
    pub async fn delay_ms(&self) -> anyhow::Result<u64> {
        let ms: String = sqlx::query_scalar(
            "SELECT setting FROM pg_settings WHERE name = 'recovery_min_apply_delay'",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(ms.parse().unwrap_or(0))
    }

    /// How far replay trails now, ms: the replica's `now()` minus the commit time of the last
    /// replayed transaction (`pg_last_xact_replay_timestamp()`) while the replica has received
    /// WAL it has not replayed yet, and 0 when it has replayed all it received. Without that
    /// condition a quiet primary (the checker's writers stop for the convergence tail) reads as
    /// a growing lag (11–13 s by the end of a run).
    ///
    /// # Errors
    /// When the query fails.
    pub async fn replay_lag_ms(&self) -> anyhow::Result<f64> {
        let lag: Option<f64> = sqlx::query_scalar(
            "SELECT CASE WHEN pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN 0::float8 \
             ELSE (EXTRACT(EPOCH FROM (now() - pg_last_xact_replay_timestamp())) * 1000)::float8 END",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(lag.unwrap_or(0.0).max(0.0))
    }

    /// Sets `recovery_min_apply_delay` (ALTER SYSTEM + `pg_reload_conf()`).
    ///
    /// # Errors
    /// When the statements fail.
    pub async fn set_delay_ms(&self, ms: u64) -> anyhow::Result<()> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER SYSTEM SET recovery_min_apply_delay = '{ms}ms'"
        )))
        .execute(&self.pool)
        .await
        .context("ALTER SYSTEM SET recovery_min_apply_delay")?;
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

/// Waits until database `name` and its tables exist on the replica (its creation has been
/// replayed); returns the replica URL of that database.
///
/// # Errors
/// When it does not appear within `limit`.
pub async fn wait_replicated(
    replica_admin_url: &str,
    name: &str,
    limit: Duration,
) -> anyhow::Result<String> {
    let url = crate::fixtures::database_url(replica_admin_url, name);
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let probe = async {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(2))
                .connect(&url)
                .await?;
            let n: i64 = sqlx::query_scalar(r#"SELECT count(*) FROM "RuntimeEnvironment""#)
                .fetch_one(&pool)
                .await?;
            pool.close().await;
            Ok::<i64, sqlx::Error>(n)
        };
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), probe).await {
            return Ok(url);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("database {name} did not appear on the replica within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Restarts node `node` (1..3) of the local Redis Cluster at `base_port` with
/// `scripts/redis-cluster.sh restart-node` (which waits for `cluster_state:ok`).
///
/// # Errors
/// When the script fails.
pub async fn restart_cluster_node(
    repo: &Path,
    base_port: u16,
    node: usize,
    down: Duration,
) -> anyhow::Result<()> {
    cluster_script(
        repo,
        &[
            "restart-node".to_string(),
            node.to_string(),
            "--base-port".to_string(),
            base_port.to_string(),
            "--down-ms".to_string(),
            down.as_millis().to_string(),
        ],
    )
    .await
    .map(|_| ())
}

/// Runs `scripts/redis-cluster.sh` with `args`; returns its standard output.
///
/// # Errors
/// When the script cannot be run or fails (its standard error in the message).
async fn cluster_script(repo: &Path, args: &[String]) -> anyhow::Result<String> {
    let out = Command::new("bash")
        .arg(repo.join("scripts/redis-cluster.sh"))
        .args(args)
        .output()
        .await
        .with_context(|| format!("run scripts/redis-cluster.sh {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "scripts/redis-cluster.sh {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Replicas in the local Redis Cluster at `base_port` (from `CLUSTER NODES` of its first node).
///
/// # Errors
/// When `redis-cli` cannot be run or the node does not answer.
pub async fn cluster_replicas(base_port: u16) -> anyhow::Result<usize> {
    let out = Command::new("redis-cli")
        .args(["-p", &base_port.to_string(), "cluster", "nodes"])
        .output()
        .await
        .context("run redis-cli cluster nodes")?;
    anyhow::ensure!(
        out.status.success(),
        "redis-cli -p {base_port} cluster nodes failed"
    );
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .nth(2)
                .is_some_and(|f| f.contains("slave"))
        })
        .count())
}

/// Fails over the master serving `slot` in the local Redis Cluster at `base_port` (3 masters
/// with a replica each) with `scripts/redis-cluster.sh failover --mode <mode>` (`kill` or
/// `takeover`; the script waits for `cluster_state:ok` on every node); returns
/// `master → promoted replica`.
///
/// # Errors
/// When no node names the slot's master or the script fails.
pub async fn cluster_failover(
    repo: &Path,
    base_port: u16,
    slot: u16,
    mode: &str,
) -> anyhow::Result<String> {
    let mut master = None;
    for port in base_port..base_port + 6 {
        if let Ok(m) = crate::faults::cluster::master_of(port, slot).await {
            master = Some(m);
            break;
        }
    }
    let master = master.with_context(|| format!("no node names the master of slot {slot}"))?;
    let out = cluster_script(
        repo,
        &[
            "failover".to_string(),
            master.to_string(),
            "--base-port".to_string(),
            base_port.to_string(),
            "--mode".to_string(),
            mode.to_string(),
        ],
    )
    .await?;
    let promoted = out
        .lines()
        .find_map(|l| l.strip_prefix("PROMOTED=").map(str::to_string))
        .unwrap_or_default();
    Ok(format!("master {master} → replica {promoted} ({mode})"))
}

/// The first port of a `redis-cluster://host:port?node=…` (or `redis://host:port,…`) URL.
pub fn cluster_base_port(url: &str) -> Option<u16> {
    let rest = url.split_once("://")?.1;
    let first = rest.split(['?', ',', '/']).next()?;
    first.rsplit_once(':')?.1.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_base_port_is_the_first_node() {
        assert_eq!(
            cluster_base_port("redis-cluster://127.0.0.1:7100?node=127.0.0.1:7101"),
            Some(7100)
        );
        assert_eq!(
            cluster_base_port("redis://127.0.0.1:7300,127.0.0.1:7301"),
            Some(7300)
        );
    }
}
