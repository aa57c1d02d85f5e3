//! `inspect services`: every frontend of the service ports the agent serves, its backends
//! with weight and state, and traffic counters from the mode's own datapath, as
//! `ipvsadm -Ln --stats` shows IPVS's.
//!
//! The frontends and backends are the model's desired state ([`view`]); the counters are
//! each mode's ([`Counted`]): the eBPF maps' per-frontend and per-backend counters
//! ([`EbpfIds`]), the userspace relays' own, IPVS's ([`count_ipvs`]), and for the iptables
//! and nftables modes the flows kernel conntrack tracks now ([`count_conntrack`]). Field names are part of
//! `inspect services -o json` (docs/inspect.md): rename none.

use std::{
    collections::{BTreeSet, HashMap},
    net::SocketAddr,
    sync::Arc,
};

use serde::{Deserialize, Serialize};

use crate::{
    kernel::conntrack::flows::Entry,
    model::{DesiredState, Frontend, FrontendKind, ObjectName, ServicePortState, WhenEmpty},
};

/// The most service ports one answer lists; name a Service (or ask again per Service) for
/// the rest. An answer is built on the sync loop, so its size is bounded.
pub const MAX_PORTS: usize = 2000;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicesView {
    pub node: String,
    pub mode: String,
    /// Where the counters come from, in words (they differ by mode).
    pub counters: String,
    /// Service ports programmed in all (the list may stop at [`MAX_PORTS`]).
    pub total_ports: usize,
    pub truncated: bool,
    pub ports: Vec<PortView>,
}

/// One service port in one family.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortView {
    /// `namespace/name`.
    pub service: String,
    pub port: String,
    pub protocol: String,
    pub family: String,
    pub scheduler: String,
    pub affinity_timeout_seconds: Option<u32>,
    /// Why the mode could not program this port as the model has it (it is retried; what
    /// served before may still serve); absent when it did, or when not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_programmed: Option<String>,
    pub frontends: Vec<FrontendView>,
    /// Every endpoint some frontend serves or drains, with its counters over all frontends.
    pub backends: Vec<BackendView>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FrontendView {
    /// `address:port/PROTOCOL`.
    pub frontend: String,
    /// `ClusterIP`, `NodePort`, `ExternalIP`, `LoadBalancer`.
    pub kind: String,
    /// Endpoints that take this frontend's new connections.
    pub serving: Vec<SocketAddr>,
    /// What a new connection meets when `serving` is empty: `refuse` or `drop`.
    pub when_empty: Option<String>,
    /// `loadBalancerSourceRanges` (load-balancer frontends); empty: every client.
    pub source_ranges: Vec<String>,
    pub traffic: Traffic,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendView {
    pub address: SocketAddr,
    /// The `proxy-agent.io/weights` weight (1 without one); null when read from the pinned
    /// maps (weights are the agent's).
    pub weight: Option<u16>,
    /// `serving` (some frontend sends it new connections) or `draining` (established
    /// connections only).
    pub state: String,
    /// On this node.
    pub local: bool,
    pub traffic: Traffic,
}

/// Counters; absent where the mode does not count that.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Traffic {
    /// Connections (new flows) given a backend; with kernel conntrack: flows tracked now.
    pub connections: Option<u64>,
    pub packets: Option<u64>,
    pub bytes: Option<u64>,
}

impl Traffic {
    /// Adds `other`'s counters; a counter one side lacks stays as the other has it.
    pub fn add(&mut self, other: Traffic) {
        let sum = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        };
        self.connections = sum(self.connections, other.connections);
        self.packets = sum(self.packets, other.packets);
        self.bytes = sum(self.bytes, other.bytes);
    }
}

/// How the counters of an answer are had: counted on the loop already (userspace), read
/// from the eBPF counter arrays off the loop by id, or counted from kernel conntrack.
#[derive(Debug)]
pub enum Counting {
    Done(Counted),
    Ebpf(EbpfIds),
    /// IPVS's own counters of each real server (read over generic netlink).
    Ipvs,
    Conntrack,
}

/// IPVS's counters of `ports`' virtual servers: per frontend, the sum over its real
/// servers; per backend, the sum over the port's frontends.
pub fn count_ipvs(ports: &[Arc<ServicePortState>]) -> anyhow::Result<Counted> {
    let mut ipvs = crate::proxier::ipvs::netlink::KernelIpvs::open()?;
    let zeros = Traffic {
        connections: Some(0),
        packets: Some(0),
        bytes: Some(0),
    };
    let mut counted = Counted {
        source: "IPVS's own counters (ipvsadm -Ln --stats): connections scheduled, packets and bytes both ways, since each virtual and real server was added".into(),
        frontend_zero: zeros,
        backend_zero: zeros,
        ..Counted::default()
    };
    let mut unread = None;
    for s in ports {
        for f in s.frontend_keys() {
            // A frontend IPVS does not hold (not programmed yet) counts nothing; the first
            // such is named.
            let servers = match ipvs.real_server_stats(&f) {
                Ok(servers) => servers,
                Err(e) => {
                    unread.get_or_insert(format!("{e:#}"));
                    continue;
                }
            };
            for (addr, st) in servers {
                let t = Traffic {
                    connections: Some(st.connections),
                    packets: Some(st.packets),
                    bytes: Some(st.bytes),
                };
                counted.count(f, s.frontend, addr, t);
            }
        }
    }
    if let Some(e) = unread {
        counted.source.push_str(&format!("; not read: {e}"));
    }
    Ok(counted)
}

/// The eBPF counter ids of the ports asked: per frontend (`SERVICE_STATS`) and per
/// backend of each port (`BACKEND_STATS`, each id once), with how they are described.
#[derive(Debug, Default)]
pub struct EbpfIds {
    pub frontends: Vec<(Frontend, u32)>,
    /// (the port's cluster-IP frontend, backend, id).
    pub backends: Vec<(Frontend, SocketAddr, u32)>,
    pub backend_metrics: bool,
}

impl EbpfIds {
    /// Reads the counters of these ids from the pinned arrays under `maps_dir`.
    pub fn read(&self, maps_dir: &std::path::Path) -> anyhow::Result<Counted> {
        let zeros = Traffic {
            connections: Some(0),
            packets: Some(0),
            bytes: Some(0),
        };
        let mut counted = Counted {
            source: format!(
                "the eBPF datapath's counters since each id was given{}",
                if self.backend_metrics {
                    ""
                } else {
                    " (per backend only with --backend-metrics)"
                }
            ),
            frontend_zero: zeros,
            backend_zero: if self.backend_metrics {
                zeros
            } else {
                Traffic::default()
            },
            ..Counted::default()
        };
        let ids: Vec<u32> = self.frontends.iter().map(|(_, id)| *id).collect();
        let stats =
            super::pinned::counters(maps_dir, proxy_common::map_names::SERVICE_STATS, &ids)?;
        for ((frontend, _), s) in self.frontends.iter().zip(&stats) {
            counted
                .frontends
                .entry(*frontend)
                .or_insert(zeros)
                .add(traffic_of(s));
        }
        if self.backend_metrics {
            let slots: Vec<u32> = self
                .backends
                .iter()
                .map(|(.., id)| id & proxy_common::BACKEND_INDEX_MASK)
                .collect();
            let stats =
                super::pinned::counters(maps_dir, proxy_common::map_names::BACKEND_STATS, &slots)?;
            for ((port, addr, _), s) in self.backends.iter().zip(&stats) {
                counted
                    .backends
                    .entry((*port, *addr))
                    .or_insert(zeros)
                    .add(traffic_of(s));
            }
        }
        Ok(counted)
    }
}

/// A datapath counter as [`Traffic`].
pub fn traffic_of(s: &proxy_common::ServiceStats) -> Traffic {
    Traffic {
        connections: Some(s.connections),
        packets: Some(s.packets),
        bytes: Some(s.bytes),
    }
}

/// What a mode counted, by frontend and by (service port's frontend set, backend).
#[derive(Debug, Default)]
pub struct Counted {
    pub source: String,
    /// What a frontend, or a backend, nothing was counted for has: zeros of what the
    /// mode counts (nothing where it does not count).
    pub frontend_zero: Traffic,
    pub backend_zero: Traffic,
    pub frontends: HashMap<Frontend, Traffic>,
    /// By the port's cluster-IP frontend (the port's identity in the datapath) and backend.
    pub backends: HashMap<(Frontend, SocketAddr), Traffic>,
}

impl Counted {
    /// Counts `t` for `frontend`, and for `backend` of the service port whose cluster-IP
    /// frontend is `port` (a backend's counters add up over its port's frontends).
    pub fn count(&mut self, frontend: Frontend, port: Frontend, backend: SocketAddr, t: Traffic) {
        let (frontend_zero, backend_zero) = (self.frontend_zero, self.backend_zero);
        self.frontends
            .entry(frontend)
            .or_insert(frontend_zero)
            .add(t);
        self.backends
            .entry((port, backend))
            .or_insert(backend_zero)
            .add(t);
    }
}

/// `service`'s service ports (every Service's without one) of `desired`, at most
/// [`MAX_PORTS`]; with how many there are.
pub fn select(
    desired: &DesiredState,
    service: Option<&ObjectName>,
) -> (Vec<Arc<ServicePortState>>, usize) {
    let wanted = desired
        .ports
        .values()
        .filter(|s| service.is_none_or(|n| s.name.service == *n));
    let total = wanted.clone().count();
    (wanted.take(MAX_PORTS).cloned().collect(), total)
}

/// The view of `ports` with what `counted` has for them.
pub fn view(ports: &[Arc<ServicePortState>], counted: &Counted) -> Vec<PortView> {
    ports.iter().map(|s| port_view(s, counted)).collect()
}

fn port_view(s: &ServicePortState, counted: &Counted) -> PortView {
    let cluster = (
        s.frontend,
        FrontendKind::ClusterIp,
        &s.backends,
        s.when_empty,
        Vec::new(),
    );
    let external = s.external.iter().map(|f| {
        (
            f.frontend,
            f.kind,
            &f.backends,
            f.when_empty,
            f.source_ranges.iter().map(|c| c.to_string()).collect(),
        )
    });
    let frontends: Vec<FrontendView> = std::iter::once(cluster)
        .chain(external)
        .map(
            |(frontend, kind, serving, when_empty, source_ranges)| FrontendView {
                frontend: frontend.to_string(),
                kind: kind.name().into(),
                serving: serving.clone(),
                when_empty: serving.is_empty().then(|| {
                    match when_empty {
                        WhenEmpty::Refuse => "refuse",
                        WhenEmpty::Drop => "drop",
                    }
                    .into()
                }),
                source_ranges,
                traffic: counted
                    .frontends
                    .get(&frontend)
                    .copied()
                    .unwrap_or(counted.frontend_zero),
            },
        )
        .collect();
    let serving: BTreeSet<SocketAddr> = std::iter::once(&s.backends)
        .chain(s.external.iter().map(|f| &f.backends))
        .chain(
            s.external
                .iter()
                .filter_map(|f| f.in_cluster.as_ref().map(|i| &i.backends)),
        )
        .flatten()
        .copied()
        .collect();
    let draining: BTreeSet<SocketAddr> = std::iter::once(&s.draining)
        .chain(s.external.iter().map(|f| &f.draining))
        .flatten()
        .copied()
        .filter(|a| !serving.contains(a))
        .collect();
    let backends = serving
        .iter()
        .map(|a| (a, "serving"))
        .chain(draining.iter().map(|a| (a, "draining")))
        .map(|(addr, state)| BackendView {
            address: *addr,
            weight: Some(s.weights.get(&addr.ip()).copied().unwrap_or(1)),
            state: state.into(),
            local: !s.remote.contains(addr),
            traffic: counted
                .backends
                .get(&(s.frontend, *addr))
                .copied()
                .unwrap_or(counted.backend_zero),
        })
        .collect();
    PortView {
        service: s.name.service.to_string(),
        port: s.name.port.clone(),
        protocol: s.name.protocol.to_string(),
        family: s.name.family.name().into(),
        scheduler: s.scheduler.name().into(),
        affinity_timeout_seconds: s.affinity_timeout,
        not_programmed: None,
        frontends,
        backends,
    }
}

/// Counts the flows kernel conntrack tracks now to each frontend of `ports`, and to each
/// of their backends (the reply's source: where the flow was translated to). A flow that
/// is not to a frontend is not counted.
pub fn count_conntrack<'a>(
    ports: impl IntoIterator<Item = &'a ServicePortState>,
    entries: &[Entry],
) -> Counted {
    // (protocol, address, port) of every frontend → the port's cluster-IP frontend.
    let mut owner: HashMap<(u8, SocketAddr), (Frontend, Frontend)> = HashMap::new();
    for s in ports {
        for f in s.frontend_keys() {
            let key = (f.protocol.number(), SocketAddr::new(f.addr, f.port));
            owner.insert(key, (f, s.frontend));
        }
    }
    let one = Traffic {
        connections: Some(1),
        ..Traffic::default()
    };
    let one_zero = Traffic {
        connections: Some(0),
        ..Traffic::default()
    };
    let mut counted = Counted {
        source:
            "flows kernel conntrack tracks now (a closed TCP connection until its TIME_WAIT ends)"
                .into(),
        frontend_zero: one_zero,
        backend_zero: one_zero,
        ..Counted::default()
    };
    for e in entries {
        if let Some((frontend, port)) = owner.get(&(e.original.protocol, e.original.dst)) {
            counted.count(*frontend, *port, e.reply.src, one);
        }
    }
    counted
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::{
        kernel::conntrack::flows::Tuple,
        model::{FrontendState, InCluster, Protocol, Scheduler},
    };

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// lab/web: cluster IP 10.96.0.10:80 and NodePort 192.168.1.1:30080 under
    /// `externalTrafficPolicy: Local`; endpoints .1 (here), .2 and .3 (elsewhere), .4
    /// draining, .3 weighted 3.
    fn web() -> ServicePortState {
        let backends = vec![
            addr("10.0.0.1:8080"),
            addr("10.0.0.2:8080"),
            addr("10.0.0.3:8080"),
        ];
        let mut s = ServicePortState::cluster_ip(
            "lab",
            "web",
            "http",
            "10.96.0.10".parse().unwrap(),
            backends.clone(),
        );
        s.draining = vec![addr("10.0.0.4:8080")];
        s.remote = [
            addr("10.0.0.2:8080"),
            addr("10.0.0.3:8080"),
            addr("10.0.0.4:8080"),
        ]
        .into_iter()
        .collect();
        s.scheduler = Scheduler::Wrr;
        s.affinity_timeout = Some(600);
        s.weights.insert("10.0.0.3".parse().unwrap(), 3);
        s.external.push(FrontendState {
            frontend: Frontend {
                addr: "192.168.1.1".parse().unwrap(),
                port: 30080,
                protocol: Protocol::Tcp,
            },
            kind: FrontendKind::NodePort,
            backends: vec![addr("10.0.0.1:8080")],
            draining: Vec::new(),
            when_empty: WhenEmpty::Drop,
            source_ranges: Vec::new(),
            masquerade: false,
            masquerade_all: false,
            in_cluster: Some(InCluster {
                backends,
                draining: Vec::new(),
            }),
        });
        s
    }

    fn flow(dst: &str, backend: &str) -> Entry {
        let (client, dst, backend) = (addr("10.0.9.9:40000"), addr(dst), addr(backend));
        Entry {
            original: Tuple {
                protocol: 6,
                src: client,
                dst,
            },
            reply: Tuple {
                protocol: 6,
                src: backend,
                dst: client,
            },
            timeout: None,
            tcp_state: None,
        }
    }

    #[test]
    fn conntrack_counts_flows_per_frontend_and_per_backend_over_frontends() {
        let entries = vec![
            flow("10.96.0.10:80", "10.0.0.1:8080"),
            flow("10.96.0.10:80", "10.0.0.2:8080"),
            flow("10.96.0.10:80", "10.0.0.2:8080"),
            flow("192.168.1.1:30080", "10.0.0.1:8080"),
            // Not to a frontend: not counted.
            flow("10.96.0.11:80", "10.0.0.1:8080"),
            flow("10.0.0.1:8080", "10.0.0.1:8080"),
        ];
        let ports = vec![Arc::new(web())];
        let counted = count_conntrack(ports.iter().map(|p| &**p), &entries);
        let v = view(&ports, &counted);
        let p = &v[0];
        let conns = |t: &Traffic| t.connections.unwrap();
        assert_eq!(conns(&p.frontends[0].traffic), 3, "cluster IP");
        assert_eq!(conns(&p.frontends[1].traffic), 1, "NodePort");
        let backend = |a: &str| {
            p.backends
                .iter()
                .find(|b| b.address == addr(a))
                .unwrap()
                .clone()
        };
        assert_eq!(conns(&backend("10.0.0.1:8080").traffic), 2);
        assert_eq!(conns(&backend("10.0.0.2:8080").traffic), 2);
        assert_eq!(
            conns(&backend("10.0.0.3:8080").traffic),
            0,
            "zero, not absent"
        );
        assert_eq!(backend("10.0.0.3:8080").weight, Some(3));
        assert_eq!(backend("10.0.0.4:8080").state, "draining");
        assert!(backend("10.0.0.1:8080").local && !backend("10.0.0.2:8080").local);
        assert_eq!(p.frontends[1].serving, vec![addr("10.0.0.1:8080")]);
        assert!(p.frontends.iter().all(|f| f.when_empty.is_none()));
    }

    #[test]
    fn one_services_ports_are_selected_and_the_list_is_bounded() {
        let mut desired = DesiredState::default();
        for i in 0..(MAX_PORTS + 5) {
            let vip: IpAddr = format!("10.97.{}.{}", i / 250, i % 250).parse().unwrap();
            let s = ServicePortState::cluster_ip("ns", &format!("s{i}"), "", vip, Vec::new());
            desired.ports.insert(s.name.clone(), Arc::new(s));
        }
        let (ports, total) = select(&desired, None);
        assert_eq!((ports.len(), total), (MAX_PORTS, MAX_PORTS + 5));
        let name = ObjectName {
            namespace: "ns".into(),
            name: "s7".into(),
        };
        let (ports, total) = select(&desired, Some(&name));
        assert_eq!((ports.len(), total), (1, 1));
        let v = view(&ports, &Counted::default());
        assert_eq!(v[0].frontends[0].when_empty.as_deref(), Some("refuse"));
        assert_eq!(
            v[0].frontends[0].traffic,
            Traffic::default(),
            "uncounted: absent"
        );
    }

    /// The JSON `inspect services -o json` prints (field names are kept stable), and
    /// behind it the golden table.
    #[test]
    fn the_json_is_the_golden_one() {
        let ports = vec![Arc::new(web())];
        let mut counted = Counted {
            source: "the eBPF datapath's counters since the maps were created".into(),
            ..Counted::default()
        };
        let t = |c, p, b| Traffic {
            connections: Some(c),
            packets: Some(p),
            bytes: Some(b),
        };
        let cluster = ports[0].frontend;
        counted.frontends.insert(cluster, t(30, 210, 12_600));
        counted
            .frontends
            .insert(ports[0].external[0].frontend, t(2, 14, 840));
        for (i, b) in ["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"]
            .iter()
            .enumerate()
        {
            let c = 10 + i as u64;
            counted
                .backends
                .insert((cluster, addr(b)), t(c, c * 7, c * 420));
        }
        counted.backend_zero = t(0, 0, 0);
        let v = ServicesView {
            node: "node-1".into(),
            mode: "ebpf".into(),
            counters: counted.source.clone(),
            total_ports: 1,
            truncated: false,
            ports: view(&ports, &counted),
        };
        crate::inspect::assert_golden(
            "services.json",
            &(serde_json::to_string_pretty(&v).unwrap() + "\n"),
        );
    }
}
