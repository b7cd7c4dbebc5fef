//! `idem ops ordering`: entities whose deliveries wait for their turn, and skipping a
//! turn that will never come (docs/DESIGN.md, "Order per entity").

use std::time::Duration;

use anyhow::bail;
use clap::Subcommand;
use idem::Store;
use idem::ordering::{self, Position, Skipped};

use crate::ops::parse_duration;
use crate::out::say;

#[derive(Subcommand)]
pub(crate) enum Ordering {
    /// Entities with deliveries waiting, those not moved for longest first: what
    /// blocks each (running, retrying, pending, dead-lettered, a gap: a number that
    /// never arrived, or released: a turn handed over and not begun).
    List {
        /// Only those that have not moved for this long (stalled): 30s, 10m, 2h.
        #[arg(long, default_value = "0s", value_parser = parse_duration)]
        stalled_for: Duration,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Skip the turn an entity waits for (a gap that will never be filled, a dead letter
    /// that will not be replayed): the next waiting delivery runs within a second or so.
    /// A skipped message that arrives later is dead-lettered as `sequence_passed` (one
    /// of an entity ordered by arrival takes a new place at the end).
    Skip {
        /// The entity's scope (tenant).
        #[arg(long)]
        scope: String,
        /// The entity's ordering key.
        #[arg(long)]
        key: String,
        /// Why (a ticket, what was lost), kept on the entity.
        #[arg(long)]
        note: String,
        /// The sequence number to skip, as the listing showed it (`next`): nothing is
        /// skipped if the entity moved since.
        #[arg(long)]
        seq: Option<i64>,
    },
}

pub(crate) async fn run(store: &Store, command: &Ordering) -> anyhow::Result<()> {
    match command {
        Ordering::List {
            stalled_for,
            limit,
            json,
        } => list(store, *stalled_for, *limit, *json).await,
        Ordering::Skip {
            scope,
            key,
            note,
            seq,
        } => skip(store, scope, key, note, *seq).await,
    }
}

async fn list(store: &Store, stalled_for: Duration, limit: i64, json: bool) -> anyhow::Result<()> {
    let stalled = (!stalled_for.is_zero()).then_some(stalled_for);
    let positions = ordering::list(store.pool(), stalled, limit).await?;
    if json {
        let rows: Vec<_> = positions.iter().map(as_json).collect();
        say!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    say!(
        "{} entities with deliveries waiting{}",
        positions.len(),
        if stalled.is_some() { ", stalled" } else { "" }
    );
    for p in &positions {
        let holder = p
            .holder
            .as_ref()
            .map_or("-".into(), |(op, key)| format!("{op} / {key}"));
        say!(
            "  {} / {}  next {}  blocked by {}  holder {}  waiting {} (first {})  not moved since {}{}",
            p.scope,
            p.ordering_key,
            p.next_seq,
            p.blocked_by(),
            holder,
            p.waiting,
            p.first_waiting.map_or("-".into(), |s| s.to_string()),
            p.moved_at.to_rfc3339(),
            p.skip_note.as_ref().map_or(String::new(), |n| format!(
                "  skipped {} (last: {n})",
                p.skipped
            )),
        );
    }
    Ok(())
}

fn as_json(p: &Position) -> serde_json::Value {
    serde_json::json!({
        "scope": p.scope,
        "ordering_key": p.ordering_key,
        "next_seq": p.next_seq,
        "blocked_by": p.blocked_by(),
        "holder": p.holder.as_ref().map(|(op, key)| serde_json::json!({"operation": op, "idempotency_key": key})),
        "holder_status": p.holder_status,
        "waiting": p.waiting,
        "first_waiting": p.first_waiting,
        "moved_at": p.moved_at,
        "skipped": p.skipped,
        "skip_note": p.skip_note,
    })
}

async fn skip(
    store: &Store,
    scope: &str,
    key: &str,
    note: &str,
    seq: Option<i64>,
) -> anyhow::Result<()> {
    match ordering::skip(store.pool(), scope, key, note, seq).await? {
        Skipped::Skipped { seq } => {
            say!(
                "skipped {scope} / {key} sequence {seq}: {} runs next",
                seq + 1
            );
            Ok(())
        }
        Skipped::Moved { next_seq } => bail!(
            "{scope} / {key} moved on: its turn is {next_seq} now; nothing skipped (list it again)"
        ),
        Skipped::Ran { seq } => {
            say!(
                "{scope} / {key} sequence {seq} had run already (its record completed): moved on past it, nothing skipped; {} runs next",
                seq + 1
            );
            Ok(())
        }
        Skipped::Unknown => bail!("no entity {scope} / {key}"),
        Skipped::Running => bail!(
            "the holder of {scope} / {key} runs now (a live lease, or a turn taken within the last minute): skipping would run its successor beside it; wait, or `idem ops release` it first"
        ),
        _ => bail!("not skipped"),
    }
}
