//! The request's transaction ([`Tx`]) and what the handler may know of its key
//! ([`IdempotentRequest`]), both extractors.
//!
//! The layer lends the handler one transaction through the request's extensions; the
//! handler's writes go through it, and when the handler has answered, the layer writes
//! the stored response and the fencing check into the same transaction and commits: the
//! writes and the record commit together or not at all.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::response::Response;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use super::problem::Problem;
use crate::key::Key;

/// The request's database transaction: extract it in a handler behind the
/// idempotency layer and run the handler's writes through it (`&mut *tx` is a
/// `&mut PgConnection`).
///
/// Do not commit it: the layer commits it together with the stored response after
/// the handler answered (an answer of 500 or more, or a transient or uncertain
/// [`crate::HandlerError`], rolls it back). The transaction begins when the handler
/// extracts it; a handler that never extracts it costs no connection.
///
/// ```no_run
/// # use axum::{Json, http::StatusCode};
/// # use idem::http::Tx;
/// async fn create(mut tx: Tx, Json(order): Json<serde_json::Value>)
///     -> Result<StatusCode, idem::HandlerError> {
///     sqlx::query("INSERT INTO orders (body) VALUES ($1)")
///         .bind(&order)
///         .execute(&mut *tx)
///         .await?;
///     Ok(StatusCode::CREATED)
/// }
/// ```
#[derive(Debug)]
pub struct Tx {
    tx: Option<Transaction<'static, Postgres>>,
    slot: TxSlot,
}

/// Where the handler's transaction goes back when the handler drops its [`Tx`].
#[derive(Debug, Clone)]
pub(crate) struct TxSlot(Arc<Mutex<SlotState>>);

#[derive(Debug)]
struct SlotState {
    pool: PgPool,
    lent: bool,
    returned: Option<Transaction<'static, Postgres>>,
}

/// What the handler left behind.
pub(crate) enum Left {
    /// It never asked for a transaction.
    Nothing,
    /// Its transaction, to be committed or rolled back.
    Transaction(Transaction<'static, Postgres>),
    /// It still holds its transaction (moved into a task that outlives the response):
    /// the layer cannot commit what it cannot see.
    Kept,
}

impl TxSlot {
    pub(crate) fn new(pool: PgPool) -> Self {
        Self(Arc::new(Mutex::new(SlotState {
            pool,
            lent: false,
            returned: None,
        })))
    }

    /// What the handler left, once it answered.
    pub(crate) fn take(&self) -> Left {
        let mut state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match (state.lent, state.returned.take()) {
            (false, _) => Left::Nothing,
            (true, Some(tx)) => Left::Transaction(tx),
            (true, None) => Left::Kept,
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Tx {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let Some(slot) = parts.extensions.get::<TxSlot>().cloned() else {
            return Err(Problem::NOT_BEHIND_LAYER.answer(
                "this route has no idempotency layer to lend a transaction (add \
                 Idempotency::required or ::optional to it)",
            ));
        };
        let pool = {
            let mut state = slot.0.lock().unwrap_or_else(PoisonError::into_inner);
            if state.lent {
                return Err(Problem::TRANSACTION_KEPT
                    .answer("the request's transaction can be extracted once per request"));
            }
            state.lent = true;
            state.pool.clone()
        };
        match pool.begin().await {
            Ok(tx) => Ok(Tx { tx: Some(tx), slot }),
            Err(error) => {
                // Not lent after all: the layer must not wait for it.
                slot.0.lock().unwrap_or_else(PoisonError::into_inner).lent = false;
                Err(Problem::STORE_UNAVAILABLE.retry_after(
                    format!(
                        "cannot begin the request's transaction: {}",
                        crate::text::error_line(&error)
                    ),
                    std::time::Duration::from_secs(1),
                ))
            }
        }
    }
}

impl Deref for Tx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        // Some from extraction until drop: only `Drop` takes it.
        match &self.tx {
            Some(tx) => tx,
            None => unreachable!("a Tx holds its transaction until it is dropped"),
        }
    }
}

impl DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.tx {
            Some(tx) => tx,
            None => unreachable!("a Tx holds its transaction until it is dropped"),
        }
    }
}

impl Drop for Tx {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let mut state = self.slot.0.lock().unwrap_or_else(PoisonError::into_inner);
            state.returned = Some(tx);
        }
    }
}

/// What a handler behind the layer may know of its key: extract it to give a
/// provider a stable idempotency key ([`IdempotentRequest::provider_key`]) or to be
/// careful on a takeover. Requests without a key (a route where the key is optional)
/// have none: extract `Option<IdempotentRequest>` there.
#[derive(Debug, Clone)]
pub struct IdempotentRequest {
    /// The key: the principal, the method and route, the `Idempotency-Key`.
    pub key: Key,
    /// Which claim of this key this is, from 1.
    pub attempt: i32,
    /// True when an earlier request with this key died mid-way (its lease expired):
    /// any effect outside the request's transaction may have happened.
    pub takeover: bool,
}

impl IdempotentRequest {
    /// A stable key for calls to providers, as [`crate::Context::provider_key`].
    pub fn provider_key(&self) -> String {
        self.key.digest()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotentRequest {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        parts
            .extensions
            .get::<IdempotentRequest>()
            .cloned()
            .ok_or_else(|| {
                Problem::MISSING_KEY.answer("this request has no Idempotency-Key to tell about")
            })
    }
}

impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for IdempotentRequest {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<IdempotentRequest>().cloned())
    }
}
