//! The iptables proxier: kube-proxy's `nat`/`filter` chains (see [`rules`]), applied
//! atomically with `iptables-restore --noflush` and `ip6tables-restore`.
//!
//! The first sync, the hourly one, and the sync after a failed restore write the whole
//! ruleset and delete any `KUBE-` service chain nobody wants (including a previous agent's or
//! kube-proxy's). Other syncs are partial, as kube-proxy's since 1.26: the dispatch chains
//! (`KUBE-SERVICES`, `KUBE-NODEPORTS`, filter `KUBE-SERVICES`) are rewritten, but of the
//! per-service chains only those of changed service ports.

pub mod cleanup;
pub mod rules;
pub mod tables;

use crate::model::local::{LocalMatch, LocalTraffic};
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

use anyhow::{Context, Result};

use self::{
    rules::{service_rules, RuleContext, ServiceRules},
    tables::RuleTables,
};
use super::{
    family_index as index, regenerate, set_family_local_traffic, set_family_masquerade_addresses,
    sync_by_family, FamilyTables, FlowCleaner, Proxier, ProxyMode, Regenerated, SyncReport,
    FAMILIES,
};
use crate::model::{DesiredState, IpFamily, ServiceChange, ServicePortName};

/// kube-proxy's jump rules from the built-in chains: (table, chain, rule).
const HOOKS: &[(&str, &str, &str)] = &[
    (
        "nat",
        "PREROUTING",
        "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
    ),
    (
        "nat",
        "OUTPUT",
        "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
    ),
    (
        "nat",
        "POSTROUTING",
        "-m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING",
    ),
    (
        "filter",
        "INPUT",
        "-m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
    ),
    (
        "filter",
        "FORWARD",
        "-m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
    ),
    (
        "filter",
        "OUTPUT",
        "-m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
    ),
    (
        "filter",
        "FORWARD",
        "-m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD",
    ),
];

/// Prefixes of the per-service chains (ours and kube-proxy's).
const SERVICE_CHAIN_PREFIXES: &[&str] = &[
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
];

/// What one family's tables hold, as last written.
#[derive(Default)]
struct FamilyRules {
    services: BTreeMap<ServicePortName, ServiceRules>,
    /// The next sync must write everything (first sync, or the last restore failed).
    needs_full: bool,
}

/// Counters the proxier reports after each sync (kube-proxy's iptables metrics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuleCounts {
    pub nat: usize,
    pub filter: usize,
}

pub struct IptablesProxier<T: RuleTables> {
    tables: T,
    flows: Box<dyn FlowCleaner>,
    contexts: [RuleContext; 2],
    families: [FamilyRules; 2],
    /// Restores that failed since start (`sync_proxy_rules_iptables_restore_failures_total`).
    pub restore_failures: u64,
    /// Partial restores that failed (`..._partial_restore_failures_total`).
    pub partial_restore_failures: u64,
}

impl<T: RuleTables> IptablesProxier<T> {
    /// `local`: how the node's pods are told apart until [`Proxier::set_local_traffic`].
    pub fn new(
        tables: T,
        flows: Box<dyn FlowCleaner>,
        masquerade_bit: u32,
        local: &LocalTraffic,
    ) -> Self {
        IptablesProxier {
            tables,
            flows,
            contexts: FAMILIES.map(|f| RuleContext::new(masquerade_bit, local.of(f).cloned())),
            families: [
                FamilyRules {
                    needs_full: true,
                    ..Default::default()
                },
                FamilyRules {
                    needs_full: true,
                    ..Default::default()
                },
            ],
            restore_failures: 0,
            partial_restore_failures: 0,
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

    /// Rules in each table, both families together.
    pub fn rule_counts(&self) -> RuleCounts {
        let mut counts = RuleCounts::default();
        for family in &self.families {
            for s in family.services.values() {
                let (nat, filter) = s.rule_counts();
                counts.nat += nat;
                counts.filter += filter;
            }
        }
        counts
    }

    /// Writes one family: everything if `changed` is `None` (or the family needs it), else
    /// the dispatch chains and the chains of the `changed` service ports.
    fn write_family(
        &mut self,
        family: IpFamily,
        desired: &DesiredState,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<usize> {
        let i = index(family);
        let full = changed.is_none() || self.families[i].needs_full;
        let ctx = self.contexts[i].clone();
        let state = &mut self.families[i];
        let Regenerated {
            current,
            write,
            replaced,
        } = regenerate(
            std::mem::take(&mut state.services),
            desired,
            family,
            full,
            changed,
            |port| service_rules(port, &ctx),
        );
        // Chains written before that may be unwanted now (compared with what is wanted
        // below).
        let mut stale: BTreeSet<String> = replaced
            .into_iter()
            .flat_map(|(_, r)| r.chains.into_iter().map(|(c, _)| c))
            .collect();
        let mut wanted_chains: BTreeSet<&str> = BTreeSet::new();
        for rules in current.values() {
            for (chain, _) in &rules.chains {
                wanted_chains.insert(chain);
            }
        }
        let mut nat_saved = String::new();
        let mut filter_saved = String::new();
        if full {
            nat_saved = self.tables.save(family, "nat")?;
            filter_saved = self.tables.save(family, "filter")?;
            for line in nat_saved.lines() {
                if let Some(chain) = line.strip_prefix(':').and_then(|l| l.split(' ').next()) {
                    if SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p)) {
                        stale.insert(chain.to_string());
                    }
                }
            }
        }
        stale.retain(|c| !wanted_chains.contains(c.as_str()));

        // With the nf_tables backend a large full sync writes the service chains first, a
        // chunk per restore, and then the rest (dispatch chains, hooks, deletions) with
        // none of them: each chunk is atomic, and the dispatch chains only ever jump to
        // chains that exist, old or new.
        let written = write.len();
        let mut write: &[ServicePortName] = &write;
        let mut chunked = Ok(());
        if full && write.len() > RESTORE_CHUNK && self.tables.chunked_full_syncs() {
            // The chains every service chain may jump to, first.
            let mut first =
                String::from("*nat\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n");
            masquerade_chains(&mut first, &ctx, &[]);
            first.push_str("COMMIT\n");
            chunked = self.tables.restore(family, &first);
            for chunk in write.chunks(RESTORE_CHUNK) {
                if chunked.is_err() {
                    break;
                }
                chunked = self.tables.restore(family, &chains_input(&current, chunk));
            }
            write = &[];
        }
        let input = restore_input(
            &ctx,
            &current,
            write,
            &stale,
            full.then_some((&nat_saved, &filter_saved)),
        );
        let state = &mut self.families[i];
        state.services = current;
        match chunked.and_then(|()| self.tables.restore(family, &input)) {
            Ok(()) => {
                state.needs_full = false;
                Ok(written)
            }
            Err(e) => {
                // The kernel's rules are unknown now: write everything next time.
                state.needs_full = true;
                self.restore_failures += 1;
                if !full {
                    self.partial_restore_failures += 1;
                }
                Err(e).with_context(|| {
                    format!(
                        "{} failed; the next sync rewrites every rule",
                        match family {
                            IpFamily::V4 => "iptables-restore",
                            IpFamily::V6 => "ip6tables-restore",
                        }
                    )
                })
            }
        }
    }
}

/// Service ports per restore in a chunked full sync (see
/// [`RuleTables::chunked_full_syncs`]).
const RESTORE_CHUNK: usize = 250;

/// The `iptables-restore --noflush` input that (re)writes the nat chains of `ports` and
/// nothing else.
fn chains_input(
    services: &BTreeMap<ServicePortName, ServiceRules>,
    ports: &[ServicePortName],
) -> String {
    let rules: Vec<&ServiceRules> = ports.iter().filter_map(|n| services.get(n)).collect();
    let mut out = String::from("*nat\n");
    declare_chains(&mut out, &rules);
    chain_rules(&mut out, &rules);
    out.push_str("COMMIT\n");
    out
}

/// `:CHAIN` lines for the service ports' chains (declared: created or flushed).
fn declare_chains(out: &mut String, rules: &[&ServiceRules]) {
    for (chain, _) in rules.iter().flat_map(|r| &r.chains) {
        let _ = writeln!(out, ":{chain} - [0:0]");
    }
}

/// The rules of the service ports' chains.
fn chain_rules(out: &mut String, rules: &[&ServiceRules]) {
    for line in rules.iter().flat_map(|r| &r.chains).flat_map(|(_, l)| l) {
        out.push_str(line);
        out.push('\n');
    }
}

/// The `iptables-restore --noflush` input of one family. `saved` (full syncs): the tables
/// as they are, to add the jump rules only where they are missing.
fn restore_input(
    ctx: &RuleContext,
    services: &BTreeMap<ServicePortName, ServiceRules>,
    write: &[ServicePortName],
    stale: &BTreeSet<String>,
    saved: Option<(&String, &String)>,
) -> String {
    let mut out = String::new();
    // nat
    out.push_str("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n");
    if saved.is_some() {
        out.push_str(":KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n");
    }
    let written: Vec<&ServiceRules> = write.iter().filter_map(|n| services.get(n)).collect();
    declare_chains(&mut out, &written);
    for chain in stale {
        let _ = writeln!(out, ":{chain} - [0:0]");
    }
    if let Some((nat, _)) = saved {
        hooks(&mut out, "nat", nat);
        masquerade_chains(&mut out, ctx, &[]);
    }
    let mut node_addrs = BTreeSet::new();
    for rules in services.values() {
        for line in &rules.services {
            out.push_str(line);
            out.push('\n');
        }
        node_addrs.extend(rules.node_port_addrs.iter().copied());
    }
    for addr in node_addrs {
        let host = match addr {
            std::net::IpAddr::V4(a) => format!("{a}/32"),
            std::net::IpAddr::V6(a) => format!("{a}/128"),
        };
        let _ = writeln!(
            out,
            "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -d {host} -j KUBE-NODEPORTS"
        );
    }
    for rules in services.values() {
        for line in &rules.node_ports {
            out.push_str(line);
            out.push('\n');
        }
    }
    chain_rules(&mut out, &written);
    for chain in stale {
        let _ = writeln!(out, "-X {chain}");
    }
    out.push_str("COMMIT\n");
    // filter
    out.push_str("*filter\n:KUBE-SERVICES - [0:0]\n");
    if let Some((_, filter)) = saved {
        out.push_str(":KUBE-FORWARD - [0:0]\n");
        hooks(&mut out, "filter", filter);
        forward_chain(&mut out, ctx);
    }
    for rules in services.values() {
        for line in &rules.filter {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.push_str("COMMIT\n");
    out
}

/// `KUBE-MARK-MASQ` and `KUBE-POSTROUTING` (nat, declared by the caller): marked packets
/// are source-NATed to the node's address. `before` are `KUBE-POSTROUTING` rules that may
/// still mark a packet (the ipvs mode's set matches).
pub(crate) fn masquerade_chains(out: &mut String, ctx: &RuleContext, before: &[String]) {
    let mark = ctx.masquerade_mark;
    let _ = writeln!(out, "-A KUBE-MARK-MASQ -j MARK --or-mark 0x{mark:x}");
    for line in before {
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(
        out,
        "-A KUBE-POSTROUTING -m mark ! --mark 0x{mark:x}/0x{mark:x} -j RETURN"
    );
    let _ = writeln!(out, "-A KUBE-POSTROUTING -j MARK --xor-mark 0x{mark:x}");
    let to = match ctx.masquerade_addr {
        Some(addr) => format!("SNAT --to-source {addr} --random-fully"),
        None => "MASQUERADE --random-fully".to_string(),
    };
    let _ = writeln!(
        out,
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j {to}"
    );
}

/// `KUBE-FORWARD` (filter, declared by the caller): INVALID packets dropped (see
/// [`RuleContext::drop_invalid`]); for nodes whose FORWARD policy is DROP, service traffic
/// still flows.
pub(crate) fn forward_chain(out: &mut String, ctx: &RuleContext) {
    let mark = ctx.masquerade_mark;
    if ctx.drop_invalid {
        out.push_str("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n");
    }
    let _ = writeln!(
        out,
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x{mark:x}/0x{mark:x} -j ACCEPT"
    );
    let _ = writeln!(
        out,
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
    );
}

/// Jump rules from the built-in chains that `saved` (an `iptables-save -t table`) lacks.
pub(crate) fn hooks(out: &mut String, table: &str, saved: &str) {
    for (t, chain, rule) in HOOKS {
        if *t != table {
            continue;
        }
        let target = rule.rsplit(' ').next().unwrap_or_default();
        let present = saved.lines().any(|l| {
            l.starts_with(&format!("-A {chain} ")) && l.ends_with(&format!("-j {target}"))
        });
        if !present {
            let _ = writeln!(out, "-I {chain} 1 {rule}");
        }
    }
}

impl<T: RuleTables> FamilyTables for IptablesProxier<T> {
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

impl<T: RuleTables> Proxier for IptablesProxier<T> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
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
        let mut ports = 0;
        let mut backends = 0;
        for family in &self.families {
            for rules in family.services.values() {
                ports += 1;
                backends += rules
                    .chains
                    .iter()
                    .filter(|(c, _)| c.starts_with("KUBE-SEP-"))
                    .count();
            }
        }
        (ports, backends)
    }
}

#[cfg(test)]
mod tests;
