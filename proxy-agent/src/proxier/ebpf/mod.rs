//! The eBPF proxier: writes the service model into the datapath's hash maps.

pub mod maps;
pub mod sync;

use std::collections::{BTreeMap, HashMap, HashSet};

use anyhow::Result;
use tracing::{debug, error};

use self::{maps::ServiceMaps, sync::MapSync};
use super::{Proxier, ProxyMode, SyncReport};
use crate::model::{DesiredState, Frontend, ServiceChange, ServicePortName};

pub struct EbpfProxier<M: ServiceMaps> {
    sync: MapSync<M>,
    /// Service ports whose last write failed (map full, ...): retried on every sync.
    failed: BTreeMap<ServicePortName, String>,
    /// Set after adopting pinned maps: the next sync also removes what the previous agent
    /// programmed that is no longer desired.
    prune_on_next_sync: bool,
    /// Which service port each programmed frontend belongs to (for per-service metrics).
    names: HashMap<Frontend, ServicePortName>,
}

impl<M: ServiceMaps> EbpfProxier<M> {
    pub fn new(maps: M) -> Self {
        Self {
            sync: MapSync::new(maps),
            failed: BTreeMap::new(),
            prune_on_next_sync: false,
            names: HashMap::new(),
        }
    }

    /// Every programmed backend: its service port, address and id (slot in `BACKEND_STATS`).
    pub fn backend_ids(&self) -> Vec<(ServicePortName, std::net::SocketAddrV4, u32)> {
        self.sync
            .backend_ids()
            .filter_map(|(f, addr, id)| Some((self.names.get(f)?.clone(), addr, id)))
            .collect()
    }

    /// Every programmed service port with its id in `SERVICE_STATS`.
    pub fn service_ids(&self) -> Vec<(ServicePortName, u32)> {
        self.sync
            .service_ids()
            .filter_map(|(f, id)| Some((self.names.get(f)?.clone(), id)))
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

    /// The maps themselves (to inspect, or to tamper with in tests).
    pub fn maps_mut(&mut self) -> &mut M {
        self.sync.maps_mut()
    }

    /// Service ports not currently programmed, with the reason.
    pub fn failed(&self) -> &BTreeMap<ServicePortName, String> {
        &self.failed
    }
}

impl<M: ServiceMaps> Proxier for EbpfProxier<M> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ebpf
    }

    fn sync(&mut self, desired: &DesiredState, changes: &[ServiceChange]) -> Result<SyncReport> {
        let mut report = SyncReport::default();
        if std::mem::take(&mut self.prune_on_next_sync) {
            let wanted: HashSet<Frontend> = desired.ports.values().map(|s| s.frontend).collect();
            let stale: Vec<Frontend> = self
                .sync
                .frontends()
                .filter(|f| !wanted.contains(f))
                .copied()
                .collect();
            for f in stale {
                self.names.remove(&f);
                debug!(frontend = %f, "removing what the previous agent programmed");
                if let Err(e) = self.sync.remove(&f) {
                    error!(frontend = %f, "removing from the datapath: {e}");
                }
            }
        }
        // Removals first: a frontend that moves from one Service to another is freed
        // before it is claimed again.
        for change in changes {
            let old = match change {
                ServiceChange::Removed(old) => old,
                ServiceChange::Updated { old, new } if old.frontend != new.frontend => old,
                _ => continue,
            };
            self.failed.remove(&old.name);
            self.names.remove(&old.frontend);
            if let Err(e) = self.sync.remove(&old.frontend) {
                error!(service = %old.name, frontend = %old.frontend, "removing from the datapath: {e}");
            }
        }
        let mut to_write: Vec<&ServicePortName> = changes
            .iter()
            .filter(|c| !matches!(c, ServiceChange::Removed(_)))
            .map(ServiceChange::name)
            .collect();
        // Earlier failures are retried with their current desired state.
        let retries: Vec<ServicePortName> = self.failed.keys().cloned().collect();
        to_write.extend(retries.iter());
        to_write.sort();
        to_write.dedup();
        for name in to_write {
            let Some(state) = desired.ports.get(name) else {
                self.failed.remove(name);
                continue;
            };
            match self.sync.set(&state.frontend, &state.backends) {
                Ok(ops) => {
                    self.names.insert(state.frontend, name.clone());
                    debug!(service = %name, frontend = %state.frontend, backends = state.backends.len(), ops, "programmed");
                    self.failed.remove(name);
                    report.services_written += 1;
                }
                Err(e) => {
                    error!(service = %name, frontend = %state.frontend, "not programmed: {e}");
                    self.failed.insert(name.clone(), e.to_string());
                    report.services_failed += 1;
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
