//! A single-commit request whose transaction claimed the key's record (a key with a
//! record, or one another request held): its answer is stored under the record's
//! lease, completed or `pending`, and committed with the route's writes (or without
//! them, rolled back to the savepoint).

use axum::response::Response;
use sqlx::{Postgres, Transaction};
use tracing::warn;

use super::Single;
use crate::http::decision::Verdict;
use crate::http::record::{
    answered, rollback, store_unavailable, stored_answer, taken_over, too_large,
};
use crate::http::tx::ROLLBACK_TO_SAVEPOINT;
use crate::store::{Lease, StoreError, StoredError};

impl Single {
    /// Records the answer of a request that claimed a record in its transaction:
    /// completed or `pending` under its lease, the route's writes rolled back to the
    /// savepoint where the answer goes without them.
    pub(super) async fn record_claimed(
        &self,
        lease: &Lease,
        mut tx: Transaction<'static, Postgres>,
        savepoint: bool,
        verdict: Verdict,
        response: Response,
    ) -> Response {
        let label = &self.keyed.label;
        if matches!(
            verdict,
            Verdict::StoreWithoutWrites | Verdict::Pending { .. }
        ) && savepoint
            && let Err(error) = sqlx::raw_sql(ROLLBACK_TO_SAVEPOINT).execute(&mut *tx).await
        {
            rollback(tx).await;
            let error = StoreError::from(error);
            return store_unavailable(label, "cannot roll the route's writes back", &error);
        }
        match verdict {
            Verdict::Pending {
                external_ref,
                error,
            } => {
                self.pending(lease, tx, response, external_ref, &error)
                    .await
            }
            _ => self.complete(lease, tx, response).await,
        }
    }

    /// Stores the answer under the claimed record's lease and commits it.
    async fn complete(
        &self,
        lease: &Lease,
        mut tx: Transaction<'static, Postgres>,
        response: Response,
    ) -> Response {
        let (shared, label) = (&self.shared, &self.keyed.label);
        let (parts, bytes, stored) = match stored_answer(shared, response).await {
            Ok(answer) => answer,
            Err(detail) => {
                rollback(tx).await;
                return too_large(label, &detail);
            }
        };
        if let Err(error) = shared.store.complete_in(&mut *tx, lease, &stored).await {
            rollback(tx).await;
            return match error {
                StoreError::LeaseLost { .. } => taken_over(label),
                error => store_unavailable(label, "cannot record the answer", &error),
            };
        }
        self.commit(tx, parts, bytes).await
    }

    /// Records an uncertain outcome under the claimed record's lease (the route's
    /// writes rolled back to the savepoint) and commits it; the route's answer (502)
    /// either way.
    async fn pending(
        &self,
        lease: &Lease,
        mut tx: Transaction<'static, Postgres>,
        response: Response,
        external_ref: Option<String>,
        error: &str,
    ) -> Response {
        let stored = StoredError {
            kind: "uncertain",
            error,
        }
        .to_json();
        let store = &self.shared.store;
        let marked = store
            .mark_pending_in(&mut *tx, lease, external_ref.as_deref(), &stored)
            .await;
        let committed = match marked {
            Ok(()) => tx.commit().await.map_err(StoreError::from),
            Err(error) => {
                rollback(tx).await;
                Err(error)
            }
        };
        if let Err(e) = committed {
            // Nothing is stored: a retry runs the route again.
            warn!(error = %e.describe(), "cannot record an uncertain outcome");
        }
        answered(&self.keyed.label, "uncertain", response)
    }
}
