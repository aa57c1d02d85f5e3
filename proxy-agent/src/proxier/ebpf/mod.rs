//! The eBPF proxier: writes the service model into the datapath's hash maps.

pub mod maglev;
pub mod maps;
pub mod sync;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    time::{Duration, Instant},
};

use anyhow::Result;
use tracing::{debug, error};

use proxy_common::{
    SERVICE_FLAG_DROP_WHEN_EMPTY, SERVICE_FLAG_EXTERNAL, SERVICE_FLAG_IN_CLUSTER_SET,
    SERVICE_FLAG_MASQUERADE, SERVICE_FLAG_MASQUERADE_ALL, SERVICE_FLAG_SCOPE_IN_CLUSTER,
};

use self::{
    maps::{MapError, ServiceMaps},
    sync::{FrontendSpec, HeaderSettings, MapSync, Target},
};
use super::{FlowCleaner, Proxier, ProxyMode, SyncReport};
use crate::model::{
    stale_flows, DesiredState, FrontendState, ServiceChange, ServicePortName, ServicePortState,
    WhenEmpty,
};

/// How `SERVICE_NAMES` records a frontend's kind.
fn frontend_kind(kind: crate::model::FrontendKind) -> u8 {
    use crate::model::FrontendKind::*;
    match kind {
        ClusterIp => proxy_common::FRONTEND_KIND_CLUSTER_IP,
        NodePort => proxy_common::FRONTEND_KIND_NODE_PORT,
        ExternalIp => proxy_common::FRONTEND_KIND_EXTERNAL_IP,
        LoadBalancer => proxy_common::FRONTEND_KIND_LOAD_BALANCER,
    }
}

/// The entry sets of a frontend: its own, and the one for clients on this node when its
/// traffic policy gives them other endpoints.
fn targets(f: &FrontendState) -> impl Iterator<Item = Target> {
    let in_cluster = f
        .in_cluster
        .as_ref()
        .map(|_| Target::in_cluster(f.frontend));
    std::iter::once(Target::all(f.frontend)).chain(in_cluster)
}

pub struct EbpfProxier<M: ServiceMaps> {
    sync: MapSync<M>,
    /// Service ports whose last write failed (map full, ...): retried with backoff, and at
    /// once when they change.
    failed: BTreeMap<ServicePortName, Failed>,
    /// Set after adopting pinned maps: the next sync also removes what the previous agent
    /// programmed that is no longer desired.
    prune_on_next_sync: bool,
    /// Which service port each programmed frontend belongs to (for per-service metrics).
    names: HashMap<crate::model::Frontend, ServicePortName>,
    /// What each entry set's service id was last named in `SERVICE_NAMES`: a fingerprint
    /// of (id, name, kind), so a set whose id, service port or kind changed is named again.
    named: HashMap<Target, u64>,
    /// Names to write at the end of the sync (kept until a write succeeds).
    pending_names: HashMap<Target, (u64, u32, proxy_common::ServiceName)>,
    /// A `SERVICE_NAMES` write failed and was logged.
    names_failed: bool,
    /// Ends the node's connected UDP sockets the socket hooks gave a backend that left
    /// (`datapath::sockets`); none without the hooks.
    socket_cleaner: Option<Box<dyn FlowCleaner>>,
}

impl<M: ServiceMaps> EbpfProxier<M> {
    pub fn new(maps: M) -> Self {
        Self {
            sync: MapSync::new(maps),
            failed: BTreeMap::new(),
            prune_on_next_sync: false,
            names: HashMap::new(),
            named: HashMap::new(),
            pending_names: HashMap::new(),
            names_failed: false,
            socket_cleaner: None,
        }
    }

    /// Ends sockets of removed backends after each sync (the socket hooks are attached).
    pub fn set_socket_cleaner(&mut self, cleaner: Box<dyn FlowCleaner>) {
        self.socket_cleaner = Some(cleaner);
    }

    /// Entries of each Maglev table (`mh` frontends); see [`MapSync::set_maglev_size`].
    pub fn set_maglev_size(&mut self, size: u32) {
        self.sync.set_maglev_size(size);
    }

    /// Every programmed backend: its service port, address and id (slot in `BACKEND_STATS`).
    pub fn backend_ids(&self) -> Vec<(ServicePortName, std::net::SocketAddr, u32)> {
        self.sync
            .backend_ids()
            .filter_map(|(f, addr, id)| Some((self.names.get(&f.frontend())?.clone(), addr, id)))
            .collect()
    }

    /// How many entries [`Self::backend_ids`] would list, without listing them.
    pub fn backend_id_count(&self) -> usize {
        self.sync
            .backend_ids()
            .filter(|(f, ..)| self.names.contains_key(&f.frontend()))
            .count()
    }

    /// How many entries [`Self::service_ids`] would list, without listing them.
    pub fn service_id_count(&self) -> usize {
        self.sync
            .service_ids()
            .filter(|(f, _)| self.names.contains_key(&f.frontend()))
            .count()
    }

    /// Every programmed frontend with its id in `SERVICE_STATS` (a Local frontend's set
    /// for this node's clients has its own id, listed with the same frontend).
    pub fn frontend_ids(&self) -> Vec<(crate::model::Frontend, u32)> {
        self.sync
            .service_ids()
            .map(|(t, id)| (t.frontend(), id))
            .collect()
    }

    /// Every backend written, draining ones too: its frontend, address and id.
    pub fn frontend_backend_ids(&self) -> Vec<(crate::model::Frontend, std::net::SocketAddr, u32)> {
        self.sync
            .every_backend_id()
            .map(|(t, addr, id)| (t.frontend(), addr, id))
            .collect()
    }

    /// Every programmed service port with its id in `SERVICE_STATS`.
    pub fn service_ids(&self) -> Vec<(ServicePortName, u32)> {
        self.sync
            .service_ids()
            .filter_map(|(f, id)| Some((self.names.get(&f.frontend())?.clone(), id)))
            .collect()
    }

    /// Takes over the services a previous agent left in pinned maps (see
    /// [`MapSync::adopt`]); returns how many frontends were taken over.
    pub fn adopt(&mut self) -> Result<usize> {
        let n = self.sync.adopt()?;
        self.prune_on_next_sync = true;
        Ok(n)
    }

    pub fn map_sync(&self) -> &MapSync<M> {
        &self.sync
    }

    #[cfg(test)]
    pub fn map_sync_mut(&mut self) -> &mut MapSync<M> {
        &mut self.sync
    }

    /// The maps themselves (to inspect, or to tamper with in tests).
    pub fn maps_mut(&mut self) -> &mut M {
        self.sync.maps_mut()
    }

    /// Writes every frontend of one service port; stops at the first that fails.
    fn write_service_port(&mut self, state: &ServicePortState) -> Result<usize, MapError> {
        let mut ops = 0;
        for f in state.frontends() {
            let mut flags = state.scheduler.datapath_id() << proxy_common::SERVICE_SCHEDULER_SHIFT;
            if f.kind.is_external() {
                flags |= SERVICE_FLAG_EXTERNAL;
            }
            if f.masquerade_all {
                flags |= SERVICE_FLAG_MASQUERADE_ALL;
            }
            let header = |flags| HeaderSettings {
                flags,
                affinity_timeout: state.affinity_timeout.unwrap_or(0),
            };
            let ranges: Vec<(std::net::IpAddr, u8)> =
                f.source_ranges.iter().map(|c| (c.addr, c.prefix)).collect();
            let spec = |backends, draining, flags| FrontendSpec {
                backends,
                draining,
                header: header(flags),
                remote: &state.remote,
                source_ranges: &ranges,
                weights: &state.weights,
            };
            let mut set = |target: Target, spec: &FrontendSpec| {
                self.sync.set_with(target, spec).map_err(|e| match e {
                    MapError::Other { map, message } => MapError::Other {
                        map,
                        message: format!("{target}: {message}"),
                    },
                    e => e,
                })
            };
            // The set for clients on this node first, so the header that points to it
            // finds it (the datapath also falls back to the frontend's own set).
            let mut own = flags;
            if let Some(inner) = &f.in_cluster {
                // Pods keep their source (the node's own flows are masqueraded by the
                // kernel's choice of source at connect time).
                ops += set(
                    Target::in_cluster(f.frontend),
                    &spec(
                        &inner.backends,
                        &inner.draining,
                        flags | SERVICE_FLAG_SCOPE_IN_CLUSTER,
                    ),
                )?;
                own |= SERVICE_FLAG_IN_CLUSTER_SET;
            }
            if f.when_empty == WhenEmpty::Drop {
                own |= SERVICE_FLAG_DROP_WHEN_EMPTY;
            }
            if f.masquerade {
                own |= SERVICE_FLAG_MASQUERADE;
            }
            ops += set(
                Target::all(f.frontend),
                &spec(&f.backends, &f.draining, own),
            )?;
            self.names.insert(f.frontend, state.name.clone());
            let text = format!("{}:{}", state.name.service, state.name.port);
            let kind = frontend_kind(f.kind);
            for target in targets(&f) {
                let Some(id) = self.sync.service_id(&target) else {
                    continue;
                };
                let fingerprint = {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    (id, &text, kind).hash(&mut h);
                    h.finish()
                };
                if self.named.get(&target) != Some(&fingerprint) {
                    let name = proxy_common::ServiceName::new(&text, kind);
                    self.pending_names.insert(target, (fingerprint, id, name));
                }
            }
        }
        Ok(ops)
    }

    /// Forgets an entry set's name record (it was removed from the maps).
    fn unname(&mut self, target: &Target) {
        self.named.remove(target);
        self.pending_names.remove(target);
    }

    /// Writes the names of the service ids this sync gave frontends (best effort: only
    /// `inspect` reads them; a failure is logged once, and the names are written again
    /// when those frontends are).
    fn write_names(&mut self) {
        if self.pending_names.is_empty() {
            return;
        }
        let names: Vec<(u32, proxy_common::ServiceName)> = self
            .pending_names
            .values()
            .map(|(_, id, name)| (*id, *name))
            .collect();
        match self.sync.maps_mut().set_names(&names) {
            Ok(()) => {
                self.names_failed = false;
                for (target, (fingerprint, ..)) in self.pending_names.drain() {
                    self.named.insert(target, fingerprint);
                }
            }
            // Kept: written with the next sync's.
            Err(e) if !std::mem::replace(&mut self.names_failed, true) => {
                tracing::warn!("naming service ids for `inspect` (SERVICE_NAMES): {e}")
            }
            Err(_) => {}
        }
    }

    /// Service ports not currently programmed (as asked), with the reason.
    pub fn failed(&self) -> BTreeMap<&ServicePortName, &str> {
        self.failed
            .iter()
            .map(|(name, f)| (name, f.message.as_str()))
            .collect()
    }
}

/// A service port whose write failed.
#[derive(Debug)]
struct Failed {
    message: String,
    attempts: u32,
    retry_at: Instant,
}

/// The wait before retrying a service port that failed `attempts` times: 1 s, doubling, at
/// most 5 min, so a Service that cannot fit costs a write attempt now and then, not at
/// every sync.
fn retry_backoff(attempts: u32) -> Duration {
    Duration::from_secs(1u64 << attempts.saturating_sub(1).min(9)).min(Duration::from_secs(300))
}

impl<M: ServiceMaps> Proxier for EbpfProxier<M> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ebpf
    }

    fn sync(&mut self, desired: &DesiredState, changes: &[ServiceChange]) -> Result<SyncReport> {
        let mut report = SyncReport::default();
        if std::mem::take(&mut self.prune_on_next_sync) {
            let wanted: HashSet<Target> = desired
                .ports
                .values()
                .flat_map(|s| s.frontends())
                .flat_map(|f| targets(&f).collect::<Vec<_>>())
                .collect();
            let stale: Vec<Target> = self
                .sync
                .frontends()
                .filter(|f| !wanted.contains(f))
                .copied()
                .collect();
            for f in stale {
                self.names.remove(&f.frontend());
                self.unname(&f);
                debug!(frontend = %f, "removing what the previous agent programmed");
                if let Err(e) = self.sync.remove(f) {
                    error!(frontend = %f, "removing from the datapath: {e}");
                }
            }
        }
        // Removals first: a frontend that moves from one Service to another is freed
        // before it is claimed again.
        for change in changes {
            let (old, kept): (_, HashSet<Target>) = match change {
                ServiceChange::Removed(old) => (old, HashSet::new()),
                ServiceChange::Updated { old, new } => {
                    (old, new.frontends().iter().flat_map(targets).collect())
                }
                ServiceChange::Added(_) => continue,
            };
            if kept.is_empty() {
                self.failed.remove(&old.name);
            }
            for f in old
                .frontends()
                .iter()
                .flat_map(targets)
                .filter(|t| !kept.contains(t))
            {
                if !kept.contains(&Target::all(f.frontend())) {
                    self.names.remove(&f.frontend());
                }
                self.unname(&f);
                if let Err(e) = self.sync.remove(f) {
                    error!(service = %old.name, frontend = %f, "removing from the datapath: {e}");
                }
            }
        }
        let mut to_write: Vec<&ServicePortName> = changes
            .iter()
            .filter(|c| !matches!(c, ServiceChange::Removed(_)))
            .map(ServiceChange::name)
            .collect();
        // Earlier failures are retried with their current desired state, once their backoff
        // has passed; at once when they changed (they are in `changes`) or when this sync
        // removed a service port, which may have made the room they lacked (not at every
        // endpoint change: a retry that fails again costs the port a moment of service).
        let now = Instant::now();
        let room_made = changes
            .iter()
            .any(|c| matches!(c, ServiceChange::Removed(_)));
        let retries: Vec<ServicePortName> = self
            .failed
            .iter()
            .filter(|(_, f)| room_made || f.retry_at <= now)
            .map(|(name, _)| name.clone())
            .collect();
        to_write.extend(retries.iter());
        to_write.sort();
        to_write.dedup();
        for name in to_write {
            let Some(state) = desired.ports.get(name) else {
                self.failed.remove(name);
                continue;
            };
            match self.write_service_port(state) {
                Ok(ops) => {
                    debug!(service = %name, frontends = state.external.len() + 1, backends = state.backends.len(), ops, "programmed");
                    self.failed.remove(name);
                    report.services_written += 1;
                }
                Err(e) => {
                    let attempts = self.failed.get(name).map_or(0, |f| f.attempts) + 1;
                    let wait = retry_backoff(attempts);
                    error!(
                        service = %name,
                        attempts,
                        retry_in_s = wait.as_secs(),
                        "not programmed (what served before still does): {e}"
                    );
                    *report.failure_reasons.entry(e.reason()).or_default() += 1;
                    self.failed.insert(
                        name.clone(),
                        Failed {
                            message: e.to_string(),
                            attempts,
                            retry_at: now + wait,
                        },
                    );
                }
            }
        }
        self.write_names();
        // Every port not programmed as asked, retried now or waiting for its turn.
        report.services_failed = self.failed.len();
        if let Some(cleaner) = self.socket_cleaner.as_mut() {
            let flows = stale_flows(changes, desired);
            if !flows.is_empty() {
                match cleaner.delete(&flows) {
                    Ok(n) => report.flows_deleted = n,
                    Err(e) => tracing::warn!("ending the sockets of removed backends: {e:#}"),
                }
            }
        }
        Ok(report)
    }

    fn sync_full(&mut self, desired: &DesiredState) -> Result<SyncReport> {
        self.sync.reload_from_maps()?;
        self.prune_on_next_sync = true;
        let all: Vec<ServiceChange> = desired
            .ports
            .values()
            .map(|s| ServiceChange::Added(s.clone()))
            .collect();
        self.sync(desired, &all)
    }

    fn programmed(&self) -> (usize, usize) {
        self.sync.counts()
    }
}

#[cfg(test)]
mod tests;
