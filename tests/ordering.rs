//! Order per entity (`Handler::ordering`, docs/DESIGN.md "Order per entity") against the
//! real broker and database, with `examples/accounts_worker.rs` processes: shuffled
//! sequences applied in order across processes and a SIGKILL, in both modes; a failing
//! predecessor blocks only its own account until it is replayed; a gap is reported and
//! skipped; a duplicate of a completed sequence is acked at once; early entries arriving
//! together (a copy, another event with the same number); order of arrival; the
//! waiting deliveries under data protection (sealed, rotated, counted by an erasure).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use lapin::BasicProperties;
use lapin::options::BasicGetOptions;
use lapin::types::{AMQPValue, FieldTable};
use rand::seq::SliceRandom;
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const SETTLE: Duration = Duration::from_secs(120);

fn entry(account: &str, version: i64) -> Vec<u8> {
    json!({
        "event_id": format!("{account}-v{version}"),
        "tenant": "acme",
        "account": account,
        "version": version,
        "amount": version * 10,
    })
    .to_string()
    .into_bytes()
}

/// Each account's applied versions, in the order they were applied.
async fn applied(pool: &PgPool) -> BTreeMap<String, Vec<i64>> {
    let rows: Vec<(String, Option<i64>)> =
        sqlx::query_as("SELECT account, version FROM account_entries ORDER BY applied")
            .fetch_all(pool)
            .await
            .unwrap_or_default();
    let mut by_account: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (account, version) in rows {
        by_account
            .entry(account)
            .or_default()
            .push(version.unwrap_or(0));
    }
    by_account
}

async fn applied_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM account_entries")
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

/// Entries that started before the entry applied before them in their account wrote:
/// two of one account at once.
async fn overlaps(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT started, lag(at) OVER (PARTITION BY account ORDER BY applied) AS before
               FROM account_entries) e
          WHERE started < before",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The position of `account` (of the accounts example): whose turn it is.
async fn next_seq(pool: &PgPool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT next_seq FROM ordering_positions WHERE ordering_key = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn waiting(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ordering_waiting")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Creates the example's tables with a worker on a queue of its own, and declares the
/// test's queue (with the tiers the workers declare) so that what is published first
/// waits for them.
async fn prepare(pool: &PgPool, url: &str, q: &TestQueue) {
    prepare_as(pool, url, q, false).await;
}

/// [`prepare`], the queue with a single active consumer when `owned` (owned order).
async fn prepare_as(pool: &PgPool, url: &str, q: &TestQueue, owned: bool) {
    // Calls of the gate's functions counted (`pg_stat_user_functions`) in the workers'
    // sessions, which open after this.
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(pool)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{database}\" SET track_functions = 'pl'"
    )))
    .execute(pool)
    .await
    .unwrap();
    let setup = q.beside("setup").await;
    let worker = spawn_accounts_worker(url, &setup.name, &[]);
    wait_until(Duration::from_secs(60), "the example's tables", || async {
        sqlx::query_scalar::<_, bool>("SELECT to_regclass('account_failures') IS NOT NULL")
            .fetch_one(pool)
            .await
            .unwrap_or(false)
    })
    .await;
    drop(worker);
    let topology = idem::Topology {
        queue: q.name.clone(),
        queue_type: idem::QueueType::Classic,
        retry_delays: RETRY_DELAYS_MS
            .iter()
            .map(|&ms| Duration::from_millis(ms))
            .collect(),
        subscriptions: Vec::new(),
        single_active_consumer: owned,
    };
    topology.declare(&q.connection).await.unwrap();
}

/// The test's pool, its database's URL and a queue named after `name`, prepared
/// ([`prepare_as`]).
async fn prepared(
    o: PgPoolOptions,
    c: &PgConnectOptions,
    name: &str,
    owned: bool,
) -> (PgPool, String, TestQueue) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let url = database_url(c);
    let q = TestQueue::new(name).await;
    prepare_as(&pool, &url, &q, owned).await;
    (pool, url, q)
}

async fn all_settled(q: &TestQueue) -> bool {
    q.counts(&q.name).await.0 == 0 && unacked(&q.name).await == 0
}

/// The worker arguments of a test's processes: its mode, and owned order when `owned`.
fn worker_args<'a>(mode: &'a str, owned: bool, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--mode", mode];
    if owned {
        args.push("--single-active-consumer");
    }
    args.extend_from_slice(more);
    args
}

/// What befalls the process that applied last, a third of the way through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blow {
    /// SIGKILLed, and another process started.
    Kill,
    /// Its broker connection closed by the broker: the process lives on and connects
    /// again (under owned order, with its positions forgotten, as a standby).
    CloseConnection,
}

/// 40 accounts × 15 entries, each account's entries shuffled, published round-robin;
/// three processes; the one that applied last is dealt `blow` after a third is applied
/// (`owned`: the queue's single active consumer, whose standby takes over). Every
/// account's entries are applied once each, in version order.
async fn shuffled_in_order_across_a_blow(
    o: PgPoolOptions,
    c: PgConnectOptions,
    mode: &str,
    owned: bool,
    blow: Blow,
) {
    let (pool, url, q) = prepared(o, &c, &format!("ordering-{mode}"), owned).await;
    const ACCOUNTS: usize = 40;
    const VERSIONS: i64 = 15;
    // Under a closed connection, the last 5 rounds are published after the blow (see
    // below): they hold the last 5 versions, so that a third can be applied before.
    let late = match blow {
        Blow::Kill => 0,
        Blow::CloseConnection => 5,
    };
    let before = (VERSIONS - late) as usize;
    let mut rng = rand::rng();
    let per_account: Vec<Vec<i64>> = (0..ACCOUNTS)
        .map(|_| {
            let mut v: Vec<i64> = (1..=VERSIONS).collect();
            v[..before].shuffle(&mut rng);
            v[before..].shuffle(&mut rng);
            v
        })
        .collect();
    // The three consume before anything is published, so that the broker spreads the
    // entries over them: published first, they could all go to one, and the kill to a
    // process that held none.
    // A closed connection takes rabbitmqctl about a second: the run must last longer
    // (leased: an account's 15 entries one after another, 300 ms each; transactional:
    // a batch's handlers one after another, 30 ms each).
    let work_ms = match (blow, mode) {
        (Blow::Kill, _) => "2",
        (Blow::CloseConnection, "transactional") => "30",
        (Blow::CloseConnection, _) => "300",
    };
    let args = worker_args(mode, owned, &["--work-ms", work_ms]);
    let mut workers: Vec<WorkerProcess> = (0..3)
        .map(|_| spawn_accounts_worker(&url, &q.name, &args))
        .collect();
    wait_for_consumers(&q, 3).await;
    // Under a closed connection, the process lives on and runs the turns it reads back
    // from their rows (no broker needed): the late rounds come after the blow, so that
    // its successor takes deliveries while it still runs its turns.
    let publish_rounds = |rounds: std::ops::Range<usize>| {
        let (q, per_account) = (&q, &per_account);
        async move {
            for round in rounds {
                for (a, versions) in per_account.iter().enumerate() {
                    q.publish(&entry(&format!("a{a}"), versions[round])).await;
                }
            }
        }
    };
    publish_rounds(0..before).await;
    let total = (ACCOUNTS as i64) * VERSIONS;
    wait_until(SETTLE, "a third applied", || async {
        applied_count(&pool).await >= total / 3
    })
    .await;
    let pids = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(DISTINCT pid) FROM account_entries")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    if owned {
        assert_eq!(pids().await, 1, "one process consumes at a time");
        for w in &workers {
            assert!(w.log_contains("owned_order=true"), "owned order is on");
        }
    }
    // The process that applied last: under a single active consumer, the active one.
    let last: i32 = sqlx::query_scalar("SELECT pid FROM account_entries ORDER BY applied DESC")
        .fetch_one(&pool)
        .await
        .unwrap();
    let at = workers
        .iter()
        .position(|w| w.child.id() == u32::try_from(last).ok())
        .expect("the last entry's process is one of the three");
    let mut _d = None;
    match blow {
        Blow::Kill => {
            let mut victim = workers.swap_remove(at);
            signal(&victim, "KILL");
            let _ = victim.child.wait().await;
            _d = Some(spawn_accounts_worker(&url, &q.name, &args));
        }
        Blow::CloseConnection => {
            let pid = workers[at].pid();
            let closed = tokio::task::spawn_blocking(move || {
                close_broker_connections_of("accounts_worker", pid)
            })
            .await
            .unwrap();
            assert!(closed >= 1, "closed the active process's connection");
        }
    }
    assert!(
        applied_count(&pool).await < total,
        "the blow came after the end"
    );
    publish_rounds(before..VERSIONS as usize).await;
    wait_until(SETTLE, "every entry applied and acked", || async {
        applied_count(&pool).await >= total && all_settled(&q).await && waiting(&pool).await == 0
    })
    .await;
    let expected: Vec<i64> = (1..=VERSIONS).collect();
    let by_account = applied(&pool).await;
    assert_eq!(by_account.len(), ACCOUNTS);
    for (account, versions) in &by_account {
        assert_eq!(
            versions, &expected,
            "account {account} out of order or twice"
        );
    }
    let letters: Vec<_> = q
        .drain(&q.dlq())
        .await
        .iter()
        .map(|l| (l.reason.clone(), l.error.clone(), l.body_text()))
        .collect();
    assert!(letters.is_empty(), "dead-lettered: {letters:?}");
    assert_eq!(
        overlaps(&pool).await,
        0,
        "two entries of one account ran at once"
    );
    // More than one process applied entries: the order held across them. (After a
    // closed connection, the process that lived on may have run every turn left from
    // its rows and its successor's parks.)
    let pids = pids().await;
    println!("{pids} process(es) applied entries");
    if blow == Blow::Kill {
        assert!(pids >= 2, "{pids} process(es) applied entries");
    } else {
        // Its second session: it connected again (a standby, or active once more).
        wait_until(SETTLE, "the closed process consuming again", || async {
            workers[at].log_count("owned_order=true") >= 2
        })
        .await;
    }
    // Which path ordered the entries: the gate's function is called at every entry;
    // owned order never calls it. Counted once every session of the workers ended (a
    // session's counts reach the statistics when it ends, at the latest).
    drop((workers, _d));
    pool.close().await;
    let one = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(c)
        .await
        .unwrap();
    wait_until(SETTLE, "the workers' sessions ended", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_one(&one)
        .await
        .unwrap()
            == 0
    })
    .await;
    let entered: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_user_functions
          WHERE funcname = 'idem_ordering_enter'",
    )
    .fetch_one(&one)
    .await
    .unwrap();
    match owned {
        true => assert_eq!(
            entered, 0,
            "owned order entered deliveries through the gate"
        ),
        false => assert!(entered > 0, "the gate's calls are counted"),
    }
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn shuffled_sequences_apply_in_order_across_processes_and_a_kill_leased(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    shuffled_in_order_across_a_blow(o, c, "leased", false, Blow::Kill).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn shuffled_sequences_apply_in_order_across_processes_and_a_kill_transactional(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    shuffled_in_order_across_a_blow(o, c, "transactional", false, Blow::Kill).await;
}

/// The same under owned order (a single active consumer keeping the positions), the
/// active process killed: its standby takes over.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_applies_shuffled_sequences_in_order_across_a_takeover_leased(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    shuffled_in_order_across_a_blow(o, c, "leased", true, Blow::Kill).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_applies_shuffled_sequences_in_order_across_a_takeover_transactional(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    shuffled_in_order_across_a_blow(o, c, "transactional", true, Blow::Kill).await;
}

/// Owned order across a broker connection the broker closes under the active process:
/// the process lives on, its in-flight turns end against positions another process
/// now owns, and it comes back as a standby with nothing remembered.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_applies_shuffled_sequences_in_order_across_a_closed_connection_leased(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    shuffled_in_order_across_a_blow(o, c, "leased", true, Blow::CloseConnection).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_applies_shuffled_sequences_in_order_across_a_closed_connection_transactional(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    shuffled_in_order_across_a_blow(o, c, "transactional", true, Blow::CloseConnection).await;
}

/// Waits (20 s at most: less than the tests' sweep interval) for x's 2 and y's 1, which a
/// sweep or a takeover brings back.
async fn x2_and_y1_applied(pool: &PgPool) {
    wait_until(
        Duration::from_secs(20),
        "x's 2 and y's 1 applied",
        || async {
            let applied = applied(pool).await;
            applied.get("x") == Some(&vec![2]) && applied.get("y") == Some(&vec![1])
        },
    )
    .await;
}

async fn nothing_left_waiting(pool: &PgPool, q: &TestQueue) {
    wait_until(SETTLE, "nothing left waiting", || async {
        waiting(pool).await == 0 && all_settled(q).await
    })
    .await;
}

/// A turn handed in process to a worker that died comes back through a sweep. A
/// redelivery (what the dead worker held, given back by the broker) wakes the sweep of a
/// worker that remains: the turn comes back about a second after its release went
/// stale, not at the sweep's own pace (a minute here, as a backed-off sweep can wait
/// several seconds).
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_turn_handed_to_a_worker_that_died_comes_back_at_the_next_redelivery(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let url = database_url(&c);
    let q = TestQueue::new("ordering-redelivery").await;
    prepare(&pool, &url, &q).await;
    // A message held unacked on a channel of the test's, redelivered when it closes.
    q.publish(&entry("y", 1)).await;
    let consumer = q.connection.create_channel().await.unwrap();
    let held = consumer
        .basic_get(q.name.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap();
    assert!(held.is_some(), "no message to hold");
    let args = ["--mode", "transactional", "--sweep-every-ms", "60000"];
    let worker = spawn_accounts_worker(&url, &q.name, &args);
    q.publish(&entry("x", 2)).await;
    wait_until(SETTLE, "x's 2 waiting", || async {
        waiting(&pool).await == 1 && q.counts(&q.name).await.0 == 0
    })
    .await;
    // What a worker that died leaves: 1 completed, the position moved to 2 and its turn
    // handed to 2's waiting row, released to that worker 3 s ago.
    sqlx::query(
        "UPDATE ordering_positions p
            SET next_seq = 2, holder_operation = w.operation, holder_key = w.idempotency_key,
                held_since = now() - interval '3 seconds'
           FROM ordering_waiting w
          WHERE p.scope = w.scope AND p.ordering_key = w.ordering_key",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE ordering_waiting SET released_at = now() - interval '3 seconds', releases = 1",
    )
    .execute(&pool)
    .await
    .unwrap();
    consumer.close(200, "a consumer goes".into()).await.unwrap();
    x2_and_y1_applied(&pool).await;
    assert!(worker.log_contains("ordering sweep released waiting deliveries"));
    assert!(worker.log_contains("redelivered=true"));
    nothing_left_waiting(&pool, &q).await;
}

/// Owned order: a turn handed in process to an owner that died is published again by
/// the next owner as soon as the queue is its own (its first delivery), not by a sweep
/// (a minute here), and no redelivery wakes one: the handed delivery was acked when it
/// was parked. So is one that ran long enough there to be recorded as its entity's
/// holder (z's 2).
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_turn_handed_to_an_owner_that_died_is_taken_over_by_the_next(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-takeover", true).await;
    let args = worker_args("transactional", true, &["--sweep-every-ms", "60000"]);
    let first = spawn_accounts_worker(&url, &q.name, &args);
    q.publish(&entry("x", 2)).await;
    q.publish(&entry("z", 2)).await;
    wait_until(SETTLE, "x's and z's 2 waiting", || async {
        waiting(&pool).await == 2 && all_settled(&q).await
    })
    .await;
    drop(first);
    // What the owner that died leaves: 1 completed, the position moved to 2 and x's 2
    // handed to it in process a moment ago (not stale for a sweep); z's 2 too, which
    // ran long enough to be recorded as z's holder.
    sqlx::query("UPDATE ordering_positions SET next_seq = 2")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE ordering_waiting SET released_at = now(), releases = 1")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE ordering_positions p
            SET holder_operation = w.operation, holder_key = w.idempotency_key, held_since = now()
           FROM ordering_waiting w
          WHERE w.ordering_key = p.ordering_key AND p.ordering_key = 'account-z'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let next = spawn_accounts_worker(&url, &q.name, &args);
    q.publish(&entry("y", 1)).await;
    x2_and_y1_applied(&pool).await;
    wait_until(Duration::from_secs(20), "z's 2 applied", || async {
        applied(&pool).await.get("z") == Some(&vec![2])
    })
    .await;
    assert!(next.log_contains("owned order: took over the turns a previous owner was handed"));
    assert!(!next.log_contains("ordering sweep released waiting deliveries"));
    nothing_left_waiting(&pool, &q).await;
}

/// Owned order, leased mode: a turn's move is in its handler's commit while at most half
/// the queue's runs are taken, else batched right after the commit. A process that
/// aborts between that commit and its ack (failpoint `after-complete`) tells them
/// apart: at concurrency 4 the position has moved with the record, at concurrency 1 it
/// has not. Either way the next process moves on from the redelivery (the record
/// decides it: applied once) and runs the account's next entry.
async fn owned_leased_move_across_a_crash_after_the_commit(
    o: PgPoolOptions,
    c: PgConnectOptions,
    concurrency: &str,
    moved_in_commit: bool,
) {
    let (pool, url, q) = prepared(o, &c, &format!("ordering-move-c{concurrency}"), true).await;
    let args = worker_args("leased", true, &["--concurrency", concurrency]);
    let crash = [("IDEM_FAILPOINT", "after-complete")];
    let mut crashing = spawn_accounts_worker_with_env(&url, &q.name, &args, &crash);
    q.publish(&entry("x", 1)).await;
    let status = tokio::time::timeout(SETTLE, crashing.child.wait())
        .await
        .expect("the worker reaches the failpoint")
        .unwrap();
    assert!(!status.success(), "aborted after the commit: {status:?}");
    assert_eq!(applied(&pool).await.get("x"), Some(&vec![1]));
    assert_eq!(
        next_seq(&pool, "account-x").await,
        if moved_in_commit { 2 } else { 1 }
    );
    let _next = spawn_accounts_worker(&url, &q.name, &args);
    q.publish(&entry("x", 2)).await;
    wait_until(
        SETTLE,
        "x's 1 and 2 applied once each, in order",
        || async {
            applied(&pool).await.get("x") == Some(&vec![1, 2])
                && next_seq(&pool, "account-x").await == 3
                && waiting(&pool).await == 0
                && all_settled(&q).await
        },
    )
    .await;
    assert_eq!(applied(&pool).await.get("x"), Some(&vec![1, 2]));
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_leased_turn_moves_in_its_handlers_commit_while_few_run(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    owned_leased_move_across_a_crash_after_the_commit(o, c, "4", true).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_leased_turn_moves_after_its_commit_under_load(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    owned_leased_move_across_a_crash_after_the_commit(o, c, "1", false).await;
}

/// Account `r`'s entries `last` down to 2, parked (the worker has taken them all),
/// then its 1: a completion whose move finds the rest parked after it.
async fn parked_then_first(pool: &PgPool, q: &TestQueue, last: i64) {
    parked_after_first(pool, q, last).await;
    q.publish(&entry("r", 1)).await;
}

/// Account `r`'s entries `last` down to 2, parked: the worker has taken them all.
async fn parked_after_first(pool: &PgPool, q: &TestQueue, last: i64) {
    for v in (2..=last).rev() {
        q.publish(&entry("r", v)).await;
    }
    wait_until(SETTLE, "r's entries after 1 parked", || async {
        waiting(pool).await == last - 1 && all_settled(q).await
    })
    .await;
}

/// Waits until account `r`'s 1 and 2 are applied and its 3 is dead-lettered, nothing
/// queued; only 1 and 2 applied, in order.
async fn r_applied_to_2_and_3_dead_lettered(pool: &PgPool, q: &TestQueue) {
    wait_until(SETTLE, "r's 1 and 2 applied, 3 dead-lettered", || async {
        applied(pool).await.get("r").is_some_and(|v| v.len() == 2)
            && q.counts(&q.dlq()).await.0 == 1
            && all_settled(q).await
    })
    .await;
    assert_eq!(applied(pool).await["r"], vec![1, 2]);
}

/// Waits until account `r`'s 1 to `last` are applied, nothing waits or stays queued,
/// and its position is past them; they applied once each, in order.
async fn r_applied_to(pool: &PgPool, q: &TestQueue, last: i64) {
    wait_until(SETTLE, "r applied to its last entry", || async {
        applied(pool)
            .await
            .get("r")
            .is_some_and(|v| v.len() as i64 == last)
            && next_seq(pool, "account-r").await == last + 1
            && waiting(pool).await == 0
            && all_settled(q).await
    })
    .await;
    assert_eq!(applied(pool).await["r"], (1..=last).collect::<Vec<_>>());
}

/// Whether `account`'s position was moved by the statement that wrote its holder
/// (`moved_at` is `held_since`): a turn of a leased run that held it, moving the position
/// from the run's first number to its own. A turn that stood at its own number (its
/// predecessor moved the position) writes only its holder, later than any move.
async fn moved_by_its_holder(pool: &PgPool, account: &str) -> bool {
    sqlx::query_scalar(
        "SELECT moved_at = held_since FROM ordering_positions WHERE ordering_key = $1",
    )
    .bind(format!("account-{account}"))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A leased run hands turns on without a move for 250 ms from its start; the tests
/// that need a turn handed on in a run stretch that to 900 ms (failpoints build), so
/// that a loaded machine, where a turn may take longer, still runs their run. Not past
/// a second: the sweep takes a released row whose position has not moved for that long
/// (`RELEASE_STALE`), which a run must not normally meet.
const RUN_WIDE: (&str, &str) = ("IDEM_RUN_FOR_MS", "900");

/// Owned order, leased mode, under load (concurrency 1: the moves go after the commit):
/// a completion's move releases the row at the next number and reads the rows after it,
/// and the task hands each turn on to the next without moving the position (a run);
/// the run's last turn moves it past them all. Account `r`'s 2 to 10 are parked, then
/// 1 comes. A process that aborts right after a hand-on (failpoint `after-hand-on`)
/// leaves the position at a turn that completed: the next owner publishes that row,
/// its record decides it (a duplicate), and the account runs on, each entry applied
/// once, in order.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_leased_run_survives_a_kill_between_its_turns(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-run-kill", true).await;
    let args = worker_args("leased", true, &["--concurrency", "1"]);
    let crash = [("IDEM_FAILPOINT", "after-hand-on"), RUN_WIDE];
    let mut crashing = spawn_accounts_worker_with_env(&url, &q.name, &args, &crash);
    parked_then_first(&pool, &q, 10).await;
    let status = tokio::time::timeout(SETTLE, crashing.child.wait())
        .await
        .expect("a turn hands on to the next (the failpoint)")
        .unwrap();
    assert!(!status.success(), "aborted after a hand-on: {status:?}");
    let by = applied(&pool).await;
    let ran = by["r"].len() as i64;
    assert_eq!(by["r"], (1..=ran).collect::<Vec<_>>());
    assert!(ran >= 2, "1 moved the position, a turn after it handed on");
    assert_eq!(
        next_seq(&pool, "account-r").await,
        ran,
        "the turn that handed on did not move the position"
    );
    let _next = spawn_accounts_worker(&url, &q.name, &args);
    r_applied_to(&pool, &q, 10).await;
}

/// A turn of a leased run that fails for good moves the position from the run's first
/// number to its own and holds it, in one statement: account `r`'s 2 to 6 are parked,
/// then 1 comes, and 3 fails. 1 and 2 apply, 3 is dead-lettered and listed as what
/// blocks `r` (its number, its key), 4 to 6 wait; replayed once fixed, 3 to 6 apply in
/// order.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_leased_runs_failing_turn_holds_its_number(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-run-fail", true).await;
    sqlx::query("INSERT INTO account_failures (account, event_id) VALUES ('r', 'r-v3')")
        .execute(&pool)
        .await
        .unwrap();
    let args = worker_args("leased", true, &["--concurrency", "1"]);
    let _w = spawn_accounts_worker_with_env(&url, &q.name, &args, &[RUN_WIDE]);
    parked_then_first(&pool, &q, 6).await;
    r_applied_to_2_and_3_dead_lettered(&pool, &q).await;
    assert_eq!(next_seq(&pool, "account-r").await, 3);
    assert_eq!(holder(&pool, "r").await.as_deref(), Some("r-v3"));
    assert!(
        moved_by_its_holder(&pool, "r").await,
        "3 was handed on in a run (2 completed within RUN_WIDE of the run's start), and its \
         hold moved the position from the run's first number"
    );
    assert_eq!(waiting(&pool).await, 3, "4 to 6 wait");
    sqlx::query("DELETE FROM account_failures")
        .execute(&pool)
        .await
        .unwrap();
    idem_cli(&url, &["dlq", "replay", "--queue", &q.name]).await;
    r_applied_to(&pool, &q, 6).await;
}

/// Makes account `r`'s entry `event` wait in its handler (`slow`) on a lock that the
/// returned transaction holds until it ends.
async fn held_in_handler(pool: &PgPool, event: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    sqlx::query("INSERT INTO account_failures (account, event_id, kind) VALUES ('r', $1, 'slow')")
        .bind(event)
        .execute(pool)
        .await
        .unwrap();
    let mut lock = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM account_failures WHERE event_id = $1 FOR UPDATE")
        .bind(event)
        .execute(&mut *lock)
        .await
        .unwrap();
    lock
}

/// A turn of a leased run that runs long moves the position to its own number and
/// holds it, half a second in, where a turn handed on alone would stand: account `r`'s
/// 2 to 6 are parked, then 1 comes, and 3 waits on a lock the test holds (`slow`). The
/// sweep is slowed to once in ten minutes: the mark alone moves the position (before,
/// the position stood at the run's first number until the sweep published that row
/// again and moved it on). One statement moved it past 2 and marked 3 its holder
/// (`moved_at` is `held_since`: had 2 moved it itself, outside a run, the mark would
/// have come apart from the move). 2's row is gone, 3's is released; the listing shows
/// 3 `running` at its number and a skip is refused. Let go, 3 to 6 apply in order,
/// each once.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_long_turn_in_a_leased_run_holds_its_own_number(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-run-long", true).await;
    let lock = held_in_handler(&pool, "r-v3").await;
    let slow_sweep = ["--concurrency", "1", "--sweep-every-ms", "600000"];
    let args = worker_args("leased", true, &slow_sweep);
    let _w = spawn_accounts_worker_with_env(&url, &q.name, &args, &[RUN_WIDE]);
    parked_then_first(&pool, &q, 6).await;
    wait_until(SETTLE, "3 holds the position at its number", || async {
        next_seq(&pool, "account-r").await == 3
            && holder(&pool, "r").await.as_deref() == Some("r-v3")
    })
    .await;
    assert_eq!(applied(&pool).await["r"], vec![1, 2]);
    assert!(
        moved_by_its_holder(&pool, "r").await,
        "3 was handed on in a run (2 completed within RUN_WIDE of the run's start), and its \
         mark moved the position"
    );
    let rows: Vec<(i64, i32)> = sqlx::query_as(
        "SELECT seq, releases FROM ordering_waiting WHERE ordering_key = 'account-r' ORDER BY seq",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows, vec![(3, 1), (4, 0), (5, 0), (6, 0)]);
    let listed = idem_cli(&url, &["ops", "ordering", "list", "--json"]).await;
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed[0]["blocked_by"], "running", "{listed}");
    assert_eq!(listed[0]["next_seq"], 3, "{listed}");
    let refused = idem_command(&url, &skip_args("acme", "account-r", &["--note", "x"]))
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "the skip of a running turn is refused"
    );
    assert!(said.contains("runs now"), "{said}");
    lock.rollback().await.unwrap();
    r_applied_to(&pool, &q, 6).await;
}

/// A turn that meets the live lease of another process running it holds its number, so
/// that operators see it running and a skip is refused, as for any turn that runs.
/// Account `r`'s 2 to 6 are parked, then 1 comes; process A runs 1, and 2 hands 3 on in
/// a run (the position stays at 2), where 3 waits on a lock the test holds. A's marks
/// are put off (`IDEM_MARK_AFTER_MS`), as if its turn had begun just before. A loses its
/// broker connection, and B, the next consumer, takes over row 2: a duplicate, its move
/// puts the position at 3, and B's 3 meets A's live lease (`duplicate_in_progress`; its
/// retry copy put off for ten minutes). B's 3 records itself the holder: the listing
/// says `running` and a skip is refused. (Before, the position stood at 3 with no
/// holder and no row while A's 3 ran: listed a `gap`, and a skip would have run 4
/// beside it.) Let go, 3 to 6 apply once each, in order.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_turn_meeting_anothers_live_lease_holds_its_number(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    meets_a_live_lease(o, c, false).await;
}

/// The same with A SIGKILLed instead (its lease lives 3 s on) and no retry delays: B's 3
/// is given back to the sweep (a requeue), and holding the position it keeps its row,
/// all there is of the message (parked, acked, and A died with it). Once A's lease ran
/// out, the sweep publishes it, B runs it, and 3 to 6 apply once each, in order. (The
/// hold deleted the row: 3 was lost, and the account stood for good.)
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_turn_meeting_a_killed_owners_lease_keeps_its_row(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    meets_a_live_lease(o, c, true).await;
}

async fn meets_a_live_lease(o: PgPoolOptions, c: PgConnectOptions, killed: bool) {
    let (pool, url, q) = prepared(o, &c, "ordering-live-lease", true).await;
    let lock = held_in_handler(&pool, "r-v3").await;
    let long = LONG_RETRY_DELAY_MS.to_string();
    let later = match killed {
        true => &["--no-retry-delays", "--lease-secs", "3"][..],
        false => &["--retry-delays-ms", &long][..],
    };
    let args = worker_args(
        "leased",
        true,
        &[&["--concurrency", "1"][..], later].concat(),
    );
    let env = [RUN_WIDE, ("IDEM_MARK_AFTER_MS", "600000")];
    let a = spawn_accounts_worker_with_env(&url, &q.name, &args, &env);
    wait_for_consumers(&q, 1).await;
    let b = spawn_accounts_worker_with_env(&url, &q.name, &args, &env);
    wait_for_consumers(&q, 2).await;
    parked_then_first(&pool, &q, 6).await;
    wait_until(SETTLE, "A's 3 in its handler", || async {
        sqlx::query_scalar::<_, String>(
            "SELECT status FROM processed_operations WHERE idempotency_key = 'r-v3'",
        )
        .fetch_optional(&pool)
        .await
        .unwrap()
        .as_deref()
            == Some("processing")
    })
    .await;
    assert_eq!(applied(&pool).await["r"], vec![1, 2]);
    assert_eq!(
        (next_seq(&pool, "account-r").await, holder(&pool, "r").await),
        (2, None),
        "3 runs in a run begun at 2"
    );
    let mut a = a;
    if killed {
        signal(&a, "KILL");
        let _ = a.child.wait().await;
    } else {
        let pid = a.pid();
        let closed = tokio::task::spawn_blocking(move || {
            close_broker_connections_of("accounts_worker", pid)
        })
        .await
        .unwrap();
        assert!(closed >= 1, "closed A's connection");
    }
    // B's first delivery begins its takeover.
    q.publish(&entry("z", 1)).await;
    wait_until(SETTLE, "B's 3 met A's lease", || async {
        b.log_contains("outcome=\"duplicate_in_progress\"")
    })
    .await;
    wait_until(SETTLE, "3 held at its number", || async {
        next_seq(&pool, "account-r").await == 3
            && holder(&pool, "r").await.as_deref() == Some("r-v3")
    })
    .await;
    if !killed {
        let listed = idem_cli(&url, &["ops", "ordering", "list", "--json"]).await;
        let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
        assert_eq!(listed[0]["blocked_by"], "running", "{listed}");
        let refused = idem_command(&url, &skip_args("acme", "account-r", &["--note", "x"]))
            .output()
            .await
            .unwrap();
        assert!(
            !refused.status.success(),
            "the skip of a running turn is refused"
        );
        assert_eq!(next_seq(&pool, "account-r").await, 3, "nothing skipped");
    }
    lock.rollback().await.unwrap();
    wait_until(SETTLE, "r applied to 6", || async {
        applied(&pool).await.get("r").is_some_and(|v| v.len() == 6)
            && next_seq(&pool, "account-r").await == 7
            && waiting(&pool).await == 0
    })
    .await;
    assert_eq!(applied(&pool).await["r"], (1..=6).collect::<Vec<_>>());
    drop((a, b));
}

/// A leased turn that ran longer than a run may hand on reads nothing ahead with its
/// move: its successor would not complete within the run's time either, and the rows
/// read would be read again by the successor's own move (on the shuffled bench under
/// load, nearly every turn: docs/PERFORMANCE.md). Account `r`'s 2 to 6 are parked,
/// then 1 comes; 1 and 3 wait on locks the test holds (`slow`). 1 runs until it is
/// written down as the holder (a second, past `RUN_WIDE`); let go, its move releases
/// 2 alone. 2 is quick: its move releases 3 and reads 4 to 6. So 3 stands at its own
/// number, released by a move, not handed on in a run begun by 1's move: its mark
/// writes the holder alone (`moved_at` is not `held_since`; in a run, the mark would
/// have moved the position from 2, as in the test above). Let go, 3 to 6 apply in
/// order, each once.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_slow_leased_turn_reads_nothing_ahead(o: PgPoolOptions, c: PgConnectOptions) {
    let (pool, url, q) = prepared(o, &c, "ordering-run-slow", true).await;
    let lock1 = held_in_handler(&pool, "r-v1").await;
    let lock3 = held_in_handler(&pool, "r-v3").await;
    let slow_sweep = ["--concurrency", "1", "--sweep-every-ms", "600000"];
    let args = worker_args("leased", true, &slow_sweep);
    let _w = spawn_accounts_worker_with_env(&url, &q.name, &args, &[RUN_WIDE]);
    parked_then_first(&pool, &q, 6).await;
    wait_until(SETTLE, "1 runs long enough to be written down", || async {
        holder(&pool, "r").await.as_deref() == Some("r-v1")
    })
    .await;
    lock1.rollback().await.unwrap();
    wait_until(SETTLE, "3 holds the position at its number", || async {
        next_seq(&pool, "account-r").await == 3
            && holder(&pool, "r").await.as_deref() == Some("r-v3")
    })
    .await;
    assert_eq!(applied(&pool).await["r"], vec![1, 2]);
    assert!(
        !moved_by_its_holder(&pool, "r").await,
        "3 was released by 2's move, not handed on in a run begun by 1's move"
    );
    let rows: Vec<(i64, i32)> = sqlx::query_as(
        "SELECT seq, releases FROM ordering_waiting WHERE ordering_key = 'account-r' ORDER BY seq",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows, vec![(3, 1), (4, 0), (5, 0), (6, 0)]);
    lock3.rollback().await.unwrap();
    r_applied_to(&pool, &q, 6).await;
}

/// A turn that a completion's move released runs next in its task in the place among
/// the queue's runs that the completed turn held, before the deliveries waiting for a
/// place: concurrency 1, account `r`'s 2 is parked and its 1 waits on a lock the test
/// holds (`slow`) while `x`'s and `y`'s 1 come and wait for the place. Let go, 1's
/// move releases 2, which applies before them (waiting behind them, a released turn
/// took half a second to complete under load, and its run rarely handed on).
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_released_turn_runs_in_the_place_of_the_turn_before_it(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-run-place", true).await;
    let lock = held_in_handler(&pool, "r-v1").await;
    let args = worker_args("leased", true, &["--concurrency", "1"]);
    let _w = spawn_accounts_worker(&url, &q.name, &args);
    parked_then_first(&pool, &q, 2).await;
    wait_until(SETTLE, "1 runs, holding the place", || async {
        holder(&pool, "r").await.as_deref() == Some("r-v1")
    })
    .await;
    q.publish(&entry("x", 1)).await;
    q.publish(&entry("y", 1)).await;
    wait_until(
        SETTLE,
        "x's and y's 1 taken, waiting for the place",
        || async { q.counts(&q.name).await.0 == 0 && unacked(&q.name).await == 3 },
    )
    .await;
    lock.rollback().await.unwrap();
    wait_until(SETTLE, "all applied", || async {
        applied_count(&pool).await == 4 && all_settled(&q).await
    })
    .await;
    let order: Vec<String> =
        sqlx::query_scalar("SELECT event_id FROM account_entries ORDER BY applied")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(order[..2], ["r-v1", "r-v2"], "{order:?}");
}

/// A row handed the turn in a leased run that does not enter (its body no longer
/// parses: a deploy whose handler refuses what an older one parked) is dead-lettered
/// `malformed`, and the memory the turn before it kept for it goes back to the run's
/// first number (the `Reserved` guard): account `r`'s 2 to 6 are parked, 3's body is
/// spoiled, then 1 comes. 1 and 2 apply and 3 is dead-lettered; the sweep publishes the
/// run's first row again (a duplicate), which moves the entity on to 3, listed as a gap
/// with 4 to 6 waiting. Skipped, 4 to 6 apply in order.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_handed_row_that_does_not_parse_is_dead_lettered_and_skipped(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-run-spoiled", true).await;
    let args = worker_args("leased", true, &["--concurrency", "1"]);
    let w = spawn_accounts_worker(&url, &q.name, &args);
    parked_after_first(&pool, &q, 6).await;
    sqlx::query(
        "UPDATE ordering_waiting SET body = convert_to('not an entry', 'UTF8')
          WHERE ordering_key = 'account-r' AND seq = 3",
    )
    .execute(&pool)
    .await
    .unwrap();
    q.publish(&entry("r", 1)).await;
    r_applied_to_2_and_3_dead_lettered(&pool, &q).await;
    // The position stood at the run's first number, 2, whose row the sweep publishes
    // once stale: its copy, a duplicate, moves the entity on to the gap at 3.
    // Handed on alone (no run), 2 would have moved the position past itself: no copy.
    wait_until(
        SETTLE,
        "2's copy a duplicate, r's position at 3",
        || async {
            next_seq(&pool, "account-r").await == 3
                && w.log_count("outcome=\"duplicate_completed\"") >= 1
        },
    )
    .await;
    let listed = idem_cli(&url, &["ops", "ordering", "list", "--json"]).await;
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed[0]["blocked_by"], "gap", "{listed}");
    assert_eq!(waiting(&pool).await, 3, "4 to 6 wait");
    let said = idem_cli(
        &url,
        &skip_args("acme", "account-r", &["--note", "3 no longer parses"]),
    )
    .await;
    assert!(said.contains("4 runs next"), "{said}");
    wait_until(SETTLE, "r's 4 to 6 applied", || async {
        applied(&pool).await.get("r").is_some_and(|v| v.len() == 5)
            && next_seq(&pool, "account-r").await == 7
            && waiting(&pool).await == 0
            && all_settled(&q).await
    })
    .await;
    assert_eq!(applied(&pool).await["r"], vec![1, 2, 4, 5, 6]);
}

/// Account `a`'s third entry fails for good: it is dead-lettered and a's later entries
/// wait (no retry tier, no dead letter), while account `b` runs to its end. `idem ops
/// ordering list` says what blocks `a`; once the failure is fixed and the dead letter
/// replayed, a's entries run in order.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_failing_predecessor_blocks_only_its_account_until_it_is_replayed(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    blocked_until_replayed(o, c, false).await;
}

/// The same under owned order: the blocked turn is recorded as its entity's holder.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_failing_predecessor_blocks_only_its_account_until_it_is_replayed(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    blocked_until_replayed(o, c, true).await;
}

/// Owned order in transactional mode runs a completed turn's parked successors in the
/// same transaction (a chain). Account `c`'s 3 and 2 wait when its 1 comes: all three
/// records are written by one transaction. Account `a`'s 4 fails for good: a chain that
/// meets it stops there (the batch runs again without chains), 1 to 3 run, 4 is
/// dead-lettered and 5 waits; replayed once fixed, 4 and 5 run in order.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_chains_run_parked_turns_in_one_commit_and_stop_at_a_failure(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-chains", true).await;
    sqlx::query("INSERT INTO account_failures (account, event_id) VALUES ('a', 'a-v4')")
        .execute(&pool)
        .await
        .unwrap();
    let addr = free_addr();
    let more = ["--metrics-addr", addr.as_str()];
    let _w = spawn_accounts_worker(&url, &q.name, &worker_args("transactional", true, &more));
    for (account, v) in [("a", 2), ("a", 4), ("c", 3), ("a", 5), ("a", 3), ("c", 2)] {
        // a's 5 comes as an operator's replay from a dead-letter queue would: a chained
        // turn counts among the replays.
        let mut headers = FieldTable::default();
        if (account, v) == ("a", 5) {
            headers.insert("idem-replays".into(), AMQPValue::LongLongInt(1));
        }
        let properties = BasicProperties::default()
            .with_message_id(uuid::Uuid::new_v4().to_string().into())
            .with_headers(headers);
        q.publish_to(&q.name, &entry(account, v), properties).await;
    }
    wait_until(SETTLE, "the early entries parked", || async {
        waiting(&pool).await == 6 && all_settled(&q).await
    })
    .await;
    // c first: a batch whose chain fails runs again without any chain.
    q.publish(&entry("c", 1)).await;
    wait_until(SETTLE, "c done", || async {
        applied(&pool).await.get("c").is_some_and(|v| v.len() == 3) && all_settled(&q).await
    })
    .await;
    assert_eq!(applied(&pool).await["c"], vec![1, 2, 3]);
    assert_eq!(
        commits(&pool, "c").await,
        1,
        "c's 1, 2 and 3 committed together"
    );
    q.publish(&entry("a", 1)).await;
    wait_until(SETTLE, "a blocked at 4", || async {
        applied(&pool).await.get("a").is_some_and(|v| v.len() == 3)
            && all_settled(&q).await
            && q.counts(&q.dlq()).await.0 == 1
    })
    .await;
    assert_eq!(applied(&pool).await["a"], vec![1, 2, 3]);
    assert_eq!(waiting(&pool).await, 1, "a's 5 waits");

    sqlx::query("DELETE FROM account_failures")
        .execute(&pool)
        .await
        .unwrap();
    idem_cli(&url, &["dlq", "replay", "--queue", &q.name]).await;
    wait_until(SETTLE, "a done", || async {
        applied(&pool).await.get("a").is_some_and(|v| v.len() == 5)
            && all_settled(&q).await
            && waiting(&pool).await == 0
    })
    .await;
    assert_eq!(applied(&pool).await["a"], (1..=5).collect::<Vec<_>>());
    assert_eq!(q.counts(&q.dlq()).await.0, 0);
    // Each turn a chain ran is counted as a delivery of its own: eight executed (c's 1
    // to 3, a's 1 to 5), in the tally the worker flushes every 5 s.
    wait_until(SETTLE, "eight executed in the tally", || async {
        executed(&pool, &q.name).await == 8
    })
    .await;
    // Two of them replays: a's 4 (replayed, leading a's chain) and a's 5 (chained).
    let (_, metrics) = scrape(&addr, "/metrics").await;
    let replayed = metrics.lines().find(|line| {
        line.starts_with("idem_replayed_deliveries_total{") && line.contains("outcome=\"executed\"")
    });
    assert_eq!(
        replayed.and_then(|line| line.rsplit(' ').next()),
        Some("2"),
        "{replayed:?}"
    );
}

/// The turns a chain ran committed with the turn that led it, so they are counted even
/// when that one's delivery then fails before its ack (failpoint `owned-move-error`:
/// the fetch after its move fails once, as an outage would). Account `r`'s 2 to 4 wait when
/// its 1 comes: one commit applies 1 to 4, 1's delivery is requeued and comes back as a
/// duplicate, and the tally counts three executed (2 to 4; 1's own run ends as
/// `requeued`) besides the three parks.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_chain_is_counted_when_its_heads_move_fails(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-chain-error", true).await;
    let args = worker_args("transactional", true, &[]);
    let failing = [("IDEM_FAILPOINT", "owned-move-error")];
    let worker = spawn_accounts_worker_with_env(&url, &q.name, &args, &failing);
    parked_then_first(&pool, &q, 4).await;
    r_applied_to(&pool, &q, 4).await;
    assert_eq!(
        commits(&pool, "r").await,
        1,
        "r's 1 to 4 committed together (a chain)"
    );
    wait_until(SETTLE, "1 requeued, then acked as a duplicate", || async {
        worker.log_contains("failpoint owned-move-error")
            && worker.log_contains("outcome=\"duplicate_completed\"")
    })
    .await;
    let expected = [
        ("duplicate_completed", 1),
        ("executed", 3),
        ("requeued", 1),
        ("waiting", 3),
    ];
    wait_until(
        SETTLE,
        "2 to 4 executed in the tally, 1 requeued",
        || async {
            let tally: Vec<(String, i64)> = sqlx::query_as(
                "SELECT outcome, sum(deliveries)::bigint FROM delivery_outcomes
              WHERE queue = $1 GROUP BY outcome ORDER BY outcome",
            )
            .bind(&q.name)
            .fetch_all(&pool)
            .await
            .unwrap();
            tally.iter().map(|(o, n)| (o.as_str(), *n)).eq(expected)
        },
    )
    .await;
}

/// The transactions that wrote account `account`'s records: `created_at` is `now()`,
/// the start of its transaction, so a chain's records share one.
async fn commits(pool: &PgPool, account: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(DISTINCT created_at) FROM processed_operations
          WHERE idempotency_key LIKE $1 || '-v%'",
    )
    .bind(account)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The deliveries of `queue` the tally counts as executed.
async fn executed(pool: &PgPool, queue: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(deliveries), 0)::bigint FROM delivery_outcomes
          WHERE queue = $1 AND outcome = 'executed'",
    )
    .bind(queue)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn blocked_until_replayed(o: PgPoolOptions, c: PgConnectOptions, owned: bool) {
    let (pool, url, q) = prepared(o, &c, "ordering-blocked", owned).await;
    sqlx::query("INSERT INTO account_failures (account, event_id) VALUES ('a', 'a-v3')")
        .execute(&pool)
        .await
        .unwrap();
    for v in [5, 3, 1, 8, 2, 7, 4, 6] {
        q.publish(&entry("a", v)).await;
        q.publish(&entry("b", v)).await;
    }
    let _w = spawn_accounts_worker(&url, &q.name, &worker_args("leased", owned, &[]));
    let transactional = worker_args("transactional", owned, &[]);
    let _x = spawn_accounts_worker(&url, &q.name, &transactional);
    wait_until(SETTLE, "b done, a blocked at 3", || async {
        let by = applied(&pool).await;
        by.get("b").is_some_and(|v| v.len() == 8)
            && by.get("a").is_some_and(|v| v.len() == 2)
            && all_settled(&q).await
            && q.counts(&q.dlq()).await.0 == 1
    })
    .await;
    let by = applied(&pool).await;
    assert_eq!(by["a"], vec![1, 2]);
    assert_eq!(by["b"], (1..=8).collect::<Vec<_>>());
    assert_eq!(waiting(&pool).await, 5, "a's 4 to 8 wait");
    let listed = idem_cli(&url, &["ops", "ordering", "list", "--json"]).await;
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let rows = listed.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{listed}");
    assert_eq!(rows[0]["ordering_key"], "account-a");
    assert_eq!(rows[0]["next_seq"], 3);
    assert_eq!(rows[0]["blocked_by"], "dead-lettered");
    assert_eq!(rows[0]["waiting"], 5);

    sqlx::query("DELETE FROM account_failures")
        .execute(&pool)
        .await
        .unwrap();
    idem_cli(&url, &["dlq", "replay", "--queue", &q.name]).await;
    wait_until(SETTLE, "a done", || async {
        applied(&pool).await.get("a").is_some_and(|v| v.len() == 8)
            && all_settled(&q).await
            && waiting(&pool).await == 0
    })
    .await;
    assert_eq!(applied(&pool).await["a"], (1..=8).collect::<Vec<_>>());
    assert_eq!(q.counts(&q.dlq()).await.0, 0);
}

/// A skip of a turn that ran already moves the entity past it, as the sweep would,
/// without counting a skip: account `k`'s 1 completed, and its position is put back at 1
/// as a leased run or a lost move leaves it, with 1's released row there (its record
/// completed with that payload): the skip answers `Ran`. (It counted a skip, and named
/// a turn that ran in its note.) With 1 as a completed holder instead, the skip's lock
/// moves past it and answers `Moved`.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_skip_of_a_turn_that_ran_moves_past_it_without_counting_a_skip(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-skip-ran", false).await;
    let worker = spawn_accounts_worker(&url, &q.name, &worker_args("leased", false, &[]));
    q.publish(&entry("k", 1)).await;
    wait_until(SETTLE, "1 applied", || async {
        applied_count(&pool).await == 1 && all_settled(&q).await
    })
    .await;
    // No sweep moves it meanwhile.
    drop(worker);
    let back = |row: bool| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "UPDATE ordering_positions
                    SET next_seq = 1, holder_operation = r.operation, holder_key = r.idempotency_key
                   FROM (SELECT NULLIF(operation, CASE WHEN $1 THEN operation END) AS operation,
                                NULLIF(idempotency_key, CASE WHEN $1 THEN idempotency_key END)
                                    AS idempotency_key
                           FROM processed_operations WHERE idempotency_key = 'k-v1') r
                  WHERE ordering_key = 'account-k'",
            )
            .bind(row)
            .execute(&pool)
            .await
            .unwrap();
            if row {
                sqlx::query(
                    "INSERT INTO ordering_waiting (scope, ordering_key, seq, operation,
                         idempotency_key, payload_sha256, queue, body, properties, released_at)
                     SELECT r.scope, 'account-k', 1, r.operation, r.idempotency_key,
                            r.payload_sha256, 'q', ''::bytea, '{}'::bytea, now()
                       FROM processed_operations r WHERE r.idempotency_key = 'k-v1'",
                )
                .execute(&pool)
                .await
                .unwrap();
            }
        }
    };
    for row in [true, false] {
        back(row).await;
        let said = idem::ordering::skip(&pool, "acme", "account-k", "lost upstream", None)
            .await
            .unwrap();
        let expected = match row {
            true => idem::ordering::Skipped::Ran { seq: 1 },
            false => idem::ordering::Skipped::Moved { next_seq: 2 },
        };
        assert_eq!(said, expected, "row: {row}");
        assert_eq!(next_seq(&pool, "account-k").await, 2, "row: {row}");
        assert_eq!(waiting(&pool).await, 0, "row: {row}");
        let (skipped, note): (i64, Option<String>) = sqlx::query_as(
            "SELECT skipped, skip_note FROM ordering_positions WHERE ordering_key = 'account-k'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((skipped, note), (0, None), "row: {row}");
    }
}

/// Account `g` gets 1, 2, 4, 5: 4 and 5 wait behind the gap; after the stall time the
/// entity is listed as stalled by a gap and the worker warns; skipped with a note, 4
/// and 5 run in order, and a 3 that comes after is dead-lettered as `sequence_passed`.
/// A copy of the completed 1 is acked at once while the gap holds (not parked).
async fn gap_skipped(o: PgPoolOptions, c: PgConnectOptions, mode: &str, owned: bool) {
    let (pool, url, q) = prepared(o, &c, &format!("ordering-gap-{mode}"), owned).await;
    let addr = free_addr();
    let more = ["--stall-after-ms", "300", "--metrics-addr", addr.as_str()];
    let worker = spawn_accounts_worker(&url, &q.name, &worker_args(mode, owned, &more));
    for v in [2, 5, 1, 4] {
        q.publish(&entry("g", v)).await;
    }
    wait_until(SETTLE, "1 and 2 applied, 4 and 5 waiting", || async {
        applied(&pool).await.get("g").is_some_and(|v| v.len() == 2)
            && waiting(&pool).await == 2
            && all_settled(&q).await
    })
    .await;
    q.publish(&entry("g", 1)).await;
    wait_until(SETTLE, "the copy of 1 acked as a duplicate", || async {
        worker.log_contains("outcome=\"duplicate_completed\"") && all_settled(&q).await
    })
    .await;
    assert_eq!(waiting(&pool).await, 2, "the copy of 1 did not wait");
    assert_eq!(applied(&pool).await["g"], vec![1, 2]);
    // Another event with the number 4 (which waits already): a producer's bug.
    let mut other = serde_json::from_slice::<serde_json::Value>(&entry("g", 4)).unwrap();
    other["event_id"] = "g-other-4".into();
    q.publish(other.to_string().as_bytes()).await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    let letters = q.drain(&q.dlq()).await;
    assert_eq!(letters[0].reason.as_deref(), Some("sequence_conflict"));

    wait_until(SETTLE, "the gap reported", || async {
        worker.log_contains("entities stalled")
    })
    .await;
    wait_until(
        SETTLE,
        "the gauges: 1 entity stalled, 2 waiting",
        || async {
            let (_, metrics) = scrape(&addr, "/metrics").await;
            metrics.lines().any(|l| l == "idem_ordering_stalled 1")
                && metrics.lines().any(|l| l == "idem_ordering_waiting 2")
        },
    )
    .await;
    let listed = idem_cli(
        &url,
        &[
            "ops",
            "ordering",
            "list",
            "--stalled-for",
            "300ms",
            "--json",
        ],
    )
    .await;
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed[0]["blocked_by"], "gap", "{listed}");
    assert_eq!(listed[0]["next_seq"], 3);
    assert_eq!(listed[0]["first_waiting"], 4);

    let (code, _) = run_idem(&url, &skip_args("nobody", "account-g", &["--note", "x"])).await;
    assert_ne!(code, 0, "an unknown entity is not skipped");
    let said = idem_cli(
        &url,
        &skip_args("acme", "account-g", &["--note", "3 was lost upstream"]),
    )
    .await;
    assert!(said.contains("sequence 3"), "{said}");
    let (code, _) = run_idem(
        &url,
        &skip_args("acme", "account-g", &["--seq", "3", "--note", "again"]),
    )
    .await;
    assert_ne!(code, 0, "a turn listed before it moved is not skipped");
    wait_until(SETTLE, "4 and 5 applied", || async {
        applied(&pool).await.get("g").is_some_and(|v| v.len() == 4) && waiting(&pool).await == 0
    })
    .await;
    assert_eq!(applied(&pool).await["g"], vec![1, 2, 4, 5]);

    q.publish(&entry("g", 3)).await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    let letters = q.drain(&q.dlq()).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].reason.as_deref(), Some("sequence_passed"));
    assert_eq!(applied(&pool).await["g"], vec![1, 2, 4, 5]);
}

/// A transaction holding `account_entries` locked against the handler's insert: a turn
/// that runs stays in its handler until it is rolled back.
async fn lock_entries(pool: &PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut lock = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE account_entries IN EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    lock
}

/// Whether a handler's insert into `account_entries` has waited on [`lock_entries`] for
/// longer than `at_least`.
async fn entry_held_for(pool: &PgPool, at_least: Duration) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                         WHERE datname = current_database() AND wait_event_type = 'Lock'
                           AND query LIKE 'INSERT INTO account_entries%'
                           AND now() - query_start > $1 * interval '1 millisecond')",
    )
    .bind(i64::try_from(at_least.as_millis()).unwrap())
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The idempotency key written down as `account`'s holder, if any.
async fn holder(pool: &PgPool, account: &str) -> Option<String> {
    sqlx::query_scalar("SELECT holder_key FROM ordering_positions WHERE ordering_key = $1")
        .bind(format!("account-{account}"))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The arguments of `idem ops ordering skip` for `key` of `scope`, and `more`.
fn skip_args<'a>(scope: &'a str, key: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["ops", "ordering", "skip", "--scope", scope, "--key", key];
    args.extend_from_slice(more);
    args
}

/// Under owned order, a turn that runs long is written down as its entity's holder:
/// account `h`'s 1 is held in its handler (the test locks `account_entries` against its
/// insert) with 2 parked behind it; the listing says `running` with 1's key, and a skip
/// is refused (it would run 2 beside 1). Once the lock goes, 1 and 2 apply in order and
/// the move clears the holder. With `failing_mark`, the first mark fails as an outage
/// would (failpoint `owned-mark-error`), and the next is still tried.
async fn long_owned_turn(o: PgPoolOptions, c: PgConnectOptions, mode: &str, failing_mark: bool) {
    let (pool, url, q) = prepared(o, &c, &format!("ordering-long-{mode}"), true).await;
    // The position is there and locked, as a batch's move holds it until its commit:
    // the marks tried meanwhile (after 1 s and 2 s of the turn) must not wait for it, and
    // the next one, once the lock is gone, records the holder.
    sqlx::query(
        "INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq)
         VALUES ('acme', 'account-h', 1, 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut moving = pool.begin().await.unwrap();
    let moving_pid: i32 = sqlx::query_scalar(
        "SELECT pg_backend_pid() FROM ordering_positions
          WHERE ordering_key = 'account-h' FOR UPDATE",
    )
    .fetch_one(&mut *moving)
    .await
    .unwrap();
    let failing = [("IDEM_FAILPOINT", "owned-mark-error")];
    let env = if failing_mark { &failing[..] } else { &[] };
    let worker = spawn_accounts_worker_with_env(&url, &q.name, &worker_args(mode, true, &[]), env);
    let lock = lock_entries(&pool).await;
    q.publish(&entry("h", 1)).await;
    q.publish(&entry("h", 2)).await;
    wait_until(SETTLE, "the handler held for 2.5 s", || async {
        entry_held_for(&pool, Duration::from_millis(2500)).await
    })
    .await;
    // Nothing of the worker waits for the position's lock: its read and its parks do
    // not write a position that moved within the hour, and the marks skip it.
    let waiting: Vec<String> = sqlx::query_scalar(
        "SELECT query FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))",
    )
    .bind(moving_pid)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        waiting.is_empty(),
        "waiting for the locked position: {waiting:?}"
    );
    moving.commit().await.unwrap();
    let listed = || async {
        let listed = idem_cli(&url, &["ops", "ordering", "list", "--json"]).await;
        serde_json::from_str::<serde_json::Value>(&listed).unwrap()
    };
    wait_until(SETTLE, "1 listed as running", || async {
        listed().await[0]["blocked_by"] == "running"
    })
    .await;
    assert_eq!(
        worker.log_contains("failpoint owned-mark-error: failing once"),
        failing_mark
    );
    let position = listed().await;
    assert_eq!(position[0]["next_seq"], 1, "{position}");
    assert_eq!(
        position[0]["holder"]["idempotency_key"], "h-v1",
        "{position}"
    );
    let refused = idem_command(&url, &skip_args("acme", "account-h", &["--note", "x"]))
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "the skip of a running turn is refused"
    );
    assert!(said.contains("runs now"), "{said}");
    assert_eq!(next_seq(&pool, "account-h").await, 1, "nothing skipped");
    lock.rollback().await.unwrap();
    wait_until(SETTLE, "1 and 2 applied", || async {
        applied(&pool).await.get("h").is_some_and(|v| v.len() == 2) && all_settled(&q).await
    })
    .await;
    assert_eq!(applied(&pool).await["h"], vec![1, 2]);
    assert_eq!(
        holder(&pool, "h").await,
        None,
        "the move cleared the holder"
    );
    drop(worker);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_long_turn_is_listed_running_and_not_skipped_leased(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    long_owned_turn(o, c, "leased", false).await;
}

/// A mark that fails (an outage, not a locked position) is tried again while the turn
/// runs: a turn whose first mark failed is still listed running.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_long_turn_whose_mark_fails_is_listed_running_all_the_same(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    long_owned_turn(o, c, "leased", true).await;
}

/// A long turn whose mark waits for a connection (an outage holds the pool's back: its
/// acquire timeout is 10 s; failpoint `owned-mark-stall` waits for good) ends when its
/// run ends: account `h`'s 1, held in its handler past the mark's second, is let go,
/// and 1 and 2 apply. (The mark was let finish before the turn ended, so the turn waited
/// for the pool's timeout: here for ever.)
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_long_turn_ends_while_its_mark_waits_for_a_connection(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-mark-stall", true).await;
    let stall = [("IDEM_FAILPOINT", "owned-mark-stall")];
    let args = worker_args("leased", true, &[]);
    let worker = spawn_accounts_worker_with_env(&url, &q.name, &args, &stall);
    let lock = lock_entries(&pool).await;
    q.publish(&entry("h", 1)).await;
    q.publish(&entry("h", 2)).await;
    wait_until(SETTLE, "1's mark waits for its connection", || async {
        worker.log_contains("failpoint owned-mark-stall: failing once")
    })
    .await;
    lock.rollback().await.unwrap();
    wait_until(SETTLE, "1 and 2 applied", || async {
        applied(&pool).await.get("h").is_some_and(|v| v.len() == 2) && all_settled(&q).await
    })
    .await;
    assert_eq!(applied(&pool).await["h"], vec![1, 2]);
    assert_eq!(holder(&pool, "h").await, None, "no holder left");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_long_turn_is_listed_running_and_not_skipped_transactional(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    long_owned_turn(o, c, "transactional", false).await;
}

/// A skip issued in an owned turn's first second, before the turn is written down as
/// its entity's holder, is refused all the same: the skip reads the turn, and skips it
/// only if it is still the turn a second and a half later, when the running turn shows
/// as its holder. Transactional: the turn has no record until its batch commits.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_turn_in_its_first_second_is_not_skipped(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-first-second", true).await;
    let worker = spawn_accounts_worker(&url, &q.name, &worker_args("transactional", true, &[]));
    // 1 applied: the position is there, as an operator's listing would have shown it.
    q.publish(&entry("f", 1)).await;
    wait_until(SETTLE, "1 applied", || async {
        applied(&pool).await.get("f").is_some_and(|v| v.len() == 1) && all_settled(&q).await
    })
    .await;
    let lock = lock_entries(&pool).await;
    q.publish(&entry("f", 2)).await;
    wait_until(SETTLE, "2 held in its handler", || async {
        entry_held_for(&pool, Duration::ZERO).await
    })
    .await;
    // In process, not through the CLI: the skip reads the turn within milliseconds of
    // the check below, well inside the turn's first second.
    assert_eq!(
        holder(&pool, "f").await,
        None,
        "not written down yet: the skip comes first"
    );
    let skipped = idem::ordering::skip(&pool, "acme", "account-f", "x", None)
        .await
        .unwrap();
    assert_eq!(skipped, idem::ordering::Skipped::Running);
    assert_eq!(holder(&pool, "f").await.as_deref(), Some("f-v2"));
    assert_eq!(next_seq(&pool, "account-f").await, 2, "nothing skipped");
    lock.rollback().await.unwrap();
    wait_until(SETTLE, "2 applied", || async {
        applied(&pool).await.get("f").is_some_and(|v| v.len() == 2) && all_settled(&q).await
    })
    .await;
    assert_eq!(applied(&pool).await["f"], vec![1, 2]);
    drop(worker);
}

/// Account `g` gets 1, 2, 4, 5: 4 and 5 wait behind the gap; after the stall time the
/// entity is listed as stalled by a gap and the worker warns; skipped with a note, 4
/// and 5 run in order, and a 3 that comes after is dead-lettered as `sequence_passed`.
/// A copy of the completed 1 is acked at once while the gap holds (not parked); another
/// event numbered 4 is dead-lettered as `sequence_conflict`. Leased mode.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_gap_is_reported_and_skipped_and_a_completed_duplicate_is_acked_at_once_leased(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    gap_skipped(o, c, "leased", false).await;
}

/// The same in transactional mode.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_gap_is_reported_and_skipped_and_a_completed_duplicate_is_acked_at_once_transactional(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    gap_skipped(o, c, "transactional", false).await;
}

/// The same under owned order: the skip moves the position without the owner, which
/// learns it when the sweep publishes the waiting 4 (a copy of a parked delivery makes
/// it read the position again).
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_gap_is_reported_and_skipped_and_a_completed_duplicate_is_acked_leased(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    gap_skipped(o, c, "leased", true).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_gap_is_reported_and_skipped_and_a_completed_duplicate_is_acked_transactional(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    gap_skipped(o, c, "transactional", true).await;
}

/// One account's early entries arriving together (published before the worker starts,
/// so that they enter, as a rule, in one batch): its 3, a copy of the 3, another event
/// numbered 3, then 2 and 1. Whichever 3 entered first (the worker's tasks may reorder
/// deliveries that arrive together) waits and runs third, once; the other key is
/// dead-lettered `sequence_conflict`, each of its copies; nothing waits at the end.
async fn early_entries_together(o: PgPoolOptions, c: PgConnectOptions, mode: &str, owned: bool) {
    let (pool, url, q) = prepared(o, &c, &format!("ordering-together-{mode}"), owned).await;
    let mut other = serde_json::from_slice::<serde_json::Value>(&entry("t", 3)).unwrap();
    other["event_id"] = "t-other-3".into();
    q.publish(&entry("t", 3)).await;
    q.publish(&entry("t", 3)).await;
    q.publish(other.to_string().as_bytes()).await;
    q.publish(&entry("t", 2)).await;
    q.publish(&entry("t", 1)).await;
    let _worker = spawn_accounts_worker(&url, &q.name, &worker_args(mode, owned, &[]));
    wait_until(
        SETTLE,
        "1 to 3 applied, the other 3 dead-lettered",
        || async {
            applied_count(&pool).await == 3
                && all_settled(&q).await
                && waiting(&pool).await == 0
                && q.counts(&q.dlq()).await.0 >= 1
        },
    )
    .await;
    assert_eq!(applied(&pool).await["t"], vec![1, 2, 3]);
    let events: Vec<String> =
        sqlx::query_scalar("SELECT event_id FROM account_entries ORDER BY applied")
            .fetch_all(&pool)
            .await
            .unwrap();
    let (held, lost, copies) = match events[2].as_str() {
        "t-v3" => ("t-v3", "t-other-3", 1),
        "t-other-3" => ("t-other-3", "t-v3", 2),
        other => panic!("the third applied is {other}"),
    };
    assert_eq!(events[..2], ["t-v1", "t-v2"], "{held} held 3");
    let letters = q.drain(&q.dlq()).await;
    assert_eq!(
        letters.len(),
        copies,
        "{held} held 3: each copy of {lost} dead-lettered"
    );
    for letter in &letters {
        assert_eq!(letter.reason.as_deref(), Some("sequence_conflict"));
        let body: serde_json::Value = serde_json::from_str(&letter.body_text()).unwrap();
        assert_eq!(body["event_id"], lost, "{}", letter.body_text());
    }
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn early_entries_arriving_together_wait_once_and_one_holds_its_number_leased(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    early_entries_together(o, c, "leased", false).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn early_entries_arriving_together_wait_once_and_one_holds_its_number_transactional(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    early_entries_together(o, c, "transactional", false).await;
}

/// The same under owned order (one process: the copies and the other 3 meet the parked
/// row, or the turn running in memory).
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_early_entries_arriving_together_wait_once_and_one_holds_its_number(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    early_entries_together(o, c, "transactional", true).await;
}

/// `u`'s 1 held in its handler (the test locks `account_entries` against its insert)
/// while `other` (`w`'s 2 sent under `u`'s key) parks, then let go.
async fn park_while_the_key_runs(pool: &PgPool, q: &TestQueue, other: &serde_json::Value) {
    let lock = lock_entries(pool).await;
    q.publish(&entry("u", 1)).await;
    wait_until(SETTLE, "u's 1 held in its handler", || async {
        entry_held_for(pool, Duration::ZERO).await
    })
    .await;
    q.publish(other.to_string().as_bytes()).await;
    wait_until(SETTLE, "w's 2 (under u-v1) parked", || async {
        waiting(pool).await == 1 && q.counts(&q.name).await.0 == 0
    })
    .await;
    lock.rollback().await.unwrap();
}

/// `u`'s 1 and `w`'s 1 applied, once each, and one dead letter: `w`'s 2 (sent under
/// `u`'s key), `fingerprint_conflict`.
async fn ws_2_alone_dead_lettered(pool: &PgPool, q: &TestQueue) {
    let applied = applied(pool).await;
    assert_eq!((&applied["u"], &applied["w"]), (&vec![1], &vec![1]));
    let letters = q.drain(&q.dlq()).await;
    assert_eq!(letters.len(), 1, "w's 2 alone, once");
    assert_eq!(letters[0].reason.as_deref(), Some("fingerprint_conflict"));
    let body: serde_json::Value = serde_json::from_str(&letters[0].body_text()).unwrap();
    assert_eq!(
        (&body["account"], &body["version"]),
        (&"w".into(), &2.into()),
        "{}",
        letters[0].body_text()
    );
}

/// A message parked early under the key of another, with another payload (`w`'s 2 sent
/// as event `u-v1`), is not lost when the message that owns the key, `u`'s 1, runs
/// first, nor when a copy of that message arrives after it completed: the turn's move
/// and the copy's entry delete their own rows only. The parked one waits for `w`'s 1,
/// then meets the record of its key and is dead-lettered `fingerprint_conflict`; the
/// copy is acked as a duplicate. (The owned move, and the gate's entry of the copy,
/// deleted every waiting row of the key: the parked message was acked, then gone
/// without a trace.)
async fn parked_under_a_used_key(o: PgPoolOptions, c: PgConnectOptions, mode: &str, owned: bool) {
    let (pool, url, q) = prepared(o, &c, &format!("ordering-used-key-{mode}"), owned).await;
    let mut other = serde_json::from_slice::<serde_json::Value>(&entry("w", 2)).unwrap();
    other["event_id"] = "u-v1".into();
    let _worker = spawn_accounts_worker(&url, &q.name, &worker_args(mode, owned, &[]));
    let parked = || async { waiting(&pool).await == 1 && all_settled(&q).await };
    if owned {
        q.publish(other.to_string().as_bytes()).await;
        wait_until(SETTLE, "w's 2 (under u-v1) parked", parked).await;
        q.publish(&entry("u", 1)).await;
    } else {
        // The gate: the first to enter under a key holds it (a message of another
        // payload parked under it makes `u`'s 1 a conflict), so `u`'s 1 runs first.
        park_while_the_key_runs(&pool, &q, &other).await;
    }
    wait_until(SETTLE, "u's 1 applied", || async {
        applied_count(&pool).await == 1 && all_settled(&q).await
    })
    .await;
    assert_eq!(waiting(&pool).await, 1, "w's 2 still waits after u's 1");
    q.publish(&entry("u", 1)).await;
    wait_until(SETTLE, "the copy of u's 1 acked", || async {
        all_settled(&q).await
    })
    .await;
    assert_eq!(waiting(&pool).await, 1, "w's 2 still waits after the copy");
    q.publish(&entry("w", 1)).await;
    wait_until(SETTLE, "w's 1 applied, its 2 dead-lettered", || async {
        applied_count(&pool).await == 2
            && all_settled(&q).await
            && waiting(&pool).await == 0
            && q.counts(&q.dlq()).await.0 >= 1
    })
    .await;
    ws_2_alone_dead_lettered(&pool, &q).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_message_parked_under_a_used_key_is_dead_lettered_not_lost_leased(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    parked_under_a_used_key(o, c, "leased", false).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_message_parked_under_a_used_key_is_dead_lettered_not_lost_transactional(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    parked_under_a_used_key(o, c, "transactional", false).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_message_parked_under_a_used_key_is_dead_lettered_not_lost_leased(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    parked_under_a_used_key(o, c, "leased", true).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_message_parked_under_a_used_key_is_dead_lettered_not_lost_transactional(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    parked_under_a_used_key(o, c, "transactional", true).await;
}

/// A message parked under the key of a message that completed is not lost when the
/// process its turn is handed to dies before running it. `w`'s 2, sent as event `u-v1`,
/// parks while `u`'s 1 runs; when `w`'s 1 completes, its process releases the turn to
/// that row, with its key as the entity's holder, and aborts (failpoint
/// `before-turn-run`). The holder's record completed (it is `u`'s 1), so the next lock
/// of the position (the next process's sweep, or the redelivery of `w`'s 1) moves past
/// it; the row, of another payload than the record's, stays, and the sweep publishes it:
/// dead-lettered `fingerprint_conflict`. (The move deleted it: gone without a trace.)
async fn handed_under_a_used_key_across_a_crash(o: PgPoolOptions, c: PgConnectOptions, mode: &str) {
    let (pool, url, q) = prepared(o, &c, &format!("ordering-used-key-crash-{mode}"), false).await;
    let mut other = serde_json::from_slice::<serde_json::Value>(&entry("w", 2)).unwrap();
    other["event_id"] = "u-v1".into();
    let args = worker_args(mode, false, &[]);
    let crash = [("IDEM_FAILPOINT", "before-turn-run")];
    let mut crashing = spawn_accounts_worker_with_env(&url, &q.name, &args, &crash);
    park_while_the_key_runs(&pool, &q, &other).await;
    wait_until(SETTLE, "u's 1 applied", || async {
        applied_count(&pool).await == 1 && all_settled(&q).await
    })
    .await;
    q.publish(&entry("w", 1)).await;
    let status = tokio::time::timeout(SETTLE, crashing.child.wait())
        .await
        .expect("the worker reaches the failpoint")
        .unwrap();
    assert!(!status.success(), "aborted before the turn ran: {status:?}");
    assert_eq!(applied(&pool).await.get("w"), Some(&vec![1]));
    assert_eq!(waiting(&pool).await, 1, "w's 2 released, not run");
    let _next = spawn_accounts_worker(&url, &q.name, &args);
    wait_until(SETTLE, "w's 2 dead-lettered", || async {
        all_settled(&q).await && waiting(&pool).await == 0 && q.counts(&q.dlq()).await.0 >= 1
    })
    .await;
    ws_2_alone_dead_lettered(&pool, &q).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_message_handed_under_a_used_key_is_not_lost_when_its_process_dies_leased(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    handed_under_a_used_key_across_a_crash(o, c, "leased").await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_message_handed_under_a_used_key_is_not_lost_when_its_process_dies_transactional(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    handed_under_a_used_key_across_a_crash(o, c, "transactional").await;
}

/// A turn handed over in process whose row was parked under another fingerprint than
/// the one its run completed under (a deploy changed the handler's volatile fields in
/// between) runs once, and its row's one copy is a duplicate: `w`'s 2 parks, and its
/// row's fingerprint is then made another. `w`'s 1 completes and hands 2 its turn; 2
/// runs and completes under today's fingerprint, so the release's move past it keeps
/// the row (it deletes a row of the record's payload only: one of another message
/// under a used key must not go before it ran). The sweep publishes the row behind the
/// position and deletes it once its copy is confirmed, and the copy is acked as a
/// duplicate: nothing applied twice, nothing dead-lettered, nothing left. (Kept until
/// its copy came back, which does not match it, the row was published for ever.)
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_handed_turn_parked_under_an_older_fingerprint_runs_once(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let (pool, url, q) = prepared(o, &c, "ordering-older-fingerprint", false).await;
    let worker = spawn_accounts_worker(&url, &q.name, &worker_args("transactional", false, &[]));
    q.publish(&entry("w", 2)).await;
    wait_until(SETTLE, "w's 2 parked", || async {
        waiting(&pool).await == 1 && all_settled(&q).await
    })
    .await;
    let changed = sqlx::query("UPDATE ordering_waiting SET payload_sha256 = repeat('1', 64)")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(changed.rows_affected(), 1);
    q.publish(&entry("w", 1)).await;
    wait_until(
        SETTLE,
        "w's 2 applied, its row's copy a duplicate",
        || async {
            applied_count(&pool).await == 2
                && worker.log_contains("outcome=\"duplicate_completed\"")
                && all_settled(&q).await
                && waiting(&pool).await == 0
        },
    )
    .await;
    assert_eq!(
        worker.log_count("outcome=\"duplicate_completed\""),
        1,
        "published once"
    );
    assert_eq!(applied(&pool).await["w"], vec![1, 2], "each once");
    assert_eq!(next_seq(&pool, "account-w").await, 3);
    assert_eq!(q.counts(&q.dlq()).await.0, 0, "the copy is a duplicate");
}

/// Without a sequence, one account's entries run one at a time (each starts after the
/// one before committed) on two processes, each once.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn order_of_arrival_runs_one_entry_of_an_account_at_a_time(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    arrival_one_at_a_time(o, c, false).await;
}

/// The same on a queue of owned order (a single active consumer): deliveries without a
/// number go through the gate there too.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_of_arrival_runs_one_entry_of_an_account_at_a_time(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    arrival_one_at_a_time(o, c, true).await;
}

async fn arrival_one_at_a_time(o: PgPoolOptions, c: PgConnectOptions, owned: bool) {
    let (pool, url, q) = prepared(o, &c, "ordering-arrival", owned).await;
    // Written outside the handler's transaction: the record completes on its own and
    // the account moves on after that commit (the release of its own).
    let args = worker_args(
        "leased",
        owned,
        &["--order", "arrival", "--work-ms", "20", "--outside-tx"],
    );
    let _a = spawn_accounts_worker(&url, &q.name, &args);
    let _b = spawn_accounts_worker(&url, &q.name, &args);
    wait_for_consumers(&q, 2).await;
    for v in 1..=20 {
        q.publish(&entry("r", v)).await;
    }
    wait_until(SETTLE, "20 applied", || async {
        applied_count(&pool).await == 20 && all_settled(&q).await && waiting(&pool).await == 0
    })
    .await;
    let mut versions = applied(&pool).await["r"].clone();
    versions.sort_unstable();
    assert_eq!(versions, (1..=20).collect::<Vec<_>>(), "each once");
    // No two at once: every entry's 20 ms of work came after the one before it was
    // written (its write is the last thing before its commit).
    let gaps: Vec<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM at - lag(at) OVER (ORDER BY applied))::float8
           FROM account_entries ORDER BY applied OFFSET 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        gaps.iter().all(|&g| g >= 0.019),
        "two entries of one account overlapped: {gaps:?}"
    );
}

/// `order.created` and `order.cancelled` of one order, handled by two handlers of one
/// service (routed by a body field) that name the same ordering key: published cancel
/// first, the create still runs first, for every order.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn two_handlers_of_a_service_share_an_entitys_order(pool: PgPool) {
    sqlx::query(
        "CREATE TABLE order_steps (applied bigint GENERATED ALWAYS AS IDENTITY,
                                   order_id text NOT NULL, kind text NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let q = TestQueue::new("ordering-service").await;
    let store = idem::Store::new(pool.clone(), idem::StoreConfig::default());
    let config = idem::WorkerConfig {
        amqp_url: amqp_url(),
        queue: q.name.clone(),
        route_by: idem::RouteBy::Field("kind".into()),
        retry: idem::RetryPolicy {
            delays: RETRY_DELAYS_MS[..2]
                .iter()
                .map(|&ms| Duration::from_millis(ms))
                .collect(),
            ..idem::RetryPolicy::default()
        },
        ..idem::WorkerConfig::default()
    };
    let service_config = idem::ServiceConfig {
        amqp_url: amqp_url(),
        tally_every: None,
        ..idem::ServiceConfig::default()
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let service = idem::Service::new(store, service_config)
        .handler_for("order.created", Step::<true>, config.clone())
        .handler_for("order.cancelled", Step::<false>, config);
    let running = tokio::spawn(service.run(shutdown.clone()));
    wait_for_consumers(&q, 1).await;
    const ORDERS: usize = 10;
    for i in 0..ORDERS {
        for (kind, version) in [("order.cancelled", 2), ("order.created", 1)] {
            let body = json!({"event_id": format!("{kind}-{i}"), "order_id": format!("o{i}"),
                              "kind": kind, "version": version});
            q.publish(body.to_string().as_bytes()).await;
        }
    }
    wait_until(SETTLE, "every step applied", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM order_steps")
            .fetch_one(&pool)
            .await
            .unwrap()
            == 2 * ORDERS as i64
            && all_settled(&q).await
    })
    .await;
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT order_id, kind FROM order_steps ORDER BY applied")
            .fetch_all(&pool)
            .await
            .unwrap();
    let mut by_order: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (order, kind) in rows {
        by_order.entry(order).or_default().push(kind);
    }
    assert_eq!(by_order.len(), ORDERS);
    for (order, kinds) in &by_order {
        assert_eq!(
            kinds,
            &["order.created", "order.cancelled"],
            "order {order}"
        );
    }
    shutdown.cancel();
    running.await.unwrap().unwrap();
}

#[derive(serde::Deserialize)]
struct OrderStep {
    event_id: String,
    order_id: String,
    kind: String,
    version: i64,
}

/// `order.created` (`CREATED`) or `order.cancelled`: one row per step.
struct Step<const CREATED: bool>;

impl<const CREATED: bool> idem::Handler for Step<CREATED> {
    type Message = OrderStep;
    type Output = ();
    const OPERATION: &'static str = if CREATED {
        "order.created"
    } else {
        "order.cancelled"
    };

    fn scope(&self, _: &OrderStep) -> String {
        "acme".into()
    }

    fn idempotency_key(&self, m: &OrderStep) -> String {
        m.event_id.clone()
    }

    fn ordering(&self, m: &OrderStep) -> Option<idem::Ordered> {
        Some(idem::Ordered::by(format!("order-{}", m.order_id)).sequence(m.version))
    }

    async fn handle(
        &self,
        m: OrderStep,
        ctx: &mut idem::Context,
    ) -> Result<(), idem::HandlerError> {
        sqlx::query("INSERT INTO order_steps (order_id, kind) VALUES ($1, $2)")
            .bind(&m.order_id)
            .bind(&m.kind)
            .execute(ctx.tx().await?)
            .await?;
        Ok(())
    }
}

/// `idem keys retire --id k1` fails, naming the 2 waiting deliveries that keep k1.
async fn retire_refused_for_2_waiting(url: &str) {
    let refused = idem_command(url, &["keys", "retire", "--id", "k1"])
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("2 waiting deliver(ies)"),
        "{said}"
    );
}

const K1: &str = "k1:1111111111111111111111111111111111111111111111111111111111111111";
const K2: &str = "k2:2222222222222222222222222222222222222222222222222222222222222222";

/// Data protection covers the deliveries that wait for their turn: their bodies are
/// sealed, a key that seals one is not retired, `idem keys rotate` moves them to the new
/// key, `idem ops erase` counts them as skipped (they have not run); the old key, which
/// made their fingerprints, is retired only once they ran, in order; then a worker
/// without it runs the account on.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn waiting_deliveries_are_sealed_rotated_and_counted_by_an_erasure(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let url = database_url(&c);
    let q = TestQueue::new("ordering-keys").await;
    prepare(&pool, &url, &q).await;
    let key_use = |url: String| async move {
        let out = idem_cli(&url, &["keys", "status", "--json"]).await;
        let uses: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
        uses.into_iter()
            .map(|u| {
                (
                    u["key"].as_str().unwrap_or("-").to_owned(),
                    u["waiting"].clone(),
                )
            })
            .collect::<BTreeMap<_, _>>()
    };

    let under_k1 = spawn_accounts_worker_with_env(&url, &q.name, &[], &[("IDEM_KEYS", K1)]);
    wait_for_consumers(&q, 1).await;
    q.publish(&entry("p", 2)).await;
    q.publish(&entry("p", 3)).await;
    wait_until(SETTLE, "2 and 3 wait", || async {
        waiting(&pool).await == 2 && all_settled(&q).await
    })
    .await;
    let plain: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ordering_waiting WHERE position('\"tenant\"'::bytea IN body) > 0",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(plain, 0, "a waiting body is kept in plaintext");
    assert_eq!(key_use(url.clone()).await["k1"], 2);
    drop(under_k1);

    // k2 rolled out (new writes under it), k1 still given for what it sealed.
    let both = format!("{K2},{K1}");
    let _rolled = spawn_accounts_worker_with_env(&url, &q.name, &[], &[("IDEM_KEYS", &both)]);
    wait_until(SETTLE, "k2 registered", || async {
        sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM idem_keys WHERE id = 'k2')")
            .fetch_one(&pool)
            .await
            .unwrap_or(false)
    })
    .await;
    retire_refused_for_2_waiting(&url).await;
    let rotated = idem_command(&url, &["keys", "rotate"])
        .env("IDEM_KEYS", &both)
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&rotated.stdout);
    assert!(
        rotated.status.success() && said.contains("2 waiting deliver(ies)"),
        "{said} {}",
        String::from_utf8_lossy(&rotated.stderr)
    );
    let uses = key_use(url.clone()).await;
    assert_eq!(
        (uses["k1"].clone(), uses["k2"].clone()),
        (json!(0), json!(2))
    );

    let erased = idem_cli(
        &url,
        &[
            "ops", "erase", "--scope", "acme", "--note", "GDPR-1", "--by", "dpo", "--json",
        ],
    )
    .await;
    let erased: serde_json::Value = serde_json::from_str(&erased).unwrap();
    assert_eq!(
        (erased["records"].clone(), erased["skipped"].clone()),
        (json!(0), json!(2))
    );

    // Their fingerprints were made with k1: it stays until they ran.
    retire_refused_for_2_waiting(&url).await;
    q.publish(&entry("p", 1)).await;
    wait_until(SETTLE, "p applied", || async {
        applied_count(&pool).await == 3 && waiting(&pool).await == 0 && all_settled(&q).await
    })
    .await;
    assert_eq!(applied(&pool).await["p"], vec![1, 2, 3]);
    drop(_rolled);
    idem_cli(&url, &["keys", "retire", "--id", "k1"]).await;
    let _under_k2 = spawn_accounts_worker_with_env(&url, &q.name, &[], &[("IDEM_KEYS", K2)]);
    q.publish(&entry("p", 4)).await;
    wait_until(SETTLE, "p 4 applied", || async {
        applied_count(&pool).await == 4 && all_settled(&q).await
    })
    .await;
    assert_eq!(applied(&pool).await["p"], vec![1, 2, 3, 4]);
}

#[derive(serde::Deserialize)]
struct Relayed {
    event_id: String,
    account: String,
    version: i64,
    /// Answer an output Postgres refuses (a NUL in its text).
    #[serde(default)]
    nul: bool,
}

/// Notes each entry in `relayed`, in order per account, and stages one follow-up per
/// entry to `out`.
struct Relay {
    out: String,
}

impl idem::Handler for Relay {
    type Message = Relayed;
    type Output = serde_json::Value;
    const OPERATION: &'static str = "relay.entry";

    fn scope(&self, _: &Relayed) -> String {
        "acme".into()
    }

    fn idempotency_key(&self, m: &Relayed) -> String {
        m.event_id.clone()
    }

    fn ordering(&self, m: &Relayed) -> Option<idem::Ordered> {
        Some(idem::Ordered::by(format!("account-{}", m.account)).sequence(m.version))
    }

    async fn handle(
        &self,
        m: Relayed,
        ctx: &mut idem::Context,
    ) -> Result<serde_json::Value, idem::HandlerError> {
        sqlx::query("INSERT INTO relayed (account, version) VALUES ($1, $2)")
            .bind(&m.account)
            .bind(m.version)
            .execute(ctx.tx().await?)
            .await?;
        let body = json!({"relayed": m.event_id});
        let message = idem::FollowUp::json("", self.out.as_str(), &body)
            .map_err(idem::HandlerError::permanent)?;
        ctx.publish(message).await?;
        Ok(json!({"note": if m.nul { "a\u{0}b" } else { "ok" }}))
    }
}

/// A worker of [`Relay`] on `q` (declared with a single active consumer), in
/// transactional mode, without an outbox relay (only the worker that committed a
/// follow-up can publish it); its follow-ups go to `out`.
async fn relay_worker(
    pool: &PgPool,
    q: &TestQueue,
    out: &TestQueue,
) -> (
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<Result<(), idem::WorkerError>>,
) {
    sqlx::query(
        "CREATE TABLE relayed (applied bigint GENERATED ALWAYS AS IDENTITY,
                               account text NOT NULL, version bigint NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
    let topology = idem::Topology {
        queue: q.name.clone(),
        queue_type: idem::QueueType::Classic,
        retry_delays: RETRY_DELAYS_MS[..2]
            .iter()
            .map(|&ms| Duration::from_millis(ms))
            .collect(),
        subscriptions: Vec::new(),
        single_active_consumer: true,
    };
    topology.declare(&q.connection).await.unwrap();
    let channel = q.connection.create_channel().await.unwrap();
    let durable = lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(out.name.as_str().into(), durable, Default::default())
        .await
        .unwrap();
    let relay = Relay {
        out: out.name.clone(),
    };
    start_in_process(pool, q, relay, |config| {
        config.mode = idem::Mode::Transactional;
        config.single_active_consumer = true;
        config.outbox.relay = false;
    })
    .await
}

/// The entry `v` of account `r` for [`Relay`].
fn relayed(v: i64, nul: bool) -> Vec<u8> {
    json!({"event_id": format!("r-v{v}"), "account": "r", "version": v, "nul": nul})
        .to_string()
        .into_bytes()
}

/// A chain's turns stage their follow-ups in the transaction of the turn that led them
/// (all four records in one commit): the worker that committed them publishes each once
/// (no relay runs).
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_chains_follow_ups_are_published_by_its_worker_once_each(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c).await.unwrap();
    let q = TestQueue::new("ordering-relay").await;
    let out = q.beside("out").await;
    let (shutdown, task) = relay_worker(&pool, &q, &out).await;
    for v in [4, 2, 3] {
        q.publish(&relayed(v, false)).await;
    }
    wait_until(SETTLE, "2 to 4 parked", || async {
        waiting(&pool).await == 3 && all_settled(&q).await
    })
    .await;
    q.publish(&relayed(1, false)).await;
    wait_until(SETTLE, "four follow-ups", || async {
        q.counts(&out.name).await.0 == 4 && waiting(&pool).await == 0
    })
    .await;
    let versions: Vec<i64> = sqlx::query_scalar("SELECT version FROM relayed ORDER BY applied")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(versions, vec![1, 2, 3, 4]);
    let commits: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT created_at) FROM processed_operations WHERE scope = 'acme'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(commits, 1, "1 to 4 committed together");
    let mut relayed: Vec<String> = q
        .drain(&out.name)
        .await
        .iter()
        .map(|m| m.body_text())
        .collect();
    relayed.sort();
    let expected: Vec<String> = (1..=4)
        .map(|v| json!({"relayed": format!("r-v{v}")}).to_string())
        .collect();
    assert_eq!(relayed, expected);
    wait_until(SETTLE, "the four follow-ups dispatched", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox_messages WHERE dispatched_at IS NOT NULL",
        )
        .fetch_one(&pool)
        .await
        .unwrap_or(0)
            == 4
    })
    .await;
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// A chained turn whose outcome Postgres refuses (a NUL in its output) is refused on its
/// own: the batch runs again without chains, the turns before it complete, and it is
/// dead-lettered, not the turn that led the chain.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn owned_order_a_chained_turn_postgres_refuses_is_refused_alone(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c).await.unwrap();
    let q = TestQueue::new("ordering-refused").await;
    let out = q.beside("out").await;
    let (shutdown, task) = relay_worker(&pool, &q, &out).await;
    q.publish(&relayed(3, true)).await;
    q.publish(&relayed(2, false)).await;
    wait_until(SETTLE, "2 and 3 parked", || async {
        waiting(&pool).await == 2 && all_settled(&q).await
    })
    .await;
    q.publish(&relayed(1, false)).await;
    wait_until(SETTLE, "3 dead-lettered", || async {
        q.counts(&q.dlq()).await.0 == 1 && all_settled(&q).await && waiting(&pool).await == 0
    })
    .await;
    let versions: Vec<i64> = sqlx::query_scalar("SELECT version FROM relayed ORDER BY applied")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(versions, vec![1, 2]);
    let dead = q.drain(&q.dlq()).await;
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].body_text().contains("r-v3"),
        "{}",
        dead[0].body_text()
    );
    assert_eq!(dead[0].reason.as_deref(), Some("permanent_failure"));
    shutdown.cancel();
    task.await.unwrap().unwrap();
}
