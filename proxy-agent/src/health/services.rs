//! `healthCheckNodePort` servers: for each `externalTrafficPolicy: Local` service with a
//! health-check node port, an HTTP server on that port that tells a load balancer whether
//! this node has endpoints of the service, as kube-proxy's service health server does: 200
//! with the local endpoint count when there are some, 503 when there are none or when the
//! sync loop is stalled (the proxy health check; node eligibility is `/healthz`'s alone), and
//! the same JSON body either way.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
};

use axum::{
    extract::State,
    http::{header, StatusCode},
    response::IntoResponse,
    Router,
};
use tracing::{info, warn};

use super::{http::Connections, proxy::ProxyHealth};
use crate::{
    metrics::Metrics,
    model::{DesiredState, ObjectName},
};

/// What one health-check port reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceHealth {
    pub service: ObjectName,
    pub local_endpoints: usize,
}

/// Health-check ports the desired state asks for: per port, the service and its local
/// endpoints (the most any of its ports has, as kube-proxy counts endpoints per service).
pub fn wanted(desired: &DesiredState) -> BTreeMap<u16, ServiceHealth> {
    let mut out: BTreeMap<u16, ServiceHealth> = BTreeMap::new();
    for state in desired.ports.values() {
        let Some((port, local)) = state.health_check else {
            continue;
        };
        let entry = out.entry(port).or_insert_with(|| ServiceHealth {
            service: state.name.service.clone(),
            local_endpoints: 0,
        });
        entry.local_endpoints = entry.local_endpoints.max(local);
    }
    out
}

struct Server {
    state: Arc<Mutex<ServiceHealth>>,
    task: tokio::task::JoinHandle<()>,
}

/// The running servers, one per health-check port.
pub struct ServiceHealthServers {
    servers: BTreeMap<u16, Server>,
    proxy: ProxyHealth,
    /// One connection budget for all of them: the ports are on every node address, and
    /// their number is the tenants' to choose.
    connections: Connections,
}

impl ServiceHealthServers {
    pub fn new(proxy: ProxyHealth, metrics: Option<Arc<Metrics>>) -> Self {
        Self {
            servers: BTreeMap::new(),
            proxy,
            connections: Connections::new(
                "health-check-node-ports",
                super::http::NODE_PORT_CONNECTIONS,
                metrics,
            ),
        }
    }

    /// Starts, updates and stops servers to match `wanted`. A port that cannot be bound is
    /// logged and retried on the next call.
    pub fn sync(&mut self, wanted: BTreeMap<u16, ServiceHealth>) {
        self.servers.retain(|port, server| {
            let keep = wanted.contains_key(port);
            if !keep {
                server.task.abort();
                info!(port, "health check node port closed");
            }
            keep
        });
        for (port, health) in wanted {
            if let Some(server) = self.servers.get(&port) {
                *server.state.lock().unwrap() = health;
                continue;
            }
            let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
            let listener = match std::net::TcpListener::bind(addr)
                .and_then(|l| l.set_nonblocking(true).map(|()| l))
                .and_then(tokio::net::TcpListener::from_std)
            {
                Ok(l) => l,
                Err(e) => {
                    warn!(port, service = %health.service, "health check node port not served: {e}");
                    continue;
                }
            };
            info!(port, service = %health.service, "health check node port serving");
            let state = Arc::new(Mutex::new(health));
            let app = Router::new()
                .fallback(respond)
                .with_state((state.clone(), self.proxy.clone()));
            let task = tokio::spawn(super::http::serve(listener, app, self.connections.clone()));
            self.servers.insert(port, Server { state, task });
        }
    }
}

impl Drop for ServiceHealthServers {
    fn drop(&mut self) {
        for server in self.servers.values() {
            server.task.abort();
        }
    }
}

async fn respond(
    State((state, proxy)): State<(Arc<Mutex<ServiceHealth>>, ProxyHealth)>,
) -> impl IntoResponse {
    let health = state.lock().unwrap().clone();
    let (proxy_healthy, _) = proxy.check(std::time::SystemTime::now());
    let code = if health.local_endpoints > 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "service": {
            "namespace": health.service.namespace,
            "name": health.service.name,
        },
        "localEndpoints": health.local_endpoints,
        "serviceProxyHealthy": proxy_healthy,
    });
    (
        code,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body.to_string(),
    )
}
