//! Kubernetes Events on the Services whose problems the model found (a frontend another
//! Service owns, an external IP outside `--external-ip-cidrs`): the tenant who wrote the
//! Service sees why part of it is not served, with `kubectl describe service`.
//!
//! Every node decides the same conflicts, so without care a thousand nodes would post a
//! thousand Events for one. Two rules keep it to about one:
//! * **Who posts**: only the two nodes that rank first for the Event under rendezvous
//!   hashing among the nodes the EndpointSlices name (every agent sees the same slices, so
//!   every agent agrees on them without talking); a node that hosts no endpoint posts only
//!   when no node does.
//! * **One object per problem**: the Event's name is derived from the problem (Service,
//!   reason, message), so a second poster's create fails with 409 and nothing is added.
//!
//! A problem of one node alone (a map of its own full: `NotProgrammed`) is posted by that
//! node, with its name in the Event's name and note.
//!
//! Each agent also posts a problem once per run and at most [`MAX_PER_MINUTE`] Events a
//! minute (the rest are counted in the log only: the metric and the log already carry every
//! problem). Best effort: a failed post is logged at debug level, never retried in a loop.

use std::{
    collections::{BTreeSet, HashSet},
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{core::v1::ObjectReference, events::v1::Event},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{
    api::{Api, PostParams},
    Client,
};
use tokio::sync::mpsc;
use tracing::debug;

use crate::model::ObjectName;

/// Events one agent posts a minute at most.
pub const MAX_PER_MINUTE: usize = 10;
/// How many nodes post each Event (two: one may be down).
const POSTERS: usize = 2;

/// A problem to show on a Service.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Notice {
    pub service: ObjectName,
    /// `FrontendConflict`, `ExternalIPRefused`, `NotProgrammed`.
    pub reason: &'static str,
    pub note: String,
    /// The node where it is true, for a problem of this node alone (a map of its own is
    /// full): that node posts it, under a name of its own. `None`: every node finds it.
    pub node: Option<String>,
}

impl Notice {
    /// The Event's name: the same on every node for the same problem.
    pub fn event_name(&self) -> String {
        let hash = stable_hash(&[
            &self.service.namespace,
            &self.service.name,
            self.reason,
            &self.note,
            self.node.as_deref().unwrap_or(""),
        ]);
        // At most 253 characters: the Service's name (≤ 253 minus the suffix) and a hash.
        let prefix: String = self.service.name.chars().take(200).collect();
        format!("{prefix}.proxy-agent.{hash:016x}")
    }
}

/// FNV-1a over the parts (each ended by a 0 byte): the same on every node and in every
/// build, which std's hasher does not promise across Rust versions (agents of two versions
/// run side by side during a rolling update).
fn stable_hash(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.bytes().chain([0]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Whether `node` is one of the nodes that post `event` (see the module doc): the
/// [`POSTERS`] first of `nodes` by rendezvous hash; when no node hosts an endpoint, every
/// node does (there are then few of them, or nothing is served anyway).
pub fn posts(node: &str, nodes: &BTreeSet<String>, event: &str) -> bool {
    if nodes.is_empty() {
        return true;
    }
    if !nodes.contains(node) {
        return false;
    }
    let rank = |n: &str| stable_hash(&[n, event]);
    let mine = rank(node);
    nodes.iter().filter(|n| rank(n) < mine).count() < POSTERS
}

/// Where the sync loop hands its notices; the posting happens on a task of its own.
#[derive(Clone)]
pub struct ServiceEvents {
    tx: mpsc::Sender<(Vec<Notice>, BTreeSet<String>)>,
}

impl ServiceEvents {
    /// Starts the poster for `node`.
    pub fn start(client: Client, node: String) -> Self {
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(post_loop(client, node, rx));
        Self { tx }
    }

    /// Queues `notices` (problems of this build), with the nodes the EndpointSlices name
    /// (only cluster-wide notices need them); dropped when the queue is full, as the log
    /// and the metrics already carry them.
    pub fn notice(&self, notices: Vec<Notice>, nodes: BTreeSet<String>) {
        if !notices.is_empty() {
            let _ = self.tx.try_send((notices, nodes));
        }
    }
}

async fn post_loop(
    client: Client,
    node: String,
    mut rx: mpsc::Receiver<(Vec<Notice>, BTreeSet<String>)>,
) {
    let mut done: HashSet<String> = HashSet::new();
    let mut recent: Vec<Instant> = Vec::new();
    while let Some((notices, nodes)) = rx.recv().await {
        for notice in notices {
            let name = notice.event_name();
            let ours = match &notice.node {
                Some(n) => *n == node,
                None => posts(&node, &nodes, &name),
            };
            if done.contains(&name) || !ours {
                continue;
            }
            recent.retain(|t| t.elapsed() < Duration::from_secs(60));
            if recent.len() >= MAX_PER_MINUTE {
                debug!(service = %notice.service, reason = notice.reason, "Event not posted: {MAX_PER_MINUTE} a minute at most");
                continue;
            }
            recent.push(Instant::now());
            done.insert(name.clone());
            let api: Api<Event> = Api::namespaced(client.clone(), &notice.service.namespace);
            match api
                .create(&PostParams::default(), &event(&notice, &name, &node))
                .await
            {
                Ok(_) => debug!(service = %notice.service, reason = notice.reason, "Event posted"),
                // Another node posted it first: that is the point.
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => debug!(service = %notice.service, "posting an Event: {e}"),
            }
        }
    }
}

fn event(notice: &Notice, name: &str, node: &str) -> Event {
    Event {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(notice.service.namespace.clone()),
            ..Default::default()
        },
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        action: Some("ProgramService".into()),
        reason: Some(notice.reason.into()),
        note: Some(
            match &notice.node {
                Some(n) => format!("on node {n}: {}", notice.note),
                None => notice.note.clone(),
            }
            .chars()
            .take(1024)
            .collect(),
        ),
        type_: Some("Warning".into()),
        regarding: Some(ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some(notice.service.namespace.clone()),
            name: Some(notice.service.name.clone()),
            ..Default::default()
        }),
        reporting_controller: Some("proxy-agent".into()),
        reporting_instance: Some(format!("proxy-agent-{node}")),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use http::{Request, Response};
    use kube::client::Body;
    use tower_test::mock;

    use super::*;

    fn notice(name: &str) -> Notice {
        Notice {
            service: ObjectName {
                namespace: "shop".into(),
                name: name.into(),
            },
            reason: "FrontendConflict",
            note: "port 53: spec.externalIPs[0]: 10.96.0.10:53/UDP is kube-system/kube-dns's cluster IP".into(),
            node: None,
        }
    }

    #[test]
    fn about_two_of_a_thousand_nodes_post_each_event_and_all_agree_which() {
        let nodes: BTreeSet<String> = (0..1000).map(|i| format!("node-{i}")).collect();
        for event in ["a", "b", "c"] {
            let posters: Vec<&String> = nodes.iter().filter(|n| posts(n, &nodes, event)).collect();
            assert_eq!(posters.len(), POSTERS, "{event}: {posters:?}");
        }
        // A node that hosts no endpoint leaves it to those that do.
        assert!(!posts("node-without-pods", &nodes, "a"));
        // With no endpoint anywhere, a node posts by itself.
        assert!(posts("node-0", &BTreeSet::new(), "a"));
        // The same problem gets the same name on every node; another, another name.
        assert_eq!(notice("evil").event_name(), notice("evil").event_name());
        assert_ne!(notice("evil").event_name(), notice("other").event_name());
    }

    #[tokio::test]
    async fn a_problem_is_posted_once_and_a_conflict_with_another_poster_is_fine() {
        let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let events = ServiceEvents::start(client, "node-a".into());
        let nodes: BTreeSet<String> = ["node-a".to_string()].into();
        events.notice(vec![notice("evil"), notice("evil")], nodes.clone());
        let (request, reply) = handle.next_request().await.expect("one POST");
        assert_eq!(request.method(), http::Method::POST);
        assert_eq!(
            request.uri().path(),
            "/apis/events.k8s.io/v1/namespaces/shop/events"
        );
        let body = request.into_body().collect_bytes().await.unwrap();
        let posted: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(posted["metadata"]["name"], notice("evil").event_name());
        assert_eq!(posted["reason"], "FrontendConflict");
        assert_eq!(posted["type"], "Warning");
        assert_eq!(posted["regarding"]["kind"], "Service");
        assert_eq!(posted["regarding"]["name"], "evil");
        assert!(posted["note"]
            .as_str()
            .unwrap()
            .contains("spec.externalIPs[0]"));
        // Another node was first: 409, and nothing more is sent.
        let conflict = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "AlreadyExists", "code": 409, "message": "already exists"});
        reply.send_response(
            Response::builder()
                .status(409)
                .body(Body::from(serde_json::to_vec(&conflict).unwrap()))
                .unwrap(),
        );
        events.notice(vec![notice("evil")], nodes);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), handle.next_request())
                .await
                .is_err(),
            "the same problem was posted again"
        );
    }
}
