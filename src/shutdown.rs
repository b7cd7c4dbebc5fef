//! Stopping a worker on SIGTERM or Ctrl-C, so no `main` has to write its own handler.

pub use tokio_util::sync::CancellationToken;

/// A token that is cancelled on the first SIGTERM or Ctrl-C (SIGINT): pass it to
/// [`crate::Worker::run`], which then stops consuming, lets the handlers in flight
/// finish, acks them and returns.
///
/// Spawns the waiting task on the current Tokio runtime, so call it from inside one.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    tokio::spawn(cancel_on_signal(token.clone()));
    token
}

async fn cancel_on_signal(token: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("stop requested");
    token.cancel();
}
