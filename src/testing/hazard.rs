//! The hazards of a real deployment that the check puts a handler through.

use std::fmt;

/// What the check puts a handler through, in this order; each hazard but the first two
/// and the last two gets an intent of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Hazard {
    /// The message's first delivery: it must complete with one effect.
    FirstDelivery,
    /// The same message again after it completed (a duplicate publish, a redelivery).
    /// The handler does not run again: this checks idem's side, and the counter.
    Redelivery,
    /// Copies of one message delivered at once, their claims racing in Postgres as on
    /// several workers. In leased mode only one runs the handler; in transactional mode
    /// each may run it and all but one roll back, so a write outside `ctx.tx()` shows.
    Concurrent,
    /// The handler returned, the worker crashed before its outcome was recorded (what
    /// it wrote through `ctx.tx()` rolled back, what it did elsewhere kept), and another
    /// worker took the operation over.
    CrashBeforeRecord,
    /// The handler returned, recording its outcome failed (its transaction rolled
    /// back), and the retry ran it again.
    FailedThenRetried,
    /// The provider accepted the call and the answer was lost: the operation is
    /// pending, and its next delivery reconciles it (needs [`Check::provider`](super::Check::provider)).
    UncertainThenReconciled,
    /// The same key with another payload (needs [`Check::other_payload`](super::Check::other_payload)).
    OtherPayload,
    /// The handler returned, the run was recorded as failed for good after all (a
    /// later step refused it), the message was dead-lettered, and an operator replayed
    /// it once the cause was fixed (`idem dlq replay`): the replay runs it again.
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
            Hazard::ReplayedDeadLetter => {
                "after a failure for good, its dead letter and a replay of it"
            }
        })
    }
}

impl Hazard {
    /// What to look at when this hazard doubled an effect.
    pub(super) fn hint(self) -> &'static str {
        match self {
            Hazard::CrashBeforeRecord | Hazard::FailedThenRetried | Hazard::ReplayedDeadLetter => {
                "writes outside ctx.tx()? a provider call without ctx.provider_key()?"
            }
            Hazard::UncertainThenReconciled => {
                "reconcile() should ask the provider (with ctx.provider_key()) instead of answering NotApplied"
            }
            Hazard::Concurrent => {
                "racing copies each ran the handler (transactional mode) and only one committed: writes outside ctx.tx()?"
            }
            _ => "the handler ran more than once for one intent",
        }
    }
}
