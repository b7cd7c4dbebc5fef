//! A real idem worker for `orders.create`, and the reference for writing your own.
//!
//! Run with (Postgres and RabbitMQ on the default ports):
//!
//! ```sh
//! cargo run --example orders_worker -- --queue orders
//! ```
//!
//! It applies the migrations, creates its example tables, declares `orders`,
//! `orders.retry.*` and `orders.dlq`, and consumes. Messages are JSON objects
//! `{"event_id", "tenant", "order_id", "amount_cents", "sent_at"}`: the key is
//! `event_id`, the scope `tenant`, and `sent_at` is left out of the fingerprint, so a
//! producer may resend an order with another message id, another `sent_at` and its keys
//! in another order: it is the same intent and books once. SIGTERM or Ctrl-C stops it
//! gracefully.
//!
//! With `--follow-ups notifications`, every booked order also stages one follow-up
//! message to the queue `notifications` (through the transactional outbox: it is sent
//! only if the booking commits, and carries an id derived from the order's key), which
//! `examples/notifications_worker.rs` consumes: a chain of two idem consumers.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use idem::outbox::OutboxConfig;
use idem::{
    Batch, CircuitBreaker, Context, FollowUp, Handler, HandlerError, Limit, Mode, QueueType,
    ResultExt, RetryPolicy, Store, StoreConfig, Topology, Worker, WorkerConfig,
};
use serde::{Deserialize, Deserializer};
use serde_json::{Value, json};

/// One order, as producers publish it.
#[derive(Debug, Deserialize)]
pub struct Order {
    /// The business event ID: the idempotency key.
    pub event_id: String,
    /// The tenant: the scope.
    pub tenant: String,
    /// The order, a string or a number.
    #[serde(deserialize_with = "string_or_number")]
    pub order_id: String,
    /// Negative amounts fail for good.
    pub amount_cents: i64,
}

/// Books an order: one call to a (stand-in) payment provider carrying the idempotency
/// key, then one ledger row written in the context's transaction.
#[derive(Debug, Clone, Default)]
pub struct Orders {
    /// Orders of this tenant fail for good, to rehearse an outage.
    pub fail_tenant: Option<String>,
    /// Pause between the provider call and the ledger write (a slow provider).
    pub provider_delay: Duration,
    /// Each pause drawn at random between none and twice `provider_delay`.
    pub provider_delay_random: bool,
    /// In transactional mode the "provider call" row is written in the handler's
    /// transaction too: every effect of this handler is then in this database.
    pub mode: Mode,
    /// Stage one follow-up message per booked order to this queue.
    pub follow_ups: Option<String>,
    /// Publish those follow-ups not before this long after booking (a reminder).
    pub follow_up_delay: Option<Duration>,
    /// Take a permit of this limit around the provider call, and note when the call
    /// ended (`finished_at`): the provider's own log of its concurrency and rate.
    pub limit: Option<Limit>,
    /// While this file exists the provider is down: its calls fail, transiently.
    pub provider_down: Option<PathBuf>,
    /// In transactional mode, book the orders the worker decides together with one
    /// insert per table ([`Handler::handle_batch`]) instead of one per order.
    pub batch: bool,
}

impl Handler for Orders {
    type Message = Order;
    type Output = Value;
    const OPERATION: &'static str = "orders.create";

    fn scope(&self, order: &Order) -> String {
        order.tenant.clone()
    }

    fn idempotency_key(&self, order: &Order) -> String {
        order.event_id.clone()
    }

    fn volatile_fields(&self) -> &'static [&'static str] {
        &["sent_at"]
    }

    async fn handle(&self, order: Order, ctx: &mut Context) -> Result<Value, HandlerError> {
        self.check(&order)?;
        // At most so many calls at once and per second, across every worker process.
        let permit = match &self.limit {
            Some(limit) => Some(limit.acquire().await?),
            None => None,
        };
        if self
            .provider_down
            .as_ref()
            .is_some_and(|down| down.exists())
        {
            return Err(HandlerError::transient("the payment provider is down"));
        }
        // The external call. A real provider gets ctx.provider_key() as its own
        // idempotency key, so a retry after a crash repeats this request, not a new one.
        // Autocommit on purpose: like a real API call, it is not rolled back.
        let provider_call = sqlx::query(
            "INSERT INTO example_provider_calls (idempotency_key, event_id, called_at)
             VALUES ($1, $2, clock_timestamp())",
        )
        .bind(ctx.provider_key())
        .bind(&order.event_id);
        match self.mode {
            Mode::Leased => provider_call.execute(ctx.pool()).await?,
            Mode::Transactional => provider_call.execute(ctx.tx().await?).await?,
        };
        if !self.provider_delay.is_zero() {
            let delay = if self.provider_delay_random {
                self.provider_delay.mul_f64(rand::random_range(0.0..2.0))
            } else {
                self.provider_delay
            };
            tokio::time::sleep(delay).await;
        }
        if let Some(permit) = permit {
            sqlx::query(
                "UPDATE example_provider_calls SET finished_at = clock_timestamp()
                  WHERE idempotency_key = $1 AND finished_at IS NULL",
            )
            .bind(ctx.provider_key())
            .execute(ctx.pool())
            .await?;
            permit.release().await;
        }
        // The database effect, committed atomically with the `completed` record. `?`
        // sorts database errors by cause: an order whose data Postgres refuses (a NUL
        // in `order_id`, say) fails for good at once; an outage is retried.
        sqlx::query(
            "INSERT INTO example_ledger (event_id, tenant, order_id, amount_cents, created_at)
             VALUES ($1, $2, $3, $4, now())",
        )
        .bind(&order.event_id)
        .bind(&order.tenant)
        .bind(&order.order_id)
        .bind(order.amount_cents)
        .execute(ctx.tx().await?)
        .await?;
        // Staged in the same transaction: sent only if this booking commits.
        if let Some(follow_up) = self.follow_up(&order, ctx.next_message_id())? {
            ctx.publish(follow_up).await?;
        }
        Ok(booked(&order))
    }

    /// The same booking for every order of a batch, in one insert per table: what
    /// `handle` does for one order, without a round trip per order. Orders that fail
    /// validation answer their error; the worker then runs each order through `handle`
    /// alone, so only theirs fail.
    async fn handle_batch(
        &self,
        batch: &mut Batch<Order>,
    ) -> Option<Vec<Result<Value, HandlerError>>> {
        // What the batch does not do (a paced or limited provider call) runs one by one.
        if !self.batch
            || self.mode != Mode::Transactional
            || self.limit.is_some()
            || !self.provider_delay.is_zero()
            || self.provider_down.is_some()
        {
            return None;
        }
        Some(
            self.book_batch(batch)
                .await
                .unwrap_or_else(|error| vec![Err(error); batch.len()]),
        )
    }
}

impl Orders {
    /// Checks each order, then writes the provider calls and ledger rows of the batch
    /// with one `unnest` insert each, and stages each order's follow-up.
    async fn book_batch(
        &self,
        batch: &mut Batch<Order>,
    ) -> Result<Vec<Result<Value, HandlerError>>, HandlerError> {
        let outcomes: Vec<Result<Value, HandlerError>> = batch
            .messages()
            .iter()
            .map(|order| self.check(order).map(|()| booked(order)))
            .collect();
        if outcomes.iter().any(Result::is_err) {
            return Ok(outcomes);
        }
        let keys: Vec<String> = batch.iter().map(|(_, ctx)| ctx.provider_key()).collect();
        let column =
            |f: fn(&Order) -> String| -> Vec<String> { batch.messages().iter().map(f).collect() };
        let (events, tenants, ids) = (
            column(|o| o.event_id.clone()),
            column(|o| o.tenant.clone()),
            column(|o| o.order_id.clone()),
        );
        let amounts: Vec<i64> = batch.messages().iter().map(|o| o.amount_cents).collect();
        sqlx::query(
            "INSERT INTO example_provider_calls (idempotency_key, event_id, called_at)
             SELECT k, e, clock_timestamp() FROM unnest($1::text[], $2::text[]) AS u(k, e)",
        )
        .bind(&keys)
        .bind(&events)
        .execute(batch.tx().await?)
        .await?;
        sqlx::query(
            "INSERT INTO example_ledger (event_id, tenant, order_id, amount_cents, created_at)
             SELECT e, t, o, a, now()
               FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) AS u(e, t, o, a)",
        )
        .bind(&events)
        .bind(&tenants)
        .bind(&ids)
        .bind(&amounts)
        .execute(batch.tx().await?)
        .await?;
        tracing::debug!(
            orders = batch.len(),
            "booked a batch with one insert per table"
        );
        for item in 0..batch.len() {
            let next_id = batch
                .context(item)
                .map(Context::next_message_id)
                .unwrap_or_default();
            if let Some(follow_up) = self.follow_up(&batch.messages()[item], next_id)? {
                batch.publish(item, follow_up).await?;
            }
        }
        Ok(outcomes)
    }

    /// Fails an order for good that must not be booked.
    fn check(&self, order: &Order) -> Result<(), HandlerError> {
        if self.fail_tenant.as_deref() == Some(order.tenant.as_str()) {
            return Err(HandlerError::permanent(format!(
                "tenant {} is failing (--fail-tenant)",
                order.tenant
            )));
        }
        if order.amount_cents < 0 {
            return Err(HandlerError::permanent("invalid amount"));
        }
        Ok(())
    }

    /// The follow-up of a booked order, when `--follow-ups` names a queue. Its id (the
    /// AMQP message_id too), `next_id`, is derived from the order's key, so the body
    /// can name it, and a copy sent twice is the same event downstream.
    fn follow_up(&self, order: &Order, next_id: String) -> Result<Option<FollowUp>, HandlerError> {
        let Some(queue) = &self.follow_ups else {
            return Ok(None);
        };
        let booked = json!({
            "event_id": next_id,
            "order_event_id": order.event_id,
            "tenant": order.tenant,
            "order_id": order.order_id,
            "amount_cents": order.amount_cents,
        });
        let mut follow_up = FollowUp::json("", queue.as_str(), &booked).permanent()?;
        if let Some(delay) = self.follow_up_delay {
            follow_up = follow_up.delayed(delay);
        }
        Ok(Some(follow_up))
    }
}

/// What a booking answers: stored on the record.
fn booked(order: &Order) -> Value {
    json!({"order_id": order.order_id, "booked_cents": order.amount_cents})
}

/// `CONCURRENT/PER_SECOND`.
fn parse_limit(text: &str) -> Result<(u32, u32), String> {
    let (concurrent, per_second) = text
        .split_once('/')
        .ok_or_else(|| format!("{text:?}: CONCURRENT/PER_SECOND, e.g. 10/50"))?;
    let number = |n: &str| n.trim().parse::<u32>().map_err(|e| format!("{n:?}: {e}"));
    Ok((number(concurrent)?, number(per_second)?))
}

fn string_or_number<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    match Value::deserialize(d)? {
        Value::String(s) => Ok(s),
        Value::Number(n) => Ok(n.to_string()),
        other => Err(serde::de::Error::custom(format!(
            "order_id must be a string or a number, not {other}"
        ))),
    }
}

/// The example's tables. Neither has a unique constraint: a duplicate effect must be
/// visible, not absorbed.
pub async fn create_example_tables(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    // One simple query runs as one transaction: the advisory lock serialises workers
    // starting together (concurrent CREATE TABLE IF NOT EXISTS can collide).
    sqlx::raw_sql(
        "SELECT pg_advisory_xact_lock(hashtext('idem_example_tables'));
         CREATE TABLE IF NOT EXISTS example_provider_calls (
             idempotency_key text NOT NULL,
             event_id text NOT NULL,
             called_at timestamptz NOT NULL
         );
         ALTER TABLE example_provider_calls ADD COLUMN IF NOT EXISTS finished_at timestamptz;
         CREATE TABLE IF NOT EXISTS example_ledger (
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
#[command(about = "idem example worker: books orders exactly once")]
struct Args {
    /// The queue to consume (its retry queues and DLQ are declared beside it).
    #[arg(long, default_value = "orders")]
    queue: String,
    /// Deliveries run at once (0: chosen from the mode, see `WorkerConfig::concurrency`).
    #[arg(long, default_value_t = 0)]
    concurrency: usize,
    /// Postgres connections (default: the concurrency and 4 more, 24 when it is chosen
    /// from the mode: Postgres on a few cores gains nothing from more).
    #[arg(long)]
    pool_size: Option<u32>,
    /// Unacked deliveries the broker sends ahead (0: twice the deliveries run at once).
    #[arg(long, default_value_t = 0)]
    prefetch: u16,
    /// Most claims (and completions) per statement; in transactional mode, most
    /// deliveries per transaction (default: `WorkerConfig::batch_size`'s).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Batches running at once, each on a connection of its own (default:
    /// `WorkerConfig::batches_in_flight`'s).
    #[arg(long)]
    batches_in_flight: Option<usize>,
    /// leased: claim, then run under a lease (for handlers that call out);
    /// transactional: claim, effects and outcome in one transaction per batch.
    #[arg(long, default_value = "leased")]
    mode: Mode,
    /// Lease of a claim in seconds (heartbeats extend it while the handler runs).
    #[arg(long, default_value_t = 30)]
    lease_secs: u64,
    /// Orders of this tenant fail for good (rehearse an outage and a replay).
    #[arg(long)]
    fail_tenant: Option<String>,
    /// Serve Prometheus metrics on http://HOST:PORT/metrics and health on /healthz.
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Delete expired records every this many seconds (0: never; use `idem gc`).
    #[arg(long, default_value_t = 0)]
    gc_every_secs: u64,
    /// Classic or quorum queues.
    #[arg(long, default_value = "classic", value_parser = ["classic", "quorum"])]
    queue_type: String,
    /// Delays of the retry queues in milliseconds, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [5_000u64, 30_000, 300_000])]
    retry_delays_ms: Vec<u64>,
    /// After how many seconds a retryable or pending record whose next delivery has not
    /// come counts as overdue (default: the longest retry delay, the lease and a minute).
    #[arg(long)]
    retry_overdue_secs: Option<u64>,
    /// Immediate in-process retries of a transient failure.
    #[arg(long, default_value_t = 2)]
    immediate_retries: usize,
    /// Pause after the provider call, in milliseconds (a slow provider).
    #[arg(long, default_value_t = 0)]
    provider_delay_ms: u64,
    /// Draw each pause at random between none and twice --provider-delay-ms.
    #[arg(long)]
    provider_delay_random: bool,
    /// Stage one follow-up message per booked order to this queue (declared if
    /// missing), for `notifications_worker`.
    #[arg(long)]
    follow_ups: Option<String>,
    /// Publish each follow-up not before this many milliseconds after its order was
    /// booked (a delayed follow-up: a reminder, a timeout).
    #[arg(long)]
    follow_up_delay_ms: Option<u64>,
    /// How long a publisher of follow-ups owns the rows it took, in seconds; after
    /// that, another process's relay publishes them again (same id).
    #[arg(long, default_value_t = 30)]
    outbox_lease_secs: u64,
    /// Limit the provider calls of every worker with this flag on the database:
    /// CONCURRENT/PER_SECOND (0: unbounded), e.g. 10/50.
    #[arg(long, value_parser = parse_limit)]
    limit: Option<(u32, u32)>,
    /// A permit's lease in milliseconds: a worker killed holding one frees it within
    /// this.
    #[arg(long, default_value_t = 10_000)]
    limit_lease_ms: u64,
    /// Open the queue's circuit after this many failed runs in a row (0: no breaker).
    #[arg(long, default_value_t = 0)]
    circuit: u32,
    /// The circuit's first pause before a probe, in milliseconds (doubling up to 16x).
    #[arg(long, default_value_t = 10_000)]
    circuit_open_ms: u64,
    /// While this file exists, the provider's calls fail transiently (an outage).
    #[arg(long)]
    provider_down_file: Option<PathBuf>,
    /// With `--mode transactional`: book each batch with one insert per table.
    #[arg(long)]
    batch: bool,
    /// How long a shutdown waits for handlers in flight, in seconds.
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
    // Logs; traces too when built with `--features otel` and OTEL_EXPORTER_OTLP_ENDPOINT
    // is set. Kept until `main` returns, so the last spans are sent.
    let _telemetry = match idem::telemetry::init("orders_worker") {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("orders_worker: error: {}", idem::text::error_line(&error));
            return ExitCode::FAILURE;
        }
    };
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!(
                "orders_worker: error: {}",
                idem::text::error_line(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let name = format!("orders_worker-{}", std::process::id());
    let pool_size = args.pool_size.unwrap_or(match args.concurrency {
        0 => 24,
        n => n as u32 + 4,
    });
    let pool = idem::db::connect_and_migrate(&args.database_url, pool_size)
        .await
        .context("prepare the database")?;
    create_example_tables(&pool)
        .await
        .context("create the example tables")?;
    let store = Store::new(
        pool,
        StoreConfig {
            owner: name.clone(),
            session: idem::db::session_options(args.session_url.as_deref())?,
            keys: idem::protect::Keys::from_env()?,
            lease: Duration::from_secs(args.lease_secs),
            ..StoreConfig::default()
        },
    );
    let queue_type = if args.queue_type == "quorum" {
        QueueType::Quorum
    } else {
        QueueType::Classic
    };
    if let Some(queue) = &args.follow_ups {
        declare_follow_up_queue(&args.amqp_url, queue, queue_type)
            .await
            .with_context(|| format!("declare the follow-up queue {queue}"))?;
    }
    let defaults = WorkerConfig::default();
    let config = WorkerConfig {
        amqp_url: args.amqp_url,
        queue: args.queue,
        mode: args.mode,
        queue_type,
        concurrency: args.concurrency,
        prefetch: args.prefetch,
        batch_size: args.batch_size.unwrap_or(defaults.batch_size),
        batches_in_flight: args.batches_in_flight.unwrap_or(defaults.batches_in_flight),
        retry: RetryPolicy {
            immediate: args.immediate_retries,
            delays: args
                .retry_delays_ms
                .iter()
                .map(|ms| Duration::from_millis(*ms))
                .collect(),
            ..RetryPolicy::default()
        },
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout_secs),
        gc_every: (args.gc_every_secs > 0).then(|| Duration::from_secs(args.gc_every_secs)),
        retry_overdue_after: args.retry_overdue_secs.map(Duration::from_secs),
        name,
        outbox: OutboxConfig {
            lease: Duration::from_secs(args.outbox_lease_secs),
            ..OutboxConfig::default()
        },
        circuit: (args.circuit > 0).then(|| {
            let first = Duration::from_millis(args.circuit_open_ms);
            CircuitBreaker::consecutive(args.circuit).open_for(first, first * 16)
        }),
        ..defaults
    };
    let handler = Orders {
        fail_tenant: args.fail_tenant,
        provider_delay: Duration::from_millis(args.provider_delay_ms),
        provider_delay_random: args.provider_delay_random,
        mode: args.mode,
        follow_ups: args.follow_ups,
        follow_up_delay: args.follow_up_delay_ms.map(Duration::from_millis),
        limit: args.limit.map(|(concurrent, per_second)| {
            let mut limit = Limit::new("payment-provider", store.pool().clone())
                .held_for(Duration::from_millis(args.limit_lease_ms));
            if concurrent > 0 {
                limit = limit.concurrent(concurrent);
            }
            if per_second > 0 {
                limit = limit.per_second(per_second);
            }
            limit
        }),
        provider_down: args.provider_down_file,
        batch: args.batch,
    };
    let shutdown = idem::shutdown::on_signal();
    let pool = store.pool().clone();
    let worker = Worker::new(handler, store, config);
    if let Some(addr) = &args.metrics_addr {
        let bound = idem::metrics::serve(addr, pool, worker.broker_health(), shutdown.clone())
            .await
            .context("metrics")?;
        tracing::info!(%bound, "serving /metrics and /healthz");
    }
    worker.run(shutdown).await.context("worker")?;
    Ok(())
}

/// Declares the follow-up queue as its consumer (an idem worker) will: durable, of the
/// same type, with its DLQ; the consumer adds its retry queues. Without it, follow-ups
/// staged before the consumer first starts come back unroutable and wait in the outbox.
async fn declare_follow_up_queue(
    amqp_url: &str,
    queue: &str,
    queue_type: QueueType,
) -> Result<(), lapin::Error> {
    let connection = idem::topology::connect(amqp_url, "orders_worker-declare").await?;
    let topology = Topology {
        queue: queue.into(),
        queue_type,
        retry_delays: Vec::new(),
        subscriptions: Vec::new(),
        single_active_consumer: false,
    };
    topology.declare(&connection).await?;
    connection.close(200, "declared".into()).await?;
    Ok(())
}
