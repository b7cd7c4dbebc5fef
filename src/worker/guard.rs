//! Calling into the handler: a panic is caught and counts as a transient failure (the
//! message is retried, never lost, the worker lives on), and in leased mode heartbeats
//! keep the lease alive while the call runs.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;

use crate::handler::HandlerError;
use crate::store::lease::{beside_heartbeat, panic_text};
use crate::store::{Lease, Store};

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
    beside_heartbeat(store, lease, call)
        .await
        .unwrap_or_else(|panic| Err(HandlerError::transient(panic)))
}
