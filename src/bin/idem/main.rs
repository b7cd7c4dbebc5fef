//! The `idem` command: operate an idem deployment.
//!
//! Migrations, dead-letter inspection and replay, key inspection, stuck operations,
//! and garbage collection. Errors are printed as one line with their causes.

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use idem::{Store, StoreConfig};

#[cfg(feature = "console")]
mod console;
mod dlq;
mod flow;
mod ops;
mod ordering;
mod out;
mod outbox;
mod protect;

use out::say;

use dlq::Dlq;
use flow::Flow;
use ops::Ops;
use outbox::Outbox;
use protect::Keys;

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
    /// Postgres URL for `idem gc`'s leader lock, which needs a session of its own, when
    /// --database-url goes through a transaction pooler.
    #[arg(
        long,
        env = "DATABASE_SESSION_URL",
        global = true,
        hide_env_values = true
    )]
    session_url: Option<String>,
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
    /// Follow-up messages not published yet: the backlog and why.
    #[command(subcommand)]
    Outbox(Outbox),
    /// Circuit breakers and limits: where each stands; close a circuit by hand.
    #[command(subcommand)]
    Flow(Flow),
    /// Encryption keys: make one, see what each holds, move values to the newest,
    /// retire an old one.
    #[command(subcommand)]
    Keys(Keys),
    /// A web page for operators: dead letters with replay previews, stuck operations,
    /// the outbox, charts (feature `console`). Its token is IDEM_CONSOLE_TOKEN, or one
    /// generated and printed as a login link.
    #[cfg(feature = "console")]
    Console(console::ConsoleArgs),
    /// Delete expired records, dispatched follow-up messages and the console's delivery
    /// counts past their retention, in short, paced batches (safe beside running
    /// workers).
    Gc(GcArgs),
}

#[derive(clap::Args)]
struct GcArgs {
    /// Most rows per batch (one short statement each).
    #[arg(long, default_value_t = 1000)]
    batch: i64,
    /// Share of time spent deleting: 0.3 rests 70 % of the time between batches, in
    /// proportion to what each cost; 1 deletes back to back.
    #[arg(long, default_value_t = 0.3)]
    duty: f64,
    /// A hard ceiling, in rows per second.
    #[arg(long)]
    max_rows_per_s: Option<f64>,
    /// Seconds between progress lines.
    #[arg(long, default_value_t = 5)]
    progress_secs: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One readable line with the whole cause chain.
            let line = idem::text::error_line(error.as_ref());
            eprintln!("idem: error: {}", idem::text::printable(&line));
            ExitCode::FAILURE
        }
    }
}

/// The store of an existing, migrated database: only `idem migrate` creates one, so a
/// mistyped URL is an error, not a new empty database that has "no record". Which
/// database it is goes to stderr, so that "no record" is never read of another one.
async fn store(cli: &Cli) -> anyhow::Result<Store> {
    let name = cli.command.application_name();
    let pool = idem::db::connect_named(&cli.database_url, name, 4).await?;
    idem::db::ensure_migrated(&pool).await?;
    eprintln!(
        "idem: database {}",
        idem::text::printable(&idem::db::describe(&cli.database_url))
    );
    let session = idem::db::session_options(cli.session_url.as_deref())?;
    Ok(Store::new(
        pool,
        StoreConfig {
            session,
            keys: idem::protect::Keys::from_env()?,
            ..StoreConfig::default()
        },
    ))
}

impl Command {
    /// What this command's connections show in `pg_stat_activity`.
    fn application_name(&self) -> &'static str {
        match self {
            Command::Migrate => "idem migrate",
            Command::Dlq(_) => "idem dlq",
            Command::Ops(_) => "idem ops",
            Command::Outbox(_) => "idem outbox",
            Command::Flow(_) => "idem flow",
            Command::Keys(_) => "idem keys",
            #[cfg(feature = "console")]
            Command::Console(_) => "idem console",
            Command::Gc(_) => "idem gc",
        }
    }
}

async fn broker(cli: &Cli) -> anyhow::Result<lapin::Connection> {
    idem::topology::connect(&cli.amqp_url, "idem-cli")
        .await
        .context("cannot reach RabbitMQ")
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Migrate => {
            idem::db::create_database_if_missing(&cli.database_url)
                .await
                .context("migrate")?;
            let name = cli.command.application_name();
            let pool = idem::db::connect_named(&cli.database_url, name, 2)
                .await
                .context("migrate")?;
            idem::db::migrate(&pool).await.context("migrate")?;
            let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_migrations")
                .fetch_one(&pool)
                .await
                .context("migrate: count applied migrations")?;
            say!(
                "migrations up to date in {} ({applied} applied)",
                idem::text::printable(&idem::db::describe(&cli.database_url))
            );
        }
        Command::Gc(args) => gc(&cli, args).await?,
        Command::Dlq(command) => dlq::run(&cli, command).await?,
        Command::Ops(command) => ops::run(&cli, command).await?,
        Command::Outbox(command) => outbox::run(&cli, command).await?,
        Command::Flow(command) => flow::run(&cli, command).await?,
        Command::Keys(command) => protect::run(&cli, command).await?,
        #[cfg(feature = "console")]
        Command::Console(args) => console::run(&cli, args).await?,
    }
    Ok(())
}

/// `idem gc`: one collector at a time (the workers' background gc included), paced, with
/// progress on long runs.
async fn gc(cli: &Cli, args: &GcArgs) -> anyhow::Result<()> {
    use idem::store::gc::{self, Report};
    let store = store(cli).await?;
    let pace = gc::Pace {
        batch: args.batch.max(1),
        duty: args.duty,
        max_rows_per_s: args.max_rows_per_s,
        ..gc::Pace::default()
    };
    let stop = idem::shutdown::on_signal();
    let every = std::time::Duration::from_secs(args.progress_secs.max(1));
    let mut expired = 0u64;
    let tell = |report| match report {
        Report::Expired { garbage, rows } => {
            expired = u64::try_from(rows).unwrap_or(0);
            say!("gc: {rows} expired {} to delete", garbage.as_str());
        }
        Report::Progress {
            garbage,
            progress: p,
        } => say!(
            "gc: deleted {} {} in {:.0} s ({:.0} rows/s), about {} left; last batch {} rows in {:.1} ms, then {:.1} ms rest",
            p.deleted,
            garbage.as_str(),
            p.elapsed.as_secs_f64(),
            p.rate(),
            expired.saturating_sub(p.deleted),
            p.batch,
            p.batch_took.as_secs_f64() * 1000.0,
            p.rest.as_secs_f64() * 1000.0
        ),
        Report::Deleted {
            garbage,
            rows,
            took,
        } => say!(
            "deleted {rows} expired {} in {:.1} s ({:.0} rows/s)",
            garbage.as_str(),
            took.as_secs_f64(),
            rows as f64 / took.as_secs_f64().max(1e-3)
        ),
        Report::Vacuumed { garbage, took } => say!(
            "vacuumed {} in {:.1} s (the server runs without autovacuum)",
            garbage.table(),
            took.as_secs_f64()
        ),
        _ => {}
    };
    if !gc::collect(&store, &pace, &stop, every, tell)
        .await
        .context("gc")?
    {
        say!("another process is collecting garbage (it holds the gc lock); nothing to do");
    }
    Ok(())
}
