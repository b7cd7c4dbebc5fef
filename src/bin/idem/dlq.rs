//! `idem dlq`: inspect, replay and discard dead letters.

use crate::out::say;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use idem::replay::{self, Action, Filter, Options};
use lapin::Connection;
use serde_json::json;

use crate::{Cli, broker, store};

#[derive(Subcommand)]
pub(crate) enum Dlq {
    /// Dead letters grouped by reason, then by operation and error, with counts.
    List {
        #[command(flatten)]
        queue: QueueArg,
        /// Read at most this many messages.
        #[arg(long, default_value_t = 100_000)]
        limit: usize,
        /// JSON for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Dead letters with their idem-* headers and body.
    Show {
        #[command(flatten)]
        queue: QueueArg,
        #[command(flatten)]
        filter: FilterArgs,
        /// JSON lines for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Republish dead letters to their original queue (completed keys are acked instead).
    Replay {
        #[command(flatten)]
        queue: QueueArg,
        #[command(flatten)]
        filter: FilterArgs,
        /// Count what would happen, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// At most this many messages per second.
        #[arg(long)]
        max_rate: Option<f64>,
        /// The summary as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove dead letters for good, recording the decision on their records.
    Discard {
        #[command(flatten)]
        queue: QueueArg,
        #[command(flatten)]
        filter: FilterArgs,
        /// Count what would happen, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// The summary as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
pub(crate) struct QueueArg {
    /// The work queue (its DLQ is `<queue>.dlq`), or the DLQ itself.
    #[arg(long)]
    queue: String,
}

#[derive(Args)]
pub(crate) struct FilterArgs {
    /// Only this reason: malformed, fingerprint_conflict, permanent_failure,
    /// retries_exhausted, undecidable.
    #[arg(long)]
    reason: Option<String>,
    /// Only this key: the idempotency key, or the key hash logs show.
    #[arg(long)]
    key: Option<String>,
    /// Only this scope's letters (`idem-scope`): with discard, a subject's erasure
    /// from the DLQ.
    #[arg(long)]
    scope: Option<String>,
    /// At most this many messages.
    #[arg(long)]
    limit: Option<usize>,
    /// Stop after leaving this many letters unacked without acting on them (not
    /// selected, left alone, a dry run's): each waits on the broker until the pass ends.
    #[arg(long, default_value_t = replay::HOLD_MAX)]
    hold: usize,
}

impl FilterArgs {
    fn filter(&self) -> Filter {
        Filter {
            reason: self.reason.clone(),
            key: self.key.clone(),
            scope: self.scope.clone(),
            limit: self.limit,
            ..Filter::default()
        }
    }

    /// What a replay or discard pass is told: this filter, this hold.
    fn options(&self, dry_run: bool, pace: Option<Duration>) -> Options {
        Options {
            filter: self.filter(),
            dry_run,
            pace,
            hold: Some(self.hold),
        }
    }
}

/// Runs one `idem dlq` command.
pub(crate) async fn run(cli: &Cli, command: &Dlq) -> anyhow::Result<()> {
    let connection = broker(cli).await?;
    let done = match command {
        Dlq::List { queue, limit, json } => list(&connection, &queue.queue, *limit, *json).await,
        Dlq::Show {
            queue,
            filter,
            json,
        } => show(&connection, &queue.queue, filter, *json).await,
        Dlq::Replay {
            queue,
            filter,
            dry_run,
            max_rate,
            json,
        } => {
            let pace = match max_rate {
                Some(rate) if *rate > 0.0 => Some(Duration::from_secs_f64(1.0 / rate)),
                Some(_) => bail!("--max-rate must be above 0"),
                None => None,
            };
            let options = filter.options(*dry_run, pace);
            act(
                cli,
                &connection,
                &queue.queue,
                Action::Replay,
                &options,
                *json,
            )
            .await
        }
        Dlq::Discard {
            queue,
            filter,
            dry_run,
            json,
        } => {
            let options = filter.options(*dry_run, None);
            act(
                cli,
                &connection,
                &queue.queue,
                Action::Discard,
                &options,
                *json,
            )
            .await
        }
    };
    let _ = connection.close(200, "done".into()).await;
    done
}

/// `idem dlq list`: a DLQ's letters grouped by why they died.
async fn list(
    connection: &Connection,
    queue: &str,
    limit: usize,
    json: bool,
) -> anyhow::Result<()> {
    let dlq = replay::dlq_of(queue);
    let messages = replay::peek(connection, &dlq, &Filter::default(), limit)
        .await
        .with_context(|| format!("read {dlq}"))?;
    let groups = replay::group(&messages);
    if json {
        say!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"dlq": dlq, "messages": messages.len(), "groups": groups})
            )?
        );
    } else {
        print_groups(&dlq, messages.len(), &groups);
    }
    Ok(())
}

/// Prints the selected dead letters with their `idem-*` headers and body.
async fn show(
    connection: &Connection,
    queue: &str,
    filter: &FilterArgs,
    json: bool,
) -> anyhow::Result<()> {
    let dlq = replay::dlq_of(queue);
    let messages = replay::peek(connection, &dlq, &filter.filter(), usize::MAX)
        .await
        .with_context(|| format!("read {dlq}"))?;
    for m in &messages {
        let view = json!({
            "reason": m.reason, "error": m.error, "operation": m.operation,
            "scope": m.scope, "key": m.key, "key_hash": m.key_hash,
            "attempts": m.attempts, "original_queue": m.original_queue,
            "failed_at": m.failed_at,
            "message_id": m.delivery.properties.message_id().as_ref().map(|s| s.as_str()),
            "type": m.message_type(),
            "headers": m.headers(),
            "body": m.body_text(),
        });
        if json {
            say!("{view}");
        } else {
            say!("{}\n", serde_json::to_string_pretty(&view)?);
        }
    }
    if !json {
        say!("{} dead letters shown from {dlq}", messages.len());
    }
    Ok(())
}

/// Dead letters grouped by reason, then operation and error, as a table.
fn print_groups(dlq: &str, total: usize, groups: &[replay::Group]) {
    say!("{dlq}: {total} dead letters");
    let mut reason = String::new();
    for g in groups {
        if g.reason != reason {
            let total: usize = groups
                .iter()
                .filter(|x| x.reason == g.reason)
                .map(|x| x.count)
                .sum();
            say!("\n{} ({total})", idem::text::printable(&g.reason));
            reason = g.reason.clone();
        }
        let time = |t: Option<chrono::DateTime<chrono::Utc>>| {
            t.map(|t| t.to_rfc3339()).unwrap_or_else(|| "?".into())
        };
        say!(
            "  {:>6}  {:<24} {}  [oldest {}, newest {}]",
            g.count,
            idem::text::printable(&g.operation),
            idem::text::printable(&g.error),
            time(g.oldest),
            time(g.newest),
        );
    }
}

async fn act(
    cli: &Cli,
    connection: &Connection,
    queue: &str,
    action: Action,
    options: &Options,
    json: bool,
) -> anyhow::Result<()> {
    let store = store(cli).await?;
    let dlq = replay::dlq_of(queue);
    let summary = replay::run(connection, &store, &dlq, action, options)
        .await
        .with_context(|| format!("{action:?} from {dlq}").to_lowercase())?;
    if json {
        say!("{}", serde_json::to_string(&summary)?);
        return Ok(());
    }
    let verb = if options.dry_run { "would be " } else { "" };
    say!(
        "{dlq}{}:",
        if options.dry_run {
            " (dry run, nothing changed)"
        } else {
            ""
        }
    );
    let line = |label: String, n: usize, note: &str| say!("  {label:<26}{n:>6}  {note}");
    match action {
        Action::Replay => {
            line(format!("{verb}replayed"), summary.replayed, "");
            line(
                format!("{verb}already done"),
                summary.already_done,
                "completed keys, acked without republishing",
            );
        }
        Action::Discard => line(format!("{verb}discarded"), summary.discarded, ""),
    }
    line(
        "conflicts left".into(),
        summary.conflicts_left,
        "a changed payload needs a new key",
    );
    line("malformed left".into(), summary.malformed_left, "");
    line("not selected".into(), summary.skipped, "");
    if summary.incomplete {
        say!(
            "  stopped after leaving {} letters unacked unselected: letters past them were not looked at (--hold)",
            options.hold.unwrap_or(replay::HOLD_MAX)
        );
    }
    Ok(())
}
