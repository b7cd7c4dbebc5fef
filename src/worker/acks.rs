//! Acknowledgements of one channel, coalesced.
//!
//! Every delivery is registered when it arrives; when its outcome is committed its ack
//! is requested. Requested acks are sent once the requests pause (nothing queued, even
//! after letting the other ready tasks run once), and never later than the linger after
//! the first of them: a completion batch's deliveries ask together, so they go together
//! as soon as the last one has asked. The longest run of decided deliveries starting at
//! the oldest unacked one goes as one `basic.ack` with `multiple`. A delivery decided
//! before an older one waits for it up to [`HOLD`], then goes on its own: the older one
//! is usually decided within a few milliseconds, and its run then covers both. The
//! broker handles a frame per run instead of a frame per message, and RabbitMQ (3.10)
//! walks a channel's unacked deliveries for every ack that is not of the oldest.
//!
//! On a queue of owned order (a single active consumer) most deliveries are parked and
//! decided within a few milliseconds while the older ones wait for a run: once one was
//! parked, acks wait longer there ([`Hold::owned`]).

use std::collections::BTreeSet;
use std::time::Duration;

use futures_util::future::join_all;
use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::warn;

enum Command {
    Delivered(u64),
    Ack { tag: u64, parked: bool },
    Nack { tag: u64, requeue: bool },
    Flush(oneshot::Sender<()>),
}

/// The handle tasks use; cheap to clone. Sends never block.
#[derive(Clone)]
pub(crate) struct Acks {
    tx: mpsc::UnboundedSender<Command>,
}

impl Acks {
    /// Starts the coalescing loop for `channel`; it ends when every handle is dropped.
    pub(crate) fn spawn(channel: Channel, linger: Duration, hold: Hold) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(channel, rx, linger, hold));
        Self { tx }
    }

    /// Registers a delivery as it arrives, before any ack of it can be requested.
    pub(crate) fn delivered(&self, tag: u64) {
        let _ = self.tx.send(Command::Delivered(tag));
    }

    /// Requests the ack of a delivery whose outcome is committed.
    pub(crate) fn ack(&self, tag: u64) {
        let _ = self.tx.send(Command::Ack { tag, parked: false });
    }

    /// Requests the ack of a delivery kept for its turn (outcome `waiting`): on a queue
    /// of owned order, from then on acks wait longer for the older runs
    /// ([`Hold::owned`]).
    pub(crate) fn ack_parked(&self, tag: u64) {
        let _ = self.tx.send(Command::Ack { tag, parked: true });
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

/// How long a decided delivery's ack waits for older deliveries to be decided before it
/// goes on its own, on a queue without owned order, and on one with it until it parks
/// a delivery ([`Hold::owned`]). The bench
/// (`examples/bench.rs`, `idem_ledger`: leased, handlers completing out of order), six
/// pairs: 3,670–3,919 msgs/s against 3,535–3,773 with such acks sent at once,
/// RabbitMQ's CPU 26–44 µs a message against 46–54 (docs/PERFORMANCE.md).
const HOLD: Duration = Duration::from_millis(10);

/// How long and how many decided deliveries wait for an older one before they go one by
/// one, and the channel's prefetch: once the deliveries taken and not acked fill it, the
/// broker sends nothing more, so the decided ones wait no more than [`HOLD`]. (A queue
/// without owned order takes deliveries up to its concurrency, usually below the
/// prefetch: there the time and the count decide.)
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hold {
    time: Duration,
    most: usize,
    /// The prefetch (0: unknown, never full).
    window: usize,
}

impl Hold {
    /// The hold of a queue whose deliveries are decided about as fast as one another:
    /// [`HOLD`], and at most 256 of them.
    pub(crate) fn plain(prefetch: u16) -> Self {
        Self {
            time: HOLD,
            most: 256,
            window: usize::from(prefetch),
        }
    }

    /// The hold of a queue with a single active consumer (owned order) and `prefetch`:
    /// its early deliveries are parked (decided) in a few milliseconds while the older
    /// ones wait for their runs, and each of their acks sent alone walked every older
    /// unacked delivery. 100 ms once the ack of a parked delivery was asked for on the
    /// channel (before, and on such a queue without order, [`HOLD`]: there the longer
    /// hold cost leased workers 8 % of their pace, medians of 6 pairs,
    /// docs/PERFORMANCE.md), and up to three quarters of the prefetch. The ordering
    /// bench (transactional, with the kill, 9 pairs each, interleaved): RabbitMQ's CPU
    /// 69 µs an ordered entry against 94 with the plain hold (medians; unordered
    /// 64–66), and 3,346 ordered msgs/s against 2,973 (docs/PERFORMANCE.md).
    pub(crate) fn owned(prefetch: u16) -> Self {
        Self {
            time: Duration::from_millis(100),
            most: usize::from(prefetch) * 3 / 4,
            window: usize::from(prefetch),
        }
    }
}

/// One channel's deliveries not yet acked or nacked, those of them decided, and since
/// when a decided one has been waiting for an older one.
struct Pending {
    outstanding: BTreeSet<u64>,
    decided: BTreeSet<u64>,
    /// Whether the ack of a delivery kept for its turn was asked for on this channel:
    /// its queue has ordered deliveries, and the hold's own time applies from then on,
    /// to every ack of the channel (those of a handler without order on the same queue
    /// too), until the session ends.
    parks: bool,
    kept_since: Option<Instant>,
    hold: Hold,
}

impl Pending {
    fn new(hold: Hold) -> Self {
        Self {
            outstanding: BTreeSet::new(),
            decided: BTreeSet::new(),
            parks: false,
            kept_since: None,
            hold,
        }
    }

    /// What to send now, forgotten here: the end of the run of decided deliveries from
    /// the oldest outstanding one (one `multiple` ack), and the other decided ones (one
    /// by one) once the first of them has waited the hold by `now`, or at once when
    /// `all`.
    fn take(&mut self, now: Instant, all: bool) -> (Option<u64>, Vec<u64>) {
        let due = all
            || self
                .kept_since
                .is_some_and(|kept| now >= kept + self.wait());
        let taken = take_acks(&mut self.outstanding, &mut self.decided, due);
        self.kept_since = match self.decided.is_empty() {
            true => None,
            false => Some(self.kept_since.unwrap_or(now)),
        };
        taken
    }

    /// Records the ack of `tag` as requested; `parked`: it was kept for its turn.
    fn decide(&mut self, tag: u64, parked: bool) {
        self.decided.insert(tag);
        self.parks |= parked;
    }

    /// Whether the decided deliveries must go now, whatever their wait: the hold keeps
    /// as many as it may.
    fn must_go(&self) -> bool {
        !self.decided.is_empty() && self.decided.len() >= self.hold.most
    }

    /// How long the first decided delivery waits for the older ones: the hold's time
    /// once a parked one was decided (else [`HOLD`]), or while the deliveries taken
    /// fill the prefetch (the broker sends nothing more until an ack), no more than
    /// [`HOLD`]. Sent at once instead, each ack of a full window went alone: leased
    /// owned order, 3 pairs, RabbitMQ 144–148 µs an ordered entry against 100–130
    /// (docs/PERFORMANCE.md).
    fn wait(&self) -> Duration {
        let full = self.hold.window > 0 && self.outstanding.len() >= self.hold.window;
        match self.parks && !full {
            true => self.hold.time,
            false => self.hold.time.min(HOLD),
        }
    }

    /// When the decided deliveries waiting for an older one go on their own.
    fn kept_until(&self) -> Option<Instant> {
        self.kept_since.map(|kept| kept + self.wait())
    }

    /// Sends what [`Pending::take`] says, every ack at once: lapin answers each only
    /// once its I/O loop wrote it, and awaited one by one, the singles of an owned
    /// queue's ordered run (about 16,000 of its 20,000 acks on the ordering bench) held
    /// this loop 75 µs each, 1.2 s of a 2.7 s run, while the acks requested meanwhile
    /// waited and the broker sends no more than the prefetch unacked; together, 13 µs
    /// each (docs/PERFORMANCE.md). They cover distinct tags (the singles are past the
    /// run's end), so their order does not matter.
    async fn send(&mut self, channel: &Channel, all: bool) {
        let (run_end, singles) = self.take(Instant::now(), all);
        let acks = run_end
            .map(|end| (end, true))
            .into_iter()
            .chain(singles.into_iter().map(|tag| (tag, false)))
            .map(|(tag, multiple)| async move {
                let sent = channel.basic_ack(tag, BasicAckOptions { multiple }).await;
                (tag, multiple, sent)
            });
        let failed: Vec<_> = join_all(acks)
            .await
            .into_iter()
            .filter_map(|(tag, multiple, sent)| sent.err().map(|error| (tag, multiple, error)))
            .collect();
        // A closed channel fails them all: one line says so.
        if let Some((tag, multiple, error)) = failed.first() {
            warn!(error = %error, delivery_tag = tag, multiple, failed = failed.len(), "acks failed; the broker redelivers on reconnect");
        }
    }
}

async fn run(
    channel: Channel,
    mut rx: mpsc::UnboundedReceiver<Command>,
    linger: Duration,
    hold: Hold,
) {
    let mut pending = Pending::new(hold);
    // Acks requested since the last send go no later than this.
    let mut deadline: Option<Instant> = None;
    loop {
        if deadline.is_some() && rx.is_empty() {
            // Requested acks and a pause in requests: let the tasks that are ready run
            // once (the rest of a batch may be about to ask), then send if still nothing
            // came. Measured with the bench: about 4 % more messages per second than
            // waiting out the linger (9 of 10 paired runs).
            tokio::task::yield_now().await;
            if rx.is_empty() {
                pending.send(&channel, false).await;
                deadline = None;
            }
        }
        let wake = [deadline, pending.kept_until()].into_iter().flatten().min();
        let command = match wake {
            Some(at) => match tokio::time::timeout_at(at, rx.recv()).await {
                Ok(command) => command,
                Err(_) => {
                    pending.send(&channel, false).await;
                    deadline = None;
                    continue;
                }
            },
            None => rx.recv().await,
        };
        let Some(command) = command else {
            pending.send(&channel, true).await;
            return;
        };
        match command {
            Command::Delivered(tag) => {
                pending.outstanding.insert(tag);
            }
            Command::Ack { tag, parked } => {
                pending.decide(tag, parked);
                deadline.get_or_insert_with(|| Instant::now() + linger);
                if pending.must_go() {
                    pending.send(&channel, true).await;
                    deadline = None;
                }
            }
            Command::Nack { tag, requeue } => {
                pending.send(&channel, true).await;
                deadline = None;
                pending.outstanding.remove(&tag);
                let options = BasicNackOptions {
                    requeue,
                    multiple: false,
                };
                if let Err(error) = channel.basic_nack(tag, options).await {
                    warn!(error = %error, delivery_tag = tag, "nack failed; the broker redelivers on reconnect");
                }
            }
            Command::Flush(done) => {
                pending.send(&channel, true).await;
                deadline = None;
                let _ = done.send(());
            }
        }
    }
}

/// Splits the decided deliveries into the end of the run that starts at the oldest
/// outstanding one (to ack with `multiple`) and, when `singles`, the rest (to ack one by
/// one), and forgets those. Without `singles`, the rest stay decided.
fn take_acks(
    outstanding: &mut BTreeSet<u64>,
    decided: &mut BTreeSet<u64>,
    singles: bool,
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
    if !singles {
        return (run_end, Vec::new());
    }
    let singles: Vec<u64> = std::mem::take(decided).into_iter().collect();
    for tag in &singles {
        outstanding.remove(tag);
    }
    (run_end, singles)
}

#[cfg(test)]
#[path = "acks_tests.rs"]
mod tests;
