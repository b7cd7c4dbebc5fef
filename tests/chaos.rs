//! A short chaos run in CI: the `chaos` example against the real broker and database.
//!
//! It closes every broker connection and restarts RabbitMQ, so it lives alone in this
//! test binary: cargo runs test binaries one after another, never beside each other.

use std::process::Stdio;
use std::time::Duration;

#[tokio::test]
async fn short_chaos_run_has_no_duplicate_and_no_lost_effect() {
    let exe = std::env::current_exe().unwrap();
    let chaos = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("chaos");
    assert!(
        chaos.exists(),
        "{} missing: run through cargo test",
        chaos.display()
    );
    let run = tokio::process::Command::new(&chaos)
        .args([
            "--orders",
            "2000",
            "--workers",
            "2",
            "--kills",
            "6",
            "--conn-drops",
            "2",
            "--pg-kills",
            "2",
            "--broker-restart",
            "--conflicts",
            "10",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("the chaos run finishes in 5 minutes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("chaos: "))
        .unwrap_or_else(|| panic!("no summary line; stderr: {stderr}"));
    for expected in [
        "kills=6",
        "connection_drops=2",
        "broker_restarts=1",
        "effects=2000",
        "duplicate_effects=0",
        "lost=0",
        "split_provider_keys=0",
        "dlq_not_conflict=0",
        "unfinished=0",
        "dead_workers=0",
        "result=ok",
    ] {
        assert!(
            summary.contains(expected),
            "{expected} missing in: {summary}\n{stderr}"
        );
    }
    assert!(out.status.success(), "{summary}\n{stderr}");
}
