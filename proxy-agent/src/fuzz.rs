//! Entry points for the fuzzers: each takes arbitrary bytes, as a tenant or the kernel could
//! hand them to the agent, and must never panic. Besides "no panic", each checks what must
//! hold of any input it accepts (a round trip, a bound, a deterministic result), so a
//! fuzzer finds wrong answers as well as crashes.
//!
//! The libFuzzer targets in `tests/fuzz` call these one to one (`cargo xtask fuzz`); the
//! corpus and every input that once failed run through them again in
//! `tests/tests/fuzz_corpus.rs`, an ordinary test, so a fixed crash stays fixed.
//!
//! | target | what it feeds | checks |
//! |---|---|---|
//! | `go_duration` | a config duration (`30s`, `1h2m`, ...) | no panic; a parsed value is within Go's range |
//! | `config_file` | the `--config` file (KubeProxyConfiguration, ProxyAgentConfiguration) | no panic |
//! | `manifests` | a `--manifests` file (YAML documents) | no panic; the model built from it is deterministic and diffs to nothing against itself |
//! | `api_objects` | API-server JSON: a Service, EndpointSlice, Node or a List of them | as `manifests` |
//! | `annotations` | a Service's scheduler, weights and topology annotations | no panic |
//! | `netlink` | a netlink reply: messages, acks, attributes, IPVS virtual and real servers, ctnetlink entries | no panic; attributes stay inside the buffer; an IPVS server decoded, encoded and decoded again is the same |
//! | `rule_listings` | `iptables-save` output and nft scripts (the netlink encoder) | no panic |

use std::net::IpAddr;

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

use crate::{
    config::{self, GoDuration},
    kernel::{conntrack::flows, nlattr},
    model::{objects::NodeInfo, DesiredState, NodeContext, ObjectStore},
    proxier::{
        iptables::cleanup as iptables_cleanup,
        ipvs::netlink::{self as ipvs, decode_real_server, decode_virtual_server},
        nftables::netlink,
    },
    source::{api, manifests, Snapshot},
};

/// A fuzz target's entry point: arbitrary bytes in, a panic for a finding.
pub type EntryPoint = fn(&[u8]);

/// Every target: its name, as `tests/fuzz` and the corpus directories spell it, and its
/// entry point.
pub const TARGETS: &[(&str, EntryPoint)] = &[
    ("go_duration", go_duration),
    ("config_file", config_file),
    ("manifests", manifests),
    ("api_objects", api_objects),
    ("annotations", annotations),
    ("netlink", netlink),
    ("rule_listings", rule_listings),
];

/// Runs target `name` on `data`; false for an unknown name.
pub fn run(name: &str, data: &[u8]) -> bool {
    match TARGETS.iter().find(|(target, _)| *target == name) {
        Some((_, entry)) => {
            entry(data);
            true
        }
        None => false,
    }
}

pub fn go_duration(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(GoDuration(d)) = GoDuration::parse(text) {
        assert!(
            d.as_nanos() <= i64::MAX as u128,
            "{text:?} parsed beyond Go's range: {d:?}"
        );
    }
}

pub fn config_file(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = config::parse(text);
    }
}

pub fn manifests(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut set = Snapshot::default();
    manifests::parse_into(text, "fuzz.yaml", &mut set);
    check_model(&set.store, &set.nodes);
}

pub fn api_objects(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let items = match value.get("items").and_then(|i| i.as_array()) {
        Some(items) => items.clone(),
        None => vec![value],
    };
    let mut store = ObjectStore::default();
    let mut nodes = Vec::new();
    for item in items {
        match item.get("kind").and_then(|k| k.as_str()) {
            Some("Service") => {
                if let Ok(svc) = serde_json::from_value::<Service>(item) {
                    if let Some((name, kept)) = api::convert_service(&svc).kept() {
                        store.services.insert(name, kept);
                    }
                }
            }
            Some("EndpointSlice") => {
                if let Ok(slice) = serde_json::from_value::<EndpointSlice>(item) {
                    if let Some((name, kept)) = api::convert_slice(&slice).kept() {
                        store.slices.insert(name, kept);
                    }
                }
            }
            Some("Node") => {
                if let Ok(node) = serde_json::from_value::<Node>(item) {
                    nodes.push(NodeInfo::from_api(&node));
                }
            }
            _ => {}
        }
    }
    check_model(&store, &nodes);
}

/// The model from `store` as the node named like the first of `nodes` (if any) sees it:
/// built twice alike, and no change between a state and itself.
fn check_model(store: &ObjectStore, nodes: &[NodeInfo]) {
    let node = nodes.first();
    let local: [IpAddr; 2] = [[10, 0, 0, 1].into(), [0xfd00, 0, 0, 0, 0, 0, 0, 1].into()];
    let context = NodeContext::new(
        node.map_or("fuzz-node", |n| n.name.as_str()),
        node,
        &[],
        &local,
    );
    let (desired, _) = DesiredState::build(store, &context);
    let (again, _) = DesiredState::build(store, &context);
    assert_eq!(desired, again, "the model is not deterministic");
    assert!(crate::model::diff(&desired, &desired).is_empty());
    let _ = crate::model::diff(&DesiredState::default(), &desired);
}

/// The first byte splits the rest into the scheduler annotation, the weights annotation
/// and the topology mode, on a Service with one port and a slice of two endpoints.
pub fn annotations(data: &[u8]) {
    let Some((&cut, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let mut parts = text.splitn(3, '\u{0}');
    let (scheduler, weights, topology) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let mut annotations = serde_json::Map::new();
    if cut & 1 != 0 {
        annotations.insert(
            crate::model::objects::SCHEDULER_ANNOTATION.into(),
            scheduler.into(),
        );
    }
    if cut & 2 != 0 {
        annotations.insert(
            crate::model::objects::WEIGHTS_ANNOTATION.into(),
            weights.into(),
        );
    }
    if cut & 4 != 0 {
        annotations.insert(
            crate::model::objects::TOPOLOGY_MODE_ANNOTATION.into(),
            topology.into(),
        );
    }
    let service = serde_json::json!({
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop", "annotations": annotations},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    });
    let slice = serde_json::json!({
        "kind": "EndpointSlice",
        "metadata": {"name": "web-1", "namespace": "shop",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080}],
        "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": true}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": true}},
        ],
    });
    let list = serde_json::json!({"items": [service, slice]});
    api_objects(list.to_string().as_bytes());
}

pub fn netlink(data: &[u8]) {
    let mut total = 0usize;
    for (_, payload) in nlattr::attrs(data) {
        total += payload.len();
        // Nested attributes are read the same way.
        for (_, inner) in nlattr::attrs(payload) {
            assert!(inner.len() <= payload.len());
        }
    }
    assert!(total <= data.len(), "attributes read past the buffer");
    let acks = nlattr::acks(data);
    assert!(acks.len() <= data.len() / 16);
    for (_, _, body) in nlattr::messages(data) {
        assert!(body.len() <= data.len());
        let _ = flows::decode_entry(body);
    }
    let _ = flows::decode_entry(data);
    if let Some(vs) = decode_virtual_server(data) {
        let mut encoded = Vec::new();
        ipvs::encode_virtual_server(&mut encoded, &vs);
        assert_eq!(
            decode_virtual_server(&encoded).as_ref(),
            Some(&vs),
            "an IPVS virtual server changed through encode and decode"
        );
    }
    for family in [libc::AF_INET as u16, libc::AF_INET6 as u16] {
        if let Some(rs) = decode_real_server(data, family) {
            let mut encoded = Vec::new();
            ipvs::encode_real_server(&mut encoded, &rs);
            let again = decode_real_server(&encoded, family).map(|r| (r.addr, r.weight));
            assert_eq!(
                again,
                Some((rs.addr, rs.weight)),
                "an IPVS real server changed through encode and decode"
            );
        }
    }
}

pub fn rule_listings(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let _ = netlink::encode_script(&text);
    let _ = iptables_cleanup::parse(&text);
}
