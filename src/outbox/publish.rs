//! Publishing taken outbox rows: an operation's messages one after another, each
//! confirmed before the next (so a failure leaves the rest unpublished and the order
//! holds), different operations side by side on the same confirming channel.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::future::join_all;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};
use serde_json::Value;
use sqlx::PgPool;
use tracing::warn;

use super::table::{self, OutboxRow};
use super::{OutboxConfig, Properties};
use crate::metrics;
use crate::store::StoreError;

/// How long a row that waits for an earlier message of its operation (held by another
/// publisher) stays untaken before a relay looks at it again.
const WAIT_FOR_EARLIER: Duration = Duration::from_millis(100);
/// What one round of publishing did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Published {
    /// Rows the broker confirmed, to mark dispatched.
    pub(crate) ids: Vec<i64>,
    /// Rows whose publish failed (recorded with their error and backoff).
    pub(crate) failed: usize,
    /// Rows left for later: an earlier message of their operation was not published.
    pub(crate) waiting: usize,
}

/// Publishes rows a publisher took, in order per operation, and records the failures
/// and the rows that must wait; the confirmed ones are the caller's to mark with
/// [`mark_dispatched`]. `check` asks the table whether an operation's earlier messages
/// are held elsewhere, for rows that do not start their operation's sequence.
pub(crate) async fn publish(
    pool: &PgPool,
    channel: &Channel,
    rows: Vec<OutboxRow>,
    check: bool,
    config: &OutboxConfig,
) -> Result<Published, StoreError> {
    let mut done = Published::default();
    if rows.is_empty() {
        return Ok(done);
    }
    let (ready, waiting) = in_order(pool, rows, check).await?;
    if !waiting.is_empty() {
        done.waiting = waiting.len();
        table::defer(pool, &waiting, WAIT_FOR_EARLIER).await?;
    }
    let sequences = ready
        .into_values()
        .map(|rows| publish_sequence(channel, rows, config));
    for outcome in join_all(sequences).await {
        done.ids.extend(outcome.published);
        if let Some((row, why, rest)) = outcome.failed {
            done.failed += 1;
            warn!(message_id = %row.message_id, attempts = row.attempts, error = %why, "follow-up not published; it stays in the outbox");
            metrics::outbox_failed();
            table::mark_failed(pool, &row, &why).await?;
            if !rest.is_empty() {
                let after = super::backoff(row.attempts).max(WAIT_FOR_EARLIER);
                table::defer(pool, &rest, after).await?;
            }
        }
    }
    Ok(done)
}

/// Marks confirmed rows dispatched (they expire after `retention`). A crash before this
/// leaves them taken: when the lease ends, they are published again, with the same id.
pub(crate) async fn mark_dispatched(
    pool: &PgPool,
    ids: &[i64],
    retention: Duration,
) -> Result<(), StoreError> {
    if ids.is_empty() {
        return Ok(());
    }
    crate::failpoint::hit("before-dispatch-mark");
    table::mark_dispatched(pool, ids, retention).await?;
    metrics::outbox_published(ids.len() as u64);
    Ok(())
}

/// The rows grouped by operation in staging order, and the ids of rows that must wait
/// because an earlier message of their operation is neither dispatched nor here.
async fn in_order(
    pool: &PgPool,
    rows: Vec<OutboxRow>,
    check: bool,
) -> Result<(BTreeMap<String, Vec<OutboxRow>>, Vec<i64>), StoreError> {
    let mut by_source: BTreeMap<String, Vec<OutboxRow>> = BTreeMap::new();
    for row in rows {
        by_source.entry(row.source.clone()).or_default().push(row);
    }
    for rows in by_source.values_mut() {
        rows.sort_by_key(|row| row.position);
    }
    // A sequence that starts at position 0 and has no gap has nothing before it.
    let unsure: Vec<String> = by_source
        .iter()
        .filter(|(_, rows)| {
            check
                || rows
                    .iter()
                    .enumerate()
                    .any(|(i, row)| row.position != i as i32)
        })
        .map(|(source, _)| source.clone())
        .collect();
    let mut waiting = Vec::new();
    if unsure.is_empty() {
        return Ok((by_source, waiting));
    }
    let held: Vec<i64> = by_source.values().flatten().map(|row| row.id).collect();
    for (source, first) in table::first_waiting(pool, &unsure, &held).await? {
        if let Some(rows) = by_source.get_mut(&source) {
            let (ready, wait): (Vec<_>, Vec<_>) =
                rows.drain(..).partition(|row| row.position < first);
            waiting.extend(wait.iter().map(|row| row.id));
            *rows = ready;
        }
    }
    by_source.retain(|_, rows| !rows.is_empty());
    Ok((by_source, waiting))
}

/// What became of one operation's rows.
struct Sequence {
    published: Vec<i64>,
    /// The row that failed, why, and the ids after it that were not tried.
    failed: Option<(OutboxRow, String, Vec<i64>)>,
}

async fn publish_sequence(
    channel: &Channel,
    rows: Vec<OutboxRow>,
    config: &OutboxConfig,
) -> Sequence {
    let mut published = Vec::new();
    let mut rows = rows.into_iter();
    while let Some(row) = rows.next() {
        if let Err(why) = publish_one(channel, &row, config.confirm_timeout).await {
            let rest = rows.map(|row| row.id).collect();
            return Sequence {
                published,
                failed: Some((row, why, rest)),
            };
        }
        published.push(row.id);
    }
    Sequence {
        published,
        failed: None,
    }
}

/// Publishes one row (persistent, `mandatory`) and waits for the confirm; the error
/// says why the broker did not take it.
async fn publish_one(channel: &Channel, row: &OutboxRow, timeout: Duration) -> Result<(), String> {
    let publishing = async {
        channel
            .basic_publish(
                row.exchange.as_str().into(),
                row.routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &row.body,
                properties(&row.message_id, &row.properties),
            )
            .await?
            .await
    };
    let confirm = match tokio::time::timeout(timeout, publishing).await {
        Ok(Ok(confirm)) => confirm,
        Ok(Err(error)) => return Err(crate::error_line(&error)),
        Err(_) => return Err(format!("not confirmed within {} ms", timeout.as_millis())),
    };
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(returned)) => Err(format!(
            "returned by the broker: {} {} (exchange {:?}, routing key {:?})",
            returned.reply_code, returned.reply_text, row.exchange, row.routing_key
        )),
        Confirmation::Nack(_) => Err("nacked by the broker".into()),
        Confirmation::NotRequested => Err("publisher confirms are off".into()),
    }
}

/// The AMQP properties of a staged message: persistent, with its derived id.
fn properties(message_id: &str, stored: &Properties) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (name, value) in &stored.headers {
        headers.insert(ShortString::from(name.as_str()), header_value(value));
    }
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(message_id.into())
        .with_headers(headers);
    if let Some(content_type) = &stored.content_type {
        properties = properties.with_content_type(content_type.as_str().into());
    }
    if let Some(kind) = &stored.kind {
        properties = properties.with_type(kind.as_str().into());
    }
    if let Some(correlation_id) = &stored.correlation_id {
        properties = properties.with_correlation_id(correlation_id.as_str().into());
    }
    properties
}

fn header_value(value: &Value) -> AMQPValue {
    match value {
        Value::String(s) => AMQPValue::LongString(LongString::from(s.as_str())),
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or(0.0)),
        },
        other => AMQPValue::LongString(LongString::from(other.to_string().as_str())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_keep_their_json_types() {
        assert_eq!(
            header_value(&Value::from("acme")),
            AMQPValue::LongString("acme".into())
        );
        assert_eq!(header_value(&Value::from(7)), AMQPValue::LongLongInt(7));
        assert_eq!(header_value(&Value::from(true)), AMQPValue::Boolean(true));
        assert_eq!(header_value(&Value::from(0.5)), AMQPValue::Double(0.5));
        assert_eq!(
            header_value(&serde_json::json!({"a": 1})),
            AMQPValue::LongString(r#"{"a":1}"#.into())
        );
    }
}
