//! The second link of a chain of idem consumers: it consumes the follow-up messages
//! `orders_worker --follow-ups notifications` stages for every booked order, and writes
//! one notification per order.
//!
//! ```sh
//! cargo run --example notifications_worker -- --queue notifications
//! cargo run --example orders_worker -- --queue orders --follow-ups notifications
//! ```
//!
//! The key is the follow-up's `event_id`, which the outbox derived from the order's key:
//! a copy published twice (a crash after the broker's confirm, before the outbox row was
//! marked) is the same intent here, and notifies once. `example_notifications` has no
//! unique constraint, so a duplicate would show.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use idem::{
    Context, Handler, HandlerError, Mode, QueueType, RetryPolicy, Store, StoreConfig, Worker,
    WorkerConfig,
};
use serde::Deserialize;
use serde_json::{Value, json};

/// A booked order, as `orders_worker` stages it.
#[derive(Debug, Deserialize)]
pub struct Booked {
    /// The follow-up's id, derived from the order's key: the idempotency key here.
    pub event_id: String,
    /// The order's own event id.
    pub order_event_id: String,
    /// The scope.
    pub tenant: String,
    /// The order.
    pub order_id: String,
    /// What was booked.
    pub amount_cents: i64,
}

/// Writes one notification per booked order, in the operation's transaction.
#[derive(Debug, Clone, Default)]
pub struct Notifications;

impl Handler for Notifications {
    type Message = Booked;
    type Output = Value;
    const OPERATION: &'static str = "notifications.send";

    fn scope(&self, booked: &Booked) -> String {
        booked.tenant.clone()
    }

    fn idempotency_key(&self, booked: &Booked) -> String {
        booked.event_id.clone()
    }

    async fn handle(&self, booked: Booked, ctx: &mut Context) -> Result<Value, HandlerError> {
        sqlx::query(
            "INSERT INTO example_notifications
                 (event_id, order_event_id, tenant, order_id, amount_cents, created_at)
             VALUES ($1, $2, $3, $4, $5, now())",
        )
        .bind(&booked.event_id)
        .bind(&booked.order_event_id)
        .bind(&booked.tenant)
        .bind(&booked.order_id)
        .bind(booked.amount_cents)
        .execute(ctx.tx().await?)
        .await?;
        Ok(json!({"notified": booked.order_event_id}))
    }
}

/// The example's table, without a unique constraint: a duplicate must be visible.
pub async fn create_notifications_table(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "SELECT pg_advisory_xact_lock(hashtext('idem_example_tables'));
         CREATE TABLE IF NOT EXISTS example_notifications (
             event_id text NOT NULL,
             order_event_id text NOT NULL,
             tenant text NOT NULL,
             order_id text NOT NULL,
             amount_cents bigint NOT NULL,
             created_at timestamptz NOT NULL
         );",
    )
    .execute(pool)
    .await?;
    Ok(())
}

#[derive(Parser, Debug)]
#[command(about = "idem example worker: one notification per booked order")]
struct Args {
    /// The queue to consume.
    #[arg(long, default_value = "notifications")]
    queue: String,
    /// leased or transactional (this handler only writes to the database, so
    /// transactional suits it).
    #[arg(long, default_value = "transactional")]
    mode: Mode,
    /// Classic or quorum queues.
    #[arg(long, default_value = "classic", value_parser = ["classic", "quorum"])]
    queue_type: String,
    /// Handlers running at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Delays of the retry queues in milliseconds, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [5_000u64, 30_000, 300_000])]
    retry_delays_ms: Vec<u64>,
    /// Postgres URL.
    #[arg(long, env = "DATABASE_URL", default_value = idem::db::DEFAULT_DATABASE_URL, hide_env_values = true)]
    database_url: String,
    /// Postgres URL for what needs a session of its own (the gc lock, the relay's
    /// LISTEN) when --database-url goes through a transaction pooler.
    #[arg(long, env = "DATABASE_SESSION_URL", hide_env_values = true)]
    session_url: Option<String>,
    /// RabbitMQ URL.
    #[arg(long, env = "AMQP_URL", default_value = idem::topology::DEFAULT_AMQP_URL, hide_env_values = true)]
    amqp_url: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    // Logs; traces too when built with `--features otel` and OTEL_EXPORTER_OTLP_ENDPOINT
    // is set. Kept until `main` returns, so the last spans are sent.
    let _telemetry = match idem::telemetry::init("notifications_worker") {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!(
                "notifications_worker: error: {}",
                idem::text::error_line(&error)
            );
            return ExitCode::FAILURE;
        }
    };
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!(
                "notifications_worker: error: {}",
                idem::text::error_line(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let name = format!("notifications_worker-{}", std::process::id());
    let pool = idem::db::connect_and_migrate(&args.database_url, args.concurrency as u32 + 4)
        .await
        .context("prepare the database")?;
    create_notifications_table(&pool)
        .await
        .context("create the example table")?;
    let store = Store::new(
        pool,
        StoreConfig {
            owner: name.clone(),
            session: idem::db::session_options(args.session_url.as_deref())?,
            keys: idem::protect::Keys::from_env()?,
            ..StoreConfig::default()
        },
    );
    let config = WorkerConfig {
        amqp_url: args.amqp_url,
        queue: args.queue,
        mode: args.mode,
        queue_type: if args.queue_type == "quorum" {
            QueueType::Quorum
        } else {
            QueueType::Classic
        },
        concurrency: args.concurrency,
        retry: RetryPolicy {
            delays: args
                .retry_delays_ms
                .iter()
                .map(|ms| Duration::from_millis(*ms))
                .collect(),
            ..RetryPolicy::default()
        },
        shutdown_timeout: Duration::from_secs(10),
        name,
        ..WorkerConfig::default()
    };
    let worker = Worker::new(Notifications, store, config);
    worker
        .run(idem::shutdown::on_signal())
        .await
        .context("worker")?;
    Ok(())
}
