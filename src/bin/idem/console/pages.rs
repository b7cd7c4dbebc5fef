//! What every page shares: the bounds of what a page reads, the error page, and how
//! times and form values read; and the outbox page. Each page reads with bounded
//! queries (the broker's DLQ up to [`DLQ_READ`] messages, records up to [`ROWS`] through
//! the index of unresolved records) and each action does what the matching `idem`
//! command does. The dead letters are in `dead_letters`, the operations in
//! `operations`, the charts in `charts`.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use super::Console;
use super::html::{escape, num, page, table};

/// The most dead letters read from one DLQ for a page.
pub(super) const DLQ_READ: usize = 2_000;
/// The most records or outbox rows on a page.
pub(super) const ROWS: i64 = 200;
/// The messages listed under each group.
pub(super) const MESSAGES_PER_GROUP: usize = 20;

/// An error page (500) saying what failed, in one line with its causes.
pub(super) fn failed(what: &str, error: &anyhow::Error) -> Response {
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
pub(super) fn when(t: Option<chrono::DateTime<chrono::Utc>>) -> String {
    t.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_else(|| "-".into())
}

/// A filter value given in a form or query: absent when empty.
pub(super) fn given(value: &Option<String>) -> Option<String> {
    value.clone().filter(|v| !v.is_empty())
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
    let scheduled = match idem::outbox::scheduled(pool, ROWS).await {
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
            vec![
                "scheduled (delayed, not due yet)".into(),
                num(stats.scheduled),
            ],
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
    let scheduled: Vec<Vec<String>> = scheduled
        .iter()
        .map(|e| {
            vec![
                when(e.not_before),
                format!("<code>{}</code>", escape(&e.message_id)),
                escape(&e.operation),
                escape(&format!("{} → {}", e.exchange, e.routing_key)),
            ]
        })
        .collect();
    let body = format!(
        "{summary}<h2>Failing (unroutable, nacked)</h2>{}<h2>Scheduled, the soonest first</h2>{}",
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
        ),
        table(
            "scheduled",
            &[
                "not before",
                "message id",
                "operation",
                "exchange → routing key"
            ],
            &scheduled
        )
    );
    page("Outbox", &body).into_response()
}
