//! The dead-letter pages: groups per queue with a replay preview, the confirmation
//! that repeats the dry run's numbers, and the replay or discard itself.

use std::sync::Arc;

use axum::Form;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use idem::replay::{self, Action, DlqMessage, Filter, Options, Preview, Summary};
use serde::Deserialize;

use super::html::{escape, num, page, post_form, query, table};
use super::pages::{DLQ_READ, MESSAGES_PER_GROUP, failed, given, when};
use super::{Console, forbidden};

/// Dead letters per queue, grouped by reason, operation and error, with what a replay
/// of each group would do.
pub(super) async fn dead_letters(State(console): State<Arc<Console>>) -> Response {
    let connection = match console.broker().await {
        Ok(c) => c,
        Err(error) => return failed("the broker", &error),
    };
    let mut body = String::new();
    for queue in &console.queues {
        match queue_section(&console, &connection, queue).await {
            Ok(section) => body.push_str(&section),
            Err(response) => return response,
        }
    }
    let _ = connection.close(200, "page done".into()).await;
    page("Dead letters", &body).into_response()
}

/// One queue's DLQ: its groups with their previews, then each group's first letters.
async fn queue_section(
    console: &Console,
    connection: &lapin::Connection,
    queue: &str,
) -> Result<String, Response> {
    let dlq = replay::dlq_of(queue);
    let messages = replay::peek(connection, &dlq, &Filter::default(), DLQ_READ)
        .await
        .map_err(|error| failed(&format!("reading {dlq}"), &error.into()))?;
    let mut section = format!(
        "<h2>{}</h2><p>{} dead letter(s){}</p>",
        escape(&dlq),
        messages.len(),
        if messages.len() == DLQ_READ {
            " (the first read)"
        } else {
            ""
        }
    );
    // What a replay would do with each letter: one read of all their records.
    let previews = replay::preview_all(&console.store, &messages)
        .await
        .map_err(|error| failed("the store", &error.into()))?;
    let mut rows = Vec::new();
    let mut listed = String::new();
    for group in replay::group(&messages) {
        let key = (
            group.reason.as_str(),
            group.operation.as_str(),
            group.error.as_str(),
        );
        let members: Vec<(&DlqMessage, Preview)> = messages
            .iter()
            .zip(previews.iter().copied())
            .filter(|(m, _)| replay::group_key(m) == key)
            .collect();
        rows.push(group_row(queue, &group, &members));
        listed.push_str(&format!(
            "<h3>{} · {} · {}</h3>",
            escape(&group.reason),
            escape(&group.operation),
            escape(&group.error)
        ));
        let message_rows: Vec<Vec<String>> = members
            .iter()
            .take(MESSAGES_PER_GROUP)
            .map(|(m, _)| message_row(queue, m))
            .collect();
        listed.push_str(&table(
            "messages",
            &[
                "scope",
                "key",
                "attempts",
                "failed at",
                "what it carried",
                "",
            ],
            &message_rows,
        ));
    }
    section.push_str(&table(
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
    section.push_str(&listed);
    Ok(section)
}

/// One group's row: what it is, how many, what a replay would do with them, and the
/// links to confirm a replay or discard of the group.
fn group_row(
    queue: &str,
    group: &replay::Group,
    members: &[(&DlqMessage, Preview)],
) -> Vec<String> {
    let (mut acked, mut runs, mut stays) = (0, 0, 0);
    for (_, preview) in members {
        match preview {
            Preview::AlreadyDone => acked += 1,
            Preview::Runs => runs += 1,
            Preview::Conflict | Preview::Malformed => stays += 1,
        }
    }
    let selector = [
        ("queue", queue),
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
    vec![
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
    ]
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
        carried(m),
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

/// How much of a dead letter's body the page shows.
const BODY_SHOWN: usize = 4096;

/// What a dead letter carried, folded: its type, message id, headers and body (cut at
/// [`BODY_SHOWN`] bytes), escaped, so that a missing handler (a fine message of an
/// unknown type) can be told from a broken producer without a terminal.
fn carried(m: &DlqMessage) -> String {
    let mut text = format!("type: {}\n", m.message_type().unwrap_or("-"));
    let id = m.delivery.properties.message_id();
    text.push_str(&format!(
        "message id: {}\n",
        id.as_ref().map_or("-", |i| i.as_str())
    ));
    for (name, value) in m.headers() {
        text.push_str(&format!("{name}: {}\n", idem::text::cut(&value, 512)));
    }
    let body = m.body_text();
    text.push_str(&format!("\n{}", idem::text::cut(&body, BODY_SHOWN)));
    format!(
        "<details><summary>{} · {} bytes</summary><pre>{}</pre></details>",
        escape(m.message_type().unwrap_or("no type")),
        m.delivery.data.len(),
        escape(&text)
    )
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
        hold: None,
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
