//! The nftables proxier: kube-proxy's nftables design (see [`rules`]), one transaction per
//! family and sync, written in nft's language and sent to nf_tables as a netlink batch
//! (see [`netlink`] for why not through `nft`).
//!
//! The first sync, the hourly one and the one after a failed transaction are full: each
//! table is deleted and written whole in a transaction of its own, so the kernel swaps the
//! old table for the new one at commit (no packet sees neither), nothing anybody left in it
//! survives, and nothing has to be listed to find what is stale — a listing of 100 000
//! services' chains takes the kernel minutes. (One transaction for all tables held a CPU
//! 47 s at 100 000 services: the kernel does not reschedule inside a batch.) The affinity
//! sets' clients are read first (one dump per wanted set) and written back with the time
//! they had left. The other syncs
//! are incremental: the changed service ports' chains are rewritten, and the verdict maps
//! get only the elements that were added or removed.
//!
//! # Tables
//!
//! nf_tables checks a table whole at every commit that adds a jump, a goto or a NAT rule
//! (loops, hooks: `nft_table_validate` walks every chain reachable from each base chain),
//! so with one table every change cost the whole table: 190 ms at 10 000 services, 2.3 s
//! at 100 000. The service ports are therefore spread over up to [`MAX_TABLES`] tables,
//! one per [`SERVICES_PER_TABLE`] (a hash of the service port's name picks its table): a
//! change validates only its own. Each table has the nat base chains and the service
//! lookups of its ports; the first (`kube-proxy`, the only one up to 1 000 service ports,
//! so smaller clusters have kube-proxy's layout exactly) also has the filter hooks,
//! masquerading and the reject chain. A frontend lives in one table, and a NAT binding is
//! made by the first nat chain that translates, so semantics do not change; the cost is
//! that a new connection passes the nat chain of every table (one hash lookup each). The
//! number of tables grows as soon as the service ports need more and shrinks only once
//! twice as many would still fit in fewer; a sync that changes it is full.
//!
//! ```text
//! kube-proxy:    nat-prerouting/output -> services -> @service-ips / @service-nodeports
//!                filter-input/forward/output -> @no-endpoint-services -> reject-chain
//!                nat-postrouting -> masquerading
//! kube-proxy-1:  nat-prerouting/output -> services -> @service-ips / @service-nodeports
//! ...            (its own service, endpoint, firewall chains and affinity sets)
//! ```

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

/// How many service ports a table holds before they spread over more tables (see
/// "Tables" in the module docs), and the most tables there are.
pub const SERVICES_PER_TABLE: usize = 1000;
pub const MAX_TABLES: usize = 16;

/// The name of the `i`th table: the first is kube-proxy's, the others add their number.
pub fn table_name(i: usize) -> String {
    if i == 0 {
        TABLE.to_string()
    } else {
        format!("{TABLE}-{i}")
    }
}

/// The table of service port `name` among `tables`: FNV-1a of its name, stable across
/// restarts (so an affinity set is found where the last agent wrote it).
fn table_of(name: &ServicePortName, tables: usize) -> usize {
    if tables <= 1 {
        return 0;
    }
    let mut hash = Fnv(0xcbf2_9ce4_8422_2325);
    let _ = write!(hash, "{name}");
    (hash.0 % tables as u64) as usize
}

/// FNV-1a over what is written to it (a name's text, without building the string).
struct Fnv(u64);

impl std::fmt::Write for Fnv {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        for b in s.bytes() {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        Ok(())
    }
}

/// Deletes `family`'s tables from the `from`th on (adding each first makes the delete
/// succeed whether or not it was there).
fn delete_tables(out: &mut String, family: &str, from: usize) {
    for t in from..MAX_TABLES {
        let _ = writeln!(
            out,
            "add table {family} {0}\ndelete table {family} {0}",
            table_name(t)
        );
    }
}

/// One family's tables, as last written.
#[derive(Default)]
struct FamilyTable {
    services: BTreeMap<ServicePortName, ServiceRules>,
    /// The elements of each of [`MAPS`] in each table, as last written.
    elements: Elements,
    needs_full: bool,
    /// How many tables the service ports are spread over (0: none written yet).
    tables: usize,
}

pub struct NftablesProxier<N: Nft> {
    nft: N,
    flows: Box<dyn FlowCleaner>,
    contexts: [RuleContext; 2],
    families: [FamilyTable; 2],
    /// See [`SERVICES_PER_TABLE`]; tests lower it to spread a few services over tables.
    pub services_per_table: usize,
    /// Failed transactions since start.
    pub failures: u64,
}

/// Elements by table and map.
type Elements = BTreeMap<(usize, &'static str), BTreeMap<String, String>>;

/// A service port's elements of verdict map `map` (one of [`MAPS`] but [`NODE_PORT_IPS`]).
fn verdict_elements<'a>(rules: &'a ServiceRules, map: &str) -> &'a [(String, String)] {
    match map {
        "service-ips" => &rules.service_ips,
        "service-nodeports" => &rules.node_ports,
        "no-endpoint-services" => &rules.no_endpoints,
        other => unreachable!("{other} is not a verdict map"),
    }
}

/// A service port's rules and the table they live in.
type Placed<'a> = (usize, &'a ServiceRules);

/// The elements `services` put in each map of each table: the service lookups in the
/// service port's table, the filter hooks' `no-endpoint-services` in the first.
fn wanted_elements<'a>(services: impl IntoIterator<Item = Placed<'a>>) -> Elements {
    let mut out = Elements::new();
    for (table, rules) in services {
        for map in MAPS {
            let target = if map == "no-endpoint-services" {
                0
            } else {
                table
            };
            let elements = out.entry((target, map)).or_default();
            if map == NODE_PORT_IPS {
                for addr in &rules.node_port_addrs {
                    elements.insert(addr.to_string(), String::new());
                }
            } else {
                for (k, v) in verdict_elements(rules, map) {
                    elements.insert(k.clone(), v.clone());
                }
            }
        }
    }
    out
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
/// it, what they put there now (`new`) enters it. A key another service port of the same
/// table also claims keeps that one's value, and the node addresses of a table (shared by
/// its NodePorts) are counted again. Only the rewritten ports' elements are copied or
/// compared; rebuilding every map copied each element of 10 000 services for a
/// one-endpoint change.
fn update_elements(
    maps: &mut Elements,
    old: &Elements,
    new: &Elements,
    current: &[Placed<'_>],
    written: &BTreeSet<*const ServiceRules>,
) -> BTreeMap<(usize, &'static str), MapChanges> {
    let mut changes: BTreeMap<(usize, &'static str), MapChanges> = BTreeMap::new();
    let mut set =
        |maps: &mut Elements, at: (usize, &'static str), key: &str, value: Option<String>| {
            let target = maps.entry(at).or_default();
            let before = target.get(key);
            if before == value.as_ref() {
                return;
            }
            let change = changes.entry(at).or_default();
            if before.is_some() {
                change.removed.push(key.to_string());
                target.remove(key);
            }
            if let Some(v) = value {
                change.added.push((key.to_string(), v.clone()));
                target.insert(key.to_string(), v);
            }
        };
    let touched: BTreeSet<(usize, &'static str)> = old.keys().chain(new.keys()).copied().collect();
    for at @ (table, map) in touched {
        if map == NODE_PORT_IPS {
            let wanted: BTreeSet<String> = current
                .iter()
                .filter(|(t, _)| *t == table)
                .flat_map(|(_, r)| &r.node_port_addrs)
                .map(|a| a.to_string())
                .collect();
            let gone: Vec<String> = maps
                .get(&at)
                .into_iter()
                .flat_map(|m| m.keys())
                .filter(|k| !wanted.contains(*k))
                .cloned()
                .collect();
            for key in &gone {
                set(maps, at, key, None);
            }
            for key in &wanted {
                set(maps, at, key, Some(String::new()));
            }
            continue;
        }
        let empty = BTreeMap::new();
        let (before, after) = (
            old.get(&at).unwrap_or(&empty),
            new.get(&at).unwrap_or(&empty),
        );
        for key in before.keys().filter(|k| !after.contains_key(*k)) {
            // Another service port of the table may claim the same key (a conflict the
            // model allows through): it keeps its element.
            let claim = current
                .iter()
                .filter(|(t, r)| {
                    (*t == table || map == "no-endpoint-services")
                        && !written.contains(&(*r as *const _))
                })
                .find_map(|(_, r)| {
                    verdict_elements(r, map)
                        .iter()
                        .find(|(k, _)| k == key)
                        .map(|(_, v)| v.clone())
                });
            set(maps, at, key, claim);
        }
        for (k, v) in after {
            set(maps, at, k, Some(v.clone()));
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
            services_per_table: SERVICES_PER_TABLE,
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

    /// How many tables `family`'s service ports are spread over.
    pub fn tables(&self, family: IpFamily) -> usize {
        self.families[index(family)].tables
    }

    /// The tables for `ports` service ports: one per [`Self::services_per_table`], at most
    /// [`MAX_TABLES`].
    fn tables_for(&self, ports: usize) -> usize {
        ports
            .div_ceil(self.services_per_table.max(1))
            .clamp(1, MAX_TABLES)
    }

    /// Whether `ports` service ports want another number of tables than `tables` (0: none
    /// written yet): more as soon as they are too many, fewer only once twice as many would
    /// still fit in fewer (so a count going back and forth across a boundary does not
    /// rewrite everything).
    fn retable(&self, tables: usize, ports: usize) -> bool {
        tables == 0
            || self.tables_for(ports) > tables
            || self.tables_for(ports.saturating_mul(2)) < tables
    }

    /// Whether the next sync of `family` is full whatever changed: the last one failed, or
    /// the service ports now want another number of tables.
    fn full_needed(&self, family: IpFamily, desired: &DesiredState) -> bool {
        let state = &self.families[index(family)];
        let ports = desired.ports.keys().filter(|n| n.family == family).count();
        state.needs_full || self.retable(state.tables, ports)
    }

    /// The fixed part of table `i`: in every table, the service lookups (maps, the nat
    /// base chains, `services`, `mark-for-masquerade`); in the first one also the filter
    /// hooks, masquerading and the reject chain.
    fn static_part(&self, ctx: &RuleContext, i: usize, out: &mut String) {
        let ip = ctx.ip();
        let t = format!("{ip} {}", table_name(i));
        let addr = ctx.addr_type();
        let first = i == 0;
        let mut maps = vec![
            (
                "service-ips",
                format!("map {{ type {addr} . inet_proto . inet_service : verdict ; }}"),
            ),
            (
                "service-nodeports",
                "map { type inet_proto . inet_service : verdict ; }".to_string(),
            ),
            (NODE_PORT_IPS, format!("set {{ type {addr} ; }}")),
        ];
        if first {
            maps.push((
                "no-endpoint-services",
                format!("map {{ type {addr} . inet_proto . inet_service : verdict ; }}"),
            ));
        }
        for (map, spec) in maps {
            let (kind, body) = spec.split_once(' ').expect("kind and body");
            let _ = writeln!(out, "add {kind} {t} {map} {body}");
        }
        let in_every = [
            "nat-prerouting",
            "nat-output",
            "services",
            "mark-for-masquerade",
        ];
        for (chain, hook) in BASE_CHAINS {
            if first || in_every.contains(chain) {
                let _ = writeln!(out, "add chain {t} {chain} {hook}");
            }
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
            if first || in_every.contains(&chain) {
                let _ = writeln!(out, "add rule {t} {chain} {rule}");
            }
        }
    }

    fn write_family(
        &mut self,
        family: IpFamily,
        desired: &DesiredState,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<usize> {
        let i = index(family);
        let ports = desired.ports.keys().filter(|n| n.family == family).count();
        let state = &self.families[i];
        let full = changed.is_none() || self.full_needed(family, desired);
        let old_tables = state.tables;
        let tables = if full && self.retable(old_tables, ports) {
            self.tables_for(ports)
        } else {
            old_tables
        };
        let ctx = self.contexts[i].clone();
        let ip = ctx.ip();
        let table = |n: &ServicePortName| format!("{ip} {}", table_name(table_of(n, tables)));
        // Until this sync succeeds, the next one must be full (whatever fails below).
        self.families[i].needs_full = true;
        // A full sync replaces the tables whole, so nothing needs listing to find what is
        // stale; the affinity sets' clients it reads first, to carry them over, from where
        // they are: the table count this agent wrote, or after a restart, the tables there.
        let mut had_table = [false; MAX_TABLES];
        let mut carry_from = old_tables;
        if full {
            for (t, had) in had_table.iter_mut().enumerate() {
                *had = self.nft.has_table(ip, &table_name(t))?;
            }
            if carry_from == 0 {
                carry_from = had_table.iter().rposition(|h| *h).map_or(0, |t| t + 1);
            }
        }
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
        let placed: Vec<Placed<'_>> = current
            .iter()
            .map(|(n, r)| (table_of(n, tables), r))
            .collect();
        // The written ports, each with its table.
        let written: Vec<(&ServicePortName, &ServiceRules, usize)> = write
            .iter()
            .filter_map(|n| current.get_key_value(n))
            .map(|(n, r)| (n, r, table_of(n, tables)))
            .collect();
        // What the rewritten service ports had in the maps (an incremental sync changes
        // only that).
        let old_elements = (!full)
            .then(|| wanted_elements(replaced.iter().map(|(n, r)| (table_of(n, tables), r))));
        // What an incremental sync deletes: the rewritten ports' chains and sets nobody
        // wants now, in their table. Names are the service port's own (its key is in
        // them), so only the ports it writes can want them again. (A full sync starts
        // from empty tables.)
        let mut stale_chains = BTreeSet::new();
        let mut stale_sets = BTreeSet::new();
        if !full {
            for (name, old) in &replaced {
                let t = table(name);
                stale_chains.extend(old.chains.iter().map(|(c, _)| (t.clone(), c.clone())));
                stale_sets.extend(old.sets.iter().map(|(s, _)| (t.clone(), s.clone())));
            }
            let mut wanted_chains = BTreeSet::new();
            let mut wanted_sets = BTreeSet::new();
            for (name, r, _) in &written {
                let t = table(name);
                wanted_chains.extend(r.chains.iter().map(|(c, _)| (t.clone(), c.clone())));
                wanted_sets.extend(r.sets.iter().map(|(s, _)| (t.clone(), s.clone())));
            }
            stale_chains.retain(|c| !wanted_chains.contains(c));
            stale_sets.retain(|s| !wanted_sets.contains(s));
        }

        let mut carried = Vec::new();
        for (name, rules) in &current {
            let from = table_of(name, carry_from);
            if !full || !had_table[from] {
                continue;
            }
            for (set, timeout) in &rules.sets {
                let clients = self.nft.address_elements(ip, &table_name(from), set)?;
                // The timeout may have been lowered since: no client keeps more than it.
                let most = u64::from(*timeout) * 1000;
                carried.extend(clients.into_iter().map(|mut c| {
                    c.expires_ms = c.expires_ms.map(|ms| ms.min(most));
                    (table_of(name, tables), set.clone(), c)
                }));
            }
        }

        // The maps: refilled (full: every element of `elements` is written) or changed
        // element by element.
        let state = &mut self.families[i];
        let mut elements = std::mem::take(&mut state.elements);
        let map_changes = match &old_elements {
            None => {
                elements = wanted_elements(placed.iter().copied());
                BTreeMap::new()
            }
            Some(old) => {
                let new = wanted_elements(written.iter().map(|(_, r, t)| (*t, *r)));
                let written_rules: BTreeSet<*const ServiceRules> =
                    written.iter().map(|(_, r, _)| *r as *const _).collect();
                update_elements(&mut elements, old, &new, &placed, &written_rules)
            }
        };
        // A full sync is a transaction per table, each table deleted and written again
        // in its own: packets see the old table or the new one, never neither (the kernel
        // swaps them at commit), and no transaction holds the kernel for the whole
        // ruleset (one of 100 000 services took 47 s without rescheduling: soft lockups).
        // A service port is in one table, so each table is whole on its own; while they
        // are replaced one by one a port that changes table may be in two for a moment,
        // which translates it the same either way. An incremental sync is one transaction.
        // Each transaction's script is built just before it is sent (at 100 000 services
        // the scripts of all tables together are ~550 MB).
        let transactions = if full { tables } else { 1 };
        let slot = |t: usize| if full { t } else { 0 };
        let mut applied = Ok(());
        for s in 0..transactions {
            let mut out = if full {
                let name = table_name(s);
                let mut out = format!(
                    "add table {ip} {name}\ndelete table {ip} {name}\nadd table {ip} {name}\n"
                );
                self.static_part(&ctx, s, &mut out);
                out
            } else {
                format!("add table {ip} {TABLE}\n")
            };
            let mine = || written.iter().filter(|(_, _, t)| slot(*t) == s);
            // 1. Every new object first, so rules and elements can name them.
            for (name, rules, _) in mine() {
                let t = table(name);
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
            for (name, rules, _) in mine() {
                let t = table(name);
                for (chain, lines) in &rules.chains {
                    if !full {
                        let _ = writeln!(out, "flush chain {t} {chain}");
                    }
                    for line in lines {
                        let _ = writeln!(out, "add rule {t} {chain} {line}");
                    }
                }
            }
            // 3. The maps.
            let add = |out: &mut String, (ti, map): (usize, &str), added: Vec<String>| {
                if !added.is_empty() {
                    let t = format!("{ip} {}", table_name(ti));
                    let _ = writeln!(out, "add element {t} {map} {{ {} }}", added.join(", "));
                }
            };
            if full {
                for (at, all) in elements.iter().filter(|((t, _), _)| *t == s) {
                    add(
                        &mut out,
                        *at,
                        all.iter().map(|(k, v)| element(k, v)).collect(),
                    );
                }
            }
            for ((ti, map), change) in map_changes.iter().filter(|((t, _), _)| slot(*t) == s) {
                if !change.removed.is_empty() {
                    let _ = writeln!(
                        out,
                        "delete element {ip} {} {map} {{ {} }}",
                        table_name(*ti),
                        change.removed.join(", ")
                    );
                }
                let added = change.added.iter().map(|(k, v)| element(k, v)).collect();
                add(&mut out, (*ti, map), added);
            }
            // Affinity: each client keeps its endpoint for the time it had left.
            for (ti, set, client) in carried.iter().filter(|(t, _, _)| slot(*t) == s) {
                let t = format!("{ip} {}", table_name(*ti));
                let _ = match client.expires_ms {
                    Some(ms) if ms > 0 => writeln!(
                        out,
                        "add element {t} {set} {{ {} expires {ms}ms }}",
                        client.key
                    ),
                    _ => writeln!(out, "add element {t} {set} {{ {} }}", client.key),
                };
            }
            // 4. What nobody wants any more (incremental syncs): emptied first, as chains
            // may jump to each other. After a full sync's last table, the tables beyond the
            // wanted number (an agent that had more) go.
            if s + 1 == transactions {
                for (t, chain) in &stale_chains {
                    let _ = writeln!(out, "flush chain {t} {chain}");
                }
                for (t, chain) in &stale_chains {
                    let _ = writeln!(out, "delete chain {t} {chain}");
                }
                for (t, set) in &stale_sets {
                    let _ = writeln!(out, "delete set {t} {set}");
                }
                if full {
                    delete_tables(&mut out, ip, tables);
                }
            }
            applied = self.nft.apply(&out);
            if applied.is_err() {
                break;
            }
        }
        let written_count = written.len();
        drop(placed);
        drop(written);
        let state = &mut self.families[i];
        state.services = current;
        match applied {
            Ok(()) => {
                let state = &mut self.families[i];
                state.elements = elements;
                state.needs_full = false;
                state.tables = tables;
                Ok(written_count)
            }
            Err(e) => {
                let state = &mut self.families[i];
                state.needs_full = true;
                self.failures += 1;
                Err(e).with_context(|| {
                    format!(
                        "an {ip} nftables transaction failed; the next sync rewrites the tables"
                    )
                })
            }
        }
    }
}

/// Deletes the `kube-proxy` tables of both families (this agent's nftables mode, and
/// upstream kube-proxy's) and the service tables beside them; returns how many families
/// had any.
pub fn remove_all(nft: &mut impl Nft) -> Result<usize> {
    let mut removed = 0;
    for ip in ["ip", "ip6"] {
        let had = nft.has_table(ip, TABLE)?;
        let mut script = String::new();
        delete_tables(&mut script, ip, 0);
        nft.apply(&script)?;
        removed += had as usize;
    }
    Ok(removed)
}

impl<N: Nft> FamilyTables for NftablesProxier<N> {
    fn needs_full(&self, family: IpFamily) -> bool {
        self.families[index(family)].needs_full
    }

    fn full_needed(&self, family: IpFamily, desired: &DesiredState) -> bool {
        NftablesProxier::full_needed(self, family, desired)
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
