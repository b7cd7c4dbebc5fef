//! HTTP entry points on the same store: an `Idempotency-Key` layer for axum routes
//! (docs/DESIGN.md, "HTTP entry points"; feature `http`).
//!
//! A request with an `Idempotency-Key` is an intent like a message: scope = the
//! authenticated principal (the application's [`Idempotency::new`] closure says how to
//! get it), operation = method and matched route (`POST /payments`), key = the header.
//! The fingerprint is the canonical JSON of the body and the request target, so the
//! same key with another body or URL is a conflict (422), never a second run. The first
//! request claims the record with a lease and runs the handler; its writes go through
//! the request's [`Tx`] and commit with the stored response and the fencing check.
//! A repeat while it runs gets 409 (`Retry-After`), or 202 with a `Location` to poll
//! where the route says so; a repeat afterwards gets the stored status, allow-listed
//! headers and byte-identical body, marked `Idempotency-Replayed: true`.
//!
//! ```no_run
//! use axum::{Json, Router, http::StatusCode, routing::post};
//! use idem::http::{Idempotency, Tx};
//!
//! async fn create(mut tx: Tx, Json(p): Json<serde_json::Value>)
//!     -> Result<(StatusCode, Json<serde_json::Value>), idem::HandlerError> {
//!     sqlx::query("INSERT INTO payments (body) VALUES ($1)").bind(&p).execute(&mut *tx).await?;
//!     Ok((StatusCode::CREATED, Json(p)))
//! }
//!
//! # fn principal(_: &axum::http::request::Parts) -> Result<String, axum::response::Response> { Ok("alice".into()) }
//! # fn app(store: idem::Store) -> Router {
//! let keys = Idempotency::new(store, principal); // principal: &Parts -> Result<String, Response>
//! Router::new().route("/payments", post(create).route_layer(keys.required()))
//! # }
//! ```
//!
//! What the layer answers itself (RFC 9457 bodies, `application/problem+json`, with a
//! `type` of `urn:idem:problem:<case>`):
//!
//! | case | answer | recorded |
//! |---|---|---|
//! | no key on a route that requires one | 400 | nothing |
//! | key not valid (empty, too long, control characters) | 400 | nothing |
//! | body over [`Idempotency::max_body_bytes`] | 413 | nothing |
//! | same key, other body or URL | 422 | nothing |
//! | same key while the first runs | 409 + `Retry-After` (or 202 + `Location`) | nothing |
//! | same key while the first is `pending` | 409 + `Retry-After`, unless the route's [`IdempotencyLayer::reconcile`] settles it | nothing |
//! | same key after a 2xx/3xx, a [`Decided`] refusal or a permanent error | the stored answer + `Idempotency-Replayed: true` | |
//! | route answers 2xx/3xx, a `Decided` 4xx or a permanent error (422) | its answer | stored (a permanent error's writes rolled back) |
//! | route answers another 4xx, 5xx, a transient error, or panics | its answer (500 for a panic) | key free for a retry, writes rolled back |
//! | handler's outcome uncertain | its answer (502) | `pending`, writes rolled back |
//! | answer over [`Idempotency::max_response_bytes`] | 500 | key free, writes rolled back |
//! | store unreachable | 503 + `Retry-After` | nothing |
//!
//! On a route in single-commit mode ([`IdempotencyLayer::single_commit`]: the record
//! is written in the request's transaction with its answer, one commit) two rows
//! differ: a repeat while the first runs waits for it and gets its stored answer (or
//! runs itself if the first rolled back), never 409 or 202 (those answer only a record
//! the default mode left running); and a failure that frees the key leaves no record at
//! all.
//!
//! A claimed request runs to its recorded outcome in a task of its own, so a client
//! that hangs up does not leave its key `processing` until the lease lapses.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use axum::extract::Request;
use axum::http::request::Parts;
use axum::http::{HeaderName, header};
use axum::response::Response;
use futures_util::future::BoxFuture;
use tower::{Layer, Service};

use crate::handler::{HandlerError, Reconciliation};
use crate::key::Key;
use crate::store::Store;

mod claimed;
mod decision;
mod problem;
mod record;
mod request;
mod service;
mod single;
mod stored;
mod tx;

pub use problem::{Decided, PROBLEM_JSON};
pub use stored::IDEMPOTENCY_REPLAYED;
pub use tx::{IdempotentRequest, Tx};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// How the application finds a request's scope (its authenticated principal) in the
/// request's parts, or answers for itself (typically 401) when there is none.
pub type ScopeFn = dyn Fn(&Parts) -> Result<String, Response> + Send + Sync;

/// Where a 202 answer tells a client to poll while the first request with its key runs.
pub type LocationFn = dyn Fn(&Key) -> String + Send + Sync;

/// A route's reconciler: told the request and the external reference its uncertain
/// outcome stored, it finds out whether the effect happened (see
/// [`IdempotencyLayer::reconcile`]).
pub type ReconcileFn = dyn Fn(
        IdempotentRequest,
        Option<String>,
    ) -> BoxFuture<'static, Result<Reconciliation<Response>, HandlerError>>
    + Send
    + Sync;

/// The idempotency settings of one application, shared by its routes: build it once
/// and take a layer per route from [`Idempotency::required`] or
/// [`Idempotency::optional`].
#[derive(Clone)]
pub struct Idempotency {
    shared: Arc<Settings>,
}

/// What every route of one [`Idempotency`] shares.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) store: Store,
    pub(crate) scope: Arc<ScopeFn>,
    pub(crate) max_body: usize,
    pub(crate) max_response: usize,
    pub(crate) replay_headers: Vec<HeaderName>,
}

/// Default [`Idempotency::max_body_bytes`]: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;
/// Default [`Idempotency::max_response_bytes`]: 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1 << 20;
/// Default [`IdempotencyLayer::run_within`]: 30 s.
pub const DEFAULT_RUN_WITHIN: Duration = Duration::from_secs(30);

impl Idempotency {
    /// Settings on `store` (its lease and retention apply to HTTP records as to
    /// messages), with `scope` naming each request's principal.
    pub fn new(
        store: Store,
        scope: impl Fn(&Parts) -> Result<String, Response> + Send + Sync + 'static,
    ) -> Self {
        Self {
            shared: Arc::new(Settings {
                store,
                scope: Arc::new(scope),
                max_body: DEFAULT_MAX_BODY_BYTES,
                max_response: DEFAULT_MAX_RESPONSE_BYTES,
                replay_headers: vec![
                    header::CONTENT_TYPE,
                    header::CONTENT_ENCODING,
                    header::CONTENT_LANGUAGE,
                    header::LOCATION,
                    header::ETAG,
                    header::LAST_MODIFIED,
                    header::LINK,
                ],
            }),
        }
    }

    /// The largest request body a keyed request may have: a larger one is answered 413
    /// before anything is claimed (the body is read whole to fingerprint it).
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.shared).max_body = bytes;
        self
    }

    /// The largest response body the layer stores for replay. A larger answer is not
    /// sent: the handler's writes are rolled back, the key is left free for a retry and
    /// the client gets 500, because an answer that cannot be replayed would make the
    /// retry of a lost response see something else.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.shared).max_response = bytes;
        self
    }

    /// The response headers a replay repeats (default: `content-type`,
    /// `content-encoding`, `content-language`, `location`, `etag`, `last-modified`,
    /// `link`). Others, such as `set-cookie`, are sent with the first answer only; keep
    /// every header the body's bytes depend on.
    pub fn replay_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        Arc::make_mut(&mut self.shared).replay_headers = names.into_iter().collect();
        self
    }

    /// A layer for a route whose unsafe requests (POST, PUT, PATCH, DELETE) must carry
    /// an `Idempotency-Key` (400 without one).
    pub fn required(&self) -> IdempotencyLayer {
        self.layer(true)
    }

    /// A layer for a route where the key is optional: a request without one runs once
    /// per request, its writes still in the request's [`Tx`].
    pub fn optional(&self) -> IdempotencyLayer {
        self.layer(false)
    }

    fn layer(&self, required: bool) -> IdempotencyLayer {
        IdempotencyLayer {
            shared: self.shared.clone(),
            route: Arc::new(Route {
                required,
                volatile: Vec::new(),
                location: None,
                reconcile: None,
                run_within: DEFAULT_RUN_WITHIN,
                single_commit: false,
            }),
        }
    }

    /// The answer for a client polling the `Location` of a 202 (see
    /// [`IdempotencyLayer::accept_while_running`]): the stored answer once there is one
    /// (marked replayed), 202 with `Retry-After` while it runs or is pending, 404 when
    /// there is no answer to wait for (no such key, or it failed and must be sent again).
    pub async fn poll(&self, key: &Key) -> Response {
        service::poll(&self.shared, key).await
    }
}

/// The idempotency layer of one route: add it with `route_layer` (or `layer`) on the
/// route's method router, so that the matched route names the operation.
#[derive(Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Settings>,
    route: Arc<Route>,
}

/// One route's settings.
#[derive(Clone)]
pub(crate) struct Route {
    pub(crate) required: bool,
    /// The volatile fields as paths into the fingerprinted payload (`body.` + field).
    pub(crate) volatile: Vec<String>,
    pub(crate) location: Option<Arc<LocationFn>>,
    pub(crate) reconcile: Option<Arc<ReconcileFn>>,
    /// The longest a claimed request's route (or reconciler) may run.
    pub(crate) run_within: Duration,
    /// The record is written in the request's own transaction, with its answer: one
    /// commit ([`IdempotencyLayer::single_commit`]).
    pub(crate) single_commit: bool,
}

impl IdempotencyLayer {
    /// Body fields left out of the fingerprint (dotted paths, as a handler's
    /// `VOLATILE_FIELDS`): a retry that changes only these is the same intent.
    pub fn volatile(mut self, fields: &[&str]) -> Self {
        Arc::make_mut(&mut self.route).volatile =
            fields.iter().map(|f| format!("body.{f}")).collect();
        self
    }

    /// While the first request with a key runs, answer a repeat 202 Accepted with a
    /// `Location` (made by `location` from the key) and `Retry-After`, instead of 409,
    /// for clients that poll (serve the location with [`Idempotency::poll`]).
    pub fn accept_while_running(
        mut self,
        location: impl Fn(&Key) -> String + Send + Sync + 'static,
    ) -> Self {
        Arc::make_mut(&mut self.route).location = Some(Arc::new(location));
        self
    }

    /// The longest a claimed request's route may run (default [`DEFAULT_RUN_WITHIN`],
    /// 30 s), its reconciler too. A claimed request runs in a task of its own so that a
    /// client that hangs up does not cut it short; without a bound, a route that hangs
    /// would hold its key, its transaction and its connection past every timeout in
    /// front of it. Past the bound the route is stopped (dropped), its writes roll
    /// back, the key is freed for a retry as after a panic, and the client gets 503
    /// `request-timed-out` with `Retry-After` (a reconciler past it: the key stays
    /// pending, 409). Effects outside the transaction may have happened: a retry runs
    /// with the same `provider_key`.
    pub fn run_within(mut self, bound: Duration) -> Self {
        Arc::make_mut(&mut self.route).run_within = bound;
        self
    }

    /// Writes the key's record in the request's own transaction, with its answer: one
    /// commit per request, for a route whose every effect is a write in this database
    /// (through its [`Tx`]).
    ///
    /// By default the layer claims the key in a commit of its own before the route runs,
    /// so that a concurrent repeat sees the claim at once and is answered 409, and then
    /// commits the answer with the route's writes: two commits. With `single_commit` the
    /// layer begins the request's transaction (READ COMMITTED), takes the key's lock in
    /// it (an advisory lock: no write) and looks for its record. For a new key it lends
    /// the transaction to the route as its [`Tx`], and writes the record once,
    /// completed with the answer, just before it commits. Until then nobody else sees
    /// the record: a concurrent repeat waits for the key's lock,
    /// and then gets the stored answer (a replay), or, if the first one rolled back (a
    /// transient error, a 5xx, a refusal not marked [`Decided`], a panic, its server
    /// killed), runs itself. Such a failure leaves no record at all
    /// (nothing to expire, no attempt counted), and a server that dies mid-request
    /// leaves nothing behind either: Postgres rolls its transaction back, and a retry
    /// runs at once, without waiting for a lease. What is stored and answered is
    /// otherwise as in the default mode; records the default mode left (a live lease:
    /// 409; a lapsed one or a retryable failure: taken over in the request's
    /// transaction; `pending`: reconciled, in the default mode's way, by the route's
    /// reconciler) are decided as documented.
    ///
    /// Do not use it for a route that calls out (a payment provider, another service,
    /// a broker): a repeat would wait, holding a database connection, for as long as
    /// the call takes (up to [`IdempotencyLayer::run_within`]); the call's effect is not
    /// rolled back with the transaction, and nobody sees that it may have happened
    /// (no record survives a crash to tell a retry `takeover`). Keep such routes in
    /// the default mode, which holds no transaction across the call. A repeat's wait
    /// also holds one of the pool's connections: size the pool for the repeats that may
    /// wait at once. [`IdempotencyLayer::accept_while_running`] has no effect here (a
    /// repeat never sees the first one running), and the route's transaction is READ
    /// COMMITTED whatever the database's default.
    pub fn single_commit(mut self) -> Self {
        Arc::make_mut(&mut self.route).single_commit = true;
        self
    }
}

impl IdempotencyLayer {
    /// How this route finds out whether an uncertain request's effect happened (a
    /// handler that returned [`HandlerError::Uncertain`] left its key `pending`). The
    /// next request with the key calls it, holding the key's lease, with the request
    /// (`takeover`, `provider_key`) and the stored external reference, and then:
    /// `Applied(answer)` stores and sends that answer (if it is one to store: a 2xx/3xx
    /// or a [`Decided`] refusal); `NotApplied` runs the request again; a
    /// [`HandlerError::Permanent`] is stored as the answer (422); `Unknown`, another
    /// error or an answer not to store keeps the key `pending` and answers 409. Without a
    /// reconciler a pending key answers 409 and stays as it is, for an operator.
    pub fn reconcile<F, Fut>(mut self, reconcile: F) -> Self
    where
        F: Fn(IdempotentRequest, Option<String>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Reconciliation<Response>, HandlerError>> + Send + 'static,
    {
        Arc::make_mut(&mut self.route).reconcile = Some(Arc::new(move |request, external_ref| {
            Box::pin(reconcile(request, external_ref))
        }));
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            shared: self.shared.clone(),
            route: self.route.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps a route in.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    shared: Arc<Settings>,
    route: Arc<Route>,
}

impl<S> Service<Request> for IdempotencyService<S>
where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The clone may not be ready; the one polled ready is used (tower's pattern).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        let route = self.route.clone();
        Box::pin(async move { Ok(service::serve(shared, route, inner, request).await) })
    }
}
