//! The chaos run: workers killed, connections dropped, the broker restarted, and every
//! effect counted.
//!
//! Run with (Postgres and RabbitMQ on this machine, `rabbitmqctl` on the PATH, as a user
//! allowed to run it; build the worker first):
//!
//! ```sh
//! cargo build --release --examples
//! ./target/release/examples/chaos --orders 100000 --kills 60 --conn-drops 10 --pg-kills 10 --broker-restart
//! ```
//!
//! It creates its own database (`idem_chaos_<id>` on the server of `DATABASE_URL`) and
//! queue, starts `--workers` `orders_worker` processes with a short lease, publishes
//! `--orders` orders (a share of them two to four times, as a retrying producer would:
//! new message id, new `sent_at`, keys reordered) plus `--conflicts` conflicting
//! payloads, and meanwhile SIGKILLs random workers and restarts them, closes all broker
//! connections, terminates the workers' Postgres backends, and once restarts RabbitMQ.
//! Then it waits until everything has settled and checks: exactly one ledger row per
//! event, none lost, one provider key per event, conflicts and only conflicts in the
//! DLQ, nothing left `processing`, all workers alive. It prints one summary line and
//! exits 1 if any check failed.
//!
//! With `--follow-ups`, every booked order also stages a follow-up message (the
//! transactional outbox) to `<queue>.notify`, which `--downstream` `notifications_worker`
//! processes consume, killed and disconnected like the others; `--negatives` adds orders
//! that fail for good. Then it also checks exactly one notification per booked order,
//! none for a conflict or a failed order, and nothing left in the outbox.

#[allow(dead_code)]
#[path = "orders_producer.rs"]
mod orders_producer;

#[path = "support/publisher.rs"]
mod publisher;

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use idem::headers;
use lapin::Connection;
use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeleteOptions};
use publisher::Publisher;
use rand::Rng;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgPool};
use tokio::process::{Child, Command};

#[derive(Parser, Debug, Clone)]
#[command(about = "idem chaos run: kill, drop, restart, and count every effect")]
struct Args {
    /// Distinct orders (intents).
    #[arg(long, default_value_t = 2000)]
    orders: usize,
    /// Share of orders published more than once (2 to 4 copies).
    #[arg(long, default_value_t = 0.3)]
    duplicate_share: f64,
    /// Orders that also get a conflicting payload (same event_id, other amount).
    #[arg(long, default_value_t = 10)]
    conflicts: usize,
    /// Worker processes on the queue.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// The workers' mode: leased or transactional (then the "provider call" is a row
    /// in the handler's transaction too, and each event must have exactly one).
    #[arg(long, default_value = "leased")]
    mode: String,
    /// Orders with a negative amount: they fail for good (DLQ `permanent_failure`)
    /// and must leave no effect and no follow-up.
    #[arg(long, default_value_t = 0)]
    negatives: usize,
    /// Booked orders stage a follow-up to `<queue>.notify`, consumed by `--downstream`
    /// notifications workers.
    #[arg(long)]
    follow_ups: bool,
    /// Notifications workers (with `--follow-ups`).
    #[arg(long, default_value_t = 1)]
    downstream: usize,
    /// Workers' lease in seconds.
    #[arg(long, default_value_t = 2)]
    lease_secs: u64,
    /// Workers SIGKILLed (and restarted) during the run.
    #[arg(long, default_value_t = 6)]
    kills: usize,
    /// Times all broker connections are closed (`rabbitmqctl close_all_connections`).
    #[arg(long, default_value_t = 2)]
    conn_drops: usize,
    /// Times the workers' Postgres backends are terminated (`pg_terminate_backend`).
    #[arg(long, default_value_t = 2)]
    pg_kills: usize,
    /// Restart RabbitMQ once, half-way (`rabbitmqctl stop_app` / `start_app`).
    #[arg(long)]
    broker_restart: bool,
    /// Give up waiting for the run to settle after this many seconds.
    #[arg(long, default_value_t = 300)]
    settle_timeout_secs: u64,
    /// The worker binary (default: `orders_worker` beside this one).
    #[arg(long)]
    worker_bin: Option<PathBuf>,
    /// The workers reach Postgres through this `host:port` (a PgBouncer in transaction
    /// pooling, say) instead of the server of DATABASE_URL.
    #[arg(long)]
    workers_through: Option<String>,
    /// With --workers-through: what needs a session (the gc lock, the relay's LISTEN)
    /// goes through this `host:port` (DATABASE_SESSION_URL); default: the server itself.
    #[arg(long)]
    sessions_through: Option<String>,
    /// Keep the run's database and queues for inspection.
    #[arg(long)]
    keep: bool,
    /// Postgres server (the run creates its own database on it).
    #[arg(long, env = "DATABASE_URL", default_value = idem::db::DEFAULT_DATABASE_URL, hide_env_values = true)]
    database_url: String,
    /// RabbitMQ URL.
    #[arg(long, env = "AMQP_URL", default_value = idem::topology::DEFAULT_AMQP_URL, hide_env_values = true)]
    amqp_url: String,
}

/// Faults injected so far.
#[derive(Debug, Default)]
struct Faults {
    kills: usize,
    conn_drops: usize,
    backend_kills: u64,
    backends_terminated: i64,
    broker_restarts: usize,
}

const APP_NAME: &str = "idem_chaos_worker";

/// The run's database for its workers, named [`APP_NAME`], on `server` (`host:port`)
/// if given.
fn through(run: &PgConnectOptions, server: Option<&str>) -> anyhow::Result<String> {
    let mut options = run.clone().application_name(APP_NAME);
    if let Some(server) = server {
        let (host, port) = server
            .rsplit_once(':')
            .with_context(|| format!("{server}: not host:port"))?;
        options = options.host(host).port(port.parse().context("the port")?);
    }
    Ok(options.to_url_lossy().to_string())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("chaos: error: {}", idem::text::error_line(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

struct Run {
    args: Args,
    id: String,
    queue: String,
    worker_url: String,
    session_url: Option<String>,
    worker_bin: PathBuf,
    log_dir: PathBuf,
    /// Order workers, then notifications workers.
    workers: Vec<Child>,
    started_workers: usize,
}

/// The retry delays of every worker of the run (and the retry queues it deletes).
const RETRY_DELAYS_MS: &str = "200,500,1000,2000,5000";

impl Run {
    /// The queue of the follow-ups.
    fn notify_queue(&self) -> String {
        format!("{}.notify", self.queue)
    }

    /// Worker `i` of the run: an order worker, or past `--workers` a notifications one.
    fn spawn_worker(&mut self, i: usize) -> anyhow::Result<Child> {
        if i >= self.args.workers {
            return self.spawn_downstream();
        }
        self.started_workers += 1;
        let log = std::fs::File::create(
            self.log_dir
                .join(format!("worker-{}.log", self.started_workers)),
        )?;
        let lease = self.args.lease_secs.to_string();
        let notify = self.notify_queue();
        let mut args = vec![
            "--queue",
            &self.queue,
            "--lease-secs",
            &lease,
            "--retry-delays-ms",
            RETRY_DELAYS_MS,
            "--concurrency",
            "8",
            "--prefetch",
            "32",
            "--mode",
            &self.args.mode,
            // A killed worker's taken follow-ups go out again soon (same id).
            "--outbox-lease-secs",
            "2",
        ];
        if self.args.follow_ups {
            args.extend(["--follow-ups", notify.as_str()]);
        }
        let mut command = Command::new(&self.worker_bin);
        if let Some(session) = &self.session_url {
            command.env("DATABASE_SESSION_URL", session);
        }
        command
            .args(args)
            .env("DATABASE_URL", &self.worker_url)
            .env("AMQP_URL", &self.args.amqp_url)
            .env("RUST_LOG", "info,sqlx=warn")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {}", self.worker_bin.display()))
    }

    fn spawn_downstream(&mut self) -> anyhow::Result<Child> {
        self.started_workers += 1;
        let log = std::fs::File::create(
            self.log_dir
                .join(format!("notifications-{}.log", self.started_workers)),
        )?;
        let bin = self.worker_bin.with_file_name(format!(
            "notifications_worker{}",
            std::env::consts::EXE_SUFFIX
        ));
        let mut command = Command::new(&bin);
        if let Some(session) = &self.session_url {
            command.env("DATABASE_SESSION_URL", session);
        }
        command
            .args([
                "--queue",
                &self.notify_queue(),
                "--retry-delays-ms",
                RETRY_DELAYS_MS,
                "--concurrency",
                "8",
            ])
            .env("DATABASE_URL", &self.worker_url)
            .env("AMQP_URL", &self.args.amqp_url)
            .env("RUST_LOG", "info,sqlx=warn")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {}", bin.display()))
    }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    let id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let server = PgConnectOptions::from_str(&args.database_url)?;
    let database = format!("idem_chaos_{id}");
    let run_options = server.clone().database(&database);
    let run_url = run_options.to_url_lossy().to_string();
    let pool = idem::db::connect_and_migrate(&run_url, 8)
        .await
        .context("create the run's database")?;
    let worker_bin = match &args.worker_bin {
        Some(path) => path.clone(),
        None => std::env::current_exe()?
            .with_file_name(format!("orders_worker{}", std::env::consts::EXE_SUFFIX)),
    };
    if !worker_bin.exists() {
        bail!(
            "{} not found: build it with cargo build --examples",
            worker_bin.display()
        );
    }
    let log_dir = std::env::temp_dir().join(format!("idem-chaos-{id}"));
    std::fs::create_dir_all(&log_dir)?;
    let mut run = Run {
        queue: format!("chaos.{id}"),
        worker_url: through(&run_options, args.workers_through.as_deref())?,
        session_url: match &args.workers_through {
            Some(_) => Some(through(&run_options, args.sessions_through.as_deref())?),
            None => None,
        },
        worker_bin,
        log_dir,
        workers: Vec::new(),
        started_workers: 0,
        id,
        args,
    };
    let downstream = if run.args.follow_ups {
        run.args.downstream
    } else {
        0
    };
    for i in 0..run.args.workers + downstream {
        let child = run.spawn_worker(i)?;
        run.workers.push(child);
    }
    let result = chaos(&mut run, &pool).await;
    for worker in &mut run.workers {
        let _ = worker.start_kill();
        let _ = worker.wait().await;
    }
    if !run.args.keep {
        if let Ok(connection) = connect(&run.args.amqp_url).await {
            if let Ok(channel) = connection.create_channel().await {
                for queue in [run.queue.clone(), run.notify_queue()] {
                    for suffix in [
                        "",
                        ".dlq",
                        ".retry.200ms",
                        ".retry.500ms",
                        ".retry.1s",
                        ".retry.2s",
                        ".retry.5s",
                    ] {
                        let name = format!("{queue}{suffix}");
                        let _ = channel
                            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                            .await;
                    }
                }
            }
            let _ = connection.close(200, "done".into()).await;
        }
        pool.close().await;
        let mut admin = server.clone().database("postgres").connect().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
        )))
        .execute(&mut admin)
        .await?;
    } else {
        println!(
            "kept database {database}, queue {}, logs {}",
            run.queue,
            run.log_dir.display()
        );
    }
    let ok = result?;
    if !ok {
        eprintln!("worker logs: {}", run.log_dir.display());
    } else if !run.args.keep {
        let _ = std::fs::remove_dir_all(&run.log_dir);
    }
    Ok(ok)
}

async fn connect(url: &str) -> anyhow::Result<Connection> {
    Ok(idem::topology::connect(url, "idem-chaos").await?)
}

async fn rabbitmqctl(args: &[&str]) -> anyhow::Result<()> {
    let status = Command::new("rabbitmqctl")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .context("run rabbitmqctl")?;
    if !status.success() {
        bail!("rabbitmqctl {args:?} failed: {status}");
    }
    Ok(())
}

/// One fault, chosen among those with budget left.
async fn inject(
    run: &mut Run,
    pool: &PgPool,
    faults: &mut Faults,
    restart_now: bool,
) -> anyhow::Result<()> {
    let mut rng = rand::rng();
    if restart_now {
        rabbitmqctl(&["stop_app"]).await?;
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1000))).await;
        rabbitmqctl(&["start_app"]).await?;
        rabbitmqctl(&["await_startup"]).await?;
        faults.broker_restarts += 1;
        return Ok(());
    }
    let mut choices = Vec::new();
    if faults.kills < run.args.kills {
        choices.extend(["kill"; 3]);
    }
    if faults.conn_drops < run.args.conn_drops {
        choices.push("drop");
    }
    if (faults.backend_kills as usize) < run.args.pg_kills {
        choices.push("pg");
    }
    let Some(choice) = choices
        .get(rng.random_range(0..choices.len().max(1)))
        .copied()
    else {
        return Ok(());
    };
    match choice {
        "kill" => {
            let victim = rng.random_range(0..run.workers.len());
            let _ = run.workers[victim].start_kill(); // SIGKILL
            let _ = run.workers[victim].wait().await;
            faults.kills += 1;
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..500))).await;
            run.workers[victim] = run.spawn_worker(victim)?;
        }
        "drop" => {
            rabbitmqctl(&["close_all_connections", "chaos: connection drop"]).await?;
            faults.conn_drops += 1;
        }
        _ => {
            // Through a pooler, a server connection is named after whichever client
            // used it last, if at all: then every backend of the run's database but
            // this process's own.
            let killed: i64 = sqlx::query_scalar(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                 WHERE application_name = $1
                    OR ($2 AND datname = current_database() AND backend_type = 'client backend'
                        AND application_name <> (SELECT application_name FROM pg_stat_activity
                                                  WHERE pid = pg_backend_pid()))",
            )
            .bind(APP_NAME)
            .bind(run.args.workers_through.is_some())
            .fetch_one(pool)
            .await?;
            faults.backend_kills += 1;
            faults.backends_terminated += killed;
        }
    }
    Ok(())
}

/// Records not completed, but for the negative orders' (`$1`), which fail for good.
const UNFINISHED: &str = "SELECT count(*) FROM processed_operations
     WHERE status <> 'completed' AND NOT (status = 'failed' AND idempotency_key = ANY($1))";

async fn chaos(run: &mut Run, pool: &PgPool) -> anyhow::Result<bool> {
    let args = run.args.clone();
    // Wait for the workers to declare the queue and create their tables.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready: bool = sqlx::query_scalar(
            "SELECT to_regclass('example_ledger') IS NOT NULL
                AND ($1 OR to_regclass('example_notifications') IS NOT NULL)",
        )
        .bind(!args.follow_ups)
        .fetch_one(pool)
        .await?;
        let notify_ready = !args.follow_ups
            || queue_ready(&args.amqp_url, &run.notify_queue())
                .await
                .is_some();
        if ready && notify_ready && queue_ready(&args.amqp_url, &run.queue).await.is_some() {
            break;
        }
        if Instant::now() > deadline {
            bail!("workers did not start; logs in {}", run.log_dir.display());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The messages: each order once, a share two to four times, some conflicts.
    let mut rng = rand::rng();
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    let mut duplicates = 0;
    let events: Vec<String> = (0..args.orders)
        .map(|i| format!("{}-evt-{i}", run.id))
        .collect();
    for (i, event) in events.iter().enumerate() {
        let tenant = if i % 2 == 0 { "acme" } else { "globex" };
        let copies = if rng.random_bool(args.duplicate_share.clamp(0.0, 1.0)) {
            rng.random_range(2..=4)
        } else {
            1
        };
        for _ in 0..copies {
            bodies.push(orders_producer::order_json(
                event,
                tenant,
                i,
                100 + i as i64,
            ));
        }
        duplicates += copies - 1;
        if i < args.conflicts {
            bodies.push(orders_producer::order_json(
                event,
                tenant,
                i,
                1_000_000 + i as i64,
            ));
        }
    }
    let negatives: Vec<String> = (0..args.negatives)
        .map(|i| format!("{}-neg-{i}", run.id))
        .collect();
    for (i, event) in negatives.iter().enumerate() {
        bodies.push(orders_producer::order_json(event, "acme", i, -1));
    }
    // Interleave locally: copies land near each other, as a producer's retries do.
    for i in (1..bodies.len()).rev() {
        let j = i.saturating_sub(rng.random_range(0..64));
        bodies.swap(i, j);
    }

    let total_faults = args.kills + args.conn_drops + args.pg_kills;
    let mut faults = Faults::default();
    let mut publisher = Publisher::new(&args.amqp_url, "idem-chaos");
    let fault_every = bodies.len() / (total_faults + 1).max(1);
    let restart_at = bodies.len() / 2;
    let started = Instant::now();
    for (n, body) in bodies.iter().enumerate() {
        publisher.publish(&run.queue, body).await?;
        if args.broker_restart && n == restart_at && faults.broker_restarts == 0 {
            inject(run, pool, &mut faults, true).await?;
        } else if fault_every > 0 && n > 0 && n % fault_every == 0 {
            inject(run, pool, &mut faults, false).await?;
        }
    }
    // Faults left over (small runs): inject them now, while the workers still work.
    while faults.kills < args.kills
        || faults.conn_drops < args.conn_drops
        || (faults.backend_kills as usize) < args.pg_kills
    {
        inject(run, pool, &mut faults, false).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if args.broker_restart && faults.broker_restarts == 0 {
        inject(run, pool, &mut faults, true).await?;
    }
    let published_at = Instant::now();

    // Settle: every event booked, nothing in the queues or in flight.
    let deadline = published_at + Duration::from_secs(args.settle_timeout_secs);
    let mut stable_since: Option<Instant> = None;
    loop {
        let booked: i64 = sqlx::query_scalar("SELECT count(DISTINCT event_id) FROM example_ledger")
            .fetch_one(pool)
            .await
            .unwrap_or(0);
        let in_flight: i64 = sqlx::query_scalar(UNFINISHED)
            .bind(&negatives)
            .fetch_one(pool)
            .await
            .unwrap_or(1);
        let mut queued = queues_total(&run.queue).await;
        let mut follow_ups_done = true;
        if args.follow_ups {
            let notified: i64 = sqlx::query_scalar(
                "SELECT count(DISTINCT order_event_id) FROM example_notifications",
            )
            .fetch_one(pool)
            .await
            .unwrap_or(0);
            let undispatched: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox_messages WHERE dispatched_at IS NULL",
            )
            .fetch_one(pool)
            .await
            .unwrap_or(1);
            follow_ups_done = notified as usize == args.orders && undispatched == 0;
            let notify_queued = queues_total(&run.notify_queue()).await;
            queued = queued.zip(notify_queued).map(|(a, b)| a + b);
        }
        let settled = booked as usize == args.orders
            && follow_ups_done
            && in_flight == 0
            && queued == Some(0);
        if settled {
            // Quiet for a moment: no retry copy still on its way back.
            let since = *stable_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= Duration::from_secs(2) {
                break;
            }
        } else {
            stable_since = None;
        }
        if Instant::now() > deadline {
            eprintln!(
                "not settled: booked {booked}/{}, unfinished records {in_flight}, queued {queued:?}",
                args.orders
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let settle = published_at.elapsed();

    // Count.
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM example_ledger GROUP BY event_id")
            .fetch_all(pool)
            .await?;
    let ledger: BTreeMap<String, i64> = rows.into_iter().collect();
    let effects: i64 = ledger.values().sum();
    let duplicate_effects: i64 = ledger.values().map(|n| n - 1).sum();
    let lost = events.iter().filter(|e| !ledger.contains_key(*e)).count();
    let calls: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT count(*), count(DISTINCT idempotency_key) FROM example_provider_calls GROUP BY event_id",
    )
    .fetch_all(pool)
    .await?;
    let calls_mean = calls.iter().map(|c| c.0).sum::<i64>() as f64 / calls.len().max(1) as f64;
    let calls_max = calls.iter().map(|c| c.0).max().unwrap_or(0);
    let split_keys = calls.iter().filter(|c| c.1 != 1).count();
    // Negative orders fail for good: their records are `failed`, nothing else may be.
    let unfinished: i64 = sqlx::query_scalar(UNFINISHED)
        .bind(&negatives)
        .fetch_one(pool)
        .await?;
    let negatives_booked = negatives.iter().filter(|e| ledger.contains_key(*e)).count();
    let dead_letters = drain_dlq(&args.amqp_url, &run.queue).await?;
    let dead = dead_letters.len();
    let conflict_events: HashSet<String> = events.iter().take(args.conflicts).cloned().collect();
    let negative_events: HashSet<String> = negatives.iter().cloned().collect();
    // Conflicts dead-lettered as conflicts, negatives as permanent failures, nothing else.
    let dead_not_conflict = dead_letters
        .iter()
        .filter(|(reason, key)| {
            !(reason == "fingerprint_conflict" && conflict_events.contains(key)
                || reason == "permanent_failure" && negative_events.contains(key))
        })
        .count();
    let dead_keys: HashSet<&String> = dead_letters.iter().map(|(_, key)| key).collect();
    let conflicts_ok = dead_not_conflict == 0
        && dead_keys.len() == args.conflicts + args.negatives
        && conflict_events.iter().all(|k| dead_keys.contains(k))
        && negatives_booked == 0;
    // The chain: one notification per booked order, none for a conflict or a failure.
    let mut follow_ups_ok = true;
    let mut chain = String::new();
    if args.follow_ups {
        let rows: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT order_event_id, count(*), max(amount_cents) FROM example_notifications
             GROUP BY order_event_id",
        )
        .fetch_all(pool)
        .await?;
        let notified: BTreeMap<String, (i64, i64)> =
            rows.into_iter().map(|(e, n, a)| (e, (n, a))).collect();
        let duplicates: i64 = notified.values().map(|(n, _)| n - 1).sum();
        let missing = events.iter().filter(|e| !notified.contains_key(*e)).count();
        let for_failed = negatives
            .iter()
            .filter(|e| notified.contains_key(*e))
            .count();
        // Whichever payload of a conflicting pair booked, the notification is of that
        // booking: never of the payload that was refused.
        let unbooked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM example_notifications n WHERE NOT EXISTS (
                 SELECT 1 FROM example_ledger l
                 WHERE l.event_id = n.order_event_id AND l.amount_cents = n.amount_cents)",
        )
        .fetch_one(pool)
        .await?;
        let undispatched: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE dispatched_at IS NULL")
                .fetch_one(pool)
                .await?;
        let published: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
            .fetch_one(pool)
            .await?;
        let downstream_dead = drain_dlq(&args.amqp_url, &run.notify_queue()).await?.len();
        follow_ups_ok = duplicates == 0
            && missing == 0
            && for_failed == 0
            && unbooked == 0
            && undispatched == 0
            && published as usize == args.orders
            && downstream_dead == 0;
        chain = format!(
            " follow_ups={published} notifications={} duplicate_notifications={duplicates} lost_notifications={missing} notifications_for_failed={for_failed} notifications_not_booked={unbooked} outbox_undispatched={undispatched} downstream_dlq={downstream_dead}",
            notified.len()
        );
    }
    let mut dead_workers = 0;
    for worker in &mut run.workers {
        if worker.try_wait()?.is_some() {
            dead_workers += 1;
        }
    }
    // In transactional mode the provider row commits with the ledger row: exactly one.
    let provider_ok = args.mode != "transactional" || calls_max == 1;
    let ok = duplicate_effects == 0
        && lost == 0
        && split_keys == 0
        && provider_ok
        && unfinished == 0
        && conflicts_ok
        && follow_ups_ok
        && dead_workers == 0;
    println!(
        "chaos: mode={} messages={} duplicate_publishes={} republished_after_errors={} conflicts={} kills={} connection_drops={} backend_kills={} backends_terminated={} broker_restarts={} effects={effects} duplicate_effects={duplicate_effects} lost={lost} provider_calls_per_event_mean={calls_mean:.3} provider_calls_per_event_max={calls_max} split_provider_keys={split_keys} negatives={} dlq={dead} dlq_not_conflict={dead_not_conflict} unfinished={unfinished} dead_workers={dead_workers}{chain} publish_s={:.1} settle_s={:.1} result={}",
        args.mode,
        bodies.len(),
        duplicates,
        publisher.republished,
        args.conflicts,
        faults.kills,
        faults.conn_drops,
        faults.backend_kills,
        faults.backends_terminated,
        faults.broker_restarts,
        args.negatives,
        (published_at - started).as_secs_f64(),
        settle.as_secs_f64(),
        if ok { "ok" } else { "FAILED" },
    );
    publisher.close().await;
    Ok(ok)
}

/// Messages ready in `queue`, if it exists.
async fn queue_ready(url: &str, queue: &str) -> Option<u32> {
    let connection = connect(url).await.ok()?;
    let counts = idem::topology::queue_counts(&connection, queue).await;
    let _ = connection.close(200, "done".into()).await;
    counts.ok().flatten().map(|c| c.ready)
}

/// Messages ready or unacked in the work queue and its retry queues.
async fn queues_total(queue: &str) -> Option<u64> {
    let out = Command::new("rabbitmqctl")
        .args(["-q", "list_queues", "name", "messages"])
        .output()
        .await
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let retry_prefix = format!("{queue}.retry.");
    Some(
        text.lines()
            .filter_map(|l| l.split_once('\t'))
            .filter(|(name, _)| *name == queue || name.starts_with(&retry_prefix))
            .filter_map(|(_, n)| n.trim().parse::<u64>().ok())
            .sum(),
    )
}

/// Takes everything out of the DLQ: each dead letter's reason and key.
async fn drain_dlq(url: &str, queue: &str) -> anyhow::Result<Vec<(String, String)>> {
    let connection = connect(url).await?;
    let channel = connection.create_channel().await?;
    let dlq = idem::topology::dlq_name(queue);
    let mut dead = Vec::new();
    while let Some(message) = channel
        .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: false })
        .await?
    {
        let p = &message.delivery.properties;
        let text = |name| headers::text(p, name).unwrap_or_default();
        dead.push((text(headers::REASON), text(headers::KEY)));
        message.delivery.ack(BasicAckOptions::default()).await?;
    }
    let _ = connection.close(200, "done".into()).await;
    Ok(dead)
}
