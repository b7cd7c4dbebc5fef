//! The background work of order per entity (docs/DESIGN.md, "Order per entity"): the
//! sweep, in every process, publishes what a crash or a skip left behind and keeps the
//! gauges; on an owned queue, the takeover runs at once what the previous owner was
//! handed and never completed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::Channel;
use lapin::options::ConfirmSelectOptions;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::hand_on::publish;
use super::route::Routes;
use super::settle::Links;
use crate::connector::Connector;
use crate::metrics;
use crate::ordering::{held, table};
use crate::store::{Store, StoreError};

/// How long after an owned queue's first delivery [`Takeover::run`] looks: a statement
/// the previous owner had in flight when it died commits within it.
const TAKEOVER_AFTER: Duration = Duration::from_millis(200);

/// What the takeover of an owned queue works with: its session's handlers, links and
/// tasks.
pub(super) struct Takeover {
    pub(super) store: Store,
    pub(super) queue: String,
    pub(super) routes: Arc<Routes>,
    pub(super) links: Links,
    pub(super) tasks: TaskTracker,
    pub(super) shutdown: CancellationToken,
}

impl Takeover {
    /// On an owned queue, once after a session's first delivery (`first`, when it
    /// came): runs the turns a previous owner was handed in process before then and
    /// never completed ([`held::taken_over`]), each in a task of its own as a turn
    /// handed on in process runs (a turn of a handler the queue no longer has is
    /// published to it). Its deliveries come back from the broker, but a turn handed
    /// from a waiting row was acked when it was parked: without this, its entity waits
    /// for the sweep, a second or more after the release went stale. Published to the
    /// queue instead, such turns waited behind what the queue still held: on the
    /// shuffled bench, in 5 of 8 runs with a kill, all or most of them were still
    /// waiting two seconds later and the sweep published them again. The tasks take no
    /// session permit: their runs take a place among the queue's runs, as every owned
    /// turn does, and there are at most as many as the previous owner was handed.
    ///
    /// The database's clock at the first delivery is read at once
    /// ([`held::takeover_cutoff`]): counted back from the look, a look that waited for a
    /// connection could take turns this process released after its first delivery.
    pub(super) async fn run(self, first: Instant) {
        let released = match self.take(first).await {
            Ok(released) => released,
            Err(error) => {
                // The sweep releases them once stale.
                warn!(error = %crate::text::error_line(&error), "owned order: takeover");
                return;
            }
        };
        if !released.is_empty() {
            info!(
                queue = %self.queue,
                released = released.len(),
                "owned order: took over the turns a previous owner was handed"
            );
        }
        for r in released {
            match self.routes.of_operation(&r.operation) {
                Some(route) if r.turn => {
                    self.tasks.spawn(route.run_released(self.links.clone(), r));
                }
                _ => publish(&self.links.publish, self.store.pool(), &r).await,
            }
        }
    }

    /// The turns to take over, released to this process: none once shutdown began
    /// (no new turns begin in a drain) or on a lost session (it may no longer own the
    /// queue); the sweep releases those once stale.
    async fn take(&self, first: Instant) -> Result<Vec<table::Released>, StoreError> {
        let cutoff = held::takeover_cutoff(self.store.pool(), first).await?;
        tokio::time::sleep_until((first + TAKEOVER_AFTER).into()).await;
        if self.shutdown.is_cancelled() || !self.links.publish.status().connected() {
            return Ok(Vec::new());
        }
        held::taken_over(self.store.pool(), self.store.keys(), &self.queue, cutoff).await
    }
}

/// Most entities one sweep moves on.
const SWEEP_BATCH: i64 = 500;

/// Most times `every` an idle sweep waits: a sweep that found nothing to move on waits
/// twice as long before the next, up to this (a busy worker's hand-offs leave it
/// nothing, and every look costs a scan of the waiting rows).
const IDLE_SWEEP_BACKOFF: u32 = 8;

/// How long after a redelivery woke it the sweep looks: the turns handed in process to
/// a consumer that died before it are stale by then ([`table::RELEASE_STALE`], counted
/// from their release, which came before the redelivery), with a margin for the clocks
/// of the two statements.
const AFTER_REDELIVERY: Duration = table::RELEASE_STALE.saturating_add(Duration::from_millis(100));

/// Until shutdown, every `every` (backing off to [`IDLE_SWEEP_BACKOFF`] times that while
/// it finds nothing, and [`AFTER_REDELIVERY`] after `redelivered` woke it): moves on the
/// entities whose holder completed without moving them (a crash between the commit and
/// the release), releases the turns nobody released (after a skip) or whose release did
/// not come back, and sets the gauges `idem_ordering_stalled` (not moved for
/// `stall_after`) and `idem_ordering_waiting`, every quarter of `stall_after` (at most
/// every sweep).
pub(super) async fn sweep_every(
    store: Store,
    publishing: Arc<Connector>,
    every: Duration,
    stall_after: Duration,
    redelivered: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let mut channel: Option<Channel> = None;
    let counted_every = (stall_after / 4).max(every);
    let mut counted: Option<tokio::time::Instant> = None;
    let mut idle = 1;
    loop {
        let Some(woken) = until_next(every * idle, &redelivered, &shutdown).await else {
            return;
        };
        if woken {
            idle = 1;
        }
        if counted.is_none_or(|at| at.elapsed() + every >= counted_every)
            && count_backlog(&store, stall_after).await
        {
            counted = Some(tokio::time::Instant::now());
        }
        let entities = match table::unmoved(store.pool(), SWEEP_BATCH, every).await {
            Ok(entities) if entities.is_empty() => {
                idle = (idle * 2).min(IDLE_SWEEP_BACKOFF);
                continue;
            }
            Ok(entities) => {
                idle = 1;
                entities
            }
            Err(error) => {
                warn!(error = %crate::text::error_line(&error), "ordering sweep");
                continue;
            }
        };
        let Some(channel) = reopened(&mut channel, &publishing).await else {
            continue;
        };
        match table::release(store.pool(), store.keys(), &entities, false).await {
            Ok(released) => {
                if !released.is_empty() {
                    info!(
                        released = released.len(),
                        "ordering sweep released waiting deliveries"
                    );
                }
                for r in &released {
                    publish(channel, store.pool(), r).await;
                }
            }
            Err(error) => warn!(error = %crate::text::error_line(&error), "ordering sweep"),
        }
    }
}

/// Counts the deliveries waiting and the stalled entities for the gauges, warning of
/// stalled ones; whether it could.
async fn count_backlog(store: &Store, stall_after: Duration) -> bool {
    match table::stats(store.pool(), stall_after).await {
        Ok((stalled, waiting)) => {
            metrics::ordering_backlog(stalled, waiting);
            if stalled > 0 {
                warn!(
                    stalled,
                    stall_after_s = stall_after.as_secs(),
                    "entities stalled: deliveries wait behind a turn that does not come; \
                     idem ops ordering"
                );
            }
            true
        }
        Err(error) => {
            debug!(error = %crate::text::error_line(&error), "ordering stats");
            false
        }
    }
}

/// The sweep's confirming channel, opened again once closed; `None` while the broker
/// cannot be reached.
async fn reopened<'c>(
    channel: &'c mut Option<Channel>,
    publishing: &Connector,
) -> Option<&'c Channel> {
    if channel.as_ref().is_none_or(|c| !c.status().connected()) {
        match confirming(publishing).await {
            Ok(c) => *channel = Some(c),
            Err(error) => {
                debug!(error = %crate::text::error_line(&error), "ordering sweep: broker");
                return None;
            }
        }
    }
    channel.as_ref()
}

/// Waits `pause`, or [`AFTER_REDELIVERY`] after `redelivered` woke it: whether a
/// redelivery did; `None` at shutdown.
async fn until_next(
    pause: Duration,
    redelivered: &Notify,
    shutdown: &CancellationToken,
) -> Option<bool> {
    let woken = tokio::select! {
        _ = tokio::time::sleep(pause) => false,
        _ = redelivered.notified() => true,
        _ = shutdown.cancelled() => return None,
    };
    if woken {
        tokio::select! {
            _ = tokio::time::sleep(AFTER_REDELIVERY) => {}
            _ = shutdown.cancelled() => return None,
        }
    }
    Some(woken)
}

async fn confirming(connector: &Connector) -> Result<Channel, lapin::Error> {
    let connection = connector.get().await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}
