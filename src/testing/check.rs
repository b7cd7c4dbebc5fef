//! The idempotency check: one handler, the intents a closure of the user's makes, and a
//! counter of each intent's effects, through every hazard of a real deployment.

use std::sync::Arc;

use futures_util::future::join_all;
use lapin::BasicProperties;
use serde::Deserialize;
use serde_json::Value;
use sqlx::PgPool;

use super::{Delivered, Failing, FakeProvider, Hazard, Settled, TestError, TestWorker};
use crate::batch::Batch;
use crate::handler::{Context, Handler, HandlerError};
use crate::store::{Claim, Origin, StoreError, StoredError};
use crate::worker::{Mode, Outcome};

/// How many copies of one message the concurrency hazard delivers at once.
const COPIES: usize = 8;

/// How many deliveries an uncertain operation gets to be reconciled.
const RECONCILE_DELIVERIES: usize = 4;

/// The hazards a handler went through with one effect each, and those left out.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Passed {
    /// The hazards passed, in order.
    pub passed: Vec<Hazard>,
    /// The hazards not run, and why.
    pub skipped: Vec<(Hazard, &'static str)>,
}

/// Why a handler failed the check: the hazard, and what went wrong in it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckFailed {
    /// The intent's effects were counted other than once.
    #[error("{hazard}: {effects} effects where there should be 1 ({hint})")]
    Effects {
        /// The hazard.
        hazard: Hazard,
        /// What the counter said.
        effects: i64,
        /// Where to look.
        hint: &'static str,
    },
    /// The worker decided otherwise than a correct handler lets it.
    #[error("{hazard}: {what}")]
    Decided {
        /// The hazard.
        hazard: Hazard,
        /// What was decided, and what should have been.
        what: String,
    },
    /// The worker could not decide a delivery (the store failed).
    #[error("{hazard}: {source}")]
    Worker {
        /// The hazard.
        hazard: Hazard,
        /// Why.
        source: TestError,
    },
}

/// Makes another payload of a message.
type Change<'w> = Box<dyn Fn(&Value) -> Value + Send + Sync + 'w>;

/// The idempotency check of one handler ([`TestWorker::check`]). Each intent is a
/// message of the closure given to [`Check::run`]; after each hazard the counter given
/// there must count exactly one effect of that intent.
pub struct Check<'w, H: Handler> {
    worker: &'w TestWorker<H>,
    other_payload: Option<Change<'w>>,
    provider: Option<FakeProvider>,
    properties: BasicProperties,
}

impl<'w, H: Handler> Check<'w, H> {
    pub(super) fn new(worker: &'w TestWorker<H>) -> Self {
        Self {
            worker,
            other_payload: None,
            provider: None,
            properties: BasicProperties::default(),
        }
    }

    /// The AMQP properties every message of the check is delivered with (a `type` for
    /// a handler that reads it from [`Context::envelope`]).
    pub fn properties(mut self, properties: BasicProperties) -> Self {
        self.properties = properties;
        self
    }

    /// The same intent with another payload, made from a message (another amount, say):
    /// it must be a conflict, dead-lettered, never a second effect nor a silent
    /// duplicate. Without it the hazard is skipped: only you know which fields are the
    /// key.
    pub fn other_payload(mut self, change: impl Fn(&Value) -> Value + Send + Sync + 'w) -> Self {
        self.other_payload = Some(Box::new(change));
        self
    }

    /// The fake provider the handler calls: the uncertain hazard makes it accept one
    /// call and lose the answer. Without it the hazard is skipped.
    pub fn provider(mut self, provider: &FakeProvider) -> Self {
        self.provider = Some(provider.clone());
        self
    }

    /// Runs the hazards. `message(n)` is the n-th intent's message (distinct `n`,
    /// distinct keys); `effects(pool, message)` counts that intent's effects (a
    /// `SELECT count(*)`, [`FakeProvider::effects`]).
    pub async fn run<M, E, Fut>(self, message: M, effects: E) -> Result<Passed, CheckFailed>
    where
        M: Fn(usize) -> Value,
        E: Fn(PgPool, Value) -> Fut,
        Fut: Future<Output = i64>,
    {
        let pool = self.worker.store().pool().clone();
        let count = |m: &Value| effects(pool.clone(), m.clone());
        let mut report = Passed::default();

        let first = message(0);
        self.completes(Hazard::FirstDelivery, &first).await?;
        once(Hazard::FirstDelivery, count(&first).await)?;
        report.passed.push(Hazard::FirstDelivery);

        let again = self.deliver(Hazard::Redelivery, &first).await?;
        expect(Hazard::Redelivery, &again, &[Outcome::DuplicateCompleted])?;
        once(Hazard::Redelivery, count(&first).await)?;
        report.passed.push(Hazard::Redelivery);

        let copy = message(1);
        let copies = join_all((0..COPIES).map(|_| self.deliver(Hazard::Concurrent, &copy))).await;
        let mut executed = 0;
        for delivered in copies {
            executed += usize::from(delivered?.outcome == Outcome::Executed);
        }
        if executed != 1 {
            return Err(CheckFailed::Decided {
                hazard: Hazard::Concurrent,
                what: format!("{executed} of {COPIES} copies ran the handler, not 1"),
            });
        }
        once(Hazard::Concurrent, count(&copy).await)?;
        report.passed.push(Hazard::Concurrent);

        for (n, hazard) in [
            (2, Hazard::CrashBeforeRecord),
            (3, Hazard::FailedThenRetried),
        ] {
            let m = message(n);
            self.interrupted_run(hazard, &m).await?;
            self.completes(hazard, &m).await?;
            once(hazard, count(&m).await)?;
            report.passed.push(hazard);
        }

        match &self.provider {
            Some(provider) => {
                let m = message(4);
                match self.uncertain(provider, &m).await? {
                    Uncertain::Reconciled => {
                        once(Hazard::UncertainThenReconciled, count(&m).await)?;
                        report.passed.push(Hazard::UncertainThenReconciled);
                    }
                    Uncertain::NeverPending => {
                        once(Hazard::UncertainThenReconciled, count(&m).await)?;
                        report.skipped.push((
                            Hazard::UncertainThenReconciled,
                            "the handler never went pending: does it answer a timeout with HandlerError::Uncertain?",
                        ));
                    }
                    Uncertain::NotCalled => report.skipped.push((
                        Hazard::UncertainThenReconciled,
                        "the handler did not call the FakeProvider",
                    )),
                }
            }
            None => report
                .skipped
                .push((Hazard::UncertainThenReconciled, "no FakeProvider given")),
        }

        match &self.other_payload {
            Some(change) => {
                let other = change(&first);
                let delivered = self.deliver(Hazard::OtherPayload, &other).await?;
                if delivered.outcome != Outcome::Conflict {
                    return Err(CheckFailed::Decided {
                        hazard: Hazard::OtherPayload,
                        what: format!(
                            "decided {}, not a conflict: is the changed field among volatile_fields(), or part of the key?",
                            delivered.outcome.as_str()
                        ),
                    });
                }
                once(Hazard::OtherPayload, count(&first).await)?;
                report.passed.push(Hazard::OtherPayload);
            }
            None => report
                .skipped
                .push((Hazard::OtherPayload, "no other_payload given")),
        }

        let hazard = Hazard::ReplayedDeadLetter;
        let m = message(5);
        self.interrupted_run(hazard, &m).await?;
        let replayed = self
            .worker
            .replay_with(&m, &self.properties)
            .await
            .map_err(|source| CheckFailed::Worker { hazard, source })?;
        match replayed {
            Some(delivered) if delivered.outcome == Outcome::Executed => {}
            other => {
                return Err(CheckFailed::Decided {
                    hazard,
                    what: format!(
                        "the replay did not run to completion: {}",
                        other.map_or("it was only acked".into(), |d| described(&d))
                    ),
                });
            }
        }
        once(hazard, count(&m).await)?;
        report.passed.push(hazard);
        Ok(report)
    }

    async fn deliver(&self, hazard: Hazard, m: &Value) -> Result<Delivered, CheckFailed> {
        self.worker
            .deliver_with(m.to_string().as_bytes(), &self.properties)
            .await
            .map_err(|source| CheckFailed::Worker { hazard, source })
    }

    /// Delivers `m` and fails unless the handler runs and its outcome commits.
    async fn completes(&self, hazard: Hazard, m: &Value) -> Result<Delivered, CheckFailed> {
        let delivered = self.deliver(hazard, m).await?;
        if delivered.outcome != Outcome::Executed {
            return Err(CheckFailed::Decided {
                hazard,
                what: format!(
                    "the message did not run to completion: {}",
                    described(&delivered)
                ),
            });
        }
        Ok(delivered)
    }

    /// The handler runs for `m` under a claim, in a context like the worker's, and its
    /// outcome is never recorded; what it wrote through `ctx.tx()` is rolled back. Then,
    /// for a crash, the lease expires (in transactional mode nothing of the batch was
    /// committed, not even the claim); for a failure, the run is recorded as failed,
    /// retryable; for a dead letter, failed for good and dead-lettered, its record
    /// pinned as a published dead letter pins it.
    async fn interrupted_run(&self, hazard: Hazard, m: &Value) -> Result<(), CheckFailed> {
        let handler = self.worker.handler();
        let store = self.worker.store();
        let message = H::Message::deserialize(m).map_err(|e| CheckFailed::Decided {
            hazard,
            what: format!("the message does not fit the handler: {e}"),
        })?;
        let key = self.worker.key_of(m).map_err(|e| CheckFailed::Decided {
            hazard,
            what: e.to_string(),
        })?;
        let store_error = |e: StoreError| CheckFailed::Worker {
            hazard,
            source: TestError::Store(e),
        };
        let crash_in_a_batch =
            hazard == Hazard::CrashBeforeRecord && self.worker.mode() == Mode::Transactional;
        let lease = if crash_in_a_batch {
            None
        } else {
            let fingerprint = store.fingerprint(m, handler.volatile_fields());
            match store.claim(&key, &fingerprint, &Origin::default()).await {
                Ok(Claim::Claimed(lease)) => Some(lease),
                Ok(other) => {
                    return Err(CheckFailed::Decided {
                        hazard,
                        what: format!("a fresh intent was not claimed: {other:?}"),
                    });
                }
                Err(e) => return Err(store_error(e)),
            }
        };
        let (attempt, takeover) = lease
            .as_ref()
            .map_or((1, false), |l| (l.attempt, l.takeover));
        let ctx = Context::new(key.clone(), attempt, takeover, store.pool().clone())
            .sealing_with(store.keys().cloned())
            .for_follow_ups(None, None, self.worker.config().outbox.handoff)
            .with_envelope(Arc::new(self.worker.envelope(&self.properties)));
        // What the handler returns is lost with the crash; its transaction rolls back.
        let ran = run_alone(handler, message, ctx, crash_in_a_batch).await;
        if let Err(error) = ran {
            return Err(CheckFailed::Decided {
                hazard,
                what: format!(
                    "the run to interrupt did not complete: {} ({})",
                    error.message(),
                    error.kind()
                ),
            });
        }
        let failed = |kind| StoredError {
            kind,
            error: "the outcome could not be recorded (idem::testing)",
        };
        match (hazard, lease) {
            (Hazard::CrashBeforeRecord, Some(_)) => {
                store.release(&key).await.map_err(store_error)?;
            }
            (Hazard::FailedThenRetried, Some(lease)) => store
                .fail(&lease, true, &failed("transient").to_json(), false)
                .await
                .map_err(store_error)?,
            (Hazard::ReplayedDeadLetter, Some(lease)) => {
                store
                    .fail(&lease, false, &failed("permanent").to_json(), false)
                    .await
                    .map_err(store_error)?;
                store.pin(lease.id).await.map_err(store_error)?;
                store
                    .mark_dead_lettered(lease.id)
                    .await
                    .map_err(store_error)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// The provider accepts `m`'s call and the answer is lost; the operation's
    /// deliveries go on until it completes. A delivery after the operation went
    /// pending must reconcile, not run the handler again. The kit's queued failure is
    /// taken back if no call met it, whatever happens.
    async fn uncertain(
        &self,
        provider: &FakeProvider,
        m: &Value,
    ) -> Result<Uncertain, CheckFailed> {
        let ticket = provider.fail_next_once(Failing::AfterAccepting);
        let result = self.deliver_until_settled(provider, m).await;
        provider.withdraw(ticket);
        result
    }

    async fn deliver_until_settled(
        &self,
        provider: &FakeProvider,
        m: &Value,
    ) -> Result<Uncertain, CheckFailed> {
        let hazard = Hazard::UncertainThenReconciled;
        let calls = provider.calls();
        let mut pending = false;
        for _ in 0..RECONCILE_DELIVERIES {
            let delivered = self.deliver(hazard, m).await?;
            if provider.calls() == calls {
                return Ok(Uncertain::NotCalled);
            }
            match delivered.outcome {
                Outcome::Executed if pending => {
                    return Err(CheckFailed::Decided {
                        hazard,
                        what: format!(
                            "the handler ran again, although the provider had accepted the first call ({})",
                            hazard.hint()
                        ),
                    });
                }
                Outcome::Executed => return Ok(Uncertain::NeverPending),
                Outcome::Reconciled => return Ok(Uncertain::Reconciled),
                Outcome::Pending => pending = true,
                _ => {}
            }
        }
        Err(CheckFailed::Decided {
            hazard,
            what: format!(
                "the operation did not complete in {RECONCILE_DELIVERIES} deliveries: {}",
                if pending {
                    "it stays pending (does reconcile() answer Unknown?)"
                } else {
                    "its runs kept failing"
                }
            ),
        })
    }
}

/// How the uncertain hazard went.
enum Uncertain {
    /// Pending, then reconciled as applied.
    Reconciled,
    /// The handler completed without going pending (it retried the timed-out call).
    NeverPending,
    /// The handler never called the provider.
    NotCalled,
}

/// A delivery's outcome and what the broker was told, for a message.
fn described(delivered: &Delivered) -> String {
    match &delivered.settled {
        Settled::DeadLettered { reason, error } => {
            format!(
                "{}, dead-lettered ({reason}: {error})",
                delivered.outcome.as_str()
            )
        }
        settled => format!("{} ({settled:?})", delivered.outcome.as_str()),
    }
}

/// Fails unless `effects` is 1.
fn once(hazard: Hazard, effects: i64) -> Result<(), CheckFailed> {
    if effects == 1 {
        return Ok(());
    }
    Err(CheckFailed::Effects {
        hazard,
        effects,
        hint: if effects == 0 {
            "the effect is missing: does the counter count this intent, and does the handler's write commit?"
        } else {
            hazard.hint()
        },
    })
}

/// Fails unless the delivery was decided as one of `outcomes`.
fn expect(hazard: Hazard, delivered: &Delivered, outcomes: &[Outcome]) -> Result<(), CheckFailed> {
    if outcomes.contains(&delivered.outcome) {
        return Ok(());
    }
    Err(CheckFailed::Decided {
        hazard,
        what: format!(
            "decided {}, where {} was due",
            delivered.outcome.as_str(),
            outcomes
                .iter()
                .map(|o| o.as_str())
                .collect::<Vec<_>>()
                .join(" or ")
        ),
    })
}

/// Runs `message` once, as a worker would: in a batch (of one) through
/// [`Handler::handle_batch`] when `batched` and the handler takes batches, otherwise
/// through [`Handler::handle`]. What it wrote stays in `ctx`'s transaction, dropped here.
async fn run_alone<H: Handler>(
    handler: &H,
    message: H::Message,
    mut ctx: Context,
    batched: bool,
) -> Result<(), HandlerError> {
    if !batched {
        return handler.handle(message, &mut ctx).await.map(drop);
    }
    let pool = ctx.pool().clone();
    let mut one = Batch::new(vec![message], vec![ctx], pool, None);
    if let Some(mut outcomes) = handler.handle_batch(&mut one).await {
        return match (outcomes.pop(), outcomes.is_empty()) {
            (Some(outcome), true) => outcome.map(drop),
            _ => Err(HandlerError::permanent(
                "handle_batch answered another count of outcomes than messages",
            )),
        };
    }
    let (mut messages, mut contexts, _) = one.into_parts();
    match (messages.pop(), contexts.pop()) {
        (Some(message), Some(mut ctx)) => handler.handle(message, &mut ctx).await.map(drop),
        _ => Err(HandlerError::permanent("a batch of one lost its message")),
    }
}
