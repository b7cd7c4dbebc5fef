//! Logs and traces for a binary: one call at the start of `main`.
//!
//! [`init`] installs the log output every idem binary uses (to stderr, filtered by
//! `RUST_LOG`, `info,sqlx=warn` by default). Built with the feature `otel`, it also
//! exports traces over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set: `OTEL_EXPORTER_OTLP_PROTOCOL` chooses
//! `http/protobuf` (the default) or `http/json`, `OTEL_SERVICE_NAME` names the service
//! (the binary's name otherwise), and the SDK's other `OTEL_*` variables (batch delay,
//! headers, timeout) apply. With neither variable set, no exporter, no OpenTelemetry
//! layer and no spans beyond the logs' exist: nothing is exported and nothing costs.
//!
//! Two limits: the endpoint is plain HTTP (an `https://` one is refused at start; send
//! to a collector or agent on the host, which forwards over TLS), and `RUST_LOG`
//! filters spans as it filters logs (at `warn`, idem's `info` spans are not made, so
//! none are exported). The exporter's own failures are logged (target
//! `opentelemetry*`).
//!
//! ```no_run
//! fn main() -> std::process::ExitCode {
//!     let _telemetry = match idem::telemetry::init("my_worker") {
//!         Ok(telemetry) => telemetry,
//!         Err(error) => {
//!             eprintln!("my_worker: error: {}", idem::text::error_line(&error));
//!             return std::process::ExitCode::FAILURE;
//!         }
//!     };
//!     // ... run the worker; dropping `_telemetry` sends what is left.
//!     std::process::ExitCode::SUCCESS
//! }
//! ```

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The log filter when `RUST_LOG` is unset.
pub const DEFAULT_FILTER: &str = "info,sqlx=warn";

/// Why [`init`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TelemetryError {
    /// `OTEL_EXPORTER_OTLP_PROTOCOL` names a protocol idem does not export with.
    #[error("OTEL_EXPORTER_OTLP_PROTOCOL={0:?} is not supported (use http/protobuf or http/json)")]
    Protocol(String),
    /// The endpoint is `https://`: idem's exporter speaks plain HTTP (a TLS client for it
    /// would add a C crypto library to every build); send to a collector or agent on
    /// the host, which forwards over TLS.
    #[error(
        "{0} is https, but idem exports over plain HTTP only: send to a local collector that forwards over TLS"
    )]
    Https(&'static str),
    /// The OTLP exporter could not be built (an endpoint that is not a URL, say).
    #[cfg(feature = "otel")]
    #[error("the OTLP exporter could not be built")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
    /// A global subscriber was installed already.
    #[error("a tracing subscriber is installed already")]
    Installed(#[source] tracing_subscriber::util::TryInitError),
}

/// Keeps the trace export running; dropping it sends the spans not yet sent (waiting a
/// few seconds at most) and stops the exporter.
#[must_use = "dropping it stops the trace export"]
pub struct Telemetry {
    #[cfg(feature = "otel")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Telemetry {
    /// Whether traces are exported (the feature `otel` and an endpoint set).
    pub fn exports_traces(&self) -> bool {
        #[cfg(feature = "otel")]
        return self.provider.is_some();
        #[cfg(not(feature = "otel"))]
        false
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        #[cfg(feature = "otel")]
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("trace export: {error}");
        }
    }
}

/// Installs logs (and, with the feature `otel` and an endpoint, trace export) for the
/// binary `service`; see the module's documentation.
pub fn init(service: &str) -> Result<Telemetry, TelemetryError> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| DEFAULT_FILTER.into());
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter).with(logs);
    #[cfg(feature = "otel")]
    {
        let provider = otlp::provider(service)?;
        let layer = provider.as_ref().map(|provider| {
            use opentelemetry::trace::TracerProvider;
            tracing_opentelemetry::layer().with_tracer(provider.tracer("idem"))
        });
        registry
            .with(layer)
            .try_init()
            .map_err(TelemetryError::Installed)?;
        Ok(Telemetry { provider })
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = service;
        registry.try_init().map_err(TelemetryError::Installed)?;
        if export_requested() {
            tracing::warn!(
                "OTEL_EXPORTER_OTLP_ENDPOINT is set, but this binary was built without the \
                 feature otel: no traces are exported"
            );
        }
        Ok(Telemetry {})
    }
}

/// The variables that name an OTLP endpoint for traces.
const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// Whether the environment asks for trace export.
pub fn export_requested() -> bool {
    ENDPOINT_VARS
        .iter()
        .any(|name| std::env::var(name).is_ok_and(|v| !v.trim().is_empty()))
}

/// Refuses an `https://` endpoint, which would fail every export.
#[cfg(feature = "otel")]
fn plain_http() -> Result<(), TelemetryError> {
    for name in ENDPOINT_VARS {
        let value = std::env::var(name).unwrap_or_default();
        if value.trim().to_ascii_lowercase().starts_with("https:") {
            return Err(TelemetryError::Https(name));
        }
    }
    Ok(())
}

#[cfg(feature = "otel")]
/// The OTLP protocol asked for: `http/protobuf` unless `OTEL_EXPORTER_OTLP_PROTOCOL`
/// says `http/json`; anything else is an error rather than a silent fallback.
fn protocol() -> Result<Protocol, TelemetryError> {
    let asked = std::env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_default();
    parse_protocol(&asked)
}

#[cfg(feature = "otel")]
fn parse_protocol(asked: &str) -> Result<Protocol, TelemetryError> {
    match asked.trim() {
        "" | "http/protobuf" => Ok(Protocol::Protobuf),
        "http/json" => Ok(Protocol::Json),
        other => Err(TelemetryError::Protocol(other.to_owned())),
    }
}

#[cfg(feature = "otel")]
/// The OTLP/HTTP encodings idem exports with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Protobuf,
    Json,
}

#[cfg(feature = "otel")]
mod otlp {
    use opentelemetry_otlp::{SpanExporter, WithExportConfig};
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::trace::SdkTracerProvider;

    use super::{Protocol, TelemetryError, export_requested, plain_http, protocol};

    /// A tracer provider exporting in batches to the endpoint the environment names,
    /// or `None` when it names none.
    pub(super) fn provider(service: &str) -> Result<Option<SdkTracerProvider>, TelemetryError> {
        if !export_requested() {
            return Ok(None);
        }
        plain_http()?;
        let protocol = match protocol()? {
            Protocol::Protobuf => opentelemetry_otlp::Protocol::HttpBinary,
            Protocol::Json => opentelemetry_otlp::Protocol::HttpJson,
        };
        let exporter = SpanExporter::builder()
            .with_http()
            .with_protocol(protocol)
            .build()
            .map_err(TelemetryError::Exporter)?;
        // OTEL_SERVICE_NAME (read by the resource's detectors) wins over the default.
        let resource = if std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty()) {
            Resource::builder().build()
        } else {
            Resource::builder()
                .with_service_name(service.to_owned())
                .build()
        };
        Ok(Some(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource)
                .build(),
        ))
    }
}

#[cfg(all(test, feature = "otel"))]
mod tests {
    use super::*;

    #[test]
    fn protocols_other_than_otlp_http_are_refused() {
        assert_eq!(parse_protocol("").ok(), Some(Protocol::Protobuf));
        assert_eq!(
            parse_protocol("http/protobuf").ok(),
            Some(Protocol::Protobuf)
        );
        assert_eq!(parse_protocol(" http/json ").ok(), Some(Protocol::Json));
        let refused = parse_protocol("grpc").unwrap_err();
        assert!(
            refused.to_string().contains("\"grpc\" is not supported"),
            "{refused}"
        );
    }
}
