//! Database set-up for development and tests (`runfeed migrate`): create the database named by a
//! URL when it is missing, then apply `migrations/` (the trigger.dev tables runfeed reads).
//! `runfeed serve` never calls any of this: in production the tables belong to trigger.dev.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

/// Why set-up failed, with the database it was about.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The URL does not parse as a Postgres URL.
    #[error("invalid Postgres URL {url:?}: {source}")]
    Url {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    /// A statement or connection failed.
    #[error("{op} {database}: {source}")]
    Sql {
        op: &'static str,
        database: String,
        #[source]
        source: sqlx::Error,
    },
    /// Applying `migrations/` failed.
    #[error("apply migrations to database {database}: {source}")]
    Migrate {
        database: String,
        #[source]
        source: sqlx::migrate::MigrateError,
    },
}

/// Applies `migrations/` (the trigger.dev tables runfeed reads) to `pool`. Idempotent.
///
/// The migrator records applied versions in `_sqlx_migrations`, so a second run is a no-op; the
/// SQL itself also tolerates pre-existing trigger.dev objects (`IF NOT EXISTS`, guarded enum
/// creation), so it can be pointed at a database that already holds the real tables.
///
/// Errors: [`sqlx::migrate::MigrateError`] (connection, SQL, or a changed already-applied file).
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    sqlx::migrate!("./migrations").run(pool).await
}

fn options(url: &str) -> Result<PgConnectOptions, SetupError> {
    PgConnectOptions::from_str(url).map_err(|source| SetupError::Url {
        url: url.to_string(),
        source,
    })
}

/// The database named by a Postgres URL (the user name when the URL names none, as libpq does).
///
/// Errors: [`SetupError::Url`].
pub fn database_name(database_url: &str) -> Result<String, SetupError> {
    let options = options(database_url)?;
    Ok(options
        .get_database()
        .unwrap_or(options.get_username())
        .to_string())
}

/// Connection options for database `name` on the server of `url` (any Postgres URL, with or
/// without a database path; its database part is replaced).
///
/// Errors: [`SetupError::Url`].
pub fn options_for(url: &str, name: &str) -> Result<PgConnectOptions, SetupError> {
    Ok(options(url)?.database(name))
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A one-connection pool on the `postgres` maintenance database of `url`'s server.
async fn maintenance_pool(url: &str) -> Result<PgPool, SetupError> {
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options_for(url, "postgres")?)
        .await
        .map_err(|source| SetupError::Sql {
            op: "connect to the maintenance database of",
            database: "postgres".into(),
            source,
        })
}

/// Creates database `name` on the server of `url` (through its `postgres` maintenance
/// database) unless it exists. Returns `true` if it was created. Safe to race.
///
/// Errors: [`SetupError`] (URL, connection, `CREATE DATABASE`).
pub async fn create_database(url: &str, name: &str) -> Result<bool, SetupError> {
    let pool = maintenance_pool(url).await?;
    let result = create_database_on(&pool, name).await;
    pool.close().await;
    result
}

async fn create_database_on(pool: &PgPool, name: &str) -> Result<bool, SetupError> {
    let sql_err = |op| {
        move |source| SetupError::Sql {
            op,
            database: name.to_string(),
            source,
        }
    };
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(pool)
            .await
            .map_err(sql_err("look up"))?;
    if exists {
        return Ok(false);
    }
    let sql = format!("CREATE DATABASE {}", quote_ident(name));
    match sqlx::query(sqlx::AssertSqlSafe(sql)).execute(pool).await {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(e))
            // duplicate_database, or the unique index on pg_database under a concurrent create.
            if matches!(e.code().as_deref(), Some("42P04") | Some("23505")) =>
        {
            Ok(false)
        }
        Err(source) => Err(sql_err("CREATE DATABASE")(source)),
    }
}

/// Drops database `name` on the server of `url` if it exists, terminating its connections
/// (`WITH (FORCE)`).
///
/// Errors: [`SetupError`] (URL, connection, `DROP DATABASE`).
pub async fn drop_database(url: &str, name: &str) -> Result<(), SetupError> {
    let pool = maintenance_pool(url).await?;
    let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(name));
    let result = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await;
    pool.close().await;
    result.map_err(|source| SetupError::Sql {
        op: "DROP DATABASE",
        database: name.to_string(),
        source,
    })?;
    Ok(())
}

/// Ensures the database of `database_url` exists, connects to it and applies the migrations.
/// Returns the pool and whether the database had to be created.
///
/// Errors: [`SetupError`] (URL, connection, creation, migration).
pub async fn connect_migrated(database_url: &str) -> Result<(PgPool, bool), SetupError> {
    let name = database_name(database_url)?;
    let options = options(database_url)?;
    let connect = || {
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options.clone())
    };
    let connect_err = |source| SetupError::Sql {
        op: "connect to database",
        database: name.clone(),
        source,
    };
    let (pool, created) = match connect().await {
        Ok(pool) => (pool, false),
        // invalid_catalog_name: the database does not exist yet.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("3D000") => {
            let created = create_database(database_url, &name).await?;
            (connect().await.map_err(connect_err)?, created)
        }
        Err(source) => return Err(connect_err(source)),
    };
    migrate(&pool).await.map_err(|source| SetupError::Migrate {
        database: name.clone(),
        source,
    })?;
    Ok((pool, created))
}
