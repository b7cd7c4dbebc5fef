//! idem: at-least-once RabbitMQ consumers that never repeat a side effect.
//!
//! A worker derives a stable [`Key`] from each message's business event ID, claims it
//! in the Postgres table `processed_operations` through the [`Store`], runs the
//! handler, records the outcome, and only then acks. A redelivery, a duplicate publish,
//! a crashed worker or a replayed dead letter finds the record and does not run the
//! effect again. The contract is `DESIGN.md`.
#![warn(missing_docs)]

pub mod db;
pub mod dead_letter;
pub mod fingerprint;
pub mod handler;
pub mod replay;
pub mod key;
pub mod metrics;
pub mod retry;
pub mod store;
pub mod topology;
pub mod worker;

pub use fingerprint::Fingerprint;
pub use handler::{Context, Handler, HandlerError, Reconciliation, ResultExt};
pub use key::{Key, KeyError};
pub use retry::RetryPolicy;
pub use store::{Claim, Lease, Origin, Record, Status, Store, StoreConfig, StoreError};
pub use topology::{QueueType, Topology};
pub use worker::{Outcome, Worker, WorkerConfig, WorkerError};

/// The README's code blocks compile as doc tests, so the first screen stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
