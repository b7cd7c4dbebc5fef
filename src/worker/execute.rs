//! Doing what the decision says for one delivery: parse it, claim its key, run or
//! reconcile the handler under the lease with heartbeats, record the outcome (fenced),
//! and hand the last step to `settle`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lapin::message::Delivery;
use tracing::{Instrument, Span, debug, error, field, info, info_span, warn};

use super::batch::Batcher;
use super::decision::{self, Chained, Decided, Outcome, Ran, Retries, Step, Verdict};
use super::hand_on;
use super::handle;
use super::ordered::{self, InOrder};
use super::owned::Ahead;
use super::parse::{Parsed, parse};
use super::settle::{self, Incoming, Links, Settler, Source};
use super::transactional::{TxAnswer, TxRequest};
use super::{Failure, Runtime};
use crate::failpoint;
use crate::fault::Fault;
use crate::flow::circuit::{Admission, Circuit, Run};
use crate::handler::{Envelope, Handler};
use crate::ordering::Released;
use crate::store::{ClaimRequest, Lease, StoreError};
use crate::trace;

/// Decides one delivery inside its span and carries the verdict out on the broker; one
/// that could not be decided goes to [`undecided`]. When it completed and released its
/// entity's next turn, that delivery runs next in this task (it holds the turn), and so
/// on (docs/DESIGN.md, "Order per entity").
pub(super) async fn process<H: Handler>(
    runtime: &Runtime<H>,
    links: &Links,
    delivery: Delivery,
    admission: Admission,
) {
    let span = delivery_span(runtime, delivery.redelivered);
    if delivery.redelivered {
        runtime.sweep_wake.notify_one();
    }
    let envelope = Envelope {
        exchange: delivery.exchange.to_string(),
        routing_key: delivery.routing_key.to_string(),
        redelivered: delivery.redelivered,
        properties: delivery.properties.clone(),
    };
    let mut incoming = Incoming::new(&delivery.data, envelope, Some(&links.follow_ups));
    incoming.admission = admission;
    incoming.positions = links.positions.clone();
    if trace::continue_trace(
        &span,
        incoming.trace.as_ref(),
        &runtime.process_span,
        "consumer",
    ) {
        trace::consumer_attributes(&span, &runtime.config.queue, H::OPERATION, &delivery);
    }
    let from = Source::Broker(delivery.delivery_tag);
    let (released, ahead) = decide(runtime, links, &incoming, from, span).await;
    hand_on::hand_on(runtime, links, released, ahead).await;
}

/// Walks the decision table for `incoming` and settles it; what its entity released when
/// it completed (its next turn, handed over), and what it leaves for a leased run.
pub(super) async fn decide<H: Handler>(
    runtime: &Runtime<H>,
    links: &Links,
    incoming: &Incoming<'_>,
    from: Source<'_>,
    span: Span,
) -> (Vec<Released>, Ahead) {
    let received = Instant::now();
    let settler = Settler {
        incoming,
        dead_lettered: AtomicBool::new(false),
        links,
        operation: H::OPERATION,
        store: &runtime.store,
        from,
        queue: &runtime.config.queue,
        tally: runtime.tally.as_deref(),
    };
    async {
        let (mut entity, mut handed, mut owned, mut chained) = (None, None, None, None);
        let mut ahead = Ahead::None;
        let settled = match walk(runtime, incoming).await {
            Ok(mut decided) => {
                entity = decided.entity.take();
                handed = decided.handed.take();
                owned = decided.owned.take();
                chained = decided.chained.take();
                ahead = std::mem::take(&mut decided.ahead);
                settle(&settler, decided).await
            }
            Err(error) => Err(error),
        };
        let outcome = match settled {
            Ok(outcome) => {
                runtime.undecided.decided(incoming.data);
                outcome
            }
            Err(error) => undecided(runtime, &settler, error).await,
        };
        if let (Some(turn), Some(owner)) = (owned, &runtime.owner) {
            turn.leave(owner, outcome).await;
        }
        // The commit that completed it released its next turn already, or the release is
        // made now. A turn handed over in that commit is run whatever became of the ack.
        let next = hand_on::released_by(runtime, outcome, entity, handed).await;
        settler.count(outcome.as_str());
        count_chained(runtime, chained);
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
        (next, ahead)
    }
    .instrument(span)
    .await
}

/// The span of one delivery: its queue and operation now, its key and attempt once
/// known.
pub(crate) fn delivery_span<H: Handler>(runtime: &Runtime<H>, redelivered: bool) -> Span {
    info_span!(
        "delivery",
        queue = %runtime.config.queue,
        operation = H::OPERATION,
        scope = field::Empty,
        key = field::Empty,
        attempt = field::Empty,
        redelivered,
        otel.name = field::Empty,
        otel.kind = field::Empty,
    )
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
        _ if fault == Fault::Message => Some(message_fault(&error)),
        // Outages (deadlock victims, pool timeouts, a broken connection) heal by
        // waiting: only errors of unknown cause count against the delivery.
        _ if fault == Fault::Unknown && runtime.undecided.failed(settler.incoming.data) => {
            Some(decision::undecidable(line.clone()))
        }
        _ => None,
    };
    if let Some(verdict) = verdict {
        match settle(settler, Decided::without_key(verdict)).await {
            Ok(outcome) => return outcome,
            Err(e) => error!(error = %crate::text::error_line(&e), "dead letter not published"),
        }
    }
    error!(error = %line, %fault, "delivery not decided; requeueing it");
    tokio::time::sleep(runtime.undecided.pause()).await;
    settler.requeue().await;
    Outcome::Requeued
}

/// A failure the message itself caused: dead-lettered as malformed, saying why (what
/// Postgres said of data it refuses).
pub(crate) fn message_fault(error: &Failure) -> Verdict {
    match error {
        Failure::Store(store) => refused(store),
        other => decision::malformed(crate::text::error_line(other)),
    }
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

/// Walks the decision table for one delivery: claim, then run or reconcile as the
/// decision says, until it says how to settle.
pub(crate) async fn walk<H: Handler>(
    runtime: &Runtime<H>,
    incoming: &Incoming<'_>,
) -> Result<Decided, Failure> {
    let (mut parsed, message) = match parse(&*runtime.handler, &runtime.store, incoming.data) {
        Ok(parsed) => parsed,
        Err(why) => return Ok(Decided::without_key(decision::malformed(why))),
    };
    let span = Span::current();
    span.record("scope", parsed.key.scope());
    span.record("key", parsed.key.short_hash());
    trace::attribute(&span, "idem.key", parsed.key.short_hash());
    let trace_id = trace::trace_id(&span, incoming.trace.as_ref());
    let request = parsed.claim_request(incoming.properties(), trace_id);
    parsed.correlation_id = request.origin.correlation_id.clone();
    let retries = Retries {
        policy: &runtime.config.retry,
        used: incoming.retries(),
    };
    let circuit = runtime.circuit.as_deref();
    let admission = incoming.admission;
    if keeps_out(circuit, admission) {
        return Ok(Decided::paused(parsed.key));
    }
    let InOrder { entity, mut turn } =
        match ordered::enter_order(runtime, incoming, &mut parsed, &message).await? {
            Ok(entered) => entered,
            Err(verdict) => return Ok(Decided::with_key(verdict, parsed.key, None)),
        };
    let (hand_to, running) =
        ordered::begin_owned(runtime, incoming, turn.as_mut(), &mut parsed).await;
    let run = async {
        match &runtime.transactions {
            Some(transactions) => {
                drop(message); // the batch deserializes its own
                let request = TxRequest {
                    claim: request,
                    value: parsed.value.clone(),
                    trace: trace::outgoing(&span, incoming.trace.as_ref()),
                    envelope: incoming.envelope.clone(),
                    entity: parsed.entity.clone(),
                    owned: parsed.owned.clone(),
                };
                in_transaction(runtime, transactions, incoming, request, retries).await
            }
            None => leased(runtime, incoming, &parsed, message, &request, retries)
                .await
                .map(|(verdict, handed)| (verdict, handed, None)),
        }
    };
    // Pinned here and lent: handed over by value, the run (the handler's call, the
    // claim, the completion) would be stored twice in this future, as the argument and
    // as the pinned local, and copied between them.
    let (verdict, handed, chained) = {
        let run = std::pin::pin!(run);
        match (&mut turn, &runtime.owner) {
            (Some(held), Some(owner)) => owner.marked_if_long(held, run).await?,
            _ => run.await?,
        }
    };
    let mut decided = Decided::with_key(verdict, parsed.key, entity);
    decided.handed = handed;
    decided.chained = chained;
    if let Err(error) =
        ordered::end_owned(runtime, incoming, turn, &mut decided, hand_to, running).await
    {
        // The turns its batch chained committed with it: they count whatever becomes of
        // this delivery (requeued now, a duplicate when it comes back).
        count_chained(runtime, decided.chained.take());
        return Err(error);
    }
    Ok(decided)
}

/// Counts and logs the turns a delivery's batch ran after it in the same commit (owned
/// order's chains, `transactional/chain.rs`): each `executed`, as a delivery of its
/// own, and among the replays when its message was replayed from a dead-letter queue.
fn count_chained<H: Handler>(runtime: &Runtime<H>, chained: Option<Chained>) {
    let executed = Outcome::Executed.as_str();
    for turn in chained.map(|c| c.ran).unwrap_or_default() {
        settle::count(
            H::OPERATION,
            runtime.tally.as_deref(),
            executed,
            turn.replayed,
        );
        info!(outcome = executed, chained_key = %turn.key, seq = turn.seq, "delivery decided (chained)");
    }
}

/// Leased mode: claims the key, then runs or reconciles under the lease as the decision
/// says, retrying in process, until it says how to settle. With the verdict, what the
/// commit that completed the run released of the delivery's entity (see
/// [`Ran::Completed`]).
async fn leased<H: Handler>(
    runtime: &Runtime<H>,
    incoming: &Incoming<'_>,
    parsed: &Parsed,
    message: H::Message,
    request: &ClaimRequest,
    retries: Retries<'_>,
) -> Result<(Verdict, Option<Vec<Released>>), Failure> {
    let span = Span::current();
    let (circuit, admission) = (runtime.circuit.as_deref(), incoming.admission);
    let mut immediate = runtime.config.retry.immediate_backoff();
    let mut message = Some(message);
    let mut step = claim(runtime, request, retries, incoming.holds_turn).await?;
    let mut handed = None;
    loop {
        step = match step {
            Step::Run(lease) => {
                attempt_on(&span, &lease);
                failpoint::hit("after-claim");
                let mut ran =
                    handle::run(runtime, incoming, parsed, message.take(), &lease).await?;
                handed = handed_over(&mut ran);
                if counted(circuit, admission, &ran).await {
                    return Ok((decision::paused(), handed));
                }
                decision::after_run(ran, immediate.next(), retries)
            }
            Step::Reconcile {
                lease,
                external_ref,
            } => {
                attempt_on(&span, &lease);
                let external_ref = external_ref.as_deref();
                let message = message.take();
                let mut ran =
                    handle::reconcile(runtime, incoming, parsed, message, &lease, external_ref)
                        .await?;
                handed = handed_over(&mut ran);
                if counted(circuit, admission, &ran).await {
                    return Ok((decision::paused(), handed));
                }
                decision::after_run(ran, immediate.next(), retries)
            }
            Step::ClaimAgain { after } => {
                debug!(
                    delay_ms = after.as_millis() as u64,
                    "transient failure, retrying in process"
                );
                tokio::time::sleep(after).await;
                if keeps_out(circuit, admission) {
                    return Ok((decision::paused(), handed));
                }
                claim(runtime, request, retries, incoming.holds_turn).await?
            }
            Step::Settle(verdict) => return Ok((verdict, handed)),
        };
    }
}

/// What the commit that completed a run released of its entity's order, taken out of
/// `ran`.
fn handed_over(ran: &mut Ran) -> Option<Vec<Released>> {
    match ran {
        Ran::Completed { handed, .. } => handed.take(),
        _ => None,
    }
}

/// Whether the queue's circuit (if it has one) keeps a delivery let in as `admission`
/// from running now.
fn keeps_out(circuit: Option<&Circuit>, admission: Admission) -> bool {
    circuit.is_some_and(|c| !c.admits(admission))
}

/// Counts a run on the queue's circuit (if it has one). True when the delivery goes
/// back unrun from here: the run failed, and the circuit, open now, keeps it out (a
/// retry tier would only bring it back while the dependency is still down).
async fn counted(circuit: Option<&Circuit>, admission: Admission, ran: &Ran) -> bool {
    let Some(circuit) = circuit else {
        return false;
    };
    let (run, error) = match ran {
        Ran::Completed { .. } | Ran::Permanent { .. } => (Run::Answered, None),
        Ran::Transient { error, .. } => (Run::Failed, Some(error.as_str())),
        Ran::Pending { .. } => (Run::Failed, Some("outcome uncertain")),
        Ran::LeaseLost => return false,
    };
    circuit.ran(run, admission, error).await;
    run == Run::Failed && !circuit.admits(admission)
}

/// Names the attempt on the delivery's span (logs and trace).
fn attempt_on(span: &Span, lease: &Lease) {
    span.record("attempt", lease.attempt);
    trace::attribute(span, "idem.attempt", i64::from(lease.attempt));
    trace::attribute(span, "idem.takeover", lease.takeover);
}

/// Transactional mode: the delivery goes into its batch's transaction, which claims,
/// runs and records it; what it answers decides, as in leased mode. With the verdict,
/// what the batch's commit released of the delivery's entity (see [`Ran::Completed`]).
async fn in_transaction<H: Handler>(
    runtime: &Runtime<H>,
    transactions: &Batcher<TxRequest, TxAnswer>,
    incoming: &Incoming<'_>,
    request: TxRequest,
    retries: Retries<'_>,
) -> Result<(Verdict, Option<Vec<Released>>, Option<Chained>), Failure> {
    let (mut handed, mut chained) = (None, None);
    let mut immediate = runtime.config.retry.immediate_backoff();
    let circuit = runtime.circuit.as_deref();
    loop {
        // A handed-over turn's batch leaves without the linger, which every turn of a
        // hot entity would pay (see `ordered::Orderings`).
        let answer = transactions
            .submit(request.clone(), incoming.holds_turn)
            .instrument(info_span!("transaction"))
            .await?;
        let step = match answer {
            Ok(TxAnswer::Found(claim)) => decision::on_claim(claim, retries),
            Ok(TxAnswer::Ran(mut ran, follow_ups)) => {
                runtime
                    .follow_ups
                    .send(incoming.follow_ups, follow_ups)
                    .await;
                handed = handed_over(&mut ran);
                if let Ran::Completed { chained: ran, .. } = &mut ran {
                    chained = ran.take();
                }
                if counted(circuit, incoming.admission, &ran).await {
                    return Ok((decision::paused(), handed, chained));
                }
                decision::after_run(ran, immediate.next(), retries)
            }
            Ok(TxAnswer::Refused(why)) => Step::Settle(decision::malformed(why)),
            Err(error) if error.fault() == Fault::Message => Step::Settle(refused(&error)),
            Err(error) => return Err(error.into()),
        };
        match step {
            Step::Settle(verdict) => return Ok((verdict, handed, chained)),
            Step::ClaimAgain { after } => {
                tokio::time::sleep(after).await;
                if keeps_out(circuit, incoming.admission) {
                    return Ok((decision::paused(), handed, chained));
                }
            }
            // The batch runs and reconciles what it takes; it never hands a lease out.
            Step::Run(_) | Step::Reconcile { .. } => {
                return Err(Failure::Internal(
                    "a transactional batch handed a lease out",
                ));
            }
        }
    }
}

/// Claims the key and decides by what the claim found. A claim the database refuses
/// for the message's own data (a property Postgres cannot store) ends as malformed.
///
/// A delivery that holds its entity's turn (handed over by the release before it) claims
/// without the batch's linger (see `ordered::Orderings`).
async fn claim<H: Handler>(
    runtime: &Runtime<H>,
    request: &ClaimRequest,
    retries: Retries<'_>,
    holds_turn: bool,
) -> Result<Step, Failure> {
    let claimed = runtime
        .claims
        .submit(request.clone(), holds_turn)
        .instrument(info_span!("claim"))
        .await?;
    match claimed {
        Ok(claim) => Ok(decision::on_claim(claim, retries)),
        Err(error) if error.fault() == Fault::Message => Ok(Step::Settle(refused(&error))),
        Err(error) => Err(error.into()),
    }
}

/// Carries out the verdict on the broker and returns its outcome.
async fn settle(settler: &Settler<'_>, decided: Decided) -> Result<Outcome, Failure> {
    let Decided { verdict, key, .. } = decided;
    if verdict.outcome == Outcome::LeaseLost {
        warn!("lease lost to another worker; its outcome decides");
    }
    settler
        .apply(verdict.action, key.as_ref())
        .instrument(info_span!("settle"))
        .await?;
    Ok(verdict.outcome)
}

#[cfg(test)]
#[path = "execute_tests.rs"]
mod tests;
