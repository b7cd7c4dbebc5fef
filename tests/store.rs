//! The Postgres store against a real Postgres, one fresh database per test.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::{Claim, Fingerprint, Key, Lease, Origin, Status, Store, StoreConfig, StoreError};
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::Barrier;

const VOLATILE: &[&str] = &["sent_at"];

fn store(pool: &PgPool, lease: Duration) -> Store {
    Store::new(
        pool.clone(),
        StoreConfig {
            owner: "test-worker".into(),
            lease,
            ..StoreConfig::default()
        },
    )
}

fn key(id: &str) -> Key {
    Key::new("tenant-a", "orders.create", id).unwrap()
}

fn fp(payload: &Value) -> Fingerprint {
    Fingerprint::of(payload, VOLATILE)
}

const TRACE_A: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const TRACE_B: &str = "0af7651916cd43dd8448eb211c80319c";

fn origin() -> Origin {
    Origin {
        message_id: Some("msg-1".into()),
        correlation_id: Some("corr-1".into()),
        trace_id: Some(TRACE_A.into()),
    }
}

async fn claimed(store: &Store, key: &Key, payload: &Value) -> Lease {
    match store.claim(key, &fp(payload), &origin()).await.unwrap() {
        Claim::Claimed(lease) => lease,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// Waits, on the database clock, until the lease of `key` has lapsed.
async fn wait_for_lease_expiry(pool: &PgPool, key: &Key) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lapsed: bool = sqlx::query_scalar(
            "SELECT lease_expires_at <= clock_timestamp() FROM processed_operations
             WHERE scope = $1 AND operation = $2 AND idempotency_key = $3",
        )
        .bind(key.scope())
        .bind(key.operation())
        .bind(key.idempotency_key())
        .fetch_one(pool)
        .await
        .unwrap();
        if lapsed {
            return;
        }
        assert!(Instant::now() < deadline, "lease did not lapse in time");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A pool whose `n` connections are all open before the race starts, so every claimer
/// runs on its own connection.
/// (Its own pool: one derived from the test's options may not exceed the test
/// harness's 20 connections.)
async fn warm_pool(connect: PgConnectOptions, n: u32) -> PgPool {
    let pool = PgPoolOptions::new()
        .max_connections(n)
        .min_connections(n)
        .test_before_acquire(false)
        .connect_with(connect)
        .await
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..n {
        held.push(pool.acquire().await.unwrap());
    }
    drop(held);
    pool
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn first_claim_runs_then_completed_result_is_returned_unchanged(pool: PgPool) {
    let store = store(&pool, Duration::from_secs(30));
    let k = key("evt-1");
    let payload = json!({"event_id": "evt-1", "amount": 10, "sent_at": "t1"});

    let lease = claimed(&store, &k, &payload).await;
    assert_eq!(lease.attempt, 1);
    assert!(!lease.takeover);
    let result = json!({"order": 42, "note": "ünïcode"});
    store.complete(&lease, &result).await.unwrap();

    let before = store.get(&k).await.unwrap().unwrap();
    assert_eq!(before.status, Status::Completed);
    assert_eq!(before.message_id.as_deref(), Some("msg-1"));
    assert_eq!(before.correlation_id.as_deref(), Some("corr-1"));
    assert_eq!(before.trace_id.as_deref(), Some(TRACE_A));
    assert_eq!(before.owner.as_deref(), Some("test-worker"));
    assert!(before.completed_at.is_some());
    let retention = before.expires_at.unwrap() - before.completed_at.unwrap();
    assert_eq!(retention.num_days(), 7);

    for _ in 0..3 {
        let again = store.claim(&k, &fp(&payload), &origin()).await.unwrap();
        assert_eq!(
            again,
            Claim::Completed {
                result: Some(result.clone())
            }
        );
    }
    let after = store.get(&k).await.unwrap().unwrap();
    assert_eq!(after.attempts, 1);
    assert_eq!(after.updated_at, before.updated_at);
    // A completed record can no longer be written with its old lease.
    assert!(matches!(
        store.complete(&lease, &json!("again")).await,
        Err(StoreError::LeaseLost { .. })
    ));
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn fifty_concurrent_claimers_of_a_new_key_exactly_one_wins(
    _options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    const CLAIMERS: usize = 50;
    const ROUNDS: usize = 20;
    let pool = warm_pool(connect, CLAIMERS as u32).await;
    sqlx::migrate!("./migrations").run(&pool).await.unwrap();
    let store = store(&pool, Duration::from_secs(30));
    let payload = json!({"event_id": "race", "amount": 1});

    for round in 0..ROUNDS {
        let k = key(&format!("race-{round}"));
        let barrier = Arc::new(Barrier::new(CLAIMERS));
        let mut tasks = Vec::new();
        for _ in 0..CLAIMERS {
            let (store, k, payload, barrier) =
                (store.clone(), k.clone(), payload.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                store.claim(&k, &fp(&payload), &origin()).await.unwrap()
            }));
        }
        let mut won = 0;
        let mut in_progress = 0;
        for task in tasks {
            match task.await.unwrap() {
                Claim::Claimed(lease) => {
                    assert_eq!(lease.attempt, 1);
                    won += 1;
                }
                Claim::InProgress { .. } => in_progress += 1,
                other => panic!("unexpected claim {other:?}"),
            }
        }
        assert_eq!((won, in_progress), (1, CLAIMERS - 1), "round {round}");
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, ROUNDS as i64);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn same_key_other_payload_is_a_conflict_and_changes_nothing(pool: PgPool) {
    let store = store(&pool, Duration::from_secs(30));
    let k = key("evt-c");
    let original =
        json!({"event_id": "evt-c", "amount": 10, "meta": {"a": 1, "b": 2}, "sent_at": "t1"});

    // While processing, and after completion: a changed payload is always a conflict.
    let lease = claimed(&store, &k, &original).await;
    let changed =
        json!({"event_id": "evt-c", "amount": 11, "meta": {"a": 1, "b": 2}, "sent_at": "t1"});
    let conflict = store.claim(&k, &fp(&changed), &origin()).await.unwrap();
    assert_eq!(
        conflict,
        Claim::Conflict {
            stored: fp(&original)
        }
    );
    store.complete(&lease, &json!({"ok": true})).await.unwrap();

    let before = store.get(&k).await.unwrap().unwrap();
    for _ in 0..3 {
        assert!(matches!(
            store.claim(&k, &fp(&changed), &origin()).await.unwrap(),
            Claim::Conflict { .. }
        ));
    }
    let after = store.get(&k).await.unwrap().unwrap();
    assert_eq!(
        serde_json::to_value(&before).unwrap(),
        serde_json::to_value(&after).unwrap()
    );

    // Keys reordered and the volatile field changed: the same intent.
    let resent: Value = serde_json::from_str(
        r#"{"sent_at": "t2", "meta": {"b": 2, "a": 1}, "amount": 10, "event_id": "evt-c"}"#,
    )
    .unwrap();
    assert_eq!(
        store.claim(&k, &fp(&resent), &origin()).await.unwrap(),
        Claim::Completed {
            result: Some(json!({"ok": true}))
        }
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn identical_payloads_under_other_keys_are_independent_intents(pool: PgPool) {
    let store = store(&pool, Duration::from_secs(30));
    let payload = json!({"amount": 100, "currency": "UAH"});
    let keys = [
        Key::new("tenant-a", "payments.charge", "evt-1").unwrap(),
        Key::new("tenant-a", "payments.charge", "evt-2").unwrap(),
        Key::new("tenant-b", "payments.charge", "evt-1").unwrap(),
        Key::new("tenant-a", "payments.refund", "evt-1").unwrap(),
    ];
    let mut tokens = Vec::new();
    for k in &keys {
        let lease = claimed(&store, k, &payload).await;
        tokens.push(lease.token);
        store
            .complete(&lease, &json!(k.short_hash()))
            .await
            .unwrap();
    }
    tokens.dedup();
    assert_eq!(tokens.len(), keys.len());
    for k in &keys {
        let record = store.get(k).await.unwrap().unwrap();
        assert_eq!(record.status, Status::Completed);
        assert_eq!(record.result, Some(json!(k.short_hash())));
    }
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn expired_lease_is_taken_over_by_exactly_one_and_the_old_token_is_fenced(
    _options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    const TAKERS: usize = 20;
    let pool = warm_pool(connect, TAKERS as u32).await;
    sqlx::migrate!("./migrations").run(&pool).await.unwrap();
    let short = store(&pool, Duration::from_millis(300));
    let k = key("evt-lease");
    let payload = json!({"event_id": "evt-lease"});

    let old = claimed(&short, &k, &payload).await;
    // Live lease: nobody else may take it.
    assert!(matches!(
        short.claim(&k, &fp(&payload), &origin()).await.unwrap(),
        Claim::InProgress { .. }
    ));
    wait_for_lease_expiry(&pool, &k).await;

    let long = store(&pool, Duration::from_secs(30));
    let barrier = Arc::new(Barrier::new(TAKERS));
    let mut tasks = Vec::new();
    for _ in 0..TAKERS {
        let (store, k, payload, barrier) =
            (long.clone(), k.clone(), payload.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            store.claim(&k, &fp(&payload), &origin()).await.unwrap()
        }));
    }
    let mut winners = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            Claim::Claimed(lease) => winners.push(lease),
            Claim::InProgress { .. } => {}
            other => panic!("unexpected claim {other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one takeover");
    let new = &winners[0];
    assert!(new.takeover);
    assert_eq!(new.attempt, 2);
    assert!(new.token > old.token, "fencing tokens only grow");

    // The old owner is told, on every kind of write.
    let lost = |r: Result<(), StoreError>| matches!(r, Err(StoreError::LeaseLost { token }) if token == old.token);
    assert!(lost(short.complete(&old, &json!("zombie")).await));
    assert!(lost(short.fail(&old, true, &json!("zombie"), false).await));
    assert!(lost(
        short
            .mark_pending(&old, Some("ref"), &json!("zombie"))
            .await
    ));
    assert!(matches!(
        short.heartbeat(&old).await,
        Err(StoreError::LeaseLost { .. })
    ));
    let record = long.get(&k).await.unwrap().unwrap();
    assert_eq!(record.status, Status::Processing);
    assert_eq!(record.lease_token, new.token);
    assert_eq!(record.attempts, 2);
    assert_eq!(record.result, None);

    // The new owner heartbeats and completes.
    let extended = long.heartbeat(new).await.unwrap();
    assert!(extended >= new.expires_at);
    long.complete(new, &json!("done")).await.unwrap();
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn atomic_completion_commits_or_rolls_back_with_the_callers_writes(pool: PgPool) {
    sqlx::query("CREATE TABLE ledger (event_id text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let ledger_rows = |event: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM ledger WHERE event_id = $1")
                .bind(event)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let store = store(&pool, Duration::from_secs(30));

    // Committed: both visible.
    let k = key("evt-ok");
    let lease = claimed(&store, &k, &json!({})).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO ledger VALUES ('evt-ok')")
        .execute(&mut *tx)
        .await
        .unwrap();
    store
        .complete_in(&mut *tx, &lease, &json!("ok"))
        .await
        .unwrap();
    assert_eq!(ledger_rows("evt-ok").await, 0, "not visible before commit");
    tx.commit().await.unwrap();
    assert_eq!(ledger_rows("evt-ok").await, 1);
    assert_eq!(
        store.get(&k).await.unwrap().unwrap().status,
        Status::Completed
    );

    // Completion written but the transaction rolled back: neither is visible.
    let k = key("evt-rollback");
    let lease = claimed(&store, &k, &json!({})).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO ledger VALUES ('evt-rollback')")
        .execute(&mut *tx)
        .await
        .unwrap();
    store
        .complete_in(&mut *tx, &lease, &json!("ok"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(ledger_rows("evt-rollback").await, 0);
    assert_eq!(
        store.get(&k).await.unwrap().unwrap().status,
        Status::Processing
    );

    // Stale token (another worker took over): completion refused, both roll back.
    let short = self::store(&pool, Duration::from_millis(200));
    let k = key("evt-stale");
    let stale = claimed(&short, &k, &json!({})).await;
    wait_for_lease_expiry(&pool, &k).await;
    let fresh = claimed(&store, &k, &json!({})).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO ledger VALUES ('evt-stale')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let refused = short.complete_in(&mut *tx, &stale, &json!("zombie")).await;
    assert!(matches!(refused, Err(StoreError::LeaseLost { .. })));
    tx.rollback().await.unwrap();
    assert_eq!(ledger_rows("evt-stale").await, 0);
    let record = store.get(&k).await.unwrap().unwrap();
    assert_eq!(
        (record.status, record.lease_token),
        (Status::Processing, fresh.token)
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_takeover_waits_for_an_uncommitted_completion_and_then_sees_it(pool: PgPool) {
    // A zombie's completion that is written but not yet committed holds the row: a
    // takeover racing it must not run the handler a second time.
    let short = store(&pool, Duration::from_millis(200));
    let k = key("evt-zombie");
    let lease = claimed(&short, &k, &json!({})).await;
    wait_for_lease_expiry(&pool, &k).await;
    let mut tx = pool.begin().await.unwrap();
    short
        .complete_in(&mut *tx, &lease, &json!("first"))
        .await
        .unwrap();
    let taker = {
        let store = store(&pool, Duration::from_secs(30));
        let k = k.clone();
        tokio::spawn(async move { store.claim(&k, &fp(&json!({})), &origin()).await })
    };
    // The taker is blocked on the row lock until we commit.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "taker never blocked on the row");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!taker.is_finished());
    tx.commit().await.unwrap();
    let seen = taker.await.unwrap().unwrap();
    assert_eq!(
        seen,
        Claim::Completed {
            result: Some(json!("first"))
        }
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn retryable_failures_reclaim_permanent_ones_do_not_and_pending_is_reconciled(pool: PgPool) {
    let store = store(&pool, Duration::from_secs(30));
    let payload = json!({"event_id": "e"});

    // Retryable: a later delivery claims again, attempt 2, not a takeover.
    let k = key("evt-retry");
    let first = claimed(&store, &k, &payload).await;
    store
        .fail(&first, true, &json!({"error": "timeout"}), false)
        .await
        .unwrap();
    let second = claimed(&store, &k, &payload).await;
    assert_eq!(second.attempt, 2);
    assert!(!second.takeover);
    assert!(second.token > first.token);
    assert!(matches!(
        store.fail(&first, true, &json!("stale"), false).await,
        Err(StoreError::LeaseLost { .. })
    ));
    store.complete(&second, &json!("ok")).await.unwrap();

    // Permanent: never claimed again.
    let k = key("evt-permanent");
    let lease = claimed(&store, &k, &payload).await;
    store
        .fail(&lease, false, &json!({"error": "invalid amount"}), false)
        .await
        .unwrap();
    store.pin(lease.id).await.unwrap();
    store.mark_dead_lettered(lease.id).await.unwrap();
    for _ in 0..3 {
        assert_eq!(
            store.claim(&k, &fp(&payload), &origin()).await.unwrap(),
            Claim::FailedForGood {
                id: lease.id,
                error: Some(json!({"error": "invalid amount"})),
                attempts: 1,
                dead_lettered: true,
            }
        );
    }

    // Pending: a claim is never a fresh run; it gets a lease to reconcile with the ref,
    // and a concurrent claimer is told it is in progress.
    let k = key("evt-pending");
    let lease = claimed(&store, &k, &payload).await;
    store
        .mark_pending(
            &lease,
            Some("psp-123"),
            &json!({"error": "timeout after send"}),
        )
        .await
        .unwrap();
    let reconcile = match store.claim(&k, &fp(&payload), &origin()).await.unwrap() {
        Claim::Pending {
            lease,
            external_ref,
        } => {
            assert_eq!(external_ref.as_deref(), Some("psp-123"));
            assert!(!lease.takeover);
            lease
        }
        other => panic!("expected pending, got {other:?}"),
    };
    assert!(matches!(
        store.claim(&k, &fp(&payload), &origin()).await.unwrap(),
        Claim::InProgress { .. }
    ));
    assert_eq!(
        store.get(&k).await.unwrap().unwrap().status,
        Status::Pending
    );
    // Still unknown: back to pending, reconciled again by the next delivery.
    store
        .mark_pending(&reconcile, None, &json!({"error": "still unknown"}))
        .await
        .unwrap();
    let again = match store.claim(&k, &fp(&payload), &origin()).await.unwrap() {
        Claim::Pending {
            lease,
            external_ref,
        } => {
            assert_eq!(external_ref.as_deref(), Some("psp-123"), "ref is kept");
            lease
        }
        other => panic!("expected pending, got {other:?}"),
    };
    // Reconcile found it applied: completed with the provider's result.
    store
        .complete(&again, &json!({"charge": "psp-123"}))
        .await
        .unwrap();
    assert!(matches!(
        store.claim(&k, &fp(&payload), &origin()).await.unwrap(),
        Claim::Completed { .. }
    ));
}

/// An operation that was ever uncertain is handed out for reconciliation, never for a
/// run, whatever path leads back to it: a reconcile that failed for good and a replay,
/// a result that could not be stored and a replay, a released lease, a takeover, and a
/// batch claim.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn an_operation_ever_uncertain_is_only_ever_handed_out_to_reconcile(pool: PgPool) {
    let short = store(&pool, Duration::from_millis(200));
    let store = store(&pool, Duration::from_secs(30));
    let payload = json!({"event_id": "e"});
    let reconcile = |claim: Claim| match claim {
        Claim::Pending { lease, .. } => lease,
        other => panic!("expected a lease to reconcile, got {other:?}"),
    };

    // Pending, then reconcile fails for good; an operator replays it.
    let k = key("evt-reconcile-failed");
    let lease = claimed(&store, &k, &payload).await;
    store
        .mark_pending(&lease, Some("psp-1"), &json!("timeout"))
        .await
        .unwrap();
    let lease = reconcile(store.claim(&k, &fp(&payload), &origin()).await.unwrap());
    store
        .fail(&lease, false, &json!("lookup refused"), false)
        .await
        .unwrap();
    assert!(store.get(&k).await.unwrap().unwrap().reconcile_first);
    store.prepare_replay(&k, true).await.unwrap().unwrap();
    let lease = reconcile(store.claim(&k, &fp(&payload), &origin()).await.unwrap());

    // Reconcile said "not applied" and the run failed transiently: still reconciled
    // first next time (the run's own effect may be the uncertain one now).
    store
        .fail(&lease, true, &json!("blip"), false)
        .await
        .unwrap();
    reconcile(store.claim(&k, &fp(&payload), &origin()).await.unwrap());

    // The handler returned but its result could not be stored; an operator replays it.
    let k = key("evt-unstorable");
    let lease = claimed(&store, &k, &payload).await;
    store
        .fail(&lease, false, &json!("result refused"), true)
        .await
        .unwrap();
    store.prepare_replay(&k, true).await.unwrap().unwrap();
    reconcile(store.claim(&k, &fp(&payload), &origin()).await.unwrap());

    // Its reconciler's lease is not released by hand: it lapses on its own (below), and
    // released, the record could never be resolved as not applied.
    assert!(store.release(&k).await.unwrap().is_none());
    assert!(matches!(
        store.claim(&k, &fp(&payload), &origin()).await.unwrap(),
        Claim::InProgress { .. }
    ));

    // A reconciler that dies: its lease lapses and another takes over, to reconcile.
    let k = key("evt-takeover");
    let first = claimed(&short, &k, &payload).await;
    short
        .mark_pending(&first, None, &json!("timeout"))
        .await
        .unwrap();
    reconcile(short.claim(&k, &fp(&payload), &origin()).await.unwrap());
    wait_for_lease_expiry(&pool, &k).await;
    reconcile(store.claim(&k, &fp(&payload), &origin()).await.unwrap());

    // A batch decides the same.
    let k = key("evt-batch");
    let lease = claimed(&store, &k, &payload).await;
    store
        .fail(&lease, true, &json!("result refused"), true)
        .await
        .unwrap();
    let claims = store.claim_many(&[input(&k, &payload)]).await.unwrap();
    reconcile(claims.into_iter().next().unwrap());
}

/// A discarded failure counts as dead-lettered: a later duplicate is acked, not
/// dead-lettered again; a replay takes the decision back.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_discarded_failure_is_settled_until_replayed(pool: PgPool) {
    let store = store(&pool, Duration::from_secs(30));
    let payload = json!({"event_id": "e"});
    let k = key("evt-discarded");
    let lease = claimed(&store, &k, &payload).await;
    store
        .fail(&lease, false, &json!("invalid amount"), false)
        .await
        .unwrap();
    store.pin(lease.id).await.unwrap();
    store.mark_dead_lettered(lease.id).await.unwrap();
    store.discard(&k).await.unwrap().unwrap();
    assert!(matches!(
        store.claim(&k, &fp(&payload), &origin()).await.unwrap(),
        Claim::FailedForGood {
            dead_lettered: true,
            ..
        }
    ));
    let replayed = store.prepare_replay(&k, true).await.unwrap().unwrap();
    assert!(replayed.discarded_at.is_none());
    let again = claimed(&store, &k, &payload).await;
    store
        .fail(&again, false, &json!("invalid amount"), false)
        .await
        .unwrap();
    assert!(
        matches!(
            store.claim(&k, &fp(&payload), &origin()).await.unwrap(),
            Claim::FailedForGood {
                dead_lettered: false,
                ..
            }
        ),
        "a replayed failure's new dead letter is published"
    );
}

fn input(k: &Key, payload: &Value) -> idem::store::ClaimRequest {
    idem::store::ClaimRequest {
        key: k.clone(),
        fingerprint: fp(payload),
        origin: Origin {
            message_id: Some("m".into()),
            correlation_id: None,
            trace_id: None,
        },
    }
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_record_keeps_the_trace_of_the_claim_that_last_took_it(pool: PgPool) {
    let store = store(&pool, Duration::from_secs(30));
    let payload = json!({"event_id": "evt-t", "amount": 1});
    let (k, other) = (key("evt-t"), key("evt-u"));
    let traced = |trace: Option<&str>, k: &Key| {
        let mut request = input(k, &payload);
        request.origin.trace_id = trace.map(str::to_owned);
        request
    };
    let trace_of = |k: Key| {
        let store = store.clone();
        async move { store.get(&k).await.unwrap().unwrap().trace_id }
    };
    // Inserted by a single claim with trace A, failed for a retry.
    let first = claimed(&store, &k, &payload).await;
    store
        .fail(&first, true, &json!("timeout"), false)
        .await
        .unwrap();
    // A batch takes it over with trace B, and inserts another key with B.
    let claims = store
        .claim_many(&[traced(Some(TRACE_B), &k), traced(Some(TRACE_B), &other)])
        .await
        .unwrap();
    assert!(
        claims.iter().all(|c| matches!(c, Claim::Claimed(_))),
        "{claims:?}"
    );
    assert_eq!(trace_of(k.clone()).await.as_deref(), Some(TRACE_B));
    assert_eq!(trace_of(other.clone()).await.as_deref(), Some(TRACE_B));
    // A claim without a trace keeps the record's.
    let Claim::Claimed(second) = &claims[0] else {
        unreachable!()
    };
    store
        .fail(second, true, &json!("timeout"), false)
        .await
        .unwrap();
    let again = Origin {
        trace_id: None,
        ..origin()
    };
    let Claim::Claimed(third) = store.claim(&k, &fp(&payload), &again).await.unwrap() else {
        panic!("not taken")
    };
    assert_eq!(trace_of(k.clone()).await.as_deref(), Some(TRACE_B));
    // A single claim with a trace takes it over with that trace.
    store
        .fail(&third, true, &json!("timeout"), false)
        .await
        .unwrap();
    assert!(matches!(
        store.claim(&k, &fp(&payload), &origin()).await.unwrap(),
        Claim::Claimed(_)
    ));
    assert_eq!(trace_of(k).await.as_deref(), Some(TRACE_A));
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_batch_decides_each_claim_as_one_at_a_time_would(pool: PgPool) {
    let short = store(&pool, Duration::from_millis(200));
    let store = store(&pool, Duration::from_secs(30));
    let a = json!({"event_id": "a"});
    let b = json!({"event_id": "b"});
    // Existing records: completed, processing with a lapsed lease, failed (retryable
    // and for good), pending, and one completed with another payload.
    let done = key("done");
    let lease = claimed(&store, &done, &a).await;
    store.complete(&lease, &json!("stored")).await.unwrap();
    let lapsed = key("lapsed");
    let old = claimed(&short, &lapsed, &a).await;
    wait_for_lease_expiry(&pool, &lapsed).await;
    let retry = key("retry");
    let lease = claimed(&store, &retry, &a).await;
    store
        .fail(&lease, true, &json!("blip"), false)
        .await
        .unwrap();
    let dead = key("dead");
    let lease = claimed(&store, &dead, &a).await;
    store
        .fail(&lease, false, &json!("bad"), false)
        .await
        .unwrap();
    let pending = key("pending");
    let lease = claimed(&store, &pending, &a).await;
    store
        .mark_pending(&lease, Some("ref-1"), &json!("timeout"))
        .await
        .unwrap();
    let live = key("live");
    claimed(&store, &live, &a).await;

    let new1 = key("new-1");
    let new2 = key("new-2");
    let inputs = vec![
        input(&new1, &a),    // 0 new
        input(&done, &a),    // 1 completed
        input(&new1, &a),    // 2 same key again in the batch: in progress
        input(&done, &b),    // 3 conflict with the stored payload
        input(&lapsed, &a),  // 4 takeover
        input(&new2, &a),    // 5 new
        input(&new1, &b),    // 6 same key, other payload, in the batch: conflict
        input(&retry, &a),   // 7 retryable failure: re-claimed
        input(&dead, &a),    // 8 failed for good
        input(&pending, &a), // 9 pending: reconcile lease
        input(&live, &a),    // 10 live lease elsewhere: in progress
        input(&lapsed, &a),  // 11 the takeover's copy: in progress
    ];
    let claims = store.claim_many(&inputs).await.unwrap();
    assert_eq!(claims.len(), inputs.len());
    let claimed_new = |c: &Claim| matches!(c, Claim::Claimed(l) if l.attempt == 1 && !l.takeover);
    assert!(claimed_new(&claims[0]), "{:?}", claims[0]);
    assert_eq!(
        claims[1],
        Claim::Completed {
            result: Some(json!("stored"))
        }
    );
    assert!(
        matches!(claims[2], Claim::InProgress { .. }),
        "{:?}",
        claims[2]
    );
    assert!(
        matches!(claims[3], Claim::Conflict { .. }),
        "{:?}",
        claims[3]
    );
    assert!(
        matches!(&claims[4], Claim::Claimed(l) if l.takeover && l.attempt == 2 && l.token > old.token),
        "{:?}",
        claims[4]
    );
    assert!(claimed_new(&claims[5]));
    assert_eq!(claims[6], Claim::Conflict { stored: fp(&a) });
    assert!(matches!(&claims[7], Claim::Claimed(l) if !l.takeover && l.attempt == 2));
    assert!(matches!(
        claims[8],
        Claim::FailedForGood { attempts: 1, .. }
    ));
    assert!(
        matches!(&claims[9], Claim::Pending { external_ref: Some(r), .. } if r == "ref-1"),
        "{:?}",
        claims[9]
    );
    assert!(matches!(claims[10], Claim::InProgress { .. }));
    assert!(matches!(claims[11], Claim::InProgress { .. }));

    // Completions in one statement, each fenced: the lapsed lease's old token is refused.
    let Claim::Claimed(fresh) = &claims[0] else {
        unreachable!()
    };
    let Claim::Claimed(other) = &claims[5] else {
        unreachable!()
    };
    let done = store
        .complete_many(&[
            (fresh.clone(), json!(1)),
            (old.clone(), json!("zombie")),
            (other.clone(), json!(2)),
        ])
        .await
        .unwrap();
    assert_eq!(
        done,
        vec![true, false, true],
        "the lost lease inside the batch is refused"
    );
    let record = store.get(&lapsed).await.unwrap().unwrap();
    assert_eq!(
        record.status,
        Status::Processing,
        "the stale completion changed nothing"
    );
    assert_eq!(record.result, None);
    assert_eq!(
        store.get(&new1).await.unwrap().unwrap().result,
        Some(json!(1))
    );
    assert_eq!(
        store.get(&new2).await.unwrap().unwrap().result,
        Some(json!(2))
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_batch_shares_one_token_and_each_lease_is_still_fenced_by_its_record(pool: PgPool) {
    let store = store(&pool, Duration::from_secs(30));
    let payload = json!({"amount": 1});
    let (a, b) = (key("shared-a"), key("shared-b"));
    let claims = store
        .claim_many(&[input(&a, &payload), input(&b, &payload)])
        .await
        .unwrap();
    let [Claim::Claimed(lease_a), Claim::Claimed(lease_b)] = claims.as_slice() else {
        panic!("expected two claims, got {claims:?}")
    };
    assert_eq!(
        lease_a.token, lease_b.token,
        "one token per batch statement"
    );
    assert_ne!(lease_a.id, lease_b.id);

    // A's lease lapses (B's stays live) and another claim takes A over.
    sqlx::query(
        "UPDATE processed_operations SET lease_expires_at = now() - interval '1 second'
         WHERE id = $1",
    )
    .bind(lease_a.id)
    .execute(&pool)
    .await
    .unwrap();
    let taken = claimed(&store, &a, &payload).await;
    assert!(taken.takeover && taken.token > lease_a.token);

    // The batch's leases: A's is refused, B's (same token value) still owns B.
    let done = store
        .complete_many(&[
            (lease_a.clone(), json!("zombie")),
            (lease_b.clone(), json!("b")),
        ])
        .await
        .unwrap();
    assert_eq!(done, vec![false, true]);
    let record_a = store.get(&a).await.unwrap().unwrap();
    assert_eq!(
        (record_a.status, record_a.lease_token, record_a.result),
        (Status::Processing, taken.token, None)
    );
    let record_b = store.get(&b).await.unwrap().unwrap();
    assert_eq!(
        (record_b.status, record_b.result),
        (Status::Completed, Some(json!("b")))
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn overlapping_batches_racing_claim_each_key_once(
    _options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    const BATCHES: usize = 8;
    const KEYS: usize = 100;
    let pool = warm_pool(connect, BATCHES as u32).await;
    let store = store(&pool, Duration::from_secs(30));
    let payload = json!({});
    for round in 0..10 {
        let barrier = Arc::new(Barrier::new(BATCHES));
        let mut tasks = Vec::new();
        for b in 0..BATCHES {
            // Every batch holds the same keys, each in its own order.
            let mut inputs: Vec<_> = (0..KEYS)
                .map(|i| input(&key(&format!("r{round}-k{i}")), &payload))
                .collect();
            inputs.rotate_left(b * 13 % KEYS);
            if b % 2 == 1 {
                inputs.reverse();
            }
            let (store, barrier) = (store.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                store.claim_many(&inputs).await.unwrap()
            }));
        }
        let mut winners = std::collections::HashMap::new();
        for task in tasks {
            for claim in task.await.unwrap() {
                match claim {
                    Claim::Claimed(lease) => *winners.entry(lease.id).or_insert(0) += 1,
                    Claim::InProgress { .. } => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
        assert_eq!(winners.len(), KEYS, "round {round}: every key claimed");
        assert!(
            winners.values().all(|n| *n == 1),
            "round {round}: each key once"
        );
    }
}

/// The schema's fingerprint rule: 64 lowercase hex digits, on a database migrated in
/// two steps (rows written before the cheaper check arrived are validated by it).
#[sqlx::test(migrations = false)]
async fn the_fingerprint_check_keeps_its_rule_across_the_upgrade(pool: PgPool) {
    // The schema as the first two migrations left it, with records in it.
    let dir = std::env::temp_dir().join(format!("idem-migrations-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in [
        "20261130000001_processed_operations.sql",
        "20261130000002_operate.sql",
    ] {
        let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        std::fs::copy(from.join(name), dir.join(name)).unwrap();
    }
    let before = sqlx::migrate::Migrator::new(dir.as_path()).await;
    // The migrator holds the files' text: the directory goes before anything can fail.
    std::fs::remove_dir_all(&dir).unwrap();
    before.unwrap().run(&pool).await.unwrap();
    // Written as that schema's code wrote them (today's claim needs today's schema).
    for i in 0..3 {
        sqlx::query(
            "INSERT INTO processed_operations
               (scope, operation, idempotency_key, payload_sha256, status, lease_token)
             VALUES ('t', 'op', $1, $2, 'processing', 1)",
        )
        .bind(format!("old-{i}"))
        .bind(Fingerprint::of(&json!({"n": i}), &[]).as_hex())
        .execute(&pool)
        .await
        .unwrap();
    }

    idem::db::MIGRATOR.run(&pool).await.unwrap();
    let validated: bool = sqlx::query_scalar(
        "SELECT convalidated FROM pg_constraint
         WHERE conname = 'processed_operations_payload_sha256_check'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(validated, "the old rows were validated by the new check");

    let insert = |fingerprint: String| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO processed_operations
                   (scope, operation, idempotency_key, payload_sha256, status, lease_token)
                 VALUES ('t', 'op', md5(random()::text), $1, 'processing', 1)",
            )
            .bind(fingerprint)
            .execute(&pool)
            .await
        }
    };
    let hex = "0123456789abcdef".repeat(4);
    assert!(insert(hex.clone()).await.is_ok());
    let refused = [
        hex[..63].to_owned(),       // too short
        format!("{hex}0"),          // too long
        hex.to_uppercase(),         // not lowercase
        format!("{}g", &hex[..63]), // not hex
        format!("{}é", &hex[..62]), // 64 bytes, 63 characters
        format!("{} ", &hex[..63]), // whitespace
    ];
    for fingerprint in refused {
        let error = insert(fingerprint.clone()).await.unwrap_err();
        let code = error
            .as_database_error()
            .and_then(|e| e.code())
            .map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("23514"), "{fingerprint:?}: {error}");
    }
}

/// One gc leader at a time; a leadership given back, or dropped (its connection is then
/// closed, so the lock cannot stay behind in the pool), frees the lock for the next.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn gc_leadership_is_exclusive_and_never_left_in_the_pool(pool: PgPool) {
    let store = store(&pool, Duration::from_secs(30));
    let leader = store
        .try_lead_gc()
        .await
        .unwrap()
        .expect("the lock is free");
    assert!(store.try_lead_gc().await.unwrap().is_none(), "held");
    leader.release().await.unwrap();
    let leader = store.try_lead_gc().await.unwrap().expect("released");
    drop(leader);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(leader) = store.try_lead_gc().await.unwrap() {
            leader.release().await.unwrap();
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a dropped leadership kept the lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks
         WHERE locktype = 'advisory' AND granted AND objsubid = 1
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND ((classid::bigint << 32) | objid::bigint) = $1",
    )
    .bind(idem::store::GC_LOCK)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(held, 0, "no pooled connection holds the gc lock");
}

/// A discard never lets an operation run again unreconciled or unasked: a retryable
/// failure (retries exhausted) stops being retryable, and a pending record gets no
/// expiry, so gc never deletes it.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_discard_keeps_exhausted_and_pending_operations_from_running_again(pool: PgPool) {
    let store = store(&pool, Duration::from_secs(30));
    let payload = json!({"event_id": "e"});
    let exhausted = key("evt-exhausted");
    let lease = claimed(&store, &exhausted, &payload).await;
    store
        .fail(&lease, true, &json!("timeout"), false)
        .await
        .unwrap();
    store.pin(lease.id).await.unwrap();
    store.mark_dead_lettered(lease.id).await.unwrap();
    store.discard(&exhausted).await.unwrap().unwrap();
    assert!(matches!(
        store
            .claim(&exhausted, &fp(&payload), &origin())
            .await
            .unwrap(),
        Claim::FailedForGood {
            dead_lettered: true,
            ..
        }
    ));

    let pending = key("evt-pending-discarded");
    let lease = claimed(&store, &pending, &payload).await;
    store
        .mark_pending(&lease, Some("psp-7"), &json!("timeout"))
        .await
        .unwrap();
    store.pin(lease.id).await.unwrap();
    store.mark_dead_lettered(lease.id).await.unwrap();
    let record = store.discard(&pending).await.unwrap().unwrap();
    assert!(
        record.expires_at.is_none(),
        "a pending record must never expire"
    );
}

/// Workers that start together against a database that does not exist yet all create it
/// and migrate it: the losers of the `CREATE DATABASE` race (42P04, or 23505 when the
/// creates ran at the same moment) go on, none fails.
#[tokio::test]
async fn workers_starting_together_create_and_migrate_one_database() {
    use sqlx::ConnectOptions;
    use std::str::FromStr;
    let server = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let name = format!(
        "idem_race_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let options = sqlx::postgres::PgConnectOptions::from_str(&server).unwrap();
    let url = options.clone().database(&name).to_url_lossy().to_string();
    let starts = (0..6).map(|_| {
        let url = url.clone();
        tokio::spawn(async move { idem::db::connect_and_migrate(&url, 2).await })
    });
    let results = futures_util::future::join_all(starts).await;
    let mut admin = options.database("postgres").connect().await.unwrap();
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .unwrap();
    for result in results {
        let pool = result.unwrap().map_err(|e| idem::text::error_line(&e));
        assert!(pool.is_ok(), "{pool:?}");
    }
}

/// Two workers' tallies of one queue add their counts to the same rows at once, over and
/// over, and every count arrives; a flush that fails keeps its counts for the next.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn racing_tallies_add_up_and_a_failed_flush_loses_nothing(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    use idem::tally::{Tally, per_minute};
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let week = Duration::from_secs(7 * 24 * 3600);
    let now = chrono::Utc::now();
    let (first, last) = (
        now - chrono::Duration::hours(1),
        now + chrono::Duration::hours(1),
    );
    // Counts from before and after the minutes asked for are left out.
    sqlx::query(
        "INSERT INTO delivery_outcomes (minute, queue, operation, outcome, deliveries, expires_at)
         SELECT date_trunc('minute', now()) + shift, 'q', 'jobs', 'executed', 7,
                now() + interval '1 day'
         FROM unnest(ARRAY[interval '-2 hours', interval '2 hours']) AS shift",
    )
    .execute(&pool)
    .await
    .unwrap();
    let tallies = [
        Arc::new(Tally::new("q", week)),
        Arc::new(Tally::new("q", week)),
    ];
    let mut racers = Vec::new();
    for tally in &tallies {
        let (tally, pool) = (tally.clone(), pool.clone());
        racers.push(tokio::spawn(async move {
            for _ in 0..50 {
                for _ in 0..10 {
                    tally.count("jobs", "executed");
                    tally.count("jobs", "duplicate_completed");
                }
                tally.flush(&pool).await.unwrap();
            }
        }));
    }
    for racer in racers {
        racer.await.unwrap();
    }
    let total = |rows: &[idem::tally::MinuteCount], outcome: &str| -> i64 {
        rows.iter()
            .filter(|r| r.outcome == outcome && r.queue == "q" && r.operation == "jobs")
            .map(|r| r.deliveries)
            .sum()
    };
    let rows = per_minute(&pool, &["q".into()], first, last).await.unwrap();
    assert_eq!(total(&rows, "executed"), 1_000);
    assert_eq!(total(&rows, "duplicate_completed"), 1_000);
    assert!(
        per_minute(&pool, &["other".into()], first, last)
            .await
            .unwrap()
            .is_empty(),
        "only the queues asked for"
    );

    let closed = PgPoolOptions::new().connect_with(connect).await.unwrap();
    closed.close().await;
    tallies[0].count("jobs", "dead_lettered");
    assert!(tallies[0].flush(&closed).await.is_err());
    tallies[0].count("jobs", "dead_lettered");
    assert_eq!(tallies[0].flush(&pool).await.unwrap(), 1, "one row");
    let rows = per_minute(&pool, &["q".into()], first, last).await.unwrap();
    assert_eq!(
        total(&rows, "dead_lettered"),
        2,
        "the failed flush's count kept"
    );
    assert_eq!(tallies[0].flush(&pool).await.unwrap(), 0, "nothing left");
}

/// `Store::completed` answers for many keys in one statement, in the order asked, and
/// only a completed record counts: not one in flight, failed or missing.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn completed_answers_for_many_keys_in_their_order(pool: PgPool) {
    let store = store(&pool, Duration::from_secs(30));
    let payload = json!({"amount": 1});
    let done = claimed(&store, &key("evt-done"), &payload).await;
    store.complete(&done, &json!("ok")).await.unwrap();
    let _running = claimed(&store, &key("evt-running"), &payload).await;
    let failed = claimed(&store, &key("evt-failed"), &payload).await;
    store
        .fail(&failed, false, &json!("no"), false)
        .await
        .unwrap();
    let other_scope = Key::new("tenant-b", "orders.create", "evt-done").unwrap();
    let asked = [
        key("evt-missing"),
        key("evt-done"),
        key("evt-running"),
        other_scope,
        key("evt-failed"),
        key("evt-done"),
    ];
    assert_eq!(
        store.completed(&asked).await.unwrap(),
        [false, true, false, false, false, true]
    );
    assert!(store.completed(&[]).await.unwrap().is_empty());
}

/// An operator's "not applied" settles only the state the operator checked: not a
/// record a worker holds (even after its lease was released: it may still be
/// reconciling), not one a worker took since (a new token: it may have acted), not a
/// discarded one. A pending record left by an unknown reconcile, or a failed one
/// waiting to be reconciled, is resolved; the dead reconciler's writes are fenced off
/// and the next claim runs the operation again.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn resolving_not_applied_takes_only_the_state_the_operator_checked(pool: PgPool) {
    let store = store(&pool, Duration::from_secs(30));
    let k = key("evt-unsure");
    let payload = json!({"amount": 5});
    let first = claimed(&store, &k, &payload).await;
    store
        .mark_pending(&first, Some("charge-1"), &json!({"error": "timeout"}))
        .await
        .unwrap();
    let checked = store.get(&k).await.unwrap().unwrap().lease_token;
    // A worker takes it to reconcile: leased, and a new token.
    let Claim::Pending { lease, .. } = store.claim(&k, &fp(&payload), &origin()).await.unwrap()
    else {
        panic!("expected a reconcile");
    };
    assert!(lease.token > checked);
    let resolve = |token: i64| store.resolve_not_applied(&k, token, "checked");
    assert!(resolve(lease.token).await.unwrap().is_none(), "leased");
    store.release(&k).await.unwrap();
    assert!(
        resolve(lease.token).await.unwrap().is_none(),
        "released, maybe alive"
    );
    // Its reconcile could not tell: pending again, unleased.
    store
        .mark_pending(&lease, None, &json!({"error": "still unknown"}))
        .await
        .unwrap();
    assert!(
        resolve(checked).await.unwrap().is_none(),
        "taken since the check"
    );
    let resolved = resolve(lease.token).await.unwrap().expect("resolved");
    assert_eq!(
        (resolved.status, resolved.retryable),
        (Status::Failed, true)
    );
    assert!(!resolved.reconcile_first);
    assert_eq!(resolved.external_ref, None);
    let error = resolved.error.unwrap();
    assert_eq!(error["note"], "checked");
    assert_eq!(error["external_ref"], "charge-1");
    assert_eq!(error["before"]["error"], "still unknown");
    // The reconciler cannot write any more; the next claim runs it again.
    assert!(store.complete(&lease, &json!("late")).await.is_err());
    let again = claimed(&store, &k, &payload).await;
    assert!(again.token > lease.token);
    store.complete(&again, &json!("ran")).await.unwrap();
    assert!(resolve(again.token).await.unwrap().is_none(), "completed");

    // A failure after an uncertain outcome waits to be reconciled: resolved alike.
    let k2 = key("evt-unsure-2");
    let lease = claimed(&store, &k2, &payload).await;
    store
        .fail(&lease, true, &json!("boom"), true)
        .await
        .unwrap();
    let resolved = store
        .resolve_not_applied(&k2, lease.token, "checked")
        .await
        .unwrap()
        .expect("resolved");
    assert!(!resolved.reconcile_first);
    assert!(matches!(
        store.claim(&k2, &fp(&payload), &origin()).await.unwrap(),
        Claim::Claimed(_)
    ));

    // A discarded operation stays discarded.
    let k3 = key("evt-unsure-3");
    let lease = claimed(&store, &k3, &payload).await;
    store
        .mark_pending(&lease, None, &json!("timeout"))
        .await
        .unwrap();
    store.pin(lease.id).await.unwrap();
    store.discard(&k3).await.unwrap();
    assert!(
        store
            .resolve_not_applied(&k3, lease.token, "checked")
            .await
            .unwrap()
            .is_none()
    );
}
