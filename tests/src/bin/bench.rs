//! Datapath cost per packet, measured by the kernel (`BPF_PROG_TEST_RUN` duration), for new and
//! established flows with 1 to 100 000 services in the maps.
//!
//! Every packet is a different flow, and the flows are spread over all the services, so the
//! figure is the cost of real lookups across the maps, not of one cached entry repeated.
//! Each run is timed on its own (repeat = 1: a repeated run would see its own rewritten
//! packet) and the median and mean over all runs are reported. The whole series is measured
//! twice, in opposite orders, and averaged, because a datapath measured right after a
//! larger one was torn down runs measurably slower while the kernel frees the old maps.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use anyhow::{bail, Result};
use clap::{ArgAction, Parser};
use proxy_agent::{
    datapath::DatapathSizes,
    model::{Frontend, Protocol},
    proxier::ebpf::sync::{FrontendSpec, HeaderSettings},
};
use proxy_tests::{
    kernel::{kernel_tests_unavailable, Hook, TestDatapath, TC_ACT_UNSPEC},
    packet::{ipv6::PacketSpec6, PacketSpec, TCP_ACK, TCP_SYN},
};

/// Datapath cost per packet, timed by the kernel (BPF_PROG_TEST_RUN, tc ingress), for new and
/// established flows by the number of services in the maps; prints a Markdown table.
#[derive(Debug, Parser)]
#[command(name = "bench", args_override_self = true)]
struct Args {
    /// The service counts to measure, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        action = ArgAction::Set,
        value_name = "N,..",
        value_parser = number,
        default_value = "1,1000,10000,100000"
    )]
    services: Vec<u32>,
    /// Distinct flows per round, spread over all the services.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    flows: u32,
    /// Rounds of new and established flows, each with flows never seen before.
    #[arg(long, value_name = "N", default_value_t = 5)]
    rounds: u32,
    /// Backends per service.
    #[arg(long, value_name = "N", default_value_t = 2)]
    backends: u32,
    /// Every service with ClientIP affinity, source ranges and masquerading (every lookup).
    #[arg(long)]
    all_features: bool,
    /// IPv6 services, clients and backends (every packet then takes the tail call into IPv6).
    #[arg(long)]
    ipv6: bool,
    /// A follower of new flows present (`inspect flows --follow`, at its default rate and
    /// reading nothing), to measure what following costs; without it, no one follows.
    #[arg(long)]
    flow_listener: bool,
    /// Also write the table (Markdown) to this file, besides standard output.
    #[arg(long, value_name = "FILE")]
    out: Option<std::path::PathBuf>,
    /// Instead: N Maglev frontends, and the MAGLEV map's memory by bpftool (other flags unused).
    #[arg(long, value_name = "N")]
    maglev_memory: Option<u32>,
}

/// A number, blanks around it allowed (as in `--services "1, 1000"`).
fn number(value: &str) -> Result<u32, std::num::ParseIntError> {
    value.trim().parse()
}

fn vip(i: u32) -> Ipv4Addr {
    // 10.96.0.0/12 holds a million addresses.
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i)
}

fn client(flow: u32, round: u32) -> (Ipv4Addr, u16) {
    let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 244, 0, 0)) + (flow >> 8) + (round << 12));
    (ip, 20_000 + (flow & 0xff) as u16)
}

/// A benchmark address in the run's family: IPv4 as it is, IPv6 as fd00::a.b.c.d.
fn in_family(v4: Ipv4Addr, ipv6: bool) -> IpAddr {
    if ipv6 {
        Ipv6Addr::from(0xfd00u128 << 112 | u32::from(v4) as u128).into()
    } else {
        v4.into()
    }
}

/// A TCP frame in the address's family.
fn tcp_frame(src: IpAddr, sport: u16, dst: IpAddr, dport: u16, flags: u8) -> Vec<u8> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => PacketSpec::tcp(s, sport, d, dport, flags).build(),
        (IpAddr::V6(s), IpAddr::V6(d)) => PacketSpec6::tcp(s, sport, d, dport, flags).build(),
        _ => unreachable!("one family per run"),
    }
}

struct Stats {
    mean: f64,
    p50: f64,
}

fn summarise(mut v: Vec<f64>) -> Stats {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Stats {
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: v[v.len() / 2],
    }
}

struct Measurement {
    other: Stats,
    new: Stats,
    established: Stats,
    program_ms: f64,
}

fn measure(n_services: u32, args: &Args) -> Result<Measurement> {
    let per_service = 1 + args.backends;
    let sizes = DatapathSizes {
        services: (n_services * per_service).max(1024),
        backends: (n_services * args.backends + 1).max(1024),
        // Two entries per flow (four masqueraded); new-flow rounds each open `flows` more.
        conntrack: (args.flows * 4 * (args.rounds + 2)).max(4096),
        maglev: 1024,
    };
    let mut dp = TestDatapath::load(sizes)?;
    let ip = |v4: Ipv4Addr| in_family(v4, args.ipv6);
    if args.flow_listener {
        dp.datapath.set_flow_listener(proxy_common::FlowListener {
            until_ns: u64::MAX,
            owner: std::process::id(),
            max_per_second: proxy_agent::inspect::flows::DEFAULT_RATE,
        })?;
    }
    if args.all_features {
        dp.datapath.configure(&proxy_common::DatapathConfig {
            masquerade_addr: u32::from(Ipv4Addr::new(10, 251, 0, 1)).to_be(),
            ..proxy_common::DatapathConfig::DEFAULT
        })?;
        if let IpAddr::V6(masq) = ip(Ipv4Addr::new(10, 251, 0, 1)) {
            dp.datapath.configure6(&proxy_common::DatapathConfig6 {
                masquerade_addr: masq.octets(),
                ..Default::default()
            })?;
        }
    }
    let header = if args.all_features {
        HeaderSettings {
            flags: proxy_common::SERVICE_FLAG_MASQUERADE_ALL,
            affinity_timeout: 10800,
        }
    } else {
        HeaderSettings::default()
    };
    let prefix = if args.ipv6 { 96 + 16 } else { 16 };
    let all_ranges = [(ip(Ipv4Addr::new(10, 244, 0, 0)), prefix)];
    let ranges: &[(std::net::IpAddr, u8)] = if args.all_features { &all_ranges } else { &[] };
    let started = std::time::Instant::now();
    for s in 0..n_services {
        let backends: Vec<SocketAddr> = (0..args.backends)
            .map(|b| {
                let ip =
                    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + s * args.backends + b);
                SocketAddr::new(in_family(ip, args.ipv6), 8080)
            })
            .collect();
        let frontend = Frontend {
            addr: ip(vip(s)),
            port: 80,
            protocol: Protocol::Tcp,
        };
        let spec = FrontendSpec {
            header,
            source_ranges: ranges,
            ..FrontendSpec::new(&backends)
        };
        dp.sync.set_with(frontend, &spec)?;
    }
    let program_ms = started.elapsed().as_secs_f64() * 1000.0;

    let frames = |round: u32, flags: u8| -> Vec<Vec<u8>> {
        (0..args.flows)
            .map(|f| {
                let (client_ip, port) = client(f, round);
                tcp_frame(ip(client_ip), port, ip(vip(f % n_services)), 80, flags)
            })
            .collect()
    };

    let mut new_ns = Vec::new();
    let mut est_ns = Vec::new();
    let mut other_ns = Vec::new();
    for round in 0..args.rounds {
        // Not for a service: parse, conntrack miss, service miss.
        for f in 0..args.flows {
            let (client_ip, port) = client(f, round);
            let frame = tcp_frame(
                ip(client_ip),
                port,
                ip(Ipv4Addr::new(10, 112, 0, 1)),
                80,
                TCP_SYN,
            );
            other_ns.push(dp.time(Hook::Ingress, &frame, 1)?);
        }
        // New flows: tuples never seen before.
        let mut sent = Vec::new();
        for frame in frames(round, TCP_SYN) {
            let (_, out, t) = dp.run_timed(Hook::Ingress, &frame)?;
            new_ns.push(t);
            sent.push(out);
        }
        // Untimed: each backend answers and its client speaks again, which confirms the flow
        // (it moves to CONNTRACK), as a real connection's handshake does.
        for (out, ack) in sent.iter().zip(frames(round, TCP_ACK)) {
            let (from, to) = proxy_tests::packet::ends(out);
            let reply = tcp_frame(
                to.ip(),
                to.port(),
                from.ip(),
                from.port(),
                TCP_SYN | TCP_ACK,
            );
            // Replies are restored at egress, toward the client (netfilter between).
            dp.run(Hook::Egress, &reply)?;
            dp.run(Hook::Ingress, &ack)?;
        }
        // Established: the same flows again.
        for frame in frames(round, TCP_ACK) {
            est_ns.push(dp.time(Hook::Ingress, &frame, 1)?);
        }
    }
    // Sanity checks that the measured path is the translating one: every flow was
    // confirmed (established packets hit CONNTRACK first), and a packet leaves translated.
    let confirmed = dp
        .datapath
        .stats()?
        .into_iter()
        .find(|(s, _)| *s == proxy_common::Stat::FlowConfirmed)
        .map_or(0, |(_, n)| n);
    let flows = u64::from(args.flows) * u64::from(args.rounds);
    if confirmed < flows {
        bail!("{confirmed} of {flows} flows confirmed: the established path measured is not the one a real connection takes");
    }
    let first = &frames(0, TCP_ACK)[0];
    let (verdict, out) = dp.run(Hook::Ingress, first)?;
    if verdict != TC_ACT_UNSPEC
        || proxy_tests::packet::ends(&out) == proxy_tests::packet::ends(first)
    {
        bail!("an established packet was not translated (verdict {verdict})");
    }
    Ok(Measurement {
        other: summarise(other_ns),
        new: summarise(new_ns),
        established: summarise(est_ns),
        program_ms,
    })
}

fn average(a: &Measurement, b: &Measurement) -> Measurement {
    let avg = |x: &Stats, y: &Stats| Stats {
        mean: (x.mean + y.mean) / 2.0,
        p50: (x.p50 + y.p50) / 2.0,
    };
    Measurement {
        other: avg(&a.other, &b.other),
        new: avg(&a.new, &b.new),
        established: avg(&a.established, &b.established),
        program_ms: (a.program_ms + b.program_ms) / 2.0,
    }
}

/// `--maglev-memory N`: N Maglev (mh) frontends with Cilium's table size, and the kernel's
/// own account of the MAGLEV map's memory (bpftool's `memlock`, which kernels >= 6.4 compute
/// from what the map holds).
fn maglev_memory(frontends: u32) -> Result<()> {
    let table = 16381;
    let sizes = DatapathSizes {
        maglev: frontends * table + 1024,
        ..DatapathSizes::default()
    };
    let mut dp = TestDatapath::load(sizes)?;
    dp.sync.set_maglev_size(table);
    let backends: Vec<SocketAddr> = (1..=10)
        .map(|b| SocketAddr::new(Ipv4Addr::new(10, 128, 0, b).into(), 8080))
        .collect();
    for s in 0..frontends {
        let frontend = Frontend {
            addr: vip(s).into(),
            port: 80,
            protocol: Protocol::Tcp,
        };
        let spec = FrontendSpec {
            header: HeaderSettings {
                flags: proxy_common::scheduler::MH << proxy_common::SERVICE_SCHEDULER_SHIFT,
                affinity_timeout: 0,
            },
            ..FrontendSpec::new(&backends)
        };
        dp.sync.set_with(frontend, &spec)?;
    }
    // The newest map of that name is ours (the agent's maps were taken by the sync).
    let out = std::process::Command::new("bpftool")
        .args(["map", "show", "name", proxy_common::map_names::MAGLEV])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let text = text
        .split("\n")
        .filter(|l| l.contains("memlock") || l.contains("name MAGLEV"))
        .collect::<Vec<_>>()
        .join(" ");
    let text = text.rsplit("name MAGLEV").next().unwrap_or("").to_string();
    let bytes: u64 = text
        .split_whitespace()
        .skip_while(|w| *w != "memlock")
        .nth(1)
        .and_then(|b| b.trim_end_matches('B').parse().ok())
        .unwrap_or(0);
    let per_frontend = bytes as f64 / frontends as f64;
    println!(
        "MAGLEV map: {frontends} mh frontends x {table} entries: {bytes} bytes (bpftool memlock) = {:.0} KiB per frontend; at 100 000 mh service ports: {:.1} GiB",
        per_frontend / 1024.0,
        per_frontend * 100_000.0 / (1u64 << 30) as f64
    );
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(reason) = kernel_tests_unavailable() {
        bail!("cannot benchmark: {reason}");
    }
    if let Some(n) = args.maglev_memory {
        return maglev_memory(n);
    }
    use std::fmt::Write as _;
    let mut text = format!(
        "BPF_PROG_TEST_RUN, tc ingress, {} TCP, {} backends/service, {} distinct flows x {} rounds, kernel-timed per packet{}{}, kernel {}\n\n",
        if args.ipv6 { "IPv6" } else { "IPv4" },
        args.backends,
        args.flows,
        args.rounds,
        if args.all_features {
            "; every service with ClientIP affinity, source ranges and masquerading"
        } else {
            ""
        },
        if args.flow_listener {
            "; a follower of new flows present (inspect flows --follow, default rate, not reading)"
        } else {
            ""
        },
        std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim()
    );
    print!("{text}");
    let mut forward = Vec::new();
    for &n in &args.services {
        forward.push(measure(n, &args)?);
    }
    let mut backward = Vec::new();
    for &n in args.services.iter().rev() {
        backward.push(measure(n, &args)?);
    }
    backward.reverse();
    text.push_str(
        "| services | not a service p50 (mean) ns | new flow p50 (mean) ns | established p50 (mean) ns | established vs first row (p50) | programming the maps |\n\
         |---:|---:|---:|---:|---:|---:|\n",
    );
    let mut baseline = None;
    for (i, &n) in args.services.iter().enumerate() {
        let m = average(&forward[i], &backward[i]);
        let base = *baseline.get_or_insert(m.established.p50);
        let _ = writeln!(
            text,
            "| {n} | {:.0} ({:.0}) | {:.0} ({:.0}) | {:.0} ({:.0}) | {:.2}x | {:.0} ms |",
            m.other.p50,
            m.other.mean,
            m.new.p50,
            m.new.mean,
            m.established.p50,
            m.established.mean,
            m.established.p50 / base,
            m.program_ms
        );
    }
    let table = &text[text.find("| services").unwrap_or(0)..];
    print!("{table}");
    if let Some(path) = &args.out {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, &text)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
    }

    #[test]
    fn flags_keep_their_defaults_and_syntax() {
        Args::command().debug_assert();
        let a = parse(&[]).unwrap();
        assert_eq!(a.services, [1, 1_000, 10_000, 100_000]);
        assert_eq!((a.flows, a.rounds, a.backends), (10_000, 5, 2));
        assert!(!a.all_features && !a.ipv6 && a.out.is_none() && a.maglev_memory.is_none());
        assert!(!a.flow_listener);
        let a = parse(&[
            "--services",
            "1, 100000",
            "--all-features",
            "--ipv6",
            "--out",
            "target/modebench/per-packet.md",
        ])
        .unwrap();
        assert_eq!(a.services, [1, 100_000]);
        assert!(a.all_features && a.ipv6);
        assert_eq!(
            a.out.unwrap(),
            std::path::Path::new("target/modebench/per-packet.md")
        );
        assert_eq!(
            parse(&["--maglev-memory", "100"]).unwrap().maglev_memory,
            Some(100)
        );
        for bad in [
            &["--bogus"][..],
            &["--service", "1"],
            &["--services", "1,x"],
            &["--maglev-memory"],
            &["stray"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
