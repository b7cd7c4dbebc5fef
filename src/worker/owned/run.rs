//! A leased run (docs/DESIGN.md, "Owned order"): in leased mode, a completion's move
//! releases the row parked at the next number and reads the rows parked right after
//! it (after the commit, only for a turn that completed within [`RUN_FOR`] of getting
//! its place among the queue's runs: `Turn::complete`). The task that runs the
//! released turn, in the completed turn's place, then hands each turn on to the row
//! after it without moving the position in the database: the run's last turn moves it
//! past them all, deleting their rows, in one statement (a move and a release mark per
//! turn were most of what a parked entry cost in leased mode: docs/PERFORMANCE.md).
//! Until then the memory is ahead of the database for that entity; a turn of the run
//! that does not complete moves the position to its own number first (holding it or
//! not), and one that fails on the way sends the memory back to where the database
//! stands.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::OwnedSemaphorePermit;

use super::{Reserved, Turn, Who};
use crate::ordering::Released;

/// Most rows a move reads after the one it releases.
pub(crate) const AHEAD: i64 = 32;

/// How long after the move that began it a run hands turns on without moving the
/// position: well within the second after which the sweep takes a released row whose
/// position has not moved for one nobody runs (`table::RELEASE_STALE`), and the skip's
/// wait, so that neither normally meets a run. A turn of the run that runs half a second
/// moves the position to its own number and holds it (`held::running`), as a turn handed
/// on alone would stand, before the sweep would take the run's first row.
const RUN_FOR: Duration = Duration::from_millis(250);

/// [`RUN_FOR`], or what a test stretched it to.
pub(crate) fn run_for() -> Duration {
    crate::failpoint::stretched("IDEM_RUN_FOR_MS", RUN_FOR)
}

/// What a completed turn's end leaves its task of its entity's rows, besides the turn
/// it released.
#[derive(Debug, Default)]
pub(crate) enum Ahead {
    /// Nothing: the run, if there was one, ends.
    #[default]
    None,
    /// Its move released the turn after it, which this task runs next in the place
    /// among the queue's runs that this turn held (`place`: the turn does not wait
    /// behind the deliveries taken up to the prefetch, nor does the run it may begin),
    /// and read these rows after that one (in order, not released).
    Read {
        rows: Vec<Released>,
        place: Option<OwnedSemaphorePermit>,
    },
    /// It handed its turn on to the row after it without a move (`reserved` for that
    /// row): the run goes on, in the place among the queue's runs that this turn held
    /// (`place`: the row does not wait again behind the deliveries taken up to the
    /// prefetch).
    HandedOn {
        reserved: Reserved,
        place: Option<OwnedSemaphorePermit>,
    },
}

/// What a turn handed on in a run is lent: where the position stands in the database,
/// who runs the row after it when the turn may hand on to that one, and the place
/// among the queue's runs that the turn before it held.
#[derive(Debug, Default)]
pub(crate) struct Link {
    /// The number of the run's first turn, when turns before this one ran without
    /// moving the position.
    from: Option<i64>,
    /// The row at the number after this turn's, and until when the run may go on: a
    /// completion before then hands the turn on to it.
    next: Option<(Who, Instant)>,
    permit: Mutex<Option<OwnedSemaphorePermit>>,
    reserved: Mutex<Option<Reserved>>,
}

impl Link {
    /// A link that lends only `place`, the place among the queue's runs of the turn
    /// before (tests).
    #[cfg(test)]
    pub(crate) fn lending(place: OwnedSemaphorePermit) -> Self {
        Self {
            permit: Mutex::new(Some(place)),
            ..Self::default()
        }
    }

    /// The place among the queue's runs the turn before this one held, if it handed on.
    pub(crate) fn permit(&self) -> Option<OwnedSemaphorePermit> {
        taken(&self.permit)
    }

    /// The row entered and holds `turn`: the memory the turn before it kept for it is
    /// the turn's now (a link dropped before sends the memory back to the run's first
    /// number: [`Reserved`]), and the turn moves the position from that number. Who
    /// runs the row after it, if the turn, completed now, hands on to it.
    pub(crate) fn entered(&self, turn: &mut Turn) -> Option<Who> {
        if let Some(reserved) = taken(&self.reserved) {
            reserved.taken();
        }
        if let Some(from) = self.from {
            turn.ran_from(from);
        }
        self.hands_to()
    }

    /// Whether the turn before this one kept its number in memory for this row (a
    /// leased run's hand-on, [`Reserved`]).
    pub(crate) fn reserved(&self) -> bool {
        self.reserved
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
    }

    /// Who runs the row after this turn, if the turn, completed now, hands on to it.
    pub(crate) fn hands_to(&self) -> Option<Who> {
        let (who, until) = self.next.as_ref()?;
        (Instant::now() < *until).then(|| who.clone())
    }
}

/// A task's run of one entity's turns.
#[derive(Debug)]
pub(crate) struct Run {
    from: Option<i64>,
    rows: VecDeque<Released>,
    since: Instant,
    permit: Option<OwnedSemaphorePermit>,
    reserved: Option<Reserved>,
}

impl Run {
    /// The run that begins with the turn a move released, `ahead` what it read after it.
    pub(crate) fn new(ahead: Ahead) -> Self {
        let (rows, permit) = match ahead {
            Ahead::Read { rows, place } => (rows.into(), place),
            Ahead::None | Ahead::HandedOn { .. } => (VecDeque::new(), None),
        };
        Self {
            from: None,
            rows,
            since: Instant::now(),
            permit,
            reserved: None,
        }
    }

    /// The link of `turn`, the run's next: it may hand on to the row after it if that
    /// one is in hand, the handler's (`operation`, from `queue`), the task may run one
    /// more turn (`more`), and the turn completes within [`RUN_FOR`] of the run's
    /// beginning.
    pub(crate) fn link(
        &mut self,
        turn: &Released,
        operation: &str,
        queue: &str,
        more: bool,
    ) -> Link {
        let next = self.rows.front().filter(|row| {
            more && row.seq == turn.seq + 1
                && row.scope == turn.scope
                && row.ordering_key == turn.ordering_key
                && row.operation == operation
                && row.queue == queue
        });
        Link {
            from: self.from,
            next: next.map(|row| {
                let who = Who(row.operation.clone(), row.idempotency_key.clone());
                (who, self.since + run_for())
            }),
            permit: Mutex::new(self.permit.take()),
            reserved: Mutex::new(self.reserved.take()),
        }
    }

    /// The run's turn ended, leaving `ahead`: the turn the run goes on with, when it
    /// handed on; else the run begins anew (with what its move read, if it moved).
    pub(crate) fn went(&mut self, ahead: Ahead) -> Option<Released> {
        match ahead {
            Ahead::HandedOn { reserved, place } => {
                // The run's first number, or the turn's own if its long-turn mark moved
                // the position there.
                self.from = Some(reserved.from());
                self.permit = place;
                self.reserved = Some(reserved);
                self.rows.pop_front()
            }
            ahead => {
                *self = Self::new(ahead);
                None
            }
        }
    }
}

/// What `slot` holds, taken out of it.
fn taken<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
}
