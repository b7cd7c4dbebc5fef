//! `idem outbox`: the follow-up messages waiting to be published, and why.

use crate::out::say;
use clap::Subcommand;
use idem::outbox::{self, OutboxEntry, OutboxStats};

use crate::{Cli, store};

#[derive(Subcommand)]
pub(crate) enum Outbox {
    /// The backlog: messages not published yet, the oldest one's age, and how many of
    /// them failed their last publish (returned as unroutable, nacked, unconfirmed).
    Stats {
        #[arg(long)]
        json: bool,
    },
    /// Messages not published yet, oldest first, with the last error of each.
    List {
        /// Only those whose last publish failed.
        #[arg(long)]
        failing: bool,
        /// Only delayed messages not due yet, the soonest first.
        #[arg(long, conflicts_with_all = ["failing", "all"])]
        scheduled: bool,
        /// Dispatched ones too (kept until their retention ends).
        #[arg(long)]
        all: bool,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
}

pub(crate) async fn run(cli: &Cli, command: &Outbox) -> anyhow::Result<()> {
    let store = store(cli).await?;
    let pool = store.pool();
    match command {
        Outbox::Stats { json } => {
            let stats = outbox::stats(pool).await?;
            let dispatched = outbox::dispatched(pool).await?;
            if *json {
                say!("{}", stats_json(&stats, dispatched));
            } else {
                print_stats(&stats, dispatched);
            }
        }
        Outbox::List {
            failing,
            scheduled,
            all,
            limit,
            json,
        } => {
            let entries = if *scheduled {
                outbox::scheduled(pool, *limit).await?
            } else {
                outbox::list(pool, *all, *failing, *limit).await?
            };
            if *json {
                for entry in &entries {
                    say!("{}", entry_json(entry));
                }
            } else if entries.is_empty() {
                say!("nothing waits in the outbox");
            } else {
                for entry in &entries {
                    print_entry(entry);
                }
            }
        }
    }
    Ok(())
}

fn print_stats(stats: &OutboxStats, dispatched: i64) {
    let oldest = stats
        .oldest_age_s
        .map(|s| format!("{s:.1} s"))
        .unwrap_or_else(|| "-".into());
    say!("undispatched: {}", stats.undispatched);
    say!("oldest:       {oldest}");
    say!("failing:      {}", stats.failing);
    match stats.next_due {
        Some(next) => say!(
            "scheduled:    {} (delayed, not due yet; the next at {})",
            stats.scheduled,
            next.format("%Y-%m-%d %H:%M:%S")
        ),
        None => say!("scheduled:    0"),
    }
    say!("dispatched:   {dispatched} (kept until their retention ends)");
}

fn stats_json(stats: &OutboxStats, dispatched: i64) -> serde_json::Value {
    serde_json::json!({
        "undispatched": stats.undispatched,
        "oldest_age_s": stats.oldest_age_s,
        "failing": stats.failing,
        "scheduled": stats.scheduled,
        "next_due": stats.next_due,
        "dispatched": dispatched,
    })
}

fn print_entry(entry: &OutboxEntry) {
    let state = match (&entry.dispatched_at, &entry.last_error, &entry.not_before) {
        (Some(at), _, _) => format!("dispatched {}", at.format("%Y-%m-%d %H:%M:%S")),
        (None, Some(error), _) => format!("failing: {}", idem::text::printable(error)),
        (None, None, Some(at)) if *at > chrono::Utc::now() => {
            format!("scheduled for {}", at.format("%Y-%m-%d %H:%M:%S"))
        }
        (None, None, _) => "waiting".into(),
    };
    say!(
        "{} {} #{} from {}/{} to {:?}/{:?}, {} B, staged {}, {} attempts, {state}",
        entry.id,
        entry.message_id,
        entry.position,
        entry.operation,
        &entry.source[..12.min(entry.source.len())],
        entry.exchange,
        entry.routing_key,
        entry.body_bytes,
        entry.staged_at.format("%Y-%m-%d %H:%M:%S"),
        entry.attempts,
    );
}

fn entry_json(entry: &OutboxEntry) -> serde_json::Value {
    serde_json::json!({
        "id": entry.id,
        "message_id": entry.message_id,
        "operation": entry.operation,
        "source_key_hash": &entry.source[..12.min(entry.source.len())],
        "position": entry.position,
        "exchange": entry.exchange,
        "routing_key": entry.routing_key,
        "body_bytes": entry.body_bytes,
        "staged_at": entry.staged_at,
        "attempts": entry.attempts,
        "last_error": entry.last_error,
        "dispatched_at": entry.dispatched_at,
        "not_before": entry.not_before,
    })
}
