//! Order per entity in the worker (docs/DESIGN.md, "Order per entity"). A delivery of a
//! handler that answers [`Handler::ordering`] enters its entity's order before its
//! claim: its turn goes on to the claim; one that came early is acked and waits in
//! Postgres. Once a delivery's record completed, its entity moves on and the turn is
//! handed to the delivery that waits for it, which `hand_on` runs next in the same task.
//! What a crash or a skip leaves behind, the sweep publishes (`sweep.rs`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tracing::debug;

use super::batch::Batcher;
use super::decision::{CONFLICT, DeadLetterOrder, Decided, Outcome, Settle, Verdict};
use super::execute::message_fault;
use super::hand_on::runs_here;
use super::owned::{Ahead, Owner, Positions, Stand, Turn, Who};
use super::parse::Parsed;
use super::settle::Incoming;
use super::{Failure, Runtime, WorkerConfig};
use crate::dead_letter::Reason;
use crate::fault::Fault;
use crate::handler::Handler;
use crate::ordering::{Entered, Entry, Gate, Ordered, Released, table};
use crate::store::{Store, StoreError};

/// An entity: its scope and ordering key.
pub(super) type Entity = (String, String);

/// Where a delivery let into its entity's order stands: the entity whose turn it
/// holds under the gate, or its turn held in memory under owned order (neither for a
/// handler that orders nothing).
#[derive(Default)]
pub(super) struct InOrder {
    pub(super) entity: Option<Entity>,
    pub(super) turn: Option<Turn>,
}

/// Lets a delivery into its entity's order, if its handler orders it; a verdict when
/// it does not run now (early and parked, passed, in conflict).
pub(super) async fn enter_order<H: Handler>(
    runtime: &Runtime<H>,
    incoming: &Incoming<'_>,
    parsed: &mut Parsed,
    message: &H::Message,
) -> Result<Result<InOrder, Verdict>, Failure> {
    let Some(ordering) = runtime.handler.ordering(message) else {
        return Ok(Ok(InOrder::default()));
    };
    let owner = runtime.owner.as_ref().zip(incoming.positions.as_ref());
    if let (Some((owner, positions)), Some(_)) = (owner, ordering.sequence) {
        // Owned order: numbered deliveries of a queue with a single active consumer.
        let entered = enter_owned(runtime, owner, positions, incoming, parsed, ordering).await?;
        return Ok(entered.map(|turn| InOrder { entity: None, turn }));
    }
    let entity = (parsed.key.scope().to_owned(), ordering.key.clone());
    if !incoming.holds_turn
        && let Some(verdict) = enter(runtime, incoming, parsed, ordering).await?
    {
        return Ok(Err(verdict));
    }
    parsed.entity = Some(entity.clone());
    Ok(Ok(InOrder {
        entity: Some(entity),
        turn: None,
    }))
}

/// Where a delivery of a queue with a single active consumer begins its run: whom its
/// turn may hand on to, if it joined a leased run (the position stands at the run's
/// first number, and the row after it may be in hand: `owned/run.rs`), and its place
/// among the queue's runs (deliveries are taken up to the prefetch, and the runs held
/// to the concurrency here, after the early ones were parked; a turn handed on keeps
/// the place of the turn before it, unless it waited for a copy of its message, which
/// gave the place back: `Owner::enter`). Nothing for other queues.
///
/// A turn held in memory moves in its completion's commit (the batch's, or the
/// handler's transaction in leased mode: `parsed.owned`) when few others run: one
/// entity's turns after one another (a hot entity) then save a round trip each. Under
/// load, a leased turn's move goes with others', batched after its commit: one move in
/// each handler's commit cost the shuffled bench a quarter of its pace (PERFORMANCE.md).
pub(super) async fn begin_owned<H: Handler>(
    runtime: &Runtime<H>,
    incoming: &Incoming<'_>,
    turn: Option<&mut Turn>,
    parsed: &mut Parsed,
) -> (Option<Who>, Option<OwnedSemaphorePermit>) {
    let Some(positions) = &incoming.positions else {
        return (None, None);
    };
    let (hand_to, turn) = match turn {
        Some(held) => (incoming.link.entered(held), Some(held)),
        None => (None, None),
    };
    let running = match incoming.link.permit() {
        Some(handed) => Some(handed),
        None => positions.run().await,
    };
    if let Some(held) = turn {
        held.placed();
        if hand_to.is_none() && (runtime.transactions.is_some() || positions.quiet()) {
            parsed.owned = Some(held.done());
        }
    }
    (hand_to, running)
}

/// Ends an owned turn's run ([`begin_owned`]): a turn that completed too late for its
/// run moves the position itself ([`move_owned`]). Its place among the queue's runs
/// goes to the turn it handed on to, or in leased mode that its move released when
/// this task runs that one next (this handler's, from this queue); else back to the
/// queue. Waiting again for a place behind the deliveries taken up to the prefetch, a
/// released turn of the shuffled leased bench took about half a second to complete,
/// twice the time in which a run hands on, so runs hardly ever did
/// (docs/PERFORMANCE.md). In transactional mode, where a batch runs the parked turns
/// after its own (chains), the bench was no faster with it.
pub(super) async fn end_owned<H: Handler>(
    runtime: &Runtime<H>,
    incoming: &Incoming<'_>,
    turn: Option<Turn>,
    decided: &mut Decided,
    hand_to: Option<Who>,
    running: Option<OwnedSemaphorePermit>,
) -> Result<(), Failure> {
    let hand_to = hand_to.and_then(|_| incoming.link.hands_to());
    let leased = runtime.transactions.is_none();
    // Kept through the move in leased mode, for the turn it may release.
    let mut running = running.filter(|_| hand_to.is_some() || leased);
    if let (Some(turn), Some(owner)) = (turn, &runtime.owner) {
        move_owned(owner, turn, decided, hand_to).await?;
    }
    let released = decided
        .handed
        .iter()
        .flatten()
        .any(|r| runs_here(runtime, r));
    match &mut decided.ahead {
        Ahead::HandedOn { place, .. } => *place = running.take(),
        Ahead::Read { place, .. } if released => *place = running.take(),
        Ahead::None if released && running.is_some() => {
            let place = running.take();
            let rows = Vec::new();
            decided.ahead = Ahead::Read { rows, place };
        }
        _ => {}
    }
    Ok(())
}

/// Moves an owned turn's entity on before the ack, when its run completed (in
/// transactional mode, in the batch's commit, which handed what it released): after
/// the ack, a crash would leave nobody to move it. A turn of a leased run that completed
/// quickly hands on to `next`, the row after it, without a move ([`Run`]). A turn that
/// did not complete stays with the decision, which records it as its entity's holder.
pub(super) async fn move_owned(
    owner: &Owner,
    turn: Turn,
    decided: &mut Decided,
    next: Option<Who>,
) -> Result<(), Failure> {
    let to = decided.chained.as_ref().map(|chained| chained.to);
    match (
        moves_on(decided.verdict.outcome),
        decided.handed.take(),
        next,
    ) {
        (true, Some(mut released), _) => {
            // A leased move in the handler's commit read the rows after the one it
            // released: they follow it.
            let next = to.unwrap_or(turn.seq() + 1);
            let ahead: Vec<_> = released.extract_if(.., |r| r.seq > next).collect();
            decided.handed = Some(turn.moved(owner, Some(released), to).await?);
            if !ahead.is_empty() {
                decided.ahead = Ahead::Read {
                    rows: ahead,
                    place: None,
                };
            }
        }
        (true, None, Some(next)) => {
            let reserved = turn.hand_on(next);
            crate::failpoint::hit("after-hand-on");
            decided.handed = Some(Vec::new());
            decided.ahead = Ahead::HandedOn {
                reserved,
                place: None,
            };
        }
        (true, None, None) => {
            let (released, ahead) = turn.complete(owner).await?;
            decided.handed = Some(released);
            if !ahead.is_empty() {
                decided.ahead = Ahead::Read {
                    rows: ahead,
                    place: None,
                };
            }
        }
        (false, handed, _) => {
            decided.handed = handed;
            decided.owned = Some(turn);
        }
    }
    Ok(())
}

/// The batching loops of a worker's ordering calls. Entries share one round trip with
/// the deliveries that arrive together. A turn's release, and the claim of the delivery
/// it hands the turn to, batch without a linger: the entity's next turn waits on them (a
/// linger would be paid at every turn of a hot entity), and what queued up while the
/// batches in flight ran still goes together (many entities at once). The claim, and in
/// transactional mode the turn's batch, go with the worker's others, submitted `now`
/// ([`Batcher::submit`]).
pub(super) struct Orderings {
    entries: Batcher<Entry, Entered>,
    releases: Batcher<Entity, Vec<Released>>,
}

impl Orderings {
    pub(super) fn new(store: &Store, config: &WorkerConfig) -> Self {
        let (size, linger, in_flight) = (
            config.batch_size,
            config.batch_linger,
            config.batches_in_flight,
        );
        let entering = store.clone();
        let entries = Batcher::spawn(size, linger, in_flight, move |entries: Arc<[Entry]>| {
            let store = entering.clone();
            async move { table::enter(store.pool(), store.keys(), &entries).await }
        });
        let releasing = store.clone();
        let releases = Batcher::spawn(
            size,
            Duration::ZERO,
            in_flight,
            move |entities: Arc<[Entity]>| {
                let store = releasing.clone();
                async move { released_for(&store, &entities).await }
            },
        );
        Self { entries, releases }
    }

    /// Moves `entity` on past its completed holder and releases the next turn
    /// ([`table::release`]), batched with other entities' releases.
    pub(super) async fn release(&self, entity: Entity) -> Result<Vec<Released>, Failure> {
        Ok(self.releases.call(entity).await??)
    }
}

/// What [`table::release`] released, one answer per entity asked about (an entity asked
/// about twice in one batch gets its rows the first time).
async fn released_for(
    store: &Store,
    entities: &[Entity],
) -> Result<Vec<Vec<Released>>, StoreError> {
    let mut released = table::release(store.pool(), store.keys(), entities, false).await?;
    Ok(entities
        .iter()
        .map(|(scope, key)| {
            let (mine, rest) = released
                .drain(..)
                .partition(|r| &r.scope == scope && &r.ordering_key == key);
            released = rest;
            mine
        })
        .collect())
}

/// Enters the delivery of `parsed` into its entity's order: `None` when its turn came
/// (the claim decides on), or the verdict it settles with (waiting, out of sequence, a
/// conflict with its waiting copy).
async fn enter<H: Handler>(
    runtime: &Runtime<H>,
    incoming: &Incoming<'_>,
    parsed: &Parsed,
    ordered: Ordered,
) -> Result<Option<Verdict>, Failure> {
    let entity = ordered.key.clone();
    let entry = match entry_of(runtime, incoming, parsed, ordered) {
        Ok(entry) => entry,
        Err(verdict) => return Ok(Some(verdict)),
    };
    let entered = match runtime.orderings.entries.call(entry).await? {
        Ok(entered) => entered,
        Err(error) if error.fault() == Fault::Message => {
            return Ok(Some(message_fault(&Failure::Store(error))));
        }
        Err(error) => return Err(error.into()),
    };
    if entered.gate == Gate::Run {
        return Ok(None);
    }
    Ok(Some(verdict_of(entered.gate, &entity, entered.seq)))
}

/// What is kept of a delivery if it waits, or why it cannot be (it is malformed).
fn entry_of<H: Handler>(
    runtime: &Runtime<H>,
    incoming: &Incoming<'_>,
    parsed: &Parsed,
    ordered: Ordered,
) -> Result<Entry, Verdict> {
    if let Some(why) = ordered.invalid() {
        return Err(super::decision::malformed(why));
    }
    let properties =
        table::stored_properties(incoming.properties()).map_err(super::decision::malformed)?;
    Ok(Entry {
        key: parsed.key.clone(),
        ordered,
        fingerprint: parsed.fingerprint.as_hex().to_owned(),
        also: parsed.fingerprint.also(),
        queue: runtime.config.queue.clone(),
        body: incoming.data.to_vec(),
        properties,
    })
}

/// Enters a numbered delivery into its entity's order under owned order (a queue with a
/// single active consumer: [`super::owned`]): the turn it holds in memory, `None` when
/// its record decides without a turn (the claim says a duplicate), or the verdict it
/// settles with.
async fn enter_owned<H: Handler>(
    runtime: &Runtime<H>,
    owner: &Owner,
    positions: &Arc<Positions>,
    incoming: &Incoming<'_>,
    parsed: &Parsed,
    ordered: Ordered,
) -> Result<Result<Option<Turn>, Verdict>, Failure> {
    let entity = (parsed.key.scope().to_owned(), ordered.key.clone());
    let seq = ordered.sequence;
    let entry = match entry_of(runtime, incoming, parsed, ordered) {
        Ok(entry) => entry,
        Err(verdict) => return Ok(Err(verdict)),
    };
    let from_row = incoming.holds_turn;
    let gate = match owner
        .enter(positions, &entity, entry, from_row, &incoming.link)
        .await
    {
        Ok(Stand::Run(turn)) => return Ok(Ok(Some(turn))),
        Ok(Stand::Decided) => return Ok(Ok(None)),
        Ok(Stand::Waiting) => Gate::Wait,
        Ok(Stand::Passed) => Gate::Passed,
        Ok(Stand::Taken) => Gate::Taken,
        Ok(Stand::Conflict) => Gate::Conflict,
        Err(error) if error.fault() == Fault::Message => return Ok(Err(message_fault(&error))),
        Err(error) => return Err(error),
    };
    Ok(Err(verdict_of(gate, &entity.1, seq)))
}

/// The verdict of a delivery of `entity` with number `seq` that does not run now.
fn verdict_of(gate: Gate, entity: &str, seq: Option<i64>) -> Verdict {
    let seq = seq.map_or_else(|| "?".into(), |s| s.to_string());
    match gate {
        Gate::Run | Gate::Wait | Gate::Waiting => {
            debug!(entity = %entity, seq = %seq, "waiting for its turn");
            Verdict {
                action: Settle::AckWaiting,
                outcome: Outcome::Waiting,
            }
        }
        Gate::Passed => out_of_sequence(
            Reason::SequencePassed,
            format!(
                "sequence {seq} of entity {entity:?} is behind its position: it ran, or an \
                 operator skipped it (idem ops ordering)"
            ),
        ),
        Gate::Taken => out_of_sequence(
            Reason::SequenceConflict,
            format!("another message of entity {entity:?} holds or waits with sequence {seq}"),
        ),
        Gate::Conflict => Verdict {
            action: dead_letter(Reason::FingerprintConflict, CONFLICT.into()),
            outcome: Outcome::Conflict,
        },
    }
}

fn out_of_sequence(reason: Reason, error: String) -> Verdict {
    Verdict {
        action: dead_letter(reason, error),
        outcome: Outcome::OutOfSequence,
    }
}

fn dead_letter(reason: Reason, error: String) -> Settle {
    Settle::DeadLetter(DeadLetterOrder {
        reason,
        error,
        attempts: 0,
        pin: None,
    })
}

/// Whether a delivery that ended with `outcome` leaves its entity's turn to the next:
/// its record is `completed`.
pub(super) fn moves_on(outcome: Outcome) -> bool {
    matches!(
        outcome,
        Outcome::Executed | Outcome::Reconciled | Outcome::DuplicateCompleted
    )
}

#[cfg(test)]
#[path = "ordered_tests.rs"]
mod tests;
