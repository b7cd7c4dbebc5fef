//! Retry policy: immediate retries in process, then delayed retries through retry queues.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// How a transient failure is retried before it is dead-lettered as `retries_exhausted`.
///
/// First `immediate` more runs in the same process, spaced by exponential backoff with
/// jitter (cheap, for blips of a second). Then the message goes through the retry queues
/// `<queue>.retry.<delay>`, one per entry of `delays`, each holding it for its delay
/// (TTL) before it flows back to the queue: for outages of minutes, without holding a
/// worker or a prefetch slot meanwhile.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Extra runs in process after the first failure.
    pub immediate: usize,
    /// First backoff between immediate runs.
    pub min_backoff: Duration,
    /// Longest backoff between immediate runs.
    pub max_backoff: Duration,
    /// The delays of the retry queues, in order; their count is the number of delayed
    /// retries. Empty: dead-letter once the immediate retries are used up.
    pub delays: Vec<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            immediate: 2,
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            delays: vec![
                Duration::from_secs(5),
                Duration::from_secs(30),
                Duration::from_secs(300),
            ],
        }
    }
}

impl RetryPolicy {
    /// The backoff between immediate runs: exponential with jitter, at most
    /// `immediate` delays.
    pub fn immediate_backoff(&self) -> impl Iterator<Item = Duration> + Send + use<> {
        ExponentialBuilder::default()
            .with_min_delay(self.min_backoff)
            .with_max_delay(self.max_backoff)
            .with_max_times(self.immediate)
            .with_jitter()
            .build()
    }

    /// The delay of the retry queue for delayed retry number `retry` (0-based), or
    /// `None` when the delayed retries are used up.
    pub fn delay(&self, retry: usize) -> Option<Duration> {
        self.delays.get(retry).copied()
    }
}

/// The retry queue name for `delay`: named by its delay, so changing the delays
/// declares new queues instead of failing on the old queues' arguments.
pub(crate) fn retry_queue_name(queue: &str, delay: Duration) -> String {
    let ms = delay.as_millis();
    let tier = if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    };
    format!("{queue}.retry.{tier}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn immediate_backoff_is_bounded_and_grows() {
        let policy = RetryPolicy {
            immediate: 4,
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(350),
            delays: vec![],
        };
        let delays: Vec<_> = policy.immediate_backoff().collect();
        assert_eq!(delays.len(), 4);
        // Jitter adds up to one more base delay.
        assert!(delays[0] >= Duration::from_millis(100) && delays[0] <= Duration::from_millis(200));
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(700)));
    }

    #[test]
    fn delayed_retries_follow_the_configured_tiers() {
        let policy = RetryPolicy::default();
        assert_eq!(policy.delay(0), Some(Duration::from_secs(5)));
        assert_eq!(policy.delay(2), Some(Duration::from_secs(300)));
        assert_eq!(policy.delay(3), None);
    }

    #[test]
    fn retry_queues_are_named_by_delay() {
        assert_eq!(
            retry_queue_name("orders", Duration::from_secs(5)),
            "orders.retry.5s"
        );
        assert_eq!(
            retry_queue_name("orders", Duration::from_millis(250)),
            "orders.retry.250ms"
        );
    }
}
