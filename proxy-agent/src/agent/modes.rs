//! Starting the proxier of the mode this agent runs, and `--proxy-mode auto`'s choice.

use anyhow::{bail, Context, Result};
use proxy_common::map_names;
use tracing::{debug, info, warn};

use super::sync_loop::ModeProxier;
use crate::{
    cli::Settings,
    datapath::{
        attach::{AttachMode, Attacher},
        cgroup,
        pins::{self, Adoption, BpffsRoot},
        runtime::{Counters, EbpfRuntime},
        sockets::SocketCleaner,
        Datapath, DatapathSizes, LoadOptions,
    },
    inspect::services::{Counted, Counting, EbpfIds, Traffic},
    kernel::{
        conntrack::flows::ConntrackFlows,
        local_routes::{self, DummyAddresses, KernelLocalRoutes, LocalRoutes},
        nlattr,
    },
    metrics::{service_labels, Metrics},
    model::{DesiredState, Frontend, IpFamily, ServiceChange},
    proxier::{
        ebpf::{maps::KernelMaps, EbpfProxier},
        iptables::{tables::IptablesCommands, IptablesProxier},
        ipvs::{self as ipvs_mode, ipset::IpsetCommand, netlink::KernelIpvs, IpvsProxier},
        nftables::{
            netlink::{self, NftNetlink},
            nft::Nft,
            NftablesProxier,
        },
        userspace::UserspaceProxier,
        Proxier, ProxyMode, SyncReport,
    },
};

/// The proxier of the mode this agent runs.
pub enum ActiveProxier {
    Ebpf(Box<EbpfProxier<KernelMaps>>),
    Iptables(Box<IptablesProxier<IptablesCommands>>),
    Ipvs(Box<IpvsProxier<IptablesCommands, IpsetCommand>>),
    Nftables(Box<NftablesProxier<NftNetlink>>),
    Userspace(Box<UserspaceProxier>),
}

/// Starts `s.mode` (resolved: not auto); the eBPF mode also returns its runtime.
pub fn start(s: &Settings, metrics: &Metrics) -> Result<(ActiveProxier, Option<EbpfRuntime>)> {
    if s.mode != ProxyMode::Ebpf && (s.interfaces.is_some() || s.cli.cgroup_path.is_some()) {
        info!(
            "--interfaces and --cgroup-path are eBPF settings: not used in {} mode",
            s.mode
        );
    }
    Ok(match s.mode {
        ProxyMode::Auto => bail!("proxy mode auto is resolved before this point"),
        ProxyMode::Ebpf => {
            let (proxier, runtime) = start_ebpf(s, metrics)?;
            (ActiveProxier::Ebpf(Box::new(proxier)), Some(runtime))
        }
        ProxyMode::Iptables => {
            let commands = IptablesCommands::host_default();
            for family in [IpFamily::V4, IpFamily::V6] {
                commands.probe(family).context(
                    "the iptables proxier needs iptables-restore and iptables-save for IPv4 and IPv6",
                )?;
            }
            let mut proxier = IptablesProxier::new(
                commands,
                Box::new(ConntrackFlows),
                s.masquerade_bit,
                &s.detect_local.resolve(None),
            );
            proxier.set_drop_invalid(!tcp_be_liberal(s));
            (ActiveProxier::Iptables(Box::new(proxier)), None)
        }
        ProxyMode::Nftables => {
            if let Some(warning) = nftables_kernel_check(s)? {
                warn!("{warning}");
            }
            netlink::probe().context("the nftables proxier needs nf_tables in the kernel")?;
            let proxier = NftablesProxier::new(
                NftNetlink::default(),
                Box::new(ConntrackFlows),
                s.masquerade_bit,
                &s.detect_local.resolve(None),
            );
            (ActiveProxier::Nftables(Box::new(proxier)), None)
        }
        ProxyMode::Ipvs => (ActiveProxier::Ipvs(Box::new(start_ipvs(s)?)), None),
        ProxyMode::Userspace => {
            let routes = KernelLocalRoutes::open()
                .context("the userspace proxier makes service addresses local with routes")?;
            // Its pod ranges come with the first sync (`Proxier::set_local_traffic`).
            let proxier = UserspaceProxier::new(Box::new(routes), s.udp_idle_timeout);
            (ActiveProxier::Userspace(Box::new(proxier)), None)
        }
    })
}

/// `--proxy-mode auto`: the first mode this kernel and node can run, in the order eBPF
/// (its programs load: the verifier accepts them), nftables, iptables, ipvs, userspace;
/// each refusal is logged with its reason.
pub fn choose(s: &Settings) -> Result<ProxyMode> {
    let mut reasons = Vec::new();
    let ebpf = (|| -> Result<()> {
        if s.cli.ebpf_object.is_none() {
            Datapath::ensure_object()?;
        }
        // The smallest datapath, unpinned: loading it runs the verifier on every program.
        let sizes = DatapathSizes {
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
    // The skipped check's warning is logged once, when the mode starts.
    let nft = nftables_kernel_check(s)
        .and_then(|_| netlink::probe())
        .and_then(|()| {
            // A transaction, not just a lookup: the kernel must accept a table.
            NftNetlink::default()
                .apply("add table ip proxy-agent-probe\ndelete table ip proxy-agent-probe\n")
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

/// kube-proxy's kernel requirement of the nftables mode: 5.13 (older kernels' nf_tables
/// can break other nftables users on the node), unless `nftables.skipKernelVersionCheck`
/// says otherwise; then the warning to log is returned.
fn nftables_kernel_check(s: &Settings) -> Result<Option<String>> {
    let skip = s.cli.nftables_skip_kernel_version_check
        || s.file
            .as_ref()
            .and_then(|f| f.nftables.skip_kernel_version_check)
            .unwrap_or(false);
    // What uname says, e.g. "5.10.0-46-amd64"; unreadable counts as new enough.
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut numbers = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().ok());
    let version = match (numbers.next().flatten(), numbers.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor),
        _ => (u32::MAX, 0),
    };
    nftables_kernel(version, skip)
}

/// The decision of [`nftables_kernel_check`] for kernel `version` (major, minor).
fn nftables_kernel(version: (u32, u32), skip: bool) -> Result<Option<String>> {
    if version >= (5, 13) {
        return Ok(None);
    }
    let (major, minor) = version;
    if skip {
        Ok(Some(format!(
            "the nftables mode runs on kernel {major}.{minor} because nftables.skipKernelVersionCheck is set; kube-proxy requires 5.13 (older kernels' nf_tables can break other nftables users on the node)"
        )))
    } else {
        bail!(
            "the nftables mode needs kernel 5.13 or later (this node runs {major}.{minor}), as kube-proxy's does; nftables.skipKernelVersionCheck: true in the configuration file runs it anyway (not recommended in production: it can break other nftables users on the node)"
        )
    }
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
        host_netns_cookie: cgroup::own_netns_cookie(),
        sock_host_only: s.cli.socket_lb == cgroup::SocketLbScope::HostOnly,
    };
    // The kernel's verifier takes most of a start (seconds on a slow or emulated CPU).
    let loading = std::time::Instant::now();
    let mut datapath = match &s.cli.ebpf_object {
        Some(object) => Datapath::load_file(object, sizes, Some(&root), options)?,
        None => Datapath::load_with(sizes, Some(&root), options)?,
    };
    let took_ms = loading.elapsed().as_millis() as u64;
    if datapath.programs_reused {
        info!(
            took_ms,
            "datapath programs reused from the pins of this build (verification skipped)"
        );
    } else {
        info!(took_ms, "datapath programs loaded and verified");
    }
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
    datapath.configure6(&proxy_common::DatapathConfig6::default())?;
    let maps = KernelMaps::take(&mut datapath)?;
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
        (map_names::CONNTRACK6, sizes.conntrack),
        (map_names::LOCAL_IFACES, proxy_common::LOCAL_IFACES_MAX),
    ] {
        metrics
            .map_capacity
            .with_label_values(&[map])
            .set(size as i64);
    }
    let features = crate::datapath::features::KernelFeatures::get();
    for (feature, on) in features.flags().into_iter().chain([
        ("tcx", s.tc_attach.resolve() == AttachMode::Tcx),
        ("netns_cookie", options.host_netns_cookie != 0),
        ("ipv6_datapath", datapath.ipv6),
    ]) {
        metrics
            .ebpf_feature
            .with_label_values(&[feature])
            .set(on as i64);
    }
    if let Some(path) = &s.cli.cgroup_path {
        cgroup::attach(&mut datapath, path, Some(&root))?;
        proxier.set_socket_cleaner(Box::new(SocketCleaner::new(&datapath)?));
    }
    let attacher = s
        .interfaces
        .clone()
        .map(|p| Attacher::new(p, s.tc_attach, Some(&root)));
    let mut runtime = EbpfRuntime::new(datapath, attacher, flow_logger, sizes, s.backend_metrics);
    runtime.traffic_metrics_limit = s.cli.traffic_metrics_limit;
    Ok((proxier, runtime))
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
        Err(e) if nlattr::errno(&e) == Some(libc::EOPNOTSUPP) => {
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
    let mut proxier = IpvsProxier::new(
        ipvs_mode::IpvsKernel {
            ipvs: Box::new(ipvs),
            addresses,
            tables: IptablesCommands::host_default(),
            sets: IpsetCommand,
            flows: Box::new(ConntrackFlows),
        },
        s.masquerade_bit,
        &s.detect_local.resolve(None),
        s.ipvs.options.clone(),
    );
    proxier.set_drop_invalid(!tcp_be_liberal(s));
    Ok(proxier)
}

/// `conntrack.tcpBeLiberal` of the configuration file (kube-proxy's default: false).
fn tcp_be_liberal(s: &Settings) -> bool {
    s.file
        .as_ref()
        .is_some_and(|f| f.conntrack.kernel.tcp_be_liberal)
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

    /// The eBPF proxier's traffic counter ids with their labels: per service port, and per
    /// backend when `backends` (`--backend-metrics`).
    pub fn counter_ids(&self, backends: bool, limit: usize) -> Option<(Counters, Counters)> {
        let ActiveProxier::Ebpf(p) = self else {
            return None;
        };
        let services = Counters::within(p.service_id_count(), limit, || {
            p.service_ids()
                .into_iter()
                .map(|(name, id)| (service_labels(&name), id))
                .collect()
        });
        let backends = if backends {
            Counters::within(p.backend_id_count(), limit, || {
                p.backend_ids()
                    .into_iter()
                    .map(|(name, endpoint, id)| {
                        let mut labels = service_labels(&name);
                        labels.push(endpoint.to_string());
                        (labels, id)
                    })
                    .collect()
            })
        } else {
            Counters::Ids(Vec::new())
        };
        Some((services, backends))
    }

    /// How `inspect services` gets this mode's counters of `ports`: the userspace relays'
    /// (counted here), the eBPF arrays' ids (read off the sync loop), or kernel conntrack
    /// ([`crate::inspect::services::count_conntrack`], off the loop too).
    pub fn counting(
        &self,
        ebpf: Option<&EbpfRuntime>,
        ports: &[std::sync::Arc<crate::model::ServicePortState>],
    ) -> Counting {
        match (self, ebpf) {
            (ActiveProxier::Ebpf(p), Some(runtime)) => Counting::Ebpf(ebpf_ids(p, runtime, ports)),
            (ActiveProxier::Userspace(p), _) => Counting::Done(userspace_counted(p, ports)),
            (ActiveProxier::Ipvs(_), _) => Counting::Ipvs,
            _ => Counting::Conntrack,
        }
    }

    /// The connections the mode itself relays through `ports` (`inspect conntrack`): the
    /// userspace mode's, which kernel conntrack sees as two unrelated flows; `None` for
    /// the modes whose flows conntrack (the kernel's or the eBPF maps) holds.
    pub fn relayed_flows(
        &self,
        ports: &[std::sync::Arc<crate::model::ServicePortState>],
    ) -> Option<Vec<crate::inspect::conntrack::FlowView>> {
        let ActiveProxier::Userspace(p) = self else {
            return None;
        };
        let mut flows = Vec::new();
        for s in ports {
            let name = format!("{}:{}", s.name.service, s.name.port);
            for f in s.frontend_keys() {
                for (client, endpoint) in p.open_connections(&f) {
                    flows.push(crate::inspect::conntrack::FlowView {
                        protocol: f.protocol.to_string(),
                        client,
                        frontend: std::net::SocketAddr::new(f.addr, f.port),
                        backend: endpoint,
                        service: Some(name.clone()),
                        state: "relayed".into(),
                        idle_seconds: None,
                        expires_in_seconds: None,
                    });
                }
            }
        }
        Some(flows)
    }

    /// The backend the mode remembers for `client` at `frontend` under ClientIP affinity,
    /// where the agent itself holds it (userspace; the eBPF mode's is read from its maps).
    pub fn remembered(
        &self,
        frontend: &Frontend,
        client: std::net::IpAddr,
    ) -> Option<crate::inspect::trace::Remembered> {
        let ActiveProxier::Userspace(p) = self else {
            return None;
        };
        let (backend, left) = p.sticky(frontend, client)?;
        Some(crate::inspect::trace::Remembered {
            backend,
            valid_for_seconds: left.as_secs(),
        })
    }
}

/// The userspace relays' counters of `ports` (no packets: TCP is relayed as a stream).
fn userspace_counted(
    p: &UserspaceProxier,
    ports: &[std::sync::Arc<crate::model::ServicePortState>],
) -> Counted {
    let zero = Traffic {
        connections: Some(0),
        bytes: Some(0),
        packets: None,
    };
    let mut counted = Counted {
        source: "the userspace relays' counters (connections or UDP sessions, and bytes both ways; a TCP connection's bytes once it ends), for the endpoints serving now".into(),
        frontend_zero: zero,
        backend_zero: zero,
        ..Counted::default()
    };
    for s in ports {
        for frontend in s.frontend_keys() {
            for (endpoint, (connections, bytes)) in p.relayed(&frontend) {
                let t = Traffic {
                    connections: Some(connections),
                    bytes: Some(bytes),
                    packets: None,
                };
                counted.count(frontend, s.frontend, endpoint, t);
            }
        }
    }
    counted
}

/// The eBPF counter ids of `ports` (their counters are read off the loop): per frontend
/// (`SERVICE_STATS`; a Local frontend's two entry sets both listed) and per backend of each
/// port, draining ones too (`BACKEND_STATS`; a port's frontends share its ids: each once).
fn ebpf_ids(
    p: &EbpfProxier<KernelMaps>,
    runtime: &EbpfRuntime,
    ports: &[std::sync::Arc<crate::model::ServicePortState>],
) -> EbpfIds {
    use std::collections::{BTreeSet, HashMap};
    // Every frontend of the ports asked → the port's cluster-IP frontend.
    let port_of: HashMap<Frontend, Frontend> = ports
        .iter()
        .flat_map(|s| s.frontend_keys().map(|f| (f, s.frontend)))
        .collect();
    let frontends = p
        .frontend_ids()
        .into_iter()
        .filter(|(f, _)| port_of.contains_key(f))
        .collect();
    let backends: BTreeSet<(Frontend, std::net::SocketAddr, u32)> = if runtime.backend_metrics {
        p.frontend_backend_ids()
            .into_iter()
            .filter_map(|(f, addr, id)| Some((*port_of.get(&f)?, addr, id)))
            .collect()
    } else {
        BTreeSet::new()
    };
    EbpfIds {
        frontends,
        backends: backends.into_iter().collect(),
        backend_metrics: runtime.backend_metrics,
    }
}

impl ModeProxier for ActiveProxier {
    fn unprogrammed(&self) -> Vec<(crate::model::ServicePortName, String)> {
        match self {
            ActiveProxier::Ebpf(p) => p
                .failed()
                .into_iter()
                .map(|(name, why)| (name.clone(), why.to_string()))
                .collect(),
            _ => Vec::new(),
        }
    }

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
                catch_up(&metrics.nftables_transactions, p.nft().transactions);
            }
            ActiveProxier::Ipvs(p) => {
                metrics.ipvs_virtual_servers.set(p.virtual_servers() as i64);
                catch_up(&metrics.ipvs_sync_failures, p.failures);
            }
            ActiveProxier::Userspace(p) => {
                metrics.userspace_listeners.set(p.listening() as i64);
                let udp = p.udp_sessions();
                metrics.userspace_udp_sessions.set(udp.open() as i64);
                metrics.userspace_udp_session_limit.set(udp.limit() as i64);
                // Counters follow the proxier's own totals.
                for (counter, total) in [
                    (&metrics.userspace_udp_sessions_evicted, udp.evicted()),
                    (&metrics.userspace_udp_sessions_refused, udp.refused()),
                ] {
                    counter.inc_by(total.saturating_sub(counter.get()));
                }
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

    fn set_local_traffic(&mut self, local: &crate::model::local::LocalTraffic) {
        self.inner().set_local_traffic(local)
    }
}

#[cfg(test)]
mod tests {
    /// kube-proxy's rule: 5.13 and later run the nftables mode; older kernels only with
    /// `nftables.skipKernelVersionCheck`, and then with a warning.
    #[test]
    fn the_nftables_mode_needs_5_13_unless_the_check_is_skipped() {
        use super::nftables_kernel;
        assert_eq!(nftables_kernel((5, 13), false).unwrap(), None);
        assert_eq!(nftables_kernel((6, 1), false).unwrap(), None);
        let refused = nftables_kernel((5, 10), false).unwrap_err().to_string();
        assert!(
            refused.contains("needs kernel 5.13") && refused.contains("runs 5.10"),
            "{refused}"
        );
        assert!(
            refused.contains("nftables.skipKernelVersionCheck"),
            "{refused}"
        );
        let warned = nftables_kernel((5, 10), true).unwrap().unwrap();
        assert!(warned.contains("kernel 5.10"), "{warned}");
    }
}
