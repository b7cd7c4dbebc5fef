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

/// One problem: what the client did (or met), and what to do next: its status, the
/// `type` slug (`urn:idem:problem:<slug>`) and the title. Each case is a constant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Problem {
    status: StatusCode,
    slug: &'static str,
    title: &'static str,
}

impl Problem {
    /// The route requires an `Idempotency-Key` and the request has none.
    pub(crate) const MISSING_KEY: Problem = Problem {
        status: StatusCode::BAD_REQUEST,
        slug: "idempotency-key-missing",
        title: "Idempotency-Key is missing",
    };

    /// The key (or the scope and route it belongs to) is not a valid key.
    pub(crate) const INVALID_KEY: Problem = Problem {
        status: StatusCode::BAD_REQUEST,
        slug: "idempotency-key-invalid",
        title: "Idempotency-Key is not a valid key",
    };

    /// The same key was used with another request body or URL.
    pub(crate) const KEY_REUSED: Problem = Problem {
        status: StatusCode::UNPROCESSABLE_ENTITY,
        slug: "idempotency-key-reused",
        title: "Idempotency-Key is already used for another request",
    };

    /// The first request with this key is still running.
    pub(crate) const IN_PROGRESS: Problem = Problem {
        status: StatusCode::CONFLICT,
        slug: "request-in-progress",
        title: "A request with this Idempotency-Key is being processed",
    };

    /// The first request's outcome is uncertain and awaits reconciliation.
    pub(crate) const OUTCOME_UNCERTAIN: Problem = Problem {
        status: StatusCode::CONFLICT,
        slug: "outcome-uncertain",
        title: "The outcome of the request with this Idempotency-Key is uncertain",
    };

    /// The first request with this key failed for good.
    pub(crate) const FAILED_FOR_GOOD: Problem = Problem {
        status: StatusCode::UNPROCESSABLE_ENTITY,
        slug: "request-failed",
        title: "The request with this Idempotency-Key failed for good",
    };

    /// Another request took the key over while this one ran.
    pub(crate) const TAKEN_OVER: Problem = Problem {
        status: StatusCode::CONFLICT,
        slug: "request-taken-over",
        title: "Another request took this Idempotency-Key over",
    };

    /// The request body is larger than the route accepts.
    pub(crate) const BODY_TOO_LARGE: Problem = Problem {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        slug: "body-too-large",
        title: "The request body is too large",
    };

    /// The request body could not be read.
    pub(crate) const UNREADABLE_BODY: Problem = Problem {
        status: StatusCode::BAD_REQUEST,
        slug: "body-unreadable",
        title: "The request body could not be read",
    };

    /// The response is larger than the layer stores.
    pub(crate) const RESPONSE_TOO_LARGE: Problem = Problem {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        slug: "response-too-large",
        title: "The response is too large to be stored for replay",
    };

    /// The idempotency store could not be reached.
    pub(crate) const STORE_UNAVAILABLE: Problem = Problem {
        status: StatusCode::SERVICE_UNAVAILABLE,
        slug: "idempotency-store-unavailable",
        title: "The idempotency store is unavailable",
    };

    /// The handler kept its transaction past its response.
    pub(crate) const TRANSACTION_KEPT: Problem = Problem {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        slug: "transaction-kept",
        title: "The handler kept its transaction past its response",
    };

    /// The stored response could not be read back.
    pub(crate) const UNREADABLE_STORED_RESPONSE: Problem = Problem {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        slug: "stored-response-unreadable",
        title: "The stored response could not be read back",
    };

    /// An extractor of the layer's was used on a route without the layer.
    pub(crate) const NOT_BEHIND_LAYER: Problem = Problem {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        slug: "route-without-idempotency-layer",
        title: "The route has no idempotency layer",
    };

    /// A poll found no answer to wait for.
    pub(crate) const NO_ANSWER: Problem = Problem {
        status: StatusCode::NOT_FOUND,
        slug: "no-answer",
        title: "There is no answer to wait for under this Idempotency-Key",
    };

    /// The route panicked, or the request's task failed.
    pub(crate) const INTERNAL: Problem = Problem {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        slug: "internal-error",
        title: "The request failed",
    };

    /// The route ran longer than its bound and was stopped.
    pub(crate) const TIMED_OUT: Problem = Problem {
        status: StatusCode::SERVICE_UNAVAILABLE,
        slug: "request-timed-out",
        title: "The request ran too long and was stopped",
    };

    /// The request with this key was handled; its stored answer was erased since.
    pub(crate) const ERASED: Problem = Problem {
        status: StatusCode::GONE,
        slug: "idempotency-key-erased",
        title: "The request with this Idempotency-Key was handled; its answer was erased",
    };

    /// The answer, with `detail` saying what happened to this request.
    pub(crate) fn answer(self, detail: impl Into<String>) -> Response {
        problem(self.status, self.slug, self.title, &detail.into())
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
