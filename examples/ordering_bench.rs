//! The ordering bench: 1,000 accounts × 20 entries, each account's entries shuffled,
//! applied by three `accounts_worker` processes in version order, one of them
//! SIGKILLed mid-run; the same load without ordering, for the ratio; and a single hot
//! account of 10,000 entries in order, against one handler at concurrency 1.
//! `--pairs N` repeats the shuffled runs N times, alternating which goes first, and
//! prints the medians: one pair is noisy on a shared machine.
//! `--unshuffled` publishes each account's entries in order; `--estimate` adds a run that
//! estimates a design of owned entities (docs/PERFORMANCE.md, "Order per entity").
//!
//! ```sh
//! cargo build --release --example accounts_worker --example ordering_bench
//! ./target/release/examples/ordering_bench --mode leased
//! ```
//!
//! It creates its own database (`idem_ordering_<id>` on the server of `DATABASE_URL`,
//! dropped at the end) and queues, checks every run (each entry applied once, every
//! account in version order) and prints one line per run and a summary; it exits 1
//! when a check failed. Per run it also prints where the cores went (CPU microseconds
//! per entry of Postgres, RabbitMQ and the workers) and what Postgres wrote per entry
//! (commits, rows inserted, updated (how many HOT) and deleted, WAL bytes); with
//! `--statements N`, the N statements that took Postgres longest (`pg_stat_statements`).

use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use futures_util::future::try_join_all;
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use rand::seq::SliceRandom;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgPool};
use tokio::process::{Child, Command};

#[allow(dead_code)]
#[path = "support/cpu.rs"]
mod cpu;
use cpu::{CpuPerOp, CpuTicks};

#[derive(Parser, Debug)]
#[command(about = "idem ordering bench: in order per account, against no order")]
struct Args {
    /// Accounts (entities).
    #[arg(long, default_value_t = 1000)]
    accounts: usize,
    /// Entries per account, shuffled.
    #[arg(long, default_value_t = 20)]
    versions: i64,
    /// Worker processes.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Only the hot runs (the hot account and one handler), not the shuffled ones.
    #[arg(long)]
    hot_only: bool,
    /// Entries of the hot account (0: no hot run).
    #[arg(long, default_value_t = 10_000)]
    hot: i64,
    /// leased or transactional.
    #[arg(long, default_value = "leased")]
    mode: String,
    /// The workers' lease, in seconds: what a SIGKILLed worker's operations wait before
    /// another takes them over (and, ordered, what their accounts wait).
    #[arg(long, default_value_t = 5)]
    lease_secs: u64,
    /// Print the applied and waiting counts every 250 ms: where a run spends its time
    /// (the entries entering, the turns running, a kill's stall).
    #[arg(long)]
    timeline: bool,
    /// Kill no worker in the shuffled runs (what the kill costs, against a run with it;
    /// the goal's figures are with it).
    #[arg(long)]
    no_kill: bool,
    /// Shuffled runs, ordered and unordered, this many times each, in pairs, the first
    /// of each pair alternating (ordered first, then unordered first): one pair's ratio
    /// moved by ±0.15 between runs on a shared two-core machine. Prints each pair, then
    /// the medians.
    #[arg(long, default_value_t = 1)]
    pairs: usize,
    /// Publish each account's entries in version order, not shuffled: what ordering
    /// costs when few entries come early (few wait in Postgres), against the same load
    /// without ordering.
    #[arg(long)]
    unshuffled: bool,
    /// A third run: the unordered load, each entry also moving a position row of its
    /// account (one per worker process) in its transaction. An estimate of order per
    /// entity done by workers that own their entities and keep the positions, writing
    /// only each move where its entry commits.
    #[arg(long)]
    estimate: bool,
    /// The ordered runs on a queue with a single active consumer: one process consumes,
    /// keeping its entities' positions in memory (owned order), the others stand by;
    /// the kill hits the active one. The unordered run is as without it.
    #[arg(long)]
    single_active_consumer: bool,
    /// The shuffled pairs' unordered runs on a queue with a single active consumer too
    /// (one process consumes, the kill hits it): what such a queue costs without order.
    #[arg(long)]
    unordered_single_active_consumer: bool,
    /// Print, per run, the N statements that took Postgres longest (executing and
    /// planning, microseconds per entry; wall time, so waits count): where an ordered
    /// entry's Postgres time goes. Needs `pg_stat_statements` in the server's
    /// `shared_preload_libraries` (a restart), and `pg_stat_statements.track_planning =
    /// on` for the planning times; it resets the server's statistics before each run.
    #[arg(long, default_value_t = 0)]
    statements: usize,
    /// More arguments for every worker process (repeatable, e.g. `--worker-arg=--sweep-every-ms=5000`).
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    worker_args: Vec<String>,
    /// Postgres server (the bench's database is created beside the one named).
    #[arg(long, env = "DATABASE_URL", default_value = idem::db::DEFAULT_DATABASE_URL)]
    database_url: String,
    /// RabbitMQ URL.
    #[arg(long, env = "AMQP_URL", default_value = idem::topology::DEFAULT_AMQP_URL)]
    amqp_url: String,
}

/// The worker process that applied a run's last entry (`$1` the run, `$2` the entries'
/// last `applied` before it): under a single active consumer, the active one.
const LAST_APPLIER: &str = "SELECT pid FROM account_entries
                             WHERE applied > $2 AND account LIKE $1 || '-%'
                             ORDER BY applied DESC LIMIT 1";

/// The workers' retry tiers (as `accounts_worker` declares them by default).
const RETRY_DELAYS_MS: [u64; 2] = [1000, 5000];

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!(
                "ordering_bench: error: {}",
                idem::text::error_line(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

struct Bench {
    args: Args,
    pool: PgPool,
    url: String,
    connection: lapin::Connection,
    worker: PathBuf,
}

/// One run's figures.
struct Ran {
    entries: i64,
    elapsed: Duration,
    in_order: bool,
    once: bool,
}

/// What [`Bench::drive`] measured of one run, before its checks.
struct Driven {
    /// Entries published.
    total: i64,
    /// The last `applied` of the entries before the run's.
    first: i64,
    /// With `--timeline`, the server's clock as the run began (seconds).
    t0: Option<f64>,
    elapsed: Duration,
    cpu: CpuPerOp,
    /// [`Bench::writes`] before and after the run.
    writes_before: [i64; 6],
    writes: [i64; 6],
}

impl Ran {
    fn rate(&self) -> f64 {
        self.entries as f64 / self.elapsed.as_secs_f64()
    }
}

/// The median of `values` (the mean of the middle two of an even count).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    let server: PgConnectOptions = args.database_url.parse().context("DATABASE_URL")?;
    let name = format!(
        "idem_ordering_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let admin = PgPool::connect_with(server.clone())
        .await
        .context("connect")?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await?;
    let options = server.clone().database(&name);
    let url = options.to_url_lossy().to_string();
    let outcome = async {
        let pool = idem::db::connect_and_migrate(&url, 8).await?;
        let connection = idem::topology::connect(&args.amqp_url, "ordering_bench").await?;
        let exe = std::env::current_exe()?;
        let worker = exe.with_file_name("accounts_worker");
        if !worker.exists() {
            bail!(
                "{} missing: cargo build --release --example accounts_worker",
                worker.display()
            );
        }
        let bench = Bench {
            args,
            pool,
            url: url.clone(),
            connection,
            worker,
        };
        bench.all().await
    }
    .await;
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .execute(&admin)
    .await;
    outcome
}

impl Bench {
    async fn all(&self) -> anyhow::Result<bool> {
        let a = &self.args;
        if a.hot_only {
            let hot = self.hot("hot", "version", a.workers, 0).await?;
            let one = self.hot("one", "none", 1, 1).await?;
            println!(
                "ordering_bench: mode={} hot_msgs_per_s={:.0} one_handler_msgs_per_s={:.0} hot_ratio={:.2}",
                a.mode,
                hot.rate(),
                one.rate(),
                hot.rate() / one.rate()
            );
            return Ok(hot.in_order && hot.once && one.once);
        }
        let kill = !a.no_kill;
        let pairs = a.pairs.max(1);
        let (mut ordered_rates, mut unordered_rates, mut ratios) = (vec![], vec![], vec![]);
        let (mut in_order, mut once) = (true, true);
        for pair in 0..pairs {
            // Run names are account and event prefixes: each run's own.
            let name = |run: &str| match pair {
                0 => run.to_string(),
                n => format!("{run}{}", n + 1),
            };
            let (ordered, unordered) = if pair % 2 == 0 {
                let ordered = self
                    .shuffled(&name("ordered"), "version", kill, &[])
                    .await?;
                (
                    ordered,
                    self.shuffled(&name("unordered"), "none", kill, &[]).await?,
                )
            } else {
                let unordered = self.shuffled(&name("unordered"), "none", kill, &[]).await?;
                (
                    self.shuffled(&name("ordered"), "version", kill, &[])
                        .await?,
                    unordered,
                )
            };
            let ratio = ordered.rate() / unordered.rate();
            if pairs > 1 {
                println!(
                    "ordering_bench pair={} first={} ordered_msgs_per_s={:.0} \
                     unordered_msgs_per_s={:.0} ratio={ratio:.2}",
                    pair + 1,
                    ["ordered", "unordered"][pair % 2],
                    ordered.rate(),
                    unordered.rate(),
                );
            }
            in_order &= ordered.in_order;
            once &= ordered.once && unordered.once;
            ordered_rates.push(ordered.rate());
            unordered_rates.push(unordered.rate());
            ratios.push(ratio);
        }
        let mut ok = in_order && once;
        let unordered_rate = median(&mut unordered_rates);
        let (low, high) = (
            ratios.iter().copied().fold(f64::MAX, f64::min),
            ratios.iter().copied().fold(f64::MIN, f64::max),
        );
        let mut line = format!(
            "ordering_bench: mode={} accounts={} versions={} workers={} kill={kill} \
             ordered_msgs_per_s={:.0} unordered_msgs_per_s={unordered_rate:.0} ratio={:.2} \
             in_order={in_order} once={once}",
            a.mode,
            a.accounts,
            a.versions,
            a.workers,
            median(&mut ordered_rates),
            median(&mut ratios),
        );
        if pairs > 1 {
            // The rates are each run's median; the ratio is the median of the pairs'
            // ratios (not the rates' quotient).
            line += &format!(" pairs={pairs} (medians) ratio_min={low:.2} ratio_max={high:.2}");
        }
        if a.hot > 0 {
            let hot = self.hot("hot", "version", a.workers, 0).await?;
            let one = self.hot("one", "none", 1, 1).await?;
            ok &= hot.in_order && hot.once && one.once;
            line += &format!(
                " hot_msgs_per_s={:.0} one_handler_msgs_per_s={:.0} hot_ratio={:.2} hot_in_order={}",
                hot.rate(),
                one.rate(),
                hot.rate() / one.rate(),
                hot.in_order
            );
        }
        if a.estimate {
            let moved = self
                .shuffled("estimate", "none", kill, &["--move-position"])
                .await?;
            ok &= moved.once;
            line += &format!(
                " estimate_msgs_per_s={:.0} estimate_ratio={:.2}",
                moved.rate(),
                moved.rate() / unordered_rate
            );
        }
        println!("{line}");
        Ok(ok)
    }

    /// Every account's entries shuffled (in order with `--unshuffled`), published
    /// round-robin before the workers start; one worker SIGKILLed once a third is applied
    /// (with `kill`); `extra` goes to the workers' command lines.
    async fn shuffled(
        &self,
        run: &str,
        order: &str,
        kill: bool,
        extra: &[&str],
    ) -> anyhow::Result<Ran> {
        let a = &self.args;
        let mut rng = rand::rng();
        let mut bodies = Vec::new();
        let mut per_account: Vec<Vec<i64>> = (0..a.accounts)
            .map(|_| {
                let mut v: Vec<i64> = (1..=a.versions).collect();
                if !a.unshuffled {
                    v.shuffle(&mut rng);
                }
                v
            })
            .collect();
        for round in 0..a.versions as usize {
            for (account, versions) in per_account.iter_mut().enumerate() {
                bodies.push(entry(run, &format!("{run}-{account}"), versions[round]));
            }
        }
        self.measure(run, order, a.workers, bodies, kill, extra)
            .await
    }

    /// One account's entries, in order.
    async fn hot(
        &self,
        run: &str,
        order: &str,
        workers: usize,
        concurrency: usize,
    ) -> anyhow::Result<Ran> {
        let bodies = (1..=self.args.hot)
            .map(|v| entry(run, &format!("{run}-hot"), v))
            .collect();
        let concurrency = concurrency.to_string();
        self.measure(
            run,
            order,
            workers,
            bodies,
            false,
            &["--concurrency", &concurrency],
        )
        .await
    }

    async fn measure(
        &self,
        run: &str,
        order: &str,
        workers: usize,
        bodies: Vec<Vec<u8>>,
        kill: bool,
        extra: &[&str],
    ) -> anyhow::Result<Ran> {
        let queue = format!(
            "ordering_bench.{run}.{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        // The flag for unordered runs is the shuffled pair's only: the hot run's one
        // handler and the estimate stay as they were measured.
        let single_active_consumer = match order {
            "none" => self.args.unordered_single_active_consumer && run.starts_with("unordered"),
            _ => self.args.single_active_consumer,
        };
        let topology = idem::Topology {
            queue: queue.clone(),
            queue_type: idem::QueueType::Classic,
            retry_delays: RETRY_DELAYS_MS
                .iter()
                .map(|&ms| Duration::from_millis(ms))
                .collect(),
            subscriptions: Vec::new(),
            single_active_consumer,
        };
        // Checked before the queue exists: a server without the preload stops the bench
        // here, leaving nothing behind.
        if self.args.statements > 0 {
            sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                .execute(&self.pool)
                .await
                .context("--statements")?;
            sqlx::query("SELECT pg_stat_statements_reset()")
                .execute(&self.pool)
                .await
                .context("--statements: pg_stat_statements must be in shared_preload_libraries")?;
        }
        // The queues go whatever happens to the run: a run that fails leaves none.
        let driven = self
            .drive(&topology, run, order, workers, &bodies, kill, extra)
            .await;
        // A run that failed says why, not that the channel to clean up failed after it.
        let channel = match self.connection.create_channel().await {
            Ok(channel) => channel,
            Err(error) => return Err(driven.err().unwrap_or_else(|| error.into())),
        };
        let mut dead_lettered = 0;
        let dlq = topology.dlq();
        for name in [queue.clone(), dlq.clone()]
            .into_iter()
            .chain(topology.retry_queues())
        {
            let deleted = channel
                .queue_delete(name.as_str().into(), Default::default())
                .await;
            if name == dlq {
                dead_lettered = deleted.unwrap_or_default();
            }
        }
        let Driven {
            total,
            first,
            t0,
            elapsed,
            cpu,
            writes_before,
            writes,
        } = driven?;
        let (in_order, once) = self.check(run, total).await?;
        if let Some(t0) = t0 {
            self.applied_per_slot(run, first, t0).await?;
        }
        // Nothing of the load is a dead letter: a copy refused as out of sequence would be
        // one.
        if dead_lettered > 0 {
            println!("ordering_bench run={run} dead_lettered={dead_lettered}");
        }
        let once = once && dead_lettered == 0;
        let (between_ms, claimed_ms): (Option<f64>, Option<f64>) = sqlx::query_as(
            "WITH r AS (SELECT created_at, completed_at,
                               lag(completed_at) OVER (ORDER BY completed_at) AS before
                          FROM processed_operations WHERE idempotency_key LIKE $1 || ':%')
             SELECT percentile_cont(0.5) WITHIN GROUP
                        (ORDER BY extract(epoch FROM created_at - before) * 1000),
                    percentile_cont(0.5) WITHIN GROUP
                        (ORDER BY extract(epoch FROM completed_at - created_at) * 1000)
               FROM r",
        )
        .bind(run)
        .fetch_one(&self.pool)
        .await?;
        println!(
            "ordering_bench run={run} median_ms: previous_completed_to_claim={:.2} claim_to_completed={:.2}",
            between_ms.unwrap_or(0.0),
            claimed_ms.unwrap_or(0.0)
        );
        let ran = Ran {
            entries: total,
            elapsed,
            in_order,
            once,
        };
        println!(
            "ordering_bench run={run} order={order} workers={workers} entries={total} elapsed_s={:.2} msgs_per_s={:.0} in_order={in_order} once={once}",
            elapsed.as_secs_f64(),
            ran.rate()
        );
        let per = |i: usize| (writes[i] - writes_before[i]) as f64 / total as f64;
        println!(
            "ordering_bench run={run} per_entry: commits={:.2} inserted={:.2} updated={:.2} (hot {:.2}) deleted={:.2} wal_bytes={:.0}",
            per(0),
            per(1),
            per(2),
            per(5),
            per(3),
            per(4)
        );
        println!(
            "ordering_bench run={run} cpu_us_per_entry: postgres={:.0} rabbitmq={:.0} workers={:.0} bench={:.0}",
            cpu.postgres, cpu.rabbitmq, cpu.children, cpu.this
        );
        Ok(ran)
    }

    /// Declares `topology`, publishes `bodies` to its queue and runs `workers` worker
    /// processes on it until every entry is applied and none waits (killing the one that
    /// applied last once a third is, with `kill`); what it measured. Its queues stay:
    /// [`Bench::measure`] deletes them, whatever this returns.
    #[allow(clippy::too_many_arguments)]
    async fn drive(
        &self,
        topology: &idem::Topology,
        run: &str,
        order: &str,
        workers: usize,
        bodies: &[Vec<u8>],
        kill: bool,
        extra: &[&str],
    ) -> anyhow::Result<Driven> {
        topology.declare(&self.connection).await?;
        let total = i64::try_from(bodies.len())?;
        publish(&self.connection, &topology.queue, bodies).await?;
        let lease = self.args.lease_secs.to_string();
        let mut args = vec![
            "--queue",
            &topology.queue,
            "--mode",
            &self.args.mode,
            "--order",
            order,
            "--lease-secs",
            &lease,
        ];
        args.extend_from_slice(extra);
        if topology.single_active_consumer {
            args.push("--single-active-consumer");
        }
        args.extend(self.args.worker_args.iter().map(String::as_str));
        let cpu = CpuTicks::now(None);
        let writes_before = self.writes().await?;
        // The progress poll reads this run's rows only, by the primary key from where the
        // run starts: a scan of every run's rows (`LIKE`) cost the later run more, every
        // 50 ms, and so favoured the earlier one.
        // The workers create the table: none before the first run.
        let exists: bool = sqlx::query_scalar("SELECT to_regclass('account_entries') IS NOT NULL")
            .fetch_one(&self.pool)
            .await?;
        let first: i64 = if exists {
            sqlx::query_scalar("SELECT coalesce(max(applied), 0) FROM account_entries")
                .fetch_one(&self.pool)
                .await?
        } else {
            0
        };
        let t0: Option<f64> = match self.args.timeline {
            true => Some(
                sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
                    .fetch_one(&self.pool)
                    .await?,
            ),
            false => None,
        };
        let started = Instant::now();
        let mut children: Vec<Child> = (0..workers)
            .map(|_| self.spawn(&args))
            .collect::<Result<_, _>>()?;
        let applied = |pool: PgPool, run: String| async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM account_entries
              WHERE applied > $2 AND account LIKE $1 || '-%'",
            )
            .bind(run)
            .bind(first)
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
        };
        let mut killed = !kill;
        let mut shown = Instant::now();
        loop {
            let done = applied(self.pool.clone(), run.into()).await;
            if self.args.timeline && shown.elapsed() >= Duration::from_millis(250) {
                shown = Instant::now();
                eprintln!(
                    "ordering_bench run={run} t_ms={} applied={done} waiting={} killed={}",
                    started.elapsed().as_millis(),
                    self.waiting().await?,
                    kill && killed
                );
            }
            if !killed && done >= total / 3 {
                // The victim: the process that applied last.
                let last: Option<i32> = sqlx::query_scalar(LAST_APPLIER)
                    .bind(run)
                    .bind(first)
                    .fetch_optional(&self.pool)
                    .await?;
                let victim = children
                    .iter()
                    .position(|c| c.id().is_some_and(|id| Some(id as i32) == last))
                    .unwrap_or(0);
                if let Some(id) = children[victim].id() {
                    let _ = std::process::Command::new("kill")
                        .args(["-KILL", &id.to_string()])
                        .status();
                }
                killed = true;
            }
            if done >= total && self.waiting().await? == 0 {
                break;
            }
            if started.elapsed() > Duration::from_secs(1200) {
                bail!("{run}: {done} of {total} applied after 20 minutes");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let elapsed = started.elapsed();
        for child in &mut children {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        let cpu = cpu.per_op(bodies.len(), None);
        // Postgres's counters reach its view a moment after a backend's last commit.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let writes = self.writes().await?;
        if self.args.statements > 0 {
            self.statements(run, total).await?;
        }
        Ok(Driven {
            total,
            first,
            t0,
            elapsed,
            cpu,
            writes_before,
            writes,
        })
    }

    /// With `--timeline`: the entries each worker process applied in every 100 ms of the
    /// run (from the rows' own times), an empty slot too: where a kill's stall falls, and
    /// who took over.
    async fn applied_per_slot(&self, run: &str, first: i64, t0: f64) -> anyhow::Result<()> {
        use std::fmt::Write;
        let rows: Vec<(i32, i32, i64)> = sqlx::query_as(
            "SELECT (floor((extract(epoch FROM at) - $3) * 10))::int AS slot, pid, count(*)
               FROM account_entries WHERE applied > $2 AND account LIKE $1 || '-%'
              GROUP BY 1, 2 ORDER BY 1, 2",
        )
        .bind(run)
        .bind(first)
        .bind(t0)
        .fetch_all(&self.pool)
        .await?;
        let (Some(low), Some(high)) = (rows.first(), rows.last()) else {
            return Ok(());
        };
        for slot in low.0..=high.0 {
            let mut line = format!("ordering_bench run={run} slot_ms={}", slot * 100);
            for (_, pid, n) in rows.iter().filter(|row| row.0 == slot) {
                write!(line, " {pid}={n}")?;
            }
            eprintln!("{line}");
        }
        Ok(())
    }

    /// With `--statements N`: the run's N costliest statements in the bench's database
    /// (the workers' and the bench's own progress poll), from `pg_stat_statements`.
    async fn statements(&self, run: &str, total: i64) -> anyhow::Result<()> {
        let rows: Vec<(i64, i64, i64, f64, f64, String)> = sqlx::query_as(
            "SELECT calls, plans, rows, total_exec_time, total_plan_time,
                    left(regexp_replace(query, '\\s+', ' ', 'g'), 90)
               FROM pg_stat_statements
              WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
              ORDER BY total_exec_time + total_plan_time DESC LIMIT $1",
        )
        .bind(i64::try_from(self.args.statements)?)
        .fetch_all(&self.pool)
        .await?;
        let per = |ms: f64| ms * 1000.0 / total as f64;
        for (calls, plans, rows, exec, plan, query) in rows {
            println!(
                "ordering_bench run={run} statement: exec_us={:.1} plan_us={:.1} calls={calls} plans={plans} rows={rows} {query}",
                per(exec),
                per(plan)
            );
        }
        Ok(())
    }

    fn spawn(&self, args: &[&str]) -> std::io::Result<Child> {
        Command::new(&self.worker)
            .args(args)
            .env("DATABASE_URL", &self.url)
            .env("AMQP_URL", &self.args.amqp_url)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
    }

    /// Postgres's commits, rows inserted, updated and deleted in the bench's database,
    /// the WAL written by the whole server so far, and the updates that were HOT (no new
    /// index entries).
    async fn writes(&self) -> anyhow::Result<[i64; 6]> {
        let (commits, inserted, updated, deleted, wal, hot): (i64, i64, i64, i64, i64, i64) =
            sqlx::query_as(
                "SELECT xact_commit, tup_inserted, tup_updated, tup_deleted,
                        pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,
                        (SELECT coalesce(sum(n_tup_hot_upd), 0)::bigint FROM pg_stat_user_tables)
                   FROM pg_stat_database WHERE datname = current_database()",
            )
            .fetch_one(&self.pool)
            .await?;
        Ok([commits, inserted, updated, deleted, wal, hot])
    }

    async fn waiting(&self) -> anyhow::Result<i64> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM ordering_waiting")
            .fetch_one(&self.pool)
            .await?)
    }

    /// Whether every account's entries were applied in version order, and each once.
    async fn check(&self, run: &str, total: i64) -> anyhow::Result<(bool, bool)> {
        let (rows, distinct, out_of_order): (i64, i64, i64) = sqlx::query_as(
            "WITH e AS (SELECT account, event_id, version,
                               lag(version) OVER (PARTITION BY account ORDER BY applied) AS before
                          FROM account_entries WHERE account LIKE $1 || '-%')
             SELECT count(*), count(DISTINCT event_id),
                    count(*) FILTER (WHERE version <> coalesce(before, 0) + 1)
               FROM e",
        )
        .bind(run)
        .fetch_one(&self.pool)
        .await?;
        Ok((out_of_order == 0, rows == total && distinct == total))
    }
}

fn entry(run: &str, account: &str, version: i64) -> Vec<u8> {
    serde_json::json!({
        "event_id": format!("{run}:{account}:{version}"),
        "tenant": "bench",
        "account": account,
        "version": version,
        "amount": 1,
    })
    .to_string()
    .into_bytes()
}

/// Publishes `bodies` to `queue` in order, persistent, a thousand confirms awaited at a
/// time.
async fn publish(
    connection: &lapin::Connection,
    queue: &str,
    bodies: &[Vec<u8>],
) -> anyhow::Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for chunk in bodies.chunks(1000) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for body in chunk {
            let properties = BasicProperties::default().with_delivery_mode(2);
            confirms.push(
                channel
                    .basic_publish(
                        "".into(),
                        queue.into(),
                        BasicPublishOptions::default(),
                        body,
                        properties,
                    )
                    .await?,
            );
        }
        try_join_all(confirms).await?;
    }
    Ok(())
}
