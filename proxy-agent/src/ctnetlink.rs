//! Deleting kernel connection-tracking entries over conntrack netlink (ctnetlink), as
//! kube-proxy does for the netfilter-based modes: the flows of an endpoint that is gone
//! would otherwise keep being translated to it (kubernetes#59368, #125467).
//!
//! The table is dumped once per family and per call, matching entries are deleted by their
//! original tuple. Only the handful of attributes needed are encoded here; the framing
//! follows `linux/netfilter/nfnetlink_conntrack.h`.

use std::net::{IpAddr, SocketAddr};

use anyhow::{bail, Context, Result};
use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr as NetlinkAddr};

use crate::{
    model::{Protocol, StaleFlow},
    proxier::FlowCleaner,
};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;

const AF_INET: u8 = libc::AF_INET as u8;
const AF_INET6: u8 = libc::AF_INET6 as u8;

/// One direction of a tracked flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuple {
    pub protocol: u8,
    pub src: SocketAddr,
    pub dst: SocketAddr,
}

/// A tracked flow: as the client sent it, and as the reply is expected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub original: Tuple,
    pub reply: Tuple,
}

impl Entry {
    /// Whether this entry belongs to `flow`.
    pub fn is(&self, flow: &StaleFlow) -> bool {
        let f = &flow.frontend;
        let protocol = match f.protocol {
            Protocol::Tcp => proxy_common::IPPROTO_TCP,
            Protocol::Udp => proxy_common::IPPROTO_UDP,
            Protocol::Sctp => proxy_common::IPPROTO_SCTP,
        };
        let frontend = SocketAddr::new(f.addr, f.port);
        self.original.protocol == protocol
            && self.original.dst == frontend
            && self.reply.src == flow.endpoint.unwrap_or(frontend)
    }
}

/// The kernel's conntrack table in this network namespace.
#[derive(Default)]
pub struct KernelConntrack;

fn attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

fn nested(buf: &mut Vec<u8>, kind: u16, fill: impl FnOnce(&mut Vec<u8>)) {
    let mut inner = Vec::new();
    fill(&mut inner);
    attr(buf, kind | NLA_F_NESTED, &inner);
}

fn message(kind: u16, flags: u16, family: u8, seq: u32, attrs: &[u8]) -> Vec<u8> {
    let len = 16 + 4 + attrs.len();
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&((NFNL_SUBSYS_CTNETLINK << 8) | kind).to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    // nfgenmsg: family, version 0, resource id 0.
    m.extend_from_slice(&[family, 0, 0, 0]);
    m.extend_from_slice(attrs);
    m
}

/// (type, payload) of each attribute in `buf`.
fn attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return None;
        }
        let payload = &buf[4..len];
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
        Some((kind, payload))
    })
}

fn encode_tuple(buf: &mut Vec<u8>, t: &Tuple) {
    nested(buf, CTA_TUPLE_IP, |b| match (t.src.ip(), t.dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            attr(b, CTA_IP_V4_SRC, &s.octets());
            attr(b, CTA_IP_V4_DST, &d.octets());
        }
        (s, d) => {
            let v6 = |a: IpAddr| match a {
                IpAddr::V6(a) => a.octets(),
                IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
            };
            attr(b, CTA_IP_V6_SRC, &v6(s));
            attr(b, CTA_IP_V6_DST, &v6(d));
        }
    });
    nested(buf, CTA_TUPLE_PROTO, |b| {
        attr(b, CTA_PROTO_NUM, &[t.protocol]);
        attr(b, CTA_PROTO_SRC_PORT, &t.src.port().to_be_bytes());
        attr(b, CTA_PROTO_DST_PORT, &t.dst.port().to_be_bytes());
    });
}

fn decode_tuple(buf: &[u8]) -> Option<Tuple> {
    let (mut src, mut dst) = (None, None);
    let (mut protocol, mut sport, mut dport) = (None, 0u16, 0u16);
    for (kind, payload) in attrs(buf) {
        match kind {
            CTA_TUPLE_IP => {
                for (k, p) in attrs(payload) {
                    let addr: Option<IpAddr> = match p.len() {
                        4 => Some(<[u8; 4]>::try_from(p).ok()?.into()),
                        16 => Some(<[u8; 16]>::try_from(p).ok()?.into()),
                        _ => None,
                    };
                    match k {
                        CTA_IP_V4_SRC | CTA_IP_V6_SRC => src = addr,
                        CTA_IP_V4_DST | CTA_IP_V6_DST => dst = addr,
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (k, p) in attrs(payload) {
                    match (k, p) {
                        (CTA_PROTO_NUM, [n, ..]) => protocol = Some(*n),
                        (CTA_PROTO_SRC_PORT, [a, b, ..]) => sport = u16::from_be_bytes([*a, *b]),
                        (CTA_PROTO_DST_PORT, [a, b, ..]) => dport = u16::from_be_bytes([*a, *b]),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(Tuple {
        protocol: protocol?,
        src: SocketAddr::new(src?, sport),
        dst: SocketAddr::new(dst?, dport),
    })
}

fn decode_entry(body: &[u8]) -> Option<Entry> {
    let (mut original, mut reply) = (None, None);
    for (kind, payload) in attrs(body) {
        match kind {
            CTA_TUPLE_ORIG => original = decode_tuple(payload),
            CTA_TUPLE_REPLY => reply = decode_tuple(payload),
            _ => {}
        }
    }
    Some(Entry {
        original: original?,
        reply: reply?,
    })
}

fn open() -> Result<Socket> {
    let mut socket =
        Socket::new(NETLINK_NETFILTER).context("opening a conntrack netlink socket")?;
    socket
        .bind_auto()
        .context("binding the conntrack netlink socket")?;
    socket
        .connect(&NetlinkAddr::new(0, 0))
        .context("connecting the conntrack netlink socket")?;
    Ok(socket)
}

/// Reads replies to `seq` until the dump ends (or the ack arrives), handing each conntrack
/// message's attributes to `each`.
fn receive(socket: &Socket, seq: u32, mut each: impl FnMut(&[u8])) -> Result<()> {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = socket
            .recv(&mut &mut buf[..], 0)
            .context("reading from conntrack netlink")?;
        let mut rest = &buf[..n];
        while rest.len() >= 16 {
            let len = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
            let kind = u16::from_ne_bytes(rest[4..6].try_into().unwrap());
            let msg_seq = u32::from_ne_bytes(rest[8..12].try_into().unwrap());
            if len < 16 || len > rest.len() {
                bail!("malformed conntrack netlink message");
            }
            let body = &rest[16..len];
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
            if msg_seq != seq {
                continue;
            }
            match kind {
                NLMSG_DONE => return Ok(()),
                NLMSG_ERROR => {
                    let code = i32::from_ne_bytes(body[0..4].try_into().unwrap_or_default());
                    if code == 0 {
                        return Ok(());
                    }
                    return Err(std::io::Error::from_raw_os_error(-code).into());
                }
                _ if body.len() >= 4 => each(&body[4..]),
                _ => {}
            }
        }
    }
}

impl KernelConntrack {
    /// Every entry of one family (`AF_INET` / `AF_INET6`).
    pub fn list(&self, family: u8) -> Result<Vec<Entry>> {
        let socket = open()?;
        let seq = 1;
        let request = message(
            IPCTNL_MSG_CT_GET,
            NLM_F_REQUEST | NLM_F_DUMP,
            family,
            seq,
            &[],
        );
        socket
            .send(&request, 0)
            .context("asking conntrack netlink for its table")?;
        let mut entries = Vec::new();
        receive(&socket, seq, |body| {
            if let Some(e) = decode_entry(body) {
                entries.push(e);
            }
        })?;
        Ok(entries)
    }

    /// Deletes one entry by its original tuple; false if it was already gone.
    pub fn remove(&self, socket: &Socket, seq: u32, entry: &Entry) -> Result<bool> {
        let family = if entry.original.src.is_ipv4() {
            AF_INET
        } else {
            AF_INET6
        };
        let mut body = Vec::new();
        nested(&mut body, CTA_TUPLE_ORIG, |b| {
            encode_tuple(b, &entry.original)
        });
        let request = message(
            IPCTNL_MSG_CT_DELETE,
            NLM_F_REQUEST | NLM_F_ACK,
            family,
            seq,
            &body,
        );
        socket
            .send(&request, 0)
            .context("deleting a conntrack entry")?;
        match receive(socket, seq, |_| {}) {
            Ok(()) => Ok(true),
            Err(e)
                if e.downcast_ref::<std::io::Error>()
                    .and_then(|e| e.raw_os_error())
                    == Some(libc::ENOENT) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

impl FlowCleaner for KernelConntrack {
    fn delete(&mut self, flows: &[StaleFlow]) -> Result<usize> {
        let mut deleted = 0;
        let socket = open()?;
        let mut seq = 100;
        for (family, v4) in [(AF_INET, true), (AF_INET6, false)] {
            let wanted: Vec<&StaleFlow> = flows
                .iter()
                .filter(|f| f.frontend.addr.is_ipv4() == v4)
                .collect();
            if wanted.is_empty() {
                continue;
            }
            for entry in self.list(family)? {
                if wanted.iter().any(|f| entry.is(f)) {
                    seq += 1;
                    deleted += self.remove(&socket, seq, &entry)? as usize;
                }
            }
        }
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuples_round_trip_through_the_attribute_encoding() {
        for (src, dst) in [
            ("10.244.1.2:40000", "10.96.0.10:53"),
            ("[fd00::2]:40000", "[fd00:10:96::a]:53"),
        ] {
            let t = Tuple {
                protocol: 17,
                src: src.parse().unwrap(),
                dst: dst.parse().unwrap(),
            };
            let mut buf = Vec::new();
            encode_tuple(&mut buf, &t);
            assert_eq!(decode_tuple(&buf), Some(t));
        }
    }
}
