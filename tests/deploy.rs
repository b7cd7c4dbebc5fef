//! The Grafana dashboard and the Prometheus rules under `deploy/` name only metrics
//! idem exports, and the dashboard shows every one of them. (`promtool test rules`
//! checks when the rules fire; `.ci/run` runs it.)

use std::collections::BTreeSet;
use std::path::Path;

/// The metric names the source records: the first argument of every `counter!`,
/// `gauge!` and `histogram!`.
fn exported() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                for macro_name in ["counter!(", "gauge!(", "histogram!("] {
                    for (at, _) in text.match_indices(macro_name) {
                        let rest = text[at + macro_name.len()..].trim_start();
                        if let Some(quoted) = rest.strip_prefix('"') {
                            let name = &quoted[..quoted.find('"').unwrap()];
                            names.insert(name.to_owned());
                        }
                    }
                }
            }
        }
    }
    names
}

/// The `idem_*` metric names in a PromQL expression, histogram series suffixes removed.
fn named_in(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("idem_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let name = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(name);
        names.insert(name.to_owned());
        rest = &tail[end..];
    }
    names
}

fn deploy_file(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

#[test]
fn the_source_exports_metrics_under_their_documented_prefix() {
    let names = exported();
    assert!(names.len() >= 15, "{names:?}");
    assert!(names.iter().all(|n| n.starts_with("idem_")), "{names:?}");
}

#[test]
fn the_dashboard_shows_every_metric_idem_exports_and_no_other() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&deploy_file("deploy/grafana/idem.json")).unwrap();
    let mut shown = BTreeSet::new();
    let mut exprs = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            shown.extend(named_in(target["expr"].as_str().unwrap()));
            exprs += 1;
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(query) = variable["query"].as_str() {
            shown.extend(named_in(query));
        }
    }
    assert!(exprs > 10);
    let exported = exported();
    let unknown: Vec<_> = shown.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard names metrics idem does not export: {unknown:?}"
    );
    let missing: Vec<_> = exported.difference(&shown).collect();
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
    let exported = exported();
    let unknown: Vec<_> = named.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "the rules name metrics idem does not export: {unknown:?}"
    );
}

#[test]
fn the_name_scanner_finds_names_and_strips_histogram_suffixes() {
    let names = named_in(
        "histogram_quantile(0.99, sum by (le) (rate(idem_gc_batch_seconds_bucket[5m]))) \
         / idem_store_up",
    );
    let expected: BTreeSet<String> = ["idem_gc_batch_seconds", "idem_store_up"]
        .map(String::from)
        .into();
    assert_eq!(names, expected);
}
