//! `idem console` (feature `console`) as a process, against the real broker and
//! database: without the token every page and action answers 401; an action without
//! the form's CSRF token answers 403 and changes nothing; the dead-letter page shows an
//! outage's group with the replay preview; replaying the group from the console books
//! each order once; discarding a conflict removes it; a stuck operation left by a
//! SIGKILLed worker is listed and released.

mod common;

use std::time::Duration;

use common::*;
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

async fn start_console(database_url: &str, queue: &str) -> ConsoleProcess {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let child = idem_command(
        database_url,
        &["console", "--listen", &listen, "--queue", queue],
    )
    .env("IDEM_CONSOLE_TOKEN", TOKEN)
    .stdout(std::process::Stdio::null())
    .spawn()
    .expect("spawn idem console");
    let base = format!("http://{listen}");
    wait_until(SETTLE, "the console to listen", || async {
        reqwest::get(format!("{base}/login?token=wrong"))
            .await
            .is_ok()
    })
    .await;
    ConsoleProcess {
        _child: child,
        base,
    }
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

/// The hidden fields of the first POST form on `page`, as the browser would send them.
fn form_fields(page: &str) -> Vec<(String, String)> {
    let form = &page[page
        .find("<form class=\"inline\" method=\"post\"")
        .expect("a form")..];
    let form = &form[..form.find("</form>").unwrap()];
    let attr = |tag: &str, name: &str| -> String {
        let at = tag.find(&format!("{name}=\"")).unwrap() + name.len() + 2;
        let value = &tag[at..];
        value[..value.find('"').unwrap()]
            .replace("&quot;", "\"")
            .replace("&#39;", "'")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&")
    };
    form.split("<input ")
        .skip(1)
        .map(|tag| (attr(tag, "name"), attr(tag, "value")))
        .collect()
}

/// The action of the first POST form on `page`.
fn form_action(page: &str) -> String {
    let form = &page[page.find("method=\"post\" action=\"").unwrap() + 22..];
    form[..form.find('"').unwrap()].to_owned()
}

/// Submits the first POST form on `page` with the token.
async fn submit(console: &ConsoleProcess, page: &str) -> (StatusCode, String) {
    let fields = form_fields(page);
    let pairs: Vec<(&str, &str)> = fields
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    console.post(&form_action(page), &pairs, true).await
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
    ] {
        let (status, _) = console.get(&path, false).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "GET {path}");
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
    for (path, form) in [("/dlq/act", &replay[..]), ("/ops/release", &release[..])] {
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
    assert_eq!(ledger(&pool).await.len(), 3, "nothing booked");

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

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn replaying_a_group_from_the_console_books_each_order_once(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let q = TestQueue::new("console-replay").await;
    let url = database_url(&connect);
    const N: usize = 10;
    outage(&pool, &q, &url, N).await;
    let acme = N.div_ceil(2);
    // A conflict: the same event with another amount.
    let _healthy = spawn_orders_worker(&url, &q.name, &["--concurrency", "1"]);
    wait_for_consumers(&q, 1).await;
    q.publish(&order("evt-1", "globex", 999_999)).await;
    wait_until(SETTLE, "the conflict dead-lettered", || async {
        q.counts(&q.dlq()).await.0 as usize > acme
    })
    .await;
    let console = start_console(&url, &q.name).await;
    // The outage's dead letters: one per acme order, or two when a resent copy was
    // dead-lettered before the first was recorded (a DLQ may hold a key twice).
    let outage_letters = q.counts(&q.dlq()).await.0 as i64 - 1;
    assert!(outage_letters >= acme as i64);

    // The page shows the outage's group: every acme order would run again.
    let (status, page) = console.get("/dlq", true).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("permanent_failure"), "{page}");
    assert!(page.contains("fingerprint_conflict"), "{page}");
    assert_eq!(
        row_number(&page, "permanent_failure"),
        outage_letters,
        "the group's count"
    );
    let (_, confirm) = console
        .get(
            &format!(
                "/dlq/confirm?queue={}&action=replay&reason=permanent_failure&operation=orders.create&error={}",
                q.name, "tenant%20acme%20is%20failing%20(--fail-tenant)"
            ),
            true,
        )
        .await;
    assert_eq!(
        row_number(&confirm, "republished: will run again"),
        outage_letters,
        "{confirm}"
    );
    assert_eq!(row_number(&confirm, "conflicts: stay"), 0);

    // Replay it from the page: each acme order is booked exactly once.
    let (status, done) = submit(&console, &confirm).await;
    assert_eq!(status, StatusCode::OK, "{done}");
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

    // Discarding the conflict from the console removes it, and only it.
    let (_, confirm) = console
        .get(
            &format!("/dlq/confirm?queue={}&action=discard&key=evt-1", q.name),
            true,
        )
        .await;
    assert_eq!(row_number(&confirm, "discarded"), 1, "{confirm}");
    let (status, done) = submit(&console, &confirm).await;
    assert_eq!(status, StatusCode::OK, "{done}");
    assert_eq!(row_number(&done, "discarded"), 1);
    let (_, page) = console.get("/dlq", true).await;
    assert!(!page.contains("fingerprint_conflict"), "{page}");
    assert_eq!(q.counts(&q.dlq()).await.0, 0, "the DLQ is empty");
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_stuck_operation_after_a_sigkill_is_listed_and_released(pool: PgPool) {
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

    // Processing with a live lease: listed as processing, not yet as stuck.
    let (_, page) = console.get("/ops?status=processing", true).await;
    assert!(page.contains("evt-stuck"), "{page}");
    let (_, page) = console.get("/ops?status=stuck", true).await;
    assert!(!page.contains("evt-stuck"), "{page}");
    let (_, shown) = console
        .get(
            "/ops/show?scope=acme&operation=orders.create&key=evt-stuck",
            true,
        )
        .await;
    assert!(shown.contains("Release the lease"), "{shown}");
    let (status, released) = submit(&console, &shown).await;
    assert_eq!(status, StatusCode::OK, "{released}");
    assert!(released.contains("Released"), "{released}");
    let (_, page) = console.get("/ops?status=stuck", true).await;
    assert!(
        page.contains("evt-stuck"),
        "released: its lease has lapsed\n{page}"
    );
}
