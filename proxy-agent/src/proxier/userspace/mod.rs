//! The userspace proxier: this process owns the service addresses and relays each flow
//! itself. Cluster, external and load-balancer IPs become local to the node with routes on
//! `lo` ([`crate::kernel::local_routes`]); NodePorts listen on the node's NodePort addresses. TCP
//! is relayed with `splice(2)`, UDP per client session. It needs no netfilter, nor BPF: the
//! last resort on any kernel.
//!
//! What it cannot do, by construction: keep the client's address (every endpoint sees the
//! node's address, as under `masqueradeAll`), and drop silently: a frontend with nothing to
//! serve it is refused (TCP reset, ICMP port unreachable) whatever the traffic policy.
//! New flows go round robin (scheduler annotations are for the ipvs and eBPF modes).

mod balancer;
mod sockets;
mod splice;
mod tcp;
#[cfg(test)]
mod tests;
mod udp;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, RwLock},
    time::Duration,
};

use anyhow::Result;
use tracing::{debug, warn};

use crate::{
    kernel::local_routes::LocalRoutes,
    model::{
        DesiredState, Frontend, FrontendKind, FrontendState, Protocol, ServiceChange,
        ServicePortName, ServicePortState,
    },
    proxier::{Proxier, ProxyMode, SyncReport},
};

use balancer::{Balancer, Choice, OnNode};

/// kube-proxy's userspace default for `udpIdleTimeout`.
pub const DEFAULT_UDP_IDLE_TIMEOUT: Duration = Duration::from_millis(250);

/// The node's addresses that relayed flows leave from (its InternalIPs), per family.
#[derive(Clone, Default)]
pub struct Sources(Arc<RwLock<(Option<Ipv4Addr>, Option<Ipv6Addr>)>>);

impl Sources {
    fn for_endpoint(&self, endpoint: SocketAddr) -> Option<IpAddr> {
        let (v4, v6) = *self.0.read().expect("not poisoned");
        match endpoint {
            SocketAddr::V4(_) => v4.map(IpAddr::from),
            SocketAddr::V6(_) => v6.map(IpAddr::from),
        }
    }
}

/// A task aborted when its owner drops it.
struct Task(tokio::task::JoinHandle<()>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One frontend this process serves.
struct Served {
    /// The model's state it was last given.
    state: FrontendState,
    balancer: Arc<Balancer>,
    /// The listening socket's task; none while there is nothing to serve (the kernel
    /// refuses: nothing listens on a local address).
    listener: Option<Task>,
}

pub struct UserspaceProxier {
    routes: Box<dyn LocalRoutes>,
    /// Addresses this agent made local (read from the kernel at the first sync).
    routed: Option<BTreeSet<IpAddr>>,
    served: BTreeMap<Frontend, Served>,
    by_port: BTreeMap<ServicePortName, Vec<Frontend>>,
    /// Service ports that could not be fully served: tried again at every sync.
    failed: BTreeSet<ServicePortName>,
    sources: Sources,
    udp_idle: Duration,
    /// The caps on UDP sessions, shared by every UDP frontend.
    udp_budget: Arc<udp::UdpBudget>,
    /// Tells pods from other clients (`externalTrafficPolicy: Local`'s short-circuit).
    cluster_cidrs: Vec<crate::model::Cidr>,
    /// The detector changed: the next sync rewrites every frontend's choice.
    local_changed: bool,
    /// An interface-based detectLocalMode was reported as unsupported here.
    told_interfaces: bool,
}

/// Whether a frontend's address is made local by a route (NodePort addresses are the
/// node's own).
fn needs_route(kind: FrontendKind) -> bool {
    kind != FrontendKind::NodePort
}

impl UserspaceProxier {
    pub fn new(routes: Box<dyn LocalRoutes>, udp_idle: Duration) -> Self {
        UserspaceProxier {
            routes,
            routed: None,
            served: BTreeMap::new(),
            by_port: BTreeMap::new(),
            failed: BTreeSet::new(),
            sources: Sources::default(),
            udp_idle,
            udp_budget: Arc::default(),
            cluster_cidrs: Vec::new(),
            local_changed: false,
            told_interfaces: false,
        }
    }

    /// The UDP sessions' caps and counts (metrics).
    pub fn udp_sessions(&self) -> &udp::UdpBudget {
        &self.udp_budget
    }

    /// The same proxier with other UDP session caps (tests).
    pub fn with_udp_caps(mut self, per_frontend: usize, total: usize) -> Self {
        self.udp_budget = Arc::new(udp::UdpBudget::new(per_frontend, total));
        self
    }

    /// What `frontend`'s relays carried to each endpoint: (connections or UDP sessions,
    /// bytes both ways, a TCP connection's once it ended).
    pub fn relayed(&self, frontend: &Frontend) -> Vec<(std::net::SocketAddr, (u64, u64))> {
        self.served
            .get(frontend)
            .map(|s| s.balancer.relayed())
            .unwrap_or_default()
    }

    /// The endpoint `client` sticks to at `frontend` (ClientIP affinity), with the time
    /// it has left.
    pub fn sticky(
        &self,
        frontend: &Frontend,
        client: std::net::IpAddr,
    ) -> Option<(std::net::SocketAddr, Duration)> {
        self.served
            .get(frontend)?
            .balancer
            .sticky(client, std::time::Instant::now())
    }

    /// The TCP connections `frontend` relays now: (client, endpoint).
    pub fn open_connections(
        &self,
        frontend: &Frontend,
    ) -> Vec<(std::net::SocketAddr, std::net::SocketAddr)> {
        self.served
            .get(frontend)
            .map(|s| s.balancer.open_connections())
            .unwrap_or_default()
    }

    /// Frontends listening right now (tests and metrics).
    pub fn listening(&self) -> usize {
        self.served
            .values()
            .filter(|s| s.listener.is_some())
            .count()
    }

    fn routed(&mut self) -> Result<&mut BTreeSet<IpAddr>> {
        if self.routed.is_none() {
            self.routed = Some(self.routes.list()?);
        }
        Ok(self.routed.as_mut().expect("just set"))
    }

    fn ensure_route(&mut self, addr: IpAddr) -> Result<()> {
        if self.routed()?.contains(&addr) {
            return Ok(());
        }
        self.routes.add(addr)?;
        self.routed()?.insert(addr);
        Ok(())
    }

    /// Brings one service port's frontends to `state` (absent: the port is gone). Returns
    /// whether all of them are served as wanted.
    fn apply_port(&mut self, name: &ServicePortName, state: Option<&ServicePortState>) -> bool {
        let wanted: Vec<FrontendState> = state.map(|s| s.frontends()).unwrap_or_default();
        let keep: BTreeSet<Frontend> = wanted.iter().map(|f| f.frontend).collect();
        for old in self.by_port.remove(name).unwrap_or_default() {
            if !keep.contains(&old) {
                if let Some(gone) = self.served.remove(&old) {
                    // Flows in progress end with their frontend.
                    gone.balancer.update(Choice::default(), BTreeSet::new());
                }
            }
        }
        let affinity = state.and_then(|s| s.affinity_timeout);
        let mut ok = true;
        for f in &wanted {
            if let Err(e) = self.apply_frontend(f, affinity) {
                warn!(service = %name.service, port = %name.port, frontend = %format_frontend(&f.frontend), "serving the frontend: {e:#}");
                ok = false;
            }
        }
        if !keep.is_empty() {
            self.by_port
                .insert(name.clone(), keep.into_iter().collect());
        }
        ok
    }

    fn apply_frontend(&mut self, f: &FrontendState, affinity: Option<u32>) -> Result<()> {
        // The address is local even with nothing to serve: the kernel then refuses (nothing
        // listens) rather than routing the packet on.
        if needs_route(f.kind) {
            self.ensure_route(f.frontend.addr)?;
        }
        if !matches!(f.frontend.protocol, Protocol::Tcp | Protocol::Udp)
            && !self.served.contains_key(&f.frontend)
        {
            warn!(frontend = %format_frontend(&f.frontend), "the userspace proxier relays TCP and UDP only: this frontend is not served");
        }
        let served = self.served.entry(f.frontend).or_insert_with(|| Served {
            state: f.clone(),
            balancer: Balancer::new(),
            listener: None,
        });
        served.state = f.clone();
        let on_node = OnNode {
            cluster_cidrs: self.cluster_cidrs.clone(),
            frontend: Some(f.frontend.addr),
        };
        let choice = Choice {
            backends: f.backends.clone(),
            affinity: affinity.map(|s| Duration::from_secs(s.into())),
            source_ranges: f.source_ranges.clone(),
            in_cluster: f.in_cluster.as_ref().map(|i| (i.backends.clone(), on_node)),
        };
        let inner = f
            .in_cluster
            .iter()
            .flat_map(|i| i.backends.iter().chain(&i.draining));
        let live = f
            .backends
            .iter()
            .chain(&f.draining)
            .chain(inner)
            .copied()
            .collect();
        served.balancer.update(choice, live);
        let serves_anyone = !f.backends.is_empty()
            || f.in_cluster
                .as_ref()
                .is_some_and(|i| !i.backends.is_empty());
        if !serves_anyone {
            served.listener = None;
            return Ok(());
        }
        if served.listener.is_some() {
            return Ok(());
        }
        let addr = SocketAddr::new(f.frontend.addr, f.frontend.port);
        let (balancer, sources) = (served.balancer.clone(), self.sources.clone());
        let task = match f.frontend.protocol {
            Protocol::Tcp => {
                let listener = sockets::listen_tcp(addr)?;
                tokio::spawn(tcp::serve(listener, balancer, sources))
            }
            Protocol::Udp => {
                let socket = sockets::bind_udp(addr)?;
                tokio::spawn(udp::serve(
                    socket,
                    balancer,
                    sources,
                    self.udp_idle,
                    self.udp_budget.clone(),
                ))
            }
            _ => return Ok(()),
        };
        served.listener = Some(Task(task));
        Ok(())
    }

    /// Drops the routes no served frontend needs any more.
    fn prune_routes(&mut self) -> Result<()> {
        let used: BTreeSet<IpAddr> = self
            .served
            .values()
            .filter(|s| needs_route(s.state.kind))
            .map(|s| s.state.frontend.addr)
            .collect();
        let stale: Vec<IpAddr> = self.routed()?.difference(&used).copied().collect();
        for addr in stale {
            self.routes.remove(addr)?;
            self.routed()?.remove(&addr);
        }
        Ok(())
    }

    fn finish(&mut self, written: usize, full: bool) -> Result<SyncReport> {
        if let Err(e) = self.prune_routes() {
            warn!("removing local routes of frontends no longer served: {e:#}");
        }
        debug!(
            frontends = self.served.len(),
            listening = self.listening(),
            "userspace frontends updated"
        );
        Ok(SyncReport {
            services_written: written,
            services_failed: self.failed.len(),
            full,
            flows_deleted: 0,
            failure_reasons: Default::default(),
        })
    }
}

fn format_frontend(f: &Frontend) -> String {
    format!("{}/{:?}", SocketAddr::new(f.addr, f.port), f.protocol)
}

impl Proxier for UserspaceProxier {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Userspace
    }

    fn sync(&mut self, desired: &DesiredState, changes: &[ServiceChange]) -> Result<SyncReport> {
        if std::mem::take(&mut self.local_changed) {
            return self.sync_full(desired);
        }
        let mut names: BTreeSet<ServicePortName> =
            changes.iter().map(|c| c.name().clone()).collect();
        names.extend(std::mem::take(&mut self.failed));
        for name in &names {
            if !self.apply_port(name, desired.ports.get(name).map(|p| p.as_ref())) {
                self.failed.insert(name.clone());
            }
        }
        self.finish(names.len(), false)
    }

    /// A relay sees a client's address, not the interface its packets came in on: the
    /// interface-based modes tell no pod apart here (logged once).
    fn set_local_traffic(&mut self, local: &crate::model::local::LocalTraffic) {
        if local.by_interface() && !std::mem::replace(&mut self.told_interfaces, true) {
            warn!("userspace mode tells pods by source address only: with detectLocalMode BridgeInterface or InterfaceNamePrefix, pods reaching an externalTrafficPolicy: Local frontend get its local endpoints, as other clients");
        }
        let cidrs = local.cidrs();
        if cidrs != self.cluster_cidrs {
            self.cluster_cidrs = cidrs;
            self.local_changed = true;
        }
    }

    fn sync_full(&mut self, desired: &DesiredState) -> Result<SyncReport> {
        self.failed.clear();
        self.local_changed = false;
        let gone: Vec<ServicePortName> = self
            .by_port
            .keys()
            .filter(|n| !desired.ports.contains_key(*n))
            .cloned()
            .collect();
        for name in &gone {
            self.apply_port(name, None);
        }
        for (name, port) in &desired.ports {
            if !self.apply_port(name, Some(port)) {
                self.failed.insert(name.clone());
            }
        }
        self.finish(desired.ports.len(), true)
    }

    fn programmed(&self) -> (usize, usize) {
        let backends: usize = self.served.values().map(|s| s.state.backends.len()).sum();
        (self.by_port.len(), backends)
    }

    fn set_masquerade_addresses(&mut self, v4: Option<Ipv4Addr>, v6: Option<Ipv6Addr>) {
        *self.sources.0.write().expect("not poisoned") = (v4, v6);
    }
}
