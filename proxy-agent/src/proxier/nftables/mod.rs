//! The nftables proxier: kube-proxy's nftables design (see [`rules`]), one transaction per
//! family and sync, written in nft's language and sent to nf_tables as a netlink batch
//! (see [`netlink`] for why not through `nft`).
//!
//! The first sync, the hourly one and the one after a failed transaction are full: the
//! table is deleted and written whole in the same transaction, so the kernel swaps the old
//! table for the new one at commit (no packet sees neither), nothing anybody left in it
//! survives, and nothing has to be listed to find what is stale — a listing of 100 000
//! services' chains takes the kernel minutes. The affinity sets' clients are read first
//! (one dump per wanted set) and written back with the time they had left. The other syncs
//! are incremental: the changed service ports' chains are rewritten, and the verdict maps
//! get only the elements that were added or removed, so a change costs the same at 10 000
//! services as at 10.

pub mod netlink;
pub mod nft;
pub mod rules;

use crate::model::local::{LocalMatch, LocalTraffic};
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

use anyhow::{Context, Result};

use self::{
    nft::Nft,
    rules::{service_rules, RuleContext, ServiceRules, TABLE},
};
use super::{
    family_index as index, regenerate, set_family_local_traffic, set_family_masquerade_addresses,
    sync_by_family, FamilyTables, FlowCleaner, Proxier, ProxyMode, Regenerated, SyncReport,
    FAMILIES,
};
use crate::model::{DesiredState, IpFamily, ServiceChange, ServicePortName};

/// The table's fixed chains, with their hook if they have one.
const BASE_CHAINS: &[(&str, &str)] = &[
    (
        "nat-prerouting",
        "{ type nat hook prerouting priority dstnat ; policy accept ; }",
    ),
    (
        "nat-output",
        "{ type nat hook output priority -100 ; policy accept ; }",
    ),
    (
        "nat-postrouting",
        "{ type nat hook postrouting priority srcnat ; policy accept ; }",
    ),
    (
        "filter-input",
        "{ type filter hook input priority filter ; policy accept ; }",
    ),
    (
        "filter-forward",
        "{ type filter hook forward priority filter ; policy accept ; }",
    ),
    (
        "filter-output",
        "{ type filter hook output priority filter ; policy accept ; }",
    ),
    ("services", ""),
    ("masquerading", ""),
    ("mark-for-masquerade", ""),
    ("reject-chain", ""),
    ("service-endpoints-check", ""),
];

/// The set of node addresses NodePorts are served on (every NodePort shares them).
const NODE_PORT_IPS: &str = "nodeport-ips";

/// The verdict maps and sets every sync fills from the service ports' rules.
const MAPS: [&str; 4] = [
    "service-ips",
    "service-nodeports",
    "no-endpoint-services",
    NODE_PORT_IPS,
];

/// One family's table, as last written.
#[derive(Default)]
struct FamilyTable {
    services: BTreeMap<ServicePortName, ServiceRules>,
    /// The elements of each of [`MAPS`] as last written.
    elements: Elements,
    needs_full: bool,
}

pub struct NftablesProxier<N: Nft> {
    nft: N,
    flows: Box<dyn FlowCleaner>,
    contexts: [RuleContext; 2],
    families: [FamilyTable; 2],
    /// Failed transactions since start.
    pub failures: u64,
}

type Elements = BTreeMap<&'static str, BTreeMap<String, String>>;

/// A service port's elements of verdict map `map` (one of [`MAPS`] but [`NODE_PORT_IPS`]).
fn verdict_elements<'a>(rules: &'a ServiceRules, map: &str) -> &'a [(String, String)] {
    match map {
        "service-ips" => &rules.service_ips,
        "service-nodeports" => &rules.node_ports,
        "no-endpoint-services" => &rules.no_endpoints,
        other => unreachable!("{other} is not a verdict map"),
    }
}

/// The [`NODE_PORT_IPS`] elements of `services`.
fn node_port_ips<'a>(
    services: impl IntoIterator<Item = &'a ServiceRules>,
) -> BTreeMap<String, String> {
    services
        .into_iter()
        .flat_map(|r| &r.node_port_addrs)
        .map(|addr| (addr.to_string(), String::new()))
        .collect()
}

/// The elements `services` put in each map.
fn wanted_elements<'a>(services: impl IntoIterator<Item = &'a ServiceRules> + Clone) -> Elements {
    MAPS.iter()
        .map(|&map| {
            let elements = if map == NODE_PORT_IPS {
                node_port_ips(services.clone())
            } else {
                services
                    .clone()
                    .into_iter()
                    .flat_map(|r| verdict_elements(r, map))
                    .cloned()
                    .collect()
            };
            (map, elements)
        })
        .collect()
}

/// What an incremental sync changes in one map: keys to delete (their old value differs or
/// is gone) and elements to add.
#[derive(Default)]
struct MapChanges {
    removed: Vec<String>,
    added: Vec<(String, String)>,
}

/// Brings `maps` (the elements last written) up to date after an incremental sync, and
/// says what changed: what the rewritten service ports put in a map before (`old`) leaves
/// it, what they put there now (`new`) enters it. A key another service port also claims
/// keeps that one's value, and the node addresses (shared by every NodePort) are counted
/// again. Only the rewritten ports' elements are copied or compared; rebuilding every map
/// copied each element of 10 000 services for a one-endpoint change.
fn update_elements(
    maps: &mut Elements,
    old: &Elements,
    new: &Elements,
    current: &BTreeMap<ServicePortName, ServiceRules>,
    written: &BTreeSet<&ServicePortName>,
) -> BTreeMap<&'static str, MapChanges> {
    let mut changes: BTreeMap<&'static str, MapChanges> = BTreeMap::new();
    let mut set = |maps: &mut Elements, map: &'static str, key: &str, value: Option<String>| {
        let target = maps.entry(map).or_default();
        let before = target.get(key);
        if before == value.as_ref() {
            return;
        }
        let change = changes.entry(map).or_default();
        if before.is_some() {
            change.removed.push(key.to_string());
            target.remove(key);
        }
        if let Some(v) = value {
            change.added.push((key.to_string(), v.clone()));
            target.insert(key.to_string(), v);
        }
    };
    let node_port_addrs = node_port_ips(current.values());
    for map in MAPS {
        if map == NODE_PORT_IPS {
            let now = maps.get(map).cloned().unwrap_or_default();
            for key in now.keys().filter(|k| !node_port_addrs.contains_key(*k)) {
                set(maps, map, key, None);
            }
            for key in node_port_addrs.keys() {
                set(maps, map, key, Some(String::new()));
            }
            continue;
        }
        for key in old[map].keys().filter(|k| !new[map].contains_key(*k)) {
            // Another service port may claim the same key (a conflict the model allows
            // through): it keeps its element.
            let claim = current
                .iter()
                .filter(|(name, _)| !written.contains(name))
                .find_map(|(_, r)| {
                    verdict_elements(r, map)
                        .iter()
                        .find(|(k, _)| k == key)
                        .map(|(_, v)| v.clone())
                });
            set(maps, map, key, claim);
        }
        for (k, v) in &new[map] {
            set(maps, map, k, Some(v.clone()));
        }
    }
    changes
}

fn element(k: &str, v: &str) -> String {
    if v.is_empty() {
        k.to_string()
    } else {
        format!("{k} : {v}")
    }
}

impl<N: Nft> NftablesProxier<N> {
    pub fn new(
        nft: N,
        flows: Box<dyn FlowCleaner>,
        masquerade_bit: u32,
        local: &LocalTraffic,
    ) -> Self {
        NftablesProxier {
            nft,
            flows,
            contexts: FAMILIES.map(|f| RuleContext::new(f, masquerade_bit, local.of(f).cloned())),
            families: [
                FamilyTable {
                    needs_full: true,
                    ..Default::default()
                },
                FamilyTable {
                    needs_full: true,
                    ..Default::default()
                },
            ],
            failures: 0,
        }
    }

    pub fn nft(&self) -> &N {
        &self.nft
    }

    /// Rules and map elements in both families' tables.
    pub fn rule_count(&self) -> usize {
        self.families
            .iter()
            .flat_map(|f| f.services.values())
            .map(ServiceRules::rule_count)
            .sum()
    }

    fn static_part(&self, ctx: &RuleContext, out: &mut String) {
        let ip = ctx.ip();
        let t = format!("{ip} {TABLE}");
        let addr = ctx.addr_type();
        for (map, spec) in [
            (
                "service-ips",
                format!("map {{ type {addr} . inet_proto . inet_service : verdict ; }}"),
            ),
            (
                "no-endpoint-services",
                format!("map {{ type {addr} . inet_proto . inet_service : verdict ; }}"),
            ),
            (
                "service-nodeports",
                "map { type inet_proto . inet_service : verdict ; }".to_string(),
            ),
            (NODE_PORT_IPS, format!("set {{ type {addr} ; }}")),
        ] {
            let (kind, body) = spec.split_once(' ').expect("kind and body");
            let _ = writeln!(out, "add {kind} {t} {map} {body}");
        }
        for (chain, hook) in BASE_CHAINS {
            let _ = writeln!(out, "add chain {t} {chain} {hook}");
        }
        let mark = ctx.masquerade_mark;
        let snat = match ctx.masquerade_addr {
            Some(a) => format!("snat to {a} fully-random"),
            None => "masquerade fully-random".to_string(),
        };
        for (chain, rule) in [
            ("nat-prerouting", "jump services".to_string()),
            ("nat-output", "jump services".to_string()),
            ("nat-postrouting", "jump masquerading".to_string()),
            (
                "filter-input",
                "ct state new jump service-endpoints-check".to_string(),
            ),
            (
                "filter-forward",
                "ct state new jump service-endpoints-check".to_string(),
            ),
            (
                "filter-output",
                "ct state new jump service-endpoints-check".to_string(),
            ),
            (
                "service-endpoints-check",
                format!("{ip} daddr . meta l4proto . th dport vmap @no-endpoint-services"),
            ),
            (
                "services",
                format!("{ip} daddr . meta l4proto . th dport vmap @service-ips"),
            ),
            (
                "services",
                format!("{ip} daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports"),
            ),
            (
                "masquerading",
                format!("meta mark & 0x{mark:x} == 0 return"),
            ),
            (
                "masquerading",
                format!("meta mark set meta mark ^ 0x{mark:x}"),
            ),
            ("masquerading", snat),
            (
                "mark-for-masquerade",
                format!("meta mark set meta mark | 0x{mark:x}"),
            ),
            (
                "reject-chain",
                "meta l4proto tcp reject with tcp reset".to_string(),
            ),
            ("reject-chain", "reject".to_string()),
        ] {
            let _ = writeln!(out, "add rule {t} {chain} {rule}");
        }
    }

    fn write_family(
        &mut self,
        family: IpFamily,
        desired: &DesiredState,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<usize> {
        let i = index(family);
        let full = changed.is_none() || self.families[i].needs_full;
        let ctx = self.contexts[i].clone();
        let ip = ctx.ip();
        let t = format!("{ip} {TABLE}");
        // A full sync replaces the table whole, so nothing needs listing to find what is
        // stale; the affinity sets' clients it reads first, to carry them over.
        let had_table = full && self.nft.has_table(ip, TABLE)?;
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
        // What the rewritten service ports had in the maps (an incremental sync changes
        // only that).
        let old_elements = (!full).then(|| wanted_elements(&replaced));
        let written_names: BTreeSet<&ServicePortName> = write.iter().collect();
        let written: Vec<&ServiceRules> = write.iter().filter_map(|n| current.get(n)).collect();
        // What an incremental sync deletes: the rewritten ports' chains and sets nobody
        // wants now. Names are the service port's own (its key is in them), so only the
        // ports it writes can want them again. (A full sync starts from an empty table.)
        let mut stale_chains = BTreeSet::new();
        let mut stale_sets = BTreeSet::new();
        if !full {
            for old in replaced {
                stale_chains.extend(old.chains.into_iter().map(|(c, _)| c));
                stale_sets.extend(old.sets.into_iter().map(|(s, _)| s));
            }
            let wanted_chains: BTreeSet<&String> = written
                .iter()
                .flat_map(|r| r.chains.iter().map(|(c, _)| c))
                .collect();
            let wanted_sets: BTreeSet<&String> = written
                .iter()
                .flat_map(|r| r.sets.iter().map(|(s, _)| s))
                .collect();
            stale_chains.retain(|c| !wanted_chains.contains(c));
            stale_sets.retain(|s| !wanted_sets.contains(s));
        }

        let mut carried = Vec::new();
        if had_table {
            for (set, _) in current.values().flat_map(|r| &r.sets) {
                let clients = self.nft.address_elements(ip, TABLE, set)?;
                carried.extend(clients.into_iter().map(|c| (set.clone(), c)));
            }
        }

        let mut out = String::new();
        let _ = writeln!(out, "add table {t}");
        if full {
            // Deleted and written again in one transaction: packets see the old table or
            // the new one, never neither (the kernel swaps them at commit).
            let _ = writeln!(out, "delete table {t}\nadd table {t}");
            self.static_part(&ctx, &mut out);
        }
        // 1. Every new object first, so rules and elements can name them.
        for rules in &written {
            for (set, timeout) in &rules.sets {
                let _ = writeln!(
                    out,
                    "add set {t} {set} {{ type {} ; flags dynamic,timeout ; timeout {timeout}s ; }}",
                    ctx.addr_type()
                );
            }
            for (chain, _) in &rules.chains {
                let _ = writeln!(out, "add chain {t} {chain}");
            }
        }
        // 2. The rewritten chains.
        for rules in &written {
            for (chain, lines) in &rules.chains {
                if !full {
                    let _ = writeln!(out, "flush chain {t} {chain}");
                }
                for line in lines {
                    let _ = writeln!(out, "add rule {t} {chain} {line}");
                }
            }
        }
        // 3. The maps: refilled (full) or changed element by element.
        let state = &mut self.families[i];
        let mut elements = std::mem::take(&mut state.elements);
        match &old_elements {
            None => {
                elements = wanted_elements(current.values());
                for map in MAPS {
                    let all: Vec<String> =
                        elements[map].iter().map(|(k, v)| element(k, v)).collect();
                    if !all.is_empty() {
                        let _ = writeln!(out, "add element {t} {map} {{ {} }}", all.join(", "));
                    }
                }
                // Affinity: each client keeps its endpoint for the time it had left.
                for (set, client) in &carried {
                    let _ = match client.expires_ms {
                        Some(ms) if ms > 0 => writeln!(
                            out,
                            "add element {t} {set} {{ {} expires {ms}ms }}",
                            client.key
                        ),
                        _ => writeln!(out, "add element {t} {set} {{ {} }}", client.key),
                    };
                }
            }
            Some(old) => {
                let new = wanted_elements(written.iter().copied());
                let changes = update_elements(&mut elements, old, &new, &current, &written_names);
                for (map, change) in changes {
                    if !change.removed.is_empty() {
                        let _ = writeln!(
                            out,
                            "delete element {t} {map} {{ {} }}",
                            change.removed.join(", ")
                        );
                    }
                    if !change.added.is_empty() {
                        let added: Vec<String> =
                            change.added.iter().map(|(k, v)| element(k, v)).collect();
                        let _ = writeln!(out, "add element {t} {map} {{ {} }}", added.join(", "));
                    }
                }
            }
        }
        // 4. What nobody wants any more: emptied first, as chains may jump to each other.
        for chain in &stale_chains {
            let _ = writeln!(out, "flush chain {t} {chain}");
        }
        for chain in &stale_chains {
            let _ = writeln!(out, "delete chain {t} {chain}");
        }
        for set in &stale_sets {
            let _ = writeln!(out, "delete set {t} {set}");
        }
        state.services = current;
        match self.nft.apply(&out) {
            Ok(()) => {
                let state = &mut self.families[i];
                state.elements = elements;
                state.needs_full = false;
                Ok(write.len())
            }
            Err(e) => {
                let state = &mut self.families[i];
                state.needs_full = true;
                self.failures += 1;
                Err(e).with_context(|| {
                    format!("the {ip} {TABLE} transaction failed; the next sync rewrites the table")
                })
            }
        }
    }
}

/// Deletes the `kube-proxy` tables of both families (this agent's nftables mode, and
/// upstream kube-proxy's); returns how many held anything.
pub fn remove_all(nft: &mut impl Nft) -> Result<usize> {
    let mut removed = 0;
    for ip in ["ip", "ip6"] {
        let had = nft.has_table(ip, TABLE)?;
        // Adding first makes the delete succeed whether or not the table was there.
        nft.apply(&format!(
            "add table {ip} {TABLE}\ndelete table {ip} {TABLE}\n"
        ))?;
        removed += had as usize;
    }
    Ok(removed)
}

impl<N: Nft> FamilyTables for NftablesProxier<N> {
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

impl<N: Nft> Proxier for NftablesProxier<N> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Nftables
    }

    fn sync(&mut self, desired: &DesiredState, changes: &[ServiceChange]) -> Result<SyncReport> {
        sync_by_family(self, desired, Some(changes))
    }

    fn sync_full(&mut self, desired: &DesiredState) -> Result<SyncReport> {
        sync_by_family(self, desired, None)
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
                    .filter(|(c, _)| c.starts_with("endpoint-"))
                    .count();
            }
        }
        (ports, backends)
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
}

#[cfg(test)]
mod tests;
