//! Prometheus metrics: kube-proxy's names and types where the meaning is the same (so
//! existing dashboards and alerts keep working), and this project's own under
//! `proxy_agent_`.

use std::collections::{HashMap, HashSet};

use proxy_common::ServiceStats;

use crate::model::ServicePortName;

use prometheus::{
    exponential_buckets, linear_buckets, Encoder, Gauge, GaugeVec, Histogram, HistogramOpts,
    HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

pub struct Metrics {
    pub registry: Registry,
    /// Every metric name this agent exports (with or without samples yet).
    pub names: Vec<String>,
    pub sync_duration: Histogram,
    pub sync_full_duration: Histogram,
    pub sync_partial_duration: Histogram,
    pub sync_last_timestamp: Gauge,
    pub sync_last_queued_timestamp: Gauge,
    pub network_programming_duration: Histogram,
    pub service_changes_pending: IntGauge,
    pub service_changes_total: IntCounter,
    pub endpoint_changes_pending: IntGauge,
    pub endpoint_changes_total: IntCounter,
    pub no_local_endpoints: IntGaugeVec,
    pub healthz_total: IntCounterVec,
    pub livez_total: IntCounterVec,
    pub conntrack_deleted_total: IntCounter,
    pub iptables_rules: IntGaugeVec,
    pub iptables_restore_failures: IntCounter,
    pub iptables_partial_restore_failures: IntCounter,
    pub nftables_rules: IntGauge,
    pub userspace_listeners: IntGauge,
    pub userspace_udp_sessions: IntGauge,
    pub userspace_udp_session_limit: IntGauge,
    pub userspace_udp_sessions_evicted: IntCounter,
    pub userspace_udp_sessions_refused: IntCounter,
    pub ipvs_virtual_servers: IntGauge,
    pub ipvs_sync_failures: IntCounter,
    pub nftables_sync_failures: IntCounter,
    pub nftables_transactions: IntCounter,
    // This project's own.
    pub programmed_service_ports: IntGaugeVec,
    pub programmed_backends: IntGaugeVec,
    pub unprogrammed_service_ports: IntGauge,
    pub other_modes_state_kept: IntGauge,
    pub sync_failures: IntCounterVec,
    pub frontend_conflicts: IntGauge,
    pub external_ips_refused: IntGauge,
    pub http_connections: IntGaugeVec,
    pub http_connection_limit: IntGaugeVec,
    pub http_connections_shed: IntCounterVec,
    /// `proxy-agent inspect` requests answered, by query and status code.
    pub inspect_requests: IntCounterVec,
    pub map_entries: IntGaugeVec,
    pub map_capacity: IntGaugeVec,
    /// What the kernel's BPF offers the datapath, by feature (1 or 0).
    pub ebpf_feature: IntGaugeVec,
    pub datapath_events: GaugeVec,
    /// Traffic counter series not exported (`--traffic-metrics-limit`), by kind.
    pub traffic_series_omitted: IntGaugeVec,
    /// The sync loop's time on anything but syncs, by `work`: a change waits behind it.
    pub loop_work: HistogramVec,
    pub service_traffic: TrafficMetrics,
    pub backend_traffic: TrafficMetrics,
}

/// Labels of the per-service-port counters.
pub const SERVICE_LABELS: &[&str] = &["namespace", "service", "port", "protocol"];
/// Labels of the per-backend counters (`--backend-metrics`).
pub const BACKEND_LABELS: &[&str] = &["namespace", "service", "port", "protocol", "endpoint"];

fn histogram(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)).expect("valid histogram")
}

impl Metrics {
    pub fn new() -> Self {
        // kube-proxy's buckets (pkg/proxy/metrics): 1 ms doubling 15 times for syncs.
        let sync_buckets = exponential_buckets(0.001, 2.0, 15).expect("buckets");
        let mut programming = linear_buckets(0.25, 0.25, 2).expect("buckets");
        programming.extend(linear_buckets(1.0, 1.0, 59).expect("buckets"));
        programming.extend(linear_buckets(60.0, 5.0, 12).expect("buckets"));
        programming.extend(linear_buckets(120.0, 30.0, 7).expect("buckets"));
        let mut m = Metrics {
            registry: Registry::new(),
            names: Vec::new(),
            sync_duration: histogram(
                "kubeproxy_sync_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds",
                sync_buckets.clone(),
            ),
            sync_full_duration: histogram(
                "kubeproxy_sync_full_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds for full resyncs",
                sync_buckets.clone(),
            ),
            sync_partial_duration: histogram(
                "kubeproxy_sync_partial_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds for partial resyncs",
                sync_buckets,
            ),
            sync_last_timestamp: Gauge::new(
                "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                "The last time proxy rules were successfully synced",
            )
            .unwrap(),
            sync_last_queued_timestamp: Gauge::new(
                "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
                "The last time a sync of proxy rules was queued",
            )
            .unwrap(),
            network_programming_duration: histogram(
                "kubeproxy_network_programming_duration_seconds",
                "In Cluster Network Programming Latency in seconds",
                programming,
            ),
            service_changes_pending: IntGauge::new(
                "kubeproxy_sync_proxy_rules_service_changes_pending",
                "Pending proxy rules Service changes",
            )
            .unwrap(),
            service_changes_total: IntCounter::new(
                "kubeproxy_sync_proxy_rules_service_changes_total",
                "Cumulative proxy rules Service changes",
            )
            .unwrap(),
            endpoint_changes_pending: IntGauge::new(
                "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
                "Pending proxy rules Endpoint changes",
            )
            .unwrap(),
            endpoint_changes_total: IntCounter::new(
                "kubeproxy_sync_proxy_rules_endpoint_changes_total",
                "Cumulative proxy rules Endpoint changes",
            )
            .unwrap(),
            // A gauge despite its name, as in kube-proxy.
            no_local_endpoints: IntGaugeVec::new(
                Opts::new(
                    "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                    "Number of services with a Local traffic policy and no endpoints",
                ),
                &["traffic_policy"],
            )
            .unwrap(),
            healthz_total: IntCounterVec::new(
                Opts::new(
                    "kubeproxy_proxy_healthz_total",
                    "Cumulative proxy healthz HTTP status",
                ),
                &["code"],
            )
            .unwrap(),
            livez_total: IntCounterVec::new(
                Opts::new(
                    "kubeproxy_proxy_livez_total",
                    "Cumulative proxy livez HTTP status",
                ),
                &["code"],
            )
            .unwrap(),
            conntrack_deleted_total: IntCounter::new(
                "kubeproxy_conntrack_reconciler_deleted_entries_total",
                "Cumulative conntrack flows deleted by conntrack reconciler",
            )
            .unwrap(),
            iptables_rules: IntGaugeVec::new(
                Opts::new(
                    "kubeproxy_sync_proxy_rules_iptables_total",
                    "Total number of iptables rules owned by kube-proxy",
                ),
                &["table"],
            )
            .unwrap(),
            iptables_restore_failures: IntCounter::new(
                "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
                "Cumulative proxy iptables restore failures",
            )
            .unwrap(),
            iptables_partial_restore_failures: IntCounter::new(
                "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
                "Cumulative proxy iptables partial restore failures",
            )
            .unwrap(),
            nftables_rules: IntGauge::new(
                "proxy_agent_nftables_rules",
                "Rules and verdict-map elements in the nftables mode's tables",
            )
            .unwrap(),
            userspace_udp_sessions: IntGauge::new(
                "proxy_agent_userspace_udp_sessions",
                "UDP sessions (one per client address and frontend) the userspace mode holds",
            )
            .unwrap(),
            userspace_udp_session_limit: IntGauge::new(
                "proxy_agent_userspace_udp_session_limit",
                "UDP sessions the userspace mode holds at most over all frontends",
            )
            .unwrap(),
            userspace_udp_sessions_evicted: IntCounter::new(
                "proxy_agent_userspace_udp_sessions_evicted_total",
                "UDP sessions closed to make room for a new client (a frontend's least \
                 recently active)",
            )
            .unwrap(),
            userspace_udp_sessions_refused: IntCounter::new(
                "proxy_agent_userspace_udp_sessions_refused_total",
                "New UDP clients given no session because every frontend's sessions together \
                 were at the limit",
            )
            .unwrap(),
            userspace_listeners: IntGauge::new(
                "proxy_agent_userspace_listeners",
                "Frontends the userspace mode listens on (those with endpoints to serve)",
            )
            .unwrap(),
            ipvs_virtual_servers: IntGauge::new(
                "proxy_agent_ipvs_virtual_servers",
                "IPVS virtual servers the ipvs mode programs (one per frontend with endpoints)",
            )
            .unwrap(),
            ipvs_sync_failures: IntCounter::new(
                "proxy_agent_ipvs_sync_failures_total",
                "ipvs mode syncs that failed (the next one compares everything with the kernel)",
            )
            .unwrap(),
            nftables_sync_failures: IntCounter::new(
                "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
                "Cumulative proxy nftables sync failures",
            )
            .unwrap(),
            nftables_transactions: IntCounter::new(
                "proxy_agent_nftables_transactions_total",
                "nftables mode transactions sent to nf_tables (per family and sync: one, or one per table for a full sync)",
            )
            .unwrap(),
            programmed_service_ports: IntGaugeVec::new(
                Opts::new(
                    "proxy_agent_service_ports",
                    "Service ports programmed in the datapath",
                ),
                &["mode"],
            )
            .unwrap(),
            programmed_backends: IntGaugeVec::new(
                Opts::new(
                    "proxy_agent_backends",
                    "Backends programmed in the datapath",
                ),
                &["mode"],
            )
            .unwrap(),
            unprogrammed_service_ports: IntGauge::new(
                "proxy_agent_unprogrammed_service_ports",
                "Service ports that could not be programmed (map full, ...); see the log",
            )
            .unwrap(),
            other_modes_state_kept: IntGauge::new(
                "proxy_agent_other_modes_state_kept",
                "1 while removing other proxy modes' state (rules, maps, if a mode switch left \
                 any) waits for this mode to serve every service port",
            )
            .unwrap(),
            sync_failures: IntCounterVec::new(
                Opts::new(
                    "proxy_agent_sync_failures_total",
                    "Service port writes that failed, by reason (services_full, \
                     backends_full, maglev_full, ...); the port keeps what served before \
                     and is retried with backoff",
                ),
                &["reason"],
            )
            .unwrap(),
            frontend_conflicts: IntGauge::new(
                "proxy_agent_frontend_conflicts",
                "Frontends (address:port:protocol) a Service asks for and does not get because \
                 another Service owns them (cluster IP, NodePort, or an older claim); see the log",
            )
            .unwrap(),
            http_connections: IntGaugeVec::new(
                Opts::new(
                    "proxy_agent_http_connections",
                    "Open connections to the agent's HTTP servers, per connection budget \
                     (agent: /healthz, /livez, /metrics; health-check-node-ports: all of them)",
                ),
                &["server"],
            )
            .unwrap(),
            http_connection_limit: IntGaugeVec::new(
                Opts::new(
                    "proxy_agent_http_connection_limit",
                    "Connections each budget holds at most; at the cap the oldest idle one is \
                     closed",
                ),
                &["server"],
            )
            .unwrap(),
            http_connections_shed: IntCounterVec::new(
                Opts::new(
                    "proxy_agent_http_connections_shed_total",
                    "Connections closed because a budget was full (the oldest idle one, or \
                     the new one when all were answering)",
                ),
                &["server"],
            )
            .unwrap(),
            inspect_requests: IntCounterVec::new(
                Opts::new(
                    "proxy_agent_inspect_requests_total",
                    "Requests to the loopback inspect endpoint (`proxy-agent inspect`), by \
                     query and HTTP status (503: the sync loop was busy or the queue full)",
                ),
                &["query", "code"],
            )
            .unwrap(),
            external_ips_refused: IntGauge::new(
                "proxy_agent_external_ips_refused",
                "externalIPs entries not served because they are outside --external-ip-cidrs",
            )
            .unwrap(),
            map_entries: IntGaugeVec::new(
                Opts::new(
                    "proxy_agent_ebpf_map_entries",
                    "Entries in use per eBPF map",
                ),
                &["map"],
            )
            .unwrap(),
            map_capacity: IntGaugeVec::new(
                Opts::new(
                    "proxy_agent_ebpf_map_capacity",
                    "Configured entries per eBPF map",
                ),
                &["map"],
            )
            .unwrap(),
            ebpf_feature: IntGaugeVec::new(
                Opts::new(
                    "proxy_agent_ebpf_feature",
                    "What this kernel's BPF offers the eBPF datapath (1) or not (0), by feature; each missing one is logged at start with what it costs",
                ),
                &["feature"],
            )
            .unwrap(),
            datapath_events: GaugeVec::new(
                Opts::new(
                    "proxy_agent_ebpf_datapath_events",
                    "What the eBPF datapath did, by event, since its maps were created",
                ),
                &["event"],
            )
            .unwrap(),
            traffic_series_omitted: IntGaugeVec::new(
                Opts::new(
                    "proxy_agent_traffic_series_omitted",
                    "Service ports (kind=service) or backends (kind=backend) whose traffic \
                     counters are not exported: more than --traffic-metrics-limit of them",
                ),
                &["kind"],
            )
            .unwrap(),
            loop_work: HistogramVec::new(
                HistogramOpts::new(
                    "proxy_agent_sync_loop_work_seconds",
                    "Time the sync loop spent on work other than syncs (work: interfaces, \
                     conntrack_gc, counters, flow_log, takeover, manifests); a change arriving \
                     meanwhile waits for it",
                )
                .buckets(exponential_buckets(0.0005, 2.0, 15).expect("buckets")),
                &["work"],
            )
            .unwrap(),
            service_traffic: TrafficMetrics::new(
                "proxy_agent_service",
                "service port",
                SERVICE_LABELS,
            ),
            backend_traffic: TrafficMetrics::new("proxy_agent_backend", "backend", BACKEND_LABELS),
        };
        let r = m.registry.clone();
        let mut names = Vec::new();
        let mut reg = |c: Box<dyn prometheus::core::Collector>| {
            names.extend(c.desc().iter().map(|d| d.fq_name.clone()));
            r.register(c).expect("unique metric")
        };
        reg(Box::new(m.sync_duration.clone()));
        reg(Box::new(m.sync_full_duration.clone()));
        reg(Box::new(m.sync_partial_duration.clone()));
        reg(Box::new(m.sync_last_timestamp.clone()));
        reg(Box::new(m.sync_last_queued_timestamp.clone()));
        reg(Box::new(m.network_programming_duration.clone()));
        reg(Box::new(m.service_changes_pending.clone()));
        reg(Box::new(m.service_changes_total.clone()));
        reg(Box::new(m.endpoint_changes_pending.clone()));
        reg(Box::new(m.endpoint_changes_total.clone()));
        reg(Box::new(m.no_local_endpoints.clone()));
        reg(Box::new(m.healthz_total.clone()));
        reg(Box::new(m.livez_total.clone()));
        reg(Box::new(m.conntrack_deleted_total.clone()));
        reg(Box::new(m.iptables_rules.clone()));
        reg(Box::new(m.iptables_restore_failures.clone()));
        reg(Box::new(m.iptables_partial_restore_failures.clone()));
        reg(Box::new(m.nftables_rules.clone()));
        reg(Box::new(m.userspace_listeners.clone()));
        reg(Box::new(m.userspace_udp_sessions.clone()));
        reg(Box::new(m.userspace_udp_session_limit.clone()));
        reg(Box::new(m.userspace_udp_sessions_evicted.clone()));
        reg(Box::new(m.userspace_udp_sessions_refused.clone()));
        reg(Box::new(m.ipvs_virtual_servers.clone()));
        reg(Box::new(m.ipvs_sync_failures.clone()));
        reg(Box::new(m.nftables_sync_failures.clone()));
        reg(Box::new(m.nftables_transactions.clone()));
        reg(Box::new(m.programmed_service_ports.clone()));
        reg(Box::new(m.programmed_backends.clone()));
        reg(Box::new(m.unprogrammed_service_ports.clone()));
        reg(Box::new(m.sync_failures.clone()));
        reg(Box::new(m.other_modes_state_kept.clone()));
        reg(Box::new(m.frontend_conflicts.clone()));
        reg(Box::new(m.external_ips_refused.clone()));
        reg(Box::new(m.http_connections.clone()));
        reg(Box::new(m.http_connection_limit.clone()));
        reg(Box::new(m.http_connections_shed.clone()));
        reg(Box::new(m.inspect_requests.clone()));
        reg(Box::new(m.map_entries.clone()));
        reg(Box::new(m.map_capacity.clone()));
        reg(Box::new(m.ebpf_feature.clone()));
        reg(Box::new(m.datapath_events.clone()));
        reg(Box::new(m.traffic_series_omitted.clone()));
        reg(Box::new(m.loop_work.clone()));
        for c in m.service_traffic.collectors() {
            reg(c);
        }
        for c in m.backend_traffic.collectors() {
            reg(c);
        }
        m.names = names;
        // kube-proxy always exports these label sets.
        for policy in ["internal", "external"] {
            m.no_local_endpoints.with_label_values(&[policy]).set(0);
        }
        m
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding");
        String::from_utf8(out).expect("utf-8")
    }
}

/// The three counters kept per service port (or per backend).
#[derive(Clone)]
pub struct TrafficMetrics {
    pub packets: IntCounterVec,
    pub bytes: IntCounterVec,
    pub connections: IntCounterVec,
}

impl TrafficMetrics {
    fn new(prefix: &str, what: &str, labels: &[&str]) -> Self {
        let vec = |name: &str, help: String| {
            IntCounterVec::new(Opts::new(format!("{prefix}_{name}_total"), help), labels).unwrap()
        };
        TrafficMetrics {
            packets: vec(
                "packets",
                format!("Packets translated for a {what}, both directions"),
            ),
            bytes: vec(
                "bytes",
                format!("Bytes translated for a {what}, both directions"),
            ),
            connections: vec(
                "connections",
                format!("New flows given a backend, per {what}"),
            ),
        }
    }

    fn collectors(&self) -> [Box<dyn prometheus::core::Collector>; 3] {
        [
            Box::new(self.packets.clone()),
            Box::new(self.bytes.clone()),
            Box::new(self.connections.clone()),
        ]
    }
}

/// The label values of a service port.
/// Seconds since the Unix epoch, as kube-proxy's timestamp gauges report them.
pub fn unix_seconds(t: std::time::SystemTime) -> f64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

pub fn service_labels(name: &ServicePortName) -> Vec<String> {
    vec![
        name.service.namespace.clone(),
        name.service.name.clone(),
        name.port.clone(),
        name.protocol.to_string(),
    ]
}

/// Turns the datapath's absolute counters into Prometheus counter increments, and drops the
/// series of what went away.
#[derive(Default)]
pub struct TrafficCounters {
    last: HashMap<(Vec<String>, u32), ServiceStats>,
}

impl TrafficCounters {
    /// `current`: (label values, id in the datapath's array, its counters now).
    pub fn update(&mut self, m: &TrafficMetrics, current: Vec<(Vec<String>, u32, ServiceStats)>) {
        let mut next = HashMap::new();
        for (labels, id, now) in current {
            let before = self.last.remove(&(labels.clone(), id)).unwrap_or_default();
            // A counter below its last value means the maps were rebuilt: start again.
            let delta = |now: u64, before: u64| if now >= before { now - before } else { now };
            let l: Vec<&str> = labels.iter().map(String::as_str).collect();
            m.packets
                .with_label_values(&l)
                .inc_by(delta(now.packets, before.packets));
            m.bytes
                .with_label_values(&l)
                .inc_by(delta(now.bytes, before.bytes));
            m.connections
                .with_label_values(&l)
                .inc_by(delta(now.connections, before.connections));
            next.insert((labels, id), now);
        }
        // A set, not a scan of `next` per series gone: 100 000 service ports go at once
        // when the maps are rebuilt.
        let kept: HashSet<&Vec<String>> = next.keys().map(|(l, _)| l).collect();
        for ((labels, _), _) in self.last.drain() {
            if kept.contains(&labels) {
                continue;
            }
            let l: Vec<&str> = labels.iter().map(String::as_str).collect();
            let _ = m.packets.remove_label_values(&l);
            let _ = m.bytes.remove_label_values(&l);
            let _ = m.connections.remove_label_values(&l);
        }
        self.last = next;
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Name and `# TYPE` of every kube-proxy metric we export, as kube-proxy exposes them.
    pub const KUBE_PROXY_METRICS: &[(&str, &str)] = &[
        ("kubeproxy_sync_proxy_rules_duration_seconds", "histogram"),
        (
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "histogram",
        ),
        (
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "histogram",
        ),
        ("kubeproxy_sync_proxy_rules_last_timestamp_seconds", "gauge"),
        (
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "gauge",
        ),
        (
            "kubeproxy_network_programming_duration_seconds",
            "histogram",
        ),
        (
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "gauge",
        ),
        (
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "counter",
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "gauge",
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "counter",
        ),
        (
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "gauge",
        ),
        ("kubeproxy_proxy_healthz_total", "counter"),
        ("kubeproxy_proxy_livez_total", "counter"),
        (
            "kubeproxy_conntrack_reconciler_deleted_entries_total",
            "counter",
        ),
    ];

    #[test]
    fn service_counters_grow_by_deltas_and_go_with_their_service() {
        use crate::model::{ObjectName, Protocol};
        let m = Metrics::new();
        let mut c = TrafficCounters::default();
        let web = ServicePortName {
            service: ObjectName {
                namespace: "shop".into(),
                name: "web".into(),
            },
            port: "http".into(),
            protocol: Protocol::Tcp,
            family: crate::model::IpFamily::V4,
        };
        let stats = |p, b, n| ServiceStats {
            packets: p,
            bytes: b,
            connections: n,
        };
        let l = service_labels(&web);
        c.update(&m.service_traffic, vec![(l.clone(), 7, stats(10, 1000, 2))]);
        c.update(&m.service_traffic, vec![(l.clone(), 7, stats(15, 1600, 3))]);
        let text = m.render();
        let series = "{namespace=\"shop\",port=\"http\",protocol=\"TCP\",service=\"web\"}";
        assert!(
            text.contains(&format!("proxy_agent_service_packets_total{series} 15")),
            "{text}"
        );
        assert!(text.contains(&format!("proxy_agent_service_bytes_total{series} 1600")));
        assert!(text.contains(&format!("proxy_agent_service_connections_total{series} 3")));
        // Maps rebuilt (counters restart): the counter keeps growing.
        c.update(&m.service_traffic, vec![(l.clone(), 7, stats(4, 400, 1))]);
        assert!(m
            .render()
            .contains(&format!("proxy_agent_service_packets_total{series} 19")));
        // The service goes away: so do its series.
        c.update(&m.service_traffic, vec![]);
        assert!(!m.render().contains("proxy_agent_service_packets_total{"));
    }

    #[test]
    fn exposition_uses_kube_proxys_names_and_types() {
        let m = Metrics::new();
        m.healthz_total.with_label_values(&["200"]).inc();
        m.livez_total.with_label_values(&["200"]).inc();
        let text = m.render();
        for (name, kind) in KUBE_PROXY_METRICS {
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "{name} not exported as a {kind}:\n{text}"
            );
        }
        assert!(text.contains(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"} 0"
        ));
        assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 1"));
    }
}
