//! Testing handlers (feature `testing`): run a handler as the worker would, with no
//! broker, and check that it stays idempotent through the hazards a real deployment
//! brings (docs/DESIGN.md, "Testing handlers").
//!
//! A [`TestWorker`] decides each message it is given through the real store, the worker's
//! decision table and its batched claims and completions, in leased or transactional
//! mode, and answers what the worker would have told the broker ([`Delivered`]). Its
//! [`TestWorker::check`] runs a handler through redeliveries, concurrent copies, a crash
//! between the effect and its record, a retried failure, an uncertain outcome, another
//! payload under the same key and a replayed dead letter, counting the effects of each
//! intent with a closure of yours; it fails naming the hazard that doubled or lost one.
//! A [`FakeProvider`] stands in for an external API (payments, e-mail) that can fail
//! before accepting, accept and time out, or be down.
//!
//! It needs a migrated Postgres database (`#[sqlx::test(migrator = "idem::db::MIGRATOR")]`
//! gives one per test) and no RabbitMQ.
//!
//! ```no_run
//! # use idem::{Context, Handler, HandlerError};
//! # struct Orders;
//! # impl Handler for Orders {
//! #     type Message = serde_json::Value; type Output = ();
//! #     const OPERATION: &'static str = "orders.create";
//! #     fn scope(&self, _: &serde_json::Value) -> String { "acme".into() }
//! #     fn idempotency_key(&self, m: &serde_json::Value) -> String { m["event_id"].as_str().unwrap_or("").into() }
//! #     async fn handle(&self, _: serde_json::Value, _: &mut Context) -> Result<(), HandlerError> { Ok(()) }
//! # }
//! # async fn test(pool: sqlx::PgPool) {
//! use idem::testing::TestWorker;
//! use serde_json::json;
//!
//! let worker = TestWorker::new(Orders, pool);
//! let passed = worker
//!     .check()
//!     .run(
//!         |n| json!({"event_id": format!("evt-{n}"), "amount_cents": 1250}),
//!         |pool, order| async move {
//!             sqlx::query_scalar("SELECT count(*) FROM ledger WHERE event_id = $1")
//!                 .bind(order["event_id"].as_str())
//!                 .fetch_one(&pool)
//!                 .await
//!                 .unwrap()
//!         },
//!     )
//!     .await
//!     .unwrap();   // or a panic naming the hazard: "after a crash ...: 2 effects"
//! assert!(passed.skipped.len() <= 2);
//! # }
//! ```

mod check;
mod hazard;
mod provider;

use std::time::Duration;

use lapin::BasicProperties;
use serde::Deserialize;
use serde_json::Value;
use sqlx::PgPool;

pub use check::{Check, CheckFailed, Passed};
pub use hazard::Hazard;
pub use provider::{Failing, FakeProvider, ProviderError, Receipt};

use crate::handler::{Envelope, Handler};
use crate::key::Key;
use crate::store::{Record, Status, Store, StoreConfig, StoreError};
use crate::worker::{Local, LocalDecision, Mode, Outcome, Settle, WorkerConfig};

/// A worker without a broker: it decides each message given to it as a worker decides a
/// delivery, through the real store and decision table, and answers what it would have
/// told the broker. Follow-up messages stay in the outbox.
pub struct TestWorker<H: Handler> {
    local: Local<H>,
}

/// What the worker decided for one delivery, and what it would have told the broker.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Delivered {
    /// What became of it, as logs and metrics name it.
    pub outcome: Outcome,
    /// What the broker would be told.
    pub settled: Settled,
    /// The operation's record after the delivery (none without a valid key).
    pub record: Option<Record>,
    /// Order per entity ([`crate::Handler::ordering`]): the deliveries that waited for
    /// their turn and were handed it when this one completed, one after the other,
    /// decided next as a worker decides them in process. Empty otherwise.
    pub then: Vec<Delivered>,
}

impl Delivered {
    /// The handler's stored output, once the operation completed.
    pub fn output(&self) -> Option<&Value> {
        self.record.as_ref().and_then(|r| r.result.as_ref())
    }
}

/// What the worker would have told the broker about a delivery.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Settled {
    /// Acked: done, or nothing to do.
    Acked,
    /// Sent through the retry queue of this delay: it comes back later.
    Retried {
        /// The retry queue's delay.
        delay: Duration,
    },
    /// Put back in its queue after this pause (no retry queues configured).
    Requeued {
        /// The pause.
        after: Duration,
    },
    /// Dead-lettered (its record pinned, as a worker's dead letter pins it).
    DeadLettered {
        /// `idem-reason`: `malformed`, `fingerprint_conflict`, `permanent_failure`,
        /// `retries_exhausted` or `undecidable`.
        reason: &'static str,
        /// `idem-error`.
        error: String,
    },
}

/// Why a delivery could not be decided at all (a worker would requeue it and try again).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestError {
    /// The store failed or could not be reached.
    #[error("the delivery could not be decided: {0}")]
    Undecided(String),
    /// The store failed while the kit read or prepared a record.
    #[error("the store failed: {}", crate::text::error_line(.0))]
    Store(#[from] StoreError),
    /// The message has no key to look its record up by (it does not fit the handler's
    /// message type, or its key is invalid).
    #[error("{0}")]
    NoKey(String),
}

impl<H: Handler> TestWorker<H> {
    /// A worker of `handler` on `pool`, which must be migrated, in leased mode. Call it
    /// inside a Tokio runtime (`#[sqlx::test]` and `#[tokio::test]` give one).
    pub fn new(handler: H, pool: PgPool) -> Self {
        let config = test_config(Mode::Leased, &pool);
        Self::with_config(handler, Store::new(pool, StoreConfig::default()), config)
    }

    /// A worker of `handler` on `pool` in transactional mode: each delivery is claimed,
    /// run and recorded in one transaction.
    pub fn transactional(handler: H, pool: PgPool) -> Self {
        let config = test_config(Mode::Transactional, &pool);
        Self::with_config(handler, Store::new(pool, StoreConfig::default()), config)
    }

    /// A worker of `handler` on `store` with `config` (its broker settings, tally, gc and
    /// relay are not used).
    pub fn with_config(handler: H, store: Store, config: WorkerConfig) -> Self {
        Self {
            local: Local::new(handler, store, config),
        }
    }

    /// The worker's store, to read records or to operate on them as an operator would.
    pub fn store(&self) -> &Store {
        self.local.store()
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        self.local.handler()
    }

    /// The execution mode.
    pub fn mode(&self) -> Mode {
        self.local.config().mode
    }

    /// Decides one delivery of `message` (as its JSON body).
    pub async fn deliver(&self, message: &Value) -> Result<Delivered, TestError> {
        self.deliver_bytes(message.to_string().as_bytes()).await
    }

    /// Decides one delivery of `body`, which need not be valid JSON.
    pub async fn deliver_bytes(&self, body: &[u8]) -> Result<Delivered, TestError> {
        self.deliver_with(body, &BasicProperties::default()).await
    }

    /// Replays `message`'s dead letter as `idem dlq replay` does once its cause is
    /// fixed: a failed record is made retryable again and the message is delivered with
    /// `idem-replays` one higher than `properties` say; a completed operation is only
    /// acked (`None`), not run again. The message must have been dead-lettered for a
    /// failure (`permanent_failure` or `retries_exhausted`), which pins its record.
    pub async fn replay(&self, message: &Value) -> Result<Option<Delivered>, TestError> {
        self.replay_with(message, &BasicProperties::default()).await
    }

    /// [`TestWorker::replay`] of a message delivered with `properties`.
    pub async fn replay_with(
        &self,
        message: &Value,
        properties: &BasicProperties,
    ) -> Result<Option<Delivered>, TestError> {
        let key = self.key_of(message)?;
        let store = self.store();
        if store.prepare_replay(&key, true).await?.is_none()
            && store
                .get(&key)
                .await?
                .is_some_and(|r| r.status == Status::Completed)
        {
            store.unpin(&key).await?;
            return Ok(None);
        }
        let properties = crate::dead_letter::replay_properties(properties);
        self.deliver_with(message.to_string().as_bytes(), &properties)
            .await
            .map(Some)
    }

    /// Decides one delivery of `body` with the AMQP `properties` a producer set (a
    /// `type`, a `message_id`, a `correlation_id`, headers), as published to the
    /// worker's queue on the default exchange.
    pub async fn deliver_with(
        &self,
        body: &[u8],
        properties: &BasicProperties,
    ) -> Result<Delivered, TestError> {
        let envelope = self.envelope(properties);
        let mut decision = self
            .local
            .decide(body, envelope)
            .await
            .map_err(|e| TestError::Undecided(crate::text::error_line(&e)))?;
        let mut then = Vec::with_capacity(decision.then.len());
        for next in std::mem::take(&mut decision.then) {
            then.push(self.delivered(next).await?);
        }
        let mut delivered = self.delivered(decision).await?;
        delivered.then = then;
        Ok(delivered)
    }

    /// What one decision of the worker comes to, with the record it left.
    async fn delivered(&self, decision: LocalDecision) -> Result<Delivered, TestError> {
        let record = match &decision.key {
            Some(key) => self.store().get(key).await?,
            None => None,
        };
        Ok(Delivered {
            outcome: decision.outcome,
            settled: settled(decision.settle),
            record,
            then: Vec::new(),
        })
    }

    /// What a handler sees of a delivery with `properties`: published to the worker's
    /// queue on the default exchange, not redelivered.
    pub(crate) fn envelope(&self, properties: &BasicProperties) -> Envelope {
        Envelope {
            exchange: String::new(),
            routing_key: self.local.config().queue.clone(),
            redelivered: false,
            properties: properties.clone(),
        }
    }

    /// The settings the worker runs with.
    pub(crate) fn config(&self) -> &WorkerConfig {
        self.local.config()
    }

    /// The operation key the handler gives `message`.
    pub(crate) fn key_of(&self, message: &Value) -> Result<Key, TestError> {
        let handler = self.handler();
        let typed = H::Message::deserialize(message)
            .map_err(|e| TestError::NoKey(format!("the message does not fit the handler: {e}")))?;
        Key::new(
            handler.scope(&typed),
            H::OPERATION,
            handler.idempotency_key(&typed),
        )
        .map_err(|e| TestError::NoKey(format!("the message has no valid key: {e}")))
    }

    /// Checks the handler's idempotency: see [`Check`].
    pub fn check(&self) -> Check<'_, H> {
        Check::new(self)
    }
}

/// Settings for a test: a queue name of its own, no tally, gc or relay, a short
/// in-process backoff, and one delivery per claim batch with up to eight batches at
/// once, so that copies delivered together race in Postgres as they would on several
/// workers. A transactional batch holds a connection and its handler may take another,
/// so at most half the pool's connections are batches.
fn test_config(mode: Mode, pool: &PgPool) -> WorkerConfig {
    let mut config = WorkerConfig {
        queue: "idem-testing".into(),
        mode,
        tally_every: None,
        gc_every: None,
        ..WorkerConfig::default()
    };
    config.outbox.relay = false;
    config.batch_size = 1;
    config.batches_in_flight = (pool.options().get_max_connections() as usize / 2).clamp(1, 8);
    config.retry.min_backoff = Duration::from_millis(10);
    config.retry.max_backoff = Duration::from_millis(50);
    config
}

fn settled(settle: Settle) -> Settled {
    match settle {
        Settle::Ack | Settle::AckWaiting => Settled::Acked,
        Settle::Retry { delay, .. } => Settled::Retried { delay },
        Settle::Requeue { after } => Settled::Requeued { after },
        Settle::DeadLetter(order) => Settled::DeadLettered {
            reason: order.reason.as_str(),
            error: order.error,
        },
    }
}
