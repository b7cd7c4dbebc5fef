//! Flow control (docs/DESIGN.md, "Flow control"): what keeps a failing provider from
//! filling the DLQ, and a provider's limits from being exceeded, across every worker
//! process, held in Postgres.
//!
//! - `breaker`: [`CircuitBreaker`], when a queue's circuit opens, and the counting;
//! - `circuit`: a queue's circuit at run time, shared through `flow_circuits`: the
//!   worker stops taking the queue's deliveries while it is open, lets one probe
//!   through when its pause ends, and closes on the probe's success;
//! - `limit`: [`Limit`], at most N calls at once and R per second to a named
//!   dependency, shared through `flow_permits` and `flow_rate_slots`;
//! - `status`: where a circuit stands, what `idem flow` and the console show, and
//!   closing a circuit by hand.

mod breaker;
pub(crate) mod circuit;
mod limit;
mod status;

pub use breaker::{CircuitBreaker, FailureRatio};
pub use limit::{Limit, LimitError, Permit};
pub use status::{CircuitRow, CircuitState, LimitRow, circuits, close_circuit, limits};
