//! Text for people: an error and its causes on one line, a text cut to a bound, and
//! control characters made visible, so that what a message or a driver says reaches a
//! log, a header or an operator's terminal as text of a known size and nothing more.

use std::borrow::Cow;
use std::fmt::Write as _;

/// An error and its causes on one line (`a: b: c`), for the one line a binary prints
/// when it fails and for logs. idem's own errors never repeat their source in their
/// message; a cause whose text the previous message already contains is skipped anyway,
/// because drivers (sqlx, lapin, std::io wrappers) often do.
pub fn error_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut last = line.clone();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !last.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        last = text;
        source = cause.source();
    }
    line
}

/// `text` in at most `max` bytes: whole when it fits, else cut on a character boundary
/// and ended with `… (N bytes cut)`, so that a reader knows it is not all. A message
/// can make an error text as long as itself (serde quotes the value it refused).
pub fn cut(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return Cow::Borrowed(text);
    }
    // The marker's own length depends on the number it shows: make room for the
    // longest it can be.
    let room = max.saturating_sub(format!("… ({} bytes cut)", text.len()).len());
    let mut end = room;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!(
        "{}… ({} bytes cut)",
        &text[..end],
        text.len() - end
    ))
}

/// `text` with every control character (C0, DEL, C1; also line breaks and tabs) written
/// as a `\u{…}` escape (`\n` as `\n`), for a terminal: a dead letter's error, a
/// correlation id or a body can otherwise move the cursor, clear the screen or change
/// a window's title on the operator's screen.
pub fn printable(text: &str) -> Cow<'_, str> {
    escaped(text, false)
}

/// [`printable`], but line breaks are kept: for text of several lines that the caller
/// made (a table, pretty JSON), whose values are already escaped or [`printable`].
pub fn printable_lines(text: &str) -> Cow<'_, str> {
    escaped(text, true)
}

fn escaped(text: &str, keep_lines: bool) -> Cow<'_, str> {
    let escape = |c: char| c.is_control() && !(keep_lines && c == '\n');
    if !text.chars().any(escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            c if !escape(c) => out.push(c),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_text_is_cut_on_a_character_boundary_within_its_bound() {
        assert_eq!(cut("short", 10), "short");
        let long = "€".repeat(1000); // 3,000 bytes
        let cut_text = cut(&long, 100);
        assert!(cut_text.len() <= 100, "{} bytes", cut_text.len());
        assert!(cut_text.ends_with(" bytes cut)"), "{cut_text}");
        let kept = cut_text.split('…').next().unwrap();
        assert!(kept.chars().all(|c| c == '€') && !kept.is_empty());
        assert_eq!(
            cut_text,
            format!("{kept}… ({} bytes cut)", 3000 - kept.len())
        );
        // A bound smaller than the marker keeps nothing of the text, and no panic.
        assert!(cut(&long, 3).starts_with('…'));
    }

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(printable("plain €"), "plain €");
        assert_eq!(printable_lines("a\nb\u{1b}c"), "a\nb\\u{1b}c");
        assert_eq!(
            printable("a\u{1b}[2Jb\nc\u{7}\u{9b}d\0"),
            "a\\u{1b}[2Jb\\nc\\u{7}\\u{9b}d\\u{0}"
        );
    }
}
