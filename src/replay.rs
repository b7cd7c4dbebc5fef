//! Dead-letter replay: read, group, replay and discard the messages of a DLQ safely.
//!
//! Every message is taken with `basic.get` and stays unacked until it is dealt with, so
//! a second replay running at the same time never sees it, and a replay killed midway
//! loses nothing: the broker requeues whatever it held. Messages left alone (filtered
//! out, conflicts, malformed) stay unacked until the end and are then requeued together,
//! so one pass visits each message once; a pass leaves at most [`HOLD_MAX`] of them so. A replay republishes with publisher confirms before it
//! acks in the DLQ; a key that is already `completed` is acked without republishing, and
//! the worker's claim makes any republished duplicate a no-op: replaying twice never
//! runs an effect twice.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, ConfirmSelectOptions};
use lapin::{Channel, Connection};
use serde::Serialize;
use tracing::warn;

use crate::dead_letter::{self, Reason};
use crate::failpoint;
use crate::headers;
use crate::key::Key;
use crate::store::{Status, Store, StoreError};
use crate::topology::{self, PublishError};

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

/// One dead letter with what its headers say.
#[derive(Debug)]
pub struct DlqMessage {
    /// The delivery (body, properties; unacked while held).
    pub delivery: Delivery,
    /// `idem-reason`.
    pub reason: Option<String>,
    /// `idem-error`.
    pub error: Option<String>,
    /// `idem-operation`.
    pub operation: Option<String>,
    /// `idem-scope`.
    pub scope: Option<String>,
    /// `idem-key` (the idempotency key).
    pub key: Option<String>,
    /// `idem-key-hash` (as logs show it).
    pub key_hash: Option<String>,
    /// `idem-attempts`.
    pub attempts: Option<i64>,
    /// `idem-original-queue`.
    pub original_queue: Option<String>,
    /// `idem-failed-at`.
    pub failed_at: Option<DateTime<Utc>>,
}

impl DlqMessage {
    /// Reads a dead letter's `idem-*` headers.
    pub fn new(delivery: Delivery) -> Self {
        let p = &delivery.properties;
        let text = |name| headers::text(p, name);
        Self {
            reason: text(headers::REASON),
            error: text(headers::ERROR),
            operation: text(headers::OPERATION),
            scope: text(headers::SCOPE),
            key: text(headers::KEY),
            key_hash: text(headers::KEY_HASH),
            attempts: headers::integer(p, headers::ATTEMPTS),
            original_queue: text(headers::ORIGINAL_QUEUE),
            failed_at: text(headers::FAILED_AT)
                .and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
                .map(|t| t.with_timezone(&Utc)),
            delivery,
        }
    }

    /// The operation's key, when the message had a valid one.
    pub fn key(&self) -> Option<Key> {
        Key::new(
            self.scope.clone()?,
            self.operation.clone()?,
            self.key.clone()?,
        )
        .ok()
    }

    /// The body as text (lossy for bodies that are not UTF-8).
    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.delivery.data).into_owned()
    }
}

/// Which dead letters a command works on.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this `idem-reason`.
    pub reason: Option<String>,
    /// Only this key: the idempotency key, or (a prefix of at least 6 digits of) the
    /// key hash that logs show.
    pub key: Option<String>,
    /// At most this many matching messages.
    pub limit: Option<usize>,
    /// Only this `idem-operation` (a group of [`group`] is reason, operation, error;
    /// a missing header reads as in the group: `unknown`).
    pub operation: Option<String>,
    /// Only this `idem-error`, exactly (a missing header reads as empty).
    pub error: Option<String>,
    /// Only this `idem-scope`.
    pub scope: Option<String>,
}

impl Filter {
    /// Whether `m` passes the filter.
    pub fn matches(&self, m: &DlqMessage) -> bool {
        let (reason, operation, error) = group_key(m);
        let same = |wanted: &Option<String>, got: &str| wanted.as_deref().is_none_or(|w| w == got);
        let key = self.key.as_deref().is_none_or(|k| {
            m.key.as_deref() == Some(k)
                || (k.len() >= 6 && m.key_hash.as_deref().is_some_and(|h| h.starts_with(k)))
        });
        let scope = self
            .scope
            .as_deref()
            .is_none_or(|s| m.scope.as_deref() == Some(s));
        same(&self.reason, reason)
            && key
            && same(&self.operation, operation)
            && same(&self.error, error)
            && scope
    }
}

/// The DLQ of a work queue; a name already ending in `.dlq` is taken as is.
pub fn dlq_of(queue: &str) -> String {
    if queue.ends_with(".dlq") {
        queue.to_owned()
    } else {
        topology::dlq_name(queue)
    }
}

/// Most dead letters one pass over a DLQ leaves unacked without acting on them (not
/// selected, left alone, or a dry run's), unless [`Options::hold`] says otherwise. They
/// wait on the broker, unacked, until the pass ends, and a DLQ can hold millions: a
/// pass that reaches the bound stops there ([`Summary::incomplete`]).
pub const HOLD_MAX: usize = 10_000;

/// Most bytes of bodies [`peek`] returns: a DLQ's letters can be as large as any
/// message (128 MiB on RabbitMQ's default).
pub const PEEK_BYTES_MAX: usize = 64 << 20;

/// Reads up to `limit` dead letters that pass `filter` without removing any: they are
/// held unacked while read and requeued when the channel closes. At most [`HOLD_MAX`]
/// letters that do not pass are read past, and at most [`PEEK_BYTES_MAX`] bytes of
/// bodies are returned.
pub async fn peek(
    connection: &Connection,
    dlq: &str,
    filter: &Filter,
    limit: usize,
) -> Result<Vec<DlqMessage>, ReplayError> {
    let channel = connection.create_channel().await?;
    let mut out = Vec::new();
    let (mut passed_over, mut bytes) = (0, 0);
    let limit = filter.limit.unwrap_or(limit).min(limit);
    while out.len() < limit && passed_over < HOLD_MAX && bytes < PEEK_BYTES_MAX {
        let Some(message) = get(&channel, dlq).await? else {
            break;
        };
        let m = DlqMessage::new(message);
        if filter.matches(&m) {
            bytes += m.delivery.data.len();
            out.push(m);
        } else {
            // Unacked on this channel until it closes; nothing to keep here.
            passed_over += 1;
        }
    }
    // Closing the channel requeues everything read.
    let _ = channel.close(200, "peek done".into()).await;
    Ok(out)
}

async fn get(channel: &Channel, queue: &str) -> Result<Option<Delivery>, lapin::Error> {
    Ok(channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await?
        .map(|m| m.delivery))
}

/// Dead letters with the same reason, operation and error.
#[derive(Debug, Clone, Serialize)]
pub struct Group {
    /// `idem-reason`.
    pub reason: String,
    /// `idem-operation`.
    pub operation: String,
    /// `idem-error`.
    pub error: String,
    /// How many.
    pub count: usize,
    /// The oldest `idem-failed-at`.
    pub oldest: Option<DateTime<Utc>>,
    /// The newest `idem-failed-at`.
    pub newest: Option<DateTime<Utc>>,
}

/// Groups dead letters by reason, then operation and error text; largest groups first
/// within a reason.
pub fn group(messages: &[DlqMessage]) -> Vec<Group> {
    let mut groups: BTreeMap<(&str, &str, &str), Group> = BTreeMap::new();
    for m in messages {
        let (reason, operation, error) = group_key(m);
        let g = groups
            .entry((reason, operation, error))
            .or_insert_with(|| Group {
                reason: reason.to_owned(),
                operation: operation.to_owned(),
                error: error.to_owned(),
                count: 0,
                oldest: None,
                newest: None,
            });
        g.count += 1;
        if let Some(at) = m.failed_at {
            g.oldest = Some(g.oldest.map_or(at, |o| o.min(at)));
            g.newest = Some(g.newest.map_or(at, |n| n.max(at)));
        }
    }
    let mut out: Vec<Group> = groups.into_values().collect();
    out.sort_by(|a, b| a.reason.cmp(&b.reason).then(b.count.cmp(&a.count)));
    out
}

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
    let mut summary = Summary {
        dry_run: options.dry_run,
        ..Summary::default()
    };
    let mut selected = 0;
    // Letters read and left unacked (requeued when the channel closes), not acted on.
    let mut held = 0;
    let hold = options.hold.unwrap_or(HOLD_MAX);
    // A dry run's keys, looked up together once the DLQ is read (one statement, not one
    // per message).
    let mut dry_keys = Vec::new();
    let default_queue = dlq.strip_suffix(".dlq").unwrap_or(dlq);
    while options.filter.limit.is_none_or(|limit| selected < limit) {
        if held >= hold {
            summary.incomplete = true;
            break;
        }
        let Some(delivery) = get(&channel, dlq).await? else {
            break;
        };
        let m = DlqMessage::new(delivery);
        if !options.filter.matches(&m) {
            summary.skipped += 1;
            held += 1;
            continue;
        }
        selected += 1;
        let key = m.key();
        if action == Action::Replay
            && let Some(left) = left_alone(&m)
        {
            if left == Preview::Conflict {
                summary.conflicts_left += 1;
            } else {
                summary.malformed_left += 1;
            }
            held += 1;
            continue;
        }
        if options.dry_run {
            // Only a replay depends on the record; a discard acks whatever it finds.
            match (action, key) {
                (Action::Replay, Some(key)) => dry_keys.push(key),
                _ => summary.count_dry_run(action, false),
            }
            held += 1;
            continue;
        }
        match (action, key) {
            (Action::Discard, key) => {
                // Ack first: a record unpinned while its dead letter still waited could
                // expire, and a later replay of that dead letter would run it again.
                // A crash between the two leaves the record pinned, which is safe.
                m.delivery.ack(BasicAckOptions::default()).await?;
                failpoint::hit("discard-acked");
                // Only a letter that pinned its record settles it: a conflict's key is
                // another payload's record, and a malformed or undecidable letter's
                // record (if any) is not what failed.
                if let Some(key) = key.as_ref().filter(|_| pins(&m)) {
                    store.discard(key).await?;
                }
                summary.discarded += 1;
            }
            (Action::Replay, Some(key)) => {
                // Where the operator asked, never where a header says: `idem-original-
                // queue` is only idem's note of it.
                let queue = default_queue;
                if m.original_queue.as_deref().is_some_and(|q| q != queue) {
                    warn!(
                        queue,
                        original_queue = m.original_queue.as_deref().unwrap_or_default(),
                        "a dead letter names another original queue; replayed to this DLQ's queue"
                    );
                }
                match replay_one(store, &channel, &m, &key, queue).await? {
                    Replayed::AlreadyDone => summary.already_done += 1,
                    Replayed::Republished => summary.replayed += 1,
                }
            }
            // Counted as malformed above.
            (Action::Replay, None) => {
                held += 1;
                continue;
            }
        }
        if let Some(pace) = options.pace {
            tokio::time::sleep(pace).await;
        }
    }
    for done in store.completed(&dry_keys).await? {
        summary.count_dry_run(action, done);
    }
    // Requeue what was left alone, all at once, in its original order.
    let _ = channel.close(200, "replay done".into()).await;
    Ok(summary)
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
    let properties = dead_letter::replay_properties(&m.delivery.properties);
    topology::publish_confirmed(channel, queue, &m.delivery.data, properties).await?;
    m.delivery.ack(BasicAckOptions::default()).await?;
    Ok(Replayed::Republished)
}

/// The group a dead letter belongs to: reason, operation and error, a missing header
/// read as `unknown` (reason, operation) or empty (error). [`group`] groups by it and
/// [`Filter`] selects by it.
pub fn group_key(m: &DlqMessage) -> (&str, &str, &str) {
    (
        m.reason.as_deref().unwrap_or("unknown"),
        m.operation.as_deref().unwrap_or("unknown"),
        m.error.as_deref().unwrap_or_default(),
    )
}

/// Whether `m` is a letter that pinned its record when it was published: a permanent
/// failure or exhausted retries of the operation its key names. Conflicts, malformed
/// and undecidable letters pin nothing.
fn pins(m: &DlqMessage) -> bool {
    [Reason::PermanentFailure, Reason::RetriesExhausted]
        .iter()
        .any(|reason| m.reason.as_deref() == Some(reason.as_str()))
}

/// What a replay would do with a dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preview {
    /// Its key is completed: acked in the DLQ, not republished.
    AlreadyDone,
    /// Republished: the operation runs again.
    Runs,
    /// A fingerprint conflict: left in the DLQ.
    Conflict,
    /// Malformed (no valid key, or data the database refuses): left in the DLQ.
    Malformed,
}

/// What a replay would do with `m` (one read of its record when it has a key).
pub async fn preview(store: &Store, m: &DlqMessage) -> Result<Preview, StoreError> {
    let previews = preview_all(store, std::slice::from_ref(m)).await?;
    Ok(previews.first().copied().unwrap_or(Preview::Malformed))
}

/// What a replay would do with each of `messages`, in order, with one read of the
/// records of all their keys (one statement): the same rule as [`preview`].
pub async fn preview_all(
    store: &Store,
    messages: &[DlqMessage],
) -> Result<Vec<Preview>, StoreError> {
    let mut previews: Vec<Option<Preview>> = messages.iter().map(left_alone).collect();
    // The keys of the messages a replay would republish, and where they stand.
    let (at, keys): (Vec<usize>, Vec<Key>) = messages
        .iter()
        .enumerate()
        .filter(|(i, _)| previews[*i].is_none())
        .filter_map(|(i, m)| Some((i, m.key()?)))
        .unzip();
    for (i, done) in at.into_iter().zip(store.completed(&keys).await?) {
        previews[i] = Some(if done {
            Preview::AlreadyDone
        } else {
            Preview::Runs
        });
    }
    // A message left with neither has no key, which left_alone calls malformed.
    Ok(previews
        .into_iter()
        .map(|p| p.unwrap_or(Preview::Malformed))
        .collect())
}

/// What a replay leaves in the DLQ, known from the headers alone: a conflict, or a
/// message malformed by its own data (no valid key, or one the database refused, even
/// with a valid key): the same bytes would fail the same way.
fn left_alone(m: &DlqMessage) -> Option<Preview> {
    if m.reason.as_deref() == Some(Reason::FingerprintConflict.as_str()) {
        return Some(Preview::Conflict);
    }
    let malformed = m.key().is_none() || m.reason.as_deref() == Some(Reason::Malformed.as_str());
    malformed.then_some(Preview::Malformed)
}

async fn is_completed(store: &Store, key: &Key) -> Result<bool, StoreError> {
    Ok(store
        .get(key)
        .await?
        .is_some_and(|r| r.status == Status::Completed))
}
