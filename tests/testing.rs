//! The test kit (`idem::testing`) against the real Postgres and no broker: the example
//! handlers pass its idempotency check in both modes; handlers that are wrong in the
//! ways users get them wrong fail it, each naming the hazard that caught it.

#[allow(dead_code)]
#[path = "../examples/orders_worker.rs"]
mod orders_worker;

#[allow(dead_code)]
#[path = "../examples/notifications_worker.rs"]
mod notifications_worker;

use idem::testing::{CheckFailed, FakeProvider, Hazard, ProviderError, Settled, TestWorker};
use idem::{Batch, Context, Handler, HandlerError, Mode, Ordered, Outcome, Reconciliation};
use serde_json::{Value, json};
use sqlx::PgPool;

fn order(n: usize) -> Value {
    json!({"event_id": format!("evt-{n}"), "tenant": "acme", "order_id": n, "amount_cents": 1250, "sent_at": n})
}

/// An order's effects: its ledger rows, and the provider keys it was sent with beyond
/// the first (a provider deduplicates by key, so a second key is a second charge).
async fn order_effects(pool: PgPool, order: Value) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM example_ledger WHERE event_id = $1)
              + greatest((SELECT count(DISTINCT idempotency_key) FROM example_provider_calls
                          WHERE event_id = $1) - 1, 0)",
    )
    .bind(order["event_id"].as_str())
    .fetch_one(&pool)
    .await
    .unwrap()
}

fn other_amount(order: &Value) -> Value {
    let mut other = order.clone();
    other["amount_cents"] = json!(999);
    other
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn the_orders_handler_passes_in_both_modes(pool: PgPool) {
    orders_worker::create_example_tables(&pool).await.unwrap();
    for mode in [Mode::Leased, Mode::Transactional] {
        let orders = orders_worker::Orders {
            mode,
            ..Default::default()
        };
        let worker = match mode {
            Mode::Leased => TestWorker::new(orders, pool.clone()),
            _ => TestWorker::transactional(orders, pool.clone()),
        };
        // Each mode its own intents.
        let tenant = format!("{mode:?}");
        let message = |n| {
            let mut m = order(n);
            m["event_id"] = json!(format!("{tenant}-{n}"));
            m
        };
        let passed = worker
            .check()
            .other_payload(other_amount)
            .run(message, order_effects)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        assert_eq!(passed.passed.len(), 7, "{mode:?}: {passed:?}");
        assert_eq!(
            passed.skipped,
            [(Hazard::UncertainThenReconciled, "no FakeProvider given")]
        );
    }
}

/// Books in `wrong_ledger`: one at a time through the transaction, as it should, but
/// a batch through the pool, outside the batch's transaction.
struct BatchOutsideTheTransaction;

impl Handler for BatchOutsideTheTransaction {
    type Message = Value;
    type Output = ();
    const OPERATION: &'static str = "wrong.batch_outside_tx";
    fn scope(&self, _: &Value) -> String {
        "acme".into()
    }
    fn idempotency_key(&self, m: &Value) -> String {
        m["event_id"].as_str().unwrap_or_default().into()
    }
    async fn handle(&self, m: Value, ctx: &mut Context) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO wrong_ledger (event_id) VALUES ($1)")
            .bind(m["event_id"].as_str())
            .execute(ctx.tx().await?)
            .await?;
        Ok(())
    }
    async fn handle_batch(
        &self,
        batch: &mut Batch<Value>,
    ) -> Option<Vec<Result<(), HandlerError>>> {
        let pool = batch.context(0)?.pool().clone();
        let ids: Vec<String> = batch
            .messages()
            .iter()
            .map(|m| m["event_id"].as_str().unwrap_or_default().to_owned())
            .collect();
        let written =
            sqlx::query("INSERT INTO wrong_ledger (event_id) SELECT * FROM unnest($1::text[])")
                .bind(&ids)
                .execute(&pool)
                .await;
        Some(
            ids.iter()
                .map(|_| {
                    written
                        .as_ref()
                        .map(|_| ())
                        .map_err(HandlerError::transient)
                })
                .collect(),
        )
    }
}

/// The orders handler's batches (`orders_worker --batch`) pass the check; a batch
/// handler that writes outside the batch's transaction fails it.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn batch_handlers_are_checked_too(pool: PgPool) {
    orders_worker::create_example_tables(&pool).await.unwrap();
    let orders = orders_worker::Orders {
        mode: Mode::Transactional,
        batch: true,
        ..Default::default()
    };
    let passed = TestWorker::transactional(orders, pool.clone())
        .check()
        .other_payload(other_amount)
        .run(order, order_effects)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(passed.passed.len(), 7, "{passed:?}");

    sqlx::query("CREATE TABLE wrong_ledger (event_id text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let message = |n: usize| json!({"event_id": format!("e-{n}")});
    let failed = TestWorker::transactional(BatchOutsideTheTransaction, pool.clone())
        .check()
        .run(message, wrong_ledger)
        .await
        .unwrap_err();
    assert!(
        matches!(failed, CheckFailed::Effects { effects: 2, .. }),
        "{failed}"
    );
    assert!(
        failed.to_string().contains("writes outside ctx.tx()"),
        "{failed}"
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn the_notifications_handler_passes(pool: PgPool) {
    notifications_worker::create_notifications_table(&pool)
        .await
        .unwrap();
    let worker = TestWorker::new(notifications_worker::Notifications, pool.clone());
    let booked = |n: usize| {
        json!({"event_id": format!("n-{n}"), "order_event_id": format!("evt-{n}"),
               "tenant": "acme", "order_id": n.to_string(), "amount_cents": 1250})
    };
    let notifications = |pool: PgPool, m: Value| async move {
        sqlx::query_scalar("SELECT count(*) FROM example_notifications WHERE event_id = $1")
            .bind(m["event_id"].as_str())
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let passed = worker
        .check()
        .other_payload(other_amount)
        .run(booked, notifications)
        .await
        .unwrap();
    assert_eq!(passed.passed.len(), 7);
}

/// What a worker decides, told without a broker: executed with its output, a duplicate,
/// a conflict dead-lettered, a malformed body dead-lettered, and nothing lost.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn deliveries_are_decided_as_the_worker_decides_them(pool: PgPool) {
    orders_worker::create_example_tables(&pool).await.unwrap();
    let worker = TestWorker::new(orders_worker::Orders::default(), pool.clone());
    let first = worker.deliver(&order(1)).await.unwrap();
    assert_eq!(first.outcome, Outcome::Executed);
    assert_eq!(first.settled, Settled::Acked);
    assert_eq!(
        first.output(),
        Some(&json!({"order_id": "1", "booked_cents": 1250}))
    );
    let again = worker.deliver(&order(1)).await.unwrap();
    assert_eq!(again.outcome, Outcome::DuplicateCompleted);
    let conflict = worker.deliver(&other_amount(&order(1))).await.unwrap();
    assert_eq!(conflict.outcome, Outcome::Conflict);
    assert!(
        matches!(
            &conflict.settled,
            Settled::DeadLettered {
                reason: "fingerprint_conflict",
                ..
            }
        ),
        "{conflict:?}"
    );
    let malformed = worker.deliver_bytes(b"{\"event_id\": 1").await.unwrap();
    assert_eq!(malformed.outcome, Outcome::Malformed);
    assert!(malformed.record.is_none());
    let negative = worker
        .deliver(&json!({"event_id": "neg", "tenant": "acme", "order_id": 1, "amount_cents": -5}))
        .await
        .unwrap();
    assert_eq!(negative.outcome, Outcome::FailedPermanent);
    let record = negative.record.expect("the failed record");
    assert_eq!(
        record.dead_letters, 1,
        "pinned, as a worker's dead letter pins it"
    );
    // Replayed as `idem dlq replay` would: the failed one runs again (and fails again,
    // its cause not fixed), one replay counted; a completed one is only acked.
    let replayed = worker
        .replay(&json!({"event_id": "neg", "tenant": "acme", "order_id": 1, "amount_cents": -5}))
        .await
        .unwrap()
        .expect("a failed operation is run again");
    assert_eq!(replayed.outcome, Outcome::FailedPermanent);
    assert_eq!(replayed.record.expect("the record").replay_count, 1);
    assert!(worker.replay(&order(1)).await.unwrap().is_none());
    assert_eq!(order_effects(pool, order(1)).await, 1);
}

// Handlers wrong in the ways users get them wrong.

/// Books outside `ctx.tx()`, with no unique key: a crash before the record books twice.
struct OutsideTheTransaction;

impl Handler for OutsideTheTransaction {
    type Message = Value;
    type Output = ();
    const OPERATION: &'static str = "wrong.outside_tx";
    fn scope(&self, _: &Value) -> String {
        "acme".into()
    }
    fn idempotency_key(&self, m: &Value) -> String {
        m["event_id"].as_str().unwrap_or_default().into()
    }
    async fn handle(&self, m: Value, ctx: &mut Context) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO wrong_ledger (event_id) VALUES ($1)")
            .bind(m["event_id"].as_str())
            .execute(ctx.pool())
            .await?;
        Ok(())
    }
}

/// Charges the provider with a fresh key on every run.
struct FreshKeys(FakeProvider);

/// Charges with `ctx.provider_key()` and reports a timeout as uncertain, but its
/// reconcile answers "not applied" without asking, and charges again.
struct IgnoresReconcile(FakeProvider);

/// The same, with a reconcile that asks the provider: correct.
struct Reconciles(FakeProvider);

async fn charge(
    provider: &FakeProvider,
    key: Option<String>,
    m: &Value,
) -> Result<String, HandlerError> {
    match provider.call(key.as_deref(), m.clone()).await {
        Ok(receipt) => Ok(receipt.id),
        Err(ProviderError::TimedOut) => Err(HandlerError::uncertain(None, "provider timed out")),
        Err(other) => Err(HandlerError::transient(other)),
    }
}

macro_rules! provider_handler {
    ($name:ident, $operation:literal, $key:expr, $reconcile:expr) => {
        impl Handler for $name {
            type Message = Value;
            type Output = String;
            const OPERATION: &'static str = $operation;
            fn scope(&self, _: &Value) -> String {
                "acme".into()
            }
            fn idempotency_key(&self, m: &Value) -> String {
                m["event_id"].as_str().unwrap_or_default().into()
            }
            async fn handle(&self, m: Value, ctx: &mut Context) -> Result<String, HandlerError> {
                let key: fn(&Context) -> Option<String> = $key;
                charge(&self.0, key(ctx), &m).await
            }
            async fn reconcile(
                &self,
                _: &Value,
                _: Option<&str>,
                ctx: &mut Context,
            ) -> Result<Reconciliation<String>, HandlerError> {
                let reconcile: fn(&FakeProvider, &Context) -> Reconciliation<String> = $reconcile;
                Ok(reconcile(&self.0, ctx))
            }
        }
    };
}

provider_handler!(
    FreshKeys,
    "wrong.fresh_keys",
    |_| Some(uuid::Uuid::new_v4().to_string()),
    |_, _| Reconciliation::NotApplied
);
provider_handler!(
    IgnoresReconcile,
    "wrong.ignores_reconcile",
    |ctx| Some(ctx.provider_key()),
    |_, _| Reconciliation::NotApplied
);
provider_handler!(
    Reconciles,
    "right.reconciles",
    |ctx| Some(ctx.provider_key()),
    |provider, ctx| match provider.find(&ctx.provider_key()) {
        Some(receipt) => Reconciliation::Applied(receipt.id),
        None => Reconciliation::NotApplied,
    }
);

/// Leaves the amount out of the fingerprint: another amount passes as a duplicate.
struct AmountIsVolatile;

impl Handler for AmountIsVolatile {
    type Message = Value;
    type Output = ();
    const OPERATION: &'static str = "wrong.volatile_amount";
    fn scope(&self, _: &Value) -> String {
        "acme".into()
    }
    fn idempotency_key(&self, m: &Value) -> String {
        m["event_id"].as_str().unwrap_or_default().into()
    }
    fn volatile_fields(&self) -> &'static [&'static str] {
        &["amount_cents"]
    }
    async fn handle(&self, m: Value, ctx: &mut Context) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO wrong_ledger (event_id) VALUES ($1)")
            .bind(m["event_id"].as_str())
            .execute(ctx.tx().await?)
            .await?;
        Ok(())
    }
}

async fn wrong_ledger(pool: PgPool, m: Value) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM wrong_ledger WHERE event_id = $1")
        .bind(m["event_id"].as_str())
        .fetch_one(&pool)
        .await
        .unwrap()
}

fn charged(provider: &FakeProvider) -> impl Fn(PgPool, Value) -> std::future::Ready<i64> {
    let provider = provider.clone();
    move |_, m| std::future::ready(provider.effects(|r| r["event_id"] == m["event_id"]))
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn wrong_handlers_fail_naming_the_hazard(pool: PgPool) {
    sqlx::query("CREATE TABLE wrong_ledger (event_id text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let message = |n: usize| json!({"event_id": format!("e-{n}"), "amount_cents": 100});

    for mode in [Mode::Leased, Mode::Transactional] {
        let worker = match mode {
            Mode::Leased => TestWorker::new(OutsideTheTransaction, pool.clone()),
            _ => TestWorker::transactional(OutsideTheTransaction, pool.clone()),
        };
        sqlx::query("TRUNCATE wrong_ledger, processed_operations")
            .execute(&pool)
            .await
            .unwrap();
        let failed = worker.check().run(message, wrong_ledger).await.unwrap_err();
        // Leased: only one copy runs, and the crash shows the write. Transactional:
        // racing copies each run the handler, all but one roll back, and the write
        // outside the transaction shows at once.
        let (caught_at, says) = match mode {
            Mode::Leased => (Hazard::CrashBeforeRecord, "after a crash before the record"),
            _ => (
                Hazard::Concurrent,
                "after copies of the message delivered at once",
            ),
        };
        assert!(
            matches!(
                failed,
                CheckFailed::Effects { hazard, effects: 2, .. } if hazard == caught_at
            ),
            "{mode:?}: {failed}"
        );
        assert!(
            failed.to_string().contains(says)
                && failed.to_string().contains("writes outside ctx.tx()"),
            "{failed}"
        );
    }

    let provider = FakeProvider::new();
    let worker = TestWorker::new(FreshKeys(provider.clone()), pool.clone());
    let failed = worker
        .check()
        .provider(&provider)
        .run(message, charged(&provider))
        .await
        .unwrap_err();
    assert!(
        matches!(
            failed,
            CheckFailed::Effects {
                hazard: Hazard::CrashBeforeRecord,
                effects: 2,
                ..
            }
        ),
        "{failed}"
    );

    let provider = FakeProvider::new();
    let worker = TestWorker::new(IgnoresReconcile(provider.clone()), pool.clone());
    let failed = worker
        .check()
        .provider(&provider)
        .run(message, charged(&provider))
        .await
        .unwrap_err();
    assert!(
        matches!(
            failed,
            CheckFailed::Decided {
                hazard: Hazard::UncertainThenReconciled,
                ..
            }
        ),
        "{failed}"
    );
    assert!(failed.to_string().contains("ran again"), "{failed}");

    let provider = FakeProvider::new();
    let worker = TestWorker::new(Reconciles(provider.clone()), pool.clone());
    let passed = worker
        .check()
        .provider(&provider)
        .run(message, charged(&provider))
        .await
        .unwrap();
    assert!(
        passed.passed.contains(&Hazard::UncertainThenReconciled),
        "{passed:?}"
    );

    sqlx::query("TRUNCATE wrong_ledger")
        .execute(&pool)
        .await
        .unwrap();
    let worker = TestWorker::new(AmountIsVolatile, pool.clone());
    let failed = worker
        .check()
        .other_payload(|m| {
            let mut other = m.clone();
            other["amount_cents"] = json!(1);
            other
        })
        .run(message, wrong_ledger)
        .await
        .unwrap_err();
    assert!(
        matches!(
            failed,
            CheckFailed::Decided {
                hazard: Hazard::OtherPayload,
                ..
            }
        ),
        "{failed}"
    );
    assert!(
        failed.to_string().contains("duplicate_completed"),
        "{failed}"
    );
}

/// Answers the message's type and a header, as its context tells them.
struct TypeEcho;

impl Handler for TypeEcho {
    type Message = Value;
    type Output = Value;
    const OPERATION: &'static str = "echo.type";
    fn scope(&self, _: &Value) -> String {
        "acme".into()
    }
    fn idempotency_key(&self, m: &Value) -> String {
        m["event_id"].as_str().unwrap_or_default().into()
    }
    async fn handle(&self, _: Value, ctx: &mut Context) -> Result<Value, HandlerError> {
        let envelope = ctx.envelope();
        Ok(json!([
            envelope.message_type(),
            envelope.header("source"),
            envelope.routing_key
        ]))
    }
}

/// The producer's properties reach the handler through the kit, in a transactional
/// batch too.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn the_handler_sees_the_properties_given(pool: PgPool) {
    use lapin::BasicProperties;
    use lapin::types::{AMQPValue, FieldTable};
    let mut headers = FieldTable::default();
    headers.insert("source".into(), AMQPValue::LongString("shop".into()));
    let properties = BasicProperties::default()
        .with_type("order.created".into())
        .with_headers(headers);
    for (n, worker) in [
        TestWorker::new(TypeEcho, pool.clone()),
        TestWorker::transactional(TypeEcho, pool.clone()),
    ]
    .into_iter()
    .enumerate()
    {
        let body = json!({"event_id": format!("t-{n}")}).to_string();
        let delivered = worker
            .deliver_with(body.as_bytes(), &properties)
            .await
            .unwrap();
        assert_eq!(
            delivered.output(),
            Some(&json!(["order.created", "shop", "idem-testing"])),
            "{:?}",
            worker.mode()
        );
    }
}

/// Applies an account's entries, each version after the one before it.
struct Entries;

impl Handler for Entries {
    type Message = Value;
    type Output = ();
    const OPERATION: &'static str = "kit.entries";
    fn scope(&self, _: &Value) -> String {
        "acme".into()
    }
    fn idempotency_key(&self, m: &Value) -> String {
        format!(
            "{}:{}",
            m["account"].as_str().unwrap_or_default(),
            m["version"]
        )
    }
    fn ordering(&self, m: &Value) -> Option<Ordered> {
        let account = m["account"].as_str().unwrap_or_default();
        Some(Ordered::by(account).sequence(m["version"].as_i64().unwrap_or_default()))
    }
    async fn handle(&self, m: Value, ctx: &mut Context) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO kit_entries (account, version) VALUES ($1, $2)")
            .bind(m["account"].as_str())
            .bind(m["version"].as_i64())
            .execute(ctx.tx().await?)
            .await?;
        Ok(())
    }
}

/// An ordered handler in the kit: entries that come before their turn wait, and when
/// the one before them completes they are handed the turn and run, in order, as a
/// worker runs them; a copy of a completed entry is acked at once. Both modes.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn entries_that_wait_for_their_turn_run_when_it_comes_in_both_modes(pool: PgPool) {
    sqlx::query(
        "CREATE TABLE kit_entries (id bigserial, account text NOT NULL, version bigint NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let entry = |account: &str, version: i64| json!({"account": account, "version": version});
    for (worker, account) in [
        (TestWorker::new(Entries, pool.clone()), "leased"),
        (
            TestWorker::transactional(Entries, pool.clone()),
            "transactional",
        ),
    ] {
        for version in [4, 2, 3] {
            let early = worker.deliver(&entry(account, version)).await.unwrap();
            assert_eq!(
                (early.outcome, &early.settled),
                (Outcome::Waiting, &Settled::Acked),
                "{account} v{version}"
            );
            assert!(early.record.is_none() && early.then.is_empty());
        }
        let first = worker.deliver(&entry(account, 1)).await.unwrap();
        assert_eq!(first.outcome, Outcome::Executed, "{account}");
        let handed: Vec<Outcome> = first.then.iter().map(|d| d.outcome).collect();
        assert_eq!(handed, [Outcome::Executed; 3], "{account}");
        assert!(first.then.iter().all(|d| d.settled == Settled::Acked));
        let applied: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM kit_entries WHERE account = $1 ORDER BY id")
                .bind(account)
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(applied, [1, 2, 3, 4], "{account}");
        let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM ordering_waiting")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(waiting, 0, "{account}: every waiting row went with its run");
        let again = worker.deliver(&entry(account, 3)).await.unwrap();
        assert_eq!(again.outcome, Outcome::DuplicateCompleted, "{account}");
        assert!(again.then.is_empty());
    }
}
