//! The incremental model against a full build, after random event sequences.

use std::{net::IpAddr, sync::Arc};

use super::*;
use crate::model::{
    AddressType, EndpointInfo, Origin, Protocol, ServiceInfo, ServicePortSpec, ServiceType,
    SliceInfo, SlicePort, TargetPort,
};

fn name(n: String) -> ObjectName {
    ObjectName {
        namespace: "default".into(),
        name: n,
    }
}

fn addr(pool: &str, rng: &mut fastrand::Rng, n: u8) -> IpAddr {
    format!("{pool}{}", rng.u8(1..=n)).parse().unwrap()
}

/// A Service from small pools of addresses and ports, so that claims collide often: cluster
/// IPs, external and load-balancer IPs, node ports, creation times shared by several.
fn random_service(rng: &mut fastrand::Rng, n: usize) -> ServiceInfo {
    let service_type = match rng.u8(0..3) {
        0 => ServiceType::ClusterIp,
        1 => ServiceType::NodePort,
        _ => ServiceType::LoadBalancer,
    };
    let ports = (0..rng.usize(1..=2))
        .map(|i| ServicePortSpec {
            name: if i == 0 { "" } else { "b" }.into(),
            protocol: Protocol::Tcp,
            port: 80 + rng.u16(0..2),
            target_port: if rng.bool() {
                TargetPort::Number(8080)
            } else {
                TargetPort::Name("web".into())
            },
            node_port: rng.bool().then(|| 30000 + rng.u16(0..2)),
        })
        .collect();
    ServiceInfo {
        name: name(format!("s{n}")),
        created: rng.bool().then(|| rng.i64(0..3)),
        service_type,
        cluster_ips: vec![addr("10.96.0.", rng, 6)],
        ports,
        external_ips: (0..rng.usize(0..=2))
            .map(|_| addr("192.0.2.", rng, 3))
            .collect(),
        load_balancer_ips: (0..rng.usize(0..=1))
            .map(|_| addr("192.0.2.", rng, 3))
            .collect(),
        source_ranges: vec![],
        affinity_timeout: rng.bool().then_some(60),
        external_local: rng.bool(),
        internal_local: rng.u8(0..4) == 0,
        health_check_node_port: rng.bool().then_some(32000),
        scheduler: None,
        weights: Default::default(),
    }
}

fn random_slice(rng: &mut fastrand::Rng, n: usize, services: usize) -> SliceInfo {
    SliceInfo {
        name: name(format!("e{n}")),
        service: name(format!("s{}", rng.usize(0..services))),
        address_type: AddressType::IPv4,
        ports: rng.bool().then(|| {
            vec![SlicePort {
                name: "".into(),
                protocol: Protocol::Tcp,
                port: Some(8080 + rng.u16(0..2)),
            }]
        }),
        endpoints: (0..rng.usize(0..=3))
            .map(|_| EndpointInfo {
                addr: addr("10.0.0.", rng, 8),
                ready: rng.u8(0..4) != 0,
                serving: rng.bool(),
                terminating: rng.u8(0..4) == 0,
                node_name: rng.bool().then(|| format!("node-{}", rng.u8(0..2))),
                zone: None,
                zone_hints: vec![],
                node_hints: vec![],
            })
            .collect(),
    }
}

fn node(rng: &mut fastrand::Rng) -> NodeContext {
    NodeContext {
        name: "node-0".into(),
        node_port_addresses: vec![addr("172.18.0.", rng, 2)],
        masquerade_all: rng.bool(),
        ..NodeContext::default()
    }
}

#[test]
fn an_event_gives_what_a_full_build_gives() {
    const SERVICES: usize = 8;
    const SLICES: usize = 10;
    for seed in 0..300 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let origins: [Origin; 2] = ["a".into(), "b".into()];
        let mut context = node(&mut rng);
        let mut store = ObjectStore::default();
        let mut model = IncrementalModel::default();
        let mut full = DesiredState::default();
        assert!(model.rebuild(&store, &context).is_empty());
        model.take_problems_changed();
        let mut last_problems = Vec::new();
        for step in 0..60 {
            let before = store.clone();
            let mut node_changed = false;
            let origin = &origins[rng.usize(0..2)];
            match rng.u8(0..11) {
                0..=3 => {
                    let n = rng.usize(0..SERVICES);
                    let s = random_service(&mut rng, n);
                    store
                        .services
                        .insert(s.name.clone(), (Arc::new(s), origin.clone()));
                }
                4 => {
                    let n = name(format!("s{}", rng.usize(0..SERVICES)));
                    store.services.remove(&n);
                }
                5..=7 => {
                    let n = rng.usize(0..SLICES);
                    let s = random_slice(&mut rng, n, SERVICES);
                    store
                        .slices
                        .insert(s.name.clone(), (Arc::new(s), origin.clone()));
                }
                8 => {
                    let n = name(format!("e{}", rng.usize(0..SLICES)));
                    store.slices.remove(&n);
                }
                9 => {
                    context = node(&mut rng);
                    node_changed = true;
                }
                // The same object from another place (a manifest document that moved).
                _ => {
                    let n = rng.usize(0..SERVICES.max(SLICES));
                    if let Some(s) = store.services.get_mut(&name(format!("s{n}"))) {
                        s.1 = origin.clone();
                    }
                    if let Some(s) = store.slices.get_mut(&name(format!("e{n}"))) {
                        s.1 = origin.clone();
                    }
                }
            }
            let (want, want_problems) = DesiredState::build(&store, &context);
            let changes = if node_changed {
                model.rebuild(&store, &context)
            } else {
                model.apply(&store, &context, &Touched::between(&before, &store))
            };
            let at = format!("seed {seed}, step {step}");
            assert_eq!(model.desired(), &want, "{at}");
            let problems_changed = model.take_problems_changed();
            assert_eq!(
                problems_changed,
                node_changed || model.problems() != last_problems,
                "{at}: problems_changed"
            );
            assert_eq!(model.problems(), want_problems, "{at}");
            last_problems = want_problems.clone();
            assert_eq!(changes, diff(&full, &want), "{at}");
            full = want;
        }
    }
}

#[test]
fn an_endpoint_change_recomputes_its_service_alone() {
    let origin: Origin = "test".into();
    let mut rng = fastrand::Rng::with_seed(7);
    let context = NodeContext::default();
    let mut store = ObjectStore::default();
    for n in 0..50 {
        let mut s = random_service(&mut rng, n);
        // Distinct frontends: no Service shares one with another.
        s.cluster_ips = vec![format!("10.96.1.{n}").parse().unwrap()];
        s.external_ips.clear();
        s.load_balancer_ips.clear();
        s.service_type = ServiceType::ClusterIp;
        s.internal_local = false;
        s.ports = vec![ServicePortSpec {
            name: "".into(),
            protocol: Protocol::Tcp,
            port: 80,
            target_port: TargetPort::Number(8080),
            node_port: None,
        }];
        store
            .services
            .insert(s.name.clone(), (Arc::new(s), origin.clone()));
    }
    let mut model = IncrementalModel::default();
    model.rebuild(&store, &context);
    let target = name("s3".into());
    let mut slice = random_slice(&mut rng, 0, 1);
    slice.service = target.clone();
    slice.ports = None;
    slice.endpoints = vec![EndpointInfo {
        addr: "10.0.0.1".parse().unwrap(),
        ready: true,
        serving: true,
        terminating: false,
        node_name: None,
        zone: None,
        zone_hints: vec![],
        node_hints: vec![],
    }];
    store.slices.insert(
        slice.name.clone(),
        (Arc::new(slice.clone()), origin.clone()),
    );
    let touched = Touched {
        slices: [slice.name.clone()].into(),
        ..Touched::default()
    };
    let seeds: BTreeSet<ObjectName> = [target.clone()].into();
    assert_eq!(model.closure(&store, &context, seeds.clone()), seeds);
    let changes = model.apply(&store, &context, &touched);
    assert!(!changes.is_empty());
    assert!(
        changes.iter().all(|c| c.name().service == target),
        "{changes:?}"
    );
}

#[test]
fn services_sharing_a_frontend_are_recomputed_together() {
    let origin: Origin = "test".into();
    let mut rng = fastrand::Rng::with_seed(9);
    let context = NodeContext::default();
    let mut store = ObjectStore::default();
    for n in 0..3 {
        let mut s = random_service(&mut rng, n);
        s.cluster_ips = vec![format!("10.96.2.{n}").parse().unwrap()];
        s.external_ips = if n < 2 {
            vec!["192.0.2.9".parse().unwrap()]
        } else {
            vec![]
        };
        s.load_balancer_ips.clear();
        store
            .services
            .insert(s.name.clone(), (Arc::new(s), origin.clone()));
    }
    let mut model = IncrementalModel::default();
    model.rebuild(&store, &context);
    let seeds: BTreeSet<ObjectName> = [name("s0".into())].into();
    let want: BTreeSet<ObjectName> = [name("s0".into()), name("s1".into())].into();
    assert_eq!(model.closure(&store, &context, seeds), want);
}
