//! Service-port states the proxiers' unit tests build their desired states from.

use std::sync::Arc;

use crate::model::{
    DesiredState, Frontend, FrontendKind, FrontendState, Protocol, ServicePortState, WhenEmpty,
};

/// TCP port 80 of `default/name` on cluster IP `vip`, served by `backends`.
pub fn state(name: &str, vip: &str, backends: &[&str]) -> ServicePortState {
    let backends = backends.iter().map(|b| b.parse().unwrap()).collect();
    ServicePortState::cluster_ip("default", name, "http", vip.parse().unwrap(), backends)
}

/// A NodePort frontend (TCP 30080 on `addr`) with `s`'s endpoints.
pub fn node_port(s: &ServicePortState, addr: &str, masquerade: bool) -> FrontendState {
    FrontendState {
        frontend: Frontend {
            addr: addr.parse().unwrap(),
            port: 30080,
            protocol: Protocol::Tcp,
        },
        kind: FrontendKind::NodePort,
        backends: s.backends.clone(),
        draining: Vec::new(),
        when_empty: WhenEmpty::Refuse,
        source_ranges: Vec::new(),
        masquerade,
        masquerade_all: false,
        in_cluster: None,
    }
}

pub fn desired(states: &[ServicePortState]) -> DesiredState {
    DesiredState {
        ports: states
            .iter()
            .map(|s| (s.name.clone(), Arc::new(s.clone())))
            .collect(),
    }
}
