//! Connecting to Postgres: create the database if missing, apply the embedded
//! migrations ([`migrate()`]), and follow a list of hosts to the writable one
//! (`hosts`).

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

mod hosts;
mod migrate;

pub(crate) use hosts::{Moved, retiring};
pub use migrate::{
    MIGRATIONS_TABLE, MIGRATOR, ensure_migrated, migrate, move_from_sqlx_migrations,
};

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
    /// None of the hosts of a host list answered as `target_session_attrs` asks.
    #[error("no host of {hosts} {wanted}")]
    NoHost {
        /// The hosts, `host:port` each, comma-separated.
        hosts: String,
        /// What was asked of them: "answers", or "takes writes".
        wanted: &'static str,
        /// Why the last one would not do.
        #[source]
        source: sqlx::Error,
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

/// Creates the database named in `url` if it does not exist yet (on the writable host,
/// when `url` lists several: see [`connect`]).
///
/// Connects to the server's `postgres` database to issue `CREATE DATABASE`; a database
/// created concurrently by another process counts as success.
pub async fn create_database_if_missing(url: &str) -> Result<(), DbError> {
    let hosts = hosts::Hosts::parse(url, &application_name())?;
    // The writable host is asked for on its `postgres` database: the URL's may not
    // exist yet.
    let options = match hosts.followed() {
        true => hosts.each[hosts.on_database("postgres").pick().await?].clone(),
        false => hosts.each[0].clone(),
    };
    let Some(database) = options.get_database().map(str::to_owned) else {
        return Ok(());
    };
    let admin = options.clone().database("postgres");
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
///
/// `url` may list several hosts as libpq does (`postgres://u:p@db1:5432,db2:5432/app`),
/// with `target_session_attrs=read-write` (or `primary`) to take only one that takes
/// writes: the pool connects to the first in order that will do, and follows when it
/// stops doing (it fails, or turns read-only as a demoted primary does): see
/// [`connect_named`].
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, DbError> {
    connect_named(url, &application_name(), max_connections).await
}

/// [`connect`], its connections named `name` unless the URL names them.
///
/// With a host list, a task of the pool's checks the host every second, on a
/// connection of its own: when it does not answer, or no longer takes writes (asked for
/// with `target_session_attrs`), the hosts are tried again in order and the pool's new
/// connections go to the first that will do; a connection opened before the move is not
/// handed out again, and (with `read-write`) each new one is checked as it opens.
/// Statements in flight on the old host fail as a lost connection does (a demoted
/// primary's SQLSTATE 25006 is an outage too), and are retried as such. The task holds the pool until
/// [`PgPool::close`]: a pool on a host list lives until it is closed, even when every
/// other handle of it is dropped.
pub async fn connect_named(url: &str, name: &str, max_connections: u32) -> Result<PgPool, DbError> {
    let hosts = hosts::Hosts::parse(url, name)?;
    if !hosts.followed() {
        return connect_with(hosts.each[0].clone(), max_connections).await;
    }
    hosts.connect(pool_options(max_connections)).await
}

/// `url`'s connection options, with `application_name` set to `name` unless the URL
/// sets one: what `pg_stat_activity` shows, so that an operator can tell a worker's
/// pool from its relay, the console or a command. One host: a host list is for
/// [`connect_named`], which follows it.
pub fn options(url: &str, name: &str) -> Result<PgConnectOptions, DbError> {
    let options = PgConnectOptions::from_str(url).map_err(DbError::InvalidUrl)?;
    Ok(if options.get_application_name().is_some() {
        options
    } else {
        options.application_name(name)
    })
}

/// [`StoreConfig::session`](crate::StoreConfig::session) from a URL, if one is given
/// (`DATABASE_SESSION_URL` in the examples and the `idem` command): where the
/// connections that need a session of their own open when the pool's URL goes through a
/// transaction pooler. Named as [`connect`]'s are.
///
/// One host: a session needs one server, and the sessions it holds (a gc round, a
/// `LISTEN`) end with a failover and open again here, so point it at something that
/// follows the primary itself (a pooler in front of it, a virtual IP); a host list is
/// refused with a line saying so.
pub fn session_options(url: Option<&str>) -> Result<Option<PgConnectOptions>, DbError> {
    url.map(|url| {
        let hosts = hosts::Hosts::parse(url, &application_name())?;
        match hosts.each.len() {
            1 => Ok(hosts.each[0].clone()),
            _ => Err(DbError::InvalidUrl(sqlx::Error::Configuration(
                "a session URL takes one host, not a list".into(),
            ))),
        }
    })
    .transpose()
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
    pool_options(max_connections)
        .connect_with(options.clone())
        .await
        .map_err(|source| DbError::Connect {
            target: target(&options),
            source,
        })
}

fn pool_options(max_connections: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        // A ping before every acquire would double the round trips of every claim;
        // a dead connection surfaces as an error on first use instead.
        .test_before_acquire(false)
}

/// Where `url` points, for what a program prints: `host:port/database` (hosts
/// comma-separated for a host list), never the password.
pub fn describe(url: &str) -> String {
    match hosts::Hosts::parse(url, "idem") {
        Ok(hosts) => hosts.describe(),
        Err(_) => "an invalid database URL".into(),
    }
}

/// A duration as whole milliseconds, saturating: how idem's statements take intervals
/// (`$n * interval '1 millisecond'`).
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
