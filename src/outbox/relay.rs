//! The relay: in every worker process, publishes the follow-up messages that a crash or
//! a failed publish left in the outbox.
//!
//! It listens on the channel `idem_outbox`, which the outbox's insert trigger notifies
//! when the staging transaction commits. A notification means rows become due after the
//! handoff (the committing worker's head start), so the relay waits that long, then
//! takes what is due; without notifications (the listener is down, or the database sits
//! behind a pooler that cannot `LISTEN`) it still looks every [`OutboxConfig::poll`].
//! Rows are taken with `FOR UPDATE SKIP LOCKED` and held under a lease, so that relays
//! in several processes never publish the same row at the same moment.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::Channel;
use lapin::options::ConfirmSelectOptions;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::OutboxConfig;
use super::publish::{mark_dispatched, publish};
use super::table;
use crate::connector::Connector;
use crate::metrics;
use crate::protect::Keys;

/// The `NOTIFY` channel of the outbox's insert trigger.
pub(crate) const CHANNEL: &str = "idem_outbox";

/// The shortest sleep of a relay that has rows due it could not publish (the broker
/// down, rows another publisher holds): a delayed row goes out at most this long after
/// it is due, and a relay with nothing to do asks the database this often at most.
const DUE_CHECK_MIN: Duration = Duration::from_millis(250);

/// How often the relay refreshes the backlog metrics.
const STATS_EVERY: Duration = Duration::from_secs(5);

/// A relay: publishes the follow-up messages that a crash or a failed publish left in
/// the outbox. Every [`crate::Worker`] runs one; run one on its own in a process that
/// stages follow-ups without consuming a queue, so that what it stages is published
/// even when nothing else runs.
pub struct Relay {
    /// The database (its outbox).
    pool: PgPool,
    /// The broker's URL (or comma-separated node list).
    amqp_url: String,
    /// The connection name shown by the broker.
    name: String,
    /// Timing and batch size.
    config: OutboxConfig,
    /// How long dispatched rows are kept.
    retention: Duration,
    /// Woken by this process when its own publish failed, so it does not wait for the
    /// next poll.
    wake: Arc<Notify>,
    /// The connection it publishes on when it shares one (a service's publishing
    /// connection); none: its own, named `name`.
    shared: Option<Arc<Connector>>,
    /// Where its `LISTEN` connection opens; none: where the pool connects now.
    session: Option<PgConnectOptions>,
    /// The keys that open sealed bodies (`StoreConfig::keys`).
    keys: Option<Keys>,
}

impl Relay {
    /// A relay of the outbox in `pool`'s database, publishing to the broker at
    /// `amqp_url`, with `config`'s timing; dispatched rows are kept for `retention`
    /// (the store's: `StoreConfig::retention`). A relay of sealed follow-ups needs the
    /// store's keys too ([`Relay::opening_with`]); a worker's relay is given them.
    pub fn new(pool: PgPool, amqp_url: &str, config: OutboxConfig, retention: Duration) -> Self {
        Self {
            pool,
            amqp_url: amqp_url.to_owned(),
            name: "idem-relay".into(),
            config,
            retention,
            wake: Arc::new(Notify::new()),
            shared: None,
            session: None,
            keys: None,
        }
    }

    /// Opens sealed follow-up bodies with `keys` (the store's: `StoreConfig::keys`).
    pub fn opening_with(mut self, keys: Option<Keys>) -> Self {
        self.keys = keys;
        self
    }

    /// Opens its `LISTEN` connection with `options` (a session of its own, which a
    /// transaction pooler cannot keep: `StoreConfig::session`) instead of the pool's.
    pub fn listening_on(mut self, options: Option<PgConnectOptions>) -> Self {
        self.session = options;
        self
    }

    /// The connection name the broker shows (`idem-relay` by default).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Wakes the relay from outside: a publish in this process failed.
    pub(crate) fn waking_on(mut self, wake: Arc<Notify>) -> Self {
        self.wake = wake;
        self
    }

    /// Publishes on `connector`'s connection, shared with others (a service's queues
    /// publish on it too), instead of one of its own; it never closes it.
    pub(crate) fn sharing(mut self, connector: Arc<Connector>) -> Self {
        self.shared = Some(connector);
        self
    }

    /// Runs until `shutdown`, reconnecting to the broker and the listener when they drop.
    /// While the broker is unreachable it goes on listening and refreshing the backlog
    /// metrics, and tries the broker again with backoff.
    pub async fn run(self, shutdown: CancellationToken) {
        let (connector, owned) = match &self.shared {
            Some(shared) => (shared.clone(), false),
            None => (Arc::new(Connector::new(&self.amqp_url, &self.name)), true),
        };
        let mut listener = None;
        // The channel it publishes on, and the connection it was opened on (dropped
        // to give up on it: a shared connection is its owner's to close).
        let mut broker: Option<(Arc<lapin::Connection>, Channel)> = None;
        let mut stats_at = Instant::now() - STATS_EVERY;
        let mut broker_backoff = Duration::from_millis(200);
        let mut broker_retry_at = Instant::now();
        // The pool's options it listens with: the pool moved to another host of a host
        // list when they change, and a `LISTEN` left on the old one hears nothing.
        let mut listening_with = self.pool.connect_options();
        while !shutdown.is_cancelled() {
            let now = self.pool.connect_options();
            if self.session.is_none() && !Arc::ptr_eq(&now, &listening_with) {
                listener = None;
                listening_with = now;
            }
            if listener.is_none() {
                listener = tokio::select! {
                    listening = self.listen() => listening,
                    _ = shutdown.cancelled() => break,
                };
            }
            // A channel the broker closed (a publish to a missing exchange) on a live
            // connection: a new channel, not a new connection.
            if let Some((connection, channel)) = broker.as_mut()
                && connection.status().connected()
                && !channel.status().connected()
            {
                match Self::confirming(connection).await {
                    Ok(fresh) => *channel = fresh,
                    Err(error) => {
                        warn!(error = %crate::text::error_line(&error), "outbox relay: cannot reopen its channel");
                        broker = None;
                        // Its own connection is replaced; a shared one is its owner's.
                        if owned {
                            connector.close().await;
                        }
                    }
                }
            }
            let up = broker
                .as_ref()
                .is_some_and(|(c, ch)| c.status().connected() && ch.status().connected());
            if !up && Instant::now() >= broker_retry_at {
                let opened = tokio::select! {
                    opened = Self::open(&connector) => opened,
                    _ = shutdown.cancelled() => break,
                };
                match opened {
                    Ok(open) => {
                        broker = Some(open);
                        broker_backoff = Duration::from_millis(200);
                    }
                    Err(error) => {
                        warn!(error = %crate::text::error_line(&error), retry_in_ms = broker_backoff.as_millis() as u64, "outbox relay: broker unreachable");
                        broker = None;
                        broker_retry_at = Instant::now() + broker_backoff;
                        broker_backoff = (broker_backoff * 2).min(Duration::from_secs(5));
                    }
                }
            }
            let publishing = match &broker {
                Some((_, publish)) if publish.status().connected() => {
                    self.drain(publish, &shutdown).await;
                    true
                }
                _ => false,
            };
            if stats_at.elapsed() >= STATS_EVERY {
                stats_at = Instant::now();
                match table::stats(&self.pool).await {
                    Ok(stats) => metrics::outbox_backlog(
                        stats.undispatched,
                        stats.failing,
                        stats.oldest_age_s,
                    ),
                    Err(error) => debug!(error = %crate::text::error_line(&error), "outbox stats"),
                }
            }
            self.wait(&mut listener, &shutdown, publishing).await;
        }
        if let Some((_, publish)) = broker {
            let close = publish.close(200, "shutdown".into());
            let _ = tokio::time::timeout(Duration::from_secs(1), close).await;
        }
        if owned {
            connector.close().await;
        }
    }

    async fn listen(&self) -> Option<PgListener> {
        // A connection of its own, named for pg_stat_activity after the pool's
        // (`orders_worker relay`): it stays open for as long as the relay runs.
        let options = match &self.session {
            Some(options) => options.clone(),
            None => (*self.pool.connect_options()).clone(),
        };
        let name = format!("{} relay", options.get_application_name().unwrap_or("idem"));
        let listen_pool = PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(options.application_name(&name));
        let listening = async {
            let mut listener = PgListener::connect_with(&listen_pool).await?;
            listener.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match listening.await {
            Ok(listener) => Some(listener),
            Err(error) => {
                warn!(error = %crate::text::error_line(&error), "outbox relay: cannot LISTEN; polling every {} ms", self.config.poll.as_millis());
                None
            }
        }
    }

    async fn open(
        connector: &Connector,
    ) -> Result<(Arc<lapin::Connection>, Channel), lapin::Error> {
        let connection = connector.get().await?;
        let channel = Self::confirming(&connection).await?;
        info!("outbox relay connected");
        Ok((connection, channel))
    }

    /// A new channel on `connection`, in confirm mode.
    async fn confirming(connection: &lapin::Connection) -> Result<Channel, lapin::Error> {
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(channel)
    }

    /// Publishes whatever is due, batch after batch, until a batch is not full or
    /// publishes nothing.
    async fn drain(&self, channel: &Channel, shutdown: &CancellationToken) {
        while !shutdown.is_cancelled() {
            let rows = match table::take_due(
                &self.pool,
                self.config.batch,
                self.config.lease,
                self.keys.as_ref(),
            )
            .await
            {
                Ok(rows) => rows,
                Err(error) => {
                    warn!(error = %crate::text::error_line(&error), "outbox relay: cannot take due messages");
                    return;
                }
            };
            let taken = rows.len();
            if taken == 0 {
                return;
            }
            let published = publish(&self.pool, channel, rows, false, &self.config).await;
            if let Err(error) = mark_dispatched(&self.pool, &published.ids, self.retention).await {
                warn!(error = %crate::text::error_line(&error), "outbox relay: cannot mark what it published");
                return;
            }
            if !published.ids.is_empty() || published.failed > 0 {
                info!(
                    published = published.ids.len(),
                    failed = published.failed,
                    waiting = published.waiting,
                    "outbox relay published what was left behind"
                );
            }
            if (taken as i64) < self.config.batch || published.ids.is_empty() {
                return;
            }
        }
    }

    /// Sleeps until a notification's handoff has passed, this process's wake-up, the
    /// next poll (sooner when a delayed row comes due before it, but never sooner than
    /// [`DUE_CHECK_MIN`], and only while it has a broker to publish on), or shutdown.
    async fn wait(
        &self,
        listener: &mut Option<PgListener>,
        shutdown: &CancellationToken,
        publishing: bool,
    ) {
        let next_due = if publishing {
            match table::until_next_due(&self.pool).await {
                Ok(next) => next,
                Err(error) => {
                    debug!(error = %crate::text::error_line(&error), "outbox: next due row");
                    None
                }
            }
        } else {
            None
        };
        let poll = next_due.map_or(self.config.poll, |due| {
            due.clamp(DUE_CHECK_MIN, self.config.poll.max(DUE_CHECK_MIN))
        });
        let poll = tokio::time::sleep(poll);
        tokio::pin!(poll);
        let notified = async {
            match listener.as_mut() {
                Some(l) => l.recv().await.map(|_| ()),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            received = notified => {
                if let Err(error) = received {
                    warn!(error = %crate::text::error_line(&error), "outbox relay: listener lost; polling until it is back");
                    *listener = None;
                    return;
                }
                // Rows become due after the handoff: wait it out, and let the
                // notifications of other commits meanwhile fold into this one.
                let due = tokio::time::sleep(self.config.handoff + Duration::from_millis(5));
                tokio::pin!(due);
                loop {
                    let next = async {
                        match listener.as_mut() {
                            Some(l) => l.recv().await.map(|_| ()),
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        _ = &mut due => return,
                        _ = shutdown.cancelled() => return,
                        received = next => if received.is_err() {
                            *listener = None;
                        },
                    }
                }
            }
            _ = self.wake.notified() => {}
            _ = &mut poll => {}
            _ = shutdown.cancelled() => {}
        }
    }
}
