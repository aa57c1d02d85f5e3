//! The kernel's IPVS table over its generic netlink family ("IPVS"), as `ipvsadm` and
//! kube-proxy's `libipvs` program it: virtual servers, their real servers, and the
//! connection timeouts. Only the attributes the ipvs proxier uses are encoded; the framing
//! follows `linux/ip_vs.h` (attributes of a virtual server nested in
//! `IPVS_CMD_ATTR_SERVICE`, of a real server in `IPVS_CMD_ATTR_DEST`; addresses as a
//! 16-byte `nf_inet_addr`, ports in network order).
//!
//! Hand-written like [`crate::kernel::conntrack::flows`], on the same helpers ([`crate::kernel::nlattr`]): no
//! maintained crate covers the IPVS family (netlink-packet-generic only frames messages and
//! resolves families, which is four lines here).

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use anyhow::{anyhow, bail, Context, Result};
use netlink_sys::{protocols::NETLINK_GENERIC, Socket};

use crate::{
    kernel::nlattr::{
        self, attr, attr_str, attrs, errno, nested, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP,
        NLM_F_EXCL, NLM_F_REQUEST,
    },
    model::{Frontend, Protocol},
};

const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;

const IPVS_GENL_VERSION: u8 = 1;
const IPVS_CMD_NEW_SERVICE: u8 = 1;
const IPVS_CMD_SET_SERVICE: u8 = 2;
const IPVS_CMD_DEL_SERVICE: u8 = 3;
const IPVS_CMD_GET_SERVICE: u8 = 4;
const IPVS_CMD_NEW_DEST: u8 = 5;
const IPVS_CMD_SET_DEST: u8 = 6;
const IPVS_CMD_DEL_DEST: u8 = 7;
const IPVS_CMD_GET_DEST: u8 = 8;
const IPVS_CMD_SET_CONFIG: u8 = 12;

const IPVS_CMD_ATTR_SERVICE: u16 = 1;
const IPVS_CMD_ATTR_DEST: u16 = 2;
const IPVS_CMD_ATTR_TIMEOUT_TCP: u16 = 4;
const IPVS_CMD_ATTR_TIMEOUT_TCP_FIN: u16 = 5;
const IPVS_CMD_ATTR_TIMEOUT_UDP: u16 = 6;

const IPVS_SVC_ATTR_AF: u16 = 1;
const IPVS_SVC_ATTR_PROTOCOL: u16 = 2;
const IPVS_SVC_ATTR_ADDR: u16 = 3;
const IPVS_SVC_ATTR_PORT: u16 = 4;
const IPVS_SVC_ATTR_FWMARK: u16 = 5;
const IPVS_SVC_ATTR_SCHED_NAME: u16 = 6;
const IPVS_SVC_ATTR_FLAGS: u16 = 7;
const IPVS_SVC_ATTR_TIMEOUT: u16 = 8;
const IPVS_SVC_ATTR_NETMASK: u16 = 9;

const IPVS_DEST_ATTR_ADDR: u16 = 1;
const IPVS_DEST_ATTR_PORT: u16 = 2;
const IPVS_DEST_ATTR_FWD_METHOD: u16 = 3;
const IPVS_DEST_ATTR_WEIGHT: u16 = 4;
const IPVS_DEST_ATTR_U_THRESH: u16 = 5;
const IPVS_DEST_ATTR_L_THRESH: u16 = 6;
const IPVS_DEST_ATTR_ACTIVE_CONNS: u16 = 7;
const IPVS_DEST_ATTR_INACT_CONNS: u16 = 8;
const IPVS_DEST_ATTR_STATS: u16 = 10;
const IPVS_DEST_ATTR_ADDR_FAMILY: u16 = 11;
const IPVS_DEST_ATTR_STATS64: u16 = 12;
const IPVS_STATS_ATTR_CONNS: u16 = 1;
const IPVS_STATS_ATTR_INPKTS: u16 = 2;
const IPVS_STATS_ATTR_OUTPKTS: u16 = 3;
const IPVS_STATS_ATTR_INBYTES: u16 = 4;
const IPVS_STATS_ATTR_OUTBYTES: u16 = 5;

/// `IP_VS_SVC_F_PERSISTENT`: a client keeps its real server for the persistence timeout.
const SVC_F_PERSISTENT: u32 = 0x1;
/// `IP_VS_CONN_F_MASQ`: the real server is reached by NAT (kube-proxy's only method).
const FWD_MASQ: u32 = 0;

/// One IPVS virtual server (an address:port:protocol; IPVS' "service").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtualServer {
    pub frontend: Frontend,
    /// The scheduler's name (`rr`, `wlc`, `mh`, ...).
    pub scheduler: String,
    /// Persistence timeout in seconds (ClientIP session affinity), per client address.
    pub persistence: Option<u32>,
}

/// One real server of a virtual server (NAT forwarding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RealServer {
    pub addr: SocketAddr,
    /// 0: takes no new connections (a draining endpoint); its established ones continue.
    pub weight: u32,
    /// Active and inactive connections, as the kernel counts them (read only).
    pub connections: (u32, u32),
}

/// The timeouts `ipvsadm --set` shows: 0 leaves the kernel's value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IpvsTimeouts {
    pub tcp: u32,
    pub tcp_fin: u32,
    pub udp: u32,
}

/// The IPVS table of this network namespace.
pub trait Ipvs: Send {
    /// Every address-based virtual server (firewall-mark ones are never this agent's).
    fn virtual_servers(&mut self) -> Result<Vec<VirtualServer>>;
    fn real_servers(&mut self, frontend: &Frontend) -> Result<Vec<RealServer>>;
    fn add_virtual_server(&mut self, vs: &VirtualServer) -> Result<()>;
    fn update_virtual_server(&mut self, vs: &VirtualServer) -> Result<()>;
    /// Deletes the virtual server and its real servers (absent is not an error).
    fn delete_virtual_server(&mut self, frontend: &Frontend) -> Result<()>;
    fn add_real_server(&mut self, frontend: &Frontend, rs: &RealServer) -> Result<()>;
    fn update_real_server(&mut self, frontend: &Frontend, rs: &RealServer) -> Result<()>;
    /// Absent is not an error.
    fn delete_real_server(&mut self, frontend: &Frontend, addr: SocketAddr) -> Result<()>;
    fn set_timeouts(&mut self, timeouts: IpvsTimeouts) -> Result<()>;
}

/// The kernel's IPVS, over generic netlink.
pub struct KernelIpvs {
    socket: Socket,
    family: u16,
    seq: u32,
}

/// What to load when the kernel has no IPVS (kube-proxy checks the same modules).
pub const REQUIRED_MODULES: &[&str] =
    &["ip_vs", "ip_vs_rr", "ip_vs_wrr", "ip_vs_sh", "nf_conntrack"];

fn protocol_number(p: Protocol) -> u16 {
    p.number() as u16
}

fn af(addr: IpAddr) -> u16 {
    match addr {
        IpAddr::V4(_) => libc::AF_INET as u16,
        IpAddr::V6(_) => libc::AF_INET6 as u16,
    }
}

/// `union nf_inet_addr`: 16 bytes, an IPv4 address in the first 4.
fn inet_addr(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(a) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&a.octets());
            b
        }
        IpAddr::V6(a) => a.octets(),
    }
}

fn parse_addr(family: u16, payload: &[u8]) -> Option<IpAddr> {
    if family == libc::AF_INET as u16 {
        let b: [u8; 4] = payload.get(..4)?.try_into().ok()?;
        Some(IpAddr::V4(Ipv4Addr::from(b)))
    } else if family == libc::AF_INET6 as u16 {
        let b: [u8; 16] = payload.get(..16)?.try_into().ok()?;
        Some(IpAddr::V6(Ipv6Addr::from(b)))
    } else {
        None
    }
}

fn u32_of(p: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(p.get(..4)?.try_into().ok()?))
}

fn u16_of(p: &[u8]) -> Option<u16> {
    Some(u16::from_ne_bytes(p.get(..2)?.try_into().ok()?))
}

fn be16_of(p: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes(p.get(..2)?.try_into().ok()?))
}

/// The attributes naming a virtual server (enough to find it).
fn service_key(buf: &mut Vec<u8>, f: &Frontend) {
    attr(buf, IPVS_SVC_ATTR_AF, &af(f.addr).to_ne_bytes());
    attr(
        buf,
        IPVS_SVC_ATTR_PROTOCOL,
        &protocol_number(f.protocol).to_ne_bytes(),
    );
    attr(buf, IPVS_SVC_ATTR_ADDR, &inet_addr(f.addr));
    attr(buf, IPVS_SVC_ATTR_PORT, &f.port.to_be_bytes());
}

/// A whole virtual server (the kernel wants every field to add or change one).
pub fn encode_virtual_server(buf: &mut Vec<u8>, vs: &VirtualServer) {
    nested(buf, IPVS_CMD_ATTR_SERVICE, |b| {
        service_key(b, &vs.frontend);
        attr_str(b, IPVS_SVC_ATTR_SCHED_NAME, &vs.scheduler);
        let flags = if vs.persistence.is_some() {
            SVC_F_PERSISTENT
        } else {
            0
        };
        let mut fl = flags.to_ne_bytes().to_vec();
        fl.extend_from_slice(&u32::MAX.to_ne_bytes());
        attr(b, IPVS_SVC_ATTR_FLAGS, &fl);
        attr(
            b,
            IPVS_SVC_ATTR_TIMEOUT,
            &vs.persistence.unwrap_or(0).to_ne_bytes(),
        );
        // Persistence per client address: a full mask (IPv4: the mask, IPv6: its length).
        let netmask: u32 = match vs.frontend.addr {
            IpAddr::V4(_) => u32::MAX,
            IpAddr::V6(_) => 128,
        };
        attr(b, IPVS_SVC_ATTR_NETMASK, &netmask.to_ne_bytes());
    });
}

pub fn decode_virtual_server(body: &[u8]) -> Option<VirtualServer> {
    let (_, svc) = attrs(body).find(|(k, _)| *k == IPVS_CMD_ATTR_SERVICE)?;
    let (mut family, mut protocol, mut addr, mut port) = (None, None, None, None);
    let (mut scheduler, mut flags, mut timeout, mut fwmark) = (String::new(), 0, 0, 0);
    for (k, p) in attrs(svc) {
        match k {
            IPVS_SVC_ATTR_AF => family = u16_of(p),
            IPVS_SVC_ATTR_PROTOCOL => protocol = u16_of(p),
            IPVS_SVC_ATTR_ADDR => addr = Some(p),
            IPVS_SVC_ATTR_PORT => port = be16_of(p),
            IPVS_SVC_ATTR_FWMARK => fwmark = u32_of(p).unwrap_or(0),
            IPVS_SVC_ATTR_SCHED_NAME => {
                scheduler = String::from_utf8_lossy(p)
                    .trim_end_matches('\0')
                    .to_string()
            }
            IPVS_SVC_ATTR_FLAGS => flags = u32_of(p).unwrap_or(0),
            IPVS_SVC_ATTR_TIMEOUT => timeout = u32_of(p).unwrap_or(0),
            _ => {}
        }
    }
    if fwmark != 0 {
        return None;
    }
    Some(VirtualServer {
        frontend: Frontend {
            addr: parse_addr(family?, addr?)?,
            port: port?,
            protocol: Protocol::from_number(protocol? as u8)?,
        },
        scheduler,
        persistence: (flags & SVC_F_PERSISTENT != 0).then_some(timeout),
    })
}

pub fn encode_real_server(buf: &mut Vec<u8>, rs: &RealServer) {
    nested(buf, IPVS_CMD_ATTR_DEST, |b| {
        attr(b, IPVS_DEST_ATTR_ADDR, &inet_addr(rs.addr.ip()));
        attr(b, IPVS_DEST_ATTR_PORT, &rs.addr.port().to_be_bytes());
        attr(b, IPVS_DEST_ATTR_FWD_METHOD, &FWD_MASQ.to_ne_bytes());
        attr(b, IPVS_DEST_ATTR_WEIGHT, &rs.weight.to_ne_bytes());
        attr(b, IPVS_DEST_ATTR_U_THRESH, &0u32.to_ne_bytes());
        attr(b, IPVS_DEST_ATTR_L_THRESH, &0u32.to_ne_bytes());
        attr(
            b,
            IPVS_DEST_ATTR_ADDR_FAMILY,
            &af(rs.addr.ip()).to_ne_bytes(),
        );
    });
}

pub fn decode_real_server(body: &[u8], service_family: u16) -> Option<RealServer> {
    let (_, dest) = attrs(body).find(|(k, _)| *k == IPVS_CMD_ATTR_DEST)?;
    let (mut family, mut addr, mut port, mut weight) = (service_family, None, None, 0);
    let (mut active, mut inactive) = (0, 0);
    for (k, p) in attrs(dest) {
        match k {
            IPVS_DEST_ATTR_ADDR => addr = Some(p),
            IPVS_DEST_ATTR_PORT => port = be16_of(p),
            IPVS_DEST_ATTR_WEIGHT => weight = u32_of(p).unwrap_or(0),
            IPVS_DEST_ATTR_ACTIVE_CONNS => active = u32_of(p).unwrap_or(0),
            IPVS_DEST_ATTR_INACT_CONNS => inactive = u32_of(p).unwrap_or(0),
            IPVS_DEST_ATTR_ADDR_FAMILY => family = u16_of(p).unwrap_or(family),
            _ => {}
        }
    }
    Some(RealServer {
        addr: SocketAddr::new(parse_addr(family, addr?)?, port?),
        weight,
        connections: (active, inactive),
    })
}

/// What IPVS counted for one real server of a virtual server since it was added:
/// connections scheduled to it, packets and bytes both ways.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RealServerStats {
    pub connections: u64,
    pub packets: u64,
    pub bytes: u64,
}

/// A real server's address and counters from a `IPVS_CMD_GET_DEST` reply: its 64-bit
/// counters (4.2+), else the 32-bit ones.
pub fn decode_real_server_stats(
    body: &[u8],
    service_family: u16,
) -> Option<(SocketAddr, RealServerStats)> {
    let (_, dest) = attrs(body).find(|(k, _)| *k == IPVS_CMD_ATTR_DEST)?;
    let (mut family, mut addr, mut port) = (service_family, None, None);
    let (mut stats, mut stats64) = (None, None);
    for (k, p) in attrs(dest) {
        match k {
            IPVS_DEST_ATTR_ADDR => addr = Some(p),
            IPVS_DEST_ATTR_PORT => port = be16_of(p),
            IPVS_DEST_ATTR_ADDR_FAMILY => family = u16_of(p).unwrap_or(family),
            IPVS_DEST_ATTR_STATS => stats = Some(p),
            IPVS_DEST_ATTR_STATS64 => stats64 = Some(p),
            _ => {}
        }
    }
    let number = |p: &[u8]| -> u64 {
        match p.len() {
            8 => u64::from_ne_bytes(p.try_into().unwrap_or([0; 8])),
            4 => u32::from_ne_bytes(p.try_into().unwrap_or([0; 4])) as u64,
            _ => 0,
        }
    };
    let mut counted = RealServerStats::default();
    if let Some(nested) = stats64.or(stats) {
        for (k, p) in attrs(nested) {
            match k {
                IPVS_STATS_ATTR_CONNS => counted.connections = number(p),
                IPVS_STATS_ATTR_INPKTS | IPVS_STATS_ATTR_OUTPKTS => counted.packets += number(p),
                IPVS_STATS_ATTR_INBYTES | IPVS_STATS_ATTR_OUTBYTES => counted.bytes += number(p),
                _ => {}
            }
        }
    }
    Some((SocketAddr::new(parse_addr(family, addr?)?, port?), counted))
}

impl KernelIpvs {
    /// The counters of `frontend`'s real servers (`ipvsadm -Ln --stats`), read only.
    pub fn real_server_stats(
        &mut self,
        frontend: &Frontend,
    ) -> Result<Vec<(SocketAddr, RealServerStats)>> {
        self.dump_real_servers(frontend, decode_real_server_stats)
            .with_context(|| format!("reading the counters of {frontend}'s real servers"))
    }

    /// `frontend`'s real servers as `decode` reads each `IPVS_CMD_GET_DEST` reply.
    fn dump_real_servers<T>(
        &mut self,
        frontend: &Frontend,
        decode: impl Fn(&[u8], u16) -> Option<T>,
    ) -> Result<Vec<T>> {
        let mut body = Vec::new();
        nested(&mut body, IPVS_CMD_ATTR_SERVICE, |b| {
            service_key(b, frontend)
        });
        let family = af(frontend.addr);
        let mut found = Vec::new();
        self.request(IPVS_CMD_GET_DEST, NLM_F_DUMP, &body, |reply| {
            found.extend(decode(reply, family))
        })?;
        Ok(found)
    }

    /// The IPVS family of this kernel; an error naming the modules to load if it has none.
    pub fn open() -> Result<Self> {
        let socket = nlattr::open(NETLINK_GENERIC, "generic netlink")?;
        let mut body = Vec::new();
        attr_str(&mut body, CTRL_ATTR_FAMILY_NAME, "IPVS");
        // Acknowledged, so the reply is followed by an end the reader waits for.
        let request = nlattr::message(
            GENL_ID_CTRL,
            NLM_F_REQUEST | NLM_F_ACK,
            1,
            [CTRL_CMD_GETFAMILY, 1, 0, 0],
            &body,
        );
        socket
            .send(&request, 0)
            .context("asking generic netlink for the IPVS family")?;
        let mut family = None;
        let found = nlattr::receive(&socket, 1, "generic netlink", |reply| {
            family = attrs(reply)
                .find(|(k, _)| *k == CTRL_ATTR_FAMILY_ID)
                .and_then(|(_, p)| u16_of(p));
        });
        match (found, family) {
            (Ok(()), Some(family)) => Ok(KernelIpvs {
                socket,
                family,
                seq: 1,
            }),
            (Err(e), _) if errno(&e) == Some(libc::ENOENT) => bail!(
                "this kernel has no IPVS (no \"IPVS\" generic netlink family): load the modules {} (modprobe -a {})",
                REQUIRED_MODULES.join(", "),
                REQUIRED_MODULES.join(" ")
            ),
            (Err(e), _) => Err(e.context("looking up the IPVS generic netlink family")),
            (Ok(()), None) => Err(anyhow!(
                "generic netlink answered without the IPVS family id"
            )),
        }
    }

    /// Sends `cmd` with `body`; hands each reply's attributes to `each`.
    fn request(&mut self, cmd: u8, flags: u16, body: &[u8], each: impl FnMut(&[u8])) -> Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let request = nlattr::message(
            self.family,
            NLM_F_REQUEST | flags,
            self.seq,
            [cmd, IPVS_GENL_VERSION, 0, 0],
            body,
        );
        self.socket
            .send(&request, 0)
            .context("sending an IPVS request")?;
        nlattr::receive(&self.socket, self.seq, "IPVS netlink", each)
    }

    fn command(&mut self, cmd: u8, flags: u16, body: &[u8]) -> Result<()> {
        self.request(cmd, NLM_F_ACK | flags, body, |_| {})
    }
}

/// `Ok` for a request whose object was already absent.
fn absent_ok(result: Result<()>) -> Result<()> {
    match result {
        Err(e) if matches!(errno(&e), Some(libc::ESRCH | libc::ENOENT)) => Ok(()),
        other => other,
    }
}

impl Ipvs for KernelIpvs {
    fn virtual_servers(&mut self) -> Result<Vec<VirtualServer>> {
        let mut found = Vec::new();
        self.request(IPVS_CMD_GET_SERVICE, NLM_F_DUMP, &[], |reply| {
            found.extend(decode_virtual_server(reply))
        })
        .context("listing IPVS virtual servers")?;
        Ok(found)
    }

    fn real_servers(&mut self, frontend: &Frontend) -> Result<Vec<RealServer>> {
        self.dump_real_servers(frontend, decode_real_server)
            .with_context(|| format!("listing the real servers of {frontend}"))
    }

    fn add_virtual_server(&mut self, vs: &VirtualServer) -> Result<()> {
        let mut body = Vec::new();
        encode_virtual_server(&mut body, vs);
        self.command(IPVS_CMD_NEW_SERVICE, NLM_F_CREATE | NLM_F_EXCL, &body)
            .with_context(|| {
                format!(
                    "adding IPVS virtual server {} (scheduler {})",
                    vs.frontend, vs.scheduler
                )
            })
    }

    fn update_virtual_server(&mut self, vs: &VirtualServer) -> Result<()> {
        let mut body = Vec::new();
        encode_virtual_server(&mut body, vs);
        self.command(IPVS_CMD_SET_SERVICE, 0, &body)
            .with_context(|| format!("updating IPVS virtual server {}", vs.frontend))
    }

    fn delete_virtual_server(&mut self, frontend: &Frontend) -> Result<()> {
        let mut body = Vec::new();
        nested(&mut body, IPVS_CMD_ATTR_SERVICE, |b| {
            service_key(b, frontend)
        });
        absent_ok(self.command(IPVS_CMD_DEL_SERVICE, 0, &body))
            .with_context(|| format!("deleting IPVS virtual server {frontend}"))
    }

    fn add_real_server(&mut self, frontend: &Frontend, rs: &RealServer) -> Result<()> {
        let mut body = Vec::new();
        nested(&mut body, IPVS_CMD_ATTR_SERVICE, |b| {
            service_key(b, frontend)
        });
        encode_real_server(&mut body, rs);
        self.command(IPVS_CMD_NEW_DEST, NLM_F_CREATE | NLM_F_EXCL, &body)
            .with_context(|| format!("adding real server {} to {frontend}", rs.addr))
    }

    fn update_real_server(&mut self, frontend: &Frontend, rs: &RealServer) -> Result<()> {
        let mut body = Vec::new();
        nested(&mut body, IPVS_CMD_ATTR_SERVICE, |b| {
            service_key(b, frontend)
        });
        encode_real_server(&mut body, rs);
        self.command(IPVS_CMD_SET_DEST, 0, &body)
            .with_context(|| format!("updating real server {} of {frontend}", rs.addr))
    }

    fn delete_real_server(&mut self, frontend: &Frontend, addr: SocketAddr) -> Result<()> {
        let mut body = Vec::new();
        nested(&mut body, IPVS_CMD_ATTR_SERVICE, |b| {
            service_key(b, frontend)
        });
        nested(&mut body, IPVS_CMD_ATTR_DEST, |b| {
            attr(b, IPVS_DEST_ATTR_ADDR, &inet_addr(addr.ip()));
            attr(b, IPVS_DEST_ATTR_PORT, &addr.port().to_be_bytes());
        });
        absent_ok(self.command(IPVS_CMD_DEL_DEST, 0, &body))
            .with_context(|| format!("deleting real server {addr} of {frontend}"))
    }

    fn set_timeouts(&mut self, t: IpvsTimeouts) -> Result<()> {
        let mut body = Vec::new();
        attr(&mut body, IPVS_CMD_ATTR_TIMEOUT_TCP, &t.tcp.to_ne_bytes());
        attr(
            &mut body,
            IPVS_CMD_ATTR_TIMEOUT_TCP_FIN,
            &t.tcp_fin.to_ne_bytes(),
        );
        attr(&mut body, IPVS_CMD_ATTR_TIMEOUT_UDP, &t.udp.to_ne_bytes());
        self.command(IPVS_CMD_SET_CONFIG, 0, &body)
            .context("setting the IPVS timeouts")
    }
}

/// Virtual servers with their real servers, by frontend.
pub type IpvsTable = BTreeMap<Frontend, (VirtualServer, Vec<RealServer>)>;

/// An IPVS table kept in memory (tests).
#[derive(Clone, Default)]
pub struct MemoryIpvs(
    pub std::sync::Arc<std::sync::Mutex<IpvsTable>>,
    pub std::sync::Arc<std::sync::Mutex<IpvsTimeouts>>,
);

impl MemoryIpvs {
    fn with<R>(&self, f: impl FnOnce(&mut IpvsTable) -> R) -> R {
        f(&mut self.0.lock().expect("not poisoned"))
    }
}

impl Ipvs for MemoryIpvs {
    fn virtual_servers(&mut self) -> Result<Vec<VirtualServer>> {
        Ok(self.with(|t| t.values().map(|(vs, _)| vs.clone()).collect()))
    }

    fn real_servers(&mut self, frontend: &Frontend) -> Result<Vec<RealServer>> {
        self.with(|t| t.get(frontend).map(|(_, r)| r.clone()))
            .ok_or_else(|| anyhow!("no virtual server {frontend}"))
    }

    fn add_virtual_server(&mut self, vs: &VirtualServer) -> Result<()> {
        self.with(|t| {
            if t.contains_key(&vs.frontend) {
                bail!("virtual server {} exists", vs.frontend);
            }
            t.insert(vs.frontend, (vs.clone(), Vec::new()));
            Ok(())
        })
    }

    fn update_virtual_server(&mut self, vs: &VirtualServer) -> Result<()> {
        self.with(|t| match t.get_mut(&vs.frontend) {
            Some((old, _)) => {
                *old = vs.clone();
                Ok(())
            }
            None => bail!("no virtual server {}", vs.frontend),
        })
    }

    fn delete_virtual_server(&mut self, frontend: &Frontend) -> Result<()> {
        self.with(|t| t.remove(frontend));
        Ok(())
    }

    fn add_real_server(&mut self, frontend: &Frontend, rs: &RealServer) -> Result<()> {
        self.with(|t| match t.get_mut(frontend) {
            Some((_, reals)) if reals.iter().any(|r| r.addr == rs.addr) => {
                bail!("real server {} exists", rs.addr)
            }
            Some((_, reals)) => {
                reals.push(*rs);
                Ok(())
            }
            None => bail!("no virtual server {frontend}"),
        })
    }

    fn update_real_server(&mut self, frontend: &Frontend, rs: &RealServer) -> Result<()> {
        self.with(|t| {
            match t
                .get_mut(frontend)
                .and_then(|(_, reals)| reals.iter_mut().find(|r| r.addr == rs.addr))
            {
                Some(r) => {
                    r.weight = rs.weight;
                    Ok(())
                }
                None => bail!("no real server {} of {frontend}", rs.addr),
            }
        })
    }

    fn delete_real_server(&mut self, frontend: &Frontend, addr: SocketAddr) -> Result<()> {
        self.with(|t| {
            if let Some((_, reals)) = t.get_mut(frontend) {
                reals.retain(|r| r.addr != addr);
            }
        });
        Ok(())
    }

    fn set_timeouts(&mut self, timeouts: IpvsTimeouts) -> Result<()> {
        *self.1.lock().expect("not poisoned") = timeouts;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_and_real_servers_round_trip_through_the_attribute_encoding() {
        for (addr, backend) in [
            ("10.96.0.10", "10.244.1.2:8080"),
            ("fd00::a", "[fd00::2]:8080"),
        ] {
            let vs = VirtualServer {
                frontend: Frontend {
                    addr: addr.parse().unwrap(),
                    port: 53,
                    protocol: Protocol::Udp,
                },
                scheduler: "wlc".into(),
                persistence: Some(10800),
            };
            let mut buf = Vec::new();
            encode_virtual_server(&mut buf, &vs);
            assert_eq!(decode_virtual_server(&buf), Some(vs.clone()));
            let rs = RealServer {
                addr: backend.parse().unwrap(),
                weight: 0,
                connections: (0, 0),
            };
            let mut buf = Vec::new();
            encode_real_server(&mut buf, &rs);
            assert_eq!(decode_real_server(&buf, af(vs.frontend.addr)), Some(rs));
        }
    }

    /// A real server's counters as the kernel sends them: the 64-bit set wins over the
    /// 32-bit one, packets and bytes both ways added up.
    #[test]
    fn real_server_counters_are_read_from_the_64_bit_set() {
        let rs = RealServer {
            addr: "10.244.1.2:8080".parse().unwrap(),
            weight: 1,
            connections: (0, 0),
        };
        let mut plain = Vec::new();
        encode_real_server(&mut plain, &rs);
        let (_, dest) = attrs(&plain).next().unwrap();
        let mut buf = Vec::new();
        nested(&mut buf, IPVS_CMD_ATTR_DEST, |b| {
            b.extend_from_slice(dest);
            nested(b, IPVS_DEST_ATTR_STATS, |st| {
                attr(st, IPVS_STATS_ATTR_CONNS, &7u32.to_ne_bytes());
            });
            nested(b, IPVS_DEST_ATTR_STATS64, |st| {
                attr(st, IPVS_STATS_ATTR_CONNS, &30u64.to_ne_bytes());
                attr(st, IPVS_STATS_ATTR_INPKTS, &200u64.to_ne_bytes());
                attr(st, IPVS_STATS_ATTR_OUTPKTS, &150u64.to_ne_bytes());
                attr(st, IPVS_STATS_ATTR_INBYTES, &12_000u64.to_ne_bytes());
                attr(st, IPVS_STATS_ATTR_OUTBYTES, &9_000u64.to_ne_bytes());
            });
        });
        let (addr, stats) = decode_real_server_stats(&buf, af(rs.addr.ip())).unwrap();
        assert_eq!(addr, rs.addr);
        assert_eq!(
            stats,
            RealServerStats {
                connections: 30,
                packets: 350,
                bytes: 21_000
            }
        );
    }
}
