//! What a delivery's body says: its typed message, its key and the fingerprint of its
//! payload, or why it is malformed (the body is not a JSON object, does not fit the
//! handler's message, or gives no valid key).

use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;

use super::ordered::Entity;
use crate::fingerprint::Fingerprint;
use crate::handler::Handler;
use crate::key::Key;
use crate::ordering::owner::Done;
use crate::store::{ClaimRequest, Origin, Store, storable};

/// A message that passed parsing; the typed message travels beside it, since the
/// handler consumes it.
pub(super) struct Parsed {
    pub(super) value: Arc<Value>,
    pub(super) key: Key,
    pub(super) fingerprint: Fingerprint,
    /// The message's correlation id, carried on to its follow-up messages.
    pub(super) correlation_id: Option<String>,
    /// The entity whose turn it holds (scope and ordering key), if its handler orders it.
    pub(super) entity: Option<Entity>,
    /// Under owned order, the turn it holds in memory: a completion on the handler's
    /// transaction moves its position in the same commit.
    pub(super) owned: Option<Done>,
}

impl Parsed {
    /// What its claim asks for: its key and fingerprint, and where it came from (kept for
    /// inspection only: a NUL in a message id or correlation id, which Postgres text
    /// cannot hold, must not fail the claim, nor the claims of the batch around it).
    /// `properties`: the message's; `trace_id`: the trace its claim runs in, if any.
    pub(super) fn claim_request(
        &self,
        properties: &lapin::BasicProperties,
        trace_id: Option<String>,
    ) -> ClaimRequest {
        let kept = |text: &Option<lapin::types::ShortString>| {
            text.as_ref().map(|s| storable(s.as_str()).into_owned())
        };
        ClaimRequest {
            key: self.key.clone(),
            fingerprint: self.fingerprint.clone(),
            origin: Origin {
                message_id: kept(properties.message_id()),
                correlation_id: kept(properties.correlation_id()),
                trace_id,
            },
        }
    }
}

pub(super) fn parse<H: Handler>(
    handler: &H,
    store: &Store,
    body: &[u8],
) -> Result<(Parsed, H::Message), String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("body is not JSON: {e}"))?;
    if !value.is_object() {
        return Err("body is not a JSON object".into());
    }
    let message = H::Message::deserialize(&value)
        .map_err(|e| format!("body does not fit the message: {e}"))?;
    let key = Key::new(
        handler.scope(&message),
        H::OPERATION,
        handler.idempotency_key(&message),
    )
    .map_err(|e| format!("invalid key: {e}"))?;
    let fingerprint = store.fingerprint(&value, handler.volatile_fields());
    let parsed = Parsed {
        value: Arc::new(value),
        key,
        fingerprint,
        correlation_id: None,
        entity: None,
        owned: None,
    };
    Ok((parsed, message))
}
