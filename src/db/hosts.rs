//! Host lists, as libpq reads them: `postgres://u:p@db1:5432,db2:5432/app` with
//! `target_session_attrs=read-write` (or `primary`). sqlx takes one host per URL, so the
//! list is split into one set of options per host; a pool connects to the first that
//! will do and a task of its own follows it to another when it stops doing (it fails,
//! or turns read-only as a demoted primary does), as a worker follows a RabbitMQ node
//! list (`topology::connect`).

use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};
use tracing::warn;

use super::{DbError, target};

/// How often a pool on a host list checks its host.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// How long one host may take to answer a check or a connect before the next is tried.
const ANSWER_WITHIN: Duration = Duration::from_secs(3);

/// Whether a session may write: libpq's check for `read-write`, and for `primary` (a
/// standby in recovery refuses writes with SQLSTATE 25006 either way).
const TAKES_WRITES: &str =
    "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'";

/// The hosts of a URL, each with the URL's user, database and parameters.
#[derive(Debug, Clone)]
pub(super) struct Hosts {
    /// One set of options per host, in the URL's order.
    pub(super) each: Vec<PgConnectOptions>,
    /// `target_session_attrs` asks for a host that takes writes.
    writable: bool,
}

impl Hosts {
    /// Splits `url`'s host list; names the connections `name` unless the URL does.
    pub(super) fn parse(url: &str, name: &str) -> Result<Hosts, DbError> {
        let invalid = |why: String| DbError::InvalidUrl(sqlx::Error::Configuration(why.into()));
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| invalid("a Postgres URL starts with postgres://".into()))?;
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (user, list) = match authority.rsplit_once('@') {
            Some((user, list)) => (format!("{user}@"), list),
            None => (String::new(), authority),
        };
        let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
        let mut writable = false;
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("target_session_attrs", value)) => {
                    writable = match value {
                        "any" => false,
                        "read-write" | "primary" => true,
                        other => {
                            return Err(invalid(format!(
                                "target_session_attrs={other} is not supported (any, read-write, primary)"
                            )));
                        }
                    }
                }
                _ => kept.push(pair),
            }
        }
        let query = match kept.is_empty() {
            true => String::new(),
            false => format!("?{}", kept.join("&")),
        };
        let hosts: Vec<&str> = list.split(',').collect();
        if hosts.len() > 1 && hosts.iter().any(|h| h.is_empty()) {
            return Err(invalid(format!("an empty host in the list {list}")));
        }
        if hosts.len() > 1
            && kept.iter().any(|p| {
                let key = p.split_once('=').map_or(*p, |(k, _)| k);
                matches!(key, "host" | "hostaddr" | "port")
            })
        {
            return Err(invalid(
                "a host list in the URL and host=, hostaddr= or port= beside it".into(),
            ));
        }
        let each = hosts
            .into_iter()
            .map(|host| {
                let one = format!("{scheme}://{user}{host}{path}{query}");
                let options = PgConnectOptions::from_str(&one).map_err(DbError::InvalidUrl)?;
                Ok(match options.get_application_name() {
                    Some(_) => options,
                    None => options.application_name(name),
                })
            })
            .collect::<Result<Vec<_>, DbError>>()?;
        Ok(Hosts { each, writable })
    }

    /// The same hosts, on database `name` (`postgres`, to create the one of the URL).
    pub(super) fn on_database(&self, name: &str) -> Hosts {
        Hosts {
            each: self.each.iter().map(|o| o.clone().database(name)).collect(),
            writable: self.writable,
        }
    }

    /// More than one host, or one that must take writes: a pool must check and follow.
    pub(super) fn followed(&self) -> bool {
        self.each.len() > 1 || self.writable
    }

    /// `host:port/database`, hosts comma-separated.
    pub(super) fn describe(&self) -> String {
        let hosts: Vec<String> = self
            .each
            .iter()
            .map(|o| format!("{}:{}", o.get_host(), o.get_port()))
            .collect();
        let database = self.each[0].get_database().unwrap_or("postgres");
        format!("{}/{database}", hosts.join(","))
    }

    /// The first host, in order, that answers (and takes writes, if asked for).
    pub(super) async fn pick(&self) -> Result<usize, DbError> {
        let mut last = None;
        for (i, options) in self.each.iter().enumerate() {
            match self.will_do(options).await {
                Ok(true) => return Ok(i),
                Ok(false) => {
                    last = Some(sqlx::Error::Configuration(
                        format!("{} does not take writes", target(options)).into(),
                    ))
                }
                Err(error) => last = Some(error),
            }
        }
        Err(DbError::NoHost {
            hosts: self.describe(),
            wanted: if self.writable {
                "takes writes"
            } else {
                "answers"
            },
            source: last.unwrap_or(sqlx::Error::PoolTimedOut),
        })
    }

    /// Whether the host of `options` answers (and takes writes, if asked for), within
    /// [`ANSWER_WITHIN`].
    async fn will_do(&self, options: &PgConnectOptions) -> Result<bool, sqlx::Error> {
        let checked = async {
            let mut conn = options.connect().await?;
            let fine = usable(&mut conn, self.writable).await;
            let _ = conn.close().await;
            fine
        };
        tokio::time::timeout(ANSWER_WITHIN, checked)
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut))
    }

    /// A pool on the first host that will do, followed by a task of its own.
    pub(super) async fn connect(self, options: PgPoolOptions) -> Result<PgPool, DbError> {
        let current = self.pick().await?;
        let moved = Moved::default();
        let writable = self.writable;
        let pool = retiring(options, &moved)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    // A host that turned read-only since the last check: not this one.
                    // (Any host that answers will do otherwise: nothing to ask.)
                    if !writable || usable(conn, true).await? {
                        return Ok(());
                    }
                    Err(sqlx::Error::Configuration(
                        "the host no longer takes writes".into(),
                    ))
                })
            })
            .connect_with(self.each[current].clone())
            .await
            .map_err(|source| DbError::Connect {
                target: target(&self.each[current]),
                source,
            })?;
        tokio::spawn(follow(pool.clone(), self, current, moved));
        Ok(pool)
    }
}

/// Whether `conn`'s host will do: it answers, and takes writes if `writable`.
async fn usable(conn: &mut PgConnection, writable: bool) -> Result<bool, sqlx::Error> {
    match writable {
        true => sqlx::query_scalar(TAKES_WRITES).fetch_one(conn).await,
        false => sqlx::query("SELECT 1").execute(conn).await.map(|_| true),
    }
}

/// When a pool's connections last moved to another host: a connection opened before
/// is not handed out again.
#[derive(Debug, Clone, Default)]
pub(crate) struct Moved(Arc<Mutex<Option<Instant>>>);

impl Moved {
    /// The pool's new connections go elsewhere from now on.
    pub(crate) fn now(&self) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
    }

    /// A connection `age` old was opened before the last move.
    fn before(&self, age: Duration) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|at| age > at.elapsed())
    }
}

/// `options`, retiring each connection opened before `moved`'s last move when it is
/// next asked for.
pub(crate) fn retiring(options: PgPoolOptions, moved: &Moved) -> PgPoolOptions {
    let moved = moved.clone();
    options.before_acquire(move |_, meta| {
        let keep = !moved.before(meta.age);
        Box::pin(async move { Ok(keep) })
    })
}

/// Checks the pool's host every [`CHECK_EVERY`] until the pool is closed, on a
/// connection of its own (a pool whose connections are all busy is not a host that
/// fails); when the host will not do, points the pool at the first host that will.
async fn follow(pool: PgPool, hosts: Hosts, mut current: usize, moved: Moved) {
    let mut checking: Option<PgConnection> = None;
    loop {
        tokio::time::sleep(CHECK_EVERY).await;
        if pool.is_closed() {
            if let Some(conn) = checking.take() {
                let _ = conn.close().await;
            }
            return;
        }
        let check = async {
            let conn = match checking.as_mut() {
                Some(conn) => conn,
                None => checking.insert(hosts.each[current].connect().await?),
            };
            usable(conn, hosts.writable).await
        };
        if let Ok(Ok(true)) = tokio::time::timeout(ANSWER_WITHIN, check).await {
            continue;
        }
        // Gone, refused, timed out or read-only: next time on a new connection.
        checking = None;
        match hosts.pick().await {
            Ok(next) if next == current => {}
            Ok(next) => {
                pool.set_connect_options(hosts.each[next].clone());
                moved.now();
                warn!(
                    from = %target(&hosts.each[current]),
                    to = %target(&hosts.each[next]),
                    "Postgres: moved to another host of the list"
                );
                current = next;
            }
            Err(error) => {
                warn!(error = %crate::text::error_line(&error), "Postgres: no host of the list will do; trying again")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_list_splits_into_one_url_per_host_with_the_rest_kept() {
        let hosts = Hosts::parse(
            "postgres://u:p%40ss@db1:5433,db2,[::1]:5434/app?sslmode=disable&target_session_attrs=read-write&application_name=w",
            "idem",
        )
        .unwrap();
        assert!(hosts.writable && hosts.followed());
        let each: Vec<_> = hosts
            .each
            .iter()
            .map(|o| {
                (
                    o.get_host().to_owned(),
                    o.get_port(),
                    o.get_database().map(str::to_owned),
                    o.get_username().to_owned(),
                    o.get_application_name().map(str::to_owned),
                )
            })
            .collect();
        let one = |host: &str, port| {
            (
                host.to_owned(),
                port,
                Some("app".to_owned()),
                "u".to_owned(),
                Some("w".to_owned()),
            )
        };
        assert_eq!(
            each,
            vec![one("db1", 5433), one("db2", 5432), one("[::1]", 5434)]
        );
        assert_eq!(
            hosts.describe(),
            "db1:5433,db2:5432,[::1]:5434/app",
            "never the password"
        );
    }

    #[test]
    fn one_host_without_target_session_attrs_is_not_followed() {
        let hosts = Hosts::parse("postgres://u@db1/app", "idem").unwrap();
        assert!(!hosts.followed());
        assert_eq!(hosts.each[0].get_application_name(), Some("idem"));
        let any = Hosts::parse("postgres://u@db1/app?target_session_attrs=any", "x").unwrap();
        assert!(!any.followed());
    }

    #[test]
    fn an_unsupported_target_is_refused_with_its_name() {
        let error =
            Hosts::parse("postgres://db1,db2/app?target_session_attrs=standby", "x").unwrap_err();
        let line = crate::text::error_line(&error);
        assert!(line.contains("target_session_attrs=standby"), "{line}");
        assert!(Hosts::parse("db1:5432/app", "x").is_err());
        assert!(
            Hosts::parse("postgres://db1,,db2/app", "x").is_err(),
            "empty host"
        );
        assert!(Hosts::parse("postgres://db1,db2/app?port=5433", "x").is_err());
        assert!(Hosts::parse("postgres://db1/app?port=5433", "x").is_ok());
        let created = Hosts::parse("postgres://db1,db2/app", "x").unwrap();
        assert_eq!(
            created.on_database("postgres").each[1].get_database(),
            Some("postgres")
        );
    }

    #[test]
    fn a_connection_opened_before_a_move_is_retired() {
        let moved = Moved::default();
        assert!(!moved.before(Duration::from_secs(3600)), "never moved");
        moved.now();
        assert!(moved.before(Duration::from_secs(1)), "opened a second ago");
        assert!(!moved.before(Duration::ZERO), "opened just now");
    }
}
