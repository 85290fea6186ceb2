//! Checks that keep the documentation honest. No network and nothing outside the repository:
//!
//! - every relative Markdown link (and its `#anchor`) resolves;
//! - every repository path, `bash scripts/…` command, `cargo test --test …` target and `runfeed …`
//!   subcommand the operator and contributor docs name exists;
//! - every `RUNFEED_*` variable is a configuration key's (from the generated reference) or is read by
//!   a script, a test or the code; every `section.key` is a configuration key; every `runfeed_…` metric
//!   is one the code declares (`telemetry::metrics::exported`);
//! - the two generated references (docs/configuration.md, docs/observability.md) are current;
//! - README.md stays an entrance (≤ 150 lines, no line over 200 characters), BENCHMARKS.md and
//!   CORRECTNESS.md hold no history (dates, commit ids), and BENCHMARKS.md keeps its two cost sections;
//! - no doc or comment cites a ticket number, a work session or a path outside the repository, and a
//!   comment that cites a section of README.md, BENCHMARKS.md or CORRECTNESS.md names one that exists.
//!
//! Every checker returns the problems it found; each has a test on a small broken input too.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// The docs written for operators and contributors, whose every path, command, variable, key and
/// metric is checked. (docs/protocol.md, docs/trigger-dev.md and docs/behaviours.md describe other
/// projects' code and name their paths; their links and citations are still checked.)
const OWNED_DOCS: &[&str] = &[
    "README.md",
    "CONTRIBUTING.md",
    "BENCHMARKS.md",
    "CORRECTNESS.md",
    "docs/architecture.md",
    "docs/configuration.md",
    "docs/http-api.md",
    "docs/install-compose.md",
    "docs/install-helm.md",
    "docs/observability.md",
    "docs/operations.md",
    "docs/proxies.md",
    "docs/self-host.md",
    "docs/troubleshooting.md",
    "deploy/trigger.dev/compose/README.md",
    "grafana/README.md",
];

/// Every file of the repository (relative paths), without build output and dependencies.
fn repo_files() -> Vec<String> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if ["target", "node_modules", ".git", "dist"].contains(&name.as_str()) {
                continue;
            }
            if path.is_dir() {
                walk(&path, root, out);
            } else if let Ok(rel) = path.strip_prefix(root) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo(), &repo(), &mut out);
    out.sort();
    out
}

fn markdown_files() -> Vec<String> {
    repo_files()
        .into_iter()
        .filter(|f| f.ends_with(".md"))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Markdown: prose, code, headings, links

/// A Markdown file split into prose lines (fenced code removed) and code (fenced blocks and inline
/// code spans).
struct Md {
    prose: Vec<(usize, String)>,
    code: Vec<(usize, String)>,
    /// Line numbers inside fenced code blocks.
    fenced: BTreeSet<usize>,
}

fn parse_md(text: &str) -> Md {
    let mut md = Md {
        prose: Vec::new(),
        code: Vec::new(),
        fenced: BTreeSet::new(),
    };
    let mut fenced = false;
    // An inline code span still open at the end of a line: where it started and its text so far.
    // CommonMark lets a span run across line breaks (not across a blank line); it is read as one
    // span, its line breaks as spaces.
    let mut open: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            open = None;
            continue;
        }
        if fenced {
            md.code.push((n, line.to_string()));
            md.fenced.insert(n);
            continue;
        }
        if line.trim().is_empty() {
            open = None;
        }
        let mut prose = String::new();
        let mut rest = line;
        if let Some((start_line, mut span)) = open.take() {
            match rest.find('`') {
                Some(end) => {
                    span.push(' ');
                    span.push_str(rest[..end].trim_start());
                    md.code.push((start_line, span));
                    prose.push_str(" CODE ");
                    rest = &rest[end + 1..];
                }
                None => {
                    span.push(' ');
                    span.push_str(rest.trim());
                    open = Some((start_line, span));
                    md.prose.push((n, " CODE ".to_string()));
                    continue;
                }
            }
        }
        // Inline code spans.
        while let Some(start) = rest.find('`') {
            prose.push_str(&rest[..start]);
            let after = &rest[start + 1..];
            match after.find('`') {
                Some(end) => {
                    md.code.push((n, after[..end].to_string()));
                    prose.push_str(" CODE ");
                    rest = &after[end + 1..];
                }
                None => {
                    open = Some((n, after.trim_end().to_string()));
                    prose.push_str(" CODE ");
                    rest = "";
                }
            }
        }
        prose.push_str(rest);
        md.prose.push((n, prose));
    }
    md
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The headings of a Markdown text (outside fenced code), without the `#`s.
fn headings(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(line.trim_start_matches('#').trim().to_string());
        }
    }
    out
}

/// The anchors of a Markdown text, with GitHub's `-1`, `-2` suffixes for repeated headings.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for h in headings(text) {
        let s = slug(&h);
        let n = seen.entry(s.clone()).or_insert(0);
        out.insert(if *n == 0 {
            s.clone()
        } else {
            format!("{s}-{n}")
        });
        *n += 1;
    }
    out
}

/// `(line, target)` of every inline link and image in prose.
fn links(md: &Md) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in &md.prose {
        let mut rest = line.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push((*n, target.to_string()));
            rest = &after[end..];
        }
    }
    out
}

/// Problems with the relative links of `file` (`text` is its content); `exists` answers for paths
/// relative to the repository, `text_of` gives a linked Markdown file's text.
fn check_links(
    file: &str,
    text: &str,
    exists: &dyn Fn(&str) -> bool,
    text_of: &dyn Fn(&str) -> Option<String>,
) -> Vec<String> {
    let md = parse_md(text);
    let dir = Path::new(file).parent().unwrap_or(Path::new(""));
    let mut p = Vec::new();
    for (n, target) in links(&md) {
        if target.is_empty()
            || target.contains("://")
            || target.starts_with("mailto:")
            || target.contains(' ')
        {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((path, anchor)) => (path, Some(anchor)),
            None => (target.as_str(), None),
        };
        let resolved = if path.is_empty() {
            file.to_string()
        } else {
            normalize(&dir.join(path))
        };
        if !exists(&resolved) {
            p.push(format!(
                "{file}:{n}: link to {target}: {resolved} does not exist"
            ));
            continue;
        }
        if let (Some(anchor), true) = (anchor, resolved.ends_with(".md")) {
            let linked = text_of(&resolved).unwrap_or_default();
            if !anchors(&linked).contains(anchor) {
                p.push(format!(
                    "{file}:{n}: link to {target}: no heading #{anchor} in {resolved}"
                ));
            }
        }
    }
    p
}

/// `a/b/../c/` → `a/c` (no file system access).
fn normalize(path: &Path) -> String {
    let mut parts: Vec<String> = Vec::new();
    for c in path.components() {
        match c {
            std::path::Component::ParentDir => {
                parts.pop();
            }
            std::path::Component::Normal(s) => parts.push(s.to_string_lossy().into_owned()),
            _ => {}
        }
    }
    parts.join("/")
}

fn exists_in_repo(rel: &str) -> bool {
    repo().join(rel).exists()
}

// ---------------------------------------------------------------------------------------------
// Names a doc uses: paths, commands, variables, keys, metrics

const PATH_PREFIXES: &[&str] = &[
    "src/",
    "docs/",
    "deploy/",
    "scripts/",
    "tests/",
    "crates/",
    "grafana/",
    "config/",
    "migrations/",
    ".ci/",
];

/// Words of code spans and code lines, trimmed of quotes and punctuation around them.
fn code_words(md: &Md) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, code) in &md.code {
        for w in code.split(|c: char| c.is_whitespace() || c == '=' || c == '(' || c == ')') {
            let w = w.trim_matches(|c: char| "\"'`,;:.)([]{}".contains(c));
            if !w.is_empty() {
                out.push((*n, w.to_string()));
            }
        }
    }
    out
}

/// Repository paths named in code that do not exist.
fn check_paths(file: &str, md: &Md, exists: &dyn Fn(&str) -> bool) -> Vec<String> {
    let mut p = Vec::new();
    for (n, w) in code_words(md) {
        let w = w.trim_start_matches("$RUNFEED/");
        // kubectl names resources `deploy/<name>`, `svc/<name>`: not paths.
        let kubectl = md
            .code
            .iter()
            .any(|(m, c)| *m == n && c.trim_start().starts_with("kubectl"));
        if kubectl {
            continue;
        }
        if !PATH_PREFIXES.iter().any(|pre| w.starts_with(pre))
            || w.contains(['*', '<', '>', '…', '{', '}', '$', '|'])
        {
            continue;
        }
        let path = w.split(':').next().unwrap_or(w).trim_end_matches('/');
        if !exists(path) {
            p.push(format!("{file}:{n}: {path} does not exist"));
        }
    }
    p
}

/// The `runfeed` subcommands (from the real CLI definition).
fn subcommands() -> BTreeSet<String> {
    use clap::CommandFactory;
    runfeed::cli::Cli::command()
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .chain(["help".to_string()])
        .collect()
}

/// Commands named in code that do not exist: `bash scripts/X`, `cargo test --test X`, `runfeed X`.
fn check_commands(
    file: &str,
    md: &Md,
    exists: &dyn Fn(&str) -> bool,
    subcommands: &BTreeSet<String>,
) -> Vec<String> {
    let mut p = Vec::new();
    for (n, code) in &md.code {
        let words: Vec<&str> = code.split_whitespace().collect();
        // A span that quotes output (`runfeed listening on http://…`) is not a command: commands
        // are fenced lines, and inline spans of two words or with flags.
        let fenced = md.fenced.contains(n);
        if !fenced && words.len() > 2 && !words.iter().any(|w| w.starts_with("--")) {
            continue;
        }
        for (i, w) in words.windows(2).enumerate() {
            let next = w[1].trim_matches(|c: char| "\"'`,;".contains(c));
            // `runfeed` in the command position: first word, or after a shell separator.
            let command_position =
                i == 0 || ["&&", "||", ";", "|", "$", "exec", "#"].contains(&words[i - 1]);
            match w[0] {
                "bash" if next.starts_with("scripts/") && !exists(next) => {
                    p.push(format!("{file}:{n}: bash {next}: no such script"))
                }
                "--test" if i > 0 && words[..i].contains(&"cargo") => {
                    let t = next;
                    let found = exists(&format!("tests/{t}.rs"))
                        || exists(&format!("tests/{t}/main.rs"))
                        || exists(&format!("crates/runfeed-dev/tests/{t}.rs"));
                    if !found && !t.is_empty() && !t.starts_with('-') {
                        p.push(format!(
                            "{file}:{n}: cargo test --test {t}: no such test target"
                        ));
                    }
                }
                "runfeed"
                    if command_position
                        && next.chars().all(|c| c.is_ascii_lowercase() || c == '-')
                        && !next.starts_with('-')
                        && !next.is_empty()
                        && !subcommands.contains(next) =>
                {
                    p.push(format!("{file}:{n}: runfeed {next}: no such subcommand"))
                }
                _ => {}
            }
        }
    }
    p
}

/// `RUNFEED_*`, `SKIP_*`, `E2E_*`, `CHECK_*`, `FUZZ_*` names anywhere in a doc.
fn env_names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let start_ok = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == '_');
        if start_ok && bytes[i].is_ascii_uppercase() {
            let mut j = i;
            while j < bytes.len()
                && (bytes[j].is_ascii_uppercase() || bytes[j].is_ascii_digit() || bytes[j] == '_')
            {
                j += 1;
            }
            let word: String = bytes[i..j].iter().collect();
            let word = word.trim_end_matches('_').to_string();
            if ["RUNFEED_", "SKIP_", "E2E_", "CHECK_", "FUZZ_"]
                .iter()
                .any(|p| word.starts_with(p) && word.len() > p.len())
            {
                out.push(word);
            }
            i = j.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// Every configuration key's environment variable and `section.key`, from the generated reference.
fn config_names() -> (BTreeSet<String>, BTreeSet<String>) {
    let mut envs = BTreeSet::new();
    let mut keys = BTreeSet::new();
    for section in runfeed::cli::reference::reference() {
        for e in section.entries {
            keys.insert(format!("{}.{}", e.section, e.key));
            envs.extend(e.env);
        }
    }
    (envs, keys)
}

/// The text of every file that may read a variable: code, scripts, tests, deploy files.
fn code_corpus() -> String {
    let mut out = String::new();
    for f in repo_files() {
        let code = [
            ".rs", ".sh", ".mjs", ".js", ".yml", ".yaml", ".toml", ".tpl", ".cfg", ".conf",
        ]
        .iter()
        .any(|e| f.ends_with(e))
            || f.ends_with("Dockerfile")
            || f.ends_with("Caddyfile")
            || f.starts_with(".ci/");
        if code && f != "tests/it/docs.rs" {
            out.push_str(&std::fs::read_to_string(repo().join(&f)).unwrap_or_default());
            out.push('\n');
        }
    }
    out
}

fn check_env(file: &str, text: &str, config_envs: &BTreeSet<String>, corpus: &str) -> Vec<String> {
    let mut p = Vec::new();
    for name in env_names(text).into_iter().collect::<BTreeSet<_>>() {
        let known = if name.starts_with("RUNFEED_") && name.contains("__") {
            config_envs.contains(&name)
        } else {
            config_envs.contains(&name) || corpus.contains(&name)
        };
        if !known {
            p.push(format!(
                "{file}: {name} is neither a configuration key's variable nor read anywhere"
            ));
        }
    }
    p
}

/// Configuration keys named in code spans that are a key alone (`feeds.max_tags`,
/// `[feeds.concurrency_limit_overrides]`, `redis.cluster = true`), not part of an expression.
fn check_config_keys(file: &str, md: &Md, keys: &BTreeSet<String>) -> Vec<String> {
    let sections: BTreeSet<&str> = keys.iter().filter_map(|k| k.split('.').next()).collect();
    let mut p = Vec::new();
    for (n, code) in &md.code {
        let mut words = code.split_whitespace();
        let Some(w) = words.next() else { continue };
        if !matches!(words.next(), None | Some("=")) {
            continue;
        }
        let w = w.trim_matches(|c| c == '[' || c == ']');
        let Some((section, key)) = w.split_once('.') else {
            continue;
        };
        if sections.contains(section)
            && !key.is_empty()
            && key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            && !keys.contains(w)
        {
            p.push(format!("{file}:{n}: {w} is not a configuration key"));
        }
    }
    p
}

const METRIC_AREAS: &[&str] = &[
    "feeds", "runset", "router", "notifier", "replica", "http", "pg", "redis", "process",
];

/// `runfeed_<area>_…` metric names anywhere in a text.
fn metric_names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("runfeed_") {
        let before_ok =
            i == 0 || !rest[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        if before_ok
            && METRIC_AREAS
                .iter()
                .any(|a| name.starts_with(&format!("runfeed_{a}_")))
        {
            out.push(name.to_string());
        }
        rest = &tail[end.max(1)..];
    }
    out
}

fn check_metrics(file: &str, text: &str, families: &BTreeSet<String>) -> Vec<String> {
    let mut p = Vec::new();
    for name in metric_names(text).into_iter().collect::<BTreeSet<_>>() {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| families.contains(*f)))
            .unwrap_or(&name);
        if !families.contains(family) {
            p.push(format!(
                "{file}: metric {name} is not declared in src/telemetry/metrics.rs"
            ));
        }
    }
    p
}

fn families() -> BTreeSet<String> {
    runfeed::telemetry::metrics::exported()
        .into_iter()
        .map(|e| e.prometheus)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Citations

/// Citations a reader of the repository cannot follow: ticket numbers, work sessions, paths
/// outside the repository.
fn check_citations(file: &str, text: &str) -> Vec<String> {
    let mut p = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let lower = line.to_lowercase();
        let n = i + 1;
        for word in ["issue ", "issue #", "issues ", "finding ", "findings "] {
            let mut rest = lower.as_str();
            while let Some(at) = rest.find(word) {
                let before = &rest[..at];
                let after = &rest[at + word.len()..];
                if !before.ends_with(|c: char| c.is_ascii_alphanumeric())
                    && after.starts_with(|c: char| c.is_ascii_digit())
                {
                    p.push(format!(
                        "{file}:{n}: cites \"{}\": {}",
                        word.trim(),
                        line.trim()
                    ));
                }
                rest = after;
            }
        }
        for qualifier in [
            "first", "second", "third", "this", "that", "earlier", "previous", "last", "next",
            "helper", "other", "lead's",
        ] {
            if lower.contains(&format!("{qualifier} session")) {
                p.push(format!("{file}:{n}: cites a work session: {}", line.trim()));
            }
        }
        if lower.contains("../shared") {
            p.push(format!(
                "{file}:{n}: names a path outside the repository: {}",
                line.trim()
            ));
        }
    }
    p
}

/// Files whose comments the citation checks cover.
fn commented_files() -> Vec<String> {
    repo_files()
        .into_iter()
        .filter(|f| f != "tests/it/docs.rs")
        .filter(|f| {
            let code_dir = [
                "src/", "crates/", "tests/", "scripts/", "deploy/", "grafana/", ".ci/", "config/",
            ]
            .iter()
            .any(|d| f.starts_with(d));
            let root = ["Dockerfile", "docker-compose.yml", "Cargo.toml"].contains(&f.as_str());
            (code_dir || root)
                && !f.ends_with(".png")
                && !f.ends_with(".lock")
                && !f.ends_with(".json")
        })
        .collect()
}

/// Comments that cite a section of README.md, BENCHMARKS.md or CORRECTNESS.md: `README "X"`,
/// `BENCHMARKS.md "X"`, `BENCHMARKS.md §N`. The quoted name must be a heading of that file; these
/// files have no numbered sections.
fn check_section_citations(
    file: &str,
    text: &str,
    headings_of: &dyn Fn(&str) -> Vec<String>,
) -> Vec<String> {
    let mut p = Vec::new();
    for (doc, names) in [
        ("README.md", ["README.md", "README"]),
        ("BENCHMARKS.md", ["BENCHMARKS.md", "BENCHMARKS"]),
        ("CORRECTNESS.md", ["CORRECTNESS.md", "CORRECTNESS"]),
    ] {
        let heads: Vec<String> = headings_of(doc).iter().map(|h| h.to_lowercase()).collect();
        for (i, line) in text.lines().enumerate() {
            for name in names {
                let mut rest = line;
                while let Some(at) = rest.find(name) {
                    let after = &rest[at + name.len()..];
                    rest = after;
                    if name == names[1] && after.starts_with(".md") {
                        continue; // counted under the longer name
                    }
                    let cited = after.trim_start_matches([',', ' ']);
                    if let Some(q) = cited.strip_prefix('"') {
                        let section = q.split('"').next().unwrap_or("").to_lowercase();
                        let section = section.trim_end_matches([',', '.']);
                        if !heads.iter().any(|h| h.contains(section)) {
                            p.push(format!(
                                "{file}:{}: cites {doc} \"{section}\", which has no such section",
                                i + 1
                            ));
                        }
                    } else if cited.starts_with('§') {
                        p.push(format!(
                            "{file}:{}: cites {doc} by section number; it has none (cite a heading)",
                            i + 1
                        ));
                    }
                }
            }
        }
    }
    p
}

// ---------------------------------------------------------------------------------------------
// Generated blocks

fn block<'a>(text: &'a str, marker: &str) -> Result<&'a str, String> {
    let (start, end) = (
        format!("<!-- {marker}:start -->"),
        format!("<!-- {marker}:end -->"),
    );
    let (Some(s), Some(e)) = (text.find(&start), text.find(&end)) else {
        return Err(format!("no {start} … {end} block"));
    };
    if e < s {
        return Err(format!("{end} comes before {start}"));
    }
    Ok(text[s + start.len()..e].trim())
}

fn check_generated(file: &str, text: &str, marker: &str, generated: &str) -> Result<(), String> {
    let how = "regenerate it with `bash scripts/config-reference.sh`";
    let found =
        block(text, marker).map_err(|e| format!("{file}: {e}; add the markers and {how}"))?;
    if found == generated.trim() {
        return Ok(());
    }
    let first = found
        .lines()
        .zip(generated.trim().lines())
        .enumerate()
        .find(|(_, (a, b))| a != b)
        .map(|(i, (a, b))| {
            format!(
                "first difference at block line {}:\n  doc:       {a}\n  generated: {b}",
                i + 1
            )
        })
        .unwrap_or_else(|| "the generated block has more or fewer lines".into());
    Err(format!(
        "{file}: the {marker} block is stale; {how}.\n{first}"
    ))
}

// =============================================================================================
// Tests on the repository

fn assert_none(problems: Vec<String>) {
    assert!(
        problems.is_empty(),
        "{} problem(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let text_of = |rel: &str| std::fs::read_to_string(repo().join(rel)).ok();
    let mut p = Vec::new();
    for f in markdown_files() {
        p.extend(check_links(&f, &read(&f), &exists_in_repo, &text_of));
    }
    assert_none(p);
}

#[test]
fn every_path_command_variable_key_and_metric_a_doc_names_exists() {
    let subs = subcommands();
    let (envs, keys) = config_names();
    let corpus = code_corpus();
    let fams = families();
    let mut p = Vec::new();
    for f in OWNED_DOCS {
        let text = read(f);
        let md = parse_md(&text);
        p.extend(check_paths(f, &md, &exists_in_repo));
        p.extend(check_commands(f, &md, &exists_in_repo, &subs));
        p.extend(check_env(f, &text, &envs, &corpus));
        p.extend(check_config_keys(f, &md, &keys));
        p.extend(check_metrics(f, &text, &fams));
    }
    assert_none(p);
}

#[test]
fn dashboards_alerts_and_chart_name_only_declared_metrics() {
    let fams = families();
    let mut p = Vec::new();
    for f in repo_files() {
        if f.starts_with("grafana/")
            || f.starts_with("deploy/helm/")
            || f.starts_with("deploy/proxies/")
        {
            p.extend(check_metrics(&f, &read(&f), &fams));
        }
    }
    assert_none(p);
}

#[test]
fn the_generated_references_are_current() {
    let mut p = Vec::new();
    if let Err(e) = check_generated(
        "docs/configuration.md",
        &read("docs/configuration.md"),
        "config-reference",
        &runfeed::cli::reference::reference_markdown(),
    ) {
        p.push(e);
    }
    if let Err(e) = check_generated(
        "docs/observability.md",
        &read("docs/observability.md"),
        "metrics-reference",
        &runfeed::cli::reference::metrics_reference_markdown(),
    ) {
        p.push(e);
    }
    assert_none(p);
}

#[test]
fn the_readme_is_an_entrance() {
    let readme = read("README.md");
    let lines: Vec<&str> = readme.lines().collect();
    assert!(
        lines.len() <= 150,
        "README.md has {} lines (at most 150)",
        lines.len()
    );
    let long: Vec<String> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.chars().count() > 200)
        .map(|(i, l)| format!("README.md:{}: {} characters", i + 1, l.chars().count()))
        .collect();
    assert_none(long);
    // The two set-up commands come first, and the docs index links every operator page.
    let first_block = readme.split("```").nth(1).unwrap_or("");
    assert!(first_block.contains("scripts/dev.sh") && first_block.contains("bash scripts/test.sh"));
    for page in [
        "docs/install-compose.md",
        "docs/install-helm.md",
        "docs/proxies.md",
        "docs/operations.md",
        "docs/configuration.md",
        "docs/observability.md",
        "docs/troubleshooting.md",
        "docs/http-api.md",
        "CONTRIBUTING.md",
    ] {
        assert!(
            readme.contains(&format!("]({page})")),
            "the README's index lacks {page}"
        );
    }
}

/// The figures a line quotes: runs of digits (with `.` decimals and thin or plain spaces between
/// digit groups, as in `10 000`) that stand alone, not glued to a letter (`p99`) and not a lone
/// digit below 10.
fn figures(line: &str) -> Vec<String> {
    let chars: Vec<char> = line.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let glued = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '.');
        if !chars[i].is_ascii_digit() || glued {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < chars.len() {
            let c = chars[j];
            let digit_at = |k: usize| chars.get(k).is_some_and(|d| d.is_ascii_digit());
            // `.` before a digit is a decimal point; a space before exactly three digits
            // separates thousands (`10 000`).
            let joins = match c {
                '.' => digit_at(j + 1),
                ' ' | '\u{202f}' => (1..=3).all(|k| digit_at(j + k)) && !digit_at(j + 4),
                _ => false,
            };
            if c.is_ascii_digit() || joins {
                j += 1;
            } else {
                break;
            }
        }
        let figure: String = chars[i..j].iter().collect();
        let glued_after = chars
            .get(j)
            .is_some_and(|c| c.is_alphabetic() && !c.is_uppercase());
        if (figure.len() > 1 || figure.parse::<u32>().is_ok_and(|v| v >= 10)) && !glued_after {
            out.push(figure);
        }
        i = j.max(i + 1);
    }
    out
}

/// Whether `figure` stands in `text` as a figure of its own (not inside a longer number).
fn quotes(text: &str, figure: &str) -> bool {
    text.match_indices(figure).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + figure.len()..].chars().next();
        let digitish = |c: Option<char>| c.is_some_and(|c| c.is_ascii_digit());
        let decimal_after = text[at + figure.len()..].starts_with('.')
            && digitish(text[at + figure.len() + 1..].chars().next());
        !digitish(before) && !digitish(after) && !decimal_after
    })
}

/// README's table of measured figures quotes only what BENCHMARKS.md or CORRECTNESS.md state: a
/// figure changed there and not here (or the reverse) fails.
#[test]
fn every_figure_the_readme_quotes_is_on_a_figures_page() {
    let readme = read("README.md");
    let pages = format!("{}\n{}", read("BENCHMARKS.md"), read("CORRECTNESS.md"));
    let mut problems = Vec::new();
    let mut in_table = false;
    let mut rows = 0;
    for (i, line) in readme.lines().enumerate() {
        if line.starts_with("| | runfeed (measured)") {
            in_table = true;
            continue;
        }
        if !in_table || line.starts_with("|---") {
            continue;
        }
        if !line.starts_with('|') {
            break;
        }
        rows += 1;
        // The measured column: the row's second cell.
        let cell = line.split('|').nth(2).unwrap_or("").replace("**", "");
        for figure in figures(&cell) {
            if !quotes(&pages, &figure) {
                problems.push(format!(
                    "README.md:{}: {figure} is in neither BENCHMARKS.md nor CORRECTNESS.md",
                    i + 1
                ));
            }
        }
    }
    assert!(
        rows >= 4,
        "README.md's table of measured figures was not found"
    );
    assert_none(problems);
}

#[test]
fn figures_reads_numbers_not_names() {
    assert_eq!(
        figures(
            "p99 7.0 ms, p99.9 28.5 ms, 0 backstops, 10 000 feeds, 0.267 cores, 8.21 KiB, 3 of 4"
        ),
        ["7.0", "28.5", "10 000", "0.267", "8.21"]
    );
    assert!(quotes("a p50 of 84 ms", "84"));
    assert!(!quotes("184 ms", "84"));
    assert!(!quotes("84.5 ms", "84"));
}

#[test]
fn figures_pages_hold_no_history() {
    let mut p = Vec::new();
    for f in ["BENCHMARKS.md", "CORRECTNESS.md"] {
        let text = read(f);
        let md = parse_md(&text);
        for (n, code) in &md.code {
            let c = code.trim();
            if (7..=40).contains(&c.len())
                && c.chars()
                    .all(|ch| ch.is_ascii_hexdigit() && !ch.is_ascii_uppercase())
                && c.chars().any(|ch| ch.is_ascii_alphabetic())
            {
                p.push(format!("{f}:{n}: a commit id `{c}`"));
            }
        }
        for (i, line) in text.lines().enumerate() {
            let chars: Vec<char> = line.chars().collect();
            for w in chars.windows(10) {
                let s: String = w.iter().collect();
                let date = s.len() == 10
                    && s[..4].chars().all(|c| c.is_ascii_digit())
                    && &s[4..5] == "-"
                    && s[5..7].chars().all(|c| c.is_ascii_digit())
                    && &s[7..8] == "-"
                    && s[8..].chars().all(|c| c.is_ascii_digit());
                if date {
                    p.push(format!(
                        "{f}:{}: a date ({s}): figures are current, not dated",
                        i + 1
                    ));
                }
            }
            for word in ["before/after", "this round", "step 1", "step 2", "step 3"] {
                if line.to_lowercase().contains(word) {
                    p.push(format!("{f}:{}: history ({word})", i + 1));
                }
            }
        }
        let mut seen = BTreeSet::new();
        for h in headings(&text) {
            if !seen.insert(h.clone()) {
                p.push(format!("{f}: heading \"{h}\" appears twice"));
            }
        }
    }
    assert_none(p);
}

#[test]
fn benchmarks_keep_one_cost_section_and_one_capacity_model() {
    let text = read("BENCHMARKS.md");
    const MARKER: &str = "<!-- cost section: maintained with runfeed-bench cost scenarios -->";
    for title in ["## Cost per unit of work", "## Capacity model"] {
        let found: Vec<usize> = text
            .lines()
            .enumerate()
            .filter(|(_, l)| *l == title)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(found.len(), 1, "BENCHMARKS.md needs exactly one `{title}`");
        let body: String = text
            .lines()
            .skip(found[0] + 1)
            .take_while(|l| !l.starts_with("## "))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(body.contains(MARKER), "`{title}` lacks the line {MARKER}");
        assert!(body.contains("| "), "`{title}` holds no figures");
    }
}

#[test]
fn no_doc_or_comment_cites_what_a_reader_cannot_open() {
    let mut p = Vec::new();
    for f in markdown_files() {
        p.extend(check_citations(&f, &read(&f)));
    }
    for f in commented_files() {
        if let Ok(text) = std::fs::read_to_string(repo().join(&f)) {
            p.extend(check_citations(&f, &text));
        }
    }
    assert_none(p);
}

#[test]
fn comments_cite_sections_that_exist() {
    let headings_of = |doc: &str| headings(&read(doc));
    let mut p = Vec::new();
    for f in commented_files() {
        if let Ok(text) = std::fs::read_to_string(repo().join(&f)) {
            p.extend(check_section_citations(&f, &text, &headings_of));
        }
    }
    assert_none(p);
}

// =============================================================================================
// The checkers on broken inputs

#[test]
fn slugs_and_anchors_follow_github() {
    assert_eq!(
        slug("What each `/readyz` body means"),
        "what-each-readyz-body-means"
    );
    assert_eq!(
        slug("Many feeds in one browser tab: HTTP/2"),
        "many-feeds-in-one-browser-tab-http2"
    );
    let a = anchors("# A\n## Setup\n```\n# not a heading\n```\n## Setup\n");
    assert!(a.contains("setup") && a.contains("setup-1") && !a.contains("not-a-heading"));
}

#[test]
fn link_check_catches_missing_files_and_anchors() {
    let files: BTreeMap<&str, &str> =
        [("docs/a.md", "# Title\n## Here\n"), ("README.md", "")].into();
    let exists = |p: &str| files.contains_key(p);
    let text_of = |p: &str| files.get(p).map(|t| t.to_string());
    let text =
        "[ok](docs/a.md#here) [gone](docs/b.md) [anchor](docs/a.md#there) [web](https://x.y/z) \
                `[in code](docs/c.md)`";
    let p = check_links("README.md", text, &exists, &text_of);
    assert_eq!(p.len(), 2, "{p:#?}");
    assert!(p[0].contains("docs/b.md does not exist") && p[1].contains("no heading #there"));
    // Relative to the linking file's directory.
    assert!(check_links(
        "docs/x.md",
        "[up](../README.md) [side](a.md#title)",
        &exists,
        &text_of
    )
    .is_empty());
}

#[test]
fn name_checks_catch_what_does_not_exist() {
    let exists = |p: &str| {
        [
            "scripts/dev.sh",
            "tests/it/main.rs",
            "tests/it/docs.rs",
            "src/http",
        ]
        .contains(&p)
    };
    let md = parse_md(
        "Run `bash scripts/dev.sh` and `bash scripts/gone.sh`, `cargo test --test it docs::`, \
         `cargo test --test nope`, `runfeed serve`, `runfeed serv`; see `src/http/` and `src/nope.rs:12`.",
    );
    let subs: BTreeSet<String> = ["serve".to_string()].into();
    let p = check_commands("x.md", &md, &exists, &subs);
    assert_eq!(p.len(), 3, "{p:#?}");
    let p = check_paths("x.md", &md, &exists);
    assert_eq!(
        p,
        [
            "x.md:1: scripts/gone.sh does not exist",
            "x.md:1: src/nope.rs does not exist"
        ]
    );

    let envs: BTreeSet<String> = ["RUNFEED_FEEDS__MAX_TAGS".to_string()].into();
    let text = "RUNFEED_FEEDS__MAX_TAGS, RUNFEED_FEEDS__MAX_TAG, SKIP_FUZZ=1 and SKIP_NOTHING, RUNFEED_DEV_PORT";
    let p = check_env("x.md", text, &envs, "SKIP_FUZZ RUNFEED_DEV_PORT");
    assert_eq!(p.len(), 2, "{p:#?}");

    let keys: BTreeSet<String> = ["feeds.max_tags".to_string()].into();
    let md = parse_md("`feeds.max_tags`, `[feeds.max_tagz]`, `router.x` (unknown section), `a.b`, `feeds.serve(req)`");
    assert_eq!(check_config_keys("x.md", &md, &keys).len(), 1);

    let fams: BTreeSet<String> = ["runfeed_http_duration_milliseconds".to_string()].into();
    let text = "runfeed_http_duration_milliseconds_bucket runfeed_http_gone_total runfeed_demo runfeed_e2e_x";
    assert_eq!(
        check_metrics("x.md", text, &fams),
        ["x.md: metric runfeed_http_gone_total is not declared in src/telemetry/metrics.rs"]
    );
}

#[test]
fn citation_checks_catch_tickets_sessions_and_missing_sections() {
    let text = "see issue 16 and Issue #3, finding 6; the first session; ../shared/notes\n\
                fine: trigger.dev#3018, issues/3018, a session TimeZone, tissue 5";
    let p = check_citations("x.rs", text);
    assert_eq!(p.len(), 5, "{p:#?}");
    let heads = |doc: &str| match doc {
        "BENCHMARKS.md" => vec!["Held feeds".to_string()],
        "README.md" => vec!["Routes".to_string()],
        _ => vec![],
    };
    let text = "// BENCHMARKS.md \"Held feeds\", BENCHMARKS.md, \"Fan-out\", BENCHMARKS.md §0.2, README \"Routes\", README \"Deploy\"";
    let p = check_section_citations("x.rs", text, &heads);
    assert_eq!(p.len(), 3, "{p:#?}");
}

#[test]
fn generated_block_check_catches_a_stale_block() {
    let generated = "| a | b |\n| c | d |\n";
    let ok = format!("# x\n<!-- m:start -->\n{generated}<!-- m:end -->\n");
    assert!(check_generated("x.md", &ok, "m", generated).is_ok());
    let stale = "# x\n<!-- m:start -->\n| a | b |\n| c | old |\n<!-- m:end -->\n";
    let err = check_generated("x.md", stale, "m", generated).unwrap_err();
    assert!(
        err.contains("scripts/config-reference.sh") && err.contains("| c | old |"),
        "{err}"
    );
    assert!(check_generated("x.md", "# no markers", "m", generated).is_err());
}
