//! An idem worker whose deliveries run in order per entity: each account's entries are
//! applied one at a time, in version order, across every worker process, while
//! different accounts run in parallel.
//!
//! ```sh
//! cargo run --example accounts_worker -- --queue accounts
//! ```
//!
//! Messages are JSON objects `{"event_id", "tenant", "account", "version", "amount"}`:
//! the key is `event_id`, the ordering key the account and the sequence its `version`
//! (1, 2, 3, …). Each applied entry is one row of `account_entries`, written in the
//! handler's transaction; its `applied` column (an identity) shows the order the
//! entries ran in, `started` and `at` when each began and wrote. An entry listed in `account_failures` fails (for good, or
//! transiently with `kind = 'transient'`) while it is listed: a predecessor that blocks
//! its account, and only it. With `kind = 'slow'` it waits for its row's lock (a test
//! holds it `FOR UPDATE` to make the entry run long), then applies.
//!
//! `--order arrival` orders each account's entries by arrival instead (no version
//! needed); `--order none` turns ordering off (the baseline of
//! `examples/ordering_bench.rs`).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use idem::{
    Context, Handler, HandlerError, Mode, Ordered, RetryPolicy, Store, StoreConfig, Worker,
    WorkerConfig,
};
use serde::Deserialize;
use serde_json::{Value, json};

/// One ledger entry of an account, as producers publish it.
#[derive(Debug, Deserialize)]
pub struct Entry {
    /// The business event ID: the idempotency key.
    pub event_id: String,
    /// The tenant: the scope.
    pub tenant: String,
    /// The account: the ordering key.
    pub account: String,
    /// The entry's place in its account (1, 2, 3, …): the sequence.
    #[serde(default)]
    pub version: Option<i64>,
    /// The amount booked.
    pub amount: i64,
}

/// How an account's entries are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Order {
    /// By `version`.
    Version,
    /// By arrival on the queue.
    Arrival,
    /// Not at all.
    None,
}

/// Applies entries: one row per entry, in the handler's transaction.
pub struct Accounts {
    /// How entries are ordered.
    pub order: Order,
    /// Time each entry takes before its write (a slower handler).
    pub work: Duration,
    /// Write the entry through the pool, not `ctx.tx()` (leased mode): the record then
    /// completes on its own, and the entity moves on after that commit, not in it.
    pub outside_tx: bool,
    /// Also move the account's row in `account_positions` by one, in the entry's
    /// transaction: what order per entity would cost Postgres if a worker that owned its
    /// entities kept their positions and only wrote each move where the entry commits
    /// (the ordering bench's `--estimate`; the entries are not ordered by it). The row
    /// is this process's (account and pid), as an owner's would be: no two workers
    /// wait for one row.
    pub move_position: bool,
}

impl Handler for Accounts {
    type Message = Entry;
    type Output = Value;
    const OPERATION: &'static str = "accounts.apply";

    fn scope(&self, entry: &Entry) -> String {
        entry.tenant.clone()
    }

    fn idempotency_key(&self, entry: &Entry) -> String {
        entry.event_id.clone()
    }

    fn ordering(&self, entry: &Entry) -> Option<Ordered> {
        let account = Ordered::by(format!("account-{}", entry.account));
        match (self.order, entry.version) {
            (Order::Version, Some(version)) => Some(account.sequence(version)),
            (Order::Version, None) | (Order::Arrival, _) => Some(account),
            (Order::None, _) => None,
        }
    }

    async fn handle(&self, entry: Entry, ctx: &mut Context) -> Result<Value, HandlerError> {
        let started = chrono::Utc::now();
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
        let pid = i32::try_from(std::process::id()).unwrap_or(0);
        let mut own = match self.outside_tx {
            true => Some(ctx.pool().acquire().await?),
            false => None,
        };
        let tx: &mut sqlx::PgConnection = match own.as_mut() {
            Some(conn) => conn,
            None => ctx.tx().await?,
        };
        let failing: Option<String> = sqlx::query_scalar(
            "SELECT kind FROM account_failures WHERE account = $1 AND event_id = $2",
        )
        .bind(&entry.account)
        .bind(&entry.event_id)
        .fetch_optional(&mut *tx)
        .await?;
        match failing.as_deref() {
            Some("slow") => {
                sqlx::query(
                    "SELECT 1 FROM account_failures WHERE account = $1 AND event_id = $2 FOR SHARE",
                )
                .bind(&entry.account)
                .bind(&entry.event_id)
                .execute(&mut *tx)
                .await?;
            }
            Some("transient") => return Err(HandlerError::transient("account_failures says so")),
            Some(_) => return Err(HandlerError::permanent("account_failures says so")),
            None => {}
        }
        sqlx::query(
            "INSERT INTO account_entries (account, event_id, version, amount, pid, started)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&entry.account)
        .bind(&entry.event_id)
        .bind(entry.version)
        .bind(entry.amount)
        .bind(pid)
        .bind(started)
        .execute(&mut *tx)
        .await?;
        if self.move_position {
            sqlx::query(
                "INSERT INTO account_positions (account, pid, next_version) VALUES ($1, $2, 2)
                 ON CONFLICT (account, pid)
                 DO UPDATE SET next_version = account_positions.next_version + 1",
            )
            .bind(&entry.account)
            .bind(pid)
            .execute(&mut *tx)
            .await?;
        }
        Ok(json!({"applied": entry.event_id}))
    }
}

/// The example's tables: the entries applied, and the entries made to fail. Under an
/// advisory lock: workers starting together would race on the catalog.
pub async fn create_example_tables(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('accounts_worker tables'))")
        .execute(&mut *tx)
        .await?;
    for statement in [
        "CREATE TABLE IF NOT EXISTS account_entries (
            applied  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            account  text NOT NULL,
            event_id text NOT NULL,
            version  bigint,
            amount   bigint NOT NULL,
            pid      integer NOT NULL,
            -- When the handler started, and when it wrote (its commit comes after): the
            -- next entry of the account must start after this one wrote.
            started  timestamptz NOT NULL,
            at       timestamptz NOT NULL DEFAULT clock_timestamp())",
        "CREATE TABLE IF NOT EXISTS account_failures (
            account  text NOT NULL,
            event_id text NOT NULL,
            kind     text NOT NULL DEFAULT 'permanent',
            PRIMARY KEY (account, event_id))",
        "CREATE TABLE IF NOT EXISTS account_positions (
            account      text NOT NULL,
            pid          integer NOT NULL,
            next_version bigint NOT NULL,
            PRIMARY KEY (account, pid))",
    ] {
        sqlx::query(statement).execute(&mut *tx).await?;
    }
    tx.commit().await
}

#[derive(Parser, Debug)]
#[command(about = "An idem worker applying each account's entries in order")]
struct Args {
    /// Queue to consume.
    #[arg(long, default_value = "accounts")]
    queue: String,
    /// leased or transactional.
    #[arg(long, default_value = "leased", value_parser = parse_mode)]
    mode: Mode,
    /// How each account's entries are ordered.
    #[arg(long, value_enum, default_value = "version")]
    order: Order,
    /// Milliseconds each entry takes before its write.
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
    /// Write each entry through the pool instead of the handler's transaction (leased
    /// mode; the entry and the record then commit apart).
    #[arg(long)]
    outside_tx: bool,
    /// Also move a position row per account in each entry's transaction (the ordering
    /// bench's estimate of a design that keeps positions in the owning worker).
    #[arg(long)]
    move_position: bool,
    /// One process at a time consumes the queue, the others standing by; its
    /// numbered entries' order is kept in memory (owned order). The queue must be
    /// declared so from the start.
    #[arg(long)]
    single_active_consumer: bool,
    /// Deliveries in flight (0: chosen from the mode and the pool).
    #[arg(long, default_value_t = 0)]
    concurrency: usize,
    /// Unacked deliveries the broker sends ahead (0: twice the concurrency, and at least
    /// 512 with `--single-active-consumer`).
    #[arg(long, default_value_t = 0)]
    prefetch: u16,
    /// Delayed retry tiers, in milliseconds (the last given counts).
    #[arg(long, value_delimiter = ',', default_value = "1000,5000", action = clap::ArgAction::Set, overrides_with = "retry_delays_ms")]
    retry_delays_ms: Vec<u64>,
    /// No delayed retry tiers, whatever `--retry-delays-ms` says: what must wait is
    /// requeued instead.
    #[arg(long)]
    no_retry_delays: bool,
    /// Seconds a claim is owned without a heartbeat: a killed worker's operations are
    /// taken over after this.
    #[arg(long, default_value_t = 30)]
    lease_secs: u64,
    /// An entity not moved for this long with deliveries waiting is stalled.
    #[arg(long, default_value_t = 60_000)]
    stall_after_ms: u64,
    /// Milliseconds between two ordering sweeps (while they find something to do).
    #[arg(long, default_value_t = 1000)]
    sweep_every_ms: u64,
    /// Serve Prometheus metrics on http://HOST:PORT/metrics and health on /healthz.
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Postgres URL.
    #[arg(long, env = "DATABASE_URL", default_value = idem::db::DEFAULT_DATABASE_URL, hide_env_values = true)]
    database_url: String,
    /// RabbitMQ URL.
    #[arg(long, env = "AMQP_URL", default_value = idem::topology::DEFAULT_AMQP_URL, hide_env_values = true)]
    amqp_url: String,
}

fn parse_mode(text: &str) -> Result<Mode, String> {
    match text {
        "leased" => Ok(Mode::Leased),
        "transactional" => Ok(Mode::Transactional),
        other => Err(format!("{other:?}: expected leased or transactional")),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let _telemetry = match idem::telemetry::init("accounts_worker") {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("accounts_worker: error: {}", idem::text::error_line(&error));
            return ExitCode::FAILURE;
        }
    };
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!(
                "accounts_worker: error: {}",
                idem::text::error_line(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let name = format!("accounts_worker-{}", std::process::id());
    let pool = idem::db::connect_and_migrate(&args.database_url, 24)
        .await
        .context("prepare the database")?;
    create_example_tables(&pool)
        .await
        .context("create the example tables")?;
    let store = Store::new(
        pool,
        StoreConfig {
            owner: name.clone(),
            lease: Duration::from_secs(args.lease_secs),
            keys: idem::protect::Keys::from_env()?,
            ..StoreConfig::default()
        },
    );
    let config = WorkerConfig {
        amqp_url: args.amqp_url,
        queue: args.queue,
        mode: args.mode,
        concurrency: args.concurrency,
        prefetch: args.prefetch,
        single_active_consumer: args.single_active_consumer,
        retry: RetryPolicy {
            delays: match args.no_retry_delays {
                true => Vec::new(),
                false => args
                    .retry_delays_ms
                    .iter()
                    .map(|ms| Duration::from_millis(*ms))
                    .collect(),
            },
            ..RetryPolicy::default()
        },
        ordering_stall_after: Duration::from_millis(args.stall_after_ms),
        ordering_sweep_every: Some(Duration::from_millis(args.sweep_every_ms)),
        name,
        ..WorkerConfig::default()
    };
    let handler = Accounts {
        order: args.order,
        work: Duration::from_millis(args.work_ms),
        outside_tx: args.outside_tx,
        move_position: args.move_position,
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
