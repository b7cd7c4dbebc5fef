//! The `idem` command: operate an idem deployment (migrations for now).

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

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
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the database if missing and apply the migrations (harmless to repeat).
    Migrate,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One readable line with the whole cause chain.
            eprintln!("idem: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate => {
            let pool = idem::db::connect_and_migrate(&cli.database_url, 2)
                .await
                .context("migrate")?;
            let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
                .fetch_one(&pool)
                .await
                .context("migrate: count applied migrations")?;
            println!("migrations up to date ({applied} applied)");
            pool.close().await;
        }
    }
    Ok(())
}
