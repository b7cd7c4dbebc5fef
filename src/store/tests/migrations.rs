//! The schema: an upgrade keeps the fingerprint rule, workers starting together
//! migrate one database.

use serde_json::json;
use sqlx::PgPool;

use super::*;

/// The schema's fingerprint rule: 64 lowercase hex digits, on a database migrated in
/// two steps (rows written before the cheaper check arrived are validated by it).
#[sqlx::test(migrations = false)]
async fn the_fingerprint_check_keeps_its_rule_across_the_upgrade(pool: PgPool) {
    // The schema as the first two migrations left it, with records in it.
    let dir = std::env::temp_dir().join(format!("idem-migrations-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in [
        "20261130000001_processed_operations.sql",
        "20261130000002_operate.sql",
    ] {
        let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        std::fs::copy(from.join(name), dir.join(name)).unwrap();
    }
    let before = sqlx::migrate::Migrator::new(dir.as_path()).await;
    // The migrator holds the files' text: the directory goes before anything can fail.
    std::fs::remove_dir_all(&dir).unwrap();
    before.unwrap().run(&pool).await.unwrap();
    // Written as that schema's code wrote them (today's claim needs today's schema).
    for i in 0..3 {
        sqlx::query(
            "INSERT INTO processed_operations
               (scope, operation, idempotency_key, payload_sha256, status, lease_token)
             VALUES ('t', 'op', $1, $2, 'processing', 1)",
        )
        .bind(format!("old-{i}"))
        .bind(Fingerprint::of(&json!({"n": i}), &[]).as_hex())
        .execute(&pool)
        .await
        .unwrap();
    }

    crate::db::MIGRATOR.run(&pool).await.unwrap();
    let validated: bool = sqlx::query_scalar(
        "SELECT convalidated FROM pg_constraint
         WHERE conname = 'processed_operations_payload_sha256_check'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(validated, "the old rows were validated by the new check");

    let insert = |fingerprint: String| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO processed_operations
                   (scope, operation, idempotency_key, payload_sha256, status, lease_token)
                 VALUES ('t', 'op', md5(random()::text), $1, 'processing', 1)",
            )
            .bind(fingerprint)
            .execute(&pool)
            .await
        }
    };
    let hex = "0123456789abcdef".repeat(4);
    assert!(insert(hex.clone()).await.is_ok());
    let refused = [
        hex[..63].to_owned(),       // too short
        format!("{hex}0"),          // too long
        hex.to_uppercase(),         // not lowercase
        format!("{}g", &hex[..63]), // not hex
        format!("{}é", &hex[..62]), // 64 bytes, 63 characters
        format!("{} ", &hex[..63]), // whitespace
    ];
    for fingerprint in refused {
        let error = insert(fingerprint.clone()).await.unwrap_err();
        let code = error
            .as_database_error()
            .and_then(|e| e.code())
            .map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("23514"), "{fingerprint:?}: {error}");
    }
}

/// Workers that start together against a database that does not exist yet all create it
/// and migrate it: the losers of the `CREATE DATABASE` race (42P04, or 23505 when the
/// creates ran at the same moment) go on, none fails.
#[tokio::test]
async fn workers_starting_together_create_and_migrate_one_database() {
    use sqlx::ConnectOptions;
    use std::str::FromStr;
    let server = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let name = format!(
        "idem_race_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let options = sqlx::postgres::PgConnectOptions::from_str(&server).unwrap();
    let url = options.clone().database(&name).to_url_lossy().to_string();
    let starts = (0..6).map(|_| {
        let url = url.clone();
        tokio::spawn(async move { crate::db::connect_and_migrate(&url, 2).await })
    });
    let results = futures_util::future::join_all(starts).await;
    let mut admin = options.database("postgres").connect().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    for result in results {
        let pool = result.unwrap().map_err(|e| crate::text::error_line(&e));
        assert!(pool.is_ok(), "{pool:?}");
    }
}
