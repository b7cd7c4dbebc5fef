//! The cluster drill in CI: the `cluster_drill` example starts a three-node RabbitMQ
//! cluster on this machine (beside the machine's own broker, which it leaves alone),
//! SIGKILLs the node leading the quorum queue while orders flow, restarts it, and
//! counts every effect. It needs root (the nodes run as the `rabbitmq` user) and Debian's
//! `rabbitmq-server`, as `.ci/run` has; it lives alone in this test binary, so nothing
//! else runs beside its three nodes.

use std::process::Stdio;
use std::time::Duration;

#[tokio::test]
async fn killing_the_quorum_queues_leader_loses_and_duplicates_nothing() {
    let exe = std::env::current_exe().unwrap();
    let drill = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("cluster_drill");
    assert!(
        drill.exists(),
        "{} missing: run through cargo test",
        drill.display()
    );
    let dir = std::env::temp_dir().join(format!(
        "idem-cluster-test-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    let run = tokio::process::Command::new(&drill)
        .args(["--orders", "2000", "--down-secs", "5", "--dir"])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    // The drill gives up after 200 s and then removes its nodes, workers and database.
    let out = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("the drill finishes in 5 minutes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("cluster_drill: "))
        .unwrap_or_else(|| panic!("no summary line; stderr: {stderr}"));
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
    assert!(out.status.success(), "{summary}\n{stderr}");
}
