//! What a message carried as the broker delivered it, for the handler's context.

use lapin::BasicProperties;

use crate::headers;

/// What the message carried, as the broker delivered it: its AMQP properties (type,
/// message id, correlation id, headers), the exchange and routing key it came through,
/// and whether the broker delivered it before. Empty for an HTTP request and in
/// [`Context::for_test`](crate::Context::for_test).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Envelope {
    /// The exchange it was published to (`""`: the default exchange).
    pub exchange: String,
    /// The routing key it was published with.
    pub routing_key: String,
    /// Whether the broker delivered it before (a redelivery after a lost ack, or a
    /// requeue).
    pub redelivered: bool,
    /// Its AMQP properties, headers included.
    pub properties: BasicProperties,
}

impl Envelope {
    /// The AMQP `type` property: what kind of message this is (`order.created`).
    pub fn message_type(&self) -> Option<&str> {
        self.properties.kind().as_ref().map(|t| t.as_str())
    }

    /// The AMQP `message_id` property (a broker-level id, never the idempotency key).
    pub fn message_id(&self) -> Option<&str> {
        self.properties.message_id().as_ref().map(|t| t.as_str())
    }

    /// The AMQP `correlation_id` property.
    pub fn correlation_id(&self) -> Option<&str> {
        self.properties
            .correlation_id()
            .as_ref()
            .map(|t| t.as_str())
    }

    /// A header as text (a string header, or a number written out), if the message
    /// carried it.
    pub fn header(&self, name: &str) -> Option<String> {
        headers::text(&self.properties, name)
            .or_else(|| headers::integer(&self.properties, name).map(|n| n.to_string()))
    }
}
