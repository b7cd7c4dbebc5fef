//! The cluster drill in CI: the `cluster_drill` example starts a three-node RabbitMQ
//! cluster on this machine (beside the machine's own broker, which it leaves alone),
//! SIGKILLs the node leading the quorum queue while orders flow, restarts it, and
//! counts every effect. It needs root (the nodes run as the `rabbitmq` user) and Debian's
//! `rabbitmq-server`, as `.ci/run` has; it lives alone in this test binary, so nothing
//! else runs beside its three nodes.

mod common;

use std::time::Duration;

use common::run_drill;

#[tokio::test]
async fn killing_the_quorum_queues_leader_loses_and_duplicates_nothing() {
    let dir = std::env::temp_dir().join(format!(
        "idem-cluster-test-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    let dir = dir.to_string_lossy();
    let args = ["--orders", "2000", "--down-secs", "5", "--dir", &dir];
    // The drill gives up after 200 s and then removes its nodes, workers and database.
    let (summary, success, stderr) =
        run_drill("cluster_drill", &args, Duration::from_secs(300)).await;
    for expected in [
        "nodes=3",
        "queue_type=quorum",
        "restarted=true",
        "effects=2000",
        "duplicate_effects=0",
        "lost=0",
        "dead_workers=0",
        "result=ok",
    ] {
        assert!(
            summary.contains(expected),
            "{expected} missing in: {summary}\n{stderr}"
        );
    }
    assert!(!summary.contains("killed=none"), "{summary}");
    assert!(success, "{summary}\n{stderr}");
}
