//! Retention (docs/DESIGN.md, "Retention"): workers collect garbage in the background,
//! one process at a time, and never touch pinned or unexpired records. Against the
//! real database, with worker processes.

mod common;

use std::time::Duration;

use common::*;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const SETTLE: Duration = Duration::from_secs(90);

async fn count(pool: &PgPool, prefix: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM processed_operations WHERE idempotency_key LIKE $1 || '-%'",
    )
    .bind(prefix)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn background_gc_runs_in_one_process_at_a_time_and_spares_pinned_and_fresh_records(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    for (n, prefix, expires, pinned) in [
        (20_000, "expired", "now() - interval '1 day'", "NULL"),
        (50, "pinned", "now() - interval '1 day'", "now()"),
        (50, "fresh", "now() + interval '1 day'", "NULL"),
    ] {
        sqlx::query(&format!(
            "INSERT INTO processed_operations
               (scope, operation, idempotency_key, payload_sha256, status, lease_token,
                completed_at, expires_at, dead_lettered_at)
             SELECT 'bulk', 'orders.create', '{prefix}-' || i, repeat('a', 64), 'completed',
                    1, now(), {expires}, {pinned}
             FROM generate_series(1, {n}) AS i"
        ))
        .execute(&pool)
        .await
        .unwrap();
    }

    // An operator's gc holds the lock: both workers skip their rounds.
    let mut operator = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(idem::store::GC_LOCK)
        .execute(&mut *operator)
        .await
        .unwrap();
    let (qa, qb) = (TestQueue::new("gc-a").await, TestQueue::new("gc-b").await);
    let a = spawn_orders_worker(&url, &qa.name, &["--gc-every-secs", "1"]);
    let b = spawn_orders_worker(&url, &qb.name, &["--gc-every-secs", "1"]);
    let skipped = "garbage collection skipped: another process holds the gc lock";
    wait_until(SETTLE, "both workers to skip a round", || async {
        a.log_contains(skipped) && b.log_contains(skipped)
    })
    .await;
    assert_eq!(
        count(&pool, "expired").await,
        20_000,
        "nothing deleted meanwhile"
    );

    // Released: one of them collects; the other skips while it does.
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(idem::store::GC_LOCK)
        .execute(&mut *operator)
        .await
        .unwrap();
    drop(operator);
    wait_until(SETTLE, "the expired records deleted", || async {
        count(&pool, "expired").await == 0
    })
    .await;
    assert_eq!(count(&pool, "pinned").await, 50, "pinned records kept");
    assert_eq!(count(&pool, "fresh").await, 50, "unexpired records kept");
    wait_until(SETTLE, "a worker to report its round", || async {
        a.log_contains("deleted=") || b.log_contains("deleted=")
    })
    .await;
}
