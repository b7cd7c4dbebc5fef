//! The idempotency check: one handler, the intents a closure of the user's makes, and a
//! counter of each intent's effects, through every hazard of a real deployment.

use std::fmt;

use futures_util::future::join_all;
use serde::Deserialize;
use serde_json::Value;
use sqlx::PgPool;

use super::{Delivered, Failing, FakeProvider, TestError, TestWorker};
use crate::fingerprint::Fingerprint;
use crate::handler::{Context, Handler};
use crate::key::Key;
use crate::store::{Claim, Origin, StoredError};
use crate::worker::{Mode, Outcome};

/// How many copies of one message the concurrency hazard delivers at once.
const COPIES: usize = 8;

/// How many deliveries an uncertain operation gets to be reconciled.
const RECONCILE_DELIVERIES: usize = 4;

/// What the check puts a handler through, in this order; each hazard but the first two
/// and the last two gets an intent of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Hazard {
    /// The message's first delivery: it must complete with one effect.
    FirstDelivery,
    /// The same message again after it completed (a duplicate publish, a redelivery).
    Redelivery,
    /// Copies of one message delivered at once (to one or several workers).
    Concurrent,
    /// The handler returned, the worker crashed before its outcome was recorded (what
    /// it wrote through `ctx.tx()` rolled back, what it did elsewhere kept), and another
    /// worker took the operation over.
    CrashBeforeRecord,
    /// The handler returned, recording its outcome failed (its transaction rolled
    /// back), and the retry ran it again.
    FailedThenRetried,
    /// The provider accepted the call and the answer was lost: the operation is
    /// pending, and its next delivery reconciles it (needs [`Check::provider`]).
    UncertainThenReconciled,
    /// The same key with another payload (needs [`Check::other_payload`]).
    OtherPayload,
    /// A dead letter of the completed message, replayed by an operator.
    ReplayedDeadLetter,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hazard::FirstDelivery => "after the first delivery",
            Hazard::Redelivery => "after the same message again, once it completed",
            Hazard::Concurrent => "after copies of the message delivered at once",
            Hazard::CrashBeforeRecord => {
                "after a crash before the record and a takeover by another worker"
            }
            Hazard::FailedThenRetried => "after a failure to record the outcome and a retry",
            Hazard::UncertainThenReconciled => {
                "after an uncertain outcome (the provider accepted, the answer was lost) and a reconcile"
            }
            Hazard::OtherPayload => "after the same key with another payload",
            Hazard::ReplayedDeadLetter => "after a replayed dead letter of the completed message",
        })
    }
}

impl Hazard {
    /// What to look at when this hazard doubled an effect.
    fn hint(self) -> &'static str {
        match self {
            Hazard::CrashBeforeRecord | Hazard::FailedThenRetried => {
                "writes outside ctx.tx()? a provider call without ctx.provider_key()?"
            }
            Hazard::UncertainThenReconciled => {
                "reconcile() should ask the provider (with ctx.provider_key()) instead of answering NotApplied"
            }
            _ => "the handler ran more than once for one intent",
        }
    }
}

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
}

impl<'w, H: Handler> Check<'w, H> {
    pub(super) fn new(worker: &'w TestWorker<H>) -> Self {
        Self {
            worker,
            other_payload: None,
            provider: None,
        }
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
        self.completes(Hazard::FirstDelivery, &first, None).await?;
        once(Hazard::FirstDelivery, count(&first).await)?;
        report.passed.push(Hazard::FirstDelivery);

        let again = self.deliver(Hazard::Redelivery, &first).await?;
        expect(Hazard::Redelivery, &again, &[Outcome::DuplicateCompleted])?;
        once(Hazard::Redelivery, count(&first).await)?;
        report.passed.push(Hazard::Redelivery);

        let copy = message(1);
        let copies = join_all((0..COPIES).map(|_| self.worker.deliver(&copy))).await;
        let mut executed = 0;
        for delivered in copies {
            let delivered = delivered.map_err(|source| CheckFailed::Worker {
                hazard: Hazard::Concurrent,
                source,
            })?;
            executed += usize::from(delivered.outcome == Outcome::Executed);
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
            self.completes(hazard, &m, Some(Outcome::Executed)).await?;
            once(hazard, count(&m).await)?;
            report.passed.push(hazard);
        }

        match &self.provider {
            Some(provider) => {
                let m = message(4);
                if self.uncertain(provider, &m).await? {
                    once(Hazard::UncertainThenReconciled, count(&m).await)?;
                    report.passed.push(Hazard::UncertainThenReconciled);
                } else {
                    report.skipped.push((
                        Hazard::UncertainThenReconciled,
                        "the handler did not call the FakeProvider",
                    ));
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

        let replayed = self
            .worker
            .deliver_replayed(&first, 1)
            .await
            .map_err(|source| CheckFailed::Worker {
                hazard: Hazard::ReplayedDeadLetter,
                source,
            })?;
        expect(
            Hazard::ReplayedDeadLetter,
            &replayed,
            &[Outcome::DuplicateCompleted],
        )?;
        once(Hazard::ReplayedDeadLetter, count(&first).await)?;
        report.passed.push(Hazard::ReplayedDeadLetter);
        Ok(report)
    }

    async fn deliver(&self, hazard: Hazard, m: &Value) -> Result<Delivered, CheckFailed> {
        self.worker
            .deliver(m)
            .await
            .map_err(|source| CheckFailed::Worker { hazard, source })
    }

    /// Delivers `m` and fails unless it completes (as `outcome`, if given).
    async fn completes(
        &self,
        hazard: Hazard,
        m: &Value,
        outcome: Option<Outcome>,
    ) -> Result<Delivered, CheckFailed> {
        let delivered = self.deliver(hazard, m).await?;
        let completed = matches!(delivered.outcome, Outcome::Executed | Outcome::Reconciled);
        if !completed || outcome.is_some_and(|o| o != delivered.outcome) {
            return Err(CheckFailed::Decided {
                hazard,
                what: format!(
                    "the message did not run to completion: {} ({:?})",
                    delivered.outcome.as_str(),
                    delivered.settled
                ),
            });
        }
        Ok(delivered)
    }

    /// The handler runs for `m` under a claim and its outcome is never recorded: for a
    /// crash, the lease then expires (in transactional mode nothing of the batch was
    /// committed, not even the claim); for a failure, the run is recorded as failed,
    /// retryable. What the handler wrote through `ctx.tx()` is rolled back.
    async fn interrupted_run(&self, hazard: Hazard, m: &Value) -> Result<(), CheckFailed> {
        let handler = self.worker.handler();
        let store = self.worker.store();
        let message = H::Message::deserialize(m).map_err(|e| CheckFailed::Decided {
            hazard,
            what: format!("the message does not fit the handler: {e}"),
        })?;
        let key = Key::new(
            handler.scope(&message),
            H::OPERATION,
            handler.idempotency_key(&message),
        )
        .map_err(|e| CheckFailed::Decided {
            hazard,
            what: format!("the message has no valid key: {e}"),
        })?;
        let worker_error = |e: crate::store::StoreError| CheckFailed::Worker {
            hazard,
            source: TestError::Store(e),
        };
        let crash_in_a_batch =
            hazard == Hazard::CrashBeforeRecord && self.worker.mode() == Mode::Transactional;
        let lease = if crash_in_a_batch {
            None
        } else {
            let fingerprint = Fingerprint::of(m, handler.volatile_fields());
            match store.claim(&key, &fingerprint, &Origin::default()).await {
                Ok(Claim::Claimed(lease)) => Some(lease),
                Ok(other) => {
                    return Err(CheckFailed::Decided {
                        hazard,
                        what: format!("a fresh intent was not claimed: {other:?}"),
                    });
                }
                Err(e) => return Err(worker_error(e)),
            }
        };
        let (attempt, takeover) = lease
            .as_ref()
            .map_or((1, false), |l| (l.attempt, l.takeover));
        let mut ctx = Context::new(key.clone(), attempt, takeover, store.pool().clone());
        // What the handler returns is lost with the crash; its transaction rolls back.
        let _ = handler.handle(message, &mut ctx).await;
        drop(ctx);
        match (hazard, lease) {
            (Hazard::CrashBeforeRecord, Some(_)) => {
                store.release(&key).await.map_err(worker_error)?;
            }
            (Hazard::FailedThenRetried, Some(lease)) => {
                let error = StoredError {
                    kind: "transient",
                    error: "the outcome could not be recorded (idem::testing)",
                };
                store
                    .fail(&lease, true, &error.to_json(), false)
                    .await
                    .map_err(worker_error)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// The provider accepts `m`'s call and the answer is lost; the operation's
    /// deliveries go on until it completes. A delivery after the operation went
    /// pending must reconcile, not run the handler again. False when the handler never
    /// called the provider.
    async fn uncertain(&self, provider: &FakeProvider, m: &Value) -> Result<bool, CheckFailed> {
        let hazard = Hazard::UncertainThenReconciled;
        let calls = provider.calls();
        provider.fail_next(Failing::AfterAccepting);
        let mut pending = false;
        for _ in 0..RECONCILE_DELIVERIES {
            let delivered = self.deliver(hazard, m).await?;
            if provider.calls() == calls {
                provider.clear_failures();
                return Ok(false);
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
                Outcome::Executed | Outcome::Reconciled => return Ok(true),
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
