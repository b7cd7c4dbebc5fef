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
//! decided within a few milliseconds while the older ones wait for a run: their acks
//! wait longer there ([`Hold::owned`]).

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
    Ack(u64),
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

/// How long a decided delivery's ack waits for older deliveries to be decided before it
/// goes on its own, on a queue without owned order ([`Hold::owned`]). The bench
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
    /// unacked delivery. 100 ms, and up to three quarters of the prefetch. The ordering
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
    kept_since: Option<Instant>,
    hold: Hold,
}

impl Pending {
    fn new(hold: Hold) -> Self {
        Self {
            outstanding: BTreeSet::new(),
            decided: BTreeSet::new(),
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

    /// Whether the decided deliveries must go now, whatever their wait: the hold keeps
    /// as many as it may.
    fn must_go(&self) -> bool {
        !self.decided.is_empty() && self.decided.len() >= self.hold.most
    }

    /// How long the first decided delivery waits for the older ones: the hold's time, or
    /// while the deliveries taken fill the prefetch (the broker sends nothing more until
    /// an ack), no more than [`HOLD`]. Sent at once instead, each ack of a full window
    /// went alone: leased owned order, 3 pairs, RabbitMQ 144–148 µs an ordered entry
    /// against 100–130 (docs/PERFORMANCE.md).
    fn wait(&self) -> Duration {
        match self.hold.window > 0 && self.outstanding.len() >= self.hold.window {
            true => self.hold.time.min(HOLD),
            false => self.hold.time,
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
            Command::Ack(tag) => {
                pending.decided.insert(tag);
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
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use lapin::BasicProperties;
    use lapin::options::{
        BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, QueueDeclareOptions,
    };
    use lapin::types::FieldTable;

    /// A channel on the real broker with an exclusive queue (it goes with the
    /// connection) holding `count` messages, consumed with prefetch `prefetch`.
    async fn consuming(
        count: usize,
        prefetch: u16,
    ) -> (lapin::Connection, Channel, String, lapin::Consumer) {
        let url = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| crate::topology::DEFAULT_AMQP_URL.to_owned());
        let connection = crate::topology::connect(&url, "idem-acks-test")
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        let queue = channel
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        for n in 1..=count {
            channel
                .basic_publish(
                    "".into(),
                    queue.name().as_str().into(),
                    BasicPublishOptions::default(),
                    n.to_string().as_bytes(),
                    BasicProperties::default(),
                )
                .await
                .unwrap();
        }
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .unwrap();
        let consumer = channel
            .basic_consume(
                queue.name().as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        (connection, channel, queue.name().to_string(), consumer)
    }

    /// A lone ack goes out as soon as nobody else asks, not after the linger: with
    /// prefetch 1 the broker sends the second message only once the first is acked.
    #[tokio::test]
    async fn a_lone_ack_does_not_wait_for_the_linger() {
        let (connection, channel, _, mut consumer) = consuming(2, 1).await;
        let first = consumer.next().await.unwrap().unwrap();
        assert_eq!(first.data, b"1");

        let acks = Acks::spawn(channel.clone(), Duration::from_secs(60), Hold::plain(0));
        acks.delivered(first.delivery_tag);
        acks.ack(first.delivery_tag);
        let second = tokio::time::timeout(Duration::from_secs(5), consumer.next())
            .await
            .expect("the first ack was held: no second delivery within 5 s (linger 60 s)")
            .unwrap()
            .unwrap();
        assert_eq!(second.data, b"2");
        let _ = connection.close(200, "done".into()).await;
    }

    /// Hundreds of acks sent at once all reach the broker, each once: a multiple ack of
    /// the oldest run (1 to 100) with 151 singles behind a gap (150 to 300), then the
    /// gap's own run. The channel stays open (an unknown or twice-acked tag would close
    /// it: a round trip after each send would fail) and, once it is closed, nothing
    /// comes back to the queue (an ack lost on the way would).
    #[tokio::test]
    async fn many_acks_sent_together_each_reach_the_broker_once() {
        const COUNT: usize = 300;
        let (connection, channel, queue, mut consumer) = consuming(COUNT, 300).await;
        let mut tags = Vec::new();
        for _ in 0..COUNT {
            let delivery = tokio::time::timeout(Duration::from_secs(5), consumer.next())
                .await
                .expect("every message delivered within 5 s")
                .unwrap()
                .unwrap();
            tags.push(delivery.delivery_tag);
        }
        // Under the plain hold's 256: nothing goes before the flush.
        let acks = Acks::spawn(channel.clone(), Duration::from_secs(60), Hold::plain(0));
        for tag in &tags {
            acks.delivered(*tag);
        }
        let open = || async {
            channel
                .basic_qos(300, BasicQosOptions::default())
                .await
                .is_ok()
        };
        for tag in tags[..100].iter().chain(&tags[149..]) {
            acks.ack(*tag);
        }
        acks.flush().await;
        assert!(open().await, "the run and the singles closed the channel");
        for tag in &tags[100..149] {
            acks.ack(*tag);
        }
        acks.flush().await;
        assert!(open().await, "the gap's run closed the channel");
        channel.close(200, "done".into()).await.unwrap();

        let check = connection.create_channel().await.unwrap();
        let left = check
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        assert_eq!(
            left.message_count(),
            0,
            "an ack was lost: its message came back"
        );
        let _ = connection.close(200, "done".into()).await;
    }

    fn plan(outstanding: &[u64], decided: &[u64]) -> (Option<u64>, Vec<u64>, Vec<u64>) {
        let mut outstanding: BTreeSet<u64> = outstanding.iter().copied().collect();
        let mut decided: BTreeSet<u64> = decided.iter().copied().collect();
        let (end, singles) = take_acks(&mut outstanding, &mut decided, true);
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

    /// A delivery decided before an older one waits for it: covered by the older one's
    /// run when that one is decided within [`HOLD`], sent on its own once it waited
    /// that long, and at once when everything must go (a nack, a flush, the end).
    #[test]
    fn a_younger_ack_waits_for_the_older_ones_up_to_the_hold() {
        let start = Instant::now();
        let at = |n: u32| start + HOLD / 2 * n;
        let mut pending = Pending::new(Hold::plain(0));
        pending.outstanding.extend([1, 2, 3, 4]);
        pending.decided.extend([2, 3]);
        assert_eq!(pending.take(at(0), false), (None, vec![]));
        assert_eq!(pending.kept_until(), Some(start + HOLD));
        pending.decided.insert(1);
        assert_eq!(pending.take(at(1), false), (Some(3), vec![]));
        assert_eq!(pending.kept_until(), None);

        pending.outstanding.extend([5, 6]);
        pending.decided.insert(6);
        assert_eq!(pending.take(at(1), false), (None, vec![]));
        pending.decided.insert(5);
        assert_eq!(
            pending.take(at(2), false),
            (None, vec![]),
            "4 is still running"
        );
        // The first of them has waited the hold: both go, one by one.
        assert_eq!(pending.take(at(3), false), (None, vec![5, 6]));
        assert_eq!(
            pending.outstanding.iter().copied().collect::<Vec<_>>(),
            vec![4]
        );
        assert_eq!(pending.kept_until(), None);

        pending.outstanding.insert(7);
        pending.decided.insert(7);
        assert_eq!(pending.take(at(3), true), (None, vec![7]));
        pending.decided.insert(4);
        assert_eq!(pending.take(at(3), false), (Some(4), vec![]));
        assert!(pending.outstanding.is_empty() && pending.decided.is_empty());
    }

    /// On a queue of owned order, parked deliveries' acks wait for the older runs ten
    /// times longer than the plain hold, and up to three quarters of the prefetch.
    #[test]
    fn an_owned_queue_holds_younger_acks_longer() {
        let owned = Hold::owned(512);
        assert_eq!((owned.time, owned.most), (Duration::from_millis(100), 384));
        let start = Instant::now();
        let mut pending = Pending::new(owned);
        pending.outstanding.extend([1, 2, 3]);
        pending.decided.extend([2, 3]);
        assert_eq!(pending.take(start, false), (None, vec![]));
        // Past the plain hold, they still wait for 1.
        assert_eq!(pending.take(start + HOLD * 2, false), (None, vec![]));
        pending.decided.insert(1);
        assert_eq!(pending.take(start + HOLD * 5, false), (Some(3), vec![]));
        pending.outstanding.extend([4, 5]);
        pending.decided.insert(5);
        assert_eq!(pending.take(start + HOLD * 5, false), (None, vec![]));
        assert_eq!(
            pending.take(start + HOLD * 5 + owned.time, false),
            (None, vec![5])
        );
    }

    /// Held acks go at once when the hold keeps as many as it may, never when nothing
    /// is decided; while the prefetch is full they wait no more than the plain hold.
    #[test]
    fn held_acks_wait_less_when_the_window_is_full() {
        let owned = Hold::owned(8);
        let mut pending = Pending::new(owned);
        pending.outstanding.extend(1..=7);
        pending.decided.extend([2, 3]);
        assert!(!pending.must_go(), "2 of 6 held");
        let start = Instant::now();
        assert_eq!(pending.take(start, false), (None, vec![]));
        assert_eq!(pending.kept_until(), Some(start + owned.time));
        pending.outstanding.insert(8);
        assert_eq!(
            pending.kept_until(),
            Some(start + HOLD),
            "the prefetch is full"
        );
        assert_eq!(pending.take(start + HOLD, false), (None, vec![2, 3]));
        pending.decided.extend(4..=8);
        assert!(!pending.must_go(), "5 held");
        pending.decided.insert(1);
        assert!(pending.must_go(), "6 held: three quarters of 8");
        pending.decided.clear();
        assert!(!pending.must_go(), "nothing to ack");
        let unknown = Hold { window: 0, ..owned };
        let mut pending = Pending::new(unknown);
        pending.outstanding.extend(1..=1000);
        pending.decided.insert(2);
        let _ = pending.take(start, false);
        assert_eq!(
            pending.kept_until(),
            Some(start + owned.time),
            "an unknown prefetch is never full"
        );
    }
}
