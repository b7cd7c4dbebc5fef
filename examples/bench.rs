//! Throughput, side by side, on the same broker and database, in one run.
//!
//! Run with (release build; Postgres and RabbitMQ on this machine):
//!
//! ```sh
//! cargo run --release --example bench -- --messages 20000 --runs 3
//! ```
//!
//! For each run and variant it publishes `--messages` persistent messages to a fresh
//! queue, then consumes them with prefetch `--prefetch` and measures from the first
//! delivery to the last ack:
//!
//! 1. `raw`: a lapin consumer that only acks;
//! 2. `handwritten`: one claim `INSERT` and one completion `UPDATE` per message (each its
//!    own commit), 32 at a time, then the ack;
//! 3. `idem_noop`: an idem worker with a handler that does nothing;
//! 4. `idem_orders`: an idem worker with the orders handler (a provider-call insert and a
//!    ledger row in the handler's transaction); `idem_orders_tx` the same in
//!    transactional mode (both rows in the batch's transaction), as `orders_worker
//!    --mode transactional` runs it;
//! 5. `idem_ledger`: leased mode, a handler that inserts one ledger row through
//!    `ctx.tx()`;
//! 6. `idem_ledger_tx`, `idem_noop_tx`: the ledger and no-op handlers in transactional
//!    mode (claim, effect and outcome in one transaction per batch);
//! 7. `idem_orders_follow_up`: `idem_orders` staging one follow-up message per order
//!    (the transactional outbox), published after the commit, confirmed, before the ack;
//! 8. `idem_ledger_traced`: `idem_ledger` with a `traceparent` on every message, trace
//!    export off (no OpenTelemetry layer, as when `OTEL_EXPORTER_OTLP_ENDPOINT` is
//!    unset): the context is read, kept on the record and carried on, no span exported;
//! 9. `idem_ledger_exporting` (built with `--features otel`): the same with an
//!    OpenTelemetry layer exporting every span in batches to an exporter that drops
//!    them: the cost of making the spans, without a collector's network round trips;
//! 10. `idem_ledger_untallied`: `idem_ledger` with `WorkerConfig::tally_every` `None`,
//!     so no delivery's outcome is counted for the console's charts (every other idem
//!     variant counts them, as workers do by default). The last line `tally: …`
//!     compares it with `idem_ledger`:
//!
//! ```sh
//! cargo run --release --example bench -- \
//!     --variants idem_ledger,idem_ledger_untallied --runs 5
//! ```
//!
//! 11. `idem_ledger_limited`: `idem_ledger` holding a permit of a shared [`idem::Limit`]
//!     that never binds (1,000 at once, 10,000 a second) around its insert: the cost of
//!     taking and freeing one. The last line `limits: …` compares it with `idem_ledger`,
//!     Postgres's CPU per message included:
//!
//! ```sh
//! cargo run --release --example bench -- \
//!     --variants idem_ledger,idem_ledger_limited --runs 3
//! ```
//!
//! 12. `idem_orders_follow_up_sealed`: `idem_orders_follow_up` with keys
//!     (`StoreConfig::keys`): the output and the follow-up body sealed, the fingerprint
//!     keyed. The last line `sealing: …` compares it with `idem_orders_follow_up`:
//!
//! ```sh
//! cargo run --release --example bench -- \
//!     --variants idem_orders_follow_up,idem_orders_follow_up_sealed --runs 5
//! ```
//!
//! 13. `idem_ledger_batch`: the ledger handler as a batch handler in transactional
//!     mode, one `unnest` insert per batch (`Handler::handle_batch`). The line
//!     `batches: …` compares it with `idem_noop_tx` and `idem_ledger_tx`:
//!
//! ```sh
//! cargo run --release --example bench -- \
//!     --variants idem_noop_tx,idem_ledger_tx,idem_ledger_batch --runs 3
//! ```
//!
//! For the cost of traces with export off, compare `idem_ledger_traced` with
//! `idem_ledger` (same run, same binary); the last line `traces: …` does, with the
//! spread of `idem_ledger` over the runs as the noise. Without `idem_ledger_exporting`
//! in `--variants`, no OpenTelemetry layer is installed at all (as in a binary with
//! export off); with it, its layer is installed for the whole run and filtered off
//! outside that variant, which costs the others one filter call per span:
//!
//! ```sh
//! cargo run --release --features otel --example bench -- \
//!     --variants idem_ledger,idem_ledger_traced --runs 5
//! cargo run --release --features otel --example bench -- \
//!     --variants idem_ledger,idem_ledger_exporting --runs 5
//! ```
//!
//! It prints one line per variant and run, the medians, and a last line
//! `idem_msgs_per_s=… raw_msgs_per_s=… ratio=…`, with p50/p99 of delivery-to-ack for idem
//! and the peak RSS of this process while idem ran. Each variant's lines also give the
//! CPU time per message of RabbitMQ, of Postgres and of this process (the consumer)
//! while the messages were consumed, read from `/proc`: where the time goes.

#[allow(dead_code)]
#[path = "orders_worker.rs"]
mod orders_worker;

#[allow(dead_code)]
#[path = "support/cpu.rs"]
mod cpu;
#[allow(dead_code)]
#[path = "support/outcomes.rs"]
mod outcomes;

use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use cpu::CpuTicks;
use futures_util::StreamExt;
use idem::{
    Context, Handler, HandlerError, Mode, RetryPolicy, Store, StoreConfig, Worker, WorkerConfig,
};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use outcomes::Outcomes;
use serde::Deserialize;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgPool};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

#[derive(Parser, Debug, Clone)]
#[command(about = "idem benchmark: raw consumer vs hand-written dedup vs idem")]
struct Args {
    /// Messages per variant and run.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Runs; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Prefetch of every consumer.
    #[arg(long, default_value_t = 200)]
    prefetch: u16,
    /// idem's batch size (claims and completions per statement).
    #[arg(long, default_value_t = 128)]
    batch_size: usize,
    /// idem's batch linger in microseconds.
    #[arg(long, default_value_t = 1000)]
    linger_us: u64,
    /// idem's batches in flight at once.
    #[arg(long, default_value_t = 3)]
    in_flight: usize,
    /// Only these variants (comma separated): raw, handwritten, idem_noop, idem_orders,
    /// idem_orders_tx, idem_orders_follow_up, idem_ledger, idem_ledger_tx, idem_noop_tx,
    /// idem_ledger_traced, idem_ledger_exporting (the last with `--features otel`),
    /// idem_ledger_untallied, idem_ledger_limited, idem_ledger_batch.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "raw,handwritten,idem_noop,idem_orders,idem_orders_follow_up,idem_ledger,idem_ledger_tx,idem_noop_tx"
    )]
    variants: Vec<String>,
    /// Completed, unexpired records to put in the table first: how the rates hold up as
    /// `processed_operations` grows.
    #[arg(long, default_value_t = 0)]
    prefill: u64,
    /// Postgres server (the bench creates and drops its own database on it).
    #[arg(long, env = "DATABASE_URL", default_value = idem::db::DEFAULT_DATABASE_URL, hide_env_values = true)]
    database_url: String,
    /// RabbitMQ URL.
    #[arg(long, env = "AMQP_URL", default_value = idem::topology::DEFAULT_AMQP_URL, hide_env_values = true)]
    amqp_url: String,
}

/// A handler that does nothing but succeed.
struct NoOp;

#[derive(Deserialize)]
struct Event {
    event_id: String,
    tenant: String,
}

impl Handler for NoOp {
    type Message = Event;
    type Output = ();
    const OPERATION: &'static str = "bench.noop";

    fn scope(&self, e: &Event) -> String {
        e.tenant.clone()
    }

    fn idempotency_key(&self, e: &Event) -> String {
        e.event_id.clone()
    }

    fn volatile_fields(&self) -> &'static [&'static str] {
        &["sent_at"]
    }

    async fn handle(&self, _: Event, _: &mut Context) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// A handler that books one ledger row in the context's transaction: the most common
/// handler, one that only writes to this database.
struct Ledger;

impl Handler for Ledger {
    type Message = orders_worker::Order;
    type Output = ();
    const OPERATION: &'static str = "bench.ledger";

    fn scope(&self, o: &orders_worker::Order) -> String {
        o.tenant.clone()
    }

    fn idempotency_key(&self, o: &orders_worker::Order) -> String {
        o.event_id.clone()
    }

    async fn handle(&self, o: orders_worker::Order, ctx: &mut Context) -> Result<(), HandlerError> {
        sqlx::query(
            "INSERT INTO example_ledger (event_id, tenant, order_id, amount_cents, created_at)
             VALUES ($1, $2, $3, $4, now())",
        )
        .bind(&o.event_id)
        .bind(&o.tenant)
        .bind(&o.order_id)
        .bind(o.amount_cents)
        .execute(ctx.tx().await?)
        .await?;
        Ok(())
    }
}

/// [`Ledger`] as a batch handler: the rows of every order the worker decides together
/// in one `unnest` insert, one statement per batch instead of one per message.
struct BatchLedger;

impl Handler for BatchLedger {
    type Message = orders_worker::Order;
    type Output = ();
    const OPERATION: &'static str = "bench.ledger";

    fn scope(&self, o: &orders_worker::Order) -> String {
        o.tenant.clone()
    }

    fn idempotency_key(&self, o: &orders_worker::Order) -> String {
        o.event_id.clone()
    }

    async fn handle(&self, o: orders_worker::Order, ctx: &mut Context) -> Result<(), HandlerError> {
        Ledger.handle(o, ctx).await
    }

    async fn handle_batch(
        &self,
        batch: &mut idem::Batch<orders_worker::Order>,
    ) -> Option<Vec<Result<(), HandlerError>>> {
        Some(match book_all(batch).await {
            Ok(()) => vec![Ok(()); batch.len()],
            Err(error) => vec![Err(error.into()); batch.len()],
        })
    }
}

/// One ledger row per order of the batch, in one statement.
async fn book_all(batch: &mut idem::Batch<orders_worker::Order>) -> Result<(), sqlx::Error> {
    let orders = batch.messages();
    let column = |f: fn(&orders_worker::Order) -> &String| -> Vec<String> {
        orders.iter().map(|o| f(o).clone()).collect()
    };
    let (events, tenants, ids) = (
        column(|o| &o.event_id),
        column(|o| &o.tenant),
        column(|o| &o.order_id),
    );
    let amounts: Vec<i64> = orders.iter().map(|o| o.amount_cents).collect();
    sqlx::query(
        "INSERT INTO example_ledger (event_id, tenant, order_id, amount_cents, created_at)
         SELECT e, t, o, a, now() FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) AS u(e, t, o, a)",
    )
    .bind(&events)
    .bind(&tenants)
    .bind(&ids)
    .bind(&amounts)
    .execute(batch.tx().await?)
    .await?;
    Ok(())
}

/// [`Ledger`] holding a permit of a limit that never binds (1,000 at once, 10,000 a
/// second) around its insert: what taking a permit costs.
struct LimitedLedger(idem::Limit);

impl Handler for LimitedLedger {
    type Message = orders_worker::Order;
    type Output = ();
    const OPERATION: &'static str = "bench.ledger";

    fn scope(&self, o: &orders_worker::Order) -> String {
        o.tenant.clone()
    }

    fn idempotency_key(&self, o: &orders_worker::Order) -> String {
        o.event_id.clone()
    }

    async fn handle(&self, o: orders_worker::Order, ctx: &mut Context) -> Result<(), HandlerError> {
        let permit = self.0.acquire().await?;
        Ledger.handle(o, ctx).await?;
        permit.release().await;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let outcomes = Outcomes::default();
    let args = Args::parse();
    // The exporting variant's layer exists only when that variant is asked for: the
    // others then run as a binary with export off does, with no OpenTelemetry layer.
    let exporting = args.variants.iter().any(|v| v == "idem_ledger_exporting");
    tracing_subscriber::registry()
        .with(outcomes.clone())
        .with(exporting.then(exporting::layer))
        .init();
    match run(args, outcomes).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bench: error: {}", idem::text::error_line(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// One measurement.
#[derive(Debug, Clone, Copy, Default)]
struct Measure {
    msgs_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    peak_rss_mb: f64,
    /// CPU per message while the messages were consumed.
    cpu: CpuPerMessage,
}

/// CPU time per message, in microseconds, of the broker, of Postgres, and of this
/// process (the consumer: the raw loop, the hand-written one, or the idem worker).
#[derive(Debug, Clone, Copy, Default)]
struct CpuPerMessage {
    rabbitmq: f64,
    postgres: f64,
    consumer: f64,
}

impl std::fmt::Display for CpuPerMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cpu/msg rabbitmq {:.0} us postgres {:.0} us consumer {:.0} us",
            self.rabbitmq, self.postgres, self.consumer
        )
    }
}

/// What the processes used since `before`, per message of `messages`.
fn cpu_per_message(before: CpuTicks, messages: usize) -> CpuPerMessage {
    let used = before.per_op(messages, None);
    CpuPerMessage {
        rabbitmq: used.rabbitmq,
        postgres: used.postgres,
        consumer: used.this,
    }
}

async fn run(args: Args, outcomes: Outcomes) -> anyhow::Result<()> {
    let id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let server = PgConnectOptions::from_str(&args.database_url)?;
    let database = format!("idem_bench_{id}");
    let url = server
        .clone()
        .database(&database)
        .to_url_lossy()
        .to_string();
    let pool = idem::db::connect_and_migrate(&url, 40)
        .await
        .context("prepare the bench database")?;
    orders_worker::create_example_tables(&pool).await?;
    if args.prefill > 0 {
        let started = Instant::now();
        prefill(&pool, args.prefill).await?;
        let (table_mb, indexes_mb): (f64, f64) = sqlx::query_as(
            "SELECT pg_table_size('processed_operations') / 1048576.0::float8,
                    pg_indexes_size('processed_operations') / 1048576.0::float8",
        )
        .fetch_one(&pool)
        .await?;
        println!(
            "bench: {} records in the table first ({:.0} s; table {table_mb:.0} MiB, indexes {indexes_mb:.0} MiB)",
            args.prefill,
            started.elapsed().as_secs_f64()
        );
    }
    let connection = idem::topology::connect(&args.amqp_url, "idem-bench")
        .await
        .context("connect to RabbitMQ")?;
    println!(
        "bench: {} persistent messages per variant, prefetch {}, {} runs, batch {} linger {} us, {} cores",
        args.messages,
        args.prefetch,
        args.runs,
        args.batch_size,
        args.linger_us,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    let mut results: Vec<(String, Vec<Measure>)> = args
        .variants
        .iter()
        .map(|v| (v.clone(), Vec::new()))
        .collect();
    for run in 0..args.runs {
        for (variant, measures) in &mut results {
            let queue = format!("bench.{id}.{run}.{variant}");
            let m = match variant.as_str() {
                "raw" => raw(&connection, &args, &queue, run).await?,
                "handwritten" => handwritten(&connection, &pool, &args, &queue, run).await?,
                "idem_noop" | "idem_noop_tx" => {
                    let bench = Bench::new(&args, &pool, &connection, &queue, run, &outcomes);
                    idem_variant(&bench, NoOp, mode_of(variant)).await?
                }
                "idem_orders" | "idem_orders_tx" => {
                    let bench = Bench::new(&args, &pool, &connection, &queue, run, &outcomes);
                    let mode = mode_of(variant);
                    let orders = orders_worker::Orders {
                        mode,
                        ..orders_worker::Orders::default()
                    };
                    idem_variant(&bench, orders, mode).await?
                }
                "idem_orders_follow_up" | "idem_orders_follow_up_sealed" => {
                    let mut bench = Bench::new(&args, &pool, &connection, &queue, run, &outcomes);
                    bench.sealed = variant.ends_with("_sealed");
                    let follow_ups = format!("{queue}.follow");
                    declare_plain(&connection, &follow_ups).await?;
                    let orders = orders_worker::Orders {
                        follow_ups: Some(follow_ups),
                        ..orders_worker::Orders::default()
                    };
                    idem_variant(&bench, orders, Mode::Leased).await?
                }
                "idem_ledger" | "idem_ledger_tx" => {
                    let bench = Bench::new(&args, &pool, &connection, &queue, run, &outcomes);
                    idem_variant(&bench, Ledger, mode_of(variant)).await?
                }
                "idem_ledger_batch" => {
                    let bench = Bench::new(&args, &pool, &connection, &queue, run, &outcomes);
                    idem_variant(&bench, BatchLedger, Mode::Transactional).await?
                }
                "idem_ledger_limited" => {
                    let bench = Bench::new(&args, &pool, &connection, &queue, run, &outcomes);
                    let limit = idem::Limit::new(&format!("bench-{run}"), pool.clone())
                        .concurrent(1_000)
                        .per_second(10_000);
                    idem_variant(&bench, LimitedLedger(limit), Mode::Leased).await?
                }
                "idem_ledger_untallied" => {
                    let mut bench = Bench::new(&args, &pool, &connection, &queue, run, &outcomes);
                    bench.tallied = false;
                    idem_variant(&bench, Ledger, Mode::Leased).await?
                }
                "idem_ledger_traced" => {
                    let mut bench = Bench::new(&args, &pool, &connection, &queue, run, &outcomes);
                    bench.traced = true;
                    idem_variant(&bench, Ledger, Mode::Leased).await?
                }
                "idem_ledger_exporting" => {
                    let mut bench = Bench::new(&args, &pool, &connection, &queue, run, &outcomes);
                    bench.traced = true;
                    exporting::set(true)?;
                    let measured = idem_variant(&bench, Ledger, Mode::Leased).await;
                    exporting::set(false)?;
                    measured?
                }
                other => bail!("unknown variant {other}"),
            };
            println!(
                "run {} {:<22} {:>9.0} msgs/s  {}{}",
                run + 1,
                variant,
                m.msgs_per_s,
                m.cpu,
                if variant.starts_with("idem") {
                    format!(
                        "  delivery->ack p50 {:.1} ms p99 {:.1} ms  peak rss {:.0} MiB",
                        m.p50_ms, m.p99_ms, m.peak_rss_mb
                    )
                } else {
                    String::new()
                }
            );
            measures.push(m);
            delete_queues(&connection, &queue).await;
        }
    }
    let median = |name: &str| -> Option<Measure> {
        let (_, ms) = results.iter().find(|(v, _)| v == name)?;
        let mut ms = ms.clone();
        ms.sort_by(|a, b| a.msgs_per_s.total_cmp(&b.msgs_per_s));
        ms.get(ms.len() / 2).copied()
    };
    println!("medians of {} runs:", args.runs);
    for (variant, _) in &results {
        if let Some(m) = median(variant) {
            let ratio = median("raw").map_or(0.0, |raw| m.msgs_per_s / raw.msgs_per_s);
            let latency = if variant.starts_with("idem") {
                format!("  p50 {:.1} ms p99 {:.1} ms", m.p50_ms, m.p99_ms)
            } else {
                String::new()
            };
            println!(
                "  {variant:<22} {:>9.0} msgs/s  {ratio:.2}x raw  {}{latency}",
                m.msgs_per_s, m.cpu
            );
        }
    }
    if let (Some(sealed), Some(plain)) = (
        median("idem_orders_follow_up_sealed"),
        median("idem_orders_follow_up"),
    ) {
        println!(
            "sealing: idem_orders_follow_up_sealed_msgs_per_s={:.0} idem_orders_follow_up_msgs_per_s={:.0} ratio={:.2} (cpu: {} against {})",
            sealed.msgs_per_s,
            plain.msgs_per_s,
            sealed.msgs_per_s / plain.msgs_per_s,
            sealed.cpu,
            plain.cpu
        );
    }
    if let (Some(batch), Some(noop), Some(ledger)) = (
        median("idem_ledger_batch"),
        median("idem_noop_tx"),
        median("idem_ledger_tx"),
    ) {
        println!(
            "batches: idem_ledger_batch_msgs_per_s={:.0} idem_noop_tx_msgs_per_s={:.0} idem_ledger_tx_msgs_per_s={:.0} vs_noop_tx={:.2} vs_ledger_tx={:.2} (cpu: {} against {} and {})",
            batch.msgs_per_s,
            noop.msgs_per_s,
            ledger.msgs_per_s,
            batch.msgs_per_s / noop.msgs_per_s,
            batch.msgs_per_s / ledger.msgs_per_s,
            batch.cpu,
            noop.cpu,
            ledger.cpu
        );
    }
    if let (Some(with), Some(without)) = (median("idem_orders_follow_up"), median("idem_orders")) {
        println!(
            "follow_ups: idem_orders_follow_up_msgs_per_s={:.0} idem_orders_msgs_per_s={:.0} ratio={:.2}",
            with.msgs_per_s,
            without.msgs_per_s,
            with.msgs_per_s / without.msgs_per_s
        );
    }
    if let (Some(traced), Some(plain)) = (median("idem_ledger_traced"), median("idem_ledger")) {
        let (_, runs) = results
            .iter()
            .find(|(v, _)| v == "idem_ledger")
            .expect("idem_ledger ran");
        let rates = runs.iter().map(|m| m.msgs_per_s);
        let (low, high) = rates.fold((f64::MAX, 0.0_f64), |(l, h), r| (l.min(r), h.max(r)));
        let exporting = median("idem_ledger_exporting").map_or(0.0, |m| m.msgs_per_s);
        println!(
            "traces: export_off_msgs_per_s={:.0} baseline_msgs_per_s={:.0} ratio={:.3} baseline_spread={:.0}..{:.0} ({:.1}%) exporting_msgs_per_s={:.0} export_off_p50_ms={:.1} baseline_p50_ms={:.1}",
            traced.msgs_per_s,
            plain.msgs_per_s,
            traced.msgs_per_s / plain.msgs_per_s,
            low,
            high,
            (high - low) / plain.msgs_per_s * 100.0,
            exporting,
            traced.p50_ms,
            plain.p50_ms
        );
    }
    if let (Some(limited), Some(plain)) = (median("idem_ledger_limited"), median("idem_ledger")) {
        println!(
            "limits: limited_msgs_per_s={:.0} baseline_msgs_per_s={:.0} ratio={:.3} limited_postgres_us_per_msg={:.0} baseline_postgres_us_per_msg={:.0} limited_p50_ms={:.1} baseline_p50_ms={:.1}",
            limited.msgs_per_s,
            plain.msgs_per_s,
            limited.msgs_per_s / plain.msgs_per_s,
            limited.cpu.postgres,
            plain.cpu.postgres,
            limited.p50_ms,
            plain.p50_ms
        );
    }
    if let (Some(untallied), Some(plain)) = (median("idem_ledger_untallied"), median("idem_ledger"))
    {
        println!(
            "tally: tallied_msgs_per_s={:.0} untallied_msgs_per_s={:.0} ratio={:.3} tallied_p50_ms={:.1} untallied_p50_ms={:.1}",
            plain.msgs_per_s,
            untallied.msgs_per_s,
            plain.msgs_per_s / untallied.msgs_per_s,
            plain.p50_ms,
            untallied.p50_ms
        );
    }
    if let (Some(idem), Some(raw)) = (median("idem_noop"), median("raw")) {
        let hand = median("handwritten").map(|h| h.msgs_per_s).unwrap_or(0.0);
        println!(
            "idem_msgs_per_s={:.0} raw_msgs_per_s={:.0} ratio={:.2} handwritten_msgs_per_s={:.0} vs_handwritten={:.1} idem_p50_ms={:.1} idem_p99_ms={:.1} idem_peak_rss_mib={:.0}",
            idem.msgs_per_s,
            raw.msgs_per_s,
            idem.msgs_per_s / raw.msgs_per_s,
            hand,
            if hand > 0.0 {
                idem.msgs_per_s / hand
            } else {
                0.0
            },
            idem.p50_ms,
            idem.p99_ms,
            idem.peak_rss_mb
        );
    }
    let _ = connection.close(200, "done".into()).await;
    pool.close().await;
    let mut admin = server.database("postgres").connect().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await?;
    Ok(())
}

/// Publishes `n` orders to `queue` (declared classic and durable), confirms pipelined;
/// each in a trace of its own (a `traceparent` header) when `traced`.
async fn publish(
    connection: &Connection,
    queue: &str,
    n: usize,
    run: usize,
    traced: bool,
) -> anyhow::Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let topology = idem::Topology {
        queue: queue.to_owned(),
        queue_type: idem::QueueType::Classic,
        retry_delays: vec![Duration::from_secs(5)],
        subscriptions: Vec::new(),
        single_active_consumer: false,
    };
    topology.declare(connection).await?;
    let mut pending = Vec::with_capacity(1000);
    for i in 0..n {
        let body = orders_worker_body(&format!("{queue}-{run}-{i}"), i);
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(format!("m-{i}").as_str().into());
        if traced {
            let mut headers = FieldTable::default();
            let traceparent = format!("00-{:016x}{:016x}-{:016x}-01", run + 1, i + 1, i + 1);
            headers.insert(
                "traceparent".into(),
                lapin::types::AMQPValue::LongString(traceparent.as_str().into()),
            );
            properties = properties.with_headers(headers);
        }
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &body,
                properties,
            )
            .await?;
        pending.push(confirm);
        if pending.len() == 1000 {
            for confirm in pending.drain(..) {
                anyhow::ensure!(confirm.await?.is_ack(), "publish not confirmed");
            }
        }
    }
    for confirm in pending {
        anyhow::ensure!(confirm.await?.is_ack(), "publish not confirmed");
    }
    let _ = channel.close(200, "published".into()).await;
    Ok(())
}

fn orders_worker_body(event_id: &str, i: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "event_id": event_id,
        "tenant": if i.is_multiple_of(2) { "acme" } else { "globex" },
        "order_id": i,
        "amount_cents": 100 + i as i64,
        "sent_at": "2026-11-30T00:00:00Z",
    }))
    .unwrap_or_default()
}

async fn consumer(
    connection: &Connection,
    queue: &str,
    prefetch: u16,
) -> anyhow::Result<(Channel, lapin::Consumer)> {
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((channel, consumer))
}

async fn raw(
    connection: &Connection,
    args: &Args,
    queue: &str,
    run: usize,
) -> anyhow::Result<Measure> {
    publish(connection, queue, args.messages, run, false).await?;
    let cpu = CpuTicks::now(None);
    let (channel, mut consumer) = consumer(connection, queue, args.prefetch).await?;
    let mut started = None;
    // Acks are sent without waiting for each to be written, as a consumer that only
    // acks would; the clock stops when the last one is written.
    let mut acks = tokio::task::JoinSet::new();
    for _ in 0..args.messages {
        let Some(delivery) = consumer.next().await else {
            bail!("consumer ended")
        };
        let delivery = delivery?;
        started.get_or_insert_with(Instant::now);
        acks.spawn(async move { delivery.ack(BasicAckOptions::default()).await });
    }
    while let Some(ack) = acks.join_next().await {
        ack??;
    }
    let elapsed = started.map(|s| s.elapsed()).unwrap_or_default();
    let cpu = cpu_per_message(cpu, args.messages);
    let _ = channel.close(200, "done".into()).await;
    Ok(Measure {
        msgs_per_s: args.messages as f64 / elapsed.as_secs_f64(),
        cpu,
        ..Measure::default()
    })
}

async fn handwritten(
    connection: &Connection,
    pool: &PgPool,
    args: &Args,
    queue: &str,
    run: usize,
) -> anyhow::Result<Measure> {
    publish(connection, queue, args.messages, run, false).await?;
    let cpu = CpuTicks::now(None);
    let (channel, mut consumer) = consumer(connection, queue, args.prefetch).await?;
    let slots = Arc::new(Semaphore::new(32));
    let done = Arc::new(AtomicU64::new(0));
    let mut started = None;
    for _ in 0..args.messages {
        let Some(delivery) = consumer.next().await else {
            bail!("consumer ended")
        };
        let delivery = delivery?;
        started.get_or_insert_with(Instant::now);
        let permit = slots.clone().acquire_owned().await?;
        let (pool, done) = (pool.clone(), done.clone());
        tokio::spawn(async move {
            let body: serde_json::Value =
                serde_json::from_slice(&delivery.data).unwrap_or_default();
            let key = body["event_id"].as_str().unwrap_or_default().to_owned();
            let claimed: Option<i64> = sqlx::query_scalar(
                "INSERT INTO processed_operations
                   (scope, operation, idempotency_key, payload_sha256, status, lease_token, lease_expires_at)
                 VALUES ('bench', 'handwritten', $1, repeat('0', 64), 'processing',
                         nextval('processed_operations_lease_token_seq'), now() + interval '30 seconds')
                 ON CONFLICT ON CONSTRAINT processed_operations_key DO NOTHING RETURNING id",
            )
            .bind(&key)
            .fetch_optional(&pool)
            .await
            .unwrap_or(None);
            if let Some(id) = claimed {
                let _ = sqlx::query(
                    "UPDATE processed_operations SET status = 'completed', completed_at = now() WHERE id = $1",
                )
                .bind(id)
                .execute(&pool)
                .await;
            }
            let _ = delivery.ack(BasicAckOptions::default()).await;
            done.fetch_add(1, Ordering::SeqCst);
            drop(permit);
        });
    }
    while done.load(Ordering::SeqCst) < args.messages as u64 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let elapsed = started.map(|s| s.elapsed()).unwrap_or_default();
    let cpu = cpu_per_message(cpu, args.messages);
    let _ = channel.close(200, "done".into()).await;
    Ok(Measure {
        msgs_per_s: args.messages as f64 / elapsed.as_secs_f64(),
        cpu,
        ..Measure::default()
    })
}

fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

fn mode_of(variant: &str) -> Mode {
    if variant.ends_with("_tx") {
        Mode::Transactional
    } else {
        Mode::Leased
    }
}

/// One idem variant's run: where, and what it reports to.
struct Bench<'a> {
    args: &'a Args,
    pool: &'a PgPool,
    connection: &'a Connection,
    queue: &'a str,
    run: usize,
    outcomes: &'a Outcomes,
    /// Messages carry a `traceparent`.
    traced: bool,
    /// The worker counts outcomes for the console (`WorkerConfig::tally_every`).
    tallied: bool,
    /// Stored values are sealed and fingerprints keyed (`StoreConfig::keys`).
    sealed: bool,
}

impl<'a> Bench<'a> {
    fn new(
        args: &'a Args,
        pool: &'a PgPool,
        connection: &'a Connection,
        queue: &'a str,
        run: usize,
        outcomes: &'a Outcomes,
    ) -> Self {
        Self {
            args,
            pool,
            connection,
            queue,
            run,
            outcomes,
            traced: false,
            tallied: true,
            sealed: false,
        }
    }
}

async fn idem_variant<H: Handler>(
    b: &Bench<'_>,
    handler: H,
    mode: Mode,
) -> anyhow::Result<Measure> {
    let (args, pool, connection, queue, run, outcomes) =
        (b.args, b.pool, b.connection, b.queue, b.run, b.outcomes);
    publish(connection, queue, args.messages, run, b.traced).await?;
    let cpu = CpuTicks::now(None);
    outcomes.reset();
    // Each sealed run has a key of its own, and an unsealed run none: the keys the last
    // run registered are forgotten first, or the store would refuse to start (its rows
    // are never read again: every run has its own keys).
    sqlx::query("DELETE FROM idem_keys").execute(pool).await?;
    let keys = match b.sealed {
        true => Some(idem::protect::Keys::parse(&idem::protect::Keys::generate(
            "bench",
        ))?),
        false => None,
    };
    let store = Store::new(
        pool.clone(),
        StoreConfig {
            keys,
            ..StoreConfig::default()
        },
    );
    let config = WorkerConfig {
        amqp_url: args.amqp_url.clone(),
        queue: queue.to_owned(),
        mode,
        concurrency: usize::from(args.prefetch),
        prefetch: args.prefetch,
        retry: RetryPolicy {
            delays: vec![Duration::from_secs(5)],
            ..RetryPolicy::default()
        },
        batch_size: args.batch_size,
        batch_linger: Duration::from_micros(args.linger_us),
        batches_in_flight: args.in_flight,
        name: format!("idem-bench-{queue}"),
        tally_every: if b.tallied {
            WorkerConfig::default().tally_every
        } else {
            None
        },
        ..WorkerConfig::default()
    };
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(Worker::new(handler, store, config).run(shutdown.clone()));
    // The clock starts when the first delivery is decided (connecting is not counted,
    // as for the other variants), then runs until all are.
    let deadline = Instant::now() + Duration::from_secs(600);
    while outcomes.total() == 0 {
        anyhow::ensure!(Instant::now() < deadline, "idem never started");
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let started = Instant::now();
    let mut peak = rss_mb();
    let mut sampled = Instant::now();
    while outcomes.total() < args.messages {
        anyhow::ensure!(Instant::now() < deadline, "idem did not finish");
        // Memory every 50 ms: reading /proc every 2 ms cost the worker under test
        // 1.5 % of the process's CPU (perf).
        if sampled.elapsed() >= Duration::from_millis(50) {
            peak = peak.max(rss_mb());
            sampled = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed();
    let cpu = cpu_per_message(cpu, args.messages);
    let executed = outcomes.get("executed");
    shutdown.cancel();
    worker.await??;
    anyhow::ensure!(
        executed == args.messages,
        "only {executed} of {} executed",
        args.messages
    );
    Ok(Measure {
        msgs_per_s: args.messages as f64 / elapsed.as_secs_f64(),
        p50_ms: outcomes.elapsed_quantile(0.5),
        p99_ms: outcomes.elapsed_quantile(0.99),
        peak_rss_mb: peak.max(rss_mb()),
        cpu,
    })
}

async fn delete_queues(connection: &Connection, queue: &str) {
    let Ok(channel) = connection.create_channel().await else {
        return;
    };
    for suffix in ["", ".dlq", ".retry.5s", ".follow"] {
        let name = format!("{queue}{suffix}");
        let _ = channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = channel.close(200, "cleanup".into()).await;
}

/// Declares a durable classic queue (where follow-ups go).
async fn declare_plain(connection: &Connection, queue: &str) -> anyhow::Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let _ = channel.close(200, "declared".into()).await;
    Ok(())
}

/// Writes `n` completed records that expire in a week, with random keys (a uuid each, so
/// new keys land all over the unique index, as real event ids do).
async fn prefill(pool: &PgPool, n: u64) -> anyhow::Result<()> {
    let mut done = 0u64;
    while done < n {
        let chunk = (n - done).min(500_000);
        sqlx::query(
            "INSERT INTO processed_operations
               (scope, operation, idempotency_key, payload_sha256, status, attempts,
                lease_token, result, completed_at, expires_at)
             SELECT 'acme', 'bench.noop', gen_random_uuid()::text,
                    md5(i::text) || md5(i::text), 'completed', 1, 1, 'null'::jsonb, now(),
                    now() + interval '7 days' + i * interval '1 millisecond'
             FROM generate_series($1::bigint, $2::bigint) i",
        )
        .bind(done as i64)
        .bind((done + chunk - 1) as i64)
        .execute(pool)
        .await
        .context("prefill")?;
        done += chunk;
    }
    sqlx::query("VACUUM ANALYZE processed_operations")
        .execute(pool)
        .await?;
    Ok(())
}

/// The `idem_ledger_exporting` variant's OpenTelemetry layer: installed for the whole
/// run, and switched on only while that variant runs (a per-layer filter), so the other
/// variants run as with export off.
mod exporting {
    use std::sync::atomic::{AtomicBool, Ordering};

    static ON: AtomicBool = AtomicBool::new(false);

    #[cfg(feature = "otel")]
    pub(super) fn layer<S>() -> impl tracing_subscriber::Layer<S>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        use opentelemetry::trace::TracerProvider;
        use tracing_subscriber::Layer;

        // Kept for the whole run: a provider dropped shuts its exporter down.
        static PROVIDER: std::sync::OnceLock<opentelemetry_sdk::trace::SdkTracerProvider> =
            std::sync::OnceLock::new();
        let provider = PROVIDER.get_or_init(|| {
            opentelemetry_sdk::trace::SdkTracerProvider::builder()
                .with_batch_exporter(Dropping)
                .build()
        });
        let tracer = provider.tracer("idem-bench");
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_filter(tracing_subscriber::filter::filter_fn(|_| {
                ON.load(Ordering::Relaxed)
            }))
    }

    #[cfg(not(feature = "otel"))]
    pub(super) fn layer() -> tracing_subscriber::layer::Identity {
        tracing_subscriber::layer::Identity::new()
    }

    /// Switches export on or off; on needs the feature.
    pub(super) fn set(on: bool) -> anyhow::Result<()> {
        anyhow::ensure!(
            cfg!(feature = "otel") || !on,
            "idem_ledger_exporting needs the bench built with --features otel"
        );
        ON.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// An exporter that drops what it is given.
    #[cfg(feature = "otel")]
    #[derive(Debug)]
    struct Dropping;

    #[cfg(feature = "otel")]
    impl opentelemetry_sdk::trace::SpanExporter for Dropping {
        async fn export(
            &self,
            batch: Vec<opentelemetry_sdk::trace::SpanData>,
        ) -> opentelemetry_sdk::error::OTelSdkResult {
            drop(batch);
            Ok(())
        }
    }
}
