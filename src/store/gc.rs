//! Garbage collection that the live path does not feel (docs/DESIGN.md, "Retention").
//!
//! Three kinds of [`Garbage`]: expired records that no dead letter pins, follow-up
//! messages dispatched longer ago than the retention (a message not yet published is
//! never deleted), and the console's per-minute delivery counts (`delivery_outcomes`).
//! Each is deleted in short batches, one statement each, and
//! between two batches gc rests in proportion to what the batch cost: with the default
//! duty of 0.3, a batch that took 30 ms is followed by 70 ms of rest, so the live path
//! gets most of the database's time and WAL bandwidth. Batches shrink when they take
//! longer than [`Pace::batch_time`] and grow back when they are quick; when a batch
//! costs much more per row than the best one so far (the database is busy, or waits
//! on locks), gc rests four times longer. [`Pace::max_rows_per_s`] is a hard ceiling.
//!
//! Across processes, gc runs one at a time: whoever holds the advisory lock
//! [`GC_LOCK`] collects; the others skip their round.
//!
//! Deleted rows leave their space behind until a vacuum makes it reusable; without one,
//! a table under a steady insert and delete rate only grows. idem leaves that to
//! autovacuum (migration 6 makes it start after 5 % of the table changed, not 20 %), and
//! where the server runs with `autovacuum = off`, a large round ends with a vacuum.
//!
//! [`collect`] is one round of every kind (what `idem gc` runs); a worker with
//! `WorkerConfig::gc_every` runs one every interval.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::AssertSqlSafe;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Store, StoreError, millis};
use crate::metrics;

mod leader;

pub use leader::GC_LOCK;

/// What gc deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Garbage {
    /// Expired records of `processed_operations`; never one a dead letter pins.
    Records,
    /// Rows of `outbox_messages` dispatched before the retention; never one that is not
    /// published yet.
    FollowUps,
    /// Rows of `delivery_outcomes` (the console's per-minute counts) older than the
    /// retention.
    Outcomes,
}

impl Garbage {
    /// Every kind, in the order gc collects them.
    pub const ALL: [Garbage; 3] = [Garbage::Records, Garbage::FollowUps, Garbage::Outcomes];

    /// The table.
    pub fn table(self) -> &'static str {
        match self {
            Garbage::Records => "processed_operations",
            Garbage::FollowUps => "outbox_messages",
            Garbage::Outcomes => "delivery_outcomes",
        }
    }

    /// `records`, `follow-ups` or `outcomes`, for output and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Garbage::Records => "records",
            Garbage::FollowUps => "follow-ups",
            Garbage::Outcomes => "outcomes",
        }
    }

    /// The rows of the table that gc keeps even when expired (an SQL condition).
    pub(crate) fn kept(self) -> &'static str {
        match self {
            // Keep this filter plain: one more condition here made the planner, on
            // stale statistics, sort every expired row for each batch (80 ms instead of
            // 4 ms, and a 200k-row gc under load took 30 minutes).
            Garbage::Records => "dead_letters > 0",
            // expires_at is set with dispatched_at; the check is belt and braces.
            Garbage::FollowUps => "dispatched_at IS NULL",
            Garbage::Outcomes => "false",
        }
    }
}

/// How fast gc may go.
#[derive(Debug, Clone)]
pub struct Pace {
    /// Most rows per batch (each batch is one short statement).
    pub batch: i64,
    /// A batch should take about this long: longer ones halve the next batch.
    pub batch_time: Duration,
    /// The share of time spent deleting, in (0, 1]: the rest after a batch is its cost
    /// times `(1 - duty) / duty`. 1 deletes back to back.
    pub duty: f64,
    /// A hard ceiling in rows per second, if any.
    pub max_rows_per_s: Option<f64>,
}

impl Default for Pace {
    fn default() -> Self {
        Self {
            batch: 1000,
            batch_time: Duration::from_millis(50),
            duty: 0.3,
            max_rows_per_s: None,
        }
    }
}

/// Where a gc run stands, for progress reports.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Records deleted so far.
    pub deleted: u64,
    /// Since the run started.
    pub elapsed: Duration,
    /// Rows asked of the last batch.
    pub batch: i64,
    /// How long the last batch took.
    pub batch_took: Duration,
    /// The rest after it.
    pub rest: Duration,
}

impl Progress {
    /// Rows per second so far.
    pub fn rate(&self) -> f64 {
        self.deleted as f64 / self.elapsed.as_secs_f64().max(1e-3)
    }
}

impl Store {
    /// Deletes up to `batch` rows of `garbage` starting at `from`, the `expires_at` the
    /// previous batch of the same run reached; returns the rows deleted and where this
    /// batch ended. Records pinned by a dead letter and follow-ups not yet dispatched
    /// are never deleted.
    ///
    /// Without the cursor every batch would scan the index from its start, over the
    /// entries of every row deleted before it that vacuum has not removed yet: measured
    /// on 2,000,000 expired records, the rate fell from 35,000 to 6,000 rows/s. The
    /// bound is a plain range (`COALESCE`, not `$2 IS NULL OR …`), so that the generic
    /// plan Postgres switches to after five runs still starts the index scan there.
    async fn delete_expired(
        &self,
        garbage: Garbage,
        batch: i64,
        from: Option<DateTime<Utc>>,
    ) -> Result<(u64, Option<DateTime<Utc>>), StoreError> {
        let started = Instant::now();
        let (table, keep) = (garbage.table(), garbage.kept());
        // The batch size behind a subquery: a plan made for a known LIMIT of 1000 over
        // stale statistics sorted every expired row for each batch (95 ms instead of
        // 5 ms), while one for an unknown LIMIT walks the index. A connection's plan
        // cache turned generic plans on after five runs; through a transaction pooler,
        // whose server connections each start over, it never did (a 200k-row gc under
        // load: 277 s instead of 14).
        let (deleted, reached): (i64, Option<DateTime<Utc>>) =
            sqlx::query_as(AssertSqlSafe(format!(
                "WITH gone AS (
                 DELETE FROM {table}
                 WHERE id IN (
                     SELECT id FROM {table}
                     WHERE expires_at <= now() AND NOT ({keep})
                       AND expires_at >= COALESCE($2, '-infinity'::timestamptz)
                     ORDER BY expires_at
                     LIMIT (SELECT $1::bigint)
                     FOR UPDATE SKIP LOCKED)
                 RETURNING expires_at)
             SELECT count(*), max(expires_at) FROM gone"
            )))
            .bind(batch)
            .bind(from)
            .fetch_one(&self.pool)
            .await?;
        metrics::store_round_trip("gc", started);
        let deleted = u64::try_from(deleted).unwrap_or(0);
        metrics::gc_deleted(garbage.as_str(), deleted);
        Ok((deleted, reached.or(from)))
    }

    /// Whether the server runs autovacuum (`autovacuum = on`).
    async fn autovacuum_on(&self) -> Result<bool, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT current_setting('autovacuum')::boolean")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    /// `VACUUM (ANALYZE)` of the table of `garbage`: makes the space of deleted rows
    /// reusable and refreshes the planner's counts. Takes a lock that does not block
    /// workers; reads the table and its indexes.
    async fn vacuum(&self, garbage: Garbage) -> Result<(), StoreError> {
        sqlx::query(AssertSqlSafe(format!(
            "VACUUM (ANALYZE) {}",
            garbage.table()
        )))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Expired rows of `garbage` that gc may delete, and the age in seconds of the
    /// oldest one. Counts through the `expires_at` index: cheap when gc keeps up.
    pub(crate) async fn expired(&self, garbage: Garbage) -> Result<(i64, Option<f64>), StoreError> {
        let (table, keep) = (garbage.table(), garbage.kept());
        Ok(sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*),
                    extract(epoch FROM now() - min(expires_at))::float8
             FROM {table}
             WHERE expires_at <= now() AND NOT ({keep})"
        )))
        .fetch_one(&self.pool)
        .await?)
    }
}

/// How much longer than the best per-row cost so far a batch may take before gc
/// counts it as pressure and rests longer.
const PRESSURE: f64 = 3.0;
/// Smallest batch.
const MIN_BATCH: i64 = 10;

/// Deletes every expired row of `garbage` at `pace`, until none is left or `stop` is
/// cancelled; calls `report` about every `every`. Returns how many it deleted.
async fn collect_one(
    store: &Store,
    garbage: Garbage,
    pace: &Pace,
    stop: &CancellationToken,
    every: Duration,
    mut report: impl FnMut(Progress),
) -> Result<u64, StoreError> {
    let duty = pace.duty.clamp(0.01, 1.0);
    let most = pace.batch.max(MIN_BATCH);
    let mut size = most;
    let mut best_per_row: Option<f64> = None;
    let started = Instant::now();
    let mut reported = Instant::now();
    let mut deleted = 0u64;
    // Where the last batch ended: the next one starts there, not at the index's start.
    let mut cursor = None;
    while !stop.is_cancelled() {
        let begun = Instant::now();
        let (rows, reached) = store.delete_expired(garbage, size, cursor).await?;
        cursor = reached;
        let took = begun.elapsed();
        metrics::gc_batch(took);
        deleted += rows;
        if rows < size as u64 {
            break; // nothing expired is left
        }
        // Keep each batch short.
        if took > pace.batch_time {
            size = (size / 2).max(MIN_BATCH);
        } else if took < pace.batch_time / 2 {
            size = (size + size / 2).min(most);
        }
        let mut rest = took.mul_f64((1.0 - duty) / duty);
        let per_row = took.as_secs_f64() / rows.max(1) as f64;
        match best_per_row {
            Some(best) if per_row > best * PRESSURE => rest *= 4,
            Some(best) => best_per_row = Some(best.min(per_row)),
            None => best_per_row = Some(per_row),
        }
        if let Some(max) = pace.max_rows_per_s.filter(|m| *m > 0.0) {
            let due = Duration::from_secs_f64(deleted as f64 / max);
            rest = rest.max(due.saturating_sub(started.elapsed()));
        }
        if reported.elapsed() >= every {
            report(Progress {
                deleted,
                elapsed: started.elapsed(),
                batch: size,
                batch_took: took,
                rest,
            });
            reported = Instant::now();
        }
        tokio::select! {
            _ = tokio::time::sleep(rest) => {}
            _ = stop.cancelled() => break,
        }
    }
    Ok(deleted)
}

/// Rounds that deleted fewer rows leave the vacuum to the next large one.
const VACUUM_AFTER: u64 = 10_000;

/// After a gc round that deleted `deleted` rows of `garbage`: vacuums its table when
/// the server runs without autovacuum and the round was large ([`VACUUM_AFTER`]).
/// Returns how long the vacuum took, if it ran.
async fn tidy(
    store: &Store,
    garbage: Garbage,
    deleted: u64,
) -> Result<Option<Duration>, StoreError> {
    if deleted < VACUUM_AFTER || store.autovacuum_on().await? {
        return Ok(None);
    }
    let started = Instant::now();
    store.vacuum(garbage).await?;
    Ok(Some(started.elapsed()))
}

/// What a round of [`collect`] is doing, for whoever started it to tell.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Report {
    /// Rows of a kind past their expiry, before deleting them.
    Expired {
        /// The kind.
        garbage: Garbage,
        /// How many.
        rows: i64,
    },
    /// A long round, on its way.
    Progress {
        /// The kind.
        garbage: Garbage,
        /// Where it stands.
        progress: Progress,
    },
    /// Deleted (none, perhaps): how many, and how long it took.
    Deleted {
        /// The kind.
        garbage: Garbage,
        /// Rows deleted.
        rows: u64,
        /// How long it took.
        took: Duration,
    },
    /// Its table vacuumed after a large round (the server runs without autovacuum).
    Vacuumed {
        /// The kind.
        garbage: Garbage,
        /// How long the vacuum took.
        took: Duration,
    },
}

/// One round of garbage collection over every kind ([`Garbage::ALL`]) at `pace`, if no
/// other process collects right now (the lock [`GC_LOCK`]): `Ok(false)` when one does.
/// Stops early when `stop` is cancelled; tells `report` what it does, progress about
/// every `progress_every`.
pub async fn collect(
    store: &Store,
    pace: &Pace,
    stop: &CancellationToken,
    progress_every: Duration,
    mut report: impl FnMut(Report),
) -> Result<bool, StoreError> {
    let Some(leader) = store.try_lead_gc().await? else {
        return Ok(false);
    };
    for garbage in Garbage::ALL {
        if stop.is_cancelled() {
            break;
        }
        let (rows, _) = store.expired(garbage).await?;
        if rows > 0 {
            report(Report::Expired { garbage, rows });
        }
        let started = Instant::now();
        let tell = |progress| report(Report::Progress { garbage, progress });
        let deleted = collect_one(store, garbage, pace, stop, progress_every, tell).await?;
        report(Report::Deleted {
            garbage,
            rows: deleted,
            took: started.elapsed(),
        });
        if let Some(took) = tidy(store, garbage, deleted).await? {
            report(Report::Vacuumed { garbage, took });
        }
        if let Ok((rows, oldest)) = store.expired(garbage).await {
            metrics::gc_expired(garbage.as_str(), rows, oldest);
        }
    }
    if !stop.is_cancelled() {
        let idle = collect_positions(store.pool(), store.config().retention, pace.batch).await?;
        metrics::gc_deleted("positions", idle);
    }
    leader.release().await?;
    Ok(true)
}

/// Every `every` until `shutdown`, one round of [`collect`] at `pace`, logged; another
/// process holding the lock means this round is its.
pub(crate) async fn collect_every(
    store: Store,
    every: Duration,
    pace: Pace,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.cancelled() => return,
        }
        let log = |report| match report {
            Report::Progress { garbage, progress } => info!(
                what = garbage.as_str(),
                deleted = progress.deleted,
                rows_per_s = progress.rate() as u64,
                "garbage collection going on"
            ),
            Report::Deleted { garbage, rows, .. } if rows > 0 => {
                info!(
                    what = garbage.as_str(),
                    deleted = rows,
                    "garbage collection"
                )
            }
            Report::Vacuumed { garbage, took } => info!(
                what = garbage.as_str(),
                took_ms = took.as_millis() as u64,
                "vacuumed (autovacuum is off)"
            ),
            Report::Expired { .. } | Report::Deleted { .. } => {}
        };
        match collect(&store, &pace, &shutdown, Duration::from_secs(10), log).await {
            Ok(true) => {}
            Ok(false) => info!("garbage collection skipped: another process holds the gc lock"),
            Err(error) => {
                warn!(error = %crate::text::error_line(&error), "garbage collection failed")
            }
        }
    }
}

/// Deletes up to `limit` ordering positions (docs/DESIGN.md, "Order per entity") idle
/// for longer than `retention`: no holder, nothing waiting (`last_seq < next_seq`,
/// which a parking entry changes on the row gc locks, so a row parked meanwhile keeps
/// its position). A later message of such an entity starts it again at its first
/// number, so the retention must exceed the entity's quiet time as the records' does
/// their redeliveries'.
async fn collect_positions(
    pool: &PgPool,
    retention: Duration,
    limit: i64,
) -> Result<u64, StoreError> {
    let done = sqlx::query(
        "DELETE FROM ordering_positions p
          WHERE (p.scope, p.ordering_key) IN (
                SELECT scope, ordering_key FROM ordering_positions q
                 WHERE q.holder_key IS NULL AND q.last_seq < q.next_seq
                   AND q.moved_at < now() - $1 * interval '1 millisecond'
                   AND NOT EXISTS (SELECT 1 FROM ordering_waiting w
                                    WHERE w.scope = q.scope AND w.ordering_key = q.ordering_key)
                 ORDER BY q.moved_at LIMIT $2
                 FOR UPDATE SKIP LOCKED)",
    )
    .bind(millis(retention))
    .bind(limit)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}
