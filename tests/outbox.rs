//! Follow-up messages through the transactional outbox (docs/DESIGN.md, "Follow-up
//! messages"), against the real broker and database: published once after the commit,
//! in staging order, never for a failed run or a zombie, relayed when the committing
//! worker did not publish, kept with the broker's reason when unroutable.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use idem::headers::{CORRELATION as CORRELATION_HEADER, SOURCE_KEY as SOURCE_KEY_HEADER};
use idem::outbox::OutboxConfig;
use idem::outbox::Relay;
use idem::{Context, FollowUp, Handler, HandlerError, Key, Mode};
use lapin::BasicProperties;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::Semaphore;

const SETTLE: Duration = Duration::from_secs(60);

#[derive(Deserialize)]
struct Job {
    event_id: String,
    tenant: String,
    /// Follow-ups to stage.
    n: usize,
    /// Negative: fails for good after staging.
    amount: i64,
    /// Where the follow-ups go (the default exchange if absent).
    #[serde(default)]
    exchange: String,
}

/// Stages `n` follow-ups to `to`, each naming its source, position and attempt; the
/// first attempt of `hold_event` waits for a permit of `gate` after staging.
struct Staging {
    to: String,
    hold_event: Option<String>,
    gate: Arc<Semaphore>,
}

impl Staging {
    fn to(queue: &str) -> Self {
        Self {
            to: queue.into(),
            hold_event: None,
            gate: Arc::new(Semaphore::new(0)),
        }
    }
}

impl Handler for Staging {
    type Message = Job;
    type Output = Value;
    const OPERATION: &'static str = "jobs.stage";

    fn scope(&self, job: &Job) -> String {
        job.tenant.clone()
    }

    fn idempotency_key(&self, job: &Job) -> String {
        job.event_id.clone()
    }

    async fn handle(&self, job: Job, ctx: &mut Context) -> Result<Value, HandlerError> {
        for position in 0..job.n {
            let body = json!({
                "event_id": ctx.next_message_id(),
                "source": job.event_id,
                "position": position,
                "attempt": ctx.attempt(),
            });
            let message = FollowUp::json(job.exchange.as_str(), self.to.as_str(), &body)
                .map_err(HandlerError::permanent)?
                .header("position", position as i64);
            ctx.publish(message).await?;
        }
        if job.amount < 0 {
            return Err(HandlerError::permanent("negative amount"));
        }
        if ctx.attempt() == 1 && self.hold_event.as_deref() == Some(job.event_id.as_str()) {
            let _permit = self.gate.acquire().await.map_err(HandlerError::transient)?;
        }
        Ok(json!({"staged": job.n}))
    }
}

fn job(event_id: &str, n: usize, amount: i64) -> Vec<u8> {
    serde_json::to_vec(&json!({"event_id": event_id, "tenant": "acme", "n": n, "amount": amount}))
        .unwrap()
}

async fn declare(q: &TestQueue, queue: &str) {
    q.channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
}

/// Publishes `body` to `queue` with a correlation id, confirmed.
async fn publish_correlated(q: &TestQueue, queue: &str, body: &[u8], correlation_id: &str) {
    let properties = BasicProperties::default().with_correlation_id(correlation_id.into());
    q.publish_to(queue, body, properties).await;
}

/// Waits until the outbox's one row has a last error containing `reason`.
async fn wait_for_last_error(pool: &PgPool, reason: &str) {
    wait_until(SETTLE, "the broker's reason recorded", || async {
        sqlx::query_scalar::<_, Option<String>>("SELECT last_error FROM outbox_messages")
            .fetch_optional(pool)
            .await
            .unwrap()
            .flatten()
            .is_some_and(|e| e.contains(reason))
    })
    .await;
}

/// Rows of the outbox: (message_id, dispatched).
async fn outbox_rows(pool: &PgPool) -> BTreeMap<String, bool> {
    sqlx::query_as::<_, (String, bool)>(
        "SELECT message_id, dispatched_at IS NOT NULL FROM outbox_messages",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// A relay on the test's database with `config`, running until `stop` is cancelled.
fn spawn_relay(
    pool: &PgPool,
    config: OutboxConfig,
    stop: &tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let relay = Relay::new(pool.clone(), &amqp_url(), config, Duration::from_secs(3600))
        .named("test-relay");
    tokio::spawn(relay.run(stop.clone()))
}

/// Polling every 100 ms.
fn polling() -> OutboxConfig {
    OutboxConfig {
        poll: Duration::from_millis(100),
        ..OutboxConfig::default()
    }
}

async fn follow_ups_once_in_order(pool: PgPool, mode: Mode) {
    let q = TestQueue::new(&format!("outbox-{}", mode.as_str())).await;
    let to = format!("{}.follow-ups", q.name);
    let out = q.beside("follow-ups").await;
    declare(&q, &to).await;
    let (stop, task) = start_in_process(&pool, &q, Staging::to(&to), |c| c.mode = mode).await;

    const JOBS: usize = 30;
    for i in 0..JOBS {
        let body = job(&format!("evt-{i}"), 3, 1);
        let correlation = format!("corr-{i}");
        publish_correlated(&q, &q.name, &body, &correlation).await;
        if i % 5 == 0 {
            // A duplicate: no new follow-ups.
            publish_correlated(&q, &q.name, &body, &correlation).await;
        }
    }
    q.publish(&job("evt-0", 3, 2)).await; // a conflict: none
    q.publish(&job("evt-neg", 2, -1)).await; // fails for good: its staged rows roll back

    wait_until(SETTLE, "every follow-up dispatched", || async {
        let rows = outbox_rows(&pool).await;
        rows.len() == JOBS * 3 && rows.values().all(|d| *d)
    })
    .await;
    out.wait_for_messages(&to, (JOBS * 3) as u32, SETTLE).await;
    wait_until(SETTLE, "the work queue settled", || async {
        q.counts(&q.name).await.0 == 0 && unacked(&q.name).await == 0
    })
    .await;

    let staged = outbox_rows(&pool).await;
    let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for message in out.drain(&to).await {
        let p = &message.delivery.properties;
        let body = body_json(&message.delivery.data);
        let id = p.message_id().as_ref().map(|s| s.to_string()).unwrap();
        assert_eq!(body["event_id"], json!(id), "the body names its own id");
        assert!(staged.contains_key(&id), "published with the staged id");
        let source = body["source"].as_str().unwrap().to_owned();
        let key = Key::new("acme", "jobs.stage", &source).unwrap();
        assert_eq!(
            idem::headers::text(p, SOURCE_KEY_HEADER),
            Some(key.short_hash())
        );
        let i = source.trim_start_matches("evt-");
        let correlation = format!("corr-{i}");
        assert_eq!(
            idem::headers::text(p, CORRELATION_HEADER).as_deref(),
            Some(correlation.as_str())
        );
        assert_eq!(
            p.correlation_id().as_ref().map(|s| s.as_str()),
            Some(correlation.as_str())
        );
        assert_eq!(p.delivery_mode(), &Some(2));
        seen.entry(source)
            .or_default()
            .push(body["position"].as_i64().unwrap());
    }
    assert_eq!(seen.len(), JOBS, "one sequence per job, none for evt-neg");
    for (source, positions) in &seen {
        assert_eq!(
            positions,
            &[0, 1, 2],
            "{source}: once each, in staging order"
        );
    }
    stop.cancel();
    task.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn leased_follow_ups_go_out_once_in_order(o: PgPoolOptions, c: PgConnectOptions) {
    let pool = o.connect_with(c).await.unwrap();
    follow_ups_once_in_order(pool, Mode::Leased).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn transactional_follow_ups_go_out_once_in_order(o: PgPoolOptions, c: PgConnectOptions) {
    let pool = o.connect_with(c).await.unwrap();
    follow_ups_once_in_order(pool, Mode::Transactional).await;
}

/// A worker whose lease was taken over stages its follow-ups, then tries to complete:
/// the fence refuses it, and its staged messages roll back with its writes. Only the
/// new owner's follow-up is ever published.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_zombies_follow_ups_never_appear(o: PgPoolOptions, c: PgConnectOptions) {
    let pool = o.connect_with(c).await.unwrap();
    let q = TestQueue::new("outbox-zombie").await;
    let to = format!("{}.follow-ups", q.name);
    declare(&q, &to).await;
    let gate = Arc::new(Semaphore::new(0));
    let handler = Staging {
        to: to.clone(),
        hold_event: Some("evt-z".into()),
        gate: gate.clone(),
    };
    let (stop, task) = start_in_process(&pool, &q, handler, |c| c.concurrency = 4).await;
    q.publish(&job("evt-z", 1, 1)).await;
    wait_until(SETTLE, "the first run holding its lease", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM processed_operations WHERE status = 'processing'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            == 1
    })
    .await;
    // The operator releases the lease of a worker believed dead; a duplicate takes over.
    let store = idem::Store::new(pool.clone(), idem::StoreConfig::default());
    let key = Key::new("acme", "jobs.stage", "evt-z").unwrap();
    store.release(&key).await.unwrap();
    q.publish(&job("evt-z", 1, 1)).await;
    wait_until(SETTLE, "the takeover completed", || async {
        store
            .get(&key)
            .await
            .unwrap()
            .is_some_and(|r| r.status == idem::Status::Completed && r.attempts == 2)
    })
    .await;
    gate.add_permits(1); // the zombie wakes and tries to complete
    let out = q.beside("follow-ups").await;
    wait_until(SETTLE, "both deliveries settled", || async {
        q.counts(&q.name).await.0 == 0 && unacked(&q.name).await == 0
    })
    .await;
    out.wait_for_messages(&to, 1, SETTLE).await;
    let messages = out.drain(&to).await;
    assert_eq!(messages.len(), 1);
    let body = body_json(&messages[0].delivery.data);
    assert_eq!(
        body["attempt"],
        json!(2),
        "the new owner's, not the zombie's"
    );
    assert_eq!(
        outbox_rows(&pool).await.len(),
        1,
        "the zombie's row rolled back"
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// Stages two messages of one operation by hand: the first held by another publisher,
/// the second due. The relay leaves the second alone until the first is dispatched, then
/// publishes it: an operation's messages never overtake each other.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_later_message_waits_for_an_earlier_one_held_elsewhere(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c).await.unwrap();
    let q = TestQueue::new("outbox-order").await;
    declare(&q, &q.name).await;
    let key = Key::new("acme", "jobs.stage", "evt-o").unwrap();
    for position in 0..2u32 {
        sqlx::query(
            "INSERT INTO outbox_messages (message_id, source, operation, position, exchange,
                 routing_key, body, properties, available_at, attempts)
             VALUES ($1, $2, 'jobs.stage', $3, '', $4, $5, '{}',
                     now() + CASE WHEN $3 = 0 THEN interval '1 hour' ELSE interval '0' END,
                     CASE WHEN $3 = 0 THEN 1 ELSE 0 END)",
        )
        .bind(idem::outbox::message_id(&key, position))
        .bind(key.digest())
        .bind(position as i32)
        .bind(&q.name)
        .bind(format!("{position}").into_bytes())
        .execute(&pool)
        .await
        .unwrap();
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let task = spawn_relay(&pool, polling(), &stop);
    let updates = || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'outbox_messages'",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    // Each look is a take and a deferral: two updates.
    wait_until(
        SETTLE,
        "the relay looked at the second message twice",
        || async { updates().await >= 4 },
    )
    .await;
    assert_eq!(
        q.counts(&q.name).await.0,
        0,
        "nothing overtook the first message"
    );
    // The other publisher's lease ends: the relay takes the first, then the second.
    sqlx::query("UPDATE outbox_messages SET available_at = now() WHERE position = 0")
        .execute(&pool)
        .await
        .unwrap();
    q.wait_for_messages(&q.name, 2, SETTLE).await;
    let bodies: Vec<Vec<u8>> = q
        .drain(&q.name)
        .await
        .into_iter()
        .map(|m| m.delivery.data)
        .collect();
    assert_eq!(bodies, vec![b"0".to_vec(), b"1".to_vec()]);
    stop.cancel();
    task.await.unwrap();
}

/// A follow-up to a queue that does not exist comes back from the broker unroutable:
/// it stays in the outbox with the broker's reason (for `idem outbox`), and goes out
/// once the queue exists.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn an_unroutable_follow_up_waits_in_the_outbox_with_the_brokers_reason(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let q = TestQueue::new("outbox-returned").await;
    let to = format!("{}.follow-ups", q.name);
    let (stop, task) = start_in_process(&pool, &q, Staging::to(&to), |_| {}).await;
    q.publish(&job("evt-r", 1, 1)).await;
    wait_for_last_error(&pool, "NO_ROUTE").await;
    // The operation itself completed: the follow-up's fate does not undo it.
    wait_until(SETTLE, "the delivery acked", || async {
        q.counts(&q.name).await.0 == 0 && unacked(&q.name).await == 0
    })
    .await;

    let url = database_url(&c);
    let stats = idem_cli(&url, &["outbox", "stats", "--json"]).await;
    let stats: Value = serde_json::from_str(stats.trim()).unwrap();
    assert_eq!(stats["undispatched"], json!(1));
    assert_eq!(stats["failing"], json!(1));
    let listed = idem_cli(&url, &["outbox", "list", "--failing"]).await;
    assert!(listed.contains("312 NO_ROUTE"), "{listed}");
    assert!(listed.contains(&to), "{listed}");

    declare(&q, &to).await;
    let out = q.beside("follow-ups").await;
    out.wait_for_messages(&to, 1, SETTLE).await;
    wait_until(SETTLE, "dispatched", || async {
        outbox_rows(&pool).await.values().all(|d| *d)
    })
    .await;
    assert_eq!(
        idem_cli(&url, &["outbox", "list"]).await.trim(),
        "nothing waits in the outbox"
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// When the committing worker does not publish (it died after the commit), a relay
/// woken by the commit's NOTIFY publishes within the handoff, not the polling interval
/// (10 s here): commit to publish, p50 under 100 ms.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn the_relay_publishes_what_a_commit_left_within_100_ms(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c).await.unwrap();
    let q = TestQueue::new("outbox-relay").await;
    declare(&q, &q.name).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let config = OutboxConfig {
        poll: Duration::from_secs(10),
        ..OutboxConfig::default()
    };
    let task = spawn_relay(&pool, config.clone(), &stop);
    // The relay is listening once a first message goes through.
    let mut latencies = Vec::new();
    let consumer = Consumer::new(&q).await;
    for i in 0..21u32 {
        let key = Key::new("acme", "jobs.stage", format!("evt-{i}")).unwrap();
        let id = idem::outbox::message_id(&key, 0);
        // What a worker's commit leaves when it dies before publishing: a staged row,
        // left to the committing worker for the handoff, and the trigger's NOTIFY.
        sqlx::query(
            "INSERT INTO outbox_messages (message_id, source, operation, position, exchange,
                 routing_key, body, properties, available_at)
             VALUES ($1, $2, 'jobs.stage', 0, '', $3, '{}', '{}',
                     clock_timestamp() + $4 * interval '1 millisecond')",
        )
        .bind(&id)
        .bind(key.digest())
        .bind(&q.name)
        .bind(config.handoff.as_millis() as i64)
        .execute(&pool)
        .await
        .unwrap();
        let committed = Instant::now();
        let got = consumer.next(SETTLE).await;
        let took = committed.elapsed();
        assert_eq!(got.as_deref(), Some(id.as_str()));
        if i > 0 {
            latencies.push(took);
        }
    }
    latencies.sort();
    let p50 = latencies[latencies.len() / 2];
    let max = latencies[latencies.len() - 1];
    println!(
        "relay: commit to publish p50 {p50:?}, max {max:?} (handoff {:?})",
        config.handoff
    );
    assert!(p50 < Duration::from_millis(100), "p50 {p50:?}");
    stop.cancel();
    task.await.unwrap();
}

/// A consumer of a test queue that yields message ids as they arrive.
struct Consumer {
    consumer: lapin::Consumer,
}

impl Consumer {
    async fn new(q: &TestQueue) -> Self {
        let channel = q.connection.create_channel().await.unwrap();
        let consumer = channel
            .basic_consume(
                q.name.as_str().into(),
                "".into(),
                lapin::options::BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        Self { consumer }
    }

    async fn next(&self, limit: Duration) -> Option<String> {
        use futures_util::StreamExt;
        let mut consumer = self.consumer.clone();
        let delivery = tokio::time::timeout(limit, consumer.next())
            .await
            .ok()??
            .ok()?;
        delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
    }
}

/// Three relays race for the same 600 messages left behind: every message is published
/// exactly once (a row is taken by one publisher at a time), and all are marked.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn racing_relays_publish_each_message_once(o: PgPoolOptions, c: PgConnectOptions) {
    let pool = o.max_connections(10).connect_with(c).await.unwrap();
    let q = TestQueue::new("outbox-race").await;
    declare(&q, &q.name).await;
    const N: i64 = 600;
    // Order under racing relays is `a_later_message_waits_for_an_earlier_one_held_elsewhere`'s
    // business; here each operation has one message.
    sqlx::query(
        "INSERT INTO outbox_messages (message_id, source, operation, position, exchange,
             routing_key, body, properties, available_at)
         SELECT 'm-' || i, lpad(to_hex(i), 64, '0'), 'jobs.stage', 0, '', $1, '', '{}', now()
         FROM generate_series(0, $2 - 1) AS i",
    )
    .bind(&q.name)
    .bind(N)
    .execute(&pool)
    .await
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let config = OutboxConfig {
        poll: Duration::from_millis(20),
        batch: 25,
        ..OutboxConfig::default()
    };
    let relays: Vec<_> = (0..3)
        .map(|_| spawn_relay(&pool, config.clone(), &stop))
        .collect();
    wait_until(SETTLE, "every message marked", || async {
        outbox_rows(&pool).await.values().filter(|d| **d).count() == N as usize
    })
    .await;
    stop.cancel();
    for relay in relays {
        relay.await.unwrap();
    }
    let messages = q.drain(&q.name).await;
    let mut copies: BTreeMap<String, usize> = BTreeMap::new();
    for m in &messages {
        let id = m.delivery.properties.message_id().as_ref().unwrap();
        *copies.entry(id.to_string()).or_default() += 1;
    }
    assert_eq!(copies.len(), N as usize, "every message published");
    assert!(copies.values().all(|n| *n == 1), "none twice");
}

/// A follow-up to an exchange that does not exist makes the broker close the channel it
/// was published on: it stays in the outbox with the broker's reason, and the worker
/// goes on (its dead letters and its other follow-ups are not on that channel).
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_follow_up_to_a_missing_exchange_fails_alone(o: PgPoolOptions, c: PgConnectOptions) {
    let pool = o.connect_with(c).await.unwrap();
    let q = TestQueue::new("outbox-no-exchange").await;
    let out = q.beside("follow-ups").await;
    declare(&q, &out.name).await;
    let (stop, task) =
        start_in_process(&pool, &q, Staging::to(&out.name), |c| c.concurrency = 1).await;
    let lost = serde_json::to_vec(&json!({
        "event_id": "evt-x", "tenant": "acme", "n": 1, "amount": 1,
        "exchange": "idem-test-no-such-exchange",
    }))
    .unwrap();
    q.publish(&lost).await;
    wait_for_last_error(&pool, "NOT_FOUND").await;
    q.publish(&job("evt-neg", 0, -1)).await; // dead-lettered on the worker's channel
    q.publish(&job("evt-ok", 1, 1)).await; // its follow-up on a fresh channel
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    out.wait_for_messages(&out.name, 1, SETTLE).await;
    let sent = out.drain(&out.name).await;
    assert_eq!(body_json(&sent[0].delivery.data)["source"], json!("evt-ok"));
    let dead = q.drain(&q.dlq()).await;
    assert_eq!(dead[0].reason.as_deref(), Some("permanent_failure"));
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// Rows waiting behind failed messages of their operations (in backoff for an hour) do
/// not fill the relay's batches: a message due after them, of another operation, still
/// goes out.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn messages_behind_failures_do_not_starve_the_others(o: PgPoolOptions, c: PgConnectOptions) {
    let pool = o.connect_with(c).await.unwrap();
    let q = TestQueue::new("outbox-starve").await;
    declare(&q, &q.name).await;
    // 150 operations whose first message failed (due in an hour) and whose second is
    // due now, then one operation's only message, due now, last in id order.
    sqlx::query(
        "INSERT INTO outbox_messages (message_id, source, operation, position, exchange,
             routing_key, body, properties, available_at, attempts, last_error)
         SELECT 'w-' || i || '-' || p, lpad(to_hex(i), 64, '0'), 'jobs.stage', p, '', $1,
                '', '{}',
                CASE p WHEN 0 THEN now() + interval '1 hour' ELSE now() END,
                CASE p WHEN 0 THEN 3 ELSE 0 END,
                CASE p WHEN 0 THEN 'returned by the broker: 312 NO_ROUTE' END
         FROM generate_series(1, 150) AS i, generate_series(0, 1) AS p
         ORDER BY i, p",
    )
    .bind(&q.name)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox_messages (message_id, source, operation, position, exchange,
             routing_key, body, properties, available_at)
         VALUES ('free', repeat('f', 64), 'jobs.stage', 0, '', $1, '', '{}', now())",
    )
    .bind(&q.name)
    .execute(&pool)
    .await
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let task = spawn_relay(&pool, polling(), &stop);
    q.wait_for_messages(&q.name, 1, SETTLE).await;
    let sent = q.drain(&q.name).await;
    let id = sent[0]
        .delivery
        .properties
        .message_id()
        .as_ref()
        .unwrap()
        .to_string();
    assert_eq!(id, "free", "only the free message, nothing out of order");
    stop.cancel();
    task.await.unwrap();
}

/// Without an OpenTelemetry layer (this test binary installs none), the trace context
/// passes through unchanged: onto follow-ups (stored when staged) and onto the dead
/// letter of a failed run, and the record keeps its trace id. A `traceparent` that does
/// not parse is dropped, with its `tracestate`.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn without_opentelemetry_the_trace_context_passes_through_unchanged(pool: PgPool) {
    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let q = TestQueue::new("outbox-trace").await;
    let to = format!("{}.follow-ups", q.name);
    let out = q.beside("follow-ups").await;
    declare(&q, &to).await;
    let (stop, task) = start_in_process(&pool, &q, Staging::to(&to), |_| {}).await;
    let traced = |traceparent: &str| {
        let mut headers = FieldTable::default();
        headers.insert("traceparent".into(), header_text(traceparent));
        headers.insert("tracestate".into(), header_text("vendor=1"));
        BasicProperties::default().with_headers(headers)
    };
    q.publish_to(&q.name, &job("evt-ok", 2, 1), traced(TRACEPARENT))
        .await;
    q.publish_to(&q.name, &job("evt-neg", 0, -1), traced(TRACEPARENT))
        .await;
    q.publish_to(&q.name, &job("evt-broken", 0, -1), traced("00-nonsense"))
        .await;
    out.wait_for_messages(&to, 2, SETTLE).await;
    q.wait_for_messages(&q.dlq(), 2, SETTLE).await;

    let header = |p: &BasicProperties, name: &str| idem::headers::text(p, name);
    for message in out.drain(&to).await {
        let p = &message.delivery.properties;
        assert_eq!(header(p, "traceparent").as_deref(), Some(TRACEPARENT));
        assert_eq!(header(p, "tracestate").as_deref(), Some("vendor=1"));
    }
    let dead: BTreeMap<String, (Option<String>, Option<String>)> = q
        .drain(&q.dlq())
        .await
        .into_iter()
        .map(|m| {
            let p = &m.delivery.properties;
            let trace = (header(p, "traceparent"), header(p, "tracestate"));
            (m.key.clone().unwrap(), trace)
        })
        .collect();
    assert_eq!(
        dead["evt-neg"],
        (Some(TRACEPARENT.to_owned()), Some("vendor=1".to_owned()))
    );
    assert_eq!(
        dead["evt-broken"],
        (None, None),
        "a broken context is dropped"
    );
    let traces: BTreeMap<String, Option<String>> = sqlx::query_as(
        "SELECT idempotency_key, trace_id FROM processed_operations WHERE operation = 'jobs.stage'",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let trace_id = Some("4bf92f3577b34da6a3ce929d0e0e4736".to_owned());
    assert_eq!(traces["evt-ok"], trace_id);
    assert_eq!(traces["evt-neg"], trace_id);
    assert_eq!(traces["evt-broken"], None);
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// A hostile trace context (a later version's unbounded tail, a `tracestate` with a NUL
/// and a line break) is passed on normalised: version `00`, no `tracestate`. Stored
/// as it came, the NUL made the outbox's `jsonb` refuse every follow-up (22P05), and
/// the run failed for good.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_hostile_trace_context_reaches_the_follow_ups_normalised(pool: PgPool) {
    let q = TestQueue::new("outbox-trace").await;
    let to = format!("{}.follow-ups", q.name);
    declare(&q, &to).await;
    let out = q.beside("follow-ups").await;
    let (stop, task) = start_in_process(&pool, &q, Staging::to(&to), |_| {}).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut headers = FieldTable::default();
    let tail = "x".repeat(50_000);
    let traceparent = format!("01-{trace_id}-00f067aa0ba902b7-01-{tail}");
    headers.insert("traceparent".into(), header_text(&traceparent));
    headers.insert("tracestate".into(), header_text("a=1\0\r\nb=2"));
    let properties = BasicProperties::default().with_headers(headers);
    q.publish_to(&q.name, &job("evt-trace", 1, 1), properties)
        .await;
    out.wait_for_messages(&to, 1, SETTLE).await;
    let sent = out.drain(&to).await;
    let p = &sent[0].delivery.properties;
    let carried = idem::headers::text(p, "traceparent").unwrap_or_default();
    assert!(
        carried.starts_with("00-") && carried.len() == 55 && carried.contains(trace_id),
        "{carried}"
    );
    assert_eq!(idem::headers::text(p, "tracestate"), None);
    assert_eq!(statuses(&pool).await.get("completed"), Some(&1));
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// A delayed follow-up (`FollowUp::delayed`) staged by a worker that is SIGKILLed before
/// it is due: another worker's relay publishes it once, not before its time and within
/// a second after it; until then `idem outbox stats` counts it as scheduled, not as a
/// backlog.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_delayed_follow_up_outlives_a_sigkill_and_goes_out_once_on_time(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    use lapin::options::BasicGetOptions;
    let pool = o.connect_with(c.clone()).await.unwrap();
    let url = database_url(&c);
    let q = TestQueue::new("outbox-delayed").await;
    let to = format!("{}.follow-ups", q.name);
    let out = q.beside("follow-ups").await;
    let args = ["--follow-ups", to.as_str(), "--follow-up-delay-ms", "3000"];
    let first = spawn_orders_worker(&url, &q.name, &args);
    wait_for_consumers(&q, 1).await;
    q.publish(&order("evt-remind", "acme", 100)).await;
    let staged = || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
                "SELECT not_before FROM outbox_messages",
            )
            .fetch_optional(&pool)
            .await
            .unwrap()
        }
    };
    wait_until(SETTLE, "the delayed follow-up staged", || async {
        staged().await.is_some()
    })
    .await;
    let not_before = staged().await.unwrap();
    signal(&first, "KILL");
    let stats = idem::outbox::stats(&pool).await.unwrap();
    assert_eq!((stats.scheduled, stats.undispatched), (1, 0), "{stats:?}");
    assert_eq!(stats.next_due, Some(not_before));
    assert!(chrono::Utc::now() < not_before, "killed before it was due");

    let _second = spawn_orders_worker(&url, &q.name, &args);
    let deadline = Instant::now() + SETTLE;
    let received = loop {
        let got = q
            .channel
            .basic_get(out.name.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap();
        if got.is_some() {
            break chrono::Utc::now();
        }
        assert!(
            Instant::now() < deadline,
            "the delayed follow-up never came"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let late = received - not_before;
    println!(
        "delayed follow-up: published {} ms after it was due",
        late.num_milliseconds()
    );
    assert!(
        late >= chrono::Duration::zero(),
        "published {late} before its time"
    );
    assert!(
        late <= chrono::Duration::seconds(1),
        "published {late} after its time"
    );
    wait_until(SETTLE, "the row marked dispatched", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT dispatched_at IS NOT NULL FROM outbox_messages")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    })
    .await;
    assert_eq!(q.counts(&out.name).await.0, 0, "published once");
}
