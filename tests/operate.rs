//! Operating idem: the `idem` command (replay, discard, ops, gc, migrate) and metrics,
//! against real RabbitMQ and Postgres, with worker processes.

mod common;

use std::time::{Duration, Instant};

use common::*;
use idem::Key;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const SETTLE: Duration = Duration::from_secs(90);

/// A sequential worker: once a message published later is done, every earlier one is.
const SEQUENTIAL: &[&str] = &["--concurrency", "1", "--prefetch", "1"];

/// Waits until every one of `n` events has exactly its ledger row, via a sentinel order
/// that a sequential worker books only after everything before it.
async fn wait_all_booked(pool: &PgPool, n: usize) {
    wait_until(SETTLE, &format!("{n} events booked"), || async {
        ledger(pool).await.len() >= n
    })
    .await;
}

/// Waits until the `n` orders are booked, sends a sentinel order behind them and waits
/// for it too, then checks one ledger row per order and an empty DLQ.
async fn assert_settled_once_each(pool: &PgPool, q: &TestQueue, n: usize) {
    wait_all_booked(pool, n).await;
    q.publish(&order("sentinel", "globex", 1)).await;
    wait_all_booked(pool, n + 1).await;
    wait_until(SETTLE, "the queue drained", || async {
        q.counts(&q.name).await.0 == 0
    })
    .await;
    assert_once_each(&ledger(pool).await, n + 1);
    assert_eq!(q.counts(&q.dlq()).await.0, 0, "DLQ empty");
}

fn assert_once_each(ledger: &std::collections::BTreeMap<String, i64>, n: usize) {
    assert_eq!(ledger.len(), n, "none lost");
    assert!(
        ledger.values().all(|c| *c == 1),
        "one ledger row per order: {ledger:?}"
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn outage_drill_replay_books_each_order_once(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("drill").await;
    let url = database_url(&connect);
    const N: usize = 30;
    let dead = outage(&pool, &q, &url, N).await;

    let metrics_addr = free_addr();
    let _healthy = spawn_orders_worker(
        &url,
        &q.name,
        &[SEQUENTIAL, &["--metrics-addr", &metrics_addr]].concat(),
    );
    wait_for_consumers(&q, 1).await;
    let (code, dry) = run_idem(
        &url,
        &["dlq", "replay", "--queue", &q.name, "--dry-run", "--json"],
    )
    .await;
    assert_eq!(code, 0);
    let dry: Value = serde_json::from_str(&dry).unwrap();
    assert_eq!(dry["replayed"].as_u64().unwrap() as u32, dead);
    assert_eq!(
        q.counts(&q.dlq()).await.0,
        dead,
        "a dry run changes nothing"
    );

    let (code, out) = run_idem(&url, &["dlq", "replay", "--queue", &q.name, "--json"]).await;
    assert_eq!(code, 0);
    let summary: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        summary["replayed"].as_u64().unwrap() + summary["already_done"].as_u64().unwrap(),
        dead as u64
    );
    wait_all_booked(&pool, N).await;
    assert_eq!(q.counts(&q.dlq()).await.0, 0, "DLQ empty");
    // The worker counts the replayed deliveries apart, and none was dead-lettered again.
    let replayed = summary["replayed"].as_u64().unwrap();
    let deadline = Instant::now() + SETTLE;
    loop {
        let metrics = scrape(&metrics_addr, "/metrics").await.1;
        let lines: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with("idem_replayed_deliveries_total{"))
            .collect();
        assert!(
            !lines.iter().any(|l| l.contains("dead_lettered")),
            "{metrics}"
        );
        let counted: u64 = lines
            .iter()
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        if counted == replayed {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{counted} of {replayed} replays counted:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Late duplicates and a second replay: nothing new.
    for i in (0..N).step_by(2) {
        q.publish(&order_resent(&format!("evt-{i}"), "acme", 100 + i as i64))
            .await;
    }
    let (code, out) = run_idem(&url, &["dlq", "replay", "--queue", &q.name, "--json"]).await;
    assert_eq!(code, 0);
    let again: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(again["replayed"], 0);
    assert_settled_once_each(&pool, &q, N).await;
    let replays: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM processed_operations WHERE scope = 'acme' AND replay_count >= 1
           AND status = 'completed' AND dead_lettered_at IS NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        replays,
        N.div_ceil(2) as i64,
        "replay count kept on every replayed record"
    );
    println!(
        "outage drill: {N} orders, {dead} dead letters replayed, ledger rows {}",
        N + 1
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn two_replays_at_once_run_each_effect_once(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("two-replays").await;
    let url = database_url(&connect);
    const N: usize = 60;
    let dead = outage(&pool, &q, &url, N).await;

    let _healthy = spawn_orders_worker(&url, &q.name, &[]);
    wait_for_consumers(&q, 1).await;
    let a = idem_command(&url, &["dlq", "replay", "--queue", &q.name, "--json"]).output();
    let b = idem_command(&url, &["dlq", "replay", "--queue", &q.name, "--json"]).output();
    let (a, b) = tokio::join!(a, b);
    let (a, b) = (a.unwrap(), b.unwrap());
    assert!(a.status.success() && b.status.success());
    let total: u64 = [a.stdout, b.stdout]
        .iter()
        .map(|out| {
            let s: Value = serde_json::from_slice(out).unwrap();
            s["replayed"].as_u64().unwrap() + s["already_done"].as_u64().unwrap()
        })
        .sum();
    assert_eq!(
        total, dead as u64,
        "each dead letter handled by exactly one replay"
    );
    assert_settled_once_each(&pool, &q, N).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_replay_killed_midway_loses_and_doubles_nothing(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("replay-kill").await;
    let url = database_url(&connect);
    const N: usize = 80;
    let dead = outage(&pool, &q, &url, N).await;

    let _healthy = spawn_orders_worker(&url, &q.name, &[]);
    wait_for_consumers(&q, 1).await;
    let mut slow = idem_command(
        &url,
        &["dlq", "replay", "--queue", &q.name, "--max-rate", "20"],
    )
    .spawn()
    .unwrap();
    wait_until(SETTLE, "the replay to be under way", || async {
        ledger(&pool).await.len() >= N / 2 + 5
    })
    .await;
    slow.start_kill().unwrap();
    slow.wait().await.unwrap();
    // The broker requeues what the killed replay held once it sees the socket close.
    let deadline = Instant::now() + SETTLE;
    let mut last = u32::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = q.counts(&q.dlq()).await.0;
        if now == last {
            break;
        }
        assert!(Instant::now() < deadline, "the DLQ count never settled");
        last = now;
    }
    let left = last;
    assert!(
        left > 0 && left < dead,
        "killed midway: {left} of {dead} left"
    );

    let (code, _) = run_idem(&url, &["dlq", "replay", "--queue", &q.name]).await;
    assert_eq!(code, 0);
    assert_settled_once_each(&pool, &q, N).await;
    println!("replay killed with {left} of {dead} dead letters left; rerun finished them");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn discard_removes_dead_letters_and_records_the_decision(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("discard").await;
    let url = database_url(&connect);
    let _worker = spawn_orders_worker(&url, &q.name, &[]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    q.publish(&order("evt-bad", "acme", -1)).await;
    q.publish(b"garbage").await;
    q.wait_for_messages(&q.dlq(), 2, SETTLE).await;

    let (code, out) = run_idem(&url, &["dlq", "list", "--queue", &q.name, "--json"]).await;
    assert_eq!(code, 0);
    let list: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(list["messages"], 2);
    let reasons: Vec<&str> = list["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["reason"].as_str().unwrap())
        .collect();
    assert_eq!(reasons, vec!["malformed", "permanent_failure"]);
    assert_eq!(q.counts(&q.dlq()).await.0, 2, "listing removes nothing");

    let (code, out) = run_idem(
        &url,
        &[
            "dlq", "show", "--queue", &q.name, "--key", "evt-bad", "--json",
        ],
    )
    .await;
    assert_eq!(code, 0);
    let shown: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(shown["reason"], "permanent_failure");
    assert_eq!(shown["error"], "invalid amount");
    assert!(shown["body"].as_str().unwrap().contains("evt-bad"));

    let (code, _) = run_idem(
        &url,
        &[
            "dlq",
            "discard",
            "--queue",
            &q.name,
            "--reason",
            "permanent_failure",
        ],
    )
    .await;
    assert_eq!(code, 0);
    assert_eq!(
        q.counts(&q.dlq()).await.0,
        1,
        "only the selected reason discarded"
    );
    let (discarded, expires): (bool, bool) = sqlx::query_as(
        "SELECT discarded_at IS NOT NULL, expires_at IS NOT NULL AND dead_lettered_at IS NULL
         FROM processed_operations WHERE idempotency_key = 'evt-bad'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(discarded && expires);
    // Replay leaves the malformed one where it is.
    let (code, out) = run_idem(&url, &["dlq", "replay", "--queue", &q.name, "--json"]).await;
    assert_eq!(code, 0);
    let summary: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(summary["malformed_left"], 1);
    assert_eq!(q.counts(&q.dlq()).await.0, 1);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn ops_take_the_logged_key_hash_and_inspecting_never_creates_a_database(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    let key = Key::new("acme", "orders.create", "evt-hashed").unwrap();
    let claimed = |key| RecordFixture {
        key,
        lease_secs: Some(30),
        ..RecordFixture::default()
    };
    insert_record(&pool, &claimed("evt-hashed")).await;
    // A neighbour in the same scope and operation that the hash must not pick.
    insert_record(&pool, &claimed("evt-other")).await;
    let hash = key.short_hash();
    let by_hash = [
        "--scope",
        "acme",
        "--operation",
        "orders.create",
        "--key",
        &hash,
    ];

    let (code, out) = run_idem(
        &url,
        &[&["ops", "show"][..], &by_hash, &["--json"]].concat(),
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let record: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(record["idempotency_key"], "evt-hashed");
    let (code, out) = run_idem(&url, &[&["ops", "release"][..], &by_hash].concat()).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("evt-hashed"), "{out}");

    // "No record" says where it looked.
    let out = idem_command(
        &url,
        &[
            "ops",
            "show",
            "--scope",
            "acme",
            "--operation",
            "orders.create",
            "--key",
            "evt-none",
        ],
    )
    .output()
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let database = connect.get_database().unwrap();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no record for")
            && stderr.contains("idem: database ")
            && stderr.contains(database),
        "{stderr}"
    );

    // A database that does not exist: an error that names it, and still no database.
    let missing = format!("idem_missing_{}", uuid::Uuid::new_v4().simple());
    let missing_url = database_url(&connect.clone().database(&missing));
    for args in [
        &["ops", "list", "--status", "processing"][..],
        &[
            "ops",
            "show",
            "--scope",
            "a",
            "--operation",
            "b",
            "--key",
            "c",
        ],
        &["gc"],
    ] {
        let out = idem_command(&missing_url, args).output().await.unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(&missing), "{args:?}: {stderr}");
    }
    let created: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&missing)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!created, "an inspecting command created {missing}");

    // A database without idem's schema: told to migrate, not answered "no record".
    let empty = format!("idem_empty_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {empty}")))
        .execute(&pool)
        .await
        .unwrap();
    let empty_url = database_url(&connect.clone().database(&empty));
    let out = idem_command(&empty_url, &["ops", "list", "--status", "pending"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("run `idem migrate` first"), "{stderr}");
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {empty}")))
        .execute(&pool)
        .await
        .unwrap();
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn ops_show_list_and_release(pool_options: PgPoolOptions, connect: PgConnectOptions) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    // Claimed by a worker that died: its lease runs for an hour.
    let stuck = RecordFixture {
        key: "evt-stuck",
        lease_secs: Some(3600),
        owner: "dead-worker",
        ..RecordFixture::default()
    };
    insert_record(&pool, &stuck).await;
    let key_args = [
        "--scope",
        "acme",
        "--operation",
        "orders.create",
        "--key",
        "evt-stuck",
    ];

    let (code, out) = run_idem(
        &url,
        &[&["ops", "show"][..], &key_args, &["--json"]].concat(),
    )
    .await;
    assert_eq!(code, 0);
    let record: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(record["status"], "processing");
    assert_eq!(record["owner"], "dead-worker");

    let (code, out) = run_idem(
        &url,
        &[
            "ops",
            "list",
            "--status",
            "processing",
            "--older-than",
            "0s",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, 0);
    let listed: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let (code, out) = run_idem(
        &url,
        &[
            "ops",
            "list",
            "--status",
            "processing",
            "--older-than",
            "1h",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, 0);
    assert_eq!(
        serde_json::from_str::<Value>(&out)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        0
    );

    // Released by hand: the lease ends now (that the next claim takes it over and the
    // dead worker is fenced is the store's to prove: src/store/tests/operate.rs).
    let (code, out) = run_idem(&url, &[&["ops", "release"][..], &key_args].concat()).await;
    assert_eq!(code, 0, "{out}");
    let released: bool = sqlx::query_scalar(
        "SELECT lease_expires_at <= now() FROM processed_operations
         WHERE idempotency_key = 'evt-stuck'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(released, "the lease ended");

    let (code, _) = run_idem(
        &url,
        &[
            "ops",
            "show",
            "--scope",
            "x",
            "--operation",
            "y",
            "--key",
            "nope",
        ],
    )
    .await;
    assert_eq!(code, 1, "a missing key is an error");

    // A pending key is not released (its lease is a reconciler's): released, it could
    // never be resolved as not applied, and a route without a reconciler would answer
    // 409 for it for ever. It stays resolvable.
    let pending = RecordFixture {
        key: "evt-pending",
        status: "pending",
        external_ref: Some("psp-9"),
        error: Some(json!("timeout")),
        ..RecordFixture::default()
    };
    let (_, token) = insert_record(&pool, &pending).await;
    let pending_args = [
        "--scope",
        "acme",
        "--operation",
        "orders.create",
        "--key",
        "evt-pending",
    ];
    let out = idem_command(&url, &[&["ops", "release"][..], &pending_args].concat())
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("is pending, not released"),
        "{said}"
    );
    let token = token.to_string();
    let resolve = [
        &[
            "ops",
            "resolve",
            "--not-applied",
            "--token",
            &token,
            "--note",
            "checked",
        ][..],
        &pending_args,
    ]
    .concat();
    let (code, out) = run_idem(&url, &resolve).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("resolved"), "{out}");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn migrate_creates_a_fresh_database_twice_in_a_row(
    _pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let name = format!(
        "idem_migrate_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let base = database_url(&connect);
    let url = format!("{}/{name}", base.rsplit_once('/').unwrap().0);
    for _ in 0..2 {
        let (code, out) = run_idem(&url, &["migrate"]).await;
        assert_eq!(code, 0);
        assert!(out.contains("migrations up to date"), "{out}");
    }
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect.clone())
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {name} WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .unwrap();
    // Unreachable Postgres: one readable line with the cause.
    let out = idem_command("postgres://postgres@127.0.0.1:1/x", &["migrate"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("cannot reach Postgres at 127.0.0.1:1"),
        "{stderr}"
    );
}

/// Processes that start together on a fresh database (through PgBouncer in transaction
/// pooling in `scripts/test`'s third pass, where a session lock would not hold) create
/// and migrate it once: every one succeeds, and each migration is recorded once.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn four_processes_migrating_a_fresh_database_at_once_all_succeed(
    _pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let name = format!(
        "idem_migrate_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let base = database_url(&connect);
    let url = format!("{}/{name}", base.rsplit_once('/').unwrap().0);
    let runs: Vec<_> = (0..4)
        .map(|_| idem_command(&url, &["migrate"]).output())
        .collect();
    for out in futures_util::future::join_all(runs).await {
        let out = out.unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect.clone().database(&name))
        .await
        .unwrap();
    let (rows, versions): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT version) FROM idem_migrations")
            .fetch_one(&pool)
            .await
            .unwrap();
    pool.close().await;
    assert_eq!(rows, idem::db::MIGRATOR.iter().count() as i64);
    assert_eq!(versions, rows);
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {name} WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .unwrap();
}

/// A rollback: this build meets a database that a newer idem migrated further. It
/// starts (and leaves the unknown migration alone) instead of refusing.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn an_older_build_accepts_a_database_migrated_further(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    sqlx::query(
        "INSERT INTO idem_migrations (version, description, success, checksum, execution_time)
         VALUES (99991231000000, 'from a newer idem', true, '\\x00', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (code, out) = run_idem(&database_url(&connect), &["migrate"]).await;
    assert_eq!(code, 0, "{out}");
    let newer: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_migrations WHERE version = 99991231000000")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(newer, 1, "the newer migration's record is left alone");
}

/// A database an older idem migrated (here: the outbox's migration not recorded): the
/// inspecting commands say which migrations are missing instead of failing half-way;
/// `idem migrate` brings it up to date (the migration is safe to apply again).
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn commands_on_a_database_behind_this_build_ask_for_migrate(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    sqlx::query("DELETE FROM idem_migrations WHERE version = 20261201000003")
        .execute(&pool)
        .await
        .unwrap();
    let url = database_url(&connect);
    let out = idem_command(&url, &["gc"]).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("lacks migrations 20261201000003 outbox; run `idem migrate` first"),
        "{stderr}"
    );
    let (code, out) = run_idem(&url, &["migrate"]).await;
    assert_eq!(code, 0, "{out}");
    let (code, out) = run_idem(&url, &["gc"]).await;
    assert_eq!(code, 0, "{out}");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn gc_of_200k_expired_rows_never_blocks_live_claims(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    const EXPIRED: i64 = 200_000;
    let insert = |n: i64, prefix: &str, expires: &str, pinned: bool| {
        format!(
            "INSERT INTO processed_operations
               (scope, operation, idempotency_key, payload_sha256, status, lease_token,
                completed_at, expires_at, dead_lettered_at, dead_letters)
             SELECT 'bulk', 'orders.create', '{prefix}-' || i, repeat('a', 64), 'completed',
                    nextval('processed_operations_lease_token_seq'), now(), {expires}, {}
             FROM generate_series(1, {n}) AS i",
            if pinned { "now(), 1" } else { "NULL, 0" }
        )
    };
    for sql in [
        insert(EXPIRED, "expired", "now() - interval '1 day'", false),
        insert(500, "pinned", "now() - interval '1 day'", true),
        insert(500, "fresh", "now() + interval '1 day'", false),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    }

    // Live traffic through a worker process while gc runs.
    let q = TestQueue::new("gc").await;
    let _worker = spawn_orders_worker(&url, &q.name, &[]);
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    let mut gc = idem_command(&url, &["gc", "--batch", "1000"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The probe's statements give up after waiting 250 ms for a lock: waiting for gc
    // (a lock held by a batch) fails the test, however slow the disk is meanwhile.
    let probe_pool = PgPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::Executor::execute(conn, "SET lock_timeout = '250ms'")
                    .await
                    .map(drop)
            })
        })
        .connect_with(connect.clone())
        .await
        .unwrap();
    let started = Instant::now();
    let mut longest = Duration::ZERO;
    let mut claims = 0;
    loop {
        if let Some(status) = gc.try_wait().unwrap() {
            assert!(status.success());
            break;
        }
        q.publish(&order(&format!("live-{claims}"), "acme", 1))
            .await;
        // A claim and its completion: the writes a worker makes to the table gc
        // deletes from (the worker beside it makes them too, through the store).
        let t = Instant::now();
        let probe = RecordFixture {
            scope: "probe",
            key: &format!("probe-{claims}"),
            lease_secs: Some(30),
            ..RecordFixture::default()
        };
        let (id, token) = insert_record(&probe_pool, &probe).await;
        let completed = sqlx::query(
            "UPDATE processed_operations SET status = 'completed', lease_expires_at = NULL,
                    completed_at = now(), expires_at = now() + interval '7 days'
             WHERE id = $1 AND lease_token = $2 AND status = 'processing'",
        )
        .bind(id)
        .bind(token)
        .execute(&probe_pool)
        .await;
        if let Err(error) = completed {
            panic!("a completion waited on gc: {error}");
        }
        longest = longest.max(t.elapsed());
        claims += 1;
    }
    let gc_took = started.elapsed();
    wait_until(SETTLE, "live traffic booked", || async {
        ledger(&pool).await.len() == claims
    })
    .await;

    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        count("SELECT count(*) FROM processed_operations WHERE idempotency_key LIKE 'expired-%'")
            .await,
        0
    );
    assert_eq!(
        count("SELECT count(*) FROM processed_operations WHERE idempotency_key LIKE 'pinned-%'")
            .await,
        500
    );
    assert_eq!(
        count("SELECT count(*) FROM processed_operations WHERE idempotency_key LIKE 'fresh-%'")
            .await,
        500
    );
    assert_once_each(&ledger(&pool).await, claims);
    println!(
        "gc: {EXPIRED} expired rows deleted in {:.1} s beside live traffic; {claims} claim+complete round trips meanwhile, longest {:.1} ms",
        gc_took.as_secs_f64(),
        longest.as_secs_f64() * 1000.0
    );
    assert!(claims >= 5, "claims ran during gc");
    // No lock wait (above); what is left is the machine's: a 2-core box flushing the
    // WAL of 200k deletes stalls a commit for up to a second at times.
    assert!(
        longest < Duration::from_secs(5),
        "a claim took {longest:?} beside gc"
    );
}

fn counter(metrics: &str, outcome: &str) -> u64 {
    let needle = format!("outcome=\"{outcome}\"");
    metrics
        .lines()
        .find(|l| l.starts_with("idem_deliveries_total{") && l.contains(&needle))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn metrics_after_a_known_scenario_match_it(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("metrics").await;
    let addr = free_addr();
    let notify = q.beside("notify").await;
    let _worker = spawn_orders_worker(
        &database_url(&connect),
        &q.name,
        &[
            SEQUENTIAL,
            &["--metrics-addr", &addr, "--follow-ups", &notify.name],
        ]
        .concat(),
    );
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    let (status, body) = scrape(&addr, "/healthz").await;
    assert_eq!(status, 200, "{body}");

    for i in 0..5 {
        q.publish(&order(&format!("evt-{i}"), "acme", 10)).await;
    }
    for i in 0..3 {
        q.publish(&order_resent(&format!("evt-{i}"), "acme", 10))
            .await;
    }
    q.publish(&order("evt-0", "acme", 11)).await; // conflict
    q.publish(b"nope").await;
    q.publish(b"[]").await;
    q.publish(&order("evt-neg", "acme", -1)).await;
    q.wait_for_messages(&q.dlq(), 4, SETTLE).await;

    let deadline = Instant::now() + SETTLE;
    let metrics = loop {
        let metrics = scrape(&addr, "/metrics").await.1;
        if counter(&metrics, "failed_permanent") == 1 {
            break metrics;
        }
        assert!(
            Instant::now() < deadline,
            "counters never showed up:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let expected = [
        ("executed", 5),
        ("duplicate_completed", 3),
        ("conflict", 1),
        ("malformed", 2),
        ("failed_permanent", 1),
        ("dead_lettered", 4),
        ("takeover", 0),
        ("failed_transient", 0),
    ];
    for (outcome, n) in expected {
        assert_eq!(counter(&metrics, outcome), n, "{outcome} in\n{metrics}");
    }
    assert!(
        metrics.contains("idem_handler_duration_seconds_count{operation=\"orders.create\"} 6"),
        "{metrics}"
    );
    assert!(metrics.contains("idem_store_round_trip_seconds_bucket{call=\"claim_many\""));
    assert!(metrics.contains("idem_oldest_pending_age_seconds"));
    assert!(metrics.contains("idem_oldest_processing_age_seconds"));
    // Both reachable: the store and broker gauges say so.
    assert!(metrics.contains("idem_store_up 1"), "{metrics}");
    assert!(metrics.contains("idem_broker_up 1"), "{metrics}");
    // One follow-up per booked order, published after its commit.
    notify.wait_for_messages(&notify.name, 5, SETTLE).await;
    wait_until(SETTLE, "the follow-ups counted", || async {
        let metrics = scrape(&addr, "/metrics").await.1;
        metrics.contains("idem_outbox_published_total 5")
    })
    .await;

    // A backlog (messages no publisher may take for an hour) shows in the gauges, and
    // /healthz stays 200: a backlog is not an outage.
    sqlx::query(
        "INSERT INTO outbox_messages (message_id, source, operation, position, exchange,
             routing_key, body, properties, staged_at, available_at)
         SELECT 'held-' || i, repeat('c', 64), 'orders.create', 0, '', 'nowhere', '', '{}',
                now() - interval '10 minutes', now() + interval '1 hour'
         FROM generate_series(1, 7) AS i",
    )
    .execute(&pool)
    .await
    .unwrap();
    wait_until(SETTLE, "the backlog in the gauges", || async {
        let metrics = scrape(&addr, "/metrics").await.1;
        metrics.contains("idem_outbox_pending 7")
            && metrics
                .lines()
                .find(|l| l.starts_with("idem_outbox_oldest_age_seconds "))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .is_some_and(|age| age >= 600.0)
    })
    .await;
    assert_eq!(scrape(&addr, "/healthz").await.0, 200);
    assert_eq!(scrape(&addr, "/nope").await.0, 404);
}

/// A dry run reads the records of all the selected dead letters in one statement
/// (`Store::completed`) and still tells them apart: a completed key would only be
/// acked; a failed or unknown one would run again; a conflict stays. Nothing changes.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_dry_run_tells_completed_keys_from_those_that_would_run(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("dry-run").await;
    for (key, status) in [("evt-done", "completed"), ("evt-failed", "failed")] {
        let record = RecordFixture {
            key,
            status,
            ..RecordFixture::default()
        };
        insert_record(&pool, &record).await;
    }
    idem::Topology {
        queue: q.name.clone(),
        queue_type: idem::QueueType::Classic,
        retry_delays: RETRY_DELAYS_MS.map(Duration::from_millis).to_vec(),
        subscriptions: Vec::new(),
        single_active_consumer: false,
    }
    .declare(&q.connection)
    .await
    .unwrap();
    let letter = |id: &str, reason: &str| {
        let mut headers = lapin::types::FieldTable::default();
        for (name, value) in [
            (idem::headers::REASON, reason),
            (idem::headers::SCOPE, "acme"),
            (idem::headers::OPERATION, "orders.create"),
            (idem::headers::KEY, id),
        ] {
            headers.insert(name.into(), header_text(value));
        }
        lapin::BasicProperties::default().with_headers(headers)
    };
    for (id, reason) in [
        ("evt-done", "permanent_failure"),
        ("evt-failed", "permanent_failure"),
        ("evt-unknown", "permanent_failure"),
        ("evt-done", "fingerprint_conflict"),
        ("evt-done", "permanent_failure"),
    ] {
        q.publish_to(&q.dlq(), b"{}", letter(id, reason)).await;
    }
    let (code, out) = run_idem(
        &database_url(&connect),
        &["dlq", "replay", "--queue", &q.name, "--dry-run", "--json"],
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let summary: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(summary["already_done"], 2, "{summary}");
    assert_eq!(summary["replayed"], 2, "{summary}");
    assert_eq!(summary["conflicts_left"], 1, "{summary}");
    assert_eq!(q.counts(&q.dlq()).await.0, 5, "a dry run changes nothing");
}
