//! The payload fingerprint: SHA-256 of canonical JSON, volatile fields left out; with
//! keys configured, a keyed hash (HMAC-SHA-256) of it instead, so that a stored
//! fingerprint cannot be used to guess a small payload.
//!
//! Same key with the same fingerprint is a redelivery; same key with another
//! fingerprint is a conflict (a changed payload is a new intent and needs a new key).

use std::fmt;
use std::io::{self, Write};

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::protect::Keys;

/// SHA-256 of a payload's canonical JSON, as 64 lowercase hex digits; with keys, the
/// newest key's HMAC-SHA-256 of it.
///
/// Two fingerprints are equal when their digests are. A keyed fingerprint also
/// carries the digests the same payload has under the older keys and unkeyed, which a
/// record written before a rotation (or before encryption was on) holds: a
/// redelivery of its payload is still recognised, not taken for a conflict.
#[derive(Debug, Clone)]
pub struct Fingerprint {
    hex: String,
    /// The id of the key that made `hex` (`None`: unkeyed SHA-256).
    key: Option<String>,
    /// The same payload's digests under the older keys and unkeyed.
    also: Vec<String>,
}

impl PartialEq for Fingerprint {
    fn eq(&self, other: &Self) -> bool {
        self.hex == other.hex
    }
}

impl Eq for Fingerprint {}

impl std::hash::Hash for Fingerprint {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.hex.hash(state);
    }
}

impl Fingerprint {
    /// Fingerprints `payload` with the `volatile` fields removed.
    ///
    /// A volatile field is named by a dotted path through objects: `sent_at` removes a
    /// top-level field, `meta.trace_id` a nested one. Paths that do not exist are
    /// ignored. Object keys are sorted at every depth and no whitespace is written, so
    /// producers that reorder keys or pretty-print produce the same fingerprint.
    pub fn of(payload: &Value, volatile: &[&str]) -> Self {
        // The canonical form streams straight into the hash: no copy of the payload as
        // text.
        let mut digest = Sha256::new();
        let written = if volatile.is_empty() {
            write_canonical(payload, &mut digest)
        } else {
            let mut stripped = payload.clone();
            for path in volatile {
                remove_path(&mut stripped, path);
            }
            write_canonical(&stripped, &mut digest)
        };
        written.expect("writing to a hasher cannot fail");
        Self::from_hex(hex::encode(digest.finalize()))
    }

    /// Fingerprints `payload` as [`Fingerprint::of`] does, keyed by the newest of
    /// `keys` when there are keys.
    pub fn keyed(payload: &Value, volatile: &[&str], keys: Option<&Keys>) -> Self {
        let Some(keys) = keys else {
            return Self::of(payload, volatile);
        };
        let mut canonical = Vec::new();
        let mut stripped;
        let payload = if volatile.is_empty() {
            payload
        } else {
            stripped = payload.clone();
            for path in volatile {
                remove_path(&mut stripped, path);
            }
            &stripped
        };
        write_canonical(payload, &mut canonical).expect("writing to a Vec cannot fail");
        let mut also: Vec<String> = keys.all()[1..]
            .iter()
            .map(|key| key.mac_hex(&canonical))
            .collect();
        also.push(hex::encode(Sha256::digest(&canonical)));
        Self {
            hex: keys.current().mac_hex(&canonical),
            key: Some(keys.current_id().to_owned()),
            also,
        }
    }

    /// Wraps a hex digest read back from the database.
    pub fn from_hex(hex: String) -> Self {
        Self {
            hex,
            key: None,
            also: Vec::new(),
        }
    }

    /// The digest as 64 lowercase hex digits.
    pub fn as_hex(&self) -> &str {
        &self.hex
    }

    /// The id of the key that made the digest (`None`: unkeyed).
    pub(crate) fn key_id(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The same payload's digests under older keys and unkeyed, comma-separated, for
    /// the claim statements (`None`: there are none).
    pub(crate) fn also(&self) -> Option<String> {
        (!self.also.is_empty()).then(|| self.also.join(","))
    }

    /// Whether a record's stored digest is this payload's, under any key.
    pub(crate) fn accepts(&self, stored: &str) -> bool {
        self.hex == stored || self.also.iter().any(|d| d == stored)
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex)
    }
}

/// Writes `value` as canonical JSON: object keys sorted (by their UTF-8 bytes) at every
/// depth, no insignificant whitespace, numbers and strings as serde_json writes them.
///
/// Sorting is done here rather than relied on from `serde_json::Map`, whose order
/// depends on whether any crate in the build enables `preserve_order`.
#[cfg(test)]
fn canonical_json(value: &Value) -> String {
    let mut out = Vec::new();
    write_canonical(value, &mut out).expect("writing to a Vec cannot fail");
    String::from_utf8(out).expect("JSON text written from `&str`s is UTF-8")
}

fn write_canonical<W: Write>(value: &Value, out: &mut W) -> io::Result<()> {
    match value {
        Value::Null => out.write_all(b"null"),
        Value::Bool(b) => out.write_all(if *b { b"true" } else { b"false" }),
        Value::Number(n) => write!(out, "{n}"),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.write_all(b"[")?;
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write_canonical(item, out)?;
            }
            out.write_all(b"]")
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.write_all(b"{")?;
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write_string(k, out)?;
                out.write_all(b":")?;
                write_canonical(v, out)?;
            }
            out.write_all(b"}")
        }
    }
}

/// A JSON string, escaped exactly as serde_json writes it.
fn write_string<W: Write>(s: &str, out: &mut W) -> io::Result<()> {
    serde_json::to_writer(out, s).map_err(io::Error::other)
}

fn remove_path(value: &mut Value, path: &str) {
    let mut parts = path.split('.').peekable();
    let mut current = value;
    while let Some(part) = parts.next() {
        let Value::Object(map) = current else { return };
        if parts.peek().is_none() {
            map.remove(part);
            return;
        }
        match map.get_mut(part) {
            Some(next) => current = next,
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sorts_keys_at_every_depth_without_whitespace() {
        let v: Value =
            serde_json::from_str(r#"{ "b": 1, "a": { "z": [ {"y":2, "x":1} ], "c": null } }"#)
                .unwrap();
        assert_eq!(
            canonical_json(&v),
            r#"{"a":{"c":null,"z":[{"x":1,"y":2}]},"b":1}"#
        );
    }

    #[test]
    fn reordered_keys_give_the_same_fingerprint() {
        let a = json!({"event_id": "e1", "amount": 10, "meta": {"x": 1, "y": [1, 2]}});
        let b: Value =
            serde_json::from_str(r#"{"meta":{"y":[1,2],"x":1},"amount":10,"event_id":"e1"}"#)
                .unwrap();
        assert_eq!(Fingerprint::of(&a, &[]), Fingerprint::of(&b, &[]));
    }

    #[test]
    fn array_order_and_values_matter() {
        let a = json!({"items": [1, 2]});
        let b = json!({"items": [2, 1]});
        let c = json!({"items": [1, 2], "n": 1});
        let d = json!({"items": [1, 2], "n": 2});
        assert_ne!(Fingerprint::of(&a, &[]), Fingerprint::of(&b, &[]));
        assert_ne!(Fingerprint::of(&c, &[]), Fingerprint::of(&d, &[]));
    }

    #[test]
    fn unicode_is_kept_and_escapes_are_normalised() {
        // The same string written with a \u escape and as a literal reads the same.
        let escaped: Value = serde_json::from_str(
            r#"{"name":"Gr\u00fc\u00dfe \u043f\u0440\u0438\u0432\u0456\u0442"}"#,
        )
        .unwrap();
        let literal = json!({"name": "Grüße привіт"});
        assert_eq!(canonical_json(&escaped), r#"{"name":"Grüße привіт"}"#);
        assert_eq!(
            Fingerprint::of(&escaped, &[]),
            Fingerprint::of(&literal, &[])
        );
        // Keys sort by bytes: "Z" < "a" < "é".
        let v = json!({"é": 1, "a": 2, "Z": 3});
        assert_eq!(canonical_json(&v), r#"{"Z":3,"a":2,"é":1}"#);
        // Control characters and quotes are escaped as JSON requires.
        assert_eq!(canonical_json(&json!("a\"b\n")), r#""a\"b\n""#);
    }

    #[test]
    fn volatile_fields_are_removed_top_level_and_dotted() {
        let a = json!({"id": 1, "sent_at": "10:00", "meta": {"trace": "t1", "kept": true}});
        let b = json!({"id": 1, "sent_at": "11:00", "meta": {"trace": "t2", "kept": true}});
        let volatile = ["sent_at", "meta.trace"];
        assert_eq!(
            Fingerprint::of(&a, &volatile),
            Fingerprint::of(&b, &volatile)
        );
        assert_ne!(
            Fingerprint::of(&a, &["sent_at"]),
            Fingerprint::of(&b, &["sent_at"])
        );
        // A non-volatile nested change is still seen.
        let c = json!({"id": 1, "sent_at": "10:00", "meta": {"trace": "t1", "kept": false}});
        assert_ne!(
            Fingerprint::of(&a, &volatile),
            Fingerprint::of(&c, &volatile)
        );
        // Absent paths and paths through non-objects are ignored.
        let d = json!({"id": 1, "meta": 5});
        assert_eq!(
            Fingerprint::of(&d, &["meta.trace", "nope", "x.y.z"]),
            Fingerprint::of(&d, &[])
        );
    }

    #[test]
    fn digest_is_sha256_of_canonical_form() {
        let v = json!({"b": 2, "a": 1});
        let expected = hex::encode(Sha256::digest(br#"{"a":1,"b":2}"#));
        assert_eq!(Fingerprint::of(&v, &[]).as_hex(), expected);
        // Streamed into the hash, the canonical form is the same as written out; and a
        // stored digest of this payload stays what it was before streaming.
        let v = json!({"z": ["a\"b\n", 1.5, null, true], "é": {"y": "привіт", "x": -3}});
        let expected = hex::encode(Sha256::digest(canonical_json(&v).as_bytes()));
        assert_eq!(Fingerprint::of(&v, &[]).as_hex(), expected);
        // (Computed independently: Python's sha256 of the canonical text.)
        assert_eq!(
            expected,
            "2862acf414bb94c64ed9762b14d6beab71f63b7d457398e6b881c9cf68bc062e"
        );
    }

    #[test]
    fn a_keyed_fingerprint_hides_the_digest_and_accepts_older_ones() {
        let v = json!({"b": 2, "a": 1, "t": "x"});
        let plain = Fingerprint::of(&v, &["t"]);
        let k1 = Keys::parse(&format!("k1:{}", "11".repeat(32))).unwrap();
        let rotated =
            Keys::parse(&format!("k2:{},k1:{}", "22".repeat(32), "11".repeat(32))).unwrap();
        let under_k1 = Fingerprint::keyed(&v, &["t"], Some(&k1));
        let under_k2 = Fingerprint::keyed(&v, &["t"], Some(&rotated));
        assert_ne!(under_k1, plain);
        assert_ne!(under_k2, under_k1);
        assert_eq!(under_k2.key_id(), Some("k2"));
        assert!(under_k2.accepts(under_k1.as_hex()) && under_k2.accepts(plain.as_hex()));
        assert!(!under_k1.accepts(under_k2.as_hex()));
        assert!(!under_k2.accepts(Fingerprint::of(&json!({"a": 2}), &[]).as_hex()));
        assert_eq!(Fingerprint::keyed(&v, &["t"], None), plain);
        assert_eq!(plain.also(), None);
    }

    #[test]
    fn numbers_are_written_as_serde_json_reads_them() {
        let v: Value = serde_json::from_str(r#"{"a": 1.50, "b": -0, "c": 10}"#).unwrap();
        assert_eq!(canonical_json(&v), r#"{"a":1.5,"b":-0.0,"c":10}"#);
    }
}
