//! A TCP frontend: accepts clients, connects each to the endpoint its balancer picks, and
//! relays between them until either side closes or the endpoint is gone.

use std::{
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tracing::debug;

use super::{
    balancer::{abort, endpoint_gone, Balancer},
    sockets, Sources,
};

/// How long connecting to an endpoint may take before another is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Endpoints tried for one client before it is reset (kube-proxy's userspace mode tried
/// a few as well).
const CONNECT_ATTEMPTS: usize = 3;

pub async fn serve(listener: TcpListener, balancer: Arc<Balancer>, sources: Sources) {
    loop {
        match listener.accept().await {
            Ok((client, peer)) => {
                tokio::spawn(connection(client, peer, balancer.clone(), sources.clone()));
            }
            Err(e) => {
                // Out of descriptors, or a client gone before accept: wait, go on.
                debug!("accept on {:?}: {e}", listener.local_addr());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Ends a connection with a reset, as a kernel datapath would for a flow it cannot serve.
fn reset(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

async fn connect(endpoint: SocketAddr, sources: &Sources) -> std::io::Result<TcpStream> {
    let socket = sockets::upstream(endpoint, sources.for_endpoint(endpoint), true)?;
    let socket = TcpSocket::from_std_stream(socket.into());
    tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(endpoint))
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

async fn connection(
    client: TcpStream,
    peer: SocketAddr,
    balancer: Arc<Balancer>,
    sources: Sources,
) {
    let mut live = balancer.watch_live();
    let mut upstream = None;
    for _ in 0..CONNECT_ATTEMPTS {
        let Some(endpoint) = balancer.pick(peer.ip(), Instant::now()) else {
            break;
        };
        match connect(endpoint, &sources).await {
            Ok(stream) => {
                upstream = Some((stream, endpoint));
                break;
            }
            Err(e) => {
                debug!(%peer, %endpoint, "connecting to the endpoint: {e}");
                balancer.unstick(peer.ip(), endpoint);
            }
        }
    }
    let Some((upstream, endpoint)) = upstream else {
        reset(&client);
        return;
    };
    let (client, upstream) = (Arc::new(client), Arc::new(upstream));
    let _registered = balancer.register(endpoint, client.clone(), upstream.clone());
    // Gone while connecting: the sync that removed it did not see this connection.
    if !balancer.is_live(endpoint) {
        abort(&client);
        abort(&upstream);
        return;
    }
    balancer.count(endpoint, 1, 0);
    tokio::select! {
        outcome = super::splice::relay(&client, &upstream) => match outcome {
            Ok((sent, received)) => balancer.count(endpoint, 0, sent + received),
            Err(e) => {
                // One side reset or failed: the other learns it the same way.
                debug!(%peer, %endpoint, "relay ended: {e}");
                reset(&client);
                reset(&upstream);
            }
        },
        () = endpoint_gone(&mut live, endpoint) => {
            reset(&client);
            reset(&upstream);
        }
    }
}
