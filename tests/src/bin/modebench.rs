//! Every proxy mode side by side on this kernel (`cargo xtask bench`): for each service
//! count, one lab per mode (its own node namespace, so every mode's datapath is up at
//! once) plus one without any proxy, then rounds that visit the targets in turn (none,
//! ebpf, iptables, …, none, ebpf, …) so drift on a shared machine shows as spread instead
//! of favouring one mode. Per target and round: new connections per second
//! (connect-request-close) with connect-time percentiles, transactions per second on a
//! kept-open connection, bulk TCP throughput. Per mode: the time from starting the agent
//! until the measured ClusterIP serves (cold start with N services × 10 endpoints), from
//! writing one more endpoint into the manifests until a connection reaches it, the agent's
//! peak RSS, and what it programmed (by its own metric).
//!
//! `modebench [--quick] [--modes ebpf,iptables,...] [--services 1,100,1000,10000]
//! [--rounds 3] [--seconds 2] [--serve-timeout 300] [--out DIR]` writes `DIR/results.md`
//! (the table, linking the plots), `DIR/results.json` (every raw sample) and the plots
//! `DIR/{connections,connect-p99,sync}.{svg,png}`.

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use proxy_tests::{
    bench::{
        load::{bulk_throughput, connect_rate, quantile, transaction_rate},
        plots,
        report::{self, ControlSample, Run, Sample, Workload, BASELINE},
    },
    kernel::kernel_tests_unavailable,
    lab::{client, manifest::service, Lab, LabOptions, BULK_PORT, TCP_PORT},
};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const HTTP: u16 = 80;
const BULK: u16 = 81;
/// Endpoints of every other service (addresses nothing answers on: they are only programmed).
const FILLER_ENDPOINTS: usize = 10;
const ALL_MODES: [&str; 5] = ["ebpf", "iptables", "ipvs", "nftables", "userspace"];

struct Args {
    modes: Option<Vec<String>>,
    services: Vec<usize>,
    rounds: usize,
    seconds: f64,
    serve_timeout: Duration,
    out: PathBuf,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        modes: None,
        services: vec![1, 100, 1000, 10_000],
        rounds: 3,
        seconds: 2.0,
        serve_timeout: Duration::from_secs(300),
        out: PathBuf::from("target/modebench"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--quick" {
            args.services = vec![1, 100];
            args.rounds = 2;
            args.seconds = 0.5;
            args.serve_timeout = Duration::from_secs(60);
            continue;
        }
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--modes" => args.modes = Some(value.split(',').map(String::from).collect()),
            "--services" => {
                args.services = value
                    .split(',')
                    .map(|n| n.trim().replace('_', "").parse())
                    .collect::<Result<_, _>>()
                    .context("--services: a comma-separated list of counts")?
            }
            "--rounds" => args.rounds = value.parse()?,
            "--seconds" => args.seconds = value.parse()?,
            "--serve-timeout" => args.serve_timeout = Duration::from_secs(value.parse()?),
            "--out" => args.out = PathBuf::from(value),
            other => bail!(
                "unknown flag {other} (--quick --modes a,b --services 1,100 --rounds N --seconds S --serve-timeout S --out DIR)"
            ),
        }
    }
    if args.services.contains(&0) || args.rounds == 0 {
        bail!("--services counts and --rounds must be at least 1");
    }
    Ok(args)
}

fn tool_runs(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Why this machine cannot run `mode`, if it cannot.
fn unsupported(mode: &str) -> Option<String> {
    match mode {
        "ebpf" => kernel_tests_unavailable(),
        "iptables" => (!tool_runs("iptables", &["--version"]))
            .then(|| "no iptables command (install the iptables package)".into()),
        "nftables" => {
            (!tool_runs("nft", &["--version"])).then(|| "no nft command (install nftables)".into())
        }
        "ipvs" => proxy_agent::ipvs_netlink::KernelIpvs::open()
            .err()
            .map(|_| {
                "this kernel has no IPVS: run it in the VM runner (cargo xtask vm-test)".into()
            }),
        "userspace" => None,
        other => Some(format!("no such mode {other}")),
    }
}

fn manifests(lab: &Lab, n: usize, endpoints: usize) -> String {
    let ips: Vec<Ipv4Addr> = lab.backends.iter().take(endpoints).map(|p| p.ip).collect();
    let mut yaml = service(
        "bench",
        VIP,
        &[
            ("http", "TCP", HTTP, TCP_PORT),
            ("bulk", "TCP", BULK, BULK_PORT),
        ],
        &ips,
    );
    for i in 1..n {
        // Cluster IPs from 10.112.0.0/12, endpoints from 10.128.0.0/9 (outside the lab).
        let vip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 112, 0, 0)) + i as u32);
        let eps: Vec<Ipv4Addr> = (0..FILLER_ENDPOINTS)
            .map(|e| {
                Ipv4Addr::from(
                    u32::from(Ipv4Addr::new(10, 128, 0, 0))
                        + ((i * FILLER_ENDPOINTS + e) % (1 << 23)) as u32,
                )
            })
            .collect();
        yaml.push_str(&service(
            &format!("filler-{i}"),
            vip,
            &[("http", "TCP", HTTP, TCP_PORT)],
            &eps,
        ));
    }
    yaml
}

/// Waits until a connection to `to` from the client pod is served (by the pod named
/// `by`, if given); returns how long that took.
fn wait_served(
    lab: &Lab,
    to: SocketAddrV4,
    by: Option<String>,
    timeout: Duration,
) -> Result<Duration> {
    let started = Instant::now();
    lab.client.ns.run(move || -> Result<Duration> {
        loop {
            // A short connect timeout: until the datapath serves, a SYN may vanish, and
            // the probe's resolution is this timeout (a served connect here takes well
            // under a millisecond).
            if let Ok(name) =
                client::tcp_hello_within(to, Duration::from_millis(20), Duration::from_secs(1))
            {
                if by.as_deref().is_none_or(|b| name == b) {
                    return Ok(started.elapsed());
                }
            }
            if started.elapsed() > timeout {
                bail!("not served within {} s", timeout.as_secs());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    })?
}

fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The mode's own count of what it programmed, from its metrics endpoint.
fn programmed(lab: &Lab, mode: &str) -> Option<(String, f64)> {
    let metric = match mode {
        "ebpf" => "proxy_agent_ebpf_map_entries",
        "iptables" => "kubeproxy_sync_proxy_rules_iptables_total",
        "nftables" => "proxy_agent_nftables_rules",
        "ipvs" => "proxy_agent_ipvs_virtual_servers",
        "userspace" => "proxy_agent_userspace_listeners",
        _ => return None,
    };
    let text = lab
        .node
        .run(|| -> std::io::Result<String> {
            let mut s = TcpStream::connect_timeout(
                &SocketAddr::from((Ipv4Addr::LOCALHOST, 10249)),
                Duration::from_secs(2),
            )?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
            let mut body = String::new();
            s.read_to_string(&mut body)?;
            Ok(body)
        })
        .ok()?
        .ok()?;
    // The eBPF mode's figure is its service and backend entries (not tracked flows).
    let total: f64 = text
        .lines()
        .filter(|l| l.starts_with(metric) && !l.to_ascii_lowercase().contains("conntrack"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    Some((metric.to_string(), total))
}

/// A lab with `mode`'s agent serving `n` services (or none: the baseline).
struct Target {
    name: String,
    lab: Lab,
    http: SocketAddr,
    bulk: SocketAddr,
}

fn lab_options() -> LabOptions {
    LabOptions {
        // The fourth pod joins the service for the one-change measurement.
        backends: (11..=14).map(|i| Ipv4Addr::new(10, 244, 1, i)).collect(),
        ..Default::default()
    }
}

fn agent_args(mode: &str, n: usize) -> Vec<String> {
    let mut args = vec!["--proxy-mode".to_string(), mode.to_string()];
    if mode == "ebpf" {
        let backends = (n * FILLER_ENDPOINTS + 1024).min(proxy_common::MAX_BACKENDS as usize);
        args.extend([
            "--services-map-size".into(),
            (n * (FILLER_ENDPOINTS + 2) + 1024).to_string(),
            "--backends-map-size".into(),
            backends.to_string(),
        ]);
    }
    args
}

fn start_mode(mode: &str, n: usize, args: &Args, control: &mut ControlSample) -> Result<Target> {
    let mut lab = Lab::new(lab_options())?;
    let path = lab.write_manifests(&manifests(&lab, n, 3))?;
    let extra = agent_args(mode, n);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    lab.spawn_agent(&path, &extra)?;
    let vip = SocketAddrV4::new(VIP, HTTP);
    match wait_served(&lab, vip, None, args.serve_timeout) {
        Ok(t) => control.cold_start_ms = Some(t.as_secs_f64() * 1e3),
        Err(e) => {
            let log = lab.agent().map(|a| a.log_text()).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(3).collect();
            bail!("{e:#} (agent log ends: {})", tail.join(" | "));
        }
    }
    Ok(Target {
        name: mode.to_string(),
        lab,
        http: SocketAddr::from((VIP, HTTP)),
        bulk: SocketAddr::from((VIP, BULK)),
    })
}

/// One endpoint more for the measured service: how long until a connection reaches it.
fn one_change(target: &mut Target, n: usize, args: &Args) -> Result<Duration> {
    let newcomer = target.lab.backends[3].name.clone();
    let yaml = manifests(&target.lab, n, 4);
    let started = Instant::now();
    target.lab.write_manifests(&yaml)?;
    wait_served(
        &target.lab,
        SocketAddrV4::new(VIP, HTTP),
        Some(newcomer),
        args.serve_timeout,
    )?;
    Ok(started.elapsed())
}

fn measure(
    target: &Target,
    n: usize,
    round: usize,
    seconds: f64,
    out: &mut Vec<Sample>,
) -> Result<()> {
    let d = Duration::from_secs_f64(seconds);
    let (http, bulk) = (target.http, target.bulk);
    let (rate, tps, bps) = target.lab.client.ns.run(move || -> Result<_> {
        Ok((
            connect_rate(http, d)?,
            transaction_rate(http, d)?,
            bulk_throughput(bulk, d)?,
        ))
    })??;
    let sample = |workload, value, operations| Sample {
        services: n,
        target: target.name.clone(),
        round,
        workload,
        value,
        operations,
    };
    let connections = rate.connections as u64;
    out.push(sample(
        Workload::ConnectionsPerSecond,
        rate.per_second(),
        connections,
    ));
    out.push(sample(
        Workload::ConnectP50Us,
        quantile(&rate.connect_us, 0.5),
        connections,
    ));
    out.push(sample(
        Workload::ConnectP99Us,
        quantile(&rate.connect_us, 0.99),
        connections,
    ));
    out.push(sample(
        Workload::TransactionsPerSecond,
        tps,
        (tps * seconds) as u64,
    ));
    out.push(sample(
        Workload::BulkBytesPerSecond,
        bps,
        (bps * seconds) as u64,
    ));
    Ok(())
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let started = Instant::now();
    let mut run = Run {
        command: std::iter::once("modebench".to_string())
            .chain(std::env::args().skip(1))
            .collect::<Vec<_>>()
            .join(" "),
        date: String::from_utf8_lossy(
            &Command::new("date")
                .args(["-u", "+%Y-%m-%d %H:%M UTC"])
                .output()?
                .stdout,
        )
        .trim()
        .to_string(),
        kernel: kernel(),
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        environment: std::env::var("PROXY_BENCH_ENVIRONMENT").unwrap_or_else(|_| "host".into()),
        rounds: args.rounds,
        seconds_per_workload: args.seconds,
        ..Default::default()
    };
    let requested: Vec<String> = args
        .modes
        .clone()
        .unwrap_or_else(|| ALL_MODES.iter().map(|m| m.to_string()).collect());
    let mut modes = Vec::new();
    for mode in requested {
        match unsupported(&mode) {
            None => modes.push(mode),
            Some(why) => run.skipped.push((mode, why)),
        }
    }

    // Steps: per count, each mode's start and change, and every target's rounds.
    let steps = args.services.len() * (2 * modes.len() + args.rounds * (modes.len() + 1));
    let bar = ProgressBar::new(steps as u64).with_style(
        ProgressStyle::with_template("[{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .expect("a valid template"),
    );
    for &n in &args.services {
        let baseline_lab = Lab::new(lab_options())?;
        let pod = baseline_lab.backends[0].ip;
        let mut targets = vec![Target {
            name: BASELINE.into(),
            http: SocketAddr::from((IpAddr::V4(pod), TCP_PORT)),
            bulk: SocketAddr::from((IpAddr::V4(pod), BULK_PORT)),
            lab: baseline_lab,
        }];
        for mode in &modes {
            bar.set_message(format!("{n} services: starting {mode}"));
            let mut control = ControlSample {
                services: n,
                mode: mode.clone(),
                ..Default::default()
            };
            match start_mode(mode, n, &args, &mut control) {
                Ok(t) => targets.push(t),
                Err(e) => control.note = Some(format!("{e:#}")),
            }
            run.control.push(control);
            bar.inc(1);
        }
        for round in 0..args.rounds {
            for target in &targets {
                bar.set_message(format!(
                    "{n} services: round {} of {}, {}",
                    round + 1,
                    args.rounds,
                    target.name
                ));
                measure(target, n, round, args.seconds, &mut run.samples)
                    .with_context(|| format!("{} at {n} services", target.name))?;
                bar.inc(1);
            }
            // A mode that failed to start still takes its place in the count.
            bar.inc((modes.len() + 1 - targets.len()) as u64);
        }
        for target in targets.iter_mut().skip(1) {
            bar.set_message(format!("{n} services: one change, {}", target.name));
            let changed = one_change(target, n, &args);
            let pid = target.lab.agent().map(|a| a.pid());
            let objects = programmed(&target.lab, &target.name);
            let control = run
                .control
                .iter_mut()
                .find(|c| c.services == n && c.mode == target.name)
                .expect("a control record per started mode");
            match changed {
                Ok(t) => control.one_change_ms = Some(t.as_secs_f64() * 1e3),
                Err(e) => control.note = Some(format!("one change: {e:#}")),
            }
            control.peak_rss_kib = pid.and_then(peak_rss_kib);
            control.datapath_objects = objects;
            bar.inc(1);
        }
        bar.inc((modes.len() + 1 - targets.len()) as u64);
        drop(targets);
    }
    bar.finish_and_clear();
    run.duration_s = started.elapsed().as_secs_f64();

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    // The raw samples first: they stay even if a plot cannot be drawn.
    write(
        &args.out.join("results.json"),
        &serde_json::to_string_pretty(&run)?,
    )?;
    let mut table = report::markdown(&run);
    table.push('\n');
    for file in plots::write_all(&run, &args.out)? {
        if file.extension().is_some_and(|e| e == "svg") {
            let name = file.file_name().unwrap_or_default().to_string_lossy();
            table.push_str(&format!("![{name}]({name})\n"));
        }
    }
    write(&args.out.join("results.md"), &table)?;
    print!("{table}");
    eprintln!("raw samples: {}", args.out.join("results.json").display());
    let problems = report::problems(&run);
    if !problems.is_empty() {
        bail!("the run is incomplete: {}", problems.join("; "));
    }
    Ok(())
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
