//! The nftables proxier's transactions, sent to nf_tables over netlink.
//!
//! Why not `nft -f`: before it applies anything, `nft` (1.0.6, Debian 12's) reads the chain
//! list of every table, and the kernel's chain dump restarts from the head of the list for
//! each reply buffer, so at 10 000 services (110 000 chains) adding one map element cost
//! 2 s of kernel time on this machine, and a full sync at 100 000 services never finished.
//! A netlink batch names its chains and sets, which the kernel looks up by hash: the cost
//! of a change no longer grows with the table, and no path of the agent lists the table.
//!
//! The proxier keeps writing nft's language (its tests and the in-memory model read it);
//! [`encode_script`] translates every command it writes — `add|delete table`, `add chain`
//! (base chains with their hooks too), `add rule`, `add map|set`, `add|delete element`,
//! `flush chain|map|set`, `delete chain|set` over the rule shapes of [`super::rules`] and
//! the table's static part — into the messages `nft` itself sends (the same bytecode and
//! set metadata, so `nft list` prints the same table). A line it does not know is an
//! error naming the line, never a silent detour through `nft`.

use std::{
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd,
};

use anyhow::{bail, Context, Result};
use netlink_sys::protocols::NETLINK_NETFILTER;

use super::nft::{Element, Nft};
use crate::kernel::nlattr::{
    self, attr, attr_str, nested, NLA_F_NESTED, NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST,
};
use crate::{model::Protocol, proxier::naming::protocol};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NLM_F_APPEND: u16 = 0x800;

// nf_tables message types (enum nf_tables_msg_types).
const NEWTABLE: u16 = 0;
const GETTABLE: u16 = 1;
const DELTABLE: u16 = 2;
const NEWCHAIN: u16 = 3;
const DELCHAIN: u16 = 5;
const NEWRULE: u16 = 6;
const DELRULE: u16 = 8;
const NEWSET: u16 = 9;
const DELSET: u16 = 11;
const NEWSETELEM: u16 = 12;
const GETSETELEM: u16 = 13;
const DELSETELEM: u16 = 14;

const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;

// Registers: the verdict register, and the two 16-byte data registers nft uses.
const REG_VERDICT: u32 = 0;
const REG_1: u32 = 1;
const REG_2: u32 = 2;

const NFT_JUMP: i32 = -3;
const NFT_GOTO: i32 = -4;
const NFT_RETURN: i32 = -5;
const NF_DROP: i32 = 0;
const NF_ACCEPT: u32 = 1;

const CMP_EQ: u32 = 0;
const CMP_NEQ: u32 = 1;
const PAYLOAD_NETWORK: u32 = 1;
const PAYLOAD_TRANSPORT: u32 = 2;
const META_MARK: u32 = 3;
const META_IIFNAME: u32 = 6;
const META_L4PROTO: u32 = 16;
const CT_STATE: u32 = 0;
/// `ct state new`: the bit of IP_CT_NEW in the state mask.
const CT_STATE_NEW: u32 = 1 << 3;
/// NF_NAT_RANGE_PROTO_RANDOM_FULLY, nft's `fully-random`.
const NAT_RANDOM_FULLY: u32 = 0x10;
const NAT_SNAT: u32 = 0;
const NAT_DNAT: u32 = 1;

/// nft's set key types (`ipv4_addr`, `ipv6_addr`), which `nft list` reads back.
const TYPE_IPADDR: u32 = 7;
const TYPE_IP6ADDR: u32 = 8;
/// `inet_proto` and `inet_service`, and how nft builds a concatenation's type from its
/// parts' (6 bits each).
const TYPE_INET_PROTOCOL: u32 = 12;
const TYPE_INET_SERVICE: u32 = 13;
const TYPE_BITS: u32 = 6;
const SET_MAP: u32 = 0x08;
const SET_TIMEOUT: u32 = 0x10;
const SET_EVAL: u32 = 0x20;
/// NFT_DATA_VERDICT: a map's values are verdicts.
const DATA_VERDICT: u32 = 0xffff_ff00;
/// nft's set user data (NFTNL_UDATA_SET_*), byte for byte what nft 1.0.6 sends, so that
/// `nft list` prints our sets as it prints its own: a set of addresses keeps its key in
/// network byte order; a verdict map of a concatenation also says how its parts read.
fn udata_address_set() -> Vec<u8> {
    let mut u = vec![0u8, 4];
    u.extend(2u32.to_ne_bytes()); // KEYBYTEORDER: big-endian
    u
}

fn udata_concat_map() -> Vec<u8> {
    let mut u = Vec::with_capacity(28);
    for (kind, value) in [(0u8, 0u32), (1, 0)] {
        u.extend([kind, 4]); // KEYBYTEORDER, DATABYTEORDER
        u.extend(value.to_ne_bytes());
    }
    u.extend([3, 8, 0, 4]);
    u.extend(TYPE_INET_SERVICE.to_ne_bytes());
    u.extend([1, 0]);
    u.extend([6, 4]); // DATA_INTERVAL: no
    u.extend(0u32.to_ne_bytes());
    u
}
/// Elements per message, and the bytes an element list may grow to before the message is
/// sent: the list is one attribute, whose length is 16 bits (an element of a verdict map
/// with the longest names is ~230 bytes).
const ELEMENTS_PER_MESSAGE: usize = 256;
const ELEMENT_BYTES: usize = 32 * 1024;

/// What [`encode_script`] does not translate: the line, for the log.
#[derive(Debug, PartialEq, Eq)]
pub struct Unsupported(pub String);

/// The address family of the table a command names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Ip,
    Ip6,
}

impl Family {
    fn parse(word: &str) -> Option<Self> {
        match word {
            "ip" => Some(Family::Ip),
            "ip6" => Some(Family::Ip6),
            _ => None,
        }
    }

    fn nfproto(self) -> u8 {
        match self {
            Family::Ip => NFPROTO_IPV4,
            Family::Ip6 => NFPROTO_IPV6,
        }
    }

    fn addr(self, text: &str) -> Option<IpAddr> {
        let addr: IpAddr = text.parse().ok()?;
        (addr.is_ipv4() == (self == Family::Ip)).then_some(addr)
    }

    /// Where the source (`saddr`) or destination address sits in the network header.
    fn addr_offset(self, field: &str) -> Option<u32> {
        match (self, field) {
            (Family::Ip, "saddr") => Some(12),
            (Family::Ip, "daddr") => Some(16),
            (Family::Ip6, "saddr") => Some(8),
            (Family::Ip6, "daddr") => Some(24),
            _ => None,
        }
    }

    fn addr_len(self) -> usize {
        match self {
            Family::Ip => 4,
            Family::Ip6 => 16,
        }
    }
}

fn addr_bytes(addr: IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// The protocol number of nft's name for it (the names the rules are written with).
fn l4proto(name: &str) -> Option<u8> {
    [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
        .into_iter()
        .find(|p| protocol(*p) == name)
        .map(Protocol::number)
}

fn be32(v: u32) -> [u8; 4] {
    v.to_be_bytes()
}

/// The table a message is about and the object in it (chain, rule's chain, set):
/// attribute 1 of every nf_tables message kind is the table.
fn table_and(buf: &mut Vec<u8>, table: &str, kind: u16, name: &str) {
    attr_str(buf, 1, table);
    attr_str(buf, kind, name);
}

/// One expression: its name and attributes.
fn expr(list: &mut Vec<u8>, name: &str, fill: impl FnOnce(&mut Vec<u8>)) {
    nested(list, 1 /* NFTA_LIST_ELEM */, |e| {
        attr_str(e, 1 /* NFTA_EXPR_NAME */, name);
        nested(e, 2 /* NFTA_EXPR_DATA */, fill);
    });
}

fn data_value(buf: &mut Vec<u8>, kind: u16, value: &[u8]) {
    nested(buf, kind, |d| attr(d, 1 /* NFTA_DATA_VALUE */, value));
}

/// The register nft names for the 32-bit register `index` (0 = the first of the data
/// registers): a 16-byte register's number where one starts there, else the 32-bit one's.
fn reg32(index: u32) -> u32 {
    if index.is_multiple_of(4) {
        REG_1 + index / 4
    } else {
        8 + index
    }
}

fn payload(list: &mut Vec<u8>, base: u32, offset: u32, len: u32) {
    payload_to(list, REG_1, base, offset, len)
}

fn payload_to(list: &mut Vec<u8>, dreg: u32, base: u32, offset: u32, len: u32) {
    expr(list, "payload", |e| {
        attr(e, 1 /* DREG */, &be32(dreg));
        attr(e, 2 /* BASE */, &be32(base));
        attr(e, 3 /* OFFSET */, &be32(offset));
        attr(e, 4 /* LEN */, &be32(len));
    });
}

fn cmp(list: &mut Vec<u8>, op: u32, value: &[u8]) {
    expr(list, "cmp", |e| {
        attr(e, 1 /* SREG */, &be32(REG_1));
        attr(e, 2 /* OP */, &be32(op));
        data_value(e, 3 /* DATA */, value);
    });
}

fn meta_load(list: &mut Vec<u8>, key: u32) {
    meta_to(list, REG_1, key)
}

fn meta_to(list: &mut Vec<u8>, dreg: u32, key: u32) {
    expr(list, "meta", |e| {
        attr(e, 1 /* DREG */, &be32(dreg));
        attr(e, 2 /* KEY */, &be32(key));
    });
}

fn bitwise(list: &mut Vec<u8>, mask: &[u8], xor: &[u8]) {
    expr(list, "bitwise", |e| {
        attr(e, 1 /* SREG */, &be32(REG_1));
        attr(e, 2 /* DREG */, &be32(REG_1));
        attr(e, 3 /* LEN */, &be32(mask.len() as u32));
        data_value(e, 4 /* MASK */, mask);
        data_value(e, 5 /* XOR */, xor);
    });
}

fn verdict(buf: &mut Vec<u8>, kind: u16, code: i32, chain: Option<&str>) {
    nested(buf, kind, |d| {
        nested(d, 2 /* NFTA_DATA_VERDICT */, |v| {
            attr(v, 1 /* CODE */, &code.to_be_bytes());
            if let Some(chain) = chain {
                attr_str(v, 2 /* CHAIN */, chain);
            }
        })
    });
}

fn immediate(list: &mut Vec<u8>, reg: u32, value: &[u8]) {
    expr(list, "immediate", |e| {
        attr(e, 1 /* DREG */, &be32(reg));
        data_value(e, 2 /* DATA */, value);
    });
}

/// `jump X`, `goto X`, `drop`, `return`: (code, chain).
fn parse_verdict<'a>(words: &[&'a str]) -> Option<(i32, Option<&'a str>)> {
    match words {
        ["jump", chain] => Some((NFT_JUMP, Some(chain))),
        ["goto", chain] => Some((NFT_GOTO, Some(chain))),
        ["drop"] => Some((NF_DROP, None)),
        ["return"] => Some((NFT_RETURN, None)),
        _ => None,
    }
}

/// A lookup of the key in REG_1 in `set`; with a verdict map, its element's verdict.
fn lookup(list: &mut Vec<u8>, set: &str, verdict_map: bool) {
    expr(list, "lookup", |e| {
        attr(e, 2 /* SREG */, &be32(REG_1));
        if verdict_map {
            attr(e, 3 /* DREG */, &be32(REG_VERDICT));
        }
        attr_str(e, 1 /* SET */, set);
    });
}

/// `meta l4proto . th dport`, loaded after a key part of `at` bytes (for a concatenation).
fn protocol_and_port(list: &mut Vec<u8>, at: u32) {
    meta_to(list, reg32(at / 4), META_L4PROTO);
    payload_to(list, reg32(at / 4 + 1), PAYLOAD_TRANSPORT, 2, 2);
}

/// A NAT statement taking its address from REG_1 (and its port from REG_2 if `port`).
fn nat(list: &mut Vec<u8>, family: Family, kind: u32, port: bool, flags: u32) {
    expr(list, "nat", |e| {
        attr(e, 1 /* TYPE */, &be32(kind));
        attr(e, 2 /* FAMILY */, &be32(u32::from(family.nfproto())));
        attr(e, 3 /* REG_ADDR_MIN */, &be32(REG_1));
        if port {
            attr(e, 5 /* REG_PROTO_MIN */, &be32(REG_2));
        }
        attr(e, 7 /* FLAGS */, &be32(flags));
    });
}

fn reject(list: &mut Vec<u8>, kind: u32, code: u8) {
    expr(list, "reject", |e| {
        attr(e, 1 /* TYPE */, &be32(kind));
        attr(e, 2 /* ICMP_CODE */, &[code]);
    });
}

/// An address match (`ip saddr 10.0.0.1`, `ip6 daddr != fd00::/56`), as nft encodes it: a
/// byte-aligned prefix compares only its bytes, another one is masked first.
fn address_match(
    list: &mut Vec<u8>,
    family: Family,
    offset: u32,
    op: u32,
    value: &str,
) -> Option<()> {
    let (addr, prefix) = match value.split_once('/') {
        Some((a, p)) => (family.addr(a)?, p.parse::<usize>().ok()?),
        None => (family.addr(value)?, family.addr_len() * 8),
    };
    let bytes = addr_bytes(addr);
    let full = family.addr_len();
    if prefix == 0 || prefix > full * 8 {
        return None;
    }
    if prefix % 8 == 0 {
        payload(list, PAYLOAD_NETWORK, offset, (prefix / 8) as u32);
        cmp(list, op, &bytes[..prefix / 8]);
    } else {
        let mask: Vec<u8> = (0..full)
            .map(|i| {
                let bits = prefix.saturating_sub(i * 8).min(8);
                (0xffu16 << (8 - bits)) as u8
            })
            .collect();
        let masked: Vec<u8> = bytes.iter().zip(&mask).map(|(b, m)| b & m).collect();
        payload(list, PAYLOAD_NETWORK, offset, full as u32);
        bitwise(list, &mask, &vec![0; full]);
        cmp(list, op, &masked);
    }
    Some(())
}

/// An input-interface match (`iifname "cbr0"`, `iifname != "veth*"`), as nft encodes it:
/// a name is compared with its terminating zeros (IFNAMSIZ bytes), a `prefix*` only over
/// the prefix's bytes.
fn interface_match(list: &mut Vec<u8>, op: u32, quoted: &str) -> Option<()> {
    const IFNAMSIZ: usize = 16;
    let name = quoted.strip_prefix('"')?.strip_suffix('"')?;
    meta_load(list, META_IIFNAME);
    match name.strip_suffix('*') {
        Some(prefix) if !prefix.is_empty() && prefix.len() < IFNAMSIZ => {
            cmp(list, op, prefix.as_bytes())
        }
        None if !name.is_empty() && name.len() < IFNAMSIZ => {
            let mut padded = [0u8; IFNAMSIZ];
            padded[..name.len()].copy_from_slice(name.as_bytes());
            cmp(list, op, &padded)
        }
        _ => return None,
    }
    Some(())
}

fn hex_mark(word: &str) -> Option<u32> {
    u32::from_str_radix(word.strip_prefix("0x")?, 16).ok()
}

/// The expressions of one rule of [`super::rules`]'s shapes, or None.
fn rule_expressions(family: Family, rule: &str) -> Option<Vec<u8>> {
    let words: Vec<&str> = rule.split_whitespace().collect();
    let mut list = Vec::new();
    let mut w = &words[..];
    while !w.is_empty() {
        w = match w {
            // The service lookup: `ip daddr . meta l4proto . th dport vmap @service-ips`.
            [ip, "daddr", ".", "meta", "l4proto", ".", "th", "dport", "vmap", map]
                if Family::parse(ip) == Some(family) =>
            {
                let len = family.addr_len() as u32;
                payload(
                    &mut list,
                    PAYLOAD_NETWORK,
                    family.addr_offset("daddr")?,
                    len,
                );
                protocol_and_port(&mut list, len);
                lookup(&mut list, map.strip_prefix('@')?, true);
                &[]
            }
            // The NodePort lookup, after the address is found in the node's set.
            ["meta", "l4proto", ".", "th", "dport", "vmap", map] => {
                protocol_and_port(&mut list, 0);
                lookup(&mut list, map.strip_prefix('@')?, true);
                &[]
            }
            ["ct", "state", "new", rest @ ..] => {
                expr(&mut list, "ct", |e| {
                    attr(e, 1 /* DREG */, &be32(REG_1));
                    attr(e, 2 /* KEY */, &be32(CT_STATE));
                });
                bitwise(&mut list, &CT_STATE_NEW.to_ne_bytes(), &0u32.to_ne_bytes());
                cmp(&mut list, CMP_NEQ, &0u32.to_ne_bytes());
                rest
            }
            [ip, field, rest @ ..]
                if Family::parse(ip) == Some(family) && matches!(*field, "saddr" | "daddr") =>
            {
                let offset = family.addr_offset(field)?;
                let (op, rest) = match rest {
                    ["!=", rest @ ..] => (CMP_NEQ, rest),
                    rest => (CMP_EQ, rest),
                };
                let (value, rest) = rest.split_first()?;
                if let Some(set) = value.strip_prefix('@') {
                    if op != CMP_EQ {
                        return None;
                    }
                    payload(&mut list, PAYLOAD_NETWORK, offset, family.addr_len() as u32);
                    lookup(&mut list, set, false);
                } else {
                    address_match(&mut list, family, offset, op, value)?;
                }
                rest
            }
            [proto, "dport", port, rest @ ..] => {
                let proto = l4proto(proto)?;
                let port: u16 = port.parse().ok()?;
                meta_load(&mut list, META_L4PROTO);
                cmp(&mut list, CMP_EQ, &[proto]);
                payload(&mut list, PAYLOAD_TRANSPORT, 2, 2);
                cmp(&mut list, CMP_EQ, &port.to_be_bytes());
                rest
            }
            ["fib", "saddr", "type", "local", rest @ ..] => {
                expr(&mut list, "fib", |e| {
                    attr(e, 1 /* DREG */, &be32(REG_1));
                    attr(
                        e,
                        2, /* RESULT */
                        &be32(3 /* NFT_FIB_RESULT_ADDRTYPE */),
                    );
                    attr(e, 3 /* FLAGS */, &be32(1 /* NFTA_FIB_F_SADDR */));
                });
                cmp(&mut list, CMP_EQ, &2u32.to_ne_bytes() /* RTN_LOCAL */);
                rest
            }
            ["iifname", rest @ ..] => {
                let (op, rest) = match rest {
                    ["!=", rest @ ..] => (CMP_NEQ, rest),
                    rest => (CMP_EQ, rest),
                };
                let (value, rest) = rest.split_first()?;
                interface_match(&mut list, op, value)?;
                rest
            }
            ["numgen", "random", "mod", n, "==", "0", rest @ ..] => {
                let n: u32 = n.parse().ok()?;
                expr(&mut list, "numgen", |e| {
                    attr(e, 1 /* DREG */, &be32(REG_1));
                    attr(e, 2 /* MODULUS */, &be32(n));
                    attr(e, 3 /* TYPE */, &be32(1 /* NFT_NG_RANDOM */));
                    attr(e, 4 /* OFFSET */, &be32(0));
                });
                cmp(&mut list, CMP_EQ, &0u32.to_ne_bytes());
                rest
            }
            ["meta", "mark", "&", mask, op @ ("!=" | "=="), "0", rest @ ..] => {
                let mask = hex_mark(mask)?;
                meta_load(&mut list, META_MARK);
                bitwise(&mut list, &mask.to_ne_bytes(), &0u32.to_ne_bytes());
                let op = if *op == "==" { CMP_EQ } else { CMP_NEQ };
                cmp(&mut list, op, &0u32.to_ne_bytes());
                rest
            }
            ["meta", "mark", "set", "meta", "mark", op @ ("|" | "^"), bits, rest @ ..] => {
                let bits = hex_mark(bits)?;
                // `|` keeps the other bits and sets these; `^` keeps all and flips these.
                let mask = if *op == "|" { !bits } else { u32::MAX };
                meta_load(&mut list, META_MARK);
                bitwise(&mut list, &mask.to_ne_bytes(), &bits.to_ne_bytes());
                expr(&mut list, "meta", |e| {
                    attr(e, 2 /* KEY */, &be32(META_MARK));
                    attr(e, 3 /* SREG */, &be32(REG_1));
                });
                rest
            }
            ["meta", "l4proto", proto, rest @ ..] => {
                meta_load(&mut list, META_L4PROTO);
                cmp(&mut list, CMP_EQ, &[l4proto(proto)?]);
                rest
            }
            ["update", set, "{", ip, "saddr", "}", rest @ ..]
                if Family::parse(ip) == Some(family) =>
            {
                let set = set.strip_prefix('@')?;
                payload(
                    &mut list,
                    PAYLOAD_NETWORK,
                    family.addr_offset("saddr")?,
                    family.addr_len() as u32,
                );
                expr(&mut list, "dynset", |e| {
                    attr_str(e, 1 /* SET_NAME */, set);
                    attr(e, 3 /* OP */, &be32(1 /* NFT_DYNSET_OP_UPDATE */));
                    attr(e, 4 /* SREG_KEY */, &be32(REG_1));
                });
                rest
            }
            ["dnat", "to", to, rest @ ..] => {
                let to: SocketAddr = to.parse().ok()?;
                family.addr(&to.ip().to_string())?;
                immediate(&mut list, REG_1, &addr_bytes(to.ip()));
                immediate(&mut list, REG_2, &to.port().to_be_bytes());
                nat(
                    &mut list, family, NAT_DNAT, true, 2, /* NF_NAT_RANGE_PROTO_SPECIFIED */
                );
                rest
            }
            ["snat", "to", to, "fully-random"] => {
                immediate(&mut list, REG_1, &addr_bytes(family.addr(to)?));
                nat(&mut list, family, NAT_SNAT, false, NAT_RANDOM_FULLY);
                &[]
            }
            ["masquerade", "fully-random"] => {
                expr(&mut list, "masq", |e| {
                    attr(e, 1 /* FLAGS */, &be32(NAT_RANDOM_FULLY))
                });
                &[]
            }
            ["reject", "with", "tcp", "reset"] => {
                reject(&mut list, 1 /* NFT_REJECT_TCP_RST */, 0);
                &[]
            }
            ["reject"] => {
                // ICMP port unreachable: code 3 in ICMP, 4 in ICMPv6.
                let code = if family == Family::Ip { 3 } else { 4 };
                reject(&mut list, 0 /* NFT_REJECT_ICMP_UNREACH */, code);
                &[]
            }
            [kind @ ("jump" | "goto" | "drop" | "return"), ..] => {
                let n = if matches!(*kind, "drop" | "return") {
                    1
                } else {
                    2
                };
                if w.len() != n {
                    return None;
                }
                let (code, chain) = parse_verdict(w)?;
                expr(&mut list, "immediate", |e| {
                    attr(e, 1 /* DREG */, &be32(REG_VERDICT));
                    verdict(e, 2 /* DATA */, code, chain);
                });
                &[]
            }
            _ => return None,
        };
    }
    Some(list)
}

/// One element's key: `10.96.0.1 . tcp . 80`, `tcp . 30080`, `192.168.1.1` (each part of a
/// concatenation padded to 4 bytes, as the kernel's registers hold it).
fn element_key(family: Family, key: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let parts: Vec<&str> = key.split(" . ").collect();
    for (i, part) in parts.iter().enumerate() {
        let part = part.trim();
        if let Some(addr) = family.addr(part) {
            if i != 0 {
                return None;
            }
            out.extend(addr_bytes(addr));
        } else if let Some(proto) = l4proto(part) {
            out.extend([proto, 0, 0, 0]);
        } else if let Ok(port) = part.parse::<u16>() {
            if i == 0 {
                return None;
            }
            out.extend(port.to_be_bytes());
            out.extend([0, 0]);
        } else {
            return None;
        }
    }
    Some(out)
}

/// The elements between the braces of `{ a : goto b, c : drop }`.
fn braced(body: &str) -> Option<Vec<&str>> {
    let inner = body.trim().strip_prefix('{')?.strip_suffix('}')?.trim();
    Some(if inner.is_empty() {
        Vec::new()
    } else {
        inner.split(", ").map(str::trim).collect()
    })
}

/// A transaction as netlink messages (between the batch's begin and end messages, ready
/// to send without another copy), and the script line each message came from.
pub struct Batch {
    bytes: Vec<u8>,
    /// The script line (from 0) of each message, by sequence number - 1.
    lines: Vec<u32>,
    /// Where the last message starts in `bytes`.
    last: usize,
    next_set_id: u32,
}

/// A hook's number and a priority's value, from their names in a base chain's spec.
fn hook_number(name: &str) -> Option<u32> {
    ["prerouting", "input", "forward", "output", "postrouting"]
        .iter()
        .position(|h| *h == name)
        .map(|i| i as u32)
}

fn priority(word: &str) -> Option<i32> {
    match word {
        "dstnat" => Some(-100),
        "filter" => Some(0),
        "srcnat" => Some(100),
        other => other.parse().ok(),
    }
}

/// One element's parts: `10.0.0.9 timeout 10800s expires 5000ms : goto x` → key, timeout
/// and expiry (ms), verdict words.
struct ElementText<'a> {
    key: &'a str,
    timeout: Option<u64>,
    expires: Option<u64>,
    value: Vec<&'a str>,
}

fn milliseconds(word: &str) -> Option<u64> {
    match word.strip_suffix("ms") {
        Some(ms) => ms.parse().ok(),
        None => word
            .strip_suffix('s')?
            .parse::<u64>()
            .ok()?
            .checked_mul(1000),
    }
}

fn element_text(element: &str) -> Option<ElementText<'_>> {
    let (key, value) = element.split_once(" : ").unwrap_or((element, ""));
    let (key, options) = match key.find(" timeout ").or_else(|| key.find(" expires ")) {
        Some(at) => (&key[..at], &key[at + 1..]),
        None => (key, ""),
    };
    let mut parsed = ElementText {
        key,
        timeout: None,
        expires: None,
        value: value.split_whitespace().collect(),
    };
    let words: Vec<&str> = options.split_whitespace().collect();
    for pair in words.chunks(2) {
        match pair {
            ["timeout", t] if parsed.timeout.is_none() => parsed.timeout = Some(milliseconds(t)?),
            ["expires", t] if parsed.expires.is_none() => parsed.expires = Some(milliseconds(t)?),
            _ => return None,
        }
    }
    Some(parsed)
}

/// The header of the batch begin and end messages: the nf_tables subsystem (res_id).
fn batch_header() -> [u8; 4] {
    let res_id = NFNL_SUBSYS_NFTABLES.to_be_bytes();
    [0, 0, res_id[0], res_id[1]]
}

impl Default for Batch {
    fn default() -> Self {
        let begin = nlattr::message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 0, batch_header(), &[]);
        Batch {
            bytes: begin,
            lines: Vec::new(),
            last: 0,
            next_set_id: 0,
        }
    }
}

impl Batch {
    fn push(&mut self, line: u32, family: Family, msg: u16, flags: u16, attrs: &[u8]) {
        let seq = self.lines.len() as u32 + 1;
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | msg;
        self.last = self.bytes.len();
        // No acknowledgement asked for each message: the kernel reports every failing
        // one anyway, and a million answers cost more than the transaction itself.
        self.bytes.extend(nlattr::message(
            kind,
            NLM_F_REQUEST | flags,
            seq,
            [family.nfproto(), 0, 0, 0],
            attrs,
        ));
        self.lines.push(line);
    }

    /// How many messages the transaction holds.
    pub fn len(&self) -> usize {
        self.lines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    fn set_id(&mut self) -> [u8; 4] {
        self.next_set_id += 1;
        be32(self.next_set_id)
    }

    /// `{ type nat hook prerouting priority dstnat ; policy accept ; }`: the chain's type,
    /// hook and priority attributes.
    fn base_chain(a: &mut Vec<u8>, body: &str) -> Option<()> {
        let spec: Vec<&str> = body.split_whitespace().collect();
        let ["{", "type", kind @ ("nat" | "filter"), "hook", hook, "priority", prio, ";", "policy", "accept", ";", "}"] =
            spec.as_slice()
        else {
            return None;
        };
        let (hook, prio) = (hook_number(hook)?, priority(prio)?);
        attr_str(a, 7 /* NFTA_CHAIN_TYPE */, kind);
        attr(a, 5 /* NFTA_CHAIN_POLICY */, &be32(NF_ACCEPT));
        nested(a, 4 /* NFTA_CHAIN_HOOK */, |h| {
            attr(h, 1 /* NFTA_HOOK_HOOKNUM */, &be32(hook));
            attr(h, 2 /* NFTA_HOOK_PRIORITY */, &prio.to_be_bytes());
        });
        Some(())
    }

    /// A set or map's type attributes, from its spec: the static part's verdict maps and
    /// address set, or an affinity set (`flags dynamic,timeout`).
    fn set_spec(&mut self, a: &mut Vec<u8>, family: Family, body: &str) -> Option<()> {
        let spec: Vec<&str> = body.split_whitespace().collect();
        let addr_type = |t: &str| match (t, family) {
            ("ipv4_addr", Family::Ip) => Some((TYPE_IPADDR, 4u32)),
            ("ipv6_addr", Family::Ip6) => Some((TYPE_IP6ADDR, 16)),
            _ => None,
        };
        let port_type = (TYPE_INET_PROTOCOL << TYPE_BITS) | TYPE_INET_SERVICE;
        let (flags, key_type, key_len, timeout, map, udata) = match spec.as_slice() {
            ["{", "type", t, ".", "inet_proto", ".", "inet_service", ":", "verdict", ";", "}"] => {
                let (t, len) = addr_type(t)?;
                let key = (t << (2 * TYPE_BITS)) | port_type;
                (SET_MAP, key, len + 8, None, true, udata_concat_map())
            }
            ["{", "type", "inet_proto", ".", "inet_service", ":", "verdict", ";", "}"] => {
                (SET_MAP, port_type, 8, None, true, udata_concat_map())
            }
            ["{", "type", t, ";", "}"] => {
                let (t, len) = addr_type(t)?;
                (0, t, len, None, false, udata_address_set())
            }
            ["{", "type", t, ";", "flags", "dynamic,timeout", ";", "timeout", timeout, ";", "}"] => {
                let (t, len) = addr_type(t)?;
                let ms = milliseconds(timeout)?;
                (
                    SET_TIMEOUT | SET_EVAL,
                    t,
                    len,
                    Some(ms),
                    false,
                    udata_address_set(),
                )
            }
            _ => return None,
        };
        attr(a, 3 /* NFTA_SET_FLAGS */, &be32(flags));
        attr(a, 4 /* NFTA_SET_KEY_TYPE */, &be32(key_type));
        attr(a, 5 /* NFTA_SET_KEY_LEN */, &be32(key_len));
        if map {
            attr(a, 6 /* NFTA_SET_DATA_TYPE */, &be32(DATA_VERDICT));
            attr(a, 7 /* NFTA_SET_DATA_LEN */, &be32(0));
        }
        attr(a, 10 /* NFTA_SET_ID */, &self.set_id());
        if let Some(ms) = timeout {
            attr(a, 11 /* NFTA_SET_TIMEOUT */, &ms.to_be_bytes());
        }
        attr(a, 13 /* NFTA_SET_USERDATA */, &udata);
        Some(())
    }

    /// `add|delete element`: a message per [`ELEMENTS_PER_MESSAGE`] elements or
    /// [`ELEMENT_BYTES`] of them, whichever comes first.
    fn elements(
        &mut self,
        n: u32,
        family: Family,
        table: &str,
        set: &str,
        add: bool,
        body: &str,
    ) -> Option<()> {
        let elements = braced(body)?;
        let mut list = Vec::new();
        let mut count = 0;
        for (i, element) in elements.iter().enumerate() {
            let e = element_text(element)?;
            let key = element_key(family, e.key)?;
            let data = match (add, e.value.as_slice()) {
                (_, []) => None,
                (true, v) => Some(parse_verdict(v)?),
                (false, _) => return None,
            };
            if !add && (e.timeout.is_some() || e.expires.is_some()) {
                return None;
            }
            nested(&mut list, 1 /* NFTA_LIST_ELEM */, |a| {
                data_value(a, 1 /* NFTA_SET_ELEM_KEY */, &key);
                if let Some((code, chain)) = data {
                    verdict(a, 2 /* NFTA_SET_ELEM_DATA */, code, chain);
                }
                if let Some(ms) = e.timeout {
                    attr(a, 4 /* NFTA_SET_ELEM_TIMEOUT */, &ms.to_be_bytes());
                }
                if let Some(ms) = e.expires {
                    attr(a, 5 /* NFTA_SET_ELEM_EXPIRATION */, &ms.to_be_bytes());
                }
            });
            count += 1;
            let last = i + 1 == elements.len();
            if !last && count < ELEMENTS_PER_MESSAGE && list.len() < ELEMENT_BYTES {
                continue;
            }
            let mut a = Vec::new();
            table_and(&mut a, table, 2 /* NFTA_SET_ELEM_LIST_SET */, set);
            attr(
                &mut a,
                3 /* NFTA_SET_ELEM_LIST_ELEMENTS */ | NLA_F_NESTED,
                &std::mem::take(&mut list),
            );
            count = 0;
            if add {
                self.push(n, family, NEWSETELEM, NLM_F_CREATE, &a);
            } else {
                self.push(n, family, DELSETELEM, 0, &a);
            }
        }
        Some(())
    }

    fn command(&mut self, n: u32, line: &str) -> Option<()> {
        let words: Vec<&str> = line.splitn(5, ' ').collect();
        let [verb, kind, family, table, rest @ ..] = words.as_slice() else {
            return None;
        };
        let family = Family::parse(family)?;
        let rest = rest.first().copied().unwrap_or_default();
        let (name, body) = rest.split_once(' ').unwrap_or((rest, ""));
        let mut a = Vec::new();
        match (*verb, *kind) {
            ("add" | "delete", "table") if rest.is_empty() => {
                attr_str(&mut a, 1 /* NFTA_TABLE_NAME */, table);
                if *verb == "add" {
                    self.push(n, family, NEWTABLE, NLM_F_CREATE, &a);
                } else {
                    // The kernel empties the table (rules, maps, chains) itself.
                    self.push(n, family, DELTABLE, 0, &a);
                }
            }
            ("add", "chain") if !name.is_empty() => {
                table_and(&mut a, table, 3 /* NFTA_CHAIN_NAME */, name);
                if !body.is_empty() {
                    Self::base_chain(&mut a, body)?;
                }
                self.push(n, family, NEWCHAIN, NLM_F_CREATE, &a);
            }
            ("delete", "chain") if !name.is_empty() && body.is_empty() => {
                table_and(&mut a, table, 3 /* NFTA_CHAIN_NAME */, name);
                self.push(n, family, DELCHAIN, 0, &a);
            }
            ("flush", "chain") if !name.is_empty() && body.is_empty() => {
                table_and(&mut a, table, 2 /* NFTA_RULE_CHAIN */, name);
                self.push(n, family, DELRULE, 0, &a);
            }
            ("add", "rule") => {
                let expressions = rule_expressions(family, body)?;
                table_and(&mut a, table, 2 /* NFTA_RULE_CHAIN */, name);
                attr(
                    &mut a,
                    4 /* NFTA_RULE_EXPRESSIONS */ | NLA_F_NESTED,
                    &expressions,
                );
                self.push(n, family, NEWRULE, NLM_F_CREATE | NLM_F_APPEND, &a);
            }
            ("add", "set" | "map") if !name.is_empty() => {
                table_and(&mut a, table, 2 /* NFTA_SET_NAME */, name);
                self.set_spec(&mut a, family, body)?;
                // A map's spec says `: verdict`, a set's does not.
                if (*kind == "map") != body.contains(": verdict") {
                    return None;
                }
                self.push(n, family, NEWSET, NLM_F_CREATE, &a);
            }
            ("delete", "set" | "map") if !name.is_empty() && body.is_empty() => {
                table_and(&mut a, table, 2 /* NFTA_SET_NAME */, name);
                self.push(n, family, DELSET, 0, &a);
            }
            ("flush", "set" | "map") if !name.is_empty() && body.is_empty() => {
                // Deleting elements without naming any empties the set.
                table_and(&mut a, table, 2 /* NFTA_SET_ELEM_LIST_SET */, name);
                self.push(n, family, DELSETELEM, 0, &a);
            }
            (verb @ ("add" | "delete"), "element") => {
                self.elements(n, family, table, name, verb == "add", body)?;
            }
            _ => return None,
        }
        Some(())
    }
}

/// The script as one netlink transaction, or the first line it cannot translate.
pub fn encode_script(script: &str) -> Result<Batch, Unsupported> {
    let mut batch = Batch::default();
    for (n, line) in script.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        batch
            .command(n as u32, line)
            .ok_or_else(|| Unsupported(line.to_string()))?;
    }
    if batch.is_empty() {
        return Ok(batch);
    }
    // The last message is the one acknowledged: its answer says the transaction applied.
    if let Some(flags) = batch.bytes.get_mut(batch.last + 6..batch.last + 8) {
        let with_ack = u16::from_ne_bytes([flags[0], flags[1]]) | NLM_F_ACK;
        flags.copy_from_slice(&with_ack.to_ne_bytes());
    }
    let end_seq = batch.len() as u32 + 1;
    batch.bytes.extend(nlattr::message(
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST,
        end_seq,
        batch_header(),
        &[],
    ));
    Ok(batch)
}

fn set_buffer(socket: &netlink_sys::Socket, option: libc::c_int, bytes: usize) {
    let size = bytes.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: a valid socket and an int option value of the right size.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            &size as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

fn family_number(family: &str) -> Result<u8> {
    Family::parse(family)
        .map(Family::nfproto)
        .with_context(|| format!("no nf_tables family {family:?}"))
}

/// Whether the kernel has nf_tables and this process may use it (one request for a table
/// by name). The agent needs no `nft` command: it speaks netlink itself.
pub fn probe() -> Result<()> {
    table_exists("ip", super::rules::TABLE)
        .map(|_| ())
        .context("asking the kernel's nf_tables over netlink")
}

/// Whether `family` (`ip` / `ip6`) has the table `table`: one request for that table,
/// answered at once whatever else the ruleset holds (nft fetches the whole ruleset before
/// listing even the table names: minutes behind 100 000 services' chains).
pub fn table_exists(family: &str, table: &str) -> Result<bool> {
    let nfproto = family_number(family)?;
    let socket = nlattr::open(NETLINK_NETFILTER, "nf_tables netlink")?;
    let mut name = Vec::new();
    attr_str(&mut name, 1 /* NFTA_TABLE_NAME */, table);
    let request = nlattr::message(
        (NFNL_SUBSYS_NFTABLES << 8) | GETTABLE,
        NLM_F_REQUEST | NLM_F_ACK,
        1,
        [nfproto, 0, 0, 0],
        &name,
    );
    socket
        .send(&request, 0)
        .context("asking nf_tables for a table")?;
    match nlattr::receive(&socket, 1, "nf_tables netlink", |_| {}) {
        Ok(()) => Ok(true),
        Err(e) if nlattr::errno(&e) == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The elements of the address set `set` (an affinity set), with the time each has left;
/// empty if there is no such set. One dump of that set alone.
pub fn address_elements(family: &str, table: &str, set: &str) -> Result<Vec<Element>> {
    let nfproto = family_number(family)?;
    let socket = nlattr::open(NETLINK_NETFILTER, "nf_tables netlink")?;
    let mut a = Vec::new();
    table_and(&mut a, table, 2 /* NFTA_SET_ELEM_LIST_SET */, set);
    let request = nlattr::message(
        (NFNL_SUBSYS_NFTABLES << 8) | GETSETELEM,
        NLM_F_REQUEST | nlattr::NLM_F_DUMP,
        1,
        [nfproto, 0, 0, 0],
        &a,
    );
    socket
        .send(&request, 0)
        .context("asking nf_tables for a set's elements")?;
    let mut out = Vec::new();
    let answer = nlattr::receive(&socket, 1, "nf_tables netlink", |body| {
        let lists = nlattr::attrs(body).filter(|(k, _)| *k == 3 /* ELEMENTS */);
        for (_, list) in lists {
            for (_, element) in nlattr::attrs(list) {
                if let Some(e) = decode_element(element) {
                    out.push(e);
                }
            }
        }
    });
    match answer {
        Ok(()) => Ok(out),
        Err(e) if nlattr::errno(&e) == Some(libc::ENOENT) => Ok(Vec::new()),
        Err(e) => Err(e).with_context(|| format!("reading the elements of {family} {table} {set}")),
    }
}

/// An address element of a dump: its key as text and the milliseconds it has left.
fn decode_element(element: &[u8]) -> Option<Element> {
    let mut key = None;
    let mut expires = None;
    for (kind, value) in nlattr::attrs(element) {
        match kind {
            1 /* KEY */ => {
                let (_, bytes) = nlattr::attrs(value).find(|(k, _)| *k == 1)?;
                key = Some(match bytes.len() {
                    4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
                    16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
                    _ => return None,
                });
            }
            5 /* EXPIRATION */ => expires = Some(u64::from_be_bytes(value.try_into().ok()?)),
            _ => {}
        }
    }
    Some(Element {
        key: key?.to_string(),
        expires_ms: expires,
    })
}

/// Sends `batch` (the translation of `script`) as one transaction — begin, its messages,
/// end — and reads the kernel's answers. The kernel runs the batch inside the send, so
/// every answer is queued when it returns: an error for each message it refused (or, at
/// sequence 0, for the commit), and the acknowledgement of the last message, which comes
/// whether or not the transaction applied: applied means that and no error.
pub fn send(batch: &Batch, script: &str) -> Result<()> {
    if batch.is_empty() {
        return Ok(());
    }
    let socket = nlattr::open(NETLINK_NETFILTER, "nf_tables netlink")?;
    let bytes = &batch.bytes;
    // Room for the whole batch and for the errors of a failing one (SO_*BUFFORCE: we hold
    // CAP_NET_ADMIN; the plain options are capped by the sysctls).
    set_buffer(&socket, libc::SO_SNDBUFFORCE, bytes.len() * 2 + (1 << 16));
    set_buffer(&socket, libc::SO_RCVBUFFORCE, 1 << 22);
    // An error answer without a copy of the (possibly large) message it answers.
    let _ = socket.set_cap_ack(true);
    socket
        .send(bytes, 0)
        .context("sending the nf_tables transaction")?;

    let last = batch.len() as u32;
    let mut applied = false;
    // The first failure, by sequence number, and how many there were.
    let mut first: Option<(u32, i32)> = None;
    let mut failures = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match socket.recv(&mut &mut buf[..], libc::MSG_DONTWAIT) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e).context("reading the nf_tables answers"),
        };
        for (seq, code) in nlattr::acks(&buf[..n]) {
            if code == 0 {
                applied |= seq == last;
                continue;
            }
            failures += 1;
            if first.is_none_or(|(s, _)| seq < s) {
                first = Some((seq, code));
            }
        }
    }
    if let Some((seq, code)) = first {
        // Only the first failure's line is looked up: a failing full sync may have
        // millions of lines and as many errors.
        let what = match batch.lines.get((seq as usize).wrapping_sub(1)) {
            Some(&line) => {
                let text = script.lines().nth(line as usize).unwrap_or_default();
                format!("{:?}", text.trim())
            }
            None => "the commit".to_string(),
        };
        bail!(
            "nf_tables refused the transaction ({failures} error{}), at {what}: {}",
            if failures == 1 { "" } else { "s" },
            std::io::Error::from_raw_os_error(-code)
        );
    }
    if !applied {
        bail!("nf_tables did not answer the transaction");
    }
    Ok(())
}

/// [`Nft`] for the proxier: every transaction over netlink, tables and sets read over
/// netlink by name.
#[derive(Clone, Debug, Default)]
pub struct NftNetlink {
    /// Transactions sent.
    pub transactions: u64,
}

impl Nft for NftNetlink {
    fn apply(&mut self, script: &str) -> Result<()> {
        let started = std::time::Instant::now();
        let batch = encode_script(script).map_err(|Unsupported(line)| {
            anyhow::anyhow!("no netlink encoding for {line:?} (a proxier bug: please report it)")
        })?;
        let encoded = started.elapsed();
        self.transactions += 1;
        let sent = send(&batch, script);
        tracing::debug!(
            messages = batch.len(),
            bytes = batch.bytes.len(),
            script_bytes = script.len(),
            encode_ms = encoded.as_secs_f64() * 1e3,
            kernel_ms = (started.elapsed() - encoded).as_secs_f64() * 1e3,
            "nf_tables transaction"
        );
        sent
    }

    fn has_table(&mut self, family: &str, table: &str) -> Result<bool> {
        table_exists(family, table)
    }

    fn address_elements(&mut self, family: &str, table: &str, set: &str) -> Result<Vec<Element>> {
        address_elements(family, table, set)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_and_service_commands_translate_and_others_are_refused() {
        let script = "add table ip kube-proxy\n\
            delete table ip kube-proxy\n\
            add table ip kube-proxy\n\
            add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }\n\
            add map ip kube-proxy service-nodeports { type inet_proto . inet_service : verdict ; }\n\
            add set ip kube-proxy nodeport-ips { type ipv4_addr ; }\n\
            add chain ip kube-proxy nat-output { type nat hook output priority -100 ; policy accept ; }\n\
            add chain ip kube-proxy filter-input { type filter hook input priority filter ; policy accept ; }\n\
            add chain ip kube-proxy services\n\
            add rule ip kube-proxy nat-output jump services\n\
            add rule ip kube-proxy filter-input ct state new jump services\n\
            add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips\n\
            add rule ip kube-proxy services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports\n\
            add rule ip kube-proxy services meta mark & 0x4000 == 0 return\n\
            add rule ip kube-proxy services meta mark set meta mark ^ 0x4000\n\
            add rule ip kube-proxy services snat to 192.168.1.1 fully-random\n\
            add rule ip kube-proxy services masquerade fully-random\n\
            add rule ip kube-proxy services meta l4proto tcp reject with tcp reset\n\
            add rule ip kube-proxy services reject\n\
            flush map ip kube-proxy service-ips\n\
            add set ip kube-proxy affinity-x { type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }\n\
            add element ip kube-proxy affinity-x { 10.0.0.9 expires 5000ms, 10.0.0.8 }\n\
            add chain ip kube-proxy endpoint-x\n\
            flush chain ip kube-proxy endpoint-x\n\
            add rule ip kube-proxy endpoint-x update @affinity-x { ip saddr }\n\
            add rule ip kube-proxy endpoint-x meta l4proto tcp dnat to 10.0.0.1:8080\n\
            add element ip kube-proxy service-ips { 10.96.0.1 . tcp . 80 : goto endpoint-x, 10.96.0.2 . udp . 53 : drop }\n\
            delete element ip kube-proxy nodeport-ips { 192.168.1.1 }\n\
            delete chain ip kube-proxy old\n\
            delete set ip kube-proxy affinity-old\n";
        assert_eq!(encode_script(script).unwrap().len(), 30);
        for line in [
            "add chain ip kube-proxy c { type route hook output priority -100 ; policy accept ; }",
            "add chain ip kube-proxy c { type nat hook egress priority -100 ; policy accept ; }",
            "add map ip kube-proxy m { type ipv4_addr : ipv4_addr ; }",
            "add map ip kube-proxy m { type ipv4_addr ; }",
            "add set ip kube-proxy s { type ipv6_addr ; }",
            "add rule ip kube-proxy c ip6 saddr fd00::1 goto x",
            "add rule ip kube-proxy c goto x goto y",
            "add rule ip kube-proxy c snat to fd00::1 fully-random",
            "add rule ip kube-proxy c counter",
            "delete element ip kube-proxy s { 10.0.0.1 expires 5s }",
            "add element ip kube-proxy s { 10.0.0.1 expires soon }",
        ] {
            let Err(Unsupported(got)) = encode_script(&format!("add table ip t\n{line}\n")) else {
                panic!("{line} should be refused");
            };
            assert_eq!(got, line);
        }
    }

    /// One `add element` of 1 000 ClusterIPs, each going to `chain`.
    fn thousand_elements(chain: &str) -> String {
        let elements: Vec<String> = (0..1000)
            .map(|i| format!("10.96.{}.{} . tcp . 80 : goto {chain}", i / 256, i % 256))
            .collect();
        format!(
            "add element ip kube-proxy service-ips {{ {} }}\n",
            elements.join(", ")
        )
    }

    #[test]
    fn large_element_lists_are_split_across_messages() {
        let batch = encode_script(&thousand_elements("s")).unwrap();
        assert_eq!(batch.len(), 1000usize.div_ceil(ELEMENTS_PER_MESSAGE));
        // Every message fits its 16-bit attribute lengths.
        for (_, _, body) in nlattr::messages(&batch.bytes) {
            assert!(body.len() < usize::from(u16::MAX));
        }
        // Elements naming long chains: split by their bytes before their count.
        let batch = encode_script(&thousand_elements(&"s".repeat(200))).unwrap();
        assert!(batch.len() > 1000usize.div_ceil(ELEMENTS_PER_MESSAGE));
        for (_, _, body) in nlattr::messages(&batch.bytes) {
            assert!(body.len() <= ELEMENT_BYTES + 1024);
        }
    }

    #[test]
    fn only_the_last_message_asks_for_an_answer() {
        let batch = encode_script("add table ip t\nadd chain ip t a\nadd chain ip t b\n").unwrap();
        let mut at = 0;
        let mut acks = Vec::new();
        while at < batch.bytes.len() {
            let len = u32::from_ne_bytes(batch.bytes[at..at + 4].try_into().unwrap()) as usize;
            let f = u16::from_ne_bytes([batch.bytes[at + 6], batch.bytes[at + 7]]);
            acks.push(f & NLM_F_ACK != 0);
            at += len;
        }
        // Begin, the three commands, end.
        assert_eq!(acks, [false, false, false, true, false]);
    }

    #[test]
    fn interface_matches_compare_a_padded_name_or_only_a_prefix() {
        let mut exact = Vec::new();
        interface_match(&mut exact, CMP_NEQ, "\"cbr0\"").unwrap();
        let mut padded = b"cbr0".to_vec();
        padded.resize(16, 0);
        assert!(exact.windows(16).any(|w| w == padded));
        let mut prefix = Vec::new();
        interface_match(&mut prefix, CMP_EQ, "\"veth*\"").unwrap();
        assert!(prefix.windows(4).any(|w| w == b"veth"));
        assert!(!prefix.windows(5).any(|w| w == b"veth*"));
        assert!(prefix.len() < exact.len());
        for bad in ["cbr0", "\"\"", "\"*\"", "\"a-name-too-long-x\""] {
            assert_eq!(interface_match(&mut Vec::new(), CMP_EQ, bad), None, "{bad}");
        }
        let rule = "add rule ip kube-proxy external-x iifname \"veth*\" goto all-x";
        assert!(encode_script(&format!("add table ip kube-proxy\n{rule}\n")).is_ok());
    }

    #[test]
    fn keys_and_prefixes_are_laid_out_as_the_kernel_compares_them() {
        assert_eq!(
            element_key(Family::Ip, "10.96.0.1 . tcp . 80").unwrap(),
            [10, 96, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0]
        );
        assert_eq!(
            element_key(Family::Ip6, "sctp . 30080").unwrap(),
            [132, 0, 0, 0, 0x75, 0x80, 0, 0]
        );
        assert_eq!(element_key(Family::Ip, "fd00::1 . tcp . 80"), None);
        // /14: the whole address, masked (255.252.0.0), then compared.
        let mut masked = Vec::new();
        address_match(&mut masked, Family::Ip, 12, CMP_NEQ, "10.4.0.0/14").unwrap();
        let mask = [255u8, 252, 0, 0];
        assert!(masked.windows(4).any(|w| w == mask));
        // /16: only the two bytes.
        let mut aligned = Vec::new();
        address_match(&mut aligned, Family::Ip, 12, CMP_EQ, "172.16.0.0/16").unwrap();
        assert!(!aligned.windows(4).any(|w| w == mask) && aligned.len() < masked.len());
    }
}
