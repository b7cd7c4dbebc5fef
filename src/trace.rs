//! Trace context: the W3C `traceparent` and `tracestate` that carry one trace through
//! every hop (docs/DESIGN.md, "Traces").
//!
//! A delivery or an HTTP request that arrives with a `traceparent` continues that trace,
//! and every message idem publishes on its behalf carries the context on: a delayed
//! retry, a dead letter (and so its replay), a follow-up message (stored in the outbox
//! when it is staged, so that a relay publishing it minutes later still joins the
//! trace). The record keeps the trace id, for `idem ops show`.
//!
//! Without the feature `otel`, idem makes no spans of its own for other processes: it
//! passes the incoming context on unchanged, and the record keeps its trace id. With
//! the feature and an OpenTelemetry layer installed ([`crate::telemetry`]), each
//! delivery is a consumer span `process <queue>` continuing the incoming context, and
//! what idem publishes carries the context of the span that published it, so the next
//! hop's span is its child.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use tracing::Span;

use crate::headers;

/// The W3C header (and AMQP header) naming the trace and the parent span.
pub(crate) const TRACEPARENT: &str = "traceparent";
/// The W3C header carrying vendor-specific trace state beside [`TRACEPARENT`].
pub(crate) const TRACESTATE: &str = "tracestate";

/// The longest `tracestate` passed on: the W3C limit is 32 members; a longer value is
/// someone else's mistake and is dropped rather than carried through every hop.
const TRACESTATE_MAX: usize = 512;

/// A valid W3C trace context, as it travels in message and HTTP headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
}

impl TraceContext {
    /// Parses a `traceparent` (and its `tracestate`), or `None` when it is not a valid
    /// one: a trace context is a hint, and a broken one is dropped, never an error.
    ///
    /// Version `00` is exactly `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`;
    /// a later version may append fields after a `-`, which are dropped: what is passed
    /// on is always version `00` (a producer's tail would otherwise travel, unbounded,
    /// into every retry, dead letter and follow-up). `ff` is invalid, and so are
    /// all-zero ids and upper-case hex. A `tracestate` is kept only when it is at most
    /// 512 bytes of printable ASCII (no NUL, CR or LF: Postgres cannot store a NUL in
    /// the outbox's `jsonb`, and a header is no place for a line break).
    pub(crate) fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let traceparent = traceparent.trim();
        let mut parts = traceparent.splitn(5, '-');
        let (version, trace_id, span_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len: usize| {
            s.len() == len
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        let zero = |s: &str| s.bytes().all(|b| b == b'0');
        let valid = hex(version, 2)
            && version != "ff"
            && hex(trace_id, 32)
            && !zero(trace_id)
            && hex(span_id, 16)
            && !zero(span_id)
            && hex(flags, 2)
            && (version != "00" || parts.next().is_none());
        if !valid {
            return None;
        }
        let printable = |s: &str| s.bytes().all(|b| (0x20..=0x7e).contains(&b));
        let tracestate = tracestate
            .map(str::trim)
            .filter(|s| !s.is_empty() && s.len() <= TRACESTATE_MAX && printable(s))
            .map(str::to_owned);
        Some(Self {
            traceparent: format!("00-{trace_id}-{span_id}-{flags}"),
            tracestate,
        })
    }

    /// The context a message carries in its `traceparent`/`tracestate` headers.
    pub(crate) fn from_properties(properties: &BasicProperties) -> Option<Self> {
        let traceparent = headers::text(properties, TRACEPARENT)?;
        Self::parse(
            &traceparent,
            headers::text(properties, TRACESTATE).as_deref(),
        )
    }

    /// The `traceparent` value.
    pub(crate) fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The `tracestate` value, if any.
    #[cfg(any(test, feature = "otel"))]
    pub(crate) fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The trace id: 32 lower-case hex digits.
    pub(crate) fn trace_id(&self) -> &str {
        &self.traceparent[3..35]
    }

    /// The parent span's id: 16 lower-case hex digits.
    #[cfg(any(test, feature = "otel"))]
    pub(crate) fn span_id(&self) -> &str {
        &self.traceparent[36..52]
    }

    /// The headers that carry this context: `traceparent`, and `tracestate` if any.
    pub(crate) fn headers(&self) -> impl Iterator<Item = (&'static str, &str)> {
        let state = self.tracestate.as_deref().map(|s| (TRACESTATE, s));
        std::iter::once((TRACEPARENT, self.traceparent.as_str())).chain(state)
    }
}

/// `properties` carrying `context` in place of the trace headers they had; without a
/// context, without trace headers (a `traceparent` that did not parse is not passed on).
pub(crate) fn with_context(
    properties: BasicProperties,
    context: Option<&TraceContext>,
) -> BasicProperties {
    let had_trace = properties.headers().as_ref().is_some_and(|h| {
        let h = h.inner();
        h.contains_key(TRACEPARENT) || h.contains_key(TRACESTATE)
    });
    if context.is_none() && !had_trace {
        return properties;
    }
    let mut table = FieldTable::default();
    for (name, value) in properties.headers().iter().flat_map(|h| h.inner()) {
        if name.as_str() != TRACEPARENT && name.as_str() != TRACESTATE {
            table.insert(name.clone(), value.clone());
        }
    }
    for (name, value) in context.iter().flat_map(|cx| cx.headers()) {
        table.insert(
            ShortString::from(name),
            AMQPValue::LongString(LongString::from(value)),
        );
    }
    properties.with_headers(table)
}

/// Makes `span` (not yet entered) continue `incoming`, or start a trace of its own
/// when there is none, and names it for OpenTelemetry (`otel.name`, `otel.kind`, which
/// the span must declare). Returns whether an OpenTelemetry layer is installed (one
/// behind a per-layer filter counts, even if the filter then drops the span); without
/// one, or without the feature `otel`, nothing is done.
pub(crate) fn continue_trace(
    span: &Span,
    incoming: Option<&TraceContext>,
    name: &str,
    kind: &'static str,
) -> bool {
    #[cfg(feature = "otel")]
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let parent = incoming.map(otel::remote).unwrap_or_default();
        if span.set_parent(parent).is_err() {
            return false;
        }
        self::name(span, name, kind);
        true
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = (span, incoming, name, kind);
        false
    }
}

/// Links `span` to each of `others` (OpenTelemetry span links): a batch's span to the
/// spans of the messages it handled, which are in other traces. Nothing without an
/// OpenTelemetry layer.
pub(crate) fn link(span: &Span, others: &[Span]) {
    #[cfg(feature = "otel")]
    {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        for other in others {
            span.add_link(other.context().span().span_context().clone());
        }
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = (span, others);
    }
}

/// Names `span` for OpenTelemetry (`otel.name`, `otel.kind`, which the span must
/// declare); the fields show in logs too, so call it only when a layer records spans.
#[cfg(any(feature = "otel", feature = "http"))]
pub(crate) fn name(span: &Span, name: &str, kind: &'static str) {
    span.record("otel.name", name);
    span.record("otel.kind", kind);
}

/// Sets an attribute on `span`'s OpenTelemetry span (not a log field): messaging
/// conventions and idem's own. Nothing without an OpenTelemetry layer.
pub(crate) fn attribute(span: &Span, key: &'static str, value: impl Into<AttributeValue>) {
    #[cfg(feature = "otel")]
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let value: opentelemetry::Value = match value.into() {
            AttributeValue::Text(s) => s.into(),
            AttributeValue::Int(i) => i.into(),
            AttributeValue::Bool(b) => b.into(),
        };
        span.set_attribute(key, value);
    }
    #[cfg(not(feature = "otel"))]
    {
        // Not converted: without the feature, an attribute costs nothing.
        let _ = (span, key, value);
    }
}

/// The OpenTelemetry messaging attributes of a RabbitMQ consumer span.
pub(crate) fn consumer_attributes(
    span: &Span,
    queue: &str,
    operation: &str,
    delivery: &lapin::message::Delivery,
) {
    attribute(span, "messaging.system", "rabbitmq");
    attribute(span, "messaging.operation.name", "process");
    attribute(span, "messaging.operation.type", "process");
    attribute(span, "messaging.destination.name", queue);
    let tag = i64::try_from(delivery.delivery_tag).unwrap_or(i64::MAX);
    attribute(span, "messaging.rabbitmq.message.delivery_tag", tag);
    let properties = &delivery.properties;
    if let Some(id) = properties.message_id() {
        attribute(span, "messaging.message.id", id.as_str());
    }
    if let Some(id) = properties.correlation_id() {
        attribute(span, "messaging.message.conversation_id", id.as_str());
    }
    let size = i64::try_from(delivery.data.len()).unwrap_or(i64::MAX);
    attribute(span, "messaging.message.body.size", size);
    attribute(span, "idem.operation", operation);
}

/// Marks `span` as failed for OpenTelemetry, saying why.
pub(crate) fn error_status(span: &Span, why: &str) {
    #[cfg(feature = "otel")]
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        span.set_status(opentelemetry::trace::Status::error(why.to_owned()));
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = (span, why);
    }
}

/// An attribute value, so that callers need not name OpenTelemetry's types (which
/// exist only with the feature).
#[derive(Debug)]
#[cfg_attr(not(feature = "otel"), allow(dead_code))]
pub(crate) enum AttributeValue {
    Text(String),
    Int(i64),
    Bool(bool),
}

impl From<&str> for AttributeValue {
    fn from(s: &str) -> Self {
        AttributeValue::Text(s.to_owned())
    }
}

impl From<String> for AttributeValue {
    fn from(s: String) -> Self {
        AttributeValue::Text(s)
    }
}

impl From<i64> for AttributeValue {
    fn from(i: i64) -> Self {
        AttributeValue::Int(i)
    }
}

impl From<bool> for AttributeValue {
    fn from(b: bool) -> Self {
        AttributeValue::Bool(b)
    }
}

/// The context to send on from inside `span`: the span's own when an OpenTelemetry
/// layer records it (the next hop becomes its child), otherwise `incoming` unchanged.
pub(crate) fn outgoing(span: &Span, incoming: Option<&TraceContext>) -> Option<TraceContext> {
    #[cfg(feature = "otel")]
    if let Some(own) = otel::of_span(span) {
        return Some(own);
    }
    let _ = span;
    incoming.cloned()
}

/// Whether a span under `enclosing` should be its child rather than continue
/// `incoming`: when `enclosing` is recorded by OpenTelemetry and is in the incoming
/// trace already (it continued it), or there is no incoming trace to continue.
#[cfg(feature = "http")]
pub(crate) fn stays_under(enclosing: &Span, incoming: Option<&TraceContext>) -> bool {
    match (outgoing(enclosing, None), incoming) {
        (None, _) => false,
        (Some(_), None) => true,
        (Some(own), Some(incoming)) => own.trace_id() == incoming.trace_id(),
    }
}

/// The trace id a record keeps for work done in `span`: its OpenTelemetry trace (which
/// is `incoming`'s, or a new one when there was none), otherwise `incoming`'s.
pub(crate) fn trace_id(span: &Span, incoming: Option<&TraceContext>) -> Option<String> {
    outgoing(span, incoming).map(|cx| cx.trace_id().to_owned())
}

#[cfg(feature = "otel")]
mod otel {
    use opentelemetry::Context;
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing::Span;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::TraceContext;

    /// The OpenTelemetry context of a remote parent.
    pub(super) fn remote(cx: &TraceContext) -> Context {
        let flags = u8::from_str_radix(&cx.traceparent[53..55], 16).unwrap_or(0);
        let state = cx
            .tracestate()
            .and_then(|s| s.parse::<TraceState>().ok())
            .unwrap_or_default();
        let span = SpanContext::new(
            TraceId::from_hex(cx.trace_id()).unwrap_or(TraceId::INVALID),
            SpanId::from_hex(cx.span_id()).unwrap_or(SpanId::INVALID),
            TraceFlags::new(flags),
            true,
            state,
        );
        Context::new().with_remote_span_context(span)
    }

    /// `span`'s own context, when an OpenTelemetry layer records it.
    pub(super) fn of_span(span: &Span) -> Option<TraceContext> {
        let cx = span.context();
        let sc = cx.span().span_context().clone();
        if !sc.is_valid() {
            return None;
        }
        let traceparent = format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        );
        let state = sc.trace_state().header();
        TraceContext::parse(&traceparent, Some(&state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_parses_and_names_its_ids() {
        let cx = TraceContext::parse(TP, Some("congo=t61rcWkgMzE")).unwrap();
        assert_eq!(cx.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(cx.span_id(), "00f067aa0ba902b7");
        assert_eq!(cx.tracestate(), Some("congo=t61rcWkgMzE"));
        // A later version may carry more fields: passed on as version 00, without
        // them, however long they were.
        let future = format!("01{}-{}", &TP[2..], "x".repeat(100_000));
        let cx = TraceContext::parse(&future, None).unwrap();
        assert_eq!(cx.traceparent(), TP);
        assert_eq!(
            TraceContext::parse(&TP.replacen("00", "cc", 1), None)
                .unwrap()
                .traceparent(),
            TP
        );
        // Not a field separator after the flags: not a traceparent.
        assert_eq!(TraceContext::parse(&format!("01{}x", &TP[2..]), None), None);
    }

    #[test]
    fn a_broken_traceparent_is_dropped() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad, None), None, "{bad:?}");
        }
    }

    #[test]
    fn a_tracestate_that_is_too_long_or_not_ascii_is_dropped() {
        let long = "a=".to_owned() + &"b".repeat(TRACESTATE_MAX);
        assert_eq!(
            TraceContext::parse(TP, Some(&long)).unwrap().tracestate(),
            None
        );
        assert_eq!(
            TraceContext::parse(TP, Some("a=ü")).unwrap().tracestate(),
            None
        );
        // Control characters (a NUL that jsonb refuses, a line break) are not passed on.
        for hostile in ["a=1\0", "a=1\r\nb=2", "a=\u{1b}[2J"] {
            let cx = TraceContext::parse(TP, Some(hostile)).unwrap();
            assert_eq!(cx.tracestate(), None, "{hostile:?}");
        }
        assert_eq!(
            TraceContext::parse(TP, Some("a=1,b=2"))
                .unwrap()
                .tracestate(),
            Some("a=1,b=2")
        );
    }

    #[test]
    fn the_context_travels_in_amqp_headers() {
        let cx = TraceContext::parse(TP, Some("a=1")).unwrap();
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("tenant"),
            AMQPValue::LongString("acme".into()),
        );
        headers.insert(
            ShortString::from(TRACESTATE),
            AMQPValue::LongString("old".into()),
        );
        let properties = with_context(BasicProperties::default().with_headers(headers), Some(&cx));
        assert_eq!(TraceContext::from_properties(&properties), Some(cx));
        assert_eq!(
            headers::text(&properties, "tenant").as_deref(),
            Some("acme")
        );
        // A context without tracestate removes a stale one.
        let bare = TraceContext::parse(TP, None).unwrap();
        let properties = with_context(properties, Some(&bare));
        assert_eq!(headers::text(&properties, TRACESTATE), None);
        // No context: no trace headers, a broken one is not passed on.
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from(TRACEPARENT),
            AMQPValue::LongString("00-bad".into()),
        );
        let broken = BasicProperties::default().with_headers(headers);
        assert_eq!(TraceContext::from_properties(&broken), None);
        let properties = with_context(broken, None);
        assert_eq!(headers::text(&properties, TRACEPARENT), None);
    }
}
