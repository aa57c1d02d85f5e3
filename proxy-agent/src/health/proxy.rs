//! `/healthz` and `/livez` with kube-proxy's semantics, and the HTTP servers for them and for
//! `/metrics` and `/proxyMode`.
//!
//! Healthy means: no change has been waiting for a completed sync for longer than the
//! health timeout (2 × syncPeriod). An idle agent with nothing pending is healthy however
//! long ago it last synced, as in kube-proxy. A sync completes even when some service ports
//! could not be programmed: those are reported per service port (log, metrics) and retried,
//! never held against the node, or one tenant's unprogrammable Service would fail the
//! liveness probe and every load balancer's health check on every node.
//!
//! `/healthz` also says whether the node should take new traffic (KEP-3836): 503 with the
//! reason while its Node is being deleted or tainted `ToBeDeletedByClusterAutoscaler`.
//! `/livez` ignores that: the agent itself is fine and must not be restarted.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result};
use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::get, Router};
use tracing::info;

use crate::metrics::Metrics;

#[derive(Debug)]
struct Times {
    last_updated: Option<SystemTime>,
    oldest_pending: Option<SystemTime>,
    /// Why the node should take no new traffic (see the module doc); `None`: eligible.
    ineligible: Option<String>,
}

/// Sync progress, shared between the sync loop and the HTTP handlers.
#[derive(Clone, Debug)]
pub struct ProxyHealth {
    times: Arc<Mutex<Times>>,
    timeout: Duration,
}

impl ProxyHealth {
    pub fn new(timeout: Duration) -> Self {
        Self {
            times: Arc::new(Mutex::new(Times {
                last_updated: None,
                oldest_pending: None,
                ineligible: None,
            })),
            timeout,
        }
    }

    /// A change was seen that needs a sync.
    pub fn queued(&self, at: SystemTime) {
        let mut t = self.times.lock().unwrap();
        t.oldest_pending.get_or_insert(at);
    }

    /// A sync completed (service ports it could not program are reported, not counted).
    pub fn updated(&self, at: SystemTime) {
        let mut t = self.times.lock().unwrap();
        t.last_updated = Some(at);
        t.oldest_pending = None;
    }

    /// Whether the node should take new traffic, and why not.
    pub fn set_ineligible(&self, why: Option<String>) {
        self.times.lock().unwrap().ineligible = why;
    }

    /// Why the node should take no new traffic, if so.
    pub fn ineligible(&self) -> Option<String> {
        self.times.lock().unwrap().ineligible.clone()
    }

    /// (healthy, last completed sync).
    pub fn check(&self, now: SystemTime) -> (bool, Option<SystemTime>) {
        let t = self.times.lock().unwrap();
        let healthy = match t.oldest_pending {
            Some(pending) => now.duration_since(pending).unwrap_or_default() <= self.timeout,
            None => true,
        };
        (healthy, t.last_updated)
    }
}

/// A time as JSON seconds since the epoch, to the millisecond (null: never).
fn seconds(t: Option<SystemTime>) -> serde_json::Value {
    match t {
        Some(t) => {
            let ms = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis();
            serde_json::json!(ms as f64 / 1000.0)
        }
        None => serde_json::Value::Null,
    }
}

#[derive(Clone)]
struct AppState {
    health: ProxyHealth,
    metrics: Arc<Metrics>,
    mode: &'static str,
}

async fn healthz(State(s): State<AppState>) -> impl IntoResponse {
    respond(&s, &s.metrics.healthz_total, true)
}

async fn livez(State(s): State<AppState>) -> impl IntoResponse {
    respond(&s, &s.metrics.livez_total, false)
}

/// The answer of `/healthz` (`eligibility`: the node's eligibility counts) or `/livez`.
fn respond(
    s: &AppState,
    counter: &prometheus::IntCounterVec,
    eligibility: bool,
) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    let now = SystemTime::now();
    let (healthy, last) = s.health.check(now);
    let ineligible = s.health.ineligible();
    let code = if healthy && !(eligibility && ineligible.is_some()) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    counter.with_label_values(&[code.as_str()]).inc();
    let mut body = serde_json::json!({
        "lastUpdated": seconds(last),
        "currentTime": seconds(Some(now)),
        "nodeEligible": ineligible.is_none(),
    });
    if let Some(why) = ineligible {
        body["nodeIneligibleReason"] = why.into();
    }
    (
        code,
        [("content-type", "application/json")],
        body.to_string(),
    )
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        s.metrics.render(),
    )
}

async fn proxy_mode(State(s): State<AppState>) -> impl IntoResponse {
    s.mode
}

/// `host:port`, or an IP alone (kube-proxy's default port is added).
pub fn bind_address(value: &str, default_port: u16) -> Result<SocketAddr> {
    if let Ok(a) = value.parse::<SocketAddr>() {
        return Ok(a);
    }
    let ip: std::net::IpAddr = value
        .parse()
        .with_context(|| format!("{value:?} is not an IP or IP:port"))?;
    Ok(SocketAddr::new(ip, default_port))
}

/// Starts the health server (`/healthz`, `/livez`) and the metrics server (`/metrics`,
/// `/proxyMode`) on their addresses; they may be the same address.
pub async fn serve(
    healthz_addr: SocketAddr,
    metrics_addr: SocketAddr,
    health: ProxyHealth,
    metrics_registry: Arc<Metrics>,
    mode: &'static str,
) -> Result<()> {
    let state = AppState {
        health,
        metrics: metrics_registry.clone(),
        mode,
    };
    let health_routes = Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez));
    let metric_routes = Router::new()
        .route("/metrics", get(metrics))
        .route("/proxyMode", get(proxy_mode));
    let mut servers = Vec::new();
    if healthz_addr == metrics_addr {
        servers.push((
            healthz_addr,
            health_routes.merge(metric_routes).with_state(state),
        ));
    } else {
        servers.push((healthz_addr, health_routes.with_state(state.clone())));
        servers.push((metrics_addr, metric_routes.with_state(state)));
    }
    // One budget for both: whatever address they share, a flood of one cannot take more
    // descriptors than the cap, and a probe still gets in (see `http`).
    let connections = super::http::Connections::new(
        "agent",
        super::http::AGENT_CONNECTIONS,
        Some(metrics_registry),
    );
    for (addr, app) in servers {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        info!(%addr, "serving HTTP");
        tokio::spawn(super::http::serve(listener, app, connections.clone()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthy_unless_a_change_waits_longer_than_the_timeout() {
        let h = ProxyHealth::new(Duration::from_secs(60));
        let t0 = UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert!(h.check(t0).0, "nothing pending");
        h.queued(t0);
        assert!(h.check(t0 + Duration::from_secs(59)).0);
        assert!(!h.check(t0 + Duration::from_secs(61)).0, "stalled");
        h.queued(t0 + Duration::from_secs(50)); // the oldest pending change counts
        assert!(!h.check(t0 + Duration::from_secs(61)).0);
        h.updated(t0 + Duration::from_secs(62));
        assert_eq!(
            h.check(t0 + Duration::from_secs(3600)),
            (true, Some(t0 + Duration::from_secs(62)))
        );
    }

    #[test]
    fn an_ineligible_node_fails_healthz_with_the_reason_but_not_livez() {
        let state = AppState {
            health: ProxyHealth::new(Duration::from_secs(60)),
            metrics: Arc::new(Metrics::new()),
            mode: "ebpf",
        };
        let answer = |eligibility| {
            let (code, _, body) = respond(&state, &state.metrics.healthz_total, eligibility);
            let body: serde_json::Value = serde_json::from_str(&body).unwrap();
            (code, body)
        };
        let (code, body) = answer(true);
        assert_eq!(code, StatusCode::OK);
        assert_eq!(body["nodeEligible"], true);
        assert!(body["currentTime"].is_number(), "{body}");
        state
            .health
            .set_ineligible(Some("the Node is being deleted".into()));
        let (code, body) = answer(true);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["nodeEligible"], false);
        assert_eq!(body["nodeIneligibleReason"], "the Node is being deleted");
        let (code, _) = answer(false);
        assert_eq!(code, StatusCode::OK, "/livez: the agent itself is fine");
        state.health.set_ineligible(None);
        assert_eq!(answer(true).0, StatusCode::OK);
    }

    #[test]
    fn bind_addresses_take_an_ip_alone() {
        assert_eq!(
            bind_address("0.0.0.0", 10256).unwrap(),
            "0.0.0.0:10256".parse().unwrap()
        );
        assert_eq!(
            bind_address("127.0.0.1:9", 10249).unwrap(),
            "127.0.0.1:9".parse().unwrap()
        );
        assert!(bind_address("nowhere", 1).is_err());
    }
}
