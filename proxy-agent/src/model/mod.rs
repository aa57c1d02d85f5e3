//! The one service model: Services and EndpointSlices in, a mode-independent desired state out.
//!
//! Every semantic decision (which endpoints serve, how a target port resolves) is made here,
//! once; proxiers only receive [`DesiredState`] and the [`ServiceChange`]s that lead to it.

pub mod objects;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddrV4},
    sync::Arc,
};

pub use objects::{
    AddressType, EndpointInfo, FieldError, ObjectName, Protocol, ServiceInfo, ServicePortSpec,
    SliceInfo, SlicePort, TargetPort,
};

/// Where an object came from, for messages: `path#document` or `api-server`.
pub type Origin = Arc<str>;

/// Something wrong with the input, reported and skipped; everything else is still served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub origin: Origin,
    /// `Kind namespace/name`, or the best name known.
    pub object: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.origin, self.object, self.message)
    }
}

/// All the objects the proxy currently knows, validated, each with its origin.
#[derive(Clone, Debug, Default)]
pub struct ObjectStore {
    pub services: BTreeMap<ObjectName, (ServiceInfo, Origin)>,
    pub slices: BTreeMap<ObjectName, (SliceInfo, Origin)>,
}

/// Identity of one port of one Service, as kube-proxy's `ServicePortName`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub service: ObjectName,
    pub port: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}/{}", self.service, self.protocol)
        } else {
            write!(f, "{}:{}/{}", self.service, self.port, self.protocol)
        }
    }
}

/// An address:port:protocol that clients connect to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.addr, self.port, self.protocol)
    }
}

/// What the datapath must do for one service port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortState {
    pub name: ServicePortName,
    pub frontend: Frontend,
    /// Endpoints that take new connections, sorted and without duplicates. Empty means
    /// "refuse": the Service exists but nothing serves it.
    pub backends: Vec<SocketAddrV4>,
}

/// The desired state of the whole node, independent of any proxy mode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    pub ports: BTreeMap<ServicePortName, Arc<ServicePortState>>,
}

impl DesiredState {
    /// Computes the desired state; problems (a named port no slice resolves, two services
    /// claiming the same frontend) are returned and the affected pieces skipped.
    pub fn build(store: &ObjectStore) -> (DesiredState, Vec<Problem>) {
        let mut problems = Vec::new();
        let mut slices_by_service: BTreeMap<&ObjectName, Vec<&(SliceInfo, Origin)>> =
            BTreeMap::new();
        for entry in store.slices.values() {
            slices_by_service
                .entry(&entry.0.service)
                .or_default()
                .push(entry);
        }

        let mut ports = BTreeMap::new();
        let mut claimed: BTreeMap<Frontend, ServicePortName> = BTreeMap::new();
        for (svc, origin) in store.services.values() {
            // IPv6 cluster IPs are served from a later release; IPv4 only for now.
            let Some(cluster_ip) = svc.cluster_ips.iter().find_map(|ip| match ip {
                IpAddr::V4(v4) => Some(*v4),
                IpAddr::V6(_) => None,
            }) else {
                continue;
            };
            let slices = slices_by_service
                .get(&svc.name)
                .map(Vec::as_slice)
                .unwrap_or_default();
            for spec in &svc.ports {
                let name = ServicePortName {
                    service: svc.name.clone(),
                    port: spec.name.clone(),
                    protocol: spec.protocol,
                };
                let frontend = Frontend {
                    addr: cluster_ip,
                    port: spec.port,
                    protocol: spec.protocol,
                };
                if let Some(owner) = claimed.get(&frontend) {
                    problems.push(Problem {
                        origin: origin.clone(),
                        object: format!("Service {}", svc.name),
                        message: format!(
                            "port {}: frontend {frontend} is already served by {owner}; skipped",
                            spec.port
                        ),
                    });
                    continue;
                }
                claimed.insert(frontend, name.clone());
                let backends = resolve_backends(spec, slices, &mut problems, &svc.name);
                ports.insert(
                    name.clone(),
                    Arc::new(ServicePortState {
                        name,
                        frontend,
                        backends,
                    }),
                );
            }
        }
        (DesiredState { ports }, problems)
    }
}

/// The ready IPv4 endpoints of one service port, with the target port resolved per slice:
/// the EndpointSlice controller writes each slice's resolved port under the service port's
/// name, and pods whose named port differs land in different slices.
fn resolve_backends(
    spec: &ServicePortSpec,
    slices: &[&(SliceInfo, Origin)],
    problems: &mut Vec<Problem>,
    service: &ObjectName,
) -> Vec<SocketAddrV4> {
    let mut backends = BTreeSet::new();
    for (slice, origin) in slices {
        if slice.address_type != AddressType::IPv4 {
            continue;
        }
        let listed = match &slice.ports {
            Some(ports) => match ports
                .iter()
                .find(|p| p.name == spec.name && p.protocol == spec.protocol)
            {
                Some(p) => p.port,
                None => continue, // this slice does not serve this service port
            },
            None => None,
        };
        let port = match (listed, &spec.target_port) {
            (Some(p), _) => p,
            (None, TargetPort::Number(n)) => *n,
            (None, TargetPort::Name(target)) => {
                problems.push(Problem {
                    origin: origin.clone(),
                    object: format!("EndpointSlice {}", slice.name),
                    message: format!(
                        "gives no port number for Service {service} port {:?}, so its \
                         targetPort {target:?} cannot be resolved; endpoints skipped for that port",
                        spec.name
                    ),
                });
                continue;
            }
        };
        for ep in &slice.endpoints {
            if !ep.ready {
                continue;
            }
            if let IpAddr::V4(addr) = ep.addr {
                backends.insert(SocketAddrV4::new(addr, port));
            }
        }
    }
    backends.into_iter().collect()
}

/// One service port that differs between two desired states.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServiceChange {
    Added(Arc<ServicePortState>),
    Updated {
        old: Arc<ServicePortState>,
        new: Arc<ServicePortState>,
    },
    Removed(Arc<ServicePortState>),
}

impl ServiceChange {
    pub fn name(&self) -> &ServicePortName {
        match self {
            ServiceChange::Added(s) | ServiceChange::Removed(s) => &s.name,
            ServiceChange::Updated { new, .. } => &new.name,
        }
    }

    /// The number of endpoints that changed, for the `endpoint_changes` metrics.
    pub fn endpoint_changes(&self) -> usize {
        match self {
            ServiceChange::Added(s) | ServiceChange::Removed(s) => s.backends.len(),
            ServiceChange::Updated { old, new } => {
                let a: BTreeSet<_> = old.backends.iter().collect();
                let b: BTreeSet<_> = new.backends.iter().collect();
                a.symmetric_difference(&b).count()
            }
        }
    }
}

/// The differences from `old` to `new`, in service-port order.
pub fn diff(old: &DesiredState, new: &DesiredState) -> Vec<ServiceChange> {
    let mut changes = Vec::new();
    for (name, new_state) in &new.ports {
        match old.ports.get(name) {
            None => changes.push(ServiceChange::Added(new_state.clone())),
            Some(old_state) if old_state != new_state => changes.push(ServiceChange::Updated {
                old: old_state.clone(),
                new: new_state.clone(),
            }),
            Some(_) => {}
        }
    }
    for (name, old_state) in &old.ports {
        if !new.ports.contains_key(name) {
            changes.push(ServiceChange::Removed(old_state.clone()));
        }
    }
    changes
}

/// Holds the state proxiers were last synced to and turns each new desired state into the
/// changes that lead to it, as kube-proxy's change trackers do.
#[derive(Debug, Default)]
pub struct ChangeTracker {
    current: DesiredState,
}

impl ChangeTracker {
    pub fn current(&self) -> &DesiredState {
        &self.current
    }

    pub fn update(&mut self, new: DesiredState) -> Vec<ServiceChange> {
        let changes = diff(&self.current, &new);
        self.current = new;
        changes
    }
}

#[cfg(test)]
mod tests;
