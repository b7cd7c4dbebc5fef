//! The `idem` command: operate an idem deployment.
//!
//! Migrations, dead-letter inspection and replay, key inspection, stuck operations,
//! and garbage collection. Errors are printed as one line with their causes.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use idem::replay::{self, Action, Filter, Options};
use idem::{Key, Record, Status, Store, StoreConfig};
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "idem",
    version,
    about = "Operate idem: at-least-once consumers that never repeat a side effect"
)]
struct Cli {
    /// Postgres URL; the database is created if missing.
    #[arg(long, env = "DATABASE_URL", default_value = idem::db::DEFAULT_DATABASE_URL, global = true, hide_env_values = true)]
    database_url: String,
    /// RabbitMQ URL.
    #[arg(long, env = "AMQP_URL", default_value = idem::topology::DEFAULT_AMQP_URL, global = true, hide_env_values = true)]
    amqp_url: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the database if missing and apply the migrations (harmless to repeat).
    Migrate,
    /// Inspect, replay and discard dead letters.
    #[command(subcommand)]
    Dlq(Dlq),
    /// Inspect operations by key, find stuck ones, release leases.
    #[command(subcommand)]
    Ops(Ops),
    /// Delete expired records in small batches (safe beside running workers).
    Gc {
        /// Rows per short transaction.
        #[arg(long, default_value_t = 1000)]
        batch: i64,
    },
}

#[derive(Subcommand)]
enum Dlq {
    /// Dead letters grouped by reason, then by operation and error, with counts.
    List {
        #[command(flatten)]
        queue: QueueArg,
        /// Read at most this many messages.
        #[arg(long, default_value_t = 100_000)]
        limit: usize,
        /// JSON for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Dead letters with their idem-* headers and body.
    Show {
        #[command(flatten)]
        queue: QueueArg,
        #[command(flatten)]
        filter: FilterArgs,
        /// JSON lines for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Republish dead letters to their original queue (completed keys are acked instead).
    Replay {
        #[command(flatten)]
        queue: QueueArg,
        #[command(flatten)]
        filter: FilterArgs,
        /// Count what would happen, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// At most this many messages per second.
        #[arg(long)]
        max_rate: Option<f64>,
        /// The summary as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove dead letters for good, recording the decision on their records.
    Discard {
        #[command(flatten)]
        queue: QueueArg,
        #[command(flatten)]
        filter: FilterArgs,
        /// Count what would happen, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// The summary as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct QueueArg {
    /// The work queue (its DLQ is `<queue>.dlq`), or the DLQ itself.
    #[arg(long)]
    queue: String,
}

#[derive(Args)]
struct FilterArgs {
    /// Only this reason: malformed, fingerprint_conflict, permanent_failure, retries_exhausted.
    #[arg(long)]
    reason: Option<String>,
    /// Only this key: the idempotency key, or the key hash logs show.
    #[arg(long)]
    key: Option<String>,
    /// At most this many messages.
    #[arg(long)]
    limit: Option<usize>,
}

impl FilterArgs {
    fn filter(&self) -> Filter {
        Filter {
            reason: self.reason.clone(),
            key: self.key.clone(),
            limit: self.limit,
        }
    }
}

#[derive(Args)]
struct KeyArgs {
    /// Tenant or actor.
    #[arg(long)]
    scope: String,
    /// Operation name, e.g. orders.create.
    #[arg(long)]
    operation: String,
    /// The idempotency key (business event ID).
    #[arg(long)]
    key: String,
}

impl KeyArgs {
    fn key(&self) -> anyhow::Result<Key> {
        Ok(Key::new(&self.scope, &self.operation, &self.key)?)
    }
}

#[derive(Subcommand)]
enum Ops {
    /// One operation's record in full.
    Show {
        #[command(flatten)]
        key: KeyArgs,
        #[arg(long)]
        json: bool,
    },
    /// Unresolved operations in a status, oldest first.
    List {
        /// processing, pending or failed (completed works too).
        #[arg(long, value_parser = ["processing", "pending", "failed", "completed"])]
        status: String,
        /// Only those not updated for this long: 30s, 10m, 2h, 1d.
        #[arg(long, default_value = "0s", value_parser = parse_duration)]
        older_than: Duration,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Expire a lease by hand, for a worker known to be dead: the next delivery takes
    /// the operation over with a new fencing token.
    Release {
        #[command(flatten)]
        key: KeyArgs,
    },
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?}: expected a number and a unit, e.g. 10m"))?;
    let secs = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "s" | "" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        other => return Err(format!("{other:?}: unit must be ms, s, m, h or d")),
    };
    Ok(Duration::from_secs(secs))
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One readable line with the whole cause chain.
            eprintln!("idem: error: {}", idem::error_line(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

async fn store(cli: &Cli) -> anyhow::Result<Store> {
    let pool = idem::db::connect_and_migrate(&cli.database_url, 4)
        .await
        .context("database")?;
    Ok(Store::new(pool, StoreConfig::default()))
}

async fn broker(cli: &Cli) -> anyhow::Result<lapin::Connection> {
    idem::topology::connect(&cli.amqp_url, "idem-cli")
        .await
        .context("cannot reach RabbitMQ")
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Migrate => {
            let store = store(&cli).await.context("migrate")?;
            let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
                .fetch_one(store.pool())
                .await
                .context("migrate: count applied migrations")?;
            println!("migrations up to date ({applied} applied)");
        }
        Command::Gc { batch } => {
            let store = store(&cli).await?;
            let deleted = store.gc((*batch).max(1)).await.context("gc")?;
            println!("deleted {deleted} expired records");
        }
        Command::Dlq(dlq) => run_dlq(&cli, dlq).await?,
        Command::Ops(ops) => run_ops(&cli, ops).await?,
    }
    Ok(())
}

async fn run_dlq(cli: &Cli, command: &Dlq) -> anyhow::Result<()> {
    let connection = broker(cli).await?;
    match command {
        Dlq::List { queue, limit, json } => {
            let dlq = replay::dlq_of(&queue.queue);
            let messages = replay::peek(&connection, &dlq, &Filter::default(), *limit)
                .await
                .with_context(|| format!("read {dlq}"))?;
            let groups = replay::group(&messages);
            if *json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &json!({"dlq": dlq, "messages": messages.len(), "groups": groups})
                    )?
                );
            } else {
                println!("{dlq}: {} dead letters", messages.len());
                let mut reason = String::new();
                for g in &groups {
                    if g.reason != reason {
                        let total: usize = groups
                            .iter()
                            .filter(|x| x.reason == g.reason)
                            .map(|x| x.count)
                            .sum();
                        println!("\n{} ({total})", g.reason);
                        reason = g.reason.clone();
                    }
                    println!(
                        "  {:>6}  {:<24} {}  [oldest {}, newest {}]",
                        g.count,
                        g.operation,
                        g.error,
                        g.oldest
                            .map(|t| t.to_rfc3339())
                            .unwrap_or_else(|| "?".into()),
                        g.newest
                            .map(|t| t.to_rfc3339())
                            .unwrap_or_else(|| "?".into()),
                    );
                }
            }
        }
        Dlq::Show {
            queue,
            filter,
            json,
        } => {
            let dlq = replay::dlq_of(&queue.queue);
            let messages = replay::peek(&connection, &dlq, &filter.filter(), usize::MAX)
                .await
                .with_context(|| format!("read {dlq}"))?;
            for m in &messages {
                let view = json!({
                    "reason": m.reason, "error": m.error, "operation": m.operation,
                    "scope": m.scope, "key": m.key, "key_hash": m.key_hash,
                    "attempts": m.attempts, "original_queue": m.original_queue,
                    "failed_at": m.failed_at,
                    "message_id": m.delivery.properties.message_id().as_ref().map(|s| s.as_str()),
                    "body": m.body_text(),
                });
                if *json {
                    println!("{view}");
                } else {
                    println!("{}\n", serde_json::to_string_pretty(&view)?);
                }
            }
            if !*json {
                println!("{} dead letters shown from {dlq}", messages.len());
            }
        }
        Dlq::Replay {
            queue,
            filter,
            dry_run,
            max_rate,
            json,
        } => {
            let pace = match max_rate {
                Some(rate) if *rate > 0.0 => Some(Duration::from_secs_f64(1.0 / rate)),
                Some(_) => bail!("--max-rate must be above 0"),
                None => None,
            };
            let options = Options {
                filter: filter.filter(),
                dry_run: *dry_run,
                pace,
            };
            act(
                cli,
                &connection,
                &queue.queue,
                Action::Replay,
                &options,
                *json,
            )
            .await?;
        }
        Dlq::Discard {
            queue,
            filter,
            dry_run,
            json,
        } => {
            let options = Options {
                filter: filter.filter(),
                dry_run: *dry_run,
                pace: None,
            };
            act(
                cli,
                &connection,
                &queue.queue,
                Action::Discard,
                &options,
                *json,
            )
            .await?;
        }
    }
    let _ = connection.close(200, "done".into()).await;
    Ok(())
}

async fn act(
    cli: &Cli,
    connection: &lapin::Connection,
    queue: &str,
    action: Action,
    options: &Options,
    json: bool,
) -> anyhow::Result<()> {
    let store = store(cli).await?;
    let dlq = replay::dlq_of(queue);
    let summary = replay::run(connection, &store, &dlq, action, options)
        .await
        .with_context(|| format!("{action:?} from {dlq}").to_lowercase())?;
    if json {
        println!("{}", serde_json::to_string(&summary)?);
        return Ok(());
    }
    let verb = if options.dry_run { "would be " } else { "" };
    println!(
        "{dlq}{}:",
        if options.dry_run {
            " (dry run, nothing changed)"
        } else {
            ""
        }
    );
    let line = |label: String, n: usize, note: &str| println!("  {label:<26}{n:>6}  {note}");
    match action {
        Action::Replay => {
            line(format!("{verb}replayed"), summary.replayed, "");
            line(
                format!("{verb}already done"),
                summary.already_done,
                "completed keys, acked without republishing",
            );
        }
        Action::Discard => line(format!("{verb}discarded"), summary.discarded, ""),
    }
    line(
        "conflicts left".into(),
        summary.conflicts_left,
        "a changed payload needs a new key",
    );
    line("malformed left".into(), summary.malformed_left, "");
    line("not selected".into(), summary.skipped, "");
    Ok(())
}

async fn run_ops(cli: &Cli, command: &Ops) -> anyhow::Result<()> {
    let store = store(cli).await?;
    match command {
        Ops::Show { key, json } => {
            let key = key.key()?;
            let Some(record) = store.get(&key).await? else {
                bail!(
                    "no record for {key} (scope {}, key {})",
                    key.scope(),
                    key.idempotency_key()
                );
            };
            if *json {
                println!("{}", serde_json::to_string_pretty(&record)?);
            } else {
                print_record(&record);
            }
        }
        Ops::List {
            status,
            older_than,
            limit,
            json,
        } => {
            let status = match status.as_str() {
                "processing" => Status::Processing,
                "pending" => Status::Pending,
                "failed" => Status::Failed,
                _ => Status::Completed,
            };
            let records = store.list(status, *older_than, *limit).await?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&records)?);
            } else {
                println!(
                    "{} {} operations not updated for {:?}, oldest first",
                    records.len(),
                    status.as_str(),
                    older_than
                );
                for r in &records {
                    println!(
                        "  {}  {} / {} / {}  attempts {}  owner {}  lease until {}  {}",
                        r.updated_at.to_rfc3339(),
                        r.scope,
                        r.operation,
                        r.idempotency_key,
                        r.attempts,
                        r.owner.as_deref().unwrap_or("-"),
                        r.lease_expires_at
                            .map(|t| t.to_rfc3339())
                            .unwrap_or_else(|| "-".into()),
                        r.error.as_ref().map(|e| e.to_string()).unwrap_or_default(),
                    );
                }
            }
        }
        Ops::Release { key } => {
            let key = key.key()?;
            match store.release(&key).await? {
                Some(r) => println!(
                    "released {} / {} / {}: status {}, lease token {} expired now; the next delivery takes it over",
                    r.scope,
                    r.operation,
                    r.idempotency_key,
                    r.status.0.as_str(),
                    r.lease_token
                ),
                None => bail!("no processing or pending record for {key}"),
            }
        }
    }
    Ok(())
}

fn print_record(r: &Record) {
    let t = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".into())
    };
    println!("scope             {}", r.scope);
    println!("operation         {}", r.operation);
    println!("idempotency_key   {}", r.idempotency_key);
    println!(
        "status            {}{}",
        r.status.0.as_str(),
        if r.retryable { " (retryable)" } else { "" }
    );
    println!("attempts          {}", r.attempts);
    println!("payload_sha256    {}", r.payload_sha256);
    println!("lease_token       {}", r.lease_token);
    println!("lease_expires_at  {}", t(r.lease_expires_at));
    println!("owner             {}", r.owner.as_deref().unwrap_or("-"));
    println!(
        "result            {}",
        r.result
            .as_ref()
            .map(|v| v.to_string())
            .unwrap_or_else(|| "-".into())
    );
    println!(
        "error             {}",
        r.error
            .as_ref()
            .map(|v| v.to_string())
            .unwrap_or_else(|| "-".into())
    );
    println!(
        "external_ref      {}",
        r.external_ref.as_deref().unwrap_or("-")
    );
    println!(
        "message_id        {}",
        r.message_id.as_deref().unwrap_or("-")
    );
    println!(
        "correlation_id    {}",
        r.correlation_id.as_deref().unwrap_or("-")
    );
    println!("dead_lettered_at  {}", t(r.dead_lettered_at));
    println!(
        "replay_count      {}  (last {})",
        r.replay_count,
        t(r.last_replayed_at)
    );
    println!("discarded_at      {}", t(r.discarded_at));
    println!("created_at        {}", r.created_at.to_rfc3339());
    println!("updated_at        {}", r.updated_at.to_rfc3339());
    println!("completed_at      {}", t(r.completed_at));
    println!("expires_at        {}", t(r.expires_at));
}
