//! The optimistic pass's runs in one call: the batch's runnable deliveries go to
//! [`Handler::handle_batch`] together. A handler that does not take batches answers
//! `None` once, and from then on each delivery runs through [`Handler::handle`] in
//! turn, as before.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tracing::{Instrument, field, info_span};

use super::run::{Prepared, RunIn, done};
use super::{Owner, Pass, RunResult, TxRequest};
use crate::batch::Batch;
use crate::failpoint;
use crate::handler::{Context, Handler};
use crate::metrics;
use crate::trace;
use crate::worker::guard::caught;

/// Whether the worker still hands its handler batches: until the handler answers
/// `None` (the default [`Handler::handle_batch`]) once.
#[derive(Debug)]
pub(in crate::worker) struct Batching(AtomicBool);

impl Default for Batching {
    fn default() -> Self {
        Self(AtomicBool::new(true))
    }
}

impl Batching {
    pub(super) fn asks(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Runs the deliveries at `runnable` (positions in `requests`, with whose run each
/// is) on the transaction `ctx` holds, in the optimistic pass. `None` when one of them
/// failed or no longer fits its message: the batch runs again carefully.
pub(super) async fn run<H: Handler>(
    handler: &H,
    ctx: &mut Context,
    requests: &[TxRequest],
    runnable: Vec<(usize, Owner)>,
    handoff: Duration,
    batching: &Batching,
) -> Option<Vec<(usize, Owner, RunResult)>> {
    let mut messages = Vec::with_capacity(runnable.len());
    let mut contexts = Vec::with_capacity(runnable.len());
    let mut spans = Vec::with_capacity(runnable.len());
    for (i, owner) in &runnable {
        let run = RunIn::of(&requests[*i], owner, Pass::Optimistic, handoff);
        let Prepared {
            message,
            context,
            span,
        } = run.prepare::<H>(ctx.pool()).ok()?;
        messages.push(message);
        contexts.push(context.sealing_with(ctx.keys().cloned()));
        spans.push(span);
    }
    let mut batch = Batch::new(messages, contexts, ctx.pool().clone(), ctx.take_tx());
    let size = runnable.len();
    let started = Instant::now();
    let span = batch_span(H::OPERATION, &spans);
    let answered = caught(async { Ok(handler.handle_batch(&mut batch).await) })
        .instrument(span)
        .await;
    let touched = batch.touched();
    let (messages, contexts, tx) = batch.into_parts();
    ctx.lend_tx(tx);
    let outcomes = match answered {
        Ok(Some(outcomes)) if outcomes.len() == size => outcomes,
        Ok(Some(outcomes)) => {
            tracing::warn!(
                operation = H::OPERATION,
                answered = outcomes.len(),
                size,
                "handle_batch answered another count of outcomes than messages; running each alone"
            );
            return None;
        }
        // A handler without batches: the next batches run one message at a time, as
        // before, and so does this one, unless its `handle_batch` wrote or staged
        // something before it answered `None`: then it runs again carefully, on a
        // fresh transaction, so that none of that is kept.
        Ok(None) => {
            batching.0.store(false, Ordering::Relaxed);
            if touched {
                return None;
            }
            return one_by_one(handler, ctx, runnable, messages, contexts, spans).await;
        }
        Err(_) => return None,
    };
    failpoint::hit("after-effect");
    // Each message's share of the call, so that the histogram stays per message.
    let share = started.elapsed() / u32::try_from(size).unwrap_or(u32::MAX).max(1);
    let mut runs = Vec::with_capacity(size);
    for (((i, owner), outcome), mut context) in runnable.into_iter().zip(outcomes).zip(contexts) {
        metrics::handler_duration(H::OPERATION, share);
        let result = done(outcome.ok()?, false, context.take_staged());
        if !matches!(result, RunResult::Done { .. }) {
            return None;
        }
        runs.push((i, owner, result));
    }
    drop(spans);
    Some(runs)
}

/// The span of one `handle_batch` call: a trace of its own (a batch belongs to no one
/// delivery's), linked to each delivery's handler span (`spans`), as the messaging
/// conventions have batches do.
fn batch_span(operation: &str, spans: &[tracing::Span]) -> tracing::Span {
    let span = info_span!(
        "handle_batch",
        idem.batch_size = spans.len(),
        otel.name = field::Empty,
        otel.kind = field::Empty
    );
    if trace::continue_trace(
        &span,
        None,
        &format!("handle_batch {operation}"),
        "internal",
    ) {
        trace::link(&span, spans);
    }
    span
}

/// Each prepared delivery through [`Handler::handle`], in turn, on the transaction
/// `ctx` holds; `None` at the first that fails.
async fn one_by_one<H: Handler>(
    handler: &H,
    ctx: &mut Context,
    runnable: Vec<(usize, Owner)>,
    messages: Vec<H::Message>,
    contexts: Vec<Context>,
    spans: Vec<tracing::Span>,
) -> Option<Vec<(usize, Owner, RunResult)>> {
    let mut runs = Vec::with_capacity(runnable.len());
    let prepared = messages.into_iter().zip(contexts).zip(spans);
    for ((i, owner), ((message, context), span)) in runnable.into_iter().zip(prepared) {
        ctx.next_run(context);
        let started = Instant::now();
        let result = caught(handler.handle(message, ctx)).instrument(span).await;
        metrics::handler_duration(H::OPERATION, started.elapsed());
        failpoint::hit("after-effect");
        let result = done(result.ok()?, false, ctx.take_staged());
        if !matches!(result, RunResult::Done { .. }) {
            return None;
        }
        runs.push((i, owner, result));
    }
    Some(runs)
}
