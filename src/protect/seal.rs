//! Sealing stored values: XChaCha20-Poly1305 under the newest key, with the key's id
//! beside the ciphertext so that an older key still opens what it sealed.
//!
//! Each kind of value keeps its column type, so that no statement changes shape:
//! - JSON (a handler's output, an HTTP answer): `{"$idem_sealed": id, "v": base64}`;
//! - text (a provider's reference): `$idem_sealed:id:base64`;
//! - bytes (a follow-up body): [`BODY_MAGIC`], the id's length and the id, then the
//!   sealed bytes.
//!
//! The sealed bytes are a random 24-byte nonce and the ciphertext with its tag; the
//! value's kind is the associated data, so a value moved into another column does not
//! open. A value without the mark is plaintext (written before encryption was on) and
//! is read as it is.

use base64::Engine;
use base64::engine::general_purpose::STANDARD_NO_PAD as BASE64;
use chacha20poly1305::XNonce;
use chacha20poly1305::aead::{Aead, Payload};
use serde_json::Value;

use super::keys::{Key, Keys};

/// The JSON field that marks a sealed value (and names its key).
pub(crate) const JSON_MARK: &str = "$idem_sealed";
/// The prefix of a sealed text value.
pub(crate) const TEXT_MARK: &str = "$idem_sealed:";
/// The first bytes of a sealed follow-up body.
pub(crate) const BODY_MAGIC: &[u8] = b"\0idem-sealed\0";

/// What a value is, bound into its ciphertext.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    /// A record's `result`: a handler's output or an HTTP stored answer.
    Result,
    /// A record's `external_ref`.
    Reference,
    /// A follow-up message's body.
    Body,
    /// The check value each key leaves in `idem_keys`.
    Check,
}

impl Kind {
    fn aad(self) -> &'static [u8] {
        match self {
            Kind::Result => b"idem result",
            Kind::Reference => b"idem external_ref",
            Kind::Body => b"idem outbox body",
            Kind::Check => b"idem key check",
        }
    }
}

/// Why a stored value could not be opened. Never the value itself.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum SealError {
    /// The value was sealed with a key that is not among the configured keys.
    #[error(
        "a stored value is sealed with key {id:?}, which is not in {}",
        super::KEYS_ENV
    )]
    UnknownKey {
        /// The key id stored with the value.
        id: String,
    },
    /// The value was sealed, but no keys are configured.
    #[error(
        "a stored value is sealed with key {id:?}, but no keys are configured (set {})",
        super::KEYS_ENV
    )]
    NoKeys {
        /// The key id stored with the value.
        id: String,
    },
    /// The key with the value's id does not open it: other key material under the same
    /// id, or an altered value.
    #[error(
        "key {id:?} does not open a value sealed under its id: wrong key material, or the value was altered"
    )]
    WrongKey {
        /// The key id.
        id: String,
    },
    /// The value carries the mark but not its parts.
    #[error("a sealed value is malformed: {0}")]
    Malformed(&'static str),
}

/// Nonce and ciphertext of `plain` under `key`.
pub(crate) fn seal_with(key: &Key, kind: Kind, plain: &[u8]) -> Vec<u8> {
    let nonce: [u8; 24] = rand::random();
    let sealed = key
        .cipher
        .encrypt(
            XNonce::from_slice(&nonce),
            Payload {
                msg: plain,
                aad: kind.aad(),
            },
        )
        // Encryption fails only for a message longer than the cipher's counter allows
        // (256 GiB), which no stored value is.
        .unwrap_or_else(|_| unreachable!("XChaCha20-Poly1305 seals any stored value"));
    [&nonce[..], &sealed].concat()
}

/// Opens what [`seal_with`] sealed under the key with `id`.
pub(crate) fn open_with(
    keys: Option<&Keys>,
    id: &str,
    kind: Kind,
    sealed: &[u8],
) -> Result<Vec<u8>, SealError> {
    let keys = keys.ok_or_else(|| SealError::NoKeys { id: id.to_owned() })?;
    let key = keys
        .get(id)
        .ok_or_else(|| SealError::UnknownKey { id: id.to_owned() })?;
    if sealed.len() < 24 {
        return Err(SealError::Malformed("shorter than its nonce"));
    }
    let (nonce, ciphertext) = sealed.split_at(24);
    key.cipher
        .decrypt(
            XNonce::from_slice(nonce),
            Payload {
                msg: ciphertext,
                aad: kind.aad(),
            },
        )
        .map_err(|_| SealError::WrongKey { id: id.to_owned() })
}

/// `value` sealed under the newest key; as it is without keys.
pub(crate) fn seal_json(keys: Option<&Keys>, kind: Kind, value: &Value) -> Value {
    let Some(keys) = keys else {
        return value.clone();
    };
    let plain = serde_json::to_vec(value)
        .unwrap_or_else(|_| unreachable!("a serde_json Value always serializes"));
    let key = keys.current();
    serde_json::json!({
        JSON_MARK: key.id,
        "v": BASE64.encode(seal_with(key, kind, &plain)),
    })
}

/// The key id of a sealed JSON value.
pub(crate) fn json_key(value: &Value) -> Option<&str> {
    let object = value.as_object()?;
    // Exactly the two fields a seal writes: an output that only mentions the mark is
    // the handler's own.
    if object.len() != 2 || !object.contains_key("v") {
        return None;
    }
    object.get(JSON_MARK)?.as_str()
}

/// `value` opened when sealed, as it is otherwise.
pub(crate) fn open_json(keys: Option<&Keys>, kind: Kind, value: Value) -> Result<Value, SealError> {
    let Some(id) = json_key(&value) else {
        return Ok(value);
    };
    let sealed = value
        .get("v")
        .and_then(Value::as_str)
        .and_then(|v| BASE64.decode(v).ok())
        .ok_or(SealError::Malformed("no base64 \"v\""))?;
    let plain = open_with(keys, id, kind, &sealed)?;
    serde_json::from_slice(&plain).map_err(|_| SealError::Malformed("not JSON inside"))
}

/// `text` sealed under the newest key; as it is without keys.
pub(crate) fn seal_text(keys: Option<&Keys>, kind: Kind, text: &str) -> String {
    match keys {
        None => text.to_owned(),
        Some(keys) => {
            let key = keys.current();
            let sealed = BASE64.encode(seal_with(key, kind, text.as_bytes()));
            format!("{TEXT_MARK}{}:{sealed}", key.id)
        }
    }
}

/// `text` opened when sealed, as it is otherwise.
pub(crate) fn open_text(
    keys: Option<&Keys>,
    kind: Kind,
    text: String,
) -> Result<String, SealError> {
    let Some(rest) = text.strip_prefix(TEXT_MARK) else {
        return Ok(text);
    };
    let (id, sealed) = rest
        .split_once(':')
        .ok_or(SealError::Malformed("no key id"))?;
    let sealed = BASE64
        .decode(sealed)
        .map_err(|_| SealError::Malformed("not base64"))?;
    let plain = open_with(keys, id, kind, &sealed)?;
    String::from_utf8(plain).map_err(|_| SealError::Malformed("not UTF-8 inside"))
}

/// `body` sealed under the newest key; as it is without keys.
pub(crate) fn seal_body(keys: Option<&Keys>, body: &[u8]) -> Vec<u8> {
    match keys {
        None => body.to_vec(),
        Some(keys) => {
            let key = keys.current();
            let id = key.id.as_bytes();
            let id_len = [u8::try_from(id.len()).unwrap_or(u8::MAX)];
            let sealed = seal_with(key, Kind::Body, body);
            [BODY_MAGIC, &id_len, id, &sealed].concat()
        }
    }
}

/// The key id of a sealed body, and where its sealed bytes start.
fn body_key(body: &[u8]) -> Option<Result<(&str, usize), SealError>> {
    let rest = body.strip_prefix(BODY_MAGIC)?;
    let parsed = (|| {
        let (&len, rest) = rest.split_first()?;
        let id = std::str::from_utf8(rest.get(..usize::from(len))?).ok()?;
        Some((id, BODY_MAGIC.len() + 1 + usize::from(len)))
    })();
    Some(parsed.ok_or(SealError::Malformed("no key id after the mark")))
}

/// `body` opened when sealed, as it is otherwise.
pub(crate) fn open_body(keys: Option<&Keys>, body: Vec<u8>) -> Result<Vec<u8>, SealError> {
    match body_key(&body) {
        None => Ok(body),
        Some(parsed) => {
            let (id, start) = parsed?;
            open_with(keys, id, Kind::Body, &body[start..])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn keys(spec: &str) -> Keys {
        let a = "11".repeat(32);
        let b = "22".repeat(32);
        Keys::parse(&spec.replace("A", &a).replace("B", &b)).unwrap()
    }

    #[test]
    fn values_round_trip_and_hide_their_plaintext() {
        let k = keys("k1:A");
        let value = json!({"name": "MARKER-Ada", "n": 1});
        let sealed = seal_json(Some(&k), Kind::Result, &value);
        assert!(!sealed.to_string().contains("MARKER"));
        assert_eq!(json_key(&sealed), Some("k1"));
        assert_eq!(open_json(Some(&k), Kind::Result, sealed).unwrap(), value);

        let text = seal_text(Some(&k), Kind::Reference, "ch_MARKER");
        assert!(text.starts_with("$idem_sealed:k1:") && !text.contains("MARKER"));
        assert_eq!(
            open_text(Some(&k), Kind::Reference, text).unwrap(),
            "ch_MARKER"
        );

        let body = seal_body(Some(&k), b"MARKER body");
        assert!(!body.windows(6).any(|w| w == b"MARKER"));
        assert_eq!(open_body(Some(&k), body).unwrap(), b"MARKER body");
        // Two seals of one value differ (a fresh nonce each).
        assert_ne!(
            seal_json(Some(&k), Kind::Result, &value),
            seal_json(Some(&k), Kind::Result, &value)
        );
    }

    #[test]
    fn plaintext_passes_through_and_nothing_is_sealed_without_keys() {
        let value = json!({"a": 1});
        assert_eq!(seal_json(None, Kind::Result, &value), value);
        assert_eq!(
            open_json(Some(&keys("k1:A")), Kind::Result, value.clone()).unwrap(),
            value
        );
        assert_eq!(
            open_text(None, Kind::Reference, "ch_1".into()).unwrap(),
            "ch_1"
        );
        assert_eq!(open_body(None, b"{}".to_vec()).unwrap(), b"{}");
    }

    #[test]
    fn an_older_key_still_opens_and_a_wrong_or_missing_one_says_so() {
        let old = keys("k1:A");
        let sealed = seal_json(Some(&old), Kind::Result, &json!("x"));
        let rotated = keys("k2:B,k1:A");
        assert_eq!(
            open_json(Some(&rotated), Kind::Result, sealed.clone()).unwrap(),
            json!("x")
        );
        let wrong = keys("k1:B");
        let error = open_json(Some(&wrong), Kind::Result, sealed.clone()).unwrap_err();
        assert!(
            matches!(error, SealError::WrongKey { ref id } if id == "k1"),
            "{error}"
        );
        let other = keys("k2:B");
        assert!(matches!(
            open_json(Some(&other), Kind::Result, sealed.clone()),
            Err(SealError::UnknownKey { .. })
        ));
        assert!(matches!(
            open_json(None, Kind::Result, sealed.clone()),
            Err(SealError::NoKeys { .. })
        ));
        // Moved into another column, it does not open.
        let text = seal_text(Some(&old), Kind::Result, "x");
        assert!(open_text(Some(&old), Kind::Reference, text).is_err());
        // Altered, it does not open.
        let mut body = seal_body(Some(&old), b"abc");
        *body.last_mut().unwrap() ^= 1;
        assert!(matches!(
            open_body(Some(&old), body),
            Err(SealError::WrongKey { .. })
        ));
        assert!(matches!(
            open_body(Some(&old), BODY_MAGIC.to_vec()),
            Err(SealError::Malformed(_))
        ));
    }
}
