//! Batched claims decide each key as one claim would, and racing batches claim each
//! key once.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::Barrier;

use super::*;
use crate::store::Status;

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
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
