//! What a worker or service runs beside its deliveries, started with it and stopped
//! after its last delivery: garbage collection (`gc_every`), the tallies' flushes
//! (`tally_every`), the outbox relay (`outbox.relay`) and the ordering sweep
//! (`ordering_sweep_every`), once per process; and per
//! queue the watch for overdue retries.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::ServiceConfig;
use crate::connector::Connector;
use crate::handler::Handler;
use crate::outbox::Relay;
use crate::store::{Store, gc};
use crate::tally::{self, Tally};

/// The background tasks of one worker or service.
pub(super) struct Background {
    /// Awaited on the way out so that their connections are closed when `run` returns
    /// (aborted when the broker refused the topology).
    tasks: Vec<JoinHandle<()>>,
    /// Each queue's delivery outcomes per minute, for the console (none when
    /// `tally_every` is `None`), until its queue takes it.
    pub(super) tallies: BTreeMap<String, Arc<Tally>>,
    /// All of them, for the last flush.
    flushed: Vec<Arc<Tally>>,
    /// The tally's flushes stop on their own token, so that every way out of `run` (a
    /// refused topology too) ends them between two flushes, never in one.
    tally_stop: CancellationToken,
    flushes: Option<JoinHandle<()>>,
    /// What this process's deliveries wake.
    pub(super) wakes: Wakes,
}

/// What a delivery wakes in the background of its process.
#[derive(Clone, Default)]
pub(crate) struct Wakes {
    /// The relay, when a follow-up's publish failed.
    pub(crate) relay: Arc<Notify>,
    /// The ordering sweep, when a redelivery came: a consumer died or lost its channel,
    /// and the turns handed to it in process come back only through a sweep, which
    /// may have backed off to several seconds while it found nothing.
    pub(crate) sweep: Arc<Notify>,
}

impl Background {
    /// Starts what `config` asks for beside the `queues` of a service on `store`: one gc
    /// loop, one flusher for every queue's tally, one relay (publishing on the queues'
    /// `publishing` connection).
    pub(super) fn start(
        store: &Store,
        config: &ServiceConfig,
        queues: &[String],
        publishing: &Arc<Connector>,
        shutdown: &CancellationToken,
    ) -> Self {
        let mut tasks = Vec::new();
        if let Some(every) = config.gc_every {
            let gc = gc::collect_every(
                store.clone(),
                every,
                config.gc_pace.clone(),
                shutdown.clone(),
            );
            tasks.push(tokio::spawn(gc));
        }
        let tally_stop = shutdown.child_token();
        let (tallies, flushes) = match config.tally_every {
            Some(every) => {
                let retention = store.config().retention;
                let tallies: BTreeMap<String, Arc<Tally>> = queues
                    .iter()
                    .map(|q| (q.clone(), Arc::new(Tally::new(q, retention))))
                    .collect();
                let all = tallies.values().cloned().collect();
                let pool = store.pool().clone();
                let flushes = tally::flush_every(all, pool, every, tally_stop.clone());
                (tallies, Some(tokio::spawn(flushes)))
            }
            None => (BTreeMap::new(), None),
        };
        let wakes = Wakes::default();
        if config.outbox.relay {
            let relay = Relay::new(
                store.pool().clone(),
                &config.amqp_url,
                config.outbox.clone(),
                store.config().retention,
            )
            .sharing(publishing.clone())
            .listening_on(store.config().session.clone())
            .opening_with(store.config().keys.clone())
            .waking_on(wakes.relay.clone());
            tasks.push(tokio::spawn(relay.run(shutdown.clone())));
        }
        if let Some(every) = config.ordering_sweep_every {
            let sweep = super::sweep::sweep_every(
                store.clone(),
                publishing.clone(),
                every,
                config.ordering_stall_after,
                wakes.sweep.clone(),
                shutdown.clone(),
            );
            tasks.push(tokio::spawn(sweep));
        }
        Self {
            tasks,
            flushed: tallies.values().cloned().collect(),
            tallies,
            tally_stop,
            flushes,
            wakes,
        }
    }

    /// Stops the background once no delivery runs any more: waits for its tasks (they
    /// end with the shutdown), or aborts them when the service stops `refused`; then the
    /// tallies' last flush.
    pub(super) async fn stop(self, pool: &sqlx::PgPool, refused: bool) {
        for task in self.tasks {
            if refused {
                task.abort();
            } else {
                let _ = task.await;
            }
        }
        last_flush(&self.flushed, pool, self.tally_stop, self.flushes).await;
    }
}

/// How long a stopping worker waits to write its last delivery counts: with the
/// database gone, a flush would wait out the pool's acquire timeout, or longer for a
/// connection that went silent.
const LAST_FLUSH_WITHIN: Duration = Duration::from_secs(5);

/// Stops the tally's periodic flushes (after the one in progress, if any) and writes
/// the outcomes decided since, now that no delivery is in flight (handlers abandoned by
/// a shutdown timeout count nowhere), giving up after [`LAST_FLUSH_WITHIN`].
async fn last_flush(
    tallies: &[Arc<Tally>],
    pool: &sqlx::PgPool,
    stop: CancellationToken,
    flushes: Option<JoinHandle<()>>,
) {
    stop.cancel();
    let last = async {
        if let Some(flushes) = flushes {
            let _ = flushes.await;
        }
        let mut failed = None;
        for tally in tallies {
            if let Err(error) = tally.flush(pool).await {
                failed.get_or_insert(error);
            }
        }
        failed.map_or(Ok(()), Err)
    };
    match tokio::time::timeout(LAST_FLUSH_WITHIN, last).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => {
            warn!(error = %crate::text::error_line(&error), "delivery outcomes of the last seconds not written");
        }
        Err(_) => warn!(
            within_s = LAST_FLUSH_WITHIN.as_secs(),
            "delivery outcomes of the last seconds not written: the database did not answer"
        ),
    }
}

/// Until shutdown, counts the records of `H`'s operation whose next delivery is overdue
/// by `after` (`Store::overdue`): the gauge `idem_retries_overdue`, and a warning while
/// there are any. Looks every half of `after`, between 1 s and a minute.
pub(super) async fn watch_overdue<H: Handler>(
    store: Store,
    after: Duration,
    shutdown: CancellationToken,
) {
    let every = (after / 2).clamp(Duration::from_secs(1), Duration::from_secs(60));
    loop {
        match store.overdue(H::OPERATION, after).await {
            Ok(records) => {
                crate::metrics::retries_overdue(H::OPERATION, records);
                if records > 0 {
                    warn!(
                        operation = H::OPERATION,
                        records,
                        after_s = after.as_secs(),
                        "retries overdue: retryable or pending records whose next delivery has not come; \
                         a retry copy may have been lost (classic retry queues dead-letter at most once): \
                         idem ops list --status failed (or pending)"
                    );
                }
            }
            Err(error) => {
                tracing::debug!(error = %crate::text::error_line(&error), "overdue retries not counted")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}
