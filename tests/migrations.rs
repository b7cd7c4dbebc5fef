//! idem's migrations beside an application's own, in one database: each migrator keeps
//! its own table (`idem_migrations`, `_sqlx_migrations`), so both stay strict, in
//! either order and on every restart; a database an older idem migrated into
//! `_sqlx_migrations` has idem's rows moved, and the application's stay.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

/// An application's own migrations directory (one table), strict as `sqlx::migrate!`
/// is by default, in a directory of the test's own.
struct AppMigrations {
    dir: PathBuf,
}

impl AppMigrations {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("idem-app-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("20260101000000_app_things.sql"),
            "CREATE TABLE app_things (id bigint PRIMARY KEY);",
        )
        .unwrap();
        std::fs::write(
            dir.join("20260102000000_app_more.sql"),
            "ALTER TABLE app_things ADD COLUMN name text;",
        )
        .unwrap();
        Self { dir }
    }

    async fn migrator(&self) -> Migrator {
        Migrator::new(self.dir.as_path()).await.unwrap()
    }

    async fn run(&self, pool: &PgPool) {
        let migrator = self.migrator().await;
        assert!(
            !migrator.ignore_missing,
            "strict, as an application's default"
        );
        migrator
            .run(pool)
            .await
            .unwrap_or_else(|e| panic!("the application's strict migrate: {e}"));
    }
}

impl Drop for AppMigrations {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn versions(pool: &PgPool, table: &str) -> Vec<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM {table} ORDER BY version"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

fn idem_versions() -> Vec<i64> {
    idem::db::MIGRATOR.iter().map(|m| m.version).collect()
}

async fn idem_migrate(pool: &PgPool) {
    idem::db::migrate(pool)
        .await
        .unwrap_or_else(|e| panic!("idem's migrate: {}", idem::text::error_line(&e)));
    idem::db::ensure_migrated(pool).await.unwrap();
}

async fn each_in_its_table(pool: &PgPool) {
    assert_eq!(versions(pool, "idem_migrations").await, idem_versions());
    assert_eq!(
        versions(pool, "_sqlx_migrations").await,
        vec![20260101000000, 20260102000000]
    );
}

#[sqlx::test(migrations = false)]
async fn idem_first_then_the_application_then_both_again(pool: PgPool) {
    let app = AppMigrations::new();
    idem_migrate(&pool).await;
    app.run(&pool).await;
    // Restarts, in both orders.
    idem_migrate(&pool).await;
    app.run(&pool).await;
    app.run(&pool).await;
    idem_migrate(&pool).await;
    each_in_its_table(&pool).await;
}

#[sqlx::test(migrations = false)]
async fn the_application_first_then_idem_then_both_again(pool: PgPool) {
    let app = AppMigrations::new();
    app.run(&pool).await;
    idem_migrate(&pool).await;
    app.run(&pool).await;
    idem_migrate(&pool).await;
    each_in_its_table(&pool).await;
    // And the `idem migrate` command says so.
    let (code, out) = run_idem(&database_url(&pool.connect_options()), &["migrate"]).await;
    assert_eq!(code, 0, "{out}");
    let applied = format!("({} applied)", idem_versions().len());
    assert!(out.contains(&applied), "{out}");
}

/// What an older idem left: its migrations recorded in `_sqlx_migrations`, beside the
/// application's (which had to ignore them with `set_ignore_missing(true)`). This idem
/// moves its own rows once, and the application's strict migrate works again.
#[sqlx::test(migrations = false)]
async fn a_database_an_older_idem_migrated_has_its_records_moved(pool: PgPool) {
    let app = AppMigrations::new();
    // An older idem: the same migrations, recorded in sqlx's default table.
    let older = Migrator::new(Path::new("migrations")).await.unwrap();
    older.run(&pool).await.unwrap();
    let mut lenient = app.migrator().await;
    lenient.set_ignore_missing(true);
    lenient.run(&pool).await.unwrap();
    let mixed = versions(&pool, "_sqlx_migrations").await;
    assert_eq!(mixed.len(), idem_versions().len() + 2);
    // The strict application cannot start on it, as users found.
    assert!(app.migrator().await.run(&pool).await.is_err());

    let moved = idem::db::move_from_sqlx_migrations(&pool).await.unwrap();
    assert_eq!(moved as usize, idem_versions().len());
    each_in_its_table(&pool).await;
    // Once: a second worker finds it done, and both migrators start as usual.
    assert_eq!(idem::db::move_from_sqlx_migrations(&pool).await.unwrap(), 0);
    idem_migrate(&pool).await;
    app.run(&pool).await;
    each_in_its_table(&pool).await;
}
