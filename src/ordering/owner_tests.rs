//! Owned order's statements against a real Postgres, one fresh database per test.

use std::time::Duration;

use sqlx::PgPool;

use super::{Done, Parked, load, move_on, park};
use crate::key::Key;
use crate::ordering::{Entry, Ordered};

/// The turn at 1 of `ordering_key` (scope `s`), run by `entry-<ordering_key>`.
pub(in crate::ordering) fn done(ordering_key: &str) -> Done {
    Done {
        place: ("s".into(), ordering_key.into(), 1),
        operation: "accounts.apply".into(),
        idempotency_key: format!("entry-{ordering_key}"),
    }
}

/// A move of several entities locks their positions in (scope, ordering key) order, as
/// the sweep's release and the gate do, whatever order its array and the table have:
/// while a sweep holds `a` and the move waits for it, the sweep can still take `b`.
/// (Before, the move locked `b` first, the sweep then waited for it, and Postgres broke
/// the deadlock after a second by failing one of them.)
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn a_move_locks_positions_in_key_order_as_the_sweep_does(pool: PgPool) {
    // b's row first in the table, and first in the move's array.
    sqlx::query(
        "INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq)
         VALUES ('s', 'b', 1, 0), ('s', 'a', 1, 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut sweep = pool.begin().await.unwrap();
    let lock = "SELECT 1 FROM ordering_positions
                 WHERE scope = 's' AND ordering_key = $1 FOR UPDATE NOWAIT";
    sqlx::query(lock)
        .bind("a")
        .execute(&mut *sweep)
        .await
        .unwrap();
    let moving = tokio::spawn({
        let pool = pool.clone();
        async move { move_on(&pool, None, &[done("b"), done("a")], 0).await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waits: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                             WHERE datname = current_database() AND wait_event_type = 'Lock'
                               AND query LIKE '%ordering_positions%')",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if waits {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the move never waited for a's lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sqlx::query(lock)
        .bind("b")
        .execute(&mut *sweep)
        .await
        .expect("the move holds b's lock while it waits for a's");
    sweep.commit().await.unwrap();
    let moved = tokio::time::timeout(Duration::from_secs(10), moving)
        .await
        .expect("the move did not end once the sweep committed")
        .unwrap()
        .unwrap();
    assert!(
        moved.iter().all(|m| m.moved),
        "both positions moved: {moved:?}"
    );
    let next: Vec<i64> = sqlx::query_scalar(
        "SELECT next_seq FROM ordering_positions WHERE scope = 's' ORDER BY ordering_key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(next, vec![2, 2]);
}

/// A load reads each position (creating a missing one at its first number) and marks
/// as moved only a position that has not moved for an hour; a park raises `last_seq`
/// only where gc could be taking the position (not moved for half the retention), and
/// answers a number the position has reached as passed; an entry of an entity with no
/// position is parked. Pins what the statements write, whatever plan reaches the
/// positions.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn a_load_and_a_park_write_only_positions_gc_could_take(pool: PgPool) {
    sqlx::query(
        "INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq, moved_at)
         VALUES ('s', 'old', 3, 2, now() - interval '2 days'),
                ('s', 'new', 3, 2, now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let item = |key: &str| ("s".to_string(), key.to_string(), 1);
    let next = load(&pool, &[item("old"), item("new"), item("missing")])
        .await
        .unwrap();
    assert_eq!(next, vec![3, 3, 1]);
    // (key, moved more than 30 minutes ago, moved more than 2 hours ago)
    let stale: Vec<(String, bool, bool)> = sqlx::query_as(
        "SELECT ordering_key, moved_at < now() - interval '30 minutes',
                moved_at < now() - interval '2 hours'
           FROM ordering_positions ORDER BY ordering_key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        stale,
        vec![
            ("missing".to_string(), false, false),
            ("new".to_string(), false, false),
            ("old".to_string(), true, false),
        ],
        "the old position is marked as moved an hour ago, the others left as they are"
    );
    sqlx::query("UPDATE ordering_positions SET moved_at = now() - interval '2 days' WHERE ordering_key = 'old'")
        .execute(&pool)
        .await
        .unwrap();

    let entry = |key: &str, seq: i64| Entry {
        key: Key::new("s", "accounts.apply", format!("{key}-{seq}")).unwrap(),
        ordered: Ordered::by(key).sequence(seq),
        fingerprint: format!("fp-{key}-{seq}"),
        also: None,
        queue: "q".into(),
        body: b"{}".to_vec(),
        properties: Vec::new(),
    };
    let parked = park(
        &pool,
        None,
        Duration::from_secs(24 * 3600),
        &[
            entry("old", 5),
            entry("new", 5),
            entry("new", 3),
            entry("fresh", 2),
        ],
    )
    .await
    .unwrap();
    assert_eq!(
        parked,
        vec![Parked::Kept, Parked::Kept, Parked::Passed, Parked::Kept]
    );
    let last: Vec<(String, i64)> = sqlx::query_as(
        "SELECT ordering_key, last_seq FROM ordering_positions
          WHERE ordering_key IN ('old', 'new') ORDER BY ordering_key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        last,
        vec![("new".to_string(), 2), ("old".to_string(), 5)],
        "last_seq raised to the highest waiting number where gc could take the position"
    );
}
