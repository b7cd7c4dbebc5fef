//! The Postgres failover drill: a pg_auto_failover monitor and two Postgres nodes on this
//! machine, workers given both hosts (`target_session_attrs=read-write`), and the
//! primary SIGKILLed while orders flow; the monitor promotes the standby, and the old
//! primary is started again and rejoins as the new standby. Every order is counted.
//!
//! Run as root on a machine with Debian's `postgresql-15-auto-failover` (the nodes run as
//! the `postgres` user; the machine's own Postgres is left alone) and RabbitMQ:
//!
//! ```sh
//! cargo build --release --examples
//! ./target/release/examples/pg_failover_drill --orders 3000
//! ./target/release/examples/pg_failover_drill --orders 3000 --asynchronous
//! ```
//!
//! The monitor listens on 127.0.0.1:6500, the nodes on 6501 and 6502 (data under
//! `--dir`); the monitor's health checks are shortened (every second, a node unhealthy
//! after 3 s, a lost primary given 5 s to demote itself instead of 30). Replication is synchronous (pg_auto_failover's default: a commit waits
//! for the standby), or asynchronous with `--asynchronous` (the standby leaves the
//! replication quorum). It starts `--workers` `orders_worker` processes on the database
//! `app`, publishes the orders (a fifth of them twice) to the machine's RabbitMQ, kills
//! the primary's `pg_autoctl` and Postgres a third of the way in, restarts its
//! `pg_autoctl` once the standby is promoted, waits until everything settled and prints
//! one line: effects, duplicate effects, lost orders, seconds until bookings resumed,
//! whether the old primary rejoined. It exits 1 if a check failed (with
//! `--asynchronous`, losses are counted, not failed), and stops its nodes and removes
//! their data either way (`--keep` keeps them).

#[allow(dead_code)]
#[path = "orders_producer.rs"]
mod orders_producer;

#[path = "support/publisher.rs"]
mod publisher;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use publisher::Publisher;
use rand::Rng;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::process::{Child, Command};

#[derive(Parser, Debug, Clone)]
#[command(about = "idem Postgres failover drill: kill the primary under load")]
struct Args {
    /// Distinct orders (intents); a fifth of them are published twice.
    #[arg(long, default_value_t = 3000)]
    orders: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// The workers' mode: leased or transactional.
    #[arg(long, default_value = "leased")]
    mode: String,
    /// Asynchronous replication: the standby leaves the replication quorum, and a
    /// commit no longer waits for it.
    #[arg(long)]
    asynchronous: bool,
    /// Where the monitor and the nodes keep their data and logs.
    #[arg(long, default_value = "/tmp/idem-pg-failover-drill")]
    dir: PathBuf,
    /// Give up waiting for the run to settle after this many seconds.
    #[arg(long, default_value_t = 120)]
    settle_timeout_secs: u64,
    /// The worker binary (default: `orders_worker` beside this one).
    #[arg(long)]
    worker_bin: Option<PathBuf>,
    /// Leave the monitor and the nodes running.
    #[arg(long)]
    keep: bool,
    /// RabbitMQ URL.
    #[arg(long, env = "AMQP_URL", default_value = idem::topology::DEFAULT_AMQP_URL, hide_env_values = true)]
    amqp_url: String,
}

const MONITOR_PORT: u16 = 6500;
const PG_CTL: &str = "/usr/lib/postgresql/15/bin/pg_ctl";

fn node_port(n: usize) -> u16 {
    MONITOR_PORT + n as u16
}

/// The URL the workers get: both nodes, the writable one wanted.
fn app_url() -> String {
    format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/app?target_session_attrs=read-write",
        node_port(1),
        node_port(2)
    )
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!(
                "pg_failover_drill: error: {}",
                idem::text::error_line(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    let worker_bin = match &args.worker_bin {
        Some(path) => path.clone(),
        None => std::env::current_exe()?
            .with_file_name(format!("orders_worker{}", std::env::consts::EXE_SUFFIX)),
    };
    if !worker_bin.exists() {
        bail!(
            "{} not found: build it with cargo build --examples",
            worker_bin.display()
        );
    }
    stop_all(&args.dir).await;
    let mut services = Vec::new();
    let queue = format!(
        "drill.pg.{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let result = match start_formation(&args, &mut services).await {
        Ok(()) => drill(&args, &worker_bin, &queue, &mut services).await,
        Err(error) => Err(error),
    };
    if args.keep {
        println!(
            "kept: monitor on {MONITOR_PORT}, nodes {}, data {}",
            app_url(),
            args.dir.display()
        );
        return result;
    }
    stop_all(&args.dir).await;
    drop(services);
    // The drill's workers went with it (killed on drop): its queues go too.
    delete_queues(&args.amqp_url, &queue).await;
    if !matches!(result, Ok(true)) {
        print_logs(&args.dir);
    }
    let _ = std::fs::remove_dir_all(&args.dir);
    result
}

/// The last lines of each service's log, and of each node's own Postgres log, to stderr:
/// a drill that failed deletes its directory, and these say why (a base backup that did
/// not finish, a standby that never caught up).
fn print_logs(dir: &Path) {
    const LINES: usize = 40;
    let mut logs = Vec::new();
    for name in ["monitor", "node1", "node2"] {
        logs.push(dir.join(format!("{name}.log")));
        let own = std::fs::read_dir(dir.join(name).join("log"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.path())
            .max();
        logs.extend(own);
    }
    for log in logs {
        let Ok(text) = std::fs::read_to_string(&log) else {
            continue;
        };
        let lines: Vec<&str> = text.lines().collect();
        eprintln!("--- the last lines of {}", log.display());
        for line in &lines[lines.len().saturating_sub(LINES)..] {
            eprintln!("{line}");
        }
    }
}

/// `pg_autoctl args…` as the `postgres` user, with its configuration under `dir`.
fn pg_autoctl(dir: &Path, args: &[&str]) -> Command {
    let mut command = Command::new("runuser");
    command
        .args(["-u", "postgres", "--", "env"])
        .arg(format!("HOME={}", dir.display()))
        .arg(format!("XDG_CONFIG_HOME={}/config", dir.display()))
        .arg(format!("XDG_DATA_HOME={}/data", dir.display()))
        .arg(format!("XDG_RUNTIME_DIR={}/run", dir.display()))
        .arg("pg_autoctl")
        .args(args)
        .stdin(Stdio::null());
    command
}

/// `pg_autoctl run` for the data directory `name`, logging to `name.log`.
fn run_service(dir: &Path, name: &str) -> anyhow::Result<Child> {
    let log = std::fs::File::create(dir.join(format!("{name}.log")))?;
    let pgdata = dir.join(name);
    pg_autoctl(dir, &["run", "--pgdata", &pgdata.to_string_lossy()])
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("start pg_autoctl")
}

async fn sql(port: u16, database: &str, sql: &str) -> anyhow::Result<Vec<(String, String)>> {
    let url = format!("postgres://postgres@127.0.0.1:{port}/{database}");
    let mut conn = PgConnection::connect(&url)
        .await
        .with_context(|| format!("connect to port {port}"))?;
    let rows = sqlx::query_as(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_all(&mut conn)
        .await
        .with_context(|| format!("{sql} on port {port}"))?;
    let _ = conn.close().await;
    Ok(rows)
}

/// Each node's reported state, by node number (`primary`, `secondary`, …).
async fn states() -> BTreeMap<usize, String> {
    let rows = sql(
        MONITOR_PORT,
        "pg_auto_failover",
        "SELECT nodeid::text, reportedstate::text FROM pgautofailover.node",
    )
    .await
    .unwrap_or_default();
    rows.into_iter()
        .filter_map(|(id, state)| Some((id.parse().ok()?, state)))
        .collect()
}

/// Waits until node `n` reports `state`; returns how long that took.
async fn await_state(n: usize, state: &str, within: Duration) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        let now = states().await;
        if now.get(&n).map(String::as_str) == Some(state) {
            return Ok(started.elapsed());
        }
        if started.elapsed() > within {
            bail!("node{n} not {state} after {within:?}: {now:?}");
        }
        // A base backup waits for a checkpoint that may be spread over minutes.
        for m in [1, 2] {
            let _ = sql(node_port(m), "postgres", "CHECKPOINT").await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The monitor (health checks every second, a node unhealthy after 3 s, a lost primary
/// given 5 s to demote itself) and two nodes,
/// node1 the primary and node2 its standby.
async fn start_formation(args: &Args, services: &mut Vec<Child>) -> anyhow::Result<()> {
    let dir = &args.dir;
    let _ = std::fs::remove_dir_all(dir);
    for sub in ["config", "data", "run"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }
    let chown = Command::new("chown")
        .args(["-R", "postgres"])
        .arg(dir)
        .status()
        .await?;
    if !chown.success() {
        bail!("chown {} to postgres failed (run as root)", dir.display());
    }
    let monitor = dir.join("monitor");
    let port = MONITOR_PORT.to_string();
    let created = pg_autoctl(
        dir,
        &[
            "create",
            "monitor",
            "--pgdata",
            &monitor.to_string_lossy(),
            "--pgport",
            &port,
            "--hostname",
            "127.0.0.1",
            "--auth",
            "trust",
            "--no-ssl",
            "--pgctl",
            PG_CTL,
        ],
    )
    .output()
    .await?;
    if !created.status.success() {
        bail!(
            "pg_autoctl create monitor: {}",
            String::from_utf8_lossy(&created.stderr).trim()
        );
    }
    services.push(run_service(dir, "monitor")?);
    let deadline = Instant::now() + Duration::from_secs(30);
    while sql(MONITOR_PORT, "pg_auto_failover", "SELECT 'up', ''")
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            bail!(
                "the monitor did not start; log in {}/monitor.log",
                dir.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for (setting, value) in [
        ("health_check_period", "1000"),
        ("health_check_timeout", "1000"),
        ("health_check_max_retries", "1"),
        ("health_check_retry_delay", "500"),
        ("node_considered_unhealthy_timeout", "3000"),
        // How long the monitor waits for an unreachable primary to demote itself
        // before it promotes the standby (30 s by default).
        ("primary_demote_timeout", "5000"),
    ] {
        let set = format!("ALTER SYSTEM SET pgautofailover.{setting} = {value}");
        // pg_autoctl may restart the monitor's Postgres as it starts: ask again.
        while let Err(error) = sql(MONITOR_PORT, "postgres", &set).await {
            if Instant::now() > deadline {
                return Err(error);
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    let _ = sql(
        MONITOR_PORT,
        "postgres",
        "SELECT pg_reload_conf()::text, ''",
    )
    .await;
    let monitor_url = format!(
        "postgres://autoctl_node@127.0.0.1:{MONITOR_PORT}/pg_auto_failover?sslmode=disable"
    );
    for n in [1, 2] {
        let name = format!("node{n}");
        let pgdata = dir.join(&name);
        let port = node_port(n).to_string();
        let log = std::fs::File::create(dir.join(format!("{name}.log")))?;
        let child = pg_autoctl(
            dir,
            &[
                "create",
                "postgres",
                "--pgdata",
                &pgdata.to_string_lossy(),
                "--pgport",
                &port,
                "--hostname",
                "127.0.0.1",
                "--auth",
                "trust",
                "--no-ssl",
                "--monitor",
                &monitor_url,
                "--pgctl",
                PG_CTL,
                "--dbname",
                "app",
                "--name",
                &name,
                "--run",
            ],
        )
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("pg_autoctl create postgres")?;
        services.push(child);
        let state = if n == 1 { "single" } else { "secondary" };
        await_state(n, state, Duration::from_secs(120)).await?;
    }
    await_state(1, "primary", Duration::from_secs(60)).await?;
    if args.asynchronous {
        let pgdata = dir.join("node2");
        let out = pg_autoctl(
            dir,
            &[
                "set",
                "node",
                "replication-quorum",
                "false",
                "--pgdata",
                &pgdata.to_string_lossy(),
            ],
        )
        .output()
        .await?;
        if !out.status.success() {
            bail!(
                "pg_autoctl set node replication-quorum false: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    Ok(())
}

/// Stops whatever an earlier drill left: every `pg_autoctl` and Postgres under `dir`.
async fn stop_all(dir: &Path) {
    kill_tree(dir, None).await;
}

/// SIGKILLs node `name`'s `pg_autoctl` and Postgres, and their children (Postgres's
/// backends, `pg_autoctl`'s services, which rename themselves), all at once, as a lost
/// machine takes them.
async fn kill_node(dir: &Path, name: &str) {
    kill_tree(dir, Some(&dir.join(name))).await;
}

/// SIGKILLs the processes this drill started under `dir` (each inherits
/// `XDG_CONFIG_HOME=<dir>/config` from [`pg_autoctl`]) whose command line names
/// `pgdata` (all of them: `None`), and all their descendants.
async fn kill_tree(dir: &Path, pgdata: Option<&Path>) {
    let marker = format!("XDG_CONFIG_HOME={}/config", dir.display());
    let mut ours = Vec::new(); // (pid, parent, command line)
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        if !environ.split(|b| *b == 0).any(|v| v == marker.as_bytes()) {
            continue;
        }
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // pid (comm) state ppid …: the parent follows the last ')'.
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok())
            .unwrap_or(0);
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        ours.push((
            pid,
            parent,
            String::from_utf8_lossy(&cmdline).replace('\0', " "),
        ));
    }
    let mut doomed: Vec<u32> = match pgdata {
        None => ours.iter().map(|(pid, _, _)| *pid).collect(),
        Some(pgdata) => {
            let path = pgdata.to_string_lossy();
            ours.iter()
                .filter(|(_, _, cmd)| cmd.split(' ').any(|word| word == path))
                .map(|(pid, _, _)| *pid)
                .collect()
        }
    };
    let mut grew = true;
    while grew {
        grew = false;
        for (pid, parent, _) in &ours {
            if doomed.contains(parent) && !doomed.contains(pid) {
                doomed.push(*pid);
                grew = true;
            }
        }
    }
    if doomed.is_empty() {
        return;
    }
    let pids: Vec<String> = doomed.iter().map(u32::to_string).collect();
    let _ = Command::new("kill").arg("-KILL").args(&pids).status().await;
}

fn spawn_worker(args: &Args, bin: &Path, queue: &str, i: usize) -> anyhow::Result<Child> {
    let log = std::fs::File::create(args.dir.join(format!("worker-{i}.log")))?;
    Command::new(bin)
        .args([
            "--queue",
            queue,
            "--mode",
            &args.mode,
            "--lease-secs",
            "5",
            "--retry-delays-ms",
            &RETRY_DELAYS_MS.map(|ms| ms.to_string()).join(","),
        ])
        .env("DATABASE_URL", app_url())
        .env("AMQP_URL", &args.amqp_url)
        .env("RUST_LOG", "info,sqlx=warn")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("start {}", bin.display()))
}

async fn booked(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT event_id) FROM example_ledger")
        .fetch_one(pool)
        .await
        .unwrap_or(-1)
}

/// The workers' retry tiers (`--retry-delays-ms`).
const RETRY_DELAYS_MS: [u64; 2] = [200, 1000];

/// The drill's queue, its dead-letter queue and its retry queues, as its workers declare
/// them.
fn queues(queue: &str) -> Vec<String> {
    let topology = idem::Topology {
        queue: queue.to_string(),
        queue_type: idem::QueueType::Classic,
        retry_delays: RETRY_DELAYS_MS.map(Duration::from_millis).to_vec(),
        subscriptions: Vec::new(),
        single_active_consumer: false,
    };
    [queue.to_string(), topology.dlq()]
        .into_iter()
        .chain(topology.retry_queues())
        .collect()
}

/// Deletes the drill's [`queues`]. If that fails, it says so; the drill's verdict stands.
async fn delete_queues(amqp_url: &str, queue: &str) {
    let deleted = async {
        let connection = idem::topology::connect(amqp_url, "idem-pg-failover-drill").await?;
        let channel = connection.create_channel().await?;
        for name in queues(queue) {
            channel
                .queue_delete(name.as_str().into(), Default::default())
                .await?;
        }
        Ok::<_, lapin::Error>(())
    };
    if let Err(error) = deleted.await {
        eprintln!("the drill's queues not deleted: {error}");
    }
}

async fn drill(
    args: &Args,
    worker_bin: &Path,
    queue: &str,
    services: &mut Vec<Child>,
) -> anyhow::Result<bool> {
    let mut tries = 0;
    let pool = loop {
        match idem::db::connect_and_migrate(&app_url(), 4).await {
            Ok(pool) => break pool,
            Err(error) if tries < 20 => {
                tries += 1;
                eprintln!("migrating: {}; again", idem::text::error_line(&error));
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(error) => {
                return Err(anyhow::Error::from(error).context("migrate the drill's database"));
            }
        }
    };
    let mut workers = Vec::new();
    for i in 0..args.workers {
        workers.push(spawn_worker(args, worker_bin, queue, i)?);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    // The drill's own statements take a restart of a node's Postgres (pg_autoctl makes
    // some) as the workers do: they ask again.
    while !sqlx::query_scalar::<_, bool>("SELECT to_regclass('example_ledger') IS NOT NULL")
        .fetch_one(&pool)
        .await
        .unwrap_or(false)
    {
        if Instant::now() > deadline {
            bail!("workers did not start; logs in {}", args.dir.display());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The workers declare the queue: wait for their consumers before publishing.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let mut rng = rand::rng();
    let events: Vec<String> = (0..args.orders).map(|i| format!("pg-drill-{i}")).collect();
    let mut bodies = Vec::new();
    for (i, event) in events.iter().enumerate() {
        for _ in 0..if rng.random_bool(0.2) { 2 } else { 1 } {
            bodies.push(orders_producer::order_json(
                event,
                "acme",
                i,
                100 + i as i64,
            ));
        }
    }
    let mut publisher = Publisher::new(&args.amqp_url, "idem-pg-failover-drill");
    let kill_at = bodies.len() / 3;
    let mut killed: Option<(usize, Instant, i64)> = None;
    let mut resumed: Option<Duration> = None;
    let mut rejoined = false;
    let started = Instant::now();
    for (i, body) in bodies.iter().enumerate() {
        publisher.publish(queue, body).await?;
        // A steady rate, so that the kill falls on a queue with work in it.
        tokio::time::sleep(Duration::from_millis(2)).await;
        if i == kill_at {
            let primary = *states()
                .await
                .iter()
                .find(|(_, s)| *s == "primary")
                .context("no primary")?
                .0;
            let before = booked(&pool).await;
            kill_node(&args.dir, &format!("node{primary}")).await;
            println!(
                "killed node{primary} (the primary) after {i} messages, {before} orders booked"
            );
            killed = Some((primary, Instant::now(), before));
        }
        if let Some((node, at, before)) = killed
            && i % 50 == 0
        {
            if resumed.is_none() && booked(&pool).await > before {
                resumed = Some(at.elapsed());
            }
            let other = 3 - node;
            let promoted = matches!(
                states().await.get(&other).map(String::as_str),
                Some("primary" | "wait_primary")
            );
            if !rejoined && promoted && at.elapsed() > Duration::from_secs(5) {
                services.push(run_service(&args.dir, &format!("node{node}"))?);
                rejoined = true;
                println!("restarted node{node} after {} messages", i + 1);
            }
        }
    }
    publisher.close().await;
    let published = started.elapsed();
    let published_at = Instant::now();
    let Some((old, at, before)) = killed else {
        bail!("nothing was killed");
    };
    while resumed.is_none() && at.elapsed() < Duration::from_secs(120) {
        if booked(&pool).await > before {
            resumed = Some(at.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if !rejoined {
        services.push(run_service(&args.dir, &format!("node{old}"))?);
    }
    let rejoin = await_state(old, "secondary", Duration::from_secs(120))
        .await
        .is_ok();

    let deadline = Instant::now() + Duration::from_secs(args.settle_timeout_secs);
    loop {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM processed_operations WHERE status <> 'completed'",
        )
        .fetch_one(&pool)
        .await
        .unwrap_or(-1);
        if booked(&pool).await as usize == args.orders && open == 0 {
            break;
        }
        if Instant::now() > deadline {
            eprintln!(
                "not settled: booked {}/{}, unfinished {open}",
                booked(&pool).await,
                args.orders
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let settle = published_at.elapsed();
    let mut tries = 0;
    let rows: Vec<(String, i64)> = loop {
        let read =
            sqlx::query_as("SELECT event_id, count(*) FROM example_ledger GROUP BY event_id")
                .fetch_all(&pool)
                .await;
        match read {
            Ok(rows) => break rows,
            Err(error) if tries < 20 => {
                tries += 1;
                eprintln!("reading the ledger: {error}; again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(error) => return Err(error.into()),
        }
    };
    let ledger: BTreeMap<String, i64> = rows.into_iter().collect();
    let effects: i64 = ledger.values().sum();
    let duplicate_effects: i64 = ledger.values().map(|n| n - 1).sum();
    let lost = events.iter().filter(|e| !ledger.contains_key(*e)).count();
    let calls: Vec<(String, i64)> =
        sqlx::query_as("SELECT idempotency_key, count(*) FROM example_provider_calls GROUP BY 1")
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
    let repeated_calls: i64 = calls.iter().map(|(_, n)| n - 1).sum();
    let mut dead_workers = 0;
    for worker in &mut workers {
        if worker.try_wait()?.is_some() {
            dead_workers += 1;
        }
    }
    let resumed_s = resumed.map_or(f64::NAN, |d| d.as_secs_f64());
    let ok = duplicate_effects == 0
        && dead_workers == 0
        && rejoin
        && resumed.is_some_and(|d| d <= Duration::from_secs(30))
        && (args.asynchronous || (lost == 0 && effects as usize == args.orders));
    println!(
        "pg_failover_drill: replication={} mode={} queue={queue} killed=node{old} orders={} messages={} effects={effects} duplicate_effects={duplicate_effects} lost={lost} repeated_provider_calls={repeated_calls} resumed_s={resumed_s:.1} rejoined={rejoin} dead_workers={dead_workers} publish_s={:.1} settle_s={:.1} result={}",
        if args.asynchronous {
            "asynchronous"
        } else {
            "synchronous"
        },
        args.mode,
        args.orders,
        bodies.len(),
        published.as_secs_f64(),
        settle.as_secs_f64(),
        if ok { "ok" } else { "FAILED" },
    );
    for worker in &mut workers {
        let _ = worker.start_kill();
        let _ = worker.wait().await;
    }
    pool.close().await;
    Ok(ok)
}
