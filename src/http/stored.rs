//! A response as the record keeps it (`result`), and the replay of it.
//!
//! The body is kept as text when it is UTF-8 and as hex otherwise, never as parsed
//! JSON: `jsonb` would reorder its keys, and a replay must be byte-identical to the
//! first answer.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The header that marks a replayed answer (IETF httpapi idempotency-key draft).
pub const IDEMPOTENCY_REPLAYED: &str = "idempotency-replayed";

/// What the record's `result` holds for an HTTP operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StoredResponse {
    /// The status code.
    pub(crate) status: u16,
    /// The headers on the allow-list, in their order, as `[name, value]`.
    pub(crate) headers: Vec<(String, String)>,
    /// The body, when it is UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) body: Option<String>,
    /// The body as hex, when it is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) body_hex: Option<String>,
}

/// Why a stored response cannot be replayed (a hand-edited or foreign record).
#[derive(Debug, thiserror::Error)]
#[error("the record's result is not a stored HTTP response: {0}")]
pub(crate) struct Unreadable(String);

impl StoredResponse {
    /// Keeps `status`, the headers named in `allowed` (header values that are not
    /// visible ASCII are left out) and `body`.
    pub(crate) fn new(
        status: StatusCode,
        headers: &HeaderMap,
        allowed: &[HeaderName],
        body: &[u8],
    ) -> Self {
        let headers = headers
            .iter()
            .filter(|(name, _)| allowed.contains(name))
            .filter_map(|(name, value)| match value.to_str() {
                Ok(value) => Some((name.as_str().to_owned(), value.to_owned())),
                Err(_) => {
                    tracing::warn!(header = %name, "a header that is not visible ASCII is not replayed");
                    None
                }
            })
            .collect();
        let (body, body_hex) = match std::str::from_utf8(body) {
            // Postgres text cannot hold NUL: such a body is kept as hex.
            Ok(text) if !text.contains('\0') => (Some(text.to_owned()), None),
            _ => (None, Some(hex::encode(body))),
        };
        Self {
            status: status.as_u16(),
            headers,
            body,
            body_hex,
        }
    }

    /// The record's `result`.
    pub(crate) fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Reads a record's `result` back.
    pub(crate) fn from_json(result: Option<Value>) -> Result<Self, Unreadable> {
        let value = result.ok_or_else(|| Unreadable("no result".into()))?;
        serde_json::from_value(value).map_err(|e| Unreadable(e.to_string()))
    }

    /// The body's bytes.
    fn body_bytes(&self) -> Result<Vec<u8>, Unreadable> {
        match (&self.body, &self.body_hex) {
            (Some(text), _) => Ok(text.clone().into_bytes()),
            (None, Some(hex_body)) => hex::decode(hex_body).map_err(|e| Unreadable(e.to_string())),
            (None, None) => Ok(Vec::new()),
        }
    }

    /// The answer again, marked `Idempotency-Replayed: true`.
    pub(crate) fn replay(&self) -> Result<Response, Unreadable> {
        let status = StatusCode::from_u16(self.status).map_err(|e| Unreadable(e.to_string()))?;
        let mut response = Response::new(Body::from(self.body_bytes()?));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        for (name, value) in &self.headers {
            let name =
                HeaderName::try_from(name.as_str()).map_err(|e| Unreadable(e.to_string()))?;
            let value =
                HeaderValue::try_from(value.as_str()).map_err(|e| Unreadable(e.to_string()))?;
            headers.append(name, value);
        }
        headers.insert(
            HeaderName::from_static(IDEMPOTENCY_REPLAYED),
            HeaderValue::from_static("true"),
        );
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::header;

    async fn bytes_of(response: Response) -> Vec<u8> {
        use http_body_util::BodyExt;
        let collected = response.into_body().collect().await;
        collected.map(|c| c.to_bytes().to_vec()).unwrap_or_default()
    }

    #[tokio::test]
    async fn a_replay_is_byte_identical_and_keeps_only_allowed_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            header::SET_COOKIE,
            HeaderValue::from_static("session=secret"),
        );
        headers.append(header::LINK, HeaderValue::from_static("</a>; rel=a"));
        headers.append(header::LINK, HeaderValue::from_static("</b>; rel=b"));
        // Keys out of order and spaces: jsonb would normalise both.
        let body = br#"{"z": 1,  "a": [2, 1]}"#;
        let allowed = [header::CONTENT_TYPE, header::LINK];
        let stored = StoredResponse::new(StatusCode::CREATED, &headers, &allowed, body);
        let read = StoredResponse::from_json(Some(stored.to_json())).unwrap();
        let replayed = read.replay().unwrap();
        assert_eq!(replayed.status(), StatusCode::CREATED);
        assert_eq!(replayed.headers()[IDEMPOTENCY_REPLAYED], "true");
        assert!(replayed.headers().get(header::SET_COOKIE).is_none());
        let links: Vec<_> = replayed.headers().get_all(header::LINK).iter().collect();
        assert_eq!(links, ["</a>; rel=a", "</b>; rel=b"]);
        assert_eq!(bytes_of(replayed).await, body);
    }

    #[tokio::test]
    async fn a_binary_body_round_trips_as_hex() {
        let body = [0u8, 159, 146, 150, b'\n'];
        let stored = StoredResponse::new(StatusCode::OK, &HeaderMap::new(), &[], &body);
        assert_eq!(stored.body, None);
        let read = StoredResponse::from_json(Some(stored.to_json())).unwrap();
        assert_eq!(bytes_of(read.replay().unwrap()).await, body);
    }

    #[test]
    fn a_foreign_result_is_unreadable_not_a_panic() {
        assert!(StoredResponse::from_json(None).is_err());
        assert!(StoredResponse::from_json(Some(serde_json::json!({"done": true}))).is_err());
        let bad_status = serde_json::json!({"status": 1000, "headers": []});
        let read = StoredResponse::from_json(Some(bad_status)).unwrap();
        assert!(read.replay().is_err());
    }
}
