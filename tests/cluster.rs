//! The cluster drill in CI: the `cluster_drill` example starts a three-node RabbitMQ
//! cluster on this machine (beside the machine's own broker, which it leaves alone),
//! SIGKILLs the node leading the quorum queue while orders flow, restarts it, and
//! counts every effect. It needs root (the nodes run as the `rabbitmq` user) and Debian's
//! `rabbitmq-server`, as CI has; it lives alone in this test binary, so nothing else runs
//! beside its three nodes.

mod common;

use std::time::Duration;

use common::run_drill;

/// Root and Debian's `rabbitmq-server`, or why not.
fn cannot_run() -> Option<&'static str> {
    if !common::is_root() {
        Some("not root")
    } else if !std::path::Path::new("/usr/lib/rabbitmq/bin/rabbitmq-server").exists()
        && !std::path::Path::new("/usr/sbin/rabbitmq-server").exists()
    {
        Some("no rabbitmq-server")
    } else {
        None
    }
}

#[tokio::test]
async fn killing_the_quorum_queues_leader_loses_and_duplicates_nothing() {
    if let Some(why) = cannot_run() {
        // Skipped where it cannot run, unless required (`IDEM_CI=1 scripts/test`).
        assert_ne!(
            std::env::var("IDEM_TEST_CLUSTER").as_deref(),
            Ok("required"),
            "the cluster drill cannot run here: {why}"
        );
        eprintln!("skipped: the cluster drill needs root and rabbitmq-server ({why})");
        return;
    }
    let dir = std::env::temp_dir().join(format!(
        "idem-cluster-test-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    let dir = dir.to_string_lossy();
    let args = ["--orders", "2000", "--down-secs", "5", "--dir", &dir];
    // The drill gives up after 200 s and then removes its nodes, workers and database.
    let drill = run_drill("cluster_drill", &args, Duration::from_secs(300)).await;
    drill.expect(&[
        ("nodes", "3"),
        ("queue_type", "quorum"),
        ("restarted", "true"),
        ("effects", "2000"),
        ("duplicate_effects", "0"),
        ("lost", "0"),
        ("dead_workers", "0"),
        ("result", "ok"),
    ]);
    assert_ne!(
        drill.fields.get("killed").map(String::as_str),
        Some("none"),
        "{}",
        drill.summary
    );
    assert!(drill.success, "{}\n{}", drill.summary, drill.stderr);
}
