//! Data protection (docs/DESIGN.md, "Data protection") against the real database and
//! broker: sealed values nowhere in the table files, rotation beside a live worker,
//! wrong and missing keys, erasure with tombstones (messages and HTTP), DLQ discard by
//! scope, and retention per operation collected by gc.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use common::*;
use idem::http::{Idempotency, Tx};
use idem::protect::Keys;
use idem::{Context, FollowUp, Handler, HandlerError, Key, Store, StoreConfig};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const MARKER: &str = "MARKER-7f3a9c-Ada-Lovelace";
const K1: &str = "k1:1111111111111111111111111111111111111111111111111111111111111111";
const K2: &str = "k2:2222222222222222222222222222222222222222222222222222222222222222";
const SETTLE: Duration = Duration::from_secs(60);

#[derive(Deserialize)]
struct Profile {
    event_id: String,
    tenant: String,
    name: String,
    #[serde(default)]
    uncertain: bool,
    #[serde(default)]
    fail: bool,
}

/// Stores the name in its output, sends it on in a follow-up, counts each run's effect;
/// reports an uncertain outcome with the name in the provider's reference, or fails for
/// good, when told.
struct Profiles {
    to: String,
}

impl Handler for Profiles {
    type Message = Profile;
    type Output = Value;
    const OPERATION: &'static str = "profiles.update";

    fn scope(&self, m: &Profile) -> String {
        m.tenant.clone()
    }

    fn idempotency_key(&self, m: &Profile) -> String {
        m.event_id.clone()
    }

    async fn handle(&self, m: Profile, ctx: &mut Context) -> Result<Value, HandlerError> {
        if m.fail {
            return Err(HandlerError::permanent("refused"));
        }
        if m.uncertain {
            return Err(HandlerError::uncertain(
                Some(format!("ref-{}", m.name)),
                "the provider timed out",
            ));
        }
        let follow_up = FollowUp::json("", self.to.as_str(), &json!({"name": m.name}))
            .map_err(HandlerError::permanent)?;
        ctx.publish(follow_up).await?;
        sqlx::query("INSERT INTO test_effects (event_id) VALUES ($1)")
            .bind(&m.event_id)
            .execute(ctx.tx().await?)
            .await?;
        Ok(json!({"name": m.name, "event_id": m.event_id}))
    }

    async fn reconcile(
        &self,
        _m: &Profile,
        _reference: Option<&str>,
        _ctx: &mut Context,
    ) -> Result<idem::Reconciliation<Value>, HandlerError> {
        Err(HandlerError::transient("still unknown"))
    }
}

/// The queue follow-ups go to, beside `q` (declared; deleted on drop).
async fn target(q: &TestQueue) -> TestQueue {
    let to = q.beside("to").await;
    to.declare_plain().await;
    to
}

fn keys(spec: &str) -> Option<Keys> {
    Some(Keys::parse(spec).unwrap())
}

fn profile(event_id: &str, tenant: &str, name: &str) -> Vec<u8> {
    json!({"event_id": event_id, "tenant": tenant, "name": name})
        .to_string()
        .into_bytes()
}

async fn setup(pool: &PgPool) {
    sqlx::query("CREATE TABLE IF NOT EXISTS test_effects (event_id text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

async fn effects(pool: &PgPool) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM test_effects GROUP BY event_id")
            .fetch_all(pool)
            .await
            .unwrap();
    rows.into_iter().collect()
}

async fn wait_for_status(pool: &PgPool, status: &str, n: i64) {
    wait_until(SETTLE, &format!("{n} records {status}"), || async {
        let found: i64 =
            sqlx::query_scalar("SELECT count(*) FROM processed_operations WHERE status = $1")
                .bind(status)
                .fetch_one(pool)
                .await
                .unwrap();
        found >= n
    })
    .await;
}

/// Every byte of a table's files (heap and TOAST), after a checkpoint.
async fn table_bytes(pool: &PgPool, table: &str) -> Vec<u8> {
    sqlx::query("CHECKPOINT").execute(pool).await.unwrap();
    let paths: Vec<String> = sqlx::query_scalar(
        "SELECT pg_relation_filepath(c.oid) FROM pg_class c
         WHERE c.oid = $1::regclass
            OR c.oid = (SELECT reltoastrelid FROM pg_class WHERE oid = $1::regclass)",
    )
    .bind(table)
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(paths.len(), 2, "{table} and its TOAST table");
    let mut bytes = Vec::new();
    for path in paths {
        let file: Vec<u8> = sqlx::query_scalar("SELECT pg_read_binary_file($1)")
            .bind(&path)
            .fetch_one(pool)
            .await
            .unwrap();
        bytes.extend(file);
    }
    bytes
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// A route that answers with the caller's name and writes an effect, on `store`.
async fn serve_profiles(store: Store) -> String {
    let layer = Idempotency::new(store, bearer_principal);
    let app = Router::new().route(
        "/profiles",
        post(|mut tx: Tx, body: String| async move {
            let v: Value = serde_json::from_str(&body).map_err(HandlerError::permanent)?;
            let name = v["name"].as_str().unwrap_or_default().to_owned();
            sqlx::query("INSERT INTO test_effects (event_id) VALUES ('http')")
                .execute(&mut *tx)
                .await?;
            Ok::<_, HandlerError>(format!("{{\"greeting\":\"hello {name}\"}}"))
        })
        .route_layer(layer.required()),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/profiles")
}

async fn post_profile(url: &str, key: &str, name: &str) -> (u16, Vec<u8>) {
    let response = reqwest::Client::new()
        .post(url)
        .bearer_auth("alice")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(json!({"name": name}).to_string())
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.bytes().await.unwrap().to_vec())
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn with_keys_a_marker_is_nowhere_in_the_table_files_and_replays_keep_the_bytes(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    setup(&pool).await;
    let q = TestQueue::new("seal").await;
    let to = target(&q).await;
    let config = StoreConfig {
        keys: keys(K1),
        ..StoreConfig::default()
    };
    let handler = Profiles {
        to: to.name.clone(),
    };
    let (stop, task) = start_in_process_with(&pool, &q, handler, config.clone(), |_| {}).await;
    q.publish(&profile("e1", "tenant-VISIBLE", MARKER)).await;
    let uncertain = json!({"event_id": "e2", "tenant": "tenant-VISIBLE", "name": MARKER,
                           "uncertain": true});
    q.publish(uncertain.to_string().as_bytes()).await;
    wait_for_status(&pool, "completed", 1).await;
    wait_for_status(&pool, "pending", 1).await;
    to.wait_for_messages(&to.name, 1, SETTLE).await;
    let sent = to.drain(&to.name).await;
    assert_eq!(
        body_json(&sent[0].delivery.data),
        json!({"name": MARKER}),
        "the follow-up's bytes"
    );

    let store = Store::new(pool.clone(), config.clone());
    let url = serve_profiles(store.clone()).await;
    let first = post_profile(&url, "h1", MARKER).await;
    let replay = post_profile(&url, "h1", MARKER).await;
    assert_eq!(first.0, 200);
    assert_eq!(replay, first, "the replay returns the exact bytes");
    assert!(contains(&first.1, MARKER));

    // The follow-up row is kept (dispatched) until gc: its body is in the table too.
    wait_until(SETTLE, "the follow-up marked dispatched", || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_messages WHERE dispatched_at IS NOT NULL",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        n == 1
    })
    .await;
    let records = table_bytes(&pool, "processed_operations").await;
    assert!(
        contains(&records, "tenant-VISIBLE"),
        "the check reads the rows"
    );
    assert!(
        !contains(&records, MARKER),
        "the marker in processed_operations' pages"
    );
    let outbox = table_bytes(&pool, "outbox_messages").await;
    assert!(
        contains(&outbox, "profiles.update"),
        "the check reads the outbox rows"
    );
    assert!(
        !contains(&outbox, MARKER),
        "the marker in outbox_messages' pages"
    );
    let raw: Vec<String> = sqlx::query_scalar(
        "SELECT concat(result::text, external_ref) FROM processed_operations
         UNION ALL SELECT encode(body, 'escape') FROM outbox_messages",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(raw.iter().all(|v| !v.contains(MARKER)), "{raw:?}");
    assert!(raw.iter().any(|v| v.contains("$idem_sealed")), "{raw:?}");

    // An operator with the keys reads the values; without them, sees them sealed.
    let url_db = database_url(&connect);
    let show = [
        "ops",
        "show",
        "--scope",
        "tenant-VISIBLE",
        "--operation",
        "profiles.update",
    ];
    let with_keys = idem_command(&url_db, &[&show[..], &["--key", "e2"]].concat())
        .env("IDEM_KEYS", K1)
        .output()
        .await
        .unwrap();
    let shown = String::from_utf8_lossy(&with_keys.stdout);
    assert!(shown.contains(&format!("ref-{MARKER}")), "{shown}");
    assert!(shown.contains("HMAC, key k1"), "{shown}");
    let without = idem_cli(&url_db, &[&show[..], &["--key", "e1"]].concat()).await;
    assert!(
        !without.contains(MARKER) && without.contains("$idem_sealed"),
        "{without}"
    );

    stop.cancel();
    task.await.unwrap().unwrap();
}

/// What each key holds now, from `idem keys status --json`.
async fn key_use(url: &str) -> BTreeMap<String, Value> {
    let out = idem_cli(url, &["keys", "status", "--json"]).await;
    let uses: Vec<Value> = serde_json::from_str(&out).unwrap();
    uses.into_iter()
        .map(|u| (u["key"].as_str().unwrap_or("-").to_owned(), u))
        .collect()
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn rotation_beside_a_live_worker_loses_nothing_and_ends_with_every_value_under_the_new_key(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    setup(&pool).await;
    let q = TestQueue::new("rotate").await;
    let to = target(&q).await;
    // Before encryption (plaintext), under k1, then under k2 while the rotation runs.
    let phases = [
        (None, 0..100),
        (keys(K1), 100..200),
        (keys(&format!("{K2},{K1}")), 200..500),
    ];
    let mut rotation = None;
    for (phase, (keys, events)) in phases.into_iter().enumerate() {
        let config = StoreConfig {
            keys,
            ..StoreConfig::default()
        };
        let handler = Profiles {
            to: to.name.clone(),
        };
        let (stop, task) = start_in_process_with(&pool, &q, handler, config, |_| {}).await;
        let last = events.end as i64;
        for i in events {
            q.publish(&profile(&format!("e{i}"), "t", &format!("name-{i}")))
                .await;
            if phase == 2 && i == 250 {
                // The rotation starts while the worker has 250 more to go.
                let mut command = idem_command(
                    &url,
                    &["keys", "rotate", "--batch", "40", "--pause-ms", "5"],
                );
                command.env("IDEM_KEYS", format!("{K2},{K1}"));
                rotation = Some(tokio::spawn(async move { command.output().await.unwrap() }));
            }
        }
        wait_for_status(&pool, "completed", last).await;
        stop.cancel();
        task.await.unwrap().unwrap();
    }
    let rotated = rotation.unwrap().await.unwrap();
    let said = String::from_utf8_lossy(&rotated.stdout).into_owned();
    assert!(
        rotated.status.success(),
        "{said} {}",
        String::from_utf8_lossy(&rotated.stderr)
    );
    assert!(said.contains("moved to key k2"), "{said}");
    if !said.contains("0 row(s) changed") {
        // A row a worker changed under the pass is left for the next one.
        let again = idem_command(&url, &["keys", "rotate"])
            .env("IDEM_KEYS", format!("{K2},{K1}"))
            .output()
            .await
            .unwrap();
        assert!(again.status.success());
    }

    let uses = key_use(&url).await;
    assert_eq!(uses["k2"]["results"], 500, "{uses:?}");
    assert_eq!(uses["k2"]["bodies"], 500, "{uses:?}");
    assert_eq!(uses["k1"]["results"], 0, "{uses:?}");
    assert_eq!(uses["k1"]["bodies"], 0, "{uses:?}");
    assert_eq!(uses["-"]["results"], 0, "no plaintext left: {uses:?}");
    assert_eq!(uses["-"]["bodies"], 0, "{uses:?}");
    // Fingerprints stay with the key (or none) that made them, until gc.
    assert_eq!(uses["-"]["fingerprints"], 100, "{uses:?}");
    assert_eq!(uses["k1"]["fingerprints"], 100, "{uses:?}");
    assert_eq!(uses["k2"]["fingerprints"], 300, "{uses:?}");

    // Nothing lost: every output opens to what its run returned, every follow-up went
    // out once with its body, every effect happened once.
    let store = Store::new(
        pool.clone(),
        StoreConfig {
            keys: keys(K2),
            ..StoreConfig::default()
        },
    );
    for i in 0..500 {
        let key = Key::new("t", "profiles.update", format!("e{i}")).unwrap();
        let record = store.get(&key).await.unwrap().unwrap();
        assert_eq!(
            record.result,
            Some(json!({"name": format!("name-{i}"), "event_id": format!("e{i}")}))
        );
    }
    to.wait_for_messages(&to.name, 500, SETTLE).await;
    let mut names: Vec<String> = to
        .drain(&to.name)
        .await
        .iter()
        .map(|m| {
            body_json(&m.delivery.data)["name"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 500);
    let done = effects(&pool).await;
    assert_eq!(done.len(), 500);
    assert!(done.values().all(|&n| n == 1), "{done:?}");

    // A redelivery of a message fingerprinted before encryption, and of one under k1,
    // is still recognised by a worker with k2 only: acked, not run, not a conflict.
    let handler = Profiles {
        to: to.name.clone(),
    };
    let config = StoreConfig {
        keys: keys(&format!("{K2},{K1}")),
        ..StoreConfig::default()
    };
    let (stop, task) =
        start_in_process_with(&pool, &q, handler, config, |c| c.concurrency = 1).await;
    for i in [5, 150] {
        q.publish(&profile(&format!("e{i}"), "t", &format!("name-{i}")))
            .await;
    }
    q.publish(&profile("e-last", "t", "last")).await;
    wait_for_status(&pool, "completed", 501).await;
    wait_until(SETTLE, "the queue drained", || async {
        q.counts(&q.name).await == (0, 1)
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(effects(&pool).await.values().sum::<i64>(), 501);
    assert_eq!(q.counts(&q.dlq()).await.0, 0, "no conflict dead-lettered");

    // k1 still made fingerprints: it is not retired yet.
    let retire = idem_command(&url, &["keys", "retire", "--id", "k1"])
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&retire.stderr);
    assert!(
        !retire.status.success() && said.contains("100 fingerprint(s)"),
        "{said}"
    );

    // Rotating to a key no worker has run with is refused: the workers could not open
    // what it would seal.
    let k3 = format!("k3:{}", "33".repeat(32));
    let refused = idem_command(&url, &["keys", "rotate"])
        .env("IDEM_KEYS", format!("{k3},{K2},{K1}"))
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("key k3 is not registered"),
        "{said}"
    );
    assert_eq!(key_use(&url).await["k2"]["results"], 501, "e-last too");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_wrong_or_missing_key_stops_with_one_line_and_writes_nothing(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    let registered = Store::new(
        pool.clone(),
        StoreConfig {
            keys: keys(K1),
            ..StoreConfig::default()
        },
    );
    registered.prepare().await.unwrap();
    let q = TestQueue::new("wrong-key").await;
    let wrong = format!("k1:{}", "33".repeat(32));
    for (env, says) in [
        (Some(wrong.as_str()), "key \"k1\" does not open"),
        (None, "key(s) k1, which IDEM_KEYS does not give"),
        (Some("k1:zz"), "key entry 1: the key is not 64 hex digits"),
    ] {
        let mut command = tokio::process::Command::new(orders_worker_path());
        command
            .args(["--queue", &q.name])
            .env("DATABASE_URL", &url)
            .env("AMQP_URL", amqp_url())
            .env("NO_COLOR", "1")
            .kill_on_drop(true);
        match env {
            Some(keys) => command.env("IDEM_KEYS", keys),
            None => command.env_remove("IDEM_KEYS"),
        };
        let out = tokio::time::timeout(SETTLE, command.output())
            .await
            .expect("the worker stops by itself")
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
        assert_eq!(errors.len(), 1, "one line: {stderr}");
        assert!(errors[0].contains(says), "{says:?} in {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            !stderr.contains(&"33".repeat(32)),
            "no key material: {stderr}"
        );
    }
    // A store with the wrong key claims nothing.
    let store = Store::new(
        pool.clone(),
        StoreConfig {
            keys: keys(&wrong),
            ..StoreConfig::default()
        },
    );
    let error = store.prepare().await.unwrap_err();
    assert!(error.to_string().contains("does not open"), "{error}");
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(records, 0);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn an_erased_subject_stays_recognised_redeliveries_are_acked_and_http_retries_get_410(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    setup(&pool).await;
    let q = TestQueue::new("erase").await;
    let to = target(&q).await;
    let config = StoreConfig {
        keys: keys(K1),
        ..StoreConfig::default()
    };
    let handler = Profiles {
        to: to.name.clone(),
    };
    let (stop, task) = start_in_process_with(&pool, &q, handler, config.clone(), |c| {
        c.concurrency = 1;
        c.prefetch = 1;
    })
    .await;
    for (event, tenant) in [("a1", "alice"), ("a2", "alice"), ("b1", "bob")] {
        q.publish(&profile(event, tenant, MARKER)).await;
    }
    for event in ["a3", "a4"] {
        let failing = json!({"event_id": event, "tenant": "alice", "name": MARKER, "fail": true});
        q.publish(failing.to_string().as_bytes()).await;
    }
    let failing = json!({"event_id": "b2", "tenant": "bob", "name": "b", "fail": true});
    q.publish(failing.to_string().as_bytes()).await;
    wait_for_status(&pool, "completed", 3).await;
    q.wait_for_messages(&q.dlq(), 3, SETTLE).await;
    to.wait_for_messages(&to.name, 3, SETTLE).await;
    wait_until(SETTLE, "follow-ups marked dispatched", || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_messages WHERE dispatched_at IS NOT NULL",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        n == 3
    })
    .await;

    let store = Store::new(pool.clone(), config);
    let http = serve_profiles(store.clone()).await;
    assert_eq!(post_profile(&http, "h1", MARKER).await.0, 200);

    let erased = store
        .erase("alice", None, "dpo@example", "GDPR-17")
        .await
        .unwrap();
    assert_eq!(
        (erased.records, erased.follow_ups, erased.skipped),
        (5, 2, 0)
    );
    let left: Vec<(String, bool, bool)> = sqlx::query_as(
        "SELECT idempotency_key, result IS NULL AND error IS NULL, erased_at IS NOT NULL
         FROM processed_operations WHERE scope = 'alice' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(left.len(), 5, "tombstones kept: {left:?}");
    assert!(
        left.iter().all(|(_, empty, erased)| *empty && *erased),
        "{left:?}"
    );
    let bob: Option<Value> = sqlx::query_scalar(
        "SELECT result FROM processed_operations WHERE scope = 'bob' AND idempotency_key = 'b1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(bob.is_some(), "another subject is untouched");
    let follow_ups: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(follow_ups, 1, "bob's follow-up stays");

    // Redelivered: acked at once, no second effect, nothing dead-lettered. A message
    // after them (one at a time) shows they were decided.
    q.publish(&profile("a1", "alice", MARKER)).await;
    q.publish(&profile("a2", "alice", MARKER)).await;
    q.publish(&profile("c1", "carol", "c")).await;
    wait_for_status(&pool, "completed", 5).await;
    wait_until(SETTLE, "the queue drained", || async {
        q.counts(&q.name).await == (0, 1)
    })
    .await;
    let done = effects(&pool).await;
    assert_eq!((done["a1"], done["a2"], done["c1"]), (1, 1, 1), "{done:?}");
    // A retried request: 410 problem+json, not run again.
    let (status, body) = post_profile(&http, "h1", MARKER).await;
    assert_eq!(status, 410);
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("idempotency-key-erased"),
        "{problem}"
    );
    assert_eq!(done["http"], 1);
    assert_eq!(effects(&pool).await["http"], 1);

    // A replayed dead letter of an erased record lands on its tombstone: acked, not run
    // (run, it would fail and be dead-lettered again).
    idem_cli(&url, &["dlq", "replay", "--queue", &q.name, "--key", "a4"]).await;
    q.publish(&profile("c2", "carol", "c")).await;
    wait_for_status(&pool, "completed", 6).await;
    wait_until(SETTLE, "the queue drained", || async {
        q.counts(&q.name).await == (0, 1)
    })
    .await;
    let (attempts, erased): (i32, bool) = sqlx::query_as(
        "SELECT attempts, result IS NULL AND error IS NULL AND erased_at IS NOT NULL
         FROM processed_operations WHERE idempotency_key = 'a4'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((attempts, erased), (1, true));

    // The audit, and the DLQ: alice's letter is discarded by scope, bob's stays.
    let audit = idem_cli(&url, &["ops", "erasures", "--json"]).await;
    let audit: Vec<Value> = serde_json::from_str(&audit).unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0]["erased_by"], "dpo@example");
    assert_eq!(audit[0]["note"], "GDPR-17");
    assert_eq!(audit[0]["records"], 5);
    idem_cli(
        &url,
        &["dlq", "discard", "--queue", &q.name, "--scope", "alice"],
    )
    .await;
    let letters = q.drain(&q.dlq()).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].scope.as_deref(), Some("bob"));
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// Sends an e-mail (a row), kept for a short time.
struct Emails;

impl Handler for Emails {
    type Message = Profile;
    type Output = Value;
    const OPERATION: &'static str = "emails.send";

    fn scope(&self, m: &Profile) -> String {
        m.tenant.clone()
    }

    fn idempotency_key(&self, m: &Profile) -> String {
        m.event_id.clone()
    }

    async fn handle(&self, m: Profile, _ctx: &mut Context) -> Result<Value, HandlerError> {
        Ok(json!({"to": m.name}))
    }
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn each_operation_keeps_its_records_for_its_own_retention_and_gc_collects_them(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    setup(&pool).await;
    let (orders, emails) = (
        TestQueue::new("keep-orders").await,
        TestQueue::new("keep-emails").await,
    );
    let to = target(&orders).await;
    const MONTH: Duration = Duration::from_secs(30 * 86_400);
    let handler = Profiles {
        to: to.name.clone(),
    };
    let (stop_a, task_a) =
        start_in_process_with(&pool, &orders, handler, StoreConfig::default(), |c| {
            c.retention = Some(MONTH)
        })
        .await;
    let (stop_b, task_b) =
        start_in_process_with(&pool, &emails, Emails, StoreConfig::default(), |c| {
            c.retention = Some(Duration::from_secs(2))
        })
        .await;
    for i in 0..20 {
        orders.publish(&profile(&format!("o{i}"), "t", "n")).await;
        emails.publish(&profile(&format!("m{i}"), "t", "n")).await;
    }
    wait_for_status(&pool, "completed", 40).await;
    let kept: Vec<(String, f64, f64)> = sqlx::query_as(
        "SELECT operation,
                min(extract(epoch FROM expires_at - completed_at))::float8,
                max(extract(epoch FROM expires_at - completed_at))::float8
         FROM processed_operations GROUP BY operation ORDER BY operation",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        kept,
        [
            ("emails.send".to_owned(), 2.0, 2.0),
            (
                "profiles.update".to_owned(),
                MONTH.as_secs_f64(),
                MONTH.as_secs_f64()
            )
        ]
    );
    let show = idem_cli(
        &url,
        &[
            "ops",
            "show",
            "--scope",
            "t",
            "--operation",
            "profiles.update",
            "--key",
            "o1",
        ],
    )
    .await;
    assert!(
        show.contains("retention         30d (operation_retention)"),
        "{show}"
    );
    assert!(show.contains("expires 30d after completion"), "{show}");

    wait_until(SETTLE, "the e-mails' records expired", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT max(expires_at) < now() FROM processed_operations WHERE operation = 'emails.send'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    })
    .await;
    idem_cli(&url, &["gc"]).await;
    let left: Vec<(String, i64)> = sqlx::query_as(
        "SELECT operation, count(*) FROM processed_operations GROUP BY operation ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(left, [("profiles.update".to_owned(), 20)]);
    stop_a.cancel();
    stop_b.cancel();
    task_a.await.unwrap().unwrap();
    task_b.await.unwrap().unwrap();
}
