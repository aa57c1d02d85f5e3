//! Control-plane cost per proxy mode: how long a sync takes for N services × 10 endpoints,
//! cold (everything written into an empty datapath) and for one changed service (one
//! endpoint replaced), against the real kernel facility of each mode (eBPF maps,
//! `iptables-restore`, `nft`, IPVS over generic netlink with `kube-ipvs0` and ipsets, local
//! routes and listening sockets), each in a network namespace of its own. A mode the kernel
//! cannot run (ipvs without IPVS) gets a row saying why.
//!
//! `syncbench [--modes ebpf,iptables,ipvs,nftables,userspace] [--services 1000,10000] [--changes 5]`
//! (also `iptables-legacy`, `iptables-nft`, and `nftables-nft`: every nftables transaction
//! through `nft -f`, for comparison with the netlink path of incremental syncs)
//! prints a Markdown table; the one-change figure is the median of `--changes` syncs
//! (min–max beside it). `iptables-legacy` / `iptables-nft` force an iptables backend
//! (`iptables` is whichever the host's is).

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{atomic::Ordering, Arc},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::{ArgAction, Parser};
use proxy_agent::{
    datapath::{Datapath, DatapathSizes, LoadOptions},
    kernel::{
        conntrack::flows::ConntrackFlows,
        local_routes::{DummyAddresses, KernelLocalRoutes, LocalRoutes},
    },
    model::{diff, local::LocalTraffic, DesiredState, ServicePortState},
    proxier::{
        ebpf::{maps::KernelMaps, EbpfProxier},
        iptables::tables::IptablesCommands,
        iptables::IptablesProxier,
        ipvs::{ipset::IpsetCommand, netlink::KernelIpvs, IpvsKernel, IpvsOptions, IpvsProxier},
        nftables::NftablesProxier,
        nftables::{netlink::NftNetlink, nft::NftCommand},
        userspace::UserspaceProxier,
        userspace::DEFAULT_UDP_IDLE_TIMEOUT,
        Proxier,
    },
};
use proxy_tests::lab::{Netns, LAB_COUNTER, PREFIX};

const ENDPOINTS: u32 = 10;

/// Control-plane cost per proxy mode: the time of a cold sync of N services × 10 endpoints
/// and of syncs that change one endpoint, against each mode's real kernel facility in a
/// network namespace of its own (needs root); prints a Markdown table.
#[derive(Debug, Parser)]
#[command(name = "syncbench", args_override_self = true)]
struct Args {
    /// The modes, comma-separated; also iptables-legacy, iptables-nft and nftables-nft.
    #[arg(
        long,
        value_delimiter = ',',
        action = ArgAction::Set,
        value_name = "MODE,..",
        default_value = "ebpf,iptables,ipvs,nftables,userspace"
    )]
    modes: Vec<String>,
    /// The service counts, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        action = ArgAction::Set,
        value_name = "N,..",
        value_parser = number,
        default_value = "1000,10000"
    )]
    services: Vec<u32>,
    /// One-endpoint changes timed per mode and count (their median is reported, min–max beside).
    #[arg(long, value_name = "N", default_value_t = 5)]
    changes: usize,
}

/// A number, blanks around it allowed (as in `--services "1000, 10000"`).
fn number(value: &str) -> Result<u32, std::num::ParseIntError> {
    value.trim().parse()
}

fn endpoint(service: u32, index: u32, generation: u32) -> SocketAddr {
    // 10.128.0.0/9: room for 100 000 services × 10 endpoints and their replacements.
    let base = u32::from(Ipv4Addr::new(10, 128, 0, 0));
    let n = base + (service * (ENDPOINTS + 8) + index + generation) % (1 << 23);
    SocketAddr::new(IpAddr::V4(Ipv4Addr::from(n)), 8080)
}

fn service(i: u32, generation: u32) -> Arc<ServicePortState> {
    let vip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i);
    let backends = (0..ENDPOINTS)
        .map(|e| endpoint(i, e, if e == 0 { generation } else { 0 }))
        .collect();
    Arc::new(ServicePortState::cluster_ip(
        "bench",
        &format!("svc-{i}"),
        "http",
        vip.into(),
        backends,
    ))
}

fn desired(n: u32) -> DesiredState {
    DesiredState {
        ports: (0..n)
            .map(|i| {
                let s = service(i, 0);
                (s.name.clone(), s)
            })
            .collect(),
    }
}

struct Figures {
    cold: Duration,
    changes: Vec<Duration>,
}

/// Cold sync, then `changes` syncs that each replace one endpoint of one service.
fn measure(proxier: &mut dyn Proxier, n: u32, changes: usize) -> Result<Figures> {
    let empty = DesiredState::default();
    let mut current = desired(n);
    let started = Instant::now();
    let report = proxier.sync(&current, &diff(&empty, &current))?;
    let cold = started.elapsed();
    if report.services_failed > 0 {
        bail!(
            "{} service ports were not programmed",
            report.services_failed
        );
    }
    let mut times = Vec::new();
    for c in 0..changes as u32 {
        let target = (c * 7919) % n;
        let mut next = current.clone();
        let s = service(target, c + 1);
        next.ports.insert(s.name.clone(), s);
        let changed = diff(&current, &next);
        let started = Instant::now();
        proxier.sync(&next, &changed)?;
        times.push(started.elapsed());
        current = next;
    }
    times.sort();
    Ok(Figures {
        cold,
        changes: times,
    })
}

fn run_mode(mode: &str, n: u32, changes: usize) -> Result<Figures> {
    let name = format!(
        "{PREFIX}-{}-{}-sync",
        std::process::id(),
        LAB_COUNTER.fetch_add(1, Ordering::SeqCst)
    );
    let ns = Netns::create(&name)?;
    let mode = mode.to_string();
    ns.run(move || -> Result<Figures> {
        match mode.as_str() {
            "ebpf" => {
                let sizes = DatapathSizes {
                    services: n * (1 + ENDPOINTS) + 1024,
                    backends: (n * ENDPOINTS + 1024).min(proxy_common::MAX_BACKENDS),
                    conntrack: 4096,
                    maglev: 1,
                };
                let mut datapath = Datapath::load_with(sizes, None, LoadOptions::default())?;
                let mut p = EbpfProxier::new(KernelMaps::take(&mut datapath)?);
                measure(&mut p, n, changes)
            }
            "iptables" | "iptables-legacy" | "iptables-nft" => {
                // `iptables`: whichever backend the host's `iptables` is; the others force one.
                let variant = mode
                    .strip_prefix("iptables")
                    .unwrap_or_default()
                    .to_string();
                let mut p = IptablesProxier::new(
                    IptablesCommands::variant(&variant),
                    Box::new(ConntrackFlows),
                    14,
                    &LocalTraffic::default(),
                );
                measure(&mut p, n, changes)
            }
            "nftables" => {
                let mut p =
                    NftablesProxier::new(NftNetlink::default(), Box::new(ConntrackFlows), 14, &LocalTraffic::default());
                measure(&mut p, n, changes)
            }
            // Every transaction through `nft -f`, as before incremental syncs used netlink.
            "nftables-nft" => {
                let mut p = NftablesProxier::new(NftCommand, Box::new(ConntrackFlows), 14, &LocalTraffic::default());
                measure(&mut p, n, changes)
            }
            "ipvs" => {
                let addresses: Box<dyn LocalRoutes> = match DummyAddresses::open() {
                    Ok(d) => Box::new(d),
                    Err(_) => Box::new(KernelLocalRoutes::open()?),
                };
                let mut p = IpvsProxier::new(
                    IpvsKernel {
                        ipvs: Box::new(KernelIpvs::open()?),
                        addresses,
                        tables: IptablesCommands::host_default(),
                        sets: IpsetCommand,
                        flows: Box::new(ConntrackFlows),
                    },
                    14,
                    &LocalTraffic::default(),
                    IpvsOptions::default(),
                );
                measure(&mut p, n, changes)
            }
            "userspace" => {
                // Its listeners are tokio sockets: a runtime must be current (they are
                // bound during the sync; nothing needs to run).
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                let _context = runtime.enter();
                let mut p = UserspaceProxier::new(
                    Box::new(KernelLocalRoutes::open()?),
                    DEFAULT_UDP_IDLE_TIMEOUT,
                );
                measure(&mut p, n, changes)
            }
            other => bail!(
                "no such mode {other} (ebpf, iptables, iptables-legacy, iptables-nft, ipvs, nftables, nftables-nft, userspace)"
            ),
        }
    })
    .context("the namespace thread")?
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

fn main() -> Result<()> {
    let args = Args::parse();
    println!(
        "Sync time per mode: N services × {ENDPOINTS} endpoints; cold = first sync into an empty datapath; one change = one endpoint of one service replaced (median of {}, min–max).\n",
        args.changes
    );
    println!("| mode | services | cold sync (ms) | one change (ms) | min–max (ms) |");
    println!("|---|---|---|---|---|");
    for &n in &args.services {
        for mode in &args.modes {
            match run_mode(mode, n, args.changes) {
                Ok(f) => {
                    let median = f.changes[f.changes.len() / 2];
                    println!(
                        "| {mode} | {n} | {} | {} | {}–{} |",
                        ms(f.cold),
                        ms(median),
                        ms(f.changes[0]),
                        ms(*f.changes.last().unwrap())
                    );
                }
                Err(e) => println!("| {mode} | {n} | failed: {e:#} | | |"),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("syncbench").chain(args.iter().copied()))
    }

    #[test]
    fn flags_keep_their_defaults_and_syntax() {
        Args::command().debug_assert();
        let a = parse(&[]).unwrap();
        assert_eq!(
            a.modes,
            ["ebpf", "iptables", "ipvs", "nftables", "userspace"]
        );
        assert_eq!(a.services, [1_000, 10_000]);
        assert_eq!(a.changes, 5);
        let a = parse(&[
            "--modes",
            "iptables-legacy,nftables-nft",
            "--services",
            "10, 100000",
            "--changes",
            "9",
        ])
        .unwrap();
        assert_eq!(a.modes, ["iptables-legacy", "nftables-nft"]);
        assert_eq!(a.services, [10, 100_000]);
        assert_eq!(a.changes, 9);
        // A flag given twice: the last one counts.
        let a = parse(&["--modes", "ebpf,ipvs", "--modes", "nftables"]).unwrap();
        assert_eq!(a.modes, ["nftables"]);
        for bad in [
            &["--bogus"][..],
            &["--mode", "ebpf"],
            &["--services", "x"],
            &["--changes"],
            &["stray"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
