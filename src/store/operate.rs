//! Operator writes and reads: inspect records, release leases, prepare replays, record
//! discards, and delete expired records (docs/DESIGN.md, "Retention" and "Replay").

use std::time::{Duration, Instant};

use sqlx::AssertSqlSafe;
use sqlx::Postgres;
use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;

use super::record::{Record, Status, storable};
use super::{Store, StoreError, millis};
use crate::key::Key;
use crate::metrics;

/// One dead letter fewer may wait: the record stays pinned while any is left, and
/// `dead_lettered_at` goes with the last.
const ONE_LETTER_FEWER: &str = "dead_letters = greatest(dead_letters - 1, 0),
     dead_lettered_at = CASE WHEN dead_letters > 1 THEN dead_lettered_at END";

/// [`ONE_LETTER_FEWER`] when `$4` (a letter that pinned the record is replayed), nothing
/// fewer otherwise (a letter that pins nothing: an `undecidable` one).
const LETTERS_FEWER_BY_4: &str = "dead_letters = greatest(dead_letters - $4::int, 0),
     dead_lettered_at = CASE WHEN dead_letters > $4::int THEN dead_lettered_at END";

impl Store {
    /// Pins the record for a dead letter about to be published: one more letter may
    /// wait in the DLQ. Counted before the publish, so a crash between the two leaves a
    /// pin too many (the record is kept), never a letter whose record gc may delete.
    /// Not fenced: it records where a message is, not an outcome.
    pub(crate) async fn pin(&self, id: i64) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE processed_operations SET dead_letters = dead_letters + 1, updated_at = now()
             WHERE id = $1",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Takes back the pin of a dead letter the broker refused (no queue holds it).
    pub(crate) async fn unpin_refused(&self, id: i64) -> Result<(), StoreError> {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE processed_operations SET {ONE_LETTER_FEWER}, updated_at = now()
             WHERE id = $1 AND dead_letters > 0"
        )))
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Notes that the operation's dead letter now waits in the DLQ (published with a
    /// confirm): a later duplicate of a failure is then acked, not dead-lettered again.
    pub(crate) async fn mark_dead_lettered(&self, id: i64) -> Result<(), StoreError> {
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
    /// before it runs), the replay is counted on the record, and, when the replayed
    /// letter is one that pinned the record (`letter_pins`), its pin is taken away (an
    /// unfinished record has no expiry, so this cannot let retention delete it; another
    /// letter of the key keeps its own pin). Returns the record as it is now, or `None`
    /// if there is none or it is completed.
    pub(crate) async fn prepare_replay(
        &self,
        key: &Key,
        letter_pins: bool,
    ) -> Result<Option<Record>, StoreError> {
        Ok(record_by_key(
            AssertSqlSafe(format!(
                "UPDATE processed_operations
                 SET retryable = (status = 'failed') OR retryable, {LETTERS_FEWER_BY_4},
                     discarded_at = NULL, replay_count = replay_count + 1,
                     last_replayed_at = now(), updated_at = now()
                 WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
                   AND status <> 'completed'
                 RETURNING *"
            )),
            key,
        )
        .bind(i32::from(letter_pins))
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Notes that one of the operation's dead letters left the DLQ, so that retention
    /// may expire the record again once none is left. Call it only after the dead
    /// letter is acked: a completed record unpinned while its dead letter still waits
    /// could expire before a replay, and the replay would then run the effect again.
    pub(crate) async fn unpin(&self, key: &Key) -> Result<(), StoreError> {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE processed_operations SET {ONE_LETTER_FEWER}, updated_at = now()
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
               AND dead_letters > 0"
        )))
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.idempotency_key())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records an operator's decision to discard one of the operation's dead letters:
    /// its pin is taken away, the record expires after the retention like a completed
    /// one (gc keeps it while another letter pins it), and a later duplicate of a failed
    /// operation is acked, not run or dead-lettered again (a retryable failure stops
    /// being retryable). A `pending` record never expires: once deleted, a duplicate
    /// would run without being reconciled. Only a pinned record is touched: a letter
    /// its record does not count (one a producer published into the DLQ itself,
    /// naming someone else's key) changes nothing. Like [`Store::unpin`], call it only
    /// after the dead letter is acked.
    pub(crate) async fn discard(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        Ok(record_by_key(
            AssertSqlSafe(format!(
                "UPDATE processed_operations
                 SET discarded_at = now(), {ONE_LETTER_FEWER}, updated_at = now(),
                     retryable = CASE WHEN status = 'failed' THEN false ELSE retryable END,
                     expires_at = CASE WHEN status = 'pending' THEN expires_at
                         ELSE COALESCE(expires_at, now() + $4::bigint * interval '1 millisecond')
                     END
                 WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
                   AND dead_letters > 0
                 RETURNING *"
            )),
            key,
        )
        .bind(millis(self.config.retention))
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Expires the lease of a `processing` record by hand (its worker is known to be
    /// dead): the next delivery takes it over with a new fencing token, so the dead
    /// worker could not write an outcome even if it came back. A `pending` record is
    /// not released: a lease on it is a reconciler's, which lapses on its own, and one
    /// released by hand would keep [`Store::resolve_not_applied`] from ever settling
    /// it (no request of a route without a reconciler takes it back). `None` when
    /// there is no `processing` record.
    pub async fn release(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        Ok(record_by_key(
            "UPDATE processed_operations
             SET lease_expires_at = now(), updated_at = now()
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
               AND status = 'processing'
             RETURNING *",
            key,
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Settles by hand an operation whose outcome was uncertain, once an operator has
    /// checked with the provider that the effect did **not** happen: a `pending`
    /// record, or a failed one waiting to be reconciled, becomes a retryable failure
    /// that is no longer reconciled first, so the next delivery or request runs it
    /// again. Its error keeps the operator's `note`, the error it had and the provider
    /// reference that was checked (`external_ref` is cleared: a later uncertain run
    /// must not be reconciled against it); it expires after the retention if nothing
    /// comes (an HTTP client may never ask again).
    ///
    /// This is what a route or handler without a reconciler needs: its pending key
    /// otherwise answers 409 forever. Only the state the operator checked is resolved:
    /// `lease_token` must still be `seen_token` (every claim draws a new one, so a
    /// worker that took the record since, and may have acted, makes this refuse), and
    /// no lease may have been taken on it since it was last settled (a lease, even a
    /// lapsed or released one, means a worker may still be reconciling it: its next
    /// delivery reconciles instead). A discarded operation stays discarded. `None`
    /// when any of this does not hold.
    pub async fn resolve_not_applied(
        &self,
        key: &Key,
        seen_token: i64,
        note: &str,
    ) -> Result<Option<Record>, StoreError> {
        Ok(record_by_key(
            "UPDATE processed_operations
             SET status = 'failed', retryable = true, reconcile_first = false,
                 error = jsonb_build_object(
                     'error', 'resolved by an operator: not applied',
                     'note', $5::text, 'external_ref', external_ref, 'before', error),
                 external_ref = NULL,
                 expires_at = now() + $6::bigint * interval '1 millisecond',
                 updated_at = now()
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
               AND lease_token = $4 AND lease_expires_at IS NULL AND discarded_at IS NULL
               AND (status = 'pending'
                    OR (status = 'failed' AND retryable AND reconcile_first))
             RETURNING *",
            key,
        )
        .bind(seen_token)
        .bind(storable(note).as_ref())
        .bind(millis(self.config.retention))
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Records of `operation` whose next delivery is overdue: a retryable failure or a
    /// pending operation of a message (no expiry), without a dead letter, not
    /// discarded, with no live lease, not updated for `older_than`. Its retry copy
    /// should have brought it back by then; a classic retry queue dead-letters at most
    /// once, so the copy may be lost, and nothing else brings the intent back.
    pub(crate) async fn overdue(
        &self,
        operation: &str,
        older_than: Duration,
    ) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM processed_operations
             WHERE operation = $1 AND expires_at IS NULL AND dead_letters = 0
               AND discarded_at IS NULL
               AND (status = 'pending' OR (status = 'failed' AND retryable))
               AND updated_at <= now() - $2::bigint * interval '1 millisecond'
               AND (lease_expires_at IS NULL OR lease_expires_at <= now())",
        )
        .bind(operation)
        .bind(millis(older_than))
        .fetch_one(&self.pool)
        .await?)
    }

    /// Notes how long `operation`'s completed records are kept, for every completion of
    /// it in any process. A process without a retention of its own for the operation
    /// leaves what another noted (a canary must not shorten it for the fleet).
    pub(crate) async fn note_retention(
        &self,
        operation: &str,
        retention: Option<Duration>,
    ) -> Result<(), StoreError> {
        let Some(retention) = retention else {
            return Ok(());
        };
        sqlx::query(
            "INSERT INTO operation_retention (operation, retention_ms) VALUES ($1, $2)
             ON CONFLICT (operation) DO UPDATE
             SET retention_ms = EXCLUDED.retention_ms, noted_at = now()",
        )
        .bind(operation)
        .bind(millis(retention).max(1))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// How long `operation`'s completed records are kept, if noted.
    pub async fn retention_of(&self, operation: &str) -> Result<Option<Duration>, StoreError> {
        let ms: Option<i64> =
            sqlx::query_scalar("SELECT retention_ms FROM operation_retention WHERE operation = $1")
                .bind(operation)
                .fetch_optional(&self.pool)
                .await?;
        Ok(ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))))
    }

    /// Notes that a worker of `queue` runs `operation` (`queue_operations`), so that
    /// operators' tools know which records belong to which queue.
    pub(crate) async fn note_queue(&self, queue: &str, operation: &str) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO queue_operations (queue, operation) VALUES ($1, $2)
             ON CONFLICT (queue, operation) DO UPDATE SET started_at = now()",
        )
        .bind(queue)
        .bind(operation)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Whether a worker of one of `queues` ever noted that it runs `operation`.
    pub async fn serves(&self, queues: &[String], operation: &str) -> Result<bool, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM queue_operations
                            WHERE queue = ANY($1) AND operation = $2)",
        )
        .bind(queues)
        .bind(operation)
        .fetch_one(&self.pool)
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
        .await?
        .into_iter()
        .map(|r: Record| r.opened(self.keys()))
        .collect())
    }

    /// For each of `keys`, in order, whether its record is `completed`: one statement
    /// for all of them (through the unique index of keys), where [`Store::get`] would
    /// make a round trip each. The console's dead-letter page asks for up to 2,000.
    pub(crate) async fn completed(&self, keys: &[Key]) -> Result<Vec<bool>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (scopes, operations, ids): (Vec<&str>, Vec<&str>, Vec<&str>) = keys
            .iter()
            .map(|k| (k.scope(), k.operation(), k.idempotency_key()))
            .collect();
        let started = Instant::now();
        let done: Vec<bool> = sqlx::query_scalar(
            "SELECT coalesce(p.status = 'completed', false)
             FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS k(s, o, i, n)
             LEFT JOIN processed_operations p
                    ON p.scope = k.s AND p.operation = k.o AND p.idempotency_key = k.i
             ORDER BY k.n",
        )
        .bind(&scopes)
        .bind(&operations)
        .bind(&ids)
        .fetch_all(&self.pool)
        .await?;
        metrics::store_round_trip("completed", started);
        Ok(done)
    }

    /// Loads the record of `key`, if any.
    pub async fn get(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        Ok(record_by_key(
            "SELECT * FROM processed_operations
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3",
            key,
        )
        .fetch_optional(&self.pool)
        .await?
        .map(|r| r.opened(self.keys())))
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
        .await?
        .into_iter()
        .map(|r: Record| r.opened(self.keys()))
        .collect())
    }
}

/// One record addressed by its key: `sql`'s `$1`, `$2` and `$3` are bound to the
/// key's scope, operation and idempotency key.
fn record_by_key<'q>(
    sql: impl sqlx::SqlSafeStr,
    key: &'q Key,
) -> QueryAs<'q, Postgres, Record, PgArguments> {
    sqlx::query_as(sql)
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.idempotency_key())
}
