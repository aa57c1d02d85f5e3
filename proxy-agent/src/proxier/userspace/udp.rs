//! A UDP frontend: one session per client address, each with its own socket connected to
//! the endpoint picked for it; replies go back from the frontend's socket, so the client
//! sees the service address. A session ends after `idle` without traffic, or when its
//! endpoint is gone (the next datagram picks again).
//!
//! Sessions are bounded, as every client address (spoofed ones too) costs a socket, a task
//! and a 64 KiB buffer: at most [`SESSIONS_PER_FRONTEND`] per frontend and
//! [`SESSIONS_TOTAL`] over all of them ([`UdpBudget`]). At either cap a new client takes the
//! place of the frontend's least recently active session (evicted, counted); a frontend
//! without sessions of its own gets none while the total is reached (refused, counted), so a
//! flood at one frontend never closes another's sessions.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use tokio::{net::UdpSocket, sync::Notify};
use tracing::debug;

use super::{
    balancer::{endpoint_gone, Balancer},
    sockets, Sources,
};

/// The largest datagram (a whole reassembled IPv4 or IPv6 one).
const MAX_DATAGRAM: usize = 65_536;

/// Sessions one frontend keeps at most.
pub const SESSIONS_PER_FRONTEND: usize = 1024;
/// Sessions all UDP frontends keep at most together (4096 × 64 KiB buffers: 256 MiB).
pub const SESSIONS_TOTAL: usize = 4096;

/// The sessions of every UDP frontend of the proxier, counted against their caps.
#[derive(Debug)]
pub struct UdpBudget {
    per_frontend: usize,
    total: usize,
    open: AtomicUsize,
    evicted: AtomicU64,
    refused: AtomicU64,
}

impl Default for UdpBudget {
    fn default() -> Self {
        Self::new(SESSIONS_PER_FRONTEND, SESSIONS_TOTAL)
    }
}

impl UdpBudget {
    pub fn new(per_frontend: usize, total: usize) -> Self {
        Self {
            per_frontend,
            total,
            open: AtomicUsize::new(0),
            evicted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// Sessions open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// The cap over all frontends.
    pub fn limit(&self) -> usize {
        self.total
    }

    /// Sessions closed to make room for a new client, since start.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// New clients given no session because the total was reached, since start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

struct Session {
    endpoint: SocketAddr,
    upstream: Arc<UdpSocket>,
    last_from_client: Mutex<Instant>,
    /// Told when the session was evicted: its reply task ends, closing the socket.
    evicted: Notify,
}

type Sessions = Arc<Mutex<HashMap<SocketAddr, Arc<Session>>>>;

/// What one frontend's sessions share.
#[derive(Clone)]
struct Frontend {
    socket: Arc<UdpSocket>,
    sessions: Sessions,
    idle: Duration,
    budget: Arc<UdpBudget>,
}

pub async fn serve(
    socket: UdpSocket,
    balancer: Arc<Balancer>,
    sources: Sources,
    idle: Duration,
    budget: Arc<UdpBudget>,
) {
    let frontend = Frontend {
        socket: Arc::new(socket),
        sessions: Arc::default(),
        idle,
        budget,
    };
    let (socket, sessions) = (frontend.socket.clone(), frontend.sessions.clone());
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let (n, client) = match socket.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                debug!("receiving on {:?}: {e}", socket.local_addr());
                continue;
            }
        };
        let existing = sessions
            .lock()
            .expect("not poisoned")
            .get(&client)
            .filter(|s| balancer.is_live(s.endpoint))
            .cloned();
        let session = match existing {
            Some(s) => s,
            None => match open(&frontend, client, &balancer, &sources) {
                Some(s) => s,
                None => continue,
            },
        };
        *session.last_from_client.lock().expect("not poisoned") = Instant::now();
        balancer.count(session.endpoint, 0, n as u64);
        if let Err(e) = session.upstream.send(&buf[..n]).await {
            debug!(%client, "forwarding a datagram: {e}");
        }
    }
}

/// Makes room for one more session of this frontend: true when there is (evicting its least
/// recently active session at a cap), false when the total is reached and this frontend has
/// none to give up.
fn make_room(sessions: &Sessions, budget: &UdpBudget) -> bool {
    let mut all = sessions.lock().expect("not poisoned");
    let at_cap = all.len() >= budget.per_frontend || budget.open() >= budget.total;
    if !at_cap {
        return true;
    }
    let oldest = all
        .iter()
        .min_by_key(|(_, s)| *s.last_from_client.lock().expect("not poisoned"))
        .map(|(client, _)| *client);
    let Some(oldest) = oldest else {
        budget.refused.fetch_add(1, Ordering::Relaxed);
        return false;
    };
    if let Some(session) = all.remove(&oldest) {
        budget.open.fetch_sub(1, Ordering::Relaxed);
        budget.evicted.fetch_add(1, Ordering::Relaxed);
        session.evicted.notify_one();
    }
    true
}

fn open(
    frontend: &Frontend,
    client: SocketAddr,
    balancer: &Arc<Balancer>,
    sources: &Sources,
) -> Option<Arc<Session>> {
    let endpoint = balancer.pick(client.ip(), Instant::now())?;
    let (sessions, budget) = (&frontend.sessions, &frontend.budget);
    // The client's own stale session (its endpoint left) gives up its place first, so it is
    // not counted against the cap and no other client is evicted for it.
    let stale = sessions.lock().expect("not poisoned").remove(&client);
    if let Some(old) = stale {
        budget.open.fetch_sub(1, Ordering::Relaxed);
        old.evicted.notify_one();
    }
    if !make_room(sessions, budget) {
        debug!(%client, "UDP session refused: the sessions of all frontends are at their cap");
        return None;
    }
    let upstream =
        sockets::upstream(endpoint, sources.for_endpoint(endpoint), false).and_then(|s| {
            s.connect(&endpoint.into())?;
            UdpSocket::from_std(s.into())
        });
    let upstream = match upstream {
        Ok(u) => Arc::new(u),
        Err(e) => {
            debug!(%client, %endpoint, "opening a UDP session: {e}");
            return None;
        }
    };
    let session = Arc::new(Session {
        endpoint,
        upstream,
        last_from_client: Mutex::new(Instant::now()),
        evicted: Notify::new(),
    });
    let replaced = sessions
        .lock()
        .expect("not poisoned")
        .insert(client, session.clone());
    if let Some(old) = replaced {
        // Raced in since the removal above: it ends, and its place is this one.
        old.evicted.notify_one();
        budget.open.fetch_sub(1, Ordering::Relaxed);
    }
    budget.open.fetch_add(1, Ordering::Relaxed);
    balancer.count(endpoint, 1, 0);
    tokio::spawn(replies(
        frontend.clone(),
        session.clone(),
        client,
        endpoint,
        balancer.clone(),
    ));
    Some(session)
}

/// Sends the endpoint's replies to the client until the session ends, then forgets it.
async fn replies(
    frontend: Frontend,
    session: Arc<Session>,
    client: SocketAddr,
    endpoint: SocketAddr,
    balancer: Arc<Balancer>,
) {
    let mut live = balancer.watch_live();
    let Frontend {
        socket,
        sessions,
        idle,
        budget,
    } = frontend;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut last_reply = Instant::now();
    loop {
        let since_client = session
            .last_from_client
            .lock()
            .expect("not poisoned")
            .elapsed();
        let quiet = since_client.min(last_reply.elapsed());
        let Some(wait) = idle.checked_sub(quiet).filter(|w| !w.is_zero()) else {
            break;
        };
        tokio::select! {
            received = tokio::time::timeout(wait, session.upstream.recv(&mut buf)) => match received {
                Ok(Ok(n)) => {
                    last_reply = Instant::now();
                    balancer.count(endpoint, 0, n as u64);
                    if let Err(e) = socket.send_to(&buf[..n], client).await {
                        debug!(%client, "returning a datagram: {e}");
                    }
                }
                // The endpoint's port is closed (ICMP): the client's datagrams are lost
                // as they would be without us.
                Ok(Err(e)) => debug!(%client, %endpoint, "UDP session: {e}"),
                Err(_) => {}
            },
            () = endpoint_gone(&mut live, endpoint) => break,
            () = session.evicted.notified() => break,
        }
    }
    let mut all = sessions.lock().expect("not poisoned");
    if all.get(&client).is_some_and(|s| Arc::ptr_eq(s, &session)) {
        all.remove(&client);
        budget.open.fetch_sub(1, Ordering::Relaxed);
    }
}
