//! Erasure by subject: what idem stored about a scope (or one key of it) goes, the
//! records stay as tombstones that still decide every redelivery, and the erasure is
//! written down (docs/DESIGN.md, "Data protection").

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::store::{Store, StoreError};

/// The records an erasure may touch (alias `p`): finished ones. A record in flight or
/// `pending` keeps what its run or its reconciliation needs (its provider reference),
/// and a retryable failure will run again: they are counted as skipped, to erase once
/// they are settled.
const FINISHED: &str = "(p.status = 'completed' OR (p.status = 'failed' AND NOT p.retryable))";

/// A key's digest as [`crate::Key::digest`] computes it, from the record `p`: the
/// `source` of its follow-up messages.
const DIGEST: &str = "encode(sha256(
       int8send(octet_length(p.scope)::bigint) || convert_to(p.scope, 'UTF8')
    || int8send(octet_length(p.operation)::bigint) || convert_to(p.operation, 'UTF8')
    || int8send(octet_length(p.idempotency_key)::bigint)
    || convert_to(p.idempotency_key, 'UTF8')), 'hex')";

/// What one erasure did, as written to `erasures`.
#[derive(Debug, Clone, Serialize)]
pub struct Erasure {
    /// Its row in `erasures`.
    pub id: i64,
    /// Records whose result, error and reference were removed (tombstones now).
    pub records: i64,
    /// Follow-up messages (published ones) deleted from the outbox.
    pub follow_ups: i64,
    /// Records left alone because they are in flight, pending or to be retried,
    /// follow-ups not yet published, and deliveries waiting for their entity's turn
    /// (not run yet: docs/DESIGN.md, "Order per entity"): erase again once they are
    /// settled.
    pub skipped: i64,
}

/// One row of `erasures`: who erased what, when and why.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ErasureRecord {
    /// The row's id.
    pub id: i64,
    /// When.
    pub erased_at: DateTime<Utc>,
    /// Who (the operator's name as given).
    pub erased_by: String,
    /// The subject's scope.
    pub scope: String,
    /// The one key erased, or none: the whole scope.
    pub idempotency_key: Option<String>,
    /// Why (a ticket, a request's reference).
    pub note: String,
    /// As in [`Erasure`].
    pub records: i64,
    /// As in [`Erasure`].
    pub follow_ups: i64,
    /// As in [`Erasure`].
    pub skipped: i64,
}

impl Store {
    /// Erases what idem stored about `scope`, or only its `idempotency_key` (of every
    /// operation): results and HTTP answers, errors, provider references, and the
    /// published follow-up messages of those records. The records stay, with their
    /// key and fingerprint, as tombstones: a redelivery is acked and a retried request
    /// answered 410, never run again. `by` and `note` go to the audit row, written in
    /// the same transaction.
    pub async fn erase(
        &self,
        scope: &str,
        idempotency_key: Option<&str>,
        by: &str,
        note: &str,
    ) -> Result<Erasure, StoreError> {
        let mut tx = self.pool().begin().await?;
        // The records are locked first, in a statement of their own: the next one then
        // runs on a snapshot taken after a completion that held a lock committed, and
        // sees the follow-ups it wrote in the same transaction.
        sqlx::query(
            "SELECT 1 FROM processed_operations
             WHERE scope = $1 AND ($2::text IS NULL OR idempotency_key = $2)
             FOR UPDATE",
        )
        .bind(scope)
        .bind(idempotency_key)
        .execute(&mut *tx)
        .await?;
        let (records, follow_ups, skipped): (i64, i64, i64) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "WITH target AS (
                 SELECT p.id, {FINISHED} AS finished, {DIGEST} AS digest
                 FROM processed_operations p
                 WHERE p.scope = $1 AND ($2::text IS NULL OR p.idempotency_key = $2)
             ),
             erased AS (
                 UPDATE processed_operations p
                 SET result = NULL, error = NULL, external_ref = NULL,
                     erased_at = COALESCE(p.erased_at, now()), updated_at = now()
                 FROM target t
                 WHERE p.id = t.id AND t.finished
                 RETURNING t.digest
             ),
             follow_ups AS (
                 DELETE FROM outbox_messages o
                 USING erased e
                 WHERE o.source = e.digest AND o.dispatched_at IS NOT NULL
                 RETURNING o.id
             ),
             waiting AS (
                 SELECT count(*) AS n FROM outbox_messages o JOIN erased e ON o.source = e.digest
                 WHERE o.dispatched_at IS NULL
             ),
             not_run AS (
                 SELECT count(*) AS n FROM ordering_waiting w
                 WHERE w.scope = $1 AND ($2::text IS NULL OR w.idempotency_key = $2)
                   -- A delivery handed its turn and running has a record, counted above.
                   AND NOT EXISTS (SELECT 1 FROM target t JOIN processed_operations p ON p.id = t.id
                                    WHERE p.operation = w.operation
                                      AND p.idempotency_key = w.idempotency_key)
             )
             SELECT (SELECT count(*) FROM erased),
                    (SELECT count(*) FROM follow_ups),
                    (SELECT count(*) FROM target WHERE NOT finished) + (SELECT n FROM waiting)
                        + (SELECT n FROM not_run)"
            )))
            .bind(scope)
            .bind(idempotency_key)
            .fetch_one(&mut *tx)
            .await?;
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO erasures
                 (erased_by, scope, idempotency_key, note, records, follow_ups, skipped)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             RETURNING id",
        )
        .bind(by)
        .bind(scope)
        .bind(idempotency_key)
        .bind(note)
        .bind(records)
        .bind(follow_ups)
        .bind(skipped)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Erasure {
            id,
            records,
            follow_ups,
            skipped,
        })
    }
}

/// The latest `limit` erasures, newest first, optionally of one scope only.
pub async fn erasures(
    pool: &PgPool,
    scope: Option<&str>,
    limit: i64,
) -> Result<Vec<ErasureRecord>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT * FROM erasures WHERE $1::text IS NULL OR scope = $1
         ORDER BY id DESC LIMIT $2",
    )
    .bind(scope)
    .bind(limit)
    .fetch_all(pool)
    .await?)
}
