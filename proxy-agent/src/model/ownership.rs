//! Who serves a frontend (address:port:protocol) that more than one service port claims.
//!
//! Decided over every Service before any service port is built, so the answer does not
//! depend on the order objects arrive in or on their names, and only the losing *frontend*
//! is dropped, never its Service's other frontends:
//!
//! 1. a cluster IP wins: the API server allocated it, no tenant chose it (kube-proxy lets an
//!    `externalIPs` entry take it over, CVE-2020-8554);
//! 2. then a NodePort on a node address (also allocated by the API server);
//! 3. between external-IP and load-balancer-IP claims, the older Service wins
//!    (`creationTimestamp`, then namespace/name).
//!
//! Two cluster IPs can only collide in hand-written manifests; the older Service wins there
//! too, and the loser's whole service port is skipped (its other frontends claim nothing).
//! `externalIPs` outside `--external-ip-cidrs` (when set) claim nothing either.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use super::{
    Cidr, Frontend, FrontendKind, IpFamily, NodeContext, ObjectStore, Origin, ServiceInfo,
    ServicePortName, ServicePortSpec, ServiceType,
};

/// The field of a Service that asks for a frontend, named in messages; it also says which
/// kind of frontend the request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Field {
    ClusterIp,
    /// `spec.ports[i].nodePort`.
    NodePort(usize),
    /// `spec.externalIPs[i]`.
    ExternalIp(usize),
    /// `status.loadBalancer.ingress[i].ip`.
    LoadBalancer(usize),
}

impl Field {
    pub fn kind(self) -> FrontendKind {
        match self {
            Field::ClusterIp => FrontendKind::ClusterIp,
            Field::NodePort(_) => FrontendKind::NodePort,
            Field::ExternalIp(_) => FrontendKind::ExternalIp,
            Field::LoadBalancer(_) => FrontendKind::LoadBalancer,
        }
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Field::ClusterIp => f.write_str("spec.clusterIPs"),
            Field::NodePort(i) => write!(f, "spec.ports[{i}].nodePort"),
            Field::ExternalIp(i) => write!(f, "spec.externalIPs[{i}]"),
            Field::LoadBalancer(i) => write!(f, "status.loadBalancer.ingress[{i}].ip"),
        }
    }
}

/// A frontend a service port asks for, and the field that asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Request {
    pub frontend: Frontend,
    pub field: Field,
}

/// One service port (one family of one port of a Service) and the frontends it asks for.
pub(super) struct PortClaims<'a> {
    pub svc: &'a ServiceInfo,
    pub origin: &'a Origin,
    pub spec: &'a ServicePortSpec,
    pub name: ServicePortName,
    /// The cluster IP first.
    pub requests: Vec<Request>,
    /// External IPs the node's `--external-ip-cidrs` refuses.
    pub refused: Vec<(IpAddr, Field)>,
}

/// Every service port of the store with what it asks for: a dual-stack Service gives one
/// per family. Computed once per build; [`Owners::decide`] and the build both read it.
pub(super) fn claims<'a>(store: &'a ObjectStore, node: &NodeContext) -> Vec<PortClaims<'a>> {
    let mut all = Vec::new();
    for (svc, origin) in store.services.values() {
        claims_of(svc, origin, node, &mut all);
    }
    all
}

/// One Service's service ports with what they ask for, appended to `out`.
pub(super) fn claims_of<'a>(
    svc: &'a ServiceInfo,
    origin: &'a Origin,
    node: &NodeContext,
    out: &mut Vec<PortClaims<'a>>,
) {
    // `clusterIPs` holds at most one address per family (the API server enforces it).
    let mut seen = BTreeSet::new();
    for cluster_ip in svc
        .cluster_ips
        .iter()
        .filter(|ip| seen.insert(IpFamily::of(**ip)))
    {
        for (index, spec) in svc.ports.iter().enumerate() {
            let (requests, refused) = requests(svc, *cluster_ip, index, spec, node);
            out.push(PortClaims {
                svc,
                origin,
                spec,
                name: ServicePortName {
                    service: svc.name.clone(),
                    port: spec.name.clone(),
                    protocol: spec.protocol,
                    family: IpFamily::of(*cluster_ip),
                },
                requests,
                refused,
            });
        }
    }
}

/// Every frontend a service port asks for, the cluster IP first, and the external IPs the
/// node's policy refuses.
fn requests(
    svc: &ServiceInfo,
    cluster_ip: IpAddr,
    index: usize,
    spec: &ServicePortSpec,
    node: &NodeContext,
) -> (Vec<Request>, Vec<(IpAddr, Field)>) {
    let family = IpFamily::of(cluster_ip);
    let request = |addr, port, field| Request {
        frontend: Frontend {
            addr,
            port,
            protocol: spec.protocol,
        },
        field,
    };
    let mut wanted = vec![request(cluster_ip, spec.port, Field::ClusterIp)];
    let mut refused = Vec::new();
    if let (Some(node_port), ServiceType::NodePort | ServiceType::LoadBalancer) =
        (spec.node_port, svc.service_type)
    {
        for addr in node
            .node_port_addresses
            .iter()
            .filter(|a| IpFamily::of(**a) == family)
        {
            wanted.push(request(*addr, node_port, Field::NodePort(index)));
        }
    }
    for (i, addr) in svc.external_ips.iter().enumerate() {
        if IpFamily::of(*addr) != family {
            continue;
        }
        if external_ip_allowed(&node.external_ip_cidrs, *addr) {
            wanted.push(request(*addr, spec.port, Field::ExternalIp(i)));
        } else {
            refused.push((*addr, Field::ExternalIp(i)));
        }
    }
    for (i, addr) in svc.load_balancer_ips.iter().enumerate() {
        if IpFamily::of(*addr) == family {
            wanted.push(request(*addr, spec.port, Field::LoadBalancer(i)));
        }
    }
    (wanted, refused)
}

/// Whether the `--external-ip-cidrs` policy lets `addr` be served (no CIDRs: every address).
pub fn external_ip_allowed(cidrs: &[Cidr], addr: IpAddr) -> bool {
    cidrs.is_empty() || cidrs.iter().any(|c| c.contains(addr))
}

/// How strong a claim is; the smallest wins. The port name sorts by Service first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Rank<'a> {
    kind: u8,
    /// `creationTimestamp` in seconds; unknown (a manifest without one) sorts last.
    created: i64,
    port: &'a ServicePortName,
}

impl<'a> Rank<'a> {
    fn of(claim: &'a PortClaims, kind: FrontendKind) -> Self {
        Rank {
            kind: match kind {
                FrontendKind::ClusterIp => 0,
                FrontendKind::NodePort => 1,
                FrontendKind::ExternalIp | FrontendKind::LoadBalancer => 2,
            },
            created: claim.svc.created.unwrap_or(i64::MAX),
            port: &claim.name,
        }
    }
}

/// A frontend a service port asked for and does not get.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    pub frontend: Frontend,
    pub kind: FrontendKind,
    pub owner: ServicePortName,
    pub owner_kind: FrontendKind,
}

impl fmt::Display for Conflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (frontend, owner) = (self.frontend, &self.owner);
        match (self.owner_kind, self.kind) {
            (FrontendKind::ClusterIp, FrontendKind::ClusterIp) => write!(
                f,
                "{frontend} not served: it is also the cluster IP of {owner}, an older Service"
            ),
            (FrontendKind::ClusterIp, _) => write!(
                f,
                "{frontend} not served: it is the cluster IP of {owner} (a cluster IP always wins)"
            ),
            (FrontendKind::NodePort, _) => write!(
                f,
                "{frontend} not served: it is the NodePort of {owner} on this node (a NodePort wins over external and load-balancer IPs)"
            ),
            _ => write!(
                f,
                "{frontend} not served: {owner} claimed it first (the older Service wins)"
            ),
        }
    }
}

/// The owner of every frontend claimed by more than one service port (uncontested
/// frontends are not listed: their one claimant serves them).
#[derive(Debug, Default)]
pub struct Owners {
    /// Frontend → (owning service port, as what).
    contested: BTreeMap<Frontend, (ServicePortName, FrontendKind)>,
}

impl Owners {
    /// Decides every contested frontend among `claims`.
    pub(super) fn decide(claims: &[PortClaims]) -> Owners {
        // Cluster IPs first: a port that loses its cluster IP is not served, so its other
        // frontends must not take anything from anyone.
        let mut cluster_owner: BTreeMap<Frontend, Rank> = BTreeMap::new();
        for claim in claims {
            let rank = Rank::of(claim, FrontendKind::ClusterIp);
            let best = cluster_owner
                .entry(claim.requests[0].frontend)
                .or_insert(rank);
            *best = (*best).min(rank);
        }
        let mut claimants: BTreeMap<Frontend, Vec<(Rank, FrontendKind)>> = BTreeMap::new();
        for claim in claims {
            let lost = cluster_owner[&claim.requests[0].frontend].port != &claim.name;
            for request in &claim.requests {
                let kind = request.field.kind();
                if lost && kind != FrontendKind::ClusterIp {
                    continue;
                }
                claimants
                    .entry(request.frontend)
                    .or_default()
                    .push((Rank::of(claim, kind), kind));
            }
        }
        let contested = claimants
            .into_iter()
            .filter(|(_, all)| all.iter().any(|(r, _)| r.port != all[0].0.port))
            .filter_map(|(frontend, all)| {
                let (rank, kind) = all.into_iter().min_by_key(|(r, _)| *r)?;
                Some((frontend, (rank.port.clone(), kind)))
            })
            .collect();
        Owners { contested }
    }

    /// Whether `port` may serve `frontend` as `kind`; the conflict when it may not.
    pub fn check(
        &self,
        port: &ServicePortName,
        frontend: Frontend,
        kind: FrontendKind,
    ) -> Result<(), Conflict> {
        match self.contested.get(&frontend) {
            Some((owner, owner_kind)) if owner != port => Err(Conflict {
                frontend,
                kind,
                owner: owner.clone(),
                owner_kind: *owner_kind,
            }),
            _ => Ok(()),
        }
    }
}
