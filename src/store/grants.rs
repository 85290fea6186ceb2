//! The least privileges `runfeed serve` needs in trigger.dev's database, and a check that the
//! role it connects as has them.
//!
//! [`required`] is the list of tables and columns runfeed reads: every column of the feed
//! ([`Column::ALL`], the wire columns) plus the `"TaskRun"` columns the router and the filters
//! use, and what authentication and the URL lookups read (`pg.rs`). A unit test below checks
//! every statement `pg.rs`, `sql.rs` and `lag.rs` issue against this list, and
//! `deploy/trigger.dev/runfeed-role.sql` grants exactly this list (`tests/it/grants.rs`).
//!
//! [`check`] asks Postgres (`has_column_privilege`, `has_schema_privilege`,
//! `has_function_privilege`) whether the connected role may read all of it, on the primary and,
//! when there is one, the replica. `runfeed serve` runs it once at start (a missing grant stops
//! the server with a message naming it; an unreachable database only logs, `/readyz` reports it)
//! and on every `/readyz` (check `"grants"`). runfeed never writes: the role needs no other
//! privilege.

use std::fmt;
use std::time::Duration;

use sqlx::{PgPool, Row};

use super::PgStore;
use crate::protocol::Column;

/// Where the role file lives in the repository (named in error messages).
pub const ROLE_SQL: &str = "deploy/trigger.dev/runfeed-role.sql";

/// `"TaskRun"` columns read besides the feed's wire columns: batch membership (router, batch
/// feed) and the environment every read is scoped to.
const TASK_RUN_EXTRA: &[&str] = &["batchId", "runtimeEnvironmentId"];

/// The other tables: URL lookups (`"BatchTaskRun"`, the run's batch), authentication (secret
/// keys, public-token environments, branches, revoked keys with their grace period).
const OTHER_TABLES: &[(&str, &[&str])] = &[
    (
        "BatchTaskRun",
        &["id", "friendlyId", "runtimeEnvironmentId"],
    ),
    (
        "RuntimeEnvironment",
        &[
            "id",
            "type",
            "organizationId",
            "projectId",
            "apiKey",
            "parentEnvironmentId",
            "branchName",
            "archivedAt",
        ],
    ),
    ("Project", &["id", "deletedAt"]),
    (
        "RevokedApiKey",
        &["apiKey", "runtimeEnvironmentId", "expiresAt"],
    ),
];

/// Functions the read-your-writes gate calls (`lag.rs`); Postgres grants them to PUBLIC by
/// default, so only a hardened database can lack them.
pub const FUNCTIONS: &[&str] = &[
    "pg_catalog.pg_current_wal_lsn()",
    "pg_catalog.pg_last_wal_replay_lsn()",
    "pg_catalog.pg_is_in_recovery()",
];

/// `SELECT` on these columns of one table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableGrant {
    pub table: &'static str,
    pub columns: Vec<&'static str>,
}

/// Every table and column `runfeed serve` reads, tables in a fixed order, columns in the
/// table's read order (the feed's wire order for `"TaskRun"`).
pub fn required() -> Vec<TableGrant> {
    let mut task_run: Vec<&'static str> = Column::ALL.iter().map(|c| c.name()).collect();
    task_run.extend_from_slice(TASK_RUN_EXTRA);
    let mut out = vec![TableGrant {
        table: "TaskRun",
        columns: task_run,
    }];
    out.extend(OTHER_TABLES.iter().map(|(table, columns)| TableGrant {
        table,
        columns: columns.to_vec(),
    }));
    out
}

/// The server a check ran on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    Primary,
    Replica,
}

impl fmt::Display for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Server::Primary => "primary",
            Server::Replica => "replica",
        })
    }
}

/// One thing the role cannot read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Missing {
    /// No such table in any schema: not trigger.dev's database (or not migrated).
    Table { table: String },
    /// The table has no such column: a trigger.dev version runfeed does not know.
    Column { table: String, column: String },
    /// The table's schema lacks `USAGE` for the role.
    SchemaUsage { schema: String },
    /// `SELECT` on the column (or the whole table) is not granted.
    Select { table: String, column: String },
    /// `EXECUTE` on the function is not granted.
    Execute { function: String },
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Missing::Table { table } => write!(f, "table \"{table}\" (not found)"),
            Missing::Column { table, column } => {
                write!(f, "column \"{table}\".\"{column}\" (not found)")
            }
            Missing::SchemaUsage { schema } => write!(f, "USAGE ON SCHEMA \"{schema}\""),
            Missing::Select { table, column } => {
                write!(f, "SELECT (\"{column}\") ON \"{table}\"")
            }
            Missing::Execute { function } => write!(f, "EXECUTE ON FUNCTION {function}"),
        }
    }
}

/// Why the role cannot serve the feeds, or why that could not be found out.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    /// The role lacks privileges (or the schema lacks tables/columns runfeed reads).
    #[error(
        "database role {role:?} on the {server} lacks {}; grant them with {ROLE_SQL}",
        list(.missing)
    )]
    Missing {
        server: Server,
        role: String,
        missing: Vec<Missing>,
    },
    /// The check itself failed (connection refused, timeout, …).
    #[error("checking the database role's privileges on the {server}: {source}")]
    Query {
        server: Server,
        #[source]
        source: sqlx::Error,
    },
}

fn list(missing: &[Missing]) -> String {
    missing
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One round trip per statement: each required column with whether its table, schema usage,
/// column and `SELECT` privilege are there. The table is looked up by name in every non-system
/// schema, preferring the one the search path makes visible (runfeed's statements use
/// unqualified names), so a schema the role cannot use is reported as such, not as missing.
const COLUMNS_SQL: &str = r#"
SELECT t.tbl, t.col, c.oid IS NOT NULL AS table_found, c.nspname,
       COALESCE(has_schema_privilege(c.nsp, 'USAGE'), false) AS schema_usage,
       a.attnum IS NOT NULL AS column_found,
       COALESCE(has_column_privilege(c.oid, a.attnum, 'SELECT'), false) AS can_select
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS t(tbl, col, ord)
LEFT JOIN LATERAL (
    SELECT c.oid, n.oid AS nsp, n.nspname::text AS nspname
    FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
    WHERE c.relname = t.tbl AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
      AND n.nspname NOT IN ('pg_catalog', 'information_schema')
    ORDER BY pg_catalog.pg_table_is_visible(c.oid) DESC, (n.nspname = 'public') DESC
    LIMIT 1
) c ON true
LEFT JOIN pg_catalog.pg_attribute a
       ON a.attrelid = c.oid AND a.attname = t.col AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY t.ord
"#;

const FUNCTIONS_SQL: &str = "SELECT f, has_function_privilege(f, 'EXECUTE') AS ok, current_user::text AS role FROM unnest($1::text[]) AS f";

/// What the role connected through `pool` (one of `store`'s pools, queried through
/// `PgStore::fetch_on`, so bounded like every store query) cannot read of [`required`] and
/// [`FUNCTIONS`] (empty: everything is there), and the role's name.
///
/// Errors: the catalog queries fail (connection, timeout).
pub async fn missing_on(
    store: &PgStore,
    pool: &PgPool,
) -> Result<(String, Vec<Missing>), sqlx::Error> {
    let (tables, columns): (Vec<&str>, Vec<&str>) = required()
        .iter()
        .flat_map(|g| g.columns.iter().map(move |c| (g.table, *c)))
        .unzip();
    let query = || sqlx::query(COLUMNS_SQL).bind(&tables).bind(&columns);
    let rows = store
        .fetch_on(pool, "grants", query)
        .await
        .map_err(|e| e.source)?;
    let mut missing = Vec::new();
    let mut push = |m: Missing| {
        if !missing.contains(&m) {
            missing.push(m);
        }
    };
    for row in &rows {
        let table: String = row.try_get("tbl")?;
        let column: String = row.try_get("col")?;
        if !row.try_get::<bool, _>("table_found")? {
            push(Missing::Table { table });
        } else if !row.try_get::<bool, _>("schema_usage")? {
            let schema: Option<String> = row.try_get("nspname")?;
            push(Missing::SchemaUsage {
                schema: schema.unwrap_or_default(),
            });
        } else if !row.try_get::<bool, _>("column_found")? {
            push(Missing::Column { table, column });
        } else if !row.try_get::<bool, _>("can_select")? {
            push(Missing::Select { table, column });
        }
    }
    let query = || sqlx::query(FUNCTIONS_SQL).bind(FUNCTIONS);
    let rows = store
        .fetch_on(pool, "grants", query)
        .await
        .map_err(|e| e.source)?;
    let mut role = String::new();
    for row in &rows {
        role = row.try_get("role")?;
        if !row.try_get::<bool, _>("ok")? {
            push(Missing::Execute {
                function: row.try_get("f")?,
            });
        }
    }
    Ok((role, missing))
}

/// Checks the primary and, when reads go to a distinct replica, the replica (a streaming
/// replica carries the primary's grants, but a separately managed one may not).
///
/// Errors: [`GrantError::Missing`] naming every missing privilege of the first server that
/// lacks one; [`GrantError::Query`] when a check could not run.
pub async fn check(store: &PgStore) -> Result<(), GrantError> {
    let mut servers = vec![(Server::Primary, store.primary())];
    if store.has_distinct_replica() {
        servers.push((Server::Replica, store.replica()));
    }
    for (server, pool) in servers {
        let (role, missing) = missing_on(store, pool)
            .await
            .map_err(|source| GrantError::Query { server, source })?;
        if !missing.is_empty() {
            return Err(GrantError::Missing {
                server,
                role,
                missing,
            });
        }
    }
    Ok(())
}

/// How long the start-up check may take before the server starts anyway (`/readyz` keeps
/// checking).
pub const STARTUP_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The start-up check: `Err` (the server must not start) when a privilege is missing; a
/// database that cannot be reached or answers slowly, or a replica that has not replayed the
/// tables yet, only logs a warning (`/readyz` reports it, and the server recovers by itself).
pub async fn check_at_startup(store: &PgStore) -> anyhow::Result<()> {
    match tokio::time::timeout(STARTUP_CHECK_TIMEOUT, check(store)).await {
        Ok(Ok(())) => Ok(()),
        // A replica whose copy of the schema has not arrived yet (a standby just created from
        // an empty database) is not a privilege problem: start, and let `/readyz` report it
        // until it has replayed the tables.
        Ok(Err(GrantError::Missing {
            server: Server::Replica,
            missing,
            ..
        })) if missing.iter().all(|m| matches!(m, Missing::Table { .. })) => {
            tracing::warn!(
                "the read replica has none of runfeed's tables yet ({}); starting, /readyz reports it until they are replayed",
                list(&missing)
            );
            Ok(())
        }
        Ok(Err(err @ GrantError::Missing { .. })) => Err(err.into()),
        Ok(Err(err)) => {
            tracing::warn!(error = %err, "database privileges not checked at start; /readyz keeps checking");
            Ok(())
        }
        Err(_) => {
            tracing::warn!(
                "database privileges not checked at start: no answer within {STARTUP_CHECK_TIMEOUT:?}; /readyz keeps checking"
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;
    use crate::protocol::ColumnSet;
    use crate::store::sql::{run_query_sql, RunQuery};

    /// String literals of a Rust source that hold SQL (raw `r#"…"#` and plain `"…"` literals
    /// containing `SELECT`/`FROM`/`WHERE`), concatenated per `concat!` / macro use is not needed:
    /// the `env_sql!` head and its tails are checked separately, which covers the same text.
    fn sql_literals(src: &str) -> Vec<String> {
        let mut out = Vec::new();
        let bytes = src.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if src[i..].starts_with("r#\"") {
                let start = i + 3;
                let end = src[start..]
                    .find("\"#")
                    .map(|e| start + e)
                    .expect("raw string end");
                out.push(src[start..end].to_string());
                i = end + 2;
            } else if bytes[i] == b'"' {
                let start = i + 1;
                let mut j = start;
                while j < bytes.len() && bytes[j] != b'"' {
                    if bytes[j] == b'\\' {
                        j += 1;
                    }
                    j += 1;
                }
                out.push(src[start..j.min(bytes.len())].to_string());
                i = j + 1;
            } else if src[i..].starts_with("//") {
                i += src[i..].find('\n').unwrap_or(src.len() - i);
            } else {
                i += 1;
            }
        }
        out.retain(|s| {
            let u = s.to_uppercase();
            u.contains("SELECT ") || u.contains(" FROM ") || u.contains(" WHERE ")
        });
        out
    }

    /// `(table or alias, column)` references of one statement: `alias."col"`, `alias.col`, and
    /// unqualified `"col"` (table `None`), plus `FROM`/`JOIN` `"Table" alias` bindings.
    struct Refs {
        aliases: BTreeMap<String, String>,
        columns: Vec<(Option<String>, String)>,
    }

    fn refs(sql: &str) -> Refs {
        // Tokens: quoted identifiers, words, dots; everything else separates.
        let mut tokens: Vec<(bool, String)> = Vec::new();
        let chars: Vec<char> = sql.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            if c == '"' {
                let end = chars[i + 1..]
                    .iter()
                    .position(|&x| x == '"')
                    .map(|p| i + 1 + p)
                    .expect("closing quote");
                tokens.push((true, chars[i + 1..end].iter().collect()));
                i = end + 1;
            } else if c == '\'' {
                let end = chars[i + 1..]
                    .iter()
                    .position(|&x| x == '\'')
                    .map(|p| i + 1 + p)
                    .expect("closing quote");
                i = end + 1; // string literal: not an identifier
            } else if c.is_alphanumeric() || c == '_' {
                let start = i;
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                tokens.push((false, chars[start..i].iter().collect()));
            } else if c == '.' {
                tokens.push((false, ".".into()));
                i += 1;
            } else if c == ':' && chars.get(i + 1) == Some(&':') {
                tokens.push((false, "::".into()));
                i += 2;
            } else {
                tokens.push((false, " ".into()));
                i += 1;
            }
        }
        let mut aliases = BTreeMap::new();
        let mut columns = Vec::new();
        for (k, (quoted, tok)) in tokens.iter().enumerate() {
            let prev = k.checked_sub(1).map(|p| &tokens[p]);
            let prev2 = k.checked_sub(2).map(|p| &tokens[p]);
            let upper_prev2 = prev2.map(|(_, t)| t.to_uppercase());
            // FROM "Table" alias / JOIN "Table" alias
            if *quoted
                && matches!(upper_prev2.as_deref(), Some("FROM") | Some("JOIN"))
                && prev.is_some_and(|(_, t)| t == " ")
            {
                if let (Some((false, sp)), Some((false, alias))) =
                    (tokens.get(k + 1), tokens.get(k + 2))
                {
                    if sp == " "
                        && alias.chars().all(|c| c.is_ascii_lowercase())
                        && !is_keyword(alias)
                    {
                        aliases.insert(alias.clone(), tok.clone());
                    }
                }
                aliases.insert(tok.clone(), tok.clone());
                continue;
            }
            if prev.is_some_and(|(q, t)| !q && t == ".") {
                let owner = prev2.map(|(_, t)| t.clone());
                if *quoted || tok.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                    columns.push((owner, tok.clone()));
                }
                continue;
            }
            if *quoted && tokens.get(k + 1).is_none_or(|(q, t)| *q || t != ".") {
                columns.push((None, tok.clone()));
            }
        }
        Refs { aliases, columns }
    }

    fn is_keyword(w: &str) -> bool {
        ["on", "where", "left", "join", "limit", "order"].contains(&w)
    }

    /// Problems: columns a statement reads that [`required`] does not grant.
    fn ungranted(sql: &str) -> Vec<String> {
        let granted: BTreeMap<&str, BTreeSet<&str>> = required()
            .into_iter()
            .map(|g| (g.table, g.columns.into_iter().collect()))
            .collect();
        let r = refs(sql);
        let tables: BTreeSet<&String> = r.aliases.values().collect();
        let mut problems = Vec::new();
        for t in &tables {
            if !granted.contains_key(t.as_str()) {
                problems.push(format!("table {t:?} is not in required(): {sql}"));
            }
        }
        for (owner, col) in &r.columns {
            let candidates: Vec<&String> = match owner {
                Some(o) => r.aliases.get(o).into_iter().collect(),
                None => tables.iter().copied().collect(),
            };
            let ok = candidates.iter().any(|t| {
                granted
                    .get(t.as_str())
                    .is_some_and(|cols| cols.contains(col.as_str()))
            });
            if !ok && !tables.contains(col) {
                problems.push(format!("{owner:?}.{col:?} is read but not granted: {sql}"));
            }
        }
        problems
    }

    #[test]
    fn every_statement_reads_only_granted_columns() {
        let mut statements: Vec<String> = Vec::new();
        for kind in [
            RunQuery::Hydrate,
            RunQuery::ReadOne,
            RunQuery::TagSet,
            RunQuery::TagSetOrdered,
            RunQuery::TagSetUnfiltered,
            RunQuery::BatchSet,
        ] {
            statements.push(run_query_sql(kind, ColumnSet::ALL));
        }
        for src in [
            include_str!("pg.rs"),
            include_str!("lag.rs"),
            include_str!("tag_plan.rs"),
        ] {
            statements.extend(sql_literals(src));
        }
        // pg.rs: 4 plain statements + the env_sql! head + 3 tails; lag.rs: 2 probes.
        assert!(statements.len() >= 5 + 8 + 2, "{statements:#?}");
        // The env head is only a prefix; give its WHERE tails the head's aliases.
        let head = statements
            .iter()
            .find(|s| s.contains(r#"FROM "RuntimeEnvironment" e"#))
            .cloned()
            .expect("the env_sql! head in pg.rs");
        let problems: Vec<String> = statements
            .iter()
            .map(|s| {
                if s.trim_start().starts_with("WHERE") {
                    format!("{head}{s}")
                } else {
                    s.clone()
                }
            })
            .flat_map(|s| ungranted(&s))
            .collect();
        assert!(problems.is_empty(), "{problems:#?}");
    }

    #[test]
    fn the_statement_check_catches_an_ungranted_column() {
        let p = ungranted(
            r#"SELECT e.id, e."secret" FROM "RuntimeEnvironment" e WHERE e."apiKey" = $1"#,
        );
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("secret"), "{p:?}");
        let p = ungranted(
            r#"SELECT "friendlyId", "payloadType", nope FROM "BatchTaskRun" WHERE id = $1"#,
        );
        assert!(p.iter().any(|x| x.contains("payloadType")), "{p:?}");
        let p = ungranted(r#"SELECT id FROM "User" WHERE id = $1"#);
        assert!(p.iter().any(|x| x.contains("\"User\"")), "{p:?}");
        let p = ungranted(
            r#"SELECT r.id, b."friendlyId" AS x FROM "TaskRun" r LEFT JOIN "BatchTaskRun" b ON b.id = r."batchId" WHERE b."taskIdentifier" = $1"#,
        );
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("taskIdentifier"), "{p:?}");
    }

    #[test]
    fn required_lists_each_table_once_and_each_column_once() {
        let req = required();
        let tables: BTreeSet<_> = req.iter().map(|g| g.table).collect();
        assert_eq!(tables.len(), req.len());
        for g in &req {
            let cols: BTreeSet<_> = g.columns.iter().collect();
            assert_eq!(cols.len(), g.columns.len(), "{}", g.table);
        }
        let task_run = &req[0];
        assert_eq!(task_run.table, "TaskRun");
        assert_eq!(task_run.columns.len(), 26 + TASK_RUN_EXTRA.len());
    }

    #[test]
    fn missing_grants_read_as_sql() {
        let err = GrantError::Missing {
            server: Server::Replica,
            role: "runfeed".into(),
            missing: vec![
                Missing::Select {
                    table: "TaskRun".into(),
                    column: "updatedAt".into(),
                },
                Missing::SchemaUsage {
                    schema: "public".into(),
                },
                Missing::Execute {
                    function: "pg_catalog.pg_is_in_recovery()".into(),
                },
            ],
        };
        assert_eq!(
            err.to_string(),
            "database role \"runfeed\" on the replica lacks SELECT (\"updatedAt\") ON \"TaskRun\", \
             USAGE ON SCHEMA \"public\", EXECUTE ON FUNCTION pg_catalog.pg_is_in_recovery(); grant \
             them with deploy/trigger.dev/runfeed-role.sql"
        );
    }
}
