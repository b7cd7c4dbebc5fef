//! Traces (feature `otel`): a message or request that carries a `traceparent` gives
//! spans in that trace, parented correctly, through a retry hop, a dead letter and its
//! replay, an outbox hop into a downstream worker, and the HTTP layer; the record keeps
//! the trace id. Spans are caught by the SDK's in-memory exporter, installed once for
//! this test binary; each test keeps to the spans of its own trace.
//!
//! The export over OTLP/HTTP to a collector is tested with a worker process and a
//! collector stand-in in `tests/otlp.rs`.

mod common;

use std::sync::OnceLock;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{TestQueue, bearer_principal, start_in_process, wait_until};
use idem::http::{Idempotency, IdempotentRequest};
use idem::replay::{self, Action};
use idem::{Context, FollowUp, Handler, HandlerError, Key, Mode, Store, StoreConfig};
use lapin::BasicProperties;
use lapin::types::FieldTable;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider,
};
use opentelemetry::{KeyValue, Value as OtelValue};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

const SETTLE: Duration = Duration::from_secs(60);

/// The spans every test of this binary makes, caught in memory.
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    &EXPORTER
        .get_or_init(|| {
            let exporter = InMemorySpanExporter::default();
            let provider = SdkTracerProvider::builder()
                .with_simple_exporter(exporter.clone())
                .build();
            let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("idem-test"));
            tracing_subscriber::registry()
                .with(tracing_subscriber::filter::LevelFilter::INFO)
                .with(layer)
                .init();
            (exporter, provider)
        })
        .0
}

/// A fresh trace: its id, and the `traceparent` of a producer's span in it.
struct Producer {
    trace_id: String,
    span_id: String,
}

impl Producer {
    fn new() -> Self {
        let trace_id = uuid::Uuid::new_v4().simple().to_string();
        let span_id = uuid::Uuid::new_v4().simple().to_string()[..16].to_owned();
        Self { trace_id, span_id }
    }

    fn traceparent(&self) -> String {
        format!("00-{}-{}-01", self.trace_id, self.span_id)
    }

    fn properties(&self) -> BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert(
            "traceparent".into(),
            common::header_text(&self.traceparent()),
        );
        headers.insert("tracestate".into(), common::header_text("vendor=abc"));
        BasicProperties::default()
            .with_message_id(uuid::Uuid::new_v4().to_string().into())
            .with_headers(headers)
    }
}

/// The finished spans of `trace_id`.
fn spans_of(trace_id: &str) -> Vec<SpanData> {
    exporter()
        .get_finished_spans()
        .unwrap_or_default()
        .into_iter()
        .filter(|s| s.span_context.trace_id().to_string() == trace_id)
        .collect()
}

/// Waits until `trace_id` has at least `n` spans named `name`; returns them, oldest
/// first.
async fn wait_for_spans(trace_id: &str, name: &str, n: usize) -> Vec<SpanData> {
    wait_until(SETTLE, &format!("{n} span(s) {name}"), || async {
        spans_of(trace_id).iter().filter(|s| s.name == name).count() >= n
    })
    .await;
    let mut found: Vec<SpanData> = spans_of(trace_id)
        .into_iter()
        .filter(|s| s.name == name)
        .collect();
    found.sort_by_key(|s| s.start_time);
    found
}

fn attribute(span: &SpanData, key: &str) -> Option<OtelValue> {
    span.attributes
        .iter()
        .find(|kv: &&KeyValue| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

fn text(span: &SpanData, key: &str) -> String {
    attribute(span, key)
        .map(|v| v.to_string())
        .unwrap_or_default()
}

/// The children of `parent` named `name`.
fn children<'a>(spans: &'a [SpanData], parent: &SpanData, name: &str) -> Vec<&'a SpanData> {
    spans
        .iter()
        .filter(|s| s.parent_span_id == parent.span_context.span_id() && s.name == name)
        .collect()
}

fn span_id(span: &SpanData) -> String {
    span.span_context.span_id().to_string()
}

#[derive(Deserialize)]
struct Job {
    event_id: String,
    /// `transient` or `permanent`: the first attempt fails so.
    #[serde(default)]
    fail: Option<String>,
    /// Stage a follow-up to this queue.
    #[serde(default)]
    follow_up_to: Option<String>,
}

struct Traced;

impl Handler for Traced {
    type Message = Job;
    type Output = Value;
    const OPERATION: &'static str = "trace.jobs";

    fn scope(&self, _: &Job) -> String {
        "t".into()
    }

    fn idempotency_key(&self, job: &Job) -> String {
        job.event_id.clone()
    }

    async fn handle(&self, job: Job, ctx: &mut Context) -> Result<Value, HandlerError> {
        match (job.fail.as_deref(), ctx.attempt()) {
            (Some("transient"), 1) => return Err(HandlerError::transient("provider timed out")),
            (Some("permanent"), 1) => return Err(HandlerError::permanent("provider refused")),
            _ => {}
        }
        if let Some(to) = &job.follow_up_to {
            let body = json!({ "event_id": ctx.next_message_id() });
            let message =
                FollowUp::json("", to.as_str(), &body).map_err(HandlerError::permanent)?;
            ctx.publish(message).await?;
        }
        Ok(json!({ "traceparent": ctx.traceparent() }))
    }
}

/// [`Traced`] as a batch handler: each message's output, in one call.
struct TracedBatch;

impl Handler for TracedBatch {
    type Message = Job;
    type Output = Value;
    const OPERATION: &'static str = "trace.batch";

    fn scope(&self, _: &Job) -> String {
        "t".into()
    }

    fn idempotency_key(&self, job: &Job) -> String {
        job.event_id.clone()
    }

    async fn handle(&self, _: Job, _: &mut Context) -> Result<Value, HandlerError> {
        Ok(json!({ "alone": true }))
    }

    async fn handle_batch(
        &self,
        batch: &mut idem::Batch<Job>,
    ) -> Option<Vec<Result<Value, HandlerError>>> {
        Some(batch.iter().map(|_| Ok(json!({ "batch": true }))).collect())
    }
}

/// The `handle_batch` span that links to `handler` (a message's handler span), if one
/// finished.
fn batch_span_of(handler: &SpanData) -> Option<SpanData> {
    exporter()
        .get_finished_spans()
        .unwrap_or_default()
        .into_iter()
        .find(|s| {
            s.name.starts_with("handle_batch")
                && s.links
                    .links
                    .iter()
                    .any(|link| link.span_context == handler.span_context)
        })
}

/// A queue beside `q` for follow-ups, declared as its worker will.
async fn downstream_of(q: &TestQueue) -> TestQueue {
    let downstream = q.beside("downstream").await;
    idem::Topology {
        queue: downstream.name.clone(),
        queue_type: idem::QueueType::Classic,
        retry_delays: Vec::new(),
        subscriptions: Vec::new(),
        single_active_consumer: false,
    }
    .declare(&q.connection)
    .await
    .unwrap();
    downstream
}

async fn trace_id_of(pool: &PgPool, event_id: &str) -> Option<String> {
    let key = Key::new("t", Traced::OPERATION, event_id).unwrap();
    let store = Store::new(pool.clone(), StoreConfig::default());
    store.get(&key).await.unwrap().and_then(|r| r.trace_id)
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_trace_survives_a_retry_hop_and_an_outbox_hop_into_a_downstream_worker(pool: PgPool) {
    exporter();
    let q = TestQueue::new("trace-hops").await;
    let downstream = downstream_of(&q).await;
    let (stop, task) = start_in_process(&pool, &q, Traced, |c| c.retry.immediate = 0).await;
    let (stop_down, task_down) = start_in_process(&pool, &downstream, Traced, |_| {}).await;

    let producer = Producer::new();
    let body = json!({"event_id": "evt-1", "fail": "transient", "follow_up_to": downstream.name});
    q.publish_to(&q.name, body.to_string().as_bytes(), producer.properties())
        .await;
    let name = format!("process {}", q.name);
    let processed = wait_for_spans(&producer.trace_id, &name, 2).await;
    let down_name = format!("process {}", downstream.name);
    let down = wait_for_spans(&producer.trace_id, &down_name, 1).await;
    let spans = spans_of(&producer.trace_id);

    // The first delivery: a consumer span under the producer's span, with the
    // messaging conventions and idem's attributes, and its four steps as children.
    let first = &processed[0];
    assert_eq!(first.span_kind, SpanKind::Consumer);
    assert_eq!(first.parent_span_id.to_string(), producer.span_id);
    assert_eq!(text(first, "messaging.system"), "rabbitmq");
    assert_eq!(text(first, "messaging.destination.name"), q.name);
    assert_eq!(text(first, "messaging.operation.name"), "process");
    assert!(attribute(first, "messaging.rabbitmq.message.delivery_tag").is_some());
    assert!(!text(first, "messaging.message.id").is_empty());
    assert_eq!(text(first, "idem.outcome"), "failed_transient");
    assert_eq!(text(first, "idem.attempt"), "1");
    assert_eq!(text(first, "idem.takeover"), "false");
    let key = Key::new("t", Traced::OPERATION, "evt-1").unwrap();
    assert_eq!(text(first, "idem.key"), key.short_hash());
    for step in ["claim", "handler", "completion", "settle"] {
        assert_eq!(
            children(&spans, first, step).len(),
            1,
            "{step} under the first delivery"
        );
    }
    // The producer's tracestate is carried on.
    assert_eq!(first.span_context.trace_state().header(), "vendor=abc");

    // The retry hop: the second delivery's parent is the span that published the retry.
    let second = &processed[1];
    let settle = children(&spans, first, "settle")[0];
    assert_eq!(second.parent_span_id, settle.span_context.span_id());
    assert_eq!(text(second, "idem.outcome"), "executed");
    assert_eq!(text(second, "idem.attempt"), "2");

    // The outbox hop: the follow-up was staged in the second run's handler span; the
    // downstream worker continues from it.
    let handler = children(&spans, second, "handler")[0];
    assert_eq!(down[0].parent_span_id, handler.span_context.span_id());
    assert_eq!(text(&down[0], "idem.outcome"), "executed");

    // The record keeps the trace id, and `idem ops show` prints it; the handler saw its
    // own span's context.
    let url = common::database_url(&pool.connect_options());
    let key_args = [
        "--scope",
        "t",
        "--operation",
        "trace.jobs",
        "--key",
        "evt-1",
    ];
    let shown = common::idem_cli(&url, &[&["ops", "show"][..], &key_args].concat()).await;
    let line = format!("trace_id          {}", producer.trace_id);
    assert!(shown.contains(&line), "{shown}");
    assert_eq!(
        trace_id_of(&pool, "evt-1").await.as_deref(),
        Some(producer.trace_id.as_str())
    );
    let result: Value = sqlx::query_scalar(
        "SELECT result FROM processed_operations WHERE idempotency_key = 'evt-1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let seen = result["traceparent"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert_eq!(
        seen,
        format!("00-{}-{}-01", producer.trace_id, span_id(handler))
    );

    stop.cancel();
    stop_down.cancel();
    task.await.unwrap().unwrap();
    task_down.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn follow_ups_of_a_transactional_batch_are_children_of_its_handler_span(pool: PgPool) {
    exporter();
    let q = TestQueue::new("trace-tx").await;
    let downstream = downstream_of(&q).await;
    let (stop, task) = start_in_process(&pool, &q, Traced, |c| c.mode = Mode::Transactional).await;
    let (stop_down, task_down) = start_in_process(&pool, &downstream, Traced, |_| {}).await;
    let producer = Producer::new();
    let body = json!({"event_id": "evt-tx", "follow_up_to": downstream.name});
    q.publish_to(&q.name, body.to_string().as_bytes(), producer.properties())
        .await;
    let processed = wait_for_spans(&producer.trace_id, &format!("process {}", q.name), 1).await;
    let down = wait_for_spans(
        &producer.trace_id,
        &format!("process {}", downstream.name),
        1,
    )
    .await;
    let spans = spans_of(&producer.trace_id);
    // The batch runs apart from the delivery: its handler span is the delivery's child
    // all the same, beside the delivery's `transaction` span, and the follow-up it
    // staged continues from it.
    let delivery = &processed[0];
    assert_eq!(children(&spans, delivery, "transaction").len(), 1);
    let handler = children(&spans, delivery, "handler");
    assert_eq!(handler.len(), 1, "{spans:#?}");
    assert_eq!(text(handler[0], "idem.attempt"), "1");
    assert_eq!(down[0].parent_span_id, handler[0].span_context.span_id());
    stop.cancel();
    stop_down.cancel();
    task.await.unwrap().unwrap();
    task_down.await.unwrap().unwrap();
}

/// A batch handler's call belongs to no one delivery's trace: its `handle_batch` span
/// starts a trace of its own and links to the handler span of each delivery it took,
/// which stays the child of its delivery's span.
#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_batch_span_links_to_the_handler_span_of_each_delivery(pool: PgPool) {
    exporter();
    let q = TestQueue::new("trace-batch").await;
    let (stop, task) =
        start_in_process(&pool, &q, TracedBatch, |c| c.mode = Mode::Transactional).await;
    let producers: Vec<Producer> = (0..4).map(|_| Producer::new()).collect();
    for (i, producer) in producers.iter().enumerate() {
        let body = json!({ "event_id": format!("evt-batch-{i}") });
        q.publish_to(&q.name, body.to_string().as_bytes(), producer.properties())
            .await;
    }
    let mut batches = std::collections::HashSet::new();
    for producer in &producers {
        let processed = wait_for_spans(&producer.trace_id, &format!("process {}", q.name), 1).await;
        let spans = spans_of(&producer.trace_id);
        let handler = children(&spans, &processed[0], "handler");
        assert_eq!(handler.len(), 1, "{spans:#?}");
        let handler = handler[0].clone();
        wait_until(SETTLE, "the batch span that links to it", || async {
            batch_span_of(&handler).is_some()
        })
        .await;
        let batch = batch_span_of(&handler).unwrap();
        assert_eq!(batch.name, "handle_batch trace.batch");
        assert_ne!(
            batch.span_context.trace_id(),
            handler.span_context.trace_id()
        );
        assert_eq!(
            text(&batch, "idem.batch_size"),
            batch.links.links.len().to_string(),
            "one link per delivery of the batch"
        );
        batches.insert(batch.span_context.span_id());
    }
    eprintln!("4 deliveries in {} batch(es)", batches.len());
    stop.cancel();
    task.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_trace_survives_a_dead_letter_and_its_replay_in_transactional_mode(pool: PgPool) {
    exporter();
    let q = TestQueue::new("trace-replay").await;
    let (stop, task) = start_in_process(&pool, &q, Traced, |c| c.mode = Mode::Transactional).await;
    let producer = Producer::new();
    let body = json!({"event_id": "evt-2", "fail": "permanent"});
    q.publish_to(&q.name, body.to_string().as_bytes(), producer.properties())
        .await;
    q.wait_for_messages(&q.dlq(), 1, SETTLE).await;
    let name = format!("process {}", q.name);
    let dead = wait_for_spans(&producer.trace_id, &name, 1).await;
    assert_eq!(text(&dead[0], "idem.outcome"), "failed_permanent");
    assert_eq!(
        dead[0].status,
        opentelemetry::trace::Status::error("dead-lettered")
    );

    // The dead letter carries the context of the span that published it.
    let spans = spans_of(&producer.trace_id);
    assert_eq!(children(&spans, &dead[0], "transaction").len(), 1);
    let settle = children(&spans, &dead[0], "settle")[0].clone();
    let letters = replay::peek(&q.connection, &q.dlq(), &replay::Filter::default(), 10)
        .await
        .unwrap();
    let carried = idem::headers::text(&letters[0].delivery.properties, "traceparent");
    assert_eq!(
        carried,
        Some(format!("00-{}-{}-01", producer.trace_id, span_id(&settle)))
    );
    drop(letters);

    // The operator replays it: the replay runs in the same trace, under that span.
    let store = Store::new(pool.clone(), StoreConfig::default());
    let summary = replay::run(
        &q.connection,
        &store,
        &q.dlq(),
        Action::Replay,
        &replay::Options::default(),
    )
    .await
    .unwrap();
    assert_eq!(summary.replayed, 1);
    let processed = wait_for_spans(&producer.trace_id, &name, 2).await;
    let replayed = &processed[1];
    assert_eq!(replayed.parent_span_id, settle.span_context.span_id());
    assert_eq!(text(replayed, "idem.outcome"), "executed");
    assert_eq!(
        trace_id_of(&pool, "evt-2").await.as_deref(),
        Some(producer.trace_id.as_str())
    );

    stop.cancel();
    task.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_message_without_a_traceparent_starts_a_trace_that_the_record_names(pool: PgPool) {
    exporter();
    let q = TestQueue::new("trace-root").await;
    let (stop, task) = start_in_process(&pool, &q, Traced, |_| {}).await;
    q.publish(json!({"event_id": "evt-3"}).to_string().as_bytes())
        .await;
    wait_until(SETTLE, "the record", || async {
        trace_id_of(&pool, "evt-3").await.is_some()
    })
    .await;
    let trace_id = trace_id_of(&pool, "evt-3").await.unwrap();
    let name = format!("process {}", q.name);
    let root = wait_for_spans(&trace_id, &name, 1).await;
    assert_eq!(
        root[0].parent_span_id,
        opentelemetry::trace::SpanId::INVALID
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}

async fn create(request: IdempotentRequest) -> Response {
    (StatusCode::CREATED, format!("attempt {}", request.attempt)).into_response()
}

/// An application's server span around the routes: it continues the request's
/// `traceparent` when the request says `x-app-continues`, else it starts a trace of its
/// own (as a `TraceLayer` that does not read the header would).
async fn app_span(request: Request, next: Next) -> Response {
    let span = tracing::info_span!("app_server");
    let continues = request.headers().contains_key("x-app-continues");
    let traceparent = request
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok());
    if let (true, Some(traceparent)) = (continues, traceparent) {
        let parts: Vec<&str> = traceparent.split('-').collect();
        let remote = SpanContext::new(
            TraceId::from_hex(parts[1]).unwrap(),
            SpanId::from_hex(parts[2]).unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let parent = opentelemetry::Context::new().with_remote_span_context(remote);
        span.set_parent(parent).unwrap();
    }
    next.run(request).instrument(span).await
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn under_an_application_span_a_request_stays_in_the_incoming_trace(pool: PgPool) {
    exporter();
    let keys = Idempotency::new(
        Store::new(pool.clone(), StoreConfig::default()),
        bearer_principal,
    );
    let app = Router::new()
        .route("/orders", post(create).route_layer(keys.required()))
        .layer(axum::middleware::from_fn(app_span));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let send = |producer: &Producer, key: &str, continues: bool| {
        let mut request = reqwest::Client::new()
            .post(format!("http://{addr}/orders"))
            .header("authorization", "Bearer acme")
            .header("idempotency-key", key)
            .header("traceparent", producer.traceparent())
            .body("{}");
        if continues {
            request = request.header("x-app-continues", "1");
        }
        request.send()
    };

    // The application's span continued the trace: idem's span is its child.
    let producer = Producer::new();
    assert_eq!(
        send(&producer, "o-1", true)
            .await
            .unwrap()
            .status()
            .as_u16(),
        201
    );
    let app = wait_for_spans(&producer.trace_id, "app_server", 1).await;
    let ours = wait_for_spans(&producer.trace_id, "POST /orders", 1).await;
    assert_eq!(app[0].parent_span_id.to_string(), producer.span_id);
    assert_eq!(ours[0].parent_span_id, app[0].span_context.span_id());
    assert_eq!(ours[0].span_kind, SpanKind::Internal);

    // It did not: idem's span continues the incoming trace, as the server span.
    let producer = Producer::new();
    assert_eq!(
        send(&producer, "o-2", false)
            .await
            .unwrap()
            .status()
            .as_u16(),
        201
    );
    let ours = wait_for_spans(&producer.trace_id, "POST /orders", 1).await;
    assert_eq!(ours[0].parent_span_id.to_string(), producer.span_id);
    assert_eq!(ours[0].span_kind, SpanKind::Server);
    assert!(
        spans_of(&producer.trace_id)
            .iter()
            .all(|s| s.name != "app_server")
    );
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn an_http_request_with_a_traceparent_joins_its_trace(pool: PgPool) {
    exporter();
    let keys = Idempotency::new(
        Store::new(pool.clone(), StoreConfig::default()),
        bearer_principal,
    );
    let app = Router::new().route("/orders", post(create).route_layer(keys.required()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let producer = Producer::new();
    let answer = reqwest::Client::new()
        .post(format!("http://{addr}/orders"))
        .header("authorization", "Bearer acme")
        .header("idempotency-key", "order-1")
        .header("traceparent", producer.traceparent())
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status().as_u16(), 201);
    let spans = wait_for_spans(&producer.trace_id, "POST /orders", 1).await;
    assert_eq!(spans[0].span_kind, SpanKind::Server);
    assert_eq!(spans[0].parent_span_id.to_string(), producer.span_id);
    assert_eq!(text(&spans[0], "http.route"), "/orders");
    assert_eq!(text(&spans[0], "http.request.method"), "POST");
    let key = Key::new("acme", "POST /orders", "order-1").unwrap();
    let record = Store::new(pool.clone(), StoreConfig::default())
        .get(&key)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.trace_id.as_deref(), Some(producer.trace_id.as_str()));
}
