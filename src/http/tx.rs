//! The request's transaction ([`Tx`]) and what the handler may know of its key
//! ([`IdempotentRequest`]), both extractors.
//!
//! The layer lends the handler one transaction through the request's extensions; the
//! handler's writes go through it, and when the handler has answered, the layer writes
//! the stored response and the fencing check into the same transaction and commits: the
//! writes and the record commit together or not at all. On a single-commit route the
//! transaction lent is the one the layer claimed the key in, after a savepoint.

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
/// extracts it; a handler that never extracts it costs no connection. On a route in
/// single-commit mode ([`super::IdempotencyLayer::single_commit`]) it is the
/// transaction that holds the key's record, begun before the handler ran.
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
    /// A single-commit route's transaction, begun by the layer with the key in it:
    /// lent (after a savepoint where `savepoint_first`) instead of a new one.
    begun: Option<Transaction<'static, Postgres>>,
    /// Take [`SAVEPOINT`] before lending `begun` (it holds a record the handler's
    /// writes may have to be rolled back without).
    savepoint_first: bool,
    /// The savepoint [`SAVEPOINT`] was taken before the handler's writes.
    savepoint: bool,
}

/// The savepoint a single-commit route's handler writes after: rolled back to, its
/// writes go and the record stays (a permanent error's answer is stored without them).
pub(crate) const SAVEPOINT: &str = "SAVEPOINT idem_route";
/// Undoes what the handler wrote after [`SAVEPOINT`].
pub(crate) const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT idem_route";

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
            begun: None,
            savepoint_first: false,
            savepoint: false,
        })))
    }

    /// A slot that lends `tx`, already begun (a single-commit route's, which holds the
    /// key), instead of beginning one; after [`SAVEPOINT`] if `savepoint`.
    pub(crate) fn with_transaction(
        pool: PgPool,
        tx: Transaction<'static, Postgres>,
        savepoint: bool,
    ) -> Self {
        let slot = Self::new(pool);
        {
            let mut state = slot.lock();
            state.begun = Some(tx);
            state.savepoint_first = savepoint;
        }
        slot
    }

    /// Whether the handler's writes began after [`SAVEPOINT`] (a single-commit route's
    /// handler that extracted its [`Tx`]).
    pub(crate) fn savepoint(&self) -> bool {
        self.lock().savepoint
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the handler left, once it answered.
    pub(crate) fn take(&self) -> Left {
        let mut state = self.lock();
        match (state.lent, state.returned.take()) {
            // A begun transaction the handler did not ask for is still the layer's.
            (false, _) => match state.begun.take() {
                Some(tx) => Left::Transaction(tx),
                None => Left::Nothing,
            },
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
        let (pool, begun) = {
            let mut state = slot.lock();
            if state.lent {
                return Err(Problem::TRANSACTION_KEPT
                    .answer("the request's transaction can be extracted once per request"));
            }
            state.lent = true;
            (state.pool.clone(), state.begun.take())
        };
        let savepoint_first = begun.is_some() && slot.lock().savepoint_first;
        let begun = match begun {
            Some(tx) if savepoint_first => savepoint(tx).await,
            Some(tx) => Ok(tx),
            None => pool.begin().await.map_err(|error| (error, None)),
        };
        match begun {
            Ok(tx) => {
                slot.lock().savepoint = savepoint_first;
                Ok(Tx { tx: Some(tx), slot })
            }
            Err((error, tx)) => {
                // Not lent after all: the layer must not wait for it (and a begun
                // transaction goes back to it, to be rolled back).
                let mut state = slot.lock();
                state.lent = false;
                state.begun = tx;
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

/// Takes [`SAVEPOINT`] in a single-commit route's transaction before lending it; on
/// failure, the error and the transaction back.
async fn savepoint(
    mut tx: Transaction<'static, Postgres>,
) -> Result<Transaction<'static, Postgres>, (sqlx::Error, Option<Transaction<'static, Postgres>>)> {
    match sqlx::raw_sql(SAVEPOINT).execute(&mut *tx).await {
        Ok(_) => Ok(tx),
        Err(error) => Err((error, Some(tx))),
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
            self.slot.lock().returned = Some(tx);
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
