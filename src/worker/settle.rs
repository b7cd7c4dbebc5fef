//! Telling the broker what became of a delivery: ack it, send it through a retry
//! queue, requeue it, or dead-letter it. Every publish is confirmed before the ack
//! (docs/DESIGN.md, "Broker topology").

use std::sync::atomic::{AtomicBool, Ordering};

use lapin::Channel;
use lapin::message::Delivery;
use tracing::{Span, warn};

use super::WorkerError;
use super::acks::Acks;
use super::decision::{DeadLetterOrder, Settle};
use super::follow_ups::FollowUpChannel;
use crate::dead_letter::{self, DeadLetter};
use crate::failpoint;
use crate::key::Key;
use crate::metrics;
use crate::retry::retry_queue_name;
use crate::store::Store;
use crate::tally::Tally;
use crate::topology;
use crate::trace::{self, TraceContext};

/// The broker side of one delivery.
pub(super) struct Settler<'a> {
    /// The trace context the delivery arrived with.
    pub(super) trace: Option<TraceContext>,
    /// How many times the message was replayed from a dead-letter queue.
    pub(super) replays: i64,
    /// Set once the delivery's dead letter is published.
    pub(super) dead_lettered: AtomicBool,
    pub(super) acks: &'a Acks,
    pub(super) operation: &'static str,
    pub(super) store: &'a Store,
    /// The publishing channel (in confirm mode) of retries and dead letters.
    pub(super) channel: &'a Channel,
    /// Where the delivery's follow-up messages are published.
    pub(super) follow_ups: &'a FollowUpChannel,
    pub(super) delivery: &'a Delivery,
    pub(super) queue: &'a str,
    /// Where the outcome is counted for the console, if anywhere.
    pub(super) tally: Option<&'a Tally>,
}

impl Settler<'_> {
    /// Delayed retries this message already went through (`idem-retries`).
    pub(super) fn retries(&self) -> i64 {
        dead_letter::header_i64(&self.delivery.properties, dead_letter::RETRIES).unwrap_or(0)
    }

    /// Counts `outcome` for the delivery, among replays too when the message was
    /// replayed from a dead-letter queue.
    pub(super) fn count(&self, outcome: &'static str) {
        metrics::delivery(self.operation, outcome);
        if let Some(tally) = self.tally {
            tally.count(self.operation, outcome);
        }
        if self.replays > 0 {
            metrics::replayed_delivery(self.operation, outcome);
        }
    }

    /// Does what the decision said. `key` is the message's key, if it had a valid one.
    pub(super) async fn apply(&self, action: Settle, key: Option<&Key>) -> Result<(), WorkerError> {
        match action {
            Settle::Ack => self.ack(),
            Settle::Retry { delay, retries } => {
                let properties = dead_letter::retry_properties(&self.delivery.properties, retries);
                self.publish(&retry_queue_name(self.queue, delay), properties)
                    .await?;
                failpoint::hit("after-publish");
                self.ack();
            }
            Settle::Requeue { after } => {
                tokio::time::sleep(after).await;
                self.requeue();
            }
            Settle::DeadLetter(order) => self.dead_letter(&order, key).await?,
        }
        Ok(())
    }

    /// Acks the delivery (coalesced with its neighbours). If the channel is gone by
    /// then, the broker redelivers and the store decides again.
    fn ack(&self) {
        self.acks.ack(self.delivery.delivery_tag);
    }

    /// Gives the delivery back to its queue, to be decided again.
    pub(super) fn requeue(&self) {
        self.acks.nack(self.delivery.delivery_tag, true);
    }

    async fn publish(
        &self,
        queue: &str,
        properties: lapin::BasicProperties,
    ) -> Result<(), WorkerError> {
        // Whatever idem publishes for a delivery carries its trace on (the settle span's
        // context with OpenTelemetry on: the next hop is its child).
        let context = trace::outgoing(&Span::current(), self.trace.as_ref());
        let properties = trace::with_context(properties, context.as_ref());
        topology::publish_confirmed(self.channel, queue, &self.delivery.data, properties).await?;
        Ok(())
    }

    /// Publishes the dead letter (confirmed), pins the record it belongs to, and only
    /// then acks. A crash after the publish leaves the record unpinned, so the
    /// redelivery publishes again: a DLQ may hold a key twice, never lose it.
    async fn dead_letter(
        &self,
        order: &DeadLetterOrder,
        key: Option<&Key>,
    ) -> Result<(), WorkerError> {
        let properties = dead_letter::dead_letter_properties(
            &self.delivery.properties,
            &DeadLetter {
                reason: order.reason,
                error: &order.error,
                key,
                operation: self.operation,
                attempts: order.attempts,
                original_queue: self.queue,
            },
        );
        warn!(reason = order.reason.as_str(), error = %order.error, "dead-lettering");
        self.publish(&topology::dlq_name(self.queue), properties)
            .await?;
        failpoint::hit("after-publish");
        if let Some(id) = order.pin {
            self.store.mark_dead_lettered(id).await?;
        }
        self.count("dead_lettered");
        self.dead_lettered.store(true, Ordering::Relaxed);
        self.ack();
        Ok(())
    }
}
