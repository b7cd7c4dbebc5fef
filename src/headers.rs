//! The AMQP headers idem reads and writes: the names of its `idem-*` headers (the
//! contract of dead letters and retries, docs/DESIGN.md "Broker topology"), readers of
//! a message's headers, and the size of the header frame its properties make.
//!
//! Headers use the `idem-` prefix, never `x-`: RabbitMQ owns `x-` headers (since 3.13
//! it drops them from client publishes).

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

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

/// The longest `idem-error` a dead letter carries, in bytes: the error of a message
/// can be as long as the message (serde quotes the value it refused), and a header
/// frame larger than the connection's `frame_max` makes the broker close the
/// connection, so the dead letter would never leave.
pub const ERROR_MAX: usize = 1024;

/// How many of the producer's headers a dead letter or retry left behind because,
/// with them, its header frame would not fit the connection's `frame_max`
/// (`idem-dropped-headers`).
pub const DROPPED_HEADERS: &str = "idem-dropped-headers";

/// The source operation of a follow-up message: its key's short hash.
pub const SOURCE_KEY: &str = "idem-source-key";
/// The correlation id of a follow-up's source message, when it had one (its AMQP
/// `correlation_id` is the source's unless the handler set another).
pub const CORRELATION: &str = "idem-correlation-id";

/// A text header's value (a long or short string, or bytes read as UTF-8, lossily).
pub fn text(properties: &BasicProperties, name: &str) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::ByteArray(b) => Some(String::from_utf8_lossy(b.as_slice()).into_owned()),
        _ => None,
    }
}

/// An integer header's value, of whichever AMQP integer type it came as.
pub fn integer(properties: &BasicProperties, name: &str) -> Option<i64> {
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

/// The size in bytes of the content header frame that carries `properties`: the
/// frame's own 8 bytes, class, weight, body size and flags, and every property as AMQP
/// encodes it. The broker refuses a frame larger than the connection's `frame_max` by
/// closing the connection, so whatever idem publishes is measured first.
pub fn frame_len(properties: &BasicProperties) -> usize {
    const FIXED: usize = 8 + 2 + 2 + 8 + 2;
    let short = |s: &Option<ShortString>| s.as_ref().map_or(0, |s| 1 + s.as_str().len());
    let p = properties;
    FIXED
        + short(p.content_type())
        + short(p.content_encoding())
        + p.headers().as_ref().map_or(0, table_len)
        + p.delivery_mode().map_or(0, |_| 1)
        + p.priority().map_or(0, |_| 1)
        + short(p.correlation_id())
        + short(p.reply_to())
        + short(p.expiration())
        + short(p.message_id())
        + p.timestamp().map_or(0, |_| 8)
        + short(p.kind())
        + short(p.user_id())
        + short(p.app_id())
        + short(p.cluster_id())
}

fn table_len(table: &FieldTable) -> usize {
    4 + table
        .inner()
        .iter()
        .map(|(name, value)| 1 + name.as_str().len() + 1 + value_len(value))
        .sum::<usize>()
}

fn value_len(value: &AMQPValue) -> usize {
    match value {
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.len(),
        AMQPValue::ByteArray(b) => 4 + b.len(),
        AMQPValue::FieldArray(a) => {
            4 + a.as_slice().iter().map(|v| 1 + value_len(v)).sum::<usize>()
        }
        AMQPValue::FieldTable(t) => table_len(t),
        AMQPValue::Void => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::LongString;

    fn text(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s))
    }

    #[test]
    fn the_header_frame_is_measured_as_amqp_encodes_it() {
        let mut nested = FieldTable::default();
        nested.insert("n".into(), AMQPValue::Boolean(true));
        let mut headers = FieldTable::default();
        headers.insert("s".into(), text("value"));
        headers.insert("i".into(), AMQPValue::LongLongInt(7));
        headers.insert("short".into(), AMQPValue::ShortString("x".into()));
        headers.insert("t".into(), AMQPValue::FieldTable(nested));
        headers.insert(
            "a".into(),
            AMQPValue::FieldArray(vec![AMQPValue::LongInt(1), text("two")].into()),
        );
        headers.insert("b".into(), AMQPValue::ByteArray(vec![1, 2, 3].into()));
        headers.insert("d".into(), AMQPValue::Double(1.5));
        headers.insert("u".into(), AMQPValue::ShortUInt(2));
        headers.insert("v".into(), AMQPValue::Void);
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_message_id("m-1".into())
            .with_correlation_id("c-1".into())
            .with_delivery_mode(2)
            .with_timestamp(1)
            .with_type("order.created".into())
            .with_headers(headers);
        let encoded = lapin::protocol::basic::gen_properties(&properties)(Vec::new().into())
            .unwrap()
            .write
            .len();
        // The frame (8), class and weight (4) and body size (8) around what gen writes.
        assert_eq!(frame_len(&properties), 8 + 4 + 8 + encoded);
        let empty = BasicProperties::default();
        let encoded = lapin::protocol::basic::gen_properties(&empty)(Vec::new().into())
            .unwrap()
            .write
            .len();
        assert_eq!(frame_len(&empty), 8 + 4 + 8 + encoded);
    }
}
