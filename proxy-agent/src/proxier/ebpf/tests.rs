use std::{net::Ipv4Addr, sync::Arc};

use super::{maps::InMemoryMaps, sync::service_key, *};
use crate::model::{diff, Frontend, Protocol, ServicePortState, WhenEmpty};

fn state(name: &str, vip: [u8; 4], backends: &[&str]) -> Arc<ServicePortState> {
    let backends = backends.iter().map(|b| b.parse().unwrap()).collect();
    let vip = Ipv4Addr::from(vip).into();
    Arc::new(ServicePortState::cluster_ip(
        "default", name, "", vip, backends,
    ))
}

fn desired(states: &[Arc<ServicePortState>]) -> DesiredState {
    DesiredState {
        ports: states.iter().map(|s| (s.name.clone(), s.clone())).collect(),
    }
}

fn header_count(p: &EbpfProxier<InMemoryMaps>, f: &Frontend) -> Option<u16> {
    p.map_sync()
        .maps()
        .services
        .get(&service_key(f, 0))
        .map(|v| v.count)
}

#[test]
fn a_cluster_ip_change_moves_the_service_to_its_new_frontend() {
    let mut proxier = EbpfProxier::new(InMemoryMaps::default());
    let before = desired(&[state("a", [10, 96, 0, 1], &["10.0.0.1:80"])]);
    proxier
        .sync(&before, &diff(&DesiredState::default(), &before))
        .unwrap();
    let after = desired(&[state("a", [10, 96, 0, 2], &["10.0.0.1:80"])]);
    let report = proxier.sync(&after, &diff(&before, &after)).unwrap();
    assert_eq!(report.services_written, 1);
    assert_eq!(
        header_count(&proxier, &before.ports.values().next().unwrap().frontend),
        None
    );
    assert_eq!(
        header_count(&proxier, &after.ports.values().next().unwrap().frontend),
        Some(1)
    );
    assert_eq!(proxier.map_sync().maps().backends.len(), 1);
}

#[test]
fn a_service_that_did_not_fit_is_retried_on_later_syncs() {
    // Room for one header + one slot.
    let mut proxier = EbpfProxier::new(InMemoryMaps::with_capacity(2, 10));
    let a = state("a", [10, 96, 0, 1], &["10.0.0.1:80"]);
    let b = state("b", [10, 96, 0, 2], &["10.0.0.2:80"]);
    let both = desired(&[a.clone(), b.clone()]);
    let report = proxier
        .sync(&both, &diff(&DesiredState::default(), &both))
        .unwrap();
    assert_eq!((report.services_written, report.services_failed), (1, 1));
    // Service ports are written in name order: `a` fits, `b` does not.
    assert_eq!(
        proxier.failed().into_keys().collect::<Vec<_>>(),
        vec![&b.name]
    );
    assert!(proxier.failed()[&b.name].contains("SERVICES is full"));
    assert_eq!(report.failure_reasons.get("services_full"), Some(&1));
    // Unchanged and within its backoff, it is not tried again at every sync, yet it still
    // counts as not programmed.
    let report = proxier.sync(&both, &[]).unwrap();
    assert_eq!((report.services_written, report.services_failed), (0, 1));
    assert!(
        report.failure_reasons.is_empty(),
        "no attempt within the backoff"
    );

    // `a` goes away; nothing about `b` changes, yet it gets its turn.
    let only_b = desired(std::slice::from_ref(&b));
    let report = proxier.sync(&only_b, &diff(&both, &only_b)).unwrap();
    assert_eq!((report.services_written, report.services_failed), (1, 0));
    assert!(proxier.failed().is_empty());
    assert_eq!(header_count(&proxier, &a.frontend), None);
    assert_eq!(header_count(&proxier, &b.frontend), Some(1));
}

#[test]
fn a_full_sync_repairs_drift_and_writes_nothing_when_nothing_drifted() {
    let mut proxier = EbpfProxier::new(InMemoryMaps::default());
    let a = state("a", [10, 96, 0, 1], &["10.0.0.1:80", "10.0.0.2:80"]);
    let want = desired(std::slice::from_ref(&a));
    proxier
        .sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let ops = proxier.map_sync().maps().operations;
    proxier.sync_full(&want).unwrap();
    assert_eq!(
        proxier.map_sync().maps().operations,
        ops,
        "nothing to correct"
    );
    assert_eq!(proxier.programmed(), (1, 2));
    // Someone deletes a slot behind the agent's back (bpftool map delete ...).
    let slot = service_key(&a.frontend, 2);
    proxier.maps_mut().services.remove(&slot);
    proxier.sync_full(&want).unwrap();
    assert!(
        proxier.map_sync().maps().services.contains_key(&slot),
        "repaired"
    );
    assert_eq!(header_count(&proxier, &a.frontend), Some(2));
}

#[test]
fn external_frontends_carry_their_flags_and_go_when_the_service_stops_exposing_them() {
    use crate::model::{FrontendKind, FrontendState};
    use proxy_common::{
        BACKEND_FLAG_REMOTE, SERVICE_FLAG_DROP_WHEN_EMPTY, SERVICE_FLAG_EXTERNAL,
        SERVICE_FLAG_MASQUERADE,
    };
    let node_port = Frontend {
        addr: Ipv4Addr::new(192, 168, 0, 1).into(),
        port: 30080,
        protocol: Protocol::Tcp,
    };
    let local: std::net::SocketAddr = "10.0.0.1:80".parse().unwrap();
    let remote: std::net::SocketAddr = "10.0.1.1:80".parse().unwrap();
    let plain = state("a", [10, 96, 0, 1], &["10.0.0.1:80", "10.0.1.1:80"]);
    let mut exposed = (*plain).clone();
    exposed.remote = [remote].into_iter().collect();
    exposed.external = vec![FrontendState {
        frontend: node_port,
        kind: FrontendKind::NodePort,
        backends: vec![local, remote],
        draining: vec![],
        when_empty: WhenEmpty::Refuse,
        source_ranges: vec![],
        masquerade: true,
        masquerade_all: false,
        in_cluster: None,
    }];
    let exposed = Arc::new(exposed);
    let mut proxier = EbpfProxier::new(InMemoryMaps::default());
    let first = desired(std::slice::from_ref(&exposed));
    proxier
        .sync(&first, &diff(&DesiredState::default(), &first))
        .unwrap();
    let maps = proxier.map_sync().maps();
    let header = maps.services[&service_key(node_port, 0)];
    assert_eq!(
        header.flags,
        SERVICE_FLAG_EXTERNAL | SERVICE_FLAG_MASQUERADE
    );
    assert_eq!(maps.services[&service_key(&exposed.frontend, 0)].flags, 0);
    let remote_flags: Vec<(u32, u8)> = maps
        .backends
        .values()
        .map(|b| (u32::from_be(b.addr), b.flags))
        .collect();
    assert!(remote_flags.contains(&(
        u32::from(std::net::Ipv4Addr::from([10, 0, 1, 1])),
        BACKEND_FLAG_REMOTE
    )));
    assert!(remote_flags.contains(&(u32::from(std::net::Ipv4Addr::from([10, 0, 0, 1])), 0)));
    assert_eq!(
        proxier.programmed(),
        (2, 4),
        "two frontends, two backends each"
    );

    // Local policy with no local endpoint: the header flips to "drop" in place.
    let mut dropping = (*exposed).clone();
    dropping.external[0].backends.clear();
    dropping.external[0].when_empty = WhenEmpty::Drop;
    dropping.external[0].masquerade = false;
    let second = desired(&[Arc::new(dropping)]);
    proxier.sync(&second, &diff(&first, &second)).unwrap();
    let header = proxier.map_sync().maps().services[&service_key(node_port, 0)];
    assert_eq!(
        (header.count, header.flags),
        (0, SERVICE_FLAG_DROP_WHEN_EMPTY | SERVICE_FLAG_EXTERNAL)
    );

    // Back to a ClusterIP service: the NodePort frontend is gone from the maps.
    let third = desired(std::slice::from_ref(&plain));
    proxier.sync(&third, &diff(&second, &third)).unwrap();
    assert_eq!(header_count(&proxier, &node_port), None);
    assert_eq!(header_count(&proxier, &plain.frontend), Some(2));
    assert_eq!(proxier.programmed(), (1, 2));
}

#[test]
fn a_local_policy_frontend_has_a_second_set_for_the_node_until_the_policy_changes() {
    let node_port = Frontend {
        addr: Ipv4Addr::new(192, 168, 0, 1).into(),
        port: 30080,
        protocol: Protocol::Tcp,
    };
    let inner = sync::Target::in_cluster(node_port);
    let remote: std::net::SocketAddr = "10.0.1.1:80".parse().unwrap();
    let mut local = (*state("a", [10, 96, 0, 1], &["10.0.1.1:80"])).clone();
    local.external = vec![FrontendState {
        frontend: node_port,
        kind: crate::model::FrontendKind::NodePort,
        backends: vec![],
        draining: vec![],
        when_empty: WhenEmpty::Drop,
        source_ranges: vec![],
        masquerade: false,
        masquerade_all: false,
        in_cluster: Some(crate::model::InCluster {
            backends: vec![remote],
            draining: vec![],
        }),
    }];
    let mut proxier = EbpfProxier::new(InMemoryMaps::default());
    let first = desired(&[Arc::new(local.clone())]);
    proxier
        .sync(&first, &diff(&DesiredState::default(), &first))
        .unwrap();
    let maps = proxier.map_sync().maps();
    let own = maps.services[&service_key(node_port, 0)];
    assert_eq!(
        (own.count, own.flags & SERVICE_FLAG_IN_CLUSTER_SET),
        (0, SERVICE_FLAG_IN_CLUSTER_SET)
    );
    let second = maps.services[&service_key(inner, 0)];
    assert_eq!(
        (second.count, second.flags & SERVICE_FLAG_SCOPE_IN_CLUSTER),
        (1, SERVICE_FLAG_SCOPE_IN_CLUSTER)
    );
    assert_ne!(
        second.service_id, own.service_id,
        "a frontend id of its own"
    );
    assert_eq!(
        proxier.programmed(),
        (2, 2),
        "one more set, not one more frontend"
    );

    // externalTrafficPolicy back to Cluster: the second set goes, the header no longer
    // points to it.
    let mut cluster = local;
    cluster.external[0].backends = vec![remote];
    cluster.external[0].when_empty = WhenEmpty::Refuse;
    cluster.external[0].masquerade = true;
    cluster.external[0].in_cluster = None;
    let next = desired(&[Arc::new(cluster)]);
    proxier.sync(&next, &diff(&first, &next)).unwrap();
    let maps = proxier.map_sync().maps();
    assert!(!maps.services.contains_key(&service_key(inner, 0)));
    assert!(!maps.services.contains_key(&service_key(inner, 1)));
    assert_eq!(
        maps.services[&service_key(node_port, 0)].flags & SERVICE_FLAG_IN_CLUSTER_SET,
        0
    );
    assert_eq!(proxier.programmed(), (2, 2));
}

/// `inspect` names what the pinned maps hold by `SERVICE_NAMES`: every written frontend's
/// id is named after its service port, once, and again when the frontend moves to another.
#[test]
fn service_ids_are_named_for_inspect_when_a_frontend_is_new_to_its_port() {
    let mut proxier = EbpfProxier::new(InMemoryMaps::default());
    let a = desired(&[state("a", [10, 96, 0, 1], &["10.0.0.1:80"])]);
    proxier
        .sync(&a, &diff(&DesiredState::default(), &a))
        .unwrap();
    let id = |p: &EbpfProxier<InMemoryMaps>| p.frontend_ids()[0].1;
    let named = |p: &EbpfProxier<InMemoryMaps>| p.map_sync().maps().names.get(&id(p)).cloned();
    assert_eq!(
        named(&proxier),
        Some((
            "default/a:".to_string(),
            proxy_common::FRONTEND_KIND_CLUSTER_IP
        ))
    );
    // An endpoint change rewrites the port, not its name.
    let a2 = desired(&[state("a", [10, 96, 0, 1], &["10.0.0.2:80"])]);
    proxier.map_sync_mut().maps_mut().names.clear();
    proxier.sync(&a2, &diff(&a, &a2)).unwrap();
    assert_eq!(
        named(&proxier),
        None,
        "unchanged names are not written again"
    );
    // The same frontend, now another Service's.
    let b = desired(&[state("b", [10, 96, 0, 1], &["10.0.0.2:80"])]);
    proxier.sync(&b, &diff(&a2, &b)).unwrap();
    assert_eq!(named(&proxier).unwrap().0, "default/b:");
}
