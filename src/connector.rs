//! A broker connection shared by whoever needs one: a service's queues consume on one,
//! and publish (retries, dead letters, follow-ups, the relay) on another. It is opened
//! by the first user that needs it and again by the first one to find it lost, so every
//! user reconnects on the same new connection, a channel each.

use std::sync::Arc;

use lapin::Connection;
use tokio::sync::Mutex;

use crate::topology;

/// How long closing the connection waits for the broker.
const CLOSE_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// One shared AMQP connection to `url`, named `name` on the broker.
pub(crate) struct Connector {
    url: String,
    name: String,
    current: Mutex<Option<Arc<Connection>>>,
}

impl Connector {
    pub(crate) fn new(url: &str, name: &str) -> Self {
        Self {
            url: url.to_owned(),
            name: name.to_owned(),
            current: Mutex::new(None),
        }
    }

    /// The connection, if it is still connected; else a new one. Sessions asking while
    /// one connects wait for it and share it.
    pub(crate) async fn get(&self) -> Result<Arc<Connection>, lapin::Error> {
        let mut current = self.current.lock().await;
        if let Some(connection) = current.as_ref()
            && connection.status().connected()
        {
            return Ok(connection.clone());
        }
        let connection = Arc::new(topology::connect(&self.url, &self.name).await?);
        *current = Some(connection.clone());
        Ok(connection)
    }

    /// Closes the connection, once no session uses it any more, waiting at most
    /// [`CLOSE_WITHIN`] for the broker's answer (a connection that went silent may
    /// never give one).
    pub(crate) async fn close(&self) {
        if let Some(connection) = self.current.lock().await.take() {
            let close = connection.close(200, "shutdown".into());
            let _ = tokio::time::timeout(CLOSE_WITHIN, close).await;
        }
    }
}
