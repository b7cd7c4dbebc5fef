//! Shared test harness: a unique queue per test on the real RabbitMQ, the test's own
//! database (from `#[sqlx::test]`), worker processes, and waiting with deadlines.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use idem::replay::DlqMessage;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection};
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tokio::process::{Child, Command};

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| idem::topology::DEFAULT_AMQP_URL.into())
}

/// The URL of the test's own database, for worker processes and the `idem` command:
/// through PgBouncer when `IDEM_TEST_PGBOUNCER` names one (`host:port`, in session
/// pooling; `scripts/test` runs the process tests through it a second time).
pub fn database_url(options: &PgConnectOptions) -> String {
    // PgConnectOptions does not expose the password: take it from DATABASE_URL.
    let url = std::env::var("DATABASE_URL").unwrap_or_default();
    let password = url
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .and_then(|(credentials, _)| credentials.split_once(':'))
        .map(|(_, password)| password.to_string())
        .unwrap_or_default();
    let server = match std::env::var("IDEM_TEST_PGBOUNCER") {
        Ok(bouncer) if !bouncer.is_empty() => bouncer,
        _ => format!("{}:{}", options.get_host(), options.get_port()),
    };
    format!(
        "postgres://{}:{}@{}/{}",
        options.get_username(),
        password,
        server,
        options.get_database().unwrap_or("postgres"),
    )
}

/// `database_url` on the server that `IDEM_TEST_SESSION_SERVER` names (`host:port`),
/// for what needs a session of its own when `IDEM_TEST_PGBOUNCER` pools transactions
/// (`scripts/test`'s transaction-pooling pass): the processes' `DATABASE_SESSION_URL`.
pub fn session_url(database_url: &str) -> Option<String> {
    let server = std::env::var("IDEM_TEST_SESSION_SERVER").ok()?;
    let (head, rest) = database_url.split_once('@')?;
    let (_, database) = rest.split_once('/')?;
    Some(format!("{head}@{server}/{database}"))
}

/// This process runs as root (its effective uid is 0): the drills start nodes as other
/// users.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

/// Polls `check` every 50 ms until it returns true, failing after `limit`.
pub async fn wait_until<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A unique queue on the real broker, with its retry queues and DLQ deleted on drop.
pub struct TestQueue {
    pub name: String,
    pub connection: Connection,
    pub channel: Channel,
    /// Exchanges a test declared through idem, deleted on drop with the queues.
    exchanges: std::sync::Mutex<Vec<String>>,
}

impl TestQueue {
    pub async fn new(test: &str) -> Self {
        let name = format!(
            "test.{test}.{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let connection = idem::topology::connect(&amqp_url(), &format!("test-{test}"))
            .await
            .expect("connect to RabbitMQ");
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        Self {
            name,
            connection,
            channel,
            exchanges: Default::default(),
        }
    }

    /// An exchange named `<this queue>.<suffix>`, deleted on drop (whether the test
    /// passed or not).
    pub fn exchange(&self, suffix: &str) -> String {
        let name = format!("{}.{suffix}", self.name);
        self.exchanges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(name.clone());
        name
    }

    /// Declares this queue durable, with no arguments (a plain queue, as a follow-up's
    /// target or a test of the broker's answers, not a worker's).
    pub async fn declare_plain(&self) {
        self.channel
            .queue_declare(
                self.name.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare the queue");
    }

    pub fn dlq(&self) -> String {
        idem::topology::dlq_name(&self.name)
    }

    /// Another test queue named `<this queue>.<suffix>` (deleted on drop too).
    pub async fn beside(&self, suffix: &str) -> TestQueue {
        let mut other = TestQueue::new("beside").await;
        other.name = format!("{}.{suffix}", self.name);
        other
    }

    /// Publishes a persistent message with a fresh message id, confirmed.
    pub async fn publish(&self, body: &[u8]) {
        self.publish_with_id(body, &uuid::Uuid::new_v4().to_string())
            .await;
    }

    /// Publishes a persistent message with `message_id`, confirmed.
    pub async fn publish_with_id(&self, body: &[u8], message_id: &str) {
        let properties = BasicProperties::default().with_message_id(message_id.into());
        self.publish_to(&self.name, body, properties).await;
    }

    /// Publishes `body` persistently to `queue` with `properties`, confirmed.
    pub async fn publish_to(&self, queue: &str, body: &[u8], properties: BasicProperties) {
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body,
                properties.with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack());
    }

    /// Messages ready and consumers of `queue` (0, 0 if it does not exist yet).
    pub async fn counts(&self, queue: &str) -> (u32, u32) {
        idem::topology::queue_counts(&self.connection, queue)
            .await
            .expect("the broker answers")
            .map_or((0, 0), |c| (c.ready, c.consumers))
    }

    /// Takes every message out of `queue`, with what its `idem-*` headers say.
    pub async fn drain(&self, queue: &str) -> Vec<DlqMessage> {
        let mut out = Vec::new();
        while let Some(message) = self
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
        {
            message
                .delivery
                .ack(BasicAckOptions::default())
                .await
                .unwrap();
            out.push(DlqMessage::new(message.delivery));
        }
        out
    }

    /// Waits until `queue` holds `n` messages.
    pub async fn wait_for_messages(&self, queue: &str, n: u32, limit: Duration) {
        wait_until(limit, &format!("{n} messages in {queue}"), || async {
            self.counts(queue).await.0 == n
        })
        .await;
    }
}

impl Drop for TestQueue {
    fn drop(&mut self) {
        let url = amqp_url();
        let base = self.name.clone();
        let exchanges =
            std::mem::take(&mut *self.exchanges.lock().unwrap_or_else(|e| e.into_inner()));
        // Drop cannot await: delete the queues from a thread with its own runtime.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async move {
                let connection = idem::topology::connect(&url, "test-cleanup").await.ok()?;
                let channel = connection.create_channel().await.ok()?;
                let topology = idem::Topology {
                    queue: base.clone(),
                    queue_type: idem::QueueType::Classic,
                    retry_delays: RETRY_DELAYS_MS.map(Duration::from_millis).to_vec(),
                    subscriptions: Vec::new(),
                    single_active_consumer: false,
                };
                // And the tier of a test that puts its retry copies off.
                let long = idem::Topology {
                    retry_delays: vec![Duration::from_millis(LONG_RETRY_DELAY_MS)],
                    ..topology.clone()
                };
                let queues = [base, topology.dlq()]
                    .into_iter()
                    .chain(topology.retry_queues())
                    .chain(long.retry_queues());
                for queue in queues {
                    let _ = channel
                        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
                for exchange in exchanges {
                    let _ = channel
                        .exchange_delete(
                            exchange.as_str().into(),
                            lapin::options::ExchangeDeleteOptions::default(),
                        )
                        .await;
                }
                let _ = connection.close(200, "cleanup".into()).await;
                Some(())
            })
        })
        .join();
    }
}

/// An order body with its keys in the given order and a fresh `sent_at`.
pub fn order(event_id: &str, tenant: &str, amount_cents: i64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "event_id": event_id,
        "tenant": tenant,
        "order_id": format!("o-{event_id}"),
        "amount_cents": amount_cents,
        "sent_at": chrono::Utc::now().to_rfc3339(),
    }))
    .unwrap()
}

/// The same order resent: reordered keys, new `sent_at`, order_id as a number-free string.
pub fn order_resent(event_id: &str, tenant: &str, amount_cents: i64) -> Vec<u8> {
    format!(
        r#"{{"sent_at":"{}","amount_cents":{amount_cents},"order_id":"o-{event_id}","tenant":"{tenant}","event_id":"{event_id}"}}"#,
        chrono::Utc::now().to_rfc3339()
    )
    .into_bytes()
}

/// Ledger rows per event.
pub async fn ledger(pool: &PgPool) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM example_ledger GROUP BY event_id")
            .fetch_all(pool)
            .await
            .unwrap_or_default();
    rows.into_iter().collect()
}

/// Provider calls per event: (calls, distinct keys).
pub async fn provider_calls(pool: &PgPool) -> BTreeMap<String, (i64, i64)> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT event_id, count(*), count(DISTINCT idempotency_key)
         FROM example_provider_calls GROUP BY event_id",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    rows.into_iter().map(|(e, c, k)| (e, (c, k))).collect()
}

/// Records per status.
pub async fn statuses(pool: &PgPool) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM processed_operations GROUP BY status")
            .fetch_all(pool)
            .await
            .unwrap_or_default();
    rows.into_iter().collect()
}

/// The `orders_worker` example binary, built by `cargo test` beside the tests.
pub fn orders_worker_path() -> PathBuf {
    example_path("orders_worker")
}

/// An example binary, built by `cargo test` beside the tests.
pub fn example_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} missing: build with cargo test",
        path.display()
    );
    path
}

/// What a drill printed: its summary line (`<name>: key=value …`) read into a map, and
/// how it ended.
pub struct Drill {
    pub summary: String,
    pub fields: BTreeMap<String, String>,
    pub success: bool,
    pub stderr: String,
}

impl Drill {
    /// Fails the test unless every `key=value` pair is in the summary, as a whole field
    /// (`kills=6` is not satisfied by `backend_kills=6`).
    pub fn expect(&self, pairs: &[(&str, &str)]) {
        for (key, value) in pairs {
            assert_eq!(
                self.fields.get(*key).map(String::as_str),
                Some(*value),
                "{key} in: {}\n{}",
                self.summary,
                self.stderr
            );
        }
    }
}

/// A summary line's `key=value` fields (the words without `=` left out).
pub fn summary_fields(line: &str) -> BTreeMap<String, String> {
    line.split_whitespace()
        .filter_map(|word| word.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Runs the drill example `name` with `args` (at most `limit`), prints its output and
/// returns its summary line (the one starting with `<name>: `) read into fields, its
/// success and stderr.
pub async fn run_drill(name: &str, args: &[&str], limit: Duration) -> Drill {
    let run = Command::new(example_path(name))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("{name} finishes within {limit:?}"))
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    println!("{stdout}");
    let prefix = format!("{name}: ");
    let summary = stdout
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no summary line; stderr: {stderr}"))
        .to_owned();
    Drill {
        fields: summary_fields(&summary),
        summary,
        success: out.status.success(),
        stderr,
    }
}

/// An `orders_worker` process and its log file.
pub struct WorkerProcess {
    pub child: Child,
    pub log: PathBuf,
}

impl WorkerProcess {
    pub fn pid(&self) -> u32 {
        self.child.id().expect("worker is running")
    }

    pub fn log_contains(&self, needle: &str) -> bool {
        std::fs::read_to_string(&self.log)
            .map(|text| text.contains(needle))
            .unwrap_or(false)
    }

    /// How many times `needle` occurs in the log so far.
    pub fn log_count(&self, needle: &str) -> usize {
        std::fs::read_to_string(&self.log)
            .map(|text| text.matches(needle).count())
            .unwrap_or(0)
    }
}

/// Starts an `orders_worker` process on `queue` and the test's database, logging to a
/// file under the temp dir (kept for post-mortems).
pub fn spawn_orders_worker(database_url: &str, queue: &str, extra: &[&str]) -> WorkerProcess {
    spawn_orders_worker_with_env(database_url, queue, extra, &[])
}

/// The retry queue delays of every worker a test starts (the in-process workers of
/// `tests/worker.rs` use the first ones): the queues a test's cleanup deletes.
pub const RETRY_DELAYS_MS: [u64; 3] = [100, 200, 300];

/// A retry delay that no test waits out (ten minutes): a test whose retry copies must
/// not come back passes it; the test queue's cleanup deletes its tier too.
pub const LONG_RETRY_DELAY_MS: u64 = 600_000;

fn retry_delays_arg() -> String {
    RETRY_DELAYS_MS.map(|ms| ms.to_string()).join(",")
}

/// [`spawn_orders_worker`] with extra environment variables.
pub fn spawn_orders_worker_with_env(
    database_url: &str,
    queue: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> WorkerProcess {
    let mut args = vec!["--queue", queue, "--retry-delays-ms"];
    let delays = retry_delays_arg();
    args.push(&delays);
    args.extend_from_slice(extra);
    spawn_example("orders_worker", database_url, queue, &args, env)
}

/// An `accounts_worker` process on `queue` (order per entity), with the tests' retry
/// tiers.
pub fn spawn_accounts_worker(database_url: &str, queue: &str, extra: &[&str]) -> WorkerProcess {
    spawn_accounts_worker_with_env(database_url, queue, extra, &[])
}

/// [`spawn_accounts_worker`] with extra environment variables (`IDEM_KEYS`).
pub fn spawn_accounts_worker_with_env(
    database_url: &str,
    queue: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> WorkerProcess {
    let delays = retry_delays_arg();
    let mut args = vec!["--queue", queue, "--retry-delays-ms", &delays];
    args.extend_from_slice(extra);
    spawn_example("accounts_worker", database_url, queue, &args, env)
}

/// A `notifications_worker` process on `queue` (the follow-ups of `orders_worker
/// --follow-ups`).
pub fn spawn_notifications_worker(database_url: &str, queue: &str) -> WorkerProcess {
    let delays = retry_delays_arg();
    let args = ["--queue", queue, "--retry-delays-ms", &delays];
    spawn_example("notifications_worker", database_url, queue, &args, &[])
}

/// A `shop` process (the example service) with its queues under `prefix`.
pub fn spawn_shop(database_url: &str, prefix: &str, extra: &[&str]) -> WorkerProcess {
    let delays = retry_delays_arg();
    let mut args = vec!["--prefix", prefix, "--retry-delays-ms", &delays];
    args.extend_from_slice(extra);
    spawn_example("shop", database_url, prefix, &args, &[])
}

/// A `payments_api` process listening on 127.0.0.1:`port` (the HTTP layer's example).
pub fn spawn_payments_api(database_url: &str, port: u16, extra: &[&str]) -> WorkerProcess {
    spawn_payments_api_with_env(database_url, port, extra, &[])
}

/// [`spawn_payments_api`] with extra environment variables (`IDEM_FAILPOINT`).
pub fn spawn_payments_api_with_env(
    database_url: &str,
    port: u16,
    extra: &[&str],
    env: &[(&str, &str)],
) -> WorkerProcess {
    let listen = format!("127.0.0.1:{port}");
    let mut args = vec!["--listen", listen.as_str()];
    args.extend_from_slice(extra);
    let name = format!("payments-{port}");
    spawn_example("payments_api", database_url, &name, &args, env)
}

/// Starts the example `name` with `args` on the test's database, logging to a file
/// under the temp dir named after `queue` (kept for post-mortems).
fn spawn_example(
    name: &str,
    database_url: &str,
    queue: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> WorkerProcess {
    let log_dir = std::env::temp_dir().join("idem-test-logs");
    let _ = std::fs::create_dir_all(&log_dir);
    let log = log_dir.join(format!(
        "{queue}-{name}-{}.log",
        uuid::Uuid::new_v4().simple()
    ));
    let file = std::fs::File::create(&log).unwrap();
    let mut command = Command::new(example_path(name));
    if let Some(session) = session_url(database_url) {
        command.env("DATABASE_SESSION_URL", session);
    }
    let child = command
        .args(args)
        .env("DATABASE_URL", database_url)
        .env("AMQP_URL", amqp_url())
        .env("RUST_LOG", "info,sqlx=warn")
        .env("NO_COLOR", "1")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(file)
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
    WorkerProcess { child, log }
}

/// Notifications written by `notifications_worker`, per order event.
pub async fn notifications(pool: &PgPool) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT order_event_id, count(*) FROM example_notifications GROUP BY order_event_id",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    rows.into_iter().collect()
}

/// The `idem` command with the test's database and broker (killed if dropped).
pub fn idem_command(database_url: &str, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    if let Some(session) = session_url(database_url) {
        command.env("DATABASE_SESSION_URL", session);
    }
    command
        .args(args)
        .env("DATABASE_URL", database_url)
        .env("AMQP_URL", amqp_url())
        .kill_on_drop(true);
    command
}

/// Runs the `idem` command; returns (exit code, stdout), with stderr printed when it
/// fails.
pub async fn run_idem(database_url: &str, args: &[&str]) -> (i32, String) {
    let out = idem_command(database_url, args).output().await.unwrap();
    if !out.status.success() {
        eprintln!(
            "idem {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Runs the `idem` command; its stdout (the test fails if it fails).
pub async fn idem_cli(database_url: &str, args: &[&str]) -> String {
    let (code, stdout) = run_idem(database_url, args).await;
    assert_eq!(
        code, 0,
        "idem {args:?} failed (its stderr is printed above)"
    );
    stdout
}

/// The broker's connections whose client-provided name is `name`: their pids
/// (`rabbitmqctl`); `None` without rabbitmqctl.
pub fn connection_pids(name: &str) -> Option<Vec<String>> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["-q", "list_connections", "pid", "client_properties"])
        .output()
        .ok()
        .filter(|out| out.status.success())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let named = format!("{{\"connection_name\",\"{name}\"}}");
    Some(
        text.lines()
            .filter(|l| l.contains(&named))
            .filter_map(|l| l.split('\t').next().map(str::to_owned))
            .collect(),
    )
}

/// Closes the broker connections of one worker process (named `<program>-<pid>`), as
/// `rabbitmqctl close_all_connections` would, without disturbing parallel tests.
pub fn close_broker_connections_of(program: &str, pid: u32) -> usize {
    let pids = connection_pids(&format!("{program}-{pid}")).expect("rabbitmqctl");
    let mut closed = 0;
    for conn in &pids {
        let status = std::process::Command::new("rabbitmqctl")
            .args([
                "-q",
                "close_connection",
                conn,
                "test: connection closed under load",
            ])
            .status()
            .expect("rabbitmqctl");
        if status.success() {
            closed += 1;
        }
    }
    closed
}

/// Sends a signal to a child process.
pub fn signal(worker: &WorkerProcess, signal: &str) {
    let pid = worker.pid();
    let status = std::process::Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid}");
}

/// Waits until the example tables exist (the worker creates them on start).
pub async fn wait_for_worker_tables(pool: &PgPool) {
    wait_until(Duration::from_secs(60), "the worker's tables", || async {
        sqlx::query_scalar::<_, bool>("SELECT to_regclass('example_ledger') IS NOT NULL")
            .fetch_one(pool)
            .await
            .unwrap_or(false)
    })
    .await;
}

/// Waits until `queue` has `n` consumers.
pub async fn wait_for_consumers(q: &TestQueue, n: u32) {
    wait_until(Duration::from_secs(60), "worker consumers", || async {
        q.counts(&q.name).await.1 >= n
    })
    .await;
}

pub fn header_text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

pub fn body_json(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or(Value::Null)
}

/// Messages delivered but not acked on `queue`, as the broker counts them.
pub async fn unacked(queue: &str) -> u64 {
    let out = Command::new("rabbitmqctl")
        .args(["-q", "list_queues", "name", "messages_unacknowledged"])
        .output()
        .await
        .expect("rabbitmqctl");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .find(|(name, _)| *name == queue)
        .and_then(|(_, n)| n.trim().parse().ok())
        .unwrap_or(0)
}

pub mod proxy;

/// A free loopback address for a worker's metrics (free when asked: the worker binds it
/// a moment later).
pub fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("127.0.0.1:{}", listener.local_addr().unwrap().port())
}

/// One HTTP GET of `path` on `addr`: (status, body); (0, "") when nothing answers.
pub async fn scrape(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return (0, String::new());
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return (0, String::new());
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response).await;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// A worker running `handler` in this process on `q`, with short retry tiers (the
/// first two of [`RETRY_DELAYS_MS`]); `tune` adjusts the rest of its settings.
pub async fn start_in_process<H: idem::Handler>(
    pool: &PgPool,
    q: &TestQueue,
    handler: H,
    tune: impl FnOnce(&mut idem::WorkerConfig),
) -> (
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<Result<(), idem::WorkerError>>,
) {
    start_in_process_with(pool, q, handler, idem::StoreConfig::default(), tune).await
}

/// [`start_in_process`] with a store of `store_config`'s settings.
pub async fn start_in_process_with<H: idem::Handler>(
    pool: &PgPool,
    q: &TestQueue,
    handler: H,
    store_config: idem::StoreConfig,
    tune: impl FnOnce(&mut idem::WorkerConfig),
) -> (
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<Result<(), idem::WorkerError>>,
) {
    // A pool of its own on the test's database: a test pool holds 5 connections, shared
    // with the test's own queries, and a worker's batches in flight each hold one; a
    // worker short of connections waits for the pool, not for the database.
    let options = (*pool.connect_options()).clone();
    let worker_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(10)
        .connect_with(options)
        .await
        .expect("connect the worker's pool");
    let store = idem::Store::new(worker_pool, store_config);
    let mut config = idem::WorkerConfig {
        amqp_url: amqp_url(),
        queue: q.name.clone(),
        retry: idem::RetryPolicy {
            immediate: 1,
            min_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
            delays: RETRY_DELAYS_MS[..2]
                .iter()
                .map(|&ms| Duration::from_millis(ms))
                .collect(),
        },
        ..idem::WorkerConfig::default()
    };
    tune(&mut config);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let worker = idem::Worker::new(handler, store, config);
    let task = tokio::spawn(worker.run(shutdown.clone()));
    wait_for_consumers(q, 1).await;
    (shutdown, task)
}

/// The principal of a test request: its bearer token (401 without one). A rejection is
/// a whole response, as axum's own are.
#[cfg(feature = "http")]
#[allow(clippy::result_large_err)]
pub fn bearer_principal(
    parts: &axum::http::request::Parts,
) -> Result<String, axum::response::Response> {
    use axum::response::IntoResponse;
    parts
        .headers
        .get("authorization")
        .and_then(|v| v.to_str().ok()?.strip_prefix("Bearer ").map(str::to_owned))
        .ok_or_else(|| axum::http::StatusCode::UNAUTHORIZED.into_response())
}

/// Publishes `n` orders over acme and globex with a worker failing acme for good, waits
/// until acme's are dead-lettered and globex's booked, and stops that worker.
pub async fn outage(pool: &PgPool, q: &TestQueue, url: &str, n: usize) -> u32 {
    let mut failing = spawn_orders_worker(url, &q.name, &["--fail-tenant", "acme"]);
    wait_for_worker_tables(pool).await;
    wait_for_consumers(q, 1).await;
    for i in 0..n {
        let tenant = if i % 2 == 0 { "acme" } else { "globex" };
        q.publish(&order(&format!("evt-{i}"), tenant, 100 + i as i64))
            .await;
        if i % 5 == 0 {
            q.publish(&order_resent(&format!("evt-{i}"), tenant, 100 + i as i64))
                .await;
        }
    }
    let acme = n.div_ceil(2) as i64;
    wait_until(Duration::from_secs(90), "the outage to settle", || async {
        let dead: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM processed_operations
             WHERE scope = 'acme' AND status = 'failed' AND dead_lettered_at IS NOT NULL",
        )
        .fetch_one(pool)
        .await
        .unwrap_or(0);
        dead == acme && ledger(pool).await.len() == n / 2 && q.counts(&q.name).await.0 == 0
    })
    .await;
    signal(&failing, "TERM");
    assert_eq!(failing.child.wait().await.unwrap().code(), Some(0));
    let dead = q.counts(&q.dlq()).await.0;
    assert!(dead as i64 >= acme, "every acme order is in the DLQ");
    dead
}

/// A record put in place by hand, as a worker would have left it: for the tests of what
/// operators see and do (the `idem` command, the console), whose subject is not how
/// records are made (the store's own tests, inside the crate, are).
#[derive(Debug, Clone)]
pub struct RecordFixture<'a> {
    pub scope: &'a str,
    pub operation: &'a str,
    pub key: &'a str,
    /// `processing`, `completed`, `failed` or `pending`.
    pub status: &'a str,
    /// The payload's fingerprint (hex); 64 `a`s when `None`.
    pub fingerprint: Option<String>,
    pub retryable: bool,
    /// A lease this many seconds from now (negative: lapsed), or none.
    pub lease_secs: Option<i64>,
    pub owner: &'a str,
    pub external_ref: Option<&'a str>,
    pub correlation_id: Option<&'a str>,
    /// `pending`, or failed after being uncertain.
    pub reconcile_first: bool,
    pub result: Option<Value>,
    pub error: Option<Value>,
}

impl Default for RecordFixture<'_> {
    fn default() -> Self {
        Self {
            scope: "acme",
            operation: "orders.create",
            key: "evt-fixture",
            status: "processing",
            fingerprint: None,
            retryable: false,
            lease_secs: None,
            owner: "fixture",
            external_ref: None,
            correlation_id: None,
            reconcile_first: false,
            result: None,
            error: None,
        }
    }
}

/// Inserts `record`; returns its id and lease token.
pub async fn insert_record(pool: &PgPool, record: &RecordFixture<'_>) -> (i64, i64) {
    let completed = record.status == "completed";
    sqlx::query_as(
        "INSERT INTO processed_operations
           (scope, operation, idempotency_key, payload_sha256, status, retryable, attempts,
            lease_token, lease_expires_at, owner, external_ref, correlation_id,
            reconcile_first, result, error, completed_at, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, 1,
                 nextval('processed_operations_lease_token_seq'),
                 now() + $7::bigint * interval '1 second', $8, $9, $10, $11, $12, $13,
                 CASE WHEN $14 THEN now() END,
                 CASE WHEN $14 THEN now() + interval '7 days' END)
         RETURNING id, lease_token",
    )
    .bind(record.scope)
    .bind(record.operation)
    .bind(record.key)
    .bind(record.fingerprint.clone().unwrap_or_else(|| "a".repeat(64)))
    .bind(record.status)
    .bind(record.retryable)
    .bind(record.lease_secs)
    .bind(record.owner)
    .bind(record.external_ref)
    .bind(record.correlation_id)
    .bind(record.reconcile_first || record.status == "pending")
    .bind(&record.result)
    .bind(&record.error)
    .bind(completed)
    .fetch_one(pool)
    .await
    .expect("insert the record")
}
