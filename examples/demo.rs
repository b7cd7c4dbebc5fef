//! The idem demo: a worker, a producer that resends like a real one, and what happened.
//!
//! Run with `scripts/demo` (which brings up Postgres and RabbitMQ first), or, with both
//! already on the default ports:
//!
//! ```sh
//! cargo run --example demo
//! ```
//!
//! It starts an `orders.create` worker on the queue `idem_demo`, publishes 20 orders
//! (some two or three times, with a new message id, a new `sent_at` and their keys in
//! another order), one conflicting resend, two malformed messages and one order with a
//! negative amount, waits until all is settled, and prints what was delivered, skipped
//! as duplicate, executed and dead-lettered, and how many ledger rows each order got.

#[allow(dead_code)]
#[path = "orders_worker.rs"]
mod orders_worker;

#[allow(dead_code)]
#[path = "orders_producer.rs"]
mod orders_producer;

#[allow(dead_code)]
#[path = "support/outcomes.rs"]
mod outcomes;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use idem::{RetryPolicy, Store, StoreConfig, Worker, WorkerConfig};
use lapin::options::QueueDeleteOptions;
use outcomes::Outcomes;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

const QUEUE: &str = "idem_demo";

#[tokio::main]
async fn main() -> ExitCode {
    let outcomes = Outcomes::default();
    tracing_subscriber::registry()
        .with(outcomes.clone())
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(tracing_subscriber::filter::LevelFilter::ERROR),
        )
        .init();
    match run(&outcomes).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("demo: error: {}", idem::text::error_line(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

async fn run(outcomes: &Outcomes) -> anyhow::Result<()> {
    let database_url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| idem::db::DEFAULT_DATABASE_URL.into());
    let amqp_url =
        std::env::var("AMQP_URL").unwrap_or_else(|_| idem::topology::DEFAULT_AMQP_URL.into());
    let pool = idem::db::connect_and_migrate(&database_url, 12)
        .await
        .context("prepare the database")?;
    let given = |var| match std::env::var_os(var) {
        Some(_) => var,
        None => "the default",
    };
    println!(
        "database {} ({}), broker {} ({})",
        idem::db::describe(&database_url),
        given("DATABASE_URL"),
        amqp_url.rsplit('@').next().unwrap_or_default(),
        given("AMQP_URL")
    );
    orders_worker::create_example_tables(&pool).await?;

    let connection = idem::topology::connect(&amqp_url, "idem-demo-producer")
        .await
        .context("connect to RabbitMQ")?;
    let channel = connection.create_channel().await?;
    let retry_delay = Duration::from_secs(1);
    // A fresh start: the demo's queues from an earlier run are removed.
    let topology = idem::Topology {
        queue: QUEUE.into(),
        queue_type: idem::QueueType::Classic,
        retry_delays: vec![retry_delay],
        subscriptions: Vec::new(),
        single_active_consumer: false,
    };
    for queue in [QUEUE.to_string(), topology.dlq()]
        .into_iter()
        .chain(topology.retry_queues())
    {
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }

    let store = Store::new(pool.clone(), StoreConfig::default());
    let config = WorkerConfig {
        amqp_url: amqp_url.clone(),
        queue: QUEUE.into(),
        concurrency: 8,
        retry: RetryPolicy {
            delays: vec![retry_delay],
            ..RetryPolicy::default()
        },
        name: "idem-demo-worker".into(),
        ..WorkerConfig::default()
    };
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(
        Worker::new(orders_worker::Orders::default(), store, config).run(shutdown.clone()),
    );

    let plan = orders_producer::Plan {
        queue: QUEUE.into(),
        orders: 20,
        max_duplicates: 2,
        conflicts: 1,
        malformed: 2,
        invalid: 1,
        tenants: vec!["acme".into(), "globex".into()],
        run_id: None,
    };
    let published = orders_producer::publish_orders(&channel, &plan).await?;
    println!(
        "published {} messages to {QUEUE}: {} orders, {} duplicate copies, {} conflicting resend, {} malformed, {} with a negative amount",
        published.messages,
        published.orders,
        published.duplicates,
        published.conflicts,
        published.malformed,
        published.invalid
    );

    // Settled: every valid order booked, every bad message dead-lettered, and every
    // delivery decided.
    let dead_expected = published.conflicts + published.malformed + published.invalid;
    let pattern = format!("{}-%", published.run_id);
    let deadline = Instant::now() + Duration::from_secs(60);
    let (booked, dead) = loop {
        let booked: i64 =
            sqlx::query_scalar("SELECT count(*) FROM example_ledger WHERE event_id LIKE $1")
                .bind(&pattern)
                .fetch_one(&pool)
                .await?;
        let dead =
            outcomes.get("conflict") + outcomes.get("malformed") + outcomes.get("failed_permanent");
        // A delivery sent to the retry queue comes back once more to be decided.
        let returns = outcomes.get("duplicate_in_progress") + outcomes.get("lease_lost");
        let all_decided = outcomes.total() >= published.messages + returns;
        if booked as usize >= published.orders && dead >= dead_expected && all_decided {
            break (booked, dead);
        }
        anyhow::ensure!(Instant::now() < deadline, "not settled after 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    shutdown.cancel();
    worker.await??;
    let _ = connection.close(200, "done".into()).await;

    let per_event: Vec<(String, i64)> = sqlx::query_as(
        "SELECT event_id, count(*) FROM example_ledger WHERE event_id LIKE $1 GROUP BY 1",
    )
    .bind(&pattern)
    .fetch_all(&pool)
    .await?;
    let doubled = per_event.iter().filter(|(_, n)| *n > 1).count();
    println!();
    println!("deliveries decided          {:>4}", outcomes.total());
    println!(
        "  executed                  {:>4}   handler ran, one ledger row",
        outcomes.get("executed")
    );
    println!(
        "  skipped as duplicate      {:>4}   already completed: acked, not run",
        outcomes.get("duplicate_completed")
    );
    println!(
        "  retried later             {:>4}   another worker held the lease",
        outcomes.get("duplicate_in_progress")
    );
    println!(
        "  dead-lettered             {:>4}   conflict {}, malformed {}, permanent failure {}",
        dead,
        outcomes.get("conflict"),
        outcomes.get("malformed"),
        outcomes.get("failed_permanent")
    );
    if outcomes.get("conflict") > published.conflicts {
        println!(
            "  (a conflicting resend that arrived first was booked; the original's copies are the conflicts: the first payload seen for a key wins)"
        );
    }
    println!();
    println!(
        "ledger rows for this run: {booked} for {} orders, {doubled} orders booked twice",
        published.orders
    );
    println!(
        "dead letters wait in {} (rabbitmqctl list_queues name messages)",
        idem::topology::dlq_name(QUEUE)
    );
    anyhow::ensure!(doubled == 0, "an order was booked twice");
    Ok(())
}
