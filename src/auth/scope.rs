//! Public-token scopes: the `action:type[:id]` grammar and the ability built from it
//! (`packages/plugins/src/rbac.ts`: `parseScope`, `buildJwtAbility`; docs/trigger-dev.md §2.4), and the
//! resources each realtime route asks for (`anyResource`, docs/trigger-dev.md §2.5).

use super::{Ability, Resource, Scope};
use crate::store::RunResource;

/// Parses one scope string as trigger.dev's `parseScope` does.
///
/// - `action` is everything before the first `:`; an empty action → `None` (scope ignored).
/// - No `:` → `{action}` (e.g. bare `read`, `admin`).
/// - `type` is between the first and second `:`; an empty type is absent (`read:` → `{read}`).
/// - `id` is everything after the second `:` (it may contain colons: `read:tags:env:prod` has id
///   `env:prod`); an id that is empty or only whitespace makes the WHOLE scope invalid → `None`
///   (so `read:runs:` grants nothing, not `read:runs`). The id is kept verbatim (not trimmed).
pub fn parse_scope(scope: &str) -> Option<Scope> {
    let (action, rest) = match scope.split_once(':') {
        None => (scope, None),
        Some((action, rest)) => (action, Some(rest)),
    };
    if action.is_empty() {
        return None;
    }
    let Some(rest) = rest else {
        return Some(Scope {
            action: action.to_string(),
            kind: None,
            id: None,
        });
    };
    let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_string());
    match rest.split_once(':') {
        None => Some(Scope {
            action: action.to_string(),
            kind: non_empty(rest),
            id: None,
        }),
        Some((kind, id)) => {
            if id.trim().is_empty() {
                return None;
            }
            Some(Scope {
                action: action.to_string(),
                kind: non_empty(kind),
                id: Some(id.to_string()),
            })
        }
    }
}

impl Scope {
    /// Whether this scope alone grants `action` on `resource` (`buildJwtAbility` semantics):
    /// - bare `admin` (action `admin`, no type; any id is ignored) grants everything;
    /// - a scope without a type grants nothing (`read`, the SDK's `{read: true}`);
    /// - otherwise the scope's action must be `action` or `*`, and then type `all` grants any
    ///   resource, a matching type without id grants every id of that type (and the type itself),
    ///   and a matching type with id grants exactly that id.
    ///
    /// `admin:runs` is therefore NOT a wildcard (it only grants the action `admin` on runs), and
    /// `write:*`/`write:all` never grant `read`.
    pub fn grants(&self, action: &str, resource: &Resource<'_>) -> bool {
        let Some(kind) = self.kind.as_deref() else {
            return self.action == "admin";
        };
        if self.action != action && self.action != "*" {
            return false;
        }
        if kind == "all" {
            return true;
        }
        if kind != resource.kind {
            return false;
        }
        match self.id.as_deref() {
            None => true,
            Some(id) => resource.id == Some(id),
        }
    }
}

impl Ability {
    /// The ability of a public token's `scopes` claim: each entry parsed with [`parse_scope`];
    /// unparsable entries are dropped (they grant nothing).
    pub fn from_scopes<S: AsRef<str>>(scopes: &[S]) -> Ability {
        Ability::Scopes(
            scopes
                .iter()
                .filter_map(|s| parse_scope(s.as_ref()))
                .collect(),
        )
    }

    /// Whether `action` is granted on ANY of `resources` (`anyResource` semantics: for scopes an
    /// empty list is denied). [`Ability::All`] (secret keys, `permissiveAbility` whose `can` is
    /// `() => true`) grants everything, whatever the list.
    pub fn can_any(&self, action: &str, resources: &[Resource<'_>]) -> bool {
        match self {
            Ability::All => true,
            Ability::Scopes(scopes) => resources
                .iter()
                .any(|r| scopes.iter().any(|s| s.grants(action, r))),
        }
    }
}

/// Resources of `GET /realtime/v1/runs/:runId` (`realtime.v1.runs.$runId.ts`): `{runs, friendlyId}`,
/// `{tasks, taskIdentifier}`, one `{tags, tag}` per run tag, and `{batch, batchFriendlyId}` when
/// the run belongs to a batch.
pub fn run_route_resources(run: &RunResource) -> Vec<Resource<'_>> {
    let mut out = Vec::with_capacity(3 + run.tags.len());
    out.push(Resource {
        kind: "runs",
        id: Some(&run.friendly_id),
    });
    out.push(Resource {
        kind: "tasks",
        id: Some(&run.task_identifier),
    });
    out.extend(run.tags.iter().map(|t| Resource {
        kind: "tags",
        id: Some(t.as_str()),
    }));
    if let Some(batch) = run.batch_friendly_id.as_deref() {
        out.push(Resource {
            kind: "batch",
            id: Some(batch),
        });
    }
    out
}

/// Resources of `GET /realtime/v1/runs?tags=…` (`realtime.v1.runs.ts` L39-45): `{runs}`,
/// `{tags}`, and one `{tags, tag}` per requested tag.
pub fn runs_list_resources<S: AsRef<str>>(tags: &[S]) -> Vec<Resource<'_>> {
    let mut out = Vec::with_capacity(2 + tags.len());
    out.push(Resource {
        kind: "runs",
        id: None,
    });
    out.push(Resource {
        kind: "tags",
        id: None,
    });
    out.extend(tags.iter().map(|t| Resource {
        kind: "tags",
        id: Some(t.as_ref()),
    }));
    out
}

/// Resources of `GET /realtime/v1/batches/:batchId` (`realtime.v1.batches.$batchId.ts`):
/// `{batch, batchFriendlyId}` and `{runs}`.
pub fn batch_route_resources(batch_friendly_id: &str) -> Vec<Resource<'_>> {
    vec![
        Resource {
            kind: "batch",
            id: Some(batch_friendly_id),
        },
        Resource {
            kind: "runs",
            id: None,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(action: &str, kind: Option<&str>, id: Option<&str>) -> Scope {
        Scope {
            action: action.into(),
            kind: kind.map(Into::into),
            id: id.map(Into::into),
        }
    }

    #[test]
    fn parse_scope_only_first_two_colons_separate() {
        assert_eq!(
            parse_scope("read:tags:env:prod"),
            Some(scope("read", Some("tags"), Some("env:prod")))
        );
        assert_eq!(
            parse_scope("read:runs:run_1"),
            Some(scope("read", Some("runs"), Some("run_1")))
        );
        assert_eq!(
            parse_scope("read:runs"),
            Some(scope("read", Some("runs"), None))
        );
    }

    #[test]
    fn parse_scope_empty_segments() {
        assert_eq!(parse_scope("read"), Some(scope("read", None, None)));
        assert_eq!(parse_scope("admin"), Some(scope("admin", None, None)));
        assert_eq!(parse_scope("read:"), Some(scope("read", None, None)));
        assert_eq!(parse_scope("read::x"), Some(scope("read", None, Some("x"))));
        assert_eq!(parse_scope(""), None);
        assert_eq!(parse_scope(":runs"), None);
        // An empty or blank id invalidates the whole scope (it does not degrade to `read:runs`).
        assert_eq!(parse_scope("read:runs:"), None);
        assert_eq!(parse_scope("read:runs:  "), None);
        // The id is kept verbatim.
        assert_eq!(
            parse_scope("read:tags: a "),
            Some(scope("read", Some("tags"), Some(" a ")))
        );
    }

    fn ability(scopes: &[&str]) -> Ability {
        Ability::from_scopes(scopes)
    }

    /// Each scope of `granted` on its own grants the `route` route (`res`); none of `denied` does.
    fn assert_scope_matrix(route: &str, res: &[Resource], granted: &[&str], denied: &[&str]) {
        for scope in granted {
            let ok = ability(&[scope]).can_read_any(res);
            assert!(ok, "{scope} should grant the {route} route");
        }
        for scope in denied {
            let ok = ability(&[scope]).can_read_any(res);
            assert!(!ok, "{scope} must not grant the {route} route");
        }
    }

    fn run_fixture(tags: &[&str], batch: Option<&str>) -> RunResource {
        RunResource {
            id: "cm_internal".into(),
            friendly_id: "run_abc".into(),
            task_identifier: "my-task".into(),
            tags: tags.iter().map(|t| t.to_string()).collect(),
            batch_friendly_id: batch.map(Into::into),
        }
    }

    #[test]
    fn run_route_scope_matrix() {
        let tagged = run_fixture(&["user:1", "org_2"], Some("batch_x"));
        let res = run_route_resources(&tagged);
        let granted = [
            "read:runs",
            "read:runs:run_abc",
            "read:tasks",
            "read:tasks:my-task",
            "read:tags",
            "read:tags:user:1",
            "read:tags:org_2",
            "read:batch",
            "read:batch:batch_x",
            "read:all",
            "*:runs",
            "*:all",
            "*:tags:org_2",
            "admin",
        ];
        let denied = [
            "read:runs:run_other",
            "read:tasks:other-task",
            "read:tags:user",
            "read:batch:batch_y",
            "read",
            "write:runs",
            "write:*",
            "write:all",
            "admin:runs",
            "read:runs:",
            "read:queues",
        ];
        assert_scope_matrix("run", &res, &granted, &denied);
    }

    #[test]
    fn run_route_read_tags_needs_at_least_one_tag() {
        let untagged = run_fixture(&[], None);
        let res = run_route_resources(&untagged);
        assert!(!ability(&["read:tags"]).can_read_any(&res));
        assert!(!ability(&["read:batch"]).can_read_any(&res));
        assert!(ability(&["read:runs"]).can_read_any(&res));
    }

    #[test]
    fn runs_list_route_scope_matrix() {
        let tags = vec!["a".to_string(), "b".to_string()];
        let res = runs_list_resources(&tags);
        let granted = [
            "read:runs",
            "read:tags",
            "read:tags:a",
            "read:tags:b",
            "read:all",
            "admin",
            "*:tags",
        ];
        let denied = [
            "read:runs:run_abc",
            "read:tasks",
            "read:batch",
            "read:tags:c",
            "read",
            "write:runs",
        ];
        assert_scope_matrix("list", &res, &granted, &denied);
        // No tags filter: `read:tags` still grants (the `{tags}` resource), a tag id does not.
        let none: Vec<String> = Vec::new();
        let res = runs_list_resources(&none);
        assert!(ability(&["read:tags"]).can_read_any(&res));
        assert!(!ability(&["read:tags:a"]).can_read_any(&res));
    }

    #[test]
    fn batch_route_scope_matrix() {
        let res = batch_route_resources("batch_x");
        let granted = [
            "read:batch",
            "read:batch:batch_x",
            "read:runs",
            "read:all",
            "admin",
            "*:batch",
        ];
        let denied = [
            "read:batch:batch_y",
            "read:runs:run_abc",
            "read:tasks",
            "read:tags",
            "write:batch:batch_x",
        ];
        assert_scope_matrix("batch", &res, &granted, &denied);
    }

    #[test]
    fn any_resource_with_empty_list_is_denied() {
        assert!(!ability(&["admin"]).can_read_any(&[]));
        // permissiveAbility ignores the resource entirely.
        assert!(Ability::All.can_read_any(&[]));
        assert!(Ability::All.can_read_any(&[Resource {
            kind: "runs",
            id: None
        }]));
    }

    #[test]
    fn admin_variants() {
        let r = [Resource {
            kind: "runs",
            id: Some("run_1"),
        }];
        assert!(ability(&["admin"]).can_read_any(&r));
        // `admin:` has an empty (absent) type, so it is bare admin.
        assert!(ability(&["admin:"]).can_read_any(&r));
        assert!(!ability(&["admin:runs"]).can_read_any(&r));
        assert!(!ability(&["admin:all"]).can_read_any(&r));
    }

    #[test]
    fn scopes_combine_any_of() {
        let r = [Resource {
            kind: "runs",
            id: Some("run_1"),
        }];
        assert!(ability(&["read", "write:runs", "read:runs:run_1"]).can_read_any(&r));
        assert!(!ability(&[]).can_read_any(&r));
    }
}
