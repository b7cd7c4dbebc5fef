//! The console's HTML: escaping, the page frame, tables and forms. Server-rendered,
//! no script, no asset from elsewhere: the page works offline.

use std::fmt::Write;

use axum::response::Html;

/// `text` safe inside HTML text and attribute values.
pub(super) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `value` percent-encoded for a query string.
pub(super) fn query_value(value: &str) -> String {
    let mut out = String::new();
    for b in value.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => {
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    out
}

/// A query string of `pairs` (values encoded; names are the console's own).
pub(super) fn query(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(name, value)| format!("{name}={}", query_value(value)))
        .collect::<Vec<_>>()
        .join("&")
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:0;color:#1b1f24}
nav{background:#1b1f24;padding:.6em 1em}nav a{color:#fff;margin-right:1.2em;text-decoration:none}
main{padding:1em 1.5em}table{border-collapse:collapse;margin:.5em 0 1.5em}
th,td{border-bottom:1px solid #d0d7de;padding:.3em .7em;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.n{text-align:right}code{font-size:.9em}
.warn{color:#9a6700}.bad{color:#cf222e}.ok{color:#1a7f37}
form.inline{display:inline}button{cursor:pointer}.box{border:1px solid #d0d7de;padding:1em;max-width:50em}";

/// A whole page: the navigation, `title`, and `body` (already HTML).
pub(super) fn page(title: &str, body: &str) -> Html<String> {
    Html(format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{title} · idem console</title><style>{STYLE}</style></head><body>\
         <nav><a href=\"/dlq\">Dead letters</a><a href=\"/ops\">Operations</a>\
         <a href=\"/outbox\">Outbox</a><a href=\"/flow\">Flow</a><a href=\"/ordering\">Ordering</a><a href=\"/charts\">Charts</a></nav><main><h1>{title}</h1>{body}</main></body></html>",
        title = escape(title),
    ))
}

/// A table with `headers` and rows of cells (already HTML); numeric cells are
/// right-aligned by the caller with [`num`].
pub(super) fn table(id: &str, headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = format!("<table id=\"{}\"><tr>", escape(id));
    for h in headers {
        let _ = write!(out, "<th>{}</th>", escape(h));
    }
    out.push_str("</tr>");
    for row in rows {
        out.push_str("<tr>");
        for cell in row {
            if let Some(n) = cell.strip_prefix("\u{0}n") {
                let _ = write!(out, "<td class=\"n\">{n}</td>");
            } else {
                let _ = write!(out, "<td>{cell}</td>");
            }
        }
        out.push_str("</tr>");
    }
    out.push_str("</table>");
    out
}

/// A number cell for [`table`].
pub(super) fn num(n: impl std::fmt::Display) -> String {
    format!("\u{0}n{n}")
}

/// A POST form to `action` with hidden `fields`, the CSRF token and one button.
pub(super) fn post_form(action: &str, fields: &[(&str, &str)], csrf: &str, button: &str) -> String {
    post_form_with(action, fields, "", csrf, button)
}

/// [`post_form`] with `inputs` (HTML the operator fills in) before the button.
pub(super) fn post_form_with(
    action: &str,
    fields: &[(&str, &str)],
    inputs: &str,
    csrf: &str,
    button: &str,
) -> String {
    let mut out = format!(
        "<form class=\"inline\" method=\"post\" action=\"{}\">",
        escape(action)
    );
    for (name, value) in fields {
        let _ = write!(
            out,
            "<input type=\"hidden\" name=\"{}\" value=\"{}\">",
            escape(name),
            escape(value)
        );
    }
    let _ = write!(
        out,
        "{inputs}<input type=\"hidden\" name=\"csrf\" value=\"{}\"><button type=\"submit\">{}</button></form>",
        escape(csrf),
        escape(button)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_and_queries_encoded() {
        assert_eq!(
            escape("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(query(&[("key", "a b&c=ü")]), "key=a%20b%26c%3D%C3%BC");
    }
}
