//! The layer's own answers, as `application/problem+json` (RFC 9457) bodies.
//!
//! Every answer the layer makes itself has a `type` naming the case, so a client can
//! tell a missing key from a conflict without reading prose (docs/DESIGN.md, "HTTP
//! entry points").

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use serde_json::json;

use crate::handler::HandlerError;

/// The media type of every answer the layer makes itself.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// One problem: what the client did (or met), and what to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Problem {
    /// The route requires an `Idempotency-Key` and the request has none.
    MissingKey,
    /// The key (or the scope and route it belongs to) is not a valid key.
    InvalidKey,
    /// The same key was used with another request body or URL.
    KeyReused,
    /// The first request with this key is still running.
    InProgress,
    /// The first request's outcome is uncertain and awaits reconciliation.
    OutcomeUncertain,
    /// The first request with this key failed for good.
    FailedForGood,
    /// Another request took the key over while this one ran.
    TakenOver,
    /// The request body is larger than the route accepts.
    BodyTooLarge,
    /// The request body could not be read.
    UnreadableBody,
    /// The response is larger than the layer stores.
    ResponseTooLarge,
    /// The idempotency store could not be reached.
    StoreUnavailable,
    /// The handler kept its transaction past its response.
    TransactionKept,
    /// The stored response could not be read back.
    UnreadableStoredResponse,
    /// An extractor of the layer's was used on a route without the layer.
    NotBehindLayer,
    /// A poll found no answer to wait for.
    NoAnswer,
    /// The route panicked, or the request's task failed.
    Internal,
    /// The route ran longer than its bound and was stopped.
    TimedOut,
}

impl Problem {
    /// The status, the `type` slug and the title.
    fn describe(self) -> (StatusCode, &'static str, &'static str) {
        use Problem::*;
        match self {
            MissingKey => (
                StatusCode::BAD_REQUEST,
                "idempotency-key-missing",
                "Idempotency-Key is missing",
            ),
            InvalidKey => (
                StatusCode::BAD_REQUEST,
                "idempotency-key-invalid",
                "Idempotency-Key is not a valid key",
            ),
            KeyReused => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "Idempotency-Key is already used for another request",
            ),
            InProgress => (
                StatusCode::CONFLICT,
                "request-in-progress",
                "A request with this Idempotency-Key is being processed",
            ),
            OutcomeUncertain => (
                StatusCode::CONFLICT,
                "outcome-uncertain",
                "The outcome of the request with this Idempotency-Key is uncertain",
            ),
            FailedForGood => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "request-failed",
                "The request with this Idempotency-Key failed for good",
            ),
            TakenOver => (
                StatusCode::CONFLICT,
                "request-taken-over",
                "Another request took this Idempotency-Key over",
            ),
            BodyTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "The request body is too large",
            ),
            UnreadableBody => (
                StatusCode::BAD_REQUEST,
                "body-unreadable",
                "The request body could not be read",
            ),
            ResponseTooLarge => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "response-too-large",
                "The response is too large to be stored for replay",
            ),
            StoreUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "idempotency-store-unavailable",
                "The idempotency store is unavailable",
            ),
            TransactionKept => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "transaction-kept",
                "The handler kept its transaction past its response",
            ),
            UnreadableStoredResponse => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "stored-response-unreadable",
                "The stored response could not be read back",
            ),
            Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal-error",
                "The request failed",
            ),
            TimedOut => (
                StatusCode::SERVICE_UNAVAILABLE,
                "request-timed-out",
                "The request ran too long and was stopped",
            ),
            NoAnswer => (
                StatusCode::NOT_FOUND,
                "no-answer",
                "There is no answer to wait for under this Idempotency-Key",
            ),
            NotBehindLayer => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "route-without-idempotency-layer",
                "The route has no idempotency layer",
            ),
        }
    }

    /// The answer, with `detail` saying what happened to this request.
    pub(crate) fn answer(self, detail: impl Into<String>) -> Response {
        let (status, slug, title) = self.describe();
        problem(status, slug, title, &detail.into())
    }

    /// The answer with a `Retry-After` of whole seconds (at least 1).
    pub(crate) fn retry_after(self, detail: impl Into<String>, after: Duration) -> Response {
        with_retry_after(self.answer(detail), after)
    }
}

/// A problem+json response.
fn problem(status: StatusCode, slug: &str, title: &str, detail: &str) -> Response {
    let body = json!({
        "type": format!("urn:idem:problem:{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON))],
        body.to_string(),
    )
        .into_response()
}

/// Adds `Retry-After` in whole seconds, rounded up, at least 1.
pub(crate) fn with_retry_after(mut response: Response, after: Duration) -> Response {
    let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
    response
}

/// Marks a refusal (a 4xx) as the route's decision, to be stored and replayed like a
/// success: `(StatusCode::PAYMENT_REQUIRED, Decided, Json(declined))`. Without it a 4xx
/// leaves the key free (its writes rolled back), because most are rejections a retry
/// may fix: a missing `Content-Type`, a body that does not parse, 401 or 429 from
/// middleware. A [`HandlerError::Permanent`] is a decision already.
#[derive(Debug, Clone, Copy, Default)]
pub struct Decided;

impl IntoResponseParts for Decided {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut parts: ResponseParts) -> Result<ResponseParts, Self::Error> {
        parts.extensions_mut().insert(self);
        Ok(parts)
    }
}

/// What the layer needs to know of a handler's failure: it rides on the response's
/// extensions from [`HandlerError`]'s `IntoResponse` to the layer.
#[derive(Debug, Clone)]
pub(crate) struct Failure(pub(crate) HandlerError);

/// A [`HandlerError`] returned from an HTTP handler answers as problem+json and tells
/// the idempotency layer what to record:
///
/// - `Transient` → 503 with `Retry-After: 1`; the handler's transaction is rolled back
///   and the key is free for a retry;
/// - `Permanent` → 422; the handler's transaction is rolled back, and the answer is
///   stored and replayed like any other answer below 500 (the request was decided);
/// - `Uncertain` → 502; the transaction is rolled back and the key stays `pending`
///   (answered 409) until the outcome is reconciled.
impl IntoResponse for HandlerError {
    fn into_response(self) -> Response {
        let (status, slug, title) = match &self {
            HandlerError::Transient(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "transient-failure",
                "The request failed; retry it with the same Idempotency-Key",
            ),
            HandlerError::Permanent(_) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "permanent-failure",
                "The request was refused",
            ),
            HandlerError::Uncertain { .. } => (
                StatusCode::BAD_GATEWAY,
                "outcome-uncertain",
                "The outcome of the request is uncertain; it will be reconciled",
            ),
        };
        // What Postgres says (tables, columns, constraints) is for the logs only.
        let detail = crate::fault::public(self.message());
        if detail != self.message() {
            tracing::warn!(error = %self.message(), kind = self.kind(), "the request failed on a database error");
        }
        let mut response = problem(status, slug, title, &detail);
        if matches!(self, HandlerError::Transient(_)) {
            response = with_retry_after(response, Duration::from_secs(1));
        }
        response.extensions_mut().insert(Failure(self));
        response
    }
}
