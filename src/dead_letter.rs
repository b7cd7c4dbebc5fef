//! What idem republishes for a delivery: its dead letter or its retry, with the
//! original body and properties, the producer's headers it carries, and the `idem-*`
//! headers (see [`crate::headers`]) that say why; and a replay's copy of a dead letter.
//! Broker `x-` headers (e.g. `x-death`) are not carried over to a republished copy.

use std::fmt;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::headers::{
    ATTEMPTS, DROPPED_HEADERS, ERROR, ERROR_MAX, FAILED_AT, KEY, KEY_HASH, OPERATION,
    ORIGINAL_QUEUE, REASON, REPLAYS, RETRIES, SCOPE,
};
use crate::key::Key;

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Reason {
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
    /// No handler of the queue takes the message's type: the message may be fine, only
    /// its handler is missing. Replayable once one is deployed.
    Unroutable,
    /// Its sequence number was behind its entity's position (an operator skipped it, or
    /// a later one ran first after a skip): running it now would apply it out of order.
    SequencePassed,
    /// Another message of its entity holds or waits with the same sequence number: two
    /// events claim one place in the order (a producer's bug).
    SequenceConflict,
}

impl Reason {
    /// The header value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::Malformed => "malformed",
            Reason::FingerprintConflict => "fingerprint_conflict",
            Reason::PermanentFailure => "permanent_failure",
            Reason::RetriesExhausted => "retries_exhausted",
            Reason::Undecidable => "undecidable",
            Reason::Unroutable => "unroutable",
            Reason::SequencePassed => "sequence_passed",
            Reason::SequenceConflict => "sequence_conflict",
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
pub(crate) struct DeadLetter<'a> {
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

/// The `idem-*` headers a republished copy keeps: counters idem carries from hop to
/// hop, and what a follow-up message says about its source. Every other `idem-*`
/// header is a verdict only idem may give (a reason, a key, a queue), and an incoming
/// one is a producer's forgery: it is dropped, so that a dead letter's headers are
/// only ever idem's own.
const CARRIED_IDEM: [&str; 4] = [
    RETRIES,
    REPLAYS,
    crate::headers::SOURCE_KEY,
    crate::headers::CORRELATION,
];

/// What idem publishes on a delivery's behalf (a retry or a dead letter): the original
/// properties, the producer's headers they carry, and idem's own headers. A copy that
/// would not fit the connection's frame is sent without the producer's headers
/// ([`Outgoing::without_carried`]).
#[derive(Debug, Clone)]
pub(crate) struct Outgoing {
    original: BasicProperties,
    carried: FieldTable,
    own: FieldTable,
}

impl Outgoing {
    /// The properties with the producer's headers and idem's.
    pub(crate) fn properties(&self) -> BasicProperties {
        let mut headers = self.carried.clone();
        for (name, value) in self.own.inner() {
            headers.insert(name.clone(), value.clone());
        }
        self.original.clone().with_headers(headers)
    }

    /// The properties with idem's headers only, saying how many of the producer's
    /// were left behind; `error_max` bounds `idem-error` again (for a connection whose
    /// `frame_max` is near the protocol's minimum of 4,096 bytes).
    pub(crate) fn without_carried(&self, error_max: usize) -> BasicProperties {
        let mut own = self.own.clone();
        let dropped = i64::try_from(self.carried.inner().len()).unwrap_or(i64::MAX);
        own.insert(
            ShortString::from(DROPPED_HEADERS),
            AMQPValue::LongLongInt(dropped),
        );
        if let Some(AMQPValue::LongString(error)) = own.inner().get(ERROR).cloned() {
            let error = String::from_utf8_lossy(error.as_bytes()).into_owned();
            own.insert(ERROR.into(), text(&crate::text::cut(&error, error_max)));
        }
        self.original.clone().with_headers(own)
    }

    /// How many of the producer's headers travel with the copy.
    pub(crate) fn carried(&self) -> usize {
        self.carried.inner().len()
    }
}

/// A dead letter of `original`: its properties, the producer's headers (not the
/// broker's `x-` ones, nor forged `idem-*` verdicts), and the dead letter's `idem-*`
/// headers, `idem-error` cut to [`ERROR_MAX`] bytes.
pub(crate) fn dead_letter(original: &BasicProperties, dl: &DeadLetter<'_>) -> Outgoing {
    let mut own = FieldTable::default();
    let mut set = |name: &str, value: AMQPValue| {
        own.insert(ShortString::from(name), value);
    };
    set(REASON, text(dl.reason.as_str()));
    set(ERROR, text(&crate::text::cut(dl.error, ERROR_MAX)));
    if let Some(key) = dl.key {
        set(KEY, text(key.idempotency_key()));
        set(SCOPE, text(key.scope()));
        set(KEY_HASH, text(&key.short_hash()));
    }
    set(OPERATION, text(dl.operation));
    set(ATTEMPTS, AMQPValue::LongLongInt(dl.attempts));
    set(ORIGINAL_QUEUE, text(dl.original_queue));
    set(FAILED_AT, text(&chrono::Utc::now().to_rfc3339()));
    outgoing(original, own)
}

/// Delayed retry number `retries` (1-based) of `original`: its properties and headers
/// (as [`dead_letter`] carries them) and `idem-retries`.
pub(crate) fn retry(original: &BasicProperties, retries: i64) -> Outgoing {
    let mut own = FieldTable::default();
    own.insert(ShortString::from(RETRIES), AMQPValue::LongLongInt(retries));
    outgoing(original, own)
}

fn outgoing(original: &BasicProperties, own: FieldTable) -> Outgoing {
    Outgoing {
        original: original.clone().with_headers(FieldTable::default()),
        carried: carried_headers(original),
        own,
    }
}

/// The headers a republished copy keeps: all but the broker's `x-` headers and the
/// `idem-*` verdicts only idem may set.
pub(crate) fn carried_headers(original: &BasicProperties) -> FieldTable {
    let mut kept = FieldTable::default();
    for (name, value) in original.headers().iter().flat_map(|h| h.inner()) {
        let name_text = name.as_str();
        let forged = name_text.starts_with("idem-") && !CARRIED_IDEM.contains(&name_text);
        if !name_text.starts_with("x-") && !forged {
            kept.insert(name.clone(), value.clone());
        }
    }
    kept
}

/// The properties of a replayed dead letter: the original ones, without the broker's
/// `x-` headers and without idem's own (`idem-*`), so the replay starts with a fresh
/// retry budget and no stale verdict; but with `idem-replays` one more than the dead
/// letter had. The trace context (`traceparent`) is kept: the replay joins the trace.
pub(crate) fn replay_properties(dead_letter: &BasicProperties) -> BasicProperties {
    let replays = crate::headers::integer(dead_letter, REPLAYS)
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

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headers::{frame_len, integer as header_i64, text as header_str};

    #[test]
    fn dead_letter_keeps_properties_and_user_headers_drops_broker_headers() {
        let mut headers = FieldTable::default();
        headers.insert("trace".into(), text("t-1"));
        headers.insert("x-death".into(), AMQPValue::LongLongInt(3));
        let original = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_delivery_mode(2)
            .with_headers(headers);
        let props = dead_letter(
            &original,
            &DeadLetter {
                reason: Reason::PermanentFailure,
                error: "invalid amount",
                key: Some(&Key::new("acme", "orders.create", "evt-1").unwrap()),
                operation: "orders.create",
                attempts: 2,
                original_queue: "orders",
            },
        )
        .properties();
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
        let retried = retry(&props, 2).properties();
        assert_eq!(header_i64(&retried, RETRIES), Some(2));
        let replayed = replay_properties(&retried);
        assert_eq!(header_str(&replayed, "trace").as_deref(), Some("t-1"));
        assert!(header_str(&replayed, REASON).is_none());
        assert!(header_i64(&replayed, RETRIES).is_none());
        assert_eq!(replayed.message_id(), props.message_id());
    }

    #[test]
    fn forged_verdicts_are_not_carried_but_idem_counters_are() {
        let mut headers = FieldTable::default();
        for forged in [
            KEY,
            SCOPE,
            KEY_HASH,
            REASON,
            ERROR,
            ORIGINAL_QUEUE,
            "idem-anything",
        ] {
            headers.insert(forged.into(), text("victim"));
        }
        headers.insert(RETRIES.into(), AMQPValue::LongLongInt(1));
        headers.insert(REPLAYS.into(), AMQPValue::LongLongInt(2));
        headers.insert("app".into(), text("kept"));
        let original = BasicProperties::default().with_headers(headers);
        let carried = carried_headers(&original);
        let names: Vec<&str> = carried.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["app", REPLAYS, RETRIES]);
        // A malformed message (no valid key) keeps no forged key or scope.
        let props = dead_letter(
            &original,
            &DeadLetter {
                reason: Reason::Malformed,
                error: "body is not JSON",
                key: None,
                operation: "orders.create",
                attempts: 0,
                original_queue: "orders",
            },
        )
        .properties();
        assert_eq!(header_str(&props, KEY), None);
        assert_eq!(header_str(&props, SCOPE), None);
        assert_eq!(
            header_str(&props, ORIGINAL_QUEUE).as_deref(),
            Some("orders")
        );
        assert_eq!(header_str(&props, REASON).as_deref(), Some("malformed"));
    }

    #[test]
    fn an_error_is_cut_and_a_copy_too_large_leaves_the_producers_headers_behind() {
        let mut headers = FieldTable::default();
        headers.insert("big".into(), text(&"h".repeat(130_000)));
        headers.insert("small".into(), text("s"));
        let original = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_headers(headers);
        let error = format!("invalid type: string \"{}\"", "x".repeat(140_000));
        let copy = dead_letter(
            &original,
            &DeadLetter {
                reason: Reason::Malformed,
                error: &error,
                key: None,
                operation: "orders.create",
                attempts: 0,
                original_queue: "orders",
            },
        );
        let full = copy.properties();
        let said = header_str(&full, ERROR).unwrap();
        assert!(
            said.len() <= ERROR_MAX && said.ends_with(" bytes cut)"),
            "{}",
            said.len()
        );
        assert!(
            frame_len(&full) > 131_072,
            "the full copy is over the frame"
        );
        let without = copy.without_carried(ERROR_MAX);
        assert!(frame_len(&without) < 4_096);
        assert_eq!(header_i64(&without, DROPPED_HEADERS), Some(2));
        assert_eq!(header_str(&without, "big"), None);
        assert_eq!(header_str(&without, REASON).as_deref(), Some("malformed"));
        assert_eq!(without.message_id(), original.message_id());
        let smaller = copy.without_carried(128);
        assert!(header_str(&smaller, ERROR).unwrap().len() <= 128);
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
        let again = dead_letter(
            &first,
            &DeadLetter {
                reason: Reason::PermanentFailure,
                error: "still refused",
                key: None,
                operation: "orders.create",
                attempts: 2,
                original_queue: "orders",
            },
        )
        .properties();
        assert_eq!(header_i64(&replay_properties(&again), REPLAYS), Some(2));
    }
}
