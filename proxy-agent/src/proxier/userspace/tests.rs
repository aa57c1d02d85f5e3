//! The userspace proxier with real sockets on loopback (every 127.0.0.0/8 address is local,
//! so "service addresses" need no route here; the routes go to an in-memory table).

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream, UdpSocket},
};

use super::*;
use crate::{
    kernel::local_routes::MemoryLocalRoutes,
    model::{
        Cidr, DesiredState, FrontendKind, FrontendState, ServiceChange, ServicePortState, WhenEmpty,
    },
};

/// A TCP endpoint that answers each connection with its name, then echoes.
async fn tcp_endpoint(ip: &str, name: &'static str) -> SocketAddr {
    let listener = TcpListener::bind((ip.parse::<IpAddr>().unwrap(), 0))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                s.write_all(format!("{name}\n").as_bytes()).await.unwrap();
                let mut buf = [0u8; 1024];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// A UDP endpoint that answers each datagram with its name.
async fn udp_endpoint(ip: &str, name: &'static str) -> SocketAddr {
    let socket = UdpSocket::bind((ip.parse::<IpAddr>().unwrap(), 0))
        .await
        .unwrap();
    let addr = socket.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 2048];
        loop {
            let (_, from) = socket.recv_from(&mut buf).await.unwrap();
            socket.send_to(name.as_bytes(), from).await.unwrap();
        }
    });
    addr
}

fn port(
    ns: &str,
    vip: &str,
    port: u16,
    protocol: Protocol,
    backends: Vec<SocketAddr>,
) -> ServicePortState {
    let mut s = ServicePortState::cluster_ip(ns, "svc", "p", vip.parse().unwrap(), backends);
    s.frontend.port = port;
    s.frontend.protocol = protocol;
    s.name.protocol = protocol;
    s
}

fn state(ports: &[ServicePortState]) -> DesiredState {
    DesiredState {
        ports: ports
            .iter()
            .map(|p| (p.name.clone(), Arc::new(p.clone())))
            .collect::<BTreeMap<_, _>>(),
    }
}

/// Syncs `proxier` from `old` to `new` the way the agent does.
fn sync(proxier: &mut UserspaceProxier, old: &DesiredState, new: &DesiredState) -> SyncReport {
    let changes: Vec<ServiceChange> = crate::model::diff(old, new);
    proxier.sync(new, &changes).unwrap()
}

fn proxier() -> (UserspaceProxier, MemoryLocalRoutes) {
    let routes = MemoryLocalRoutes::default();
    (
        UserspaceProxier::new(Box::new(routes.clone()), Duration::from_millis(300)),
        routes,
    )
}

async fn hello(to: SocketAddr) -> std::io::Result<String> {
    let mut s = TcpStream::connect(to).await?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        let n = s.read(&mut byte).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if byte[0] == b'\n' {
            return Ok(String::from_utf8(line).unwrap());
        }
        line.push(byte[0]);
    }
}

#[tokio::test]
async fn tcp_flows_go_round_robin_and_a_port_without_endpoints_refuses() {
    let a = tcp_endpoint("127.0.0.2", "a").await;
    let b = tcp_endpoint("127.0.0.3", "b").await;
    let (mut p, routes) = proxier();
    let svc = port("ns", "127.0.10.1", 18080, Protocol::Tcp, vec![a, b]);
    let one = state(&[svc]);
    sync(&mut p, &DesiredState::default(), &one);
    assert_eq!(
        routes.0.lock().unwrap().iter().copied().collect::<Vec<_>>(),
        vec!["127.0.10.1".parse::<IpAddr>().unwrap()],
        "the cluster IP is made local"
    );
    let vip: SocketAddr = "127.0.10.1:18080".parse().unwrap();
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(hello(vip).await.unwrap());
    }
    assert_eq!(seen, ["a", "b", "a", "b"]);

    // No endpoint: nothing listens, the kernel refuses.
    let empty = state(&[port("ns", "127.0.10.1", 18080, Protocol::Tcp, vec![])]);
    sync(&mut p, &one, &empty);
    tokio::task::yield_now().await;
    let e = hello(vip).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    // Endpoints again: served again on the same address.
    sync(&mut p, &empty, &one);
    assert!(hello(vip).await.is_ok());
    // The service gone: its route goes too.
    sync(&mut p, &one, &DesiredState::default());
    assert!(routes.0.lock().unwrap().is_empty());
    assert_eq!(p.programmed(), (0, 0));
}

#[tokio::test]
async fn client_ip_affinity_keeps_a_client_on_one_endpoint_until_the_timeout() {
    let a = tcp_endpoint("127.0.0.2", "a").await;
    let b = tcp_endpoint("127.0.0.3", "b").await;
    let (mut p, _) = proxier();
    let mut svc = port("ns", "127.0.10.2", 18081, Protocol::Tcp, vec![a, b]);
    svc.affinity_timeout = Some(1);
    sync(&mut p, &DesiredState::default(), &state(&[svc]));
    let vip: SocketAddr = "127.0.10.2:18081".parse().unwrap();
    let first = hello(vip).await.unwrap();
    for _ in 0..5 {
        assert_eq!(
            hello(vip).await.unwrap(),
            first,
            "sticky within the timeout"
        );
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // Expired: the next flow is a fresh round-robin choice, which moves on.
    assert_ne!(hello(vip).await.unwrap(), first);
}

#[tokio::test]
async fn source_ranges_reset_clients_outside_them() {
    let a = tcp_endpoint("127.0.0.2", "a").await;
    let (mut p, _) = proxier();
    let mut svc = port("ns", "127.0.10.3", 18082, Protocol::Tcp, vec![a]);
    let lb = FrontendState {
        frontend: Frontend {
            addr: "127.0.10.4".parse().unwrap(),
            port: 18082,
            protocol: Protocol::Tcp,
        },
        kind: FrontendKind::LoadBalancer,
        backends: vec![a],
        draining: vec![],
        when_empty: WhenEmpty::Refuse,
        source_ranges: vec![Cidr {
            addr: "127.0.0.99".parse().unwrap(),
            prefix: 32,
        }],
        masquerade: true,
        masquerade_all: false,
        in_cluster: None,
    };
    svc.external.push(lb);
    sync(&mut p, &DesiredState::default(), &state(&[svc]));
    // Connecting from 127.0.0.1 (outside): reset; the cluster IP has no ranges.
    assert!(hello("127.0.10.4:18082".parse().unwrap()).await.is_err());
    assert_eq!(
        hello("127.0.10.3:18082".parse().unwrap()).await.unwrap(),
        "a"
    );
    let inside = tokio::net::TcpSocket::new_v4().unwrap();
    inside.bind("127.0.0.99:0".parse().unwrap()).unwrap();
    let mut s = inside
        .connect("127.0.10.4:18082".parse().unwrap())
        .await
        .unwrap();
    let mut buf = [0u8; 2];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"a\n");
}

#[tokio::test]
async fn a_connection_lasts_while_its_endpoint_drains_and_ends_when_it_is_gone() {
    let a = tcp_endpoint("127.0.0.2", "a").await;
    let b = tcp_endpoint("127.0.0.3", "b").await;
    let (mut p, _) = proxier();
    let serving = state(&[port("ns", "127.0.10.5", 18083, Protocol::Tcp, vec![a])]);
    sync(&mut p, &DesiredState::default(), &serving);
    let mut s = TcpStream::connect("127.0.10.5:18083").await.unwrap();
    let mut buf = [0u8; 2];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"a\n");

    let mut draining_port = port("ns", "127.0.10.5", 18083, Protocol::Tcp, vec![b]);
    draining_port.draining = vec![a];
    let draining = state(&[draining_port]);
    sync(&mut p, &serving, &draining);
    s.write_all(b"hi").await.unwrap();
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"hi", "the draining endpoint still answers");

    let gone = state(&[port("ns", "127.0.10.5", 18083, Protocol::Tcp, vec![b])]);
    sync(&mut p, &draining, &gone);
    // Reset by the sync itself: the reset is there before the relay task runs again.
    let mut error = None;
    for _ in 0..2 {
        let write = s.write_all(b"hi").await;
        let read = s.read(&mut buf).await;
        error = write.err().or(read.err());
        if error.is_some() {
            break;
        }
    }
    assert_eq!(
        error.map(|e| e.kind()),
        Some(std::io::ErrorKind::ConnectionReset)
    );
}

#[tokio::test]
async fn udp_sessions_answer_from_the_service_address_and_move_when_the_endpoint_goes() {
    let a = udp_endpoint("127.0.0.2", "a").await;
    let b = udp_endpoint("127.0.0.3", "b").await;
    let (mut p, _) = proxier();
    let first = state(&[port("ns", "127.0.10.6", 18053, Protocol::Udp, vec![a])]);
    sync(&mut p, &DesiredState::default(), &first);
    let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let vip: SocketAddr = "127.0.10.6:18053".parse().unwrap();
    let mut buf = [0u8; 64];
    let mut ask = async |client: &UdpSocket| {
        client.send_to(b"?", vip).await.unwrap();
        let (n, from) = tokio::time::timeout(Duration::from_secs(2), client.recv_from(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        (String::from_utf8_lossy(&buf[..n]).to_string(), from)
    };
    let (who, from) = ask(&client).await;
    assert_eq!(
        (who.as_str(), from),
        ("a", vip),
        "answered from the service address"
    );
    let second = state(&[port("ns", "127.0.10.6", 18053, Protocol::Udp, vec![b])]);
    sync(&mut p, &first, &second);
    tokio::task::yield_now().await;
    assert_eq!(
        ask(&client).await.0,
        "b",
        "the session moved to the live endpoint"
    );
}

#[tokio::test]
async fn a_frontend_that_cannot_be_bound_is_reported_and_the_others_are_served() {
    let a = tcp_endpoint("127.0.0.2", "a").await;
    let taken = std::net::TcpListener::bind("127.0.10.7:18084").unwrap();
    let (mut p, _) = proxier();
    let bad = port("ns", "127.0.10.7", 18084, Protocol::Tcp, vec![a]);
    let mut good = port("ns", "127.0.10.8", 18084, Protocol::Tcp, vec![a]);
    good.name.service.name = "other".into();
    let both = state(&[bad, good]);
    let report = sync(&mut p, &DesiredState::default(), &both);
    assert_eq!(report.services_failed, 1);
    assert_eq!(
        hello("127.0.10.8:18084".parse().unwrap()).await.unwrap(),
        "a"
    );
    // Freed: the next sync, even with no change, tries it again.
    drop(taken);
    let again = p.sync(&both, &[]).unwrap();
    assert_eq!(again.services_failed, 0);
    assert_eq!(
        hello("127.0.10.7:18084".parse().unwrap()).await.unwrap(),
        "a"
    );
}

/// Every client address costs a session (a socket, a task, a buffer): a flood from many
/// sources is held to the caps. Over its own cap a frontend gives up its least recently
/// active session; at the total, a frontend with no sessions of its own gets none rather
/// than closing another frontend's.
#[tokio::test]
async fn udp_sessions_are_capped_and_the_least_recently_active_goes_first() {
    let a = udp_endpoint("127.0.0.2", "a").await;
    // Sessions that never idle out during the test.
    let mut p = UserspaceProxier::new(
        Box::new(MemoryLocalRoutes::default()),
        Duration::from_secs(60),
    )
    .with_udp_caps(3, 4);
    let mut other = port("ns", "127.0.10.11", 18053, Protocol::Udp, vec![a]);
    other.name.service.name = "other".into();
    let mut third = port("ns", "127.0.10.12", 18053, Protocol::Udp, vec![a]);
    third.name.service.name = "third".into();
    let both = state(&[
        port("ns", "127.0.10.10", 18053, Protocol::Udp, vec![a]),
        other,
        third,
    ]);
    sync(&mut p, &DesiredState::default(), &both);
    let flooded: SocketAddr = "127.0.10.10:18053".parse().unwrap();
    let quiet: SocketAddr = "127.0.10.11:18053".parse().unwrap();
    async fn ask(client: &UdpSocket, vip: SocketAddr) -> bool {
        client.send_to(b"?", vip).await.unwrap();
        let mut buf = [0u8; 16];
        tokio::time::timeout(Duration::from_millis(500), client.recv_from(&mut buf))
            .await
            .is_ok()
    }
    let mut clients = Vec::new();
    for _ in 0..3 {
        let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        assert!(ask(&c, flooded).await);
        clients.push(c);
    }
    assert_eq!(p.udp_sessions().open(), 3);
    // The first client speaks again, so the second is now the least recently active.
    assert!(ask(&clients[0], flooded).await);
    let fourth = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    assert!(ask(&fourth, flooded).await, "a new client gets a session");
    assert_eq!(p.udp_sessions().open(), 3, "held to the frontend's cap");
    assert_eq!(p.udp_sessions().evicted(), 1);
    // The other frontend is unaffected and takes the last place of the total.
    let q = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    assert!(ask(&q, quiet).await);
    assert_eq!(p.udp_sessions().open(), 4);
    // At the total, the flooded frontend evicts its own, never the other's.
    for _ in 0..5 {
        let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        assert!(ask(&c, flooded).await);
    }
    assert_eq!(p.udp_sessions().open(), 4);
    assert!(
        ask(&q, quiet).await,
        "the other frontend's session survived"
    );
    assert_eq!(p.udp_sessions().refused(), 0);
    // A frontend with no session of its own gets none while the total is reached.
    let t = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    assert!(!ask(&t, "127.0.10.12:18053".parse().unwrap()).await);
    assert_eq!(p.udp_sessions().refused(), 1);
    assert_eq!(p.udp_sessions().limit(), 4);
}
