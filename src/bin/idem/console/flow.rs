//! The flow page: each circuit (state, opens in a row, next probe, why) with a form to
//! close it by hand (as `idem flow close`, for the console's queues only), and each
//! limit's use now.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Form, http::StatusCode};
use idem::flow::{CircuitRow, CircuitState, LimitRow};
use serde::Deserialize;

use super::html::{escape, num, page, post_form_with, table};
use super::pages::{failed, when};
use super::{Console, forbidden};

/// The circuits and the limits.
pub(super) async fn page_of(State(console): State<Arc<Console>>) -> Response {
    let pool = console.store.pool();
    let circuits = match idem::flow::circuits(pool).await {
        Ok(rows) => rows,
        Err(error) => return failed("the store", &error.into()),
    };
    let limits = match idem::flow::limits(pool).await {
        Ok(rows) => rows,
        Err(error) => return failed("the store", &error.into()),
    };
    let circuits: Vec<Vec<String>> = circuits.iter().map(|c| circuit_row(&console, c)).collect();
    let limits: Vec<Vec<String>> = limits.iter().map(limit_row).collect();
    let body = format!(
        "<h2>Circuits</h2><p>A queue whose circuit is open takes no delivery: they wait in \
         the broker, and one probe per pause tests the dependency.</p>{}\
         <h2>Limits</h2>{}",
        table(
            "circuits",
            &[
                "queue",
                "state",
                "opens in a row",
                "next probe / probe until",
                "reason",
                "since",
                ""
            ],
            &circuits
        ),
        table(
            "limits",
            &[
                "limit",
                "permits held",
                "held by",
                "calls in the last second"
            ],
            &limits
        )
    );
    page("Flow control", &body).into_response()
}

/// A circuit's row, with the form that closes it if it is one of the console's queues.
fn circuit_row(console: &Console, c: &CircuitRow) -> Vec<String> {
    let close = if c.state() != CircuitState::Closed && console.serves(&c.name) {
        post_form_with(
            "/flow/close",
            &[("queue", c.name.as_str())],
            "<input type=\"text\" name=\"note\" size=\"30\" required \
             placeholder=\"why (kept as its reason)\">",
            &console.csrf,
            "Close it",
        )
    } else {
        String::new()
    };
    vec![
        escape(&c.name),
        format!(
            "<span class=\"{}\">{}</span>",
            state_class(&c.state),
            escape(&c.state)
        ),
        num(c.opens),
        when(c.retry_at),
        escape(c.reason.as_deref().unwrap_or("-")),
        when(Some(c.changed_at)),
        close,
    ]
}

/// A limit's row: its permits held and by whom, its calls in the last second.
fn limit_row(l: &LimitRow) -> Vec<String> {
    vec![
        escape(&l.name),
        bound(l.held, l.slots),
        escape(&l.holders.join(", ")),
        bound(l.last_second, l.per_second),
    ]
}

fn state_class(state: &str) -> &'static str {
    match state {
        "open" => "bad",
        "half_open" => "warn",
        _ => "ok",
    }
}

/// `used of bound`, or `used` with no bound.
fn bound(used: i64, of: i64) -> String {
    if of > 0 {
        num(format!("{used} of {of}"))
    } else {
        num(format!("{used} (no bound)"))
    }
}

#[derive(Deserialize)]
pub(super) struct CloseForm {
    queue: String,
    note: String,
    #[serde(default)]
    csrf: Option<String>,
}

/// Closes a circuit of one of the console's queues (as `idem flow close`).
pub(super) async fn close(
    State(console): State<Arc<Console>>,
    Form(form): Form<CloseForm>,
) -> Response {
    if !console.csrf_ok(form.csrf.as_deref()) {
        return forbidden();
    }
    if !console.serves(&form.queue) {
        let said = "403: the console acts on its own queues only (--queue); nothing was changed\n";
        return (StatusCode::FORBIDDEN, said).into_response();
    }
    let note = form.note.trim();
    if note.is_empty() {
        return (StatusCode::BAD_REQUEST, "a note is required\n").into_response();
    }
    let said = match idem::flow::close_circuit(console.store.pool(), &form.queue, note).await {
        Ok(Some(before)) => format!(
            "<p class=\"ok\">Closed (it was {}): the workers of {} take its deliveries again \
             within a second.</p>",
            before.as_str(),
            escape(&form.queue)
        ),
        Ok(None) => "<p class=\"warn\">Nothing closed: the queue has no circuit.</p>".into(),
        Err(error) => return failed("the store", &error.into()),
    };
    page(
        "Close a circuit",
        &format!("{said}<p><a href=\"/flow\">Back to flow control</a></p>"),
    )
    .into_response()
}
