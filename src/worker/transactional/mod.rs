//! Transactional mode (docs/DESIGN.md, "Two execution modes"): the deliveries that
//! arrive together are decided in one transaction. Their keys are looked up (and
//! taken over where they may be), their handlers run one after another on that
//! transaction, and every outcome is written in it; one commit makes all of it true at
//! once, and a crash before the commit leaves nothing.
//!
//! A batch first runs optimistically, without savepoints. When a handler fails (or a
//! reconciliation does not complete), the batch rolls back and runs again with each
//! handler in its own savepoint, so that only the failing handler's writes are undone
//! and its failure is recorded beside the others' successes. A batch whose new key
//! another worker inserted meanwhile, or that Postgres picked as a deadlock or
//! serialization victim, rolls back and runs again too: a handler may run more than
//! once, but only one run commits. That is why its effects must all be writes in this
//! database.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tracing::debug;

use super::decision::Ran;
use super::ordered::Entity;
use crate::failpoint;
use crate::fault::Fault;
use crate::handler::{Context, Envelope, Handler, HandlerError};
use crate::key::Key;
use crate::ordering::owner::{self, Done, Then};
use crate::ordering::table;
use crate::store::{Claim, ClaimRequest, Found, Lease, Store, StoreError};
use crate::trace::TraceContext;
pub(super) use batched::Batching;
use outcome::{answer_of, first_lease, new_record, refused, write_taken};
use run::RunIn;

mod batched;
mod chain;
mod outcome;
mod run;

/// Most deliveries in one transaction: each may get a savepoint, and Postgres keeps
/// the subtransactions of a transaction in a per-session cache of 64; past it, every
/// snapshot in the database gets slower.
pub(super) const MAX_BATCH: usize = 64;

/// How many times a batch starts again (after a race on a new key, a deadlock or a
/// serialization failure) before its deliveries are given back as undecided.
const PASSES: u32 = 8;

/// One delivery of a transactional batch.
#[derive(Debug, Clone)]
pub(super) struct TxRequest {
    pub(super) claim: ClaimRequest,
    /// The parsed body, deserialized into the handler's message when it runs.
    pub(super) value: Arc<Value>,
    /// The trace context its follow-up messages carry.
    pub(super) trace: Option<TraceContext>,
    /// What the message carried, for the handler's context.
    pub(super) envelope: Arc<Envelope>,
    /// The entity whose turn it holds, if its handler orders it: a completed run moves
    /// it on in the batch's commit.
    pub(super) entity: Option<Entity>,
    /// Under owned order, the turn it holds in memory: a completed run moves its
    /// position in the batch's commit (fenced), and its answer carries the delivery
    /// parked at the next number (`Ran::Completed::handed`; `None` when the fence
    /// failed), or, in the optimistic pass, the turns parked after it run in the same
    /// transaction and what waits where they end (`chain.rs`).
    pub(super) owned: Option<Done>,
}

/// What a committed batch says about one delivery.
#[derive(Debug)]
pub(super) enum TxAnswer {
    /// Not run: what the record says decides (completed, conflict, failed for good, in
    /// progress).
    Found(Claim),
    /// Run or reconciled, and its outcome committed; with the outbox rows its run
    /// staged (committed with it, to publish now).
    Ran(Ran, Vec<i64>),
    /// The body no longer fits the message (it did when parsed): malformed.
    Refused(String),
}

/// What every pass over a worker's batches runs with.
struct Setup<'a> {
    /// The outbox's hand-off to its publisher (`OutboxConfig::handoff`).
    handoff: Duration,
    batching: &'a Batching,
    /// The queue, when it has a single active consumer (owned order): a completed turn
    /// runs the turns parked after it in the same transaction (`chain.rs`).
    owned: Option<&'a str>,
}

/// Decides a batch of deliveries in one transaction, starting it again after races.
/// `owned`: the queue, when it has a single active consumer (see [`Setup`]).
pub(super) async fn run<H: Handler>(
    handler: &H,
    store: &Store,
    requests: &[TxRequest],
    handoff: Duration,
    batching: &Batching,
    owned: Option<&str>,
) -> Result<Vec<TxAnswer>, StoreError> {
    let mut pass = Pass::Optimistic;
    let mut last = None;
    let setup = Setup {
        handoff,
        batching,
        owned,
    };
    for round in 0..PASSES {
        match once(handler, store, requests, pass, &setup).await {
            Ok(Ended::Committed(answers)) => return Ok(answers),
            Ok(Ended::HandlerFailed) => pass = Pass::Careful,
            // Neither the data nor an outage (a handler that ignored a failed statement
            // and left the transaction aborted: SQLSTATE 25P02): the careful pass finds
            // out whose run it was, and records that run as failed.
            Err(error) if pass == Pass::Optimistic && error.fault() == Fault::Unknown => {
                debug!(error = %crate::text::error_line(&error), "batch failed; running it again with a savepoint per handler");
                pass = Pass::Careful;
            }
            Ok(Ended::Raced) => debug!(round, "a new key was inserted meanwhile; starting again"),
            Err(error) if is_victim(&error) && round + 1 < PASSES => {
                debug!(round, error = %crate::text::error_line(&error), "batch rolled back; starting again");
                last = Some(error);
                // Long enough for the winner to commit (it still holds its locks), and
                // jittered, so that two victims of each other do not meet again at once:
                // 10 ms doubling per round, plus up to as much again.
                let base = 10u64 << round.min(7);
                let pause = base + base * u64::from(rand_u8()) / 255;
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            // One delivery whose outcome Postgres refuses (a result with a NUL, a
            // deferred constraint at commit): a failure for good, recorded on its own,
            // so it is dead-lettered as `permanent_failure` and can be replayed.
            Err(error) if requests.len() == 1 && error.fault() == Fault::Message => {
                return refused(store, &requests[0], &error).await.map(|a| vec![a]);
            }
            Err(error) => return Err(error),
        }
    }
    Err(last.unwrap_or(StoreError::Contention(PASSES)))
}

/// A deadlock or serialization failure: Postgres rolled the transaction back and
/// running it again is the cure (SQLSTATE class 40).
fn is_victim(error: &StoreError) -> bool {
    match error {
        StoreError::Database(sqlx::Error::Database(db)) => {
            db.code().is_some_and(|code| code.starts_with("40"))
        }
        _ => false,
    }
}

fn rand_u8() -> u8 {
    // Nanoseconds of the clock are jitter enough for spreading two retries apart.
    (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0)
        % 251) as u8
}

/// Which pass over a batch this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Every handler on the batch's transaction, without savepoints: one that fails
    /// ends the pass, and the batch runs again carefully.
    Optimistic,
    /// Each handler in a savepoint of its own (`idem_run`), so that a failing one
    /// undoes only its own writes and its failure is recorded beside the others'.
    Careful,
}

/// How one pass over a batch ended.
enum Ended {
    Committed(Vec<TxAnswer>),
    /// A handler failed while running without savepoints: run again with them.
    HandlerFailed,
    /// Another transaction inserted one of the new keys: look them up again.
    Raced,
}

/// What a run in the batch came to, before it is written.
pub(super) enum RunResult {
    /// The output, as stored.
    Done {
        output: Value,
        reconciled: bool,
        /// The outbox rows the run staged.
        follow_ups: Vec<i64>,
    },
    Failed(HandlerError),
    Refused(String),
}

/// Whose run a result is: a key without a record, or a record taken over.
enum Owner {
    New,
    Taken(Lease),
}

/// One pass over a batch: look its keys up (taking over what may be taken), run what
/// is the batch's to run, write every outcome, commit. A crash before the commit leaves
/// nothing.
async fn once<H: Handler>(
    handler: &H,
    store: &Store,
    requests: &[TxRequest],
    pass: Pass,
    setup: &Setup<'_>,
) -> Result<Ended, StoreError> {
    let (handoff, batching) = (setup.handoff, setup.batching);
    let distinct = distinct(requests);
    let mut answers: Vec<Option<TxAnswer>> = requests.iter().map(|_| None).collect();
    let claims: Vec<ClaimRequest> = distinct
        .iter()
        .map(|&i| requests[i].claim.clone())
        .collect();
    // One context for the whole batch: it holds the batch's transaction, and each run
    // in turn gets it for its key (`ctx.tx()` is the batch's transaction).
    let first = &requests[distinct[0]].claim;
    // Before the batch holds a connection: a first check must not wait for one.
    store.prepare().await?;
    let mut ctx = Context::new(first.key.clone(), 1, false, store.pool().clone())
        .sealing_with(store.keys().cloned())
        .with_tx(store.pool().begin().await?);
    let found = store.find_in(ctx.tx().await?, &claims).await?;
    let mut runs = Vec::new();
    // In the optimistic pass, what runs without a reconciliation first runs together,
    // after the rest: through `handle_batch`, or one by one when the handler takes none.
    let batch = pass == Pass::Optimistic && batching.asks();
    let mut runnable = Vec::new();
    for (&i, found) in distinct.iter().zip(found) {
        let (owner, reconcile) = match found {
            Found::New => (Owner::New, None),
            Found::Record(Claim::Claimed(lease)) => (Owner::Taken(lease), None),
            Found::Record(Claim::Pending {
                lease,
                external_ref,
            }) => (Owner::Taken(lease), Some(external_ref)),
            Found::Record(other) => {
                answers[i] = Some(TxAnswer::Found(other));
                continue;
            }
            Found::Stale => {
                answers[i] = Some(TxAnswer::Found(in_progress()));
                continue;
            }
        };
        if batch && reconcile.is_none() {
            runnable.push((i, owner));
            continue;
        }
        let run = RunIn::of(&requests[i], &owner, pass, handoff);
        let result = run.guarded(handler, &mut ctx, reconcile).await?;
        if pass == Pass::Optimistic && !matches!(result, RunResult::Done { .. }) {
            return Ok(Ended::HandlerFailed);
        }
        runs.push((i, owner, result));
    }
    if !runnable.is_empty() {
        match batched::run(handler, &mut ctx, requests, runnable, handoff, batching).await {
            Some(batch) => runs.extend(batch),
            None => return Ok(Ended::HandlerFailed),
        }
    }
    if let Some(raced) = write(store, &mut ctx, requests, runs, &mut answers).await? {
        return Ok(raced);
    }
    // Chains run only in the optimistic pass: one that fails sends the batch here again.
    let chains = setup.owned.filter(|_| pass == Pass::Optimistic);
    let released = release(
        handler,
        store,
        &mut ctx,
        requests,
        &mut answers,
        chains,
        handoff,
    );
    if let Some(again) = released.await? {
        return Ok(again);
    }
    failpoint::hit("before-commit");
    match ctx.commit().await {
        // A refusal at the commit (a deferred constraint) in a pass that ran chains: run
        // again without them, so that a chained turn's writes are not blamed on its head.
        Err(error) if ran_chains(&answers) && crate::fault::classify(&error) == Fault::Message => {
            return Ok(Ended::HandlerFailed);
        }
        committed => committed?,
    }
    failpoint::hit("after-complete");
    // Copies of a key in the batch: decided again once this commit is visible.
    let answers = answers
        .into_iter()
        .map(|answer| answer.unwrap_or(TxAnswer::Found(in_progress())))
        .collect();
    Ok(Ended::Committed(answers))
}

/// Moves on, in the batch's transaction, the entity whose holder the batch completed,
/// and hands it the turn its next delivery waits for, true with the commit: its answer
/// carries what it released. Only when the batch completed one ordered delivery (a hot
/// entity's turns come one per batch): a batch that moved many would hold all their
/// positions until its commit, and their parks and other batches' releases would queue
/// behind it (the shuffled bench: 1,200 msgs/s against 1,800, docs/PERFORMANCE.md).
/// Otherwise each delivery's task moves its entity on after the commit.
///
/// `chains`: the queue, where completed owned turns run their chains (see
/// [`move_owned`]); `Some(Ended)` when one sends the batch to run again.
async fn release<H: Handler>(
    handler: &H,
    store: &Store,
    ctx: &mut Context,
    requests: &[TxRequest],
    answers: &mut [Option<TxAnswer>],
    chains: Option<&str>,
    handoff: Duration,
) -> Result<Option<Ended>, StoreError> {
    let completed: Vec<(usize, &Entity)> = completed(answers)
        .filter_map(|i| requests[i].entity.as_ref().map(|entity| (i, entity)))
        .collect();
    let moved = move_owned(handler, store, ctx, requests, answers, chains, handoff);
    if let Some(again) = moved.await? {
        return Ok(Some(again));
    }
    let [(i, entity)] = completed[..] else {
        return Ok(None);
    };
    // One entity: everything released is its.
    let entities = std::slice::from_ref(entity);
    let released = table::release(ctx.tx().await?, store.keys(), entities, true).await?;
    if let Some(TxAnswer::Ran(Ran::Completed { handed, .. }, _)) = &mut answers[i] {
        *handed = Some(released);
    }
    Ok(None)
}

/// Moves, in the batch's transaction, the positions of the turns held in memory (owned
/// order) that the batch completed, and releases the deliveries parked at their next
/// numbers. All of them, unlike the gate's one: measured, 0.59–0.61 of the unordered
/// pace against 0.52–0.60 with the moves after the commit. Their positions stay locked
/// until the commit; a park that raises one's `last_seq` (one idle for half the
/// retention) waits for it.
///
/// With `chains` (the queue), the move reads the rows parked after each turn instead of
/// releasing the next, and the turns they hold run in this transaction (`chain.rs`).
async fn move_owned<H: Handler>(
    handler: &H,
    store: &Store,
    ctx: &mut Context,
    requests: &[TxRequest],
    answers: &mut [Option<TxAnswer>],
    chains: Option<&str>,
    handoff: Duration,
) -> Result<Option<Ended>, StoreError> {
    let (at, done): (Vec<usize>, Vec<Done>) = completed(answers)
        .filter_map(|i| requests[i].owned.clone().map(|done| (i, done)))
        .unzip();
    if done.is_empty() {
        return Ok(None);
    }
    let then = match chains {
        Some(_) => Then::Read(chain::AHEAD),
        None => Then::Release { ahead: 0 },
    };
    let moved = owner::move_on(ctx.tx().await?, store.keys(), &done, then).await?;
    let mut heads = Vec::new();
    for ((i, done), moved) in at.into_iter().zip(done).zip(moved) {
        if !moved.moved {
            continue;
        }
        if chains.is_some() && !moved.next.is_empty() {
            heads.push(chain::Head {
                at: i,
                done,
                ahead: moved.next,
            });
        } else if let Some(TxAnswer::Ran(Ran::Completed { handed, .. }, _)) = &mut answers[i] {
            *handed = Some(moved.next);
        }
    }
    match chains {
        Some(queue) if !heads.is_empty() => {
            match chain::run(handler, store, ctx, queue, handoff, heads, answers).await {
                // What Postgres refuses of a chained turn (a NUL in its output) is not its
                // head's fault: the batch runs again without chains, and the turn on its
                // own is refused then.
                Err(error) if error.fault() == Fault::Message => Ok(Some(Ended::HandlerFailed)),
                ran => ran,
            }
        }
        _ => Ok(None),
    }
}

/// Whether a chain ran a turn in this pass (`chain.rs`).
fn ran_chains(answers: &[Option<TxAnswer>]) -> bool {
    answers.iter().any(|answer| {
        matches!(answer, Some(TxAnswer::Ran(Ran::Completed { chained: Some(c), .. }, _))
            if !c.ran.is_empty())
    })
}

/// The indices of the batch's deliveries that ran and completed.
fn completed(answers: &[Option<TxAnswer>]) -> impl Iterator<Item = usize> + '_ {
    answers.iter().enumerate().filter_map(|(i, answer)| {
        matches!(answer, Some(TxAnswer::Ran(Ran::Completed { .. }, _))).then_some(i)
    })
}

/// The first request of each key, by position: copies of a key after the first are
/// decided later, when the first one's outcome is committed (they see it then).
fn distinct(requests: &[TxRequest]) -> Vec<usize> {
    let mut first: HashMap<&Key, usize> = HashMap::new();
    let mut distinct = Vec::new();
    for (i, request) in requests.iter().enumerate() {
        if *first.entry(&request.claim.key).or_insert(i) == i {
            distinct.push(i);
        }
    }
    distinct
}

/// What a delivery that the batch leaves to its next delivery answers: in progress.
fn in_progress() -> Claim {
    Claim::InProgress {
        lease_expires_at: None,
    }
}

/// Writes every outcome in the batch's transaction: the fenced outcome of records taken
/// over, then the records of new keys, each with its outcome, in key order. Sets each
/// run's answer; `Some(Raced)` when another transaction inserted one of the new keys.
async fn write(
    store: &Store,
    ctx: &mut Context,
    requests: &[TxRequest],
    runs: Vec<(usize, Owner, RunResult)>,
    answers: &mut [Option<TxAnswer>],
) -> Result<Option<Ended>, StoreError> {
    let mut new = Vec::new();
    let mut new_runs = Vec::new();
    for (i, owner, result) in runs {
        match owner {
            Owner::New => match new_record(&requests[i].claim, &result) {
                Some(record) => {
                    new.push(record);
                    new_runs.push((i, result));
                }
                // Nothing ran: no record, the delivery is dead-lettered as malformed.
                None => {
                    if let RunResult::Refused(why) = result {
                        answers[i] = Some(TxAnswer::Refused(why));
                    }
                }
            },
            Owner::Taken(lease) => match write_taken(store, ctx.tx().await?, &lease, result).await?
            {
                Some(answer) => answers[i] = Some(answer),
                None => return Ok(Some(Ended::Raced)),
            },
        }
    }
    let inserted = store.insert_in(ctx.tx().await?, &new).await?;
    for ((i, result), ids) in new_runs.into_iter().zip(inserted) {
        let Some((id, token)) = ids else {
            return Ok(Some(Ended::Raced));
        };
        answers[i] = Some(answer_of(first_lease(id, token), result));
    }
    Ok(None)
}
