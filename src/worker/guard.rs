//! Calling into the handler: a panic is caught and counts as a transient failure (the
//! message is retried, never lost, the worker lives on), and in leased mode heartbeats
//! keep the lease alive while the call runs.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use tracing::warn;

use crate::handler::HandlerError;
use crate::store::{Lease, Store, StoreError};

/// Awaits a call into the handler; a panic becomes a transient failure that says what
/// the panic said.
pub(super) async fn caught<T>(
    call: impl Future<Output = Result<T, HandlerError>>,
) -> Result<T, HandlerError> {
    AssertUnwindSafe(call)
        .catch_unwind()
        .await
        .unwrap_or_else(|panic| Err(HandlerError::transient(panic_text(&panic))))
}

/// Awaits a call into the handler ([`caught`]) while heartbeats keep `lease` alive.
///
/// The heartbeat runs in the same task as the call, so a short handler costs a timer,
/// not a task. A handler that blocks its thread stops its heartbeats too: it becomes a
/// zombie whose outcome the fencing token refuses, as if its process had stalled.
pub(super) async fn guarded<T>(
    store: &Store,
    lease: &Lease,
    call: impl Future<Output = Result<T, HandlerError>>,
) -> Result<T, HandlerError> {
    let call = caught(call);
    let beat = heartbeat(store, lease);
    tokio::pin!(call, beat);
    tokio::select! {
        biased;
        done = &mut call => done,
        never = &mut beat => match never {},
    }
}

/// Extends `lease` every third of the lease time, forever; after the lease is lost it
/// only waits (the outcome write will be refused).
async fn heartbeat(store: &Store, lease: &Lease) -> std::convert::Infallible {
    let every = store.config().lease / 3;
    loop {
        tokio::time::sleep(every).await;
        match store.heartbeat(lease).await {
            Ok(_) => {}
            Err(StoreError::LeaseLost { .. }) => {
                warn!(
                    "heartbeat: lease lost to another worker; this run's outcome will be refused"
                );
                return std::future::pending().await;
            }
            Err(error) => warn!(error = %crate::error_line(&error), "heartbeat failed; retrying"),
        }
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("handler panicked: {text}")
}
