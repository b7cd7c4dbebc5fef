//! A single-commit request whose transaction holds the key's lock and no record (a new
//! key): the record is inserted once with the answer, in the transaction with the
//! route's writes, or on its own once they rolled back; a key recorded meanwhile by
//! another request is answered from that record.

use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use sqlx::{Postgres, Transaction};
use tracing::{debug, warn};

use super::{Single, begin, waited_too_long};
use crate::failpoint;
use crate::http::decision::{self, Answer, Next, Verdict};
use crate::http::record::{answered, rollback, store_unavailable, stored_answer, too_large};
use crate::http::service::from_record;
use crate::store::{ClaimRequest, NewRecord, Status, StoreError, StoredError};

/// How long a request whose answer goes without its route's writes waits for a second
/// connection to write its record on while it still holds the key's lock.
const SECOND_CONNECTION: Duration = Duration::from_secs(1);

impl Single {
    /// Records the answer of a request that holds the key's lock and no record: the
    /// record is inserted with the answer, in the transaction with the route's writes,
    /// or on its own once they rolled back (an answer stored without them, `pending`).
    /// A key recorded meanwhile by another request is answered from its record.
    pub(super) async fn record_new(
        &self,
        request: &ClaimRequest,
        mut tx: Transaction<'static, Postgres>,
        verdict: Verdict,
        response: Response,
    ) -> Response {
        let (shared, label) = (&self.shared, &self.keyed.label);
        if let Verdict::Pending {
            external_ref,
            error,
        } = verdict
        {
            let stored = StoredError {
                kind: "uncertain",
                error: &error,
            };
            let record = NewRecord {
                request,
                status: Status::Pending,
                retryable: false,
                result: None,
                error: Some(stored.to_json()),
                external_ref,
            };
            // The route's answer (502) either way: with nothing stored a retry runs
            // afresh, and another request's record decides the next one.
            match self.record_alone(tx, &record).await {
                Ok(true) => {}
                Ok(false) => debug!("the key was recorded by another request first"),
                Err(e) => warn!(error = %e.describe(), "cannot record an uncertain outcome"),
            }
            return answered(label, "uncertain", response);
        }
        let (parts, bytes, stored) = match stored_answer(shared, response).await {
            Ok(answer) => answer,
            Err(detail) => {
                rollback(tx).await;
                return too_large(label, &detail);
            }
        };
        let record = NewRecord {
            request,
            status: Status::Completed,
            retryable: false,
            result: Some(stored),
            error: None,
            external_ref: None,
        };
        let inserted = if verdict == Verdict::Store {
            match shared.store.insert_one_in(&mut tx, &record).await {
                Ok(true) => return self.commit(tx, parts, bytes).await,
                inserted => {
                    rollback(tx).await;
                    inserted
                }
            }
        } else {
            self.record_alone(tx, &record).await
        };
        match inserted {
            Ok(true) => answered(
                label,
                "executed",
                Response::from_parts(parts, Body::from(bytes)),
            ),
            Ok(false) => self.answer_from_record(request).await,
            // It waited for another request's uncommitted claim of the key as long as
            // a run may take.
            Err(error) if waited_too_long(&error) => {
                from_record(Answer::InProgress, &self.route, &self.keyed)
            }
            Err(error) => store_unavailable(label, "cannot record the answer", &error),
        }
    }

    /// Writes the record of an answer that goes without the route's writes (a
    /// permanent error's, `pending`) while the key's lock is still held: in a
    /// transaction of its own on a second connection, committed before the request's
    /// own rolls back and lets a waiting repeat in, which then finds the record and does
    /// not run. With no second connection within [`SECOND_CONNECTION`] (a pool taken by
    /// requests that all wait for one), it is written after the rollback, and a repeat
    /// that takes the lock in between may run (one of the two then finds the other's
    /// record). False when another request recorded the key first.
    async fn record_alone(
        &self,
        tx: Transaction<'static, Postgres>,
        record: &NewRecord<'_>,
    ) -> Result<bool, StoreError> {
        let second = tokio::time::timeout(SECOND_CONNECTION, begin(&self.shared, &self.route));
        if let Ok(Ok(alone)) = second.await {
            let written = self.write_alone(alone, record).await;
            rollback(tx).await;
            return written;
        }
        rollback(tx).await;
        let alone = begin(&self.shared, &self.route).await?;
        self.write_alone(alone, record).await
    }

    /// Inserts `record` in `alone` and commits it (false: the key had one already).
    async fn write_alone(
        &self,
        mut alone: Transaction<'static, Postgres>,
        record: &NewRecord<'_>,
    ) -> Result<bool, StoreError> {
        match self.shared.store.insert_one_in(&mut alone, record).await {
            Ok(true) => {
                failpoint::hit("http-single-before-commit");
                alone.commit().await?;
                failpoint::hit("http-single-after-commit");
                Ok(true)
            }
            other => {
                rollback(alone).await;
                other
            }
        }
    }

    /// Answers a request whose new record another request wrote first (one in the
    /// default mode, or one whose commit this one's first look just missed) from that
    /// record, as a repeat would be answered; a key it could take (free again) is
    /// answered as in progress, for a retry that runs it.
    async fn answer_from_record(&self, request: &ClaimRequest) -> Response {
        match self.recorded_answer(request).await {
            Some(answer) => answer,
            None => from_record(Answer::InProgress, &self.route, &self.keyed),
        }
    }

    /// The answer the key's record gives, as a repeat would get it; `None` when the
    /// record does not decide (no record, or one this request could take). The claim
    /// that reads it runs in a transaction rolled back before the answer.
    pub(super) async fn recorded_answer(&self, request: &ClaimRequest) -> Option<Response> {
        let (store, label) = (&self.shared.store, &self.keyed.label);
        let mut tx = match begin(&self.shared, &self.route).await {
            Ok(tx) => tx,
            Err(error) => return Some(store_unavailable(label, "cannot read the record", &error)),
        };
        let reconciles = self.route.reconcile.is_some();
        let claim = store
            .claim_request_in(
                &mut tx,
                &request.key,
                &request.fingerprint,
                &request.origin,
                reconciles,
            )
            .await;
        // Nothing of it stays, and a row it took is free again before the answer.
        rollback(tx).await;
        match claim.map(decision::on_claim) {
            Ok(Next::Answer(answer)) => Some(from_record(answer, &self.route, &self.keyed)),
            Ok(_) => None,
            Err(error) if waited_too_long(&error) => {
                Some(from_record(Answer::InProgress, &self.route, &self.keyed))
            }
            Err(error) => Some(store_unavailable(label, "cannot read the record", &error)),
        }
    }
}
