//! An HTTP endpoint that takes payments, protected by `Idempotency-Key` on idem's store:
//! the seeds' first example. A client whose response was lost sends the same request
//! again and gets the same answer, not a second payment.
//!
//! ```sh
//! cargo run --features http --example payments_api
//! curl -i localhost:3000/payments -H 'Authorization: Bearer alice' \
//!      -H 'Idempotency-Key: order-17' -H 'Content-Type: application/json' \
//!      -d '{"customer": "c-1", "amount_cents": 1250, "currency": "EUR"}'
//! ```
//!
//! Send the `curl` twice: the first answer is `201 Created` with the payment; the second
//! is the same bytes with `Idempotency-Replayed: true`, and `example_payments` holds one
//! row. Change the amount and keep the key: `422`. Send it while the first still runs
//! (`--provider-delay-ms 5000`): `409` with `Retry-After`. The bearer token is the
//! principal (a demo: use real authentication), so two principals may use one key.
//! `example_payments` has no unique constraint, so a double payment would show.
//!
//! `--unprotected-route` also serves the same handler without the layer at
//! `POST /unprotected/payments`, for `examples/http_bench.rs` to compare, and
//! `--single-commit-route` serves it at `POST /single/payments` behind the layer in
//! single-commit mode (`IdempotencyLayer::single_commit`: the record is written in the
//! request's transaction with its answer, one commit; a concurrent repeat waits for the
//! first one and gets its answer instead of 409). That mode is for routes whose every
//! effect is a write in this database: a real provider call belongs on `/payments`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::{Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use idem::http::{Idempotency, IdempotentRequest, PROBLEM_JSON, Tx};
use idem::{HandlerError, Key, Store, StoreConfig};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

/// What a client asks for.
#[derive(Debug, Deserialize)]
struct NewPayment {
    customer: String,
    amount_cents: i64,
    currency: String,
}

/// A payment as stored and answered.
#[derive(Debug, Serialize, sqlx::FromRow)]
struct Payment {
    payment_id: String,
    principal: String,
    customer: String,
    amount_cents: i64,
    currency: String,
    created_at: chrono::DateTime<chrono::Utc>,
}

#[derive(Clone)]
struct App {
    provider_delay: Duration,
    pool: sqlx::PgPool,
    keys: Idempotency,
}

/// `POST /payments` (and `POST /single/payments`): one payment in the request's
/// transaction, which commits with the stored answer.
async fn create_payment(
    State(app): State<App>,
    request: IdempotentRequest,
    mut tx: Tx,
    Json(new): Json<NewPayment>,
) -> Result<(StatusCode, Json<Payment>), HandlerError> {
    let principal = request.key.scope().to_owned();
    let payment = book(&mut tx, &principal, new, app.provider_delay).await?;
    Ok((StatusCode::CREATED, Json(payment)))
}

/// `POST /unprotected/payments`: the same work without the layer, in a transaction of
/// its own (for the bench).
async fn create_payment_unprotected(
    State(app): State<App>,
    parts: Parts,
    Json(new): Json<NewPayment>,
) -> Result<(StatusCode, Json<Payment>), Response> {
    let principal = principal(&parts)?;
    let mut tx = app.pool.begin().await.map_err(internal)?;
    let payment = book(&mut tx, &principal, new, app.provider_delay)
        .await
        .map_err(IntoResponse::into_response)?;
    tx.commit().await.map_err(internal)?;
    Ok((StatusCode::CREATED, Json(payment)))
}

/// `GET /payment-requests/{key}`: where a 202 (`--accept-while-running`) points.
async fn poll(State(app): State<App>, parts: Parts, Path(key): Path<String>) -> Response {
    let principal = match principal(&parts) {
        Ok(principal) => principal,
        Err(rejection) => return rejection,
    };
    match Key::new(principal, "POST /payments", key) {
        Ok(key) => app.keys.poll(&key).await,
        Err(error) => (StatusCode::BAD_REQUEST, error.to_string()).into_response(),
    }
}

/// Calls the (simulated) payment provider and records the payment.
async fn book(
    conn: &mut PgConnection,
    principal: &str,
    new: NewPayment,
    provider_delay: Duration,
) -> Result<Payment, HandlerError> {
    if new.amount_cents <= 0 {
        return Err(HandlerError::permanent("amount_cents must be positive"));
    }
    if new.currency.len() != 3 || !new.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(HandlerError::permanent(
            "currency must be three capital letters (ISO 4217)",
        ));
    }
    // The provider is slow: the window in which a client gives up and sends again.
    tokio::time::sleep(provider_delay).await;
    let payment = sqlx::query_as(
        "INSERT INTO example_payments
             (payment_id, principal, customer, amount_cents, currency, created_at)
         VALUES ($1, $2, $3, $4, $5, now())
         RETURNING payment_id, principal, customer, amount_cents, currency, created_at",
    )
    .bind(uuid::Uuid::new_v4().to_string())
    .bind(principal)
    .bind(&new.customer)
    .bind(new.amount_cents)
    .bind(&new.currency)
    .fetch_one(conn)
    .await?;
    Ok(payment)
}

/// The principal: the bearer token itself (a demo), or 401. (A rejection is a whole
/// response, as axum's own are.)
#[allow(clippy::result_large_err)]
fn principal(parts: &Parts) -> Result<String, Response> {
    parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|token| !token.is_empty())
        .map(str::to_owned)
        .ok_or_else(|| {
            let body = serde_json::json!({
                "type": "about:blank",
                "title": "Unauthorized",
                "status": 401,
                "detail": "send Authorization: Bearer <principal>",
            });
            (
                StatusCode::UNAUTHORIZED,
                [
                    (header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON)),
                    (header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")),
                ],
                body.to_string(),
            )
                .into_response()
        })
}

/// `text` as one percent-encoded path segment (RFC 3986 unreserved characters kept).
fn path_segment(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn internal(error: sqlx::Error) -> Response {
    HandlerError::transient(idem::text::error_line(&error)).into_response()
}

/// The example's table, without a unique constraint: a double payment must be visible.
async fn create_payments_table(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "SELECT pg_advisory_xact_lock(hashtext('idem_example_tables'));
         CREATE TABLE IF NOT EXISTS example_payments (
             payment_id text NOT NULL,
             principal text NOT NULL,
             customer text NOT NULL,
             amount_cents bigint NOT NULL,
             currency text NOT NULL,
             created_at timestamptz NOT NULL
         );",
    )
    .execute(pool)
    .await?;
    Ok(())
}

#[derive(Parser, Debug)]
#[command(about = "idem example: POST /payments behind an Idempotency-Key layer")]
struct Args {
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// How long a request owns its key without a heartbeat (a server that dies holds
    /// it this long).
    #[arg(long, default_value_t = 30)]
    lease_secs: u64,
    /// How long the simulated payment provider takes.
    #[arg(long, default_value_t = 0)]
    provider_delay_ms: u64,
    /// The largest request body, in bytes (larger: 413).
    #[arg(long, default_value_t = 64 * 1024)]
    max_body_bytes: usize,
    /// Answer a repeat while the first runs with 202 and a Location to poll, not 409.
    #[arg(long)]
    accept_while_running: bool,
    /// Also serve POST /unprotected/payments without the layer (for the bench).
    #[arg(long)]
    unprotected_route: bool,
    /// Also serve POST /single/payments behind the layer in single-commit mode.
    #[arg(long)]
    single_commit_route: bool,
    /// Database connections.
    #[arg(long, default_value_t = 20)]
    connections: u32,
    /// Postgres URL.
    #[arg(long, env = "DATABASE_URL", default_value = idem::db::DEFAULT_DATABASE_URL, hide_env_values = true)]
    database_url: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    // Logs; traces too when built with `--features otel` and OTEL_EXPORTER_OTLP_ENDPOINT
    // is set. Kept until `main` returns, so the last spans are sent.
    let _telemetry = match idem::telemetry::init("payments_api") {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("payments_api: error: {}", idem::text::error_line(&error));
            return ExitCode::FAILURE;
        }
    };
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!(
                "payments_api: error: {}",
                idem::text::error_line(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let pool = idem::db::connect_and_migrate(&args.database_url, args.connections)
        .await
        .context("prepare the database")?;
    create_payments_table(&pool)
        .await
        .context("create the example table")?;
    let store = Store::new(
        pool.clone(),
        StoreConfig {
            owner: format!("payments_api-{}", std::process::id()),
            keys: idem::protect::Keys::from_env()?,
            lease: Duration::from_secs(args.lease_secs),
            ..StoreConfig::default()
        },
    );
    let keys = Idempotency::new(store, principal).max_body_bytes(args.max_body_bytes);
    let mut layer = keys.required();
    if args.accept_while_running {
        layer = layer.accept_while_running(|key| {
            format!("/payment-requests/{}", path_segment(key.idempotency_key()))
        });
    }
    let app = App {
        provider_delay: Duration::from_millis(args.provider_delay_ms),
        pool,
        keys: keys.clone(),
    };
    let mut router = Router::new()
        .route("/payments", post(create_payment).route_layer(layer))
        .route("/payment-requests/{key}", get(poll))
        .route("/healthz", get(|| async { "ok" }));
    if args.unprotected_route {
        router = router.route("/unprotected/payments", post(create_payment_unprotected));
    }
    if args.single_commit_route {
        let single = keys.required().single_commit();
        router = router.route("/single/payments", post(create_payment).route_layer(single));
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listen on {}", args.listen))?;
    tracing::info!(addr = %listener.local_addr()?, "payments_api: listening");
    let shutdown = idem::shutdown::on_signal();
    axum::serve(listener, router.with_state(app))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .context("serve")?;
    Ok(())
}
