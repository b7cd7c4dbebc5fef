//! The cluster drill: a three-node RabbitMQ cluster on this machine, a quorum queue, two
//! workers given the node list, and the node that leads the queue SIGKILLed while orders
//! flow, then restarted. Every order must be booked exactly once.
//!
//! Run as root on a machine with Debian's `rabbitmq-server` (the nodes run as the
//! `rabbitmq` user and share its Erlang cookie; the machine's own broker is left alone):
//!
//! ```sh
//! cargo build --release --examples
//! ./target/release/examples/cluster_drill --orders 3000
//! ```
//!
//! It starts nodes `idem1@localhost` … `idem3@localhost` (AMQP on 127.0.0.1:5681–5683,
//! distribution on 25681–25683, data under `--dir`), joins them with `rabbitmqctl
//! join_cluster`, creates its own database, starts `--workers` `orders_worker` processes
//! with `AMQP_URL` listing the three nodes and `--queue-type quorum`, and publishes the
//! orders (a share twice) with confirms through the node list. A third of the way in it
//! asks the cluster which node leads the queue, SIGKILLs that node's Erlang VM, and
//! restarts it some seconds later. Then it waits until everything settled and prints one
//! line: effects, duplicate effects, lost orders, workers alive. It exits 1 if a check
//! failed, and stops its nodes and drops its database either way, after
//! `--deadline-secs` at the latest (`--keep` keeps them).

#[allow(dead_code)]
#[path = "orders_producer.rs"]
mod orders_producer;

#[path = "support/publisher.rs"]
mod publisher;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use publisher::Publisher;
use rand::Rng;
use sqlx::ConnectOptions;
use sqlx::postgres::PgConnectOptions;
use tokio::process::{Child, Command};

#[derive(Parser, Debug, Clone)]
#[command(about = "idem cluster drill: kill the quorum queue's leader under load")]
struct Args {
    /// Distinct orders (intents); a fifth of them are published twice.
    #[arg(long, default_value_t = 3000)]
    orders: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Seconds between the kill and the restart of the leader's node.
    #[arg(long, default_value_t = 5)]
    down_secs: u64,
    /// Where the nodes keep their data and logs.
    #[arg(long, default_value = "/tmp/idem-cluster-drill")]
    dir: PathBuf,
    /// Give up waiting for the run to settle after this many seconds.
    #[arg(long, default_value_t = 120)]
    settle_timeout_secs: u64,
    /// Give up on the whole drill after this many seconds (its nodes, workers and
    /// database are removed all the same).
    #[arg(long, default_value_t = 200)]
    deadline_secs: u64,
    /// The worker binary (default: `orders_worker` beside this one).
    #[arg(long)]
    worker_bin: Option<PathBuf>,
    /// Leave the nodes running and the database in place.
    #[arg(long)]
    keep: bool,
    /// Postgres server (the drill creates its own database on it).
    #[arg(long, env = "DATABASE_URL", default_value = idem::db::DEFAULT_DATABASE_URL, hide_env_values = true)]
    database_url: String,
}

const NODES: usize = 3;
const QUEUE: &str = "drill.orders";

fn node_name(n: usize) -> String {
    format!("idem{n}@localhost")
}

fn amqp_port(n: usize) -> usize {
    5680 + n
}

/// The node list the workers and the publisher get.
fn node_list() -> String {
    (1..=NODES)
        .map(|n| format!("amqp://guest:guest@127.0.0.1:{}/%2f", amqp_port(n)))
        .collect::<Vec<_>>()
        .join(",")
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!(
                "cluster_drill: error: {}",
                idem::text::error_line(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    let id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
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
    let server = PgConnectOptions::from_str(&args.database_url)?;
    let database = format!("idem_drill_{id}");
    let url = server
        .clone()
        .database(&database)
        .to_url_lossy()
        .to_string();
    // Nodes of an earlier drill that did not get to clean up hold the names and ports.
    for n in 1..=NODES {
        let _ = rabbitmqctl(n, &["stop"]).await;
    }
    let deadline = Duration::from_secs(args.deadline_secs);
    let result = match start_cluster(&args.dir).await {
        Ok(()) => match tokio::time::timeout(deadline, drill(&args, &worker_bin, &url)).await {
            Ok(result) => result,
            Err(_) => Err(anyhow::anyhow!(
                "the drill did not finish in {} s (--deadline-secs)",
                args.deadline_secs
            )),
        },
        Err(error) => Err(error),
    };
    if args.keep {
        println!(
            "kept: nodes {}, data {}, database {database}",
            node_list(),
            args.dir.display()
        );
        return result;
    }
    // Always: the nodes, the data, the database (the workers died with `drill`).
    for n in 1..=NODES {
        if rabbitmqctl(n, &["stop"]).await.is_err() {
            let _ = kill_node(&args.dir, n).await;
        }
    }
    let _ = std::fs::remove_dir_all(&args.dir);
    let dropped = async {
        let mut admin = server.database("postgres").connect().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
        )))
        .execute(&mut admin)
        .await?;
        Ok::<_, sqlx::Error>(())
    };
    if let Err(error) = dropped.await {
        eprintln!("cluster_drill: database {database} not dropped: {error}");
    }
    result
}

/// Starts the three nodes and joins the second and third to the first.
async fn start_cluster(dir: &Path) -> anyhow::Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    for n in 1..=NODES {
        let node = dir.join(format!("n{n}"));
        std::fs::create_dir_all(node.join("mnesia"))?;
        std::fs::create_dir_all(node.join("log"))?;
        std::fs::write(
            node.join("rabbitmq.conf"),
            format!("listeners.tcp.local = 127.0.0.1:{}\n", amqp_port(n)),
        )?;
        std::fs::write(node.join("env.conf"), "")?;
        std::fs::write(node.join("enabled_plugins"), "[].\n")?;
    }
    let status = Command::new("chown")
        .args(["-R", "rabbitmq:rabbitmq"])
        .arg(dir)
        .status()
        .await?;
    if !status.success() {
        bail!("chown {} to rabbitmq failed (run as root)", dir.display());
    }
    for n in 1..=NODES {
        start_node(dir, n).await?;
    }
    for n in 2..=NODES {
        rabbitmqctl(n, &["stop_app"]).await?;
        rabbitmqctl(n, &["join_cluster", &node_name(1)]).await?;
        rabbitmqctl(n, &["start_app"]).await?;
    }
    Ok(())
}

/// Starts node `n` (detached, as the `rabbitmq` user, so it shares that user's Erlang
/// cookie with `rabbitmqctl`) and waits until it has booted.
async fn start_node(dir: &Path, n: usize) -> anyhow::Result<()> {
    let node = dir.join(format!("n{n}"));
    let d = node.display();
    let script = format!(
        "cd /var/lib/rabbitmq && HOME=/var/lib/rabbitmq RABBITMQ_CONF_ENV_FILE={d}/env.conf \
         RABBITMQ_NODENAME={name} RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT={port} \
         RABBITMQ_DIST_PORT={dist} RABBITMQ_CONFIG_FILE={d}/rabbitmq.conf \
         RABBITMQ_MNESIA_BASE={d}/mnesia RABBITMQ_LOG_BASE={d}/log RABBITMQ_PID_FILE={d}/pid \
         RABBITMQ_ENABLED_PLUGINS_FILE={d}/enabled_plugins ERL_EPMD_ADDRESS=127.0.0.1 \
         /usr/lib/rabbitmq/bin/rabbitmq-server -detached",
        name = node_name(n),
        port = amqp_port(n),
        dist = 25680 + n,
    );
    let status = Command::new("su")
        .args(["rabbitmq", "-s", "/bin/sh", "-c", &script])
        .status()
        .await?;
    if !status.success() {
        bail!("starting {} failed", node_name(n));
    }
    // `await_startup` fails while the VM is not up yet: ask again for a while.
    let deadline = Instant::now() + Duration::from_secs(90);
    while rabbitmqctl(n, &["await_startup"]).await.is_err() {
        if Instant::now() > deadline {
            bail!("{} did not boot; logs in {}/log", node_name(n), d);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

/// `rabbitmqctl -n <node n> args…`; its output.
async fn rabbitmqctl(n: usize, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("rabbitmqctl")
        .arg("-n")
        .arg(node_name(n))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .context("rabbitmqctl")?;
    if !out.status.success() {
        bail!(
            "rabbitmqctl -n {} {args:?}: {}",
            node_name(n),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The node that leads `QUEUE` and how many messages it holds, asked of the nodes in
/// turn (any live member answers).
async fn queue_state(skip: Option<usize>) -> Option<(usize, u64)> {
    for n in (1..=NODES).filter(|n| Some(*n) != skip) {
        let Ok(out) = rabbitmqctl(n, &["-q", "list_queues", "name", "leader", "messages"]).await
        else {
            continue;
        };
        for line in out.lines() {
            let fields: Vec<&str> = line.split('\t').collect();
            if let [name, leader, messages] = fields.as_slice()
                && *name == QUEUE
            {
                let leader = (1..=NODES).find(|m| node_name(*m) == *leader)?;
                return Some((leader, messages.trim().parse().unwrap_or(u64::MAX)));
            }
        }
    }
    None
}

fn spawn_worker(bin: &Path, url: &str, dir: &Path, i: usize) -> anyhow::Result<Child> {
    let log = std::fs::File::create(dir.join(format!("worker-{i}.log")))?;
    Command::new(bin)
        .args([
            "--queue",
            QUEUE,
            "--queue-type",
            "quorum",
            "--lease-secs",
            "5",
            "--retry-delays-ms",
            "200,1000",
        ])
        .env("DATABASE_URL", url)
        .env("AMQP_URL", node_list())
        .env("RUST_LOG", "info,sqlx=warn")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("start {}", bin.display()))
}

async fn drill(args: &Args, worker_bin: &Path, url: &str) -> anyhow::Result<bool> {
    let pool = idem::db::connect_and_migrate(url, 4)
        .await
        .context("create the drill's database")?;
    let mut workers = Vec::new();
    for i in 0..args.workers {
        workers.push(spawn_worker(worker_bin, url, &args.dir, i)?);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let tables: bool = sqlx::query_scalar("SELECT to_regclass('example_ledger') IS NOT NULL")
            .fetch_one(&pool)
            .await?;
        if tables && queue_state(None).await.is_some() {
            break;
        }
        if Instant::now() > deadline {
            bail!("workers did not start; logs in {}", args.dir.display());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let mut rng = rand::rng();
    let events: Vec<String> = (0..args.orders).map(|i| format!("drill-{i}")).collect();
    let mut bodies = Vec::new();
    for (i, event) in events.iter().enumerate() {
        let copies = if rng.random_bool(0.2) { 2 } else { 1 };
        for _ in 0..copies {
            bodies.push(orders_producer::order_json(
                event,
                "acme",
                i,
                100 + i as i64,
            ));
        }
    }
    let mut publisher = Publisher::new(&node_list(), "idem-cluster-drill");
    let kill_at = bodies.len() / 3;
    let mut killed: Option<(usize, Instant)> = None;
    let mut restarted = false;
    let started = Instant::now();
    for (i, body) in bodies.iter().enumerate() {
        publisher.publish(QUEUE, body).await?;
        if i == kill_at {
            let (leader, _) = queue_state(None)
                .await
                .context("no node answers for the queue")?;
            kill_node(&args.dir, leader).await?;
            println!(
                "killed {} (the queue's leader) after {i} messages",
                node_name(leader)
            );
            killed = Some((leader, Instant::now()));
        }
        if let Some((node, at)) = killed
            && !restarted
            && at.elapsed() >= Duration::from_secs(args.down_secs)
        {
            start_node(&args.dir, node).await?;
            restarted = true;
            println!("restarted {} after {} messages", node_name(node), i + 1);
        }
    }
    if let Some((node, at)) = killed
        && !restarted
    {
        let left = Duration::from_secs(args.down_secs).saturating_sub(at.elapsed());
        tokio::time::sleep(left).await;
        start_node(&args.dir, node).await?;
        restarted = true;
        println!("restarted {} after the last message", node_name(node));
    }
    let published = started.elapsed();
    let published_at = Instant::now();
    publisher.close().await;

    // Settle: every order booked, nothing left in the queue or in progress.
    let deadline = Instant::now() + Duration::from_secs(args.settle_timeout_secs);
    loop {
        let booked: i64 = sqlx::query_scalar("SELECT count(DISTINCT event_id) FROM example_ledger")
            .fetch_one(&pool)
            .await?;
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM processed_operations WHERE status <> 'completed'",
        )
        .fetch_one(&pool)
        .await?;
        let queued = queue_state(None).await.map(|(_, m)| m);
        if booked as usize == args.orders && open == 0 && queued == Some(0) {
            break;
        }
        if Instant::now() > deadline {
            eprintln!(
                "not settled: booked {booked}/{}, unfinished {open}, queued {queued:?}",
                args.orders
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let settle = published_at.elapsed();

    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM example_ledger GROUP BY event_id")
            .fetch_all(&pool)
            .await?;
    let ledger: BTreeMap<String, i64> = rows.into_iter().collect();
    let effects: i64 = ledger.values().sum();
    let duplicate_effects: i64 = ledger.values().map(|n| n - 1).sum();
    let lost = events.iter().filter(|e| !ledger.contains_key(*e)).count();
    let mut dead_workers = 0;
    for worker in &mut workers {
        if worker.try_wait()?.is_some() {
            dead_workers += 1;
        }
    }
    let ok = duplicate_effects == 0
        && lost == 0
        && dead_workers == 0
        && killed.is_some()
        && restarted
        && effects as usize == args.orders;
    println!(
        "cluster_drill: nodes={NODES} queue_type=quorum killed={} restarted={restarted} orders={} messages={} republished_after_errors={} effects={effects} duplicate_effects={duplicate_effects} lost={lost} dead_workers={dead_workers} publish_s={:.1} settle_s={:.1} result={}",
        killed.map_or("none".into(), |(n, _)| node_name(n)),
        args.orders,
        bodies.len(),
        publisher.republished,
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

/// SIGKILLs node `n`'s Erlang VM (its pid file names it).
async fn kill_node(dir: &Path, n: usize) -> anyhow::Result<()> {
    let pid_file = dir.join(format!("n{n}")).join("pid");
    let pid = std::fs::read_to_string(&pid_file)
        .with_context(|| format!("read {}", pid_file.display()))?;
    let status = Command::new("kill")
        .args(["-KILL", pid.trim()])
        .status()
        .await?;
    if !status.success() {
        bail!("kill -KILL {} failed", pid.trim());
    }
    Ok(())
}
