//! A tracing layer that counts the worker's `delivery decided` events by outcome and
//! keeps their `elapsed_ms` (delivery to ack), for the demo and the benchmark.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer};

#[derive(Default)]
struct Seen {
    counts: BTreeMap<String, usize>,
    elapsed_ms: Vec<f64>,
}

/// Outcome counts and latencies; clones share them.
#[derive(Clone, Default)]
pub struct Outcomes(Arc<Mutex<Seen>>);

impl<S: tracing::Subscriber> Layer<S> for Outcomes {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        #[derive(Default)]
        struct Find {
            outcome: Option<String>,
            elapsed_ms: Option<f64>,
        }
        impl Visit for Find {
            fn record_str(&mut self, field: &Field, value: &str) {
                if field.name() == "outcome" {
                    self.outcome = Some(value.to_owned());
                }
            }
            fn record_f64(&mut self, field: &Field, value: f64) {
                if field.name() == "elapsed_ms" {
                    self.elapsed_ms = Some(value);
                }
            }
            fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
        }
        let mut find = Find::default();
        event.record(&mut find);
        if let (Some(outcome), Ok(mut seen)) = (find.outcome, self.0.lock()) {
            *seen.counts.entry(outcome).or_default() += 1;
            if let Some(ms) = find.elapsed_ms {
                seen.elapsed_ms.push(ms);
            }
        }
    }
}

impl Outcomes {
    /// Deliveries decided with `outcome`.
    pub fn get(&self, outcome: &str) -> usize {
        self.0
            .lock()
            .map(|s| s.counts.get(outcome).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    /// Deliveries decided in all.
    pub fn total(&self) -> usize {
        self.0.lock().map(|s| s.counts.values().sum()).unwrap_or(0)
    }

    /// Forgets everything seen so far.
    pub fn reset(&self) {
        if let Ok(mut seen) = self.0.lock() {
            *seen = Seen::default();
        }
    }

    /// The `q` quantile (0..=1) of delivery-to-ack times, in milliseconds.
    pub fn elapsed_quantile(&self, q: f64) -> f64 {
        let Ok(seen) = self.0.lock() else { return 0.0 };
        let mut v = seen.elapsed_ms.clone();
        if v.is_empty() {
            return 0.0;
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let i = ((v.len() - 1) as f64 * q).round() as usize;
        v[i.min(v.len() - 1)]
    }
}
