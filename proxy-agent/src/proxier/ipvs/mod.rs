//! The ipvs proxier, as kube-proxy's ipvs mode: service addresses on the dummy interface
//! `kube-ipvs0` (local routes on `lo` where the kernel has no dummy driver), one IPVS
//! virtual server per frontend with its endpoints as NAT real servers (programmed over
//! generic netlink, [`crate::proxier::ipvs::netlink`]; `ipvsadm -Ln` shows them), and the few
//! iptables rules IPVS needs around it, which match ipsets ([`ipset`]) rather than growing
//! with the services:
//!
//! ```text
//! nat     PREROUTING, OUTPUT -> KUBE-SERVICES
//!         KUBE-SERVICES   set KUBE-MASQUERADE-ALL            -> KUBE-MARK-MASQ
//!                         ! -s <cluster CIDR>, KUBE-CLUSTER-IP -> KUBE-MARK-MASQ
//!                         from this node, KUBE-CLUSTER-IP / KUBE-EXTERNAL-SERVICE -> KUBE-MARK-MASQ
//!                         KUBE-EXTERNAL-MASQ                 -> mark "masquerade if remote"
//!         POSTROUTING -> KUBE-POSTROUTING: KUBE-LOOP-BACK (hairpin) and remote endpoints of
//!                        marked flows are masqueraded, with what KUBE-MARK-MASQ marked
//! filter  INPUT, FORWARD, OUTPUT (new flows) -> KUBE-SERVICES: refusals, drops, source
//!         ranges of frontends (IPVS sees packets after the filter table's INPUT)
//! ```
//!
//! The model decides everything (endpoints per frontend, draining, affinity, masquerade);
//! this module spells it for IPVS. Partial syncs touch only the changed service ports'
//! virtual servers and the changed set entries; full syncs compare with what the kernel
//! holds and correct it.

pub mod ipset;
pub mod netlink;
pub mod plan;

use crate::model::local::{LocalMatch, LocalTraffic};
use crate::proxier::iptables::rules::local_match;
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

use anyhow::{Context, Result};

use self::{
    ipset::{change_input, full_input, IpSets, SetEntries, SetKind},
    plan::{plan, PortPlan},
};
use super::{
    family_index as index,
    iptables::{forward_chain, hooks, masquerade_chains, rules::RuleContext, tables::RuleTables},
    regenerate, set_family_local_traffic, set_family_masquerade_addresses, sync_by_family,
    FamilyTables, FlowCleaner, Proxier, ProxyMode, Regenerated, SyncReport, FAMILIES,
};
use crate::{
    kernel::local_routes::LocalRoutes,
    kernel::nlattr::errno,
    model::{Cidr, DesiredState, Frontend, IpFamily, ServiceChange, ServicePortName},
    proxier::ipvs::netlink::{Ipvs, IpvsTimeouts, RealServer, VirtualServer},
};

/// The iptables chains the ipvs mode writes (nat and filter); other kube-proxy-style
/// chains (the iptables mode's) are removed when it starts.
pub const IPTABLES_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-FORWARD",
];

/// The ipvs section of the configuration that the proxier itself applies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IpvsOptions {
    /// `ipvs.excludeCIDRs`: virtual servers on these addresses are someone else's; full
    /// syncs and cleanup leave them alone.
    pub exclude_cidrs: Vec<Cidr>,
    /// `ipvs.tcpTimeout`, `tcpFinTimeout`, `udpTimeout` (0: the kernel's).
    pub timeouts: IpvsTimeouts,
}

#[derive(Default)]
struct FamilyState {
    plans: BTreeMap<ServicePortName, PortPlan>,
    needs_full: bool,
    addresses: BTreeSet<IpAddr>,
    sets: SetEntries,
    /// The last rules written (without the hooks), to skip a restore that changes nothing.
    rules: String,
}

pub struct IpvsProxier<T: RuleTables, S: IpSets> {
    ipvs: Box<dyn Ipvs>,
    addresses: Box<dyn LocalRoutes>,
    tables: T,
    sets: S,
    flows: Box<dyn FlowCleaner>,
    contexts: [RuleContext; 2],
    families: [FamilyState; 2],
    options: IpvsOptions,
    timeouts_set: bool,
    /// Syncs that failed since start.
    pub failures: u64,
}

/// The kernel facilities the ipvs proxier programs.
pub struct IpvsKernel<T: RuleTables, S: IpSets> {
    pub ipvs: Box<dyn Ipvs>,
    /// Where service addresses are made local (`kube-ipvs0`, or routes on `lo`).
    pub addresses: Box<dyn LocalRoutes>,
    pub tables: T,
    pub sets: S,
    pub flows: Box<dyn FlowCleaner>,
}

impl<T: RuleTables, S: IpSets> IpvsProxier<T, S> {
    pub fn new(
        kernel: IpvsKernel<T, S>,
        masquerade_bit: u32,
        local: &LocalTraffic,
        options: IpvsOptions,
    ) -> Self {
        let IpvsKernel {
            ipvs,
            addresses,
            tables,
            sets,
            flows,
        } = kernel;
        IpvsProxier {
            ipvs,
            addresses,
            tables,
            sets,
            flows,
            contexts: FAMILIES.map(|f| RuleContext::new(masquerade_bit, local.of(f).cloned())),
            families: FAMILIES.map(|_| FamilyState {
                needs_full: true,
                ..Default::default()
            }),
            options,
            timeouts_set: false,
            failures: 0,
        }
    }

    /// Whether forwarded INVALID packets are dropped (kube-proxy's rule, left out when
    /// `conntrack.tcpBeLiberal` makes conntrack accept out-of-window segments).
    pub fn set_drop_invalid(&mut self, drop: bool) {
        for ctx in &mut self.contexts {
            ctx.drop_invalid = drop;
        }
    }

    pub fn tables(&self) -> &T {
        &self.tables
    }

    /// Virtual servers programmed (both families).
    pub fn virtual_servers(&self) -> usize {
        self.families
            .iter()
            .flat_map(|f| f.plans.values())
            .map(|p| p.servers.len())
            .sum()
    }

    fn excluded(&self, addr: IpAddr) -> bool {
        self.options.exclude_cidrs.iter().any(|c| c.contains(addr))
    }

    fn write_family(
        &mut self,
        family: IpFamily,
        desired: &DesiredState,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<usize> {
        let i = index(family);
        let full = changed.is_none() || self.families[i].needs_full;
        if full && !self.timeouts_set {
            self.timeouts_set = true;
            if self.options.timeouts != IpvsTimeouts::default() {
                if let Err(e) = self.ipvs.set_timeouts(self.options.timeouts) {
                    tracing::warn!("{e:#}");
                }
            }
        }
        let local = self.contexts[i].local.clone();
        let Regenerated {
            current,
            write,
            replaced,
        } = regenerate(
            std::mem::take(&mut self.families[i].plans),
            desired,
            family,
            full,
            changed,
            |s| plan(s, local.as_ref()),
        );
        let replaced: Vec<PortPlan> = replaced.into_iter().map(|(_, p)| p).collect();
        let result = self.apply(family, &current, &write, &replaced, full);
        let state = &mut self.families[i];
        state.plans = current;
        match result {
            Ok(()) => {
                state.needs_full = false;
                Ok(write.len())
            }
            Err(e) => {
                state.needs_full = true;
                self.failures += 1;
                Err(e.context("the ipvs sync failed; the next one compares everything"))
            }
        }
    }

    fn apply(
        &mut self,
        family: IpFamily,
        current: &BTreeMap<ServicePortName, PortPlan>,
        write: &[ServicePortName],
        replaced: &[PortPlan],
        full: bool,
    ) -> Result<()> {
        // Addresses first: a virtual server's address must be local before it is served.
        self.write_addresses(family, current, full)?;
        self.write_servers(family, current, write, replaced, full)?;
        self.write_sets(family, current, full)?;
        self.write_rules(family, current, full)
    }

    fn write_addresses(
        &mut self,
        family: IpFamily,
        current: &BTreeMap<ServicePortName, PortPlan>,
        full: bool,
    ) -> Result<()> {
        let wanted: BTreeSet<IpAddr> = current
            .values()
            .flat_map(|p| p.addresses.iter().copied())
            .collect();
        let i = index(family);
        let have = if full {
            self.addresses
                .list()?
                .into_iter()
                .filter(|a| IpFamily::of(*a) == family)
                .collect()
        } else {
            std::mem::take(&mut self.families[i].addresses)
        };
        for addr in wanted.difference(&have) {
            self.addresses.add(*addr)?;
        }
        for addr in have.difference(&wanted) {
            self.addresses.remove(*addr)?;
        }
        self.families[i].addresses = wanted;
        Ok(())
    }

    fn write_servers(
        &mut self,
        family: IpFamily,
        current: &BTreeMap<ServicePortName, PortPlan>,
        write: &[ServicePortName],
        replaced: &[PortPlan],
        full: bool,
    ) -> Result<()> {
        // What each frontend held before this sync: the kernel's (full) or the replaced
        // plans' (partial).
        let mut before: BTreeMap<Frontend, (VirtualServer, Option<Vec<RealServer>>)> =
            BTreeMap::new();
        if full {
            for vs in self.ipvs.virtual_servers()? {
                if vs.frontend.family() == family {
                    before.insert(vs.frontend, (vs, None));
                }
            }
        } else {
            for (vs, reals) in replaced.iter().flat_map(|p| p.servers.iter()) {
                before.insert(vs.frontend, (vs.clone(), Some(reals.clone())));
            }
        }
        let wanted: Vec<&(VirtualServer, Vec<RealServer>)> = if full {
            current.values().flat_map(|p| p.servers.iter()).collect()
        } else {
            write
                .iter()
                .filter_map(|n| current.get(n))
                .flat_map(|p| p.servers.iter())
                .collect()
        };
        let mut errors = Vec::new();
        for (vs, reals) in &wanted {
            if let Err(e) = self.write_server(vs, reals, before.remove(&vs.frontend)) {
                errors.push(e);
            }
        }
        // What is left was held before and is not wanted by a written port; a frontend can
        // move to a service port this sync did not write, so check them all.
        if !before.is_empty() {
            let kept: BTreeSet<Frontend> = current
                .values()
                .flat_map(|p| p.servers.iter().map(|(vs, _)| vs.frontend))
                .collect();
            for frontend in before.keys() {
                if kept.contains(frontend) || self.excluded(frontend.addr) {
                    continue;
                }
                if let Err(e) = self.ipvs.delete_virtual_server(frontend) {
                    errors.push(e);
                }
            }
        }
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Makes one virtual server and its real servers as wanted, from what it held before
    /// (`None`: nothing known; real servers `None`: ask the kernel).
    fn write_server(
        &mut self,
        vs: &VirtualServer,
        reals: &[RealServer],
        before: Option<(VirtualServer, Option<Vec<RealServer>>)>,
    ) -> Result<()> {
        let had: Vec<RealServer> = match before {
            Some((old, old_reals)) => {
                if old != *vs {
                    self.ipvs.update_virtual_server(vs)?;
                }
                match old_reals {
                    Some(r) => r,
                    None => self.ipvs.real_servers(&vs.frontend)?,
                }
            }
            None => match self.ipvs.add_virtual_server(vs) {
                Ok(()) => Vec::new(),
                // Held by a port this sync did not see go (a partial sync after a move).
                Err(e) if errno(&e) == Some(libc::EEXIST) => {
                    self.ipvs.update_virtual_server(vs)?;
                    self.ipvs.real_servers(&vs.frontend)?
                }
                Err(e) => return Err(e),
            },
        };
        for r in reals {
            match had.iter().find(|h| h.addr == r.addr) {
                None => self.ipvs.add_real_server(&vs.frontend, r)?,
                Some(h) if h.weight != r.weight => self.ipvs.update_real_server(&vs.frontend, r)?,
                Some(_) => {}
            }
        }
        for h in &had {
            if !reals.iter().any(|r| r.addr == h.addr) {
                self.ipvs.delete_real_server(&vs.frontend, h.addr)?;
            }
        }
        Ok(())
    }

    fn write_sets(
        &mut self,
        family: IpFamily,
        current: &BTreeMap<ServicePortName, PortPlan>,
        full: bool,
    ) -> Result<()> {
        let mut wanted = SetEntries::new();
        for kind in SetKind::ALL {
            wanted.insert(kind, BTreeSet::new());
        }
        for (kind, entry) in current.values().flat_map(|p| p.entries.iter()) {
            wanted
                .get_mut(kind)
                .expect("every kind")
                .insert(entry.clone());
        }
        let i = index(family);
        let input = if full {
            full_input(family, &wanted)
        } else {
            change_input(family, &self.families[i].sets, &wanted)
        };
        if !input.is_empty() {
            self.sets.restore(&input)?;
        }
        self.families[i].sets = wanted;
        Ok(())
    }

    fn write_rules(
        &mut self,
        family: IpFamily,
        current: &BTreeMap<ServicePortName, PortPlan>,
        full: bool,
    ) -> Result<()> {
        let i = index(family);
        let ctx = &self.contexts[i];
        let plain = rules_input(ctx, family, current, None);
        if full {
            let nat = self.tables.save(family, "nat")?;
            let filter = self.tables.save(family, "filter")?;
            let input = rules_input(ctx, family, current, Some((&nat, &filter)));
            self.tables.restore(family, &input)?;
        } else if plain != self.families[i].rules {
            self.tables.restore(family, &plain)?;
        }
        self.families[i].rules = plain;
        Ok(())
    }
}

/// The `iptables-restore --noflush` input of one family; `saved` (full syncs): the nat and
/// filter tables as they are, to add the hooks where missing and rewrite the fixed chains.
fn rules_input(
    ctx: &RuleContext,
    family: IpFamily,
    plans: &BTreeMap<ServicePortName, PortPlan>,
    saved: Option<(&str, &str)>,
) -> String {
    let set = |k: SetKind| k.name(family);
    let mark = ctx.masquerade_mark;
    let remote = ctx.remote_masquerade_mark;
    let mut out = String::from("*nat\n:KUBE-SERVICES - [0:0]\n");
    if let Some((nat, _)) = saved {
        out.push_str(":KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n");
        hooks(&mut out, "nat", nat);
        masquerade_chains(
            &mut out,
            ctx,
            &[
                format!(
                    "-A KUBE-POSTROUTING -m comment --comment \"Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose\" -m set --match-set {} dst,dst,src -j MARK --or-mark 0x{mark:x}",
                    set(SetKind::LoopBack)
                ),
                format!(
                    "-A KUBE-POSTROUTING -m comment --comment \"external traffic leaving the node for an endpoint elsewhere\" -m mark --mark 0x{remote:x}/0x{remote:x} -m set --match-set {} dst,dst -j MARK --or-mark 0x{mark:x}",
                    set(SetKind::RemoteEndpoint)
                ),
            ],
        );
    }
    let _ = writeln!(
        out,
        "-A KUBE-SERVICES -m comment --comment \"masqueradeAll\" -m set --match-set {} dst,dst -j KUBE-MARK-MASQ",
        set(SetKind::MasqueradeAll)
    );
    if let Some(local) = &ctx.local {
        let _ = writeln!(
            out,
            "-A KUBE-SERVICES -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" {} -m set --match-set {} dst,dst -j KUBE-MARK-MASQ",
            local_match(local, true),
            set(SetKind::ClusterIp)
        );
    }
    // The node's own connections: their source is the service address itself (it is
    // local); masquerading gives them one the endpoint can answer.
    for kind in [SetKind::ClusterIp, SetKind::External] {
        let _ = writeln!(
            out,
            "-A KUBE-SERVICES -m comment --comment \"service traffic from this node\" -m addrtype --src-type LOCAL -m set --match-set {} dst,dst -j KUBE-MARK-MASQ",
            set(kind)
        );
    }
    let _ = writeln!(
        out,
        "-A KUBE-SERVICES -m comment --comment \"external traffic, masqueraded if it leaves the node\" -m set --match-set {} dst,dst -j MARK --or-mark 0x{remote:x}",
        set(SetKind::ExternalMasquerade)
    );
    out.push_str("COMMIT\n*filter\n:KUBE-SERVICES - [0:0]\n");
    if let Some((_, filter)) = saved {
        out.push_str(":KUBE-FORWARD - [0:0]\n");
        hooks(&mut out, "filter", filter);
        forward_chain(&mut out, ctx);
    }
    for line in plans.values().flat_map(|p| p.filter.iter()) {
        out.push_str(line);
        out.push('\n');
    }
    out.push_str("COMMIT\n");
    out
}

impl<T: RuleTables, S: IpSets> FamilyTables for IpvsProxier<T, S> {
    fn needs_full(&self, family: IpFamily) -> bool {
        self.families[index(family)].needs_full
    }

    fn sync_family(
        &mut self,
        family: IpFamily,
        desired: &DesiredState,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<usize> {
        self.write_family(family, desired, changed)
    }

    fn flow_cleaner(&mut self) -> &mut dyn FlowCleaner {
        self.flows.as_mut()
    }

    fn masquerade_addr_mut(&mut self, family: IpFamily) -> &mut Option<IpAddr> {
        &mut self.contexts[index(family)].masquerade_addr
    }

    fn local_mut(&mut self, family: IpFamily) -> &mut Option<LocalMatch> {
        &mut self.contexts[index(family)].local
    }

    fn require_full(&mut self, family: IpFamily) {
        self.families[index(family)].needs_full = true;
    }
}

impl<T: RuleTables, S: IpSets> Proxier for IpvsProxier<T, S> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ipvs
    }

    fn sync(&mut self, desired: &DesiredState, changes: &[ServiceChange]) -> Result<SyncReport> {
        sync_by_family(self, desired, Some(changes))
    }

    fn sync_full(&mut self, desired: &DesiredState) -> Result<SyncReport> {
        sync_by_family(self, desired, None)
    }

    fn set_masquerade_addresses(
        &mut self,
        v4: Option<std::net::Ipv4Addr>,
        v6: Option<std::net::Ipv6Addr>,
    ) {
        set_family_masquerade_addresses(self, v4, v6)
    }

    fn set_local_traffic(&mut self, local: &LocalTraffic) {
        set_family_local_traffic(self, local)
    }

    fn programmed(&self) -> (usize, usize) {
        let plans = self.families.iter().flat_map(|f| f.plans.values());
        let ports = plans.clone().count();
        let reals = plans
            .flat_map(|p| p.servers.iter())
            .map(|(_, r)| r.len())
            .sum();
        (ports, reals)
    }
}

/// The node's ipvs-mode state besides the iptables rules (removed with the iptables
/// mode's): every IPVS virtual server outside `exclude` (kube-proxy's cleanup flushes
/// IPVS), the `kube-ipvs0` interface, and the `KUBE-` ipsets. Returns (virtual servers,
/// interface removed, sets). `None`: the node has no IPVS / no ipset.
pub fn remove_all(
    ipvs: Option<&mut dyn Ipvs>,
    sets: Option<&mut dyn IpSets>,
    exclude: &[Cidr],
) -> Result<(usize, bool, usize)> {
    let mut servers = 0;
    if let Some(ipvs) = ipvs {
        for vs in ipvs.virtual_servers()? {
            if exclude.iter().any(|c| c.contains(vs.frontend.addr)) {
                continue;
            }
            ipvs.delete_virtual_server(&vs.frontend)?;
            servers += 1;
        }
    }
    let interface = crate::kernel::local_routes::remove_dummy_interface()?;
    let mut destroyed = 0;
    if let Some(sets) = sets {
        let names: Vec<String> = sets
            .names()?
            .into_iter()
            .filter(|n| n.starts_with("KUBE-"))
            .collect();
        if !names.is_empty() {
            sets.restore(&ipset::removal_input(&names))
                .context("destroying the ipvs mode's ipsets")?;
        }
        destroyed = names.len();
    }
    Ok((servers, interface, destroyed))
}

#[cfg(test)]
mod tests;
