//! Acknowledgements of one channel, coalesced.
//!
//! Every delivery is registered when it arrives; when its outcome is committed its ack
//! is requested. Requested acks are sent within about a millisecond: the longest run of
//! decided deliveries starting at the oldest unacked one goes as one `basic.ack` with
//! `multiple`, the others one by one. The broker then handles a frame per run instead of
//! a frame per message, and no ack waits for a slower, older delivery.

use std::collections::BTreeSet;
use std::time::Duration;

use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use tokio::sync::{mpsc, oneshot};
use tracing::debug;

enum Command {
    Delivered(u64),
    Ack(u64),
    Nack { tag: u64, requeue: bool },
    Flush(oneshot::Sender<()>),
}

/// The handle tasks use; cheap to clone. Sends never block.
#[derive(Clone)]
pub(crate) struct Acks {
    tx: mpsc::UnboundedSender<Command>,
}

/// Most requested acks held before a flush.
const MAX_HELD: usize = 256;

impl Acks {
    /// Starts the coalescing loop for `channel`; it ends when every handle is dropped.
    pub(crate) fn spawn(channel: Channel, linger: Duration) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(channel, rx, linger));
        Self { tx }
    }

    /// Registers a delivery as it arrives, before any ack of it can be requested.
    pub(crate) fn delivered(&self, tag: u64) {
        let _ = self.tx.send(Command::Delivered(tag));
    }

    /// Requests the ack of a delivery whose outcome is committed.
    pub(crate) fn ack(&self, tag: u64) {
        let _ = self.tx.send(Command::Ack(tag));
    }

    /// Rejects a delivery, requeued or not (held acks are sent first).
    pub(crate) fn nack(&self, tag: u64, requeue: bool) {
        let _ = self.tx.send(Command::Nack { tag, requeue });
    }

    /// Sends every held ack; returns once they are written.
    pub(crate) async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Command::Flush(done)).is_ok() {
            let _ = wait.await;
        }
    }
}

async fn run(channel: Channel, mut rx: mpsc::UnboundedReceiver<Command>, linger: Duration) {
    // Delivered and not yet acked or nacked, and of those, the ones decided.
    let mut outstanding = BTreeSet::new();
    let mut decided = BTreeSet::new();
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let command = match deadline {
            Some(at) => match tokio::time::timeout_at(at, rx.recv()).await {
                Ok(command) => command,
                Err(_) => {
                    send(&channel, &mut outstanding, &mut decided).await;
                    deadline = None;
                    continue;
                }
            },
            None => rx.recv().await,
        };
        let Some(command) = command else {
            send(&channel, &mut outstanding, &mut decided).await;
            return;
        };
        match command {
            Command::Delivered(tag) => {
                outstanding.insert(tag);
            }
            Command::Ack(tag) => {
                decided.insert(tag);
                deadline.get_or_insert_with(|| tokio::time::Instant::now() + linger);
                if decided.len() >= MAX_HELD {
                    send(&channel, &mut outstanding, &mut decided).await;
                    deadline = None;
                }
            }
            Command::Nack { tag, requeue } => {
                send(&channel, &mut outstanding, &mut decided).await;
                deadline = None;
                outstanding.remove(&tag);
                let options = BasicNackOptions {
                    requeue,
                    multiple: false,
                };
                if let Err(error) = channel.basic_nack(tag, options).await {
                    debug!(error = %error, "nack failed; the broker redelivers on reconnect");
                }
            }
            Command::Flush(done) => {
                send(&channel, &mut outstanding, &mut decided).await;
                deadline = None;
                let _ = done.send(());
            }
        }
    }
}

/// Acks every decided delivery: the run from the oldest outstanding one with one
/// `multiple` ack, the rest one by one.
async fn send(channel: &Channel, outstanding: &mut BTreeSet<u64>, decided: &mut BTreeSet<u64>) {
    let (run_end, singles) = take_acks(outstanding, decided);
    let acks = run_end
        .map(|end| (end, true))
        .into_iter()
        .chain(singles.into_iter().map(|tag| (tag, false)));
    for (tag, multiple) in acks {
        if let Err(error) = channel.basic_ack(tag, BasicAckOptions { multiple }).await {
            debug!(error = %error, "ack failed; the broker redelivers on reconnect");
        }
    }
}

/// Splits the decided deliveries into the end of the run that starts at the oldest
/// outstanding one (to ack with `multiple`) and the rest (to ack one by one), and
/// forgets all of them.
fn take_acks(
    outstanding: &mut BTreeSet<u64>,
    decided: &mut BTreeSet<u64>,
) -> (Option<u64>, Vec<u64>) {
    let run_end = outstanding
        .iter()
        .take_while(|tag| decided.contains(tag))
        .last()
        .copied();
    if let Some(end) = run_end {
        *outstanding = outstanding.split_off(&(end + 1));
        *decided = decided.split_off(&(end + 1));
    }
    let singles: Vec<u64> = std::mem::take(decided).into_iter().collect();
    for tag in &singles {
        outstanding.remove(tag);
    }
    (run_end, singles)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(outstanding: &[u64], decided: &[u64]) -> (Option<u64>, Vec<u64>, Vec<u64>) {
        let mut outstanding: BTreeSet<u64> = outstanding.iter().copied().collect();
        let mut decided: BTreeSet<u64> = decided.iter().copied().collect();
        let (end, singles) = take_acks(&mut outstanding, &mut decided);
        assert!(decided.is_empty());
        (end, singles, outstanding.into_iter().collect())
    }

    #[test]
    fn a_run_from_the_oldest_goes_as_one_multiple_ack() {
        assert_eq!(plan(&[1, 2, 3, 4], &[1, 2, 3]), (Some(3), vec![], vec![4]));
        // The oldest is still running: everything else one by one, nothing skipped.
        assert_eq!(plan(&[1, 2, 3, 4], &[2, 4]), (None, vec![2, 4], vec![1, 3]));
        assert_eq!(
            plan(&[5, 6, 9, 10], &[5, 6, 10]),
            (Some(6), vec![10], vec![9])
        );
        assert_eq!(plan(&[1], &[]), (None, vec![], vec![1]));
    }
}
