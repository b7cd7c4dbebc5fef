//! Batching: requests that arrive together share one statement (and one commit).
//!
//! A batch closes when it is full or when the linger has passed since its first
//! request, so a lone request waits about the linger and no more; a request submitted
//! `now` closes its batch without the linger. Up to `in_flight`
//! batches run at once: a request waits for an earlier batch's round trip only when all
//! of them are busy, and then the next batch takes everything that arrived meanwhile.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot};

use super::Failure;
use crate::fault::Fault;
use crate::store::StoreError;

type Reply<T> = oneshot::Sender<Result<T, Arc<StoreError>>>;

/// A request, where its answer goes, and whether it closes its batch without the linger.
type Queued<Req, Resp> = (Req, Reply<Resp>, bool);

/// The sending side of a batching loop; cheap to clone.
pub(crate) struct Batcher<Req, Resp> {
    tx: mpsc::Sender<Queued<Req, Resp>>,
}

impl<Req, Resp> Clone for Batcher<Req, Resp> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
        }
    }
}

impl<Req: Clone + Send + Sync + 'static, Resp: Send + 'static> Batcher<Req, Resp> {
    /// Spawns the loop: `run` gets up to `max` requests and answers each, in order.
    /// The loop ends when every `Batcher` handle is dropped.
    pub(crate) fn spawn<F, Fut>(max: usize, linger: Duration, in_flight: usize, run: F) -> Self
    where
        F: Fn(Arc<[Req]>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<Resp>, StoreError>> + Send + 'static,
    {
        let max = max.max(1);
        let slots = Arc::new(Semaphore::new(in_flight.max(1)));
        let run = Arc::new(run);
        let (tx, mut rx) = mpsc::channel::<Queued<Req, Resp>>(max * 4);
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let lingers = |queued: &Queued<Req, Resp>| match queued.2 {
                    true => Duration::ZERO,
                    false => linger,
                };
                let mut deadline = tokio::time::Instant::now() + lingers(&first);
                // A slot first, then the batch: while every slot is busy, requests pile
                // up in the channel, and the next batch takes them all at once instead
                // of leaving as a handful closed by the linger.
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let mut batch = vec![first];
                while batch.len() < max {
                    let item = match rx.try_recv() {
                        Ok(item) => item,
                        Err(mpsc::error::TryRecvError::Disconnected) => break,
                        Err(mpsc::error::TryRecvError::Empty) => {
                            match tokio::time::timeout_at(deadline, rx.recv()).await {
                                Ok(Some(item)) => item,
                                _ => break,
                            }
                        }
                    };
                    deadline = deadline.min(tokio::time::Instant::now() + lingers(&item));
                    batch.push(item);
                }
                let (requests, replies): (Vec<Req>, Vec<Reply<Resp>>) = batch
                    .into_iter()
                    .map(|(req, reply, _)| (req, reply))
                    .unzip();
                let run = run.clone();
                tokio::spawn(async move {
                    answer(&*run, requests.into(), replies).await;
                    drop(slot);
                });
            }
        });
        Self { tx }
    }

    /// Submits one request and waits for the store's answer to it. The outer error
    /// says that no answer will come: the batching loop is gone (it panicked), or a
    /// batch answered fewer requests than it was given (a bug either way).
    pub(crate) async fn call(&self, request: Req) -> Result<Result<Resp, StoreError>, Failure> {
        self.submit(request, false).await
    }

    /// As [`Batcher::call`]; with `now`, the batch it joins leaves without waiting for
    /// the linger: for a request that something waits on one at a time (the next turn
    /// of an entity, handed over), where a linger would be paid at every step.
    pub(crate) async fn submit(
        &self,
        request: Req,
        now: bool,
    ) -> Result<Result<Resp, StoreError>, Failure> {
        let (reply, answer) = oneshot::channel();
        if self.tx.send((request, reply, now)).await.is_err() {
            return Err(Failure::Internal("the batching loop stopped"));
        }
        match answer.await {
            Ok(result) => Ok(result.map_err(StoreError::Batch)),
            Err(_) => Err(Failure::Internal("a batch gave a request no answer")),
        }
    }
}

/// Runs one batch and answers each request. A batch that fails for anything but an
/// outage is run again one request at a time, so that one request the database
/// refuses (a hostile message) fails alone instead of failing its neighbours with it;
/// during an outage every request gets the error at once.
async fn answer<Req, Resp, F, Fut>(run: &F, requests: Arc<[Req]>, replies: Vec<Reply<Resp>>)
where
    Req: Clone,
    F: Fn(Arc<[Req]>) -> Fut,
    Fut: Future<Output = Result<Vec<Resp>, StoreError>>,
{
    let error = match run(requests.clone()).await {
        Ok(responses) => {
            for (reply, response) in replies.into_iter().zip(responses) {
                let _ = reply.send(Ok(response));
            }
            return;
        }
        Err(error) => Arc::new(error),
    };
    if requests.len() == 1 || error.fault() == Fault::Outage {
        for reply in replies {
            let _ = reply.send(Err(error.clone()));
        }
        return;
    }
    for (request, reply) in requests.iter().zip(replies) {
        let alone: Arc<[Req]> = Arc::from([request.clone()]);
        match run(alone).await {
            Ok(mut responses) => {
                // No response for the request: its caller hears that none will come.
                if let Some(response) = responses.pop() {
                    let _ = reply.send(Ok(response));
                }
            }
            Err(error) => drop(reply.send(Err(Arc::new(error)))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// A batcher with a linger no test waits out, that records the size of each batch.
    fn lingering(sizes: Arc<Mutex<Vec<usize>>>) -> Batcher<u32, u32> {
        Batcher::spawn(
            16,
            Duration::from_secs(600),
            1,
            move |requests: Arc<[u32]>| {
                let sizes = sizes.clone();
                async move {
                    sizes.lock().unwrap().push(requests.len());
                    Ok(requests.to_vec())
                }
            },
        )
    }

    #[tokio::test]
    async fn a_request_submitted_now_leaves_without_the_linger() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let batcher = lingering(sizes.clone());
        let alone = tokio::time::timeout(Duration::from_secs(10), batcher.submit(7, true))
            .await
            .expect("answered without waiting for the linger")
            .expect("the loop answers")
            .expect("the batch ran");
        assert_eq!(alone, 7);
        assert_eq!(*sizes.lock().unwrap(), vec![1]);
    }

    #[tokio::test]
    async fn a_request_submitted_now_takes_a_lingering_batch_with_it() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let batcher = lingering(sizes.clone());
        let waiting = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.call(1).await }
        });
        // The first request lingers: no answer while nothing closes its batch.
        let early = tokio::time::timeout(Duration::from_millis(200), async {
            while sizes.lock().unwrap().is_empty() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(early.is_err(), "a batch left before its linger");
        let now = tokio::time::timeout(Duration::from_secs(10), batcher.submit(2, true))
            .await
            .expect("answered without waiting for the linger")
            .expect("the loop answers")
            .expect("the batch ran");
        let lingered = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("the lingering request left with it")
            .expect("the task ran")
            .expect("the loop answers")
            .expect("the batch ran");
        assert_eq!((lingered, now), (1, 2));
        assert_eq!(*sizes.lock().unwrap(), vec![2], "one batch took both");
    }
}
