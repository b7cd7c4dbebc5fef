//! Broker topology: the work queue, its retry queues and its dead-letter queue, and the
//! exchanges the work queue is bound to.

use std::time::Duration;

use lapin::options::{
    BasicPublishOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::uri::AMQPUri;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};

use tracing::warn;

use crate::retry::retry_queue_name;

/// The AMQP URL used when neither `AMQP_URL` nor a flag gives one.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// `AMQP_URL` from the environment, or [`DEFAULT_AMQP_URL`].
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| DEFAULT_AMQP_URL.into())
}

/// Classic or quorum queues (quorum: replicated, for clusters; needs RabbitMQ 3.8+).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    /// A classic durable queue.
    #[default]
    Classic,
    /// A quorum queue.
    Quorum,
}

impl QueueType {
    fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

/// The queues of one work queue: `<queue>`, `<queue>.retry.<delay>` for every retry
/// delay (TTL, dead-lettering back to `<queue>`), and `<queue>.dlq`; and the exchanges
/// `<queue>` consumes from.
#[derive(Debug, Clone, PartialEq)]
pub struct Topology {
    /// The work queue.
    pub queue: String,
    /// Classic or quorum, for every queue declared.
    pub queue_type: QueueType,
    /// One retry queue per delay.
    pub retry_delays: Vec<Duration>,
    /// The exchanges the work queue is bound to (none: producers publish to it through
    /// the default exchange, by its name).
    pub subscriptions: Vec<Subscription>,
    /// One consumer of the work queue at a time (`x-single-active-consumer`), the
    /// others standing by: see [`crate::WorkerConfig::single_active_consumer`].
    pub single_active_consumer: bool,
}

/// An exchange the work queue consumes from: declared durable if missing, and the queue
/// bound to it with each binding key. An exchange that exists with another type stops
/// the worker (406 PRECONDITION_FAILED, naming the exchange), as a queue declared with
/// other arguments does. Declaring is additive: a subscription removed from the
/// configuration leaves its binding on the broker until an operator unbinds it
/// (`rabbitmqctl` or the management UI).
#[derive(Debug, Clone, PartialEq)]
pub struct Subscription {
    /// The exchange's name.
    pub exchange: String,
    /// Its type: direct, fanout, topic or headers.
    pub kind: ExchangeKind,
    /// The binding keys (`order.*` on a topic exchange). None binds once with the empty
    /// key, which is what a fanout exchange needs.
    pub binding_keys: Vec<String>,
}

impl Subscription {
    /// A topic exchange, bound with these patterns (`order.*`, `#.eu`); no pattern binds
    /// once with the empty key, which matches only messages published with an empty
    /// routing key.
    pub fn topic(exchange: impl Into<String>, patterns: &[&str]) -> Self {
        Self::of(exchange, ExchangeKind::Topic, patterns)
    }

    /// A direct exchange, bound with these routing keys; none binds once with the empty
    /// key.
    pub fn direct(exchange: impl Into<String>, routing_keys: &[&str]) -> Self {
        Self::of(exchange, ExchangeKind::Direct, routing_keys)
    }

    /// A fanout exchange: every message published to it.
    pub fn fanout(exchange: impl Into<String>) -> Self {
        Self::of(exchange, ExchangeKind::Fanout, &[])
    }

    fn of(exchange: impl Into<String>, kind: ExchangeKind, keys: &[&str]) -> Self {
        Self {
            exchange: exchange.into(),
            kind,
            binding_keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        }
    }

    /// Declares the exchange (durable) and binds `queue` to it with each key.
    async fn declare(&self, channel: &Channel, queue: &str) -> Result<(), lapin::Error> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                self.exchange.as_str().into(),
                self.kind.clone(),
                durable,
                FieldTable::default(),
            )
            .await?;
        let empty = [String::new()];
        let keys = if self.binding_keys.is_empty() {
            &empty[..]
        } else {
            &self.binding_keys[..]
        };
        for key in keys {
            channel
                .queue_bind(
                    queue.into(),
                    self.exchange.as_str().into(),
                    key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        Ok(())
    }
}

impl Topology {
    /// The dead-letter queue's name.
    pub fn dlq(&self) -> String {
        dlq_name(&self.queue)
    }

    /// The retry queues' names, in the order of the delays.
    pub fn retry_queues(&self) -> Vec<String> {
        self.retry_delays
            .iter()
            .map(|d| retry_queue_name(&self.queue, *d))
            .collect()
    }

    /// Declares every queue, durable, on channels of `connection`, then the exchanges of
    /// [`Topology::subscriptions`] and the work queue's bindings to them. Idempotent:
    /// declaring again with the same settings changes nothing; a queue that exists with
    /// other settings fails with 406 PRECONDITION_FAILED, unless it is one an older idem
    /// declared (without the quorum arguments below), which is kept as it is and named
    /// in [`Declared::older`].
    ///
    /// Quorum queues get what makes them keep messages: the work queue and the DLQ an
    /// `x-delivery-limit` no delivery count reaches ([`DELIVERY_LIMIT`]; RabbitMQ 4
    /// otherwise drops a message after 20 requeues, and the worker requeues while
    /// Postgres is down, while a replay's `basic.get`s and the console's reads requeue
    /// dead letters), and the retry queues at-least-once dead-lettering back to the work
    /// queue (`x-dead-letter-strategy`, which needs `x-overflow: reject-publish`):
    /// RabbitMQ dead-letters at most once otherwise, and drops the copy when the work
    /// queue's leader is unavailable at that moment.
    pub async fn declare(&self, connection: &Connection) -> Result<Declared, lapin::Error> {
        let mut channel = connection.create_channel().await?;
        let mut declared = Declared::default();
        let queues = std::iter::once((self.queue.clone(), Role::Work))
            .chain(
                self.retry_delays
                    .iter()
                    .map(|d| (retry_queue_name(&self.queue, *d), Role::Retry(*d))),
            )
            .chain(std::iter::once((self.dlq(), Role::DeadLetters)));
        for (name, role) in queues {
            let args = self.args(role, true);
            let durable = QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            };
            let Err(error) = channel
                .queue_declare(name.as_str().into(), durable, args.clone())
                .await
            else {
                continue;
            };
            let older = self.args(role, false);
            if older == args || !refused(&error) {
                return Err(error);
            }
            // The refusal closed the channel. A queue an older idem declared takes its
            // old arguments; one that refuses those too says what really differs.
            channel = connection.create_channel().await?;
            channel
                .queue_declare(name.as_str().into(), durable, older)
                .await?;
            declared.older.push(name);
        }
        for subscription in &self.subscriptions {
            subscription.declare(&channel, &self.queue).await?;
        }
        let _ = channel.close(200, "declared".into()).await;
        Ok(declared)
    }

    /// The arguments of one of the queues; `current` false: as idem declared them
    /// before the quorum arguments of [`Topology::declare`].
    fn args(&self, role: Role, current: bool) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), long_string(self.queue_type.as_str()));
        let quorum = current && self.queue_type == QueueType::Quorum;
        if self.single_active_consumer && matches!(role, Role::Work) {
            args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        }
        match role {
            Role::Work | Role::DeadLetters if quorum => {
                args.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongInt(DELIVERY_LIMIT),
                );
            }
            Role::Work | Role::DeadLetters => {}
            Role::Retry(delay) => {
                let ttl = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
                args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl));
                args.insert("x-dead-letter-exchange".into(), long_string(""));
                args.insert("x-dead-letter-routing-key".into(), long_string(&self.queue));
                if quorum {
                    args.insert(
                        "x-dead-letter-strategy".into(),
                        long_string("at-least-once"),
                    );
                    args.insert("x-overflow".into(), long_string("reject-publish"));
                }
            }
        }
        args
    }
}

/// What [`Topology::declare`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Declared {
    /// Quorum queues an older idem declared without the arguments that keep their
    /// messages: kept as they are (a queue's arguments cannot change), working as
    /// before (a retry hop at most once, RabbitMQ's default delivery limit). To
    /// upgrade one, stop its workers, let it empty, delete it, and start them again.
    pub older: Vec<String>,
}

/// The `x-delivery-limit` of quorum work queues and DLQs: as many deliveries as the
/// broker can count, so that none is ever dropped for being delivered too often (a
/// positive number: RabbitMQ 3 drops a message at once under -1, which only RabbitMQ
/// 4 reads as "no limit").
pub const DELIVERY_LIMIT: i32 = i32::MAX;

/// Which of a topology's queues.
#[derive(Debug, Clone, Copy)]
enum Role {
    Work,
    Retry(Duration),
    DeadLetters,
}

/// 406 PRECONDITION_FAILED: the queue exists with other arguments.
fn refused(error: &lapin::Error) -> bool {
    matches!(error.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 406)
}

/// The dead-letter queue of `queue`.
pub fn dlq_name(queue: &str) -> String {
    format!("{queue}.dlq")
}

/// What the broker says of a queue: messages ready (not delivered) and consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueCounts {
    /// Messages ready to be delivered; unacked deliveries are not counted.
    pub ready: u32,
    /// Consumers subscribed to it.
    pub consumers: u32,
}

/// The counts of `queue`, or `None` if it does not exist. A passive declare, so nothing
/// is created; on a channel of its own, since the broker closes the channel of a passive
/// declare on a missing queue. Any other failure (no channel, a closed connection) is
/// an error, not a missing queue.
pub async fn queue_counts(
    connection: &Connection,
    queue: &str,
) -> Result<Option<QueueCounts>, lapin::Error> {
    let channel = connection.create_channel().await?;
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await;
    let _ = channel.close(200, "counted".into()).await;
    match declared {
        Ok(q) => Ok(Some(QueueCounts {
            ready: q.message_count(),
            consumers: q.consumer_count(),
        })),
        Err(error) if not_found(&error) => Ok(None),
        Err(error) => Err(error),
    }
}

/// 404 NOT_FOUND: the queue does not exist.
fn not_found(error: &lapin::Error) -> bool {
    matches!(error.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 404)
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// How long one node of a list may take to accept a connection before the next is
/// tried.
const NODE_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens an AMQP connection named `name` (shown in the management UI and by
/// `rabbitmqctl list_connections`).
///
/// `urls` may list the nodes of a cluster, comma-separated (a comma inside a password
/// must be percent-encoded as `%2C`): they are tried in order, and the first that
/// answers is used. Every reconnect starts again from the first, so a node that died
/// costs one refused connection, and a node that came back is used again. If none
/// answers, the last node's error is returned.
pub async fn connect(urls: &str, name: &str) -> Result<Connection, lapin::Error> {
    let nodes: Vec<&str> = urls
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    let mut last = None;
    for (i, url) in nodes.iter().enumerate() {
        // The URL carries credentials: a node is named by its place in the list, and a
        // URL that does not parse is not quoted back (the parser's error would).
        let Ok(uri) = url.parse::<AMQPUri>() else {
            let why = format!("AMQP URL {} of {} is not a valid URL", i + 1, nodes.len());
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, why).into());
        };
        let properties = ConnectionProperties::default().with_connection_name(name.into());
        let attempt = Connection::connect_uri(uri, properties);
        let error = match tokio::time::timeout(NODE_CONNECT_TIMEOUT, attempt).await {
            Ok(Ok(connection)) => return Ok(connection),
            Ok(Err(error)) => error,
            Err(_) => std::io::Error::from(std::io::ErrorKind::TimedOut).into(),
        };
        if i + 1 < nodes.len() {
            warn!(node = i + 1, of = nodes.len(), error = %error, "broker node did not answer; trying the next");
        }
        last = Some(error);
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "no broker URL given").into()
    }))
}

/// Why a publish did not land.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The channel or connection failed.
    #[error(transparent)]
    Broker(#[from] lapin::Error),
    /// The broker answered that it did not take the message (a nack, or returned as
    /// unroutable): no queue holds it.
    #[error("publish to {queue} refused: {why}")]
    Refused {
        /// Target queue.
        queue: String,
        /// What the broker said.
        why: String,
    },
    /// No confirm came in time (or confirms are off): the message may have landed.
    #[error("publish to {queue} not confirmed: {why}")]
    NotConfirmed {
        /// Target queue.
        queue: String,
        /// Why not.
        why: String,
    },
}

/// The longest [`publish_confirmed`] waits for the publish and its confirm. lapin can
/// leave a publish waiting for ever when the broker closes the connection under it
/// (amqp-rs/lapin#409, seen here when `rabbitmqctl close_all_connections` hit a
/// publisher mid-publish): without a bound, a worker's delivery task would hang holding
/// its slot. Past it the publish counts as unconfirmed: whoever called publishes again,
/// a duplicate at worst.
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// Publishes `body` persistently to `queue` through the default exchange and waits for
/// the broker's confirm (the channel must be in confirm mode), at most
/// [`CONFIRM_TIMEOUT`]. Unroutable messages (no such queue) are refused, not silently
/// dropped.
pub async fn publish_confirmed(
    channel: &Channel,
    queue: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), PublishError> {
    let published = publish_and_confirm(channel, queue, body, properties);
    match tokio::time::timeout(CONFIRM_TIMEOUT, published).await {
        Ok(result) => result,
        Err(_) => Err(PublishError::NotConfirmed {
            queue: queue.into(),
            why: format!("no confirm within {} s", CONFIRM_TIMEOUT.as_secs()),
        }),
    }
}

async fn publish_and_confirm(
    channel: &Channel,
    queue: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), PublishError> {
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties.with_delivery_mode(2),
        )
        .await?
        .await?;
    let queue = queue.to_owned();
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(returned)) => Err(PublishError::Refused {
            queue,
            why: format!("unroutable: {}", returned.reply_text),
        }),
        Confirmation::Nack(_) => Err(PublishError::Refused {
            queue,
            why: "nacked by the broker".into(),
        }),
        Confirmation::NotRequested => Err(PublishError::NotConfirmed {
            queue,
            why: "publisher confirms are off".into(),
        }),
    }
}
