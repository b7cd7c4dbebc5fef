//! What the `Idempotency-Key` layer costs an HTTP route, on the same server, in one run.
//!
//! Run with (release build; Postgres on this machine):
//!
//! ```sh
//! cargo build --release --features http --examples
//! cargo run --release --features http --example http_bench -- --requests 5000 --rounds 3
//! ```
//!
//! It starts `payments_api --unprotected-route --single-commit-route` (the release
//! binary beside this one) on
//! a fresh database `idem_http_bench`, and for each round sends `--requests` payments
//! with `--concurrency` clients at once, each request with a new key, to:
//!
//! 1. `bare`: `POST /unprotected/payments`, the same handler in its own transaction,
//!    without the layer;
//! 2. `layer`: `POST /payments`, behind the layer (claim, the handler in the request's
//!    transaction, the stored answer committed with it);
//! 3. `single`: `POST /single/payments`, behind the layer in single-commit mode (the
//!    key's lock taken in the request's transaction, the handler in it, the record
//!    inserted with the answer and committed with both: one commit);
//! 4. `replayed`: `POST /payments` again with the keys `layer` used: every answer comes
//!    from the record.
//!
//! It prints requests/s, p50/p99 latency and the CPU per request (Postgres's processes,
//! the server's, this client's, from `/proc`) per variant and round, the medians, and a
//! last line `layer_req_per_s=… bare_req_per_s=… ratio=… single_req_per_s=…
//! single_ratio=… single_p99_ratio=…` (the ratios are to `bare`). `--variants single`
//! (or `bare,single`, …) measures only those, for a profiler attached to the server.

use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use sqlx::Connection;

#[allow(dead_code)]
#[path = "support/cpu.rs"]
mod cpu;
use cpu::{CpuPerOp, CpuTicks};

#[derive(Parser, Debug)]
#[command(
    about = "idem HTTP bench: POST /payments without the idempotency layer, with it, and with it in single-commit mode"
)]
struct Args {
    /// Requests per variant and round.
    #[arg(long, default_value_t = 5000)]
    requests: usize,
    /// Clients sending at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Rounds (the medians are printed).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Port of the server under test.
    #[arg(long, default_value_t = 3917)]
    port: u16,
    /// The routes to measure, of `bare`, `layer`, `single` (comma-separated; all by
    /// default; `layer` brings `replayed`). The last line needs all three.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "bare,layer,single",
        value_parser = ["bare", "layer", "single"]
    )]
    variants: Vec<String>,
    /// Postgres URL of a database to create the bench's own database from.
    #[arg(long, env = "DATABASE_URL", default_value = idem::db::DEFAULT_DATABASE_URL, hide_env_values = true)]
    database_url: String,
}

/// One variant's run.
#[derive(Debug, Clone, Copy)]
struct Measured {
    per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// CPU per request: Postgres, the server (`other`), this client (`this`).
    cpu: CpuPerOp,
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!(
                "http_bench: error: {}",
                idem::text::error_line(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let bench_url = fresh_database(&args.database_url, "idem_http_bench").await?;
    let args = Args {
        database_url: bench_url.clone(),
        ..args
    };
    let server = std::env::current_exe()?
        .with_file_name("payments_api")
        .canonicalize()
        .context(
            "payments_api beside http_bench: cargo build --release --features http --examples",
        )?;
    let mut child = tokio::process::Command::new(server)
        .args(["--unprotected-route", "--single-commit-route"])
        .args(["--connections", "40"])
        .args(["--listen", &format!("127.0.0.1:{}", args.port)])
        .env("DATABASE_URL", &bench_url)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("start payments_api")?;
    let base = format!("http://127.0.0.1:{}", args.port);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency)
        .build()?;
    wait_for(&client, &format!("{base}/healthz")).await?;

    warm_up(&client, &base, &args).await?;
    let server = child.id();

    let paths = ["/unprotected/payments", "/payments", "/single/payments"];
    let mut results: Vec<(&str, Vec<Measured>)> = vec![
        ("bare", Vec::new()),
        ("layer", Vec::new()),
        ("single", Vec::new()),
        ("replayed", Vec::new()),
    ];
    for round in 0..args.rounds {
        let keys = format!("r{round}");
        // Rotate which goes first, so none always meets a warmer cache.
        for step in 0..paths.len() {
            let i = (round + step) % paths.len();
            if !args.variants.iter().any(|v| v == results[i].0) {
                continue;
            }
            let url = format!("{base}{}", paths[i]);
            let m = send(&client, &url, &args, &keys, false, server).await?;
            print_line(results[i].0, round, m);
            results[i].1.push(m);
        }
        if args.variants.iter().any(|v| v == "layer") {
            let m = send(
                &client,
                &format!("{base}/payments"),
                &args,
                &keys,
                true,
                server,
            )
            .await?;
            print_line("replayed", round, m);
            results[3].1.push(m);
        }
    }
    results.retain(|(_, ms)| !ms.is_empty());
    let medians: Vec<Measured> = results.iter().map(|(_, ms)| median(ms)).collect();
    for ((name, _), m) in results.iter().zip(&medians) {
        println!(
            "median {name:<9} {:>8.0} req/s  p50 {:>6.2} ms  p99 {:>6.2} ms  {}",
            m.per_s,
            m.p50_ms,
            m.p99_ms,
            cpu_line(m.cpu)
        );
    }
    let &[bare, layer, single, replayed] = &medians[..] else {
        child.kill().await.ok();
        return Ok(());
    };
    println!(
        "layer_req_per_s={:.0} bare_req_per_s={:.0} ratio={:.2} layer_p50_ms={:.2} layer_p99_ms={:.2} bare_p50_ms={:.2} bare_p99_ms={:.2} replayed_req_per_s={:.0} single_req_per_s={:.0} single_ratio={:.2} single_p50_ms={:.2} single_p99_ms={:.2} single_p99_ratio={:.2}",
        layer.per_s,
        bare.per_s,
        layer.per_s / bare.per_s,
        layer.p50_ms,
        layer.p99_ms,
        bare.p50_ms,
        bare.p99_ms,
        replayed.per_s,
        single.per_s,
        single.per_s / bare.per_s,
        single.p50_ms,
        single.p99_ms,
        single.p99_ms / bare.p99_ms
    );
    child.kill().await.ok();
    Ok(())
}

/// Warms every route up (connections, plans, caches).
async fn warm_up(client: &reqwest::Client, base: &str, args: &Args) -> anyhow::Result<()> {
    let warm = Args {
        requests: 500,
        database_url: String::new(),
        variants: Vec::new(),
        ..*args
    };
    for path in ["/unprotected/payments", "/payments", "/single/payments"] {
        let url = format!("{base}{path}");
        send(
            client,
            &url,
            &warm,
            &format!("warm{}", path.replace('/', "-")),
            false,
            None,
        )
        .await?;
    }
    Ok(())
}

/// Where a request's CPU went.
fn cpu_line(cpu: CpuPerOp) -> String {
    format!(
        "cpu/req postgres {:.0} us server {:.0} us client {:.0} us",
        cpu.postgres, cpu.other, cpu.this
    )
}

fn print_line(name: &str, round: usize, m: Measured) {
    println!(
        "round {round} {name:<9} {:>8.0} req/s  p50 {:>6.2} ms  p99 {:>6.2} ms  {}",
        m.per_s,
        m.p50_ms,
        m.p99_ms,
        cpu_line(m.cpu)
    );
}

/// Sends `args.requests` payments to `url`, `args.concurrency` at once, request `i`
/// with key `{keys}-{i}`; every answer must be 201, replayed or not as `replays` says.
async fn send(
    client: &reqwest::Client,
    url: &str,
    args: &Args,
    keys: &str,
    replays: bool,
    server: Option<u32>,
) -> anyhow::Result<Measured> {
    let next = Arc::new(AtomicUsize::new(0));
    let cpu = CpuTicks::now(server);
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..args.concurrency {
        let (client, url, next, keys) = (
            client.clone(),
            url.to_owned(),
            next.clone(),
            keys.to_owned(),
        );
        let total = args.requests;
        clients.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return Ok::<_, anyhow::Error>(latencies);
                }
                let body = format!(
                    r#"{{"customer":"c-{}","amount_cents":{},"currency":"EUR"}}"#,
                    i % 100,
                    100 + i
                );
                let sent = Instant::now();
                let response = client
                    .post(&url)
                    .bearer_auth("bench")
                    .header("idempotency-key", format!("{keys}-{i}"))
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await?;
                let status = response.status();
                let replayed = response.headers().contains_key("idempotency-replayed");
                response.bytes().await?;
                if status != reqwest::StatusCode::CREATED {
                    bail!("{url} answered {status}");
                }
                if replayed != replays {
                    bail!("{url}: replayed {replayed}, expected {replays}");
                }
                latencies.push(sent.elapsed());
            }
        });
    }
    let mut latencies = Vec::with_capacity(args.requests);
    for result in clients.join_all().await {
        latencies.extend(result?);
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    let quantile = |q: f64| {
        let i = ((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1));
        latencies.get(i).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    Ok(Measured {
        per_s: args.requests as f64 / elapsed.as_secs_f64(),
        p50_ms: quantile(0.5),
        p99_ms: quantile(0.99),
        cpu: cpu.per_op(args.requests, server),
    })
}

fn median(ms: &[Measured]) -> Measured {
    let pick = |f: fn(&Measured) -> f64| {
        let mut v: Vec<f64> = ms.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    Measured {
        per_s: pick(|m| m.per_s),
        p50_ms: pick(|m| m.p50_ms),
        p99_ms: pick(|m| m.p99_ms),
        cpu: CpuPerOp {
            postgres: pick(|m| m.cpu.postgres),
            other: pick(|m| m.cpu.other),
            this: pick(|m| m.cpu.this),
            ..CpuPerOp::default()
        },
    }
}

async fn wait_for(client: &reqwest::Client, url: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while client.get(url).send().await.is_err() {
        if Instant::now() > deadline {
            bail!("{url} did not answer within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Drops and creates `name` beside the database of `url`; returns its URL.
async fn fresh_database(url: &str, name: &str) -> anyhow::Result<String> {
    let mut admin = sqlx::PgConnection::connect(url).await.context("connect")?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await?;
    let (base, _) = url
        .rsplit_once('/')
        .context("a database URL ends in /name")?;
    Ok(format!("{base}/{name}"))
}
