//! How an owned delivery enters its entity's order, against a real Postgres, one fresh
//! database per test.

use std::time::Duration;

use sqlx::PgPool;

use super::*;
use crate::StoreConfig;
use crate::ordering::Ordered;

/// The entry of `ordering_key` numbered `seq` (scope `s`).
fn entry(ordering_key: &str, seq: i64) -> Entry {
    Entry {
        key: Key::new("s", "accounts.apply", format!("{ordering_key}-{seq}")).unwrap(),
        ordered: Ordered::by(ordering_key).sequence(seq),
        fingerprint: format!("fp-{ordering_key}-{seq}"),
        also: None,
        queue: "q".into(),
        body: b"{}".to_vec(),
        properties: Vec::new(),
    }
}

/// A turn released from its waiting row (a takeover's) whose entity this process read
/// before the previous owner's last move committed finds the memory behind it: it reads
/// the position once and runs. Answered `waiting` from the stale memory, its row would
/// have waited for the sweep, a second or more. A row that is early by the database too
/// is answered `waiting` after that one read, and nothing is parked for it.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn a_turn_released_from_its_row_reads_a_memory_behind_it_once(pool: PgPool) {
    let store = Store::new(pool.clone(), StoreConfig::default());
    let owner = Owner::new(&store, &WorkerConfig::default(), false);
    let positions = Arc::new(Positions::new(4));
    let entity: Entity = ("s".into(), "account-a".into());
    // This process reads the entity at 1 (its position is created there) ...
    owner.read(&positions, &entity, 1).await.unwrap();
    // ... then the previous owner's move past 1 commits.
    let moved = sqlx::query(
        "UPDATE ordering_positions SET next_seq = 2
          WHERE scope = 's' AND ordering_key = 'account-a' AND next_seq = 1",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(moved.rows_affected(), 1);

    let within = Duration::from_secs(10);
    let entered = owner.enter(&positions, &entity, entry("account-a", 2), true, false);
    let stand = tokio::time::timeout(within, entered)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(stand, Stand::Run(_)),
        "the released turn at 2 runs"
    );

    let other: Entity = ("s".into(), "account-b".into());
    owner.read(&positions, &other, 1).await.unwrap();
    let entered = owner.enter(&positions, &other, entry("account-b", 3), true, false);
    let stand = tokio::time::timeout(within, entered)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(stand, Stand::Waiting),
        "3 is early by the database too"
    );
    let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM ordering_waiting")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(parked, 0, "a row released to its turn is not parked again");
}
