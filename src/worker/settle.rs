//! Telling the broker what became of a delivery: ack it, send it through a retry
//! queue, requeue it, or dead-letter it. Every publish is confirmed before the ack
//! (docs/DESIGN.md, "Broker topology").

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use lapin::types::DeliveryTag;
use lapin::{BasicProperties, Channel};
use tracing::{Span, debug, warn};

use super::Failure;
use super::acks::Acks;
use super::decision::{DeadLetterOrder, Settle};
use super::follow_ups::FollowUpChannel;
use super::owned::{Link, Positions};
use crate::dead_letter::{self, DeadLetter, Outgoing};
use crate::failpoint;
use crate::flow::circuit::Admission;
use crate::handler::Envelope;
use crate::headers;
use crate::key::Key;
use crate::metrics;
use crate::ordering::{Released, table};
use crate::retry::retry_queue_name;
use crate::store::Store;
use crate::tally::Tally;
use crate::topology::{self, PublishError};
use crate::trace::{self, TraceContext};

/// What one broker connection gives every delivery it brings.
#[derive(Clone)]
pub(super) struct Links {
    /// The publishing channel (in confirm mode) of retries and dead letters.
    pub(super) publish: Channel,
    /// Where follow-up messages are published.
    pub(super) follow_ups: Arc<FollowUpChannel>,
    /// Acks and nacks, coalesced.
    pub(super) acks: Acks,
    /// The connection's negotiated `frame_max`: no header frame idem sends may be
    /// larger, or the broker closes the connection.
    pub(super) frame_max: u32,
    /// On a queue with a single active consumer, the entities' positions this session
    /// knows (owned order), shared by the queue's handlers.
    pub(super) positions: Option<Arc<Positions>>,
}

/// How long `idem-error` may stay on a copy sent without the producer's headers that
/// still does not fit (a `frame_max` near the protocol's minimum, 4,096 bytes).
const ERROR_MAX_IN_A_SMALL_FRAME: usize = 128;

/// What idem reads of one delivery, whether a broker brought it or a test
/// (`crate::testing`): its body and properties, the trace context it arrived with, and
/// where its run's follow-ups are published after the commit.
pub(crate) struct Incoming<'a> {
    pub(crate) data: &'a [u8],
    /// What the message carried (its properties among it), for the handler's context.
    pub(crate) envelope: Arc<Envelope>,
    /// The trace context the delivery arrived with.
    pub(crate) trace: Option<TraceContext>,
    /// The session's follow-up channel; none leaves a run's follow-ups in the outbox,
    /// for the relay.
    pub(crate) follow_ups: Option<&'a FollowUpChannel>,
    /// How the queue's circuit let it in (closed, or as its probe).
    pub(crate) admission: Admission,
    /// It holds its entity's turn already: the release handed it over (it does not
    /// enter its entity's order again).
    pub(crate) holds_turn: bool,
    /// The session's positions under owned order (none elsewhere: the gate decides).
    pub(crate) positions: Option<Arc<Positions>>,
    /// Handed on in a leased run under owned order: where the position stands and the
    /// row it may hand on to.
    pub(crate) link: Link,
}

impl<'a> Incoming<'a> {
    /// A delivery of `data` in `envelope`, its follow-ups published on `follow_ups`.
    pub(crate) fn new(
        data: &'a [u8],
        envelope: Envelope,
        follow_ups: Option<&'a FollowUpChannel>,
    ) -> Self {
        Self {
            data,
            trace: TraceContext::from_properties(&envelope.properties),
            envelope: Arc::new(envelope),
            follow_ups,
            admission: Admission::UNBROKEN,
            holds_turn: false,
            positions: None,
            link: Link::default(),
        }
    }

    /// The message's AMQP properties.
    pub(crate) fn properties(&self) -> &BasicProperties {
        &self.envelope.properties
    }

    /// Delayed retries this message already went through (`idem-retries`).
    pub(crate) fn retries(&self) -> i64 {
        headers::integer(self.properties(), headers::RETRIES).unwrap_or(0)
    }

    /// How many times the message was replayed from a dead-letter queue
    /// (`idem-replays`).
    pub(crate) fn replays(&self) -> i64 {
        headers::integer(self.properties(), headers::REPLAYS).unwrap_or(0)
    }
}

/// Where a delivery came from, for its ack.
#[derive(Clone, Copy)]
pub(super) enum Source<'a> {
    /// The broker, with this delivery tag.
    Broker(DeliveryTag),
    /// Its waiting row, whose turn this process released: acked, the row is deleted
    /// (the outcome, retry copy or dead letter is safe); given back, the sweep publishes
    /// it to its queue.
    Waiting(&'a Released),
}

/// The broker side of one delivery.
pub(super) struct Settler<'a> {
    /// The delivery as idem read it.
    pub(super) incoming: &'a Incoming<'a>,
    /// Set once the delivery's dead letter is published.
    pub(super) dead_lettered: AtomicBool,
    /// The session's channels.
    pub(super) links: &'a Links,
    pub(super) operation: &'static str,
    pub(super) store: &'a Store,
    /// Who hears the ack: the broker (the delivery's tag), or, for a delivery whose
    /// turn was handed to it in this process, its waiting row.
    pub(super) from: Source<'a>,
    pub(super) queue: &'a str,
    /// Where the outcome is counted for the console, if anywhere.
    pub(super) tally: Option<&'a Tally>,
}

impl Settler<'_> {
    /// Counts `outcome` for the delivery, among replays too when the message was
    /// replayed from a dead-letter queue.
    pub(super) fn count(&self, outcome: &'static str) {
        let replayed = self.incoming.replays() > 0;
        count(self.operation, self.tally, outcome, replayed);
    }

    /// Does what the decision said. `key` is the message's key, if it had a valid one.
    pub(super) async fn apply(&self, action: Settle, key: Option<&Key>) -> Result<(), Failure> {
        match action {
            // A handed-over delivery acked here completed, or its record decides without
            // a turn: the release's move past it deletes its row (under the gate, a row
            // of its record's payload; another stays behind the position, and the sweep
            // publishes and deletes it), or the next copy's entry does; no round trip of
            // its own at every turn of a hot entity (a delete of its own cost the gate's
            // shuffled bench a quarter to 40 % of its pace).
            Settle::Ack => match self.from {
                Source::Broker(tag) => self.links.acks.ack(tag),
                Source::Waiting(_) => {}
            },
            Settle::AckWaiting => match self.from {
                Source::Broker(tag) => self.links.acks.ack_parked(tag),
                Source::Waiting(_) => {}
            },
            Settle::Retry { delay, retries } => {
                let copy = dead_letter::retry(self.incoming.properties(), retries);
                self.publish(&retry_queue_name(self.queue, delay), &copy, false)
                    .await?;
                failpoint::hit("after-publish");
                self.ack().await;
            }
            Settle::Requeue { after } => {
                tokio::time::sleep(after).await;
                self.requeue().await;
            }
            Settle::DeadLetter(order) => self.dead_letter(&order, key).await?,
        }
        Ok(())
    }

    /// Acks the delivery (coalesced with its neighbours). If the channel is gone by
    /// then, the broker redelivers and the store decides again.
    async fn ack(&self) {
        match self.from {
            Source::Broker(tag) => self.links.acks.ack(tag),
            Source::Waiting(released) => {
                if let Err(error) = table::finish(self.store.pool(), released).await {
                    debug!(error = %crate::text::error_line(&error), "a handed-over turn's row stays for the sweep");
                }
            }
        }
    }

    /// Gives the delivery back to its queue, to be decided again.
    pub(super) async fn requeue(&self) {
        match self.from {
            Source::Broker(tag) => self.links.acks.nack(tag, true),
            Source::Waiting(released) => {
                if let Err(error) = table::give_back(self.store.pool(), released).await {
                    debug!(error = %crate::text::error_line(&error), "a handed-over turn goes back after the release time");
                }
            }
        }
    }

    /// Publishes `copy` to `queue`, confirmed, with the producer's headers unless
    /// `without_carried` or they would not fit the connection's frame.
    async fn publish(
        &self,
        queue: &str,
        copy: &Outgoing,
        without_carried: bool,
    ) -> Result<(), Failure> {
        let properties = self.fitted(copy, without_carried);
        topology::publish_confirmed(&self.links.publish, queue, self.incoming.data, properties)
            .await?;
        Ok(())
    }

    /// `copy`'s properties with the delivery's trace carried on (the settle span's
    /// context with OpenTelemetry on: the next hop is its child), measured against the
    /// connection's `frame_max`: the broker answers a larger header frame by closing the
    /// connection, and the delivery would come back and fail the same way for ever. So
    /// a copy that would not fit leaves the producer's headers behind, and one that
    /// still would not (a `frame_max` near the protocol's minimum) most of its error
    /// text and its trace too.
    fn fitted(&self, copy: &Outgoing, without_carried: bool) -> BasicProperties {
        let context = trace::outgoing(&Span::current(), self.incoming.trace.as_ref());
        let frame_max = usize::try_from(self.links.frame_max).unwrap_or(usize::MAX);
        let fits = |p: &BasicProperties| headers::frame_len(p) <= frame_max;
        if !without_carried {
            let full = trace::with_context(copy.properties(), context.as_ref());
            if fits(&full) {
                return full;
            }
            warn!(
                headers = copy.carried(),
                frame_bytes = headers::frame_len(&full),
                frame_max,
                "the producer's headers are left behind: with them the copy would not fit the broker's frame"
            );
        }
        let without =
            trace::with_context(copy.without_carried(headers::ERROR_MAX), context.as_ref());
        if fits(&without) {
            return without;
        }
        copy.without_carried(ERROR_MAX_IN_A_SMALL_FRAME)
    }

    /// Pins the record the dead letter belongs to, publishes the letter (confirmed),
    /// notes that it waits in the DLQ, and only then acks. The pin comes first, so a
    /// crash between the two leaves a pin too many (the record is kept), never a letter
    /// whose record gc may delete; a crash after the publish leaves the record not yet
    /// marked, so the redelivery publishes again: a DLQ may hold a key twice, each
    /// letter with its pin, and never loses one.
    async fn dead_letter(&self, order: &DeadLetterOrder, key: Option<&Key>) -> Result<(), Failure> {
        let copy = dead_letter::dead_letter(
            self.incoming.properties(),
            &DeadLetter {
                reason: order.reason,
                error: &order.error,
                key,
                operation: self.operation,
                attempts: order.attempts,
                original_queue: self.queue,
            },
        );
        let error = crate::text::cut(&order.error, headers::ERROR_MAX);
        warn!(reason = order.reason.as_str(), error = %error, "dead-lettering");
        if let Some(id) = order.pin {
            self.store.pin(id).await?;
        }
        let dlq = topology::dlq_name(self.queue);
        let published = match self.publish(&dlq, &copy, false).await {
            // The broker answered and did not take it: the same letter without the
            // producer's headers, which are the one part of it idem did not make.
            Err(Failure::Publish(PublishError::Refused { why, .. })) if copy.carried() > 0 => {
                warn!(why = %why, "dead letter refused; publishing it without the producer's headers");
                self.publish(&dlq, &copy, true).await
            }
            other => other,
        };
        if let Err(error) = published {
            // A letter no queue holds needs no pin; one that may have landed keeps it.
            if let (Some(id), Failure::Publish(PublishError::Refused { .. })) = (order.pin, &error)
                && let Err(e) = self.store.unpin_refused(id).await
            {
                warn!(error = %crate::text::error_line(&e), "the refused dead letter's pin stays");
            }
            return Err(error);
        }
        failpoint::hit("after-publish");
        if let Some(id) = order.pin {
            self.store.mark_dead_lettered(id).await?;
        }
        self.count("dead_lettered");
        self.dead_lettered.store(true, Ordering::Relaxed);
        self.ack().await;
        Ok(())
    }
}

/// Counts one delivery's `outcome` of `operation`: in `idem_deliveries_total`, in the
/// tally, and among the replays when its message was replayed from a dead-letter queue.
pub(super) fn count(
    operation: &'static str,
    tally: Option<&Tally>,
    outcome: &'static str,
    replayed: bool,
) {
    metrics::delivery(operation, outcome);
    if let Some(tally) = tally {
        tally.count(operation, outcome);
    }
    if replayed {
        metrics::replayed_delivery(operation, outcome);
    }
}
