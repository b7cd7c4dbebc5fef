//! Whose fault a database error is: the message's, or the world's (docs/DESIGN.md,
//! "Errors by cause").
//!
//! The worker and handlers meet the same errors in different places; what to do with
//! one depends on its cause, never on where it surfaced. Postgres says the cause in the
//! SQLSTATE's class:
//!
//! | class | meaning | fault |
//! |---|---|---|
//! | 22 | data exception (NUL in text, a number out of range, bad encoding) | the message |
//! | 23 | integrity violation (a check or foreign key the data breaks) | the message |
//! | 54 | program limit exceeded (an index row too large, too many columns) | the message |
//! | 08, 57, 53, 58 | connection failure, shutdown or crash recovery, no resources, system error | an outage |
//! | 40 | serialization failure, deadlock | an outage (try again) |
//!
//! A connection that cannot be opened, broke, or timed out in the pool is an outage
//! too. Anything else (a syntax error, a missing table: a deploy's fault) is
//! [`Fault::Unknown`]: retried, and bounded by the retry tiers or the worker's safety
//! net, never dead-lettered at first sight.
//!
//! The message's fault cannot heal by retrying: the same bytes fail the same way, so
//! the worker dead-letters it at once. An outage heals by waiting.

use std::fmt;

/// Who caused an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The data: the same message fails the same way every time.
    Message,
    /// The database is unreachable, restarting, overloaded or asked us to try again:
    /// waiting heals it.
    Outage,
    /// Neither is known (a bug or a deploy's fault): retry, but not forever.
    Unknown,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fault::Message => "the message's fault",
            Fault::Outage => "an outage",
            Fault::Unknown => "of unknown cause",
        })
    }
}

/// Classifies a database error by its SQLSTATE class, or by the driver's error kind
/// when Postgres never answered.
pub(crate) fn classify(error: &sqlx::Error) -> Fault {
    match error {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => by_sqlstate(&code),
            None => Fault::Unknown,
        },
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => Fault::Outage,
        // A value the driver could not encode came from the caller's data.
        sqlx::Error::Encode(_) => Fault::Message,
        _ => Fault::Unknown,
    }
}

/// Classifies a SQLSTATE (five characters) by its class, its first two.
pub(crate) fn by_sqlstate(code: &str) -> Fault {
    // A read-only transaction: the host is a standby, or a primary demoted in a
    // failover (a host list moves to the new one).
    if code == "25006" {
        return Fault::Outage;
    }
    match code.get(..2) {
        Some("22" | "23" | "54") => Fault::Message,
        Some("08" | "57" | "53" | "58" | "40") => Fault::Outage,
        _ => Fault::Unknown,
    }
}

/// How the text of a handler's error begins when it came from the database (`?` on a
/// sqlx call): operators see all of it (logs, dead letters); an HTTP client sees only
/// [`public`], since what Postgres says names tables, columns and constraints.
pub(crate) const FROM_DATABASE: &str = "database: ";

/// What a client may see of an error text: the text itself, unless it came from the
/// database ([`FROM_DATABASE`]), which is cut to its SQLSTATE.
#[cfg(any(test, feature = "http"))]
pub(crate) fn public(text: &str) -> std::borrow::Cow<'_, str> {
    let Some(said) = text.strip_prefix(FROM_DATABASE) else {
        return std::borrow::Cow::Borrowed(text);
    };
    let code = said
        .rsplit_once("(SQLSTATE ")
        .and_then(|(_, code)| code.strip_suffix(')'))
        .filter(|code| code.len() == 5 && code.bytes().all(|b| b.is_ascii_alphanumeric()));
    std::borrow::Cow::Owned(match code {
        Some(code) => format!("a database error (SQLSTATE {code})"),
        None => "a database error".to_owned(),
    })
}

/// What Postgres said, with its SQLSTATE, for a dead letter's `idem-error`:
/// `invalid byte sequence for encoding "UTF8": 0x00 (SQLSTATE 22021)`.
pub(crate) fn describe(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("{} (SQLSTATE {code})", db.message()),
            None => db.message().to_owned(),
        },
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstate_classes_decide_the_fault() {
        // NUL in text, numeric out of range, invalid text representation.
        for code in ["22021", "22003", "22P02", "22P05"] {
            assert_eq!(by_sqlstate(code), Fault::Message, "{code}");
        }
        // Check, not-null, foreign key; index row too large.
        for code in ["23514", "23502", "23503", "54000"] {
            assert_eq!(by_sqlstate(code), Fault::Message, "{code}");
        }
        // Connection failure, admin shutdown, cannot connect now, out of memory,
        // disk full, I/O error, serialization failure, deadlock, read-only (a standby).
        for code in [
            "08006", "57P01", "57P03", "53200", "53100", "58030", "40001", "40P01", "25006",
        ] {
            assert_eq!(by_sqlstate(code), Fault::Outage, "{code}");
        }
        // Undefined table, syntax error, internal error: nobody's known fault.
        for code in ["42P01", "42601", "XX000", "25001", "", "2"] {
            assert_eq!(by_sqlstate(code), Fault::Unknown, "{code}");
        }
    }

    #[test]
    fn a_client_sees_of_a_database_error_only_its_sqlstate() {
        let said = format!(
            "{FROM_DATABASE}duplicate key value violates unique constraint \"payments_pkey\" (SQLSTATE 23505)"
        );
        assert_eq!(public(&said), "a database error (SQLSTATE 23505)");
        assert_eq!(
            public(&format!("{FROM_DATABASE}no code")),
            "a database error"
        );
        assert_eq!(public("card declined"), "card declined");
    }

    #[test]
    fn driver_errors_without_an_answer_are_outages() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(classify(&sqlx::Error::Io(refused)), Fault::Outage);
        assert_eq!(classify(&sqlx::Error::PoolTimedOut), Fault::Outage);
        assert_eq!(classify(&sqlx::Error::RowNotFound), Fault::Unknown);
    }
}
