//! The idempotency key: which logical operation a message belongs to.

use std::fmt;

use sha2::{Digest, Sha256};

/// Longest accepted `scope` or `operation`, in bytes.
pub(crate) const MAX_NAME_LEN: usize = 200;
/// Longest accepted `idempotency_key`, in bytes.
pub(crate) const MAX_KEY_LEN: usize = 500;

/// Why a [`Key`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// A part was empty (or only whitespace): an empty key would merge unrelated intents.
    #[error("{part} is empty")]
    Empty {
        /// Which part: `scope`, `operation` or `idempotency_key`.
        part: &'static str,
    },
    /// A part was longer than the column allows.
    #[error("{part} is {len} bytes long, at most {max} are allowed")]
    TooLong {
        /// Which part: `scope`, `operation` or `idempotency_key`.
        part: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// A part held a NUL or another control character (a line break, an escape). Postgres
    /// cannot store NUL in text at all, and the others are never part of a business ID:
    /// they come from a broken producer, and would make keys that look alike in logs
    /// differ.
    #[error("{part} contains {}", describe(*.character))]
    ControlCharacter {
        /// Which part: `scope`, `operation` or `idempotency_key`.
        part: &'static str,
        /// The first such character.
        character: char,
    },
}

/// How an error names a control character: NUL by name, the others by code point.
fn describe(character: char) -> String {
    if character == '\0' {
        "a NUL character".into()
    } else {
        format!("the control character U+{:04X}", u32::from(character))
    }
}

/// One intent's identity: `(scope, operation, idempotency_key)`.
///
/// `scope` is the tenant or actor, `operation` the handler's operation name (e.g.
/// `orders.create`) and `idempotency_key` is derived from the business event ID, never
/// from the broker's message id or from the body alone: two identical bodies can be two
/// intents. The three parts are unique together in `processed_operations`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    scope: String,
    operation: String,
    idempotency_key: String,
}

impl Key {
    /// Builds a key, rejecting empty or oversized parts and parts with control
    /// characters.
    pub fn new(
        scope: impl Into<String>,
        operation: impl Into<String>,
        idempotency_key: impl Into<String>,
    ) -> Result<Self, KeyError> {
        let scope = checked("scope", scope.into(), MAX_NAME_LEN)?;
        let operation = checked("operation", operation.into(), MAX_NAME_LEN)?;
        let idempotency_key = checked("idempotency_key", idempotency_key.into(), MAX_KEY_LEN)?;
        Ok(Self {
            scope,
            operation,
            idempotency_key,
        })
    }

    /// The tenant or actor the operation belongs to.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The handler's operation name.
    pub fn operation(&self) -> &str {
        &self.operation
    }

    /// The key derived from the business event ID.
    pub fn idempotency_key(&self) -> &str {
        &self.idempotency_key
    }

    /// SHA-256 of the whole key as 64 hex digits: a stable identifier of the intent that
    /// reveals none of its parts (see [`crate::Context::provider_key`]).
    pub fn digest(&self) -> String {
        let mut hasher = Sha256::new();
        for part in [&self.scope, &self.operation, &self.idempotency_key] {
            // Length-prefix each part so ("ab","c") and ("a","bc") hash differently.
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        hex::encode(hasher.finalize())
    }

    /// Whether `text` has the shape of a [`Key::short_hash`] (12 hex digits), so a tool
    /// that asks for a key can take the hash that logs show instead.
    pub fn looks_like_short_hash(text: &str) -> bool {
        text.len() == 12 && text.bytes().all(|b| b.is_ascii_hexdigit())
    }

    /// The first 12 hex digits of [`Key::digest`], for logs and metrics, so that keys,
    /// which may carry customer data, never appear in logs in clear.
    pub fn short_hash(&self) -> String {
        let mut digest = self.digest();
        digest.truncate(12);
        digest
    }
}

impl fmt::Display for Key {
    /// Shows the short hash only: a key is an identifier that may carry customer data.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.operation, self.short_hash())
    }
}

fn checked(part: &'static str, value: String, max: usize) -> Result<String, KeyError> {
    if value.trim().is_empty() {
        return Err(KeyError::Empty { part });
    }
    if value.len() > max {
        return Err(KeyError::TooLong {
            part,
            len: value.len(),
            max,
        });
    }
    if let Some(character) = value.chars().find(|c| c.is_control()) {
        return Err(KeyError::ControlCharacter { part, character });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_empty_and_oversized_parts() {
        assert_eq!(
            Key::new("", "op", "k"),
            Err(KeyError::Empty { part: "scope" })
        );
        assert_eq!(
            Key::new("t", "  ", "k"),
            Err(KeyError::Empty { part: "operation" })
        );
        let long = "x".repeat(MAX_KEY_LEN + 1);
        assert_eq!(
            Key::new("t", "op", long),
            Err(KeyError::TooLong {
                part: "idempotency_key",
                len: MAX_KEY_LEN + 1,
                max: MAX_KEY_LEN
            })
        );
        assert!(Key::new("t", "op", "x".repeat(MAX_KEY_LEN)).is_ok());
        // Bytes, not characters: 167 three-byte characters are 501 bytes.
        let wide = "€".repeat(167);
        assert_eq!(
            Key::new("t", "op", wide),
            Err(KeyError::TooLong {
                part: "idempotency_key",
                len: 501,
                max: MAX_KEY_LEN
            })
        );
    }

    #[test]
    fn rejects_nul_and_other_control_characters() {
        let nul = Key::new("ten\0ant", "op", "k").unwrap_err();
        assert_eq!(
            nul,
            KeyError::ControlCharacter {
                part: "scope",
                character: '\0'
            }
        );
        assert_eq!(nul.to_string(), "scope contains a NUL character");
        let escape = Key::new("t", "op", "evt-\u{1b}[31m").unwrap_err();
        assert_eq!(
            escape.to_string(),
            "idempotency_key contains the control character U+001B"
        );
        assert!(Key::new("t", "op", "evt\n1").is_err());
        assert!(Key::new("t", "op", "Straße-ü-✓").is_ok());
    }

    #[test]
    fn short_hash_is_stable_and_separates_parts() {
        let a = Key::new("ab", "c", "k").unwrap();
        let b = Key::new("a", "bc", "k").unwrap();
        assert_eq!(a.short_hash(), a.clone().short_hash());
        assert_eq!(a.short_hash().len(), 12);
        assert_ne!(a.short_hash(), b.short_hash());
        let secret = Key::new("tenant-secret", "orders.create", "evt-secret").unwrap();
        assert!(!secret.to_string().contains("secret"));
    }
}
