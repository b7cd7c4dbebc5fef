//! One service, four job types over three queues: orders, the notifications their
//! bookings stage, and refunds and cancellations, two message types on one queue fed by
//! a topic exchange; one process that shares one broker connection, one Postgres pool,
//! one outbox relay and one `/healthz`.
//!
//! ```sh
//! cargo run --example shop -- --metrics-addr 127.0.0.1:9464 &
//! cargo run --example orders_producer -- --queue shop.orders --orders 100
//! curl -s 127.0.0.1:9464/healthz    # broker: up, one line per queue, database: up
//! ```
//!
//! - `shop.orders`: [`Orders`] (leased: it calls a stand-in provider), staging one
//!   follow-up per booked order to `shop.notifications`;
//! - `shop.notifications`: [`Notifications`] (transactional: database writes only);
//! - `shop.order-events`, bound to the topic exchange `shop.events` with `order.*`:
//!   [`Refunds`] for messages of type `order.refunded` and [`Cancellations`] for
//!   `order.cancelled` (transactional); any other type (`order.shipped`, until
//!   `--shipments` hosts [`Shipments`]) is dead-lettered as `unroutable`, and
//!   `idem dlq replay --queue shop.order-events` brings it back once it is handled.
//!
//! `--prefix` names the queues (`<prefix>.orders`, …). SIGTERM drains every queue.

#[allow(dead_code)]
#[path = "orders_worker.rs"]
mod orders_worker;

#[allow(dead_code)]
#[path = "notifications_worker.rs"]
mod notifications_worker;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use idem::{
    Context, Handler, HandlerError, Mode, RetryPolicy, Service, ServiceConfig, Store, StoreConfig,
    Subscription, WorkerConfig,
};
use serde::Deserialize;
use serde_json::{Value, json};

use notifications_worker::Notifications;
use orders_worker::Orders;

/// An event about an order, as the order service publishes it to the topic exchange
/// `<prefix>.events` with the routing key and AMQP `type` `order.refunded`,
/// `order.cancelled` or `order.shipped`.
#[derive(Debug, Deserialize)]
pub struct OrderEvent {
    /// The business event ID: the idempotency key.
    pub event_id: String,
    /// The scope.
    pub tenant: String,
    /// The order.
    pub order_id: String,
    /// How much (a refund's).
    #[serde(default)]
    pub amount_cents: i64,
}

/// Refunds an order: one row in `example_order_events`, in the operation's transaction.
#[derive(Debug, Clone, Default)]
pub struct Refunds;

/// Cancels an order, likewise.
#[derive(Debug, Clone, Default)]
pub struct Cancellations;

/// Ships an order, likewise: the handler deployed after its first events came
/// (`--shipments`), which `idem dlq replay` then runs.
#[derive(Debug, Clone, Default)]
pub struct Shipments;

macro_rules! order_event_handler {
    ($handler:ty, $operation:literal, $kind:literal) => {
        impl Handler for $handler {
            type Message = OrderEvent;
            type Output = Value;
            const OPERATION: &'static str = $operation;

            fn scope(&self, event: &OrderEvent) -> String {
                event.tenant.clone()
            }

            fn idempotency_key(&self, event: &OrderEvent) -> String {
                event.event_id.clone()
            }

            async fn handle(
                &self,
                event: OrderEvent,
                ctx: &mut Context,
            ) -> Result<Value, HandlerError> {
                record(ctx, $kind, &event).await
            }
        }
    };
}

order_event_handler!(Refunds, "orders.refund", "refunded");
order_event_handler!(Cancellations, "orders.cancel", "cancelled");
order_event_handler!(Shipments, "orders.ship", "shipped");

/// Writes `event` as `kind` through `ctx.tx()`: it commits with the operation's record.
async fn record(ctx: &mut Context, kind: &str, event: &OrderEvent) -> Result<Value, HandlerError> {
    sqlx::query(
        "INSERT INTO example_order_events (kind, event_id, tenant, order_id, amount_cents, created_at)
         VALUES ($1, $2, $3, $4, $5, now())",
    )
    .bind(kind)
    .bind(&event.event_id)
    .bind(&event.tenant)
    .bind(&event.order_id)
    .bind(event.amount_cents)
    .execute(ctx.tx().await?)
    .await?;
    Ok(json!({ kind: event.order_id }))
}

/// The events table, without a unique constraint: a duplicate must be visible.
pub async fn create_order_events_table(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "SELECT pg_advisory_xact_lock(hashtext('idem_example_tables'));
         CREATE TABLE IF NOT EXISTS example_order_events (
             kind text NOT NULL,
             event_id text NOT NULL,
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
#[command(about = "idem example service: orders, notifications and refunds in one process")]
struct Args {
    /// The queues are <prefix>.orders, <prefix>.notifications and <prefix>.order-events
    /// (bound to the topic exchange <prefix>.events with order.*).
    #[arg(long, default_value = "shop")]
    prefix: String,
    /// Host the handler of order.shipped too (without it, those events are
    /// dead-lettered as unroutable).
    #[arg(long)]
    shipments: bool,
    /// Handlers running at once, per queue.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Delays of the retry queues in milliseconds, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [5_000u64, 30_000, 300_000])]
    retry_delays_ms: Vec<u64>,
    /// Serve Prometheus metrics on http://HOST:PORT/metrics and health on /healthz.
    #[arg(long)]
    metrics_addr: Option<String>,
    /// How long a shutdown waits for each queue's handlers in flight, in seconds.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout_secs: u64,
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
    let _telemetry = match idem::telemetry::init("shop") {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("shop: error: {}", idem::text::error_line(&error));
            return ExitCode::FAILURE;
        }
    };
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("shop: error: {}", idem::text::error_line(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let name = format!("shop-{}", std::process::id());
    // One pool for the three queues: their concurrency summed, and a few more for the
    // batches, the relay and gc.
    let pool = idem::db::connect_and_migrate(&args.database_url, 3 * args.concurrency as u32 + 6)
        .await
        .context("prepare the database")?;
    orders_worker::create_example_tables(&pool).await?;
    notifications_worker::create_notifications_table(&pool).await?;
    create_order_events_table(&pool).await?;
    let store = Store::new(
        pool,
        StoreConfig {
            owner: name.clone(),
            session: idem::db::session_options(args.session_url.as_deref())?,
            keys: idem::protect::Keys::from_env()?,
            ..StoreConfig::default()
        },
    );
    let queue = |job: &str, mode: Mode| WorkerConfig {
        queue: format!("{}.{job}", args.prefix),
        mode,
        concurrency: args.concurrency,
        retry: RetryPolicy {
            delays: args
                .retry_delays_ms
                .iter()
                .map(|ms| Duration::from_millis(*ms))
                .collect(),
            ..RetryPolicy::default()
        },
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout_secs),
        ..WorkerConfig::default()
    };
    let orders = Orders {
        follow_ups: Some(format!("{}.notifications", args.prefix)),
        ..Orders::default()
    };
    let events = WorkerConfig {
        subscriptions: vec![Subscription::topic(
            format!("{}.events", args.prefix),
            &["order.*"],
        )],
        ..queue("order-events", Mode::Transactional)
    };
    let mut service = Service::new(
        store.clone(),
        ServiceConfig {
            amqp_url: args.amqp_url,
            name,
            ..ServiceConfig::default()
        },
    )
    // Each job type keeps its records for its own time: an order's for a month (its
    // producer may resend for weeks), a notification's for two days.
    .handler(
        orders,
        WorkerConfig {
            retention: Some(Duration::from_secs(30 * 86_400)),
            ..queue("orders", Mode::Leased)
        },
    )
    .handler(
        Notifications,
        WorkerConfig {
            retention: Some(Duration::from_secs(2 * 86_400)),
            ..queue("notifications", Mode::Transactional)
        },
    )
    // Two message types on one queue, told apart by their AMQP `type`.
    .handler_for("order.refunded", Refunds, events.clone())
    .handler_for("order.cancelled", Cancellations, events.clone());
    if args.shipments {
        service = service.handler_for("order.shipped", Shipments, events);
    }
    let shutdown = idem::shutdown::on_signal();
    if let Some(addr) = &args.metrics_addr {
        let health = service.broker_health();
        let bound = idem::metrics::serve(addr, store.pool().clone(), health, shutdown.clone())
            .await
            .context("metrics")?;
        tracing::info!(%bound, "serving /metrics and /healthz");
    }
    service.run(shutdown).await.context("service")?;
    Ok(())
}
