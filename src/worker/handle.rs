//! Running the handler (or its `reconcile`) under the lease, with heartbeats and panics
//! caught, and writing what it came to, fenced: a success commits the handler's
//! transaction with the `completed` record, a failure is recorded by its kind.

use std::time::Instant;

use serde::Deserialize;
use tracing::{Instrument, Span, info, info_span, warn};

use super::decision::{self, Ran, Reconciled};
use super::guard::guarded;
use super::ordered::Entity;
use super::owned::AHEAD;
use super::parse::Parsed;
use super::settle::Incoming;
use super::{Failure, Runtime};
use crate::failpoint;
use crate::fault::Fault;
use crate::handler::{Context, Handler, HandlerError};
use crate::metrics;
use crate::ordering::owner::{self, Done, Then};
use crate::ordering::table;
use crate::store::{Lease, Store, StoreError, StoredError};
use crate::trace;

/// The message, or the message again for a second run (the handler consumed the
/// first), and a fresh context for a run under `lease` in `span`: its follow-ups carry
/// that span's trace context.
fn prepare<H: Handler>(
    runtime: &Runtime<H>,
    incoming: &Incoming<'_>,
    parsed: &Parsed,
    message: Option<H::Message>,
    lease: &Lease,
    span: &Span,
) -> Result<(H::Message, Context), Failure> {
    let message = match message {
        Some(message) => message,
        None => H::Message::deserialize(&*parsed.value).map_err(Failure::Reparse)?,
    };
    let ctx = Context::new(
        parsed.key.clone(),
        lease.attempt,
        lease.takeover,
        runtime.store.pool().clone(),
    )
    .sealing_with(runtime.store.keys().cloned())
    .for_follow_ups(
        parsed.correlation_id.clone(),
        trace::outgoing(span, incoming.trace.as_ref()),
        runtime.config.outbox.handoff,
    )
    .with_envelope(incoming.envelope.clone());
    Ok((message, ctx))
}

/// Runs the handler under `lease` with a heartbeat, and records its outcome.
pub(super) async fn run<H: Handler>(
    runtime: &Runtime<H>,
    incoming: &Incoming<'_>,
    parsed: &Parsed,
    message: Option<H::Message>,
    lease: &Lease,
) -> Result<Ran, Failure> {
    let span = info_span!("handler");
    let (message, mut ctx) = prepare(runtime, incoming, parsed, message, lease, &span)?;
    if lease.takeover {
        metrics::delivery(H::OPERATION, "takeover");
    }
    let started = Instant::now();
    // Boxed: a delivery's future then holds a pointer to the handler's, whatever its
    // size (the accounts example's is 26 KB), instead of a copy moved with it through
    // every layer that awaits it.
    let handling = Box::pin(runtime.handler.handle(message, &mut ctx));
    let result = guarded(&runtime.store, lease, handling)
        .instrument(span)
        .await;
    metrics::handler_duration(H::OPERATION, started.elapsed());
    failpoint::hit("after-effect");
    let order = (parsed.entity.as_ref(), parsed.owned.as_ref());
    record(runtime, incoming, &mut ctx, lease, result, false, order)
        .instrument(info_span!("completion"))
        .await
}

/// Asks the handler what became of a pending operation, and acts on the answer.
pub(super) async fn reconcile<H: Handler>(
    runtime: &Runtime<H>,
    incoming: &Incoming<'_>,
    parsed: &Parsed,
    message: Option<H::Message>,
    lease: &Lease,
    external_ref: Option<&str>,
) -> Result<Ran, Failure> {
    let span = info_span!("reconcile");
    let (message, mut ctx) = prepare(runtime, incoming, parsed, message, lease, &span)?;
    // Boxed, as the handler's call in `run`.
    let reconciling = Box::pin(runtime.handler.reconcile(&message, external_ref, &mut ctx));
    let reconciled = guarded(&runtime.store, lease, reconciling)
        .instrument(span)
        .await;
    let answer = match decision::reconciled(reconciled) {
        Reconciled::Applied(output) => Ok(output),
        Reconciled::NotApplied => {
            info!("reconcile: not applied, running the handler again");
            drop(ctx);
            return run(runtime, incoming, parsed, Some(message), lease).await;
        }
        Reconciled::Failed(error) => Err(error),
    };
    let order = (parsed.entity.as_ref(), parsed.owned.as_ref());
    record(runtime, incoming, &mut ctx, lease, answer, true, order)
        .instrument(info_span!("completion"))
        .await
}

/// Writes the outcome, fenced by the lease; a success commits the handler's transaction
/// together with the `completed` record, then publishes the follow-up messages it
/// staged. On the handler's transaction, the delivery's entity (if it has one: `order`,
/// through the gate or owned) moves on in the same commit, and the turn it hands over
/// comes back in the answer (an owned move that was fenced out hands nothing: its
/// worker moves it again, and reads the position).
async fn record<H: Handler>(
    runtime: &Runtime<H>,
    incoming: &Incoming<'_>,
    ctx: &mut Context,
    lease: &Lease,
    result: Result<H::Output, HandlerError>,
    reconciled: bool,
    order: (Option<&Entity>, Option<&Done>),
) -> Result<Ran, Failure> {
    let store = &runtime.store;
    let tx = ctx.take_tx();
    let output = match result {
        Ok(output) => serde_json::to_value(output)
            .map_err(|e| format!("handler output does not serialize: {e}")),
        Err(error) => {
            drop(tx); // the handler's writes roll back
            return record_failure(store, lease, error, false).await;
        }
    };
    let output = match output {
        Ok(output) => output,
        Err(why) => {
            drop(tx);
            return unstorable(store, lease, why).await;
        }
    };
    let mut handed = None;
    let completed: Result<bool, StoreError> = match tx {
        None => runtime.completions.call((lease.clone(), output)).await?,
        Some(mut tx) => match store.complete_in(&mut *tx, lease, &output).await {
            Ok(()) => {
                // A failed release leaves the transaction aborted: it rolls back when
                // dropped, as a failed completion does.
                let released = match order {
                    (Some(entity), _) => {
                        let entities = std::slice::from_ref(entity);
                        table::release(&mut *tx, store.keys(), entities, true)
                            .await
                            .map(Some)
                    }
                    (None, Some(done)) => {
                        let done = std::slice::from_ref(done);
                        // The rows read after the released one follow it, for a run.
                        let then = Then::Release { ahead: AHEAD };
                        owner::move_on(&mut *tx, store.keys(), done, then)
                            .await
                            .map(|moved| {
                                let moved = moved.into_iter().next().filter(|m| m.moved)?;
                                Some([moved.next, moved.ahead].concat())
                            })
                    }
                    (None, None) => Ok(None),
                };
                match released {
                    Ok(released) => {
                        failpoint::hit("before-commit");
                        let committed = tx.commit().await;
                        handed = released;
                        committed.map(|()| true).map_err(StoreError::from)
                    }
                    Err(e) => Err(e),
                }
            }
            Err(StoreError::LeaseLost { .. }) => {
                // A zombie: another worker owns the operation; undo our writes.
                let _ = tx.rollback().await;
                Ok(false)
            }
            Err(e) => Err(e), // the transaction rolls back when dropped
        },
    };
    let ran = match completed {
        Ok(true) => Ran::Completed {
            reconciled,
            handed,
            chained: None,
        },
        Ok(false) => Ran::LeaseLost,
        Err(error) if error.fault() == Fault::Message => {
            let why = format!("the result could not be stored: {}", error.describe());
            return unstorable(store, lease, why).await;
        }
        // Neither the message nor an outage (a handler that left its transaction
        // aborted: SQLSTATE 25P02): a failure of this run, through the retry tiers to
        // `retries_exhausted`. Requeued as undecided, its redelivery would meet its own
        // live lease, wait for it, and take it over to run again, for ever.
        Err(error) if error.fault() == Fault::Unknown => {
            let why = format!("the outcome could not be recorded: {}", error.describe());
            warn!(error = %why, "completion failed");
            return record_failure(store, lease, HandlerError::Transient(why), false).await;
        }
        Err(error) => return Err(error.into()),
    };
    if matches!(ran, Ran::Completed { .. }) {
        failpoint::hit("after-complete");
        runtime
            .follow_ups
            .send(incoming.follow_ups, ctx.take_staged())
            .await;
    }
    Ok(ran)
}

/// The handler returned but its result cannot be stored (it does not serialize, or
/// Postgres refuses it): a failure for good, and an uncertain one, since the effect
/// happened but nothing records it. Dead-lettered; a replay reconciles first.
async fn unstorable(store: &Store, lease: &Lease, why: String) -> Result<Ran, Failure> {
    record_failure(store, lease, HandlerError::Permanent(why), true).await
}

/// Records a failed run by its kind: `failed` (retryable or not) or `pending`.
/// `uncertain` when the effect may have happened all the same.
async fn record_failure(
    store: &Store,
    lease: &Lease,
    error: HandlerError,
    uncertain: bool,
) -> Result<Ran, Failure> {
    let text = error.message().to_owned();
    let written = match &error {
        HandlerError::Transient(_) | HandlerError::Permanent(_) => {
            let retryable = matches!(error, HandlerError::Transient(_));
            let kind = error.kind();
            warn!(error = %text, "handler failed, {kind}");
            let stored = StoredError { kind, error: &text }.to_json();
            store.fail(lease, retryable, &stored, uncertain).await
        }
        HandlerError::Uncertain { external_ref, .. } => {
            warn!(error = %text, "outcome uncertain, pending reconciliation");
            let stored = StoredError {
                kind: error.kind(),
                error: &text,
            };
            let external_ref = external_ref.as_deref();
            store
                .mark_pending(lease, external_ref, &stored.to_json())
                .await
        }
    };
    let lease = lease.clone();
    match written {
        Ok(()) => Ok(match error {
            HandlerError::Transient(_) => Ran::Transient { lease, error: text },
            HandlerError::Permanent(_) => Ran::Permanent { lease, error: text },
            HandlerError::Uncertain { .. } => Ran::Pending { lease },
        }),
        Err(StoreError::LeaseLost { .. }) => Ok(Ran::LeaseLost),
        Err(e) => Err(e.into()),
    }
}
