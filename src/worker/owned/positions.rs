//! What the process knows of its entities' positions (a cache per broker session), and
//! the turns it hands out from them: `Positions` decides from memory whether a delivery
//! runs, waits for the running one, is parked or must read its position first; a `Turn`
//! ends by moving the position (its completion) or by leaving it (docs/DESIGN.md,
//! "Owned order").

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::time::Instant;
use tracing::{debug, warn};

use super::{FORGET_AFTER, FRESH, MAX_ENTITIES, Owner, Who};
use crate::ordering::Released;
use crate::ordering::held;
use crate::ordering::owner::Done;
use crate::worker::Failure;
use crate::worker::decision::Outcome;
use crate::worker::ordered::Entity;

/// One entity as this process knows it.
struct Position {
    /// Whose turn it is.
    next: i64,
    /// When the database last said so (read, or a move of this process); `None`:
    /// read it again before a turn.
    checked: Option<Instant>,
    /// The delivery running a turn, if one does, and its number: `next`, or the one
    /// before while its completion's move is on its way (a read of the position may
    /// have seen the move already); or the row a leased run's turn handed on to, kept
    /// for it ([`Reserved`]).
    running: Option<(i64, Who)>,
    /// Deliveries waiting for the running one to end: its copies, and the next turn's.
    waiters: Vec<oneshot::Sender<()>>,
    /// Numbers this process parked (the move that passes the one before reads them
    /// back; one parked while that move ran is fetched after it).
    parked: BTreeSet<i64>,
}

impl Position {
    /// Whether nothing of it runs or waits in memory: it may be forgotten (read again at
    /// its next delivery; what this process parked, the sweep reads back).
    fn idle(&self) -> bool {
        self.running.is_none() && self.waiters.is_empty()
    }

    /// The turn of `who` at `seq` ended: the turn is free (or kept for `then`, a leased
    /// run's next row), and the deliveries waiting for it decide again.
    fn ended(&mut self, seq: i64, who: &Who, then: Option<(i64, Who)>) {
        if self
            .running
            .as_ref()
            .is_some_and(|(at, running)| *at == seq && running == who)
        {
            self.running = then;
        }
        for waiter in self.waiters.drain(..) {
            let _ = waiter.send(());
        }
    }
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
pub(super) enum Look {
    Run,
    Behind,
    Taken,
    Park,
    Load,
    Wait(oneshot::Receiver<()>),
}

impl Positions {
    pub(in crate::worker) fn new(concurrency: usize) -> Self {
        let concurrency = concurrency.max(1);
        Self {
            entities: Mutex::default(),
            runs: Arc::new(Semaphore::new(concurrency)),
            concurrency,
        }
    }

    /// Whether at most half the queue's runs are taken.
    pub(in crate::worker) fn quiet(&self) -> bool {
        self.runs.available_permits() * 2 >= self.concurrency
    }

    /// A place among the queue's runs (claim, handler, outcome), waited for.
    pub(in crate::worker) async fn run(&self) -> Option<OwnedSemaphorePermit> {
        self.runs.clone().acquire_owned().await.ok()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Entity, Position>> {
        // A panic while the map was held leaves it as it was between two statements:
        // every change under the lock is whole.
        self.entities
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What the memory says of `who`'s delivery at `seq` of `entity`; `from_row` as
    /// [`super::Owner::enter`] takes it, `reserved`: the turn before it, in a leased run,
    /// kept its number in memory for it.
    pub(super) fn look(
        &self,
        entity: &Entity,
        seq: i64,
        who: &Who,
        from_row: bool,
        reserved: bool,
    ) -> Look {
        let mut entities = self.lock();
        let Some(p) = entities.get_mut(entity) else {
            return Look::Load;
        };
        // Quiet for longer than FORGET_AFTER, or not confirmed since a move was fenced
        // out or a leased run went back, with nothing running or waiting: forgotten and
        // read again, so that neither a number behind it nor a park is decided from a
        // memory the database may have left (gc takes a position idle for its
        // retention, and the entity starts again at its first number; a read keeps the
        // higher of the memory's number and the database's).
        if p.idle() && p.checked.is_none_or(|at| at.elapsed() > FORGET_AFTER) {
            entities.remove(entity);
            return Look::Load;
        }
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
            // Handed on in a leased run: the turn before it kept it for its row. (Not
            // any row of the same message: a turn taken over from a previous owner runs
            // from its row while the broker's copy of it may hold the turn here; it
            // waits for that one.)
            Some((at, running)) if reserved && *at == seq && running == who => Look::Run,
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
    pub(super) fn loaded(&self, entity: &Entity, next: i64) {
        let mut entities = self.lock();
        if !entities.contains_key(entity) && entities.len() >= MAX_ENTITIES {
            entities.retain(|_, p| !p.idle());
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

    /// Makes `entity`'s last check `ago` older (tests of what the memory forgets).
    #[cfg(test)]
    fn backdate(&self, entity: &Entity, ago: std::time::Duration) {
        if let Some(p) = self.lock().get_mut(entity) {
            let at = p.checked.unwrap_or_else(Instant::now);
            let at = at.checked_sub(ago);
            p.checked = Some(at.expect("the monotonic clock is older than `ago`"));
        }
    }

    /// `seq` of `entity` is parked now: its turn, if it came meanwhile and nobody runs
    /// it (the move that passed the number before it ran before the park committed).
    pub(super) fn parked(self: &Arc<Self>, entity: &Entity, seq: i64, who: &Who) -> Option<Turn> {
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
    pub(super) fn end(
        &self,
        entity: &Entity,
        seq: i64,
        who: &Who,
        moved: Option<bool>,
        to: i64,
    ) -> bool {
        let mut entities = self.lock();
        let Some(p) = entities.get_mut(entity) else {
            return false;
        };
        p.ended(seq, who, None);
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

    /// The turn of `who` at `seq` completed and hands its entity on to `next`'s row at
    /// the number after it, in a leased run: the position moves in memory only (the
    /// run's last turn moves it in the database), and the turn is kept for that row.
    fn handed_on(&self, entity: &Entity, seq: i64, who: &Who, next: &Who) {
        let mut entities = self.lock();
        let Some(p) = entities.get_mut(entity) else {
            return;
        };
        p.ended(seq, who, Some((seq + 1, next.clone())));
        p.next = p.next.max(seq + 1);
        p.checked = Some(Instant::now());
        p.parked = p.parked.split_off(&(seq + 1));
        p.parked.remove(&(seq + 1));
    }

    /// A leased run's turn at `seq` ended without moving the position in the database,
    /// which stands at `from`: the memory goes back to it, to be read again (the turns
    /// between completed: their rows, republished by the sweep, are duplicates that move
    /// the position on).
    fn rewind(&self, entity: &Entity, seq: i64, who: &Who, from: i64) {
        let mut entities = self.lock();
        let Some(p) = entities.get_mut(entity) else {
            return;
        };
        p.ended(seq, who, None);
        p.next = from;
        p.checked = None;
    }
}

/// The turn a leased run's turn handed on to the row after it, kept in memory for that
/// row until it enters ([`Reserved::taken`]). Dropped before (the row was not run: its
/// body did not parse, the circuit kept it out), it sends the memory back to where the
/// database stands, the run's first number, as a turn of the run that fails does.
pub(crate) struct Reserved {
    positions: Arc<Positions>,
    entity: Entity,
    seq: i64,
    who: Who,
    from: i64,
    taken: bool,
}

impl Reserved {
    /// Where the position stands in the database for the row's turn: the run's first
    /// number, or the number of the turn that handed on, if its long-turn mark moved
    /// the position there ([`Turn::stands_at_own`]).
    pub(in crate::worker) fn from(&self) -> i64 {
        self.from
    }

    /// The row entered and holds the turn now (its [`Turn`] ends it).
    pub(in crate::worker) fn taken(mut self) {
        self.taken = true;
    }
}

impl std::fmt::Debug for Reserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reserved")
            .field("entity", &self.entity)
            .field("seq", &self.seq)
            .field("from", &self.from)
            .finish()
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if !self.taken {
            self.positions
                .rewind(&self.entity, self.seq, &self.who, self.from);
        }
    }
}

/// A turn this process holds in memory. Dropped without [`Turn::complete`] or
/// [`Turn::leave`] (an error on the way), it ends without moving (in a leased run, it
/// sends the memory back to the run's first number): the delivery comes
/// back and decides again.
pub(crate) struct Turn {
    positions: Arc<Positions>,
    entity: Entity,
    seq: i64,
    who: Who,
    /// Where the position stands in the database: `seq`, or the number of a leased
    /// run's first turn, when the turns since ran without moving it.
    from: i64,
    /// When it was taken, or got its place among the queue's runs ([`Turn::placed`]).
    began: Instant,
    ended: bool,
}

impl Turn {
    /// The turn of `who` at `seq`, which `positions` marked as running.
    pub(super) fn new(positions: &Arc<Positions>, entity: &Entity, seq: i64, who: Who) -> Self {
        Self {
            positions: positions.clone(),
            entity: entity.clone(),
            seq,
            who,
            from: seq,
            began: Instant::now(),
            ended: false,
        }
    }

    /// The turn is part of a leased run whose first turn was at `from`, where the
    /// position stands in the database: its move (or its holder) moves it from there.
    pub(in crate::worker) fn ran_from(&mut self, from: i64) {
        self.from = from.min(self.seq);
    }

    /// The turn got its place among the queue's runs: from now on it runs (what it
    /// waited for a place does not tell how long its successor will take).
    pub(in crate::worker) fn placed(&mut self) {
        self.began = Instant::now();
    }

    /// The turn's number.
    pub(in crate::worker) fn seq(&self) -> i64 {
        self.seq
    }

    /// Whether the position stands behind the turn in the database (a leased run).
    pub(super) fn behind(&self) -> bool {
        self.from < self.seq
    }

    /// The turn's long-run mark moved the position to its number
    /// ([`crate::ordering::held::Marked::Moved`]): its move goes from there.
    pub(super) fn stands_at_own(&mut self) {
        self.from = self.seq;
    }

    /// The turn's place and who runs it.
    pub(in crate::worker) fn done(&self) -> Done {
        Done {
            place: (self.entity.0.clone(), self.entity.1.clone(), self.seq),
            operation: self.who.0.clone(),
            idempotency_key: self.who.1.clone(),
            from: self.from,
        }
    }

    /// Its record completed: moves the position past it (before the delivery is acked:
    /// a crash between an ack and the move would leave nobody to move it) and returns
    /// the delivery parked at the next number, released to run next, and in leased
    /// mode the rows the move read after that one
    /// ([`crate::ordering::owner::Then::Release`]), if this turn completed within a
    /// run's time ([`super::run_for`]) of getting its place. A slower turn's successor
    /// would likely not complete in time to be handed on either, and what the move read
    /// was read again by the next: on the shuffled leased bench, under load, 19,800 of
    /// 20,000 turns moved, each move reading 5.7 rows with their bodies
    /// (docs/PERFORMANCE.md).
    pub(in crate::worker) async fn complete(
        self,
        owner: &Owner,
    ) -> Result<(Vec<Released>, Vec<Released>), Failure> {
        let moves = match &owner.reads {
            Some(reads) if self.began.elapsed() < super::run_for() => reads,
            _ => &owner.moves,
        };
        let moved = moves.call(self.done()).await??;
        let ahead = moved.ahead;
        let next = moved.moved.then_some(moved.next);
        Ok((self.moved(owner, next, None).await?, ahead))
    }

    /// Its record completed, quickly, in a leased run, and the row parked at the next
    /// number (run by `next`) is in hand: the turn goes to it without moving the
    /// position in the database (the run's last turn moves it past them all).
    pub(in crate::worker) fn hand_on(mut self, next: Who) -> Reserved {
        self.ended = true;
        self.positions
            .handed_on(&self.entity, self.seq, &self.who, &next);
        Reserved {
            positions: self.positions.clone(),
            entity: self.entity.clone(),
            seq: self.seq + 1,
            who: next,
            from: self.from,
            taken: false,
        }
    }

    /// Its completion moved the position past it (`next`: what that move released), or
    /// was fenced out (`None`: an operator's skip, or another process, moved it): the
    /// memory follows. `to`: where the position moved, when the same commit ran the
    /// turns after it (a chain); else the number after it. The delivery parked at that
    /// number, released to run next (one this process parked while the move ran is
    /// fetched now).
    pub(in crate::worker) async fn moved(
        mut self,
        owner: &Owner,
        next: Option<Vec<Released>>,
        to: Option<i64>,
    ) -> Result<Vec<Released>, Failure> {
        self.ended = true;
        let moved = next.is_some();
        let to = to.unwrap_or(self.seq + 1);
        if !moved && self.behind() {
            self.positions
                .rewind(&self.entity, self.seq, &self.who, self.from);
            return Ok(Vec::new());
        }
        let parked_next = self
            .positions
            .end(&self.entity, self.seq, &self.who, Some(moved), to);
        if !moved {
            debug!(entity = ?self.entity, seq = self.seq, "owned order: the position moved without this process; read again");
        }
        let next = next.unwrap_or_default();
        if next.is_empty() && crate::failpoint::fails("owned-move-error") {
            // Where the fetch below may fail: the memory has ended, nothing was handed.
            let outage = crate::store::StoreError::Database(sqlx::Error::PoolTimedOut);
            return Err(outage.into());
        }
        if !next.is_empty() || !parked_next {
            return Ok(next);
        }
        let place = (self.entity.0.clone(), self.entity.1.clone(), to);
        Ok(owner.fetches.call(place).await??.into_iter().collect())
    }

    /// It ended without completing (`outcome`): a delivery that ran and is retrying,
    /// pending or failed for good is recorded as the entity's holder, for operators and
    /// a skip; so is one whose record another process, or this process's session before
    /// a lost connection, runs under a live lease (`DuplicateInProgress`): that one's
    /// move, fenced on where its run began, passes a position its own key holds, and
    /// the sweep moves on past it once it completed. That one keeps its waiting row:
    /// given back to the sweep when no retry delay is set, it may be all there is of
    /// its message (a SIGKILLed owner's turn, run from its row). (Left without a
    /// holder, the position stood at the turn with no row while it ran elsewhere:
    /// listed a gap, which a skip would have passed.)
    pub(in crate::worker) async fn leave(mut self, owner: &Owner, outcome: Outcome) {
        let holds = matches!(
            outcome,
            Outcome::FailedTransient
                | Outcome::FailedPermanent
                | Outcome::RetriesExhausted
                | Outcome::Pending
                | Outcome::DuplicateFailed
                | Outcome::DuplicateInProgress
        );
        // A run's turn moves the position to its own number first, even if it holds
        // nothing (its record never ran: the position must not stay behind it).
        let keeps_row = matches!(outcome, Outcome::DuplicateInProgress);
        let held = match holds || self.behind() {
            true => held::hold(owner.store.pool(), &self.done(), holds, keeps_row).await,
            false => Ok(true),
        };
        if let Err(error) = &held {
            warn!(error = %crate::text::error_line(error), "owned order: the blocked turn's holder not recorded");
        }
        self.ended = true;
        if self.behind() && !matches!(held, Ok(true)) {
            self.positions
                .rewind(&self.entity, self.seq, &self.who, self.from);
            return;
        }
        let next = self.seq + 1;
        self.positions
            .end(&self.entity, self.seq, &self.who, None, next);
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if !self.ended && self.behind() {
            self.positions
                .rewind(&self.entity, self.seq, &self.who, self.from);
        } else if !self.ended {
            let next = self.seq + 1;
            self.positions
                .end(&self.entity, self.seq, &self.who, None, next);
        }
    }
}

#[cfg(test)]
#[path = "positions_tests.rs"]
mod tests;
