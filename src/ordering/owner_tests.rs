//! Owned order's statements against a real Postgres, one fresh database per test.

use std::time::Duration;

use sqlx::PgPool;

use super::{Done, Parked, Then, load, move_on, park};
use crate::key::Key;
use crate::ordering::{Entry, Ordered};

/// The turn at 1 of `ordering_key` (scope `s`), run by `entry-<ordering_key>`.
pub(in crate::ordering) fn done(ordering_key: &str) -> Done {
    Done {
        place: ("s".into(), ordering_key.into(), 1),
        operation: "accounts.apply".into(),
        idempotency_key: format!("entry-{ordering_key}"),
        from: 1,
    }
}

/// Positions of scope `s`, each ordering key at its next number with nothing held,
/// inserted in the order given.
pub(in crate::ordering) async fn positions_at(pool: &PgPool, at: &[(&str, i64)]) {
    let keys: Vec<&str> = at.iter().map(|(key, _)| *key).collect();
    let next: Vec<i64> = at.iter().map(|(_, next)| *next).collect();
    sqlx::query(
        "INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq)
         SELECT 's', k, n, n - 1 FROM unnest($1::text[], $2::int8[]) WITH ORDINALITY AS t(k, n, i)
          ORDER BY i",
    )
    .bind(&keys)
    .bind(&next)
    .execute(pool)
    .await
    .unwrap();
}

/// The entry of `key` numbered `seq` (scope `s`), kept with `properties`.
pub(crate) fn entry(key: &str, seq: i64, properties: Vec<u8>) -> Entry {
    Entry {
        key: Key::new("s", "accounts.apply", format!("{key}-{seq}")).unwrap(),
        ordered: Ordered::by(key).sequence(seq),
        fingerprint: format!("fp-{key}-{seq}"),
        also: None,
        queue: "q".into(),
        body: b"{}".to_vec(),
        properties,
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
    positions_at(&pool, &[("b", 1), ("a", 1)]).await;
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
        async move {
            move_on(
                &pool,
                None,
                &[done("b"), done("a")],
                Then::Release { ahead: 0 },
            )
            .await
        }
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

    let entry = |key: &str, seq: i64| entry(key, seq, Vec::new());
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

/// A park runs as a plain insert, which a row in the way refuses as a whole; it then
/// runs again with `ON CONFLICT DO NOTHING`: the entries with no row in their way are
/// kept, a copy of a waiting entry and another message at a taken place are answered
/// with the row in their way, and two copies within one batch are kept as one row (both
/// answered kept: either may be acked).
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn a_park_refused_by_a_waiting_row_keeps_the_others(pool: PgPool) {
    let day = Duration::from_secs(24 * 3600);
    let entry = |key: &str, seq: i64| entry(key, seq, Vec::new());
    let first = park(&pool, None, day, &[entry("a", 5), entry("b", 5)]).await;
    assert_eq!(first.unwrap(), vec![Parked::Kept, Parked::Kept]);
    // Another message (another key) at b's place 5.
    let mut rival = entry("b", 5);
    rival.key = Key::new("s", "accounts.apply", "rival").unwrap();
    let parked = park(
        &pool,
        None,
        day,
        &[
            entry("a", 5),
            entry("c", 3),
            rival,
            entry("d", 2),
            entry("d", 2),
        ],
    )
    .await
    .unwrap();
    let found = |key: &str, seq: i64| {
        Parked::Found(
            seq,
            "accounts.apply".into(),
            format!("{key}-{seq}"),
            format!("fp-{key}-{seq}"),
        )
    };
    assert_eq!(
        parked,
        vec![
            found("a", 5),
            Parked::Kept,
            found("b", 5),
            Parked::Kept,
            Parked::Kept
        ]
    );
    let kept: Vec<(String, i64)> =
        sqlx::query_as("SELECT ordering_key, seq FROM ordering_waiting ORDER BY 1, 2")
            .fetch_all(&pool)
            .await
            .unwrap();
    let at = |key: &str, seq: i64| (key.to_string(), seq);
    assert_eq!(kept, vec![at("a", 5), at("b", 5), at("c", 3), at("d", 2)]);
}

/// A leased run: its last turn's move goes from the run's first number (`from`) past
/// the turn, deleting the rows of the turns between; it releases the row at the next
/// number and reads the rows right after that one, to the first gap, not released. A
/// move whose position is not at `from` (moved by an operator's skip) writes nothing
/// and deletes no row. A run's turn that does not complete moves the position from the
/// run's first number to its own and holds it there.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn a_runs_move_passes_its_turns_rows_and_reads_the_rows_ahead(pool: PgPool) {
    let properties =
        crate::ordering::table::stored_properties(&lapin::BasicProperties::default()).unwrap();
    let entry = |key: &str, seq: i64| entry(key, seq, properties.clone());
    let mut entries: Vec<Entry> = [2, 3, 4, 5, 6, 7, 9].map(|n| entry("r", n)).into();
    entries.extend([5, 6].map(|n| entry("f", n)));
    entries.extend([7, 8].map(|n| entry("g", n)));
    let day = Duration::from_secs(24 * 3600);
    let parked = park(&pool, None, day, &entries).await.unwrap();
    assert!(parked.iter().all(|p| *p == Parked::Kept), "{parked:?}");
    sqlx::query(
        "INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq)
         VALUES ('s', 'r', 2, 9), ('s', 'f', 6, 6), ('s', 'g', 5, 8)
         ON CONFLICT (scope, ordering_key) DO UPDATE SET next_seq = excluded.next_seq",
    )
    .execute(&pool)
    .await
    .unwrap();
    let release = Then::Release { ahead: 32 };
    let turns = [turn("r", 4, 2), turn("f", 7, 5), turn("g", 5, 5)];
    let moved = move_on(&pool, None, &turns, release).await.unwrap();
    let seqs = |rows: &[crate::ordering::Released]| rows.iter().map(|r| r.seq).collect::<Vec<_>>();
    assert!(moved[0].moved);
    assert_eq!(seqs(&moved[0].next), vec![5], "the next row released");
    assert_eq!(
        seqs(&moved[0].ahead),
        vec![6, 7],
        "the rows after it, to the gap"
    );
    assert!(
        !moved[1].moved,
        "f's position is not at the run's first number"
    );
    assert!(moved[1].next.is_empty() && moved[1].ahead.is_empty());
    // g's 6 is missing: nothing released, nor read past the gap.
    assert!(moved[2].moved);
    assert!(
        moved[2].next.is_empty() && moved[2].ahead.is_empty(),
        "{:?}",
        moved[2]
    );
    assert_eq!(
        rows(&pool, "r").await,
        vec![(5, true), (6, false), (7, false), (9, false)],
        "the run's rows 2 to 4 went, 5 is released, the rows read ahead are not"
    );
    assert_eq!(position(&pool, "r").await, (5, None));
    assert_eq!(
        rows(&pool, "f").await,
        vec![(5, false), (6, false)],
        "nothing deleted"
    );
    assert_eq!(position(&pool, "f").await, (6, None));

    // 5 and 6 completed in the run, 7 failed for good: the position moves from 5 to 7,
    // held by 7; 5's and 6's rows go, and 7's (its dead letter is safe).
    let held = crate::ordering::held::hold(&pool, &turn("r", 7, 5), true, false)
        .await
        .unwrap();
    assert!(held);
    assert_eq!(position(&pool, "r").await, (7, Some("r-7".into())));
    assert_eq!(rows(&pool, "r").await, vec![(9, false)]);
    // Fenced out the same way: f's position is not at 5.
    let held = crate::ordering::held::hold(&pool, &turn("f", 6, 5), true, false)
        .await
        .unwrap();
    assert!(!held);
    assert_eq!(position(&pool, "f").await, (6, None));
    assert_eq!(
        rows(&pool, "f").await,
        vec![(5, false)],
        "only its own row went"
    );
}

/// A turn of a leased run that runs long is marked ([`crate::ordering::held::running`]):
/// the position moves from the run's first number to the turn's own, held by it, the
/// rows of the turns between go, and its own row is marked released. Its move, whose
/// fence was taken at the run's first number (a move in its handler's commit), still
/// moves it on from there; a move from a number the position is not at, and not held by
/// the turn, is fenced out. A mark whose run's first number was passed (a skip) writes
/// nothing.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn a_long_run_turns_mark_moves_the_position_to_its_number(pool: PgPool) {
    use crate::ordering::held::{Marked, running};
    let properties =
        crate::ordering::table::stored_properties(&lapin::BasicProperties::default()).unwrap();
    let entries: Vec<Entry> = [("r", 2), ("r", 3), ("r", 4), ("r", 5), ("f", 7)]
        .map(|(key, n)| entry(key, n, properties.clone()))
        .into();
    let day = Duration::from_secs(24 * 3600);
    park(&pool, None, day, &entries).await.unwrap();
    sqlx::query(
        "INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq)
         VALUES ('s', 'r', 2, 5), ('s', 'f', 6, 7), ('s', 'g', 5, 5)
         ON CONFLICT (scope, ordering_key) DO UPDATE SET next_seq = excluded.next_seq",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        running(&pool, &turn("r", 4, 2)).await.unwrap(),
        Marked::Moved
    );
    assert_eq!(position(&pool, "r").await, (4, Some("r-4".into())));
    assert_eq!(
        rows(&pool, "r").await,
        vec![(4, true), (5, false)],
        "2 and 3 went, 4 is released"
    );
    let release = Then::Release { ahead: 32 };
    let moved = move_on(&pool, None, &[turn("r", 4, 2), turn("g", 5, 3)], release)
        .await
        .unwrap();
    assert!(moved[0].moved, "the turn holds the position at its number");
    assert_eq!(
        moved[0].next.iter().map(|r| r.seq).collect::<Vec<_>>(),
        vec![5]
    );
    assert_eq!(position(&pool, "r").await, (5, None));
    assert_eq!(rows(&pool, "r").await, vec![(5, true)]);
    assert!(!moved[1].moved, "g is at 5, held by nobody: not the turn's");
    assert_eq!(position(&pool, "g").await, (5, None));

    assert_eq!(
        running(&pool, &turn("f", 7, 5)).await.unwrap(),
        Marked::Looked
    );
    assert_eq!(
        position(&pool, "f").await,
        (6, None),
        "f is past 5: nothing written"
    );
    assert_eq!(rows(&pool, "f").await, vec![(7, false)]);
}

/// A leased turn of `key` (scope `s`) at `seq`, run by `<key>-<seq>`, whose position
/// stands at `from`.
fn turn(key: &str, seq: i64, from: i64) -> Done {
    Done {
        place: ("s".into(), key.into(), seq),
        operation: "accounts.apply".into(),
        idempotency_key: format!("{key}-{seq}"),
        from,
    }
}

/// The waiting rows of `key`: each number, and whether it was released.
async fn rows(pool: &PgPool, key: &str) -> Vec<(i64, bool)> {
    sqlx::query_as(
        "SELECT seq, released_at IS NOT NULL FROM ordering_waiting
          WHERE ordering_key = $1 ORDER BY seq",
    )
    .bind(key)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// `key`'s position and holder.
async fn position(pool: &PgPool, key: &str) -> (i64, Option<String>) {
    sqlx::query_as("SELECT next_seq, holder_key FROM ordering_positions WHERE ordering_key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A turn's statements touch its own waiting row only (its key at its place): a row of
/// another message parked under its key, at another entity, stays through the turn's
/// hold, the sweep's move past its completed holder and a released turn's finish. Each
/// deleted every row of the key, and that message, acked, was lost; kept, it meets the
/// record when its turn comes and is dead-lettered `fingerprint_conflict`.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn a_turn_deletes_its_own_waiting_row_not_another_under_its_key(pool: PgPool) {
    let properties =
        crate::ordering::table::stored_properties(&lapin::BasicProperties::default()).unwrap();
    // `w`'s 2, parked under the key of `h`'s turn at 1.
    let mut other = entry("w", 2, properties);
    other.key = Key::new("s", "accounts.apply", "h-1").unwrap();
    let day = Duration::from_secs(24 * 3600);
    let parked = park(&pool, None, day, &[other]).await.unwrap();
    assert_eq!(parked, vec![Parked::Kept]);
    positions_at(&pool, &[("h", 1)]).await;

    let held = crate::ordering::held::hold(&pool, &turn("h", 1, 1), true, false)
        .await
        .unwrap();
    assert!(held);
    assert_eq!(rows(&pool, "w").await, vec![(2, false)], "after the hold");

    completed(&pool, "h-1").await;
    let entities = [("s".to_string(), "h".to_string())];
    crate::ordering::table::release(&pool, None, &entities, false)
        .await
        .unwrap();
    assert_eq!(
        position(&pool, "h").await,
        (2, None),
        "moved past its holder"
    );
    assert_eq!(rows(&pool, "w").await, vec![(2, false)], "after the sweep");

    let released = crate::ordering::Released {
        scope: "s".into(),
        ordering_key: "h".into(),
        seq: 1,
        operation: "accounts.apply".into(),
        idempotency_key: "h-1".into(),
        turn: true,
        queue: "q".into(),
        body: Vec::new(),
        properties: lapin::BasicProperties::default(),
    };
    crate::ordering::table::finish(&pool, &released)
        .await
        .unwrap();
    assert_eq!(rows(&pool, "w").await, vec![(2, false)], "after the finish");
}

/// A delivery behind its position that its record decides deletes its own waiting row
/// behind the position, not a row of another payload under its key: `w`'s 2, parked
/// under the key of `h`'s 1 and passed by `w`'s position, stays for a copy of `h`'s 1,
/// and goes with its own delivery (which the sweep publishes, and which is then
/// dead-lettered `fingerprint_conflict`). (Deleted by key alone, it was lost without a
/// trace.)
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn a_decided_delivery_deletes_its_own_row_behind_not_another_under_its_key(pool: PgPool) {
    let properties =
        crate::ordering::table::stored_properties(&lapin::BasicProperties::default()).unwrap();
    let mut other = entry("w", 2, properties.clone());
    other.key = Key::new("s", "accounts.apply", "h-1").unwrap();
    let day = Duration::from_secs(24 * 3600);
    let parked = park(&pool, None, day, &[other.clone()]).await.unwrap();
    assert_eq!(parked, vec![Parked::Kept]);
    // `w`'s position, past 2 (a skip, say).
    positions_at(&pool, &[("w", 5)]).await;
    completed(&pool, "h-1").await;
    let copy = entry("h", 1, properties);
    let decided = crate::ordering::held::decided(&pool, &copy).await.unwrap();
    assert!(decided, "h's 1 completed");
    assert_eq!(rows(&pool, "w").await, vec![(2, false)], "after h's copy");
    let decided = crate::ordering::held::decided(&pool, &other).await.unwrap();
    assert!(decided, "its key's record decides it too");
    assert_eq!(rows(&pool, "w").await, vec![], "after its own delivery");
}

/// A completed record of `idempotency_key` (scope `s`), of a payload no entry has.
async fn completed(pool: &PgPool, idempotency_key: &str) {
    sqlx::query(
        "INSERT INTO processed_operations (scope, operation, idempotency_key,
             payload_sha256, status, lease_token, completed_at)
         VALUES ('s', 'accounts.apply', $1, repeat('0', 64), 'completed', 1, now())",
    )
    .bind(idempotency_key)
    .execute(pool)
    .await
    .unwrap();
}

/// A move past a holder whose record completed deletes the holder's row at its turn only
/// when the row carries the record's payload. `w`'s 2, parked under the key of a message
/// that completed (`h-1`, `g-1`) and handed its turn with that key as its holder, stays
/// through the gate's lock (an entering delivery's, a skip's) and the sweep's move, behind
/// the position, and the sweep publishes it once its release is stale: it is
/// dead-lettered `fingerprint_conflict` when it comes back. (Deleted, a crash of the
/// releasing process before its run lost it without a trace.) A row of the record's
/// payload, what the turn ran, goes.
#[sqlx::test(migrator = "crate::db::MIGRATOR")]
async fn a_move_past_a_completed_holder_keeps_its_row_of_another_payload(pool: PgPool) {
    let record_fp = "0".repeat(64);
    for (entity, key, fp) in [
        ("lock", "h-1", "fp-other"),
        ("sweep", "g-1", "fp-other"),
        ("own", "o-1", record_fp.as_str()),
    ] {
        completed(&pool, key).await;
        sqlx::query(
            "WITH p AS (
                 INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq,
                     holder_operation, holder_key, held_since)
                 VALUES ('s', $1, 2, 2, 'accounts.apply', $2, now()))
             INSERT INTO ordering_waiting (scope, ordering_key, seq, operation,
                 idempotency_key, payload_sha256, queue, body, properties, released_at,
                 releases)
             VALUES ('s', $1, 2, 'accounts.apply', $2, $3, 'q', '\\x7b7d', '\\x7b7d', now(), 1)",
        )
        .bind(entity)
        .bind(key)
        .bind(fp)
        .execute(&pool)
        .await
        .unwrap();
    }
    let lock = |entity: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT (idem_ordering_lock('s', $1, 1)).next_seq")
                .bind(entity)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(lock("lock").await, 3, "moved past its completed holder");
    assert_eq!(
        rows(&pool, "lock").await,
        vec![(2, true)],
        "another payload"
    );
    // The row behind the position is not the first waiting: with 3 released, the
    // listing says so (not `gap`).
    sqlx::query(
        "INSERT INTO ordering_waiting (scope, ordering_key, seq, operation, idempotency_key,
             payload_sha256, queue, body, properties, released_at, releases)
         VALUES ('s', 'lock', 3, 'accounts.apply', 'lock-3', 'fp', 'q', '\\x7b7d',
                 '\\x7b7d', now(), 1)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let listed = crate::ordering::list(&pool, None, 10).await.unwrap();
    let lock_listed = listed.iter().find(|p| p.ordering_key == "lock").unwrap();
    assert_eq!(
        (
            lock_listed.waiting,
            lock_listed.first_waiting,
            lock_listed.blocked_by()
        ),
        (2, Some(3), "released")
    );
    sqlx::query("DELETE FROM ordering_waiting WHERE idempotency_key = 'lock-3'")
        .execute(&pool)
        .await
        .unwrap();
    let sweep = [("s".to_string(), "sweep".to_string())];
    let released = crate::ordering::table::release(&pool, None, &sweep, false)
        .await
        .unwrap();
    assert!(released.is_empty(), "nothing at 3: {released:?}");
    assert_eq!(position(&pool, "sweep").await, (3, None));
    assert_eq!(
        rows(&pool, "sweep").await,
        vec![(2, true)],
        "another payload"
    );
    assert_eq!(lock("own").await, 3);
    assert_eq!(rows(&pool, "own").await, vec![], "the record's payload");

    // Its release a second and more old: the sweep finds both and publishes them.
    sqlx::query("UPDATE ordering_waiting SET released_at = now() - interval '2 seconds'")
        .execute(&pool)
        .await
        .unwrap();
    let mut unmoved = crate::ordering::table::unmoved(&pool, 10, Duration::ZERO)
        .await
        .unwrap();
    unmoved.sort();
    assert_eq!(
        unmoved,
        [("s".into(), "lock".into()), ("s".into(), "sweep".into())]
    );
    let released = crate::ordering::table::release(&pool, None, &unmoved, false)
        .await
        .unwrap();
    let mut published: Vec<_> = released
        .iter()
        .map(|r| {
            (
                r.ordering_key.as_str(),
                r.seq,
                r.idempotency_key.as_str(),
                r.turn,
            )
        })
        .collect();
    published.sort();
    assert_eq!(
        published,
        [("lock", 2, "h-1", false), ("sweep", 2, "g-1", false)]
    );
}
