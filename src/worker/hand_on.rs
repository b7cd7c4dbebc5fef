//! A turn handed on: once a delivery completed, its entity's next turn runs in the same
//! task when it is this handler's, from this queue, and so on down the entity's sequence
//! (docs/DESIGN.md, "Order per entity"); the rest of what a release gave back is
//! published to its queue.

use lapin::{BasicProperties, Channel};
use sqlx::PgPool;
use tracing::{debug, warn};

use super::Runtime;
use super::decision::Outcome;
use super::execute::{decide, delivery_span};
use super::ordered::{Entity, moves_on};
use super::owned::{Ahead, Link, Run};
use super::settle::{Incoming, Links, Source};
use crate::handler::{Envelope, Handler};
use crate::metrics;
use crate::ordering::{Released, table};
use crate::{topology, trace};

/// What a delivery that ended with `outcome` released of its `entity`'s order: what the
/// commit that completed it `handed` over already, or, when it completed without, the
/// release made now ([`leave`]).
pub(super) async fn released_by<H: Handler>(
    runtime: &Runtime<H>,
    outcome: Outcome,
    entity: Option<Entity>,
    handed: Option<Vec<Released>>,
) -> Vec<Released> {
    match (handed, entity) {
        (Some(handed), _) => handed,
        (None, Some(entity)) if moves_on(outcome) => leave(runtime, entity).await,
        _ => Vec::new(),
    }
}

/// Moves `entity` on past the delivery that completed and hands the next turn to the
/// delivery that waits for it, if one does: returned (flagged [`Released::turn`]) to run
/// in this process, with rows whose turn passed while they waited (to publish, for their
/// dead letter). A failure here only delays the next turn until the sweep.
async fn leave<H: Handler>(runtime: &Runtime<H>, entity: Entity) -> Vec<Released> {
    let released = runtime.orderings.release(entity).await;
    released.unwrap_or_else(|error| {
        warn!(error = %crate::text::error_line(&error), "the next turn waits for the sweep");
        Vec::new()
    })
}

/// Most turns one delivery's task hands on in this process, one after the other, before
/// it publishes the next to its queue (where it waits its turn among the others, under
/// the queue's concurrency and the shutdown's drain).
const MAX_HANDED_ON: usize = 64;

/// Carries on after a delivery was decided with what its completion `released` of its
/// entity's order: the turn runs next in this task when it is this handler's, from this
/// queue, and so on with what that one releases; everything else released goes to its
/// queue (rows whose turn passed come back dead-lettered). With the rows a move read
/// `ahead`, the turns after it are handed on in a leased run ([`Run`]).
pub(super) async fn hand_on<H: Handler>(
    runtime: &Runtime<H>,
    links: &Links,
    mut released: Vec<Released>,
    ahead: Ahead,
) {
    let mut handed_on = 0;
    let mut run = Run::new(ahead);
    let mut next = None;
    loop {
        let turn = match next.take() {
            Some(turn) => Some(turn),
            None if handed_on < MAX_HANDED_ON => take_turn(runtime, &mut released),
            None => None,
        };
        for other in &released {
            publish(&links.publish, runtime.store.pool(), other).await;
        }
        let Some(turn) = turn else { return };
        crate::failpoint::hit("before-turn-run");
        handed_on += 1;
        let queue = &runtime.config.queue;
        let link = run.link(&turn, H::OPERATION, queue, handed_on < MAX_HANDED_ON);
        let ahead;
        (released, ahead) = run_turn(runtime, links, &turn, link).await;
        next = run.went(ahead);
    }
}

/// The turn among `released` that this worker runs next (its handler's, from its
/// queue), taken out of it.
pub(super) fn take_turn<H: Handler>(
    runtime: &Runtime<H>,
    released: &mut Vec<Released>,
) -> Option<Released> {
    let mine = released.iter().position(|r| runs_here(runtime, r))?;
    Some(released.swap_remove(mine))
}

/// Whether `released` is a turn this worker runs in the task that released it: its
/// handler's, from its queue (else it is published to its queue).
pub(super) fn runs_here<H: Handler>(runtime: &Runtime<H>, released: &Released) -> bool {
    released.turn && released.operation == H::OPERATION && released.queue == runtime.config.queue
}

/// What a delivery handed its turn carries, as if the broker brought it from its queue.
pub(super) fn envelope_of(released: &Released) -> Envelope {
    Envelope {
        exchange: String::new(),
        routing_key: released.queue.clone(),
        redelivered: false,
        properties: released.properties.clone(),
    }
}

/// Runs the delivery whose turn this process released, from its waiting row, as if the
/// broker had brought it: its row goes with the release's move past it once it
/// completed, or once its retry copy or dead letter is published; a requeue gives it
/// back to the sweep. What its own completion released.
async fn run_turn<H: Handler>(
    runtime: &Runtime<H>,
    links: &Links,
    released: &Released,
    link: Link,
) -> (Vec<Released>, Ahead) {
    let span = delivery_span(runtime, false);
    let envelope = envelope_of(released);
    let mut incoming = Incoming::new(&released.body, envelope, Some(&links.follow_ups));
    incoming.holds_turn = true;
    incoming.link = link;
    incoming.positions = links.positions.clone();
    trace::continue_trace(
        &span,
        incoming.trace.as_ref(),
        &runtime.process_span,
        "consumer",
    );
    decide(runtime, links, &incoming, Source::Waiting(released), span).await
}

/// Publishes a delivery whose turn came to its queue (confirmed). Not published, it is
/// released again by a sweep after [`crate::ordering::table::RELEASE_STALE`]. A row
/// behind its position ([`Released::turn`] false) whose key's record decides it goes
/// once its copy is confirmed ([`table::published_behind`]).
pub(super) async fn publish(channel: &Channel, pool: &PgPool, released: &Released) {
    let properties: BasicProperties = released.properties.clone();
    match topology::publish_confirmed(channel, &released.queue, &released.body, properties).await {
        Ok(()) => {
            metrics::ordering_released(1);
            if !released.turn
                && let Err(error) = table::published_behind(pool, released).await
            {
                debug!(
                    error = %crate::text::error_line(&error),
                    "a published row behind its position stays; the sweep publishes it again"
                );
            }
        }
        Err(error) => warn!(
            error = %crate::text::error_line(&error),
            queue = %released.queue,
            seq = released.seq,
            "a waiting delivery's turn came but it was not published; the sweep tries again"
        ),
    }
}
