//! `inspect conntrack`: the flows through services on this node — client, frontend,
//! backend, protocol, state, and how long until they go — from the eBPF conntrack maps
//! (read from their pins, so with or without the agent), or from kernel conntrack
//! (ctnetlink) in the netfilter and ipvs modes, matched against the frontends the agent
//! serves. Field names are part of `inspect conntrack -o json` (docs/inspect.md).

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
    sync::Arc,
};

use anyhow::{Context, Result};
use aya::maps::MapData;
use proxy_common::{
    map_names, ConntrackKey, ConntrackKey6, ConntrackValue, ConntrackValue6, ServiceName,
    CT_FLAG_CLOSING, CT_FLAG_REPLY, CT_FLAG_SEEN_REPLY, CT_FLAG_SNAT, CT_FLAG_SNAT_REPLY,
};
use serde::{Deserialize, Serialize};

use crate::{
    datapath::batch,
    kernel::conntrack::flows::Entry,
    model::{ObjectName, Protocol, ServicePortState},
};

/// The most flows one answer lists (`total` counts them all).
pub const MAX_FLOWS: usize = 10_000;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FlowsView {
    pub node: String,
    pub mode: String,
    /// Where the flows come from, in words.
    pub source: String,
    pub total: usize,
    pub truncated: bool,
    pub flows: Vec<FlowView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FlowView {
    pub protocol: String,
    pub client: SocketAddr,
    pub frontend: SocketAddr,
    pub backend: SocketAddr,
    /// `namespace/name:port`, when known.
    pub service: Option<String>,
    /// eBPF: `new`, `established` (the backend answered) or `closing`; kernel conntrack:
    /// the TCP state (`ESTABLISHED`, `TIME_WAIT`, ...) or `tracked` for other protocols.
    pub state: String,
    /// eBPF: seconds since the flow's last packet refreshed it.
    pub idle_seconds: Option<u64>,
    /// Kernel conntrack: seconds until the entry expires.
    pub expires_in_seconds: Option<u32>,
}

fn protocol_name(number: u8) -> String {
    Protocol::from_number(number).map_or_else(|| number.to_string(), |p| p.to_string())
}

const TCP_STATES: [&str; 10] = [
    "NONE",
    "SYN_SENT",
    "SYN_RECV",
    "ESTABLISHED",
    "FIN_WAIT",
    "CLOSE_WAIT",
    "LAST_ACK",
    "TIME_WAIT",
    "CLOSE",
    "SYN_SENT2",
];

/// Kernel conntrack's flows to a frontend of `ports`, named by their service port.
pub fn from_kernel(ports: &[Arc<ServicePortState>], entries: &[Entry]) -> Vec<FlowView> {
    let mut owner: HashMap<(u8, SocketAddr), String> = HashMap::new();
    for s in ports {
        let name = format!("{}:{}", s.name.service, s.name.port);
        for f in s.frontend_keys() {
            owner.insert(
                (f.protocol.number(), SocketAddr::new(f.addr, f.port)),
                name.clone(),
            );
        }
    }
    entries
        .iter()
        .filter_map(|e| {
            let service = owner.get(&(e.original.protocol, e.original.dst))?;
            Some(FlowView {
                protocol: protocol_name(e.original.protocol),
                client: e.original.src,
                frontend: e.original.dst,
                backend: e.reply.src,
                service: Some(service.clone()),
                state: e.tcp_state.map_or_else(
                    || "tracked".into(),
                    |s| TCP_STATES.get(s as usize).unwrap_or(&"UNKNOWN").to_string(),
                ),
                idle_seconds: None,
                expires_in_seconds: e.timeout,
            })
        })
        .collect()
}

/// One eBPF conntrack entry of a flow as the client sent it (the reply direction's entry
/// is its twin and is not listed).
struct Tracked {
    protocol: u8,
    client: SocketAddr,
    frontend: SocketAddr,
    backend: SocketAddr,
    flags: u8,
    last_seen_ns: u64,
    service_id: u32,
}

fn state_of(flags: u8) -> &'static str {
    if flags & CT_FLAG_CLOSING != 0 {
        "closing"
    } else if flags & CT_FLAG_SEEN_REPLY != 0 {
        "established"
    } else {
        "new"
    }
}

fn read<K: aya::Pod, V: aya::Pod>(maps_dir: &Path, name: &str) -> Result<Vec<(K, V)>> {
    use aya::maps::Map;
    let pin = maps_dir.join(name);
    let data = MapData::from_pin(&pin).with_context(|| format!("opening {}", pin.display()))?;
    if let Some(all) = batch::lookup_all::<K, V>(&data) {
        return Ok(all);
    }
    let map: aya::maps::HashMap<MapData, K, V> =
        aya::maps::HashMap::try_from(Map::LruHashMap(data))?;
    Ok(map.iter().filter_map(Result::ok).collect())
}

/// Entries that are not a flow's own original direction: the reply direction's twin and
/// a masqueraded flow's two source-NAT entries.
const NOT_ORIGINAL: u8 = CT_FLAG_REPLY | CT_FLAG_SNAT | CT_FLAG_SNAT_REPLY;

/// Adds the flows of the pinned map `name` (`flow` reads an entry: `None` for one that is
/// not a flow's original direction) to `into`, by (protocol, client, frontend).
fn gather<K: aya::Pod, V: aya::Pod>(
    maps_dir: &Path,
    name: &str,
    required: bool,
    flow: impl Fn(&K, &V) -> Option<Tracked>,
    into: &mut HashMap<(u8, SocketAddr, SocketAddr), Tracked>,
) -> Result<()> {
    let entries: Vec<(K, V)> = match read(maps_dir, name) {
        Ok(entries) => entries,
        Err(e) if required => return Err(e),
        Err(e) => {
            tracing::debug!("{e:#}");
            Vec::new()
        }
    };
    for t in entries.iter().filter_map(|(k, v)| flow(k, v)) {
        into.insert((t.protocol, t.client, t.frontend), t);
    }
    Ok(())
}

/// The flows in the pinned eBPF conntrack maps under `<root>/maps`: confirmed ones
/// (`CONNTRACK`, `CONNTRACK6`) and those not confirmed yet (`CT_NEW`, `CT_NEW6`), each
/// once, named by `SERVICE_NAMES`; only `service`'s with one.
pub fn from_pins(root: &Path, service: Option<&ObjectName>) -> Result<Vec<FlowView>> {
    let maps_dir = root.join("maps");
    let mut tracked: HashMap<(u8, SocketAddr, SocketAddr), Tracked> = HashMap::new();
    let v4 = |k: &ConntrackKey, v: &ConntrackValue| {
        let ip = |a: u32| IpAddr::V4(Ipv4Addr::from(u32::from_be(a)));
        let addr = |a, p: u16| SocketAddr::new(ip(a), u16::from_be(p));
        (v.flags & NOT_ORIGINAL == 0).then(|| Tracked {
            protocol: k.proto,
            client: addr(k.saddr, k.sport),
            frontend: addr(k.daddr, k.dport),
            backend: addr(v.nat_addr, v.nat_port),
            flags: v.flags,
            last_seen_ns: v.last_seen_ns,
            service_id: v.service_id,
        })
    };
    let v6 = |k: &ConntrackKey6, v: &ConntrackValue6| {
        let addr = |a: [u8; 16], p: u16| SocketAddr::new(Ipv6Addr::from(a).into(), u16::from_be(p));
        (v.flags & NOT_ORIGINAL == 0).then(|| Tracked {
            protocol: k.proto,
            client: addr(k.saddr, k.sport),
            frontend: addr(k.daddr, k.dport),
            backend: addr(v.nat_addr, v.nat_port),
            flags: v.flags,
            last_seen_ns: v.last_seen_ns,
            service_id: v.service_id,
        })
    };
    // Unconfirmed first: a flow in both (being confirmed) is taken from the confirmed map.
    // Only CONNTRACK must be there (the IPv6 maps are absent where IPv6 never loaded).
    gather(&maps_dir, map_names::CT_NEW, false, v4, &mut tracked)?;
    gather(&maps_dir, map_names::CONNTRACK, true, v4, &mut tracked)?;
    gather(&maps_dir, map_names::CT_NEW6, false, v6, &mut tracked)?;
    gather(&maps_dir, map_names::CONNTRACK6, false, v6, &mut tracked)?;
    let tracked: Vec<Tracked> = tracked.into_values().collect();
    let names: HashMap<u32, String> = read::<u32, ServiceName>(&maps_dir, map_names::SERVICE_NAMES)
        .unwrap_or_default()
        .into_iter()
        .map(|(id, n)| (id, String::from_utf8_lossy(n.text()).into_owned()))
        .collect();
    let wanted: Option<HashSet<u32>> = service.map(|s| {
        let prefix = format!("{s}:");
        names
            .iter()
            .filter(|(_, n)| n.starts_with(&prefix))
            .map(|(id, _)| *id)
            .collect()
    });
    let now = crate::datapath::monotonic_ns();
    Ok(tracked
        .into_iter()
        .filter(|t| wanted.as_ref().is_none_or(|w| w.contains(&t.service_id)))
        .map(|t| FlowView {
            protocol: protocol_name(t.protocol),
            client: t.client,
            frontend: t.frontend,
            backend: t.backend,
            service: names.get(&t.service_id).cloned(),
            state: state_of(t.flags).into(),
            idle_seconds: Some(now.saturating_sub(t.last_seen_ns) / 1_000_000_000),
            expires_in_seconds: None,
        })
        .collect())
}

/// `flows` as an answer: sorted, at most [`MAX_FLOWS`].
pub fn view(node: &str, mode: &str, source: &str, mut flows: Vec<FlowView>) -> FlowsView {
    flows.sort_by(|a, b| {
        (&a.service, a.frontend, a.client).cmp(&(&b.service, b.frontend, b.client))
    });
    let total = flows.len();
    flows.truncate(MAX_FLOWS);
    FlowsView {
        node: node.into(),
        mode: mode.into(),
        source: source.into(),
        total,
        truncated: total > MAX_FLOWS,
        flows,
    }
}

/// How the eBPF flows are described.
pub const FROM_PINS: &str = "the eBPF datapath's conntrack maps, confirmed and new flows (those the tc programs translate; connections the socket hooks translate at connect() go straight to their backend and are not tracked here)";
/// How the userspace mode's relayed connections are described.
pub const FROM_RELAYS: &str =
    "the userspace relays: TCP connections being relayed now (UDP sessions are not listed)";
/// How kernel conntrack's flows are described.
pub const FROM_KERNEL: &str = "kernel conntrack (ctnetlink): flows to a frontend this agent serves";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::conntrack::flows::Tuple;

    #[test]
    fn kernel_flows_to_frontends_are_named_and_others_left_out() {
        let s = ServicePortState::cluster_ip(
            "lab",
            "web",
            "http",
            "10.96.0.10".parse().unwrap(),
            vec!["10.0.0.1:8080".parse().unwrap()],
        );
        let entry = |dst: &str, state| Entry {
            original: Tuple {
                protocol: 6,
                src: "10.0.9.9:40000".parse().unwrap(),
                dst: dst.parse().unwrap(),
            },
            reply: Tuple {
                protocol: 6,
                src: "10.0.0.1:8080".parse().unwrap(),
                dst: "10.0.9.9:40000".parse().unwrap(),
            },
            timeout: Some(431_999),
            tcp_state: state,
        };
        let flows = from_kernel(
            &[Arc::new(s)],
            &[
                entry("10.96.0.10:80", Some(3)),
                entry("10.96.0.11:80", Some(3)),
            ],
        );
        assert_eq!(flows.len(), 1);
        assert_eq!(flows[0].service.as_deref(), Some("lab/web:http"));
        assert_eq!(flows[0].state, "ESTABLISHED");
        assert_eq!(flows[0].backend, "10.0.0.1:8080".parse().unwrap());
        assert_eq!(flows[0].expires_in_seconds, Some(431_999));
        let v = view("n", "iptables", FROM_KERNEL, flows.clone());
        assert_eq!((v.total, v.truncated), (1, false));
        let many = vec![flows[0].clone(); MAX_FLOWS + 1];
        let v = view("n", "iptables", FROM_KERNEL, many);
        assert_eq!(
            (v.total, v.truncated, v.flows.len()),
            (MAX_FLOWS + 1, true, MAX_FLOWS)
        );
    }

    #[test]
    fn ebpf_states_follow_the_entry_flags() {
        assert_eq!(state_of(0), "new");
        assert_eq!(state_of(CT_FLAG_SEEN_REPLY), "established");
        assert_eq!(state_of(CT_FLAG_SEEN_REPLY | CT_FLAG_CLOSING), "closing");
    }
}
