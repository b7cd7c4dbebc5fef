//! Chains (owned order in transactional mode, docs/DESIGN.md "Order per entity"): when a
//! batch completes an entity's turn, the deliveries parked at the numbers right after it
//! run in the same transaction, one after another, and one commit makes all of them
//! true, moves the position once past the last and deletes their rows. A shuffled
//! entity's early deliveries mostly come due together, once the gap before them fills:
//! each of them used to be released (a write to its row), handed to its task, and run in
//! a batch of its own, with a move of its own.
//!
//! Only in the optimistic pass, and only what runs plainly: a row of this handler and
//! queue, at the next number, whose body still parses to its key and number, with no
//! record yet. The chain stops before anything else, which is released as before (its
//! row marked, handed to the task) at the number the chain ended at. A chained handler
//! that fails sends the batch to its careful pass, which runs no chains. A crash before
//! the commit leaves the rows parked and the position where it was.

use std::sync::Arc;
use std::time::Duration;

use tracing::{Span, debug};

use super::outcome::new_record;
use super::run::RunIn;
use super::{Ended, Owner, Pass, RunResult, TxAnswer, TxRequest};
use crate::handler::{Context, Handler};
use crate::headers;
use crate::ordering::Released;
use crate::ordering::owner::{ChainEnd, Done};
use crate::store::{ClaimRequest, Store, StoreError};
use crate::trace::{self, TraceContext};
use crate::worker::decision::{Chained, ChainedTurn, Ran};
use crate::worker::hand_on::envelope_of;
use crate::worker::parse::parse;

/// Rows ahead of a completed turn read for its chain: the most one entity's chain runs.
pub(super) const AHEAD: i64 = 32;

/// Most turns the chains of one batch run, beside the batch's own deliveries: they
/// lengthen its transaction, which holds the chained positions locked.
const MAX_CHAINED: usize = 512;

/// A completed turn of the batch, and the rows parked after it that its move read.
pub(super) struct Head {
    /// Its place among the batch's requests.
    pub(super) at: usize,
    pub(super) done: Done,
    pub(super) ahead: Vec<Released>,
}

/// One entity's chain: its head, and the requests of the rows that run after it.
struct Chain {
    at: usize,
    scope: String,
    ordering_key: String,
    /// The number after its head's: the first that runs in it.
    from: i64,
    runs: Vec<(TxRequest, i64)>,
}

impl Chain {
    /// The number its entity's position moves to: past its last run.
    fn to(&self) -> i64 {
        self.from + self.runs.len() as i64
    }

    /// Where it ends, for [`crate::ordering::owner::chain_end`].
    fn end(&self) -> ChainEnd {
        ChainEnd {
            scope: self.scope.clone(),
            ordering_key: self.ordering_key.clone(),
            from: self.from,
            to: self.to(),
        }
    }
}

/// Runs the chains of `heads` on the batch's transaction (`ctx`), writes their outcomes,
/// moves their positions past them and releases what waits where each ended; the
/// heads' answers carry it (`handed`, `chained`, and the chained runs' follow-ups).
/// `Some(Ended)` when the batch must run again: a chained run failed (carefully, then,
/// without chains), or another transaction inserted one of the chained keys.
pub(super) async fn run<H: Handler>(
    handler: &H,
    store: &Store,
    ctx: &mut Context,
    queue: &str,
    handoff: Duration,
    heads: Vec<Head>,
    answers: &mut [Option<TxAnswer>],
) -> Result<Option<Ended>, StoreError> {
    let mut budget = MAX_CHAINED;
    let mut chains: Vec<Chain> = heads
        .into_iter()
        .map(|head| chain_of(handler, store, queue, head, &mut budget))
        .collect();
    // A chain stops before a key that has a record: what it says decides that delivery
    // (a copy ran it, or it failed), which goes the usual way.
    let claims: Vec<ClaimRequest> = chains
        .iter()
        .flat_map(|c| c.runs.iter().map(|(r, _)| r.claim.clone()))
        .collect();
    if !claims.is_empty() {
        let mut existing = store
            .existing_in(ctx.tx().await?, &claims)
            .await?
            .into_iter();
        for chain in &mut chains {
            let known: Vec<bool> = chain
                .runs
                .iter()
                .map(|_| existing.next().unwrap_or(true))
                .collect();
            let stop = known.iter().position(|&k| k).unwrap_or(known.len());
            chain.runs.truncate(stop);
        }
    }
    let mut results = Vec::new();
    for chain in &chains {
        let mut ran = Vec::with_capacity(chain.runs.len());
        for (request, seq) in &chain.runs {
            let run = RunIn::of(request, &Owner::New, Pass::Optimistic, handoff);
            let result = run.guarded(handler, ctx, None).await?;
            if !matches!(result, RunResult::Done { .. }) {
                return Ok(Some(Ended::HandlerFailed));
            }
            debug!(key = %request.claim.key.short_hash(), seq, "chained turn ran");
            ran.push(result);
        }
        results.push(ran);
    }
    let records: Vec<_> = chains
        .iter()
        .zip(&results)
        .flat_map(|(chain, ran)| chain.runs.iter().zip(ran))
        .filter_map(|((request, _), result)| new_record(&request.claim, result))
        .collect();
    let inserted = store.insert_in(ctx.tx().await?, &records).await?;
    if inserted.iter().any(Option::is_none) {
        return Ok(Some(Ended::Raced));
    }
    let ends: Vec<ChainEnd> = chains.iter().map(Chain::end).collect();
    let released = crate::ordering::owner::chain_end(ctx.tx().await?, store.keys(), &ends).await?;
    hand_to_heads(chains, results, released, answers);
    Ok(None)
}

/// Each head's answer carries what its chain did: the row released where it ended
/// (`handed`), the turns it ran and where the position moved (`chained`), and their
/// follow-ups, published with the head's.
fn hand_to_heads(
    chains: Vec<Chain>,
    results: Vec<Vec<RunResult>>,
    released: Vec<Option<Released>>,
    answers: &mut [Option<TxAnswer>],
) {
    for ((chain, ran), next) in chains.into_iter().zip(results).zip(released) {
        let Some(TxAnswer::Ran(
            Ran::Completed {
                handed, chained, ..
            },
            follow_ups,
        )) = &mut answers[chain.at]
        else {
            continue;
        };
        *handed = Some(next.into_iter().collect());
        for result in ran {
            if let RunResult::Done {
                follow_ups: staged, ..
            } = result
            {
                follow_ups.extend(staged);
            }
        }
        *chained = Some(Chained {
            to: chain.to(),
            ran: chain
                .runs
                .iter()
                .map(|(r, seq)| ChainedTurn {
                    key: r.claim.key.short_hash(),
                    seq: *seq,
                    replayed: headers::integer(&r.envelope.properties, headers::REPLAYS)
                        .is_some_and(|replays| replays > 0),
                })
                .collect(),
        });
    }
}

/// The chain of `head`: the rows right after its number, of this handler and queue,
/// that still parse to their key and number, within `budget`.
fn chain_of<H: Handler>(
    handler: &H,
    store: &Store,
    queue: &str,
    head: Head,
    budget: &mut usize,
) -> Chain {
    let (scope, ordering_key, seq) = head.done.place;
    let from = seq + 1;
    let mut runs = Vec::new();
    for row in head.ahead {
        let next = from + runs.len() as i64;
        if *budget == 0 || row.seq != next || row.operation != H::OPERATION || row.queue != queue {
            break;
        }
        let Some(request) = request_of(handler, store, &row) else {
            break;
        };
        *budget -= 1;
        runs.push((request, row.seq));
    }
    Chain {
        at: head.at,
        scope,
        ordering_key,
        from,
        runs,
    }
}

/// The request of a parked row, as its delivery's task would make it; `None` when its
/// body no longer gives its key and number (it goes the usual way, and is decided there).
fn request_of<H: Handler>(handler: &H, store: &Store, row: &Released) -> Option<TxRequest> {
    let (parsed, message) = parse(handler, store, &row.body).ok()?;
    let ordered = handler.ordering(&message)?;
    let key = &parsed.key;
    if ordered.key != row.ordering_key
        || ordered.sequence != Some(row.seq)
        || key.scope() != row.scope
        || key.idempotency_key() != row.idempotency_key
    {
        return None;
    }
    let trace = TraceContext::from_properties(&row.properties);
    let trace_id = trace::trace_id(&Span::none(), trace.as_ref());
    Some(TxRequest {
        claim: parsed.claim_request(&row.properties, trace_id),
        value: parsed.value,
        trace,
        envelope: Arc::new(envelope_of(row)),
        entity: None,
        owned: None,
    })
}
