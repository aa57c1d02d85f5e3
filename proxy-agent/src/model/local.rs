//! Which clients are this node's pods: kube-proxy's `detectLocalMode`.
//!
//! Two behaviours hang on it, in every mode: cluster-IP traffic from outside the pods is
//! masqueraded (so replies come back through this node), and the `externalTrafficPolicy:
//! Local` short-circuit sends the node's pods to every endpoint. The mode is configuration;
//! [`DetectLocal::resolve`] turns it into a [`LocalTraffic`] with this node's Node object
//! (`NodeCIDR` reads its `spec.podCIDRs`), decided once here for every proxier.
//!
//! | mode | a client is a pod when | per family |
//! |---|---|---|
//! | `ClusterCIDR` (default) | its source is in `clusterCIDR` | the first range of each family |
//! | `NodeCIDR` | its source is in the Node's `spec.podCIDRs` | the first of each family |
//! | `BridgeInterface` | it arrived on `detectLocal.bridgeInterface` | both |
//! | `InterfaceNamePrefix` | it arrived on an interface named `prefix*` | both |
//!
//! Without a range for a family (no `clusterCIDR`, a Node without `podCIDRs` yet) nothing
//! of that family counts as a pod, as kube-proxy's no-op detector: cluster-IP traffic is
//! masqueraded only under `masqueradeAll`, and pods take the external policy.

use std::fmt;

use super::{objects::NodeInfo, Cidr, IpFamily};

/// Linux's interface-name limit (IFNAMSIZ less the terminating NUL).
pub const INTERFACE_NAME_MAX: usize = 15;

/// `detectLocalMode` with its parameter, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DetectLocal {
    /// `clusterCIDR`'s ranges (at most one per family).
    ClusterCidr(Vec<Cidr>),
    NodeCidr,
    BridgeInterface(String),
    InterfaceNamePrefix(String),
}

impl Default for DetectLocal {
    fn default() -> Self {
        DetectLocal::ClusterCidr(Vec::new())
    }
}

impl DetectLocal {
    /// The mode's name, as in the configuration.
    pub fn mode(&self) -> &'static str {
        match self {
            DetectLocal::ClusterCidr(_) => "ClusterCIDR",
            DetectLocal::NodeCidr => "NodeCIDR",
            DetectLocal::BridgeInterface(_) => "BridgeInterface",
            DetectLocal::InterfaceNamePrefix(_) => "InterfaceNamePrefix",
        }
    }

    /// This node's detector; `node` is its Node object, if known.
    pub fn resolve(&self, node: Option<&NodeInfo>) -> LocalTraffic {
        let by_cidr = |cidrs: &[Cidr]| {
            LocalTraffic(FAMILIES.map(|f| {
                cidrs
                    .iter()
                    .find(|c| IpFamily::of(c.addr) == f)
                    .map(|c| LocalMatch::Cidr(*c))
            }))
        };
        match self {
            DetectLocal::ClusterCidr(cidrs) => by_cidr(cidrs),
            DetectLocal::NodeCidr => by_cidr(node.map_or(&[][..], |n| &n.pod_cidrs)),
            DetectLocal::BridgeInterface(name) => {
                LocalTraffic([0, 1].map(|_| Some(LocalMatch::Interface(name.clone()))))
            }
            DetectLocal::InterfaceNamePrefix(prefix) => {
                LocalTraffic([0, 1].map(|_| Some(LocalMatch::InterfacePrefix(prefix.clone()))))
            }
        }
    }
}

/// Checks an interface name or prefix from the configuration: `what` names the field.
pub fn check_interface_name(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("{what} is required by its detectLocalMode"));
    }
    if name.len() > INTERFACE_NAME_MAX {
        return Err(format!(
            "{what}: {name:?} is longer than an interface name ({INTERFACE_NAME_MAX} bytes)"
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| *c == '/' || *c == '"' || *c == '*' || *c == '+' || !c.is_ascii_graphic())
    {
        return Err(format!("{what}: {name:?} holds {c:?}, not allowed here"));
    }
    Ok(())
}

const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

/// How one family's pods are told apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalMatch {
    /// The source address is in this range.
    Cidr(Cidr),
    /// The packet arrived on this interface.
    Interface(String),
    /// The packet arrived on an interface whose name starts with this.
    InterfacePrefix(String),
}

impl fmt::Display for LocalMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LocalMatch::Cidr(c) => write!(f, "source in {c}"),
            LocalMatch::Interface(i) => write!(f, "arrived on {i}"),
            LocalMatch::InterfacePrefix(p) => write!(f, "arrived on {p}*"),
        }
    }
}

/// The node's detector, per family (IPv4, IPv6).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalTraffic(pub [Option<LocalMatch>; 2]);

impl LocalTraffic {
    /// Pods told by their source range.
    pub fn by_cidrs(cidrs: &[Cidr]) -> Self {
        DetectLocal::ClusterCidr(cidrs.to_vec()).resolve(None)
    }

    pub fn of(&self, family: IpFamily) -> Option<&LocalMatch> {
        self.0[match family {
            IpFamily::V4 => 0,
            IpFamily::V6 => 1,
        }]
        .as_ref()
    }

    /// Whether some family tells pods by interface (datapaths that see only addresses
    /// cannot follow it).
    pub fn by_interface(&self) -> bool {
        self.0
            .iter()
            .flatten()
            .any(|m| !matches!(m, LocalMatch::Cidr(_)))
    }

    /// The source ranges, for datapaths that see only addresses.
    pub fn cidrs(&self) -> Vec<Cidr> {
        self.0
            .iter()
            .filter_map(|m| match m {
                Some(LocalMatch::Cidr(c)) => Some(*c),
                _ => None,
            })
            .collect()
    }
}

impl fmt::Display for LocalTraffic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            [None, None] => write!(f, "no client counts as a pod"),
            [Some(a), Some(b)] if a == b => write!(f, "pods: {a}"),
            [a, b] => {
                let show =
                    |m: &Option<LocalMatch>| m.as_ref().map_or("none".into(), |m| m.to_string());
                write!(f, "IPv4 pods: {}; IPv6 pods: {}", show(a), show(b))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(cidrs: &[&str]) -> NodeInfo {
        NodeInfo {
            name: "n".into(),
            pod_cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn node_cidr_follows_the_node_objects_pod_ranges_per_family() {
        let d = DetectLocal::NodeCidr;
        assert_eq!(d.resolve(None), LocalTraffic::default());
        let l = d.resolve(Some(&node(&[
            "10.244.1.0/24",
            "fd00:1::/64",
            "10.9.0.0/24",
        ])));
        assert_eq!(
            l.of(IpFamily::V4),
            Some(&LocalMatch::Cidr("10.244.1.0/24".parse().unwrap()))
        );
        assert_eq!(
            l.of(IpFamily::V6),
            Some(&LocalMatch::Cidr("fd00:1::/64".parse().unwrap()))
        );
        assert_eq!(l.cidrs().len(), 2);
    }

    #[test]
    fn interface_modes_apply_to_both_families_and_have_no_ranges() {
        let l = DetectLocal::InterfaceNamePrefix("veth".into()).resolve(None);
        assert_eq!(
            l.of(IpFamily::V6),
            Some(&LocalMatch::InterfacePrefix("veth".into()))
        );
        assert!(l.cidrs().is_empty());
        assert_eq!(l.to_string(), "pods: arrived on veth*");
    }

    #[test]
    fn interface_names_are_checked_for_length_and_characters() {
        assert!(check_interface_name("x", "cbr0").is_ok());
        assert!(check_interface_name("x", "")
            .unwrap_err()
            .contains("required"));
        assert!(check_interface_name("x", "a-very-long-name0")
            .unwrap_err()
            .contains("15 bytes"));
        assert!(check_interface_name("x", "veth\"; drop").is_err());
        assert!(check_interface_name("x", "veth+").is_err());
    }
}
