//! The operator's keys: parsed from `IDEM_KEYS` or a file, each with an id, newest
//! first, never printed.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use chacha20poly1305::{KeyInit, XChaCha20Poly1305};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The environment variable that holds the keys (`id:hex,id:hex`, newest first).
pub const KEYS_ENV: &str = "IDEM_KEYS";
/// The environment variable that names a file holding the keys, one per line.
pub const KEYS_FILE_ENV: &str = "IDEM_KEYS_FILE";

/// Why keys could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeysError {
    /// No key was given where keys were expected.
    #[error("no keys: give at least one as id:64-hex-digits")]
    Empty,
    /// One entry is not `id:64 hex digits`.
    #[error("key entry {entry}: {reason} (want id:64-hex-digits, e.g. k1:$(openssl rand -hex 32))")]
    Entry {
        /// Which entry, from 1.
        entry: usize,
        /// What is wrong with it (never the key material).
        reason: &'static str,
    },
    /// Two entries have the same id.
    #[error("key id {0:?} is given twice")]
    Duplicate(String),
    /// The key file could not be read.
    #[error("reading key file {path}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Both `IDEM_KEYS` and `IDEM_KEYS_FILE` are set.
    #[error("both {KEYS_ENV} and {KEYS_FILE_ENV} are set: give the keys one way")]
    Both,
}

/// One key: its id and what is derived from its 32 bytes.
pub(crate) struct Key {
    pub(crate) id: String,
    pub(crate) cipher: XChaCha20Poly1305,
    /// The keyed hash for payload fingerprints: a key of its own, derived, so that a
    /// fingerprint tells nothing about the encryption key.
    fingerprint: Hmac<Sha256>,
}

impl Key {
    fn new(id: String, material: &[u8; 32]) -> Self {
        let derive = |label: &[u8]| -> [u8; 32] {
            let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(material)
                .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
            mac.update(label);
            mac.finalize().into_bytes().into()
        };
        let seal = derive(b"idem seal v1");
        let fingerprint = derive(b"idem fingerprint v1");
        Self {
            id,
            cipher: XChaCha20Poly1305::new(&seal.into()),
            fingerprint: <Hmac<Sha256> as Mac>::new_from_slice(&fingerprint)
                .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length")),
        }
    }

    /// The keyed hash of `bytes`, as 64 hex digits.
    pub(crate) fn mac_hex(&self, bytes: &[u8]) -> String {
        let mut mac = self.fingerprint.clone();
        mac.update(bytes);
        hex::encode(mac.finalize().into_bytes())
    }
}

/// The keys idem seals stored values with (docs/DESIGN.md, "Data protection"): the
/// first is the newest, used for every new write and fingerprint; the others keep what
/// they sealed readable until `idem keys rotate` has moved it to the newest.
///
/// Given by the operator, as `id:64-hex-digits` entries separated by commas or
/// newlines (`IDEM_KEYS`, or a file named by `IDEM_KEYS_FILE`; `#` starts a comment in
/// a file). The key material is never printed: `Debug` shows the ids.
#[derive(Clone)]
pub struct Keys {
    keys: Arc<[Key]>,
}

impl Keys {
    /// Parses `id:hex` entries, newest first. An id is 1–32 characters of letters,
    /// digits, `-`, `_` and `.`; the key is 32 bytes as 64 hex digits.
    pub fn parse(spec: &str) -> Result<Self, KeysError> {
        let mut keys: Vec<Key> = Vec::new();
        let entries = spec
            .lines()
            .map(|line| line.split('#').next().unwrap_or(""))
            .flat_map(|line| line.split(','))
            .map(str::trim)
            .filter(|entry| !entry.is_empty());
        for (n, entry) in entries.enumerate() {
            let bad = |reason| KeysError::Entry {
                entry: n + 1,
                reason,
            };
            let (id, material) = entry.split_once(':').ok_or(bad("no ':' after the id"))?;
            let (id, material) = (id.trim(), material.trim());
            let id_ok = (1..=32).contains(&id.len())
                && id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
            if !id_ok {
                return Err(bad("the id is not 1-32 letters, digits, '-', '_' or '.'"));
            }
            let mut bytes = [0u8; 32];
            hex::decode_to_slice(material, &mut bytes)
                .map_err(|_| bad("the key is not 64 hex digits"))?;
            if keys.iter().any(|k| k.id == id) {
                return Err(KeysError::Duplicate(id.to_owned()));
            }
            keys.push(Key::new(id.to_owned(), &bytes));
        }
        if keys.is_empty() {
            return Err(KeysError::Empty);
        }
        Ok(Self { keys: keys.into() })
    }

    /// The keys from `IDEM_KEYS` or the file `IDEM_KEYS_FILE` names; `None` when
    /// neither is set (encryption off).
    pub fn from_env() -> Result<Option<Self>, KeysError> {
        let inline = std::env::var(KEYS_ENV)
            .ok()
            .filter(|s| !s.trim().is_empty());
        let file = std::env::var_os(KEYS_FILE_ENV).filter(|s| !s.is_empty());
        match (inline, file) {
            (Some(_), Some(_)) => Err(KeysError::Both),
            (Some(spec), None) => Self::parse(&spec).map(Some),
            (None, Some(path)) => Self::from_file(Path::new(&path)).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// The keys in a file, one entry per line.
    pub fn from_file(path: &Path) -> Result<Self, KeysError> {
        let spec = std::fs::read_to_string(path).map_err(|source| KeysError::File {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&spec)
    }

    /// A new entry for the key list: `id:` and 32 random bytes as hex.
    pub fn generate(id: &str) -> String {
        format!("{id}:{}", hex::encode(rand::random::<[u8; 32]>()))
    }

    /// The id of the newest key, which new writes use.
    pub fn current_id(&self) -> &str {
        &self.current().id
    }

    /// Every key's id, newest first.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|k| k.id.as_str())
    }

    pub(crate) fn current(&self) -> &Key {
        &self.keys[0]
    }

    pub(crate) fn all(&self) -> &[Key] {
        &self.keys
    }

    pub(crate) fn get(&self, id: &str) -> Option<&Key> {
        self.keys.iter().find(|k| k.id == id)
    }
}

impl fmt::Debug for Keys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keys")
            .field("ids", &self.ids().collect::<Vec<_>>())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "0000000000000000000000000000000000000000000000000000000000000001";
    const B: &str = "00000000000000000000000000000000000000000000000000000000000000ff";

    #[test]
    fn entries_parse_newest_first_from_commas_or_lines() {
        let keys = Keys::parse(&format!("k2:{B}, k1:{A}")).unwrap();
        assert_eq!(keys.ids().collect::<Vec<_>>(), ["k2", "k1"]);
        assert_eq!(keys.current_id(), "k2");
        let file = format!("# rotated 2026-12\nk3:{A}  # newest\n\nk2:{B}\n");
        assert_eq!(
            Keys::parse(&file).unwrap().ids().collect::<Vec<_>>(),
            ["k3", "k2"]
        );
    }

    #[test]
    fn bad_entries_are_named_without_their_material() {
        for (spec, want) in [
            ("", "no keys"),
            (&format!("k1{A}") as &str, "entry 1: no ':'"),
            (&format!("k1:{A},k2:abc"), "entry 2: the key is not 64 hex"),
            (&format!("bad id:{A}"), "entry 1: the id"),
            (&format!("k1:{A},k1:{B}"), "given twice"),
        ] {
            let error = Keys::parse(spec).unwrap_err().to_string();
            assert!(error.contains(want), "{spec:?}: {error}");
            assert!(!error.contains(A) && !error.contains(B), "{error}");
        }
    }

    #[test]
    fn debug_shows_ids_only_and_generated_entries_parse() {
        let keys = Keys::parse(&format!("k1:{A}")).unwrap();
        assert_eq!(format!("{keys:?}"), r#"Keys { ids: ["k1"] }"#);
        let entry = Keys::generate("k9");
        let parsed = Keys::parse(&entry).unwrap();
        assert_eq!(parsed.current_id(), "k9");
        assert_ne!(Keys::generate("k9"), entry);
    }

    #[test]
    fn each_key_hashes_differently() {
        let keys = Keys::parse(&format!("k2:{B},k1:{A}")).unwrap();
        let [k2, k1] = keys.all() else { panic!() };
        assert_ne!(k2.mac_hex(b"x"), k1.mac_hex(b"x"));
        assert_eq!(k1.mac_hex(b"x").len(), 64);
    }
}
