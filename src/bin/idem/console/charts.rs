//! The console's charts, drawn as inline SVG from what Postgres and the broker hold, not
//! from a metrics server that may not exist.
//!
//! - Deliveries per minute over the last hours by what became of them (executed,
//!   duplicates, retried, dead-lettered), as the workers tallied them in
//!   `delivery_outcomes` ([`idem::tally`]), with every outcome's total below.
//! - Operations completed per minute (first runs and runs after a retry), read from the
//!   records' `completed_at` through the index on `expires_at` (a completed
//!   record expires `--retention-days` after it completed, so that flag must say the
//!   workers' retention), and dead letters per minute from `dead_lettered_at` of failed
//!   records (the index of unresolved records): those not replayed or discarded since,
//!   which clear it.
//! - Queue depths (ready messages of each queue and its DLQ) and the outbox's oldest
//!   age, sampled by the console itself every [`SAMPLE_EVERY`] since it started: the
//!   broker keeps no history.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use idem::tally::{Line, MinuteCount};

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use super::Console;
use super::html::{self, escape};
use super::pages::failed;

/// How often the console samples the broker and the outbox.
pub(super) const SAMPLE_EVERY: Duration = Duration::from_secs(15);
/// The samples kept: three hours.
const SAMPLES_KEPT: usize = 720;
/// The window of the per-minute charts, in minutes.
pub(super) const WINDOW_MINUTES: i64 = 180;

/// One sample: when, each queue's ready messages (queue, then its DLQ), the outbox's
/// oldest age in seconds.
#[derive(Debug, Clone)]
pub(super) struct Sample {
    pub(super) at: DateTime<Utc>,
    pub(super) depths: Vec<(String, Option<u32>)>,
    pub(super) outbox_age_s: Option<f64>,
}

/// The samples taken so far, oldest first.
#[derive(Default)]
pub(super) struct Samples(Mutex<VecDeque<Sample>>);

impl Samples {
    pub(super) fn snapshot(&self) -> Vec<Sample> {
        self.0
            .lock()
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn push(&self, sample: Sample) {
        if let Ok(mut samples) = self.0.lock() {
            if samples.len() == SAMPLES_KEPT {
                samples.pop_front();
            }
            samples.push_back(sample);
        }
    }
}

/// Samples the broker and the outbox every [`SAMPLE_EVERY`] while the console runs. What
/// a sample could not read is drawn as 0, never fatal.
pub(super) async fn sample_forever(console: Arc<Console>) {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    let mut connection: Option<lapin::Connection> = None;
    loop {
        tick.tick().await;
        if connection.as_ref().is_none_or(|c| !c.status().connected()) {
            connection = console.broker().await.ok();
        }
        let mut depths = Vec::new();
        for queue in &console.queues {
            for name in [queue.clone(), idem::replay::dlq_of(queue)] {
                let depth = match &connection {
                    Some(c) => idem::topology::queue_counts(c, &name)
                        .await
                        .ok()
                        .flatten()
                        .map(|q| q.ready),
                    None => None,
                };
                depths.push((name, depth));
            }
        }
        let outbox_age_s = idem::outbox::stats(console.store.pool())
            .await
            .ok()
            .and_then(|s| s.oldest_age_s);
        console.samples.push(Sample {
            at: Utc::now(),
            depths,
            outbox_age_s,
        });
    }
}

/// One minute's counts.
#[derive(sqlx::FromRow)]
pub(super) struct Minute {
    pub(super) minute: DateTime<Utc>,
    /// Completed on the first attempt.
    pub(super) first_runs: i64,
    /// Completed after a retry (a later claim).
    pub(super) retried: i64,
    /// Dead-lettered (records failed for good).
    pub(super) dead: i64,
}

/// Per-minute counts over the window, every minute of it (zeros where nothing happened).
pub(super) async fn per_minute(console: &Console) -> Result<Vec<Minute>, sqlx::Error> {
    let retention_ms = i64::try_from(console.retention.as_millis()).unwrap_or(i64::MAX);
    sqlx::query_as(
        "WITH completed AS (
            SELECT date_trunc('minute', completed_at) AS minute,
                   count(*) FILTER (WHERE attempts = 1) AS first_runs,
                   count(*) FILTER (WHERE attempts > 1) AS retried
            FROM processed_operations
            WHERE expires_at >= now() + $1::bigint * interval '1 millisecond'
                                 - $2::bigint * interval '1 minute' - interval '1 minute'
              AND status = 'completed'
              AND completed_at >= now() - $2::bigint * interval '1 minute'
            GROUP BY 1
         ),
         dead AS (
            SELECT date_trunc('minute', dead_lettered_at) AS minute, count(*) AS dead
            FROM processed_operations
            WHERE status = 'failed'
              AND dead_lettered_at >= now() - $2::bigint * interval '1 minute'
            GROUP BY 1
         )
         SELECT m.minute, coalesce(c.first_runs, 0) AS first_runs,
                coalesce(c.retried, 0) AS retried, coalesce(d.dead, 0) AS dead
         FROM generate_series(date_trunc('minute', now()) - $2::bigint * interval '1 minute',
                              date_trunc('minute', now()), interval '1 minute') AS m(minute)
         LEFT JOIN completed c USING (minute) LEFT JOIN dead d USING (minute)
         ORDER BY m.minute",
    )
    .bind(retention_ms)
    .bind(WINDOW_MINUTES)
    .fetch_all(console.store.pool())
    .await
}

/// A line chart of `series` (name, colour, values by time) as inline SVG, with the
/// largest value and the time range as labels.
pub(super) fn line_chart(
    id: &str,
    title: &str,
    times: &[DateTime<Utc>],
    series: &[(&str, &str, Vec<f64>)],
) -> String {
    let (w, h, pad) = (900.0, 220.0, 40.0);
    let max = series
        .iter()
        .flat_map(|(_, _, v)| v.iter().copied())
        .fold(0.0_f64, f64::max)
        .max(1.0);
    let (first, last) = match (times.first(), times.last()) {
        (Some(f), Some(l)) => (*f, *l),
        _ => {
            return format!(
                "<h2>{}</h2><p id=\"{}\">No data yet.</p>",
                escape(title),
                escape(id)
            );
        }
    };
    let span = (last - first).num_milliseconds().max(1) as f64;
    let x =
        |t: &DateTime<Utc>| pad + (*t - first).num_milliseconds() as f64 / span * (w - 2.0 * pad);
    let y = |v: f64| h - pad - v / max * (h - 2.0 * pad);
    let mut svg = format!(
        "<h2>{}</h2><svg id=\"{}\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
         role=\"img\" aria-label=\"{}\" style=\"border:1px solid #d0d7de\">\
         <text x=\"4\" y=\"{}\" font-size=\"11\">{max:.0}</text>\
         <text x=\"4\" y=\"{}\" font-size=\"11\">0</text>\
         <text x=\"{pad}\" y=\"{}\" font-size=\"11\">{}</text>\
         <text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"end\">{}</text>",
        escape(title),
        escape(id),
        escape(title),
        pad,
        h - pad,
        h - 8.0,
        first.format("%H:%M"),
        w - pad,
        h - 8.0,
        last.format("%H:%M UTC"),
    );
    let mut legend_x = pad;
    for (name, colour, values) in series {
        let points: Vec<String> = times
            .iter()
            .zip(values)
            .map(|(t, v)| format!("{:.1},{:.1}", x(t), y(*v)))
            .collect();
        let _ = write!(
            svg,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{}\"/>\
             <text x=\"{}\" y=\"14\" font-size=\"12\" fill=\"{colour}\">{}</text>",
            points.join(" "),
            legend_x,
            escape(name)
        );
        legend_x += 7.0 * name.chars().count() as f64 + 24.0;
        if points.len() == 1 {
            let _ = write!(
                svg,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{colour}\"/>",
                x(&times[0]),
                y(values[0])
            );
        }
    }
    svg.push_str("</svg>");
    svg
}

/// Deliveries per (operation, outcome) over the window.
type Totals = BTreeMap<(String, String), i64>;

/// The deliveries chart's four lines over `times` (one value per minute, in the order
/// of [`Line::ALL`]), and every (operation, outcome)'s total over the window.
fn delivery_lines(times: &[DateTime<Utc>], rows: &[MinuteCount]) -> ([Vec<f64>; 4], Totals) {
    let at: HashMap<DateTime<Utc>, usize> =
        times.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut lines: [Vec<f64>; 4] = std::array::from_fn(|_| vec![0.0; times.len()]);
    let mut totals = BTreeMap::new();
    for row in rows {
        *totals
            .entry((row.operation.clone(), row.outcome.clone()))
            .or_default() += row.deliveries;
        let (Some(line), Some(&i)) = (Line::of(&row.outcome), at.get(&row.minute)) else {
            continue;
        };
        let n = Line::ALL.iter().position(|l| *l == line).unwrap_or(0);
        lines[n][i] += row.deliveries as f64;
    }
    (lines, totals)
}

/// Charts: deliveries per minute by outcome (as the workers tallied them), operations
/// completed and dead-lettered per minute (from the records), queue depths and the
/// outbox's oldest age (sampled by the console since it started).
pub(super) async fn page(State(console): State<Arc<Console>>) -> Response {
    let minutes = match per_minute(&console).await {
        Ok(minutes) => minutes,
        Err(error) => return failed("the store", &error.into()),
    };
    let times: Vec<_> = minutes.iter().map(|m| m.minute).collect();
    // The same minutes as the records' chart, so that the lines, the sums and the
    // table below count the same rows.
    let tallied = match (times.first(), times.last()) {
        (Some(first), Some(last)) => {
            match idem::tally::per_minute(console.store.pool(), &console.queues, *first, *last)
                .await
            {
                Ok(rows) => rows,
                Err(error) => return failed("the store", &error.into()),
            }
        }
        _ => Vec::new(),
    };
    let mut body = deliveries(&times, &tallied);
    body.push_str(&records(&times, &minutes));
    body.push_str(&sampled(&console.samples.snapshot()));
    html::page("Charts", &body).into_response()
}

/// The workers' tallies: the sum per line, the chart, the total per operation and outcome.
fn deliveries(times: &[DateTime<Utc>], tallied: &[MinuteCount]) -> String {
    let (lines, totals) = delivery_lines(times, tallied);
    let mut body = format!("<p>Deliveries in the last {WINDOW_MINUTES} minutes:");
    for (line, values) in Line::ALL.iter().zip(&lines) {
        let _ = write!(
            body,
            " <span id=\"{0}\">{1:.0}</span> {0},",
            line.as_str(),
            values.iter().sum::<f64>()
        );
    }
    body.pop();
    body.push_str(
        " (counted by the workers every few seconds; a worker killed with SIGKILL takes \
         its last seconds with it).</p>",
    );
    let colours = ["#1a7f37", "#0969da", "#9a6700", "#cf222e"];
    let series: Vec<(&str, &str, Vec<f64>)> = Line::ALL
        .iter()
        .zip(colours)
        .zip(lines)
        .map(|((line, colour), values)| (line.as_str(), colour, values))
        .collect();
    body.push_str(&line_chart(
        "deliveries",
        "Deliveries per minute",
        times,
        &series,
    ));
    let rows: Vec<Vec<String>> = totals
        .iter()
        .map(|((operation, outcome), n)| vec![escape(operation), escape(outcome), html::num(n)])
        .collect();
    body.push_str(&html::table(
        "outcome-totals",
        &["operation", "outcome", "deliveries"],
        &rows,
    ));
    body
}

/// The records' minutes: completed first time, after a retry, dead and still in a DLQ.
fn records(times: &[DateTime<Utc>], minutes: &[Minute]) -> String {
    let column =
        |f: fn(&Minute) -> i64| -> Vec<f64> { minutes.iter().map(|m| f(m) as f64).collect() };
    let total = |f: fn(&Minute) -> i64| -> i64 { minutes.iter().map(f).sum() };
    let mut body = format!(
        "<p>From the records, last {} minutes: \
         <span id=\"completed-first\">{}</span> completed on the first run, \
         <span id=\"completed-retried\">{}</span> after a retry, \
         <span id=\"dead-in-dlq\">{}</span> dead-lettered and still in the DLQ.</p>",
        WINDOW_MINUTES,
        total(|m| m.first_runs),
        total(|m| m.retried),
        total(|m| m.dead)
    );
    body.push_str(&line_chart(
        "operations",
        "Operations per minute (from the records)",
        times,
        &[
            ("completed, first run", "#1a7f37", column(|m| m.first_runs)),
            ("completed after a retry", "#9a6700", column(|m| m.retried)),
            (
                "dead-lettered, still in the DLQ",
                "#cf222e",
                column(|m| m.dead),
            ),
        ],
    ));
    body
}

/// What the console sampled since it started: queue depths and the outbox's oldest age.
fn sampled(samples: &[Sample]) -> String {
    let times: Vec<_> = samples.iter().map(|s| s.at).collect();
    let colours = [
        "#0969da", "#cf222e", "#8250df", "#bf3989", "#1a7f37", "#9a6700",
    ];
    let names: Vec<String> = samples
        .last()
        .map(|s| s.depths.iter().map(|(name, _)| name.clone()).collect())
        .unwrap_or_default();
    let depth_series: Vec<(&str, &str, Vec<f64>)> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let values = samples
                .iter()
                .map(|s| {
                    s.depths
                        .iter()
                        .find(|(n, _)| n == name)
                        .and_then(|(_, d)| *d)
                        .map_or(0.0, f64::from)
                })
                .collect();
            (name.as_str(), colours[i % colours.len()], values)
        })
        .collect();
    let mut body = line_chart(
        "depths",
        &format!(
            "Queue depths (ready messages, sampled every {} s)",
            SAMPLE_EVERY.as_secs()
        ),
        &times,
        &depth_series,
    );
    let ages: Vec<f64> = samples
        .iter()
        .map(|s| s.outbox_age_s.unwrap_or(0.0))
        .collect();
    body.push_str(&line_chart(
        "outbox-age",
        "Outbox: oldest unpublished message (s)",
        &times,
        &[("oldest age", "#8250df", ages)],
    ));
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_scales_to_its_largest_value_and_says_when_it_has_no_data() {
        let t0 = Utc::now();
        let times = [t0, t0 + chrono::Duration::minutes(1)];
        let svg = line_chart("c", "t", &times, &[("a", "#000", vec![2.0, 4.0])]);
        assert!(svg.contains(">4</text>"), "{svg}");
        assert!(svg.contains("points=\"40.0,110.0 860.0,40.0\""), "{svg}");
        assert!(line_chart("c", "t", &[], &[]).contains("No data yet."));
    }

    #[test]
    fn deliveries_add_up_per_line_and_minute_and_every_outcome_is_totalled() {
        let t0 = DateTime::from_timestamp(60 * 1_000, 0).unwrap();
        let times = [t0, t0 + chrono::Duration::minutes(1)];
        let row = |minute: DateTime<Utc>, outcome: &str, n: i64| MinuteCount {
            minute,
            queue: "q".into(),
            operation: "jobs".into(),
            outcome: outcome.into(),
            deliveries: n,
        };
        let rows = [
            row(times[0], "executed", 3),
            row(times[0], "reconciled", 1),
            row(times[1], "duplicate_completed", 2),
            row(times[1], "duplicate_in_progress", 1),
            row(times[1], "conflict", 1),
            row(times[1], "dead_lettered", 1),
            // Outside the window: totalled, not drawn.
            row(t0 - chrono::Duration::minutes(1), "executed", 5),
        ];
        let (lines, totals) = delivery_lines(&times, &rows);
        assert_eq!(lines[0], [4.0, 0.0], "executed and reconciled");
        assert_eq!(lines[1], [0.0, 3.0], "duplicates");
        assert_eq!(lines[2], [0.0, 0.0], "retried");
        assert_eq!(
            lines[3],
            [0.0, 1.0],
            "the conflict once, as its dead letter"
        );
        assert_eq!(totals[&("jobs".into(), "conflict".into())], 1);
        assert_eq!(totals[&("jobs".into(), "executed".into())], 8);
    }
}
