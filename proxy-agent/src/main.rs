use std::{path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{bail, Context, Result};
use clap::Parser;
use proxy_agent::{
    attach::{self, AttachMode, Attacher, InterfacePatterns},
    cleanup::cleanup,
    datapath::{Datapath, DatapathSizes},
    model::{ChangeTracker, DesiredState},
    pins::{self, Adoption, BpffsRoot, DEFAULT_BPFFS_ROOT},
    privileges::{self, Capabilities},
    proxier::{ebpf::EbpfProxier, Proxier, ProxyMode},
    source::manifests,
};
use tokio::{signal::unix::SignalKind, sync::mpsc};
use tracing::{debug, info, warn};

/// A kube-proxy replacement: programs this node's datapath so that traffic to a Service
/// reaches its pods.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Which proxy mode to use: ebpf (default).
    #[arg(long = "proxy-mode", default_value = "ebpf", value_parser = parse_mode)]
    proxy_mode: ProxyMode,

    /// Read Services, EndpointSlices and Nodes from this YAML/JSON file or directory
    /// instead of an API server; edits are applied while the agent runs.
    #[arg(long)]
    manifests: Option<PathBuf>,

    /// Attach the datapath to the interfaces whose names match these comma-separated globs
    /// (e.g. `lxc*,eth0`), including interfaces created later.
    #[arg(long)]
    interfaces: Option<InterfacePatterns>,

    /// How to attach: tcx (kernel 6.6+), netlink (clsact qdisc + filter) or auto.
    #[arg(long = "tc-attach", default_value = "auto")]
    tc_attach: AttachMode,

    /// bpffs directory for the pinned maps and links that keep the datapath serving while
    /// the agent restarts or upgrades (mounted if absent).
    #[arg(long = "bpffs-root", default_value = DEFAULT_BPFFS_ROOT)]
    bpffs_root: PathBuf,

    /// Remove everything this agent installed on the node (programs, links, filters, the
    /// qdiscs it added, pins, maps) and exit.
    #[arg(long)]
    cleanup: bool,

    /// Load the eBPF object from this file instead of the embedded one.
    #[arg(long = "ebpf-object", hide = true)]
    ebpf_object: Option<PathBuf>,

    /// Log verbosity, as kube-proxy's -v: 0-1 info, 2-3 debug, 4+ trace.
    #[arg(short = 'v', long = "v", default_value_t = 0)]
    verbosity: u8,

    /// Entries of the SERVICES map (one per service port plus one per endpoint of each).
    #[arg(long, default_value_t = DatapathSizes::default().services)]
    services_map_size: u32,

    /// Entries of the BACKENDS map (one per endpoint of each service port).
    #[arg(long, default_value_t = DatapathSizes::default().backends)]
    backends_map_size: u32,

    /// Entries of the CONNTRACK map (two per tracked flow).
    #[arg(long, default_value_t = DatapathSizes::default().conntrack)]
    conntrack_map_size: u32,
}

/// How often expired conntrack entries are swept from user space.
const CONNTRACK_GC_INTERVAL: Duration = Duration::from_secs(60);

fn parse_mode(s: &str) -> Result<ProxyMode, String> {
    s.parse()
}

fn init_logging(verbosity: u8) {
    let default = match verbosity {
        0 | 1 => "info,aya=warn,aya_obj=warn",
        2 | 3 => "debug,aya=info,aya_obj=info",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbosity);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, outermost context first: what failed and how to fix it.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    let caps = Capabilities::current().context("reading the process capabilities")?;
    privileges::check_datapath(caps)?;
    if cli.cleanup {
        let report = cleanup(&cli.bpffs_root).await?;
        info!(
            links = report.links_unpinned,
            filters = report.filters_removed,
            qdiscs = report.qdiscs_removed,
            maps = report.maps_unpinned,
            "cleanup done"
        );
        return Ok(());
    }
    let Some(path) = cli.manifests.clone() else {
        bail!("no service source: pass --manifests PATH (API-server mode is not built yet)");
    };
    info!("Using {} Proxier", cli.proxy_mode);
    if cli.ebpf_object.is_none() {
        // Before touching bpffs: nothing to do without the datapath.
        Datapath::ensure_object()?;
    }
    let root = BpffsRoot::prepare(&cli.bpffs_root)?;
    let mut sizes = DatapathSizes {
        services: cli.services_map_size,
        backends: cli.backends_map_size,
        conntrack: cli.conntrack_map_size,
    };
    let adoption = pins::adopt_or_rebuild(&root, &mut sizes)?;
    match &adoption {
        Adoption::Fresh => info!(root = %root.path.display(), "creating the datapath"),
        Adoption::Adopted => info!(root = %root.path.display(), "adopting the pinned datapath"),
        Adoption::Rebuilt { reason } => warn!(
            root = %root.path.display(),
            "rebuilding the datapath maps: {reason}; tracked connections are re-balanced"
        ),
    }
    let mut datapath = match &cli.ebpf_object {
        Some(object) => Datapath::load_file(object, sizes, Some(&root))?,
        None => Datapath::load(sizes, Some(&root))?,
    };
    let maps = datapath.take_service_maps()?;
    let mut proxier = EbpfProxier::new(maps);
    if adoption == Adoption::Adopted {
        let services = proxier.adopt()?;
        info!(frontends = services, "took over the pinned service maps");
    }
    let mut tracker = ChangeTracker::default();

    let mut attacher = cli
        .interfaces
        .clone()
        .map(|p| Attacher::new(p, cli.tc_attach, Some(&root)));
    let (link_tx, mut link_rx) = mpsc::channel(64);
    if attacher.is_some() {
        tokio::spawn(async move {
            if let Err(e) = attach::watch_links(link_tx).await {
                warn!("interface watch stopped: {e:#}");
            }
        });
    }

    let (reload_tx, mut reload_rx) = mpsc::channel(1);
    let _watcher = manifests::watch(&path, reload_tx)?;
    let mut sigterm = tokio::signal::unix::signal(SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut stats_tick = tokio::time::interval(Duration::from_secs(30));
    let mut gc_tick = tokio::time::interval(CONNTRACK_GC_INTERVAL);

    let mut reported = Vec::new();
    sync_from_manifests(&path, &mut tracker, &mut proxier, &mut reported)?;
    loop {
        tokio::select! {
            Some(()) = reload_rx.recv() => {
                if let Err(e) = sync_from_manifests(&path, &mut tracker, &mut proxier, &mut reported) {
                    warn!("manifests not reloaded: {e:#}");
                }
            }
            Some(event) = link_rx.recv() => {
                if let Some(attacher) = attacher.as_mut() {
                    attacher.handle(&mut datapath, event);
                }
            }
            _ = gc_tick.tick() => {
                match datapath.collect_conntrack_garbage() {
                    Ok(0) => {}
                    Ok(n) => debug!(entries = n, "expired conntrack entries deleted"),
                    Err(e) => warn!("conntrack garbage collection: {e:#}"),
                }
            }
            _ = stats_tick.tick() => {
                if let Ok(stats) = datapath.stats() {
                    let line: Vec<String> = stats.iter().map(|(s, n)| format!("{}={n}", s.name())).collect();
                    debug!("datapath: {}", line.join(" "));
                }
            }
            _ = sigterm.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    info!("stopping; the datapath keeps serving from the pinned state");
    Ok(())
}

fn sync_from_manifests(
    path: &std::path::Path,
    tracker: &mut ChangeTracker,
    proxier: &mut impl Proxier,
    reported: &mut Vec<String>,
) -> Result<()> {
    let set = manifests::load(path)?;
    let (desired, model_problems) = DesiredState::build(&set.store);
    // Problems are reported when they appear, not again on every reload.
    let problems: Vec<String> = set
        .problems
        .iter()
        .chain(&model_problems)
        .map(ToString::to_string)
        .collect();
    for p in problems.iter().filter(|p| !reported.contains(p)) {
        warn!("{p}");
    }
    *reported = problems;
    let changes = tracker.update(desired);
    if changes.is_empty() {
        return Ok(());
    }
    let started = std::time::Instant::now();
    let report = proxier.sync(tracker.current(), &changes)?;
    info!(
        changes = changes.len(),
        written = report.services_written,
        failed = report.services_failed,
        service_ports = tracker.current().ports.len(),
        elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
        "synced"
    );
    Ok(())
}
