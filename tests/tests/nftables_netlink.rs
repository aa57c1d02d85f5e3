//! The nftables mode's transactions, full and incremental, go to nf_tables over netlink
//! instead of through `nft`: the same syncs, once with each, must leave the same tables, as
//! `nft list` prints them (rule by rule, element by element); a refused transaction must
//! leave nothing behind and name the line it failed on; a full sync after a restart must
//! drop what is no longer wanted and keep the affinity clients.

use std::{
    net::SocketAddr,
    sync::{atomic::Ordering, Arc},
};

use proxy_agent::{
    model::{
        diff,
        local::{LocalMatch, LocalTraffic},
        Cidr, DesiredState, Frontend, FrontendKind, FrontendState, Protocol, ServicePortState,
        WhenEmpty,
    },
    proxier::{
        nftables::{
            netlink::NftNetlink,
            nft::{Nft, NftCommand},
            table_name, NftablesProxier, MAX_TABLES, SERVICES_PER_TABLE,
        },
        Proxier, RecordedFlows,
    },
};
use proxy_tests::{
    lab::{sh, Netns, LAB_COUNTER, PREFIX},
    require_kernel,
};

fn addrs(list: &[&str]) -> Vec<SocketAddr> {
    let mut v: Vec<SocketAddr> = list.iter().map(|a| a.parse().unwrap()).collect();
    v.sort();
    v
}

fn svc(name: &str, vip: &str, backends: &[&str]) -> ServicePortState {
    ServicePortState::cluster_ip("lab", name, "p", vip.parse().unwrap(), addrs(backends))
}

fn external(
    kind: FrontendKind,
    addr: &str,
    port: u16,
    s: &ServicePortState,
    ranges: &[(&str, u8)],
) -> FrontendState {
    FrontendState {
        frontend: Frontend {
            addr: addr.parse().unwrap(),
            port,
            protocol: s.frontend.protocol,
        },
        kind,
        backends: s.backends.clone(),
        draining: Vec::new(),
        when_empty: WhenEmpty::Refuse,
        source_ranges: ranges
            .iter()
            .map(|(a, p)| Cidr {
                addr: a.parse().unwrap(),
                prefix: *p,
            })
            .collect(),
        masquerade: true,
        masquerade_all: false,
        in_cluster: None,
    }
}

fn with_protocol(mut s: ServicePortState, protocol: Protocol) -> ServicePortState {
    s.name.protocol = protocol;
    s.frontend.protocol = protocol;
    s
}

/// Service ports covering every rule shape the nftables mode writes; `generation` moves
/// endpoints and frontends the way endpoint churn does.
fn states(generation: u8) -> Vec<ServicePortState> {
    let g = generation;
    let mut out = Vec::new();

    let web_backends = [
        "10.0.0.1:8080".to_string(),
        format!("10.0.1.{}:8080", 10 + g),
    ];
    let web_refs: Vec<&str> = web_backends.iter().map(String::as_str).collect();
    let mut web = svc("web", "10.96.0.10", &web_refs);
    web.remote = [web.backends[1]].into_iter().collect();
    web.external = vec![
        external(FrontendKind::NodePort, "192.168.50.2", 30080, &web, &[]),
        external(
            FrontendKind::LoadBalancer,
            "10.252.0.5",
            80,
            &web,
            &[("10.250.1.2", 32), ("10.240.0.0", 12), ("172.16.0.0", 16)],
        ),
    ];
    out.push(web);

    let mut sticky = svc("sticky", "10.96.0.11", &["10.0.0.2:80", "10.0.0.3:80"]);
    if g > 0 {
        sticky.backends.push("10.0.0.4:80".parse().unwrap());
    }
    sticky.affinity_timeout = Some(10800);
    out.push(sticky);

    let mut all = with_protocol(svc("dns", "10.96.0.12", &["10.0.0.5:53"]), Protocol::Udp);
    all.masquerade_all = true;
    out.push(all);

    let empty_backends: &[&str] = if g > 0 { &["10.0.0.6:9090"] } else { &[] };
    out.push(with_protocol(
        svc("empty", "10.96.0.13", empty_backends),
        Protocol::Sctp,
    ));

    let mut local = svc("local", "10.96.0.14", &["10.0.0.7:80"]);
    let mut np = external(FrontendKind::NodePort, "192.168.50.2", 30081, &local, &[]);
    np.masquerade = false;
    if g > 0 {
        np.backends.clear();
        np.when_empty = WhenEmpty::Drop;
    }
    local.external = vec![np];
    out.push(local);

    let v6_backend = format!("[fd00:10::{}]:8080", 1 + g);
    let mut v6 = svc("web6", "fd00:96::10", &[&v6_backend, "[fd00:10::99]:8080"]);
    v6.affinity_timeout = Some(60);
    v6.external = vec![external(
        FrontendKind::ExternalIp,
        "fd00:252::5",
        80,
        &v6,
        &[],
    )];
    out.push(v6);

    // Churn in every service port, so each of its chains is rewritten incrementally.
    if g > 0 {
        for (i, s) in out.iter_mut().enumerate() {
            let extra: SocketAddr = if s.frontend.addr.is_ipv4() {
                format!("10.0.{}.{}:7000", 100 + g, i + 1).parse().unwrap()
            } else {
                format!("[fd00:10::{}:{}]:7000", 100 + g, i + 1)
                    .parse()
                    .unwrap()
            };
            s.backends.push(extra);
            s.backends.sort();
            for f in s.external.iter_mut().filter(|f| !f.backends.is_empty()) {
                f.backends = s.backends.clone();
            }
        }
    }
    if g > 1 {
        out.retain(|s| s.name.service.name != "web");
        out.push(svc("late", "10.96.0.20", &["10.0.0.9:80"]));
    }
    out
}

fn desired(states: &[ServicePortState]) -> DesiredState {
    DesiredState {
        ports: states
            .iter()
            .map(|s| (s.name.clone(), Arc::new(s.clone())))
            .collect(),
    }
}

/// Every table of the mode in `family`, as `nft list` prints them.
fn listing(family: &str) -> String {
    (0..MAX_TABLES)
        .filter_map(|t| sh("nft", &["list", "table", family, &table_name(t)]).ok())
        .collect()
}

/// Every sync's resulting tables (ip, ip6), and whether it was full.
fn drive<N: Nft>(
    nft: N,
    netlink_counts: impl Fn(&N) -> u64,
    local: &LocalTraffic,
    per_table: usize,
) -> (Vec<(bool, String, String)>, u64) {
    let mut p = NftablesProxier::new(nft, Box::new(RecordedFlows::default()), 14, local);
    p.services_per_table = per_table;
    let mut out = Vec::new();
    let mut current = DesiredState::default();
    for generation in 0..3 {
        let next = desired(&states(generation));
        let report = p.sync(&next, &diff(&current, &next)).expect("sync");
        out.push((report.full, listing("ip"), listing("ip6")));
        current = next;
    }
    let report = p.sync_full(&current).expect("full sync");
    out.push((report.full, listing("ip"), listing("ip6")));
    (out, netlink_counts(p.nft()))
}

fn namespace(what: &str) -> Netns {
    Netns::create(&format!(
        "{PREFIX}-{}-{}-{what}",
        std::process::id(),
        LAB_COUNTER.fetch_add(1, Ordering::SeqCst)
    ))
    .expect("namespace")
}

/// Pods told by range: a prefix nft masks (/14) and one it compares bytewise (/56).
fn by_cidrs() -> LocalTraffic {
    LocalTraffic::by_cidrs(&[
        Cidr {
            addr: "10.0.0.0".parse().unwrap(),
            prefix: 14,
        },
        Cidr {
            addr: "fd00:10::".parse().unwrap(),
            prefix: 56,
        },
    ])
}

/// Both runs' tables after each step: (nft's, netlink's), and the netlink transactions.
type Runs = (
    Vec<(bool, String, String)>,
    Vec<(bool, String, String)>,
    u64,
);

fn both_ways(local: &LocalTraffic, per_table: usize) -> Runs {
    let (first, second) = (local.clone(), local.clone());
    let (nft_steps, _) = namespace("nft")
        .run(move || drive(NftCommand, |_| 0, &first, per_table))
        .expect("nft namespace");
    let (netlink_steps, transactions) = namespace("nl")
        .run(move || {
            drive(
                NftNetlink::default(),
                |n| n.transactions,
                &second,
                per_table,
            )
        })
        .expect("netlink namespace");
    (nft_steps, netlink_steps, transactions)
}

/// A proxier as a newly started agent has it: no memory of the tables.
fn agent() -> NftablesProxier<NftNetlink> {
    NftablesProxier::new(
        NftNetlink::default(),
        Box::new(RecordedFlows::default()),
        14,
        &by_cidrs(),
    )
}

/// The seconds an element of `listing` has left (`10.9.9.9 expires 1m39s996ms`).
fn expires_seconds(listing: &str, key: &str) -> Option<u64> {
    let at = listing.find(&format!("{key} expires "))? + key.len() + " expires ".len();
    let text: String = listing[at..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    let mut seconds = 0;
    let mut number = 0;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '0'..='9' => number = number * 10 + u64::from(c.to_digit(10)?),
            'h' => (seconds, number) = (seconds + number * 3600, 0),
            'm' if chars.peek() == Some(&'s') => break,
            'm' => (seconds, number) = (seconds + number * 60, 0),
            's' => (seconds, number) = (seconds + number, 0),
            _ => return None,
        }
    }
    Some(seconds)
}

/// [W2-5]'s tests: their own part of `cargo xtask test`.
mod scale {
    use super::*;

    #[test]
    fn pods_told_by_interface_over_netlink_leave_the_tables_nft_would() {
        require_kernel!();
        // IPv4 pods by a name prefix, IPv6 pods by a bridge: both encodings of `iifname`.
        let local = LocalTraffic([
            Some(LocalMatch::InterfacePrefix("lxc".into())),
            Some(LocalMatch::Interface("cbr0".into())),
        ]);
        let (nft_steps, netlink_steps, transactions) = both_ways(&local, SERVICES_PER_TABLE);
        assert_eq!(transactions, 8);
        for (step, (a, b)) in nft_steps.iter().zip(&netlink_steps).enumerate() {
            assert!(a.1.contains("iifname != \"lxc*\""), "step {step}: {}", a.1);
            assert!(a.2.contains("iifname != \"cbr0\""), "step {step}: {}", a.2);
            assert_eq!(a.1, b.1, "step {step}: ip kube-proxy differs");
            assert_eq!(a.2, b.2, "step {step}: ip6 kube-proxy differs");
        }
    }

    #[test]
    fn full_and_incremental_syncs_over_netlink_leave_the_tables_nft_would() {
        require_kernel!();
        let (nft_steps, netlink_steps, netlink_transactions) =
            both_ways(&by_cidrs(), SERVICES_PER_TABLE);
        // Two full and two incremental syncs, each a transaction per family.
        assert_eq!(netlink_transactions, 8);
        let fulls: Vec<bool> = netlink_steps.iter().map(|(full, _, _)| *full).collect();
        assert_eq!(fulls, [true, false, false, true]);
        for (step, (a, b)) in nft_steps.iter().zip(&netlink_steps).enumerate() {
            assert!(a.1.contains("dnat to"), "step {step}: the table is there");
            assert!(a.2.contains("dnat to [fd00:10::"), "step {step}: ip6 too");
            assert_eq!(a.1, b.1, "step {step}: ip kube-proxy differs");
            assert_eq!(a.2, b.2, "step {step}: ip6 kube-proxy differs");
        }
        // What the incremental steps changed is there (the netlink path did write).
        let (_, after_change, after_change6) = &netlink_steps[1];
        assert!(
            after_change.contains("10.0.1.11:8080") && !after_change.contains("10.0.1.10:8080")
        );
        assert!(after_change6.contains("[fd00:10::2]:8080"));
        assert!(after_change.contains("sctp . 80 : goto service-"));
    }

    #[test]
    fn a_refused_netlink_transaction_names_its_line_and_changes_nothing() {
        require_kernel!();
        let (error, tables, table_after) = namespace("nlfail")
            .run(|| {
                let mut nft = NftNetlink::default();
                nft.apply("add table ip kube-proxy\nadd chain ip kube-proxy kept\n")
                    .unwrap();
                let error = nft
                    .apply(
                        "add table ip kube-proxy\n\
                         add chain ip kube-proxy fresh\n\
                         add rule ip kube-proxy fresh ip saddr 10.0.0.1 goto missing\n",
                    )
                    .unwrap_err();
                (
                    format!("{error:#}"),
                    sh("nft", &["list", "tables"]).unwrap(),
                    listing("ip"),
                )
            })
            .expect("namespace");
        assert!(
            error.contains("add rule ip kube-proxy fresh ip saddr 10.0.0.1 goto missing"),
            "{error}"
        );
        assert!(tables.contains("table ip kube-proxy"), "{tables}");
        assert!(table_after.contains("chain kept"), "{table_after}");
        assert!(
            !table_after.contains("fresh"),
            "all or nothing:\n{table_after}"
        );
    }

    #[test]
    fn a_table_is_found_by_name_without_listing_the_ruleset() {
        require_kernel!();
        let (before, found, removed, gone, over_netlink) = namespace("nlhas")
            .run(|| {
                let mut nft = NftNetlink::default();
                let before = nft.has_table("ip", "kube-proxy").unwrap();
                nft.apply(
                    "add table ip kube-proxy\nadd chain ip kube-proxy a\n\
                     add chain ip kube-proxy b\nadd rule ip kube-proxy a jump b\n",
                )
                .unwrap();
                let found = (
                    nft.has_table("ip", "kube-proxy").unwrap(),
                    nft.has_table("ip6", "kube-proxy").unwrap(),
                    NftCommand.has_table("ip", "kube-proxy-other").unwrap(),
                );
                // Removal (cleanup, mode switches) goes over netlink too, chains and all.
                let removed = proxy_agent::proxier::nftables::remove_all(&mut nft).unwrap();
                let gone = !nft.has_table("ip", "kube-proxy").unwrap();
                (before, found, removed, gone, nft.transactions == 3)
            })
            .expect("namespace");
        assert!(!before && found.0, "the table is found once it exists");
        assert!(!found.1 && !found.2, "only that family's, by that name");
        assert_eq!(removed, 1, "one table removed (ip6 had none)");
        assert!(gone && over_netlink, "deleted, one transaction per family");
    }

    #[test]
    fn a_restarted_proxier_replaces_the_table_and_keeps_affinity_clients() {
        require_kernel!();
        let (before, after, lowered) = namespace("nlrestart")
            .run(|| {
                let mut first = agent();
                let start = desired(&states(0));
                first.sync_full(&start).expect("first agent's sync");
                // A client the sticky service's affinity set has seen, 100 s left.
                let table = listing("ip");
                let set = table
                    .lines()
                    .filter_map(|l| l.trim().strip_prefix("set "))
                    .find(|s| s.starts_with("affinity-"))
                    .expect("an affinity set")
                    .trim_end_matches(" {")
                    .to_string();
                let client = [
                    "add",
                    "element",
                    "ip",
                    "kube-proxy",
                    &set,
                    "{",
                    "10.9.9.9",
                    "expires",
                    "100s",
                    "}",
                ];
                sh("nft", &client).expect("adding a client");
                // A new agent (no memory of the table) whose services changed meanwhile.
                agent()
                    .sync(&desired(&states(2)), &[])
                    .expect("second agent's first sync");
                let after = listing("ip");
                // A third agent, with the affinity timeout lowered below what the client has
                // left: the client keeps no more than the new timeout (a kernel refuses an
                // expiry beyond the set's timeout).
                let mut lowered = states(2);
                for s in lowered.iter_mut().filter(|s| s.affinity_timeout.is_some()) {
                    s.affinity_timeout = Some(30);
                }
                agent()
                    .sync(&desired(&lowered), &[])
                    .expect("third agent's first sync");
                (table, after, listing("ip"))
            })
            .expect("namespace");
        assert!(before.contains("10.96.0.10"), "web was served:\n{before}");
        assert!(
            !after.contains("10.96.0.10") && !after.contains("10.0.1.10:8080"),
            "web's chains and elements are gone after the restart:\n{after}"
        );
        assert!(after.contains("10.96.0.20"), "late is served:\n{after}");
        let left = expires_seconds(&after, "10.9.9.9").expect("the client is still there");
        assert!(
            left > 0 && left <= 100,
            "the client keeps the time it had left ({left} s):\n{after}"
        );
        let capped = expires_seconds(&lowered, "10.9.9.9").expect("still there");
        assert!(
            capped > 0 && capped <= 30,
            "capped at the new timeout ({capped} s)"
        );
    }

    #[test]
    fn services_spread_over_tables_leave_the_tables_nft_would() {
        require_kernel!();
        // One service port per table: the IPv4 ones spread over five tables.
        let (nft_steps, netlink_steps, transactions) = both_ways(&by_cidrs(), 1);
        // Two full syncs, a transaction per table (five ip, one ip6), and two incremental
        // ones, a transaction per family.
        assert_eq!(transactions, 2 * (5 + 1) + 2 * 2);
        for (step, (a, b)) in nft_steps.iter().zip(&netlink_steps).enumerate() {
            assert!(
                a.1.contains("table ip kube-proxy-4 {"),
                "step {step}: five tables:\n{}",
                a.1
            );
            assert!(
                !a.2.contains("table ip6 kube-proxy-1 "),
                "step {step}: one ip6 table"
            );
            assert_eq!(a.1, b.1, "step {step}: ip tables differ");
            assert_eq!(a.2, b.2, "step {step}: ip6 tables differ");
        }
    }

    #[test]
    fn a_service_in_every_table_is_served() {
        require_kernel!();
        let served = namespace("nlshards")
            .run(|| {
                // The backends' address on lo, and a route for the ClusterIPs to leave by.
                for args in [
                    "link set lo up",
                    "addr add 10.0.0.1/24 dev lo",
                    "route add 10.96.0.0/16 dev lo",
                ] {
                    sh("ip", &args.split(' ').collect::<Vec<_>>()).expect("lab network");
                }
                let ports: Vec<ServicePortState> = (1..=6)
                    .map(|i| {
                        let backend = format!("10.0.0.1:{}", 8000 + i);
                        svc(&format!("s{i}"), &format!("10.96.0.{i}"), &[&backend])
                    })
                    .collect();
                let mut p = NftablesProxier::new(
                    NftNetlink::default(),
                    Box::new(RecordedFlows::default()),
                    14,
                    &LocalTraffic::default(),
                );
                p.services_per_table = 2;
                p.sync_full(&desired(&ports)).expect("sync");
                let tables = p.tables(proxy_agent::model::IpFamily::V4);
                let mut served = Vec::new();
                for i in 1..=6u16 {
                    let listener = std::net::TcpListener::bind(("10.0.0.1", 8000 + i)).unwrap();
                    listener.set_nonblocking(true).unwrap();
                    let vip: SocketAddr = format!("10.96.0.{i}:80").parse().unwrap();
                    let connected = std::net::TcpStream::connect_timeout(
                        &vip,
                        std::time::Duration::from_secs(2),
                    );
                    let accepted = (0..200).any(|_| {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                        listener.accept().is_ok()
                    });
                    served.push(connected.is_ok() && accepted);
                }
                (tables, served, listing("ip"))
            })
            .expect("namespace");
        let (tables, served, listing) = served;
        assert_eq!(tables, 3, "six service ports, two per table");
        assert!(listing.contains("table ip kube-proxy-2 {"), "{listing}");
        assert_eq!(
            served, [true; 6],
            "each ClusterIP reaches its backend:\n{listing}"
        );
    }
}
