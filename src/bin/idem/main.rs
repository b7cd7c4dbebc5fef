//! The `idem` command: operate an idem deployment.
//!
//! Migrations, dead-letter inspection and replay, key inspection, stuck operations,
//! and garbage collection. Errors are printed as one line with their causes.

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use idem::{Store, StoreConfig};

mod dlq;
mod ops;

use dlq::Dlq;
use ops::Ops;

#[derive(Parser)]
#[command(
    name = "idem",
    version,
    about = "Operate idem: at-least-once consumers that never repeat a side effect"
)]
struct Cli {
    /// Postgres URL. `idem migrate` creates the database if missing; the other
    /// commands need it migrated.
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

/// The store of an existing, migrated database: only `idem migrate` creates one, so a
/// mistyped URL is an error, not a new empty database that has "no record".
async fn store(cli: &Cli) -> anyhow::Result<Store> {
    let pool = idem::db::connect(&cli.database_url, 4).await?;
    idem::db::ensure_migrated(&pool).await?;
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
            let pool = idem::db::connect_and_migrate(&cli.database_url, 2)
                .await
                .context("migrate")?;
            let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
                .fetch_one(&pool)
                .await
                .context("migrate: count applied migrations")?;
            println!("migrations up to date ({applied} applied)");
        }
        Command::Gc { batch } => {
            let store = store(&cli).await?;
            let deleted = store.gc((*batch).max(1)).await.context("gc")?;
            println!("deleted {deleted} expired records");
        }
        Command::Dlq(command) => dlq::run(&cli, command).await?,
        Command::Ops(command) => ops::run(&cli, command).await?,
    }
    Ok(())
}
