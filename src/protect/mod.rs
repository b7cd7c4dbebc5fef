//! Data protection (docs/DESIGN.md, "Data protection"): what idem keeps about people,
//! sealed, erasable, and kept no longer than its operation needs.
//!
//! - [`Keys`]: the operator's keys (`IDEM_KEYS`), newest first, never printed;
//! - `seal`: sealing and opening stored values (outputs, HTTP answers, provider
//!   references, follow-up bodies) with XChaCha20-Poly1305, the key's id stored beside;
//! - `erase`: erasure by subject (a scope, or a scope and key), leaving tombstones that
//!   still decide redeliveries, audited in `erasures`;
//! - `rotate`: moving what older keys sealed to the newest, in paced batches beside
//!   live workers, and retiring a key nothing uses any more.
//!
//! Encryption is off until keys are given: a key idem made up and kept in the same
//! database would protect nothing against a leaked database or backup.

use sqlx::PgPool;

mod erase;
mod keys;
mod rotate;
mod seal;

pub use erase::{Erasure, ErasureRecord, erasures};
pub use keys::{KEYS_ENV, KEYS_FILE_ENV, Keys, KeysError};
pub use rotate::{KeyUse, RetireError, Rotation, key_use, retire, rotate};
pub use seal::SealError;
pub(crate) use seal::{Kind, open_body, open_json, open_text, seal_body, seal_json, seal_text};

use crate::store::StoreError;

/// The constant each key seals into `idem_keys`, to prove later processes hold the
/// same material under the same id.
const CHECK: &[u8] = b"idem key check v1";

/// Checks `keys` against the keys registered in `idem_keys`, and registers the new
/// ones: every configured key must open its check value (else
/// [`SealError::WrongKey`]), and every registered key not yet retired must be
/// configured (else [`StoreError::KeysMissing`]), so that a process never writes
/// plaintext beside sealed values nor fails later on a value it cannot open. The keys
/// after the first are marked superseded.
pub(crate) async fn check(pool: &PgPool, keys: Option<&Keys>) -> Result<(), StoreError> {
    // One transaction, the table locked: what is registered is checked before anything
    // is written, so a process with a wrong key registers nothing.
    let mut tx = pool.begin().await?;
    sqlx::query("LOCK TABLE idem_keys IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await?;
    let registered: Vec<(String, Vec<u8>, bool)> =
        sqlx::query_as("SELECT id, check_value, retired_at IS NOT NULL FROM idem_keys ORDER BY id")
            .fetch_all(&mut *tx)
            .await?;
    let mut missing = Vec::new();
    for (id, check_value, retired) in registered {
        match keys.and_then(|keys| keys.get(&id)) {
            Some(_) if retired => return Err(StoreError::KeyRetired { id }),
            Some(_) => {
                let opened = seal::open_with(keys, &id, Kind::Check, &check_value)?;
                if opened != CHECK {
                    return Err(SealError::WrongKey { id }.into());
                }
            }
            None if !retired => missing.push(id),
            None => {}
        }
    }
    if !missing.is_empty() {
        return Err(StoreError::KeysMissing {
            ids: missing.join(", "),
        });
    }
    if let Some(keys) = keys {
        let ids: Vec<&str> = keys.ids().collect();
        let checks: Vec<Vec<u8>> = keys
            .all()
            .iter()
            .map(|key| seal::seal_with(key, Kind::Check, CHECK))
            .collect();
        sqlx::query(
            "INSERT INTO idem_keys (id, check_value)
             SELECT * FROM unnest($1::text[], $2::bytea[])
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(&ids)
        .bind(&checks)
        .execute(&mut *tx)
        .await?;
        // The newest is current; the others superseded (since the first process that
        // put a newer one before them).
        sqlx::query(
            "UPDATE idem_keys
             SET superseded_at = CASE WHEN id = $1 THEN NULL ELSE COALESCE(superseded_at, now()) END
             WHERE id = ANY($2)",
        )
        .bind(ids[0])
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}
