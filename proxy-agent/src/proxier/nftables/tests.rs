use super::{nft::MemoryNft, rules::*, *};
use crate::{
    model::{diff, Cidr, Frontend, FrontendKind, FrontendState, Protocol, WhenEmpty},
    proxier::{
        test_states::{desired, node_port, state},
        RecordedFlows,
    },
};

fn proxier() -> NftablesProxier<MemoryNft> {
    NftablesProxier::new(
        MemoryNft::default(),
        Box::new(RecordedFlows::default()),
        14,
        &LocalTraffic::default(),
    )
}

fn map(p: &NftablesProxier<MemoryNft>, ip: &str, name: &str) -> BTreeMap<String, String> {
    p.nft().elements(ip, TABLE, name).unwrap()
}

#[test]
fn a_cluster_ip_is_a_verdict_map_element_leading_to_a_random_pick() {
    let mut p = proxier();
    let s = state("web", "10.96.0.10", &["10.0.0.1:8080", "10.0.0.2:8080"]);
    let want = desired(std::slice::from_ref(&s));
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let svc = service_chain(&s);
    assert!(svc.starts_with("service-") && svc.ends_with("-default/web/tcp/http"));
    assert_eq!(
        map(&p, "ip", "service-ips").get("10.96.0.10 . tcp . 80"),
        Some(&format!("goto {svc}"))
    );
    let rules = p.nft().chain("ip", TABLE, &svc).unwrap();
    // Half the flows to the first endpoint, the rest to the second.
    let first = endpoint_chain(&s, "10.0.0.1:8080".parse().unwrap());
    let ep = endpoint_chain(&s, "10.0.0.2:8080".parse().unwrap());
    let n = rules.len();
    assert_eq!(
        rules[n - 2],
        format!("numgen random mod 2 == 0 goto {first}")
    );
    assert_eq!(rules[n - 1], format!("goto {ep}"));
    let ep_rules = p.nft().chain("ip", TABLE, &ep).unwrap();
    assert_eq!(
        ep_rules.last().unwrap(),
        "meta l4proto tcp dnat to 10.0.0.2:8080"
    );
    // The hooks exist once, whatever the number of syncs.
    p.sync_full(&want).unwrap();
    assert_eq!(
        p.nft().chain("ip", TABLE, "nat-prerouting").unwrap().len(),
        1
    );
}

#[test]
fn a_change_writes_only_its_chains_and_the_map_elements_that_differ() {
    let mut p = proxier();
    let a = state("a", "10.96.0.1", &["10.0.0.1:80"]);
    let b = state("b", "10.96.0.2", &["10.0.0.2:80", "10.0.0.3:80"]);
    let before = desired(&[a.clone(), b.clone()]);
    p.sync(&before, &diff(&DesiredState::default(), &before))
        .unwrap();
    let b2 = state("b", "10.96.0.3", &["10.0.0.2:80"]);
    let after = desired(&[a.clone(), b2.clone()]);
    let report = p.sync(&after, &diff(&before, &after)).unwrap();
    assert!(!report.full);
    let script = p.nft().scripts.last().unwrap().clone();
    assert!(
        !script.contains(&service_chain(&a)),
        "a untouched:\n{script}"
    );
    assert!(script.contains("delete element ip kube-proxy service-ips { 10.96.0.2 . tcp . 80 }"));
    assert!(script.contains("add element ip kube-proxy service-ips { 10.96.0.3 . tcp . 80 : goto"));
    let gone = endpoint_chain(&b, "10.0.0.3:80".parse().unwrap());
    assert!(script.contains(&format!("delete chain ip kube-proxy {gone}")));
    assert!(p.nft().chain("ip", TABLE, &gone).is_none());
    assert_eq!(map(&p, "ip", "service-ips").len(), 2);
}

#[test]
fn refusals_drops_and_source_ranges_go_through_the_no_endpoint_map() {
    let mut p = proxier();
    let empty = state("empty", "10.96.0.9", &[]);
    let mut s = state("lb", "10.96.0.10", &["10.0.0.1:8080"]);
    s.external = vec![FrontendState {
        frontend: Frontend {
            addr: "10.252.0.5".parse().unwrap(),
            port: 80,
            protocol: Protocol::Tcp,
        },
        kind: FrontendKind::LoadBalancer,
        backends: s.backends.clone(),
        draining: Vec::new(),
        when_empty: WhenEmpty::Refuse,
        source_ranges: vec![Cidr {
            addr: "10.250.1.2".parse().unwrap(),
            prefix: 32,
        }],
        masquerade: true,
        masquerade_all: false,
        in_cluster: None,
    }];
    let want = desired(&[empty, s.clone()]);
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let no_endpoints = map(&p, "ip", "no-endpoint-services");
    assert_eq!(
        no_endpoints.get("10.96.0.9 . tcp . 80").map(String::as_str),
        Some("goto reject-chain")
    );
    assert_eq!(
        no_endpoints
            .get("10.252.0.5 . tcp . 80")
            .map(String::as_str),
        Some("drop")
    );
    let fw = map(&p, "ip", "service-ips")["10.252.0.5 . tcp . 80"].clone();
    let fw = fw.strip_prefix("goto ").unwrap();
    assert!(fw.starts_with("firewall-"));
    let rules = p.nft().chain("ip", TABLE, fw).unwrap();
    assert!(rules[0].starts_with("ip saddr 10.250.1.2/32 goto external-"));
}

#[test]
fn ipv6_and_affinity_use_their_own_table_and_per_endpoint_sets() {
    let mut p = proxier();
    let mut s = state("web", "fd00::10", &["[fd00:1::1]:8080"]);
    s.affinity_timeout = Some(30);
    let want = desired(std::slice::from_ref(&s));
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    assert!(map(&p, "ip6", "service-ips").contains_key("fd00::10 . tcp . 80"));
    let ep = endpoint_chain(&s, "[fd00:1::1]:8080".parse().unwrap());
    assert!(!ep.contains(':'), "nft names take no colons: {ep}");
    let rules = p.nft().chain("ip6", TABLE, &ep).unwrap();
    assert!(rules.iter().any(|r| r.starts_with("update @affinity-")));
    assert_eq!(
        rules.last().unwrap(),
        "meta l4proto tcp dnat to [fd00:1::1]:8080"
    );
    assert!(p
        .nft()
        .elements("ip", TABLE, "service-ips")
        .unwrap()
        .is_empty());
}

#[test]
fn a_full_sync_deletes_chains_nobody_wants_and_cleanup_deletes_the_tables() {
    let mut p = proxier();
    let a = state("a", "10.96.0.1", &["10.0.0.1:80"]);
    let want = desired(std::slice::from_ref(&a));
    // A table left by kube-proxy, with a chain of a service that is gone.
    p.nft
        .apply("add table ip kube-proxy\nadd chain ip kube-proxy service-OLD-ns/gone/tcp/p80\n")
        .unwrap();
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    assert!(p
        .nft()
        .chain("ip", TABLE, "service-OLD-ns/gone/tcp/p80")
        .is_none());
    assert_eq!(remove_all(&mut p.nft).unwrap(), 2);
    assert!(!p.nft().has_table("ip", TABLE) && !p.nft().has_table("ip6", TABLE));
    assert_eq!(remove_all(&mut p.nft).unwrap(), 0, "idempotent");
}

#[test]
fn a_failed_transaction_makes_the_next_sync_full() {
    let mut p = proxier();
    let a = state("a", "10.96.0.1", &["10.0.0.1:80"]);
    let want = desired(std::slice::from_ref(&a));
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    // The table vanishes behind our back: the incremental transaction fails.
    p.nft = MemoryNft::default();
    let b = state("b", "10.96.0.2", &["10.0.0.2:80"]);
    let next = desired(&[a, b]);
    assert!(p.sync(&next, &diff(&want, &next)).is_err());
    assert_eq!(p.failures, 1);
    assert!(p.sync(&next, &[]).unwrap().full);
    assert_eq!(map(&p, "ip", "service-ips").len(), 2);
}

#[test]
fn incremental_syncs_keep_elements_other_service_ports_still_claim() {
    let mut p = proxier();
    let mut a = state("a", "10.96.0.1", &["10.0.0.1:80"]);
    a.external = vec![node_port(&a, "192.168.50.2", true)];
    let mut b = state("b", "10.96.0.2", &["10.0.0.2:80"]);
    let mut np = node_port(&b, "192.168.50.2", true);
    np.frontend.port = 30081;
    b.external = vec![np];
    let both = desired(&[a.clone(), b.clone()]);
    p.sync(&both, &diff(&DesiredState::default(), &both))
        .unwrap();
    assert_eq!(map(&p, "ip", "nodeport-ips").len(), 1);

    // a goes: its NodePort leaves, the node address stays for b's.
    let only_b = desired(std::slice::from_ref(&b));
    assert!(!p.sync(&only_b, &diff(&both, &only_b)).unwrap().full);
    let script = p.nft().scripts.last().unwrap().clone();
    assert!(!script.contains("nodeport-ips"), "{script}");
    assert!(script.contains("delete element ip kube-proxy service-nodeports { tcp . 30080 }"));
    assert_eq!(
        map(&p, "ip", "nodeport-ips").keys().collect::<Vec<_>>(),
        ["192.168.50.2"]
    );

    // b loses its endpoints: its elements move to the no-endpoint map.
    let mut b_empty = b.clone();
    b_empty.backends.clear();
    b_empty.external[0].backends.clear();
    let empty = desired(std::slice::from_ref(&b_empty));
    p.sync(&empty, &diff(&only_b, &empty)).unwrap();
    assert!(map(&p, "ip", "service-ips").is_empty());
    assert!(map(&p, "ip", "service-nodeports").is_empty());
    assert_eq!(
        map(&p, "ip", "no-endpoint-services").get("10.96.0.2 . tcp . 80"),
        Some(&"goto reject-chain".to_string())
    );
    assert!(map(&p, "ip", "nodeport-ips").is_empty());

    // The incremental result is what a full sync writes.
    let incremental: Vec<_> = MAPS.iter().map(|m| map(&p, "ip", m)).collect();
    p.sync_full(&empty).unwrap();
    let full: Vec<_> = MAPS.iter().map(|m| map(&p, "ip", m)).collect();
    assert_eq!(incremental, full);
}

#[test]
fn an_interface_detector_matches_the_input_interface_in_both_families() {
    let mut p = proxier();
    let v4 = state("web", "10.96.0.10", &["10.0.0.1:8080"]);
    let v6 = state("web6", "fd00::10", &["[fd00:1::1]:8080"]);
    let want = desired(&[v4.clone(), v6.clone()]);
    p.set_local_traffic(
        &crate::model::local::DetectLocal::BridgeInterface("cbr0".into()).resolve(None),
    );
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    for (ip, s, vip) in [("ip", &v4, "10.96.0.10"), ("ip6", &v6, "fd00::10")] {
        let rules = p.nft().chain(ip, TABLE, &service_chain(s)).unwrap();
        assert_eq!(
            rules[0],
            format!("{ip} daddr {vip} tcp dport 80 iifname != \"cbr0\" jump mark-for-masquerade")
        );
    }
}

/// Service ports `s0`… with ClusterIPs 10.96.0.1… and one endpoint each.
fn numbered_ports(n: usize, affinity: Option<u32>) -> Vec<crate::model::ServicePortState> {
    (0..n)
        .map(|i| {
            let vip = format!("10.96.0.{}", i + 1);
            let mut s = state(&format!("s{i}"), &vip, &["10.0.0.1:8080"]);
            s.affinity_timeout = affinity;
            s
        })
        .collect()
}

/// The tables a script writes to, besides the `add table` every script starts with.
fn tables_written(script: &str) -> BTreeSet<String> {
    script
        .lines()
        .filter(|l| !l.starts_with("add table") && !l.starts_with("delete table"))
        .filter_map(|l| l.split(' ').nth(3).map(str::to_string))
        .collect()
}

#[test]
fn service_ports_spread_over_tables_and_a_change_touches_only_its_own() {
    let mut p = proxier();
    p.services_per_table = 2;
    let ports = |n| numbered_ports(n, None);
    let six = desired(&ports(6));
    p.sync(&six, &diff(&DesiredState::default(), &six)).unwrap();
    assert_eq!(p.tables(IpFamily::V4), 3);
    // The full sync: a transaction per table, each writing only its own (the IPv6 family,
    // without service ports, one more).
    let scripts = &p.nft().scripts;
    assert_eq!(scripts.len(), 3 + 1);
    for (t, script) in scripts[..3].iter().enumerate() {
        let written = tables_written(script);
        assert_eq!(written, BTreeSet::from([table_name(t)]), "{script}");
    }
    // Every table has the service lookups; only the first the filter hooks.
    for t in 0..3 {
        assert!(p.nft().chain("ip", &table_name(t), "nat-output").is_some());
        assert_eq!(
            p.nft()
                .chain("ip", &table_name(t), "filter-input")
                .is_some(),
            t == 0
        );
    }
    let in_tables: usize = (0..3)
        .map(|t| {
            p.nft()
                .elements("ip", &table_name(t), "service-ips")
                .unwrap()
                .len()
        })
        .sum();
    assert_eq!(in_tables, 6, "each ClusterIP in exactly one table");

    // One endpoint more for one service: only its table is written.
    let mut changed = ports(6);
    changed[3].backends.push("10.0.0.2:8080".parse().unwrap());
    let changed = desired(&changed);
    p.sync(&changed, &diff(&six, &changed)).unwrap();
    let script = p.nft().scripts.last().unwrap();
    assert_eq!(tables_written(script).len(), 1, "{script}");
    assert!(!script.contains("delete table"), "{script}");

    // A seventh service port: a fourth table, everything rewritten at once.
    let seven = desired(&ports(7));
    let report = p.sync(&seven, &diff(&changed, &seven)).unwrap();
    assert_eq!(p.tables(IpFamily::V4), 4);
    assert!(p
        .nft()
        .scripts
        .last()
        .unwrap()
        .contains("delete table ip kube-proxy-3"));
    assert!(report.services_written >= 7);

    // Back to four: still four tables (no rewrite for a count that may come back)...
    let four = desired(&ports(4));
    p.sync(&four, &diff(&seven, &four)).unwrap();
    assert_eq!(p.tables(IpFamily::V4), 4);
    // ...down to two: one table again, and the others deleted.
    let two = desired(&ports(2));
    p.sync(&two, &diff(&four, &two)).unwrap();
    assert_eq!(p.tables(IpFamily::V4), 1);
    assert!(!p.nft().has_table("ip", &table_name(1)));
    let served = p.nft().elements("ip", TABLE, "service-ips").unwrap();
    assert_eq!(served.len(), 2);
}

#[test]
fn affinity_clients_follow_their_service_port_to_another_table() {
    let mut p = proxier();
    p.services_per_table = 2;
    let ports = |n| numbered_ports(n, Some(600));
    let two = desired(&ports(2));
    p.sync(&two, &diff(&DesiredState::default(), &two)).unwrap();
    assert_eq!(p.tables(IpFamily::V4), 1);
    let sets: Vec<String> = p.nft().scripts[0]
        .lines()
        .filter_map(|l| l.strip_prefix("add set ip kube-proxy affinity-"))
        .map(|l| format!("affinity-{}", l.split(' ').next().unwrap()))
        .collect();
    assert_eq!(sets.len(), 2);
    for set in &sets {
        p.nft
            .apply(&format!("add element ip kube-proxy {set} {{ 10.9.9.9 }}\n"))
            .unwrap();
    }
    // Five ports: three tables, every port's chains and sets rewritten where they now go.
    let five = desired(&ports(5));
    p.sync(&five, &diff(&two, &five)).unwrap();
    assert_eq!(p.tables(IpFamily::V4), 3);
    for set in &sets {
        let holding: Vec<usize> = (0..3)
            .filter(|t| {
                p.nft()
                    .elements("ip", &table_name(*t), set)
                    .is_some_and(|e| e.contains_key("10.9.9.9"))
            })
            .collect();
        assert_eq!(
            holding.len(),
            1,
            "{set}: the client is in its port's new table"
        );
    }
}
