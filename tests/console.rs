//! `idem console` (feature `console`) as a process, against the real broker and
//! database. Over plain HTTP: without the token every page and action answers 401; an
//! action without the form's CSRF token answers 403 and changes nothing. In a real
//! browser (headless Chromium through WebDriver): the dead-letter page shows an
//! outage's group with the replay preview; replaying the group from the page books each
//! order once; discarding a conflict from the page removes it; a stuck operation left
//! by a SIGKILLed worker is listed and released. The ordering page lists the entities
//! stalled behind a gap or a dead-lettered holder. Screenshots of each page are saved
//! under `target/tmp/console-screenshots/`.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use common::*;
use fantoccini::Locator;
use idem::tally::Line;
use reqwest::StatusCode;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::process::Child;

const SETTLE: Duration = Duration::from_secs(90);
const TOKEN: &str = "console-test-token-0123456789";

/// An `idem console` process on a free port, serving `queue`.
struct ConsoleProcess {
    _child: Child,
    base: String,
}

/// Starts `idem console` on a port of its own choosing and reads its address from the
/// line it prints (no port picked here and raced for).
async fn start_console(database_url: &str, queue: &str) -> ConsoleProcess {
    start_console_with(database_url, &["--queue", queue], Some(TOKEN))
        .await
        .0
}

/// [`start_console`] with `args`, and the token in the environment if any; with the
/// line it printed.
async fn start_console_with(
    database_url: &str,
    args: &[&str],
    token: Option<&str>,
) -> (ConsoleProcess, String) {
    use tokio::io::AsyncBufReadExt;
    let mut command = idem_command(
        database_url,
        &[&["console", "--listen", "127.0.0.1:0"][..], args].concat(),
    );
    match token {
        Some(token) => command.env("IDEM_CONSOLE_TOKEN", token),
        None => command.env_remove("IDEM_CONSOLE_TOKEN"),
    };
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn idem console");
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(SETTLE, lines.next_line())
        .await
        .expect("the console starts")
        .unwrap()
        .expect("the console prints its address");
    let base = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .map(|w| w.trim_end_matches('/').to_owned())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let console = ConsoleProcess {
        _child: child,
        base,
    };
    (console, line)
}

/// A client that follows no redirects, with or without the token.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

impl ConsoleProcess {
    async fn get(&self, path: &str, token: bool) -> (StatusCode, String) {
        let mut request = client().get(format!("{}{path}", self.base));
        if token {
            request = request.bearer_auth(TOKEN);
        }
        let response = request.send().await.unwrap();
        (response.status(), response.text().await.unwrap_or_default())
    }

    async fn post(&self, path: &str, form: &[(&str, &str)], token: bool) -> (StatusCode, String) {
        let mut request = client().post(format!("{}{path}", self.base)).form(form);
        if token {
            request = request.bearer_auth(TOKEN);
        }
        let response = request.send().await.unwrap();
        (response.status(), response.text().await.unwrap_or_default())
    }
}

/// The number in the row of table `id` whose first cell is `label`.
fn row_number(page: &str, label: &str) -> i64 {
    let row = &page[page
        .find(&format!("<td>{label}</td>"))
        .unwrap_or_else(|| panic!("{label} in {page}"))..];
    let cell = &row[row.find("<td class=\"n\">").unwrap() + 14..];
    cell[..cell.find('<').unwrap()].parse().unwrap()
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn without_the_token_nothing_answers_and_without_csrf_nothing_changes(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("console-auth").await;
    let url = database_url(&connect);
    let dead = outage(&pool, &q, &url, 6).await;
    // Another address than loopback needs the explicit flag.
    let refused = idem_command(
        &url,
        &["console", "--listen", "0.0.0.0:0", "--queue", &q.name],
    )
    .output()
    .await
    .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("--allow-remote"),
        "{said}"
    );
    let console = start_console(&url, &q.name).await;
    let key = "?scope=acme&operation=orders.create&key=evt-0";
    let group = format!("?queue={}&action=replay&reason=permanent_failure", q.name);
    for path in [
        "/".to_owned(),
        "/dlq".into(),
        format!("/dlq/confirm{group}"),
        "/ops".into(),
        format!("/ops/show{key}"),
        "/outbox".into(),
        "/flow".into(),
        "/ordering".into(),
        "/charts".into(),
    ] {
        let (status, _) = console.get(&path, false).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "GET {path}");
        let wrong = client()
            .get(format!("{}{path}", console.base))
            .bearer_auth("not-the-console-token")
            .header("cookie", "idem_console=not-the-console-token")
            .send()
            .await
            .unwrap();
        assert_eq!(
            wrong.status(),
            StatusCode::UNAUTHORIZED,
            "GET {path} with a wrong token"
        );
        let (status, _) = console.get(&path, true).await;
        assert!(
            status.is_success() || status.is_redirection(),
            "GET {path} with the token: {status}"
        );
    }
    let replay = [
        ("queue", q.name.as_str()),
        ("action", "replay"),
        ("reason", "permanent_failure"),
    ];
    let release = [
        ("scope", "acme"),
        ("operation", "orders.create"),
        ("key", "evt-0"),
    ];
    let close = [("queue", q.name.as_str()), ("note", "back")];
    for (path, form) in [
        ("/dlq/act", &replay[..]),
        ("/ops/release", &release[..]),
        ("/ops/resolve", &release[..]),
        ("/flow/close", &close[..]),
    ] {
        let (status, _) = console.post(path, form, false).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "POST {path}");
        let (status, _) = console.post(path, form, true).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "POST {path} without CSRF");
        let mut wrong = form.to_vec();
        wrong.push(("csrf", "0000"));
        let (status, _) = console.post(path, &wrong, true).await;
        assert_eq!(
            status,
            StatusCode::FORBIDDEN,
            "POST {path} with a wrong CSRF"
        );
    }
    assert_eq!(q.counts(&q.dlq()).await.0, dead, "nothing replayed");

    // An uncertain operation's page offers "not applied"; the form, with its CSRF
    // token, resolves it, keeping the operator's note.
    let store = idem::Store::new(pool.clone(), idem::StoreConfig::default());
    let unsure = idem::Key::new("acme", "orders.create", "evt-unsure").unwrap();
    let pending = RecordFixture {
        key: "evt-unsure",
        status: "pending",
        external_ref: Some("charge-3"),
        error: Some(serde_json::json!("timeout")),
        ..RecordFixture::default()
    };
    let (_, lease_token) = insert_record(&pool, &pending).await;
    let (status, shown) = console
        .get(
            "/ops/show?scope=acme&operation=orders.create&key=evt-unsure",
            true,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(shown.contains("charge-3") && shown.contains("action=\"/ops/resolve\""));
    let needle = "name=\"csrf\" value=\"";
    let csrf_at = shown.find(needle).unwrap() + needle.len();
    let csrf = &shown[csrf_at..csrf_at + shown[csrf_at..].find('"').unwrap()];
    let token = lease_token.to_string();
    assert!(shown.contains(&format!("name=\"token\" value=\"{token}\"")));
    fn form<'a>(csrf: &'a str, token: &'a str) -> [(&'static str, &'a str); 6] {
        [
            ("scope", "acme"),
            ("operation", "orders.create"),
            ("key", "evt-unsure"),
            ("note", "TICKET-9"),
            ("csrf", csrf),
            ("token", token),
        ]
    }
    let stale = (lease_token - 1).to_string();
    let (status, refused) = console
        .post("/ops/resolve", &form(csrf, &stale), true)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(refused.contains("Nothing resolved"), "{refused}");
    let (status, done) = console
        .post("/ops/resolve", &form(csrf, &token), true)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(done.contains("Resolved as not applied"), "{done}");
    let record = store.get(&unsure).await.unwrap().unwrap();
    assert_eq!(
        (record.status, record.retryable),
        (idem::Status::Failed, true)
    );
    assert_eq!(record.error.unwrap()["note"], "TICKET-9");

    // The login link sets the token as a strict, HTTP-only cookie, which then works.
    let response = client()
        .get(format!("{}/login?token={TOKEN}", console.base))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let cookie = response.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let pair = cookie.split(';').next().unwrap().to_owned();
    let page = client()
        .get(format!("{}/outbox", console.base))
        .header("cookie", pair)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::OK);
}

/// The console keeps its token to itself: never printed (a generated one goes to a
/// file only its user reads), never a cookie (a session's opaque id is); it answers
/// only to its own host, takes browser POSTs only from its own origin, and acts only on
/// records of its queues' operations (and `--operation`'s).
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn the_console_keeps_its_token_and_its_actions_to_itself(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = database_url(&connect);
    let q = TestQueue::new("console-own").await;
    let args = ["--queue", &q.name, "--operation", "emails.send"];
    let (console, line) = start_console_with(&url, &args, None).await;
    let file = line
        .split_whitespace()
        .find(|w| w.ends_with(".token,"))
        .map(|w| w.trim_end_matches(','))
        .unwrap_or_else(|| panic!("no token file in {line:?}"));
    let token = std::fs::read_to_string(file).unwrap().trim().to_owned();
    assert!(token.len() >= 32 && !line.contains(&token), "{line}");
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the token file is its user's only");

    // The form's login starts a session whose cookie is not the token.
    let origin = console.base.clone();
    let login = client()
        .post(format!("{}/login", console.base))
        .header("origin", &origin)
        .form(&[("token", token.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), StatusCode::SEE_OTHER);
    let cookie = login.headers()["set-cookie"].to_str().unwrap().to_owned();
    let pair = cookie.split(';').next().unwrap().to_owned();
    assert!(!pair.contains(&token), "{cookie}");
    let as_cookie = |value: &str| {
        client()
            .get(format!("{}/ops", console.base))
            .header("cookie", value.to_owned())
    };
    assert_eq!(
        as_cookie(&pair).send().await.unwrap().status(),
        StatusCode::OK
    );
    let token_cookie = format!("idem_console={token}");
    let status = as_cookie(&token_cookie).send().await.unwrap().status();
    assert_eq!(status, StatusCode::UNAUTHORIZED, "the token is no cookie");

    // Another host name for the same address (DNS rebinding) gets nothing.
    let port = console.base.rsplit(':').next().unwrap();
    let rebound = client()
        .get(format!("{}/ops", console.base))
        .header("host", format!("attacker.example:{port}"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status(), StatusCode::MISDIRECTED_REQUEST);

    // A stuck record of an operation of its own (--operation) and one of another's.
    let store = idem::Store::new(pool.clone(), idem::StoreConfig::default());
    for operation in ["emails.send", "payments.charge"] {
        let claimed = RecordFixture {
            operation,
            key: "evt-1",
            lease_secs: Some(30),
            ..RecordFixture::default()
        };
        insert_record(&pool, &claimed).await;
    }
    let (status, _) = console
        .get(
            "/ops/show?scope=acme&operation=emails.send&key=evt-1",
            false,
        )
        .await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "without a session nothing shows"
    );
    let shown = client()
        .get(format!(
            "{}/ops/show?scope=acme&operation=emails.send&key=evt-1",
            console.base
        ))
        .header("cookie", pair.clone())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let needle = "name=\"csrf\" value=\"";
    let csrf_at = shown.find(needle).unwrap() + needle.len();
    let csrf = shown[csrf_at..csrf_at + shown[csrf_at..].find('"').unwrap()].to_owned();
    let release = |operation: &'static str, origin: Option<String>| {
        let mut request = client()
            .post(format!("{}/ops/release", console.base))
            .header("cookie", pair.clone())
            .form(&[
                ("scope", "acme"),
                ("operation", operation),
                ("key", "evt-1"),
                ("csrf", csrf.as_str()),
            ]);
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        request.send()
    };
    let lease = |operation: &'static str| {
        let store = store.clone();
        async move {
            let key = idem::Key::new("acme", operation, "evt-1").unwrap();
            store.get(&key).await.unwrap().unwrap().lease_expires_at
        }
    };
    let before = lease("emails.send").await;
    for origin in [None, Some("http://attacker.example".to_owned())] {
        let status = release("emails.send", origin.clone())
            .await
            .unwrap()
            .status();
        assert_eq!(status, StatusCode::FORBIDDEN, "origin {origin:?}");
    }
    assert_eq!(lease("emails.send").await, before, "nothing released");
    let other = release("payments.charge", Some(origin.clone()))
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::FORBIDDEN);
    assert!(
        other
            .text()
            .await
            .unwrap()
            .contains("not an operation of this console")
    );
    let ours = release("emails.send", Some(origin.clone())).await.unwrap();
    assert_eq!(ours.status(), StatusCode::OK);
    assert!(ours.text().await.unwrap().contains("Released"));
    assert_ne!(lease("emails.send").await, before);
}

/// A headless Chromium driven through WebDriver (Debian's `chromium` and
/// `chromium-driver`), logged in to `console`; each page it shows can be saved as a
/// screenshot under `target/tmp/console-screenshots/`. Without a `chromedriver` the
/// test is skipped, unless `IDEM_TEST_BROWSER=required` (as `scripts/test` sets it where it has them).
struct Browser {
    client: fantoccini::Client,
    _driver: Child,
    _profile: PathBuf,
    test: &'static str,
}

impl Browser {
    async fn open(console: &ConsoleProcess, test: &'static str) -> Option<Browser> {
        let driver =
            std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "/usr/bin/chromedriver".into());
        if !Path::new(&driver).exists() {
            assert!(
                std::env::var("IDEM_TEST_BROWSER").as_deref() != Ok("required"),
                "{driver} is missing: install chromium and chromium-driver"
            );
            eprintln!("{test}: skipped, {driver} is missing (install chromium-driver)");
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = tokio::process::Command::new(&driver)
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn chromedriver");
        let profile = std::env::temp_dir().join(format!("idem-chromium-{}", uuid::Uuid::new_v4()));
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into()),
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-quic", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--window-size=1400,1000",
                    format!("--user-data-dir={}", profile.display()),
                ]
            }),
        );
        let webdriver = format!("http://127.0.0.1:{port}");
        // chromedriver takes a moment to listen: try until a session starts.
        let deadline = std::time::Instant::now() + SETTLE;
        let client = loop {
            let mut builder = fantoccini::ClientBuilder::new(
                hyper_util::client::legacy::connect::HttpConnector::new(),
            );
            builder.capabilities(capabilities.clone());
            match builder.connect(&webdriver).await {
                Ok(client) => break client,
                Err(error) if std::time::Instant::now() > deadline => {
                    panic!("no WebDriver session: {error}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        let browser = Browser {
            client,
            _driver: child,
            _profile: profile,
            test,
        };
        browser
            .go(&format!("{}/login?token={TOKEN}", console.base))
            .await;
        Some(browser)
    }

    async fn go(&self, url: &str) {
        self.client.goto(url).await.unwrap();
    }

    async fn source(&self) -> String {
        self.client.source().await.unwrap()
    }

    /// Clicks the element `css` finds, and waits until the browser shows the page the
    /// click leads to (a form's submit navigates after the click returns).
    async fn click(&self, css: &str) {
        let before = self.client.current_url().await.unwrap();
        let element = match self.client.find(Locator::Css(css)).await {
            Ok(element) => element,
            Err(error) => panic!("{css}: {error}\n{}", self.source().await),
        };
        element.click().await.unwrap();
        let deadline = std::time::Instant::now() + SETTLE;
        loop {
            let now = self.client.current_url().await.unwrap();
            if now != before && self.source().await.contains("</main>") {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{css} led nowhere from {before}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Saves what the browser shows as `<test>-<name>.png`.
    async fn screenshot(&self, name: &str) {
        let png = self.client.screenshot().await.unwrap();
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("{}-{name}.png", self.test)), png).unwrap();
    }

    async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self._profile);
    }
}

/// The number in the charts page's `<span id="{id}">`.
fn chart_count(page: &str, id: &str) -> i64 {
    let open = format!("<span id=\"{id}\">");
    let at = page.find(&open).unwrap_or_else(|| panic!("{id}: {page}")) + open.len();
    page[at..at + page[at..].find('<').unwrap()]
        .parse()
        .unwrap()
}

/// The deliveries of `queue` per line of the charts page, as the workers tallied them.
async fn tallied(pool: &PgPool, queue: &str) -> HashMap<Line, i64> {
    let mut lines: HashMap<Line, i64> = Line::ALL.iter().map(|l| (*l, 0)).collect();
    let now = chrono::Utc::now();
    let window = chrono::Duration::minutes(180);
    for row in idem::tally::per_minute(pool, &[queue.to_owned()], now - window, now + window)
        .await
        .unwrap()
    {
        if let Some(line) = Line::of(&row.outcome) {
            *lines.entry(line).or_default() += row.deliveries;
        }
    }
    lines
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn replaying_a_group_from_the_page_books_each_order_once(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("console-replay").await;
    let url = database_url(&connect);
    const N: usize = 10;
    let dead = outage(&pool, &q, &url, N).await;
    let acme = N.div_ceil(2);
    // The failing worker counted its deliveries as it stopped (resent copies may have
    // been duplicates or dead letters: the outage decides).
    let outage_duplicates = tallied(&pool, &q.name).await[&Line::Duplicates];
    // A conflict, the same event with another amount, and a duplicate of a completed
    // order: the worker's next flush counts both, with any resent copy of the outage
    // that was still in a retry queue (the worker's log says how many duplicates it
    // decided).
    let healthy = spawn_orders_worker(&url, &q.name, &["--concurrency", "1"]);
    wait_for_consumers(&q, 1).await;
    q.publish(&order("evt-1", "globex", 999_999)).await;
    q.publish(&order("evt-1", "globex", 101)).await;
    wait_until(SETTLE, "the conflict dead-lettered", || async {
        q.counts(&q.dlq()).await.0 == dead + 1
    })
    .await;
    let decided_duplicates =
        || outage_duplicates + healthy.log_count("outcome=\"duplicate_") as i64;
    let duplicates = AtomicI64::new(0);
    wait_until(SETTLE, "the duplicate and the conflict tallied", || async {
        let lines = tallied(&pool, &q.name).await;
        duplicates.store(lines[&Line::Duplicates], Ordering::Relaxed);
        decided_duplicates() > outage_duplicates
            && lines[&Line::Duplicates] == decided_duplicates()
            && lines[&Line::DeadLettered] == i64::from(dead) + 1
    })
    .await;
    let duplicates = duplicates.load(Ordering::Relaxed);
    let console = start_console(&url, &q.name).await;
    let Some(browser) = Browser::open(&console, "replay").await else {
        return;
    };
    // The outage's dead letters: one per acme order, or two when a resent copy was
    // dead-lettered before the first was recorded (a DLQ may hold a key twice).
    let outage_letters = i64::from(dead);
    assert!(outage_letters >= acme as i64);

    // The page shows the outage's group and the conflict, with the replay preview.
    let page = browser.source().await;
    browser.screenshot("dead-letters").await;
    assert!(page.contains("fingerprint_conflict"), "{page}");
    // What each letter carried, folded under it: the conflict's body with its other
    // amount, escaped (a browser serialises the quotes of a text node as they are).
    assert!(
        page.contains("<details><summary>no type")
            && (page.contains("amount_cents\":999999")
                || page.contains("amount_cents&quot;:999999")),
        "{page}"
    );
    assert_eq!(
        row_number(&page, "permanent_failure"),
        outage_letters,
        "the group's count"
    );

    // The charts show the outage as the workers counted it: globex's orders executed,
    // the duplicate, every dead letter (the outage's and the conflict).
    browser.go(&format!("{}/charts", console.base)).await;
    let charts = browser.source().await;
    browser.screenshot("charts-outage").await;
    assert_eq!(
        chart_count(&charts, "executed"),
        (N - acme) as i64,
        "{charts}"
    );
    assert_eq!(chart_count(&charts, "duplicates"), duplicates);
    assert_eq!(chart_count(&charts, "dead-lettered"), i64::from(dead) + 1);
    assert!(charts.contains("<svg id=\"deliveries\""), "{charts}");
    browser.go(&format!("{}/dlq", console.base)).await;
    browser
        .click("a[href*='action=replay'][href*='reason=permanent_failure']")
        .await;
    let confirm = browser.source().await;
    browser.screenshot("replay-confirm").await;
    assert_eq!(
        row_number(&confirm, "republished: will run again"),
        outage_letters,
        "{confirm}"
    );
    assert_eq!(row_number(&confirm, "conflicts: stay"), 0);

    // Replay it from the page: each acme order is booked exactly once.
    browser.click("form[action='/dlq/act'] button").await;
    let done = browser.source().await;
    browser.screenshot("replay-done").await;
    assert!(done.contains("Replayed"), "{done}");
    let replayed = row_number(&done, "republished: will run again")
        + row_number(&done, "already completed: acked, not run");
    assert_eq!(replayed, outage_letters);
    wait_until(SETTLE, "every order booked", || async {
        ledger(&pool).await.len() == N
    })
    .await;
    assert!(
        ledger(&pool).await.values().all(|n| *n == 1),
        "one ledger row per order"
    );

    // Discarding the conflict from the page removes it, and only it.
    browser.go(&format!("{}/dlq", console.base)).await;
    browser
        .click("a[href*='action=discard'][href*='key=evt-1']")
        .await;
    let confirm = browser.source().await;
    assert_eq!(row_number(&confirm, "discarded"), 1, "{confirm}");
    browser.click("form[action='/dlq/act'] button").await;
    let done = browser.source().await;
    assert_eq!(row_number(&done, "discarded"), 1, "{done}");
    browser.go(&format!("{}/dlq", console.base)).await;
    let page = browser.source().await;
    assert!(!page.contains("fingerprint_conflict"), "{page}");
    assert_eq!(q.counts(&q.dlq()).await.0, 0, "the DLQ is empty");
    browser.go(&format!("{}/outbox", console.base)).await;
    browser.screenshot("outbox").await;

    // Once the worker's next flush has counted the replayed orders, every order was
    // executed once and nothing more was dead-lettered. From the records: globex's
    // orders completed on their first run, acme's after the replay (their second
    // claim), and none is dead-lettered any more.
    wait_until(SETTLE, "the replay tallied", || async {
        tallied(&pool, &q.name).await[&Line::Executed] == N as i64
    })
    .await;
    browser.go(&format!("{}/charts", console.base)).await;
    let charts = browser.source().await;
    browser.screenshot("charts").await;
    assert_eq!(chart_count(&charts, "executed"), N as i64, "{charts}");
    assert_eq!(chart_count(&charts, "dead-lettered"), i64::from(dead) + 1);
    assert_eq!(chart_count(&charts, "completed-first"), (N - acme) as i64);
    assert_eq!(chart_count(&charts, "completed-retried"), acme as i64);
    assert_eq!(chart_count(&charts, "dead-in-dlq"), 0, "{charts}");
    assert!(charts.contains("<svg id=\"operations\""), "{charts}");
    assert!(
        charts.contains("<svg id=\"depths\""),
        "a depth sample at least\n{charts}"
    );
    browser.close().await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_stuck_operation_after_a_sigkill_is_released_from_the_page(pool: PgPool) {
    let q = TestQueue::new("console-stuck").await;
    let url = database_url(&pool.connect_options());
    let worker = spawn_orders_worker(
        &url,
        &q.name,
        &["--lease-secs", "600", "--provider-delay-ms", "60000"],
    );
    wait_for_worker_tables(&pool).await;
    wait_for_consumers(&q, 1).await;
    q.publish(&order("evt-stuck", "acme", 100)).await;
    wait_until(SETTLE, "the order in flight", || async {
        statuses(&pool).await.get("processing") == Some(&1)
    })
    .await;
    signal(&worker, "KILL");
    let console = start_console(&url, &q.name).await;
    let Some(browser) = Browser::open(&console, "stuck").await else {
        return;
    };

    // A release without the form's CSRF token is refused and changes nothing.
    let lease = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
            "SELECT lease_expires_at FROM processed_operations WHERE idempotency_key = 'evt-stuck'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let before = lease().await;
    let form = [
        ("scope", "acme"),
        ("operation", "orders.create"),
        ("key", "evt-stuck"),
    ];
    let (status, _) = console.post("/ops/release", &form, true).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(lease().await, before, "the lease is untouched");

    // Processing with a live lease: listed as processing, not yet as stuck.
    browser
        .go(&format!("{}/ops?status=stuck", console.base))
        .await;
    let stuck = browser.source().await;
    assert!(stuck.contains("<p>0 operation(s)</p>"), "{stuck}");
    browser
        .go(&format!("{}/ops?status=processing", console.base))
        .await;
    browser.screenshot("operations").await;
    browser.click("a[href*='key=evt-stuck']").await;
    let shown = browser.source().await;
    browser.screenshot("operation").await;
    assert!(
        shown.contains("orders_worker-"),
        "the owner is shown\n{shown}"
    );
    browser.click("form[action='/ops/release'] button").await;
    let released = browser.source().await;
    assert!(released.contains("Released"), "{released}");
    let lapsed: bool = sqlx::query_scalar(
        "SELECT lease_expires_at <= now() FROM processed_operations WHERE idempotency_key = 'evt-stuck'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(lapsed, "the lease ended");
    browser
        .go(&format!("{}/ops?status=stuck", console.base))
        .await;
    assert!(browser.source().await.contains("evt-stuck"));
    browser.close().await;
}

/// What `pg_stat_activity` shows of each role's connections in this test's database,
/// by `application_name`.
async fn connection_names(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT DISTINCT application_name FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// An operator looking at `pg_stat_activity` tells the roles apart: a worker's pool goes
/// by its executable's name, its outbox relay's LISTEN connection by that name and
/// `relay`, the console by `idem console`; a name in the URL wins.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn every_role_names_its_connections(pool_options: PgPoolOptions, connect: PgConnectOptions) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("console-names").await;
    let url = database_url(&connect);
    let worker = spawn_orders_worker(&url, &q.name, &[]);
    let _console = start_console(&url, &q.name).await;
    let wanted = ["idem console", "orders_worker", "orders_worker relay"];
    let deadline = std::time::Instant::now() + SETTLE;
    loop {
        let seen = connection_names(&pool).await;
        if wanted.iter().all(|name| seen.iter().any(|s| s == name)) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "wanted {wanted:?}, pg_stat_activity shows {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(worker);

    // A name given in the URL is kept (and the relay's is derived from it).
    let named = format!("{url}?application_name=billing");
    let worker = spawn_orders_worker(&named, &q.name, &[]);
    wait_until(SETTLE, "the URL's name used", || {
        let pool = pool.clone();
        async move {
            let names = connection_names(&pool).await;
            names.iter().any(|n| n == "billing") && names.iter().any(|n| n == "billing relay")
        }
    })
    .await;
    drop(worker);
}

/// The flow page shows each circuit and each limit's use; its form closes a circuit
/// of the console's own queues (with the CSRF token and a note), and no other.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn the_flow_page_shows_circuits_and_limits_and_closes_a_circuit(pool: PgPool) {
    let url = database_url(&pool.connect_options());
    let q = TestQueue::new("console-flow").await;
    sqlx::query(
        "INSERT INTO flow_circuits (name, state, generation, opens, retry_at, reason)
         VALUES ($1, 'open', 3, 2, now() + interval '10 minutes', 'the mail provider is down'),
                ('someone.elses', 'open', 1, 1, now() + interval '10 minutes', 'down')",
    )
    .bind(&q.name)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO flow_permits (name, slot, holder, held_until)
         VALUES ('mail', 0, 'host-a:1', now() + interval '1 minute'),
                ('mail', 1, 'host-b:2', now() + interval '1 minute'),
                ('mail', 2, 'host-c:3', now() - interval '1 minute')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let console = start_console(&url, &q.name).await;
    let (status, shown) = console.get("/flow", true).await;
    assert_eq!(status, StatusCode::OK);
    for needle in [
        q.name.as_str(),
        "the mail provider is down",
        "someone.elses",
        "mail",
        "2 of 3",
        "host-a:1, host-b:2",
        "action=\"/flow/close\"",
    ] {
        assert!(shown.contains(needle), "{needle} in {shown}");
    }
    assert_eq!(
        shown.matches("action=\"/flow/close\"").count(),
        1,
        "only its own queue"
    );
    let needle = "name=\"csrf\" value=\"";
    let csrf_at = shown.find(needle).unwrap() + needle.len();
    let csrf = &shown[csrf_at..csrf_at + shown[csrf_at..].find('"').unwrap()];
    fn form<'a>(queue: &'a str, csrf: &'a str) -> [(&'static str, &'a str); 3] {
        [
            ("queue", queue),
            ("note", "provider back (INC-9)"),
            ("csrf", csrf),
        ]
    }
    let (status, _) = console
        .post("/flow/close", &form("someone.elses", csrf), true)
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "another's queue");
    let (status, said) = console
        .post("/flow/close", &form(&q.name, csrf), true)
        .await;
    assert_eq!(status, StatusCode::OK, "{said}");
    assert!(said.contains("Closed (it was open)"), "{said}");
    let rows: Vec<(String, String, Option<String>)> =
        sqlx::query_as("SELECT name, state, reason FROM flow_circuits ORDER BY name")
            .fetch_all(&pool)
            .await
            .unwrap();
    let ours = rows.iter().find(|r| r.0 == q.name).unwrap();
    assert_eq!(
        (ours.1.as_str(), ours.2.as_deref()),
        ("closed", Some("provider back (INC-9)"))
    );
    let theirs = rows.iter().find(|r| r.0 == "someone.elses").unwrap();
    assert_eq!(theirs.1, "open", "untouched");
}

/// The `<tr>` of `page` that contains `needle`.
fn row_of<'a>(page: &'a str, needle: &str) -> &'a str {
    let at = page
        .find(needle)
        .unwrap_or_else(|| panic!("{needle} in {page}"));
    let start = page[..at].rfind("<tr>").unwrap();
    &page[start..at + page[at..].find("</tr>").unwrap()]
}

/// The ordering page lists the entities whose deliveries wait behind a turn that does
/// not come, the longest unmoved first: a gap (the number whose turn it is never came),
/// with the command that skips it, the key quoted for the shell and escaped for the
/// page; a dead-lettered holder, linked to its record. An entity that moved a moment
/// ago shows only when every entity with deliveries waiting is asked for.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn the_ordering_page_shows_the_entities_stalled_behind_their_turn(pool: PgPool) {
    let url = database_url(&pool.connect_options());
    let q = TestQueue::new("console-ordering").await;
    let dead = RecordFixture {
        key: "evt-dead",
        status: "failed",
        retryable: true,
        error: Some(serde_json::json!("the ledger refused it")),
        ..RecordFixture::default()
    };
    insert_record(&pool, &dead).await;
    sqlx::query(
        "UPDATE processed_operations SET dead_lettered_at = now(), dead_letters = 1
          WHERE idempotency_key = 'evt-dead'",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO ordering_positions (scope, ordering_key, next_seq, last_seq,
                 holder_operation, holder_key, held_since, moved_at, skipped, skip_note)
         VALUES ('acme', 'account-<7>''s', 3, 5, NULL, NULL, NULL,
                 now() - interval '10 minutes', 1, 'seq 2 lost (INC-4)'),
                ('acme', 'order-42', 2, 3, 'orders.create', 'evt-dead',
                 now() - interval '20 minutes', now() - interval '20 minutes', 0, NULL),
                ('acme', 'order-fresh', 1, 2, NULL, NULL, NULL, now(), 0, NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    for (key, seq) in [
        ("account-<7>'s", 4_i64),
        ("account-<7>'s", 5),
        ("order-42", 3),
        ("order-fresh", 2),
    ] {
        sqlx::query(
            "INSERT INTO ordering_waiting (scope, ordering_key, seq, operation,
                     idempotency_key, payload_sha256, queue, body, properties)
             VALUES ('acme', $1, $2, 'orders.create', $3, $4, $5, $6, $7)",
        )
        .bind(key)
        .bind(seq)
        .bind(format!("evt-{key}-{seq}"))
        .bind("a".repeat(64))
        .bind(&q.name)
        .bind(b"{\"order\":1}".to_vec())
        .bind(b"{}".to_vec())
        .execute(&pool)
        .await
        .unwrap();
    }
    let console = start_console(&url, &q.name).await;

    // By default, those not moved for the workers' stall time (60 s).
    let (status, shown) = console.get("/ordering", true).await;
    assert_eq!(status, StatusCode::OK, "{shown}");
    assert!(
        shown.contains("href=\"/ordering\">Ordering</a>"),
        "in the navigation"
    );
    assert_eq!(row_number(&shown, "entities with deliveries waiting"), 3);
    assert_eq!(row_number(&shown, "deliveries waiting"), 4);
    assert!(
        shown.contains("2 entities with deliveries waiting, not moved for 60s or longer"),
        "{shown}"
    );
    assert!(
        !shown.contains("order-fresh"),
        "moved a moment ago: {shown}"
    );
    assert!(!shown.contains("account-<7>"), "escaped: {shown}");
    let key = "<code>account-&lt;7&gt;&#39;s</code>";
    let blocked = "<code>order-42</code>";
    assert!(
        shown.find(blocked).unwrap() < shown.find(key).unwrap(),
        "the longest unmoved first"
    );
    let gap = row_of(&shown, key);
    for needle in [
        "<td>acme</td>",
        "<td class=\"n\">3</td>",
        "<span class=\"bad\">gap</span>",
        "<td>-</td>",
        "<td class=\"n\">2</td><td class=\"n\">4</td>",
        "1 (last: seq 2 lost (INC-4))",
        "<code>idem ops ordering skip --scope acme --key \
         &#39;account-&lt;7&gt;&#39;\\&#39;&#39;s&#39; --seq 3 --note &quot;...&quot;</code>",
    ] {
        assert!(gap.contains(needle), "{needle} in {gap}");
    }
    let holder = row_of(&shown, blocked);
    for needle in [
        "<td class=\"n\">2</td>",
        "<span class=\"bad\">dead-lettered</span>",
        "href=\"/ops/show?scope=acme&amp;operation=orders.create&amp;key=evt-dead\"",
        "<code>orders.create</code> / <code>evt-dead</code></a> (failed)",
        "<td class=\"n\">1</td><td class=\"n\">3</td>",
        "(20m ",
        "idem ops ordering skip --scope acme --key order-42 --seq ",
    ] {
        assert!(holder.contains(needle), "{needle} in {holder}");
    }

    // Every entity with deliveries waiting; only the longest stalled; a bad duration.
    let (status, all) = console.get("/ordering?stalled_for=0s", true).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        all.contains("3 entities with deliveries waiting, all"),
        "{all}"
    );
    let fresh = row_of(&all, "<code>order-fresh</code>");
    assert!(fresh.contains("gap") && fresh.contains("s ago)"), "{fresh}");
    let (status, longest) = console.get("/ordering?stalled_for=15m", true).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        longest.contains("1 entity with deliveries waiting, not moved for 15m or longer")
            && longest.contains(blocked)
            && !longest.contains(key),
        "{longest}"
    );
    let (status, _) = console.get("/ordering?stalled_for=soon", true).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}
