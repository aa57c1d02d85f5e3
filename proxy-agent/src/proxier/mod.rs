//! Proxiers: one per proxy mode, all fed from the one service model.

pub mod ebpf;
pub mod iptables;
pub mod naming;
pub mod nftables;

use std::{fmt, str::FromStr};

use anyhow::Result;

use crate::model::{DesiredState, ServiceChange, StaleFlow};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProxyMode {
    Ebpf,
    Iptables,
    Nftables,
    /// Resolved at start to the first mode the kernel supports (see `main`); never runs.
    Auto,
}

impl ProxyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Ebpf => "ebpf",
            ProxyMode::Iptables => "iptables",
            ProxyMode::Nftables => "nftables",
            ProxyMode::Auto => "auto",
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
            "iptables" => Ok(ProxyMode::Iptables),
            "nftables" => Ok(ProxyMode::Nftables),
            "auto" => Ok(ProxyMode::Auto),
            "ipvs" | "userspace" => Err(format!(
                "proxy mode {s:?} is not available in this build yet (available: ebpf, iptables, nftables)"
            )),
            other => Err(format!(
                "unknown proxy mode {other:?} (expected auto, ebpf, iptables, ipvs, nftables or userspace)"
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
    /// Whether the whole datapath was written (a full sync, or one the proxier needed).
    pub full: bool,
    /// Kernel conntrack entries of ended flows deleted after the sync.
    pub flows_deleted: usize,
}

/// Ends flows in the kernel's connection tracking (see [`crate::model::stale_flows`]).
pub trait FlowCleaner: Send {
    /// Deletes the entries of `flows`; returns how many there were.
    fn delete(&mut self, flows: &[StaleFlow]) -> Result<usize>;
}

/// A [`FlowCleaner`] that only records what it was asked (tests).
#[derive(Clone, Default)]
pub struct RecordedFlows(pub std::sync::Arc<std::sync::Mutex<Vec<StaleFlow>>>);

impl FlowCleaner for RecordedFlows {
    fn delete(&mut self, flows: &[StaleFlow]) -> Result<usize> {
        let mut seen = self.0.lock().expect("not poisoned");
        seen.extend_from_slice(flows);
        Ok(flows.len())
    }
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

    /// The node's addresses that masqueraded flows leave with (its first InternalIP of each
    /// family, from the Node object), before each sync. Proxiers that translate sources
    /// themselves use them; the kernel's MASQUERADE would pick the outgoing link's.
    fn set_masquerade_addresses(
        &mut self,
        _v4: Option<std::net::Ipv4Addr>,
        _v6: Option<std::net::Ipv6Addr>,
    ) {
    }
}
