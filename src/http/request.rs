//! What the layer reads of a request before it claims: whether it needs a key, the
//! key header, the operation, the body (within its limit) and the fingerprint.

use axum::body::{Body, Bytes};
use axum::extract::MatchedPath;
use axum::http::{HeaderMap, Method, Uri, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::IDEMPOTENCY_KEY;
use crate::fingerprint::Fingerprint;
use crate::protect::Keys;
use crate::trace::{TRACEPARENT, TRACESTATE, TraceContext};

/// GET, HEAD, OPTIONS and TRACE change nothing and need no key.
pub(super) fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// The key header's value: `None` when absent. The draft's form is a structured-field
/// string (`"abc"`); a bare token is accepted too.
pub(super) fn key_header(headers: &HeaderMap) -> Result<Option<String>, String> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err("the request has more than one Idempotency-Key header".into());
    }
    let text = value
        .to_str()
        .map_err(|_| "the Idempotency-Key header is not visible ASCII".to_string())?;
    let text = text.trim();
    let unquoted = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(text);
    Ok(Some(unquoted.to_owned()))
}

/// The operation: method and matched route (`POST /payments/{id}`), or the path when
/// the layer is outside a router.
pub(super) fn operation_of(parts: &axum::http::request::Parts) -> String {
    format!("{} {}", parts.method, route_of(parts))
}

/// The label of the request's metrics: its operation when a route matched, else the
/// method and `(unmatched)`: raw paths would make a label each.
pub(super) fn label_of(parts: &axum::http::request::Parts) -> String {
    match parts.extensions.get::<MatchedPath>() {
        Some(route) => format!("{} {}", parts.method, route.as_str()),
        None => format!("{} (unmatched)", parts.method),
    }
}

pub(super) fn route_of(parts: &axum::http::request::Parts) -> &str {
    parts
        .extensions
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
        .unwrap_or_else(|| parts.uri.path())
}

/// The W3C trace context the request carries (`traceparent`, `tracestate`), if valid.
pub(super) fn trace_context(headers: &HeaderMap) -> Option<TraceContext> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    TraceContext::parse(text(TRACEPARENT)?, text(TRACESTATE))
}

/// The request's correlation id, kept on a new record for inspection.
pub(super) fn correlation_id(headers: &HeaderMap) -> Option<String> {
    ["x-correlation-id", "x-request-id"]
        .iter()
        .find_map(|name| headers.get(*name)?.to_str().ok())
        .map(|id| crate::store::storable(id).into_owned())
}

/// The fingerprint of a request: its target (path and query) and its body, as
/// canonical JSON when it is JSON, else as the SHA-256 of its bytes.
pub(super) fn fingerprint(
    uri: &Uri,
    body: &[u8],
    volatile: &[String],
    keys: Option<&Keys>,
) -> Fingerprint {
    let target = uri.path_and_query().map_or("/", |p| p.as_str());
    let payload = if body.is_empty() {
        json!({ "target": target })
    } else {
        match serde_json::from_slice::<Value>(body) {
            Ok(body) => json!({ "target": target, "body": body }),
            Err(_) => json!({ "target": target, "body_sha256": hex::encode(Sha256::digest(body)) }),
        }
    };
    let volatile: Vec<&str> = volatile.iter().map(String::as_str).collect();
    Fingerprint::keyed(&payload, &volatile, keys)
}

/// Why a body was not read.
pub(super) enum Unread {
    /// Over the limit.
    TooLarge,
    /// The body could not be read.
    Broken(String),
}

/// Reads a body whole, refusing more than `limit` bytes (at once when its declared
/// length says so).
pub(super) async fn read_limited(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
) -> Result<Bytes, Unread> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Unread::TooLarge);
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(Unread::TooLarge),
        Err(error) => Err(Unread::Broken(error.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn a_request_no_route_matched_is_labelled_by_its_method_only() {
        let (parts, _) = axum::http::Request::post("/made/up/path-123")
            .body(())
            .unwrap()
            .into_parts();
        assert_eq!(label_of(&parts), "POST (unmatched)");
        assert_eq!(operation_of(&parts), "POST /made/up/path-123");
    }

    #[tokio::test]
    async fn a_streamed_body_is_cut_at_the_limit() {
        let chunks = |n: usize| {
            Body::from_stream(futures_util::stream::iter(
                (0..n).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 100]))),
            ))
        };
        let over = read_limited(chunks(10), &HeaderMap::new(), 500).await;
        assert!(matches!(over, Err(Unread::TooLarge)));
        let within = read_limited(chunks(5), &HeaderMap::new(), 500).await;
        assert!(matches!(within, Ok(bytes) if bytes.len() == 500));
        let mut declared = HeaderMap::new();
        declared.insert(header::CONTENT_LENGTH, HeaderValue::from(501));
        let refused = read_limited(Body::empty(), &declared, 500).await;
        assert!(matches!(refused, Err(Unread::TooLarge)));
    }

    #[test]
    fn the_key_header_may_be_a_structured_string_and_must_be_single() {
        let mut headers = HeaderMap::new();
        assert_eq!(key_header(&headers), Ok(None));
        headers.insert(IDEMPOTENCY_KEY, "\"8e03978e\"".parse().unwrap());
        assert_eq!(key_header(&headers), Ok(Some("8e03978e".into())));
        headers.insert(IDEMPOTENCY_KEY, " k-1 ".parse().unwrap());
        assert_eq!(key_header(&headers), Ok(Some("k-1".into())));
        headers.append(IDEMPOTENCY_KEY, "k-2".parse().unwrap());
        assert!(key_header(&headers).is_err());
    }

    #[test]
    fn the_fingerprint_covers_body_and_target_but_not_volatile_fields_or_layout() {
        let uri: Uri = "/payments".parse().unwrap();
        let a = fingerprint(
            &uri,
            br#"{"amount": 5, "sent_at": 1}"#,
            &["body.sent_at".into()],
            None,
        );
        let b = fingerprint(
            &uri,
            br#"{ "sent_at": 2,"amount":5 }"#,
            &["body.sent_at".into()],
            None,
        );
        assert_eq!(a, b);
        let other_amount = fingerprint(&uri, br#"{"amount": 6}"#, &[], None);
        assert_ne!(a, other_amount);
        let other_target = fingerprint(
            &"/payments?x=1".parse().unwrap(),
            br#"{"amount": 5}"#,
            &[],
            None,
        );
        assert_ne!(
            fingerprint(&uri, br#"{"amount": 5}"#, &[], None),
            other_target
        );
        // Not JSON: the bytes count.
        assert_ne!(
            fingerprint(&uri, b"a=1", &[], None),
            fingerprint(&uri, b"a=2", &[], None)
        );
        assert_eq!(
            fingerprint(&uri, b"a=1", &[], None),
            fingerprint(&uri, b"a=1", &[], None)
        );
    }
}
