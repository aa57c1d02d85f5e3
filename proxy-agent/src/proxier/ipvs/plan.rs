//! What one service port asks of the ipvs mode: its IPVS virtual servers with their real
//! servers, the addresses `kube-ipvs0` must hold, its ipset entries, and its filter rules
//! (refusals, drops, source ranges). kube-proxy's ipvs layout, spelled from the model's
//! decisions: which endpoints serve each frontend, which drain, what is masqueraded.

use crate::proxier::iptables::rules::local_match;
use std::{fmt::Write as _, net::IpAddr};

use super::ipset::SetKind;
use crate::{
    model::{local::LocalMatch, FrontendKind, FrontendState, Scheduler, ServicePortState},
    proxier::ipvs::netlink::{RealServer, VirtualServer},
    proxier::{iptables::rules::refusal, naming::protocol},
};

/// Everything one service port contributes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PortPlan {
    /// Virtual servers with their real servers (weight 0: draining).
    pub servers: Vec<(VirtualServer, Vec<RealServer>)>,
    /// Addresses `kube-ipvs0` holds for it (cluster, external and load-balancer IPs).
    pub addresses: Vec<IpAddr>,
    /// ipset entries.
    pub entries: Vec<(SetKind, String)>,
    /// filter `KUBE-SERVICES` lines.
    pub filter: Vec<String>,
}

/// IPVS has no "random": kube-proxy's ipvs mode defaults to round robin.
pub fn scheduler_name(s: Scheduler) -> &'static str {
    match s {
        Scheduler::Random => "rr",
        other => other.name(),
    }
}

/// `10.96.0.10,tcp:80` (ipset `hash:ip,port`).
fn ip_port(addr: IpAddr, proto: &str, port: u16) -> String {
    format!("{addr},{proto}:{port}")
}

fn host(addr: IpAddr) -> String {
    match addr {
        IpAddr::V4(a) => format!("{a}/32"),
        IpAddr::V6(a) => format!("{a}/128"),
    }
}

/// The plan of `state`; `local` (this family's detector) tells pods from other clients.
pub fn plan(state: &ServicePortState, local: Option<&LocalMatch>) -> PortPlan {
    let mut p = PortPlan::default();
    let proto = protocol(state.name.protocol);
    let name = &state.name;
    let weight = |addr: IpAddr| state.weights.get(&addr).copied().unwrap_or(1) as u32;
    let mut any_external_masquerade = false;
    for f in state.frontends() {
        let FrontendState {
            frontend,
            kind,
            mut backends,
            mut draining,
            ..
        } = f.clone();
        let entry = ip_port(frontend.addr, proto, frontend.port);
        if kind != FrontendKind::NodePort && !p.addresses.contains(&frontend.addr) {
            p.addresses.push(frontend.addr);
        }
        p.entries.push((
            if kind == FrontendKind::ClusterIp {
                SetKind::ClusterIp
            } else {
                SetKind::External
            },
            entry.clone(),
        ));
        if f.masquerade_all {
            p.entries.push((SetKind::MasqueradeAll, entry.clone()));
        } else if f.masquerade && kind.is_external() {
            p.entries.push((SetKind::ExternalMasquerade, entry.clone()));
            any_external_masquerade = true;
        }
        if backends.is_empty() {
            if let (Some(_), Some(inner)) = (f.short_circuit(), &f.in_cluster) {
                // externalTrafficPolicy: Local with no endpoint on this node. A virtual
                // server has one set of real servers: as kube-proxy's ipvs mode, it takes
                // every endpoint, so the node's pods and processes are served; the rest
                // of the world is still dropped, before IPVS sees it. (With a local
                // endpoint, clients on the node get only the local ones, as there.)
                let matches = format!(
                    "-m comment --comment \"{name} clients on this node\" -d {} -p {proto} -m {proto} --dport {}",
                    host(frontend.addr),
                    frontend.port
                );
                if let Some(local) = local {
                    p.filter.push(format!(
                        "-A KUBE-SERVICES {matches} {} -j RETURN",
                        local_match(local, false)
                    ));
                }
                p.filter.push(format!(
                    "-A KUBE-SERVICES {matches} -m addrtype --src-type LOCAL -j RETURN"
                ));
                (backends, draining) = (inner.backends.clone(), inner.draining.clone());
            }
            p.filter.push(refusal(state, kind, &frontend, f.when_empty));
        }
        if !f.source_ranges.is_empty() {
            let matches = format!(
                "-m comment --comment \"{name} loadBalancerSourceRanges\" -d {} -p {proto} -m {proto} --dport {}",
                host(frontend.addr),
                frontend.port
            );
            for c in &f.source_ranges {
                p.filter.push(format!(
                    "-A KUBE-SERVICES {matches} -s {}/{} -j RETURN",
                    c.addr, c.prefix
                ));
            }
            p.filter.push(format!("-A KUBE-SERVICES {matches} -j DROP"));
        }
        if backends.is_empty() && draining.is_empty() {
            continue;
        }
        let mut reals: Vec<RealServer> = backends
            .iter()
            .map(|b| RealServer {
                addr: *b,
                weight: weight(b.ip()),
                connections: (0, 0),
            })
            .collect();
        // Draining endpoints stay with weight 0: established connections continue, new
        // ones go elsewhere (kube-proxy's graceful termination).
        reals.extend(
            draining
                .iter()
                .filter(|d| !backends.contains(d))
                .map(|d| RealServer {
                    addr: *d,
                    weight: 0,
                    connections: (0, 0),
                }),
        );
        p.servers.push((
            VirtualServer {
                frontend,
                scheduler: scheduler_name(state.scheduler).to_string(),
                persistence: state.affinity_timeout,
            },
            reals,
        ));
    }
    for ep in state.all_backends() {
        let mut hairpin = ip_port(ep.ip(), proto, ep.port());
        let _ = write!(hairpin, ",{}", ep.ip());
        p.entries.push((SetKind::LoopBack, hairpin));
        if any_external_masquerade && state.remote.contains(&ep) {
            p.entries
                .push((SetKind::RemoteEndpoint, ip_port(ep.ip(), proto, ep.port())));
        }
    }
    p
}
