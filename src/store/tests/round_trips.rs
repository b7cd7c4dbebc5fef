//! Round trips of the store's common path, counted from sqlx's statement log events.
//!
//! The counting subscriber is this test's thread's own (`#[sqlx::test]` runs the test
//! on a current-thread runtime, so every statement of it is made on this thread), and
//! the call sites' cached interest is rebuilt once it is set: tracing caches per call
//! site whether anyone listens, and another test may have hit sqlx's first.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::key::Key;
use crate::store::{Claim, Origin, Store, StoreConfig};
use serde_json::json;
use sqlx::PgPool;
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

struct Counter(Arc<AtomicUsize>);

impl<S: Subscriber> Layer<S> for Counter {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if event.metadata().target() == "sqlx::query" {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn take_and_assert(count: &AtomicUsize, n: usize, what: &str) {
    assert_eq!(count.swap(0, Ordering::SeqCst), n, "{what}");
}

#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn claim_and_completion_are_one_statement_each(pool: PgPool) {
    let count = Arc::new(AtomicUsize::new(0));
    let subscriber = tracing_subscriber::registry()
        .with(tracing_subscriber::filter::LevelFilter::TRACE)
        .with(Counter(count.clone()));
    let _counting = tracing::subscriber::set_default(subscriber);
    tracing::callsite::rebuild_interest_cache();
    let store = Store::new(
        pool.clone(),
        StoreConfig {
            lease: Duration::from_secs(30),
            ..StoreConfig::default()
        },
    );
    // Warm the pool so connection set-up statements are not counted, and the store:
    // its one check of the keys before the first claim is not on the common path.
    sqlx::query("SELECT 1").execute(&pool).await.unwrap();
    store.prepare().await.unwrap();
    // Once more, after the store's check: another test's thread may have rebuilt the
    // cache meanwhile, without this thread's subscriber in it (seen once in CI).
    tracing::callsite::rebuild_interest_cache();
    count.swap(0, Ordering::SeqCst);

    let payload = json!({"event_id": "evt-rt"});
    let fingerprint = Fingerprint::of(&payload, &[]);
    let claim = |id: &'static str| {
        let (store, fingerprint) = (store.clone(), fingerprint.clone());
        async move {
            let key = Key::new("tenant-a", "orders.create", id).unwrap();
            store
                .claim(&key, &fingerprint, &Origin::default())
                .await
                .unwrap()
        }
    };
    let Claim::Claimed(lease) = claim("evt-rt").await else {
        panic!("new key")
    };
    take_and_assert(&count, 1, "new claim");
    store.complete(&lease, &json!("ok")).await.unwrap();
    take_and_assert(&count, 1, "completion");
    assert!(matches!(claim("evt-rt").await, Claim::Completed { .. }));
    take_and_assert(&count, 1, "duplicate claim");
    let Claim::Claimed(lease) = claim("evt-rt2").await else {
        panic!("new key")
    };
    take_and_assert(&count, 1, "second claim");
    store.heartbeat(&lease).await.unwrap();
    take_and_assert(&count, 1, "heartbeat");

    // A batch of new keys: one statement for all of them, one for their completions
    // (in a transaction of its own, which an unnamed statement needs behind a
    // transaction pooler: BEGIN, it and COMMIT, of which sqlx's log shows two).
    let inputs: Vec<_> = (0..50)
        .map(|i| crate::store::ClaimRequest {
            key: Key::new("tenant-a", "orders.create", format!("batch-{i}")).unwrap(),
            fingerprint: fingerprint.clone(),
            origin: Origin::default(),
        })
        .collect();
    let claims = store.claim_many(&inputs).await.unwrap();
    take_and_assert(&count, 1, "a batch of 50 new claims");
    let done: Vec<_> = claims
        .into_iter()
        .map(|c| match c {
            Claim::Claimed(lease) => (lease, json!(null)),
            other => panic!("new key: {other:?}"),
        })
        .collect();
    let written = store.complete_many(&done).await.unwrap();
    assert!(written.iter().all(|w| *w));
    take_and_assert(&count, 2, "a batch of 50 completions, in a transaction");
}
