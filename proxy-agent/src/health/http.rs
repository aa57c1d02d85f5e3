//! Serving HTTP to anyone who can reach a port, with bounds: every server the agent runs
//! (`/healthz` and `/livez`, `/metrics`, the health-check node ports) goes through [`serve`].
//!
//! * A request's header must arrive within [`HEADER_READ_TIMEOUT`], and a keep-alive
//!   connection may wait that long for its next request (hyper's header-read timer runs in
//!   both cases); a client that sends half a header and stalls is closed then.
//! * A header is at most [`MAX_HEADER_BYTES`] (hyper answers 431 beyond), and no handler
//!   reads a body, so nothing a client sends is buffered beyond that.
//! * At most `limit` connections are open per [`Connections`] budget. At the cap, the oldest
//!   connection that is not in the middle of a request (a stalled half header, or an idle
//!   keep-alive) is closed to make room; when every connection is busy answering, the new
//!   one is closed instead. The new one is served only once the closed one's descriptor is
//!   free (the closing runs on another worker thread). So a slowloris holds at most `limit`
//!   descriptors (and the one just accepted) and never starves a probe that sends its
//!   request at once.
//!
//! The agent raises its descriptor limit for the datapath; without these bounds a few
//! thousand stalled connections would exhaust memory and descriptors and make syncs fail.
//! Counts are exported as `proxy_agent_http_connections{server}` (open),
//! `proxy_agent_http_connection_limit{server}` and
//! `proxy_agent_http_connections_shed_total{server}`.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::TcpListener,
    sync::{oneshot, Semaphore},
};
use tower::ServiceExt;
use tracing::{debug, warn};

use crate::metrics::Metrics;

/// How long a request header (or a keep-alive connection's next one) may take to arrive.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest request header accepted (hyper's smallest read buffer is 8 KiB).
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// Connections open at once for the agent's own servers (health and metrics together).
pub const AGENT_CONNECTIONS: usize = 256;
/// Connections open at once over all health-check node ports together.
pub const NODE_PORT_CONNECTIONS: usize = 512;

/// One budget of open connections, shared by the servers given it.
#[derive(Clone)]
pub struct Connections {
    name: &'static str,
    limit: usize,
    header_read_timeout: Duration,
    table: Arc<Mutex<Table>>,
    /// One per open descriptor: released when a connection's stream is gone, which a
    /// connection closed to make room does some time after it is told to.
    descriptors: Arc<Semaphore>,
    metrics: Option<Arc<Metrics>>,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    /// By id, which is the order of arrival: the first idle one is the oldest.
    open: BTreeMap<u64, Open>,
}

struct Open {
    busy: Arc<AtomicBool>,
    close: Option<oneshot::Sender<()>>,
}

/// A connection's place in its budget; dropping it frees the place.
struct Admitted {
    id: u64,
    busy: Arc<AtomicBool>,
    closed: oneshot::Receiver<()>,
    connections: Connections,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let open = {
            let mut table = self.connections.table.lock().unwrap();
            table.open.remove(&self.id);
            table.open.len()
        };
        self.connections.report(open);
    }
}

impl Connections {
    /// A budget named `name` in the metrics (`agent`, `health-check-node-ports`).
    pub fn new(name: &'static str, limit: usize, metrics: Option<Arc<Metrics>>) -> Self {
        if let Some(m) = &metrics {
            m.http_connection_limit
                .with_label_values(&[name])
                .set(limit as i64);
        }
        Self {
            name,
            limit,
            header_read_timeout: HEADER_READ_TIMEOUT,
            table: Arc::default(),
            descriptors: Arc::new(Semaphore::new(limit)),
            metrics,
        }
    }

    /// The same budget with another header-read timeout (tests).
    pub fn with_header_read_timeout(mut self, timeout: Duration) -> Self {
        self.header_read_timeout = timeout;
        self
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.table.lock().unwrap().open.len()
    }

    fn report(&self, open: usize) {
        if let Some(m) = &self.metrics {
            m.http_connections
                .with_label_values(&[self.name])
                .set(open as i64);
        }
    }

    fn shed(&self) {
        if let Some(m) = &self.metrics {
            m.http_connections_shed
                .with_label_values(&[self.name])
                .inc();
        }
    }

    /// A place for a new connection, closing the oldest idle one at the cap; `None` when
    /// every open connection is busy.
    fn admit(&self) -> Option<Admitted> {
        let mut table = self.table.lock().unwrap();
        if table.open.len() >= self.limit {
            let oldest_idle = table
                .open
                .iter()
                .find(|(_, c)| !c.busy.load(Ordering::Relaxed))
                .map(|(id, _)| *id);
            let Some(id) = oldest_idle else {
                drop(table);
                self.shed();
                return None;
            };
            if let Some(mut open) = table.open.remove(&id) {
                if let Some(close) = open.close.take() {
                    let _ = close.send(());
                }
            }
            self.shed();
        }
        let id = table.next_id;
        table.next_id += 1;
        let busy = Arc::new(AtomicBool::new(false));
        let (close, closed) = oneshot::channel();
        table.open.insert(
            id,
            Open {
                busy: busy.clone(),
                close: Some(close),
            },
        );
        let open = table.open.len();
        drop(table);
        self.report(open);
        Some(Admitted {
            id,
            busy,
            closed,
            connections: self.clone(),
        })
    }
}

/// Marks its connection busy while a request is being answered.
struct BusyGuard(Arc<AtomicBool>);

impl BusyGuard {
    fn new(busy: &Arc<AtomicBool>) -> Self {
        busy.store(true, Ordering::Relaxed);
        Self(busy.clone())
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

/// Serves `app` on `listener` within the `connections` budget until the task is aborted.
pub async fn serve(listener: TcpListener, app: Router, connections: Connections) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors or memory: back off instead of spinning on the error.
                warn!(
                    server = connections.name,
                    "accepting an HTTP connection: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(mut admitted) = connections.admit() else {
            debug!(
                server = connections.name,
                "HTTP connection refused: every open connection is answering a request"
            );
            continue;
        };
        // At the cap, `admit` told the oldest idle connection to close; wait until it has.
        let Ok(descriptor) = connections.descriptors.clone().acquire_owned().await else {
            continue; // never closed
        };
        let app = app.clone();
        let header_read_timeout = connections.header_read_timeout;
        tokio::spawn(async move {
            let busy = admitted.busy.clone();
            let service = hyper::service::service_fn(move |request| {
                let guard = BusyGuard::new(&busy);
                let app = app.clone();
                async move {
                    let response = app.oneshot(request).await;
                    drop(guard);
                    response
                }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout)
                .max_buf_size(MAX_HEADER_BYTES)
                .keep_alive(true);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = connection => {}
                _ = &mut admitted.closed => {}
            }
            // The stream went with `connection`.
            drop(descriptor);
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn server(limit: usize, timeout: Duration) -> (std::net::SocketAddr, Connections) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/healthz", get(|| async { "ok" }));
        let connections = Connections::new("test", limit, None).with_header_read_timeout(timeout);
        tokio::spawn(serve(listener, app, connections.clone()));
        (addr, connections)
    }

    /// Reads until the peer closes (or `within` passes); true when it closed.
    async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 1024];
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, stream.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    }

    async fn get_healthz(addr: std::net::SocketAddr) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn a_stalled_half_header_and_an_idle_keep_alive_are_closed_after_the_timeout() {
        let (addr, _) = server(8, Duration::from_millis(300)).await;
        let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
        idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let n = idle.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
        assert!(
            closed_within(&mut half, Duration::from_secs(5)).await,
            "half header kept"
        );
        assert!(
            closed_within(&mut idle, Duration::from_secs(5)).await,
            "idle keep-alive kept"
        );
    }

    #[tokio::test]
    async fn at_the_cap_the_oldest_idle_connection_makes_room_for_a_request() {
        let (addr, connections) = server(4, Duration::from_secs(60)).await;
        let mut stalled = Vec::new();
        for _ in 0..4 {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /hea").await.unwrap();
            stalled.push(s);
        }
        while connections.open() < 4 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // A probe still gets its answer, long before the stalled ones time out.
        let answer = get_healthz(addr).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("ok"), "{answer}");
        // The one closed for it was the oldest.
        assert!(closed_within(&mut stalled[0], Duration::from_secs(2)).await);
        assert!(!closed_within(&mut stalled[3], Duration::from_millis(100)).await);
        assert!(connections.open() <= 4);
    }

    #[tokio::test]
    async fn a_header_beyond_the_bound_is_refused() {
        let (addr, _) = server(4, Duration::from_secs(60)).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let big = format!(
            "GET /healthz HTTP/1.1\r\nhost: x\r\nx-filler: {}\r\n\r\n",
            "a".repeat(MAX_HEADER_BYTES * 2)
        );
        // The server may close while the header is still being written.
        let _ = s.write_all(big.as_bytes()).await;
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        let out = String::from_utf8_lossy(&out);
        assert!(
            out.is_empty() || out.starts_with("HTTP/1.1 431"),
            "an oversized header was answered: {out}"
        );
        assert!(get_healthz(addr).await.starts_with("HTTP/1.1 200"));
    }
}
