//! Ordered processing per entity (docs/DESIGN.md, "Order per entity"): deliveries with
//! the same scope and ordering key, whichever handler's, run one at a time, in sequence
//! order, across every worker process; different keys run in parallel.
//!
//! A handler opts in with [`crate::Handler::ordering`], answering an [`Ordered`] for a
//! message. A delivery that comes before its turn is acked and waits in Postgres
//! (`ordering_waiting`), spending no retry tier and no attempt; when its predecessor's
//! record completes, the worker that completed it runs it next, in process (it is
//! published to its queue again when it is another handler's or queue's or the 65th in
//! a row, and by the sweep after a skip or when the worker that was to run it died; on
//! a queue with a single active consumer, the standby that takes over runs those
//! itself). A predecessor that is retrying, pending or dead-lettered blocks only its
//! own entity, until it completes (a replay) or an operator skips it ([`skip`], `idem
//! ops ordering skip`); an entity that has not moved for a while with deliveries
//! waiting is *stalled* ([`list`], the gauge `idem_ordering_stalled`, the alert
//! `IdemOrderingStalled`).
//!
//! - `owner`: the statements of owned order (a queue's single active consumer keeps
//!   the positions in memory).
//! - `table`: the statements (the decisions are SQL functions of the migration, one
//!   round trip for the deliveries that arrived together).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::store::StoreError;

pub(crate) mod held;
pub(crate) mod owner;
pub(crate) mod table;

pub(crate) use table::{Entered, Entry, Gate, Released};

/// Longest accepted ordering key, in bytes.
const MAX_KEY_LEN: usize = 500;
/// Sequence numbers lie within ±2^62: the position counts on past them without
/// overflowing.
const MAX_SEQUENCE: u64 = 1 << 62;

/// Where a message stands in its entity's order: the entity (an order id, an account),
/// and optionally its sequence number (a version, a per-entity counter from the
/// producer). Without a sequence, one entity's deliveries run in order of arrival.
///
/// ```
/// # use idem::Ordered;
/// // order.created is version 1 of order 42, order.cancelled version 2: the cancel
/// // waits until the create completed, whichever arrives first.
/// let created = Ordered::by("order-42").sequence(1);
/// let cancelled = Ordered::by("order-42").sequence(2);
/// # let _ = (created, cancelled);
/// ```
///
/// The position is per scope and ordering key, shared by every handler that names the
/// same key: `order.created` and `order.cancelled` handled by two handlers are still
/// one order's sequence. Give keys a prefix (`order-42`, `account-7`) so two kinds of
/// entity do not share one by accident.
///
/// A message whose key is empty or blank, longer than 500 bytes or holds a control
/// character, or whose number or [`Ordered::starting_at`] is ±2^62 or beyond, is
/// dead-lettered as malformed.
///
/// gc deletes an entity's position once it has been idle (no holder, nothing waiting)
/// for the store's retention (`StoreConfig::retention`, 7 days by default): a later
/// message of that entity starts it again at its first number. An entity with numbers
/// that can be quiet for longer needs a longer retention, or its next message (say
/// version 8) waits for numbers 1 to 7 as a gap, reported stalled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ordered {
    pub(crate) key: String,
    pub(crate) sequence: Option<i64>,
    pub(crate) first: i64,
}

impl Ordered {
    /// The entity `key`'s deliveries, in order of arrival on the queue (until
    /// [`Ordered::sequence`] gives each its number).
    ///
    /// Order an entity one way: by its producer's numbers or by arrival, not both. A
    /// delivery without a number takes the one after the highest seen, which a numbered
    /// message of the same entity may carry too (it is then dead-lettered
    /// `sequence_conflict` or `sequence_passed`).
    pub fn by(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            sequence: None,
            first: 1,
        }
    }

    /// This message's sequence number in its entity: it runs after `sequence - 1`
    /// completed (or was skipped). Numbers start at 1 ([`Ordered::starting_at`]) and
    /// leave no gap: a missing number blocks the entity until it arrives or is skipped.
    pub fn sequence(mut self, sequence: i64) -> Self {
        self.sequence = Some(sequence);
        self
    }

    /// The number an entity's first message carries (1 unless said otherwise); read
    /// when the entity is first seen.
    pub fn starting_at(mut self, first: i64) -> Self {
        self.first = first;
        self
    }

    /// Why the ordering key cannot be stored, if it cannot (empty, too long, or with a
    /// control character): such a message is dead-lettered as malformed.
    pub(crate) fn invalid(&self) -> Option<String> {
        if self.key.trim().is_empty() {
            return Some("the ordering key is empty".into());
        }
        if self.key.len() > MAX_KEY_LEN {
            return Some(format!(
                "the ordering key is {} bytes long, at most {MAX_KEY_LEN} are allowed",
                self.key.len()
            ));
        }
        if self.key.chars().any(char::is_control) {
            return Some("the ordering key contains a control character".into());
        }
        let bounded = |n: i64| n.unsigned_abs() < MAX_SEQUENCE;
        if !bounded(self.first) || self.sequence.is_some_and(|n| !bounded(n)) {
            return Some(format!("sequence numbers must lie within ±{MAX_SEQUENCE}"));
        }
        None
    }
}

/// One entity's position, as operators see it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Position {
    /// The scope (tenant) of the entity.
    pub scope: String,
    /// The ordering key.
    pub ordering_key: String,
    /// The sequence number whose turn it is.
    pub next_seq: i64,
    /// The operation and idempotency key holding the turn, if one does.
    pub holder: Option<(String, String)>,
    /// Since when the holder holds the turn.
    pub held_since: Option<DateTime<Utc>>,
    /// The holder's record status (`processing`, `failed`, `pending`), when it has one.
    pub holder_status: Option<String>,
    /// Whether the holder's record waits in a dead-letter queue.
    pub holder_dead_lettered: bool,
    /// Deliveries waiting for their turn.
    pub waiting: i64,
    /// The lowest waiting sequence number at or past `next_seq` (a row behind it, whose
    /// turn passed, is published to its queue within a second or so, and decided when it
    /// comes back): above it with no holder, a gap.
    pub first_waiting: Option<i64>,
    /// Since when the position has not moved.
    pub moved_at: DateTime<Utc>,
    /// Sequence numbers operators skipped, and the note of the last skip.
    pub skipped: i64,
    /// The note of the last skip.
    pub skip_note: Option<String>,
}

impl Position {
    /// What blocks the entity, in a word: `running`, `retrying`, `pending`,
    /// `dead-lettered`, `gap` (the number whose turn it is never arrived), `released`
    /// (its turn was handed over over a minute ago and has no record yet: on its way
    /// back through the queue, or its run died before its claim) or `idle`.
    pub fn blocked_by(&self) -> &'static str {
        let old = |since: &Option<DateTime<Utc>>| {
            since.is_some_and(|t| Utc::now() - t > chrono::TimeDelta::minutes(1))
        };
        match (&self.holder, self.holder_status.as_deref()) {
            (Some(_), _) if self.holder_dead_lettered => "dead-lettered",
            (Some(_), Some("failed")) => "retrying",
            (Some(_), Some("pending")) => "pending",
            (Some(_), None) if old(&self.held_since) => "released",
            (Some(_), _) => "running",
            (None, _) if self.first_waiting == Some(self.next_seq) => "released",
            (None, _) if self.waiting > 0 => "gap",
            (None, _) => "idle",
        }
    }
}

/// Entities with deliveries waiting, those that have not moved for `stalled_for` (all
/// with waiting deliveries when `None`), most stalled first, at most `limit`.
pub async fn list(
    pool: &PgPool,
    stalled_for: Option<Duration>,
    limit: i64,
) -> Result<Vec<Position>, StoreError> {
    table::list(pool, stalled_for, limit).await
}

/// What [`skip`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Skipped {
    /// The entity moved past `seq`; the delivery waiting for `seq + 1`, if any, is
    /// released by the next sweep (within a second or so).
    Skipped {
        /// The skipped sequence number.
        seq: i64,
    },
    /// Nothing skipped: the entity's turn is `next_seq`, not the one given (it moved
    /// since it was listed), or it moved while the skip waited (or as the skip locked
    /// it: past a holder whose record completed, as the sweep would).
    Moved {
        /// The sequence number whose turn it is.
        next_seq: i64,
    },
    /// Nothing skipped: the turn at `seq` had run already (its record completed) and
    /// the entity had not moved past it yet (a leased run hands its turns on before it
    /// moves the position; a move can be lost with its connection). It moved on past
    /// it now, as the sweep would have, without counting a skip or keeping the note.
    Ran {
        /// The sequence number that had run.
        seq: i64,
    },
    /// No such entity.
    Unknown,
    /// The holder runs now (a live lease, or a turn taken within the last minute that
    /// has no record yet): skipping it would run its successor beside it. Wait for
    /// it, or release its lease first.
    Running,
}

/// Skips the sequence number whose turn it is for one entity (a gap that will never be
/// filled, or a dead letter that will never be replayed), noting why; with `expected`,
/// only if that is still the turn (an operator acting on a listing a minute old must
/// not skip the turn after it). The turn is read, and skipped a second and a half
/// later only if it is still the turn (else [`Skipped::Moved`]): a turn of an owned
/// queue (a single active consumer) is written down as its entity's holder once it has
/// run for a second, so one that was running at the read is normally refused as
/// [`Skipped::Running`], and one that ran already is moved past, not skipped
/// ([`Skipped::Ran`]). A skipped message that arrives later, or waited, is
/// dead-lettered as `sequence_passed`; one of an entity ordered by arrival (no
/// sequence) that arrives later takes a new place at the end instead.
pub async fn skip(
    pool: &PgPool,
    scope: &str,
    ordering_key: &str,
    note: &str,
    expected: Option<i64>,
) -> Result<Skipped, StoreError> {
    table::skip(pool, scope, ordering_key, note, expected).await
}
