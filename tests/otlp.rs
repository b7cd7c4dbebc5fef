//! Trace export (feature `otel`): an `orders_worker` process started with
//! `OTEL_EXPORTER_OTLP_ENDPOINT` sends its spans over OTLP/HTTP, in protobuf or JSON as
//! `OTEL_EXPORTER_OTLP_PROTOCOL` says, to a collector stand-in: an HTTP server in the
//! test that decodes every request as a collector would and keeps the spans.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::{
    TestQueue, database_url, spawn_orders_worker_with_env, wait_for_consumers, wait_until,
};
use lapin::BasicProperties;
use lapin::types::FieldTable;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value;
use prost::Message;
use sqlx::PgPool;

const SETTLE: Duration = Duration::from_secs(60);

/// One span as the collector received it.
#[derive(Debug, Clone)]
struct Received {
    content_type: String,
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
}

type Inbox = Arc<Mutex<Vec<Received>>>;

/// `POST /v1/traces`, decoded by its content type; anything undecodable is a 400 (and
/// fails the test by never showing up).
async fn collect(State(inbox): State<Inbox>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let request = match content_type.as_str() {
        "application/x-protobuf" => ExportTraceServiceRequest::decode(body).ok(),
        "application/json" => serde_json::from_slice::<ExportTraceServiceRequest>(&body).ok(),
        _ => None,
    };
    let Some(request) = request else {
        return StatusCode::BAD_REQUEST;
    };
    let mut inbox = inbox.lock().unwrap();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                any_value::Value::StringValue(s) => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                inbox.push(Received {
                    content_type: content_type.clone(),
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex::encode(span.trace_id),
                    span_id: hex::encode(span.span_id),
                    parent_span_id: hex::encode(span.parent_span_id),
                });
            }
        }
    }
    StatusCode::OK
}

/// A collector stand-in on a free port: its base URL and what it received.
async fn collector() -> (String, Inbox) {
    let inbox = Inbox::default();
    let app = Router::new()
        .route("/v1/traces", post(collect))
        .with_state(inbox.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), inbox)
}

/// Starts a worker exporting with `protocol`, publishes an order in a trace of the
/// test's, and checks that the collector received the worker's spans in that trace.
async fn exports_with(pool: PgPool, protocol: &str, content_type: &str) {
    let (endpoint, inbox) = collector().await;
    let q = TestQueue::new("otlp").await;
    let service = format!("orders-{}", &q.name[q.name.len() - 8..]);
    let _worker = spawn_orders_worker_with_env(
        &database_url(&pool.connect_options()),
        &q.name,
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
            ("OTEL_SERVICE_NAME", service.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    wait_for_consumers(&q, 1).await;

    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let producer_span = "00f067aa0ba902b7";
    let mut headers = FieldTable::default();
    let traceparent = format!("00-{trace_id}-{producer_span}-01");
    headers.insert("traceparent".into(), common::header_text(&traceparent));
    let properties = BasicProperties::default()
        .with_message_id("m-otlp".into())
        .with_headers(headers);
    q.publish_to(
        &q.name,
        &common::order("evt-otlp", "acme", 1200),
        properties,
    )
    .await;

    let name = format!("process {}", q.name);
    let received = || -> Vec<Received> {
        inbox
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect()
    };
    wait_until(SETTLE, "the consumer span and its handler span", || async {
        let spans = received();
        spans.iter().any(|s| s.name == name) && spans.iter().any(|s| s.name == "handler")
    })
    .await;
    let spans = received();
    let consumer = spans.iter().find(|s| s.name == name).unwrap();
    assert_eq!(consumer.parent_span_id, producer_span);
    assert_eq!(
        consumer.service, service,
        "OTEL_SERVICE_NAME names the service"
    );
    assert_eq!(consumer.content_type, content_type);
    let handler = spans.iter().find(|s| s.name == "handler").unwrap();
    assert_eq!(handler.parent_span_id, consumer.span_id);
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_worker_exports_its_spans_over_otlp_http_protobuf(pool: PgPool) {
    exports_with(pool, "http/protobuf", "application/x-protobuf").await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn a_worker_exports_its_spans_over_otlp_http_json(pool: PgPool) {
    exports_with(pool, "http/json", "application/json").await;
}

#[sqlx::test(migrator = "idem::db::MIGRATOR")]
async fn an_unknown_otlp_protocol_stops_the_worker_with_one_line(pool: PgPool) {
    // An error at start, not a silent fallback to another protocol.
    let q = TestQueue::new("otlp-refused").await;
    let mut worker = spawn_orders_worker_with_env(
        &database_url(&pool.connect_options()),
        &q.name,
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ],
    );
    let status = tokio::time::timeout(SETTLE, worker.child.wait())
        .await
        .expect("the worker exits")
        .unwrap();
    assert!(!status.success());
    let log = std::fs::read_to_string(&worker.log).unwrap();
    assert!(
        log.contains("orders_worker: error: OTEL_EXPORTER_OTLP_PROTOCOL=\"grpc\" is not supported"),
        "{log}"
    );
}
