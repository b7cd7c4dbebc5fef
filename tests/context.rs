//! A handler called in a user's own test, with no worker and no broker: a `Context`
//! built for it, the handler's writes in its transaction, committed or dropped by the
//! test (against the real Postgres).

use idem::{Context, FollowUp, Handler, HandlerError, Key, ResultExt};
use sqlx::PgPool;

struct Book;

impl Handler for Book {
    type Message = serde_json::Value;
    type Output = serde_json::Value;
    const OPERATION: &'static str = "ledger.book";

    fn scope(&self, _: &serde_json::Value) -> String {
        "acme".into()
    }

    fn idempotency_key(&self, m: &serde_json::Value) -> String {
        m["event_id"].as_str().unwrap_or_default().into()
    }

    async fn handle(
        &self,
        m: serde_json::Value,
        ctx: &mut Context,
    ) -> Result<serde_json::Value, HandlerError> {
        sqlx::query("INSERT INTO test_ledger (event_id, attempt, takeover) VALUES ($1, $2, $3)")
            .bind(m["event_id"].as_str())
            .bind(ctx.attempt())
            .bind(ctx.is_takeover())
            .execute(ctx.tx().await?)
            .await?;
        let id = ctx
            .publish(
                FollowUp::json("", "booked", &serde_json::json!({"booked": true})).permanent()?,
            )
            .await?;
        Ok(serde_json::json!({"follow_up": id}))
    }
}

async fn counts(pool: &PgPool) -> (i64, i64) {
    let ledger = sqlx::query_scalar("SELECT count(*) FROM test_ledger")
        .fetch_one(pool)
        .await
        .unwrap();
    let outbox = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
        .fetch_one(pool)
        .await
        .unwrap();
    (ledger, outbox)
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_handler_runs_in_a_test_and_its_writes_wait_for_the_test(pool: PgPool) {
    sqlx::query("CREATE TABLE test_ledger (event_id text, attempt int, takeover bool)")
        .execute(&pool)
        .await
        .unwrap();
    let message = serde_json::json!({"event_id": "evt-1"});
    let key = Key::new(
        Book.scope(&message),
        Book::OPERATION,
        Book.idempotency_key(&message),
    )
    .unwrap();

    // Dropped: nothing the handler wrote stays.
    let mut ctx = Context::for_test(key.clone(), pool.clone());
    let follow_up = ctx.next_message_id();
    let out = Book.handle(message.clone(), &mut ctx).await.unwrap();
    assert_eq!(out["follow_up"], follow_up.as_str());
    drop(ctx.into_transaction());
    assert_eq!(counts(&pool).await, (0, 0));

    // Committed, as a takeover's third run: the row and its follow-up, both.
    let mut ctx = Context::for_test(key, pool.clone()).retried(3, true);
    Book.handle(message, &mut ctx).await.unwrap();
    ctx.into_transaction()
        .expect("the handler wrote through ctx.tx()")
        .commit()
        .await
        .unwrap();
    assert_eq!(counts(&pool).await, (1, 1));
    let (attempt, takeover): (i32, bool) =
        sqlx::query_as("SELECT attempt, takeover FROM test_ledger")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((attempt, takeover), (3, true));
}
