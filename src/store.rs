//! The Postgres idempotency store: claims, fences and finishes each operation's record.
//!
//! Every call is one short statement (one round trip, autocommit) except where the
//! caller passes its own transaction. Time always comes from the database clock
//! (`now()`), so workers with skewed clocks agree on when a lease expires.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{PgExecutor, PgPool};

use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::metrics;

/// What the store failed at.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The caller no longer holds the lease: another worker took the operation over (or
    /// an operator released it). Its outcome was not written; in atomic mode its
    /// transaction must be rolled back.
    #[error("lease lost: lease token {token} no longer owns the record")]
    LeaseLost {
        /// The stale token.
        token: i64,
    },
    /// The claim kept racing with concurrent inserts and deletes and did not settle.
    #[error("claim did not settle after {0} tries (concurrent writers on the same key)")]
    Contention(u32),
    /// A row holds a value this version does not know (e.g. a status added later).
    #[error("unexpected record: {0}")]
    Unexpected(String),
    /// Postgres failed or could not be reached.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The batched statement this call was part of failed.
    #[error(transparent)]
    Batch(std::sync::Arc<StoreError>),
}

/// A record's status (DESIGN.md, "The record").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// A worker holds a lease and runs the handler.
    Processing,
    /// The handler succeeded; `result` is stored for replay.
    Completed,
    /// The handler failed; `retryable` says whether a later delivery may run it again.
    Failed,
    /// The external outcome is uncertain; reconcile with `external_ref`, never re-run blindly.
    Pending,
}

impl Status {
    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Processing => "processing",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Pending => "pending",
        }
    }

    fn parse(s: &str) -> Result<Self, StoreError> {
        Ok(match s {
            "processing" => Status::Processing,
            "completed" => Status::Completed,
            "failed" => Status::Failed,
            "pending" => Status::Pending,
            other => return Err(StoreError::Unexpected(format!("status {other:?}"))),
        })
    }
}

/// One row of `processed_operations`, as loaded by [`Store::get`].
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[allow(missing_docs)]
pub struct Record {
    pub id: i64,
    pub scope: String,
    pub operation: String,
    pub idempotency_key: String,
    pub payload_sha256: String,
    #[sqlx(try_from = "String")]
    pub status: StatusColumn,
    pub retryable: bool,
    pub attempts: i32,
    pub lease_token: i64,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub owner: Option<String>,
    pub result: Option<Value>,
    pub error: Option<Value>,
    pub external_ref: Option<String>,
    pub correlation_id: Option<String>,
    pub message_id: Option<String>,
    pub dead_lettered_at: Option<DateTime<Utc>>,
    pub replay_count: i32,
    pub last_replayed_at: Option<DateTime<Utc>>,
    pub discarded_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
    pub expires_at: Option<DateTime<Utc>>,
}

/// The `status` column decoded; a separate type so [`Record`] can derive `FromRow`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct StatusColumn(pub Status);

impl TryFrom<String> for StatusColumn {
    type Error = StoreError;
    fn try_from(s: String) -> Result<Self, StoreError> {
        Status::parse(&s).map(StatusColumn)
    }
}

/// Proof that the caller owns an operation until `expires_at`: pass it to every write.
///
/// `token` is the fencing token. It is new on every claim or takeover of the record and
/// only grows, and every outcome write checks it together with `id`, so a worker whose
/// lease was taken over can no longer write an outcome. New records claimed by one
/// batch statement share a token value: a token identifies a lease only together with
/// `id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The record's primary key.
    pub id: i64,
    /// The fencing token.
    pub token: i64,
    /// Which claim of this key this is, from 1.
    pub attempt: i32,
    /// True when the previous owner's lease expired while it was `processing`: it may
    /// have crashed half-way, so effects must be idempotent by the key.
    pub takeover: bool,
    /// When the lease lapses unless extended (database clock).
    pub expires_at: DateTime<Utc>,
}

/// What a claim found, deciding what the worker does with a delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// The caller owns the operation (new, taken over after an expired lease, or a
    /// retryable failure re-claimed): run the handler.
    Claimed(Lease),
    /// Already done with this payload: do not run; the stored result is replayable.
    Completed {
        /// The stored result.
        result: Option<Value>,
    },
    /// Another worker holds a live lease: do not run, retry later.
    InProgress {
        /// When that lease lapses, if known.
        lease_expires_at: Option<DateTime<Utc>>,
    },
    /// The key was used with another payload: never run, never retry.
    Conflict {
        /// The fingerprint stored with the key.
        stored: Fingerprint,
    },
    /// Failed and not retryable: do not run.
    FailedForGood {
        /// The record's primary key (for [`Store::mark_dead_lettered`]).
        id: i64,
        /// The stored error.
        error: Option<Value>,
        /// How many claims the key had.
        attempts: i32,
        /// Whether its dead letter was published. A worker that died between recording
        /// the failure and publishing leaves this false: publish it then.
        dead_lettered: bool,
    },
    /// The outcome is uncertain. The caller now holds a lease for reconciling it (call
    /// the handler's `reconcile` with `external_ref`); it must not re-run the handler
    /// unless reconcile says the effect was not applied.
    Pending {
        /// The lease for reconciling.
        lease: Lease,
        /// The provider's reference stored when the operation became pending.
        external_ref: Option<String>,
    },
}

/// Delivery details kept on a new record for inspection.
#[derive(Debug, Clone, Default)]
pub struct Origin<'a> {
    /// The broker message id of the first delivery.
    pub message_id: Option<&'a str>,
    /// The correlation id, if the producer set one.
    pub correlation_id: Option<&'a str>,
}

/// Store settings.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Worker id written to `owner` on claims.
    pub owner: String,
    /// How long a claim is owned without a heartbeat.
    pub lease: Duration,
    /// How long a completed record is kept (DESIGN.md: default 7 days). It must exceed
    /// the longest redelivery and replay horizon, or a late duplicate runs again.
    pub retention: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            owner: format!("pid-{}", std::process::id()),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// The idempotency store on Postgres.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    config: StoreConfig,
}

/// How often a claim may find the key inserted or deleted between its snapshot and its
/// write before giving up (each retry is one more statement with a fresh snapshot).
const CLAIM_TRIES: u32 = 8;

/// A record the claimer may take (alias `p`): an expired lease, a retryable failure, or
/// a pending operation nobody is reconciling.
const CLAIMABLE: &str = "(   (p.status = 'processing' AND p.lease_expires_at <= now())
     OR (p.status = 'failed' AND p.retryable)
     OR (p.status = 'pending' AND (p.lease_expires_at IS NULL OR p.lease_expires_at <= now())))";

/// Taking a record: a new fencing token, attempts + 1, a lease of `$5` ms for owner `$6`.
///
/// The token is drawn per row, when the row is written: a takeover that waited for
/// another writer's lock draws it after the wait, so a record's tokens only grow.
const TAKE: &str =
    "SET status = CASE WHEN p.status = 'pending' THEN 'pending' ELSE 'processing' END,
        attempts = p.attempts + 1,
        lease_token = nextval('processed_operations_lease_token_seq'),
        lease_expires_at = now() + $5::bigint * interval '1 millisecond',
        owner = $6,
        retryable = false,
        updated_at = now()";

/// The columns every claim statement returns, after `found`, for [`ClaimRow`].
const TAKEN_COLUMNS: &str = "id, status, attempts, lease_token, lease_expires_at,
       previous_status, external_ref, NULL::text AS payload_sha256, NULL::jsonb AS result,
       NULL::jsonb AS error, NULL::boolean AS claimable, NULL::boolean AS dead_lettered";
const EXISTING_COLUMNS: &str = "id, status, attempts, lease_token, lease_expires_at,
       NULL::text AS previous_status, external_ref, payload_sha256, result, error, claimable,
       dead_lettered_at IS NOT NULL AS dead_lettered";

/// One statement decides the claim: insert a new record, or take over an expired /
/// retryable / pending one, or report the existing one. Each CTE runs on the same
/// snapshot; the `UPDATE` re-checks its conditions on the newest row version, so of
/// concurrent takers exactly one wins. Two races make the snapshot stale, and the
/// caller then runs the statement again with a fresh one: the key was committed by
/// another transaction after our snapshot began (the `INSERT` conflicts but `cur` cannot
/// see the row: no row comes back), or the row was claimable in our snapshot but
/// another transaction changed it first (`existing` with `claimable`).
static CLAIM_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH ins AS (
    INSERT INTO processed_operations
        (scope, operation, idempotency_key, payload_sha256, status, attempts,
         lease_token, lease_expires_at, owner, message_id, correlation_id)
    VALUES ($1, $2, $3, $4, 'processing', 1,
            nextval('processed_operations_lease_token_seq'),
            now() + $5::bigint * interval '1 millisecond', $6, $7, $8)
    ON CONFLICT ON CONSTRAINT processed_operations_key DO NOTHING
    RETURNING id, status, attempts, lease_token, lease_expires_at
),
cur AS (
    SELECT p.*, p.payload_sha256 = $4 AND {CLAIMABLE} AS claimable
    FROM processed_operations p
    WHERE p.scope = $1 AND p.operation = $2 AND p.idempotency_key = $3
      AND NOT EXISTS (SELECT 1 FROM ins)
),
upd AS (
    UPDATE processed_operations p {TAKE}
    FROM cur
    WHERE p.id = cur.id AND p.payload_sha256 = $4 AND {CLAIMABLE}
    RETURNING p.id, p.status, p.attempts, p.lease_token, p.lease_expires_at,
              cur.status AS previous_status, p.external_ref
)
SELECT 'inserted' AS found, id, status, attempts, lease_token, lease_expires_at,
       NULL::text AS previous_status, NULL::text AS external_ref,
       NULL::text AS payload_sha256, NULL::jsonb AS result, NULL::jsonb AS error,
       NULL::boolean AS claimable, NULL::boolean AS dead_lettered
  FROM ins
UNION ALL
SELECT 'taken', {TAKEN_COLUMNS} FROM upd
UNION ALL
SELECT 'existing', {EXISTING_COLUMNS} FROM cur WHERE NOT EXISTS (SELECT 1 FROM upd)"
    )
});

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
    (scope, operation, idempotency_key, payload_sha256, status, attempts,
     lease_token, lease_expires_at, owner, message_id, correlation_id)
SELECT t.scope, t.operation, t.idempotency_key, t.fp, 'processing', 1,
       (SELECT nextval('processed_operations_lease_token_seq')),
       now() + $5::bigint * interval '1 millisecond', $6, t.message_id, t.correlation_id
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $7::text[], $8::text[])
     AS t(scope, operation, idempotency_key, fp, message_id, correlation_id)
ORDER BY t.scope, t.operation, t.idempotency_key
ON CONFLICT ON CONSTRAINT processed_operations_key DO NOTHING
RETURNING id, scope, operation, idempotency_key, lease_token, lease_expires_at";

/// A batch's existing keys in one statement: take over what may be taken, report the
/// rest, exactly as [`CLAIM_SQL`] does for one key.
static CLAIM_EXISTING_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[])
                  AS t(scope, operation, idempotency_key, fp)
),
cur AS (
    SELECT p.*, i.fp, p.payload_sha256 = i.fp AND {CLAIMABLE} AS claimable
    FROM processed_operations p JOIN input i USING (scope, operation, idempotency_key)
),
upd AS (
    UPDATE processed_operations p {TAKE}
    FROM cur
    WHERE p.id = cur.id AND p.payload_sha256 = cur.fp AND {CLAIMABLE}
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
struct ClaimRow {
    found: String,
    id: i64,
    status: String,
    attempts: i32,
    lease_token: i64,
    lease_expires_at: Option<DateTime<Utc>>,
    previous_status: Option<String>,
    external_ref: Option<String>,
    payload_sha256: Option<String>,
    result: Option<Value>,
    error: Option<Value>,
    claimable: Option<bool>,
    dead_lettered: Option<bool>,
}

#[derive(sqlx::FromRow)]
struct BatchClaimRow {
    scope: String,
    operation: String,
    idempotency_key: String,
    #[sqlx(flatten)]
    row: ClaimRow,
}

/// One claim of a batch (see [`Store::claim_many`]).
#[derive(Debug, Clone)]
pub struct ClaimInput {
    /// The key.
    pub key: Key,
    /// The payload's fingerprint.
    pub fingerprint: Fingerprint,
    /// The broker message id.
    pub message_id: Option<String>,
    /// The correlation id.
    pub correlation_id: Option<String>,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Store {
    /// A store on `pool` (already migrated, see [`crate::db::connect_and_migrate`]).
    pub fn new(pool: PgPool, config: StoreConfig) -> Self {
        Self { pool, config }
    }

    /// The pool, for callers that open their own transactions (atomic mode).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The settings.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Claims `key` for a payload with `fingerprint`, deciding what to do with a delivery.
    ///
    /// One round trip in the common case; a retry only when a concurrent writer
    /// committed the same key between this statement's snapshot and its insert.
    pub async fn claim(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        origin: &Origin<'_>,
    ) -> Result<Claim, StoreError> {
        for _ in 0..CLAIM_TRIES {
            let started = Instant::now();
            let row: Option<ClaimRow> = sqlx::query_as(CLAIM_SQL.as_str())
                .bind(key.scope())
                .bind(key.operation())
                .bind(key.idempotency_key())
                .bind(fingerprint.as_hex())
                .bind(millis(self.config.lease))
                .bind(&self.config.owner)
                .bind(origin.message_id)
                .bind(origin.correlation_id)
                .fetch_optional(&self.pool)
                .await?;
            metrics::store_round_trip("claim", started);
            if let Some(row) = row
                && let Some(claim) = decide(row, fingerprint)?
            {
                return Ok(claim);
            }
        }
        Err(StoreError::Contention(CLAIM_TRIES))
    }

    /// Claims many keys in two statements (new keys, then the keys that existed), each
    /// deciding exactly as [`Store::claim`] does. A key that appears twice in the batch
    /// is claimed once in the batch and its other copies afterwards, one at a time, so
    /// they see the first copy's claim (in progress, or a conflict). Results are in the
    /// order of `inputs`.
    pub async fn claim_many(&self, inputs: &[ClaimInput]) -> Result<Vec<Claim>, StoreError> {
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
        let column = |f: &dyn Fn(&ClaimInput) -> Option<&str>| -> Vec<Option<&str>> {
            distinct.iter().map(|&i| f(&inputs[i])).collect()
        };
        let scopes = column(&|c| Some(c.key.scope()));
        let operations = column(&|c| Some(c.key.operation()));
        let keys = column(&|c| Some(c.key.idempotency_key()));
        let fingerprints = column(&|c| Some(c.fingerprint.as_hex()));
        let started = Instant::now();
        let inserted: Vec<(i64, String, String, String, i64, DateTime<Utc>)> =
            sqlx::query_as(CLAIM_NEW_SQL)
                .bind(&scopes)
                .bind(&operations)
                .bind(&keys)
                .bind(&fingerprints)
                .bind(millis(self.config.lease))
                .bind(&self.config.owner)
                .bind(column(&|c| c.message_id.as_deref()))
                .bind(column(&|c| c.correlation_id.as_deref()))
                .fetch_all(&self.pool)
                .await?;
        metrics::store_round_trip("claim_many", started);
        for (id, scope, operation, key, token, expires_at) in inserted {
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
            .iter()
            .copied()
            .filter(|&i| results[i].is_none())
            .collect();
        if !existing.is_empty() {
            let pick = |f: &dyn Fn(&ClaimInput) -> &str| -> Vec<&str> {
                existing.iter().map(|&i| f(&inputs[i])).collect()
            };
            let started = Instant::now();
            // Planned on every run (an unnamed statement): a cached generic plan made
            // while the table was small would seq-scan it forever after.
            let rows: Vec<BatchClaimRow> = sqlx::query_as(CLAIM_EXISTING_SQL.as_str())
                .persistent(false)
                .bind(pick(&|c| c.key.scope()))
                .bind(pick(&|c| c.key.operation()))
                .bind(pick(&|c| c.key.idempotency_key()))
                .bind(pick(&|c| c.fingerprint.as_hex()))
                .bind(millis(self.config.lease))
                .bind(&self.config.owner)
                .fetch_all(&self.pool)
                .await?;
            metrics::store_round_trip("claim_many", started);
            for row in rows {
                let slot = (
                    row.scope.as_str(),
                    row.operation.as_str(),
                    row.idempotency_key.as_str(),
                );
                if let Some(&i) = first.get(&slot) {
                    results[i] = decide(row.row, &inputs[i].fingerprint)?;
                }
            }
        }
        // Copies of a key within the batch, and keys whose snapshot was stale: one at a
        // time, after the batch, so they see what it did.
        let mut claims = Vec::with_capacity(inputs.len());
        for (input, result) in inputs.iter().zip(results) {
            let claim = match result {
                Some(claim) => claim,
                None => {
                    let origin = Origin {
                        message_id: input.message_id.as_deref(),
                        correlation_id: input.correlation_id.as_deref(),
                    };
                    self.claim(&input.key, &input.fingerprint, &origin).await?
                }
            };
            claims.push(claim);
        }
        Ok(claims)
    }

    /// Records many successes in one statement, each fenced by its own lease: returns,
    /// in order, whether each lease still owned its record (false: lease lost, nothing
    /// written for it). Rows are updated in id order, so concurrent batches cannot
    /// deadlock.
    pub async fn complete_many(&self, items: &[(Lease, Value)]) -> Result<Vec<bool>, StoreError> {
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_unstable_by_key(|&i| items[i].0.id);
        let ids: Vec<i64> = order.iter().map(|&i| items[i].0.id).collect();
        let tokens: Vec<i64> = order.iter().map(|&i| items[i].0.token).collect();
        let results: Vec<Value> = order.iter().map(|&i| items[i].1.clone()).collect();
        let started = Instant::now();
        let done: Vec<i64> = sqlx::query_scalar(
            "UPDATE processed_operations p
             SET status = 'completed', result = t.result, error = NULL, retryable = false,
                 lease_expires_at = NULL, completed_at = now(), updated_at = now(),
                 expires_at = now() + $4::bigint * interval '1 millisecond'
             FROM (SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::jsonb[])
                   AS u(id, token, result) ORDER BY id) t
             WHERE p.id = t.id AND p.lease_token = t.token
               AND p.status IN ('processing', 'pending')
             RETURNING p.id",
        )
        // Planned on every run, with the real array sizes: a generic plan cached while
        // the table was small hash-joins against a full scan of it.
        .persistent(false)
        .bind(&ids)
        .bind(&tokens)
        .bind(&results)
        .bind(millis(self.config.retention))
        .fetch_all(&self.pool)
        .await?;
        metrics::store_round_trip("complete_many", started);
        let done: std::collections::HashSet<i64> = done.into_iter().collect();
        Ok(items
            .iter()
            .map(|(lease, _)| done.contains(&lease.id))
            .collect())
    }

    /// Extends the lease by the configured lease time (heartbeat) while a handler runs.
    /// Returns the new expiry, or [`StoreError::LeaseLost`] if another worker took over.
    pub async fn heartbeat(&self, lease: &Lease) -> Result<DateTime<Utc>, StoreError> {
        let started = Instant::now();
        let expires: Option<DateTime<Utc>> = sqlx::query_scalar(
            "UPDATE processed_operations
             SET lease_expires_at = now() + $3::bigint * interval '1 millisecond'
             WHERE id = $1 AND lease_token = $2 AND status IN ('processing', 'pending')
             RETURNING lease_expires_at",
        )
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
    pub async fn complete(&self, lease: &Lease, result: &Value) -> Result<(), StoreError> {
        self.complete_in(&self.pool, lease, result).await
    }

    /// Records success inside the caller's transaction (or on any executor), so the
    /// caller's own writes and the `completed` record commit or roll back together.
    ///
    /// On [`StoreError::LeaseLost`] the caller must roll its transaction back: another
    /// worker owns the operation now. The row lock taken here is held until the caller
    /// commits, so a concurrent takeover waits for the commit and then sees `completed`.
    pub async fn complete_in<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        lease: &Lease,
        result: &Value,
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        let done = sqlx::query(
            "UPDATE processed_operations
             SET status = 'completed', result = $3, error = NULL, retryable = false,
                 lease_expires_at = NULL, completed_at = now(), updated_at = now(),
                 expires_at = now() + $4::bigint * interval '1 millisecond'
             WHERE id = $1 AND lease_token = $2 AND status IN ('processing', 'pending')",
        )
        .bind(lease.id)
        .bind(lease.token)
        .bind(result)
        .bind(millis(self.config.retention))
        .execute(executor)
        .await?;
        metrics::store_round_trip("complete", started);
        fenced(done.rows_affected(), lease)
    }

    /// Records a failure, if `lease` still owns the record. A `retryable` failure may be
    /// claimed again by a later delivery; a failure for good never runs again.
    pub async fn fail(
        &self,
        lease: &Lease,
        retryable: bool,
        error: &Value,
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        let done = sqlx::query(
            "UPDATE processed_operations
             SET status = 'failed', retryable = $3, error = $4,
                 lease_expires_at = NULL, updated_at = now()
             WHERE id = $1 AND lease_token = $2 AND status IN ('processing', 'pending')",
        )
        .bind(lease.id)
        .bind(lease.token)
        .bind(retryable)
        .bind(error)
        .execute(&self.pool)
        .await?;
        metrics::store_round_trip("fail", started);
        fenced(done.rows_affected(), lease)
    }

    /// Records an uncertain outcome with the provider's reference, if `lease` still owns
    /// the record, and gives the lease up: the next delivery reconciles instead of
    /// re-running.
    pub async fn mark_pending(
        &self,
        lease: &Lease,
        external_ref: Option<&str>,
        error: &Value,
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        let done = sqlx::query(
            "UPDATE processed_operations
             SET status = 'pending', external_ref = COALESCE($3, external_ref), error = $4,
                 retryable = false, lease_expires_at = NULL, updated_at = now()
             WHERE id = $1 AND lease_token = $2 AND status IN ('processing', 'pending')",
        )
        .bind(lease.id)
        .bind(lease.token)
        .bind(external_ref)
        .bind(error)
        .execute(&self.pool)
        .await?;
        metrics::store_round_trip("mark_pending", started);
        fenced(done.rows_affected(), lease)
    }

    /// Notes that the operation's message now waits in the DLQ (published with a
    /// confirm). Not fenced: it records where the message is, not an outcome.
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
    /// `failed` record becomes retryable, the replay is counted on the record, and the
    /// record is unpinned (an unfinished record has no expiry, so this cannot let
    /// retention delete it). Returns the record as it is now, or `None` if there is
    /// none or it is completed.
    pub async fn prepare_replay(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        Ok(sqlx::query_as(
            "UPDATE processed_operations
             SET retryable = (status = 'failed') OR retryable, dead_lettered_at = NULL,
                 replay_count = replay_count + 1, last_replayed_at = now(), updated_at = now()
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
               AND status <> 'completed'
             RETURNING *",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.idempotency_key())
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
    /// record is unpinned and expires after the retention like a completed one.
    pub async fn discard(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        Ok(sqlx::query_as(
            "UPDATE processed_operations
             SET discarded_at = now(), dead_lettered_at = NULL, updated_at = now(),
                 expires_at = COALESCE(expires_at, now() + $4::bigint * interval '1 millisecond')
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
             RETURNING *",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.idempotency_key())
        .bind(millis(self.config.retention))
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Expires the lease of a `processing` or `pending` record by hand (its worker is
    /// known to be dead): the next delivery takes it over with a new fencing token, so
    /// the dead worker could not write an outcome even if it came back.
    pub async fn release(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        Ok(sqlx::query_as(
            "UPDATE processed_operations
             SET lease_expires_at = now(), updated_at = now()
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3
               AND status IN ('processing', 'pending')
             RETURNING *",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.idempotency_key())
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
        .bind(status.as_str())
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
        Ok(sqlx::query_as(
            "SELECT * FROM processed_operations
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.idempotency_key())
        .fetch_optional(&self.pool)
        .await?)
    }
}

fn fenced(rows: u64, lease: &Lease) -> Result<(), StoreError> {
    if rows == 1 {
        Ok(())
    } else {
        Err(StoreError::LeaseLost { token: lease.token })
    }
}

/// Turns the claim statement's row into a [`Claim`]; `None` when the snapshot was stale
/// and the statement must run again.
fn decide(row: ClaimRow, fingerprint: &Fingerprint) -> Result<Option<Claim>, StoreError> {
    let status = Status::parse(&row.status)?;
    let lease = |takeover| -> Result<Lease, StoreError> {
        Ok(Lease {
            id: row.id,
            token: row.lease_token,
            attempt: row.attempts,
            takeover,
            expires_at: row.lease_expires_at.ok_or_else(|| {
                StoreError::Unexpected("claimed record without lease expiry".into())
            })?,
        })
    };
    let claim = match row.found.as_str() {
        "inserted" => Claim::Claimed(lease(false)?),
        "taken" if status == Status::Pending => Claim::Pending {
            lease: lease(false)?,
            external_ref: row.external_ref,
        },
        "taken" => Claim::Claimed(lease(row.previous_status.as_deref() == Some("processing"))?),
        "existing" if row.claimable == Some(true) => return Ok(None),
        "existing" => {
            let stored = row.payload_sha256.unwrap_or_default();
            if stored != fingerprint.as_hex() {
                return Ok(Some(Claim::Conflict {
                    stored: Fingerprint::from_hex(stored),
                }));
            }
            match status {
                Status::Completed => Claim::Completed { result: row.result },
                Status::Failed => Claim::FailedForGood {
                    id: row.id,
                    error: row.error,
                    attempts: row.attempts,
                    dead_lettered: row.dead_lettered == Some(true),
                },
                // Processing with a live lease, or pending while another worker holds
                // the lease to reconcile it.
                Status::Processing | Status::Pending => Claim::InProgress {
                    lease_expires_at: row.lease_expires_at,
                },
            }
        }
        other => return Err(StoreError::Unexpected(format!("claim row kind {other:?}"))),
    };
    Ok(Some(claim))
}
