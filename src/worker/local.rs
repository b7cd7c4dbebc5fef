//! A worker without a broker, for `crate::testing`: it decides the deliveries handed to
//! it as a worker decides the broker's, through the same walk of the decision table,
//! the same batched claims and completions and the same transactional batches, and
//! tells what it would have told the broker instead of telling it. A dead letter pins
//! its record as a worker's does, so that a replay finds what it would find.

use std::sync::Arc;

use tokio::sync::Notify;
use tracing::Instrument;

use super::decision::{Decided, Outcome, Settle};
use super::execute;
use super::settle::Incoming;
use super::{Failure, Runtime, WorkerConfig};
use crate::fault::Fault;
use crate::handler::{Envelope, Handler};
use crate::key::Key;
use crate::store::{Store, StoreError};

/// The worker's runtime (claims, completions, transactional batches), with no broker,
/// no tally and no background.
pub(crate) struct Local<H> {
    runtime: Runtime<H>,
}

/// What the worker decided for one delivery and would have told the broker.
pub(crate) struct LocalDecision {
    pub(crate) outcome: Outcome,
    pub(crate) settle: Settle,
    /// The message's key, if it had a valid one.
    pub(crate) key: Option<Key>,
}

impl<H: Handler> Local<H> {
    pub(crate) fn new(handler: H, store: Store, config: WorkerConfig) -> Self {
        let runtime = Runtime::new(handler, store, config, None, Arc::new(Notify::new()), None);
        Self { runtime }
    }

    pub(crate) fn handler(&self) -> &H {
        &self.runtime.handler
    }

    pub(crate) fn store(&self) -> &Store {
        &self.runtime.store
    }

    pub(crate) fn config(&self) -> &WorkerConfig {
        &self.runtime.config
    }

    /// Decides one delivery of `data` in `envelope`. Its follow-ups stay in the
    /// outbox (there is no broker to publish them on). A failure of the message's own is
    /// decided as the worker decides it (a malformed dead letter); any other failure
    /// (the store unreachable) is returned: a worker would requeue the delivery.
    pub(crate) async fn decide(
        &self,
        data: &[u8],
        envelope: Envelope,
    ) -> Result<LocalDecision, Failure> {
        let span = execute::delivery_span(&self.runtime, envelope.redelivered);
        let incoming = Incoming::new(data, envelope, None);
        let decided = match execute::walk(&self.runtime, &incoming)
            .instrument(span)
            .await
        {
            Ok(decided) => decided,
            Err(error) if error.fault() == Fault::Message => {
                Decided::without_key(execute::message_fault(&error))
            }
            Err(error) => return Err(error),
        };
        let Decided { verdict, key, .. } = decided;
        if let Settle::DeadLetter(order) = &verdict.action
            && let Some(id) = order.pin
        {
            self.pin(id).await?;
        }
        Ok(LocalDecision {
            outcome: verdict.outcome,
            settle: verdict.action,
            key,
        })
    }

    /// What a worker's published dead letter leaves in the store: its record pinned
    /// and marked as waiting in the DLQ.
    async fn pin(&self, id: i64) -> Result<(), StoreError> {
        let store = &self.runtime.store;
        store.pin(id).await?;
        store.mark_dead_lettered(id).await
    }
}
