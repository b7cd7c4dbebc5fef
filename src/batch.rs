//! Batch handlers (docs/DESIGN.md, "Batch handlers"): the deliveries a transactional
//! batch runs together, handed to [`crate::Handler::handle_batch`] in one call so that
//! a handler whose effects are rows in this database can write them with one
//! set-based statement instead of one statement per message.

use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use crate::handler::Context;
use crate::key::Key;
use crate::outbox::{FollowUp, FollowUpError};

/// The messages of one batch, each with its own [`Context`] (key, attempt, envelope,
/// provider key), and the one transaction they share.
///
/// Only deliveries that would run alone reach a batch: no conflict, no malformed body,
/// no duplicate of a completed key, and one copy of a key that came twice. What the
/// handler writes through [`Batch::tx`] commits with every message's `completed`
/// record in one commit, or not at all.
///
/// ```no_run
/// # use idem::{Batch, HandlerError};
/// # struct Entry { event_id: String, amount_cents: i64 }
/// async fn book(batch: &mut Batch<Entry>) -> Result<Vec<Result<(), HandlerError>>, HandlerError> {
///     let ids: Vec<String> = batch.messages().iter().map(|e| e.event_id.clone()).collect();
///     let amounts: Vec<i64> = batch.messages().iter().map(|e| e.amount_cents).collect();
///     sqlx::query("INSERT INTO ledger (event_id, amount_cents) SELECT * FROM unnest($1::text[], $2::bigint[])")
///         .bind(&ids)
///         .bind(&amounts)
///         .execute(batch.tx().await?)
///         .await?;
///     Ok(vec![Ok(()); batch.len()])
/// }
/// ```
pub struct Batch<M> {
    messages: Vec<M>,
    contexts: Vec<Context>,
    pool: PgPool,
    tx: Option<Transaction<'static, Postgres>>,
    /// Whether the handler took the transaction or staged a follow-up.
    touched: bool,
}

impl<M> Batch<M> {
    pub(crate) fn new(
        messages: Vec<M>,
        contexts: Vec<Context>,
        pool: PgPool,
        tx: Option<Transaction<'static, Postgres>>,
    ) -> Self {
        Self {
            messages,
            contexts,
            pool,
            tx,
            touched: false,
        }
    }

    /// A batch for calling a batch handler in a test, outside a worker: the first run
    /// of each key, on `pool`. Nothing is claimed or recorded; what the handler writes
    /// through [`Batch::tx`] stays in a transaction that [`Batch::into_transaction`]
    /// hands back, to commit or drop.
    pub fn for_test(pool: PgPool, items: Vec<(Key, M)>) -> Self {
        let (keys, messages): (Vec<Key>, Vec<M>) = items.into_iter().unzip();
        let contexts = keys
            .into_iter()
            .map(|key| Context::for_test(key, pool.clone()))
            .collect();
        Self::new(messages, contexts, pool, None)
    }

    /// How many messages the batch holds (at least one).
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Never true for a batch the worker hands over.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The messages, in the order the outcomes are answered in.
    pub fn messages(&self) -> &[M] {
        &self.messages
    }

    /// Each message with its context, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&M, &Context)> {
        self.messages.iter().zip(&self.contexts)
    }

    /// The context of message `item` (its key, attempt, envelope, provider key), or
    /// `None` past the end.
    pub fn context(&self, item: usize) -> Option<&Context> {
        self.contexts.get(item)
    }

    /// The batch's transaction: what goes through it commits atomically with every
    /// message's `completed` record, and is rolled back with all of them.
    pub async fn tx(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        self.touched = true;
        let tx = match self.tx.take() {
            Some(tx) => tx,
            None => self.pool.begin().await?,
        };
        Ok(&mut **self.tx.insert(tx))
    }

    /// Stages a follow-up message of message `item`, as [`Context::publish`] does for
    /// a one-message run: it carries that message's ids, correlation and trace, and is
    /// published after the batch commits.
    pub async fn publish(
        &mut self,
        item: usize,
        message: FollowUp,
    ) -> Result<String, FollowUpError> {
        let Some(ctx) = self.contexts.get_mut(item) else {
            return Err(FollowUpError::Invalid(format!(
                "no message {item} in a batch of {}",
                self.messages.len()
            )));
        };
        self.touched = true;
        ctx.lend_tx(self.tx.take());
        let staged = ctx.publish(message).await;
        self.tx = ctx.take_tx();
        staged
    }

    /// The transaction the handler opened through [`Batch::tx`], if any, to commit.
    pub fn into_transaction(self) -> Option<Transaction<'static, Postgres>> {
        self.tx
    }

    /// Whether the handler took the batch's transaction or staged a follow-up.
    pub(crate) fn touched(&self) -> bool {
        self.touched
    }

    /// The messages, their contexts (with what each staged) and the transaction.
    pub(crate) fn into_parts(
        self,
    ) -> (Vec<M>, Vec<Context>, Option<Transaction<'static, Postgres>>) {
        (self.messages, self.contexts, self.tx)
    }
}
