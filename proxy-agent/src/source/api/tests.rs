//! The API source against kube's client over a mocked HTTP service that replays API-server
//! JSON (lists, watch streams, errors), routed by request path.

use std::{
    collections::{HashMap, VecDeque},
    time::Duration,
};

use http::{Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{json, Value};
use tower_test::mock;

use super::*;
use crate::{
    model::{DesiredState, NodeContext, Protocol, ServicePortName},
    source::View,
};

const SERVICES: &str = "/api/v1/services";
const SLICES: &str = "/apis/discovery.k8s.io/v1/endpointslices";
const NODES: &str = "/api/v1/nodes";

fn service(name: &str, ip: Option<&str>, kind: &str, labels: Value) -> Value {
    let mut spec = json!({
        "type": kind,
        "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}],
        "sessionAffinity": "None",
        "ipFamilies": ["IPv4"],
        "ipFamilyPolicy": "SingleStack",
        "internalTrafficPolicy": "Cluster"
    });
    match ip {
        Some(ip) => {
            spec["clusterIP"] = json!(ip);
            spec["clusterIPs"] = json!([ip]);
        }
        None => spec["externalName"] = json!("example.com"),
    }
    json!({
        "kind": "Service", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"),
                     "resourceVersion": "1", "creationTimestamp": "2026-11-29T10:00:00Z",
                     "labels": labels},
        "spec": spec,
        "status": {"loadBalancer": {}}
    })
}

fn slice(name: &str, svc: &str, ips: &[&str]) -> Value {
    let endpoints: Vec<Value> = ips
        .iter()
        .map(|ip| json!({"addresses": [ip], "conditions": {"ready": true, "serving": true, "terminating": false},
                          "nodeName": "node-a", "zone": "z1",
                          "targetRef": {"kind": "Pod", "namespace": "shop", "name": format!("pod-{ip}")}}))
        .collect();
    json!({
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"),
                     "resourceVersion": "1", "generation": 1,
                     "labels": {"kubernetes.io/service-name": svc,
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}]
    })
}

fn list(kind: &str, rv: &str, items: Vec<Value>) -> Reply {
    Reply::Json(
        StatusCode::OK,
        json!({"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": rv}, "items": items}),
    )
}

fn event(kind: &str, object: Value) -> Value {
    json!({"type": kind, "object": object})
}

enum Reply {
    Json(StatusCode, Value),
    Events(Vec<Value>),
    /// Sent after a pause: orders events across the three watches.
    After(Duration, Box<Reply>),
}

impl Reply {
    fn into_response(self) -> Response<Body> {
        let (status, bytes) = match self {
            Reply::Json(status, v) => (status, serde_json::to_vec(&v).unwrap()),
            Reply::After(..) => unreachable!("sent by the server loop"),
            Reply::Events(events) => {
                let mut b = Vec::new();
                for e in events {
                    b.extend(serde_json::to_vec(&e).unwrap());
                    b.push(b'\n');
                }
                (StatusCode::OK, b)
            }
        };
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Body::from(bytes))
            .unwrap()
    }
}

/// Replies, in order, per (path, is-watch). A request with nothing scripted is left pending,
/// as a quiet watch is.
#[derive(Default)]
struct Script(HashMap<(&'static str, bool), VecDeque<Reply>>);

impl Script {
    fn on(mut self, path: &'static str, watch: bool, reply: Reply) -> Self {
        self.0.entry((path, watch)).or_default().push_back(reply);
        self
    }
}

fn serve(mut script: Script) -> Client {
    let (svc, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        let mut parked = Vec::new();
        while let Some((request, send)) = handle.next_request().await {
            let path = request.uri().path().to_string();
            let watch = request.uri().query().unwrap_or("").contains("watch=true");
            let key = [SERVICES, SLICES, NODES]
                .into_iter()
                .find(|p| *p == path)
                .unwrap_or_else(|| panic!("unexpected request {}", request.uri()));
            match script
                .0
                .get_mut(&(key, watch))
                .and_then(VecDeque::pop_front)
            {
                Some(Reply::After(pause, reply)) => {
                    tokio::spawn(async move {
                        tokio::time::sleep(pause).await;
                        send.send_response(reply.into_response());
                    });
                }
                Some(reply) => send.send_response(reply.into_response()),
                None => parked.push(send),
            }
        }
    });
    Client::new(svc, "default")
}

fn port(name: &str) -> ServicePortName {
    ServicePortName {
        service: ObjectName {
            namespace: "shop".into(),
            name: name.into(),
        },
        port: "http".into(),
        protocol: Protocol::Tcp,
        family: crate::model::IpFamily::V4,
    }
}

fn backends(state: &DesiredState, name: &str) -> Option<Vec<std::net::SocketAddr>> {
    state.ports.get(&port(name)).map(|s| s.backends.clone())
}

#[tokio::test]
async fn relists_skips_foreign_services_and_recovers_from_watch_errors() {
    let foreign = json!({"service.kubernetes.io/service-proxy-name": "other-proxy"});
    let script = Script::default()
        .on(
            SERVICES,
            false,
            list(
                "ServiceList",
                "100",
                vec![
                    service("web", Some("10.96.0.10"), "ClusterIP", json!({})),
                    service("gone", Some("10.96.0.11"), "ClusterIP", json!({})),
                    service("retyped", Some("10.96.0.14"), "ClusterIP", json!({})),
                    service("foreign", Some("10.96.0.13"), "ClusterIP", foreign),
                ],
            ),
        )
        // After the slices' retry, so the first complete state still has `gone`.
        .on(
            SERVICES,
            true,
            Reply::After(Duration::from_secs(3), Box::new(Reply::Events(vec![
                // Its EndpointSlice was listed before it existed.
                event("ADDED", service("late", Some("10.96.0.12"), "ClusterIP", json!({}))),
                event("MODIFIED", service("retyped", None, "ExternalName", json!({}))),
                // The watch falls too far behind: the watcher must relist.
                event(
                    "ERROR",
                    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": "too old resource version: 100 (150)", "reason": "Expired", "code": 410}),
                ),
            ]))),
        )
        // The relist: `gone` was deleted while the watch was down.
        .on(
            SERVICES,
            false,
            list(
                "ServiceList",
                "200",
                vec![
                    service("web", Some("10.96.0.10"), "ClusterIP", json!({})),
                    service("retyped", None, "ExternalName", json!({})),
                    service("late", Some("10.96.0.12"), "ClusterIP", json!({})),
                ],
            ),
        )
        // The first slice list fails; the watcher backs off and tries again.
        .on(
            SLICES,
            false,
            Reply::Json(
                StatusCode::INTERNAL_SERVER_ERROR,
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": "etcdserver: request timed out", "code": 500}),
            ),
        )
        .on(
            SLICES,
            false,
            list(
                "EndpointSliceList",
                "150",
                vec![
                    slice("web-abc", "web", &["10.244.1.1", "10.244.1.2"]),
                    slice("late-xyz", "late", &["10.244.2.1"]),
                ],
            ),
        )
        .on(
            NODES,
            false,
            list(
                "NodeList",
                "1",
                vec![json!({"kind": "Node", "apiVersion": "v1",
                            "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "z1"}},
                            "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.5"},
                                                     {"type": "Hostname", "address": "node-a"}]}})],
            ),
        );

    let (tx, mut rx) = mpsc::channel(16);
    tokio::spawn(run(serve(script), "node-a".into(), tx));

    let mut saw_gone = false;
    let mut saw_foreign = false;
    let mut view = View::default();
    let done = tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(update) = rx.recv().await {
            view.apply(update);
            let (state, _) = DesiredState::build(&view.store, &NodeContext::default());
            saw_gone |= state.ports.contains_key(&port("gone"));
            saw_foreign |= state.ports.contains_key(&port("foreign"));
            let web = backends(&state, "web");
            let late = backends(&state, "late");
            if web.is_some_and(|b| b.len() == 2)
                && late.is_some_and(|b| b.len() == 1)
                && !state.ports.contains_key(&port("gone"))
                && !state.ports.contains_key(&port("retyped"))
            {
                assert_eq!(view.nodes.len(), 1);
                let node = view.node("node-a").unwrap();
                assert_eq!(node.name, "node-a");
                assert_eq!(node.zone.as_deref(), Some("z1"));
                assert_eq!(
                    node.addresses,
                    vec![("InternalIP".to_string(), "10.0.0.5".parse().unwrap())]
                );
                return state;
            }
        }
        panic!("the source stopped");
    })
    .await
    .expect("the desired state was never reached");
    assert!(saw_gone, "`gone` was served before the relist dropped it");
    assert!(!saw_foreign, "a Service of another proxy was served");
    assert_eq!(
        done.ports.len(),
        2,
        "{:?}",
        done.ports.keys().collect::<Vec<_>>()
    );
    assert_eq!(
        backends(&done, "web").unwrap(),
        vec![
            "10.244.1.1:8080".parse().unwrap(),
            "10.244.1.2:8080".parse().unwrap()
        ]
    );
}

#[tokio::test]
async fn invalid_objects_are_reported_and_the_rest_served() {
    let mut bad = service("bad", Some("10.96.0.300"), "ClusterIP", json!({}));
    bad["metadata"]["resourceVersion"] = json!("2");
    let script = Script::default()
        .on(
            SERVICES,
            false,
            list(
                "ServiceList",
                "1",
                vec![
                    service("web", Some("10.96.0.10"), "ClusterIP", json!({})),
                    bad,
                ],
            ),
        )
        .on(
            SLICES,
            false,
            list(
                "EndpointSliceList",
                "1",
                vec![slice("web-abc", "web", &["10.244.1.1"])],
            ),
        )
        .on(NODES, false, list("NodeList", "1", vec![]));
    let (tx, mut rx) = mpsc::channel(16);
    tokio::spawn(run(serve(script), "node-a".into(), tx));
    // The first update is the whole first list, problems included.
    let first = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap()
        .unwrap();
    let mut view = View::default();
    view.apply(first);
    let (state, _) = DesiredState::build(&view.store, &NodeContext::default());
    assert_eq!(backends(&state, "web").unwrap().len(), 1);
    assert_eq!(view.problems.len(), 1);
    let p = view.problems[0].to_string();
    assert!(
        p.contains("api-server: Service shop/bad: spec.clusterIP"),
        "{p}"
    );
}

/// A watch event sends only its own object: the sync loop recomputes only what that touches,
/// however many objects the first list held; a problem fixed goes with the next update.
#[tokio::test]
async fn a_watch_event_sends_only_its_object() {
    let mut services: Vec<Value> = (0..50)
        .map(|i| {
            service(
                &format!("s{i}"),
                Some(&format!("10.96.1.{i}")),
                "ClusterIP",
                json!({}),
            )
        })
        .collect();
    services.push(service("bad", Some("10.96.0.300"), "ClusterIP", json!({})));
    let slices = (0..50)
        .map(|i| slice(&format!("s{i}-a"), &format!("s{i}"), &["10.244.1.1"]))
        .collect();
    let script = Script::default()
        .on(SERVICES, false, list("ServiceList", "1", services))
        .on(
            SERVICES,
            true,
            Reply::Events(vec![event(
                "MODIFIED",
                service("bad", Some("10.96.0.99"), "ClusterIP", json!({})),
            )]),
        )
        .on(SLICES, false, list("EndpointSliceList", "1", slices))
        .on(
            SLICES,
            true,
            Reply::Events(vec![event(
                "MODIFIED",
                slice("s7-a", "s7", &["10.244.1.1", "10.244.1.2"]),
            )]),
        )
        .on(NODES, false, list("NodeList", "1", vec![]));
    let (tx, mut rx) = mpsc::channel(16);
    tokio::spawn(run(serve(script), "node-a".into(), tx));
    let first = next(&mut rx).await;
    assert_eq!((first.services.len(), first.slices.len()), (50, 50));
    assert_eq!(first.problems.map(|p| p.len()), Some(1));
    let mut fixed = false;
    let mut scaled = false;
    while !(fixed && scaled) {
        let delta = next(&mut rx).await;
        let services: Vec<_> = delta.services.iter().map(|(n, _)| &n.name).collect();
        let slices: Vec<_> = delta.slices.iter().map(|(n, _)| &n.name).collect();
        match (services.as_slice(), slices.as_slice()) {
            ([s], []) if *s == "bad" => {
                assert_eq!(delta.problems, Some(vec![]), "the fixed Service's problem");
                fixed = true;
            }
            ([], [s]) if *s == "s7-a" => {
                assert_eq!(delta.problems, None, "no problem changed");
                scaled = true;
            }
            other => panic!("a delta of more than the event's object: {other:?}"),
        }
    }
}

async fn next(rx: &mut mpsc::Receiver<Update>) -> Delta {
    match tokio::time::timeout(Duration::from_secs(10), rx.recv()).await {
        Ok(Some(Update::Delta(d))) => d,
        other => panic!("expected a delta, got {other:?}"),
    }
}
