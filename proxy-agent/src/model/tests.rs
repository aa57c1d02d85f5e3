use std::net::{IpAddr, SocketAddrV4};

use super::*;

fn name(ns: &str, n: &str) -> ObjectName {
    ObjectName {
        namespace: ns.into(),
        name: n.into(),
    }
}

fn service(n: &str, ip: &str, ports: Vec<ServicePortSpec>) -> ServiceInfo {
    ServiceInfo {
        name: name("default", n),
        cluster_ips: vec![ip.parse().unwrap()],
        ports,
    }
}

fn port(n: &str, port: u16, target: TargetPort) -> ServicePortSpec {
    ServicePortSpec {
        name: n.into(),
        protocol: Protocol::Tcp,
        port,
        target_port: target,
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
    }
}

fn slice(n: &str, svc: &str, ports: Option<Vec<(&str, u16)>>, eps: Vec<EndpointInfo>) -> SliceInfo {
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

fn store(services: Vec<ServiceInfo>, slices: Vec<SliceInfo>) -> ObjectStore {
    let origin: Origin = "test.yaml".into();
    ObjectStore {
        services: services
            .into_iter()
            .map(|s| (s.name.clone(), (s, origin.clone())))
            .collect(),
        slices: slices
            .into_iter()
            .map(|s| (s.name.clone(), (s, origin.clone())))
            .collect(),
    }
}

fn spn(svc: &str, port: &str) -> ServicePortName {
    ServicePortName {
        service: name("default", svc),
        port: port.into(),
        protocol: Protocol::Tcp,
    }
}

fn addrs(list: &[&str]) -> Vec<SocketAddrV4> {
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
    let (state, problems) = DesiredState::build(&st);
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
    let (state, problems) = DesiredState::build(&st);
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
    let (state, _) = DesiredState::build(&st);
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
    let (state, _) = DesiredState::build(&st);
    assert_eq!(state.ports[&spn("a", "")].backends, addrs(&["10.0.0.1:80"]));
}

#[test]
fn headless_and_ipv6_only_services_are_not_proxied() {
    let mut headless = service("h", "10.96.0.1", vec![port("", 80, TargetPort::Number(80))]);
    headless.cluster_ips.clear();
    let mut v6 = service(
        "v6",
        "10.96.0.2",
        vec![port("", 80, TargetPort::Number(80))],
    );
    v6.cluster_ips = vec!["fd00::10".parse::<IpAddr>().unwrap()];
    let (state, problems) = DesiredState::build(&store(vec![headless, v6], vec![]));
    assert!(state.ports.is_empty());
    assert!(problems.is_empty());
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
    let (state, problems) = DesiredState::build(&st);
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
    let mut tracker = ChangeTracker::default();
    let first = tracker.update(DesiredState::build(&base()).0);
    assert_eq!(first.len(), 2);
    assert!(first.iter().all(|c| matches!(c, ServiceChange::Added(_))));

    assert!(
        tracker.update(DesiredState::build(&base()).0).is_empty(),
        "no change, no diff"
    );

    let mut next = base();
    next.services.remove(&name("default", "b"));
    next.services.insert(
        name("default", "c"),
        (
            service("c", "10.96.0.3", vec![port("", 80, TargetPort::Number(80))]),
            "t".into(),
        ),
    );
    next.slices
        .get_mut(&name("default", "a-1"))
        .unwrap()
        .0
        .endpoints = vec![endpoint("10.0.0.1", true), endpoint("10.0.0.5", true)];
    let changes = tracker.update(DesiredState::build(&next).0);
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
