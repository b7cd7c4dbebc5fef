//! Doing what the decision says for one delivery: parse it, claim its key, run or
//! reconcile the handler under the lease with heartbeats, record the outcome (fenced),
//! and hand the last step to `settle`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lapin::message::Delivery;
use serde::Deserialize;
use serde_json::Value;
use tracing::{Instrument, Span, debug, error, field, info, info_span, warn};

use super::batch::Batcher;
use super::decision::{self, Outcome, Ran, Reconciled, Retries, Step, Verdict};
use super::guard::guarded;
use super::settle::{Links, Settler};
use super::transactional::{TxAnswer, TxRequest};
use super::{Failure, Runtime};
use crate::failpoint;
use crate::fault::Fault;
use crate::fingerprint::Fingerprint;
use crate::handler::{Context, Handler, HandlerError};
use crate::headers;
use crate::key::Key;
use crate::metrics;
use crate::store::{ClaimRequest, Lease, Origin, Store, StoreError, StoredError, storable};
use crate::trace::{self, TraceContext};

/// Decides one delivery inside its span; one that could not be decided goes to
/// [`undecided`].
pub(super) async fn process<H: Handler>(runtime: &Runtime<H>, links: &Links, delivery: Delivery) {
    let span = info_span!(
        "delivery",
        queue = %runtime.config.queue,
        operation = H::OPERATION,
        scope = field::Empty,
        key = field::Empty,
        attempt = field::Empty,
        redelivered = delivery.redelivered,
        otel.name = field::Empty,
        otel.kind = field::Empty,
    );
    let incoming = TraceContext::from_properties(&delivery.properties);
    if trace::continue_trace(&span, incoming.as_ref(), &runtime.process_span, "consumer") {
        trace::consumer_attributes(&span, &runtime.config.queue, H::OPERATION, &delivery);
    }
    let received = Instant::now();
    let settler = Settler {
        trace: incoming,
        replays: headers::integer(&delivery.properties, headers::REPLAYS).unwrap_or(0),
        dead_lettered: AtomicBool::new(false),
        links,
        operation: H::OPERATION,
        store: &runtime.store,
        delivery: &delivery,
        queue: &runtime.config.queue,
        tally: runtime.tally.as_deref(),
    };
    async {
        let outcome = match decide(runtime, &settler).await {
            Ok(outcome) => {
                runtime.undecided.decided(&settler.delivery.data);
                outcome
            }
            Err(error) => undecided(runtime, &settler, error).await,
        };
        settler.count(outcome.as_str());
        let span = Span::current();
        trace::attribute(&span, "idem.outcome", outcome.as_str());
        if settler.dead_lettered.load(Ordering::Relaxed) {
            trace::error_status(&span, "dead-lettered");
        }
        info!(
            outcome = outcome.as_str(),
            elapsed_ms = rounded_ms(received.elapsed()),
            "delivery decided"
        );
    }
    .instrument(span)
    .await
}

/// A delivery that could not be decided (docs/DESIGN.md, "Errors by cause"). The
/// message's own fault is dead-lettered at once as `malformed`: the same bytes would
/// fail the same way. Anything else is requeued after a pause that grows while nothing
/// gets decided (an outage), unless the safety net gives the delivery up as
/// `undecidable`: it failed again and again while the store decided others.
async fn undecided<H: Handler>(
    runtime: &Runtime<H>,
    settler: &Settler<'_>,
    error: Failure,
) -> Outcome {
    let fault = error.fault();
    let line = crate::text::error_line(&error);
    let verdict = match &error {
        Failure::Store(store) if fault == Fault::Message => Some(refused(store)),
        _ if fault == Fault::Message => Some(decision::malformed(line.clone())),
        // Outages (deadlock victims, pool timeouts, a broken connection) heal by
        // waiting: only errors of unknown cause count against the delivery.
        _ if fault == Fault::Unknown && runtime.undecided.failed(&settler.delivery.data) => {
            Some(decision::undecidable(line.clone()))
        }
        _ => None,
    };
    if let Some(verdict) = verdict {
        match settle(settler, verdict, None).await {
            Ok(outcome) => return outcome,
            Err(e) => error!(error = %crate::text::error_line(&e), "dead letter not published"),
        }
    }
    error!(error = %line, %fault, "delivery not decided; requeueing it");
    tokio::time::sleep(runtime.undecided.pause()).await;
    settler.requeue();
    Outcome::Requeued
}

/// A delivery whose data the database refuses: dead-lettered as malformed, saying what
/// Postgres said.
fn refused(error: &StoreError) -> Verdict {
    decision::malformed(format!(
        "the database refused the message: {}",
        error.describe()
    ))
}

/// Milliseconds with one decimal, for logs (`10.2`, not `10.247793999999999`).
fn rounded_ms(elapsed: Duration) -> f64 {
    (elapsed.as_secs_f64() * 10_000.0).round() / 10.0
}

/// A message that passed parsing; the typed message travels beside it, since the
/// handler consumes it.
struct Parsed {
    value: Arc<Value>,
    key: Key,
    fingerprint: Fingerprint,
    /// The message's correlation id, carried on to its follow-up messages.
    correlation_id: Option<String>,
}

fn parse<H: Handler>(handler: &H, body: &[u8]) -> Result<(Parsed, H::Message), String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("body is not JSON: {e}"))?;
    if !value.is_object() {
        return Err("body is not a JSON object".into());
    }
    let message = H::Message::deserialize(&value)
        .map_err(|e| format!("body does not fit the message: {e}"))?;
    let key = Key::new(
        handler.scope(&message),
        H::OPERATION,
        handler.idempotency_key(&message),
    )
    .map_err(|e| format!("invalid key: {e}"))?;
    let fingerprint = Fingerprint::of(&value, handler.volatile_fields());
    let parsed = Parsed {
        value: Arc::new(value),
        key,
        fingerprint,
        correlation_id: None,
    };
    Ok((parsed, message))
}

/// Walks the decision table for one delivery: claim, then run or reconcile as the
/// decision says, until it says how to settle.
async fn decide<H: Handler>(
    runtime: &Runtime<H>,
    settler: &Settler<'_>,
) -> Result<Outcome, Failure> {
    let (mut parsed, message) = match parse(&*runtime.handler, &settler.delivery.data) {
        Ok(parsed) => parsed,
        Err(why) => return settle(settler, decision::malformed(why), None).await,
    };
    let span = Span::current();
    span.record("scope", parsed.key.scope());
    span.record("key", parsed.key.short_hash());
    trace::attribute(&span, "idem.key", parsed.key.short_hash());
    let properties = &settler.delivery.properties;
    let request = ClaimRequest {
        key: parsed.key.clone(),
        fingerprint: parsed.fingerprint.clone(),
        // Kept for inspection only: a NUL in them (Postgres text cannot hold one) must not
        // fail the claim, nor the claims of the batch around it.
        origin: Origin {
            message_id: properties
                .message_id()
                .as_ref()
                .map(|s| storable(s.as_str()).into_owned()),
            correlation_id: properties
                .correlation_id()
                .as_ref()
                .map(|s| storable(s.as_str()).into_owned()),
            trace_id: trace::trace_id(&span, settler.trace.as_ref()),
        },
    };
    parsed.correlation_id = request.origin.correlation_id.clone();
    let retries = Retries {
        policy: &runtime.config.retry,
        used: settler.retries(),
    };
    if let Some(transactions) = &runtime.transactions {
        drop(message); // the batch deserializes its own
        let request = TxRequest {
            claim: request,
            value: parsed.value.clone(),
            trace: trace::outgoing(&span, settler.trace.as_ref()),
        };
        return in_transaction(
            runtime,
            transactions,
            settler,
            request,
            &parsed.key,
            retries,
        )
        .await;
    }
    let mut immediate = runtime.config.retry.immediate_backoff();
    let mut message = Some(message);
    let mut step = claim(runtime, &request, retries).await?;
    loop {
        step = match step {
            Step::Run(lease) => {
                attempt_on(&span, &lease);
                failpoint::hit("after-claim");
                let ran = run(runtime, settler, &parsed, message.take(), &lease).await?;
                decision::after_run(ran, immediate.next(), retries)
            }
            Step::Reconcile {
                lease,
                external_ref,
            } => {
                attempt_on(&span, &lease);
                let external_ref = external_ref.as_deref();
                let ran = reconcile(
                    runtime,
                    settler,
                    &parsed,
                    message.take(),
                    &lease,
                    external_ref,
                )
                .await?;
                decision::after_run(ran, immediate.next(), retries)
            }
            Step::ClaimAgain { after } => {
                debug!(
                    delay_ms = after.as_millis() as u64,
                    "transient failure, retrying in process"
                );
                tokio::time::sleep(after).await;
                claim(runtime, &request, retries).await?
            }
            Step::Settle(verdict) => return settle(settler, verdict, Some(&parsed.key)).await,
        };
    }
}

/// Names the attempt on the delivery's span (logs and trace).
fn attempt_on(span: &Span, lease: &Lease) {
    span.record("attempt", lease.attempt);
    trace::attribute(span, "idem.attempt", i64::from(lease.attempt));
    trace::attribute(span, "idem.takeover", lease.takeover);
}

/// Transactional mode: the delivery goes into its batch's transaction, which claims,
/// runs and records it; what it answers decides, as in leased mode.
async fn in_transaction<H: Handler>(
    runtime: &Runtime<H>,
    transactions: &Batcher<TxRequest, TxAnswer>,
    settler: &Settler<'_>,
    request: TxRequest,
    key: &Key,
    retries: Retries<'_>,
) -> Result<Outcome, Failure> {
    let mut immediate = runtime.config.retry.immediate_backoff();
    loop {
        let answer = transactions
            .call(request.clone())
            .instrument(info_span!("transaction"))
            .await;
        let step = match answer {
            Ok(TxAnswer::Found(claim)) => decision::on_claim(claim, retries),
            Ok(TxAnswer::Ran(ran, follow_ups)) => {
                runtime
                    .follow_ups
                    .send(&settler.links.follow_ups, follow_ups)
                    .await;
                decision::after_run(ran, immediate.next(), retries)
            }
            Ok(TxAnswer::Refused(why)) => Step::Settle(decision::malformed(why)),
            Err(error) if error.fault() == Fault::Message => Step::Settle(refused(&error)),
            Err(error) => return Err(error.into()),
        };
        match step {
            Step::Settle(verdict) => return settle(settler, verdict, Some(key)).await,
            Step::ClaimAgain { after } => tokio::time::sleep(after).await,
            // The batch runs and reconciles what it takes; it never hands a lease out.
            Step::Run(_) | Step::Reconcile { .. } => {
                return Err(StoreError::UnknownClaimRow(
                    "lease out of a transactional batch".into(),
                )
                .into());
            }
        }
    }
}

/// Claims the key and decides by what the claim found. A claim the database refuses
/// for the message's own data (a property Postgres cannot store) ends as malformed.
async fn claim<H: Handler>(
    runtime: &Runtime<H>,
    request: &ClaimRequest,
    retries: Retries<'_>,
) -> Result<Step, Failure> {
    let claimed = runtime
        .claims
        .call(request.clone())
        .instrument(info_span!("claim"))
        .await;
    match claimed {
        Ok(claim) => Ok(decision::on_claim(claim, retries)),
        Err(error) if error.fault() == Fault::Message => Ok(Step::Settle(refused(&error))),
        Err(error) => Err(error.into()),
    }
}

/// Carries out the verdict on the broker and returns its outcome.
async fn settle(
    settler: &Settler<'_>,
    verdict: Verdict,
    key: Option<&Key>,
) -> Result<Outcome, Failure> {
    if verdict.outcome == Outcome::LeaseLost {
        warn!("lease lost to another worker; its outcome decides");
    }
    settler
        .apply(verdict.action, key)
        .instrument(info_span!("settle"))
        .await?;
    Ok(verdict.outcome)
}

/// The message, or the message again for a second run (the handler consumed the
/// first), and a fresh context for a run under `lease` in `span`: its follow-ups carry
/// that span's trace context.
fn prepare<H: Handler>(
    runtime: &Runtime<H>,
    settler: &Settler<'_>,
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
    .for_follow_ups(
        parsed.correlation_id.clone(),
        trace::outgoing(span, settler.trace.as_ref()),
        runtime.config.outbox.handoff,
    );
    Ok((message, ctx))
}

/// Runs the handler under `lease` with a heartbeat, and records its outcome.
async fn run<H: Handler>(
    runtime: &Runtime<H>,
    settler: &Settler<'_>,
    parsed: &Parsed,
    message: Option<H::Message>,
    lease: &Lease,
) -> Result<Ran, Failure> {
    let span = info_span!("handler");
    let (message, mut ctx) = prepare(runtime, settler, parsed, message, lease, &span)?;
    if lease.takeover {
        metrics::delivery(H::OPERATION, "takeover");
    }
    let started = Instant::now();
    let handling = runtime.handler.handle(message, &mut ctx);
    let result = guarded(&runtime.store, lease, handling)
        .instrument(span)
        .await;
    metrics::handler_duration(H::OPERATION, started.elapsed());
    failpoint::hit("after-effect");
    record(runtime, settler, &mut ctx, lease, result, false)
        .instrument(info_span!("completion"))
        .await
}

/// Asks the handler what became of a pending operation, and acts on the answer.
async fn reconcile<H: Handler>(
    runtime: &Runtime<H>,
    settler: &Settler<'_>,
    parsed: &Parsed,
    message: Option<H::Message>,
    lease: &Lease,
    external_ref: Option<&str>,
) -> Result<Ran, Failure> {
    let span = info_span!("reconcile");
    let (message, mut ctx) = prepare(runtime, settler, parsed, message, lease, &span)?;
    let reconciling = runtime.handler.reconcile(&message, external_ref, &mut ctx);
    let reconciled = guarded(&runtime.store, lease, reconciling)
        .instrument(span)
        .await;
    let answer = match decision::reconciled(reconciled) {
        Reconciled::Applied(output) => Ok(output),
        Reconciled::NotApplied => {
            info!("reconcile: not applied, running the handler again");
            drop(ctx);
            return run(runtime, settler, parsed, Some(message), lease).await;
        }
        Reconciled::Failed(error) => Err(error),
    };
    record(runtime, settler, &mut ctx, lease, answer, true)
        .instrument(info_span!("completion"))
        .await
}

/// Writes the outcome, fenced by the lease; a success commits the handler's transaction
/// together with the `completed` record, then publishes the follow-up messages it
/// staged.
async fn record<H: Handler>(
    runtime: &Runtime<H>,
    settler: &Settler<'_>,
    ctx: &mut Context,
    lease: &Lease,
    result: Result<H::Output, HandlerError>,
    reconciled: bool,
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
    let done = Ran::Completed { reconciled };
    let completed: Result<bool, StoreError> = match tx {
        None => runtime.completions.call((lease.clone(), output)).await,
        Some(mut tx) => match store.complete_in(&mut *tx, lease, &output).await {
            Ok(()) => {
                failpoint::hit("before-commit");
                tx.commit().await.map(|()| true).map_err(StoreError::from)
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
        Ok(true) => done,
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
            .send(&settler.links.follow_ups, ctx.take_staged())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_durations_are_rounded_to_a_tenth_of_a_millisecond() {
        assert_eq!(rounded_ms(Duration::from_nanos(10_247_793)), 10.2);
        assert_eq!(rounded_ms(Duration::from_micros(1_950)), 2.0);
    }
}
