//! Postgres host lists against real servers: two Postgres clusters of the test's own
//! (initdb on free ports, run as the `postgres` user), one of them read-only as a standby
//! is. A pool on `host1,host2?target_session_attrs=read-write` connects to the writable
//! one, and follows when that one turns read-only (SQLSTATE 25006, as a demoted primary
//! does) or dies (SIGKILL), with no write lost or left failing once it has moved.
//!
//! Needs root (or the `postgres` user) and Debian's PostgreSQL binaries; skipped without
//! them unless `IDEM_TEST_PG_HOSTS=required` (`IDEM_CI=1 scripts/test`).

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use sqlx::PgPool;

const BIN: &str = "/usr/lib/postgresql/15/bin";

/// A Postgres cluster of the test's own, stopped (immediately) when dropped.
struct Cluster {
    dir: PathBuf,
    port: u16,
}

fn as_postgres(program: &str, args: &[&str]) -> std::process::Output {
    let mut command = if common::is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", program]);
        c
    } else {
        Command::new(program)
    };
    command.args(args).output().expect("run as postgres")
}

fn cannot_run() -> Option<String> {
    if !std::path::Path::new(&format!("{BIN}/initdb")).exists() {
        return Some(format!("no {BIN}/initdb"));
    }
    let user = Command::new("id").arg("-un").output().ok()?;
    if !common::is_root() && user.stdout != b"postgres\n" {
        return Some("neither root nor postgres".into());
    }
    None
}

impl Cluster {
    fn start(read_only: bool) -> Cluster {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!(
            "idem-hosts-test-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ));
        std::fs::create_dir_all(&dir).unwrap();
        if common::is_root() {
            let chown = Command::new("chown")
                .args(["postgres", &dir.to_string_lossy()])
                .status()
                .unwrap();
            assert!(chown.success());
        }
        let data = dir.join("data");
        let init = as_postgres(
            &format!("{BIN}/initdb"),
            &[
                "-D",
                &data.to_string_lossy(),
                "-A",
                "trust",
                "-U",
                "postgres",
            ],
        );
        assert!(
            init.status.success(),
            "{}",
            String::from_utf8_lossy(&init.stderr)
        );
        let options = format!(
            "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c fsync=off",
            dir.to_string_lossy()
        );
        let start = as_postgres(
            &format!("{BIN}/pg_ctl"),
            &[
                "-D",
                &data.to_string_lossy(),
                "-o",
                &options,
                "-l",
                &dir.join("log").to_string_lossy(),
                "-w",
                "start",
            ],
        );
        assert!(
            start.status.success(),
            "{}",
            String::from_utf8_lossy(&start.stderr)
        );
        let cluster = Cluster { dir, port };
        cluster.sql("CREATE DATABASE app");
        cluster.sql_app("CREATE TABLE writes (n int PRIMARY KEY)");
        cluster.set_read_only(read_only);
        cluster
    }

    fn psql(&self, database: &str, sql: &str) -> String {
        let out = Command::new("psql")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args(["-d", database, "-Atqc", sql])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    fn sql(&self, sql: &str) -> String {
        self.psql("postgres", sql)
    }

    fn sql_app(&self, sql: &str) -> String {
        self.psql("app", sql)
    }

    /// As a standby refuses writes (25006), and as a promoted one takes them again:
    /// every session's next transaction sees it.
    fn set_read_only(&self, on: bool) {
        let value = if on { "on" } else { "off" };
        self.sql(&format!(
            "ALTER SYSTEM SET default_transaction_read_only = {value}"
        ));
        self.sql("SELECT pg_reload_conf()");
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// SIGKILLed: the host is gone, its sessions with it.
    fn kill(&self) {
        let pid = std::fs::read_to_string(self.dir.join("data/postmaster.pid")).unwrap();
        let pid = pid.lines().next().unwrap().trim().to_owned();
        // The postmaster and its backends at once, as a lost machine takes them (a
        // backend whose postmaster died serves its client until it notices).
        let _ = Command::new("kill").args(["-STOP", &pid]).status();
        let _ = Command::new("pkill").args(["-KILL", "-P", &pid]).status();
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
    }

    fn written(&self) -> i64 {
        self.sql_app("SELECT count(*) FROM writes").parse().unwrap()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        as_postgres(
            &format!("{BIN}/pg_ctl"),
            &["-D", &data.to_string_lossy(), "-m", "immediate", "stop"],
        );
        let _ = Command::new("pkill")
            .args(["-KILL", "-f", &data.to_string_lossy()])
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Writes `n` through `pool` until one succeeds, within `limit`; returns how many
/// tries failed first.
async fn write(pool: &PgPool, n: i32, limit: Duration) -> usize {
    let deadline = Instant::now() + limit;
    let mut failed = 0;
    loop {
        match sqlx::query("INSERT INTO writes (n) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(n)
            .execute(pool)
            .await
        {
            Ok(_) => return failed,
            Err(error) => {
                failed += 1;
                assert!(
                    Instant::now() < deadline,
                    "write {n} still failing after {limit:?}: {error}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_list_follows_the_writable_host_when_one_turns_read_only_or_dies() {
    if let Some(why) = cannot_run() {
        assert_ne!(
            std::env::var("IDEM_TEST_PG_HOSTS").as_deref(),
            Ok("required"),
            "the host list test cannot run here: {why}"
        );
        eprintln!("skipped: the host list test needs root and PostgreSQL's binaries ({why})");
        return;
    }
    // The standby first in the list: the writable one is found, not just the first.
    let standby = Cluster::start(true);
    let primary = Cluster::start(false);
    let url = format!(
        "postgres://postgres@{},{}/app?target_session_attrs=read-write",
        standby.host(),
        primary.host()
    );
    // A database that does not exist yet is created on the writable host.
    let fresh = url.replace("/app?", "/fresh?");
    idem::db::create_database_if_missing(&fresh).await.unwrap();
    let exists = "SELECT count(*) FROM pg_database WHERE datname = 'fresh'";
    assert_eq!(
        (primary.sql(exists), standby.sql(exists)),
        ("1".into(), "0".into())
    );
    let pool = idem::db::connect(&url, 4).await.unwrap();
    for n in 0..20 {
        assert_eq!(write(&pool, n, Duration::ZERO).await, 0, "before the move");
    }
    assert_eq!((primary.written(), standby.written()), (20, 0));

    // A failover: the primary is demoted (read-only), the standby promoted.
    primary.set_read_only(true);
    standby.set_read_only(false);
    let moved = Instant::now();
    let mut failed = 0;
    for n in 20..60 {
        failed += write(&pool, n, Duration::from_secs(15)).await;
    }
    let settled = moved.elapsed();
    // Once moved, every write goes to the new primary at once: no connection of the
    // old one is handed out again.
    for n in 60..100 {
        assert_eq!(write(&pool, n, Duration::ZERO).await, 0, "after the move");
    }
    assert_eq!(primary.written(), 20, "nothing more on the demoted one");
    assert_eq!(standby.written(), 80);

    // The new primary dies; the old one is promoted back.
    primary.set_read_only(false);
    standby.kill();
    let killed = Instant::now();
    for n in 100..120 {
        write(&pool, n, Duration::from_secs(15)).await;
    }
    let back = killed.elapsed();
    assert_eq!(primary.written(), 40);
    pool.close().await;
    println!(
        "hosts: moved off a demoted primary in {:.1} s ({failed} writes refused meanwhile), off a killed one in {:.1} s",
        settled.as_secs_f64(),
        back.as_secs_f64()
    );
}
