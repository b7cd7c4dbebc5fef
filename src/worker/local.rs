//! A worker without a broker, for `crate::testing`: it decides the deliveries handed to
//! it as a worker decides the broker's, through the same walk of the decision table,
//! the same batched claims and completions and the same transactional batches, and
//! tells what it would have told the broker instead of telling it. A dead letter pins
//! its record as a worker's does, so that a replay finds what it would find.

use std::pin::Pin;

use tracing::Instrument;

use super::background::Wakes;
use super::decision::{Decided, Outcome, Settle};
use super::settle::Incoming;
use super::{Failure, Runtime, WorkerConfig, execute, hand_on};
use crate::fault::Fault;
use crate::handler::{Envelope, Handler};
use crate::key::Key;
use crate::ordering::{Released, table};
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
    /// The deliveries its completion handed its entity's turn to, one after the other,
    /// run next as a worker runs them (order per entity).
    pub(crate) then: Vec<LocalDecision>,
}

impl<H: Handler> Local<H> {
    pub(crate) fn new(handler: H, store: Store, config: WorkerConfig) -> Self {
        let runtime = Runtime::new(handler, store, config, None, Wakes::default(), None);
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
    ///
    /// When it completed and its entity's next turn was handed to a delivery that
    /// waited for it, that delivery is decided next, from its waiting row, and so on
    /// ([`LocalDecision::then`]), as a worker hands the turn on in process.
    pub(crate) async fn decide(
        &self,
        data: &[u8],
        envelope: Envelope,
    ) -> Result<LocalDecision, Failure> {
        let incoming = Incoming::new(data, envelope, None);
        let (mut decision, mut released) = self.decide_one(&incoming).await?;
        while let Some(turn) = hand_on::take_turn(&self.runtime, &mut released) {
            let mut incoming = Incoming::new(&turn.body, hand_on::envelope_of(&turn), None);
            incoming.holds_turn = true;
            let (next, more) = self.decide_one(&incoming).await?;
            // Its row goes once it is settled (its copy or dead letter would be
            // published), or back to the sweep when it would be requeued.
            let pool = self.runtime.store.pool();
            match next.settle {
                Settle::Requeue { .. } => table::give_back(pool, &turn).await?,
                _ => table::finish(pool, &turn).await?,
            }
            decision.then.push(next);
            released = more;
        }
        Ok(decision)
    }

    /// Decides one delivery; with what its completion released of its entity's order.
    async fn decide_one(
        &self,
        incoming: &Incoming<'_>,
    ) -> Result<(LocalDecision, Vec<Released>), Failure> {
        let span = execute::delivery_span(&self.runtime, incoming.envelope.redelivered);
        // Boxed: the walk's future is deep (the decision table, ordering, the handler's
        // own), and unboxed it became part of every future of a user's test that awaits
        // the kit, past the compiler's default recursion limit in the user's crate.
        let walk: Pin<Box<dyn Future<Output = _> + Send + '_>> =
            Box::pin(execute::walk(&self.runtime, incoming).instrument(span));
        let decided = match walk.await {
            Ok(decided) => decided,
            Err(error) if error.fault() == Fault::Message => {
                Decided::without_key(execute::message_fault(&error))
            }
            Err(error) => return Err(error),
        };
        let Decided {
            verdict,
            key,
            entity,
            handed,
            ..
        } = decided;
        if let Settle::DeadLetter(order) = &verdict.action
            && let Some(id) = order.pin
        {
            self.pin(id).await?;
        }
        let released = hand_on::released_by(&self.runtime, verdict.outcome, entity, handed).await;
        let decision = LocalDecision {
            outcome: verdict.outcome,
            settle: verdict.action,
            key,
            then: Vec::new(),
        };
        Ok((decision, released))
    }

    /// What a worker's published dead letter leaves in the store: its record pinned
    /// and marked as waiting in the DLQ.
    async fn pin(&self, id: i64) -> Result<(), StoreError> {
        let store = &self.runtime.store;
        store.pin(id).await?;
        store.mark_dead_lettered(id).await
    }
}
