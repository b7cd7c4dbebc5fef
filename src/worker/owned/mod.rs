//! Owned order (docs/DESIGN.md, "Order per entity", "Owned order"): on a queue with a
//! single active consumer, one process at a time consumes, so it keeps its entities'
//! positions in memory instead of entering each delivery through the gate. A delivery
//! at its entity's position runs like an unordered one; one that came early is parked
//! in `ordering_waiting` (batched) and acked; a completion moves the position, fenced
//! (`WHERE next_seq = n`), and releases the row parked at the next number, which runs
//! next in the same task (in transactional mode, the turns parked right after it run
//! in its batch's transaction first: `transactional/chain.rs`). Nothing is written at
//! the start of a turn.
//!
//! The memory is a cache of the positions, kept per broker session (a process that
//! lost its consumer and got it back starts empty). Every decision it cannot make alone
//! goes to the database: a number behind the position asks the delivery's record; a
//! park that finds a row there reads the position again (the sweep republished it: its
//! turn may have come while this process did not know); a fenced move that fails reads
//! it again; and a turn taken from a position not confirmed for [`FRESH`] reads it first
//! (an operator's skip, or another queue's owner of the same entity, moves positions
//! this process does not see).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::time::Instant;
use tracing::{debug, warn};

use super::batch::Batcher;
use super::decision::Outcome;
use super::ordered::Entity;
use super::{Failure, WorkerConfig};
use crate::key::Key;
use crate::ordering::held;
use crate::ordering::owner::{self, Done, Moved, Parked, Place};
use crate::ordering::{Entry, Released};
use crate::store::{Store, StoreError};

/// How long a position read or moved by this process is taken as true for a turn: older,
/// it is read again before a delivery takes the turn (one round trip after a pause of
/// the entity; an entity moving faster never pays it).
pub(super) const FRESH: Duration = Duration::from_secs(1);

/// How long an owned turn runs before it is written down as its entity's holder: from
/// then on operators see it running (`idem ops ordering`), and a skip of it is refused
/// as under the gate. Shorter turns, nearly all, write nothing at their start.
pub(super) const MARK_AFTER: Duration = Duration::from_secs(1);

/// Most entities kept in memory: past it, those idle are forgotten (read again when
/// their next delivery comes).
const MAX_ENTITIES: usize = 100_000;

/// The batching loops of owned order's statements, one per worker. Like the gate's
/// releases, they batch without a linger: an entity's next turn waits on them.
pub(super) struct Owner {
    store: Store,
    loads: Batcher<(String, String, i64), i64>,
    parks: Batcher<Entry, Parked>,
    moves: Batcher<Done, Moved>,
    fetches: Batcher<Place, Option<Released>>,
}

impl Owner {
    pub(super) fn new(store: &Store, config: &WorkerConfig) -> Self {
        let (size, in_flight) = (config.batch_size, config.batches_in_flight);
        let zero = Duration::ZERO;
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
        let moves = Batcher::spawn(size, zero, in_flight, move |items: Arc<[Done]>| {
            let s = s.clone();
            async move { owner::move_on(s.pool(), s.keys(), &items, 0).await }
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
            moves,
            fetches,
        }
    }

    /// Where the numbered delivery `entry` of `entity` stands (it is parked if it came
    /// early). `from_row`: its turn was released to this process from its waiting row
    /// (the position is known to be at it).
    pub(super) async fn enter(
        &self,
        positions: &Arc<Positions>,
        entity: &Entity,
        entry: Entry,
        from_row: bool,
    ) -> Result<Stand, Failure> {
        let seq = entry.ordered.sequence.unwrap_or(entry.ordered.first);
        let who = Who::of(&entry.key);
        let mut parked = false;
        loop {
            let look = positions.look(entity, seq, &who, from_row);
            match look {
                Look::Run => return Ok(Stand::Run(Turn::new(positions, entity, seq, who))),
                Look::Behind | Look::Taken => {
                    let decided = self.decided(&entry.key).await?;
                    return Ok(match (decided, look) {
                        (true, _) => Stand::Decided,
                        (false, Look::Behind) => Stand::Passed,
                        (false, _) => Stand::Taken,
                    });
                }
                Look::Wait(ended) => {
                    // A copy of the running delivery, or the turn after one whose
                    // move is on its way: decided once that one ended.
                    let _ = ended.await;
                }
                Look::Load => self.read(positions, entity, entry.ordered.first).await?,
                Look::Park if parked || from_row => return Ok(Stand::Waiting),
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
                            return Ok(match self.decided(&entry.key).await? {
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
    /// that finds the position locked (a move in flight) looks again after another
    /// [`MARK_AFTER`], while the run lasts.
    pub(super) async fn marked_if_long<F: Future>(&self, turn: &Turn, run: F) -> F::Output {
        let mut run = std::pin::pin!(run);
        loop {
            tokio::select! {
                biased;
                out = &mut run => return out,
                () = tokio::time::sleep(MARK_AFTER) => {}
            }
            let done = turn.done();
            let mut mark = std::pin::pin!(held::running(self.store.pool(), &done));
            let looked = tokio::select! {
                biased;
                looked = &mut mark => looked,
                out = &mut run => {
                    // The mark is let finish: a statement dropped half-sent would cost
                    // its connection.
                    not_marked(mark.await);
                    return out;
                }
            };
            match looked {
                Ok(false) => continue,
                looked => {
                    not_marked(looked);
                    break;
                }
            }
        }
        run.await
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

    /// Whether the record of `key` decides its delivery without a turn
    /// ([`held::decided`]).
    async fn decided(&self, key: &Key) -> Result<bool, Failure> {
        let pool = self.store.pool();
        let (scope, operation, idempotency_key) =
            (key.scope(), key.operation(), key.idempotency_key());
        Ok(held::decided(pool, scope, operation, idempotency_key).await?)
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
struct Who(String, String);

impl Who {
    fn of(key: &Key) -> Self {
        Self(key.operation().to_owned(), key.idempotency_key().to_owned())
    }
}

/// One entity as this process knows it.
struct Position {
    /// Whose turn it is.
    next: i64,
    /// When the database last said so (read, or a move of this process); `None`:
    /// read it again before a turn.
    checked: Option<Instant>,
    /// The delivery running a turn, if one does, and its number: `next`, or the one
    /// before while its completion's move is on its way (a read of the position may
    /// have seen the move already).
    running: Option<(i64, Who)>,
    /// Deliveries waiting for the running one to end: its copies, and the next turn's.
    waiters: Vec<oneshot::Sender<()>>,
    /// Numbers this process parked (the move that passes the one before reads them
    /// back; one parked while that move ran is fetched after it).
    parked: BTreeSet<i64>,
}

/// The positions a consumer session knows, shared by the queue's handlers, and the
/// queue's runs: deliveries are taken up to the prefetch (early ones are parked at
/// once), runs are held to the concurrency.
pub(crate) struct Positions {
    entities: Mutex<HashMap<Entity, Position>>,
    runs: Arc<Semaphore>,
    concurrency: usize,
}

/// What one look at the memory says.
enum Look {
    Run,
    Behind,
    Taken,
    Park,
    Load,
    Wait(oneshot::Receiver<()>),
}

impl Positions {
    pub(super) fn new(concurrency: usize) -> Self {
        let concurrency = concurrency.max(1);
        Self {
            entities: Mutex::default(),
            runs: Arc::new(Semaphore::new(concurrency)),
            concurrency,
        }
    }

    /// Whether at most half the queue's runs are taken.
    pub(super) fn quiet(&self) -> bool {
        self.runs.available_permits() * 2 >= self.concurrency
    }

    /// A place among the queue's runs (claim, handler, outcome), waited for.
    pub(super) async fn run(&self) -> Option<OwnedSemaphorePermit> {
        self.runs.clone().acquire_owned().await.ok()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Entity, Position>> {
        // A panic while the map was held leaves it as it was between two statements:
        // every change under the lock is whole.
        self.entities
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn look(&self, entity: &Entity, seq: i64, who: &Who, from_row: bool) -> Look {
        let mut entities = self.lock();
        let Some(p) = entities.get_mut(entity) else {
            return Look::Load;
        };
        if seq < p.next {
            return Look::Behind;
        }
        if seq > p.next {
            // Parked against a position not confirmed since a move was fenced out, it
            // could wait behind a position that passed it.
            if p.checked.is_none() && !from_row {
                return Look::Load;
            }
            return Look::Park;
        }
        match &p.running {
            // Another message with the number of the one running: two claim one place.
            Some((at, running)) if *at == seq && running != who => Look::Taken,
            Some(_) => {
                let (tx, rx) = oneshot::channel();
                p.waiters.push(tx);
                Look::Wait(rx)
            }
            None if !from_row && p.checked.is_none_or(|at| at.elapsed() > FRESH) => Look::Load,
            None => {
                p.running = Some((seq, who.clone()));
                Look::Run
            }
        }
    }

    /// The database says `entity` is at `next` (read now).
    fn loaded(&self, entity: &Entity, next: i64) {
        let mut entities = self.lock();
        if !entities.contains_key(entity) && entities.len() >= MAX_ENTITIES {
            // What this process parked is read back by the sweep if forgotten.
            entities.retain(|_, p| p.running.is_some() || !p.waiters.is_empty());
        }
        let p = entities.entry(entity.clone()).or_insert_with(|| Position {
            next,
            checked: None,
            running: None,
            waiters: Vec::new(),
            parked: BTreeSet::new(),
        });
        // A read that began before a move of this process committed says less.
        p.next = p.next.max(next);
        p.checked = Some(Instant::now());
    }

    /// `seq` of `entity` is parked now: its turn, if it came meanwhile and nobody runs
    /// it (the move that passed the number before it ran before the park committed).
    fn parked(self: &Arc<Self>, entity: &Entity, seq: i64, who: &Who) -> Option<Turn> {
        let mut entities = self.lock();
        let p = entities.get_mut(entity)?;
        if seq == p.next && p.running.is_none() {
            p.running = Some((seq, who.clone()));
            return Some(Turn::new(self, entity, seq, who.clone()));
        }
        // At the position, it waits for the turn running before it (its move read the
        // waiting rows before this one's park committed): fetched when that one ends.
        if seq >= p.next {
            p.parked.insert(seq);
        }
        None
    }

    /// The turn of `who` at `seq` ended: `moved` whether its completion moved the
    /// position past it, to `to` (`None`: it did not complete). Whether a row this
    /// process parked waits at `to`.
    fn end(&self, entity: &Entity, seq: i64, who: &Who, moved: Option<bool>, to: i64) -> bool {
        let mut entities = self.lock();
        let Some(p) = entities.get_mut(entity) else {
            return false;
        };
        if p.running
            .as_ref()
            .is_some_and(|(at, running)| *at == seq && running == who)
        {
            p.running = None;
        }
        for waiter in p.waiters.drain(..) {
            let _ = waiter.send(());
        }
        match moved {
            Some(true) => {
                p.next = p.next.max(to);
                p.checked = Some(Instant::now());
                let next = p.next;
                p.parked = p.parked.split_off(&next);
                p.parked.remove(&next)
            }
            // Fenced out: an operator's skip or another process moved it.
            Some(false) => {
                p.checked = None;
                false
            }
            None => false,
        }
    }
}

/// A turn this process holds in memory. Dropped without [`Turn::complete`] or
/// [`Turn::leave`] (an error on the way), it ends without moving: the delivery comes
/// back and decides again.
pub(crate) struct Turn {
    positions: Arc<Positions>,
    entity: Entity,
    seq: i64,
    who: Who,
    ended: bool,
}

impl Turn {
    /// The turn of `who` at `seq`, which `positions` marked as running.
    fn new(positions: &Arc<Positions>, entity: &Entity, seq: i64, who: Who) -> Self {
        Self {
            positions: positions.clone(),
            entity: entity.clone(),
            seq,
            who,
            ended: false,
        }
    }

    /// The turn's place and who runs it.
    pub(super) fn done(&self) -> Done {
        Done {
            place: (self.entity.0.clone(), self.entity.1.clone(), self.seq),
            operation: self.who.0.clone(),
            idempotency_key: self.who.1.clone(),
        }
    }

    /// Its record completed: moves the position past it (before the delivery is acked:
    /// a crash between an ack and the move would leave nobody to move it) and returns
    /// the delivery parked at the next number, released to run next.
    pub(super) async fn complete(self, owner: &Owner) -> Result<Vec<Released>, Failure> {
        let moved = owner.moves.call(self.done()).await??;
        let next = moved.moved.then_some(moved.next);
        self.moved(owner, next, None).await
    }

    /// Its completion moved the position past it (`next`: what that move released), or
    /// was fenced out (`None`: an operator's skip, or another process, moved it): the
    /// memory follows. `to`: where the position moved, when the same commit ran the
    /// turns after it (a chain); else the number after it. The delivery parked at that
    /// number, released to run next (one this process parked while the move ran is
    /// fetched now).
    pub(super) async fn moved(
        mut self,
        owner: &Owner,
        next: Option<Vec<Released>>,
        to: Option<i64>,
    ) -> Result<Vec<Released>, Failure> {
        self.ended = true;
        let moved = next.is_some();
        let to = to.unwrap_or(self.seq + 1);
        let parked_next = self
            .positions
            .end(&self.entity, self.seq, &self.who, Some(moved), to);
        if !moved {
            debug!(entity = ?self.entity, seq = self.seq, "owned order: the position moved without this process; read again");
        }
        let next = next.unwrap_or_default();
        if !next.is_empty() || !parked_next {
            return Ok(next);
        }
        let place = (self.entity.0.clone(), self.entity.1.clone(), to);
        Ok(owner.fetches.call(place).await??.into_iter().collect())
    }

    /// It ended without completing (`outcome`): a delivery that ran and is retrying,
    /// pending or failed for good is recorded as the entity's holder, for operators and
    /// a skip.
    pub(super) async fn leave(mut self, owner: &Owner, outcome: Outcome) {
        let holds = matches!(
            outcome,
            Outcome::FailedTransient
                | Outcome::FailedPermanent
                | Outcome::RetriesExhausted
                | Outcome::Pending
                | Outcome::DuplicateFailed
        );
        if holds && let Err(error) = held::hold(owner.store.pool(), &self.done()).await {
            warn!(error = %crate::text::error_line(&error), "owned order: the blocked turn's holder not recorded");
        }
        self.ended = true;
        let next = self.seq + 1;
        self.positions
            .end(&self.entity, self.seq, &self.who, None, next);
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if !self.ended {
            let next = self.seq + 1;
            self.positions
                .end(&self.entity, self.seq, &self.who, None, next);
        }
    }
}

/// Warns of a long turn's mark that failed (the turn runs on; only the listing misses it).
fn not_marked(mark: Result<bool, StoreError>) {
    if let Err(error) = mark {
        warn!(error = %crate::text::error_line(&error), "owned order: a long turn's holder not recorded");
    }
}
