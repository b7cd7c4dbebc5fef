//! The user's test: the signup handler, with a fake mail API, through every hazard.

use idem::testing::{FakeProvider, ProviderError, TestWorker};
use kit_user::{Mailer, Signups};
use serde_json::{Value, json};
use sqlx::PgPool;

struct FakeMailer(FakeProvider);

impl Mailer for FakeMailer {
    async fn send(&self, key: &str, to: &str) -> Result<bool, String> {
        match self.0.call(Some(key), json!({ "to": to })).await {
            Ok(_) => Ok(true),
            Err(ProviderError::TimedOut) => Ok(false),
            Err(e) => Err(e.to_string()),
        }
    }
    async fn sent(&self, key: &str) -> bool {
        self.0.find(key).is_some()
    }
}

fn signup(n: usize) -> Value {
    json!({"signup_id": format!("s-{n}"), "tenant": "acme", "email": format!("u{n}@example.org")})
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_signup_is_one_account_and_one_mail(pool: PgPool) {
    sqlx::query("CREATE TABLE accounts (signup_id text NOT NULL, email text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let mails = FakeProvider::new();
    let worker = TestWorker::new(
        Signups {
            mailer: FakeMailer(mails.clone()),
        },
        pool,
    );
    let passed = worker
        .check()
        .provider(&mails)
        .other_payload(
            |s| json!({"signup_id": s["signup_id"], "tenant": "acme", "email": "x@example.org"}),
        )
        .run(signup, |pool, s| {
            let mails = mails.clone();
            async move {
                let accounts: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM accounts WHERE signup_id = $1")
                        .bind(s["signup_id"].as_str())
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                let sent = mails.effects(|mail| mail["to"] == s["email"]);
                if accounts == sent {
                    accounts
                } else {
                    accounts.max(sent) + 1
                }
            }
        })
        .await
        .unwrap_or_else(|failed| panic!("{failed}"));
    assert!(passed.skipped.is_empty(), "{passed:?}");
}
