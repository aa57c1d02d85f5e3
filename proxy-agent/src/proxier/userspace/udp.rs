//! A UDP frontend: one session per client address, each with its own socket connected to
//! the endpoint picked for it; replies go back from the frontend's socket, so the client
//! sees the service address. A session ends after `idle` without traffic, or when its
//! endpoint is gone (the next datagram picks again).

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::net::UdpSocket;
use tracing::debug;

use super::{
    balancer::{endpoint_gone, Balancer},
    sockets, Sources,
};

/// The largest datagram (a whole reassembled IPv4 or IPv6 one).
const MAX_DATAGRAM: usize = 65_536;

struct Session {
    endpoint: SocketAddr,
    upstream: Arc<UdpSocket>,
    last_from_client: Mutex<Instant>,
}

type Sessions = Arc<Mutex<HashMap<SocketAddr, Arc<Session>>>>;

pub async fn serve(socket: UdpSocket, balancer: Arc<Balancer>, sources: Sources, idle: Duration) {
    let socket = Arc::new(socket);
    let sessions: Sessions = Arc::default();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let (n, client) = match socket.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                debug!("receiving on {:?}: {e}", socket.local_addr());
                continue;
            }
        };
        let existing = sessions
            .lock()
            .expect("not poisoned")
            .get(&client)
            .filter(|s| balancer.is_live(s.endpoint))
            .cloned();
        let session = match existing {
            Some(s) => s,
            None => match open(&socket, &sessions, client, &balancer, &sources, idle) {
                Some(s) => s,
                None => continue,
            },
        };
        *session.last_from_client.lock().expect("not poisoned") = Instant::now();
        if let Err(e) = session.upstream.send(&buf[..n]).await {
            debug!(%client, "forwarding a datagram: {e}");
        }
    }
}

fn open(
    socket: &Arc<UdpSocket>,
    sessions: &Sessions,
    client: SocketAddr,
    balancer: &Arc<Balancer>,
    sources: &Sources,
    idle: Duration,
) -> Option<Arc<Session>> {
    let endpoint = balancer.pick(client.ip(), Instant::now())?;
    let upstream =
        sockets::upstream(endpoint, sources.for_endpoint(endpoint), false).and_then(|s| {
            s.connect(&endpoint.into())?;
            UdpSocket::from_std(s.into())
        });
    let upstream = match upstream {
        Ok(u) => Arc::new(u),
        Err(e) => {
            debug!(%client, %endpoint, "opening a UDP session: {e}");
            return None;
        }
    };
    let session = Arc::new(Session {
        endpoint,
        upstream,
        last_from_client: Mutex::new(Instant::now()),
    });
    sessions
        .lock()
        .expect("not poisoned")
        .insert(client, session.clone());
    tokio::spawn(replies(
        socket.clone(),
        sessions.clone(),
        session.clone(),
        client,
        endpoint,
        balancer.watch_live(),
        idle,
    ));
    Some(session)
}

/// Sends the endpoint's replies to the client until the session ends, then forgets it.
async fn replies(
    socket: Arc<UdpSocket>,
    sessions: Sessions,
    session: Arc<Session>,
    client: SocketAddr,
    endpoint: SocketAddr,
    mut live: tokio::sync::watch::Receiver<Arc<std::collections::BTreeSet<SocketAddr>>>,
    idle: Duration,
) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut last_reply = Instant::now();
    loop {
        let since_client = session
            .last_from_client
            .lock()
            .expect("not poisoned")
            .elapsed();
        let quiet = since_client.min(last_reply.elapsed());
        let Some(wait) = idle.checked_sub(quiet).filter(|w| !w.is_zero()) else {
            break;
        };
        tokio::select! {
            received = tokio::time::timeout(wait, session.upstream.recv(&mut buf)) => match received {
                Ok(Ok(n)) => {
                    last_reply = Instant::now();
                    if let Err(e) = socket.send_to(&buf[..n], client).await {
                        debug!(%client, "returning a datagram: {e}");
                    }
                }
                // The endpoint's port is closed (ICMP): the client's datagrams are lost
                // as they would be without us.
                Ok(Err(e)) => debug!(%client, %endpoint, "UDP session: {e}"),
                Err(_) => {}
            },
            () = endpoint_gone(&mut live, endpoint) => break,
        }
    }
    let mut all = sessions.lock().expect("not poisoned");
    if all.get(&client).is_some_and(|s| Arc::ptr_eq(s, &session)) {
        all.remove(&client);
    }
}
