//! Key rotation: moving what older keys (or no key) sealed to the newest key, in
//! paced batches beside live workers, and retiring a key nothing uses any more.
//!
//! A row is rewritten only if it still holds what the batch read (compared in the
//! `UPDATE`), so a worker's write in between is never overwritten; such a row is read
//! again in the next pass. Fingerprints cannot move (their payloads are not kept): a
//! record's fingerprint stays under its key until gc deletes the record.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgPool;

use super::seal::{self, BODY_MAGIC, JSON_MARK, Kind, TEXT_MARK};
use super::{Keys, SealError};
use crate::store::StoreError;

/// How many passes a rotation makes over rows that changed under it before it stops.
const PASSES: usize = 5;

/// What a rotation moved to the newest key.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Rotation {
    /// Records' results and HTTP answers.
    pub results: u64,
    /// Records' provider references.
    pub references: u64,
    /// Follow-up bodies in the outbox.
    pub bodies: u64,
    /// Bodies of deliveries waiting for their entity's turn (`ordering_waiting`).
    pub waiting: u64,
    /// Rows changed by a worker between the read and the write, in the last pass:
    /// none when the rotation finished.
    pub raced: u64,
}

/// Re-seals, under the newest of `keys`, every stored value sealed with an older key
/// or not sealed, `batch` rows per statement with `pause` between statements.
pub async fn rotate(
    pool: &PgPool,
    keys: &Keys,
    batch: i64,
    pause: Duration,
) -> Result<Rotation, StoreError> {
    let mut done = Rotation::default();
    for _ in 0..PASSES {
        done.raced = 0;
        rotate_records(pool, keys, batch, pause, &mut done).await?;
        rotate_bodies(pool, keys, batch, pause, &mut done).await?;
        rotate_waiting(pool, keys, batch, pause, &mut done).await?;
        if done.raced == 0 {
            break;
        }
    }
    Ok(done)
}

type RecordRow = (i64, Option<Value>, Option<String>);

async fn rotate_records(
    pool: &PgPool,
    keys: &Keys,
    batch: i64,
    pause: Duration,
    done: &mut Rotation,
) -> Result<(), StoreError> {
    let current = keys.current_id();
    let text_prefix = format!("{TEXT_MARK}{current}:");
    let mut after = 0i64;
    loop {
        let rows: Vec<RecordRow> = sqlx::query_as(
            "SELECT id, result, external_ref FROM processed_operations
             WHERE id > $1
               AND ((result IS NOT NULL AND (result ->> $2) IS DISTINCT FROM $3)
                 OR (external_ref IS NOT NULL AND NOT starts_with(external_ref, $4)))
             ORDER BY id LIMIT $5",
        )
        .bind(after)
        .bind(JSON_MARK)
        .bind(current)
        .bind(&text_prefix)
        .bind(batch)
        .fetch_all(pool)
        .await?;
        let Some(&(last, _, _)) = rows.last() else {
            return Ok(());
        };
        after = last;
        let mut update = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (id, result, reference) in rows {
            let new_result = match &result {
                Some(v) if seal::json_key(v) != Some(current) => {
                    let opened = seal::open_json(Some(keys), Kind::Result, v.clone())?;
                    done.results += 1;
                    Some(seal::seal_json(Some(keys), Kind::Result, &opened))
                }
                other => other.clone(),
            };
            let new_reference = match &reference {
                Some(r) if !r.starts_with(&text_prefix) => {
                    let opened = seal::open_text(Some(keys), Kind::Reference, r.clone())?;
                    done.references += 1;
                    Some(seal::seal_text(Some(keys), Kind::Reference, &opened))
                }
                other => other.clone(),
            };
            update.0.push(id);
            update.1.push(result);
            update.2.push(new_result);
            update.3.push(reference);
            update.4.push(new_reference);
        }
        let written = sqlx::query(
            "UPDATE processed_operations p
             SET result = u.new_result, external_ref = u.new_ref
             FROM unnest($1::bigint[], $2::jsonb[], $3::jsonb[], $4::text[], $5::text[])
                  AS u(id, old_result, new_result, old_ref, new_ref)
             WHERE p.id = u.id AND p.result IS NOT DISTINCT FROM u.old_result
               AND p.external_ref IS NOT DISTINCT FROM u.old_ref",
        )
        .bind(&update.0)
        .bind(&update.1)
        .bind(&update.2)
        .bind(&update.3)
        .bind(&update.4)
        .execute(pool)
        .await?;
        done.raced += update.0.len() as u64 - written.rows_affected();
        tokio::time::sleep(pause).await;
    }
}

/// The first bytes of a body sealed with `id`.
fn body_prefix(id: &str) -> Vec<u8> {
    [BODY_MAGIC, &[id.len() as u8], id.as_bytes()].concat()
}

async fn rotate_bodies(
    pool: &PgPool,
    keys: &Keys,
    batch: i64,
    pause: Duration,
    done: &mut Rotation,
) -> Result<(), StoreError> {
    let prefix = body_prefix(keys.current_id());
    let mut after = 0i64;
    loop {
        let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as(
            "SELECT id, body FROM outbox_messages
             WHERE id > $1 AND substring(body FROM 1 FOR $2) IS DISTINCT FROM $3
             ORDER BY id LIMIT $4",
        )
        .bind(after)
        .bind(prefix.len() as i32)
        .bind(&prefix)
        .bind(batch)
        .fetch_all(pool)
        .await?;
        let Some(last) = rows.last().map(|(id, _)| *id) else {
            return Ok(());
        };
        after = last;
        let mut update = (Vec::new(), Vec::new(), Vec::new());
        for (id, body) in rows {
            let opened = seal::open_body(Some(keys), body.clone())?;
            update.0.push(id);
            update.1.push(body);
            update.2.push(seal::seal_body(Some(keys), &opened));
        }
        let written = sqlx::query(
            "UPDATE outbox_messages o SET body = u.new_body
             FROM unnest($1::bigint[], $2::bytea[], $3::bytea[]) AS u(id, old_body, new_body)
             WHERE o.id = u.id AND o.body = u.old_body",
        )
        .bind(&update.0)
        .bind(&update.1)
        .bind(&update.2)
        .execute(pool)
        .await?;
        done.bodies += written.rows_affected();
        done.raced += update.0.len() as u64 - written.rows_affected();
        tokio::time::sleep(pause).await;
    }
}

type WaitingKey = (String, String, i64);

/// The bodies of deliveries waiting for their turn, as [`rotate_bodies`] does the
/// outbox's, by their primary key.
async fn rotate_waiting(
    pool: &PgPool,
    keys: &Keys,
    batch: i64,
    pause: Duration,
    done: &mut Rotation,
) -> Result<(), StoreError> {
    let prefix = body_prefix(keys.current_id());
    let mut after: WaitingKey = (String::new(), String::new(), i64::MIN);
    loop {
        let rows: Vec<(String, String, i64, Vec<u8>)> = sqlx::query_as(
            "SELECT scope, ordering_key, seq, body FROM ordering_waiting
             WHERE (scope, ordering_key, seq) > ($1, $2, $3)
               AND substring(body FROM 1 FOR $4) IS DISTINCT FROM $5
             ORDER BY scope, ordering_key, seq LIMIT $6",
        )
        .bind(&after.0)
        .bind(&after.1)
        .bind(after.2)
        .bind(prefix.len() as i32)
        .bind(&prefix)
        .bind(batch)
        .fetch_all(pool)
        .await?;
        let Some((scope, key, seq, _)) = rows.last() else {
            return Ok(());
        };
        after = (scope.clone(), key.clone(), *seq);
        let mut update = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (scope, key, seq, body) in rows {
            let opened = seal::open_body(Some(keys), body.clone())?;
            update.0.push(scope);
            update.1.push(key);
            update.2.push(seq);
            update.3.push(body);
            update.4.push(seal::seal_body(Some(keys), &opened));
        }
        let written = sqlx::query(
            "UPDATE ordering_waiting w SET body = u.new_body
             FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bytea[], $5::bytea[])
                  AS u(scope, ordering_key, seq, old_body, new_body)
             WHERE w.scope = u.scope AND w.ordering_key = u.ordering_key AND w.seq = u.seq
               AND w.body = u.old_body",
        )
        .bind(&update.0)
        .bind(&update.1)
        .bind(&update.2)
        .bind(&update.3)
        .bind(&update.4)
        .execute(pool)
        .await?;
        done.waiting += written.rows_affected();
        done.raced += update.0.len() as u64 - written.rows_affected();
        tokio::time::sleep(pause).await;
    }
}

/// What one key (or, for `key: None`, no key) holds now.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KeyUse {
    /// The key id; none: plaintext values and unkeyed fingerprints.
    pub key: Option<String>,
    /// When the key was first seen, superseded and retired (from `idem_keys`).
    pub registered_at: Option<DateTime<Utc>>,
    /// When a newer key became the one new writes use.
    pub superseded_at: Option<DateTime<Utc>>,
    /// When it was retired.
    pub retired_at: Option<DateTime<Utc>>,
    /// Results and HTTP answers sealed with it.
    pub results: i64,
    /// Provider references sealed with it.
    pub references: i64,
    /// Follow-up bodies sealed with it.
    pub bodies: i64,
    /// Bodies of deliveries waiting for their turn sealed with it.
    pub waiting: i64,
    /// Records whose fingerprint it made (they keep it until gc deletes them).
    pub fingerprints: i64,
}

/// What every key holds, and what no key does (plaintext), from a scan of the tables.
pub async fn key_use(pool: &PgPool) -> Result<Vec<KeyUse>, StoreError> {
    let counts: Vec<(Option<String>, String, i64)> = sqlx::query_as(
        "SELECT k, what, count(*) FROM (
             SELECT result ->> '$idem_sealed' AS k, 'result' AS what
               FROM processed_operations WHERE result IS NOT NULL
             UNION ALL
             SELECT CASE WHEN starts_with(external_ref, '$idem_sealed:')
                         THEN split_part(external_ref, ':', 2) END, 'reference'
               FROM processed_operations WHERE external_ref IS NOT NULL
             UNION ALL
             SELECT fingerprint_key, 'fingerprint' FROM processed_operations
             UNION ALL
             SELECT CASE WHEN substring(body FROM 1 FOR 13) = '\\x006964656d2d7365616c656400'::bytea
                         THEN convert_from(substring(body FROM 15 FOR get_byte(body, 13)), 'UTF8')
                    END, 'body'
               FROM outbox_messages
             UNION ALL
             SELECT CASE WHEN substring(body FROM 1 FOR 13) = '\\x006964656d2d7365616c656400'::bytea
                         THEN convert_from(substring(body FROM 15 FOR get_byte(body, 13)), 'UTF8')
                    END, 'waiting'
               FROM ordering_waiting
         ) t GROUP BY k, what",
    )
    .fetch_all(pool)
    .await?;
    type Registered = (
        String,
        DateTime<Utc>,
        Option<DateTime<Utc>>,
        Option<DateTime<Utc>>,
    );
    let registered: Vec<Registered> = sqlx::query_as(
        "SELECT id, registered_at, superseded_at, retired_at FROM idem_keys
             ORDER BY registered_at DESC, id",
    )
    .fetch_all(pool)
    .await?;
    let mut uses: BTreeMap<Option<String>, KeyUse> = BTreeMap::new();
    for (id, registered_at, superseded_at, retired_at) in registered {
        uses.insert(
            Some(id.clone()),
            KeyUse {
                key: Some(id),
                registered_at: Some(registered_at),
                superseded_at,
                retired_at,
                ..KeyUse::default()
            },
        );
    }
    for (key, what, n) in counts {
        let entry = uses.entry(key.clone()).or_insert_with(|| KeyUse {
            key,
            ..KeyUse::default()
        });
        match what.as_str() {
            "result" => entry.results = n,
            "reference" => entry.references = n,
            "fingerprint" => entry.fingerprints = n,
            "waiting" => entry.waiting = n,
            _ => entry.bodies = n,
        }
    }
    Ok(uses.into_values().collect())
}

/// Why a key could not be retired.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RetireError {
    /// Something is still under the key.
    #[error(
        "key {id:?} still holds {results} result(s), {references} reference(s), {bodies} \
         follow-up bod(ies), {waiting} waiting deliver(ies) and {fingerprints} fingerprint(s): \
         run `idem keys rotate` (values) and wait for gc (fingerprints expire with their \
         records)"
    )]
    InUse {
        /// The key.
        id: String,
        /// As in [`KeyUse`].
        results: i64,
        /// As in [`KeyUse`].
        references: i64,
        /// As in [`KeyUse`].
        bodies: i64,
        /// As in [`KeyUse`].
        waiting: i64,
        /// As in [`KeyUse`].
        fingerprints: i64,
    },
    /// No such key is registered.
    #[error("no key {0:?} is registered in idem_keys")]
    Unknown(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Marks key `id` retired once nothing is under it, so that processes may start
/// without it; refuses while anything is.
pub async fn retire(pool: &PgPool, id: &str) -> Result<(), RetireError> {
    let uses = key_use(pool).await?;
    let Some(found) = uses.into_iter().find(|u| u.key.as_deref() == Some(id)) else {
        return Err(RetireError::Unknown(id.to_owned()));
    };
    // A waiting delivery's fingerprint is made with the key that was newest when it
    // parked, and no rotation can make it again (its payload is only in its sealed body):
    // one parked before `id` was superseded keeps `id` in use.
    let parked_before: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ordering_waiting w, idem_keys k
          WHERE k.id = $1 AND (k.superseded_at IS NULL OR w.waiting_since <= k.superseded_at)",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .map_err(StoreError::from)?;
    let found = KeyUse {
        waiting: found.waiting.max(parked_before),
        ..found
    };
    if found.results + found.references + found.bodies + found.waiting + found.fingerprints > 0 {
        return Err(RetireError::InUse {
            id: id.to_owned(),
            results: found.results,
            references: found.references,
            bodies: found.bodies,
            waiting: found.waiting,
            fingerprints: found.fingerprints,
        });
    }
    sqlx::query("UPDATE idem_keys SET retired_at = now() WHERE id = $1 AND retired_at IS NULL")
        .bind(id)
        .execute(pool)
        .await
        .map_err(StoreError::from)?;
    Ok(())
}

impl From<SealError> for RetireError {
    fn from(error: SealError) -> Self {
        RetireError::Store(error.into())
    }
}
