use super::*;

/// A delivery kept for its turn is acked as parked, and only such a one: on a queue of
/// owned order, that ack is what makes the channel's acks wait longer for older
/// deliveries (`acks::Hold::owned`), the hold that spared RabbitMQ most of its walks of
/// the unacked deliveries (docs/PERFORMANCE.md).
#[test]
fn only_a_delivery_kept_for_its_turn_is_acked_as_parked() {
    for gate in [Gate::Run, Gate::Wait, Gate::Waiting] {
        let verdict = verdict_of(gate, "account-7", Some(3));
        assert_eq!(verdict.outcome, Outcome::Waiting);
        assert_eq!(verdict.action, Settle::AckWaiting);
    }
    for gate in [Gate::Passed, Gate::Taken, Gate::Conflict] {
        let verdict = verdict_of(gate, "account-7", Some(3));
        assert_ne!(verdict.outcome, Outcome::Waiting);
        assert!(
            matches!(verdict.action, Settle::DeadLetter(_)),
            "{:?}",
            verdict.action
        );
    }
}
