//! Deleting kernel connection-tracking entries over conntrack netlink (ctnetlink), as
//! kube-proxy does for the netfilter-based modes: the flows of an endpoint that is gone
//! would otherwise keep being translated to it (kubernetes#59368, #125467).
//!
//! The table is dumped once per family and per call, matching entries are deleted by their
//! original tuple. Only the handful of attributes needed are encoded here; the framing
//! follows `linux/netfilter/nfnetlink_conntrack.h`.

use std::net::{IpAddr, SocketAddr};

use anyhow::{Context, Result};
use netlink_sys::{protocols::NETLINK_NETFILTER, Socket};

use crate::{
    kernel::nlattr::{self, attr, attrs, nested, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST},
    model::StaleFlow,
    proxier::FlowCleaner,
};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;

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
const CTA_PROTOINFO: u16 = 4;
const CTA_TIMEOUT: u16 = 7;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;

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
    /// Seconds until the entry expires, as the kernel reported it.
    pub timeout: Option<u32>,
    /// TCP's conntrack state (`enum tcp_conntrack`: 3 established, 7 time-wait, ...).
    pub tcp_state: Option<u8>,
}

impl Entry {
    /// What an entry of `flow` has: (protocol, original destination, reply source).
    pub fn key_of(flow: &StaleFlow) -> (u8, SocketAddr, SocketAddr) {
        let f = &flow.frontend;
        let frontend = SocketAddr::new(f.addr, f.port);
        (
            f.protocol.number(),
            frontend,
            flow.endpoint.unwrap_or(frontend),
        )
    }

    fn key(&self) -> (u8, SocketAddr, SocketAddr) {
        (self.original.protocol, self.original.dst, self.reply.src)
    }
}

/// The kernel's conntrack table in this network namespace.
#[derive(Default)]
pub struct ConntrackFlows;

fn message(kind: u16, flags: u16, family: u8, seq: u32, attrs: &[u8]) -> Vec<u8> {
    // nfgenmsg: family, version 0, resource id 0.
    nlattr::message(
        (NFNL_SUBSYS_CTNETLINK << 8) | kind,
        flags,
        seq,
        [family, 0, 0, 0],
        attrs,
    )
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

pub(crate) fn decode_entry(body: &[u8]) -> Option<Entry> {
    let (mut original, mut reply, mut timeout, mut tcp_state) = (None, None, None, None);
    for (kind, payload) in attrs(body) {
        match kind {
            CTA_TUPLE_ORIG => original = decode_tuple(payload),
            CTA_TUPLE_REPLY => reply = decode_tuple(payload),
            CTA_TIMEOUT => {
                timeout = payload
                    .get(..4)
                    .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            }
            CTA_PROTOINFO => {
                tcp_state = attrs(payload)
                    .filter(|(k, _)| *k == CTA_PROTOINFO_TCP)
                    .flat_map(|(_, tcp)| attrs(tcp))
                    .find(|(k, _)| *k == CTA_PROTOINFO_TCP_STATE)
                    .and_then(|(_, v)| v.first().copied())
            }
            _ => {}
        }
    }
    Some(Entry {
        original: original?,
        reply: reply?,
        timeout,
        tcp_state,
    })
}

fn open() -> Result<Socket> {
    nlattr::open(NETLINK_NETFILTER, "conntrack netlink")
}

fn receive(socket: &Socket, seq: u32, each: impl FnMut(&[u8])) -> Result<()> {
    nlattr::receive(socket, seq, "conntrack netlink", each)
}

impl ConntrackFlows {
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

impl FlowCleaner for ConntrackFlows {
    fn delete(&mut self, flows: &[StaleFlow]) -> Result<usize> {
        let mut deleted = 0;
        let socket = open()?;
        let mut seq = 100;
        for (family, v4) in [(AF_INET, true), (AF_INET6, false)] {
            // (protocol, frontend, where the reply comes from): one lookup per entry, as a
            // cold start asks for every frontend.
            let wanted: std::collections::HashSet<(u8, SocketAddr, SocketAddr)> = flows
                .iter()
                .filter(|f| f.frontend.addr.is_ipv4() == v4)
                .map(Entry::key_of)
                .collect();
            if wanted.is_empty() {
                continue;
            }
            for entry in self.list(family)? {
                if wanted.contains(&entry.key()) {
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
