//! When a queue's circuit opens: failed runs in a row, or a share of failed runs over a
//! window, counted per worker process (the open state itself is shared).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// When a queue's circuit opens, and how long it stays open before a probe.
///
/// A run counts as failed when the handler returns a transient or uncertain error (the
/// dependency did not answer); a success or a permanent failure (it answered, and said
/// no) counts as a success; conflicts, malformed messages and duplicates are not runs.
/// Set it on a queue with [`WorkerConfig::circuit`](crate::WorkerConfig::circuit).
///
/// ```
/// # use std::time::Duration;
/// # use idem::CircuitBreaker;
/// // Open after 5 failed runs in a row, or when half the runs of the last 30 s (at
/// // least 20 of them) failed; probe after 10 s, then 20, 40, up to 5 minutes.
/// let breaker = CircuitBreaker::consecutive(5)
///     .or_ratio(0.5, Duration::from_secs(30), 20)
///     .open_for(Duration::from_secs(10), Duration::from_secs(300));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct CircuitBreaker {
    /// Opens after this many failed runs in a row (none: not by count).
    pub consecutive: Option<u32>,
    /// Opens when this share of the window's runs failed (none: not by share).
    pub ratio: Option<FailureRatio>,
    /// The pause before the first probe.
    pub open_for: Duration,
    /// The longest pause: each failed probe doubles it, up to this.
    pub max_open: Duration,
}

/// A share of failed runs over a sliding window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FailureRatio {
    /// The share, 0 to 1, at or above which the circuit opens.
    pub ratio: f64,
    /// How far back runs count.
    pub window: Duration,
    /// Fewer runs than this in the window never open it.
    pub min_runs: u32,
}

impl Default for CircuitBreaker {
    /// 5 failed runs in a row; probes after 10 s, doubling up to 5 minutes.
    fn default() -> Self {
        Self::consecutive(5)
    }
}

impl CircuitBreaker {
    /// Opens after `failures` failed runs in a row.
    pub fn consecutive(failures: u32) -> Self {
        Self {
            consecutive: Some(failures.max(1)),
            ratio: None,
            open_for: Duration::from_secs(10),
            max_open: Duration::from_secs(300),
        }
    }

    /// Opens when `ratio` of the runs of the last `window` failed, counting only windows
    /// of at least `min_runs` runs.
    pub fn ratio(ratio: f64, window: Duration, min_runs: u32) -> Self {
        Self {
            consecutive: None,
            ..Self::consecutive(1).or_ratio(ratio, window, min_runs)
        }
    }

    /// Opens by share as well as by count.
    pub fn or_ratio(self, ratio: f64, window: Duration, min_runs: u32) -> Self {
        Self {
            ratio: Some(FailureRatio {
                ratio: ratio.clamp(0.0, 1.0),
                window: window.max(Duration::from_secs(1)),
                min_runs: min_runs.max(1),
            }),
            ..self
        }
    }

    /// The first pause before a probe, and the longest (each at least 100 ms and at
    /// most a day).
    pub fn open_for(self, first: Duration, max: Duration) -> Self {
        let day = Duration::from_secs(86_400);
        let first = first.clamp(Duration::from_millis(100), day);
        Self {
            open_for: first,
            max_open: max.clamp(first, day),
            ..self
        }
    }
}

/// Buckets a window is counted in.
const BUCKETS: u32 = 10;

/// One process's count of a queue's runs, to tell when the circuit should open.
#[derive(Debug)]
pub(crate) struct Tripwire {
    in_a_row: u32,
    /// Per bucket of a tenth of the window: its start, runs and failures.
    window: VecDeque<(Instant, u32, u32)>,
}

impl Tripwire {
    pub(crate) fn new() -> Self {
        Self {
            in_a_row: 0,
            window: VecDeque::new(),
        }
    }

    /// Counts a failed run at `now`; true when `config` says the circuit opens.
    pub(crate) fn failed(&mut self, config: &CircuitBreaker, now: Instant) -> bool {
        self.in_a_row = self.in_a_row.saturating_add(1);
        self.count(config, now, true);
        let by_count = config.consecutive.is_some_and(|n| self.in_a_row >= n);
        let by_share = config.ratio.is_some_and(|r| {
            let (runs, failures) = self.totals();
            runs >= r.min_runs && f64::from(failures) >= r.ratio * f64::from(runs)
        });
        by_count || by_share
    }

    /// Counts a successful run at `now`.
    pub(crate) fn succeeded(&mut self, config: &CircuitBreaker, now: Instant) {
        self.in_a_row = 0;
        self.count(config, now, false);
    }

    /// Forgets every run: the circuit changed state.
    pub(crate) fn reset(&mut self) {
        self.in_a_row = 0;
        self.window.clear();
    }

    fn count(&mut self, config: &CircuitBreaker, now: Instant, failed: bool) {
        let Some(ratio) = config.ratio else { return };
        let bucket = ratio.window / BUCKETS;
        while let Some(&(start, _, _)) = self.window.front() {
            if now.saturating_duration_since(start) < ratio.window {
                break;
            }
            self.window.pop_front();
        }
        match self.window.back_mut() {
            Some((start, runs, failures)) if now.saturating_duration_since(*start) < bucket => {
                *runs += 1;
                *failures += u32::from(failed);
            }
            _ => self.window.push_back((now, 1, u32::from(failed))),
        }
    }

    fn totals(&self) -> (u32, u32) {
        self.window
            .iter()
            .fold((0, 0), |(r, f), (_, runs, failures)| {
                (r + runs, f + failures)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_in_a_row_open_it_and_a_success_starts_the_count_again() {
        let config = CircuitBreaker::consecutive(3);
        let mut wire = Tripwire::new();
        let now = Instant::now();
        assert!(!wire.failed(&config, now));
        assert!(!wire.failed(&config, now));
        wire.succeeded(&config, now);
        assert!(!wire.failed(&config, now));
        assert!(!wire.failed(&config, now));
        assert!(wire.failed(&config, now), "third in a row");
        wire.reset();
        assert!(!wire.failed(&config, now));
    }

    #[test]
    fn a_share_opens_it_only_over_enough_runs_of_the_window() {
        let config = CircuitBreaker::ratio(0.5, Duration::from_secs(10), 10);
        let mut wire = Tripwire::new();
        let start = Instant::now();
        // Alternating: half failed, but below 10 runs nothing opens.
        for i in 0..9 {
            let at = start + Duration::from_millis(100 * i);
            if i % 2 == 0 {
                assert!(!wire.failed(&config, at), "run {i}");
            } else {
                wire.succeeded(&config, at);
            }
        }
        assert!(
            wire.failed(&config, start + Duration::from_secs(1)),
            "6 of 10"
        );
        // Runs older than the window no longer count: 20 successes, then eleven
        // seconds on 9 failures are too few runs to open it.
        wire.reset();
        for _ in 0..20 {
            wire.succeeded(&config, start);
        }
        let later = start + Duration::from_secs(11);
        for _ in 0..9 {
            assert!(!wire.failed(&config, later));
        }
        assert!(wire.failed(&config, later), "10 of 10");
    }
}
