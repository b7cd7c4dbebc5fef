//! What a claimed request's answer records: the verdict on it, the stored answer (in
//! the handler's transaction), a freed key, and the counted answer.

use std::future::Future;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::HeaderMap;
use axum::response::Response;
use backon::{ExponentialBuilder, Retryable};
use serde_json::Value;
use sqlx::{Postgres, Transaction};
use tracing::{debug, warn};

use super::Settings;
use super::decision::{self, Verdict};
use super::problem::{Decided, Failure, Problem};
use super::request::{Unread, read_limited};
use super::stored::StoredResponse;
use crate::metrics;
use crate::store::{Lease, Store, StoreError, StoredError};

/// The verdict on `response`.
pub(super) fn verdict_of(response: &Response) -> Verdict {
    let extensions = response.extensions();
    decision::verdict(
        response.status().as_u16(),
        extensions.get::<Failure>().map(|f| &f.0),
        extensions.get::<Decided>().is_some(),
    )
}

/// [`record`] while heartbeats keep the lease: reading a slow streamed answer must not
/// let the lease lapse under it.
pub(super) async fn record_beside_heartbeat(
    shared: &Settings,
    lease: &Lease,
    operation: &str,
    response: Response,
    tx: Option<Transaction<'static, Postgres>>,
) -> Response {
    let recording = record(shared, lease, operation, response, tx);
    match crate::store::lease::beside_heartbeat(&shared.store, lease, recording).await {
        Ok(response) => response,
        Err(panic) => {
            warn!(error = %panic, "recording the answer panicked");
            Problem::INTERNAL.answer("the request failed; retry with the same key")
        }
    }
}

/// Stores `response` as the key's answer, in `tx` with the handler's writes when there
/// is one, and sends it; or, when it cannot be stored, sends why.
pub(super) async fn record(
    shared: &Settings,
    lease: &Lease,
    operation: &str,
    response: Response,
    mut tx: Option<Transaction<'static, Postgres>>,
) -> Response {
    let store = &shared.store;
    let (parts, bytes, stored) = match stored_answer(shared, response).await {
        Ok(answer) => answer,
        Err(detail) => {
            if let Some(tx) = tx {
                rollback(tx).await;
            }
            free(store, lease, &detail).await;
            return too_large(operation, &detail);
        }
    };
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
        Err(StoreError::LeaseLost { .. }) => taken_over(operation),
        Err(error) => {
            // Fenced: if the commit went through after all, the record is completed and
            // this writes nothing.
            free(store, lease, "the outcome could not be recorded").await;
            store_unavailable(operation, "cannot record the answer", &error)
        }
    }
}

/// The answer read whole (within [`Settings::max_response`]) and as the record stores
/// it; or why it cannot be stored.
pub(super) async fn stored_answer(
    shared: &Settings,
    response: Response,
) -> Result<(axum::http::response::Parts, Bytes, Value), String> {
    let (parts, body) = response.into_parts();
    let bytes = read_limited(body, &HeaderMap::new(), shared.max_response)
        .await
        .map_err(|unread| match unread {
            Unread::TooLarge => format!(
                "the answer exceeds the {} bytes the layer stores for replay",
                shared.max_response
            ),
            Unread::Broken(error) => format!("the answer could not be read: {error}"),
        })?;
    let stored =
        StoredResponse::new(parts.status, &parts.headers, &shared.replay_headers, &bytes).to_json();
    Ok((parts, bytes, stored))
}

/// 500 for an answer that could not be stored (`detail`): nothing was.
pub(super) fn too_large(operation: &str, detail: &str) -> Response {
    let detail = format!("{detail}; nothing was stored, the key is free for a retry");
    let problem = Problem::RESPONSE_TOO_LARGE.answer(detail);
    answered(operation, "response_too_large", problem)
}

/// 409 `request-taken-over`: the request outlived its lease.
pub(super) fn taken_over(operation: &str) -> Response {
    answered(
        operation,
        "taken_over",
        Problem::TAKEN_OVER.answer(
            "this request outlived its lease and another request with the same key took \
             it over; this one's writes were rolled back; retry to get that one's answer",
        ),
    )
}

/// Records a failure that leaves the key free for a retry; the record expires after
/// the retention if no retry comes.
pub(super) async fn free(store: &Store, lease: &Lease, error: &str) {
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
pub(super) async fn retried<F, Fut>(write: F) -> Result<(), StoreError>
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

pub(super) async fn rollback(tx: sqlx::Transaction<'static, sqlx::Postgres>) {
    if let Err(error) = tx.rollback().await {
        debug!(error = %crate::text::error_line(&error), "rollback failed (the connection is gone)");
    }
}

/// Counts the answer and passes it on.
pub(super) fn answered(operation: &str, outcome: &'static str, response: Response) -> Response {
    metrics::http_request(operation, outcome);
    debug!(outcome, status = response.status().as_u16(), "answered");
    response
}

pub(super) fn store_unavailable(operation: &str, what: &str, error: &StoreError) -> Response {
    warn!(error = %error.describe(), "{what}");
    answered(
        operation,
        "store_unavailable",
        Problem::STORE_UNAVAILABLE.retry_after(
            format!("{what}; retry with the same key"),
            Duration::from_secs(1),
        ),
    )
}
