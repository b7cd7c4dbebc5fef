//! What operators see of flow control (`idem flow`, the console), and closing a
//! circuit by hand.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// Where a circuit stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// Deliveries are taken.
    Closed,
    /// One probe delivery is running; the others wait.
    HalfOpen,
    /// No delivery is taken until the pause ends.
    Open,
}

impl CircuitState {
    /// The name in logs, `/healthz` and `idem flow`.
    pub fn as_str(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::HalfOpen => "half_open",
            CircuitState::Open => "open",
        }
    }

    pub(crate) fn parse(state: &str) -> Self {
        match state {
            "open" => CircuitState::Open,
            "half_open" => CircuitState::HalfOpen,
            _ => CircuitState::Closed,
        }
    }

    /// `idem_circuit_state`: 0 closed, 1 half-open, 2 open.
    pub(crate) fn gauge(self) -> f64 {
        match self {
            CircuitState::Closed => 0.0,
            CircuitState::HalfOpen => 1.0,
            CircuitState::Open => 2.0,
        }
    }
}

/// A circuit as its row says.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct CircuitRow {
    /// The queue.
    pub name: String,
    /// `closed`, `open` or `half_open` (see [`CircuitState`]).
    pub state: String,
    /// Opens since it last closed (the backoff's step).
    pub opens: i32,
    /// Open: when the next probe may go; half-open: when the probe's turn ends.
    pub retry_at: Option<DateTime<Utc>>,
    /// The failure that opened it, or the note of the operator who closed it.
    pub reason: Option<String>,
    /// When it last changed state.
    pub changed_at: DateTime<Utc>,
}

impl CircuitRow {
    /// Its state.
    pub fn state(&self) -> CircuitState {
        CircuitState::parse(&self.state)
    }
}

/// A limit's use, as its rows say.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct LimitRow {
    /// The limit's name.
    pub name: String,
    /// Its concurrency slots (0: no concurrency bound).
    pub slots: i64,
    /// Slots held now (by a live holder: an expired one counts as free).
    pub held: i64,
    /// Who holds them (`host:pid`), each once.
    pub holders: Vec<String>,
    /// Its calls per second (0: no rate bound).
    pub per_second: i64,
    /// Calls in the last second.
    pub last_second: i64,
}

/// Every circuit that ever opened, by name.
pub async fn circuits(pool: &PgPool) -> Result<Vec<CircuitRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT name, state, opens, retry_at, reason, changed_at FROM flow_circuits ORDER BY name",
    )
    .fetch_all(pool)
    .await
}

/// Every limit used on this database, with its use now.
pub async fn limits(pool: &PgPool) -> Result<Vec<LimitRow>, sqlx::Error> {
    sqlx::query_as(
        "WITH p AS (
            SELECT name, count(*) AS slots,
                   count(*) FILTER (WHERE holder IS NOT NULL AND held_until >= clock_timestamp()) AS held,
                   coalesce(array_agg(DISTINCT holder) FILTER (WHERE holder IS NOT NULL AND held_until >= clock_timestamp()), '{}') AS holders
              FROM flow_permits GROUP BY name),
         r AS (
            SELECT name, count(*) AS per_second,
                   count(*) FILTER (WHERE used_at > clock_timestamp() - interval '1 second') AS last_second
              FROM flow_rate_slots GROUP BY name)
         SELECT coalesce(p.name, r.name) AS name,
                coalesce(p.slots, 0) AS slots, coalesce(p.held, 0) AS held,
                coalesce(p.holders, '{}') AS holders,
                coalesce(r.per_second, 0) AS per_second, coalesce(r.last_second, 0) AS last_second
           FROM p FULL JOIN r ON p.name = r.name
          ORDER BY 1",
    )
    .fetch_all(pool)
    .await
}

/// Closes queue `name`'s circuit by hand, keeping `note` as its reason: the workers
/// take its deliveries again within a second. The state it had, or none when no such
/// circuit ever opened.
pub async fn close_circuit(
    pool: &PgPool,
    name: &str,
    note: &str,
) -> Result<Option<CircuitState>, sqlx::Error> {
    let before: Option<(String,)> = sqlx::query_as(
        "WITH old AS (SELECT state FROM flow_circuits WHERE name = $1 FOR UPDATE)
         UPDATE flow_circuits c
            SET state = 'closed', generation = generation + 1, opens = 0, retry_at = NULL,
                reason = $2, changed_at = now()
           FROM old WHERE c.name = $1
         RETURNING old.state",
    )
    .bind(name)
    .bind(super::circuit::reason(Some(note)))
    .fetch_optional(pool)
    .await?;
    Ok(before.map(|(state,)| CircuitState::parse(&state)))
}
