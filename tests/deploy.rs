//! The Grafana dashboard and the Prometheus rules under `deploy/` name only metrics
//! idem exports, and the dashboard shows every one of them. (`promtool test rules`
//! checks when the rules fire; `scripts/test` runs it.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every `.rs` file under `src/`, with its text.
fn sources() -> Vec<String> {
    let mut texts = Vec::new();
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                texts.push(std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    texts
}

/// The metric names the source records, with whether each is a histogram: the first
/// argument of every `counter!`, `gauge!` and `histogram!`.
fn exported() -> BTreeMap<String, bool> {
    let mut names = BTreeMap::new();
    for text in sources() {
        for macro_name in ["counter!(", "gauge!(", "histogram!("] {
            for (at, _) in text.match_indices(macro_name) {
                let rest = text[at + macro_name.len()..].trim_start();
                if let Some(quoted) = rest.strip_prefix('"') {
                    let name = &quoted[..quoted.find('"').unwrap()];
                    names.insert(name.to_owned(), macro_name == "histogram!(");
                }
            }
        }
    }
    names
}

/// The `outcome` label values the source records: the first string literal of every
/// call that counts an outcome (`metrics::delivery(` and `replayed_delivery(`, the
/// worker's `count(`, `http_request(`, `answered(`), and the names of the worker's
/// outcomes (`Outcome::as_str`).
fn outcomes() -> BTreeSet<String> {
    let mut values = BTreeSet::new();
    for text in sources() {
        for call in ["delivery(", "count(", "http_request(", "answered("] {
            for (at, _) in text.match_indices(call) {
                let args = &text[at + call.len()..];
                let args = &args[..args.find(')').unwrap_or(args.len())];
                if let Some(value) = args.split('"').nth(1) {
                    values.insert(value.to_owned());
                }
            }
        }
        for line in text
            .lines()
            .filter(|l| l.contains("Outcome::") && l.contains("=> \""))
        {
            values.extend(line.split('"').nth(1).map(str::to_owned));
        }
    }
    values
}

/// The values an expression matches the `outcome` label against, as written
/// (`outcome="a"`, `outcome=~"a|b"`, `outcome!~"a|b"`).
fn outcomes_in(expr: &str) -> BTreeSet<String> {
    let mut values = BTreeSet::new();
    for (at, _) in expr.match_indices("outcome") {
        let rest = expr[at + "outcome".len()..].trim_start_matches(['=', '!', '~']);
        if let Some(quoted) = rest.strip_prefix('"') {
            let value = &quoted[..quoted.find('"').unwrap_or(quoted.len())];
            values.extend(value.split('|').map(str::to_owned));
        }
    }
    values
}

/// The `idem_*` series names in a PromQL expression, as written.
fn named_in(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("idem_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// The series names in `named` that idem does not export: a counter or gauge by its
/// name, a histogram only by one of its series (`_bucket`, `_sum`, `_count`).
fn unknown(named: &BTreeSet<String>, exported: &BTreeMap<String, bool>) -> Vec<String> {
    named
        .iter()
        .filter(|name| {
            let histogram = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix));
            let known_plain = exported.get(name.as_str()) == Some(&false);
            let known_histogram = histogram.is_some_and(|base| exported.get(base) == Some(&true));
            !(known_plain || known_histogram)
        })
        .cloned()
        .collect()
}

/// The metric a series name belongs to (a histogram's series to the histogram).
fn metric_of(name: &str, exported: &BTreeMap<String, bool>) -> String {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .filter(|base| exported.get(*base) == Some(&true))
        .unwrap_or(name)
        .to_owned()
}

/// Every target expression of `panels`, rows' nested panels included.
fn expressions(panels: &serde_json::Value, out: &mut Vec<String>) {
    for panel in panels.as_array().into_iter().flatten() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.extend(target["expr"].as_str().map(str::to_owned));
        }
        expressions(&panel["panels"], out);
    }
}

fn deploy_file(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

#[test]
fn the_source_exports_metrics_under_their_documented_prefix() {
    let names = exported();
    assert!(names.len() >= 15, "{names:?}");
    assert!(names.keys().all(|n| n.starts_with("idem_")), "{names:?}");
}

#[test]
fn the_dashboard_shows_every_metric_idem_exports_and_no_other() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&deploy_file("deploy/grafana/idem.json")).unwrap();
    let mut exprs = Vec::new();
    expressions(&dashboard["panels"], &mut exprs);
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        exprs.extend(variable["query"].as_str().map(str::to_owned));
    }
    assert!(exprs.len() > 10);
    let named: BTreeSet<String> = exprs.iter().flat_map(|e| named_in(e)).collect();
    let exported = exported();
    let unknown = unknown(&named, &exported);
    assert!(
        unknown.is_empty(),
        "the dashboard names series idem does not export: {unknown:?}"
    );
    let shown: BTreeSet<String> = named.iter().map(|n| metric_of(n, &exported)).collect();
    let missing: Vec<_> = exported.keys().filter(|m| !shown.contains(*m)).collect();
    assert!(
        missing.is_empty(),
        "exported metrics missing from the dashboard: {missing:?}"
    );
}

#[test]
fn the_alert_rules_name_only_metrics_idem_exports() {
    let rules = deploy_file("deploy/prometheus/idem-rules.yml");
    let named: BTreeSet<String> = rules
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .flat_map(named_in)
        .collect();
    assert!(named.len() >= 8, "{named:?}");
    let unknown = unknown(&named, &exported());
    assert!(
        unknown.is_empty(),
        "the rules name series idem does not export: {unknown:?}"
    );
}

#[test]
fn the_rules_and_the_dashboard_match_only_outcomes_idem_records() {
    let known = outcomes();
    for value in [
        "executed",
        "dead_lettered",
        "takeover",
        "failed_transient",
        "store_unavailable",
    ] {
        assert!(
            known.contains(value),
            "{value} not found in the source: {known:?}"
        );
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&deploy_file("deploy/grafana/idem.json")).unwrap();
    let mut exprs = Vec::new();
    expressions(&dashboard["panels"], &mut exprs);
    let rules = deploy_file("deploy/prometheus/idem-rules.yml");
    exprs.extend(
        rules
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .map(str::to_owned),
    );
    let matched: BTreeSet<String> = exprs.iter().flat_map(|e| outcomes_in(e)).collect();
    assert!(matched.len() >= 5, "{matched:?}");
    let unknown: Vec<_> = matched.difference(&known).collect();
    assert!(
        unknown.is_empty(),
        "outcomes idem never records: {unknown:?}"
    );
}

#[test]
fn outcome_matchers_are_read_in_full() {
    assert_eq!(
        outcomes_in(
            r#"rate(x{outcome=~"failed_transient|retries_exhausted"}[5m]) / y{outcome!~"takeover"} + z{outcome="dead_letterd"}"#
        ),
        [
            "dead_letterd",
            "failed_transient",
            "retries_exhausted",
            "takeover"
        ]
        .map(str::to_owned)
        .into()
    );
}

#[test]
fn the_checks_refuse_what_idem_does_not_export() {
    let exported: BTreeMap<String, bool> = [
        ("idem_gc_batch_seconds".to_owned(), true),
        ("idem_store_up".to_owned(), false),
    ]
    .into();
    let named = named_in(
        "histogram_quantile(0.99, sum by (le) (rate(idem_gc_batch_seconds_bucket[5m]))) \
         / idem_store_up + idem_store_up2 + idem_store_up_count + idem_gc_batch_seconds",
    );
    assert_eq!(
        unknown(&named, &exported),
        [
            "idem_gc_batch_seconds",
            "idem_store_up2",
            "idem_store_up_count"
        ],
        "a bare histogram name, a longer name, a suffix on a gauge"
    );
}
