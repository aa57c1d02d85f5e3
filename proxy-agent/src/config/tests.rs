use super::*;

const KUBEADM: &str = include_str!("../../../deploy/config/kubeadm-kube-proxy.yaml");
const OURS: &str = include_str!("../../../deploy/config/proxy-agent.yaml");

fn err(text: &str) -> ConfigError {
    parse(text).unwrap_err()
}

fn kpc(body: &str) -> String {
    format!("apiVersion: {KUBE_PROXY_API_VERSION}\nkind: KubeProxyConfiguration\n{body}")
}

#[test]
fn kubeadm_config_loads_unchanged_and_reports_what_it_ignores() {
    let s = parse(KUBEADM).unwrap();
    assert_eq!(s.mode.as_deref(), Some(""));
    assert_eq!(s.bind_address, Some("0.0.0.0".parse().unwrap()));
    assert_eq!(s.cluster_cidrs, vec!["10.244.0.0/16".to_string()]);
    assert_eq!(
        s.kubeconfig.as_deref(),
        Some("/var/lib/kube-proxy/kubeconfig.conf")
    );
    // kubeadm's zero values mean "default", as in kube-proxy.
    assert_eq!(s.healthz_bind_address, None);
    assert_eq!(s.iptables.sync_period, None);
    assert_eq!(s.conntrack.udp_timeout, None);
    // The kernel's conntrack gets kube-proxy's defaults for the nulls; 0s leaves UDP alone.
    assert_eq!(
        s.conntrack.kernel,
        crate::kernel::conntrack::sysctls::ConntrackSysctls::default()
    );
    for field in ["bindAddressHardFail", "winkernel", "clientConnection.qps"] {
        assert!(
            s.ignored.iter().any(|f| f == field),
            "{field} not reported as ignored: {:?}",
            s.ignored
        );
    }
    assert!(
        !s.ignored.iter().any(|f| f == "portRange"),
        "an empty portRange is not a setting"
    );
}

#[test]
fn every_example_config_in_the_repository_parses() {
    for text in [KUBEADM, OURS] {
        parse(text).unwrap();
    }
    let s = parse(OURS).unwrap();
    assert_eq!(s.mode.as_deref(), Some("ebpf"));
    assert_eq!(s.interfaces.as_deref(), Some("lxc*,cali*,eth0"));
    assert_eq!(s.sync_period, Some(Duration::from_secs(30)));
    assert_eq!(s.min_sync_period, None, "0s is unset");
}

#[test]
fn honoured_fields_reach_the_settings() {
    let s = parse(&kpc(
        "mode: ebpf
bindAddress: 10.0.0.5
healthzBindAddress: 127.0.0.1:20256
metricsBindAddress: 0.0.0.0:20249
hostnameOverride: node-7
clusterCIDR: 10.244.0.0/16,fd00::/48
nodePortAddresses: [10.0.0.0/8, primary]
configSyncPeriod: 1m30s
clientConnection: {kubeconfig: /etc/kube.conf}
logging: {verbosity: 4}
iptables: {masqueradeBit: 14, masqueradeAll: true, syncPeriod: 10s, minSyncPeriod: 1s}
ipvs: {scheduler: wlc, excludeCIDRs: [10.1.0.0/16], strictARP: true, syncPeriod: 20s, minSyncPeriod: 2s, tcpTimeout: 1h, tcpFinTimeout: 2m, udpTimeout: 45s}
nftables: {syncPeriod: 5s, minSyncPeriod: 500ms}
conntrack: {maxPerCore: 32768, min: 131072, tcpEstablishedTimeout: 12h, tcpCloseWaitTimeout: 30m, udpTimeout: 20s, udpStreamTimeout: 90s}
syncPeriod: 40s
minSyncPeriod: 250ms
",
    ))
    .unwrap();
    assert_eq!(s.mode.as_deref(), Some("ebpf"));
    assert_eq!(s.bind_address, Some("10.0.0.5".parse().unwrap()));
    assert_eq!(s.healthz_bind_address.as_deref(), Some("127.0.0.1:20256"));
    assert_eq!(s.metrics_bind_address.as_deref(), Some("0.0.0.0:20249"));
    assert_eq!(s.hostname_override.as_deref(), Some("node-7"));
    assert_eq!(s.cluster_cidrs, vec!["10.244.0.0/16", "fd00::/48"]);
    assert_eq!(s.node_port_addresses, vec!["10.0.0.0/8", "primary"]);
    assert_eq!(s.config_sync_period, Some(Duration::from_secs(90)));
    assert_eq!(s.kubeconfig.as_deref(), Some("/etc/kube.conf"));
    assert_eq!(s.verbosity, Some(4));
    assert_eq!(s.iptables.masquerade_bit, Some(14));
    assert_eq!(s.iptables.masquerade_all, Some(true));
    assert_eq!(s.iptables.sync_period, Some(Duration::from_secs(10)));
    assert_eq!(s.ipvs.scheduler.as_deref(), Some("wlc"));
    assert_eq!(s.ipvs.exclude_cidrs, vec!["10.1.0.0/16"]);
    assert_eq!(s.ipvs.strict_arp, Some(true));
    assert_eq!(s.ipvs.tcp_timeout, Some(Duration::from_secs(3600)));
    assert_eq!(s.ipvs.tcp_fin_timeout, Some(Duration::from_secs(120)));
    assert_eq!(s.ipvs.udp_timeout, Some(Duration::from_secs(45)));
    assert_eq!(s.conntrack.max_per_core, Some(32768));
    assert_eq!(s.conntrack.min, Some(131072));
    assert_eq!(
        s.conntrack.tcp_established_timeout,
        Some(Duration::from_secs(12 * 3600))
    );
    assert_eq!(
        s.conntrack.tcp_close_wait_timeout,
        Some(Duration::from_secs(1800))
    );
    assert_eq!(s.conntrack.udp_timeout, Some(Duration::from_secs(20)));
    assert_eq!(s.conntrack.kernel.udp_timeout, Duration::from_secs(20));
    assert_eq!(
        s.conntrack.kernel.tcp_established_timeout,
        Duration::from_secs(12 * 3600)
    );
    assert_eq!(
        s.conntrack.udp_stream_timeout,
        Some(Duration::from_secs(90))
    );
    assert_eq!(s.sync_period, Some(Duration::from_secs(40)));
    assert_eq!(s.min_sync_period, Some(Duration::from_millis(250)));
    assert!(s.ignored.is_empty(), "{:?}", s.ignored);
}

#[test]
fn top_level_v_is_read_as_verbosity_with_a_warning() {
    let s = parse(&kpc("v: 5\n")).unwrap();
    assert_eq!(s.verbosity, Some(5));
    assert_eq!(s.warnings.len(), 1);
    assert!(s.warnings[0].contains("logging.verbosity"));
}

#[test]
fn unknown_fields_are_rejected_with_their_path() {
    assert_eq!(err(&kpc("modee: ebpf\n")).path, "modee");
    let e = err(&kpc("iptables: {masqueradeBits: 14}\n"));
    assert_eq!(e.path, "iptables.masqueradeBits");
    assert!(e.reason.contains("unknown field"), "{e}");
    assert_eq!(
        err(&kpc("conntrack: {udpTimeOut: 1s}\n")).path,
        "conntrack.udpTimeOut"
    );
    let ours = format!(
        "apiVersion: {AGENT_API_VERSION}\nkind: ProxyAgentConfiguration\nebpf: {{mapSize: 1}}\n"
    );
    assert_eq!(err(&ours).path, "ebpf.mapSize");
    let e = err("apiVersion: v1\nkind: ConfigMap\n");
    assert!(
        e.reason
            .contains("expected kubeproxy.config.k8s.io/v1alpha1"),
        "{e}"
    );
}

#[test]
fn invalid_values_are_rejected_with_their_path_and_reason() {
    let cases = [
        ("mode: fastest\n", "mode", "not a proxy mode"),
        (
            "bindAddress: 10.0.0.300\n",
            "bindAddress",
            "not an IP address",
        ),
        (
            "healthzBindAddress: localhost:abc\n",
            "healthzBindAddress",
            "not an IP or IP:port",
        ),
        (
            "metricsBindAddress: nowhere\n",
            "metricsBindAddress",
            "not an IP or IP:port",
        ),
        (
            "clusterCIDR: 10.244.0.0/40\n",
            "clusterCIDR",
            "prefix length",
        ),
        (
            "nodePortAddresses: [10.0.0.1]\n",
            "nodePortAddresses[0]",
            "not a CIDR",
        ),
        (
            "iptables: {masqueradeBit: 40}\n",
            "iptables.masqueradeBit",
            "out of range",
        ),
        (
            "iptables: {masqueradeBit: -1}\n",
            "iptables.masqueradeBit",
            "negative",
        ),
        (
            "ipvs: {scheduler: fastest}\n",
            "ipvs.scheduler",
            "not an IPVS scheduler",
        ),
        (
            "ipvs: {excludeCIDRs: [nope]}\n",
            "ipvs.excludeCIDRs[0]",
            "not a CIDR",
        ),
        (
            "conntrack: {maxPerCore: -5}\n",
            "conntrack.maxPerCore",
            "negative",
        ),
        (
            "conntrack: {udpTimeout: 30 seconds}\n",
            "conntrack.udpTimeout",
            "unknown unit",
        ),
        ("configSyncPeriod: -1m\n", "configSyncPeriod", "negative"),
        (
            "logging: {verbosity: -1}\n",
            "logging.verbosity",
            "invalid value",
        ),
    ];
    for (body, path, reason) in cases {
        let e = err(&kpc(body));
        assert_eq!(e.path, path, "{body}: {e}");
        assert!(e.reason.contains(reason), "{body}: {e}");
    }
    let ours = format!(
        "apiVersion: {AGENT_API_VERSION}\nkind: ProxyAgentConfiguration\nebpf: {{tcAttach: xdp}}\n"
    );
    assert_eq!(err(&ours).path, "ebpf.tcAttach");
    for (ebpf, path, reason) in [
        (
            "{scheduler: fastest}",
            "ebpf.scheduler",
            "unknown scheduler",
        ),
        ("{maglevTableSize: 16380}", "ebpf.maglevTableSize", "16381"),
    ] {
        let ours = format!(
            "apiVersion: {AGENT_API_VERSION}\nkind: ProxyAgentConfiguration\nebpf: {ebpf}\n"
        );
        let e = err(&ours);
        assert_eq!(e.path, path, "{e}");
        assert!(e.reason.contains(reason), "{e}");
    }
    let ours = format!(
        "apiVersion: {AGENT_API_VERSION}\nkind: ProxyAgentConfiguration\nebpf: {{scheduler: mh, maglevTableSize: 65537}}\n"
    );
    let s = parse(&ours).unwrap();
    assert_eq!(s.scheduler, Some(crate::model::Scheduler::Mh));
    assert_eq!(s.maglev_table_size, Some(65537));
}

#[test]
fn external_ip_cidrs_are_read_and_checked() {
    let ours = |list: &str| {
        format!("apiVersion: {AGENT_API_VERSION}\nkind: ProxyAgentConfiguration\nexternalIPCIDRs: {list}\n")
    };
    let s = parse(&ours("[192.0.2.0/24, \"2001:db8::/64\"]")).unwrap();
    assert_eq!(
        s.external_ip_cidrs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        vec!["192.0.2.0/24", "2001:db8::/64"]
    );
    let e = err(&ours("[192.0.2.0/24, 10.0.0.0/33]"));
    assert_eq!(e.path, "externalIPCIDRs[1]", "{e}");
}

/// A duration too long for the clock was a panic at start; now an error naming the field.
#[test]
fn durations_beyond_gos_range_are_errors_naming_the_field() {
    for text in [
        "99999999999999999999h",
        "2562048h",
        &format!("{}s", "9".repeat(400)),
    ] {
        let e = GoDuration::parse(text).unwrap_err();
        assert!(e.contains("out of range"), "{text}: {e}");
        let e = err(&kpc(&format!("configSyncPeriod: {text}\n")));
        assert_eq!(e.path, "configSyncPeriod", "{e}");
        assert!(e.reason.contains("out of range"), "{e}");
    }
    let longest = GoDuration::parse("2562047h47m16s").unwrap().0;
    assert_eq!(longest.as_secs(), 9_223_372_036);
    // Found by the go_duration fuzzer: summed in floating point, Go's own longest duration
    // came out 575 ns beyond it, and one nanosecond more was accepted.
    let go_max = GoDuration::parse("2562047h47m16.854775807s").unwrap().0;
    assert_eq!(go_max.as_nanos(), i64::MAX as u128);
    assert!(GoDuration::parse("2562047h47m16.854775808s").is_err());
}

#[test]
fn go_durations_parse_as_go_writes_them() {
    let d = |s| GoDuration::parse(s).unwrap().0;
    assert_eq!(d("30s"), Duration::from_secs(30));
    assert_eq!(d("1m0s"), Duration::from_secs(60));
    assert_eq!(d("24h0m0s"), Duration::from_secs(86400));
    assert_eq!(d("1.5h"), Duration::from_secs(5400));
    assert_eq!(d("500ms"), Duration::from_millis(500));
    assert_eq!(d("0"), Duration::ZERO);
    assert_eq!(d("1h2m3.5s"), Duration::from_millis(3_723_500));
    assert_eq!(d(".5s"), Duration::from_millis(500));
    assert_eq!(d("1.s"), Duration::from_secs(1));
    assert_eq!(d("1\u{b5}s"), Duration::from_micros(1));
    assert_eq!(d("+3ns"), Duration::from_nanos(3));
    assert!(GoDuration::parse(".s").is_err());
    assert!(GoDuration::parse("1x").is_err());
    assert!(GoDuration::parse("10").is_err());
    assert!(GoDuration::parse("").is_err());
}

#[test]
fn detect_local_mode_and_its_interfaces_are_read_and_checked() {
    let s = parse(KUBEADM).unwrap();
    assert_eq!(
        s.detect_local_mode, None,
        "kubeadm's empty mode is the default"
    );
    assert_eq!(s.bridge_interface, None);
    let s = parse(&kpc(
        "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: veth}",
    ))
    .unwrap();
    assert_eq!(s.detect_local_mode.as_deref(), Some("InterfaceNamePrefix"));
    assert_eq!(s.interface_name_prefix.as_deref(), Some("veth"));
    assert!(!s.ignored.iter().any(|f| f.starts_with("detectLocal")));
    let e = err(&kpc("detectLocalMode: PodCIDR"));
    assert_eq!(e.path, "detectLocalMode");
    assert!(e.reason.contains("NodeCIDR"), "{e}");
    let e = err(&kpc(
        "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: a-bridge-too-long}",
    ));
    assert_eq!(e.path, "detectLocal.bridgeInterface");
    assert!(e.reason.contains("15 bytes"), "{e}");
}
