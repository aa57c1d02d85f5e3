use super::{rules::*, tables::MemoryTables, *};
use crate::{
    model::{diff, Cidr, FrontendKind, Protocol, StaleFlow},
    proxier::{
        test_states::{desired, node_port, state},
        RecordedFlows,
    },
};

fn proxier() -> (IptablesProxier<MemoryTables>, RecordedFlows) {
    let flows = RecordedFlows::default();
    let p = IptablesProxier::new(
        MemoryTables::default(),
        Box::new(flows.clone()),
        DEFAULT_MASQUERADE_BIT,
        &LocalTraffic::default(),
    );
    (p, flows)
}

fn nat(p: &IptablesProxier<MemoryTables>, chain: &str) -> Vec<String> {
    p.tables()
        .chain(IpFamily::V4, "nat", chain)
        .unwrap_or_else(|| panic!("no nat chain {chain}"))
}

/// The rules of a selection chain that pick an endpoint.
fn picks(rules: &[String]) -> Vec<String> {
    rules
        .iter()
        .filter(|r| r.contains("-j KUBE-SEP-"))
        .cloned()
        .collect()
}

#[test]
fn chain_names_are_kube_proxys_hash_of_the_service_port() {
    // kube-proxy: "KUBE-SVC-" + base32(sha256("ns1/svc1:p80" + "tcp"))[:16], the name in
    // kube-proxy's own iptables tests.
    let mut upstream = state("svc1", "10.96.0.10", &[]);
    upstream.name.service.namespace = "ns1".into();
    upstream.name.port = "p80".into();
    assert_eq!(service_chain(&upstream), "KUBE-SVC-XPGD46QRK7WJZT7O");
    let s = state("web", "10.96.0.10", &[]);
    let name = service_chain(&s);
    assert_eq!(name.len(), "KUBE-SVC-".len() + 16);
    assert!(name[9..]
        .chars()
        .all(|c| c.is_ascii_uppercase() || ('2'..='7').contains(&c)));
    // Stable, and different per service port and per endpoint.
    assert_eq!(name, service_chain(&s));
    assert_ne!(name, service_chain(&state("web2", "10.96.0.10", &[])));
    assert_ne!(
        endpoint_chain(&s, "10.0.0.1:80".parse().unwrap()),
        endpoint_chain(&s, "10.0.0.2:80".parse().unwrap())
    );
}

#[test]
fn a_cluster_ip_balances_at_random_over_its_endpoints() {
    let (mut p, _) = proxier();
    let s = state(
        "web",
        "10.96.0.10",
        &["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"],
    );
    let want = desired(std::slice::from_ref(&s));
    let report = p
        .sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    assert!(report.full, "the first sync writes everything");
    let svc = service_chain(&s);
    let services = nat(&p, "KUBE-SERVICES");
    assert_eq!(services.len(), 1);
    assert!(services[0].contains("-d 10.96.0.10/32 -p tcp -m tcp --dport 80"));
    assert!(services[0].ends_with(&format!("-j {svc}")));
    let all = nat(&p, &svc);
    // The node's own connections are masqueraded (their source was picked for the VIP).
    assert!(all[0].contains("--src-type LOCAL") && all[0].ends_with("-j KUBE-MARK-MASQ"));
    let chain = picks(&all);
    // 1/3, then 1/2 of the rest, then the rest.
    assert!(chain[0].contains("--probability 0.3333333333"), "{chain:?}");
    assert!(chain[1].contains("--probability 0.5000000000"), "{chain:?}");
    assert!(!chain[2].contains("statistic"), "{chain:?}");
    let sep = endpoint_chain(&s, "10.0.0.1:8080".parse().unwrap());
    let ep = nat(&p, &sep);
    assert!(ep[0].contains("-s 10.0.0.1/32") && ep[0].ends_with("-j KUBE-MARK-MASQ"));
    assert!(
        ep[1].ends_with("-j DNAT --to-destination 10.0.0.1:8080"),
        "{ep:?}"
    );
    // The jumps from the built-in chains, once.
    assert_eq!(nat(&p, "PREROUTING").len(), 1);
    assert_eq!(nat(&p, "POSTROUTING").len(), 1);
    p.sync_full(&want).unwrap();
    assert_eq!(nat(&p, "PREROUTING").len(), 1, "hooks are not added twice");
}

#[test]
fn a_service_without_endpoints_is_rejected_in_the_filter_table() {
    let (mut p, _) = proxier();
    let mut udp = state("dns", "10.96.0.11", &[]);
    udp.name.protocol = Protocol::Udp;
    udp.frontend.protocol = Protocol::Udp;
    let tcp = state("web", "10.96.0.10", &[]);
    let want = desired(&[tcp, udp]);
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let filter = p
        .tables()
        .chain(IpFamily::V4, "filter", "KUBE-SERVICES")
        .unwrap();
    assert!(filter
        .iter()
        .any(|r| r.contains("-d 10.96.0.10/32") && r.ends_with("REJECT --reject-with tcp-reset")));
    assert!(filter.iter().any(|r| r.contains("-d 10.96.0.11/32")
        && r.ends_with("REJECT --reject-with icmp-port-unreachable")));
    assert!(nat(&p, "KUBE-SERVICES").is_empty());
}

#[test]
fn external_traffic_under_the_cluster_policy_is_masqueraded_only_to_remote_endpoints() {
    let (mut p, _) = proxier();
    let mut s = state("web", "10.96.0.10", &["10.0.1.1:8080", "10.0.2.1:8080"]);
    s.remote.insert("10.0.2.1:8080".parse().unwrap());
    s.external = vec![node_port(&s, "192.168.0.1", true)];
    let want = desired(std::slice::from_ref(&s));
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let remote = nat(&p, &endpoint_chain(&s, "10.0.2.1:8080".parse().unwrap()));
    let local = nat(&p, &endpoint_chain(&s, "10.0.1.1:8080".parse().unwrap()));
    assert!(remote
        .iter()
        .any(|r| r.contains("--mark 0x2000/0x2000") && r.ends_with("KUBE-MARK-MASQ")));
    assert!(!local.iter().any(|r| r.contains("--mark 0x2000")));
    let nodeports = nat(&p, "KUBE-NODEPORTS");
    assert_eq!(nodeports.len(), 1);
    assert!(nodeports[0].contains("--dport 30080 -j KUBE-EXT-"));
    let services = nat(&p, "KUBE-SERVICES");
    assert!(services
        .last()
        .unwrap()
        .ends_with("-d 192.168.0.1/32 -j KUBE-NODEPORTS"));
}

#[test]
fn ipv6_service_ports_go_to_ip6tables() {
    let (mut p, _) = proxier();
    let s = state("web", "fd00::10", &["[fd00:1::1]:8080"]);
    let want = desired(std::slice::from_ref(&s));
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let services = p
        .tables()
        .chain(IpFamily::V6, "nat", "KUBE-SERVICES")
        .unwrap();
    assert!(services[0].contains("-d fd00::10/128"));
    let sep = endpoint_chain(&s, "[fd00:1::1]:8080".parse().unwrap());
    let ep = p.tables().chain(IpFamily::V6, "nat", &sep).unwrap();
    assert!(
        ep[1].ends_with("--to-destination [fd00:1::1]:8080"),
        "{ep:?}"
    );
    assert!(nat(&p, "KUBE-SERVICES").is_empty(), "nothing in IPv4");
}

#[test]
fn later_syncs_rewrite_only_the_changed_service_ports_chains() {
    let (mut p, flows) = proxier();
    let a = state("a", "10.96.0.1", &["10.0.0.1:80"]);
    let b = state("b", "10.96.0.2", &["10.0.0.2:80", "10.0.0.3:80"]);
    let before = desired(&[a.clone(), b.clone()]);
    p.sync(&before, &diff(&DesiredState::default(), &before))
        .unwrap();
    // Newly served frontends: what the kernel tracked for them untranslated goes.
    assert_eq!(
        std::mem::take(&mut *flows.0.lock().unwrap()),
        [a.frontend, b.frontend].map(|frontend| StaleFlow {
            frontend,
            endpoint: None
        })
    );
    let b2 = state("b", "10.96.0.2", &["10.0.0.2:80"]);
    let after = desired(&[a.clone(), b2.clone()]);
    let report = p.sync(&after, &diff(&before, &after)).unwrap();
    assert!(!report.full);
    assert_eq!(report.services_written, 1);
    let (_, input) = p.tables().restores.last().unwrap().clone();
    // a's chains are neither declared (flushed) nor rewritten; only the dispatch names it.
    let a_chain = service_chain(&a);
    assert!(!input.contains(&format!(":{a_chain} ")), "{input}");
    assert!(!input.contains(&format!("-A {a_chain} ")), "{input}");
    assert!(input.contains(&format!(":{} - [0:0]", service_chain(&b))));
    // The removed endpoint's chain is deleted; the rest still resolve.
    let gone = endpoint_chain(&b, "10.0.0.3:80".parse().unwrap());
    assert!(input.contains(&format!("-X {gone}")), "{input}");
    assert!(!p.tables().chains(IpFamily::V4, "nat").contains(&gone));
    assert_eq!(picks(&nat(&p, &service_chain(&a))).len(), 1);
    // Its flows end.
    assert_eq!(
        *flows.0.lock().unwrap(),
        vec![StaleFlow {
            frontend: b.frontend,
            endpoint: Some("10.0.0.3:80".parse().unwrap()),
        }]
    );
    // Removing a service port deletes all its chains.
    let only_a = desired(std::slice::from_ref(&a));
    p.sync(&only_a, &diff(&after, &only_a)).unwrap();
    let chains = p.tables().chains(IpFamily::V4, "nat");
    assert!(!chains.iter().any(|c| *c == service_chain(&b2)));
    assert_eq!(nat(&p, "KUBE-SERVICES").len(), 1);
}

#[test]
fn a_full_sync_removes_service_chains_nobody_wants() {
    let (mut p, _) = proxier();
    // Left by a previous agent or by kube-proxy.
    let mut tables = MemoryTables::default();
    tables
        .restore(
            IpFamily::V4,
            "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-OLDOLDOLDOLDOLD1 - [0:0]\n:KUBE-SEP-OLDOLDOLDOLDOLD2 - [0:0]\n-A KUBE-SERVICES -d 10.96.9.9/32 -j KUBE-SVC-OLDOLDOLDOLDOLD1\n-A KUBE-SVC-OLDOLDOLDOLDOLD1 -j KUBE-SEP-OLDOLDOLDOLDOLD2\nCOMMIT\n",
        )
        .unwrap();
    p.tables = tables;
    let want = desired(&[state("a", "10.96.0.1", &["10.0.0.1:80"])]);
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let chains = p.tables().chains(IpFamily::V4, "nat");
    assert!(!chains.iter().any(|c| c.contains("OLDOLD")), "{chains:?}");
}

#[test]
fn a_failed_restore_makes_the_next_sync_full() {
    let (mut p, _) = proxier();
    let a = state("a", "10.96.0.1", &["10.0.0.1:80"]);
    let want = desired(std::slice::from_ref(&a));
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    // Someone flushes the tables behind our back: the next partial restore jumps to a
    // chain that is not there any more and fails.
    p.tables = MemoryTables::default();
    let b = state("b", "10.96.0.2", &["10.0.0.2:80"]);
    let next = desired(&[a.clone(), b]);
    assert!(p.sync(&next, &diff(&want, &next)).is_err());
    assert_eq!(p.restore_failures, 1);
    let report = p.sync(&next, &[]).unwrap();
    assert!(report.full, "recovered with a full sync");
    assert_eq!(nat(&p, "KUBE-SERVICES").len(), 2);
}

#[test]
fn client_ip_affinity_uses_the_recent_module() {
    let (mut p, _) = proxier();
    let mut s = state("web", "10.96.0.10", &["10.0.0.1:8080", "10.0.0.2:8080"]);
    s.affinity_timeout = Some(10800);
    let want = desired(std::slice::from_ref(&s));
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let chain = picks(&nat(&p, &service_chain(&s)));
    let sep = endpoint_chain(&s, "10.0.0.1:8080".parse().unwrap());
    assert!(chain[0].contains(&format!(
        "-m recent --name {sep} --rcheck --seconds 10800 --reap -j {sep}"
    )));
    assert!(nat(&p, &sep)[1].contains(&format!("-m recent --name {sep} --set")));
}

#[test]
fn load_balancer_source_ranges_pass_through_a_firewall_chain() {
    let (mut p, _) = proxier();
    let mut s = state("web", "10.96.0.10", &["10.0.0.1:8080"]);
    let mut lb = node_port(&s, "10.252.0.5", false);
    lb.kind = FrontendKind::LoadBalancer;
    lb.frontend.port = 80;
    lb.source_ranges = vec![Cidr {
        addr: "10.250.1.2".parse().unwrap(),
        prefix: 32,
    }];
    s.external = vec![lb];
    let want = desired(std::slice::from_ref(&s));
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let services = nat(&p, "KUBE-SERVICES");
    let fw_jump = services
        .iter()
        .find(|r| r.contains("-d 10.252.0.5/32"))
        .unwrap();
    let fw = fw_jump.rsplit(' ').next().unwrap();
    assert!(fw.starts_with("KUBE-FW-"));
    let rules = nat(&p, fw);
    assert_eq!(rules.len(), 1);
    assert!(rules[0].contains("-s 10.250.1.2/32 -j KUBE-EXT-"));
    let filter = p
        .tables()
        .chain(IpFamily::V4, "filter", "KUBE-SERVICES")
        .unwrap();
    assert!(filter
        .iter()
        .any(|r| r.contains("-d 10.252.0.5/32") && r.ends_with("-j DROP")));
}

#[test]
fn cleanup_removes_every_chain_and_jump_but_keeps_shared_chains_others_use() {
    let (mut p, _) = proxier();
    let mut s = state("web", "10.96.0.10", &["10.0.0.1:8080"]);
    s.external = vec![node_port(&s, "192.168.0.1", true)];
    let empty = state("empty", "fd00::1", &[]);
    let want = desired(&[s, empty]);
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let mut tables = p.tables().clone();
    // Someone else's chain in nat that uses KUBE-MARK-MASQ (an old kubelet's).
    tables
        .restore(
            IpFamily::V6,
            "*nat\n:KUBE-MARK-MASQ - [0:0]\n:OTHER - [0:0]\n-A OTHER -j KUBE-MARK-MASQ\nCOMMIT\n",
        )
        .unwrap();
    let removed = cleanup::remove_all(&mut tables, &[]).unwrap();
    assert!(removed >= 6, "{removed}");
    for family in [IpFamily::V4, IpFamily::V6] {
        for table in ["nat", "filter"] {
            let saved = tables.save(family, table).unwrap();
            let left: Vec<&str> = saved
                .lines()
                .filter(|l| l.contains("KUBE-") && !l.contains("KUBE-MARK-MASQ"))
                .collect();
            assert!(left.is_empty(), "{family:?} {table}: {left:?}");
        }
    }
    assert!(tables
        .chain(IpFamily::V4, "nat", "KUBE-MARK-MASQ")
        .is_none());
    assert!(tables
        .chain(IpFamily::V6, "nat", "KUBE-MARK-MASQ")
        .is_some());
    assert_eq!(
        cleanup::remove_all(&mut tables, &[]).unwrap(),
        0,
        "idempotent"
    );
}

#[test]
fn cleanup_for_the_ipvs_mode_keeps_the_chains_it_writes_itself() {
    let (mut p, _) = proxier();
    let want = desired(&[state("web", "10.96.0.10", &["10.0.0.1:8080"])]);
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let mut tables = p.tables().clone();
    let keep = crate::proxier::ipvs::IPTABLES_CHAINS;
    assert!(cleanup::remove_all(&mut tables, keep).unwrap() > 0);
    let nat = tables.chains(IpFamily::V4, "nat");
    for chain in ["KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"] {
        assert!(nat.iter().any(|c| c == chain), "{chain} kept: {nat:?}");
    }
    assert!(
        !nat.iter()
            .any(|c| c.starts_with("KUBE-SVC-") || c.starts_with("KUBE-SEP-")),
        "the iptables mode's service chains go: {nat:?}"
    );
    // The hooks into kept chains stay.
    assert!(tables
        .chain(IpFamily::V4, "nat", "PREROUTING")
        .unwrap()
        .iter()
        .any(|r| r.ends_with("-j KUBE-SERVICES")));
}

#[test]
fn external_traffic_policy_local_short_circuits_pods_and_the_node() {
    let flows = RecordedFlows::default();
    let cidr = "10.244.0.0/16".parse().unwrap();
    let mut p = IptablesProxier::new(
        MemoryTables::default(),
        Box::new(flows),
        DEFAULT_MASQUERADE_BIT,
        &LocalTraffic::by_cidrs(&[cidr]),
    );
    let mut s = state("web", "10.96.0.10", &["10.0.2.1:8080", "10.0.2.2:8080"]);
    let mut np = node_port(&s, "192.168.0.1", false);
    // No endpoint on this node: the outside is dropped, the node's clients take them all.
    np.backends.clear();
    np.when_empty = crate::model::WhenEmpty::Drop;
    np.in_cluster = Some(crate::model::InCluster {
        backends: s.backends.clone(),
        draining: Vec::new(),
    });
    s.external = vec![np];
    let want = desired(std::slice::from_ref(&s));
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let nodeports = nat(&p, "KUBE-NODEPORTS");
    let ext = nodeports[0].rsplit(' ').next().unwrap().to_string();
    let svc = service_chain(&s);
    let rules = nat(&p, &ext);
    assert_eq!(
        rules,
        vec![
            format!("-m comment --comment \"pod traffic for default/web:http/TCP external destinations\" -s 10.244.0.0/16 -j {svc}"),
            format!("-m comment --comment \"masquerade LOCAL traffic for default/web:http/TCP external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"),
            format!("-m comment --comment \"route LOCAL traffic for default/web:http/TCP external destinations\" -m addrtype --src-type LOCAL -j {svc}"),
        ]
    );
    let filter = p
        .tables()
        .chain(IpFamily::V4, "filter", "KUBE-SERVICES")
        .unwrap();
    assert!(
        filter
            .iter()
            .any(|r| r.contains("-d 192.168.0.1/32") && r.ends_with("-j DROP")),
        "{filter:#?}"
    );
}

#[test]
fn an_interface_detector_replaces_the_cluster_cidr_and_a_change_rewrites_the_rules() {
    use crate::model::local::DetectLocal;
    let (mut p, _) = proxier();
    let s = state("web", "10.96.0.10", &["10.0.2.1:8080"]);
    let want = desired(std::slice::from_ref(&s));
    let svc = service_chain(&s);
    p.set_local_traffic(&DetectLocal::InterfaceNamePrefix("veth".into()).resolve(None));
    p.sync(&want, &diff(&DesiredState::default(), &want))
        .unwrap();
    let masq = |p: &IptablesProxier<MemoryTables>| {
        nat(p, &svc)
            .into_iter()
            .filter(|r| r.ends_with("-j KUBE-MARK-MASQ") && r.contains("cluster IP"))
            .collect::<Vec<_>>()
    };
    assert_eq!(masq(&p).len(), 1);
    assert!(
        masq(&p)[0].contains(" ! -i veth+ -d 10.96.0.10/32 "),
        "{:?}",
        masq(&p)
    );
    // The Node's pod range appears (NodeCIDR): the next sync, with no Service change,
    // rewrites the rule.
    let node = crate::model::NodeInfo {
        pod_cidrs: vec!["10.244.1.0/24".parse().unwrap()],
        ..Default::default()
    };
    p.set_local_traffic(&DetectLocal::NodeCidr.resolve(Some(&node)));
    p.sync(&want, &[]).unwrap();
    assert!(
        masq(&p)[0].contains(" ! -s 10.244.1.0/24 -d "),
        "{:?}",
        masq(&p)
    );
    // None known: cluster-IP traffic is not masqueraded (kube-proxy's no-op detector).
    p.set_local_traffic(&DetectLocal::NodeCidr.resolve(None));
    p.sync(&want, &[]).unwrap();
    assert!(masq(&p).is_empty(), "{:?}", masq(&p));
}

#[test]
fn forwarded_invalid_packets_are_dropped_unless_conntrack_is_liberal() {
    for (tcp_be_liberal, dropped) in [(false, true), (true, false)] {
        let (mut p, _) = proxier();
        p.set_drop_invalid(!tcp_be_liberal);
        let want = desired(&[state("web", "10.96.0.10", &[])]);
        p.sync(&want, &diff(&DesiredState::default(), &want))
            .unwrap();
        let forward = p
            .tables()
            .chain(IpFamily::V4, "filter", "KUBE-FORWARD")
            .expect("KUBE-FORWARD written");
        // kube-proxy's first KUBE-FORWARD rule, before the ones that accept service traffic.
        let first_drops = forward
            .first()
            .is_some_and(|r| r.contains("-m conntrack --ctstate INVALID -j DROP"));
        assert_eq!(
            first_drops, dropped,
            "tcpBeLiberal {tcp_be_liberal}: {forward:?}"
        );
        assert_eq!(
            forward.iter().filter(|r| r.contains("INVALID")).count(),
            usize::from(dropped)
        );
    }
}

/// Every chain of both tables, with its rules.
fn everything(t: &MemoryTables) -> Vec<(String, String, Vec<String>)> {
    ["nat", "filter"]
        .iter()
        .flat_map(|table| {
            t.chains(IpFamily::V4, table).into_iter().map(move |c| {
                let rules = t.chain(IpFamily::V4, table, &c).unwrap_or_default();
                (table.to_string(), c, rules)
            })
        })
        .collect()
}

#[test]
fn a_large_full_sync_in_chunks_leaves_the_rules_one_restore_would() {
    let ports: Vec<_> = (0..600)
        .map(|i| {
            let vip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
            let mut s = state(&format!("s{i}"), &vip, &["10.0.0.1:8080", "10.0.0.2:8080"]);
            if i % 7 == 0 {
                let mut np = node_port(&s, "192.168.1.2", true);
                np.frontend.port = 30000 + i as u16;
                s.external = vec![np];
            }
            s
        })
        .collect();
    let want = desired(&ports);
    let (mut whole, _) = proxier();
    whole.sync_full(&want).unwrap();
    let (mut chunked, _) = proxier();
    chunked.tables.chunked = true;
    // A previous agent's chain, which the last restore deletes.
    chunked
        .tables
        .restore(
            IpFamily::V4,
            "*nat\n:KUBE-SVC-OLDOLDOLDOLDOLDO - [0:0]\nCOMMIT\n",
        )
        .unwrap();
    let report = chunked.sync_full(&want).unwrap();
    assert_eq!(report.services_written, 600);
    // The shared chains, three chunks of service chains, then the rest, per family.
    let v4: Vec<&String> = chunked
        .tables()
        .restores
        .iter()
        .filter(|(f, _)| *f == IpFamily::V4)
        .map(|(_, input)| input)
        .collect();
    assert_eq!(
        v4.len(),
        1 + 1 + 3 + 1,
        "{:?}",
        v4.iter().map(|i| i.len()).collect::<Vec<_>>()
    );
    assert!(v4[1].contains(":KUBE-MARK-MASQ") && !v4[1].contains("KUBE-SERVICES"));
    assert!(!v4[2].contains("KUBE-SERVICES") && v4[2].contains(":KUBE-SVC-"));
    assert!(v4[5].contains("-X KUBE-SVC-OLDOLDOLDOLDOLDO"));
    assert_eq!(everything(chunked.tables()), everything(whole.tables()));
}
