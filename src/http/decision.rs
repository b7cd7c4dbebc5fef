//! The HTTP layer's decision tables of docs/DESIGN.md ("HTTP entry points", "What the
//! layer answers") as pure functions: what a keyed request's claim found decides what
//! happens next ([`on_claim`]); what the route answered decides what is recorded
//! ([`verdict`]); what a route's reconciler found decides how a pending key goes on
//! ([`reconciled`]). Nothing here waits, reads or writes, and nothing needs axum: the
//! service does what a decision says, so every row is a unit test (`cargo test --lib
//! decision`, with or without the feature `http`).

use serde_json::Value;

use crate::handler::{HandlerError, Reconciliation};
use crate::store::{Claim, Lease, RequestClaim};

/// What a keyed request does after its claim.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Next {
    /// The key is the request's: run the route under this lease.
    Run(Lease),
    /// The key is pending and the route has a reconciler: ask it first, under this
    /// lease, with the stored external reference.
    Reconcile {
        lease: Lease,
        external_ref: Option<String>,
    },
    /// Answer from the record, running nothing.
    Answer(Answer),
}

/// What the layer answers from the record, without running the route.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Answer {
    /// The stored answer, replayed (`Idempotency-Replayed: true`).
    Replay(Option<Value>),
    /// 409 `request-in-progress` with `Retry-After: 1`, or 202 with a `Location` where
    /// the route lets clients poll.
    InProgress,
    /// 409 `outcome-uncertain` with `Retry-After: 30`: pending, and no reconciler took
    /// it.
    Uncertain,
    /// 422 `idempotency-key-reused`: the key was first used with another body or URL.
    KeyReused,
    /// 422 `request-failed`: the first request with the key failed for good.
    FailedForGood,
    /// 410 `idempotency-key-erased`: the request was handled, and what was stored of
    /// it has been erased since.
    Erased,
}

/// What the claim found decides the request (one arm per row of the table).
pub(crate) fn on_claim(found: RequestClaim) -> Next {
    let claim = match found {
        RequestClaim::Claim(claim) => claim,
        // Pending, and the route cannot reconcile: left as it is.
        RequestClaim::Uncertain => return Next::Answer(Answer::Uncertain),
    };
    match claim {
        // No record, a lapsed lease (a takeover), or a retryable failure: the route runs.
        Claim::Claimed(lease) => Next::Run(lease),
        Claim::Pending {
            lease,
            external_ref,
        } => Next::Reconcile {
            lease,
            external_ref,
        },
        Claim::Completed { result } => Next::Answer(Answer::Replay(result)),
        Claim::InProgress { .. } => Next::Answer(Answer::InProgress),
        Claim::Conflict { .. } => Next::Answer(Answer::KeyReused),
        Claim::FailedForGood { .. } => Next::Answer(Answer::FailedForGood),
        Claim::Erased => Next::Answer(Answer::Erased),
    }
}

/// What the layer does with the route's answer to a claimed request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// Store the answer; commit the handler's writes with it.
    Store,
    /// Store the answer (the request was decided: a permanent error), but roll the
    /// handler's writes back.
    StoreWithoutWrites,
    /// Roll back and leave the key free for a retry: a transient error, an answer of
    /// 500 or more, or a refusal (4xx) the handler did not mark as its decision.
    Free(String),
    /// Roll back and keep the key `pending` (an uncertain outcome).
    Pending {
        external_ref: Option<String>,
        error: String,
    },
}

/// Decides from the answer's `status`, the handler's error if it returned one, and
/// whether it marked the answer `Decided`.
pub(crate) fn verdict(status: u16, failure: Option<&HandlerError>, decided: bool) -> Verdict {
    match failure {
        Some(HandlerError::Transient(error)) => Verdict::Free(error.clone()),
        Some(HandlerError::Uncertain {
            external_ref,
            error,
        }) => Verdict::Pending {
            external_ref: external_ref.clone(),
            error: error.clone(),
        },
        Some(HandlerError::Permanent(_)) => Verdict::StoreWithoutWrites,
        None if decided => Verdict::Store,
        // A 4xx is an extractor's rejection (a missing Content-Type, a body that does
        // not parse), middleware's (401, 429) or a refusal that should change nothing:
        // a retry that fixes it must be able to run.
        None if status >= 400 => Verdict::Free(format!("the route answered {status}")),
        None => Verdict::Store,
    }
}

/// What a route's reconciler found out about a pending key, `A` its answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum AfterReconcile<A> {
    /// The effect did not happen: run the request again, under the same lease.
    RunAgain,
    /// The effect happened: store this answer and send it.
    Answer(A),
    /// The reconciler decided the request failed for good: store its error's answer.
    Failed(HandlerError),
    /// Still unknown, an error, a panic, or an answer not to be stored: give the lease
    /// back (no attempt counted) and answer 409 `outcome-uncertain`.
    StillUncertain(String),
}

/// Sorts a reconciler's answer (`None`: it panicked or ran past its bound, with why).
/// `storable` tells whether an applied answer is one to store (its verdict is
/// [`Verdict::Store`] or [`Verdict::StoreWithoutWrites`]).
pub(crate) fn reconciled<A>(
    found: Result<Result<Reconciliation<A>, HandlerError>, String>,
    storable: impl FnOnce(&A) -> bool,
) -> AfterReconcile<A> {
    match found {
        Ok(Ok(Reconciliation::NotApplied)) => AfterReconcile::RunAgain,
        Ok(Ok(Reconciliation::Applied(answer))) if storable(&answer) => {
            AfterReconcile::Answer(answer)
        }
        Ok(Ok(Reconciliation::Applied(_))) => {
            AfterReconcile::StillUncertain("reconcile: an answer that is not to be stored".into())
        }
        Ok(Err(error @ HandlerError::Permanent(_))) => AfterReconcile::Failed(error),
        Ok(Ok(Reconciliation::Unknown)) => {
            AfterReconcile::StillUncertain("reconcile: still unknown".into())
        }
        Ok(Err(error)) => AfterReconcile::StillUncertain(format!("reconcile failed: {error}")),
        Err(stopped) => AfterReconcile::StillUncertain(stopped),
    }
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use serde_json::json;

    use super::*;
    use crate::fingerprint::Fingerprint;

    fn lease() -> Lease {
        Lease {
            id: 7,
            token: 42,
            attempt: 1,
            takeover: false,
            expires_at: chrono::DateTime::UNIX_EPOCH,
        }
    }

    // ---- what the claim found ----

    #[test]
    fn decision_a_new_key_runs_the_route() {
        let next = on_claim(RequestClaim::Claim(Claim::Claimed(lease())));
        assert_eq!(next, Next::Run(lease()));
    }

    #[test]
    fn decision_a_completed_key_replays_the_stored_answer() {
        let stored = Some(json!({"status": 201, "headers": [], "body": "paid"}));
        let next = on_claim(RequestClaim::Claim(Claim::Completed {
            result: stored.clone(),
        }));
        assert_eq!(next, Next::Answer(Answer::Replay(stored)));
    }

    #[test]
    fn decision_a_key_still_running_answers_in_progress() {
        let next = on_claim(RequestClaim::Claim(Claim::InProgress {
            lease_expires_at: Some(Utc::now()),
        }));
        assert_eq!(next, Next::Answer(Answer::InProgress));
    }

    #[test]
    fn decision_a_key_with_another_body_or_url_is_reused() {
        let next = on_claim(RequestClaim::Claim(Claim::Conflict {
            stored: Fingerprint::of(&json!({"amount": 1}), &[]),
        }));
        assert_eq!(next, Next::Answer(Answer::KeyReused));
    }

    #[test]
    fn decision_a_key_failed_for_good_answers_request_failed() {
        let next = on_claim(RequestClaim::Claim(Claim::FailedForGood {
            id: 7,
            error: None,
            attempts: 1,
            dead_lettered: false,
        }));
        assert_eq!(next, Next::Answer(Answer::FailedForGood));
    }

    #[test]
    fn decision_a_pending_key_with_a_reconciler_is_reconciled_first() {
        let next = on_claim(RequestClaim::Claim(Claim::Pending {
            lease: lease(),
            external_ref: Some("ch_1".into()),
        }));
        assert_eq!(
            next,
            Next::Reconcile {
                lease: lease(),
                external_ref: Some("ch_1".into())
            }
        );
    }

    #[test]
    fn decision_a_pending_key_without_a_reconciler_answers_uncertain() {
        let next = on_claim(RequestClaim::Uncertain);
        assert_eq!(next, Next::Answer(Answer::Uncertain));
    }

    // ---- what the route answered ----

    #[test]
    fn decision_a_2xx_or_3xx_is_stored_with_its_writes() {
        assert_eq!(verdict(201, None, false), Verdict::Store);
        assert_eq!(verdict(303, None, false), Verdict::Store);
    }

    #[test]
    fn decision_a_decided_4xx_is_stored_with_its_writes() {
        assert_eq!(verdict(402, None, true), Verdict::Store);
    }

    #[test]
    fn decision_a_permanent_error_is_stored_without_its_writes() {
        let permanent = HandlerError::permanent("card refused");
        assert_eq!(
            verdict(422, Some(&permanent), false),
            Verdict::StoreWithoutWrites
        );
    }

    #[test]
    fn decision_another_4xx_or_a_5xx_frees_the_key() {
        for status in [404, 415, 429, 500, 502] {
            assert!(
                matches!(verdict(status, None, false), Verdict::Free(_)),
                "{status}"
            );
        }
    }

    #[test]
    fn decision_a_transient_error_frees_the_key() {
        let transient = HandlerError::transient("db busy");
        assert_eq!(
            verdict(503, Some(&transient), false),
            Verdict::Free("db busy".into())
        );
    }

    #[test]
    fn decision_an_uncertain_outcome_keeps_the_key_pending() {
        let uncertain = HandlerError::uncertain(Some("ch_1".into()), "timeout");
        assert_eq!(
            verdict(502, Some(&uncertain), false),
            Verdict::Pending {
                external_ref: Some("ch_1".into()),
                error: "timeout".into()
            }
        );
    }

    // ---- what the reconciler found ----

    fn storable(status: &u16) -> bool {
        *status < 400
    }

    #[test]
    fn decision_reconciled_not_applied_runs_the_request_again() {
        let found = reconciled(Ok(Ok(Reconciliation::NotApplied)), storable);
        assert_eq!(found, AfterReconcile::RunAgain);
    }

    #[test]
    fn decision_reconciled_applied_stores_the_answer_to_store() {
        let found = reconciled(Ok(Ok(Reconciliation::Applied(201))), storable);
        assert_eq!(found, AfterReconcile::Answer(201));
    }

    #[test]
    fn decision_reconciled_applied_with_an_answer_not_to_store_stays_uncertain() {
        let found = reconciled(Ok(Ok(Reconciliation::Applied(500))), storable);
        assert!(matches!(found, AfterReconcile::StillUncertain(_)));
    }

    #[test]
    fn decision_reconciled_a_permanent_error_is_the_answer() {
        let refused = HandlerError::permanent("refused");
        let found = reconciled::<u16>(Ok(Err(refused.clone())), storable);
        assert_eq!(found, AfterReconcile::Failed(refused));
    }

    #[test]
    fn decision_reconciled_unknown_an_error_or_a_panic_stays_uncertain() {
        for found in [
            reconciled::<u16>(Ok(Ok(Reconciliation::Unknown)), storable),
            reconciled::<u16>(Ok(Err(HandlerError::transient("down"))), storable),
            reconciled::<u16>(Err("handler panicked: boom".into()), storable),
        ] {
            assert!(
                matches!(found, AfterReconcile::StillUncertain(_)),
                "{found:?}"
            );
        }
    }
}
