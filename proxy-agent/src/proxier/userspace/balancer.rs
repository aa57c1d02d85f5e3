//! Where a frontend's new flows go: round robin over its serving endpoints, sticky per
//! client address under `sessionAffinity: ClientIP`, and only for clients its source ranges
//! admit. Shared by the frontend's listener (which picks) and the sync (which updates).

use std::{
    collections::{BTreeSet, HashMap},
    net::{IpAddr, SocketAddr},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use tokio::{net::TcpStream, sync::watch};

use crate::model::Cidr;

/// The choice rules of one frontend, as the model decided them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Choice {
    /// Endpoints that take new flows (sorted, as the model lists them).
    pub backends: Vec<SocketAddr>,
    /// `sessionAffinity: ClientIP` timeout.
    pub affinity: Option<Duration>,
    /// `loadBalancerSourceRanges`; empty: every client.
    pub source_ranges: Vec<Cidr>,
    /// `externalTrafficPolicy: Local`: the endpoints of clients on this node instead
    /// (kube-proxy's short-circuit), and how such clients are told apart.
    pub in_cluster: Option<(Vec<SocketAddr>, OnNode)>,
}

/// Which clients are on this node: pods (sources in the cluster CIDR, kube-proxy's default
/// detectLocalMode) and the node's processes, whose connections to a local address come
/// from that address (the kernel's choice) or from loopback.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OnNode {
    pub cluster_cidrs: Vec<Cidr>,
    /// The frontend's own address.
    pub frontend: Option<IpAddr>,
}

impl OnNode {
    pub fn holds(&self, client: IpAddr) -> bool {
        client.is_loopback()
            || Some(client) == self.frontend
            || self.cluster_cidrs.iter().any(|c| c.contains(client))
    }
}

impl Choice {
    /// The endpoints new flows from `client` choose among.
    fn backends_for(&self, client: IpAddr) -> &[SocketAddr] {
        match &self.in_cluster {
            Some((backends, on_node)) if on_node.holds(client) => backends,
            _ => &self.backends,
        }
    }
}

#[derive(Default)]
struct Picker {
    choice: Choice,
    next: usize,
    /// Client address → (endpoint, last new flow).
    sticky: HashMap<IpAddr, (SocketAddr, Instant)>,
}

/// One frontend's shared state.
pub struct Balancer {
    picker: Mutex<Picker>,
    /// Endpoints whose flows may continue (serving or draining): a flow whose endpoint
    /// leaves this set ends. Closed (sender dropped) when the frontend goes.
    live: watch::Sender<Arc<BTreeSet<SocketAddr>>>,
    /// Relayed TCP connections: (endpoint, client side, endpoint side), so a sync ends
    /// those of a gone endpoint before it returns, not whenever their task next runs.
    connections: Mutex<HashMap<u64, Relayed>>,
    next_connection: AtomicU64,
    /// What was relayed to each live endpoint (`inspect services`): (connections or UDP
    /// sessions, bytes both ways; a TCP connection's once it ends).
    relayed: Mutex<HashMap<SocketAddr, (u64, u64)>>,
}

type Relayed = (SocketAddr, Arc<TcpStream>, Arc<TcpStream>);

/// A relayed connection's entry; removed when the relay ends.
pub struct Registration<'a> {
    balancer: &'a Balancer,
    id: u64,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.balancer
            .connections
            .lock()
            .expect("not poisoned")
            .remove(&self.id);
    }
}

/// Ends a connection at once with a reset, whoever else holds the socket: connecting a
/// TCP socket to `AF_UNSPEC` disconnects it (the kernel's `tcp_disconnect`), which resets
/// an established connection; its relay then finds it closed.
pub fn abort(stream: &TcpStream) {
    // SAFETY: an all-zero sockaddr is a valid AF_UNSPEC address.
    let unspec: libc::sockaddr = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor, and an address of the size given.
    unsafe {
        libc::connect(
            std::os::fd::AsRawFd::as_raw_fd(stream),
            &unspec,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
}

/// Above this many remembered clients, expired ones are forgotten at the next new flow.
const STICKY_PRUNE_AT: usize = 4096;

impl Balancer {
    pub fn new() -> Arc<Self> {
        Arc::new(Balancer {
            picker: Mutex::default(),
            live: watch::Sender::new(Arc::default()),
            connections: Mutex::default(),
            next_connection: AtomicU64::new(0),
            relayed: Mutex::default(),
        })
    }

    /// Takes the model's latest decision for this frontend.
    pub fn update(&self, choice: Choice, live: BTreeSet<SocketAddr>) {
        {
            let mut picker = self.picker.lock().expect("not poisoned");
            if picker.choice != choice {
                picker
                    .sticky
                    .retain(|client, (ep, _)| choice.backends_for(*client).contains(ep));
                picker.choice = choice;
            }
        }
        self.relayed
            .lock()
            .expect("not poisoned")
            .retain(|endpoint, _| live.contains(endpoint));
        for (endpoint, client, upstream) in self.connections.lock().expect("not poisoned").values()
        {
            if !live.contains(endpoint) {
                abort(client);
                abort(upstream);
            }
        }
        self.live.send_if_modified(|current| {
            if **current == live {
                false
            } else {
                *current = Arc::new(live);
                true
            }
        });
    }

    /// Records a relayed connection until the returned registration drops.
    pub fn register(
        &self,
        endpoint: SocketAddr,
        client: Arc<TcpStream>,
        upstream: Arc<TcpStream>,
    ) -> Registration<'_> {
        let id = self.next_connection.fetch_add(1, Ordering::Relaxed);
        self.connections
            .lock()
            .expect("not poisoned")
            .insert(id, (endpoint, client, upstream));
        Registration { balancer: self, id }
    }

    /// Counts what was relayed to `endpoint`: new connections (or UDP sessions) and bytes.
    pub fn count(&self, endpoint: SocketAddr, connections: u64, bytes: u64) {
        let mut relayed = self.relayed.lock().expect("not poisoned");
        // Only live endpoints are kept (`update` forgets the others), so this is bounded.
        if self.is_live(endpoint) || relayed.contains_key(&endpoint) {
            let counts = relayed.entry(endpoint).or_default();
            counts.0 += connections;
            counts.1 += bytes;
        }
    }

    /// The TCP connections being relayed now: (client, endpoint).
    pub fn open_connections(&self) -> Vec<(SocketAddr, SocketAddr)> {
        let connections = self.connections.lock().expect("not poisoned");
        connections
            .values()
            .filter_map(|(endpoint, client, _)| Some((client.peer_addr().ok()?, *endpoint)))
            .collect()
    }

    /// What was relayed to each endpoint: (connections or sessions, bytes).
    pub fn relayed(&self) -> Vec<(SocketAddr, (u64, u64))> {
        let relayed = self.relayed.lock().expect("not poisoned");
        relayed.iter().map(|(a, c)| (*a, *c)).collect()
    }

    /// Whether flows to `endpoint` may continue.
    pub fn is_live(&self, endpoint: SocketAddr) -> bool {
        self.live.borrow().contains(&endpoint)
    }

    /// The endpoint for a new flow from `client`, or `None` if it is refused (outside the
    /// source ranges, or nothing serves).
    pub fn pick(&self, client: IpAddr, now: Instant) -> Option<SocketAddr> {
        let mut p = self.picker.lock().expect("not poisoned");
        let ranges = &p.choice.source_ranges;
        if !ranges.is_empty() && !ranges.iter().any(|r| r.contains(client)) {
            return None;
        }
        let backends = p.choice.backends_for(client);
        if backends.is_empty() {
            return None;
        }
        if let Some(timeout) = p.choice.affinity {
            if let Some((ep, last)) = p.sticky.get(&client).copied() {
                if now.duration_since(last) < timeout {
                    p.sticky.insert(client, (ep, now));
                    return Some(ep);
                }
            }
        }
        let ep = backends[p.next % backends.len()];
        p.next = p.next.wrapping_add(1);
        if let Some(timeout) = p.choice.affinity {
            if p.sticky.len() >= STICKY_PRUNE_AT {
                p.sticky
                    .retain(|_, (_, last)| now.duration_since(*last) < timeout);
            }
            p.sticky.insert(client, (ep, now));
        }
        Some(ep)
    }

    /// The endpoint `client` sticks to under ClientIP affinity, and how long it has left.
    pub fn sticky(&self, client: IpAddr, now: Instant) -> Option<(SocketAddr, Duration)> {
        let p = self.picker.lock().expect("not poisoned");
        let timeout = p.choice.affinity?;
        let (endpoint, last) = p.sticky.get(&client)?;
        let left = timeout.checked_sub(now.duration_since(*last))?;
        Some((*endpoint, left))
    }

    /// Forgets `client`'s sticky endpoint (it could not be reached).
    pub fn unstick(&self, client: IpAddr, endpoint: SocketAddr) {
        let mut p = self.picker.lock().expect("not poisoned");
        if p.sticky.get(&client).is_some_and(|(ep, _)| *ep == endpoint) {
            p.sticky.remove(&client);
        }
    }

    pub fn watch_live(&self) -> watch::Receiver<Arc<BTreeSet<SocketAddr>>> {
        self.live.subscribe()
    }
}

/// Resolves when `endpoint` no longer serves nor drains (or the frontend is gone): the flow
/// to it must end.
pub async fn endpoint_gone(
    live: &mut watch::Receiver<Arc<BTreeSet<SocketAddr>>>,
    endpoint: SocketAddr,
) {
    loop {
        if !live.borrow_and_update().contains(&endpoint) {
            return;
        }
        if live.changed().await.is_err() {
            return;
        }
    }
}
