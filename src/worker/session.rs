//! One broker connection of a running worker: declare the topology, consume, hand
//! each delivery to its own task, and on shutdown stop consuming and drain.

use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use super::acks::{Acks, Hold};
use super::follow_ups::FollowUpChannel;
use super::owned::Positions;
use super::route::{Routes, Unrouted};
use super::settle::Links;
use super::sweep;
use super::{Failure, WorkerConfig, drain};
use crate::connector::Connector;
use crate::flow::circuit::{Admission, Circuit, Turn};
use crate::metrics::BrokerHealth;
use crate::topology::Topology;

/// The broker side of one queue of a running worker or service.
pub(super) struct Session {
    /// The queue's settings (its first handler's).
    pub(super) config: WorkerConfig,
    /// Its handlers.
    pub(super) routes: Arc<Routes>,
    /// Where the deliveries no handler takes go.
    pub(super) unrouted: Arc<Unrouted>,
    pub(super) topology: Topology,
    pub(super) broker: BrokerHealth,
    /// The connection this queue consumes on, shared with the others of its service.
    pub(super) connector: Arc<Connector>,
    /// The connection its retries, dead letters and follow-ups are published on,
    /// shared with the other queues and the relay: a publisher the broker blocks for
    /// flow control does not hold back the consumers' acks.
    pub(super) publishing: Arc<Connector>,
    /// The queue's circuit, when it has a breaker: while it is open, no delivery is
    /// taken (they wait in the broker).
    pub(super) circuit: Option<Arc<Circuit>>,
}

/// How long a connection must have consumed for the reconnect backoff to start afresh
/// after it is lost: one that the broker closes sooner (a refusal it repeats, a node
/// that keeps failing) dies young, and the pauses keep growing.
const LIVED_LONG: Duration = Duration::from_secs(30);

/// The pauses between broker connections: from 100 ms, doubling (with jitter) up to
/// the worker's `max_reconnect_delay`, and from the start again only after a
/// connection that lived long ([`LIVED_LONG`]).
pub(super) struct Reconnects {
    max: Duration,
    backoff: backon::ExponentialBackoff,
}

impl Reconnects {
    pub(super) fn new(max: Duration) -> Self {
        Self {
            max,
            backoff: Self::fresh(max),
        }
    }

    fn fresh(max: Duration) -> backon::ExponentialBackoff {
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(max)
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// The pause before the next connection, after one that consumed for `lived`
    /// (`None`: it never got as far as consuming).
    pub(super) fn after(&mut self, lived: Option<Duration>) -> Duration {
        if lived.is_some_and(|lived| lived >= LIVED_LONG) {
            self.backoff = Self::fresh(self.max);
        }
        self.backoff.next().unwrap_or(self.max)
    }
}

impl Session {
    /// Connects, declares the topology and starts consuming.
    async fn open(&self) -> Result<Open, Failure> {
        self.try_open()
            .await
            .map_err(|error| Failure::opening(error, &self.config.queue))
    }

    async fn try_open(&self) -> Result<Open, lapin::Error> {
        let config = &self.config;
        let consuming = self.connector.get().await?;
        let declared = self.topology.declare(&consuming).await?;
        for queue in &declared.older {
            warn!(
                queue = %queue,
                "an older idem declared this quorum queue without the arguments that keep its messages \
                 (x-delivery-limit; at-least-once dead-lettering for a retry queue): it keeps working as \
                 before; to upgrade it, stop its workers, let it empty, delete it and start them again"
            );
        }
        let publishing = self.publishing.get().await?;
        let publish = publishing.create_channel().await?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let consume = consuming.create_channel().await?;
        consume
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .await?;
        // Last: no delivery arrives before it can be settled.
        let consumer = consume
            .basic_consume(
                config.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Open {
            publishing,
            consume,
            publish,
            consumer,
        })
    }

    /// One broker connection: declare, consume, dispatch. Returns `Ok` on shutdown.
    pub(super) async fn run(
        &self,
        shutdown: &CancellationToken,
        tasks: &TaskTracker,
        permits: &Arc<Semaphore>,
    ) -> Result<(), SessionError> {
        let config = &self.config;
        // A connect can take its timeout per node, and the queues sharing the
        // connection wait for each other's: a shutdown meanwhile ends it.
        let opened = tokio::select! {
            opened = self.open() => opened,
            _ = shutdown.cancelled() => {
                // Handlers of a lost session may still run: they finish first.
                drain(tasks, config.shutdown_timeout).await;
                return Ok(());
            }
        };
        let mut open = opened.map_err(|error| SessionError { lived: None, error })?;
        let links = self.links(&open);
        info!(
            queue = %config.queue,
            prefetch = config.prefetch,
            concurrency = config.concurrency,
            owned_order = config.single_active_consumer,
            "consuming"
        );
        self.broker.set(&config.queue, true);
        let consuming = Instant::now();
        if let Err(error) = self
            .consume(shutdown, tasks, permits, &mut open, &links)
            .await
        {
            if open.consume.status().connected() {
                // The decided deliveries' acks go before the close gives back the rest
                // (an owned queue holds them up to 100 ms).
                links.acks.flush().await;
            }
            close_channels(&open.consume, &open.publish).await;
            return Err(SessionError {
                lived: Some(consuming.elapsed()),
                error,
            });
        }

        info!(queue = %config.queue, "shutting down: no new deliveries, waiting for handlers in flight");
        let cancel = open
            .consume
            .basic_cancel(open.consumer.tag(), BasicCancelOptions::default());
        let _ = tokio::time::timeout(Duration::from_secs(1), cancel).await;
        drain(tasks, config.shutdown_timeout).await;
        links.acks.flush().await;
        // Deliveries prefetched but never started are requeued by the broker on close;
        // the connection is closed once every queue sharing it has drained.
        close_channels(&open.consume, &open.publish).await;
        Ok(())
    }

    /// What the deliveries of a session settle with.
    fn links(&self, open: &Open) -> Links {
        let hold = match self.config.single_active_consumer {
            true => Hold::owned(self.config.prefetch),
            false => Hold::plain(self.config.prefetch),
        };
        Links {
            publish: open.publish.clone(),
            follow_ups: Arc::new(FollowUpChannel::new(open.publishing.clone())),
            acks: Acks::spawn(open.consume.clone(), self.config.batch_linger, hold),
            frame_max: open.publishing.configuration().frame_max(),
            // Known afresh by every session: while this one had no consumer, another
            // process may have owned the queue and moved its entities.
            positions: self
                .config
                .single_active_consumer
                .then(|| Arc::new(Positions::new(self.config.concurrency))),
        }
    }

    /// Takes deliveries, each in a task of its own as a permit frees up and the circuit
    /// lets it in, until shutdown (`Ok`) or until the session is lost.
    async fn consume(
        &self,
        shutdown: &CancellationToken,
        tasks: &TaskTracker,
        permits: &Arc<Semaphore>,
        open: &mut Open,
        links: &Links,
    ) -> Result<(), Failure> {
        // Owned order: what a previous owner of the queue left handed is taken over
        // once this session's first delivery shows the queue is this process's.
        let mut take_over = self.config.single_active_consumer;
        loop {
            let permit = tokio::select! {
                permit = permits.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return Ok(()),
                },
                _ = shutdown.cancelled() => return Ok(()),
            };
            let next = tokio::select! {
                next = open.consumer.next() => next,
                _ = shutdown.cancelled() => return Ok(()),
            };
            let delivery = delivered(next)?;
            let (admission, turn) = match self.admitted(shutdown, &open.consume).await {
                Admitted::Run(admission, turn) => (admission, turn),
                Admitted::Shutdown => return Ok(()),
                Admitted::ChannelLost => return Err(Failure::ConsumerCancelled),
            };
            if !open.publishing.status().connected() || !open.publish.status().connected() {
                // Settling needs it: this delivery is left unacked (the close gives it
                // back), the decided acks go out first, and a new session opens a new
                // publishing connection.
                links.acks.flush().await;
                return Err(Failure::PublisherLost);
            }
            links.acks.delivered(delivery.delivery_tag);
            let ticket = Ticket {
                admission,
                _turn: turn,
                _permit: permit,
            };
            self.spawn(tasks, links.clone(), delivery, ticket);
            if std::mem::take(&mut take_over) {
                let takeover = sweep::Takeover {
                    store: self.unrouted.store.clone(),
                    queue: self.config.queue.clone(),
                    routes: self.routes.clone(),
                    links: links.clone(),
                    tasks: tasks.clone(),
                    shutdown: shutdown.clone(),
                };
                tasks.spawn(takeover.run(Instant::now()));
            }
        }
    }
}

/// What a delivery's task holds until it is done: how the circuit let it in, the
/// probe's turn if it is the probe, and its concurrency permit.
struct Ticket {
    admission: Admission,
    /// Held for its drop: it gives an undecided turn back.
    _turn: Option<Turn>,
    /// Held for its drop: it frees the slot for the next delivery.
    _permit: OwnedSemaphorePermit,
}

/// The delivery a consumer's `next` brought, or why the session ends.
fn delivered(next: Option<Result<Delivery, lapin::Error>>) -> Result<Delivery, Failure> {
    match next {
        Some(Ok(delivery)) => Ok(delivery),
        Some(Err(error)) => Err(error.into()),
        // The queue's channel ended (the queue deleted, say); the shared connection
        // may live on, and its other channel with it.
        None => Err(Failure::ConsumerCancelled),
    }
}

impl Session {
    /// Runs a delivery in a task of its own, holding `ticket` until it is done.
    fn spawn(&self, tasks: &TaskTracker, links: Links, delivery: Delivery, ticket: Ticket) {
        let routes = self.routes.clone();
        let unrouted = self.unrouted.clone();
        tasks.spawn(async move {
            // In the delivery's task: routing by a field parses the body.
            match routes.pick(&delivery) {
                Ok(route) => route.process(links, delivery, ticket.admission).await,
                Err(why) => unrouted.dead_letter(&links, delivery, why).await,
            }
            // A probe that ran decided its turn; one that did not (a duplicate, say)
            // gives it to the next delivery, when the ticket drops.
            drop(ticket);
        });
    }

    /// Whether the delivery in hand may run: at once without a breaker or while the
    /// circuit is closed; while it is open, it waits (unacked, as do those prefetched
    /// behind it, none of them spending a retry tier) until this process takes the
    /// probe's turn; a shutdown meanwhile gives it back with the channel's close.
    async fn admitted(&self, shutdown: &CancellationToken, consume: &lapin::Channel) -> Admitted {
        let Some(circuit) = &self.circuit else {
            return Admitted::Run(Admission::UNBROKEN, None);
        };
        match circuit
            .admit(shutdown, || consume.status().connected())
            .await
        {
            Some((admission, turn)) => Admitted::Run(admission, turn),
            None if shutdown.is_cancelled() => Admitted::Shutdown,
            None => Admitted::ChannelLost,
        }
    }
}

/// What the circuit said of the delivery in hand.
enum Admitted {
    /// It runs, as the probe if it holds the turn.
    Run(Admission, Option<Turn>),
    Shutdown,
    /// The consuming channel closed while it waited.
    ChannelLost,
}

/// Closes a session's channels, waiting at most a second for each (a connection that
/// went silent may never answer).
async fn close_channels(consume: &lapin::Channel, publish: &lapin::Channel) {
    for channel in [consume, publish] {
        let close = channel.close(200, "shutdown".into());
        let _ = tokio::time::timeout(Duration::from_secs(1), close).await;
    }
}

/// A connection's channels and its consumer.
struct Open {
    /// The connection retries, dead letters and follow-ups are published on.
    publishing: Arc<lapin::Connection>,
    /// Consumes and acks (prefetch applies here).
    consume: lapin::Channel,
    /// Publishes retries and dead letters, in confirm mode.
    publish: lapin::Channel,
    consumer: lapin::Consumer,
}

/// Why a session ended other than by shutdown.
pub(super) struct SessionError {
    /// How long the session consumed, if it got that far (see [`Reconnects`]).
    pub(super) lived: Option<Duration>,
    pub(super) error: Failure,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_that_die_young_make_the_pauses_grow_and_a_long_one_resets_them() {
        let max = Duration::from_secs(5);
        let mut reconnects = Reconnects::new(max);
        let young = Some(Duration::from_millis(300));
        let pauses: Vec<Duration> = (0..10).map(|_| reconnects.after(young)).collect();
        // 100 ms, then doubling, each with up to as much again of jitter.
        assert!(pauses[0] < Duration::from_millis(200), "{pauses:?}");
        for (i, pause) in pauses.iter().enumerate() {
            let base = Duration::from_millis(100 << i.min(6)).min(max);
            assert!(*pause >= base && *pause < base * 2, "pause {i}: {pauses:?}");
        }
        // Never consumed at all: still growing.
        assert!(reconnects.after(None) >= max);
        // A connection that lived long starts the pauses afresh.
        assert!(reconnects.after(Some(LIVED_LONG)) < Duration::from_millis(200));
    }
}
