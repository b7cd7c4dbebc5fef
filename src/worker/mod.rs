//! The worker: consumes a queue and decides every delivery by its record.
//!
//! For each delivery (docs/DESIGN.md, "One delivery, decided by the record"): parse,
//! derive the key, claim it, run the handler only when the store says so, record the
//! outcome, and only then ack. Retries and dead letters are published with publisher
//! confirms before the original is acked. The broker connection is re-established with
//! backoff whenever it drops; deliveries in flight at that moment come back as
//! redeliveries and are decided by the store again.
//!
//! - `config`: [`WorkerConfig`];
//! - `service`: [`Service`], many handlers on their queues in one process, sharing a
//!   connection to consume on and one to publish on, the relay, the tally flusher and
//!   the gc loop (a [`Worker`] is its one-queue case);
//! - `route`: which handler of a queue a delivery goes to, by message type;
//! - `session`: one queue's channels on those connections (declare, consume, dispatch,
//!   drain);
//! - `decision`: the decision table as pure functions;
//! - `parse`: a delivery's message, key and fingerprint, or why it is malformed;
//! - `execute`: claim, and walk the decision table to the settling step;
//! - `ordered`: order per entity, entered before the claim, moved on after completion;
//! - `hand_on`: the next turn of an entity that moved on, run in the same task;
//! - `handle`: run or reconcile the handler under the lease, and record its outcome;
//! - `follow_ups`: a run's follow-up messages, published after its commit;
//! - `transactional`: transactional mode, a batch of deliveries in one transaction;
//! - `guard`: calls into the handler, panics caught, heartbeats in leased mode;
//! - `settle`: ack, retry, requeue or dead-letter on the broker;
//! - `batch` and `acks`: claims, completions and acks that share a round trip;
//! - `undecided`: the pause while the store fails, and the safety net.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::warn;

mod acks;
mod background;
mod batch;
mod config;
mod decision;
mod execute;
mod follow_ups;
mod guard;
mod hand_on;
mod handle;
#[cfg(feature = "testing")]
mod local;
mod ordered;
mod owned;
mod parse;
mod route;
mod service;
mod session;
mod settle;
mod sweep;
mod transactional;
mod undecided;

pub use config::{Mode, WorkerConfig};
pub use decision::Outcome;
#[cfg(feature = "testing")]
pub(crate) use decision::Settle;
#[cfg(feature = "testing")]
pub(crate) use local::{Local, LocalDecision};
pub(crate) use owned::MARK_AFTER;
pub use route::RouteBy;
pub use service::{Service, ServiceConfig};

use crate::fault::Fault;
use crate::flow::circuit::Circuit;
use crate::handler::Handler;
use crate::metrics::BrokerHealth;
use crate::store::{Claim, ClaimRequest, Lease, Store, StoreError};
use crate::tally::Tally;
use crate::topology::{self, Topology};
use batch::Batcher;
use follow_ups::FollowUps;
use session::{Session, SessionError};
use transactional::{TxAnswer, TxRequest};
use undecided::Undecided;

/// Why [`Worker::run`] returned before its shutdown: the broker refused the worker's
/// queues or access for a reason retrying cannot fix. Every other error heals: the
/// worker retries it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// A queue that exists with other arguments (406 PRECONDITION_FAILED), or a user
    /// without the permissions (403 ACCESS_REFUSED).
    #[error("the broker refused to serve queue {queue}: {reason}")]
    Refused {
        /// The worker's queue.
        queue: String,
        /// What the broker said; it names the queue and the argument that differs.
        reason: String,
    },
    /// A queue's task of a service panicked (a bug of idem's: a handler's panic is
    /// caught where it runs and fails only its delivery); the others were stopped.
    #[error("queue {queue} stopped: idem panicked: {reason}")]
    Crashed {
        /// The queue.
        queue: String,
        /// The panic's message.
        reason: String,
    },
    /// A service that cannot start as assembled (two handlers on one queue, say).
    #[error("the service cannot start: {reason}")]
    Invalid {
        /// What is wrong, naming the queue or operation.
        reason: String,
    },
    /// The store refused the service at start: the keys do not open what they sealed,
    /// a key is missing, or Postgres could not be reached.
    #[error("the service cannot start")]
    Store(#[source] StoreError),
}

/// Why a delivery could not be decided (it is requeued), or why a session ended (the
/// worker reconnects, unless the broker refused it).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Failure {
    /// The broker failed or could not be reached.
    #[error("broker")]
    Broker(#[source] lapin::Error),
    /// The store failed or could not be reached.
    #[error("store")]
    Store(#[from] StoreError),
    /// A retry or dead letter was not published.
    #[error("publish")]
    Publish(#[from] topology::PublishError),
    /// The broker ended the consumer (queue deleted, or the channel closed).
    #[error("the broker cancelled the consumer")]
    ConsumerCancelled,
    /// The connection retries and dead letters are published on was lost.
    #[error("the publishing connection was lost")]
    PublisherLost,
    /// The message parsed for its first run but not for a second one (a handler
    /// whose `Message` type deserializes differently from the same JSON).
    #[error("the message no longer deserializes for another run")]
    Reparse(#[source] serde_json::Error),
    /// The broker refused the worker's queues or access: the worker stops with it.
    #[error("the broker refused to serve queue {queue}: {reason}")]
    Refused { queue: String, reason: String },
    /// An invariant of the worker's own broke (a bug): the delivery is requeued, and
    /// the safety net bounds how often.
    #[error("internal: {0}")]
    Internal(&'static str),
}

impl Failure {
    /// Whose fault the failure is: the store's errors by their cause; the broker's are
    /// outages (the connection heals); a message that no longer deserializes is the
    /// message's; a refused topology is nobody's the worker knows.
    pub(crate) fn fault(&self) -> Fault {
        match self {
            Failure::Store(error) => error.fault(),
            Failure::Broker(_)
            | Failure::Publish(_)
            | Failure::ConsumerCancelled
            | Failure::PublisherLost => Fault::Outage,
            Failure::Reparse(_) => Fault::Message,
            Failure::Refused { .. } | Failure::Internal(_) => Fault::Unknown,
        }
    }

    /// The broker's answer to declaring or consuming `queue`, as a failure: a refusal
    /// that retrying cannot fix becomes [`Failure::Refused`].
    fn opening(error: lapin::Error, queue: &str) -> Self {
        if let lapin::ErrorKind::ProtocolError(amqp) = error.kind()
            && matches!(amqp.get_id(), 403 | 406)
        {
            return Failure::Refused {
                queue: queue.to_owned(),
                reason: amqp.get_message().to_string(),
            };
        }
        Failure::Broker(error)
    }
}

impl From<lapin::Error> for Failure {
    fn from(error: lapin::Error) -> Self {
        Failure::Broker(error)
    }
}

/// Consumes one queue with one [`Handler`]: a [`Service`] of one handler, with every
/// setting in one [`WorkerConfig`].
pub struct Worker<H: Handler> {
    handler: H,
    store: Store,
    config: WorkerConfig,
    topology: Topology,
    broker: BrokerHealth,
}

/// What every delivery's task shares.
struct Runtime<H> {
    handler: Arc<H>,
    store: Store,
    config: WorkerConfig,
    /// Claims of deliveries that arrive together, in one statement.
    claims: Batcher<ClaimRequest, Claim>,
    /// Completions without a handler transaction, in one statement.
    completions: Batcher<(Lease, Value), bool>,
    /// Transactional mode: the deliveries that arrive together, decided in one
    /// transaction (none in leased mode).
    transactions: Option<Batcher<TxRequest, TxAnswer>>,
    /// Entries into and releases of entities' orders, batched.
    orderings: ordered::Orderings,
    /// On a queue with a single active consumer, the statements of owned order (its
    /// positions are the session's, in [`settle::Links`]).
    owner: Option<owned::Owner>,
    /// Deliveries that could not be decided: the outage pause and the safety net.
    undecided: Undecided,
    /// Follow-up messages to publish after their operation's commit.
    follow_ups: FollowUps,
    /// The name of each delivery's consumer span: `process <queue>`.
    process_span: String,
    /// The deliveries' outcomes per minute, for the console (none when
    /// `tally_every` is `None`).
    tally: Option<Arc<Tally>>,
    /// The queue's circuit, when it has a breaker (shared by the queue's handlers).
    circuit: Option<Arc<Circuit>>,
    /// Wakes the process's ordering sweep: a redelivery came.
    sweep_wake: Arc<tokio::sync::Notify>,
}

impl<H: Handler> Worker<H> {
    /// A worker running `handler` on `store` (whose lease time is the claim lease).
    pub fn new(handler: H, store: Store, config: WorkerConfig) -> Self {
        let topology = topology_of(&config);
        Self {
            handler,
            store,
            config,
            topology,
            broker: BrokerHealth::default(),
        }
    }

    /// Whether the worker is connected to the broker and consuming (for `/healthz`).
    pub fn broker_health(&self) -> BrokerHealth {
        self.broker.clone()
    }

    /// The queues this worker declares.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Consumes until `shutdown` is cancelled, reconnecting to the broker with backoff
    /// whenever the connection drops. On shutdown it stops consuming, lets in-flight
    /// handlers finish (up to the shutdown timeout), acks them and closes cleanly.
    ///
    /// Every broker and store error that can heal is retried; it returns `Ok` once
    /// `shutdown` is cancelled, and [`WorkerError::Refused`] when the broker refuses the
    /// topology for good (a queue declared with other arguments, missing permissions).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        let Worker {
            handler,
            store,
            config,
            topology: _,
            broker,
        } = self;
        Service::new(store, ServiceConfig::of(&config))
            .with_health(broker)
            .handler(handler, config)
            .run(shutdown)
            .await
    }
}

/// The queues a worker of `config` declares.
fn topology_of(config: &WorkerConfig) -> Topology {
    Topology {
        queue: config.queue.clone(),
        queue_type: config.queue_type,
        retry_delays: config.retry.delays.clone(),
        subscriptions: config.subscriptions.clone(),
        single_active_consumer: config.single_active_consumer,
    }
}

impl<H: Handler> Runtime<H> {
    /// What the deliveries of a worker share: its handler, store and settings, the
    /// batching loops of its claims, completions and (transactional mode) batches, the
    /// tally its outcomes are counted in (if any) and what its deliveries wake (the
    /// relay when a follow-up's publish fails, the ordering sweep at a redelivery).
    pub(crate) fn new(
        handler: H,
        store: Store,
        config: WorkerConfig,
        tally: Option<Arc<Tally>>,
        wakes: background::Wakes,
        circuit: Option<Arc<Circuit>>,
    ) -> Self {
        let handler = Arc::new(handler);
        let transactions = (config.mode == Mode::Transactional).then(|| {
            let handler = handler.clone();
            // At most 64 deliveries per transaction: the second pass gives each handler
            // a savepoint, and past 64 subtransactions Postgres's snapshots slow down
            // for every session of the database.
            let config = WorkerConfig {
                batch_size: config.batch_size.min(transactional::MAX_BATCH),
                ..config.clone()
            };
            let handoff = config.outbox.handoff;
            let batching = Arc::new(transactional::Batching::default());
            let owned: Option<Arc<str>> = config
                .single_active_consumer
                .then(|| config.queue.as_str().into());
            batched(&store, &config, move |store, requests| {
                let (handler, batching) = (handler.clone(), batching.clone());
                let owned = owned.clone();
                async move {
                    let owned = owned.as_deref();
                    transactional::run(&*handler, &store, &requests, handoff, &batching, owned)
                        .await
                }
            })
        });
        Self {
            transactions,
            claims: batched(&store, &config, |store, requests| async move {
                store.claim_many(&requests).await
            }),
            completions: batched(&store, &config, |store, items| async move {
                store.complete_many(&items).await
            }),
            orderings: ordered::Orderings::new(&store, &config),
            owner: config
                .single_active_consumer
                .then(|| owned::Owner::new(&store, &config, config.mode == Mode::Leased)),
            undecided: Undecided::new(config.undecidable_after),
            follow_ups: FollowUps::new(&store, &config, wakes.relay.clone()),
            sweep_wake: wakes.sweep,
            process_span: format!("process {}", config.queue),
            tally,
            circuit,
            handler,
            store,
            config,
        }
    }
}

/// Runs sessions, one broker connection at a time, reconnecting with backoff, until
/// `shutdown`; then lets the handlers in flight finish. Returns the queue and the
/// reason when the broker refused the topology for good.
async fn consume(session: &Session, shutdown: &CancellationToken) -> Option<(String, String)> {
    let config = &session.config;
    let tasks = TaskTracker::new();
    // With a single active consumer, deliveries are taken up to the prefetch (early ones
    // are parked, acked, at once) and runs are held to the concurrency (owned order's
    // `Positions`).
    let taken = match config.single_active_consumer {
        true => usize::from(config.prefetch).max(config.concurrency),
        false => config.concurrency,
    };
    let permits = Arc::new(Semaphore::new(taken.max(1)));
    let mut reconnects = session::Reconnects::new(config.max_reconnect_delay);
    while !shutdown.is_cancelled() {
        let result = session.run(shutdown, &tasks, &permits).await;
        session.broker.set(&config.queue, false);
        let SessionError { lived, error } = match result {
            // The session drained the handlers in flight itself.
            Ok(()) => return None,
            Err(lost) => lost,
        };
        if let Failure::Refused { queue, reason } = error {
            drain(&tasks, config.shutdown_timeout).await;
            return Some((queue, reason));
        }
        let delay = reconnects.after(lived);
        warn!(error = %crate::text::error_line(&error), retry_in_ms = delay.as_millis() as u64, "broker connection lost, reconnecting");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.cancelled() => {}
        }
    }
    // Stopped while reconnecting: handlers from the dropped connection may still be
    // running; let them finish (their acks go nowhere, their outcomes count).
    drain(&tasks, config.shutdown_timeout).await;
    None
}

/// A batching loop of `config`'s size, linger and parallelism around a store call.
fn batched<Req, Resp, F, Fut>(store: &Store, config: &WorkerConfig, call: F) -> Batcher<Req, Resp>
where
    Req: Clone + Send + Sync + 'static,
    Resp: Send + 'static,
    F: Fn(Store, Arc<[Req]>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Vec<Resp>, StoreError>> + Send + 'static,
{
    let store = store.clone();
    Batcher::spawn(
        config.batch_size,
        config.batch_linger,
        config.batches_in_flight,
        move |requests| call(store.clone(), requests),
    )
}

/// Stops taking tasks and waits for the running ones, at most `timeout`.
async fn drain(tasks: &TaskTracker, timeout: Duration) {
    tasks.close();
    if tokio::time::timeout(timeout, tasks.wait()).await.is_err() {
        warn!(
            running = tasks.len(),
            "shutdown timeout: handlers still running are abandoned; their messages will be redelivered"
        );
    }
}
