//! Dead letters an operator can trust (docs/DESIGN.md, "Broker topology" and
//! "Replay"): their `idem-*` headers are only ever idem's own, every letter of a key
//! keeps its record pinned, and a replay goes where the operator asked. Against the
//! real broker and database.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use idem::replay::{self, Action};
use idem::{Context, Handler, HandlerError, RetryPolicy, Store, StoreConfig};
use lapin::BasicProperties;
use lapin::types::FieldTable;
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const SETTLE: Duration = Duration::from_secs(90);

/// The record of `key`: (dead letters counted, pinned since, discarded).
async fn pins(pool: &PgPool, key: &str) -> Option<(i32, bool, bool)> {
    sqlx::query_as(
        "SELECT dead_letters, dead_lettered_at IS NOT NULL, discarded_at IS NOT NULL
         FROM processed_operations WHERE idempotency_key = $1",
    )
    .bind(key)
    .fetch_optional(pool)
    .await
    .unwrap()
}

fn headers(pairs: &[(&str, &str)]) -> BasicProperties {
    let mut table = FieldTable::default();
    for (name, value) in pairs {
        table.insert((*name).into(), header_text(value));
    }
    BasicProperties::default().with_headers(table)
}

/// A malformed message carrying another tenant's key in forged `idem-*` headers: its
/// dead letter keeps none of them, so the routine discard of the malformed group
/// leaves the other tenant's record (and its real dead letter) as they were.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn forged_verdict_headers_are_dropped_and_a_discard_settles_nobody_elses_record(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("forged").await;
    let url = database_url(&connect);
    let _worker = spawn_orders_worker(&url, &q.name, &[]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    // The victim's own order fails for good: a real dead letter, its record pinned.
    q.publish(&order("evt-victim", "victim", -1)).await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    assert_eq!(pins(&pool, "evt-victim").await, Some((1, true, false)));

    let forged = headers(&[
        ("idem-scope", "victim"),
        ("idem-key", "evt-victim"),
        ("idem-operation", "orders.create"),
        ("idem-reason", "permanent_failure"),
        ("idem-original-queue", "elsewhere"),
        ("app-header", "kept"),
    ]);
    q.publish_to(&q.name, b"not json", forged).await;
    q.wait_for_messages(&q.dlq(), 2, SETTLE).await;
    let letters = replay::peek(&q.connection, &q.dlq(), &replay::Filter::default(), 10)
        .await
        .unwrap();
    let letter = letters
        .iter()
        .find(|m| *m.delivery.data == *b"not json")
        .expect("the malformed letter");
    assert_eq!(letter.reason.as_deref(), Some("malformed"));
    assert_eq!(
        (letter.key.as_deref(), letter.scope.as_deref()),
        (None, None)
    );
    assert_eq!(letter.original_queue.as_deref(), Some(q.name.as_str()));
    let app = idem::headers::text(&letter.delivery.properties, "app-header");
    assert_eq!(
        app.as_deref(),
        Some("kept"),
        "the producer's own headers travel"
    );
    drop(letters);

    let args = [
        "dlq",
        "discard",
        "--queue",
        &q.name,
        "--reason",
        "malformed",
        "--json",
    ];
    let summary: Value = serde_json::from_str(&idem_cli(&url, &args).await).unwrap();
    assert_eq!(summary["discarded"], 1, "{summary}");
    assert_eq!(
        pins(&pool, "evt-victim").await,
        Some((1, true, false)),
        "the victim's record is untouched"
    );
    assert_eq!(q.counts(&q.dlq()).await.0, 1, "the victim's letter waits");
}

/// A replay republishes to the queue of the DLQ the operator named, whatever a
/// letter's `idem-original-queue` says (a letter put into the DLQ by hand can say
/// anything).
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_replay_goes_to_the_queue_it_was_asked_for(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("replay-target").await;
    let elsewhere = q.beside("elsewhere").await;
    let url = database_url(&connect);
    let _worker = spawn_orders_worker(&url, &q.name, &[]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    let durable = lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    q.channel
        .queue_declare(
            elsewhere.name.as_str().into(),
            durable,
            FieldTable::default(),
        )
        .await
        .unwrap();
    let letter = headers(&[
        ("idem-reason", "permanent_failure"),
        ("idem-scope", "acme"),
        ("idem-key", "evt-elsewhere"),
        ("idem-operation", "orders.create"),
        ("idem-original-queue", &elsewhere.name),
    ]);
    q.publish_to(&q.dlq(), &order("evt-elsewhere", "acme", 1), letter)
        .await;
    let args = ["dlq", "replay", "--queue", &q.name, "--json"];
    let summary: Value = serde_json::from_str(&idem_cli(&url, &args).await).unwrap();
    assert_eq!(summary["replayed"], 1, "{summary}");
    wait_until(SETTLE, "the replay booked", || async {
        ledger(&pool).await.get("evt-elsewhere") == Some(&1)
    })
    .await;
    assert_eq!(elsewhere.counts(&elsewhere.name).await.0, 0);
}

#[derive(Deserialize)]
struct Job {
    event_id: String,
}

/// Fails transiently while `failing`, else writes one effect row per run.
#[derive(Clone)]
struct Switch {
    failing: Arc<AtomicBool>,
}

impl Handler for Switch {
    type Message = Job;
    type Output = Value;
    const OPERATION: &'static str = "jobs.switch";

    fn scope(&self, _: &Job) -> String {
        "tests".into()
    }

    fn idempotency_key(&self, job: &Job) -> String {
        job.event_id.clone()
    }

    async fn handle(&self, job: Job, ctx: &mut Context) -> Result<Value, HandlerError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(HandlerError::transient("the provider is down"));
        }
        sqlx::query("INSERT INTO effects (event_id) VALUES ($1)")
            .bind(&job.event_id)
            .execute(ctx.tx().await?)
            .await?;
        Ok(json!({"done": true}))
    }
}

async fn effects(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Two dead letters of one key (a producer's duplicate re-ran the retryable failure):
/// each pins the record. Replaying one runs it; gc past the retention keeps the record
/// while the other waits, so replaying the other does not run the effect again.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn every_dead_letter_of_a_key_pins_its_record_until_it_leaves_the_dlq(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    sqlx::query("CREATE TABLE effects (event_id text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let q = TestQueue::new("two-letters").await;
    let failing = Arc::new(AtomicBool::new(true));
    let handler = Switch {
        failing: failing.clone(),
    };
    let retention = Duration::from_secs(1);
    let worker_store = Store::new(
        pool.clone(),
        StoreConfig {
            retention,
            ..StoreConfig::default()
        },
    );
    let config = idem::WorkerConfig {
        amqp_url: amqp_url(),
        queue: q.name.clone(),
        retry: RetryPolicy {
            immediate: 0,
            delays: vec![Duration::from_millis(RETRY_DELAYS_MS[0])],
            ..RetryPolicy::default()
        },
        ..idem::WorkerConfig::default()
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(idem::Worker::new(handler, worker_store, config).run(shutdown.clone()));
    wait_for_consumers(&q, 1).await;
    let body = serde_json::to_vec(&json!({"event_id": "evt-twice"})).unwrap();
    q.publish(&body).await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    q.publish(&body).await;
    q.wait_for_messages(&q.dlq(), 2, SETTLE).await;
    assert_eq!(pins(&pool, "evt-twice").await, Some((2, true, false)));

    failing.store(false, Ordering::SeqCst);
    let store = Store::new(pool.clone(), StoreConfig::default());
    let one = replay::Options {
        filter: replay::Filter {
            limit: Some(1),
            ..replay::Filter::default()
        },
        ..replay::Options::default()
    };
    let summary = replay::run(&q.connection, &store, &q.dlq(), Action::Replay, &one)
        .await
        .unwrap();
    assert_eq!(summary.replayed, 1);
    wait_until(SETTLE, "the replay completed", || async {
        statuses(&pool).await.get("completed") == Some(&1)
    })
    .await;
    assert_eq!(effects(&pool).await, 1);
    assert_eq!(pins(&pool, "evt-twice").await, Some((1, true, false)));

    // Past the retention, gc keeps the record: the other letter still waits.
    wait_until(SETTLE, "the record past its retention", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT expires_at <= now() FROM processed_operations
             WHERE idempotency_key = 'evt-twice'",
        )
        .fetch_one(&pool)
        .await
        .unwrap_or(false)
    })
    .await;
    let url = database_url(&connect);
    idem_cli(&url, &["gc"]).await;
    assert!(
        pins(&pool, "evt-twice").await.is_some(),
        "gc kept the record"
    );
    let all = replay::Options::default();
    let summary = replay::run(&q.connection, &store, &q.dlq(), Action::Replay, &all)
        .await
        .unwrap();
    assert_eq!((summary.replayed, summary.already_done), (0, 1));
    assert_eq!(effects(&pool).await, 1, "the effect ran once");
    assert_eq!(pins(&pool, "evt-twice").await, Some((0, false, false)));
    // With no letter left, the record goes with the next gc.
    idem_cli(&url, &["gc"]).await;
    assert_eq!(pins(&pool, "evt-twice").await, None);
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// A pass over a DLQ leaves at most its bound of letters unacked without acting on
/// them, then stops and says so; every letter stays in the DLQ.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_pass_over_a_large_dlq_holds_at_most_its_bound(pool: PgPool) {
    let q = TestQueue::new("hold").await;
    let durable = lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    q.channel
        .queue_declare(q.dlq().as_str().into(), durable, FieldTable::default())
        .await
        .unwrap();
    for i in 0..30 {
        let letter = headers(&[("idem-reason", "permanent_failure")]);
        q.publish_to(&q.dlq(), format!("letter {i}").as_bytes(), letter)
            .await;
    }
    let store = Store::new(pool.clone(), StoreConfig::default());
    let none = replay::Options {
        filter: replay::Filter {
            reason: Some("retries_exhausted".into()),
            ..replay::Filter::default()
        },
        hold: Some(10),
        ..replay::Options::default()
    };
    for action in [Action::Replay, Action::Discard] {
        let summary = replay::run(&q.connection, &store, &q.dlq(), action, &none)
            .await
            .unwrap();
        assert_eq!(
            (summary.skipped, summary.incomplete),
            (10, true),
            "{action:?}"
        );
    }
    let dry = replay::Options {
        dry_run: true,
        hold: Some(10),
        ..replay::Options::default()
    };
    let summary = replay::run(&q.connection, &store, &q.dlq(), Action::Discard, &dry)
        .await
        .unwrap();
    assert_eq!((summary.discarded, summary.incomplete), (10, true));
    q.wait_for_messages(&q.dlq(), 30, SETTLE).await;
}

/// The `arguments` rabbitmqctl lists for `queue`.
async fn arguments(queue: &str) -> String {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args(["-q", "list_queues", "name", "arguments"])
        .output()
        .await
        .expect("rabbitmqctl");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .find(|(name, _)| *name == queue)
        .map(|(_, args)| args.to_owned())
        .unwrap_or_default()
}

/// Quorum queues are declared to keep their messages: the work queue and the DLQ with
/// a delivery limit no count reaches (RabbitMQ 4 drops a message after 20 requeues
/// otherwise, and reading a DLQ requeues), the retry queues dead-lettering back at
/// least once. Queues an older idem declared without those arguments keep working.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn quorum_queues_are_declared_to_keep_their_messages(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    let q = TestQueue::new("quorum-keeps").await;
    let quorum = ["--queue-type", "quorum"];
    let _worker = spawn_orders_worker(&url, &q.name, &quorum);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    let limit = format!(
        "{{\"x-delivery-limit\",{}}}",
        idem::topology::DELIVERY_LIMIT
    );
    for queue in [q.name.clone(), q.dlq()] {
        let args = arguments(&queue).await;
        assert!(args.contains(&limit), "{queue}: {args}");
    }
    for delay in RETRY_DELAYS_MS {
        let queue = format!("{}.retry.{delay}ms", q.name);
        let args = arguments(&queue).await;
        assert!(
            args.contains("{\"x-dead-letter-strategy\",\"at-least-once\"}")
                && args.contains("{\"x-overflow\",\"reject-publish\"}"),
            "{queue}: {args}"
        );
    }
    // A dead letter read (and so requeued) 25 times is still there.
    q.publish(&order("evt-refused", "acme", -1)).await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    for _ in 0..25 {
        let read = replay::peek(&q.connection, &q.dlq(), &replay::Filter::default(), 10)
            .await
            .unwrap();
        assert_eq!(read.len(), 1);
    }
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;

    // Quorum queues as an older idem declared them: the worker uses them as they are.
    let old = TestQueue::new("quorum-older").await;
    let older = idem::Topology {
        queue: old.name.clone(),
        queue_type: idem::QueueType::Quorum,
        retry_delays: RETRY_DELAYS_MS.map(Duration::from_millis).to_vec(),
        subscriptions: Vec::new(),
        single_active_consumer: false,
    };
    declare_as_before(&old, &older).await;
    let worker = spawn_orders_worker(&url, &old.name, &quorum);
    wait_for_consumers(&old, 1).await;
    old.publish(&order("evt-older", "acme", 1)).await;
    wait_until(SETTLE, "the order booked", || async {
        ledger(&pool).await.get("evt-older") == Some(&1)
    })
    .await;
    let warning = "an older idem declared this quorum queue";
    assert_eq!(worker.log_count(warning), 2 + RETRY_DELAYS_MS.len());
}

/// Declares `topology`'s queues with the arguments idem gave quorum queues before
/// their delivery limit and at-least-once dead-lettering.
async fn declare_as_before(q: &TestQueue, topology: &idem::Topology) {
    let durable = lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let quorum = || {
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), header_text("quorum"));
        args
    };
    for queue in [topology.queue.clone(), topology.dlq()] {
        q.channel
            .queue_declare(queue.as_str().into(), durable, quorum())
            .await
            .unwrap();
    }
    for (queue, delay) in topology.retry_queues().iter().zip(&topology.retry_delays) {
        let mut args = quorum();
        let ttl = delay.as_millis() as i64;
        args.insert(
            "x-message-ttl".into(),
            lapin::types::AMQPValue::LongLongInt(ttl),
        );
        args.insert("x-dead-letter-exchange".into(), header_text(""));
        args.insert(
            "x-dead-letter-routing-key".into(),
            header_text(&topology.queue),
        );
        q.channel
            .queue_declare(queue.as_str().into(), durable, args)
            .await
            .unwrap();
    }
}

/// The value of `idem_retries_overdue` for `operation` on the worker's `/metrics`.
async fn overdue_gauge(addr: &str, operation: &str) -> Option<f64> {
    let (_, body) = scrape(addr, "/metrics").await;
    let series = format!("idem_retries_overdue{{operation=\"{operation}\"}} ");
    body.lines()
        .find_map(|line| line.strip_prefix(&series)?.trim().parse().ok())
}

/// A classic retry queue dead-letters its copies back at most once: a record whose
/// copy was lost waits for a delivery that never comes. The worker reports it as
/// overdue (gauge, warning) until a delivery of it arrives.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_retryable_record_whose_delivery_does_not_come_is_reported_overdue(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    let q = TestQueue::new("overdue").await;
    let addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().to_string()
    };
    let args = ["--metrics-addr", &addr, "--retry-overdue-secs", "1"];
    let worker = spawn_orders_worker(&url, &q.name, &args);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    // A delivery that failed transiently, its retry copy since lost.
    let body = order("evt-lost", "acme", 1);
    let payload: Value = serde_json::from_slice(&body).unwrap();
    let lost = RecordFixture {
        key: "evt-lost",
        status: "failed",
        retryable: true,
        fingerprint: Some(
            idem::Fingerprint::of(&payload, &["sent_at"])
                .as_hex()
                .into(),
        ),
        error: Some(json!({"error": "provider down", "kind": "transient"})),
        ..RecordFixture::default()
    };
    insert_record(&pool, &lost).await;
    wait_until(SETTLE, "the record reported overdue", || async {
        overdue_gauge(&addr, "orders.create").await == Some(1.0)
    })
    .await;
    assert!(worker.log_contains("retries overdue"));
    // The delivery comes after all: booked, and nothing is overdue any more.
    q.publish(&body).await;
    wait_until(SETTLE, "the order booked", || async {
        ledger(&pool).await.get("evt-lost") == Some(&1)
    })
    .await;
    wait_until(SETTLE, "nothing overdue", || async {
        overdue_gauge(&addr, "orders.create").await == Some(0.0)
    })
    .await;
}

/// What a message carries never reaches the operator's terminal as control
/// characters: `idem dlq list`, `dlq show` and `ops show` escape them. A reader that
/// goes away (`| head`) ends the command quietly.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn the_command_escapes_what_messages_carry_and_stops_quietly_for_a_closed_pipe(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    let q = TestQueue::new("escapes").await;
    let durable = lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    q.channel
        .queue_declare(q.dlq().as_str().into(), durable, FieldTable::default())
        .await
        .unwrap();
    let hostile = "\u{1b}]0;pwned\u{7}\u{1b}[2J\u{9b}31m\nfake line";
    let letter = headers(&[("idem-reason", "malformed"), ("idem-error", hostile)])
        .with_correlation_id(hostile.into());
    q.publish_to(&q.dlq(), hostile.as_bytes(), letter).await;
    let record = RecordFixture {
        key: "evt-escape",
        lease_secs: Some(30),
        correlation_id: Some(hostile),
        ..RecordFixture::default()
    };
    insert_record(&pool, &record).await;
    let key_args = [
        "--scope",
        "acme",
        "--operation",
        "orders.create",
        "--key",
        "evt-escape",
    ];
    for args in [
        &["dlq", "list", "--queue", &q.name][..],
        &["dlq", "show", "--queue", &q.name],
        &["dlq", "show", "--queue", &q.name, "--json"],
        &[&["ops", "show"][..], &key_args].concat(),
    ] {
        let out = idem_cli(&url, args).await;
        let raw = out.chars().find(|c| c.is_control() && *c != '\n');
        assert_eq!(
            raw, None,
            "idem {args:?} printed a control character: {out:?}"
        );
        assert!(!out.contains("\nfake line"), "idem {args:?}: {out}");
    }

    // Nobody reads: the command ends without a panic.
    let mut child = idem_command(&url, &["dlq", "show", "--queue", &q.name])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().await.unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !said.contains("panicked"),
        "{}: {said}",
        out.status
    );
}
