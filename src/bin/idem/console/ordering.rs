//! The ordering page: entities of ordered handlers whose deliveries wait for their turn
//! (as `idem ops ordering list`), those that have not moved for a while first, with
//! what blocks each and the `idem ops ordering skip` command for a turn that will never
//! come. Reading only: a skip is the operator's decision, taken with a note, at the
//! command line.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem::ordering::Position;
use serde::Deserialize;

use super::Console;
use super::html::{escape, num, page, query, table};
use super::pages::{ROWS, failed, when};

/// The stall time the page starts with: the workers' default
/// (`WorkerConfig::ordering_stall_after`), as the gauge `idem_ordering_stalled` counts.
const STALL_AFTER: &str = "60s";

#[derive(Deserialize, Default)]
pub(super) struct OrderingQuery {
    /// Only entities not moved for this long (`30s`, `10m`); `0s`: every entity with
    /// deliveries waiting.
    #[serde(default)]
    stalled_for: Option<String>,
}

/// Entities with deliveries waiting, the most stalled first.
pub(super) async fn page_of(
    State(console): State<Arc<Console>>,
    Query(q): Query<OrderingQuery>,
) -> Response {
    let asked = q
        .stalled_for
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .unwrap_or(STALL_AFTER)
        .to_owned();
    let stalled_for = match crate::ops::parse_duration(&asked) {
        Ok(d) => (!d.is_zero()).then_some(d),
        Err(error) => {
            return (StatusCode::BAD_REQUEST, format!("stalled_for: {error}\n")).into_response();
        }
    };
    let pool = console.store.pool();
    let totals: (i64, i64) = match sqlx::query_as(
        "SELECT count(DISTINCT (scope, ordering_key)), count(*) FROM ordering_waiting",
    )
    .fetch_one(pool)
    .await
    {
        Ok(totals) => totals,
        Err(error) => return failed("the store", &error.into()),
    };
    let positions = match idem::ordering::list(pool, stalled_for, ROWS).await {
        Ok(positions) => positions,
        Err(error) => return failed("the store", &error.into()),
    };
    let now = chrono::Utc::now();
    let rows: Vec<Vec<String>> = positions.iter().map(|p| position_row(p, now)).collect();
    let listed = match stalled_for {
        Some(d) => format!("not moved for {} or longer", escape(&asked_as(d, &asked))),
        None => "all".into(),
    };
    let body = format!(
        "<p>An ordered handler's deliveries of one entity run one at a time, in sequence; \
         one that comes before its turn waits in Postgres. An entity that does not move \
         is blocked by its holder (retrying, pending, dead-lettered: replay it from the \
         dead letters) or by a gap (the number whose turn it is never arrived). For a gap \
         that will never be filled or a dead letter that will not be replayed, skip the \
         turn with a note: <code>idem ops ordering skip --scope S --key K --note \
         \"...\"</code>; the next waiting delivery then runs within a second or so.</p>\
         {}{}<p>{} entit{} with deliveries waiting, {listed}{}</p>{}",
        table(
            "ordering-totals",
            &["", ""],
            &[
                vec!["entities with deliveries waiting".into(), num(totals.0)],
                vec!["deliveries waiting".into(), num(totals.1)],
            ],
        ),
        filter_form(&asked),
        positions.len(),
        if positions.len() == 1 { "y" } else { "ies" },
        if positions.len() as i64 == ROWS {
            " (the first)"
        } else {
            ""
        },
        table(
            "ordering",
            &[
                "scope",
                "ordering key",
                "next seq",
                "blocked by",
                "holder",
                "waiting",
                "first waiting seq",
                "not moved since",
                "skipped",
                "to skip the turn"
            ],
            &rows
        )
    );
    page("Order per entity", &body).into_response()
}

/// The duration as asked, or as seconds when it was given as a bare number.
fn asked_as(d: Duration, asked: &str) -> String {
    if asked.ends_with(|c: char| c.is_ascii_digit()) {
        format!("{}s", d.as_secs())
    } else {
        asked.to_owned()
    }
}

/// The stall time to list by, filled in, and the links to the two usual views.
fn filter_form(asked: &str) -> String {
    format!(
        "<form method=\"get\" action=\"/ordering\"><label>Not moved for at least \
         <input type=\"text\" name=\"stalled_for\" size=\"6\" value=\"{}\"></label> \
         <button type=\"submit\">List</button> <a href=\"/ordering?{}\">stalled \
         ({STALL_AFTER})</a> · <a href=\"/ordering?{}\">all with deliveries waiting</a></form>",
        escape(asked),
        query(&[("stalled_for", STALL_AFTER)]),
        query(&[("stalled_for", "0s")]),
    )
}

/// One entity's row.
fn position_row(p: &Position, now: chrono::DateTime<chrono::Utc>) -> Vec<String> {
    let blocked_by = p.blocked_by();
    let holder = match &p.holder {
        Some((operation, key)) => format!(
            "<a href=\"/ops/show?{}\"><code>{}</code> / <code>{}</code></a>{}",
            escape(&query(&[
                ("scope", &p.scope),
                ("operation", operation),
                ("key", key)
            ])),
            escape(operation),
            escape(key),
            p.holder_status
                .as_deref()
                .map_or(String::new(), |s| format!(" ({})", escape(s)))
        ),
        None => "-".into(),
    };
    let skipped = match (&p.skip_note, p.skipped) {
        (_, 0) => String::new(),
        (Some(note), n) => format!("{n} (last: {})", escape(note)),
        (None, n) => n.to_string(),
    };
    let skip = if matches!(blocked_by, "gap" | "dead-lettered") {
        format!(
            "<code>{}</code>",
            escape(&format!(
                "idem ops ordering skip --scope {} --key {} --seq {} --note \"...\"",
                shell_word(&p.scope),
                shell_word(&p.ordering_key),
                p.next_seq
            ))
        )
    } else {
        String::new()
    };
    vec![
        escape(&p.scope),
        format!("<code>{}</code>", escape(&p.ordering_key)),
        num(p.next_seq),
        format!(
            "<span class=\"{}\">{}</span>",
            blocked_class(blocked_by),
            blocked_by
        ),
        holder,
        num(p.waiting),
        num(p.first_waiting.map_or("-".into(), |s| s.to_string())),
        format!(
            "{} ({} ago)",
            when(Some(p.moved_at)),
            age((now - p.moved_at).to_std().unwrap_or_default())
        ),
        skipped,
        skip,
    ]
}

fn blocked_class(blocked_by: &str) -> &'static str {
    match blocked_by {
        "dead-lettered" | "gap" => "bad",
        "retrying" | "pending" => "warn",
        _ => "ok",
    }
}

/// A duration as an operator reads it: `45s`, `12m 5s`, `3h 2m`, `2d 4h`.
fn age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// `word` as one shell word: as it is when it needs no quoting, else single-quoted.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/@%+=,".contains(&b));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_in_their_largest_units_and_keys_quote_as_one_shell_word() {
        assert_eq!(age(Duration::from_secs(45)), "45s");
        assert_eq!(age(Duration::from_secs(725)), "12m 5s");
        assert_eq!(age(Duration::from_secs(3 * 3600 + 150)), "3h 2m");
        assert_eq!(age(Duration::from_secs(2 * 86_400 + 4 * 3600)), "2d 4h");
        assert_eq!(shell_word("order-42"), "order-42");
        assert_eq!(shell_word("it's <x>"), "'it'\\''s <x>'");
        assert_eq!(shell_word(""), "''");
        assert_eq!(asked_as(Duration::from_secs(90), "90"), "90s");
        assert_eq!(asked_as(Duration::from_secs(600), "10m"), "10m");
    }
}
