use std::net::{IpAddr, SocketAddr};

use super::*;

pub(super) fn name(ns: &str, n: &str) -> ObjectName {
    ObjectName {
        namespace: ns.into(),
        name: n.into(),
    }
}

pub(super) fn service(n: &str, ip: &str, ports: Vec<ServicePortSpec>) -> ServiceInfo {
    ServiceInfo {
        name: name("default", n),
        created: None,
        service_type: ServiceType::ClusterIp,
        cluster_ips: vec![ip.parse().unwrap()],
        ports,
        external_ips: vec![],
        load_balancer_ips: vec![],
        source_ranges: vec![],
        affinity_timeout: None,
        external_local: false,
        internal_local: false,
        health_check_node_port: None,
        scheduler: None,
        weights: Default::default(),
    }
}

pub(super) fn port(n: &str, port: u16, target: TargetPort) -> ServicePortSpec {
    ServicePortSpec {
        name: n.into(),
        protocol: Protocol::Tcp,
        port,
        target_port: target,
        node_port: None,
    }
}

fn endpoint(addr: &str, ready: bool) -> EndpointInfo {
    EndpointInfo {
        addr: addr.parse().unwrap(),
        ready,
        serving: ready,
        terminating: false,
        node_name: None,
        zone: None,
        zone_hints: vec![],
        node_hints: vec![],
    }
}

pub(super) fn slice(
    n: &str,
    svc: &str,
    ports: Option<Vec<(&str, u16)>>,
    eps: Vec<EndpointInfo>,
) -> SliceInfo {
    SliceInfo {
        name: name("default", n),
        service: name("default", svc),
        address_type: AddressType::IPv4,
        ports: ports.map(|ps| {
            ps.into_iter()
                .map(|(n, p)| SlicePort {
                    name: n.into(),
                    protocol: Protocol::Tcp,
                    port: Some(p),
                })
                .collect()
        }),
        endpoints: eps,
    }
}

pub(super) fn store(services: Vec<ServiceInfo>, slices: Vec<SliceInfo>) -> ObjectStore {
    let origin: Origin = "test.yaml".into();
    ObjectStore {
        services: services
            .into_iter()
            .map(|s| (s.name.clone(), (Arc::new(s), origin.clone())))
            .collect(),
        slices: slices
            .into_iter()
            .map(|s| (s.name.clone(), (Arc::new(s), origin.clone())))
            .collect(),
    }
}

fn spn(svc: &str, port: &str) -> ServicePortName {
    ServicePortName {
        service: name("default", svc),
        port: port.into(),
        protocol: Protocol::Tcp,
        family: IpFamily::V4,
    }
}

fn last_octet(a: &SocketAddr) -> u8 {
    match a.ip() {
        IpAddr::V4(v4) => v4.octets()[3],
        IpAddr::V6(v6) => v6.octets()[15],
    }
}

fn addrs(list: &[&str]) -> Vec<SocketAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

#[test]
fn only_ready_endpoints_serve() {
    let st = store(
        vec![service(
            "a",
            "10.96.0.1",
            vec![port("", 80, TargetPort::Number(8080))],
        )],
        vec![slice(
            "a-1",
            "a",
            Some(vec![("", 8080)]),
            vec![endpoint("10.0.0.1", true), endpoint("10.0.0.2", false)],
        )],
    );
    let (state, problems) = DesiredState::build(&st, &NodeContext::default());
    assert!(problems.is_empty());
    assert_eq!(
        state.ports[&spn("a", "")].backends,
        addrs(&["10.0.0.1:8080"])
    );
}

#[test]
fn named_target_port_without_slice_ports_is_reported_not_guessed() {
    let st = store(
        vec![service(
            "a",
            "10.96.0.1",
            vec![port("web", 80, TargetPort::Name("http".into()))],
        )],
        vec![slice("a-1", "a", None, vec![endpoint("10.0.0.1", true)])],
    );
    let (state, problems) = DesiredState::build(&st, &NodeContext::default());
    assert_eq!(problems.len(), 1);
    assert!(
        problems[0]
            .to_string()
            .contains("EndpointSlice default/a-1"),
        "{}",
        problems[0]
    );
    assert!(problems[0].message.contains("\"http\""));
    assert!(state.ports[&spn("a", "web")].backends.is_empty());
}

#[test]
fn numeric_target_port_applies_to_slices_without_ports() {
    let st = store(
        vec![service(
            "a",
            "10.96.0.1",
            vec![port("", 80, TargetPort::Number(9000))],
        )],
        vec![slice("a-1", "a", None, vec![endpoint("10.0.0.1", true)])],
    );
    let (state, _) = DesiredState::build(&st, &NodeContext::default());
    assert_eq!(
        state.ports[&spn("a", "")].backends,
        addrs(&["10.0.0.1:9000"])
    );
}

#[test]
fn slices_of_other_services_and_families_are_ignored() {
    let mut v6 = slice("a-v6", "a", Some(vec![("", 80)]), vec![]);
    v6.address_type = AddressType::IPv6;
    v6.endpoints.push(EndpointInfo {
        addr: "fd00::1".parse().unwrap(),
        ..endpoint("10.0.0.9", true)
    });
    let st = store(
        vec![service(
            "a",
            "10.96.0.1",
            vec![port("", 80, TargetPort::Number(80))],
        )],
        vec![
            v6,
            slice(
                "b-1",
                "b",
                Some(vec![("", 80)]),
                vec![endpoint("10.0.0.2", true)],
            ),
            slice(
                "a-1",
                "a",
                Some(vec![("", 80)]),
                vec![endpoint("10.0.0.1", true)],
            ),
        ],
    );
    let (state, _) = DesiredState::build(&st, &NodeContext::default());
    assert_eq!(state.ports[&spn("a", "")].backends, addrs(&["10.0.0.1:80"]));
}

#[test]
fn headless_services_are_not_proxied() {
    let mut headless = service("h", "10.96.0.1", vec![port("", 80, TargetPort::Number(80))]);
    headless.cluster_ips.clear();
    let (state, problems) =
        DesiredState::build(&store(vec![headless], vec![]), &NodeContext::default());
    assert!(state.ports.is_empty());
    assert!(problems.is_empty());
}

fn v6_slice(n: &str, svc: &str, addrs: &[&str]) -> SliceInfo {
    SliceInfo {
        address_type: AddressType::IPv6,
        ..slice(
            n,
            svc,
            Some(vec![("", 8080)]),
            addrs.iter().map(|a| endpoint(a, true)).collect(),
        )
    }
}

#[test]
fn a_dual_stack_service_is_two_service_ports_each_with_its_own_family() {
    let mut svc = service(
        "web",
        "10.96.0.10",
        vec![ServicePortSpec {
            node_port: Some(30080),
            ..port("", 80, TargetPort::Number(8080))
        }],
    );
    svc.service_type = ServiceType::NodePort;
    svc.cluster_ips.push("fd00:96::10".parse().unwrap());
    svc.external_ips = vec![
        "203.0.113.9".parse().unwrap(),
        "2001:db8::9".parse().unwrap(),
    ];
    svc.weights = [
        ("10.0.0.1".parse().unwrap(), 3),
        ("fd00:244::1".parse().unwrap(), 5),
    ]
    .into_iter()
    .collect();
    let node = NodeContext {
        node_port_addresses: vec!["192.168.0.1".parse().unwrap(), "fd00:1::1".parse().unwrap()],
        ..NodeContext::default()
    };
    let st = store(
        vec![svc],
        vec![
            slice(
                "web-v4",
                "web",
                Some(vec![("", 8080)]),
                vec![endpoint("10.0.0.1", true)],
            ),
            v6_slice("web-v6", "web", &["fd00:244::1", "fd00:244::2"]),
        ],
    );
    let (state, problems) = DesiredState::build(&st, &node);
    assert!(problems.is_empty(), "{problems:?}");
    let v4 = &state.ports[&spn("web", "")];
    let v6 = &state.ports[&ServicePortName {
        family: IpFamily::V6,
        ..spn("web", "")
    }];
    assert_eq!(state.ports.len(), 2);
    assert_eq!(v4.frontend.addr, "10.96.0.10".parse::<IpAddr>().unwrap());
    assert_eq!(v4.backends, addrs(&["10.0.0.1:8080"]));
    assert_eq!(v6.frontend.addr, "fd00:96::10".parse::<IpAddr>().unwrap());
    assert_eq!(
        v6.backends,
        addrs(&["[fd00:244::1]:8080", "[fd00:244::2]:8080"])
    );
    let external = |s: &ServicePortState| -> Vec<String> {
        s.external.iter().map(|f| f.frontend.to_string()).collect()
    };
    assert_eq!(
        external(v4),
        ["192.168.0.1:30080/TCP", "203.0.113.9:80/TCP"]
    );
    assert_eq!(
        external(v6),
        ["[fd00:1::1]:30080/TCP", "[2001:db8::9]:80/TCP"]
    );
    assert_eq!(v4.weights.len(), 1);
    assert_eq!(v6.weights.values().collect::<Vec<_>>(), [&5]);
    assert_eq!(v6.name.to_string(), "default/web/TCP (IPv6)");
    assert_eq!(v4.name.to_string(), "default/web/TCP");
}

#[test]
fn an_ipv6_only_service_uses_only_ipv6_slices() {
    let mut v6 = service(
        "v6",
        "fd00:96::20",
        vec![port("", 80, TargetPort::Number(8080))],
    );
    v6.cluster_ips = vec!["fd00:96::20".parse::<IpAddr>().unwrap()];
    let st = store(
        vec![v6],
        vec![
            v6_slice("v6-a", "v6", &["fd00:244::7"]),
            slice(
                "v6-b",
                "v6",
                Some(vec![("", 8080)]),
                vec![endpoint("10.0.0.7", true)],
            ),
        ],
    );
    let (state, _) = DesiredState::build(&st, &NodeContext::default());
    assert_eq!(state.ports.len(), 1);
    let port = state.ports.values().next().unwrap();
    assert_eq!(port.name.family, IpFamily::V6);
    assert_eq!(port.backends, addrs(&["[fd00:244::7]:8080"]));
}

#[test]
fn two_services_on_one_frontend_keep_the_first_and_report_the_second() {
    let st = store(
        vec![
            service("a", "10.96.0.1", vec![port("", 80, TargetPort::Number(80))]),
            service("b", "10.96.0.1", vec![port("", 80, TargetPort::Number(80))]),
        ],
        vec![],
    );
    let (state, problems) = DesiredState::build(&st, &NodeContext::default());
    assert!(state.ports.contains_key(&spn("a", "")));
    assert!(!state.ports.contains_key(&spn("b", "")));
    assert_eq!(problems.len(), 1);
    assert!(problems[0].to_string().contains("Service default/b"));
    assert!(problems[0].message.contains("default/a"));
}

#[test]
fn diff_reports_exactly_what_changed() {
    let base = || {
        store(
            vec![
                service("a", "10.96.0.1", vec![port("", 80, TargetPort::Number(80))]),
                service("b", "10.96.0.2", vec![port("", 80, TargetPort::Number(80))]),
            ],
            vec![slice(
                "a-1",
                "a",
                Some(vec![("", 80)]),
                vec![endpoint("10.0.0.1", true)],
            )],
        )
    };
    let build = |st: &ObjectStore| DesiredState::build(st, &NodeContext::default()).0;
    let current = build(&base());
    let first = diff(&DesiredState::default(), &current);
    assert_eq!(first.len(), 2);
    assert!(first.iter().all(|c| matches!(c, ServiceChange::Added(_))));

    assert!(
        diff(&current, &build(&base())).is_empty(),
        "no change, no diff"
    );

    let mut next = base();
    next.services.remove(&name("default", "b"));
    next.services.insert(
        name("default", "c"),
        (
            Arc::new(service(
                "c",
                "10.96.0.3",
                vec![port("", 80, TargetPort::Number(80))],
            )),
            "t".into(),
        ),
    );
    Arc::make_mut(&mut next.slices.get_mut(&name("default", "a-1")).unwrap().0).endpoints =
        vec![endpoint("10.0.0.1", true), endpoint("10.0.0.5", true)];
    let changes = diff(&current, &build(&next));
    let summary: Vec<(String, &str, usize)> = changes
        .iter()
        .map(|c| {
            let kind = match c {
                ServiceChange::Added(_) => "added",
                ServiceChange::Updated { .. } => "updated",
                ServiceChange::Removed(_) => "removed",
            };
            (c.name().to_string(), kind, c.endpoint_changes())
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("default/a/TCP".to_string(), "updated", 1),
            ("default/c/TCP".to_string(), "added", 0),
            ("default/b/TCP".to_string(), "removed", 0),
        ]
    );
}

/// An endpoint for the selection table: `R` ready, `S` serving-and-terminating, `T`
/// terminating and not serving, `U` not ready; on node `n1` (this node) or `n2`; hinted for
/// the zones listed.
pub(super) fn ep(spec: &str, last_octet: u8, node: &str, hints: &[&str]) -> EndpointInfo {
    let (ready, serving, terminating) = match spec {
        "R" => (true, true, false),
        "S" => (false, true, true),
        "T" => (false, false, true),
        "U" => (false, false, false),
        other => panic!("{other}"),
    };
    EndpointInfo {
        addr: format!("10.0.0.{last_octet}").parse().unwrap(),
        ready,
        serving,
        terminating,
        node_name: Some(node.into()),
        zone: None,
        zone_hints: hints.iter().map(|h| h.to_string()).collect(),
        node_hints: vec![],
    }
}

/// `e` hinted for the nodes listed (`hints.forNodes`).
pub(super) fn on_nodes(mut e: EndpointInfo, nodes: &[&str]) -> EndpointInfo {
    e.node_hints = nodes.iter().map(|n| n.to_string()).collect();
    e
}

struct SelectionCase {
    what: &'static str,
    endpoints: Vec<EndpointInfo>,
    internal_local: bool,
    external_local: bool,
    /// Last octets chosen for cluster-IP traffic, and for NodePort traffic.
    internal: (&'static [u8], WhenEmpty),
    external: (&'static [u8], WhenEmpty),
    /// For NodePort traffic from this node and its pods (`externalTrafficPolicy: Local`'s
    /// short-circuit: the endpoints cluster traffic may use, whatever the internal policy).
    in_cluster: Option<&'static [u8]>,
}

#[test]
fn endpoint_selection_follows_conditions_traffic_policy_and_topology() {
    use WhenEmpty::{Drop, Refuse};
    let cases = vec![
        SelectionCase {
            what: "ready endpoints anywhere serve Cluster policy",
            endpoints: vec![
                ep("R", 1, "n1", &[]),
                ep("R", 2, "n2", &[]),
                ep("U", 3, "n1", &[]),
            ],
            internal_local: false,
            external_local: false,
            internal: (&[1, 2], Refuse),
            external: (&[1, 2], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            what: "terminating endpoints are not used while any is ready",
            endpoints: vec![ep("R", 1, "n2", &[]), ep("S", 2, "n1", &[])],
            internal_local: false,
            external_local: false,
            internal: (&[1], Refuse),
            external: (&[1], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            what: "no ready endpoint: serving-and-terminating ones take over (KEP-1669)",
            endpoints: vec![
                ep("S", 1, "n1", &[]),
                ep("S", 2, "n2", &[]),
                ep("T", 3, "n1", &[]),
            ],
            internal_local: false,
            external_local: false,
            internal: (&[1, 2], Refuse),
            external: (&[1, 2], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            what: "nothing ready or serving: refused",
            endpoints: vec![ep("T", 1, "n1", &[]), ep("U", 2, "n2", &[])],
            internal_local: false,
            external_local: true,
            internal: (&[], Refuse),
            external: (&[], Refuse),
            in_cluster: Some(&[]),
        },
        SelectionCase {
            what: "externalTrafficPolicy Local: only this node's ready endpoints",
            endpoints: vec![ep("R", 1, "n1", &[]), ep("R", 2, "n2", &[])],
            internal_local: false,
            external_local: true,
            internal: (&[1, 2], Refuse),
            external: (&[1], Drop),
            in_cluster: Some(&[1, 2]),
        },
        SelectionCase {
            what: "Local with endpoints only elsewhere: dropped, not refused",
            endpoints: vec![ep("R", 2, "n2", &[])],
            internal_local: true,
            external_local: true,
            internal: (&[], Drop),
            external: (&[], Drop),
            in_cluster: Some(&[2]),
        },
        SelectionCase {
            what: "Local falls back to this node's serving-and-terminating endpoints",
            endpoints: vec![ep("S", 1, "n1", &[]), ep("R", 2, "n2", &[])],
            internal_local: true,
            external_local: false,
            internal: (&[1], Drop),
            external: (&[2], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            what: "topology: endpoints hinted for this node's zone",
            endpoints: vec![
                ep("R", 1, "n2", &["z1"]),
                ep("R", 2, "n2", &["z2"]),
                ep("R", 3, "n1", &["z1", "z2"]),
            ],
            internal_local: false,
            external_local: false,
            internal: (&[1, 3], Refuse),
            external: (&[1, 3], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            what: "topology ignored when an endpoint lacks hints",
            endpoints: vec![ep("R", 1, "n2", &["z1"]), ep("R", 2, "n2", &[])],
            internal_local: false,
            external_local: false,
            internal: (&[1, 2], Refuse),
            external: (&[1, 2], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            what: "topology ignored when nothing is hinted for this zone",
            endpoints: vec![ep("R", 1, "n2", &["z2"]), ep("R", 2, "n2", &["z3"])],
            internal_local: false,
            external_local: false,
            internal: (&[1, 2], Refuse),
            external: (&[1, 2], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            // kube-proxy 1.34: the EndpointSlice controller writes hints only when the
            // Service asks for them, so hints alone decide.
            what: "hints decide, whatever the Service says",
            endpoints: vec![ep("R", 1, "n2", &["z1"]), ep("R", 2, "n2", &["z2"])],
            internal_local: false,
            external_local: false,
            internal: (&[1], Refuse),
            external: (&[1], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            what: "PreferSameNode: endpoints hinted for this node, before zone hints",
            endpoints: vec![
                on_nodes(ep("R", 1, "n1", &["z1"]), &["n1"]),
                on_nodes(ep("R", 2, "n2", &["z1"]), &["n2"]),
                on_nodes(ep("R", 3, "n2", &["z1"]), &["n2", "n1"]),
            ],
            internal_local: false,
            external_local: false,
            internal: (&[1, 3], Refuse),
            external: (&[1, 3], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            what: "PreferSameNode with nothing hinted for this node falls back to zone hints",
            endpoints: vec![
                on_nodes(ep("R", 1, "n2", &["z1"]), &["n2"]),
                on_nodes(ep("R", 2, "n3", &["z2"]), &["n3"]),
            ],
            internal_local: false,
            external_local: false,
            internal: (&[1], Refuse),
            external: (&[1], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            what: "node hints ignored when a ready endpoint lacks one (zone hints too: none)",
            endpoints: vec![
                on_nodes(ep("R", 1, "n1", &[]), &["n1"]),
                ep("R", 2, "n2", &[]),
                on_nodes(ep("U", 3, "n1", &[]), &[]),
            ],
            internal_local: false,
            external_local: false,
            internal: (&[1, 2], Refuse),
            external: (&[1, 2], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            what: "PreferSameNode narrows Cluster policy only, not Local",
            endpoints: vec![
                on_nodes(ep("R", 1, "n1", &[]), &["n2"]),
                on_nodes(ep("R", 2, "n2", &[]), &["n1"]),
            ],
            internal_local: true,
            external_local: false,
            internal: (&[1], Drop),
            external: (&[2], Refuse),
            in_cluster: None,
        },
        SelectionCase {
            what: "Local policy is not narrowed by topology",
            endpoints: vec![ep("R", 1, "n1", &["z2"]), ep("R", 2, "n2", &["z1"])],
            internal_local: true,
            external_local: false,
            internal: (&[1], Drop),
            external: (&[2], Refuse),
            in_cluster: None,
        },
    ];
    let node = NodeContext {
        name: "n1".into(),
        zone: Some("z1".into()),
        node_port_addresses: vec!["192.168.0.1".parse().unwrap()],
        masquerade_addr: None,
        masquerade_addr6: None,
        masquerade_all: false,
        default_scheduler: Scheduler::Random,
        external_ip_cidrs: Vec::new(),
    };
    for case in cases {
        let mut svc = service(
            "a",
            "10.96.0.1",
            vec![port("", 80, TargetPort::Number(8080))],
        );
        svc.service_type = ServiceType::NodePort;
        svc.ports[0].node_port = Some(30080);
        svc.internal_local = case.internal_local;
        svc.external_local = case.external_local;
        let st = store(vec![svc], vec![slice("a-1", "a", None, case.endpoints)]);
        let (state, problems) = DesiredState::build(&st, &node);
        assert!(problems.is_empty(), "{}: {problems:?}", case.what);
        let s = &state.ports[&spn("a", "")];
        let chosen = |octets: &[u8]| -> Vec<SocketAddr> {
            octets
                .iter()
                .map(|o| SocketAddr::new([10, 0, 0, *o].into(), 8080))
                .collect()
        };
        assert_eq!(
            (s.backends.clone(), s.when_empty),
            (chosen(case.internal.0), case.internal.1),
            "cluster IP: {}",
            case.what
        );
        assert_eq!(s.external.len(), 1, "{}", case.what);
        let np = &s.external[0];
        assert_eq!(np.kind, FrontendKind::NodePort);
        assert_eq!(np.frontend.to_string(), "192.168.0.1:30080/TCP");
        assert_eq!(
            (np.backends.clone(), np.when_empty),
            (chosen(case.external.0), case.external.1),
            "NodePort: {}",
            case.what
        );
        assert_eq!(np.masquerade, !case.external_local, "{}", case.what);
        assert_eq!(
            np.in_cluster.as_ref().map(|i| i.backends.clone()),
            case.in_cluster.map(chosen),
            "NodePort from this node: {}",
            case.what
        );
    }
}

#[test]
fn external_frontends_come_from_node_ports_external_ips_and_load_balancer_status() {
    let mut svc = service(
        "lb",
        "10.96.0.7",
        vec![port("http", 80, TargetPort::Number(8080))],
    );
    svc.service_type = ServiceType::LoadBalancer;
    svc.ports[0].node_port = Some(31000);
    svc.external_ips = vec![
        "203.0.113.5".parse().unwrap(),
        "2001:db8::5".parse().unwrap(),
    ];
    svc.load_balancer_ips = vec!["198.51.100.9".parse().unwrap()];
    svc.source_ranges = vec!["198.51.100.0/24".parse().unwrap()];
    svc.external_local = true;
    svc.health_check_node_port = Some(32000);
    svc.affinity_timeout = Some(60);
    let node = NodeContext {
        name: "n1".into(),
        zone: None,
        node_port_addresses: vec!["192.168.0.1".parse().unwrap(), "10.1.0.1".parse().unwrap()],
        masquerade_addr: None,
        masquerade_addr6: None,
        masquerade_all: false,
        default_scheduler: Scheduler::Random,
        external_ip_cidrs: Vec::new(),
    };
    let eps = vec![
        ep("R", 1, "n1", &[]),
        ep("R", 2, "n1", &[]),
        ep("R", 3, "n2", &[]),
    ];
    let st = store(
        vec![svc],
        vec![slice("lb-1", "lb", Some(vec![("http", 8080)]), eps)],
    );
    let (state, _) = DesiredState::build(&st, &node);
    let s = &state.ports[&spn("lb", "http")];
    let kinds: Vec<(String, FrontendKind, usize)> = s
        .external
        .iter()
        .map(|f| (f.frontend.to_string(), f.kind, f.source_ranges.len()))
        .collect();
    assert_eq!(
        kinds,
        [
            (
                "192.168.0.1:31000/TCP".to_string(),
                FrontendKind::NodePort,
                0
            ),
            ("10.1.0.1:31000/TCP".to_string(), FrontendKind::NodePort, 0),
            (
                "203.0.113.5:80/TCP".to_string(),
                FrontendKind::ExternalIp,
                0
            ),
            (
                "198.51.100.9:80/TCP".to_string(),
                FrontendKind::LoadBalancer,
                1
            ),
        ]
    );
    assert_eq!(s.health_check, Some((32000, 2)), "two local endpoints");
    assert_eq!(s.affinity_timeout, Some(60));
    assert_eq!(
        s.remote.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        ["10.0.0.3:8080"]
    );
    assert_eq!(
        s.frontends().len(),
        5,
        "cluster IP first, then the four above"
    );
}

#[test]
fn node_port_addresses_come_from_cidrs_the_node_object_or_local_addresses() {
    let node = NodeInfo {
        name: "n1".into(),
        addresses: vec![
            ("InternalIP".into(), "10.0.0.5".parse().unwrap()),
            ("ExternalIP".into(), "203.0.113.5".parse().unwrap()),
            ("InternalIP".into(), "fd00::5".parse().unwrap()),
        ],
        zone: Some("z1".into()),
        ineligible: None,
        pod_cidrs: Vec::new(),
    };
    let ips = |list: &[&str]| -> Vec<IpAddr> { list.iter().map(|a| a.parse().unwrap()).collect() };
    let local = ips(&[
        "127.0.0.1",
        "10.0.0.5",
        "192.168.7.1",
        "::1",
        "fe80::1",
        "fd00::5",
    ]);
    let ctx = NodeContext::new("n1", Some(&node), &[], &local);
    assert_eq!(
        ctx.node_port_addresses,
        ips(&["10.0.0.5", "203.0.113.5", "fd00::5"])
    );
    assert_eq!(ctx.zone.as_deref(), Some("z1"));
    assert_eq!(ctx.masquerade_addr, Some("10.0.0.5".parse().unwrap()));
    assert_eq!(ctx.masquerade_addr6, Some("fd00::5".parse().unwrap()));
    // No Node object: every local address but loopback and link-local ones.
    let ctx = NodeContext::new("n1", None, &[], &local);
    assert_eq!(
        ctx.node_port_addresses,
        ips(&["10.0.0.5", "192.168.7.1", "fd00::5"])
    );
    let cidr = NodePortAddress::Cidr("192.168.0.0/16".parse().unwrap());
    let ctx = NodeContext::new("n1", Some(&node), std::slice::from_ref(&cidr), &local);
    assert_eq!(ctx.node_port_addresses, ips(&["192.168.7.1"]));
    let cidr6 = NodePortAddress::Cidr("fd00::/64".parse().unwrap());
    let ctx = NodeContext::new("n1", Some(&node), &[cidr.clone(), cidr6], &local);
    assert_eq!(ctx.node_port_addresses, ips(&["192.168.7.1", "fd00::5"]));
    let ctx = NodeContext::new("n1", Some(&node), &[cidr, NodePortAddress::Primary], &local);
    assert_eq!(
        ctx.node_port_addresses,
        ips(&["10.0.0.5", "192.168.7.1", "fd00::5"])
    );
}

#[test]
fn not_ready_endpoints_drain_instead_of_disappearing() {
    let node = NodeContext {
        name: "n1".into(),
        ..NodeContext::default()
    };
    let eps = vec![
        ep("R", 1, "n1", &[]),
        ep("S", 2, "n2", &[]),
        ep("U", 3, "n1", &[]),
    ];
    let mut svc = service(
        "a",
        "10.96.0.1",
        vec![port("", 80, TargetPort::Number(8080))],
    );
    let st = store(
        vec![svc.clone()],
        vec![slice("a-1", "a", None, eps.clone())],
    );
    let (state, _) = DesiredState::build(&st, &node);
    let s = &state.ports[&spn("a", "")];
    let octets = |v: &[SocketAddr]| v.iter().map(last_octet).collect::<Vec<_>>();
    assert_eq!(octets(&s.backends), [1]);
    assert_eq!(
        octets(&s.draining),
        [2, 3],
        "established flows to them go on"
    );
    // Local policy: only this node's not-ready endpoints can have flows from here.
    svc.internal_local = true;
    let st = store(vec![svc], vec![slice("a-1", "a", None, eps)]);
    let (state, _) = DesiredState::build(&st, &node);
    let s = &state.ports[&spn("a", "")];
    assert_eq!(octets(&s.draining), [3]);
}

#[test]
fn the_scheduler_is_the_annotations_else_the_default_and_weight_zero_drains() {
    let node = NodeContext {
        name: "n1".into(),
        default_scheduler: Scheduler::Rr,
        ..NodeContext::default()
    };
    let eps = vec![ep("R", 1, "n1", &[]), ep("R", 2, "n1", &[])];
    let plain = service(
        "a",
        "10.96.0.1",
        vec![port("", 80, TargetPort::Number(8080))],
    );
    let mut weighted = service(
        "b",
        "10.96.0.2",
        vec![port("", 80, TargetPort::Number(8080))],
    );
    weighted.scheduler = Some(Scheduler::Wrr);
    weighted.weights = [("10.0.0.2".parse().unwrap(), 0)].into();
    let st = store(
        vec![plain, weighted],
        vec![
            slice("a-1", "a", None, eps.clone()),
            slice("b-1", "b", None, eps),
        ],
    );
    let (state, _) = DesiredState::build(&st, &node);
    assert_eq!(state.ports[&spn("a", "")].scheduler, Scheduler::Rr);
    let b = &state.ports[&spn("b", "")];
    assert_eq!(b.scheduler, Scheduler::Wrr);
    let octets = |v: &[SocketAddr]| v.iter().map(last_octet).collect::<Vec<_>>();
    assert_eq!(octets(&b.backends), [1], "weight 0: no new flows");
    assert_eq!(octets(&b.draining), [2], "its established flows go on");
}

// --- frontend ownership (model/ownership.rs) ---

fn frontends_of(state: &DesiredState, svc: &str) -> Vec<(String, FrontendKind)> {
    state
        .ports
        .values()
        .filter(|p| p.name.service.name == svc)
        .flat_map(|p| p.frontends())
        .map(|f| (f.frontend.to_string(), f.kind))
        .collect()
}

fn conflicts(problems: &[Problem]) -> Vec<String> {
    problems
        .iter()
        .filter(|p| p.kind == ProblemKind::FrontendConflict)
        .map(|p| format!("{}: {}", p.object, p.message))
        .collect()
}

pub(super) fn web_port() -> Vec<ServicePortSpec> {
    vec![port("http", 80, TargetPort::Number(8080))]
}

/// Builds the state with the Services inserted in both orders (and so under both names
/// first): ownership must not depend on either.
fn both_orders(a: ServiceInfo, b: ServiceInfo, node: &NodeContext) -> (DesiredState, Vec<Problem>) {
    let first = DesiredState::build(&store(vec![a.clone(), b.clone()], vec![]), node);
    let (mut a2, mut b2) = (a, b);
    // Swap the names: the same two claims, the other one now sorts first.
    std::mem::swap(&mut a2.name, &mut b2.name);
    let second = DesiredState::build(&store(vec![b2, a2], vec![]), node);
    // The same Service by content (its cluster IP) serves each frontend in both.
    let winners = |s: &DesiredState| {
        let mut w: Vec<(String, IpAddr)> = s
            .ports
            .values()
            .flat_map(|p| {
                p.frontends()
                    .into_iter()
                    .map(move |f| (f.frontend.to_string(), p.frontend.addr))
            })
            .collect();
        w.sort();
        w
    };
    assert_eq!(
        winners(&first.0),
        winners(&second.0),
        "ownership depends on names"
    );
    first
}

#[test]
fn an_external_ip_never_takes_a_cluster_ip() {
    // "aaa" sorts before "kube-dns" and is newer: neither order nor age lets it win.
    let dns = ServiceInfo {
        created: Some(100),
        ..service("kube-dns", "10.96.0.10", web_port())
    };
    let evil = ServiceInfo {
        created: Some(50),
        external_ips: vec!["10.96.0.10".parse().unwrap(), "192.0.2.7".parse().unwrap()],
        ..service("aaa", "10.96.0.20", web_port())
    };
    let (state, problems) = both_orders(dns.clone(), evil.clone(), &NodeContext::default());
    assert_eq!(
        frontends_of(&state, "kube-dns"),
        vec![("10.96.0.10:80/TCP".to_string(), FrontendKind::ClusterIp)]
    );
    // Only the conflicting frontend is dropped: evil keeps its cluster IP and other IP.
    assert_eq!(
        frontends_of(&state, "aaa"),
        vec![
            ("10.96.0.20:80/TCP".to_string(), FrontendKind::ClusterIp),
            ("192.0.2.7:80/TCP".to_string(), FrontendKind::ExternalIp),
        ]
    );
    let c = conflicts(&problems);
    assert_eq!(c.len(), 1, "{problems:?}");
    assert!(
        c[0].starts_with("Service default/aaa: port 80: spec.externalIPs[0]: 10.96.0.10:80/TCP not served: it is the cluster IP of default/kube-dns:http/TCP"),
        "{c:?}"
    );
}

#[test]
fn a_node_port_wins_over_an_external_ip_on_a_node_address() {
    let node = NodeContext {
        node_port_addresses: vec!["192.168.0.1".parse().unwrap()],
        ..NodeContext::default()
    };
    let mut np_port = web_port();
    np_port[0].node_port = Some(30080);
    let np = ServiceInfo {
        created: Some(100),
        service_type: ServiceType::NodePort,
        ..service("np", "10.96.0.30", np_port)
    };
    let squatter = ServiceInfo {
        created: Some(1),
        external_ips: vec!["192.168.0.1".parse().unwrap()],
        ..service(
            "squatter",
            "10.96.0.31",
            vec![port("http", 30080, TargetPort::Number(8080))],
        )
    };
    let (state, problems) = both_orders(np, squatter, &node);
    assert!(frontends_of(&state, "np")
        .contains(&("192.168.0.1:30080/TCP".to_string(), FrontendKind::NodePort)));
    assert_eq!(
        frontends_of(&state, "squatter"),
        vec![("10.96.0.31:30080/TCP".to_string(), FrontendKind::ClusterIp)]
    );
    let c = conflicts(&problems);
    assert_eq!(c.len(), 1, "{problems:?}");
    assert!(
        c[0].contains("it is the NodePort of default/np:http/TCP on this node"),
        "{c:?}"
    );
}

#[test]
fn between_external_claims_the_older_service_wins_whatever_the_names() {
    for (old_name, new_name) in [("aaa", "zzz"), ("zzz", "aaa")] {
        let old = ServiceInfo {
            created: Some(10),
            external_ips: vec!["192.0.2.1".parse().unwrap()],
            ..service(old_name, "10.96.0.40", web_port())
        };
        let mut new = ServiceInfo {
            created: Some(20),
            ..service(new_name, "10.96.0.41", web_port())
        };
        new.service_type = ServiceType::LoadBalancer;
        new.load_balancer_ips = vec!["192.0.2.1".parse().unwrap()];
        let (state, problems) =
            DesiredState::build(&store(vec![old, new], vec![]), &NodeContext::default());
        assert!(frontends_of(&state, old_name)
            .contains(&("192.0.2.1:80/TCP".to_string(), FrontendKind::ExternalIp)));
        assert_eq!(
            frontends_of(&state, new_name),
            vec![("10.96.0.41:80/TCP".to_string(), FrontendKind::ClusterIp)]
        );
        let c = conflicts(&problems);
        assert_eq!(c.len(), 1, "{problems:?}");
        assert!(
            c[0].contains(&format!(
                "status.loadBalancer.ingress[0].ip: 192.0.2.1:80/TCP not served: default/{old_name}:http/TCP claimed it first"
            )),
            "{c:?}"
        );
    }
}

#[test]
fn same_age_external_claims_go_to_the_first_name() {
    let a = ServiceInfo {
        external_ips: vec!["192.0.2.1".parse().unwrap()],
        ..service("a", "10.96.0.50", web_port())
    };
    let b = ServiceInfo {
        external_ips: vec!["192.0.2.1".parse().unwrap()],
        ..service("b", "10.96.0.51", web_port())
    };
    let (state, _) = DesiredState::build(&store(vec![b, a], vec![]), &NodeContext::default());
    assert_eq!(frontends_of(&state, "a").len(), 2);
    assert_eq!(frontends_of(&state, "b").len(), 1);
}

#[test]
fn a_port_that_loses_its_cluster_ip_takes_no_other_frontend() {
    // Two manifests with one cluster IP: the older is served; the newer's external IP must
    // not take the address from a third Service, since the newer is not served at all.
    let older = ServiceInfo {
        created: Some(1),
        ..service("older", "10.96.0.60", web_port())
    };
    let newer = ServiceInfo {
        created: Some(2),
        external_ips: vec!["192.0.2.9".parse().unwrap()],
        ..service("newer", "10.96.0.60", web_port())
    };
    let third = ServiceInfo {
        created: Some(3),
        external_ips: vec!["192.0.2.9".parse().unwrap()],
        ..service("third", "10.96.0.61", web_port())
    };
    let (state, problems) = DesiredState::build(
        &store(vec![older, newer, third], vec![]),
        &NodeContext::default(),
    );
    assert!(frontends_of(&state, "newer").is_empty());
    assert_eq!(frontends_of(&state, "third").len(), 2);
    assert_eq!(conflicts(&problems).len(), 1, "{problems:?}");
}

#[test]
fn external_ips_outside_the_allowed_cidrs_are_refused_and_reported() {
    let node = NodeContext {
        external_ip_cidrs: vec!["192.0.2.0/24".parse().unwrap()],
        ..NodeContext::default()
    };
    let svc = ServiceInfo {
        external_ips: vec!["192.0.2.5".parse().unwrap(), "10.96.0.10".parse().unwrap()],
        ..service("web", "10.96.0.70", web_port())
    };
    let (state, problems) = DesiredState::build(&store(vec![svc], vec![]), &node);
    assert_eq!(
        frontends_of(&state, "web"),
        vec![
            ("10.96.0.70:80/TCP".to_string(), FrontendKind::ClusterIp),
            ("192.0.2.5:80/TCP".to_string(), FrontendKind::ExternalIp),
        ]
    );
    let refused: Vec<_> = problems
        .iter()
        .filter(|p| p.kind == ProblemKind::ExternalIpRefused)
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        refused,
        vec!["test.yaml: Service default/web: port 80: spec.externalIPs[1]: 10.96.0.10 not served: outside --external-ip-cidrs"]
    );
}

/// The short-circuit's endpoints count for the flows a change ends: a pod's flow through an
/// `externalTrafficPolicy: Local` LB IP to an endpoint that left ends, and untranslated
/// entries end once such a frontend serves the node's clients at all.
#[test]
fn flows_of_clients_on_the_node_end_with_their_short_circuit_endpoint() {
    let (a, b): (SocketAddr, SocketAddr) = (
        "10.0.2.1:8080".parse().unwrap(),
        "10.0.2.2:8080".parse().unwrap(),
    );
    let with = |inner: Vec<SocketAddr>| {
        let mut s = ServicePortState::cluster_ip(
            "default",
            "web",
            "http",
            "10.96.0.1".parse().unwrap(),
            // internalTrafficPolicy: Local, no endpoint on this node.
            Vec::new(),
        );
        s.external = vec![FrontendState {
            frontend: Frontend {
                addr: "203.0.113.9".parse().unwrap(),
                port: 80,
                protocol: Protocol::Tcp,
            },
            kind: FrontendKind::LoadBalancer,
            backends: Vec::new(),
            draining: Vec::new(),
            when_empty: WhenEmpty::Drop,
            source_ranges: Vec::new(),
            masquerade: false,
            masquerade_all: false,
            in_cluster: Some(InCluster {
                backends: inner,
                draining: Vec::new(),
            }),
        }];
        Arc::new(s)
    };
    let lb = with(vec![]).external[0].frontend;
    let change = |old: Arc<ServicePortState>, new: Arc<ServicePortState>| {
        let desired = DesiredState {
            ports: [(new.name.clone(), new.clone())].into(),
        };
        stale_flows(&[ServiceChange::Updated { old, new }], &desired)
    };
    assert_eq!(
        change(with(vec![a, b]), with(vec![a])),
        vec![StaleFlow {
            frontend: lb,
            endpoint: Some(b),
        }]
    );
    assert_eq!(
        change(with(vec![]), with(vec![a])),
        vec![StaleFlow {
            frontend: lb,
            endpoint: None,
        }]
    );
    assert!(with(vec![a]).all_backends().contains(&a));
}
