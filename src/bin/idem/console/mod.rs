//! `idem console`: dead letters, stuck operations, the outbox and the entities waiting
//! for their turn (order per entity) on one page, with replay, discard and release
//! behind a confirmation (feature `console`).
//!
//! Server-rendered (axum), no script and no asset from elsewhere. Nothing answers
//! without the token (`IDEM_CONSOLE_TOKEN`, or one generated at start and written to a
//! file only its user can read): `/login` takes it (a form, or `?token=`) and starts a
//! session, whose opaque id is an `HttpOnly`, `SameSite=Strict` cookie (never the token:
//! a cookie goes to every service on the host, whatever its port);
//! `Authorization: Bearer …` works too. Every request must name one of the console's
//! own hosts (`Host`: its address, or `--allow-host`), so that a page elsewhere cannot
//! reach it through a name it rebinds to loopback; every POST from a browser must come
//! from the console's own origin (`Origin`) and carry the CSRF token of the page's form
//! (derived from the console token), or it answers 403 and changes nothing. Actions
//! take only the `--queue`s given, and records of their operations. It listens on
//! loopback unless `--allow-remote` says otherwise. Keys are shown on the pages
//! (operators need them) but never logged.

use crate::out::say;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use axum::Router;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use idem::Store;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::Cli;

mod charts;
mod dead_letters;
mod flow;
mod html;
mod operations;
mod ordering;
mod pages;

/// `idem console` flags.
#[derive(clap::Args)]
pub(crate) struct ConsoleArgs {
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// Allow an address other than loopback (the console can replay and release).
    #[arg(long)]
    allow_remote: bool,
    /// The work queues whose dead letters to show (repeat the flag for several).
    #[arg(long = "queue", required = true)]
    queues: Vec<String>,
    /// The token, from the environment only (a flag would show in `ps`); one is
    /// generated and printed when it is unset.
    #[arg(skip = std::env::var("IDEM_CONSOLE_TOKEN").ok())]
    token: Option<String>,
    /// The workers' retention in days (`StoreConfig::retention`), which the charts use
    /// to find completed records through the index on their expiry.
    #[arg(long, default_value_t = 7)]
    retention_days: u64,
    /// Another `Host` the console answers to (`name:port`, as browsers send it), for a
    /// proxy in front or a remote address (repeat the flag for several). Without it, it
    /// answers only to the address it listens on (and, on loopback, `localhost`).
    #[arg(long = "allow-host")]
    hosts: Vec<String>,
    /// An operation whose records the console may release or resolve, besides those
    /// the workers of the `--queue`s counted (an HTTP route's, or a worker's whose
    /// delivery counts are off); repeat the flag for several.
    #[arg(long = "operation")]
    operations: Vec<String>,
}

/// What every page needs.
pub(super) struct Console {
    store: Store,
    amqp_url: String,
    queues: Vec<String>,
    token: String,
    csrf: String,
    retention: std::time::Duration,
    samples: charts::Samples,
    /// Sessions a login started, by their opaque id: when each began.
    sessions: Mutex<HashMap<String, Instant>>,
    /// The `Host` values requests may carry.
    hosts: Vec<String>,
    /// Operations actions may touch besides those of the console's queues.
    operations: Vec<String>,
}

/// The cookie that carries a session's id.
const COOKIE: &str = "idem_console";

/// How long a session lasts; a login starts another.
const SESSION_FOR: Duration = Duration::from_secs(12 * 3600);

/// Most sessions kept at once (the oldest goes first).
const SESSIONS_MAX: usize = 1_000;

/// Serves the console until the process is stopped.
pub(crate) async fn run(cli: &Cli, args: &ConsoleArgs) -> anyhow::Result<()> {
    let addr: SocketAddr = args
        .listen
        .parse()
        .with_context(|| format!("--listen {} is not an address", args.listen))?;
    if !addr.ip().is_loopback() && !args.allow_remote {
        bail!(
            "--listen {addr} is not a loopback address: the console can replay and release, so \
             say --allow-remote to serve it there"
        );
    }
    let token = match &args.token {
        Some(token) if token_is_valid(token) => token.clone(),
        Some(_) => bail!(
            "IDEM_CONSOLE_TOKEN must be at least 16 characters of A-Z, a-z, 0-9, '.', '_', \
             '~' or '-'"
        ),
        None => random_id(),
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    let hosts = allowed_hosts(bound, &args.hosts)?;
    let console = Arc::new(Console {
        store: crate::store(cli).await?,
        amqp_url: cli.amqp_url.clone(),
        queues: args.queues.clone(),
        csrf: hex::encode(Sha256::digest(format!("idem-console-csrf:{token}"))),
        token,
        retention: std::time::Duration::from_secs(args.retention_days.saturating_mul(86_400)),
        samples: charts::Samples::default(),
        sessions: Mutex::new(HashMap::new()),
        hosts,
        operations: args.operations.clone(),
    });
    tokio::spawn(charts::sample_forever(console.clone()));
    // The token is never printed: output is often kept (journals, CI logs).
    match &args.token {
        Some(_) => {
            say!("idem console: http://{bound}/ (log in at /login with IDEM_CONSOLE_TOKEN)")
        }
        None => {
            let file = write_token(&console.token, bound.port())?;
            say!(
                "idem console: http://{bound}/ (log in at /login with the token in {}, readable by you only)",
                file.display()
            );
        }
    }
    let app = router(console);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            idem::shutdown::on_signal().cancelled().await;
        })
        .await
        .context("console server")?;
    Ok(())
}

/// 128 random bits as 32 hex digits: a generated token, or a session's id.
fn random_id() -> String {
    let bytes: [u8; 16] = rand::random();
    hex::encode(bytes)
}

/// Writes a generated token to a file in the temp directory that only this user can
/// read, and returns its path.
fn write_token(token: &str, port: u16) -> anyhow::Result<std::path::PathBuf> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = std::env::temp_dir().join(format!("idem-console-{port}.token"));
    let _ = std::fs::remove_file(&path);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot write the token to {}", path.display()))?;
    writeln!(file, "{token}")?;
    Ok(path)
}

/// The `Host` values the console answers to: its address and, on loopback, the
/// loopback names with its port; then `extra`. A console on an unspecified address
/// (`0.0.0.0`) has no address of its own that a client would name: it needs `extra`.
fn allowed_hosts(bound: SocketAddr, extra: &[String]) -> anyhow::Result<Vec<String>> {
    let port = bound.port();
    let mut hosts: Vec<String> = extra.iter().map(|h| h.to_ascii_lowercase()).collect();
    if bound.ip().is_unspecified() {
        if hosts.is_empty() {
            bail!(
                "--listen {bound} names no host a browser would send: say --allow-host <name>:{port} \
                 for each name clients use"
            );
        }
    } else {
        hosts.push(bound.to_string());
    }
    if bound.ip().is_loopback() {
        hosts.extend([
            format!("localhost:{port}"),
            format!("127.0.0.1:{port}"),
            format!("[::1]:{port}"),
        ]);
    }
    Ok(hosts)
}

fn router(console: Arc<Console>) -> Router {
    use axum::routing::post;
    let pages = Router::new()
        .route("/", get(|| async { Redirect::to("/dlq") }))
        .route("/dlq", get(dead_letters::dead_letters))
        .route("/dlq/confirm", get(dead_letters::confirm_dead_letters))
        .route("/dlq/act", post(dead_letters::act_on_dead_letters))
        .route("/ops", get(operations::operations))
        .route("/ops/show", get(operations::operation))
        .route("/ops/release", post(operations::release))
        .route("/ops/resolve", post(operations::resolve))
        .route("/outbox", get(pages::outbox))
        .route("/flow", get(flow::page_of))
        .route("/flow/close", post(flow::close))
        .route("/ordering", get(ordering::page_of))
        .route("/charts", get(charts::page))
        .route_layer(middleware::from_fn_with_state(console.clone(), authorized));
    Router::new()
        .route("/login", get(login).post(login_form))
        .merge(pages)
        .layer(middleware::from_fn_with_state(console.clone(), own_host))
        .layer(middleware::map_response(guarded))
        .with_state(console)
}

/// Answers only requests that name one of the console's hosts: a page elsewhere that
/// rebinds a name of its own to 127.0.0.1 gets nothing (its requests carry its name).
async fn own_host(State(console): State<Arc<Console>>, request: Request, next: Next) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_ascii_lowercase);
    match host {
        Some(host) if console.hosts.contains(&host) => next.run(request).await,
        _ => (
            StatusCode::MISDIRECTED_REQUEST,
            "421: this console answers to its own address only (or --allow-host)\n",
        )
            .into_response(),
    }
}

/// Headers on every answer: no framing (clickjacking), no script and nothing loaded
/// from elsewhere, forms posted only here, no referrer (URLs carry keys).
async fn guarded(mut response: Response) -> Response {
    let headers = response.headers_mut();
    for (name, value) in [
        ("x-frame-options", "DENY"),
        (
            "content-security-policy",
            "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; \
             form-action 'self'; frame-ancestors 'none'",
        ),
        // No referrer to other sites (URLs carry keys); the console's own pages keep
        // theirs, so that a form's POST carries its Origin (under no-referrer, browsers
        // send `Origin: null`).
        ("referrer-policy", "same-origin"),
        ("x-content-type-options", "nosniff"),
        ("cache-control", "no-store"),
    ] {
        headers.insert(name, header::HeaderValue::from_static(value));
    }
    response
}

/// A token that can travel in a cookie, and long enough.
fn token_is_valid(token: &str) -> bool {
    token.len() >= 16
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'~' | b'-'))
}

#[derive(Deserialize)]
struct Login {
    token: Option<String>,
}

/// `GET /login?token=…` starts a session; `GET /login` shows the form that posts it.
async fn login(State(console): State<Arc<Console>>, Query(login): Query<Login>) -> Response {
    match login.token {
        Some(token) => start_session(&console, &token),
        None => html::page(
            "Log in",
            "<form method=\"post\" action=\"/login\"><p><label>Console token \
             <input type=\"password\" name=\"token\" size=\"40\" autofocus></label> \
             <button type=\"submit\">Log in</button></p></form>",
        )
        .into_response(),
    }
}

/// `POST /login` from the form (the token stays out of the browser's history).
async fn login_form(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    axum::Form(login): axum::Form<Login>,
) -> Response {
    if !console.same_origin(&headers, false) {
        return forbidden();
    }
    start_session(&console, login.token.as_deref().unwrap_or_default())
}

/// A new session for the right token, as an opaque cookie; a wrong token is a 401.
fn start_session(console: &Console, token: &str) -> Response {
    if !same(token, &console.token) {
        return unauthorized();
    }
    let id = random_id();
    {
        let mut sessions = console.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions.retain(|_, started| started.elapsed() < SESSION_FOR);
        if sessions.len() >= SESSIONS_MAX
            && let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, t)| **t)
                .map(|(id, _)| id.clone())
        {
            sessions.remove(&oldest);
        }
        sessions.insert(id.clone(), Instant::now());
    }
    let cookie = format!("{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/");
    ([(header::SET_COOKIE, cookie)], Redirect::to("/dlq")).into_response()
}

/// Lets a request through with the token (bearer) or a session's cookie, else 401; a
/// POST from a browser (a cookie's) must come from the console's own origin, else 403.
async fn authorized(State(console): State<Arc<Console>>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let bearer = bearer(headers).is_some_and(|token| same(&token, &console.token));
    if !bearer && !session(headers).is_some_and(|id| console.session_live(&id)) {
        return unauthorized();
    }
    if request.method() == Method::POST && !console.same_origin(headers, bearer) {
        return forbidden();
    }
    next.run(request).await
}

/// The token of `Authorization: Bearer …`.
fn bearer(headers: &HeaderMap) -> Option<String> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|token| token.trim().to_owned())
}

/// The session id of the request's cookie.
fn session(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            pair.trim()
                .strip_prefix(&format!("{COOKIE}="))
                .map(str::to_owned)
        })
}

/// Compares without stopping at the first difference (timing tells nothing).
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        "401: the console needs its token: open the URL idem console printed, or send \
         Authorization: Bearer <token>\n",
    )
        .into_response()
}

/// 403 for a POST without the page's CSRF token; nothing was changed.
fn forbidden() -> Response {
    (
        StatusCode::FORBIDDEN,
        "403: the form's CSRF token is missing or wrong; nothing was changed\n",
    )
        .into_response()
}

impl Console {
    /// Whether `id` names a session a login started, not yet over.
    fn session_live(&self, id: &str) -> bool {
        let sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions
            .iter()
            .any(|(known, started)| same(known, id) && started.elapsed() < SESSION_FOR)
    }

    /// Whether a POST's `Origin` is the console's own: `http://` and one of its hosts.
    /// A request without one passes only when `without_is_fine` (a bearer token's,
    /// which a page elsewhere cannot send); browsers send it on every form POST.
    fn same_origin(&self, headers: &HeaderMap, without_is_fine: bool) -> bool {
        match headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
            Some(origin) => origin
                .to_ascii_lowercase()
                .strip_prefix("http://")
                .is_some_and(|host| self.hosts.iter().any(|h| h == host)),
            None => without_is_fine,
        }
    }

    /// Whether an action may touch records of `operation`: one of `--operation`, or
    /// one a worker of the console's queues runs.
    async fn acts_on(&self, operation: &str) -> anyhow::Result<bool> {
        if self.operations.iter().any(|o| o == operation) {
            return Ok(true);
        }
        self.store
            .serves(&self.queues, operation)
            .await
            .context("which operations the queues serve")
    }

    /// Whether `queue` is one the console was started for (actions take no other).
    fn serves(&self, queue: &str) -> bool {
        self.queues.iter().any(|q| q == queue)
    }

    /// Whether a form carried this console's CSRF token.
    fn csrf_ok(&self, presented: Option<&str>) -> bool {
        presented.is_some_and(|p| same(p, &self.csrf))
    }

    async fn broker(&self) -> anyhow::Result<lapin::Connection> {
        idem::topology::connect(&self.amqp_url, "idem-console")
            .await
            .context("cannot reach RabbitMQ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_comes_from_the_bearer_header_and_a_session_from_the_cookie() {
        let mut headers = HeaderMap::new();
        assert_eq!((bearer(&headers), session(&headers)), (None, None));
        headers.insert(
            header::COOKIE,
            "a=1; idem_console=sid; b=2".parse().unwrap(),
        );
        assert_eq!(session(&headers).as_deref(), Some("sid"));
        headers.insert(header::AUTHORIZATION, "Bearer other".parse().unwrap());
        assert_eq!(bearer(&headers).as_deref(), Some("other"));
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("abc", "ab"));
        assert!(token_is_valid("abcdefghijklmnop-_.~0"));
        assert!(!token_is_valid("short") && !token_is_valid("abcdefghijklmnop;x"));
    }

    #[test]
    fn a_console_answers_to_its_own_hosts_only() {
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let hosts = allowed_hosts(loopback, &[]).unwrap();
        assert!(hosts.contains(&"localhost:8080".to_owned()));
        assert!(!hosts.contains(&"evil.example:8080".to_owned()));
        let anywhere: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        assert!(allowed_hosts(anywhere, &[]).is_err());
        let named = allowed_hosts(anywhere, &["Console.Internal:8080".into()]).unwrap();
        assert_eq!(named, ["console.internal:8080"]);
    }
}
