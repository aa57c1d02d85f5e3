//! The API-server source: watches Services, EndpointSlices and this node's Node with kube-rs
//! watchers and sends what each consistent change changed: a [`Delta`] of the event's object
//! (after a relist, of every object listed).
//!
//! A relist (`Init` … `InitDone`) is the full truth: objects deleted while the watch was
//! down disappear when it completes. Services that belong to another proxy
//! (`service.kubernetes.io/service-proxy-name`) and headless ones are skipped, as kube-proxy
//! does, both by label selector and again on arrival.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

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

use super::{Delta, Puts, Update};
use crate::model::{
    objects::{display_name, NodeInfo, Validated},
    ObjectName, Origin, Problem, ProblemKind, ServiceInfo, SliceInfo, Stored,
};

pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";

/// Objects of one kind as the watcher reported them: the names of those kept (the objects
/// themselves live once, in the sync loop's view), the changes not yet sent, and the
/// objects of a relist (`Init` … `InitDone`) until it completes.
struct Kind<T> {
    live: BTreeSet<ObjectName>,
    pending: Puts<T>,
    relist: Option<BTreeMap<ObjectName, T>>,
    /// A first list has completed.
    listed: bool,
}

impl<T> Default for Kind<T> {
    fn default() -> Self {
        Self {
            live: BTreeSet::new(),
            pending: Vec::new(),
            relist: None,
            listed: false,
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

    fn name(&self) -> &ObjectName {
        match self {
            Conversion::Keep(n, _) | Conversion::Skip(n) | Conversion::Invalid(n, _) => n,
        }
    }

    /// (name, the object if kept, the problem if invalid).
    fn into_parts(self) -> (ObjectName, Option<T>, Option<Problem>) {
        match self {
            Conversion::Keep(name, t) => (name, Some(t), None),
            Conversion::Skip(name) => (name, None, None),
            Conversion::Invalid(name, p) => (name, None, Some(p)),
        }
    }
}

/// The problems of invalid objects, by kind and name (a Service and an EndpointSlice may
/// share a name); `changed` until they are next sent.
#[derive(Default)]
struct Problems {
    by_object: BTreeMap<(&'static str, ObjectName), Problem>,
    changed: bool,
}

impl Problems {
    fn set(&mut self, kind: &'static str, name: &ObjectName, problem: Option<Problem>) {
        let key = (kind, name.clone());
        let changed = match problem {
            Some(p) => self.by_object.insert(key, p.clone()).as_ref() != Some(&p),
            None => self.by_object.remove(&key).is_some(),
        };
        self.changed |= changed;
    }

    fn clear(&mut self, kind: &'static str) {
        let before = self.by_object.len();
        self.by_object.retain(|(k, _), _| *k != kind);
        self.changed |= self.by_object.len() != before;
    }

    /// Every problem, if they changed since the last call.
    fn take_changed(&mut self) -> Option<Vec<Problem>> {
        std::mem::take(&mut self.changed).then(|| self.by_object.values().cloned().collect())
    }
}

impl<T> Kind<T> {
    /// Listed once and not being listed again.
    fn settled(&self) -> bool {
        self.listed && self.relist.is_none()
    }

    /// Applies a watcher event; returns true when the state is consistent afterwards (not
    /// in the middle of a relist).
    fn apply<K>(
        &mut self,
        kind: &'static str,
        event: Event<K>,
        convert: impl Fn(&K) -> Conversion<T>,
        problems: &mut Problems,
    ) -> bool {
        match event {
            Event::Apply(obj) => {
                let (name, object, problem) = convert(&obj).into_parts();
                problems.set(kind, &name, problem);
                match object {
                    Some(_) => self.live.insert(name.clone()),
                    None => self.live.remove(&name),
                };
                self.pending.push((name, object));
                true
            }
            Event::Delete(obj) => {
                let name = convert(&obj).name().clone();
                problems.set(kind, &name, None);
                self.live.remove(&name);
                self.pending.push((name, None));
                true
            }
            Event::Init => {
                // The relist reports every invalid object again.
                problems.clear(kind);
                self.relist = Some(BTreeMap::new());
                false
            }
            Event::InitApply(obj) => {
                let map = self.relist.get_or_insert_with(BTreeMap::new);
                let (name, object, problem) = convert(&obj).into_parts();
                problems.set(kind, &name, problem);
                match object {
                    Some(t) => map.insert(name, t),
                    None => map.remove(&name),
                };
                false
            }
            Event::InitDone => {
                self.listed = true;
                if let Some(fresh) = self.relist.take() {
                    // Objects deleted while the watch was down go, with their problems.
                    for gone in self.live.iter().filter(|n| !fresh.contains_key(*n)) {
                        self.pending.push((gone.clone(), None));
                    }
                    self.live = fresh.keys().cloned().collect();
                    self.pending
                        .extend(fresh.into_iter().map(|(name, t)| (name, Some(t))));
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
fn convert<T: Validated>(obj: &T::Api, skip_labels: &[&str]) -> Conversion<Stored<T>> {
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
        Ok(info) => Conversion::Keep(name, (Arc::new(info), origin())),
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

pub(crate) fn convert_service(svc: &Service) -> Conversion<Stored<ServiceInfo>> {
    convert(svc, &[SERVICE_PROXY_NAME_LABEL, HEADLESS_LABEL])
}

pub(crate) fn convert_slice(slice: &EndpointSlice) -> Conversion<Stored<SliceInfo>> {
    convert(slice, &[HEADLESS_LABEL])
}

enum Change {
    Service(Box<Event<Service>>),
    Slice(Box<Event<EndpointSlice>>),
    Node(Box<Event<Node>>),
}

/// Watches the API server through `client` and sends what changed after every consistent
/// change (a delta naming the objects of the event; after a relist, every object listed),
/// until `tx` is closed. Watch errors are logged and retried with backoff.
pub async fn run(client: Client, node_name: String, tx: mpsc::Sender<Update>) {
    let services = watcher::watcher(
        Api::<Service>::all(client.clone()),
        watcher::Config::default()
            .labels(&format!("!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}")),
    )
    .default_backoff()
    .map(|r| r.map(|e| Change::Service(Box::new(e))));
    let slices = watcher::watcher(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default().labels(&format!("!{HEADLESS_LABEL}")),
    )
    .default_backoff()
    .map(|r| r.map(|e| Change::Slice(Box::new(e))));
    let nodes = watcher::watcher(
        Api::<Node>::all(client),
        watcher::Config::default().fields(&format!("metadata.name={node_name}")),
    )
    .default_backoff()
    .map(|r| r.map(|e| Change::Node(Box::new(e))));
    let mut updates = stream::select_all([services.boxed(), slices.boxed(), nodes.boxed()]);

    let mut svc: Kind<Stored<ServiceInfo>> = Kind::default();
    let mut sl: Kind<Stored<SliceInfo>> = Kind::default();
    let mut node: Kind<NodeInfo> = Kind::default();
    let mut problems = Problems::default();
    let mut first = true;
    while let Some(update) = updates.next().await {
        let consistent = match update {
            Ok(Change::Service(e)) => svc.apply("Service", *e, convert_service, &mut problems),
            Ok(Change::Slice(e)) => sl.apply("EndpointSlice", *e, convert_slice, &mut problems),
            Ok(Change::Node(e)) => node.apply(
                "Node",
                *e,
                |n: &Node| Conversion::Keep(name_of(&n.metadata), NodeInfo::from_api(n)),
                &mut problems,
            ),
            Err(e) => {
                warn!("API watch: {e}; retrying with backoff");
                false
            }
        };
        // Nothing goes out before Services and EndpointSlices have been listed once
        // (kube-proxy waits for those informers to sync likewise), nor while a kind is being
        // listed again. The Node is not waited for: a Node watch that keeps failing (RBAC)
        // must not keep every Service unserved; its arrival recomputes everything.
        if !(consistent && svc.settled() && sl.settled() && node.relist.is_none()) {
            continue;
        }
        let delta = Delta {
            services: std::mem::take(&mut svc.pending),
            slices: std::mem::take(&mut sl.pending),
            nodes: std::mem::take(&mut node.pending)
                .into_iter()
                .map(|(name, n)| (name.name, n))
                .collect(),
            // The first update carries them even when there are none: it is the whole view.
            problems: problems.take_changed().or_else(|| first.then(Vec::new)),
        };
        first = false;
        if tx.send(Update::Delta(delta)).await.is_err() {
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
