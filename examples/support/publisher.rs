//! A publisher for the drills: confirms every message, and when the broker does not
//! (a dropped connection, a node killed, a broker restarting), reconnects to the first
//! node of the list that answers and publishes again, as a careful producer does.

use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
use lapin::{BasicProperties, Channel, Connection};

/// Publishes until the broker confirms; counts the messages it had to publish again.
pub struct Publisher {
    url: String,
    name: String,
    channel: Option<(Connection, Channel)>,
    /// Messages published again after an error (each a possible duplicate).
    pub republished: usize,
}

impl Publisher {
    /// A publisher to `url` (one node, or a comma-separated list), shown as `name`.
    pub fn new(url: &str, name: &str) -> Self {
        Self {
            url: url.to_owned(),
            name: name.to_owned(),
            channel: None,
            republished: 0,
        }
    }

    /// Publishes `body` persistently to `queue` with a fresh message id, again and
    /// again until it is confirmed.
    pub async fn publish(&mut self, queue: &str, body: &[u8]) {
        loop {
            if self.channel.is_none()
                && let Ok(connection) = idem::topology::connect(&self.url, &self.name).await
                && let Ok(channel) = connection.create_channel().await
                && channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .is_ok()
            {
                self.channel = Some((connection, channel));
            }
            if let Some((_, channel)) = &self.channel {
                let message_id = uuid::Uuid::new_v4().to_string();
                let properties =
                    BasicProperties::default().with_message_id(message_id.as_str().into());
                match idem::topology::publish_confirmed(channel, queue, body, properties).await {
                    Ok(()) => return,
                    Err(_) => {
                        // Unknown whether it landed: publish again (a duplicate at worst).
                        self.channel = None;
                        self.republished += 1;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Closes the connection.
    pub async fn close(&mut self) {
        if let Some((connection, channel)) = self.channel.take() {
            let _ = channel.close(200, "done".into()).await;
            let _ = connection.close(200, "done".into()).await;
        }
    }
}
