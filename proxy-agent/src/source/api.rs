//! The API-server source: watches Services, EndpointSlices and this node's Node with kube-rs
//! watchers and sends a complete, consistent snapshot after every change.
//!
//! A relist (`Init` … `InitDone`) is the full truth: objects deleted while the watch was
//! down disappear when it completes. Services that belong to another proxy
//! (`service.kubernetes.io/service-proxy-name`) and headless ones are skipped, as kube-proxy
//! does, both by label selector and again on arrival.

use std::collections::BTreeMap;

use futures::{stream, StreamExt};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    runtime::{
        watcher::{self, Event},
        WatchStreamExt,
    },
    Api, Client,
};
use tokio::sync::mpsc;
use tracing::warn;

use super::Snapshot;
use crate::model::{
    objects::{display_name, NodeInfo, Validated},
    ObjectName, ObjectStore, Origin, Problem, ProblemKind, ServiceInfo, SliceInfo,
};

pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";

/// Objects of one kind as the watcher reported them; `relist` buffers an `Init` until its
/// `InitDone`.
struct Kind<T> {
    live: BTreeMap<ObjectName, T>,
    relist: Option<BTreeMap<ObjectName, T>>,
}

impl<T> Default for Kind<T> {
    fn default() -> Self {
        Self {
            live: BTreeMap::new(),
            relist: None,
        }
    }
}

/// What to do with one object.
pub(crate) enum Conversion<T> {
    Keep(ObjectName, T),
    /// Not for this proxy (another proxy's, headless ...): as if it did not exist.
    Skip(ObjectName),
    Invalid(ObjectName, Problem),
}

impl<T> Conversion<T> {
    /// The object, if it is kept.
    pub(crate) fn kept(self) -> Option<(ObjectName, T)> {
        match self {
            Conversion::Keep(name, t) => Some((name, t)),
            _ => None,
        }
    }
}

impl<T> Kind<T> {
    /// Applies a watcher event; returns true when the state is consistent afterwards (not
    /// in the middle of a relist).
    fn apply<K>(
        &mut self,
        event: Event<K>,
        convert: impl Fn(&K) -> Conversion<T>,
        problems: &mut BTreeMap<ObjectName, Problem>,
    ) -> bool {
        let mut put = |map: &mut BTreeMap<ObjectName, T>, obj: &K| match convert(obj) {
            Conversion::Keep(name, t) => {
                problems.remove(&name);
                map.insert(name, t);
            }
            Conversion::Skip(name) => {
                problems.remove(&name);
                map.remove(&name);
            }
            Conversion::Invalid(name, p) => {
                map.remove(&name);
                problems.insert(name, p);
            }
        };
        match event {
            Event::Apply(obj) => {
                put(&mut self.live, &obj);
                true
            }
            Event::Delete(obj) => {
                let name = match convert(&obj) {
                    Conversion::Keep(n, _) | Conversion::Skip(n) | Conversion::Invalid(n, _) => n,
                };
                problems.remove(&name);
                self.live.remove(&name);
                true
            }
            Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            Event::InitApply(obj) => {
                let map = self.relist.get_or_insert_with(BTreeMap::new);
                put(map, &obj);
                false
            }
            Event::InitDone => {
                if let Some(fresh) = self.relist.take() {
                    self.live = fresh;
                }
                true
            }
        }
    }
}

fn name_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> ObjectName {
    ObjectName {
        namespace: meta.namespace.clone().unwrap_or_else(|| "default".into()),
        name: meta.name.clone().unwrap_or_default(),
    }
}

fn origin() -> Origin {
    "api-server".into()
}

/// Validates an object, unless one of `skip_labels` says it is not for this proxy.
fn convert<T: Validated>(obj: &T::Api, skip_labels: &[&str]) -> Conversion<(T, Origin)> {
    let meta = T::meta(obj);
    let name = name_of(meta);
    if meta
        .labels
        .as_ref()
        .is_some_and(|l| skip_labels.iter().any(|s| l.contains_key(*s)))
    {
        return Conversion::Skip(name);
    }
    match T::validate(obj) {
        Ok(info) => Conversion::Keep(name, (info, origin())),
        Err(e) => Conversion::Invalid(
            name,
            Problem {
                origin: origin(),
                object: format!("{} {}", T::KIND, display_name(meta)),
                message: format!("{e}; skipped"),
                kind: ProblemKind::Invalid,
            },
        ),
    }
}

pub(crate) fn convert_service(svc: &Service) -> Conversion<(ServiceInfo, Origin)> {
    convert(svc, &[SERVICE_PROXY_NAME_LABEL, HEADLESS_LABEL])
}

pub(crate) fn convert_slice(slice: &EndpointSlice) -> Conversion<(SliceInfo, Origin)> {
    convert(slice, &[HEADLESS_LABEL])
}

enum Update {
    Service(Box<Event<Service>>),
    Slice(Box<Event<EndpointSlice>>),
    Node(Box<Event<Node>>),
}

/// Watches the API server through `client` and sends a snapshot after every consistent
/// change, until `tx` is closed. Watch errors are logged and retried with backoff.
pub async fn run(client: Client, node_name: String, tx: mpsc::Sender<Snapshot>) {
    let services = watcher::watcher(
        Api::<Service>::all(client.clone()),
        watcher::Config::default()
            .labels(&format!("!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}")),
    )
    .default_backoff()
    .map(|r| r.map(|e| Update::Service(Box::new(e))));
    let slices = watcher::watcher(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default().labels(&format!("!{HEADLESS_LABEL}")),
    )
    .default_backoff()
    .map(|r| r.map(|e| Update::Slice(Box::new(e))));
    let nodes = watcher::watcher(
        Api::<Node>::all(client),
        watcher::Config::default().fields(&format!("metadata.name={node_name}")),
    )
    .default_backoff()
    .map(|r| r.map(|e| Update::Node(Box::new(e))));
    let mut updates = stream::select_all([services.boxed(), slices.boxed(), nodes.boxed()]);

    let mut svc: Kind<(ServiceInfo, Origin)> = Kind::default();
    let mut sl: Kind<(SliceInfo, Origin)> = Kind::default();
    let mut node: Kind<NodeInfo> = Kind::default();
    let mut problems = BTreeMap::new();
    let mut node_problems = BTreeMap::new();
    while let Some(update) = updates.next().await {
        let consistent = match update {
            Ok(Update::Service(e)) => svc.apply(*e, convert_service, &mut problems),
            Ok(Update::Slice(e)) => sl.apply(*e, convert_slice, &mut problems),
            Ok(Update::Node(e)) => node.apply(
                *e,
                |n: &Node| Conversion::Keep(name_of(&n.metadata), NodeInfo::from_api(n)),
                &mut node_problems,
            ),
            Err(e) => {
                warn!("API watch: {e}; retrying with backoff");
                false
            }
        };
        if !consistent || svc.relist.is_some() || sl.relist.is_some() {
            continue;
        }
        let snapshot = Snapshot {
            store: ObjectStore {
                services: svc.live.clone(),
                slices: sl.live.clone(),
            },
            problems: problems.values().cloned().collect(),
            nodes: node.live.values().cloned().collect(),
        };
        if tx.send(snapshot).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests;

/// A client for the API server: from --kubeconfig (or clientConnection.kubeconfig), else
/// in-cluster configuration, else $KUBECONFIG / ~/.kube/config.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<Client> {
    use anyhow::Context;
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context(
            "no API server: not in a cluster and no kubeconfig (pass --kubeconfig, or --manifests PATH to run without a cluster)",
        )?,
    };
    Client::try_from(config).context("creating the API client")
}

/// Records a `Starting` event on this node's Node object, as kube-proxy does; best effort.
pub async fn announce_start(client: Client, node: String, mode: &'static str) {
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "proxy-agent".into(),
            instance: Some(node.clone()),
        },
    );
    let regarding = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.clone()),
        uid: Some(node.clone()),
        ..Default::default()
    };
    let event = Event {
        type_: EventType::Normal,
        reason: "Starting".into(),
        note: Some(format!("Using {mode} Proxier")),
        action: "StartProxyAgent".into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, &regarding).await {
        warn!(%node, "recording the Starting event: {e}");
    }
}
