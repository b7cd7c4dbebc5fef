//! `idem console`: dead letters, stuck operations and the outbox on one page, with
//! replay, discard and release behind a confirmation (feature `console`).
//!
//! Server-rendered (axum), no script and no asset from elsewhere. Nothing answers
//! without the token (`IDEM_CONSOLE_TOKEN`, or one generated and printed at start):
//! `GET /login?token=…` sets it as an `HttpOnly`, `SameSite=Strict` cookie, and
//! `Authorization: Bearer …` works too. Every action is a POST that must carry the CSRF
//! token of the page's form (derived from the console token), or it answers 403 and
//! changes nothing. It listens on loopback unless `--allow-remote` says otherwise. Keys
//! are shown on the pages (operators need them) but never logged.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use axum::Router;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use idem::Store;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::Cli;

mod charts;
mod dead_letters;
mod html;
mod operations;
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
}

/// The cookie that carries the token.
const COOKIE: &str = "idem_console";

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
             '~' or '-' (it travels in a cookie)"
        ),
        None => uuid::Uuid::new_v4().simple().to_string(),
    };
    let console = Arc::new(Console {
        store: crate::store(cli).await?,
        amqp_url: cli.amqp_url.clone(),
        queues: args.queues.clone(),
        csrf: hex::encode(Sha256::digest(format!("idem-console-csrf:{token}"))),
        token,
        retention: std::time::Duration::from_secs(args.retention_days.saturating_mul(86_400)),
        samples: charts::Samples::default(),
    });
    tokio::spawn(charts::sample_forever(console.clone()));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    match &args.token {
        Some(_) => println!("idem console: http://{bound}/ (token from IDEM_CONSOLE_TOKEN)"),
        None => println!("idem console: http://{bound}/login?token={}", console.token),
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

fn router(console: Arc<Console>) -> Router {
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
        .route("/charts", get(charts::page))
        .route_layer(middleware::from_fn_with_state(console.clone(), authorized));
    Router::new()
        .route("/login", get(login))
        .merge(pages)
        .layer(middleware::map_response(guarded))
        .with_state(console)
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
        ("referrer-policy", "no-referrer"),
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
    token: String,
}

/// Sets the token as a cookie and goes to the dead letters; a wrong token is a 401.
async fn login(State(console): State<Arc<Console>>, Query(login): Query<Login>) -> Response {
    if !same(&login.token, &console.token) {
        return unauthorized();
    }
    let cookie = format!(
        "{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/",
        console.token
    );
    ([(header::SET_COOKIE, cookie)], Redirect::to("/dlq")).into_response()
}

/// Lets a request through with the token (cookie or bearer), else 401.
async fn authorized(State(console): State<Arc<Console>>, request: Request, next: Next) -> Response {
    match presented(request.headers()) {
        Some(token) if same(&token, &console.token) => next.run(request).await,
        _ => unauthorized(),
    }
}

/// The token a request presents: `Authorization: Bearer …` or the cookie.
fn presented(headers: &HeaderMap) -> Option<String> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if let Some(token) = bearer {
        return Some(token.trim().to_owned());
    }
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
    fn the_token_comes_from_the_bearer_header_or_the_cookie() {
        let mut headers = HeaderMap::new();
        assert_eq!(presented(&headers), None);
        headers.insert(
            header::COOKIE,
            "a=1; idem_console=tok; b=2".parse().unwrap(),
        );
        assert_eq!(presented(&headers).as_deref(), Some("tok"));
        headers.insert(header::AUTHORIZATION, "Bearer other".parse().unwrap());
        assert_eq!(presented(&headers).as_deref(), Some("other"));
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("abc", "ab"));
        assert!(token_is_valid("abcdefghijklmnop-_.~0"));
        assert!(!token_is_valid("short") && !token_is_valid("abcdefghijklmnop;x"));
    }
}
