//! The leadership of garbage collection: one process at a time collects, the one that
//! holds the session advisory lock [`GC_LOCK`]; the others skip their round.

use std::time::Duration;

use sqlx::{ConnectOptions, Connection, PgConnection};

use crate::store::{Store, StoreError};

/// The advisory lock whose holder is the one process collecting garbage ("idem gc" in
/// ASCII).
pub const GC_LOCK: i64 = 0x0069_6465_6d20_6763;

/// The leadership of garbage collection: while held, no other process's gc runs. Give it
/// back with [`GcLeader::release`]; dropped without that, its connection is closed, and
/// the lock with it.
#[derive(Debug)]
pub(crate) struct GcLeader {
    conn: Option<PgConnection>,
}

impl GcLeader {
    /// Unlocks and closes the connection.
    pub(crate) async fn release(mut self) -> Result<(), StoreError> {
        if let Some(mut conn) = self.conn.take() {
            let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(GC_LOCK)
                .execute(&mut conn)
                .await;
            // Closing the session would end the lock too; the unlock says so at once.
            let _ = conn.close().await;
            unlocked?;
        }
        Ok(())
    }
}

impl Store {
    /// Takes the leadership of garbage collection if no other process holds it: a
    /// session advisory lock ([`GC_LOCK`]) on a connection of its own, opened for the
    /// round where [`StoreConfig::session`](crate::StoreConfig::session) says (through
    /// a transaction pooler, the lock and its unlock could land on two server
    /// connections). The lock ends with that session, so a leader that dies frees it at
    /// once.
    pub(crate) async fn try_lead_gc(&self) -> Result<Option<GcLeader>, StoreError> {
        let options = self.session_options();
        let name = format!("{} gc", options.get_application_name().unwrap_or("idem"));
        // As long as an acquire from the pool may wait.
        let options = options.application_name(&name);
        let mut conn = tokio::time::timeout(Duration::from_secs(10), options.connect())
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut))?;
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(GC_LOCK)
            .fetch_one(&mut conn)
            .await?;
        if !got {
            let _ = conn.close().await;
            return Ok(None);
        }
        Ok(Some(GcLeader { conn: Some(conn) }))
    }
}
