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
//! [`key`] and [`fingerprint`] name an intent; [`handler`] is where you plug in;
//! [`store`] is the Postgres record; [`worker`] consumes, decides and settles;
//! [`topology`], [`retry`] and [`dead_letter`] are the queues and what travels through
//! them; [`replay`] brings dead letters back; [`outbox`] carries a handler's follow-up
//! messages; [`gc`] expires what is done; [`metrics`] and [`db`] serve operators;
//! [`trace`] carries the W3C trace context through every hop, and [`telemetry`] sets up
//! a binary's logs (and, with the feature `otel`, its OTLP trace export).
//! With the feature `http`, `http` puts axum routes with an `Idempotency-Key` on the
//! same store.
#![warn(missing_docs, unreachable_pub)]

pub mod db;
pub mod dead_letter;
#[doc(hidden)]
pub mod failpoint;
pub mod fault;
pub mod fingerprint;
pub mod gc;
pub mod handler;
pub mod headers;
#[cfg(feature = "http")]
pub mod http;
pub mod key;
pub mod metrics;
pub mod outbox;
pub mod replay;
pub mod retry;
pub mod shutdown;
pub mod store;
pub mod tally;
pub mod telemetry;
pub mod text;
pub mod topology;
pub mod trace;
pub mod worker;

pub use fault::Fault;
pub use fingerprint::Fingerprint;
pub use handler::{Context, Handler, HandlerError, Reconciliation, ResultExt};
pub use key::{Key, KeyError};
pub use outbox::FollowUp;
pub use retry::RetryPolicy;
pub use shutdown::CancellationToken;
pub use store::{Claim, Lease, Origin, Record, Status, Store, StoreConfig, StoreError};
pub use topology::{QueueType, Topology};
pub use worker::{Mode, Worker, WorkerConfig, WorkerError};

/// The README's code blocks compile as doc tests, so the first screen stays true (with
/// the feature `http`, which one of them uses: `cargo test --all-features`).
#[cfg(all(doctest, feature = "http"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
