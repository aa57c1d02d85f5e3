//! A soak: the agent in the two-node lab under continuous churn for minutes to hours,
//! with traffic that must never fail, and its footprint sampled over time.
//!
//! `soak [--minutes 30] [--modes ebpf,nftables] [--out target/soak]` (or `cargo xtask soak`).
//! Per mode, both agents run with the flags the cluster lab gives them and `--proxy-mode`;
//! then, every 100 ms, the manifests change: the `churn` Service's three endpoints go round
//! ready → terminating → gone → ready again, out of phase so one is always ready, with a
//! not-ready endpoint that moves every tick; one `extra-N` Service is added and the one
//! from 2 s before removed. Every `--restart-minutes` node 1's agent restarts (node 2's runs
//! throughout, and its footprint is the one judged). Meanwhile, from the client pods: new
//! TCP connections to `churn` and `stable`, UDP queries to `stable`, and long connections
//! to `stable` opened at the start that echo a line every 5 s. Every request goes to a
//! Service with a live endpoint ready (a terminating endpoint keeps what it has; a gone one
//! had no new flow for a second), so each failure counts. Every 5 s: each agent's RSS and
//! open descriptors, its eBPF map entries or nftables rules, and the node's kernel
//! conntrack entries.
//!
//! Writes `results.md`, `samples.json` and `footprint.svg`/`.png` to `--out`; exits
//! non-zero when a request failed, or when RSS or descriptors grew more than
//! `--max-growth` percent from just after warm-up (the first fifth) to the end (the means
//! of the second and the last fifth of the samples).

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::Parser;
use plotters::prelude::*;
use proxy_tests::{
    cluster::{client, Cluster, BACKENDS, CLIENT, CLIENT_2, TCP_PORTS, UDP_PORT},
    lab::Session,
};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// How long each mode runs.
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// Modes, comma-separated.
    #[arg(long, default_value = "ebpf,nftables", value_delimiter = ',')]
    modes: Vec<String>,
    /// Minutes between restarts of node 1's agent; 0: none.
    #[arg(long, default_value_t = 3.0)]
    restart_minutes: f64,
    /// Growth of RSS or descriptors after warm-up, in percent, above which the soak fails.
    #[arg(long, default_value_t = 5.0)]
    max_growth: f64,
    #[arg(long, default_value = "target/soak")]
    out: PathBuf,
}

const STABLE: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const CHURN: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const TICK: Duration = Duration::from_millis(100);
const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// Ticks in one endpoint's round: ready 15, terminating 5, gone 10.
const ROUND: u64 = 30;
/// `extra-N` Services alive at a time (one added and one removed per tick).
const EXTRAS: u64 = 20;
const LONG_CONNECTIONS: usize = 8;

#[derive(Clone, Copy, PartialEq, Eq)]
enum EndpointState {
    Ready,
    Terminating,
    Gone,
}

/// Backend `i`'s state at `tick`: the rounds are a third apart, so one is always ready.
fn endpoint_state(i: usize, tick: u64) -> EndpointState {
    match (tick + i as u64 * ROUND / 3) % ROUND {
        0..15 => EndpointState::Ready,
        15..20 => EndpointState::Terminating,
        _ => EndpointState::Gone,
    }
}

fn service(name: &str, ip: Ipv4Addr, udp: bool) -> String {
    let udp_port = if udp {
        format!("\n  - {{name: dns, protocol: UDP, port: 53, targetPort: {UDP_PORT}}}")
    } else {
        String::new()
    };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: soak}}\nspec:\n  clusterIP: \"{ip}\"\n  ports:\n  - {{name: http, protocol: TCP, port: 80, targetPort: {}}}{udp_port}\n---\n",
        TCP_PORTS[0]
    )
}

/// An EndpointSlice of `name` with (address, ready, terminating) endpoints.
fn slice(name: &str, endpoints: &[(Ipv4Addr, bool, bool)], udp: bool) -> String {
    let udp_port = if udp {
        format!("\n- {{name: dns, protocol: UDP, port: {UDP_PORT}}}")
    } else {
        String::new()
    };
    let eps: String = endpoints
        .iter()
        .map(|(ip, ready, terminating)| {
            format!(
                "- addresses: [\"{ip}\"]\n  conditions: {{ready: {ready}, serving: {}, terminating: {terminating}}}\n",
                ready | terminating
            )
        })
        .collect();
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  namespace: soak\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports:\n- {{name: http, protocol: TCP, port: {}}}{udp_port}\nendpoints:\n{eps}---\n",
        TCP_PORTS[0]
    )
}

/// The manifests at `tick`.
fn manifests(tick: u64) -> String {
    let all: Vec<(Ipv4Addr, bool, bool)> = BACKENDS.iter().map(|b| (b.2, true, false)).collect();
    let mut yaml = service("stable", STABLE, true) + &slice("stable", &all, true);
    let mut churn: Vec<(Ipv4Addr, bool, bool)> = BACKENDS
        .iter()
        .enumerate()
        .filter_map(|(i, b)| match endpoint_state(i, tick) {
            EndpointState::Ready => Some((b.2, true, false)),
            EndpointState::Terminating => Some((b.2, false, true)),
            EndpointState::Gone => None,
        })
        .collect();
    // A pod that never gets ready, at a new address every tick: an endpoint change per tick.
    churn.push((
        Ipv4Addr::new(10, 244, 1, 100 + (tick % 100) as u8),
        false,
        false,
    ));
    yaml += &service("churn", CHURN, false);
    yaml += &slice("churn", &churn, false);
    for n in tick.saturating_sub(EXTRAS - 1)..=tick {
        let name = format!("extra-{n}");
        let ip = Ipv4Addr::new(10, 96, 1 + ((n / 250) % 200) as u8, (n % 250) as u8 + 1);
        yaml += &service(&name, ip, false);
        yaml += &slice(&name, &[(BACKENDS[0].2, true, false)], false);
    }
    yaml
}

#[derive(Default)]
struct Counters {
    ok: AtomicU64,
    failed: AtomicU64,
    errors: Mutex<Vec<String>>,
}

impl Counters {
    fn record(&self, what: &str, outcome: std::result::Result<(), String>) {
        match outcome {
            Ok(()) => {
                self.ok.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                let mut errors = self.errors.lock().unwrap();
                if errors.len() < 20 {
                    errors.push(format!("{what}: {e}"));
                }
            }
        }
    }
}

/// One per-node series of a sample.
type Field = fn(&Sample) -> &Vec<u64>;

#[derive(Clone, Serialize)]
struct Sample {
    mode: String,
    seconds: f64,
    /// Per node: agent RSS in KiB and open descriptors.
    rss_kib: Vec<u64>,
    fds: Vec<u64>,
    /// Per node: eBPF map entries (all maps) or nftables rules, from the agent's metrics.
    programmed: Vec<u64>,
    /// Per node: kernel conntrack entries.
    conntrack: Vec<u64>,
    /// Per node: new flows the eBPF datapath gave another source port because their tuple
    /// was a held connection's (`tuple_clash`, docs/datapath.md), since it started.
    clashes: Vec<u64>,
    requests_ok: u64,
    requests_failed: u64,
}

#[derive(Serialize)]
struct ModeResult {
    mode: String,
    minutes: f64,
    restarts: u64,
    requests_ok: u64,
    requests_failed: u64,
    /// Tuple clashes the eBPF datapaths resolved with another source port (their count).
    clashes: u64,
    errors: Vec<String>,
    /// (after warm-up, at the end) per node.
    rss_kib: Vec<(u64, u64)>,
    fds: Vec<(u64, u64)>,
    growth_percent: f64,
}

fn proc_status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

/// The agent's /metrics in node `node` (empty while it restarts).
fn metrics(c: &Cluster, node: u8) -> String {
    c.node(node)
        .ns
        .run(|| {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect("127.0.0.1:10249").ok()?;
            s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
                .ok()?;
            let mut text = String::new();
            s.read_to_string(&mut text).ok()?;
            Some(text)
        })
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// The agent's own count of what it programmed: eBPF map entries or nftables rules.
fn programmed(text: &str) -> u64 {
    text.lines()
        .filter(|l| {
            l.starts_with("proxy_agent_ebpf_map_entries{")
                || l.starts_with("proxy_agent_nftables_rules")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn kernel_conntrack(c: &Cluster, node: u8) -> u64 {
    c.node(node)
        .ns
        .run(|| std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_count"))
        .ok()
        .and_then(|r| r.ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn sample(c: &Cluster, mode: &str, started: Instant, counters: &Counters) -> Sample {
    let pids: Vec<u32> = c
        .nodes
        .iter()
        .map(|n| n.agent.as_ref().map_or(0, |a| a.pid()))
        .collect();
    let texts: Vec<String> = (1..=2).map(|n| metrics(c, n)).collect();
    Sample {
        mode: mode.to_string(),
        seconds: started.elapsed().as_secs_f64(),
        rss_kib: pids.iter().map(|p| proc_status_kib(*p, "VmRSS:")).collect(),
        fds: pids.iter().map(|p| open_fds(*p)).collect(),
        programmed: texts.iter().map(|t| programmed(t)).collect(),
        conntrack: (1..=2).map(|n| kernel_conntrack(c, n)).collect(),
        clashes: texts
            .iter()
            .map(|t| {
                t.lines()
                    .find_map(|l| {
                        l.strip_prefix("proxy_agent_ebpf_datapath_events{event=\"tuple_clash\"} ")
                    })
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0) as u64
            })
            .collect(),
        requests_ok: counters.ok.load(Ordering::Relaxed),
        requests_failed: counters.failed.load(Ordering::Relaxed),
    }
}

/// Client threads until `stop`: new TCP connections to both Services, UDP queries, and
/// long connections that echo every 5 s.
fn start_traffic(
    c: &Cluster,
    stop: &Arc<AtomicBool>,
    counters: &Arc<Counters>,
) -> Vec<std::thread::JoinHandle<Result<()>>> {
    let mut threads = Vec::new();
    for (pod, to) in [(CLIENT, CHURN), (CLIENT_2, STABLE), (CLIENT_2, CHURN)] {
        let (stop, counters) = (stop.clone(), counters.clone());
        threads.push(c.pod(pod).ns.spawn(move || {
            let to = SocketAddrV4::new(to, 80);
            while !stop.load(Ordering::Relaxed) {
                let r = client::tcp_hello(to, None, Duration::from_secs(3));
                counters.record(
                    &format!("tcp {to}"),
                    r.map(|_| ()).map_err(|e| e.to_string()),
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }));
    }
    {
        let (stop, counters) = (stop.clone(), counters.clone());
        threads.push(c.pod(CLIENT).ns.spawn(move || {
            let to = SocketAddrV4::new(STABLE, 53);
            while !stop.load(Ordering::Relaxed) {
                // A datagram may be lost on its way as on any network: one retry.
                let ask = || client::udp_hello(to, None, 16, Duration::from_secs(1));
                let r = ask()
                    .or_else(|_| ask())
                    .map(|_| ())
                    .map_err(|e| e.to_string());
                counters.record(&format!("udp {to}"), r);
                std::thread::sleep(Duration::from_millis(50));
            }
        }));
    }
    let sessions: Vec<Session> = (0..LONG_CONNECTIONS)
        .filter_map(|_| {
            let s = Session::open(&c.pod(CLIENT).ns, SocketAddrV4::new(STABLE, 80));
            counters.record(
                "opening a long connection",
                s.as_ref().map(|_| ()).map_err(|e| format!("{e:#}")),
            );
            s.ok()
        })
        .collect();
    let (stop, counters) = (stop.clone(), counters.clone());
    threads.push(std::thread::spawn(move || {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            for (i, s) in sessions.iter().enumerate() {
                let line = format!("ping {n}");
                let r = match s.exchange(&line) {
                    Ok(echo) if echo == line => Ok(()),
                    Ok(other) => Err(format!("echo {other:?}")),
                    Err(e) => Err(format!("{e:#}")),
                };
                counters.record(&format!("long connection {i} to {}", s.backend), r);
            }
            n += 1;
            for _ in 0..50 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    }));
    threads
}

fn soak(mode: &str, a: &Args) -> Result<(ModeResult, Vec<Sample>)> {
    eprintln!("soak: {mode} for {} minutes", a.minutes);
    let mut c = Cluster::new()?;
    let path = c.write_manifests(&manifests(0))?;
    c.start_agents(&path, &["--proxy-mode", mode])
        .with_context(|| format!("starting the {mode} agents"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let threads = start_traffic(&c, &stop, &counters);
    let started = Instant::now();
    let duration = Duration::from_secs_f64(a.minutes * 60.0);
    let restart_every =
        (a.restart_minutes > 0.0).then(|| Duration::from_secs_f64(a.restart_minutes * 60.0));
    let (mut tick, mut restarts) = (0u64, 0u64);
    let mut next_sample = Instant::now();
    let mut next_restart = restart_every.map(|d| Instant::now() + d);
    let mut samples = Vec::new();
    while started.elapsed() < duration {
        tick += 1;
        c.write_manifests(&manifests(tick))?;
        if Instant::now() >= next_sample {
            samples.push(sample(&c, mode, started, &counters));
            next_sample += SAMPLE_EVERY;
        }
        if let (Some(at), Some(every)) = (next_restart, restart_every) {
            if Instant::now() >= at {
                // Node 1 only: node 2's agent runs the whole soak, so its footprint over
                // time is one process's.
                c.restart_agent(1)
                    .context("restarting the agent on node 1")?;
                restarts += 1;
                next_restart = Some(at + every);
            }
        }
        std::thread::sleep(TICK);
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let failed = match t.join() {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("{e:#}")),
            Err(_) => Some("panicked".to_string()),
        };
        if let Some(e) = failed {
            counters.record("a traffic thread", Err(e));
        }
    }
    // The agents read the datapath's counters every 10 s: the last sample waits for them.
    std::thread::sleep(Duration::from_secs(11));
    samples.push(sample(&c, mode, started, &counters));
    // Warm-up is the first fifth. Footprint is compared as the mean of the second fifth
    // (just after warm-up) against the mean of the last fifth, per node: single samples
    // jitter (a scrape's own connection, a restart's fresh process).
    let fifth = (samples.len() / 5).max(1);
    let mean = |window: &[Sample], f: Field, n: usize| -> f64 {
        window.iter().map(|s| f(s)[n] as f64).sum::<f64>() / window.len().max(1) as f64
    };
    let after_warmup = &samples[fifth.min(samples.len() - 1)..(2 * fifth).min(samples.len())];
    let last = &samples[samples.len().saturating_sub(fifth)..];
    let per_node = |f: Field| -> Vec<(u64, u64)> {
        (0..2)
            .map(|n| (mean(after_warmup, f, n) as u64, mean(last, f, n) as u64))
            .collect()
    };
    let (rss, fds) = (per_node(|s| &s.rss_kib), per_node(|s| &s.fds));
    // Judged on node 2, whose agent is never restarted (node 1's restarts reset its
    // footprint); descriptors are few: a change of up to 4 is not growth.
    let (rss2, fds2) = (rss[1], fds[1]);
    let growth = [
        (rss2.1 as f64 / rss2.0.max(1) as f64 - 1.0) * 100.0,
        if fds2.1.saturating_sub(fds2.0) <= 4 {
            0.0
        } else {
            (fds2.1 as f64 / fds2.0.max(1) as f64 - 1.0) * 100.0
        },
    ]
    .into_iter()
    .fold(0.0f64, f64::max);
    // A sample that could not be read would pass as a small footprint.
    if samples.iter().any(|s| s.rss_kib[1] == 0 || s.fds[1] == 0) {
        counters.record(
            "sampling node 2's agent",
            Err("no RSS or descriptors read".into()),
        );
    }
    // Too little traffic proves nothing (about 80 requests a second are made).
    let expected = (a.minutes * 60.0 * 10.0) as u64;
    if counters.ok.load(Ordering::Relaxed) < expected {
        counters.record(
            "traffic",
            Err(format!(
                "only {} requests succeeded, fewer than {expected}",
                counters.ok.load(Ordering::Relaxed)
            )),
        );
    }
    let result = ModeResult {
        mode: mode.to_string(),
        minutes: a.minutes,
        restarts,
        requests_ok: counters.ok.load(Ordering::Relaxed),
        requests_failed: counters.failed.load(Ordering::Relaxed),
        clashes: samples.last().map_or(0, |s| s.clashes.iter().sum()),
        errors: counters.errors.lock().unwrap().clone(),
        rss_kib: rss,
        fds,
        growth_percent: growth,
    };
    if result.requests_failed > 0 {
        eprintln!("soak: {mode}: failures:\n{}", result.errors.join("\n"));
        eprintln!(
            "{}",
            c.logs()
                .lines()
                .rev()
                .take(40)
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    Ok((result, samples))
}

fn report(results: &[ModeResult]) -> String {
    let mut md = String::from(
        "| mode | minutes | agent restarts | requests ok | failed | tuple clashes given another port | RSS KiB after warm-up → end (node 1; node 2) | descriptors (node 1; node 2) | growth after warm-up |\n|---|---:|---:|---:|---:|---:|---|---|---:|\n",
    );
    for r in results {
        let pair = |v: &[(u64, u64)]| {
            v.iter()
                .map(|(a, b)| format!("{a} → {b}"))
                .collect::<Vec<_>>()
                .join("; ")
        };
        md += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.1} % |\n",
            r.mode,
            r.minutes,
            r.restarts,
            r.requests_ok,
            r.requests_failed,
            r.clashes,
            pair(&r.rss_kib),
            pair(&r.fds),
            r.growth_percent
        );
    }
    md
}

fn plot(samples: &[Sample], out: &Path) -> Result<()> {
    proxy_tests::bench::plots::register_font()?;
    draw(
        SVGBackend::new(&out.join("footprint.svg"), (1100, 420)).into_drawing_area(),
        samples,
    )?;
    draw(
        BitMapBackend::new(&out.join("footprint.png"), (1100, 420)).into_drawing_area(),
        samples,
    )
}

/// RSS and descriptors of each node's agent over time, a line per mode and node.
fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    samples: &[Sample],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let mut by_mode: BTreeMap<&str, Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        by_mode.entry(s.mode.as_str()).or_default().push(s);
    }
    let max_minutes = samples.iter().map(|s| s.seconds / 60.0).fold(1.0, f64::max);
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    let series: [(&str, Field, f64); 2] = [
        ("agent RSS (MiB)", |s| &s.rss_kib, 1024.0),
        ("agent open descriptors", |s| &s.fds, 1.0),
    ];
    for (panel, (title, get, scale)) in panels.iter().zip(series) {
        let top = samples
            .iter()
            .flat_map(|s| get(s).iter().map(|v| *v as f64 / scale))
            .fold(1.0, f64::max)
            * 1.2;
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..max_minutes, 0.0..top)?;
        chart.configure_mesh().x_desc("minutes").draw()?;
        for (i, (mode, list)) in by_mode.iter().enumerate() {
            for node in 0..2 {
                let color = Palette99::pick(i * 2 + node).to_rgba();
                chart
                    .draw_series(LineSeries::new(
                        list.iter()
                            .map(|s| (s.seconds / 60.0, get(s)[node] as f64 / scale)),
                        color.stroke_width(2),
                    ))?
                    .label(format!("{mode} node {}", node + 1))
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

fn main() -> Result<()> {
    let a = Args::parse();
    std::fs::create_dir_all(&a.out)?;
    let mut results = Vec::new();
    let mut samples = Vec::new();
    for mode in &a.modes {
        let (r, s) = soak(mode, &a)?;
        results.push(r);
        samples.extend(s);
    }
    let md = report(&results);
    print!("{md}");
    std::fs::write(a.out.join("results.md"), &md)?;
    std::fs::write(
        a.out.join("samples.json"),
        serde_json::to_string_pretty(&samples)?,
    )?;
    std::fs::write(
        a.out.join("results.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    plot(&samples, &a.out)?;
    let failed: Vec<String> = results
        .iter()
        .filter(|r| r.requests_failed > 0 || r.growth_percent > a.max_growth)
        .map(|r| {
            format!(
                "{}: {} failed requests, {:.1} % growth",
                r.mode, r.requests_failed, r.growth_percent
            )
        })
        .collect();
    if !failed.is_empty() {
        bail!("soak failed: {}", failed.join("; "));
    }
    Ok(())
}
