//! Dead-letter replay: read, group, replay and discard the messages of a DLQ safely.
//!
//! Every message is taken with `basic.get` and stays unacked until it is dealt with, so
//! a second replay running at the same time never sees it, and a replay killed midway
//! loses nothing: the broker requeues whatever it held. Messages left alone (filtered
//! out, conflicts, malformed) stay unacked until the end and are then requeued together,
//! so one pass visits each message once; a pass leaves at most [`HOLD_MAX`] of them so.
//! A replay republishes with publisher confirms before it acks in the DLQ; a key that is
//! already `completed` is acked without republishing, and the worker's claim makes any
//! republished duplicate a no-op: replaying twice never runs an effect twice.
//!
//! `letters` are the dead letters themselves ([`DlqMessage`], [`Filter`], [`peek`],
//! [`group`]); `preview` says what a replay would do with each ([`Preview`]).

use std::time::Duration;

use lapin::options::{BasicAckOptions, ConfirmSelectOptions};
use lapin::{Channel, Connection};
use serde::Serialize;
use tracing::warn;

use crate::dead_letter::{self, Reason};
use crate::failpoint;
use crate::key::Key;
use crate::store::{Status, Store, StoreError};
use crate::topology::{self, PublishError};

mod letters;
mod preview;

use letters::get;
pub use letters::{DlqMessage, Filter, Group, PEEK_BYTES_MAX, dlq_of, group, group_key, peek};
use preview::left_alone;
pub use preview::{Preview, preview, preview_all};

/// What went wrong while working on a DLQ.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The broker failed or could not be reached.
    #[error("broker")]
    Broker(#[from] lapin::Error),
    /// The store failed or could not be reached.
    #[error("store")]
    Store(#[from] StoreError),
    /// A republish was not confirmed.
    #[error(transparent)]
    Publish(#[from] PublishError),
}

/// Most dead letters one pass over a DLQ leaves unacked without acting on them (not
/// selected, left alone, or a dry run's), unless [`Options::hold`] says otherwise. They
/// wait on the broker, unacked, until the pass ends, and a DLQ can hold millions: a
/// pass that reaches the bound stops there ([`Summary::incomplete`]).
pub const HOLD_MAX: usize = 10_000;

/// What a replay or discard did, per outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// Republished to their original queue (or, in a dry run, would be).
    pub replayed: usize,
    /// Keys already completed: acked in the DLQ, not republished.
    pub already_done: usize,
    /// Discarded (acked, decision recorded).
    pub discarded: usize,
    /// Fingerprint conflicts, left in the DLQ: a changed payload needs a new key.
    pub conflicts_left: usize,
    /// Messages without a valid key, left in the DLQ.
    pub malformed_left: usize,
    /// Messages the filter did not select, left in the DLQ.
    pub skipped: usize,
    /// Whether nothing was changed.
    pub dry_run: bool,
    /// Whether the pass stopped at its bound on letters left unacked without being
    /// acted on ([`HOLD_MAX`], or [`Options::hold`]): letters past them were not looked
    /// at. A filter that selects letters deeper than that needs a larger bound.
    pub incomplete: bool,
}

impl Summary {
    /// Counts what `action` would do with a dead letter whose key is `done` or not.
    fn count_dry_run(&mut self, action: Action, done: bool) {
        match action {
            Action::Replay if done => self.already_done += 1,
            Action::Replay => self.replayed += 1,
            Action::Discard => self.discarded += 1,
        }
    }
}

/// What to do with each selected dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Republish to the original queue (completed keys are acked instead).
    Replay,
    /// Ack and record the decision on the record.
    Discard,
}

/// Options of [`run`].
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Which messages.
    pub filter: Filter,
    /// Count what would happen, change nothing.
    pub dry_run: bool,
    /// Pause between two messages acted on (throttles a large replay).
    pub pace: Option<Duration>,
    /// Most letters left unacked without being acted on, before the pass stops
    /// (default [`HOLD_MAX`]).
    pub hold: Option<usize>,
}

/// Replays or discards the dead letters of `dlq` that pass the filter.
pub async fn run(
    connection: &Connection,
    store: &Store,
    dlq: &str,
    action: Action,
    options: &Options,
) -> Result<Summary, ReplayError> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut pass = Pass {
        store,
        channel: &channel,
        action,
        options,
        // Where the operator asked, never where a header says: `idem-original-queue`
        // is only idem's note of it.
        queue: dlq.strip_suffix(".dlq").unwrap_or(dlq),
        summary: Summary {
            dry_run: options.dry_run,
            ..Summary::default()
        },
        selected: 0,
        held: 0,
        dry_keys: Vec::new(),
    };
    let hold = options.hold.unwrap_or(HOLD_MAX);
    while options
        .filter
        .limit
        .is_none_or(|limit| pass.selected < limit)
    {
        if pass.held >= hold {
            pass.summary.incomplete = true;
            break;
        }
        let Some(delivery) = get(&channel, dlq).await? else {
            break;
        };
        if pass.take(DlqMessage::new(delivery)).await? == Taken::ActedOn
            && let Some(pace) = options.pace
        {
            tokio::time::sleep(pace).await;
        }
    }
    // A dry run's keys, looked up together once the DLQ is read (one statement, not one
    // per message).
    for done in store.completed(&pass.dry_keys).await? {
        pass.summary.count_dry_run(action, done);
    }
    let summary = pass.summary;
    // Requeue what was left alone, all at once, in its original order.
    let _ = channel.close(200, "replay done".into()).await;
    Ok(summary)
}

/// One pass of [`run`] over a DLQ: what it was asked, and what it did so far.
struct Pass<'a> {
    store: &'a Store,
    channel: &'a Channel,
    action: Action,
    options: &'a Options,
    /// The work queue a replay republishes to: the DLQ's.
    queue: &'a str,
    summary: Summary,
    /// Letters the filter selected.
    selected: usize,
    /// Letters read and left unacked (requeued when the channel closes), not acted on.
    held: usize,
    /// A dry run's replay keys, looked up at the end.
    dry_keys: Vec<Key>,
}

/// What a pass did with one letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Taken {
    /// Left unacked: not selected, left alone, or a dry run's.
    Held,
    /// Replayed or discarded.
    ActedOn,
}

impl Pass<'_> {
    /// Does what the pass does with letter `m`.
    async fn take(&mut self, m: DlqMessage) -> Result<Taken, ReplayError> {
        let (summary, action) = (&mut self.summary, self.action);
        if !self.options.filter.matches(&m) {
            summary.skipped += 1;
            return Ok(self.hold());
        }
        self.selected += 1;
        if action == Action::Replay
            && let Some(left) = left_alone(&m).filter(|p| *p != Preview::Runs)
        {
            match left {
                Preview::Conflict => summary.conflicts_left += 1,
                _ => summary.malformed_left += 1,
            }
            return Ok(self.hold());
        }
        let key = m.key();
        if self.options.dry_run {
            // Only a replay depends on the record; a discard acks whatever it finds.
            match (action, key) {
                (Action::Replay, Some(key)) => self.dry_keys.push(key),
                _ => summary.count_dry_run(action, false),
            }
            return Ok(self.hold());
        }
        match (action, key) {
            (Action::Discard, key) => {
                discard_one(self.store, &m, key.as_ref()).await?;
                self.summary.discarded += 1;
            }
            (Action::Replay, Some(key)) => {
                if m.original_queue.as_deref().is_some_and(|q| q != self.queue) {
                    warn!(
                        queue = self.queue,
                        original_queue = m.original_queue.as_deref().unwrap_or_default(),
                        "a dead letter names another original queue; replayed to this DLQ's queue"
                    );
                }
                match replay_one(self.store, self.channel, &m, &key, self.queue).await? {
                    Replayed::AlreadyDone => self.summary.already_done += 1,
                    Replayed::Republished => self.summary.replayed += 1,
                }
            }
            // No handler took it when it came: it has no key and no record, so it
            // is only republished, for the handler deployed since.
            (Action::Replay, None) if preview::unroutable(&m) => {
                republish(self.channel, &m, self.queue).await?;
                self.summary.replayed += 1;
            }
            // Counted as malformed above.
            (Action::Replay, None) => return Ok(self.hold()),
        }
        Ok(Taken::ActedOn)
    }

    fn hold(&mut self) -> Taken {
        self.held += 1;
        Taken::Held
    }
}

/// Discards one dead letter: acks it first, then settles its record. A record
/// unpinned while its dead letter still waited could expire, and a later replay of that
/// dead letter would run it again; a crash between the two leaves the record pinned,
/// which is safe. Only a letter that pinned its record settles it: a conflict's key is
/// another payload's record, and a malformed or undecidable letter's record (if any) is
/// not what failed.
async fn discard_one(store: &Store, m: &DlqMessage, key: Option<&Key>) -> Result<(), ReplayError> {
    m.delivery.ack(BasicAckOptions::default()).await?;
    failpoint::hit("discard-acked");
    if let Some(key) = key.filter(|_| pins(m)) {
        store.discard(key).await?;
    }
    Ok(())
}

/// What a replay did with one dead letter.
enum Replayed {
    /// Its key is completed: acked, nothing to run.
    AlreadyDone,
    /// Republished to `queue` (confirmed), then acked.
    Republished,
}

/// Replays one dead letter: a `failed` record is made retryable, then the message is
/// republished and acked; a completed key is only acked.
async fn replay_one(
    store: &Store,
    channel: &Channel,
    m: &DlqMessage,
    key: &Key,
    queue: &str,
) -> Result<Replayed, ReplayError> {
    let prepared = store.prepare_replay(key, pins(m)).await?;
    if prepared.is_none() && is_completed(store, key).await? {
        // Done already: nothing to run. Unpin only once the ack is sent.
        m.delivery.ack(BasicAckOptions::default()).await?;
        if pins(m) {
            store.unpin(key).await?;
        }
        return Ok(Replayed::AlreadyDone);
    }
    republish(channel, m, queue).await?;
    Ok(Replayed::Republished)
}

/// Republishes `m` to `queue` (confirmed, `idem-replays` one higher), then acks it in
/// the DLQ.
async fn republish(channel: &Channel, m: &DlqMessage, queue: &str) -> Result<(), ReplayError> {
    let properties = dead_letter::replay_properties(&m.delivery.properties);
    topology::publish_confirmed(channel, queue, &m.delivery.data, properties).await?;
    m.delivery.ack(BasicAckOptions::default()).await?;
    Ok(())
}

/// Whether `m` is a letter that pinned its record when it was published: a permanent
/// failure or exhausted retries of the operation its key names. Conflicts, malformed
/// and undecidable letters pin nothing.
fn pins(m: &DlqMessage) -> bool {
    [Reason::PermanentFailure, Reason::RetriesExhausted]
        .iter()
        .any(|reason| m.reason.as_deref() == Some(reason.as_str()))
}

async fn is_completed(store: &Store, key: &Key) -> Result<bool, StoreError> {
    Ok(store
        .get(key)
        .await?
        .is_some_and(|r| r.status == Status::Completed))
}
