//! Owned order (docs/DESIGN.md, "Order per entity", "Owned order"): on a queue with a
//! single active consumer, one process at a time consumes, so it keeps its entities'
//! positions in memory instead of entering each delivery through the gate. A delivery
//! at its entity's position runs like an unordered one; one that came early is parked
//! in `ordering_waiting` (batched) and acked; a completion moves the position, fenced
//! (`WHERE next_seq = n`), and releases the row parked at the next number, which runs
//! next in the same task (in transactional mode, the turns parked right after it run
//! in its batch's transaction first: `transactional/chain.rs`; in leased mode, the
//! task hands each turn on to the row after it without a move, and the last one moves
//! the position past them all: `run.rs`). Nothing is written at the start of a turn.
//!
//! The memory is a cache of the positions, kept per broker session (a process that
//! lost its consumer and got it back starts empty). Every decision it cannot make alone
//! goes to the database: a number behind the position asks the delivery's record; a
//! park that finds a row there reads the position again (the sweep republished it: its
//! turn may have come while this process did not know); a fenced move that fails reads
//! it again; a turn released to this process from its row that finds the memory behind
//! it reads it once (a previous owner's last move committed after this process read
//! it); and a turn taken from a position not confirmed for [`FRESH`] reads it first
//! (an operator's skip, or another queue's owner of the same entity, moves positions
//! this process does not see). An entity quiet for longer than [`FORGET_AFTER`], or
//! whose move was fenced out, is forgotten, and read again at its next delivery (gc
//! may have taken its position).

mod positions;
mod run;

use std::sync::Arc;
use std::time::Duration;

use sqlx::Postgres;
use sqlx::pool::PoolConnection;
use tracing::{debug, warn};

use super::batch::Batcher;
use super::ordered::Entity;
use super::{Failure, WorkerConfig};
use crate::key::Key;
use crate::ordering::held::{self, Marked};
use crate::ordering::owner::{self, Done, Moved, Parked, Place, Then};
use crate::ordering::{Entry, Released};
use crate::store::{Store, StoreError};

use positions::Look;
pub(crate) use positions::{Positions, Reserved, Turn};
pub(crate) use run::{AHEAD, Ahead, Link, Run, run_for};

/// How long a position read or moved by this process is taken as true for a turn: older,
/// it is read again before a delivery takes the turn (one round trip after a pause of
/// the entity; an entity moving faster never pays it).
pub(super) const FRESH: Duration = Duration::from_secs(1);

/// How long an entity this process keeps in memory may stay quiet (nothing read or moved)
/// before its next delivery reads its position again: a number behind the memory would
/// be dead-lettered `sequence_passed`, and an early one parked, against a position gc
/// may have taken meanwhile (one idle for `StoreConfig::retention`), where the entity
/// starts again at its first number. Far beyond a shuffled entity's pauses, far within
/// the retention (7 days by default).
pub(super) const FORGET_AFTER: Duration = Duration::from_secs(60);

/// How long an owned turn runs before it is written down as its entity's holder: from
/// then on operators see it running (`idem ops ordering`), and a skip of it is refused
/// as under the gate. Shorter turns, nearly all, write nothing at their start.
pub(crate) const MARK_AFTER: Duration = Duration::from_secs(1);

/// Most entities kept in memory: past it, those idle are forgotten (read again when
/// their next delivery comes).
const MAX_ENTITIES: usize = 100_000;

/// The batching loops of owned order's statements, one per worker. Like the gate's
/// releases, they batch without a linger: an entity's next turn waits on them.
pub(super) struct Owner {
    store: Store,
    loads: Batcher<(String, String, i64), i64>,
    parks: Batcher<Entry, Parked>,
    /// Moves that release the row at the next number.
    moves: Batcher<Done, Moved>,
    /// In leased mode, moves that also read the rows after it, for a run
    /// ([`Turn::complete`] says when).
    reads: Option<Batcher<Done, Moved>>,
    fetches: Batcher<Place, Option<Released>>,
}

impl Owner {
    /// `leased`: the queue runs in leased mode, where a move may read the rows after the
    /// one it releases, for a run ([`Run`]).
    pub(super) fn new(store: &Store, config: &WorkerConfig, leased: bool) -> Self {
        let (size, in_flight) = (config.batch_size, config.batches_in_flight);
        let zero = Duration::ZERO;
        let moves = |ahead| {
            let s = store.clone();
            let then = Then::Release { ahead };
            Batcher::spawn(size, zero, in_flight, move |items: Arc<[Done]>| {
                let s = s.clone();
                async move { owner::move_on(s.pool(), s.keys(), &items, then).await }
            })
        };
        let s = store.clone();
        let loads = Batcher::spawn(size, zero, in_flight, move |items: Arc<[_]>| {
            let s = s.clone();
            async move { owner::load(s.pool(), &items).await }
        });
        let s = store.clone();
        let parks = Batcher::spawn(size, zero, in_flight, move |items: Arc<[Entry]>| {
            let s = s.clone();
            async move { owner::park(s.pool(), s.keys(), s.config().retention, &items).await }
        });
        let s = store.clone();
        let fetches = Batcher::spawn(size, zero, in_flight, move |items: Arc<[Place]>| {
            let s = s.clone();
            async move { held::fetch(s.pool(), s.keys(), &items).await }
        });
        Self {
            store: store.clone(),
            loads,
            parks,
            moves: moves(0),
            reads: leased.then(|| moves(AHEAD)),
            fetches,
        }
    }

    /// Where the numbered delivery `entry` of `entity` stands (it is parked if it came
    /// early). `from_row`: its turn was released to this process from its waiting row
    /// (the position is known to be at it); `lent`: what the turn before it lent it, in
    /// a leased run (its number kept in memory for it, its place among the queue's runs).
    pub(super) async fn enter(
        &self,
        positions: &Arc<Positions>,
        entity: &Entity,
        entry: Entry,
        from_row: bool,
        lent: &Link,
    ) -> Result<Stand, Failure> {
        let reserved = lent.reserved();
        let seq = entry.ordered.sequence.unwrap_or(entry.ordered.first);
        let who = Who::of(&entry.key);
        // Once set: its row is kept and the position was read since, so still early,
        // it waits.
        let mut parked = false;
        loop {
            let look = positions.look(entity, seq, &who, from_row, reserved);
            match look {
                Look::Run => return Ok(Stand::Run(Turn::new(positions, entity, seq, who))),
                Look::Behind | Look::Taken => {
                    let decided = self.decided(&entry).await?;
                    return Ok(match (decided, look) {
                        (true, _) => Stand::Decided,
                        (false, Look::Behind) => Stand::Passed,
                        (false, _) => Stand::Taken,
                    });
                }
                Look::Wait(ended) => {
                    // A copy of the running delivery, or the turn after one whose
                    // move is on its way: decided once that one ended. A place among
                    // the queue's runs lent by the turn before goes back first: the
                    // one running may be a copy of this message that waits for a place
                    // (with a concurrency of 1, both waited for ever).
                    drop(lent.permit());
                    let _ = ended.await;
                }
                Look::Load => self.read(positions, entity, entry.ordered.first).await?,
                Look::Park if parked => return Ok(Stand::Waiting),
                // Released from its row, so the database's position was at it: the
                // memory is behind, read before a move this process did not make
                // committed (a previous owner's last one, for a turn taken over). Read
                // once: acked as waiting, it would wait for the sweep.
                Look::Park if from_row => {
                    parked = true;
                    self.read(positions, entity, entry.ordered.first).await?;
                }
                Look::Park => {
                    let found = self.parks.call(entry.clone()).await??;
                    match found {
                        Parked::Kept => {
                            if let Some(turn) = positions.parked(entity, seq, &who) {
                                return Ok(Stand::Run(turn));
                            }
                            return Ok(Stand::Waiting);
                        }
                        Parked::Again => {}
                        // The database's position is at its number or past it: decided
                        // again from it.
                        Parked::Passed => {
                            self.read(positions, entity, entry.ordered.first).await?;
                        }
                        Parked::Found(at, operation, key, fingerprint)
                            if operation == who.0 && key == who.1 =>
                        {
                            if !(fingerprint == entry.fingerprint
                                || entry
                                    .also
                                    .as_deref()
                                    .is_some_and(|also| also.split(',').any(|f| f == fingerprint)))
                            {
                                return Ok(Stand::Conflict);
                            }
                            if at != seq {
                                // Its key waits with another number: as the gate, a copy.
                                return Ok(Stand::Waiting);
                            }
                            // A copy of a parked delivery: the sweep republished it, its
                            // turn may have come. Decided again from the position read
                            // afresh; parked already, it is acked if still early.
                            parked = true;
                            self.read(positions, entity, entry.ordered.first).await?;
                        }
                        Parked::Found(..) => {
                            return Ok(match self.decided(&entry).await? {
                                true => Stand::Decided,
                                false => Stand::Taken,
                            });
                        }
                    }
                }
            }
        }
    }
}

impl Owner {
    /// Runs `run`, the run of `turn`; one that takes longer than [`MARK_AFTER`] is
    /// recorded as its entity's holder meanwhile (fenced: only while the position is at
    /// its number and has no holder). Its completion's move clears the holder. A mark
    /// that finds the position locked (a move in flight), or fails (an outage), looks
    /// again after another [`MARK_AFTER`], while the run lasts; a run that ends while its
    /// mark waits for a connection does not wait for it. A turn of a leased run past its
    /// first is marked after half that, and its mark moves the position to its number
    /// first ([`held::running`]): its move then goes from there.
    pub(super) async fn marked_if_long<F: Future>(&self, turn: &mut Turn, run: F) -> F::Output {
        let mut run = std::pin::pin!(run);
        let mark_after = crate::failpoint::stretched("IDEM_MARK_AFTER_MS", MARK_AFTER);
        let mut warned = false;
        loop {
            let after = match turn.behind() {
                true => mark_after / 2,
                false => mark_after,
            };
            tokio::select! {
                biased;
                out = &mut run => return out,
                () = tokio::time::sleep(after) => {}
            }
            let done = turn.done();
            // Its connection first: a run that ends while the mark waits for one (an
            // outage, a pool all taken) ends at once, nothing sent.
            let connection = tokio::select! {
                biased;
                out = &mut run => return out,
                connection = self.mark_connection() => connection,
            };
            let mut mark = std::pin::pin!(async {
                let mut connection = connection?;
                held::running(&mut *connection, &done).await
            });
            let (marked, out) = tokio::select! {
                biased;
                marked = &mut mark => (marked, None),
                // The mark is let finish: a statement dropped half-sent would cost its
                // connection.
                out = &mut run => (mark.await, Some(out)),
            };
            match marked {
                Ok(Marked::Moved) => turn.stands_at_own(),
                Ok(Marked::Locked) if out.is_none() => continue,
                Ok(_) => {}
                Err(error) => {
                    let error = crate::text::error_line(&error);
                    // Once a turn: an outage fails every mark until it ends.
                    match std::mem::replace(&mut warned, true) {
                        false => {
                            warn!(%error, "owned order: a long turn's holder not recorded yet; tried again while it runs")
                        }
                        true => {
                            debug!(%error, "owned order: a long turn's holder not recorded yet")
                        }
                    }
                    if out.is_none() {
                        continue;
                    }
                }
            }
            if let Some(out) = out {
                return out;
            }
            break;
        }
        run.await
    }

    /// A connection for a long turn's mark ([`Owner::marked_if_long`]).
    async fn mark_connection(&self) -> Result<PoolConnection<Postgres>, StoreError> {
        crate::failpoint::stalls("owned-mark-stall").await;
        if crate::failpoint::fails("owned-mark-error") {
            return Err(StoreError::Database(sqlx::Error::PoolTimedOut));
        }
        Ok(self.store.pool().acquire().await?)
    }

    /// Reads `entity`'s position from the database into `positions` (created at
    /// `first` when it has none).
    async fn read(
        &self,
        positions: &Positions,
        entity: &Entity,
        first: i64,
    ) -> Result<(), Failure> {
        let item = (entity.0.clone(), entity.1.clone(), first);
        let next = self.loads.call(item).await??;
        positions.loaded(entity, next);
        Ok(())
    }

    /// Whether the record of `entry`'s key decides it without a turn
    /// ([`held::decided`]).
    async fn decided(&self, entry: &Entry) -> Result<bool, Failure> {
        Ok(held::decided(self.store.pool(), entry).await?)
    }
}

/// What [`Owner::enter`] decided.
pub(crate) enum Stand {
    /// It holds its entity's turn: run it, then [`Turn::complete`] or [`Turn::leave`].
    Run(Turn),
    /// Its record decides without a turn (a duplicate, or failed for good): the claim
    /// says so.
    Decided,
    /// Parked (or a copy of a parked one): ack it.
    Waiting,
    /// Its number is behind the position: it ran under another key, or was skipped.
    Passed,
    /// Another message holds or waits with its number.
    Taken,
    /// Its key waits with another payload.
    Conflict,
}

/// Who runs a turn: the delivery's operation and idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Who(String, String);

impl Who {
    fn of(key: &Key) -> Self {
        Self(key.operation().to_owned(), key.idempotency_key().to_owned())
    }
}

#[cfg(test)]
#[path = "enter_tests.rs"]
mod tests;
