//! The Postgres idempotency store: claims, fences and finishes each operation's record.
//!
//! Every call is one short statement (one round trip, autocommit) except where the
//! caller passes its own transaction. Time always comes from the database clock
//! (`now()`), so workers with skewed clocks agree on when a lease expires.
//!
//! - `record`: what the store holds and answers ([`Status`], [`Record`], the lease a
//!   claim grants, what a claim found);
//! - `claim`: the statement that decides whether a delivery (or a request) may run;
//! - `claim_batch`: the same for the deliveries that arrived together, in two statements;
//! - `outcome`: the lease holder's fenced writes (heartbeat, complete, fail, pending);
//! - `lease`: keeping a lease while work runs (heartbeats beside it, panics caught);
//! - `operate`: what operators do (get, list, release, replay, discard);
//! - [`gc`]: deleting what expired, paced, one process at a time;
//! - `transactional`: a transactional-mode batch's lookups and inserts, in its own
//!   transaction.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

use crate::db::millis;
use crate::fault::{self, Fault};
use crate::fingerprint::Fingerprint;
use crate::protect::{self, Keys, SealError};

mod claim;
mod claim_batch;
pub mod gc;
pub(crate) mod lease;
mod operate;
mod outcome;
mod record;
mod transactional;

#[cfg(test)]
mod tests;

#[cfg(any(test, feature = "http"))]
pub(crate) use claim::RequestClaim;
pub(crate) use record::{Claim, ClaimRequest, Lease, Origin};
pub use record::{Record, Status, UnknownStatus};
pub(crate) use record::{StoredError, storable};
pub(crate) use transactional::{Found, NewRecord};

/// What the store failed at.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The caller no longer holds the lease: another worker took the operation over (or
    /// an operator released it). Its outcome was not written; a caller that wrote in
    /// its own transaction must roll it back.
    #[error("lease lost: lease token {token} no longer owns the record")]
    LeaseLost {
        /// The stale token.
        token: i64,
    },
    /// The claim kept racing with concurrent inserts and deletes and did not settle.
    #[error("claim did not settle after {0} tries (concurrent writers on the same key)")]
    Contention(u32),
    /// A claimed record came back without a lease expiry (the schema forbids none, but
    /// a hand-edited row can).
    #[error("record {id} was claimed but has no lease expiry")]
    NoLeaseExpiry {
        /// The record's primary key.
        id: i64,
    },
    /// The claim statement returned a row of a kind this version does not know.
    #[error("claim statement returned an unknown row kind {0:?}")]
    UnknownClaimRow(String),
    /// Postgres failed or could not be reached.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The batched statement this call was part of failed.
    #[error(transparent)]
    Batch(Arc<StoreError>),
    /// A stored value could not be opened with the configured keys.
    #[error(transparent)]
    Sealed(#[from] SealError),
    /// Keys that sealed stored values (registered in `idem_keys`, not retired) are not
    /// among the configured keys.
    #[error(
        "stored values may be sealed with key(s) {ids}, which {} does not give: add them \
         (after the newest), or run `idem keys rotate` and `idem keys retire` where they are",
        crate::protect::KEYS_ENV
    )]
    KeysMissing {
        /// The missing key ids, comma-separated.
        ids: String,
    },
    /// A configured key was retired (`idem keys retire`): values it sealed may have
    /// been dropped from the fleet's keys. Give the key a new id.
    #[error("key {id:?} is retired: remove it, or give its material a new id")]
    KeyRetired {
        /// The key id.
        id: String,
    },
}

impl StoreError {
    /// Whose fault the error is: Postgres's SQLSTATE decides for a database error (see
    /// [`crate::fault`]); a lost lease, contention or a stopped batch loop heal by
    /// trying again; a row the store cannot read is nobody's known fault.
    pub(crate) fn fault(&self) -> Fault {
        match self {
            StoreError::Database(error) => fault::classify(error),
            StoreError::Batch(error) => error.fault(),
            StoreError::LeaseLost { .. } | StoreError::Contention(_) => Fault::Outage,
            // The deployment's keys (checked at start), or one altered row: nobody's
            // known fault, so the safety net still ends a delivery that never decides.
            StoreError::Sealed(_)
            | StoreError::KeysMissing { .. }
            | StoreError::KeyRetired { .. } => Fault::Unknown,
            StoreError::NoLeaseExpiry { .. } | StoreError::UnknownClaimRow(_) => Fault::Unknown,
        }
    }

    /// What Postgres said, with its SQLSTATE, when the error came from Postgres.
    pub(crate) fn describe(&self) -> String {
        match self {
            StoreError::Database(error) => fault::describe(error),
            StoreError::Batch(error) => error.describe(),
            other => other.to_string(),
        }
    }
}

/// Store settings.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Worker id written to `owner` on claims.
    pub owner: String,
    /// How long a claim is owned without a heartbeat.
    pub lease: Duration,
    /// How long a completed record is kept (docs/DESIGN.md, "Retention": default 7
    /// days). It must exceed the longest redelivery and replay horizon, or a late
    /// duplicate runs again.
    pub retention: Duration,
    /// Where the connections that need a session of their own open: the gc leader's
    /// advisory lock and the outbox relay's `LISTEN`. Set it when the pool goes through
    /// a pooler in transaction mode (PgBouncer's `pool_mode = transaction`, which gives
    /// each transaction whichever server connection is free), to Postgres itself or to
    /// a session-pooled database of the pooler ([`crate::db::session_options`] makes it
    /// from a URL, `DATABASE_SESSION_URL` in the examples). `None`: the pool's own
    /// options.
    pub session: Option<PgConnectOptions>,
    /// The keys stored values are sealed with (docs/DESIGN.md, "Data protection"):
    /// handler outputs, HTTP answers, provider references and follow-up bodies, and the
    /// key payload fingerprints are hashed with. `None` (the default): stored as given.
    /// [`Keys::from_env`] reads `IDEM_KEYS`.
    pub keys: Option<Keys>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            owner: format!("pid-{}", std::process::id()),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(7 * 24 * 3600),
            session: None,
            keys: None,
        }
    }
}

/// The idempotency store on Postgres: one table, `processed_operations`.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    config: StoreConfig,
    /// Set once the keys were checked and the retentions noted ([`Store::prepare`]).
    prepared: Arc<tokio::sync::OnceCell<()>>,
    /// The retention of each operation a service hosts, noted by [`Store::prepare`].
    retentions: Retentions,
}

/// Operations and their retentions (`None`: the store's), to note.
type Retentions = Arc<std::sync::Mutex<Vec<(String, Option<Duration>)>>>;

impl Store {
    /// A store on `pool` (already migrated, see [`crate::db::connect_and_migrate`]).
    pub fn new(pool: PgPool, config: StoreConfig) -> Self {
        Self {
            pool,
            config,
            prepared: Arc::default(),
            retentions: Arc::default(),
        }
    }

    /// Checks the configured keys against those that sealed stored values, and notes
    /// the retention of each operation a service hosts: once per store, before its
    /// first claim (every claim asks; a service asks at start, to stop with one line).
    /// Each key must open its check value, and every key not yet retired must be
    /// configured, so that nothing is written in plaintext beside sealed values nor
    /// fails later on a value it cannot open.
    pub async fn prepare(&self) -> Result<(), StoreError> {
        self.prepared
            .get_or_try_init(|| async {
                protect::check(&self.pool, self.config.keys.as_ref()).await?;
                let noted = self
                    .retentions
                    .lock()
                    .map(|r| r.clone())
                    .unwrap_or_default();
                for (operation, retention) in noted {
                    self.note_retention(&operation, retention).await?;
                }
                Ok::<(), StoreError>(())
            })
            .await
            .map(|_| ())
    }

    /// Notes, for [`Store::prepare`], that `operation`'s completed records are kept for
    /// `retention` (`None`: the store's) by every process that completes it. A service
    /// notes each handler's `WorkerConfig::retention`; call it for an HTTP route's
    /// operation (`POST /payments`) before the store's first claim.
    pub fn retains(&self, operation: &str, retention: Option<Duration>) {
        if let Ok(mut noted) = self.retentions.lock() {
            noted.push((operation.to_owned(), retention));
        }
    }

    /// The keys values are sealed with, if any.
    pub(crate) fn keys(&self) -> Option<&Keys> {
        self.config.keys.as_ref()
    }

    /// `payload`'s fingerprint, keyed when keys are configured.
    pub(crate) fn fingerprint(
        &self,
        payload: &serde_json::Value,
        volatile: &[&str],
    ) -> Fingerprint {
        Fingerprint::keyed(payload, volatile, self.keys())
    }

    /// The pool, for callers that open their own transactions.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The settings.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Where a connection that needs a session of its own opens
    /// ([`StoreConfig::session`], else the pool's host as it is now).
    pub(crate) fn session_options(&self) -> PgConnectOptions {
        match &self.config.session {
            Some(options) => options.clone(),
            None => (*self.pool.connect_options()).clone(),
        }
    }
}
