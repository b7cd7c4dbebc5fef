//! A user's job type: a signup that writes its account row and sends a welcome mail.

use idem::{Context, Handler, HandlerError, Reconciliation};
use serde::Deserialize;

#[derive(Deserialize)]
pub struct Signup {
    pub signup_id: String,
    pub tenant: String,
    pub email: String,
}

/// Where welcome mails go: a real mail API in production, a fake in tests.
pub trait Mailer: Send + Sync {
    /// Sends, with an idempotency key; `Ok(false)` when the answer was lost (the mail
    /// may have gone).
    fn send(&self, key: &str, to: &str) -> impl Future<Output = Result<bool, String>> + Send;
    /// Whether a mail was sent under this key.
    fn sent(&self, key: &str) -> impl Future<Output = bool> + Send;
}

pub struct Signups<M> {
    pub mailer: M,
}

impl<M: Mailer + 'static> Handler for Signups<M> {
    type Message = Signup;
    type Output = ();
    const OPERATION: &'static str = "signups.create";

    fn scope(&self, s: &Signup) -> String {
        s.tenant.clone()
    }

    fn idempotency_key(&self, s: &Signup) -> String {
        s.signup_id.clone()
    }

    async fn handle(&self, s: Signup, ctx: &mut Context) -> Result<(), HandlerError> {
        match self.mailer.send(&ctx.provider_key(), &s.email).await {
            Ok(true) => {}
            Ok(false) => return Err(HandlerError::uncertain(None, "mail API timed out")),
            Err(e) => return Err(HandlerError::transient(e)),
        }
        sqlx::query("INSERT INTO accounts (signup_id, email) VALUES ($1, $2)")
            .bind(&s.signup_id)
            .bind(&s.email)
            .execute(ctx.tx().await?)
            .await?;
        Ok(())
    }

    async fn reconcile(
        &self,
        s: &Signup,
        _: Option<&str>,
        ctx: &mut Context,
    ) -> Result<Reconciliation<()>, HandlerError> {
        if !self.mailer.sent(&ctx.provider_key()).await {
            return Ok(Reconciliation::NotApplied);
        }
        sqlx::query("INSERT INTO accounts (signup_id, email) VALUES ($1, $2)")
            .bind(&s.signup_id)
            .bind(&s.email)
            .execute(ctx.tx().await?)
            .await?;
        Ok(Reconciliation::Applied(()))
    }
}
