//! How an owned delivery enters its entity's order, against a real Postgres, one fresh
//! database per test.

use std::time::Duration;

use sqlx::PgPool;

use super::*;
use crate::StoreConfig;
use crate::ordering::owner::tests::entry;

/// A turn released from its waiting row (a takeover's) whose entity this process read
/// before the previous owner's last move committed finds the memory behind it: it reads
/// the position once and runs. Answered `waiting` from the stale memory, its row would
/// have waited for the sweep, a second or more. A row that is early by the database too
/// is answered `waiting` after that one read, and nothing is parked for it. (The test
/// keeps no waiting row, which a real released turn has, so that a park, which this
/// path must not make, would show as one.)
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

    let stand = enter_released(&owner, &positions, &entity, 2).await;
    assert!(
        matches!(stand, Stand::Run(_)),
        "the released turn at 2 runs"
    );

    let other: Entity = ("s".into(), "account-b".into());
    owner.read(&positions, &other, 1).await.unwrap();
    let stand = enter_released(&owner, &positions, &other, 3).await;
    assert!(
        matches!(stand, Stand::Waiting),
        "3 is early by the database too"
    );
    let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM ordering_waiting")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(parked, 0, "nothing is parked");
}

/// What [`Owner::enter`] decides for `entity`'s entry numbered `seq`, its turn released
/// to this process from its row; within 10 s (a loop that kept reading would hang).
async fn enter_released(
    owner: &Owner,
    positions: &Arc<Positions>,
    entity: &Entity,
    seq: i64,
) -> Stand {
    let entry = entry(&entity.1, seq, Vec::new());
    let lent = Link::default();
    let entered = owner.enter(positions, entity, entry, true, &lent);
    tokio::time::timeout(Duration::from_secs(10), entered)
        .await
        .expect("entered within 10 s")
        .expect("entered")
}

/// A released turn whose number a copy of its message holds in memory waits for that
/// copy, and first gives back the place among the queue's runs that the turn before it
/// lent it: the copy may be waiting for that place. Kept, with a concurrency of 1,
/// each waited for the other for ever.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn a_released_turn_waiting_for_its_copy_gives_back_its_lent_place(pool: PgPool) {
    let store = Store::new(pool.clone(), StoreConfig::default());
    let owner = Owner::new(&store, &WorkerConfig::default(), true);
    let positions = Arc::new(Positions::new(1));
    let entity: Entity = ("s".into(), "account-a".into());
    owner.read(&positions, &entity, 1).await.unwrap();
    // The broker's copy of the message at 1 takes the turn in memory ...
    let message = entry(&entity.1, 1, Vec::new());
    let copy = owner
        .enter(
            &positions,
            &entity,
            message.clone(),
            false,
            &Link::default(),
        )
        .await
        .unwrap();
    let Stand::Run(copy) = copy else {
        panic!("the copy takes the turn");
    };
    // ... and the row of the same message, released to this task, comes with the
    // queue's only place, lent by the turn before it.
    let place = positions.run().await.unwrap();
    let lent = Link::lending(place);
    let released = owner.enter(&positions, &entity, message, true, &lent);
    let copy_runs = async {
        let place = tokio::time::timeout(Duration::from_secs(10), positions.run())
            .await
            .expect("the lent place given back within 10 s");
        // The copy ran and ended (without a move: its delivery decides again).
        drop(copy);
        drop(place);
    };
    let (stand, ()) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(10), released),
        copy_runs
    );
    let stand = stand.expect("entered within 10 s").expect("entered");
    assert!(
        matches!(stand, Stand::Run(_)),
        "the released turn runs next"
    );
}
