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

use std::{collections::BTreeMap, fmt, net::IpAddr};

use super::{
    Cidr, Frontend, FrontendKind, IpFamily, NodeContext, ObjectName, ObjectStore, Origin,
    ServiceInfo, ServicePortName, ServicePortSpec, ServiceType,
};

/// Every service port of the store in one family: a dual-stack Service gives two.
pub(super) fn service_ports(
    store: &ObjectStore,
) -> impl Iterator<Item = (&ServiceInfo, &Origin, IpAddr)> {
    store.services.values().flat_map(|(svc, origin)| {
        let mut seen = std::collections::BTreeSet::new();
        // `clusterIPs` holds at most one address per family (the API server enforces it).
        svc.cluster_ips
            .iter()
            .filter(move |ip| seen.insert(IpFamily::of(**ip)))
            .map(move |ip| (svc, origin, *ip))
    })
}

/// A frontend a service port asks for, and the field that asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Request {
    pub frontend: Frontend,
    pub kind: FrontendKind,
    /// The object field, for messages (`spec.externalIPs[1]`).
    pub field: String,
}

/// Every frontend a service port asks for, the cluster IP first, and the external IPs the
/// node's policy refuses (with the field that listed them).
pub(super) fn requests(
    svc: &ServiceInfo,
    cluster_ip: IpAddr,
    index: usize,
    spec: &ServicePortSpec,
    node: &NodeContext,
) -> (Vec<Request>, Vec<(IpAddr, String)>) {
    let family = IpFamily::of(cluster_ip);
    let frontend = |addr, port| Frontend {
        addr,
        port,
        protocol: spec.protocol,
    };
    let mut wanted = vec![Request {
        frontend: frontend(cluster_ip, spec.port),
        kind: FrontendKind::ClusterIp,
        field: "spec.clusterIPs".into(),
    }];
    let mut refused = Vec::new();
    if let (Some(node_port), ServiceType::NodePort | ServiceType::LoadBalancer) =
        (spec.node_port, svc.service_type)
    {
        for addr in node
            .node_port_addresses
            .iter()
            .filter(|a| IpFamily::of(**a) == family)
        {
            wanted.push(Request {
                frontend: frontend(*addr, node_port),
                kind: FrontendKind::NodePort,
                field: format!("spec.ports[{index}].nodePort"),
            });
        }
    }
    for (i, addr) in svc.external_ips.iter().enumerate() {
        if IpFamily::of(*addr) != family {
            continue;
        }
        let field = format!("spec.externalIPs[{i}]");
        if !external_ip_allowed(&node.external_ip_cidrs, *addr) {
            refused.push((*addr, field));
            continue;
        }
        wanted.push(Request {
            frontend: frontend(*addr, spec.port),
            kind: FrontendKind::ExternalIp,
            field,
        });
    }
    for (i, addr) in svc.load_balancer_ips.iter().enumerate() {
        if IpFamily::of(*addr) == family {
            wanted.push(Request {
                frontend: frontend(*addr, spec.port),
                kind: FrontendKind::LoadBalancer,
                field: format!("status.loadBalancer.ingress[{i}].ip"),
            });
        }
    }
    (wanted, refused)
}

/// Whether the `--external-ip-cidrs` policy lets `addr` be served (no CIDRs: every address).
pub fn external_ip_allowed(cidrs: &[Cidr], addr: IpAddr) -> bool {
    cidrs.is_empty() || cidrs.iter().any(|c| c.contains(addr))
}

/// How strong a claim is; the smallest wins.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    kind: u8,
    /// `creationTimestamp` in seconds; unknown (a manifest without one) sorts last.
    created: i64,
    service: ObjectName,
    port: ServicePortName,
}

fn kind_rank(kind: FrontendKind) -> u8 {
    match kind {
        FrontendKind::ClusterIp => 0,
        FrontendKind::NodePort => 1,
        FrontendKind::ExternalIp | FrontendKind::LoadBalancer => 2,
    }
}

/// The service port that serves a contested frontend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub port: ServicePortName,
    pub kind: FrontendKind,
    rank: Rank,
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
    contested: BTreeMap<Frontend, Owner>,
}

impl Owners {
    /// Decides every contested frontend of `store` on `node`.
    pub fn decide(store: &ObjectStore, node: &NodeContext) -> Owners {
        let mut claims: BTreeMap<Frontend, Vec<Owner>> = BTreeMap::new();
        let all: Vec<(Request, Rank)> = service_ports(store)
            .flat_map(|(svc, _, cluster_ip)| {
                svc.ports.iter().enumerate().flat_map(move |(i, spec)| {
                    let port = ServicePortName {
                        service: svc.name.clone(),
                        port: spec.name.clone(),
                        protocol: spec.protocol,
                        family: IpFamily::of(cluster_ip),
                    };
                    requests(svc, cluster_ip, i, spec, node)
                        .0
                        .into_iter()
                        .map(move |r| {
                            let rank = Rank {
                                kind: kind_rank(r.kind),
                                created: svc.created.unwrap_or(i64::MAX),
                                service: svc.name.clone(),
                                port: port.clone(),
                            };
                            (r, rank)
                        })
                })
            })
            .collect();
        // Cluster IPs first: a port that loses its cluster IP is not served, so its other
        // frontends must not take anything from anyone.
        let mut cluster_owner: BTreeMap<Frontend, Rank> = BTreeMap::new();
        for (r, rank) in all
            .iter()
            .filter(|(r, _)| r.kind == FrontendKind::ClusterIp)
        {
            let best = cluster_owner
                .entry(r.frontend)
                .or_insert_with(|| rank.clone());
            if rank < best {
                *best = rank.clone();
            }
        }
        let lost_cluster_ip = |rank: &Rank, cluster: &Frontend| {
            cluster_owner
                .get(cluster)
                .is_some_and(|best| best.port != rank.port)
        };
        let cluster_of: BTreeMap<&ServicePortName, Frontend> = all
            .iter()
            .filter(|(r, _)| r.kind == FrontendKind::ClusterIp)
            .map(|(r, rank)| (&rank.port, r.frontend))
            .collect();
        for (r, rank) in &all {
            if r.kind != FrontendKind::ClusterIp
                && cluster_of
                    .get(&rank.port)
                    .is_some_and(|c| lost_cluster_ip(rank, c))
            {
                continue;
            }
            claims.entry(r.frontend).or_default().push(Owner {
                port: rank.port.clone(),
                kind: r.kind,
                rank: rank.clone(),
            });
        }
        let contested = claims
            .into_iter()
            .filter(|(_, owners)| owners.iter().any(|o| o.port != owners[0].port))
            .filter_map(|(frontend, owners)| {
                owners
                    .into_iter()
                    .min_by(|a, b| a.rank.cmp(&b.rank))
                    .map(|o| (frontend, o))
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
            Some(owner) if owner.port != *port => Err(Conflict {
                frontend,
                kind,
                owner: owner.port.clone(),
                owner_kind: owner.kind,
            }),
            _ => Ok(()),
        }
    }
}
