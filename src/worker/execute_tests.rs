use super::*;
use crate::WorkerConfig;

/// A handler whose call holds 64 KB across an await, as a large one may.
struct Large;

impl Handler for Large {
    type Message = serde_json::Value;
    type Output = ();
    const OPERATION: &'static str = "tests.large";

    fn scope(&self, _: &serde_json::Value) -> String {
        "tests".into()
    }

    fn idempotency_key(&self, message: &serde_json::Value) -> String {
        message["id"].to_string()
    }

    async fn handle(
        &self,
        _: serde_json::Value,
        _: &mut crate::Context,
    ) -> Result<(), crate::HandlerError> {
        let buffer = [7u8; 65_536];
        tokio::task::yield_now().await;
        assert_eq!(buffer[65_535], 7);
        Ok(())
    }
}

/// Every delivery's future is boxed and moved (copied) on its way to its task: it
/// must not grow with the handler's, nor hold the run twice (it was 65,840 bytes for
/// the accounts example, whose handler's call is 26 KB, with the run stored both as
/// `marked_if_long`'s argument and as its pinned local).
#[tokio::test]
async fn a_deliverys_walk_does_not_hold_the_handlers_call() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://nobody@127.0.0.1:1/none")
        .expect("a lazy pool parses its URL");
    let store = crate::Store::new(pool, crate::StoreConfig::default());
    let config = WorkerConfig {
        single_active_consumer: true,
        ..WorkerConfig::default()
    };
    let runtime = Runtime::new(Large, store, config, None, Default::default(), None);
    let envelope = Envelope {
        exchange: String::new(),
        routing_key: "tests".into(),
        redelivered: false,
        properties: Default::default(),
    };
    let incoming = Incoming::new(br#"{"id": 1}"#, envelope, None);
    // Made, not run: its size is its type's.
    let walking = walk(&runtime, &incoming);
    let size = std::mem::size_of_val(&walking);
    assert!(size < 16 * 1024, "a delivery's walk is {size} bytes");
}

#[test]
fn log_durations_are_rounded_to_a_tenth_of_a_millisecond() {
    assert_eq!(rounded_ms(Duration::from_nanos(10_247_793)), 10.2);
    assert_eq!(rounded_ms(Duration::from_micros(1_950)), 2.0);
}
