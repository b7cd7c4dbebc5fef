//! The park (docs/DESIGN.md, "Owned order"): early entries kept in `ordering_waiting`,
//! those that arrived together in one statement, a plain insert first.

use std::time::Duration;

use sqlx::PgPool;

use super::index;
use crate::ordering::table::Entry;
use crate::protect::{self, Keys};
use crate::store::StoreError;

/// What [`park`] found for one early entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Parked {
    /// Kept in `ordering_waiting`.
    Kept,
    /// A row with its key or its place is there already: `(seq, operation,
    /// idempotency key, fingerprint)` of that row.
    Found(i64, String, String, String),
    /// Refused by a row committed while the statement ran: park it again.
    Again,
    /// Not parked: the position is at its number or past it (this process's memory is
    /// behind): read it again.
    Passed,
}

/// The park's statement ([`park`]), with `$conflict` after its insert: the plain one
/// (nothing) or the careful one (`ON CONFLICT DO NOTHING`); `$head`, a comment before it.
macro_rules! park_statement {
    ($head:literal, $conflict:literal) => {
        concat!(
            $head,
            "WITH t AS (SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::text[],
                                         $5::text[], $6::text[], $7::text[], $8::bytea[],
                                         $9::bytea[])
                                   WITH ORDINALITY AS t(s, k, n, op, idem, fp, q, body, props, i)),
         early AS (
             SELECT t.*, p.moved_at AS moved FROM t
               LEFT JOIN LATERAL (
                     SELECT p.next_seq, p.moved_at FROM ordering_positions p
                      WHERE p.scope = t.s AND p.ordering_key = t.k
                      -- A subquery with a limit is not pulled up into a join, which
                      -- could hash the whole table: each entry probes its position.
                      LIMIT 1) p ON true
              WHERE NOT coalesce(p.next_seq >= t.n, false)),
         kept AS (
             INSERT INTO ordering_waiting (scope, ordering_key, seq, operation,
                 idempotency_key, payload_sha256, queue, body, properties)
             SELECT e.s, e.k, e.n, e.op, e.idem, e.fp, e.q, e.body, e.props
               FROM early e ORDER BY e.s, e.k, e.n, e.i
",
            $conflict,
            "             RETURNING scope, ordering_key, seq, operation, idempotency_key, payload_sha256),
         -- As the gate's parks, last_seq at the highest number waiting keeps gc off
         -- the position, but only where gc could be deleting it now (moved longer
         -- than half the retention ago): a gc that missed this row must have begun
         -- half a retention after this statement. A write on a position a batch
         -- is moving waits for that batch's commit, and was a third of the park's
         -- time (docs/PERFORMANCE.md). Rarely any: each entry's moved_at comes with
         -- its look at its position (early), read by its key (a join read the whole
         -- table), and the update runs only if one is found.
         old AS (
             SELECT e.s AS scope, e.k AS ordering_key, max(e.n) AS top FROM early e
              WHERE e.moved < now() - $10 * interval '1 millisecond' / 2
                AND EXISTS (SELECT 1 FROM kept k
                             WHERE k.scope = e.s AND k.ordering_key = e.k AND k.seq = e.n
                               AND k.operation = e.op AND k.idempotency_key = e.idem)
              GROUP BY e.s, e.k),
         grown AS (
             UPDATE ordering_positions p SET last_seq = m.top
               FROM old m
              WHERE p.scope = m.scope AND p.ordering_key = m.ordering_key AND p.last_seq < m.top
                AND p.moved_at < now() - $10 * interval '1 millisecond' / 2
                AND EXISTS (SELECT 1 FROM old))
         SELECT t.i, k.seq IS NOT NULL, NOT EXISTS (SELECT 1 FROM early e WHERE e.i = t.i),
                x.seq, x.operation, x.idempotency_key, x.payload_sha256
           FROM t
           LEFT JOIN kept k ON k.scope = t.s AND k.operation = t.op
                           AND k.idempotency_key = t.idem AND k.seq = t.n
                           AND k.payload_sha256 = t.fp
           LEFT JOIN LATERAL (
                 -- Only for an entry not kept (rare): each branch on an index of its own.
                 SELECT w.seq, w.operation, w.idempotency_key, w.payload_sha256
                   FROM ordering_waiting w
                  WHERE k.seq IS NULL AND w.scope = t.s AND w.operation = t.op
                    AND w.idempotency_key = t.idem
                 UNION ALL
                 SELECT w.seq, w.operation, w.idempotency_key, w.payload_sha256
                   FROM ordering_waiting w
                  WHERE k.seq IS NULL AND w.scope = t.s AND w.ordering_key = t.k AND w.seq = t.n
                 UNION ALL
                 SELECT o.seq, o.operation, o.idempotency_key, o.payload_sha256
                   FROM kept o
                  WHERE k.seq IS NULL AND o.scope = t.s
                    AND ((o.operation = t.op AND o.idempotency_key = t.idem)
                         OR (o.ordering_key = t.k AND o.seq = t.n))
                  LIMIT 1) x ON true"
        )
    };
}

/// The park's statement as it runs first: a plain insert, which a waiting row with the
/// key or the place of one of the entries refuses (23505, and nothing is written).
/// `ON CONFLICT DO NOTHING` makes Postgres look each unique index up before the insert
/// and confirm the row after it: 128 rows took 3.5–4.4 ms with it against 2.2–2.7
/// without (docs/PERFORMANCE.md), for a conflict that is rare (a copy of a delivery
/// parked already, after a kill).
const PARK_PLAIN: &str = park_statement!("", "");

/// The park's statement once the plain one was refused: each entry kept or answered
/// with the row in its way. Its comment tells it from the plain one in
/// `pg_stat_statements`.
const PARK_CAREFUL: &str = park_statement!(
    "/* park, careful */ ",
    "             ON CONFLICT DO NOTHING\n"
);

/// Keeps early entries in `ordering_waiting` (their bodies sealed under data
/// protection), answering for each whether it was kept or what row stood in its way.
/// `retention`: gc's of positions (the store's).
pub(crate) async fn park(
    pool: &PgPool,
    keys: Option<&Keys>,
    retention: Duration,
    entries: &[Entry],
) -> Result<Vec<Parked>, StoreError> {
    let text = |f: for<'a> fn(&'a Entry) -> &'a str| entries.iter().map(f).collect::<Vec<_>>();
    let scopes = text(|e| e.key.scope());
    let ordering_keys = text(|e| &e.ordered.key);
    let operations = text(|e| e.key.operation());
    let idempotency_keys = text(|e| e.key.idempotency_key());
    let fingerprints = text(|e| &e.fingerprint);
    let queues = text(|e| &e.queue);
    let seqs: Vec<i64> = entries
        .iter()
        .map(|e| e.ordered.sequence.unwrap_or_default())
        .collect();
    let bodies: Vec<Vec<u8>> = entries
        .iter()
        .map(|e| protect::seal_body(keys, &e.body))
        .collect();
    let properties: Vec<&[u8]> = entries.iter().map(|e| e.properties.as_slice()).collect();
    let query = |sql: &'static str| {
        sqlx::query_as::<_, ParkRow>(sql)
            .bind(&scopes)
            .bind(&ordering_keys)
            .bind(&seqs)
            .bind(&operations)
            .bind(&idempotency_keys)
            .bind(&fingerprints)
            .bind(&queues)
            .bind(&bodies)
            .bind(&properties)
            .bind(crate::db::millis(retention))
    };
    let rows = match query(PARK_PLAIN).fetch_all(pool).await {
        Err(sqlx::Error::Database(error)) if error.is_unique_violation() => {
            query(PARK_CAREFUL).fetch_all(pool).await?
        }
        rows => rows?,
    };
    let mut answers = vec![Parked::Again; entries.len()];
    for row in rows {
        if let Some(slot) = index(row.0).and_then(|i| answers.get_mut(i)) {
            *slot = parked(row);
        }
    }
    Ok(answers)
}

/// A row of [`park`]: the entry's ordinal, whether it was kept, whether the position
/// passed it, and the row in its way (`seq`, operation, idempotency key, fingerprint).
type ParkRow = (
    i64,
    bool,
    bool,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// What a row of [`park`] says of its entry.
fn parked((_, kept, passed, seq, operation, key, fingerprint): ParkRow) -> Parked {
    match (kept, passed, seq, operation, key, fingerprint) {
        (true, ..) => Parked::Kept,
        (false, true, ..) => Parked::Passed,
        (false, false, Some(seq), Some(op), Some(key), Some(fp)) => Parked::Found(seq, op, key, fp),
        _ => Parked::Again,
    }
}
