//! Connecting to Postgres: create the database if missing, apply the embedded migrations.

use std::str::FromStr;
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

/// The migrations under `migrations/`, embedded in the binary, recorded in
/// [`MIGRATIONS_TABLE`] (set in `sqlx.toml`).
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// Where idem records its applied migrations: a table of its own, so that an
/// application's own strict `sqlx::migrate!` (recorded in `_sqlx_migrations`) and
/// idem's run side by side in one database, in either order. An older idem recorded
/// them in `_sqlx_migrations`; [`migrate`] moves them.
pub const MIGRATIONS_TABLE: &str = "idem_migrations";

/// The database URL used when neither `DATABASE_URL` nor a flag gives one.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/idem";

/// `DATABASE_URL` from the environment, or [`DEFAULT_DATABASE_URL`].
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into())
}

/// Why the database could not be prepared.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DbError {
    /// The URL does not parse as a Postgres URL.
    #[error("invalid database URL")]
    InvalidUrl(#[source] sqlx::Error),
    /// Postgres did not accept a connection.
    #[error("cannot reach Postgres at {target}")]
    Connect {
        /// `host:port/database`, without credentials.
        target: String,
        /// What the driver said.
        #[source]
        source: sqlx::Error,
    },
    /// `CREATE DATABASE` failed.
    #[error("cannot create database {database}")]
    CreateDatabase {
        /// The database name.
        database: String,
        /// What Postgres said.
        #[source]
        source: sqlx::Error,
    },
    /// A migration failed to apply.
    #[error("cannot apply migrations")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The rows an older idem left in `_sqlx_migrations` could not be moved to
    /// `idem_migrations`.
    #[error("cannot move idem's migrations from _sqlx_migrations to idem_migrations")]
    MoveMigrations(#[source] sqlx::Error),
    /// The database lacks migrations this build needs (an older idem migrated it).
    #[error("{target} lacks migrations {missing}; run `idem migrate` first")]
    Behind {
        /// `host:port/database`, without credentials.
        target: String,
        /// The migrations not applied, by version and description.
        missing: String,
    },
    /// The database exists but holds no idem schema (`idem migrate` was never run).
    #[error("{target} has no processed_operations table; run `idem migrate` first")]
    NotMigrated {
        /// `host:port/database`, without credentials.
        target: String,
    },
}

/// Where a connection goes, for error messages: never includes the password.
fn target(options: &PgConnectOptions) -> String {
    format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("postgres")
    )
}

/// Creates the database named in `url` if it does not exist yet.
///
/// Connects to the server's `postgres` database to issue `CREATE DATABASE`; a database
/// created concurrently by another process counts as success.
pub async fn create_database_if_missing(url: &str) -> Result<(), DbError> {
    let options = PgConnectOptions::from_str(url).map_err(DbError::InvalidUrl)?;
    let Some(database) = options.get_database().map(str::to_owned) else {
        return Ok(());
    };
    let admin = options.clone().database("postgres");
    let admin = match admin.get_application_name() {
        Some(_) => admin,
        None => admin.application_name(&application_name()),
    };
    let mut conn = admin.connect().await.map_err(|source| DbError::Connect {
        target: target(&admin),
        source,
    })?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&database)
            .fetch_one(&mut conn)
            .await
            .map_err(|source| DbError::Connect {
                target: target(&admin),
                source,
            })?;
    if !exists {
        let create = format!("CREATE DATABASE \"{}\"", database.replace('"', "\"\""));
        if let Err(source) = sqlx::query(sqlx::AssertSqlSafe(create))
            .execute(&mut conn)
            .await
        {
            // Another process won the race, which is fine: 42P04 duplicate_database
            // when it had committed, 23505 on pg_database's unique index when both
            // creates ran at the same moment.
            let raced = source
                .as_database_error()
                .and_then(|e| e.code())
                .is_some_and(|code| code == "42P04" || code == "23505");
            if !raced {
                return Err(DbError::CreateDatabase { database, source });
            }
        }
    }
    let _ = conn.close().await;
    Ok(())
}

/// Creates the database if missing, opens a pool of at most `max_connections` and
/// applies the migrations. Applying them again is harmless. Its connections are named
/// as [`connect`]'s are.
pub async fn connect_and_migrate(url: &str, max_connections: u32) -> Result<PgPool, DbError> {
    create_database_if_missing(url).await?;
    let pool = connect(url, max_connections).await?;
    migrate(&pool).await?;
    Ok(pool)
}

/// Opens a pool of at most `max_connections` on a database that must exist already;
/// creates and migrates nothing. For tools that only inspect or operate.
///
/// Its connections show in `pg_stat_activity` under [`application_name`] (the
/// executable's name), unless the URL names them (`?application_name=…`).
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, DbError> {
    connect_with(options(url, &application_name())?, max_connections).await
}

/// `url`'s connection options, with `application_name` set to `name` unless the URL
/// sets one: what `pg_stat_activity` shows, so that an operator can tell a worker's
/// pool from its relay, the console or a command.
pub fn options(url: &str, name: &str) -> Result<PgConnectOptions, DbError> {
    let options = PgConnectOptions::from_str(url).map_err(DbError::InvalidUrl)?;
    Ok(if options.get_application_name().is_some() {
        options
    } else {
        options.application_name(name)
    })
}

/// The name idem's connections take when nobody names them: the executable's file name
/// (`orders_worker`), or `idem` when it has none.
pub fn application_name() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "idem".into())
}

/// Opens a pool of at most `max_connections` with these options ([`options`] names them).
pub async fn connect_with(
    options: PgConnectOptions,
    max_connections: u32,
) -> Result<PgPool, DbError> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        // A ping before every acquire would double the round trips of every claim;
        // a dead connection surfaces as an error on first use instead.
        .test_before_acquire(false)
        .connect_with(options.clone())
        .await
        .map_err(|source| DbError::Connect {
            target: target(&options),
            source,
        })
}

/// Where `url` points, for what a program prints: `host:port/database`, never the
/// password.
pub fn describe(url: &str) -> String {
    match PgConnectOptions::from_str(url) {
        Ok(options) => target(&options),
        Err(_) => "an invalid database URL".into(),
    }
}

/// Fails with [`DbError::NotMigrated`] unless `processed_operations` exists in the
/// database `pool` is on, and with [`DbError::Behind`] unless every migration this
/// build knows is applied (a newer database is fine: migrations only add).
pub async fn ensure_migrated(pool: &PgPool) -> Result<(), DbError> {
    let options = pool.connect_options();
    let connect_error = |source| DbError::Connect {
        target: target(&options),
        source,
    };
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('processed_operations') IS NOT NULL")
        .fetch_one(pool)
        .await
        .map_err(connect_error)?;
    if !exists {
        return Err(DbError::NotMigrated {
            target: target(&options),
        });
    }
    // A database an older idem migrated has no such table yet: all are missing, and
    // `idem migrate` moves them.
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM idem_migrations WHERE success")
        .fetch_all(pool)
        .await
        .or_else(|error| match &error {
            sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => Ok(Vec::new()),
            _ => Err(error),
        })
        .map_err(connect_error)?;
    let missing: Vec<String> = MIGRATOR
        .iter()
        .filter(|m| !applied.contains(&m.version))
        .map(|m| format!("{} {}", m.version, m.description))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(DbError::Behind {
            target: target(&options),
            missing: missing.join(", "),
        })
    }
}

/// Applies the embedded migrations. Migrations that a newer idem applied and this build
/// does not know are left alone, so that an older worker still starts during a rolling
/// upgrade or after a rollback: idem's migrations only add to the schema (or, like the
/// fingerprint check's, say the same rule another way), so older code keeps working.
///
/// A database an older idem migrated recorded them in `_sqlx_migrations`, beside an
/// application's own: they are moved to [`MIGRATIONS_TABLE`] first (once, under a lock,
/// in one transaction), so that neither migrator finds the other's versions.
pub async fn migrate(pool: &PgPool) -> Result<(), DbError> {
    move_from_sqlx_migrations(pool).await?;
    // The same embedded migrations as `MIGRATOR` (which stays strict for the tests).
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.set_ignore_missing(true);
    Ok(migrator.run(pool).await?)
}

/// Moves idem's rows (its versions, with its checksums) from `_sqlx_migrations` to
/// `idem_migrations`, if an older idem left them there and none were moved yet.
/// Returns how many moved.
pub async fn move_from_sqlx_migrations(pool: &PgPool) -> Result<u64, DbError> {
    move_rows(pool).await.map_err(DbError::MoveMigrations)
}

async fn move_rows(pool: &PgPool) -> Result<u64, sqlx::Error> {
    let mut tx = pool.begin().await?;
    // Workers starting together: one moves, the others find it done.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem_migrations_move'))")
        .execute(&mut *tx)
        .await?;
    let (old, new): (bool, bool) = sqlx::query_as(
        "SELECT to_regclass('_sqlx_migrations') IS NOT NULL, to_regclass('idem_migrations') IS NOT NULL",
    )
    .fetch_one(&mut *tx)
    .await?;
    if !old || new {
        return Ok(0);
    }
    let recorded: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT version, checksum FROM _sqlx_migrations")
            .fetch_all(&mut *tx)
            .await?;
    let ours: Vec<i64> = recorded
        .iter()
        .filter(|(version, checksum)| {
            MIGRATOR
                .iter()
                .any(|m| m.version == *version && *m.checksum == **checksum)
        })
        .map(|(version, _)| *version)
        .collect();
    if ours.is_empty() {
        return Ok(0);
    }
    sqlx::query("CREATE TABLE idem_migrations (LIKE _sqlx_migrations INCLUDING ALL)")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO idem_migrations SELECT * FROM _sqlx_migrations WHERE version = ANY($1)",
    )
    .bind(&ours)
    .execute(&mut *tx)
    .await?;
    let moved = sqlx::query("DELETE FROM _sqlx_migrations WHERE version = ANY($1)")
        .bind(&ours)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    tx.commit().await?;
    tracing::info!(
        moved,
        "idem's migrations moved from _sqlx_migrations to idem_migrations"
    );
    Ok(moved)
}
