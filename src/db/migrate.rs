//! idem's migrations: applied in one transaction, recorded in a table of idem's own.

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::{PgConnection, PgPool};

use super::{DbError, target};

/// The migrations under `migrations/`, embedded in the binary, recorded in
/// [`MIGRATIONS_TABLE`] (set in `sqlx.toml`).
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// Where idem records its applied migrations: a table of its own, so that an
/// application's own strict `sqlx::migrate!` (recorded in `_sqlx_migrations`) and
/// idem's run side by side in one database, in either order. An older idem recorded
/// them in `_sqlx_migrations`; [`migrate`] moves them.
pub const MIGRATIONS_TABLE: &str = "idem_migrations";

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
/// application's own: they are moved to [`MIGRATIONS_TABLE`] first, so that neither
/// migrator finds the other's versions.
///
/// All of it runs in one transaction under a transaction-scoped advisory lock
/// ([`MIGRATE_LOCK`]): processes that start together migrate one after the other, the
/// later ones find it done, and nothing needs a session that outlives a transaction
/// (sqlx's own migration lock is a session lock, which a transaction pooler does not
/// keep: two workers starting together through one both ran the migrations).
pub async fn migrate(pool: &PgPool) -> Result<(), DbError> {
    let mut tx = pool.begin().await.map_err(MigrateError::Execute)?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATE_LOCK)
        .execute(&mut *tx)
        .await
        .map_err(MigrateError::Execute)?;
    move_rows(&mut tx).await.map_err(DbError::MoveMigrations)?;
    // The same embedded migrations as `MIGRATOR` (which stays strict for the tests);
    // each runs in a savepoint of this transaction.
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.set_ignore_missing(true).set_locking(false);
    // `run_direct`, not `run`: `run`'s `Acquire` bound on a borrowed connection makes
    // the future not `Send` (sqlx's own comment on `run_direct` says so).
    migrator.run_direct(None, &mut *tx, false).await?;
    tx.commit().await.map_err(MigrateError::Execute)?;
    Ok(())
}

/// The advisory lock [`migrate`] holds for its transaction ("idem mig" in ASCII).
pub const MIGRATE_LOCK: i64 = 0x0069_6465_6d20_6d69;

/// Moves idem's rows (its versions, with its checksums) from `_sqlx_migrations` to
/// `idem_migrations`, if an older idem left them there and none were moved yet.
/// Returns how many moved. [`migrate`] does it first.
pub async fn move_from_sqlx_migrations(pool: &PgPool) -> Result<u64, DbError> {
    let moving = async {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await?;
        let moved = move_rows(&mut tx).await?;
        tx.commit().await?;
        Ok(moved)
    };
    moving.await.map_err(DbError::MoveMigrations)
}

/// [`move_from_sqlx_migrations`] in `tx`, which holds [`MIGRATE_LOCK`].
async fn move_rows(tx: &mut PgConnection) -> Result<u64, sqlx::Error> {
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
    tracing::info!(
        moved,
        "idem's migrations moved from _sqlx_migrations to idem_migrations"
    );
    Ok(moved)
}
