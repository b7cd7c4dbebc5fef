//! Owned order's statements beside its normal path (docs/DESIGN.md, "Owned order"): a
//! row parked while the move before it ran, fetched; the turns a dead owner was handed,
//! taken over; a holder recorded for a turn that failed or runs long; a delivery its
//! record decides without a turn. The loads, parks, moves and chain ends are in
//! `owner.rs`.

use std::collections::HashMap;
use std::time::Instant;

use chrono::{DateTime, Utc};

use sqlx::PgPool;

use super::owner::{Done, Place};
use super::table::{Entry, Released, WaitingRow, readable};
use crate::protect::Keys;
use crate::store::StoreError;

/// Releases the rows parked at each place, where the position is at it: a row parked
/// while the move before it ran, which that move did not see.
pub(crate) async fn fetch(
    pool: &PgPool,
    keys: Option<&Keys>,
    places: &[Place],
) -> Result<Vec<Option<Released>>, StoreError> {
    let scopes: Vec<&str> = places.iter().map(|(s, _, _)| s.as_str()).collect();
    let ordering_keys: Vec<&str> = places.iter().map(|(_, k, _)| k.as_str()).collect();
    let seqs: Vec<i64> = places.iter().map(|(_, _, n)| *n).collect();
    let rows: Vec<WaitingRow> = sqlx::query_as(
        "UPDATE ordering_waiting w SET released_at = now(), releases = w.releases + 1
           FROM unnest($1::text[], $2::text[], $3::int8[]) AS t(s, k, n)
          WHERE w.scope = t.s AND w.ordering_key = t.k AND w.seq = t.n
            AND EXISTS (SELECT 1 FROM ordering_positions p
                         WHERE p.scope = t.s AND p.ordering_key = t.k AND p.next_seq = t.n)
         RETURNING w.scope, w.ordering_key, w.seq, w.operation, w.idempotency_key, w.queue,
                   w.body, w.properties, true",
    )
    .bind(&scopes)
    .bind(&ordering_keys)
    .bind(&seqs)
    .fetch_all(pool)
    .await?;
    let mut found: HashMap<Place, Released> = rows
        .into_iter()
        .filter_map(|row| readable(row, keys))
        .map(|r| ((r.scope.clone(), r.ordering_key.clone(), r.seq), r))
        .collect();
    Ok(places.iter().map(|place| found.remove(place)).collect())
}

/// The database's clock at a session's first delivery, `first` (counted back from a
/// connection already in hand, so that no wait for one moves it later): what was
/// handed before it is a previous owner's ([`taken_over`]).
pub(crate) async fn takeover_cutoff(
    pool: &PgPool,
    first: Instant,
) -> Result<DateTime<Utc>, StoreError> {
    let mut connection = pool.acquire().await?;
    let since_first = first.elapsed();
    Ok(
        sqlx::query_scalar("SELECT now() - $1 * interval '1 millisecond'")
            .bind(crate::db::millis(since_first))
            .fetch_one(&mut *connection)
            .await?,
    )
}

/// The turns a previous owner of `queue` was handed in process and did not complete
/// (it died, or lost its consumer): rows at their entity's turn, with no holder (or
/// held by themselves: a turn handed in process that ran long, see [`running`]),
/// released (or parked, for a turn it was to fetch) before `cutoff`, and not run under
/// a live lease, released again (to run in this process, or to be published). `cutoff`: the database's clock at a
/// session's first delivery ([`takeover_cutoff`]); what was handed before it is the
/// previous owner's, as the broker gives a single-active-consumer queue to the next
/// consumer only once the last one is gone. What the stale sweep would publish a second
/// or more later.
pub(crate) async fn taken_over(
    pool: &PgPool,
    keys: Option<&Keys>,
    queue: &str,
    cutoff: DateTime<Utc>,
) -> Result<Vec<Released>, StoreError> {
    let rows: Vec<WaitingRow> = sqlx::query_as(
        "UPDATE ordering_waiting w SET released_at = now(), releases = w.releases + 1
           FROM ordering_positions p
          WHERE w.queue = $1 AND p.scope = w.scope AND p.ordering_key = w.ordering_key
            AND w.seq = p.next_seq
            AND (p.holder_key IS NULL
                 OR (p.holder_operation = w.operation AND p.holder_key = w.idempotency_key))
            AND coalesce(w.released_at, w.waiting_since) < $2
            AND NOT EXISTS (
                SELECT 1 FROM processed_operations o
                 WHERE o.scope = w.scope AND o.operation = w.operation
                   AND o.idempotency_key = w.idempotency_key
                   AND o.status IN ('processing', 'pending')
                   AND o.lease_expires_at > now())
         RETURNING w.scope, w.ordering_key, w.seq, w.operation, w.idempotency_key, w.queue,
                   w.body, w.properties, true",
    )
    .bind(queue)
    .bind(cutoff)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|row| readable(row, keys))
        .collect())
}

/// Records the turn at `place` as held by the delivery that ran it and did not complete
/// (retrying, pending, dead-lettered; `holds`): operators see what blocks the entity, a
/// skip waits for its live lease, and the sweep moves on past it once a copy completes
/// without its owner's move (a crash). Its waiting row, if it had one, is done with:
/// its retry copy or dead letter is safe (the sweep would publish the row again and
/// again, and run it ahead of its retry delay); unless `keeps_row`: a turn that met
/// another's live lease, whose row may be all there is of its message (given back to
/// the sweep when no retry delay is set), keeps it. A turn of a leased run first moves the
/// position from the run's [`Done::from`] to its number (holding it or not), past the
/// turns that completed before it, whose rows go. Whether the position was written
/// (false: it was not at `from`, or held by the turn already).
pub(crate) async fn hold(
    pool: &PgPool,
    done: &Done,
    holds: bool,
    keeps_row: bool,
) -> Result<bool, StoreError> {
    let (scope, ordering_key, seq) = &done.place;
    let written = sqlx::query_scalar(
        "WITH moved AS (
             UPDATE ordering_positions
                SET holder_operation = CASE WHEN $7 THEN $4
                                            WHEN $6 < $3 THEN NULL ELSE holder_operation END,
                    holder_key = CASE WHEN $7 THEN $5
                                      WHEN $6 < $3 THEN NULL ELSE holder_key END,
                    held_since = CASE WHEN $7 THEN now()
                                      WHEN $6 < $3 THEN NULL ELSE held_since END,
                    next_seq = $3, last_seq = greatest(last_seq, $3 - 1),
                    moved_at = CASE WHEN $6 < $3 THEN now() ELSE moved_at END
              WHERE scope = $1 AND ordering_key = $2 AND next_seq = $6
                AND (NOT $7 OR holder_key IS DISTINCT FROM $5)
             RETURNING 1),
         gone AS (
             DELETE FROM ordering_waiting
              WHERE $7 AND NOT $8 AND scope = $1 AND operation = $4 AND idempotency_key = $5
                AND ordering_key = $2 AND seq = $3),
         ran AS (
             DELETE FROM ordering_waiting
              WHERE $6 < $3 AND EXISTS (SELECT 1 FROM moved)
                AND scope = $1 AND ordering_key = $2 AND seq >= $6 AND seq < $3)
         SELECT EXISTS (SELECT 1 FROM moved)",
    )
    .bind(scope)
    .bind(ordering_key)
    .bind(seq)
    .bind(&done.operation)
    .bind(&done.idempotency_key)
    .bind(done.from)
    .bind(holds)
    .bind(keeps_row)
    .fetch_one(pool)
    .await?;
    Ok(written)
}

/// What a long turn's mark ([`running`]) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Marked {
    /// The position is locked (its move, or another write, is in flight), or gone: the
    /// mark did not wait for it.
    Locked,
    /// The position was looked at: the turn is its holder now, or something else was (a
    /// move that committed first, a holder written since).
    Looked,
    /// A turn of a leased run: the position moved from the run's first number to the
    /// turn's own, past the turns that completed before it (their rows gone), and the
    /// turn holds it. Its move goes from there now.
    Moved,
}

/// Records the turn at `place` as held by the delivery running it, which has run for a
/// second (`MARK_AFTER` in `worker/owned/mod.rs`): the listing shows it running and a skip
/// is refused, as under the gate. Only while the position is at its number with no
/// holder (a turn of a leased run: at the run's first number, whatever its holder): a
/// move that committed first (the turn ended), a skip, or a holder written since wins.
/// It does not wait for a locked position: a transactional batch holds its turns'
/// positions from its move to its commit, and marks that waited for them held a
/// connection each, 47 ms on average, to find the turn moved (docs/PERFORMANCE.md).
///
/// A turn of a leased run past its first (its [`Done::from`] behind its number) is
/// marked after half that: the position stands at the run's first number, whose row was
/// released, and the sweep would publish that row a second after its release and move
/// the position through the run's completed turns. The mark moves the position from
/// there to the turn's own number, deletes the rows of the turns between, and marks its
/// own row released, so that the position, the listing and the sweep see what a turn
/// handed on alone would show: a released turn running under its lease. (The move from
/// a run's first number, deleting the rows between, is also in [`hold`] and in
/// `owner::move_on`: their fences change together.)
pub(crate) async fn running<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    done: &Done,
) -> Result<Marked, StoreError> {
    let (scope, ordering_key, seq) = &done.place;
    let (looked, moved): (bool, bool) = sqlx::query_as(
        "WITH p AS (SELECT scope, ordering_key FROM ordering_positions
                     WHERE scope = $1 AND ordering_key = $2
                       FOR NO KEY UPDATE SKIP LOCKED),
              marked AS (
                 UPDATE ordering_positions o
                    SET holder_operation = $4, holder_key = $5, held_since = now(),
                        next_seq = $3, last_seq = greatest(o.last_seq, $3 - 1),
                        moved_at = CASE WHEN $6 < $3 THEN now() ELSE o.moved_at END
                   FROM p
                  WHERE o.scope = p.scope AND o.ordering_key = p.ordering_key
                    AND o.next_seq = $6 AND ($6 < $3 OR o.holder_key IS NULL)
                 RETURNING 1),
              ran AS (
                 DELETE FROM ordering_waiting
                  WHERE $6 < $3 AND EXISTS (SELECT 1 FROM marked)
                    AND scope = $1 AND ordering_key = $2 AND seq >= $6 AND seq < $3),
              own AS (
                 UPDATE ordering_waiting
                    SET released_at = clock_timestamp(), releases = releases + 1
                  WHERE $6 < $3 AND EXISTS (SELECT 1 FROM marked)
                    AND scope = $1 AND operation = $4 AND idempotency_key = $5
                    AND ordering_key = $2 AND seq = $3 AND released_at IS NULL)
         SELECT EXISTS (SELECT 1 FROM p), $6 < $3 AND EXISTS (SELECT 1 FROM marked)",
    )
    .bind(scope)
    .bind(ordering_key)
    .bind(seq)
    .bind(&done.operation)
    .bind(&done.idempotency_key)
    .bind(done.from)
    .fetch_one(executor)
    .await?;
    Ok(match (looked, moved) {
        (false, _) => Marked::Locked,
        (true, false) => Marked::Looked,
        (true, true) => Marked::Moved,
    })
}

/// Whether the record of `entry`'s key decides it without a turn: completed (a
/// duplicate), or failed for good. A delivery behind its position is decided by it (run
/// on to its claim, or `sequence_passed`): its waiting row, if one is behind the
/// position too, goes (the sweep would publish it for ever). Its own row only, of its
/// payload: a row of another message under its key is that message's, which the sweep
/// publishes (and then deletes, its copy confirmed), and which is dead-lettered
/// `fingerprint_conflict` when it comes back; deleted here, it would be lost without a
/// trace.
pub(crate) async fn decided(pool: &PgPool, entry: &Entry) -> Result<bool, StoreError> {
    let decided = sqlx::query_scalar(
        "WITH gone AS (
             DELETE FROM ordering_waiting w USING ordering_positions p
              WHERE w.scope = $1 AND w.operation = $2 AND w.idempotency_key = $3
                AND p.scope = w.scope AND p.ordering_key = w.ordering_key
                AND w.seq < p.next_seq
                AND (w.payload_sha256 = $4
                     OR w.payload_sha256 = ANY(string_to_array($5, ','))))
         SELECT EXISTS (SELECT 1 FROM processed_operations o
                         WHERE o.scope = $1 AND o.operation = $2 AND o.idempotency_key = $3
                           AND (o.status = 'completed' OR (o.status = 'failed' AND NOT o.retryable)))",
    )
    .bind(entry.key.scope())
    .bind(entry.key.operation())
    .bind(entry.key.idempotency_key())
    .bind(&entry.fingerprint)
    .bind(entry.also.as_deref())
    .fetch_one(pool)
    .await?;
    Ok(decided)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::PgPool;

    use super::{Marked, running, taken_over, takeover_cutoff};
    use crate::ordering::owner::tests::{done, positions_at};

    /// The takeover takes the turns released before the session's first delivery,
    /// by the database's clock read at once: a turn this process released since is not
    /// taken, however long the look waited, and a turn taken is not taken again.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn a_takeover_takes_only_what_was_released_before_the_first_delivery(pool: PgPool) {
        positions_at(&pool, &[("old", 3), ("new", 5)]).await;
        let park = |key: &'static str, seq: i64, released_ago_ms: i64| {
            let pool = pool.clone();
            async move {
                sqlx::query(
                    "INSERT INTO ordering_waiting (scope, ordering_key, seq, operation,
                         idempotency_key, payload_sha256, queue, body, properties,
                         released_at, releases)
                     VALUES ('s', $1, $2, 'op', $1 || '-' || $2, 'fp', 'q', '\\x7b7d',
                             '\\x7b7d', now() - $3 * interval '1 millisecond', 1)",
                )
                .bind(key)
                .bind(seq)
                .bind(released_ago_ms)
                .execute(&pool)
                .await
                .unwrap();
            }
        };
        // Handed to the previous owner a second before this session's first delivery.
        park("old", 3, 1_000).await;
        let first = std::time::Instant::now();
        let cutoff = takeover_cutoff(&pool, first).await.unwrap();
        // Handed by this process after its first delivery, before the look.
        tokio::time::sleep(Duration::from_millis(50)).await;
        park("new", 5, 0).await;
        let taken = taken_over(&pool, None, "q", cutoff).await.unwrap();
        let places: Vec<_> = taken
            .iter()
            .map(|r| (r.ordering_key.as_str(), r.seq))
            .collect();
        assert_eq!(places, [("old", 3)], "only what was handed before");
        assert!(
            taken_over(&pool, None, "q", cutoff)
                .await
                .unwrap()
                .is_empty(),
            "a turn taken over is released after the cutoff: not taken twice"
        );
    }

    /// A long turn's mark does not wait for a locked position (a batch's move holds it
    /// until its commit): it answers false at once and writes nothing. Unlocked, it records
    /// the turn's holder; fenced out (the position moved past the turn) or with no position,
    /// it writes nothing.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn a_long_turns_mark_skips_a_locked_position_and_is_fenced(pool: PgPool) {
        positions_at(&pool, &[("a", 1), ("moved", 2)]).await;
        let holder = |key: &'static str| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, Option<String>>(
                    "SELECT holder_key FROM ordering_positions WHERE ordering_key = $1",
                )
                .bind(key)
                .fetch_one(&pool)
                .await
                .unwrap()
            }
        };
        let mut moving = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM ordering_positions WHERE ordering_key = 'a' FOR UPDATE")
            .execute(&mut *moving)
            .await
            .unwrap();
        let locked = tokio::time::timeout(Duration::from_secs(10), running(&pool, &done("a")))
            .await
            .expect("the mark waited for the lock");
        assert_eq!(
            locked.unwrap(),
            Marked::Locked,
            "a locked position is not looked at"
        );
        moving.commit().await.unwrap();
        assert_eq!(holder("a").await, None, "nothing written while locked");
        assert_eq!(running(&pool, &done("a")).await.unwrap(), Marked::Looked);
        assert_eq!(holder("a").await.as_deref(), Some("entry-a"));
        assert_eq!(
            running(&pool, &done("moved")).await.unwrap(),
            Marked::Looked
        );
        assert_eq!(
            holder("moved").await,
            None,
            "fenced: the position is past 1"
        );
        assert_eq!(
            running(&pool, &done("gone")).await.unwrap(),
            Marked::Locked,
            "no position"
        );
    }
}
