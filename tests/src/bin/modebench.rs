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
    io::{IsTerminal, Read, Write},
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::{ArgAction, Parser};
use indicatif::{ProgressBar, ProgressStyle};
use proxy_tests::{
    apiserver::ApiServer,
    bench::{
        load::{
            bulk_throughput, connect_rate, parallel_connect_rate, parallel_transaction_rate,
            quantile, transaction_rate, ConnectRate, CpuTimes,
        },
        plots,
        report::{self, ControlSample, Run, Sample, Workload, BASELINE},
    },
    kernel::kernel_tests_unavailable,
    lab::{
        client,
        manifest::{objects, service, Port},
        Lab, LabOptions, BULK_PORT, TCP_PORT,
    },
};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const HTTP: u16 = 80;
const BULK: u16 = 81;
/// The measured service's ports.
const BENCH_PORTS: [Port; 2] = [
    ("http", "TCP", HTTP, TCP_PORT),
    ("bulk", "TCP", BULK, BULK_PORT),
];
/// Endpoints of every other service (addresses nothing answers on: they are only programmed).
const FILLER_ENDPOINTS: usize = 10;
const ALL_MODES: [&str; 5] = ["ebpf", "iptables", "ipvs", "nftables", "userspace"];
/// The largest service count each mode runs at by default: 100 000 services are asked of
/// the modes built for it (ebpf, nftables); iptables needs minutes per sync well before
/// that, IPVS and the userspace proxy a kernel object or a socket per service port.
const DEFAULT_LIMITS: [(&str, usize); 3] = [
    ("iptables", 10_000),
    ("ipvs", 10_000),
    ("userspace", 10_000),
];

/// Every proxy mode side by side on this kernel, against a baseline without a proxy; writes
/// the table (results.md), every raw sample (results.json) and the plots into --out.
#[derive(Debug, Parser)]
#[command(name = "modebench", args_override_self = true)]
struct Args {
    /// A short run: 1 and 100 services, 2 rounds of 0.5 s, 60 s serve timeout (flags given win).
    #[arg(long)]
    quick: bool,
    /// The modes to run, comma-separated [default: ebpf,iptables,ipvs,nftables,userspace].
    #[arg(
        long,
        value_delimiter = ',',
        action = ArgAction::Set,
        value_name = "MODE,.."
    )]
    modes: Option<Vec<String>>,
    /// The service counts, comma-separated (`10_000` allowed; --quick: 1,100).
    #[arg(
        long,
        value_delimiter = ',',
        action = ArgAction::Set,
        value_name = "N,..",
        value_parser = count,
        default_value = "1,100,1000,10000,100000",
        default_value_if("quick", "true", Some("1,100"))
    )]
    services: Vec<usize>,
    /// The largest service count per mode (modes not listed: any); `none` lifts every limit.
    #[arg(long = "limit", value_name = "MODE=N,..|none", default_value_t = Limits::default())]
    limits: Limits,
    /// The modes whose control plane is also measured through the replayed API server
    /// (paged lists, then a watch), after the manifest source's; `none`: no API-source run.
    #[arg(
        long = "api-modes",
        value_delimiter = ',',
        action = ArgAction::Set,
        value_name = "MODE,..|none",
        default_value = "ebpf"
    )]
    api_modes: Vec<String>,
    /// Keep each agent's log in --out (`agent-MODE-N.log`, `agent-MODE-N-api.log`).
    #[arg(long = "keep-logs")]
    keep_logs: bool,
    /// Only rebuild the table and plots from DIR/results.json (a run made elsewhere, e.g. a VM).
    #[arg(long)]
    render: bool,
    /// Rounds over every target (--quick: 2).
    #[arg(
        long,
        value_name = "N",
        value_parser = count,
        default_value = "3",
        default_value_if("quick", "true", Some("2"))
    )]
    rounds: usize,
    /// Seconds each workload runs per target and round (--quick: 0.5).
    #[arg(
        long,
        value_name = "S",
        default_value = "2",
        default_value_if("quick", "true", Some("0.5"))
    )]
    seconds: f64,
    /// Client threads of the saturated workloads [default: 4 per CPU, enough to keep every
    /// core busy here].
    #[arg(long, value_name = "N", value_parser = count)]
    clients: Option<usize>,
    /// Seconds to wait for a mode's agent to serve, after a start or a change (--quick: 60).
    #[arg(
        long = "serve-timeout",
        value_name = "S",
        value_parser = whole_seconds,
        default_value = "300",
        default_value_if("quick", "true", Some("60"))
    )]
    serve_timeout: Duration,
    /// The directory the results and plots are written to (and --render reads).
    #[arg(long, value_name = "DIR", default_value = "target/modebench")]
    out: PathBuf,
}

/// A count of at least 1 (`10_000` allowed).
fn count(value: &str) -> Result<usize, String> {
    match value.trim().replace('_', "").parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("expected a count: {e}")),
    }
}

/// A timeout in whole seconds.
fn whole_seconds(value: &str) -> Result<Duration, std::num::ParseIntError> {
    value.parse().map(Duration::from_secs)
}

/// `--limit`: the largest service count per mode.
#[derive(Clone, Debug, PartialEq)]
struct Limits(Vec<(String, usize)>);

impl Default for Limits {
    fn default() -> Self {
        Limits(
            DEFAULT_LIMITS
                .iter()
                .map(|(m, n)| (m.to_string(), *n))
                .collect(),
        )
    }
}

impl std::str::FromStr for Limits {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, String> {
        parse_limits(value)
            .map(Limits)
            .map_err(|e| format!("{e:#}"))
    }
}

impl std::fmt::Display for Limits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        let pairs: Vec<String> = self.0.iter().map(|(m, n)| format!("{m}={n}")).collect();
        f.write_str(&pairs.join(","))
    }
}

/// `mode=N,mode=N` (or `none`): the largest service count per mode.
fn parse_limits(value: &str) -> Result<Vec<(String, usize)>> {
    if value == "none" {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .map(|pair| {
            let (mode, n) = pair
                .split_once('=')
                .with_context(|| format!("--limit {pair}: expected mode=N"))?;
            let n = n
                .replace('_', "")
                .parse()
                .with_context(|| format!("--limit {pair}: N is a service count"))?;
            Ok((mode.to_string(), n))
        })
        .collect()
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
        "ipvs" => proxy_agent::proxier::ipvs::netlink::KernelIpvs::open()
            .err()
            .map(|_| {
                "this kernel has no IPVS: `cargo xtask bench --vm` runs every mode with it in a VM"
                    .into()
            }),
        "userspace" => None,
        other => Some(format!("no such mode {other}")),
    }
}

/// Calls `f` with every service of a run at `n` services: the measured one (with the
/// first `endpoints` backend pods) and the fillers; both sources are fed from here.
fn each_service(
    lab: &Lab,
    n: usize,
    endpoints: usize,
    mut f: impl FnMut(&str, Ipv4Addr, &[Port], &[Ipv4Addr]),
) {
    let ips: Vec<Ipv4Addr> = lab.backends.iter().take(endpoints).map(|p| p.ip).collect();
    f("bench", VIP, &BENCH_PORTS, &ips);
    let mut eps = Vec::with_capacity(FILLER_ENDPOINTS);
    for i in 1..n {
        // Cluster IPs from 10.112.0.0/12, endpoints from 10.128.0.0/9 (outside the lab).
        let vip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 112, 0, 0)) + i as u32);
        eps.clear();
        eps.extend((0..FILLER_ENDPOINTS).map(|e| {
            Ipv4Addr::from(
                u32::from(Ipv4Addr::new(10, 128, 0, 0))
                    + ((i * FILLER_ENDPOINTS + e) % (1 << 23)) as u32,
            )
        }));
        f(
            &format!("filler-{i}"),
            vip,
            &[("http", "TCP", HTTP, TCP_PORT)],
            &eps,
        );
    }
}

fn manifests(lab: &Lab, n: usize, endpoints: usize) -> String {
    let mut yaml = String::new();
    each_service(lab, n, endpoints, |name, vip, ports, eps| {
        yaml.push_str(&service(name, vip, ports, eps))
    });
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
    let connect = proxy_tests::scaled(Duration::from_millis(20));
    lab.client.ns.run(move || -> Result<Duration> {
        loop {
            // A short connect timeout: until the datapath serves, a SYN may vanish, and
            // the probe's resolution is this timeout (a served connect here takes well
            // under a millisecond).
            if let Ok(name) = client::tcp_hello_within(to, connect, Duration::from_secs(1)) {
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

/// The agent's metrics page (served in the node namespace).
fn metrics_text(lab: &Lab) -> Option<String> {
    lab.node
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
        .ok()
}

/// The sum of every sample of `metric` (all label sets), if it has any.
fn metric_sum(text: &str, metric: &str, keep: impl Fn(&str) -> bool) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with([' ', '{']))
                && keep(l)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// The mode's own count of what it programmed, from its metrics.
fn programmed(text: &str, mode: &str) -> Option<(String, f64)> {
    let metric = match mode {
        "ebpf" => "proxy_agent_ebpf_map_entries",
        "iptables" => "kubeproxy_sync_proxy_rules_iptables_total",
        "nftables" => "proxy_agent_nftables_rules",
        "ipvs" => "proxy_agent_ipvs_virtual_servers",
        "userspace" => "proxy_agent_userspace_listeners",
        _ => return None,
    };
    // The eBPF mode's figure is its service and backend entries (not tracked flows).
    let total = metric_sum(text, metric, |l| {
        !l.to_ascii_lowercase().contains("conntrack")
    })?;
    Some((metric.to_string(), total))
}

/// The agent's sync histogram so far: (seconds summed, syncs).
fn sync_totals(text: &str) -> Option<(f64, f64)> {
    const SYNC: &str = "kubeproxy_sync_proxy_rules_duration_seconds";
    Some((
        metric_sum(text, &format!("{SYNC}_sum"), |_| true)?,
        metric_sum(text, &format!("{SYNC}_count"), |_| true)?,
    ))
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

/// A lab whose client can open connections as fast as the rounds ask: every connection
/// the client closes first waits in TIME_WAIT for 60 s holding its port, and connect()
/// takes ports from half of the range, so a round of 2 s at 6 000 connections/s used up
/// the default range for the next (rates fell to a tenth, connect p99 rose to
/// milliseconds). The client gets the whole port range, and the client and the node (the
/// userspace proxy connects from there; its port range stays clear of node ports) reuse
/// TIME_WAIT ports once that is safe (TCP timestamps), as a load-generating host would be
/// tuned.
fn bench_lab() -> Result<Lab> {
    let lab = Lab::new(lab_options())?;
    lab.client
        .ns
        .sysctl("net.ipv4.ip_local_port_range=1024 65535")?;
    for ns in [&lab.client.ns, &lab.node] {
        ns.sysctl("net.ipv4.tcp_tw_reuse=1")?;
    }
    Ok(lab)
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
    let mut lab = bench_lab()?;
    let path = lab.write_manifests(&manifests(&lab, n, 3))?;
    let extra = agent_args(mode, n);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    lab.spawn_agent(&path, &extra)?;
    control.cold_start_ms = Some(cold_start(&mut lab, args)?.as_secs_f64() * 1e3);
    Ok(Target {
        name: mode.to_string(),
        lab,
        http: SocketAddr::from((VIP, HTTP)),
        bulk: SocketAddr::from((VIP, BULK)),
    })
}

/// How long after the agent's start the measured ClusterIP served; on a timeout, the error
/// ends with the agent's last log lines.
/// From the agent's start until the measured service serves and the agent has recorded
/// its first sync: a mode that writes its datapath in several transactions (nftables'
/// tables, iptables-nft's chunks) serves some services, or ports, before others.
fn cold_start(lab: &mut Lab, args: &Args) -> Result<Duration> {
    let started = Instant::now();
    wait_served(lab, SocketAddrV4::new(VIP, HTTP), None, args.serve_timeout).map_err(|e| {
        let log = lab.agent().map(|a| a.log_text()).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(3).collect();
        anyhow::anyhow!("{e:#} (agent log ends: {})", tail.join(" | "))
    })?;
    first_sync_recorded(lab, args)?;
    Ok(started.elapsed())
}

/// Waits until the agent's metrics count a sync.
fn first_sync_recorded(lab: &Lab, args: &Args) -> Result<()> {
    let deadline = Instant::now() + args.serve_timeout;
    loop {
        if metrics_text(lab)
            .and_then(|t| sync_totals(&t))
            .is_some_and(|(_, count)| count >= 1.0)
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the agent recorded no sync within {:?}", args.serve_timeout);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// From starting the agent again (same settings, the state its predecessor left: pinned
/// maps and programs, rules) until it recorded its first sync. The datapath serves
/// throughout; this is how long a restarted agent takes to be in charge again.
fn restart(lab: &mut Lab, mode: &str, n: usize, args: &Args) -> Result<Duration> {
    // What the one change left.
    let path = lab.write_manifests(&manifests(lab, n, 4))?;
    lab.stop_agent()?;
    let extra = agent_args(mode, n);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let started = Instant::now();
    lab.spawn_agent(&path, &extra)?;
    first_sync_recorded(lab, args)?;
    Ok(started.elapsed())
}

/// What one more endpoint for the measured service cost.
struct OneChange {
    /// From writing the manifests until a connection reached the new endpoint.
    served: Duration,
    /// The agent's own syncs in that time (its sync histogram's mean over them): the
    /// datapath's share, without the manifest source's reading and settling.
    sync: Option<Duration>,
}

/// Makes `change` (one more endpoint for the measured service) and waits until a connection
/// reaches that endpoint, and for the agent's record of its sync.
fn one_change(lab: &Lab, change: impl FnOnce() -> Result<()>, args: &Args) -> Result<OneChange> {
    let newcomer = lab.backends[3].name.clone();
    let before = metrics_text(lab).and_then(|t| sync_totals(&t));
    let started = Instant::now();
    change()?;
    wait_served(
        lab,
        SocketAddrV4::new(VIP, HTTP),
        Some(newcomer),
        args.serve_timeout,
    )?;
    let served = started.elapsed();
    // A datapath may serve before its sync returns and is recorded: wait for the record.
    let mut sync = None;
    let deadline = Instant::now() + proxy_tests::scaled(Duration::from_secs(10));
    while let Some((sum0, count0)) = before {
        if let Some((sum, count)) = metrics_text(lab).and_then(|t| sync_totals(&t)) {
            if count > count0 {
                sync = Some(Duration::from_secs_f64((sum - sum0) / (count - count0)));
                break;
            }
        }
        if Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(OneChange { served, sync })
}

/// With --keep-logs: the lab's agent log, copied into --out as `name`.
fn keep_log(lab: &mut Lab, args: &Args, name: &str) {
    if let Some(agent) = lab.agent().filter(|_| args.keep_logs) {
        let _ = std::fs::create_dir_all(&args.out);
        if let Err(e) = std::fs::write(args.out.join(name), agent.log_text()) {
            eprintln!("keeping {name}: {e}");
        }
    }
}

/// Where the replayed API server listens, in the measured lab's node namespace.
const API_PORT: u16 = 18080;
/// How long the API-source run waits after the cold start before its one change.
const STEADY: Duration = Duration::from_secs(1);
/// The node the agent runs as in the API-source runs.
const NODE_NAME: &str = "bench-node";

/// `mode`'s control plane at `n` services fed by the replayed API server (lists paged 500
/// at a time by the agent's watcher, then a watch): cold start, one change through the
/// watch, peak RSS. The server runs in the node namespace on the same cores, as the
/// manifest source's file reads do.
fn api_control(mode: &str, n: usize, args: &Args) -> ControlSample {
    let mut control = ControlSample {
        services: n,
        mode: mode.to_string(),
        ..Default::default()
    };
    if let Err(e) = api_control_into(mode, n, args, &mut control) {
        control.note = Some(format!("{e:#}"));
    }
    control
}

fn api_control_into(mode: &str, n: usize, args: &Args, control: &mut ControlSample) -> Result<()> {
    let mut lab = bench_lab()?;
    let api = ApiServer::new();
    let mut services = Vec::with_capacity(n);
    let mut slices = Vec::with_capacity(n);
    each_service(&lab, n, 3, |name, vip, ports, eps| {
        let (svc, slice) = objects(name, vip, ports, eps);
        services.push(svc);
        slices.extend(slice);
    });
    api.load("services", services);
    api.load("endpointslices", slices);
    api.load(
        "nodes",
        [serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_NAME}})],
    );
    api.start(&lab.node, API_PORT)?;
    let kubeconfig = ApiServer::kubeconfig(lab.dir.path(), API_PORT)?;
    let mut extra = agent_args(mode, n);
    extra.extend([
        "--kubeconfig".to_string(),
        kubeconfig.display().to_string(),
        "--hostname-override".into(),
        NODE_NAME.into(),
    ]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    lab.spawn_agent_from(None, &extra)?;
    control.cold_start_ms = Some(cold_start(&mut lab, args)?.as_secs_f64() * 1e3);
    // The change goes through the watch: wait until all three are open, and then for the
    // start-up's last work (attaching the lab's interfaces) to pass, so the change is
    // measured in a steady state, as the manifest source's is (after the rounds).
    api.wait_for_watchers(3, args.serve_timeout)?;
    std::thread::sleep(STEADY);
    let (_, slice) = objects(
        "bench",
        VIP,
        &BENCH_PORTS,
        &lab.backends
            .iter()
            .take(4)
            .map(|p| p.ip)
            .collect::<Vec<_>>(),
    );
    let slice = slice.expect("endpoints make a slice");
    let changed = one_change(
        &lab,
        || {
            api.change("endpointslices", "MODIFIED", slice);
            Ok(())
        },
        args,
    );
    let pid = lab.agent().map(|a| a.pid());
    keep_log(&mut lab, args, &format!("agent-{mode}-{n}-api.log"));
    control.peak_rss_kib = pid.and_then(peak_rss_kib);
    control.datapath_objects = metrics_text(&lab).and_then(|t| programmed(&t, mode));
    let c = changed.context("one change")?;
    control.one_change_ms = Some(c.served.as_secs_f64() * 1e3);
    control.one_change_sync_ms = c.sync.map(|d| d.as_secs_f64() * 1e3);
    Ok(())
}

/// What the saturated connection workload measured.
struct Saturated {
    rate: ConnectRate,
    cpu: CpuTimes,
    tps: f64,
}

fn measure(
    target: &Target,
    n: usize,
    round: usize,
    seconds: f64,
    clients: usize,
    out: &mut Vec<Sample>,
) -> Result<()> {
    let d = Duration::from_secs_f64(seconds);
    let (http, bulk) = (target.http, target.bulk);
    let (rate, tps, bps, saturated) = target.lab.client.ns.run(move || -> Result<_> {
        let rate = connect_rate(http, d)?;
        let tps = transaction_rate(http, d)?;
        let bps = bulk_throughput(bulk, d)?;
        let before = CpuTimes::now()?;
        let many = parallel_connect_rate(http, d, clients)?;
        let cpu = CpuTimes::now()?.since(&before);
        let saturated = Saturated {
            rate: many,
            cpu,
            tps: parallel_transaction_rate(http, d, clients)?,
        };
        Ok((rate, tps, bps, saturated))
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
    let Saturated { rate, cpu, tps } = saturated;
    let connections = rate.connections as u64;
    let per_connection = |us: f64| us / rate.connections.max(1) as f64;
    out.push(sample(
        Workload::SaturatedConnectionsPerSecond,
        rate.per_second(),
        connections,
    ));
    out.push(sample(
        Workload::CpuUsPerConnection,
        per_connection(cpu.busy_us),
        connections,
    ));
    out.push(sample(
        Workload::KernelCpuUsPerConnection,
        per_connection(cpu.kernel_us),
        connections,
    ));
    out.push(sample(
        Workload::BusyPercent,
        100.0 * cpu.busy_us / cpu.total_us.max(1.0),
        connections,
    ));
    out.push(sample(
        Workload::SaturatedTransactionsPerSecond,
        tps,
        (tps * seconds) as u64,
    ));
    Ok(())
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.render {
        let path = args.out.join("results.json");
        let json = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let run: Run = serde_json::from_str(&json)
            .with_context(|| format!("{} is not a modebench run", path.display()))?;
        return write_outputs(&run, &args.out);
    }
    let started = Instant::now();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let clients = args.clients.unwrap_or(4 * cpus);
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
        cpus,
        environment: std::env::var("PROXY_BENCH_ENVIRONMENT").unwrap_or_else(|_| "host".into()),
        rounds: args.rounds,
        seconds_per_workload: args.seconds,
        clients,
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
    let limit = |mode: &str| {
        args.limits
            .0
            .iter()
            .find(|(m, _)| m == mode)
            .map_or(usize::MAX, |(_, n)| *n)
    };
    for mode in &modes {
        let above: Vec<String> = args
            .services
            .iter()
            .filter(|&&n| n > limit(mode))
            .map(|n| n.to_string())
            .collect();
        if !above.is_empty() {
            run.skipped.push((
                mode.clone(),
                format!(
                    "not at {} services: above its --limit ({mode}={}; `--limit none` lifts every limit)",
                    above.join(", "),
                    limit(mode)
                ),
            ));
        }
    }
    let modes_at =
        |n: usize| -> Vec<String> { modes.iter().filter(|m| n <= limit(m)).cloned().collect() };
    let api_modes_at = |n: usize| -> Vec<String> {
        modes_at(n)
            .into_iter()
            .filter(|m| args.api_modes.contains(m))
            .collect()
    };

    // Steps: per count, each mode's start and change, and every target's rounds.
    let steps: usize = args
        .services
        .iter()
        .map(|&n| {
            let k = modes_at(n).len();
            2 * k + args.rounds * (k + 1) + api_modes_at(n).len()
        })
        .sum();
    let mut bar = Progress::new(steps);
    for &n in &args.services {
        let modes = modes_at(n);
        let baseline_lab = bench_lab()?;
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
                let measured = measure(target, n, round, args.seconds, clients, &mut run.samples)
                    .with_context(|| format!("{} at {n} services", target.name));
                match measured {
                    // Every ratio is taken against the baseline: without it there is no run.
                    Err(e) if target.name == BASELINE => return Err(e),
                    // A mode that fails a workload keeps its place; the table says why.
                    Err(e) => {
                        let control = run
                            .control
                            .iter_mut()
                            .find(|c| c.services == n && c.mode == target.name)
                            .expect("a control record per started mode");
                        let why = format!("round {}: {e:#}", round + 1);
                        control.note = Some(match control.note.take() {
                            Some(earlier) => format!("{earlier}; {why}"),
                            None => why,
                        });
                    }
                    Ok(()) => {}
                }
                bar.inc(1);
            }
            // A mode that failed to start still takes its place in the count.
            bar.inc((modes.len() + 1 - targets.len()) as u64);
        }
        for target in targets.iter_mut().skip(1) {
            bar.set_message(format!("{n} services: one change, {}", target.name));
            let yaml = manifests(&target.lab, n, 4);
            let lab = &target.lab;
            let changed = one_change(lab, || lab.write_manifests(&yaml).map(drop), &args);
            let pid = target.lab.agent().map(|a| a.pid());
            keep_log(
                &mut target.lab,
                &args,
                &format!("agent-{}-{n}.log", target.name),
            );
            let objects = metrics_text(&target.lab).and_then(|t| programmed(&t, &target.name));
            let control = run
                .control
                .iter_mut()
                .find(|c| c.services == n && c.mode == target.name)
                .expect("a control record per started mode");
            match changed {
                Ok(c) => {
                    control.one_change_ms = Some(c.served.as_secs_f64() * 1e3);
                    control.one_change_sync_ms = c.sync.map(|d| d.as_secs_f64() * 1e3);
                }
                Err(e) => control.note = Some(format!("one change: {e:#}")),
            }
            control.peak_rss_kib = pid.and_then(peak_rss_kib);
            control.datapath_objects = objects;
            bar.set_message(format!("{n} services: restart, {}", target.name));
            match restart(&mut target.lab, &target.name, n, &args) {
                Ok(took) => control.restart_ms = Some(took.as_secs_f64() * 1e3),
                Err(e) => {
                    let why = format!("restart: {e:#}");
                    control.note = Some(match control.note.take() {
                        Some(earlier) => format!("{earlier}; {why}"),
                        None => why,
                    });
                }
            }
            keep_log(
                &mut target.lab,
                &args,
                &format!("agent-{}-{n}-restart.log", target.name),
            );
            bar.inc(1);
        }
        bar.inc((modes.len() + 1 - targets.len()) as u64);
        drop(targets);
        for mode in api_modes_at(n) {
            bar.set_message(format!(
                "{n} services: {mode} through the API-server source"
            ));
            run.api.push(api_control(&mode, n, &args));
            bar.inc(1);
        }
    }
    bar.finish();
    run.duration_s = started.elapsed().as_secs_f64();
    write_outputs(&run, &args.out)
}

/// A progress bar on a terminal; on a serial console (the VM runner) or in a log, one line
/// per step (`PROXY_BENCH_PLAIN=1` asks for lines).
struct Progress {
    bar: Option<ProgressBar>,
    pos: u64,
    len: u64,
    started: Instant,
}

impl Progress {
    fn new(len: usize) -> Self {
        let plain =
            std::env::var_os("PROXY_BENCH_PLAIN").is_some() || !std::io::stderr().is_terminal();
        let bar = (!plain).then(|| {
            ProgressBar::new(len as u64).with_style(
                ProgressStyle::with_template("[{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
                    .expect("a valid template"),
            )
        });
        Progress {
            bar,
            pos: 0,
            len: len as u64,
            started: Instant::now(),
        }
    }

    fn set_message(&self, msg: String) {
        match &self.bar {
            Some(bar) => bar.set_message(msg),
            None => eprintln!(
                "[{:>5.0} s] {}/{} {msg}",
                self.started.elapsed().as_secs_f64(),
                self.pos,
                self.len
            ),
        }
    }

    fn inc(&mut self, n: u64) {
        self.pos += n;
        if let Some(bar) = &self.bar {
            bar.inc(n);
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

/// results.json (every raw sample), results.md (the table, linking the plots) and the
/// plots, into `out`; fails listing what the run lacks.
fn write_outputs(run: &Run, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    // The raw samples first: they stay even if a plot cannot be drawn.
    write(
        &out.join("results.json"),
        &serde_json::to_string_pretty(run)?,
    )?;
    let mut table = report::markdown(run);
    table.push('\n');
    for file in plots::write_all(run, out)? {
        if file.extension().is_some_and(|e| e == "svg") {
            let name = file.file_name().unwrap_or_default().to_string_lossy();
            table.push_str(&format!("![{name}]({name})\n"));
        }
    }
    write(&out.join("results.md"), &table)?;
    print!("{table}");
    eprintln!("raw samples: {}", out.join("results.json").display());
    let problems = report::problems(run);
    if !problems.is_empty() {
        bail!("the run is incomplete: {}", problems.join("; "));
    }
    Ok(())
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: &str = "\
# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.001\"} 3
kubeproxy_sync_proxy_rules_duration_seconds_sum 0.25
kubeproxy_sync_proxy_rules_duration_seconds_count 4
proxy_agent_ebpf_map_entries{map=\"services\"} 12
proxy_agent_ebpf_map_entries{map=\"backends\"} 30
proxy_agent_ebpf_map_entries{map=\"conntrack\"} 900
proxy_agent_ebpf_map_entries_limit{map=\"services\"} 4096
";

    #[test]
    fn figures_come_from_the_named_metric_only() {
        assert_eq!(sync_totals(METRICS), Some((0.25, 4.0)));
        // Tracked flows and the `_limit` metric sharing the prefix are not programmed objects.
        assert_eq!(
            programmed(METRICS, "ebpf"),
            Some(("proxy_agent_ebpf_map_entries".into(), 42.0))
        );
        assert_eq!(programmed(METRICS, "nftables"), None);
    }

    #[test]
    fn limits_name_a_mode_and_a_count() {
        assert_eq!(
            parse_limits("iptables=10_000,ipvs=100").unwrap(),
            [("iptables".to_string(), 10_000), ("ipvs".to_string(), 100)]
        );
        assert!(parse_limits("none").unwrap().is_empty());
        let err = parse_limits("iptables").unwrap_err().to_string();
        assert!(err.contains("--limit iptables"), "{err}");
    }

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("modebench").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_line_is_well_formed() {
        use clap::CommandFactory;
        Args::command().debug_assert();
    }

    #[test]
    fn flags_default_and_quick_presets_what_is_not_given() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.services, [1, 100, 1000, 10_000, 100_000]);
        assert_eq!(
            (a.rounds, a.seconds, a.serve_timeout),
            (3, 2.0, Duration::from_secs(300))
        );
        assert_eq!(a.limits, Limits::default());
        assert_eq!(
            a.limits.to_string(),
            "iptables=10000,ipvs=10000,userspace=10000"
        );
        assert_eq!(a.out, PathBuf::from("target/modebench"));
        assert!(a.modes.is_none() && !a.render && !a.quick);

        let q = parse(&["--quick"]).unwrap();
        assert_eq!(q.services, [1, 100]);
        assert_eq!(
            (q.rounds, q.seconds, q.serve_timeout),
            (2, 0.5, Duration::from_secs(60))
        );
        // A flag given wins over the preset, on either side of --quick.
        let q = parse(&["--services", "1, 10_000", "--quick", "--rounds", "4"]).unwrap();
        assert_eq!((q.services, q.rounds, q.seconds), (vec![1, 10_000], 4, 0.5));

        // As xtask and the smoke test pass them.
        let a = parse(&[
            "--modes",
            "ipvs,ebpf",
            "--services",
            "1",
            "--rounds",
            "1",
            "--seconds",
            "0.2",
            "--serve-timeout",
            "120",
            "--limit",
            "none",
            "--out",
            "/tmp/mb",
        ])
        .unwrap();
        assert_eq!(a.modes.unwrap(), ["ipvs", "ebpf"]);
        assert_eq!((a.services, a.rounds, a.seconds), (vec![1], 1, 0.2));
        assert_eq!(a.serve_timeout, Duration::from_secs(120));
        assert!(a.limits.0.is_empty());
        assert_eq!(a.out, PathBuf::from("/tmp/mb"));
        let r = parse(&["--render", "--out", "target/modebench/vm"]).unwrap();
        assert!(r.render);
        // A flag given twice: the last one counts.
        let a = parse(&[
            "--services",
            "1,2",
            "--services",
            "3",
            "--limit",
            "ipvs=5",
            "--limit",
            "none",
        ])
        .unwrap();
        assert_eq!(a.services, [3]);
        assert!(a.limits.0.is_empty());
    }

    #[test]
    fn zero_counts_unknown_flags_and_malformed_values_are_refused() {
        for args in [
            &["--services", "1,0"][..],
            &["--rounds", "0"],
            &["--services", "1,x"],
            &["--seconds", "two"],
            &["--serve-timeout", "1.5"],
            &["--bogus"],
            &["--service", "1"],
            &["--rounds"],
            &["stray"],
        ] {
            assert!(parse(args).is_err(), "{args:?}");
        }
        let err = parse(&["--rounds", "0"]).unwrap_err().to_string();
        assert!(err.contains("at least 1"), "{err}");
        let err = parse(&["--limit", "iptables"]).unwrap_err().to_string();
        assert!(err.contains("--limit iptables: expected mode=N"), "{err}");
    }
}
