//! Publishes orders the way a retrying producer does: some twice or more (new message
//! id, new `sent_at`, keys in another order), plus a few bad ones.
//!
//! Run with (an `orders_worker` consuming the same queue):
//!
//! ```sh
//! cargo run --example orders_producer -- --queue orders --orders 100
//! ```
//!
//! It prints what it published: orders, duplicate copies, conflicts, malformed and
//! invalid messages.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel};
use rand::Rng;
use serde_json::{Value, json};

/// What to publish.
#[derive(Debug, Clone, Parser)]
pub struct Plan {
    /// The queue to publish to (declared as a durable classic queue if missing).
    #[arg(long, default_value = "orders")]
    pub queue: String,
    /// Distinct orders (intents).
    #[arg(long, default_value_t = 20)]
    pub orders: usize,
    /// Most extra copies of one order; each order gets 0..=this many, at random.
    #[arg(long, default_value_t = 2)]
    pub max_duplicates: usize,
    /// Orders republished with the same event_id but another amount (conflicts).
    #[arg(long, default_value_t = 1)]
    pub conflicts: usize,
    /// Messages that are not valid orders (dead-lettered as malformed).
    #[arg(long, default_value_t = 1)]
    pub malformed: usize,
    /// Orders with a negative amount (a permanent failure).
    #[arg(long, default_value_t = 1)]
    pub invalid: usize,
    /// Tenants, comma separated; orders are spread over them.
    #[arg(long, value_delimiter = ',', default_value = "acme,globex")]
    pub tenants: Vec<String>,
    /// Prefix of event ids, so runs do not collide (default: a random one).
    #[arg(long)]
    pub run_id: Option<String>,
}

/// What was published.
#[derive(Debug, Clone, Default)]
pub struct Published {
    /// The prefix of this run's event ids.
    pub run_id: String,
    /// Messages published in all.
    pub messages: usize,
    /// Distinct valid orders (each should book exactly once).
    pub orders: usize,
    /// Extra copies of valid orders.
    pub duplicates: usize,
    /// Conflicting copies.
    pub conflicts: usize,
    /// Malformed messages.
    pub malformed: usize,
    /// Orders with a negative amount.
    pub invalid: usize,
}

/// One order's JSON with its keys in a random order and a fresh `sent_at`.
pub fn order_json(event_id: &str, tenant: &str, order_id: usize, amount_cents: i64) -> Vec<u8> {
    let mut fields = [
        ("event_id", json!(event_id)),
        ("tenant", json!(tenant)),
        ("order_id", json!(order_id)),
        ("amount_cents", json!(amount_cents)),
        ("sent_at", json!(chrono::Utc::now().to_rfc3339())),
    ];
    let mut rng = rand::rng();
    for i in (1..fields.len()).rev() {
        fields.swap(i, rng.random_range(0..=i));
    }
    // Written by hand to keep the shuffled order (serde_json's map would sort it).
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{}:{}", Value::from(*k), v))
        .collect();
    format!("{{{}}}", body.join(",")).into_bytes()
}

/// Publishes `body` persistently with a new message id, waiting for the confirm.
pub async fn publish(channel: &Channel, queue: &str, body: &[u8]) -> anyhow::Result<()> {
    let message_id = uuid::Uuid::new_v4().to_string();
    let mut headers = FieldTable::default();
    headers.insert(
        "producer".into(),
        AMQPValue::LongString(LongString::from("orders_producer")),
    );
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into())
                .with_message_id(message_id.as_str().into())
                .with_headers(headers),
        )
        .await?
        .await?;
    anyhow::ensure!(confirm.is_ack(), "publish to {queue} not confirmed");
    Ok(())
}

/// Publishes the plan's messages, duplicates interleaved at random.
pub async fn publish_orders(channel: &Channel, plan: &Plan) -> anyhow::Result<Published> {
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("classic")),
    );
    channel
        .queue_declare(
            plan.queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            args,
        )
        .await?;
    let run_id = plan
        .run_id
        .clone()
        .unwrap_or_else(|| format!("run-{}", &uuid::Uuid::new_v4().to_string()[..8]));
    let tenants = if plan.tenants.is_empty() {
        vec!["acme".to_string()]
    } else {
        plan.tenants.clone()
    };
    let mut rng = rand::rng();
    let mut out = Published {
        run_id: run_id.clone(),
        ..Published::default()
    };
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    for i in 0..plan.orders {
        let event_id = format!("{run_id}-evt-{i}");
        let tenant = &tenants[i % tenants.len()];
        let amount = 100 + i as i64;
        let copies = 1 + rng.random_range(0..=plan.max_duplicates);
        for _ in 0..copies {
            bodies.push(order_json(&event_id, tenant, i, amount));
        }
        out.orders += 1;
        out.duplicates += copies - 1;
        if i < plan.conflicts {
            bodies.push(order_json(&event_id, tenant, i, amount + 1));
            out.conflicts += 1;
        }
    }
    for i in 0..plan.invalid {
        let event_id = format!("{run_id}-invalid-{i}");
        bodies.push(order_json(&event_id, &tenants[0], i, -1));
        out.invalid += 1;
    }
    let malformed_kinds: [&[u8]; 4] = [
        b"not json at all",
        b"[1, 2, 3]",
        br#"{"tenant": "acme", "order_id": 1, "amount_cents": 5}"#,
        br#"{"event_id": 42, "tenant": "acme", "order_id": 1, "amount_cents": 5}"#,
    ];
    for i in 0..plan.malformed {
        bodies.push(malformed_kinds[i % malformed_kinds.len()].to_vec());
        out.malformed += 1;
    }
    // Interleave: a duplicate may arrive before, beside or after its original.
    for i in (1..bodies.len()).rev() {
        bodies.swap(i, rng.random_range(0..=i));
    }
    for body in &bodies {
        publish(channel, &plan.queue, body).await?;
        out.messages += 1;
    }
    Ok(out)
}

#[allow(dead_code)] // when included by the demo
#[tokio::main]
async fn main() -> ExitCode {
    let plan = Plan::parse();
    let url = std::env::var("AMQP_URL").unwrap_or_else(|_| idem::topology::DEFAULT_AMQP_URL.into());
    let result = async {
        let connection = idem::topology::connect(&url, "orders_producer")
            .await
            .context("connect to RabbitMQ")?;
        let channel = connection.create_channel().await?;
        let published = publish_orders(&channel, &plan).await?;
        let _ = connection.close(200, "done".into()).await;
        anyhow::Ok(published)
    }
    .await;
    match result {
        Ok(p) => {
            println!(
                "published {} messages to {}: {} orders (run {}), {} duplicate copies, {} conflicts, {} malformed, {} invalid",
                p.messages,
                plan.queue,
                p.orders,
                p.run_id,
                p.duplicates,
                p.conflicts,
                p.malformed,
                p.invalid
            );
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!(
                "orders_producer: error: {}",
                idem::text::error_line(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}
