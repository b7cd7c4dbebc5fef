//! What a replay would do with a dead letter, told from its headers and its record
//! before anything is done: what the console's pages and a dry run show.

use super::letters::DlqMessage;
use crate::dead_letter::Reason;
use crate::key::Key;
use crate::store::{Store, StoreError};

/// What a replay would do with a dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preview {
    /// Its key is completed: acked in the DLQ, not republished.
    AlreadyDone,
    /// Republished: the operation runs again.
    Runs,
    /// A fingerprint conflict: left in the DLQ.
    Conflict,
    /// Malformed (no valid key, or data the database refuses): left in the DLQ.
    Malformed,
}

/// What a replay would do with `m` (one read of its record when it has a key).
pub async fn preview(store: &Store, m: &DlqMessage) -> Result<Preview, StoreError> {
    let previews = preview_all(store, std::slice::from_ref(m)).await?;
    Ok(previews.first().copied().unwrap_or(Preview::Malformed))
}

/// What a replay would do with each of `messages`, in order, with one read of the
/// records of all their keys (one statement): the same rule as [`preview`].
pub async fn preview_all(
    store: &Store,
    messages: &[DlqMessage],
) -> Result<Vec<Preview>, StoreError> {
    let mut previews: Vec<Option<Preview>> = messages.iter().map(left_alone).collect();
    // The keys of the messages a replay would republish, and where they stand.
    let (at, keys): (Vec<usize>, Vec<Key>) = messages
        .iter()
        .enumerate()
        .filter(|(i, _)| previews[*i].is_none())
        .filter_map(|(i, m)| Some((i, m.key()?)))
        .unzip();
    for (i, done) in at.into_iter().zip(store.completed(&keys).await?) {
        previews[i] = Some(if done {
            Preview::AlreadyDone
        } else {
            Preview::Runs
        });
    }
    // A message left with neither has no key, which left_alone calls malformed.
    Ok(previews
        .into_iter()
        .map(|p| p.unwrap_or(Preview::Malformed))
        .collect())
}

/// Whether `m` was dead-lettered because no handler of its queue took its type: it has
/// no key (no handler derived one), and a replay republishes it as it is, for the
/// handler deployed since.
pub(super) fn unroutable(m: &DlqMessage) -> bool {
    m.reason.as_deref() == Some(Reason::Unroutable.as_str())
}

/// What a replay does with `m`, known from the headers alone: it leaves a conflict in
/// the DLQ, and a message malformed by its own data (no valid key, or one the database
/// refused, even with a valid key): the same bytes would fail the same way; it
/// republishes an unroutable one.
pub(super) fn left_alone(m: &DlqMessage) -> Option<Preview> {
    if m.reason.as_deref() == Some(Reason::FingerprintConflict.as_str()) {
        return Some(Preview::Conflict);
    }
    if unroutable(m) {
        return Some(Preview::Runs);
    }
    let malformed = m.key().is_none() || m.reason.as_deref() == Some(Reason::Malformed.as_str());
    malformed.then_some(Preview::Malformed)
}
