//! A service: many handlers, each on a queue of its own with its own settings (mode,
//! concurrency, prefetch, retries, queue type), run by one process that shares what a
//! worker runs beside its deliveries: one broker connection (a channel pair per queue),
//! one Postgres pool, one outbox relay, one tally flusher, one gc loop and one health
//! that names each queue (docs/DESIGN.md, "One service, many handlers"). A [`Worker`]
//! is the service of one handler.
//!
//! [`Worker`]: super::Worker

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::background::{self, Background};
use super::connector::Connector;
use super::session::Session;
use super::{Runtime, WorkerConfig, WorkerError, consume, topology_of};
use crate::handler::Handler;
use crate::metrics::BrokerHealth;
use crate::outbox::OutboxConfig;
use crate::store::Store;
use crate::store::gc::Pace;
use crate::tally::Tally;

/// What a service's queues share; one [`WorkerConfig`] per handler says the rest.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// AMQP URL of the broker (default: `AMQP_URL`, else
    /// [`crate::topology::DEFAULT_AMQP_URL`]).
    pub amqp_url: String,
    /// The connection name shown by the broker (its relay's is `<name>-relay`).
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

/// One handler of a service, its type erased: its queue, its operation and how to run
/// it on what the service shares.
struct Hosted {
    queue: String,
    operation: &'static str,
    run: Box<dyn FnOnce(Shared, CancellationToken) -> BoxFuture<'static, Refusal> + Send>,
}

/// The broker's refusal of a queue for good: its name and what the broker said.
type Refusal = Option<(String, String)>;

/// What every queue of a service is given to run on.
struct Shared {
    store: Store,
    connector: Arc<Connector>,
    health: BrokerHealth,
    relay_wake: Arc<Notify>,
    tally: Option<Arc<Tally>>,
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

    /// Hosts `handler` on `config.queue`, with `config`'s queue settings. Its
    /// service-wide fields (`amqp_url`, `name`, `gc_every`, `gc_pace`, `tally_every`,
    /// `outbox`) are the service's. Two handlers on one queue, or two of one
    /// operation, are refused when the service starts.
    pub fn handler<H: Handler>(mut self, handler: H, config: WorkerConfig) -> Self {
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
        self.hosted.push(Hosted {
            queue: config.queue.clone(),
            operation: H::OPERATION,
            run: Box::new(move |shared, shutdown| {
                Box::pin(run_queue(handler, config, shared, shutdown))
            }),
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
    /// ([`WorkerError::Refused`], naming it) after the others drained.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        self.check()?;
        let Service {
            store,
            config,
            hosted,
            health,
        } = self;
        for queue in &hosted {
            health.set(&queue.queue, false);
        }
        let stop = shutdown.child_token();
        let queues: Vec<String> = hosted.iter().map(|h| h.queue.clone()).collect();
        let mut background = Background::start(&store, &config, &queues, &stop);
        let connector = Arc::new(Connector::new(&config.amqp_url, &config.name));
        let mut running = JoinSet::new();
        for queue in hosted {
            let shared = Shared {
                store: store.clone(),
                connector: connector.clone(),
                health: health.clone(),
                relay_wake: background.relay_wake.clone(),
                tally: background.tallies.remove(&queue.queue),
            };
            running.spawn((queue.run)(shared, stop.clone()));
        }
        let mut refused = None;
        while let Some(done) = running.join_next().await {
            match done {
                Ok(None) => {}
                Ok(Some(refusal)) => {
                    refused.get_or_insert(refusal);
                    stop.cancel();
                }
                // Handlers' panics are caught where they run; this is idem's own.
                Err(join) => error!(error = %join, "a queue's task ended abnormally"),
            }
        }
        connector.close().await;
        background.stop(store.pool(), refused.is_some()).await;
        info!("stopped");
        match refused {
            Some((queue, reason)) => Err(WorkerError::Refused { queue, reason }),
            None => Ok(()),
        }
    }

    /// Refuses a service without handlers, two handlers on one queue (routing by
    /// message type is not built yet) and two handlers of one operation (their keys and
    /// records would mix).
    fn check(&self) -> Result<(), WorkerError> {
        let invalid = |reason: String| Err(WorkerError::Invalid { reason });
        if self.hosted.is_empty() {
            return invalid("no handler: add one with Service::handler".into());
        }
        let mut queues = BTreeMap::new();
        let mut operations = BTreeMap::new();
        for hosted in &self.hosted {
            if let Some(other) = queues.insert(hosted.queue.as_str(), hosted.operation) {
                return invalid(format!(
                    "queue {} has two handlers ({other} and {}): one handler per queue",
                    hosted.queue, hosted.operation
                ));
            }
            if let Some(other) = operations.insert(hosted.operation, hosted.queue.as_str()) {
                return invalid(format!(
                    "operation {} is handled on two queues ({other} and {}): operation names must be distinct",
                    hosted.operation, hosted.queue
                ));
            }
        }
        Ok(())
    }
}

/// One queue of a service, until `shutdown` or the broker's refusal.
async fn run_queue<H: Handler>(
    handler: H,
    config: WorkerConfig,
    shared: Shared,
    shutdown: CancellationToken,
) -> Refusal {
    let Shared {
        store,
        connector,
        health,
        relay_wake,
        tally,
    } = shared;
    if let Err(error) = store.note_queue(&config.queue, H::OPERATION).await {
        warn!(queue = %config.queue, error = %crate::text::error_line(&error), "the queue's operation not noted for operators");
    }
    let overdue = background::watch_overdue::<H>(
        store.clone(),
        config.overdue_after(store.config().lease),
        shutdown.clone(),
    );
    let overdue = tokio::spawn(overdue);
    let topology = topology_of(&config);
    let runtime = Arc::new(Runtime::new(handler, store, config, tally, relay_wake));
    let session = Session {
        runtime,
        topology,
        broker: health,
        connector,
    };
    let refused = consume(&session, &shutdown).await;
    overdue.abort();
    refused
}
