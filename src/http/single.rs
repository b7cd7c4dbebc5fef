//! A request on a single-commit route ([`super::IdempotencyLayer::single_commit`]):
//! the record is written in the request's own transaction with the route's writes and
//! its answer, and all of it commits once.
//!
//! The request's first statement takes the key's lock (a transaction-scoped advisory
//! lock: no write) and looks for the key's record. Holding the lock, for a key with no
//! record (a new key, the common case), the route runs and the record is inserted
//! once, completed with the answer, just before the commit: nothing is written first
//! to be updated after. A concurrent repeat waits for the lock and then claims in its
//! own transaction as the default mode does: it finds the stored answer, or nothing
//! if the first one rolled back, and runs itself. A key that has a record is claimed
//! in the transaction the same way (taken over, or answered from the record).
//!
//! Nobody sees the record before that commit. So nothing here heartbeats (no other
//! single-commit request can take the key while the transaction holds it, and a
//! heartbeat from another connection would wait for the same lock), and a failure
//! frees the key by rolling back: no `failed` record is written.
//!
//! - `locked`: what a new key's request records (its transaction holds the lock only);
//! - `recorded`: what a request that claimed the key's record in its transaction
//!   records.

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
use super::record::{answered, rollback, store_unavailable, verdict_of};
use super::service::{Intent, Keyed, call, claim_and_run, from_record};
use super::tx::{IdempotentRequest, Left, TxSlot};
use super::{Route, Settings};
use crate::failpoint;

mod locked;
mod recorded;
use crate::store::lease::panic_text;
use crate::store::{ClaimRequest, Lease, StoreError};

/// The request's transaction: READ COMMITTED whatever the database's default, so that
/// a claim that waited for another transaction sees its commit on its next statement.
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Serves a keyed request on a single-commit route: runs the route in the request's
/// transaction with the key's lock (a new key) or its claimed record, or answers from
/// the record.
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
    let mut tx = match begin(&shared, &route).await {
        Ok(tx) => tx,
        Err(error) => {
            return store_unavailable(&label, "cannot begin the request's transaction", &error);
        }
    };
    let key = &intent.keyed.key;
    let lock = match store.lock_request_in(&mut tx, key).await {
        Ok(lock) => lock,
        Err(error) => {
            rollback(tx).await;
            return store_unavailable(&label, "cannot lock the key", &error);
        }
    };
    if !lock.recorded && lock.held {
        failpoint::hit("http-single-after-claim");
        let Intent {
            parts,
            body,
            keyed,
            fingerprint,
            origin,
        } = intent;
        let request = ClaimRequest {
            key: keyed.key.clone(),
            fingerprint,
            origin,
        };
        let single = Single {
            shared: shared.clone(),
            route,
            keyed,
            holds: Holds::Lock(request),
        };
        return single.run(inner, tx, parts, body).await;
    }
    // A repeat waits at the key for the first request's commit no longer than a run
    // may take; then it answers as for a key in progress (409 + Retry-After). A key
    // with a record is claimed at once, lock or not: the claim's row lock orders
    // takeovers, and replays of one key do not queue behind each other.
    if !lock.recorded
        && let Err(error) = store.wait_for_request_in(&mut tx, key).await
    {
        rollback(tx).await;
        if waited_too_long(&error) {
            return from_record(Answer::InProgress, &route, &intent.keyed);
        }
        return store_unavailable(&label, "cannot wait for the key", &error);
    }
    claim_in(shared, route, inner, intent, tx).await
}

/// The request's transaction, READ COMMITTED (so that a statement after a wait sees
/// what the other transaction committed), waiting for a lock no longer than a run.
async fn begin(
    shared: &Settings,
    route: &Route,
) -> Result<Transaction<'static, Postgres>, StoreError> {
    let begin = format!(
        "{BEGIN}; SET LOCAL lock_timeout = {}",
        route.run_within.as_millis().max(1)
    );
    Ok(shared
        .store
        .pool()
        .begin_with(sqlx::AssertSqlSafe(begin))
        .await?)
}

/// Claims a key that has a record, or that another request held, in the request's
/// transaction (which holds the key's lock), and does what the claim decides.
async fn claim_in<S>(
    shared: Arc<Settings>,
    route: Arc<Route>,
    inner: S,
    intent: Intent,
    mut tx: Transaction<'static, Postgres>,
) -> Response
where
    S: Service<Request, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let store = &shared.store;
    let label = &intent.keyed.label;
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
            return store_unavailable(label, "cannot claim the key", &error);
        }
    };
    match decision::on_claim(claim) {
        Next::Run(lease) => {
            failpoint::hit("http-single-after-claim");
            let single = Single {
                shared: shared.clone(),
                route,
                keyed: intent.keyed,
                holds: Holds::Record(lease),
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

/// A request whose key its transaction holds.
struct Single {
    shared: Arc<Settings>,
    route: Arc<Route>,
    keyed: Keyed,
    holds: Holds,
}

/// How a request's transaction holds its key.
enum Holds {
    /// The key's lock, and no record: the record is inserted with the answer.
    Lock(ClaimRequest),
    /// A record claimed in the transaction (inserted `processing`, or taken over),
    /// completed under its lease.
    Record(Lease),
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
        let (attempt, takeover) = match &self.holds {
            Holds::Lock(_) => (1, false),
            Holds::Record(lease) => (lease.attempt, lease.takeover),
        };
        request.extensions_mut().insert(IdempotentRequest {
            key: self.keyed.key.clone(),
            attempt,
            takeover,
        });
        // With a record in the transaction, the route writes after a savepoint, so that
        // an answer stored without its writes keeps the record; with the lock alone,
        // such an answer rolls back whole and is recorded on its own.
        let savepoint = matches!(self.holds, Holds::Record(_));
        let pool = self.shared.store.pool().clone();
        let slot = TxSlot::with_transaction(pool, tx, savepoint);
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
    /// the route's writes (or without them), `pending`, or rolled back whole, which
    /// frees the key.
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
        match (verdict_of(&response), &self.holds) {
            (Verdict::Free(error), holds) => {
                debug!(error = %error, "rolled back: the key is free");
                // With the lock alone, another request may have recorded the key while
                // this one ran (its first look just missed that one's commit, or a
                // default-mode claim): looked for before the lock goes, so that no
                // waiting repeat's commit counts. A transaction the route's error
                // aborted cannot look.
                let recorded = match holds {
                    Holds::Lock(request) => {
                        let store = &self.shared.store;
                        let found = store.record_exists_in(&mut tx, &request.key).await;
                        matches!(found, Ok(true)).then_some(request)
                    }
                    Holds::Record(_) => None,
                };
                rollback(tx).await;
                if let Some(request) = recorded
                    && let Some(answer) = self.recorded_answer(request).await
                {
                    return answer;
                }
                answered(label, "failed", response)
            }
            (verdict, Holds::Record(lease)) => {
                self.record_claimed(lease, tx, savepoint, verdict, response)
                    .await
            }
            (verdict, Holds::Lock(request)) => {
                self.record_new(request, tx, verdict, response).await
            }
        }
    }

    /// Commits the request's transaction, which holds its record with the answer, and
    /// answers.
    async fn commit(
        &self,
        tx: Transaction<'static, Postgres>,
        parts: axum::http::response::Parts,
        bytes: Bytes,
    ) -> Response {
        let label = &self.keyed.label;
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
}

/// The claim waited longer than `lock_timeout` for another request holding the key
/// (SQLSTATE 55P03).
fn waited_too_long(error: &StoreError) -> bool {
    match error {
        StoreError::Database(sqlx::Error::Database(db)) => db.code().as_deref() == Some("55P03"),
        _ => false,
    }
}
