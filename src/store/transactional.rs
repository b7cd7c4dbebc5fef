//! The store's side of transactional mode (docs/DESIGN.md, "Two execution modes"): a
//! batch looks its keys up, takes over what may be taken, and writes every new record
//! in its own transaction, so claim, effects and outcome commit together.
//!
//! A key without a record is not inserted before its handler runs: the record is
//! written once, with its outcome, at the end of the batch (one write per record, not a
//! claim and then a completion). Two workers racing on a new key both run their
//! handler; the second one's insert waits at the unique index for the first one's
//! commit and then finds the key taken, so its batch rolls back (its handler's writes
//! with it) and starts again, and then sees `completed`.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Instant;

use serde_json::Value;
use sqlx::PgConnection;

use super::claim::claim_of;
use super::outcome::retention_of;
use super::record::{Claim, ClaimRequest, Status, storable};
use super::{Store, StoreError, millis};
use crate::metrics;
use crate::protect::{self, Kind};

/// What a transactional batch found for one key.
#[derive(Debug)]
pub(crate) enum Found {
    /// No record: run the handler, then insert the record with its outcome.
    New,
    /// A record that changed between the statement's snapshot and its update: claim_of
    /// again later.
    Stale,
    /// A record: taken over (run or reconcile under the lease), or reported.
    Record(Claim),
}

/// The record of a key that had none, written with its outcome.
#[derive(Debug)]
pub(crate) struct NewRecord<'a> {
    pub(crate) request: &'a ClaimRequest,
    /// `completed`, `failed` or `pending`.
    pub(crate) status: Status,
    pub(crate) retryable: bool,
    pub(crate) result: Option<Value>,
    pub(crate) error: Option<Value>,
    pub(crate) external_ref: Option<String>,
}

/// The columns a new record is written with, by [`INSERT_SQL`] and `INSERT_ONE_SQL`.
const INSERT_INTO: &str = "INSERT INTO processed_operations
    (scope, operation, idempotency_key, payload_sha256, fingerprint_key, status, retryable,
     attempts, lease_token, owner, result, error, external_ref, reconcile_first, message_id,
     correlation_id, trace_id, completed_at, expires_at)";

/// New records with their outcomes, in key order so that batches inserting overlapping
/// keys wait for each other instead of deadlocking. One fencing token for the
/// statement, as in `CLAIM_NEW_SQL`. A key another transaction inserted meanwhile is
/// skipped (after waiting for that transaction), and missing from what comes back.
static INSERT_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{INSERT_INTO}
SELECT t.scope, t.operation, t.idempotency_key, t.fp, $15, t.status, t.retryable, 1,
       (SELECT nextval('processed_operations_lease_token_seq')), $12, t.result, t.error,
       t.external_ref, t.status = 'pending', t.message_id, t.correlation_id,
       t.trace_id,
       CASE WHEN t.status = 'completed' THEN now() END,
       CASE WHEN t.status = 'completed'
            THEN now() + {} * interval '1 millisecond' END
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bool[],
            $7::jsonb[], $8::jsonb[], $9::text[], $10::text[], $11::text[], $14::text[])
     AS t(scope, operation, idempotency_key, fp, status, retryable, result, error,
          external_ref, message_id, correlation_id, trace_id)
ORDER BY t.scope, t.operation, t.idempotency_key
ON CONFLICT ON CONSTRAINT processed_operations_key DO NOTHING
RETURNING scope, operation, idempotency_key, id, lease_token",
        retention_of("t.operation", "$13")
    )
});

/// One new record with its outcome (a single-commit HTTP request's), the columns and
/// parameters of [`INSERT_SQL`] with one value each. A plain `VALUES` insert, with no
/// `ON CONFLICT` and nothing returned: Postgres spends about two thirds of what the
/// many-row form costs for one row (`SELECT ... FROM VALUES`, a sort, a speculative
/// insertion; pgbench, 32 clients). A key another transaction inserted is a unique
/// violation, once that one committed.
#[cfg(feature = "http")]
static INSERT_ONE_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{INSERT_INTO}
VALUES ($1, $2, $3, $4, $15, $5, $6, 1, nextval('processed_operations_lease_token_seq'),
        $12, $7, $8, $9, $5 = 'pending', $10, $11, $14,
        CASE WHEN $5 = 'completed' THEN now() END,
        CASE WHEN $5 = 'completed' THEN now() + {} * interval '1 millisecond' END)",
        retention_of("$2", "$13")
    )
});

impl Store {
    /// Looks up the keys of `inputs` (distinct) in the batch's transaction: a record
    /// that may be taken is taken (its row stays locked until the batch commits), the
    /// others are reported as [`Store::claim_many`] reports them. Which keys have a
    /// record comes first, on a cached plan (`idem_existing_keys`); the statement that
    /// takes over or reports records, planned at each call, runs only for those.
    pub(crate) async fn find_in(
        &self,
        conn: &mut PgConnection,
        inputs: &[ClaimRequest],
    ) -> Result<Vec<Found>, StoreError> {
        let picked: Vec<usize> = self
            .existing_in(&mut *conn, inputs)
            .await?
            .into_iter()
            .enumerate()
            .filter_map(|(i, present)| present.then_some(i))
            .collect();
        let mut index: HashMap<(&str, &str, &str), usize> = HashMap::new();
        for (i, input) in inputs.iter().enumerate() {
            let k = &input.key;
            index.insert((k.scope(), k.operation(), k.idempotency_key()), i);
        }
        let mut found: Vec<Found> = inputs.iter().map(|_| Found::New).collect();
        for row in self.claim_existing_in(&mut *conn, inputs, &picked).await? {
            let slot = (
                row.scope.as_str(),
                row.operation.as_str(),
                row.idempotency_key.as_str(),
            );
            if let Some(&i) = index.get(&slot) {
                found[i] = match claim_of(row.row, &inputs[i].fingerprint, self.keys())? {
                    Some(claim) => Found::Record(claim),
                    None => Found::Stale,
                };
            }
        }
        Ok(found)
    }

    /// Which keys of `inputs` have a record, in order, in the batch's transaction,
    /// writing nothing (`idem_existing_keys`, on a cached plan).
    pub(crate) async fn existing_in(
        &self,
        conn: &mut PgConnection,
        inputs: &[ClaimRequest],
    ) -> Result<Vec<bool>, StoreError> {
        self.prepare().await?;
        let column = |f: fn(&ClaimRequest) -> &str| -> Vec<&str> { inputs.iter().map(f).collect() };
        let started = Instant::now();
        let present: Vec<i32> = sqlx::query_scalar(
            "SELECT * FROM idem_existing_keys($1::text[], $2::text[], $3::text[])",
        )
        .bind(column(|c| c.key.scope()))
        .bind(column(|c| c.key.operation()))
        .bind(column(|c| c.key.idempotency_key()))
        .fetch_all(&mut *conn)
        .await?;
        metrics::store_round_trip("find_existing", started);
        let mut existing = vec![false; inputs.len()];
        for i in present {
            if let Some(slot) = usize::try_from(i - 1)
                .ok()
                .and_then(|i| existing.get_mut(i))
            {
                *slot = true;
            }
        }
        Ok(existing)
    }

    /// Inserts the records of keys that had none, each with its outcome, in one
    /// statement. Returns each one's `(id, lease_token)`, or `None` for a key another
    /// transaction inserted meanwhile (the batch must then start again).
    pub(crate) async fn insert_in(
        &self,
        conn: &mut PgConnection,
        records: &[NewRecord<'_>],
    ) -> Result<Vec<Option<(i64, i64)>>, StoreError> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let column = |f: fn(&NewRecord<'_>) -> Option<String>| -> Vec<Option<String>> {
            records.iter().map(f).collect()
        };
        let (results, references): (Vec<Option<Value>>, Vec<Option<String>>) =
            records.iter().map(|r| self.sealed(r)).unzip();
        let errors: Vec<Option<&Value>> = records.iter().map(|r| r.error.as_ref()).collect();
        let started = Instant::now();
        // A prepared statement (its plan cached per connection): it reads no table that
        // grows (the unique index arbitrates a conflict, `operation_retention` holds a
        // row per operation), so no cached plan can come to scan one. Planned afresh it
        // cost Postgres about 0.5 ms a batch, most of a small batch's insert.
        let rows: Vec<(String, String, String, i64, i64)> = sqlx::query_as(INSERT_SQL.as_str())
            .bind(column(|r| Some(r.request.key.scope().to_owned())))
            .bind(column(|r| Some(r.request.key.operation().to_owned())))
            .bind(column(|r| Some(r.request.key.idempotency_key().to_owned())))
            .bind(column(|r| Some(r.request.fingerprint.as_hex().to_owned())))
            .bind(column(|r| Some(r.status.as_str().to_owned())))
            .bind(records.iter().map(|r| r.retryable).collect::<Vec<_>>())
            .bind(&results)
            .bind(&errors)
            .bind(&references)
            .bind(column(|r| r.request.origin.message_id.clone()))
            .bind(column(|r| r.request.origin.correlation_id.clone()))
            .bind(&self.config.owner)
            .bind(millis(self.config.retention))
            .bind(column(|r| r.request.origin.trace_id.clone()))
            .bind(records.first().and_then(|r| r.request.fingerprint.key_id()))
            .fetch_all(&mut *conn)
            .await?;
        metrics::store_round_trip("insert_many", started);
        let mut index: HashMap<(&str, &str, &str), usize> = HashMap::new();
        for (i, r) in records.iter().enumerate() {
            let k = &r.request.key;
            index.insert((k.scope(), k.operation(), k.idempotency_key()), i);
        }
        let mut inserted = vec![None; records.len()];
        for (scope, operation, key, id, token) in rows {
            if let Some(&i) = index.get(&(scope.as_str(), operation.as_str(), key.as_str())) {
                inserted[i] = Some((id, token));
            }
        }
        Ok(inserted)
    }

    /// The record of a key that had none, written with its outcome in `conn`'s
    /// transaction (or on its own). False when another transaction inserted the key
    /// first (found after waiting for its commit): the statement failed, and so did a
    /// transaction it ran in, which must be rolled back.
    #[cfg(feature = "http")]
    pub(crate) async fn insert_one_in(
        &self,
        conn: &mut PgConnection,
        record: &NewRecord<'_>,
    ) -> Result<bool, StoreError> {
        let (result, reference) = self.sealed(record);
        let request = record.request;
        let started = Instant::now();
        let inserted = sqlx::query(INSERT_ONE_SQL.as_str())
            .bind(request.key.scope())
            .bind(request.key.operation())
            .bind(request.key.idempotency_key())
            .bind(request.fingerprint.as_hex())
            .bind(record.status.as_str())
            .bind(record.retryable)
            .bind(&result)
            .bind(&record.error)
            .bind(&reference)
            .bind(request.origin.message_id.as_deref())
            .bind(request.origin.correlation_id.as_deref())
            .bind(&self.config.owner)
            .bind(millis(self.config.retention))
            .bind(request.origin.trace_id.as_deref())
            .bind(request.fingerprint.key_id())
            .execute(&mut *conn)
            .await;
        metrics::store_round_trip("insert_one", started);
        match inserted {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(db))
                if db.constraint() == Some("processed_operations_key") =>
            {
                Ok(false)
            }
            Err(error) => Err(error.into()),
        }
    }

    /// A new record's result and external reference as they are stored (sealed where
    /// keys are configured).
    fn sealed(&self, record: &NewRecord<'_>) -> (Option<Value>, Option<String>) {
        let keys = self.keys();
        let result = record
            .result
            .as_ref()
            .map(|v| protect::seal_json(keys, Kind::Result, v));
        let reference = record
            .external_ref
            .as_deref()
            .map(|r| protect::seal_text(keys, Kind::Reference, storable(r).as_ref()));
        (result, reference)
    }
}
