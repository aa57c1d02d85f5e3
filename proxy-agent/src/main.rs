use std::{
    process::ExitCode,
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context, Result};
use clap::CommandFactory;
use proxy_agent::{
    attach::{self, Attacher},
    cleanup::cleanup,
    cli::{settings, Cli, Settings},
    ctnetlink::KernelConntrack,
    datapath::{Datapath, LoadOptions},
    health::{self, Health},
    ipvs_netlink::{Ipvs, KernelIpvs},
    local_routes::{self, DummyAddresses, KernelLocalRoutes, LocalRoutes},
    metrics::{service_labels, Metrics, TrafficCounters},
    model::{
        local_addresses, objects::NodeInfo, ChangeTracker, DesiredState, IpFamily, NodeContext,
        NodePortAddress, ServiceChange, WhenEmpty,
    },
    pins::{self, Adoption, BpffsRoot},
    privileges::{self, Capabilities},
    proxier::{
        ebpf::{maps::KernelMaps, EbpfProxier},
        iptables::{cleanup as iptables_cleanup, tables::IptablesCommands, IptablesProxier},
        ipvs::{
            self as ipvs_mode,
            ipset::{IpSets, IpsetCommand},
            IpvsProxier,
        },
        nftables::{
            self,
            netlink::NftNetlink,
            nft::{Nft, NftCommand},
            NftablesProxier,
        },
        userspace::UserspaceProxier,
        Proxier, ProxyMode, SyncReport,
    },
    service_health::{self, ServiceHealthServers},
    source::{api, manifests},
};
use proxy_common::map_names;
use tokio::{signal::unix::SignalKind, sync::mpsc};
use tracing::{debug, info, warn};

fn init_logging(verbosity: u32) {
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
    let matches = Cli::command().get_matches();
    let settings = match settings(&matches) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    init_logging(settings.verbosity);
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
    match runtime.block_on(run(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, outermost context first: what failed and how to fix it.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Records a `Starting` event on this node's Node object, as kube-proxy does.
async fn announce_start(client: kube::Client, node: String, mode: &'static str) {
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "proxy-agent".into(),
            instance: Some(node.clone()),
        },
    );
    let regarding = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.clone()),
        uid: Some(node.clone()),
        ..Default::default()
    };
    let event = Event {
        type_: EventType::Normal,
        reason: "Starting".into(),
        note: Some(format!("Using {mode} Proxier")),
        action: "StartProxyAgent".into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, &regarding).await {
        warn!(%node, "recording the Starting event: {e}");
    }
}

/// kube-proxy's kernel conntrack tuning; a failure is a warning, as the datapath does not
/// depend on it.
fn tune_kernel_conntrack(s: &Settings) {
    use proxy_agent::kernel_conntrack::{apply, Outcome};
    let tuning = s
        .file
        .as_ref()
        .map(|f| f.conntrack.kernel.clone())
        .unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    match apply(std::path::Path::new("/"), &tuning, cpus) {
        Ok(Outcome::Applied(changed)) => {
            for (path, old, new) in changed {
                info!("kernel conntrack: /{path} {old} -> {new}");
            }
        }
        Ok(Outcome::NotInitialNamespace) => info!(
            "kernel conntrack left alone: not the node's initial network namespace (nf_conntrack_max is read-only here)"
        ),
        Ok(Outcome::NoConntrack) => debug!("kernel conntrack not loaded: nothing to tune"),
        Err(e) => warn!("kernel conntrack not tuned: {e:#}"),
    }
}

/// How often expired conntrack entries are swept from user space.
const CONNTRACK_GC_INTERVAL: Duration = Duration::from_secs(60);

/// How often the datapath's counters are read into the metrics.
const STATS_INTERVAL: Duration = Duration::from_secs(10);
/// The longest time between full syncs, kube-proxy's `FullSyncPeriod`: a full sync rewrites
/// (or, in eBPF mode, re-reads) the whole datapath, which at 10 000 services takes seconds
/// of CPU in the netfilter modes, so the periodic syncs in between are partial, as
/// kube-proxy's are. The first sync and the one after a failure are full whatever this says.
const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// A client for the API server: from --kubeconfig (or clientConnection.kubeconfig), else
/// in-cluster configuration, else $KUBECONFIG / ~/.kube/config.
async fn kube_client(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context(
            "no API server: not in a cluster and no kubeconfig (pass --kubeconfig, or --manifests PATH to run without a cluster)",
        )?,
    };
    kube::Client::try_from(config).context("creating the API client")
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

async fn run(mut s: Settings) -> Result<()> {
    let caps = Capabilities::current().context("reading the process capabilities")?;
    // The netfilter modes (and auto, which falls back to them) need no BPF rights; the
    // eBPF mode and --cleanup (which unloads the eBPF datapath) do.
    let needs_bpf = s.cli.cleanup || s.mode == ProxyMode::Ebpf;
    privileges::check_datapath(caps, needs_bpf, s.mode == ProxyMode::Userspace)?;
    if s.cli.cleanup {
        let report = cleanup(&s.bpffs_root).await?;
        info!(
            links = report.links_unpinned,
            filters = report.filters_removed,
            qdiscs = report.qdiscs_removed,
            maps = report.maps_unpinned,
            "eBPF mode cleaned up"
        );
        // nftables first: iptables-nft reads the whole nf_tables ruleset, which a large
        // kube-proxy table makes slow (minutes at 100 000 services).
        match remove_nftables_tables()? {
            Some(tables) => info!(tables, "nftables mode cleaned up"),
            None => info!("no nftables here: no nftables tables to clean up"),
        }
        match remove_iptables_rules(&[])? {
            Some(chains) => info!(chains, "iptables mode cleaned up"),
            None => info!("no iptables here: no iptables rules to clean up"),
        }
        let routes = local_routes::remove_all()?;
        info!(routes, "userspace mode cleaned up");
        let (servers, interface, sets) = remove_ipvs_mode(&s)?;
        info!(
            virtual_servers = servers,
            kube_ipvs0 = interface,
            ipsets = sets,
            "ipvs mode cleaned up"
        );
        info!("cleanup done");
        return Ok(());
    }
    if let Some(file) = &s.file {
        for w in &file.warnings {
            warn!("--config: {w}");
        }
        if !file.ignored.is_empty() {
            info!(
                "--config: fields without meaning for this agent, ignored: {}",
                file.ignored.join(", ")
            );
        }
    }
    if s.mode == ProxyMode::Auto {
        s.mode = choose_mode(&s)?;
    }
    info!("Using {} Proxier", s.mode);
    tune_kernel_conntrack(&s);
    raise_open_files_limit();
    // The source first: a missing API server or manifest path fails before the node is touched.
    // The source: manifest files (re-read on change) or the API server (snapshots).
    let (reload_tx, mut reload_rx) = mpsc::channel(1);
    let (snapshot_tx, mut snapshot_rx) = mpsc::channel(8);
    let mut api_client = None;
    let _watcher = match &s.cli.manifests {
        Some(path) => Some(manifests::watch(path, reload_tx)?),
        None => {
            let client = kube_client(s.kubeconfig.as_deref()).await?;
            info!(node = %s.node_name, "watching the API server");
            tokio::spawn(api::run(client.clone(), s.node_name.clone(), snapshot_tx));
            api_client = Some(client);
            None
        }
    };
    let manifests_path = s.cli.manifests.clone();
    info!(node = %s.node_name, sync_period = ?s.sync_period, min_sync_period = ?s.min_sync_period, "settings");
    let metrics = Arc::new(Metrics::new());
    if s.mode != ProxyMode::Ebpf && (s.interfaces.is_some() || s.cli.cgroup_path.is_some()) {
        info!(
            "--interfaces and --cgroup-path are eBPF settings: not used in {} mode",
            s.mode
        );
    }
    let (mut proxier, mut ebpf) = match s.mode {
        ProxyMode::Auto => bail!("proxy mode auto is resolved before this point"),
        ProxyMode::Ebpf => {
            let (proxier, runtime) = start_ebpf(&s, &metrics)?;
            (ActiveProxier::Ebpf(Box::new(proxier)), Some(runtime))
        }
        ProxyMode::Iptables => {
            let commands = IptablesCommands::host_default();
            for family in [IpFamily::V4, IpFamily::V6] {
                commands.probe(family).context(
                    "the iptables proxier needs iptables-restore and iptables-save for IPv4 and IPv6",
                )?;
            }
            let proxier = IptablesProxier::new(
                commands,
                Box::new(KernelConntrack),
                s.masquerade_bit,
                &s.cluster_cidrs,
            );
            (ActiveProxier::Iptables(Box::new(proxier)), None)
        }
        ProxyMode::Nftables => {
            NftCommand.probe().context(
                "the nftables proxier needs the nft command and nf_tables in the kernel",
            )?;
            let proxier = NftablesProxier::new(
                NftNetlink::default(),
                Box::new(KernelConntrack),
                s.masquerade_bit,
                &s.cluster_cidrs,
            );
            (ActiveProxier::Nftables(Box::new(proxier)), None)
        }
        ProxyMode::Ipvs => (ActiveProxier::Ipvs(Box::new(start_ipvs(&s)?)), None),
        ProxyMode::Userspace => {
            let routes = KernelLocalRoutes::open()
                .context("the userspace proxier makes service addresses local with routes")?;
            let proxier = UserspaceProxier::new(Box::new(routes), s.udp_idle_timeout);
            (ActiveProxier::Userspace(Box::new(proxier)), None)
        }
    };
    let health = Health::new(2 * s.sync_period);
    health::serve(
        s.healthz,
        s.metrics,
        health.clone(),
        metrics.clone(),
        s.mode.as_str(),
    )
    .await?;

    let (link_tx, mut link_rx) = mpsc::channel(64);
    if ebpf.as_ref().is_some_and(|e| e.attacher.is_some()) {
        tokio::spawn(async move {
            // A failed watch starts again (listing the links anew: attaching is idempotent),
            // so interfaces created later are still served. It ends when the receiver goes.
            while !link_tx.is_closed() {
                if let Err(e) = attach::watch_links(link_tx.clone()).await {
                    warn!("interface watch failed, restarting it in 1 s: {e:#}");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }

    let mut sigterm = tokio::signal::unix::signal(SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut stats_tick = tokio::time::interval(STATS_INTERVAL);
    let mut gc_tick = tokio::time::interval(CONNTRACK_GC_INTERVAL);
    let mut sync_tick = tokio::time::interval(s.sync_period);
    sync_tick.tick().await; // the first tick is immediate; the start-up sync covers it
    let mut config_sync_tick = tokio::time::interval(s.config_sync_period);
    config_sync_tick.tick().await;

    let mut loop_state = SyncLoop {
        tracker: ChangeTracker::default(),
        node_name: s.node_name.clone(),
        node_port_filter: s.node_port_addresses.clone(),
        masquerade_addr: None,
        masquerade_addr6: None,
        masquerade_all: s.masquerade_all,
        default_scheduler: s.scheduler,
        node: None,
        pending: Vec::new(),
        pending_since: None,
        reported: Vec::new(),
        last_sync: None,
        last_full_sync: None,
        min_sync_period: s.min_sync_period,
        service_health: ServiceHealthServers::new(health.clone()),
        health,
        metrics: metrics.clone(),
    };
    match &manifests_path {
        Some(path) => loop_state.ingest(manifests::load(path)?),
        // Nothing is programmed before the API server has been listed once.
        None => match snapshot_rx.recv().await {
            Some(set) => loop_state.ingest(set),
            None => bail!("the API-server source stopped"),
        },
    }
    if let Some(e) = ebpf.as_mut() {
        e.follow_masquerade_address(&loop_state);
    }
    loop_state.sync(&mut proxier, false);
    // The start-up sync wrote everything (the periodic full one comes an hour later).
    loop_state.last_full_sync = Some(Instant::now());
    // Only now that this mode serves: what the other modes left (ours or upstream
    // kube-proxy's) goes, so switching modes by restarting leaves no gap.
    remove_other_modes(s.mode, &s).await;
    if let Some(client) = api_client {
        // As kube-proxy announces itself on its Node; best effort.
        tokio::spawn(announce_start(client, s.node_name.clone(), s.mode.as_str()));
    }
    let mut deferred: Option<Instant> = None;
    loop {
        let wait = deferred.map(|d| d.saturating_duration_since(Instant::now()));
        let flow_log = ebpf.as_mut().and_then(|e| e.flow_logger.as_mut());
        let has_flow_log = flow_log.is_some();
        tokio::select! {
            Some(()) = reload_rx.recv() => {
                if let Some(path) = &manifests_path {
                    match manifests::load(path) {
                        Ok(set) => {
                            loop_state.ingest(set);
                            deferred = loop_state.sync_or_defer(&mut proxier);
                        }
                        Err(e) => warn!("manifests not reloaded: {e:#}"),
                    }
                }
            }
            Some(set) = snapshot_rx.recv() => {
                loop_state.ingest(set);
                deferred = loop_state.sync_or_defer(&mut proxier);
            }
            _ = tokio::time::sleep(wait.unwrap_or(Duration::from_secs(3600))), if wait.is_some() => {
                deferred = loop_state.sync_or_defer(&mut proxier);
            }
            _ = sync_tick.tick() => {
                let full = loop_state
                    .last_full_sync
                    .is_none_or(|t| t.elapsed() >= FULL_SYNC_PERIOD);
                loop_state.sync(&mut proxier, full);
            }
            _ = config_sync_tick.tick() => {
                // A periodic re-read of the manifests, as kube-proxy's configSyncPeriod
                // resyncs its informers (the API watchers relist by themselves).
                if let Some(Ok(set)) = manifests_path.as_deref().map(manifests::load) {
                    loop_state.ingest(set);
                    deferred = loop_state.sync_or_defer(&mut proxier);
                }
            }
            Ok(mut ready) = async { flow_log.unwrap().readable_mut().await }, if has_flow_log => {
                ready.get_inner_mut().flush();
                ready.clear_ready();
            }
            Some(event) = link_rx.recv() => {
                if let Some(e) = ebpf.as_mut() {
                    e.link_event(event);
                }
            }
            _ = gc_tick.tick() => {
                if let Some(e) = ebpf.as_mut() {
                    e.collect_conntrack_garbage(&metrics);
                }
            }
            _ = stats_tick.tick() => {
                if let (Some(e), ActiveProxier::Ebpf(p)) = (ebpf.as_mut(), &proxier) {
                    e.read_counters(p, &metrics);
                }
            }
            _ = sigterm.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
        if let Some(e) = ebpf.as_mut() {
            e.follow_masquerade_address(&loop_state);
        }
    }
    match s.mode {
        ProxyMode::Ebpf => info!("stopping; the datapath keeps serving from the pinned state"),
        _ => info!("stopping; the rules stay in place"),
    }
    Ok(())
}

/// `--proxy-mode auto`: the first mode this kernel and node can run, in the order eBPF
/// (its programs load: the verifier accepts them), nftables, iptables; each refusal is
/// logged with its reason.
fn choose_mode(s: &Settings) -> Result<ProxyMode> {
    let mut reasons = Vec::new();
    let ebpf = (|| -> Result<()> {
        if s.cli.ebpf_object.is_none() {
            Datapath::ensure_object()?;
        }
        // The smallest datapath, unpinned: loading it runs the verifier on every program.
        let sizes = proxy_agent::datapath::DatapathSizes {
            services: 16,
            backends: 16,
            conntrack: 16,
            maglev: 1,
        };
        match &s.cli.ebpf_object {
            Some(object) => Datapath::load_file(object, sizes, None, LoadOptions::default())?,
            None => Datapath::load_with(sizes, None, LoadOptions::default())?,
        };
        Ok(())
    })();
    match ebpf {
        Ok(()) => {
            info!("auto: choosing ebpf: the datapath's programs load on this kernel");
            return Ok(ProxyMode::Ebpf);
        }
        Err(e) => reasons.push(format!("ebpf: {e:#}")),
    }
    let nft = NftCommand.probe().and_then(|()| {
        // A transaction, not just a listing: the kernel must accept a table.
        NftCommand.apply("add table ip proxy-agent-probe\ndelete table ip proxy-agent-probe\n")
    });
    match nft {
        Ok(()) => {
            info!(not_chosen = ?reasons, "auto: choosing nftables");
            return Ok(ProxyMode::Nftables);
        }
        Err(e) => reasons.push(format!("nftables: {e:#}")),
    }
    let commands = IptablesCommands::host_default();
    match commands
        .probe(IpFamily::V4)
        .and_then(|()| commands.probe(IpFamily::V6))
    {
        Ok(()) => {
            info!(not_chosen = ?reasons, "auto: choosing iptables");
            return Ok(ProxyMode::Iptables);
        }
        Err(e) => reasons.push(format!("iptables: {e:#}")),
    }
    match ipvs_prerequisites() {
        Ok(_) => {
            info!(not_chosen = ?reasons, "auto: choosing ipvs");
            return Ok(ProxyMode::Ipvs);
        }
        Err(e) => reasons.push(format!("ipvs: {e:#}")),
    }
    // The last resort: no netfilter, no BPF, only sockets and a route per address.
    match KernelLocalRoutes::open().and_then(|mut r| r.list().map(|_| ())) {
        Ok(()) => {
            info!(not_chosen = ?reasons, "auto: choosing userspace");
            Ok(ProxyMode::Userspace)
        }
        Err(e) => {
            reasons.push(format!("userspace: {e:#}"));
            bail!("auto: no proxy mode can run here: {}", reasons.join("; "))
        }
    }
}

/// Raises the soft limit on open files to the hard one, as Go programs such as kube-proxy
/// do at start: the userspace mode holds a listener per service port and two sockets per
/// proxied connection, and a shell's default soft limit (1024) ran out at 1 000 services
/// (every new connection reset).
fn raise_open_files_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 || limit.rlim_cur >= limit.rlim_max
        {
            return;
        }
        let wanted = libc::rlimit {
            rlim_cur: limit.rlim_max,
            ..limit
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) == 0 {
            debug!(
                from = limit.rlim_cur,
                to = limit.rlim_max,
                "open files limit raised"
            );
        }
    }
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
    if NftCommand.probe().is_err() {
        return Ok(None);
    }
    // Over netlink: nft would fetch the whole ruleset first (minutes behind a table of
    // 100 000 services).
    nftables::remove_all(&mut NftNetlink::default()).map(Some)
}

/// Removes what the other modes left on this node (ours or upstream kube-proxy's), as
/// kube-proxy does when it starts: best effort, each failure a warning.
async fn remove_other_modes(mode: ProxyMode, s: &Settings) {
    // nftables first: iptables-nft reads the whole nf_tables ruleset (slow behind a large
    // kube-proxy table).
    if mode != ProxyMode::Nftables {
        match remove_nftables_tables() {
            Ok(None | Some(0)) => {}
            Ok(Some(n)) => info!(tables = n, "removed the nftables mode's tables"),
            Err(e) => warn!("removing the nftables mode's tables: {e:#}"),
        }
    }
    if mode != ProxyMode::Iptables {
        // The ipvs mode writes a few of the same chains itself (already, by now).
        let keep = if mode == ProxyMode::Ipvs {
            ipvs_mode::IPTABLES_CHAINS
        } else {
            &[]
        };
        match remove_iptables_rules(keep) {
            Ok(None | Some(0)) => {}
            Ok(Some(n)) => info!(chains = n, "removed the iptables mode's rules"),
            Err(e) => warn!("removing the iptables mode's rules: {e:#}"),
        }
    }
    if mode != ProxyMode::Ipvs {
        match remove_ipvs_mode(s) {
            Ok((0, false, 0)) => {}
            Ok((servers, interface, sets)) => info!(
                virtual_servers = servers,
                kube_ipvs0 = interface,
                ipsets = sets,
                "removed the ipvs mode's state"
            ),
            Err(e) => warn!("removing the ipvs mode's state: {e:#}"),
        }
    }
    if mode != ProxyMode::Userspace {
        match local_routes::remove_all() {
            Ok(0) => {}
            Ok(n) => info!(routes = n, "removed the userspace mode's local routes"),
            Err(e) => warn!("removing the userspace mode's local routes: {e:#}"),
        }
    }
    if mode != ProxyMode::Ebpf {
        match cleanup(&s.bpffs_root).await {
            Ok(report) if report == Default::default() => {}
            Ok(report) => info!(
                links = report.links_unpinned,
                filters = report.filters_removed,
                maps = report.maps_unpinned,
                "removed the eBPF mode's datapath"
            ),
            Err(e) => warn!("removing the eBPF mode's datapath: {e:#}"),
        }
    }
}

/// What the ipvs proxier needs of the node: IPVS in the kernel, ipset, and iptables for
/// both families (for masquerading around IPVS). Returns the IPVS handle it opened.
fn ipvs_prerequisites() -> Result<KernelIpvs> {
    let ipvs = KernelIpvs::open()?;
    IpsetCommand
        .probe()
        .context("the ipvs proxier needs the ipset command and ip_set in the kernel")?;
    let commands = IptablesCommands::host_default();
    for family in [IpFamily::V4, IpFamily::V6] {
        commands
            .probe(family)
            .context("the ipvs proxier needs iptables-restore for its masquerade rules")?;
    }
    Ok(ipvs)
}

/// kube-proxy's ipvs sysctls (in this network namespace): IPVS connections tracked by
/// conntrack (so iptables can masquerade them), connections of removed real servers and
/// their persistence templates expired at once, forwarding on; with strictARP, ARP answered
/// only for the asking interface's addresses.
fn ipvs_sysctls(strict_arp: bool) {
    let mut settings = vec![
        ("net/ipv4/vs/conntrack", "1"),
        ("net/ipv4/vs/expire_nodest_conn", "1"),
        ("net/ipv4/vs/expire_quiescent_template", "1"),
        ("net/ipv4/ip_forward", "1"),
    ];
    if strict_arp {
        settings.push(("net/ipv4/conf/all/arp_ignore", "1"));
        settings.push(("net/ipv4/conf/all/arp_announce", "2"));
    }
    for (path, value) in settings {
        let full = format!("/proc/sys/{path}");
        match std::fs::write(&full, value) {
            Ok(()) => debug!("{full} = {value}"),
            Err(e) => warn!("ipvs mode: could not set {full} to {value}: {e}"),
        }
    }
}

fn start_ipvs(s: &Settings) -> Result<IpvsProxier<IptablesCommands, IpsetCommand>> {
    let ipvs = ipvs_prerequisites().context("the ipvs proxier cannot run")?;
    ipvs_sysctls(s.ipvs.strict_arp);
    let addresses: Box<dyn LocalRoutes> = match DummyAddresses::open() {
        Ok(dummy) => Box::new(dummy),
        Err(e) if proxy_agent::nlattr::errno(&e) == Some(libc::EOPNOTSUPP) => {
            warn!(
                "this kernel has no dummy interfaces ({}): service addresses are made local with routes on lo instead",
                local_routes::DUMMY_INTERFACE
            );
            Box::new(KernelLocalRoutes::open()?)
        }
        Err(e) => {
            return Err(e.context("the ipvs proxier holds service addresses on a dummy interface"))
        }
    };
    Ok(IpvsProxier::new(
        ipvs_mode::IpvsKernel {
            ipvs: Box::new(ipvs),
            addresses,
            tables: IptablesCommands::host_default(),
            sets: IpsetCommand,
            flows: Box::new(KernelConntrack),
        },
        s.masquerade_bit,
        &s.cluster_cidrs,
        s.ipvs.options.clone(),
    ))
}

/// Removes the ipvs mode's IPVS virtual servers (outside excludeCIDRs), `kube-ipvs0` and
/// `KUBE-` ipsets (ours or kube-proxy's); nothing where the node has no IPVS or ipset.
/// Runs after the iptables rules are gone (sets in use cannot be destroyed).
fn remove_ipvs_mode(s: &Settings) -> Result<(usize, bool, usize)> {
    let mut ipvs = KernelIpvs::open().ok();
    let mut sets = IpsetCommand.probe().ok().map(|()| IpsetCommand);
    ipvs_mode::remove_all(
        ipvs.as_mut().map(|i| i as &mut dyn Ipvs),
        sets.as_mut().map(|s| s as &mut dyn IpSets),
        &s.ipvs.options.exclude_cidrs,
    )
}

/// The proxier of the mode this agent runs.
enum ActiveProxier {
    Ebpf(Box<EbpfProxier<KernelMaps>>),
    Iptables(Box<IptablesProxier<IptablesCommands>>),
    Ipvs(Box<IpvsProxier<IptablesCommands, IpsetCommand>>),
    Nftables(Box<NftablesProxier<NftNetlink>>),
    Userspace(Box<UserspaceProxier>),
}

/// Brings a counter up to a total the proxier keeps.
fn catch_up(counter: &prometheus::IntCounter, total: u64) {
    counter.inc_by(total.saturating_sub(counter.get()));
}

impl ActiveProxier {
    fn inner_ref(&self) -> &dyn Proxier {
        match self {
            ActiveProxier::Ebpf(p) => p.as_ref(),
            ActiveProxier::Iptables(p) => p.as_ref(),
            ActiveProxier::Ipvs(p) => p.as_ref(),
            ActiveProxier::Nftables(p) => p.as_ref(),
            ActiveProxier::Userspace(p) => p.as_ref(),
        }
    }

    fn inner(&mut self) -> &mut dyn Proxier {
        match self {
            ActiveProxier::Ebpf(p) => p.as_mut(),
            ActiveProxier::Iptables(p) => p.as_mut(),
            ActiveProxier::Ipvs(p) => p.as_mut(),
            ActiveProxier::Nftables(p) => p.as_mut(),
            ActiveProxier::Userspace(p) => p.as_mut(),
        }
    }

    /// The mode's own metrics, after a sync.
    fn report(&self, metrics: &Metrics) {
        match self {
            ActiveProxier::Ebpf(p) => {
                let (ports, backends) = p.programmed();
                metrics
                    .map_entries
                    .with_label_values(&[map_names::SERVICES])
                    .set((ports + backends) as i64);
                metrics
                    .map_entries
                    .with_label_values(&[map_names::BACKENDS])
                    .set(backends as i64);
            }
            ActiveProxier::Iptables(p) => {
                let counts = p.rule_counts();
                for (table, n) in [("nat", counts.nat), ("filter", counts.filter)] {
                    metrics
                        .iptables_rules
                        .with_label_values(&[table])
                        .set(n as i64);
                }
                catch_up(&metrics.iptables_restore_failures, p.restore_failures);
                catch_up(
                    &metrics.iptables_partial_restore_failures,
                    p.partial_restore_failures,
                );
            }
            ActiveProxier::Nftables(p) => {
                metrics.nftables_rules.set(p.rule_count() as i64);
                catch_up(&metrics.nftables_sync_failures, p.failures);
                let nft = p.nft();
                for (via, total) in [
                    ("netlink", nft.netlink_transactions),
                    ("nft", nft.nft_transactions),
                ] {
                    catch_up(
                        &metrics.nftables_transactions.with_label_values(&[via]),
                        total,
                    );
                }
            }
            ActiveProxier::Ipvs(p) => {
                metrics.ipvs_virtual_servers.set(p.virtual_servers() as i64);
                catch_up(&metrics.ipvs_sync_failures, p.failures);
            }
            ActiveProxier::Userspace(p) => {
                metrics.userspace_listeners.set(p.listening() as i64);
            }
        }
    }
}

impl Proxier for ActiveProxier {
    fn mode(&self) -> ProxyMode {
        self.inner_ref().mode()
    }

    fn sync(&mut self, desired: &DesiredState, changes: &[ServiceChange]) -> Result<SyncReport> {
        self.inner().sync(desired, changes)
    }

    fn sync_full(&mut self, desired: &DesiredState) -> Result<SyncReport> {
        self.inner().sync_full(desired)
    }

    fn programmed(&self) -> (usize, usize) {
        self.inner_ref().programmed()
    }

    fn set_masquerade_addresses(
        &mut self,
        v4: Option<std::net::Ipv4Addr>,
        v6: Option<std::net::Ipv6Addr>,
    ) {
        self.inner().set_masquerade_addresses(v4, v6)
    }
}

/// What the eBPF mode runs besides its proxier: the loaded datapath, the interface
/// attacher, the flow log, and the state of its periodic readings.
struct EbpfRuntime {
    datapath: Datapath,
    attacher: Option<Attacher>,
    flow_logger: Option<tokio::io::unix::AsyncFd<aya_log::EbpfLogger<&'static dyn log::Log>>>,
    sizes: proxy_agent::datapath::DatapathSizes,
    backend_metrics: bool,
    service_counters: TrafficCounters,
    backend_counters: TrafficCounters,
    /// Evictions are derived from pinned counters, so they survive restarts; new ones are
    /// warned about.
    evicted_reported: Option<u64>,
}

/// Loads (or adopts) the eBPF datapath and its proxier.
fn start_ebpf(s: &Settings, metrics: &Metrics) -> Result<(EbpfProxier<KernelMaps>, EbpfRuntime)> {
    if s.cli.ebpf_object.is_none() {
        // Before touching bpffs: nothing to do without the datapath.
        Datapath::ensure_object()?;
    }
    let root = BpffsRoot::prepare(&s.bpffs_root)?;
    let mut sizes = s.sizes;
    let adoption = pins::adopt_or_rebuild(&root, &mut sizes)?;
    match &adoption {
        Adoption::Fresh => info!(root = %root.path.display(), "creating the datapath"),
        Adoption::Adopted => info!(root = %root.path.display(), "adopting the pinned datapath"),
        Adoption::Rebuilt { reason } => warn!(
            root = %root.path.display(),
            "rebuilding the datapath maps: {reason}; tracked connections are re-balanced"
        ),
    }
    // -v 4 and up: per-flow debug messages from the datapath (aya-log), as operators turn up
    // kube-proxy's verbosity to debug a Service.
    let flow_log = s.verbosity >= 4;
    let options = LoadOptions {
        flow_log,
        backend_stats: s.backend_metrics,
        without_ipv6: !s.cli.ebpf_ipv6,
    };
    let mut datapath = match &s.cli.ebpf_object {
        Some(object) => Datapath::load_file(object, sizes, Some(&root), options)?,
        None => Datapath::load_with(sizes, Some(&root), options)?,
    };
    let flow_logger = if flow_log {
        let logger = aya_log::EbpfLogger::init(&mut datapath.ebpf)
            .context("reading the datapath's log buffer")?;
        // SAFETY: the logger owns the ring buffer's fd and keeps it open while the AsyncFd
        // holds it; nothing else replaces or closes it.
        Some(unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)?
        })
    } else {
        None
    };
    datapath.configure(&s.datapath)?;
    datapath.configure6(&s.datapath6)?;
    let maps = datapath.take_service_maps()?;
    let mut proxier = EbpfProxier::new(maps);
    proxier.set_maglev_size(s.datapath.maglev_table_size);
    if adoption == Adoption::Adopted {
        let services = proxier.adopt()?;
        info!(frontends = services, "took over the pinned service maps");
    }
    for (map, size) in [
        (map_names::SERVICES, sizes.services),
        (map_names::BACKENDS, sizes.backends),
        (map_names::CONNTRACK, sizes.conntrack),
    ] {
        metrics
            .map_capacity
            .with_label_values(&[map])
            .set(size as i64);
    }
    if let Some(path) = &s.cli.cgroup_path {
        proxy_agent::cgroup::attach(&mut datapath, path, Some(&root))?;
    }
    let attacher = s
        .interfaces
        .clone()
        .map(|p| Attacher::new(p, s.tc_attach, Some(&root)));
    let runtime = EbpfRuntime {
        datapath,
        attacher,
        flow_logger,
        sizes,
        backend_metrics: s.backend_metrics,
        service_counters: TrafficCounters::default(),
        backend_counters: TrafficCounters::default(),
        evicted_reported: None,
    };
    Ok((proxier, runtime))
}

impl EbpfRuntime {
    fn link_event(&mut self, event: attach::LinkEvent) {
        if let Some(attacher) = self.attacher.as_mut() {
            attacher.handle(&mut self.datapath, event);
        }
    }

    fn collect_conntrack_garbage(&mut self, metrics: &Metrics) {
        match self.datapath.collect_conntrack_garbage() {
            Ok(sweep) => {
                metrics.conntrack_deleted_total.inc_by(sweep.deleted as u64);
                metrics
                    .datapath_events
                    .with_label_values(&["conntrack_evicted"])
                    .set(sweep.evicted as f64);
                let before = self.evicted_reported.unwrap_or(sweep.evicted);
                if sweep.evicted > before {
                    warn!(
                        evicted = sweep.evicted - before,
                        entries = sweep.remaining,
                        capacity = self.sizes.conntrack,
                        "the conntrack map is full: the kernel evicted tracked flows to make room (their next packets pick a backend again); raise --conntrack-map-size"
                    );
                }
                self.evicted_reported = Some(before.max(sweep.evicted));
                metrics
                    .map_entries
                    .with_label_values(&[map_names::CONNTRACK])
                    .set(sweep.remaining as i64);
                if sweep.deleted > 0 {
                    debug!(
                        deleted = sweep.deleted,
                        remaining = sweep.remaining,
                        "conntrack swept"
                    );
                }
            }
            Err(e) => warn!("conntrack garbage collection: {e:#}"),
        }
    }

    /// Per-service and per-backend traffic counters and the datapath's event counters.
    fn read_counters(&mut self, proxier: &EbpfProxier<KernelMaps>, metrics: &Metrics) {
        let ids = proxier.service_ids();
        let numbers: Vec<u32> = ids.iter().map(|(_, id)| *id).collect();
        match self.datapath.service_stats(&numbers) {
            Ok(stats) => self.service_counters.update(
                &metrics.service_traffic,
                ids.into_iter()
                    .zip(stats)
                    .map(|((name, id), s)| (service_labels(&name), id, s))
                    .collect(),
            ),
            Err(e) => debug!("reading per-service counters: {e:#}"),
        }
        if self.backend_metrics {
            let ids = proxier.backend_ids();
            let numbers: Vec<u32> = ids.iter().map(|(_, _, id)| *id).collect();
            match self.datapath.backend_stats(&numbers) {
                Ok(stats) => self.backend_counters.update(
                    &metrics.backend_traffic,
                    ids.into_iter()
                        .zip(stats)
                        .map(|((name, endpoint, id), s)| {
                            let mut l = service_labels(&name);
                            l.push(endpoint.to_string());
                            (l, id, s)
                        })
                        .collect(),
                ),
                Err(e) => debug!("reading per-backend counters: {e:#}"),
            }
        }
        if let Ok(stats) = self.datapath.stats() {
            for (stat, n) in &stats {
                metrics
                    .datapath_events
                    .with_label_values(&[stat.name()])
                    .set(*n as f64);
            }
            let line: Vec<String> = stats
                .iter()
                .map(|(s, n)| format!("{}={n}", s.name()))
                .collect();
            debug!("datapath: {}", line.join(" "));
        }
    }

    /// Keeps the datapath's masquerade addresses at this node's InternalIPs (one per family).
    fn follow_masquerade_address(&mut self, loop_state: &SyncLoop) {
        let datapath = &mut self.datapath;
        let wanted = loop_state
            .masquerade_addr
            .map_or(0, |a| u32::from(a).to_be());
        if datapath.config.masquerade_addr != wanted {
            let config = proxy_common::DatapathConfig {
                masquerade_addr: wanted,
                ..datapath.config
            };
            match datapath.configure(&config) {
                Ok(()) => info!(address = ?loop_state.masquerade_addr, "masquerade address"),
                Err(e) => warn!("setting the masquerade address: {e:#}"),
            }
        }
        let wanted6 = loop_state.masquerade_addr6.map_or([0; 16], |a| a.octets());
        if datapath.config6.masquerade_addr != wanted6 {
            let config = proxy_common::DatapathConfig6 {
                masquerade_addr: wanted6,
                ..datapath.config6
            };
            match datapath.configure6(&config) {
                Ok(()) => info!(address = ?loop_state.masquerade_addr6, "IPv6 masquerade address"),
                Err(e) => warn!("setting the IPv6 masquerade address: {e:#}"),
            }
        }
    }
}

/// The sync loop's state: changes read but not yet programmed, batched no more often than
/// minSyncPeriod, with kube-proxy's metrics and health bookkeeping.
struct SyncLoop {
    tracker: ChangeTracker,
    node_name: String,
    node_port_filter: Vec<NodePortAddress>,
    /// The source for masqueraded flows: this node's first IPv4 InternalIP.
    masquerade_addr: Option<std::net::Ipv4Addr>,
    /// The same for IPv6: this node's first IPv6 InternalIP.
    masquerade_addr6: Option<std::net::Ipv6Addr>,
    masquerade_all: bool,
    default_scheduler: proxy_agent::model::Scheduler,
    /// This node's Node object, as last seen (addresses and zone, for features to come).
    node: Option<NodeInfo>,
    pending: Vec<ServiceChange>,
    pending_since: Option<SystemTime>,
    reported: Vec<String>,
    last_sync: Option<Instant>,
    /// When a full sync last succeeded (see [`FULL_SYNC_PERIOD`]).
    last_full_sync: Option<Instant>,
    min_sync_period: Duration,
    health: Health,
    metrics: Arc<Metrics>,
    service_health: ServiceHealthServers,
}

impl SyncLoop {
    /// Takes a new view of the cluster and queues the changes it makes.
    fn ingest(&mut self, set: manifests::ManifestSet) {
        let node = set.nodes.iter().find(|n| n.name == self.node_name);
        let context = NodeContext {
            masquerade_all: self.masquerade_all,
            default_scheduler: self.default_scheduler,
            ..NodeContext::new(
                &self.node_name,
                node,
                &self.node_port_filter,
                &local_addresses(),
            )
        };
        let (desired, model_problems) = DesiredState::build(&set.store, &context);
        self.masquerade_addr = context.masquerade_addr;
        self.masquerade_addr6 = context.masquerade_addr6;
        // Problems are reported when they appear, not again on every reload.
        let problems: Vec<String> = set
            .problems
            .iter()
            .chain(&model_problems)
            .map(ToString::to_string)
            .collect();
        for p in problems.iter().filter(|p| !self.reported.contains(p)) {
            warn!("{p}");
        }
        self.reported = problems;
        let node = set.nodes.into_iter().find(|n| n.name == self.node_name);
        if node != self.node {
            match &node {
                Some(n) => info!("{n}"),
                None => warn!(node = %self.node_name, "this node's Node object is not known"),
            }
            self.node = node;
        }
        let changes = self.tracker.update(desired);
        if !changes.is_empty() {
            let now = SystemTime::now();
            self.pending_since.get_or_insert(now);
            self.health.queued(now);
            self.metrics
                .sync_last_queued_timestamp
                .set(unix_seconds(now));
            let endpoints: usize = changes.iter().map(ServiceChange::endpoint_changes).sum();
            self.metrics
                .service_changes_total
                .inc_by(changes.len() as u64);
            self.metrics.endpoint_changes_total.inc_by(endpoints as u64);
            self.pending.extend(changes);
            self.metrics
                .service_changes_pending
                .set(self.pending.len() as i64);
            self.metrics.endpoint_changes_pending.set(
                self.pending
                    .iter()
                    .map(ServiceChange::endpoint_changes)
                    .sum::<usize>() as i64,
            );
        }
    }

    /// Syncs now, or returns when to, if the last sync was less than minSyncPeriod ago.
    fn sync_or_defer(&mut self, proxier: &mut ActiveProxier) -> Option<Instant> {
        if self.pending.is_empty() {
            return None;
        }
        if let Some(last) = self.last_sync {
            let next = last + self.min_sync_period;
            if Instant::now() < next {
                return Some(next);
            }
        }
        self.sync(proxier, false);
        None
    }

    fn sync(&mut self, proxier: &mut ActiveProxier, full: bool) {
        let started = Instant::now();
        let changes = std::mem::take(&mut self.pending);
        proxier.set_masquerade_addresses(self.masquerade_addr, self.masquerade_addr6);
        let result = if full {
            proxier.sync_full(self.tracker.current())
        } else {
            // Repeated changes to one service port collapse to old -> newest; the proxier
            // only needs to know which ports changed.
            proxier.sync(self.tracker.current(), &changes)
        };
        let elapsed = started.elapsed().as_secs_f64();
        self.last_sync = Some(Instant::now());
        self.metrics.sync_duration.observe(elapsed);
        let full = full || result.as_ref().is_ok_and(|r| r.full);
        if full {
            if result.is_ok() {
                self.last_full_sync = Some(Instant::now());
            }
            self.metrics.sync_full_duration.observe(elapsed);
        } else {
            self.metrics.sync_partial_duration.observe(elapsed);
        }
        self.service_health
            .sync(service_health::wanted(self.tracker.current()));
        // Service ports whose Local policy finds endpoints elsewhere but none here.
        let (mut internal, mut external) = (0, 0);
        for state in self.tracker.current().ports.values() {
            internal += (state.when_empty == WhenEmpty::Drop) as i64;
            external += state
                .external
                .iter()
                .any(|f| f.when_empty == WhenEmpty::Drop) as i64;
        }
        for (policy, n) in [("internal", internal), ("external", external)] {
            self.metrics
                .no_local_endpoints
                .with_label_values(&[policy])
                .set(n);
        }
        let (ports, backends) = proxier.programmed();
        let mode = proxier.mode().as_str();
        self.metrics
            .programmed_service_ports
            .with_label_values(&[mode])
            .set(ports as i64);
        self.metrics
            .programmed_backends
            .with_label_values(&[mode])
            .set(backends as i64);
        proxier.report(&self.metrics);
        if let Ok(r) = &result {
            self.metrics
                .conntrack_deleted_total
                .inc_by(r.flows_deleted as u64);
        }
        match result {
            Ok(report) => {
                self.metrics
                    .unprogrammed_service_ports
                    .set(report.services_failed as i64);
                if report.services_failed == 0 {
                    let now = SystemTime::now();
                    self.health.updated(now);
                    self.metrics.sync_last_timestamp.set(unix_seconds(now));
                    if let Some(since) = self.pending_since.take() {
                        self.metrics
                            .network_programming_duration
                            .observe(now.duration_since(since).unwrap_or_default().as_secs_f64());
                    }
                    self.metrics.service_changes_pending.set(0);
                    self.metrics.endpoint_changes_pending.set(0);
                }
                if !changes.is_empty() || report.services_failed > 0 {
                    info!(
                        full,
                        changes = changes.len(),
                        written = report.services_written,
                        failed = report.services_failed,
                        service_ports = self.tracker.current().ports.len(),
                        elapsed_ms = elapsed * 1000.0,
                        "synced"
                    );
                }
            }
            Err(e) => warn!("sync failed: {e:#}"),
        }
    }
}
