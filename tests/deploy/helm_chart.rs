//! Static checks of the Helm chart `deploy/helm/runfeed` and of `deploy/helm/trigger-values.yaml`
//! (the values for trigger.dev's own chart). No `helm` binary and no cluster: this file renders
//! the chart itself with [`render_chart`], a small implementation of the part of Helm's template
//! language the chart uses (Go `text/template` actions `if`/`else`/`with`/`range`/`define`,
//! `{{-`/`-}}` trimming, pipelines, parentheses, and Helm's `include`, `toYaml`, `nindent`,
//! `indent`, `quote`, `default`, `required`, `printf`, `trunc`, `trimSuffix`, `not`, `and`,
//! `or`, `eq`, `contains`). Anything else in a template is an error, so the chart cannot drift outside
//! what is checked here. The rendered manifests are parsed as YAML and checked: probes on the
//! admin port's `/readyz` and `/healthz`, ports, the environment runfeed requires (through the
//! real CLI parser and configuration loader), resources, the preStop drain against the graceful
//! shutdown, and that Service, Ingress, PodDisruptionBudget, HPA and ServiceMonitor select the
//! pods and name the right ports.
//!
//! Every checker returns the problems it found and has a test on a broken input too.

use crate::common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Parser;
use common::checks::assert_found_all;
use runfeed::cli::{Cli, Command};
use serde_yaml::{Mapping, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

const CHART: &str = "deploy/helm/runfeed";

// =============================================================================================
// A small Helm template renderer

#[derive(Clone, Debug)]
enum Arg {
    Dot(Vec<String>),  // `.` or `.a.b`
    Root(Vec<String>), // `$` or `$.a.b`
    Str(String),
    Num(i64),
    Func(String),
    Sub(Pipe),
}

type Cmd = Vec<Arg>;
type Pipe = Vec<Cmd>;

#[derive(Clone, Debug)]
enum Node {
    Text(String),
    Expr(Pipe),
    If(Pipe, Vec<Node>, Vec<Node>),
    With(Pipe, Vec<Node>, Vec<Node>),
    Range(Pipe, Vec<Node>),
}

/// `{{ … }}` actions and the text between them, with `{{-` / `-}}` whitespace trimming applied
/// and comments dropped.
fn lex(src: &str) -> Result<Vec<Result<String, String>>, String> {
    // Ok(text) | Err(action) — a plain Result used as an either.
    let mut out: Vec<Result<String, String>> = Vec::new();
    let mut rest = src;
    let mut trim_next = false;
    while let Some(start) = rest.find("{{") {
        let mut text = rest[..start].to_string();
        if trim_next {
            text = text.trim_start().to_string();
        }
        let after = &rest[start + 2..];
        let trim_prev = after.starts_with('-') && after[1..].starts_with(char::is_whitespace);
        if trim_prev {
            text = text.trim_end().to_string();
        }
        out.push(Ok(text));
        let end = after.find("}}").ok_or("unclosed {{")?;
        let mut body = &after[..end];
        if trim_prev {
            body = &body[1..];
        }
        trim_next = body.ends_with('-') && body[..body.len() - 1].ends_with(char::is_whitespace);
        if trim_next {
            body = &body[..body.len() - 1];
        }
        let body = body.trim();
        if !(body.starts_with("/*") && body.ends_with("*/")) {
            out.push(Err(body.to_string()));
        }
        rest = &after[end + 2..];
    }
    let mut text = rest.to_string();
    if trim_next {
        text = text.trim_start().to_string();
    }
    out.push(Ok(text));
    Ok(out)
}

fn words(body: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let chars: Vec<char> = body.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '"' {
            let mut s = String::from('"');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                s.push(*chars.get(i).ok_or("unterminated string")?);
                i += 1;
            }
            if i >= chars.len() {
                return Err(format!("unterminated string in {body:?}"));
            }
            out.push(s);
            i += 1;
        } else if "()|".contains(c) {
            out.push(c.to_string());
            i += 1;
        } else {
            let start = i;
            while i < chars.len() && !chars[i].is_whitespace() && !"()|\"".contains(chars[i]) {
                i += 1;
            }
            out.push(chars[start..i].iter().collect());
        }
    }
    Ok(out)
}

const FUNCS: &[&str] = &[
    "include",
    "toYaml",
    "nindent",
    "indent",
    "quote",
    "default",
    "required",
    "printf",
    "trunc",
    "trimSuffix",
    "not",
    "and",
    "or",
    "eq",
    "contains",
];

fn parse_pipe(ws: &[String], pos: &mut usize) -> Result<Pipe, String> {
    let mut pipe = vec![Vec::new()];
    while *pos < ws.len() {
        let w = &ws[*pos];
        *pos += 1;
        let arg = match w.as_str() {
            ")" => return Ok(pipe),
            "|" => {
                pipe.push(Vec::new());
                continue;
            }
            "(" => Arg::Sub(parse_pipe(ws, pos)?),
            "." => Arg::Dot(vec![]),
            "$" => Arg::Root(vec![]),
            _ if w.starts_with('"') => Arg::Str(w[1..].to_string()),
            _ if w.starts_with('.') => Arg::Dot(w[1..].split('.').map(String::from).collect()),
            _ if w.starts_with("$.") => Arg::Root(w[2..].split('.').map(String::from).collect()),
            _ if w.parse::<i64>().is_ok() => Arg::Num(w.parse().unwrap()),
            _ if FUNCS.contains(&w.as_str()) => Arg::Func(w.clone()),
            _ => return Err(format!("unsupported in this renderer: {w:?}")),
        };
        pipe.last_mut().unwrap().push(arg);
    }
    if pipe.iter().any(Vec::is_empty) {
        return Err("empty command in a pipeline".into());
    }
    Ok(pipe)
}

fn pipe_of(body: &str) -> Result<Pipe, String> {
    let ws = words(body)?;
    let mut pos = 0;
    let pipe = parse_pipe(&ws, &mut pos)?;
    if pos != ws.len() {
        return Err(format!("unbalanced parentheses in {body:?}"));
    }
    Ok(pipe)
}

/// Parses until `{{ end }}` (or `{{ else }}` when `allow_else`); returns the nodes and whether
/// it stopped at an `else`.
fn parse_nodes(
    toks: &[Result<String, String>],
    pos: &mut usize,
    defines: &mut BTreeMap<String, Vec<Node>>,
    top: bool,
) -> Result<(Vec<Node>, Option<&'static str>), String> {
    let mut nodes = Vec::new();
    while *pos < toks.len() {
        let tok = &toks[*pos];
        *pos += 1;
        let body = match tok {
            Ok(text) => {
                if !text.is_empty() {
                    nodes.push(Node::Text(text.clone()));
                }
                continue;
            }
            Err(body) => body.as_str(),
        };
        let (kw, rest) = body.split_once(' ').unwrap_or((body, ""));
        match kw {
            "end" => return Ok((nodes, Some("end"))),
            "else" if rest.is_empty() => return Ok((nodes, Some("else"))),
            "else" => return Err(format!("unsupported in this renderer: {{{{ {body} }}}}")),
            "if" | "with" => {
                let cond = pipe_of(rest)?;
                let (then, stop) = parse_nodes(toks, pos, defines, false)?;
                let els = match stop {
                    Some("else") => {
                        let (els, stop) = parse_nodes(toks, pos, defines, false)?;
                        if stop != Some("end") {
                            return Err(format!("{kw} … else without end"));
                        }
                        els
                    }
                    Some("end") => Vec::new(),
                    _ => return Err(format!("{kw} without end")),
                };
                nodes.push(if kw == "if" {
                    Node::If(cond, then, els)
                } else {
                    Node::With(cond, then, els)
                });
            }
            "range" => {
                let over = pipe_of(rest)?;
                let (body, stop) = parse_nodes(toks, pos, defines, false)?;
                if stop != Some("end") {
                    return Err("range without end (or with else)".into());
                }
                nodes.push(Node::Range(over, body));
            }
            "define" => {
                let name = rest.trim().trim_matches('"').to_string();
                let (body, stop) = parse_nodes(toks, pos, defines, false)?;
                if stop != Some("end") {
                    return Err(format!("define {name} without end"));
                }
                defines.insert(name, body);
            }
            _ if body.contains(":=")
                || body.starts_with("template")
                || body.starts_with("block") =>
            {
                return Err(format!("unsupported in this renderer: {{{{ {body} }}}}"));
            }
            _ => nodes.push(Node::Expr(pipe_of(body)?)),
        }
    }
    if top {
        Ok((nodes, None))
    } else {
        Err("missing {{ end }}".into())
    }
}

struct Engine {
    defines: BTreeMap<String, Vec<Node>>,
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Sequence(s) => !s.is_empty(),
        Value::Mapping(m) => !m.is_empty(),
        Value::Tagged(_) => true,
    }
}

fn text_of(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        other => serde_yaml::to_string(other)
            .unwrap_or_default()
            .trim_end()
            .to_string(),
    }
}

fn field(mut v: &Value, path: &[String]) -> Value {
    for key in path {
        match v.get(key.as_str()) {
            Some(next) => v = next,
            None => return Value::Null,
        }
    }
    v.clone()
}

fn indent(n: usize, s: &str) -> String {
    let pad = " ".repeat(n);
    s.lines()
        .map(|l| format!("{pad}{l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl Engine {
    fn new() -> Engine {
        Engine {
            defines: BTreeMap::new(),
        }
    }

    fn parse(&mut self, src: &str) -> Result<Vec<Node>, String> {
        let toks = lex(src)?;
        let mut pos = 0;
        let (nodes, stop) = parse_nodes(&toks, &mut pos, &mut self.defines, true)?;
        if stop.is_some() {
            return Err("unexpected {{ end }} / {{ else }}".into());
        }
        Ok(nodes)
    }

    fn render(&self, nodes: &[Node], dot: &Value, root: &Value) -> Result<String, String> {
        let mut out = String::new();
        for node in nodes {
            match node {
                Node::Text(t) => out.push_str(t),
                Node::Expr(p) => out.push_str(&text_of(&self.eval(p, dot, root)?)),
                Node::If(c, then, els) => {
                    let branch = if truthy(&self.eval(c, dot, root)?) {
                        then
                    } else {
                        els
                    };
                    out.push_str(&self.render(branch, dot, root)?);
                }
                Node::With(c, then, els) => {
                    let v = self.eval(c, dot, root)?;
                    if truthy(&v) {
                        out.push_str(&self.render(then, &v, root)?);
                    } else {
                        out.push_str(&self.render(els, dot, root)?);
                    }
                }
                Node::Range(over, body) => match self.eval(over, dot, root)? {
                    Value::Sequence(items) => {
                        for item in &items {
                            out.push_str(&self.render(body, item, root)?);
                        }
                    }
                    Value::Mapping(m) => {
                        for (_, item) in &m {
                            out.push_str(&self.render(body, item, root)?);
                        }
                    }
                    Value::Null => {}
                    other => return Err(format!("range over {other:?}")),
                },
            }
        }
        Ok(out)
    }

    fn arg(&self, a: &Arg, dot: &Value, root: &Value) -> Result<Value, String> {
        Ok(match a {
            Arg::Dot(path) => field(dot, path),
            Arg::Root(path) => field(root, path),
            Arg::Str(s) => Value::String(s.clone()),
            Arg::Num(n) => Value::Number((*n).into()),
            Arg::Sub(p) => self.eval(p, dot, root)?,
            Arg::Func(f) => return Err(format!("function {f} used as a value")),
        })
    }

    fn eval(&self, pipe: &Pipe, dot: &Value, root: &Value) -> Result<Value, String> {
        let mut piped: Option<Value> = None;
        for cmd in pipe {
            let value = match &cmd[0] {
                Arg::Func(name) => {
                    let mut args = cmd[1..]
                        .iter()
                        .map(|a| self.arg(a, dot, root))
                        .collect::<Result<Vec<_>, _>>()?;
                    if let Some(p) = piped.take() {
                        args.push(p);
                    }
                    self.call(name, &args, root)?
                }
                single if cmd.len() == 1 && piped.is_none() => self.arg(single, dot, root)?,
                _ => return Err(format!("not a function call: {cmd:?}")),
            };
            piped = Some(value);
        }
        Ok(piped.unwrap_or(Value::Null))
    }

    fn call(&self, name: &str, args: &[Value], root: &Value) -> Result<Value, String> {
        let want = |n: usize| -> Result<(), String> {
            if args.len() == n {
                Ok(())
            } else {
                Err(format!("{name} takes {n} arguments, got {}", args.len()))
            }
        };
        let s = |v: &Value| text_of(v);
        let n = |v: &Value| -> Result<usize, String> {
            v.as_u64()
                .map(|n| n as usize)
                .ok_or(format!("{name}: not a number: {v:?}"))
        };
        Ok(match name {
            "include" => {
                want(2)?;
                let body = self
                    .defines
                    .get(&s(&args[0]))
                    .ok_or(format!("include of undefined {:?}", s(&args[0])))?;
                Value::String(self.render(body, &args[1], root)?)
            }
            "toYaml" => {
                want(1)?;
                let text = serde_yaml::to_string(&args[0]).map_err(|e| e.to_string())?;
                Value::String(text.trim_end().to_string())
            }
            "nindent" => {
                want(2)?;
                Value::String(format!("\n{}", indent(n(&args[0])?, &s(&args[1]))))
            }
            "indent" => {
                want(2)?;
                Value::String(indent(n(&args[0])?, &s(&args[1])))
            }
            "quote" => {
                want(1)?;
                Value::String(format!(
                    "\"{}\"",
                    s(&args[0]).replace('\\', "\\\\").replace('"', "\\\"")
                ))
            }
            "default" => {
                want(2)?;
                if truthy(&args[1]) {
                    args[1].clone()
                } else {
                    args[0].clone()
                }
            }
            "required" => {
                want(2)?;
                if !truthy(&args[1]) {
                    return Err(format!("required: {}", s(&args[0])));
                }
                args[1].clone()
            }
            "printf" => {
                let fmt = s(args.first().ok_or("printf without a format")?);
                let mut out = String::new();
                let mut rest = args[1..].iter();
                let mut chars = fmt.chars();
                while let Some(c) = chars.next() {
                    if c != '%' {
                        out.push(c);
                        continue;
                    }
                    match chars.next() {
                        Some('s' | 'v' | 'd') => {
                            out.push_str(&s(rest.next().ok_or("printf: too few arguments")?))
                        }
                        Some('%') => out.push('%'),
                        other => return Err(format!("printf: unsupported verb {other:?}")),
                    }
                }
                if rest.next().is_some() {
                    return Err("printf: too many arguments".into());
                }
                Value::String(out)
            }
            "trunc" => {
                want(2)?;
                Value::String(s(&args[1]).chars().take(n(&args[0])?).collect())
            }
            "trimSuffix" => {
                want(2)?;
                let (suffix, text) = (s(&args[0]), s(&args[1]));
                Value::String(text.strip_suffix(&suffix).unwrap_or(&text).to_string())
            }
            "not" => {
                want(1)?;
                Value::Bool(!truthy(&args[0]))
            }
            "and" => Value::Bool(args.iter().all(truthy)),
            "or" => Value::Bool(args.iter().any(truthy)),
            "eq" => {
                want(2)?;
                Value::Bool(args[0] == args[1])
            }
            "contains" => {
                want(2)?;
                Value::Bool(s(&args[1]).contains(&s(&args[0])))
            }
            other => return Err(format!("unsupported function {other}")),
        })
    }
}

/// Deep merge (`over` wins; mappings merge, everything else replaces), like `helm -f`.
fn merge(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// `.Chart` as Helm builds it from Chart.yaml (keys capitalised).
fn chart_object(chart_yaml: &Value) -> Value {
    let mut m = Mapping::new();
    for (k, key) in [
        ("name", "Name"),
        ("version", "Version"),
        ("appVersion", "AppVersion"),
    ] {
        m.insert(
            key.into(),
            chart_yaml.get(k).cloned().unwrap_or(Value::Null),
        );
    }
    Value::Mapping(m)
}

/// A rendered manifest: the template it came from and the parsed document.
struct Doc {
    template: String,
    value: Value,
}

/// Renders the chart in `dir` with its values.yaml deep-merged with `overrides` (YAML) for a
/// release named `release`; returns every non-empty document.
fn render_chart_in(dir: &str, overrides: &str, release: &str) -> Result<Vec<Doc>, String> {
    let chart: Value = serde_yaml::from_str(&read(&format!("{dir}/Chart.yaml")))
        .map_err(|e| format!("Chart.yaml: {e}"))?;
    let mut values: Value = serde_yaml::from_str(&read(&format!("{dir}/values.yaml")))
        .map_err(|e| format!("values.yaml: {e}"))?;
    let over: Value = serde_yaml::from_str(overrides).map_err(|e| format!("overrides: {e}"))?;
    if !over.is_null() {
        merge(&mut values, &over);
    }
    let root: Value = serde_yaml::from_str(&format!(
        "Release: {{Name: {release}, Namespace: {release}, Service: Helm}}"
    ))
    .unwrap();
    let mut root = root;
    root.as_mapping_mut()
        .unwrap()
        .insert("Values".into(), values);
    root.as_mapping_mut()
        .unwrap()
        .insert("Chart".into(), chart_object(&chart));

    let mut engine = Engine::new();
    let mut files: Vec<_> = std::fs::read_dir(repo().join(dir).join("templates"))
        .map_err(|e| e.to_string())?
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let mut parsed = Vec::new();
    for f in &files {
        let nodes = engine
            .parse(&read(&format!("{dir}/templates/{f}")))
            .map_err(|e| format!("{f}: {e}"))?;
        if !f.starts_with('_') && (f.ends_with(".yaml") || f.ends_with(".yml")) {
            parsed.push((f.clone(), nodes));
        }
    }
    let mut docs = Vec::new();
    for (f, nodes) in parsed {
        let text = engine
            .render(&nodes, &root, &root)
            .map_err(|e| format!("{f}: {e}"))?;
        for part in text.split("\n---") {
            let value: Value = serde_yaml::from_str(part)
                .map_err(|e| format!("{f} renders invalid YAML: {e}\n{text}"))?;
            if !value.is_null() {
                docs.push(Doc {
                    template: f.clone(),
                    value,
                });
            }
        }
    }
    Ok(docs)
}

fn render_chart(overrides: &str) -> Vec<Doc> {
    render_chart_in(CHART, overrides, "trigger").unwrap_or_else(|e| panic!("{e}"))
}

/// Every switch on: the manifests a full install renders.
const ALL_ON: &str = r#"
serviceMonitor: {enabled: true, labels: {release: prometheus}}
prometheusRule: {enabled: true, labels: {release: prometheus}}
autoscaling: {heldFeeds: {enabled: true}}
database: {replicaUrlKey: replica-url}
redis: {existingSecret: runfeed-redis}
extraEnv: [{name: RUNFEED_FEEDS__DEFAULT_CONCURRENCY_LIMIT, value: "5000"}]
ingress:
  className: nginx
  annotations: {nginx.ingress.kubernetes.io/proxy-read-timeout: "90"}
  tls: [{secretName: trigger-tls, hosts: [trigger.local]}]
podAnnotations: {prometheus.io/scrape: "false"}
"#;

fn kind<'a>(docs: &'a [Doc], kind: &str) -> Option<&'a Value> {
    docs.iter()
        .map(|d| &d.value)
        .find(|v| v["kind"].as_str() == Some(kind))
}

// =============================================================================================
// Checkers

fn s(v: &Value) -> Option<&str> {
    v.as_str()
}

fn container(deploy: &Value) -> &Value {
    &deploy["spec"]["template"]["spec"]["containers"][0]
}

/// `name → value` of literal env entries; `name → "<secretKeyRef>"` for secret ones.
fn env_map(c: &Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for e in c["env"].as_sequence().into_iter().flatten() {
        let name = e["name"].as_str().unwrap_or("?").to_string();
        let value = if let Some(v) = e.get("value") {
            text_of(v)
        } else if e["valueFrom"]["secretKeyRef"]["name"].as_str().is_some() {
            "<secretKeyRef>".into()
        } else {
            "<other>".into()
        };
        out.insert(name, value);
    }
    out
}

fn port_named(c: &Value, name: &str) -> Option<u64> {
    c["ports"]
        .as_sequence()?
        .iter()
        .find(|p| p["name"].as_str() == Some(name))?["containerPort"]
        .as_u64()
}

/// Probes, ports, environment, resources and the shutdown sequence of the Deployment.
fn check_deployment(deploy: &Value) -> Vec<String> {
    let mut p = Vec::new();
    let c = container(deploy);
    let pod = &deploy["spec"]["template"]["spec"];
    let (http, admin) = (port_named(c, "http"), port_named(c, "admin"));
    if http.is_none() || admin.is_none() {
        p.push(format!("container ports http/admin: {:?}", c["ports"]));
    }
    // The command line through the real parser; its listen port is the http containerPort.
    let args: Vec<String> = std::iter::once("runfeed".to_string())
        .chain(c["args"].as_sequence().into_iter().flatten().map(text_of))
        .collect();
    match Cli::try_parse_from(&args) {
        Ok(Cli {
            command: Command::Serve(a),
        }) => {
            let port = a
                .listen
                .as_deref()
                .and_then(|l| l.parse::<std::net::SocketAddr>().ok())
                .map(|a| (a.ip().is_unspecified(), u64::from(a.port())));
            if port != http.map(|h| (true, h)) {
                p.push(format!(
                    "serve --listen {:?} is not 0.0.0.0:<http containerPort {http:?}>",
                    a.listen
                ));
            }
        }
        Ok(other) => p.push(format!("args run {:?}, not serve", other.command)),
        Err(e) => p.push(format!("the CLI rejects {args:?}: {}", e.render())),
    }
    // Probes on the admin listener.
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        let get = &c[probe]["httpGet"];
        if s(&get["path"]) != Some(path) || s(&get["port"]) != Some("admin") {
            p.push(format!("{probe} must GET {path} on port admin, is {get:?}"));
        }
    }
    // The environment runfeed requires.
    let env = env_map(c);
    for required in ["DATABASE_URL", "REDIS_URL", "RUNFEED_SERVER__HANDLE_SECRET"] {
        if !env.contains_key(required) {
            p.push(format!("env {required} missing"));
        }
    }
    for secret in ["DATABASE_URL", "RUNFEED_SERVER__HANDLE_SECRET"] {
        if env.get(secret).is_some_and(|v| v != "<secretKeyRef>") {
            p.push(format!("env {secret} must come from a Secret"));
        }
    }
    match env.get("RUNFEED_TELEMETRY__ADMIN_LISTEN").map(|a| a.parse::<std::net::SocketAddr>()) {
        Some(Ok(a)) if a.ip().is_unspecified() && Some(u64::from(a.port())) == admin => {}
        other => p.push(format!(
            "RUNFEED_TELEMETRY__ADMIN_LISTEN must be 0.0.0.0:<admin containerPort {admin:?}> (probes come from the kubelet), is {other:?}"
        )),
    }
    // Resources.
    let res = &c["resources"];
    for (what, key) in [
        ("requests", "cpu"),
        ("requests", "memory"),
        ("limits", "memory"),
    ] {
        if res[what][key].is_null() {
            p.push(format!("resources.{what}.{key} unset"));
        }
    }
    // preStop drain, then runfeed's own graceful shutdown, inside the grace period.
    let sleep = c["lifecycle"]["preStop"]["exec"]["command"]
        .as_sequence()
        .filter(|cmd| cmd.first().and_then(Value::as_str) == Some("sleep"))
        .and_then(|cmd| cmd.get(1))
        .map(text_of)
        .and_then(|n| n.parse::<u64>().ok());
    let grace_ms = env
        .get("RUNFEED_SERVER__SHUTDOWN_GRACE_MS")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| runfeed::config::Config::default().server.shutdown_grace_ms);
    match (sleep, pod["terminationGracePeriodSeconds"].as_u64()) {
        (Some(sleep), Some(period)) => {
            let needed = sleep + grace_ms.div_ceil(1000) + 5;
            if period < needed {
                p.push(format!(
                    "terminationGracePeriodSeconds {period} < preStop sleep {sleep} s + shutdown grace {grace_ms} ms + 5 s"
                ));
            }
            if sleep == 0 {
                p.push("preStop sleeps 0 s: new polls may still arrive after SIGTERM".into());
            }
        }
        other => p.push(format!(
            "needs a preStop `sleep N` and terminationGracePeriodSeconds, found {other:?}"
        )),
    }
    // Zero-downtime rollout.
    if deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"].as_u64() != Some(0) {
        p.push("rollingUpdate.maxUnavailable should be 0".into());
    }
    p
}

fn selector_matches(selector: &Value, labels: &Value) -> bool {
    selector
        .as_mapping()
        .is_some_and(|sel| !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// Service, Ingress, PodDisruptionBudget, HPA and ServiceMonitor against the Deployment.
fn check_wiring(docs: &[Doc]) -> Vec<String> {
    let mut p = Vec::new();
    let Some(deploy) = kind(docs, "Deployment") else {
        return vec!["no Deployment".into()];
    };
    let pod_labels = &deploy["spec"]["template"]["metadata"]["labels"];
    let name = &deploy["metadata"]["name"];
    if !selector_matches(&deploy["spec"]["selector"]["matchLabels"], pod_labels) {
        p.push("the Deployment's selector does not match its pods".into());
    }
    let c = container(deploy);
    let Some(svc) = kind(docs, "Service") else {
        return vec!["no Service".into()];
    };
    if !selector_matches(&svc["spec"]["selector"], pod_labels) {
        p.push("the Service does not select the pods".into());
    }
    let svc_ports: Vec<(&str, &str)> = svc["spec"]["ports"]
        .as_sequence()
        .into_iter()
        .flatten()
        .map(|sp| {
            (
                sp["name"].as_str().unwrap_or(""),
                sp["targetPort"].as_str().unwrap_or(""),
            )
        })
        .collect();
    for port in ["http", "admin"] {
        if port_named(c, port).is_none() || !svc_ports.contains(&(port, port)) {
            p.push(format!(
                "the Service has no port {port} → container port {port}"
            ));
        }
    }
    if let Some(ing) = kind(docs, "Ingress") {
        for rule in ing["spec"]["rules"].as_sequence().into_iter().flatten() {
            for path in rule["http"]["paths"].as_sequence().into_iter().flatten() {
                let backend = &path["backend"]["service"];
                if backend["name"] != svc["metadata"]["name"]
                    || s(&backend["port"]["name"]) != Some("http")
                {
                    p.push(format!(
                        "Ingress path {:?} does not go to the Service's http port",
                        path["path"]
                    ));
                }
            }
        }
        p.extend(check_ingress_routing(ing));
    } else {
        p.push("no Ingress".into());
    }
    if let Some(pdb) = kind(docs, "PodDisruptionBudget") {
        if !selector_matches(&pdb["spec"]["selector"]["matchLabels"], pod_labels) {
            p.push("the PodDisruptionBudget does not select the pods".into());
        }
        if pdb["spec"]["maxUnavailable"].is_null() && pdb["spec"]["minAvailable"].is_null() {
            p.push("the PodDisruptionBudget sets neither maxUnavailable nor minAvailable".into());
        }
    } else {
        p.push("no PodDisruptionBudget".into());
    }
    if let Some(hpa) = kind(docs, "HorizontalPodAutoscaler") {
        let target = &hpa["spec"]["scaleTargetRef"];
        if s(&target["kind"]) != Some("Deployment") || &target["name"] != name {
            p.push("the HPA does not scale the Deployment".into());
        }
        if hpa["spec"]["minReplicas"].as_u64().unwrap_or(0) < 2 {
            p.push("HPA minReplicas < 2: a disruption or rollout drops every held poll".into());
        }
        let metrics: Vec<&Value> = hpa["spec"]["metrics"]
            .as_sequence()
            .into_iter()
            .flatten()
            .collect();
        let cpu = metrics
            .iter()
            .any(|m| s(&m["resource"]["name"]) == Some("cpu"));
        let held = metrics
            .iter()
            .any(|m| s(&m["pods"]["metric"]["name"]) == Some("runfeed_router_held_feeds"));
        if !cpu && !held {
            p.push("the HPA scales on neither CPU nor held feeds".into());
        }
        if cpu && c["resources"]["requests"]["cpu"].is_null() {
            p.push("HPA on CPU utilisation needs a CPU request".into());
        }
        if !deploy["spec"]["replicas"].is_null() {
            p.push("with an HPA the Deployment must not set replicas".into());
        }
    }
    if let Some(sm) = kind(docs, "ServiceMonitor") {
        if !selector_matches(
            &sm["spec"]["selector"]["matchLabels"],
            &svc["metadata"]["labels"],
        ) {
            p.push("the ServiceMonitor does not select the Service".into());
        }
        let ep = &sm["spec"]["endpoints"][0];
        if s(&ep["port"]) != Some("admin") || s(&ep["path"]) != Some("/metrics") {
            p.push(format!(
                "the ServiceMonitor must scrape admin /metrics, scrapes {ep:?}"
            ));
        }
    }
    p
}

/// Kubernetes path matching (`Exact`, or `Prefix` on whole `/` segments).
fn ingress_path_matches(path_type: &str, path: &str, request: &str) -> bool {
    match path_type {
        "Exact" => request == path,
        "Prefix" => {
            let p = path.trim_end_matches('/');
            request == p || request.starts_with(&format!("{p}/")) || p.is_empty()
        }
        _ => false,
    }
}

/// The feed routes reach runfeed's Ingress; the webapp's own realtime routes never do.
fn check_ingress_routing(ing: &Value) -> Vec<String> {
    let paths: Vec<(String, String)> = ing["spec"]["rules"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|r| r["http"]["paths"].as_sequence().into_iter().flatten())
        .map(|p| {
            (
                p["pathType"].as_str().unwrap_or("").to_string(),
                p["path"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let routed = |req: &str| paths.iter().any(|(t, p)| ingress_path_matches(t, p, req));
    let mut p = Vec::new();
    for feed in [
        "/realtime/v1/runs",
        "/realtime/v1/runs/run_1",
        "/realtime/v1/batches/batch_1",
    ] {
        if !routed(feed) {
            p.push(format!("{feed} does not reach runfeed"));
        }
    }
    for webapp in [
        "/realtime/v1/streams/run_1/default",
        "/realtime/v1/sessions/s_1/out",
        "/realtime/v1/runsx",
        "/api/v1/runs/run_1",
        "/",
    ] {
        if routed(webapp) {
            p.push(format!("{webapp} must stay on the webapp's Ingress"));
        }
    }
    p
}

// =============================================================================================
// Tests: the renderer

#[test]
fn renderer_trims_pipes_and_includes_like_helm() {
    let mut e = Engine::new();
    let defs = e
        .parse("{{- define \"x.name\" -}}\n{{ printf \"%s-%s\" .a \"b\" | trunc 5 | trimSuffix \"-\" }}\n{{- end -}}")
        .unwrap();
    assert!(defs.is_empty());
    let nodes = e
        .parse("k:\n  {{- include \"x.name\" . | nindent 2 }}\nq: {{ .n | quote }}\nd: {{ .missing | default \"dflt\" }}\n{{- if not .off }}\non: yes\n{{- else }}\non: no\n{{- end }}\n{{- with .m }}\nm:\n  {{- toYaml . | nindent 2 }}\n{{- end }}\n{{- range .l }}\n- {{ . }}\n{{- end }}\np: {{ (.missing | default .n) }}")
        .unwrap();
    let ctx: Value =
        serde_yaml::from_str("{a: abcd, n: 5, off: false, m: {z: 1}, l: [u, v]}").unwrap();
    let out = e.render(&nodes, &ctx, &ctx).unwrap();
    assert_eq!(
        out,
        "k:\n  abcd\nq: \"5\"\nd: dflt\non: yes\nm:\n  z: 1\n- u\n- v\np: 5"
    );
}

#[test]
fn renderer_rejects_what_it_does_not_implement() {
    for bad in [
        "{{ tpl (toYaml .) $ }}",
        "{{- if .a }}x{{- else if .b }}y{{- end }}",
        "{{ $x := 1 }}",
        "{{ template \"x\" . }}",
        "{{ .a | b64enc }}",
        "{{- if .a }}no end",
        "{{ required \"must\" .missing }}",
    ] {
        let mut e = Engine::new();
        let rendered = e
            .parse(bad)
            .and_then(|n| e.render(&n, &Value::Null, &Value::Null));
        assert!(rendered.is_err(), "{bad:?} rendered: {rendered:?}");
    }
}

// =============================================================================================
// Tests: the chart

#[test]
fn chart_renders_every_manifest_with_defaults_and_with_everything_on() {
    let defaults = render_chart("");
    let kinds: Vec<&str> = defaults
        .iter()
        .filter_map(|d| d.value["kind"].as_str())
        .collect();
    for k in [
        "Deployment",
        "Service",
        "Ingress",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    ] {
        assert!(
            kinds.contains(&k),
            "{k} missing from the default render: {kinds:?}"
        );
    }
    assert!(
        !kinds.contains(&"ServiceMonitor"),
        "ServiceMonitor is opt-in (needs the CRD)"
    );
    assert!(
        !kinds.contains(&"PrometheusRule"),
        "PrometheusRule is opt-in (needs the CRD)"
    );
    let all = render_chart(ALL_ON);
    assert!(kind(&all, "ServiceMonitor").is_some());
    for d in defaults.iter().chain(&all) {
        let text = serde_yaml::to_string(&d.value).unwrap();
        assert!(!text.contains("<no value>"), "{}: {text}", d.template);
        assert!(
            d.value["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("trigger-runfeed")),
            "{}",
            d.template
        );
    }
    // The switches show up where they should.
    let deploy = kind(&all, "Deployment").unwrap();
    let env = env_map(container(deploy));
    assert_eq!(env["DATABASE_READ_REPLICA_URL"], "<secretKeyRef>");
    assert_eq!(env["REDIS_URL"], "<secretKeyRef>");
    assert_eq!(env["RUNFEED_FEEDS__DEFAULT_CONCURRENCY_LIMIT"], "5000");
    let hpa = kind(&all, "HorizontalPodAutoscaler").unwrap();
    assert_eq!(hpa["spec"]["metrics"].as_sequence().unwrap().len(), 2);
    let ing = kind(&all, "Ingress").unwrap();
    assert_eq!(ing["spec"]["ingressClassName"], "nginx");
    assert_eq!(ing["spec"]["tls"][0]["secretName"], "trigger-tls");
    // Without an HPA the Deployment sets its replicas.
    let fixed = render_chart("autoscaling: {enabled: false}");
    assert!(kind(&fixed, "HorizontalPodAutoscaler").is_none());
    assert_eq!(kind(&fixed, "Deployment").unwrap()["spec"]["replicas"], 2);
}

#[test]
fn chart_refuses_to_render_without_its_secrets() {
    let err = render_chart_in(CHART, "database: {existingSecret: \"\"}", "trigger")
        .err()
        .unwrap();
    assert!(err.contains("database.existingSecret is required"), "{err}");
    let err = render_chart_in(CHART, "handleSecret: {existingSecret: \"\"}", "trigger")
        .err()
        .unwrap();
    assert!(
        err.contains("handleSecret.existingSecret is required"),
        "{err}"
    );
}

#[test]
fn deployment_probes_ports_env_resources_and_shutdown() {
    for overrides in ["", ALL_ON] {
        let docs = render_chart(overrides);
        let deploy = kind(&docs, "Deployment").unwrap();
        let problems = check_deployment(deploy);
        assert!(problems.is_empty(), "{problems:#?}");
    }
}

#[test]
fn deployment_check_catches_a_broken_deployment() {
    let docs = render_chart("");
    let mut deploy = kind(&docs, "Deployment").unwrap().clone();
    {
        let c = &mut deploy["spec"]["template"]["spec"]["containers"][0];
        c["readinessProbe"]["httpGet"]["path"] = "/healthz".into();
        c["livenessProbe"]["httpGet"]["port"] = "http".into();
        c["args"] = serde_yaml::from_str("[serve, --listen, '127.0.0.1:3030']").unwrap();
        let env = c["env"].as_sequence_mut().unwrap();
        env.retain(|e| e["name"] != "REDIS_URL");
        for e in env.iter_mut() {
            if e["name"] == "RUNFEED_TELEMETRY__ADMIN_LISTEN" {
                e["value"] = "127.0.0.1:9464".into();
            }
        }
        c["resources"] = Value::Mapping(Mapping::new());
        c["lifecycle"]["preStop"]["exec"]["command"] =
            serde_yaml::from_str("[sleep, '40']").unwrap();
    }
    let problems = check_deployment(&deploy);
    assert_found_all(
        &problems,
        &[
            "readinessProbe must GET /readyz",
            "livenessProbe must GET /healthz on port admin",
            "serve --listen",
            "env REDIS_URL missing",
            "RUNFEED_TELEMETRY__ADMIN_LISTEN must be 0.0.0.0",
            "resources.requests.cpu unset",
            "resources.limits.memory unset",
            "terminationGracePeriodSeconds 30 < preStop sleep 40 s",
        ],
    );
}

#[test]
#[allow(clippy::result_large_err)] // figment's jail closure returns figment::Result
fn runfeed_env_vars_load_through_the_real_configuration_loader() {
    let docs = render_chart(ALL_ON);
    let env = env_map(container(kind(&docs, "Deployment").unwrap()));
    let mut seen = 0;
    figment::Jail::expect_with(|jail| {
        jail.clear_env();
        for (k, v) in env
            .iter()
            .filter(|(k, v)| k.starts_with("RUNFEED_") && !v.starts_with('<'))
        {
            jail.set_env(k, v);
            seen += 1;
        }
        let config = runfeed::config::Config::load(None).map_err(|e| e.to_string())?;
        assert_eq!(config.telemetry.log_format, "json");
        assert_eq!(config.server.shutdown_grace_ms, 5000);
        Ok(())
    });
    assert!(seen >= 4, "{env:?}");
    // And a misspelt key is caught by the same loader.
    figment::Jail::expect_with(|jail| {
        jail.clear_env();
        jail.set_env("RUNFEED_SERVER__SHUTDOWN_GRACE", "5000");
        assert!(runfeed::config::Config::load(None).is_err());
        Ok(())
    });
}

#[test]
fn service_ingress_pdb_hpa_and_servicemonitor_select_the_pods() {
    for overrides in ["", ALL_ON] {
        let problems = check_wiring(&render_chart(overrides));
        assert!(problems.is_empty(), "{problems:#?}");
    }
}

#[test]
fn wiring_check_catches_mismatches() {
    let mut docs = render_chart(ALL_ON);
    for d in &mut docs {
        match d.value["kind"].as_str() {
            Some("Service") => {
                d.value["spec"]["selector"]["app.kubernetes.io/name"] = "webapp".into()
            }
            Some("PodDisruptionBudget") => {
                d.value["spec"]
                    .as_mapping_mut()
                    .unwrap()
                    .remove("maxUnavailable");
            }
            Some("HorizontalPodAutoscaler") => d.value["spec"]["minReplicas"] = 1.into(),
            Some("ServiceMonitor") => d.value["spec"]["endpoints"][0]["port"] = "http".into(),
            Some("Ingress") => {
                d.value["spec"]["rules"][0]["http"]["paths"][0]["path"] = "/realtime/v1".into();
            }
            _ => {}
        }
    }
    let problems = check_wiring(&docs);
    assert_found_all(
        &problems,
        &[
            "the Service does not select the pods",
            "sets neither maxUnavailable nor minAvailable",
            "HPA minReplicas < 2",
            "must scrape admin /metrics",
            "/realtime/v1/streams/run_1/default must stay on the webapp's Ingress",
            "/realtime/v1/sessions/s_1/out must stay on the webapp's Ingress",
        ],
    );
    assert!(ingress_path_matches(
        "Prefix",
        "/realtime/v1/runs",
        "/realtime/v1/runs/run_1"
    ));
    assert!(!ingress_path_matches(
        "Prefix",
        "/realtime/v1/runs",
        "/realtime/v1/runsx"
    ));
    assert!(!ingress_path_matches(
        "Exact",
        "/realtime/v1/runs",
        "/realtime/v1/runs/x"
    ));
}

#[test]
fn pod_runs_as_the_images_user() {
    // The Dockerfile's runtime user (useradd --uid N) is the pod's runAsUser, so the read-only
    // root filesystem and non-root checks hold for the real image.
    let dockerfile = read("Dockerfile");
    let uid: u64 = dockerfile
        .split("--uid ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("the Dockerfile creates its user with --uid N");
    let docs = render_chart("");
    let pod = &kind(&docs, "Deployment").unwrap()["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsUser"].as_u64(), Some(uid));
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
}

// =============================================================================================
// Tests: plugging into trigger.dev's chart

/// Facts of trigger.dev's chart, hosting/k8s/helm at tag v4.5.12
/// (https://github.com/triggerdotdev/trigger.dev/tree/v4.5.12/hosting/k8s/helm):
/// - `webapp.extraEnvVars` (values.yaml) is a list of `{name, value}` appended to the webapp
///   container's env (templates/webapp.yaml, `toYaml . | nindent 12`);
/// - the bundled Redis is `<release>-redis-master:6379` without auth (templates/_helpers.tpl
///   `trigger-v4.redis.hostname`; values.yaml `redis.auth.enabled: false`), and the webapp's
///   REDIS_HOST/REDIS_PORT are what REALTIME_BACKEND_NATIVE_PUBSUB_REDIS_* fall back to;
/// - the bundled Postgres is `<release>-postgres:5432`, database `main`
///   (`trigger-v4.postgres.hostname`, values.yaml `postgres.auth.database`);
/// - `electric.deploy: false` requires `electric.external.url`
///   (templates/validate-external-config.yaml);
/// - the webapp's Service is `<release>-webapp` on `webapp.service.port` 3030 (templates/webapp.yaml,
///   values.yaml).
const TRIGGER_CHART_VERSION: &str = "4.5.12";

#[test]
fn trigger_values_switch_on_publishing_in_trigger_charts_shape() {
    let text = read("deploy/helm/trigger-values.yaml");
    assert!(
        text.contains(&format!("v{TRIGGER_CHART_VERSION}")),
        "names the trigger.dev version"
    );
    let v: Value = serde_yaml::from_str(&text).unwrap();
    let extra = v["webapp"]["extraEnvVars"]
        .as_sequence()
        .expect("webapp.extraEnvVars is a list");
    let switch = extra
        .iter()
        .find(|e| e["name"] == "REALTIME_BACKEND_NATIVE_ENABLED")
        .expect("REALTIME_BACKEND_NATIVE_ENABLED");
    // trigger.dev compares the string with "1" (apps/webapp/app/env.server.ts).
    assert_eq!(switch["value"], Value::String("1".into()));
    assert!(extra
        .iter()
        .all(|e| e["name"].is_string() && e["value"].is_string()));
    // The commented Electric switch-off carries the external URL the chart requires.
    assert!(text.contains("#   deploy: false") && text.contains("#     url: "));
}

#[test]
fn chart_defaults_name_trigger_charts_services() {
    let values: Value = serde_yaml::from_str(&read(&format!("{CHART}/values.yaml"))).unwrap();
    // Release `trigger`: <release>-redis-master, <release>-postgres, database main.
    assert_eq!(values["redis"]["url"], "redis://trigger-redis-master:6379");
    let text = read(&format!("{CHART}/values.yaml"));
    assert!(
        text.contains("@trigger-postgres:5432/main"),
        "the database URL example names trigger's Postgres"
    );
    assert!(text.contains(&format!("v{TRIGGER_CHART_VERSION}")));
    // Run tokens go to trigger's webapp Service: <release>-webapp, `webapp.service.port` 3030.
    assert_eq!(values["runTokenUpstream"], "http://trigger-webapp:3030");
    let env = env_map(container(
        kind(&render_chart(""), "Deployment").expect("Deployment"),
    ));
    assert_eq!(
        env["RUNFEED_AUTH__RUN_TOKEN_UPSTREAM"],
        "http://trigger-webapp:3030"
    );
    let unset = render_chart("runTokenUpstream: \"\"");
    let env = env_map(container(kind(&unset, "Deployment").expect("Deployment")));
    assert!(!env.contains_key("RUNFEED_AUTH__RUN_TOKEN_UPSTREAM"));
    // The Ingress host must be set to the webapp's; default = trigger's chart default host.
    assert_eq!(values["ingress"]["host"], "trigger.local");
}

/// The names of every rendered resource.
fn resource_names(docs: &[Doc]) -> Vec<String> {
    docs.iter()
        .map(|d| s(&d.value["metadata"]["name"]).unwrap_or("").to_string())
        .collect()
}

#[test]
fn resources_follow_helms_fullname_rule() {
    // A release named after the chart keeps its name: `helm install runfeed …` → `runfeed`,
    // never `runfeed-runfeed`.
    let own = render_chart_in(CHART, ALL_ON, "runfeed").unwrap_or_else(|e| panic!("{e}"));
    assert!(
        resource_names(&own).iter().all(|n| n == "runfeed"),
        "{:?}",
        resource_names(&own)
    );
    let contains = render_chart_in(CHART, "", "prod-runfeed").unwrap_or_else(|e| panic!("{e}"));
    assert!(resource_names(&contains)
        .iter()
        .all(|n| n == "prod-runfeed"));
    // Any other release: `<release>-runfeed`.
    let other = render_chart_in(CHART, "", "trigger").unwrap_or_else(|e| panic!("{e}"));
    assert!(resource_names(&other)
        .iter()
        .all(|n| n == "trigger-runfeed"));
    // fullnameOverride wins; nameOverride replaces the chart name (and the name label).
    let full = render_chart_in(CHART, "fullnameOverride: feeds", "trigger").unwrap();
    assert!(resource_names(&full).iter().all(|n| n == "feeds"));
    let named = render_chart_in(CHART, "nameOverride: realtime", "trigger").unwrap();
    assert!(resource_names(&named)
        .iter()
        .all(|n| n == "trigger-realtime"));
    let deploy = kind(&named, "Deployment").unwrap();
    assert_eq!(
        deploy["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
        "realtime"
    );
    // Whatever the names, everything still selects and routes to the same pods.
    for docs in [&own, &full, &named] {
        let problems = check_wiring(docs);
        assert!(problems.is_empty(), "{problems:#?}");
    }
}

#[test]
fn stage_a_of_the_switch_over_renders_no_ingress() {
    let docs = render_chart("ingress: {enabled: false}");
    assert!(kind(&docs, "Ingress").is_none());
    assert!(kind(&docs, "Deployment").is_some() && kind(&docs, "Service").is_some());
}

/// The metric families a PromQL expression names (`runfeed_…` identifiers).
fn metrics_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("runfeed_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

#[test]
fn prometheus_rule_alerts_on_5xx_429s_delivery_lag_and_memory() {
    let docs = render_chart(
        "prometheusRule: {enabled: true, errorRatio: 0.05, memoryBytes: 123456789, labels: {release: prometheus}}",
    );
    let rule = kind(&docs, "PrometheusRule").expect("a PrometheusRule when enabled");
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(rule["metadata"]["labels"]["release"], "prometheus");
    let rules: Vec<&Value> = rule["spec"]["groups"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_sequence().into_iter().flatten())
        .collect();
    let exported: Vec<String> = runfeed::telemetry::metrics::exported()
        .into_iter()
        .map(|e| e.prometheus)
        .collect();
    let mut problems = Vec::new();
    for r in &rules {
        let expr = s(&r["expr"]).unwrap_or("");
        for m in metrics_in(expr) {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| m.strip_suffix(suffix))
                .unwrap_or(&m);
            if !exported.iter().any(|e| e == family) {
                problems.push(format!(
                    "{:?}: {m} is not a metric runfeed exports",
                    r["alert"]
                ));
            }
        }
        if r["for"].is_null()
            || r["labels"]["severity"].is_null()
            || r["annotations"]["summary"].is_null()
        {
            problems.push(format!(
                "{:?}: needs for, a severity and a summary",
                r["alert"]
            ));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
    let expr_of = |needle: &str| {
        rules
            .iter()
            .map(|r| s(&r["expr"]).unwrap_or("").to_string())
            .find(|e| e.contains(needle))
            .unwrap_or_else(|| panic!("no alert on {needle}"))
    };
    assert!(
        expr_of("status=~\"5..\"").ends_with("> 0.05"),
        "the 5xx threshold comes from values"
    );
    expr_of("runfeed_feeds_concurrency_rejections_total");
    assert!(expr_of("runfeed_feeds_delivery_lag_milliseconds_bucket")
        .contains("histogram_quantile(0.99"));
    assert!(expr_of("runfeed_process_resident_memory_bytes").ends_with("> 123456789"));
    // No alert on a publisher `serve` never creates.
    assert!(rules.iter().all(|r| !s(&r["expr"])
        .unwrap_or("")
        .contains("runfeed_notifier_publishes_total")));
}
