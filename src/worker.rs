//! The worker: consumes a queue and decides every delivery by its record.
//!
//! For each delivery (DESIGN.md, "One delivery, decided by the record"): parse, derive
//! the key, claim it, run the handler only when the store says so, record the outcome,
//! and only then ack. Retries and dead letters are published with publisher confirms
//! before the original is acked. The broker connection is re-established with backoff
//! whenever it drops; deliveries in flight at that moment come back as redeliveries and
//! are decided by the store again.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, Span, debug, error, field, info, info_span, warn};

use crate::acks::Acks;
use crate::batch::Batcher;
use crate::dead_letter::{self, DeadLetter, Reason};
use crate::failpoint;
use crate::fingerprint::Fingerprint;
use crate::handler::{Context, Handler, HandlerError, Reconciliation};
use crate::key::Key;
use crate::metrics::{self, BrokerHealth};
use crate::retry::{RetryPolicy, retry_queue_name};
use crate::store::{Claim, ClaimInput, Lease, Store, StoreError};
use crate::topology::{self, QueueType, Topology};

/// Worker settings.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// AMQP URL of the broker.
    pub amqp_url: String,
    /// The work queue.
    pub queue: String,
    /// Classic or quorum queues.
    pub queue_type: QueueType,
    /// Handlers running at once.
    pub concurrency: usize,
    /// Unacked deliveries the broker sends ahead (basic.qos).
    pub prefetch: u16,
    /// How transient failures are retried.
    pub retry: RetryPolicy,
    /// How long a shutdown waits for in-flight handlers before closing anyway.
    pub shutdown_timeout: Duration,
    /// Longest wait between reconnection attempts to the broker.
    pub max_reconnect_delay: Duration,
    /// The connection name shown by the broker.
    pub name: String,
    /// Run garbage collection of expired records this often (`None`: leave it to
    /// `idem gc`).
    pub gc_every: Option<Duration>,
    /// Rows deleted per short transaction by the periodic garbage collection.
    pub gc_batch: i64,
    /// Most claims (and most completions) written in one statement. Deliveries that
    /// arrive together share a statement and a commit; 1 turns batching off.
    pub batch_size: usize,
    /// How long a batch waits for more after its first request, and the longest that
    /// decided acks are held to go out together (they go as soon as requests pause).
    pub batch_linger: Duration,
    /// Batches of claims (and of completions) running at once, each on its own
    /// connection.
    pub batches_in_flight: usize,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            amqp_url: topology::DEFAULT_AMQP_URL.into(),
            queue: "idem".into(),
            queue_type: QueueType::Classic,
            concurrency: 16,
            prefetch: 64,
            retry: RetryPolicy::default(),
            shutdown_timeout: Duration::from_secs(30),
            max_reconnect_delay: Duration::from_secs(5),
            name: format!("idem-worker-{}", std::process::id()),
            gc_every: None,
            gc_batch: 1000,
            batch_size: 128,
            batch_linger: Duration::from_millis(1),
            batches_in_flight: 3,
        }
    }
}

/// Why the worker stopped or a delivery could not be decided.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The broker failed or could not be reached.
    #[error("broker: {0}")]
    Broker(#[from] lapin::Error),
    /// The store failed or could not be reached.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// A retry or dead letter was not published.
    #[error("publish: {0}")]
    Publish(#[from] topology::PublishError),
    /// The broker ended the consumer (queue deleted, or the channel closed).
    #[error("the broker cancelled the consumer")]
    ConsumerCancelled,
}

/// What became of one delivery: the `outcome` field of the `delivery decided` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The handler ran and its result was recorded.
    Executed,
    /// Already completed: acked without running.
    DuplicateCompleted,
    /// Another worker holds the lease: sent to a retry queue.
    DuplicateInProgress,
    /// Failed for good earlier: acked without running.
    DuplicateFailed,
    /// Same key, other payload: dead-lettered.
    Conflict,
    /// Not a valid message: dead-lettered.
    Malformed,
    /// Transient failure: sent to a retry queue.
    FailedTransient,
    /// Permanent failure: dead-lettered.
    FailedPermanent,
    /// Transient failures outlasted the retries: dead-lettered.
    RetriesExhausted,
    /// Uncertain outcome: recorded as pending, sent to a retry queue to reconcile.
    Pending,
    /// A pending operation was reconciled as applied and completed.
    Reconciled,
    /// The lease was lost to another worker before the outcome was written.
    LeaseLost,
    /// The store or broker failed: requeued for another try.
    Requeued,
}

impl Outcome {
    /// The name used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::DuplicateCompleted => "duplicate_completed",
            Outcome::DuplicateInProgress => "duplicate_in_progress",
            Outcome::DuplicateFailed => "duplicate_failed",
            Outcome::Conflict => "conflict",
            Outcome::Malformed => "malformed",
            Outcome::FailedTransient => "failed_transient",
            Outcome::FailedPermanent => "failed_permanent",
            Outcome::RetriesExhausted => "retries_exhausted",
            Outcome::Pending => "pending",
            Outcome::Reconciled => "reconciled",
            Outcome::LeaseLost => "lease_lost",
            Outcome::Requeued => "requeued",
        }
    }
}

/// Consumes one queue with one [`Handler`].
pub struct Worker<H: Handler> {
    handler: H,
    store: Store,
    config: WorkerConfig,
    topology: Topology,
    broker: BrokerHealth,
}

/// What every delivery's task shares.
struct Shared<H> {
    handler: H,
    store: Store,
    config: WorkerConfig,
    /// Claims of deliveries that arrive together, in one statement.
    claims: Batcher<ClaimInput, Claim>,
    /// Completions without a handler transaction, in one statement.
    completions: Batcher<(Lease, Value), bool>,
}

impl<H: Handler> Worker<H> {
    /// A worker running `handler` on `store` (whose lease time is the claim lease).
    pub fn new(handler: H, store: Store, config: WorkerConfig) -> Self {
        let topology = Topology {
            queue: config.queue.clone(),
            queue_type: config.queue_type,
            retry_delays: config.retry.delays.clone(),
        };
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
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        let Worker {
            handler,
            store,
            config,
            topology,
            broker,
        } = self;
        let claims = {
            let store = store.clone();
            Batcher::spawn(
                config.batch_size,
                config.batch_linger,
                config.batches_in_flight,
                move |inputs| {
                    let store = store.clone();
                    async move { store.claim_many(&inputs).await }
                },
            )
        };
        let completions = {
            let store = store.clone();
            Batcher::spawn(
                config.batch_size,
                config.batch_linger,
                config.batches_in_flight,
                move |items| {
                    let store = store.clone();
                    async move { store.complete_many(&items).await }
                },
            )
        };
        if let Some(every) = config.gc_every {
            tokio::spawn(collect_garbage(
                store.clone(),
                every,
                config.gc_batch,
                shutdown.clone(),
            ));
        }
        let shared = Arc::new(Shared {
            handler,
            store,
            config,
            claims,
            completions,
        });
        let session = Session {
            shared: shared.clone(),
            topology,
            broker,
        };
        let tasks = TaskTracker::new();
        let permits = Arc::new(Semaphore::new(shared.config.concurrency.max(1)));
        let mut backoff = session.reconnect_backoff();
        // Whether a session already waited for the handlers in flight on shutdown.
        let mut drained = false;
        while !shutdown.is_cancelled() {
            let result = session.run(&shutdown, &tasks, &permits).await;
            session.broker.set(false);
            match result {
                Ok(()) => {
                    drained = true;
                    break;
                }
                Err(SessionError { connected, error }) => {
                    if connected {
                        backoff = session.reconnect_backoff();
                    }
                    let delay = backoff.next().unwrap_or(shared.config.max_reconnect_delay);
                    warn!(error = %error, retry_in_ms = delay.as_millis() as u64, "broker connection lost, reconnecting");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.cancelled() => {}
                    }
                }
            }
        }
        tasks.close();
        // Stopped while reconnecting: handlers from the dropped connection may still be
        // running; let them finish (their acks go nowhere, their outcomes count).
        if !drained
            && tokio::time::timeout(shared.config.shutdown_timeout, tasks.wait())
                .await
                .is_err()
        {
            warn!(
                running = tasks.len(),
                "shutdown timeout: handlers still running are abandoned; their messages will be redelivered"
            );
        }
        info!("worker stopped");
        Ok(())
    }
}

/// The broker side of a running worker: one connection at a time.
struct Session<H> {
    shared: Arc<Shared<H>>,
    topology: Topology,
    broker: BrokerHealth,
}

impl<H: Handler> Session<H> {
    fn reconnect_backoff(&self) -> impl Iterator<Item = Duration> + use<H> {
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(self.shared.config.max_reconnect_delay)
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// One broker connection: declare, consume, dispatch. Returns `Ok` on shutdown.
    async fn run(
        &self,
        shutdown: &CancellationToken,
        tasks: &TaskTracker,
        permits: &Arc<Semaphore>,
    ) -> Result<(), SessionError> {
        let config = &self.shared.config;
        let not_connected = |error: lapin::Error| SessionError {
            connected: false,
            error: error.into(),
        };
        let connection = topology::connect(&config.amqp_url, &config.name)
            .await
            .map_err(not_connected)?;
        let consume = connection.create_channel().await.map_err(not_connected)?;
        consume
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .await
            .map_err(not_connected)?;
        self.topology
            .declare(&consume)
            .await
            .map_err(not_connected)?;
        let publish = connection.create_channel().await.map_err(not_connected)?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(not_connected)?;
        let mut consumer = consume
            .basic_consume(
                config.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(not_connected)?;
        let acks = Acks::spawn(consume.clone(), config.batch_linger);
        info!(queue = %config.queue, prefetch = config.prefetch, concurrency = config.concurrency, "consuming");
        self.broker.set(true);

        let lost = |error: WorkerError| SessionError {
            connected: true,
            error,
        };
        loop {
            let permit = tokio::select! {
                permit = permits.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => break,
                },
                _ = shutdown.cancelled() => break,
            };
            let next = tokio::select! {
                next = consumer.next() => next,
                _ = shutdown.cancelled() => break,
            };
            match next {
                Some(Ok(delivery)) => {
                    acks.delivered(delivery.delivery_tag);
                    let shared = self.shared.clone();
                    let (publish, acks) = (publish.clone(), acks.clone());
                    tasks.spawn(async move {
                        process(&shared, &publish, &acks, delivery).await;
                        drop(permit);
                    });
                }
                Some(Err(error)) => return Err(lost(error.into())),
                None => return Err(lost(WorkerError::ConsumerCancelled)),
            }
        }

        info!("shutting down: no new deliveries, waiting for handlers in flight");
        let _ = consume
            .basic_cancel(consumer.tag(), BasicCancelOptions::default())
            .await;
        tasks.close();
        if tokio::time::timeout(config.shutdown_timeout, tasks.wait())
            .await
            .is_err()
        {
            warn!(
                running = tasks.len(),
                "shutdown timeout: closing with handlers still running; their messages will be redelivered"
            );
        }
        acks.flush().await;
        // Deliveries prefetched but never started are requeued by the broker on close.
        let _ = consume.close(200, "shutdown".into()).await;
        let _ = publish.close(200, "shutdown".into()).await;
        let _ = connection.close(200, "shutdown".into()).await;
        Ok(())
    }
}

struct SessionError {
    /// Whether the session got as far as consuming (then the backoff starts afresh).
    connected: bool,
    error: WorkerError,
}

/// Decides one delivery inside its span, and requeues it if the store or broker failed.
async fn process<H: Handler>(
    shared: &Shared<H>,
    publish: &Channel,
    acks: &Acks,
    delivery: Delivery,
) {
    let span = info_span!(
        "delivery",
        queue = %shared.config.queue,
        operation = H::OPERATION,
        scope = field::Empty,
        key = field::Empty,
        attempt = field::Empty,
        redelivered = delivery.redelivered,
    );
    let received = Instant::now();
    async {
        let outcome = match decide(shared, publish, acks, &delivery).await {
            Ok(outcome) => outcome,
            Err(error) => {
                error!(error = %error, "delivery not decided; requeueing it");
                // Wait a moment so an outage does not turn into a hot redelivery loop.
                tokio::time::sleep(Duration::from_millis(500)).await;
                acks.nack(delivery.delivery_tag, true);
                Outcome::Requeued
            }
        };
        metrics::delivery(H::OPERATION, outcome.as_str());
        let elapsed_ms = received.elapsed().as_secs_f64() * 1000.0;
        info!(outcome = outcome.as_str(), elapsed_ms, "delivery decided");
    }
    .instrument(span)
    .await
}

/// A message that passed parsing; the typed message travels beside it, since the
/// handler consumes it.
struct Parsed {
    value: Value,
    key: Key,
    fingerprint: Fingerprint,
}

fn parse<H: Handler>(handler: &H, body: &[u8]) -> Result<(Parsed, H::Message), String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("body is not JSON: {e}"))?;
    if !value.is_object() {
        return Err("body is not a JSON object".into());
    }
    let message = H::Message::deserialize(&value)
        .map_err(|e| format!("body does not fit the message: {e}"))?;
    let key = Key::new(
        handler.scope(&message),
        H::OPERATION,
        handler.idempotency_key(&message),
    )
    .map_err(|e| format!("invalid key: {e}"))?;
    let fingerprint = Fingerprint::of(&value, handler.volatile_fields());
    Ok((
        Parsed {
            value,
            key,
            fingerprint,
        },
        message,
    ))
}

async fn decide<H: Handler>(
    shared: &Shared<H>,
    publish: &Channel,
    acks: &Acks,
    delivery: &Delivery,
) -> Result<Outcome, WorkerError> {
    let broker = Broker {
        acks,
        operation: H::OPERATION,
        store: &shared.store,
        channel: publish,
        delivery,
        queue: &shared.config.queue,
        retry: &shared.config.retry,
    };
    let (parsed, message) = match parse(&shared.handler, &delivery.data) {
        Ok(parsed) => parsed,
        Err(why) => {
            broker
                .dead_letter(Reason::Malformed, &why, None, 0, None)
                .await?;
            return Ok(Outcome::Malformed);
        }
    };
    let span = Span::current();
    span.record("scope", parsed.key.scope());
    span.record("key", parsed.key.short_hash());
    let properties = &delivery.properties;
    let input = ClaimInput {
        key: parsed.key.clone(),
        fingerprint: parsed.fingerprint.clone(),
        message_id: properties.message_id().as_ref().map(|s| s.to_string()),
        correlation_id: properties.correlation_id().as_ref().map(|s| s.to_string()),
    };
    let store = &shared.store;
    let mut immediate = shared.config.retry.immediate_backoff();
    let mut message = Some(message);
    loop {
        let claim = shared.claims.call(input.clone()).await?;
        let run = match claim {
            Claim::Claimed(lease) => {
                span.record("attempt", lease.attempt);
                failpoint::hit("after-claim");
                run(shared, &parsed, message.take(), &lease).await?
            }
            Claim::Completed { .. } => {
                broker.ack().await?;
                return Ok(Outcome::DuplicateCompleted);
            }
            Claim::InProgress { .. } => {
                broker.retry_later().await?;
                return Ok(Outcome::DuplicateInProgress);
            }
            Claim::Conflict { .. } => {
                let why = "the key was already used with another payload; a changed payload needs a new key";
                broker
                    .dead_letter(Reason::FingerprintConflict, why, Some(&parsed.key), 0, None)
                    .await?;
                return Ok(Outcome::Conflict);
            }
            Claim::FailedForGood {
                id,
                error,
                attempts,
                dead_lettered,
            } => {
                if !dead_lettered {
                    // The worker that failed it died before publishing the dead letter.
                    let why = error_text(error.as_ref());
                    broker
                        .dead_letter(
                            Reason::PermanentFailure,
                            &why,
                            Some(&parsed.key),
                            i64::from(attempts),
                            Some(id),
                        )
                        .await?;
                    return Ok(Outcome::FailedPermanent);
                }
                broker.ack().await?;
                return Ok(Outcome::DuplicateFailed);
            }
            Claim::Pending {
                lease,
                external_ref,
            } => {
                span.record("attempt", lease.attempt);
                reconcile(
                    shared,
                    &parsed,
                    message.take(),
                    &lease,
                    external_ref.as_deref(),
                )
                .await?
            }
        };
        match run {
            Run::Completed { reconciled } => {
                failpoint::hit("after-complete");
                broker.ack().await?;
                return Ok(if reconciled {
                    Outcome::Reconciled
                } else {
                    Outcome::Executed
                });
            }
            Run::LeaseLost => {
                warn!("lease lost to another worker; its outcome decides");
                broker.retry_later().await?;
                return Ok(Outcome::LeaseLost);
            }
            Run::Transient { lease } => {
                if let Some(delay) = immediate.next() {
                    debug!(
                        delay_ms = delay.as_millis() as u64,
                        "transient failure, retrying in process"
                    );
                    tokio::time::sleep(delay).await;
                    continue;
                }
                return match broker.retry_counted().await? {
                    true => Ok(Outcome::FailedTransient),
                    false => {
                        let record = store.get(&parsed.key).await?;
                        let why = error_text(record.as_ref().and_then(|r| r.error.as_ref()));
                        broker
                            .dead_letter(
                                Reason::RetriesExhausted,
                                &why,
                                Some(&parsed.key),
                                i64::from(lease.attempt),
                                Some(lease.id),
                            )
                            .await?;
                        Ok(Outcome::RetriesExhausted)
                    }
                };
            }
            Run::Permanent { lease, error } => {
                broker
                    .dead_letter(
                        Reason::PermanentFailure,
                        &error,
                        Some(&parsed.key),
                        i64::from(lease.attempt),
                        Some(lease.id),
                    )
                    .await?;
                return Ok(Outcome::FailedPermanent);
            }
            Run::Pending => {
                return match broker.retry_counted().await? {
                    true => Ok(Outcome::Pending),
                    false => {
                        let why = "outcome still unknown after every retry; reconcile by hand";
                        broker
                            .dead_letter(Reason::RetriesExhausted, why, Some(&parsed.key), 0, None)
                            .await?;
                        Ok(Outcome::RetriesExhausted)
                    }
                };
            }
        }
    }
}

/// The message again, for a second run (the handler consumed the first).
fn rebuild<H: Handler>(value: &Value) -> Result<H::Message, WorkerError> {
    H::Message::deserialize(value).map_err(|e| {
        WorkerError::Store(StoreError::Unexpected(format!(
            "message no longer parses: {e}"
        )))
    })
}

fn error_text(error: Option<&Value>) -> String {
    match error {
        Some(Value::Object(map)) => match map.get("error") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => Value::Object(map.clone()).to_string(),
        },
        Some(other) => other.to_string(),
        None => "unknown error".into(),
    }
}

/// How a run of the handler (or a reconciliation) ended, once recorded.
enum Run {
    Completed { reconciled: bool },
    LeaseLost,
    Transient { lease: Lease },
    Permanent { lease: Lease, error: String },
    Pending,
}

/// The message (as parsed, or parsed again for a second run) and a fresh context for a
/// run under `lease`.
fn prepare<H: Handler>(
    shared: &Shared<H>,
    parsed: &Parsed,
    message: Option<H::Message>,
    lease: &Lease,
) -> Result<(H::Message, Context), WorkerError> {
    let message = match message {
        Some(message) => message,
        None => rebuild::<H>(&parsed.value)?,
    };
    let ctx = Context::new(
        parsed.key.clone(),
        lease.attempt,
        lease.takeover,
        shared.store.pool().clone(),
    );
    Ok((message, ctx))
}

/// Awaits a call into the handler while heartbeats keep `lease` alive; a panic counts
/// as a transient failure (the message is retried, never lost, the worker lives on).
///
/// The heartbeat runs in the same task as the call, so a short handler costs a timer,
/// not a task. A handler that blocks its thread stops its heartbeats too: it becomes a
/// zombie whose outcome the fencing token refuses, as if its process had stalled.
async fn guarded<T>(
    store: &Store,
    lease: &Lease,
    call: impl Future<Output = Result<T, HandlerError>>,
) -> Result<T, HandlerError> {
    let call = AssertUnwindSafe(call).catch_unwind();
    let beat = heartbeat(store, lease);
    tokio::pin!(call, beat);
    tokio::select! {
        biased;
        done = &mut call => {
            done.unwrap_or_else(|panic| Err(HandlerError::transient(panic_text(&panic))))
        }
        never = &mut beat => match never {},
    }
}

/// Runs the handler under `lease` with a heartbeat, and records its outcome.
async fn run<H: Handler>(
    shared: &Shared<H>,
    parsed: &Parsed,
    message: Option<H::Message>,
    lease: &Lease,
) -> Result<Run, WorkerError> {
    let (message, mut ctx) = prepare(shared, parsed, message, lease)?;
    if lease.takeover {
        metrics::delivery(H::OPERATION, "takeover");
    }
    let started = Instant::now();
    let result = guarded(
        &shared.store,
        lease,
        shared.handler.handle(message, &mut ctx),
    )
    .await;
    metrics::handler_duration(H::OPERATION, started.elapsed());
    failpoint::hit("after-effect");
    record(shared, &mut ctx, lease, result, false).await
}

/// Asks the handler what became of a pending operation, and acts on the answer.
async fn reconcile<H: Handler>(
    shared: &Shared<H>,
    parsed: &Parsed,
    message: Option<H::Message>,
    lease: &Lease,
    external_ref: Option<&str>,
) -> Result<Run, WorkerError> {
    let (message, mut ctx) = prepare(shared, parsed, message, lease)?;
    let reconciling = shared.handler.reconcile(&message, external_ref, &mut ctx);
    let answer = guarded(&shared.store, lease, reconciling).await;
    match answer {
        Ok(Reconciliation::Applied(output)) => {
            record(shared, &mut ctx, lease, Ok(output), true).await
        }
        Ok(Reconciliation::NotApplied) => {
            info!("reconcile: not applied, running the handler again");
            drop(ctx);
            run(shared, parsed, Some(message), lease).await
        }
        Ok(Reconciliation::Unknown) => {
            let error = HandlerError::uncertain(None, "reconcile: outcome still unknown");
            record(shared, &mut ctx, lease, Err(error), true).await
        }
        Err(error) => {
            // A failing reconciliation says nothing about the effect: stay pending.
            let error = match error {
                HandlerError::Permanent(e) => HandlerError::Permanent(e),
                other => {
                    HandlerError::uncertain(None, format!("reconcile failed: {}", other.message()))
                }
            };
            record(shared, &mut ctx, lease, Err(error), true).await
        }
    }
}

/// Writes the outcome, fenced by the lease; a success commits the handler's transaction
/// together with the `completed` record.
async fn record<H: Handler>(
    shared: &Shared<H>,
    ctx: &mut Context,
    lease: &Lease,
    result: Result<H::Output, HandlerError>,
    reconciling: bool,
) -> Result<Run, WorkerError> {
    let store = &shared.store;
    let tx = ctx.take_tx();
    let fenced = |r: Result<(), StoreError>, run: Run| match r {
        Ok(()) => Ok(run),
        Err(StoreError::LeaseLost { .. }) => Ok(Run::LeaseLost),
        Err(e) => Err(WorkerError::Store(e)),
    };
    match result {
        Ok(output) => {
            let output = match serde_json::to_value(output) {
                Ok(output) => output,
                Err(e) => {
                    drop(tx);
                    let error = format!("handler output does not serialize: {e}");
                    let r = store
                        .fail(lease, false, &json!({"error": error, "kind": "permanent"}))
                        .await;
                    return fenced(
                        r,
                        Run::Permanent {
                            lease: lease.clone(),
                            error,
                        },
                    );
                }
            };
            let done = Run::Completed {
                reconciled: reconciling,
            };
            match tx {
                None => match shared.completions.call((lease.clone(), output)).await? {
                    true => Ok(done),
                    false => Ok(Run::LeaseLost),
                },
                Some(mut tx) => match store.complete_in(&mut *tx, lease, &output).await {
                    Ok(()) => {
                        failpoint::hit("before-commit");
                        tx.commit().await.map_err(StoreError::from)?;
                        Ok(done)
                    }
                    Err(StoreError::LeaseLost { .. }) => {
                        // A zombie: another worker owns the operation; undo our writes.
                        let _ = tx.rollback().await;
                        Ok(Run::LeaseLost)
                    }
                    Err(e) => Err(e.into()),
                },
            }
        }
        Err(error) => {
            drop(tx); // the handler's writes roll back
            let text = error.message().to_owned();
            match error {
                HandlerError::Transient(_) => {
                    warn!(error = %text, "handler failed, transient");
                    let r = store
                        .fail(lease, true, &json!({"error": text, "kind": "transient"}))
                        .await;
                    fenced(
                        r,
                        Run::Transient {
                            lease: lease.clone(),
                        },
                    )
                }
                HandlerError::Permanent(_) => {
                    warn!(error = %text, "handler failed, permanent");
                    let r = store
                        .fail(lease, false, &json!({"error": text, "kind": "permanent"}))
                        .await;
                    fenced(
                        r,
                        Run::Permanent {
                            lease: lease.clone(),
                            error: text,
                        },
                    )
                }
                HandlerError::Uncertain { external_ref, .. } => {
                    warn!(error = %text, "outcome uncertain, pending reconciliation");
                    let r = store
                        .mark_pending(
                            lease,
                            external_ref.as_deref(),
                            &json!({"error": text, "kind": "uncertain"}),
                        )
                        .await;
                    fenced(r, Run::Pending)
                }
            }
        }
    }
}

/// Deletes expired records every `every` until shutdown.
async fn collect_garbage(store: Store, every: Duration, batch: i64, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.cancelled() => return,
        }
        match store.gc(batch).await {
            Ok(0) => {}
            Ok(deleted) => info!(deleted, "garbage collection"),
            Err(error) => warn!(error = %error, "garbage collection failed"),
        }
    }
}

/// Extends `lease` every third of the lease time, forever; after the lease is lost it
/// only waits (the outcome write will be refused).
async fn heartbeat(store: &Store, lease: &Lease) -> std::convert::Infallible {
    let every = store.config().lease / 3;
    loop {
        tokio::time::sleep(every).await;
        match store.heartbeat(lease).await {
            Ok(_) => {}
            Err(StoreError::LeaseLost { .. }) => {
                warn!(
                    "heartbeat: lease lost to another worker; this run's outcome will be refused"
                );
                return std::future::pending().await;
            }
            Err(error) => warn!(error = %error, "heartbeat failed; retrying"),
        }
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("handler panicked: {text}")
}

/// Broker actions on one delivery: every publish is confirmed before the ack.
struct Broker<'a> {
    acks: &'a Acks,
    operation: &'static str,
    store: &'a Store,
    channel: &'a Channel,
    delivery: &'a Delivery,
    queue: &'a str,
    retry: &'a RetryPolicy,
}

impl Broker<'_> {
    /// Acks the delivery (coalesced with its neighbours). If the channel is gone by
    /// then, the broker redelivers and the store decides again.
    async fn ack(&self) -> Result<(), WorkerError> {
        self.acks.ack(self.delivery.delivery_tag);
        Ok(())
    }

    async fn publish(&self, queue: &str, properties: BasicProperties) -> Result<(), WorkerError> {
        topology::publish_confirmed(self.channel, queue, &self.delivery.data, properties).await?;
        Ok(())
    }

    /// Publishes the dead letter (confirmed), pins the record it belongs to, and only
    /// then acks. A crash after the publish leaves the record unpinned, so the
    /// redelivery publishes again: a DLQ may hold a key twice, never lose it.
    async fn dead_letter(
        &self,
        reason: Reason,
        error: &str,
        key: Option<&Key>,
        attempts: i64,
        pin: Option<i64>,
    ) -> Result<(), WorkerError> {
        let properties = dead_letter::dead_letter_properties(
            &self.delivery.properties,
            &DeadLetter {
                reason,
                error,
                key,
                operation: self.operation,
                attempts,
                original_queue: self.queue,
            },
        );
        warn!(reason = reason.as_str(), error, "dead-lettering");
        self.publish(&topology::dlq_name(self.queue), properties)
            .await?;
        failpoint::hit("after-publish");
        if let Some(id) = pin {
            self.store.mark_dead_lettered(id).await?;
        }
        metrics::delivery(self.operation, "dead_lettered");
        self.ack().await
    }

    fn retries(&self) -> i64 {
        dead_letter::header_i64(&self.delivery.properties, dead_letter::RETRIES).unwrap_or(0)
    }

    /// Sends the message through the next retry queue, counting the retry. `false`
    /// when the retries are used up (nothing was published).
    async fn retry_counted(&self) -> Result<bool, WorkerError> {
        let retries = self.retries();
        let Some(delay) = usize::try_from(retries)
            .ok()
            .and_then(|r| self.retry.delay(r))
        else {
            return Ok(false);
        };
        let properties = dead_letter::retry_properties(&self.delivery.properties, retries + 1);
        self.publish(&retry_queue_name(self.queue, delay), properties)
            .await?;
        failpoint::hit("after-publish");
        self.ack().await?;
        Ok(true)
    }

    /// Looks again later without counting a retry (another worker is on it). With no
    /// retry queues configured, the message is requeued after a short wait.
    async fn retry_later(&self) -> Result<(), WorkerError> {
        match self.retry.delays.first() {
            Some(delay) => {
                let properties =
                    dead_letter::retry_properties(&self.delivery.properties, self.retries());
                self.publish(&retry_queue_name(self.queue, *delay), properties)
                    .await?;
                self.ack().await
            }
            None => {
                tokio::time::sleep(self.retry.max_backoff).await;
                self.acks.nack(self.delivery.delivery_tag, true);
                Ok(())
            }
        }
    }
}
