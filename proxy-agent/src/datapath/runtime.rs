//! What the eBPF mode runs besides its proxier: the loaded datapath, the interface
//! attacher, the flow log, and its periodic work (conntrack garbage collection, counters,
//! the masquerade addresses).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use proxy_common::map_names;
use tracing::{debug, info, warn};

use super::{
    attach::{self, Attacher},
    Datapath, DatapathSizes,
};
use crate::{
    metrics::{Metrics, TrafficCounters},
    model::{
        local::{LocalMatch, LocalTraffic},
        Cidr, IpFamily,
    },
};

/// The datapath's log buffer, read when the kernel says it has something (`-v 4`).
pub type FlowLogger = tokio::io::unix::AsyncFd<aya_log::EbpfLogger<&'static dyn log::Log>>;

/// Traffic counter ids with their metric labels (service, or service and endpoint).
pub type CounterIds = Vec<(Vec<String>, u32)>;

/// One kind's counters to read: their labels and ids, or, beyond
/// `--traffic-metrics-limit`, only how many there are (no labels built for series that are
/// not exported: at 100 000 service ports building them held the sync loop 100–180 ms
/// every 10 s).
#[derive(Debug)]
pub enum Counters {
    Ids(CounterIds),
    Over(usize),
}

impl Counters {
    /// `count` counters named by `ids()`, which runs only within `limit`.
    pub fn within(count: usize, limit: usize, ids: impl FnOnce() -> CounterIds) -> Self {
        if count > limit {
            Counters::Over(count)
        } else {
            Counters::Ids(ids())
        }
    }
}

pub struct EbpfRuntime {
    pub datapath: Datapath,
    pub attacher: Option<Attacher>,
    pub flow_logger: Option<FlowLogger>,
    pub sizes: DatapathSizes,
    pub backend_metrics: bool,
    /// `--traffic-metrics-limit`.
    pub traffic_metrics_limit: usize,
    service_counters: TrafficCounters,
    backend_counters: TrafficCounters,
    /// Evictions are derived from pinned counters, so they survive restarts; new ones are
    /// warned about.
    evicted_reported: Option<u64>,
    /// The links of this namespace (ifindex -> name), from the link watch.
    links: BTreeMap<u32, String>,
    /// How pods are told apart, as last followed.
    local: LocalTraffic,
    /// What `LOCAL_IFACES` holds.
    pod_interfaces: BTreeSet<u32>,
}

/// `ids`, or none of them when there are more than `limit` (their series then go, and the
/// count omitted is exported; a change either way is logged once).
fn within_limit(kind: &str, counters: Counters, limit: usize, metrics: &Metrics) -> CounterIds {
    let omitted = metrics.traffic_series_omitted.with_label_values(&[kind]);
    let (count, ids) = match counters {
        Counters::Ids(ids) => (ids.len(), ids),
        Counters::Over(count) => (count, Vec::new()),
    };
    let over = count > limit;
    let was_over = omitted.get() > 0;
    if over && !was_over {
        warn!(
            "{count} {kind} traffic counters exceed --traffic-metrics-limit {limit}: not exported (the datapath keeps counting)"
        );
    } else if !over && was_over {
        info!(
            "{count} {kind} traffic counters within --traffic-metrics-limit {limit}: exported again"
        );
    }
    if over {
        omitted.set(count as i64);
        Vec::new()
    } else {
        omitted.set(0);
        ids
    }
}

impl EbpfRuntime {
    pub fn new(
        datapath: Datapath,
        attacher: Option<Attacher>,
        flow_logger: Option<FlowLogger>,
        sizes: DatapathSizes,
        backend_metrics: bool,
    ) -> Self {
        Self {
            datapath,
            attacher,
            flow_logger,
            sizes,
            backend_metrics,
            traffic_metrics_limit: usize::MAX,
            service_counters: TrafficCounters::default(),
            backend_counters: TrafficCounters::default(),
            evicted_reported: None,
            links: BTreeMap::new(),
            local: LocalTraffic::default(),
            pod_interfaces: BTreeSet::new(),
        }
    }

    pub fn link_event(&mut self, event: attach::LinkEvent) {
        match &event {
            attach::LinkEvent::Present { name, ifindex } => {
                self.links.insert(*ifindex, name.clone());
            }
            attach::LinkEvent::Gone { ifindex, .. } => {
                self.links.remove(ifindex);
            }
        }
        self.write_pod_interfaces();
        if let Some(attacher) = self.attacher.as_mut() {
            attacher.handle(&mut self.datapath, event);
        }
    }

    /// Writes `LOCAL_IFACES` from the links present and the detector, when either changed.
    fn write_pod_interfaces(&mut self) {
        let wanted: BTreeSet<u32> = self
            .links
            .iter()
            .filter(|(_, name)| {
                self.local.0.iter().flatten().any(|m| match m {
                    LocalMatch::Interface(n) => *name == n,
                    LocalMatch::InterfacePrefix(p) => name.starts_with(p.as_str()),
                    LocalMatch::Cidr(_) => false,
                })
            })
            .map(|(ifindex, _)| *ifindex)
            .collect();
        if wanted == self.pod_interfaces {
            return;
        }
        match self.datapath.set_pod_interfaces(&wanted) {
            Ok(0) => {
                let names: Vec<&str> = wanted.iter().map(|i| self.links[i].as_str()).collect();
                info!(interfaces = ?names, "pod interfaces (detectLocalMode)");
                self.pod_interfaces = wanted;
            }
            Ok(left_out) => {
                warn!(
                    left_out,
                    capacity = proxy_common::LOCAL_IFACES_MAX,
                    "LOCAL_IFACES is full: flows from {left_out} pod interfaces count as from outside the node's pods (masqueraded to cluster IPs)"
                );
                self.pod_interfaces = wanted;
            }
            Err(e) => warn!("writing the pod interfaces: {e:#}"),
        }
    }

    pub fn collect_conntrack_garbage(&mut self, metrics: &Metrics) {
        match self.datapath.collect_conntrack_garbage() {
            Ok(sweep) => {
                metrics.conntrack_deleted_total.inc_by(sweep.deleted as u64);
                metrics
                    .datapath_events
                    .with_label_values(&["conntrack_evicted"])
                    .set(sweep.evicted as f64);
                let before = self.evicted_reported.unwrap_or(sweep.evicted);
                if sweep.evicted > before {
                    warn!(
                        evicted = sweep.evicted - before,
                        entries = sweep.remaining,
                        entries6 = sweep.remaining6,
                        capacity = self.sizes.conntrack,
                        "a conntrack map (CONNTRACK or CONNTRACK6) is full: the kernel evicted tracked flows to make room (their next packets pick a backend again); raise --conntrack-map-size"
                    );
                }
                self.evicted_reported = Some(before.max(sweep.evicted));
                // Unconfirmed flows pushed out by newer ones: a flood of spoofed sources, or
                // more new flows per round trip than CT_NEW holds. Confirmed flows are safe
                // from it, so it is counted, not warned about.
                metrics
                    .datapath_events
                    .with_label_values(&["new_flow_evicted"])
                    .set(sweep.evicted_new as f64);
                for (map, entries) in [
                    (map_names::CONNTRACK, sweep.remaining),
                    (map_names::CONNTRACK6, sweep.remaining6),
                    (map_names::CT_NEW, sweep.remaining_new),
                    (map_names::CT_NEW6, sweep.remaining_new6),
                ] {
                    metrics
                        .map_entries
                        .with_label_values(&[map])
                        .set(entries as i64);
                }
                if sweep.deleted > 0 {
                    debug!(
                        deleted = sweep.deleted,
                        remaining = sweep.remaining,
                        "conntrack swept"
                    );
                }
            }
            Err(e) => warn!("conntrack garbage collection: {e:#}"),
        }
    }

    /// Per-service and per-backend traffic counters (`backends` only with
    /// `--backend-metrics`) and the datapath's event counters.
    pub fn read_counters(&mut self, services: Counters, backends: Counters, metrics: &Metrics) {
        let limit = self.traffic_metrics_limit;
        let services = within_limit("service", services, limit, metrics);
        let numbers: Vec<u32> = services.iter().map(|(_, id)| *id).collect();
        match self.datapath.service_stats(&numbers) {
            Ok(stats) => self.service_counters.update(
                &metrics.service_traffic,
                services
                    .into_iter()
                    .zip(stats)
                    .map(|((labels, id), s)| (labels, id, s))
                    .collect(),
            ),
            Err(e) => debug!("reading per-service counters: {e:#}"),
        }
        if self.backend_metrics {
            let backends = within_limit("backend", backends, limit, metrics);
            let numbers: Vec<u32> = backends.iter().map(|(_, id)| *id).collect();
            match self.datapath.backend_stats(&numbers) {
                Ok(stats) => self.backend_counters.update(
                    &metrics.backend_traffic,
                    backends
                        .into_iter()
                        .zip(stats)
                        .map(|((labels, id), s)| (labels, id, s))
                        .collect(),
                ),
                Err(e) => debug!("reading per-backend counters: {e:#}"),
            }
        }
        if let Ok(stats) = self.datapath.stats() {
            for (stat, n) in &stats {
                metrics
                    .datapath_events
                    .with_label_values(&[stat.name()])
                    .set(*n as f64);
            }
            let line: Vec<String> = stats
                .iter()
                .map(|(s, n)| format!("{}={n}", s.name()))
                .collect();
            debug!("datapath: {}", line.join(" "));
        }
    }

    /// Keeps the datapath's masquerade addresses at this node's InternalIPs (one per family).
    pub fn follow_masquerade_addresses(&mut self, v4: Option<Ipv4Addr>, v6: Option<Ipv6Addr>) {
        let datapath = &mut self.datapath;
        let wanted = v4.map_or(0, |a| u32::from(a).to_be());
        if datapath.config.masquerade_addr != wanted {
            let config = proxy_common::DatapathConfig {
                masquerade_addr: wanted,
                ..datapath.config
            };
            match datapath.configure(&config) {
                Ok(()) => info!(address = ?v4, "masquerade address"),
                Err(e) => warn!("setting the masquerade address: {e:#}"),
            }
        }
        let wanted6 = v6.map_or([0; 16], |a| a.octets());
        if datapath.config6.masquerade_addr != wanted6 {
            let config = proxy_common::DatapathConfig6 {
                masquerade_addr: wanted6,
                ..datapath.config6
            };
            match datapath.configure6(&config) {
                Ok(()) => info!(address = ?v6, "IPv6 masquerade address"),
                Err(e) => warn!("setting the IPv6 masquerade address: {e:#}"),
            }
        }
    }

    /// Tells the datapath which clients are the node's pods (`detectLocalMode`, resolved):
    /// the ranges (ClusterCIDR, NodeCIDR) in `CONFIG`/`CONFIG6`, or the pod interfaces
    /// (BridgeInterface, InterfaceNamePrefix) in `LOCAL_IFACES`, kept as links come and go.
    /// Cluster-IP flows from anything else are masqueraded.
    pub fn follow_local_traffic(&mut self, local: &LocalTraffic) {
        // Called after every event of the agent's loop: only a change is written.
        if *local == self.local {
            return;
        }
        self.local = local.clone();
        let cidr = |family| match local.of(family) {
            Some(LocalMatch::Cidr(c)) => Some(*c),
            _ => None,
        };
        let (addr, mask) = match cidr(IpFamily::V4) {
            Some(Cidr {
                addr: IpAddr::V4(a),
                prefix,
            }) => {
                let mask = u32::MAX.checked_shl(32 - prefix as u32).unwrap_or(0);
                ((u32::from(a) & mask).to_be(), mask.to_be())
            }
            _ => (0, 0),
        };
        let datapath = &mut self.datapath;
        let config = proxy_common::DatapathConfig {
            pods_by_interface: u32::from(local.by_interface()),
            cluster_cidr_addr: addr,
            cluster_cidr_mask: mask,
            ..datapath.config
        };
        if config != datapath.config {
            if let Err(e) = datapath.configure(&config) {
                warn!("setting how IPv4 pods are told apart: {e:#}");
            }
        }
        let (addr6, mask6) = match cidr(IpFamily::V6) {
            Some(Cidr {
                addr: IpAddr::V6(a),
                prefix,
            }) => {
                let mask = u128::MAX.checked_shl(128 - prefix as u32).unwrap_or(0);
                ((u128::from(a) & mask).to_be_bytes(), mask.to_be_bytes())
            }
            _ => ([0; 16], [0; 16]),
        };
        let config6 = proxy_common::DatapathConfig6 {
            cluster_cidr_addr: addr6,
            cluster_cidr_mask: mask6,
            ..datapath.config6
        };
        if config6 != datapath.config6 {
            if let Err(e) = datapath.configure6(&config6) {
                warn!("setting the IPv6 pod range: {e:#}");
            }
        }
        self.write_pod_interfaces();
    }

    /// Watches this namespace's links so interfaces created later are attached too; the
    /// watch restarts after an error (listing the links anew: attaching is idempotent) and
    /// ends when the receiver goes. `None` without an attacher.
    pub fn watch_links(&self) -> Option<tokio::sync::mpsc::Receiver<attach::LinkEvent>> {
        self.attacher.as_ref()?;
        let (link_tx, link_rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            while !link_tx.is_closed() {
                if let Err(e) = attach::watch_links(link_tx.clone()).await {
                    warn!("interface watch failed, restarting it in 1 s: {e:#}");
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        });
        Some(link_rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32) -> Counters {
        Counters::Ids(
            (0..n)
                .map(|i| (vec![format!("default/s{i}:http")], i))
                .collect(),
        )
    }

    /// Over the limit no series of the kind are kept and the count omitted is exported;
    /// back under it, all of them again.
    #[test]
    fn traffic_series_beyond_the_limit_are_omitted_and_counted() {
        let metrics = Metrics::new();
        let omitted = || {
            metrics
                .traffic_series_omitted
                .with_label_values(&["service"])
                .get()
        };
        assert_eq!(within_limit("service", ids(3), 3, &metrics).len(), 3);
        assert_eq!(omitted(), 0);
        assert!(within_limit("service", ids(4), 3, &metrics).is_empty());
        assert_eq!(omitted(), 4);
        assert_eq!(within_limit("service", ids(2), 3, &metrics).len(), 2);
        assert_eq!(omitted(), 0);
        // Beyond the limit the labels are never built, and the count still shows.
        let over = Counters::within(5, 3, || panic!("labels built beyond the limit"));
        assert!(within_limit("service", over, 3, &metrics).is_empty());
        assert_eq!(omitted(), 5);
        let within = Counters::within(2, 3, || vec![(vec!["a".into()], 1), (vec!["b".into()], 2)]);
        assert_eq!(within_limit("service", within, 3, &metrics).len(), 2);
        assert_eq!(omitted(), 0);
    }
}
