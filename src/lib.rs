//! idem: at-least-once RabbitMQ consumers that never repeat a side effect.
//!
//! A worker derives a stable [`Key`] from each message's business event ID, claims it
//! in the Postgres table `processed_operations` through the [`Store`], runs your
//! [`Handler`], records the outcome, and only then acks. A redelivery, a duplicate
//! publish, a crashed worker or a replayed dead letter finds the record and does not
//! run the effect again. The contract is `docs/DESIGN.md` in the repository.
//!
//! # Quick start
//!
//! A job type is a [`Handler`]; a worker is a few lines around it:
//!
//! ```no_run
//! use idem::{Context, Handler, HandlerError, Store, StoreConfig, Worker, WorkerConfig};
//!
//! #[derive(serde::Deserialize)]
//! struct Welcome { event_id: String, tenant: String, email: String }
//!
//! struct SendWelcome;
//!
//! impl Handler for SendWelcome {
//!     type Message = Welcome;
//!     type Output = serde_json::Value;
//!     const OPERATION: &'static str = "emails.welcome";
//!
//!     fn scope(&self, m: &Welcome) -> String { m.tenant.clone() }
//!     fn idempotency_key(&self, m: &Welcome) -> String { m.event_id.clone() }
//!
//!     async fn handle(&self, m: Welcome, ctx: &mut Context) -> Result<serde_json::Value, HandlerError> {
//!         // Give the mail provider ctx.provider_key() as its idempotency key.
//!         let _ = (m.email, ctx.provider_key());
//!         Ok(serde_json::json!({"sent": true}))
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let pool = idem::db::connect_and_migrate(&idem::db::database_url(), 20).await?;
//!     let store = Store::new(pool, StoreConfig::default());
//!     let config = WorkerConfig { queue: "emails".into(), ..WorkerConfig::default() };
//!     Worker::new(SendWelcome, store, config)
//!         .run(idem::shutdown::on_signal())   // SIGTERM or Ctrl-C: drain, ack, return
//!         .await?;
//!     Ok(())
//! }
//! ```
//!
//! # Where things are
//!
//! What you write: a [`Handler`] (its [`Context`], [`HandlerError`],
//! [`Reconciliation`], and [`FollowUp`] messages it stages), run by a [`Worker`]
//! ([`WorkerConfig`], [`RetryPolicy`], [`Mode`]) on a [`Store`] ([`StoreConfig`]) over a
//! pool from [`db`]; [`shutdown`] and [`telemetry`] for the binary around it; with the
//! feature `http`, `http` puts axum routes with an `Idempotency-Key` on the same store.
//!
//! What operators use: [`Record`] and [`Status`] (and [`Store`]'s reads and operator
//! writes), [`replay`] for dead letters, [`store::gc`] for expiry, [`metrics`] for
//! `/metrics` and `/healthz`, [`outbox`] and [`tally`] for what the console shows,
//! [`headers`] for what a dead letter says, [`topology`] for the queues, and [`text`]
//! for what a binary prints.
//!
//! Inside, one module per concept: `key` and `fingerprint` name an intent, `worker`
//! consumes, decides (`worker::decision`, a pure table) and settles, `dead_letter`
//! builds what idem republishes, `trace` carries the W3C trace context, `fault` sorts
//! errors by cause, `failpoint` aborts at named points in crash tests.
#![warn(missing_docs)]
#![deny(unreachable_pub)]

mod batch;
mod connector;
pub mod db;
mod dead_letter;
mod envelope;
mod failpoint;
mod fault;
mod fingerprint;
pub mod flow;
mod handler;
pub mod headers;
#[cfg(feature = "http")]
pub mod http;
// The HTTP layer's decision table is pure: its tests run without the feature too.
#[cfg(all(test, not(feature = "http")))]
#[path = "http/decision.rs"]
mod http_decision;
mod key;
pub mod metrics;
pub mod ordering;
pub mod outbox;
pub mod protect;
pub mod replay;
mod retry;
pub mod shutdown;
pub mod store;
pub mod tally;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod text;
pub mod topology;
mod trace;
mod worker;

/// The AMQP client idem is built on, re-exported so that the types idem shows
/// ([`Envelope::properties`], the connections of [`topology`]) are the ones you name.
pub use lapin;

pub use batch::Batch;
pub use fingerprint::Fingerprint;
pub use flow::{CircuitBreaker, Limit, Permit};
pub use handler::{Context, Envelope, Handler, HandlerError, Reconciliation, ResultExt};
pub use key::{Key, KeyError};
pub use ordering::Ordered;
pub use outbox::FollowUp;
pub use retry::RetryPolicy;
pub use store::{Record, Status, Store, StoreConfig, StoreError};
pub use topology::{QueueType, Subscription, Topology};
pub use worker::{
    Mode, Outcome, RouteBy, Service, ServiceConfig, Worker, WorkerConfig, WorkerError,
};

/// The README's code blocks compile as doc tests, so the first screen stays true (with
/// the features `http` and `testing`, which two of them use: `cargo test --all-features`).
#[cfg(all(doctest, feature = "http", feature = "testing"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
