//! Metrics (`idem_*`, through the `metrics` facade) and the `/metrics` + `/healthz` server.
//!
//! The worker and the store record through the `metrics` macros, which cost nothing
//! until a recorder is installed. [`serve`] installs the Prometheus recorder and answers
//! `GET /metrics` (Prometheus text format) and `GET /healthz` (200 only while every
//! queue is consuming and the database is reachable; a 503 says which is down and why,
//! one line per queue).
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `idem_deliveries_total` | counter | `operation`, `outcome` |
//! | `idem_replayed_deliveries_total` | counter | `operation`, `outcome` |
//! | `idem_handler_duration_seconds` | histogram | `operation` |
//! | `idem_store_round_trip_seconds` | histogram | `call` |
//! | `idem_oldest_pending_age_seconds` | gauge | |
//! | `idem_oldest_processing_age_seconds` | gauge | |
//! | `idem_retries_overdue` | gauge | `operation` |
//! | `idem_gc_deleted_total` | counter | `table` (`records`, `follow-ups`, `outcomes`) |
//! | `idem_gc_batch_seconds` | histogram | |
//! | `idem_gc_expired_rows`, `idem_gc_oldest_expired_age_seconds` | gauge | `table` |
//! | `idem_outbox_published_total` | counter | |
//! | `idem_outbox_publish_failures_total` | counter | |
//! | `idem_outbox_pending`, `idem_outbox_failing` | gauge | |
//! | `idem_outbox_oldest_age_seconds` | gauge | |
//! | `idem_http_requests_total` | counter | `operation` (`POST /payments`), `outcome` |
//! | `idem_store_up` (every 5 s), `idem_broker_up` (as it changes) | gauge, 1 or 0 | |
//! | `idem_queue_up` (as it changes) | gauge, 1 or 0 | `queue` |
//! | `idem_circuit_state` (as it changes) | gauge, 0 closed, 1 half-open, 2 open | `queue` |
//! | `idem_limit_wait_seconds` | histogram | `limit` |
//! | `idem_ordering_stalled`, `idem_ordering_waiting` | gauge | |
//! | `idem_ordering_released_total` | counter | |

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::flow::CircuitState;

/// Why metrics could not be served.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// Another recorder is installed already.
    #[error("cannot install the Prometheus recorder")]
    Install(#[from] metrics_exporter_prometheus::BuildError),
    /// The address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Counts one delivery's outcome.
pub(crate) fn delivery(operation: &'static str, outcome: &'static str) {
    ::metrics::counter!("idem_deliveries_total", "operation" => operation, "outcome" => outcome)
        .increment(1);
}

/// Sets how many records of `operation` wait past their due time for the delivery that
/// brings them back (see `Store::overdue`).
pub(crate) fn retries_overdue(operation: &'static str, records: i64) {
    ::metrics::gauge!("idem_retries_overdue", "operation" => operation).set(records as f64);
}

/// Counts the outcome of a delivery replayed from a dead-letter queue (`idem-replays`
/// set), and `dead_lettered` when it is dead-lettered again: a replay that keeps failing.
pub(crate) fn replayed_delivery(operation: &'static str, outcome: &'static str) {
    ::metrics::counter!("idem_replayed_deliveries_total", "operation" => operation, "outcome" => outcome)
        .increment(1);
}

/// Counts one keyed HTTP request's outcome (feature `http`): `executed`, `replayed`,
/// `conflict`, `in_progress`, `pending`, `failed`, `uncertain`, `taken_over`,
/// `missing_key`, `invalid_key`, `too_large`, `unreadable_body`, `response_too_large`,
/// `store_unavailable`, `timed_out`. The `operation` is `<METHOD> (unmatched)` for a request
/// no route matched.
#[cfg(feature = "http")]
pub(crate) fn http_request(operation: &str, outcome: &'static str) {
    ::metrics::counter!("idem_http_requests_total", "operation" => operation.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// Records how long a handler ran.
pub(crate) fn handler_duration(operation: &'static str, elapsed: Duration) {
    ::metrics::histogram!("idem_handler_duration_seconds", "operation" => operation)
        .record(elapsed.as_secs_f64());
}

/// Records one store round trip.
pub(crate) fn store_round_trip(call: &'static str, started: Instant) {
    ::metrics::histogram!("idem_store_round_trip_seconds", "call" => call)
        .record(started.elapsed().as_secs_f64());
}

/// Records how long one gc batch took.
pub(crate) fn gc_batch(elapsed: Duration) {
    ::metrics::histogram!("idem_gc_batch_seconds").record(elapsed.as_secs_f64());
}

/// Sets how many expired rows of `table` (its gc label) wait for gc, and the oldest
/// one's age.
pub(crate) fn gc_expired(table: &'static str, rows: i64, oldest_age_s: Option<f64>) {
    ::metrics::gauge!("idem_gc_expired_rows", "table" => table).set(rows as f64);
    ::metrics::gauge!("idem_gc_oldest_expired_age_seconds", "table" => table)
        .set(oldest_age_s.unwrap_or(0.0));
}

/// Counts rows of `table` (its gc label) deleted by garbage collection.
pub(crate) fn gc_deleted(table: &'static str, n: u64) {
    ::metrics::counter!("idem_gc_deleted_total", "table" => table).increment(n);
}

/// Counts follow-up messages published and confirmed.
pub(crate) fn outbox_published(n: u64) {
    ::metrics::counter!("idem_outbox_published_total").increment(n);
}

/// Counts publishes of follow-up messages that failed (returned, nacked, unconfirmed).
pub(crate) fn outbox_failed() {
    ::metrics::counter!("idem_outbox_publish_failures_total").increment(1);
}

/// Sets the outbox backlog: undispatched messages, those whose publish failed, and the
/// oldest one's age.
pub(crate) fn outbox_backlog(undispatched: i64, failing: i64, oldest_age_s: Option<f64>) {
    ::metrics::gauge!("idem_outbox_pending").set(undispatched as f64);
    ::metrics::gauge!("idem_outbox_failing").set(failing as f64);
    ::metrics::gauge!("idem_outbox_oldest_age_seconds").set(oldest_age_s.unwrap_or(0.0));
}

/// Sets the ordering gauges: entities with deliveries waiting that have not moved for
/// the stall time, and the deliveries waiting in all.
pub(crate) fn ordering_backlog(stalled: i64, waiting: i64) {
    ::metrics::gauge!("idem_ordering_stalled").set(stalled as f64);
    ::metrics::gauge!("idem_ordering_waiting").set(waiting as f64);
}

/// Counts waiting deliveries published again for their turn.
pub(crate) fn ordering_released(n: u64) {
    ::metrics::counter!("idem_ordering_released_total").increment(n);
}

/// Whether each queue of a worker (or of a service's handlers) is connected and
/// consuming, and where its circuit stands, set by the worker as it changes.
#[derive(Debug, Clone, Default)]
pub struct BrokerHealth(Arc<Mutex<Queues>>);

#[derive(Debug, Default)]
struct Queues {
    up: BTreeMap<String, bool>,
    circuits: BTreeMap<String, CircuitState>,
}

impl BrokerHealth {
    /// True while every queue is connected and consuming (false before the first). A
    /// queue paused by its open circuit is consuming: it is healthy.
    pub fn is_up(&self) -> bool {
        all_consuming(&self.queues())
    }

    /// Each queue, and whether it is consuming, by name.
    pub fn queues(&self) -> Vec<(String, bool)> {
        self.lock()
            .up
            .iter()
            .map(|(q, up)| (q.clone(), *up))
            .collect()
    }

    /// Where the circuit of each queue that has a breaker stands, by name.
    pub fn circuits(&self) -> Vec<(String, CircuitState)> {
        let queues = self.lock();
        queues
            .circuits
            .iter()
            .map(|(q, c)| (q.clone(), *c))
            .collect()
    }

    /// Records `queue`'s state, and sets `idem_queue_up{queue}` and `idem_broker_up`
    /// (every queue up) at once, not at the next gauge refresh: a scrape right after a
    /// reconnect must not say down.
    pub(crate) fn set(&self, queue: &str, up: bool) {
        let all = {
            let mut queues = self.lock();
            queues.up.insert(queue.to_owned(), up);
            queues.up.values().all(|up| *up)
        };
        ::metrics::gauge!("idem_queue_up", "queue" => queue.to_owned())
            .set(f64::from(u8::from(up)));
        ::metrics::gauge!("idem_broker_up").set(f64::from(u8::from(all)));
    }

    /// Records where `queue`'s circuit stands.
    pub(crate) fn set_circuit(&self, queue: &str, state: CircuitState) {
        self.lock().circuits.insert(queue.to_owned(), state);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Installs the Prometheus recorder (once per process) and returns its handle.
pub fn install_recorder() -> Result<PrometheusHandle, MetricsError> {
    let buckets = [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ];
    Ok(PrometheusBuilder::new()
        .set_buckets(&buckets)?
        .install_recorder()?)
}

/// Serves `/metrics` and `/healthz` on `addr` until `shutdown`, and refreshes the age
/// gauges from the database every few seconds. Installs the recorder.
///
/// Returns the bound address (useful with port 0) once listening; the server runs in a
/// spawned task.
pub async fn serve(
    addr: &str,
    pool: PgPool,
    broker: BrokerHealth,
    shutdown: CancellationToken,
) -> Result<SocketAddr, MetricsError> {
    let handle = install_recorder()?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind {
            addr: addr.into(),
            source,
        })?;
    let local = listener.local_addr().map_err(|source| MetricsError::Bind {
        addr: addr.into(),
        source,
    })?;
    tokio::spawn(refresh_gauges(
        pool.clone(),
        handle.clone(),
        shutdown.clone(),
    ));
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = shutdown.cancelled() => return,
            };
            match accepted {
                Ok((stream, _)) => {
                    let (handle, pool, broker) = (handle.clone(), pool.clone(), broker.clone());
                    tokio::spawn(async move {
                        if let Err(error) = answer(stream, &handle, &pool, &broker).await {
                            debug!(error = %error, "metrics request failed");
                        }
                    });
                }
                Err(error) => warn!(error = %error, "metrics accept failed"),
            }
        }
    });
    Ok(local)
}

/// Answers one HTTP/1.x request and closes the connection.
async fn answer(
    mut stream: TcpStream,
    handle: &PrometheusHandle,
    pool: &PgPool,
    broker: &BrokerHealth,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    // Read until the end of the request head (or the buffer is full).
    while len < buf.len() {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf[len..]))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        if n == 0 {
            break;
        }
        len += n;
        if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf[..len]);
    let path = head.split_whitespace().nth(1).unwrap_or("/");
    let (status, content_type, body) = match path {
        "/metrics" => {
            handle.run_upkeep();
            ("200 OK", "text/plain; version=0.0.4", handle.render())
        }
        "/healthz" => {
            let database = database_health(pool).await;
            // One look at the queues for the status and the body: read twice, a queue
            // that went down in between was listed down under a 200.
            let queues = broker.queues();
            let broker_up = all_consuming(&queues);
            let up = database.is_ok() && broker_up;
            let mut body = format!("broker: {}\n", if broker_up { "up" } else { "down" });
            let circuits: BTreeMap<String, CircuitState> = broker.circuits().into_iter().collect();
            for (queue, up) in queues {
                let state = if up { "consuming" } else { "down" };
                let circuit = match circuits.get(&queue) {
                    Some(CircuitState::Open) => ", paused: circuit open",
                    Some(CircuitState::HalfOpen) => ", paused: circuit half-open (probing)",
                    _ => "",
                };
                body.push_str(&format!(
                    "queue {}: {state}{circuit}\n",
                    crate::text::printable(&queue)
                ));
            }
            body.push_str(&match &database {
                Ok(()) => "database: up\n".to_owned(),
                Err(why) => format!("database: down ({why})\n"),
            });
            if up {
                ("200 OK", "text/plain", body)
            } else {
                ("503 Service Unavailable", "text/plain", body)
            }
        }
        _ => ("404 Not Found", "text/plain", "not found\n".into()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// Whether the broker is up by [`BrokerHealth::queues`]: at least one queue, and every
/// one consuming.
fn all_consuming(queues: &[(String, bool)]) -> bool {
    !queues.is_empty() && queues.iter().all(|(_, up)| *up)
}

/// Whether Postgres answers a trivial query within two seconds, and if not, why.
async fn database_health(pool: &PgPool) -> Result<(), String> {
    let query = sqlx::query("SELECT 1").execute(pool);
    match tokio::time::timeout(Duration::from_secs(2), query).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) => Err(crate::text::error_line(&error)),
        Err(_) => Err("no answer within 2 s".into()),
    }
}

/// Sets the age gauges of the oldest pending and processing records.
async fn refresh_gauges(pool: PgPool, handle: PrometheusHandle, shutdown: CancellationToken) {
    loop {
        // Each is the first entry of an index: cheap however large the table is.
        type Ages = (Option<f64>, Option<f64>, Option<f64>);
        let query = sqlx::query_as(
            "SELECT
               -- A discarded pending record stays pending for good, on purpose.
               (SELECT extract(epoch FROM now() - min(updated_at))::float8
                  FROM processed_operations
                 WHERE status = 'pending' AND discarded_at IS NULL),
               -- Not an HTTP request's record (it has an expiry) whose server died:
               -- it waits for its client, maybe forever, and gc takes it. One whose
               -- lease is live (a hung route) counts.
               (SELECT extract(epoch FROM now() - min(updated_at))::float8
                  FROM processed_operations
                 WHERE status = 'processing'
                   AND (expires_at IS NULL OR lease_expires_at > now())),
               (SELECT extract(epoch FROM now() - min(expires_at))::float8
                  FROM processed_operations
                 WHERE expires_at <= now() AND dead_letters = 0)",
        )
        .fetch_one(&pool);
        // A database that hangs rather than refuses must read as down too (as /healthz
        // does after 2 s), not keep the last value for minutes.
        let ages: Result<Ages, String> =
            match tokio::time::timeout(Duration::from_secs(2), query).await {
                Ok(Ok(ages)) => Ok(ages),
                Ok(Err(error)) => Err(crate::text::error_line(&error)),
                Err(_) => Err("no answer within 2 s".into()),
            };
        match ages {
            Ok((pending, processing, expired)) => {
                ::metrics::gauge!("idem_store_up").set(1.0);
                ::metrics::gauge!("idem_gc_oldest_expired_age_seconds", "table" => "records")
                    .set(expired.unwrap_or(0.0));
                ::metrics::gauge!("idem_oldest_pending_age_seconds").set(pending.unwrap_or(0.0));
                ::metrics::gauge!("idem_oldest_processing_age_seconds")
                    .set(processing.unwrap_or(0.0));
            }
            Err(error) => {
                ::metrics::gauge!("idem_store_up").set(0.0);
                debug!(error = %error, "age gauges not refreshed");
            }
        }
        handle.run_upkeep();
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}
