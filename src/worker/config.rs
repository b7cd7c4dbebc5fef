//! Worker settings.

use std::time::Duration;

use super::route::RouteBy;
use crate::flow::CircuitBreaker;
use crate::outbox::OutboxConfig;
use crate::retry::RetryPolicy;
use crate::store::gc::Pace;
use crate::topology::{self, QueueType, Subscription};

/// How a worker commits an operation (docs/DESIGN.md, "Two execution modes").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// The claim commits on its own before the handler runs, and a lease with
    /// heartbeats and a fencing token guards the run. For handlers that call anything
    /// outside this database (payment providers, e-mail, HTTP).
    #[default]
    Leased,
    /// Claim, the handler's writes through [`crate::Context::tx`] and the outcome commit
    /// in one transaction, shared by the deliveries that arrive together (each handler
    /// in its own savepoint when one of them fails). No lease to pay for: a racing
    /// duplicate waits at the unique index, then sees `completed`. Only for handlers
    /// whose every effect is a write in this database: an external call from one is a
    /// misuse (it may be repeated when a batch starts again).
    Transactional,
}

impl Mode {
    /// `leased` or `transactional`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Leased => "leased",
            Mode::Transactional => "transactional",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "leased" => Ok(Mode::Leased),
            "transactional" => Ok(Mode::Transactional),
            other => Err(format!("unknown mode {other:?}: leased or transactional")),
        }
    }
}

/// Worker settings.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// AMQP URL of the broker (default: `AMQP_URL`, else [`topology::DEFAULT_AMQP_URL`]).
    pub amqp_url: String,
    /// The work queue.
    pub queue: String,
    /// Leased (the default) or transactional.
    pub mode: Mode,
    /// Classic or quorum queues.
    pub queue_type: QueueType,
    /// The exchanges the work queue consumes from, declared and bound by the worker
    /// (none: producers publish to the queue by its name).
    pub subscriptions: Vec<Subscription>,
    /// One process at a time consumes the work queue (RabbitMQ's single active
    /// consumer, declared on the queue): the others stand by, and one of them takes
    /// over when it stops or dies. On such a queue, order per entity is *owned*
    /// (docs/DESIGN.md, "Owned order"): the consuming process keeps the positions of
    /// its entities in memory, so a numbered turn takes no lock and no write before it
    /// runs: on the shuffled bench (one worker SIGKILLed, two cores), ordered deliveries
    /// ran at 0.62–0.69 of the unordered pace in transactional mode and 0.68–0.75 in
    /// leased mode (medians on the last seven sessions' machines), against 0.35–0.50
    /// through the gate (docs/PERFORMANCE.md), within one process's capacity. Order of
    /// arrival (`Ordered::by` without a sequence) still goes through the gate.
    ///
    /// A queue declared without it cannot take it later, nor drop it once declared with
    /// it (406 PRECONDITION_FAILED, and the worker stops). To switch: stop the
    /// producers, let the workers empty the queue and its retry queues (on classic
    /// queues, a retry copy that expires while the queue is gone is lost), stop the
    /// workers, delete the queue, and start them with the new setting, which declares
    /// it again. Deliveries waiting in Postgres name the queue: keep its name. Off by
    /// default.
    pub single_active_consumer: bool,
    /// When several handlers of a [`crate::Service`] share the queue, where the message
    /// type that picks one is read (the AMQP `type` property unless told otherwise).
    pub route_by: RouteBy,
    /// Deliveries run at once; 0 (the default) lets the worker choose from the mode
    /// and the pool ([`WorkerConfig::in_flight`]): in leased mode 128 handlers, at most
    /// the pool's connections less 4; in transactional mode enough to fill
    /// `batches_in_flight` batches and one more (256 with the defaults). Set it to
    /// bound what one worker does at once (in leased mode: calls to a provider).
    pub concurrency: usize,
    /// Unacked deliveries the broker sends ahead (basic.qos); 0 (the default): twice
    /// the deliveries run at once.
    pub prefetch: u16,
    /// How transient failures are retried.
    pub retry: RetryPolicy,
    /// How long a shutdown waits for in-flight handlers before closing anyway.
    pub shutdown_timeout: Duration,
    /// Longest wait between reconnection attempts to the broker.
    pub max_reconnect_delay: Duration,
    /// The connection name shown by the broker.
    pub name: String,
    /// Run garbage collection of expired records this often (`None`: leave it to
    /// `idem gc`). Every worker may run it; one at a time across all processes
    /// collects (the one holding the gc advisory lock), the others skip the round.
    pub gc_every: Option<Duration>,
    /// How fast that garbage collection goes (see [`crate::store::gc`]).
    pub gc_pace: Pace,
    /// Most claims (and most completions) written in one statement. Deliveries that
    /// arrive together share a statement and a commit; 1 turns batching off.
    pub batch_size: usize,
    /// How long a batch waits for more after its first request, and the longest that
    /// decided acks are held to go out together (they go as soon as requests pause).
    pub batch_linger: Duration,
    /// Batches of claims (and of completions) running at once, each on its own
    /// connection.
    pub batches_in_flight: usize,
    /// The safety net: a delivery that could not be decided this many times in a row,
    /// each time after the store decided other deliveries, is dead-lettered as
    /// `undecidable` with its last error. During an outage, when nothing is decided,
    /// nothing is dead-lettered.
    pub undecidable_after: u32,
    /// How handlers' follow-up messages are published (see [`crate::outbox`]).
    pub outbox: OutboxConfig,
    /// Add the outcome counts of the deliveries to `delivery_outcomes` this often (no
    /// more often than every 100 ms), for the console's charts (see [`crate::tally`]);
    /// `None` counts nothing. Each flush is one statement per worker; a worker killed
    /// with `SIGKILL` loses the counts not flushed yet (this interval's, unless the
    /// database was unreachable for longer), and a stopping worker gives its last flush
    /// 5 s.
    pub tally_every: Option<Duration>,
    /// Sweep the entities' orders this often (docs/DESIGN.md, "Order per entity"):
    /// move on an entity whose holder completed without moving it (a crash after its
    /// commit), publish a turn nobody published (after a skip) or one that did not come
    /// back within 1 s (doubling up to 64 s); what has stood so for this long only (a
    /// holder that completed a moment ago is its own worker's to move on). A sweep that
    /// finds nothing waits twice as long before the next, up to 8 times this. The gauges
    /// `idem_ordering_stalled` and `idem_ordering_waiting` are set at the first sweep
    /// after a quarter of [`Self::ordering_stall_after`] passed (with the back-off, up to
    /// 8 times this apart). `None`: no sweep in this process (one is enough).
    pub ordering_sweep_every: Option<Duration>,
    /// An entity with deliveries waiting that has not moved for this long is stalled
    /// (the gauge, the alert `IdemOrderingStalled`, a warning): a gap, or a predecessor
    /// retrying, pending or dead-lettered.
    pub ordering_stall_after: Duration,
    /// How long a retryable failure or pending operation of this worker's may wait for
    /// the delivery that brings it back before it counts as overdue
    /// (`idem_retries_overdue`, the alert `IdemRetriesOverdue`, a warning): its retry
    /// copy was probably lost (a classic retry queue dead-letters at most once). `None`:
    /// the longest retry delay, plus the lease, plus a minute.
    pub retry_overdue_after: Option<Duration>,
    /// Pause the queue while the dependency its handler calls keeps failing
    /// (docs/DESIGN.md, "Flow control"): once the breaker's count of transient
    /// failures says so, the circuit opens, no delivery of the queue is taken (they wait
    /// in the broker, spending no retry tier), and after a pause one probe delivery
    /// runs; its success closes the circuit. Shared by every worker of the queue through
    /// the database. `None` (the default): no breaker, failures walk the retry tiers.
    pub circuit: Option<CircuitBreaker>,
    /// How long this handler's completed records are kept (docs/DESIGN.md,
    /// "Retention": an order's 30 days, an e-mail's 2): noted for its operation in
    /// `operation_retention` when the service starts, and used by every completion of
    /// the operation, in any process. `None` (the default): the store's
    /// [`crate::StoreConfig::retention`]. It must exceed the longest redelivery and
    /// replay horizon of the queue, or a late duplicate runs again.
    pub retention: Option<Duration>,
}

impl WorkerConfig {
    /// [`WorkerConfig::retry_overdue_after`], or what `None` stands for with a claim
    /// lease of `lease`.
    pub(crate) fn overdue_after(&self, lease: Duration) -> Duration {
        self.retry_overdue_after.unwrap_or_else(|| {
            let longest = self.retry.delays.iter().max().copied().unwrap_or_default();
            longest + lease + Duration::from_secs(60)
        })
    }
}

/// What `concurrency: 0` runs at most at once in leased mode: measured with
/// `examples/latency` against `orders_worker` (docs/SCALING.md), 16 kept 1,284 of 2,000
/// msgs/s offered and 128 kept 1,405, the machine's floor with the publisher beside it.
const LEASED_IN_FLIGHT: usize = 128;

/// The least prefetch chosen for a queue with a single active consumer (owned order):
/// its deliveries are taken up to the prefetch, and only runs are held to the
/// concurrency, so that early deliveries are parked (acked) while the handlers run. Not
/// far more: RabbitMQ 3.10 walks a channel's unacked deliveries at every ack out of
/// order, and a prefetch of thousands stalled the broker (docs/PERFORMANCE.md).
pub(crate) const OWNED_PREFETCH: usize = 512;

/// Connections of the store's pool that a leased worker leaves to its claims,
/// completions and heartbeats when it chooses its concurrency.
const LEASED_SPARE_CONNECTIONS: usize = 4;

impl WorkerConfig {
    /// Deliveries run at once by a worker whose store's pool has `connections`:
    /// `concurrency`, or when it is 0, what the mode needs. Leased: 128, but no more
    /// than the pool's connections less 4, so that handlers waiting for a connection
    /// for `ctx.tx()` never starve the heartbeats that keep their leases (at least 4).
    /// Transactional: enough to fill `batches_in_flight` batches and one more, since a
    /// batch runs its handlers one after another on one connection.
    pub fn in_flight(&self, connections: u32) -> usize {
        match (self.concurrency, self.mode) {
            (0, Mode::Leased) => {
                let spare = (connections as usize).saturating_sub(LEASED_SPARE_CONNECTIONS);
                LEASED_IN_FLIGHT.min(spare).max(4)
            }
            (0, Mode::Transactional) => {
                let batch = self.batch_size.clamp(1, super::transactional::MAX_BATCH);
                (self.batches_in_flight.max(1) + 1) * batch
            }
            (n, _) => n,
        }
    }

    /// Unacked deliveries the broker sends ahead: `prefetch`, or when it is 0, twice
    /// [`WorkerConfig::in_flight`] (at most 65,535), so that the next batch is already
    /// here when one ends; with a single active consumer, at least 512, so that early
    /// deliveries keep coming to be parked while the handlers run.
    pub fn prefetch_count(&self, connections: u32) -> u16 {
        match self.prefetch {
            0 => {
                let ahead = self.in_flight(connections).saturating_mul(2);
                let ahead = match self.single_active_consumer {
                    true => ahead.max(OWNED_PREFETCH),
                    false => ahead,
                };
                u16::try_from(ahead).unwrap_or(u16::MAX)
            }
            n => n,
        }
    }

    /// These settings with concurrency and prefetch chosen where they are 0, for a
    /// store whose pool has `connections`.
    pub(crate) fn sized_for(mut self, connections: u32) -> Self {
        self.prefetch = self.prefetch_count(connections);
        self.concurrency = self.in_flight(connections);
        self
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            amqp_url: topology::amqp_url(),
            queue: "idem".into(),
            mode: Mode::Leased,
            queue_type: QueueType::Classic,
            subscriptions: Vec::new(),
            single_active_consumer: false,
            route_by: RouteBy::default(),
            concurrency: 0,
            prefetch: 0,
            retry: RetryPolicy::default(),
            shutdown_timeout: Duration::from_secs(30),
            max_reconnect_delay: Duration::from_secs(5),
            name: format!("idem-worker-{}", std::process::id()),
            gc_every: None,
            gc_pace: Pace::default(),
            batch_size: 128,
            batch_linger: Duration::from_millis(1),
            batches_in_flight: 3,
            undecidable_after: 20,
            outbox: OutboxConfig::default(),
            tally_every: Some(Duration::from_secs(5)),
            ordering_sweep_every: Some(Duration::from_secs(1)),
            ordering_stall_after: Duration::from_secs(60),
            retry_overdue_after: None,
            circuit: None,
            retention: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_chooses_from_the_mode_and_the_pool() {
        let leased = WorkerConfig::default();
        assert_eq!(
            (leased.in_flight(200), leased.prefetch_count(200)),
            (128, 256)
        );
        // A pool of 24: 20 handlers, 4 connections to spare; never fewer than 4.
        assert_eq!((leased.in_flight(24), leased.prefetch_count(24)), (20, 40));
        assert_eq!(leased.in_flight(2), 4);
        let transactional = WorkerConfig {
            mode: Mode::Transactional,
            ..WorkerConfig::default()
        };
        // Batches of at most 64, 3 in flight and one more filling, whatever the pool.
        assert_eq!(transactional.in_flight(10), 256);
        assert_eq!(transactional.prefetch_count(10), 512);
        let set = WorkerConfig {
            mode: Mode::Transactional,
            concurrency: 4,
            prefetch: 10,
            ..WorkerConfig::default()
        };
        assert_eq!((set.in_flight(10), set.prefetch_count(10)), (4, 10));
        let sized = WorkerConfig::default().sized_for(24);
        assert_eq!((sized.concurrency, sized.prefetch), (20, 40));
        let huge = WorkerConfig {
            concurrency: 40_000,
            ..WorkerConfig::default()
        };
        assert_eq!(huge.prefetch_count(10), u16::MAX);
    }
}
