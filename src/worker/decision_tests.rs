//! The decision table's unit tests: one per row of docs/DESIGN.md's table, then one per
//! way a run can end. They need neither Postgres nor RabbitMQ.

use super::*;
use crate::fingerprint::Fingerprint;
use serde_json::json;

fn lease(attempt: i32, takeover: bool) -> Lease {
    Lease {
        id: 7,
        token: 40 + i64::from(attempt),
        attempt,
        takeover,
        expires_at: chrono::DateTime::UNIX_EPOCH,
    }
}

fn policy() -> RetryPolicy {
    RetryPolicy {
        delays: vec![Duration::from_secs(5), Duration::from_secs(30)],
        ..RetryPolicy::default()
    }
}

/// A delivery that went through `used` delayed retries of `policy`.
fn retries(policy: &RetryPolicy, used: i64) -> Retries<'_> {
    Retries { policy, used }
}

fn dead(reason: Reason, error: &str, attempts: i64, pin: Option<i64>) -> Settle {
    Settle::DeadLetter(DeadLetterOrder {
        reason,
        error: error.into(),
        attempts,
        pin,
    })
}

#[test]
fn decision_no_record_runs_the_handler() {
    let p = policy();
    let step = on_claim(Claim::Claimed(lease(1, false)), retries(&p, 0));
    assert_eq!(step, Step::Run(lease(1, false)));
}

#[test]
fn decision_completed_same_payload_is_acked_without_running() {
    let p = policy();
    let claim = Claim::Completed {
        result: Some(json!({"booked": 1})),
    };
    assert_eq!(
        on_claim(claim, retries(&p, 0)),
        finish(Settle::Ack, Outcome::DuplicateCompleted)
    );
}

#[test]
fn decision_other_payload_is_a_conflict_dead_lettered_without_a_pin() {
    let p = policy();
    let claim = Claim::Conflict {
        stored: Fingerprint::of(&json!({"a": 1}), &[]),
    };
    assert_eq!(
        on_claim(claim, retries(&p, 2)),
        finish(
            dead(Reason::FingerprintConflict, CONFLICT, 0, None),
            Outcome::Conflict
        )
    );
}

#[test]
fn decision_live_lease_retries_later_without_spending_a_retry() {
    let p = policy();
    let claim = Claim::InProgress {
        lease_expires_at: None,
    };
    let later = Settle::Retry {
        delay: Duration::from_secs(5),
        retries: 1,
    };
    assert_eq!(
        on_claim(claim.clone(), retries(&p, 1)),
        finish(later, Outcome::DuplicateInProgress)
    );
    // Even when the delayed retries are used up: it is not this message's failure.
    assert!(matches!(
        on_claim(claim.clone(), retries(&p, 9)),
        Step::Settle(Verdict {
            action: Settle::Retry { retries: 9, .. },
            ..
        })
    ));
    // Without retry queues the message goes back to its queue after a pause.
    let none = RetryPolicy {
        delays: vec![],
        ..policy()
    };
    assert_eq!(
        on_claim(claim, retries(&none, 0)),
        finish(
            Settle::Requeue {
                after: none.max_backoff
            },
            Outcome::DuplicateInProgress
        )
    );
}

#[test]
fn decision_expired_lease_is_taken_over_and_run() {
    let p = policy();
    let takeover = lease(2, true);
    assert_eq!(
        on_claim(Claim::Claimed(takeover.clone()), retries(&p, 0)),
        Step::Run(takeover)
    );
}

#[test]
fn decision_retryable_failure_is_claimed_again_and_run() {
    let p = policy();
    let again = lease(3, false);
    assert_eq!(
        on_claim(Claim::Claimed(again.clone()), retries(&p, 1)),
        Step::Run(again)
    );
}

#[test]
fn decision_failed_for_good_and_dead_lettered_is_acked() {
    let p = policy();
    let claim = Claim::FailedForGood {
        id: 7,
        error: Some(json!({"error": "invalid amount", "kind": "permanent"})),
        attempts: 1,
        dead_lettered: true,
    };
    assert_eq!(
        on_claim(claim, retries(&p, 0)),
        finish(Settle::Ack, Outcome::DuplicateFailed)
    );
}

#[test]
fn decision_failed_for_good_without_its_dead_letter_publishes_it() {
    let p = policy();
    let claim = Claim::FailedForGood {
        id: 7,
        error: Some(json!({"error": "invalid amount", "kind": "permanent"})),
        attempts: 2,
        dead_lettered: false,
    };
    assert_eq!(
        on_claim(claim, retries(&p, 0)),
        finish(
            dead(Reason::PermanentFailure, "invalid amount", 2, Some(7)),
            Outcome::FailedPermanent
        )
    );
}

#[test]
fn decision_pending_is_reconciled_never_run_blindly() {
    let p = policy();
    let claim = Claim::Pending {
        lease: lease(2, false),
        external_ref: Some("pay-9".into()),
    };
    assert_eq!(
        on_claim(claim, retries(&p, 0)),
        Step::Reconcile {
            lease: lease(2, false),
            external_ref: Some("pay-9".into())
        }
    );
}

#[test]
fn decision_malformed_is_dead_lettered_without_key_or_pin() {
    assert_eq!(
        Step::Settle(malformed("body is not JSON".into())),
        finish(
            dead(Reason::Malformed, "body is not JSON", 0, None),
            Outcome::Malformed
        )
    );
}

#[test]
fn decision_completed_run_is_acked() {
    let p = policy();
    let ran = Ran::Completed {
        reconciled: false,
        handed: None,
        chained: None,
    };
    assert_eq!(
        after_run(ran, None, retries(&p, 0)),
        finish(Settle::Ack, Outcome::Executed)
    );
    let reconciled = Ran::Completed {
        reconciled: true,
        handed: None,
        chained: None,
    };
    assert_eq!(
        after_run(reconciled, None, retries(&p, 0)),
        finish(Settle::Ack, Outcome::Reconciled)
    );
}

#[test]
fn decision_transient_failure_retries_in_process_first() {
    let p = policy();
    let ran = Ran::Transient {
        lease: lease(1, false),
        error: "timeout".into(),
    };
    let pause = Duration::from_millis(150);
    assert_eq!(
        after_run(ran, Some(pause), retries(&p, 0)),
        Step::ClaimAgain { after: pause }
    );
}

#[test]
fn decision_transient_failure_then_goes_through_the_retry_tiers() {
    let p = policy();
    let ran = Ran::Transient {
        lease: lease(3, false),
        error: "timeout".into(),
    };
    let tier = |delay, retries| finish(Settle::Retry { delay, retries }, Outcome::FailedTransient);
    assert_eq!(
        after_run(ran.clone(), None, retries(&p, 0)),
        tier(Duration::from_secs(5), 1)
    );
    assert_eq!(
        after_run(ran, None, retries(&p, 1)),
        tier(Duration::from_secs(30), 2)
    );
}

#[test]
fn decision_transient_failure_past_every_retry_is_dead_lettered_and_pinned() {
    let p = policy();
    let ran = Ran::Transient {
        lease: lease(5, false),
        error: "timeout".into(),
    };
    assert_eq!(
        after_run(ran, None, retries(&p, 2)),
        finish(
            dead(Reason::RetriesExhausted, "timeout", 5, Some(7)),
            Outcome::RetriesExhausted
        )
    );
}

#[test]
fn decision_permanent_failure_is_dead_lettered_at_once_and_pinned() {
    let p = policy();
    let ran = Ran::Permanent {
        lease: lease(1, false),
        error: "invalid amount".into(),
    };
    assert_eq!(
        after_run(ran, Some(Duration::from_millis(100)), retries(&p, 0)),
        finish(
            dead(Reason::PermanentFailure, "invalid amount", 1, Some(7)),
            Outcome::FailedPermanent
        )
    );
}

#[test]
fn decision_uncertain_outcome_waits_in_the_retry_tiers_to_reconcile() {
    let p = policy();
    let ran = Ran::Pending {
        lease: lease(1, false),
    };
    assert_eq!(
        after_run(ran, Some(Duration::from_millis(100)), retries(&p, 0)),
        finish(
            Settle::Retry {
                delay: Duration::from_secs(5),
                retries: 1
            },
            Outcome::Pending
        )
    );
}

#[test]
fn decision_pending_past_every_retry_is_dead_lettered_with_its_attempts_and_pinned() {
    let p = policy();
    let ran = Ran::Pending {
        lease: lease(4, false),
    };
    assert_eq!(
        after_run(ran, None, retries(&p, 2)),
        finish(
            dead(Reason::RetriesExhausted, STILL_PENDING, 4, Some(7)),
            Outcome::RetriesExhausted
        )
    );
}

#[test]
fn decision_lost_lease_leaves_the_outcome_to_the_new_owner() {
    let p = policy();
    assert_eq!(
        after_run(Ran::LeaseLost, None, retries(&p, 2)),
        finish(
            Settle::Retry {
                delay: Duration::from_secs(5),
                retries: 2
            },
            Outcome::LeaseLost
        )
    );
}

/// Every outcome is on one line of the console's deliveries chart, or ends in a dead
/// letter that `dead_lettered` counts (the match is exhaustive: a new outcome has to be
/// placed here before this compiles).
#[test]
fn every_outcome_is_on_one_chart_line_or_counted_by_its_dead_letter() {
    use crate::tally::Line;
    let all = [
        Outcome::Executed,
        Outcome::DuplicateCompleted,
        Outcome::DuplicateInProgress,
        Outcome::DuplicateFailed,
        Outcome::Conflict,
        Outcome::Malformed,
        Outcome::FailedTransient,
        Outcome::FailedPermanent,
        Outcome::RetriesExhausted,
        Outcome::Pending,
        Outcome::Reconciled,
        Outcome::LeaseLost,
        Outcome::Requeued,
        Outcome::Undecidable,
        Outcome::Unroutable,
        Outcome::Paused,
        Outcome::Waiting,
        Outcome::OutOfSequence,
    ];
    for outcome in all {
        let line = match outcome {
            Outcome::Executed | Outcome::Reconciled => Some(Line::Executed),
            Outcome::DuplicateCompleted
            | Outcome::DuplicateInProgress
            | Outcome::DuplicateFailed => Some(Line::Duplicates),
            Outcome::FailedTransient
            | Outcome::Pending
            | Outcome::LeaseLost
            | Outcome::Requeued => Some(Line::Retried),
            Outcome::Conflict
            | Outcome::Malformed
            | Outcome::FailedPermanent
            | Outcome::RetriesExhausted
            | Outcome::Undecidable
            | Outcome::Unroutable
            | Outcome::OutOfSequence
            | Outcome::Paused
            | Outcome::Waiting => None,
        };
        assert_eq!(Line::of(outcome.as_str()), line, "{outcome:?}");
    }
    assert_eq!(Line::of("dead_lettered"), Some(Line::DeadLettered));
}
