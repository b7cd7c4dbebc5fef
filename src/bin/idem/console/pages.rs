//! The console's pages and actions. Each page reads with bounded queries (the broker's
//! DLQ up to [`DLQ_READ`] messages, records up to [`ROWS`] through the index of
//! unresolved records) and each action does what the matching `idem` command does.

use std::sync::Arc;

use axum::Form;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use idem::replay::{self, Action, DlqMessage, Filter, Options, Preview, Summary};
use idem::store::Record;
use idem::{Key, Status};
use serde::Deserialize;

use super::html::{escape, num, page, post_form, query, table};
use super::{Console, charts, forbidden};

/// The most dead letters read from one DLQ for a page.
const DLQ_READ: usize = 2_000;
/// The most records or outbox rows on a page.
const ROWS: i64 = 200;
/// The messages listed under each group.
const MESSAGES_PER_GROUP: usize = 20;

/// An error page (500) saying what failed, in one line with its causes.
fn failed(what: &str, error: &anyhow::Error) -> Response {
    let body = format!(
        "<p class=\"bad\">{}: {}</p>",
        escape(what),
        escape(&format!("{error:#}"))
    );
    (
        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        page("Error", &body),
    )
        .into_response()
}

/// A time as the pages show it.
fn when(t: Option<chrono::DateTime<chrono::Utc>>) -> String {
    t.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_else(|| "-".into())
}

/// A filter value given in a form or query: absent when empty.
fn given(value: &Option<String>) -> Option<String> {
    value.clone().filter(|v| !v.is_empty())
}

/// Dead letters per queue, grouped by reason, operation and error, with what a replay
/// of each group would do.
pub(super) async fn dead_letters(State(console): State<Arc<Console>>) -> Response {
    let connection = match console.broker().await {
        Ok(c) => c,
        Err(error) => return failed("the broker", &error),
    };
    let mut body = String::new();
    for queue in &console.queues {
        let dlq = replay::dlq_of(queue);
        let messages = match replay::peek(&connection, &dlq, &Filter::default(), DLQ_READ).await {
            Ok(messages) => messages,
            Err(error) => return failed(&format!("reading {dlq}"), &error.into()),
        };
        body.push_str(&format!(
            "<h2>{}</h2><p>{} dead letter(s){}</p>",
            escape(&dlq),
            messages.len(),
            if messages.len() == DLQ_READ {
                " (the first read)"
            } else {
                ""
            }
        ));
        let mut rows = Vec::new();
        let mut listed = String::new();
        for group in replay::group(&messages) {
            let key = (
                group.reason.as_str(),
                group.operation.as_str(),
                group.error.as_str(),
            );
            let members: Vec<&DlqMessage> = messages
                .iter()
                .filter(|m| replay::group_key(m) == key)
                .collect();
            let (mut acked, mut runs, mut stays) = (0, 0, 0);
            for m in &members {
                match replay::preview(&console.store, m).await {
                    Ok(Preview::AlreadyDone) => acked += 1,
                    Ok(Preview::Runs) => runs += 1,
                    Ok(Preview::Conflict | Preview::Malformed) => stays += 1,
                    Err(error) => return failed("the store", &error.into()),
                }
            }
            let selector = [
                ("queue", queue.as_str()),
                ("reason", group.reason.as_str()),
                ("operation", group.operation.as_str()),
                ("error", group.error.as_str()),
            ];
            let link = |action: &str, label: &str| {
                let mut pairs = selector.to_vec();
                pairs.push(("action", action));
                format!(
                    "<a href=\"/dlq/confirm?{}\">{label}</a>",
                    escape(&query(&pairs))
                )
            };
            rows.push(vec![
                escape(&group.reason),
                escape(&group.operation),
                escape(&group.error),
                num(group.count),
                when(group.oldest),
                when(group.newest),
                num(acked),
                num(runs),
                num(stays),
                format!(
                    "{} {}",
                    link("replay", "Replay…"),
                    link("discard", "Discard…")
                ),
            ]);
            listed.push_str(&format!(
                "<h3>{} · {} · {}</h3>",
                escape(&group.reason),
                escape(&group.operation),
                escape(&group.error)
            ));
            let message_rows: Vec<Vec<String>> = members
                .iter()
                .take(MESSAGES_PER_GROUP)
                .map(|m| message_row(queue, m))
                .collect();
            listed.push_str(&table(
                "messages",
                &["scope", "key", "attempts", "failed at", ""],
                &message_rows,
            ));
        }
        drop(messages);
        body.push_str(&table(
            "groups",
            &[
                "reason",
                "operation",
                "error",
                "count",
                "oldest",
                "newest",
                "completed: acked only",
                "would run again",
                "conflict or malformed: stay",
                "",
            ],
            &rows,
        ));
        body.push_str(&listed);
    }
    let _ = connection.close(200, "page done".into()).await;
    page("Dead letters", &body).into_response()
}

fn message_row(queue: &str, m: &DlqMessage) -> Vec<String> {
    let key = m.key.as_deref().unwrap_or_default();
    let (_, operation, _) = replay::group_key(m);
    let scope = m.scope.as_deref().unwrap_or_default();
    let link = |action: &str, label: &str| {
        let pairs = [
            ("queue", queue),
            ("scope", scope),
            ("operation", operation),
            ("key", key),
            ("action", action),
        ];
        format!(
            "<a href=\"/dlq/confirm?{}\">{label}</a>",
            escape(&query(&pairs))
        )
    };
    vec![
        escape(m.scope.as_deref().unwrap_or("-")),
        format!("<code>{}</code>", escape(key)),
        num(m.attempts.unwrap_or(0)),
        when(m.failed_at),
        if key.is_empty() {
            String::new()
        } else {
            format!(
                "{} {}",
                link("replay", "Replay…"),
                link("discard", "Discard…")
            )
        },
    ]
}

/// Which dead letters an action is about: a group, or one message by key.
#[derive(Deserialize)]
pub(super) struct Selection {
    queue: String,
    action: String,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    operation: Option<String>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    key: Option<String>,
    /// With `key`: the message's scope (a key is unique within a scope and operation).
    #[serde(default)]
    scope: Option<String>,
    /// The form's CSRF token (actions only).
    #[serde(default)]
    csrf: Option<String>,
}

impl Selection {
    fn action(&self) -> Option<Action> {
        match self.action.as_str() {
            "replay" => Some(Action::Replay),
            "discard" => Some(Action::Discard),
            _ => None,
        }
    }

    /// One message: its key, scope and operation. A group: its reason, operation and
    /// error exactly as the page grouped them (an empty error is a value).
    fn filter(&self) -> Filter {
        match given(&self.key) {
            Some(key) => Filter {
                key: Some(key),
                scope: given(&self.scope),
                operation: given(&self.operation),
                ..Filter::default()
            },
            None => Filter {
                reason: Some(self.reason.clone().unwrap_or_default()),
                operation: Some(self.operation.clone().unwrap_or_default()),
                error: Some(self.error.clone().unwrap_or_default()),
                ..Filter::default()
            },
        }
    }

    /// `Replay` or `Discard`, and its past tense.
    fn verbs(action: Action) -> (&'static str, &'static str) {
        match action {
            Action::Replay => ("Replay", "Replayed"),
            Action::Discard => ("Discard", "Discarded"),
        }
    }

    fn fields(&self) -> Vec<(&'static str, String)> {
        let mut fields = vec![
            ("queue", self.queue.clone()),
            ("action", self.action.clone()),
        ];
        for (name, value) in [
            ("reason", &self.reason),
            ("operation", &self.operation),
            ("error", &self.error),
            ("key", &self.key),
            ("scope", &self.scope),
        ] {
            if let Some(value) = value {
                fields.push((name, value.clone()));
            }
        }
        fields
    }

    fn describe(&self) -> String {
        match &self.key {
            Some(key) => format!("the dead letter with key <code>{}</code>", escape(key)),
            None => format!(
                "the group {} · {} · {}",
                escape(self.reason.as_deref().unwrap_or("-")),
                escape(self.operation.as_deref().unwrap_or("-")),
                escape(self.error.as_deref().unwrap_or(""))
            ),
        }
    }
}

/// The numbers of a summary, as a table.
fn summary_table(summary: &Summary, action: Action) -> String {
    let mut rows = Vec::new();
    match action {
        Action::Replay => {
            rows.push(vec![
                "republished: will run again".into(),
                num(summary.replayed),
            ]);
            rows.push(vec![
                "already completed: acked, not run".into(),
                num(summary.already_done),
            ]);
            rows.push(vec!["conflicts: stay".into(), num(summary.conflicts_left)]);
            rows.push(vec!["malformed: stay".into(), num(summary.malformed_left)]);
        }
        Action::Discard => rows.push(vec!["discarded".into(), num(summary.discarded)]),
    }
    table("summary", &["", "messages"], &rows)
}

async fn summarize(
    console: &Console,
    selection: &Selection,
    action: Action,
    dry_run: bool,
) -> anyhow::Result<Summary> {
    let connection = console.broker().await?;
    // At most DLQ_READ matching messages per action, as the page shows at most that
    // many: a larger group takes another action (its confirmation says what is left).
    let options = Options {
        filter: Filter {
            limit: Some(DLQ_READ),
            ..selection.filter()
        },
        dry_run,
        pace: None,
    };
    let dlq = replay::dlq_of(&selection.queue);
    let summary = replay::run(&connection, &console.store, &dlq, action, &options).await;
    let _ = connection.close(200, "done".into()).await;
    Ok(summary?)
}

/// The selection's action on one of the console's queues, and what it did (or, in a dry
/// run, would do); otherwise the 400 or 500 answer.
async fn carry_out(
    console: &Console,
    selection: &Selection,
    dry_run: bool,
) -> Result<(Action, Summary), Box<Response>> {
    let Some(action) = selection
        .action()
        .filter(|_| console.serves(&selection.queue))
    else {
        let answer = (
            axum::http::StatusCode::BAD_REQUEST,
            "unknown action or queue",
        );
        return Err(Box::new(answer.into_response()));
    };
    match summarize(console, selection, action, dry_run).await {
        Ok(summary) => Ok((action, summary)),
        Err(error) => {
            let what = if dry_run { "the dry run" } else { "the action" };
            Err(Box::new(failed(what, &error)))
        }
    }
}

/// What an action would do, with the form that does it.
pub(super) async fn confirm_dead_letters(
    State(console): State<Arc<Console>>,
    Query(selection): Query<Selection>,
) -> Response {
    let (action, summary) = match carry_out(&console, &selection, true).await {
        Ok(done) => done,
        Err(answer) => return *answer,
    };
    let (verb, _) = Selection::verbs(action);
    let fields = selection.fields();
    let fields: Vec<(&str, &str)> = fields.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let body = format!(
        "<div class=\"box\"><p>{verb} {} in <code>{}</code>?</p>{}{}\
         <p><a href=\"/dlq\">Cancel</a></p></div>",
        selection.describe(),
        escape(&replay::dlq_of(&selection.queue)),
        summary_table(&summary, action),
        post_form("/dlq/act", &fields, &console.csrf, &format!("{verb} now")),
    );
    page(&format!("{verb}: confirm"), &body).into_response()
}

/// Replays or discards what the form selected, and says what was done.
pub(super) async fn act_on_dead_letters(
    State(console): State<Arc<Console>>,
    Form(selection): Form<Selection>,
) -> Response {
    if !console.csrf_ok(selection.csrf.as_deref()) {
        return forbidden();
    }
    let (action, summary) = match carry_out(&console, &selection, false).await {
        Ok(done) => done,
        Err(answer) => return *answer,
    };
    let (_, verb) = Selection::verbs(action);
    let body = format!(
        "<p class=\"ok\">{verb}: {}.</p>{}<p><a href=\"/dlq\">Back to the dead letters</a></p>",
        selection.describe(),
        summary_table(&summary, action)
    );
    page("Done", &body).into_response()
}

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
    // Served by the partial index on (status, lease_expires_at) of unresolved records
    // (the literal `<> 'completed'` lets every plan use its predicate).
    let rows: Result<Vec<Record>, sqlx::Error> = sqlx::query_as(
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
    .await;
    let records = match rows {
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
    let value = |v: &Option<String>| escape(v.as_deref().unwrap_or_default());
    let search = format!(
        "<form method=\"get\" action=\"/ops\"><input type=\"hidden\" name=\"status\" value=\"{}\">\
         scope <input name=\"scope\" value=\"{}\"> operation <input name=\"operation\" value=\"{}\"> \
         key starts with <input name=\"key\" value=\"{}\"> <button type=\"submit\">Search</button></form>",
        escape(&wanted),
        value(&q.scope),
        value(&q.operation),
        value(&q.key)
    );
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|r| {
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
        })
        .collect();
    let body = format!(
        "<p>{tabs}</p>{search}<p>{} operation(s){}</p>{}",
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

/// One operation's key, as a query or a form.
#[derive(Deserialize)]
pub(super) struct KeyForm {
    scope: String,
    operation: String,
    key: String,
    #[serde(default)]
    csrf: Option<String>,
}

impl KeyForm {
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
    let release = if matches!(record.status, Status::Processing | Status::Pending) {
        let pairs = [
            ("scope", form.scope.as_str()),
            ("operation", form.operation.as_str()),
            ("key", form.key.as_str()),
        ];
        format!(
            "<div class=\"box\"><p class=\"warn\">Release only when its worker is dead: the \
             lease ends now, and the next delivery or replay takes the operation over \
             (a pending one is reconciled first). The old owner's late writes are fenced \
             off.</p>{}</div>",
            post_form("/ops/release", &pairs, &console.csrf, "Release the lease")
        )
    } else {
        String::new()
    };
    let body = format!("{}{release}", table("record", &["field", "value"], &fields));
    page("Operation", &body).into_response()
}

/// Ends an in-flight operation's lease (as `idem ops release`).
pub(super) async fn release(
    State(console): State<Arc<Console>>,
    Form(form): Form<KeyForm>,
) -> Response {
    if !console.csrf_ok(form.csrf.as_deref()) {
        return forbidden();
    }
    let key = match form.key() {
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
    let back = format!(
        "<p><a href=\"/ops/show?{}\">Back to the operation</a></p>",
        escape(&query(&[
            ("scope", form.scope.as_str()),
            ("operation", form.operation.as_str()),
            ("key", form.key.as_str()),
        ]))
    );
    page("Release", &format!("{said}{back}")).into_response()
}

/// The outbox: backlog, oldest age, messages that keep failing.
pub(super) async fn outbox(State(console): State<Arc<Console>>) -> Response {
    let pool = console.store.pool();
    let stats = match idem::outbox::stats(pool).await {
        Ok(stats) => stats,
        Err(error) => return failed("the store", &error.into()),
    };
    let failing = match idem::outbox::list(pool, false, true, ROWS).await {
        Ok(rows) => rows,
        Err(error) => return failed("the store", &error.into()),
    };
    let summary = table(
        "outbox",
        &["", ""],
        &[
            vec!["not published yet".into(), num(stats.undispatched)],
            vec![
                "oldest waiting (s)".into(),
                num(stats.oldest_age_s.map_or("-".into(), |s| format!("{s:.0}"))),
            ],
            vec!["last publish failed".into(), num(stats.failing)],
        ],
    );
    let rows: Vec<Vec<String>> = failing
        .iter()
        .map(|e| {
            vec![
                format!("<code>{}</code>", escape(&e.message_id)),
                escape(&e.operation),
                escape(&format!("{} → {}", e.exchange, e.routing_key)),
                num(e.attempts),
                escape(e.last_error.as_deref().unwrap_or_default()),
            ]
        })
        .collect();
    let body = format!(
        "{summary}<h2>Failing (unroutable, nacked)</h2>{}",
        table(
            "failing",
            &[
                "message id",
                "operation",
                "exchange → routing key",
                "attempts",
                "last error"
            ],
            &rows
        )
    );
    page("Outbox", &body).into_response()
}

/// Charts: operations completed and dead-lettered per minute (from the records), queue
/// depths and the outbox's oldest age (sampled by the console since it started).
pub(super) async fn charts(State(console): State<Arc<Console>>) -> Response {
    let minutes = match charts::per_minute(&console).await {
        Ok(minutes) => minutes,
        Err(error) => return failed("the store", &error.into()),
    };
    let times: Vec<_> = minutes.iter().map(|m| m.minute).collect();
    let column = |f: fn(&charts::Minute) -> i64| -> Vec<f64> {
        minutes.iter().map(|m| f(m) as f64).collect()
    };
    let total = |f: fn(&charts::Minute) -> i64| -> i64 { minutes.iter().map(f).sum() };
    let mut body = format!(
        "<p>Last {} minutes: <span id=\"executed\">{}</span> completed on the first run, \
         <span id=\"retried\">{}</span> after a retry, <span id=\"dead-lettered\">{}</span> \
         dead-lettered and still in the DLQ.</p>",
        charts::WINDOW_MINUTES,
        total(|m| m.first_runs),
        total(|m| m.retried),
        total(|m| m.dead)
    );
    body.push_str(&charts::line_chart(
        "outcomes",
        "Operations per minute",
        &times,
        &[
            ("completed, first run", "#1a7f37", column(|m| m.first_runs)),
            ("completed after a retry", "#9a6700", column(|m| m.retried)),
            (
                "dead-lettered, still in the DLQ",
                "#cf222e",
                column(|m| m.dead),
            ),
        ],
    ));
    let samples = console.samples.snapshot();
    let times: Vec<_> = samples.iter().map(|s| s.at).collect();
    let colours = [
        "#0969da", "#cf222e", "#8250df", "#bf3989", "#1a7f37", "#9a6700",
    ];
    let names: Vec<String> = samples
        .last()
        .map(|s| s.depths.iter().map(|(name, _)| name.clone()).collect())
        .unwrap_or_default();
    let depth_series: Vec<(&str, &str, Vec<f64>)> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let values = samples
                .iter()
                .map(|s| {
                    s.depths
                        .iter()
                        .find(|(n, _)| n == name)
                        .and_then(|(_, d)| *d)
                        .map_or(0.0, f64::from)
                })
                .collect();
            (name.as_str(), colours[i % colours.len()], values)
        })
        .collect();
    body.push_str(&charts::line_chart(
        "depths",
        &format!(
            "Queue depths (ready messages, sampled every {} s)",
            charts::SAMPLE_EVERY.as_secs()
        ),
        &times,
        &depth_series,
    ));
    let ages: Vec<f64> = samples
        .iter()
        .map(|s| s.outbox_age_s.unwrap_or(0.0))
        .collect();
    body.push_str(&charts::line_chart(
        "outbox-age",
        "Outbox: oldest unpublished message (s)",
        &times,
        &[("oldest age", "#8250df", ages)],
    ));
    page("Charts", &body).into_response()
}
