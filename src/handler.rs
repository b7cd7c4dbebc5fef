//! The `Handler` trait users implement for a job type, and the context it runs in.

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use crate::batch::Batch;
pub use crate::envelope::Envelope;
use crate::fault::Fault;
use crate::headers;
use crate::key::Key;
use crate::ordering::Ordered;
use crate::outbox::{self, FollowUp, FollowUpError, SHORT_STRING_MAX};
use crate::protect::Keys;
use crate::trace::{TRACEPARENT, TraceContext};

/// One job type: how to read its messages, name their intent, and run the effect.
///
/// The worker parses each message body as a JSON object, deserializes it into
/// [`Handler::Message`] (a body that does not fit is dead-lettered as `malformed`),
/// derives the key with [`Handler::scope`] and [`Handler::idempotency_key`], claims it
/// and calls [`Handler::handle`] only when the store says this intent has not run yet.
///
/// ```no_run
/// use idem::{Context, Handler, HandlerError};
/// use serde::Deserialize;
///
/// #[derive(Deserialize)]
/// struct Welcome { event_id: String, tenant: String, email: String }
///
/// struct SendWelcome;
///
/// impl Handler for SendWelcome {
///     type Message = Welcome;
///     type Output = serde_json::Value;
///     const OPERATION: &'static str = "emails.welcome";
///
///     fn scope(&self, m: &Welcome) -> String { m.tenant.clone() }
///     fn idempotency_key(&self, m: &Welcome) -> String { m.event_id.clone() }
///
///     async fn handle(&self, m: Welcome, ctx: &mut Context) -> Result<serde_json::Value, HandlerError> {
///         // Pass ctx.provider_key() to the mail provider as its idempotency key, so a
///         // takeover after a crash repeats the same request instead of a new one.
///         let _ = (m.email, ctx.provider_key());
///         Ok(serde_json::json!({"sent": true}))
///     }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// The message body's type, read from JSON.
    type Message: DeserializeOwned + Send + Sync + 'static;
    /// What a successful run returns; stored on the record and replayable.
    type Output: Serialize + Send + 'static;

    /// The operation name, the second part of every key (e.g. `orders.create`).
    const OPERATION: &'static str;

    /// The tenant or actor the message belongs to, the first part of the key.
    fn scope(&self, message: &Self::Message) -> String;

    /// The idempotency key, derived from the business event ID: never from the broker's
    /// message id, nor from the body alone (two identical bodies can be two intents).
    fn idempotency_key(&self, message: &Self::Message) -> String;

    /// Fields left out of the fingerprint because producers change them on a resend
    /// (`sent_at`, trace ids); dotted paths reach into objects (`meta.sent_at`).
    fn volatile_fields(&self) -> &'static [&'static str] {
        &[]
    }

    /// Where the message stands in its entity's order, for deliveries that must run one
    /// at a time per entity, in sequence (docs/DESIGN.md, "Order per entity"); the
    /// default, `None`, runs every delivery as it comes, at full concurrency.
    fn ordering(&self, message: &Self::Message) -> Option<Ordered> {
        let _ = message;
        None
    }

    /// Runs the effect once for this intent.
    ///
    /// Database writes made through [`Context::tx`] commit atomically with the
    /// `completed` record, and are rolled back if another worker took the operation
    /// over meanwhile. External calls should carry [`Context::provider_key`].
    fn handle(
        &self,
        message: Self::Message,
        ctx: &mut Context,
    ) -> impl Future<Output = Result<Self::Output, HandlerError>> + Send;

    /// Runs several messages at once on one transaction, for a handler whose effects are
    /// all writes in this database (a ledger, a projection): one `unnest` insert for the
    /// batch instead of one insert per message. Used in [`crate::Mode::Transactional`]
    /// only, with the deliveries the worker decides together; answers one outcome per
    /// message of [`Batch::messages`], in order. The default, `None`, runs each message
    /// through [`Handler::handle`].
    ///
    /// When an outcome is an error (or the call panics, or answers a wrong count), the
    /// batch's writes are rolled back and every message runs again through
    /// [`Handler::handle`] in a savepoint of its own, so that only the failing one's
    /// writes are undone: `handle` must do what `handle_batch` does for one message.
    fn handle_batch(
        &self,
        batch: &mut Batch<Self::Message>,
    ) -> impl Future<Output = Option<Vec<Result<Self::Output, HandlerError>>>> + Send {
        let _ = batch;
        async { None }
    }

    /// Finds out what became of an operation left `pending` (an uncertain outcome):
    /// ask the provider with `external_ref`. The default says it cannot tell, so the
    /// operation stays pending and is retried later; it is never re-run blindly.
    fn reconcile(
        &self,
        message: &Self::Message,
        external_ref: Option<&str>,
        ctx: &mut Context,
    ) -> impl Future<Output = Result<Reconciliation<Self::Output>, HandlerError>> + Send {
        let _ = (message, external_ref, ctx);
        async { Ok(Reconciliation::Unknown) }
    }
}

/// What [`Handler::reconcile`] found out about a pending operation.
#[derive(Debug, Clone, PartialEq)]
pub enum Reconciliation<O> {
    /// The effect happened; complete the operation with this output.
    Applied(O),
    /// The effect certainly did not happen; it is safe to run the handler again.
    NotApplied,
    /// Still unknown; keep it pending and ask again later.
    Unknown,
}

/// How a handler failed, which decides what happens next.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// Worth retrying (a timeout before anything was sent, a lock, a 503): retried in
    /// process with backoff, then through the retry queues, then dead-lettered as
    /// `retries_exhausted`.
    #[error("transient: {0}")]
    Transient(String),
    /// Retrying cannot help (invalid input, a refused charge): dead-lettered at once as
    /// `permanent_failure`, never run again unless replayed.
    #[error("permanent: {0}")]
    Permanent(String),
    /// The outcome is unknown (a timeout after the request was sent): the operation
    /// becomes `pending` with the provider's reference and is reconciled, not re-run.
    #[error("uncertain: {error}")]
    Uncertain {
        /// The provider's reference for the request, for [`Handler::reconcile`].
        external_ref: Option<String>,
        /// What happened.
        error: String,
    },
}

impl HandlerError {
    /// A transient failure.
    pub fn transient(error: impl Display) -> Self {
        Self::Transient(error.to_string())
    }

    /// A permanent failure.
    pub fn permanent(error: impl Display) -> Self {
        Self::Permanent(error.to_string())
    }

    /// An uncertain outcome with the provider's reference.
    pub fn uncertain(external_ref: Option<String>, error: impl Display) -> Self {
        Self::Uncertain {
            external_ref,
            error: error.to_string(),
        }
    }

    /// `transient`, `permanent` or `uncertain`: the kind stored in the record's `error`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Transient(_) => "transient",
            Self::Permanent(_) => "permanent",
            Self::Uncertain { .. } => "uncertain",
        }
    }

    /// The message without the kind, as stored in the record's `error`.
    pub fn message(&self) -> &str {
        match self {
            Self::Transient(e) | Self::Permanent(e) => e,
            Self::Uncertain { error, .. } => error,
        }
    }
}

/// A database error fails the run by its cause (docs/DESIGN.md, "Errors by cause"), so
/// `?` works on sqlx calls in a handler: the data's fault (SQLSTATE classes 22, 23, 54)
/// is permanent, dead-lettered at once; an outage or anything else is transient.
impl From<sqlx::Error> for HandlerError {
    fn from(error: sqlx::Error) -> Self {
        let text = format!(
            "{}{}",
            crate::fault::FROM_DATABASE,
            crate::fault::describe(&error)
        );
        match crate::fault::classify(&error) {
            Fault::Message => Self::Permanent(text),
            Fault::Outage | Fault::Unknown => Self::Transient(text),
        }
    }
}

/// A follow-up the handler got wrong fails the run for good; one the database did not
/// take fails by the database error's cause.
impl From<FollowUpError> for HandlerError {
    fn from(error: FollowUpError) -> Self {
        match error {
            FollowUpError::Invalid(why) => Self::Permanent(why),
            FollowUpError::Database(error) => error.into(),
        }
    }
}

/// Marks any error as transient or permanent: `call().await.transient()?`.
pub trait ResultExt<T> {
    /// Maps the error to [`HandlerError::Transient`].
    fn transient(self) -> Result<T, HandlerError>;
    /// Maps the error to [`HandlerError::Permanent`].
    fn permanent(self) -> Result<T, HandlerError>;
}

impl<T, E: Display> ResultExt<T> for Result<T, E> {
    fn transient(self) -> Result<T, HandlerError> {
        self.map_err(HandlerError::transient)
    }
    fn permanent(self) -> Result<T, HandlerError> {
        self.map_err(HandlerError::permanent)
    }
}

/// What a handler knows about the run it is in.
pub struct Context {
    key: Key,
    attempt: i32,
    takeover: bool,
    pool: PgPool,
    tx: Option<Transaction<'static, Postgres>>,
    /// The source message's correlation id, carried on to follow-up messages.
    correlation_id: Option<String>,
    /// The trace context follow-up messages carry.
    trace: Option<TraceContext>,
    /// Outbox rows staged by this run, in order.
    staged: Vec<i64>,
    /// How long the committing worker has its staged rows to itself.
    handoff: Duration,
    /// What the message carried.
    envelope: Arc<Envelope>,
    /// The keys follow-up bodies are sealed with (`StoreConfig::keys`).
    keys: Option<Keys>,
}

impl Context {
    pub(crate) fn new(key: Key, attempt: i32, takeover: bool, pool: PgPool) -> Self {
        Self {
            key,
            attempt,
            takeover,
            pool,
            tx: None,
            correlation_id: None,
            trace: None,
            staged: Vec::new(),
            handoff: Duration::ZERO,
            envelope: Arc::default(),
            keys: None,
        }
    }

    /// A context for calling a handler in a test, outside a worker: the first run of
    /// `key`, on `pool`. Nothing is claimed or recorded; what the handler writes through
    /// [`Context::tx`] (its follow-ups included) stays in a transaction that
    /// [`Context::into_transaction`] hands back, to commit or drop.
    ///
    /// ```no_run
    /// # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// # struct Orders;
    /// # impl idem::Handler for Orders {
    /// #     type Message = serde_json::Value; type Output = ();
    /// #     const OPERATION: &'static str = "orders.create";
    /// #     fn scope(&self, _: &serde_json::Value) -> String { "acme".into() }
    /// #     fn idempotency_key(&self, _: &serde_json::Value) -> String { "evt-1".into() }
    /// #     async fn handle(&self, _: serde_json::Value, _: &mut idem::Context) -> Result<(), idem::HandlerError> { Ok(()) }
    /// # }
    /// use idem::{Context, Handler, Key};
    ///
    /// let key = Key::new("acme", Orders::OPERATION, "evt-1")?;
    /// let mut ctx = Context::for_test(key, pool.clone());
    /// Orders.handle(serde_json::json!({"event_id": "evt-1"}), &mut ctx).await?;
    /// if let Some(tx) = ctx.into_transaction() {
    ///     tx.commit().await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn for_test(key: Key, pool: PgPool) -> Self {
        Self::new(key, 1, false, pool)
    }

    /// The same context as run `attempt` (from 1), a takeover of a crashed run or not:
    /// what [`Context::attempt`] and [`Context::is_takeover`] tell the handler.
    pub fn retried(mut self, attempt: i32, takeover: bool) -> Self {
        self.attempt = attempt;
        self.takeover = takeover;
        self
    }

    /// The transaction the handler opened through [`Context::tx`], if any, to commit.
    pub fn into_transaction(mut self) -> Option<Transaction<'static, Postgres>> {
        self.tx.take()
    }

    /// Follow-ups' correlation id and trace context, and the committing worker's handoff.
    pub(crate) fn for_follow_ups(
        mut self,
        correlation_id: Option<String>,
        trace: Option<TraceContext>,
        handoff: Duration,
    ) -> Self {
        self.correlation_id = correlation_id;
        self.trace = trace;
        self.handoff = handoff;
        self
    }

    /// The message as the broker delivered it, for the run's message: its type,
    /// headers, ids, exchange and routing key.
    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// Seals the bodies of follow-up messages with `keys` (`StoreConfig::keys`).
    pub(crate) fn sealing_with(mut self, keys: Option<Keys>) -> Self {
        self.keys = keys;
        self
    }

    /// The context for a run of a message that came in `envelope`.
    pub(crate) fn with_envelope(mut self, envelope: Arc<Envelope>) -> Self {
        self.envelope = envelope;
        self
    }

    /// The operation's key.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// A stable string for this intent to pass to external providers as *their*
    /// idempotency key: the same on every attempt and after a takeover, so a repeated
    /// request is recognised by the provider instead of executed twice.
    pub fn provider_key(&self) -> String {
        self.key.digest()
    }

    /// Which claim of this key this run is, from 1.
    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    /// True when a previous worker's lease expired while it ran this operation: it may
    /// have done part of the work before it died.
    pub fn is_takeover(&self) -> bool {
        self.takeover
    }

    /// The W3C trace context of this run (`traceparent`), to pass to the providers it
    /// calls so that their spans join the trace: the handler's span with OpenTelemetry
    /// on, otherwise the context the message arrived with. `None` when there is none.
    pub fn traceparent(&self) -> Option<&str> {
        self.trace.as_ref().map(TraceContext::traceparent)
    }

    /// The pool, for reads and for writes that must not wait for the outcome (they are
    /// *not* rolled back with the operation).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A transaction that commits atomically with the `completed` record, fenced by the
    /// lease: if another worker took over, it is rolled back. It is opened on first use,
    /// so a handler that calls a slow provider first holds no transaction meanwhile.
    pub async fn tx(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        let tx = match self.tx.take() {
            Some(tx) => tx,
            None => self.pool.begin().await?,
        };
        Ok(&mut **self.tx.insert(tx))
    }

    pub(crate) fn take_tx(&mut self) -> Option<Transaction<'static, Postgres>> {
        self.tx.take()
    }

    /// The keys follow-up bodies are sealed with.
    pub(crate) fn keys(&self) -> Option<&Keys> {
        self.keys.as_ref()
    }

    /// Lends the context a batch's transaction, for one call that writes through it.
    pub(crate) fn lend_tx(&mut self, tx: Option<Transaction<'static, Postgres>>) {
        self.tx = tx;
    }

    /// Stages a follow-up message (docs/DESIGN.md, "Follow-up messages"): it is written
    /// to the outbox in [`Context::tx`] and published after the operation's outcome
    /// commits; if the run fails, or another worker took the operation over, it is
    /// rolled back and never sent. Returns its id, the AMQP `message_id` of every
    /// publish of it: [`Context::next_message_id`] before the call.
    ///
    /// The message carries the headers `idem-source-key` (this operation's short key
    /// hash) and, when the source message had one, `idem-correlation-id`; its
    /// `correlation_id` is the source message's unless set on the [`FollowUp`]. It
    /// carries this run's trace context ([`Context::traceparent`]) unless it sets a
    /// `traceparent` header of its own: stored now, it joins the trace whenever the
    /// message is published.
    pub async fn publish(&mut self, message: FollowUp) -> Result<String, FollowUpError> {
        message.check()?;
        let position = self.staged.len() as u32;
        let id = outbox::message_id(&self.key, position);
        let mut message = message.header(headers::SOURCE_KEY, self.key.short_hash());
        if let Some(correlation_id) = &self.correlation_id {
            // The header has no length limit; the property does (a longer source id
            // travels in the header only).
            message = message.header(headers::CORRELATION, correlation_id.as_str());
            if message.properties.correlation_id.is_none()
                && correlation_id.len() <= SHORT_STRING_MAX
            {
                message = message.correlation_id(correlation_id.as_str());
            }
        }
        if let Some(trace) = &self.trace
            && !message.properties.headers.contains_key(TRACEPARENT)
        {
            for (name, value) in trace.headers() {
                message = message.header(name, value);
            }
        }
        let (source, operation) = (self.key.digest(), self.key.operation().to_owned());
        let handoff = self.handoff;
        let message = message.sealed(self.keys.as_ref());
        let conn = self.tx().await?;
        let row =
            outbox::stage(conn, &source, &operation, position, &id, &message, handoff).await?;
        self.staged.push(row);
        Ok(id)
    }

    /// The id the next [`Context::publish`] gives its message, for a body that names
    /// itself (`{"event_id": …}`, so that a downstream idem consumer keys on it).
    pub fn next_message_id(&self) -> String {
        outbox::message_id(&self.key, self.staged.len() as u32)
    }

    /// The outbox rows this run staged, for dispatch after the commit.
    pub(crate) fn take_staged(&mut self) -> Vec<i64> {
        std::mem::take(&mut self.staged)
    }

    /// Hands the context a transaction that is already open: in transactional mode, the
    /// batch's, so the handler's writes commit with the claim and the outcome.
    pub(crate) fn with_tx(mut self, tx: Transaction<'static, Postgres>) -> Self {
        self.tx = Some(tx);
        self
    }

    /// This context, with its transaction and keys, becomes `next` for the next run of a
    /// transactional batch (its key, claim, follow-ups' ids and trace, envelope).
    pub(crate) fn next_run(&mut self, next: Context) {
        let (tx, keys) = (self.tx.take(), self.keys.take());
        *self = Context { tx, keys, ..next };
    }

    /// Commits the context's transaction, if it opened one (a run that never wrote
    /// has none: nothing to commit).
    pub(crate) async fn commit(&mut self) -> Result<(), sqlx::Error> {
        match self.tx.take() {
            Some(tx) => tx.commit().await,
            None => Ok(()),
        }
    }
}
