//! Operator writes and reads: inspect records, release leases, prepare replays, record
//! discards, and delete expired records (docs/DESIGN.md, "Retention" and "Replay").

use std::time::{Duration, Instant};

use sqlx::Postgres;
use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;

use super::record::{Record, Status};
use super::{Store, StoreError, millis};
use crate::key::Key;
use crate::metrics;

impl Store {
    /// Notes that the operation's message now waits in the DLQ (published with a
    /// confirm). Not fenced: it records where the message is, not an outcome.
    #[doc(hidden)]
    pub async fn mark_dead_lettered(&self, id: i64) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE processed_operations SET dead_lettered_at = now(), updated_at = now()
             WHERE id = $1",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Takes a dead-lettered operation that is not completed back for a replay: a
    /// `failed` record becomes retryable (one that was ever uncertain is reconciled
    /// before it runs), the replay is counted on the record, and the record is unpinned (an unfinished record has no expiry, so this cannot let
    /// retention delete it). Returns the record as it is now, or `None` if there is
    /// none or it is completed.
    pub async fn prepare_replay(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        Ok(record_by_key(
            "UPDATE processed_operations
             SET retryable = (status = 'failed') OR retryable, dead_lettered_at = NULL,
                 discarded_at = NULL,
                 replay_count = replay_count + 1, last_replayed_at = now(), updated_at = now()
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
               AND status <> 'completed'
             RETURNING *",
            key,
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Notes that the operation's dead letter left the DLQ, so retention may expire the
    /// record again. Call it only after the dead letter is acked: a completed record
    /// unpinned while its dead letter still waits could expire before a replay, and the
    /// replay would then run the effect again.
    pub async fn unpin(&self, key: &Key) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE processed_operations SET dead_lettered_at = NULL, updated_at = now()
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
               AND dead_lettered_at IS NOT NULL",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.idempotency_key())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records an operator's decision to discard the operation's dead letter: the
    /// record is unpinned and expires after the retention like a completed one, and a
    /// later duplicate of a failed operation is acked, not dead-lettered again. Like
    /// [`Store::unpin`], call it only after the dead letter is acked.
    pub async fn discard(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        Ok(record_by_key(
            "UPDATE processed_operations
             SET discarded_at = now(), dead_lettered_at = NULL, updated_at = now(),
                 expires_at = COALESCE(expires_at, now() + $4::bigint * interval '1 millisecond')
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
             RETURNING *",
            key,
        )
        .bind(millis(self.config.retention))
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Expires the lease of a `processing` or `pending` record by hand (its worker is
    /// known to be dead): the next delivery takes it over with a new fencing token, so
    /// the dead worker could not write an outcome even if it came back.
    pub async fn release(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        Ok(record_by_key(
            "UPDATE processed_operations
             SET lease_expires_at = now(), updated_at = now()
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
               AND status IN ('processing', 'pending')
             RETURNING *",
            key,
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Records in `status` not updated for `older_than`, oldest first.
    pub async fn list(
        &self,
        status: Status,
        older_than: Duration,
        limit: i64,
    ) -> Result<Vec<Record>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT * FROM processed_operations
             WHERE status = $1 AND updated_at <= now() - $2::bigint * interval '1 millisecond'
             ORDER BY updated_at
             LIMIT $3",
        )
        .bind(status)
        .bind(millis(older_than))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Deletes up to `batch` expired records that no dead letter pins, in one short
    /// statement. Rows locked by a worker at that moment are skipped, never waited for.
    pub async fn gc_batch(&self, batch: i64) -> Result<u64, StoreError> {
        let started = Instant::now();
        let done = sqlx::query(
            "DELETE FROM processed_operations
             WHERE id IN (
                 SELECT id FROM processed_operations
                 WHERE expires_at <= now() AND dead_lettered_at IS NULL
                 ORDER BY expires_at
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED)",
        )
        .bind(batch)
        .execute(&self.pool)
        .await?;
        metrics::store_round_trip("gc", started);
        metrics::gc_deleted(done.rows_affected());
        Ok(done.rows_affected())
    }

    /// Deletes every expired, unpinned record, `batch` rows per short transaction, until
    /// none is left; returns how many. Safe beside running workers.
    pub async fn gc(&self, batch: i64) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let deleted = self.gc_batch(batch).await?;
            total += deleted;
            if deleted < batch.max(1) as u64 {
                return Ok(total);
            }
        }
    }

    /// Loads the record of `key`, if any.
    pub async fn get(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        Ok(record_by_key(
            "SELECT * FROM processed_operations
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3",
            key,
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The records in `scope` and `operation` whose key has this short hash (the 12 hex
    /// digits that logs and dead letters show, see [`Key::short_hash`]). Usually one;
    /// more only if two keys share the first 48 bits of their digest.
    pub async fn find_by_short_hash(
        &self,
        scope: &str,
        operation: &str,
        short_hash: &str,
    ) -> Result<Vec<Record>, StoreError> {
        // The digest of Key::digest, computed by Postgres: each part prefixed by its
        // length in bytes as a big-endian u64.
        Ok(sqlx::query_as(
            "SELECT * FROM processed_operations
             WHERE scope = $1 AND operation = $2
               AND left(encode(sha256(
                     int8send(octet_length(scope)::bigint) || convert_to(scope, 'UTF8')
                  || int8send(octet_length(operation)::bigint) || convert_to(operation, 'UTF8')
                  || int8send(octet_length(idempotency_key)::bigint)
                  || convert_to(idempotency_key, 'UTF8')), 'hex'), 12) = lower($3)
             ORDER BY id",
        )
        .bind(scope)
        .bind(operation)
        .bind(short_hash)
        .fetch_all(&self.pool)
        .await?)
    }
}

/// One record addressed by its key: `sql`'s `$1`, `$2` and `$3` are bound to the
/// key's scope, operation and idempotency key.
fn record_by_key<'q>(sql: &'q str, key: &'q Key) -> QueryAs<'q, Postgres, Record, PgArguments> {
    sqlx::query_as(sql)
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.idempotency_key())
}
