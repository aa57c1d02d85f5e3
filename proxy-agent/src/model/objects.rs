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
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceInfo {
    pub name: ObjectName,
    /// Cluster IPs, primary first; empty for headless and ExternalName services, which the
    /// proxy does not serve.
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePortSpec>,
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
    Ok(ObjectName {
        namespace: meta.namespace.clone().unwrap_or_else(|| "default".into()),
        name,
    })
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
                    Err(_) => TargetPort::Name(s.clone()),
                },
            };
            ports.push(ServicePortSpec {
                name: p.name.clone().unwrap_or_default(),
                protocol,
                port,
                target_port,
            });
        }

        let external_name = spec.type_.as_deref() == Some("ExternalName");
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
        Ok(ServiceInfo {
            name,
            cluster_ips,
            ports,
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
                        name: p.name.clone().unwrap_or_default(),
                        protocol,
                        port,
                    });
                }
                Some(ports)
            }
        };
        let mut endpoints = Vec::new();
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

/// What the proxy needs of its own Node: its addresses (NodePort, later) and its zone
/// (topology hints, later).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// (type, address): InternalIP, ExternalIP, ...; unparsable addresses are left out.
    pub addresses: Vec<(String, IpAddr)>,
    pub zone: Option<String>,
}

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
        NodeInfo {
            name: node.metadata.name.clone().unwrap_or_default(),
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
        Ok(())
    }
}
