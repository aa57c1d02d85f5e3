//! Removing every kube-proxy-style iptables rule: this agent's iptables mode and upstream
//! kube-proxy's (iptables mode, and the iptables half of its ipvs mode), so a node can move
//! between them in either direction. Chains kube-proxy shares with the kubelet are removed
//! only when nothing else jumps to them.

use std::{collections::BTreeMap, fmt::Write as _};

use anyhow::Result;

use super::tables::RuleTables;
use crate::model::IpFamily;

/// Chains kube-proxy (and this agent) own, by table.
const OWNED: &[(&str, &[&str])] = &[
    (
        "nat",
        &[
            "KUBE-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-POSTROUTING",
            "KUBE-LOAD-BALANCER",
            "KUBE-PROXY-CANARY",
            // kube-proxy's ipvs mode.
            "KUBE-NODE-PORT",
        ],
    ),
    (
        "filter",
        &[
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-FORWARD",
            "KUBE-NODEPORTS",
            "KUBE-PROXY-FIREWALL",
            "KUBE-PROXY-CANARY",
            // kube-proxy's ipvs mode.
            "KUBE-NODE-PORT",
            "KUBE-SOURCE-RANGES-FIREWALL",
            "KUBE-IPVS-FILTER",
            "KUBE-IPVS-OUT-FILTER",
        ],
    ),
    ("mangle", &["KUBE-PROXY-CANARY"]),
];

/// Per-service chain prefixes (nat).
const OWNED_PREFIXES: &[&str] = &[
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
    "KUBE-XLB-",
];

/// Shared with older kubelets: removed only if nothing but our chains jumps to them.
const SHARED: &[&str] = &["KUBE-MARK-MASQ", "KUBE-MARK-DROP"];

/// Chains and their rules (`-A` lines without `-A CHAIN `) from `iptables-save` output.
pub(crate) fn parse(saved: &str) -> BTreeMap<String, Vec<String>> {
    let mut chains: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in saved.lines() {
        if let Some(decl) = line.strip_prefix(':') {
            chains
                .entry(decl.split(' ').next().unwrap_or_default().to_string())
                .or_default();
        } else if let Some(rule) = line.strip_prefix("-A ") {
            if let Some((chain, rest)) = rule.split_once(' ') {
                chains
                    .entry(chain.to_string())
                    .or_default()
                    .push(rest.to_string());
            }
        }
    }
    chains
}

fn jump_target(rule: &str) -> Option<&str> {
    rule.split(" -j ")
        .nth(1)
        .or_else(|| rule.strip_prefix("-j "))
        .and_then(|t| t.split(' ').next())
}

/// The restore input that removes our chains from one saved table, or `None` if it has
/// none; also the number of chains removed. Chains named in `keep` stay (with their
/// rules and the jumps to them).
pub fn removal(table: &str, saved: &str, keep: &[&str]) -> Option<(String, usize)> {
    let chains = parse(saved);
    let owned = OWNED
        .iter()
        .find(|(t, _)| *t == table)
        .map_or(&[][..], |(_, c)| *c);
    let mut remove: Vec<&String> = chains
        .keys()
        .filter(|c| owned.contains(&c.as_str()) || OWNED_PREFIXES.iter().any(|p| c.starts_with(p)))
        .filter(|c| !keep.contains(&c.as_str()))
        .collect();
    for shared in SHARED {
        let used_elsewhere = chains.iter().any(|(chain, rules)| {
            !remove.contains(&chain) && rules.iter().any(|r| jump_target(r) == Some(shared))
        });
        if let Some((name, _)) = chains.get_key_value(*shared) {
            if !used_elsewhere && !keep.contains(shared) {
                remove.push(name);
            }
        }
    }
    if remove.is_empty() {
        return None;
    }
    let mut out = format!("*{table}\n");
    // Jumps into the removed chains from chains that stay (the built-in hooks).
    for (chain, rules) in &chains {
        if remove.contains(&chain) {
            continue;
        }
        for rule in rules {
            if jump_target(rule).is_some_and(|t| remove.iter().any(|r| r.as_str() == t)) {
                let _ = writeln!(out, "-D {chain} {rule}");
            }
        }
    }
    for chain in &remove {
        let _ = writeln!(out, ":{chain} - [0:0]");
    }
    for chain in &remove {
        let _ = writeln!(out, "-X {chain}");
    }
    out.push_str("COMMIT\n");
    Some((out, remove.len()))
}

/// Removes every kube-proxy-style chain and jump from both families' nat, filter and
/// mangle tables, except the chains in `keep` (those the running mode writes itself);
/// returns how many chains went.
pub fn remove_all(tables: &mut impl RuleTables, keep: &[&str]) -> Result<usize> {
    let mut removed = 0;
    for family in [IpFamily::V4, IpFamily::V6] {
        for (table, _) in OWNED {
            let saved = tables.save(family, table)?;
            if let Some((input, n)) = removal(table, &saved, keep) {
                tables.restore(family, &input)?;
                removed += n;
            }
        }
    }
    Ok(removed)
}
