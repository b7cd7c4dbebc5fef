//! A TCP proxy in front of Postgres (or RabbitMQ) that a test can cut and restore: the
//! worker behind it sees what a stopped server looks like (open connections broken, new
//! ones refused), while the real server keeps serving every other test. It can also
//! end every connection a while after it opened, as a server that keeps closing them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::JoinSet;

pub struct Proxy {
    /// The port clients connect to.
    pub port: u16,
    target: SocketAddr,
    running: Mutex<Option<Running>>,
    /// Each connection is ended this long after it was accepted, if set.
    lifetime: Option<Duration>,
    /// Connections accepted so far.
    accepted: Arc<AtomicUsize>,
}

struct Running {
    accept: tokio::task::JoinHandle<()>,
    connections: Arc<Mutex<JoinSet<()>>>,
}

impl Proxy {
    /// Listens on a free local port and forwards every connection to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        Self::start_with(target, None).await
    }

    /// Like [`Proxy::start`], but each connection is ended `lifetime` after it opened.
    pub async fn closing_after(target: SocketAddr, lifetime: Duration) -> Self {
        Self::start_with(target, Some(lifetime)).await
    }

    async fn start_with(target: SocketAddr, lifetime: Option<Duration>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let proxy = Self {
            port,
            target,
            running: Mutex::new(None),
            lifetime,
            accepted: Arc::new(AtomicUsize::new(0)),
        };
        *proxy.running.lock().await = Some(proxy.serve(listener));
        proxy
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Breaks every open connection and refuses new ones, as a stopped server does.
    pub async fn cut(&self) {
        if let Some(running) = self.running.lock().await.take() {
            running.accept.abort();
            let _ = running.accept.await;
            running.connections.lock().await.abort_all();
        }
    }

    /// Accepts connections again on the same port.
    pub async fn restore(&self) {
        let mut running = self.running.lock().await;
        if running.is_none() {
            let listener = TcpListener::bind(("127.0.0.1", self.port)).await.unwrap();
            *running = Some(self.serve(listener));
        }
    }
}

impl Proxy {
    fn serve(&self, listener: TcpListener) -> Running {
        let (target, lifetime) = (self.target, self.lifetime);
        let accepted = self.accepted.clone();
        let connections = Arc::new(Mutex::new(JoinSet::new()));
        let tracked = connections.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                accepted.fetch_add(1, Ordering::SeqCst);
                tracked.lock().await.spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        let copy = tokio::io::copy_bidirectional(&mut client, &mut server);
                        match lifetime {
                            Some(lifetime) => drop(tokio::time::timeout(lifetime, copy).await),
                            None => drop(copy.await),
                        }
                    }
                });
            }
        });
        Running {
            accept,
            connections,
        }
    }
}
