//! A replayed Kubernetes API server: what the agent's API source talks to, served over real
//! HTTP inside a lab namespace (the one mock the guide allows: nothing real runs here).
//!
//! It serves the three resources the agent watches (`services`, `endpointslices`, `nodes`)
//! with the API server's list and watch protocol as kube-rs' watcher uses it: lists paged by
//! `limit` and `continue` (the watcher asks for 500 at a time), a `resourceVersion` on every
//! list and object, and watches from a resource version that first replay what changed since
//! (so a change made between a list and its watch is not lost) and then stream each change
//! as it is made. Events the agent records (`events.k8s.io`) are kept for tests to read.
//!
//! Objects are held serialized, so a list page of 500 of 100 000 EndpointSlices is a copy of
//! bytes, not a serialization: the server stays cheap beside the agent it feeds on the same
//! cores. Label and field selectors are not applied: the agent checks the labels it selects
//! on itself too, and a test that needs a selector's effect checks the agent's, not ours.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use axum::{
    body::{Body, Bytes},
    extract::{RawQuery, State},
    routing::{get, post},
    serve::ListenerExt,
    Router,
};
use serde_json::Value;
use tokio::sync::broadcast;

use crate::lab::Netns;

/// The resources served: (path under the API root, list kind, list apiVersion).
const RESOURCES: [(&str, &str, &str, &str); 3] = [
    ("services", "/api/v1/services", "ServiceList", "v1"),
    (
        "endpointslices",
        "/apis/discovery.k8s.io/v1/endpointslices",
        "EndpointSliceList",
        "discovery.k8s.io/v1",
    ),
    ("nodes", "/api/v1/nodes", "NodeList", "v1"),
];

/// One resource's objects (serialized, by `namespace/name`) and its change log.
struct Resource {
    list_kind: &'static str,
    api_version: &'static str,
    items: BTreeMap<String, Bytes>,
    /// Every change so far as (resource version, watch event line), oldest first.
    log: Vec<(u64, Bytes)>,
    events: broadcast::Sender<(u64, Bytes)>,
    watchers: usize,
}

struct Inner {
    resources: BTreeMap<&'static str, Resource>,
    /// The last resource version given out (one counter for every resource, as etcd's).
    version: u64,
}

/// The replayed API server's state; clones share it.
#[derive(Clone)]
pub struct ApiServer {
    inner: Arc<Mutex<Inner>>,
    recorded: Arc<Mutex<Vec<Value>>>,
}

impl Default for ApiServer {
    fn default() -> Self {
        Self::new()
    }
}

fn key_of(object: &Value) -> String {
    let meta = &object["metadata"];
    format!(
        "{}/{}",
        meta["namespace"].as_str().unwrap_or(""),
        meta["name"].as_str().expect("an object has metadata.name")
    )
}

impl ApiServer {
    pub fn new() -> Self {
        let resources = RESOURCES
            .iter()
            .map(|&(name, _, list_kind, api_version)| {
                (
                    name,
                    Resource {
                        list_kind,
                        api_version,
                        items: BTreeMap::new(),
                        log: Vec::new(),
                        events: broadcast::channel(1024).0,
                        watchers: 0,
                    },
                )
            })
            .collect();
        ApiServer {
            inner: Arc::new(Mutex::new(Inner {
                resources,
                version: 1,
            })),
            recorded: Arc::default(),
        }
    }

    /// Stores objects of `resource` without telling watchers: what exists before the agent
    /// starts (each gets a resource version of its own).
    pub fn load(&self, resource: &str, objects: impl IntoIterator<Item = Value>) {
        let mut inner = self.inner.lock().unwrap();
        let mut version = inner.version;
        let r = inner
            .resources
            .get_mut(resource)
            .expect("a served resource");
        for mut object in objects {
            version += 1;
            object["metadata"]["resourceVersion"] = Value::String(version.to_string());
            let body = Bytes::from(serde_json::to_vec(&object).expect("JSON"));
            r.items.insert(key_of(&object), body);
        }
        inner.version = version;
    }

    /// Changes an object and tells the watchers: `ADDED`, `MODIFIED` or `DELETED`.
    pub fn change(&self, resource: &str, kind: &str, mut object: Value) {
        let mut inner = self.inner.lock().unwrap();
        inner.version += 1;
        let version = inner.version;
        object["metadata"]["resourceVersion"] = Value::String(version.to_string());
        let r = inner
            .resources
            .get_mut(resource)
            .expect("a served resource");
        let key = key_of(&object);
        if kind == "DELETED" {
            r.items.remove(&key);
        } else {
            let body = Bytes::from(serde_json::to_vec(&object).expect("JSON"));
            r.items.insert(key, body);
        }
        let mut line =
            serde_json::to_vec(&serde_json::json!({"type": kind, "object": object})).unwrap();
        line.push(b'\n');
        let line = Bytes::from(line);
        r.log.push((version, line.clone()));
        let _ = r.events.send((version, line));
    }

    /// Open watches, over every resource.
    pub fn watchers(&self) -> usize {
        let inner = self.inner.lock().unwrap();
        inner.resources.values().map(|r| r.watchers).sum()
    }

    /// Waits until `n` watches are open (the agent watches three resources).
    pub fn wait_for_watchers(&self, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while self.watchers() < n {
            if Instant::now() > deadline {
                anyhow::bail!(
                    "{} of {n} watches open after {} s",
                    self.watchers(),
                    timeout.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Events the agent recorded (POSTed to events.k8s.io), in order.
    pub fn events(&self) -> Vec<Value> {
        self.recorded.lock().unwrap().clone()
    }

    /// The first recorded Event with `reason`, waiting up to `timeout`.
    pub fn wait_for_event(&self, reason: &str, timeout: Duration) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.events().into_iter().find(|e| e["reason"] == reason) {
                return Ok(e);
            }
            if Instant::now() > deadline {
                anyhow::bail!("no {reason} event: {:?}", self.events());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn list(&self, resource: &str, query: &Query) -> axum::response::Response {
        let inner = self.inner.lock().unwrap();
        let r = &inner.resources[resource];
        let start = query
            .continue_after
            .as_ref()
            .map_or(std::ops::Bound::Unbounded, |k| {
                std::ops::Bound::Excluded(k.clone())
            });
        let limit = query.limit.unwrap_or(usize::MAX);
        let mut body = Vec::with_capacity(64 * 1024);
        body.extend_from_slice(b"{\"items\":[");
        let mut last = None;
        let mut count = 0;
        let mut range = r
            .items
            .range((start, std::ops::Bound::Unbounded))
            .peekable();
        while count < limit {
            let Some((key, item)) = range.next() else {
                break;
            };
            if count > 0 {
                body.push(b',');
            }
            body.extend_from_slice(item);
            count += 1;
            last = Some(key);
        }
        let more = range.peek().is_some();
        let token = match (more, last) {
            (true, Some(key)) => format!(",\"continue\":\"{}\"", hex(key.as_bytes())),
            _ => String::new(),
        };
        body.extend_from_slice(
            format!(
                "],\"kind\":\"{}\",\"apiVersion\":\"{}\",\"metadata\":{{\"resourceVersion\":\"{}\"{token}}}}}",
                r.list_kind, r.api_version, inner.version
            )
            .as_bytes(),
        );
        json_response(200, Body::from(body))
    }

    fn watch(&self, resource: &'static str, query: &Query) -> axum::response::Response {
        let mut inner = self.inner.lock().unwrap();
        let r = inner.resources.get_mut(resource).unwrap();
        r.watchers += 1;
        // Subscribed under the lock: nothing falls between the replay and the stream.
        let rx = r.events.subscribe();
        let since = query.resource_version.unwrap_or(0);
        let replay: Vec<Bytes> = r
            .log
            .iter()
            .filter(|(v, _)| *v > since)
            .map(|(_, line)| line.clone())
            .collect();
        let last = r.log.last().map_or(since, |(v, _)| *v.max(&since));
        let gone = WatchGuard(self.clone(), resource);
        let replayed = futures::stream::iter(replay.into_iter().map(Ok::<_, Infallible>));
        let live = futures::stream::unfold((rx, last, gone), |(mut rx, last, gone)| async move {
            loop {
                match rx.recv().await {
                    Ok((v, line)) if v > last => return Some((Ok(line), (rx, v, gone))),
                    Ok(_) => continue,
                    // A watcher that fell behind ends; kube's watcher lists again.
                    Err(_) => return None,
                }
            }
        });
        use futures::StreamExt;
        json_response(200, Body::from_stream(replayed.chain(live)))
    }

    async fn serve(
        self,
        resource: &'static str,
        query: Option<String>,
    ) -> axum::response::Response {
        let query = Query::parse(query.as_deref().unwrap_or(""));
        if query.watch {
            self.watch(resource, &query)
        } else {
            self.list(resource, &query)
        }
    }

    async fn record_event(self, body: Bytes) -> axum::response::Response {
        let Ok(event) = serde_json::from_slice::<Value>(&body) else {
            return json_response(400, Body::from("{}"));
        };
        self.recorded.lock().unwrap().push(event.clone());
        json_response(201, Body::from(serde_json::to_vec(&event).unwrap()))
    }

    /// Serves on 127.0.0.1:`port` inside `ns`, from a thread of its own with its own
    /// runtime; returns once it listens.
    pub fn start(&self, ns: &Netns, port: u16) -> Result<()> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let server = self.clone();
        let _thread = ns.spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            rt.block_on(async move {
                let mut app = Router::new();
                for (name, path, _, _) in RESOURCES {
                    app = app.route(
                        path,
                        get(move |State(a): State<ApiServer>, RawQuery(q): RawQuery| {
                            a.serve(name, q)
                        }),
                    );
                }
                let app = app
                    .route(
                        "/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                        post(|State(a): State<ApiServer>, body: Bytes| a.record_event(body)),
                    )
                    .with_state(server);
                let listener = match tokio::net::TcpListener::bind(SocketAddr::from((
                    Ipv4Addr::LOCALHOST,
                    port,
                )))
                .await
                {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                // As the API server (Go's net/http) does: without it each list page waits
                // on Nagle and delayed ACKs.
                let listener = listener.tap_io(|tcp| {
                    let _ = tcp.set_nodelay(true);
                });
                let _ = axum::serve(listener, app).await;
            });
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .context("the replayed API server did not start")?
            .with_context(|| format!("binding 127.0.0.1:{port}"))
    }

    /// A kubeconfig in `dir` pointing at this server on `port`.
    pub fn kubeconfig(dir: &Path, port: u16) -> Result<PathBuf> {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters: [{{name: lab, cluster: {{server: \"http://127.0.0.1:{port}\"}}}}]\nusers: [{{name: lab, user: {{}}}}]\ncontexts: [{{name: lab, context: {{cluster: lab, user: lab}}}}]\ncurrent-context: lab\n"
            ),
        )
        .with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }
}

/// Counts a watch as closed when its stream is dropped (the agent hung up).
struct WatchGuard(ApiServer, &'static str);

impl Drop for WatchGuard {
    fn drop(&mut self) {
        if let Ok(mut inner) = self.0.inner.lock() {
            if let Some(r) = inner.resources.get_mut(self.1) {
                r.watchers = r.watchers.saturating_sub(1);
            }
        }
    }
}

fn json_response(status: u16, body: Body) -> axum::response::Response {
    axum::response::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(body)
        .expect("a response")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<String> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

/// The query parameters the watcher sends that change what is served.
#[derive(Debug, Default, PartialEq)]
struct Query {
    watch: bool,
    limit: Option<usize>,
    continue_after: Option<String>,
    resource_version: Option<u64>,
}

impl Query {
    fn parse(raw: &str) -> Self {
        let mut q = Query::default();
        for pair in raw.split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "watch" => q.watch = v == "true" || v == "1",
                "limit" => q.limit = v.parse().ok().filter(|n| *n > 0),
                "continue" => q.continue_after = unhex(v),
                "resourceVersion" => q.resource_version = v.parse().ok(),
                _ => {}
            }
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_read_as_the_watcher_writes_them() {
        let q = Query::parse(
            "labelSelector=%21a&limit=500&continue=6c61622f61&resourceVersion=7&watch=true",
        );
        assert_eq!(
            q,
            Query {
                watch: true,
                limit: Some(500),
                continue_after: Some("lab/a".into()),
                resource_version: Some(7),
            }
        );
        assert_eq!(Query::parse(""), Query::default());
        assert_eq!(Query::parse("continue=zz&limit=0").continue_after, None);
    }

    fn page(server: &ApiServer, query: &str) -> Value {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let response = rt.block_on(server.clone().serve("services", Some(query.into())));
        let body = rt
            .block_on(axum::body::to_bytes(response.into_body(), usize::MAX))
            .unwrap();
        serde_json::from_slice(&body).expect("a list is JSON")
    }

    #[test]
    fn lists_come_in_pages_that_cover_every_object_once() {
        let server = ApiServer::new();
        server.load(
            "services",
            (0..7).map(
                |i| serde_json::json!({"metadata": {"name": format!("s{i}"), "namespace": "lab"}}),
            ),
        );
        let mut names = Vec::new();
        let mut query = "limit=3".to_string();
        loop {
            let list = page(&server, &query);
            assert_eq!(list["kind"], "ServiceList");
            assert_eq!(list["metadata"]["resourceVersion"], "8");
            for item in list["items"].as_array().unwrap() {
                names.push(item["metadata"]["name"].as_str().unwrap().to_string());
            }
            match list["metadata"]["continue"].as_str() {
                Some(token) => query = format!("limit=3&continue={token}"),
                None => break,
            }
        }
        let want: Vec<String> = (0..7).map(|i| format!("s{i}")).collect();
        assert_eq!(names, want);
        // Without a limit: everything at once.
        assert_eq!(page(&server, "")["items"].as_array().unwrap().len(), 7);
    }
}
