//! The sync loop against a fake proxier that records each call, fed snapshots parsed from
//! manifest text as the manifest source makes them.

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{bail, Result};

use super::*;
use crate::{
    model::{DesiredState, ServiceChange},
    proxier::{ProxyMode, SyncReport},
    source::{manifests::parse_into, Snapshot},
};

/// One call the fake proxier received.
#[derive(Debug, PartialEq, Eq)]
enum Call {
    /// A partial sync with this many changed service ports.
    Partial(usize),
    Full,
}

#[derive(Default)]
struct FakeProxier {
    calls: Vec<Call>,
    /// Calls still to fail (a refused transaction, say).
    fail: usize,
    /// Service ports each sync reports as not programmed.
    unprogrammed: usize,
    /// Which, and why (for the Events).
    unprogrammed_names: Vec<(ServicePortName, String)>,
    ports: usize,
}

impl Proxier for FakeProxier {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
    }

    fn sync(&mut self, desired: &DesiredState, changes: &[ServiceChange]) -> Result<SyncReport> {
        self.calls.push(Call::Partial(changes.len()));
        self.outcome(desired, false)
    }

    fn sync_full(&mut self, desired: &DesiredState) -> Result<SyncReport> {
        self.calls.push(Call::Full);
        self.outcome(desired, true)
    }

    fn programmed(&self) -> (usize, usize) {
        (self.ports, 0)
    }
}

impl ModeProxier for FakeProxier {
    fn unprogrammed(&self) -> Vec<(ServicePortName, String)> {
        self.unprogrammed_names.clone()
    }
}

impl FakeProxier {
    fn outcome(&mut self, desired: &DesiredState, full: bool) -> Result<SyncReport> {
        if self.fail > 0 {
            self.fail -= 1;
            bail!("the kernel refused the transaction");
        }
        self.ports = desired.ports.len();
        Ok(SyncReport {
            services_written: desired.ports.len(),
            services_failed: self.unprogrammed,
            full,
            flows_deleted: 0,
            failure_reasons: Default::default(),
        })
    }
}

/// A snapshot with ClusterIP Services `web-0` … `web-{n-1}`, one port each, and the
/// endpoints given for every one of them.
fn snapshot(services: usize, endpoints: &[&str]) -> Snapshot {
    let mut text = String::new();
    for i in 0..services {
        text.push_str(&format!(
            r#"---
apiVersion: v1
kind: Service
metadata: {{name: web-{i}, namespace: default}}
spec:
  clusterIP: 10.96.0.{ip}
  ports: [{{name: http, port: 80, protocol: TCP, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-{i}-abc
  namespace: default
  labels: {{kubernetes.io/service-name: web-{i}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints: [{eps}]
"#,
            ip = i + 10,
            eps = endpoints
                .iter()
                .map(|a| format!("{{addresses: [{a}], conditions: {{ready: true}}}}"))
                .collect::<Vec<_>>()
                .join(", "),
        ));
    }
    let mut set = Snapshot::default();
    parse_into(&text, "cluster.yaml", &mut set);
    assert!(set.problems.is_empty(), "{:?}", set.problems);
    set
}

fn sync_loop(min_sync_period: Duration) -> (SyncLoop, ProxyHealth, Arc<Metrics>) {
    let health = ProxyHealth::new(Duration::from_secs(60));
    let metrics = Arc::new(Metrics::new());
    let options = LoopOptions {
        node_name: "node-a".into(),
        node_port_addresses: Vec::new(),
        masquerade_all: false,
        external_ip_cidrs: Vec::new(),
        default_scheduler: Default::default(),
        min_sync_period,
        full_sync_period: FULL_SYNC_PERIOD,
        detect_local: Default::default(),
    };
    (
        SyncLoop::new(options, health.clone(), metrics.clone()),
        health,
        metrics,
    )
}

/// Whether the health endpoints would answer 200 `after` from now.
fn healthy_after(health: &ProxyHealth, after: Duration) -> bool {
    health.check(SystemTime::now() + after).0
}

#[test]
fn changes_within_min_sync_period_are_batched_into_one_sync() {
    let (mut syncs, _, metrics) = sync_loop(Duration::from_secs(3600));
    let mut proxier = FakeProxier::default();
    syncs.ingest(snapshot(2, &["10.0.0.1"]));
    syncs.first_sync(&mut proxier);
    assert_eq!(proxier.calls, [Call::Partial(2)]);

    // Two changes in quick succession: both wait for minSyncPeriod.
    syncs.ingest(snapshot(2, &["10.0.0.2"]));
    let first = syncs.sync_or_defer(&mut proxier).expect("deferred");
    syncs.ingest(snapshot(3, &["10.0.0.3"]));
    let second = syncs.sync_or_defer(&mut proxier).expect("deferred");
    assert_eq!(first, second, "one deadline for the batch");
    assert!(first > Instant::now() + Duration::from_secs(3000));
    assert_eq!(proxier.calls.len(), 1, "nothing synced before the deadline");
    // Two endpoint changes, then the same two again and a new service port.
    assert_eq!(syncs.pending(), 5, "2 + 3 changes waiting");
    assert_eq!(metrics.service_changes_pending.get(), 5);

    // The deadline passes: one sync hands over every change read meanwhile.
    syncs.sync(&mut proxier, false);
    assert_eq!(proxier.calls, [Call::Partial(2), Call::Partial(5)]);
    assert_eq!(syncs.pending(), 0);
    assert_eq!(metrics.service_changes_pending.get(), 0);
    assert_eq!(proxier.ports, 3);
}

#[test]
fn a_change_after_min_sync_period_syncs_at_once_and_no_change_syncs_nothing() {
    let (mut syncs, _, _) = sync_loop(Duration::ZERO);
    let mut proxier = FakeProxier::default();
    syncs.ingest(snapshot(1, &["10.0.0.1"]));
    syncs.first_sync(&mut proxier);
    // The same view again: no change, no sync.
    syncs.ingest(snapshot(1, &["10.0.0.1"]));
    assert_eq!(syncs.sync_or_defer(&mut proxier), None);
    assert_eq!(proxier.calls, [Call::Partial(1)]);
    syncs.ingest(snapshot(1, &["10.0.0.2"]));
    assert_eq!(syncs.sync_or_defer(&mut proxier), None);
    assert_eq!(proxier.calls, [Call::Partial(1), Call::Partial(1)]);
}

#[test]
fn periodic_syncs_are_partial_until_the_full_sync_period_has_passed() {
    let (mut syncs, _, _) = sync_loop(Duration::ZERO);
    let mut proxier = FakeProxier::default();
    syncs.ingest(snapshot(1, &["10.0.0.1"]));
    syncs.first_sync(&mut proxier);
    syncs.periodic(&mut proxier);
    syncs.periodic(&mut proxier);
    assert_eq!(
        proxier.calls,
        [Call::Partial(1), Call::Partial(0), Call::Partial(0)],
        "the first sync counts as full"
    );
    // An hour on: the next periodic sync is full, and the one after it partial again.
    syncs.last_full_sync = Instant::now().checked_sub(FULL_SYNC_PERIOD);
    syncs.periodic(&mut proxier);
    syncs.periodic(&mut proxier);
    assert_eq!(proxier.calls[3..], [Call::Full, Call::Partial(0)]);
}

#[test]
fn a_failed_sync_makes_the_next_one_full_and_health_turns_after_the_timeout() {
    let (mut syncs, health, _) = sync_loop(Duration::ZERO);
    let mut proxier = FakeProxier::default();
    syncs.ingest(snapshot(1, &["10.0.0.1"]));
    syncs.first_sync(&mut proxier);
    assert!(
        healthy_after(&health, Duration::from_secs(3600)),
        "idle and synced"
    );

    proxier.fail = 1;
    syncs.ingest(snapshot(2, &["10.0.0.1"]));
    assert_eq!(syncs.sync_or_defer(&mut proxier), None);
    assert_eq!(proxier.calls[1], Call::Partial(1));
    assert!(
        healthy_after(&health, Duration::from_secs(30)),
        "within 2 × syncPeriod"
    );
    assert!(
        !healthy_after(&health, Duration::from_secs(61)),
        "a change left unprogrammed beyond the timeout"
    );
    // Its change is not replayed: the next sync, periodic or not, is full.
    syncs.periodic(&mut proxier);
    assert_eq!(proxier.calls[2], Call::Full);
    assert_eq!(proxier.ports, 2, "the failed sync's service is programmed");
    assert!(healthy_after(&health, Duration::from_secs(3600)));
    // And the one after that partial again.
    syncs.periodic(&mut proxier);
    assert_eq!(proxier.calls[3], Call::Partial(0));
}

/// One tenant's Service that cannot be programmed (a full map, a Maglev table too large)
/// must not fail the node's liveness probe or every load balancer's health check: it is
/// reported per service port, and health follows the sync loop, as kube-proxy's.
#[test]
fn a_sync_leaving_service_ports_unprogrammed_is_reported_without_failing_health() {
    let (mut syncs, health, metrics) = sync_loop(Duration::ZERO);
    let mut proxier = FakeProxier {
        unprogrammed: 1,
        ..Default::default()
    };
    syncs.ingest(snapshot(1, &["10.0.0.1"]));
    syncs.first_sync(&mut proxier);
    assert_eq!(metrics.unprogrammed_service_ports.get(), 1);
    assert!(healthy_after(&health, Duration::from_secs(3600)));
    // Further changes keep being synced and health stays with the loop.
    syncs.ingest(snapshot(1, &["10.0.0.1", "10.0.0.2"]));
    syncs.sync_or_defer(&mut proxier);
    assert!(healthy_after(&health, Duration::from_secs(3600)));
    proxier.unprogrammed = 0;
    syncs.periodic(&mut proxier);
    assert_eq!(metrics.unprogrammed_service_ports.get(), 0);
    assert!(healthy_after(&health, Duration::from_secs(3600)));
}

#[test]
fn a_node_being_removed_is_ineligible_until_it_is_not() {
    let (mut syncs, health, _) = sync_loop(Duration::ZERO);
    let with_node = |node: &str| {
        let mut set = snapshot(1, &["10.0.0.1"]);
        parse_into(
            &format!("apiVersion: v1\nkind: Node\n{node}"),
            "node.yaml",
            &mut set,
        );
        set
    };
    syncs.ingest(with_node(
        "metadata: {name: node-a}\nspec:\n  taints: [{key: ToBeDeletedByClusterAutoscaler, value: \"1700000000\", effect: NoSchedule}]\n",
    ));
    assert_eq!(
        health.ineligible().as_deref(),
        Some("the Node is tainted ToBeDeletedByClusterAutoscaler")
    );
    syncs.ingest(with_node("metadata: {name: node-a}\n"));
    assert_eq!(health.ineligible(), None);
    syncs.ingest(with_node(
        "metadata: {name: node-a, deletionTimestamp: \"2026-12-01T00:00:00Z\"}\n",
    ));
    assert_eq!(
        health.ineligible().as_deref(),
        Some("the Node is being deleted")
    );
    // Another node's state is not this one's.
    syncs.ingest(with_node(
        "metadata: {name: node-b, deletionTimestamp: \"2026-12-01T00:00:00Z\"}\n",
    ));
    assert_eq!(health.ineligible(), None);
}

/// A service port the proxier could not program is told on its Service with an Event,
/// posted by the node whose maps could not take it (not by the endpoints' nodes).
#[tokio::test]
async fn an_unprogrammed_service_port_gets_an_event_on_its_service() {
    use http::{Request, Response};
    use kube::client::Body;
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let (mut syncs, _, _) = sync_loop(Duration::ZERO);
    syncs.set_events(ServiceEvents::start(
        kube::Client::new(service, "default"),
        "node-a".into(),
    ));
    // The endpoints are on other nodes (the slices name none here, so every node may post
    // a cluster-wide problem); this one is node-a's own.
    syncs.ingest(snapshot(1, &["10.244.1.1"]));
    let name = syncs.desired().ports.keys().next().unwrap().clone();
    let mut proxier = FakeProxier {
        unprogrammed: 1,
        unprogrammed_names: vec![(
            name,
            "eBPF map SERVICES is full (6 entries); raise its size in the configuration".into(),
        )],
        ..FakeProxier::default()
    };
    syncs.sync(&mut proxier, false);
    let (request, _reply) = handle.next_request().await.expect("a POST");
    assert_eq!(
        request.uri().path(),
        "/apis/events.k8s.io/v1/namespaces/default/events"
    );
    let body = request.into_body().collect_bytes().await.unwrap();
    let event: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(event["reason"], "NotProgrammed");
    assert_eq!(event["regarding"]["name"], "web-0");
    assert!(
        event["note"].as_str().is_some_and(
            |n| n.starts_with("on node node-a: port http (TCP): eBPF map SERVICES is full")
        ),
        "{event}"
    );
}

/// A watch event for one EndpointSlice queues the change of its one service port, however
/// many there are; an update that puts objects unchanged (a relist) queues nothing.
#[test]
fn a_delta_queues_only_the_service_ports_it_changed() {
    use crate::source::{Delta, Update};
    let (mut syncs, _, _) = sync_loop(Duration::ZERO);
    let mut proxier = FakeProxier::default();
    syncs.ingest(snapshot(20, &["10.0.0.1"]));
    syncs.first_sync(&mut proxier);
    assert_eq!(proxier.calls, [Call::Partial(20)]);

    let moved = snapshot(20, &["10.0.0.2"]);
    let (name, slice) = moved
        .store
        .slices
        .into_iter()
        .find(|(n, _)| n.name == "web-7-abc")
        .unwrap();
    syncs.ingest(Update::Delta(Delta {
        slices: vec![(name.clone(), Some(slice))],
        ..Delta::default()
    }));
    assert_eq!(syncs.pending(), 1);
    syncs.sync(&mut proxier, false);
    assert_eq!(proxier.calls[1], Call::Partial(1));
    let port = syncs
        .desired()
        .ports
        .values()
        .find(|p| p.backends == ["10.0.0.2:8080".parse().unwrap()])
        .expect("the moved endpoint is served");
    assert_eq!(port.name.service.name, "web-7");

    let relist = snapshot(20, &["10.0.0.1"]);
    let unchanged = relist.store.services.into_iter().map(|(n, s)| (n, Some(s)));
    syncs.ingest(Update::Delta(Delta {
        services: unchanged.collect(),
        ..Delta::default()
    }));
    assert_eq!(syncs.pending(), 0, "the Services were put again unchanged");
}
