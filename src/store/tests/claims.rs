//! Claims: a new key runs once, a completed one answers its result, another payload
//! conflicts, an expired lease is taken over by exactly one.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::Barrier;

use super::*;
use crate::store::{Status, StoreError};

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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
