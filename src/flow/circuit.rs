//! A queue's circuit at run time, shared by every worker process through its row in
//! `flow_circuits`: each process counts its own runs and opens the circuit when its
//! count says so; every process reads the row every second; when the pause ends one
//! process (the first to take the turn) lets one delivery through as the probe, and
//! its run closes the circuit or opens it again for twice as long.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::CircuitState;
use super::breaker::{CircuitBreaker, Tripwire};
use crate::store::storable;

/// The longest reason kept on the row.
const REASON_MAX: usize = 500;

/// An error's text as the row keeps it: without NUL, at most [`REASON_MAX`] bytes.
pub(super) fn reason(error: Option<&str>) -> Option<String> {
    error.map(|e| {
        let mut text = storable(e).into_owned();
        if text.len() > REASON_MAX {
            let mut cut = REASON_MAX;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        text
    })
}

/// How often a worker reads its circuits' rows: another process's open (or an
/// operator's close) is seen within this.
const POLL: Duration = Duration::from_secs(1);

/// The longest a probe keeps its turn (see `renew_turn`).
const LONGEST_PROBE: Duration = Duration::from_secs(300);

/// What this process knows of the row.
#[derive(Debug, Clone, Copy, PartialEq)]
struct View {
    state: CircuitState,
    generation: i64,
    /// Open: when the probe may go; half-open: when the probe's turn ends.
    until: Option<Instant>,
}

/// How a delivery was let in, and in which of the circuit's generations: a run is
/// counted only while the circuit is still in it (a call that started before a probe
/// closed the circuit and failed after does not open it again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// The circuit is closed (or the queue has no breaker: generation 0).
    Closed(i64),
    /// This delivery is the probe of the turn the circuit's `generation` names.
    Probe(i64),
}

impl Admission {
    /// A queue without a breaker.
    pub(crate) const UNBROKEN: Admission = Admission::Closed(0);
}

/// A probe's turn, held by its delivery's task: renewed while the probe runs, so that
/// a slow run keeps it; given back when dropped if its run did not decide it (the
/// delivery was a duplicate, or never reached its handler).
pub(crate) struct Turn {
    circuit: Arc<Circuit>,
    generation: i64,
    renew: JoinHandle<()>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.renew.abort();
        let (circuit, generation) = (self.circuit.clone(), self.generation);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { circuit.give_back(generation).await });
        }
    }
}

/// What a run said of the dependency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Run {
    /// It answered (a success, or a permanent failure).
    Answered,
    /// It did not (a transient or uncertain failure).
    Failed,
}

/// A queue's circuit.
pub(crate) struct Circuit {
    name: String,
    config: CircuitBreaker,
    pool: PgPool,
    /// How long a probe's turn lasts: past it, another process may probe.
    turn: Duration,
    view: watch::Sender<View>,
    tripwire: Mutex<Tripwire>,
    /// Told of each change of state (the process's `/healthz`).
    on_change: Box<dyn Fn(CircuitState) + Send + Sync>,
}

impl Circuit {
    /// The circuit of queue `name`, closed until its row is read; `on_change` is told
    /// of each change of its state.
    pub(crate) fn new(
        name: &str,
        config: CircuitBreaker,
        pool: PgPool,
        turn: Duration,
        on_change: impl Fn(CircuitState) + Send + Sync + 'static,
    ) -> Self {
        let closed = View {
            state: CircuitState::Closed,
            generation: 0,
            until: None,
        };
        on_change(CircuitState::Closed);
        ::metrics::gauge!("idem_circuit_state", "queue" => name.to_owned())
            .set(CircuitState::Closed.gauge());
        Self {
            name: name.to_owned(),
            config,
            pool,
            turn,
            view: watch::channel(closed).0,
            tripwire: Mutex::new(Tripwire::new()),
            on_change: Box::new(on_change),
        }
    }

    /// Whether a delivery let in as `admission` may run now: the circuit is closed, or
    /// it is this delivery's probe turn.
    pub(crate) fn admits(&self, admission: Admission) -> bool {
        let view = *self.view.borrow();
        match (view.state, admission) {
            (CircuitState::Closed, Admission::Closed(_)) => true,
            // The probe closed it: its delivery goes on as any other.
            (CircuitState::Closed, Admission::Probe(_)) => true,
            (CircuitState::HalfOpen, Admission::Probe(generation)) => generation == view.generation,
            _ => false,
        }
    }

    /// Waits until the circuit lets the delivery in hand run: at once while it is
    /// closed; while it is open, until its pause ends and this process takes the
    /// probe's turn (the [`Turn`], which the delivery's task holds until it is done).
    /// `None` on `shutdown`, or once `alive` says the delivery's channel is gone.
    pub(crate) async fn admit(
        self: &Arc<Self>,
        shutdown: &CancellationToken,
        alive: impl Fn() -> bool,
    ) -> Option<(Admission, Option<Turn>)> {
        let mut changes = self.view.subscribe();
        loop {
            // A channel that closed meanwhile (a lost connection, a delivery past the
            // broker's consumer timeout): the session ends and reconnects.
            if !alive() {
                return None;
            }
            let view = *changes.borrow_and_update();
            if view.state == CircuitState::Closed {
                return Some((Admission::Closed(view.generation), None));
            }
            let due = view.until.is_none_or(|until| until <= Instant::now());
            if due {
                match self.take_turn().await {
                    Ok(Some(generation)) => {
                        let turn = Turn {
                            circuit: self.clone(),
                            generation,
                            renew: tokio::spawn(self.clone().renew_turn(generation)),
                        };
                        return Some((Admission::Probe(generation), Some(turn)));
                    }
                    // Another process was first: read its turn's end now, rather
                    // than trying again every few milliseconds until the next poll.
                    Ok(None) => {
                        if let Err(error) = self.refresh().await {
                            warn!(queue = %self.name, error = %error, "circuit: state not read");
                        }
                    }
                    Err(error) => {
                        warn!(queue = %self.name, error = %error, "circuit: the probe's turn not taken");
                        // The database is down: try again at the next poll, not at once.
                        tokio::select! {
                            _ = tokio::time::sleep(POLL) => {}
                            _ = shutdown.cancelled() => return None,
                        }
                        continue;
                    }
                }
            }
            let wait = view
                .until
                .map_or(POLL, |until| {
                    until.saturating_duration_since(Instant::now())
                })
                .clamp(Duration::from_millis(10), POLL);
            tokio::select! {
                _ = changes.changed() => {}
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => return None,
            }
        }
    }

    /// Keeps the probe's turn of `generation` while its run goes on, up to
    /// [`LONGEST_PROBE`]: a probe whose call hangs must not keep every worker of the
    /// queue waiting; past it another process probes, and the hung one's late result
    /// is fenced off by the generation.
    async fn renew_turn(self: Arc<Self>, generation: i64) {
        let started = Instant::now();
        loop {
            tokio::time::sleep(self.turn / 3).await;
            if started.elapsed() + self.turn > LONGEST_PROBE {
                warn!(queue = %self.name, "circuit: the probe runs too long; its turn ends, another delivery probes");
                return;
            }
            let renewed = sqlx::query(
                "UPDATE flow_circuits SET retry_at = now() + $3 * interval '1 millisecond'
                  WHERE name = $1 AND state = 'half_open' AND generation = $2",
            )
            .bind(&self.name)
            .bind(generation)
            .bind(self.turn.as_millis() as f64)
            .execute(&self.pool)
            .await;
            match renewed {
                Ok(done) if done.rows_affected() == 0 => return,
                Ok(_) => {}
                Err(error) => {
                    warn!(queue = %self.name, error = %error, "circuit: the probe's turn not renewed")
                }
            }
        }
    }

    /// Counts a run of a delivery let in as `admission`: a probe's run closes the
    /// circuit or opens it again; another run may open it.
    pub(crate) async fn ran(&self, run: Run, admission: Admission, error: Option<&str>) {
        let result = match (admission, run) {
            (Admission::Probe(generation), Run::Answered) => self.close(generation).await,
            (Admission::Probe(generation), Run::Failed) => self.reopen(generation, error).await,
            // A run of an earlier generation (it started before the circuit last
            // changed) says nothing of the dependency now.
            (Admission::Closed(generation), _) if generation != self.view.borrow().generation => {
                Ok(())
            }
            (Admission::Closed(_), Run::Answered) => {
                self.wire().succeeded(&self.config, Instant::now());
                Ok(())
            }
            (Admission::Closed(generation), Run::Failed) => {
                let trips = self.wire().failed(&self.config, Instant::now());
                if trips && self.view.borrow().state == CircuitState::Closed {
                    self.open(error, generation).await
                } else {
                    Ok(())
                }
            }
        };
        if let Err(error) = result {
            warn!(queue = %self.name, error = %error, "circuit: state not written");
        }
    }

    /// Gives the probe's turn of `generation` back if its run did not decide it (a
    /// duplicate, a delivery that never reached its handler): the next delivery
    /// probes. Fenced: a decided turn is another generation by now.
    async fn give_back(&self, generation: i64) {
        let given_back = sqlx::query_as::<_, (i64, Option<f64>)>(
            "UPDATE flow_circuits SET state = 'open', generation = generation + 1, retry_at = now()
             WHERE name = $1 AND state = 'half_open' AND generation = $2
             RETURNING generation, 0::float8",
        )
        .bind(&self.name)
        .bind(generation)
        .fetch_optional(&self.pool)
        .await;
        match given_back {
            Ok(Some(row)) => self.saw(CircuitState::Open, row),
            Ok(None) => {}
            Err(error) => {
                warn!(queue = %self.name, error = %error, "circuit: probe turn not given back")
            }
        }
    }

    /// Reads the row every second until `stop`, so that what other processes (or an
    /// operator) did is seen here.
    pub(crate) async fn watch(&self, stop: CancellationToken) {
        loop {
            if let Err(error) = self.refresh().await {
                warn!(queue = %self.name, error = %error, "circuit: state not read");
            }
            tokio::select! {
                _ = tokio::time::sleep(POLL) => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    /// Reads the row.
    async fn refresh(&self) -> Result<(), sqlx::Error> {
        let row = sqlx::query_as::<_, (String, i64, Option<f64>)>(
            "SELECT state, generation, extract(epoch FROM retry_at - now())::float8 * 1000
               FROM flow_circuits WHERE name = $1",
        )
        .bind(&self.name)
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some((state, generation, until)) => {
                self.saw(CircuitState::parse(&state), (generation, until));
            }
            None => self.saw(CircuitState::Closed, (0, None)),
        }
        Ok(())
    }

    /// Opens the circuit for the first pause, if it is still closed in `generation`
    /// (the one the failed runs were admitted in: a view a second old must not reopen
    /// what another process's probe just closed).
    async fn open(&self, error: Option<&str>, generation: i64) -> Result<(), sqlx::Error> {
        let row = sqlx::query_as::<_, (i64, Option<f64>)>(
            "INSERT INTO flow_circuits (name, state, generation, opens, retry_at, reason, changed_at)
             VALUES ($1, 'open', 1, 1, now() + $2 * interval '1 millisecond', $3, now())
             ON CONFLICT (name) DO UPDATE
                SET state = 'open', generation = flow_circuits.generation + 1, opens = 1,
                    retry_at = excluded.retry_at, reason = excluded.reason, changed_at = now()
                WHERE flow_circuits.state = 'closed' AND flow_circuits.generation = $4
             RETURNING generation, $2::float8",
        )
        .bind(&self.name)
        .bind(self.config.open_for.as_millis() as f64)
        .bind(reason(error))
        .bind(generation)
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(row) => {
                warn!(queue = %self.name, pause_ms = self.config.open_for.as_millis() as u64, error = error.unwrap_or_default(), "circuit open: the queue's deliveries wait in the broker");
                self.saw(CircuitState::Open, row);
            }
            // Another process opened it (or probes): read where it stands now rather
            // than at the next poll.
            None => self.refresh().await?,
        }
        Ok(())
    }

    /// Takes the probe's turn of an open circuit whose pause ended (or of a half-open
    /// one whose probe's turn ran out): the generation it wrote, or none when another
    /// process was first.
    async fn take_turn(&self) -> Result<Option<i64>, sqlx::Error> {
        let row = sqlx::query_as::<_, (i64, Option<f64>)>(
            "UPDATE flow_circuits
                SET state = 'half_open', generation = generation + 1,
                    retry_at = now() + $2 * interval '1 millisecond', changed_at = now()
              WHERE name = $1
                AND ((state = 'open' AND retry_at <= now()) OR (state = 'half_open' AND retry_at < now()))
              RETURNING generation, $2::float8",
        )
        .bind(&self.name)
        .bind(self.turn.as_millis() as f64)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|row| {
            info!(queue = %self.name, "circuit half-open: one delivery probes");
            self.saw(CircuitState::HalfOpen, row);
            row.0
        }))
    }

    /// The probe of `generation` succeeded: closed.
    async fn close(&self, generation: i64) -> Result<(), sqlx::Error> {
        let row = sqlx::query_as::<_, (i64, Option<f64>)>(
            "UPDATE flow_circuits
                SET state = 'closed', generation = generation + 1, opens = 0, retry_at = NULL,
                    reason = NULL, changed_at = now()
              WHERE name = $1 AND state = 'half_open' AND generation = $2
              RETURNING generation, NULL::float8",
        )
        .bind(&self.name)
        .bind(generation)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(row) = row {
            info!(queue = %self.name, "circuit closed: the probe succeeded");
            self.saw(CircuitState::Closed, row);
        }
        Ok(())
    }

    /// The probe of `generation` failed: open again, for twice the last pause.
    async fn reopen(&self, generation: i64, error: Option<&str>) -> Result<(), sqlx::Error> {
        let row = sqlx::query_as::<_, (i64, Option<f64>)>(
            "UPDATE flow_circuits
                SET state = 'open', generation = generation + 1, opens = opens + 1,
                    retry_at = now() + LEAST($3 * power(2, LEAST(opens, 30)), $4) * interval '1 millisecond',
                    reason = $5, changed_at = now()
              WHERE name = $1 AND state = 'half_open' AND generation = $2
              RETURNING generation, extract(epoch FROM retry_at - now())::float8 * 1000",
        )
        .bind(&self.name)
        .bind(generation)
        .bind(self.config.open_for.as_millis() as f64)
        .bind(self.config.max_open.as_millis() as f64)
        .bind(reason(error))
        .fetch_optional(&self.pool)
        .await?;
        if let Some(row) = row {
            warn!(queue = %self.name, pause_ms = row.1.unwrap_or_default() as u64, error = error.unwrap_or_default(), "circuit open again: the probe failed");
            self.saw(CircuitState::Open, row);
        }
        Ok(())
    }

    /// Takes in what the row says: `state` at `generation`, `until` in milliseconds
    /// from now. A new generation forgets the runs counted before it.
    fn saw(&self, state: CircuitState, (generation, until): (i64, Option<f64>)) {
        // At most a day ahead: a time set by hand (`infinity`) must not overflow.
        let until = until.map(|ms| {
            let ahead = Duration::from_millis(ms.clamp(0.0, 86_400_000.0) as u64);
            Instant::now() + ahead
        });
        let next = View {
            state,
            generation,
            until,
        };
        let (mut fresh, mut moved) = (false, false);
        self.view.send_if_modified(|view| {
            // A read that an own transition overtook is older: kept out (a row deleted
            // by hand starts again from 0).
            if generation < view.generation && generation != 0 {
                return false;
            }
            if view.generation == generation && view.state == state {
                // The same turn: only the deadline, read again, may have moved.
                view.until = until;
                return false;
            }
            fresh = view.generation != generation;
            moved = view.state != state;
            *view = next;
            true
        });
        if fresh {
            self.wire().reset();
        }
        if moved {
            (self.on_change)(state);
            ::metrics::gauge!("idem_circuit_state", "queue" => self.name.clone())
                .set(state.gauge());
            info!(queue = %self.name, state = state.as_str(), "circuit state");
        }
    }

    fn wire(&self) -> std::sync::MutexGuard<'_, Tripwire> {
        self.tripwire.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
