//! A publisher for the drills: confirms every message, and when the broker does not
//! (a dropped connection, a node killed, a broker restarting), reconnects to the first
//! node of the list that answers and publishes again, as a careful producer does. A
//! broker that never answered, or stopped answering for [`GIVE_UP_AFTER`], is an error
//! (a wrong `--amqp-url` fails the drill at once, not by hanging).

use std::time::{Duration, Instant};

use anyhow::anyhow;

use lapin::options::ConfirmSelectOptions;
use lapin::{BasicProperties, Channel, Connection};

/// How long a publish tries again after the broker answered once: longer than a broker
/// restart or a cluster node's loss take in the drills.
const GIVE_UP_AFTER: Duration = Duration::from_secs(120);

/// Publishes until the broker confirms; counts the messages it had to publish again.
pub struct Publisher {
    url: String,
    name: String,
    channel: Option<(Connection, Channel)>,
    /// Whether the broker answered once (before, a connection error is the answer).
    answered: bool,
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
            answered: false,
            republished: 0,
        }
    }

    /// Publishes `body` persistently to `queue` with a fresh message id, again and
    /// again until it is confirmed; an error when the broker never answered, or has not
    /// for [`GIVE_UP_AFTER`].
    pub async fn publish(&mut self, queue: &str, body: &[u8]) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            if self.channel.is_none() {
                match self.open().await {
                    Ok(channel) => {
                        self.channel = Some(channel);
                        self.answered = true;
                    }
                    Err(error) if !self.answered || started.elapsed() > GIVE_UP_AFTER => {
                        return Err(anyhow!(
                            "the broker at {} does not answer: {}",
                            self.url,
                            idem::text::error_line(&error)
                        ));
                    }
                    Err(_) => {}
                }
            }
            if let Some((_, channel)) = &self.channel {
                let message_id = uuid::Uuid::new_v4().to_string();
                let properties =
                    BasicProperties::default().with_message_id(message_id.as_str().into());
                match idem::topology::publish_confirmed(channel, queue, body, properties).await {
                    Ok(()) => return Ok(()),
                    Err(error) if started.elapsed() > GIVE_UP_AFTER => {
                        return Err(anyhow!(
                            "the broker at {} does not confirm: {}",
                            self.url,
                            idem::text::error_line(&error)
                        ));
                    }
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

    async fn open(&self) -> Result<(Connection, Channel), lapin::Error> {
        let connection = idem::topology::connect(&self.url, &self.name).await?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok((connection, channel))
    }

    /// Closes the connection.
    pub async fn close(&mut self) {
        if let Some((connection, channel)) = self.channel.take() {
            let _ = channel.close(200, "done".into()).await;
            let _ = connection.close(200, "done".into()).await;
        }
    }
}
