//! The agent's side of `proxy-agent inspect`: an HTTP endpoint on a loopback address only
//! (`--inspect-address`), because what it tells describes every tenant's Services.
//!
//! ```text
//! GET /debug/explain/{namespace}/{name}   → model::explain::Explanation (JSON)
//! GET /debug/services                     → services::ServicesView (JSON)
//! GET /debug/services/{namespace}/{name}  → the same, one Service's ports
//! GET /debug/conntrack                    → conntrack::FlowsView (JSON)
//! GET /debug/conntrack/{namespace}/{name} → the same, one Service's flows
//! GET /debug/trace/{client}/{ip}/{port}/{protocol} → trace::TraceView (JSON)
//! ```
//!
//! The model belongs to the sync loop, which runs on the agent's main thread; a handler
//! does not lock it. It sends a [`Query`] over a queue of [`QUEUE`] places, the event loop
//! answers between syncs ([`Query::answer`]), and the handler waits [`ANSWER_TIMEOUT`] at
//! most. A full queue or a sync that outlasts the wait is a 503 that says so: inspecting
//! never delays a sync by more than one answer, and answering costs what an update of the
//! Service costs. Connections share their own budget of [`CONNECTIONS`] within
//! [`crate::health::http`]'s bounds; answers are counted in
//! `proxy_agent_inspect_requests_total{query,code}`.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::{bail, Context, Result};
use axum::{
    extract::{Path, State},
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tracing::info;

use super::{
    conntrack::{self, FlowsView},
    services::{self, Counted, Counting, ServicesView},
    trace::{self, TraceView},
};
use crate::{
    agent::{modes::ActiveProxier, sync_loop::SyncLoop},
    datapath::runtime::EbpfRuntime,
    health::http::{self, Connections},
    kernel::conntrack::flows::ConntrackFlows,
    metrics::Metrics,
    model::{explain::Explanation, Frontend, ObjectName, ServicePortState},
    proxier::Proxier,
};

/// Where the agent serves, and `inspect` asks, by default.
pub const DEFAULT_ADDRESS: &str = "127.0.0.1:10247";
/// Queries waiting for the sync loop at once.
pub const QUEUE: usize = 4;
/// How long a handler waits for the sync loop's answer.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections open at once to the inspect endpoint.
pub const CONNECTIONS: usize = 16;

/// A question for the sync loop, with where its answer goes.
pub enum Query {
    Explain {
        service: ObjectName,
        reply: oneshot::Sender<Explanation>,
    },
    Services {
        service: Option<ObjectName>,
        /// Also the connections the mode relays itself (`inspect conntrack`).
        relayed: bool,
        reply: oneshot::Sender<Selected>,
    },
    Trace {
        client: std::net::IpAddr,
        destination: Frontend,
        reply: oneshot::Sender<Traced>,
    },
}

/// A trace as the model and the mode's program decide it, with what the handler needs to
/// add the datapath's state (the service port; the userspace relays' flows).
pub struct Traced {
    pub view: TraceView,
    pub port: Option<Arc<ServicePortState>>,
    pub relayed: Option<Vec<conntrack::FlowView>>,
}

/// The service ports `inspect services` asked for, in the model's desired state, with how
/// their counters are had, and the ports the mode could not program (with why).
pub struct Selected {
    pub node: String,
    pub mode: &'static str,
    pub ports: Vec<Arc<ServicePortState>>,
    pub total: usize,
    pub counting: Counting,
    pub unprogrammed: std::collections::HashMap<crate::model::ServicePortName, String>,
    /// The connections the mode relays itself (userspace), for `inspect conntrack`.
    pub relayed: Option<Vec<conntrack::FlowView>>,
}

impl Query {
    /// Answers from the sync loop's model and the running mode (the event loop calls this
    /// between syncs). The asker may have given up waiting: a lost answer is no error.
    pub fn answer(self, syncs: &SyncLoop, proxier: &ActiveProxier, ebpf: Option<&EbpfRuntime>) {
        match self {
            Query::Explain { service, reply } => {
                let _ = reply.send(syncs.explain(&service));
            }
            Query::Trace {
                client,
                destination,
                reply,
            } => {
                let port = trace::port_of(syncs.desired(), destination).cloned();
                let mut view = trace::trace(
                    (syncs.node_name(), proxier.mode().as_str()),
                    port.as_deref(),
                    &syncs.local,
                    &crate::kernel::host::local_addresses(),
                    client,
                    destination,
                );
                let relayed = port
                    .as_ref()
                    .and_then(|p| proxier.relayed_flows(std::slice::from_ref(p)));
                view.remembered = proxier.remembered(&destination, client);
                let _ = reply.send(Traced {
                    view,
                    port,
                    relayed,
                });
            }
            Query::Services {
                service,
                relayed,
                reply,
            } => {
                let (ports, total) = services::select(syncs.desired(), service.as_ref());
                let counting = proxier.counting(ebpf, &ports);
                let relayed = relayed.then(|| proxier.relayed_flows(&ports)).flatten();
                let unprogrammed = crate::agent::sync_loop::ModeProxier::unprogrammed(proxier)
                    .into_iter()
                    .collect();
                let _ = reply.send(Selected {
                    node: syncs.node_name().to_string(),
                    mode: proxier.mode().as_str(),
                    ports,
                    total,
                    counting,
                    unprogrammed,
                    relayed,
                });
            }
        }
    }
}

/// `--inspect-address`: an address and port on a loopback address.
pub fn address(value: &str) -> Result<SocketAddr> {
    let addr = crate::health::proxy::bind_address(value, 10247)?;
    if !addr.ip().is_loopback() {
        bail!(
            "{addr} is not a loopback address: the inspect endpoint describes every tenant's Services and is served on loopback only (127.0.0.1 or ::1)"
        );
    }
    Ok(addr)
}

#[derive(Clone)]
struct AppState {
    queries: mpsc::Sender<Query>,
    metrics: Arc<Metrics>,
    /// Where the eBPF mode's maps are pinned (its conntrack is read there).
    bpffs_root: Arc<std::path::Path>,
}

/// Starts serving on `addr` (a loopback address, see [`address`]); the queries go to
/// `queries`, which the event loop answers.
pub async fn serve(
    addr: SocketAddr,
    queries: mpsc::Sender<Query>,
    metrics: Arc<Metrics>,
    bpffs_root: &std::path::Path,
) -> Result<()> {
    if !addr.ip().is_loopback() {
        bail!("--inspect-address {addr}: not a loopback address");
    }
    let state = AppState {
        queries,
        metrics: metrics.clone(),
        bpffs_root: bpffs_root.into(),
    };
    let app = Router::new()
        .route("/debug/explain/{namespace}/{name}", get(explain))
        .route("/debug/services", get(all_services))
        .route("/debug/services/{namespace}/{name}", get(one_service))
        .route("/debug/trace/{client}/{ip}/{port}/{protocol}", get(traced))
        .route("/debug/conntrack", get(all_flows))
        .route(
            "/debug/conntrack/{namespace}/{name}",
            get(one_services_flows),
        )
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("--inspect-address: listening on {addr}"))?;
    info!(%addr, "serving the inspect endpoint (loopback only)");
    let connections = Connections::new("inspect", CONNECTIONS, Some(metrics));
    tokio::spawn(http::serve(listener, app, connections));
    Ok(())
}

async fn explain(
    State(state): State<AppState>,
    Path((namespace, name)): Path<(String, String)>,
) -> Response {
    let response = match object_name(&namespace, &name) {
        Ok(service) => match ask(&state.queries, |reply| Query::Explain { service, reply }).await {
            Ok(explanation) => json(&explanation),
            Err(response) => response,
        },
        Err(message) => (StatusCode::BAD_REQUEST, message).into_response(),
    };
    count(&state, "explain", response.status());
    response
}

async fn all_services(State(state): State<AppState>) -> Response {
    services_of(state, None).await
}

async fn one_service(
    State(state): State<AppState>,
    Path((namespace, name)): Path<(String, String)>,
) -> Response {
    match object_name(&namespace, &name) {
        Ok(service) => services_of(state, Some(service)).await,
        Err(message) => {
            count(&state, "services", StatusCode::BAD_REQUEST);
            (StatusCode::BAD_REQUEST, message).into_response()
        }
    }
}

async fn services_of(state: AppState, service: Option<ObjectName>) -> Response {
    let root = state.bpffs_root.clone();
    let response = match ask(&state.queries, |reply| Query::Services {
        service,
        relayed: false,
        reply,
    })
    .await
    {
        Ok(selected) => match services_view(selected, root).await {
            Ok(view) => json(&view),
            Err(e) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("reading the counters: {e:#}\n"),
            )
                .into_response(),
        },
        Err(response) => response,
    };
    count(&state, "services", response.status());
    response
}

async fn traced(
    State(state): State<AppState>,
    Path((client, ip, port, protocol)): Path<(String, String, String, String)>,
) -> Response {
    let parsed = trace::parse_client(&client).and_then(|c| {
        let ip: std::net::IpAddr = ip
            .parse()
            .map_err(|_| anyhow::anyhow!("{ip:?}: not an IP address"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| anyhow::anyhow!("{port:?}: not a port"))?;
        let destination =
            trace::parse_destination(&format!("{}/{protocol}", SocketAddr::new(ip, port)))?;
        Ok((c, destination))
    });
    let response = match parsed {
        Err(e) => (StatusCode::BAD_REQUEST, format!("{e:#}\n")).into_response(),
        Ok((client, destination)) => {
            match ask(&state.queries, |reply| Query::Trace {
                client,
                destination,
                reply,
            })
            .await
            {
                Ok(traced) => {
                    let root = state.bpffs_root.clone();
                    match tokio::task::spawn_blocking(move || {
                        with_datapath_state(traced, &root, client, destination)
                    })
                    .await
                    {
                        Ok(view) => json(&view),
                        Err(e) => {
                            (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response()
                        }
                    }
                }
                Err(response) => response,
            }
        }
    };
    count(&state, "trace", response.status());
    response
}

/// Adds to a trace what the datapath holds for the client: its tracked flows to the
/// destination, and in eBPF mode the backend its affinity remembers. What cannot be read
/// is said in a step, not an error: the rest of the trace stands.
fn with_datapath_state(
    traced: Traced,
    root: &std::path::Path,
    client: std::net::IpAddr,
    destination: Frontend,
) -> TraceView {
    let Traced {
        mut view,
        port,
        relayed,
    } = traced;
    let Some(port) = port else {
        return view;
    };
    let to = SocketAddr::new(destination.addr, destination.port);
    let flows: Result<Vec<conntrack::FlowView>> = if let Some(relayed) = relayed {
        Ok(relayed)
    } else if view.mode == "ebpf" {
        conntrack::from_pins(root, None)
    } else {
        let kernel = ConntrackFlows;
        kernel
            .list(if client.is_ipv4() {
                libc::AF_INET as u8
            } else {
                libc::AF_INET6 as u8
            })
            .map(|entries| conntrack::from_kernel(std::slice::from_ref(&port), &entries))
    };
    match flows {
        Ok(flows) => {
            view.existing = flows
                .into_iter()
                .filter(|f| f.client.ip() == client && f.frontend == to)
                .collect()
        }
        Err(e) => view.steps.push(trace::Step {
            step: "tracked flows".into(),
            outcome: format!("not read: {e:#}"),
        }),
    }
    if view.mode == "ebpf" {
        let this_node_set = view.set == "thisNode";
        match trace::ebpf_affinity(root, client, destination, this_node_set, &port) {
            Ok(remembered) => view.remembered = remembered,
            Err(e) => view.steps.push(trace::Step {
                step: "affinity".into(),
                outcome: format!("not read: {e:#}"),
            }),
        }
    }
    if let Some(r) = &view.remembered {
        view.verdict = format!(
            "translated to {} (the client's ClientIP affinity, {} s left)",
            r.backend, r.valid_for_seconds
        );
    }
    view
}

async fn all_flows(State(state): State<AppState>) -> Response {
    flows_of(state, None).await
}

async fn one_services_flows(
    State(state): State<AppState>,
    Path((namespace, name)): Path<(String, String)>,
) -> Response {
    match object_name(&namespace, &name) {
        Ok(service) => flows_of(state, Some(service)).await,
        Err(message) => {
            count(&state, "conntrack", StatusCode::BAD_REQUEST);
            (StatusCode::BAD_REQUEST, message).into_response()
        }
    }
}

/// The flows through `service` (every service without one): the eBPF mode's from its
/// pinned conntrack maps, the others' from kernel conntrack; read on a worker thread.
async fn flows_of(state: AppState, service: Option<ObjectName>) -> Response {
    let asked = service.clone();
    let response = match ask(&state.queries, |reply| Query::Services {
        service,
        relayed: true,
        reply,
    })
    .await
    {
        Ok(selected) => {
            let root = state.bpffs_root.clone();
            let read = tokio::task::spawn_blocking(move || -> Result<FlowsView> {
                let (flows, source) = if let Some(relayed) = selected.relayed {
                    (relayed, conntrack::FROM_RELAYS)
                } else if selected.mode == "ebpf" {
                    (
                        conntrack::from_pins(&root, asked.as_ref())?,
                        conntrack::FROM_PINS,
                    )
                } else {
                    let kernel = ConntrackFlows;
                    let mut entries = kernel.list(libc::AF_INET as u8)?;
                    entries.extend(kernel.list(libc::AF_INET6 as u8)?);
                    (
                        conntrack::from_kernel(&selected.ports, &entries),
                        conntrack::FROM_KERNEL,
                    )
                };
                Ok(conntrack::view(
                    &selected.node,
                    selected.mode,
                    source,
                    flows,
                ))
            })
            .await;
            match read {
                Ok(Ok(view)) => json(&view),
                Ok(Err(e)) => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("reading conntrack: {e:#}\n"),
                )
                    .into_response(),
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
            }
        }
        Err(response) => response,
    };
    count(&state, "conntrack", response.status());
    response
}

/// The view of what the sync loop selected; the counters are read here, on a worker
/// thread (the eBPF arrays through their pins, or kernel conntrack).
async fn services_view(selected: Selected, root: Arc<std::path::Path>) -> Result<ServicesView> {
    let Selected {
        node,
        mode,
        ports,
        total,
        counting,
        unprogrammed,
        ..
    } = selected;
    let counted = match counting {
        Counting::Done(c) => c,
        Counting::Ebpf(ids) => {
            tokio::task::spawn_blocking(move || ids.read(&root.join("maps"))).await??
        }
        Counting::Ipvs => {
            let ports = ports.clone();
            tokio::task::spawn_blocking(move || services::count_ipvs(&ports)).await??
        }
        Counting::Conntrack => {
            let ports = ports.clone();
            tokio::task::spawn_blocking(move || -> Result<Counted> {
                let flows = ConntrackFlows;
                let mut entries = flows.list(libc::AF_INET as u8)?;
                entries.extend(flows.list(libc::AF_INET6 as u8)?);
                Ok(services::count_conntrack(
                    ports.iter().map(|p| &**p),
                    &entries,
                ))
            })
            .await??
        }
    };
    let mut views = services::view(&ports, &counted);
    for (view, port) in views.iter_mut().zip(&ports) {
        view.not_programmed = unprogrammed.get(&port.name).cloned();
    }
    Ok(ServicesView {
        node,
        mode: mode.into(),
        counters: counted.source.clone(),
        total_ports: total,
        truncated: total > ports.len(),
        ports: views,
    })
}

fn count(state: &AppState, query: &str, code: StatusCode) {
    state
        .metrics
        .inspect_requests
        .with_label_values(&[query, code.as_str()])
        .inc();
}

/// A Service's name as the API server allows it (DNS-1123 labels and subdomains), so that
/// nothing else reaches the sync loop.
fn object_name(namespace: &str, name: &str) -> Result<ObjectName, String> {
    for (what, value) in [("namespace", namespace), ("name", name)] {
        let fine = !value.is_empty()
            && value.len() <= 253
            && value
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !fine {
            return Err(format!(
                "{what} {value:?}: expected a Kubernetes name (lower-case letters, digits, '-' and '.', at most 253)\n"
            ));
        }
    }
    Ok(ObjectName {
        namespace: namespace.into(),
        name: name.into(),
    })
}

/// Sends a query to the sync loop and waits for its answer; a 503 saying why when it
/// cannot wait or waited too long.
async fn ask<T>(
    queries: &mpsc::Sender<Query>,
    query: impl FnOnce(oneshot::Sender<T>) -> Query,
) -> Result<T, Response> {
    let (reply, answer) = oneshot::channel();
    let unavailable =
        |why: &str| (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response();
    match queries.try_send(query(reply)) {
        Ok(()) => {}
        Err(mpsc::error::TrySendError::Full(_)) => {
            return Err(unavailable(&format!(
                "{QUEUE} inspect requests are already waiting for the sync loop: try again"
            )))
        }
        Err(mpsc::error::TrySendError::Closed(_)) => {
            return Err(unavailable("the agent is stopping"))
        }
    }
    match tokio::time::timeout(ANSWER_TIMEOUT, answer).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(_)) => Err(unavailable("the agent is stopping")),
        Err(_) => Err(unavailable(&format!(
            "the sync loop did not answer within {} s (a sync is running): try again",
            ANSWER_TIMEOUT.as_secs()
        ))),
    }
}

fn json(answer: &impl Serialize) -> Response {
    match serde_json::to_string_pretty(answer) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body + "\n").into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_addresses_are_served() {
        assert_eq!(
            address(DEFAULT_ADDRESS).unwrap(),
            "127.0.0.1:10247".parse().unwrap()
        );
        assert_eq!(address("::1").unwrap(), "[::1]:10247".parse().unwrap());
        let e = address("0.0.0.0:10247").unwrap_err().to_string();
        assert!(e.contains("not a loopback address"), "{e}");
        assert!(address("10.0.0.1").is_err());
    }

    #[test]
    fn names_that_no_service_can_have_are_refused_before_the_sync_loop() {
        assert!(object_name("default", "web").is_ok());
        assert!(object_name("kube-system", "kube-dns.v2").is_ok());
        for (ns, name) in [
            ("", "web"),
            ("default", "Web"),
            ("default", "a b"),
            ("x", &"a".repeat(254)),
        ] {
            let e = object_name(ns, name).unwrap_err();
            assert!(e.contains("expected a Kubernetes name"), "{e}");
        }
    }

    #[tokio::test]
    async fn a_busy_sync_loop_is_a_503_that_says_so() {
        // Nobody answers: the queue fills, then each request says why it was not answered.
        let (tx, _rx) = mpsc::channel(QUEUE);
        for _ in 0..QUEUE {
            let (reply, _) = oneshot::channel();
            tx.try_send(Query::Explain {
                service: object_name("a", "b").unwrap(),
                reply,
            })
            .unwrap();
        }
        let full = ask::<Explanation>(&tx, |reply| Query::Explain {
            service: object_name("a", "b").unwrap(),
            reply,
        })
        .await
        .unwrap_err();
        assert_eq!(full.status(), StatusCode::SERVICE_UNAVAILABLE);
        let (tx, rx) = mpsc::channel(QUEUE);
        drop(rx);
        let closed = ask::<Explanation>(&tx, |reply| Query::Explain {
            service: object_name("a", "b").unwrap(),
            reply,
        })
        .await
        .unwrap_err();
        assert_eq!(closed.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
}
