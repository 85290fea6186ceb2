//! Static checks of the container artefacts (docker-compose.yml, Dockerfile, deploy/,
//! grafana/prometheus.yml). No Docker and no network: the files are parsed here, runfeed's commands with the real CLI parser
//! ([`runfeed::cli::Cli`]) and the `RUNFEED_*` variables with the real configuration loader
//! ([`runfeed::config::Config::load`]).
//!
//! Every checker returns the problems it found; each has a test on the real file and one on a
//! small bad input, so a checker that cannot fail is caught too.

use crate::common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser};
use common::checks::{assert_exactly, assert_found, assert_found_all, assert_none, services};
use runfeed::cli::{Cli, Command};
use serde_yaml::Value;

// ---------------------------------------------------------------------------------------------
// Files

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A repository file (absolute path: the figment jail changes the working directory).
fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

fn compose() -> Value {
    parse_compose(&read("docker-compose.yml")).unwrap_or_else(|e| panic!("docker-compose.yml: {e}"))
}

/// `check` finds nothing wrong in the real docker-compose.yml.
fn assert_compose_ok(what: &str, check: impl Fn(&Value) -> Vec<String>) {
    assert_none(&format!("docker-compose.yml {what}"), check(&compose()));
}

/// `check` finds nothing wrong in the real Dockerfile.
fn assert_dockerfile_ok(what: &str, check: impl Fn(&[Instr]) -> Vec<String>) {
    assert_none(&format!("Dockerfile {what}"), check(&dockerfile()));
}

/// A compose document the test writes (it must parse).
fn compose_doc(text: &str) -> Value {
    parse_compose(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// Environment variables from `(name, value)` pairs.
fn env_vars(pairs: &[(&str, &str)]) -> Env {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn dockerfile() -> Vec<Instr> {
    parse_dockerfile(&read("Dockerfile"))
}

// ---------------------------------------------------------------------------------------------
// Environment, the CLI parser and the configuration loader

type Env = BTreeMap<String, String>;

/// Runs `f` with exactly `vars` as the process environment (figment's jail: serialised with
/// every other jail, restored afterwards). The working directory is a temporary one meanwhile.
#[allow(clippy::result_large_err)] // figment's jail closure returns figment::Result
fn with_env<T>(vars: &Env, f: impl FnOnce() -> T) -> T {
    let mut out = None;
    figment::Jail::expect_with(|jail| {
        jail.clear_env();
        for (k, v) in vars {
            jail.set_env(k, v);
        }
        out = Some(f());
        Ok(())
    });
    out.expect("the jail ran")
}

/// `runfeed ARGS…` through the real parser, with `env` as the environment (clap reads
/// `DATABASE_URL`, `RUNFEED_LISTEN`, … from it).
fn parse_cli(args: &[String], env: &Env) -> Result<Cli, String> {
    with_env(env, || {
        Cli::try_parse_from(args).map_err(|e| format!("`{}`: {}", args.join(" "), e.render()))
    })
}

/// `RUNFEED_*` variables that belong to the CLI or logging, not to the configuration.
fn cli_switches() -> Vec<String> {
    fn walk(cmd: &clap::Command, out: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            if let Some(env) = arg.get_env() {
                out.push(env.to_string_lossy().into_owned());
            }
        }
        for sub in cmd.get_subcommands() {
            walk(sub, out);
        }
    }
    let mut out = vec!["RUNFEED_LOG_FORMAT".to_string()];
    walk(&Cli::command(), &mut out);
    out
}

/// Every `RUNFEED_*` variable of `env` is a configuration key (loads through `Config::load`,
/// whose sections reject unknown fields) or a CLI/logging switch; together they load.
fn check_config_env(origin: &str, env: &Env) -> Vec<String> {
    let switches = cli_switches();
    let mut problems = Vec::new();
    let mut keys = Env::new();
    for (name, value) in env.iter().filter(|(k, _)| k.starts_with("RUNFEED_")) {
        if !name.contains("__") {
            if !switches.contains(name) {
                problems.push(format!(
                    "{origin}: {name} is neither a configuration key (RUNFEED_<SECTION>__<KEY>) \
                     nor a CLI/logging variable ({}); runfeed ignores it",
                    switches.join(", ")
                ));
            }
            continue;
        }
        let one = Env::from([(name.clone(), value.clone())]);
        match with_env(&one, || runfeed::config::Config::load(None)) {
            Ok(_) => {
                keys.insert(name.clone(), value.clone());
            }
            Err(e) => problems.push(format!(
                "{origin}: {name}={value} is not a valid configuration key/value: {e} \
                 (keys: `cargo run -q -- config-reference`)"
            )),
        }
    }
    if problems.is_empty() {
        if let Err(e) = with_env(&keys, || runfeed::config::Config::load(None)) {
            problems.push(format!("{origin}: the RUNFEED_ variables together: {e}"));
        }
    }
    problems
}

/// The `runfeed serve` listen address of a parsed command line (flag or `RUNFEED_LISTEN`, then
/// `RUNFEED_SERVER__LISTEN`, then the built-in default).
fn serve_listen(cli: &Cli, env: &Env) -> Option<Result<SocketAddr, String>> {
    let Command::Serve(args) = &cli.command else {
        return None;
    };
    let listen = match &args.listen {
        Some(l) => l.clone(),
        None => match env.get("RUNFEED_SERVER__LISTEN") {
            Some(l) => l.clone(),
            None => runfeed::config::Config::default().server.listen,
        },
    };
    Some(
        listen
            .parse::<SocketAddr>()
            .map_err(|e| format!("listen address {listen:?}: {e}")),
    )
}

/// `(host, port)` of `scheme://user@host:port/db`.
fn url_host(url: &str) -> Option<(String, Option<u16>)> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?']).next()?;
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    match hostport.rsplit_once(':') {
        Some((h, p)) => Some((h.to_string(), p.parse().ok())),
        None => Some((hostport.to_string(), None)),
    }
}

// ---------------------------------------------------------------------------------------------
// docker-compose.yml

/// Parses a compose file and applies YAML merge keys (`<<: *anchor`), which serde_yaml does not
/// do by itself.
fn parse_compose(text: &str) -> Result<Value, String> {
    let mut doc: Value = serde_yaml::from_str(text).map_err(|e| format!("not YAML: {e}"))?;
    doc.apply_merge()
        .map_err(|e| format!("bad merge key (<<): {e}"))?;
    match doc.get("services") {
        Some(Value::Mapping(m)) if !m.is_empty() => Ok(doc),
        _ => Err("no `services` mapping".into()),
    }
}

fn service<'a>(doc: &'a Value, name: &str) -> Option<&'a Value> {
    doc["services"].get(name)
}

fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Null => Some(String::new()),
        _ => None,
    }
}

/// `environment` as a map (compose accepts a mapping or a list of `KEY=VALUE`).
fn env_of(svc: &Value) -> Env {
    let mut env = Env::new();
    match svc.get("environment") {
        Some(Value::Mapping(m)) => {
            for (k, v) in m {
                if let (Some(k), Some(v)) = (k.as_str(), scalar(v)) {
                    env.insert(k.to_string(), v);
                }
            }
        }
        Some(Value::Sequence(items)) => {
            for item in items.iter().filter_map(|i| i.as_str()) {
                let (k, v) = item.split_once('=').unwrap_or((item, ""));
                env.insert(k.to_string(), v.to_string());
            }
        }
        _ => {}
    }
    env
}

/// A `command` / `entrypoint` as words (a string is split on whitespace, as compose does for
/// strings without quotes).
fn words(v: Option<&Value>) -> Option<Vec<String>> {
    match v? {
        Value::String(s) => Some(s.split_whitespace().map(str::to_string).collect()),
        Value::Sequence(items) => Some(items.iter().filter_map(scalar).collect()),
        _ => None,
    }
}

/// Services built from this repository (the runfeed image).
fn built_here(svc: &Value) -> bool {
    svc.get("build").is_some()
}

/// The service running `runfeed serve`, with its parsed command line.
fn serve_service(doc: &Value) -> Option<(String, &Value)> {
    services(doc).into_iter().find(|(_, svc)| {
        built_here(svc)
            && words(svc.get("command")).is_some_and(|c| c.first().is_some_and(|w| w == "serve"))
    })
}

fn depends_on(svc: &Value) -> Vec<String> {
    match svc.get("depends_on") {
        Some(Value::Sequence(items)) => items.iter().filter_map(scalar).collect(),
        Some(Value::Mapping(m)) => m.keys().filter_map(scalar).collect(),
        _ => Vec::new(),
    }
}

/// `(host source, container target)` of every bind mount (short `./src:/dst[:ro]` or long
/// `{type: bind, source, target}` syntax); named volumes are skipped.
fn bind_mounts(svc: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for vol in svc
        .get("volumes")
        .and_then(|v| v.as_sequence())
        .into_iter()
        .flatten()
    {
        match vol {
            Value::String(s) => {
                let mut parts = s.splitn(3, ':');
                let src = parts.next().unwrap_or("");
                let dst = parts.next().unwrap_or("");
                if src.starts_with('.') || src.starts_with('/') || src.starts_with('~') {
                    out.push((src.to_string(), dst.to_string()));
                }
            }
            Value::Mapping(_) if vol.get("type").and_then(|t| t.as_str()) == Some("bind") => {
                let get = |k: &str| vol.get(k).and_then(scalar).unwrap_or_default();
                out.push((get("source"), get("target")));
            }
            _ => {}
        }
    }
    out
}

fn check_depends_on(doc: &Value) -> Vec<String> {
    let names: Vec<String> = services(doc).into_iter().map(|(n, _)| n).collect();
    let mut problems = Vec::new();
    for (name, svc) in services(doc) {
        for dep in depends_on(svc) {
            if !names.contains(&dep) {
                problems.push(format!(
                    "service {name} depends on {dep}, which is not a service"
                ));
            }
            if dep == name {
                problems.push(format!("service {name} depends on itself"));
            }
        }
    }
    problems
}

fn check_image_or_build(doc: &Value) -> Vec<String> {
    services(doc)
        .into_iter()
        .filter(|(_, svc)| svc.get("image").is_none() && svc.get("build").is_none())
        .map(|(name, _)| format!("service {name} has neither `image` nor `build`"))
        .collect()
}

fn check_bind_mounts(doc: &Value, root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    for (name, svc) in services(doc) {
        for (src, dst) in bind_mounts(svc) {
            if !src.starts_with("./") && src != "." {
                problems.push(format!(
                    "service {name}: bind mount {src} is outside the repository (use ./…)"
                ));
            } else if !root.join(&src).exists() {
                problems.push(format!(
                    "service {name}: bind mount source {src} (→ {dst}) does not exist in the repository"
                ));
            }
        }
    }
    problems
}

/// `runfeed-demo`'s command line.
#[derive(clap::Parser)]
struct DemoCli {
    #[command(flatten)]
    _args: runfeed_dev::demo::DemoArgs,
}

/// The runfeed image's ENTRYPOINT (compose's `command` replaces only its CMD).
fn image_entrypoint() -> Vec<String> {
    exec_form(&dockerfile(), "ENTRYPOINT").unwrap_or_else(|| vec!["runfeed".into()])
}

fn check_runfeed_commands(doc: &Value, entrypoint: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    for (name, svc) in services(doc).into_iter().filter(|(_, s)| built_here(s)) {
        let entry = words(svc.get("entrypoint")).unwrap_or_else(|| entrypoint.to_vec());
        let Some(command) = words(svc.get("command")) else {
            continue; // the image's CMD: checked with the Dockerfile
        };
        let args: Vec<String> = entry.into_iter().chain(command).collect();
        let env = env_of(svc);
        if args.first().is_some_and(|w| w == "runfeed-demo") {
            // The development workload (crates/runfeed-dev): its own command line.
            if let Err(e) = with_env(&env, || DemoCli::try_parse_from(&args)) {
                problems.push(format!("service {name}: runfeed-demo rejects {e}"));
            }
            continue;
        }
        match parse_cli(&args, &env) {
            Ok(cli) => {
                if let Some(Err(e)) = serve_listen(&cli, &env) {
                    problems.push(format!("service {name}: {e}"));
                }
            }
            Err(e) => problems.push(format!("service {name}: the CLI rejects {e}")),
        }
    }
    problems
}

fn check_compose_env(doc: &Value) -> Vec<String> {
    services(doc)
        .into_iter()
        .filter(|(_, s)| built_here(s))
        .flat_map(|(name, svc)| check_config_env(&format!("service {name}"), &env_of(svc)))
        .collect()
}

/// `-c name=value` settings of a Postgres server command.
fn pg_settings(command: &[String]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut it = command.iter();
    while let Some(w) = it.next() {
        let setting = if w == "-c" {
            it.next().cloned()
        } else {
            w.strip_prefix("-c").map(str::to_string).or_else(|| {
                w.strip_prefix("--")
                    .filter(|s| s.contains('='))
                    .map(|s| s.replace('-', "_"))
            })
        };
        if let Some((k, v)) = setting.as_deref().and_then(|s| s.split_once('=')) {
            out.insert(k.trim().to_string(), v.trim().to_string());
        }
    }
    out
}

/// The primary: the host of the serve service's `DATABASE_URL`.
fn primary_name(doc: &Value) -> Result<String, String> {
    let (name, svc) = serve_service(doc).ok_or("no service runs `runfeed serve`")?;
    let url = env_of(svc)
        .get("DATABASE_URL")
        .cloned()
        .ok_or(format!("service {name} sets no DATABASE_URL"))?;
    let (host, _) = url_host(&url).ok_or(format!("DATABASE_URL {url} has no host"))?;
    Ok(host)
}

fn check_primary_postgres(doc: &Value) -> Vec<String> {
    let primary = match primary_name(doc) {
        Ok(p) => p,
        Err(e) => return vec![e],
    };
    let Some(svc) = service(doc, &primary) else {
        return vec![format!(
            "runfeed's DATABASE_URL host {primary} is not a service"
        )];
    };
    let mut problems = Vec::new();
    let command = words(svc.get("command")).unwrap_or_default();
    let settings = pg_settings(&command);
    if settings.get("wal_level").map(String::as_str) != Some("logical") {
        problems.push(format!(
            "service {primary} (the primary) must run with `-c wal_level=logical`; command: {command:?}"
        ));
    }
    for key in ["max_wal_senders", "max_replication_slots"] {
        match settings.get(key).map(|v| v.parse::<u32>()) {
            Some(Ok(n)) if n > 0 => {}
            _ => problems.push(format!(
                "service {primary} (the primary) must set `-c {key}=N` with N > 0"
            )),
        }
    }
    // pg_hba must let the replica in: `host replication …` from an init script.
    let allows_replication = bind_mounts(svc).iter().any(|(src, dst)| {
        dst.starts_with("/docker-entrypoint-initdb.d")
            && std::fs::read_to_string(repo().join(src))
                .is_ok_and(|s| s.lines().any(|l| l.contains("host replication")))
    });
    if !allows_replication {
        problems.push(format!(
            "service {primary} (the primary) mounts no /docker-entrypoint-initdb.d script adding a \
             `host replication …` pg_hba line (trust auth alone does not cover replication)"
        ));
    }
    problems
}

fn check_replica(doc: &Value, root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let primary = match primary_name(doc) {
        Ok(p) => p,
        Err(e) => return vec![e],
    };
    let (serve_name, serve) = serve_service(doc).expect("primary_name found it");
    let serve_env = env_of(serve);
    let command = words(serve.get("command")).unwrap_or_default();
    let flag = command
        .iter()
        .position(|w| w == "--replica-url")
        .and_then(|i| command.get(i + 1).cloned())
        .or_else(|| {
            command
                .iter()
                .find_map(|w| w.strip_prefix("--replica-url=").map(str::to_string))
        });
    let Some(url) = flag.or_else(|| serve_env.get("DATABASE_READ_REPLICA_URL").cloned()) else {
        return vec![format!(
            "service {serve_name} has no replica: set DATABASE_READ_REPLICA_URL (or --replica-url)"
        )];
    };
    let Some((replica, _)) = url_host(&url) else {
        return vec![format!("replica URL {url} has no host")];
    };
    if replica == primary {
        problems.push(format!(
            "service {serve_name}'s replica URL {url} points at the primary {primary}"
        ));
    }
    match service(doc, &replica) {
        None => problems.push(format!(
            "service {serve_name}'s replica URL host {replica} is not a service"
        )),
        Some(svc) => {
            if !svc
                .get("image")
                .and_then(|i| i.as_str())
                .is_some_and(|i| i.starts_with("postgres"))
            {
                problems.push(format!("service {replica} is not a postgres image"));
            }
            // It clones the primary: pg_basebackup -R -h <primary>, inline or in a mounted script.
            let mut text = words(svc.get("entrypoint")).unwrap_or_default().join(" ");
            text.push(' ');
            text.push_str(&words(svc.get("command")).unwrap_or_default().join(" "));
            for (src, _) in bind_mounts(svc) {
                text.push_str(&std::fs::read_to_string(root.join(&src)).unwrap_or_default());
            }
            let env = env_of(svc);
            let names_primary = text.contains(&format!("-h {primary}"))
                || (env.values().any(|v| v == &primary) && text.contains("-h \"$"));
            if !(text.contains("pg_basebackup") && text.contains(" -R") && names_primary) {
                problems.push(format!(
                    "service {replica} does not clone {primary} with `pg_basebackup -h {primary} -R …`"
                ));
            }
            if svc.get("healthcheck").is_none() {
                problems.push(format!("service {replica} has no healthcheck"));
            }
            if !depends_on(svc).contains(&primary) {
                problems.push(format!("service {replica} does not depend on {primary}"));
            }
            if !depends_on(serve).contains(&replica) {
                problems.push(format!("service {serve_name} does not depend on {replica}"));
            }
        }
    }
    // `migrate` writes: it must use the primary.
    for (name, svc) in services(doc).into_iter().filter(|(_, s)| built_here(s)) {
        let cmd = words(svc.get("command")).unwrap_or_default();
        if cmd.first().map(String::as_str) != Some("migrate") {
            continue;
        }
        let env = env_of(svc);
        let host = env
            .get("DATABASE_URL")
            .and_then(|u| url_host(u))
            .map(|(h, _)| h);
        if host.as_deref() != Some(primary.as_str()) || cmd.iter().any(|w| w.contains(&replica)) {
            problems.push(format!(
                "service {name} (migrate) must use the primary {primary}"
            ));
        }
    }
    problems
}

/// Prometheus (`prom_config`: the scrape file's text) scrapes the serve service on the admin
/// port its environment sets.
fn check_prometheus_scrape(doc: &Value, prom_config: &str) -> Vec<String> {
    let Some((serve_name, serve)) = serve_service(doc) else {
        return vec!["no service runs `runfeed serve`".into()];
    };
    let Some(admin) = env_of(serve)
        .get("RUNFEED_TELEMETRY__ADMIN_LISTEN")
        .cloned()
    else {
        return vec![format!(
            "service {serve_name} sets no RUNFEED_TELEMETRY__ADMIN_LISTEN (the default 127.0.0.1 \
             is unreachable for Prometheus)"
        )];
    };
    let addr: SocketAddr = match admin.parse() {
        Ok(a) => a,
        Err(e) => return vec![format!("RUNFEED_TELEMETRY__ADMIN_LISTEN {admin:?}: {e}")],
    };
    let mut problems = Vec::new();
    if !addr.ip().is_unspecified() {
        problems.push(format!(
            "service {serve_name}: admin listener {addr} is not reachable from the compose network"
        ));
    }
    let prom: Value = match serde_yaml::from_str(prom_config) {
        Ok(v) => v,
        Err(e) => return vec![format!("prometheus config is not YAML: {e}")],
    };
    let wanted = format!("{serve_name}:{}", addr.port());
    let scraped = prom["scrape_configs"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter(|job| {
            job.get("metrics_path")
                .and_then(|p| p.as_str())
                .is_none_or(|p| p == "/metrics")
        })
        .flat_map(|job| job["static_configs"].as_sequence().into_iter().flatten())
        .flat_map(|sc| sc["targets"].as_sequence().into_iter().flatten())
        .any(|t| t.as_str() == Some(wanted.as_str()));
    if !scraped {
        problems.push(format!(
            "the Prometheus config scrapes no target {wanted} at /metrics (runfeed's admin listener)"
        ));
    }
    problems
}

/// The scrape config the compose `prometheus` service mounts (path in the repository).
fn prometheus_config_path(doc: &Value) -> String {
    let svc = service(doc, "prometheus").expect("a prometheus service");
    bind_mounts(svc)
        .into_iter()
        .find(|(_, dst)| dst.ends_with("prometheus.yml"))
        .map(|(src, _)| src)
        .expect("prometheus mounts its prometheus.yml from the repository")
}

// ---------------------------------------------------------------------------------------------
// Dockerfile

#[derive(Clone, Debug)]
struct Instr {
    /// 0-based stage (FROM count − 1).
    stage: usize,
    /// First line, 1-based.
    line: usize,
    keyword: String,
    args: String,
}

/// Logical instructions: comments dropped, `\` continuations joined.
fn parse_dockerfile(text: &str) -> Vec<Instr> {
    let mut out = Vec::new();
    let mut stage: Option<usize> = None;
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_none()) {
            continue;
        }
        let (start, mut buf) = current.take().unwrap_or((i + 1, String::new()));
        let (body, continued) = match trimmed.strip_suffix('\\') {
            Some(b) => (b, true),
            None => (trimmed, false),
        };
        if !buf.is_empty() {
            buf.push(' ');
        }
        buf.push_str(body.trim());
        if continued {
            current = Some((start, buf));
            continue;
        }
        let (kw, args) = buf.split_once(char::is_whitespace).unwrap_or((&buf, ""));
        let keyword = kw.to_uppercase();
        if keyword == "FROM" {
            stage = Some(stage.map_or(0, |s| s + 1));
        }
        out.push(Instr {
            stage: stage.unwrap_or(0),
            line: start,
            keyword,
            args: args.trim().to_string(),
        });
    }
    out
}

fn final_stage(instrs: &[Instr]) -> usize {
    instrs.iter().map(|i| i.stage).max().unwrap_or(0)
}

/// Words of a shell-form argument string, honouring double and single quotes.
fn shell_words(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote = None;
    let mut any = false;
    for c in s.chars() {
        match (quote, c) {
            (None, '"' | '\'') => {
                quote = Some(c);
                any = true;
            }
            (Some(q), c) if c == q => quote = None,
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            (_, c) => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// The last `keyword` of the final stage in exec form (`["a", "b"]`); shell form is split.
fn exec_form(instrs: &[Instr], keyword: &str) -> Option<Vec<String>> {
    let last = final_stage(instrs);
    let instr = instrs
        .iter()
        .rev()
        .find(|i| i.stage == last && i.keyword == keyword)?;
    Some(
        serde_json::from_str::<Vec<String>>(&instr.args)
            .unwrap_or_else(|_| shell_words(&instr.args)),
    )
}

/// `ENV` of the final stage (`K=V …` or legacy `K V`).
fn dockerfile_env(instrs: &[Instr]) -> Env {
    let last = final_stage(instrs);
    let mut env = Env::new();
    for instr in instrs
        .iter()
        .filter(|i| i.stage == last && i.keyword == "ENV")
    {
        let words = shell_words(&instr.args);
        if words.first().is_some_and(|w| !w.contains('=')) {
            env.insert(words[0].clone(), words[1..].join(" "));
            continue;
        }
        for w in words {
            if let Some((k, v)) = w.split_once('=') {
                env.insert(k.to_string(), v.to_string());
            }
        }
    }
    env
}

fn check_multi_stage(instrs: &[Instr]) -> Vec<String> {
    let froms: Vec<&Instr> = instrs.iter().filter(|i| i.keyword == "FROM").collect();
    let mut problems = Vec::new();
    if froms.len() < 2 {
        problems.push(format!(
            "{} FROM stage(s): build in one stage, run from a slim one",
            froms.len()
        ));
    }
    let names: Vec<String> = froms
        .iter()
        .filter_map(|f| {
            let w = shell_words(&f.args);
            (w.len() >= 3 && w[w.len() - 2].eq_ignore_ascii_case("as"))
                .then(|| w[w.len() - 1].clone())
        })
        .collect();
    for instr in instrs.iter().filter(|i| i.keyword == "COPY") {
        for w in shell_words(&instr.args) {
            if let Some(from) = w.strip_prefix("--from=") {
                if !names.iter().any(|n| n == from) {
                    problems.push(format!(
                        "line {}: COPY --from={from} names no stage ({names:?})",
                        instr.line
                    ));
                }
            }
        }
    }
    problems
}

fn check_non_root(instrs: &[Instr]) -> Vec<String> {
    let last = final_stage(instrs);
    match instrs
        .iter()
        .rev()
        .find(|i| i.stage == last && i.keyword == "USER")
    {
        None => vec!["the final stage sets no USER: the server would run as root".into()],
        Some(instr) => {
            let user = instr.args.split(':').next().unwrap_or("").trim();
            if user.is_empty() || user == "root" || user == "0" {
                vec![format!("line {}: USER {} is root", instr.line, instr.args)]
            } else {
                Vec::new()
            }
        }
    }
}

/// Ports a health-check command probes on the container itself.
fn probed_ports(cmd: &str) -> Vec<u16> {
    let mut ports = Vec::new();
    let digits = |s: &str| -> Option<u16> {
        let d: String = s.chars().take_while(|c| c.is_ascii_digit()).collect();
        d.parse().ok()
    };
    for (i, _) in cmd.match_indices("/dev/tcp/") {
        let rest = &cmd[i + "/dev/tcp/".len()..];
        if let Some((_, port)) = rest.split_once('/') {
            ports.extend(digits(port));
        }
    }
    for host in ["127.0.0.1:", "localhost:", "[::1]:"] {
        for (i, _) in cmd.match_indices(host) {
            ports.extend(digits(&cmd[i + host.len()..]));
        }
    }
    ports
}

/// ENTRYPOINT + CMD through the real CLI parser (with the image's ENV).
fn image_command(instrs: &[Instr]) -> Result<(Vec<String>, Cli), String> {
    let entry = exec_form(instrs, "ENTRYPOINT").ok_or("no ENTRYPOINT")?;
    let cmd = exec_form(instrs, "CMD").unwrap_or_default();
    if !entry
        .first()
        .is_some_and(|e| e == "runfeed" || e.ends_with("/runfeed"))
    {
        return Err(format!("ENTRYPOINT {entry:?} does not run runfeed"));
    }
    let args: Vec<String> = entry.into_iter().chain(cmd).collect();
    let cli =
        parse_cli(&args, &dockerfile_env(instrs)).map_err(|e| format!("the CLI rejects {e}"))?;
    Ok((args, cli))
}

fn check_entrypoint_cmd(instrs: &[Instr]) -> Vec<String> {
    match image_command(instrs) {
        Err(e) => vec![e],
        Ok((args, cli)) => match serve_listen(&cli, &dockerfile_env(instrs)) {
            None => vec![format!(
                "the default command `{}` does not serve",
                args.join(" ")
            )],
            Some(Err(e)) => vec![e],
            Some(Ok(addr)) if !addr.ip().is_unspecified() => vec![format!(
                "the default command listens on {addr}: unreachable from outside the container"
            )],
            Some(Ok(_)) => Vec::new(),
        },
    }
}

fn check_healthcheck(instrs: &[Instr]) -> Vec<String> {
    let last = final_stage(instrs);
    let Some(hc) = instrs
        .iter()
        .rev()
        .find(|i| i.stage == last && i.keyword == "HEALTHCHECK")
    else {
        return vec!["the final stage has no HEALTHCHECK".into()];
    };
    let Some((_, probe)) = hc.args.split_once("CMD") else {
        return vec![format!("line {}: HEALTHCHECK without CMD", hc.line)];
    };
    let listen = match image_command(instrs) {
        Ok((_, cli)) => match serve_listen(&cli, &dockerfile_env(instrs)) {
            Some(Ok(addr)) => addr,
            _ => return vec!["the default command does not serve on an address".into()],
        },
        Err(e) => return vec![e],
    };
    let mut problems = Vec::new();
    let ports = probed_ports(probe);
    if ports.is_empty() {
        problems.push(format!(
            "line {}: the HEALTHCHECK probes no local port",
            hc.line
        ));
    }
    // A fixed port fails every container whose `serve --listen` names another one.
    if !probe.contains("--listen") {
        problems.push(format!(
            "line {}: the HEALTHCHECK probes a fixed address, not the one `serve --listen` names",
            hc.line
        ));
    }
    for port in &ports {
        if *port != listen.port() {
            problems.push(format!(
                "line {}: the HEALTHCHECK probes port {port} but CMD listens on {}",
                hc.line,
                listen.port()
            ));
        }
    }
    let exposed: Vec<u16> = instrs
        .iter()
        .filter(|i| i.stage == last && i.keyword == "EXPOSE")
        .flat_map(|i| shell_words(&i.args))
        .filter_map(|p| p.split('/').next().and_then(|p| p.parse().ok()))
        .collect();
    if !exposed.contains(&listen.port()) {
        problems.push(format!(
            "the listen port {} is not EXPOSEd ({exposed:?})",
            listen.port()
        ));
    }
    if let Some(admin) = dockerfile_env(instrs).get("RUNFEED_TELEMETRY__ADMIN_LISTEN") {
        if let Ok(addr) = admin.parse::<SocketAddr>() {
            if !exposed.contains(&addr.port()) {
                problems.push(format!(
                    "the admin port {} (RUNFEED_TELEMETRY__ADMIN_LISTEN) is not EXPOSEd ({exposed:?})",
                    addr.port()
                ));
            }
        }
    }
    problems
}

/// Literal (wildcard-free) `.dockerignore` patterns.
fn dockerignored(root: &Path) -> Vec<String> {
    std::fs::read_to_string(root.join(".dockerignore"))
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('!') && !l.contains('*'))
        .map(|l| l.trim_matches('/').to_string())
        .collect()
}

fn check_copy_sources(instrs: &[Instr], root: &Path) -> Vec<String> {
    let ignored = dockerignored(root);
    let mut problems = Vec::new();
    for instr in instrs
        .iter()
        .filter(|i| i.keyword == "COPY" || i.keyword == "ADD")
    {
        let words: Vec<String> = serde_json::from_str::<Vec<String>>(&instr.args)
            .unwrap_or_else(|_| shell_words(&instr.args));
        if words.iter().any(|w| w.starts_with("--from=")) {
            continue;
        }
        let paths: Vec<&String> = words.iter().filter(|w| !w.starts_with("--")).collect();
        if paths.len() < 2 {
            problems.push(format!(
                "line {}: {} needs a source and a destination",
                instr.line, instr.keyword
            ));
            continue;
        }
        for src in &paths[..paths.len() - 1] {
            let rel = src.trim_start_matches("./").trim_end_matches('/');
            let check = if rel.contains('*') {
                Path::new(rel)
                    .parent()
                    .unwrap_or(Path::new(""))
                    .to_path_buf()
            } else {
                PathBuf::from(rel)
            };
            if !root.join(&check).exists() {
                problems.push(format!(
                    "line {}: {} source {src} does not exist in the repository",
                    instr.line, instr.keyword
                ));
            }
            if let Some(pattern) = ignored
                .iter()
                .find(|p| rel == p.as_str() || rel.starts_with(&format!("{p}/")))
            {
                problems.push(format!(
                    "line {}: {} source {src} is excluded by .dockerignore ({pattern})",
                    instr.line, instr.keyword
                ));
            }
        }
    }
    problems
}

fn check_locked(instrs: &[Instr]) -> Vec<String> {
    let builds: Vec<&Instr> = instrs
        .iter()
        .filter(|i| {
            i.keyword == "RUN"
                && (i.args.contains("cargo build") || i.args.contains("cargo install"))
        })
        .collect();
    if builds.is_empty() {
        return vec!["no RUN cargo build".into()];
    }
    builds
        .iter()
        .filter(|i| !i.args.split_whitespace().any(|w| w == "--locked"))
        .map(|i| {
            format!(
                "line {}: cargo builds without --locked (Cargo.lock ignored)",
                i.line
            )
        })
        .collect()
}

fn check_dockerfile_env(instrs: &[Instr]) -> Vec<String> {
    check_config_env("Dockerfile ENV", &dockerfile_env(instrs))
}

/// The platforms the image is built for: `TARGETARCH`, the Rust target it compiles to, and the
/// smallest jemalloc page (log2) that runs on every kernel of that architecture (arm64 kernels
/// use 4, 16 or 64 KiB pages; jemalloc aborts on a kernel page larger than its own).
const PLATFORMS: &[(&str, &str, u32)] = &[
    ("amd64", "x86_64-unknown-linux-gnu", 12),
    ("arm64", "aarch64-unknown-linux-gnu", 16),
];

/// Each stage's `FROM` words, and whether the stage runs on the build platform
/// (`--platform=$BUILDPLATFORM`, or `FROM` a stage that does) rather than the target one.
fn stage_platforms(instrs: &[Instr]) -> Vec<(Vec<String>, bool)> {
    let mut stages: Vec<(Vec<String>, bool)> = Vec::new();
    let mut names: Vec<(String, bool)> = Vec::new();
    for from in instrs.iter().filter(|i| i.keyword == "FROM") {
        let w = shell_words(&from.args);
        let on_build = w
            .iter()
            .any(|x| x == "--platform=$BUILDPLATFORM" || x == "--platform=${BUILDPLATFORM}")
            || w.iter()
                .find(|x| !x.starts_with("--"))
                .is_some_and(|base| names.iter().any(|(n, b)| n == base && *b));
        if w.len() >= 3 && w[w.len() - 2].eq_ignore_ascii_case("as") {
            names.push((w[w.len() - 1].clone(), on_build));
        }
        stages.push((w, on_build));
    }
    stages
}

/// The image builds for every platform of [`PLATFORMS`] by cross-compiling: the stage running
/// `cargo build` runs on the build platform, maps each `TARGETARCH` to its Rust target and C
/// linker, gives arm64's jemalloc a page size every arm64 kernel accepts, and no `RUN` executes
/// on the target platform (so no CPU emulation is needed).
fn check_multi_platform(instrs: &[Instr]) -> Vec<String> {
    let stages = stage_platforms(instrs);
    let mut problems = Vec::new();
    let builds: Vec<&Instr> = instrs
        .iter()
        .filter(|i| i.keyword == "RUN" && i.args.contains("cargo build"))
        .collect();
    for build in &builds {
        let stage = build.stage;
        if !stages.get(stage).is_some_and(|(_, on_build)| *on_build) {
            problems.push(format!(
                "line {}: cargo build runs in a stage without --platform=$BUILDPLATFORM: each target platform would be compiled under emulation",
                build.line
            ));
        }
        let in_stage: Vec<&Instr> = instrs.iter().filter(|i| i.stage == stage).collect();
        if !in_stage
            .iter()
            .any(|i| i.keyword == "ARG" && i.args.trim() == "TARGETARCH")
        {
            problems.push(format!(
                "stage {stage}: no `ARG TARGETARCH`: the build cannot tell which platform it is for"
            ));
        }
        let runs: String = in_stage
            .iter()
            .filter(|i| i.keyword == "RUN")
            .map(|i| i.args.as_str())
            .collect::<Vec<_>>()
            .join(" ; ");
        for (arch, triple, min_lg_page) in PLATFORMS {
            let Some(start) = runs.find(&format!("{arch})")) else {
                problems.push(format!("stage {stage}: TARGETARCH {arch} is not handled"));
                continue;
            };
            let arm = &runs[start..];
            let arm = &arm[..arm.find(";;").unwrap_or(arm.len())];
            if !arm.contains(triple) {
                problems.push(format!("stage {stage}: {arch} does not build for {triple}"));
            }
            let lg_page = arm
                .split_once("lg_page=")
                .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|d| d.parse::<u32>().ok());
            match lg_page {
                Some(lg) if lg >= *min_lg_page => {}
                other => problems.push(format!(
                    "stage {stage}: {arch} builds jemalloc with lg_page={other:?}, needs at least {min_lg_page} to start on every {arch} kernel"
                )),
            }
        }
        for needed in [
            "JEMALLOC_SYS_WITH_LG_PAGE=$lg_page",
            "CARGO_BUILD_TARGET=$triple",
            "_LINKER=$gnu-gcc",
        ] {
            if !runs.contains(needed) {
                problems.push(format!("stage {stage}: the build does not set {needed}"));
            }
        }
    }
    if builds.is_empty() {
        problems.push("no RUN cargo build".into());
    }
    for run in instrs.iter().filter(|i| i.keyword == "RUN") {
        if !stages.get(run.stage).is_some_and(|(_, on_build)| *on_build) {
            problems.push(format!(
                "line {}: RUN in a stage of the target platform needs CPU emulation to build the other architecture; prepare files on the build platform and COPY them",
                run.line
            ));
        }
    }
    problems
}

// ---------------------------------------------------------------------------------------------
// The release version

/// The `version = "…"` of a Cargo manifest's `[package]`.
fn manifest_version(manifest: &str) -> Option<String> {
    let package = manifest.split("[package]").nth(1)?;
    let package = package.split("\n[").next()?;
    package.lines().find_map(|l| {
        let v = l.trim().strip_prefix("version")?.trim().strip_prefix('=')?;
        Some(v.trim().trim_matches('"').to_string())
    })
}

/// The version a Cargo.lock records for package `name`.
fn locked_version(lock: &str, name: &str) -> Option<String> {
    lock.split("[[package]]").find_map(|p| {
        p.lines()
            .any(|l| l.trim() == format!("name = \"{name}\""))
            .then(|| {
                p.lines()
                    .find_map(|l| l.trim().strip_prefix("version = "))
                    .map(|v| v.trim_matches('"').to_string())
            })
            .flatten()
    })
}

/// Every place that states runfeed's version states `version`: the development crate, the fuzz
/// crate's lockfile, the chart's `version` and `appVersion`, the image tag the chart pulls
/// (`image.tag` empty = `appVersion`), any runfeed image a compose file pins by version, and a
/// CHANGELOG section.
fn check_release_version(version: &str, root: &Path) -> Vec<String> {
    let read = |rel: &str| std::fs::read_to_string(root.join(rel)).unwrap_or_default();
    let mut problems = Vec::new();
    let mut expect = |what: &str, got: Option<String>| {
        if got.as_deref() != Some(version) {
            problems.push(format!("{what} is {got:?}, not {version}"));
        }
    };
    expect(
        "crates/runfeed-dev/Cargo.toml version",
        manifest_version(&read("crates/runfeed-dev/Cargo.toml")),
    );
    expect(
        "tests/fuzz/Cargo.lock's runfeed",
        locked_version(&read("tests/fuzz/Cargo.lock"), "runfeed"),
    );
    let chart: Value =
        serde_yaml::from_str(&read("deploy/helm/runfeed/Chart.yaml")).unwrap_or(Value::Null);
    expect("Chart.yaml version", scalar(&chart["version"]));
    expect("Chart.yaml appVersion", scalar(&chart["appVersion"]));
    let values: Value =
        serde_yaml::from_str(&read("deploy/helm/runfeed/values.yaml")).unwrap_or(Value::Null);
    match scalar(&values["image"]["tag"]) {
        Some(tag) if tag.is_empty() || tag == version => {}
        other => problems.push(format!(
            "values.yaml image.tag is {other:?}: leave it empty (the chart's appVersion) or {version}"
        )),
    }
    for compose in [
        "docker-compose.yml",
        "deploy/trigger.dev/compose/docker-compose.runfeed.yml",
        "deploy/trigger.dev/compose/docker-compose.runfeed.traefik.yml",
    ] {
        for (i, line) in read(compose).lines().enumerate() {
            let Some((_, image)) = line.split_once("image:") else {
                continue;
            };
            for (at, _) in image.match_indices("runfeed:") {
                let tag: String = image[at + "runfeed:".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || ".-_".contains(*c))
                    .collect();
                if tag.starts_with(|c: char| c.is_ascii_digit()) && tag != version {
                    problems.push(format!(
                        "{compose}:{}: pins runfeed:{tag}, not {version}",
                        i + 1
                    ));
                }
            }
        }
    }
    if !read("CHANGELOG.md").contains(&format!("\n## [{version}] - ")) {
        problems.push(format!(
            "CHANGELOG.md has no `## [{version}] - <date>` section"
        ));
    }
    problems
}

// =============================================================================================
// Tests: docker-compose.yml

#[test]
fn compose_parses_as_yaml_with_merge_keys() {
    let doc = compose();
    // `<<: *runfeed` brought the build into the runfeed services.
    for name in ["migrate", "runfeed", "demo"] {
        let svc = service(&doc, name).unwrap_or_else(|| panic!("service {name} is missing"));
        assert!(
            built_here(svc),
            "service {name} should be built from this repository"
        );
        assert!(
            env_of(svc).contains_key("DATABASE_URL"),
            "service {name} has no DATABASE_URL"
        );
    }
    for name in [
        "postgres",
        "postgres-replica",
        "redis",
        "prometheus",
        "grafana",
    ] {
        assert!(service(&doc, name).is_some(), "service {name} is missing");
    }
}

#[test]
fn compose_parser_rejects_bad_yaml() {
    assert!(parse_compose("services: [").is_err());
    assert!(parse_compose("version: '3'").is_err());
    assert!(parse_compose("services:\n  a:\n    <<: 3\n").is_err());
    let merged = compose_doc("x: &x\n  build: .\nservices:\n  a:\n    <<: *x\n");
    assert!(
        built_here(service(&merged, "a").unwrap()),
        "merge keys are applied"
    );
}

#[test]
fn compose_depends_on_names_existing_services() {
    assert_compose_ok("depends_on", check_depends_on);
}

#[test]
fn compose_depends_on_check_catches_unknown_service() {
    let doc = compose_doc(
        "services:\n  a:\n    image: x\n    depends_on: [nope]\n  b:\n    image: x\n    depends_on:\n      a:\n        condition: service_healthy\n      gone:\n        condition: service_started\n",
    );
    assert_exactly(
        &check_depends_on(&doc),
        &["depends on nope", "depends on gone"],
    );
}

#[test]
fn compose_services_have_image_or_build() {
    assert_compose_ok("images", check_image_or_build);
}

#[test]
fn compose_image_check_catches_service_without_image() {
    let doc = compose_doc("services:\n  a:\n    command: [x]\n  b:\n    build: .\n");
    assert_eq!(
        check_image_or_build(&doc),
        ["service a has neither `image` nor `build`"]
    );
}

#[test]
fn compose_bind_mounts_exist() {
    assert_compose_ok("bind mounts", |doc| check_bind_mounts(doc, &repo()));
    let doc = compose();
    let mounts: usize = services(&doc)
        .iter()
        .map(|(_, s)| bind_mounts(s).len())
        .sum();
    assert!(
        mounts >= 5,
        "expected the Prometheus, Grafana and Postgres mounts, found {mounts}"
    );
}

#[test]
fn compose_bind_mount_check_catches_missing_paths() {
    let doc = compose_doc(
        "services:\n  a:\n    image: x\n    volumes:\n      - ./grafana/prometheus.yml:/p.yml:ro\n      - ./no/such/file:/x\n      - data:/data\n      - type: bind\n        source: ./missing-too\n        target: /y\n      - /etc/passwd:/z:ro\n",
    );
    let problems = check_bind_mounts(&doc, &repo());
    assert_exactly(
        &problems,
        &[
            "./no/such/file",
            "./missing-too",
            "/etc/passwd is outside the repository",
        ],
    );
}

#[test]
fn compose_runfeed_commands_parse_with_the_cli() {
    let entrypoint = image_entrypoint();
    assert_compose_ok("commands", |doc| check_runfeed_commands(doc, &entrypoint));
    assert!(
        serve_service(&compose()).is_some(),
        "no service runs `runfeed serve`"
    );
}

#[test]
fn compose_command_check_catches_bad_flags() {
    let doc = compose_doc(
        "x: &rf\n  build: .\nservices:\n  a:\n    <<: *rf\n    command: [serve, --listn, 0.0.0.0:1]\n  b:\n    <<: *rf\n    command: serve --listen nowhere\n  c:\n    <<: *rf\n    command: [frobnicate]\n  d:\n    <<: *rf\n    command: [token, --env, e]\n  ok:\n    <<: *rf\n    command: [migrate]\n",
    );
    let problems = check_runfeed_commands(&doc, &["runfeed".into()]);
    assert_exactly(
        &problems,
        &[
            "service a: the CLI rejects",
            "service b: listen address \"nowhere\"",
            "service c: the CLI rejects",
            "service d: the CLI rejects", // --scope is required
        ],
    );
}

#[test]
fn compose_runfeed_env_vars_are_config_keys() {
    let doc = compose();
    let seen: usize = services(&doc)
        .iter()
        .filter(|(_, s)| built_here(s))
        .map(|(_, s)| {
            env_of(s)
                .keys()
                .filter(|k| k.starts_with("RUNFEED_"))
                .count()
        })
        .sum();
    assert!(seen > 0, "expected RUNFEED_ variables in the compose file");
    assert_none("docker-compose.yml environment", check_compose_env(&doc));
}

#[test]
fn env_check_catches_unknown_keys_and_bad_values() {
    let env = env_vars(&[
        ("RUNFEED_TELEMETRY__ADMIN_LISTN", "0.0.0.0:9464"),
        ("RUNFEED_NOPE__X", "1"),
        ("RUNFEED_FEEDS__MAX_TAGS", "many"),
        ("RUNFEED_TELEMETRY__LOG_FORMAT", "xml"),
        ("RUNFEED_ADMIN_LISTEN", "0.0.0.0:1"),
        // Fine: a config key, CLI/logging switches, a foreign variable.
        ("RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS", "3000"),
        ("RUNFEED_LISTEN", "0.0.0.0:1"),
        ("RUNFEED_LOG_FORMAT", "json"),
        ("RUNFEED_CONFIG", "/etc/runfeed/default.toml"),
        ("RUST_LOG", "info"),
    ]);
    let problems = check_config_env("test", &env);
    assert_exactly(
        &problems,
        &[
            "RUNFEED_TELEMETRY__ADMIN_LISTN",
            "RUNFEED_NOPE__X",
            "RUNFEED_FEEDS__MAX_TAGS=many",
            "RUNFEED_TELEMETRY__LOG_FORMAT=xml",
            "RUNFEED_ADMIN_LISTEN is neither",
        ],
    );
}

#[test]
fn compose_primary_postgres_has_logical_wal_and_allows_replication() {
    assert_compose_ok("primary Postgres", check_primary_postgres);
}

#[test]
fn compose_primary_check_catches_missing_wal_level() {
    let doc = compose_doc(
        "services:\n  runfeed:\n    build: .\n    command: [serve]\n    environment:\n      DATABASE_URL: postgres://postgres@db:5432/x\n  db:\n    image: postgres:15\n    command: [postgres, -c, wal_level=replica]\n",
    );
    let problems = check_primary_postgres(&doc);
    let needles = ["wal_level=logical", "max_wal_senders", "host replication"];
    assert_found_all(&problems, &needles);
    assert_eq!(
        pg_settings(&[
            "postgres".into(),
            "-c".into(),
            "wal_level=logical".into(),
            "-cmax_wal_senders=4".into()
        ]),
        BTreeMap::from([
            ("max_wal_senders".to_string(), "4".to_string()),
            ("wal_level".to_string(), "logical".to_string())
        ])
    );
}

#[test]
fn compose_replica_streams_from_the_primary_and_runfeed_reads_it() {
    assert_compose_ok("replica", |doc| check_replica(doc, &repo()));
    let doc = compose();
    let (_, serve) = serve_service(&doc).unwrap();
    assert_eq!(
        env_of(serve)
            .get("DATABASE_READ_REPLICA_URL")
            .and_then(|u| url_host(u)),
        Some(("postgres-replica".to_string(), Some(5432)))
    );
}

#[test]
fn compose_replica_check_catches_missing_or_wrong_replica() {
    let base = "x: &rf\n  build: .\nservices:\n  db:\n    image: postgres:15\n  migrate:\n    <<: *rf\n    command: [migrate]\n    environment:\n      DATABASE_URL: postgres://postgres@replica/x\n";
    // No replica at all.
    let doc = compose_doc(&format!(
        "{base}  runfeed:\n    <<: *rf\n    command: [serve]\n    environment:\n      DATABASE_URL: postgres://postgres@db/x\n"
    ));
    assert_found(&check_replica(&doc, &repo()), "has no replica");
    // The replica URL is the primary.
    let doc = compose_doc(&format!(
        "{base}  runfeed:\n    <<: *rf\n    command: [serve, --replica-url, postgres://postgres@db/x]\n    environment:\n      DATABASE_URL: postgres://postgres@db/x\n"
    ));
    assert_found(&check_replica(&doc, &repo()), "points at the primary db");
    // A replica service that does not clone the primary, and a migrate on the replica.
    let doc = compose_doc(&format!(
        "{base}  replica:\n    image: postgres:15\n  runfeed:\n    <<: *rf\n    command: [serve]\n    environment:\n      DATABASE_URL: postgres://postgres@db/x\n      DATABASE_READ_REPLICA_URL: postgres://postgres@replica/x\n"
    ));
    assert_found_all(
        &check_replica(&doc, &repo()),
        &[
            "does not clone db",
            "service replica has no healthcheck",
            "service replica does not depend on db",
            "service runfeed does not depend on replica",
            "service migrate (migrate) must use the primary db",
        ],
    );
}

#[test]
fn compose_prometheus_scrapes_runfeed_admin_port() {
    let doc = compose();
    let prom = read(&prometheus_config_path(&doc));
    assert_none(
        "Prometheus scrape config",
        check_prometheus_scrape(&doc, &prom),
    );
}

#[test]
fn prometheus_check_catches_wrong_target() {
    let doc = compose_doc(
        "services:\n  runfeed:\n    build: .\n    command: [serve]\n    environment:\n      RUNFEED_TELEMETRY__ADMIN_LISTEN: 0.0.0.0:9464\n",
    );
    let wrong_port = "scrape_configs:\n  - job_name: r\n    static_configs:\n      - targets: [\"runfeed:9465\"]\n";
    assert_found(
        &check_prometheus_scrape(&doc, wrong_port),
        "scrapes no target runfeed:9464",
    );
    let wrong_path = "scrape_configs:\n  - job_name: r\n    metrics_path: /m\n    static_configs:\n      - targets: [\"runfeed:9464\"]\n";
    assert_found(
        &check_prometheus_scrape(&doc, wrong_path),
        "scrapes no target runfeed:9464",
    );
    let right = "scrape_configs:\n  - job_name: r\n    static_configs:\n      - targets: [\"runfeed:9464\"]\n";
    assert!(check_prometheus_scrape(&doc, right).is_empty());
    let loopback = compose_doc(
        "services:\n  runfeed:\n    build: .\n    command: [serve]\n    environment:\n      RUNFEED_TELEMETRY__ADMIN_LISTEN: 127.0.0.1:9464\n",
    );
    assert_found(&check_prometheus_scrape(&loopback, right), "not reachable");
}

// =============================================================================================
// Tests: Dockerfile

const BAD_DOCKERFILE: &str = "FROM rust:1 AS build\n\
COPY Cargo.toml no-such-dir ./\n\
COPY .ci/run ./t\n\
RUN cargo build --release\n\
USER root\n\
ENV RUNFEED_TELEMETRY__ADMIN_LISTEN=0.0.0.0:9464 RUNFEED_SERVER__LISTN=x\n\
COPY --from=buidler /a /b\n\
HEALTHCHECK CMD [\"bash\", \"-c\", \"exec 3<>/dev/tcp/127.0.0.1/8080\"]\n\
EXPOSE 8080\n\
ENTRYPOINT [\"runfeed\"]\n\
CMD [\"serve\", \"--listen\", \"127.0.0.1:3030\", \\\n     \"--bogus\"]\n";

#[test]
fn dockerfile_parser_joins_continuations_and_tracks_stages() {
    let instrs = dockerfile();
    assert!(instrs
        .iter()
        .all(|i| !i.args.contains('\\') || i.keyword == "HEALTHCHECK"));
    let run = instrs
        .iter()
        .find(|i| i.keyword == "RUN" && i.stage == 0 && i.args.contains("cargo build"))
        .unwrap();
    assert!(run.args.contains("--mount=type=cache") && run.args.contains("cargo build"));
    let bad = parse_dockerfile(BAD_DOCKERFILE);
    assert_eq!(
        exec_form(&bad, "CMD").unwrap(),
        ["serve", "--listen", "127.0.0.1:3030", "--bogus"]
    );
    assert_eq!(bad.last().unwrap().line, 11);
}

/// One `#[test]` per `name: what => check`: `check` finds nothing wrong in the real Dockerfile.
macro_rules! dockerfile_ok_tests {
    ($($name:ident: $what:literal => $check:expr;)*) => {
        $(
            #[test]
            fn $name() {
                assert_dockerfile_ok($what, $check);
            }
        )*
    };
}

dockerfile_ok_tests! {
    dockerfile_is_multi_stage: "stages" => check_multi_stage;
    dockerfile_runs_as_non_root: "USER" => check_non_root;
    dockerfile_healthcheck_probes_the_listen_port_and_it_is_exposed: "HEALTHCHECK/EXPOSE" => check_healthcheck;
    dockerfile_entrypoint_and_cmd_parse_with_the_cli: "ENTRYPOINT/CMD" => check_entrypoint_cmd;
    dockerfile_copy_sources_exist: "COPY" => |d| check_copy_sources(d, &repo());
    dockerfile_builder_uses_locked: "cargo build" => check_locked;
    dockerfile_builds_for_amd64_and_arm64_without_emulation: "platforms" => check_multi_platform;
}

#[test]
fn multi_platform_check_catches_a_single_platform_dockerfile() {
    let native = parse_dockerfile(
        "FROM rust:1 AS builder\nRUN cargo build --locked\n\
         FROM debian AS base\nRUN apt-get update\nFROM base\nRUN useradd app\n",
    );
    let problems = check_multi_platform(&native);
    assert_found_all(
        &problems,
        &[
            "line 2: cargo build runs in a stage without --platform=$BUILDPLATFORM",
            "no `ARG TARGETARCH`",
            "TARGETARCH amd64 is not handled",
            "TARGETARCH arm64 is not handled",
            "does not set JEMALLOC_SYS_WITH_LG_PAGE",
            "line 4: RUN in a stage of the target platform",
            "line 6: RUN in a stage of the target platform",
        ],
    );
    // arm64's jemalloc built for 4 KiB pages aborts on a 16 or 64 KiB-page kernel.
    let real = read("Dockerfile");
    let small_pages = real.replacen("lg_page=16", "lg_page=12", 1);
    assert_ne!(real, small_pages, "the Dockerfile sets arm64's lg_page=16");
    assert_exactly(
        &check_multi_platform(&parse_dockerfile(&small_pages)),
        &["arm64 builds jemalloc with lg_page=Some(12), needs at least 16"],
    );
    // A build stage FROM a build-platform stage is on the build platform too.
    let derived = parse_dockerfile(
        "FROM --platform=$BUILDPLATFORM debian AS a\nFROM a AS b\nRUN true\nFROM scratch\n",
    );
    assert_eq!(
        stage_platforms(&derived)
            .iter()
            .map(|(_, b)| *b)
            .collect::<Vec<_>>(),
        [true, true, false]
    );
}

// =============================================================================================
// Tests: the release version

#[test]
fn the_release_version_is_the_same_everywhere() {
    assert_none(
        "release version",
        check_release_version(env!("CARGO_PKG_VERSION"), &repo()),
    );
}

#[test]
fn release_version_check_catches_a_stale_version() {
    assert_exactly(
        &check_release_version("9.9.9", &repo()),
        &[
            "crates/runfeed-dev/Cargo.toml version is Some(",
            "tests/fuzz/Cargo.lock's runfeed is Some(",
            "Chart.yaml version is Some(",
            "Chart.yaml appVersion is Some(",
            "CHANGELOG.md has no `## [9.9.9] - <date>` section",
        ],
    );
    let dir = std::env::temp_dir().join(format!("runfeed-release-check-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("deploy/helm/runfeed")).expect("temp dir");
    std::fs::write(
        dir.join("deploy/helm/runfeed/values.yaml"),
        "image:\n  tag: \"0.1.0\"\n",
    )
    .expect("values");
    std::fs::write(
        dir.join("docker-compose.yml"),
        "services:\n  runfeed:\n    image: ghcr.io/x/runfeed:0.1.0\n  local:\n    image: runfeed:local\n",
    )
    .expect("compose");
    let problems = check_release_version("0.2.0", &dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert_found_all(
        &problems,
        &[
            "values.yaml image.tag is Some(\"0.1.0\")",
            "docker-compose.yml:3: pins runfeed:0.1.0, not 0.2.0",
        ],
    );
    assert!(
        !problems.iter().any(|p| p.contains("runfeed:local")),
        "{problems:?}"
    );
}

#[test]
fn dockerfile_env_vars_are_config_keys() {
    let instrs = dockerfile();
    assert!(
        dockerfile_env(&instrs)
            .keys()
            .any(|k| k.starts_with("RUNFEED_")),
        "expected RUNFEED_ ENV in the Dockerfile"
    );
    assert_none("Dockerfile ENV", check_dockerfile_env(&instrs));
}

#[test]
fn dockerfile_checks_catch_a_bad_dockerfile() {
    let bad = parse_dockerfile(BAD_DOCKERFILE);
    let stages = check_multi_stage(&bad);
    assert_found(&stages, "1 FROM stage");
    assert_found(&stages, "--from=buidler");
    assert_found(&check_non_root(&bad), "USER root is root");
    assert_found(
        &check_non_root(&parse_dockerfile("FROM a AS b\nUSER app\nFROM c\n")),
        "sets no USER",
    );
    assert_found(
        &check_non_root(&parse_dockerfile("FROM a\nUSER 0:0\n")),
        "is root",
    );
    assert_found(&check_entrypoint_cmd(&bad), "the CLI rejects");
    assert_found(
        &check_entrypoint_cmd(&parse_dockerfile(
            "FROM a\nENTRYPOINT [\"sh\"]\nCMD [\"serve\"]\n",
        )),
        "does not run runfeed",
    );
    assert_found(
        &check_entrypoint_cmd(&parse_dockerfile(
            "FROM a\nENTRYPOINT [\"runfeed\"]\nCMD [\"serve\", \"--listen\", \"127.0.0.1:3030\"]\n",
        )),
        "unreachable from outside",
    );
    let fixed_cmd =
        BAD_DOCKERFILE.replace("127.0.0.1:3030\", \\\n     \"--bogus\"", "0.0.0.0:3030\"");
    let hc = check_healthcheck(&parse_dockerfile(&fixed_cmd));
    assert_found(&hc, "probes port 8080 but CMD listens on 3030");
    assert_found(&hc, "probes a fixed address");
    assert_found(&hc, "listen port 3030 is not EXPOSEd");
    assert_found(&hc, "admin port 9464");
    assert_found(
        &check_healthcheck(&parse_dockerfile(
            "FROM a\nENTRYPOINT [\"runfeed\"]\nCMD [\"serve\"]\n",
        )),
        "no HEALTHCHECK",
    );
    let copy = check_copy_sources(&bad, &repo());
    assert_found(&copy, "no-such-dir does not exist");
    assert_found(&copy, ".ci/run is excluded by .dockerignore (.ci)");
    assert_eq!(copy.len(), 2, "{copy:?}");
    assert_found(&check_locked(&bad), "without --locked");
    assert_found(
        &check_locked(&parse_dockerfile("FROM a\nRUN make\n")),
        "no RUN cargo build",
    );
    assert_found(&check_dockerfile_env(&bad), "RUNFEED_SERVER__LISTN");
    assert_eq!(
        probed_ports("curl -f http://localhost:3030/healthz"),
        [3030]
    );
}
