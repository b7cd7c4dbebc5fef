//! Publish → effect committed, at a steady rate, against `orders_worker`.
//!
//! ```sh
//! cargo build --release --examples
//! cargo run --release --example latency -- --rate 1000 --seconds 20 --mode transactional
//! ```
//!
//! It creates its own database, starts one `orders_worker` (the binary beside this one,
//! with its default settings plus `--mode` and anything after `--`), publishes orders at
//! `--rate` per second, and takes the time from each publish to the moment the order's
//! ledger row is committed: a trigger on the ledger sends a `NOTIFY`, which Postgres
//! delivers at commit. It prints one line: the rate kept, and p50/p90/p99/max;
//! `--timeline` also prints p50/p99/max of each second's messages.
//!
//! Garbage collection beside live traffic (the retention scenario of docs/OPERATING.md):
//!
//! ```sh
//! cargo run --release --example latency -- --rate 300 --seconds 200 --expired 2000000 --gc-after 10
//! ```
//!
//! fills the table with `--expired` expired records first, starts `idem gc` (the binary
//! beside the examples' directory) `--gc-after` seconds into the run, and also prints how
//! long gc took and the latencies of the messages published while it ran.
//!
//! The operator console beside live traffic (what its pages cost the workers):
//!
//! ```sh
//! cargo build --release --features console --bin idem --examples
//! cargo run --release --example latency -- --rate 300 --seconds 40 --console-after 20
//! ```
//!
//! starts `idem console` `--console-after` seconds into the run and loads its pages
//! (dead letters, stuck and processing operations, outbox, charts) until the run ends,
//! back to back or `--console-rate` per second, then prints the latencies of the
//! messages published before and while it did, and how many pages it served.

#[allow(dead_code)]
#[path = "orders_worker.rs"]
mod orders_worker;

use std::collections::HashMap;
use std::process::{ExitCode, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
use sqlx::postgres::{PgConnectOptions, PgListener};
use sqlx::{ConnectOptions, Connection};

#[derive(Parser, Debug)]
#[command(about = "idem latency: publish -> committed effect at a steady rate")]
struct Args {
    /// Messages per second.
    #[arg(long, default_value_t = 1000)]
    rate: u32,
    /// How long to publish.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// The worker's mode: leased or transactional.
    #[arg(long, default_value = "leased")]
    mode: String,
    /// Expired records to put in the table before the run.
    #[arg(long, default_value_t = 0)]
    expired: u64,
    /// Start `idem gc` this many seconds into the run.
    #[arg(long)]
    gc_after: Option<u64>,
    /// Start `idem console` this many seconds into the run and load its pages until the
    /// end (needs the idem binary built with `--features console`).
    #[arg(long)]
    console_after: Option<u64>,
    /// Console pages per second (0: back to back, as fast as it answers).
    #[arg(long, default_value_t = 0.0)]
    console_rate: f64,
    /// More arguments for `idem gc`, comma separated (e.g. `--duty,1`).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    gc_args: Vec<String>,
    /// Also print p50/p99/max of the messages published in each second of the run: where
    /// in the run a tail comes from (the first second's warm-up, a checkpoint, a sweep).
    #[arg(long)]
    timeline: bool,
    /// More arguments for orders_worker (after `--`).
    #[arg(last = true)]
    worker_args: Vec<String>,
    /// Postgres server (a database of its own is created and dropped on it).
    #[arg(long, env = "DATABASE_URL", default_value = idem::db::DEFAULT_DATABASE_URL, hide_env_values = true)]
    database_url: String,
    /// RabbitMQ URL.
    #[arg(long, env = "AMQP_URL", default_value = idem::topology::DEFAULT_AMQP_URL, hide_env_values = true)]
    amqp_url: String,
}

/// The `p` quantile (0..=1) of `sorted`, zero when it is empty.
fn quantile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1));
    sorted.get(at).copied().unwrap_or_default()
}

/// One line per second of the run: the messages published in it, their p50, p99 and max
/// publish → effect.
fn print_timeline(timed: &[(Instant, Duration)], start: Instant) {
    let mut seconds: Vec<Vec<Duration>> = Vec::new();
    for (at, latency) in timed {
        let second = at.saturating_duration_since(start).as_secs() as usize;
        if seconds.len() <= second {
            seconds.resize_with(second + 1, Vec::new);
        }
        seconds[second].push(*latency);
    }
    for (second, mut part) in seconds.into_iter().enumerate() {
        if part.is_empty() {
            continue;
        }
        part.sort();
        let at = |p: f64| quantile(&part, p);
        println!(
            "latency: second {second:>3}: {:>5} messages p50_ms={:.1} p99_ms={:.1} max_ms={:.1}",
            part.len(),
            at(0.5).as_secs_f64() * 1000.0,
            at(0.99).as_secs_f64() * 1000.0,
            at(1.0).as_secs_f64() * 1000.0,
        );
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("latency: error: {}", idem::text::error_line(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let server = PgConnectOptions::from_str(&args.database_url)?;
    let database = format!("idem_latency_{id}");
    let url = server
        .clone()
        .database(&database)
        .to_url_lossy()
        .to_string();
    let queue = format!("latency.{id}");
    let pool = idem::db::connect_and_migrate(&url, 4).await?;
    orders_worker::create_example_tables(&pool).await?;
    sqlx::raw_sql(
        "CREATE OR REPLACE FUNCTION latency_notify() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM pg_notify('latency', NEW.event_id); RETURN NULL; END $$;
         CREATE TRIGGER latency AFTER INSERT ON example_ledger
           FOR EACH ROW EXECUTE FUNCTION latency_notify();",
    )
    .execute(&pool)
    .await
    .context("create the ledger and its trigger")?;
    if args.expired > 0 {
        let started = Instant::now();
        fill_expired(&pool, args.expired).await?;
        println!(
            "latency: {} expired records written in {:.0} s",
            args.expired,
            started.elapsed().as_secs_f64()
        );
    }
    let mut listener = PgListener::connect_with(&pool).await?;
    listener.listen("latency").await?;

    let worker_path = std::env::current_exe()?.with_file_name("orders_worker");
    let mut worker = tokio::process::Command::new(&worker_path)
        .args(["--queue", &queue, "--mode", &args.mode])
        .args(&args.worker_args)
        .env("DATABASE_URL", &url)
        .env("AMQP_URL", &args.amqp_url)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("start {}", worker_path.display()))?;

    let connection = idem::topology::connect(&args.amqp_url, "idem-latency").await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    // Wait for the worker to declare its queue and consume.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let counts = idem::topology::queue_counts(&connection, &queue).await?;
        if counts.is_some_and(|c| c.consumers > 0) {
            break;
        }
        if Instant::now() > deadline {
            bail!("the worker did not start consuming");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let total = (u64::from(args.rate) * args.seconds) as usize;
    let interval = Duration::from_secs_f64(1.0 / f64::from(args.rate));
    let mut sent: HashMap<String, Instant> = HashMap::with_capacity(total);
    let mut latencies = Vec::with_capacity(total);
    let mut timed: Vec<(Instant, Duration)> = Vec::with_capacity(total);
    let gc_path = std::env::current_exe()?
        .parent()
        .and_then(|examples| examples.parent())
        .map(|dir| dir.join("idem"))
        .context("where is idem")?;
    let mut gc: Option<tokio::task::JoinHandle<anyhow::Result<(Instant, Instant, String)>>> = None;
    let mut console: Option<ConsoleLoad> = None;
    let start = tokio::time::Instant::now();
    let mut next = 0usize;
    let mut confirms = Vec::new();
    while latencies.len() < total {
        let due = start + interval * next as u32;
        if gc.is_none()
            && let Some(after) = args.gc_after
            && start.elapsed() >= Duration::from_secs(after)
        {
            let mut command = tokio::process::Command::new(&gc_path);
            command
                .arg("gc")
                .args(&args.gc_args)
                .env("DATABASE_URL", &url);
            gc = Some(tokio::spawn(async move {
                let begun = Instant::now();
                let out = command.output().await?;
                let ended = Instant::now();
                anyhow::ensure!(
                    out.status.success(),
                    "idem gc failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                Ok((
                    begun,
                    ended,
                    String::from_utf8_lossy(&out.stdout).into_owned(),
                ))
            }));
        }
        if console.is_none()
            && let Some(after) = args.console_after
            && start.elapsed() >= Duration::from_secs(after)
        {
            let load =
                ConsoleLoad::start(&gc_path, &url, &args.amqp_url, &queue, args.console_rate);
            console = Some(load.await?);
        }
        tokio::select! {
            _ = tokio::time::sleep_until(due), if next < total => {
                let event = format!("evt-{next}");
                let body = serde_json::to_vec(&serde_json::json!({
                    "event_id": event, "tenant": "acme", "order_id": next, "amount_cents": 1,
                }))?;
                let confirm = channel
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        BasicPublishOptions::default(),
                        &body,
                        BasicProperties::default().with_delivery_mode(2),
                    )
                    .await?;
                sent.insert(event, Instant::now());
                confirms.push(confirm);
                next += 1;
            }
            notification = listener.recv() => {
                let notification = notification?;
                if let Some(at) = sent.remove(notification.payload()) {
                    latencies.push(at.elapsed());
                    timed.push((at, at.elapsed()));
                }
            }
            _ = tokio::time::sleep(Duration::from_secs(60)) => bail!("no effect for 60 s"),
        }
    }
    let elapsed = start.elapsed();
    for confirm in confirms {
        confirm.await?;
    }
    latencies.sort();
    let q = |p: f64| quantile(&latencies, p);
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    if args.timeline {
        print_timeline(&timed, start.into_std());
    }
    if let Some(gc) = gc {
        let (begun, ended, out) = gc.await??;
        print!("{out}");
        let mut during: Vec<Duration> = timed
            .iter()
            .filter(|(at, _)| *at >= begun && *at <= ended)
            .map(|(_, latency)| *latency)
            .collect();
        during.sort();
        let dq = |p: f64| quantile(&during, p);
        println!(
            "latency: during gc ({:.1} s, {} messages): p50_ms={:.1} p90_ms={:.1} p99_ms={:.1} max_ms={:.1}",
            (ended - begun).as_secs_f64(),
            during.len(),
            ms(dq(0.5)),
            ms(dq(0.9)),
            ms(dq(0.99)),
            ms(dq(1.0)),
        );
    }
    if let Some(console) = console {
        let (begun, pages) = console.stop().await?;
        let (before, during): (Vec<_>, Vec<_>) = timed.iter().partition(|(at, _)| *at < begun);
        for (label, part) in [
            ("before the console", before),
            ("while the console was loaded", during),
        ] {
            let mut part: Vec<Duration> = part.into_iter().map(|(_, latency)| latency).collect();
            part.sort();
            let pq = |p: f64| quantile(&part, p);
            println!(
                "latency: {label} ({} messages): p50_ms={:.1} p90_ms={:.1} p99_ms={:.1} max_ms={:.1}",
                part.len(),
                ms(pq(0.5)),
                ms(pq(0.9)),
                ms(pq(0.99)),
                ms(pq(1.0)),
            );
        }
        println!("latency: the console served {pages} pages while loaded");
    }
    println!(
        "latency: mode={} rate={} kept={:.0}/s messages={} p50_ms={:.1} p90_ms={:.1} p99_ms={:.1} max_ms={:.1} worker_args={:?}",
        args.mode,
        args.rate,
        total as f64 / elapsed.as_secs_f64(),
        total,
        ms(q(0.5)),
        ms(q(0.9)),
        ms(q(0.99)),
        ms(q(1.0)),
        args.worker_args
    );

    if args.expired > 0 {
        table_health(&pool).await?;
    }
    let _ = worker.start_kill();
    let _ = worker.wait().await;
    let topology = idem::Topology {
        queue: queue.clone(),
        queue_type: idem::QueueType::Classic,
        retry_delays: idem::RetryPolicy::default().delays,
        subscriptions: Vec::new(),
        single_active_consumer: false,
    };
    let queues = [queue.clone(), topology.dlq()]
        .into_iter()
        .chain(topology.retry_queues());
    for name in queues {
        let _ = channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = connection.close(200, "done".into()).await;
    drop(listener);
    pool.close().await;
    let mut admin = server.database("postgres").connect().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await?;
    admin.close().await?;
    Ok(())
}

/// Writes `n` completed records that expired one after another (10 ms apart, the oldest
/// two days ago), in chunks of 100,000 rows.
async fn fill_expired(pool: &sqlx::PgPool, n: u64) -> anyhow::Result<()> {
    let mut done = 0u64;
    while done < n {
        let chunk = (n - done).min(100_000);
        sqlx::query(
            "INSERT INTO processed_operations
               (scope, operation, idempotency_key, payload_sha256, status, attempts,
                lease_token, result, completed_at, expires_at, created_at, updated_at)
             SELECT 'old', 'orders.create', 'expired-' || i, md5(i::text) || md5(i::text),
                    'completed', 1, 1, 'null'::jsonb, now() - interval '8 days',
                    now() - interval '2 days' + i * interval '10 milliseconds',
                    now() - interval '8 days', now() - interval '8 days'
             FROM generate_series($1::bigint, $2::bigint) i",
        )
        .bind(done as i64)
        .bind((done + chunk - 1) as i64)
        .execute(pool)
        .await
        .context("fill expired records")?;
        done += chunk;
    }
    sqlx::query("VACUUM ANALYZE processed_operations")
        .execute(pool)
        .await?;
    Ok(())
}

/// What the table looks like after the run: sizes, dead rows, vacuums.
async fn table_health(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    let (rows, dead, table_mb, indexes_mb, vacuums): (i64, i64, f64, f64, i64) = sqlx::query_as(
        "SELECT n_live_tup, n_dead_tup,
                pg_table_size('processed_operations') / 1048576.0::float8,
                pg_indexes_size('processed_operations') / 1048576.0::float8,
                autovacuum_count
         FROM pg_stat_user_tables WHERE relname = 'processed_operations'",
    )
    .fetch_one(pool)
    .await?;
    println!(
        "latency: table after the run: live {rows} dead {dead}, table {table_mb:.0} MiB, indexes {indexes_mb:.0} MiB, autovacuums {vacuums}"
    );
    Ok(())
}

/// `idem console` on a free port, and a task loading its pages back to back.
struct ConsoleLoad {
    _process: tokio::process::Child,
    begun: Instant,
    stop: tokio_util::sync::CancellationToken,
    loader: tokio::task::JoinHandle<anyhow::Result<u64>>,
}

impl ConsoleLoad {
    const TOKEN: &str = "latency-console-token-000000";

    async fn start(
        idem: &std::path::Path,
        url: &str,
        amqp: &str,
        queue: &str,
        rate: f64,
    ) -> anyhow::Result<Self> {
        use tokio::io::AsyncBufReadExt;
        let mut process = tokio::process::Command::new(idem)
            .args(["console", "--listen", "127.0.0.1:0", "--queue", queue])
            .env("DATABASE_URL", url)
            .env("AMQP_URL", amqp)
            .env("IDEM_CONSOLE_TOKEN", Self::TOKEN)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("start idem console (built with --features console?)")?;
        let stdout = process.stdout.take().context("console stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = lines
            .next_line()
            .await?
            .context("idem console printed nothing")?;
        let base = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .map(|w| w.trim_end_matches('/').to_owned())
            .context("no URL in the console's first line")?;
        let stop = tokio_util::sync::CancellationToken::new();
        let until = stop.clone();
        let loader = tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut pages = 0u64;
            let paths = [
                "/dlq",
                "/ops?status=stuck",
                "/ops?status=processing",
                "/outbox",
                "/charts",
            ];
            while !until.is_cancelled() {
                for path in paths {
                    let answer = client
                        .get(format!("{base}{path}"))
                        .bearer_auth(Self::TOKEN)
                        .send()
                        .await?;
                    anyhow::ensure!(answer.status().is_success(), "{path}: {}", answer.status());
                    answer.bytes().await?;
                    pages += 1;
                    if rate > 0.0 {
                        tokio::time::sleep(Duration::from_secs_f64(1.0 / rate)).await;
                    }
                }
            }
            Ok(pages)
        });
        Ok(Self {
            _process: process,
            begun: Instant::now(),
            stop,
            loader,
        })
    }

    /// Stops loading; when it began and how many pages were served.
    async fn stop(self) -> anyhow::Result<(Instant, u64)> {
        self.stop.cancel();
        let pages = self.loader.await??;
        Ok((self.begun, pages))
    }
}
