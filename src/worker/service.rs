//! A service: many handlers, each on a queue of its own with its own settings (mode,
//! concurrency, prefetch, retries, queue type), run by one process that shares what a
//! worker runs beside its deliveries: one broker connection to consume on and one to
//! publish on (channels of each per queue), one Postgres pool, one outbox relay, one
//! tally flusher, one gc loop and one health that names each queue (docs/DESIGN.md, "One service, many handlers"). A [`Worker`]
//! is the service of one handler.
//!
//! [`Worker`]: super::Worker

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::background::{self, Background, Wakes};
use super::route::{Route, RouteBy, Routes, Unrouted};
use super::session::Session;
use super::{Mode, Runtime, WorkerConfig, WorkerError, consume, topology_of};
use crate::connector::Connector;
use crate::flow::circuit::Circuit;
use crate::handler::Handler;
use crate::metrics::BrokerHealth;
use crate::outbox::OutboxConfig;
use crate::store::gc::Pace;
use crate::store::{Store, StoreError};
use crate::tally::Tally;

/// What a service's queues share; one [`WorkerConfig`] per handler says the rest.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// AMQP URL of the broker (default: `AMQP_URL`, else
    /// [`crate::topology::DEFAULT_AMQP_URL`]).
    pub amqp_url: String,
    /// The connection name shown by the broker: the queues consume on `<name>` and
    /// publish (the relay too) on `<name>-publish`.
    pub name: String,
    /// Run garbage collection of expired records this often (`None`: leave it to
    /// `idem gc`); see [`WorkerConfig::gc_every`].
    pub gc_every: Option<Duration>,
    /// How fast that garbage collection goes.
    pub gc_pace: Pace,
    /// Add the queues' delivery outcome counts to `delivery_outcomes` this often; see
    /// [`WorkerConfig::tally_every`].
    pub tally_every: Option<Duration>,
    /// How follow-up messages are published, and whether the relay runs.
    pub outbox: OutboxConfig,
    /// See [`WorkerConfig::ordering_sweep_every`].
    pub ordering_sweep_every: Option<Duration>,
    /// See [`WorkerConfig::ordering_stall_after`].
    pub ordering_stall_after: Duration,
}

impl ServiceConfig {
    /// The service-wide part of a worker's settings.
    pub(super) fn of(config: &WorkerConfig) -> Self {
        Self {
            amqp_url: config.amqp_url.clone(),
            name: config.name.clone(),
            gc_every: config.gc_every,
            gc_pace: config.gc_pace.clone(),
            tally_every: config.tally_every,
            outbox: config.outbox.clone(),
            ordering_sweep_every: config.ordering_sweep_every,
            ordering_stall_after: config.ordering_stall_after,
        }
    }
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self::of(&WorkerConfig::default())
    }
}

/// Many handlers in one process, each on its own queue: see the module docs.
///
/// ```no_run
/// # use idem::{Context, Handler, HandlerError, Service, ServiceConfig, Store, StoreConfig, WorkerConfig};
/// # struct Orders; struct Emails;
/// # impl Handler for Orders { type Message = serde_json::Value; type Output = (); const OPERATION: &'static str = "orders.create";
/// #   fn scope(&self, _: &serde_json::Value) -> String { "acme".into() }
/// #   fn idempotency_key(&self, m: &serde_json::Value) -> String { m["event_id"].to_string() }
/// #   async fn handle(&self, _: serde_json::Value, _: &mut Context) -> Result<(), HandlerError> { Ok(()) } }
/// # impl Handler for Emails { type Message = serde_json::Value; type Output = (); const OPERATION: &'static str = "emails.welcome";
/// #   fn scope(&self, _: &serde_json::Value) -> String { "acme".into() }
/// #   fn idempotency_key(&self, m: &serde_json::Value) -> String { m["event_id"].to_string() }
/// #   async fn handle(&self, _: serde_json::Value, _: &mut Context) -> Result<(), HandlerError> { Ok(()) } }
/// # async fn run(pool: sqlx::PgPool) -> Result<(), idem::WorkerError> {
/// let store = Store::new(pool, StoreConfig::default());
/// Service::new(store, ServiceConfig::default())
///     .handler(Orders, WorkerConfig { queue: "orders".into(), ..WorkerConfig::default() })
///     .handler(Emails, WorkerConfig { queue: "emails".into(), concurrency: 4, ..WorkerConfig::default() })
///     .run(idem::shutdown::on_signal())
///     .await
/// # }
/// ```
pub struct Service {
    store: Store,
    config: ServiceConfig,
    hosted: Vec<Hosted>,
    health: BrokerHealth,
}

/// One handler of a service, its type erased: its queue and settings, its operation,
/// the message type it takes (none: every message of its queue), and how to start its
/// runtime and its watch for overdue retries on what the service shares.
struct Hosted {
    config: WorkerConfig,
    operation: &'static str,
    message_type: Option<String>,
    start: Box<dyn FnOnce(&Shared) -> Started + Send>,
}

/// A hosted handler, running: its runtime, and the watch for its overdue retries.
struct Started {
    route: Arc<dyn Route>,
    watch: BoxFuture<'static, ()>,
}

/// The broker's refusal of a queue for good: its name and what the broker said.
type Refusal = Option<(String, String)>;

/// What every queue of a service is given to run on.
struct Shared {
    /// The queue's shutdown.
    stop: CancellationToken,
    store: Store,
    connector: Arc<Connector>,
    publishing: Arc<Connector>,
    health: BrokerHealth,
    wakes: Wakes,
    tally: Option<Arc<Tally>>,
    /// The queue's circuit, when its settings have a breaker.
    circuit: Option<Arc<Circuit>>,
}

impl Service {
    /// A service on `store` (one pool for every handler: size it for their summed
    /// concurrency) with `config`'s shared settings, and no handler yet.
    pub fn new(store: Store, config: ServiceConfig) -> Self {
        Self {
            store,
            config,
            hosted: Vec::new(),
            health: BrokerHealth::default(),
        }
    }

    /// Hosts `handler` on `config.queue`, for every message of that queue, with
    /// `config`'s queue settings. Its service-wide fields (`amqp_url`, `name`,
    /// `gc_every`, `gc_pace`, `tally_every`, `outbox`) are the service's. Two handlers of
    /// one operation, or another handler on the queue, are refused when it starts.
    pub fn handler<H: Handler>(self, handler: H, config: WorkerConfig) -> Self {
        self.host(None, handler, config)
    }

    /// Hosts `handler` on `config.queue` for the messages of type `message_type` (the
    /// AMQP `type` property, or what `config.route_by` names), beside the queue's other
    /// typed handlers: `order.created` and `order.cancelled` on one queue, say. A
    /// message whose type none of them takes is dead-lettered as `unroutable`, and
    /// `idem dlq replay` brings it back once its handler is deployed. The queue's
    /// settings (prefetch, concurrency, queue type, retry delays, subscriptions,
    /// shutdown timeout, route_by) are its first handler's; each handler keeps its own
    /// mode and retry policy. Two handlers of one type on a queue are refused at start.
    pub fn handler_for<H: Handler>(
        self,
        message_type: &str,
        handler: H,
        config: WorkerConfig,
    ) -> Self {
        self.host(Some(message_type.to_owned()), handler, config)
    }

    fn host<H: Handler>(
        mut self,
        message_type: Option<String>,
        handler: H,
        config: WorkerConfig,
    ) -> Self {
        let shared = &self.config;
        let config = WorkerConfig {
            amqp_url: shared.amqp_url.clone(),
            name: shared.name.clone(),
            gc_every: shared.gc_every,
            gc_pace: shared.gc_pace.clone(),
            tally_every: shared.tally_every,
            outbox: shared.outbox.clone(),
            ..config
        };
        let runtime_config = config.clone();
        self.hosted.push(Hosted {
            config,
            operation: H::OPERATION,
            message_type,
            start: Box::new(move |shared: &Shared| start::<H>(handler, runtime_config, shared)),
        });
        self
    }

    /// Whether each queue is connected and consuming (for `/healthz`).
    pub fn broker_health(&self) -> BrokerHealth {
        self.health.clone()
    }

    pub(super) fn with_health(self, health: BrokerHealth) -> Self {
        Self { health, ..self }
    }

    /// Runs every handler until `shutdown` is cancelled: each queue consumes on the
    /// shared connection, and they reconnect together when it drops. On shutdown every
    /// queue stops consuming and drains its handlers (each up to its own shutdown
    /// timeout, side by side, so a hung handler holds back only its own queue), then
    /// the connection closes. A queue the broker refuses for good stops the service
    /// ([`WorkerError::Refused`], naming it) after the others drained; so does a queue
    /// whose own task fails ([`WorkerError::Crashed`], a bug of idem's).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        self.check()?;
        let Service {
            store,
            config,
            hosted,
            health,
        } = self;
        // Keys that do not open what they sealed, or a key missing, stop the service
        // here with one line, before a delivery is taken.
        for hosted in &hosted {
            store.retains(hosted.operation, hosted.config.retention);
        }
        match store.prepare().await {
            Ok(()) => {}
            // Postgres is not there yet: every claim prepares first, and waits for it.
            Err(error)
                if matches!(error, StoreError::Database(_))
                    && error.fault() == crate::fault::Fault::Outage =>
            {
                warn!(error = %crate::text::error_line(&error), "keys and retentions not checked yet");
            }
            Err(error) => return Err(WorkerError::Store(error)),
        }
        let mut queues: BTreeMap<String, Vec<Hosted>> = BTreeMap::new();
        for hosted in hosted {
            health.set(&hosted.config.queue, false);
            queues
                .entry(hosted.config.queue.clone())
                .or_default()
                .push(hosted);
        }
        let stop = shutdown.child_token();
        // The relay, gc and the tallies' flushes stop once every queue has drained:
        // follow-ups whose publish failed meanwhile still get the relay.
        let background_stop = CancellationToken::new();
        let names: Vec<String> = queues.keys().cloned().collect();
        // One connection to consume on, one to publish on (the queues' retries, dead
        // letters and follow-ups, and the relay's), as RabbitMQ advises: the broker
        // blocks a publishing connection under a memory or disk alarm, and the
        // consumers' acks must not wait behind it.
        let connector = Arc::new(Connector::new(&config.amqp_url, &config.name));
        let publishing = Arc::new(Connector::new(
            &config.amqp_url,
            &format!("{}-publish", config.name),
        ));
        let mut background =
            Background::start(&store, &config, &names, &publishing, &background_stop);
        let mut running = JoinSet::new();
        for (queue, group) in queues {
            let shared = Shared {
                stop: stop.clone(),
                store: store.clone(),
                connector: connector.clone(),
                publishing: publishing.clone(),
                health: health.clone(),
                wakes: background.wakes.clone(),
                tally: background.tallies.remove(&queue),
                circuit: None,
            };
            let run = AssertUnwindSafe(run_queue(group, shared, stop.clone())).catch_unwind();
            running.spawn(async move { (queue, run.await) });
        }
        let mut ended = None;
        while let Some(done) = running.join_next().await {
            let error = match done {
                Ok((_, Ok(None))) => continue,
                Ok((_, Ok(Some((queue, reason))))) => WorkerError::Refused { queue, reason },
                // Handlers' panics are caught where they run: this one is idem's own.
                Ok((queue, Err(panic))) => {
                    health.set(&queue, false);
                    let reason = panic_message(&panic);
                    error!(queue = %queue, reason = %reason, "a queue stopped: idem panicked");
                    WorkerError::Crashed { queue, reason }
                }
                Err(join) => {
                    error!(error = %join, "a queue's task ended abnormally");
                    continue;
                }
            };
            // The others drain and stop too: a service runs whole or not at all.
            ended.get_or_insert(error);
            stop.cancel();
        }
        background_stop.cancel();
        background.stop(store.pool(), ended.is_some()).await;
        connector.close().await;
        publishing.close().await;
        info!("stopped");
        ended.map_or(Ok(()), Err)
    }

    /// Refuses a service without handlers, a queue with an untyped handler and
    /// another, two handlers of one type on a queue, typed handlers of one queue with
    /// other retry delays (the queue has one set of retry queues), and two handlers of
    /// one operation (their keys and records would mix).
    fn check(&self) -> Result<(), WorkerError> {
        let invalid = |reason: String| Err(WorkerError::Invalid { reason });
        if self.hosted.is_empty() {
            return invalid("no handler: add one with Service::handler".into());
        }
        let mut queues: BTreeMap<&str, &Hosted> = BTreeMap::new();
        let mut types = BTreeMap::new();
        let mut operations = BTreeMap::new();
        for hosted in &self.hosted {
            let queue = hosted.config.queue.as_str();
            if let RouteBy::Header(name) = &hosted.config.route_by
                && (name.starts_with("x-") || name.starts_with("idem-"))
            {
                return invalid(format!(
                    "queue {queue} routes by header {name}, which a dead letter or a retry does not carry (x- and idem- headers are the broker's and idem's): route by another"
                ));
            }
            if let Some(other) = operations.insert(hosted.operation, queue) {
                return invalid(format!(
                    "operation {} is handled twice (on {other} and {queue}): operation names must be distinct",
                    hosted.operation
                ));
            }
            let Some(first) = queues.insert(queue, hosted) else {
                types.insert((queue, hosted.message_type.clone()), hosted.operation);
                continue;
            };
            if first.message_type.is_none() || hosted.message_type.is_none() {
                return invalid(format!(
                    "queue {queue} has two handlers ({} and {}): give each its message type (Service::handler_for), or each its queue",
                    first.operation, hosted.operation
                ));
            }
            if let Some(other) =
                types.insert((queue, hosted.message_type.clone()), hosted.operation)
            {
                return invalid(format!(
                    "queue {queue} has two handlers for message type {:?} ({other} and {})",
                    hosted.message_type.as_deref().unwrap_or_default(),
                    hosted.operation
                ));
            }
            if first.config.retry.delays != hosted.config.retry.delays {
                return invalid(format!(
                    "the handlers of queue {queue} ({} and {}) have other retry delays: the queue has one set of retry queues",
                    first.operation, hosted.operation
                ));
            }
        }
        Ok(())
    }
}

/// Starts `handler`'s runtime on what the service shares.
fn start<H: Handler>(handler: H, config: WorkerConfig, shared: &Shared) -> Started {
    let store = shared.store.clone();
    let watch = background::watch_overdue::<H>(
        store.clone(),
        config.overdue_after(store.config().lease),
        shared.stop.clone(),
    );
    let runtime = Runtime::new(
        handler,
        store,
        config,
        shared.tally.clone(),
        shared.wakes.clone(),
        shared.circuit.clone(),
    );
    Started {
        route: Arc::new(runtime),
        watch: Box::pin(watch),
    }
}

/// One queue of a service and its handlers, until `shutdown` or the broker's refusal.
async fn run_queue(group: Vec<Hosted>, mut shared: Shared, shutdown: CancellationToken) -> Refusal {
    let config = group.first().map(|h| h.config.clone())?;
    shared.circuit = config.circuit.clone().map(|breaker| {
        // A probe's turn: a run of the handler under its lease, with room to spare.
        let turn = (shared.store.config().lease * 2).max(Duration::from_secs(10));
        let pool = shared.store.pool().clone();
        let (health, queue) = (shared.health.clone(), config.queue.clone());
        let on_change = move |state| health.set_circuit(&queue, state);
        Arc::new(Circuit::new(&config.queue, breaker, pool, turn, on_change))
    });
    // Stopped when the queue ends, or its task unwinds.
    let watching = CancellationToken::new().drop_guard();
    if let Some(circuit) = shared.circuit.clone() {
        let stop = watching.token().clone();
        tokio::spawn(async move { circuit.watch(stop).await });
    }
    let typed = group.iter().any(|h| h.message_type.is_some());
    let config = sized(&group, config, &shared);
    let mut watches = Vec::new();
    let mut routes = HashMap::new();
    let mut one = None;
    for hosted in group {
        if let Err(error) = shared
            .store
            .note_queue(&config.queue, hosted.operation)
            .await
        {
            warn!(queue = %config.queue, error = %crate::text::error_line(&error), "the queue's operation not noted for operators");
        }
        let started = (hosted.start)(&shared);
        watches.push(tokio::spawn(started.watch));
        match hosted.message_type {
            Some(kind) => {
                routes.insert(kind, started.route);
            }
            None => one = Some(started.route),
        }
    }
    let routes = match one {
        Some(route) if !typed => Routes::One(route),
        _ => Routes::ByType {
            by: config.route_by.clone(),
            routes,
        },
    };
    let session = Session {
        topology: topology_of(&config),
        unrouted: Arc::new(Unrouted {
            store: shared.store.clone(),
            queue: config.queue.clone(),
            tally: shared.tally.clone(),
        }),
        config,
        routes: Arc::new(routes),
        broker: shared.health,
        connector: shared.connector,
        publishing: shared.publishing,
        circuit: shared.circuit,
    };
    let refused = consume(&session, &shutdown).await;
    drop(watching);
    for watch in watches {
        watch.abort();
    }
    refused
}

/// The queue's settings with concurrency and prefetch chosen where they are 0, for
/// the store's pool; a queue whose handlers are not all transactional sizes itself as a
/// leased one (its handlers may hold connections while they run).
fn sized(group: &[Hosted], config: WorkerConfig, shared: &Shared) -> WorkerConfig {
    let mode = match group.iter().all(|h| h.config.mode == Mode::Transactional) {
        true => Mode::Transactional,
        false => Mode::Leased,
    };
    let connections = shared.store.pool().options().get_max_connections();
    let sized = WorkerConfig {
        mode,
        ..config.clone()
    }
    .sized_for(connections);
    WorkerConfig {
        concurrency: sized.concurrency,
        prefetch: sized.prefetch,
        ..config
    }
}

/// What a panic said.
fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
