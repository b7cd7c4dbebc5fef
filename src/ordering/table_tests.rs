use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use super::stored_properties;

#[test]
fn properties_not_set_are_left_out() {
    let none = stored_properties(&BasicProperties::default()).unwrap();
    assert_eq!(none, b"{}");
    let persistent = BasicProperties::default().with_delivery_mode(2);
    let kept = stored_properties(&persistent).unwrap();
    assert_eq!(kept, br#"{"delivery_mode":2}"#);
}

#[test]
fn kept_properties_read_back_the_same() {
    let mut headers = FieldTable::default();
    headers.insert("idem-replays".into(), AMQPValue::LongLongInt(1));
    headers.insert("type".into(), AMQPValue::LongString("orders.paid".into()));
    let properties = BasicProperties::default()
        .with_message_id("m-1".into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_headers(headers);
    let kept = stored_properties(&properties).unwrap();
    let back: BasicProperties = serde_json::from_slice(&kept).unwrap();
    assert_eq!(back, properties);
}

#[test]
fn rows_kept_with_every_field_still_read_back() {
    // Rows parked before unset properties were left out name all fourteen.
    let properties = BasicProperties::default().with_delivery_mode(2);
    let full = serde_json::to_vec(&properties).unwrap();
    assert!(full.len() > 200, "{}", String::from_utf8_lossy(&full));
    let back: BasicProperties = serde_json::from_slice(&full).unwrap();
    assert_eq!(back, properties);
}
