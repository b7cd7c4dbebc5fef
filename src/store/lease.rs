//! Keeping a lease while work runs: heartbeats beside the work, in the same task, and a
//! panic of the work caught and told as text. The worker's handlers and the HTTP
//! layer's routes both run under it.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;

use super::{Lease, Store, StoreError};

impl Store {
    /// Extends `lease` every third of the lease time, forever, while the caller's work
    /// runs beside it (`select!`, in the same task: a short run costs a timer, not a
    /// task); once the lease is lost it only waits (the outcome write will be refused).
    pub(crate) async fn keep_alive(&self, lease: &Lease) -> std::convert::Infallible {
        let every = self.config.lease / 3;
        loop {
            tokio::time::sleep(every).await;
            match self.heartbeat(lease).await {
                Ok(_) => {}
                Err(StoreError::LeaseLost { .. }) => {
                    tracing::warn!(
                        "heartbeat: lease lost to another owner; this run's outcome will be refused"
                    );
                    return std::future::pending().await;
                }
                Err(error) => {
                    tracing::warn!(error = %crate::text::error_line(&error), "heartbeat failed; retrying")
                }
            }
        }
    }
}

/// Awaits `work` while heartbeats keep `lease` alive, with a panic caught and told as
/// text.
///
/// The heartbeat runs in the same task as the work, so a short run costs a timer, not a
/// task. Work that blocks its thread stops its heartbeats too: it becomes a zombie whose
/// outcome the fencing token refuses, as if its process had stalled.
pub(crate) async fn beside_heartbeat<F: Future>(
    store: &Store,
    lease: &Lease,
    work: F,
) -> Result<F::Output, String> {
    let work = AssertUnwindSafe(work).catch_unwind();
    let beat = store.keep_alive(lease);
    tokio::pin!(work, beat);
    tokio::select! {
        biased;
        done = &mut work => done.map_err(|panic| panic_text(&panic)),
        never = &mut beat => match never {},
    }
}

/// What a panic said.
pub(crate) fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("handler panicked: {text}")
}
