//! `idem flow`: the circuits of queues with a breaker and the limits of named
//! dependencies, and closing a circuit by hand.

use clap::Subcommand;
use idem::flow::{self, CircuitRow, LimitRow};
use serde_json::json;

use crate::out::say;
use crate::{Cli, store};

#[derive(Subcommand)]
pub(crate) enum Flow {
    /// Each circuit (state, opens in a row, next probe, why) and each limit's use now
    /// (permits held and by whom, calls in the last second).
    Show {
        #[arg(long)]
        json: bool,
    },
    /// Close a queue's circuit now: its workers take its deliveries again within a
    /// second (the breaker opens it again if the dependency still fails).
    Close {
        /// The queue.
        queue: String,
        /// Why, kept as the circuit's reason.
        #[arg(long)]
        note: String,
    },
}

pub(crate) async fn run(cli: &Cli, command: &Flow) -> anyhow::Result<()> {
    let store = store(cli).await?;
    let pool = store.pool();
    match command {
        Flow::Show { json } => {
            let circuits = flow::circuits(pool).await?;
            let limits = flow::limits(pool).await?;
            if *json {
                let circuits: Vec<_> = circuits.iter().map(circuit_json).collect();
                let limits: Vec<_> = limits.iter().map(limit_json).collect();
                say!("{}", json!({ "circuits": circuits, "limits": limits }));
            } else {
                print(&circuits, &limits);
            }
        }
        Flow::Close { queue, note } => match flow::close_circuit(pool, queue, note).await? {
            Some(before) => say!(
                "circuit of {queue} closed (it was {}); its workers take deliveries again within a second",
                before.as_str()
            ),
            None => anyhow::bail!("queue {queue} has no circuit (its breaker never opened)"),
        },
    }
    Ok(())
}

fn print(circuits: &[CircuitRow], limits: &[LimitRow]) {
    if circuits.is_empty() {
        say!("circuits: none has opened");
    }
    for c in circuits {
        let when = match (c.state(), c.retry_at) {
            (idem::flow::CircuitState::Open, Some(at)) => format!(", next probe at {}", time(at)),
            (idem::flow::CircuitState::HalfOpen, Some(at)) => {
                format!(", probing until {}", time(at))
            }
            _ => String::new(),
        };
        say!(
            "circuit {}: {} since {} ({} opens in a row{when}){}",
            c.name,
            c.state,
            time(c.changed_at),
            c.opens,
            c.reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        );
    }
    if limits.is_empty() {
        say!("limits: none used");
    }
    for l in limits {
        let concurrency = if l.slots > 0 {
            format!("{} of {} permits held", l.held, l.slots)
        } else {
            "no concurrency bound".into()
        };
        let rate = if l.per_second > 0 {
            format!(
                "{} of {} calls in the last second",
                l.last_second, l.per_second
            )
        } else {
            "no rate bound".into()
        };
        let holders = if l.holders.is_empty() {
            String::new()
        } else {
            format!(" (by {})", l.holders.join(", "))
        };
        say!("limit {}: {concurrency}{holders}; {rate}", l.name);
    }
}

fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn circuit_json(c: &CircuitRow) -> serde_json::Value {
    json!({
        "queue": c.name,
        "state": c.state,
        "opens": c.opens,
        "retry_at": c.retry_at,
        "reason": c.reason,
        "changed_at": c.changed_at,
    })
}

fn limit_json(l: &LimitRow) -> serde_json::Value {
    json!({
        "limit": l.name,
        "permits": l.slots,
        "held": l.held,
        "holders": l.holders,
        "per_second": l.per_second,
        "last_second": l.last_second,
    })
}
