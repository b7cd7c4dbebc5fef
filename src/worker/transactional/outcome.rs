//! Writing what a transactional batch came to: new records with their outcome, the
//! fenced outcome of records taken over, and the answer each delivery gets.

use super::{RunResult, TxAnswer, TxRequest};
use crate::handler::HandlerError;
use crate::store::{
    Claim, ClaimRequest, Found, Lease, NewRecord, Status, Store, StoreError, StoredError,
};
use crate::worker::decision::Ran;
use tracing::warn;

/// Records, in a transaction of its own, that the outcome of `request` could not be
/// stored: its record fails for good (its handler's writes rolled back with the batch).
pub(super) async fn refused(
    store: &Store,
    request: &TxRequest,
    error: &StoreError,
) -> Result<TxAnswer, StoreError> {
    let why = format!("the result could not be stored: {}", error.describe());
    let failed = HandlerError::Permanent(why);
    let mut tx = store.pool().begin().await?;
    let claims = std::slice::from_ref(&request.claim);
    let found = store.find_in(&mut tx, claims).await?.pop();
    let answer = match found {
        Some(Found::New) => {
            let record = failed_record(&request.claim, &failed);
            match store.insert_in(&mut tx, &[record]).await?.pop().flatten() {
                Some((id, token)) => answer_of(first_lease(id, token), RunResult::Failed(failed)),
                None => TxAnswer::Found(Claim::InProgress {
                    lease_expires_at: None,
                }),
            }
        }
        Some(Found::Record(Claim::Claimed(lease) | Claim::Pending { lease, .. })) => {
            match write_taken(store, &mut tx, &lease, RunResult::Failed(failed)).await? {
                Some(answer) => answer,
                None => TxAnswer::Found(Claim::InProgress {
                    lease_expires_at: None,
                }),
            }
        }
        Some(Found::Record(other)) => TxAnswer::Found(other),
        Some(Found::Stale) | None => TxAnswer::Found(Claim::InProgress {
            lease_expires_at: None,
        }),
    };
    tx.commit().await?;
    Ok(answer)
}

/// The record of a key that had none, with the run's outcome; none for a body that no
/// longer fits the message (nothing ran). An uncertain outcome in this mode is a misuse
/// (every effect is in this transaction, and a failed run's writes were rolled back):
/// it is kept `pending` all the same, so that `reconcile` decides, as in leased mode.
pub(super) fn new_record<'a>(
    request: &'a ClaimRequest,
    result: &RunResult,
) -> Option<NewRecord<'a>> {
    match result {
        RunResult::Done { output, .. } => Some(NewRecord {
            request,
            status: Status::Completed,
            retryable: false,
            result: Some(output.clone()),
            error: None,
            external_ref: None,
        }),
        RunResult::Failed(error) => Some(failed_record(request, error)),
        RunResult::Refused(_) => None,
    }
}

/// The record of a key that had none, with a failure: `failed` (retryable when
/// transient) or, for an uncertain outcome, `pending` with its external reference.
fn failed_record<'a>(request: &'a ClaimRequest, error: &HandlerError) -> NewRecord<'a> {
    let (kind, external_ref) = failure_kind(error);
    NewRecord {
        request,
        status: if kind == "uncertain" {
            Status::Pending
        } else {
            Status::Failed
        },
        retryable: kind == "transient",
        result: None,
        error: Some(
            StoredError {
                kind,
                error: error.message(),
            }
            .to_json(),
        ),
        external_ref,
    }
}

/// The kind a failure is stored with, and the provider's reference of an uncertain one.
fn failure_kind(error: &HandlerError) -> (&'static str, Option<String>) {
    let external_ref = match error {
        HandlerError::Uncertain { external_ref, .. } => {
            warn!(
                "uncertain outcome in transactional mode: its writes were rolled back; \
                 external calls do not belong in a transactional handler"
            );
            external_ref.clone()
        }
        _ => None,
    };
    (error.kind(), external_ref)
}

/// Writes the outcome of a record taken over in the batch (its row is locked by the
/// batch since the take). `None` if the fence refused it, which the lock rules out.
pub(super) async fn write_taken(
    store: &Store,
    conn: &mut sqlx::PgConnection,
    lease: &Lease,
    result: RunResult,
) -> Result<Option<TxAnswer>, StoreError> {
    let written = match &result {
        RunResult::Done { output, .. } => store.complete_in(&mut *conn, lease, output).await,
        RunResult::Failed(error) => {
            let (kind, external_ref) = failure_kind(error);
            let stored = StoredError {
                kind,
                error: error.message(),
            }
            .to_json();
            match kind {
                "uncertain" => {
                    let external_ref = external_ref.as_deref();
                    store
                        .mark_pending_in(&mut *conn, lease, external_ref, &stored)
                        .await
                }
                _ => {
                    let retryable = kind == "transient";
                    store
                        .fail_in(&mut *conn, lease, retryable, &stored, false)
                        .await
                }
            }
        }
        RunResult::Refused(why) => {
            let stored = StoredError {
                kind: "permanent",
                error: why,
            }
            .to_json();
            store
                .fail_in(&mut *conn, lease, false, &stored, false)
                .await
        }
    };
    match written {
        Ok(()) => Ok(Some(answer_of(lease.clone(), result))),
        Err(StoreError::LeaseLost { .. }) => Ok(None),
        Err(error) => Err(error),
    }
}

/// The lease a new record was written with: its first claim, held only by the batch
/// that wrote it (no expiry to keep: the record carries its outcome already).
pub(super) fn first_lease(id: i64, token: i64) -> Lease {
    Lease {
        id,
        token,
        attempt: 1,
        takeover: false,
        expires_at: chrono::Utc::now(),
    }
}

/// The answer for a run whose outcome was written on the record of `lease`.
pub(super) fn answer_of(lease: Lease, result: RunResult) -> TxAnswer {
    match result {
        RunResult::Done {
            reconciled,
            follow_ups,
            ..
        } => TxAnswer::Ran(
            Ran::Completed {
                reconciled,
                handed: None,
                chained: None,
            },
            follow_ups,
        ),
        RunResult::Refused(why) => TxAnswer::Refused(why),
        RunResult::Failed(HandlerError::Transient(error)) => {
            TxAnswer::Ran(Ran::Transient { lease, error }, Vec::new())
        }
        RunResult::Failed(HandlerError::Permanent(error)) => {
            TxAnswer::Ran(Ran::Permanent { lease, error }, Vec::new())
        }
        RunResult::Failed(HandlerError::Uncertain { .. }) => {
            TxAnswer::Ran(Ran::Pending { lease }, Vec::new())
        }
    }
}
