//! A claimed request, in a task of its own: its route's reconciler first when the key
//! is pending, then its route under the lease, with heartbeats and its run-time bound,
//! and what the route answered recorded.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use tower::Service;
use tracing::{Instrument, debug, warn};

use super::decision::{self, AfterReconcile, Verdict};
use super::problem::Problem;
use super::record::{answered, free, record_beside_heartbeat, retried, rollback, verdict_of};
use super::service::{Keyed, call, uncertain};
use super::tx::{IdempotentRequest, Left, TxSlot};
use super::{Route, Settings};
use crate::handler::Reconciliation;
use crate::store::lease::beside_heartbeat;
use crate::store::{Lease, StoredError};

/// A request whose key it holds: what it needs to run to its recorded outcome.
pub(super) struct Claimed {
    pub(super) shared: Arc<Settings>,
    pub(super) route: Arc<Route>,
    pub(super) keyed: Keyed,
    pub(super) lease: Lease,
    /// The stored external reference, when the key is pending (reconcile first).
    pub(super) pending: Option<Option<String>>,
}

impl Claimed {
    /// Runs the request to its recorded outcome in a task of its own: a client that
    /// hangs up (hyper then drops the caller's future) must not leave the key
    /// `processing` until its lease lapses, nor lose an uncertain outcome.
    pub(super) async fn run<S>(self, inner: S, parts: Parts, body: Bytes) -> Response
    where
        S: Service<Request, Response = Response, Error = Infallible> + Send + 'static,
        S::Future: Send + 'static,
    {
        let info = IdempotentRequest {
            key: self.keyed.key.clone(),
            attempt: self.lease.attempt,
            takeover: self.lease.takeover,
        };
        let mut request = Request::from_parts(parts, body.into());
        request.extensions_mut().insert(info.clone());
        let task = async move {
            if let Some(external_ref) = self.pending.clone() {
                match self.reconcile(info, external_ref).await {
                    AfterReconcile::RunAgain => {}
                    AfterReconcile::Answer(response) => return self.record(response).await,
                    AfterReconcile::Failed(error) => {
                        return self.record(error.into_response()).await;
                    }
                    AfterReconcile::StillUncertain(why) => {
                        debug!(why = %why, "still uncertain");
                        self.give_back().await;
                        return uncertain(&self.keyed.label);
                    }
                }
            }
            let shared = &self.shared;
            let label = &self.keyed.label;
            run_claimed(
                shared,
                inner,
                request,
                &self.lease,
                label,
                self.route.run_within,
            )
            .await
        }
        .in_current_span();
        match tokio::spawn(task).await {
            Ok(response) => response,
            Err(error) => {
                warn!(error = %error, "a claimed request's task failed");
                Problem::INTERNAL.answer("the request's task failed; retry with the same key")
            }
        }
    }

    /// Asks the route's reconciler about the pending key, under the lease and within
    /// the route's run-time bound.
    async fn reconcile(
        &self,
        request: IdempotentRequest,
        external_ref: Option<String>,
    ) -> AfterReconcile<Response> {
        let (store, route) = (&self.shared.store, &self.route);
        let found = match &route.reconcile {
            Some(reconcile) => {
                let asked =
                    tokio::time::timeout(route.run_within, reconcile(request, external_ref));
                match beside_heartbeat(store, &self.lease, asked).await {
                    Ok(Ok(found)) => Ok(found),
                    Ok(Err(_)) => Err(format!(
                        "the reconciler ran longer than {} ms",
                        route.run_within.as_millis()
                    )),
                    Err(panic) => Err(panic),
                }
            }
            // A route without a reconciler does not take pending keys (claim_request).
            None => Ok(Ok(Reconciliation::Unknown)),
        };
        // An applied answer is stored only if it is one to store (not a failure or an
        // unmarked refusal, which would be replayed for the whole retention).
        decision::reconciled(found, |response: &Response| {
            matches!(
                verdict_of(response),
                Verdict::Store | Verdict::StoreWithoutWrites
            )
        })
    }

    /// Gives the lease of a key that stays pending back, with nothing written but the
    /// lease: no attempt counted.
    async fn give_back(&self) {
        let store = &self.shared.store;
        if let Err(error) = retried(|| store.give_back(&self.lease)).await {
            warn!(error = %error.describe(), "cannot give a pending key's lease back");
        }
    }

    /// Stores a reconciler's answer as the key's answer and sends it.
    async fn record(&self, response: Response) -> Response {
        record_beside_heartbeat(&self.shared, &self.lease, &self.keyed.label, response, None).await
    }
}

/// Runs the route for a claimed key, extending the lease while it runs, and records
/// what it answered.
async fn run_claimed<S>(
    shared: &Settings,
    inner: S,
    mut request: Request,
    lease: &Lease,
    operation: &str,
    within: Duration,
) -> Response
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    let store = &shared.store;
    let slot = TxSlot::new(store.pool().clone());
    request.extensions_mut().insert(slot.clone());
    let running = tokio::time::timeout(within, call(inner, request));
    let stopped = match beside_heartbeat(store, lease, running).await {
        Ok(Ok(response)) => return record_answer(shared, &slot, lease, operation, response).await,
        Ok(Err(_)) => Stopped::TimedOut(within),
        Err(panic) => Stopped::Panicked(panic),
    };
    // The route's future is gone (dropped at its bound, or unwound by a panic), and its
    // transaction went back to the slot with it.
    if let Left::Transaction(tx) = slot.take() {
        rollback(tx).await;
    }
    let (why, outcome, answer) = stopped.answer();
    free(store, lease, &why).await;
    answered(operation, outcome, answer)
}

/// How a route's run ended without an answer.
pub(super) enum Stopped {
    /// It ran past its bound and was dropped.
    TimedOut(Duration),
    /// It panicked (what it said).
    Panicked(String),
}

impl Stopped {
    /// Why (logged), the outcome's label, and the client's answer: 503
    /// `request-timed-out` with `Retry-After`, or 500.
    pub(super) fn answer(self) -> (String, &'static str, Response) {
        match self {
            Stopped::TimedOut(within) => {
                let why = format!("the route ran longer than {} ms", within.as_millis());
                let answer = Problem::TIMED_OUT.retry_after(
                    format!(
                        "{why} and was stopped; its writes were rolled back; retry with the \
                         same key"
                    ),
                    Duration::from_secs(1),
                );
                warn!(error = %why, "the route was stopped");
                (why, "timed_out", answer)
            }
            Stopped::Panicked(panic) => {
                warn!(error = %panic, "the route panicked");
                let answer =
                    Problem::INTERNAL.answer("the request failed; retry with the same key");
                (panic, "failed", answer)
            }
        }
    }
}

/// Records what the route answered, as its verdict says: stored with the handler's
/// writes (or without them), the key freed, or kept pending.
async fn record_answer(
    shared: &Settings,
    slot: &TxSlot,
    lease: &Lease,
    operation: &str,
    response: Response,
) -> Response {
    let store = &shared.store;
    let verdict = verdict_of(&response);
    let tx = match (slot.take(), &verdict) {
        (Left::Transaction(tx), Verdict::Store) => Some(tx),
        (Left::Transaction(tx), _) => {
            rollback(tx).await;
            None
        }
        (Left::Kept, Verdict::Store | Verdict::StoreWithoutWrites) => {
            let why = "the handler kept its transaction past its answer";
            free(store, lease, why).await;
            let problem = Problem::TRANSACTION_KEPT.answer(
                "the handler's writes could not be committed: its transaction outlived its \
                 answer; the key is free for a retry",
            );
            return answered(operation, "failed", problem);
        }
        (Left::Kept | Left::Nothing, _) => None,
    };
    match verdict {
        Verdict::Free(error) => {
            free(store, lease, &error).await;
            answered(operation, "failed", response)
        }
        Verdict::Pending {
            external_ref,
            error,
        } => {
            let stored = StoredError {
                kind: "uncertain",
                error: &error,
            }
            .to_json();
            let marked = retried(|| store.mark_pending(lease, external_ref.as_deref(), &stored));
            if let Err(e) = marked.await {
                // The record stays `processing`: a retry after the lease takes it over,
                // told so (`takeover`).
                warn!(error = %e.describe(), "cannot record an uncertain outcome");
            }
            answered(operation, "uncertain", response)
        }
        Verdict::Store | Verdict::StoreWithoutWrites => {
            record_beside_heartbeat(shared, lease, operation, response, tx).await
        }
    }
}
