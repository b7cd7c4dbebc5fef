//! A request on a single-commit route ([`super::IdempotencyLayer::single_commit`]):
//! the record is claimed in the request's own transaction, the route writes in it, and
//! the answer is written and committed with both, once.
//!
//! Nobody sees the record before that commit: a concurrent repeat's claim waits at the
//! key's unique index (or, for a record taken over, at its row) and then finds the
//! stored answer, or nothing if this one rolled back, and runs itself. So nothing here
//! heartbeats (no other claim can take the key while the transaction holds it, and a
//! heartbeat from another connection would wait for the same lock), and a failure
//! frees the key by rolling back: no `failed` record is written.

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::request::Parts;
use axum::response::Response;
use futures_util::FutureExt;
use sqlx::{Postgres, Transaction};
use tower::Service;
use tracing::{Instrument, debug, warn};

use super::claimed::Stopped;
use super::decision::{self, Answer, Next, Verdict};
use super::problem::Problem;
use super::record::{
    answered, rollback, store_unavailable, stored_answer, taken_over, too_large, verdict_of,
};
use super::service::{Intent, Keyed, call, claim_and_run, from_record};
use super::tx::{IdempotentRequest, Left, ROLLBACK_TO_SAVEPOINT, TxSlot};
use super::{Route, Settings};
use crate::failpoint;
use crate::store::lease::panic_text;
use crate::store::{Lease, StoreError, StoredError};

/// The request's transaction: READ COMMITTED whatever the database's default, so that
/// a claim that waited for another transaction sees its commit on its next statement.
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Serves a keyed request on a single-commit route: claims the key in the request's
/// transaction, and runs the route in it, or answers from the record.
pub(super) async fn serve<S>(
    shared: Arc<Settings>,
    route: Arc<Route>,
    inner: S,
    intent: Intent,
) -> Response
where
    S: Service<Request, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let store = &shared.store;
    let label = intent.keyed.label.clone();
    // Before the request holds a connection: a first check must not wait for one.
    if let Err(error) = store.prepare().await {
        return store_unavailable(&label, "cannot check the store", &error);
    }
    // A repeat waits at the key for the first request's commit no longer than a run
    // may take; then it answers as for a key in progress (409 + Retry-After).
    let begin = format!(
        "{BEGIN}; SET LOCAL lock_timeout = {}",
        route.run_within.as_millis().max(1)
    );
    let mut tx = match store.pool().begin_with(sqlx::AssertSqlSafe(begin)).await {
        Ok(tx) => tx,
        Err(error) => {
            let error = StoreError::from(error);
            return store_unavailable(&label, "cannot begin the request's transaction", &error);
        }
    };
    let reconciles = route.reconcile.is_some();
    let claim = store
        .claim_request_in(
            &mut tx,
            &intent.keyed.key,
            &intent.fingerprint,
            &intent.origin,
            reconciles,
        )
        .await;
    let claim = match claim {
        Ok(claim) => claim,
        Err(error) if waited_too_long(&error) => {
            rollback(tx).await;
            return from_record(Answer::InProgress, &route, &intent.keyed);
        }
        Err(error) => {
            rollback(tx).await;
            return store_unavailable(&label, "cannot claim the key", &error);
        }
    };
    match decision::on_claim(claim) {
        Next::Run(lease) => {
            failpoint::hit("http-single-after-claim");
            let single = Single {
                shared: shared.clone(),
                route,
                keyed: intent.keyed,
                lease,
            };
            single.run(inner, tx, intent.parts, intent.body).await
        }
        // An uncertain record (left by the default mode, or by this one's uncertain
        // answer): its reconciler calls out, so it is reconciled as the default mode
        // does, under a lease of its own, not in a transaction held across the call.
        Next::Reconcile { .. } => {
            rollback(tx).await;
            claim_and_run(shared, route, inner, intent).await
        }
        // Nothing written: the rollback goes with the connection's return to the pool
        // (sqlx flushes it there), not before the answer.
        Next::Answer(answer) => {
            drop(tx);
            from_record(answer, &route, &intent.keyed)
        }
    }
}

/// A request whose record its transaction holds.
struct Single {
    shared: Arc<Settings>,
    route: Arc<Route>,
    keyed: Keyed,
    lease: Lease,
}

impl Single {
    /// Runs the route with the request's transaction as its [`super::Tx`], in a task of
    /// its own (a client that hangs up does not cut it short) and within the route's
    /// bound, and records what it answered.
    async fn run<S>(
        self,
        inner: S,
        tx: Transaction<'static, Postgres>,
        parts: Parts,
        body: Bytes,
    ) -> Response
    where
        S: Service<Request, Response = Response, Error = Infallible> + Send + 'static,
        S::Future: Send + 'static,
    {
        let mut request = Request::from_parts(parts, Body::from(body));
        request.extensions_mut().insert(IdempotentRequest {
            key: self.keyed.key.clone(),
            attempt: self.lease.attempt,
            takeover: self.lease.takeover,
        });
        let slot = TxSlot::with_transaction(self.shared.store.pool().clone(), tx);
        request.extensions_mut().insert(slot.clone());
        let task = async move {
            let within = self.route.run_within;
            let running = AssertUnwindSafe(call(inner, request)).catch_unwind();
            let stopped = match tokio::time::timeout(within, running).await {
                Ok(Ok(response)) => return self.record(&slot, response).await,
                Ok(Err(panic)) => Stopped::Panicked(panic_text(&panic)),
                Err(_) => Stopped::TimedOut(within),
            };
            // The route's future is gone, and its transaction went back to the slot
            // with it: rolled back, the record with it, so the key is free.
            if let Left::Transaction(tx) = slot.take() {
                rollback(tx).await;
            }
            let (_, outcome, answer) = stopped.answer();
            answered(&self.keyed.label, outcome, answer)
        }
        .in_current_span();
        match tokio::spawn(task).await {
            Ok(response) => response,
            Err(error) => {
                warn!(error = %error, "a single-commit request's task failed");
                Problem::INTERNAL.answer("the request's task failed; retry with the same key")
            }
        }
    }

    /// Records what the route answered, as its verdict says: stored and committed with
    /// the route's writes (or without them, rolled back to the savepoint), `pending`,
    /// or rolled back whole, which frees the key.
    async fn record(&self, slot: &TxSlot, response: Response) -> Response {
        let label = &self.keyed.label;
        let savepoint = slot.savepoint();
        let mut tx = match slot.take() {
            Left::Transaction(tx) => tx,
            // The record is in that transaction: never committed, the key stays free.
            Left::Kept => {
                let problem = Problem::TRANSACTION_KEPT.answer(
                    "the handler's writes could not be committed: its transaction outlived \
                     its answer; the key is free for a retry",
                );
                return answered(label, "failed", problem);
            }
            Left::Nothing => {
                warn!("a single-commit request's transaction is missing");
                let problem =
                    Problem::INTERNAL.answer("the request failed; retry with the same key");
                return answered(label, "failed", problem);
            }
        };
        let verdict = verdict_of(&response);
        if matches!(
            verdict,
            Verdict::StoreWithoutWrites | Verdict::Pending { .. }
        ) && savepoint
            && let Err(error) = sqlx::raw_sql(ROLLBACK_TO_SAVEPOINT).execute(&mut *tx).await
        {
            rollback(tx).await;
            let error = StoreError::from(error);
            return store_unavailable(label, "cannot roll the route's writes back", &error);
        }
        match verdict {
            Verdict::Free(error) => {
                debug!(error = %error, "rolled back: the key is free");
                rollback(tx).await;
                answered(label, "failed", response)
            }
            Verdict::Pending {
                external_ref,
                error,
            } => self.pending(tx, response, external_ref, &error).await,
            Verdict::Store | Verdict::StoreWithoutWrites => self.complete(tx, response).await,
        }
    }

    /// Stores the answer in the request's transaction and commits it.
    async fn complete(
        &self,
        mut tx: Transaction<'static, Postgres>,
        response: Response,
    ) -> Response {
        let (shared, label) = (&self.shared, &self.keyed.label);
        let (parts, bytes, stored) = match stored_answer(shared, response).await {
            Ok(answer) => answer,
            Err(detail) => {
                rollback(tx).await;
                return too_large(label, &detail);
            }
        };
        if let Err(error) = shared
            .store
            .complete_in(&mut *tx, &self.lease, &stored)
            .await
        {
            rollback(tx).await;
            return match error {
                StoreError::LeaseLost { .. } => taken_over(label),
                error => store_unavailable(label, "cannot record the answer", &error),
            };
        }
        failpoint::hit("http-single-before-commit");
        if let Err(error) = tx.commit().await {
            // Whether it committed is unknown: a retry finds the answer, or nothing.
            let error = StoreError::from(error);
            return store_unavailable(label, "cannot commit the request", &error);
        }
        failpoint::hit("http-single-after-commit");
        answered(
            label,
            "executed",
            Response::from_parts(parts, Body::from(bytes)),
        )
    }

    /// Records an uncertain outcome (the route's writes rolled back to the savepoint)
    /// and commits it; the route's answer (502) either way.
    async fn pending(
        &self,
        mut tx: Transaction<'static, Postgres>,
        response: Response,
        external_ref: Option<String>,
        error: &str,
    ) -> Response {
        let stored = StoredError {
            kind: "uncertain",
            error,
        }
        .to_json();
        let store = &self.shared.store;
        let marked = store
            .mark_pending_in(&mut *tx, &self.lease, external_ref.as_deref(), &stored)
            .await;
        let committed = match marked {
            Ok(()) => tx.commit().await.map_err(StoreError::from),
            Err(error) => {
                rollback(tx).await;
                Err(error)
            }
        };
        if let Err(e) = committed {
            // Nothing is stored: a retry runs the route again.
            warn!(error = %e.describe(), "cannot record an uncertain outcome");
        }
        answered(&self.keyed.label, "uncertain", response)
    }
}

/// The claim waited longer than `lock_timeout` for another request holding the key
/// (SQLSTATE 55P03).
fn waited_too_long(error: &StoreError) -> bool {
    match error {
        StoreError::Database(sqlx::Error::Database(db)) => db.code().as_deref() == Some("55P03"),
        _ => false,
    }
}
