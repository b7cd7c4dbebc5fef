//! Fenced outcomes: a completion commits with the caller's writes, failures and
//! pending operations are claimed again as their kind says.

use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::PgPool;

use super::*;
use crate::store::{Status, StoreError};

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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
