//! Proxiers: one per proxy mode, all fed from the one service model.

pub mod ebpf;
pub mod iptables;
pub mod ipvs;
pub mod naming;
pub mod nftables;
#[cfg(test)]
pub(crate) mod test_states;
pub mod userspace;

use std::{fmt, str::FromStr};

use anyhow::Result;

use crate::model::{
    stale_flows, DesiredState, IpFamily, ServiceChange, ServicePortName, StaleFlow,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProxyMode {
    Ebpf,
    Iptables,
    Ipvs,
    Nftables,
    Userspace,
    /// Resolved at start to the first mode the kernel supports (see `agent::modes::choose`); never runs.
    Auto,
}

impl ProxyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Ebpf => "ebpf",
            ProxyMode::Iptables => "iptables",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Nftables => "nftables",
            ProxyMode::Userspace => "userspace",
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
            "userspace" => Ok(ProxyMode::Userspace),
            "ipvs" => Ok(ProxyMode::Ipvs),
            "auto" => Ok(ProxyMode::Auto),
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
    /// Write attempts that failed in this sync, by reason (`services_full`, ...):
    /// `proxy_agent_sync_failures_total{reason}`.
    pub failure_reasons: std::collections::BTreeMap<String, usize>,
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

    /// Reconciles the whole datapath with `desired` (hourly, as kube-proxy's
    /// `FullSyncPeriod`): corrects anything that drifted, still writing only differences.
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

    /// How the node's pods are told from other clients (`detectLocalMode`, resolved with
    /// the Node object), before each sync.
    fn set_local_traffic(&mut self, _local: &crate::model::local::LocalTraffic) {}
}

/// Both address families, in the order per-family state is kept.
pub(crate) const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

/// Where `family`'s state is in a per-family array.
pub(crate) fn family_index(family: IpFamily) -> usize {
    match family {
        IpFamily::V4 => 0,
        IpFamily::V6 => 1,
    }
}

/// What the netfilter proxiers (iptables, nftables, and ipvs with its rules) have in common: one set of tables per
/// address family, each written whole when it needs to be and otherwise only for the
/// changed service ports, and the stale flows ended after a sync.
pub trait FamilyTables {
    /// Whether `family`'s next write must be a full one (first sync, or the last failed).
    fn needs_full(&self, family: IpFamily) -> bool;

    /// Whether a write of `family` towards `desired` will be full whatever changed: by
    /// default [`FamilyTables::needs_full`]; a proxier whose layout depends on the number
    /// of service ports says so here too.
    fn full_needed(&self, family: IpFamily, _desired: &DesiredState) -> bool {
        self.needs_full(family)
    }

    /// Writes `family`: everything if `changed` is `None` (or the family needs it), else
    /// what the `changed` service ports need. Returns the service ports written.
    fn sync_family(
        &mut self,
        family: IpFamily,
        desired: &DesiredState,
        changed: Option<&std::collections::BTreeSet<ServicePortName>>,
    ) -> Result<usize>;

    fn flow_cleaner(&mut self) -> &mut dyn FlowCleaner;

    /// Where `family`'s masquerade address is kept (written by full syncs only).
    fn masquerade_addr_mut(&mut self, family: IpFamily) -> &mut Option<std::net::IpAddr>;

    /// Where `family`'s pod detector is kept (written by full syncs only).
    fn local_mut(&mut self, family: IpFamily) -> &mut Option<crate::model::local::LocalMatch>;

    /// Makes `family`'s next write a full one.
    fn require_full(&mut self, family: IpFamily);
}

/// [`Proxier::set_local_traffic`] for the netfilter proxiers: a family whose detector
/// changed is rewritten whole at its next sync (every cluster IP's rules use it).
pub fn set_family_local_traffic(
    tables: &mut impl FamilyTables,
    local: &crate::model::local::LocalTraffic,
) {
    for family in FAMILIES {
        let wanted = local.of(family).cloned();
        let kept = tables.local_mut(family);
        if *kept != wanted {
            *kept = wanted;
            tables.require_full(family);
        }
    }
}

/// [`Proxier::set_masquerade_addresses`] for the netfilter proxiers: a family whose
/// address changed is rewritten whole at its next sync, as the source-NAT rule is part
/// of the fixed chains only full syncs write.
pub fn set_family_masquerade_addresses(
    tables: &mut impl FamilyTables,
    v4: Option<std::net::Ipv4Addr>,
    v6: Option<std::net::Ipv6Addr>,
) {
    for (family, addr) in [
        (IpFamily::V4, v4.map(std::net::IpAddr::from)),
        (IpFamily::V6, v6.map(std::net::IpAddr::from)),
    ] {
        let kept = tables.masquerade_addr_mut(family);
        if *kept != addr {
            *kept = addr;
            tables.require_full(family);
        }
    }
}

/// What a family's write starts from: each of its service ports' rules, regenerated with
/// `build` where `full` or the port is in `changed`, kept from `previous` otherwise; the
/// ports to write; and every rules value that was replaced or whose port is gone (their
/// objects may be stale now).
pub struct Regenerated<R> {
    pub current: std::collections::BTreeMap<ServicePortName, R>,
    pub write: Vec<ServicePortName>,
    /// What the rewritten and removed service ports had, by name.
    pub replaced: Vec<(ServicePortName, R)>,
}

pub fn regenerate<R>(
    mut previous: std::collections::BTreeMap<ServicePortName, R>,
    desired: &DesiredState,
    family: IpFamily,
    full: bool,
    changed: Option<&std::collections::BTreeSet<ServicePortName>>,
    build: impl Fn(&crate::model::ServicePortState) -> R,
) -> Regenerated<R> {
    let mut out = Regenerated {
        current: std::collections::BTreeMap::new(),
        write: Vec::new(),
        replaced: Vec::new(),
    };
    for (name, port) in desired.ports.iter().filter(|(n, _)| n.family == family) {
        let rewrite = full || changed.is_some_and(|c| c.contains(name));
        let rules = match previous.remove(name) {
            Some(old) if !rewrite => old,
            old => {
                out.replaced.extend(old.map(|o| (name.clone(), o)));
                out.write.push(name.clone());
                build(port)
            }
        };
        out.current.insert(name.clone(), rules);
    }
    out.replaced.extend(previous);
    out
}

/// A sync of both families' tables (`changes` `None`: a full one), then the kernel's
/// conntrack entries of the flows that must end.
pub fn sync_by_family(
    tables: &mut impl FamilyTables,
    desired: &DesiredState,
    changes: Option<&[ServiceChange]>,
) -> Result<SyncReport> {
    let changed: Option<std::collections::BTreeSet<ServicePortName>> =
        changes.map(|c| c.iter().map(|c| c.name().clone()).collect());
    let mut report = SyncReport::default();
    let mut errors = Vec::new();
    for family in FAMILIES {
        let full = changed.is_none() || tables.full_needed(family, desired);
        let touched = full
            || changed
                .as_ref()
                .is_some_and(|c| c.iter().any(|n| n.family == family));
        if !touched {
            continue;
        }
        report.full |= full;
        match tables.sync_family(family, desired, changed.as_ref()) {
            Ok(n) => report.services_written += n,
            Err(e) => {
                report.services_failed +=
                    desired.ports.keys().filter(|n| n.family == family).count();
                errors.push(e);
            }
        }
    }
    if let Some(e) = errors.into_iter().next() {
        return Err(e);
    }
    if let Some(changes) = changes {
        let flows = stale_flows(changes, desired);
        if !flows.is_empty() {
            match tables.flow_cleaner().delete(&flows) {
                Ok(n) => {
                    report.flows_deleted = n;
                    tracing::debug!(entries = n, "stale conntrack entries deleted");
                }
                Err(e) => tracing::warn!("deleting stale conntrack entries: {e:#}"),
            }
        }
    }
    Ok(report)
}
