//! What the command prints: every line goes through [`line`], so that no control
//! character a message or a record carries (an escape sequence in a dead letter's error,
//! a correlation id, a body) reaches the operator's terminal: they are written as
//! `\u{…}` escapes, the command's own line breaks kept. A reader that goes away
//! (`idem dlq show | head`) ends the command quietly.

use std::io::Write as _;

/// Prints one line (or the lines the command itself broke it into), escaped.
pub(crate) fn line(args: std::fmt::Arguments<'_>) {
    let text = args.to_string();
    let mut stdout = std::io::stdout().lock();
    if let Err(error) = writeln!(stdout, "{}", idem::text::printable_lines(&text)) {
        if error.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("idem: error: cannot write the output: {error}");
        std::process::exit(1);
    }
}

/// `println!`, through [`line`].
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::out::line(format_args!($($arg)*))
    };
}
pub(crate) use say;
