//! Single-commit HTTP routes (`IdempotencyLayer::single_commit`) against the real
//! database with a real HTTP client: the record is written in the request's own
//! transaction with its answer. The `payments_api` example as processes (30 concurrent
//! requests with one key, a server SIGKILLed mid-request while a repeat waits on another
//! server, failpoints on the commit path), and routes served in the test for the
//! answers the example does not give (a first request that rolls back while a repeat
//! waits, the stored 4xx rules, records the default mode left).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use common::{
    WorkerProcess, bearer_principal, database_url, signal, spawn_payments_api_with_env, wait_until,
};
use idem::http::{Decided, IDEMPOTENCY_REPLAYED, Idempotency, IdempotentRequest, Tx};
use idem::{HandlerError, Store, StoreConfig};
use reqwest::header::HeaderMap;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const LIMIT: Duration = Duration::from_secs(60);

/// One answer: status, headers, body bytes.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get(IDEMPOTENCY_REPLAYED)
            .is_some_and(|v| v == "true")
    }

    fn problem_type(&self) -> String {
        let body: Value = serde_json::from_slice(&self.body).unwrap_or(Value::Null);
        body["type"].as_str().unwrap_or_default().to_owned()
    }
}

/// POSTs `body` to `url` as alice with `key` (none: no header).
async fn send(url: &str, key: Option<&str>, body: &[u8]) -> Result<Answer, reqwest::Error> {
    let mut request = reqwest::Client::new()
        .post(url)
        .bearer_auth("alice")
        .header("content-type", "application/json")
        .body(body.to_vec());
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.bytes().await?.to_vec();
    Ok(Answer {
        status,
        headers,
        body,
    })
}

fn payment(amount_cents: i64) -> Vec<u8> {
    json!({"customer": "c-1", "amount_cents": amount_cents, "currency": "EUR"})
        .to_string()
        .into_bytes()
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap_or(-1)
}

async fn payments(pool: &PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM example_payments").await
}

async fn records(pool: &PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM processed_operations").await
}

/// Sessions of this database waiting for another transaction: a repeat at the key's
/// lock, or a claim at the key's unique index or a locked row.
async fn waiting(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND wait_event IN ('advisory', 'transactionid')",
    )
    .await
}

/// Sessions of this database inside a transaction that holds a key (its lock, or a
/// record written and not committed) while its route runs.
async fn writing(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM pg_stat_activity a
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'
           AND (backend_xid IS NOT NULL
                OR EXISTS (SELECT 1 FROM pg_locks l
                           WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted))",
    )
    .await
}

/// Advisory locks held by sessions of this database (a key's lock is given back at
/// its request's end).
async fn held_locks(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
         WHERE d.datname = current_database() AND l.locktype = 'advisory' AND l.granted",
    )
    .await
}

/// Waits until no key's lock is held. A request's transaction ends (and its key's lock
/// with it) as its connection goes back to the pool, which may be just after its answer
/// was sent.
async fn locks_given_back(pool: &PgPool) {
    wait_until(LIMIT, "every key's lock given back", || async {
        held_locks(pool).await == 0
    })
    .await;
}

/// The single record of `operation`: (status, attempts).
async fn record_of(pool: &PgPool, operation: &str) -> Option<(String, i32)> {
    sqlx::query_as("SELECT status, attempts FROM processed_operations WHERE operation = $1")
        .bind(operation)
        .fetch_optional(pool)
        .await
        .unwrap()
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A `payments_api --single-commit-route` process, ready; its URL of
/// `POST /single/payments`.
async fn start_api(
    url: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (WorkerProcess, String, u16) {
    let port = free_port();
    let mut args = vec!["--single-commit-route"];
    args.extend_from_slice(extra);
    let api = spawn_payments_api_with_env(url, port, &args, env);
    let health = format!("http://127.0.0.1:{port}/healthz");
    let client = reqwest::Client::new();
    wait_until(LIMIT, "payments_api listening", || async {
        client.get(&health).send().await.is_ok()
    })
    .await;
    (
        api,
        format!("http://127.0.0.1:{port}/single/payments"),
        port,
    )
}

const SINGLE: &str = "POST /single/payments";

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn thirty_concurrent_requests_with_one_key_wait_for_the_first_and_get_its_answer(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let extra = ["--provider-delay-ms", "500", "--connections", "40"];
    let (_api, url, _) = start_api(&database_url(&c), &extra, &[]).await;
    let body = payment(1250);
    let start = Arc::new(tokio::sync::Barrier::new(30));
    let mut racers = tokio::task::JoinSet::new();
    for _ in 0..30 {
        let (url, body, start) = (url.clone(), body.clone(), start.clone());
        racers.spawn(async move {
            start.wait().await;
            send(&url, Some("order-17"), &body).await.unwrap()
        });
    }
    // The repeats really wait for the first one, at the key's lock.
    wait_until(LIMIT, "repeats waiting at the key's lock", || async {
        waiting(&pool).await >= 1
    })
    .await;
    let answers = racers.join_all().await;
    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    assert!(
        statuses.iter().all(|s| *s == 201),
        "every answer is the first one's: {statuses:?}"
    );
    let executed: Vec<&Answer> = answers.iter().filter(|a| !a.replayed()).collect();
    assert_eq!(executed.len(), 1, "one request ran");
    for answer in &answers {
        assert_eq!(answer.body, executed[0].body, "30 identical answers");
        assert_eq!(
            answer.headers.get("content-type"),
            executed[0].headers.get("content-type")
        );
    }
    assert_eq!(payments(&pool).await, 1, "exactly one payment");
    assert_eq!(
        record_of(&pool, SINGLE).await,
        Some(("completed".into(), 1))
    );
    let one_commit: bool = sqlx::query_scalar(
        "SELECT (SELECT xmin::text FROM example_payments)
              = (SELECT xmin::text FROM processed_operations)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        one_commit,
        "the payment and its record were written by one transaction"
    );
    locks_given_back(&pool).await;
    let retry = send(&url, Some("order-17"), &body).await.unwrap();
    assert_eq!((retry.status, retry.replayed()), (201, true));
    assert_eq!(retry.body, executed[0].body, "byte-identical");
    // Another body with the key: 422, nothing run.
    let reused = send(&url, Some("order-17"), &payment(99)).await.unwrap();
    assert_eq!(reused.status, 422);
    assert_eq!(
        reused.problem_type(),
        "urn:idem:problem:idempotency-key-reused"
    );
    assert_eq!(payments(&pool).await, 1);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_server_killed_mid_request_leaves_nothing_and_the_waiting_repeat_runs(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let db = database_url(&c);
    // Two servers on one database: the first one's request is slow, and is killed.
    let (mut slow, slow_url, _) = start_api(&db, &["--provider-delay-ms", "20000"], &[]).await;
    let (_fast, fast_url, _) = start_api(&db, &[], &[]).await;
    let body = payment(500);
    let in_flight = {
        let (url, body) = (slow_url.clone(), body.clone());
        tokio::spawn(async move { send(&url, Some("k"), &body).await })
    };
    wait_until(LIMIT, "the first request holds its record", || async {
        writing(&pool).await == 1
    })
    .await;
    assert_eq!(records(&pool).await, 0, "nobody sees an uncommitted record");
    let repeat = {
        let (url, body) = (fast_url.clone(), body.clone());
        tokio::spawn(async move { send(&url, Some("k"), &body).await })
    };
    wait_until(LIMIT, "the repeat waits for the first", || async {
        waiting(&pool).await == 1
    })
    .await;
    assert!(!repeat.is_finished(), "the repeat waits");
    signal(&slow, "KILL");
    let _ = slow.child.wait().await;
    assert!(
        in_flight.await.unwrap().is_err(),
        "the client lost its answer"
    );
    let ran = tokio::time::timeout(LIMIT, repeat)
        .await
        .expect("the repeat is answered once the first rolled back")
        .unwrap()
        .unwrap();
    assert_eq!((ran.status, ran.replayed()), (201, false), "the repeat ran");
    assert_eq!(payments(&pool).await, 1, "exactly one payment");
    // The killed request left nothing: the repeat's claim was the first.
    assert_eq!(
        record_of(&pool, SINGLE).await,
        Some(("completed".into(), 1))
    );
    let again = send(&fast_url, Some("k"), &body).await.unwrap();
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, ran.body);
    // A kill with no repeat waiting: the retry runs at once, no lease to wait out.
    let (slow, slow_url, _) = start_api(&db, &["--provider-delay-ms", "20000"], &[]).await;
    let lost = {
        let url = slow_url.clone();
        tokio::spawn(async move { send(&url, Some("k2"), &payment(7)).await })
    };
    wait_until(LIMIT, "the request holds its record", || async {
        writing(&pool).await == 1
    })
    .await;
    signal(&slow, "KILL");
    assert!(lost.await.unwrap().is_err());
    let retry = send(&fast_url, Some("k2"), &payment(7)).await.unwrap();
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(payments(&pool).await, 2);
}

// ---- Routes served by the test itself ----

#[derive(Clone)]
struct TestState {
    calls: Arc<AtomicU32>,
    gate: Arc<tokio::sync::Semaphore>,
}

async fn note(tx: &mut Tx, what: &str) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO test_effects (what) VALUES ($1)")
        .bind(what)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The first call writes, waits for the gate and fails transiently; later calls write
/// and answer 201.
async fn first_fails(
    State(s): State<TestState>,
    request: IdempotentRequest,
    mut tx: Tx,
) -> Result<(StatusCode, String), HandlerError> {
    note(&mut tx, "first_fails").await?;
    if s.calls.fetch_add(1, Ordering::SeqCst) == 0 {
        let _permit = s.gate.acquire().await;
        return Err(HandlerError::transient("the first one fails"));
    }
    Ok((StatusCode::CREATED, format!("attempt {}", request.attempt)))
}

/// Waits for the gate, then answers 201 with the attempt (a default-mode route's run
/// that holds its lease meanwhile).
async fn gated(
    State(s): State<TestState>,
    request: IdempotentRequest,
    mut tx: Tx,
) -> Result<(StatusCode, String), HandlerError> {
    note(&mut tx, "gated").await?;
    let _permit = s.gate.acquire().await;
    Ok((StatusCode::CREATED, format!("attempt {}", request.attempt)))
}

/// Fails transiently on its first attempt, after a write.
async fn flaky(request: IdempotentRequest, mut tx: Tx) -> Result<String, HandlerError> {
    note(&mut tx, "flaky").await?;
    if request.attempt == 1 {
        return Err(HandlerError::transient("busy"));
    }
    Ok(format!("attempt {}", request.attempt))
}

async fn declined(mut tx: Tx) -> Result<impl IntoResponse, HandlerError> {
    note(&mut tx, "declined").await?;
    Ok((StatusCode::PAYMENT_REQUIRED, Decided, "card declined"))
}

async fn refused(mut tx: Tx) -> Result<StatusCode, HandlerError> {
    note(&mut tx, "refused").await?;
    Ok(StatusCode::NOT_FOUND)
}

async fn permanent(mut tx: Tx) -> Result<StatusCode, HandlerError> {
    note(&mut tx, "permanent").await?;
    Err(HandlerError::permanent("amount must be positive"))
}

async fn uncertain(mut tx: Tx) -> Result<StatusCode, HandlerError> {
    note(&mut tx, "uncertain").await?;
    Err(HandlerError::uncertain(Some("ch-1".into()), "timed out"))
}

/// Waits for the gate after its write, then answers uncertain (a provider's timeout).
async fn uncertain_gated(
    State(s): State<TestState>,
    mut tx: Tx,
) -> Result<StatusCode, HandlerError> {
    note(&mut tx, "uncertain_gated").await?;
    let _permit = s.gate.acquire().await;
    Err(HandlerError::uncertain(Some("ch-2".into()), "timed out"))
}

/// Writes its key, and answers 201 with the isolation level it ran at, its key, and text
/// a stored answer must keep as it is.
async fn echo(
    request: IdempotentRequest,
    mut tx: Tx,
) -> Result<(StatusCode, String), HandlerError> {
    let key = request.key.idempotency_key();
    note(&mut tx, &format!("echo {key}")).await?;
    let isolation: String = sqlx::query_scalar("SELECT current_setting('transaction_isolation')")
        .fetch_one(&mut *tx)
        .await?;
    let body = format!("{isolation} {key} \"quoted\" \\ ✓");
    Ok((StatusCode::CREATED, body))
}

async fn huge(mut tx: Tx) -> Result<String, HandlerError> {
    note(&mut tx, "huge").await?;
    Ok("x".repeat(4096))
}

async fn panics(request: IdempotentRequest, mut tx: Tx) -> Result<StatusCode, HandlerError> {
    note(&mut tx, "panics").await?;
    if request.attempt == 1 {
        panic!("the handler's bug");
    }
    Ok(StatusCode::CREATED)
}

/// Serves the test routes: single-commit ones, and `/mixed` and `/mixed-flaky` in the
/// default mode (`single` false) or in single-commit mode, so that two servers on one
/// database share their records.
async fn serve(pool: &PgPool, state: TestState, single: bool) -> String {
    sqlx::query("CREATE TABLE IF NOT EXISTS test_effects (what text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    let store = Store::new(
        pool.clone(),
        StoreConfig {
            lease: Duration::from_secs(30),
            ..StoreConfig::default()
        },
    );
    // One route keeps its records an hour, the others the store's week.
    store.retains("POST /declined", Some(Duration::from_secs(3600)));
    let keys = Idempotency::new(store, bearer_principal)
        .max_body_bytes(256)
        .max_response_bytes(1024);
    let one = || keys.required().single_commit();
    let mixed = || match single {
        true => keys.required().single_commit(),
        false => keys.required(),
    };
    let app = Router::new()
        .route("/first-fails", post(first_fails).route_layer(one()))
        .route("/declined", post(declined).route_layer(one()))
        .route("/refused", post(refused).route_layer(one()))
        .route("/permanent", post(permanent).route_layer(one()))
        .route("/uncertain", post(uncertain).route_layer(one()))
        .route("/uncertain-gated", post(uncertain_gated).route_layer(one()))
        .route("/mixed-first-fails", post(first_fails).route_layer(mixed()))
        .route("/huge", post(huge).route_layer(one()))
        .route("/echo", post(echo).route_layer(one()))
        .route("/panics", post(panics).route_layer(one()))
        .route("/mixed", post(gated).route_layer(mixed()))
        .route("/mixed-flaky", post(flaky).route_layer(mixed()))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

fn test_state() -> TestState {
    TestState {
        calls: Arc::new(AtomicU32::new(0)),
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
    }
}

/// How long `operation`'s completed record is kept (`expires_at - completed_at`).
async fn kept_for(pool: &PgPool, operation: &str) -> String {
    sqlx::query_scalar(
        "SELECT (expires_at - completed_at)::text FROM processed_operations
         WHERE operation = $1 AND status = 'completed'",
    )
    .bind(operation)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn effects(pool: &PgPool, what: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM test_effects WHERE what = $1")
        .bind(what)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_first_request_that_rolls_back_lets_the_waiting_repeat_run(pool: PgPool) {
    let state = test_state();
    let base = serve(&pool, state.clone(), true).await;
    let url = format!("{base}/first-fails");
    let first = {
        let url = url.clone();
        tokio::spawn(async move { send(&url, Some("k"), b"{}").await.unwrap() })
    };
    wait_until(LIMIT, "the first request runs", || async {
        state.calls.load(Ordering::SeqCst) == 1 && writing(&pool).await == 1
    })
    .await;
    let repeat = {
        let url = url.clone();
        tokio::spawn(async move { send(&url, Some("k"), b"{}").await.unwrap() })
    };
    wait_until(LIMIT, "the repeat waits for the first", || async {
        waiting(&pool).await == 1
    })
    .await;
    assert_eq!(state.calls.load(Ordering::SeqCst), 1, "the repeat waits");
    state.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "the first one failed");
    let repeat = tokio::time::timeout(LIMIT, repeat).await.unwrap().unwrap();
    assert_eq!((repeat.status, repeat.replayed()), (201, false));
    assert_eq!(repeat.body, b"attempt 1", "the first one left no record");
    assert_eq!(
        effects(&pool, "first_fails").await,
        1,
        "its write rolled back"
    );
    assert_eq!(
        record_of(&pool, "POST /first-fails").await,
        Some(("completed".into(), 1))
    );
    let again = send(&url, Some("k"), b"{}").await.unwrap();
    assert_eq!((again.status, again.replayed()), (201, true));
}

/// The route's transaction is READ COMMITTED whatever the database's default (a claim
/// that waited must see the other transaction's commit on its next statement): on a
/// database whose sessions default to REPEATABLE READ, keys of any text run once each,
/// at READ COMMITTED, and their repeats are replays with the same answer.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_database_that_defaults_to_another_isolation_runs_the_route_read_committed(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let repeatable = PgPoolOptions::new()
        .connect_with(c.options([("default_transaction_isolation", "repeatable read")]))
        .await
        .unwrap();
    let base = serve(&repeatable, test_state(), true).await;
    let url = format!("{base}/echo");
    let keys = ["o'k", "back\\slash", "$$; DROP TABLE test_effects; --"];
    for key in keys {
        let first = send(&url, Some(key), b"{}").await.unwrap();
        assert_eq!((first.status, first.replayed()), (201, false), "{key}");
        let body = String::from_utf8(first.body).unwrap();
        assert_eq!(body, format!("read committed {key} \"quoted\" \\ ✓"));
        let again = send(&url, Some(key), b"{}").await.unwrap();
        assert_eq!((again.status, again.replayed()), (201, true), "{key}");
        assert_eq!(String::from_utf8(again.body).unwrap(), body);
        assert_eq!(effects(&pool, &format!("echo {key}")).await, 1, "{key}");
    }
    let stored: Vec<String> = sqlx::query_scalar(
        "SELECT idempotency_key FROM processed_operations
          WHERE operation = 'POST /echo' AND status = 'completed' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(stored, keys);
    locks_given_back(&pool).await;
    // The pools are the test's own (made from options), and the server still holds the
    // second: closed here, or their connections can outlive the test and keep sqlx from
    // dropping its database (one was left after each CI run).
    repeatable.close().await;
    pool.close().await;
}

/// A repeat waits at the key's lock no longer than its route's `run_within` (the
/// transaction's `lock_timeout`), then answers 409 `request-in-progress` with
/// `Retry-After`, having run nothing; once the first one committed, it is a replay.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_repeat_waits_for_the_key_no_longer_than_its_run_within(pool: PgPool) {
    sqlx::query("CREATE TABLE IF NOT EXISTS test_effects (what text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let state = test_state();
    // Two servers of one route: the first runs within a minute, the second 300 ms.
    let mut bases = Vec::new();
    for bound in [LIMIT, Duration::from_millis(300)] {
        let store = Store::new(pool.clone(), StoreConfig::default());
        let keys = Idempotency::new(store, bearer_principal);
        let layer = keys.required().single_commit().run_within(bound);
        let app = Router::new()
            .route("/held", post(gated).route_layer(layer))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        bases.push(format!("http://{addr}/held"));
    }
    let first = {
        let url = bases[0].clone();
        tokio::spawn(async move { send(&url, Some("k"), b"{}").await.unwrap() })
    };
    wait_until(LIMIT, "the first request runs", || async {
        writing(&pool).await == 1
    })
    .await;
    let started = std::time::Instant::now();
    let repeat = send(&bases[1], Some("k"), b"{}").await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(repeat.status, 409);
    assert_eq!(
        repeat.problem_type(),
        "urn:idem:problem:request-in-progress"
    );
    assert!(repeat.headers.contains_key("retry-after"), "{repeat:?}");
    assert_eq!(effects(&pool, "gated").await, 0, "nothing committed yet");
    state.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!((first.status, first.replayed()), (201, false));
    let again = send(&bases[1], Some("k"), b"{}").await.unwrap();
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, first.body);
    assert_eq!(effects(&pool, "gated").await, 1);
    locks_given_back(&pool).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn bad_input_and_the_stored_4xx_rules_stay_as_documented(pool: PgPool) {
    let base = serve(&pool, test_state(), true).await;
    let at = |path: &str| format!("{base}{path}");
    // 400: no key, an invalid key; 413: a body over the limit. Nothing stored.
    let missing = send(&at("/declined"), None, b"{}").await.unwrap();
    assert_eq!(missing.status, 400);
    assert_eq!(
        missing.problem_type(),
        "urn:idem:problem:idempotency-key-missing"
    );
    let invalid = send(&at("/declined"), Some(""), b"{}").await.unwrap();
    assert_eq!(invalid.status, 400);
    let big = json!({"pad": "x".repeat(400)}).to_string();
    let large = send(&at("/declined"), Some("big"), big.as_bytes())
        .await
        .unwrap();
    assert_eq!(large.status, 413);
    assert_eq!(records(&pool).await, 0);
    // A decided refusal: stored with its write, replayed.
    let declined = send(&at("/declined"), Some("d"), b"{}").await.unwrap();
    assert_eq!((declined.status, declined.replayed()), (402, false));
    let again = send(&at("/declined"), Some("d"), b"{}").await.unwrap();
    assert_eq!((again.status, again.replayed()), (402, true));
    assert_eq!(again.body, declined.body);
    assert_eq!(effects(&pool, "declined").await, 1);
    assert_eq!(
        kept_for(&pool, "POST /declined").await,
        "01:00:00",
        "its own retention"
    );
    let reused = send(&at("/declined"), Some("d"), br#"{"a":1}"#)
        .await
        .unwrap();
    assert_eq!(reused.status, 422);
    assert_eq!(
        reused.problem_type(),
        "urn:idem:problem:idempotency-key-reused"
    );
    // A permanent error: stored without its write (rolled back to the savepoint).
    let permanent = send(&at("/permanent"), Some("p"), b"{}").await.unwrap();
    assert_eq!((permanent.status, permanent.replayed()), (422, false));
    let again = send(&at("/permanent"), Some("p"), b"{}").await.unwrap();
    assert_eq!((again.status, again.replayed()), (422, true));
    assert_eq!(again.body, permanent.body);
    assert_eq!(
        effects(&pool, "permanent").await,
        0,
        "its write rolled back"
    );
    let stored = record_of(&pool, "POST /permanent").await;
    assert_eq!(stored, Some(("completed".into(), 1)));
    assert_eq!(
        kept_for(&pool, "POST /permanent").await,
        "7 days",
        "the store's"
    );
    // A refusal not marked, a panic, an answer too large to store: nothing recorded,
    // the writes rolled back, the key free (the retry runs again).
    for (path, status) in [("/refused", 404), ("/panics", 500), ("/huge", 500)] {
        let answer = send(&at(path), Some("f"), b"{}").await.unwrap();
        assert_eq!(answer.status, status, "{path}");
        let operation = format!("POST {path}");
        assert_eq!(record_of(&pool, &operation).await, None, "{path}");
        assert_eq!(effects(&pool, &path[1..]).await, 0, "{path}");
    }
    let retry = send(&at("/panics"), Some("f"), b"{}").await.unwrap();
    assert_eq!(
        retry.status, 500,
        "attempt 1 again: nothing counted the panic"
    );
    // Uncertain: pending with its reference, its write rolled back; a repeat is 409.
    let uncertain = send(&at("/uncertain"), Some("u"), b"{}").await.unwrap();
    assert_eq!(uncertain.status, 502);
    let (status, external_ref): (String, Option<String>) = sqlx::query_as(
        "SELECT status, external_ref FROM processed_operations WHERE operation = 'POST /uncertain'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (status.as_str(), external_ref.as_deref()),
        ("pending", Some("ch-1"))
    );
    assert_eq!(effects(&pool, "uncertain").await, 0);
    let repeat = send(&at("/uncertain"), Some("u"), b"{}").await.unwrap();
    assert_eq!(repeat.status, 409);
    assert_eq!(repeat.problem_type(), "urn:idem:problem:outcome-uncertain");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn records_the_default_mode_left_are_decided_as_documented(pool: PgPool) {
    let state = test_state();
    let default_mode = serve(&pool, state.clone(), false).await;
    let single = serve(&pool, state.clone(), true).await;
    // A default-mode run holding a live lease: 409 in progress, then its answer.
    let running = {
        let url = format!("{default_mode}/mixed");
        tokio::spawn(async move { send(&url, Some("m"), b"{}").await.unwrap() })
    };
    wait_until(LIMIT, "the default-mode claim", || async {
        record_of(&pool, "POST /mixed").await == Some(("processing".into(), 1))
    })
    .await;
    let busy = send(&format!("{single}/mixed"), Some("m"), b"{}")
        .await
        .unwrap();
    assert_eq!(busy.status, 409);
    assert_eq!(busy.problem_type(), "urn:idem:problem:request-in-progress");
    state.gate.add_permits(10);
    let first = running.await.unwrap();
    assert_eq!(
        (first.status, first.body.as_slice()),
        (201, &b"attempt 1"[..])
    );
    let replay = send(&format!("{single}/mixed"), Some("m"), b"{}")
        .await
        .unwrap();
    assert_eq!((replay.status, replay.replayed()), (201, true));
    assert_eq!(replay.body, first.body);
    // A retryable failure the default mode recorded: taken over in one commit.
    let failed = send(&format!("{default_mode}/mixed-flaky"), Some("f"), b"{}")
        .await
        .unwrap();
    assert_eq!(failed.status, 503);
    assert_eq!(
        record_of(&pool, "POST /mixed-flaky").await,
        Some(("failed".into(), 1))
    );
    let taken = send(&format!("{single}/mixed-flaky"), Some("f"), b"{}")
        .await
        .unwrap();
    assert_eq!(
        (taken.status, taken.body.as_slice()),
        (200, &b"attempt 2"[..])
    );
    assert_eq!(
        record_of(&pool, "POST /mixed-flaky").await,
        Some(("completed".into(), 2))
    );
    assert_eq!(
        effects(&pool, "flaky").await,
        1,
        "the failed run's write rolled back"
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_new_key_another_mode_recorded_meanwhile_is_answered_from_its_record(pool: PgPool) {
    // Two servers on one database, each with its own gate: the single-commit request
    // holds the key's lock (no record yet) while a default-mode one claims the key,
    // completes it, and commits first.
    let (single_state, default_state) = (test_state(), test_state());
    let single = serve(&pool, single_state.clone(), true).await;
    let default_mode = serve(&pool, default_state.clone(), false).await;
    let held = {
        let url = format!("{single}/mixed");
        tokio::spawn(async move { send(&url, Some("n"), b"{}").await.unwrap() })
    };
    wait_until(LIMIT, "the single-commit request holds the key", || async {
        writing(&pool).await == 1
    })
    .await;
    assert_eq!(records(&pool).await, 0, "the lock writes no record");
    let claimed = {
        let url = format!("{default_mode}/mixed");
        tokio::spawn(async move { send(&url, Some("n"), b"{}").await.unwrap() })
    };
    wait_until(LIMIT, "the default-mode claim", || async {
        record_of(&pool, "POST /mixed").await == Some(("processing".into(), 1))
    })
    .await;
    default_state.gate.add_permits(1);
    let first = tokio::time::timeout(LIMIT, claimed).await.unwrap().unwrap();
    assert_eq!((first.status, first.replayed()), (201, false));
    single_state.gate.add_permits(1);
    // Its record insert finds the key taken: rolled back, answered from the record.
    let late = tokio::time::timeout(LIMIT, held).await.unwrap().unwrap();
    assert_eq!((late.status, late.replayed()), (201, true));
    assert_eq!(late.body, first.body);
    assert_eq!(effects(&pool, "gated").await, 1, "its write rolled back");
    assert_eq!(
        record_of(&pool, "POST /mixed").await,
        Some(("completed".into(), 1))
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_repeat_waiting_for_an_uncertain_first_request_finds_it_pending(pool: PgPool) {
    let state = test_state();
    let base = serve(&pool, state.clone(), true).await;
    let url = format!("{base}/uncertain-gated");
    let first = {
        let url = url.clone();
        tokio::spawn(async move { send(&url, Some("u2"), b"{}").await.unwrap() })
    };
    wait_until(LIMIT, "the first request holds the key", || async {
        writing(&pool).await == 1
    })
    .await;
    let repeat = {
        let url = url.clone();
        tokio::spawn(async move { send(&url, Some("u2"), b"{}").await.unwrap() })
    };
    wait_until(LIMIT, "the repeat waits for the first", || async {
        waiting(&pool).await == 1
    })
    .await;
    // The first one's writes roll back and its pending record is written while it
    // still holds the key: the repeat must find that record, not run.
    state.gate.add_permits(1);
    let first = tokio::time::timeout(LIMIT, first).await.unwrap().unwrap();
    assert_eq!(first.status, 502);
    let repeat = tokio::time::timeout(LIMIT, repeat).await.unwrap().unwrap();
    assert_eq!(repeat.status, 409);
    assert_eq!(repeat.problem_type(), "urn:idem:problem:outcome-uncertain");
    assert_eq!(
        effects(&pool, "uncertain_gated").await,
        0,
        "rolled back, run once"
    );
    let (status, external_ref): (String, Option<String>) = sqlx::query_as(
        "SELECT status, external_ref FROM processed_operations
         WHERE operation = 'POST /uncertain-gated'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (status.as_str(), external_ref.as_deref()),
        ("pending", Some("ch-2"))
    );
    locks_given_back(&pool).await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_route_that_fails_on_a_key_recorded_meanwhile_answers_with_the_record(pool: PgPool) {
    // The single-commit request holds the key's lock and runs; meanwhile a
    // default-mode request on another server records the key; then the first one's
    // route fails. Its answer is the record's, not its own failure.
    let (single_state, default_state) = (test_state(), test_state());
    let single = serve(&pool, single_state.clone(), true).await;
    let default_mode = serve(&pool, default_state.clone(), false).await;
    // The default-mode server's first call is not its first: it answers at once.
    default_state.calls.store(1, Ordering::SeqCst);
    let held = {
        let url = format!("{single}/mixed-first-fails");
        tokio::spawn(async move { send(&url, Some("z"), b"{}").await.unwrap() })
    };
    wait_until(LIMIT, "the single-commit request holds the key", || async {
        single_state.calls.load(Ordering::SeqCst) == 1 && writing(&pool).await == 1
    })
    .await;
    let recorded = send(
        &format!("{default_mode}/mixed-first-fails"),
        Some("z"),
        b"{}",
    )
    .await
    .unwrap();
    assert_eq!((recorded.status, recorded.replayed()), (201, false));
    single_state.gate.add_permits(1);
    let late = tokio::time::timeout(LIMIT, held).await.unwrap().unwrap();
    assert_eq!(
        (late.status, late.replayed()),
        (201, true),
        "not its own 503"
    );
    assert_eq!(late.body, recorded.body);
    assert_eq!(
        effects(&pool, "first_fails").await,
        1,
        "its write rolled back"
    );
    locks_given_back(&pool).await;
}

// ---- Failpoints on the commit path (feature `failpoints`) ----

/// Sends a payment to a `payments_api` that aborts at `point`, checks that it died
/// there, and starts a healthy one; returns it (it runs until dropped) and its URL.
#[cfg(feature = "failpoints")]
async fn crash_at(
    pool: &PgPool,
    c: &PgConnectOptions,
    point: &str,
) -> (WorkerProcess, String, u16) {
    crash_with(pool, c, point, &payment(300)).await
}

/// [`crash_at`] with the request's body.
#[cfg(feature = "failpoints")]
async fn crash_with(
    pool: &PgPool,
    c: &PgConnectOptions,
    point: &str,
    body: &[u8],
) -> (WorkerProcess, String, u16) {
    let db = database_url(c);
    let env = [("IDEM_FAILPOINT", point)];
    let (mut crashing, url, _) = start_api(&db, &[], &env).await;
    let lost = send(&url, Some("k"), body).await;
    assert!(lost.is_err(), "the client lost its answer at {point}");
    let status = tokio::time::timeout(LIMIT, crashing.child.wait())
        .await
        .expect("the server reaches the failpoint")
        .unwrap();
    assert!(!status.success(), "aborted at {point}: {status:?}");
    assert!(crashing.log_contains(&format!("failpoint {point}: aborting")));
    wait_until(LIMIT, "the dead server's session gone", || async {
        writing(pool).await == 0
    })
    .await;
    start_api(&db, &[], &[]).await
}

#[cfg(feature = "failpoints")]
async fn crash_before_the_commit_leaves_nothing(
    o: PgPoolOptions,
    c: PgConnectOptions,
    point: &str,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let (_api, url, _) = crash_at(&pool, &c, point).await;
    assert_eq!(records(&pool).await, 0, "{point}: no record");
    assert_eq!(payments(&pool).await, 0, "{point}: no payment");
    let retry = send(&url, Some("k"), &payment(300)).await.unwrap();
    assert_eq!((retry.status, retry.replayed()), (201, false), "{point}");
    assert_eq!(payments(&pool).await, 1);
    assert_eq!(
        record_of(&pool, SINGLE).await,
        Some(("completed".into(), 1))
    );
}

#[cfg(feature = "failpoints")]
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_crash_while_the_requests_transaction_holds_the_key_leaves_nothing(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    crash_before_the_commit_leaves_nothing(o, c, "http-single-after-claim").await;
}

#[cfg(feature = "failpoints")]
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_crash_before_the_single_commit_leaves_nothing(o: PgPoolOptions, c: PgConnectOptions) {
    crash_before_the_commit_leaves_nothing(o, c, "http-single-before-commit").await;
}

#[cfg(feature = "failpoints")]
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_crash_after_the_single_commit_is_replayed(o: PgPoolOptions, c: PgConnectOptions) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let (_api, url, _) = crash_at(&pool, &c, "http-single-after-commit").await;
    assert_eq!(payments(&pool).await, 1, "the payment committed");
    assert_eq!(
        record_of(&pool, SINGLE).await,
        Some(("completed".into(), 1))
    );
    let retry = send(&url, Some("k"), &payment(300)).await.unwrap();
    assert_eq!((retry.status, retry.replayed()), (201, true));
    assert_eq!(payments(&pool).await, 1, "exactly one payment");
}

/// A permanent error's answer is stored without the route's writes, on a second
/// connection while the request holds the key: a crash before that commit leaves
/// nothing, and the retry answers afresh.
#[cfg(feature = "failpoints")]
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_crash_before_a_permanent_answer_is_stored_leaves_nothing(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let refused = payment(-5);
    let (_api, url, _) = crash_with(&pool, &c, "http-single-before-commit", &refused).await;
    assert_eq!(records(&pool).await, 0, "no record");
    let retry = send(&url, Some("k"), &refused).await.unwrap();
    assert_eq!((retry.status, retry.replayed()), (422, false));
    assert_eq!(payments(&pool).await, 0);
    assert_eq!(
        record_of(&pool, SINGLE).await,
        Some(("completed".into(), 1))
    );
}

/// ... and a crash after it leaves the answer, replayed to the retry.
#[cfg(feature = "failpoints")]
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_crash_after_a_permanent_answer_is_stored_is_replayed(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let refused = payment(-5);
    let (_api, url, _) = crash_with(&pool, &c, "http-single-after-commit", &refused).await;
    assert_eq!(
        record_of(&pool, SINGLE).await,
        Some(("completed".into(), 1))
    );
    let retry = send(&url, Some("k"), &refused).await.unwrap();
    assert_eq!((retry.status, retry.replayed()), (422, true));
    assert_eq!(payments(&pool).await, 0, "its write never committed");
}
