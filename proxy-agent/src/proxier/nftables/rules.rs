//! kube-proxy's nftables design, generated from one service port's state: a table per
//! family (`ip kube-proxy`, `ip6 kube-proxy`; beyond 1 000 service ports, more beside it,
//! see "Tables" in [`super`]), verdict maps keyed by destination
//! (`service-ips`: address . protocol . port, `service-nodeports`: protocol . port, and
//! `no-endpoint-services` for the filter hooks), a chain per service port that picks an
//! endpoint with `numgen random` (a cascade, see [`service_rules`]), a chain per endpoint
//! that DNATs.
//!
//! ```text
//! nat-prerouting/nat-output -> services: ip daddr . meta l4proto . th dport vmap @service-ips
//!                                        ip daddr @nodeport-ips ... vmap @service-nodeports
//! service-<hash>-ns/name/tcp/port: numgen random mod N-i == 0 goto endpoint-... (each i)
//! external-<hash>-...: mark for (remote) masquerade, goto the service chain; under
//!     externalTrafficPolicy: Local, pods (saddr in the cluster CIDR) and the node (fib
//!     saddr type local, masqueraded) first goto the chain of every endpoint
//! endpoint-<hash>-...__<ip>/<port>: dnat to <ip>:<port>
//! filter-input/forward/output (ct state new): vmap @no-endpoint-services (reject / drop)
//! ```
//!
//! The semantics (which endpoints, masquerade, affinity) are the model's, spelled as the
//! iptables mode spells them (see `proxier::iptables::rules`).

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use crate::{
    model::{local::LocalMatch, Cidr, FrontendKind, IpFamily, ServicePortState, WhenEmpty},
    proxier::naming::{hash, port_key, protocol},
};

/// What the rules of every service port share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleContext {
    pub family: IpFamily,
    pub masquerade_mark: u32,
    /// See `proxier::iptables::rules::RuleContext::remote_masquerade_mark`.
    pub remote_masquerade_mark: u32,
    /// How this family's pods are told apart (`detectLocalMode`).
    pub local: Option<LocalMatch>,
    pub masquerade_addr: Option<IpAddr>,
}

impl RuleContext {
    pub fn new(family: IpFamily, masquerade_bit: u32, local: Option<LocalMatch>) -> Self {
        let bit = masquerade_bit.clamp(1, 31);
        RuleContext {
            family,
            masquerade_mark: 1 << bit,
            remote_masquerade_mark: 1 << (bit - 1),
            local,
            masquerade_addr: None,
        }
    }

    /// `ip` or `ip6`: the table family and the address match keyword.
    pub fn ip(&self) -> &'static str {
        match self.family {
            IpFamily::V4 => "ip",
            IpFamily::V6 => "ip6",
        }
    }

    /// The nft type of an address of this family.
    pub fn addr_type(&self) -> &'static str {
        match self.family {
            IpFamily::V4 => "ipv4_addr",
            IpFamily::V6 => "ipv6_addr",
        }
    }
}

/// The table every object lives in (kube-proxy's name, so either cleans up the other's).
pub const TABLE: &str = "kube-proxy";

/// Everything one service port contributes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceRules {
    /// Chains owned by this service port, each with its rules.
    pub chains: Vec<(String, Vec<String>)>,
    /// Affinity sets owned by this service port: (name, timeout in seconds).
    pub sets: Vec<(String, u32)>,
    /// `service-ips` elements: (key, verdict).
    pub service_ips: Vec<(String, String)>,
    /// `service-nodeports` elements.
    pub node_ports: Vec<(String, String)>,
    /// `nodeport-ips` elements.
    pub node_port_addrs: BTreeSet<IpAddr>,
    /// `no-endpoint-services` elements (untranslated frontends: reject or drop).
    pub no_endpoints: Vec<(String, String)>,
}

impl ServiceRules {
    pub fn rule_count(&self) -> usize {
        self.chains.iter().map(|(_, r)| r.len()).sum::<usize>()
            + self.service_ips.len()
            + self.node_ports.len()
            + self.no_endpoints.len()
    }
}

fn readable(state: &ServicePortState) -> String {
    format!(
        "{}/{}/{}/{}",
        state.name.service.namespace,
        state.name.service.name,
        protocol(state.name.protocol),
        state.name.port
    )
}

/// An endpoint in a chain name: `10.0.0.1/8080`, `fd00..1/8080` (nft names take no `:`).
fn readable_endpoint(ep: SocketAddr) -> String {
    format!("{}/{}", ep.ip().to_string().replace(':', "."), ep.port())
}

/// kube-proxy's chain names: a kind, 8 hash characters, and the readable service port.
pub fn service_chain(state: &ServicePortState) -> String {
    format!("service-{}-{}", hash(&port_key(state), 8), readable(state))
}

fn chain_with(kind: &str, state: &ServicePortState, variant: usize) -> String {
    let mut key = port_key(state);
    if variant > 0 {
        let _ = write!(key, "#{variant}");
    }
    let suffix = if variant > 0 {
        format!("-{variant}")
    } else {
        String::new()
    };
    format!("{kind}-{}-{}{suffix}", hash(&key, 8), readable(state))
}

pub fn endpoint_chain(state: &ServicePortState, ep: SocketAddr) -> String {
    format!(
        "endpoint-{}-{}__{}",
        hash(&(port_key(state) + &ep.to_string()), 8),
        readable(state),
        readable_endpoint(ep)
    )
}

/// ClientIP affinity: a set per endpoint of the clients it served recently (kube-proxy's).
fn affinity_set(state: &ServicePortState, ep: SocketAddr) -> String {
    format!(
        "affinity-{}-{}__{}",
        hash(&(port_key(state) + &ep.to_string()), 8),
        readable(state),
        readable_endpoint(ep)
    )
}

/// The match of this node's pods (`negate`: of every other client), as kube-proxy's
/// nftables mode writes it; `ip` is the family's word (`ip`, `ip6`).
pub fn local_match(ip: &str, local: &LocalMatch, negate: bool) -> String {
    let op = if negate { "!= " } else { "" };
    match local {
        LocalMatch::Cidr(c) => format!("{ip} saddr {op}{}", cidr(c)),
        LocalMatch::Interface(name) => format!("iifname {op}\"{name}\""),
        LocalMatch::InterfacePrefix(prefix) => format!("iifname {op}\"{prefix}*\""),
    }
}

fn cidr(c: &Cidr) -> String {
    format!("{}/{}", c.addr, c.prefix)
}

/// A verdict-map key: `10.96.0.1 . tcp . 80`.
fn key(addr: IpAddr, p: crate::model::Protocol, port: u16) -> String {
    format!("{addr} . {} . {port}", protocol(p))
}

/// The rules of one service port.
pub fn service_rules(state: &ServicePortState, ctx: &RuleContext) -> ServiceRules {
    let mut r = ServiceRules::default();
    let ip = ctx.ip();
    let proto = state.name.protocol;
    let svc = service_chain(state);
    let remote = ctx.remote_masquerade_mark;
    let affinity = state.affinity_timeout;

    // Selection chains, one per distinct endpoint list (cluster, external if it differs).
    let mut selections: Vec<(Vec<SocketAddr>, String)> = Vec::new();
    let mut selection_for = |backends: &[SocketAddr], r: &mut ServiceRules| -> String {
        if let Some((_, chain)) = selections.iter().find(|(b, _)| b == backends) {
            return chain.clone();
        }
        let chain = match selections.len() {
            0 => svc.clone(),
            n => chain_with("service-external-endpoints", state, n - 1),
        };
        let mut rules = Vec::new();
        if chain == svc {
            let vip = state.frontend.addr;
            let dport = format!("{} dport {}", protocol(proto), state.frontend.port);
            if state.masquerade_all {
                rules.push(format!("{ip} daddr {vip} {dport} jump mark-for-masquerade"));
            } else if let Some(local) = &ctx.local {
                rules.push(format!(
                    "{ip} daddr {vip} {dport} {} jump mark-for-masquerade",
                    local_match(ip, local, true)
                ));
            }
        }
        // The node's own connections (see the iptables mode).
        rules.push("fib saddr type local jump mark-for-masquerade".to_string());
        if affinity.is_some() {
            for b in backends {
                rules.push(format!(
                    "{ip} saddr @{} goto {}",
                    affinity_set(state, *b),
                    endpoint_chain(state, *b)
                ));
            }
        }
        // A cascade, as iptables' statistic: endpoint i of n is taken with probability
        // 1/(n-i) if none before it was, which is 1/n for each. (kube-proxy writes one
        // `numgen random mod n vmap { ... }`; with nft 1.0.6 each such anonymous map makes
        // every later transaction slower: 4 000 services took 27.8 s to load that way and
        // 3.0 s as cascades, and a one-element change 0.23 s against 0.08 s.)
        let n = backends.len();
        for (i, b) in backends.iter().enumerate() {
            let ep = endpoint_chain(state, *b);
            if i + 1 < n {
                rules.push(format!("numgen random mod {} == 0 goto {ep}", n - i));
            } else {
                rules.push(format!("goto {ep}"));
            }
        }
        r.chains.push((chain.clone(), rules));
        selections.push((backends.to_vec(), chain.clone()));
        chain
    };
    selection_for(&state.backends, &mut r);

    let any_remote_masquerade = state.external.iter().any(|f| f.masquerade);
    let mut endpoints: BTreeSet<SocketAddr> = state.backends.iter().copied().collect();
    endpoints.extend(state.external.iter().flat_map(|f| {
        let inner = f.in_cluster.iter().flat_map(|i| i.backends.iter());
        f.backends.iter().chain(inner).copied()
    }));
    let mut endpoint_chains = Vec::new();
    for ep in &endpoints {
        let mut rules = vec![format!("{ip} saddr {} jump mark-for-masquerade", ep.ip())];
        if any_remote_masquerade && state.remote.contains(ep) {
            rules.push(format!(
                "meta mark & 0x{remote:x} != 0 jump mark-for-masquerade"
            ));
        }
        if let Some(timeout) = affinity {
            let set = affinity_set(state, *ep);
            rules.push(format!("update @{set} {{ {ip} saddr }}"));
            r.sets.push((set, timeout));
        }
        rules.push(format!("meta l4proto {} dnat to {ep}", protocol(proto)));
        endpoint_chains.push((endpoint_chain(state, *ep), rules));
    }

    let reject = |when: WhenEmpty| match when {
        WhenEmpty::Refuse => "goto reject-chain".to_string(),
        WhenEmpty::Drop => "drop".to_string(),
    };
    let cluster = &state.frontend;
    if state.backends.is_empty() {
        r.no_endpoints.push((
            key(cluster.addr, proto, cluster.port),
            reject(state.when_empty),
        ));
    } else {
        r.service_ips.push((
            key(cluster.addr, proto, cluster.port),
            format!("goto {svc}"),
        ));
    }

    // (endpoints, masquerade, masquerade_all, endpoints for clients on this node).
    type Treatment = (Vec<SocketAddr>, bool, bool, Option<Vec<SocketAddr>>);
    let mut externals: Vec<(Treatment, String)> = Vec::new();
    let mut firewalls: Vec<((String, Vec<Cidr>), String)> = Vec::new();
    for f in &state.external {
        let k = key(f.frontend.addr, proto, f.frontend.port);
        // externalTrafficPolicy: Local: clients on this node take every endpoint.
        let in_cluster = f.short_circuit().map(<[SocketAddr]>::to_vec);
        if f.backends.is_empty() {
            // What the short-circuit does not translate is refused or dropped.
            r.no_endpoints.push((k.clone(), reject(f.when_empty)));
            if in_cluster.is_none() {
                continue;
            }
        }
        let treatment = (
            f.backends.clone(),
            f.masquerade,
            f.masquerade_all,
            in_cluster.clone(),
        );
        let ext = match externals.iter().find(|(t, _)| *t == treatment) {
            Some((_, chain)) => chain.clone(),
            None => {
                let chain = chain_with("external", state, externals.len());
                let mut rules = Vec::new();
                if let Some(inner) = &in_cluster {
                    // kube-proxy's short-circuit (see the iptables mode).
                    let all = selection_for(inner, &mut r);
                    if let Some(local) = &ctx.local {
                        rules.push(format!("{} goto {all}", local_match(ip, local, false)));
                    }
                    rules.push("fib saddr type local jump mark-for-masquerade".to_string());
                    rules.push(format!("fib saddr type local goto {all}"));
                }
                if f.masquerade_all {
                    rules.push("jump mark-for-masquerade".to_string());
                } else if f.masquerade {
                    rules.push(format!("meta mark set meta mark | 0x{remote:x}"));
                }
                if !f.backends.is_empty() {
                    let target = selection_for(&f.backends, &mut r);
                    rules.push(format!("goto {target}"));
                }
                r.chains.push((chain.clone(), rules));
                externals.push((treatment, chain.clone()));
                chain
            }
        };
        let target = if f.source_ranges.is_empty() {
            ext
        } else {
            let fw_key = (ext.clone(), f.source_ranges.clone());
            let fw = match firewalls.iter().find(|(k, _)| *k == fw_key) {
                Some((_, chain)) => chain.clone(),
                None => {
                    let chain = chain_with("firewall", state, firewalls.len());
                    // A rule per range (kube-proxy writes one anonymous set): the same
                    // match, and each is a plain prefix compare in an incremental
                    // transaction (see `netlink`), with no anonymous set to create.
                    let rules = f
                        .source_ranges
                        .iter()
                        .map(|c| format!("{ip} saddr {} goto {ext}", cidr(c)))
                        .collect();
                    r.chains.push((chain.clone(), rules));
                    firewalls.push((fw_key, chain.clone()));
                    chain
                }
            };
            // What the firewall chain leaves untranslated is dropped by the filter hooks.
            if !r.no_endpoints.iter().any(|(e, _)| *e == k) {
                r.no_endpoints.push((k.clone(), "drop".to_string()));
            }
            fw
        };
        if f.kind == FrontendKind::NodePort {
            r.node_port_addrs.insert(f.frontend.addr);
            let element = (
                format!("{} . {}", protocol(proto), f.frontend.port),
                format!("goto {target}"),
            );
            if !r.node_ports.contains(&element) {
                r.node_ports.push(element);
            }
        } else {
            r.service_ips.push((k, format!("goto {target}")));
        }
    }
    r.chains.extend(endpoint_chains);
    r
}
