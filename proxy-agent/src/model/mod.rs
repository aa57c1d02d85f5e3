//! The one service model: Services and EndpointSlices in, a mode-independent desired state out.
//!
//! Every semantic decision (which endpoints serve, how a target port resolves) is made here,
//! once; proxiers only receive [`DesiredState`] and the [`ServiceChange`]s that lead to it.

pub mod explain;
pub mod incremental;
pub mod local;
pub mod objects;
pub mod ownership;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
};

pub use objects::{
    AddressType, Cidr, EndpointInfo, FieldError, NodeInfo, ObjectName, Protocol, Scheduler,
    ServiceInfo, ServicePortSpec, ServiceType, SliceInfo, SlicePort, TargetPort,
};

/// Where an object came from, for messages: `path#document` or `api-server`.
pub type Origin = Arc<str>;

/// Something wrong with the input, reported and skipped; everything else is still served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub origin: Origin,
    /// `Kind namespace/name`, or the best name known.
    pub object: String,
    pub message: String,
    pub kind: ProblemKind,
}

/// What kind of problem, for the metrics that count them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ProblemKind {
    /// An object or a field of it that cannot be used.
    #[default]
    Invalid,
    /// A frontend another service port owns ([`ownership`]).
    FrontendConflict,
    /// An external IP outside `--external-ip-cidrs`.
    ExternalIpRefused,
}

impl Problem {
    /// The Service a problem is about, when it is one (its `object` is `Service ns/name`;
    /// names are DNS-1123, so the one `/` splits them).
    pub fn service(&self) -> Option<ObjectName> {
        let (namespace, name) = self.object.strip_prefix("Service ")?.split_once('/')?;
        Some(ObjectName {
            namespace: namespace.into(),
            name: name.into(),
        })
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.origin, self.object, self.message)
    }
}

/// One stored object with its origin. Shared: the manifest source's cache, its snapshots
/// and the sync loop's view hold the same object, and comparing an object with itself is a
/// pointer comparison.
pub type Stored<T> = (Arc<T>, Origin);

/// All the objects the proxy currently knows, validated, each with its origin.
#[derive(Clone, Debug, Default)]
pub struct ObjectStore {
    pub services: BTreeMap<ObjectName, Stored<ServiceInfo>>,
    pub slices: BTreeMap<ObjectName, Stored<SliceInfo>>,
}

impl ObjectStore {
    /// The EndpointSlices of each Service, in slice-name order.
    pub fn slices_by_service(&self) -> BTreeMap<&ObjectName, Vec<&Stored<SliceInfo>>> {
        let mut by_service: BTreeMap<&ObjectName, Vec<&Stored<SliceInfo>>> = BTreeMap::new();
        for entry in self.slices.values() {
            by_service.entry(&entry.0.service).or_default().push(entry);
        }
        by_service
    }
}

/// An IP family. A dual-stack Service is served as two independent service ports, one per
/// family, as kube-proxy runs one proxier per family: each has its own cluster IP, its own
/// EndpointSlices (they are per address type) and its own frontends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpFamily {
    #[default]
    V4,
    V6,
}

impl IpFamily {
    /// As the API names it (`IPv4`, `IPv6`).
    pub fn name(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }

    pub fn of(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    pub fn address_type(self) -> AddressType {
        match self {
            IpFamily::V4 => AddressType::IPv4,
            IpFamily::V6 => AddressType::IPv6,
        }
    }
}

/// Identity of one port of one Service in one IP family, as kube-proxy's `ServicePortName`
/// (which is per family because its proxiers are).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub service: ObjectName,
    pub port: String,
    pub protocol: Protocol,
    pub family: IpFamily,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}/{}", self.service, self.protocol)?;
        } else {
            write!(f, "{}:{}/{}", self.service, self.port, self.protocol)?;
        }
        // IPv4 keeps kube-proxy's spelling; the IPv6 half of a dual-stack Service is marked.
        match self.family {
            IpFamily::V4 => Ok(()),
            IpFamily::V6 => f.write_str(" (IPv6)"),
        }
    }
}

/// An address:port:protocol that clients connect to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub addr: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            SocketAddr::new(self.addr, self.port),
            self.protocol
        )
    }
}

impl Frontend {
    pub fn family(&self) -> IpFamily {
        IpFamily::of(self.addr)
    }
}

/// This node, as the model needs it: which endpoints are local, its zone for topology,
/// and the addresses NodePorts are served on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    pub name: String,
    pub zone: Option<String>,
    /// Both families; each service port uses those of its own.
    pub node_port_addresses: Vec<IpAddr>,
    /// The source address of masqueraded flows: the node's first IPv4 InternalIP.
    pub masquerade_addr: Option<Ipv4Addr>,
    /// The same for IPv6 flows: the node's first IPv6 InternalIP.
    pub masquerade_addr6: Option<std::net::Ipv6Addr>,
    /// `masqueradeAll`: every service flow is source-NATed to the node.
    pub masquerade_all: bool,
    /// The scheduler of Services without the scheduler annotation.
    pub default_scheduler: Scheduler,
    /// `--external-ip-cidrs`: external IPs served only inside these; empty: all.
    pub external_ip_cidrs: Vec<Cidr>,
}

/// One entry of `nodePortAddresses` / `--nodeport-addresses`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddress {
    Cidr(Cidr),
    /// The node's primary addresses (its Node object's InternalIPs).
    Primary,
}

impl NodeContext {
    /// This node's context. NodePorts are served on the local addresses inside the
    /// `nodePortAddresses` CIDRs (plus the InternalIPs for `primary`); without any, on the
    /// Node object's addresses, or on every local address when there is no Node object.
    pub fn new(
        name: &str,
        node: Option<&NodeInfo>,
        filter: &[NodePortAddress],
        local: &[IpAddr],
    ) -> Self {
        let node_addresses = |only_internal: bool| -> Vec<IpAddr> {
            node.into_iter()
                .flat_map(|n| n.addresses.iter())
                .filter(|(kind, _)| !only_internal || kind == "InternalIP")
                .map(|(_, a)| *a)
                .collect()
        };
        // Link-local IPv6 addresses need a zone to be reached: never NodePort addresses.
        let usable = |a: &&IpAddr| match a {
            IpAddr::V4(v4) => !v4.is_loopback(),
            IpAddr::V6(v6) => !v6.is_loopback() && !v6.is_unicast_link_local(),
        };
        let mut addresses: BTreeSet<IpAddr> = BTreeSet::new();
        if filter.is_empty() {
            if node.is_some() {
                addresses.extend(node_addresses(false));
            } else {
                addresses.extend(local.iter().filter(usable));
            }
        } else {
            for f in filter {
                match f {
                    NodePortAddress::Primary => addresses.extend(node_addresses(true)),
                    NodePortAddress::Cidr(c) => {
                        addresses.extend(local.iter().filter(usable).filter(|a| c.contains(**a)))
                    }
                }
            }
        }
        NodeContext {
            name: name.to_string(),
            zone: node.and_then(|n| n.zone.clone()),
            node_port_addresses: addresses.into_iter().collect(),
            masquerade_addr: node_addresses(true).into_iter().find_map(|a| match a {
                IpAddr::V4(v4) => Some(v4),
                IpAddr::V6(_) => None,
            }),
            masquerade_addr6: node_addresses(true).into_iter().find_map(|a| match a {
                IpAddr::V6(v6) => Some(v6),
                IpAddr::V4(_) => None,
            }),
            masquerade_all: false,
            default_scheduler: Scheduler::default(),
            external_ip_cidrs: Vec::new(),
        }
    }
}

/// How clients reach a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrontendKind {
    ClusterIp,
    NodePort,
    ExternalIp,
    LoadBalancer,
}

impl FrontendKind {
    /// As the Service's type names it (`inspect`'s output).
    pub fn name(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "ClusterIP",
            FrontendKind::NodePort => "NodePort",
            FrontendKind::ExternalIp => "ExternalIP",
            FrontendKind::LoadBalancer => "LoadBalancer",
        }
    }

    /// External traffic: subject to `externalTrafficPolicy`.
    pub fn is_external(self) -> bool {
        self != FrontendKind::ClusterIp
    }
}

/// What a new flow meets when its frontend has no backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WhenEmpty {
    /// No endpoint serves the Service anywhere: ICMP port unreachable (kube-proxy's REJECT).
    Refuse,
    /// The traffic policy is Local and endpoints exist only on other nodes: dropped, as
    /// kube-proxy does, so a load balancer's health check (not a refusal) steers clients.
    Drop,
}

/// One address:port:protocol of a service port and what it leads to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendState {
    pub frontend: Frontend,
    pub kind: FrontendKind,
    /// Endpoints that take new connections, sorted and without duplicates.
    pub backends: Vec<SocketAddr>,
    /// Endpoints still listed but not ready (terminating, or failing readiness): no new
    /// connections, but established ones continue until the endpoint is gone.
    pub draining: Vec<SocketAddr>,
    pub when_empty: WhenEmpty,
    /// `loadBalancerSourceRanges` (load-balancer frontends only); empty: everyone.
    pub source_ranges: Vec<Cidr>,
    /// External traffic under `externalTrafficPolicy: Cluster`: source-NATed to the node
    /// when it goes to an endpoint on another node, so replies come back through here.
    pub masquerade: bool,
    /// `masqueradeAll`: every flow is source-NATed to the node.
    pub masquerade_all: bool,
    /// `externalTrafficPolicy: Local`: what new flows from this node and its pods meet
    /// instead of `backends` (kube-proxy's short-circuit, so a node without a local endpoint
    /// does not black-hole in-cluster clients of an LB IP). `None`: every client alike.
    pub in_cluster: Option<InCluster>,
}

impl FrontendState {
    /// The endpoints that clients on this node take instead of `backends`, when there are
    /// some (`externalTrafficPolicy: Local`'s short-circuit).
    pub fn short_circuit(&self) -> Option<&[SocketAddr]> {
        self.in_cluster
            .as_ref()
            .map(|i| i.backends.as_slice())
            .filter(|b| !b.is_empty())
    }
}

/// The endpoints of an `externalTrafficPolicy: Local` frontend for clients on this node:
/// those cluster traffic may use. Empty only when no endpoint serves anywhere (refused).
/// Flows from the node's own addresses are masqueraded, as kube-proxy does; flows from
/// its pods keep their source.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InCluster {
    /// Endpoints that take new flows, sorted and without duplicates.
    pub backends: Vec<SocketAddr>,
    /// As [`FrontendState::draining`].
    pub draining: Vec<SocketAddr>,
}

/// What the datapath must do for one service port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortState {
    pub name: ServicePortName,
    /// The cluster IP frontend.
    pub frontend: Frontend,
    /// Endpoints for cluster-IP traffic (after `internalTrafficPolicy` and topology), sorted.
    /// Empty means refuse or drop, as `when_empty` says.
    pub backends: Vec<SocketAddr>,
    /// Not-ready endpoints of cluster-IP traffic (see [`FrontendState::draining`]).
    pub draining: Vec<SocketAddr>,
    pub when_empty: WhenEmpty,
    /// `masqueradeAll`.
    pub masquerade_all: bool,
    /// NodePort, external IP and load-balancer frontends.
    pub external: Vec<FrontendState>,
    /// Endpoints on other nodes (by `nodeName`); the rest are this node's.
    pub remote: BTreeSet<SocketAddr>,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub affinity_timeout: Option<u32>,
    /// `healthCheckNodePort` of an `externalTrafficPolicy: Local` service, with the number
    /// of local endpoints it reports.
    pub health_check: Option<(u16, usize)>,
    /// How new flows choose among the backends (the Service's annotation, else the default).
    pub scheduler: Scheduler,
    /// Backend weights for the weighted schedulers (absent: 1). Weight-0 endpoints take no
    /// new flows and are draining instead.
    pub weights: BTreeMap<IpAddr, u16>,
}

impl ServicePortState {
    /// A TCP port 80 served on cluster IP `vip` only, by `backends`, everything else at
    /// its default (tests and benchmarks build their states from it).
    pub fn cluster_ip(
        namespace: &str,
        name: &str,
        port: &str,
        vip: IpAddr,
        backends: Vec<SocketAddr>,
    ) -> Self {
        ServicePortState {
            name: ServicePortName {
                service: ObjectName {
                    namespace: namespace.into(),
                    name: name.into(),
                },
                port: port.into(),
                protocol: Protocol::Tcp,
                family: IpFamily::of(vip),
            },
            frontend: Frontend {
                addr: vip,
                port: 80,
                protocol: Protocol::Tcp,
            },
            backends,
            draining: Vec::new(),
            when_empty: WhenEmpty::Refuse,
            masquerade_all: false,
            external: Vec::new(),
            remote: BTreeSet::new(),
            affinity_timeout: None,
            health_check: None,
            scheduler: Scheduler::default(),
            weights: BTreeMap::new(),
        }
    }

    /// The address, port and protocol of every frontend, the cluster IP first (without
    /// the copies of their states that [`Self::frontends`] makes).
    pub fn frontend_keys(&self) -> impl Iterator<Item = Frontend> + '_ {
        std::iter::once(self.frontend).chain(self.external.iter().map(|f| f.frontend))
    }

    /// Every frontend, the cluster IP first.
    pub fn frontends(&self) -> Vec<FrontendState> {
        let mut all = vec![FrontendState {
            frontend: self.frontend,
            kind: FrontendKind::ClusterIp,
            backends: self.backends.clone(),
            draining: self.draining.clone(),
            when_empty: self.when_empty,
            source_ranges: Vec::new(),
            masquerade: false,
            masquerade_all: self.masquerade_all,
            in_cluster: None,
        }];
        all.extend(self.external.iter().cloned());
        all
    }

    /// Every backend of any frontend (for any client), sorted, without duplicates.
    pub fn all_backends(&self) -> BTreeSet<SocketAddr> {
        self.backends
            .iter()
            .chain(self.external.iter().flat_map(|f| {
                let inner = f.in_cluster.iter().flat_map(|i| i.backends.iter());
                f.backends.iter().chain(inner)
            }))
            .copied()
            .collect()
    }
}

/// The desired state of the whole node, independent of any proxy mode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    pub ports: BTreeMap<ServicePortName, Arc<ServicePortState>>,
}

impl DesiredState {
    /// Computes the desired state; problems (a named port no slice resolves, two services
    /// claiming the same frontend) are returned and the affected pieces skipped.
    pub fn build(store: &ObjectStore, node: &NodeContext) -> (DesiredState, Vec<Problem>) {
        let mut problems = Vec::new();
        let slices_by_service = store.slices_by_service();
        let mut ports = BTreeMap::new();
        let claims = ownership::claims(store, node);
        let owners = ownership::Owners::decide(&claims);
        for claim in claims {
            let slices = slices_by_service
                .get(&claim.svc.name)
                .map(Vec::as_slice)
                .unwrap_or_default();
            let name = claim.name.clone();
            if let Some(state) = build_port(claim, &owners, slices, node, &mut problems, None) {
                ports.insert(name, state);
            }
        }
        (DesiredState { ports }, problems)
    }
}

/// One service port's state from its claims, given who owns the frontends it claims and its
/// Service's EndpointSlices; `None` when it is not served (it lost its cluster IP, or
/// every frontend). Problems found on the way go to `problems`; with `why`, the decisions
/// are recorded there too ([`explain`]).
fn build_port(
    claim: ownership::PortClaims,
    owners: &ownership::Owners,
    slices: &[&Stored<SliceInfo>],
    node: &NodeContext,
    problems: &mut Vec<Problem>,
    mut why: Option<&mut Vec<explain::PortExplanation>>,
) -> Option<Arc<ServicePortState>> {
    let ownership::PortClaims {
        svc,
        origin,
        spec,
        name,
        requests,
        refused,
    } = claim;
    let family = name.family;
    let problem = |kind, message: String| Problem {
        origin: origin.clone(),
        object: format!("Service {}", svc.name),
        message: format!("port {}: {message}", spec.port),
        kind,
    };
    let mut verdicts = Vec::new();
    let explaining = why.is_some();
    let mut verdict = |frontend, kind, field: &ownership::Field, refusal: Option<String>| {
        if explaining {
            verdicts.push(explain::frontend(
                frontend,
                kind,
                &field.to_string(),
                refusal,
            ));
        }
    };
    for (addr, field) in refused {
        problems.push(problem(
            ProblemKind::ExternalIpRefused,
            format!("{field}: {addr} not served: outside --external-ip-cidrs"),
        ));
        let frontend = Frontend {
            addr,
            port: spec.port,
            protocol: spec.protocol,
        };
        verdict(
            frontend,
            field.kind(),
            &field,
            Some("outside --external-ip-cidrs".into()),
        );
    }
    let mut served: Vec<(Frontend, FrontendKind)> = Vec::new();
    let mut lost_cluster_ip = false;
    for request in requests {
        let kind = request.field.kind();
        if let Err(conflict) = owners.check(&name, request.frontend, kind) {
            problems.push(problem(
                ProblemKind::FrontendConflict,
                format!("{}: {conflict}", request.field),
            ));
            lost_cluster_ip |= kind == FrontendKind::ClusterIp;
            verdict(
                request.frontend,
                kind,
                &request.field,
                Some(conflict.to_string()),
            );
            continue;
        }
        if let Some((_, earlier)) = served.iter().find(|(f, _)| *f == request.frontend) {
            problems.push(problem(
                ProblemKind::Invalid,
                format!(
                    "{}: {} is already this port's {earlier:?} frontend; listed once",
                    request.field, request.frontend
                ),
            ));
            verdict(
                request.frontend,
                kind,
                &request.field,
                Some(format!("already this port's {earlier:?} frontend")),
            );
            continue;
        }
        verdict(request.frontend, kind, &request.field, None);
        served.push((request.frontend, kind));
    }
    if lost_cluster_ip || served.is_empty() {
        if let Some(out) = why {
            let reason = if lost_cluster_ip {
                "its cluster IP belongs to another Service, so none of its frontends is served"
            } else {
                "it has no frontend this node serves"
            };
            out.push(explain::unserved(&name, svc, verdicts, reason));
        }
        return None;
    }
    let frontend = served[0].0;
    let external_claimed: Vec<(Frontend, FrontendKind)> = served.into_iter().skip(1).collect();

    let endpoints = resolve_endpoints(spec, family, slices, problems, &svc.name);
    let picked = categorize(&endpoints, node);
    let policy = |local: bool| {
        if local {
            let when_empty = if picked.any_serving {
                WhenEmpty::Drop
            } else {
                WhenEmpty::Refuse
            };
            (picked.local.clone(), when_empty)
        } else {
            (picked.cluster.clone(), WhenEmpty::Refuse)
        }
    };
    let (backends, when_empty) = policy(svc.internal_local);
    let (external_backends, external_when_empty) = policy(svc.external_local);
    // Weight 0 (IPVS's "quiesced"): no new flows, established ones continue.
    let quiesced = |a: &SocketAddr| svc.weights.get(&a.ip()) == Some(&0);
    let (backends, external_backends): (Vec<_>, Vec<_>) = (
        backends.into_iter().filter(|a| !quiesced(a)).collect(),
        external_backends
            .into_iter()
            .filter(|a| !quiesced(a))
            .collect(),
    );
    let draining_for = |local_only: bool, chosen: &[SocketAddr]| {
        let set: BTreeSet<SocketAddr> = endpoints
            .iter()
            .filter(|(a, ep)| (!ep.ready || quiesced(a)) && (!local_only || is_local(ep, node)))
            .map(|(a, _)| *a)
            .filter(|a| !chosen.contains(a))
            .collect();
        set.into_iter().collect::<Vec<_>>()
    };
    let draining = draining_for(svc.internal_local, &backends);
    let external_draining = draining_for(svc.external_local, &external_backends);
    // kube-proxy's short-circuit sends such clients to its cluster-policy chain,
    // whatever internalTrafficPolicy says.
    let in_cluster = svc.external_local.then(|| {
        let backends: Vec<SocketAddr> = picked
            .cluster
            .iter()
            .copied()
            .filter(|a| !quiesced(a))
            .collect();
        InCluster {
            draining: draining_for(false, &backends),
            backends,
        }
    });
    let external: Vec<FrontendState> = external_claimed
        .into_iter()
        .map(|(frontend, kind)| FrontendState {
            frontend,
            kind,
            backends: external_backends.clone(),
            draining: external_draining.clone(),
            when_empty: external_when_empty,
            source_ranges: if kind == FrontendKind::LoadBalancer {
                svc.source_ranges
                    .iter()
                    .filter(|c| IpFamily::of(c.addr) == family)
                    .cloned()
                    .collect()
            } else {
                Vec::new()
            },
            masquerade: !svc.external_local,
            masquerade_all: node.masquerade_all,
            in_cluster: in_cluster.clone(),
        })
        .collect();
    let remote = endpoints
        .iter()
        .filter(|(_, ep)| !is_local(ep, node))
        .map(|(addr, _)| *addr)
        .collect();
    let health_check = svc
        .health_check_node_port
        .filter(|_| svc.external_local)
        .map(|p| (p, picked.local.len()));
    if let Some(out) = why.as_mut() {
        let first: Option<&FrontendState> = external.first();
        out.push(explain::port(explain::Decided {
            name: &name,
            svc,
            node,
            frontends: verdicts,
            endpoints: &endpoints,
            picked: &picked,
            backends: &backends,
            draining: &draining,
            when_empty,
            external: first.map(|f| explain::External {
                backends: &f.backends,
                draining: &f.draining,
                when_empty: f.when_empty,
                in_cluster: f.in_cluster.as_ref(),
            }),
        }));
    }
    Some(Arc::new(ServicePortState {
        name,
        frontend,
        backends,
        draining,
        when_empty,
        masquerade_all: node.masquerade_all,
        external,
        remote,
        affinity_timeout: svc.affinity_timeout,
        health_check,
        scheduler: svc.scheduler.unwrap_or(node.default_scheduler),
        weights: svc
            .weights
            .iter()
            .filter(|(a, _)| IpFamily::of(**a) == family)
            .map(|(a, w)| (*a, *w))
            .collect(),
    }))
}

fn is_local(ep: &EndpointInfo, node: &NodeContext) -> bool {
    ep.node_name.as_deref() == Some(node.name.as_str())
}

/// Endpoints of one service port sorted into the sets kube-proxy's `CategorizeEndpoints`
/// makes, so every proxy mode serves the same ones.
#[derive(Debug, PartialEq, Eq)]
struct Categorized {
    /// For Cluster policy: ready endpoints (in this node's zone when topology applies);
    /// when none is ready anywhere, the serving-and-terminating ones (KEP-1669).
    cluster: Vec<SocketAddr>,
    /// For Local policy: this node's ready endpoints, else its serving-and-terminating ones.
    local: Vec<SocketAddr>,
    /// Some endpoint anywhere is ready or serving-and-terminating.
    any_serving: bool,
    /// `cluster` / `local` hold serving-and-terminating endpoints (none was ready).
    cluster_fallback: bool,
    local_fallback: bool,
    /// How hints applied to `cluster`, and why.
    topology: (Topology, explain::TopologyWhy),
}

fn serving_terminating(ep: &EndpointInfo) -> bool {
    ep.serving && ep.terminating
}

fn categorize(endpoints: &[(SocketAddr, &EndpointInfo)], node: &NodeContext) -> Categorized {
    let pick = |keep: &dyn Fn(&EndpointInfo) -> bool| -> Vec<SocketAddr> {
        let set: BTreeSet<SocketAddr> = endpoints
            .iter()
            .filter(|(_, ep)| keep(ep))
            .map(|(a, _)| *a)
            .collect();
        set.into_iter().collect()
    };
    let topology = topology_mode(endpoints, node);
    let mut cluster = pick(&|ep| ep.ready && topology.0.admits(ep, node));
    let cluster_fallback = cluster.is_empty();
    if cluster_fallback {
        cluster = pick(&serving_terminating);
    }
    let mut local = pick(&|ep| ep.ready && is_local(ep, node));
    let local_fallback = local.is_empty();
    if local_fallback {
        local = pick(&|ep| serving_terminating(ep) && is_local(ep, node));
    }
    let any_serving = endpoints
        .iter()
        .any(|(_, ep)| ep.ready || serving_terminating(ep));
    Categorized {
        cluster_fallback: cluster_fallback && !cluster.is_empty(),
        local_fallback: local_fallback && !local.is_empty(),
        cluster,
        local,
        any_serving,
        topology,
    }
}

/// Which endpoints a Cluster-policy service port keeps on this node: kube-proxy's
/// `topologyModeFromHints` (1.34). The EndpointSlice controller writes the hints when the
/// Service asks (`trafficDistribution: PreferSameNode`, `PreferSameZone` or its old name
/// `PreferClose`, or the `topology-mode: Auto` annotation), so the hints alone decide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Topology {
    /// Every ready endpoint.
    Everywhere,
    /// Those hinted for this node.
    SameNode,
    /// Those hinted for this node's zone.
    SameZone,
}

impl Topology {
    fn admits(self, ep: &EndpointInfo, node: &NodeContext) -> bool {
        match self {
            Topology::Everywhere => true,
            Topology::SameNode => ep.node_hints.contains(&node.name),
            Topology::SameZone => ep
                .zone_hints
                .iter()
                .any(|z| Some(z.as_str()) == node.zone.as_deref()),
        }
    }
}

/// Node hints apply when every ready endpoint has one and one names this node; else zone
/// hints, when every ready endpoint has one and one names this node's zone; else none
/// (hints that would leave this node or zone with nothing are ignored). With the reason,
/// for [`explain`].
fn topology_mode(
    endpoints: &[(SocketAddr, &EndpointInfo)],
    node: &NodeContext,
) -> (Topology, explain::TopologyWhy) {
    use explain::TopologyWhy as Why;
    let ready = || endpoints.iter().map(|(_, ep)| *ep).filter(|ep| ep.ready);
    let all_node_hints = ready().all(|ep| !ep.node_hints.is_empty());
    if all_node_hints && ready().any(|ep| Topology::SameNode.admits(ep, node)) {
        return (Topology::SameNode, Why::ForThisNode);
    }
    let all_zone_hints = ready().all(|ep| !ep.zone_hints.is_empty());
    if node.zone.is_some()
        && all_zone_hints
        && ready().any(|ep| Topology::SameZone.admits(ep, node))
    {
        return (Topology::SameZone, Why::ForThisZone);
    }
    let any_hints = ready().any(|ep| !ep.node_hints.is_empty() || !ep.zone_hints.is_empty());
    let why = if !any_hints {
        Why::NoHints
    } else if !(all_node_hints || all_zone_hints) {
        Why::Incomplete
    } else if all_zone_hints && node.zone.is_none() {
        Why::NodeWithoutZone
    } else {
        Why::NoneForUs
    };
    (Topology::Everywhere, why)
}

/// The endpoints of one service port in one family with their conditions, the target port resolved
/// per slice: the EndpointSlice controller writes each slice's resolved port under the
/// service port's name, and pods whose named port differs land in different slices.
fn resolve_endpoints<'a>(
    spec: &ServicePortSpec,
    family: IpFamily,
    slices: &[&'a Stored<SliceInfo>],
    problems: &mut Vec<Problem>,
    service: &ObjectName,
) -> Vec<(SocketAddr, &'a EndpointInfo)> {
    let mut endpoints = Vec::new();
    for (slice, origin) in slices.iter().map(|e| (&e.0, &e.1)) {
        if slice.address_type != family.address_type() {
            continue;
        }
        let listed = match &slice.ports {
            Some(ports) => match ports
                .iter()
                .find(|p| p.name == spec.name && p.protocol == spec.protocol)
            {
                Some(p) => p.port,
                None => continue, // this slice does not serve this service port
            },
            None => None,
        };
        let port = match (listed, &spec.target_port) {
            (Some(p), _) => p,
            (None, TargetPort::Number(n)) => *n,
            (None, TargetPort::Name(target)) => {
                problems.push(Problem {
                    origin: origin.clone(),
                    object: format!("EndpointSlice {}", slice.name),
                    message: format!(
                        "gives no port number for Service {service} port {:?}, so its \
                         targetPort {target:?} cannot be resolved; endpoints skipped for that port",
                        spec.name
                    ),
                    kind: ProblemKind::Invalid,
                });
                continue;
            }
        };
        for ep in &slice.endpoints {
            if IpFamily::of(ep.addr) == family {
                endpoints.push((SocketAddr::new(ep.addr, port), ep));
            }
        }
    }
    endpoints
}

/// One service port that differs between two desired states.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServiceChange {
    Added(Arc<ServicePortState>),
    Updated {
        old: Arc<ServicePortState>,
        new: Arc<ServicePortState>,
    },
    Removed(Arc<ServicePortState>),
}

impl ServiceChange {
    pub fn name(&self) -> &ServicePortName {
        match self {
            ServiceChange::Added(s) | ServiceChange::Removed(s) => &s.name,
            ServiceChange::Updated { new, .. } => &new.name,
        }
    }

    /// The number of endpoints that changed, for the `endpoint_changes` metrics.
    pub fn endpoint_changes(&self) -> usize {
        match self {
            ServiceChange::Added(s) | ServiceChange::Removed(s) => s.all_backends().len(),
            ServiceChange::Updated { old, new } => old
                .all_backends()
                .symmetric_difference(&new.all_backends())
                .count(),
        }
    }
}

/// A connection-tracking flow that must end: the kernel's entries for `frontend` whose reply
/// comes from `endpoint` (translated to it), or with `endpoint` `None`, from the frontend
/// itself (entries made before the frontend was translated at all).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct StaleFlow {
    pub frontend: Frontend,
    pub endpoint: Option<SocketAddr>,
}

/// The flows that must end after `changes` brought the state to `desired`: a frontend's
/// flows to an endpoint that neither serves nor drains it any more (the endpoint is gone:
/// TCP gets a reset from wherever the next packet lands instead of hanging, and UDP moves
/// to a live endpoint instead of being black-holed, kubernetes#59368), and the
/// untranslated entries of frontends that had no endpoint (or were not programmed yet, as
/// at start-up) and now have one: a UDP client's or a connecting TCP client's packets made
/// an entry without translation while nothing served the address, and would keep matching
/// it (a SYN retransmitted, a client port reused within the entry's lifetime) instead of
/// being translated now.
pub fn stale_flows(changes: &[ServiceChange], desired: &DesiredState) -> Vec<StaleFlow> {
    let pairs = |state: &ServicePortState| -> BTreeSet<(Frontend, SocketAddr)> {
        state
            .frontends()
            .into_iter()
            .flat_map(|f| {
                // Clients on the node have their own endpoints (the short-circuit).
                let inner = f
                    .in_cluster
                    .into_iter()
                    .flat_map(|i| i.backends.into_iter().chain(i.draining));
                f.backends
                    .into_iter()
                    .chain(f.draining)
                    .chain(inner)
                    .map(move |b| (f.frontend, b))
            })
            .collect()
    };
    let served = |state: &ServicePortState| -> BTreeSet<Frontend> {
        state
            .frontends()
            .into_iter()
            .filter(|f| !f.backends.is_empty() || f.short_circuit().is_some())
            .map(|f| f.frontend)
            .collect()
    };
    let mut stale = BTreeSet::new();
    for change in changes {
        let new = desired.ports.get(change.name());
        let (new_pairs, new_served) = new.map_or_else(Default::default, |n| (pairs(n), served(n)));
        let old = match change {
            ServiceChange::Added(_) => None,
            ServiceChange::Updated { old, .. } | ServiceChange::Removed(old) => Some(old),
        };
        let (old_pairs, old_served) = old.map_or_else(Default::default, |o| (pairs(o), served(o)));
        for (frontend, endpoint) in old_pairs.difference(&new_pairs) {
            stale.insert(StaleFlow {
                frontend: *frontend,
                endpoint: Some(*endpoint),
            });
        }
        for frontend in new_served.difference(&old_served) {
            stale.insert(StaleFlow {
                frontend: *frontend,
                endpoint: None,
            });
        }
    }
    stale.into_iter().collect()
}

/// The differences from `old` to `new`, in service-port order.
pub fn diff(old: &DesiredState, new: &DesiredState) -> Vec<ServiceChange> {
    let mut changes = Vec::new();
    for (name, new_state) in &new.ports {
        match old.ports.get(name) {
            None => changes.push(ServiceChange::Added(new_state.clone())),
            Some(old_state) if old_state != new_state => changes.push(ServiceChange::Updated {
                old: old_state.clone(),
                new: new_state.clone(),
            }),
            Some(_) => {}
        }
    }
    for (name, old_state) in &old.ports {
        if !new.ports.contains_key(name) {
            changes.push(ServiceChange::Removed(old_state.clone()));
        }
    }
    changes
}

#[cfg(test)]
mod tests;
