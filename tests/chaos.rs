//! Short chaos runs in CI, one per mode: the `chaos` example against the real broker and
//! database, with follow-up messages to a downstream idem worker (the outbox).
//!
//! It closes every broker connection and restarts RabbitMQ, so it lives alone in this
//! test binary: cargo runs test binaries one after another, never beside each other.

mod common;

use std::time::Duration;

use common::run_drill;

/// Both modes, one after the other (each restarts the broker).
#[tokio::test]
async fn short_chaos_runs_have_no_duplicate_and_no_lost_effect() {
    for mode in ["leased", "transactional"] {
        chaos_run(mode).await;
    }
}

async fn chaos_run(mode: &str) {
    let args = [
        "--orders",
        "2000",
        "--workers",
        "2",
        "--kills",
        "6",
        "--conn-drops",
        "2",
        "--pg-kills",
        "2",
        "--broker-restart",
        "--conflicts",
        "10",
        "--negatives",
        "10",
        "--follow-ups",
        "--mode",
        mode,
    ];
    let drill = run_drill("chaos", &args, Duration::from_secs(300)).await;
    drill.expect(&[
        ("mode", mode),
        ("kills", "6"),
        ("connection_drops", "2"),
        ("broker_restarts", "1"),
        ("effects", "2000"),
        ("duplicate_effects", "0"),
        ("lost", "0"),
        ("split_provider_keys", "0"),
        ("dlq_not_conflict", "0"),
        ("unfinished", "0"),
        ("dead_workers", "0"),
        ("negatives", "10"),
        ("follow_ups", "2000"),
        ("notifications", "2000"),
        ("duplicate_notifications", "0"),
        ("lost_notifications", "0"),
        ("notifications_for_failed", "0"),
        ("notifications_not_booked", "0"),
        ("outbox_undispatched", "0"),
        ("downstream_dlq", "0"),
        ("result", "ok"),
    ]);
    if mode == "transactional" {
        // Every effect in the transaction, once.
        drill.expect(&[("provider_calls_per_event_max", "1")]);
    }
    assert!(drill.success, "{}\n{}", drill.summary, drill.stderr);
}

/// The summary is read field by field: `backend_kills=6` is no `kills=6`.
#[test]
fn a_summary_field_is_matched_whole() {
    let fields = common::summary_fields("chaos: backend_kills=6 kills=0 result=ok");
    assert_eq!(fields["kills"], "0");
    assert_eq!(fields["backend_kills"], "6");
    assert!(!fields.contains_key("chaos:"));
}
