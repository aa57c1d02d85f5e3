//! Proxiers: one per proxy mode, all fed from the one service model.

pub mod ebpf;

use std::{fmt, str::FromStr};

use anyhow::Result;

use crate::model::{DesiredState, ServiceChange};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProxyMode {
    Ebpf,
}

impl ProxyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Ebpf => "ebpf",
        }
    }
}

impl fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ProxyMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            // kube-proxy's empty mode means "the platform default"; ours is eBPF.
            "" | "ebpf" => Ok(ProxyMode::Ebpf),
            "iptables" | "ipvs" | "nftables" | "userspace" => Err(format!(
                "proxy mode {s:?} is not available in this build yet (available: ebpf)"
            )),
            other => Err(format!(
                "unknown proxy mode {other:?} (expected ebpf, iptables, ipvs, nftables or userspace)"
            )),
        }
    }
}

/// What one sync did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Service ports whose datapath state was written.
    pub services_written: usize,
    /// Service ports that could not be programmed (each also logged with its reason); the
    /// rest of the sync still happened.
    pub services_failed: usize,
}

/// A datapath that serves the desired state.
pub trait Proxier {
    fn mode(&self) -> ProxyMode;

    /// Brings the datapath from `changes`' old states to `desired`. `changes` lists exactly
    /// the service ports that differ from the previous call, so a proxier that keeps its own
    /// record can write only those; `desired` is the whole state for full resyncs.
    fn sync(&mut self, desired: &DesiredState, changes: &[ServiceChange]) -> Result<SyncReport>;

    /// Reconciles the whole datapath with `desired` (periodically, as kube-proxy's
    /// syncPeriod): corrects anything that drifted, still writing only differences.
    fn sync_full(&mut self, desired: &DesiredState) -> Result<SyncReport>;

    /// (service ports, backends) programmed.
    fn programmed(&self) -> (usize, usize);
}
