//! Poison-proof (docs/DESIGN.md, "Errors by cause"): a message's own fault ends in the
//! DLQ at once and never loops; an outage is waited out; an operation that was ever
//! uncertain is reconciled before it runs again, whatever path leads back to it.
//! Against the real broker and database.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::proxy::Proxy;
use common::*;
use idem::replay::{self, Action};
use idem::{Context, Handler, HandlerError, Reconciliation, Store, StoreConfig};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// "Within a few seconds": every hostile message is settled within this, or the test
/// fails (a message that loops never is).
const FEW_SECONDS: Duration = Duration::from_secs(15);
const SETTLE: Duration = Duration::from_secs(90);

fn order_with(event_id: &str, tenant: &str, order_id: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "event_id": event_id, "tenant": tenant, "order_id": order_id, "amount_cents": 1,
    }))
    .unwrap()
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn hostile_inputs_end_in_the_ledger_once_or_in_the_dlq_within_seconds(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("hostile").await;
    let mut worker = spawn_orders_worker(&database_url(&connect), &q.name, &[]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;

    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let mut invalid_utf8 = br#"{"event_id":"evt-"#.to_vec();
    invalid_utf8.extend_from_slice(&[0xff, 0xfe]);
    invalid_utf8.extend_from_slice(br#"","tenant":"acme","order_id":"o","amount_cents":1}"#);
    // (what, body, reason, what idem-error says)
    let hostile: Vec<(&str, Vec<u8>, &str, &str)> = vec![
        (
            "NUL in the key",
            order_with("evt-\u{0}", "acme", "o-1"),
            "malformed",
            "idempotency_key contains a NUL character",
        ),
        (
            "NUL in the scope",
            order_with("evt-scope", "ac\u{0}me", "o-2"),
            "malformed",
            "scope contains a NUL character",
        ),
        (
            "NUL in a field the handler writes",
            order_with("evt-order-id", "acme", "o-\u{0}"),
            "permanent_failure",
            "SQLSTATE 22021",
        ),
        (
            "a key of 600 bytes in 200 characters",
            order_with(&"€".repeat(200), "acme", "o-3"),
            "malformed",
            "idempotency_key is 600 bytes long, at most 500",
        ),
        (
            "a number out of range",
            br#"{"event_id":"evt-range","tenant":"acme","order_id":"o","amount_cents":1e40}"#
                .to_vec(),
            "malformed",
            "does not fit the message",
        ),
        (
            "invalid UTF-8 in a string",
            invalid_utf8,
            "malformed",
            "not JSON",
        ),
        (
            "nesting 100,000 deep",
            format!(
                r#"{{"event_id":"evt-deep","tenant":"acme","order_id":"o","amount_cents":1,"note":{deep}}}"#
            )
            .into_bytes(),
            "malformed",
            "recursion limit exceeded",
        ),
    ];
    let big = serde_json::to_vec(&json!({
        "event_id": "evt-big", "tenant": "acme", "order_id": "o-big", "amount_cents": 1,
        "note": "x".repeat(6 << 20),
    }))
    .unwrap();

    q.publish(&order("evt-before", "acme", 1)).await;
    let started = Instant::now();
    for (_, body, _, _) in &hostile {
        q.publish(body).await;
    }
    // A message property Postgres cannot store, between good messages of its batch: it
    // is kept with U+FFFD for the NUL, and booked like its neighbours.
    q.publish_with_id(&order("evt-neighbour-1", "acme", 1), "m-1")
        .await;
    q.publish_with_id(&order("evt-bad-id", "acme", 1), "m-\u{0}")
        .await;
    q.publish_with_id(&order("evt-neighbour-2", "acme", 1), "m-2")
        .await;
    q.publish(&big).await;
    q.publish(&order("evt-after", "acme", 1)).await;

    let expected_dead = hostile.len() as u32;
    let good = [
        "evt-before",
        "evt-neighbour-1",
        "evt-bad-id",
        "evt-neighbour-2",
        "evt-big",
        "evt-after",
    ];
    wait_until(FEW_SECONDS, "hostile messages settled", || async {
        let booked = ledger(&pool).await;
        q.counts(&q.dlq()).await.0 == expected_dead && good.iter().all(|e| booked.contains_key(*e))
    })
    .await;
    println!(
        "hostile: {expected_dead} dead-lettered and {} booked in {:?}",
        good.len(),
        started.elapsed()
    );

    let dead = q.drain(&q.dlq()).await;
    let mut by_body: BTreeMap<Vec<u8>, _> =
        dead.iter().map(|d| (d.delivery.data.to_vec(), d)).collect();
    for (what, body, reason, error) in &hostile {
        let d = by_body
            .remove(body)
            .unwrap_or_else(|| panic!("{what}: not in the DLQ"));
        assert_eq!(d.reason.as_deref(), Some(*reason), "{what}");
        let said = d.error.as_deref().unwrap_or_default();
        assert!(said.contains(error), "{what}: idem-error {said:?}");
    }
    assert!(by_body.is_empty(), "nothing else dead-lettered");
    let message_id: String = sqlx::query_scalar(
        "SELECT message_id FROM processed_operations WHERE idempotency_key = 'evt-bad-id'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(message_id, "m-\u{FFFD}");
    for d in &dead {
        let retries = idem::headers::integer(&d.delivery.properties, idem::headers::RETRIES);
        assert_eq!(retries.unwrap_or(0), 0, "went through a retry queue: {d:?}");
    }
    let booked = ledger(&pool).await;
    for event in good {
        assert_eq!(booked.get(event), Some(&1), "{event} booked once");
    }
    assert_eq!(
        booked.len(),
        good.len(),
        "nothing hostile booked: {booked:?}"
    );
    assert!(
        worker.child.try_wait().unwrap().is_none(),
        "the worker is alive"
    );
    assert!(
        !worker.log_contains("requeueing") && !worker.log_contains("failed_transient"),
        "no hostile message was retried as an outage"
    );
}

/// A header of `bytes` bytes, near the broker's `frame_max` (131,072) when large.
fn with_header(bytes: usize) -> lapin::BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert("note".into(), header_text(&"h".repeat(bytes)));
    headers.insert("tag".into(), header_text("t"));
    lapin::BasicProperties::default()
        .with_message_id(uuid::Uuid::new_v4().to_string().into())
        .with_headers(headers)
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn values_and_headers_near_the_brokers_frame_are_dead_lettered_once_and_the_worker_stays_connected(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("frame").await;
    let worker = spawn_orders_worker(&database_url(&connect), &q.name, &[]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;

    // A 140 KB string where a number belongs: serde's error quotes it whole.
    let huge = serde_json::to_vec(&json!({
        "event_id": "evt-huge", "tenant": "acme", "order_id": "o",
        "amount_cents": "x".repeat(140_000),
    }))
    .unwrap();
    q.publish(&huge).await;
    // A producer header near frame_max on a malformed body, and on an order that fails
    // for good: what idem adds would push either over the frame.
    q.publish_to(&q.name, b"not json", with_header(130_900))
        .await;
    q.publish_to(
        &q.name,
        &order("evt-refused", "acme", -1),
        with_header(130_900),
    )
    .await;
    let good: Vec<String> = (0..20).map(|i| format!("evt-good-{i}")).collect();
    for event in &good {
        q.publish(&order(event, "acme", 1)).await;
    }
    wait_until(FEW_SECONDS, "every message settled", || async {
        q.counts(&q.dlq()).await.0 == 3
            && ledger(&pool).await.len() == good.len()
            && q.counts(&q.name).await.0 == 0
            && unacked(&q.name).await == 0
    })
    .await;

    let dead = q.drain(&q.dlq()).await;
    assert_eq!(dead.len(), 3, "each dead-lettered once");
    let huge_letter = dead.iter().find(|d| *d.delivery.data == *huge).unwrap();
    assert_eq!(huge_letter.reason.as_deref(), Some("malformed"));
    let said = huge_letter.error.as_deref().unwrap_or_default();
    assert!(
        said.len() <= idem::headers::ERROR_MAX && said.contains("invalid type: string"),
        "idem-error of {} bytes: {}",
        said.len(),
        &said[..said.len().min(200)]
    );
    for letter in dead.iter().filter(|d| *d.delivery.data != *huge) {
        let p = &letter.delivery.properties;
        let note = idem::headers::text(p, "note");
        assert!(
            note.is_none(),
            "{:?}: the big header was carried",
            letter.reason
        );
        assert_eq!(
            idem::headers::integer(p, idem::headers::DROPPED_HEADERS),
            Some(2)
        );
        assert!(p.message_id().is_some(), "the properties are kept");
    }
    let reasons: BTreeMap<String, usize> = dead.iter().fold(BTreeMap::new(), |mut m, d| {
        *m.entry(d.reason.clone().unwrap_or_default()).or_default() += 1;
        m
    });
    assert_eq!(
        reasons,
        BTreeMap::from([("malformed".into(), 2), ("permanent_failure".into(), 1)])
    );
    let booked = ledger(&pool).await;
    assert!(good.iter().all(|e| booked.get(e) == Some(&1)), "{booked:?}");
    assert_eq!(
        worker.log_count("dead-lettering"),
        3,
        "each dead-lettered once"
    );
    assert!(
        !worker.log_contains("broker connection lost"),
        "the worker stayed connected"
    );
    assert_eq!(
        worker.log_count(" consuming "),
        1,
        "one connection throughout"
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_queue_declared_with_other_arguments_stops_the_worker_with_one_line(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let _pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("mismatch").await;
    // A classic queue of that name exists already; the worker wants a quorum queue.
    q.channel
        .queue_declare(
            q.name.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut worker = spawn_orders_worker(
        &database_url(&connect),
        &q.name,
        &["--queue-type", "quorum"],
    );
    let status = tokio::time::timeout(Duration::from_secs(30), worker.child.wait())
        .await
        .expect("the worker stops within seconds")
        .unwrap();
    assert!(!status.success(), "exit status {status}");
    let log = std::fs::read_to_string(&worker.log).unwrap();
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("orders_worker: error:")
            && last.contains(&q.name)
            && last.contains("inequivalent arg 'x-queue-type'"),
        "last line: {last}"
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn discard_acks_before_it_unpins_and_a_discarded_failure_stays_settled(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("discard-order").await;
    let url = database_url(&connect);
    let _worker = spawn_orders_worker(&url, &q.name, &["--concurrency", "1", "--prefetch", "1"]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    q.publish(&order("evt-crash", "acme", -1)).await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;

    // Killed between the two steps of a discard.
    let out = idem_command(&url, &["dlq", "discard", "--queue", &q.name])
        .env("IDEM_FAILPOINT", "discard-acked")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "the failpoint aborts the discard");
    let in_dlq = q.counts(&q.dlq()).await.0;
    let pinned: bool = sqlx::query_scalar(
        "SELECT dead_lettered_at IS NOT NULL FROM processed_operations
         WHERE idempotency_key = 'evt-crash'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        in_dlq == 0 || pinned,
        "a dead letter still waits ({in_dlq}) while its record may expire"
    );

    // A completed discard: a later duplicate of the failure is acked, not dead-lettered
    // again.
    q.publish(&order("evt-discarded", "acme", -1)).await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    let (code, _) = run_idem(&url, &["dlq", "discard", "--queue", &q.name]).await;
    assert_eq!(code, 0);
    q.publish(&order("evt-discarded", "acme", -1)).await;
    q.publish(&order("evt-marker", "acme", 1)).await;
    wait_until(SETTLE, "the marker booked", || async {
        ledger(&pool).await.contains_key("evt-marker")
    })
    .await;
    assert_eq!(
        q.counts(&q.dlq()).await.0,
        0,
        "the duplicate of a discarded failure was dead-lettered again"
    );
}

/// A handler whose runs and reconciliations follow a script per event, and that
/// writes down every call in order.
#[derive(Clone, Default)]
struct Scripted {
    calls: Arc<Mutex<Vec<(String, &'static str)>>>,
}

#[derive(Deserialize)]
struct Job {
    event_id: String,
}

/// An output that refuses to serialize when `poisoned`.
struct Out {
    text: String,
    poisoned: bool,
}

impl Out {
    fn ok(text: &str) -> Self {
        Self {
            text: text.into(),
            poisoned: false,
        }
    }
}

impl Serialize for Out {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.poisoned {
            return Err(serde::ser::Error::custom("poisoned output"));
        }
        json!({ "text": self.text }).serialize(s)
    }
}

impl Scripted {
    /// Notes a call; returns how many of this kind this event had, this one included.
    fn note(&self, event: &str, call: &'static str) -> usize {
        let mut calls = self.calls.lock().unwrap();
        calls.push((event.to_owned(), call));
        calls
            .iter()
            .filter(|(e, c)| e == event && *c == call)
            .count()
    }

    fn calls_of(&self, event: &str) -> Vec<&'static str> {
        let calls = self.calls.lock().unwrap();
        calls
            .iter()
            .filter(|(e, _)| e == event)
            .map(|(_, c)| *c)
            .collect()
    }
}

impl Handler for Scripted {
    type Message = Job;
    type Output = Out;
    const OPERATION: &'static str = "jobs.scripted";

    fn scope(&self, _: &Job) -> String {
        "tests".into()
    }

    fn idempotency_key(&self, job: &Job) -> String {
        job.event_id.clone()
    }

    async fn handle(&self, job: Job, _: &mut Context) -> Result<Out, HandlerError> {
        let n = self.note(&job.event_id, "handle");
        match (job.event_id.as_str(), n) {
            ("evt-uncertain", 1) => Err(HandlerError::uncertain(
                Some("ref-1".into()),
                "timed out after sending",
            )),
            ("evt-unserializable", 1) => Ok(Out {
                text: "x".into(),
                poisoned: true,
            }),
            ("evt-nul-result", 1) => Ok(Out::ok("a\u{0}b")),
            _ => Ok(Out::ok("ran")),
        }
    }

    async fn reconcile(
        &self,
        job: &Job,
        _: Option<&str>,
        _: &mut Context,
    ) -> Result<Reconciliation<Out>, HandlerError> {
        let n = self.note(&job.event_id, "reconcile");
        match (job.event_id.as_str(), n) {
            ("evt-uncertain", 1) => Err(HandlerError::permanent("provider lookup refused")),
            ("evt-uncertain", _) => Ok(Reconciliation::NotApplied),
            _ => Ok(Reconciliation::Applied(Out::ok("found"))),
        }
    }
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn an_operation_ever_uncertain_is_reconciled_before_it_runs_again(pool: PgPool) {
    let q = TestQueue::new("ever-uncertain").await;
    let handler = Scripted::default();
    let (shutdown, task) = start_in_process(&pool, &q, handler.clone(), |_| {}).await;
    let events = [
        "evt-uncertain",
        "evt-unserializable",
        "evt-nul-result",
        "evt-plain",
    ];
    for event in events {
        q.publish(&serde_json::to_vec(&json!({ "event_id": event })).unwrap())
            .await;
    }
    q.wait_for_messages(&q.dlq(), 3, SETTLE).await;
    let failed: Vec<(String, bool)> = sqlx::query_as(
        "SELECT idempotency_key, reconcile_first FROM processed_operations
         WHERE status = 'failed' ORDER BY idempotency_key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        failed,
        vec![
            ("evt-nul-result".to_owned(), true),
            ("evt-uncertain".to_owned(), true),
            ("evt-unserializable".to_owned(), true),
        ]
    );
    let dead = replay::peek(&q.connection, &q.dlq(), &replay::Filter::default(), 10)
        .await
        .unwrap();
    let errors: BTreeMap<String, String> = dead
        .iter()
        .map(|d| {
            assert_eq!(d.reason.as_deref(), Some("permanent_failure"));
            (d.key.clone().unwrap(), d.error.clone().unwrap())
        })
        .collect();
    drop(dead);
    assert_eq!(errors["evt-uncertain"], "provider lookup refused");
    assert!(errors["evt-unserializable"].contains("poisoned output"));
    assert!(
        errors["evt-nul-result"].starts_with("the result could not be stored:")
            && errors["evt-nul-result"].contains("SQLSTATE 22P05"),
        "{}",
        errors["evt-nul-result"]
    );

    // An operator replays the three.
    let store = Store::new(pool.clone(), StoreConfig::default());
    let summary = replay::run(
        &q.connection,
        &store,
        &q.dlq(),
        Action::Replay,
        &replay::Options::default(),
    )
    .await
    .unwrap();
    assert_eq!(summary.replayed, 3);
    wait_until(SETTLE, "every operation completed", || async {
        statuses(&pool).await == BTreeMap::from([("completed".to_owned(), 4)])
    })
    .await;
    assert_eq!(
        handler.calls_of("evt-uncertain"),
        ["handle", "reconcile", "reconcile", "handle"],
        "run again only after reconcile said not applied"
    );
    assert_eq!(
        handler.calls_of("evt-unserializable"),
        ["handle", "reconcile"]
    );
    assert_eq!(handler.calls_of("evt-nul-result"), ["handle", "reconcile"]);
    assert_eq!(handler.calls_of("evt-plain"), ["handle"]);
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// CPU time (user + system) a process has used, from /proc.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which ends with the last ')'): utime is the 12th,
    // stime the 13th, in clock ticks (100 per second on Linux).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

async fn healthz(port: u16) -> (u16, String) {
    scrape(&format!("127.0.0.1:{port}"), "/healthz").await
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn postgres_gone_for_30_s_under_load_is_waited_out_and_everything_done_once(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let server: SocketAddr = format!("{}:{}", connect.get_host(), connect.get_port())
        .parse()
        .unwrap();
    let proxy = Proxy::start(server).await;
    let through_proxy = database_url(&connect.clone().port(proxy.port));
    let metrics_port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let q = TestQueue::new("pg-outage").await;
    let mut worker = spawn_orders_worker(
        &through_proxy,
        &q.name,
        &[
            "--lease-secs",
            "5",
            "--metrics-addr",
            &format!("127.0.0.1:{metrics_port}"),
        ],
    );
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    assert_eq!(healthz(metrics_port).await.0, 200);

    let n = 400;
    let events: Vec<String> = (0..n).map(|i| format!("evt-{i}")).collect();
    for event in &events[..n / 2] {
        q.publish(&order(event, "acme", 1)).await;
    }
    // Cut while the first half is being worked on.
    wait_until(SETTLE, "some orders booked", || async {
        ledger(&pool).await.len() >= 20
    })
    .await;
    proxy.cut().await;
    let cut = Instant::now();
    for event in &events[n / 2..] {
        q.publish(&order(event, "acme", 1)).await;
    }
    // Let the first failures pass, then measure what waiting costs.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let cpu_before = cpu_time(worker.pid());
    let measured_from = Instant::now();
    wait_until(
        Duration::from_secs(20),
        "/healthz to say the database is down",
        || async {
            let (status, body) = healthz(metrics_port).await;
            status == 503 && body.contains("database: down (")
        },
    )
    .await;
    let (_, body) = healthz(metrics_port).await;
    println!(
        "healthz during the outage: {}",
        body.trim().replace('\n', "; ")
    );
    tokio::time::sleep(Duration::from_secs(30).saturating_sub(cut.elapsed())).await;
    let cpu = cpu_time(worker.pid()).saturating_sub(cpu_before);
    let window = measured_from.elapsed();
    assert!(
        worker.child.try_wait().unwrap().is_none(),
        "the worker is alive"
    );
    proxy.restore().await;
    println!(
        "postgres outage: worker CPU {cpu:?} in {window:?} ({:.1}%)",
        cpu.as_secs_f64() * 100.0 / window.as_secs_f64()
    );
    assert!(
        cpu.as_secs_f64() < 0.05 * window.as_secs_f64(),
        "the worker used {cpu:?} of CPU in {window:?} while Postgres was gone"
    );

    wait_until(SETTLE, "every order booked after the outage", || async {
        ledger(&pool).await.len() == n
    })
    .await;
    wait_until(SETTLE, "every record completed", || async {
        statuses(&pool).await == BTreeMap::from([("completed".to_owned(), n as i64)])
    })
    .await;
    let booked = ledger(&pool).await;
    assert!(booked.values().all(|&c| c == 1), "an order booked twice");
    let split = provider_calls(&pool)
        .await
        .values()
        .filter(|(_, keys)| *keys != 1)
        .count();
    assert_eq!(split, 0, "one provider key per order");
    assert_eq!(q.counts(&q.dlq()).await.0, 0, "nothing dead-lettered");
    assert_eq!(healthz(metrics_port).await.0, 200);
    assert!(worker.child.try_wait().unwrap().is_none());
}

/// Ignores the error of a statement it ran through `ctx.tx()`, leaving the transaction
/// aborted, and returns as if all went well.
#[derive(Clone, Default)]
struct IgnoresItsError {
    runs: Arc<Mutex<usize>>,
}

impl Handler for IgnoresItsError {
    type Message = Job;
    type Output = serde_json::Value;
    const OPERATION: &'static str = "jobs.ignores-its-error";

    fn scope(&self, _: &Job) -> String {
        "tests".into()
    }

    fn idempotency_key(&self, job: &Job) -> String {
        job.event_id.clone()
    }

    async fn handle(&self, _: Job, ctx: &mut Context) -> Result<serde_json::Value, HandlerError> {
        *self.runs.lock().unwrap() += 1;
        let failed = sqlx::query("SELECT 1 / 0").execute(ctx.tx().await?).await;
        assert!(failed.is_err());
        Ok(json!({"fine": true}))
    }
}

/// A handler that leaves its transaction aborted (SQLSTATE 25P02 at completion) goes
/// through the retry tiers and ends as `retries_exhausted`, in both modes: it neither
/// loops for ever between its own lease and a takeover, nor is retried as an outage.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_handler_that_leaves_its_transaction_aborted_ends_in_the_dlq(pool: PgPool) {
    for mode in [idem::Mode::Leased, idem::Mode::Transactional] {
        let q = TestQueue::new(&format!("aborted-{}", mode.as_str())).await;
        let handler = IgnoresItsError::default();
        let (shutdown, task) = start_in_process(&pool, &q, handler.clone(), |config| {
            config.mode = mode;
        })
        .await;
        q.publish(&serde_json::to_vec(&json!({"event_id": "evt-aborted"})).unwrap())
            .await;
        q.wait_for_messages(&q.dlq(), 1, FEW_SECONDS).await;
        let dead = q.drain(&q.dlq()).await;
        assert_eq!(
            dead[0].reason.as_deref(),
            Some("retries_exhausted"),
            "{mode:?}"
        );
        let said = dead[0].error.as_deref().unwrap_or_default();
        assert!(said.contains("25P02"), "{mode:?}: {said}");
        // One run per claim: the first and its immediate retry, then the same after
        // each of the two delayed retries.
        let runs = *handler.runs.lock().unwrap();
        println!("{mode:?}: {runs} runs, then dead-lettered: {said}");
        assert!((2..=12).contains(&runs), "{mode:?}: {runs} runs");
        shutdown.cancel();
        task.await.unwrap().unwrap();
        sqlx::query("DELETE FROM processed_operations")
            .execute(&pool)
            .await
            .unwrap();
    }
}
