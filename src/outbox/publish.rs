//! Publishing taken outbox rows: an operation's messages one after another, each
//! confirmed before the next (so a failure leaves the rest unpublished and the order
//! holds), different operations side by side on the same confirming channel.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::future::join_all;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};
use serde_json::Value;
use sqlx::PgPool;
use tracing::warn;

use super::table::{self, Deferral, OutboxRow};
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
    /// Rows given back for later: an earlier message of their operation was not
    /// published, or the channel closed before their turn.
    pub(crate) waiting: usize,
}

/// Publishes rows a publisher took, in order per operation, and records the failures
/// and the rows that must wait (best effort: a row whose record fails stays taken until
/// its lease ends); the confirmed ones are the caller's to mark with
/// [`mark_dispatched`], whatever else failed. `check` asks the table whether an
/// operation's earlier messages are held elsewhere, for rows that do not start their
/// operation's sequence.
pub(crate) async fn publish(
    pool: &PgPool,
    channel: &Channel,
    rows: Vec<OutboxRow>,
    check: bool,
    config: &OutboxConfig,
) -> Published {
    let mut done = Published::default();
    if rows.is_empty() {
        return done;
    }
    let (ready, mut waiting) = match in_order(pool, rows, check).await {
        Ok(sorted) => sorted,
        Err(error) => {
            warn!(error = %crate::text::error_line(&error), "follow-ups: cannot check their order; left for later");
            return done;
        }
    };
    // One deadline for the round, half the lease: every publish of it is confirmed or
    // given up before another publisher may take the rows.
    let deadline = tokio::time::Instant::now() + config.confirm_wait();
    let sequences = ready
        .into_values()
        .map(|rows| publish_sequence(channel, rows, deadline));
    let mut failed = Vec::new();
    for outcome in join_all(sequences).await {
        done.ids.extend(outcome.published);
        match outcome.stopped {
            Stopped::Done => {}
            Stopped::Failed { row, why, rest } => {
                let attempts = row.attempts + 1;
                warn!(message_id = %row.message_id, attempts, error = %why, "follow-up not published; it stays in the outbox");
                metrics::outbox_failed();
                let until = None;
                let after = super::backoff(attempts).max(WAIT_FOR_EARLIER);
                waiting.extend(rest.into_iter().map(|r| (deferral(&r, until), after)));
                failed.push((row, why));
            }
            Stopped::ChannelClosed { rest } => {
                waiting.extend(
                    rest.into_iter()
                        .map(|r| (deferral(&r, None), WAIT_FOR_EARLIER)),
                );
            }
        }
    }
    done.failed = failed.len();
    done.waiting = waiting.len();
    for (row, why) in &failed {
        if let Err(error) = table::mark_failed(pool, row, why).await {
            warn!(error = %crate::text::error_line(&error), "follow-ups: cannot record a failed publish");
        }
    }
    let mut by_delay: BTreeMap<Duration, Vec<Deferral>> = BTreeMap::new();
    for (row, after) in waiting {
        by_delay.entry(after).or_default().push(row);
    }
    for (after, rows) in by_delay {
        if let Err(error) = table::defer(pool, &rows, after).await {
            warn!(error = %crate::text::error_line(&error), "follow-ups: cannot give rows back");
        }
    }
    done
}

fn deferral(row: &OutboxRow, until: Option<DateTime<Utc>>) -> Deferral {
    Deferral {
        id: row.id,
        take_token: row.take_token,
        until,
    }
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

/// The rows grouped by operation in staging order, and the rows that must wait because
/// an earlier message of their operation is neither dispatched nor here.
async fn in_order(pool: &PgPool, rows: Vec<OutboxRow>, check: bool) -> Result<Sorted, StoreError> {
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
    for (source, first, failing_until) in table::first_waiting(pool, &unsure, &held).await? {
        if let Some(rows) = by_source.get_mut(&source) {
            let (ready, wait): (Vec<_>, Vec<_>) =
                rows.drain(..).partition(|row| row.position < first);
            // Behind a message in backoff: due with it, so that rows waiting behind
            // failures never fill a relay's batches. Behind one another publisher
            // holds: soon (it is usually published within milliseconds).
            waiting.extend(
                wait.iter()
                    .map(|row| (deferral(row, failing_until), WAIT_FOR_EARLIER)),
            );
            *rows = ready;
        }
    }
    by_source.retain(|_, rows| !rows.is_empty());
    Ok((by_source, waiting))
}

/// Rows to publish per operation, and rows to give back with their earliest delay.
type Sorted = (BTreeMap<String, Vec<OutboxRow>>, Vec<(Deferral, Duration)>);

/// What became of one operation's rows.
struct Sequence {
    published: Vec<i64>,
    stopped: Stopped,
}

/// Why a sequence stopped.
enum Stopped {
    /// Every row was published.
    Done,
    /// The broker did not take `row`; `rest` were not tried.
    Failed {
        row: Box<OutboxRow>,
        why: String,
        rest: Vec<OutboxRow>,
    },
    /// The channel closed (another sequence's publish made the broker close it): `rest`
    /// were not tried, and it is no failure of theirs.
    ChannelClosed { rest: Vec<OutboxRow> },
}

async fn publish_sequence(
    channel: &Channel,
    rows: Vec<OutboxRow>,
    deadline: tokio::time::Instant,
) -> Sequence {
    let mut published = Vec::new();
    let mut rows = rows.into_iter();
    while let Some(row) = rows.next() {
        if !channel.status().connected() {
            let rest = std::iter::once(row).chain(rows).collect();
            return Sequence {
                published,
                stopped: Stopped::ChannelClosed { rest },
            };
        }
        if let Err(why) = publish_one(channel, &row, deadline).await {
            let rest = rows.collect();
            return Sequence {
                published,
                stopped: Stopped::Failed {
                    row: Box::new(row),
                    why,
                    rest,
                },
            };
        }
        published.push(row.id);
    }
    Sequence {
        published,
        stopped: Stopped::Done,
    }
}

/// Publishes one row (persistent, `mandatory`) and waits for the confirm until
/// `deadline`; the error says why the broker did not take it.
async fn publish_one(
    channel: &Channel,
    row: &OutboxRow,
    deadline: tokio::time::Instant,
) -> Result<(), String> {
    let properties = properties(&row.message_id, &row.properties)?;
    let exchange = short(&row.exchange, "exchange")?;
    let routing_key = short(&row.routing_key, "routing key")?;
    let publishing = async {
        channel
            .basic_publish(
                exchange,
                routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &row.body,
                properties,
            )
            .await?
            .await
    };
    let confirm = match tokio::time::timeout_at(deadline, publishing).await {
        Ok(Ok(confirm)) => confirm,
        Ok(Err(error)) => return Err(crate::text::error_line(&error)),
        Err(_) => return Err("not confirmed in time (half the lease)".into()),
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

/// An AMQP short string (at most 255 bytes), or why not: lapin panics on a longer one.
fn short(text: &str, what: &str) -> Result<ShortString, String> {
    if text.len() > super::SHORT_STRING_MAX {
        return Err(format!(
            "its {what} is {} bytes; AMQP allows {}",
            text.len(),
            super::SHORT_STRING_MAX
        ));
    }
    Ok(ShortString::from(text))
}

/// The AMQP properties of a staged message: persistent, with its derived id. Staging
/// checked the lengths; a row written otherwise fails here, never panics.
fn properties(message_id: &str, stored: &Properties) -> Result<BasicProperties, String> {
    let mut headers = FieldTable::default();
    for (name, value) in &stored.headers {
        headers.insert(short(name, "header name")?, header_value(value));
    }
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(short(message_id, "message id")?)
        .with_headers(headers);
    if let Some(content_type) = &stored.content_type {
        properties = properties.with_content_type(short(content_type, "content type")?);
    }
    if let Some(kind) = &stored.kind {
        properties = properties.with_type(short(kind, "type")?);
    }
    if let Some(correlation_id) = &stored.correlation_id {
        properties = properties.with_correlation_id(short(correlation_id, "correlation id")?);
    }
    Ok(properties)
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

    #[test]
    fn a_field_longer_than_amqp_allows_is_an_error_not_a_panic() {
        let long = "x".repeat(256);
        assert!(short(&"x".repeat(255), "exchange").is_ok());
        assert!(short(&long, "exchange").unwrap_err().contains("256 bytes"));
        let stored = Properties {
            correlation_id: Some(long.clone()),
            ..Properties::default()
        };
        assert!(properties("id", &stored).is_err());
        let stored = Properties {
            headers: [(long, Value::from(1))].into(),
            ..Properties::default()
        };
        assert!(properties("id", &stored).is_err());
    }
}
