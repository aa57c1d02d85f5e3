//! `inspect trace SRC DST:PORT/PROTO`: what a new flow from SRC to that address would get
//! on this node, worked out from the programmed state without sending a packet or
//! changing anything (running the live program would write conntrack, affinity and
//! round-robin state): the frontend it matches, the source-range verdict, which set of
//! endpoints its clients get, an affinity the datapath remembers and the client's flows
//! already tracked, the scheduler's candidates and rule, and what decides it (the socket
//! hook, the tc classifier, netfilter, IPVS, the relay). Field names are part of
//! `inspect trace -o json` (docs/inspect.md).

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    sync::Arc,
};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::conntrack::FlowView;
use crate::model::{
    local::{LocalMatch, LocalTraffic},
    DesiredState, Frontend, FrontendKind, IpFamily, Protocol, Scheduler, ServicePortState,
    WhenEmpty,
};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TraceView {
    pub node: String,
    pub mode: String,
    pub client: String,
    pub destination: String,
    /// `namespace/name:port` of the service port the destination is a frontend of.
    pub service: Option<String>,
    /// `ClusterIP`, `NodePort`, `ExternalIP`, `LoadBalancer`.
    pub kind: Option<String>,
    /// What happens, in one line.
    pub verdict: String,
    /// Each decision on the way, in order.
    pub steps: Vec<Step>,
    /// Which of the frontend's endpoint sets the client gets: `all`, or `thisNode`
    /// (`externalTrafficPolicy: Local`'s set for clients on this node).
    pub set: String,
    /// The endpoints a new flow chooses among.
    pub candidates: Vec<SocketAddr>,
    pub scheduler: Option<String>,
    /// How the scheduler picks among the candidates.
    pub rule: Option<String>,
    /// `sessionAffinity: ClientIP`: the backend the datapath remembers for this client,
    /// where the mode's state can be read.
    pub remembered: Option<Remembered>,
    /// The client's flows to this destination that are tracked now.
    pub existing: Vec<FlowView>,
    /// Which part of the datapath decides a new flow from this client.
    pub decided_by: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    pub step: String,
    pub outcome: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Remembered {
    pub backend: SocketAddr,
    /// Seconds the client has left to open its next flow and keep it.
    pub valid_for_seconds: u64,
}

/// `SRC` as `ip` or `ip:port`.
pub fn parse_client(text: &str) -> Result<IpAddr> {
    text.parse::<IpAddr>()
        .or_else(|_| text.parse::<SocketAddr>().map(|a| a.ip()))
        .map_err(|_| anyhow!("{text:?}: expected the client's IP address"))
}

/// `DST:PORT/PROTO` (`10.96.0.10:80/TCP`, `[fd00::10]:53/udp`; TCP without `/PROTO`).
pub fn parse_destination(text: &str) -> Result<Frontend> {
    let (addr, protocol) = match text.rsplit_once('/') {
        Some((a, p)) => (a, p),
        None => (text, "TCP"),
    };
    let addr: SocketAddr = addr
        .parse()
        .map_err(|_| anyhow!("{text:?}: expected ADDRESS:PORT/PROTOCOL"))?;
    let protocol = match protocol.to_ascii_uppercase().as_str() {
        "TCP" => Protocol::Tcp,
        "UDP" => Protocol::Udp,
        "SCTP" => Protocol::Sctp,
        other => bail!("{text:?}: protocol {other:?} is not TCP, UDP or SCTP"),
    };
    Ok(Frontend {
        addr: addr.ip(),
        port: addr.port(),
        protocol,
    })
}

fn rule(scheduler: Scheduler) -> &'static str {
    match scheduler {
        Scheduler::Random => "one at random, equally likely (kube-proxy's iptables behaviour)",
        Scheduler::Rr => "the next in turn",
        Scheduler::Wrr => "in turn, each as often as its weight",
        Scheduler::Sh => "by a hash of the client's address: the same client, the same backend",
        Scheduler::Dh => "by a hash of the destination address",
        Scheduler::Mh => "Maglev: a consistent hash of the client, stable as backends come and go",
        Scheduler::Lc => "the one with the fewest active connections",
        Scheduler::Wlc => "the fewest active connections per unit of weight",
        Scheduler::Sed => "the shortest expected delay: (active connections + 1) / weight",
        Scheduler::Nq => "an idle one if any, else as sed",
        Scheduler::Lblc => {
            "the client's last backend unless it is overloaded, else the least loaded"
        }
        Scheduler::Lblcr => "the least loaded of the client's set of backends",
    }
}

/// Whether `client` counts as on this node: a pod by `local`'s source range, or one of the
/// node's own addresses.
fn on_node(client: IpAddr, local: &LocalTraffic, node_addresses: &[IpAddr]) -> (bool, String) {
    if client.is_loopback() || node_addresses.contains(&client) {
        return (true, "one of this node's own addresses".into());
    }
    match local.of(IpFamily::of(client)) {
        Some(LocalMatch::Cidr(c)) if c.contains(client) => {
            (true, format!("a pod: its address is in {c}"))
        }
        Some(LocalMatch::Cidr(c)) => (false, format!("not a pod of this node ({c} holds none)")),
        Some(m) => (
            false,
            format!("traced as from elsewhere: pods are told by interface here ({m}), which an address alone does not show"),
        ),
        None => (false, "not a pod (no pod range is known)".into()),
    }
}

/// The service port of `desired` that `destination` is a frontend of.
pub fn port_of(desired: &DesiredState, destination: Frontend) -> Option<&Arc<ServicePortState>> {
    desired
        .ports
        .values()
        .find(|s| s.frontend_keys().any(|f| f == destination))
}

/// The trace of a new flow from `client` to `destination`, a frontend of `port` (`None`:
/// of no service port), as the model had the mode program it. `existing` and `remembered` are filled by the caller from
/// the datapath's state.
pub fn trace(
    (node, mode): (&str, &str),
    port: Option<&ServicePortState>,
    local: &LocalTraffic,
    node_addresses: &[IpAddr],
    client: IpAddr,
    destination: Frontend,
) -> TraceView {
    let mut out = TraceView {
        node: node.into(),
        mode: mode.into(),
        client: client.to_string(),
        destination: destination.to_string(),
        set: "all".into(),
        ..TraceView::default()
    };
    fn step(out: &mut TraceView, step: &str, outcome: String) {
        out.steps.push(Step {
            step: step.into(),
            outcome,
        })
    }
    let Some(s) = port else {
        step(
            &mut out,
            "frontend",
            "no service port of this node has this frontend".into(),
        );
        out.verdict =
            "not a service: not translated, the packet goes where routing sends it".into();
        out.decided_by = "nothing of this agent's".into();
        return out;
    };
    // Which external frontend it is, if it is not the cluster IP.
    let external = s.external.iter().position(|f| f.frontend == destination);
    out.service = Some(format!("{}:{}", s.name.service, s.name.port));
    let kind = external.map_or(FrontendKind::ClusterIp, |i| s.external[i].kind);
    out.kind = Some(kind.name().into());
    let what = format!(
        "{} of {}",
        kind.name(),
        out.service.as_deref().unwrap_or("")
    );
    step(&mut out, "frontend", what);
    if IpFamily::of(client) != IpFamily::of(destination.addr) {
        step(
            &mut out,
            "family",
            "the client's family differs: no flow".into(),
        );
        out.verdict = "no flow: the client and the destination are of different families".into();
        return out;
    }
    let (backends, when_empty): (&[SocketAddr], WhenEmpty) = match external {
        None => (&s.backends, s.when_empty),
        Some(i) => {
            let f = &s.external[i];
            if !f.source_ranges.is_empty() {
                let admitted = f.source_ranges.iter().any(|c| c.contains(client));
                let ranges: Vec<String> = f.source_ranges.iter().map(|c| c.to_string()).collect();
                step(
                    &mut out,
                    "loadBalancerSourceRanges",
                    format!(
                        "{} ({})",
                        if admitted { "admitted" } else { "not admitted" },
                        ranges.join(", ")
                    ),
                );
                if !admitted {
                    out.verdict =
                        "dropped: the client is outside the load balancer's source ranges".into();
                    out.decided_by = decider(mode, false);
                    return out;
                }
            }
            match (&f.in_cluster, on_node(client, local, node_addresses)) {
                (Some(inner), (true, why)) => {
                    out.set = "thisNode".into();
                    step(
                        &mut out,
                        "clients on this node",
                        format!("{why}: it gets every endpoint cluster traffic may use (externalTrafficPolicy: Local's short-circuit)"),
                    );
                    (&inner.backends, WhenEmpty::Refuse)
                }
                (Some(_), (false, why)) => {
                    step(
                        &mut out,
                        "externalTrafficPolicy",
                        format!("Local: only this node's endpoints ({why})"),
                    );
                    (&f.backends, f.when_empty)
                }
                (None, _) => (&f.backends, f.when_empty),
            }
        }
    };
    out.candidates = backends.to_vec();
    out.scheduler = Some(s.scheduler.name().into());
    let client_on_node = on_node(client, local, node_addresses).0;
    out.decided_by = decider(mode, client_on_node);
    if mode == "ebpf" && client_on_node {
        step(
            &mut out,
            "socket hooks",
            "a process below the hooks gets its backend at connect(), and its affinity is kept per network namespace (SOCK_AFFINITY), which this trace does not read; the affinity and flows below are the tc path's".into(),
        );
    }
    if backends.is_empty() {
        let outcome = match when_empty {
            WhenEmpty::Refuse => "refused: no endpoint serves it (TCP reset, ICMP unreachable)",
            WhenEmpty::Drop => "dropped: the policy is Local and this node has no endpoint",
        };
        step(&mut out, "endpoints", outcome.into());
        out.verdict = outcome.into();
        return out;
    }
    let mut choice = rule(s.scheduler).to_string();
    if let Some(t) = s.affinity_timeout {
        choice = format!(
            "sessionAffinity ClientIP ({t} s): the backend the client had while it keeps returning within {t} s; else {choice}"
        );
    }
    step(
        &mut out,
        "scheduler",
        format!(
            "{} among {} endpoints: {choice}",
            s.scheduler.name(),
            backends.len()
        ),
    );
    out.rule = Some(choice);
    out.verdict = format!(
        "translated to one of {} endpoint{} ({})",
        backends.len(),
        if backends.len() == 1 { "" } else { "s" },
        s.scheduler.name()
    );
    out
}

/// What decides a new flow in `mode`, for a client on this node or not.
fn decider(mode: &str, client_on_node: bool) -> String {
    match (mode, client_on_node) {
        ("ebpf", true) => "the socket hook at connect() for processes below --cgroup-path (pods, the node); the tc classifier for those outside it".into(),
        ("ebpf", false) => "the tc classifier on the interface the packet arrives on".into(),
        ("iptables", _) => "netfilter: nat KUBE-SERVICES → KUBE-SVC/KUBE-EXT → KUBE-SEP (DNAT), at the flow's first packet".into(),
        ("nftables", _) => "netfilter: the kube-proxy table's service maps → endpoint chains (DNAT), at the flow's first packet".into(),
        ("ipvs", _) => "IPVS: the virtual server's scheduler, at the flow's first packet".into(),
        ("userspace", _) => "the agent's relay listening on the frontend".into(),
        (other, _) => format!("the {other} mode"),
    }
}

/// The eBPF affinity this client has for `destination`'s entry set, from the pinned maps:
/// the remembered backend, if still valid.
pub fn ebpf_affinity(
    root: &Path,
    client: IpAddr,
    destination: Frontend,
    this_node_set: bool,
    port: &ServicePortState,
) -> Result<Option<Remembered>> {
    use aya::maps::{HashMap as BpfHashMap, Map, MapData};
    use proxy_common::{map_names, AffinityKey, AffinityKey6, AffinityValue};
    let Some(timeout) = port.affinity_timeout else {
        return Ok(None);
    };
    let maps_dir = root.join("maps");
    let maps = crate::proxier::ebpf::maps::KernelMaps::open_pinned(&maps_dir)?;
    use crate::proxier::ebpf::sync::{service_key, Target};
    let target = if this_node_set {
        Target::in_cluster(destination)
    } else {
        Target::all(destination)
    };
    let key = service_key(target, 0);
    let header = maps
        .service(&key)
        .context("reading the frontend's header")?;
    let Some(header) = header else {
        return Ok(None);
    };
    let open = |name: &str| -> Result<MapData> {
        let pin = maps_dir.join(name);
        MapData::from_pin(&pin).with_context(|| format!("opening {}", pin.display()))
    };
    let value: Option<AffinityValue> = match client {
        IpAddr::V4(a) => {
            let map: BpfHashMap<MapData, AffinityKey, AffinityValue> =
                BpfHashMap::try_from(Map::LruHashMap(open(map_names::AFFINITY)?))?;
            map.get(
                &AffinityKey {
                    client: u32::from(a).to_be(),
                    service_id: header.service_id,
                },
                0,
            )
            .ok()
        }
        IpAddr::V6(a) => {
            let map: BpfHashMap<MapData, AffinityKey6, AffinityValue> =
                BpfHashMap::try_from(Map::LruHashMap(open(map_names::AFFINITY6)?))?;
            map.get(
                &AffinityKey6 {
                    client: a.octets(),
                    service_id: header.service_id,
                },
                0,
            )
            .ok()
        }
    };
    let Some(value) = value else {
        return Ok(None);
    };
    let age = crate::datapath::monotonic_ns().saturating_sub(value.last_seen_ns) / 1_000_000_000;
    let left = u64::from(timeout).saturating_sub(age);
    if left == 0 {
        return Ok(None);
    }
    let backend = maps
        .backend_address(value.backend_id)
        .context("reading the remembered backend")?;
    Ok(backend.map(|backend| Remembered {
        backend,
        valid_for_seconds: left,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Cidr, FrontendState, InCluster};

    fn desired(s: ServicePortState) -> DesiredState {
        let mut d = DesiredState::default();
        d.ports.insert(s.name.clone(), Arc::new(s));
        d
    }

    /// lab/web:http at 10.96.0.10:80 with two endpoints and 60 s of ClientIP affinity.
    fn web() -> (ServicePortState, Vec<SocketAddr>) {
        let backends: Vec<SocketAddr> = vec![
            "10.244.1.5:8080".parse().unwrap(),
            "10.244.2.5:8080".parse().unwrap(),
        ];
        let mut s = ServicePortState::cluster_ip(
            "lab",
            "web",
            "http",
            "10.96.0.10".parse().unwrap(),
            backends.clone(),
        );
        s.affinity_timeout = Some(60);
        (s, backends)
    }

    fn local() -> LocalTraffic {
        LocalTraffic::by_cidrs(&["10.244.1.0/24".parse::<Cidr>().unwrap()])
    }

    #[test]
    fn destinations_parse_with_and_without_protocol() {
        let f = parse_destination("10.96.0.10:53/udp").unwrap();
        assert_eq!((f.port, f.protocol), (53, Protocol::Udp));
        assert_eq!(
            parse_destination("[fd00::1]:80").unwrap().protocol,
            Protocol::Tcp
        );
        assert!(parse_destination("10.96.0.10/TCP").is_err());
        assert!(parse_destination("10.96.0.10:80/ICMP").is_err());
        assert_eq!(
            parse_client("10.0.0.1:4000").unwrap(),
            "10.0.0.1".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn a_traced_flow_follows_the_models_sets_policies_and_ranges() {
        let (mut s, backends) = web();
        let lb = Frontend {
            addr: "192.0.2.10".parse().unwrap(),
            port: 80,
            protocol: Protocol::Tcp,
        };
        s.external.push(FrontendState {
            frontend: lb,
            kind: FrontendKind::LoadBalancer,
            backends: vec![backends[0]],
            draining: Vec::new(),
            when_empty: WhenEmpty::Drop,
            source_ranges: vec!["198.51.100.0/24".parse().unwrap()],
            masquerade: false,
            masquerade_all: false,
            in_cluster: Some(InCluster {
                backends: backends.clone(),
                draining: Vec::new(),
            }),
        });
        let d = desired(s);
        let t = |client: &str, dst: Frontend| {
            trace(
                ("n1", "ebpf"),
                port_of(&d, dst).map(|p| &**p),
                &local(),
                &[],
                client.parse().unwrap(),
                dst,
            )
        };
        let cluster = parse_destination("10.96.0.10:80/TCP").unwrap();
        let v = t("10.244.1.2", cluster);
        assert_eq!(v.service.as_deref(), Some("lab/web:http"));
        assert_eq!(v.candidates, backends);
        assert!(v
            .rule
            .unwrap()
            .starts_with("sessionAffinity ClientIP (60 s)"));
        assert!(v.decided_by.starts_with("the socket hook"));
        // Outside the source ranges: dropped before any endpoint.
        let v = t("203.0.113.9", lb);
        assert!(v.verdict.starts_with("dropped"), "{v:?}");
        assert!(v.candidates.is_empty());
        // Admitted, from elsewhere: Local's one endpoint.
        let v = t("198.51.100.7", lb);
        assert_eq!(v.candidates, vec![backends[0]]);
        assert!(v.decided_by.starts_with("the tc classifier"));
        // Not a frontend.
        let v = t(
            "10.244.1.2",
            parse_destination("10.96.0.99:80/TCP").unwrap(),
        );
        assert!(v.verdict.starts_with("not a service"));
    }

    /// The JSON `inspect trace -o json` prints (field names kept stable), and behind it
    /// the golden table.
    #[test]
    fn the_json_is_the_golden_one() {
        let (s, backends) = web();
        let d = desired(s);
        let dst = parse_destination("10.96.0.10:80/TCP").unwrap();
        let mut v = trace(
            ("node-1", "ebpf"),
            port_of(&d, dst).map(|p| &**p),
            &local(),
            &[],
            "10.244.1.2".parse().unwrap(),
            dst,
        );
        v.remembered = Some(Remembered {
            backend: backends[1],
            valid_for_seconds: 57,
        });
        v.existing.push(FlowView {
            protocol: "TCP".into(),
            client: "10.244.1.2:40112".parse().unwrap(),
            frontend: "10.96.0.10:80".parse().unwrap(),
            backend: backends[1],
            service: Some("lab/web:http".into()),
            state: "established".into(),
            idle_seconds: Some(3),
            expires_in_seconds: None,
        });
        crate::inspect::assert_golden(
            "trace.json",
            &(serde_json::to_string_pretty(&v).unwrap() + "\n"),
        );
    }
}
