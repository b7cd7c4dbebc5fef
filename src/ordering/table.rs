//! The ordering statements: entering deliveries (`idem_ordering_enter`), releasing the
//! next turn (`idem_ordering_release`), the sweep, and what operators read and do.

use std::time::Duration;

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use sqlx::PgPool;

use super::{Ordered, Position, Skipped};
use crate::db::millis;
use crate::key::Key;
use crate::protect::{self, Keys};
use crate::store::StoreError;

/// One delivery entering its entity's order: who it is, and what to keep if it waits.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) key: Key,
    pub(crate) ordered: Ordered,
    /// Its fingerprint's hex, and the one under the previous key (key rotation).
    pub(crate) fingerprint: String,
    pub(crate) also: Option<String>,
    pub(crate) queue: String,
    pub(crate) body: Vec<u8>,
    /// Its AMQP properties, as [`stored_properties`] keeps them.
    pub(crate) properties: Vec<u8>,
}

/// Where a delivery stands, as `idem_ordering_enter` decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Its turn (or its record decides: a completed one is a duplicate).
    Run,
    /// Parked until its turn: ack it.
    Wait,
    /// A copy of one already parked: ack it.
    Waiting,
    /// Its number is behind the position (run, or skipped).
    Passed,
    /// Another message holds or waits with its number.
    Taken,
    /// Its key waits with another payload.
    Conflict,
}

/// The decision for one entry, and its sequence number (assigned on arrival when the
/// message has none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entered {
    pub(crate) gate: Gate,
    pub(crate) seq: Option<i64>,
}

/// A delivery whose turn came (it holds the turn now): run in the process that released
/// it, or published to its queue again.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Released {
    pub(crate) scope: String,
    pub(crate) ordering_key: String,
    pub(crate) seq: i64,
    pub(crate) operation: String,
    pub(crate) idempotency_key: String,
    /// Whether it holds the turn (else its turn passed while it waited: its copy is
    /// dead-lettered `sequence_passed`).
    pub(crate) turn: bool,
    pub(crate) queue: String,
    pub(crate) body: Vec<u8>,
    pub(crate) properties: BasicProperties,
}

/// How long a released delivery may take to come back and take its turn before a
/// sweep publishes it again (its publish may have been lost with a connection, or its
/// worker killed while it ran the turn in process), doubling at each release. Its
/// entity waits meanwhile; a copy published too early is a duplicate its record
/// decides (a leased run that claimed is not republished under its live lease).
pub(crate) const RELEASE_STALE: Duration = Duration::from_secs(1);

/// Enters the deliveries that arrived together, one round trip; answers in the order of
/// `entries`.
pub(crate) async fn enter(
    pool: &PgPool,
    keys: Option<&Keys>,
    entries: &[Entry],
) -> Result<Vec<Entered>, StoreError> {
    let mut columns = Columns::default();
    for e in entries {
        columns.push(e, keys)?;
    }
    let rows: Vec<(i32, String, Option<i64>)> = sqlx::query_as(
        "SELECT item, verdict, seq FROM idem_ordering_enter(
            $1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::text[], $6::text[],
            $7::text[], $8::text[], $9::text[], $10::bytea[], $11::bytea[])",
    )
    .bind(columns.scope)
    .bind(columns.ordering_key)
    .bind(columns.seq)
    .bind(columns.first)
    .bind(columns.operation)
    .bind(columns.idempotency_key)
    .bind(columns.fingerprint)
    .bind(columns.also)
    .bind(columns.queue)
    .bind(columns.body)
    .bind(columns.properties)
    .fetch_all(pool)
    .await?;
    let mut answers = vec![None; entries.len()];
    for (item, verdict, seq) in rows {
        let gate = match verdict.as_str() {
            "run" => Gate::Run,
            "wait" => Gate::Wait,
            "waiting" => Gate::Waiting,
            "passed" => Gate::Passed,
            "taken" => Gate::Taken,
            "conflict" => Gate::Conflict,
            other => return Err(StoreError::UnknownClaimRow(other.into())),
        };
        let slot = usize::try_from(item - 1)
            .ok()
            .and_then(|i| answers.get_mut(i));
        if let Some(slot) = slot {
            *slot = Some(Entered { gate, seq });
        }
    }
    answers
        .into_iter()
        .map(|a| a.ok_or_else(|| StoreError::UnknownClaimRow("an entry without a verdict".into())))
        .collect()
}

/// The columns of `idem_ordering_enter`'s arrays.
#[derive(Default)]
struct Columns {
    scope: Vec<String>,
    ordering_key: Vec<String>,
    seq: Vec<Option<i64>>,
    first: Vec<i64>,
    operation: Vec<String>,
    idempotency_key: Vec<String>,
    fingerprint: Vec<String>,
    also: Vec<Option<String>>,
    queue: Vec<String>,
    body: Vec<Vec<u8>>,
    properties: Vec<Vec<u8>>,
}

impl Columns {
    fn push(&mut self, e: &Entry, keys: Option<&Keys>) -> Result<(), StoreError> {
        self.scope.push(e.key.scope().to_owned());
        self.ordering_key.push(e.ordered.key.clone());
        self.seq.push(e.ordered.sequence);
        self.first.push(e.ordered.first);
        self.operation.push(e.key.operation().to_owned());
        self.idempotency_key
            .push(e.key.idempotency_key().to_owned());
        self.fingerprint.push(e.fingerprint.clone());
        self.also.push(e.also.clone());
        self.queue.push(e.queue.clone());
        self.body.push(protect::seal_body(keys, &e.body));
        self.properties.push(e.properties.clone());
        Ok(())
    }
}

/// `properties` as kept in `ordering_waiting`: JSON that must read back as the same
/// properties (a header float that is not a number would not), or the message is
/// refused as malformed before it is acked. Properties not set are left out (they read
/// back as not set): a message sets a few of the 14, and the nulls of
/// the others made up 225 of a parked row's 571 bytes on the ordering bench.
pub(crate) fn stored_properties(properties: &BasicProperties) -> Result<Vec<u8>, String> {
    let refused =
        |why: String| format!("the message's properties cannot be kept while it waits: {why}");
    let mut json = serde_json::to_value(properties).map_err(|e| refused(e.to_string()))?;
    if let serde_json::Value::Object(fields) = &mut json {
        fields.retain(|_, value| !value.is_null());
    }
    let bytes = serde_json::to_vec(&json).map_err(|e| refused(e.to_string()))?;
    match serde_json::from_slice::<BasicProperties>(&bytes) {
        Ok(back) if &back == properties => Ok(bytes),
        Ok(_) => Err(refused("they do not read back the same".into())),
        Err(e) => Err(refused(e.to_string())),
    }
}

pub(crate) type WaitingRow = (
    String,
    String,
    i64,
    String,
    String,
    String,
    Vec<u8>,
    Vec<u8>,
    bool,
);

/// Moves the positions of `entities` on past completed holders and releases the
/// deliveries whose turn came. `in_commit`: on the transaction that completes the
/// holder (its commit makes the move and the hand-off true with the completion);
/// otherwise a statement of its own, committed without waiting for the WAL flush.
pub(crate) async fn release<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    keys: Option<&Keys>,
    entities: &[(String, String)],
    in_commit: bool,
) -> Result<Vec<Released>, StoreError> {
    let (scopes, ordering_keys): (Vec<&str>, Vec<&str>) = entities
        .iter()
        .map(|(s, k)| (s.as_str(), k.as_str()))
        .unzip();
    let rows: Vec<WaitingRow> = sqlx::query_as(
        "SELECT scope, ordering_key, seq, operation, idempotency_key, queue, body, properties,
                turn
           FROM idem_ordering_release($1::text[], $2::text[], $3, $4)",
    )
    .bind(scopes)
    .bind(ordering_keys)
    .bind(millis(RELEASE_STALE))
    .bind(!in_commit)
    .fetch_all(executor)
    .await?;
    // Each row on its own: one that cannot be opened must not hold back the others.
    Ok(rows
        .into_iter()
        .filter_map(|row| readable(row, keys))
        .collect())
}

/// A released row read back, or `None` (logged) when it cannot be: a body sealed under
/// a key no longer configured stays released, and the sweep shows its entity stalled.
pub(crate) fn readable(row: WaitingRow, keys: Option<&Keys>) -> Option<Released> {
    let (scope, key, seq) = (row.0.clone(), row.1.clone(), row.2);
    released(row, keys)
        .map_err(|error| {
            tracing::warn!(
                error = %crate::text::error_line(&error),
                scope = %scope, ordering_key = %key, seq,
                "a waiting delivery cannot be read back; its entity stays stalled"
            )
        })
        .ok()
}

fn released(row: WaitingRow, keys: Option<&Keys>) -> Result<Released, StoreError> {
    let (scope, ordering_key, seq, operation, idempotency_key, queue, body, properties, turn) = row;
    let properties = serde_json::from_slice(&properties)
        .map_err(|error| StoreError::UnknownClaimRow(format!("waiting properties: {error}")))?;
    Ok(Released {
        scope,
        ordering_key,
        seq,
        operation,
        idempotency_key,
        turn,
        queue,
        body: protect::open_body(keys, body)?,
        properties,
    })
}

/// A released delivery run in its releasing process was settled (its outcome, retry copy
/// or dead letter is safe): its waiting row is done with (its key at its place: a row of
/// another message parked under its key since stays).
pub(crate) async fn finish(pool: &PgPool, released: &Released) -> Result<(), StoreError> {
    sqlx::query(
        "DELETE FROM ordering_waiting
          WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
            AND ordering_key = $4 AND seq = $5",
    )
    .bind(&released.scope)
    .bind(&released.operation)
    .bind(&released.idempotency_key)
    .bind(&released.ordering_key)
    .bind(released.seq)
    .execute(pool)
    .await?;
    Ok(())
}

/// A row behind its position that the sweep published (confirmed) goes when its key's
/// record decides it (completed, or failed for good): a row kept by a move past a
/// completed holder, of another payload or parked under an older fingerprint than the
/// record's. Its copy is the message now, decided when it comes back (a duplicate, or
/// `fingerprint_conflict`); kept, a row its copy does not match was published again and
/// again. A row whose turn was skipped while it waited stays for its copy, which is
/// dead-lettered `sequence_passed` (its key has no such record).
pub(crate) async fn published_behind(pool: &PgPool, released: &Released) -> Result<(), StoreError> {
    sqlx::query(
        "DELETE FROM ordering_waiting w
          WHERE w.scope = $1 AND w.operation = $2 AND w.idempotency_key = $3
            AND w.ordering_key = $4 AND w.seq = $5
            AND EXISTS (SELECT 1 FROM processed_operations o
                         WHERE o.scope = w.scope AND o.operation = w.operation
                           AND o.idempotency_key = w.idempotency_key
                           AND (o.status = 'completed' OR (o.status = 'failed' AND NOT o.retryable)))",
    )
    .bind(&released.scope)
    .bind(&released.operation)
    .bind(&released.idempotency_key)
    .bind(&released.ordering_key)
    .bind(released.seq)
    .execute(pool)
    .await?;
    Ok(())
}

/// A released delivery run in its releasing process went back unsettled (an outage, an
/// open circuit): the sweep publishes it to its queue within a second or so.
pub(crate) async fn give_back(pool: &PgPool, released: &Released) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE ordering_waiting SET released_at = NULL, releases = 0
          WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
            AND ordering_key = $4 AND seq = $5",
    )
    .bind(&released.scope)
    .bind(&released.operation)
    .bind(&released.idempotency_key)
    .bind(&released.ordering_key)
    .bind(released.seq)
    .execute(pool)
    .await?;
    Ok(())
}

/// Entities that may move on without a delivery of theirs coming: a holder whose record
/// completed, or a turn nobody released (after a skip), or released longer than
/// [`RELEASE_STALE`] ago without coming back. At most `limit`. Only what has stood so
/// for `grace`: a holder that completed a moment ago is being moved on by its own
/// worker, which hands the next turn on in process (the sweep would publish it).
pub(crate) async fn unmoved(
    pool: &PgPool,
    limit: i64,
    grace: Duration,
) -> Result<Vec<(String, String)>, StoreError> {
    let rows = sqlx::query_as(
        // Each held position's record through the key's index (a lateral join): a hash
        // join would scan the whole records table at every sweep.
        "(SELECT p.scope, p.ordering_key FROM ordering_positions p
           CROSS JOIN LATERAL (
                 SELECT 1 FROM processed_operations r
                  WHERE r.scope = p.scope AND r.operation = p.holder_operation
                    AND r.idempotency_key = p.holder_key AND r.status = 'completed'
                    AND r.completed_at < now() - $3 * interval '1 millisecond'
                  LIMIT 1) r
           WHERE p.holder_key IS NOT NULL
           LIMIT $1)
         UNION
         -- Rows at or behind their position, on the waiting rows' key either way round:
         -- from each position (few entities, many rows waiting: a scan of every row
         -- took 340 ms with a million waiting, this 11 ms) or from each row (a few rows,
         -- many idle positions).
         (SELECT p.scope, p.ordering_key FROM ordering_waiting w
            JOIN ordering_positions p ON p.scope = w.scope AND p.ordering_key = w.ordering_key
                 AND w.seq <= p.next_seq
           WHERE (w.seq < p.next_seq OR p.holder_key IS NULL
                  OR (p.holder_operation = w.operation AND p.holder_key = w.idempotency_key))
             AND ((w.released_at IS NULL AND p.moved_at < now() - $3 * interval '1 millisecond')
                  OR w.released_at < now() - $2 * interval '1 millisecond')
           LIMIT $1)",
    )
    .bind(limit)
    .bind(millis(RELEASE_STALE))
    .bind(millis(grace))
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Entities with deliveries waiting that have not moved for `stall_after`, and the
/// deliveries waiting in all: the gauges `idem_ordering_stalled` and
/// `idem_ordering_waiting`.
pub(crate) async fn stats(pool: &PgPool, stall_after: Duration) -> Result<(i64, i64), StoreError> {
    // From the waiting rows (few), not the positions (one per entity seen within the
    // retention), counted per entity before the join: a distinct count of the joined
    // rows took up to 1.9 s with a million waiting, this 0.15 s.
    let row = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE p.moved_at < now() - $1 * interval '1 millisecond'),
                coalesce(sum(w.waiting), 0)::bigint
           FROM (SELECT x.scope, x.ordering_key, count(*) AS waiting FROM ordering_waiting x
                  GROUP BY x.scope, x.ordering_key) w
           JOIN ordering_positions p ON p.scope = w.scope AND p.ordering_key = w.ordering_key",
    )
    .bind(millis(stall_after))
    .fetch_one(pool)
    .await?;
    Ok(row)
}

#[derive(sqlx::FromRow)]
struct PositionRow {
    scope: String,
    ordering_key: String,
    next_seq: i64,
    holder_operation: Option<String>,
    holder_key: Option<String>,
    held_since: Option<DateTime<Utc>>,
    holder_status: Option<String>,
    holder_dead_lettered: Option<bool>,
    waiting: i64,
    first_waiting: Option<i64>,
    moved_at: DateTime<Utc>,
    skipped: i64,
    skip_note: Option<String>,
}

pub(super) async fn list(
    pool: &PgPool,
    stalled_for: Option<Duration>,
    limit: i64,
) -> Result<Vec<Position>, StoreError> {
    let rows: Vec<PositionRow> = sqlx::query_as(
        "SELECT p.scope, p.ordering_key, p.next_seq, p.holder_operation, p.holder_key,
                p.held_since,
                r.status AS holder_status,
                (r.dead_lettered_at IS NOT NULL OR r.discarded_at IS NOT NULL) AS holder_dead_lettered,
                w.waiting,
                -- At or past the turn: a row behind it (its turn passed, or kept by a
                -- move past a completed holder) is published within a second or so.
                (SELECT min(x.seq) FROM ordering_waiting x
                  WHERE x.scope = p.scope AND x.ordering_key = p.ordering_key
                    AND x.seq >= p.next_seq) AS first_waiting,
                p.moved_at, p.skipped, p.skip_note
           -- From the waiting rows: a count for each position read every position (1.6 s
           -- with a million idle ones, this 12 ms).
           FROM (SELECT x.scope, x.ordering_key, count(*) AS waiting
                   FROM ordering_waiting x
                  GROUP BY x.scope, x.ordering_key) w
           JOIN ordering_positions p ON p.scope = w.scope AND p.ordering_key = w.ordering_key
           LEFT JOIN processed_operations r ON r.scope = p.scope
                AND r.operation = p.holder_operation AND r.idempotency_key = p.holder_key
          WHERE $1::bigint IS NULL OR p.moved_at < now() - $1 * interval '1 millisecond'
          ORDER BY p.moved_at, p.scope, p.ordering_key
          LIMIT $2",
    )
    .bind(stalled_for.map(millis))
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| Position {
            scope: r.scope,
            ordering_key: r.ordering_key,
            next_seq: r.next_seq,
            holder: r.holder_operation.zip(r.holder_key),
            held_since: r.held_since,
            holder_status: r.holder_status,
            holder_dead_lettered: r.holder_dead_lettered.unwrap_or(false),
            waiting: r.waiting,
            first_waiting: r.first_waiting,
            moved_at: r.moved_at,
            skipped: r.skipped,
            skip_note: r.skip_note,
        })
        .collect())
}

/// How long a skip waits between reading the turn and skipping it: an owned turn that
/// was running at the read has normally been written down as its entity's holder by
/// then ([`crate::worker::MARK_AFTER`], and half a second for the mark's statement; a
/// mark that finds the position locked looks again a second later).
const SKIP_AFTER: Duration = crate::worker::MARK_AFTER.saturating_add(Duration::from_millis(500));

pub(super) async fn skip(
    pool: &PgPool,
    scope: &str,
    ordering_key: &str,
    note: &str,
    expected: Option<i64>,
) -> Result<Skipped, StoreError> {
    // A turn of an owned queue is written down as its entity's holder only once it has
    // run for `MARK_AFTER`: the turn is read, and skipped only if it is still the turn
    // once that has passed, when a turn that ran then normally shows as its holder
    // (docs/DESIGN.md, "Owned order", says when it does not).
    let turn: Option<i64> = sqlx::query_scalar(
        "SELECT next_seq FROM ordering_positions WHERE scope = $1 AND ordering_key = $2",
    )
    .bind(scope)
    .bind(ordering_key)
    .fetch_optional(pool)
    .await?;
    let Some(turn) = turn else {
        return Ok(Skipped::Unknown);
    };
    if expected.is_some_and(|seq| seq != turn) {
        return Ok(Skipped::Moved { next_seq: turn });
    }
    tokio::time::sleep(SKIP_AFTER).await;
    let mut tx = pool.begin().await?;
    let locked: Option<(i64,)> = sqlx::query_as(
        "SELECT (idem_ordering_lock($1, $2, 0)).next_seq
          WHERE EXISTS (SELECT 1 FROM ordering_positions WHERE scope = $1 AND ordering_key = $2)",
    )
    .bind(scope)
    .bind(ordering_key)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((from,)) = locked else {
        return Ok(Skipped::Unknown);
    };
    if from != turn {
        // Kept: the lock may have moved past a completed holder, as the sweep would.
        tx.commit().await?;
        return Ok(Skipped::Moved { next_seq: from });
    }
    // The holder runs: its record's lease is alive (running, or reconciling), or it has
    // no record yet and took its turn within the last minute (a transactional batch not
    // committed yet, or a claim on its way).
    let running: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM ordering_positions p
                   LEFT JOIN processed_operations r
                          ON r.scope = p.scope AND r.operation = p.holder_operation
                         AND r.idempotency_key = p.holder_key
                       WHERE p.scope = $1 AND p.ordering_key = $2 AND p.holder_key IS NOT NULL
                         AND ((r.status IN ('processing', 'pending') AND r.lease_expires_at > now())
                              OR (r.id IS NULL AND p.held_since > now() - interval '1 minute')))",
    )
    .bind(scope)
    .bind(ordering_key)
    .fetch_one(&mut *tx)
    .await?;
    if running {
        return Ok(Skipped::Running);
    }
    // A turn that ran already is moved past, not skipped.
    if moved_past_a_turn_that_ran(&mut tx, scope, ordering_key).await? {
        tx.commit().await?;
        return Ok(Skipped::Ran { seq: from });
    }
    sqlx::query(
        "UPDATE ordering_positions
            SET next_seq = next_seq + 1, last_seq = greatest(last_seq, next_seq),
                holder_operation = NULL, holder_key = NULL, held_since = NULL,
                moved_at = now(), skipped = skipped + 1, skip_note = $3, skipped_at = now()
          WHERE scope = $1 AND ordering_key = $2",
    )
    .bind(scope)
    .bind(ordering_key)
    .bind(note)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Skipped::Skipped { seq: from })
}

/// Moves the locked position of `(scope, ordering_key)` past its turn if that turn ran
/// already: the row at its number, with no holder, belongs to a record completed with
/// the row's payload (a leased run hands its turns on before it moves the position, and
/// a move can be lost with its connection; a completed holder is moved past by the
/// skip's lock). As the sweep would move it: that row deleted, no skip counted. Whether
/// it moved.
async fn moved_past_a_turn_that_ran(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    scope: &str,
    ordering_key: &str,
) -> Result<bool, StoreError> {
    let moved = sqlx::query_scalar(
        "WITH t AS (
             SELECT w.scope, w.ordering_key, w.seq FROM ordering_positions p
               JOIN ordering_waiting w ON w.scope = p.scope
                    AND w.ordering_key = p.ordering_key AND w.seq = p.next_seq
               JOIN processed_operations r ON r.scope = w.scope
                    AND r.operation = w.operation AND r.idempotency_key = w.idempotency_key
              WHERE p.scope = $1 AND p.ordering_key = $2 AND p.holder_key IS NULL
                AND r.status = 'completed' AND r.payload_sha256 = w.payload_sha256),
         gone AS (
             DELETE FROM ordering_waiting w USING t
              WHERE w.scope = t.scope AND w.ordering_key = t.ordering_key AND w.seq = t.seq),
         moved AS (
             UPDATE ordering_positions p
                SET next_seq = p.next_seq + 1, last_seq = greatest(p.last_seq, p.next_seq),
                    moved_at = now()
               FROM t
              WHERE p.scope = t.scope AND p.ordering_key = t.ordering_key
             RETURNING 1)
         SELECT EXISTS (SELECT 1 FROM moved)",
    )
    .bind(scope)
    .bind(ordering_key)
    .fetch_one(&mut **tx)
    .await?;
    Ok(moved)
}

#[cfg(test)]
#[path = "table_tests.rs"]
mod tests;
