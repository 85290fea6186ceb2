//! The generated references.
//!
//! - `runfeed config-reference`: the configuration reference, generated from the config struct's
//!   JSON schema (doc comments → descriptions), [`Config::default`] and the `serve` command's
//!   flags. docs/configuration.md holds a copy between `<!-- config-reference:start -->` and
//!   `<!-- config-reference:end -->`.
//! - `runfeed metrics-reference`: the metric reference, generated from the instrument
//!   declarations in `telemetry::metrics`. docs/observability.md holds a copy between
//!   `<!-- metrics-reference:start -->` and `<!-- metrics-reference:end -->`.
//!
//! `scripts/config-reference.sh` rewrites both copies, and a test fails when one is stale.

use crate::config::Config;

/// Config keys `runfeed serve` also takes as a flag: the flag's clap id → `section.key`. Each
/// flag's name and environment variable are read from the CLI definition.
const SERVE_FLAG_KEYS: [(&str, &str); 5] = [
    ("listen", "server.listen"),
    ("database_url", "database.url"),
    ("replica_url", "database.replica_url"),
    ("redis_url", "redis.url"),
    ("run_reads_from_primary", "database.run_reads_from_primary"),
];

/// Switches outside the configuration that also set a key: (`section.key`, how it is spelt).
const OTHER_SWITCHES: [(&str, &str); 1] = [("telemetry.log_format", "RUNFEED_LOG_FORMAT=json")];

/// One row of the configuration reference.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceEntry {
    /// `section`.
    pub section: String,
    /// `key` inside the section.
    pub key: String,
    /// How to set it from outside a file: `RUNFEED_<SECTION>__<KEY>`, then any dedicated
    /// environment variable or `serve` flag.
    pub env: Vec<String>,
    /// JSON-schema type, shortened (`integer`, `string, optional`, `map of string → integer`).
    pub ty: String,
    /// [`Config::default`]'s value, TOML-ish (`unset` for an absent optional).
    pub default: String,
    /// The first paragraph of the key's doc comment, on one line.
    pub description: String,
}

/// One `[section]` of the configuration reference.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceSection {
    /// The section name (`server`, `feeds`, …).
    pub name: String,
    /// The first paragraph of the section struct's doc comment, without the leading `` `[name]` ``.
    pub description: String,
    /// Its keys, in declaration order.
    pub entries: Vec<ReferenceEntry>,
}

/// The configuration reference, built from [`Config`]'s JSON schema (doc comments →
/// descriptions), [`Config::default`] and the `serve` command's flags.
pub fn reference() -> Vec<ReferenceSection> {
    let schema = schemars::schema_for!(Config);
    let root = schema.as_value();
    let defaults = serde_json::to_value(Config::default()).expect("the defaults serialize");
    let serve = serve_flags();
    let mut sections = Vec::new();
    for (name, prop) in properties(root) {
        let def = resolve(root, prop);
        let section_doc = first_paragraph(
            def.get("description")
                .or_else(|| prop.get("description"))
                .and_then(|d| d.as_str())
                .unwrap_or(""),
        );
        let heading = format!("`[{name}]`");
        let rest = section_doc
            .strip_prefix(&heading)
            .unwrap_or(&section_doc)
            .trim_start_matches([':', ' ']);
        let mut chars = rest.chars();
        let description = match chars.next() {
            Some(first) => first.to_uppercase().chain(chars).collect(),
            None => String::new(),
        };
        let mut entries = Vec::new();
        for (key, field) in properties(def) {
            let path = format!("{name}.{key}");
            let mut env = vec![format!(
                "RUNFEED_{}__{}",
                name.to_uppercase(),
                key.to_uppercase()
            )];
            if let Some(extra) = serve.iter().find(|(k, _)| *k == path) {
                env.extend(extra.1.iter().cloned());
            }
            env.extend(
                OTHER_SWITCHES
                    .iter()
                    .filter(|(k, _)| *k == path)
                    .map(|(_, s)| s.to_string()),
            );
            entries.push(ReferenceEntry {
                section: name.to_string(),
                key: key.to_string(),
                env,
                ty: type_name(resolve(root, field)),
                default: render_default(&defaults[name][key]),
                description: first_paragraph(
                    field
                        .get("description")
                        .and_then(|d| d.as_str())
                        .unwrap_or(""),
                ),
            });
        }
        sections.push(ReferenceSection {
            name: name.to_string(),
            description,
            entries,
        });
    }
    sections
}

/// The configuration reference as Markdown: one table per section (docs/configuration.md holds
/// a copy between `<!-- config-reference:start -->` and `<!-- config-reference:end -->`;
/// `runfeed config-reference` prints it, `scripts/config-reference.sh` rewrites the copy).
pub fn reference_markdown() -> String {
    let mut out = String::new();
    for section in reference() {
        out.push_str(&format!("#### `[{}]`\n\n", section.name));
        if !section.description.is_empty() {
            out.push_str(&format!("{}\n\n", md_cell(&section.description)));
        }
        out.push_str("| key | environment / flag | type | default | description |\n");
        out.push_str("|---|---|---|---|---|\n");
        for e in &section.entries {
            let env = e
                .env
                .iter()
                .map(|v| format!("`{v}`"))
                .collect::<Vec<_>>()
                .join(", ");
            out.push_str(&format!(
                "| `{}.{}` | {} | {} | {} | {} |\n",
                e.section,
                e.key,
                env,
                e.ty,
                e.default,
                md_cell(&e.description)
            ));
        }
        out.push('\n');
    }
    out.truncate(out.trim_end().len());
    out.push('\n');
    out
}

/// `(section.key, [--flag, ENV])` for every `serve` flag in [`SERVE_FLAG_KEYS`].
fn serve_flags() -> Vec<(&'static str, Vec<String>)> {
    use clap::CommandFactory;
    let cli = super::Cli::command();
    let serve = cli
        .find_subcommand("serve")
        .expect("the CLI has a serve command");
    SERVE_FLAG_KEYS
        .iter()
        .map(|(id, key)| {
            let arg = serve
                .get_arguments()
                .find(|a| a.get_id().as_str() == *id)
                .unwrap_or_else(|| panic!("serve has no --{id} flag (SERVE_FLAG_KEYS)"));
            let mut names = Vec::new();
            if let Some(env) = arg.get_env() {
                names.push(env.to_string_lossy().into_owned());
            }
            if let Some(long) = arg.get_long() {
                names.push(format!("--{long}"));
            }
            (*key, names)
        })
        .collect()
}

/// A schema object's `properties`, in declaration order.
fn properties(schema: &serde_json::Value) -> impl Iterator<Item = (&str, &serde_json::Value)> {
    schema
        .get("properties")
        .and_then(|p| p.as_object())
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.as_str(), v))
}

/// Follows a local `$ref` (`#/$defs/Name`).
fn resolve<'a>(
    root: &'a serde_json::Value,
    schema: &'a serde_json::Value,
) -> &'a serde_json::Value {
    match schema.get("$ref").and_then(|r| r.as_str()) {
        Some(r) => r
            .strip_prefix('#')
            .and_then(|pointer| root.pointer(pointer))
            .unwrap_or(schema),
        None => schema,
    }
}

/// `integer`, `string, optional`, `map of string → integer`, ….
fn type_name(schema: &serde_json::Value) -> String {
    let types: Vec<&str> = match schema.get("type") {
        Some(serde_json::Value::String(t)) => vec![t.as_str()],
        Some(serde_json::Value::Array(ts)) => ts.iter().filter_map(|t| t.as_str()).collect(),
        _ => Vec::new(),
    };
    let optional = types.contains(&"null");
    let base = match types.iter().find(|t| **t != "null").copied() {
        Some("object") => match schema.get("additionalProperties") {
            Some(values) if values.is_object() => format!("map of string → {}", type_name(values)),
            _ => "table".to_string(),
        },
        Some(t) => t.to_string(),
        None => "any".to_string(),
    };
    if optional {
        format!("{base}, optional")
    } else {
        base
    }
}

/// A default as it would be written in TOML, in backticks; `unset` for `None`.
fn render_default(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::Null => "unset".to_string(),
        serde_json::Value::Object(map) if map.is_empty() => "`{}`".to_string(),
        other => format!("`{other}`"),
    }
}

/// The first paragraph of a doc comment on one line, intra-doc links reduced to their code.
fn first_paragraph(doc: &str) -> String {
    let para = doc.trim().split("\n\n").next().unwrap_or("");
    para.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace("[`", "`")
        .replace("`]", "`")
}

/// Text safe inside a Markdown table cell.
/// The metric reference as Markdown: one row per Prometheus metric family, with its type, unit,
/// labels and meaning, from `telemetry::metrics::exported` (docs/observability.md holds a copy
/// between `<!-- metrics-reference:start -->` and `<!-- metrics-reference:end -->`).
pub fn metrics_reference_markdown() -> String {
    let mut out = String::from(
        "| metric (Prometheus) | type | unit | labels | meaning |\n|---|---|---|---|---|\n",
    );
    for e in crate::telemetry::metrics::exported() {
        let unit = match e.unit {
            "ms" => "milliseconds".to_string(),
            "By" => "bytes".to_string(),
            u => u.trim_start_matches('{').trim_end_matches('}').to_string(),
        };
        let labels = if e.labels.is_empty() {
            "–".to_string()
        } else {
            e.labels
                .iter()
                .map(|l| format!("`{l}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        out.push_str(&format!(
            "| `{}` | {} | {} | {} | {} |\n",
            e.prometheus,
            e.kind,
            unit,
            labels,
            md_cell(e.description)
        ));
    }
    out
}

fn md_cell(text: &str) -> String {
    text.replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_covers_every_key_with_a_description_and_units() {
        let sections = reference();
        let defaults = serde_json::to_value(Config::default()).unwrap();
        let names: Vec<&str> = sections.iter().map(|s| s.name.as_str()).collect();
        let expected: Vec<&str> = defaults
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        assert_eq!(names, expected, "one reference section per config section");
        for section in &sections {
            let keys: Vec<&str> = section.entries.iter().map(|e| e.key.as_str()).collect();
            let expected: Vec<&str> = defaults[&section.name]
                .as_object()
                .unwrap()
                .keys()
                .map(|k| k.as_str())
                .collect();
            assert_eq!(keys, expected, "[{}]: one row per key", section.name);
            for e in &section.entries {
                let path = format!("{}.{}", e.section, e.key);
                assert!(!e.description.is_empty(), "{path} has no doc comment");
                if e.key.ends_with("_ms") {
                    assert!(
                        e.description.contains("ms"),
                        "{path}: doc names no unit (ms)"
                    );
                }
                if e.key.ends_with("_bytes") {
                    assert!(
                        e.description.contains("bytes"),
                        "{path}: doc names no unit (bytes)"
                    );
                }
                assert!(
                    e.env[0] == format!("RUNFEED_{}__{}", e.section, e.key).to_uppercase(),
                    "{path}: first name is the RUNFEED_ variable"
                );
                assert!(e.ty != "any", "{path}: unknown type");
            }
        }
    }

    #[test]
    fn reference_names_the_serve_flags_and_the_docs_agree() {
        let sections = reference();
        let entry = |path: &str| {
            sections
                .iter()
                .flat_map(|s| &s.entries)
                .find(|e| format!("{}.{}", e.section, e.key) == path)
                .unwrap_or_else(|| panic!("{path} is not in the reference"))
                .clone()
        };
        let listen = entry("server.listen");
        assert_eq!(
            listen.env,
            ["RUNFEED_SERVER__LISTEN", "RUNFEED_LISTEN", "--listen"]
        );
        assert_eq!(listen.default, "`\"127.0.0.1:3030\"`");
        assert_eq!(listen.ty, "string");
        let replica = entry("database.replica_url");
        assert!(replica
            .env
            .contains(&"DATABASE_READ_REPLICA_URL".to_string()));
        assert_eq!(replica.ty, "string, optional");
        assert_eq!(replica.default, "unset");
        assert_eq!(
            entry("feeds.concurrency_limit_overrides").ty,
            "map of string → integer"
        );
        assert_eq!(entry("feeds.live_poll_jitter_ratio").default, "`0.15`");
        // Every flag and dedicated variable is also named by the key's doc comment.
        for (_, path) in SERVE_FLAG_KEYS {
            let e = entry(path);
            for name in &e.env[1..] {
                assert!(
                    e.description.contains(&format!("`{name}`")),
                    "{path}: the doc comment does not name {name}"
                );
            }
        }
        // Every serve flag that sets a key is in SERVE_FLAG_KEYS (only --config is not a key).
        use clap::CommandFactory;
        let cli = crate::cli::Cli::command();
        let serve = cli.find_subcommand("serve").unwrap();
        for arg in serve.get_arguments() {
            let id = arg.get_id().as_str();
            if matches!(id, "config" | "help") {
                continue;
            }
            assert!(
                SERVE_FLAG_KEYS.iter().any(|(flag, _)| *flag == id),
                "serve flag {id} is missing from SERVE_FLAG_KEYS"
            );
        }
        let md = reference_markdown();
        assert!(md.starts_with("#### `[server]`\n"));
        assert!(md.contains("| `feeds.live_poll_timeout_ms` | `RUNFEED_FEEDS__LIVE_POLL_TIMEOUT_MS` | integer | `20000` | "));
    }
}
