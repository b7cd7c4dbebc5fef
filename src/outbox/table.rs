//! The statements on `outbox_messages`. Each is one short statement; only staging runs
//! in a caller's transaction (the operation's).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::AssertSqlSafe;
use sqlx::{PgConnection, PgPool};

use super::{FollowUp, NotBefore, Properties, backoff};
use crate::db::millis;
use crate::protect::{self, Keys};
use crate::store::{StoreError, storable};

/// A staged message that is not published yet, as a publisher took it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct OutboxRow {
    pub(crate) id: i64,
    pub(crate) message_id: String,
    pub(crate) source: String,
    pub(crate) position: i32,
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) body: Vec<u8>,
    pub(crate) properties: sqlx::types::Json<Properties>,
    /// Failed publishes before this take.
    pub(crate) attempts: i32,
    /// This take's token: the fence of what the taker writes back.
    pub(crate) take_token: i64,
}

/// Writes `message` to the outbox on `conn` (the operation's transaction). `source` is
/// the operation's key digest; the row is left to the committing worker for `handoff`.
pub(crate) async fn stage(
    conn: &mut PgConnection,
    source: &str,
    operation: &str,
    position: u32,
    message_id: &str,
    message: &FollowUp,
    handoff: Duration,
) -> Result<i64, sqlx::Error> {
    let position = i32::try_from(position).unwrap_or(i32::MAX);
    let (at, after) = match message.not_before {
        None => (None, None),
        Some(NotBefore::At(at)) => (Some(at), None),
        // Past a century it is a mistake, not a schedule; Postgres's intervals end
        // before Duration's do.
        Some(NotBefore::After(delay)) => (None, Some(millis(delay.min(CENTURY)))),
    };
    // A delayed row is due at its time, or after the handoff if that is later (greatest
    // leaves out NULLs).
    sqlx::query_scalar(
        "WITH due AS (
             SELECT CASE WHEN $10::timestamptz IS NULL AND $11::bigint IS NULL THEN NULL
                         ELSE coalesce($10, clock_timestamp() + $11 * interval '1 millisecond')
                    END AS not_before
         )
         INSERT INTO outbox_messages
             (message_id, source, operation, position, exchange, routing_key, body,
              properties, not_before, available_at)
         SELECT $1, $2, $3, $4, $5, $6, $7, $8, due.not_before,
                greatest(clock_timestamp() + $9 * interval '1 millisecond', due.not_before)
         FROM due
         RETURNING id",
    )
    .bind(message_id)
    .bind(source)
    .bind(operation)
    .bind(position)
    .bind(storable(&message.exchange).as_ref())
    .bind(storable(&message.routing_key).as_ref())
    .bind(&message.body)
    .bind(sqlx::types::Json(&message.properties))
    .bind(millis(handoff))
    .bind(at)
    .bind(after)
    .fetch_one(conn)
    .await
}

const ROW: &str = "id, message_id, source, position, exchange, routing_key, body, properties, \
                   attempts, take_token";

/// What a take writes: the row is the taker's for the lease (`$2`, in milliseconds),
/// under a token no earlier take had.
const TAKE: &str = "available_at = now() + $2 * interval '1 millisecond', \
                    take_token = nextval('outbox_messages_take_seq')";

/// The committing workers take the rows they staged (of the operations that committed
/// together), unless a relay took them first.
pub(crate) async fn take_staged(
    pool: &PgPool,
    ids: &[i64],
    lease: Duration,
    keys: Option<&Keys>,
) -> Result<Vec<OutboxRow>, StoreError> {
    opened(
        sqlx::query_as(AssertSqlSafe(format!(
            "UPDATE outbox_messages SET {TAKE}
         WHERE id = ANY($1) AND dispatched_at IS NULL AND take_token = 0
           AND (not_before IS NULL OR not_before <= now())
         RETURNING {ROW}"
        )))
        .bind(ids)
        .bind(millis(lease))
        .fetch_all(pool)
        .await?,
        keys,
    )
}

/// `rows` with their sealed bodies opened.
fn opened(mut rows: Vec<OutboxRow>, keys: Option<&Keys>) -> Result<Vec<OutboxRow>, StoreError> {
    for row in &mut rows {
        row.body = protect::open_body(keys, std::mem::take(&mut row.body))?;
    }
    Ok(rows)
}

/// A relay takes up to `batch` rows that are due, the longest due first (through the
/// index of due times), skipping rows another publisher is taking at this moment; they
/// are its own for `lease`.
pub(crate) async fn take_due(
    pool: &PgPool,
    batch: i64,
    lease: Duration,
    keys: Option<&Keys>,
) -> Result<Vec<OutboxRow>, StoreError> {
    opened(
        sqlx::query_as(AssertSqlSafe(format!(
            "UPDATE outbox_messages SET {TAKE}
         WHERE id IN (SELECT id FROM outbox_messages
                      WHERE dispatched_at IS NULL AND available_at <= now()
                      ORDER BY available_at LIMIT $1
                      FOR UPDATE SKIP LOCKED)
         RETURNING {ROW}"
        )))
        .bind(batch)
        .bind(millis(lease))
        .fetch_all(pool)
        .await?,
        keys,
    )
}

/// For each of `sources`, the first message not yet dispatched among rows other than
/// `held`: its position, and when it is due again if its last publish failed. A held
/// row after it must wait, or the operation's messages go out of order. A delayed row
/// not due yet holds nothing back: it goes out when it is due.
pub(crate) async fn first_waiting(
    pool: &PgPool,
    sources: &[String],
    held: &[i64],
) -> Result<Vec<(String, i32, Option<DateTime<Utc>>)>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT DISTINCT ON (source) source, position,
                CASE WHEN last_error IS NOT NULL THEN available_at END
         FROM outbox_messages
         WHERE source = ANY($1) AND dispatched_at IS NULL AND NOT (id = ANY($2))
           AND (not_before IS NULL OR not_before <= now())
         ORDER BY source, position",
    )
    .bind(sources)
    .bind(held)
    .fetch_all(pool)
    .await?)
}

/// A taken row given back unpublished, due again at `until` (at the earliest after the
/// delay `defer` is given).
#[derive(Debug, Clone)]
pub(crate) struct Deferral {
    pub(crate) id: i64,
    /// The take's token: the fence (a row taken again since is not ours).
    pub(crate) take_token: i64,
    pub(crate) until: Option<DateTime<Utc>>,
}

/// Gives rows back without publishing them, each due again at its `until` or after
/// `after`, whichever is later.
pub(crate) async fn defer(
    pool: &PgPool,
    rows: &[Deferral],
    after: Duration,
) -> Result<(), StoreError> {
    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    let tokens: Vec<i64> = rows.iter().map(|r| r.take_token).collect();
    let until: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.until).collect();
    sqlx::query(
        "UPDATE outbox_messages o
         SET available_at = greatest(d.until, now() + $4 * interval '1 millisecond')
         FROM unnest($1::bigint[], $2::bigint[], $3::timestamptz[]) AS d(id, token, until)
         WHERE o.id = d.id AND o.take_token = d.token AND o.dispatched_at IS NULL",
    )
    .bind(&ids)
    .bind(&tokens)
    .bind(&until)
    .bind(millis(after))
    .execute(pool)
    .await?;
    Ok(())
}

/// Marks published rows dispatched; they expire after `retention`.
pub(crate) async fn mark_dispatched(
    pool: &PgPool,
    ids: &[i64],
    retention: Duration,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE outbox_messages
         SET dispatched_at = now(), expires_at = now() + $2 * interval '1 millisecond',
             last_error = NULL
         WHERE id = ANY($1) AND dispatched_at IS NULL",
    )
    .bind(ids)
    .bind(millis(retention))
    .execute(pool)
    .await?;
    Ok(())
}

/// Records why a row was not published (one more failed attempt), and when it is due
/// again.
pub(crate) async fn mark_failed(
    pool: &PgPool,
    row: &OutboxRow,
    why: &str,
) -> Result<(), StoreError> {
    // Fenced by the take: a row another publisher took since (after this one's lease
    // ended) is not this one's to reschedule.
    sqlx::query(
        "UPDATE outbox_messages
         SET available_at = now() + $2 * interval '1 millisecond', last_error = $3,
             attempts = attempts + 1
         WHERE id = $1 AND dispatched_at IS NULL AND take_token = $4",
    )
    .bind(row.id)
    .bind(millis(backoff(row.attempts + 1)))
    .bind(storable(why).as_ref())
    .bind(row.take_token)
    .execute(pool)
    .await?;
    Ok(())
}

/// The backlog, for `idem outbox stats` and the metrics.
#[derive(Debug, Clone, Default, PartialEq, sqlx::FromRow)]
pub struct OutboxStats {
    /// Staged messages due and not published yet.
    pub undispatched: i64,
    /// The oldest of them, in seconds since it was due (staged, or its delay ended).
    pub oldest_age_s: Option<f64>,
    /// Undispatched messages whose last publish failed (returned as unroutable, nacked,
    /// not confirmed in time).
    pub failing: i64,
    /// Delayed messages not due yet: scheduled, not a backlog.
    pub scheduled: i64,
    /// When the next of them is due.
    pub next_due: Option<DateTime<Utc>>,
}

/// Counts the backlog through the partial index of undispatched rows (what the relays
/// refresh the metrics with, every few seconds). Scheduled messages are counted apart:
/// a reminder due tomorrow is no backlog, and its age alarms nobody.
pub async fn stats(pool: &PgPool) -> Result<OutboxStats, StoreError> {
    Ok(sqlx::query_as(
        "SELECT count(*) FILTER (WHERE NOT scheduled) AS undispatched,
                extract(epoch FROM now() - min(greatest(not_before, staged_at))
                                           FILTER (WHERE NOT scheduled))::float8
                    AS oldest_age_s,
                count(*) FILTER (WHERE last_error IS NOT NULL) AS failing,
                count(*) FILTER (WHERE scheduled) AS scheduled,
                min(not_before) FILTER (WHERE scheduled) AS next_due
         FROM (SELECT *, coalesce(not_before > now(), false) AS scheduled
               FROM outbox_messages WHERE dispatched_at IS NULL) AS undispatched",
    )
    .fetch_one(pool)
    .await?)
}

/// How long until the next undispatched row is due (zero when one is due now; none
/// when there is none), by the database's clock, through the index of due times: what
/// a relay sleeps at most.
pub(crate) async fn until_next_due(pool: &PgPool) -> Result<Option<Duration>, StoreError> {
    let seconds: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM min(available_at) - now())::float8
         FROM outbox_messages WHERE dispatched_at IS NULL",
    )
    .fetch_one(pool)
    .await?;
    Ok(seconds.map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)))
}

/// Dispatched messages kept until their retention ends: every one of them is counted
/// (through the index of `expires_at`), so this is for an operator's question, not for a
/// loop.
pub async fn dispatched(pool: &PgPool) -> Result<i64, StoreError> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE expires_at IS NOT NULL")
            .fetch_one(pool)
            .await?,
    )
}

/// One outbox row as operators see it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OutboxEntry {
    /// The row.
    pub id: i64,
    /// The AMQP `message_id`.
    pub message_id: String,
    /// The source operation's key digest (its first 12 digits are the short hash).
    pub source: String,
    /// The source operation's name.
    pub operation: String,
    /// Its position among the operation's messages.
    pub position: i32,
    /// Where it goes.
    pub exchange: String,
    /// Where it goes.
    pub routing_key: String,
    /// When it was staged.
    pub staged_at: DateTime<Utc>,
    /// Publishes tried.
    pub attempts: i32,
    /// Why the last one failed.
    pub last_error: Option<String>,
    /// When it was published, if it was.
    pub dispatched_at: Option<DateTime<Utc>>,
    /// A delayed message's time: not published before it.
    pub not_before: Option<DateTime<Utc>>,
    /// The body's size in bytes.
    pub body_bytes: i32,
}

/// Undispatched rows (or, with `all`, every row), oldest first; `failing` keeps only
/// those whose last publish failed.
pub async fn list(
    pool: &PgPool,
    all: bool,
    failing: bool,
    limit: i64,
) -> Result<Vec<OutboxEntry>, StoreError> {
    // Two statements rather than one with `$1 OR …`, so that the usual question (the
    // backlog) is answered from the partial index of undispatched rows.
    let which = match (all, failing) {
        (false, false) => "dispatched_at IS NULL",
        (false, true) => "dispatched_at IS NULL AND last_error IS NOT NULL",
        (true, false) => "true",
        (true, true) => "last_error IS NOT NULL",
    };
    Ok(sqlx::query_as(AssertSqlSafe(format!(
        "SELECT {ENTRY} FROM outbox_messages WHERE {which}
         ORDER BY id LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// Delayed messages not due yet, the soonest first (through the index of due times).
pub async fn scheduled(pool: &PgPool, limit: i64) -> Result<Vec<OutboxEntry>, StoreError> {
    Ok(sqlx::query_as(AssertSqlSafe(format!(
        "SELECT {ENTRY} FROM outbox_messages
         WHERE dispatched_at IS NULL AND not_before > now()
         ORDER BY available_at LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// The columns of an [`OutboxEntry`].
const ENTRY: &str = "id, message_id, source, operation, position, exchange, routing_key, \
                     staged_at, attempts, last_error, dispatched_at, not_before, \
                     octet_length(body) AS body_bytes";

/// The longest delay a follow-up is staged with.
const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
