//! Validated, source-independent forms of the Kubernetes objects the proxy reads.
//!
//! Both sources (manifest files now, the API server later) convert `k8s-openapi` objects into
//! these types, so every field check lives in one place and the model never sees an address
//! that does not parse or a port out of range. A conversion error names the offending field.

use std::{collections::BTreeMap, fmt, net::IpAddr};

use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::util::intstr::IntOrString,
};

/// Label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// Kubernetes spelling; absent means TCP.
    pub fn parse(value: Option<&str>) -> Result<Self, String> {
        match value.unwrap_or("TCP") {
            "TCP" => Ok(Protocol::Tcp),
            "UDP" => Ok(Protocol::Udp),
            "SCTP" => Ok(Protocol::Sctp),
            other => Err(format!(
                "unknown protocol {other:?} (expected TCP, UDP or SCTP)"
            )),
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            proxy_common::IPPROTO_TCP => Some(Protocol::Tcp),
            proxy_common::IPPROTO_UDP => Some(Protocol::Udp),
            proxy_common::IPPROTO_SCTP => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// IANA protocol number, as in the IPv4 header.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => proxy_common::IPPROTO_TCP,
            Protocol::Udp => proxy_common::IPPROTO_UDP,
            Protocol::Sctp => proxy_common::IPPROTO_SCTP,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

/// `namespace/name` of an object.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectName {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for ObjectName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A field that failed validation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

fn field_error(field: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        message: message.into(),
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetPort {
    Number(u16),
    Name(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortSpec {
    /// Port name; "" when the Service has a single unnamed port.
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
    pub target_port: TargetPort,
    /// The node port, for NodePort and LoadBalancer services (unless allocation is off).
    pub node_port: Option<u16>,
}

/// `spec.type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceType {
    ClusterIp,
    NodePort,
    LoadBalancer,
    ExternalName,
}

/// An address block (`10.0.0.0/8`), as in `loadBalancerSourceRanges`, `clusterCIDR` and
/// `nodePortAddresses`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - self.prefix as u32).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - self.prefix as u32).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (addr, len) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not a CIDR (address/length)"))?;
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?}: {addr:?} is not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        match len.parse::<u8>() {
            Ok(prefix) if prefix <= max => Ok(Cidr { addr, prefix }),
            _ => Err(format!("{s:?}: prefix length must be 0-{max}")),
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Annotation that turns on topology-aware routing (and its deprecated predecessor). Read by
/// the EndpointSlice controller, which writes the hints this agent follows, as
/// `trafficDistribution` is.
pub const TOPOLOGY_MODE_ANNOTATION: &str = "service.kubernetes.io/topology-mode";
pub const TOPOLOGY_HINTS_ANNOTATION: &str = "service.kubernetes.io/topology-aware-hints";

/// Annotation choosing a Service's scheduler, by IPVS's names.
pub const SCHEDULER_ANNOTATION: &str = "proxy-agent.io/scheduler";
/// Annotation with endpoint weights for the weighted schedulers: `ADDRESS=WEIGHT,...`
/// (endpoints not listed weigh 1; weight 0 takes no new connections, as in IPVS).
pub const WEIGHTS_ANNOTATION: &str = "proxy-agent.io/weights";

/// IPVS's scheduling algorithms, by their names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Scheduler {
    /// Uniformly random: kube-proxy's iptables and nftables behaviour.
    #[default]
    Random,
    Rr,
    Wrr,
    Lc,
    Wlc,
    Lblc,
    Lblcr,
    Sh,
    Dh,
    Sed,
    Nq,
    Mh,
}

impl Scheduler {
    pub const ALL: [Scheduler; 12] = [
        Scheduler::Random,
        Scheduler::Rr,
        Scheduler::Wrr,
        Scheduler::Lc,
        Scheduler::Wlc,
        Scheduler::Lblc,
        Scheduler::Lblcr,
        Scheduler::Sh,
        Scheduler::Dh,
        Scheduler::Sed,
        Scheduler::Nq,
        Scheduler::Mh,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scheduler::Random => "random",
            Scheduler::Rr => "rr",
            Scheduler::Wrr => "wrr",
            Scheduler::Lc => "lc",
            Scheduler::Wlc => "wlc",
            Scheduler::Lblc => "lblc",
            Scheduler::Lblcr => "lblcr",
            Scheduler::Sh => "sh",
            Scheduler::Dh => "dh",
            Scheduler::Sed => "sed",
            Scheduler::Nq => "nq",
            Scheduler::Mh => "mh",
        }
    }

    /// The scheduler's id in the eBPF datapath's frontend header.
    pub fn datapath_id(self) -> u16 {
        use proxy_common::scheduler as id;
        match self {
            Scheduler::Random => id::RANDOM,
            Scheduler::Rr => id::RR,
            Scheduler::Wrr => id::WRR,
            Scheduler::Sh => id::SH,
            Scheduler::Dh => id::DH,
            Scheduler::Mh => id::MH,
            Scheduler::Lc => id::LC,
            Scheduler::Wlc => id::WLC,
            Scheduler::Sed => id::SED,
            Scheduler::Nq => id::NQ,
            Scheduler::Lblc => id::LBLC,
            Scheduler::Lblcr => id::LBLCR,
        }
    }
}

impl std::str::FromStr for Scheduler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Scheduler::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Scheduler::ALL.iter().map(|x| x.name()).collect();
                format!(
                    "unknown scheduler {s:?} (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// Kubernetes' default `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceInfo {
    pub name: ObjectName,
    /// `metadata.creationTimestamp` in Unix seconds (unknown in manifests without one):
    /// between two Services claiming one external address, the older wins.
    pub created: Option<i64>,
    pub service_type: ServiceType,
    /// Cluster IPs, primary first; empty for headless and ExternalName services, which the
    /// proxy does not serve.
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePortSpec>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`, except those with `ipMode: Proxy` (the load
    /// balancer then delivers to the node, not to the IP).
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges`; empty means everyone.
    pub source_ranges: Vec<Cidr>,
    /// `sessionAffinity: ClientIP`: the affinity timeout in seconds.
    pub affinity_timeout: Option<u32>,
    /// `externalTrafficPolicy: Local`.
    pub external_local: bool,
    /// `internalTrafficPolicy: Local`.
    pub internal_local: bool,
    pub health_check_node_port: Option<u16>,
    /// The `proxy-agent.io/scheduler` annotation, when set.
    pub scheduler: Option<Scheduler>,
    /// The `proxy-agent.io/weights` annotation: endpoint address -> weight.
    pub weights: BTreeMap<IpAddr, u16>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum AddressType {
    IPv4,
    IPv6,
    Fqdn,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    pub name: String,
    pub protocol: Protocol,
    /// None: the slice does not restrict this port (rare; only numeric targetPorts resolve).
    pub port: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    pub addr: IpAddr,
    /// Absent conditions count as true, as in Kubernetes (ready/serving) and false
    /// (terminating).
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<String>,
    pub zone: Option<String>,
    /// `hints.forZones[].name`: the zones the EndpointSlice controller assigned it to.
    pub zone_hints: Vec<String>,
    /// `hints.forNodes[].name`: the nodes it was assigned to (`trafficDistribution:
    /// PreferSameNode`).
    pub node_hints: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceInfo {
    pub name: ObjectName,
    /// Namespace/name of the Service this slice belongs to.
    pub service: ObjectName,
    pub address_type: AddressType,
    pub ports: Option<Vec<SlicePort>>,
    pub endpoints: Vec<EndpointInfo>,
}

fn object_name(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Result<ObjectName, FieldError> {
    let name = meta
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| field_error("metadata.name", "missing"))?;
    dns_subdomain("metadata.name", &name)?;
    let namespace = meta.namespace.clone().unwrap_or_else(|| "default".into());
    dns_label("metadata.namespace", &namespace)?;
    Ok(ObjectName { namespace, name })
}

/// Names end up in rule text (iptables and nft comments, chain names' hashes, logs): they
/// are held to the API server's own rules, so a manifest or a replayed object cannot carry
/// a quote, a newline or a rule of its own into an `iptables-restore` or `nft` script.
/// Lowercase letters, digits and '-', starting and ending with a letter or digit: a
/// label's characters (a subdomain's labels have no length of their own).
fn label_chars(value: &str) -> bool {
    !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !value.starts_with('-')
        && !value.ends_with('-')
}

fn dns_label(field: &str, value: &str) -> Result<(), FieldError> {
    if value.len() <= 63 && label_chars(value) {
        return Ok(());
    }
    Err(field_error(
        field,
        format!(
            "{:?} is not a DNS-1123 label (at most 63 lowercase letters, digits and '-', \
             starting and ending with a letter or digit)",
            truncated(value)
        ),
    ))
}

/// A DNS-1123 subdomain: dot-separated labels, at most 253 characters.
fn dns_subdomain(field: &str, value: &str) -> Result<(), FieldError> {
    if value.len() <= 253 && value.split('.').all(label_chars) {
        return Ok(());
    }
    Err(field_error(
        field,
        format!(
            "{:?} is not a DNS-1123 subdomain (at most 253 lowercase letters, digits, '-' \
             and '.')",
            truncated(value)
        ),
    ))
}

/// A port's name: empty (a single unnamed port) or a DNS-1123 label.
fn port_name(field: &str, value: Option<&String>) -> Result<String, FieldError> {
    match value.map(String::as_str) {
        None | Some("") => Ok(String::new()),
        Some(v) => dns_label(field, v).map(|()| v.to_string()),
    }
}

/// At most 80 characters of a hostile value, for an error message.
fn truncated(value: &str) -> String {
    value.chars().take(80).collect()
}

/// Name of the object for messages, even when it is otherwise invalid.
pub fn display_name(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or("<unnamed>")
    )
}

fn port_number(value: i32, field: &str) -> Result<u16, FieldError> {
    u16::try_from(value)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| field_error(field, format!("{value} is not a port number (1-65535)")))
}

impl ServiceInfo {
    pub fn from_api(svc: &Service) -> Result<Self, FieldError> {
        let name = object_name(&svc.metadata)?;
        let spec = svc
            .spec
            .as_ref()
            .ok_or_else(|| field_error("spec", "missing"))?;

        let mut ports = Vec::new();
        for (i, p) in spec.ports.iter().flatten().enumerate() {
            let port = port_number(p.port, &format!("spec.ports[{i}].port"))?;
            let protocol = Protocol::parse(p.protocol.as_deref())
                .map_err(|m| field_error(format!("spec.ports[{i}].protocol"), m))?;
            let target_port = match &p.target_port {
                None => TargetPort::Number(port),
                Some(IntOrString::Int(n)) => {
                    TargetPort::Number(port_number(*n, &format!("spec.ports[{i}].targetPort"))?)
                }
                Some(IntOrString::String(s)) if s.is_empty() => TargetPort::Number(port),
                Some(IntOrString::String(s)) => match s.parse::<i32>() {
                    Ok(n) => {
                        TargetPort::Number(port_number(n, &format!("spec.ports[{i}].targetPort"))?)
                    }
                    Err(_) => {
                        dns_label(&format!("spec.ports[{i}].targetPort"), s)?;
                        TargetPort::Name(s.clone())
                    }
                },
            };
            let node_port = match p.node_port {
                None | Some(0) => None,
                Some(n) => Some(port_number(n, &format!("spec.ports[{i}].nodePort"))?),
            };
            ports.push(ServicePortSpec {
                name: port_name(&format!("spec.ports[{i}].name"), p.name.as_ref())?,
                protocol,
                port,
                target_port,
                node_port,
            });
        }

        let service_type = match spec.type_.as_deref().unwrap_or("ClusterIP") {
            "ClusterIP" | "" => ServiceType::ClusterIp,
            "NodePort" => ServiceType::NodePort,
            "LoadBalancer" => ServiceType::LoadBalancer,
            "ExternalName" => ServiceType::ExternalName,
            other => {
                return Err(field_error(
                    "spec.type",
                    format!("unknown type {other:?} (expected ClusterIP, NodePort, LoadBalancer or ExternalName)"),
                ))
            }
        };
        let external_name = service_type == ServiceType::ExternalName;
        let mut cluster_ips = Vec::new();
        if !external_name {
            let listed: Vec<(String, &str)> = match &spec.cluster_ips {
                Some(ips) if !ips.is_empty() => ips
                    .iter()
                    .enumerate()
                    .map(|(i, ip)| (format!("spec.clusterIPs[{i}]"), ip.as_str()))
                    .collect(),
                _ => spec
                    .cluster_ip
                    .iter()
                    .map(|ip| ("spec.clusterIP".to_string(), ip.as_str()))
                    .collect(),
            };
            for (field, ip) in listed {
                if ip.is_empty() || ip == "None" {
                    continue; // headless
                }
                let addr = ip
                    .parse::<IpAddr>()
                    .map_err(|_| field_error(field, format!("{ip:?} is not an IP address")))?;
                cluster_ips.push(addr);
            }
        }
        let ip = |field: String, text: &str| {
            text.parse::<IpAddr>()
                .map_err(|_| field_error(field, format!("{text:?} is not an IP address")))
        };
        let mut external_ips = Vec::new();
        for (i, text) in spec.external_ips.iter().flatten().enumerate() {
            external_ips.push(ip(format!("spec.externalIPs[{i}]"), text)?);
        }
        let mut load_balancer_ips = Vec::new();
        if service_type == ServiceType::LoadBalancer {
            let ingress = svc
                .status
                .as_ref()
                .and_then(|s| s.load_balancer.as_ref())
                .and_then(|lb| lb.ingress.as_ref());
            for (i, entry) in ingress.into_iter().flatten().enumerate() {
                let Some(text) = entry.ip.as_deref().filter(|t| !t.is_empty()) else {
                    continue; // hostname-only ingress: nothing to program
                };
                if entry.ip_mode.as_deref() == Some("Proxy") {
                    continue;
                }
                load_balancer_ips.push(ip(format!("status.loadBalancer.ingress[{i}].ip"), text)?);
            }
        }
        let mut source_ranges = Vec::new();
        for (i, text) in spec
            .load_balancer_source_ranges
            .iter()
            .flatten()
            .enumerate()
        {
            source_ranges.push(
                text.parse::<Cidr>()
                    .map_err(|m| field_error(format!("spec.loadBalancerSourceRanges[{i}]"), m))?,
            );
        }
        let affinity_timeout = match spec.session_affinity.as_deref() {
            None | Some("None") | Some("") => None,
            Some("ClientIP") => {
                let t = spec
                    .session_affinity_config
                    .as_ref()
                    .and_then(|c| c.client_ip.as_ref())
                    .and_then(|c| c.timeout_seconds);
                match t {
                    None => Some(DEFAULT_AFFINITY_TIMEOUT),
                    Some(t) if (1..=86400).contains(&t) => Some(t as u32),
                    Some(t) => {
                        return Err(field_error(
                            "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                            format!("{t} must be 1-86400"),
                        ))
                    }
                }
            }
            Some(other) => {
                return Err(field_error(
                    "spec.sessionAffinity",
                    format!("unknown affinity {other:?} (expected None or ClientIP)"),
                ))
            }
        };
        let policy = |field: &str, value: Option<&str>| match value {
            None | Some("") | Some("Cluster") => Ok(false),
            Some("Local") => Ok(true),
            Some(other) => Err(field_error(
                field,
                format!("unknown policy {other:?} (expected Cluster or Local)"),
            )),
        };
        let external_local = policy(
            "spec.externalTrafficPolicy",
            spec.external_traffic_policy.as_deref(),
        )?;
        let internal_local = policy(
            "spec.internalTrafficPolicy",
            spec.internal_traffic_policy.as_deref(),
        )?;
        let health_check_node_port = match spec.health_check_node_port {
            None | Some(0) => None,
            Some(n) => Some(port_number(n, "spec.healthCheckNodePort")?),
        };
        let annotations = svc.metadata.annotations.clone().unwrap_or_default();
        let scheduler = match annotations.get(SCHEDULER_ANNOTATION) {
            None => None,
            Some(v) => Some(v.parse::<Scheduler>().map_err(|m| {
                field_error(format!("metadata.annotations[{SCHEDULER_ANNOTATION}]"), m)
            })?),
        };
        let mut weights = BTreeMap::new();
        if let Some(text) = annotations.get(WEIGHTS_ANNOTATION) {
            let field = format!("metadata.annotations[{WEIGHTS_ANNOTATION}]");
            for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                let parsed = item.split_once('=').and_then(|(a, w)| {
                    Some((
                        a.trim().parse::<IpAddr>().ok()?,
                        w.trim().parse::<u16>().ok()?,
                    ))
                });
                let Some((addr, weight)) = parsed else {
                    return Err(field_error(
                        field,
                        format!("{item:?} is not ADDRESS=WEIGHT (weight 0-65535)"),
                    ));
                };
                weights.insert(addr, weight);
            }
        }
        Ok(ServiceInfo {
            name,
            created: svc
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.as_second()),
            service_type,
            cluster_ips,
            ports,
            external_ips,
            load_balancer_ips,
            source_ranges,
            affinity_timeout,
            external_local,
            internal_local,
            health_check_node_port,
            scheduler,
            weights,
        })
    }
}

impl SliceInfo {
    pub fn from_api(slice: &EndpointSlice) -> Result<Self, FieldError> {
        let name = object_name(&slice.metadata)?;
        let labels: BTreeMap<String, String> = slice.metadata.labels.clone().unwrap_or_default();
        let service_name = labels.get(SERVICE_NAME_LABEL).cloned().ok_or_else(|| {
            field_error(
                format!("metadata.labels[{SERVICE_NAME_LABEL}]"),
                "missing: the slice belongs to no Service",
            )
        })?;
        dns_subdomain(
            &format!("metadata.labels[{SERVICE_NAME_LABEL}]"),
            &service_name,
        )?;
        let address_type = match slice.address_type.as_str() {
            "IPv4" => AddressType::IPv4,
            "IPv6" => AddressType::IPv6,
            "FQDN" => AddressType::Fqdn,
            other => {
                return Err(field_error(
                    "addressType",
                    format!("unknown address type {other:?} (expected IPv4, IPv6 or FQDN)"),
                ))
            }
        };
        let ports = match &slice.ports {
            None => None,
            Some(list) => {
                let mut ports = Vec::new();
                for (i, p) in list.iter().enumerate() {
                    let port = match p.port {
                        None => None,
                        Some(n) => Some(port_number(n, &format!("ports[{i}].port"))?),
                    };
                    let protocol = Protocol::parse(p.protocol.as_deref())
                        .map_err(|m| field_error(format!("ports[{i}].protocol"), m))?;
                    ports.push(SlicePort {
                        name: port_name(&format!("ports[{i}].name"), p.name.as_ref())?,
                        protocol,
                        port,
                    });
                }
                Some(ports)
            }
        };
        let mut endpoints = Vec::with_capacity(slice.endpoints.len());
        if address_type != AddressType::Fqdn {
            for (i, ep) in slice.endpoints.iter().enumerate() {
                // Kubernetes uses only the first address of an endpoint.
                let Some(first) = ep.addresses.first() else {
                    return Err(field_error(format!("endpoints[{i}].addresses"), "empty"));
                };
                let addr = first.parse::<IpAddr>().map_err(|_| {
                    field_error(
                        format!("endpoints[{i}].addresses[0]"),
                        format!("{first:?} is not an IP address"),
                    )
                })?;
                let family_ok = match address_type {
                    AddressType::IPv4 => addr.is_ipv4(),
                    AddressType::IPv6 => addr.is_ipv6(),
                    AddressType::Fqdn => true,
                };
                if !family_ok {
                    return Err(field_error(
                        format!("endpoints[{i}].addresses[0]"),
                        format!("{first} does not match addressType {}", slice.address_type),
                    ));
                }
                let conditions = ep.conditions.clone().unwrap_or_default();
                let ready = conditions.ready.unwrap_or(true);
                endpoints.push(EndpointInfo {
                    addr,
                    ready,
                    // serving: "If nil, consumers should defer to the ready condition."
                    serving: conditions.serving.unwrap_or(ready),
                    terminating: conditions.terminating.unwrap_or(false),
                    node_name: ep.node_name.clone(),
                    zone: ep.zone.clone(),
                    zone_hints: ep
                        .hints
                        .as_ref()
                        .and_then(|h| h.for_zones.as_ref())
                        .into_iter()
                        .flatten()
                        .map(|z| z.name.clone())
                        .collect(),
                    node_hints: ep
                        .hints
                        .as_ref()
                        .and_then(|h| h.for_nodes.as_ref())
                        .into_iter()
                        .flatten()
                        .map(|n| n.name.clone())
                        .collect(),
                });
            }
        }
        Ok(SliceInfo {
            service: ObjectName {
                namespace: name.namespace.clone(),
                name: service_name,
            },
            name,
            address_type,
            ports,
            endpoints,
        })
    }
}

/// A validated form of a Kubernetes object: one conversion, shared by every source.
pub trait Validated: Sized {
    type Api: serde::de::DeserializeOwned;
    const KIND: &'static str;
    fn validate(obj: &Self::Api) -> Result<Self, FieldError>;
    fn meta(obj: &Self::Api) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    fn name(&self) -> &ObjectName;
}

impl Validated for ServiceInfo {
    type Api = Service;
    const KIND: &'static str = "Service";
    fn validate(obj: &Service) -> Result<Self, FieldError> {
        ServiceInfo::from_api(obj)
    }
    fn meta(obj: &Service) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &obj.metadata
    }
    fn name(&self) -> &ObjectName {
        &self.name
    }
}

impl Validated for SliceInfo {
    type Api = EndpointSlice;
    const KIND: &'static str = "EndpointSlice";
    fn validate(obj: &EndpointSlice) -> Result<Self, FieldError> {
        SliceInfo::from_api(obj)
    }
    fn meta(obj: &EndpointSlice) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &obj.metadata
    }
    fn name(&self) -> &ObjectName {
        &self.name
    }
}

/// Label with a node's zone (topology-aware routing uses it).
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// What the proxy needs of its own Node: its addresses (NodePort, masquerade source), its
/// zone (topology hints), its pod ranges (`detectLocalMode: NodeCIDR`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// (type, address): InternalIP, ExternalIP, ...; unparsable addresses are left out.
    pub addresses: Vec<(String, IpAddr)>,
    pub zone: Option<String>,
    /// Why load balancers should stop sending new traffic here (KEP-3836): the Node is being
    /// deleted, or the cluster autoscaler is about to remove it. `/healthz` then answers 503.
    pub ineligible: Option<String>,
    /// `spec.podCIDRs` (else `spec.podCIDR`); unparsable ranges are left out.
    pub pod_cidrs: Vec<Cidr>,
}

/// The taint the cluster autoscaler sets on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

impl NodeInfo {
    pub fn from_api(node: &Node) -> Self {
        let addresses = node
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|a| Some((a.type_.clone(), a.address.parse().ok()?)))
            .collect();
        let tainted = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .into_iter()
            .flatten()
            .any(|t| t.key == TO_BE_DELETED_TAINT);
        let ineligible = if node.metadata.deletion_timestamp.is_some() {
            Some("the Node is being deleted".to_string())
        } else if tainted {
            Some(format!("the Node is tainted {TO_BE_DELETED_TAINT}"))
        } else {
            None
        };
        let spec = node.spec.as_ref();
        let pod_cidrs = spec
            .and_then(|s| s.pod_cidrs.clone())
            .filter(|c| !c.is_empty())
            .or_else(|| spec.and_then(|s| s.pod_cidr.clone()).map(|c| vec![c]))
            .unwrap_or_default()
            .iter()
            .filter_map(|c| c.parse().ok())
            .collect();
        NodeInfo {
            name: node.metadata.name.clone().unwrap_or_default(),
            ineligible,
            pod_cidrs,
            addresses,
            zone: node
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(ZONE_LABEL).cloned()),
        }
    }
}

impl fmt::Display for NodeInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {}", self.name)?;
        for (kind, addr) in &self.addresses {
            write!(f, " {kind}={addr}")?;
        }
        if let Some(z) = &self.zone {
            write!(f, " zone={z}")?;
        }
        for c in &self.pod_cidrs {
            write!(f, " podCIDR={c}")?;
        }
        if let Some(why) = &self.ineligible {
            write!(f, " not eligible for new traffic: {why}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(
        spec: serde_json::Value,
        status: serde_json::Value,
    ) -> Result<ServiceInfo, FieldError> {
        let svc: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop",
                          "annotations": {"service.kubernetes.io/topology-mode": "Auto"}},
            "spec": spec,
            "status": status,
        }))
        .unwrap();
        ServiceInfo::from_api(&svc)
    }

    #[test]
    fn load_balancer_fields_are_read_and_proxy_mode_ingress_is_skipped() {
        let s = parse(
            serde_json::json!({
                "type": "LoadBalancer", "clusterIP": "10.96.0.9",
                "ports": [{"port": 80, "targetPort": 8080, "nodePort": 30080}],
                "externalIPs": ["203.0.113.1"],
                "loadBalancerSourceRanges": ["198.51.100.0/24"],
                "sessionAffinity": "ClientIP",
                "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local",
                "healthCheckNodePort": 32001,
            }),
            serde_json::json!({"loadBalancer": {"ingress": [
                {"ip": "198.51.100.7"},
                {"ip": "198.51.100.8", "ipMode": "Proxy"},
                {"hostname": "lb.example.com"},
            ]}}),
        )
        .unwrap();
        assert_eq!(s.service_type, ServiceType::LoadBalancer);
        assert_eq!(s.ports[0].node_port, Some(30080));
        assert_eq!(
            s.external_ips,
            vec!["203.0.113.1".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(
            s.load_balancer_ips,
            vec!["198.51.100.7".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(s.source_ranges[0].to_string(), "198.51.100.0/24");
        assert_eq!(s.affinity_timeout, Some(DEFAULT_AFFINITY_TIMEOUT));
        assert!(s.external_local && s.internal_local);
        assert_eq!(s.health_check_node_port, Some(32001));
    }

    #[test]
    fn invalid_fields_are_named() {
        let cases = [
            (serde_json::json!({"type": "Balanced"}), "spec.type"),
            (
                serde_json::json!({"loadBalancerSourceRanges": ["10.0.0.0/40"]}),
                "spec.loadBalancerSourceRanges[0]",
            ),
            (
                serde_json::json!({"sessionAffinity": "ClientIP",
                    "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}}}),
                "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
            ),
            (
                serde_json::json!({"externalTrafficPolicy": "Nearby"}),
                "spec.externalTrafficPolicy",
            ),
            (
                serde_json::json!({"externalIPs": ["nope"]}),
                "spec.externalIPs[0]",
            ),
            (
                serde_json::json!({"ports": [{"port": 80, "nodePort": 70000}]}),
                "spec.ports[0].nodePort",
            ),
        ];
        for (spec, field) in cases {
            let err = parse(spec, serde_json::json!({})).unwrap_err();
            assert_eq!(err.field, field);
        }
    }

    #[test]
    fn scheduler_and_weights_come_from_annotations_and_bad_ones_are_named() {
        let svc = |annotations: serde_json::Value| -> Result<ServiceInfo, FieldError> {
            let svc: Service = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "web", "namespace": "shop", "annotations": annotations},
                "spec": {"clusterIP": "10.96.0.9", "ports": [{"port": 80}]},
            }))
            .unwrap();
            ServiceInfo::from_api(&svc)
        };
        let s = svc(serde_json::json!({
            SCHEDULER_ANNOTATION: "wrr",
            WEIGHTS_ANNOTATION: "10.0.0.1=3, 10.0.0.2=0",
        }))
        .unwrap();
        assert_eq!(s.scheduler, Some(Scheduler::Wrr));
        assert_eq!(s.weights[&"10.0.0.1".parse::<IpAddr>().unwrap()], 3);
        assert_eq!(s.weights[&"10.0.0.2".parse::<IpAddr>().unwrap()], 0);
        for name in [
            "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh", "random",
        ] {
            let s = svc(serde_json::json!({ SCHEDULER_ANNOTATION: name })).unwrap();
            assert_eq!(s.scheduler.unwrap().name(), name);
        }
        let e = svc(serde_json::json!({ SCHEDULER_ANNOTATION: "fastest" })).unwrap_err();
        assert_eq!(
            e.field,
            format!("metadata.annotations[{SCHEDULER_ANNOTATION}]")
        );
        let e = svc(serde_json::json!({ WEIGHTS_ANNOTATION: "10.0.0.1:3" })).unwrap_err();
        assert_eq!(
            e.field,
            format!("metadata.annotations[{WEIGHTS_ANNOTATION}]")
        );
    }

    #[test]
    fn cidrs_contain_their_addresses_only() {
        let c: Cidr = "10.1.0.0/16".parse().unwrap();
        assert!(c.contains("10.1.255.3".parse().unwrap()));
        assert!(!c.contains("10.2.0.1".parse().unwrap()));
        assert!(!c.contains("::1".parse().unwrap()));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("8.8.8.8".parse().unwrap()));
        let host: Cidr = "fd00::1/128".parse().unwrap();
        assert!(host.contains("fd00::1".parse().unwrap()));
    }
}
