//! The command line, and how it combines with the `--config` file: flags given on the
//! command line win, then the file, then the defaults.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result};
use clap::{parser::ValueSource, ArgMatches, FromArgMatches, Parser};
use proxy_common::DatapathConfig;

use crate::{
    config::{self, FileSettings},
    datapath::{
        attach::{AttachMode, InterfacePatterns},
        cgroup::SocketLbScope,
        pins::DEFAULT_BPFFS_ROOT,
        DatapathSizes,
    },
    health::proxy as health,
    model::NodePortAddress,
    proxier::ProxyMode,
};

/// A kube-proxy replacement: programs this node's datapath so that traffic to a Service
/// reaches its pods.
///
/// Flags given on the command line override the --config file.
#[derive(Debug, Parser)]
#[command(version, about, args_override_self = true)]
pub struct Cli {
    /// KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1), optionally followed by a
    /// ProxyAgentConfiguration document with this agent's own settings.
    #[arg(long)]
    pub config: Option<PathBuf>,

    /// Which proxy mode to use: ebpf (default), iptables, ipvs, nftables, userspace, or auto
    /// (the first the kernel and node support, in the order ebpf, nftables, iptables, ipvs,
    /// userspace). `--mode` is the same flag.
    #[arg(
        long = "proxy-mode",
        visible_alias = "mode",
        default_value = "ebpf",
        value_parser = parse_mode
    )]
    pub proxy_mode: ProxyMode,

    /// Read Services, EndpointSlices and Nodes from this YAML/JSON file or directory
    /// instead of an API server; edits are applied while the agent runs.
    #[arg(long)]
    pub manifests: Option<PathBuf>,

    /// With --manifests: how long a burst of writes (an editor's save, a ConfigMap's
    /// symlink swap) may last before the files are read again, once (a Go duration).
    #[arg(long = "manifests-settle", value_parser = parse_duration, default_value = "100ms")]
    pub manifests_settle: Duration,

    /// Attach the datapath to the interfaces whose names match these comma-separated globs
    /// (e.g. `lxc*,eth0`), including interfaces created later.
    #[arg(long)]
    pub interfaces: Option<InterfacePatterns>,

    /// Attach the socket-level hooks (connect, sendmsg, recvmsg, getpeername, release) to
    /// this cgroup v2 directory: every process in it and below gives its sockets a backend
    /// at connect time. At the host's cgroup root (the DaemonSet's) that is the node's own
    /// processes and every pod's; see docs/modes/ebpf.md for what stays with the tc path.
    #[arg(long = "cgroup-path")]
    pub cgroup_path: Option<PathBuf>,

    /// Whose sockets the hooks translate: `all` processes below --cgroup-path, or
    /// `host-only`, the node's network namespace alone (pods' connects stay untouched and
    /// the tc path translates their packets, as service meshes that redirect pods' traffic
    /// need; Cilium's bpf-lb-sock-hostns-only).
    #[arg(long = "socket-lb", value_enum, default_value = "all")]
    pub socket_lb: SocketLbScope,

    /// How to attach: tcx (kernel 6.6+), netlink (clsact qdisc + filter) or auto.
    #[arg(long = "tc-attach", default_value = "auto")]
    pub tc_attach: AttachMode,

    /// bpffs directory for the pinned maps and links that keep the datapath serving while
    /// the agent restarts or upgrades (mounted if absent).
    #[arg(long = "bpffs-root", default_value = DEFAULT_BPFFS_ROOT)]
    pub bpffs_root: PathBuf,

    /// Remove everything this agent installed on the node (programs, links, filters, the
    /// qdiscs it added, pins, maps) and exit.
    #[arg(long)]
    pub cleanup: bool,

    /// The address and port for the health server (/healthz, /livez).
    #[arg(long = "healthz-bind-address", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: String,

    /// The address and port for the metrics server (/metrics, /proxyMode).
    #[arg(long = "metrics-bind-address", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: String,

    /// The address and port of the endpoint `proxy-agent inspect` reads: a loopback address
    /// only, as it explains every tenant's Services.
    #[arg(long = "inspect-address", default_value = crate::inspect::server::DEFAULT_ADDRESS)]
    pub inspect_address: String,

    /// Kubeconfig for the API server (default: in-cluster configuration, else $KUBECONFIG
    /// or ~/.kube/config). Ignored with --manifests.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,

    /// Serve NodePorts only on this node's addresses in these comma-separated CIDRs (or
    /// `primary`: the Node's InternalIPs). Default: the Node object's addresses, or every
    /// local address when there is no Node object.
    #[arg(long = "nodeport-addresses", value_delimiter = ',')]
    pub nodeport_addresses: Option<Vec<String>>,

    /// Serve Services' externalIPs only inside these comma-separated CIDRs; others are
    /// reported on their Service and not served (default: all, as kube-proxy). externalIPs
    /// are written by whoever may edit a Service: this keeps a tenant from taking addresses
    /// it does not own.
    #[arg(long = "external-ip-cidrs", value_delimiter = ',')]
    pub external_ip_cidrs: Option<Vec<String>>,

    /// Source-NAT every flow to a service to the node's address (kube-proxy's
    /// --masquerade-all).
    #[arg(long = "masquerade-all")]
    pub masquerade_all: bool,

    /// eBPF mode: load the IPv6 datapath. Where the kernel's verifier refuses it (none of
    /// 5.10, 6.1 and 6.18 does) the agent warns and serves IPv4 only; `--ebpf-ipv6=false`
    /// skips the attempt (and the time it costs).
    #[arg(long = "ebpf-ipv6", default_value_t = true, action = clap::ArgAction::Set)]
    pub ebpf_ipv6: bool,

    /// Userspace mode: how long a UDP session without traffic is kept (kube-proxy's
    /// --udp-timeout; default 250ms).
    #[arg(long = "udp-timeout", value_parser = parse_duration)]
    pub udp_timeout: Option<Duration>,

    /// ipvs mode: the scheduler of Services without the scheduler annotation (kube-proxy's
    /// --ipvs-scheduler; default rr). Overrides --scheduler in ipvs mode.
    #[arg(long = "ipvs-scheduler")]
    pub ipvs_scheduler: Option<crate::model::Scheduler>,

    /// ipvs mode: comma-separated CIDRs whose IPVS virtual servers are someone else's
    /// (never removed by syncs or cleanup).
    #[arg(long = "ipvs-exclude-cidrs")]
    pub ipvs_exclude_cidrs: Option<String>,

    /// nftables mode: run on a kernel before 5.13, which kube-proxy refuses (older nf_tables
    /// can break other nftables users on the node); `nftables.skipKernelVersionCheck` in
    /// the file.
    #[arg(long = "nftables-skip-kernel-version-check")]
    pub nftables_skip_kernel_version_check: bool,

    /// ipvs mode: arp_ignore=1 and arp_announce=2, so the node answers ARP only for
    /// addresses of the interface asked (kube-ipvs0's stay unannounced; MetalLB L2 needs it).
    #[arg(long = "ipvs-strict-arp")]
    pub ipvs_strict_arp: bool,

    /// ipvs mode: the idle timeout of IPVS TCP connections (0: the kernel's).
    #[arg(long = "ipvs-tcp-timeout", value_parser = parse_duration)]
    pub ipvs_tcp_timeout: Option<Duration>,

    /// ipvs mode: the timeout of IPVS TCP connections after a FIN (0: the kernel's).
    #[arg(long = "ipvs-tcpfin-timeout", value_parser = parse_duration)]
    pub ipvs_tcpfin_timeout: Option<Duration>,

    /// ipvs mode: the timeout of IPVS UDP flows (0: the kernel's).
    #[arg(long = "ipvs-udp-timeout", value_parser = parse_duration)]
    pub ipvs_udp_timeout: Option<Duration>,

    /// The pods' address ranges (comma-separated, the first of each family is used, as
    /// kube-proxy's dual-stack list): flows from outside them to a cluster IP are
    /// source-NATed to the node.
    #[arg(long = "cluster-cidr")]
    pub cluster_cidr: Option<String>,

    /// How the node's pods are told from other clients (kube-proxy's detectLocalMode):
    /// ClusterCIDR (default: source in --cluster-cidr), NodeCIDR (source in the Node's
    /// spec.podCIDRs), BridgeInterface (arrived on --pod-bridge-interface),
    /// InterfaceNamePrefix (arrived on an interface named --pod-interface-name-prefix*).
    #[arg(long = "detect-local-mode", value_parser = clap::builder::PossibleValuesParser::new(crate::config::DETECT_LOCAL_MODES))]
    pub detect_local_mode: Option<String>,

    /// The bridge the node's pods are attached to (--detect-local-mode BridgeInterface).
    #[arg(long = "pod-bridge-interface")]
    pub pod_bridge_interface: Option<String>,

    /// The name prefix of the node's pod interfaces (--detect-local-mode InterfaceNamePrefix).
    #[arg(long = "pod-interface-name-prefix")]
    pub pod_interface_name_prefix: Option<String>,

    /// The name of this node (default: $NODE_NAME, else the host name).
    #[arg(long = "hostname-override")]
    pub hostname_override: Option<String>,

    /// Load the eBPF object from this file instead of the embedded one.
    #[arg(long = "ebpf-object", hide = true)]
    pub ebpf_object: Option<PathBuf>,

    /// Count packets, bytes and connections per backend too (one metric series per endpoint of
    /// every service port).
    #[arg(long = "backend-metrics")]
    pub backend_metrics: bool,

    /// The most service ports (and, with --backend-metrics, backends) whose traffic counters
    /// are exported as metric series: beyond it none of that kind are, as each series costs
    /// the agent memory on every scrape (the datapath keeps counting; the count omitted is
    /// proxy_agent_traffic_series_omitted).
    #[arg(long = "traffic-metrics-limit", default_value_t = 5000)]
    pub traffic_metrics_limit: usize,

    /// Log verbosity, as kube-proxy's -v: 0-1 info, 2-3 debug, 4+ trace.
    #[arg(short = 'v', long = "v", default_value_t = 0)]
    pub verbosity: u32,

    /// Entries of the SERVICES map (one per service port plus one per endpoint of each).
    #[arg(long, default_value_t = DatapathSizes::default().services)]
    pub services_map_size: u32,

    /// Entries of the BACKENDS map (one per endpoint of each service port).
    #[arg(long, default_value_t = DatapathSizes::default().backends)]
    pub backends_map_size: u32,

    /// Entries of the CONNTRACK map (two per tracked flow).
    #[arg(long, default_value_t = DatapathSizes::default().conntrack)]
    pub conntrack_map_size: u32,

    /// The scheduler of Services without the proxy-agent.io/scheduler annotation, by IPVS's
    /// names: random (kube-proxy's iptables behaviour), rr, wrr, sh, dh, mh, ...
    #[arg(long, default_value = "random")]
    pub scheduler: crate::model::Scheduler,

    /// Entries of each Maglev (mh) lookup table: a prime. Each entry of each mh service port
    /// costs about 100 bytes of kernel memory (hash-map entries; see docs/benchmarks.md).
    #[arg(long, default_value_t = 16381)]
    pub maglev_table_size: u32,

    /// Entries of the MAGLEV map, all mh service ports' tables together (allocated as used).
    #[arg(long, default_value_t = DatapathSizes::default().maglev)]
    pub maglev_map_size: u32,

    #[command(subcommand)]
    pub command: Option<Command>,
}

/// What the binary does instead of running the agent.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Look at what the agent on this node decided, and why (docs/inspect.md).
    Inspect(crate::inspect::InspectArgs),
}

const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
const DEFAULT_CONFIG_SYNC_PERIOD: Duration = Duration::from_secs(15 * 60);

fn parse_node_port_addresses(list: Vec<String>) -> Result<Vec<NodePortAddress>> {
    list.iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| {
            if s == "primary" {
                Ok(NodePortAddress::Primary)
            } else {
                s.parse()
                    .map(NodePortAddress::Cidr)
                    .map_err(|e| anyhow::anyhow!("--nodeport-addresses: {e}"))
            }
        })
        .collect()
}

/// This node's name when neither `--hostname-override` nor the file names it: `$NODE_NAME`
/// (the DaemonSet sets it from the pod's node), else the host name.
pub fn default_node_name() -> String {
    std::env::var("NODE_NAME")
        .ok()
        .filter(|n| !n.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .unwrap_or_default()
}

fn parse_mode(s: &str) -> Result<ProxyMode, String> {
    s.parse()
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    crate::config::GoDuration::parse(s).map(|d| d.0)
}

/// Everything the agent runs with, after the file and the flags.
pub struct Settings {
    pub cli: Cli,
    pub mode: ProxyMode,
    pub verbosity: u32,
    pub interfaces: Option<InterfacePatterns>,
    pub tc_attach: AttachMode,
    pub bpffs_root: PathBuf,
    pub sizes: DatapathSizes,
    pub healthz: std::net::SocketAddr,
    pub metrics: std::net::SocketAddr,
    /// `--inspect-address`: loopback only.
    pub inspect: std::net::SocketAddr,
    pub node_name: String,
    /// `--nodeport-addresses` / `nodePortAddresses`: CIDRs or `primary`; empty: unrestricted.
    pub node_port_addresses: Vec<NodePortAddress>,
    /// `--masquerade-all` / `iptables.masqueradeAll`.
    pub masquerade_all: bool,
    /// `--external-ip-cidrs` / `externalIPCIDRs`: external IPs served only inside these.
    pub external_ip_cidrs: Vec<crate::model::Cidr>,
    /// Userspace mode's UDP session idle timeout.
    pub udp_idle_timeout: Duration,
    /// `--scheduler` / `ebpf.scheduler`.
    pub scheduler: crate::model::Scheduler,
    pub backend_metrics: bool,
    pub kubeconfig: Option<PathBuf>,
    pub sync_period: Duration,
    pub min_sync_period: Duration,
    pub config_sync_period: Duration,
    /// The datapath's settings; the cluster CIDR and the masquerade address follow the
    /// Node object (`datapath::runtime`).
    pub datapath: DatapathConfig,
    /// `--detect-local-mode` / `detectLocalMode`, with `--cluster-cidr`'s first range of
    /// each family or the interface it names.
    pub detect_local: crate::model::local::DetectLocal,
    /// `iptables.masqueradeBit` (default 14).
    pub masquerade_bit: u32,
    /// The ipvs mode's own settings (`ipvs.*`, `--ipvs-*`).
    pub ipvs: IpvsModeSettings,
    pub file: Option<FileSettings>,
}

/// What the ipvs mode takes from `ipvs.*` and `--ipvs-*`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IpvsModeSettings {
    pub options: crate::proxier::ipvs::IpvsOptions,
    pub strict_arp: bool,
}

pub fn settings(matches: &ArgMatches) -> Result<Settings> {
    let cli = Cli::from_arg_matches(matches)?;
    let on_command_line = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    let file = cli.config.as_deref().map(config::load).transpose()?;
    let f = file.as_ref();

    let mode = match f.and_then(|f| f.mode.as_deref()) {
        Some(m) if !on_command_line("proxy_mode") => m
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--config: mode: {e}"))?,
        _ => cli.proxy_mode,
    };
    let pick = |id: &str, flag: String, file: Option<String>| {
        if on_command_line(id) {
            flag
        } else {
            file.unwrap_or(flag)
        }
    };
    let healthz = pick(
        "healthz_bind_address",
        cli.healthz_bind_address.clone(),
        f.and_then(|f| f.healthz_bind_address.clone()),
    );
    let metrics = pick(
        "metrics_bind_address",
        cli.metrics_bind_address.clone(),
        f.and_then(|f| f.metrics_bind_address.clone()),
    );
    let interfaces = match (&cli.interfaces, f.and_then(|f| f.interfaces.as_deref())) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(p)) => Some(p.parse().map_err(|e: String| anyhow::anyhow!(e))?),
        (None, None) => None,
    };
    let tc_attach = match f.and_then(|f| f.tc_attach.as_deref()) {
        Some(t) if !on_command_line("tc_attach") => {
            t.parse().map_err(|e: String| anyhow::anyhow!(e))?
        }
        _ => cli.tc_attach,
    };
    let bpffs_root = PathBuf::from(pick(
        "bpffs_root",
        cli.bpffs_root.display().to_string(),
        f.and_then(|f| f.bpffs_root.clone()),
    ));
    let size = |id: &str, flag: u32, file: Option<u32>| {
        if on_command_line(id) {
            flag
        } else {
            file.unwrap_or(flag)
        }
    };
    // kube-proxy sizes the kernel conntrack table as max(min, maxPerCore x CPUs); the same
    // rule sizes ours when the file asks for it and our own setting does not.
    let from_conntrack_section = f.and_then(|f| {
        let per_core = f.conntrack.max_per_core.filter(|n| *n > 0)?;
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1) as u32;
        Some((per_core.saturating_mul(cpus)).max(f.conntrack.min.unwrap_or(0)))
    });
    let sizes = DatapathSizes {
        services: size(
            "services_map_size",
            cli.services_map_size,
            f.and_then(|f| f.services_map_size),
        ),
        backends: size(
            "backends_map_size",
            cli.backends_map_size,
            f.and_then(|f| f.backends_map_size),
        ),
        conntrack: size(
            "conntrack_map_size",
            cli.conntrack_map_size,
            f.and_then(|f| f.conntrack_map_size.or(from_conntrack_section)),
        ),
        maglev: cli.maglev_map_size,
    };
    let ipvs_file = f.map(|f| f.ipvs.clone()).unwrap_or_default();
    let scheduler = if mode == ProxyMode::Ipvs && cli.ipvs_scheduler.is_some() {
        cli.ipvs_scheduler.unwrap_or_default()
    } else if on_command_line("scheduler") {
        cli.scheduler
    } else if mode == ProxyMode::Ipvs
        && ipvs_file
            .scheduler
            .as_deref()
            .is_some_and(|s| !s.is_empty())
    {
        ipvs_file
            .scheduler
            .as_deref()
            .unwrap_or_default()
            .parse()
            .map_err(|e: String| anyhow::anyhow!("ipvs.scheduler: {e}"))?
    } else {
        f.and_then(|f| f.scheduler).unwrap_or(cli.scheduler)
    };
    let exclude_text: Vec<String> = match &cli.ipvs_exclude_cidrs {
        Some(list) => list
            .split(',')
            .map(|c| c.trim().to_string())
            .filter(|c| !c.is_empty())
            .collect(),
        None => ipvs_file.exclude_cidrs.clone(),
    };
    let mut exclude_cidrs = Vec::new();
    for text in &exclude_text {
        exclude_cidrs.push(
            text.parse::<crate::model::Cidr>()
                .map_err(|e| anyhow::anyhow!("--ipvs-exclude-cidrs / ipvs.excludeCIDRs: {e}"))?,
        );
    }
    let seconds = |cli: Option<Duration>, file: Option<Duration>| {
        cli.or(file)
            .map_or(0, |d| d.as_secs().min(u32::MAX as u64) as u32)
    };
    let ipvs_periods = if mode == ProxyMode::Ipvs {
        (ipvs_file.sync_period, ipvs_file.min_sync_period)
    } else {
        (None, None)
    };
    let ipvs = IpvsModeSettings {
        options: crate::proxier::ipvs::IpvsOptions {
            exclude_cidrs,
            timeouts: crate::proxier::ipvs::netlink::IpvsTimeouts {
                tcp: seconds(cli.ipvs_tcp_timeout, ipvs_file.tcp_timeout),
                tcp_fin: seconds(cli.ipvs_tcpfin_timeout, ipvs_file.tcp_fin_timeout),
                udp: seconds(cli.ipvs_udp_timeout, ipvs_file.udp_timeout),
            },
        },
        strict_arp: cli.ipvs_strict_arp || ipvs_file.strict_arp.unwrap_or(false),
    };
    let maglev_table_size = size(
        "maglev_table_size",
        cli.maglev_table_size,
        f.and_then(|f| f.maglev_table_size),
    );
    if crate::proxier::ebpf::maglev::prime_at_least(maglev_table_size) != maglev_table_size {
        anyhow::bail!("--maglev-table-size: {maglev_table_size} is not a prime");
    }

    let verbosity = if on_command_line("verbosity") {
        cli.verbosity
    } else {
        f.and_then(|f| f.verbosity).unwrap_or(cli.verbosity)
    };
    let node_name = cli
        .hostname_override
        .clone()
        .or_else(|| f.and_then(|f| f.hostname_override.clone()))
        .unwrap_or_else(default_node_name);
    let mut datapath = DatapathConfig::DEFAULT;
    datapath.maglev_table_size = maglev_table_size;
    if let Some(ct) = f.map(|f| &f.conntrack) {
        let ns = |d: Duration| d.as_nanos() as u64;
        if let Some(d) = ct.tcp_established_timeout {
            datapath.tcp_established_timeout_ns = ns(d);
        }
        if let Some(d) = ct.tcp_close_wait_timeout {
            datapath.tcp_closing_timeout_ns = ns(d);
        }
        if let Some(d) = ct.udp_timeout {
            datapath.udp_timeout_ns = ns(d);
        }
        if let Some(d) = ct.udp_stream_timeout {
            datapath.udp_stream_timeout_ns = ns(d);
        }
    }
    let cidrs: Vec<String> = match &cli.cluster_cidr {
        Some(list) => list.split(',').map(|c| c.trim().to_string()).collect(),
        None => f.map(|f| f.cluster_cidrs.clone()).unwrap_or_default(),
    };
    // One range per family (kube-proxy takes the first of each in a dual-stack list).
    let mut cluster_cidrs: Vec<crate::model::Cidr> = Vec::new();
    for text in cidrs.iter().filter(|c| !c.is_empty()) {
        let cidr: crate::model::Cidr = text
            .parse()
            .map_err(|e| anyhow::anyhow!("--cluster-cidr: {e}"))?;
        if !cluster_cidrs
            .iter()
            .any(|c| c.addr.is_ipv4() == cidr.addr.is_ipv4())
        {
            cluster_cidrs.push(cidr);
        }
    }
    let detect_local = detect_local(&cli, f, cluster_cidrs)?;
    // The file's section of the netfilter mode in use: kube-proxy reads `iptables.*` in
    // iptables mode and `nftables.*` in nftables mode. (The eBPF mode has its own sync
    // periods and reads `iptables.masqueradeAll`, as before.)
    let section = f.and_then(|f| match mode {
        ProxyMode::Nftables => Some(&f.nftables),
        ProxyMode::Iptables => Some(&f.iptables),
        _ => None,
    });
    let masquerade_section = f.map(|f| match mode {
        ProxyMode::Nftables => &f.nftables,
        _ => &f.iptables,
    });
    Ok(Settings {
        mode,
        verbosity,
        interfaces,
        tc_attach,
        bpffs_root,
        sizes,
        healthz: health::bind_address(&healthz, 10256).context("healthzBindAddress")?,
        metrics: health::bind_address(&metrics, 10249).context("metricsBindAddress")?,
        inspect: crate::inspect::server::address(&cli.inspect_address)
            .context("--inspect-address")?,
        node_name,
        node_port_addresses: parse_node_port_addresses(
            cli.nodeport_addresses
                .clone()
                .or_else(|| f.map(|f| f.node_port_addresses.clone()))
                .unwrap_or_default(),
        )?,
        scheduler,
        external_ip_cidrs: match &cli.external_ip_cidrs {
            Some(list) => list
                .iter()
                .map(|c| c.trim())
                .filter(|c| !c.is_empty())
                .map(|c| {
                    c.parse()
                        .map_err(|e| anyhow::anyhow!("--external-ip-cidrs: {e}"))
                })
                .collect::<Result<_>>()?,
            None => f.map(|f| f.external_ip_cidrs.clone()).unwrap_or_default(),
        },
        masquerade_all: cli.masquerade_all
            || masquerade_section
                .and_then(|t| t.masquerade_all)
                .unwrap_or(false),
        udp_idle_timeout: cli
            .udp_timeout
            .or(f.and_then(|f| f.udp_idle_timeout))
            .unwrap_or(crate::proxier::userspace::DEFAULT_UDP_IDLE_TIMEOUT),
        backend_metrics: cli.backend_metrics || f.and_then(|f| f.backend_metrics).unwrap_or(false),
        kubeconfig: cli
            .kubeconfig
            .clone()
            .or_else(|| f.and_then(|f| f.kubeconfig.clone()).map(PathBuf::from)),
        // The mode's own section first (iptables.syncPeriod, ...), as kube-proxy reads it.
        sync_period: section
            .and_then(|t| t.sync_period)
            .or(ipvs_periods.0)
            .or(f.and_then(|f| f.sync_period))
            .unwrap_or(DEFAULT_SYNC_PERIOD),
        min_sync_period: section
            .and_then(|t| t.min_sync_period)
            .or(ipvs_periods.1)
            .or(f.and_then(|f| f.min_sync_period))
            .unwrap_or(Duration::ZERO),
        config_sync_period: f
            .and_then(|f| f.config_sync_period)
            .unwrap_or(DEFAULT_CONFIG_SYNC_PERIOD),
        datapath,
        detect_local,
        masquerade_bit: masquerade_section
            .and_then(|t| t.masquerade_bit)
            .unwrap_or(crate::proxier::iptables::rules::DEFAULT_MASQUERADE_BIT),
        ipvs,
        file,
        cli,
    })
}

#[cfg(test)]
mod tests;

/// `--detect-local-mode` and its parameter, each flag over its `detectLocal*` field.
fn detect_local(
    cli: &Cli,
    f: Option<&FileSettings>,
    cluster_cidrs: Vec<crate::model::Cidr>,
) -> Result<crate::model::local::DetectLocal> {
    use crate::model::local::{check_interface_name, DetectLocal};
    let mode = cli
        .detect_local_mode
        .clone()
        .or_else(|| f.and_then(|f| f.detect_local_mode.clone()))
        .unwrap_or_else(|| "ClusterCIDR".into());
    let interface = |flag: &Option<String>, field: Option<&String>, names: &str| {
        let name = flag.clone().or_else(|| field.cloned()).unwrap_or_default();
        check_interface_name(names, &name).map_err(|m| anyhow::anyhow!(m))?;
        anyhow::Ok(name)
    };
    Ok(match mode.as_str() {
        "NodeCIDR" => DetectLocal::NodeCidr,
        "BridgeInterface" => DetectLocal::BridgeInterface(interface(
            &cli.pod_bridge_interface,
            f.and_then(|f| f.bridge_interface.as_ref()),
            "--pod-bridge-interface (detectLocal.bridgeInterface)",
        )?),
        "InterfaceNamePrefix" => DetectLocal::InterfaceNamePrefix(interface(
            &cli.pod_interface_name_prefix,
            f.and_then(|f| f.interface_name_prefix.as_ref()),
            "--pod-interface-name-prefix (detectLocal.interfaceNamePrefix)",
        )?),
        _ => DetectLocal::ClusterCidr(cluster_cidrs),
    })
}
