//! Service addresses made local to the node with routes of type `local` on `lo` (in the
//! kernel's `local` table), so packets to them are delivered to this node's sockets: how the
//! userspace proxier receives its traffic (and the ipvs one where there is no dummy
//! driver). Routes carry this agent's own protocol number, so the agent finds and removes
//! exactly its own ones (`ip route show table local proto 201`).
//!
//! Requests go over a blocking rtnetlink socket with messages built by
//! `netlink-packet-route`: the proxiers sync from synchronous code.

use std::{collections::BTreeSet, net::IpAddr};

use anyhow::{anyhow, bail, Context, Result};
use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP,
    NLM_F_REPLACE, NLM_F_REQUEST,
};
use netlink_packet_route::{
    route::{
        RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope,
        RouteType,
    },
    AddressFamily, RouteNetlinkMessage,
};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr as NetlinkAddr};

/// The routing protocol number that marks this agent's routes (`proto 201`).
pub const ROUTE_PROTOCOL: u8 = 201;
const RT_TABLE_LOCAL: u8 = 255;

/// The node's local routes for service addresses.
pub trait LocalRoutes: Send {
    /// Makes `addr` local (idempotent).
    fn add(&mut self, addr: IpAddr) -> Result<()>;
    /// Stops `addr` being local (absent is not an error).
    fn remove(&mut self, addr: IpAddr) -> Result<()>;
    /// Every address this agent made local.
    fn list(&mut self) -> Result<BTreeSet<IpAddr>>;
}

/// The kernel's routes, over rtnetlink.
pub struct KernelLocalRoutes {
    socket: Socket,
    seq: u32,
    loopback: u32,
}

impl KernelLocalRoutes {
    pub fn open() -> Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE).context("opening an rtnetlink socket")?;
        socket.bind_auto().context("binding the rtnetlink socket")?;
        socket
            .connect(&NetlinkAddr::new(0, 0))
            .context("connecting the rtnetlink socket")?;
        // SAFETY: a NUL-terminated name; the call only reads it.
        let loopback = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
        if loopback == 0 {
            bail!("this network namespace has no loopback interface \"lo\"");
        }
        Ok(KernelLocalRoutes {
            socket,
            seq: 0,
            loopback,
        })
    }

    fn route(&self, addr: IpAddr) -> RouteMessage {
        let mut msg = RouteMessage::default();
        msg.header.address_family = match addr {
            IpAddr::V4(_) => AddressFamily::Inet,
            IpAddr::V6(_) => AddressFamily::Inet6,
        };
        msg.header.destination_prefix_length = if addr.is_ipv4() { 32 } else { 128 };
        msg.header.table = RT_TABLE_LOCAL;
        msg.header.protocol = RouteProtocol::Other(ROUTE_PROTOCOL);
        msg.header.scope = RouteScope::Host;
        msg.header.kind = RouteType::Local;
        msg.attributes.push(RouteAttribute::Destination(match addr {
            IpAddr::V4(a) => RouteAddress::Inet(a),
            IpAddr::V6(a) => RouteAddress::Inet6(a),
        }));
        msg.attributes.push(RouteAttribute::Oif(self.loopback));
        msg
    }

    /// Sends `message` and collects the replies until the ack or the end of the dump.
    fn request(&mut self, message: RouteNetlinkMessage, flags: u16) -> Result<Vec<RouteMessage>> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(message));
        packet.finalize();
        let mut buf = vec![0u8; packet.buffer_len()];
        packet.serialize(&mut buf);
        self.socket
            .send(&buf, 0)
            .context("sending an rtnetlink request")?;
        let mut routes = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = self
                .socket
                .recv(&mut &mut buf[..], 0)
                .context("reading from rtnetlink")?;
            let mut offset = 0;
            while offset < n {
                let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[offset..n])
                    .map_err(|e| anyhow!("malformed rtnetlink reply: {e}"))?;
                let length = reply.header.length as usize;
                if length == 0 {
                    bail!("malformed rtnetlink reply: zero length");
                }
                offset += length.next_multiple_of(4);
                if reply.header.sequence_number != self.seq {
                    continue;
                }
                match reply.payload {
                    NetlinkPayload::Done(_) => return Ok(routes),
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(routes),
                            Some(code) => {
                                Err(std::io::Error::from_raw_os_error(-code.get()).into())
                            }
                        }
                    }
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(route)) => {
                        routes.push(route)
                    }
                    _ => {}
                }
            }
        }
    }
}

impl LocalRoutes for KernelLocalRoutes {
    fn add(&mut self, addr: IpAddr) -> Result<()> {
        let route = self.route(addr);
        self.request(
            RouteNetlinkMessage::NewRoute(route),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        )
        .with_context(|| format!("adding the local route for {addr} on lo"))?;
        Ok(())
    }

    fn remove(&mut self, addr: IpAddr) -> Result<()> {
        let route = self.route(addr);
        match self.request(RouteNetlinkMessage::DelRoute(route), NLM_F_ACK) {
            Ok(_) => Ok(()),
            Err(e)
                if e.downcast_ref::<std::io::Error>()
                    .and_then(|e| e.raw_os_error())
                    == Some(libc::ESRCH) =>
            {
                Ok(())
            }
            Err(e) => Err(e.context(format!("removing the local route for {addr}"))),
        }
    }

    fn list(&mut self) -> Result<BTreeSet<IpAddr>> {
        let mut found = BTreeSet::new();
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut query = RouteMessage::default();
            query.header.address_family = family;
            query.header.table = RouteHeader::RT_TABLE_UNSPEC;
            let routes = self
                .request(RouteNetlinkMessage::GetRoute(query), NLM_F_DUMP)
                .context("listing routes")?;
            for route in routes {
                if route.header.table != RT_TABLE_LOCAL
                    || route.header.protocol != RouteProtocol::Other(ROUTE_PROTOCOL)
                {
                    continue;
                }
                for attr in &route.attributes {
                    match attr {
                        RouteAttribute::Destination(RouteAddress::Inet(a)) => {
                            found.insert(IpAddr::V4(*a));
                        }
                        RouteAttribute::Destination(RouteAddress::Inet6(a)) => {
                            found.insert(IpAddr::V6(*a));
                        }
                        _ => {}
                    }
                }
            }
        }
        Ok(found)
    }
}

/// Local routes kept in memory (tests).
#[derive(Clone, Default)]
pub struct MemoryLocalRoutes(pub std::sync::Arc<std::sync::Mutex<BTreeSet<IpAddr>>>);

impl LocalRoutes for MemoryLocalRoutes {
    fn add(&mut self, addr: IpAddr) -> Result<()> {
        self.0.lock().expect("not poisoned").insert(addr);
        Ok(())
    }

    fn remove(&mut self, addr: IpAddr) -> Result<()> {
        self.0.lock().expect("not poisoned").remove(&addr);
        Ok(())
    }

    fn list(&mut self) -> Result<BTreeSet<IpAddr>> {
        Ok(self.0.lock().expect("not poisoned").clone())
    }
}

/// Removes every local route this agent made (another mode starting, or `--cleanup`);
/// returns how many there were.
pub fn remove_all() -> Result<usize> {
    let mut routes = KernelLocalRoutes::open()?;
    let ours = routes.list()?;
    for addr in &ours {
        routes.remove(*addr)?;
    }
    Ok(ours.len())
}
