//! What the store holds and answers: a record's status, the record itself, the lease a
//! claim grants, and what a claim found.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgTypeInfo, PgValueRef};
use sqlx::{Decode, Encode, Postgres, Type};

use crate::fingerprint::Fingerprint;
use crate::key::Key;

/// A record's status (docs/DESIGN.md, "The record"), stored as text in `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// A worker holds a lease and runs the handler.
    Processing,
    /// The handler succeeded; `result` is stored for replay.
    Completed,
    /// The handler failed; `retryable` says whether a later delivery may run it again.
    Failed,
    /// The external outcome is uncertain; reconcile with `external_ref`, never re-run blindly.
    Pending,
}

impl Status {
    /// Every status, in the order a record usually goes through them.
    pub const ALL: [Status; 4] = [
        Status::Processing,
        Status::Pending,
        Status::Failed,
        Status::Completed,
    ];

    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Processing => "processing",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Pending => "pending",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `status` value this version does not know (a status added by a newer idem).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown status {0:?}")]
pub struct UnknownStatus(pub String);

impl FromStr for Status {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, UnknownStatus> {
        Status::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
            .ok_or_else(|| UnknownStatus(s.to_owned()))
    }
}

impl Type<Postgres> for Status {
    fn type_info() -> PgTypeInfo {
        <&str as Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <&str as Type<Postgres>>::compatible(ty)
    }
}

impl<'r> Decode<'r, Postgres> for Status {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        Ok(<&str as Decode<Postgres>>::decode(value)?.parse()?)
    }
}

impl Encode<'_, Postgres> for Status {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        <&str as Encode<Postgres>>::encode_by_ref(&self.as_str(), buf)
    }
}

/// One row of `processed_operations`, as loaded by [`crate::Store::get`]: what an
/// operator reads about an operation (docs/DESIGN.md, "The record").
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Record {
    /// The row's primary key; a lease token names a lease only together with it.
    pub id: i64,
    /// The tenant or actor: the key's first part.
    pub scope: String,
    /// The handler's operation name (`orders.create`) or an HTTP route
    /// (`POST /payments`): the key's second part.
    pub operation: String,
    /// Derived from the business event ID (a message) or the `Idempotency-Key` header
    /// (a request): the key's third part.
    pub idempotency_key: String,
    /// The fingerprint of the payload the key was first used with, as 64 hex digits:
    /// another payload under the key is a conflict.
    pub payload_sha256: String,
    /// Where the operation stands.
    pub status: Status,
    /// For a `failed` record: whether a later delivery may run it again.
    pub retryable: bool,
    /// How many claims the key had (each claim, takeover or retry counts one).
    pub attempts: i32,
    /// The fencing token of the last claim: every outcome write must name it.
    pub lease_token: i64,
    /// When the current lease lapses (database clock); none when nobody holds one.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// The worker (or server) that last claimed the key.
    pub owner: Option<String>,
    /// A completed operation's stored result (an HTTP request's: its stored answer),
    /// replayed to duplicates.
    pub result: Option<Value>,
    /// What failed, with its kind (`transient`, `permanent`, `uncertain`).
    pub error: Option<Value>,
    /// The provider's reference of an uncertain outcome, for reconciliation.
    pub external_ref: Option<String>,
    /// The outcome was uncertain once (`pending`, or an effect whose result could not
    /// be stored): the operation is reconciled before it may run again.
    pub reconcile_first: bool,
    /// The first delivery's correlation id (a request's `x-correlation-id`).
    pub correlation_id: Option<String>,
    /// The first delivery's AMQP message id.
    pub message_id: Option<String>,
    /// The W3C trace id of the delivery or request that inserted the record or last
    /// took it over (a claim without a trace keeps the one there).
    pub trace_id: Option<String>,
    /// When a dead letter of the operation was last published (confirmed); cleared with
    /// the last pin.
    pub dead_lettered_at: Option<DateTime<Utc>>,
    /// Dead letters of the operation that may wait in a DLQ: counted before each is
    /// published, one taken away by each replay or discard. While any is left, the
    /// record is pinned: gc keeps it.
    pub dead_letters: i32,
    /// How many times a replay took the operation back.
    pub replay_count: i32,
    /// When the last replay did.
    pub last_replayed_at: Option<DateTime<Utc>>,
    /// When an operator discarded its dead letter: a later duplicate of a failure is
    /// acked, not run or dead-lettered again.
    pub discarded_at: Option<DateTime<Utc>>,
    /// When the key was first claimed.
    pub created_at: DateTime<Utc>,
    /// When the record last changed.
    pub updated_at: DateTime<Utc>,
    /// When the operation completed.
    pub completed_at: Option<DateTime<Utc>>,
    /// When gc may delete the record; none: kept (in flight, failed or pending).
    pub expires_at: Option<DateTime<Utc>>,
    /// The id of the key `payload_sha256` was made with (an HMAC); none: unkeyed
    /// SHA-256 (docs/DESIGN.md, "Data protection").
    pub fingerprint_key: Option<String>,
    /// When an erasure removed the record's result, error and reference: a tombstone,
    /// which still decides redeliveries (acked) and retried requests (410).
    pub erased_at: Option<DateTime<Utc>>,
}

impl Record {
    /// The record with its sealed result and reference opened by `keys`, for an
    /// operator to read; a value the keys cannot open stays as stored (sealed, its key
    /// id visible).
    pub(crate) fn opened(mut self, keys: Option<&crate::protect::Keys>) -> Self {
        use crate::protect::{self, Kind};
        if let Some(result) = self.result.take() {
            self.result = Some(
                match protect::open_json(keys, Kind::Result, result.clone()) {
                    Ok(opened) => opened,
                    Err(_) => result,
                },
            );
        }
        if let Some(reference) = self.external_ref.take() {
            let opened = protect::open_text(keys, Kind::Reference, reference.clone());
            self.external_ref = Some(opened.unwrap_or(reference));
        }
        self
    }

    /// Whether the operation's outcome is uncertain and waits to be reconciled:
    /// `pending`, or failed retryably after having been uncertain. These are the
    /// records [`Store::resolve_not_applied`](super::Store::resolve_not_applied) may
    /// settle (its statement says the same in SQL).
    pub fn awaits_reconcile(&self) -> bool {
        self.status == Status::Pending
            || (self.status == Status::Failed && self.retryable && self.reconcile_first)
    }

    /// The stored error's text (`error.error`), if the record holds one.
    pub fn error_text(&self) -> Option<String> {
        self.error.as_ref().map(StoredError::text_of)
    }
}

/// The `error` column: what failed, and of which kind (`transient`, `permanent`,
/// `uncertain`). Built in one place so every writer stores the same shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoredError<'a> {
    pub(crate) kind: &'static str,
    pub(crate) error: &'a str,
}

impl StoredError<'_> {
    pub(crate) fn to_json(self) -> Value {
        serde_json::json!({"error": storable(self.error), "kind": self.kind})
    }

    /// The text of a stored error, whatever its shape (older rows included).
    pub(crate) fn text_of(stored: &Value) -> String {
        match stored.get("error") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => stored.to_string(),
        }
    }
}

/// `text` as Postgres can store it: text and jsonb cannot hold a NUL character, so an
/// error message or provider reference that carries one (echoing a hostile message)
/// gets U+FFFD in its place instead of failing the write that records the outcome.
pub(crate) fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') {
        std::borrow::Cow::Owned(text.replace('\0', "\u{FFFD}"))
    } else {
        std::borrow::Cow::Borrowed(text)
    }
}

/// Proof that the caller owns an operation until `expires_at`: pass it to every write.
///
/// `token` is the fencing token. It is new on every claim or takeover of the record and
/// only grows, and every outcome write checks it together with `id`, so a worker whose
/// lease was taken over can no longer write an outcome. New records claimed by one
/// batch statement share a token value: a token identifies a lease only together with
/// `id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lease {
    /// The record's primary key.
    pub id: i64,
    /// The fencing token.
    pub token: i64,
    /// Which claim of this key this is, from 1.
    pub attempt: i32,
    /// True when the previous owner's lease expired while it was `processing`: it may
    /// have crashed half-way, so effects must be idempotent by the key.
    pub takeover: bool,
    /// When the lease lapses unless extended (database clock).
    pub expires_at: DateTime<Utc>,
}

/// What a claim found, deciding what the worker does with a delivery.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Claim {
    /// The caller owns the operation (new, taken over after an expired lease, or a
    /// retryable failure re-claimed): run the handler.
    Claimed(Lease),
    /// Already done with this payload: do not run; the stored result is replayable.
    Completed {
        /// The stored result.
        result: Option<Value>,
    },
    /// Done with this payload, and then erased (docs/DESIGN.md, "Data protection"):
    /// do not run; nothing is left to replay.
    Erased,
    /// Another worker holds a live lease: do not run, retry later.
    InProgress {
        /// When that lease lapses, if known.
        lease_expires_at: Option<DateTime<Utc>>,
    },
    /// The key was used with another payload: never run, never retry.
    Conflict {
        /// The fingerprint stored with the key.
        stored: Fingerprint,
    },
    /// Failed and not retryable: do not run.
    FailedForGood {
        /// The record's primary key.
        id: i64,
        /// The stored error.
        error: Option<Value>,
        /// How many claims the key had.
        attempts: i32,
        /// Whether its dead letter was published. A worker that died between recording
        /// the failure and publishing leaves this false: publish it then.
        dead_lettered: bool,
    },
    /// The outcome is uncertain. The caller now holds a lease for reconciling it (call
    /// the handler's `reconcile` with `external_ref`); it must not re-run the handler
    /// unless reconcile says the effect was not applied.
    Pending {
        /// The lease for reconciling.
        lease: Lease,
        /// The provider's reference stored when the operation became pending.
        external_ref: Option<String>,
    },
}

/// Delivery details kept on a record for inspection (the trace id is also updated by a
/// claim that takes the record over).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Origin {
    /// The broker message id of the first delivery.
    pub message_id: Option<String>,
    /// The correlation id, if the producer set one.
    pub correlation_id: Option<String>,
    /// The trace the claim runs in (32 hex digits), if it has one: the incoming
    /// `traceparent`'s, or the trace OpenTelemetry started for it.
    pub trace_id: Option<String>,
}

/// One claim of a batch: the arguments of [`crate::Store::claim`] as one value.
#[derive(Debug, Clone)]
pub(crate) struct ClaimRequest {
    /// The key.
    pub key: Key,
    /// The payload's fingerprint.
    pub fingerprint: Fingerprint,
    /// Where the delivery came from.
    pub origin: Origin,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_text_round_trips_and_unknown_is_an_error() {
        for status in Status::ALL {
            assert_eq!(status.as_str().parse::<Status>(), Ok(status));
            assert_eq!(status.to_string(), status.as_str());
        }
        assert_eq!(
            "archived".parse::<Status>(),
            Err(UnknownStatus("archived".into()))
        );
    }

    #[test]
    fn stored_errors_have_one_shape_and_read_back() {
        let stored = StoredError {
            kind: "permanent",
            error: "invalid amount",
        }
        .to_json();
        assert_eq!(
            stored,
            serde_json::json!({"error": "invalid amount", "kind": "permanent"})
        );
        assert_eq!(StoredError::text_of(&stored), "invalid amount");
        assert_eq!(StoredError::text_of(&serde_json::json!("raw")), "\"raw\"");
        let hostile = StoredError {
            kind: "permanent",
            error: "bad id \0x",
        };
        assert_eq!(StoredError::text_of(&hostile.to_json()), "bad id \u{FFFD}x");
    }
}
