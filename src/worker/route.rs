//! How a delivery finds its handler: a queue of one handler gives it every delivery; a
//! queue of several gives each delivery to the handler of its message type (the AMQP
//! `type` property, a header or a field of the JSON body: [`RouteBy`]), and
//! dead-letters one whose type no handler takes as `unroutable` (docs/DESIGN.md, "One service, many handlers").

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use futures_util::future::BoxFuture;
use lapin::message::Delivery;
use serde_json::Value;
use tracing::{Instrument, info_span, warn};

use super::decision::{DeadLetterOrder, Outcome, Settle};
use super::hand_on;
use super::owned::Ahead;
use super::settle::{Incoming, Links, Settler, Source};
use super::{Runtime, execute};
use crate::dead_letter::Reason;
use crate::flow::circuit::Admission;
use crate::handler::{Envelope, Handler};
use crate::headers;
use crate::ordering::Released;
use crate::store::Store;
use crate::tally::Tally;

/// Where a queue's handlers read a message's type from, when several share the queue.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RouteBy {
    /// The AMQP `type` property (`order.created`), as most producers set it.
    #[default]
    Type,
    /// A header of this name, holding text (or a number).
    Header(String),
    /// A top-level field of the JSON body (`{"kind": "order.created", …}`), text or a
    /// number: the body is parsed once more to read it, and a body that is not a JSON
    /// object is dead-lettered as `malformed`.
    Field(String),
}

/// How long an unroutable delivery whose dead letter failed waits before it goes back
/// to its queue (holding its queue's permit, so a queue spends at most its concurrency
/// on them).
const UNROUTED_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// The metrics and tally label of a delivery no handler took.
const UNROUTED: &str = "(unroutable)";

/// One handler's runtime, its type erased, as a queue's deliveries reach it.
pub(super) trait Route: Send + Sync + 'static {
    fn process(
        self: Arc<Self>,
        links: Links,
        delivery: Delivery,
        admission: Admission,
    ) -> BoxFuture<'static, ()>;

    /// Its handler's operation.
    fn operation(&self) -> &'static str;

    /// Runs a turn released to this process from its waiting row, as a turn handed on
    /// in process runs, and what that one hands on (`hand_on`).
    fn run_released(self: Arc<Self>, links: Links, released: Released) -> BoxFuture<'static, ()>;
}

impl<H: Handler> Route for Runtime<H> {
    fn process(
        self: Arc<Self>,
        links: Links,
        delivery: Delivery,
        admission: Admission,
    ) -> BoxFuture<'static, ()> {
        Box::pin(async move { execute::process(&self, &links, delivery, admission).await })
    }

    fn operation(&self) -> &'static str {
        H::OPERATION
    }

    fn run_released(self: Arc<Self>, links: Links, released: Released) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            hand_on::hand_on(&self, &links, vec![released], Ahead::default()).await;
        })
    }
}

/// The handlers of one queue.
pub(super) enum Routes {
    /// One handler takes every delivery.
    One(Arc<dyn Route>),
    /// Each message type its handler.
    ByType {
        by: RouteBy,
        routes: HashMap<String, Arc<dyn Route>>,
    },
}

/// Why no handler of a queue takes a delivery, and what its dead letter says.
pub(super) struct NoRoute {
    /// `unroutable` (a type no handler takes, or none), or `malformed` (a body that is
    /// not the JSON object a field is read from).
    reason: Reason,
    error: String,
}

impl Routes {
    /// The handler of `operation`, if one of this queue's is.
    pub(super) fn of_operation(&self, operation: &str) -> Option<Arc<dyn Route>> {
        match self {
            Routes::One(route) => Some(route).filter(|r| r.operation() == operation).cloned(),
            Routes::ByType { routes, .. } => routes
                .values()
                .find(|r| r.operation() == operation)
                .cloned(),
        }
    }

    /// The handler of `delivery`, or why none takes it.
    pub(super) fn pick(&self, delivery: &Delivery) -> Result<Arc<dyn Route>, NoRoute> {
        let (by, routes) = match self {
            Routes::One(route) => return Ok(route.clone()),
            Routes::ByType { by, routes } => (by, routes),
        };
        let properties = &delivery.properties;
        let (kind, source) = match by {
            RouteBy::Type => (
                properties.kind().as_ref().map(|t| t.to_string()),
                "type".to_owned(),
            ),
            RouteBy::Header(name) => (
                headers::text(properties, name)
                    .or_else(|| headers::integer(properties, name).map(|n| n.to_string())),
                format!("header {name}"),
            ),
            RouteBy::Field(name) => (field(&delivery.data, name)?, format!("field {name}")),
        };
        let mut known: Vec<&str> = routes.keys().map(String::as_str).collect();
        known.sort_unstable();
        let unroutable = |error| NoRoute {
            reason: Reason::Unroutable,
            error,
        };
        match kind {
            Some(kind) => routes.get(&kind).cloned().ok_or_else(|| {
                unroutable(format!(
                    "no handler for message {source} {:?} on this queue (it has {})",
                    crate::text::cut(&kind, 200),
                    known.join(", ")
                ))
            }),
            None => Err(unroutable(format!(
                "the message has no {source} as text or a number, which this queue's handlers are chosen by ({})",
                known.join(", ")
            ))),
        }
    }
}

/// The text (or number) of the top-level field `name` of a JSON object body; a body
/// that is not one is malformed.
fn field(body: &[u8], name: &str) -> Result<Option<String>, NoRoute> {
    let malformed = |error| NoRoute {
        reason: Reason::Malformed,
        error,
    };
    let value: Value =
        serde_json::from_slice(body).map_err(|e| malformed(format!("body is not JSON: {e}")))?;
    let object = value
        .as_object()
        .ok_or_else(|| malformed("body is not a JSON object".into()))?;
    Ok(match object.get(name) {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    })
}

/// What a queue's unroutable deliveries are dead-lettered with.
pub(super) struct Unrouted {
    pub(super) store: Store,
    pub(super) queue: String,
    pub(super) tally: Option<Arc<Tally>>,
}

impl Unrouted {
    /// Dead-letters `delivery` as `why` says (its DLQ is the queue's), then acks it; a
    /// publish that fails gives it back to the queue after a pause.
    pub(super) async fn dead_letter(&self, links: &Links, delivery: Delivery, why: NoRoute) {
        let envelope = Envelope {
            exchange: delivery.exchange.to_string(),
            routing_key: delivery.routing_key.to_string(),
            redelivered: delivery.redelivered,
            properties: delivery.properties.clone(),
        };
        let incoming = Incoming::new(&delivery.data, envelope, None);
        let settler = Settler {
            incoming: &incoming,
            dead_lettered: AtomicBool::new(false),
            links,
            operation: UNROUTED,
            store: &self.store,
            from: Source::Broker(delivery.delivery_tag),
            queue: &self.queue,
            tally: self.tally.as_deref(),
        };
        let decided = match why.reason {
            Reason::Malformed => Outcome::Malformed,
            _ => Outcome::Unroutable,
        };
        let order = DeadLetterOrder {
            reason: why.reason,
            error: why.error,
            attempts: 0,
            pin: None,
        };
        let span = info_span!("delivery", queue = %self.queue, outcome = decided.as_str());
        let outcome = async {
            match settler.apply(Settle::DeadLetter(order), None).await {
                Ok(()) => decided,
                Err(error) => {
                    // Its DLQ refused it or the broker failed: the same message would
                    // fail the same way at once, so it waits before it goes back.
                    warn!(error = %crate::text::error_line(&error), pause_ms = UNROUTED_PAUSE.as_millis() as u64, "the message no handler takes was not dead-lettered; requeued");
                    tokio::time::sleep(UNROUTED_PAUSE).await;
                    settler.requeue().await;
                    Outcome::Requeued
                }
            }
        }
        .instrument(span)
        .await;
        settler.count(outcome.as_str());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_is_read_as_text_or_a_number_and_a_body_not_an_object_is_malformed() {
        let read = |body: &str| field(body.as_bytes(), "kind");
        assert_eq!(
            read(r#"{"kind":"order.created"}"#)
                .ok()
                .flatten()
                .as_deref(),
            Some("order.created")
        );
        assert_eq!(read(r#"{"kind":7}"#).ok().flatten().as_deref(), Some("7"));
        assert!(read(r#"{"kind":null,"other":"x"}"#).is_ok_and(|k| k.is_none()));
        for bad in ["not json", "[1,2]"] {
            let Err(no) = read(bad) else {
                panic!("{bad} routed")
            };
            assert_eq!(no.reason, Reason::Malformed, "{bad}");
        }
    }
}
