//! Follow-up messages after their operation's commit (docs/DESIGN.md, "Follow-up
//! messages"): the worker publishes what a run staged at once, on a channel of its own,
//! and leaves what it could not to the outbox relay.

use std::collections::HashMap;
use std::sync::Arc;

use lapin::options::ConfirmSelectOptions;
use sqlx::PgPool;
use tokio::sync::Notify;
use tracing::{debug, warn};

use super::batch::Batcher;
use super::{Failure, WorkerConfig, batched};
use crate::failpoint;
use crate::outbox::{self, OutboxConfig, OutboxRow};
use crate::store::Store;

/// The in-process dispatch of follow-up messages: the takes and the marks of operations
/// that commit together share a statement.
pub(super) struct FollowUps {
    /// Each request: the rows one operation staged; each answer: those it took.
    takes: Batcher<Vec<i64>, Vec<OutboxRow>>,
    /// Each request: the rows one operation published.
    marks: Batcher<Vec<i64>, ()>,
    /// Wakes this process's relay when a follow-up was not published after its commit.
    wake: Arc<Notify>,
    pool: PgPool,
    config: OutboxConfig,
}

impl FollowUps {
    pub(super) fn new(store: &Store, config: &WorkerConfig, wake: Arc<Notify>) -> Self {
        let lease = config.outbox.lease;
        let retention = store.config().retention;
        let takes = batched(
            store,
            config,
            move |store, requests: Arc<[Vec<i64>]>| async move {
                let ids: Vec<i64> = requests.iter().flatten().copied().collect();
                let rows = outbox::take_staged(store.pool(), &ids, lease, store.keys()).await?;
                let mut taken: HashMap<i64, OutboxRow> =
                    rows.into_iter().map(|r| (r.id, r)).collect();
                Ok(requests
                    .iter()
                    .map(|ids| ids.iter().filter_map(|id| taken.remove(id)).collect())
                    .collect())
            },
        );
        let marks = batched(
            store,
            config,
            move |store, requests: Arc<[Vec<i64>]>| async move {
                let ids: Vec<i64> = requests.iter().flatten().copied().collect();
                outbox::mark_dispatched(store.pool(), &ids, retention).await?;
                Ok(vec![(); requests.len()])
            },
        );
        Self {
            takes,
            marks,
            wake,
            pool: store.pool().clone(),
            config: config.outbox.clone(),
        }
    }

    /// After the commit: publishes the follow-up messages a run staged (`ids`) on
    /// `channel`. What it could not publish stays in the outbox for the relay, which it
    /// wakes; the delivery's outcome stands either way.
    pub(super) async fn send(&self, channel: Option<&FollowUpChannel>, ids: Vec<i64>) {
        // Without a channel (a test's run) they wait in the outbox, for the relay.
        let Some(channel) = channel else { return };
        if ids.is_empty() {
            return;
        }
        failpoint::hit("before-dispatch");
        match self.dispatch(channel, &ids).await {
            Ok(published) if published == ids.len() => {}
            Ok(published) => {
                debug!(
                    staged = ids.len(),
                    published, "follow-ups left to the relay"
                );
                self.wake.notify_one();
            }
            Err(error) => {
                warn!(error = %crate::text::error_line(&error), "follow-ups left to the relay");
                self.wake.notify_one();
            }
        }
    }

    /// Takes the rows `ids` (unless a relay was first), publishes them in order and
    /// marks them; returns how many went out.
    async fn dispatch(&self, channel: &FollowUpChannel, ids: &[i64]) -> Result<usize, Failure> {
        let channel = channel.get().await?;
        let rows = self.takes.call(ids.to_vec()).await??;
        // Some taken by a relay: the rest may have to wait for them.
        let check = rows.len() < ids.len();
        let published = outbox::publish(&self.pool, &channel, rows, check, &self.config).await;
        let n = published.ids.len();
        if n > 0 {
            self.marks.call(published.ids).await??;
        }
        Ok(n)
    }
}

/// The channel follow-up messages are published on, opened on first use: a channel of
/// its own, because the broker answers some publishes (to an exchange that does not
/// exist) by closing the channel, and the retries' and dead letters' must not go with
/// it. A closed one is opened again on the next use.
pub(super) struct FollowUpChannel {
    connection: Arc<lapin::Connection>,
    channel: tokio::sync::Mutex<Option<lapin::Channel>>,
}

impl FollowUpChannel {
    pub(super) fn new(connection: Arc<lapin::Connection>) -> Self {
        Self {
            connection,
            channel: tokio::sync::Mutex::new(None),
        }
    }

    /// The channel, in confirm mode; a new one if the last was closed.
    pub(super) async fn get(&self) -> Result<lapin::Channel, lapin::Error> {
        let mut slot = self.channel.lock().await;
        if let Some(channel) = slot.as_ref()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        let channel = self.connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        *slot = Some(channel.clone());
        Ok(channel)
    }
}
