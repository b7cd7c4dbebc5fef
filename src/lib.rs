//! idem: at-least-once RabbitMQ consumers that never repeat a side effect.
//!
//! A worker derives a stable [`Key`] from each message's business event ID, claims it
//! in the Postgres table `processed_operations` through the [`Store`], runs the
//! handler, records the outcome, and only then acks. A redelivery, a duplicate publish,
//! a crashed worker or a replayed dead letter finds the record and does not run the
//! effect again. The contract is `DESIGN.md`.
#![warn(missing_docs)]

pub mod db;
pub mod fingerprint;
pub mod key;
pub mod store;

pub use fingerprint::Fingerprint;
pub use key::{Key, KeyError};
pub use store::{Claim, Lease, Origin, Record, Status, Store, StoreConfig, StoreError};
