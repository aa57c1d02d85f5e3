//! Why this node uses, or does not use, each endpoint of a Service: the decisions
//! [`build_port`](super::build_port) makes, recorded while it makes them
//! (`proxy-agent inspect explain`). Nothing here decides: every verdict below reads the sets
//! the build chose, and the reason names the rule that put the endpoint there.
//!
//! Field names are part of `inspect explain -o json` (docs/inspect.md): rename none.

use std::{collections::BTreeSet, net::SocketAddr};

use serde::{Deserialize, Serialize};

use super::{
    ownership, Categorized, EndpointInfo, FrontendKind, InCluster, NodeContext, ObjectName,
    ServiceInfo, ServicePortName, SliceInfo, Stored, Topology, WhenEmpty,
};

/// One Service on this node, port by port and family by family.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    /// `namespace/name`.
    pub service: String,
    pub node: String,
    pub zone: Option<String>,
    /// The agent knows the Service (a Service it rejected is not known: its log and the
    /// Service's Events say why).
    pub found: bool,
    /// What the agent reported about this Service's input: fields it could not use,
    /// unresolved named ports, frontend conflicts, external IPs outside
    /// `--external-ip-cidrs`.
    pub problems: Vec<String>,
    /// Why the Service has no port here at all, when it has none.
    pub note: Option<String>,
    pub ports: Vec<PortExplanation>,
}

/// One service port in one family.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortExplanation {
    /// The port's name (may be empty), its protocol and family (`IPv4`, `IPv6`).
    pub port: String,
    pub protocol: String,
    pub family: String,
    /// Some frontend of it is served; when none is, `notServed` says why.
    pub served: bool,
    pub not_served: Option<String>,
    pub frontends: Vec<FrontendVerdict>,
    pub internal_traffic_policy: String,
    pub external_traffic_policy: String,
    /// How topology hints were applied to cluster-policy traffic.
    pub topology: String,
    pub scheduler: String,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub affinity_timeout_seconds: Option<u32>,
    /// What each kind of traffic meets when it has no endpoint (absent: it has some).
    pub when_empty: Vec<Traffic>,
    pub endpoints: Vec<EndpointExplanation>,
}

/// A frontend the port asked for: served, or why not.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FrontendVerdict {
    /// `address:port/PROTOCOL`.
    pub frontend: String,
    /// `ClusterIP`, `NodePort`, `ExternalIP`, `LoadBalancer`.
    pub kind: String,
    /// The Service's field that asked for it.
    pub field: String,
    pub served: bool,
    pub reason: Option<String>,
}

/// What a kind of traffic meets without endpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Traffic {
    /// `clusterIP`, `external` or `externalFromThisNode`.
    pub traffic: String,
    pub outcome: String,
}

/// One endpoint of the port's EndpointSlices and what each kind of traffic does with it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointExplanation {
    pub address: SocketAddr,
    pub node: Option<String>,
    pub zone: Option<String>,
    /// On this node (its `nodeName` is this node's).
    pub local: bool,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub uses: Vec<Use>,
}

/// One kind of traffic's use of one endpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Use {
    /// `clusterIP` (the cluster IP: internalTrafficPolicy), `external` (NodePorts,
    /// external and load-balancer IPs: externalTrafficPolicy) or `externalFromThisNode`
    /// (the same frontends for clients on this node and its pods under
    /// `externalTrafficPolicy: Local`: kube-proxy's short-circuit).
    pub traffic: String,
    /// `serving` (takes new connections), `draining` (keeps its established ones only)
    /// or `unused`.
    pub state: String,
    pub reason: String,
}

/// Why topology hints applied or not, as [`super::topology_mode`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TopologyWhy {
    NoHints,
    /// Node hints, one naming this node.
    ForThisNode,
    /// Zone hints, one naming this node's zone.
    ForThisZone,
    /// Some ready endpoint has no hint.
    Incomplete,
    /// Every ready endpoint has one, none for this node or its zone.
    NoneForUs,
    /// Zone hints, but the node has no zone.
    NodeWithoutZone,
}

impl TopologyWhy {
    fn describe(self, node: &NodeContext) -> String {
        let zone = node.zone.as_deref().unwrap_or("");
        match self {
            TopologyWhy::NoHints => "no topology hints: every ready endpoint is used".into(),
            TopologyWhy::ForThisNode => {
                "node hints used: every ready endpoint has one and some name this node".into()
            }
            TopologyWhy::ForThisZone => format!(
                "zone hints used: every ready endpoint has one and some name this node's zone {zone}"
            ),
            TopologyWhy::Incomplete => {
                "hints ignored: some ready endpoint has none, so every ready endpoint is used"
                    .into()
            }
            TopologyWhy::NoneForUs => format!(
                "hints ignored: none names this node or its zone{}, so every ready endpoint is used",
                if zone.is_empty() { String::new() } else { format!(" {zone}") }
            ),
            TopologyWhy::NodeWithoutZone => {
                "zone hints ignored: this node has no topology.kubernetes.io/zone label".into()
            }
        }
    }
}

/// What the build decided for one service port, by reference, for [`port`].
pub(super) struct Decided<'a> {
    pub name: &'a ServicePortName,
    pub svc: &'a ServiceInfo,
    pub node: &'a NodeContext,
    pub frontends: Vec<FrontendVerdict>,
    pub endpoints: &'a [(SocketAddr, &'a EndpointInfo)],
    pub picked: &'a Categorized,
    pub backends: &'a [SocketAddr],
    pub draining: &'a [SocketAddr],
    pub when_empty: WhenEmpty,
    /// Present when the port has external frontends.
    pub external: Option<External<'a>>,
}

pub(super) struct External<'a> {
    pub backends: &'a [SocketAddr],
    pub draining: &'a [SocketAddr],
    pub when_empty: WhenEmpty,
    pub in_cluster: Option<&'a InCluster>,
}

pub(super) fn frontend(
    frontend: super::Frontend,
    kind: FrontendKind,
    field: &str,
    refusal: Option<String>,
) -> FrontendVerdict {
    FrontendVerdict {
        frontend: frontend.to_string(),
        kind: kind.name().into(),
        field: field.into(),
        served: refusal.is_none(),
        reason: refusal,
    }
}

fn policy(local: bool) -> String {
    if local { "Local" } else { "Cluster" }.into()
}

fn family(name: &ServicePortName) -> String {
    name.family.name().into()
}

/// A port that is not served at all.
pub(super) fn unserved(
    name: &ServicePortName,
    svc: &ServiceInfo,
    frontends: Vec<FrontendVerdict>,
    why: &str,
) -> PortExplanation {
    PortExplanation {
        port: name.port.clone(),
        protocol: name.protocol.to_string(),
        family: family(name),
        served: false,
        not_served: Some(why.into()),
        frontends,
        internal_traffic_policy: policy(svc.internal_local),
        external_traffic_policy: policy(svc.external_local),
        ..PortExplanation::default()
    }
}

/// The explanation of a served port from what the build decided.
pub(super) fn port(d: Decided<'_>) -> PortExplanation {
    let is_local = |ep: &EndpointInfo| super::is_local(ep, d.node);
    let weight_zero = |a: &SocketAddr| d.svc.weights.get(&a.ip()) == Some(&0);
    let mut when_empty = Vec::new();
    let mut empty = |traffic: &str, backends: &[SocketAddr], outcome: WhenEmpty| {
        if backends.is_empty() {
            when_empty.push(Traffic {
                traffic: traffic.into(),
                outcome: match outcome {
                    WhenEmpty::Refuse => {
                        "refused: no endpoint serves anywhere (TCP reset, ICMP unreachable)"
                    }
                    WhenEmpty::Drop => {
                        "dropped: the policy is Local and this node has no serving endpoint"
                    }
                }
                .into(),
            });
        }
    };
    empty("clusterIP", d.backends, d.when_empty);
    if let Some(x) = &d.external {
        empty("external", x.backends, x.when_empty);
        if let Some(inner) = x.in_cluster {
            empty("externalFromThisNode", &inner.backends, WhenEmpty::Refuse);
        }
    }
    let endpoints = d
        .endpoints
        .iter()
        .map(|(addr, ep)| {
            let verdict = |traffic: &str,
                           local_policy: bool,
                           chosen: &[SocketAddr],
                           draining: &[SocketAddr]| {
                let (state, reason) = if chosen.contains(addr) {
                    ("serving", serving_reason(d.picked, local_policy, d.node))
                } else if draining.contains(addr) {
                    ("draining", draining_reason(ep, weight_zero(addr)))
                } else {
                    (
                        "unused",
                        unused_reason(ep, local_policy, is_local(ep), d.picked, d.node),
                    )
                };
                Use {
                    traffic: traffic.into(),
                    state: state.into(),
                    reason,
                }
            };
            let mut uses = vec![verdict(
                "clusterIP",
                d.svc.internal_local,
                d.backends,
                d.draining,
            )];
            if let Some(x) = &d.external {
                uses.push(verdict(
                    "external",
                    d.svc.external_local,
                    x.backends,
                    x.draining,
                ));
                if let Some(inner) = x.in_cluster {
                    uses.push(verdict(
                        "externalFromThisNode",
                        false,
                        &inner.backends,
                        &inner.draining,
                    ));
                }
            }
            EndpointExplanation {
                address: *addr,
                node: ep.node_name.clone(),
                zone: ep.zone.clone(),
                local: is_local(ep),
                ready: ep.ready,
                serving: ep.serving,
                terminating: ep.terminating,
                uses,
            }
        })
        .collect();
    PortExplanation {
        port: d.name.port.clone(),
        protocol: d.name.protocol.to_string(),
        family: family(d.name),
        served: true,
        not_served: None,
        frontends: d.frontends,
        internal_traffic_policy: policy(d.svc.internal_local),
        external_traffic_policy: policy(d.svc.external_local),
        topology: d.picked.topology.1.describe(d.node),
        scheduler: d
            .svc
            .scheduler
            .unwrap_or(d.node.default_scheduler)
            .name()
            .into(),
        affinity_timeout_seconds: d.svc.affinity_timeout,
        when_empty,
        endpoints,
    }
}

fn serving_reason(picked: &Categorized, local_policy: bool, node: &NodeContext) -> String {
    if local_policy {
        return if picked.local_fallback {
            "serving and terminating on this node: used because no endpoint on this node is ready"
                .into()
        } else {
            "ready, on this node (policy Local)".into()
        };
    }
    if picked.cluster_fallback {
        return "serving and terminating: used because no endpoint is ready anywhere".into();
    }
    match picked.topology.0 {
        Topology::Everywhere => "ready".into(),
        Topology::SameNode => "ready, hinted for this node".into(),
        Topology::SameZone => format!(
            "ready, hinted for this node's zone {}",
            node.zone.as_deref().unwrap_or("")
        ),
    }
}

fn draining_reason(ep: &EndpointInfo, weight_zero: bool) -> String {
    if weight_zero {
        "weight 0: no new connections; established ones continue".into()
    } else if ep.terminating {
        "terminating: no new connections; established ones continue until it is removed".into()
    } else {
        "not ready: no new connections; established ones continue until it is ready or removed"
            .into()
    }
}

fn unused_reason(
    ep: &EndpointInfo,
    local_policy: bool,
    local: bool,
    picked: &Categorized,
    node: &NodeContext,
) -> String {
    if local_policy && !local {
        return format!(
            "on {}: the policy is Local, so only this node's endpoints are used",
            ep.node_name.as_deref().map_or_else(
                || "no node (the slice names none)".to_string(),
                |n| format!("node {n}")
            )
        );
    }
    if ep.ready && !local_policy && !picked.topology.0.admits(ep, node) {
        let hints: Vec<&str> = match picked.topology.0 {
            Topology::SameNode => ep.node_hints.iter().map(String::as_str).collect(),
            _ => ep.zone_hints.iter().map(String::as_str).collect(),
        };
        return format!(
            "ready, but topology hints keep this traffic to {}; this endpoint is hinted for {}",
            match picked.topology.0 {
                Topology::SameNode => "endpoints hinted for this node".to_string(),
                _ => format!(
                    "endpoints hinted for zone {}",
                    node.zone.as_deref().unwrap_or("")
                ),
            },
            hints.join(", ")
        );
    }
    if ep.serving && ep.terminating {
        return "serving and terminating: unused while another endpoint is ready".into();
    }
    "neither ready nor serving".into()
}

/// The explanation of `service` (`svc`, when the agent holds it), building its ports
/// from `claims` (every claim of the Services that share a frontend with it, as an update
/// rebuilds them) with their owners decided among those claims, so conflicts come out as
/// the model decided them.
pub(super) fn explain(
    service: &ObjectName,
    svc: Option<&ServiceInfo>,
    node: &NodeContext,
    claims: Vec<ownership::PortClaims>,
    slices: &[&Stored<SliceInfo>],
) -> Explanation {
    let mut out = Explanation {
        service: service.to_string(),
        node: node.name.clone(),
        zone: node.zone.clone(),
        found: svc.is_some(),
        ..Explanation::default()
    };
    let owners = ownership::Owners::decide(&claims);
    let mut problems = Vec::new();
    for claim in claims.into_iter().filter(|c| c.svc.name == *service) {
        super::build_port(
            claim,
            &owners,
            slices,
            node,
            &mut problems,
            Some(&mut out.ports),
        );
    }
    let mut seen = BTreeSet::new();
    out.problems = problems
        .into_iter()
        .map(|p| p.message)
        .filter(|p| seen.insert(p.clone()))
        .collect();
    out.note = match svc {
        None => Some(
            "not known to the agent: no such Service, or it was rejected (see problems, the agent's log and the Service's Events)".into(),
        ),
        Some(svc) if svc.cluster_ips.is_empty() => Some(
            "no cluster IP (headless or ExternalName): no proxy serves it; clients reach the endpoints through DNS".into(),
        ),
        Some(svc) if svc.ports.is_empty() => Some("the Service has no ports".into()),
        Some(_) => None,
    };
    out
}

#[cfg(test)]
mod tests;
