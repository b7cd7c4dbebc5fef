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
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::Value;
use sqlx::{Postgres, Transaction};
use tracing::{Instrument, debug, field, info_span};

use super::decision::{self, Ran, Reconciled};
use super::guard::caught;
use crate::failpoint;
use crate::fault::Fault;
use crate::handler::{Context, Handler, HandlerError};
use crate::key::Key;
use crate::metrics;
use crate::store::{Claim, ClaimRequest, Found, Lease, Store, StoreError};
use crate::trace::{self, TraceContext};
use outcome::{answer_of, first_lease, new_record, refused, write_taken};

mod outcome;

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

/// Decides a batch of deliveries in one transaction, starting it again after races.
pub(super) async fn run<H: Handler>(
    handler: &H,
    store: &Store,
    requests: &[TxRequest],
    handoff: Duration,
) -> Result<Vec<TxAnswer>, StoreError> {
    let mut careful = false;
    let mut last = None;
    for pass in 0..PASSES {
        match once(handler, store, requests, careful, handoff).await {
            Ok(Pass::Committed(answers)) => return Ok(answers),
            Ok(Pass::HandlerFailed) => careful = true,
            // Neither the data nor an outage (a handler that ignored a failed statement
            // and left the transaction aborted: SQLSTATE 25P02): the careful pass finds
            // out whose run it was, and records that run as failed.
            Err(error) if !careful && error.fault() == Fault::Unknown => {
                debug!(error = %crate::text::error_line(&error), "batch failed; running it again with a savepoint per handler");
                careful = true;
            }
            Ok(Pass::Raced) => debug!(pass, "a new key was inserted meanwhile; starting again"),
            Err(error) if is_victim(&error) && pass + 1 < PASSES => {
                debug!(pass, error = %crate::text::error_line(&error), "batch rolled back; starting again");
                last = Some(error);
                // Long enough for the winner to commit (it still holds its locks), and
                // jittered, so that two victims of each other do not meet again at once:
                // 10 ms doubling per pass, plus up to as much again.
                let base = 10u64 << pass.min(7);
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

/// How one pass over a batch ended.
enum Pass {
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

async fn once<H: Handler>(
    handler: &H,
    store: &Store,
    requests: &[TxRequest],
    careful: bool,
    handoff: Duration,
) -> Result<Pass, StoreError> {
    // Copies of a key after the first are decided later, when the first one's outcome
    // is committed: they see it then.
    let mut first: HashMap<&Key, usize> = HashMap::new();
    let mut distinct = Vec::new();
    for (i, request) in requests.iter().enumerate() {
        if *first.entry(&request.claim.key).or_insert(i) == i {
            distinct.push(i);
        }
    }
    let mut answers: Vec<Option<TxAnswer>> = requests.iter().map(|_| None).collect();
    let claims: Vec<ClaimRequest> = distinct
        .iter()
        .map(|&i| requests[i].claim.clone())
        .collect();

    let mut tx = Some(store.pool().begin().await?);
    let found = store.find_in(open(&mut tx)?, &claims).await?;
    let mut runs: Vec<(usize, Owner, RunResult)> = Vec::new();
    for (&i, found) in distinct.iter().zip(found) {
        let request = &requests[i];
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
                answers[i] = Some(TxAnswer::Found(Claim::InProgress {
                    lease_expires_at: None,
                }));
                continue;
            }
        };
        let (attempt, takeover) = match &owner {
            Owner::New => (1, false),
            Owner::Taken(lease) => (lease.attempt, lease.takeover),
        };
        if takeover {
            metrics::delivery(H::OPERATION, "takeover");
        }
        if careful {
            sqlx::query("SAVEPOINT idem_run")
                .execute(open(&mut tx)?)
                .await?;
        }
        let ctx = RunIn {
            key: &request.claim.key,
            value: &request.value,
            correlation_id: &request.claim.origin.correlation_id,
            trace: &request.trace,
            handoff,
            attempt,
            takeover,
            careful,
        };
        let mut result = ctx.run(handler, store, &mut tx, reconcile).await;
        let failed = !matches!(result, RunResult::Done { .. });
        if failed && !careful {
            return Ok(Pass::HandlerFailed);
        }
        if careful {
            result = end_savepoint(open(&mut tx)?, result).await?;
        }
        runs.push((i, owner, result));
    }

    // Every outcome, in the same transaction.
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
            Owner::Taken(lease) => {
                let answer = write_taken(store, open(&mut tx)?, &lease, result).await?;
                match answer {
                    Some(answer) => answers[i] = Some(answer),
                    None => return Ok(Pass::Raced),
                }
            }
        }
    }
    let inserted = store.insert_in(open(&mut tx)?, &new).await?;
    for ((i, result), ids) in new_runs.into_iter().zip(inserted) {
        let Some((id, token)) = ids else {
            return Ok(Pass::Raced);
        };
        answers[i] = Some(answer_of(first_lease(id, token), result));
    }
    failpoint::hit("before-commit");
    let Some(tx) = tx.take() else {
        return Err(lost_transaction());
    };
    tx.commit().await?;
    failpoint::hit("after-complete");

    // Copies of a key in the batch: decided again once this commit is visible.
    let answers = answers
        .into_iter()
        .map(|answer| {
            answer.unwrap_or(TxAnswer::Found(Claim::InProgress {
                lease_expires_at: None,
            }))
        })
        .collect();
    Ok(Pass::Committed(answers))
}

/// Ends the savepoint of a run in the careful pass: released after a success, rolled
/// back to after a failure. A success whose savepoint cannot be released left its
/// subtransaction aborted (it ignored a failed statement: SQLSTATE 25P02): its writes
/// are rolled back and the run is a transient failure, so that the retry tiers bound
/// it, as in leased mode.
async fn end_savepoint(
    conn: &mut sqlx::PgConnection,
    result: RunResult,
) -> Result<RunResult, StoreError> {
    const UNDO: &str = "ROLLBACK TO SAVEPOINT idem_run";
    if !matches!(result, RunResult::Done { .. }) {
        sqlx::query(UNDO).execute(&mut *conn).await?;
        return Ok(result);
    }
    match sqlx::query("RELEASE SAVEPOINT idem_run")
        .execute(&mut *conn)
        .await
    {
        Ok(_) => Ok(result),
        Err(error) if crate::fault::classify(&error) == Fault::Unknown => {
            sqlx::query(UNDO).execute(&mut *conn).await?;
            let why = format!(
                "the outcome could not be recorded: {}",
                crate::fault::describe(&error)
            );
            tracing::warn!(error = %why, "completion failed");
            Ok(RunResult::Failed(HandlerError::Transient(why)))
        }
        Err(error) => Err(error.into()),
    }
}

/// The batch's transaction, which is only ever out of its slot while a handler holds it.
fn open<'a>(
    tx: &'a mut Option<Transaction<'static, Postgres>>,
) -> Result<&'a mut sqlx::PgConnection, StoreError> {
    match tx.as_mut() {
        Some(tx) => Ok(&mut **tx),
        None => Err(lost_transaction()),
    }
}

pub(super) fn lost_transaction() -> StoreError {
    StoreError::Database(sqlx::Error::WorkerCrashed)
}

/// One run in the batch: the key, the body, and which claim of the key it is.
struct RunIn<'a> {
    key: &'a Key,
    value: &'a Value,
    correlation_id: &'a Option<String>,
    trace: &'a Option<TraceContext>,
    handoff: Duration,
    attempt: i32,
    takeover: bool,
    /// The careful pass: the run is in the savepoint `idem_run` already.
    careful: bool,
}

impl RunIn<'_> {
    /// Runs the handler (or reconciles first, when `reconcile` holds the reference of a
    /// pending operation) on the batch's transaction, which it gives back after.
    async fn run<H: Handler>(
        &self,
        handler: &H,
        store: &Store,
        tx: &mut Option<Transaction<'static, Postgres>>,
        reconcile: Option<Option<String>>,
    ) -> RunResult {
        let message = match H::Message::deserialize(self.value) {
            Ok(message) => message,
            Err(e) => return RunResult::Refused(format!("body does not fit the message: {e}")),
        };
        // The batch runs apart from the delivery's task: the handler's span is made a
        // child of the delivery's span by its context.
        let span = info_span!(
            "handler",
            otel.name = field::Empty,
            otel.kind = field::Empty
        );
        if trace::continue_trace(&span, self.trace.as_ref(), "handler", "internal") {
            trace::attribute(&span, "idem.attempt", i64::from(self.attempt));
            trace::attribute(&span, "idem.takeover", self.takeover);
        }
        let mut ctx = Context::new(
            self.key.clone(),
            self.attempt,
            self.takeover,
            store.pool().clone(),
        )
        .for_follow_ups(
            self.correlation_id.clone(),
            trace::outgoing(&span, self.trace.as_ref()),
            self.handoff,
        );
        if let Some(open) = tx.take() {
            ctx.put_tx(open);
        }
        let started = Instant::now();
        let result = match reconcile {
            None => {
                caught(handler.handle(message, &mut ctx))
                    .instrument(span)
                    .await
            }
            Some(external_ref) => {
                // What reconcile writes or stages counts only if it finds the effect
                // applied: "not applied" runs the handler afresh, as in leased mode. The
                // careful pass goes back to its run's savepoint (one subtransaction per
                // delivery, as MAX_BATCH counts them); the optimistic one sets its own.
                let (set, undo) = if self.careful {
                    (None, "ROLLBACK TO SAVEPOINT idem_run")
                } else {
                    (
                        Some("SAVEPOINT idem_reconcile"),
                        "ROLLBACK TO SAVEPOINT idem_reconcile",
                    )
                };
                if let Some(set) = set
                    && let Err(error) = savepoint(&mut ctx, set).await
                {
                    *tx = ctx.take_tx();
                    return RunResult::Failed(error);
                }
                let asked = caught(handler.reconcile(&message, external_ref.as_deref(), &mut ctx));
                match decision::reconciled(asked.instrument(span.clone()).await) {
                    Reconciled::Applied(output) => {
                        *tx = ctx.take_tx();
                        return done(output, true, ctx.take_staged());
                    }
                    Reconciled::NotApplied => {
                        let undone = savepoint(&mut ctx, undo);
                        match undone.await {
                            Ok(()) => {
                                ctx.take_staged();
                                caught(handler.handle(message, &mut ctx))
                                    .instrument(span)
                                    .await
                            }
                            Err(error) => Err(error),
                        }
                    }
                    Reconciled::Failed(error) => Err(error),
                }
            }
        };
        metrics::handler_duration(H::OPERATION, started.elapsed());
        failpoint::hit("after-effect");
        *tx = ctx.take_tx();
        match result {
            Ok(output) => done(output, false, ctx.take_staged()),
            Err(error) => RunResult::Failed(error),
        }
    }
}

/// Runs a savepoint statement on the batch's transaction, which the context holds.
async fn savepoint(ctx: &mut Context, statement: &str) -> Result<(), HandlerError> {
    sqlx::query(statement).execute(ctx.tx().await?).await?;
    Ok(())
}

fn done<O: serde::Serialize>(output: O, reconciled: bool, follow_ups: Vec<i64>) -> RunResult {
    match serde_json::to_value(output) {
        Ok(output) => RunResult::Done {
            output,
            reconciled,
            follow_ups,
        },
        Err(e) => RunResult::Failed(HandlerError::permanent(format!(
            "handler output does not serialize: {e}"
        ))),
    }
}
