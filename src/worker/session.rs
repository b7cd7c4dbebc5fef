//! One broker connection of a running worker: declare the topology, consume, hand
//! each delivery to its own task, and on shutdown stop consuming and drain.

use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures_util::StreamExt;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

use super::acks::Acks;
use super::follow_ups::FollowUpChannel;
use super::settle::Links;
use super::{Shared, WorkerError, drain, execute};
use crate::handler::Handler;
use crate::metrics::BrokerHealth;
use crate::topology::{self, Topology};

/// The broker side of a running worker: one connection at a time.
pub(super) struct Session<H> {
    pub(super) shared: Arc<Shared<H>>,
    pub(super) topology: Topology,
    pub(super) broker: BrokerHealth,
}

impl<H: Handler> Session<H> {
    pub(super) fn reconnect_backoff(&self) -> impl Iterator<Item = Duration> + use<H> {
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(self.shared.config.max_reconnect_delay)
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// Connects, declares the topology and starts consuming.
    async fn open(&self) -> Result<Open, WorkerError> {
        self.try_open()
            .await
            .map_err(|error| WorkerError::opening(error, &self.shared.config.queue))
    }

    async fn try_open(&self) -> Result<Open, lapin::Error> {
        let config = &self.shared.config;
        let connection = topology::connect(&config.amqp_url, &config.name).await?;
        let consume = connection.create_channel().await?;
        consume
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .await?;
        self.topology.declare(&consume).await?;
        let publish = connection.create_channel().await?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let consumer = consume
            .basic_consume(
                config.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Open {
            connection,
            consume,
            publish,
            consumer,
        })
    }

    /// One broker connection: declare, consume, dispatch. Returns `Ok` on shutdown.
    pub(super) async fn run(
        &self,
        shutdown: &CancellationToken,
        tasks: &TaskTracker,
        permits: &Arc<Semaphore>,
    ) -> Result<(), SessionError> {
        let config = &self.shared.config;
        let Open {
            connection,
            consume,
            publish,
            mut consumer,
        } = self.open().await.map_err(|error| SessionError {
            connected: false,
            error,
        })?;
        let frame_max = connection.configuration().frame_max();
        let connection = Arc::new(connection);
        let acks = Acks::spawn(consume.clone(), config.batch_linger);
        let links = Links {
            publish: publish.clone(),
            follow_ups: Arc::new(FollowUpChannel::new(connection.clone())),
            acks: acks.clone(),
            frame_max,
        };
        info!(queue = %config.queue, prefetch = config.prefetch, concurrency = config.concurrency, "consuming");
        self.broker.set(true);

        let lost = |error: WorkerError| SessionError {
            connected: true,
            error,
        };
        loop {
            let permit = tokio::select! {
                permit = permits.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => break,
                },
                _ = shutdown.cancelled() => break,
            };
            let next = tokio::select! {
                next = consumer.next() => next,
                _ = shutdown.cancelled() => break,
            };
            match next {
                Some(Ok(delivery)) => {
                    acks.delivered(delivery.delivery_tag);
                    let shared = self.shared.clone();
                    let links = links.clone();
                    tasks.spawn(async move {
                        execute::process(&shared, &links, delivery).await;
                        drop(permit);
                    });
                }
                Some(Err(error)) => return Err(lost(error.into())),
                None => return Err(lost(WorkerError::ConsumerCancelled)),
            }
        }

        info!("shutting down: no new deliveries, waiting for handlers in flight");
        let _ = consume
            .basic_cancel(consumer.tag(), BasicCancelOptions::default())
            .await;
        drain(tasks, config.shutdown_timeout).await;
        acks.flush().await;
        // Deliveries prefetched but never started are requeued by the broker on close.
        let _ = consume.close(200, "shutdown".into()).await;
        let _ = publish.close(200, "shutdown".into()).await;
        let _ = connection.close(200, "shutdown".into()).await;
        Ok(())
    }
}

/// A connection's channels and its consumer.
struct Open {
    connection: lapin::Connection,
    /// Consumes and acks (prefetch applies here).
    consume: lapin::Channel,
    /// Publishes retries and dead letters, in confirm mode.
    publish: lapin::Channel,
    consumer: lapin::Consumer,
}

/// Why a session ended other than by shutdown.
pub(super) struct SessionError {
    /// Whether the session got as far as consuming (then the backoff starts afresh).
    pub(super) connected: bool,
    pub(super) error: WorkerError,
}
