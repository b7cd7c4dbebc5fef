//! Dead letters as a DLQ holds them: what each says about itself, which ones a command
//! selects, reading them without removing any, and their groups.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use lapin::message::Delivery;
use lapin::options::BasicGetOptions;
use lapin::{Channel, Connection};
use serde::Serialize;

use super::{HOLD_MAX, ReplayError};
use crate::headers;
use crate::key::Key;
use crate::topology;

/// One dead letter with what its headers say.
#[derive(Debug)]
pub struct DlqMessage {
    /// The delivery (body, properties; unacked while held).
    pub delivery: Delivery,
    /// `idem-reason`.
    pub reason: Option<String>,
    /// `idem-error`.
    pub error: Option<String>,
    /// `idem-operation`.
    pub operation: Option<String>,
    /// `idem-scope`.
    pub scope: Option<String>,
    /// `idem-key` (the idempotency key).
    pub key: Option<String>,
    /// `idem-key-hash` (as logs show it).
    pub key_hash: Option<String>,
    /// `idem-attempts`.
    pub attempts: Option<i64>,
    /// `idem-original-queue`.
    pub original_queue: Option<String>,
    /// `idem-failed-at`.
    pub failed_at: Option<DateTime<Utc>>,
}

impl DlqMessage {
    /// Reads a dead letter's `idem-*` headers.
    pub fn new(delivery: Delivery) -> Self {
        let p = &delivery.properties;
        let text = |name| headers::text(p, name);
        Self {
            reason: text(headers::REASON),
            error: text(headers::ERROR),
            operation: text(headers::OPERATION),
            scope: text(headers::SCOPE),
            key: text(headers::KEY),
            key_hash: text(headers::KEY_HASH),
            attempts: headers::integer(p, headers::ATTEMPTS),
            original_queue: text(headers::ORIGINAL_QUEUE),
            failed_at: text(headers::FAILED_AT)
                .and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
                .map(|t| t.with_timezone(&Utc)),
            delivery,
        }
    }

    /// The operation's key, when the message had a valid one.
    pub fn key(&self) -> Option<Key> {
        Key::new(
            self.scope.clone()?,
            self.operation.clone()?,
            self.key.clone()?,
        )
        .ok()
    }

    /// The body as text (lossy for bodies that are not UTF-8).
    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.delivery.data).into_owned()
    }

    /// The AMQP `type` the producer gave it, if any.
    pub fn message_type(&self) -> Option<&str> {
        self.delivery.properties.kind().as_ref().map(|t| t.as_str())
    }

    /// Its headers (the producer's and idem's), by name: text and numbers as they are,
    /// other values as AMQP describes them.
    pub fn headers(&self) -> BTreeMap<String, String> {
        use lapin::types::AMQPValue;
        let mut out = BTreeMap::new();
        for (name, value) in self
            .delivery
            .properties
            .headers()
            .iter()
            .flat_map(|h| h.inner())
        {
            let value = match value {
                AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                AMQPValue::ShortString(s) => s.to_string(),
                AMQPValue::LongLongInt(n) => n.to_string(),
                AMQPValue::LongInt(n) => n.to_string(),
                AMQPValue::ShortInt(n) => n.to_string(),
                AMQPValue::Boolean(b) => b.to_string(),
                other => format!("{other:?}"),
            };
            out.insert(name.to_string(), value);
        }
        out
    }
}

/// Which dead letters a command works on.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this `idem-reason`.
    pub reason: Option<String>,
    /// Only this key: the idempotency key, or (a prefix of at least 6 digits of) the
    /// key hash that logs show.
    pub key: Option<String>,
    /// At most this many matching messages.
    pub limit: Option<usize>,
    /// Only this `idem-operation` (a group of [`group`] is reason, operation, error;
    /// a missing header reads as in the group: `unknown`).
    pub operation: Option<String>,
    /// Only this `idem-error`, exactly (a missing header reads as empty).
    pub error: Option<String>,
    /// Only this `idem-scope`.
    pub scope: Option<String>,
}

impl Filter {
    /// Whether `m` passes the filter.
    pub fn matches(&self, m: &DlqMessage) -> bool {
        let (reason, operation, error) = group_key(m);
        let same = |wanted: &Option<String>, got: &str| wanted.as_deref().is_none_or(|w| w == got);
        let key = self.key.as_deref().is_none_or(|k| {
            m.key.as_deref() == Some(k)
                || (k.len() >= 6 && m.key_hash.as_deref().is_some_and(|h| h.starts_with(k)))
        });
        let scope = self
            .scope
            .as_deref()
            .is_none_or(|s| m.scope.as_deref() == Some(s));
        same(&self.reason, reason)
            && key
            && same(&self.operation, operation)
            && same(&self.error, error)
            && scope
    }
}

/// The DLQ of a work queue; a name already ending in `.dlq` is taken as is.
pub fn dlq_of(queue: &str) -> String {
    if queue.ends_with(".dlq") {
        queue.to_owned()
    } else {
        topology::dlq_name(queue)
    }
}

/// Most bytes of bodies [`peek`] returns: a DLQ's letters can be as large as any
/// message (128 MiB on RabbitMQ's default).
pub const PEEK_BYTES_MAX: usize = 64 << 20;

/// Reads up to `limit` dead letters that pass `filter` without removing any: they are
/// held unacked while read and requeued when the channel closes. At most [`HOLD_MAX`]
/// letters that do not pass are read past, and at most [`PEEK_BYTES_MAX`] bytes of
/// bodies are returned.
pub async fn peek(
    connection: &Connection,
    dlq: &str,
    filter: &Filter,
    limit: usize,
) -> Result<Vec<DlqMessage>, ReplayError> {
    let channel = connection.create_channel().await?;
    let mut out = Vec::new();
    let (mut passed_over, mut bytes) = (0, 0);
    let limit = filter.limit.unwrap_or(limit).min(limit);
    while out.len() < limit && passed_over < HOLD_MAX && bytes < PEEK_BYTES_MAX {
        let Some(message) = get(&channel, dlq).await? else {
            break;
        };
        let m = DlqMessage::new(message);
        if filter.matches(&m) {
            bytes += m.delivery.data.len();
            out.push(m);
        } else {
            // Unacked on this channel until it closes; nothing to keep here.
            passed_over += 1;
        }
    }
    // Closing the channel requeues everything read.
    let _ = channel.close(200, "peek done".into()).await;
    Ok(out)
}

pub(super) async fn get(channel: &Channel, queue: &str) -> Result<Option<Delivery>, lapin::Error> {
    Ok(channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await?
        .map(|m| m.delivery))
}

/// Dead letters with the same reason, operation and error.
#[derive(Debug, Clone, Serialize)]
pub struct Group {
    /// `idem-reason`.
    pub reason: String,
    /// `idem-operation`.
    pub operation: String,
    /// `idem-error`.
    pub error: String,
    /// How many.
    pub count: usize,
    /// The oldest `idem-failed-at`.
    pub oldest: Option<DateTime<Utc>>,
    /// The newest `idem-failed-at`.
    pub newest: Option<DateTime<Utc>>,
}

/// Groups dead letters by reason, then operation and error text; largest groups first
/// within a reason.
pub fn group(messages: &[DlqMessage]) -> Vec<Group> {
    let mut groups: BTreeMap<(&str, &str, &str), Group> = BTreeMap::new();
    for m in messages {
        let (reason, operation, error) = group_key(m);
        let g = groups
            .entry((reason, operation, error))
            .or_insert_with(|| Group {
                reason: reason.to_owned(),
                operation: operation.to_owned(),
                error: error.to_owned(),
                count: 0,
                oldest: None,
                newest: None,
            });
        g.count += 1;
        if let Some(at) = m.failed_at {
            g.oldest = Some(g.oldest.map_or(at, |o| o.min(at)));
            g.newest = Some(g.newest.map_or(at, |n| n.max(at)));
        }
    }
    let mut out: Vec<Group> = groups.into_values().collect();
    out.sort_by(|a, b| a.reason.cmp(&b.reason).then(b.count.cmp(&a.count)));
    out
}

/// The group a dead letter belongs to: reason, operation and error, a missing header
/// read as `unknown` (reason, operation) or empty (error). [`group`] groups by it and
/// [`Filter`] selects by it.
pub fn group_key(m: &DlqMessage) -> (&str, &str, &str) {
    (
        m.reason.as_deref().unwrap_or("unknown"),
        m.operation.as_deref().unwrap_or("unknown"),
        m.error.as_deref().unwrap_or_default(),
    )
}
