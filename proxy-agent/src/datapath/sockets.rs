//! Ending the node's own connected UDP sockets whose backend left their Service.
//!
//! The socket hooks connect a UDP socket of the node's processes (a resolver's) straight to
//! a backend, so no later packet meets the datapath's frontend: when that backend leaves the
//! Service (the pod may live on), nothing would move the socket. As kube-proxy ends stale
//! UDP conntrack entries (kubernetes#59368), the agent ends such sockets after the sync that
//! removed the backend, with sock_diag's SOCK_DESTROY (`ss -K`): the process sees
//! ECONNABORTED and makes a new socket, which the hooks give a live backend. Only sockets
//! the hooks translated from that very frontend are ended (their `SOCK_REVNAT` entry says
//! so); a socket connected to the pod's address by itself is left alone. Pods' connected
//! UDP sockets are not translated by the hooks (the tc path serves them, and re-steers), and
//! sock_diag sees only the agent's network namespace, the node's.
//!
//! A kernel built without `CONFIG_INET_DIAG_DESTROY` refuses SOCK_DESTROY; that is logged
//! once, and such sockets keep their backend until they close.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use anyhow::{bail, Context, Result};
use aya::maps::{HashMap, Map, MapData};
use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_sock_diag::{
    constants::{AF_INET, AF_INET6, IPPROTO_UDP},
    inet::{ExtensionFlags, InetRequest, InetResponse, SocketId, StateFlags},
    SockDiagDestroy, SockDiagMessage,
};
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket, SocketAddr as NetlinkAddr};
use proxy_common::{map_names, SockRevNatKey, SockRevNatKey6, SockRevNatValue, SockRevNatValue6};
use tracing::{debug, warn};

use super::Datapath;
use crate::{
    model::{Protocol, StaleFlow},
    proxier::FlowCleaner,
};

/// Ends the node's connected UDP sockets the hooks gave a backend that left.
pub struct SocketCleaner {
    revnat: HashMap<MapData, SockRevNatKey, SockRevNatValue>,
    revnat6: HashMap<MapData, SockRevNatKey6, SockRevNatValue6>,
    /// Set once the kernel refused SOCK_DESTROY (said once).
    unsupported: bool,
}

impl SocketCleaner {
    pub fn new(datapath: &Datapath) -> Result<Self> {
        let handle = |name: &str| -> Result<Map> {
            match datapath.ebpf.map(name) {
                Some(Map::LruHashMap(data)) => Ok(Map::LruHashMap(super::duplicate(data)?)),
                _ => bail!("eBPF object has no LRU hash map {name}"),
            }
        };
        Ok(SocketCleaner {
            revnat: HashMap::try_from(handle(map_names::SOCK_REVNAT)?)?,
            revnat6: HashMap::try_from(handle(map_names::SOCK_REVNAT6)?)?,
            unsupported: false,
        })
    }

    /// Whether the hooks gave socket `cookie` the backend `to` (the socket's peer, as
    /// sock_diag reports it) for frontend `frontend`.
    fn translated(&self, cookie: u64, to: SocketAddr, frontend: SocketAddr) -> bool {
        match to {
            SocketAddr::V4(to) => {
                let key = SockRevNatKey {
                    cookie,
                    addr: u32::from_ne_bytes(to.ip().octets()),
                    port: to.port().to_be(),
                    _pad0: [0; 2],
                };
                self.revnat.get(&key, 0).is_ok_and(|v| {
                    SocketAddr::new(
                        Ipv4Addr::from(v.addr.to_ne_bytes()).into(),
                        u16::from_be(v.port),
                    ) == frontend
                })
            }
            SocketAddr::V6(to) => {
                let key = SockRevNatKey6 {
                    cookie,
                    addr: to.ip().octets(),
                    port: to.port().to_be(),
                    _pad0: [0; 6],
                };
                self.revnat6.get(&key, 0).is_ok_and(|v| {
                    unmapped(SocketAddr::new(
                        Ipv6Addr::from(v.addr).into(),
                        u16::from_be(v.port),
                    )) == frontend
                })
            }
        }
    }
}

impl FlowCleaner for SocketCleaner {
    fn delete(&mut self, flows: &[StaleFlow]) -> Result<usize> {
        let gone: Vec<(SocketAddr, SocketAddr)> = flows
            .iter()
            .filter(|f| f.frontend.protocol == Protocol::Udp)
            .filter_map(|f| {
                let frontend = SocketAddr::new(f.frontend.addr, f.frontend.port);
                Some((f.endpoint?, frontend))
            })
            .collect();
        if gone.is_empty() || self.unsupported {
            return Ok(0);
        }
        let mut ended = 0;
        let diag = diag_socket().context("opening a sock_diag socket")?;
        // IPv4 services are also reached from dual-stack IPv6 sockets (::ffff:a.b.c.d).
        let families: &[u8] = if gone.iter().any(|(endpoint, _)| endpoint.is_ipv4()) {
            &[AF_INET, AF_INET6]
        } else {
            &[AF_INET6]
        };
        for &family in families {
            for socket in udp_sockets(&diag, family)? {
                let id = &socket.header.socket_id;
                let peer = SocketAddr::new(id.destination_address, id.destination_port);
                let cookie = u64::from_ne_bytes(id.cookie);
                let Some((_, frontend)) = gone
                    .iter()
                    .find(|(endpoint, _)| *endpoint == unmapped(peer))
                else {
                    continue;
                };
                if !self.translated(cookie, peer, *frontend) {
                    continue;
                }
                match destroy(&diag, family, id.clone()) {
                    Ok(()) => {
                        debug!(%peer, %frontend, "ended a connected UDP socket whose backend left");
                        ended += 1;
                    }
                    Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                        warn!(
                            "this kernel cannot end sockets (CONFIG_INET_DIAG_DESTROY): the node's own connected UDP sockets keep a backend that left their Service until they close"
                        );
                        self.unsupported = true;
                        return Ok(ended);
                    }
                    // Closed meanwhile.
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                    Err(e) => return Err(e).context("ending a UDP socket (SOCK_DESTROY)"),
                }
            }
        }
        Ok(ended)
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it maps.
fn unmapped(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(v4.into(), addr.port()),
            None => addr,
        },
        IpAddr::V4(_) => addr,
    }
}

fn diag_socket() -> std::io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.bind_auto()?;
    socket.connect(&NetlinkAddr::new(0, 0))?;
    Ok(socket)
}

fn send<T: netlink_packet_core::NetlinkSerializable>(
    socket: &Socket,
    mut message: NetlinkMessage<T>,
) -> std::io::Result<()> {
    message.finalize();
    let mut buf = vec![0; message.buffer_len()];
    message.serialize(&mut buf);
    socket.send(&buf, 0)?;
    Ok(())
}

/// The connected UDP sockets of `family` in this network namespace.
fn udp_sockets(socket: &Socket, family: u8) -> Result<Vec<InetResponse>> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let request = SockDiagMessage::InetRequest(InetRequest {
        family,
        protocol: IPPROTO_UDP,
        extensions: ExtensionFlags::empty(),
        // A connected UDP socket is in state ESTABLISHED; the others have no backend.
        states: StateFlags::ESTABLISHED,
        socket_id: if family == AF_INET {
            SocketId::new_v4()
        } else {
            SocketId::new_v6()
        },
    });
    send(socket, NetlinkMessage::new(header, request.into()))?;
    let mut found = Vec::new();
    let mut buf = vec![0u8; 65536];
    loop {
        let size = socket.recv(&mut &mut buf[..], 0)?;
        let mut offset = 0;
        while offset < size {
            let message = <NetlinkMessage<SockDiagMessage>>::deserialize(&buf[offset..size])
                .context("parsing a sock_diag answer")?;
            let length = message.header.length as usize;
            match message.payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => found.push(*r),
                NetlinkPayload::Done(_) => return Ok(found),
                NetlinkPayload::Error(e) => bail!("sock_diag dump: {e}"),
                _ => {}
            }
            if length == 0 {
                break;
            }
            offset += length;
        }
    }
}

/// SOCK_DESTROY for the socket `id` names (its cookie included).
fn destroy(socket: &Socket, family: u8, socket_id: SocketId) -> std::io::Result<()> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_ACK;
    let request = SockDiagDestroy::new(SockDiagMessage::InetRequest(InetRequest {
        family,
        protocol: IPPROTO_UDP,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::all(),
        socket_id,
    }));
    send(socket, NetlinkMessage::new(header, request.into()))?;
    let mut buf = vec![0u8; 4096];
    let size = socket.recv(&mut &mut buf[..], 0)?;
    let message = <NetlinkMessage<SockDiagDestroy>>::deserialize(&buf[..size])
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    match message.payload {
        NetlinkPayload::Error(e) => match e.code {
            None => Ok(()),
            Some(code) => Err(std::io::Error::from_raw_os_error(-code.get())),
        },
        _ => Ok(()),
    }
}
