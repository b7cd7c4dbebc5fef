//! A TCP proxy in front of Postgres that a test can cut and restore: the worker behind
//! it sees what a stopped server looks like (open connections broken, new ones
//! refused), while the real server keeps serving every other test.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::JoinSet;

pub struct Proxy {
    /// The port clients connect to.
    pub port: u16,
    target: SocketAddr,
    running: Mutex<Option<Running>>,
}

struct Running {
    accept: tokio::task::JoinHandle<()>,
    connections: Arc<Mutex<JoinSet<()>>>,
}

impl Proxy {
    /// Listens on a free local port and forwards every connection to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let proxy = Self {
            port,
            target,
            running: Mutex::new(None),
        };
        *proxy.running.lock().await = Some(serve(listener, target));
        proxy
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
            *running = Some(serve(listener, self.target));
        }
    }
}

fn serve(listener: TcpListener, target: SocketAddr) -> Running {
    let connections = Arc::new(Mutex::new(JoinSet::new()));
    let tracked = connections.clone();
    let accept = tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                continue;
            };
            tracked.lock().await.spawn(async move {
                if let Ok(mut server) = TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    Running {
        accept,
        connections,
    }
}
