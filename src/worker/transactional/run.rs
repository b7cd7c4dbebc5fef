//! One run of a transactional batch: the handler (or its reconciliation) on the
//! batch's transaction, in the careful pass inside a savepoint of its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::Value;
use sqlx::PgPool;
use tracing::{Instrument, field, info_span};

use super::{Owner, Pass, RunResult, TxRequest};
use crate::failpoint;
use crate::fault::Fault;
use crate::handler::{Context, Envelope, Handler, HandlerError};
use crate::key::Key;
use crate::metrics;
use crate::store::StoreError;
use crate::trace::{self, TraceContext};
use crate::worker::decision::{self, Reconciled};
use crate::worker::guard::caught;

/// A run's message and context, ready to run ([`RunIn::prepare`]).
pub(super) struct Prepared<M> {
    pub(super) message: M,
    pub(super) context: Context,
    /// The handler's span of this delivery, child of the delivery's span.
    pub(super) span: tracing::Span,
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

/// One run in the batch: the key, the body, and which claim of the key it is.
pub(super) struct RunIn<'a> {
    key: &'a Key,
    value: &'a Value,
    correlation_id: &'a Option<String>,
    trace: &'a Option<TraceContext>,
    envelope: &'a Arc<Envelope>,
    handoff: Duration,
    attempt: i32,
    takeover: bool,
    pass: Pass,
}

impl<'a> RunIn<'a> {
    pub(super) fn of(request: &'a TxRequest, owner: &Owner, pass: Pass, handoff: Duration) -> Self {
        let (attempt, takeover) = match owner {
            Owner::New => (1, false),
            Owner::Taken(lease) => (lease.attempt, lease.takeover),
        };
        Self {
            key: &request.claim.key,
            value: &request.value,
            correlation_id: &request.claim.origin.correlation_id,
            trace: &request.trace,
            envelope: &request.envelope,
            handoff,
            attempt,
            takeover,
            pass,
        }
    }

    /// [`RunIn::run`], in the careful pass inside a savepoint of its own: released
    /// after a success, rolled back to after a failure (`end_savepoint`).
    pub(super) async fn guarded<H: Handler>(
        &self,
        handler: &H,
        ctx: &mut Context,
        reconcile: Option<Option<String>>,
    ) -> Result<RunResult, StoreError> {
        if self.pass == Pass::Careful {
            sqlx::query("SAVEPOINT idem_run")
                .execute(ctx.tx().await?)
                .await?;
        }
        let result = self.run(handler, ctx, reconcile).await;
        match self.pass {
            Pass::Careful => end_savepoint(ctx.tx().await?, result).await,
            Pass::Optimistic => Ok(result),
        }
    }

    /// The run's message and context, before it runs: the body deserialized into the
    /// handler's message (`Err` with why when it no longer fits), and a context for its
    /// key, claim, follow-ups and envelope, with the handler's span for its trace.
    pub(super) fn prepare<H: Handler>(
        &self,
        pool: &PgPool,
    ) -> Result<Prepared<H::Message>, String> {
        let message = H::Message::deserialize(self.value)
            .map_err(|e| format!("body does not fit the message: {e}"))?;
        if self.takeover {
            metrics::delivery(H::OPERATION, "takeover");
        }
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
        let context = Context::new(self.key.clone(), self.attempt, self.takeover, pool.clone())
            .for_follow_ups(
                self.correlation_id.clone(),
                trace::outgoing(&span, self.trace.as_ref()),
                self.handoff,
            )
            .with_envelope(self.envelope.clone());
        Ok(Prepared {
            message,
            context,
            span,
        })
    }

    /// Runs the handler (or reconciles first, when `reconcile` holds the reference of a
    /// pending operation) on the batch's transaction, which `ctx` holds.
    async fn run<H: Handler>(
        &self,
        handler: &H,
        ctx: &mut Context,
        reconcile: Option<Option<String>>,
    ) -> RunResult {
        let Prepared {
            message,
            context,
            span,
        } = match self.prepare::<H>(ctx.pool()) {
            Ok(prepared) => prepared,
            Err(why) => return RunResult::Refused(why),
        };
        ctx.next_run(context);
        let started = Instant::now();
        let result = match reconcile {
            None => caught(handler.handle(message, ctx)).instrument(span).await,
            Some(external_ref) => {
                match self
                    .reconcile(handler, ctx, &message, external_ref, &span)
                    .await
                {
                    Ok(Some(output)) => return done(output, true, ctx.take_staged()),
                    Ok(None) => caught(handler.handle(message, ctx)).instrument(span).await,
                    Err(error) => Err(error),
                }
            }
        };
        metrics::handler_duration(H::OPERATION, started.elapsed());
        failpoint::hit("after-effect");
        match result {
            Ok(output) => done(output, false, ctx.take_staged()),
            Err(error) => RunResult::Failed(error),
        }
    }

    /// Asks the handler's `reconcile` about a pending operation: `Some(output)` when the
    /// effect happened, `None` when it did not (what reconcile wrote or staged is undone,
    /// and the handler runs afresh, as in leased mode). The careful pass goes back to its
    /// run's savepoint (one subtransaction per delivery, as `MAX_BATCH` counts them);
    /// the optimistic one sets its own.
    async fn reconcile<H: Handler>(
        &self,
        handler: &H,
        ctx: &mut Context,
        message: &H::Message,
        external_ref: Option<String>,
        span: &tracing::Span,
    ) -> Result<Option<H::Output>, HandlerError> {
        let undo = match self.pass {
            Pass::Careful => "ROLLBACK TO SAVEPOINT idem_run",
            Pass::Optimistic => {
                savepoint(ctx, "SAVEPOINT idem_reconcile").await?;
                "ROLLBACK TO SAVEPOINT idem_reconcile"
            }
        };
        let asked = caught(handler.reconcile(message, external_ref.as_deref(), ctx));
        match decision::reconciled(asked.instrument(span.clone()).await) {
            Reconciled::Applied(output) => Ok(Some(output)),
            Reconciled::NotApplied => {
                savepoint(ctx, undo).await?;
                ctx.take_staged();
                Ok(None)
            }
            Reconciled::Failed(error) => Err(error),
        }
    }
}

/// Runs a savepoint statement on the batch's transaction, which the context holds.
async fn savepoint(ctx: &mut Context, statement: &'static str) -> Result<(), HandlerError> {
    sqlx::query(statement).execute(ctx.tx().await?).await?;
    Ok(())
}

pub(super) fn done<O: serde::Serialize>(
    output: O,
    reconciled: bool,
    follow_ups: Vec<i64>,
) -> RunResult {
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
