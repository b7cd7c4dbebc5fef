//! Fenced writes: the lease holder extends its lease and records the outcome. Every
//! write names the record's id and the lease's fencing token, so a worker whose lease
//! was taken over writes nothing (docs/DESIGN.md, "Vocabulary": lease).

use std::collections::HashSet;
use std::sync::LazyLock;
use std::time::Instant;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgExecutor;

use super::record::{Lease, storable};
use super::{Store, StoreError, millis};
use crate::metrics;
use crate::protect::{self, Kind};

/// The lease still owns the record: the condition of every fenced write on one row
/// (`$1` id, `$2` token).
const FENCED: &str = "id = $1 AND lease_token = $2 AND status IN ('processing', 'pending')";

/// How long a record of `table`'s row (an alias or the table's name) is kept, in
/// milliseconds: its operation's own retention (`operation_retention`), else the
/// store's from `default`.
pub(super) fn retention_of(operation: &str, default: &str) -> String {
    format!(
        "COALESCE((SELECT r.retention_ms FROM operation_retention r
                   WHERE r.operation = {operation}), {default}::bigint)"
    )
}

/// What a success writes, with the stored result taken from `result` and the store's
/// retention in milliseconds from `$4`; `table` names the updated row.
fn completed_set(table: &str, result: &str) -> String {
    let retention = retention_of(&format!("{table}.operation"), "$4");
    format!(
        "SET status = 'completed', result = {result}, error = NULL, retryable = false,
             lease_expires_at = NULL, completed_at = now(), updated_at = now(),
             expires_at = now() + {retention} * interval '1 millisecond'"
    )
}

static COMPLETE_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE processed_operations {} WHERE {FENCED}",
        completed_set("processed_operations", "$3")
    )
});

/// Many successes in one statement, each fenced by its own lease; rows are updated in
/// id order, so concurrent batches cannot deadlock.
static COMPLETE_MANY_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE processed_operations p {}
         FROM (SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::jsonb[])
               AS u(id, token, result) ORDER BY id) t
         WHERE p.id = t.id AND p.lease_token = t.token
           AND p.status IN ('processing', 'pending')
         RETURNING p.id, p.lease_token",
        completed_set("p", "t.result")
    )
});

/// Extends the lease by `$3` milliseconds.
static HEARTBEAT_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE processed_operations
         SET lease_expires_at = now() + $3::bigint * interval '1 millisecond'
         WHERE {FENCED}
         RETURNING lease_expires_at"
    )
});

/// A failure: retryable (`$3`) or not, with the stored error `$4`; `$5` when the
/// effect may have happened, so the operation is reconciled before it runs again (a
/// record that was ever uncertain stays so).
static FAIL_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE processed_operations
         SET status = 'failed', retryable = $3, error = $4,
             reconcile_first = reconcile_first OR $5,
             lease_expires_at = NULL, updated_at = now()
         WHERE {FENCED}"
    )
});

/// A failure that leaves the key free for a retry, with the stored error `$3`, that
/// expires after `$4` ms if no retry comes (an HTTP request that failed: unlike a
/// message, nothing is bound to bring it back), unless it was ever uncertain: that one
/// is reconciled before it runs again, and never expires.
#[cfg(feature = "http")]
static FAIL_EXPIRING_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE processed_operations
         SET status = 'failed', retryable = true, error = $3, lease_expires_at = NULL,
             expires_at = CASE WHEN reconcile_first THEN NULL
                               ELSE now() + {} * interval '1 millisecond' END,
             updated_at = now()
         WHERE {FENCED}",
        retention_of("processed_operations.operation", "$4")
    )
});

/// Gives a lease back with nothing written but the lease: the claim did not count as an
/// attempt (a `pending` HTTP key, which no reconciler serves, stays as it was).
#[cfg(feature = "http")]
static GIVE_BACK_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE processed_operations
         SET lease_expires_at = NULL, attempts = attempts - 1, updated_at = now()
         WHERE {FENCED}"
    )
});

/// An uncertain outcome with the provider's reference `$3` and the stored error `$4`;
/// the lease is given up, and the operation is marked to be reconciled before it may
/// ever run again. It never expires (an HTTP request's record had an expiry): deleted,
/// a repeat would run without being reconciled.
static PENDING_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE processed_operations
         SET status = 'pending', external_ref = COALESCE($3, external_ref), error = $4,
             retryable = false, reconcile_first = true, lease_expires_at = NULL,
             expires_at = NULL, updated_at = now()
         WHERE {FENCED}"
    )
});

impl Store {
    /// Extends the lease by the configured lease time (heartbeat) while a handler runs.
    /// Returns the new expiry, or [`StoreError::LeaseLost`] if another worker took over.
    pub(crate) async fn heartbeat(&self, lease: &Lease) -> Result<DateTime<Utc>, StoreError> {
        let started = Instant::now();
        let expires: Option<DateTime<Utc>> = sqlx::query_scalar(HEARTBEAT_SQL.as_str())
            .bind(lease.id)
            .bind(lease.token)
            .bind(millis(self.config.lease))
            .fetch_optional(&self.pool)
            .await?;
        metrics::store_round_trip("heartbeat", started);
        expires.ok_or(StoreError::LeaseLost { token: lease.token })
    }

    /// Records success with `result`, if `lease` still owns the record. The record
    /// expires after the configured retention.
    #[cfg(any(test, feature = "http"))]
    pub(crate) async fn complete(&self, lease: &Lease, result: &Value) -> Result<(), StoreError> {
        self.complete_in(&self.pool, lease, result).await
    }

    /// Records success inside the caller's transaction (or on any executor), so the
    /// caller's own writes and the `completed` record commit or roll back together.
    ///
    /// On [`StoreError::LeaseLost`] the caller must roll its transaction back: another
    /// worker owns the operation now. The row lock taken here is held until the caller
    /// commits, so a concurrent takeover waits for the commit and then sees `completed`.
    pub(crate) async fn complete_in<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        lease: &Lease,
        result: &Value,
    ) -> Result<(), StoreError> {
        let result = protect::seal_json(self.keys(), Kind::Result, result);
        let started = Instant::now();
        let done = sqlx::query(COMPLETE_SQL.as_str())
            .bind(lease.id)
            .bind(lease.token)
            .bind(&result)
            .bind(millis(self.config.retention))
            .execute(executor)
            .await?;
        metrics::store_round_trip("complete", started);
        fenced(done.rows_affected(), lease)
    }

    /// Records many successes in one statement, each fenced by its own lease: returns,
    /// in order, whether each lease still owned its record (false: lease lost, nothing
    /// written for it). A lease is matched by its id *and* token.
    pub(crate) async fn complete_many(
        &self,
        items: &[(Lease, Value)],
    ) -> Result<Vec<bool>, StoreError> {
        let ids: Vec<i64> = items.iter().map(|(lease, _)| lease.id).collect();
        let tokens: Vec<i64> = items.iter().map(|(lease, _)| lease.token).collect();
        let results: Vec<Value> = items
            .iter()
            .map(|(_, result)| protect::seal_json(self.keys(), Kind::Result, result))
            .collect();
        let started = Instant::now();
        // In a transaction of its own: an unnamed statement is parsed and executed in
        // two exchanges, which a transaction pooler keeps on one server connection only
        // inside a transaction.
        let mut tx = self.pool.begin().await?;
        let done: Vec<(i64, i64)> = sqlx::query_as(COMPLETE_MANY_SQL.as_str())
            // Planned on every run, with the real array sizes: a generic plan cached
            // while the table was small hash-joins against a full scan of it.
            .persistent(false)
            .bind(&ids)
            .bind(&tokens)
            .bind(&results)
            .bind(millis(self.config.retention))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        metrics::store_round_trip("complete_many", started);
        let done: HashSet<(i64, i64)> = done.into_iter().collect();
        Ok(items
            .iter()
            .map(|(lease, _)| done.contains(&(lease.id, lease.token)))
            .collect())
    }

    /// Records a failure, if `lease` still owns the record. A `retryable` failure may be
    /// claimed again by a later delivery; a failure for good never runs again unless
    /// replayed. `uncertain` says the effect may have happened all the same (the
    /// handler returned, but its result could not be stored): then, as for an operation
    /// that was ever `pending`, the next run of it starts with `reconcile`.
    pub(crate) async fn fail(
        &self,
        lease: &Lease,
        retryable: bool,
        error: &Value,
        uncertain: bool,
    ) -> Result<(), StoreError> {
        self.fail_in(&self.pool, lease, retryable, error, uncertain)
            .await
    }

    /// [`Store::fail`] on any executor (the batch's transaction in transactional mode).
    pub(crate) async fn fail_in<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        lease: &Lease,
        retryable: bool,
        error: &Value,
        uncertain: bool,
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        let done = sqlx::query(FAIL_SQL.as_str())
            .bind(lease.id)
            .bind(lease.token)
            .bind(retryable)
            .bind(error)
            .bind(uncertain)
            .execute(executor)
            .await?;
        metrics::store_round_trip("fail", started);
        fenced(done.rows_affected(), lease)
    }

    /// Records a failure that leaves the key free for a retry and expires the record
    /// after the retention if none comes, if `lease` still owns the record.
    #[cfg(feature = "http")]
    pub(crate) async fn fail_expiring(
        &self,
        lease: &Lease,
        error: &Value,
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        let done = sqlx::query(FAIL_EXPIRING_SQL.as_str())
            .bind(lease.id)
            .bind(lease.token)
            .bind(error)
            .bind(millis(self.config.retention))
            .execute(&self.pool)
            .await?;
        metrics::store_round_trip("fail", started);
        fenced(done.rows_affected(), lease)
    }

    /// Gives `lease` back unused: the record keeps its status and outcome, its lease
    /// lapses now, and the claim is not counted as an attempt.
    #[cfg(feature = "http")]
    pub(crate) async fn give_back(&self, lease: &Lease) -> Result<(), StoreError> {
        let started = Instant::now();
        let done = sqlx::query(GIVE_BACK_SQL.as_str())
            .bind(lease.id)
            .bind(lease.token)
            .execute(&self.pool)
            .await?;
        metrics::store_round_trip("give_back", started);
        fenced(done.rows_affected(), lease)
    }

    /// Records an uncertain outcome with the provider's reference, if `lease` still owns
    /// the record, and gives the lease up: the next delivery reconciles instead of
    /// re-running.
    pub(crate) async fn mark_pending(
        &self,
        lease: &Lease,
        external_ref: Option<&str>,
        error: &Value,
    ) -> Result<(), StoreError> {
        self.mark_pending_in(&self.pool, lease, external_ref, error)
            .await
    }

    /// [`Store::mark_pending`] on any executor.
    pub(crate) async fn mark_pending_in<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        lease: &Lease,
        external_ref: Option<&str>,
        error: &Value,
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        let done =
            sqlx::query(PENDING_SQL.as_str())
                .bind(lease.id)
                .bind(lease.token)
                .bind(external_ref.map(|r| {
                    protect::seal_text(self.keys(), Kind::Reference, storable(r).as_ref())
                }))
                .bind(error)
                .execute(executor)
                .await?;
        metrics::store_round_trip("mark_pending", started);
        fenced(done.rows_affected(), lease)
    }
}

fn fenced(rows: u64, lease: &Lease) -> Result<(), StoreError> {
    if rows == 1 {
        Ok(())
    } else {
        Err(StoreError::LeaseLost { token: lease.token })
    }
}
