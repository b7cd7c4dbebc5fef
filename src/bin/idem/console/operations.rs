//! The operations pages: unresolved records (stuck, processing, pending, failed),
//! searchable; one record whole; releasing its lease.

use std::sync::Arc;

use axum::Form;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use idem::store::Record;
use idem::{Key, Status};
use serde::Deserialize;

use super::html::{escape, num, page, post_form, post_form_with, query, table};
use super::pages::{ROWS, failed, given, when};
use super::{Console, forbidden};

/// Which operations to list.
#[derive(Deserialize, Default)]
pub(super) struct OpsQuery {
    /// `stuck` (processing past its lease), `processing`, `pending` or `failed`.
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    scope: Option<String>,
    #[serde(default)]
    operation: Option<String>,
    /// A prefix of the idempotency key.
    #[serde(default)]
    key: Option<String>,
}

/// Unresolved operations (stuck, pending, failed), searchable.
pub(super) async fn operations(
    State(console): State<Arc<Console>>,
    Query(q): Query<OpsQuery>,
) -> Response {
    let wanted = q.status.clone().unwrap_or_else(|| "stuck".into());
    let (status, stuck) = match wanted.as_str() {
        "stuck" => (Status::Processing, true),
        other => match other.parse::<Status>() {
            Ok(Status::Completed) | Err(_) => {
                return (axum::http::StatusCode::BAD_REQUEST, "unknown status").into_response();
            }
            Ok(status) => (status, false),
        },
    };
    let records = match unresolved(&console, status, stuck, &q).await {
        Ok(records) => records,
        Err(error) => return failed("the store", &error.into()),
    };
    let tabs: String = ["stuck", "processing", "pending", "failed"]
        .iter()
        .map(|s| {
            let mark = if *s == wanted { " <b>◀</b>" } else { "" };
            format!("<a href=\"/ops?status={s}\">{s}</a>{mark} ")
        })
        .collect();
    let rows: Vec<Vec<String>> = records.iter().map(operation_row).collect();
    let body = format!(
        "<p>{tabs}</p>{}<p>{} operation(s){}</p>{}",
        search_form(&wanted, &q),
        records.len(),
        if records.len() as i64 == ROWS {
            " (the first)"
        } else {
            ""
        },
        table(
            "operations",
            &[
                "scope",
                "operation",
                "key",
                "status",
                "attempts",
                "lease expires",
                "owner",
                "error"
            ],
            &rows
        )
    );
    page("Operations", &body).into_response()
}

/// The first [`ROWS`] records in `status` (past their lease if `stuck`) that match the
/// search, by lease expiry.
async fn unresolved(
    console: &Console,
    status: Status,
    stuck: bool,
    q: &OpsQuery,
) -> Result<Vec<Record>, sqlx::Error> {
    // Served by the partial index on (status, lease_expires_at) of unresolved records
    // (the literal `<> 'completed'` lets every plan use its predicate).
    sqlx::query_as(
        "SELECT * FROM processed_operations
         WHERE status <> 'completed' AND status = $1
           AND (NOT $2 OR lease_expires_at <= now())
           AND ($3::text IS NULL OR scope = $3)
           AND ($4::text IS NULL OR operation = $4)
           AND ($5::text IS NULL OR starts_with(idempotency_key, $5))
         ORDER BY lease_expires_at
         LIMIT $6",
    )
    .bind(status)
    .bind(stuck)
    .bind(given(&q.scope))
    .bind(given(&q.operation))
    .bind(given(&q.key))
    .bind(ROWS)
    .fetch_all(console.store.pool())
    .await
}

/// The search over one status tab, filled in with what was searched.
fn search_form(wanted: &str, q: &OpsQuery) -> String {
    let value = |v: &Option<String>| escape(v.as_deref().unwrap_or_default());
    format!(
        "<form method=\"get\" action=\"/ops\"><input type=\"hidden\" name=\"status\" value=\"{}\">\
         scope <input name=\"scope\" value=\"{}\"> operation <input name=\"operation\" value=\"{}\"> \
         key starts with <input name=\"key\" value=\"{}\"> <button type=\"submit\">Search</button></form>",
        escape(wanted),
        value(&q.scope),
        value(&q.operation),
        value(&q.key)
    )
}

/// One record's row, its key a link to the record whole.
fn operation_row(r: &Record) -> Vec<String> {
    let pairs = [
        ("scope", r.scope.as_str()),
        ("operation", r.operation.as_str()),
        ("key", r.idempotency_key.as_str()),
    ];
    vec![
        escape(&r.scope),
        escape(&r.operation),
        format!(
            "<a href=\"/ops/show?{}\"><code>{}</code></a>",
            escape(&query(&pairs)),
            escape(&r.idempotency_key)
        ),
        escape(r.status.as_str()),
        num(r.attempts),
        when(r.lease_expires_at),
        escape(r.owner.as_deref().unwrap_or("-")),
        escape(&r.error_text().unwrap_or_default()),
    ]
}

/// One operation's key, as a query or a form.
#[derive(Deserialize)]
pub(super) struct KeyForm {
    scope: String,
    operation: String,
    key: String,
    #[serde(default)]
    csrf: Option<String>,
    /// Why an uncertain operation is resolved (kept in its record).
    #[serde(default)]
    note: Option<String>,
    /// The lease token the page showed, which a resolve must still find.
    #[serde(default)]
    token: Option<i64>,
}

impl KeyForm {
    /// The key's fields, for a form or a link.
    fn pairs(&self) -> [(&'static str, &str); 3] {
        [
            ("scope", self.scope.as_str()),
            ("operation", self.operation.as_str()),
            ("key", self.key.as_str()),
        ]
    }

    /// The link back to the operation's page.
    fn back(&self) -> String {
        format!(
            "<p><a href=\"/ops/show?{}\">Back to the operation</a></p>",
            escape(&query(&self.pairs()))
        )
    }

    /// For an action: the key, once the form's CSRF token is right (403 otherwise, 400
    /// for a key that is not one) and its operation is one of the console's queues'
    /// (403 otherwise).
    async fn action_key(&self, console: &Console) -> Result<Key, Box<Response>> {
        if !console.csrf_ok(self.csrf.as_deref()) {
            return Err(Box::new(forbidden()));
        }
        let key = self.key()?;
        match console.acts_on(key.operation()).await {
            Ok(true) => Ok(key),
            Ok(false) => Err(Box::new(not_served(key.operation()))),
            Err(error) => Err(Box::new(failed("the store", &error))),
        }
    }

    /// The key, or the 400 answer saying why it is not one.
    fn key(&self) -> Result<Key, Box<Response>> {
        Key::new(&self.scope, &self.operation, &self.key).map_err(|e| {
            let answer = (
                axum::http::StatusCode::BAD_REQUEST,
                format!("invalid key: {e}"),
            );
            Box::new(answer.into_response())
        })
    }
}

/// 403 for an action on a record of an operation none of the console's queues serves.
fn not_served(operation: &str) -> Response {
    let body = format!(
        "<p class=\"warn\">Nothing changed: {} is not an operation of this console's queues \
         (start it with --operation to act on its records).</p>",
        escape(operation)
    );
    (axum::http::StatusCode::FORBIDDEN, page("Refused", &body)).into_response()
}

/// One operation's whole record, with a release button while it is in flight.
pub(super) async fn operation(
    State(console): State<Arc<Console>>,
    Query(form): Query<KeyForm>,
) -> Response {
    let key = match form.key() {
        Ok(key) => key,
        Err(response) => return *response,
    };
    let record = match console.store.get(&key).await {
        Ok(Some(record)) => record,
        Ok(None) => return page("Operation", "<p>No record for this key.</p>").into_response(),
        Err(error) => return failed("the store", &error.into()),
    };
    let mut fields: Vec<Vec<String>> = Vec::new();
    let json = serde_json::to_value(&record).unwrap_or_default();
    if let Some(object) = json.as_object() {
        for (name, value) in object {
            let text = match value {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Null => "-".into(),
                other => other.to_string(),
            };
            fields.push(vec![
                escape(name),
                format!("<code>{}</code>", escape(&text)),
            ]);
        }
    }
    // Buttons only for the operations of the console's queues.
    let acts = match console.acts_on(key.operation()).await {
        Ok(acts) => acts,
        Err(error) => return failed("the store", &error),
    };
    // A pending record's lease is a reconciler's and lapses on its own; released by
    // hand it could no longer be resolved (Store::release).
    let release = if acts && record.status == Status::Processing {
        let pairs = form.pairs();
        format!(
            "<div class=\"box\"><p class=\"warn\">Release only when its worker is dead: the \
             lease ends now, and the next delivery or replay takes the operation over. The \
             old owner's late writes are fenced off.</p>{}</div>",
            post_form("/ops/release", &pairs, &console.csrf, "Release the lease")
        )
    } else {
        String::new()
    };
    let resolve = if acts && record.awaits_reconcile() && record.lease_expires_at.is_none() {
        let token = record.lease_token.to_string();
        let mut pairs = form.pairs().to_vec();
        pairs.push(("token", token.as_str()));
        format!(
            "<div class=\"box\"><p class=\"warn\">Its outcome was uncertain. Only once you \
             have checked with the provider (reference <code>{}</code>) that the effect did \
             <strong>not</strong> happen: resolve it as not applied, and the next delivery \
             or request runs it again. A worker reconciling it right now keeps it.</p>{}</div>",
            escape(record.external_ref.as_deref().unwrap_or("-")),
            post_form_with(
                "/ops/resolve",
                &pairs,
                "<input type=\"text\" name=\"note\" size=\"40\" \
                 placeholder=\"what the provider said (kept in the record)\">",
                &console.csrf,
                "Not applied: run it again"
            )
        )
    } else {
        String::new()
    };
    let body = format!(
        "{}{release}{resolve}",
        table("record", &["field", "value"], &fields)
    );
    page("Operation", &body).into_response()
}

/// Resolves an uncertain operation as not applied (as `idem ops resolve --not-applied`).
pub(super) async fn resolve(
    State(console): State<Arc<Console>>,
    Form(form): Form<KeyForm>,
) -> Response {
    let key = match form.action_key(&console).await {
        Ok(key) => key,
        Err(response) => return *response,
    };
    let Some(token) = form.token else {
        let answer = (
            axum::http::StatusCode::BAD_REQUEST,
            "the lease token the page showed is missing",
        );
        return answer.into_response();
    };
    let note = match form.note.as_deref().map(str::trim) {
        Some(note) if !note.is_empty() => note.to_owned(),
        _ => "resolved from the console".to_owned(),
    };
    let said = match console.store.resolve_not_applied(&key, token, &note).await {
        Ok(Some(record)) => format!(
            "<p class=\"ok\">Resolved as not applied: failed (retryable) after {} \
             attempt(s); the next delivery or request runs it again.</p>",
            record.attempts
        ),
        Ok(None) => "<p class=\"warn\">Nothing resolved: the operation changed since the \
                     page showed it (a worker took it, and may have acted: check with the \
                     provider again), is leased to a worker reconciling it, was \
                     discarded, or is not uncertain.</p>"
            .into(),
        Err(error) => return failed("the store", &error.into()),
    };
    page("Resolve", &format!("{said}{}", form.back())).into_response()
}

/// Ends an in-flight operation's lease (as `idem ops release`).
pub(super) async fn release(
    State(console): State<Arc<Console>>,
    Form(form): Form<KeyForm>,
) -> Response {
    let key = match form.action_key(&console).await {
        Ok(key) => key,
        Err(response) => return *response,
    };
    let said = match console.store.release(&key).await {
        Ok(Some(record)) => format!(
            "<p class=\"ok\">Released: the lease of this {} operation ended; the next \
             delivery takes it over.</p>",
            escape(record.status.as_str())
        ),
        Ok(None) => "<p class=\"warn\">Nothing released: the operation is not processing or \
                     pending.</p>"
            .into(),
        Err(error) => return failed("the store", &error.into()),
    };
    page("Release", &format!("{said}{}", form.back())).into_response()
}
