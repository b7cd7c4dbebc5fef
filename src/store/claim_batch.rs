//! Claiming the keys of deliveries that arrived together in two statements (new keys,
//! then the keys that existed), each decided exactly as one claim would
//! (docs/DESIGN.md, "One delivery, decided by the record").

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Instant;

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::claim::{
    CLAIMABLE, ClaimRow, EXISTING_COLUMNS, NO_EXPIRY, TAKEN_COLUMNS, claim_of, same_payload, take,
};
use super::record::{Claim, ClaimRequest, Lease};
use super::{Store, StoreError, millis};
use crate::metrics;

/// A batch's new keys in one statement, inserted in key order so that two workers
/// inserting overlapping batches cannot deadlock. Keys that exist already are skipped
/// (and decided by [`CLAIM_EXISTING_SQL`]).
///
/// The new records share one fencing token, drawn once for the statement (an init
/// plan), not once per row: a batch of 100 saves 99 sequence calls, about 4 µs of server
/// time per message. It is each record's first token, so tokens still only grow per
/// record (a later takeover draws after this commit), and every write a token allows
/// also names the record's id.
const CLAIM_NEW_SQL: &str = "INSERT INTO processed_operations
    (scope, operation, idempotency_key, payload_sha256, fingerprint_key, status, attempts,
     lease_token, lease_expires_at, owner, message_id, correlation_id, trace_id)
SELECT t.scope, t.operation, t.idempotency_key, t.fp, $10, 'processing', 1,
       (SELECT nextval('processed_operations_lease_token_seq')),
       now() + $5::bigint * interval '1 millisecond', $6, t.message_id, t.correlation_id,
       t.trace_id
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $7::text[], $8::text[],
            $9::text[])
     AS t(scope, operation, idempotency_key, fp, message_id, correlation_id, trace_id)
ORDER BY t.scope, t.operation, t.idempotency_key
ON CONFLICT ON CONSTRAINT processed_operations_key DO NOTHING
RETURNING id, scope, operation, idempotency_key, lease_token, lease_expires_at";

/// A batch's existing keys in one statement: take over what may be taken, report the
/// rest, exactly as [`super::claim`]'s `CLAIM_SQL` does for one key.
static CLAIM_EXISTING_SQL: LazyLock<String> = LazyLock::new(|| {
    let take = take(NO_EXPIRY, "cur.new_trace_id");
    let same_input = same_payload("i.fp", "i.also");
    let same_cur = same_payload("cur.fp", "cur.also");
    format!(
        "WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $7::text[],
                         $8::text[])
                  AS t(scope, operation, idempotency_key, fp, trace_id, also)
),
cur AS (
    SELECT p.*, i.fp, i.also, i.trace_id AS new_trace_id, {same_input} AND {CLAIMABLE} AS claimable
    FROM processed_operations p JOIN input i USING (scope, operation, idempotency_key)
),
upd AS (
    UPDATE processed_operations p {take}
    FROM cur
    WHERE p.id = cur.id AND {same_cur} AND {CLAIMABLE}
    RETURNING p.id, p.scope, p.operation, p.idempotency_key, p.status, p.attempts,
              p.lease_token, p.lease_expires_at, cur.status AS previous_status,
              p.external_ref
)
SELECT 'taken' AS found, scope, operation, idempotency_key, {TAKEN_COLUMNS} FROM upd
UNION ALL
SELECT 'existing', scope, operation, idempotency_key, {EXISTING_COLUMNS} FROM cur
 WHERE NOT EXISTS (SELECT 1 FROM upd WHERE upd.id = cur.id)"
    )
});

#[derive(sqlx::FromRow)]
pub(super) struct BatchClaimRow {
    pub(super) scope: String,
    pub(super) operation: String,
    pub(super) idempotency_key: String,
    #[sqlx(flatten)]
    pub(super) row: ClaimRow,
}

impl Store {
    /// Claims many keys in two statements (new keys, then the keys that existed), each
    /// deciding exactly as [`Store::claim`] does. A key that appears twice in the batch
    /// is claimed once in the batch and its other copies afterwards, one at a time, so
    /// they see the first copy's claim (in progress, or a conflict). Results are in the
    /// order of `inputs`.
    pub(crate) async fn claim_many(
        &self,
        inputs: &[ClaimRequest],
    ) -> Result<Vec<Claim>, StoreError> {
        self.prepare().await?;
        let mut results: Vec<Option<Claim>> = vec![None; inputs.len()];
        let mut first: HashMap<(&str, &str, &str), usize> = HashMap::new();
        for (i, input) in inputs.iter().enumerate() {
            let k = &input.key;
            first
                .entry((k.scope(), k.operation(), k.idempotency_key()))
                .or_insert(i);
        }
        let mut distinct: Vec<usize> = first.values().copied().collect();
        distinct.sort_unstable();
        for (id, scope, operation, key, token, expires_at) in
            self.claim_new(inputs, &distinct).await?
        {
            if let Some(&i) = first.get(&(scope.as_str(), operation.as_str(), key.as_str())) {
                results[i] = Some(Claim::Claimed(Lease {
                    id,
                    token,
                    attempt: 1,
                    takeover: false,
                    expires_at,
                }));
            }
        }
        let existing: Vec<usize> = distinct
            .into_iter()
            .filter(|&i| results[i].is_none())
            .collect();
        for row in self.claim_existing(inputs, &existing).await? {
            let slot = (
                row.scope.as_str(),
                row.operation.as_str(),
                row.idempotency_key.as_str(),
            );
            if let Some(&i) = first.get(&slot) {
                results[i] = claim_of(row.row, &inputs[i].fingerprint, self.keys())?;
            }
        }
        // Copies of a key within the batch, and keys whose snapshot was stale: one at a
        // time, after the batch, so they see what it did.
        let mut claims = Vec::with_capacity(inputs.len());
        for (input, result) in inputs.iter().zip(results) {
            let claim = match result {
                Some(claim) => claim,
                None => {
                    self.claim(&input.key, &input.fingerprint, &input.origin)
                        .await?
                }
            };
            claims.push(claim);
        }
        Ok(claims)
    }

    /// Inserts the records of `inputs[picked]` that do not exist yet ([`CLAIM_NEW_SQL`]).
    async fn claim_new(
        &self,
        inputs: &[ClaimRequest],
        picked: &[usize],
    ) -> Result<Vec<(i64, String, String, String, i64, DateTime<Utc>)>, StoreError> {
        let column = |f: &dyn Fn(&ClaimRequest) -> Option<&str>| -> Vec<Option<&str>> {
            picked.iter().map(|&i| f(&inputs[i])).collect()
        };
        let started = Instant::now();
        let inserted = sqlx::query_as(CLAIM_NEW_SQL)
            .bind(column(&|c| Some(c.key.scope())))
            .bind(column(&|c| Some(c.key.operation())))
            .bind(column(&|c| Some(c.key.idempotency_key())))
            .bind(column(&|c| Some(c.fingerprint.as_hex())))
            .bind(millis(self.config.lease))
            .bind(&self.config.owner)
            .bind(column(&|c| c.origin.message_id.as_deref()))
            .bind(column(&|c| c.origin.correlation_id.as_deref()))
            .bind(column(&|c| c.origin.trace_id.as_deref()))
            .bind(inputs.first().and_then(|c| c.fingerprint.key_id()))
            .fetch_all(&self.pool)
            .await?;
        metrics::store_round_trip("claim_many", started);
        Ok(inserted)
    }

    /// Takes over or reports the existing records of `inputs[picked]`
    /// ([`CLAIM_EXISTING_SQL`]); no statement when there are none. In a transaction of
    /// its own: the statement is unnamed, parsed and executed in two exchanges, which a
    /// transaction pooler keeps on one server connection only inside a transaction.
    async fn claim_existing(
        &self,
        inputs: &[ClaimRequest],
        picked: &[usize],
    ) -> Result<Vec<BatchClaimRow>, StoreError> {
        if picked.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self.pool.begin().await?;
        let rows = self.claim_existing_in(&mut *tx, inputs, picked).await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// [`Store::claim_existing`] on any executor: in transactional mode, the batch's
    /// transaction, which then holds the taken rows' locks until it commits.
    pub(super) async fn claim_existing_in<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        inputs: &[ClaimRequest],
        picked: &[usize],
    ) -> Result<Vec<BatchClaimRow>, StoreError> {
        if picked.is_empty() {
            return Ok(Vec::new());
        }
        let column = |f: &dyn Fn(&ClaimRequest) -> Option<&str>| -> Vec<Option<&str>> {
            picked.iter().map(|&i| f(&inputs[i])).collect()
        };
        let started = Instant::now();
        // Planned on every run (an unnamed statement): a cached generic plan made while
        // the table was small would seq-scan it forever after.
        let rows = sqlx::query_as(CLAIM_EXISTING_SQL.as_str())
            .persistent(false)
            .bind(column(&|c| Some(c.key.scope())))
            .bind(column(&|c| Some(c.key.operation())))
            .bind(column(&|c| Some(c.key.idempotency_key())))
            .bind(column(&|c| Some(c.fingerprint.as_hex())))
            .bind(millis(self.config.lease))
            .bind(&self.config.owner)
            .bind(column(&|c| c.origin.trace_id.as_deref()))
            .bind(
                picked
                    .iter()
                    .map(|&i| inputs[i].fingerprint.also())
                    .collect::<Vec<_>>(),
            )
            .fetch_all(executor)
            .await?;
        metrics::store_round_trip("claim_many", started);
        Ok(rows)
    }
}
