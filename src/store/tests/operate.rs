//! What operators do: discard, resolve, gc leadership, the records of many keys.

use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::PgPool;

use super::*;
use crate::store::{Status, StoreError};

/// A discarded failure counts as dead-lettered: a later duplicate is acked, not
/// dead-lettered again; a replay takes the decision back.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

/// One gc leader at a time; a leadership given back, or dropped (its connection is then
/// closed, so the lock cannot stay behind in the pool), frees the lock for the next.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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
    .bind(crate::store::gc::GC_LOCK)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(held, 0, "no pooled connection holds the gc lock");
}

/// A discard never lets an operation run again unreconciled or unasked: a retryable
/// failure (retries exhausted) stops being retryable, and a pending record gets no
/// expiry, so gc never deletes it.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

/// `Store::completed` answers for many keys in one statement, in the order asked, and
/// only a completed record counts: not one in flight, failed or missing.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

/// A worker known dead: its live lease keeps every other claimer out until an operator
/// releases it; the next claim then takes it over with a new token, and the dead
/// worker, should it come back, is fenced off.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn a_lease_released_by_hand_is_taken_over_and_its_old_owner_fenced(pool: PgPool) {
    let dead_worker = store(&pool, Duration::from_secs(3600));
    let k = key("evt-stuck");
    let payload = json!({"event_id": "evt-stuck"});
    let dead = claimed(&dead_worker, &k, &payload).await;
    let other = store(&pool, Duration::from_secs(30));
    assert!(matches!(
        other.claim(&k, &fp(&payload), &origin()).await.unwrap(),
        Claim::InProgress { .. }
    ));
    other.release(&k).await.unwrap().expect("released");
    let Claim::Claimed(next) = other.claim(&k, &fp(&payload), &origin()).await.unwrap() else {
        panic!("a released lease is taken over");
    };
    assert!(next.takeover && next.token > dead.token);
    assert!(
        matches!(
            dead_worker.complete(&dead, &json!("zombie")).await,
            Err(StoreError::LeaseLost { .. })
        ),
        "the dead worker is fenced"
    );
}
