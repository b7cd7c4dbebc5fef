//! idem: at-least-once RabbitMQ consumers that never repeat a side effect.
//!
//! A worker derives a stable [`Key`] from each message's business event ID, claims it
//! in the Postgres table `processed_operations` through the [`Store`], runs the
//! handler, records the outcome, and only then acks. A redelivery, a duplicate publish,
//! a crashed worker or a replayed dead letter finds the record and does not run the
//! effect again. The contract is `DESIGN.md`.
#![warn(missing_docs)]

mod acks;
mod batch;
pub mod db;
pub mod dead_letter;
pub mod failpoint;
pub mod fingerprint;
pub mod handler;
pub mod key;
pub mod metrics;
pub mod replay;
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

/// An error and its causes on one line (`a: b: c`), skipping a cause whose text the
/// previous message already contains (drivers often repeat their source). For the one
/// readable line a binary prints when it fails.
pub fn error_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut last = line.clone();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !last.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        last = text;
        source = cause.source();
    }
    line
}

/// The README's code blocks compile as doc tests, so the first screen stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
