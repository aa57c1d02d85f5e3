//! The agent in API-server mode, end to end: a replayed API server (list + watch over HTTP,
//! inside the lab's node namespace) feeds the real agent, whose datapath serves real traffic
//! from a pod; watch events change what is served.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    net::{Ipv4Addr, SocketAddrV4},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{
    body::{Body, Bytes},
    extract::{RawQuery, State},
    routing::get,
    Router,
};
use proxy_tests::{
    lab::{client, Lab, LabOptions, TCP_PORT},
    require_kernel,
};
use serde_json::{json, Value};
use tokio::sync::broadcast;

const WEB: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);
const API_PORT: u16 = 18080;

/// One resource's objects and its watchers.
struct Resource {
    list_kind: &'static str,
    items: BTreeMap<String, Value>,
    events: broadcast::Sender<Bytes>,
    watchers: usize,
}

#[derive(Clone)]
struct Api(
    Arc<Mutex<BTreeMap<&'static str, Resource>>>,
    Arc<Mutex<Vec<Value>>>,
);

impl Api {
    fn new() -> Self {
        let mut m = BTreeMap::new();
        for (path, kind) in [
            ("services", "ServiceList"),
            ("endpointslices", "EndpointSliceList"),
            ("nodes", "NodeList"),
        ] {
            m.insert(
                path,
                Resource {
                    list_kind: kind,
                    items: BTreeMap::new(),
                    events: broadcast::channel(64).0,
                    watchers: 0,
                },
            );
        }
        Api(Arc::new(Mutex::new(m)), Arc::default())
    }

    /// Events the agent recorded (POSTed to events.k8s.io).
    fn events(&self) -> Vec<Value> {
        self.1.lock().unwrap().clone()
    }

    /// The first Event with `reason` the agent records, waiting 5 s at most.
    fn wait_for_event(&self, reason: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(e) = self.events().into_iter().find(|e| e["reason"] == reason) {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "no {reason} event: {:?}",
                self.events()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    async fn record_event(self, body: Bytes) -> axum::response::Response {
        let event: Value = serde_json::from_slice(&body).unwrap();
        self.1.lock().unwrap().push(event.clone());
        axum::response::Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(&event).unwrap()))
            .unwrap()
    }

    /// Changes an object and tells the watchers (`ADDED`, `MODIFIED`, `DELETED`).
    fn change(&self, resource: &'static str, kind: &str, object: Value) {
        let mut m = self.0.lock().unwrap();
        let r = m.get_mut(resource).unwrap();
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        if kind == "DELETED" {
            r.items.remove(&name);
        } else {
            r.items.insert(name, object.clone());
        }
        let mut line = serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap();
        line.push(b'\n');
        let _ = r.events.send(Bytes::from(line));
    }

    fn watchers(&self) -> usize {
        self.0.lock().unwrap().values().map(|r| r.watchers).sum()
    }

    async fn serve(
        self,
        resource: &'static str,
        query: Option<String>,
    ) -> axum::response::Response {
        let watch = query.unwrap_or_default().contains("watch=true");
        let mut m = self.0.lock().unwrap();
        let r = m.get_mut(resource).unwrap();
        if !watch {
            let body = json!({"kind": r.list_kind, "apiVersion": "v1",
                              "metadata": {"resourceVersion": "1"},
                              "items": r.items.values().cloned().collect::<Vec<_>>()});
            return axum::response::Response::builder()
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(&body).unwrap()))
                .unwrap();
        }
        r.watchers += 1;
        let rx = r.events.subscribe();
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.ok().map(|b| (Ok::<_, Infallible>(b), rx))
        });
        axum::response::Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(stream))
            .unwrap()
    }
}

fn start_api(lab: &Lab, api: Api) {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    // A thread of its own inside the node namespace, with its own runtime.
    let _server = lab.node.spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let app = Router::new()
                .route(
                    "/api/v1/services",
                    get(|State(a): State<Api>, RawQuery(q): RawQuery| a.serve("services", q)),
                )
                .route(
                    "/apis/discovery.k8s.io/v1/endpointslices",
                    get(|State(a): State<Api>, RawQuery(q): RawQuery| a.serve("endpointslices", q)),
                )
                .route(
                    "/api/v1/nodes",
                    get(|State(a): State<Api>, RawQuery(q): RawQuery| a.serve("nodes", q)),
                )
                .route(
                    "/apis/events.k8s.io/v1/namespaces/default/events",
                    axum::routing::post(|State(a): State<Api>, body: Bytes| a.record_event(body)),
                )
                .route(
                    "/apis/events.k8s.io/v1/namespaces/shop/events",
                    axum::routing::post(|State(a): State<Api>, body: Bytes| a.record_event(body)),
                )
                .with_state(api);
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", API_PORT))
                .await
                .unwrap();
            ready_tx.send(()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    ready_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("mock API server");
}

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
    let api = Api::new();
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
    start_api(&lab, api.clone());

    let kubeconfig = lab.dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: lab, cluster: {{server: \"http://127.0.0.1:{API_PORT}\"}}}}]\nusers: [{{name: lab, user: {{}}}}]\ncontexts: [{{name: lab, context: {{cluster: lab, user: lab}}}}]\ncurrent-context: lab\n"
        ),
    )
    .unwrap();
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
    let event = api.wait_for_event("Starting");
    assert_eq!(event["regarding"]["kind"], "Node");
    assert_eq!(event["regarding"]["name"], "node-a");
    assert_eq!(event["note"], "Using ebpf Proxier");
    assert_eq!(event["reportingController"], "proxy-agent");
    let conflict = api.wait_for_event("FrontendConflict");
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
    let deadline = Instant::now() + Duration::from_secs(10);
    while api.watchers() < 3 {
        assert!(
            Instant::now() < deadline,
            "the agent never watched all three resources"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
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
