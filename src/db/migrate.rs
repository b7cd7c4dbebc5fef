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
/// Each migration runs in a transaction of its own, which first takes the migration
/// locks as transaction-scoped advisory locks and then looks again at what is
/// applied: processes that start together migrate one after the other, the later ones
/// find it done, and nothing needs a session that outlives a transaction (sqlx's own
/// migration lock is a session lock, which a transaction pooler does not keep: two
/// workers starting together through one both ran the migrations). One transaction per
/// migration, not one for all: a migration's locks and settings (migration 3 waits at
/// most 5 s for its lock) end with it.
pub async fn migrate(pool: &PgPool) -> Result<(), DbError> {
    // The same embedded migrations as `MIGRATOR` (which stays strict for the tests).
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.set_ignore_missing(true).set_locking(false);
    let mut moved = false;
    let mut last = None;
    loop {
        let mut tx = pool.begin().await.map_err(MigrateError::Execute)?;
        lock(&mut tx).await.map_err(MigrateError::Execute)?;
        if !moved {
            move_rows(&mut tx).await.map_err(DbError::MoveMigrations)?;
            moved = true;
        }
        let applied = applied(&mut tx).await.map_err(MigrateError::Execute)?;
        let Some(next) = migrator
            .iter()
            .filter(|m| !m.migration_type.is_down_migration())
            .map(|m| m.version)
            .find(|v| !applied.contains(v))
        else {
            tx.commit().await.map_err(MigrateError::Execute)?;
            return Ok(());
        };
        if last == Some(next) {
            // Applied, but not found as applied: never loop on it.
            return Err(MigrateError::Execute(sqlx::Error::Configuration(
                format!("migration {next} ran but is not recorded in {MIGRATIONS_TABLE}").into(),
            ))
            .into());
        }
        last = Some(next);
        // Up to `next`: the ones before it are applied, so it alone runs. `run_direct`,
        // not `run`: `run`'s `Acquire` bound on a borrowed connection makes the future
        // not `Send` (sqlx's own comment on `run_direct` says so).
        migrator.run_direct(Some(next), &mut *tx, false).await?;
        tx.commit().await.map_err(MigrateError::Execute)?;
    }
}

/// Takes, for `tx`, the locks that every migrator of this database takes: sqlx's
/// (keyed by the database's name: an application's own `sqlx::migrate!` and an older
/// idem take it as a session lock) and the one under which an older idem moved its rows
/// out of `_sqlx_migrations`. Always in this order.
async fn lock(tx: &mut PgConnection) -> Result<(), sqlx::Error> {
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut *tx)
        .await?;
    sqlx::query(
        "SELECT pg_advisory_xact_lock($1), pg_advisory_xact_lock(hashtext('idem_migrations_move'))",
    )
    .bind(sqlx_lock_id(&database))
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The versions recorded as applied in [`MIGRATIONS_TABLE`] (none before it exists).
async fn applied(tx: &mut PgConnection) -> Result<Vec<i64>, sqlx::Error> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('idem_migrations') IS NOT NULL")
        .fetch_one(&mut *tx)
        .await?;
    if !exists {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT version FROM idem_migrations WHERE success")
        .fetch_all(&mut *tx)
        .await
}

/// The advisory lock id sqlx's migrator takes for a database (its `generate_lock_id`:
/// the CRC-32 of the name, times a constant).
fn sqlx_lock_id(database: &str) -> i64 {
    0x3d32_ad9e * i64::from(crc32(database.as_bytes()))
}

/// CRC-32 (ISO HDLC, the zlib one), bit by bit: a name is short.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Moves idem's rows (its versions, with its checksums) from `_sqlx_migrations` to
/// `idem_migrations`, if an older idem left them there and none were moved yet.
/// Returns how many moved. [`migrate`] does it first.
pub async fn move_from_sqlx_migrations(pool: &PgPool) -> Result<u64, DbError> {
    let moving = async {
        let mut tx = pool.begin().await?;
        lock(&mut tx).await?;
        let moved = move_rows(&mut tx).await?;
        tx.commit().await?;
        Ok(moved)
    };
    moving.await.map_err(DbError::MoveMigrations)
}

/// [`move_from_sqlx_migrations`] in `tx`, which holds the migration locks.
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

#[cfg(test)]
mod tests {
    use sqlx::PgPool;
    use sqlx::migrate::Migrate;

    #[test]
    fn crc32_is_the_zlib_one() {
        assert_eq!(super::crc32(b"123456789"), 0xCBF4_3926, "its check value");
    }

    /// While an application's `sqlx::migrate!` (or an older idem) holds sqlx's
    /// migration lock of a database, idem's migrations wait for it.
    #[sqlx::test(migrations = false)]
    async fn idem_waits_for_the_lock_sqlx_migrators_take(pool: PgPool) {
        let mut holder = pool.acquire().await.unwrap();
        holder.lock().await.unwrap();
        let mut tx = pool.begin().await.unwrap();
        let database: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
            .bind(super::sqlx_lock_id(&database))
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert!(!got, "sqlx's migrator holds it");
        tx.rollback().await.unwrap();
        holder.unlock().await.unwrap();
    }
}
