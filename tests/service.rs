//! One service, many handlers (`idem::Service`): the example service's three queues
//! through SIGKILLs on one shared connection, its `/healthz` naming a queue that is down;
//! in process, a hung handler holding back only its own queue's shutdown, and a service
//! refused as assembled or by the broker, naming the queue.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use idem::{
    Context, Handler, HandlerError, QueueType, Service, ServiceConfig, Store, StoreConfig,
    WorkerConfig, WorkerError,
};
use lapin::options::QueueDeleteOptions;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

const SETTLE: Duration = Duration::from_secs(60);

/// A free port on loopback.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

async fn healthz(port: u16) -> Option<(u16, String)> {
    let response = reqwest::get(format!("http://127.0.0.1:{port}/healthz"))
        .await
        .ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

async fn counts(pool: &PgPool, table: &str) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT event_id, count(*) FROM {table} GROUP BY event_id"
    )))
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    rows.into_iter().collect()
}

/// How many of the broker's connections carry `name` in their client-provided name
/// (`rabbitmqctl`, as the operator would count them); `None` without rabbitmqctl.
fn broker_connections(name: &str) -> Option<usize> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["-q", "list_connections", "client_properties"])
        .output()
        .ok()
        .filter(|out| out.status.success())?;
    let text = String::from_utf8_lossy(&out.stdout);
    Some(
        text.lines()
            .filter(|l| {
                l.contains(&format!("\"{name}\"")) || l.contains(&format!("\"{name}-publish\""))
            })
            .count(),
    )
}

/// Order events as the shop's events queue counts them: (kind, event id) → rows.
async fn order_events(pool: &PgPool) -> BTreeMap<(String, String), i64> {
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT kind, event_id, count(*) FROM example_order_events GROUP BY kind, event_id",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    rows.into_iter().map(|(k, e, n)| ((k, e), n)).collect()
}

fn of_kind(events: &BTreeMap<(String, String), i64>, kind: &str) -> Vec<i64> {
    events
        .iter()
        .filter(|((k, _), _)| k == kind)
        .map(|(_, n)| *n)
        .collect()
}

/// The example service: three queues, four job types (orders leased with a follow-up
/// each; notifications; refunds and cancellations, two message types on one queue fed by
/// a topic exchange), SIGKILLed twice while orders and events, each published twice,
/// flow: every order is booked and notified once, every refund and cancellation written
/// once; the three queues share one connection (the relay has its own). An event of a
/// type no handler takes is dead-lettered `unroutable` with its type, and after a restart
/// with its handler, `idem dlq replay` runs it once. `/healthz` names each queue, and a
/// queue whose consumer is gone.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn three_queues_four_job_types_through_two_sigkills_with_one_effect_each(
    o: PgPoolOptions,
    c: PgConnectOptions,
) {
    const ORDERS: usize = 150;
    const EVENTS: usize = 40;
    let pool = o.connect_with(c.clone()).await.unwrap();
    let url = database_url(&c);
    let q = TestQueue::new("shop").await;
    let orders = q.beside("orders").await;
    let notifications = q.beside("notifications").await;
    let events = q.beside("order-events").await;
    let exchange = q.exchange("events");
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let args = ["--metrics-addr", metrics.as_str(), "--concurrency", "4"];
    let mut shop = spawn_shop(&url, &q.name, &args);
    for queue in [&orders, &notifications, &events] {
        wait_for_consumers(queue, 1).await;
    }
    let name = format!("shop-{}", shop.pid());
    match broker_connections(&name) {
        Some(connections) => {
            assert_eq!(
                connections, 2,
                "one for the three queues, one for the relay"
            )
        }
        None if std::env::var("IDEM_CI").is_ok_and(|v| v == "1") => {
            panic!("rabbitmqctl list_connections failed: CI must count the connections")
        }
        None => println!("skipped: counting connections needs rabbitmqctl"),
    }

    // Each order and event twice (a producer's retry; an order with another sent_at),
    // while the service is killed; one event of a type nobody handles yet.
    let publisher = {
        let (to_orders, exchange) = (orders.name.clone(), exchange.clone());
        let p = TestQueue::new("shop-publisher").await;
        tokio::spawn(async move {
            for _ in 0..2 {
                for n in 0..ORDERS {
                    let body = order(&format!("o-{n}"), "acme", 100 + n as i64);
                    p.publish_to(&to_orders, &body, persistent()).await;
                    if n < EVENTS {
                        let kind = if n % 2 == 0 {
                            "order.refunded"
                        } else {
                            "order.cancelled"
                        };
                        let event = json!({"event_id": format!("e-{n}"), "tenant": "acme",
                                           "order_id": format!("o-{n}"), "amount_cents": 10});
                        publish_event(&p, &exchange, kind, &event).await;
                    }
                }
            }
            let shipped = json!({"event_id": "s-1", "tenant": "acme", "order_id": "o-1"});
            publish_event(&p, &exchange, "order.shipped", &shipped).await;
        })
    };
    for killed_after in [ORDERS / 4, ORDERS / 2] {
        wait_until(SETTLE, "orders booked before the kill", || async {
            ledger(&pool).await.len() >= killed_after
        })
        .await;
        signal(&shop, "KILL");
        let _ = shop.child.wait().await;
        shop = spawn_shop(&url, &q.name, &args);
    }
    publisher.await.unwrap();
    wait_until(
        SETTLE,
        "every order notified, every event written",
        || async {
            common::notifications(&pool).await.len() == ORDERS
                && order_events(&pool).await.len() == EVENTS
        },
    )
    .await;
    for queue in [&orders, &notifications, &events] {
        wait_until(SETTLE, "the queues drained", || async {
            queue.counts(&queue.name).await.0 == 0
        })
        .await;
    }
    let booked = ledger(&pool).await;
    assert_eq!(booked.len(), ORDERS, "no order lost");
    assert!(
        booked.values().all(|n| *n == 1),
        "one booking per order: {booked:?}"
    );
    let notified = common::notifications(&pool).await;
    assert!(
        notified.values().all(|n| *n == 1),
        "one notification per order: {notified:?}"
    );
    let written = order_events(&pool).await;
    for kind in ["refunded", "cancelled"] {
        let rows = of_kind(&written, kind);
        assert_eq!(rows.len(), EVENTS / 2, "{kind}: {written:?}");
        assert!(
            rows.iter().all(|n| *n == 1),
            "{kind} once each: {written:?}"
        );
    }

    // The shipped event: dead-lettered as unroutable, naming its type; listed as such.
    wait_until(SETTLE, "the unroutable event dead-lettered", || async {
        events.counts(&events.dlq()).await.0 == 1
    })
    .await;
    let (code, shown) = run_idem(&url, &["dlq", "show", "--queue", &events.name, "--json"]).await;
    assert_eq!(code, 0, "{shown}");
    let letters: Vec<Value> = shown
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(letters.len(), 1, "only the unroutable one: {shown}");
    assert_eq!(letters[0]["reason"], "unroutable", "{shown}");
    assert_eq!(letters[0]["type"], "order.shipped", "{shown}");
    let error = letters[0]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("order.shipped") && error.contains("order.cancelled"),
        "{error}"
    );
    let (code, listed) = run_idem(&url, &["dlq", "list", "--queue", &events.name]).await;
    assert_eq!(code, 0);
    assert!(listed.contains("unroutable"), "{listed}");

    // /healthz names each queue; a queue whose consumer the broker ended is down until
    // its session comes back (it reconnects within its backoff, so delete it until the
    // probe sees it).
    assert_healthz_names_a_queue_down(port, &q, &[&orders, &notifications], &events).await;

    // Deployed with the shipments handler: the replay runs the shipped event once.
    signal(&shop, "TERM");
    let status = tokio::time::timeout(SETTLE, shop.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(
        status.success(),
        "SIGTERM drains every queue and exits 0: {status}"
    );
    let with_shipments = ["--metrics-addr", metrics.as_str(), "--shipments"];
    let _shop = spawn_shop(&url, &q.name, &with_shipments);
    wait_for_consumers(&events, 1).await;
    let (code, replayed) = run_idem(&url, &["dlq", "replay", "--queue", &events.name]).await;
    assert_eq!(code, 0, "{replayed}");
    wait_until(SETTLE, "the shipment written", || async {
        of_kind(&order_events(&pool).await, "shipped").len() == 1
    })
    .await;
    let (_, again) = run_idem(&url, &["dlq", "replay", "--queue", &events.name]).await;
    println!("{again}");
    wait_until(SETTLE, "the events queue drained", || async {
        events.counts(&events.name).await.0 == 0
    })
    .await;
    assert_eq!(of_kind(&order_events(&pool).await, "shipped"), vec![1]);
    assert_eq!(events.counts(&events.dlq()).await.0, 0);
}

fn persistent() -> lapin::BasicProperties {
    lapin::BasicProperties::default().with_delivery_mode(2)
}

/// Publishes `event` to the topic `exchange` with `kind` as routing key and AMQP type.
async fn publish_event(p: &TestQueue, exchange: &str, kind: &str, event: &Value) {
    let confirm = p
        .channel
        .basic_publish(
            exchange.into(),
            kind.into(),
            lapin::options::BasicPublishOptions::default(),
            event.to_string().as_bytes(),
            persistent().with_type(kind.into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
}

async fn assert_healthz_names_a_queue_down(
    port: u16,
    q: &TestQueue,
    up: &[&TestQueue],
    downed: &TestQueue,
) {
    wait_until(SETTLE, "the service healthy", || async {
        healthz(port).await.is_some_and(|(status, _)| status == 200)
    })
    .await;
    let (_, body) = healthz(port).await.unwrap();
    for queue in up.iter().chain([&downed]) {
        assert!(
            body.contains(&format!("queue {}: consuming", queue.name)),
            "{body}"
        );
    }
    let down = format!("queue {}: down", downed.name);
    let deadline = Instant::now() + SETTLE;
    let seen = loop {
        let _ = q
            .channel
            .queue_delete(downed.name.as_str().into(), QueueDeleteOptions::default())
            .await;
        let probing = Instant::now();
        let mut seen = None;
        while seen.is_none() && probing.elapsed() < Duration::from_secs(2) {
            seen = healthz(port).await.filter(|(_, body)| body.contains(&down));
        }
        if let Some(seen) = seen {
            break seen;
        }
        assert!(Instant::now() < deadline, "/healthz never said {down}");
    };
    assert_eq!(seen.0, 503, "{}", seen.1);
    for queue in up {
        let consuming = format!("queue {}: consuming", queue.name);
        assert!(seen.1.contains(&consuming), "{}", seen.1);
    }
    wait_until(SETTLE, "the queue back", || async {
        healthz(port).await.is_some_and(|(status, _)| status == 200)
    })
    .await;
}

/// Records its event id in `service_effects`, in the operation's transaction, after
/// `delay_ms` from the message.
struct Effect<const HANG: bool, const OTHER: bool = false>;

impl<const HANG: bool, const OTHER: bool> Handler for Effect<HANG, OTHER> {
    type Message = Value;
    type Output = ();
    const OPERATION: &'static str = match (HANG, OTHER) {
        (true, _) => "tests.hang",
        (false, false) => "tests.effect",
        (false, true) => "tests.other",
    };
    fn scope(&self, _: &Value) -> String {
        "tests".into()
    }
    fn idempotency_key(&self, m: &Value) -> String {
        m["event_id"].as_str().unwrap_or_default().into()
    }
    async fn handle(&self, m: Value, ctx: &mut Context) -> Result<(), HandlerError> {
        if HANG {
            std::future::pending::<()>().await;
        }
        let delay = m["delay_ms"].as_u64().unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        sqlx::query("INSERT INTO service_effects (event_id) VALUES ($1)")
            .bind(m["event_id"].as_str())
            .execute(ctx.tx().await?)
            .await?;
        Ok(())
    }
}

fn queue_config(queue: &TestQueue, shutdown_timeout: Duration) -> WorkerConfig {
    WorkerConfig {
        queue: queue.name.clone(),
        shutdown_timeout,
        retry: idem::RetryPolicy {
            delays: RETRY_DELAYS_MS.map(Duration::from_millis).to_vec(),
            ..idem::RetryPolicy::default()
        },
        ..WorkerConfig::default()
    }
}

fn service_config() -> ServiceConfig {
    ServiceConfig {
        amqp_url: amqp_url(),
        name: format!("test-service-{}", uuid::Uuid::new_v4().simple()),
        tally_every: None,
        ..ServiceConfig::default()
    }
}

/// A handler that hangs past its queue's shutdown timeout holds back that queue only:
/// the other queue's handler in flight at the shutdown finishes, is recorded and acked;
/// the service returns once the hung queue's timeout is over, and the hung message is
/// back in its queue for the next start.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_hung_handler_holds_back_only_its_own_queue_at_shutdown(pool: PgPool) {
    sqlx::query("CREATE TABLE service_effects (event_id text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let hung = TestQueue::new("service-hung").await;
    let busy = TestQueue::new("service-busy").await;
    let store = Store::new(pool.clone(), StoreConfig::default());
    let shutdown = CancellationToken::new();
    let service = Service::new(store.clone(), service_config())
        .handler(Effect::<true>, queue_config(&hung, Duration::from_secs(3)))
        .handler(
            Effect::<false>,
            queue_config(&busy, Duration::from_secs(30)),
        );
    let running = tokio::spawn(service.run(shutdown.clone()));
    wait_for_consumers(&hung, 1).await;
    wait_for_consumers(&busy, 1).await;
    hung.publish(json!({"event_id": "stuck"}).to_string().as_bytes())
        .await;
    busy.publish(
        json!({"event_id": "slow", "delay_ms": 1500})
            .to_string()
            .as_bytes(),
    )
    .await;
    let key = |queue: &str, id: &str| {
        let op = if queue == "hung" {
            "tests.hang"
        } else {
            "tests.effect"
        };
        idem::Key::new("tests", op, id).unwrap()
    };
    wait_until(SETTLE, "both handlers running", || async {
        let hung = store.get(&key("hung", "stuck")).await.unwrap();
        let slow = store.get(&key("busy", "slow")).await.unwrap();
        hung.is_some() && slow.is_some()
    })
    .await;
    let stopping = Instant::now();
    shutdown.cancel();
    let result = tokio::time::timeout(SETTLE, running)
        .await
        .unwrap()
        .unwrap();
    let took = stopping.elapsed();
    assert!(result.is_ok(), "{result:?}");
    assert!(
        took >= Duration::from_secs(3),
        "the hung queue waited its timeout: {took:?}"
    );
    assert!(
        took < Duration::from_secs(30),
        "nobody waited for the hung one past it: {took:?}"
    );
    let slow = store.get(&key("busy", "slow")).await.unwrap().unwrap();
    assert_eq!(
        slow.status,
        idem::Status::Completed,
        "the other queue drained"
    );
    assert_eq!(counts(&pool, "service_effects").await.get("slow"), Some(&1));
    assert_eq!(busy.counts(&busy.name).await.0, 0, "and acked");
    wait_until(SETTLE, "the hung message back in its queue", || async {
        hung.counts(&hung.name).await.0 == 1
    })
    .await;
}

/// A service with two handlers on one queue, or two of one operation, does not start,
/// saying which; a queue the broker refuses (declared with other arguments) stops the
/// service naming it, after the other queue stopped too.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_service_refused_as_assembled_or_by_the_broker_names_the_queue(pool: PgPool) {
    let store = Store::new(pool.clone(), StoreConfig::default());
    let a = TestQueue::new("service-a").await;
    let b = TestQueue::new("service-b").await;
    let two_on_one = Service::new(store.clone(), service_config())
        .handler(Effect::<false>, queue_config(&a, Duration::from_secs(5)))
        .handler(Effect::<true>, queue_config(&a, Duration::from_secs(5)))
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    assert!(
        matches!(two_on_one, WorkerError::Invalid { .. }),
        "{two_on_one}"
    );
    assert!(
        two_on_one
            .to_string()
            .contains(&format!("queue {} has two handlers", a.name)),
        "{two_on_one}"
    );
    let one_op_twice = Service::new(store.clone(), service_config())
        .handler(Effect::<false>, queue_config(&a, Duration::from_secs(5)))
        .handler(Effect::<false>, queue_config(&b, Duration::from_secs(5)))
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    assert!(
        one_op_twice
            .to_string()
            .contains("operation tests.effect is handled twice"),
        "{one_op_twice}"
    );
    let one_type_twice = Service::new(store.clone(), service_config())
        .handler_for(
            "t",
            Effect::<false>,
            queue_config(&a, Duration::from_secs(5)),
        )
        .handler_for(
            "t",
            Effect::<true>,
            queue_config(&a, Duration::from_secs(5)),
        )
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    assert!(
        one_type_twice
            .to_string()
            .contains("two handlers for message type \"t\""),
        "{one_type_twice}"
    );

    let by_idem_header = Service::new(store.clone(), service_config())
        .handler_for(
            "t",
            Effect::<false>,
            WorkerConfig {
                route_by: idem::RouteBy::Header("idem-kind".into()),
                ..queue_config(&a, Duration::from_secs(5))
            },
        )
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    assert!(
        by_idem_header
            .to_string()
            .contains("routes by header idem-kind"),
        "{by_idem_header}"
    );

    // b exists as a quorum queue; the service declares it classic.
    let quorum = idem::Topology {
        queue: b.name.clone(),
        queue_type: QueueType::Quorum,
        retry_delays: RETRY_DELAYS_MS.map(Duration::from_millis).to_vec(),
        subscriptions: Vec::new(),
        single_active_consumer: false,
    };
    quorum.declare(&a.connection).await.unwrap();
    let refused = Service::new(store, service_config())
        .handler(Effect::<false>, queue_config(&a, Duration::from_secs(5)))
        .handler(Effect::<true>, queue_config(&b, Duration::from_secs(5)))
        .run(CancellationToken::new());
    let refused = tokio::time::timeout(SETTLE, refused)
        .await
        .expect("the service stops")
        .unwrap_err();
    let line = refused.to_string();
    assert!(
        matches!(&refused, WorkerError::Refused { queue, .. } if *queue == b.name)
            && line.contains("PRECONDITION_FAILED")
            && !line.contains('\n'),
        "{line}"
    );
}

/// The broker closes the connection the service's queues share: both queues reconnect
/// on one new connection and consume again, and what is published then is handled.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn the_queues_reconnect_together_when_their_connection_is_closed(pool: PgPool) {
    sqlx::query("CREATE TABLE service_effects (event_id text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let config = service_config();
    let name = config.name.clone();
    let Some(_) = connection_pids(&name) else {
        assert!(
            !std::env::var("IDEM_CI").is_ok_and(|v| v == "1"),
            "rabbitmqctl list_connections failed: CI must close the connection"
        );
        println!("skipped: closing a connection needs rabbitmqctl");
        return;
    };
    let a = TestQueue::new("service-reconnect-a").await;
    let b = TestQueue::new("service-reconnect-b").await;
    let store = Store::new(pool.clone(), StoreConfig::default());
    let shutdown = CancellationToken::new();
    let service = Service::new(store.clone(), config)
        .handler(Effect::<false>, queue_config(&a, Duration::from_secs(5)))
        .handler(
            Effect::<false, true>,
            queue_config(&b, Duration::from_secs(5)),
        );
    let health = service.broker_health();
    let running = tokio::spawn(service.run(shutdown.clone()));
    wait_for_consumers(&a, 1).await;
    wait_for_consumers(&b, 1).await;
    let first = connection_pids(&name).unwrap();
    assert_eq!(first.len(), 1, "two queues, one connection: {first:?}");
    let closed = std::process::Command::new("rabbitmqctl")
        .args([
            "-q",
            "close_connection",
            &first[0],
            "test: the broker closes it",
        ])
        .status()
        .unwrap();
    assert!(closed.success());
    wait_until(
        SETTLE,
        "both queues consuming on a new connection",
        || async {
            let now = connection_pids(&name).unwrap_or_default();
            now.len() == 1 && now != first && health.is_up()
        },
    )
    .await;
    wait_for_consumers(&a, 1).await;
    wait_for_consumers(&b, 1).await;
    a.publish(json!({"event_id": "after-a"}).to_string().as_bytes())
        .await;
    b.publish(json!({"event_id": "after-b"}).to_string().as_bytes())
        .await;
    wait_until(SETTLE, "both handled after the reconnect", || async {
        let effects = counts(&pool, "service_effects").await;
        effects.get("after-a") == Some(&1) && effects.get("after-b") == Some(&1)
    })
    .await;
    shutdown.cancel();
    let result = tokio::time::timeout(SETTLE, running)
        .await
        .unwrap()
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
}

/// Handlers chosen by a field of the JSON body: each type reaches its handler; a type
/// none takes is dead-lettered `unroutable`, a body that is not JSON `malformed`.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn handlers_chosen_by_a_json_field(pool: PgPool) {
    sqlx::query("CREATE TABLE service_effects (event_id text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let q = TestQueue::new("service-by-field").await;
    let store = Store::new(pool.clone(), StoreConfig::default());
    let by_kind = WorkerConfig {
        route_by: idem::RouteBy::Field("kind".into()),
        ..queue_config(&q, Duration::from_secs(5))
    };
    let shutdown = CancellationToken::new();
    let service = Service::new(store, service_config())
        .handler_for("a", Effect::<false>, by_kind.clone())
        .handler_for("b", Effect::<false, true>, by_kind);
    let running = tokio::spawn(service.run(shutdown.clone()));
    wait_for_consumers(&q, 1).await;
    for body in [
        json!({"event_id": "f-a", "kind": "a"}).to_string(),
        json!({"event_id": "f-b", "kind": "b"}).to_string(),
        json!({"event_id": "f-c", "kind": "c"}).to_string(),
        "not json".to_string(),
    ] {
        q.publish(body.as_bytes()).await;
    }
    wait_until(
        SETTLE,
        "both typed messages handled, two dead letters",
        || async {
            let effects = counts(&pool, "service_effects").await;
            effects.len() == 2 && q.counts(&q.dlq()).await.0 == 2
        },
    )
    .await;
    let mut reasons: Vec<String> = q
        .drain(&q.dlq())
        .await
        .into_iter()
        .map(|m| {
            format!(
                "{} {}",
                m.reason.unwrap_or_default(),
                m.error.unwrap_or_default()
            )
        })
        .collect();
    reasons.sort();
    assert!(
        reasons[0].starts_with("malformed body is not JSON"),
        "{reasons:?}"
    );
    assert!(
        reasons[1].starts_with("unroutable no handler for message field kind \"c\""),
        "{reasons:?}"
    );
    for (op, key) in [("tests.effect", "f-a"), ("tests.other", "f-b")] {
        let record = Store::new(pool.clone(), StoreConfig::default())
            .get(&idem::Key::new("tests", op, key).unwrap())
            .await
            .unwrap();
        assert_eq!(
            record.map(|r| r.status),
            Some(idem::Status::Completed),
            "{op}"
        );
    }
    shutdown.cancel();
    tokio::time::timeout(SETTLE, running)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
