//! New TCP connections per second from a pod, through a ClusterIP (the eBPF datapath) and
//! straight to a backend pod, in the same lab and the same run, with connect-latency
//! percentiles. Each connection: connect, read the backend's one-line greeting, close.
//! The two targets are measured in alternating rounds so drift affects both alike.

use std::{
    io::{BufRead, BufReader},
    net::{Ipv4Addr, SocketAddrV4, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::Parser;
use proxy_tests::{
    kernel::kernel_tests_unavailable,
    lab::{manifest::service, Lab, LabOptions, TCP_PORT},
};

const VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);

/// New TCP connections per second from a pod, through a ClusterIP (the eBPF datapath) and
/// straight to a backend pod, in 4 alternating rounds; prints a Markdown table.
#[derive(Debug, Parser)]
#[command(name = "connbench")]
struct Args {
    /// Connections per target and round.
    #[arg(value_name = "PER_ROUND", default_value_t = 1000)]
    per_round: usize,
}

#[derive(Default)]
struct Series {
    connect_us: Vec<f64>,
    seconds: f64,
    connections: usize,
}

fn one_round(to: SocketAddrV4, n: usize) -> Result<Series> {
    let mut s = Series::default();
    let started = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        let stream = TcpStream::connect_timeout(&to.into(), Duration::from_secs(2))
            .with_context(|| format!("connecting to {to}"))?;
        s.connect_us.push(t.elapsed().as_secs_f64() * 1e6);
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut line = String::new();
        BufReader::new(&stream).read_line(&mut line)?;
        s.connections += 1;
    }
    s.seconds = started.elapsed().as_secs_f64();
    Ok(s)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn main() -> Result<()> {
    let per_round = Args::parse().per_round;
    if let Some(reason) = kernel_tests_unavailable() {
        bail!("cannot benchmark: {reason}");
    }
    let rounds = 4;

    let mut lab = Lab::new(LabOptions::default())?;
    let ips: Vec<Ipv4Addr> = lab.backends.iter().map(|p| p.ip).collect();
    let manifest = service("web", *VIP.ip(), &[("", "TCP", 80, TCP_PORT)], &ips);
    let path = lab.write_manifests(&manifest)?;
    lab.start_agent(&path, &[])?;
    let direct = SocketAddrV4::new(lab.backends[0].ip, TCP_PORT);

    let (vip, pod) = lab.client.ns.run(move || -> Result<(Series, Series)> {
        // Warm up both paths (ARP, caches).
        one_round(VIP, 50)?;
        one_round(direct, 50)?;
        let mut vip = Series::default();
        let mut pod = Series::default();
        for _ in 0..rounds {
            for (target, acc) in [(VIP, &mut vip), (direct, &mut pod)] {
                let r = one_round(target, per_round)?;
                acc.connect_us.extend(r.connect_us);
                acc.seconds += r.seconds;
                acc.connections += r.connections;
            }
        }
        Ok((vip, pod))
    })??;

    println!(
        "TCP connect + greeting + close from a pod, sequential, {} connections per target in {rounds} alternating rounds",
        per_round * rounds
    );
    println!("| target | connections/s | connect p50 µs | connect p99 µs |");
    println!("|---|---:|---:|---:|");
    let mut rates = Vec::new();
    for (name, mut s) in [
        (format!("ClusterIP {VIP} (eBPF, 3 backends)"), vip),
        (format!("pod {direct} directly"), pod),
    ] {
        s.connect_us.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let rate = s.connections as f64 / s.seconds;
        rates.push(rate);
        println!(
            "| {name} | {rate:.0} | {:.0} | {:.0} |",
            percentile(&s.connect_us, 0.5),
            percentile(&s.connect_us, 0.99)
        );
    }
    println!(
        "ClusterIP / direct connection rate: {:.2}",
        rates[0] / rates[1]
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn connections_per_round_is_the_one_positional() {
        Args::command().debug_assert();
        let parse = |args: &[&str]| {
            Args::try_parse_from(std::iter::once("connbench").chain(args.iter().copied()))
        };
        assert_eq!(parse(&[]).unwrap().per_round, 1000);
        assert_eq!(parse(&["2000"]).unwrap().per_round, 2000);
        for bad in [&["x"][..], &["10", "20"], &["--bogus"]] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
