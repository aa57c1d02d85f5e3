//! kube-proxy's iptables ruleset, generated from one service port's state.
//!
//! The layout is kube-proxy's (`pkg/proxy/iptables`), so `iptables-save | grep KUBE-` reads
//! the same to an operator who knows it:
//!
//! ```text
//! nat     PREROUTING, OUTPUT -> KUBE-SERVICES
//!         KUBE-SERVICES   -d <cluster IP> --dport P        -> KUBE-SVC-<hash>
//!                         -d <external/LB IP> --dport P    -> KUBE-EXT-<hash> (or KUBE-FW-<hash>)
//!                         -d <node address>                -> KUBE-NODEPORTS (last)
//!         KUBE-NODEPORTS  --dport <nodePort>               -> KUBE-EXT-<hash>
//!         KUBE-EXT-<hash> externalTrafficPolicy: Local: -s <cluster CIDR> (pods) and
//!                         src-type LOCAL (the node, masqueraded) -> every endpoint's chain;
//!                         the rest -> KUBE-SVL-<hash>, this node's endpoints
//!         KUBE-SVC-<hash> statistic random over the endpoints -> KUBE-SEP-<hash>
//!         KUBE-SEP-<hash> DNAT to one endpoint
//!         POSTROUTING -> KUBE-POSTROUTING: MASQUERADE what KUBE-MARK-MASQ marked
//! filter  INPUT, FORWARD, OUTPUT (new flows) -> KUBE-SERVICES: REJECT / DROP frontends
//!         that were not translated (no endpoints, or a source outside the ranges)
//! ```
//!
//! Chain names hash the service port name and protocol with SHA-256 and base32 as kube-proxy
//! does (`KUBE-SVC-` + 16 characters). What serves, and what is masqueraded, comes from the
//! model; this module only spells it.

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use crate::{
    model::{
        local::LocalMatch, Cidr, Frontend, FrontendKind, IpFamily, Protocol, ServicePortState,
        WhenEmpty,
    },
    proxier::naming::{hash, port_key, protocol},
};

/// kube-proxy's default `masqueradeBit` 14.
pub const DEFAULT_MASQUERADE_BIT: u32 = 14;

/// What the rules of every service port share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleContext {
    /// `KUBE-MARK-MASQ` sets this bit; `KUBE-POSTROUTING` masquerades packets carrying it.
    pub masquerade_mark: u32,
    /// Set on external traffic that is to be masqueraded only if it goes to an endpoint on
    /// another node (`externalTrafficPolicy: Cluster`): the endpoint's chain turns it into
    /// the masquerade mark. The bit below the masquerade bit.
    pub remote_masquerade_mark: u32,
    /// How this family's pods are told apart (`detectLocalMode`): cluster-IP traffic from
    /// anything else is masqueraded.
    pub local: Option<LocalMatch>,
    /// The address masqueraded flows get (the node's InternalIP of this family); without
    /// one, the outgoing link's (MASQUERADE).
    pub masquerade_addr: Option<IpAddr>,
    /// Forwarded packets conntrack finds INVALID are dropped, as kube-proxy does unless
    /// `conntrack.tcpBeLiberal` is set: an out-of-window segment gets no NAT, and a reply
    /// leaving with the pod's address makes the client reset its connection.
    pub drop_invalid: bool,
}

impl RuleContext {
    pub fn new(masquerade_bit: u32, local: Option<LocalMatch>) -> Self {
        let bit = masquerade_bit.clamp(1, 31);
        RuleContext {
            masquerade_mark: 1 << bit,
            remote_masquerade_mark: 1 << (bit - 1),
            local,
            masquerade_addr: None,
            drop_invalid: true,
        }
    }
}

/// Everything one service port contributes to the ruleset.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceRules {
    /// nat chains owned by this service port, each with its rules (`-A ...` lines).
    pub chains: Vec<(String, Vec<String>)>,
    /// nat `KUBE-SERVICES` lines.
    pub services: Vec<String>,
    /// nat `KUBE-NODEPORTS` lines.
    pub node_ports: Vec<String>,
    /// Node addresses this service port's node ports listen on.
    pub node_port_addrs: BTreeSet<IpAddr>,
    /// filter `KUBE-SERVICES` lines: refusals and drops.
    pub filter: Vec<String>,
}

impl ServiceRules {
    /// Lines this service port adds to each table (nat, filter).
    pub fn rule_counts(&self) -> (usize, usize) {
        let nat = self.services.len()
            + self.node_ports.len()
            + self.chains.iter().map(|(_, r)| r.len()).sum::<usize>();
        (nat, self.filter.len())
    }
}

/// The `KUBE-SVC-` chain of a service port (its cluster-traffic endpoints).
pub fn service_chain(state: &ServicePortState) -> String {
    format!("KUBE-SVC-{}", hash(&port_key(state), 16))
}

fn chain_with(prefix: &str, state: &ServicePortState, variant: usize) -> String {
    let mut text = port_key(state);
    if variant > 0 {
        let _ = write!(text, "#{variant}");
    }
    format!("{prefix}{}", hash(&text, 16))
}

/// The `KUBE-SEP-` chain of one endpoint of a service port.
pub fn endpoint_chain(state: &ServicePortState, endpoint: SocketAddr) -> String {
    format!(
        "KUBE-SEP-{}",
        hash(&(port_key(state) + &endpoint.to_string()), 16)
    )
}

fn host(addr: IpAddr) -> String {
    match addr {
        IpAddr::V4(a) => format!("{a}/32"),
        IpAddr::V6(a) => format!("{a}/128"),
    }
}

/// The match of this node's pods (`negate`: of every other client), as kube-proxy's local
/// detector writes it.
pub fn local_match(local: &LocalMatch, negate: bool) -> String {
    let not = if negate { "! " } else { "" };
    match local {
        LocalMatch::Cidr(c) => format!("{not}-s {}", cidr(c)),
        LocalMatch::Interface(name) => format!("{not}-i {name}"),
        LocalMatch::InterfacePrefix(prefix) => format!("{not}-i {prefix}+"),
    }
}

fn cidr(c: &Cidr) -> String {
    format!("{}/{}", c.addr, c.prefix)
}

/// `-p tcp -m tcp --dport 80`.
fn port_match(p: Protocol, port: u16) -> String {
    let p = protocol(p);
    format!("-p {p} -m {p} --dport {port}")
}

fn comment(text: &str) -> String {
    format!("-m comment --comment \"{text}\"")
}

fn kind_label(kind: FrontendKind) -> &'static str {
    match kind {
        FrontendKind::ClusterIp => "cluster IP",
        FrontendKind::NodePort => "node port",
        FrontendKind::ExternalIp => "external IP",
        FrontendKind::LoadBalancer => "load balancer IP",
    }
}

/// A chain that picks one of `backends` at random (kube-proxy's `statistic` cascade), after
/// sending clients with affinity back to their endpoint.
fn selection_rules(
    state: &ServicePortState,
    chain: &str,
    backends: &[SocketAddr],
    label: &str,
    out: &mut Vec<String>,
) {
    if let Some(timeout) = state.affinity_timeout {
        for b in backends {
            let sep = endpoint_chain(state, *b);
            out.push(format!(
                "-A {chain} {} -m recent --name {sep} --rcheck --seconds {timeout} --reap -j {sep}",
                comment(&format!("{label} -> {b}"))
            ));
        }
    }
    let n = backends.len();
    for (i, b) in backends.iter().enumerate() {
        let sep = endpoint_chain(state, *b);
        let label = comment(&format!("{label} -> {b}"));
        if i + 1 < n {
            let probability = 1.0 / (n - i) as f64;
            out.push(format!(
                "-A {chain} {label} -m statistic --mode random --probability {probability:.10} -j {sep}"
            ));
        } else {
            out.push(format!("-A {chain} {label} -j {sep}"));
        }
    }
}

/// The rules of one service port.
pub fn service_rules(state: &ServicePortState, ctx: &RuleContext) -> ServiceRules {
    let mut r = ServiceRules::default();
    let name = state.name.to_string();
    let proto = state.name.protocol;
    let svc = service_chain(state);
    let remote = format!("0x{:x}", ctx.remote_masquerade_mark);

    // Selection chains: one per distinct list of endpoints (cluster traffic's, and the
    // external traffic's when a traffic policy makes it differ).
    let mut selections: Vec<(Vec<SocketAddr>, String)> = Vec::new();
    let mut selection_for = |backends: &[SocketAddr], r: &mut ServiceRules| -> String {
        if let Some((_, chain)) = selections.iter().find(|(b, _)| b == backends) {
            return chain.clone();
        }
        let chain = match selections.len() {
            0 => svc.clone(),
            n => chain_with("KUBE-SVL-", state, n - 1),
        };
        let label = if selections.is_empty() {
            name.clone()
        } else {
            format!("{name} external endpoints")
        };
        let mut rules = Vec::new();
        if chain == svc {
            if state.masquerade_all {
                rules.push(format!(
                    "-A {chain} {} -d {} {} -j KUBE-MARK-MASQ",
                    comment(&format!("{name} cluster IP")),
                    host(state.frontend.addr),
                    port_match(proto, state.frontend.port)
                ));
            } else if let Some(local) = &ctx.local {
                rules.push(format!(
                    "-A {chain} {} {} -d {} {} -j KUBE-MARK-MASQ",
                    comment(&format!("{name} cluster IP")),
                    local_match(local, true),
                    host(state.frontend.addr),
                    port_match(proto, state.frontend.port)
                ));
            }
        }
        // The node's own connections: their source address was chosen for the frontend's
        // route, which need not be one the endpoint can answer (a node address on another
        // link); masquerading picks the one on the way to the endpoint, as the eBPF
        // mode's connect-time translation lets the kernel do.
        rules.push(format!(
            "-A {chain} {} -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
            comment(&format!("{name} from this node"))
        ));
        selection_rules(state, &chain, backends, &label, &mut rules);
        r.chains.push((chain.clone(), rules));
        selections.push((backends.to_vec(), chain.clone()));
        chain
    };
    // The cluster-IP chain exists whenever the service port does (kube-proxy's does too),
    // so the external chains can name it.
    selection_for(&state.backends, &mut r);

    // Endpoint chains, for every endpoint any frontend selects.
    let any_remote_masquerade = state.external.iter().any(|f| f.masquerade);
    let mut endpoints: BTreeSet<SocketAddr> = state.backends.iter().copied().collect();
    endpoints.extend(state.external.iter().flat_map(|f| {
        let inner = f.in_cluster.iter().flat_map(|i| i.backends.iter());
        f.backends.iter().chain(inner).copied()
    }));
    let mut endpoint_chains = Vec::new();
    for ep in &endpoints {
        let sep = endpoint_chain(state, *ep);
        let label = comment(&name);
        let mut rules = vec![
            // Hairpin: a pod reaching itself must not see its own address as the source.
            format!("-A {sep} {label} -s {} -j KUBE-MARK-MASQ", host(ep.ip())),
        ];
        if any_remote_masquerade && state.remote.contains(ep) {
            rules.push(format!(
                "-A {sep} {label} -m mark --mark {remote}/{remote} -j KUBE-MARK-MASQ"
            ));
        }
        let mut dnat = format!("-A {sep} {label} -p {}", protocol(proto));
        if state.affinity_timeout.is_some() {
            let _ = write!(dnat, " -m recent --name {sep} --set");
        }
        let _ = write!(
            dnat,
            " -m {} -j DNAT --to-destination {ep}",
            protocol(proto)
        );
        rules.push(dnat);
        endpoint_chains.push((sep, rules));
    }

    // The cluster IP.
    let cluster = &state.frontend;
    if !state.backends.is_empty() {
        r.services.push(format!(
            "-A KUBE-SERVICES {} -d {} {} -j {svc}",
            comment(&format!("{name} cluster IP")),
            host(cluster.addr),
            port_match(proto, cluster.port)
        ));
    } else {
        r.filter.push(refusal(
            state,
            FrontendKind::ClusterIp,
            &state.frontend,
            state.when_empty,
        ));
    }

    // External frontends: one KUBE-EXT chain per distinct treatment.
    // (endpoints, masquerade, masquerade_all, endpoints for clients on this node) -> chain.
    type Treatment = (Vec<SocketAddr>, bool, bool, Option<Vec<SocketAddr>>);
    let mut externals: Vec<(Treatment, String)> = Vec::new();
    let mut firewalls: Vec<((String, Vec<Cidr>), String)> = Vec::new();
    for f in &state.external {
        let label = format!("{name} {}", kind_label(f.kind));
        // externalTrafficPolicy: Local: clients on this node take every endpoint.
        let in_cluster = f.short_circuit().map(<[SocketAddr]>::to_vec);
        if f.backends.is_empty() {
            // What the short-circuit below does not translate is refused or dropped.
            r.filter
                .push(refusal(state, f.kind, &f.frontend, f.when_empty));
            if in_cluster.is_none() {
                continue;
            }
        }
        let key = (
            f.backends.clone(),
            f.masquerade,
            f.masquerade_all,
            in_cluster.clone(),
        );
        let ext = match externals.iter().find(|(k, _)| *k == key) {
            Some((_, chain)) => chain.clone(),
            None => {
                let chain = chain_with("KUBE-EXT-", state, externals.len());
                let mut rules = Vec::new();
                if let Some(inner) = &in_cluster {
                    // kube-proxy's short-circuit: the node's pods and the node itself reach
                    // every endpoint (the node masqueraded: its source is the LB IP's
                    // route's); the rest of the world only this node's.
                    let all = selection_for(inner, &mut r);
                    if let Some(local) = &ctx.local {
                        rules.push(format!(
                            "-A {chain} {} {} -j {all}",
                            comment(&format!("pod traffic for {name} external destinations")),
                            local_match(local, false)
                        ));
                    }
                    rules.push(format!(
                        "-A {chain} {} -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
                        comment(&format!(
                            "masquerade LOCAL traffic for {name} external destinations"
                        ))
                    ));
                    rules.push(format!(
                        "-A {chain} {} -m addrtype --src-type LOCAL -j {all}",
                        comment(&format!(
                            "route LOCAL traffic for {name} external destinations"
                        ))
                    ));
                }
                if f.masquerade_all {
                    rules.push(format!(
                        "-A {chain} {} -j KUBE-MARK-MASQ",
                        comment(&format!(
                            "masquerade traffic for {name} external destinations"
                        ))
                    ));
                } else if f.masquerade {
                    rules.push(format!(
                        "-A {chain} {} -j MARK --or-mark {remote}",
                        comment(&format!(
                            "masquerade traffic for {name} external destinations that leave the node"
                        ))
                    ));
                }
                if !f.backends.is_empty() {
                    let target = selection_for(&f.backends, &mut r);
                    rules.push(format!("-A {chain} -j {target}"));
                }
                r.chains.push((chain.clone(), rules));
                externals.push((key, chain.clone()));
                chain
            }
        };
        let target = if f.source_ranges.is_empty() {
            ext
        } else {
            let key = (ext.clone(), f.source_ranges.clone());
            let fw = match firewalls.iter().find(|(k, _)| *k == key) {
                Some((_, chain)) => chain.clone(),
                None => {
                    let chain = chain_with("KUBE-FW-", state, firewalls.len());
                    let rules = f
                        .source_ranges
                        .iter()
                        .map(|c| {
                            format!(
                                "-A {chain} {} -s {} -j {ext}",
                                comment(&format!("{name} loadBalancerSourceRanges")),
                                cidr(c)
                            )
                        })
                        .collect();
                    r.chains.push((chain.clone(), rules));
                    firewalls.push((key, chain.clone()));
                    chain
                }
            };
            // What the firewall chain did not translate is dropped in the filter table.
            r.filter.push(format!(
                "-A KUBE-SERVICES {} -d {} {} -j DROP",
                comment(&format!("{label} is not open to this source")),
                host(f.frontend.addr),
                port_match(proto, f.frontend.port)
            ));
            fw
        };
        if f.kind == FrontendKind::NodePort {
            r.node_port_addrs.insert(f.frontend.addr);
            let line = format!(
                "-A KUBE-NODEPORTS {} {} -j {target}",
                comment(&label),
                port_match(proto, f.frontend.port)
            );
            if !r.node_ports.contains(&line) {
                r.node_ports.push(line);
            }
        } else {
            r.services.push(format!(
                "-A KUBE-SERVICES {} -d {} {} -j {target}",
                comment(&label),
                host(f.frontend.addr),
                port_match(proto, f.frontend.port)
            ));
        }
    }
    r.chains.extend(endpoint_chains);
    r
}

/// The filter rule for a frontend with no endpoint to take it: a TCP reset or ICMP port
/// unreachable when the Service has none (kube-proxy's REJECT; a reset because an ICMP
/// error meeting a connecting socket's lock is dropped), a silent drop when a Local traffic
/// policy finds them only on other nodes.
pub(crate) fn refusal(
    state: &ServicePortState,
    kind: FrontendKind,
    frontend: &Frontend,
    when_empty: WhenEmpty,
) -> String {
    let name = &state.name;
    let proto = state.name.protocol;
    let (why, verdict) = match when_empty {
        WhenEmpty::Refuse => (
            "has no endpoints",
            match (proto, state.name.family) {
                (Protocol::Tcp, _) => "REJECT --reject-with tcp-reset",
                (_, IpFamily::V4) => "REJECT --reject-with icmp-port-unreachable",
                (_, IpFamily::V6) => "REJECT --reject-with icmp6-port-unreachable",
            },
        ),
        WhenEmpty::Drop => ("has no local endpoints", "DROP"),
    };
    format!(
        "-A KUBE-SERVICES {} -d {} {} -j {verdict}",
        comment(&format!("{name} {} {why}", kind_label(kind))),
        host(frontend.addr),
        port_match(proto, frontend.port)
    )
}
