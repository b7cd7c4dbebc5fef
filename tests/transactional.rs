//! Transactional mode (docs/DESIGN.md, "Two execution modes") against the real broker
//! and database: claim, effects and outcome in one transaction per batch.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use idem::{Context, Handler, HandlerError, Mode, Reconciliation};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const SETTLE: Duration = Duration::from_secs(90);
const TRANSACTIONAL: [&str; 2] = ["--mode", "transactional"];

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn racing_duplicates_on_two_workers_book_each_event_once(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("tx-two-workers").await;
    let url = database_url(&connect);
    let _a = spawn_orders_worker(&url, &q.name, &TRANSACTIONAL);
    let _b = spawn_orders_worker(&url, &q.name, &TRANSACTIONAL);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 2).await;

    const EVENTS: usize = 300;
    for i in 0..EVENTS {
        let event = format!("evt-{i}");
        q.publish(&order(&event, "acme", 1)).await;
        q.publish(&order_resent(&event, "acme", 1)).await;
        if i % 3 == 0 {
            q.publish(&order_resent(&event, "acme", 1)).await;
        }
    }
    wait_until(
        SETTLE,
        "every event booked and the queue drained",
        || async {
            ledger(&pool).await.len() == EVENTS
                && q.counts(&q.name).await.0 == 0
                && unacked(&q.name).await == 0
        },
    )
    .await;
    let ledger = ledger(&pool).await;
    assert!(ledger.values().all(|n| *n == 1), "{ledger:?}");
    // Both effects are in the transaction: exactly one provider row per event too.
    let calls = provider_calls(&pool).await;
    assert_eq!(calls.len(), EVENTS);
    assert!(
        calls.values().all(|&(n, keys)| n == 1 && keys == 1),
        "{calls:?}"
    );
    assert_eq!(
        statuses(&pool).await,
        BTreeMap::from([("completed".to_owned(), EVENTS as i64)])
    );
    let owners: i64 = sqlx::query_scalar("SELECT count(DISTINCT owner) FROM processed_operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(owners, 2, "both workers took part");
    assert_eq!(q.counts(&q.dlq()).await.0, 0);
}

/// A handler that writes one effect row per run in the context's transaction and
/// follows a script per event; it counts its calls.
#[derive(Clone, Default)]
struct Effects {
    calls: Arc<Mutex<HashMap<String, usize>>>,
}

#[derive(Deserialize)]
struct Job {
    event_id: String,
    #[serde(default)]
    amount: i64,
}

impl Effects {
    fn calls(&self, event: &str) -> usize {
        self.calls.lock().unwrap().get(event).copied().unwrap_or(0)
    }
}

impl Handler for Effects {
    type Message = Job;
    type Output = Value;
    const OPERATION: &'static str = "jobs.effects";

    fn scope(&self, _: &Job) -> String {
        "tests".into()
    }

    fn idempotency_key(&self, job: &Job) -> String {
        job.event_id.clone()
    }

    async fn handle(&self, job: Job, ctx: &mut Context) -> Result<Value, HandlerError> {
        *self
            .calls
            .lock()
            .unwrap()
            .entry(job.event_id.clone())
            .or_default() += 1;
        sqlx::query("INSERT INTO effects (event_id, amount) VALUES ($1, $2)")
            .bind(&job.event_id)
            .bind(job.amount)
            .execute(ctx.tx().await?)
            .await?;
        match job.event_id.as_str() {
            "evt-bad" => Err(HandlerError::permanent("refused by the script")),
            // A result Postgres cannot store (jsonb holds no NUL).
            "evt-nul" => Ok(json!({"echo": "a\u{0}b"})),
            "evt-flaky" if self.calls("evt-flaky-failed") == 0 => {
                self.calls
                    .lock()
                    .unwrap()
                    .insert("evt-flaky-failed".into(), 1);
                Err(HandlerError::transient("flaky once"))
            }
            "evt-uncertain" if self.calls("evt-uncertain-reconciled") == 0 => {
                Err(HandlerError::uncertain(
                    Some("ref-9".into()),
                    "a transactional handler that called out",
                ))
            }
            _ => Ok(json!({"amount": job.amount})),
        }
    }

    async fn reconcile(
        &self,
        _: &Job,
        external_ref: Option<&str>,
        _: &mut Context,
    ) -> Result<Reconciliation<Value>, HandlerError> {
        assert_eq!(external_ref, Some("ref-9"));
        self.calls
            .lock()
            .unwrap()
            .insert("evt-uncertain-reconciled".into(), 1);
        Ok(Reconciliation::NotApplied)
    }
}

async fn effects(pool: &PgPool) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM effects GROUP BY event_id")
            .fetch_all(pool)
            .await
            .unwrap();
    rows.into_iter().collect()
}

async fn effects_table(pool: &PgPool) {
    sqlx::query("CREATE TABLE effects (event_id text NOT NULL, amount bigint NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

fn job(event: &str, amount: i64) -> Vec<u8> {
    serde_json::to_vec(&json!({"event_id": event, "amount": amount})).unwrap()
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_failing_handler_in_a_batch_undoes_only_its_own_writes(pool: PgPool) {
    effects_table(&pool).await;
    let q = TestQueue::new("tx-batch-failure").await;
    let handler = Effects::default();
    let (shutdown, task) = start_in_process(&pool, &q, handler.clone(), |c| {
        c.mode = Mode::Transactional;
        // Long enough that the messages below share one batch.
        c.batch_linger = Duration::from_millis(300);
        c.concurrency = 32;
    })
    .await;
    let events = ["evt-1", "evt-2", "evt-bad", "evt-3", "evt-flaky", "evt-4"];
    for event in events {
        q.publish(&job(event, 1)).await;
    }
    wait_until(SETTLE, "the good ones completed", || async {
        statuses(&pool).await.get("completed") == Some(&5)
    })
    .await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    let dead = q.drain(&q.dlq()).await;
    assert_eq!(dead[0].key.as_deref(), Some("evt-bad"));
    assert_eq!(dead[0].reason.as_deref(), Some("permanent_failure"));
    assert_eq!(
        effects(&pool).await,
        BTreeMap::from([
            ("evt-1".to_owned(), 1),
            ("evt-2".to_owned(), 1),
            ("evt-3".to_owned(), 1),
            ("evt-4".to_owned(), 1),
            ("evt-flaky".to_owned(), 1),
        ]),
        "the failing handler's writes rolled back, the others' kept once"
    );
    // They shared a batch: it rolled back when evt-bad failed and ran again with a
    // savepoint per handler.
    assert!(
        ["evt-1", "evt-2", "evt-3", "evt-4"]
            .iter()
            .any(|e| handler.calls(e) >= 2),
        "no batch was run again: {:?}",
        handler.calls.lock().unwrap()
    );
    let (status, retryable): (String, bool) = sqlx::query_as(
        "SELECT status, retryable FROM processed_operations WHERE idempotency_key = 'evt-bad'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), retryable), ("failed", false));
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn conflicts_malformed_and_uncertain_in_transactional_mode(pool: PgPool) {
    effects_table(&pool).await;
    let q = TestQueue::new("tx-table").await;
    let handler = Effects::default();
    let (shutdown, task) = start_in_process(&pool, &q, handler.clone(), |c| {
        c.mode = Mode::Transactional;
    })
    .await;
    q.publish(&job("evt-a", 1)).await;
    // Decided first, so that the payload below is the conflicting one (with 16 handlers
    // at once, whichever of two payloads is decided first wins).
    wait_until(SETTLE, "evt-a completed", || async {
        statuses(&pool).await.get("completed") == Some(&1)
    })
    .await;
    q.publish(&job("evt-a", 2)).await; // same key, other payload
    q.publish(&job("evt-a", 1)).await; // a duplicate
    q.publish(b"not json").await;
    q.publish(&job("evt-uncertain", 1)).await;
    q.wait_for_messages(&q.dlq(), 2, SETTLE).await;
    wait_until(SETTLE, "both operations completed", || async {
        statuses(&pool).await.get("completed") == Some(&2)
    })
    .await;
    let mut reasons: Vec<String> = q
        .drain(&q.dlq())
        .await
        .into_iter()
        .map(|d| d.reason.unwrap_or_default())
        .collect();
    reasons.sort();
    assert_eq!(reasons, ["fingerprint_conflict", "malformed"]);
    // The uncertain run's write rolled back; pending, reconciled "not applied", run
    // again: one effect. evt-a ran once for three deliveries.
    assert_eq!(
        effects(&pool).await,
        BTreeMap::from([("evt-a".to_owned(), 1), ("evt-uncertain".to_owned(), 1)])
    );
    let (attempts, reconcile_first): (i32, bool) = sqlx::query_as(
        "SELECT attempts, reconcile_first FROM processed_operations
         WHERE idempotency_key = 'evt-uncertain'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((attempts, reconcile_first), (2, true));
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_result_postgres_refuses_fails_for_good_alone_and_stays_replayable(pool: PgPool) {
    effects_table(&pool).await;
    let q = TestQueue::new("tx-refused-result").await;
    let (shutdown, task) = start_in_process(&pool, &q, Effects::default(), |c| {
        c.mode = Mode::Transactional;
        c.batch_linger = Duration::from_millis(200);
    })
    .await;
    for event in ["evt-ok-1", "evt-nul", "evt-ok-2"] {
        q.publish(&job(event, 1)).await;
    }
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    wait_until(SETTLE, "the neighbours completed", || async {
        statuses(&pool).await.get("completed") == Some(&2)
    })
    .await;
    let dead = q.drain(&q.dlq()).await;
    assert_eq!(dead[0].key.as_deref(), Some("evt-nul"));
    assert_eq!(dead[0].reason.as_deref(), Some("permanent_failure"));
    let said = dead[0].error.clone().unwrap_or_default();
    assert!(
        said.starts_with("the result could not be stored:") && said.contains("SQLSTATE 22P05"),
        "{said}"
    );
    let (status, retryable): (String, bool) = sqlx::query_as(
        "SELECT status, retryable FROM processed_operations WHERE idempotency_key = 'evt-nul'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), retryable), ("failed", false));
    assert_eq!(
        effects(&pool).await,
        BTreeMap::from([("evt-ok-1".to_owned(), 1), ("evt-ok-2".to_owned(), 1)]),
        "the refused run's write rolled back"
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// A handler that bumps one counter row per key: two batches holding the same keys in
/// opposite order lock the same rows in opposite order.
#[derive(Clone)]
struct Counters;

impl Handler for Counters {
    type Message = Job;
    type Output = ();
    const OPERATION: &'static str = "jobs.counters";

    fn scope(&self, _: &Job) -> String {
        "tests".into()
    }

    fn idempotency_key(&self, job: &Job) -> String {
        job.event_id.clone()
    }

    async fn handle(&self, job: Job, ctx: &mut Context) -> Result<(), HandlerError> {
        sqlx::query("UPDATE counters SET n = n + 1 WHERE event_id = $1")
            .bind(&job.event_id)
            .execute(ctx.tx().await?)
            .await?;
        Ok(())
    }
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn overlapping_batches_in_opposite_order_each_run_once_and_dead_letter_nothing(pool: PgPool) {
    const KEYS: usize = 60;
    sqlx::query("CREATE TABLE counters (event_id text PRIMARY KEY, n int NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO counters SELECT 'evt-' || i, 0 FROM generate_series(0, $1) i")
        .bind(KEYS as i32 - 1)
        .execute(&pool)
        .await
        .unwrap();
    let up = TestQueue::new("tx-order-up").await;
    let down = TestQueue::new("tx-order-down").await;
    let tune = |c: &mut idem::WorkerConfig| {
        c.mode = Mode::Transactional;
        c.batch_linger = Duration::from_millis(200);
        c.concurrency = KEYS;
        c.prefetch = KEYS as u16;
    };
    let (stop_up, task_up) = start_in_process(&pool, &up, Counters, tune).await;
    let (stop_down, task_down) = start_in_process(&pool, &down, Counters, tune).await;
    // The same keys, one queue in order, the other in reverse, published together.
    let forward = async {
        for i in 0..KEYS {
            up.publish(&job(&format!("evt-{i}"), 1)).await;
        }
    };
    let backward = async {
        for i in (0..KEYS).rev() {
            down.publish(&job(&format!("evt-{i}"), 1)).await;
        }
    };
    tokio::join!(forward, backward);
    wait_until(SETTLE, "both queues settled", || async {
        statuses(&pool).await.get("completed") == Some(&(KEYS as i64))
            && up.counts(&up.name).await.0 == 0
            && down.counts(&down.name).await.0 == 0
            && unacked(&up.name).await == 0
            && unacked(&down.name).await == 0
    })
    .await;
    let counts: Vec<i32> = sqlx::query_scalar("SELECT n FROM counters ORDER BY event_id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(
        counts.iter().all(|&n| n == 1),
        "each key ran once: {counts:?}"
    );
    assert_eq!(up.counts(&up.dlq()).await.0, 0, "nothing dead-lettered");
    assert_eq!(down.counts(&down.dlq()).await.0, 0, "nothing dead-lettered");
    stop_up.cancel();
    stop_down.cancel();
    task_up.await.unwrap().unwrap();
    task_down.await.unwrap().unwrap();
}
