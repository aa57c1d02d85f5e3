//! The nftables proxier's incremental transactions, sent to nf_tables over netlink.
//!
//! Why not `nft -f`: before it applies anything, `nft` (1.0.6, Debian 12's) reads the chain
//! list of every table, and the kernel's chain dump restarts from the head of the list for
//! each reply buffer, so at 10 000 services (110 000 chains) adding one map element cost
//! 2 s of kernel time on this machine. A netlink batch names its chains and sets, which the
//! kernel looks up by hash: the cost of a change no longer grows with the table.
//!
//! The proxier keeps writing nft's language (its tests and the in-memory model read it);
//! [`encode_script`] translates the commands incremental syncs use — `add table|chain|rule|
//! set|element`, `flush chain`, `delete chain|set|element` over the rule shapes of
//! [`super::rules`] — into the messages `nft` itself sends (the same bytecode, so `nft list`
//! prints the same rules). A script with anything else (the full syncs' base chains and map
//! definitions) goes to `nft` whole. Either way a script is one transaction.

use std::{
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd,
};

use anyhow::{bail, Context, Result};
use netlink_sys::protocols::NETLINK_NETFILTER;

use super::nft::{Nft, NftCommand, TableObjects};
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
const DELSETELEM: u16 = 14;

const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;

// Registers: the verdict register, and the two 16-byte data registers nft uses.
const REG_VERDICT: u32 = 0;
const REG_1: u32 = 1;
const REG_2: u32 = 2;

const NFT_JUMP: i32 = -3;
const NFT_GOTO: i32 = -4;
const NF_DROP: i32 = 0;

const CMP_EQ: u32 = 0;
const CMP_NEQ: u32 = 1;
const PAYLOAD_NETWORK: u32 = 1;
const PAYLOAD_TRANSPORT: u32 = 2;
const META_MARK: u32 = 3;
const META_IIFNAME: u32 = 6;
const META_L4PROTO: u32 = 16;

/// nft's set key types (`ipv4_addr`, `ipv6_addr`), which `nft list` reads back.
const TYPE_IPADDR: u32 = 7;
const TYPE_IP6ADDR: u32 = 8;
const SET_TIMEOUT: u32 = 0x10;
const SET_EVAL: u32 = 0x20;

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

fn payload(list: &mut Vec<u8>, base: u32, offset: u32, len: u32) {
    expr(list, "payload", |e| {
        attr(e, 1 /* DREG */, &be32(REG_1));
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
    expr(list, "meta", |e| {
        attr(e, 1 /* DREG */, &be32(REG_1));
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

/// `jump X`, `goto X`, `drop`: (code, chain).
fn parse_verdict<'a>(words: &[&'a str]) -> Option<(i32, Option<&'a str>)> {
    match words {
        ["jump", chain] => Some((NFT_JUMP, Some(chain))),
        ["goto", chain] => Some((NFT_GOTO, Some(chain))),
        ["drop"] => Some((NF_DROP, None)),
        _ => None,
    }
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
                    expr(&mut list, "lookup", |e| {
                        attr_str(e, 1 /* SET */, set);
                        attr(e, 2 /* SREG */, &be32(REG_1));
                    });
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
            ["meta", "mark", "&", mask, "!=", "0", rest @ ..] => {
                let mask = hex_mark(mask)?;
                meta_load(&mut list, META_MARK);
                bitwise(&mut list, &mask.to_ne_bytes(), &0u32.to_ne_bytes());
                cmp(&mut list, CMP_NEQ, &0u32.to_ne_bytes());
                rest
            }
            ["meta", "mark", "set", "meta", "mark", "|", bits, rest @ ..] => {
                let bits = hex_mark(bits)?;
                meta_load(&mut list, META_MARK);
                bitwise(&mut list, &(!bits).to_ne_bytes(), &bits.to_ne_bytes());
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
                expr(&mut list, "nat", |e| {
                    attr(e, 1 /* TYPE */, &be32(1 /* NFT_NAT_DNAT */));
                    attr(e, 2 /* FAMILY */, &be32(u32::from(family.nfproto())));
                    attr(e, 3 /* REG_ADDR_MIN */, &be32(REG_1));
                    attr(e, 5 /* REG_PROTO_MIN */, &be32(REG_2));
                    attr(
                        e,
                        7, /* FLAGS */
                        &be32(2 /* NF_NAT_RANGE_PROTO_SPECIFIED */),
                    );
                });
                rest
            }
            [kind @ ("jump" | "goto" | "drop"), ..] => {
                let n = if *kind == "drop" { 1 } else { 2 };
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

/// A transaction as netlink messages, and the script line each message came from.
#[derive(Default)]
pub struct Batch {
    bytes: Vec<u8>,
    /// Line of each message, by sequence number - 1.
    lines: Vec<String>,
    next_set_id: u32,
}

impl Batch {
    fn push(&mut self, line: &str, family: Family, msg: u16, flags: u16, attrs: &[u8]) {
        let seq = self.lines.len() as u32 + 1;
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | msg;
        self.bytes.extend(nlattr::message(
            kind,
            NLM_F_REQUEST | NLM_F_ACK | flags,
            seq,
            [family.nfproto(), 0, 0, 0],
            attrs,
        ));
        self.lines.push(line.to_string());
    }

    /// How many messages the transaction holds.
    pub fn len(&self) -> usize {
        self.lines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    fn command(&mut self, line: &str) -> Option<()> {
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
                    self.push(line, family, NEWTABLE, NLM_F_CREATE, &a);
                } else {
                    // The kernel empties the table (rules, maps, chains) itself.
                    self.push(line, family, DELTABLE, 0, &a);
                }
            }
            ("add" | "delete", "chain") if !name.is_empty() && body.is_empty() => {
                table_and(&mut a, table, 3 /* NFTA_CHAIN_NAME */, name);
                if *verb == "add" {
                    self.push(line, family, NEWCHAIN, NLM_F_CREATE, &a);
                } else {
                    self.push(line, family, DELCHAIN, 0, &a);
                }
            }
            ("flush", "chain") if !name.is_empty() && body.is_empty() => {
                table_and(&mut a, table, 2 /* NFTA_RULE_CHAIN */, name);
                self.push(line, family, DELRULE, 0, &a);
            }
            ("add", "rule") => {
                let expressions = rule_expressions(family, body)?;
                table_and(&mut a, table, 2 /* NFTA_RULE_CHAIN */, name);
                attr(
                    &mut a,
                    4 /* NFTA_RULE_EXPRESSIONS */ | NLA_F_NESTED,
                    &expressions,
                );
                self.push(line, family, NEWRULE, NLM_F_CREATE | NLM_F_APPEND, &a);
            }
            ("add", "set") => {
                // Only the affinity sets: `{ type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }`.
                let spec: Vec<&str> = body.split_whitespace().collect();
                let ["{", "type", key_type, ";", "flags", "dynamic,timeout", ";", "timeout", timeout, ";", "}"] =
                    spec.as_slice()
                else {
                    return None;
                };
                let (key_type, key_len) = match (*key_type, family) {
                    ("ipv4_addr", Family::Ip) => (TYPE_IPADDR, 4u32),
                    ("ipv6_addr", Family::Ip6) => (TYPE_IP6ADDR, 16),
                    _ => return None,
                };
                let seconds: u64 = timeout.strip_suffix('s')?.parse().ok()?;
                self.next_set_id += 1;
                table_and(&mut a, table, 2 /* NFTA_SET_NAME */, name);
                attr(
                    &mut a,
                    3, /* NFTA_SET_FLAGS */
                    &be32(SET_TIMEOUT | SET_EVAL),
                );
                attr(&mut a, 4 /* NFTA_SET_KEY_TYPE */, &be32(key_type));
                attr(&mut a, 5 /* NFTA_SET_KEY_LEN */, &be32(key_len));
                attr(&mut a, 10 /* NFTA_SET_ID */, &be32(self.next_set_id));
                attr(
                    &mut a,
                    11, /* NFTA_SET_TIMEOUT */
                    &(seconds * 1000).to_be_bytes(),
                );
                // nft's user data: the key is big-endian (NFTNL_UDATA_SET_KEYBYTEORDER).
                let mut udata = vec![0u8, 4];
                udata.extend(2u32.to_ne_bytes());
                attr(&mut a, 13 /* NFTA_SET_USERDATA */, &udata);
                self.push(line, family, NEWSET, NLM_F_CREATE, &a);
            }
            ("delete", "set") if !name.is_empty() && body.is_empty() => {
                table_and(&mut a, table, 2 /* NFTA_SET_NAME */, name);
                self.push(line, family, DELSET, 0, &a);
            }
            (verb @ ("add" | "delete"), "element") => {
                let elements = braced(body)?;
                let mut list = Vec::new();
                for element in elements {
                    let (key, value) = element.split_once(" : ").unwrap_or((element, ""));
                    let key = element_key(family, key)?;
                    let value: Vec<&str> = value.split_whitespace().collect();
                    let data = match (verb, value.as_slice()) {
                        (_, []) => None,
                        ("add", v) => Some(parse_verdict(v)?),
                        _ => return None,
                    };
                    nested(&mut list, 1 /* NFTA_LIST_ELEM */, |e| {
                        data_value(e, 1 /* NFTA_SET_ELEM_KEY */, &key);
                        if let Some((code, chain)) = data {
                            verdict(e, 2 /* NFTA_SET_ELEM_DATA */, code, chain);
                        }
                    });
                }
                table_and(&mut a, table, 2 /* NFTA_SET_ELEM_LIST_SET */, name);
                attr(
                    &mut a,
                    3 /* NFTA_SET_ELEM_LIST_ELEMENTS */ | NLA_F_NESTED,
                    &list,
                );
                if verb == "add" {
                    self.push(line, family, NEWSETELEM, NLM_F_CREATE, &a);
                } else {
                    self.push(line, family, DELSETELEM, 0, &a);
                }
            }
            _ => return None,
        }
        Some(())
    }
}

/// The script as one netlink transaction, or the first line it cannot translate.
pub fn encode_script(script: &str) -> Result<Batch, Unsupported> {
    let mut batch = Batch::default();
    for line in script.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        batch
            .command(line)
            .ok_or_else(|| Unsupported(line.to_string()))?;
    }
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

/// Sends `batch` as one transaction (begin, its messages, end) and reads the kernel's
/// answer to each message. The kernel runs the batch inside the send, so every answer is
/// queued when it returns.
/// Whether `family` (`ip` / `ip6`) has the table `table`: one request for that table,
/// answered at once whatever else the ruleset holds (nft fetches the whole ruleset before
/// listing even the table names: minutes behind 100 000 services' chains).
pub fn table_exists(family: &str, table: &str) -> Result<bool> {
    let nfproto = match family {
        "ip" => NFPROTO_IPV4,
        "ip6" => NFPROTO_IPV6,
        other => bail!("no nf_tables family {other:?}"),
    };
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

pub fn send(batch: &Batch) -> Result<()> {
    if batch.is_empty() {
        return Ok(());
    }
    let socket = nlattr::open(NETLINK_NETFILTER, "nf_tables netlink")?;
    let res_id = NFNL_SUBSYS_NFTABLES.to_be_bytes();
    let header = [0, 0, res_id[0], res_id[1]];
    let end_seq = batch.len() as u32 + 1;
    let mut bytes = nlattr::message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 0, header, &[]);
    bytes.extend_from_slice(&batch.bytes);
    bytes.extend(nlattr::message(
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST,
        end_seq,
        header,
        &[],
    ));
    // Room for the whole batch and an answer per message (SO_*BUFFORCE: we hold
    // CAP_NET_ADMIN; the plain options are capped by the sysctls).
    set_buffer(&socket, libc::SO_SNDBUFFORCE, bytes.len() * 2 + (1 << 16));
    set_buffer(&socket, libc::SO_RCVBUFFORCE, batch.len() * 128 + (1 << 16));
    // An error answer without a copy of the (possibly large) message it answers.
    let _ = socket.set_cap_ack(true);
    socket
        .send(&bytes, 0)
        .context("sending the nf_tables transaction")?;

    let mut acked = 0;
    let mut failures: Vec<String> = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    while acked < batch.len() {
        let n = match socket.recv(&mut &mut buf[..], libc::MSG_DONTWAIT) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e).context("reading the nf_tables answers"),
        };
        for (seq, code) in nlattr::acks(&buf[..n]) {
            acked += 1;
            if code != 0 {
                let what = match batch.lines.get((seq as usize).wrapping_sub(1)) {
                    Some(line) => format!("{line:?}"),
                    None => "the commit".to_string(),
                };
                failures.push(format!(
                    "{what}: {}",
                    std::io::Error::from_raw_os_error(-code)
                ));
            }
        }
    }
    if let Some(first) = failures.first() {
        bail!(
            "nf_tables refused the transaction ({} error{}), at {first}",
            failures.len(),
            if failures.len() == 1 { "" } else { "s" }
        );
    }
    if acked < batch.len() {
        bail!(
            "nf_tables answered {acked} of the transaction's {} messages",
            batch.len()
        );
    }
    Ok(())
}

/// [`Nft`] for the proxier: incremental transactions over netlink, the rest through `nft`.
#[derive(Clone, Debug, Default)]
pub struct NftNetlink {
    fallback: NftCommand,
    /// Transactions sent over netlink, and those handed to `nft`.
    pub netlink_transactions: u64,
    pub nft_transactions: u64,
}

impl Nft for NftNetlink {
    fn apply(&mut self, script: &str) -> Result<()> {
        match encode_script(script) {
            Ok(batch) => {
                self.netlink_transactions += 1;
                send(&batch)
            }
            Err(Unsupported(line)) => {
                tracing::trace!(%line, "transaction through nft");
                self.nft_transactions += 1;
                self.fallback.apply(script)
            }
        }
    }

    fn objects(&mut self, family: &str, table: &str) -> Result<TableObjects> {
        self.fallback.objects(family, table)
    }

    fn has_table(&mut self, family: &str, table: &str) -> Result<bool> {
        table_exists(family, table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incremental_commands_translate_and_the_rest_goes_to_nft() {
        let script = "add table ip kube-proxy\n\
            add set ip kube-proxy affinity-x { type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }\n\
            add chain ip kube-proxy endpoint-x\n\
            flush chain ip kube-proxy endpoint-x\n\
            add rule ip kube-proxy endpoint-x update @affinity-x { ip saddr }\n\
            add rule ip kube-proxy endpoint-x meta l4proto tcp dnat to 10.0.0.1:8080\n\
            add element ip kube-proxy service-ips { 10.96.0.1 . tcp . 80 : goto endpoint-x, 10.96.0.2 . udp . 53 : drop }\n\
            delete element ip kube-proxy nodeport-ips { 192.168.1.1 }\n\
            delete chain ip kube-proxy old\n\
            delete set ip kube-proxy affinity-old\n";
        assert_eq!(encode_script(script).unwrap().len(), 10);
        // A base chain, a map definition, a rule shape of the static part: nft's.
        for line in [
            "add chain ip kube-proxy nat-output { type nat hook output priority -100 ; policy accept ; }",
            "add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }",
            "add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips",
            "add rule ip kube-proxy c ip6 saddr fd00::1 goto x",
            "add rule ip kube-proxy c goto x goto y",
        ] {
            let Err(Unsupported(got)) = encode_script(&format!("add table ip t\n{line}\n")) else {
                panic!("{line} should go to nft");
            };
            assert_eq!(got, line);
        }
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
