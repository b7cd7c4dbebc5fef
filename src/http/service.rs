//! One request through the layer: read and fingerprint it, claim its key, run the
//! route (or answer from the record), and record what the route answered.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Request};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use backon::{ExponentialBuilder, Retryable};
use chrono::Utc;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sqlx::{Postgres, Transaction};
use tower::Service;
use tracing::{Instrument, debug, info_span, warn};

use super::problem::{Decided, Failure, Problem, with_retry_after};
use super::stored::StoredResponse;
use super::tx::{IdempotentRequest, Left, TxSlot};
use super::{IDEMPOTENCY_KEY, Route, Shared};
use crate::fingerprint::Fingerprint;
use crate::handler::{HandlerError, Reconciliation};
use crate::key::Key;
use crate::metrics;
use crate::store::{Claim, Lease, Origin, RequestClaim, Status, Store, StoreError, StoredError};

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
    let header = match header {
        Ok(Some(header)) => header,
        Ok(None) => {
            let detail = format!("{operation} requires an Idempotency-Key header");
            return answered(
                &operation,
                "missing_key",
                Problem::MissingKey.answer(detail),
            );
        }
        Err(detail) => {
            return answered(
                &operation,
                "invalid_key",
                Problem::InvalidKey.answer(detail),
            );
        }
    };
    let key = match Key::new(scope, operation.clone(), header) {
        Ok(key) => key,
        Err(error) => {
            let problem = Problem::InvalidKey.answer(error.to_string());
            return answered(&operation, "invalid_key", problem);
        }
    };
    let span = info_span!("idempotent_request", operation = %operation, key = %key.short_hash());
    async move {
        let bytes = match read_limited(body, &parts.headers, shared.max_body).await {
            Ok(bytes) => bytes,
            Err(Unread::TooLarge) => {
                let detail = format!("the body exceeds {} bytes", shared.max_body);
                return answered(
                    &operation,
                    "too_large",
                    Problem::BodyTooLarge.answer(detail),
                );
            }
            Err(Unread::Broken(error)) => {
                let problem = Problem::UnreadableBody.answer(error);
                return answered(&operation, "unreadable_body", problem);
            }
        };
        let fingerprint = fingerprint(&parts.uri, &bytes, &route.volatile);
        let origin = Origin {
            message_id: None,
            correlation_id: correlation_id(&parts.headers),
        };
        let reconciles = route.reconcile.is_some();
        let claim = match shared
            .store
            .claim_request(&key, &fingerprint, &origin, reconciles)
            .await
        {
            Ok(claim) => claim,
            Err(error) => return store_unavailable(&operation, "cannot claim the key", &error),
        };
        let claim = match claim {
            RequestClaim::Claim(claim) => claim,
            RequestClaim::Uncertain => return uncertain(&operation),
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
                    Ok(response) => answered(&operation, "replayed", response),
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
                return answered(&operation, "in_progress", response);
            }
            Claim::Conflict { .. } => {
                let problem = Problem::KeyReused.answer(
                    "this key was first used with another body or URL; use a new key for a \
                     new request",
                );
                return answered(&operation, "conflict", problem);
            }
            Claim::FailedForGood { .. } => {
                let problem = Problem::FailedForGood
                    .answer("the request with this key failed for good; use a new key");
                return answered(&operation, "failed", problem);
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
            let operation = operation.clone();
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
                        Reconciled::StillUncertain => return uncertain(&operation),
                    }
                }
                run_claimed(shared, inner, request, &lease, &operation).await
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
            crate::worker::beside_heartbeat(store, lease, reconcile(request, external_ref)).await
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
        Err(panic) => warn!(error = %panic, "reconcile panicked"),
    }
    if let Err(error) = retried(|| store.give_back(lease)).await {
        warn!(error = %error.describe(), "cannot give a pending key's lease back");
    }
    Reconciled::StillUncertain
}

/// What the layer does with the route's answer to a claimed request.
#[derive(Debug, Clone, PartialEq)]
enum Verdict {
    /// Store the answer; commit the handler's writes with it.
    Store,
    /// Store the answer (the request was decided: a permanent error), but roll the
    /// handler's writes back.
    StoreWithoutWrites,
    /// Roll back and leave the key free for a retry: a transient error, an answer of
    /// 500 or more, or a refusal (4xx) the handler did not mark as its decision.
    Free(String),
    /// Roll back and keep the key `pending` (an uncertain outcome).
    Pending {
        external_ref: Option<String>,
        error: String,
    },
}

/// Decides from the answer's status, the handler's error if it returned one, and
/// whether it marked the answer [`Decided`].
fn verdict(status: StatusCode, failure: Option<&HandlerError>, decided: bool) -> Verdict {
    match failure {
        Some(HandlerError::Transient(error)) => Verdict::Free(error.clone()),
        Some(HandlerError::Uncertain {
            external_ref,
            error,
        }) => Verdict::Pending {
            external_ref: external_ref.clone(),
            error: error.clone(),
        },
        Some(HandlerError::Permanent(_)) => Verdict::StoreWithoutWrites,
        None if decided => Verdict::Store,
        // A 4xx is an extractor's rejection (a missing Content-Type, a body that does
        // not parse), middleware's (401, 429) or a refusal that should change nothing:
        // a retry that fixes it must be able to run.
        None if status.is_client_error() || status.is_server_error() => {
            Verdict::Free(format!("the route answered {status}"))
        }
        None => Verdict::Store,
    }
}

/// The verdict on `response`.
fn verdict_of(response: &Response) -> Verdict {
    let extensions = response.extensions();
    verdict(
        response.status(),
        extensions.get::<Failure>().map(|f| &f.0),
        extensions.get::<Decided>().is_some(),
    )
}

/// Runs the route for a claimed key, extending the lease while it runs, and records
/// what it answered.
async fn run_claimed<S>(
    shared: &Shared,
    inner: S,
    mut request: Request,
    lease: &Lease,
    operation: &str,
) -> Response
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    let store = &shared.store;
    let slot = TxSlot::new(store.pool().clone());
    request.extensions_mut().insert(slot.clone());
    let response = match crate::worker::beside_heartbeat(store, lease, call(inner, request)).await {
        Ok(response) => response,
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

/// [`record`] while heartbeats keep the lease: reading a slow streamed answer must not
/// let the lease lapse under it.
async fn record_beside_heartbeat(
    shared: &Shared,
    lease: &Lease,
    operation: &str,
    response: Response,
    tx: Option<Transaction<'static, Postgres>>,
) -> Response {
    let recording = record(shared, lease, operation, response, tx);
    match crate::worker::beside_heartbeat(&shared.store, lease, recording).await {
        Ok(response) => response,
        Err(panic) => {
            warn!(error = %panic, "recording the answer panicked");
            Problem::Internal.answer("the request failed; retry with the same key")
        }
    }
}

/// Stores `response` as the key's answer, in `tx` with the handler's writes when there
/// is one, and sends it; or, when it cannot be stored, sends why.
async fn record(
    shared: &Shared,
    lease: &Lease,
    operation: &str,
    response: Response,
    mut tx: Option<Transaction<'static, Postgres>>,
) -> Response {
    let store = &shared.store;
    let (parts, body) = response.into_parts();
    let bytes = match read_limited(body, &HeaderMap::new(), shared.max_response).await {
        Ok(bytes) => bytes,
        Err(unread) => {
            if let Some(tx) = tx {
                rollback(tx).await;
            }
            let detail = match unread {
                Unread::TooLarge => format!(
                    "the answer exceeds the {} bytes the layer stores for replay",
                    shared.max_response
                ),
                Unread::Broken(error) => format!("the answer could not be read: {error}"),
            };
            free(store, lease, &detail).await;
            let detail = format!("{detail}; nothing was stored, the key is free for a retry");
            let problem = Problem::ResponseTooLarge.answer(detail);
            return answered(operation, "response_too_large", problem);
        }
    };
    let stored =
        StoredResponse::new(parts.status, &parts.headers, &shared.replay_headers, &bytes).to_json();
    let recorded = match tx.as_mut() {
        Some(tx) => store.complete_in(&mut **tx, lease, &stored).await,
        None => store.complete(lease, &stored).await,
    };
    let committed = match (recorded, tx) {
        (Ok(()), Some(tx)) => tx.commit().await.map_err(StoreError::from),
        (Ok(()), None) => Ok(()),
        (Err(error), Some(tx)) => {
            rollback(tx).await;
            Err(error)
        }
        (Err(error), None) => Err(error),
    };
    match committed {
        Ok(()) => answered(
            operation,
            "executed",
            Response::from_parts(parts, Body::from(bytes)),
        ),
        Err(StoreError::LeaseLost { .. }) => answered(
            operation,
            "taken_over",
            Problem::TakenOver.answer(
                "this request outlived its lease and another request with the same key took \
                 it over; this one's writes were rolled back; retry to get that one's answer",
            ),
        ),
        Err(error) => {
            // Fenced: if the commit went through after all, the record is completed and
            // this writes nothing.
            free(store, lease, "the outcome could not be recorded").await;
            store_unavailable(operation, "cannot record the answer", &error)
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
            Err(error) => Problem::StoreUnavailable.retry_after(
                format!(
                    "cannot commit the request's writes: {}",
                    crate::error_line(&error)
                ),
                Duration::from_secs(1),
            ),
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

/// Records a failure that leaves the key free for a retry; the record expires after
/// the retention if no retry comes.
async fn free(store: &Store, lease: &Lease, error: &str) {
    let stored = StoredError {
        kind: "transient",
        error,
    }
    .to_json();
    if let Err(e) = retried(|| store.fail_expiring(lease, &stored)).await {
        warn!(error = %e.describe(), "cannot free the key after a failed request");
    }
}

/// A fenced write after the route answered, tried a few times over about a second: a
/// moment's outage must not leave the key `processing` for a whole lease. A lost lease
/// is final.
async fn retried<F, Fut>(write: F) -> Result<(), StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), StoreError>>,
{
    write
        .retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(50))
                .with_max_times(4),
        )
        .when(|error| !matches!(error, StoreError::LeaseLost { .. }))
        .await
}

async fn rollback(tx: sqlx::Transaction<'static, sqlx::Postgres>) {
    if let Err(error) = tx.rollback().await {
        debug!(error = %crate::error_line(&error), "rollback failed (the connection is gone)");
    }
}

/// Counts the answer and passes it on.
fn answered(operation: &str, outcome: &'static str, response: Response) -> Response {
    metrics::http_request(operation, outcome);
    debug!(outcome, status = response.status().as_u16(), "answered");
    response
}

fn store_unavailable(operation: &str, what: &str, error: &StoreError) -> Response {
    warn!(error = %error.describe(), "{what}");
    answered(
        operation,
        "store_unavailable",
        Problem::StoreUnavailable.retry_after(
            format!("{what}; retry with the same key"),
            Duration::from_secs(1),
        ),
    )
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

/// GET, HEAD, OPTIONS and TRACE change nothing and need no key.
fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// The key header's value: `None` when absent. The draft's form is a structured-field
/// string (`"abc"`); a bare token is accepted too.
fn key_header(headers: &HeaderMap) -> Result<Option<String>, String> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err("the request has more than one Idempotency-Key header".into());
    }
    let text = value
        .to_str()
        .map_err(|_| "the Idempotency-Key header is not visible ASCII".to_string())?;
    let text = text.trim();
    let unquoted = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(text);
    Ok(Some(unquoted.to_owned()))
}

/// The operation: method and matched route (`POST /payments/{id}`), or the path when
/// the layer is outside a router.
fn operation_of(parts: &axum::http::request::Parts) -> String {
    format!("{} {}", parts.method, route_of(parts))
}

fn route_of(parts: &axum::http::request::Parts) -> &str {
    parts
        .extensions
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
        .unwrap_or_else(|| parts.uri.path())
}

/// The request's correlation id, kept on a new record for inspection.
fn correlation_id(headers: &HeaderMap) -> Option<String> {
    ["x-correlation-id", "x-request-id"]
        .iter()
        .find_map(|name| headers.get(*name)?.to_str().ok())
        .map(|id| crate::store::storable(id).into_owned())
}

/// The fingerprint of a request: its target (path and query) and its body, as
/// canonical JSON when it is JSON, else as the SHA-256 of its bytes.
fn fingerprint(uri: &Uri, body: &[u8], volatile: &[String]) -> Fingerprint {
    let target = uri.path_and_query().map_or("/", |p| p.as_str());
    let payload = if body.is_empty() {
        json!({ "target": target })
    } else {
        match serde_json::from_slice::<Value>(body) {
            Ok(body) => json!({ "target": target, "body": body }),
            Err(_) => json!({ "target": target, "body_sha256": hex::encode(Sha256::digest(body)) }),
        }
    };
    let volatile: Vec<&str> = volatile.iter().map(String::as_str).collect();
    Fingerprint::of(&payload, &volatile)
}

/// Why a body was not read.
enum Unread {
    TooLarge,
    Broken(String),
}

/// Reads a body whole, refusing more than `limit` bytes (at once when its declared
/// length says so).
async fn read_limited(body: Body, headers: &HeaderMap, limit: usize) -> Result<Bytes, Unread> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Unread::TooLarge);
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(Unread::TooLarge),
        Err(error) => Err(Unread::Broken(error.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_follows_the_status_and_the_handlers_error() {
        assert_eq!(verdict(StatusCode::CREATED, None, false), Verdict::Store);
        assert!(matches!(
            verdict(StatusCode::NOT_FOUND, None, false),
            Verdict::Free(_)
        ));
        assert!(matches!(
            verdict(StatusCode::TOO_MANY_REQUESTS, None, false),
            Verdict::Free(_)
        ));
        assert_eq!(verdict(StatusCode::NOT_FOUND, None, true), Verdict::Store);
        assert!(matches!(
            verdict(StatusCode::BAD_GATEWAY, None, false),
            Verdict::Free(_)
        ));
        let transient = HandlerError::transient("db busy");
        assert_eq!(
            verdict(StatusCode::SERVICE_UNAVAILABLE, Some(&transient), false),
            Verdict::Free("db busy".into())
        );
        let permanent = HandlerError::permanent("card refused");
        assert_eq!(
            verdict(StatusCode::UNPROCESSABLE_ENTITY, Some(&permanent), false),
            Verdict::StoreWithoutWrites
        );
        let uncertain = HandlerError::uncertain(Some("ch_1".into()), "timeout");
        assert_eq!(
            verdict(StatusCode::BAD_GATEWAY, Some(&uncertain), false),
            Verdict::Pending {
                external_ref: Some("ch_1".into()),
                error: "timeout".into()
            }
        );
    }

    #[tokio::test]
    async fn a_streamed_body_is_cut_at_the_limit() {
        let chunks = |n: usize| {
            Body::from_stream(futures_util::stream::iter(
                (0..n).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 100]))),
            ))
        };
        let over = read_limited(chunks(10), &HeaderMap::new(), 500).await;
        assert!(matches!(over, Err(Unread::TooLarge)));
        let within = read_limited(chunks(5), &HeaderMap::new(), 500).await;
        assert!(matches!(within, Ok(bytes) if bytes.len() == 500));
        let mut declared = HeaderMap::new();
        declared.insert(header::CONTENT_LENGTH, HeaderValue::from(501));
        let refused = read_limited(Body::empty(), &declared, 500).await;
        assert!(matches!(refused, Err(Unread::TooLarge)));
    }

    #[test]
    fn the_key_header_may_be_a_structured_string_and_must_be_single() {
        let mut headers = HeaderMap::new();
        assert_eq!(key_header(&headers), Ok(None));
        headers.insert(IDEMPOTENCY_KEY, "\"8e03978e\"".parse().unwrap());
        assert_eq!(key_header(&headers), Ok(Some("8e03978e".into())));
        headers.insert(IDEMPOTENCY_KEY, " k-1 ".parse().unwrap());
        assert_eq!(key_header(&headers), Ok(Some("k-1".into())));
        headers.append(IDEMPOTENCY_KEY, "k-2".parse().unwrap());
        assert!(key_header(&headers).is_err());
    }

    #[test]
    fn the_fingerprint_covers_body_and_target_but_not_volatile_fields_or_layout() {
        let uri: Uri = "/payments".parse().unwrap();
        let a = fingerprint(
            &uri,
            br#"{"amount": 5, "sent_at": 1}"#,
            &["body.sent_at".into()],
        );
        let b = fingerprint(
            &uri,
            br#"{ "sent_at": 2,"amount":5 }"#,
            &["body.sent_at".into()],
        );
        assert_eq!(a, b);
        let other_amount = fingerprint(&uri, br#"{"amount": 6}"#, &[]);
        assert_ne!(a, other_amount);
        let other_target = fingerprint(&"/payments?x=1".parse().unwrap(), br#"{"amount": 5}"#, &[]);
        assert_ne!(fingerprint(&uri, br#"{"amount": 5}"#, &[]), other_target);
        // Not JSON: the bytes count.
        assert_ne!(
            fingerprint(&uri, b"a=1", &[]),
            fingerprint(&uri, b"a=2", &[])
        );
        assert_eq!(
            fingerprint(&uri, b"a=1", &[]),
            fingerprint(&uri, b"a=1", &[])
        );
    }
}
