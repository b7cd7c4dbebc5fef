//! The statements of owned order's normal path (docs/DESIGN.md, "Order per entity",
//! "Owned order"): a queue with a single active consumer keeps its entities' positions in
//! memory (a load) and writes only when a turn completes (a fenced move, a chain's end)
//! or an entry comes early (a park, `owner/park.rs`). Each takes the items that arrived
//! together, one round trip. The rest (fetches, takeovers, holders) is in `held.rs`.

use sqlx::PgPool;

use super::table::{Released, readable};
use crate::protect::Keys;
use crate::store::StoreError;

mod park;
pub(crate) use park::{Parked, park};

/// An entity and a number in it: `(scope, ordering key, seq)`.
pub(crate) type Place = (String, String, i64);

/// A turn that completed: its place, and the operation and idempotency key that ran it.
#[derive(Debug, Clone)]
pub(crate) struct Done {
    pub(crate) place: Place,
    pub(crate) operation: String,
    pub(crate) idempotency_key: String,
    /// Where the entity's position stands in the database: the turn's number, or an
    /// earlier one when the turns between ran in a leased run without moving it (their
    /// rows go with this turn's move).
    pub(crate) from: i64,
}

/// What a move reads of the rows parked after each turn it moves past.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Then {
    /// Releases the row parked at the next number (it runs next) and reads up to
    /// `ahead` rows parked right after that one, not released: a leased run hands them
    /// on in turn without moving the position between them (`worker/owned/run.rs`).
    Release { ahead: i64 },
    /// Releases nothing and reads up to this many rows parked at the next numbers: a
    /// transactional batch runs them in the same commit (`worker/transactional/chain.rs`).
    Read(i64),
}

/// What [`move_on`] did for one completed turn.
#[derive(Debug, Clone, Default)]
pub(crate) struct Moved {
    /// The position was at the turn's [`Done::from`] (its number, or a leased run's
    /// first) and moved past it; false: it was not (an operator skipped it, or another
    /// process moved it): read it again.
    pub(crate) moved: bool,
    /// The delivery parked at the next number, released to run now; asked to read
    /// ([`Then::Read`]), the rows parked at the numbers right after the
    /// turn, up to that many and to the first gap, in order and not released (a chain
    /// reads them). A row that cannot be read back (its key is not given) is left out,
    /// as a gap: released later, it waits for the sweep as before.
    pub(crate) next: Vec<Released>,
    /// Asked to release and read ahead ([`Then::Release`]): the rows parked right after
    /// the released one, up to the first gap, in order and not released.
    pub(crate) ahead: Vec<Released>,
}

/// Each entity's position, created at `first` when it has none: `(scope, ordering key,
/// first)` in, `next_seq` out, in order. A position read that has not moved for an
/// hour is marked as moved then: gc takes positions that have not moved for the
/// retention, and a turn is about to run from this one with nothing written before it.
/// Nothing else is written: a batch's move holds its positions' locks until its commit,
/// and a read of one of them must not wait for it (or lock others in another order).
pub(crate) async fn load(
    pool: &PgPool,
    items: &[(String, String, i64)],
) -> Result<Vec<i64>, StoreError> {
    let scopes: Vec<&str> = items.iter().map(|(s, _, _)| s.as_str()).collect();
    let keys: Vec<&str> = items.iter().map(|(_, k, _)| k.as_str()).collect();
    let firsts: Vec<i64> = items.iter().map(|(_, _, f)| *f).collect();
    // A row created or touched by the statement is not in its own snapshot: read from
    // what those return. One created meanwhile by another transaction is in none: its
    // first.
    let rows: Vec<(i64, i64)> = sqlx::query_as(
        "WITH t AS (SELECT * FROM unnest($1::text[], $2::text[], $3::int8[])
                                   WITH ORDINALITY AS t(s, k, f, i)),
         created AS (
             INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq)
             SELECT DISTINCT ON (t.s, t.k) t.s, t.k, t.f, t.f - 1 FROM t ORDER BY t.s, t.k
             ON CONFLICT (scope, ordering_key) DO NOTHING
             RETURNING scope, ordering_key, next_seq),
         -- Each position is read by its key (a subquery per item): a join made the
         -- planner hash the whole table for a handful of items (docs/PERFORMANCE.md).
         stale AS (
             SELECT DISTINCT t.s, t.k FROM t
              WHERE (SELECT p.moved_at FROM ordering_positions p
                      WHERE p.scope = t.s AND p.ordering_key = t.k) < now() - interval '1 hour'),
         touched AS (
             UPDATE ordering_positions p SET moved_at = now() - interval '1 hour'
               FROM stale u
              WHERE p.scope = u.s AND p.ordering_key = u.k
                AND p.moved_at < now() - interval '1 hour'
                AND EXISTS (SELECT 1 FROM stale)
             RETURNING p.scope, p.ordering_key, p.next_seq)
         SELECT t.i, coalesce(c.next_seq, u.next_seq,
                              (SELECT p.next_seq FROM ordering_positions p
                                WHERE p.scope = t.s AND p.ordering_key = t.k), t.f)
           FROM t
           LEFT JOIN created c ON c.scope = t.s AND c.ordering_key = t.k
           LEFT JOIN touched u ON u.scope = t.s AND u.ordering_key = t.k",
    )
    .bind(&scopes)
    .bind(&keys)
    .bind(&firsts)
    .fetch_all(pool)
    .await?;
    let mut next: Vec<i64> = firsts.clone();
    for (i, n) in rows {
        if let Some(slot) = index(i).and_then(|i| next.get_mut(i)) {
            *slot = n;
        }
    }
    Ok(next)
}

/// A row of [`move_on`]: the item's ordinal, and the row released at the next number
/// (all `None` when none waits there).
type MovedRow = (
    i64,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
);

/// A [`MovedRow`]'s ordinal, and the waiting row it carries read back (unsealed), if
/// it carries one.
fn read_back(row: MovedRow, keys: Option<&Keys>) -> (i64, Option<Released>) {
    let (i, scope, ordering_key, seq, operation, key, queue, body, properties) = row;
    let released = match (
        scope,
        ordering_key,
        seq,
        operation,
        key,
        queue,
        body,
        properties,
    ) {
        (Some(s), Some(k), Some(n), Some(op), Some(idem), Some(q), Some(b), Some(p)) => {
            readable((s, k, n, op, idem, q, b, p, true), keys)
        }
        _ => None,
    };
    (i, released)
}

/// [`move_on`]'s statement: `$1`–`$5` and `$8` the turns (scope, ordering key,
/// number, operation, idempotency key, the run's first number), `$6` the rows to read
/// ahead, `$7` whether the row at the next number is released.
const MOVE_ON: &str =
    "WITH t AS (SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::text[],
                                     $5::text[], $8::int8[])
                               WITH ORDINALITY AS t(s, k, n, op, idem, f, i)),
     locked AS MATERIALIZED (
         SELECT l.scope, l.ordering_key
           FROM (SELECT DISTINCT t.s, t.k FROM t ORDER BY t.s, t.k) u
          CROSS JOIN LATERAL (
                SELECT p.scope, p.ordering_key FROM ordering_positions p
                 WHERE p.scope = u.s AND p.ordering_key = u.k
                   FOR UPDATE) l),
     moved AS (
         UPDATE ordering_positions p
            -- moved_at only once it is a second old: with no indexed column
            -- changed, a move is a HOT update (no new entries in the positions'
            -- indexes; each move was two, and bloated them).
            SET next_seq = t.n + 1, last_seq = greatest(p.last_seq, t.n),
                moved_at = CASE WHEN p.moved_at < now() - interval '1 second' THEN now()
                                ELSE p.moved_at END,
                holder_operation = NULL, holder_key = NULL, held_since = NULL
           FROM t JOIN locked l ON l.scope = t.s AND l.ordering_key = t.k
          WHERE p.scope = t.s AND p.ordering_key = t.k
            -- At the run's first number, or at the turn's own if its long-turn
            -- mark moved it there while its move waited in its commit.
            AND (p.next_seq = t.f
                 OR (p.next_seq = t.n AND p.holder_key = t.idem
                     AND p.holder_operation = t.op))
         RETURNING t.i, t.s, t.k, t.n, t.op, t.idem, t.f),
     -- The turn's own row: its key at its place (another message with its number
     -- stays, and so does a row of another message under its key, which runs into
     -- the record when its turn comes: a conflict, dead-lettered, not lost).
     gone AS (
         DELETE FROM ordering_waiting w USING moved m
          WHERE w.scope = m.s AND w.operation = m.op AND w.idempotency_key = m.idem
            AND w.ordering_key = m.k AND w.seq = m.n),
     -- The rows of the turns a leased run ran before this one without a move.
     ran AS (
         DELETE FROM ordering_waiting w USING moved m
          WHERE m.f < m.n AND w.scope = m.s AND w.ordering_key = m.k
            AND w.seq >= m.f AND w.seq < m.n),
     -- The clock, not the transaction's start (now()): a batch's transaction can
     -- run long, and a release dated at its start would look stale to the sweep
     -- as soon as it committed.
     released AS (
         UPDATE ordering_waiting w
            SET released_at = clock_timestamp(), releases = w.releases + 1
           FROM moved m
          WHERE $7 AND w.scope = m.s AND w.ordering_key = m.k AND w.seq = m.n + 1
         RETURNING m.i, w.scope, w.ordering_key, w.seq, w.operation, w.idempotency_key,
                   w.queue, w.body, w.properties),
     -- The rows at the numbers right after the turn, up to the first gap (after the
     -- released one, when one is).
     ahead AS (
         SELECT m.i, w.scope, w.ordering_key, w.seq, w.operation, w.idempotency_key,
                w.queue, w.body, w.properties
           FROM moved m CROSS JOIN LATERAL (
                 SELECT w.*, row_number() OVER (ORDER BY w.seq) AS r
                   FROM ordering_waiting w
                  WHERE w.scope = m.s AND w.ordering_key = m.k
                    AND w.seq > m.n AND w.seq <= m.n + $7::int + $6) w
          WHERE $6 > 0 AND w.seq = m.n + w.r AND w.seq > m.n + $7::int)
     -- Each moved turn once (no row of its own: nothing released or ahead), then
     -- its rows; no join between them (a nested loop read every row for each turn).
     SELECT i, NULL::text, NULL::text, NULL::int8, NULL::text, NULL::text, NULL::text,
            NULL::bytea, NULL::bytea
       FROM moved
     UNION ALL SELECT * FROM released
     UNION ALL SELECT * FROM ahead
     ORDER BY 1, 4 NULLS FIRST";

/// Moves each entity past its completed turn, fenced (only where the position is at
/// the turn's [`Done::from`], or at its number held by it), with the turn's waiting row
/// if it had one and the rows of the turns a leased run ran from `from` without moving
/// it (as `held::hold` and `held::running` move a run's turn to its own number: their
/// fences change together), then releases or reads the rows parked after it as `then`
/// says. On `executor`: the pool, or a transaction. A
/// transactional batch runs the rows read ([`Then::Read`]) in the same commit
/// (`worker/transactional/chain.rs`, which ends with [`chain_end`]).
///
/// The positions are locked first, in (scope, ordering key) order, as the sweep's
/// release (`idem_ordering_release`) and the gate lock theirs: an update joined to its
/// array locks them in whatever order its plan reads them (the table's, for a hash
/// join), and a sweep that held one of them while waiting for another made a deadlock
/// that Postgres broke after `deadlock_timeout` (1 s) by failing one of the two (seen in
/// 4 of about 25 bench runs, at the kill, when redeliveries wake the sweep). Each is
/// locked by its key, in the order of the sorted keys (a lateral subquery, so a nested
/// loop): a join hashed the whole table to lock a handful of rows.
pub(crate) async fn move_on<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    keys: Option<&Keys>,
    done: &[Done],
    then: Then,
) -> Result<Vec<Moved>, StoreError> {
    let scopes: Vec<&str> = done.iter().map(|d| d.place.0.as_str()).collect();
    let ordering_keys: Vec<&str> = done.iter().map(|d| d.place.1.as_str()).collect();
    let seqs: Vec<i64> = done.iter().map(|d| d.place.2).collect();
    let operations: Vec<&str> = done.iter().map(|d| d.operation.as_str()).collect();
    let idempotency_keys: Vec<&str> = done.iter().map(|d| d.idempotency_key.as_str()).collect();
    let froms: Vec<i64> = done.iter().map(|d| d.from).collect();
    let (reads, release) = match then {
        Then::Release { ahead } => (ahead, true),
        Then::Read(rows) => (rows, false),
    };
    let rows: Vec<MovedRow> = sqlx::query_as(MOVE_ON)
        .bind(&scopes)
        .bind(&ordering_keys)
        .bind(&seqs)
        .bind(&operations)
        .bind(&idempotency_keys)
        .bind(reads)
        .bind(release)
        .bind(&froms)
        .fetch_all(executor)
        .await?;
    let mut answers = vec![Moved::default(); done.len()];
    for row in rows {
        let (i, released) = read_back(row, keys);
        let Some((slot, done)) = index(i).and_then(|i| answers.get_mut(i).zip(done.get(i))) else {
            continue;
        };
        slot.moved = true;
        match released {
            Some(r) if release && r.seq > done.place.2 + 1 => slot.ahead.push(r),
            released => slot.next.extend(released),
        }
    }
    Ok(answers)
}

/// Where a chain ends: the entity's position, moved past its completed turn to `from`
/// by [`move_on`] in the same transaction, and the number `to` it moves to now (the
/// rows `from..to` ran in that transaction).
#[derive(Debug, Clone)]
pub(crate) struct ChainEnd {
    pub(crate) scope: String,
    pub(crate) ordering_key: String,
    pub(crate) from: i64,
    pub(crate) to: i64,
}

/// Ends chains, in the transaction that ran them (after [`move_on`] with rows ahead):
/// deletes the rows that ran, moves each position from `from` to `to` (fenced; the
/// transaction holds its lock since the move) and releases the row parked at `to`,
/// answered for each end in order.
pub(crate) async fn chain_end(
    conn: &mut sqlx::PgConnection,
    keys: Option<&Keys>,
    ends: &[ChainEnd],
) -> Result<Vec<Option<Released>>, StoreError> {
    let scopes: Vec<&str> = ends.iter().map(|e| e.scope.as_str()).collect();
    let ordering_keys: Vec<&str> = ends.iter().map(|e| e.ordering_key.as_str()).collect();
    let froms: Vec<i64> = ends.iter().map(|e| e.from).collect();
    let tos: Vec<i64> = ends.iter().map(|e| e.to).collect();
    let rows: Vec<MovedRow> = sqlx::query_as(
        "WITH t AS (SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[])
                                   WITH ORDINALITY AS t(s, k, f, e, i)),
         gone AS (
             DELETE FROM ordering_waiting w USING t
              WHERE w.scope = t.s AND w.ordering_key = t.k AND w.seq >= t.f AND w.seq < t.e),
         moved AS (
             UPDATE ordering_positions p
                SET next_seq = t.e, last_seq = greatest(p.last_seq, t.e - 1)
               FROM t
              WHERE p.scope = t.s AND p.ordering_key = t.k AND p.next_seq = t.f AND t.e > t.f
             RETURNING t.i),
         -- The clock, not the transaction's start: see move_on.
         released AS (
             UPDATE ordering_waiting w
                SET released_at = clock_timestamp(), releases = w.releases + 1
               FROM t
              WHERE w.scope = t.s AND w.ordering_key = t.k AND w.seq = t.e
                AND (t.e = t.f OR EXISTS (SELECT 1 FROM moved m WHERE m.i = t.i))
             RETURNING t.i, w.scope, w.ordering_key, w.seq, w.operation, w.idempotency_key,
                       w.queue, w.body, w.properties)
         SELECT i, scope, ordering_key, seq, operation, idempotency_key, queue, body,
                properties
           FROM released",
    )
    .bind(&scopes)
    .bind(&ordering_keys)
    .bind(&froms)
    .bind(&tos)
    .fetch_all(&mut *conn)
    .await?;
    let mut answers = vec![None; ends.len()];
    for row in rows {
        let (i, released) = read_back(row, keys);
        if let Some(slot) = index(i).and_then(|i| answers.get_mut(i)) {
            *slot = released;
        }
    }
    Ok(answers)
}

/// A 1-based ordinal as an index.
fn index(ordinal: i64) -> Option<usize> {
    usize::try_from(ordinal - 1).ok()
}

#[cfg(test)]
#[path = "owner_tests.rs"]
pub(crate) mod tests;
