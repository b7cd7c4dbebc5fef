//! Dead letters and retries: the `idem-*` headers they carry and the properties they keep.
//!
//! A dead-lettered or retried message keeps the original body and properties. Headers
//! use the `idem-` prefix, never `x-`: RabbitMQ owns `x-` headers (since 3.13 it drops
//! them from client publishes), and broker `x-` headers (e.g. `x-death`) are not
//! carried over to a republished copy.

use std::fmt;

use lapin::BasicProperties;

use crate::key::Key;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

/// Why the message was dead-lettered (`idem-reason`).
pub const REASON: &str = "idem-reason";
/// The error text (`idem-error`).
pub const ERROR: &str = "idem-error";
/// The idempotency key, when the message had a valid key (`idem-key`).
pub const KEY: &str = "idem-key";
/// The key's scope (`idem-scope`).
pub const SCOPE: &str = "idem-scope";
/// The key's short hash, as logs show it (`idem-key-hash`).
pub const KEY_HASH: &str = "idem-key-hash";
/// The record's claim count when dead-lettered (`idem-attempts`).
pub const ATTEMPTS: &str = "idem-attempts";
/// The work queue the message came from (`idem-original-queue`).
pub const ORIGINAL_QUEUE: &str = "idem-original-queue";
/// When it was dead-lettered, RFC 3339 (`idem-failed-at`).
pub const FAILED_AT: &str = "idem-failed-at";
/// The operation name, when known (`idem-operation`).
pub const OPERATION: &str = "idem-operation";
/// How many delayed retries the message went through (`idem-retries`).
pub const RETRIES: &str = "idem-retries";
/// How many times the message was replayed from a dead-letter queue (`idem-replays`):
/// set by a replay, kept through retries and dead letters, so a replay that fails
/// again is counted as such (`idem_replayed_deliveries_total`).
pub const REPLAYS: &str = "idem-replays";

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Not JSON, not an object, no valid key, or data the database refuses.
    Malformed,
    /// The key was already used with another payload.
    FingerprintConflict,
    /// The handler failed permanently.
    PermanentFailure,
    /// Transient failures outlasted every retry.
    RetriesExhausted,
    /// The delivery could not be decided many times in a row while the store decided
    /// others: an error nobody foresaw, stopped from looping forever. Replayable.
    Undecidable,
}

impl Reason {
    /// The header value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Malformed => "malformed",
            Reason::FingerprintConflict => "fingerprint_conflict",
            Reason::PermanentFailure => "permanent_failure",
            Reason::RetriesExhausted => "retries_exhausted",
            Reason::Undecidable => "undecidable",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a dead letter says about itself.
#[derive(Debug, Clone)]
pub struct DeadLetter<'a> {
    /// Why.
    pub reason: Reason,
    /// The error text.
    pub error: &'a str,
    /// The key, if the message had a valid one.
    pub key: Option<&'a Key>,
    /// The operation name of the handler.
    pub operation: &'a str,
    /// Claims made on the key (0 when none was made).
    pub attempts: i64,
    /// The work queue.
    pub original_queue: &'a str,
}

/// The original properties with the dead letter's `idem-*` headers set and broker `x-`
/// headers removed.
pub fn dead_letter_properties(original: &BasicProperties, dl: &DeadLetter<'_>) -> BasicProperties {
    let mut headers = carried_headers(original);
    let mut set = |name: &str, value: AMQPValue| {
        headers.insert(ShortString::from(name), value);
    };
    set(REASON, text(dl.reason.as_str()));
    set(ERROR, text(dl.error));
    if let Some(key) = dl.key {
        set(KEY, text(key.idempotency_key()));
        set(SCOPE, text(key.scope()));
        set(KEY_HASH, text(&key.short_hash()));
    }
    set(OPERATION, text(dl.operation));
    set(ATTEMPTS, AMQPValue::LongLongInt(dl.attempts));
    set(ORIGINAL_QUEUE, text(dl.original_queue));
    set(FAILED_AT, text(&chrono::Utc::now().to_rfc3339()));
    original.clone().with_headers(headers)
}

/// The original properties for delayed retry number `retries` (1-based).
pub fn retry_properties(original: &BasicProperties, retries: i64) -> BasicProperties {
    let mut headers = carried_headers(original);
    headers.insert(ShortString::from(RETRIES), AMQPValue::LongLongInt(retries));
    original.clone().with_headers(headers)
}

/// The headers a republished copy keeps: all but the broker's `x-` headers.
pub fn carried_headers(original: &BasicProperties) -> FieldTable {
    headers_without(original, &["x-"])
}

/// The properties of a replayed dead letter: the original ones, without the broker's
/// `x-` headers and without idem's own (`idem-*`), so the replay starts with a fresh
/// retry budget and no stale verdict; but with `idem-replays` one more than the dead
/// letter had. The trace context (`traceparent`) is kept: the replay joins the trace.
pub fn replay_properties(dead_letter: &BasicProperties) -> BasicProperties {
    let replays = header_i64(dead_letter, REPLAYS)
        .unwrap_or(0)
        .saturating_add(1);
    let mut headers = headers_without(dead_letter, &["x-", "idem-"]);
    headers.insert(ShortString::from(REPLAYS), AMQPValue::LongLongInt(replays));
    dead_letter.clone().with_headers(headers)
}

fn headers_without(original: &BasicProperties, prefixes: &[&str]) -> FieldTable {
    let mut kept = FieldTable::default();
    if let Some(headers) = original.headers() {
        for (name, value) in headers.inner() {
            if !prefixes.iter().any(|p| name.as_str().starts_with(p)) {
                kept.insert(name.clone(), value.clone());
            }
        }
    }
    kept
}

/// A string header's value.
pub fn header_str(properties: &BasicProperties, name: &str) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::ByteArray(b) => Some(String::from_utf8_lossy(b.as_slice()).into_owned()),
        _ => None,
    }
}

/// An integer header's value.
pub fn header_i64(properties: &BasicProperties, name: &str) -> Option<i64> {
    match properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongLongInt(i) => Some(*i),
        AMQPValue::LongInt(i) => Some(i64::from(*i)),
        AMQPValue::LongUInt(i) => Some(i64::from(*i)),
        AMQPValue::ShortInt(i) => Some(i64::from(*i)),
        AMQPValue::ShortUInt(i) => Some(i64::from(*i)),
        AMQPValue::ShortShortInt(i) => Some(i64::from(*i)),
        AMQPValue::ShortShortUInt(i) => Some(i64::from(*i)),
        _ => None,
    }
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letter_keeps_properties_and_user_headers_drops_broker_headers() {
        let mut headers = FieldTable::default();
        headers.insert("trace".into(), text("t-1"));
        headers.insert("x-death".into(), AMQPValue::LongLongInt(3));
        let original = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_delivery_mode(2)
            .with_headers(headers);
        let props = dead_letter_properties(
            &original,
            &DeadLetter {
                reason: Reason::PermanentFailure,
                error: "invalid amount",
                key: Some(&Key::new("acme", "orders.create", "evt-1").unwrap()),
                operation: "orders.create",
                attempts: 2,
                original_queue: "orders",
            },
        );
        assert_eq!(props.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert_eq!(*props.delivery_mode(), Some(2));
        assert_eq!(header_str(&props, "trace").as_deref(), Some("t-1"));
        assert_eq!(
            header_str(&props, REASON).as_deref(),
            Some("permanent_failure")
        );
        assert_eq!(header_str(&props, ERROR).as_deref(), Some("invalid amount"));
        assert_eq!(header_i64(&props, ATTEMPTS), Some(2));
        assert_eq!(
            header_str(&props, ORIGINAL_QUEUE).as_deref(),
            Some("orders")
        );
        assert!(header_str(&props, FAILED_AT).is_some());
        assert!(
            props
                .headers()
                .as_ref()
                .unwrap()
                .inner()
                .get("x-death")
                .is_none()
        );
        assert_eq!(header_str(&props, KEY).as_deref(), Some("evt-1"));
        assert_eq!(header_str(&props, SCOPE).as_deref(), Some("acme"));
        let retried = retry_properties(&props, 2);
        assert_eq!(header_i64(&retried, RETRIES), Some(2));
        let replayed = replay_properties(&retried);
        assert_eq!(header_str(&replayed, "trace").as_deref(), Some("t-1"));
        assert!(header_str(&replayed, REASON).is_none());
        assert!(header_i64(&replayed, RETRIES).is_none());
        assert_eq!(replayed.message_id(), props.message_id());
    }

    #[test]
    fn each_replay_counts_one_more_and_keeps_the_trace() {
        let mut headers = FieldTable::default();
        headers.insert("traceparent".into(), text("00-t"));
        headers.insert(REASON.into(), text("permanent_failure"));
        let dead = BasicProperties::default().with_headers(headers);
        let first = replay_properties(&dead);
        assert_eq!(header_i64(&first, REPLAYS), Some(1));
        assert_eq!(header_str(&first, REASON), None);
        assert_eq!(header_str(&first, "traceparent").as_deref(), Some("00-t"));
        // Dead-lettered again (the header travels with it), then replayed again.
        let again = dead_letter_properties(
            &first,
            &DeadLetter {
                reason: Reason::PermanentFailure,
                error: "still refused",
                key: None,
                operation: "orders.create",
                attempts: 2,
                original_queue: "orders",
            },
        );
        assert_eq!(header_i64(&replay_properties(&again), REPLAYS), Some(2));
    }
}
