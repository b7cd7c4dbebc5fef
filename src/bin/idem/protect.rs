//! `idem keys` and `idem ops erase`: the keys stored values are sealed with, and
//! erasure by subject (docs/DESIGN.md, "Data protection").

use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use idem::Store;
use idem::protect::{self, KEYS_ENV};

use crate::out::say;
use crate::{Cli, store};

#[derive(Subcommand)]
pub(crate) enum Keys {
    /// Print a new key entry (`id:64 hex digits`) to put first in IDEM_KEYS.
    New {
        /// Its id, e.g. k2 or 2026-12.
        #[arg(long)]
        id: String,
    },
    /// What each key holds: results, references, follow-up bodies, fingerprints; and
    /// what is in plaintext (key `-`).
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Re-seal every value an older key (or no key) sealed with the newest key of
    /// IDEM_KEYS, in paced batches; live workers go on meanwhile.
    Rotate {
        /// Rows per statement.
        #[arg(long, default_value_t = 500)]
        batch: i64,
        /// Pause between statements, in milliseconds.
        #[arg(long, default_value_t = 20)]
        pause_ms: u64,
    },
    /// Mark a key retired once nothing is under it, so processes may start without it.
    Retire {
        /// The key id.
        #[arg(long)]
        id: String,
    },
}

#[derive(Args)]
pub(crate) struct EraseArgs {
    /// The subject's scope (tenant, customer, actor).
    #[arg(long)]
    scope: String,
    /// Only this idempotency key of the scope (of every operation).
    #[arg(long)]
    key: Option<String>,
    /// Why: a ticket or request reference, kept in the audit row.
    #[arg(long)]
    note: String,
    /// Who erases (default: $USER).
    #[arg(long, env = "USER", hide_env_values = true)]
    by: String,
    #[arg(long)]
    json: bool,
}

/// `idem ops erase`.
pub(crate) async fn erase(store: &Store, args: &EraseArgs) -> anyhow::Result<()> {
    if args.note.trim().is_empty() || args.by.trim().is_empty() {
        bail!("an erasure needs --note (why) and --by (who)");
    }
    let done = store
        .erase(&args.scope, args.key.as_deref(), &args.by, &args.note)
        .await
        .context("erase")?;
    if args.json {
        say!("{}", serde_json::to_string(&done)?);
    } else {
        say!(
            "erasure {}: {} record(s) erased (tombstones kept), {} follow-up(s) deleted, {} skipped (in flight, pending, to be retried, follow-ups not yet published, or deliveries waiting for their turn: erase again once settled)",
            done.id,
            done.records,
            done.follow_ups,
            done.skipped
        );
        say!(
            "the broker's dead letters are not in the database: discard them with `idem dlq discard --queue <queue> --scope {}`",
            idem::text::printable(&args.scope)
        );
    }
    Ok(())
}

/// `idem ops erasures`.
pub(crate) async fn erasures(
    store: &Store,
    scope: Option<&str>,
    limit: i64,
    json: bool,
) -> anyhow::Result<()> {
    let rows = protect::erasures(store.pool(), scope, limit).await?;
    if json {
        say!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    say!("ID\tERASED_AT\tBY\tSCOPE\tKEY\tRECORDS\tFOLLOW_UPS\tSKIPPED\tNOTE");
    for r in rows {
        say!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            r.id,
            r.erased_at.to_rfc3339(),
            idem::text::printable(&r.erased_by),
            idem::text::printable(&r.scope),
            idem::text::printable(r.idempotency_key.as_deref().unwrap_or("*")),
            r.records,
            r.follow_ups,
            r.skipped,
            idem::text::printable(&r.note)
        );
    }
    Ok(())
}

/// Runs one `idem keys` command.
pub(crate) async fn run(cli: &Cli, command: &Keys) -> anyhow::Result<()> {
    if let Keys::New { id } = command {
        // Parsed back, so that a bad id is refused here and not at a worker's start.
        let entry = protect::Keys::generate(id);
        protect::Keys::parse(&entry)?;
        say!("{entry}");
        return Ok(());
    }
    let store = store(cli).await?;
    let pool = store.pool();
    match command {
        Keys::New { .. } => {}
        Keys::Status { json } => {
            let uses = protect::key_use(pool).await?;
            if *json {
                say!("{}", serde_json::to_string_pretty(&uses)?);
                return Ok(());
            }
            say!(
                "KEY\tRESULTS\tREFERENCES\tBODIES\tWAITING\tFINGERPRINTS\tSUPERSEDED_AT\tRETIRED_AT"
            );
            let t =
                |t: Option<chrono::DateTime<chrono::Utc>>| t.map_or("-".into(), |t| t.to_rfc3339());
            for u in uses {
                say!(
                    "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
                    u.key.as_deref().unwrap_or("-"),
                    u.results,
                    u.references,
                    u.bodies,
                    u.waiting,
                    u.fingerprints,
                    t(u.superseded_at),
                    t(u.retired_at)
                );
            }
        }
        Keys::Rotate { batch, pause_ms } => {
            let Some(keys) = store.config().keys.clone() else {
                bail!("no keys: set {KEYS_ENV} (the newest first) to rotate to");
            };
            // Only to a key the fleet already has: a key first seen here would leave the
            // running workers with values they cannot open.
            let known: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM idem_keys WHERE id = $1)")
                    .bind(keys.current_id())
                    .fetch_one(pool)
                    .await?;
            if !known {
                bail!(
                    "key {} is not registered: no worker or server has run with it yet; roll it out first (docs/OPERATING.md, \"Data protection\")",
                    keys.current_id()
                );
            }
            store.prepare().await?;
            let done = protect::rotate(pool, &keys, *batch, Duration::from_millis(*pause_ms))
                .await
                .context("rotate")?;
            say!(
                "moved to key {}: {} result(s), {} reference(s), {} follow-up bod(ies), {} waiting deliver(ies); {} row(s) changed under the rotation{}",
                keys.current_id(),
                done.results,
                done.references,
                done.bodies,
                done.waiting,
                done.raced,
                if done.raced > 0 {
                    " (run it again)"
                } else {
                    ""
                }
            );
        }
        Keys::Retire { id } => {
            protect::retire(pool, id).await?;
            say!("key {id} retired: processes may start without it");
        }
    }
    Ok(())
}
