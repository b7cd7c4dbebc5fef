//! `idem ops`: inspect operations by key, find stuck ones, release leases, settle an
//! uncertain one that no reconciler can.

use crate::out::say;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};
use idem::{Key, Record, Status, Store};

use crate::{Cli, store};

#[derive(Subcommand)]
pub(crate) enum Ops {
    /// One operation's record in full.
    Show {
        #[command(flatten)]
        key: KeyArgs,
        #[arg(long)]
        json: bool,
    },
    /// Unresolved operations in a status, oldest first.
    List {
        /// processing, pending or failed (completed works too).
        #[arg(long, value_parser = parse_status)]
        status: Status,
        /// Only those not updated for this long: 30s, 10m, 2h, 1d.
        #[arg(long, default_value = "0s", value_parser = parse_duration)]
        older_than: Duration,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Expire a lease by hand, for a worker known to be dead: the next delivery takes
    /// the operation over with a new fencing token.
    Release {
        #[command(flatten)]
        key: KeyArgs,
    },
    /// Settle an uncertain (`pending`) operation by hand, once you have checked with the
    /// provider that its effect did not happen: the next delivery or request runs it
    /// again. For routes and handlers without a reconciler, whose pending keys
    /// otherwise wait forever (an HTTP request gets 409).
    Resolve {
        #[command(flatten)]
        key: KeyArgs,
        /// What you found: the effect did not happen (the only finding this command
        /// takes; an applied effect needs its result, which a reconciler gives).
        #[arg(long, required = true)]
        not_applied: bool,
        /// The lease_token `idem ops show` printed when you checked: if a worker took
        /// the operation since (and may have acted), nothing is resolved.
        #[arg(long)]
        token: i64,
        /// Why, kept in the record's error (a ticket, what the provider said).
        #[arg(long, default_value = "")]
        note: String,
    },
    /// Erase what idem stored about a subject (a scope, or one key of it): results,
    /// HTTP answers, errors, provider references and published follow-ups. The keys
    /// stay as tombstones: a redelivery is acked, a retried request gets 410, nothing
    /// runs again. Audited in `erasures` (`idem ops erasures`).
    Erase(crate::protect::EraseArgs),
    /// Order per entity: entities whose deliveries wait (`list`), skipping a turn
    /// (`skip`).
    Ordering {
        #[command(subcommand)]
        command: crate::ordering::Ordering,
    },
    /// The erasures made, newest first.
    Erasures {
        /// Only this scope's.
        #[arg(long)]
        scope: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
pub(crate) struct KeyArgs {
    /// Tenant or actor.
    #[arg(long)]
    scope: String,
    /// Operation name, e.g. orders.create.
    #[arg(long)]
    operation: String,
    /// The idempotency key (business event ID), or the 12-digit key hash logs show.
    #[arg(long)]
    key: String,
}

impl KeyArgs {
    /// The key as given, or, when no record has it and it looks like a key hash, the
    /// key of the one record in the scope and operation with that hash.
    async fn resolve(&self, store: &Store) -> anyhow::Result<Key> {
        let key = Key::new(&self.scope, &self.operation, &self.key)?;
        if !Key::looks_like_short_hash(&self.key) || store.get(&key).await?.is_some() {
            return Ok(key);
        }
        let found = store
            .find_by_short_hash(&self.scope, &self.operation, &self.key)
            .await?;
        match found.as_slice() {
            [] => Ok(key),
            [record] => Ok(Key::new(
                &record.scope,
                &record.operation,
                &record.idempotency_key,
            )?),
            _ => bail!(
                "{} records in scope {} share the key hash {}: give the key itself",
                found.len(),
                self.scope,
                self.key
            ),
        }
    }
}

pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?}: expected a number and a unit, e.g. 10m"))?;
    let secs = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "s" | "" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        other => return Err(format!("{other:?}: unit must be ms, s, m, h or d")),
    };
    Ok(Duration::from_secs(secs))
}

fn parse_status(text: &str) -> Result<Status, String> {
    text.parse().map_err(|e: idem::store::UnknownStatus| {
        format!("{e}: expected processing, pending, failed or completed")
    })
}

/// Runs one `idem ops` command.
pub(crate) async fn run(cli: &Cli, command: &Ops) -> anyhow::Result<()> {
    let store = store(cli).await?;
    match command {
        Ops::Show { key, json } => show(&store, key, *json).await,
        Ops::List {
            status,
            older_than,
            limit,
            json,
        } => list(&store, *status, *older_than, *limit, *json).await,
        Ops::Release { key } => release(&store, key).await,
        Ops::Resolve {
            key, note, token, ..
        } => resolve(&store, key, *token, note).await,
        Ops::Erase(args) => crate::protect::erase(&store, args).await,
        Ops::Ordering { command } => crate::ordering::run(&store, command).await,
        Ops::Erasures { scope, limit, json } => {
            crate::protect::erasures(&store, scope.as_deref(), *limit, *json).await
        }
    }
}

/// `idem ops show`: one record, whole.
async fn show(store: &Store, key: &KeyArgs, json: bool) -> anyhow::Result<()> {
    let key = key.resolve(store).await?;
    let Some(record) = store.get(&key).await? else {
        bail!(
            "no record for {key} (scope {}, key {})",
            key.scope(),
            key.idempotency_key()
        );
    };
    let retention = store.retention_of(key.operation()).await?;
    if json {
        let mut value = serde_json::to_value(&record)?;
        value["operation_retention_ms"] = retention.map(|d| d.as_millis() as u64).into();
        say!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print_record(&record);
        let kept = record
            .completed_at
            .zip(record.expires_at)
            .and_then(|(done, expires)| (expires - done).to_std().ok());
        say!(
            "retention         {}; this record: {}",
            retention.map_or("the store's (no operation_retention)".into(), |d| {
                format!("{} (operation_retention)", humane(d))
            }),
            kept.map_or("-".into(), |d| format!(
                "expires {} after completion",
                humane(d)
            ))
        );
    }
    Ok(())
}

/// `idem ops list`: records in a status not updated for a while, oldest first.
async fn list(
    store: &Store,
    status: Status,
    older_than: Duration,
    limit: i64,
    json: bool,
) -> anyhow::Result<()> {
    let records = store.list(status, older_than, limit).await?;
    if json {
        say!("{}", serde_json::to_string_pretty(&records)?);
        return Ok(());
    }
    say!(
        "{} {status} operations not updated for {}, oldest first",
        records.len(),
        humane(older_than)
    );
    for r in &records {
        say!(
            "  {}  {} / {} / {}  attempts {}  owner {}  lease until {}  {}",
            r.updated_at.to_rfc3339(),
            r.scope,
            r.operation,
            r.idempotency_key,
            r.attempts,
            r.owner.as_deref().unwrap_or("-"),
            r.lease_expires_at
                .map(|t| t.to_rfc3339())
                .unwrap_or_else(|| "-".into()),
            r.error.as_ref().map(|e| e.to_string()).unwrap_or_default(),
        );
    }
    Ok(())
}

/// A duration as `--older-than` takes it, in its largest whole unit (`90s`, `10m`, `2h`,
/// `7d`), `0s` for none: what the command prints can be pasted back.
fn humane(d: Duration) -> String {
    let ms = d.as_millis();
    let units: [(u128, &str); 5] = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
        (1, "ms"),
    ];
    match units
        .iter()
        .find(|(unit, _)| ms >= *unit && ms.is_multiple_of(*unit))
    {
        Some((unit, name)) => format!("{}{name}", ms / unit),
        None => "0s".into(),
    }
}

/// `idem ops release`: ends a processing record's lease (its worker is dead).
async fn release(store: &Store, key: &KeyArgs) -> anyhow::Result<()> {
    let key = key.resolve(store).await?;
    match store.release(&key).await? {
        Some(r) => say!(
            "released {} / {} / {}: status {}, lease token {} expired now; the next delivery takes it over",
            r.scope,
            r.operation,
            r.idempotency_key,
            r.status,
            r.lease_token
        ),
        None => bail!(match store.get(&key).await? {
            Some(r) if r.status == Status::Pending => format!(
                "{key} is pending, not released: a lease on it is a reconciler's and lapses on \
                 its own; once the provider says the effect did not happen, settle it with \
                 `idem ops resolve --not-applied --token {}`",
                r.lease_token
            ),
            Some(r) => format!("{key} is {}, not processing: no lease to release", r.status),
            None => format!("no record for {key}"),
        }),
    }
    Ok(())
}

/// `idem ops resolve --not-applied`: settles an uncertain operation by hand.
async fn resolve(store: &Store, key: &KeyArgs, token: i64, note: &str) -> anyhow::Result<()> {
    let key = key.resolve(store).await?;
    match store.resolve_not_applied(&key, token, note).await? {
        Some(r) => say!(
            "resolved {} / {} / {} as not applied: now failed (retryable) after {} attempt(s); the next delivery or request runs it again",
            r.scope,
            r.operation,
            r.idempotency_key,
            r.attempts
        ),
        None => bail!(unresolved(&key, store.get(&key).await?.as_ref(), token)),
    }
    Ok(())
}

/// Why `resolve --not-applied` left `key` as it is.
fn unresolved(key: &Key, record: Option<&Record>, token: i64) -> String {
    let Some(r) = record else {
        return format!("no record for {key}");
    };
    if !r.awaits_reconcile() {
        return format!(
            "{key} is {}{}: only an uncertain (pending) operation is resolved by hand",
            r.status,
            if r.retryable { " (retryable)" } else { "" }
        );
    }
    if r.discarded_at.is_some() {
        return format!("{key} was discarded: it stays discarded");
    }
    if r.lease_token != token {
        return format!(
            "{key} changed since you checked (lease_token {} now, not {token}): a worker took it and may have acted; check with the provider again",
            r.lease_token
        );
    }
    format!(
        "{key} is leased (until {}): a worker took it to reconcile; its next delivery or request reconciles it, or it becomes pending again to resolve",
        r.lease_expires_at
            .map(|t| t.to_rfc3339())
            .unwrap_or_else(|| "-".into())
    )
}

fn print_record(r: &Record) {
    let t = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".into())
    };
    say!("scope             {}", r.scope);
    say!("operation         {}", r.operation);
    say!("idempotency_key   {}", r.idempotency_key);
    say!(
        "status            {}{}{}",
        r.status,
        if r.retryable { " (retryable)" } else { "" },
        if r.reconcile_first && r.status != Status::Completed {
            " (was uncertain: reconciled before any run)"
        } else {
            ""
        }
    );
    say!("attempts          {}", r.attempts);
    say!(
        "payload_sha256    {}  ({})",
        r.payload_sha256,
        r.fingerprint_key
            .as_deref()
            .map_or("unkeyed SHA-256".into(), |k| format!("HMAC, key {k}"))
    );
    say!("lease_token       {}", r.lease_token);
    say!("lease_expires_at  {}", t(r.lease_expires_at));
    say!("owner             {}", r.owner.as_deref().unwrap_or("-"));
    say!(
        "result            {}",
        r.result
            .as_ref()
            .map(|v| v.to_string())
            .unwrap_or_else(|| "-".into())
    );
    say!(
        "error             {}",
        r.error
            .as_ref()
            .map(|v| v.to_string())
            .unwrap_or_else(|| "-".into())
    );
    say!(
        "external_ref      {}",
        idem::text::printable(r.external_ref.as_deref().unwrap_or("-"))
    );
    say!(
        "message_id        {}",
        idem::text::printable(r.message_id.as_deref().unwrap_or("-"))
    );
    say!(
        "correlation_id    {}",
        idem::text::printable(r.correlation_id.as_deref().unwrap_or("-"))
    );
    say!("trace_id          {}", r.trace_id.as_deref().unwrap_or("-"));
    say!("dead_lettered_at  {}", t(r.dead_lettered_at));
    say!(
        "dead_letters      {}  (pinned while above 0: gc keeps the record)",
        r.dead_letters
    );
    say!(
        "replay_count      {}  (last {})",
        r.replay_count,
        t(r.last_replayed_at)
    );
    say!("discarded_at      {}", t(r.discarded_at));
    say!("erased_at         {}", t(r.erased_at));
    say!("created_at        {}", r.created_at.to_rfc3339());
    say!("updated_at        {}", r.updated_at.to_rfc3339());
    say!("completed_at      {}", t(r.completed_at));
    say!("expires_at        {}", t(r.expires_at));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_print_as_the_flag_takes_them() {
        for (d, text) in [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(600), "10m"),
            (Duration::from_secs(7 * 86_400), "7d"),
            (Duration::from_millis(1500), "1500ms"),
        ] {
            assert_eq!(humane(d), text);
            assert_eq!(parse_duration(text), Ok(d), "{text} reads back");
        }
    }
}
