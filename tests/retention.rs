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
        (20_000, "expired", "now() - interval '1 day'", "NULL, 0"),
        (50, "pinned", "now() - interval '1 day'", "now(), 1"),
        (50, "fresh", "now() + interval '1 day'", "NULL, 0"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO processed_operations
               (scope, operation, idempotency_key, payload_sha256, status, lease_token,
                completed_at, expires_at, dead_lettered_at, dead_letters)
             SELECT 'bulk', 'orders.create', '{prefix}-' || i, repeat('a', 64), 'completed',
                    1, now(), {expires}, {pinned}
             FROM generate_series(1, {n}) AS i"
        )))
        .execute(&pool)
        .await
        .unwrap();
    }

    stage_rows(&pool, "sent", 1_000, true, "now() - interval '1 day'").await;
    stage_rows(&pool, "unsent", 10, false, "").await;

    // An operator's gc holds the lock: both workers skip their rounds.
    let mut operator = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(idem::store::gc::GC_LOCK)
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
        .bind(idem::store::gc::GC_LOCK)
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
    wait_until(SETTLE, "the dispatched follow-ups deleted", || async {
        outbox_count(&pool, "sent").await == 0
    })
    .await;
    assert_eq!(outbox_count(&pool, "unsent").await, 10, "unpublished kept");
    wait_until(SETTLE, "a worker to report its round", || async {
        a.log_contains("deleted=") || b.log_contains("deleted=")
    })
    .await;
}

/// Follow-up messages in the outbox: `n` rows named `<prefix>-i`, dispatched or not,
/// expiring at `expires` (SQL) when dispatched.
async fn stage_rows(pool: &PgPool, prefix: &str, n: i64, dispatched: bool, expires: &str) {
    let (dispatched_at, expires_at) = if dispatched {
        ("now() - interval '8 days'", expires)
    } else {
        ("NULL", "NULL")
    };
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO outbox_messages (message_id, source, operation, position, exchange,
             routing_key, body, properties, staged_at, available_at, dispatched_at, expires_at)
         SELECT '{prefix}-' || i, repeat('b', 64), 'orders.create', 0, '', 'q', '', '{{}}',
                now() - interval '8 days', now() + interval '1 hour', {dispatched_at},
                {expires_at}
         FROM generate_series(1, {n}) AS i"
    )))
    .execute(pool)
    .await
    .unwrap();
}

async fn outbox_count(pool: &PgPool, prefix: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE message_id LIKE $1 || '-%'")
        .bind(prefix)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// `idem gc` removes dispatched follow-ups past their retention in batches, and never a
/// message that was not published, however old.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn gc_deletes_dispatched_follow_ups_and_never_undispatched_ones(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    stage_rows(&pool, "sent", 5_000, true, "now() - interval '1 day'").await;
    stage_rows(&pool, "recent", 50, true, "now() + interval '1 day'").await;
    stage_rows(&pool, "unsent", 50, false, "").await;
    let out = idem_command(
        &database_url(&connect),
        &["gc", "--batch", "1000", "--duty", "1"],
    )
    .output()
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("deleted 5000 expired follow-ups"),
        "{stdout}"
    );
    assert_eq!(outbox_count(&pool, "sent").await, 0);
    assert_eq!(outbox_count(&pool, "recent").await, 50, "not expired yet");
    assert_eq!(
        outbox_count(&pool, "unsent").await,
        50,
        "never published: kept"
    );
}

/// `idem gc` deletes the console's per-minute delivery counts after the retention, and
/// only those.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn gc_deletes_delivery_counts_past_their_retention(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    // Two minutes of counts as workers flush them: one queue's past its retention, the
    // other's not.
    for (queue, expires) in [
        ("gone", "now() - interval '1 minute'"),
        ("kept", "now() + interval '1 hour'"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO delivery_outcomes (minute, queue, operation, outcome, deliveries, expires_at)
             SELECT date_trunc('minute', now()), $1, 'jobs', outcome, 1, {expires}
             FROM unnest(ARRAY['executed', 'dead_lettered']) AS outcome"
        )))
        .bind(queue)
        .execute(&pool)
        .await
        .unwrap();
    }
    let (code, stdout) = run_idem(&database_url(&connect), &["gc", "--duty", "1"]).await;
    assert_eq!(code, 0, "{stdout}");
    assert!(stdout.contains("deleted 2 expired outcomes"), "{stdout}");
    let queues: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT queue FROM delivery_outcomes ORDER BY queue")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(queues, ["kept"]);
}
