//! The Postgres failover drill in CI: the `pg_failover_drill` example starts a
//! pg_auto_failover monitor and two Postgres nodes on this machine (beside the machine's
//! own Postgres, which it leaves alone), SIGKILLs the primary while orders flow, lets the
//! monitor promote the standby, brings the old primary back as the new standby, and
//! counts every effect, with synchronous replication, in both modes. It needs root (the
//! nodes run as the `postgres` user) and Debian's `postgresql-15-auto-failover`, as CI
//! has; it lives alone in this test binary, so nothing else runs beside its nodes.

mod common;

use std::time::Duration;

use common::run_drill;

/// Root and pg_auto_failover, or why not.
fn cannot_run() -> Option<&'static str> {
    if !common::is_root() {
        Some("not root")
    } else if !std::path::Path::new("/usr/bin/pg_autoctl").exists() {
        Some("no pg_autoctl (postgresql-15-auto-failover)")
    } else {
        None
    }
}

#[tokio::test]
async fn killing_the_primary_loses_and_duplicates_nothing_with_synchronous_replication() {
    if let Some(why) = cannot_run() {
        // Skipped where it cannot run, unless required (`IDEM_CI=1 scripts/test`).
        assert_ne!(
            std::env::var("IDEM_TEST_PG_FAILOVER").as_deref(),
            Ok("required"),
            "the Postgres failover drill cannot run here: {why}"
        );
        eprintln!("skipped: the Postgres failover drill needs root and pg_auto_failover ({why})");
        return;
    }
    for mode in ["leased", "transactional"] {
        let dir = std::env::temp_dir().join(format!(
            "idem-pg-failover-test-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ));
        let dir = dir.to_string_lossy();
        let args = ["--orders", "1000", "--mode", mode, "--dir", &dir];
        let drill = run_drill("pg_failover_drill", &args, Duration::from_secs(300)).await;
        drill.expect(&[
            ("replication", "synchronous"),
            ("mode", mode),
            ("effects", "1000"),
            ("duplicate_effects", "0"),
            ("lost", "0"),
            ("rejoined", "true"),
            ("dead_workers", "0"),
            ("result", "ok"),
        ]);
        let resumed: f64 = drill.fields["resumed_s"].parse().unwrap();
        assert!(resumed <= 30.0, "{}", drill.summary);
        assert!(drill.success, "{}\n{}", drill.summary, drill.stderr);
        let left = queues_of(&drill.fields["queue"]);
        assert!(left.is_empty(), "the drill left {left:?} behind");
    }
}

/// The broker's queues named `queue` or `queue.<anything>` (its dead-letter and retry
/// queues, whatever its tiers), as `rabbitmqctl` lists them.
fn queues_of(queue: &str) -> Vec<String> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["-q", "list_queues", "name"])
        .output()
        .expect("rabbitmqctl");
    assert!(out.status.success(), "rabbitmqctl list_queues failed");
    let prefix = format!("{queue}.");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|name| *name == queue || name.starts_with(&prefix))
        .map(str::to_owned)
        .collect()
}
