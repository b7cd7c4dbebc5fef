//! What became of the deliveries, per minute, in Postgres (`delivery_outcomes`), so that
//! the operator console can chart executed, duplicates, retried and dead-lettered
//! without a metrics server (docs/DESIGN.md, "Operator console").
//!
//! The records cannot tell these apart on their own: a duplicate delivery writes nothing
//! to `processed_operations` (its claim only reads the completed record), and a retry
//! leaves only a higher `attempts`. So each worker counts every delivery's outcome in
//! memory as it records `idem_deliveries_total` (a lock and a map entry, no I/O on the
//! delivery's path) and adds the counts to one row per minute, queue, operation and
//! outcome every [`crate::WorkerConfig::tally_every`], in one statement, and once more
//! when it stops. A flush that fails keeps its counts for the next one.
//!
//! It is a tally, not a ledger: a worker killed with `SIGKILL` takes the counts not
//! flushed yet with it, and a flush whose commit the database made but whose answer
//! the worker never got (the connection dropped in between) is added again by the next
//! one. The records stay the truth about operations; this is the truth about
//! deliveries, give or take those seconds. The minute is the worker's clock's. gc
//! deletes the rows after the store's retention (`Garbage::Outcomes`).

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// The most (minute, operation, outcome) entries a tally keeps while its flushes fail:
/// past it, the oldest minutes are dropped. A day of 15 outcomes of one operation is
/// 21,600 entries; an outage of the database that long has other consequences.
const MAX_ENTRIES: usize = 50_000;

/// The four lines of the console's deliveries chart, each a set of outcomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Line {
    /// The handler ran and its result was recorded (`executed`), or a pending
    /// operation was reconciled as applied (`reconciled`).
    Executed,
    /// The key was already completed, failed for good, or in another worker's hands:
    /// acked or sent to a retry queue without running.
    Duplicates,
    /// Sent to a retry queue or requeued to run again: a transient failure, an
    /// uncertain outcome awaiting reconciliation, an outage, a lost lease.
    Retried,
    /// A dead letter was published (whatever the reason).
    DeadLettered,
}

impl Line {
    /// The four, in the chart's order.
    pub const ALL: [Line; 4] = [
        Line::Executed,
        Line::Duplicates,
        Line::Retried,
        Line::DeadLettered,
    ];

    /// The line an outcome label belongs to; `None` for those that are counted apart
    /// from a delivery's one outcome (`takeover`), or that end in a dead letter, which
    /// `dead_lettered` counts already (`conflict`, `malformed`, `failed_permanent`,
    /// `retries_exhausted`, `undecidable`, `unroutable`).
    pub fn of(outcome: &str) -> Option<Line> {
        match outcome {
            "executed" | "reconciled" => Some(Line::Executed),
            "duplicate_completed" | "duplicate_failed" | "duplicate_in_progress" => {
                Some(Line::Duplicates)
            }
            "failed_transient" | "pending" | "requeued" | "lease_lost" => Some(Line::Retried),
            "dead_lettered" => Some(Line::DeadLettered),
            _ => None,
        }
    }

    /// How the console names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Line::Executed => "executed",
            Line::Duplicates => "duplicates",
            Line::Retried => "retried",
            Line::DeadLettered => "dead-lettered",
        }
    }
}

/// One worker's counts not yet written: (minute since the epoch, operation, outcome) →
/// deliveries. Sorted, so that every worker's statement locks the shared rows in the
/// same order and two flushes never deadlock.
type Counts = BTreeMap<(i64, &'static str, &'static str), i64>;

/// The outcome counts of one queue's deliveries, kept in memory until [`Tally::flush`]
/// adds them to `delivery_outcomes`. A worker makes its own; it is public for tests
/// and for tools that decide deliveries themselves.
#[derive(Debug)]
pub(crate) struct Tally {
    queue: String,
    retention: Duration,
    counts: Mutex<Counts>,
}

impl Tally {
    /// An empty tally of `queue`'s deliveries, whose rows expire `retention` after
    /// their minute.
    pub(crate) fn new(queue: impl Into<String>, retention: Duration) -> Self {
        Self {
            queue: queue.into(),
            retention,
            counts: Mutex::default(),
        }
    }

    /// Counts one delivery of `operation` with `outcome`, in the current minute.
    pub(crate) fn count(&self, operation: &'static str, outcome: &'static str) {
        let minute = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| (d.as_secs() / 60) as i64);
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        *counts.entry((minute, operation, outcome)).or_default() += 1;
    }

    /// Adds the counts so far to `delivery_outcomes`, in one statement; returns the
    /// rows written. When the statement fails the counts are kept for the next flush.
    pub(crate) async fn flush(&self, pool: &PgPool) -> Result<usize, sqlx::Error> {
        let taken = std::mem::take(&mut *self.lock());
        if taken.is_empty() {
            return Ok(0);
        }
        let rows = taken.len();
        let (mut minutes, mut operations, mut outcomes, mut deliveries) =
            (Vec::with_capacity(rows), Vec::new(), Vec::new(), Vec::new());
        for (&(minute, operation, outcome), &n) in &taken {
            minutes.push(minute);
            operations.push(operation);
            outcomes.push(outcome);
            deliveries.push(n);
        }
        // The update leaves `expires_at` (set by the insert) alone: with no indexed
        // column changed, Postgres updates the row in place (HOT), and a flush leaves
        // no index entries behind.
        let retention_ms = i64::try_from(self.retention.as_millis()).unwrap_or(i64::MAX);
        let written = sqlx::query(
            "INSERT INTO delivery_outcomes
                 (minute, queue, operation, outcome, deliveries, expires_at)
             SELECT to_timestamp(m * 60), $1, o, r, n,
                    to_timestamp(m * 60) + $6::bigint * interval '1 millisecond'
             FROM unnest($2::bigint[], $3::text[], $4::text[], $5::bigint[])
                  WITH ORDINALITY AS t(m, o, r, n, i)
             ORDER BY i
             ON CONFLICT (queue, minute, operation, outcome) DO UPDATE
             SET deliveries = delivery_outcomes.deliveries + excluded.deliveries",
        )
        .bind(&self.queue)
        .bind(&minutes)
        .bind(&operations)
        .bind(&outcomes)
        .bind(&deliveries)
        .bind(retention_ms)
        .execute(pool)
        .await;
        match written {
            Ok(_) => Ok(rows),
            Err(error) => {
                self.keep(taken);
                Err(error)
            }
        }
    }

    /// Puts back counts whose flush failed, dropping the oldest minutes past
    /// [`MAX_ENTRIES`].
    fn keep(&self, taken: Counts) {
        let mut counts = self.lock();
        for (entry, n) in taken {
            *counts.entry(entry).or_default() += n;
        }
        while counts.len() > MAX_ENTRIES {
            counts.pop_first();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The shortest interval between two flushes.
const MIN_FLUSH_EVERY: Duration = Duration::from_millis(100);

/// Flushes `tallies` (a statement each) every `every` (at least [`MIN_FLUSH_EVERY`])
/// until `stop` is cancelled, which ends it between two flushes. The last flush is the
/// caller's, once the deliveries in flight are decided.
pub(crate) async fn flush_every(
    tallies: Vec<std::sync::Arc<Tally>>,
    pool: PgPool,
    every: Duration,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(every.max(MIN_FLUSH_EVERY));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        // Stop first: after a slow flush the next tick is ready at once too, and a
        // worker stopping should not start another.
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        for tally in &tallies {
            if let Err(error) = tally.flush(&pool).await {
                warn!(queue = %tally.queue, error = %crate::text::error_line(&error), "delivery outcomes not written; kept for the next flush");
            }
        }
    }
}

/// One row of `delivery_outcomes`.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct MinuteCount {
    /// The minute the deliveries were decided in.
    pub minute: DateTime<Utc>,
    /// The queue.
    pub queue: String,
    /// The operation.
    pub operation: String,
    /// The outcome label (see [`Line::of`]).
    pub outcome: String,
    /// Deliveries with that outcome in that minute, by every worker of the queue.
    pub deliveries: i64,
}

/// The rows of `queues` for the minutes from `first` to `last` (both included), oldest
/// first; read through the table's unique index, which leads with queue and minute.
pub async fn per_minute(
    pool: &PgPool,
    queues: &[String],
    first: DateTime<Utc>,
    last: DateTime<Utc>,
) -> Result<Vec<MinuteCount>, sqlx::Error> {
    sqlx::query_as(
        "SELECT minute, queue, operation, outcome, deliveries
         FROM delivery_outcomes
         WHERE queue = ANY($1) AND minute BETWEEN $2 AND $3
         ORDER BY minute, queue, operation, outcome",
    )
    .bind(queues)
    .bind(first)
    .bind(last)
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    use super::*;

    #[test]
    fn every_line_has_outcomes_and_dead_letter_reasons_count_once() {
        for line in Line::ALL {
            assert!(!line.as_str().is_empty());
        }
        assert_eq!(Line::of("executed"), Some(Line::Executed));
        assert_eq!(Line::of("duplicate_completed"), Some(Line::Duplicates));
        assert_eq!(Line::of("failed_transient"), Some(Line::Retried));
        assert_eq!(Line::of("dead_lettered"), Some(Line::DeadLettered));
        // A conflict is dead-lettered: `dead_lettered` counts it, not its own outcome.
        assert_eq!(Line::of("conflict"), None);
        assert_eq!(Line::of("takeover"), None);
    }

    #[test]
    fn counts_add_up_per_minute_operation_and_outcome() {
        let tally = Tally::new("q", Duration::from_secs(60));
        tally.count("op", "executed");
        tally.count("op", "executed");
        tally.count("op", "dead_lettered");
        let counts = tally.lock();
        let per_outcome: BTreeMap<_, _> = counts.iter().map(|(k, n)| (k.2, *n)).collect();
        assert_eq!(per_outcome["executed"], 2);
        assert_eq!(per_outcome["dead_lettered"], 1);
    }

    #[test]
    fn counts_kept_after_a_failed_flush_are_bounded() {
        let tally = Tally::new("q", Duration::from_secs(60));
        let mut many = Counts::new();
        for minute in 0..(MAX_ENTRIES as i64 + 10) {
            many.insert((minute, "op", "executed"), 1);
        }
        tally.keep(many);
        let counts = tally.lock();
        assert_eq!(counts.len(), MAX_ENTRIES);
        assert_eq!(
            counts.keys().next().map(|k| k.0),
            Some(10),
            "oldest dropped"
        );
    }

    /// Two workers' tallies of one queue add their counts to the same rows at once, over and
    /// over, and every count arrives; a flush that fails keeps its counts for the next.
    #[sqlx::test(migrator = "crate::db::MIGRATOR")]
    async fn racing_tallies_add_up_and_a_failed_flush_loses_nothing(
        pool_options: PgPoolOptions,
        connect: PgConnectOptions,
    ) {
        let pool = pool_options.connect_with(connect.clone()).await.unwrap();
        let week = Duration::from_secs(7 * 24 * 3600);
        let now = chrono::Utc::now();
        let (first, last) = (
            now - chrono::Duration::hours(1),
            now + chrono::Duration::hours(1),
        );
        // Counts from before and after the minutes asked for are left out.
        sqlx::query(
            "INSERT INTO delivery_outcomes (minute, queue, operation, outcome, deliveries, expires_at)
             SELECT date_trunc('minute', now()) + shift, 'q', 'jobs', 'executed', 7,
                    now() + interval '1 day'
             FROM unnest(ARRAY[interval '-2 hours', interval '2 hours']) AS shift",
        )
        .execute(&pool)
        .await
        .unwrap();
        let tallies = [
            Arc::new(Tally::new("q", week)),
            Arc::new(Tally::new("q", week)),
        ];
        let mut racers = Vec::new();
        for tally in &tallies {
            let (tally, pool) = (tally.clone(), pool.clone());
            racers.push(tokio::spawn(async move {
                for _ in 0..50 {
                    for _ in 0..10 {
                        tally.count("jobs", "executed");
                        tally.count("jobs", "duplicate_completed");
                    }
                    tally.flush(&pool).await.unwrap();
                }
            }));
        }
        for racer in racers {
            racer.await.unwrap();
        }
        let total = |rows: &[crate::tally::MinuteCount], outcome: &str| -> i64 {
            rows.iter()
                .filter(|r| r.outcome == outcome && r.queue == "q" && r.operation == "jobs")
                .map(|r| r.deliveries)
                .sum()
        };
        let rows = per_minute(&pool, &["q".into()], first, last).await.unwrap();
        assert_eq!(total(&rows, "executed"), 1_000);
        assert_eq!(total(&rows, "duplicate_completed"), 1_000);
        assert!(
            per_minute(&pool, &["other".into()], first, last)
                .await
                .unwrap()
                .is_empty(),
            "only the queues asked for"
        );

        let closed = PgPoolOptions::new().connect_with(connect).await.unwrap();
        closed.close().await;
        tallies[0].count("jobs", "dead_lettered");
        assert!(tallies[0].flush(&closed).await.is_err());
        tallies[0].count("jobs", "dead_lettered");
        assert_eq!(tallies[0].flush(&pool).await.unwrap(), 1, "one row");
        let rows = per_minute(&pool, &["q".into()], first, last).await.unwrap();
        assert_eq!(
            total(&rows, "dead_lettered"),
            2,
            "the failed flush's count kept"
        );
        assert_eq!(tallies[0].flush(&pool).await.unwrap(), 0, "nothing left");
    }
}
