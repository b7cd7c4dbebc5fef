//! Garbage collection that the live path does not feel (docs/DESIGN.md, "Retention").
//!
//! Three kinds of [`Garbage`]: expired records that no dead letter pins, follow-up
//! messages dispatched longer ago than the retention (a message not yet published is
//! never deleted), and the per-minute delivery counts of [`crate::tally`]. Each is deleted in short batches ([`Store::gc_batch_from`]), and
//! between two batches gc rests in proportion to what the batch cost: with the default
//! duty of 0.3, a batch that took 30 ms is followed by 70 ms of rest, so the live path
//! gets most of the database's time and WAL bandwidth. Batches shrink when they take
//! longer than [`Pace::batch_time`] and grow back when they are quick; when a batch
//! costs much more per row than the best one so far (the database is busy, or waits
//! on locks), gc rests four times longer. [`Pace::max_rows_per_s`] is a hard ceiling.
//!
//! Across processes, gc runs one at a time: whoever holds the advisory lock
//! [`crate::store::GC_LOCK`] collects; the others skip their round
//! ([`Store::try_lead_gc`]).
//!
//! Deleted rows leave their space behind until a vacuum makes it reusable; without one,
//! a table under a steady insert and delete rate only grows. idem leaves that to
//! autovacuum (migration 6 makes it start after 5 % of the table changed, not 20 %), and
//! where the server runs with `autovacuum = off`, [`tidy`] vacuums after a large round.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::metrics;
use crate::store::{Store, StoreError};

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

/// How much longer than the best per-row cost so far a batch may take before gc
/// counts it as pressure and rests longer.
const PRESSURE: f64 = 3.0;
/// Smallest batch.
const MIN_BATCH: i64 = 10;

/// Deletes every expired row of `garbage` at `pace`, until none is left or `stop` is
/// cancelled; calls `report` about every `every`. Returns how many it deleted.
pub async fn collect(
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
        let (rows, reached) = store.gc_batch_from(garbage, size, cursor).await?;
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
pub const VACUUM_AFTER: u64 = 10_000;

/// After a gc round that deleted `deleted` rows of `garbage`: vacuums its table when
/// the server runs without autovacuum and the round was large ([`VACUUM_AFTER`]).
/// Returns how long the vacuum took, if it ran.
pub async fn tidy(
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
