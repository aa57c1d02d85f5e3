use clap::CommandFactory;

use super::*;

fn with_config(yaml: &str, args: &[&str]) -> Settings {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, yaml).unwrap();
    let mut argv = vec!["proxy-agent", "--config", path.to_str().unwrap()];
    argv.extend_from_slice(args);
    settings(&Cli::command().get_matches_from(argv)).unwrap()
}

const FILE: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: ebpf
healthzBindAddress: 0.0.0.0:20256
metricsBindAddress: 127.0.0.1:20249
hostnameOverride: from-file
logging: {verbosity: 3}
configSyncPeriod: 2m
conntrack: {maxPerCore: 1000, min: 500000, tcpEstablishedTimeout: 2h, tcpCloseWaitTimeout: 5m, udpTimeout: 10s, udpStreamTimeout: 1m}
syncPeriod: 45s
minSyncPeriod: 2s
---
apiVersion: proxy-agent.io/v1alpha1
kind: ProxyAgentConfiguration
ebpf:
  interfaces: \"eth*\"
  tcAttach: netlink
  bpffsRoot: /sys/fs/bpf/from-file
  servicesMapSize: 1000
  backendsMapSize: 2000
  syncPeriod: 20s
  backendMetrics: true
";

#[test]
fn the_file_sets_what_the_command_line_does_not() {
    let s = with_config(FILE, &[]);
    assert_eq!(s.mode, ProxyMode::Ebpf);
    assert_eq!(s.healthz, "0.0.0.0:20256".parse().unwrap());
    assert_eq!(s.metrics, "127.0.0.1:20249".parse().unwrap());
    assert_eq!(s.node_name, "from-file");
    assert_eq!(s.verbosity, 3);
    assert_eq!(s.config_sync_period, Duration::from_secs(120));
    assert!(s.interfaces.as_ref().unwrap().matches("eth7"));
    assert_eq!(s.tc_attach, AttachMode::Netlink);
    assert_eq!(s.bpffs_root, PathBuf::from("/sys/fs/bpf/from-file"));
    assert_eq!(s.sizes.services, 1000);
    assert_eq!(s.sizes.backends, 2000);
    // The eBPF section's sync period wins over the top-level one; minSyncPeriod comes from
    // the top level, as the section does not set it.
    assert_eq!(s.sync_period, Duration::from_secs(20));
    assert_eq!(s.min_sync_period, Duration::from_secs(2));
    assert!(s.backend_metrics);
    // conntrack: timeouts go to the datapath; the map is max(min, maxPerCore x CPUs).
    assert_eq!(
        s.datapath.tcp_established_timeout_ns,
        2 * 3600 * 1_000_000_000
    );
    assert_eq!(s.datapath.tcp_closing_timeout_ns, 300 * 1_000_000_000);
    assert_eq!(s.datapath.udp_timeout_ns, 10 * 1_000_000_000);
    assert_eq!(s.datapath.udp_stream_timeout_ns, 60 * 1_000_000_000);
    let cpus = std::thread::available_parallelism().unwrap().get() as u32;
    assert_eq!(s.sizes.conntrack, (1000 * cpus).max(500_000));
}

#[test]
fn flags_on_the_command_line_override_the_file() {
    let s = with_config(
        FILE,
        &[
            "--healthz-bind-address",
            "127.0.0.1:1",
            "--metrics-bind-address",
            "127.0.0.1:2",
            "--hostname-override",
            "from-flag",
            "-v",
            "0",
            "--interfaces",
            "lxc*",
            "--tc-attach",
            "tcx",
            "--bpffs-root",
            "/tmp/x",
            "--services-map-size",
            "7",
            "--backends-map-size",
            "8",
            "--conntrack-map-size",
            "9",
        ],
    );
    assert_eq!(s.healthz, "127.0.0.1:1".parse().unwrap());
    assert_eq!(s.metrics, "127.0.0.1:2".parse().unwrap());
    assert_eq!(s.node_name, "from-flag");
    assert_eq!(s.verbosity, 0);
    assert!(s.interfaces.as_ref().unwrap().matches("lxc1"));
    assert!(!s.interfaces.as_ref().unwrap().matches("eth0"));
    assert_eq!(s.tc_attach, AttachMode::Tcx);
    assert_eq!(s.bpffs_root, PathBuf::from("/tmp/x"));
    assert_eq!(
        (s.sizes.services, s.sizes.backends, s.sizes.conntrack),
        (7, 8, 9)
    );
}

#[test]
fn defaults_without_a_file_are_kube_proxys() {
    let s = settings(&Cli::command().get_matches_from(["proxy-agent"])).unwrap();
    assert_eq!(s.healthz, "0.0.0.0:10256".parse().unwrap());
    assert_eq!(s.metrics, "127.0.0.1:10249".parse().unwrap());
    assert_eq!(s.sync_period, Duration::from_secs(30));
    assert_eq!(s.min_sync_period, Duration::ZERO);
    assert_eq!(s.config_sync_period, Duration::from_secs(900));
    assert_eq!(
        s.datapath,
        DatapathConfig {
            maglev_table_size: 16381,
            ..DatapathConfig::DEFAULT
        }
    );
    assert!(!s.backend_metrics, "one series per endpoint is opt-in");
    assert_eq!(s.cli.traffic_metrics_limit, 5000);
    let s =
        settings(&Cli::command().get_matches_from(["proxy-agent", "--backend-metrics"])).unwrap();
    assert!(s.backend_metrics);
}

#[test]
fn the_ipvs_mode_reads_its_section_and_flags() {
    let file = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: ipvs
syncPeriod: 45s
iptables: {masqueradeBit: 12}
ipvs: {scheduler: wlc, excludeCIDRs: [192.0.2.0/24], strictARP: true, tcpTimeout: 15m, tcpFinTimeout: 2m, udpTimeout: 5m, syncPeriod: 20s}
";
    let s = with_config(file, &[]);
    assert_eq!(s.mode, ProxyMode::Ipvs);
    assert_eq!(s.scheduler, crate::model::Scheduler::Wlc);
    assert_eq!(s.sync_period, Duration::from_secs(20));
    // kube-proxy's ipvs mode masquerades with the iptables section's mark.
    assert_eq!(s.masquerade_bit, 12);
    assert!(s.ipvs.strict_arp);
    assert_eq!(
        s.ipvs.options.exclude_cidrs,
        vec!["192.0.2.0/24".parse().unwrap()]
    );
    assert_eq!(
        s.ipvs.options.timeouts,
        crate::proxier::ipvs::netlink::IpvsTimeouts {
            tcp: 900,
            tcp_fin: 120,
            udp: 300
        }
    );
    let s = with_config(
        file,
        &[
            "--ipvs-scheduler",
            "mh",
            "--ipvs-exclude-cidrs",
            "198.51.100.0/24,2001:db8::/32",
            "--ipvs-udp-timeout",
            "10s",
        ],
    );
    assert_eq!(s.scheduler, crate::model::Scheduler::Mh);
    assert_eq!(s.ipvs.options.exclude_cidrs.len(), 2);
    assert_eq!(s.ipvs.options.timeouts.udp, 10);
    let bad = Cli::command().try_get_matches_from([
        "proxy-agent",
        "--proxy-mode",
        "ipvs",
        "--ipvs-exclude-cidrs",
        "10.0.0.0/99",
    ]);
    let err = settings(&bad.unwrap()).err().unwrap();
    assert!(
        format!("{err:#}").contains("--ipvs-exclude-cidrs"),
        "{err:#}"
    );
}

#[test]
fn a_dual_stack_cluster_cidr_sets_one_range_per_family() {
    use crate::model::local::DetectLocal;
    let s = with_config(
        FILE,
        &[
            "--cluster-cidr",
            "10.244.0.0/16, fd00:10:244::/48, 10.99.0.0/16",
        ],
    );
    let cidr = |c: &str| c.parse::<crate::model::Cidr>().unwrap();
    assert_eq!(
        s.detect_local,
        DetectLocal::ClusterCidr(vec![cidr("10.244.0.0/16"), cidr("fd00:10:244::/48")])
    );
}

#[test]
fn detect_local_mode_flags_override_the_file_and_name_what_is_missing() {
    use crate::model::local::DetectLocal;
    let file = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
detectLocalMode: BridgeInterface
detectLocal: {bridgeInterface: cbr0}
";
    assert_eq!(
        with_config(file, &[]).detect_local,
        DetectLocal::BridgeInterface("cbr0".into())
    );
    let s = with_config(
        file,
        &[
            "--detect-local-mode",
            "InterfaceNamePrefix",
            "--pod-interface-name-prefix",
            "veth",
        ],
    );
    assert_eq!(
        s.detect_local,
        DetectLocal::InterfaceNamePrefix("veth".into())
    );
    assert_eq!(
        with_config(file, &["--detect-local-mode", "NodeCIDR"]).detect_local,
        DetectLocal::NodeCidr
    );
    let m = Cli::command()
        .try_get_matches_from(["proxy-agent", "--detect-local-mode", "InterfaceNamePrefix"])
        .unwrap();
    let err = settings(&m).err().unwrap();
    assert!(
        format!("{err:#}")
            .contains("--pod-interface-name-prefix (detectLocal.interfaceNamePrefix) is required"),
        "{err:#}"
    );
    assert!(Cli::command()
        .try_get_matches_from(["proxy-agent", "--detect-local-mode", "PodCIDR"])
        .is_err());
}

#[test]
fn each_netfilter_mode_reads_its_own_section() {
    let file = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
syncPeriod: 45s
iptables: {masqueradeBit: 12, masqueradeAll: false, syncPeriod: 10s}
nftables: {masqueradeBit: 9, masqueradeAll: true, syncPeriod: 7s, minSyncPeriod: 300ms}
";
    let s = with_config(file, &[]);
    assert_eq!(s.mode, ProxyMode::Nftables);
    assert_eq!(s.masquerade_bit, 9);
    assert!(s.masquerade_all);
    assert_eq!(s.sync_period, Duration::from_secs(7));
    assert_eq!(s.min_sync_period, Duration::from_millis(300));
    let s = with_config(file, &["--proxy-mode", "iptables"]);
    assert_eq!(s.masquerade_bit, 12);
    assert!(!s.masquerade_all);
    assert_eq!(s.sync_period, Duration::from_secs(10));
    // The eBPF mode keeps its own periods (here the top-level one).
    let s = with_config(file, &["--proxy-mode", "ebpf"]);
    assert_eq!(s.sync_period, Duration::from_secs(45));
}

#[test]
fn udp_idle_timeout_comes_from_the_flag_then_the_file_then_kube_proxys_default() {
    let file = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: userspace\nudpIdleTimeout: 2s\n";
    let s = with_config(file, &[]);
    assert_eq!(s.mode, ProxyMode::Userspace);
    assert_eq!(s.udp_idle_timeout, Duration::from_secs(2));
    let s = with_config(file, &["--udp-timeout", "500ms"]);
    assert_eq!(s.udp_idle_timeout, Duration::from_millis(500));
    let s = settings(&Cli::command().get_matches_from(["proxy-agent"])).unwrap();
    assert_eq!(s.udp_idle_timeout, Duration::from_millis(250));
}

#[test]
fn external_ip_cidrs_come_from_the_flag_over_the_file() {
    let file = "apiVersion: proxy-agent.io/v1alpha1\nkind: ProxyAgentConfiguration\nexternalIPCIDRs: [192.0.2.0/24]\n";
    let shown = |s: &Settings| {
        s.external_ip_cidrs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(shown(&with_config(file, &[])), ["192.0.2.0/24"]);
    let s = with_config(
        file,
        &["--external-ip-cidrs", "198.51.100.0/24,2001:db8::/32"],
    );
    assert_eq!(shown(&s), ["198.51.100.0/24", "2001:db8::/32"]);
    let none = settings(&Cli::command().get_matches_from(["proxy-agent"])).unwrap();
    assert!(none.external_ip_cidrs.is_empty(), "default: every address");
    let bad = settings(&Cli::command().get_matches_from([
        "proxy-agent",
        "--external-ip-cidrs",
        "10.0.0.0/40",
    ]));
    let e = format!("{:#}", bad.err().expect("an invalid CIDR is an error"));
    assert!(e.contains("--external-ip-cidrs"), "{e}");
}

/// `--mode` is the design card's spelling of `--proxy-mode`; `--help` shows both and every
/// mode.
#[test]
fn mode_is_an_alias_of_proxy_mode_and_help_lists_every_mode() {
    // The file says `mode: ebpf`; the command line wins under either spelling.
    for (args, want) in [
        (&["--mode", "ipvs"][..], ProxyMode::Ipvs),
        (&["--proxy-mode", "nftables"][..], ProxyMode::Nftables),
        (&["--mode=auto"][..], ProxyMode::Auto),
        (&[][..], ProxyMode::Ebpf),
    ] {
        assert_eq!(with_config(FILE, args).mode, want, "{args:?}");
    }
    let help = Cli::command().render_long_help().to_string();
    assert!(
        help.contains("--proxy-mode") && help.contains("--mode"),
        "{help}"
    );
    for mode in ["ebpf", "iptables", "ipvs", "nftables", "userspace", "auto"] {
        assert!(help.contains(mode), "{mode} missing from --help");
    }
}
