//! Claiming keys: one statement decides whether a delivery may run, for one key or for
//! a batch of keys that arrived together (docs/DESIGN.md, "One delivery, decided by the
//! record").

use std::sync::LazyLock;
use std::time::Instant;

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::record::{Claim, Lease, Origin, Status};
use super::{Store, StoreError, millis};
use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::metrics;
use crate::protect::{self, Keys};

/// How often a claim may find the key inserted or deleted between its snapshot and its
/// write before giving up (each retry is one more statement with a fresh snapshot).
const CLAIM_TRIES: u32 = 8;

/// A record the claimer may take (alias `p`): an expired lease, a retryable failure, or
/// a pending operation nobody is reconciling; never an erased one (a replay of its dead
/// letter makes it retryable, and it must still not run again).
pub(super) const CLAIMABLE: &str = "(p.erased_at IS NULL AND (
        (p.status = 'processing' AND p.lease_expires_at <= now())
     OR (p.status = 'failed' AND p.retryable)
     OR (p.status = 'pending' AND (p.lease_expires_at IS NULL OR p.lease_expires_at <= now()))))";

/// [`CLAIMABLE`] without records to reconcile: for a claimer that cannot reconcile (an
/// HTTP route without a reconciler), which must leave them as they are.
#[cfg(feature = "http")]
const CLAIMABLE_UNLESS_PENDING: &str = "(NOT p.reconcile_first AND p.erased_at IS NULL AND
    (   (p.status = 'processing' AND p.lease_expires_at <= now())
     OR (p.status = 'failed' AND p.retryable)))";

/// A message's record never expires while in flight: its broker brings it back.
pub(super) const NO_EXPIRY: &str = "NULL::timestamptz";

/// An HTTP request's record expires even in flight, after the retention plus one lease
/// (`$12` ms): if its server dies and its client never asks again, nothing else would
/// bring it back. A request still running by then (heartbeats past the retention) loses
/// its record to gc, and with it its fenced completion: its writes roll back; a repeat
/// after that starts afresh (attempt 1, no takeover), so only its provider key guards
/// effects outside the transaction.
#[cfg(feature = "http")]
const REQUEST_EXPIRY: &str = "now() + $12::bigint * interval '1 millisecond'";

/// Taking a record: a new fencing token, attempts + 1, a lease of `$5` ms for owner `$6`,
/// the taker's trace id (`trace`, the record's own when the taker has none), and the
/// in-flight `expiry` ([`NO_EXPIRY`] or [`REQUEST_EXPIRY`]) unless it is taken
/// to be reconciled: such a record never expires (deleted, a repeat would run it blind).
/// A record that is or ever was uncertain (`reconcile_first`) is taken as `pending`, so
/// the taker reconciles it instead of running it (a replay or a released lease brings
/// it back here too).
///
/// The token is drawn per row, when the row is written: a takeover that waited for
/// another writer's lock draws it after the wait, so a record's tokens only grow.
pub(super) fn take(expiry: &str, trace: &str) -> String {
    format!(
        "SET status = CASE WHEN p.status = 'pending' OR p.reconcile_first THEN 'pending'
                       ELSE 'processing' END,
        attempts = p.attempts + 1,
        lease_token = nextval('processed_operations_lease_token_seq'),
        lease_expires_at = now() + $5::bigint * interval '1 millisecond',
        owner = $6,
        retryable = false,
        trace_id = COALESCE({trace}, p.trace_id),
        expires_at = CASE WHEN p.status = 'pending' OR p.reconcile_first THEN NULL
                          ELSE {expiry} END,
        updated_at = now()"
    )
}

/// The columns every claim statement returns, after `found`, for [`ClaimRow`].
pub(super) const TAKEN_COLUMNS: &str = "id, status, attempts, lease_token, lease_expires_at,
       previous_status, external_ref, NULL::text AS payload_sha256, NULL::jsonb AS result,
       NULL::jsonb AS error, NULL::boolean AS claimable, NULL::boolean AS dead_lettered,
       NULL::boolean AS awaits_reconcile, NULL::boolean AS erased";
pub(super) const EXISTING_COLUMNS: &str = "id, status, attempts, lease_token, lease_expires_at,
       NULL::text AS previous_status, external_ref, payload_sha256, result, error, claimable,
       (dead_lettered_at IS NOT NULL OR discarded_at IS NOT NULL) AS dead_lettered,
       (status = 'pending' OR (reconcile_first AND (
            (status = 'processing' AND lease_expires_at <= now())
         OR (status = 'failed' AND retryable)))) AS awaits_reconcile,
       erased_at IS NOT NULL AS erased";

/// The record `p` holds the payload of fingerprint `fp` (a digest made with the
/// newest key) or of `also` (the same payload's digests under older keys and unkeyed,
/// comma-separated, or NULL).
pub(super) fn same_payload(fp: &str, also: &str) -> String {
    format!(
        "(p.payload_sha256 = {fp} OR COALESCE(p.payload_sha256 = ANY(string_to_array({also}, ',')), false))"
    )
}

/// One statement decides the claim: insert a new record, or take over an expired /
/// retryable / pending one, or report the existing one. Each CTE runs on the same
/// snapshot; the `UPDATE` re-checks its conditions on the newest row version, so of
/// concurrent takers exactly one wins. Two races make the snapshot stale, and the
/// caller then runs the statement again with a fresh one: the key was committed by
/// another transaction after our snapshot began (the `INSERT` conflicts but `cur` cannot
/// see the row: no row comes back), or the row was claimable in our snapshot but
/// another transaction changed it first (`existing` with `claimable`).
static CLAIM_SQL: LazyLock<String> = LazyLock::new(|| claim_sql(CLAIMABLE, NO_EXPIRY));

/// [`CLAIM_SQL`] for an HTTP request: in-flight records expire, and records to reconcile
/// are taken only by a route that can reconcile them.
#[cfg(feature = "http")]
static REQUEST_CLAIM_SQL: LazyLock<String> = LazyLock::new(|| claim_sql(CLAIMABLE, REQUEST_EXPIRY));
#[cfg(feature = "http")]
static REQUEST_CLAIM_UNLESS_PENDING_SQL: LazyLock<String> =
    LazyLock::new(|| claim_sql(CLAIMABLE_UNLESS_PENDING, REQUEST_EXPIRY));

/// The HTTP claim statement for a route that can reconcile (`reconcile`) or cannot.
#[cfg(feature = "http")]
fn request_claim_sql(reconcile: bool) -> &'static str {
    if reconcile {
        &REQUEST_CLAIM_SQL
    } else {
        &REQUEST_CLAIM_UNLESS_PENDING_SQL
    }
}

/// The single-key claim statement for records `claimable` may take, with `expiry` on
/// the records it inserts or takes.
fn claim_sql(claimable: &str, expiry: &str) -> String {
    let take = take(expiry, "$9");
    let same = same_payload("$4", "$10");
    format!(
        "WITH ins AS (
    INSERT INTO processed_operations
        (scope, operation, idempotency_key, payload_sha256, fingerprint_key, status,
         attempts, lease_token, lease_expires_at, owner, message_id, correlation_id,
         trace_id, expires_at)
    VALUES ($1, $2, $3, $4, $11, 'processing', 1,
            nextval('processed_operations_lease_token_seq'),
            now() + $5::bigint * interval '1 millisecond', $6, $7, $8, $9, {expiry})
    ON CONFLICT ON CONSTRAINT processed_operations_key DO NOTHING
    RETURNING id, status, attempts, lease_token, lease_expires_at
),
cur AS (
    SELECT p.*, {same} AND {claimable} AS claimable
    FROM processed_operations p
    WHERE p.scope = $1 AND p.operation = $2 AND p.idempotency_key = $3
      AND NOT EXISTS (SELECT 1 FROM ins)
),
upd AS (
    UPDATE processed_operations p {take}
    FROM cur
    WHERE p.id = cur.id AND {same} AND {claimable}
    RETURNING p.id, p.status, p.attempts, p.lease_token, p.lease_expires_at,
              cur.status AS previous_status, p.external_ref
)
SELECT 'inserted' AS found, id, status, attempts, lease_token, lease_expires_at,
       NULL::text AS previous_status, NULL::text AS external_ref,
       NULL::text AS payload_sha256, NULL::jsonb AS result, NULL::jsonb AS error,
       NULL::boolean AS claimable, NULL::boolean AS dead_lettered,
       NULL::boolean AS awaits_reconcile, NULL::boolean AS erased
  FROM ins
UNION ALL
SELECT 'taken', {TAKEN_COLUMNS} FROM upd
UNION ALL
SELECT 'existing', {EXISTING_COLUMNS} FROM cur WHERE NOT EXISTS (SELECT 1 FROM upd)"
    )
}

/// Whether key `$1`, `$2`, `$3` has a record.
#[cfg(feature = "http")]
const KEY_RECORDED: &str = "EXISTS (SELECT 1 FROM processed_operations
        WHERE scope = $1 AND operation = $2 AND idempotency_key = $3)";

/// A single-commit request's first statement: the key's lock (`$4`), if free, and
/// whether the key has a record.
#[cfg(feature = "http")]
static REQUEST_LOCK_SQL: LazyLock<String> =
    LazyLock::new(|| format!("SELECT pg_try_advisory_xact_lock($4), {KEY_RECORDED}"));

/// Whether the key has a record.
#[cfg(feature = "http")]
static RECORD_EXISTS_SQL: LazyLock<String> = LazyLock::new(|| format!("SELECT {KEY_RECORDED}"));

/// What a single-commit request's first statement found ([`Store::lock_request_in`]).
#[cfg(feature = "http")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RequestLock {
    /// The request holds the key's lock (until its transaction ends).
    pub(crate) held: bool,
    /// The key had a record in the statement's snapshot.
    pub(crate) recorded: bool,
}

/// The advisory lock of a key: the first 8 bytes of the SHA-256 of its three parts.
/// Two keys that share it (one chance in 2^64) only wait for each other; an
/// application's own advisory locks would share the space too, as unlikely.
#[cfg(feature = "http")]
fn lock_id(key: &Key) -> i64 {
    use sha2::{Digest, Sha256};
    let mut digest = Sha256::new();
    for part in [key.scope(), key.operation(), key.idempotency_key()] {
        digest.update(part.as_bytes());
        digest.update([0]);
    }
    let bytes = digest.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&bytes[..8]);
    i64::from_be_bytes(first)
}

/// What an HTTP request's claim found.
#[cfg(any(test, feature = "http"))]
#[derive(Debug)]
pub(crate) enum RequestClaim {
    /// As for a message.
    Claim(Claim),
    /// The record is to be reconciled (`pending`, or failed after being uncertain) and
    /// the route cannot: it was left untouched.
    Uncertain,
}

#[derive(sqlx::FromRow)]
pub(super) struct ClaimRow {
    found: String,
    id: i64,
    status: Status,
    attempts: i32,
    lease_token: i64,
    lease_expires_at: Option<DateTime<Utc>>,
    previous_status: Option<Status>,
    external_ref: Option<String>,
    payload_sha256: Option<String>,
    result: Option<Value>,
    error: Option<Value>,
    claimable: Option<bool>,
    dead_lettered: Option<bool>,
    /// The existing record is one a claim would take to reconcile (read by an HTTP
    /// request's claim only).
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    awaits_reconcile: Option<bool>,
    /// The existing record was erased (a tombstone).
    erased: Option<bool>,
}

impl Store {
    /// Claims `key` for a payload with `fingerprint`, deciding what to do with a delivery.
    ///
    /// One round trip in the common case; a retry only when a concurrent writer
    /// committed the same key between this statement's snapshot and its insert.
    pub(crate) async fn claim(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        origin: &Origin,
    ) -> Result<Claim, StoreError> {
        self.prepare().await?;
        for _ in 0..CLAIM_TRIES {
            let row = self
                .claim_once(&self.pool, &CLAIM_SQL, key, fingerprint, origin)
                .await?;
            if let Some(row) = row
                && let Some(claim) = claim_of(row, fingerprint, self.keys())?
            {
                return Ok(claim);
            }
        }
        Err(StoreError::Contention(CLAIM_TRIES))
    }

    /// Claims `key` for an HTTP request, as [`Store::claim`] does for a message, except
    /// that the record expires after the retention even while in flight, and that a
    /// record to reconcile (`pending`, or failed after being uncertain) is taken only
    /// when `reconcile` says the route can reconcile it; otherwise it is reported as
    /// [`RequestClaim::Uncertain`], untouched.
    #[cfg(feature = "http")]
    pub(crate) async fn claim_request(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        origin: &Origin,
        reconcile: bool,
    ) -> Result<RequestClaim, StoreError> {
        // Before it holds a connection: a first check must not wait for one.
        self.prepare().await?;
        // Each statement commits on its own (autocommit), on one connection.
        let mut conn = self.pool.acquire().await?;
        self.claim_request_in(&mut conn, key, fingerprint, origin, reconcile)
            .await
    }

    /// A single-commit HTTP request's first statement, in its transaction: takes the
    /// key's lock if nobody holds it (a transaction-scoped advisory lock, no write) and
    /// looks for the key's record. Holding the lock with no record, the request runs
    /// its route and writes the record once, with its answer
    /// ([`Store::insert_one_in`]); a repeat waits for the lock
    /// ([`Store::wait_for_request_in`]) and then claims as the default mode does.
    #[cfg(feature = "http")]
    pub(crate) async fn lock_request_in(
        &self,
        conn: &mut sqlx::PgConnection,
        key: &Key,
    ) -> Result<RequestLock, StoreError> {
        let started = Instant::now();
        let found: Result<(bool, bool), _> = sqlx::query_as(REQUEST_LOCK_SQL.as_str())
            .bind(key.scope())
            .bind(key.operation())
            .bind(key.idempotency_key())
            .bind(lock_id(key))
            .fetch_one(&mut *conn)
            .await;
        metrics::store_round_trip("lock", started);
        let (held, recorded) = found?;
        Ok(RequestLock { held, recorded })
    }

    /// Whether the key has a record (committed, or written by `conn`'s transaction).
    #[cfg(feature = "http")]
    pub(crate) async fn record_exists_in(
        &self,
        conn: &mut sqlx::PgConnection,
        key: &Key,
    ) -> Result<bool, StoreError> {
        Ok(sqlx::query_scalar(RECORD_EXISTS_SQL.as_str())
            .bind(key.scope())
            .bind(key.operation())
            .bind(key.idempotency_key())
            .fetch_one(&mut *conn)
            .await?)
    }

    /// Waits for the key's lock (see [`Store::lock_request_in`]) while another
    /// single-commit request holds it, at most the transaction's `lock_timeout`.
    #[cfg(feature = "http")]
    pub(crate) async fn wait_for_request_in(
        &self,
        conn: &mut sqlx::PgConnection,
        key: &Key,
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        let waited = sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(lock_id(key))
            .execute(&mut *conn)
            .await;
        metrics::store_round_trip("wait_for_lock", started);
        waited?;
        Ok(())
    }

    /// [`Store::claim_request`] in the caller's transaction (a single-commit HTTP
    /// route's): a new record is inserted uncommitted and a taken one stays locked
    /// until the caller commits or rolls back, so a concurrent claim of the key waits
    /// at the unique index (or the row) until then. Each try is a statement of its own,
    /// with a fresh snapshot under READ COMMITTED: a claim that waited for another
    /// transaction's commit sees that one's record on its next try.
    #[cfg(feature = "http")]
    pub(crate) async fn claim_request_in(
        &self,
        conn: &mut sqlx::PgConnection,
        key: &Key,
        fingerprint: &Fingerprint,
        origin: &Origin,
        reconcile: bool,
    ) -> Result<RequestClaim, StoreError> {
        self.prepare().await?;
        let sql = request_claim_sql(reconcile);
        for _ in 0..CLAIM_TRIES {
            let row = self
                .claim_once(&mut *conn, sql, key, fingerprint, origin)
                .await?;
            if let Some(claim) = self.request_claim_of(row, fingerprint, reconcile)? {
                return Ok(claim);
            }
        }
        Err(StoreError::Contention(CLAIM_TRIES))
    }

    /// What an HTTP request's claim statement found: `None` when the statement must run
    /// again (a stale snapshot).
    #[cfg(feature = "http")]
    fn request_claim_of(
        &self,
        row: Option<ClaimRow>,
        fingerprint: &Fingerprint,
        reconcile: bool,
    ) -> Result<Option<RequestClaim>, StoreError> {
        let Some(row) = row else {
            return Ok(None);
        };
        let uncertain = row.found == "existing"
            && row.claimable != Some(true)
            && row
                .payload_sha256
                .as_deref()
                .is_some_and(|stored| fingerprint.accepts(stored))
            && row.awaits_reconcile == Some(true);
        if uncertain && !reconcile {
            return Ok(Some(RequestClaim::Uncertain));
        }
        Ok(claim_of(row, fingerprint, self.keys())?.map(RequestClaim::Claim))
    }

    /// One run of a single-key claim statement (`$12`, the in-flight expiry, is bound
    /// for the HTTP statements only).
    async fn claim_once<'e>(
        &self,
        executor: impl sqlx::PgExecutor<'e>,
        sql: &'static str,
        key: &Key,
        fingerprint: &Fingerprint,
        origin: &Origin,
    ) -> Result<Option<ClaimRow>, StoreError> {
        let started = Instant::now();
        let mut query = sqlx::query_as(sql)
            .bind(key.scope())
            .bind(key.operation())
            .bind(key.idempotency_key())
            .bind(fingerprint.as_hex())
            .bind(millis(self.config.lease))
            .bind(&self.config.owner)
            .bind(origin.message_id.as_deref())
            .bind(origin.correlation_id.as_deref())
            .bind(origin.trace_id.as_deref())
            .bind(fingerprint.also())
            .bind(fingerprint.key_id());
        if sql.contains("$12") {
            let expiry = self.config.retention.saturating_add(self.config.lease);
            query = query.bind(millis(expiry));
        }
        let row = query.fetch_optional(executor).await?;
        metrics::store_round_trip("claim", started);
        Ok(row)
    }
}

/// Turns the claim statement's row into a [`Claim`]; `None` when the snapshot was stale
/// and the statement must run again.
pub(super) fn claim_of(
    row: ClaimRow,
    fingerprint: &Fingerprint,
    keys: Option<&Keys>,
) -> Result<Option<Claim>, StoreError> {
    let external_ref = row
        .external_ref
        .map(|r| protect::open_text(keys, protect::Kind::Reference, r))
        .transpose()?;
    let status = row.status;
    let lease = |takeover| -> Result<Lease, StoreError> {
        Ok(Lease {
            id: row.id,
            token: row.lease_token,
            attempt: row.attempts,
            takeover,
            expires_at: row
                .lease_expires_at
                .ok_or_else(|| StoreError::NoLeaseExpiry { id: row.id })?,
        })
    };
    let claim = match row.found.as_str() {
        "inserted" => Claim::Claimed(lease(false)?),
        "taken" if status == Status::Pending => Claim::Pending {
            lease: lease(false)?,
            external_ref,
        },
        "taken" => Claim::Claimed(lease(row.previous_status == Some(Status::Processing))?),
        "existing" if row.claimable == Some(true) => return Ok(None),
        "existing" => {
            let stored = row.payload_sha256.unwrap_or_default();
            if !fingerprint.accepts(&stored) {
                return Ok(Some(Claim::Conflict {
                    stored: Fingerprint::from_hex(stored),
                }));
            }
            if row.erased == Some(true) {
                return Ok(Some(Claim::Erased));
            }
            match status {
                Status::Completed => Claim::Completed {
                    result: row
                        .result
                        .map(|r| protect::open_json(keys, protect::Kind::Result, r))
                        .transpose()?,
                },
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
        other => return Err(StoreError::UnknownClaimRow(other.to_owned())),
    };
    Ok(Some(claim))
}
