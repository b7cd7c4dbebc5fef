//! The store against a real Postgres, one fresh database per test (`#[sqlx::test]`, on
//! the server `DATABASE_URL` names): claims, fenced outcomes, batches, what operators
//! do, and the schema's upgrades.

use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::store::{Claim, ClaimRequest, Lease, Origin, Store, StoreConfig};

mod batches;
mod claims;
mod migrations;
mod operate;
mod outcomes;
mod round_trips;

pub(super) const VOLATILE: &[&str] = &["sent_at"];

pub(super) fn store(pool: &PgPool, lease: Duration) -> Store {
    Store::new(
        pool.clone(),
        StoreConfig {
            owner: "test-worker".into(),
            lease,
            ..StoreConfig::default()
        },
    )
}

pub(super) fn key(id: &str) -> Key {
    Key::new("tenant-a", "orders.create", id).unwrap()
}

pub(super) fn fp(payload: &Value) -> Fingerprint {
    Fingerprint::of(payload, VOLATILE)
}

pub(super) const TRACE_A: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

pub(super) const TRACE_B: &str = "0af7651916cd43dd8448eb211c80319c";

pub(super) fn origin() -> Origin {
    Origin {
        message_id: Some("msg-1".into()),
        correlation_id: Some("corr-1".into()),
        trace_id: Some(TRACE_A.into()),
    }
}

pub(super) async fn claimed(store: &Store, key: &Key, payload: &Value) -> Lease {
    match store.claim(key, &fp(payload), &origin()).await.unwrap() {
        Claim::Claimed(lease) => lease,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// Waits, on the database clock, until the lease of `key` has lapsed.
pub(super) async fn wait_for_lease_expiry(pool: &PgPool, key: &Key) {
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
pub(super) async fn warm_pool(connect: PgConnectOptions, n: u32) -> PgPool {
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

pub(super) fn input(k: &Key, payload: &Value) -> ClaimRequest {
    ClaimRequest {
        key: k.clone(),
        fingerprint: fp(payload),
        origin: Origin {
            message_id: Some("m".into()),
            correlation_id: None,
            trace_id: None,
        },
    }
}
