//! A stand-in for an external API (a payment provider, an e-mail service) in tests of
//! handlers with external effects: it records every call, accepts each idempotency key
//! once (as payment APIs do: a repeat gets the first receipt back), and can be told to
//! fail before accepting, to accept and time out, or to be down.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;

/// A fake provider; clones share its state.
#[derive(Debug, Clone, Default)]
pub struct FakeProvider {
    state: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    /// Every call, accepted or not.
    calls: usize,
    /// The accepted requests, in order: the provider's effects.
    accepted: Vec<Receipt>,
    /// How the next calls fail, one each, with the number each was queued under.
    failing: VecDeque<(u64, Failing)>,
    /// The number the next queued failure gets.
    next_failure: u64,
    down: bool,
}

/// One accepted request: the provider's effect.
#[derive(Debug, Clone, PartialEq)]
pub struct Receipt {
    /// The provider's reference for it (`ch_1`, `ch_2`, …).
    pub id: String,
    /// The idempotency key it was sent with, if any.
    pub idempotency_key: Option<String>,
    /// What was asked.
    pub request: Value,
}

/// How a call fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failing {
    /// Refused before accepting anything (a 503): nothing happened, a retry is safe.
    BeforeAccepting,
    /// Accepted, then the answer was lost (a timeout): the effect happened, and the
    /// caller cannot know; only asking the provider ([`FakeProvider::find`]) tells.
    AfterAccepting,
}

/// What a call returns when it fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderError {
    /// 503: nothing was accepted.
    #[error("the provider is unavailable (503); nothing was accepted")]
    Unavailable,
    /// The call timed out: it may have been accepted.
    #[error("the provider did not answer in time; the request may have been accepted")]
    TimedOut,
    /// The provider cannot be reached at all.
    #[error("the provider cannot be reached")]
    Down,
}

impl FakeProvider {
    /// A provider that accepts everything.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding it has failed already; its state is
        // still the best account of what happened.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `request`. A key the provider accepted before gets that first receipt back
    /// and no second effect; a call without a key is a new effect every time.
    pub async fn call(
        &self,
        idempotency_key: Option<&str>,
        request: Value,
    ) -> Result<Receipt, ProviderError> {
        let mut state = self.state();
        state.calls += 1;
        if state.down {
            return Err(ProviderError::Down);
        }
        let failing = state.failing.pop_front().map(|(_, how)| how);
        if failing == Some(Failing::BeforeAccepting) {
            return Err(ProviderError::Unavailable);
        }
        let earlier = idempotency_key.and_then(|key| {
            state
                .accepted
                .iter()
                .find(|r| r.idempotency_key.as_deref() == Some(key))
                .cloned()
        });
        let receipt = match earlier {
            Some(receipt) => receipt,
            None => {
                let receipt = Receipt {
                    id: format!("ch_{}", state.accepted.len() + 1),
                    idempotency_key: idempotency_key.map(str::to_owned),
                    request,
                };
                state.accepted.push(receipt.clone());
                receipt
            }
        };
        match failing {
            Some(Failing::AfterAccepting) => Err(ProviderError::TimedOut),
            _ => Ok(receipt),
        }
    }

    /// The receipt of the request accepted under `idempotency_key`, if any: what a
    /// handler's `reconcile` asks after an uncertain call.
    pub fn find(&self, idempotency_key: &str) -> Option<Receipt> {
        self.state()
            .accepted
            .iter()
            .find(|r| r.idempotency_key.as_deref() == Some(idempotency_key))
            .cloned()
    }

    /// Makes the next call fail `how` (several calls queue up, one failure each).
    pub fn fail_next(&self, how: Failing) {
        self.fail_next_once(how);
    }

    /// Forgets the failures queued by [`FakeProvider::fail_next`] that no call met.
    pub fn clear_failures(&self) {
        self.state().failing.clear();
    }

    /// Queues `how` as [`FakeProvider::fail_next`] does, and returns what to give
    /// [`FakeProvider::withdraw`] to take it back if no call meets it.
    pub(crate) fn fail_next_once(&self, how: Failing) -> u64 {
        let mut state = self.state();
        let ticket = state.next_failure;
        state.next_failure += 1;
        state.failing.push_back((ticket, how));
        ticket
    }

    /// Takes back the failure queued under `ticket`, if no call met it.
    pub(crate) fn withdraw(&self, ticket: u64) {
        self.state().failing.retain(|(queued, _)| *queued != ticket);
    }

    /// Takes the provider down (every call fails with [`ProviderError::Down`]) or back up.
    pub fn set_down(&self, down: bool) {
        self.state().down = down;
    }

    /// How many calls it got, accepted or not.
    pub fn calls(&self) -> usize {
        self.state().calls
    }

    /// The accepted requests, in order: its effects.
    pub fn accepted(&self) -> Vec<Receipt> {
        self.state().accepted.clone()
    }

    /// How many accepted requests `matches`: the effects of one intent, for
    /// [`Check::run`](super::Check::run)'s counter.
    pub fn effects(&self, matches: impl Fn(&Value) -> bool) -> i64 {
        let count = self
            .state()
            .accepted
            .iter()
            .filter(|r| matches(&r.request))
            .count();
        i64::try_from(count).unwrap_or(i64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[tokio::test]
    async fn a_key_is_accepted_once_and_a_timeout_still_accepts() {
        let provider = FakeProvider::new();
        let first = provider.call(Some("k1"), json!({"n": 1})).await.unwrap();
        let again = provider.call(Some("k1"), json!({"n": 1})).await.unwrap();
        assert_eq!(first, again);
        provider.call(None, json!({"n": 2})).await.unwrap();
        provider.call(None, json!({"n": 2})).await.unwrap();
        assert_eq!(provider.effects(|r| r["n"] == 1), 1);
        assert_eq!(
            provider.effects(|r| r["n"] == 2),
            2,
            "no key, no deduplication"
        );

        provider.fail_next(Failing::BeforeAccepting);
        provider.fail_next(Failing::AfterAccepting);
        assert_eq!(
            provider.call(Some("k3"), json!({"n": 3})).await,
            Err(ProviderError::Unavailable)
        );
        assert!(provider.find("k3").is_none(), "a 503 accepts nothing");
        assert_eq!(
            provider.call(Some("k3"), json!({"n": 3})).await,
            Err(ProviderError::TimedOut)
        );
        assert_eq!(provider.find("k3").map(|r| r.id), Some("ch_4".into()));
        provider.set_down(true);
        assert_eq!(
            provider.call(Some("k4"), json!({})).await,
            Err(ProviderError::Down)
        );
        assert_eq!(provider.calls(), 7);
    }
}
