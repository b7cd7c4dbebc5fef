//! One request through the layer: read its key and fingerprint its body, claim the key,
//! and answer from the record or hand the claimed request to `claimed`; requests that
//! need no key, and polls of a 202's `Location`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use chrono::Utc;
use tower::Service;
use tracing::{Instrument, Span, field, info_span, warn};

use super::claimed::Claimed;
use super::decision::{self, Answer, Next, Verdict};
use super::problem::{Problem, with_retry_after};
use super::record::{answered, rollback, store_unavailable, verdict_of};
use super::request::{
    Unread, correlation_id, fingerprint, is_safe, key_header, label_of, operation_of, read_limited,
    route_of, trace_context,
};
use super::stored::StoredResponse;
use super::tx::{Left, TxSlot};
use super::{Route, Settings};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::store::{Origin, Status};
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
    shared: Arc<Settings>,
    route: Arc<Route>,
    inner: S,
    request: Request,
) -> Response
where
    S: Service<Request, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let (parts, body) = request.into_parts();
    let keyed = match keyed(&shared, &route, &parts) {
        Ok(Some(keyed)) => keyed,
        Ok(None) => return run_unkeyed(&shared, inner, Request::from_parts(parts, body)).await,
        Err(refusal) => return *refusal,
    };
    let span = request_span(&keyed, &parts);
    serve_keyed(shared, route, inner, (parts, body), keyed)
        .instrument(span)
        .await
}

/// A keyed request's key, its operation, and the label of its metrics.
pub(super) struct Keyed {
    pub(super) key: Key,
    pub(super) operation: String,
    /// The operation, unless no route matched (a layer around a whole router sees every
    /// path a client makes up, and each would be a label of its own).
    pub(super) label: String,
}

/// The request's key, `None` when it needs none (a safe method, or no key on a route
/// where it is optional), or the answer that refuses it. The principal comes first: an
/// anonymous client learns nothing but the application's rejection (typically 401).
fn keyed(shared: &Settings, route: &Route, parts: &Parts) -> Result<Option<Keyed>, Box<Response>> {
    if is_safe(&parts.method) {
        return Ok(None);
    }
    let header = key_header(&parts.headers);
    if matches!(header, Ok(None)) && !route.required {
        return Ok(None);
    }
    let scope = (shared.scope)(parts).map_err(Box::new)?;
    let (operation, label) = (operation_of(parts), label_of(parts));
    let refused = |outcome, problem| Err(Box::new(answered(&label, outcome, problem)));
    let header = match header {
        Ok(Some(header)) => header,
        Ok(None) => {
            let detail = format!("{operation} requires an Idempotency-Key header");
            return refused("missing_key", Problem::MISSING_KEY.answer(detail));
        }
        Err(detail) => return refused("invalid_key", Problem::INVALID_KEY.answer(detail)),
    };
    match Key::new(scope, operation.clone(), header) {
        Ok(key) => Ok(Some(Keyed {
            key,
            operation,
            label,
        })),
        Err(error) => refused(
            "invalid_key",
            Problem::INVALID_KEY.answer(error.to_string()),
        ),
    }
}

/// The span of a keyed request: under a server span of the application's that
/// continued the request's trace, its child; otherwise the server span of the incoming
/// trace.
fn request_span(keyed: &Keyed, parts: &Parts) -> Span {
    let span = info_span!(
        "idempotent_request",
        operation = %keyed.operation,
        key = %keyed.key.short_hash(),
        otel.name = field::Empty,
        otel.kind = field::Empty,
    );
    let incoming = trace_context(&parts.headers);
    if trace::stays_under(&Span::current(), incoming.as_ref()) {
        trace::name(&span, &keyed.operation, "internal");
    } else if trace::continue_trace(&span, incoming.as_ref(), &keyed.operation, "server") {
        trace::attribute(&span, "http.request.method", parts.method.as_str());
        trace::attribute(&span, "http.route", route_of(parts));
    }
    trace::attribute(&span, "idem.key", keyed.key.short_hash());
    span
}

/// Reads and fingerprints a keyed request, claims its key, and does what the claim
/// decides (`decision::on_claim`).
async fn serve_keyed<S>(
    shared: Arc<Settings>,
    route: Arc<Route>,
    inner: S,
    (parts, body): (Parts, Body),
    keyed: Keyed,
) -> Response
where
    S: Service<Request, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let label = keyed.label.clone();
    let bytes = match read_limited(body, &parts.headers, shared.max_body).await {
        Ok(bytes) => bytes,
        Err(Unread::TooLarge) => {
            let detail = format!("the body exceeds {} bytes", shared.max_body);
            return answered(&label, "too_large", Problem::BODY_TOO_LARGE.answer(detail));
        }
        Err(Unread::Broken(error)) => {
            let problem = Problem::UNREADABLE_BODY.answer(error);
            return answered(&label, "unreadable_body", problem);
        }
    };
    let fingerprint = fingerprint(&parts.uri, &bytes, &route.volatile, shared.store.keys());
    let incoming = trace_context(&parts.headers);
    let origin = Origin {
        message_id: None,
        correlation_id: correlation_id(&parts.headers),
        trace_id: trace::trace_id(&Span::current(), incoming.as_ref()),
    };
    let intent = Intent {
        parts,
        body: bytes,
        keyed,
        fingerprint,
        origin,
    };
    if route.single_commit {
        super::single::serve(shared, route, inner, intent).await
    } else {
        claim_and_run(shared, route, inner, intent).await
    }
}

/// A keyed request read whole: what its claim needs, and what its route is given.
pub(super) struct Intent {
    pub(super) parts: Parts,
    pub(super) body: Bytes,
    pub(super) keyed: Keyed,
    pub(super) fingerprint: Fingerprint,
    pub(super) origin: Origin,
}

/// Claims the key in a statement of its own (autocommit: a concurrent repeat sees the
/// claim at once) and does what the claim decides (`decision::on_claim`).
pub(super) async fn claim_and_run<S>(
    shared: Arc<Settings>,
    route: Arc<Route>,
    inner: S,
    intent: Intent,
) -> Response
where
    S: Service<Request, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let Intent {
        parts,
        body,
        keyed,
        fingerprint,
        origin,
    } = intent;
    let label = &keyed.label;
    let reconciles = route.reconcile.is_some();
    let claim = match shared
        .store
        .claim_request(&keyed.key, &fingerprint, &origin, reconciles)
        .await
    {
        Ok(claim) => claim,
        Err(error) => return store_unavailable(label, "cannot claim the key", &error),
    };
    let (lease, pending) = match decision::on_claim(claim) {
        Next::Run(lease) => (lease, None),
        Next::Reconcile {
            lease,
            external_ref,
        } => (lease, Some(external_ref)),
        Next::Answer(answer) => return from_record(answer, &route, &keyed),
    };
    let claimed = Claimed {
        shared,
        route,
        keyed,
        lease,
        pending,
    };
    claimed.run(inner, parts, body).await
}

/// What the layer answers from the record itself.
pub(super) fn from_record(answer: Answer, route: &Route, keyed: &Keyed) -> Response {
    let label = &keyed.label;
    match answer {
        Answer::Replay(result) => {
            match StoredResponse::from_json(result).and_then(|s| s.replay()) {
                Ok(response) => answered(label, "replayed", response),
                Err(error) => Problem::UNREADABLE_STORED_RESPONSE.answer(error.to_string()),
            }
        }
        Answer::InProgress => {
            let location = route.location.as_ref().map(|location| location(&keyed.key));
            let response = match location.as_deref().map(str::parse) {
                Some(Ok(location)) => accepted(Some(location), IN_PROGRESS_RETRY_AFTER),
                _ => Problem::IN_PROGRESS.retry_after(
                    "the first request with this key is still running; retry after it",
                    IN_PROGRESS_RETRY_AFTER,
                ),
            };
            answered(label, "in_progress", response)
        }
        Answer::Uncertain => uncertain(label),
        Answer::KeyReused => answered(
            label,
            "conflict",
            Problem::KEY_REUSED.answer(
                "this key was first used with another body or URL; use a new key for a new \
                 request",
            ),
        ),
        Answer::FailedForGood => answered(
            label,
            "failed",
            Problem::FAILED_FOR_GOOD
                .answer("the request with this key failed for good; use a new key"),
        ),
        Answer::Erased => answered(label, "erased", erased()),
    }
}

/// 409 for a key whose first request's outcome is uncertain.
pub(super) fn uncertain(operation: &str) -> Response {
    answered(
        operation,
        "pending",
        Problem::OUTCOME_UNCERTAIN.retry_after(
            "the outcome of the first request with this key is uncertain and awaits \
             reconciliation",
            PENDING_RETRY_AFTER,
        ),
    )
}

/// Runs a request that has no key (a safe method, or a route where the key is
/// optional): its transaction commits unless the answer would have freed a key (an
/// error, a refusal, 500 or more) or was uncertain.
async fn run_unkeyed<S>(shared: &Settings, inner: S, mut request: Request) -> Response
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
                Problem::STORE_UNAVAILABLE.retry_after(
                    "cannot commit the request's writes; retry the request",
                    Duration::from_secs(1),
                )
            }
        },
        Left::Transaction(tx) => {
            rollback(tx).await;
            response
        }
        Left::Kept if commit => Problem::TRANSACTION_KEPT.answer(
            "the handler's writes could not be committed: its transaction outlived its answer",
        ),
        Left::Kept | Left::Nothing => response,
    }
}

/// The answer of a poll of a 202's `Location`.
pub(super) async fn poll(shared: &Settings, key: &Key) -> Response {
    let record = match shared.store.get(key).await {
        Ok(record) => record,
        Err(error) => return store_unavailable(key.operation(), "cannot read the key", &error),
    };
    let Some(record) = record else {
        return Problem::NO_ANSWER.answer("no request with this key is known");
    };
    if record.erased_at.is_some() {
        return erased();
    }
    let lease_live = record.lease_expires_at.is_some_and(|at| at > Utc::now());
    match record.status {
        Status::Completed => {
            match StoredResponse::from_json(record.result).and_then(|s| s.replay()) {
                Ok(response) => response,
                Err(error) => Problem::UNREADABLE_STORED_RESPONSE.answer(error.to_string()),
            }
        }
        Status::Processing if lease_live => accepted(None, IN_PROGRESS_RETRY_AFTER),
        // Its server died: only the request itself, sent again, can take it over.
        Status::Processing => Problem::NO_ANSWER
            .answer("the request with this key stopped without an answer; send it again"),
        // Being reconciled: worth waiting for.
        Status::Pending if lease_live => accepted(None, PENDING_RETRY_AFTER),
        Status::Pending => Problem::OUTCOME_UNCERTAIN.retry_after(
            "the outcome of the request with this key is uncertain and awaits reconciliation",
            PENDING_RETRY_AFTER,
        ),
        Status::Failed => Problem::NO_ANSWER
            .answer("the request with this key failed without an answer to keep; send it again"),
    }
}

/// 410 for a key whose request was handled and whose stored answer was erased since.
fn erased() -> Response {
    Problem::ERASED.answer(
        "the request with this key was handled and is not run again; what was stored of \
         it, its answer too, has been erased",
    )
}

/// Calls the route.
pub(super) async fn call<S>(mut inner: S, request: Request) -> Response
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
