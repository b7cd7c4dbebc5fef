//! Crash safety at every failpoint: a worker process aborts at a named point
//! (`IDEM_FAILPOINT`, feature `failpoints`), is restarted, and the outcome is exact.
//! Run with `cargo test --all-features`.

mod common;

use std::time::Duration;

use common::*;
use idem::Mode;
use serde_json::{Value, json};
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
    // Each letter pinned the record before it was published, the one the crash left
    // too: a replay of one cannot unpin the record while the other waits.
    let pinned: i32 = sqlx::query_scalar(
        "SELECT dead_letters FROM processed_operations WHERE idempotency_key = 'evt-f'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(pinned as usize, dead.len());
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

/// The follow-up queue's messages: (message_id, body).
async fn follow_ups(out: &TestQueue) -> Vec<(String, Value)> {
    out.drain(&out.name)
        .await
        .into_iter()
        .map(|m| {
            let id = m
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string());
            (id.unwrap_or_default(), body_json(&m.delivery.data))
        })
        .collect()
}

/// The staged follow-up of `evt-f`: its message id, and whether it is dispatched.
async fn staged(pool: &PgPool) -> Option<(String, bool)> {
    sqlx::query_as("SELECT message_id, dispatched_at IS NOT NULL FROM outbox_messages")
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// Starts a worker with `args` that aborts at `point`, publishes `evt-f` and waits for
/// the abort.
async fn crash_at(pool: &PgPool, url: &str, q: &TestQueue, args: &[&str], point: &str) {
    let mut crashing =
        spawn_orders_worker_with_env(url, &q.name, args, &[("IDEM_FAILPOINT", point)]);
    wait_for_worker_tables(pool).await;
    wait_for_consumers(q, 1).await;
    q.publish(&order("evt-f", "acme", 5)).await;
    let status = tokio::time::timeout(SETTLE, crashing.child.wait())
        .await
        .expect("the worker reaches the failpoint")
        .unwrap();
    assert!(!status.success(), "aborted at {point}: {status:?}");
}

/// A worker dies after the booking (and its follow-up) committed, before it published
/// the follow-up: another process's relay publishes it, once, with the staged id.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn crash_between_the_commit_and_the_follow_ups_publish(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let url = database_url(&c);
    let q = TestQueue::new("fp-before-dispatch").await;
    let out = q.beside("notify").await;
    let args = ["--follow-ups", out.name.as_str()];
    crash_at(&pool, &url, &q, &args, "before-dispatch").await;
    let (id, dispatched) = staged(&pool).await.expect("the follow-up committed");
    assert!(!dispatched);
    assert_eq!(
        out.counts(&out.name).await.0,
        0,
        "nothing published before the crash"
    );

    let _healthy = spawn_orders_worker(&url, &q.name, &args);
    out.wait_for_messages(&out.name, 1, SETTLE).await;
    wait_until(SETTLE, "marked dispatched", || async {
        staged(&pool).await.is_some_and(|(_, d)| d)
    })
    .await;
    let published = follow_ups(&out).await;
    assert_eq!(published.len(), 1, "published once");
    assert_eq!(published[0].0, id, "with the staged id");
    assert_eq!(published[0].1["event_id"], json!(id));
    assert_eq!(published[0].1["order_event_id"], json!("evt-f"));
    assert_booked_once(&pool, 1, 1).await;
}

/// A worker dies after the broker confirmed the follow-up, before it marked it
/// dispatched: when its lease on the row ends, a relay publishes it again. Both copies
/// carry the same id, and the downstream idem worker notifies once.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn crash_between_the_follow_ups_confirm_and_its_mark(o: PgPoolOptions, c: PgConnectOptions) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let url = database_url(&c);
    let q = TestQueue::new("fp-before-mark").await;
    let out = q.beside("notify").await;
    let args = [
        "--follow-ups",
        out.name.as_str(),
        "--outbox-lease-secs",
        "1",
    ];
    crash_at(&pool, &url, &q, &args, "before-dispatch-mark").await;
    assert_eq!(staged(&pool).await.map(|(_, d)| d), Some(false));

    let mut healthy = spawn_orders_worker(&url, &q.name, &args);
    out.wait_for_messages(&out.name, 2, SETTLE).await;
    wait_until(SETTLE, "marked dispatched", || async {
        staged(&pool).await.is_some_and(|(_, d)| d)
    })
    .await;
    signal(&healthy, "TERM");
    let _ = tokio::time::timeout(SETTLE, healthy.child.wait()).await;
    // At least twice: the crashed worker's copy and the relay's. A relay whose confirm
    // takes longer than half the 1 s lease (a loaded machine) leaves the row taken and
    // publishes it once more when the lease ends, which the contract allows.
    let copies = follow_ups(&out).await;
    assert!(copies.len() >= 2, "published again: {copies:?}");
    assert!(
        copies.iter().all(|c| c.0 == copies[0].0),
        "with one id: {copies:?}"
    );
    assert!(
        copies.iter().all(|c| c.1 == copies[0].1),
        "and one body: {copies:?}"
    );

    // The downstream consumer sees both copies and notifies once.
    for (id, body) in &copies {
        let bytes = serde_json::to_vec(body).unwrap();
        out.publish_with_id(&bytes, id).await;
    }
    let _downstream = spawn_notifications_worker(&url, &out.name);
    wait_until(SETTLE, "every copy consumed", || async {
        notifications(&pool).await.get("evt-f") == Some(&1)
            && out.counts(&out.name).await.0 == 0
            && unacked(&out.name).await == 0
    })
    .await;
    assert_eq!(notifications(&pool).await.get("evt-f"), Some(&1));
    let (status, attempts): (String, i32) = sqlx::query_as(
        "SELECT status, attempts FROM processed_operations WHERE operation = 'notifications.send'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), attempts), ("completed", 1));
}
