//! `inspect services` in eBPF mode without the agent: what the pinned maps serve, read
//! straight from bpffs, so it answers while the agent is stopped or crash-looping (the
//! datapath keeps serving from the pins then).
//!
//! The maps hold numbers: frontends and backend slots are read as the next agent would
//! adopt them (`SERVICES`, `SERVICES6`, `BACKENDS`, `BACKEND_ADDRS6`), named by the
//! `SERVICE_NAMES` the agent writes beside them, and counted from `SERVICE_STATS` and
//! `BACKEND_STATS`. Nothing is written: the handles are opened read-only in effect (no
//! write goes through them).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::SocketAddr,
    path::Path,
};

use anyhow::{Context, Result};
use aya::maps::{Map, MapData, PerCpuArray};
use proxy_common::{
    map_names, Backend, ServiceStats, ServiceValue, BACKEND_INDEX_MASK,
    SERVICE_FLAG_DROP_WHEN_EMPTY, SERVICE_SCHEDULER_MASK, SERVICE_SCHEDULER_SHIFT,
};

use super::services::{BackendView, FrontendView, PortView, ServicesView, Traffic};
use crate::{
    model::{FrontendKind, IpFamily, ObjectName, Scheduler},
    proxier::ebpf::{
        maps::{KernelMaps, ServiceMaps},
        sync::{backend_addr, frontend_of, Target},
    },
};

/// A frontend's kind as `SERVICE_NAMES` records it.
fn kind_of(kind: u8) -> &'static str {
    match kind {
        proxy_common::FRONTEND_KIND_CLUSTER_IP => FrontendKind::ClusterIp.name(),
        proxy_common::FRONTEND_KIND_NODE_PORT => FrontendKind::NodePort.name(),
        proxy_common::FRONTEND_KIND_EXTERNAL_IP => FrontendKind::ExternalIp.name(),
        proxy_common::FRONTEND_KIND_LOAD_BALANCER => FrontendKind::LoadBalancer.name(),
        _ => "unknown",
    }
}

fn scheduler_of(flags: u16) -> &'static str {
    let id = (flags >> SERVICE_SCHEDULER_SHIFT) & SERVICE_SCHEDULER_MASK;
    Scheduler::ALL
        .into_iter()
        .find(|s| s.datapath_id() == id)
        .map_or("unknown", Scheduler::name)
}

/// Per-CPU counters of `ids` in the pinned array `name` (summed over CPUs); zeros where
/// an id cannot be read.
pub fn counters(maps_dir: &Path, name: &str, ids: &[u32]) -> Result<Vec<ServiceStats>> {
    let pin = maps_dir.join(name);
    let data = MapData::from_pin(&pin).with_context(|| format!("opening {}", pin.display()))?;
    let array: PerCpuArray<MapData, ServiceStats> = PerCpuArray::try_from(Map::PerCpuArray(data))?;
    Ok(ids
        .iter()
        .map(|id| {
            array.get(id, 0).map_or(ServiceStats::default(), |per_cpu| {
                crate::datapath::summed(&per_cpu)
            })
        })
        .collect())
}

use super::services::traffic_of as traffic;

/// One frontend as the maps hold it: its header, and the backend ids of its slots.
struct Found {
    header: ServiceValue,
    slots: Vec<u32>,
}

/// What the maps under `<root>/maps` serve: `service`'s ports (every Service's without
/// one), at most [`super::services::MAX_PORTS`].
pub fn services(root: &Path, service: Option<&ObjectName>, node: &str) -> Result<ServicesView> {
    let maps_dir = root.join("maps");
    let maps = KernelMaps::open_pinned(&maps_dir).with_context(|| {
        format!(
            "reading the eBPF mode's pinned maps under {} (is this node in eBPF mode, with this --bpffs-root?)",
            maps_dir.display()
        )
    })?;
    let contents = maps
        .entries()
        .map_err(|e| anyhow::anyhow!("reading the pinned maps: {e}"))?;
    let names: HashMap<u32, (String, u8)> = maps
        .names()
        .into_iter()
        .map(|(id, n)| (id, (String::from_utf8_lossy(n.text()).into_owned(), n.kind)))
        .collect();
    let backends: HashMap<u32, Backend> = contents.backends.iter().map(|b| (b.id, *b)).collect();
    let mut found: BTreeMap<Target, Found> = BTreeMap::new();
    let mut slots: HashMap<Target, BTreeMap<u16, u32>> = HashMap::new();
    for (key, value) in &contents.services {
        let Some(target) = frontend_of(key) else {
            continue;
        };
        if key.slot() == 0 {
            found.insert(
                target,
                Found {
                    header: *value,
                    slots: Vec::new(),
                },
            );
        } else {
            slots
                .entry(target)
                .or_default()
                .insert(key.slot(), value.backend_id);
        }
    }
    for (target, f) in found.iter_mut() {
        let mine = slots.remove(target).unwrap_or_default();
        f.slots = (1..=f.header.count)
            .filter_map(|slot| mine.get(&slot).copied())
            .collect();
    }
    let mut by_service: HashMap<u32, Vec<&Backend>> = HashMap::new();
    for b in backends.values() {
        by_service.entry(b.service_id).or_default().push(b);
    }
    let address = |id: u32| {
        backends
            .get(&id)
            .and_then(|b| backend_addr(b, &contents.backend_addrs6))
    };

    // Ports by (name, family), from their frontends' sets for every client; a Local
    // frontend's set for this node's clients adds its slots and counters to the same port.
    struct PortParts {
        view: PortView,
        /// Backend ids: serving (in some slot) or draining.
        serving: BTreeSet<u32>,
        draining: BTreeSet<u32>,
    }
    let mut ports: BTreeMap<(String, IpFamily), PortParts> = BTreeMap::new();
    let mut frontend_ids: Vec<(String, IpFamily, usize, u32)> = Vec::new();
    for (target, f) in found.iter().filter(|(t, _)| !t.in_cluster) {
        let id = f.header.service_id;
        let (name, kind) = names
            .get(&id)
            .cloned()
            .unwrap_or_else(|| (format!("(service id {id}: no name recorded)"), u8::MAX));
        let (service_name, port_name) = name.rsplit_once(':').unwrap_or((name.as_str(), ""));
        if let Some(wanted) = service {
            if service_name != wanted.to_string() {
                continue;
            }
        }
        let family = IpFamily::of(target.addr);
        let inner = Target {
            in_cluster: true,
            ..*target
        };
        let inner = found.get(&inner);
        let parts = ports
            .entry((name.clone(), family))
            .or_insert_with(|| PortParts {
                view: PortView {
                    service: service_name.to_string(),
                    port: port_name.to_string(),
                    protocol: target.protocol.to_string(),
                    family: family.name().into(),
                    scheduler: scheduler_of(f.header.flags).into(),
                    affinity_timeout_seconds: (f.header.backend_id > 0)
                        .then_some(f.header.backend_id),
                    not_programmed: None,
                    frontends: Vec::new(),
                    backends: Vec::new(),
                },
                serving: BTreeSet::new(),
                draining: BTreeSet::new(),
            });
        let serving: Vec<SocketAddr> = f.slots.iter().filter_map(|id| address(*id)).collect();
        for set in std::iter::once(f).chain(inner) {
            parts.serving.extend(&set.slots);
            let drained = by_service
                .get(&set.header.service_id)
                .into_iter()
                .flatten()
                .map(|b| b.id);
            parts.draining.extend(drained);
            frontend_ids.push((
                name.clone(),
                family,
                parts.view.frontends.len(),
                set.header.service_id,
            ));
        }
        parts.view.frontends.push(FrontendView {
            frontend: target.frontend().to_string(),
            kind: kind_of(kind).into(),
            when_empty: serving.is_empty().then(|| {
                if f.header.flags & SERVICE_FLAG_DROP_WHEN_EMPTY != 0 {
                    "drop".into()
                } else {
                    "refuse".into()
                }
            }),
            serving,
            source_ranges: contents
                .source_ranges
                .iter()
                .filter(|(sid, ..)| *sid == id)
                .map(|(_, addr, prefix)| format!("{addr}/{prefix}"))
                .collect(),
            traffic: Traffic::default(),
        });
    }

    // Counters: each frontend's sets, each port's backend ids once.
    let ids: Vec<u32> = frontend_ids.iter().map(|(.., id)| *id).collect();
    let stats = counters(&maps_dir, map_names::SERVICE_STATS, &ids)?;
    for ((name, family, index, _), s) in frontend_ids.iter().zip(&stats) {
        if let Some(p) = ports.get_mut(&(name.clone(), *family)) {
            let t = &mut p.view.frontends[*index].traffic;
            if t.connections.is_none() {
                *t = traffic(&ServiceStats::default());
            }
            t.add(traffic(s));
        }
    }
    let total = ports.len();
    let mut out = Vec::new();
    for (_, mut p) in ports.into_iter().take(super::services::MAX_PORTS) {
        let draining: Vec<u32> = p.draining.difference(&p.serving).copied().collect();
        let all: Vec<(u32, &str)> = p
            .serving
            .iter()
            .map(|id| (*id, "serving"))
            .chain(draining.iter().map(|id| (*id, "draining")))
            .collect();
        let slots: Vec<u32> = all.iter().map(|(id, _)| id & BACKEND_INDEX_MASK).collect();
        let stats = counters(&maps_dir, map_names::BACKEND_STATS, &slots)?;
        let mut seen: BTreeMap<SocketAddr, BackendView> = BTreeMap::new();
        for ((id, state), s) in all.iter().zip(&stats) {
            let (Some(addr), Some(b)) = (address(*id), backends.get(id)) else {
                continue;
            };
            seen.entry(addr)
                .or_insert_with(|| BackendView {
                    address: addr,
                    weight: None,
                    state: (*state).into(),
                    local: b.flags & proxy_common::BACKEND_FLAG_REMOTE == 0,
                    traffic: traffic(&ServiceStats::default()),
                })
                .traffic
                .add(traffic(s));
        }
        p.view.backends = seen.into_values().collect();
        // Per-backend counting is the agent's --backend-metrics, which the pins do not
        // record: backends all at zero under a frontend that counted are not counted.
        let counted = |t: &Traffic| t.connections.unwrap_or(0) > 0;
        if p.view.frontends.iter().any(|f| counted(&f.traffic))
            && !p.view.backends.iter().any(|b| counted(&b.traffic))
        {
            for b in &mut p.view.backends {
                b.traffic = Traffic::default();
            }
        }
        out.push(p.view);
    }
    Ok(ServicesView {
        node: node.into(),
        mode: "ebpf".into(),
        counters: format!(
            "read from the pinned maps under {} (the agent did not answer): the eBPF datapath's counters since the maps were created, per backend only if the agent ran with --backend-metrics; weights are the agent's and not shown",
            root.display()
        ),
        total_ports: total,
        truncated: total > out.len(),
        ports: out,
    })
}
