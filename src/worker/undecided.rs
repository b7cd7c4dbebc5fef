//! Deliveries the worker could not decide (docs/DESIGN.md, "Errors by cause"): while
//! the store keeps failing, the pause before each requeue grows, so an outage costs
//! next to nothing; and a delivery that keeps failing while the store decides others
//! is given up as `undecidable`, so an error nobody foresaw cannot loop forever.

use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// The first pause before an undecided delivery is requeued.
const FIRST_PAUSE: Duration = Duration::from_millis(500);
/// The longest pause, reached after a few deliveries in a row were not decided.
const LONGEST_PAUSE: Duration = Duration::from_secs(5);
/// Deliveries remembered at most; past it the memory starts afresh (the net then
/// takes longer to close, nothing worse).
const REMEMBERED: usize = 10_000;

/// The worker's memory of undecided deliveries, shared by every delivery's task.
pub(super) struct Undecided {
    /// After how many strikes a delivery is given up.
    limit: u32,
    /// Deliveries decided since the worker started.
    decided: AtomicU64,
    /// Deliveries not decided since the last one that was.
    failing: AtomicU32,
    /// Per body (hashed): strikes so far, and `decided` at the last one.
    strikes: Mutex<HashMap<u64, (u32, u64)>>,
}

impl Undecided {
    pub(super) fn new(limit: u32) -> Self {
        Self {
            limit: limit.max(1),
            decided: AtomicU64::new(0),
            failing: AtomicU32::new(0),
            strikes: Mutex::new(HashMap::new()),
        }
    }

    /// A delivery was decided: the store answers.
    pub(super) fn decided(&self, body: &[u8]) {
        self.decided.fetch_add(1, Ordering::Relaxed);
        self.failing.store(0, Ordering::Relaxed);
        let mut strikes = self.strikes.lock().unwrap_or_else(|e| e.into_inner());
        if !strikes.is_empty() {
            strikes.remove(&hash(body));
        }
    }

    /// A delivery was not decided. True when it is time to give it up: this is its
    /// `limit`th failure in a row, and before each one (but its first) the store
    /// decided some other delivery. Its memory is then forgotten.
    pub(super) fn failed(&self, body: &[u8]) -> bool {
        self.failing.fetch_add(1, Ordering::Relaxed);
        let decided = self.decided.load(Ordering::Relaxed);
        let key = hash(body);
        let mut strikes = self.strikes.lock().unwrap_or_else(|e| e.into_inner());
        if strikes.len() >= REMEMBERED && !strikes.contains_key(&key) {
            strikes.clear();
        }
        let (count, seen) = strikes.entry(key).or_insert((0, decided));
        if *count == 0 || *seen != decided {
            *count += 1;
            *seen = decided;
        }
        let give_up = *count >= self.limit;
        if give_up {
            strikes.remove(&key);
        }
        give_up
    }

    /// How long to wait before requeueing an undecided delivery: half a second,
    /// doubled for every delivery in a row that was not decided, up to five seconds.
    pub(super) fn pause(&self) -> Duration {
        let failing = self.failing.load(Ordering::Relaxed).saturating_sub(1);
        FIRST_PAUSE
            .saturating_mul(1 << failing.min(4))
            .min(LONGEST_PAUSE)
    }
}

fn hash(body: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    body.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_is_given_up_only_while_others_are_decided() {
        let net = Undecided::new(3);
        // An outage: nothing is decided, so the same delivery never strikes out.
        for _ in 0..50 {
            assert!(!net.failed(b"poison"));
        }
        // The store answers others between its failures: the third strike gives up.
        net.decided(b"other");
        assert!(!net.failed(b"poison"));
        net.decided(b"other");
        assert!(
            net.failed(b"poison"),
            "third failure in a row with others decided"
        );
        // Forgotten once given up; a success in between starts the count afresh.
        net.decided(b"other");
        assert!(!net.failed(b"poison"));
        net.decided(b"poison");
        net.decided(b"other");
        assert!(!net.failed(b"poison"));
    }

    #[test]
    fn the_pause_grows_while_nothing_is_decided_and_resets_after() {
        let net = Undecided::new(20);
        net.failed(b"a");
        assert_eq!(net.pause(), Duration::from_millis(500));
        net.failed(b"b");
        assert_eq!(net.pause(), Duration::from_secs(1));
        for _ in 0..10 {
            net.failed(b"c");
        }
        assert_eq!(net.pause(), LONGEST_PAUSE);
        net.decided(b"d");
        net.failed(b"a");
        assert_eq!(net.pause(), Duration::from_millis(500));
    }
}
