use std::{collections::BTreeSet, net::SocketAddr};

use super::{ipset::MemorySets, *};
use crate::{
    kernel::local_routes::MemoryLocalRoutes,
    model::{diff, Protocol, Scheduler},
    proxier::ipvs::netlink::MemoryIpvs,
    proxier::{
        iptables::tables::MemoryTables,
        test_states::{desired, node_port, state},
        RecordedFlows,
    },
};

struct Node {
    proxier: IpvsProxier<MemoryTables, MemorySets>,
    ipvs: MemoryIpvs,
    addresses: MemoryLocalRoutes,
    sets: MemorySets,
}

fn node(options: IpvsOptions) -> Node {
    let (ipvs, addresses, sets) = (
        MemoryIpvs::default(),
        MemoryLocalRoutes::default(),
        MemorySets::default(),
    );
    let proxier = IpvsProxier::new(
        IpvsKernel {
            ipvs: Box::new(ipvs.clone()),
            addresses: Box::new(addresses.clone()),
            tables: MemoryTables::default(),
            sets: sets.clone(),
            flows: Box::new(RecordedFlows::default()),
        },
        14,
        &LocalTraffic::by_cidrs(&["10.244.0.0/16".parse().unwrap()]),
        options,
    );
    Node {
        proxier,
        ipvs,
        addresses,
        sets,
    }
}

fn tcp(addr: &str, port: u16) -> Frontend {
    Frontend {
        addr: addr.parse().unwrap(),
        port,
        protocol: Protocol::Tcp,
    }
}

/// (scheduler, persistence, real servers with weights) of one virtual server.
type Server = (String, Option<u32>, Vec<(SocketAddr, u32)>);

impl Node {
    fn server(&self, f: Frontend) -> Option<Server> {
        let table = self.ipvs.0.lock().unwrap();
        let (vs, reals) = table.get(&f)?;
        let mut reals: Vec<(SocketAddr, u32)> = reals.iter().map(|r| (r.addr, r.weight)).collect();
        reals.sort();
        Some((vs.scheduler.clone(), vs.persistence, reals))
    }

    fn addresses(&self) -> BTreeSet<IpAddr> {
        self.addresses.0.lock().unwrap().clone()
    }
}

fn ep(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn each_frontend_is_a_virtual_server_with_its_endpoints_and_the_service_addresses_are_local() {
    let mut n = node(IpvsOptions::default());
    let mut web = state("web", "10.96.0.10", &["10.244.1.2:8080", "10.244.2.2:8080"]);
    web.external.push(node_port(&web, "192.168.1.10", true));
    web.remote.insert(ep("10.244.2.2:8080"));
    n.proxier.sync_full(&desired(&[web])).unwrap();

    let both = vec![(ep("10.244.1.2:8080"), 1), (ep("10.244.2.2:8080"), 1)];
    // IPVS has no random scheduler: kube-proxy's ipvs default, round robin.
    assert_eq!(
        n.server(tcp("10.96.0.10", 80)),
        Some(("rr".into(), None, both.clone()))
    );
    assert_eq!(
        n.server(tcp("192.168.1.10", 30080)),
        Some(("rr".into(), None, both))
    );
    // kube-ipvs0 holds the cluster IP, not the node's own address.
    assert_eq!(
        n.addresses(),
        BTreeSet::from(["10.96.0.10".parse().unwrap()])
    );
    assert_eq!(
        n.sets.entries("KUBE-CLUSTER-IP").unwrap(),
        BTreeSet::from(["10.96.0.10,tcp:80".to_string()])
    );
    assert_eq!(
        n.sets.entries("KUBE-EXTERNAL-MASQ").unwrap(),
        BTreeSet::from(["192.168.1.10,tcp:30080".to_string()])
    );
    // Only the endpoint on the other node is masqueraded for external traffic.
    assert_eq!(
        n.sets.entries("KUBE-REMOTE-ENDPOINT").unwrap(),
        BTreeSet::from(["10.244.2.2,tcp:8080".to_string()])
    );
    assert!(n
        .sets
        .entries("KUBE-LOOP-BACK")
        .unwrap()
        .contains("10.244.1.2,tcp:8080,10.244.1.2"));
    let nat = n
        .proxier
        .tables()
        .chain(IpFamily::V4, "nat", "KUBE-SERVICES")
        .unwrap();
    assert!(
        nat.iter().any(|r| r.contains("! -s 10.244.0.0/16")
            && r.contains("--match-set KUBE-CLUSTER-IP dst,dst")
            && r.ends_with("-j KUBE-MARK-MASQ")),
        "{nat:#?}"
    );
    let post = n
        .proxier
        .tables()
        .chain(IpFamily::V4, "nat", "KUBE-POSTROUTING")
        .unwrap();
    assert!(
        post.iter()
            .any(|r| r.contains("--match-set KUBE-LOOP-BACK dst,dst,src")),
        "{post:#?}"
    );
    assert_eq!(n.proxier.programmed(), (1, 4));
}

#[test]
fn changes_touch_only_their_virtual_servers_and_draining_endpoints_keep_weight_zero() {
    let mut n = node(IpvsOptions::default());
    let web = state("web", "10.96.0.10", &["10.244.1.2:8080", "10.244.1.3:8080"]);
    let api = state("api", "10.96.0.11", &["10.244.1.4:8080"]);
    let old = desired(&[web.clone(), api.clone()]);
    n.proxier.sync_full(&old).unwrap();
    // Someone changes the api's virtual server behind our back: a partial sync that does
    // not concern it leaves it be (only full syncs compare with the kernel).
    n.ipvs
        .update_real_server(
            &tcp("10.96.0.11", 80),
            &RealServer {
                addr: ep("10.244.1.4:8080"),
                weight: 7,
                connections: (0, 0),
            },
        )
        .unwrap();

    let mut web2 = web.clone();
    web2.backends = vec![ep("10.244.1.3:8080"), ep("10.244.1.5:8080")];
    web2.draining = vec![ep("10.244.1.2:8080")];
    web2.scheduler = Scheduler::Wlc;
    web2.affinity_timeout = Some(60);
    let new = desired(&[web2.clone(), api.clone()]);
    let report = n.proxier.sync(&new, &diff(&old, &new)).unwrap();
    assert!(!report.full);
    assert_eq!(report.services_written, 1);
    assert_eq!(
        n.server(tcp("10.96.0.10", 80)),
        Some((
            "wlc".into(),
            Some(60),
            vec![
                (ep("10.244.1.2:8080"), 0),
                (ep("10.244.1.3:8080"), 1),
                (ep("10.244.1.5:8080"), 1)
            ]
        ))
    );
    assert_eq!(
        n.server(tcp("10.96.0.11", 80)).unwrap().2,
        vec![(ep("10.244.1.4:8080"), 7)]
    );
    // The periodic full sync corrects it.
    n.proxier.sync_full(&new).unwrap();
    assert_eq!(
        n.server(tcp("10.96.0.11", 80)).unwrap().2,
        vec![(ep("10.244.1.4:8080"), 1)]
    );

    // The api goes: its virtual server, address and set entries with it.
    let last = desired(&[web2]);
    n.proxier.sync(&last, &diff(&new, &last)).unwrap();
    assert_eq!(n.server(tcp("10.96.0.11", 80)), None);
    assert!(!n
        .addresses()
        .contains(&"10.96.0.11".parse::<IpAddr>().unwrap()));
    assert!(!n
        .sets
        .entries("KUBE-CLUSTER-IP")
        .unwrap()
        .contains("10.96.0.11,tcp:80"));
}

#[test]
fn a_service_without_endpoints_keeps_its_address_and_is_refused_by_a_filter_rule() {
    let mut n = node(IpvsOptions::default());
    n.proxier
        .sync_full(&desired(&[state("empty", "10.96.0.12", &[])]))
        .unwrap();
    assert_eq!(n.server(tcp("10.96.0.12", 80)), None);
    assert!(n
        .addresses()
        .contains(&"10.96.0.12".parse::<IpAddr>().unwrap()));
    let filter = n
        .proxier
        .tables()
        .chain(IpFamily::V4, "filter", "KUBE-SERVICES")
        .unwrap();
    assert!(
        filter
            .iter()
            .any(|r| r.contains("-d 10.96.0.12/32")
                && r.ends_with("-j REJECT --reject-with tcp-reset")),
        "{filter:#?}"
    );
}

#[test]
fn full_syncs_remove_unknown_virtual_servers_but_not_those_in_exclude_cidrs() {
    let mut n = node(IpvsOptions {
        exclude_cidrs: vec!["192.0.2.0/24".parse().unwrap()],
        timeouts: IpvsTimeouts {
            tcp: 900,
            tcp_fin: 120,
            udp: 300,
        },
    });
    for addr in ["10.96.0.99", "192.0.2.7"] {
        n.ipvs
            .add_virtual_server(&VirtualServer {
                frontend: tcp(addr, 80),
                scheduler: "rr".into(),
                persistence: None,
            })
            .unwrap();
    }
    n.addresses.add("10.96.0.99".parse().unwrap()).unwrap();
    n.proxier
        .sync_full(&desired(&[state(
            "web",
            "10.96.0.10",
            &["10.244.1.2:8080"],
        )]))
        .unwrap();
    assert_eq!(
        n.server(tcp("10.96.0.99", 80)),
        None,
        "a leftover is removed"
    );
    assert!(
        n.server(tcp("192.0.2.7", 80)).is_some(),
        "excludeCIDRs: kept"
    );
    assert_eq!(
        n.addresses(),
        BTreeSet::from(["10.96.0.10".parse().unwrap()])
    );
    assert_eq!(
        *n.ipvs.1.lock().unwrap(),
        IpvsTimeouts {
            tcp: 900,
            tcp_fin: 120,
            udp: 300
        }
    );
}

#[test]
fn a_failed_write_makes_the_next_sync_a_full_one() {
    let mut n = node(IpvsOptions::default());
    let web = state("web", "10.96.0.10", &["10.244.1.2:8080"]);
    let old = desired(std::slice::from_ref(&web));
    n.proxier.sync_full(&old).unwrap();
    // The kernel loses the virtual server; a partial sync updating it fails...
    n.ipvs
        .delete_virtual_server(&tcp("10.96.0.10", 80))
        .unwrap();
    let mut web2 = web;
    web2.backends.push(ep("10.244.1.3:8080"));
    let new = desired(&[web2]);
    assert!(n.proxier.sync(&new, &diff(&old, &new)).is_err());
    // ... and the next one compares with the kernel and recreates it.
    let report = n.proxier.sync(&new, &[]).unwrap();
    assert!(report.full);
    assert_eq!(n.server(tcp("10.96.0.10", 80)).unwrap().2.len(), 2);
}

#[test]
fn the_cluster_ip_masquerade_follows_the_pod_detector() {
    let mut n = node(IpvsOptions::default());
    let want = desired(&[state("web", "10.96.0.10", &["10.244.1.2:8080"])]);
    n.proxier.set_local_traffic(
        &crate::model::local::DetectLocal::InterfaceNamePrefix("veth".into()).resolve(None),
    );
    n.proxier
        .sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let masq = |n: &Node| {
        n.proxier
            .tables()
            .chain(IpFamily::V4, "nat", "KUBE-SERVICES")
            .unwrap()
            .into_iter()
            .filter(|r| r.contains("--match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ"))
            .filter(|r| !r.contains("src-type LOCAL"))
            .collect::<Vec<_>>()
    };
    assert_eq!(masq(&n).len(), 1, "{:?}", masq(&n));
    assert!(masq(&n)[0].contains(" ! -i veth+ -m set"), "{:?}", masq(&n));
    n.proxier.set_local_traffic(&Default::default());
    n.proxier.sync(&want, &[]).unwrap();
    assert!(masq(&n).is_empty(), "{:?}", masq(&n));
}
