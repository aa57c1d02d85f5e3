//! `--config FILE`: kube-proxy's `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1),
//! plus, in a separate document of the same file, this project's own settings
//! (`ProxyAgentConfiguration`, proxy-agent.io/v1alpha1), so nothing of ours is mixed into
//! kube-proxy's fields.
//!
//! Every v1alpha1 field is accepted, so a kubeadm-generated ConfigMap loads unchanged.
//! Fields that mean nothing to this agent are logged once as ignored. Fields that are not in
//! v1alpha1, and invalid values, are rejected with the field path and the reason.

use std::{collections::BTreeMap, fmt, net::IpAddr, path::Path, time::Duration};

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_yaml::Value;

use crate::kernel::conntrack::sysctls::ConntrackSysctls;

pub const KUBE_PROXY_API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const AGENT_API_VERSION: &str = "proxy-agent.io/v1alpha1";

/// A Go duration as kube-proxy's config writes it ("30s", "1m0s", "24h0m0s", "1.5h").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct GoDuration(pub Duration);

/// The longest Go duration: i64::MAX nanoseconds.
const MAX_GO_DURATION_NANOS: u128 = i64::MAX as u128;

impl GoDuration {
    /// Parses as Go's `time.ParseDuration`, in whole nanoseconds (no floating point, so the
    /// longest duration Go accepts is accepted and one nanosecond more is not); fractions
    /// finer than a nanosecond are dropped. Negative durations are errors here.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let body = s.strip_prefix('+').unwrap_or(s);
        if body == "0" {
            return Ok(GoDuration(Duration::ZERO));
        }
        if body.starts_with('-') {
            return Err(format!("{s:?} is negative"));
        }
        if body.is_empty() {
            return Err("empty duration".into());
        }
        let out_of_range =
            || format!("{s:?} is out of range (a duration is at most 2562047h47m16.854775807s)");
        let digits = |t: &str| t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let mut total: u128 = 0;
        let mut rest = body;
        while !rest.is_empty() {
            let (whole, after) = rest.split_at(digits(rest));
            let (fraction, after) = match after.strip_prefix('.') {
                Some(a) => a.split_at(digits(a)),
                None => ("", after),
            };
            if whole.is_empty() && fraction.is_empty() {
                return Err(format!("{s:?} is not a duration"));
            }
            let unit_len = after
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(after.len());
            let (unit, next) = after.split_at(unit_len);
            let scale: u128 = match unit {
                "" => return Err(format!("{s:?}: missing unit (ns, us, ms, s, m, h)")),
                "ns" => 1,
                "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
                "ms" => 1_000_000,
                "s" => 1_000_000_000,
                "m" => 60_000_000_000,
                "h" => 3_600_000_000_000,
                other => {
                    return Err(format!(
                        "{s:?}: unknown unit {other:?} (ns, us, ms, s, m, h)"
                    ))
                }
            };
            let mut nanos: u128 = 0;
            for d in whole.bytes() {
                nanos = nanos * 10 + u128::from(d - b'0');
                if nanos > MAX_GO_DURATION_NANOS {
                    return Err(out_of_range());
                }
            }
            nanos *= scale;
            // 18 digits are finer than a nanosecond of an hour, and keep the product small.
            let (mut part, mut denominator) = (0u128, 1u128);
            for d in fraction.bytes().take(18) {
                part = part * 10 + u128::from(d - b'0');
                denominator *= 10;
            }
            total += nanos + part * scale / denominator;
            if total > MAX_GO_DURATION_NANOS {
                return Err(out_of_range());
            }
            rest = next;
        }
        Ok(GoDuration(Duration::from_nanos(total as u64)))
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        GoDuration::parse(&s).map_err(serde::de::Error::custom)
    }
}

// --- KubeProxyConfiguration v1alpha1, every field (k8s.io/kube-proxy/config/v1alpha1) ---

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub feature_gates: Option<BTreeMap<String, bool>>,
    pub client_connection: Option<ClientConnection>,
    pub logging: Option<Logging>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub bind_address_hard_fail: Option<bool>,
    pub enable_profiling: Option<bool>,
    pub show_hidden_metrics_for_version: Option<String>,
    pub mode: Option<String>,
    pub iptables: Option<IptablesConfig>,
    pub ipvs: Option<IpvsConfig>,
    pub nftables: Option<NftablesConfig>,
    pub winkernel: Option<Value>,
    pub detect_local_mode: Option<String>,
    pub detect_local: Option<DetectLocal>,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub oom_score_adj: Option<i32>,
    pub conntrack: Option<ConntrackConfig>,
    pub config_sync_period: Option<GoDuration>,
    pub port_range: Option<String>,
    pub windows_run_as_service: Option<bool>,
    pub sync_period: Option<GoDuration>,
    pub min_sync_period: Option<GoDuration>,
    /// The userspace mode's UDP session idle timeout (a v1alpha1 field until kube-proxy
    /// removed its userspace mode).
    pub udp_idle_timeout: Option<GoDuration>,
    /// Not a v1alpha1 field, but widely copied guides write it; accepted as an alias of
    /// `logging.verbosity`, with a warning.
    pub v: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClientConnection {
    pub kubeconfig: Option<String>,
    pub accept_content_types: Option<String>,
    pub content_type: Option<String>,
    pub qps: Option<f64>,
    pub burst: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Logging {
    pub format: Option<String>,
    pub flush_frequency: Option<Value>,
    pub verbosity: Option<u32>,
    pub vmodule: Option<Value>,
    pub options: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct IptablesConfig {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: Option<bool>,
    pub localhost_node_ports: Option<bool>,
    pub sync_period: Option<GoDuration>,
    pub min_sync_period: Option<GoDuration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct IpvsConfig {
    pub sync_period: Option<GoDuration>,
    pub min_sync_period: Option<GoDuration>,
    pub scheduler: Option<String>,
    #[serde(rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    pub strict_arp: Option<bool>,
    pub tcp_timeout: Option<GoDuration>,
    pub tcp_fin_timeout: Option<GoDuration>,
    pub udp_timeout: Option<GoDuration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NftablesConfig {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: Option<bool>,
    pub sync_period: Option<GoDuration>,
    pub min_sync_period: Option<GoDuration>,
    pub skip_kernel_version_check: Option<bool>,
}

/// kube-proxy's `detectLocalMode` values (ClusterCIDR is the default).
pub const DETECT_LOCAL_MODES: [&str; 4] = [
    "ClusterCIDR",
    "NodeCIDR",
    "BridgeInterface",
    "InterfaceNamePrefix",
];

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DetectLocal {
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ConntrackConfig {
    pub max_per_core: Option<i32>,
    pub min: Option<i32>,
    pub tcp_established_timeout: Option<GoDuration>,
    pub tcp_close_wait_timeout: Option<GoDuration>,
    pub tcp_be_liberal: Option<bool>,
    pub udp_timeout: Option<GoDuration>,
    pub udp_stream_timeout: Option<GoDuration>,
}

// --- this project's own settings ---

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProxyAgentConfiguration {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub ebpf: Option<EbpfSettings>,
    /// Serve `externalIPs` only inside these CIDRs (every mode); absent or empty: all, as
    /// kube-proxy does.
    #[serde(rename = "externalIPCIDRs")]
    pub external_ip_cidrs: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EbpfSettings {
    pub interfaces: Option<String>,
    pub tc_attach: Option<String>,
    pub bpffs_root: Option<String>,
    pub services_map_size: Option<u32>,
    pub backends_map_size: Option<u32>,
    pub conntrack_map_size: Option<u32>,
    pub sync_period: Option<GoDuration>,
    pub min_sync_period: Option<GoDuration>,
    pub backend_metrics: Option<bool>,
    pub scheduler: Option<String>,
    pub maglev_table_size: Option<u32>,
}

/// A rejected field: its path and why.
#[derive(Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.reason)
    }
}

impl std::error::Error for ConfigError {}

fn bad(path: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        path: path.into(),
        reason: reason.into(),
    }
}

/// The settings the agent runs with, from the file (flags override them afterwards).
#[derive(Clone, Debug, PartialEq)]
pub struct FileSettings {
    pub mode: Option<String>,
    pub bind_address: Option<IpAddr>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub hostname_override: Option<String>,
    pub cluster_cidrs: Vec<String>,
    /// `detectLocalMode`, checked to be one of [`DETECT_LOCAL_MODES`].
    pub detect_local_mode: Option<String>,
    /// `detectLocal.bridgeInterface` and `.interfaceNamePrefix`, checked as interface names.
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
    pub node_port_addresses: Vec<String>,
    pub config_sync_period: Option<Duration>,
    pub udp_idle_timeout: Option<Duration>,
    pub kubeconfig: Option<String>,
    pub verbosity: Option<u32>,
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    pub iptables: IptablesSettings,
    /// `nftables.*`: the same settings, for the nftables mode.
    pub nftables: IptablesSettings,
    pub ipvs: IpvsSettings,
    pub conntrack: ConntrackSettings,
    pub interfaces: Option<String>,
    pub tc_attach: Option<String>,
    pub bpffs_root: Option<String>,
    pub services_map_size: Option<u32>,
    pub backends_map_size: Option<u32>,
    pub conntrack_map_size: Option<u32>,
    pub backend_metrics: Option<bool>,
    /// `ebpf.scheduler`: the default scheduler of Services without the annotation.
    pub scheduler: Option<crate::model::Scheduler>,
    /// `ebpf.maglevTableSize` (a prime).
    pub maglev_table_size: Option<u32>,
    /// `externalIPCIDRs`: external IPs served only inside these; empty: all.
    pub external_ip_cidrs: Vec<crate::model::Cidr>,
    /// Fields accepted but meaningless to this agent (logged once at start).
    pub ignored: Vec<String>,
    /// Warnings (deprecated aliases).
    pub warnings: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct IptablesSettings {
    pub masquerade_bit: Option<u32>,
    pub masquerade_all: Option<bool>,
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    /// `nftables.skipKernelVersionCheck` (the nftables section only).
    pub skip_kernel_version_check: Option<bool>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct IpvsSettings {
    pub scheduler: Option<String>,
    pub exclude_cidrs: Vec<String>,
    pub strict_arp: Option<bool>,
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    pub tcp_timeout: Option<Duration>,
    pub tcp_fin_timeout: Option<Duration>,
    pub udp_timeout: Option<Duration>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConntrackSettings {
    pub max_per_core: Option<u32>,
    pub min: Option<u32>,
    pub tcp_established_timeout: Option<Duration>,
    pub tcp_close_wait_timeout: Option<Duration>,
    pub udp_timeout: Option<Duration>,
    pub udp_stream_timeout: Option<Duration>,
    /// The same section as the kernel conntrack tuning: unset means kube-proxy's default,
    /// zero means "leave the kernel's value".
    pub kernel: ConntrackSysctls,
}

pub const MODES: &[&str] = &[
    "",
    "auto",
    "ebpf",
    "iptables",
    "ipvs",
    "nftables",
    "userspace",
    "kernelspace",
];
pub const IPVS_SCHEDULERS: &[&str] = &[
    "", "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh",
];

fn check_cidr(path: &str, cidr: &str) -> Result<(), ConfigError> {
    let (addr, len) = cidr
        .split_once('/')
        .ok_or_else(|| bad(path, format!("{cidr:?} is not a CIDR (address/length)")))?;
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| bad(path, format!("{cidr:?}: {addr:?} is not an IP address")))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    match len.parse::<u32>() {
        Ok(l) if l <= max => Ok(()),
        _ => Err(bad(
            path,
            format!("{cidr:?}: prefix length must be 0-{max}"),
        )),
    }
}

fn check_host_port(path: &str, value: &str) -> Result<(), ConfigError> {
    if value.is_empty() {
        return Ok(()); // defaulted, as in kube-proxy
    }
    if value.parse::<std::net::SocketAddr>().is_ok() || value.parse::<IpAddr>().is_ok() {
        return Ok(());
    }
    Err(bad(path, format!("{value:?} is not an IP or IP:port")))
}

/// kube-proxy's defaulting treats a zero duration (kubeadm writes `0s` everywhere) as "not
/// set": so does this.
fn duration(_path: &str, d: Option<GoDuration>) -> Result<Option<Duration>, ConfigError> {
    Ok(d.map(|d| d.0).filter(|d| !d.is_zero()))
}

fn non_negative(path: &str, v: Option<i32>) -> Result<Option<u32>, ConfigError> {
    match v {
        None => Ok(None),
        Some(n) if n >= 0 => Ok(Some(n as u32)),
        Some(n) => Err(bad(path, format!("{n} must not be negative"))),
    }
}

/// Parses a config file's text: one `KubeProxyConfiguration` document and optionally one
/// `ProxyAgentConfiguration` document.
pub fn parse(text: &str) -> Result<FileSettings, ConfigError> {
    let mut kube = None;
    let mut agent = None;
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(doc)
            .map_err(|e| bad(&format!("document {}", i + 1), e.to_string()))?;
        if value.is_null() {
            continue;
        }
        let api = value
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or("");
        let kind = value.get("kind").and_then(Value::as_str).unwrap_or("");
        let doc_path = format!("document {}", i + 1);
        match (api, kind) {
            (KUBE_PROXY_API_VERSION, "KubeProxyConfiguration") => {
                let cfg: KubeProxyConfiguration = serde_path_to_error::deserialize(value)
                    .map_err(|e| bad(&e.path().to_string(), e.inner().to_string()))?;
                kube = Some(cfg);
            }
            (AGENT_API_VERSION, "ProxyAgentConfiguration") => {
                let cfg: ProxyAgentConfiguration = serde_path_to_error::deserialize(value)
                    .map_err(|e| bad(&e.path().to_string(), e.inner().to_string()))?;
                agent = Some(cfg);
            }
            _ => {
                return Err(bad(
                    &doc_path,
                    format!(
                        "apiVersion {api:?} kind {kind:?}: expected {KUBE_PROXY_API_VERSION} \
                         KubeProxyConfiguration or {AGENT_API_VERSION} ProxyAgentConfiguration"
                    ),
                ))
            }
        }
    }
    settings(kube.unwrap_or_default(), agent.unwrap_or_default())
}

pub fn load(path: &Path) -> Result<FileSettings> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("--config {}", path.display()))?;
    match parse(&text) {
        Ok(s) => Ok(s),
        Err(e) => bail!("--config {}: {e}", path.display()),
    }
}

fn settings(
    k: KubeProxyConfiguration,
    a: ProxyAgentConfiguration,
) -> Result<FileSettings, ConfigError> {
    let mut ignored = Vec::new();
    let mut warnings = Vec::new();
    let mut ignore = |field: &str, present: bool| {
        if present {
            ignored.push(field.to_string());
        }
    };
    ignore("featureGates", k.feature_gates.is_some());
    ignore("bindAddressHardFail", k.bind_address_hard_fail.is_some());
    ignore("enableProfiling", k.enable_profiling.is_some());
    ignore(
        "showHiddenMetricsForVersion",
        k.show_hidden_metrics_for_version.is_some(),
    );
    ignore("winkernel", k.winkernel.is_some());
    ignore("oomScoreAdj", k.oom_score_adj.is_some());
    ignore(
        "portRange",
        k.port_range.as_deref().is_some_and(|p| !p.is_empty()),
    );
    ignore("windowsRunAsService", k.windows_run_as_service.is_some());
    ignore(
        "iptables.localhostNodePorts",
        k.iptables
            .as_ref()
            .is_some_and(|i| i.localhost_node_ports.is_some()),
    );
    if let Some(c) = &k.client_connection {
        ignore(
            "clientConnection.acceptContentTypes",
            c.accept_content_types.is_some(),
        );
        ignore("clientConnection.contentType", c.content_type.is_some());
        ignore("clientConnection.qps", c.qps.is_some());
        ignore("clientConnection.burst", c.burst.is_some());
    }
    if let Some(l) = &k.logging {
        ignore("logging.format", l.format.is_some());
        ignore("logging.flushFrequency", l.flush_frequency.is_some());
        ignore("logging.vmodule", l.vmodule.is_some());
        ignore("logging.options", l.options.is_some());
    }

    let mode = k.mode.clone();
    if let Some(m) = &mode {
        if !MODES.contains(&m.as_str()) {
            return Err(bad(
                "mode",
                format!("{m:?} is not a proxy mode ({})", MODES[1..].join(", ")),
            ));
        }
    }
    let bind_address = match k.bind_address.as_deref() {
        None | Some("") => None,
        Some(s) => Some(
            s.parse()
                .map_err(|_| bad("bindAddress", format!("{s:?} is not an IP address")))?,
        ),
    };
    if let Some(h) = &k.healthz_bind_address {
        check_host_port("healthzBindAddress", h)?;
    }
    if let Some(m) = &k.metrics_bind_address {
        check_host_port("metricsBindAddress", m)?;
    }
    let cluster_cidrs: Vec<String> = k
        .cluster_cidr
        .as_deref()
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(String::from)
        .collect();
    for c in &cluster_cidrs {
        check_cidr("clusterCIDR", c)?;
    }
    let detect_local_mode = match k.detect_local_mode.as_deref() {
        None | Some("") => None,
        Some(m) if DETECT_LOCAL_MODES.contains(&m) => Some(m.to_string()),
        Some(m) => {
            return Err(bad(
                "detectLocalMode",
                format!("{m:?} is not one of {}", DETECT_LOCAL_MODES.join(", ")),
            ))
        }
    };
    let detect_local = k.detect_local.unwrap_or_default();
    let interface = |path: &str, name: Option<String>| -> Result<_, ConfigError> {
        match name.filter(|n| !n.is_empty()) {
            None => Ok(None),
            Some(n) => {
                crate::model::local::check_interface_name(path, &n).map_err(|m| bad(path, m))?;
                Ok(Some(n))
            }
        }
    };
    let bridge_interface = interface("detectLocal.bridgeInterface", detect_local.bridge_interface)?;
    let interface_name_prefix = interface(
        "detectLocal.interfaceNamePrefix",
        detect_local.interface_name_prefix,
    )?;
    let node_port_addresses = k.node_port_addresses.clone().unwrap_or_default();
    for (i, c) in node_port_addresses.iter().enumerate() {
        if c != "primary" {
            check_cidr(&format!("nodePortAddresses[{i}]"), c)?;
        }
    }
    let mut verbosity = k.logging.as_ref().and_then(|l| l.verbosity);
    if let Some(v) = k.v {
        warnings.push(
            "top-level `v` is not a KubeProxyConfiguration field; read as logging.verbosity".into(),
        );
        verbosity.get_or_insert(v);
    }

    let ipt = k.iptables.unwrap_or_default();
    let masquerade_bit = non_negative("iptables.masqueradeBit", ipt.masquerade_bit)?;
    if let Some(b) = masquerade_bit {
        if b > 31 {
            return Err(bad(
                "iptables.masqueradeBit",
                format!("{b} is out of range (0-31)"),
            ));
        }
    }
    let iptables = IptablesSettings {
        masquerade_bit,
        masquerade_all: ipt.masquerade_all,
        sync_period: duration("iptables.syncPeriod", ipt.sync_period)?,
        min_sync_period: duration("iptables.minSyncPeriod", ipt.min_sync_period)?,
        skip_kernel_version_check: None,
    };
    let ip = k.ipvs.unwrap_or_default();
    if let Some(s) = &ip.scheduler {
        if !IPVS_SCHEDULERS.contains(&s.as_str()) {
            return Err(bad(
                "ipvs.scheduler",
                format!(
                    "{s:?} is not an IPVS scheduler ({})",
                    IPVS_SCHEDULERS[1..].join(", ")
                ),
            ));
        }
    }
    let exclude_cidrs = ip.exclude_cidrs.unwrap_or_default();
    for (i, c) in exclude_cidrs.iter().enumerate() {
        check_cidr(&format!("ipvs.excludeCIDRs[{i}]"), c)?;
    }
    let ipvs = IpvsSettings {
        scheduler: ip.scheduler,
        exclude_cidrs,
        strict_arp: ip.strict_arp,
        sync_period: duration("ipvs.syncPeriod", ip.sync_period)?,
        min_sync_period: duration("ipvs.minSyncPeriod", ip.min_sync_period)?,
        tcp_timeout: duration("ipvs.tcpTimeout", ip.tcp_timeout)?,
        tcp_fin_timeout: duration("ipvs.tcpFinTimeout", ip.tcp_fin_timeout)?,
        udp_timeout: duration("ipvs.udpTimeout", ip.udp_timeout)?,
    };
    let nft = k.nftables.unwrap_or_default();
    let nft_masquerade_bit = non_negative("nftables.masqueradeBit", nft.masquerade_bit)?;
    if let Some(b) = nft_masquerade_bit {
        if b > 31 {
            return Err(bad(
                "nftables.masqueradeBit",
                format!("{b} is out of range (0-31)"),
            ));
        }
    }
    let nftables = IptablesSettings {
        masquerade_bit: nft_masquerade_bit,
        masquerade_all: nft.masquerade_all,
        sync_period: duration("nftables.syncPeriod", nft.sync_period)?,
        min_sync_period: duration("nftables.minSyncPeriod", nft.min_sync_period)?,
        skip_kernel_version_check: nft.skip_kernel_version_check,
    };
    let ct = k.conntrack.unwrap_or_default();
    let conntrack = ConntrackSettings {
        max_per_core: non_negative("conntrack.maxPerCore", ct.max_per_core)?,
        min: non_negative("conntrack.min", ct.min)?,
        tcp_established_timeout: duration(
            "conntrack.tcpEstablishedTimeout",
            ct.tcp_established_timeout,
        )?,
        tcp_close_wait_timeout: duration(
            "conntrack.tcpCloseWaitTimeout",
            ct.tcp_close_wait_timeout,
        )?,
        udp_timeout: duration("conntrack.udpTimeout", ct.udp_timeout)?,
        udp_stream_timeout: duration("conntrack.udpStreamTimeout", ct.udp_stream_timeout)?,
        kernel: {
            let d = ConntrackSysctls::default();
            let raw = |g: &Option<GoDuration>, default| g.as_ref().map_or(default, |g| g.0);
            ConntrackSysctls {
                max_per_core: non_negative("conntrack.maxPerCore", ct.max_per_core)?
                    .unwrap_or(d.max_per_core),
                min: non_negative("conntrack.min", ct.min)?.unwrap_or(d.min),
                tcp_established_timeout: raw(
                    &ct.tcp_established_timeout,
                    d.tcp_established_timeout,
                ),
                tcp_close_wait_timeout: raw(&ct.tcp_close_wait_timeout, d.tcp_close_wait_timeout),
                tcp_be_liberal: ct.tcp_be_liberal.unwrap_or(d.tcp_be_liberal),
                udp_timeout: raw(&ct.udp_timeout, d.udp_timeout),
                udp_stream_timeout: raw(&ct.udp_stream_timeout, d.udp_stream_timeout),
            }
        },
    };

    let mut external_ip_cidrs = Vec::new();
    for (i, c) in a.external_ip_cidrs.iter().flatten().enumerate() {
        external_ip_cidrs.push(
            c.trim()
                .parse::<crate::model::Cidr>()
                .map_err(|m| bad(&format!("externalIPCIDRs[{i}]"), m))?,
        );
    }
    let e = a.ebpf.unwrap_or_default();
    if let Some(t) = &e.tc_attach {
        if !["tcx", "netlink", "auto"].contains(&t.as_str()) {
            return Err(bad(
                "ebpf.tcAttach",
                format!("{t:?} is not one of tcx, netlink, auto"),
            ));
        }
    }
    if let Some(i) = &e.interfaces {
        i.parse::<crate::datapath::attach::InterfacePatterns>()
            .map_err(|m| bad("ebpf.interfaces", m))?;
    }
    // The eBPF mode's own sync periods, else the top-level ones kube-proxy 1.33 added.
    let sync_period =
        duration("ebpf.syncPeriod", e.sync_period)?.or(duration("syncPeriod", k.sync_period)?);
    let min_sync_period = duration("ebpf.minSyncPeriod", e.min_sync_period)?
        .or(duration("minSyncPeriod", k.min_sync_period)?);

    Ok(FileSettings {
        mode,
        bind_address,
        healthz_bind_address: k.healthz_bind_address.filter(|h| !h.is_empty()),
        metrics_bind_address: k.metrics_bind_address.filter(|m| !m.is_empty()),
        hostname_override: k.hostname_override.filter(|h| !h.is_empty()),
        cluster_cidrs,
        detect_local_mode,
        bridge_interface,
        interface_name_prefix,
        node_port_addresses,
        config_sync_period: duration("configSyncPeriod", k.config_sync_period)?,
        udp_idle_timeout: duration("udpIdleTimeout", k.udp_idle_timeout)?,
        kubeconfig: k
            .client_connection
            .and_then(|c| c.kubeconfig)
            .filter(|k| !k.is_empty()),
        verbosity,
        sync_period,
        min_sync_period,
        iptables,
        nftables,
        ipvs,
        conntrack,
        interfaces: e.interfaces,
        tc_attach: e.tc_attach,
        bpffs_root: e.bpffs_root,
        services_map_size: e.services_map_size,
        backends_map_size: e.backends_map_size,
        conntrack_map_size: e.conntrack_map_size,
        backend_metrics: e.backend_metrics,
        scheduler: match &e.scheduler {
            None => None,
            Some(name) => Some(name.parse().map_err(|m: String| bad("ebpf.scheduler", m))?),
        },
        maglev_table_size: match e.maglev_table_size {
            Some(n) if crate::proxier::ebpf::maglev::prime_at_least(n) != n => {
                return Err(bad(
                    "ebpf.maglevTableSize",
                    format!(
                        "{n} is not a prime (Maglev tables need one; {} is the next)",
                        crate::proxier::ebpf::maglev::prime_at_least(n)
                    ),
                ))
            }
            other => other,
        },
        external_ip_cidrs,
        ignored,
        warnings,
    })
}

#[cfg(test)]
mod tests;
