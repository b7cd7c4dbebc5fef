//! Failpoints: abort the process (or fail a step) at a named point, to prove crash
//! safety in tests.
//!
//! Compiled in only with the `failpoints` cargo feature; without it [`hit`], [`fails`],
//! [`stalls`] and [`stretched`] are empty and cost nothing. With it,
//! `IDEM_FAILPOINT=<name>` makes the process abort (no unwinding, no cleanup, like a
//! `SIGKILL`) the first time it passes that point:
//!
//! | name | where |
//! |---|---|
//! | `after-claim` | the claim committed, the handler has not run |
//! | `after-effect` | the handler returned (its external effect is done), nothing recorded |
//! | `before-commit` | the completion is written in the handler's transaction, not committed |
//! | `after-complete` | the completion committed, the delivery not acked |
//! | `before-dispatch` | the completion committed with staged follow-ups, none published |
//! | `before-dispatch-mark` | follow-ups published and confirmed, not marked dispatched |
//! | `after-hand-on` | a leased run's turn completed and handed on to the row after it, the position not moved |
//! | `before-turn-run` | a turn was released, in this process, to the delivery waiting for it (its row released), which has not run |
//! | `after-publish` | a retry or dead letter published and confirmed, the original not acked |
//! | `discard-acked` | `idem dlq discard` acked a dead letter, its record not yet unpinned |
//! | `http-single-after-claim` | a single-commit HTTP request holds its key in its transaction (the key's lock, or a claimed record), the route has not run |
//! | `http-single-before-commit` | its record with the answer is written in that transaction (an answer stored without the route's writes: in a transaction of its own), not committed |
//! | `http-single-after-commit` | it committed, the client has no answer yet |
//!
//! A few points fail instead, once per process, as an outage would (a pool timeout),
//! and the process goes on ([`fails`]):
//!
//! | name | where |
//! |---|---|
//! | `owned-move-error` | an owned turn's move is made (in its commit: a transactional batch's, with the turns it chained, or a leased handler's; or on its own after it) and its end in memory too, nothing was handed to run next: where fetching a row parked meanwhile may fail |
//! | `owned-mark-error` | a long owned turn's first mark (which writes it down as its entity's holder) is due: that mark fails, the next is tried a second later |
//!
//! And one waits for good, once per process, as for a connection an outage holds back
//! ([`stalls`]):
//!
//! | name | where |
//! |---|---|
//! | `owned-mark-stall` | a long owned turn's first mark waits for its connection |
//!
//! The same builds let tests stretch a timing the behaviour they prove depends on
//! ([`stretched`]).

/// `default`, or with the `failpoints` feature the milliseconds in the environment
/// variable `var` when it holds a number: tests on a loaded machine stretch a timing
/// that the behaviour they prove depends on (`IDEM_RUN_FOR_MS`: how long a leased run
/// hands turns on without a move, `worker/owned/run.rs`; `IDEM_MARK_AFTER_MS`: when a
/// long owned turn is written down as its entity's holder, `worker/owned/mod.rs`).
#[cfg(feature = "failpoints")]
pub(crate) fn stretched(var: &str, default: std::time::Duration) -> std::time::Duration {
    std::env::var(var)
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(default, std::time::Duration::from_millis)
}

/// `default`: built without the `failpoints` feature.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn stretched(_var: &str, default: std::time::Duration) -> std::time::Duration {
    default
}

/// Whether `IDEM_FAILPOINT` names this point.
#[cfg(feature = "failpoints")]
fn chosen(name: &str) -> bool {
    std::env::var("IDEM_FAILPOINT").is_ok_and(|point| point == name)
}

/// Whether `IDEM_FAILPOINT` names this point and it has not failed yet in this process
/// (feature `failpoints` only): the caller then fails as an outage would.
#[cfg(feature = "failpoints")]
pub(crate) fn fails(name: &str) -> bool {
    use std::sync::atomic::{AtomicBool, Ordering};
    static FAILED: AtomicBool = AtomicBool::new(false);
    let failing = chosen(name) && !FAILED.swap(true, Ordering::SeqCst);
    if failing {
        eprintln!("failpoint {name}: failing once");
    }
    failing
}

/// Never: built without the `failpoints` feature.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn fails(_name: &str) -> bool {
    false
}

/// Never returns if `IDEM_FAILPOINT` names this point, the first time in this process
/// (feature `failpoints` only): the caller waits as for a connection an outage holds
/// back (until the pool's acquire timeout, 10 s for idem's pools).
#[cfg(feature = "failpoints")]
pub(crate) async fn stalls(name: &str) {
    if fails(name) {
        std::future::pending::<()>().await;
    }
}

/// Returns at once: built without the `failpoints` feature.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) async fn stalls(_name: &str) {}

/// Aborts the process if `IDEM_FAILPOINT` names this point (feature `failpoints` only).
#[cfg(feature = "failpoints")]
pub(crate) fn hit(name: &str) {
    if chosen(name) {
        eprintln!("failpoint {name}: aborting");
        std::process::abort();
    }
}

/// Does nothing: built without the `failpoints` feature.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn hit(_name: &str) {}
