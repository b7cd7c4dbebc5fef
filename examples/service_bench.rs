//! Ten job types: one [`Service`] against ten separate [`Worker`]s, side by side in one
//! run, on the same broker, database and load.
//!
//! ```sh
//! cargo run --release --example service_bench -- --messages-per-type 2000
//! ```
//!
//! For each set-up it fills ten queues with `--messages-per-type` persistent messages
//! each, then starts a child process (this binary with `--child SETUP`) that consumes
//! them: `workers` runs ten `Worker`s joined in one process (what a user had to write
//! before `Service`), `service` one `Service` of the same ten handlers with the same
//! settings. Each handler inserts one row through `ctx.tx()` in transactional mode. It
//! prints one line per set-up: messages per second (first to last completion, from
//! the records), the broker connections of the child (`rabbitmqctl`), its relay
//! `LISTEN` connections and its Postgres connections (`pg_stat_activity`) and its peak
//! RSS; after `--runs` runs of both (alternating which goes first), the medians and
//! their `ratio=` (service over workers).

use std::process::{ExitCode, Stdio};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Parser;
use futures_util::future::{BoxFuture, join_all};
use idem::{
    Context, Handler, HandlerError, Mode, Service, ServiceConfig, Store, StoreConfig, Topology,
    Worker, WorkerConfig,
};
use serde_json::Value;
use sqlx::PgPool;

const JOB_TYPES: usize = 10;
const OPERATIONS: [&str; JOB_TYPES] = [
    "bench.job0",
    "bench.job1",
    "bench.job2",
    "bench.job3",
    "bench.job4",
    "bench.job5",
    "bench.job6",
    "bench.job7",
    "bench.job8",
    "bench.job9",
];

/// Job type `N`: one row in `bench_jobs` per message, in the operation's transaction.
struct Job<const N: usize>;

impl<const N: usize> Handler for Job<N> {
    type Message = Value;
    type Output = ();
    const OPERATION: &'static str = OPERATIONS[N];
    fn scope(&self, _: &Value) -> String {
        "service_bench".into()
    }
    fn idempotency_key(&self, m: &Value) -> String {
        m["event_id"].as_str().unwrap_or_default().into()
    }
    async fn handle(&self, m: Value, ctx: &mut Context) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO bench_jobs (job, event_id) VALUES ($1, $2)")
            .bind(N as i32)
            .bind(m["event_id"].as_str())
            .execute(ctx.tx().await?)
            .await?;
        Ok(())
    }
}

#[derive(Parser, Debug)]
#[command(about = "ten job types: one idem Service against ten Workers")]
struct Args {
    /// Messages published to each of the ten queues.
    #[arg(long, default_value_t = 2000)]
    messages_per_type: usize,
    /// Handlers running at once, per queue.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Runs of both set-ups, alternating which goes first; medians at the end.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Run as the consuming child: `workers` or `service`, on queues under `--prefix`.
    #[arg(long, hide = true)]
    child: Option<String>,
    #[arg(long, hide = true, default_value = "")]
    prefix: String,
    /// Postgres URL.
    #[arg(long, env = "DATABASE_URL", default_value = idem::db::DEFAULT_DATABASE_URL, hide_env_values = true)]
    database_url: String,
    /// RabbitMQ URL.
    #[arg(long, env = "AMQP_URL", default_value = idem::topology::DEFAULT_AMQP_URL, hide_env_values = true)]
    amqp_url: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let result = match args.child.clone() {
        Some(setup) => child(args, &setup).await,
        None => parent(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!(
                "service_bench: error: {}",
                idem::text::error_line(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

fn queue_config(args: &Args, n: usize) -> WorkerConfig {
    WorkerConfig {
        amqp_url: args.amqp_url.clone(),
        queue: format!("{}.job{n}", args.prefix),
        mode: Mode::Transactional,
        concurrency: args.concurrency,
        prefetch: 64,
        name: format!("svcbench-{}-{n}", std::process::id()),
        tally_every: None,
        ..WorkerConfig::default()
    }
}

/// Consumes the ten queues until SIGTERM, as `setup` says.
async fn child(args: Args, setup: &str) -> anyhow::Result<()> {
    let pool = idem::db::connect(
        &args.database_url,
        (JOB_TYPES * args.concurrency) as u32 + 6,
    )
    .await?;
    let store = Store::new(pool, StoreConfig::default());
    let shutdown = idem::shutdown::on_signal();
    let c = |n| queue_config(&args, n);
    match setup {
        "workers" => {
            let token = &shutdown;
            let s = &store;
            let runs: Vec<BoxFuture<'_, Result<(), idem::WorkerError>>> = vec![
                Box::pin(Worker::new(Job::<0>, s.clone(), c(0)).run(token.clone())),
                Box::pin(Worker::new(Job::<1>, s.clone(), c(1)).run(token.clone())),
                Box::pin(Worker::new(Job::<2>, s.clone(), c(2)).run(token.clone())),
                Box::pin(Worker::new(Job::<3>, s.clone(), c(3)).run(token.clone())),
                Box::pin(Worker::new(Job::<4>, s.clone(), c(4)).run(token.clone())),
                Box::pin(Worker::new(Job::<5>, s.clone(), c(5)).run(token.clone())),
                Box::pin(Worker::new(Job::<6>, s.clone(), c(6)).run(token.clone())),
                Box::pin(Worker::new(Job::<7>, s.clone(), c(7)).run(token.clone())),
                Box::pin(Worker::new(Job::<8>, s.clone(), c(8)).run(token.clone())),
                Box::pin(Worker::new(Job::<9>, s.clone(), c(9)).run(token.clone())),
            ];
            for result in join_all(runs).await {
                result?;
            }
        }
        "service" => {
            let shared = ServiceConfig {
                amqp_url: args.amqp_url.clone(),
                name: format!("svcbench-{}", std::process::id()),
                tally_every: None,
                ..ServiceConfig::default()
            };
            Service::new(store, shared)
                .handler(Job::<0>, c(0))
                .handler(Job::<1>, c(1))
                .handler(Job::<2>, c(2))
                .handler(Job::<3>, c(3))
                .handler(Job::<4>, c(4))
                .handler(Job::<5>, c(5))
                .handler(Job::<6>, c(6))
                .handler(Job::<7>, c(7))
                .handler(Job::<8>, c(8))
                .handler(Job::<9>, c(9))
                .run(shutdown)
                .await?;
        }
        other => bail!("unknown set-up {other:?}: workers or service"),
    }
    Ok(())
}

/// What one set-up measured.
struct Measured {
    msgs_per_s: f64,
    amqp: Option<usize>,
    listeners: i64,
    pg: i64,
    rss_mb: f64,
}

async fn parent(args: Args) -> anyhow::Result<()> {
    let pool = idem::db::connect_and_migrate(&args.database_url, 4).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bench_jobs (job int NOT NULL, event_id text NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let connection = idem::topology::connect(&args.amqp_url, "service_bench").await?;
    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for run in 0..args.runs {
        // Alternate which goes first, so that neither always meets a warmer database.
        let order = if run % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let setup = SETUPS[i];
            let prefix = format!("bench.svc.{}.{setup}", uuid::Uuid::new_v4().simple());
            let m = measure(&args, &pool, &connection, setup, &prefix).await;
            delete_queues(&connection, &prefix).await;
            let m = m?;
            println!(
                "service_bench: run={run} setup={setup} job_types={JOB_TYPES} messages={} msgs_per_s={:.0} \
                 amqp_connections={} listen_connections={} pg_connections={} peak_rss_mb={:.1}",
                JOB_TYPES * args.messages_per_type,
                m.msgs_per_s,
                m.amqp.map_or("?".into(), |n| n.to_string()),
                m.listeners,
                m.pg,
                m.rss_mb
            );
            rates[i].push(m.msgs_per_s);
        }
    }
    let [workers, service] = rates.map(median);
    println!(
        "service_bench: median_workers_msgs_per_s={workers:.0} median_service_msgs_per_s={service:.0} ratio={:.2}",
        service / workers
    );
    Ok(())
}

const SETUPS: [&str; 2] = ["workers", "service"];

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

async fn measure(
    args: &Args,
    pool: &PgPool,
    connection: &lapin::Connection,
    setup: &str,
    prefix: &str,
) -> anyhow::Result<Measured> {
    // Each set-up starts from an empty scope (the bench's own): the records of earlier runs would slow
    // the counting below and the claims alike.
    sqlx::raw_sql(
        "DELETE FROM processed_operations WHERE scope = 'service_bench'; TRUNCATE bench_jobs",
    )
    .execute(pool)
    .await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await?;
    let args_for = Args {
        prefix: prefix.into(),
        child: None,
        ..clone_args(args)
    };
    for n in 0..JOB_TYPES {
        let config = queue_config(&args_for, n);
        topology_of(&config).declare(connection).await?;
        for i in 0..args.messages_per_type {
            let body = format!(r#"{{"event_id":"{prefix}-{n}-{i}"}}"#);
            channel
                .basic_publish(
                    "".into(),
                    config.queue.as_str().into(),
                    lapin::options::BasicPublishOptions::default(),
                    body.as_bytes(),
                    lapin::BasicProperties::default().with_delivery_mode(2),
                )
                .await?;
        }
    }
    channel.wait_for_confirms().await?;
    let exe = std::env::current_exe()?;
    let mut child = tokio::process::Command::new(exe)
        .args(["--child", setup, "--prefix", prefix])
        .args(["--concurrency", &args.concurrency.to_string()])
        .env("DATABASE_URL", &args.database_url)
        .env("AMQP_URL", &args.amqp_url)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().context("the child runs")?;
    let total = (JOB_TYPES * args.messages_per_type) as i64;
    // Through the key's index (its scope leads): no scan of the table.
    let completed = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM processed_operations WHERE scope = 'service_bench' AND status = 'completed'",
        )
        .fetch_one(pool)
        .await
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(600);
    while completed().await? < total {
        if std::time::Instant::now() > deadline {
            bail!("{setup}: not every message completed within 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let (first, last): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as(
            "SELECT min(completed_at), max(completed_at) FROM processed_operations WHERE scope = 'service_bench'",
        )
        .fetch_one(pool)
        .await?;
    let seconds = (last - first).as_seconds_f64().max(0.001);
    let (listeners, pg): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE application_name LIKE '% relay'), count(*)
         FROM pg_stat_activity WHERE application_name LIKE 'service_bench%' AND pid <> pg_backend_pid()
           AND backend_type = 'client backend'",
    )
    .fetch_one(pool)
    .await?;
    let measured = Measured {
        msgs_per_s: total as f64 / seconds,
        amqp: broker_connections(&format!("svcbench-{pid}")),
        listeners,
        // This process's own pool holds up to 4.
        pg: pg - i64::from(pool.size()),
        rss_mb: peak_rss_mb(pid),
    };
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = tokio::time::timeout(Duration::from_secs(60), child.wait()).await;
    Ok(measured)
}

fn clone_args(args: &Args) -> Args {
    Args {
        messages_per_type: args.messages_per_type,
        concurrency: args.concurrency,
        runs: args.runs,
        child: args.child.clone(),
        prefix: args.prefix.clone(),
        database_url: args.database_url.clone(),
        amqp_url: args.amqp_url.clone(),
    }
}

fn topology_of(config: &WorkerConfig) -> Topology {
    Topology {
        queue: config.queue.clone(),
        queue_type: config.queue_type,
        retry_delays: config.retry.delays.clone(),
        subscriptions: Vec::new(),
        single_active_consumer: config.single_active_consumer,
    }
}

/// The broker connections whose client-provided name starts with `name`.
fn broker_connections(name: &str) -> Option<usize> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["-q", "list_connections", "client_properties"])
        .output()
        .ok()
        .filter(|out| out.status.success())?;
    let text = String::from_utf8_lossy(&out.stdout);
    Some(
        text.lines()
            .filter(|l| l.contains(&format!("\"{name}")))
            .count(),
    )
}

fn peak_rss_mb(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

async fn delete_queues(connection: &lapin::Connection, prefix: &str) {
    let Ok(channel) = connection.create_channel().await else {
        return;
    };
    for n in 0..JOB_TYPES {
        let config = WorkerConfig {
            queue: format!("{prefix}.job{n}"),
            ..WorkerConfig::default()
        };
        let topology = topology_of(&config);
        let queues = [config.queue.clone(), topology.dlq()]
            .into_iter()
            .chain(topology.retry_queues());
        for queue in queues {
            let _ = channel
                .queue_delete(
                    queue.as_str().into(),
                    lapin::options::QueueDeleteOptions::default(),
                )
                .await;
        }
    }
}
