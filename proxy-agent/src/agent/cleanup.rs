//! Removing what proxy modes left on the node, ours and upstream kube-proxy's: every mode
//! for `--cleanup`, every mode but the running one once it serves (a mode switch by
//! restart), as kube-proxy does at start.
//!
//! Order matters: nftables tables first (iptables-nft reads the whole nf_tables ruleset,
//! minutes behind a large kube-proxy table), iptables rules before ipsets (a set in use
//! cannot be destroyed), then local routes and the eBPF datapath.

use anyhow::{bail, Result};
use tracing::{debug, info, warn};

use crate::{
    cli::Settings,
    datapath::cleanup::remove_datapath,
    kernel::local_routes,
    model::IpFamily,
    proxier::{
        iptables::{cleanup as iptables_cleanup, tables::IptablesCommands},
        ipvs::{
            self as ipvs_mode,
            ipset::{IpSets, IpsetCommand},
            netlink::{Ipvs, KernelIpvs},
        },
        nftables::{
            self,
            netlink::{self, NftNetlink},
        },
        ProxyMode,
    },
};

/// The modes in removal order.
const ORDER: [ProxyMode; 5] = [
    ProxyMode::Nftables,
    ProxyMode::Iptables,
    ProxyMode::Ipvs,
    ProxyMode::Userspace,
    ProxyMode::Ebpf,
];

/// Removes every mode's state but `keep`'s. Each mode is tried whatever the others did;
/// each removal is logged, each failure warned about, and the failures are returned
/// together.
pub async fn remove_modes(keep: Option<ProxyMode>, s: &Settings) -> Result<()> {
    let mut failures = Vec::new();
    for mode in ORDER.into_iter().filter(|m| Some(*m) != keep) {
        match remove_mode(mode, keep, s).await {
            Ok(None) => debug!("{mode} mode: nothing to remove"),
            Ok(Some(removed)) => info!("{mode} mode: removed {removed}"),
            Err(e) => {
                warn!("{mode} mode: removing its state: {e:#}");
                failures.push(format!("{mode}: {e:#}"));
            }
        }
    }
    if !failures.is_empty() {
        bail!("cleanup incomplete: {}", failures.join("; "));
    }
    Ok(())
}

/// Removes one mode's state; what it removed, `None` for nothing (or no such facility on
/// this node).
async fn remove_mode(
    mode: ProxyMode,
    keep: Option<ProxyMode>,
    s: &Settings,
) -> Result<Option<String>> {
    let some = |n: usize, what: String| (n > 0).then_some(what);
    Ok(match mode {
        ProxyMode::Nftables => {
            remove_nftables_tables()?.and_then(|n| some(n, format!("{n} nftables tables")))
        }
        ProxyMode::Iptables => {
            // The ipvs mode writes a few of the same chains itself (already, by now).
            let kept = if keep == Some(ProxyMode::Ipvs) {
                ipvs_mode::IPTABLES_CHAINS
            } else {
                &[]
            };
            remove_iptables_rules(kept)?.and_then(|n| some(n, format!("{n} iptables chains")))
        }
        ProxyMode::Ipvs => {
            let (servers, interface, sets) = remove_ipvs_mode(&s.ipvs.options.exclude_cidrs)?;
            (servers > 0 || interface || sets > 0).then(|| {
                format!(
                    "{servers} IPVS virtual servers, {sets} ipsets{}",
                    if interface { ", kube-ipvs0" } else { "" }
                )
            })
        }
        ProxyMode::Userspace => {
            let n = local_routes::remove_all()?;
            some(n, format!("{n} local routes"))
        }
        ProxyMode::Ebpf => {
            let r = remove_datapath(&s.bpffs_root).await?;
            (r != Default::default()).then(|| {
                format!(
                    "the eBPF datapath ({} links unpinned, {} tc filters, {} qdiscs, {} maps and {} programs unpinned)",
                    r.links_unpinned, r.filters_removed, r.qdiscs_removed, r.maps_unpinned, r.programs_unpinned
                )
            })
        }
        ProxyMode::Auto => None,
    })
}

/// Removes every kube-proxy-style iptables chain (ours and upstream kube-proxy's) but
/// those in `keep`; `None` when this node has no iptables to hold any.
fn remove_iptables_rules(keep: &[&str]) -> Result<Option<usize>> {
    // Asked before the probe, which is an `iptables-save` itself.
    if !iptables_tables_present() {
        return Ok(Some(0));
    }
    let mut commands = IptablesCommands::host_default();
    if commands.probe(IpFamily::V4).is_err() {
        return Ok(None);
    }
    iptables_cleanup::remove_all(&mut commands, keep).map(Some)
}

/// Whether this network namespace has any iptables table, of either backend, to look in.
/// Asked cheaply first because `iptables-save` of the nft backend reads the whole nf_tables
/// ruleset, which a large `kube-proxy` nftables table makes a minutes-long wait.
fn iptables_tables_present() -> bool {
    // The legacy backend's tables in use here.
    let legacy = ["/proc/net/ip_tables_names", "/proc/net/ip6_tables_names"]
        .iter()
        .any(|p| std::fs::read_to_string(p).is_ok_and(|t| !t.trim().is_empty()));
    if legacy {
        return true;
    }
    // The nft backend's are nf_tables tables named as iptables' (`table ip nat`).
    ["ip", "ip6"].iter().any(|family| {
        ["nat", "filter", "mangle", "raw", "security"]
            .iter()
            .any(|table| {
                // Unknown (no nf_tables here, say): look.
                nftables::netlink::table_exists(family, table).unwrap_or(true)
            })
    })
}

/// Removes the `kube-proxy` nftables tables (ours and upstream kube-proxy's); `None` when
/// this node has no nftables.
fn remove_nftables_tables() -> Result<Option<usize>> {
    if netlink::probe().is_err() {
        return Ok(None);
    }
    // Over netlink: nft would fetch the whole ruleset first (minutes behind a table of
    // 100 000 services).
    nftables::remove_all(&mut NftNetlink::default()).map(Some)
}

/// Removes the ipvs mode's IPVS virtual servers (outside excludeCIDRs), `kube-ipvs0` and
/// `KUBE-` ipsets (ours or kube-proxy's); nothing where the node has no IPVS or ipset.
/// Runs after the iptables rules are gone (sets in use cannot be destroyed).
fn remove_ipvs_mode(exclude_cidrs: &[crate::model::Cidr]) -> Result<(usize, bool, usize)> {
    let mut ipvs = KernelIpvs::open().ok();
    let mut sets = IpsetCommand.probe().ok().map(|()| IpsetCommand);
    ipvs_mode::remove_all(
        ipvs.as_mut().map(|i| i as &mut dyn Ipvs),
        sets.as_mut().map(|s| s as &mut dyn IpSets),
        exclude_cidrs,
    )
}
