//! How a delivery finds its handler: a queue of one handler gives it every delivery; a
//! queue of several gives each delivery to the handler of its message type (the AMQP
//! `type` property, or a header: [`RouteBy`]), and dead-letters one whose type no
//! handler takes as `unroutable` (docs/DESIGN.md, "One service, many handlers").

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use futures_util::future::BoxFuture;
use lapin::message::Delivery;
use tracing::{Instrument, info_span, warn};

use super::decision::{DeadLetterOrder, Outcome, Settle};
use super::settle::{Incoming, Links, Settler};
use super::{Runtime, execute};
use crate::dead_letter::Reason;
use crate::handler::{Envelope, Handler};
use crate::store::Store;
use crate::tally::Tally;

/// Where a queue's handlers read a message's type from, when several share the queue.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RouteBy {
    /// The AMQP `type` property (`order.created`), as most producers set it.
    #[default]
    Type,
    /// A header of this name, holding text.
    Header(String),
}

/// How long an unroutable delivery whose dead letter failed waits before it goes back
/// to its queue (holding its queue's permit, so a queue spends at most its concurrency
/// on them).
const UNROUTED_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// The metrics and tally label of a delivery no handler took.
const UNROUTED: &str = "(unroutable)";

/// One handler's runtime, its type erased, as a queue's deliveries reach it.
pub(super) trait Route: Send + Sync + 'static {
    fn process(self: Arc<Self>, links: Links, delivery: Delivery) -> BoxFuture<'static, ()>;
}

impl<H: Handler> Route for Runtime<H> {
    fn process(self: Arc<Self>, links: Links, delivery: Delivery) -> BoxFuture<'static, ()> {
        Box::pin(async move { execute::process(&self, &links, delivery).await })
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

impl Routes {
    /// The handler of `delivery`, or why none takes it.
    pub(super) fn pick(&self, delivery: &Delivery) -> Result<Arc<dyn Route>, String> {
        let (by, routes) = match self {
            Routes::One(route) => return Ok(route.clone()),
            Routes::ByType { by, routes } => (by, routes),
        };
        let envelope = Envelope {
            exchange: String::new(),
            routing_key: String::new(),
            redelivered: false,
            properties: delivery.properties.clone(),
        };
        let (kind, source) = match by {
            RouteBy::Type => (
                envelope.message_type().map(str::to_owned),
                "type".to_owned(),
            ),
            RouteBy::Header(name) => (envelope.header(name), format!("header {name}")),
        };
        let mut known: Vec<&str> = routes.keys().map(String::as_str).collect();
        known.sort_unstable();
        match kind {
            Some(kind) => routes.get(&kind).cloned().ok_or_else(|| {
                format!(
                    "no handler for message {source} {:?} on this queue (it has {})",
                    crate::text::cut(&kind, 200),
                    known.join(", ")
                )
            }),
            None => Err(format!(
                "the message has no {source}, which this queue's handlers are chosen by ({})",
                known.join(", ")
            )),
        }
    }
}

/// What a queue's unroutable deliveries are dead-lettered with.
pub(super) struct Unrouted {
    pub(super) store: Store,
    pub(super) queue: String,
    pub(super) tally: Option<Arc<Tally>>,
}

impl Unrouted {
    /// Dead-letters `delivery` as `unroutable` with `why` (its DLQ is the queue's), then
    /// acks it; a publish that fails gives it back to the queue.
    pub(super) async fn dead_letter(&self, links: &Links, delivery: Delivery, why: String) {
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
            delivery: &delivery,
            queue: &self.queue,
            tally: self.tally.as_deref(),
        };
        let order = DeadLetterOrder {
            reason: Reason::Unroutable,
            error: why,
            attempts: 0,
            pin: None,
        };
        let span =
            info_span!("delivery", queue = %self.queue, outcome = Outcome::Unroutable.as_str());
        let outcome = async {
            match settler.apply(Settle::DeadLetter(order), None).await {
                Ok(()) => Outcome::Unroutable,
                Err(error) => {
                    // Its DLQ refused it or the broker failed: the same message would
                    // fail the same way at once, so it waits before it goes back.
                    warn!(error = %crate::text::error_line(&error), pause_ms = UNROUTED_PAUSE.as_millis() as u64, "the unroutable message was not dead-lettered; requeued");
                    tokio::time::sleep(UNROUTED_PAUSE).await;
                    settler.requeue();
                    Outcome::Requeued
                }
            }
        }
        .instrument(span)
        .await;
        settler.count(outcome.as_str());
    }
}
