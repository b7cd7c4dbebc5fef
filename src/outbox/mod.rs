//! Follow-up messages through a transactional outbox (docs/DESIGN.md, "Follow-up
//! messages").
//!
//! A handler stages a [`FollowUp`] with [`crate::Context::publish`]: the message is
//! written to `outbox_messages` in the context's transaction, so it exists only if the
//! operation's outcome commits (a fenced-out zombie's messages roll back with it). Its
//! id is derived from the operation's key and its position among the operation's
//! messages ([`message_id`]) and is the AMQP `message_id` of every publish, so a
//! downstream idem consumer recognises a copy published twice.
//!
//! After the commit the worker publishes the operation's messages at once (persistent,
//! `mandatory`, publisher confirms), in staging order, and marks them dispatched. A
//! [`Relay`] in every worker process publishes what a crash or a failed publish left
//! behind: woken by the `NOTIFY` of the committing transaction, polling as the safety
//! net, taking rows with `FOR UPDATE SKIP LOCKED` under a lease so that two processes
//! never publish a row at the same moment. A message the broker returns (unroutable)
//! stays in the table with the broker's reason and is tried again with backoff.
//!
//! - `table`: the statements on `outbox_messages`;
//! - `publish`: publishing taken rows, in order, on a confirming channel;
//! - `relay`: the background loop.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::key::Key;

mod publish;
mod relay;
mod table;

pub(crate) use publish::{mark_dispatched, publish};
pub use relay::Relay;
pub use table::{OutboxEntry, OutboxStats, dispatched, list, scheduled, stats};
pub(crate) use table::{OutboxRow, stage, take_staged};

/// The longest AMQP short string, in bytes: exchange, routing key, header names,
/// `content_type`, `type`, `correlation_id`.
pub const SHORT_STRING_MAX: usize = 255;

/// The most a follow-up's headers may hold (names and values, as JSON): its header
/// frame must fit the relay's connection (`frame_max`, 128 KiB on RabbitMQ's default;
/// a larger frame makes the broker close the connection, and the message would never
/// leave), with room for the trace context and idem's own headers.
pub const HEADERS_MAX: usize = 64 * 1024;

/// Why [`crate::Context::publish`] did not stage a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FollowUpError {
    /// The message cannot be published as it is (a field longer than AMQP allows): the
    /// handler's fault, a permanent failure of the run.
    #[error("follow-up refused: {0}")]
    Invalid(String),
    /// Writing it to the outbox failed.
    #[error("follow-up not staged")]
    Database(#[from] sqlx::Error),
}

/// A message a handler publishes after its operation commits.
///
/// ```
/// use idem::outbox::FollowUp;
///
/// let booked = serde_json::json!({"order_id": "o-1"});
/// let message = FollowUp::json("", "orders.booked", &booked)
///     .unwrap()
///     .header("tenant", "acme");
/// assert_eq!(message.routing_key(), "orders.booked");
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct FollowUp {
    exchange: String,
    routing_key: String,
    body: Vec<u8>,
    pub(crate) properties: Properties,
    pub(crate) not_before: Option<NotBefore>,
}

/// When a delayed follow-up may be published at the earliest.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum NotBefore {
    /// At this time.
    At(DateTime<Utc>),
    /// This long after it was staged (by the database's clock).
    After(Duration),
}

/// The AMQP properties a follow-up keeps, as stored in the outbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Properties {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) content_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "type")]
    pub(crate) kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) correlation_id: Option<String>,
    /// Strings, integers, floats and booleans; anything else travels as its JSON text.
    #[serde(default)]
    pub(crate) headers: BTreeMap<String, Value>,
}

impl FollowUp {
    /// `body` to `routing_key` on `exchange` (`""` is the default exchange, where the
    /// routing key names the queue).
    pub fn new(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        body: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            body: body.into(),
            properties: Properties::default(),
            not_before: None,
        }
    }

    /// `body` straight to `queue`, through the default exchange.
    pub fn to_queue(queue: impl Into<String>, body: impl Into<Vec<u8>>) -> Self {
        Self::new("", queue, body)
    }

    /// `value` as JSON (`content_type` `application/json`) to `routing_key` on
    /// `exchange`.
    pub fn json<T: Serialize + ?Sized>(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        let body = serde_json::to_vec(value)?;
        Ok(Self::new(exchange, routing_key, body).content_type("application/json"))
    }

    /// Sets the AMQP `content_type`.
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.properties.content_type = Some(content_type.into());
        self
    }

    /// Sets the AMQP `type`.
    pub fn kind(mut self, kind: impl Into<String>) -> Self {
        self.properties.kind = Some(kind.into());
        self
    }

    /// Sets the AMQP `correlation_id` (by default, the source message's).
    pub fn correlation_id(mut self, correlation_id: impl Into<String>) -> Self {
        self.properties.correlation_id = Some(correlation_id.into());
        self
    }

    /// Adds a header: a string, integer, float or boolean travels as that AMQP type,
    /// anything else as its JSON text.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        self.properties.headers.insert(name.into(), value.into());
        self
    }

    /// Publishes it not before `at`: it is staged with the operation as any follow-up
    /// (and rolled back with a failed run), survives restarts in the outbox, and a relay
    /// publishes it once it is due ("cancel the reservation if unpaid by 18:00"). It does
    /// not hold back the operation's later follow-ups.
    pub fn not_before(mut self, at: DateTime<Utc>) -> Self {
        self.not_before = Some(NotBefore::At(at));
        self
    }

    /// Publishes it not before `delay` after it was staged, by the database's clock
    /// ("send the reminder in 24 h"), as [`FollowUp::not_before`] does.
    pub fn delayed(mut self, delay: Duration) -> Self {
        self.not_before = Some(NotBefore::After(delay));
        self
    }

    /// The exchange.
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The routing key.
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The message with its body sealed by `keys`, as the outbox keeps it.
    pub(crate) fn sealed(mut self, keys: Option<&crate::protect::Keys>) -> Self {
        if keys.is_some() {
            self.body = crate::protect::seal_body(keys, &self.body);
        }
        self
    }

    /// Whether it can be published: every AMQP short string within
    /// [`SHORT_STRING_MAX`] bytes and without a NUL, and its headers within
    /// [`HEADERS_MAX`] bytes (as JSON).
    pub fn check(&self) -> Result<(), FollowUpError> {
        let p = &self.properties;
        let headers: usize = p
            .headers
            .iter()
            .map(|(name, value)| name.len() + value.to_string().len())
            .sum();
        if headers > HEADERS_MAX {
            return Err(FollowUpError::Invalid(format!(
                "its headers are {headers} bytes; at most {HEADERS_MAX}"
            )));
        }
        let fields = [
            ("exchange", Some(self.exchange.as_str())),
            ("routing key", Some(self.routing_key.as_str())),
            ("content type", p.content_type.as_deref()),
            ("type", p.kind.as_deref()),
            ("correlation id", p.correlation_id.as_deref()),
        ]
        .into_iter()
        .chain(
            p.headers
                .keys()
                .map(|name| ("header name", Some(name.as_str()))),
        );
        for (what, text) in fields.filter_map(|(what, text)| Some((what, text?))) {
            if text.len() > SHORT_STRING_MAX {
                return Err(FollowUpError::Invalid(format!(
                    "its {what} is {} bytes; AMQP allows {SHORT_STRING_MAX}",
                    text.len()
                )));
            }
            // Postgres text cannot hold a NUL (it would be stored as U+FFFD, three
            // bytes, and no longer be what the handler asked for).
            if text.contains('\0') {
                return Err(FollowUpError::Invalid(format!("its {what} holds a NUL")));
            }
        }
        Ok(())
    }
}

/// The id of the message at `position` (from 0) among those the operation with `key`
/// stages: the same on every run of the operation, after a takeover too, and different
/// for every other key or position. A UUID (version 8, from SHA-256), so it fits where
/// downstream systems expect one.
pub fn message_id(key: &Key, position: u32) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"idem-follow-up\0");
    hasher.update(key.digest().as_bytes());
    hasher.update(position.to_be_bytes());
    let digest = hasher.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes)
        .into_uuid()
        .to_string()
}

/// How the outbox is dispatched and relayed.
#[derive(Debug, Clone)]
pub struct OutboxConfig {
    /// Run a relay in this worker process (every process should, so that nothing a
    /// crash leaves behind waits for a particular one to come back).
    pub relay: bool,
    /// How often the relay looks for messages without being woken (the safety net
    /// behind `NOTIFY`).
    pub poll: Duration,
    /// How long a publisher owns the rows it took: after that, another may publish them
    /// again (a copy with the same id).
    pub lease: Duration,
    /// How long after staging the committing worker has the rows to itself, before a
    /// relay woken by the commit takes them.
    pub handoff: Duration,
    /// Most rows a relay takes at once.
    pub batch: i64,
    /// How long a publish may wait for the broker's confirm before it counts as failed;
    /// at most half the lease is used, so that no publisher still waits for a confirm
    /// when another may take the row.
    pub confirm_timeout: Duration,
}

impl OutboxConfig {
    /// The confirm timeout in use: `confirm_timeout`, at most half of `lease`.
    pub fn confirm_wait(&self) -> Duration {
        self.confirm_timeout.min(self.lease / 2)
    }
}

impl Default for OutboxConfig {
    fn default() -> Self {
        Self {
            relay: true,
            poll: Duration::from_secs(2),
            lease: Duration::from_secs(30),
            handoff: Duration::from_millis(50),
            batch: 100,
            confirm_timeout: Duration::from_secs(10),
        }
    }
}

/// When a row whose publish failed `attempts` times may be tried again: at once after
/// the first failure (a relay on another connection may succeed), then 1 s doubling to
/// at most 5 minutes (300 s).
pub(crate) fn backoff(attempts: i32) -> Duration {
    match attempts {
        i32::MIN..=1 => Duration::ZERO,
        n => Duration::from_secs(1u64 << (n - 2).min(9) as u32).min(Duration::from_secs(300)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> Key {
        Key::new("acme", "orders.create", id).unwrap()
    }

    #[test]
    fn message_ids_follow_the_key_and_the_position() {
        let a0 = message_id(&key("evt-1"), 0);
        assert_eq!(a0, message_id(&key("evt-1"), 0), "stable");
        assert_ne!(a0, message_id(&key("evt-1"), 1));
        assert_ne!(a0, message_id(&key("evt-2"), 0));
        let uuid = uuid::Uuid::parse_str(&a0).unwrap();
        assert_eq!(uuid.get_version_num(), 8);
    }

    #[test]
    fn a_field_longer_than_amqp_allows_is_refused_at_staging() {
        let ok = FollowUp::to_queue("q", "body").header("h", "v");
        assert!(ok.check().is_ok());
        let long = "x".repeat(SHORT_STRING_MAX + 1);
        for message in [
            FollowUp::to_queue(long.as_str(), "body"),
            FollowUp::new(long.as_str(), "q", "body"),
            ok.clone().header(long.as_str(), 1),
            ok.clone().correlation_id(long.as_str()),
            ok.clone().content_type(long.as_str()),
            ok.clone().kind(long.as_str()),
        ] {
            let refused = message.check().unwrap_err().to_string();
            assert!(refused.contains("256 bytes"), "{refused}");
        }
        let nul = FollowUp::to_queue("q\0", "body").check().unwrap_err();
        assert!(nul.to_string().contains("routing key holds a NUL"), "{nul}");
        // Headers that would not fit the relay's frame.
        let big = ok.clone().header("big", "x".repeat(HEADERS_MAX));
        let refused = big.check().unwrap_err().to_string();
        assert!(
            refused.contains("headers are") && refused.contains("at most 65536"),
            "{refused}"
        );
    }

    #[test]
    fn the_confirm_wait_is_at_most_half_the_lease() {
        let config = OutboxConfig {
            lease: Duration::from_secs(2),
            ..OutboxConfig::default()
        };
        assert_eq!(config.confirm_wait(), Duration::from_secs(1));
        assert_eq!(
            OutboxConfig::default().confirm_wait(),
            Duration::from_secs(10)
        );
    }

    #[test]
    fn backoff_starts_at_once_then_doubles_to_five_minutes() {
        assert_eq!(backoff(1), Duration::ZERO);
        assert_eq!(backoff(2), Duration::from_secs(1));
        assert_eq!(backoff(3), Duration::from_secs(2));
        assert_eq!(backoff(10), Duration::from_secs(256));
        assert_eq!(backoff(40), Duration::from_secs(300));
    }
}
