//! Service addresses made local to the node with routes of type `local` on `lo` (in the
//! kernel's `local` table), so packets to them are delivered to this node's sockets: how the
//! userspace proxier receives its traffic (and the ipvs one where there is no dummy
//! driver; see [`DummyAddresses`] for where it has one). Routes carry this agent's own protocol number, so the agent finds and removes
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
    address::{AddressAttribute, AddressFlags, AddressMessage},
    link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage},
    route::{
        RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope,
        RouteType,
    },
    AddressFamily, RouteNetlinkMessage,
};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr as NetlinkAddr};

use crate::kernel::nlattr::errno;

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
        let socket = rtnetlink_socket()?;
        // SAFETY: a NUL-terminated name; the call only reads it.
        let loopback = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
        if loopback == 0 {
            bail!("this network namespace has no loopback interface \"lo\"");
        }
        Ok(KernelLocalRoutes {
            socket,
            seq: initial_seq(),
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

    fn request(&mut self, message: RouteNetlinkMessage, flags: u16) -> Result<Vec<RouteMessage>> {
        Ok(
            rtnetlink_request(&self.socket, &mut self.seq, message, flags)?
                .into_iter()
                .filter_map(|m| match m {
                    RouteNetlinkMessage::NewRoute(route) => Some(route),
                    _ => None,
                })
                .collect(),
        )
    }
}

/// The first sequence number of a new rtnetlink socket: not 1, as every other socket's
/// is. The kernel's notifications of a change carry the requester's sequence number, and a
/// listener whose own request has the same one (the rtnetlink crate's link watch) can take
/// our notification for its reply.
fn initial_seq() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    nanos | 0x4000_0000
}

/// A bound and connected rtnetlink socket.
fn rtnetlink_socket() -> Result<Socket> {
    let mut socket = Socket::new(NETLINK_ROUTE).context("opening an rtnetlink socket")?;
    socket.bind_auto().context("binding the rtnetlink socket")?;
    socket
        .connect(&NetlinkAddr::new(0, 0))
        .context("connecting the rtnetlink socket")?;
    Ok(socket)
}

/// Sends `message` and collects the replies until the ack or the end of the dump.
fn rtnetlink_request(
    socket: &Socket,
    seq: &mut u32,
    message: RouteNetlinkMessage,
    flags: u16,
) -> Result<Vec<RouteNetlinkMessage>> {
    *seq = seq.wrapping_add(1);
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | flags;
    header.sequence_number = *seq;
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(message));
    packet.finalize();
    let mut buf = vec![0u8; packet.buffer_len()];
    packet.serialize(&mut buf);
    socket
        .send(&buf, 0)
        .context("sending an rtnetlink request")?;
    let mut replies = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = socket
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
            if reply.header.sequence_number != *seq {
                continue;
            }
            match reply.payload {
                NetlinkPayload::Done(_) => return Ok(replies),
                NetlinkPayload::Error(e) => {
                    return match e.code {
                        None => Ok(replies),
                        Some(code) => Err(std::io::Error::from_raw_os_error(-code.get()).into()),
                    }
                }
                NetlinkPayload::InnerMessage(m) => replies.push(m),
                _ => {}
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
            Err(e) if errno(&e) == Some(libc::ESRCH) => Ok(()),
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

/// The dummy interface kube-proxy's ipvs mode puts service addresses on.
pub const DUMMY_INTERFACE: &str = "kube-ipvs0";

/// Service addresses held by the dummy interface `kube-ipvs0` (kube-proxy's ipvs mode):
/// each a /32 or /128 on it, so the kernel adds its `local` route. The interface is
/// created on first use and kept up (an IPv6 address on an interface that is down gets no
/// local route); it answers nothing itself, being a dummy.
pub struct DummyAddresses {
    socket: Socket,
    seq: u32,
    index: u32,
}

fn interface_index(name: &str) -> u32 {
    let Ok(name) = std::ffi::CString::new(name) else {
        return 0;
    };
    // SAFETY: a NUL-terminated name; the call only reads it.
    unsafe { libc::if_nametoindex(name.as_ptr()) }
}

impl DummyAddresses {
    /// `kube-ipvs0`, created if missing. The error is an `EOPNOTSUPP` io error where the
    /// kernel has no dummy driver (callers fall back to [`KernelLocalRoutes`]).
    pub fn open() -> Result<Self> {
        let socket = rtnetlink_socket()?;
        let mut seq = initial_seq();
        if interface_index(DUMMY_INTERFACE) == 0 {
            let mut link = LinkMessage::default();
            link.attributes
                .push(LinkAttribute::IfName(DUMMY_INTERFACE.into()));
            link.attributes
                .push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(
                    InfoKind::Dummy,
                )]));
            rtnetlink_request(
                &socket,
                &mut seq,
                RouteNetlinkMessage::NewLink(link),
                NLM_F_ACK | NLM_F_CREATE,
            )
            .with_context(|| format!("creating the dummy interface {DUMMY_INTERFACE}"))?;
        }
        let index = interface_index(DUMMY_INTERFACE);
        if index == 0 {
            bail!("the dummy interface {DUMMY_INTERFACE} vanished after it was created");
        }
        let mut up = LinkMessage::default();
        up.header.index = index;
        up.header.flags = LinkFlags::Up;
        up.header.change_mask = LinkFlags::Up;
        rtnetlink_request(
            &socket,
            &mut seq,
            RouteNetlinkMessage::SetLink(up),
            NLM_F_ACK,
        )
        .with_context(|| format!("setting {DUMMY_INTERFACE} up"))?;
        Ok(DummyAddresses { socket, seq, index })
    }

    fn address(&self, addr: IpAddr) -> AddressMessage {
        let mut msg = AddressMessage::default();
        msg.header.family = match addr {
            IpAddr::V4(_) => AddressFamily::Inet,
            IpAddr::V6(_) => AddressFamily::Inet6,
        };
        msg.header.prefix_len = if addr.is_ipv4() { 32 } else { 128 };
        msg.header.index = self.index;
        msg.attributes.push(AddressAttribute::Local(addr));
        msg.attributes.push(AddressAttribute::Address(addr));
        if addr.is_ipv6() {
            // No duplicate address detection: the address is usable at once.
            msg.attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        msg
    }
}

impl LocalRoutes for DummyAddresses {
    fn add(&mut self, addr: IpAddr) -> Result<()> {
        let msg = self.address(addr);
        rtnetlink_request(
            &self.socket,
            &mut self.seq,
            RouteNetlinkMessage::NewAddress(msg),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        )
        .with_context(|| format!("adding {addr} to {DUMMY_INTERFACE}"))?;
        Ok(())
    }

    fn remove(&mut self, addr: IpAddr) -> Result<()> {
        let msg = self.address(addr);
        match rtnetlink_request(
            &self.socket,
            &mut self.seq,
            RouteNetlinkMessage::DelAddress(msg),
            NLM_F_ACK,
        ) {
            Ok(_) => Ok(()),
            Err(e) if matches!(errno(&e), Some(libc::EADDRNOTAVAIL | libc::ENODEV)) => Ok(()),
            Err(e) => Err(e.context(format!("removing {addr} from {DUMMY_INTERFACE}"))),
        }
    }

    fn list(&mut self) -> Result<BTreeSet<IpAddr>> {
        let replies = rtnetlink_request(
            &self.socket,
            &mut self.seq,
            RouteNetlinkMessage::GetAddress(AddressMessage::default()),
            NLM_F_DUMP,
        )
        .with_context(|| format!("listing the addresses of {DUMMY_INTERFACE}"))?;
        let mut found = BTreeSet::new();
        for reply in replies {
            let RouteNetlinkMessage::NewAddress(a) = reply else {
                continue;
            };
            if a.header.index != self.index {
                continue;
            }
            for attr in a.attributes {
                if let AddressAttribute::Local(addr) | AddressAttribute::Address(addr) = attr {
                    // Only our host addresses: not the link-local one the kernel adds.
                    if !matches!(addr, IpAddr::V6(v6) if v6.is_unicast_link_local()) {
                        found.insert(addr);
                    }
                }
            }
        }
        Ok(found)
    }
}

/// Deletes `kube-ipvs0` (with its addresses); whether it existed.
pub fn remove_dummy_interface() -> Result<bool> {
    let index = interface_index(DUMMY_INTERFACE);
    if index == 0 {
        return Ok(false);
    }
    let socket = rtnetlink_socket()?;
    let mut link = LinkMessage::default();
    link.header.index = index;
    match rtnetlink_request(
        &socket,
        &mut initial_seq(),
        RouteNetlinkMessage::DelLink(link),
        NLM_F_ACK,
    ) {
        Ok(_) => Ok(true),
        Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(false),
        Err(e) => Err(e.context(format!("deleting the interface {DUMMY_INTERFACE}"))),
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
