//! Unit tests of `acks.rs`: what the hold sends when, and the real broker taking
//! the acks sent.

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
    let url =
        std::env::var("AMQP_URL").unwrap_or_else(|_| crate::topology::DEFAULT_AMQP_URL.to_owned());
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
    pending.decide(2, true);
    pending.decide(3, false);
    assert_eq!(pending.take(start, false), (None, vec![]));
    // Past the plain hold, they still wait for 1.
    assert_eq!(pending.take(start + HOLD * 2, false), (None, vec![]));
    pending.decide(1, false);
    assert_eq!(pending.take(start + HOLD * 5, false), (Some(3), vec![]));
    pending.outstanding.extend([4, 5]);
    pending.decide(5, true);
    assert_eq!(pending.take(start + HOLD * 5, false), (None, vec![]));
    assert_eq!(
        pending.take(start + HOLD * 5 + owned.time, false),
        (None, vec![5])
    );
}

/// On such a queue, acks wait the plain hold until a parked delivery is acked (a queue
/// whose handlers order nothing never parks: the longer hold cost leased workers 8 %
/// of their pace there), the owned one from then on.
#[test]
fn an_owned_queue_holds_acks_longer_once_it_parked() {
    let owned = Hold::owned(512);
    let start = Instant::now();
    let mut pending = Pending::new(owned);
    pending.outstanding.extend([1, 2, 3]);
    pending.decide(2, false);
    assert_eq!(pending.take(start, false), (None, vec![]));
    assert_eq!(pending.kept_until(), Some(start + HOLD));
    assert_eq!(pending.take(start + HOLD, false), (None, vec![2]));
    pending.outstanding.insert(4);
    pending.decide(4, true);
    let _ = pending.take(start + HOLD, false);
    assert_eq!(pending.kept_until(), Some(start + HOLD + owned.time));
    assert_eq!(
        pending.take(start + HOLD + owned.time, false),
        (None, vec![4])
    );
    // From then on, a delivery that ran waits as long.
    pending.decide(3, false);
    let later = start + HOLD * 20;
    let _ = pending.take(later, false);
    assert_eq!(pending.kept_until(), Some(later + owned.time));
}

/// Held acks go at once when the hold keeps as many as it may, never when nothing
/// is decided; while the prefetch is full they wait no more than the plain hold.
#[test]
fn held_acks_wait_less_when_the_window_is_full() {
    let owned = Hold::owned(8);
    let mut pending = Pending::new(owned);
    pending.outstanding.extend(1..=7);
    pending.decide(2, true);
    pending.decide(3, true);
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
    pending.decide(2, true);
    let _ = pending.take(start, false);
    assert_eq!(
        pending.kept_until(),
        Some(start + owned.time),
        "an unknown prefetch is never full"
    );
}
