//! One request through the layer: read and fingerprint it, claim its key, run the
//! route (or answer from the record), and record what the route answered.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use tower::Service;
use tracing::{Instrument, Span, debug, field, info_span, warn};

use super::problem::{Problem, with_retry_after};
use super::record::{
    Verdict, answered, free, record_beside_heartbeat, retried, rollback, store_unavailable,
    verdict_of,
};
use super::request::{
    Unread, correlation_id, fingerprint, is_safe, key_header, label_of, operation_of, read_limited,
    route_of, trace_context,
};
use super::stored::StoredResponse;
use super::tx::{IdempotentRequest, Left, TxSlot};
use super::{Route, Shared};
use crate::handler::{HandlerError, Reconciliation};
use crate::key::Key;
use crate::store::{Claim, Lease, Origin, RequestClaim, Status, StoredError};
use crate::trace;

/// How long a client waits before asking again while the first request runs: most
/// requests take well under a second, and asking again costs one indexed statement. The
/// rest of the lease would be the bound, but it is only reached when a server died.
const IN_PROGRESS_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How long a client waits before asking again about a `pending` key: reconciling is
/// slower than a request.
const PENDING_RETRY_AFTER: Duration = Duration::from_secs(30);

/// Serves one request on a route behind the layer.
pub(super) async fn serve<S>(
    shared: Arc<Shared>,
    route: Arc<Route>,
    inner: S,
    request: Request,
) -> Response
where
    S: Service<Request, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let (parts, body) = request.into_parts();
    if is_safe(&parts.method) {
        return run_unkeyed(&shared, inner, Request::from_parts(parts, body)).await;
    }
    let header = key_header(&parts.headers);
    if matches!(header, Ok(None)) && !route.required {
        return run_unkeyed(&shared, inner, Request::from_parts(parts, body)).await;
    }
    // The principal first: an anonymous client learns nothing but the application's
    // rejection (typically 401).
    let scope = match (shared.scope)(&parts) {
        Ok(scope) => scope,
        Err(rejection) => return rejection,
    };
    let operation = operation_of(&parts);
    // The metrics label: the operation, unless no route matched (a layer around a whole
    // router sees every path a client makes up, and each would be a label of its own).
    let label = label_of(&parts);
    let header = match header {
        Ok(Some(header)) => header,
        Ok(None) => {
            let detail = format!("{operation} requires an Idempotency-Key header");
            return answered(&label, "missing_key", Problem::MissingKey.answer(detail));
        }
        Err(detail) => {
            return answered(&label, "invalid_key", Problem::InvalidKey.answer(detail));
        }
    };
    let key = match Key::new(scope, operation.clone(), header) {
        Ok(key) => key,
        Err(error) => {
            let problem = Problem::InvalidKey.answer(error.to_string());
            return answered(&label, "invalid_key", problem);
        }
    };
    let span = info_span!(
        "idempotent_request",
        operation = %operation,
        key = %key.short_hash(),
        otel.name = field::Empty,
        otel.kind = field::Empty,
    );
    let incoming = trace_context(&parts.headers);
    // Under a server span of the application's that continued the request's trace,
    // this span is its child; otherwise it is the server span of the incoming trace.
    let stays_under = trace::stays_under(&Span::current(), incoming.as_ref());
    if stays_under {
        trace::name(&span, &operation, "internal");
    } else if trace::continue_trace(&span, incoming.as_ref(), &operation, "server") {
        trace::attribute(&span, "http.request.method", parts.method.as_str());
        trace::attribute(&span, "http.route", route_of(&parts));
    }
    trace::attribute(&span, "idem.key", key.short_hash());
    async move {
        let bytes = match read_limited(body, &parts.headers, shared.max_body).await {
            Ok(bytes) => bytes,
            Err(Unread::TooLarge) => {
                let detail = format!("the body exceeds {} bytes", shared.max_body);
                return answered(&label, "too_large", Problem::BodyTooLarge.answer(detail));
            }
            Err(Unread::Broken(error)) => {
                let problem = Problem::UnreadableBody.answer(error);
                return answered(&label, "unreadable_body", problem);
            }
        };
        let fingerprint = fingerprint(&parts.uri, &bytes, &route.volatile);
        let origin = Origin {
            message_id: None,
            correlation_id: correlation_id(&parts.headers),
            trace_id: trace::trace_id(&Span::current(), incoming.as_ref()),
        };
        let reconciles = route.reconcile.is_some();
        let claim = match shared
            .store
            .claim_request(&key, &fingerprint, &origin, reconciles)
            .await
        {
            Ok(claim) => claim,
            Err(error) => return store_unavailable(&label, "cannot claim the key", &error),
        };
        let claim = match claim {
            RequestClaim::Claim(claim) => claim,
            RequestClaim::Uncertain => return uncertain(&label),
        };
        let (lease, pending) = match claim {
            Claim::Claimed(lease) => (lease, None),
            Claim::Pending {
                lease,
                external_ref,
            } => (lease, Some(external_ref)),
            Claim::Completed { result } => {
                let replay = StoredResponse::from_json(result).and_then(|s| s.replay());
                return match replay {
                    Ok(response) => answered(&label, "replayed", response),
                    Err(error) => Problem::UnreadableStoredResponse.answer(error.to_string()),
                };
            }
            Claim::InProgress { .. } => {
                let location = route.location.as_ref().map(|location| location(&key));
                let response = match location.as_deref().map(str::parse) {
                    Some(Ok(location)) => accepted(Some(location), IN_PROGRESS_RETRY_AFTER),
                    _ => Problem::InProgress.retry_after(
                        "the first request with this key is still running; retry after it",
                        IN_PROGRESS_RETRY_AFTER,
                    ),
                };
                return answered(&label, "in_progress", response);
            }
            Claim::Conflict { .. } => {
                let problem = Problem::KeyReused.answer(
                    "this key was first used with another body or URL; use a new key for a \
                     new request",
                );
                return answered(&label, "conflict", problem);
            }
            Claim::FailedForGood { .. } => {
                let problem = Problem::FailedForGood
                    .answer("the request with this key failed for good; use a new key");
                return answered(&label, "failed", problem);
            }
        };
        let info = IdempotentRequest {
            key,
            attempt: lease.attempt,
            takeover: lease.takeover,
        };
        let mut request = Request::from_parts(parts, Body::from(bytes));
        request.extensions_mut().insert(info.clone());
        // The claimed request runs to its recorded outcome in a task of its own: a client
        // that hangs up (hyper then drops this future) must not leave the key
        // `processing` until its lease lapses, nor lose an uncertain outcome.
        let run = {
            let operation = label.clone();
            async move {
                let shared = &shared;
                if let Some(external_ref) = pending {
                    match reconcile(shared, &route, info, &lease, external_ref).await {
                        Reconciled::RunAgain => {}
                        Reconciled::Answer(response) => {
                            return record_beside_heartbeat(
                                shared, &lease, &operation, response, None,
                            )
                            .await;
                        }
                        Reconciled::StillUncertain => return uncertain(&label),
                    }
                }
                run_claimed(shared, inner, request, &lease, &operation, route.run_within).await
            }
            .in_current_span()
        };
        match tokio::spawn(run).await {
            Ok(response) => response,
            Err(error) => {
                warn!(error = %error, "a claimed request's task failed");
                Problem::Internal.answer("the request's task failed; retry with the same key")
            }
        }
    }
    .instrument(span)
    .await
}

/// 409 for a key whose first request's outcome is uncertain.
fn uncertain(operation: &str) -> Response {
    answered(
        operation,
        "pending",
        Problem::OutcomeUncertain.retry_after(
            "the outcome of the first request with this key is uncertain and awaits \
             reconciliation",
            PENDING_RETRY_AFTER,
        ),
    )
}

/// What a route's reconciler found out about a pending key.
enum Reconciled {
    /// The effect did not happen: run the request again.
    RunAgain,
    /// The effect happened: this is the answer to store and send.
    Answer(Response),
    /// Still unknown (or the reconciler failed): the lease was given back.
    StillUncertain,
}

/// Asks the route's reconciler about a pending key the request's claim took.
async fn reconcile(
    shared: &Shared,
    route: &Route,
    request: IdempotentRequest,
    lease: &Lease,
    external_ref: Option<String>,
) -> Reconciled {
    let store = &shared.store;
    let found = match &route.reconcile {
        Some(reconcile) => {
            let asked = tokio::time::timeout(route.run_within, reconcile(request, external_ref));
            match crate::store::lease::beside_heartbeat(store, lease, asked).await {
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
    match found {
        Ok(Ok(Reconciliation::NotApplied)) => return Reconciled::RunAgain,
        // The effect happened: store what the reconciler answers, if it is an answer
        // to store (not a failure or an unmarked refusal, which would be replayed for
        // the whole retention).
        Ok(Ok(Reconciliation::Applied(response))) => match verdict_of(&response) {
            Verdict::Store | Verdict::StoreWithoutWrites => return Reconciled::Answer(response),
            other => warn!(verdict = ?other, "reconcile: an answer that is not to be stored"),
        },
        // The reconciler decided the request failed for good: that is its answer.
        Ok(Err(error @ HandlerError::Permanent(_))) => {
            return Reconciled::Answer(error.into_response());
        }
        Ok(Ok(Reconciliation::Unknown)) => debug!("reconcile: still unknown"),
        Ok(Err(error)) => warn!(error = %error, "reconcile failed"),
        Err(stopped) => warn!(error = %stopped, "reconcile panicked or was stopped"),
    }
    if let Err(error) = retried(|| store.give_back(lease)).await {
        warn!(error = %error.describe(), "cannot give a pending key's lease back");
    }
    Reconciled::StillUncertain
}

/// Runs the route for a claimed key, extending the lease while it runs, and records
/// what it answered.
async fn run_claimed<S>(
    shared: &Shared,
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
    let response = match crate::store::lease::beside_heartbeat(store, lease, running).await {
        Ok(Ok(response)) => response,
        Ok(Err(_)) => {
            // Stopped: the route's future is dropped, and its transaction with it.
            if let Left::Transaction(tx) = slot.take() {
                rollback(tx).await;
            }
            let why = format!("the route ran longer than {} ms", within.as_millis());
            warn!(error = %why, "the route was stopped");
            free(store, lease, &why).await;
            let problem = Problem::TimedOut.retry_after(
                format!(
                    "{why} and was stopped; its writes were rolled back; retry with the same key"
                ),
                Duration::from_secs(1),
            );
            return answered(operation, "timed_out", problem);
        }
        Err(panic) => {
            // The handler's transaction went back to the slot as the panic unwound.
            if let Left::Transaction(tx) = slot.take() {
                rollback(tx).await;
            }
            warn!(error = %panic, "the route panicked");
            free(store, lease, &panic).await;
            let problem = Problem::Internal.answer("the request failed; retry with the same key");
            return answered(operation, "failed", problem);
        }
    };
    let verdict = verdict_of(&response);
    let tx = match (slot.take(), &verdict) {
        (Left::Transaction(tx), Verdict::Store) => Some(tx),
        (Left::Transaction(tx), _) => {
            rollback(tx).await;
            None
        }
        (Left::Kept, Verdict::Store | Verdict::StoreWithoutWrites) => {
            free(
                store,
                lease,
                "the handler kept its transaction past its answer",
            )
            .await;
            let problem = Problem::TransactionKept.answer(
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

/// Runs a request that has no key (a safe method, or a route where the key is
/// optional): its transaction commits unless the answer would have freed a key (an
/// error, a refusal, 500 or more) or was uncertain.
async fn run_unkeyed<S>(shared: &Shared, inner: S, mut request: Request) -> Response
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    let slot = TxSlot::new(shared.store.pool().clone());
    request.extensions_mut().insert(slot.clone());
    let response = call(inner, request).await;
    let commit = verdict_of(&response) == Verdict::Store;
    match slot.take() {
        Left::Transaction(tx) if commit => match tx.commit().await {
            Ok(()) => response,
            Err(error) => {
                warn!(error = %crate::text::error_line(&error), "cannot commit the request's writes");
                Problem::StoreUnavailable.retry_after(
                    "cannot commit the request's writes; retry the request",
                    Duration::from_secs(1),
                )
            }
        },
        Left::Transaction(tx) => {
            rollback(tx).await;
            response
        }
        Left::Kept if commit => Problem::TransactionKept.answer(
            "the handler's writes could not be committed: its transaction outlived its answer",
        ),
        Left::Kept | Left::Nothing => response,
    }
}

/// The answer of a poll of a 202's `Location`.
pub(super) async fn poll(shared: &Shared, key: &Key) -> Response {
    let record = match shared.store.get(key).await {
        Ok(record) => record,
        Err(error) => return store_unavailable(key.operation(), "cannot read the key", &error),
    };
    let Some(record) = record else {
        return Problem::NoAnswer.answer("no request with this key is known");
    };
    let lease_live = record.lease_expires_at.is_some_and(|at| at > Utc::now());
    match record.status {
        Status::Completed => {
            match StoredResponse::from_json(record.result).and_then(|s| s.replay()) {
                Ok(response) => response,
                Err(error) => Problem::UnreadableStoredResponse.answer(error.to_string()),
            }
        }
        Status::Processing if lease_live => accepted(None, IN_PROGRESS_RETRY_AFTER),
        // Its server died: only the request itself, sent again, can take it over.
        Status::Processing => Problem::NoAnswer
            .answer("the request with this key stopped without an answer; send it again"),
        // Being reconciled: worth waiting for.
        Status::Pending if lease_live => accepted(None, PENDING_RETRY_AFTER),
        Status::Pending => Problem::OutcomeUncertain.retry_after(
            "the outcome of the request with this key is uncertain and awaits reconciliation",
            PENDING_RETRY_AFTER,
        ),
        Status::Failed => Problem::NoAnswer
            .answer("the request with this key failed without an answer to keep; send it again"),
    }
}

/// Calls the route.
async fn call<S>(mut inner: S, request: Request) -> Response
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    match inner.call(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// 202 Accepted with when to ask again, and where when the route says.
fn accepted(location: Option<HeaderValue>, after: Duration) -> Response {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::ACCEPTED;
    if let Some(location) = location {
        response.headers_mut().insert(header::LOCATION, location);
    }
    with_retry_after(response, after)
}
