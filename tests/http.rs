//! The HTTP layer against the real database with a real HTTP client: the
//! `payments_api` example as a process (concurrent repeats, conflicts, a server killed
//! mid-request, the body limit), and routes served in the test for the outcomes the
//! example does not produce (transient, uncertain, too large, 202 and polling, the
//! operator commands on HTTP records).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::{
    WorkerProcess, bearer_principal, database_url, idem_cli, run_idem, signal, spawn_payments_api,
    wait_until,
};
use idem::http::{Decided, IDEMPOTENCY_REPLAYED, Idempotency, IdempotentRequest, Tx};
use idem::{HandlerError, Key, Reconciliation, Store, StoreConfig};
use reqwest::header::HeaderMap;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// One answer: status, headers, body bytes.
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

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// POSTs `body` to `url` as `principal` with `key`.
async fn post_json(
    client: &reqwest::Client,
    url: &str,
    principal: Option<&str>,
    key: Option<&str>,
    body: &[u8],
) -> Result<Answer, reqwest::Error> {
    let mut request = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_vec());
    if let Some(principal) = principal {
        request = request.bearer_auth(principal);
    }
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

fn payment(customer: &str, amount_cents: i64) -> Vec<u8> {
    json!({"customer": customer, "amount_cents": amount_cents, "currency": "EUR"})
        .to_string()
        .into_bytes()
}

async fn payments(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM example_payments")
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

async fn records(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM processed_operations")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A free port on loopback (bound, then let go, so a restarted server can take it).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A `payments_api` process, ready.
async fn start_api(url: &str, port: u16, extra: &[&str]) -> WorkerProcess {
    let api = spawn_payments_api(url, port, extra);
    let health = format!("http://127.0.0.1:{port}/healthz");
    let client = reqwest::Client::new();
    wait_until(
        Duration::from_secs(60),
        "payments_api listening",
        || async { client.get(&health).send().await.is_ok() },
    )
    .await;
    api
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn thirty_concurrent_requests_with_one_key_make_one_payment(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let port = free_port();
    let _api = start_api(&database_url(&c), port, &["--provider-delay-ms", "300"]).await;
    let url = format!("http://127.0.0.1:{port}/payments");
    let client = reqwest::Client::new();
    let body = payment("c-1", 1250);
    let start = Arc::new(tokio::sync::Barrier::new(30));
    let mut racers = tokio::task::JoinSet::new();
    for _ in 0..30 {
        let (client, url, body, start) = (client.clone(), url.clone(), body.clone(), start.clone());
        racers.spawn(async move {
            start.wait().await;
            post_json(&client, &url, Some("alice"), Some("order-17"), &body)
                .await
                .unwrap()
        });
    }
    let answers = racers.join_all().await;
    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    assert!(
        statuses.iter().all(|s| *s == 201 || *s == 409),
        "every answer is 201 or 409: {statuses:?}"
    );
    let created: Vec<&Answer> = answers.iter().filter(|a| a.status == 201).collect();
    let executed: Vec<&&Answer> = created.iter().filter(|a| !a.replayed()).collect();
    assert_eq!(executed.len(), 1, "one request ran: {statuses:?}");
    assert!(statuses.contains(&409), "the requests raced: {statuses:?}");
    for conflict in answers.iter().filter(|a| a.status == 409) {
        assert_eq!(
            conflict.problem_type(),
            "urn:idem:problem:request-in-progress"
        );
        assert_eq!(conflict.header("retry-after"), Some("1"));
        assert_eq!(
            conflict.header("content-type"),
            Some("application/problem+json")
        );
    }
    assert_eq!(payments(&pool).await, 1, "exactly one payment");

    let retry = post_json(&client, &url, Some("alice"), Some("order-17"), &body)
        .await
        .unwrap();
    assert_eq!(retry.status, 201);
    assert!(retry.replayed(), "the retry is a replay");
    assert_eq!(retry.body, executed[0].body, "byte-identical body");
    assert_eq!(
        retry.header("content-type"),
        executed[0].header("content-type")
    );
    for replay in created.iter().filter(|a| a.replayed()) {
        assert_eq!(replay.body, executed[0].body);
    }
    assert_eq!(payments(&pool).await, 1);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_reused_key_conflicts_a_missing_key_is_refused_and_principals_are_apart(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let port = free_port();
    let _api = start_api(&database_url(&c), port, &[]).await;
    let url = format!("http://127.0.0.1:{port}/payments");
    let client = reqwest::Client::new();

    let first = post_json(
        &client,
        &url,
        Some("alice"),
        Some("k-1"),
        &payment("c-1", 100),
    )
    .await
    .unwrap();
    assert_eq!(first.status, 201);
    let other = post_json(
        &client,
        &url,
        Some("alice"),
        Some("k-1"),
        &payment("c-1", 999),
    )
    .await
    .unwrap();
    assert_eq!(other.status, 422);
    assert_eq!(
        other.problem_type(),
        "urn:idem:problem:idempotency-key-reused"
    );
    // Reordered and re-spaced JSON is the same request.
    let reordered = br#"{ "currency": "EUR", "amount_cents": 100, "customer": "c-1" }"#;
    let same = post_json(&client, &url, Some("alice"), Some("k-1"), reordered)
        .await
        .unwrap();
    assert_eq!((same.status, same.replayed()), (201, true));
    assert_eq!(payments(&pool).await, 1);

    // A rejection before the handler ran (axum's Json wants a Content-Type) is not the
    // request's answer: the key stays free, and the corrected request runs.
    let unlabelled = client
        .post(&url)
        .bearer_auth("alice")
        .header("idempotency-key", "k-2")
        .body(payment("c-2", 200))
        .send()
        .await
        .unwrap();
    assert_eq!(unlabelled.status().as_u16(), 415);
    let labelled = post_json(
        &client,
        &url,
        Some("alice"),
        Some("k-2"),
        &payment("c-2", 200),
    )
    .await
    .unwrap();
    assert_eq!((labelled.status, labelled.replayed()), (201, false));
    assert_eq!(payments(&pool).await, 2);

    let records_before = records(&pool).await;
    let no_key = post_json(&client, &url, Some("alice"), None, &payment("c-1", 100))
        .await
        .unwrap();
    assert_eq!(no_key.status, 400);
    assert_eq!(
        no_key.problem_type(),
        "urn:idem:problem:idempotency-key-missing"
    );
    let invalid = client
        .post(&url)
        .bearer_auth("alice")
        .header("idempotency-key", format!("{:?}", "x".repeat(501)))
        .body(payment("c-1", 100))
        .send()
        .await
        .unwrap();
    assert_eq!(invalid.status().as_u16(), 400, "a 501-byte key is refused");
    let anonymous = post_json(&client, &url, None, Some("k-1"), &payment("c-1", 100))
        .await
        .unwrap();
    assert_eq!(anonymous.status, 401, "the application's own rejection");
    assert_eq!(payments(&pool).await, 2, "no payment without a valid key");
    assert_eq!(records(&pool).await, records_before, "nothing recorded");

    let bob = post_json(
        &client,
        &url,
        Some("bob"),
        Some("k-1"),
        &payment("c-1", 100),
    )
    .await
    .unwrap();
    assert_eq!((bob.status, bob.replayed()), (201, false));
    assert_eq!(
        payments(&pool).await,
        3,
        "two principals, one key: two payments"
    );
    let principals: Vec<String> = sqlx::query_scalar(
        "SELECT principal FROM example_payments WHERE customer = 'c-1' ORDER BY principal",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(principals, ["alice", "bob"]);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_server_killed_mid_request_is_taken_over_after_its_lease(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let url_db = database_url(&c);
    let port = free_port();
    // A lease of 6 s: the restart (migrate, bind) is well within it, so the first retry
    // meets the dead server's lease.
    let slow = ["--lease-secs", "6", "--provider-delay-ms", "10000"];
    let mut api = start_api(&url_db, port, &slow).await;
    let url = format!("http://127.0.0.1:{port}/payments");
    let client = reqwest::Client::new();
    let body = payment("c-1", 500);
    let in_flight = {
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        tokio::spawn(async move { post_json(&client, &url, Some("alice"), Some("k"), &body).await })
    };
    wait_until(
        Duration::from_secs(30),
        "the request claimed its key",
        || async { records(&pool).await == 1 },
    )
    .await;
    signal(&api, "KILL");
    let _ = api.child.wait().await;
    assert!(
        in_flight.await.unwrap().is_err(),
        "the client lost its answer"
    );
    let _api = start_api(&url_db, port, &["--lease-secs", "6"]).await;
    let live: bool =
        sqlx::query_scalar("SELECT lease_expires_at > now() FROM processed_operations")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(live, "the restart took longer than the dead server's lease");

    let mut statuses = Vec::new();
    let done = loop {
        let answer = post_json(&client, &url, Some("alice"), Some("k"), &body)
            .await
            .unwrap();
        statuses.push(answer.status);
        match answer.status {
            409 => {
                assert_eq!(answer.header("retry-after"), Some("1"));
                let wait = answer.header("retry-after").unwrap().parse().unwrap();
                tokio::time::sleep(Duration::from_secs(wait)).await;
            }
            _ => break answer,
        }
        assert!(
            statuses.len() < 30,
            "taken over within the lease: {statuses:?}"
        );
    };
    assert_eq!(done.status, 201, "after {statuses:?}");
    assert!(!done.replayed(), "the retry ran the request");
    assert!(
        statuses[0] == 409,
        "409 while the dead server's lease ran: {statuses:?}"
    );
    let (attempts, status): (i32, String) =
        sqlx::query_as("SELECT attempts, status FROM processed_operations")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((attempts, status.as_str()), (2, "completed"));
    assert_eq!(payments(&pool).await, 1, "exactly one payment");
    let again = post_json(&client, &url, Some("alice"), Some("k"), &body)
        .await
        .unwrap();
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, done.body);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_body_over_the_limit_is_refused_with_nothing_stored(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let port = free_port();
    let _api = start_api(&database_url(&c), port, &["--max-body-bytes", "1024"]).await;
    let url = format!("http://127.0.0.1:{port}/payments");
    let client = reqwest::Client::new();
    let big = json!({"customer": "c".repeat(2000), "amount_cents": 1, "currency": "EUR"});
    let answer = post_json(
        &client,
        &url,
        Some("alice"),
        Some("big"),
        big.to_string().as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(answer.status, 413);
    assert_eq!(answer.problem_type(), "urn:idem:problem:body-too-large");
    assert_eq!(records(&pool).await, 0, "no record");
    assert_eq!(payments(&pool).await, 0, "no payment");
    // The same key with a body that fits is a first request.
    let small = post_json(&client, &url, Some("alice"), Some("big"), &payment("c", 1))
        .await
        .unwrap();
    assert_eq!((small.status, small.replayed()), (201, false));
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

/// Fails transiently on its first call, then succeeds.
async fn flaky(State(s): State<TestState>, mut tx: Tx) -> Result<StatusCode, HandlerError> {
    note(&mut tx, "flaky").await?;
    if s.calls.fetch_add(1, Ordering::SeqCst) == 0 {
        return Err(HandlerError::transient("the provider is busy"));
    }
    Ok(StatusCode::CREATED)
}

async fn uncertain(mut tx: Tx) -> Result<StatusCode, HandlerError> {
    note(&mut tx, "uncertain").await?;
    Err(HandlerError::uncertain(
        Some("charge-7".into()),
        "the provider timed out",
    ))
}

async fn huge(mut tx: Tx) -> Result<String, HandlerError> {
    note(&mut tx, "huge").await?;
    Ok("x".repeat(4096))
}

/// A refusal marked as the route's decision: stored and replayed, its write kept.
async fn declined(mut tx: Tx) -> Result<impl IntoResponse, HandlerError> {
    note(&mut tx, "declined").await?;
    Ok((StatusCode::PAYMENT_REQUIRED, Decided, "card declined"))
}

/// A refusal not marked: the key stays free and its write is rolled back.
async fn refused(mut tx: Tx) -> Result<StatusCode, HandlerError> {
    note(&mut tx, "refused").await?;
    Ok(StatusCode::NOT_FOUND)
}

/// Panics on its first attempt, after a write.
async fn panics(request: IdempotentRequest, mut tx: Tx) -> Result<StatusCode, HandlerError> {
    note(&mut tx, "panics").await?;
    if request.attempt == 1 {
        panic!("the handler's bug");
    }
    Ok(StatusCode::CREATED)
}

/// Uncertain on its first attempt (the provider's reference is the body's `outcome`),
/// then it runs.
async fn maybe(
    request: IdempotentRequest,
    mut tx: Tx,
    Json(body): Json<Value>,
) -> Result<(StatusCode, String), HandlerError> {
    note(&mut tx, "maybe").await?;
    if request.attempt == 1 {
        let outcome = body["outcome"].as_str().map(str::to_owned);
        return Err(HandlerError::uncertain(outcome, "the provider timed out"));
    }
    Ok((
        StatusCode::CREATED,
        format!("ran again, attempt {}", request.attempt),
    ))
}

/// Asks "the provider": the reference says what it knows.
async fn reconcile_maybe(
    _: IdempotentRequest,
    external_ref: Option<String>,
) -> Result<Reconciliation<Response>, HandlerError> {
    match external_ref.as_deref() {
        Some("applied") => Ok(Reconciliation::Applied(
            (StatusCode::CREATED, "found at the provider").into_response(),
        )),
        Some("absent") => Ok(Reconciliation::NotApplied),
        Some("broken") => Err(HandlerError::transient("the provider is down")),
        Some("refused") => Err(HandlerError::permanent("the provider refused it")),
        // Not an answer to keep: the key stays pending.
        Some("odd") => Ok(Reconciliation::Applied(
            StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        )),
        _ => Ok(Reconciliation::Unknown),
    }
}

/// A write the database refuses: a duplicate primary key.
async fn db_refused(mut tx: Tx) -> Result<StatusCode, HandlerError> {
    sqlx::query("INSERT INTO test_unique_ids (id) VALUES (1)")
        .execute(&mut *tx)
        .await?;
    Ok(StatusCode::CREATED)
}

/// A query of a table that does not exist: neither the data's fault nor an outage.
async fn db_broken(mut tx: Tx) -> Result<StatusCode, HandlerError> {
    sqlx::query("SELECT * FROM test_no_such_table")
        .execute(&mut *tx)
        .await?;
    Ok(StatusCode::CREATED)
}

/// Hangs on its first attempt, after a write (rolled back only once the run is
/// dropped, since the run holds the transaction); answers on the next.
async fn hangs(request: IdempotentRequest, mut tx: Tx) -> Result<StatusCode, HandlerError> {
    note(&mut tx, "hangs").await?;
    if request.attempt == 1 {
        std::future::pending::<()>().await;
    }
    Ok(StatusCode::CREATED)
}

/// Waits for the test to open the gate, then answers.
async fn gated(State(s): State<TestState>, request: IdempotentRequest, mut tx: Tx) -> Response {
    if let Err(e) = note(&mut tx, "gated").await {
        return e.into_response();
    }
    let _permit = s.gate.acquire().await;
    (StatusCode::CREATED, format!("attempt {}", request.attempt)).into_response()
}

/// Serves the test routes on a free port; returns the base URL and the store.
async fn serve_test_routes(pool: &PgPool, lease: Duration, retention: Duration) -> String {
    sqlx::query("CREATE TABLE IF NOT EXISTS test_effects (what text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS test_unique_ids (id int PRIMARY KEY)")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO test_unique_ids VALUES (1) ON CONFLICT DO NOTHING")
        .execute(pool)
        .await
        .unwrap();
    let store = Store::new(
        pool.clone(),
        StoreConfig {
            lease,
            retention,
            ..StoreConfig::default()
        },
    );
    let keys = Idempotency::new(store, bearer_principal).max_response_bytes(1024);
    let poll_keys = keys.clone();
    let state = TestState {
        calls: Arc::new(AtomicU32::new(0)),
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let gate = state.gate.clone();
    let app = Router::new()
        .route("/flaky", post(flaky).route_layer(keys.required()))
        .route("/uncertain", post(uncertain).route_layer(keys.required()))
        .route("/huge", post(huge).route_layer(keys.required()))
        .route("/declined", post(declined).route_layer(keys.required()))
        .route("/refused", post(refused).route_layer(keys.required()))
        .route("/panics", post(panics).route_layer(keys.required()))
        .route("/db-refused", post(db_refused).route_layer(keys.required()))
        .route("/db-broken", post(db_broken).route_layer(keys.required()))
        .route(
            "/hangs",
            post(hangs).route_layer(keys.required().run_within(Duration::from_millis(300))),
        )
        .route(
            "/maybe",
            post(maybe).route_layer(keys.required().reconcile(reconcile_maybe)),
        )
        .route(
            "/maybe-unreconciled",
            post(maybe).route_layer(keys.required()),
        )
        .route(
            "/gated",
            post(gated).route_layer(
                keys.required()
                    .accept_while_running(|key| format!("/polls/{}", key.idempotency_key())),
            ),
        )
        .route(
            "/polls/{key}",
            get(
                move |parts: Parts, axum::extract::Path(key): axum::extract::Path<String>| {
                    let keys = poll_keys.clone();
                    async move {
                        let scope = bearer_principal(&parts)?;
                        let key = Key::new(scope, "POST /gated", key).map_err(|e| {
                            (StatusCode::BAD_REQUEST, e.to_string()).into_response()
                        })?;
                        Ok::<_, Response>(keys.poll(&key).await)
                    }
                },
            ),
        )
        .route(
            "/open",
            post(|| async move {
                gate.add_permits(1000);
            }),
        )
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

async fn effects(pool: &PgPool, what: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM test_effects WHERE what = $1")
        .bind(what)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn record_of(pool: &PgPool, operation: &str) -> (String, i32, bool, Option<String>, bool) {
    sqlx::query_as(
        "SELECT status, attempts, retryable, external_ref, expires_at IS NOT NULL
         FROM processed_operations WHERE operation = $1",
    )
    .bind(operation)
    .fetch_one(pool)
    .await
    .unwrap()
}

const DAY: Duration = Duration::from_secs(86_400);

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_transient_failure_frees_the_key_and_rolls_its_writes_back(pool: PgPool) {
    let base = serve_test_routes(&pool, Duration::from_secs(30), DAY).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/flaky");
    let first = post_json(&client, &url, Some("a"), Some("k"), b"{}")
        .await
        .unwrap();
    assert_eq!(first.status, 503);
    assert_eq!(first.header("retry-after"), Some("1"));
    assert_eq!(effects(&pool, "flaky").await, 0, "rolled back");
    let (status, attempts, retryable, _, expires) = record_of(&pool, "POST /flaky").await;
    assert_eq!((status.as_str(), attempts, retryable), ("failed", 1, true));
    assert!(expires, "a freed key expires if no retry comes");
    let second = post_json(&client, &url, Some("a"), Some("k"), b"{}")
        .await
        .unwrap();
    assert_eq!((second.status, second.replayed()), (201, false));
    assert_eq!(effects(&pool, "flaky").await, 1);
    let (status, attempts, ..) = record_of(&pool, "POST /flaky").await;
    assert_eq!((status.as_str(), attempts), ("completed", 2));
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn an_uncertain_outcome_stays_pending_and_is_answered_409(pool: PgPool) {
    let base = serve_test_routes(&pool, Duration::from_secs(30), DAY).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/uncertain");
    let first = post_json(&client, &url, Some("a"), Some("k"), b"{}")
        .await
        .unwrap();
    assert_eq!(first.status, 502);
    assert_eq!(effects(&pool, "uncertain").await, 0, "rolled back");
    for _ in 0..2 {
        let again = post_json(&client, &url, Some("a"), Some("k"), b"{}")
            .await
            .unwrap();
        assert_eq!(again.status, 409);
        assert_eq!(again.problem_type(), "urn:idem:problem:outcome-uncertain");
        assert_eq!(again.header("retry-after"), Some("30"));
    }
    let (status, attempts, _, external_ref, expires) = record_of(&pool, "POST /uncertain").await;
    assert_eq!(
        (status.as_str(), attempts, external_ref.as_deref()),
        ("pending", 1, Some("charge-7")),
        "asking again neither runs it nor counts as an attempt"
    );
    assert!(
        !expires,
        "a pending key never expires: a repeat would run unreconciled"
    );
    let lease: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT lease_expires_at FROM processed_operations")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(lease, None, "no lease held");
    assert_eq!(effects(&pool, "uncertain").await, 0);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn an_answer_too_large_to_store_is_500_with_nothing_stored(pool: PgPool) {
    let base = serve_test_routes(&pool, Duration::from_secs(30), DAY).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/huge");
    for attempt in 1..=2 {
        let answer = post_json(&client, &url, Some("a"), Some("k"), b"{}")
            .await
            .unwrap();
        assert_eq!(answer.status, 500);
        assert_eq!(answer.problem_type(), "urn:idem:problem:response-too-large");
        let (status, attempts, retryable, ..) = record_of(&pool, "POST /huge").await;
        assert_eq!(
            (status.as_str(), attempts, retryable),
            ("failed", attempt, true)
        );
    }
    assert_eq!(effects(&pool, "huge").await, 0, "its writes rolled back");
    let result: Option<Value> = sqlx::query_scalar("SELECT result FROM processed_operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(result, None, "no answer stored");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_route_may_answer_202_with_a_location_to_poll(pool: PgPool) {
    let base = serve_test_routes(&pool, Duration::from_secs(30), DAY).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/gated");
    let first = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { post_json(&client, &url, Some("a"), Some("g-1"), b"{}").await })
    };
    wait_until(
        Duration::from_secs(10),
        "the first request runs",
        || async { records(&pool).await == 1 },
    )
    .await;
    let repeat = post_json(&client, &url, Some("a"), Some("g-1"), b"{}")
        .await
        .unwrap();
    assert_eq!(repeat.status, 202);
    assert_eq!(repeat.header("location"), Some("/polls/g-1"));
    assert_eq!(repeat.header("retry-after"), Some("1"));
    let poll_url = format!("{base}/polls/g-1");
    let polled = client.get(&poll_url).bearer_auth("a").send().await.unwrap();
    assert_eq!(polled.status().as_u16(), 202);
    // Were its server dead (its lease lapsed), polling would wait forever: 404, send the
    // request again.
    sqlx::query("UPDATE processed_operations SET lease_expires_at = now() - interval '1 s'")
        .execute(&pool)
        .await
        .unwrap();
    let dead = client.get(&poll_url).bearer_auth("a").send().await.unwrap();
    assert_eq!(dead.status().as_u16(), 404);
    sqlx::query("UPDATE processed_operations SET lease_expires_at = now() + interval '30 s'")
        .execute(&pool)
        .await
        .unwrap();
    let unknown = client
        .get(format!("{base}/polls/nope"))
        .bearer_auth("a")
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status().as_u16(), 404);

    client.post(format!("{base}/open")).send().await.unwrap();
    let first = first.await.unwrap().unwrap();
    assert_eq!(
        (first.status, first.body.as_slice()),
        (201, &b"attempt 1"[..])
    );
    let polled = client.get(&poll_url).bearer_auth("a").send().await.unwrap();
    assert_eq!(polled.status().as_u16(), 201);
    assert_eq!(polled.headers()[IDEMPOTENCY_REPLAYED], "true");
    assert_eq!(polled.bytes().await.unwrap().as_ref(), b"attempt 1");
    assert_eq!(effects(&pool, "gated").await, 1);
}

/// A route without a reconciler leaves an uncertain key pending, answering 409, until
/// an operator who checked with the provider resolves it as not applied: the next
/// request runs it again, once. What is not pending is refused with its status.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn an_operator_resolves_an_unreconciled_pending_key_and_it_runs_again(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let url_db = database_url(&c);
    let base = serve_test_routes(&pool, Duration::from_secs(30), DAY).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/maybe-unreconciled");
    let body = br#"{"outcome":"charge-9"}"#;
    let first = post_json(&client, &url, Some("ops"), Some("r-1"), body)
        .await
        .unwrap();
    assert_eq!(first.status, 502);
    let waiting = post_json(&client, &url, Some("ops"), Some("r-1"), body)
        .await
        .unwrap();
    assert_eq!(waiting.status, 409);
    assert_eq!(waiting.problem_type(), "urn:idem:problem:outcome-uncertain");
    let key = [
        "--scope",
        "ops",
        "--operation",
        "POST /maybe-unreconciled",
        "--key",
        "r-1",
    ];
    let resolve = |extra: Vec<String>| {
        let url_db = url_db.clone();
        async move {
            let mut args: Vec<&str> = vec!["ops", "resolve"];
            args.extend_from_slice(&key);
            args.extend(extra.iter().map(String::as_str));
            run_idem(&url_db, &args).await
        }
    };
    let token: i64 = sqlx::query_scalar("SELECT lease_token FROM processed_operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    let token_args = |token: i64| vec!["--token".to_owned(), token.to_string()];
    // The finding must be said, and the state it was found in.
    let (code, _) = resolve(token_args(token)).await;
    assert_ne!(code, 0, "resolve without --not-applied");
    let (code, _) = resolve(vec!["--not-applied".into()]).await;
    assert_ne!(code, 0, "resolve without --token");
    let (code, _) = resolve([vec!["--not-applied".into()], token_args(token - 1)].concat()).await;
    assert_ne!(code, 0, "resolve with a token the record no longer has");
    assert_eq!(
        record_of(&pool, "POST /maybe-unreconciled").await.0,
        "pending"
    );
    let note = vec![
        "--not-applied".to_owned(),
        "--note".into(),
        "TICKET-7: no charge-9".into(),
    ];
    let (code, out) = resolve([note, token_args(token)].concat()).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("resolved"), "{out}");
    let (status, attempts, retryable, external_ref, expires) =
        record_of(&pool, "POST /maybe-unreconciled").await;
    assert_eq!(
        (
            status.as_str(),
            attempts,
            retryable,
            external_ref.as_deref()
        ),
        ("failed", 1, true, None),
        "the checked reference moves into the error"
    );
    assert!(expires, "a resolved key expires if no request comes");
    let shown = idem_cli(&url_db, &[&["ops", "show"][..], &key].concat()).await;
    assert!(
        shown.contains("TICKET-7") && shown.contains("charge-9"),
        "the note and the reference are kept: {shown}"
    );

    let again = post_json(&client, &url, Some("ops"), Some("r-1"), body)
        .await
        .unwrap();
    assert_eq!(
        (again.status, again.body.as_slice()),
        (201, &b"ran again, attempt 2"[..])
    );
    assert_eq!(effects(&pool, "maybe").await, 1, "one run committed");
    let replayed = post_json(&client, &url, Some("ops"), Some("r-1"), body)
        .await
        .unwrap();
    assert!(replayed.replayed(), "then it is an ordinary completed key");
    let (code, _) = resolve([vec!["--not-applied".into()], token_args(token)].concat()).await;
    assert_ne!(code, 0, "a completed key is not resolved");
    assert_eq!(effects(&pool, "maybe").await, 1);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn operators_show_list_release_and_collect_http_records(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    let pool = o.connect_with(c.clone()).await.unwrap();
    let url_db = database_url(&c);
    // Completed records expire at once, so gc has something to collect; the lease is
    // long, so that no heartbeat renews it between the release and the takeover.
    let base = serve_test_routes(&pool, Duration::from_secs(600), Duration::ZERO).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/gated");
    let stuck = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { post_json(&client, &url, Some("ops"), Some("s-1"), b"{}").await })
    };
    wait_until(Duration::from_secs(10), "the request runs", || async {
        records(&pool).await == 1
    })
    .await;
    // In flight, its record expires after the retention (zero) plus one lease (600 s):
    // gc leaves it.
    idem_cli(&url_db, &["gc"]).await;
    assert_eq!(records(&pool).await, 1, "gc spares a record in flight");
    let key = [
        "--scope",
        "ops",
        "--operation",
        "POST /gated",
        "--key",
        "s-1",
    ];
    let shown = idem_cli(&url_db, &[&["ops", "show"][..], &key].concat()).await;
    assert!(shown.contains("processing"), "{shown}");
    let listed = idem_cli(&url_db, &["ops", "list", "--status", "processing"]).await;
    assert!(listed.contains("POST /gated"), "{listed}");
    // The server is alive, but the operator says its request is dead: a retry takes
    // it over at once, and the first request's late completion is fenced off.
    idem_cli(&url_db, &[&["ops", "release"][..], &key].concat()).await;
    let takeover = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { post_json(&client, &url, Some("ops"), Some("s-1"), b"{}").await })
    };
    wait_until(
        Duration::from_secs(10),
        "the retry takes the key over",
        || async {
            sqlx::query_scalar::<_, i32>("SELECT attempts FROM processed_operations")
                .fetch_one(&pool)
                .await
                .unwrap_or(0)
                == 2
        },
    )
    .await;
    client.post(format!("{base}/open")).send().await.unwrap();
    let taken = takeover.await.unwrap().unwrap();
    assert_eq!(
        (taken.status, taken.body.as_slice()),
        (201, &b"attempt 2"[..])
    );
    let first = stuck.await.unwrap().unwrap();
    assert_eq!(
        first.status, 409,
        "the released request is told it was taken over"
    );
    assert_eq!(first.problem_type(), "urn:idem:problem:request-taken-over");
    assert_eq!(
        effects(&pool, "gated").await,
        1,
        "only the takeover's write commits"
    );

    idem_cli(&url_db, &["gc"]).await;
    assert_eq!(
        records(&pool).await,
        0,
        "the completed HTTP record is collected"
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn only_a_decided_refusal_is_stored(pool: PgPool) {
    let base = serve_test_routes(&pool, Duration::from_secs(30), DAY).await;
    let client = reqwest::Client::new();
    for _ in 0..2 {
        let refused = post_json(
            &client,
            &format!("{base}/refused"),
            Some("a"),
            Some("k"),
            b"{}",
        )
        .await
        .unwrap();
        assert_eq!((refused.status, refused.replayed()), (404, false));
    }
    assert_eq!(
        effects(&pool, "refused").await,
        0,
        "a refusal's write rolls back"
    );
    let (status, attempts, retryable, ..) = record_of(&pool, "POST /refused").await;
    assert_eq!((status.as_str(), attempts, retryable), ("failed", 2, true));

    let url = format!("{base}/declined");
    let first = post_json(&client, &url, Some("a"), Some("k"), b"{}")
        .await
        .unwrap();
    let again = post_json(&client, &url, Some("a"), Some("k"), b"{}")
        .await
        .unwrap();
    assert_eq!((first.status, first.replayed()), (402, false));
    assert_eq!((again.status, again.replayed()), (402, true));
    assert_eq!(again.body, b"card declined");
    assert_eq!(
        effects(&pool, "declined").await,
        1,
        "a decision's write commits"
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_panicking_route_frees_its_key_and_the_server_lives_on(pool: PgPool) {
    let base = serve_test_routes(&pool, Duration::from_secs(30), DAY).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/panics");
    let first = post_json(&client, &url, Some("a"), Some("k"), b"{}")
        .await
        .unwrap();
    assert_eq!(first.status, 500);
    assert_eq!(first.problem_type(), "urn:idem:problem:internal-error");
    assert_eq!(effects(&pool, "panics").await, 0, "its write rolled back");
    let second = post_json(&client, &url, Some("a"), Some("k"), b"{}")
        .await
        .unwrap();
    assert_eq!((second.status, second.replayed()), (201, false));
    assert_eq!(effects(&pool, "panics").await, 1);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_reconciler_settles_an_uncertain_key(pool: PgPool) {
    let base = serve_test_routes(&pool, Duration::from_secs(30), DAY).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/maybe");
    let ask = |key: &'static str, outcome: &'static str| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let body = json!({ "outcome": outcome }).to_string();
            post_json(&client, &url, Some("a"), Some(key), body.as_bytes())
                .await
                .unwrap()
        }
    };
    let keys = [
        ("k-applied", "applied"),
        ("k-absent", "absent"),
        ("k-unknown", "unknown"),
        ("k-broken", "broken"),
        ("k-refused", "refused"),
        ("k-odd", "odd"),
    ];
    for (key, outcome) in keys {
        assert_eq!(
            ask(key, outcome).await.status,
            502,
            "{key}: uncertain at first"
        );
    }
    assert_eq!(effects(&pool, "maybe").await, 0, "uncertain runs roll back");

    // The provider has it: its answer is stored, the request does not run again.
    let applied = ask("k-applied", "applied").await;
    assert_eq!(
        (applied.status, applied.body.as_slice()),
        (201, &b"found at the provider"[..])
    );
    let replayed = ask("k-applied", "applied").await;
    assert_eq!((replayed.status, replayed.replayed()), (201, true));
    assert_eq!(replayed.body, applied.body);

    // The provider never saw it: it runs again, once.
    let absent = ask("k-absent", "absent").await;
    assert_eq!(
        (absent.status, absent.body.as_slice()),
        (201, &b"ran again, attempt 2"[..])
    );
    assert_eq!(effects(&pool, "maybe").await, 1);

    // The reconciler says it failed for good: its 422 is the answer, kept.
    let refused = ask("k-refused", "refused").await;
    assert_eq!((refused.status, refused.replayed()), (422, false));
    let again = ask("k-refused", "refused").await;
    assert_eq!((again.status, again.replayed()), (422, true));

    // Unknown, the reconciler failed, or it answered what is not to be kept: still
    // pending, never expiring, and the claim counts nothing.
    for key in ["k-unknown", "k-broken", "k-odd"] {
        let outcome = key.trim_start_matches("k-");
        let answer = ask(key, outcome).await;
        assert_eq!(answer.status, 409, "{key}");
        assert_eq!(answer.problem_type(), "urn:idem:problem:outcome-uncertain");
        let (status, attempts, expires) = sqlx::query_as::<_, (String, i32, bool)>(
            "SELECT status, attempts, expires_at IS NOT NULL
             FROM processed_operations WHERE idempotency_key = $1",
        )
        .bind(key)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            (status.as_str(), attempts, expires),
            ("pending", 1, false),
            "{key}"
        );
    }
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_client_that_hangs_up_does_not_abandon_its_request(pool: PgPool) {
    let base = serve_test_routes(&pool, Duration::from_secs(30), DAY).await;
    let url = format!("{base}/gated");
    // The client hangs up once its request is claimed and waits at the gate (not after
    // a fixed time: on a loaded machine the claim may come later than any timeout).
    let impatient = {
        let url = url.clone();
        tokio::spawn(async move {
            let client = reqwest::Client::new();
            post_json(&client, &url, Some("a"), Some("h-1"), b"{}").await
        })
    };
    wait_until(Duration::from_secs(10), "the request claimed", || async {
        sqlx::query_scalar::<_, String>(
            "SELECT status FROM processed_operations WHERE operation = 'POST /gated'",
        )
        .fetch_optional(&pool)
        .await
        .unwrap()
        .is_some_and(|status| status == "processing")
    })
    .await;
    impatient.abort();
    assert!(impatient.await.is_err(), "the client gave up");
    let client = reqwest::Client::new();
    client.post(format!("{base}/open")).send().await.unwrap();
    wait_until(
        Duration::from_secs(10),
        "the request completes anyway",
        || async { record_of(&pool, "POST /gated").await.0 == "completed" },
    )
    .await;
    let retry = post_json(&client, &url, Some("a"), Some("h-1"), b"{}")
        .await
        .unwrap();
    assert_eq!((retry.status, retry.replayed()), (201, true));
    assert_eq!(retry.body, b"attempt 1");
    assert_eq!(effects(&pool, "gated").await, 1);
}

/// What Postgres says (tables, constraints) stays in the logs: a client's problem
/// detail names only the SQLSTATE.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_database_error_is_answered_without_what_postgres_said(pool: PgPool) {
    let base = serve_test_routes(&pool, Duration::from_secs(30), DAY).await;
    let client = reqwest::Client::new();
    for (route, status, code) in [("db-refused", 422, "23505"), ("db-broken", 503, "42P01")] {
        let url = format!("{base}/{route}");
        let answer = post_json(&client, &url, Some("alice"), Some("k-1"), b"{}")
            .await
            .unwrap();
        let body: Value = serde_json::from_slice(&answer.body).unwrap();
        let detail = body["detail"].as_str().unwrap_or_default();
        assert_eq!(answer.status, status, "{route}: {body}");
        assert_eq!(
            detail,
            format!("a database error (SQLSTATE {code})"),
            "{route}"
        );
        let all = String::from_utf8_lossy(&answer.body);
        for secret in ["test_unique_ids", "test_no_such_table", "duplicate", "pkey"] {
            assert!(
                !all.contains(secret),
                "{route} told the client {secret:?}: {all}"
            );
        }
    }
}

/// A route that hangs is stopped at its bound: its writes roll back, the key is free,
/// and a retry with the same key runs.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_route_that_hangs_is_stopped_at_its_bound_and_frees_its_key(pool: PgPool) {
    let base = serve_test_routes(&pool, Duration::from_secs(30), DAY).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/hangs");
    let started = std::time::Instant::now();
    let first = post_json(&client, &url, Some("alice"), Some("k-hang"), b"{}")
        .await
        .unwrap();
    assert_eq!(first.status, 503);
    assert_eq!(first.problem_type(), "urn:idem:problem:request-timed-out");
    assert_eq!(first.header("retry-after"), Some("1"));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(effects(&pool, "hangs").await, 0, "its write rolled back");
    let (status, _, retryable, _, _) = record_of(&pool, "POST /hangs").await;
    assert_eq!((status.as_str(), retryable), ("failed", true));
    let again = post_json(&client, &url, Some("alice"), Some("k-hang"), b"{}")
        .await
        .unwrap();
    assert_eq!(again.status, 201);
    assert_eq!(effects(&pool, "hangs").await, 1);
    assert_eq!(record_of(&pool, "POST /hangs").await.0, "completed");
}
