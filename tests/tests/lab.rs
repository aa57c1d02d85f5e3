//! End to end in the namespace lab: the real agent, the real kernel datapath, real TCP and UDP
//! sockets in pod namespaces.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    net::{Ipv4Addr, SocketAddrV4, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

use proxy_tests::{
    lab::{client, manifest::service, Checksums, Lab, LabOptions, TCP_PORT, UDP_PORT},
    require_kernel,
};

const WEB: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);
const DNS: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 53), 53);
const DEAD: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 99), 80);
const TIMEOUT: Duration = Duration::from_secs(2);

/// web (TCP 80 -> 8080) and dns (UDP 53 -> 5353) on `backends`; dead has no endpoint.
fn manifest(backends: &[Ipv4Addr]) -> String {
    [
        service("web", *WEB.ip(), &[("http", "TCP", 80, TCP_PORT)], backends),
        service("dns", *DNS.ip(), &[("dns", "UDP", 53, UDP_PORT)], backends),
        service(
            "dead",
            *DEAD.ip(),
            &[("tcp", "TCP", 80, TCP_PORT), ("udp", "UDP", 80, UDP_PORT)],
            &[],
        ),
    ]
    .concat()
}

fn lab_with_agent(checksums: Checksums, extra_args: &[&str]) -> Lab {
    let mut lab = Lab::new(LabOptions {
        checksums,
        ..LabOptions::default()
    })
    .expect("lab");
    let ips: Vec<Ipv4Addr> = lab.backends.iter().map(|p| p.ip).collect();
    let path = lab.write_manifests(&manifest(&ips)).unwrap();
    lab.start_agent(&path, extra_args).expect("agent");
    lab
}

/// Runs `n` clients of `kind` from the client pod; returns answers per backend pod.
fn spread(lab: &Lab, udp: bool, n: usize) -> BTreeMap<String, usize> {
    let results = lab
        .client
        .ns
        .run(move || {
            (0..n)
                .map(|_| {
                    if udp {
                        client::udp_hello(DNS, TIMEOUT)
                    } else {
                        client::tcp_hello(WEB, TIMEOUT)
                    }
                })
                .collect::<Vec<_>>()
        })
        .unwrap();
    let mut counts = BTreeMap::new();
    for r in results {
        let pod =
            r.unwrap_or_else(|e| panic!("{} request failed: {e}", if udp { "UDP" } else { "TCP" }));
        *counts.entry(pod).or_insert(0) += 1;
    }
    counts
}

fn assert_spread(counts: &BTreeMap<String, usize>, n: usize, what: &str) {
    assert_eq!(counts.len(), 3, "{what}: every backend serves: {counts:?}");
    for (pod, c) in counts {
        let share = *c as f64 / n as f64;
        assert!(
            (0.20..=0.47).contains(&share),
            "{what}: {pod} got {:.0}% of {n}: {counts:?}",
            share * 100.0
        );
    }
}

/// TCP connect and UDP exchange to the no-endpoint service are refused, fast.
fn assert_refused_quickly(lab: &Lab) {
    let (tcp, udp) = lab
        .client
        .ns
        .run(|| {
            let t = Instant::now();
            let tcp = TcpStream::connect_timeout(&DEAD.into(), TIMEOUT).map(|_| ());
            let tcp_time = t.elapsed();
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.connect(DEAD).unwrap();
            s.set_read_timeout(Some(TIMEOUT)).unwrap();
            let t = Instant::now();
            s.send(b"anyone?").unwrap();
            let udp = s.recv(&mut [0u8; 16]).map(|_| ());
            ((tcp, tcp_time), (udp, t.elapsed()))
        })
        .unwrap();
    for (what, (result, took)) in [("TCP", tcp), ("UDP", udp)] {
        let err = result.expect_err("no-endpoint service must refuse");
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::ConnectionRefused,
            "{what}: {err}"
        );
        assert!(
            took < Duration::from_millis(100),
            "{what} refused after {took:?}"
        );
    }
}

fn traffic_is_served(checksums: Checksums) {
    let lab = lab_with_agent(checksums, &[]);
    // 300 (the issue asks for at least 150) keeps a fair spread from leaving 20-47 % by
    // chance (below 1e-6 per backend).
    let n = 300;
    assert_spread(&spread(&lab, false, n), n, "TCP");
    assert_spread(&spread(&lab, true, n), n, "UDP");
    assert_refused_quickly(&lab);
}

#[test]
fn tcp_and_udp_spread_over_backends_with_offload() {
    require_kernel!();
    traffic_is_served(Checksums::Offloaded);
}

#[test]
fn tcp_and_udp_spread_over_backends_with_software_checksums() {
    require_kernel!();
    traffic_is_served(Checksums::Software);
}

/// Every packet the datapath rewrites carries a partial (offload) checksum, which the node
/// then completes in software and the receiving pod verifies: a wrong partial update shows
/// up as lost connections.
#[test]
fn partial_checksums_are_rewritten_correctly() {
    require_kernel!();
    traffic_is_served(Checksums::PartialCompletedByNode);
}

#[test]
fn dropping_a_backend_stops_new_connections_within_a_second_and_keeps_established_ones() {
    require_kernel!();
    let lab = lab_with_agent(Checksums::Software, &[]);
    // An established connection, and the backend it landed on.
    let (tx, rx) = std::sync::mpsc::channel::<&'static str>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Result<String, String>>();
    let (pod_tx, pod_rx) = std::sync::mpsc::channel::<String>();
    let conn = lab.client.ns.spawn(move || {
        let mut s = TcpStream::connect_timeout(&WEB.into(), TIMEOUT).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut reader = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        pod_tx.send(line.trim().to_string()).unwrap();
        // Keep exchanging data until told to stop.
        while let Ok(msg) = rx.recv() {
            let r = (|| {
                s.write_all(format!("{msg}\n").as_bytes())?;
                let mut echo = String::new();
                reader.read_line(&mut echo)?;
                Ok::<_, std::io::Error>(echo.trim().to_string())
            })();
            done_tx.send(r.map_err(|e| e.to_string())).unwrap();
        }
    });
    let established_on = pod_rx.recv_timeout(TIMEOUT).unwrap();
    let dropped = lab
        .backends
        .iter()
        .find(|p| p.name != established_on)
        .unwrap();
    let (dropped_name, dropped_ip) = (dropped.name.clone(), dropped.ip);
    let keep: Vec<Ipv4Addr> = lab
        .backends
        .iter()
        .map(|p| p.ip)
        .filter(|ip| *ip != dropped_ip)
        .collect();

    let edited = Instant::now();
    lab.write_manifests(&manifest(&keep)).unwrap();
    // Connections opened from 1 s after the edit must never reach the dropped pod.
    std::thread::sleep(Duration::from_secs(1).saturating_sub(edited.elapsed()));
    let after = spread(&lab, false, 60);
    assert!(
        !after.contains_key(&dropped_name),
        "{dropped_name} still got new connections 1 s after it was dropped: {after:?}"
    );
    assert_eq!(after.len(), 2, "{after:?}");
    // The established connection still works, both ways.
    tx.send("still-there").unwrap();
    let echo = done_rx.recv_timeout(TIMEOUT).unwrap();
    assert_eq!(
        echo,
        Ok("still-there".to_string()),
        "established connection broke"
    );
    drop(tx);
    conn.join().unwrap().unwrap();
}

fn attach_path(mode: &str) {
    let mut lab = lab_with_agent(Checksums::Offloaded, &["--tc-attach", mode]);
    let log = lab.agent().unwrap().log_text();
    let expected = if mode == "tcx" {
        "mode=Tcx"
    } else {
        "mode=Netlink"
    };
    assert!(log.contains(expected), "{log}");
    if mode == "netlink" {
        let filters = lab
            .node
            .exec("tc", &["filter", "show", "dev", "lxc0", "ingress"])
            .unwrap();
        assert!(filters.contains("proxy_ingress"), "no tc filter: {filters}");
    }
    // 300 (the issue asks for at least 150) keeps a fair spread from leaving 20-47 % by
    // chance (below 1e-6 per backend).
    let n = 300;
    assert_spread(&spread(&lab, false, n), n, &format!("TCP via {mode}"));
}

#[test]
fn tcx_attach_carries_traffic() {
    require_kernel!();
    attach_path("tcx");
}

#[test]
fn netlink_attach_carries_traffic() {
    require_kernel!();
    attach_path("netlink");
}

#[test]
fn interface_created_after_start_is_served_also_when_recreated() {
    require_kernel!();
    let mut lab = lab_with_agent(Checksums::Offloaded, &[]);
    for round in 0..2 {
        let ip = Ipv4Addr::new(10, 244, 0, 50);
        lab.add_pod_later("late", ip, 9).unwrap();
        let attached_before = round; // lines for lxc9 already in the log
        lab.agent()
            .unwrap()
            .wait_for_log(|log| log.matches("attached interface=lxc9").count() > attached_before)
            .unwrap();
        let pod = lab.extra_pods.last().unwrap();
        let answer = pod
            .ns
            .run(|| client::tcp_hello(WEB, TIMEOUT))
            .unwrap()
            .unwrap_or_else(|e| panic!("round {round}: late pod not served: {e}"));
        assert!(answer.starts_with("pod"), "{answer}");
        lab.remove_extra_pod("late");
    }
}
