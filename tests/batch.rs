//! Batch handlers (`Handler::handle_batch`, docs/DESIGN.md "Batch handlers") against
//! the real broker and database: what reaches a batch, a failing item, follow-ups per
//! item, a crash before the batch commits, and racing batches on two processes.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use idem::{Batch, Context, FollowUp, Handler, HandlerError, Key, Mode};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const SETTLE: Duration = Duration::from_secs(90);
const BATCHED: [&str; 3] = ["--mode", "transactional", "--batch"];
/// The orders worker's log with its batches (`booked a batch … orders=N`).
const BATCH_LOG: (&str, &str) = ("RUST_LOG", "info,sqlx=warn,orders_worker=debug");

/// The most orders `process` booked in one batch, from its log.
fn largest_batch(process: &WorkerProcess) -> usize {
    let log = std::fs::read_to_string(&process.log).unwrap_or_default();
    log.lines()
        .filter(|line| line.contains("booked a batch"))
        .filter_map(|line| {
            let (_, after) = line.split_once("orders=")?;
            after
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .max()
        .unwrap_or(0)
}

#[derive(Deserialize)]
struct Entry {
    event_id: String,
    tenant: String,
    amount_cents: i64,
}

/// Books one row per entry in `batch_entries`, a batch with one insert, and stages one
/// follow-up per entry to `out`; a negative amount fails for good. It notes the keys
/// of every batch it is handed and every entry `handle` runs.
#[derive(Clone)]
struct Book {
    out: String,
    batches: Arc<Mutex<Vec<Vec<String>>>>,
    alone: Arc<Mutex<Vec<String>>>,
}

impl Book {
    fn follow_up(&self, entry: &Entry, id: String) -> Result<FollowUp, HandlerError> {
        let body = json!({"event_id": id, "entry": entry.event_id});
        FollowUp::json("", self.out.as_str(), &body).map_err(HandlerError::permanent)
    }
}

impl Handler for Book {
    type Message = Entry;
    type Output = Value;
    const OPERATION: &'static str = "book.entries";

    fn scope(&self, e: &Entry) -> String {
        e.tenant.clone()
    }

    fn idempotency_key(&self, e: &Entry) -> String {
        e.event_id.clone()
    }

    async fn handle(&self, e: Entry, ctx: &mut Context) -> Result<Value, HandlerError> {
        self.alone.lock().unwrap().push(e.event_id.clone());
        if e.amount_cents < 0 {
            return Err(HandlerError::permanent("negative amount"));
        }
        sqlx::query("INSERT INTO batch_entries (event_id, amount_cents) VALUES ($1, $2)")
            .bind(&e.event_id)
            .bind(e.amount_cents)
            .execute(ctx.tx().await?)
            .await?;
        let follow_up = self.follow_up(&e, ctx.next_message_id())?;
        ctx.publish(follow_up).await?;
        Ok(json!({"booked": e.amount_cents}))
    }

    async fn handle_batch(
        &self,
        batch: &mut Batch<Entry>,
    ) -> Option<Vec<Result<Value, HandlerError>>> {
        let keys = batch.messages().iter().map(|e| e.event_id.clone());
        self.batches.lock().unwrap().push(keys.collect());
        let booked = async {
            let ids: Vec<String> = batch
                .messages()
                .iter()
                .map(|e| e.event_id.clone())
                .collect();
            let amounts: Vec<i64> = batch.messages().iter().map(|e| e.amount_cents).collect();
            sqlx::query(
                "INSERT INTO batch_entries (event_id, amount_cents)
                 SELECT * FROM unnest($1::text[], $2::bigint[])",
            )
            .bind(&ids)
            .bind(&amounts)
            .execute(batch.tx().await?)
            .await?;
            for item in 0..batch.len() {
                let id = batch
                    .context(item)
                    .map(Context::next_message_id)
                    .unwrap_or_default();
                let follow_up = self.follow_up(&batch.messages()[item], id)?;
                batch.publish(item, follow_up).await?;
            }
            Ok::<_, HandlerError>(())
        };
        let failed = booked.await.err();
        Some(
            batch
                .messages()
                .iter()
                .map(|e| match (&failed, e.amount_cents < 0) {
                    (Some(error), _) => Err(error.clone()),
                    (None, true) => Err(HandlerError::permanent("negative amount")),
                    (None, false) => Ok(json!({"booked": e.amount_cents})),
                })
                .collect(),
        )
    }
}

fn entry(event_id: &str, amount_cents: i64) -> Vec<u8> {
    json!({"event_id": event_id, "tenant": "acme", "amount_cents": amount_cents})
        .to_string()
        .into_bytes()
}

async fn entries(pool: &PgPool) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM batch_entries GROUP BY event_id")
            .fetch_all(pool)
            .await
            .unwrap();
    rows.into_iter().collect()
}

/// Forty entries published before the worker starts, so that it decides them in
/// batches: one fails for good in the middle of its batch, one comes twice, one comes
/// again with another amount (a conflict), two bodies do not fit. The batch handler
/// sees only what would run alone, the failing entry alone fails, and every follow-up
/// carries its own entry's ids.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_batch_runs_what_would_run_alone_and_a_failing_entry_fails_alone(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c).await.unwrap();
    sqlx::query(
        "CREATE TABLE batch_entries (event_id text NOT NULL, amount_cents bigint NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let q = TestQueue::new("batch-handler").await;
    let out = q.beside("out").await;
    declare(&q, &out.name).await;
    declare_topology(&q, &RETRY_DELAYS_MS[..2]).await;
    for i in 0..40 {
        let amount = if i == 13 { -1 } else { 10 };
        q.publish(&entry(&format!("evt-{i}"), amount)).await;
        match i {
            7 => q.publish(&entry("evt-7", 10)).await,
            20 => q.publish(&entry("evt-20", 99)).await,
            30 => q.publish(b"not json").await,
            31 => {
                q.publish(br#"{"event_id": "evt-x", "tenant": "acme"}"#)
                    .await
            }
            _ => {}
        }
    }
    let book = Book {
        out: out.name.clone(),
        batches: Arc::default(),
        alone: Arc::default(),
    };
    let (shutdown, task) = start_in_process(&pool, &q, book.clone(), |config| {
        config.mode = Mode::Transactional;
        config.concurrency = 64;
        config.prefetch = 64;
        config.batch_linger = Duration::from_millis(20);
    })
    .await;
    wait_until(SETTLE, "every delivery decided", || async {
        q.counts(&q.name).await.0 == 0
            && unacked(&q.name).await == 0
            && q.counts(&q.dlq()).await.0 == 4
            && q.counts(&out.name).await.0 >= 39
    })
    .await;
    shutdown.cancel();
    task.await.unwrap().unwrap();

    // Every entry but the failing one booked once; evt-20 at its first amount.
    let booked = entries(&pool).await;
    assert_eq!(booked.len(), 39, "{booked:?}");
    assert!(booked.values().all(|&n| n == 1), "{booked:?}");
    assert!(!booked.contains_key("evt-13"));
    let amount: i64 =
        sqlx::query_scalar("SELECT amount_cents FROM batch_entries WHERE event_id = 'evt-20'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(amount, 10);
    let reasons: BTreeMap<String, usize> =
        q.drain(&q.dlq())
            .await
            .into_iter()
            .fold(BTreeMap::new(), |mut m, d| {
                *m.entry(d.reason.unwrap_or_default()).or_default() += 1;
                m
            });
    assert_eq!(
        reasons,
        BTreeMap::from([
            ("fingerprint_conflict".to_owned(), 1),
            ("malformed".to_owned(), 2),
            ("permanent_failure".to_owned(), 1),
        ])
    );

    // Batches of more than one, each key once in its batch, never a body that does not
    // fit; the failing entry's batch ran again one entry at a time.
    let batches = book.batches.lock().unwrap().clone();
    assert!(batches.iter().any(|b| b.len() > 1), "{batches:?}");
    for batch in &batches {
        let distinct: BTreeSet<&String> = batch.iter().collect();
        assert_eq!(
            distinct.len(),
            batch.len(),
            "a key twice in one batch: {batch:?}"
        );
        assert!(!batch.iter().any(|k| k == "evt-x"));
    }
    let alone = book.alone.lock().unwrap().clone();
    assert!(alone.contains(&"evt-13".to_owned()), "{alone:?}");
    let failing_batch = batches
        .iter()
        .find(|b| b.contains(&"evt-13".to_owned()))
        .unwrap();
    assert!(
        failing_batch.iter().all(|k| alone.contains(k)),
        "{failing_batch:?} {alone:?}"
    );

    // One follow-up per booked entry, with that entry's ids.
    let follow_ups = out.drain(&out.name).await;
    let mut seen = BTreeSet::new();
    for message in &follow_ups {
        let body = body_json(&message.delivery.data);
        let entry = body["entry"].as_str().unwrap().to_owned();
        let key = Key::new("acme", Book::OPERATION, &entry).unwrap();
        let props = &message.delivery.properties;
        let id = props.message_id().as_ref().map(|s| s.to_string());
        assert_eq!(id.as_deref(), body["event_id"].as_str(), "{body}");
        let source = props
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(idem::headers::SOURCE_KEY).cloned());
        assert_eq!(source, Some(header_text(&key.short_hash())), "{body}");
        assert!(seen.insert(entry));
    }
    assert_eq!(seen.len(), 39);
}

/// The worker's queues, declared before it starts so that what is published first
/// waits for it: retry tiers of `delays` milliseconds, as the worker declares them.
async fn declare_topology(q: &TestQueue, delays: &[u64]) {
    let topology = idem::Topology {
        queue: q.name.clone(),
        queue_type: idem::QueueType::Classic,
        retry_delays: delays.iter().map(|&ms| Duration::from_millis(ms)).collect(),
        subscriptions: Vec::new(),
        single_active_consumer: false,
    };
    topology.declare(&q.connection).await.unwrap();
}

async fn declare(q: &TestQueue, name: &str) {
    let channel = q.connection.create_channel().await.unwrap();
    let options = lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(name.into(), options, Default::default())
        .await
        .unwrap();
}

/// A worker that batches dies before its batch commits: nothing of the batch is left
/// (no record, no row, no provider call), and a restarted one books each order once.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_crash_before_the_batch_commits_leaves_nothing(o: PgPoolOptions, c: PgConnectOptions) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let url = database_url(&c);
    let q = TestQueue::new("batch-crash").await;
    // The tables first, then the orders, then the worker that dies: it finds them all.
    let setup = q.beside("setup").await;
    let worker = spawn_orders_worker(&url, &setup.name, &BATCHED);
    wait_for_worker_tables(&pool).await;
    drop(worker);
    declare_topology(&q, &RETRY_DELAYS_MS).await;
    const ORDERS: usize = 20;
    for i in 0..ORDERS {
        q.publish(&order(&format!("evt-{i}"), "acme", 5)).await;
    }
    let crash = [("IDEM_FAILPOINT", "before-commit"), BATCH_LOG];
    let mut crashing = spawn_orders_worker_with_env(&url, &q.name, &BATCHED, &crash);
    let status = tokio::time::timeout(SETTLE, crashing.child.wait())
        .await
        .expect("the worker reaches the failpoint")
        .unwrap();
    assert!(!status.success(), "{status:?}");
    assert!(crashing.log_contains("failpoint before-commit: aborting"));
    // Its first batch may have formed before the other orders arrived: what counts is
    // that `handle_batch` booked it and the process died before the commit.
    assert!(
        largest_batch(&crashing) >= 1,
        "the batch handler booked the batch that died"
    );
    assert!(statuses(&pool).await.is_empty());
    assert!(ledger(&pool).await.is_empty() && provider_calls(&pool).await.is_empty());

    let _healthy = spawn_orders_worker(&url, &q.name, &BATCHED);
    wait_until(SETTLE, "every order booked and acked", || async {
        ledger(&pool).await.len() == ORDERS
            && q.counts(&q.name).await.0 == 0
            && unacked(&q.name).await == 0
    })
    .await;
    assert!(ledger(&pool).await.values().all(|&n| n == 1));
    assert!(
        provider_calls(&pool)
            .await
            .values()
            .all(|&(n, keys)| n == 1 && keys == 1)
    );
    assert_eq!(
        statuses(&pool).await,
        BTreeMap::from([("completed".to_owned(), ORDERS as i64)])
    );
}

/// Two processes whose batches overlap in keys (every order comes two or three
/// times): each order is booked once, one provider call each, with follow-ups once.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn racing_batches_on_two_processes_book_each_order_once(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let q = TestQueue::new("batch-race").await;
    let out = q.beside("booked").await;
    declare(&q, &out.name).await;
    let url = database_url(&c);
    let args = [&BATCHED[..], &["--follow-ups", out.name.as_str()]].concat();
    let a = spawn_orders_worker_with_env(&url, &q.name, &args, &[BATCH_LOG]);
    let b = spawn_orders_worker_with_env(&url, &q.name, &args, &[BATCH_LOG]);
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
    wait_until(SETTLE, "every order booked, its follow-up sent", || async {
        ledger(&pool).await.len() == EVENTS
            && q.counts(&q.name).await.0 == 0
            && unacked(&q.name).await == 0
            && q.counts(&out.name).await.0 as usize >= EVENTS
    })
    .await;
    let ledger = ledger(&pool).await;
    assert!(ledger.values().all(|&n| n == 1), "{ledger:?}");
    let calls = provider_calls(&pool).await;
    assert!(calls.len() == EVENTS && calls.values().all(|&(n, k)| n == 1 && k == 1));
    let owners: i64 = sqlx::query_scalar("SELECT count(DISTINCT owner) FROM processed_operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(owners, 2, "both processes took part");
    let sent: BTreeSet<String> = out
        .drain(&out.name)
        .await
        .iter()
        .map(|m| {
            body_json(&m.delivery.data)["order_event_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(sent.len(), EVENTS);
    assert_eq!(q.counts(&q.dlq()).await.0, 0);
    assert!(
        largest_batch(&a) > 1 && largest_batch(&b) > 1,
        "both booked batches"
    );
}
