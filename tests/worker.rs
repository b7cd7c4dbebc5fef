//! The worker against real RabbitMQ and Postgres: a unique queue and database per test.
//! Worker processes are the `orders_worker` example; in-process workers run test handlers.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use idem::{Context, Handler, HandlerError, RetryPolicy, Store, StoreConfig, Worker, WorkerConfig};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

const SETTLE: Duration = Duration::from_secs(90);

/// Waits until every event has its ledger row and the queues are empty, then returns.
async fn wait_settled(pool: &PgPool, q: &TestQueue, events: usize) {
    wait_until(SETTLE, &format!("{events} events booked"), || async {
        ledger(pool).await.len() == events
    })
    .await;
    wait_until(SETTLE, "the queue drained", || async {
        let (ready, _) = q.counts(&q.name).await;
        let unsettled: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM processed_operations WHERE status = 'processing'",
        )
        .fetch_one(pool)
        .await
        .unwrap_or(1);
        ready == 0 && unsettled == 0
    })
    .await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn duplicates_interleaved_book_each_event_exactly_once(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("duplicates").await;
    let _worker = spawn_orders_worker(&database_url(&connect), &q.name, &["--concurrency", "8"]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;

    const EVENTS: usize = 150;
    let mut bodies = Vec::new();
    for i in 0..EVENTS {
        let event = format!("evt-{i}");
        bodies.push(order(&event, "acme", 100 + i as i64));
        for _ in 0..(i % 4) {
            bodies.push(order_resent(&event, "acme", 100 + i as i64));
        }
    }
    let published = bodies.len();
    // Interleave deterministically: duplicates land before, beside and after originals.
    let mut order_ix: Vec<usize> = (0..published).collect();
    order_ix.sort_by_key(|i| (i * 7919) % published);
    for i in order_ix {
        q.publish(&bodies[i]).await;
    }
    wait_settled(&pool, &q, EVENTS).await;

    let ledger = ledger(&pool).await;
    assert_eq!(ledger.len(), EVENTS, "no event missing");
    assert!(
        ledger.values().all(|n| *n == 1),
        "one ledger row per event: {ledger:?}"
    );
    let calls = provider_calls(&pool).await;
    assert_eq!(calls.len(), EVENTS);
    assert!(calls.values().all(|(n, keys)| *n == 1 && *keys == 1));
    assert_eq!(
        statuses(&pool).await.get("completed"),
        Some(&(EVENTS as i64))
    );
    assert_eq!(q.counts(&q.dlq()).await.0, 0, "nothing dead-lettered");
    println!(
        "duplicates: published {published} messages for {EVENTS} events, ledger rows {}",
        ledger.values().sum::<i64>()
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn same_event_with_another_amount_is_dead_lettered_as_conflict(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("conflict").await;
    let _worker = spawn_orders_worker(&database_url(&connect), &q.name, &[]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;

    q.publish(&order("evt-c", "acme", 500)).await;
    wait_settled(&pool, &q, 1).await;
    let changed = order("evt-c", "acme", 999);
    q.publish(&changed).await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;

    let dead = q.drain(&q.dlq()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason.as_deref(), Some("fingerprint_conflict"));
    assert_eq!(dead[0].original_queue.as_deref(), Some(q.name.as_str()));
    assert_eq!(dead[0].key.as_deref(), Some("evt-c"));
    assert!(dead[0].failed_at.is_some());
    assert_eq!(dead[0].delivery.data, changed, "original body kept");
    let amounts: Vec<i64> = sqlx::query_scalar("SELECT amount_cents FROM example_ledger")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(amounts, vec![500], "ledger unchanged");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn malformed_messages_are_dead_lettered_and_the_worker_goes_on(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("malformed").await;
    let _worker = spawn_orders_worker(&database_url(&connect), &q.name, &[]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;

    let kinds: Vec<(&str, Vec<u8>)> = vec![
        ("not json", b"this is not json".to_vec()),
        ("not utf-8", vec![0xff, 0xfe, 0x00, 0x01]),
        ("empty body", Vec::new()),
        ("not an object", b"[1,2,3]".to_vec()),
        ("a string", br#""evt-1""#.to_vec()),
        (
            "no key field",
            br#"{"tenant":"acme","order_id":"1","amount_cents":1}"#.to_vec(),
        ),
        (
            "key of the wrong type",
            br#"{"event_id":42,"tenant":"acme","order_id":"1","amount_cents":1}"#.to_vec(),
        ),
        (
            "empty key",
            br#"{"event_id":"","tenant":"acme","order_id":"1","amount_cents":1}"#.to_vec(),
        ),
        (
            "oversized key",
            format!(
                r#"{{"event_id":"{}","tenant":"acme","order_id":"1","amount_cents":1}}"#,
                "k".repeat(600)
            )
            .into_bytes(),
        ),
    ];
    for (_, body) in &kinds {
        q.publish(body).await;
    }
    q.publish(&order("evt-after", "acme", 1)).await;
    wait_settled(&pool, &q, 1).await;
    q.wait_for_messages(&q.dlq(), kinds.len() as u32, SETTLE)
        .await;

    let dead = q.drain(&q.dlq()).await;
    assert_eq!(dead.len(), kinds.len());
    for d in &dead {
        assert_eq!(d.reason.as_deref(), Some("malformed"), "{d:?}");
        assert!(d.error.as_deref().is_some_and(|e| !e.is_empty()));
        assert_eq!(d.attempts, Some(0));
    }
    let mut bodies: Vec<_> = dead.iter().map(|d| d.delivery.data.clone()).collect();
    let mut sent: Vec<_> = kinds.iter().map(|(_, b)| b.clone()).collect();
    bodies.sort();
    sent.sort();
    assert_eq!(bodies, sent, "every malformed body kept as sent");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1, "malformed messages leave no record");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn permanent_failure_is_dead_lettered_at_once(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("permanent").await;
    let _worker = spawn_orders_worker(&database_url(&connect), &q.name, &[]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;

    q.publish(&order("evt-neg", "acme", -5)).await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    // A late duplicate of a failure for good is acked, not run and not dead-lettered again.
    q.publish(&order_resent("evt-neg", "acme", -5)).await;
    q.publish(&order("evt-ok", "acme", 5)).await;
    wait_settled(&pool, &q, 1).await;

    let dead = q.drain(&q.dlq()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason.as_deref(), Some("permanent_failure"));
    assert_eq!(dead[0].error.as_deref(), Some("invalid amount"));
    assert_eq!(dead[0].attempts, Some(1));
    let record: (String, bool, i32, bool) = sqlx::query_as(
        "SELECT status, retryable, attempts, dead_lettered_at IS NOT NULL
         FROM processed_operations WHERE idempotency_key = 'evt-neg'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(record, ("failed".into(), false, 1, true));
    assert!(!ledger(&pool).await.contains_key("evt-neg"));
}

/// A handler that fails transiently a number of times per event, then books once.
#[derive(Clone)]
struct Flaky {
    failures: usize,
    seen: Arc<Mutex<HashMap<String, usize>>>,
}

#[derive(Deserialize)]
struct Job {
    event_id: String,
}

impl Handler for Flaky {
    type Message = Job;
    type Output = Value;
    const OPERATION: &'static str = "jobs.flaky";

    fn scope(&self, _: &Job) -> String {
        "tests".into()
    }

    fn idempotency_key(&self, job: &Job) -> String {
        job.event_id.clone()
    }

    async fn handle(&self, job: Job, ctx: &mut Context) -> Result<Value, HandlerError> {
        let runs = {
            let mut seen = self.seen.lock().unwrap();
            let runs = seen.entry(job.event_id.clone()).or_default();
            *runs += 1;
            *runs
        };
        // Written in the transaction: a failed run must leave nothing behind.
        sqlx::query("INSERT INTO effects (event_id, run) VALUES ($1, $2)")
            .bind(&job.event_id)
            .bind(runs as i32)
            .execute(ctx.tx().await.map_err(HandlerError::transient)?)
            .await
            .map_err(HandlerError::transient)?;
        if runs <= self.failures {
            return Err(HandlerError::transient(format!("flaky run {runs}")));
        }
        Ok(json!({"runs": runs}))
    }
}

async fn start_in_process<H: Handler>(
    pool: &PgPool,
    q: &TestQueue,
    handler: H,
    lease: Duration,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<Result<(), idem::WorkerError>>,
) {
    let (shutdown, task) = start_configured(pool, q, handler, lease, |_| {});
    wait_for_consumers(q, 1).await;
    (shutdown, task)
}

/// [`start_in_process`] with settings of the test's own, not waiting for its consumer.
fn start_configured<H: Handler>(
    pool: &PgPool,
    q: &TestQueue,
    handler: H,
    lease: Duration,
    edit: impl FnOnce(&mut WorkerConfig),
) -> (
    CancellationToken,
    tokio::task::JoinHandle<Result<(), idem::WorkerError>>,
) {
    let store = Store::new(
        pool.clone(),
        StoreConfig {
            lease,
            ..StoreConfig::default()
        },
    );
    let config = WorkerConfig {
        amqp_url: amqp_url(),
        queue: q.name.clone(),
        concurrency: 4,
        prefetch: 8,
        retry: RetryPolicy {
            immediate: 2,
            min_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
            delays: common::RETRY_DELAYS_MS[..2]
                .iter()
                .map(|&ms| Duration::from_millis(ms))
                .collect(),
        },
        shutdown_timeout: Duration::from_secs(10),
        ..WorkerConfig::default()
    };
    let mut config = config;
    edit(&mut config);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(Worker::new(handler, store, config).run(shutdown.clone()));
    (shutdown, task)
}

/// The deliveries of `queue` by outcome, as the workers tallied them for the console.
async fn outcomes(pool: &PgPool, queue: &str) -> HashMap<String, i64> {
    let now = chrono::Utc::now();
    let hour = chrono::Duration::hours(1);
    idem::tally::per_minute(pool, &[queue.to_owned()], now - hour, now + hour)
        .await
        .unwrap()
        .into_iter()
        .fold(HashMap::new(), |mut by, row| {
            *by.entry(row.outcome).or_default() += row.deliveries;
            by
        })
}

async fn effects(pool: &PgPool, event: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = $1")
        .bind(event)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn transient_failures_retry_until_success_or_exhaustion(pool: PgPool) {
    sqlx::query("CREATE TABLE effects (event_id text NOT NULL, run int NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let q = TestQueue::new("transient").await;
    // 4 failures: 3 runs in process fail, the first delayed retry fails once more, then
    // succeeds. With 100 failures every run fails: 3 runs x (1 + 2 delayed) = 9 claims.
    let sometimes = Flaky {
        failures: 4,
        seen: Arc::default(),
    };
    let (shutdown, task) =
        start_in_process(&pool, &q, sometimes.clone(), Duration::from_secs(10)).await;
    q.publish(br#"{"event_id":"evt-eventually"}"#).await;
    wait_until(SETTLE, "the flaky job to complete", || async {
        effects(&pool, "evt-eventually").await == 1
    })
    .await;
    // A duplicate publish is acked without running, and counted as such for the
    // console by the worker's next periodic flush (every 5 s), before any shutdown.
    q.publish(br#"{"event_id":"evt-eventually"}"#).await;
    wait_until(SETTLE, "the duplicate tallied", || async {
        outcomes(&pool, &q.name).await.get("duplicate_completed") == Some(&1)
    })
    .await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
    let tallied = outcomes(&pool, &q.name).await;
    assert_eq!(tallied["executed"], 1, "{tallied:?}");
    assert_eq!(
        tallied["failed_transient"], 1,
        "one delayed retry: {tallied:?}"
    );
    let record: (String, i32) = sqlx::query_as(
        "SELECT status, attempts FROM processed_operations WHERE idempotency_key = 'evt-eventually'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(record, ("completed".into(), 5));
    assert_eq!(sometimes.seen.lock().unwrap()["evt-eventually"], 5);

    let always = Flaky {
        failures: 100,
        seen: Arc::default(),
    };
    let (shutdown, task) =
        start_in_process(&pool, &q, always.clone(), Duration::from_secs(10)).await;
    q.publish(br#"{"event_id":"evt-never"}"#).await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
    let dead = q.drain(&q.dlq()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason.as_deref(), Some("retries_exhausted"));
    assert_eq!(dead[0].attempts, Some(9));
    assert_eq!(dead[0].error.as_deref(), Some("flaky run 9"));
    assert_eq!(always.seen.lock().unwrap()["evt-never"], 9);
    // Counted per delivery, the last ones by the flush at shutdown: two delayed retries
    // more, then the exhausted one, dead-lettered.
    let tallied = outcomes(&pool, &q.name).await;
    assert_eq!(tallied["failed_transient"], 3, "{tallied:?}");
    assert_eq!(tallied["retries_exhausted"], 1, "{tallied:?}");
    assert_eq!(tallied["dead_lettered"], 1, "{tallied:?}");
    assert_eq!(tallied["executed"], 1, "{tallied:?}");
    assert_eq!(tallied.len(), 5, "no other outcome: {tallied:?}");
    assert_eq!(
        effects(&pool, "evt-never").await,
        0,
        "failed runs rolled back"
    );
    let record: (String, bool, i32) = sqlx::query_as(
        "SELECT status, retryable, attempts FROM processed_operations WHERE idempotency_key = 'evt-never'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(record, ("failed".into(), true, 9));
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn worker_killed_between_provider_call_and_completion_books_once(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("sigkill").await;
    let url = database_url(&connect);
    let mut first = spawn_orders_worker(
        &url,
        &q.name,
        &["--lease-secs", "2", "--provider-delay-ms", "60000"],
    );
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;

    q.publish(&order("evt-kill", "acme", 42)).await;
    wait_until(SETTLE, "the provider call", || async {
        provider_calls(&pool).await.contains_key("evt-kill")
    })
    .await;
    signal(&first, "KILL");
    first.child.wait().await.unwrap();
    assert!(
        ledger(&pool).await.is_empty(),
        "killed before the ledger write committed"
    );

    let _second = spawn_orders_worker(&url, &q.name, &["--lease-secs", "2"]);
    wait_settled(&pool, &q, 1).await;

    assert_eq!(ledger(&pool).await.get("evt-kill"), Some(&1));
    let (calls, keys) = provider_calls(&pool).await["evt-kill"];
    assert_eq!(
        (calls, keys),
        (2, 1),
        "the retry repeated the same provider request"
    );
    let record: (String, i32) = sqlx::query_as(
        "SELECT status, attempts FROM processed_operations WHERE idempotency_key = 'evt-kill'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        record,
        ("completed".into(), 2),
        "taken over after the lease lapsed"
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_zombie_that_outlives_its_lease_is_rolled_back(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("zombie").await;
    let url = database_url(&connect);
    // The zombie: stopped (SIGSTOP) after its provider call, so its heartbeats stop too.
    let zombie = spawn_orders_worker(
        &url,
        &q.name,
        &["--lease-secs", "2", "--provider-delay-ms", "1500"],
    );
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    q.publish(&order("evt-zombie", "acme", 7)).await;
    wait_until(SETTLE, "the zombie's provider call", || async {
        provider_calls(&pool).await.contains_key("evt-zombie")
    })
    .await;
    signal(&zombie, "STOP");

    // A healthy worker gets a resend and takes over once the lease lapses. It consumes
    // another queue on the same database: on the zombie's queue the broker would hand
    // half the deliveries to the stopped zombie.
    let other = TestQueue::new("zombie-healthy").await;
    let _healthy = spawn_orders_worker(&url, &other.name, &["--lease-secs", "2"]);
    wait_for_consumers(&other, 1).await;
    other.publish(&order_resent("evt-zombie", "acme", 7)).await;
    wait_until(SETTLE, "the takeover to book", || async {
        ledger(&pool).await.get("evt-zombie") == Some(&1)
    })
    .await;

    // The zombie wakes up, writes its ledger row in its transaction, and is refused.
    signal(&zombie, "CONT");
    wait_until(
        SETTLE,
        "the zombie to be told it lost its lease",
        || async { zombie.log_contains("lease lost") },
    )
    .await;
    wait_until(SETTLE, "every message settled", || async {
        q.counts(&q.name).await.0 == 0
    })
    .await;
    assert_eq!(
        ledger(&pool).await.get("evt-zombie"),
        Some(&1),
        "the zombie's write was rolled back"
    );
    let (calls, keys) = provider_calls(&pool).await["evt-zombie"];
    assert_eq!((calls, keys), (2, 1));
    let attempts: i32 = sqlx::query_scalar(
        "SELECT attempts FROM processed_operations WHERE idempotency_key = 'evt-zombie'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(attempts, 2);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn two_worker_processes_on_one_queue_book_each_event_once(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("two-workers").await;
    let url = database_url(&connect);
    let _a = spawn_orders_worker(&url, &q.name, &["--concurrency", "4"]);
    let _b = spawn_orders_worker(&url, &q.name, &["--concurrency", "4"]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 2).await;

    const EVENTS: usize = 200;
    for i in 0..EVENTS {
        let event = format!("evt-{i}");
        q.publish(&order(&event, "acme", 1)).await;
        q.publish(&order_resent(&event, "acme", 1)).await;
        if i % 3 == 0 {
            q.publish(&order_resent(&event, "acme", 1)).await;
        }
    }
    wait_settled(&pool, &q, EVENTS).await;
    let ledger = ledger(&pool).await;
    assert_eq!(ledger.len(), EVENTS);
    assert!(ledger.values().all(|n| *n == 1), "{ledger:?}");
    let owners: i64 = sqlx::query_scalar("SELECT count(DISTINCT owner) FROM processed_operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(owners, 2, "both workers took part");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn broker_connection_closed_under_load_loses_and_repeats_nothing(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("conn-drop").await;
    let worker = spawn_orders_worker(
        &database_url(&connect),
        &q.name,
        &["--provider-delay-ms", "5"],
    );
    let pid = worker.pid();
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;

    const EVENTS: usize = 400;
    for i in 0..EVENTS {
        let event = format!("evt-{i}");
        q.publish(&order(&event, "acme", 1)).await;
        if i % 2 == 0 {
            q.publish(&order_resent(&event, "acme", 1)).await;
        }
    }
    let mut drops = 0;
    for _ in 0..2 {
        wait_until(SETTLE, "some progress", || async {
            ledger(&pool).await.len() >= (drops + 1) * EVENTS / 4
        })
        .await;
        let closed =
            tokio::task::spawn_blocking(move || close_broker_connections_of("orders_worker", pid))
                .await
                .unwrap();
        assert!(closed >= 1, "closed the worker's connection");
        drops += 1;
    }
    wait_settled(&pool, &q, EVENTS).await;
    let ledger = ledger(&pool).await;
    assert_eq!(ledger.len(), EVENTS, "none lost");
    assert!(ledger.values().all(|n| *n == 1), "none doubled");
    assert!(
        provider_calls(&pool)
            .await
            .values()
            .all(|(_, keys)| *keys == 1)
    );
    println!(
        "connection drops: {drops}, events {EVENTS}, ledger rows {}",
        ledger.values().sum::<i64>()
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn postgres_connections_terminated_under_load_lose_and_repeat_nothing(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("pg-drop").await;
    let url = format!(
        "{}?application_name=idem_worker_under_test",
        database_url(&connect)
    );
    let _worker = spawn_orders_worker(&url, &q.name, &["--provider-delay-ms", "5"]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;

    const EVENTS: usize = 300;
    for i in 0..EVENTS {
        q.publish(&order(&format!("evt-{i}"), "acme", 1)).await;
    }
    let mut killed = 0;
    for round in 1..=2 {
        wait_until(SETTLE, "some progress", || async {
            ledger(&pool).await.len() >= round * EVENTS / 4
        })
        .await;
        killed += sqlx::query_scalar::<_, i64>(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = 'idem_worker_under_test'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
    }
    assert!(killed >= 1, "terminated the worker's backends");
    wait_settled(&pool, &q, EVENTS).await;
    let ledger = ledger(&pool).await;
    assert_eq!(ledger.len(), EVENTS, "none lost");
    assert!(ledger.values().all(|n| *n == 1), "none doubled");
    println!("backends terminated: {killed}, events {EVENTS}");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn sigterm_lets_handlers_in_flight_finish_and_exits_zero(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("sigterm").await;
    let mut worker = spawn_orders_worker(
        &database_url(&connect),
        &q.name,
        &[
            "--provider-delay-ms",
            "1500",
            "--concurrency",
            "3",
            "--prefetch",
            "5",
        ],
    );
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    const EVENTS: usize = 10;
    for i in 0..EVENTS {
        q.publish(&order(&format!("evt-{i}"), "acme", 1)).await;
    }
    wait_until(SETTLE, "three handlers in flight", || async {
        provider_calls(&pool).await.len() == 3
    })
    .await;
    signal(&worker, "TERM");
    let status = tokio::time::timeout(Duration::from_secs(30), worker.child.wait())
        .await
        .expect("worker exits after its handlers finish")
        .unwrap();
    assert_eq!(status.code(), Some(0));

    let ledger = ledger(&pool).await;
    assert_eq!(ledger.len(), 3, "the handlers in flight finished");
    let records = statuses(&pool).await;
    assert_eq!(records.get("completed"), Some(&3));
    assert_eq!(records.get("processing"), None, "nothing left processing");
    // The rest went back to the queue, nothing is left unacked.
    q.wait_for_messages(&q.name, (EVENTS - 3) as u32, Duration::from_secs(10))
        .await;
}

/// `AMQP_URL` may list cluster nodes: a dead first node costs a refused connection, and
/// the worker consumes through the next one.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_node_list_with_a_dead_first_node_connects_to_the_next(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("node-list").await;
    let nodes = format!("amqp://guest:guest@127.0.0.1:1/%2f, {}", amqp_url());
    let worker = spawn_orders_worker_with_env(
        &database_url(&connect),
        &q.name,
        &[],
        &[("AMQP_URL", nodes.as_str())],
    );
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    q.publish(&order("evt-node", "acme", 1)).await;
    wait_settled(&pool, &q, 1).await;
    assert_eq!(ledger(&pool).await.get("evt-node"), Some(&1));
    assert!(worker.log_contains("broker node did not answer; trying the next"));
}

/// A broker that closes every connection soon after it opened (a refusal it repeats, a
/// node that keeps failing): the worker's pauses between connections grow, instead of
/// starting again from 100 ms after each one that got as far as consuming.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn connections_the_broker_keeps_closing_are_retried_less_and_less_often(pool: PgPool) {
    let q = TestQueue::new("dying-young").await;
    let uri: lapin::uri::AMQPUri = amqp_url().parse().unwrap();
    let broker = tokio::net::lookup_host((uri.authority.host.as_str(), uri.authority.port))
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = common::proxy::Proxy::closing_after(broker, Duration::from_millis(300)).await;
    let mut through_proxy = uri.clone();
    through_proxy.authority.host = "127.0.0.1".into();
    through_proxy.authority.port = proxy.port;
    let config = WorkerConfig {
        amqp_url: through_proxy.to_string(),
        queue: q.name.clone(),
        max_reconnect_delay: Duration::from_secs(5),
        // The delays TestQueue's cleanup deletes the retry queues of.
        retry: RetryPolicy {
            delays: RETRY_DELAYS_MS.map(Duration::from_millis).to_vec(),
            ..RetryPolicy::default()
        },
        outbox: idem::outbox::OutboxConfig {
            relay: false,
            ..idem::outbox::OutboxConfig::default()
        },
        ..WorkerConfig::default()
    };
    let handler = Flaky {
        failures: 0,
        seen: Arc::default(),
    };
    let store = Store::new(pool.clone(), StoreConfig::default());
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(Worker::new(handler, store, config).run(shutdown.clone()));
    wait_until(SETTLE, "three connections", || async {
        proxy.accepted() >= 3
    })
    .await;
    // What the next ten seconds cost: a session opens two connections (one to consume
    // on, one to publish on), both closed by the proxy; a pause from 100 ms after every
    // session would be one every ~0.4 s (25 sessions, 50 connections); growing pauses
    // make it a handful.
    let before = proxy.accepted();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let in_ten_seconds = proxy.accepted() - before;
    println!("connections in 10 s: {in_ten_seconds}");
    assert!(
        (1..=16).contains(&in_ten_seconds),
        "{in_ten_seconds} connections in 10 s"
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// Answers what its message carried, as the context tells it.
struct EnvelopeEcho;

impl Handler for EnvelopeEcho {
    type Message = Job;
    type Output = Value;
    const OPERATION: &'static str = "jobs.envelope";

    fn scope(&self, _: &Job) -> String {
        "tests".into()
    }

    fn idempotency_key(&self, job: &Job) -> String {
        job.event_id.clone()
    }

    async fn handle(&self, _: Job, ctx: &mut Context) -> Result<Value, HandlerError> {
        let envelope = ctx.envelope();
        Ok(json!({
            "type": envelope.message_type(),
            "message_id": envelope.message_id(),
            "correlation_id": envelope.correlation_id(),
            "source": envelope.header("source"),
            "priority": envelope.header("priority"),
            "exchange": envelope.exchange,
            "routing_key": envelope.routing_key,
            "redelivered": envelope.redelivered,
        }))
    }
}

/// A handler sees what its message carried: the type, ids and headers the producer set,
/// the exchange and routing key it came through, and whether it is a redelivery.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn the_handler_sees_what_the_message_carried(pool: PgPool) {
    use lapin::BasicProperties;
    use lapin::types::{AMQPValue, FieldTable};
    let q = TestQueue::new("envelope").await;
    let (shutdown, task) = start_in_process(&pool, &q, EnvelopeEcho, Duration::from_secs(5)).await;
    let mut table = FieldTable::default();
    table.insert("source".into(), AMQPValue::LongString("shop".into()));
    table.insert("priority".into(), AMQPValue::LongInt(7));
    let properties = BasicProperties::default()
        .with_type("order.created".into())
        .with_message_id("m-1".into())
        .with_correlation_id("c-1".into())
        .with_headers(table);
    q.publish_to(&q.name, br#"{"event_id": "evt-env"}"#, properties)
        .await;
    let store = Store::new(pool.clone(), StoreConfig::default());
    let key = idem::Key::new("tests", EnvelopeEcho::OPERATION, "evt-env").unwrap();
    wait_until(Duration::from_secs(30), "the envelope recorded", || {
        let store = store.clone();
        let key = key.clone();
        async move {
            store
                .get(&key)
                .await
                .unwrap()
                .is_some_and(|r| r.result.is_some())
        }
    })
    .await;
    let output = store.get(&key).await.unwrap().and_then(|r| r.result);
    assert_eq!(
        output.unwrap(),
        json!({"type": "order.created", "message_id": "m-1", "correlation_id": "c-1",
               "source": "shop", "priority": "7", "exchange": "", "routing_key": q.name,
               "redelivered": false})
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// A queue that consumes from exchanges: the worker declares them and binds the queue
/// with each key (again harmlessly at its next start); what is published to them with a
/// matching key is handled, and the handler sees which exchange and key it came by. An
/// exchange that exists with another type stops the worker with one line naming it.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn subscriptions_are_declared_bound_and_a_mismatch_stops_the_worker(pool: PgPool) {
    use idem::Subscription;
    use lapin::options::BasicPublishOptions;
    let q = TestQueue::new("subscribed").await;
    let events = q.exchange("events");
    let broadcast = q.exchange("broadcast");
    let subscriptions = vec![
        Subscription::topic(events.as_str(), &["order.*"]),
        Subscription::fanout(broadcast.as_str()),
    ];
    let store = Store::new(pool.clone(), StoreConfig::default());
    let output = |event: &'static str| {
        let store = store.clone();
        async move {
            let key = idem::Key::new("tests", EnvelopeEcho::OPERATION, event).unwrap();
            store.get(&key).await.unwrap().and_then(|r| r.result)
        }
    };
    for round in 0..2 {
        let subscribed = subscriptions.clone();
        let (shutdown, task) =
            start_configured(&pool, &q, EnvelopeEcho, Duration::from_secs(5), |c| {
                c.subscriptions = subscribed;
            });
        wait_for_consumers(&q, 1).await;
        for (exchange, routing_key, event) in [
            (
                events.as_str(),
                "order.created",
                format!("evt-topic-{round}"),
            ),
            (
                events.as_str(),
                "invoice.created",
                format!("evt-unbound-{round}"),
            ),
            (
                broadcast.as_str(),
                "anything",
                format!("evt-fanout-{round}"),
            ),
        ] {
            let body = json!({ "event_id": event }).to_string();
            let confirm = q
                .channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    lapin::BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            assert!(confirm.is_ack());
        }
        let topic: &'static str = if round == 0 {
            "evt-topic-0"
        } else {
            "evt-topic-1"
        };
        let fanout: &'static str = if round == 0 {
            "evt-fanout-0"
        } else {
            "evt-fanout-1"
        };
        wait_until(
            Duration::from_secs(30),
            "both bound messages handled",
            || async { output(topic).await.is_some() && output(fanout).await.is_some() },
        )
        .await;
        let seen = output(topic).await.unwrap();
        assert_eq!(
            (seen["exchange"].as_str(), seen["routing_key"].as_str()),
            (Some(events.as_str()), Some("order.created"))
        );
        assert_eq!(
            output(fanout).await.unwrap()["exchange"],
            broadcast.as_str()
        );
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }
    let unbound = idem::Key::new("tests", EnvelopeEcho::OPERATION, "evt-unbound-0").unwrap();
    assert!(
        store.get(&unbound).await.unwrap().is_none(),
        "a key no binding matches is not routed"
    );

    // The same exchange name with another type: refused, naming the exchange.
    let (_, task) = start_configured(&pool, &q, EnvelopeEcho, Duration::from_secs(5), |c| {
        c.subscriptions = vec![Subscription::fanout(events.as_str())];
    });
    let refused = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the worker stops")
        .unwrap()
        .unwrap_err();
    let line = refused.to_string();
    assert!(
        line.contains(&events) && line.contains("PRECONDITION_FAILED") && !line.contains('\n'),
        "{line}"
    );
}

/// `topology::queue_counts` answers `None` for a missing queue (a passive declare's
/// 404), the counts of one that exists, and an error when it cannot ask the broker (a
/// closed connection), not a missing queue.
#[tokio::test]
async fn queue_counts_tells_a_missing_queue_from_a_broker_it_cannot_ask() {
    let q = TestQueue::new("queue_counts").await;
    let counts = idem::topology::queue_counts(&q.connection, &q.name)
        .await
        .expect("the broker answers");
    assert_eq!(counts, None);
    q.declare_plain().await;
    q.publish(b"{}").await;
    q.publish(b"{}").await;
    let counts = idem::topology::queue_counts(&q.connection, &q.name)
        .await
        .expect("the broker answers");
    assert_eq!(
        counts,
        Some(idem::topology::QueueCounts {
            ready: 2,
            consumers: 0
        })
    );
    let closed = idem::topology::connect(&amqp_url(), "test-queue-counts-closed")
        .await
        .unwrap();
    closed.close(200, "closed".into()).await.unwrap();
    assert!(
        idem::topology::queue_counts(&closed, &q.name)
            .await
            .is_err(),
        "a closed connection is an error, not a missing queue"
    );
}
