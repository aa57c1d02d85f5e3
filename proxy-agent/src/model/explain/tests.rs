//! Explanations through the path the agent asks them (`IncrementalModel::explain`), checked
//! against the desired state the same model built: an explanation may never disagree with
//! what is served.

use std::net::SocketAddr;

use super::super::tests::{ep, name, on_nodes, port, service, slice, store, web_port};
use super::super::{
    incremental::IncrementalModel, EndpointInfo, NodeContext, ObjectStore, Scheduler, ServiceInfo,
    ServiceType, TargetPort,
};
use super::*;

fn node() -> NodeContext {
    NodeContext {
        name: "n1".into(),
        zone: Some("z1".into()),
        node_port_addresses: vec!["192.168.0.1".parse().unwrap()],
        default_scheduler: Scheduler::Random,
        ..NodeContext::default()
    }
}

/// The explanation of `default/<svc>` after the model was built from `st`.
fn explained(st: &ObjectStore, svc: &str) -> Explanation {
    let mut model = IncrementalModel::default();
    model.rebuild(st, &node());
    model.explain(st, &node(), &name("default", svc))
}

fn node_port_service(internal_local: bool, external_local: bool) -> ServiceInfo {
    let mut svc = service(
        "a",
        "10.96.0.1",
        vec![port("", 80, TargetPort::Number(8080))],
    );
    svc.service_type = ServiceType::NodePort;
    svc.ports[0].node_port = Some(30080);
    svc.internal_local = internal_local;
    svc.external_local = external_local;
    svc
}

/// (state, reason) of the endpoint with this last octet for this kind of traffic.
fn use_of<'a>(port: &'a PortExplanation, octet: u8, traffic: &str) -> (&'a str, &'a str) {
    let ep = port
        .endpoints
        .iter()
        .find(|e| e.address == SocketAddr::new([10, 0, 0, octet].into(), 8080))
        .unwrap_or_else(|| panic!("no endpoint .{octet} in {port:#?}"));
    let u = ep
        .uses
        .iter()
        .find(|u| u.traffic == traffic)
        .unwrap_or_else(|| panic!("no {traffic} use of .{octet}: {ep:#?}"));
    (&u.state, &u.reason)
}

fn with_endpoints(svc: ServiceInfo, endpoints: Vec<EndpointInfo>) -> ObjectStore {
    store(vec![svc], vec![slice("a-1", "a", None, endpoints)])
}

#[test]
fn zone_hints_used_name_the_zone_and_the_endpoints_left_out() {
    let st = with_endpoints(
        node_port_service(false, false),
        vec![ep("R", 1, "n1", &["z1"]), ep("R", 2, "n2", &["z2"])],
    );
    let e = explained(&st, "a");
    assert!(
        e.found && e.problems.is_empty() && e.note.is_none(),
        "{e:#?}"
    );
    let p = &e.ports[0];
    assert!(p.served);
    assert!(p.topology.starts_with("zone hints used"), "{}", p.topology);
    assert_eq!(
        use_of(p, 1, "clusterIP"),
        ("serving", "ready, hinted for this node's zone z1")
    );
    let (state, reason) = use_of(p, 2, "clusterIP");
    assert_eq!(state, "unused");
    assert!(
        reason.contains("topology hints keep this traffic to endpoints hinted for zone z1")
            && reason.ends_with("hinted for z2"),
        "{reason}"
    );
    // NodePorts follow the same hints: the model applies them to both.
    assert_eq!(use_of(p, 2, "external").0, "unused");
}

#[test]
fn hints_are_ignored_with_the_reason_when_one_ready_endpoint_has_none() {
    let st = with_endpoints(
        node_port_service(false, false),
        vec![ep("R", 1, "n1", &["z1"]), ep("R", 2, "n2", &[])],
    );
    let p = &explained(&st, "a").ports[0];
    assert!(
        p.topology.contains("some ready endpoint has none"),
        "{}",
        p.topology
    );
    assert_eq!(use_of(p, 2, "clusterIP"), ("serving", "ready"));

    // Node hints none of which names this node.
    let st = with_endpoints(
        node_port_service(false, false),
        vec![on_nodes(ep("R", 1, "n2", &[]), &["n2"])],
    );
    let p = &explained(&st, "a").ports[0];
    assert!(
        p.topology.contains("none names this node"),
        "{}",
        p.topology
    );
}

#[test]
fn local_policy_without_a_local_endpoint_says_traffic_is_dropped_and_why() {
    let st = with_endpoints(
        node_port_service(true, true),
        vec![ep("R", 2, "n2", &[]), ep("R", 3, "n2", &[])],
    );
    let p = &explained(&st, "a").ports[0];
    let outcomes: Vec<(&str, &str)> = p
        .when_empty
        .iter()
        .map(|t| (t.traffic.as_str(), t.outcome.as_str()))
        .collect();
    assert!(
        outcomes
            .iter()
            .any(|(t, o)| *t == "clusterIP" && o.starts_with("dropped"))
            && outcomes
                .iter()
                .any(|(t, o)| *t == "external" && o.starts_with("dropped")),
        "{outcomes:?}"
    );
    let (state, reason) = use_of(p, 2, "clusterIP");
    assert_eq!(state, "unused");
    assert_eq!(
        reason,
        "on node n2: the policy is Local, so only this node's endpoints are used"
    );
    // This node's own clients reach NodePorts through every endpoint (the short-circuit).
    assert_eq!(use_of(p, 2, "externalFromThisNode").0, "serving");
}

#[test]
fn terminating_endpoints_say_whether_they_serve_as_the_fallback() {
    let both = vec![ep("R", 1, "n2", &[]), ep("S", 2, "n1", &[])];
    let p = &explained(&with_endpoints(node_port_service(false, false), both), "a").ports[0];
    assert_eq!(use_of(p, 1, "clusterIP"), ("serving", "ready"));
    let (state, reason) = use_of(p, 2, "clusterIP");
    assert_eq!(state, "draining", "{reason}");
    assert!(
        reason.starts_with("terminating: no new connections"),
        "{reason}"
    );

    let only_terminating = vec![ep("S", 2, "n1", &[]), ep("T", 3, "n1", &[])];
    let p = &explained(
        &with_endpoints(node_port_service(false, false), only_terminating),
        "a",
    )
    .ports[0];
    assert_eq!(
        use_of(p, 2, "clusterIP"),
        (
            "serving",
            "serving and terminating: used because no endpoint is ready anywhere"
        )
    );
    assert_ne!(use_of(p, 3, "clusterIP").0, "serving");
}

#[test]
fn a_lost_cluster_ip_is_explained_on_the_losing_service() {
    let older = ServiceInfo {
        created: Some(1),
        ..service("older", "10.96.0.60", web_port())
    };
    let newer = ServiceInfo {
        created: Some(2),
        ..service("newer", "10.96.0.60", web_port())
    };
    let st = store(vec![older, newer], vec![]);
    let e = explained(&st, "newer");
    assert!(e.found);
    let p = &e.ports[0];
    assert!(!p.served);
    assert!(
        p.not_served
            .as_deref()
            .unwrap()
            .contains("belongs to another Service"),
        "{p:#?}"
    );
    assert!(!p.frontends[0].served);
    assert!(
        p.frontends[0]
            .reason
            .as_deref()
            .unwrap()
            .contains("default/older"),
        "{p:#?}"
    );
    assert!(!e.problems.is_empty(), "{e:#?}");
    assert!(explained(&st, "older").ports[0].served);
}

#[test]
fn unknown_and_headless_services_say_so() {
    let st = store(vec![], vec![]);
    let e = explained(&st, "nothing");
    assert!(!e.found);
    assert!(e.note.unwrap().starts_with("not known to the agent"));
    let mut headless = service("h", "10.96.0.9", web_port());
    headless.cluster_ips.clear();
    let e = explained(&store(vec![headless], vec![]), "h");
    assert!(e.found && e.ports.is_empty());
    assert!(e.note.unwrap().starts_with("no cluster IP"));
}

/// What the explanation calls serving is exactly what the model serves, over the whole
/// selection table of the model's own tests' shapes.
#[test]
fn serving_endpoints_are_exactly_the_desired_state_backends() {
    let sets: Vec<Vec<EndpointInfo>> = vec![
        vec![
            ep("R", 1, "n1", &["z1"]),
            ep("R", 2, "n2", &["z2"]),
            ep("U", 3, "n1", &[]),
        ],
        vec![
            ep("S", 1, "n1", &[]),
            ep("S", 2, "n2", &[]),
            ep("T", 3, "n2", &[]),
        ],
        vec![
            on_nodes(ep("R", 1, "n2", &[]), &["n1"]),
            ep("R", 2, "n1", &[]),
        ],
    ];
    for endpoints in sets {
        for (internal, external) in [(false, false), (true, false), (false, true), (true, true)] {
            let st = with_endpoints(node_port_service(internal, external), endpoints.clone());
            let (state, _) = super::super::DesiredState::build(&st, &node());
            let built = state.ports.values().next().unwrap();
            let p = &explained(&st, "a").ports[0];
            let serving = |traffic: &str| -> Vec<SocketAddr> {
                p.endpoints
                    .iter()
                    .filter(|e| {
                        e.uses
                            .iter()
                            .any(|u| u.traffic == traffic && u.state == "serving")
                    })
                    .map(|e| e.address)
                    .collect()
            };
            let mut backends = built.backends.clone();
            backends.sort();
            let mut external_backends = built.external[0].backends.clone();
            external_backends.sort();
            assert_eq!(
                serving("clusterIP"),
                backends,
                "{internal} {external}: {p:#?}"
            );
            assert_eq!(
                serving("external"),
                external_backends,
                "{internal} {external}"
            );
        }
    }
}

/// The JSON `inspect explain -o json` prints, field names included (docs/inspect.md: they
/// are kept stable), for a Service that shows most reasons at once: zone hints, a Local
/// external policy, a terminating and a not-ready endpoint, and an external IP refused.
#[test]
fn the_json_is_the_golden_one() {
    let mut svc = node_port_service(false, true);
    svc.external_ips = vec![
        "192.0.2.7".parse().unwrap(),
        "198.51.100.7".parse().unwrap(),
    ];
    svc.health_check_node_port = Some(32000);
    svc.affinity_timeout = Some(10800);
    let node = NodeContext {
        external_ip_cidrs: vec!["192.0.2.0/24".parse().unwrap()],
        ..node()
    };
    let mut terminating = ep("S", 3, "n1", &["z1"]);
    terminating.zone = Some("z1".into());
    let mut endpoints = vec![
        ep("R", 1, "n1", &["z1"]),
        ep("R", 2, "n2", &["z2"]),
        terminating,
        ep("U", 4, "n2", &[]),
    ];
    endpoints[0].zone = Some("z1".into());
    endpoints[1].zone = Some("z2".into());
    let st = with_endpoints(svc, endpoints);
    let mut model = IncrementalModel::default();
    model.rebuild(&st, &node);
    let e = model.explain(&st, &node, &name("default", "a"));
    let json = serde_json::to_string_pretty(&e).unwrap() + "\n";
    crate::inspect::assert_golden("explain.json", &json);
}
