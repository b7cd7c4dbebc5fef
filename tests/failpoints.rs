//! Crash safety at every failpoint: a worker process aborts at a named point
//! (`IDEM_FAILPOINT`, feature `failpoints`), is restarted, and the outcome is exact.
//! Run with `cargo test --all-features`.

mod common;

use std::time::Duration;

use common::*;
use idem::Mode;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const SETTLE: Duration = Duration::from_secs(90);

/// What the record of `evt-f` says: (status, attempts, dead-lettered); `none` when
/// there is no record (transactional mode writes it only with the outcome).
async fn record(pool: &PgPool) -> (String, i32, bool) {
    sqlx::query_as(
        "SELECT status, attempts, dead_lettered_at IS NOT NULL
         FROM processed_operations WHERE idempotency_key = 'evt-f'",
    )
    .fetch_optional(pool)
    .await
    .unwrap()
    .unwrap_or_else(|| ("none".into(), 0, false))
}

/// Publishes `body` to a worker that aborts at `point`, checks that it died there,
/// restarts a healthy worker and waits until nothing is left in flight.
async fn crash_and_restart(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
    point: &str,
    amount_cents: i64,
) -> (PgPool, TestQueue) {
    crash_and_restart_in(pool_options, connect, point, amount_cents, Mode::Leased).await
}

/// [`crash_and_restart`] with workers in `mode`.
async fn crash_and_restart_in(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
    point: &str,
    amount_cents: i64,
    mode: Mode,
) -> (PgPool, TestQueue) {
    let args = ["--lease-secs", "2", "--mode", mode.as_str()];
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new(&format!("fp-{}-{point}", mode.as_str())).await;
    let url = database_url(&connect);
    let mut crashing =
        spawn_orders_worker_with_env(&url, &q.name, &args, &[("IDEM_FAILPOINT", point)]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    q.publish(&order("evt-f", "acme", amount_cents)).await;
    let status = tokio::time::timeout(SETTLE, crashing.child.wait())
        .await
        .expect("the worker reaches the failpoint")
        .unwrap();
    assert!(!status.success(), "aborted at {point}: {status:?}");
    assert!(crashing.log_contains(&format!("failpoint {point}: aborting")));

    if mode == Mode::Transactional && point != "after-complete" {
        // One transaction: a crash before its commit leaves nothing behind.
        assert_eq!(record(&pool).await.0, "none");
        assert!(ledger(&pool).await.is_empty() && provider_calls(&pool).await.is_empty());
    }
    let _healthy = spawn_orders_worker(&url, &q.name, &args);
    wait_until(SETTLE, "nothing left in flight", || async {
        let processing: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM processed_operations WHERE status = 'processing'",
        )
        .fetch_one(&pool)
        .await
        .unwrap_or(1);
        let (status, _, _) = record(&pool).await;
        processing == 0
            && status != "pending"
            && q.counts(&q.name).await.0 == 0
            && unacked(&q.name).await == 0
    })
    .await;
    (pool, q)
}

async fn assert_booked_once(pool: &PgPool, provider_calls_expected: i64, attempts: i32) {
    wait_until(SETTLE, "the order booked", || async {
        ledger(pool).await.get("evt-f") == Some(&1)
    })
    .await;
    assert_eq!(
        ledger(pool).await.get("evt-f"),
        Some(&1),
        "exactly one ledger row"
    );
    let (calls, keys) = provider_calls(pool).await["evt-f"];
    assert_eq!(
        (calls, keys),
        (provider_calls_expected, 1),
        "provider calls, one key"
    );
    assert_eq!(record(pool).await, ("completed".into(), attempts, false));
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn crash_after_the_claim_commits(o: PgPoolOptions, c: PgConnectOptions) {
    let (pool, q) = crash_and_restart(o, c, "after-claim", 5).await;
    assert_booked_once(&pool, 1, 2).await; // taken over, the handler ran once
    assert_eq!(q.counts(&q.dlq()).await.0, 0);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn crash_after_the_handlers_external_effect(o: PgPoolOptions, c: PgConnectOptions) {
    let (pool, q) = crash_and_restart(o, c, "after-effect", 5).await;
    // The provider was called again with the same key; the ledger row once.
    assert_booked_once(&pool, 2, 2).await;
    assert_eq!(q.counts(&q.dlq()).await.0, 0);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn crash_before_the_completion_commits(o: PgPoolOptions, c: PgConnectOptions) {
    let (pool, q) = crash_and_restart(o, c, "before-commit", 5).await;
    // The crash rolled back the ledger row with the completion; the takeover wrote it.
    assert_booked_once(&pool, 2, 2).await;
    assert_eq!(q.counts(&q.dlq()).await.0, 0);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn crash_after_the_completion_commits_before_the_ack(o: PgPoolOptions, c: PgConnectOptions) {
    let (pool, q) = crash_and_restart(o, c, "after-complete", 5).await;
    // The redelivery found it completed: not run again, attempts stay 1.
    assert_booked_once(&pool, 1, 1).await;
    assert_eq!(q.counts(&q.dlq()).await.0, 0);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn crash_after_the_dead_letter_publish_before_the_ack(o: PgPoolOptions, c: PgConnectOptions) {
    // A negative amount fails for good: dead-lettered, then the worker dies before the
    // ack. The redelivery finds the record failed but not pinned, and dead-letters it
    // again: the DLQ holds the key twice (at least once), never zero times.
    let (pool, q) = crash_and_restart(o, c, "after-publish", -1).await;
    q.wait_for_messages(&q.dlq(), 2, SETTLE).await;
    assert_eq!(record(&pool).await, ("failed".into(), 1, true));
    assert!(ledger(&pool).await.is_empty());
    assert!(
        provider_calls(&pool).await.is_empty(),
        "validation failed before any call"
    );
    let dead = q.drain(&q.dlq()).await;
    assert!(
        dead.iter()
            .all(|d| d.reason.as_deref() == Some("permanent_failure"))
    );
}

/// Transactional mode: a crash anywhere before the batch commits leaves nothing (no
/// record, no effect); after the commit, the redelivery finds it completed. Each
/// intent ends with exactly one of each effect, and one attempt.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn transactional_crash_after_the_handler_ran(o: PgPoolOptions, c: PgConnectOptions) {
    let (pool, q) = crash_and_restart_in(o, c, "after-effect", 5, Mode::Transactional).await;
    assert_booked_once(&pool, 1, 1).await;
    assert_eq!(q.counts(&q.dlq()).await.0, 0);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn transactional_crash_before_the_batch_commits(o: PgPoolOptions, c: PgConnectOptions) {
    let (pool, q) = crash_and_restart_in(o, c, "before-commit", 5, Mode::Transactional).await;
    assert_booked_once(&pool, 1, 1).await;
    assert_eq!(q.counts(&q.dlq()).await.0, 0);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn transactional_crash_after_the_batch_commits(o: PgPoolOptions, c: PgConnectOptions) {
    let (pool, q) = crash_and_restart_in(o, c, "after-complete", 5, Mode::Transactional).await;
    assert_booked_once(&pool, 1, 1).await;
    assert_eq!(q.counts(&q.dlq()).await.0, 0);
}
