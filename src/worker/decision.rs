//! The decision table of docs/DESIGN.md ("One delivery, decided by the record") as
//! pure functions: what the store found, or how a run of the handler was recorded, in;
//! the next [`Step`] out. Nothing here waits, reads or writes: `execute` does what a
//! step says and `settle` talks to the broker, so every row is a unit test.

use std::time::Duration;

use super::ordered::Entity;
use crate::dead_letter::Reason;
use crate::handler::{HandlerError, Reconciliation};
use crate::key::Key;
use crate::ordering::Released;
use crate::retry::RetryPolicy;
use crate::store::{Claim, Lease, StoredError};

/// What a conflicting delivery's dead letter says.
pub(crate) const CONFLICT: &str =
    "the key was already used with another payload; a changed payload needs a new key";
/// What a pending operation's dead letter says once its retries are used up.
pub(crate) const STILL_PENDING: &str = "outcome still unknown after every retry; reconcile by hand";

/// The next thing to do with a delivery.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Step {
    /// Run the handler under this lease (a new claim, a takeover or a re-claim).
    Run(Lease),
    /// Ask the handler's `reconcile` what became of a pending operation; never run it
    /// blindly.
    Reconcile {
        lease: Lease,
        external_ref: Option<String>,
    },
    /// A transient failure with immediate retries left: claim again after this pause,
    /// in this process.
    ClaimAgain { after: Duration },
    /// Done deciding.
    Settle(Verdict),
}

/// The end of a decision: what the broker is told, and what is reported.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Verdict {
    pub(crate) action: Settle,
    pub(crate) outcome: Outcome,
}

/// What the broker is told about a delivery.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Settle {
    /// Ack it: done, or nothing to do.
    Ack,
    /// Ack it: kept in `ordering_waiting` for its turn (outcome `waiting`). On a queue of
    /// owned order its ack, and from then on every ack of the channel, waits longer for
    /// the older deliveries (`acks::Hold::owned`).
    AckWaiting,
    /// Publish a copy through the retry queue of this delay, carrying `retries` in
    /// `idem-retries`, then ack.
    Retry { delay: Duration, retries: i64 },
    /// No retry queues are configured: put it back in the queue after this pause.
    Requeue { after: Duration },
    /// Publish it to the DLQ, then ack.
    DeadLetter(DeadLetterOrder),
}

/// A dead letter to publish, with what its headers say.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DeadLetterOrder {
    pub(crate) reason: Reason,
    /// `idem-error`.
    pub(crate) error: String,
    /// `idem-attempts`: claims made on the key, 0 when none was.
    pub(crate) attempts: i64,
    /// The record to pin once the dead letter is confirmed, so retention keeps it while
    /// the dead letter waits (none when there is no record, or it is not the cause).
    pub(crate) pin: Option<i64>,
}

/// The turns of an entity that a transactional batch ran after one that completed, in
/// the same commit (owned order: `transactional/chain.rs`).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Chained {
    /// The number the entity's position moved to.
    pub(crate) to: i64,
    /// Each turn that ran, for its log line and counts.
    pub(crate) ran: Vec<ChainedTurn>,
}

/// One turn a chain ran: what its delivery is counted and logged as.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ChainedTurn {
    /// Its key's short hash.
    pub(crate) key: String,
    /// Its number in its entity's sequence.
    pub(crate) seq: i64,
    /// Whether its message was replayed from a dead-letter queue (`idem-replays`).
    pub(crate) replayed: bool,
}

/// How a run of the handler, or a reconciliation, ended once its outcome was written.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Ran {
    /// `completed` committed; `reconciled` when `reconcile` found the effect applied.
    /// `handed`: what the same commit released of its entity's order (its next turn,
    /// handed over), when the release ran in it; `None` leaves the release to be made.
    /// `chained`: the turns after it that its transactional batch ran in the same commit.
    Completed {
        reconciled: bool,
        handed: Option<Vec<crate::ordering::Released>>,
        chained: Option<Chained>,
    },
    /// Another worker took the operation over; nothing of this run was written.
    LeaseLost,
    /// Recorded as `failed`, retryable.
    Transient { lease: Lease, error: String },
    /// Recorded as `failed` for good.
    Permanent { lease: Lease, error: String },
    /// Recorded as `pending`: reconcile on a later delivery.
    Pending { lease: Lease },
}

/// What became of one delivery: the `outcome` of the `delivery decided` event and of
/// `idem_deliveries_total`, and what `idem::testing` answers for a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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
    /// Not decidable many times in a row while others were: dead-lettered.
    Undecidable,
    /// No handler of the queue takes the message's type: dead-lettered.
    Unroutable,
    /// The queue's circuit is open: given back to the queue unrun, no retry tier spent.
    Paused,
    /// Came before its turn in its entity's order: acked, kept in Postgres, published
    /// again when its predecessor completes (no retry tier, no attempt).
    Waiting,
    /// Its sequence number was behind its entity's position (skipped by an operator) or
    /// held by another message: dead-lettered.
    OutOfSequence,
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
            Outcome::Undecidable => "undecidable",
            Outcome::Unroutable => "unroutable",
            Outcome::Paused => "paused",
            Outcome::Waiting => "waiting",
            Outcome::OutOfSequence => "out_of_sequence",
        }
    }
}

/// The delayed retries left to a delivery: the policy's tiers and the `idem-retries`
/// it already went through.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Retries<'a> {
    pub(crate) policy: &'a RetryPolicy,
    /// Delayed retries this message already went through (`idem-retries`).
    pub(crate) used: i64,
}

impl Retries<'_> {
    /// Looks again later without spending a retry (another worker is on it).
    fn later(self) -> Settle {
        match self.policy.delays.first() {
            Some(&delay) => Settle::Retry {
                delay,
                retries: self.used,
            },
            None => Settle::Requeue {
                after: self.policy.max_backoff,
            },
        }
    }

    /// Spends the next delayed retry; `None` when they are used up.
    fn next(self) -> Option<Settle> {
        let delay = self.policy.delay(usize::try_from(self.used).ok()?)?;
        Some(Settle::Retry {
            delay,
            retries: self.used + 1,
        })
    }
}

fn finish(action: Settle, outcome: Outcome) -> Step {
    Step::Settle(Verdict { action, outcome })
}

fn dead_letter(
    reason: Reason,
    error: impl Into<String>,
    attempts: i32,
    pin: Option<i64>,
    outcome: Outcome,
) -> Step {
    let order = DeadLetterOrder {
        reason,
        error: error.into(),
        attempts: i64::from(attempts),
        pin,
    };
    finish(Settle::DeadLetter(order), outcome)
}

/// A body that is not a JSON object, does not fit the message, has no valid key, or
/// holds data the database refuses: dead-lettered, no record pinned.
/// The queue's circuit is open: the delivery goes back to its queue unrun, and waits
/// there (the worker takes none of the queue's deliveries until the circuit lets it).
pub(crate) fn paused() -> Verdict {
    Verdict {
        action: Settle::Requeue {
            after: Duration::ZERO,
        },
        outcome: Outcome::Paused,
    }
}

pub(crate) fn malformed(why: String) -> Verdict {
    let order = DeadLetterOrder {
        reason: Reason::Malformed,
        error: why,
        attempts: 0,
        pin: None,
    };
    Verdict {
        action: Settle::DeadLetter(order),
        outcome: Outcome::Malformed,
    }
}

/// A delivery the safety net gives up (see `undecided`): dead-lettered with the last
/// error, no record pinned (none may exist, or it is not the cause). Replayable.
pub(crate) fn undecidable(last_error: String) -> Verdict {
    let order = DeadLetterOrder {
        reason: Reason::Undecidable,
        error: last_error,
        attempts: 0,
        pin: None,
    };
    Verdict {
        action: Settle::DeadLetter(order),
        outcome: Outcome::Undecidable,
    }
}

/// What an answer of [`crate::Handler::reconcile`] means (the reconcile table of
/// docs/DESIGN.md).
#[derive(Debug, PartialEq)]
pub(crate) enum Reconciled<O> {
    /// The effect happened: complete with this output.
    Applied(O),
    /// The effect certainly did not happen: run the handler under the same lease.
    NotApplied,
    /// Record this failure: still unknown (or the reconciliation failed) stays
    /// `pending`; a reconciliation that failed for good fails for good.
    Failed(HandlerError),
}

/// Sorts a reconciliation's answer. A failing reconciliation says nothing about the
/// effect, so it keeps the operation pending, unless it failed for good.
pub(crate) fn reconciled<O>(answer: Result<Reconciliation<O>, HandlerError>) -> Reconciled<O> {
    match answer {
        Ok(Reconciliation::Applied(output)) => Reconciled::Applied(output),
        Ok(Reconciliation::NotApplied) => Reconciled::NotApplied,
        Ok(Reconciliation::Unknown) => Reconciled::Failed(HandlerError::uncertain(
            None,
            "reconcile: outcome still unknown",
        )),
        Err(HandlerError::Permanent(e)) => Reconciled::Failed(HandlerError::Permanent(e)),
        Err(other) => Reconciled::Failed(HandlerError::uncertain(
            None,
            format!("reconcile failed: {}", other.message()),
        )),
    }
}

/// What a claim found decides the delivery (one arm per row of the table).
pub(crate) fn on_claim(claim: Claim, retries: Retries<'_>) -> Step {
    match claim {
        // No record, an expired lease (takeover) or a retryable failure: ours to run.
        Claim::Claimed(lease) => Step::Run(lease),
        Claim::Pending {
            lease,
            external_ref,
        } => Step::Reconcile {
            lease,
            external_ref,
        },
        // An erased record's intent is done all the same: acked, never run again.
        Claim::Completed { .. } | Claim::Erased => finish(Settle::Ack, Outcome::DuplicateCompleted),
        Claim::InProgress { .. } => finish(retries.later(), Outcome::DuplicateInProgress),
        Claim::Conflict { .. } => dead_letter(
            Reason::FingerprintConflict,
            CONFLICT,
            0,
            None,
            Outcome::Conflict,
        ),
        Claim::FailedForGood {
            dead_lettered: true,
            ..
        } => finish(Settle::Ack, Outcome::DuplicateFailed),
        // The worker that failed it died before publishing the dead letter: publish it.
        Claim::FailedForGood {
            id,
            error,
            attempts,
            dead_lettered: false,
        } => {
            let error = error
                .as_ref()
                .map_or_else(|| "unknown error".to_owned(), StoredError::text_of);
            let outcome = Outcome::FailedPermanent;
            dead_letter(Reason::PermanentFailure, error, attempts, Some(id), outcome)
        }
    }
}

/// How the run was recorded decides the rest. `immediate` is the pause before the next
/// in-process retry, `None` once those are used up.
pub(crate) fn after_run(ran: Ran, immediate: Option<Duration>, retries: Retries<'_>) -> Step {
    match ran {
        Ran::Completed {
            reconciled: false, ..
        } => finish(Settle::Ack, Outcome::Executed),
        Ran::Completed {
            reconciled: true, ..
        } => finish(Settle::Ack, Outcome::Reconciled),
        Ran::LeaseLost => finish(retries.later(), Outcome::LeaseLost),
        Ran::Transient { lease, error } => match (immediate, retries.next()) {
            (Some(after), _) => Step::ClaimAgain { after },
            (None, Some(retry)) => finish(retry, Outcome::FailedTransient),
            (None, None) => dead_letter(
                Reason::RetriesExhausted,
                error,
                lease.attempt,
                Some(lease.id),
                Outcome::RetriesExhausted,
            ),
        },
        Ran::Permanent { lease, error } => dead_letter(
            Reason::PermanentFailure,
            error,
            lease.attempt,
            Some(lease.id),
            Outcome::FailedPermanent,
        ),
        Ran::Pending { lease } => match retries.next() {
            Some(retry) => finish(retry, Outcome::Pending),
            None => dead_letter(
                Reason::RetriesExhausted,
                STILL_PENDING,
                lease.attempt,
                Some(lease.id),
                Outcome::RetriesExhausted,
            ),
        },
    }
}

/// How a delivery was decided: the verdict, and the message's key if it had a valid one.
pub(crate) struct Decided {
    pub(crate) verdict: Verdict,
    pub(crate) key: Option<Key>,
    /// The entity whose order the delivery entered and took its turn in, if it did.
    pub(crate) entity: Option<Entity>,
    /// What the commit that completed it released of that order (see [`Ran::Completed`]).
    pub(crate) handed: Option<Vec<Released>>,
    /// The turns after it that the same commit ran (see [`Ran::Completed`]).
    pub(crate) chained: Option<Chained>,
    /// Under owned order, the turn it holds in memory when it did not complete: left
    /// once it is settled.
    pub(crate) owned: Option<super::owned::Turn>,
    /// Under owned order in leased mode, what its completion leaves its task for a run.
    pub(crate) ahead: super::owned::Ahead,
}

impl Decided {
    pub(crate) fn without_key(verdict: Verdict) -> Self {
        Self {
            verdict,
            key: None,
            entity: None,
            handed: None,
            chained: None,
            owned: None,
            ahead: super::owned::Ahead::None,
        }
    }

    pub(super) fn with_key(verdict: Verdict, key: Key, entity: Option<Entity>) -> Self {
        Self {
            verdict,
            key: Some(key),
            entity,
            handed: None,
            chained: None,
            owned: None,
            ahead: super::owned::Ahead::None,
        }
    }

    /// The queue's circuit keeps the delivery of `key` out: back to the queue unrun.
    pub(super) fn paused(key: Key) -> Self {
        Self::with_key(paused(), key, None)
    }
}

#[cfg(test)]
#[path = "decision_tests.rs"]
mod tests;
