//! Limits on a named dependency (a mail provider allows 10 calls at once and 50 a
//! second), held in Postgres so that every worker process that uses the name shares
//! them: a concurrency permit is a slot row taken under a lease its holder renews, a
//! call per second a slot row stamped with the call's time.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use rand::Rng;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tracing::warn;

use crate::db::Moved;
use crate::handler::HandlerError;

/// The longest pause between two tries for a concurrency permit held in another
/// process (one released in this process wakes its waiters at once).
const LONGEST_POLL: Duration = Duration::from_millis(50);

/// Connections of a limit's own pool in a process: its queries are short, and at
/// most one per waiter is in flight at once.
const CONNECTIONS: u32 = 4;

/// The most slots of a limit: a row each.
const MAX_SLOTS: u32 = 100_000;

/// At most `concurrent` calls at once and `per_second` calls in any second to a named
/// dependency, shared by every worker process that uses the name on one database (or,
/// [`per_process`](Limit::per_process), by this process's handlers only).
///
/// A handler holds a [`Permit`] around its call. Waiting for one happens inside the
/// handler's run, under its lease's heartbeat, and holds back only the deliveries that
/// wait: other queues' handlers run on. A permit whose process dies is freed when its
/// lease ([`held_for`](Limit::held_for), renewed while it is held) runs out.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), idem::HandlerError> {
/// use idem::Limit;
/// // Built once, kept in the handler beside its client:
/// let mail = Limit::new("mail", pool).concurrent(10).per_second(50);
/// // In `handle`:
/// let permit = mail.acquire().await?;
/// // ... call the mail provider ...
/// drop(permit);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Limit {
    name: String,
    /// The store's pool: where its own pool connects, following it to another host of
    /// a host list.
    store: PgPool,
    concurrent: Option<u32>,
    per_second: Option<u32>,
    held_for: Duration,
    shared: bool,
    state: Arc<State>,
}

impl std::fmt::Debug for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limit")
            .field("name", &self.name)
            .field("concurrent", &self.concurrent)
            .field("per_second", &self.per_second)
            .field("held_for", &self.held_for)
            .field("shared", &self.shared)
            .finish_non_exhaustive()
    }
}

/// What the clones of one limit share in this process.
#[derive(Default)]
struct State {
    /// The limit's own pool, made at its first use (in the runtime).
    pool: OnceLock<PgPool>,
    /// The store pool's options its own pool connects with, and when they last changed.
    following: Mutex<Option<Arc<PgConnectOptions>>>,
    moved: Moved,
    /// At most `concurrent` waiters or holders in this process: no more could hold a
    /// permit, and no more poll for one.
    local: OnceLock<Arc<Semaphore>>,
    /// The slot rows exist.
    slots_ready: tokio::sync::OnceCell<()>,
    /// A permit of this process was released.
    released: Notify,
    /// Per-process limits: the times of the last `per_second` calls.
    calls: Mutex<VecDeque<Instant>>,
}

/// Why no permit could be taken: the database failed. Into [`HandlerError`] it is a
/// transient failure (the delivery is retried).
#[derive(Debug, thiserror::Error)]
#[error("limit {limit}: the permit could not be taken")]
pub struct LimitError {
    limit: String,
    #[source]
    source: sqlx::Error,
}

impl From<LimitError> for HandlerError {
    fn from(error: LimitError) -> Self {
        HandlerError::transient(crate::text::error_line(&error))
    }
}

/// A permit of a [`Limit`]: one of its concurrent calls, and one of this second's.
///
/// Held under a lease its task renews: if the database cannot be reached for longer
/// than the lease, the slot may be taken by another process while this one still
/// calls (a warning says so), one call more than the bound. An `acquire` cancelled
/// between its take and its answer leaves the slot taken until the lease ends.
/// Dropping it frees the concurrency slot (in a task of its own);
/// [`release`](Permit::release) frees it before returning.
#[must_use = "the permit is freed when dropped"]
pub struct Permit {
    limit: Limit,
    /// The shared slot and the token of this hold.
    slot: Option<(i32, i64)>,
    renew: Option<JoinHandle<()>>,
    local: Option<OwnedSemaphorePermit>,
}

impl Limit {
    /// A limit named `name` (the dependency's: `mail`, `payments`), on the database of
    /// `pool` (the store's), with no bound yet.
    ///
    /// Its queries run on a pool of their own on that database (at most 4
    /// connections, opened when first needed, closed after a minute idle): a handler that waits for
    /// a permit, or frees one, while its transaction holds a connection of the store's
    /// pool must not wait for another one of that pool, which every other handler may
    /// hold the same way.
    ///
    /// Permits are counted, not kept: a write lost with a crash of Postgres costs a
    /// slot for one lease, or one call too many, never an effect. So its writes commit
    /// without waiting for the WAL flush (which would triple a permit's cost), set off
    /// inside each statement: a session setting would stay behind, through a
    /// transaction pooler, on a server connection other clients use next.
    pub fn new(name: &str, pool: PgPool) -> Self {
        Self {
            name: name.to_owned(),
            store: pool,
            concurrent: None,
            per_second: None,
            held_for: Duration::from_secs(10),
            shared: true,
            state: Arc::default(),
        }
    }

    /// At most `n` calls at once (1 to 100,000: one row each).
    pub fn concurrent(self, n: u32) -> Self {
        Self {
            concurrent: Some(n.clamp(1, MAX_SLOTS)),
            state: Arc::default(),
            ..self
        }
    }

    /// At most `n` calls in any second (1 to 100,000: one row each).
    pub fn per_second(self, n: u32) -> Self {
        Self {
            per_second: Some(n.clamp(1, MAX_SLOTS)),
            state: Arc::default(),
            ..self
        }
    }

    /// The lease of a concurrency permit, renewed every third of it while held: a
    /// worker that dies holding one frees it within this (10 s by default; 300 ms to a
    /// day).
    pub fn held_for(self, lease: Duration) -> Self {
        Self {
            held_for: lease.clamp(Duration::from_millis(300), Duration::from_secs(86_400)),
            ..self
        }
    }

    /// Counted in this process only, without the database: the cheap case, for a
    /// dependency only one process calls.
    pub fn per_process(self) -> Self {
        Self {
            shared: false,
            ..self
        }
    }

    /// The limit's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits for a permit: a concurrency slot, then a call of this second.
    pub async fn acquire(&self) -> Result<Permit, LimitError> {
        let started = Instant::now();
        let local = match self.local() {
            Some(semaphore) => semaphore.acquire_owned().await.ok(),
            None => None,
        };
        let mut permit = Permit {
            limit: self.clone(),
            slot: None,
            renew: None,
            local,
        };
        if self.shared {
            self.ready().await.map_err(|e| self.error(e))?;
            if self.concurrent.is_some() {
                let slot = self.take_slot().await.map_err(|e| self.error(e))?;
                permit.slot = Some(slot);
                permit.renew = Some(tokio::spawn(renew(self.clone(), slot)));
            }
            if let Some(rate) = self.per_second {
                self.take_call(rate).await.map_err(|e| self.error(e))?;
            }
        } else if let Some(rate) = self.per_second {
            self.take_local_call(rate).await;
        }
        ::metrics::histogram!("idem_limit_wait_seconds", "limit" => self.name.clone())
            .record(started.elapsed().as_secs_f64());
        Ok(permit)
    }

    /// The limit's own pool (see [`Limit::new`]), on the store pool's host as it is now.
    fn pool(&self) -> &PgPool {
        let now = self.store.connect_options();
        let pool = self.state.pool.get_or_init(|| {
            let options = PgPoolOptions::new()
                .max_connections(CONNECTIONS)
                .min_connections(0)
                .idle_timeout(Duration::from_secs(60));
            crate::db::retiring(options, &self.state.moved).connect_lazy_with((*now).clone())
        });
        let mut following = self
            .state
            .following
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // The store's pool moved to another host since: so does this one.
        if following
            .as_ref()
            .is_some_and(|seen| !Arc::ptr_eq(seen, &now))
        {
            pool.set_connect_options((*now).clone());
            self.state.moved.now();
        }
        *following = Some(now);
        pool
    }

    fn local(&self) -> Option<Arc<Semaphore>> {
        let n = self.concurrent?;
        Some(
            self.state
                .local
                .get_or_init(|| Arc::new(Semaphore::new(n as usize)))
                .clone(),
        )
    }

    fn error(&self, source: sqlx::Error) -> LimitError {
        LimitError {
            limit: self.name.clone(),
            source,
        }
    }

    /// Creates the limit's slot rows, once per process.
    async fn ready(&self) -> Result<(), sqlx::Error> {
        self.state
            .slots_ready
            .get_or_try_init(|| async {
                // Both kinds in one statement (a kind without a bound gets none).
                sqlx::query(
                    "WITH permits AS (
                        INSERT INTO flow_permits (name, slot)
                        SELECT $1, generate_series(0, $2 - 1) ON CONFLICT DO NOTHING)
                     INSERT INTO flow_rate_slots (name, slot)
                     SELECT $1, generate_series(0, $3 - 1) ON CONFLICT DO NOTHING",
                )
                .bind(&self.name)
                .bind(self.concurrent.unwrap_or(0) as i32)
                .bind(self.per_second.unwrap_or(0) as i32)
                .execute(self.pool())
                .await?;
                Ok(())
            })
            .await
            .map(|_| ())
    }

    /// Takes a free (or expired) concurrency slot, waiting for one: its number and
    /// the token of this hold.
    async fn take_slot(&self) -> Result<(i32, i64), sqlx::Error> {
        let slots = self.concurrent.unwrap_or(0) as i32;
        let mut pause = Duration::from_millis(2);
        loop {
            let notified = self.state.released.notified();
            for (from, to) in from_anywhere(slots) {
                let taken = sqlx::query_as::<_, (i32, i64)>(
                    "UPDATE flow_permits SET holder = $4, token = token + 1,
                            held_until = clock_timestamp() + $5 * interval '1 millisecond'
                      WHERE (name, slot) = (
                            SELECT name, slot FROM flow_permits
                             WHERE name = $1 AND slot >= $2 AND slot < $3
                               AND (holder IS NULL OR held_until < clock_timestamp())
                             LIMIT 1 FOR UPDATE SKIP LOCKED)
                        AND (SELECT set_config('synchronous_commit', 'off', true)) = 'off'
                      RETURNING slot, token",
                )
                .bind(&self.name)
                .bind(from)
                .bind(to)
                .bind(holder())
                .bind(self.held_for.as_millis() as f64)
                .fetch_optional(self.pool())
                .await?;
                if let Some(slot) = taken {
                    return Ok(slot);
                }
            }
            let jittered = pause.mul_f64(rand::rng().random_range(0.5..1.5));
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(jittered) => {}
            }
            pause = (pause * 2).min(LONGEST_POLL);
        }
    }

    /// Takes one of this second's calls: a slot last stamped over a second ago (and
    /// 25 ms more: a call reaches the provider some milliseconds after its take, and
    /// two calls' latencies differ; the margin keeps a provider that counts by its own
    /// clock at `rate` too), waiting until the oldest stamp is that old.
    async fn take_call(&self, rate: u32) -> Result<(), sqlx::Error> {
        let slots = rate as i32;
        loop {
            for (from, to) in from_anywhere(slots) {
                let taken: Option<i32> = sqlx::query_scalar(
                    "UPDATE flow_rate_slots SET used_at = clock_timestamp()
                      WHERE (name, slot) = (
                            SELECT name, slot FROM flow_rate_slots
                             WHERE name = $1 AND slot >= $2 AND slot < $3
                               AND used_at <= clock_timestamp() - interval '1025 milliseconds'
                             LIMIT 1 FOR UPDATE SKIP LOCKED)
                        AND (SELECT set_config('synchronous_commit', 'off', true)) = 'off'
                      RETURNING slot",
                )
                .bind(&self.name)
                .bind(from)
                .bind(to)
                .fetch_optional(self.pool())
                .await?;
                if taken.is_some() {
                    return Ok(());
                }
            }
            // This second is full: wait until its oldest call is old enough.
            let wait_ms: Option<f64> = sqlx::query_scalar(
                "SELECT extract(epoch FROM min(used_at) + interval '1025 milliseconds' - clock_timestamp())::float8 * 1000
                   FROM flow_rate_slots WHERE name = $1 AND slot < $2",
            )
            .bind(&self.name)
            .bind(slots)
            .fetch_one(self.pool())
            .await?;
            let wait = Duration::from_millis(wait_ms.unwrap_or(1.0).clamp(1.0, 1000.0) as u64);
            let jitter = Duration::from_millis(rand::rng().random_range(0..5));
            tokio::time::sleep(wait + jitter).await;
        }
    }

    /// A per-process limit's call of this second.
    async fn take_local_call(&self, rate: u32) {
        loop {
            let wait = {
                let mut calls = self
                    .state
                    .calls
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let now = Instant::now();
                while calls
                    .front()
                    .is_some_and(|t| now.duration_since(*t) >= Duration::from_secs(1))
                {
                    calls.pop_front();
                }
                if calls.len() < rate as usize {
                    calls.push_back(now);
                    return;
                }
                calls.front().map_or(Duration::ZERO, |t| {
                    Duration::from_secs(1) - now.duration_since(*t)
                })
            };
            tokio::time::sleep(wait).await;
        }
    }
}

impl Permit {
    /// Frees the permit's concurrency slot now.
    pub async fn release(mut self) {
        if let Some(slot) = self.slot {
            // Kept until freed: a release cut short is finished by the drop.
            release(&self.limit, slot).await;
            self.slot = None;
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(renew) = self.renew.take() {
            renew.abort();
        }
        if let Some(slot) = self.slot.take() {
            let limit = self.limit.clone();
            // Without a runtime to free it on, its lease frees it.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move { release(&limit, slot).await });
            }
        }
        drop(self.local.take());
        self.limit.state.released.notify_waiters();
    }
}

/// Frees a shared slot (fenced by the hold's token) and wakes this process's waiters.
async fn release(limit: &Limit, (slot, token): (i32, i64)) {
    let freed = sqlx::query(
        "UPDATE flow_permits SET holder = NULL, held_until = NULL
          WHERE name = $1 AND slot = $2 AND token = $3
            AND (SELECT set_config('synchronous_commit', 'off', true)) = 'off'",
    )
    .bind(&limit.name)
    .bind(slot)
    .bind(token)
    .execute(limit.pool())
    .await;
    if let Err(error) = freed {
        warn!(limit = %limit.name, error = %error, "permit not freed: its lease frees it");
    }
    limit.state.released.notify_waiters();
}

/// Renews a held slot every third of its lease until the permit is dropped.
async fn renew(limit: Limit, (slot, token): (i32, i64)) {
    loop {
        tokio::time::sleep(limit.held_for / 3).await;
        let renewed = sqlx::query(
            "UPDATE flow_permits SET held_until = clock_timestamp() + $4 * interval '1 millisecond'
              WHERE name = $1 AND slot = $2 AND token = $3
                AND (SELECT set_config('synchronous_commit', 'off', true)) = 'off'",
        )
        .bind(&limit.name)
        .bind(slot)
        .bind(token)
        .bind(limit.held_for.as_millis() as f64)
        .execute(limit.pool())
        .await;
        match renewed {
            Ok(done) if done.rows_affected() == 0 => {
                warn!(limit = %limit.name, slot, "permit lost: its lease ran out before it was renewed");
                return;
            }
            Ok(_) => {}
            Err(error) => warn!(limit = %limit.name, error = %error, "permit not renewed"),
        }
    }
}

/// The slot ranges a take looks through: from a random slot to the last, then from
/// the first: the takes of many callers spread over the slots instead of all reading
/// past the same busy ones at the start.
fn from_anywhere(slots: i32) -> impl Iterator<Item = (i32, i32)> {
    let start = if slots > 1 {
        rand::rng().random_range(0..slots)
    } else {
        0
    };
    [(start, slots), (0, start)]
        .into_iter()
        .filter(|(from, to)| from < to)
}

/// Who holds a permit, for `idem flow`: this process.
fn holder() -> &'static str {
    static HOLDER: OnceLock<String> = OnceLock::new();
    HOLDER.get_or_init(|| {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "worker".into());
        format!("{host}:{}", std::process::id())
    })
}
