//! The agent in API-server mode, end to end: a replayed API server (list + watch over HTTP,
//! inside the lab's node namespace) feeds the real agent, whose datapath serves real traffic
//! from a pod; watch events change what is served.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    time::{Duration, Instant},
};

use proxy_tests::{
    apiserver::ApiServer,
    lab::{client, Lab, LabOptions, TCP_PORT},
    require_kernel,
};
use serde_json::{json, Value};

const WEB: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);
const API_PORT: u16 = 18080;

fn service(name: &str, ip: Ipv4Addr) -> Value {
    json!({"kind": "Service", "apiVersion": "v1",
           "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"), "resourceVersion": "2"},
           "spec": {"type": "ClusterIP", "clusterIP": ip.to_string(), "clusterIPs": [ip.to_string()],
                    "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": TCP_PORT}]}})
}

fn slice(name: &str, svc: &str, ips: &[Ipv4Addr]) -> Value {
    let endpoints: Vec<Value> = ips
        .iter()
        .map(|ip| json!({"addresses": [ip.to_string()], "conditions": {"ready": true}, "nodeName": "node-a"}))
        .collect();
    json!({"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
           "metadata": {"name": name, "namespace": "shop", "resourceVersion": "2",
                        "labels": {"kubernetes.io/service-name": svc}},
           "addressType": "IPv4", "endpoints": endpoints,
           "ports": [{"name": "http", "protocol": "TCP", "port": TCP_PORT}]})
}

fn spread(lab: &Lab, n: usize) -> BTreeMap<String, usize> {
    let results = lab
        .client
        .ns
        .run(move || {
            (0..n)
                .map(|_| client::tcp_hello(WEB, Duration::from_secs(2)))
                .collect::<Vec<_>>()
        })
        .unwrap();
    let mut counts = BTreeMap::new();
    for r in results {
        *counts
            .entry(r.expect("connection through the ClusterIP"))
            .or_insert(0) += 1;
    }
    counts
}

#[test]
fn the_agent_serves_what_the_api_server_says_and_follows_its_watch() {
    require_kernel!();
    let mut lab = Lab::new(LabOptions::default()).expect("lab");
    let api = ApiServer::new();
    let ips: Vec<Ipv4Addr> = lab.backends.iter().map(|p| p.ip).collect();
    api.change("services", "ADDED", service("web", *WEB.ip()));
    api.change("endpointslices", "ADDED", slice("web-1", "web", &ips));
    api.change(
        "nodes",
        "ADDED",
        json!({"kind": "Node", "apiVersion": "v1", "metadata": {"name": "node-a"}}),
    );
    // A Service of another proxy: never served.
    let mut foreign = service("other", Ipv4Addr::new(10, 96, 0, 77));
    foreign["metadata"]["labels"] = json!({"service.kubernetes.io/service-proxy-name": "other"});
    api.change("services", "ADDED", foreign);
    // A tenant's Service claiming web's cluster IP as an external IP: it does not get it,
    // and is told so with an Event on it.
    let mut evil = service("evil", Ipv4Addr::new(10, 96, 0, 78));
    evil["spec"]["externalIPs"] = json!([WEB.ip().to_string()]);
    api.change("services", "ADDED", evil);
    api.start(&lab.node, API_PORT)
        .expect("the replayed API server");
    let kubeconfig = ApiServer::kubeconfig(lab.dir.path(), API_PORT).unwrap();
    let kc = kubeconfig.to_str().unwrap().to_string();
    lab.start_agent_from(
        None,
        &["--kubeconfig", &kc, "--hostname-override", "node-a"],
    )
    .unwrap();
    let log = lab.agent().unwrap().log_text();
    assert!(log.contains("watching the API server"), "{log}");

    let counts = spread(&lab, 60);
    assert_eq!(counts.len(), 3, "{counts:?}");
    // The agent announces itself on its Node, as kube-proxy does.
    let event = api
        .wait_for_event("Starting", Duration::from_secs(5))
        .unwrap();
    assert_eq!(event["regarding"]["kind"], "Node");
    assert_eq!(event["regarding"]["name"], "node-a");
    assert_eq!(event["note"], "Using ebpf Proxier");
    assert_eq!(event["reportingController"], "proxy-agent");
    let conflict = api
        .wait_for_event("FrontendConflict", Duration::from_secs(5))
        .unwrap();
    assert_eq!(conflict["regarding"]["kind"], "Service");
    assert_eq!(conflict["regarding"]["namespace"], "shop");
    assert_eq!(conflict["regarding"]["name"], "evil");
    assert_eq!(conflict["type"], "Warning");
    assert!(
        conflict["note"]
            .as_str()
            .is_some_and(|n| n.contains("spec.externalIPs[0]")),
        "{conflict}"
    );

    // Wait for the three watches, then change an EndpointSlice through the watch.
    api.wait_for_watchers(3, Duration::from_secs(10))
        .expect("the agent watches all three resources");
    api.change(
        "endpointslices",
        "MODIFIED",
        slice("web-1", "web", &ips[..1]),
    );
    std::thread::sleep(Duration::from_secs(1));
    let counts = spread(&lab, 30);
    assert_eq!(
        counts.keys().collect::<Vec<_>>(),
        vec![&lab.backends[0].name],
        "{counts:?}"
    );

    // The Service is deleted: its ClusterIP is no longer translated.
    api.change("services", "DELETED", service("web", *WEB.ip()));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let answered = lab
            .client
            .ns
            .run(|| client::tcp_hello(WEB, Duration::from_millis(300)).is_ok())
            .unwrap();
        if !answered {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the deleted Service is still served"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = lab.agent().unwrap().log_text();
    assert!(
        !log.contains("10.96.0.77"),
        "the foreign Service was programmed: {log}"
    );
    // Seen at every sync, the conflict was posted once.
    let conflicts = api
        .events()
        .into_iter()
        .filter(|e| e["reason"] == "FrontendConflict")
        .count();
    assert_eq!(conflicts, 1, "{:?}", api.events());
}
