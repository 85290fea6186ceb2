//! Helpers of the static deployment checks (tests/deploy/deploy.rs, tests/deploy/deploy_trigger.rs,
//! tests/deploy/helm_chart.rs): every checker returns the problems it found as text.

use serde_yaml::Value;

/// Fails unless `problems` is empty.
pub fn assert_none(what: &str, problems: Vec<String>) {
    assert!(
        problems.is_empty(),
        "{what}:\n  - {}",
        problems.join("\n  - ")
    );
}

/// Fails unless some problem contains `needle`.
pub fn assert_found(problems: &[String], needle: &str) {
    assert!(
        problems.iter().any(|p| p.contains(needle)),
        "expected a problem mentioning {needle:?}, got {problems:#?}"
    );
}

/// Fails unless every one of `needles` is in some problem.
pub fn assert_found_all(problems: &[String], needles: &[&str]) {
    for needle in needles {
        assert_found(problems, needle);
    }
}

/// Fails unless `problems` are exactly as many as `needles`, each needle in some problem.
pub fn assert_exactly(problems: &[String], needles: &[&str]) {
    assert_found_all(problems, needles);
    assert_eq!(problems.len(), needles.len(), "{problems:?}");
}

/// The `services` of a compose document, by name.
pub fn services(doc: &Value) -> Vec<(String, &Value)> {
    doc["services"]
        .as_mapping()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.as_str().unwrap_or("?").to_string(), v))
        .collect()
}
