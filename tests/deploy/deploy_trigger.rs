//! Static checks of the trigger.dev Docker Compose overlay (`deploy/trigger.dev/compose/`), the
//! least-privilege role file's use in it, and the routing rule shared with the proxy recipes.
//!
//! The tests cannot read trigger.dev's repository (no network, and none of its files are
//! committed here), so the facts the overlay depends on are written down below, with the public
//! file each comes from, as of trigger.dev v4.5.12 (tag `v4.5.12`). Every checker returns the
//! problems it found and has a test on a broken input too.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use clap::Parser;
use common::checks::{assert_found_all, services};
use runfeed::cli::{Cli, Command};
use serde_yaml::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

const OVERLAY: &str = "deploy/trigger.dev/compose/docker-compose.runfeed.yml";
const TRAEFIK_OVERLAY: &str = "deploy/trigger.dev/compose/docker-compose.runfeed.traefik.yml";
const NO_ELECTRIC: &str = "deploy/trigger.dev/compose/docker-compose.no-electric.yml";

// =============================================================================================
// Facts of trigger.dev v4.5.12

/// The version the overlay was written and checked against.
const TRIGGER_VERSION: &str = "v4.5.12";

/// https://github.com/triggerdotdev/trigger.dev/blob/v4.5.12/hosting/docker/webapp/docker-compose.yml
mod webapp_compose {
    /// Its services.
    pub const SERVICES: &[&str] = &[
        "webapp",
        "postgres",
        "redis",
        "electric",
        "clickhouse",
        "registry",
        "minio",
        "s2-init",
        "s2",
    ];
    /// Its networks (top-level `networks`, each with `name:` equal to the key).
    pub const NETWORKS: &[&str] = &["docker-proxy", "supervisor", "webapp"];
    /// The networks `postgres` and `redis` are on.
    pub const DATA_NETWORK: &str = "webapp";
    /// `DATABASE_URL: postgresql://postgres:${POSTGRES_PASSWORD}@postgres:5432/main?schema=public&sslmode=disable`
    pub const PG_HOST: &str = "postgres";
    pub const PG_PORT: u16 = 5432;
    pub const PG_DATABASE: &str = "main";
    /// `REDIS_HOST: redis`, `REDIS_PORT: 6379`, `REDIS_TLS_DISABLED: true`; image redis:7, no password.
    pub const REDIS_HOST: &str = "redis";
    pub const REDIS_PORT: u16 = 6379;
    /// The webapp listens on 3000 inside the network (Traefik's `loadbalancer.server.port=3000`,
    /// published as `8030:3000`).
    pub const WEBAPP_PORT: u16 = 3000;
    /// The webapp does not depend on `electric` (depends_on: postgres, redis, clickhouse, s2).
    pub const WEBAPP_DEPENDS_ON: &[&str] = &["postgres", "redis", "clickhouse", "s2"];
    /// Variables the file reads that the overlay reuses for its own service.
    pub const SHARED_VARS: &[&str] = &[
        "RESTART_POLICY",
        "LOGGING_DRIVER",
        "LOGGING_MAX_SIZE",
        "LOGGING_MAX_FILES",
        "LOGGING_COMPRESS",
    ];
}

/// https://github.com/triggerdotdev/trigger.dev/blob/v4.5.12/hosting/docker/docker-compose.traefik.yml
mod traefik_compose {
    /// Traefik's Docker provider watches this network (`--providers.docker.network=traefik`,
    /// top-level `networks: traefik: name: traefik`).
    pub const NETWORK: &str = "traefik";
    /// The webapp's router: `traefik.http.routers.webapp.rule=Host(\`webapp.localhost\`)`,
    /// `…entrypoints=${TRAEFIK_ENTRYPOINT:-web}`, `…loadbalancer.server.port=3000`.
    pub const WEBAPP_RULE: &str = "Host(`webapp.localhost`)";
    pub const WEBAPP_HOST: &str = "webapp.localhost";
    pub const ENTRYPOINTS: &str = "${TRAEFIK_ENTRYPOINT:-web}";
    /// `--entrypoints.websecure.address=:443`: the entry point for TLS (and so HTTP/2).
    pub const TLS_ENTRYPOINT: &str = "websecure";
    /// `image: traefik:${TRAEFIK_IMAGE_TAG:-v3.4}`: v3 rule syntax (one method per `Method`,
    /// `PathRegexp`).
    pub const TRAEFIK_MAJOR: u32 = 3;
}

/// Environment keys the webapp reads (https://github.com/triggerdotdev/trigger.dev/blob/v4.5.12/apps/webapp/app/env.server.ts):
/// the switch (`REALTIME_BACKEND_NATIVE_ENABLED`, compared with "1"; off = no change records
/// published) and the Redis it publishes to (falls back to `PUBSUB_REDIS_*`, then `REDIS_*`).
const WEBAPP_ENV_KEYS: &[&str] = &[
    "REALTIME_BACKEND_NATIVE_ENABLED",
    "REALTIME_BACKEND_DEFAULT",
    "REALTIME_BACKEND_NATIVE_PUBSUB_REDIS_HOST",
    "REALTIME_BACKEND_NATIVE_PUBSUB_REDIS_PORT",
    "REALTIME_BACKEND_NATIVE_PUBSUB_REDIS_USERNAME",
    "REALTIME_BACKEND_NATIVE_PUBSUB_REDIS_PASSWORD",
    "REALTIME_BACKEND_NATIVE_PUBSUB_REDIS_TLS_DISABLED",
    "REALTIME_BACKEND_NATIVE_PUBSUB_REDIS_CLUSTER_MODE_ENABLED",
    "REALTIME_BACKEND_NATIVE_PUBSUB_REDIS_SHARDED_ENABLED",
];

/// The three feed routes as one regular expression: the same text in the Traefik rule and the
/// nginx, Caddy and HAProxy recipes, all of which tests/e2e/proxies/ runs for real (the Traefik
/// labels in a real Traefik v3).
const FEED_PATH_REGEX: &str = "^/realtime/v1/(runs|runs/[^/]+|batches/[^/]+)$";

// =============================================================================================
// Helpers

fn parse(text: &str) -> Result<Value, String> {
    let doc: Value = serde_yaml::from_str(text).map_err(|e| format!("not YAML: {e}"))?;
    match doc.get("services") {
        Some(Value::Mapping(m)) if !m.is_empty() => Ok(doc),
        _ => Err("no `services` mapping".into()),
    }
}

fn overlay(rel: &str) -> Value {
    parse(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        _ => String::new(),
    }
}

fn env_of(svc: &Value) -> BTreeMap<String, Value> {
    svc["environment"]
        .as_mapping()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.as_str().unwrap_or("?").to_string(), v.clone()))
        .collect()
}

fn list(v: &Value) -> Vec<String> {
    match v {
        Value::Sequence(s) => s.iter().map(scalar).collect(),
        Value::Mapping(m) => m.keys().map(scalar).collect(),
        _ => Vec::new(),
    }
}

/// Compose interpolation with sample values: `${VAR:-default}` → default (or `vars[VAR]`),
/// `${VAR:?msg}` / `${VAR}` → `vars[VAR]` (an error when absent), `$$` → `$`. Errors on any other
/// use of `$` (which compose rejects or reads differently).
fn interpolate(text: &str, vars: &BTreeMap<&str, &str>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(r) = after.strip_prefix('$') {
            out.push('$');
            rest = r;
        } else if let Some(r) = after.strip_prefix('{') {
            let end = r
                .find('}')
                .ok_or_else(|| format!("unclosed ${{ in {text:?}"))?;
            let expr = &r[..end];
            let name_end = expr
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(expr.len());
            let (name, op) = expr.split_at(name_end);
            if name.is_empty() {
                return Err(format!("bad interpolation ${{{expr}}} in {text:?}"));
            }
            let value = match (vars.get(name), op) {
                (Some(v), _) => v.to_string(),
                (None, op) if op.starts_with(":-") => op[2..].to_string(),
                (None, op) if op.starts_with(":?") || op.is_empty() => {
                    return Err(format!("${{{name}}} has no value (and no default)"))
                }
                (None, op) => return Err(format!("unsupported interpolation ${{{name}{op}}}")),
            };
            out.push_str(&value);
            rest = &r[end + 1..];
        } else {
            return Err(format!(
                "a lone `$` in {text:?}: write `$$` for a literal dollar"
            ));
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// `(user, host, port, database)` of `scheme://user:pass@host:port/db?…`.
fn url_parts(url: &str) -> Option<(String, String, Option<u16>, String)> {
    let rest = url.split_once("://")?.1;
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (userinfo, hostport) = authority.rsplit_once('@').unwrap_or(("", authority));
    let user = userinfo.split(':').next().unwrap_or("").to_string();
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) => (h.to_string(), p.parse().ok()),
        None => (hostport.to_string(), None),
    };
    let db = path.split('?').next().unwrap_or("").to_string();
    Some((user, host, port, db))
}

/// Sample values for the variables the overlay requires.
fn sample_vars() -> BTreeMap<&'static str, &'static str> {
    BTreeMap::from([
        ("RUNFEED_DB_PASSWORD", "pw"),
        ("RUNFEED_HANDLE_SECRET", "0123456789abcdef"),
    ])
}

/// Every `${VAR…}` the files use.
fn variables(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for part in text.split("${").skip(1) {
        let name: String = part
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        out.insert(name);
    }
    out
}

/// The labels of a service as `key → value`.
fn labels(svc: &Value) -> BTreeMap<String, String> {
    match &svc["labels"] {
        Value::Sequence(items) => items
            .iter()
            .filter_map(|i| i.as_str())
            .map(|l| {
                let (k, v) = l.split_once('=').unwrap_or((l, ""));
                (k.to_string(), v.to_string())
            })
            .collect(),
        Value::Mapping(m) => m.iter().map(|(k, v)| (scalar(k), scalar(v))).collect(),
        _ => BTreeMap::new(),
    }
}

// =============================================================================================
// Checkers

/// The base overlay: what it adds to trigger.dev's stack and how it wires runfeed in.
#[allow(clippy::result_large_err)] // figment's jail closure returns figment::Result
fn check_overlay(doc: &Value, raw: &str) -> Vec<String> {
    let mut p = Vec::new();
    let vars = sample_vars();
    for (name, svc) in services(doc) {
        if name != "runfeed" && !webapp_compose::SERVICES.contains(&name.as_str()) {
            p.push(format!(
                "service {name} is neither runfeed nor one of trigger.dev's ({TRIGGER_VERSION})"
            ));
        }
        if svc.get("build").is_some() {
            p.push(format!(
                "service {name} builds: paths resolve against trigger.dev's directory"
            ));
        }
        for vol in list(&svc["volumes"]) {
            if vol.starts_with('.') || vol.starts_with('/') {
                p.push(format!(
                    "service {name} mounts {vol}: paths resolve against trigger.dev's directory"
                ));
            }
        }
    }
    // The webapp: only keys it reads, the switch on, the Redis named.
    let webapp = &doc["services"]["webapp"];
    let env = env_of(webapp);
    for key in env.keys() {
        if !WEBAPP_ENV_KEYS.contains(&key.as_str()) {
            p.push(format!(
                "webapp env {key} is not a key trigger.dev's webapp reads ({TRIGGER_VERSION})"
            ));
        }
    }
    match env.get("REALTIME_BACKEND_NATIVE_ENABLED") {
        Some(Value::String(s)) if s == "1" => {}
        other => p.push(format!(
            "webapp REALTIME_BACKEND_NATIVE_ENABLED must be the string \"1\" (the webapp compares strings), is {other:?}"
        )),
    }
    let pub_host = env
        .get("REALTIME_BACKEND_NATIVE_PUBSUB_REDIS_HOST")
        .map(scalar);
    let pub_port = env
        .get("REALTIME_BACKEND_NATIVE_PUBSUB_REDIS_PORT")
        .map(scalar)
        .and_then(|s| s.parse::<u16>().ok());
    if pub_host.as_deref() != Some(webapp_compose::REDIS_HOST)
        || pub_port != Some(webapp_compose::REDIS_PORT)
    {
        p.push(format!(
            "the webapp publishes to {pub_host:?}:{pub_port:?}, not trigger.dev's Redis {}:{}",
            webapp_compose::REDIS_HOST,
            webapp_compose::REDIS_PORT
        ));
    }
    // runfeed itself.
    let Some(rf) = doc["services"].get("runfeed") else {
        p.push("no runfeed service".into());
        return p;
    };
    let networks = list(&rf["networks"]);
    if !networks.contains(&webapp_compose::DATA_NETWORK.to_string()) {
        p.push(format!(
            "runfeed is not on network {} (postgres, redis)",
            webapp_compose::DATA_NETWORK
        ));
    }
    for n in &networks {
        if !webapp_compose::NETWORKS.contains(&n.as_str()) && n != traefik_compose::NETWORK {
            p.push(format!(
                "runfeed is on network {n}, which trigger.dev's files do not define"
            ));
        }
    }
    for dep in list(&rf["depends_on"]) {
        if !webapp_compose::SERVICES.contains(&dep.as_str()) {
            p.push(format!(
                "runfeed depends on {dep}, not a trigger.dev service"
            ));
        }
    }
    let renv: BTreeMap<String, String> = env_of(rf)
        .into_iter()
        .map(|(k, v)| {
            let v = interpolate(&scalar(&v), &vars).unwrap_or_else(|e| {
                p.push(format!("runfeed env {k}: {e}"));
                String::new()
            });
            (k, v)
        })
        .collect();
    match renv.get("DATABASE_URL").and_then(|u| url_parts(u)) {
        Some((user, host, port, db))
            if user == "runfeed"
                && host == webapp_compose::PG_HOST
                && port == Some(webapp_compose::PG_PORT)
                && db == webapp_compose::PG_DATABASE => {}
        other => p.push(format!(
            "runfeed's DATABASE_URL must be the `runfeed` role on {}:{}/{}, is {other:?}",
            webapp_compose::PG_HOST,
            webapp_compose::PG_PORT,
            webapp_compose::PG_DATABASE
        )),
    }
    match renv.get("REDIS_URL").and_then(|u| url_parts(u)) {
        Some((_, host, port, _)) if Some(&host) == pub_host.as_ref() && port == pub_port => {}
        other => p.push(format!(
            "runfeed's REDIS_URL must be the Redis the webapp publishes to ({pub_host:?}:{pub_port:?}), is {other:?}"
        )),
    }
    if renv
        .get("RUNFEED_SERVER__HANDLE_SECRET")
        .is_none_or(|s| s.is_empty())
    {
        p.push("runfeed needs RUNFEED_SERVER__HANDLE_SECRET (the same on every instance)".into());
    }
    // Its command through the real CLI; the published port is the listen port.
    let args: Vec<String> = std::iter::once("runfeed".to_string())
        .chain(list(&rf["command"]))
        .collect();
    let listen_port = match Cli::try_parse_from(&args) {
        Ok(Cli {
            command: Command::Serve(a),
        }) => a
            .listen
            .as_deref()
            .and_then(|l| l.parse::<std::net::SocketAddr>().ok())
            .filter(|a| a.ip().is_unspecified())
            .map(|a| a.port()),
        Ok(_) => None,
        Err(e) => {
            p.push(format!("the CLI rejects {args:?}: {}", e.render()));
            None
        }
    };
    if listen_port.is_none() {
        p.push(format!(
            "runfeed must `serve --listen 0.0.0.0:PORT`, runs {args:?}"
        ));
    }
    for port in list(&rf["ports"]) {
        let port = interpolate(&port, &vars).unwrap_or_default();
        let container: Option<u16> = port.rsplit(':').next().and_then(|c| c.parse().ok());
        if container != listen_port {
            p.push(format!(
                "runfeed publishes {port}, not its listen port {listen_port:?}"
            ));
        }
        if port.contains(":9464") {
            p.push("runfeed publishes its admin port".into());
        }
    }
    // Its RUNFEED_* variables through the real configuration loader.
    let config_env: Vec<(String, String)> = renv
        .iter()
        .filter(|(k, _)| k.starts_with("RUNFEED_"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    figment::Jail::expect_with(|jail| {
        jail.clear_env();
        for (k, v) in &config_env {
            jail.set_env(k, v);
        }
        if let Err(e) = runfeed::config::Config::load(None) {
            p.push(format!("runfeed's RUNFEED_ variables do not load: {e}"));
        }
        Ok(())
    });
    match renv
        .get("RUNFEED_TELEMETRY__ADMIN_LISTEN")
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
    {
        Some(a) if a.ip().is_unspecified() => {}
        other => p.push(format!(
            "RUNFEED_TELEMETRY__ADMIN_LISTEN must listen on 0.0.0.0 (health checks come over the network), is {other:?}"
        )),
    }
    // Run tokens go to the webapp on the compose network, never to a proxy in front of runfeed.
    let upstream = renv.get("RUNFEED_AUTH__RUN_TOKEN_UPSTREAM");
    let names_webapp = upstream.is_some_and(|url| {
        url.starts_with("http://")
            && url_parts(url).is_some_and(|(_, host, port, _)| {
                host == "webapp" && port == Some(webapp_compose::WEBAPP_PORT)
            })
    });
    if !names_webapp {
        p.push(format!(
            "RUNFEED_AUTH__RUN_TOKEN_UPSTREAM must name the webapp on the compose network (http://webapp:{}), is {upstream:?}",
            webapp_compose::WEBAPP_PORT
        ));
    }
    // Variables: trigger.dev's own, or runfeed's documented ones.
    for var in variables(raw) {
        let ours = var.starts_with("RUNFEED_") || var == "TRAEFIK_WEBAPP_HOST";
        if !ours
            && !webapp_compose::SHARED_VARS.contains(&var.as_str())
            && var != "TRAEFIK_ENTRYPOINT"
        {
            p.push(format!(
                "${{{var}}} is neither trigger.dev's nor a RUNFEED_ variable"
            ));
        }
    }
    p
}

/// The Traefik overlay: runfeed on Traefik's network with a router above the webapp's for GET,
/// HEAD and OPTIONS on exactly the feed routes of the webapp's host.
fn check_traefik(doc: &Value, base: &Value) -> Vec<String> {
    let mut p = Vec::new();
    let vars = BTreeMap::new();
    let Some(rf) = doc["services"].get("runfeed") else {
        return vec!["no runfeed service".into()];
    };
    let networks = list(&rf["networks"]);
    for n in [traefik_compose::NETWORK, webapp_compose::DATA_NETWORK] {
        if !networks.contains(&n.to_string()) {
            p.push(format!("runfeed is not on network {n}"));
        }
    }
    let l = labels(rf);
    let get = |k: &str| l.get(k).map(|v| interpolate(v, &vars));
    if l.get("traefik.enable").map(String::as_str) != Some("true") {
        p.push("traefik.enable=true missing (the provider's exposedbydefault is false)".into());
    }
    if get("traefik.docker.network") != Some(Ok(traefik_compose::NETWORK.into())) {
        p.push(format!(
            "traefik.docker.network must be {}",
            traefik_compose::NETWORK
        ));
    }
    if l.get("traefik.http.routers.runfeed.entrypoints")
        .map(String::as_str)
        != Some(traefik_compose::ENTRYPOINTS)
    {
        p.push(format!(
            "the router must use the webapp's entrypoints {}",
            traefik_compose::ENTRYPOINTS
        ));
    }
    let want_rule = format!(
        "Host(`{}`) && (Method(`GET`) || Method(`HEAD`) || Method(`OPTIONS`)) && PathRegexp(`{FEED_PATH_REGEX}`)",
        traefik_compose::WEBAPP_HOST
    );
    match get("traefik.http.routers.runfeed.rule") {
        Some(Ok(rule)) if rule == want_rule => {}
        other => p.push(format!(
            "router rule (interpolated) is {other:?}, expected {want_rule:?}"
        )),
    }
    if traefik_compose::TRAEFIK_MAJOR >= 3 {
        if let Some(rule) = l.get("traefik.http.routers.runfeed.rule") {
            if rule.contains("Method(`GET`,") || rule.contains("PathPrefix(`/realtime/v1/`") {
                p.push("Traefik v3 takes one method per Method(); no prefix routes".into());
            }
        }
    }
    match l
        .get("traefik.http.routers.runfeed.priority")
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(pr) if pr > traefik_compose::WEBAPP_RULE.len() => {}
        other => p.push(format!(
            "priority {other:?} must exceed the webapp router's (its rule's length, {})",
            traefik_compose::WEBAPP_RULE.len()
        )),
    }
    // The service port is runfeed's listen port; the health check hits /readyz on the admin port.
    let base_rf = &base["services"]["runfeed"];
    let listen_port = list(&base_rf["command"])
        .iter()
        .find_map(|w| w.parse::<std::net::SocketAddr>().ok())
        .map(|a| a.port().to_string());
    if l.get("traefik.http.services.runfeed.loadbalancer.server.port") != listen_port.as_ref() {
        p.push(format!(
            "the service port must be runfeed's listen port {listen_port:?}"
        ));
    }
    let admin_port = env_of(base_rf)
        .get("RUNFEED_TELEMETRY__ADMIN_LISTEN")
        .map(scalar)
        .and_then(|a| a.rsplit(':').next().map(String::from));
    if l.get("traefik.http.services.runfeed.loadbalancer.healthcheck.port") != admin_port.as_ref()
        || l.get("traefik.http.services.runfeed.loadbalancer.healthcheck.path")
            .map(String::as_str)
            != Some("/readyz")
    {
        p.push(format!(
            "the health check must GET /readyz on the admin port {admin_port:?}"
        ));
    }
    if l.get("traefik.http.routers.runfeed.service")
        .map(String::as_str)
        != Some("runfeed")
    {
        p.push("the router must name its service (runfeed)".into());
    }
    // The same route over TLS (HTTP/2 to browsers) on the TLS entry point.
    let tls = |k: &str| l.get(&format!("traefik.http.routers.runfeed-websecure.{k}"));
    for k in ["rule", "priority", "service"] {
        if tls(k) != l.get(&format!("traefik.http.routers.runfeed.{k}")) {
            p.push(format!(
                "the runfeed-websecure router's {k} must be the runfeed router's"
            ));
        }
    }
    if tls("entrypoints").map(String::as_str) != Some(traefik_compose::TLS_ENTRYPOINT)
        || tls("tls").map(String::as_str) != Some("true")
    {
        p.push(format!(
            "the runfeed-websecure router must serve TLS (tls=true) on entrypoint {}",
            traefik_compose::TLS_ENTRYPOINT
        ));
    }
    p
}

// =============================================================================================
// Tests

#[test]
fn overlay_wires_runfeed_into_trigger_dev_compose() {
    let problems = check_overlay(&overlay(OVERLAY), &read(OVERLAY));
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn overlay_check_catches_a_broken_overlay() {
    let bad = r#"
services:
  webapp:
    environment:
      REALTIME_BACKEND_NATIVE_ENABLED: 1
      REALTIME_NATIVE_ENABLED: "1"
      REALTIME_BACKEND_NATIVE_PUBSUB_REDIS_HOST: cache
  worker:
    image: x
  runfeed:
    build: ./runfeed
    command: ["serve", "--listen", "127.0.0.1:3030"]
    networks: [default]
    depends_on: [db]
    ports: ["9464:9464"]
    environment:
      DATABASE_URL: postgresql://postgres:${POSTGRES_PASSWORD}@postgres:5432/postgres
      REDIS_URL: redis://redis:6379
      RUNFEED_TELEMETRY__ADMIN_LISTN: 0.0.0.0:9464
      RUNFEED_X: $x
"#;
    let problems = check_overlay(&parse(bad).unwrap(), bad);
    assert_found_all(
        &problems,
        &[
            "service worker is neither runfeed",
            "service runfeed builds",
            "REALTIME_NATIVE_ENABLED is not a key",
            "must be the string \"1\"",
            "not trigger.dev's Redis redis:6379",
            "not on network webapp",
            "network default",
            "depends on db",
            "DATABASE_URL: ${POSTGRES_PASSWORD} has no value",
            "REDIS_URL must be the Redis the webapp publishes to",
            "RUNFEED_SERVER__HANDLE_SECRET",
            "serve --listen 0.0.0.0:PORT",
            "publishes its admin port",
            "RUNFEED_X: a lone `$`",
            "do not load",
            "RUNFEED_TELEMETRY__ADMIN_LISTEN must listen on 0.0.0.0",
            "${POSTGRES_PASSWORD} is neither",
        ],
    );
}

#[test]
fn traefik_overlay_routes_exactly_the_feed_routes_above_the_webapp() {
    let problems = check_traefik(&overlay(TRAEFIK_OVERLAY), &overlay(OVERLAY));
    assert!(problems.is_empty(), "{problems:#?}");
    // Only runfeed is touched: the webapp's own router stays as trigger.dev ships it.
    let doc = overlay(TRAEFIK_OVERLAY);
    assert_eq!(services(&doc).len(), 1);
}

#[test]
fn traefik_check_catches_a_broken_router() {
    let bad = "services:\n  runfeed:\n    networks: [webapp]\n    labels:\n      - \"traefik.http.routers.runfeed.rule=Host(`webapp.localhost`) && PathPrefix(`/realtime/v1/`)\"\n      - traefik.http.routers.runfeed.priority=10\n      - traefik.http.routers.runfeed.entrypoints=web\n      - traefik.http.services.runfeed.loadbalancer.server.port=3000\n      - traefik.http.services.runfeed.loadbalancer.healthcheck.path=/healthz\n";
    let problems = check_traefik(&parse(bad).unwrap(), &overlay(OVERLAY));
    assert_found_all(
        &problems,
        &[
            "not on network traefik",
            "traefik.enable=true missing",
            "traefik.docker.network",
            "entrypoints",
            "router rule",
            "no prefix routes",
            "priority Some(10)",
            "service port",
            "/readyz",
            "name its service",
            "runfeed-websecure router's rule",
            "must serve TLS",
        ],
    );
}

#[test]
fn the_feed_route_regex_is_the_one_the_proxy_recipes_run() {
    // The Traefik rule's regex is compose-escaped ($$); the recipes carry it verbatim.
    assert!(read(TRAEFIK_OVERLAY).contains(&FEED_PATH_REGEX.replace('$', "$$")));
    for recipe in [
        "deploy/proxies/nginx/runfeed.conf",
        "deploy/proxies/caddy/Caddyfile",
        "deploy/proxies/haproxy/haproxy.cfg",
    ] {
        assert!(
            read(recipe).contains(FEED_PATH_REGEX),
            "{recipe} routes another regex"
        );
    }
    // tests/e2e/proxies/suite.mjs checks the routing with the same pattern.
    assert!(read("tests/e2e/proxies/suite.mjs")
        .contains(r"^\/realtime\/v1\/(runs|runs\/[^/]+|batches\/[^/]+)$"));
}

#[test]
fn no_electric_overlay_only_parks_electric() {
    let doc = overlay(NO_ELECTRIC);
    let svcs = services(&doc);
    assert_eq!(svcs.len(), 1, "touches one service");
    let (name, svc) = &svcs[0];
    assert_eq!(name, "electric");
    assert!(webapp_compose::SERVICES.contains(&"electric"));
    assert_eq!(
        list(&svc["profiles"]),
        ["electric"],
        "a profile nobody activates keeps it from starting"
    );
    assert!(
        !webapp_compose::WEBAPP_DEPENDS_ON.contains(&"electric"),
        "the webapp starts without electric"
    );
}

#[test]
fn interpolation_and_urls_parse_like_compose() {
    let vars = BTreeMap::from([("A", "1")]);
    assert_eq!(interpolate("x${A}y$${B}", &vars).unwrap(), "x1y${B}");
    assert_eq!(interpolate("${B:-dflt}", &vars).unwrap(), "dflt");
    assert!(interpolate("${B:?need B}", &vars)
        .unwrap_err()
        .contains("no value"));
    assert!(interpolate("a$b", &vars).is_err());
    assert_eq!(
        url_parts("postgresql://runfeed:pw@postgres:5432/main?sslmode=disable"),
        Some((
            "runfeed".into(),
            "postgres".into(),
            Some(5432),
            "main".into()
        ))
    );
}

#[test]
fn compose_guide_has_the_exact_up_line_and_names_the_version() {
    let readme = read("docs/install-compose.md");
    assert!(
        readme.contains(TRIGGER_VERSION),
        "names the trigger.dev version"
    );
    let line = readme
        .lines()
        .find(|l| {
            l.contains("docker compose")
                && l.contains("docker-compose.runfeed.traefik.yml")
                && l.trim_end().ends_with("up -d")
        })
        .expect("a `docker compose -f … up -d` line with the Traefik overlay");
    let files: Vec<&str> = line
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0] == "-f")
        .map(|w| w[1])
        .collect();
    assert_eq!(
        files,
        [
            "docker-compose.yml",
            "../docker-compose.traefik.yml",
            "$RUNFEED/deploy/trigger.dev/compose/docker-compose.runfeed.yml",
            "$RUNFEED/deploy/trigger.dev/compose/docker-compose.runfeed.traefik.yml"
        ],
        "{line}"
    );
    for f in &files[2..] {
        let rel = f.trim_start_matches("$RUNFEED/");
        assert!(repo().join(rel).is_file(), "{rel} missing");
    }
    // The variables the overlay requires are the ones the guide tells to set.
    for var in [
        "RUNFEED_DB_PASSWORD",
        "RUNFEED_HANDLE_SECRET",
        "TRAEFIK_WEBAPP_HOST",
    ] {
        assert!(
            readme.contains(var),
            "docs/install-compose.md does not explain {var}"
        );
    }
    let required: BTreeSet<String> = read(OVERLAY)
        .split("${")
        .skip(1)
        .filter(|p| p.split('}').next().is_some_and(|e| e.contains(":?")))
        .map(|p| {
            p.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect();
    assert_eq!(
        required,
        BTreeSet::from([
            "RUNFEED_DB_PASSWORD".to_string(),
            "RUNFEED_HANDLE_SECRET".to_string()
        ])
    );
}

#[test]
fn the_overlay_connects_as_the_role_the_role_file_creates() {
    // The role file's default role is the user in the overlay's DATABASE_URL.
    let sql = read("deploy/trigger.dev/runfeed-role.sql");
    assert!(
        sql.contains("\\set role runfeed"),
        "the role file's default role"
    );
    let rf = &overlay(OVERLAY)["services"]["runfeed"];
    let url = interpolate(&scalar(&env_of(rf)["DATABASE_URL"]), &sample_vars()).unwrap();
    assert_eq!(url_parts(&url).unwrap().0, "runfeed");
}
