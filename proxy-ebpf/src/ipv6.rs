//! The IPv6 datapath: tail-called by the IPv4 programs for IPv6 packets, so it has the whole
//! BPF stack to itself.
//!
//! Services are found in `SERVICES6`, backends in the shared `BACKENDS` array (port, flags,
//! generation) with their addresses in `BACKEND_ADDRS6`, flows in `CONNTRACK6`. It serves
//! every frontend the agent writes there: destination NAT to a uniformly random backend,
//! replies restored (at egress only for external frontends, as for IPv4), backends that left
//! their service re-balanced, and refusals (see `refuse`) for services without endpoints.
//! What IPv4 has beyond that (schedulers other than random, affinity, source NAT, hairpin,
//! fragments, source ranges) is not here yet; the agent programs only the frontends this
//! can serve.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::{bpf_csum_diff, bpf_ktime_get_ns},
    macros::map,
    maps::{Array, HashMap, LruHashMap},
    programs::TcContext,
};
use proxy_common::{
    BackendAddr6, ConntrackKey6, ConntrackValue6, ServiceKey6, ServiceValue, Stat,
    BACKEND_INDEX_MASK, CT_FLAG_CLOSING, CT_FLAG_EGRESS_ONLY, CT_FLAG_REPLY, CT_FLAG_SEEN_REPLY,
    CT_REFRESH_NS, IPPROTO_TCP, IPPROTO_UDP, SERVICE_FLAG_DROP_WHEN_EMPTY, SERVICE_FLAG_EXTERNAL,
};

use crate::{
    account, backend, bump, config, random_below, read, Hook, ETH_HLEN, REFRESH_NS, TCP_ACK,
    TCP_CSUM_OFF, TCP_FIN, TCP_RST, TCP_SYN, UDP_CSUM_OFF,
};

#[map]
pub static SERVICES6: HashMap<ServiceKey6, ServiceValue> = HashMap::with_max_entries(65536, 0);
#[map]
pub static BACKEND_ADDRS6: Array<BackendAddr6> = Array::with_max_entries(65536, 0);
#[map]
pub static CONNTRACK6: LruHashMap<ConntrackKey6, ConntrackValue6> =
    LruHashMap::with_max_entries(65536, 0);

pub const ETH_P_IPV6: u16 = 0x86dd;
const IPV6_HLEN: usize = 40;
const IP6_SADDR_OFF: usize = ETH_HLEN + 8;
const IP6_DADDR_OFF: usize = ETH_HLEN + 24;

struct Packet6 {
    l4_off: usize,
    key: ConntrackKey6,
    tcp_flags: u8,
}

#[inline(always)]
pub fn run(ctx: &TcContext, hook: Hook) -> i32 {
    match try_run(ctx, hook) {
        Ok(verdict) => verdict,
        Err(stat) => {
            bump(stat);
            TC_ACT_SHOT as i32
        }
    }
}

#[inline(always)]
fn try_run(ctx: &TcContext, hook: Hook) -> Result<i32, Stat> {
    let Some(pkt) = parse(ctx) else {
        return Ok(TC_ACT_UNSPEC);
    };
    if let Some(ct) = CONNTRACK6.get_ptr_mut(&pkt.key) {
        // SAFETY: the pointer is to a map value and valid for this program run.
        let ct = unsafe { &mut *ct };
        let now = unsafe { bpf_ktime_get_ns() };
        if ct.flags & CT_FLAG_REPLY != 0 {
            if ct.flags & CT_FLAG_EGRESS_ONLY != 0 && hook == Hook::Ingress {
                return Ok(TC_ACT_UNSPEC);
            }
            return translate_reply(ctx, &pkt, ct, now);
        }
        if hook == Hook::Egress {
            return Ok(TC_ACT_UNSPEC);
        }
        if let Some(verdict) = translate_tracked(ctx, &pkt, ct, now)? {
            return Ok(verdict);
        }
    }
    if hook == Hook::Egress {
        return Ok(TC_ACT_UNSPEC);
    }
    let header_key = ServiceKey6::new(pkt.key.daddr, pkt.key.dport, pkt.key.proto, 0);
    let Some(header) = (unsafe { SERVICES6.get(&header_key) }) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let header = *header;
    if header.count == 0 {
        if header.flags & SERVICE_FLAG_DROP_WHEN_EMPTY != 0 {
            bump(Stat::NoLocalEndpoint);
            return Ok(TC_ACT_SHOT as i32);
        }
        return crate::refuse(ctx);
    }
    new_flow(ctx, &pkt, &header)
}

/// IPv6 with TCP or UDP directly after the fixed header; anything else (extension headers,
/// fragments, ICMPv6) passes untouched.
#[inline(always)]
fn parse(ctx: &TcContext) -> Option<Packet6> {
    let eth_proto: u16 = u16::from_be(read(ctx, 12)?);
    if eth_proto != ETH_P_IPV6 {
        return None;
    }
    let version: u8 = read(ctx, ETH_HLEN)?;
    if version >> 4 != 6 {
        return None;
    }
    let proto: u8 = read(ctx, ETH_HLEN + 6)?;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return None;
    }
    let saddr: [u8; 16] = read(ctx, IP6_SADDR_OFF)?;
    let daddr: [u8; 16] = read(ctx, IP6_DADDR_OFF)?;
    let l4_off = ETH_HLEN + IPV6_HLEN;
    let sport: u16 = read(ctx, l4_off)?;
    let dport: u16 = read(ctx, l4_off + 2)?;
    let tcp_flags: u8 = if proto == IPPROTO_TCP {
        read(ctx, l4_off + 13)?
    } else {
        0
    };
    Some(Packet6 {
        l4_off,
        key: ConntrackKey6::new(saddr, daddr, sport, dport, proto),
        tcp_flags,
    })
}

#[inline(always)]
fn touch(ct: &mut ConntrackValue6, pkt: &Packet6, now: u64, extra_flags: u8) {
    let mut flags = ct.flags | extra_flags;
    if pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        flags |= CT_FLAG_CLOSING;
    }
    if flags != ct.flags {
        ct.flags = flags;
    }
    if now.wrapping_sub(ct.last_seen_ns) > REFRESH_NS {
        ct.last_seen_ns = now;
    }
}

// A subprogram of its own: its stack frame is not added to its callers'.
#[inline(never)]
fn translate_reply(
    ctx: &TcContext,
    pkt: &Packet6,
    ct: &mut ConntrackValue6,
    now: u64,
) -> Result<i32, Stat> {
    let first_reply = ct.flags & CT_FLAG_SEEN_REPLY == 0;
    let closing = pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0 && ct.flags & CT_FLAG_CLOSING == 0;
    let (nat_addr, nat_port, service_id, backend_id) =
        (ct.nat_addr, ct.nat_port, ct.service_id, ct.backend_id);
    touch(ct, pkt, now, CT_FLAG_SEEN_REPLY);
    if first_reply || closing {
        // The original-direction entry decides the flow's timeout: tell it what we saw.
        let original = ConntrackKey6::new(
            pkt.key.daddr,
            nat_addr,
            pkt.key.dport,
            nat_port,
            pkt.key.proto,
        );
        if let Some(orig) = CONNTRACK6.get_ptr_mut(&original) {
            // SAFETY: map value pointer, valid for this run.
            touch(unsafe { &mut *orig }, pkt, now, CT_FLAG_SEEN_REPLY);
        }
    }
    rewrite(
        ctx,
        pkt,
        IP6_SADDR_OFF,
        &pkt.key.saddr,
        &nat_addr,
        (pkt.l4_off, pkt.key.sport, nat_port),
    )?;
    bump(Stat::ReplyTranslated);
    account(ctx, service_id, backend_id, false);
    Ok(TC_ACT_UNSPEC)
}

/// A packet of a tracked flow; `None` when it needs a new backend (timed out, a closed TCP
/// tuple reopened, or its backend left the service).
// A subprogram of its own: its stack frame is not added to its callers'.
#[inline(never)]
fn translate_tracked(
    ctx: &TcContext,
    pkt: &Packet6,
    ct: &mut ConntrackValue6,
    now: u64,
) -> Result<Option<i32>, Stat> {
    let expired = now.wrapping_sub(ct.last_seen_ns)
        > config().timeout_ns(pkt.key.proto, ct.flags) + CT_REFRESH_NS;
    let reopened =
        pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN && ct.flags & CT_FLAG_CLOSING != 0;
    let backend_alive = backend(ct.backend_id).is_some();
    if expired || reopened || !backend_alive {
        bump(if backend_alive {
            Stat::FlowExpired
        } else {
            Stat::BackendGone
        });
        let reply = ConntrackKey6::new(
            ct.nat_addr,
            pkt.key.saddr,
            ct.nat_port,
            pkt.key.sport,
            pkt.key.proto,
        );
        let _ = CONNTRACK6.remove(&reply);
        let _ = CONNTRACK6.remove(&pkt.key);
        return Ok(None);
    }
    let (nat_addr, nat_port, service_id, backend_id) =
        (ct.nat_addr, ct.nat_port, ct.service_id, ct.backend_id);
    touch(ct, pkt, now, 0);
    rewrite(
        ctx,
        pkt,
        IP6_DADDR_OFF,
        &pkt.key.daddr,
        &nat_addr,
        (pkt.l4_off + 2, pkt.key.dport, nat_port),
    )?;
    bump(Stat::EstablishedFlow);
    account(ctx, service_id, backend_id, false);
    Ok(Some(TC_ACT_UNSPEC))
}

// A subprogram of its own: its stack frame is not added to its callers'.
#[inline(never)]
fn new_flow(ctx: &TcContext, pkt: &Packet6, header: &ServiceValue) -> Result<i32, Stat> {
    let slot = random_below(header.count as u32) as u16 + 1;
    let key = ServiceKey6::new(pkt.key.daddr, pkt.key.dport, pkt.key.proto, slot);
    let Some(entry) = (unsafe { SERVICES6.get(&key) }) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let backend_id = entry.backend_id;
    let Some(b) = backend(backend_id) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let backend_port = b.port;
    let Some(addr) = BACKEND_ADDRS6.get(backend_id & BACKEND_INDEX_MASK) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let backend_addr = addr.addr;
    let service_id = header.service_id;
    let now = unsafe { bpf_ktime_get_ns() };
    let original = ConntrackValue6 {
        last_seen_ns: now,
        nat_addr: backend_addr,
        nat_port: backend_port,
        flags: 0,
        _pad0: 0,
        backend_id,
        service_id,
        _pad1: [0; 4],
    };
    let reply_flags = if header.flags & SERVICE_FLAG_EXTERNAL != 0 {
        CT_FLAG_REPLY | CT_FLAG_EGRESS_ONLY
    } else {
        CT_FLAG_REPLY
    };
    let reply = ConntrackValue6 {
        nat_addr: pkt.key.daddr,
        nat_port: pkt.key.dport,
        flags: reply_flags,
        ..original
    };
    let reply_key = ConntrackKey6::new(
        backend_addr,
        pkt.key.saddr,
        backend_port,
        pkt.key.sport,
        pkt.key.proto,
    );
    if CONNTRACK6
        .insert(&pkt.key, &original, BPF_ANY as u64)
        .is_err()
        || CONNTRACK6
            .insert(&reply_key, &reply, BPF_ANY as u64)
            .is_err()
    {
        bump(Stat::ConntrackInsertFailed);
    }
    rewrite(
        ctx,
        pkt,
        IP6_DADDR_OFF,
        &pkt.key.daddr,
        &backend_addr,
        (pkt.l4_off + 2, pkt.key.dport, backend_port),
    )?;
    bump(Stat::NewFlow);
    account(ctx, service_id, backend_id, true);
    Ok(TC_ACT_UNSPEC)
}

/// Rewrites one address (at `addr_off`) and its port (`(offset, old, new)`), fixing the
/// transport checksum: IPv6 has no header checksum, but TCP's and UDP's cover the addresses
/// through the pseudo-header, so the address change goes in as one checksum difference.
#[inline(always)]
fn rewrite(
    ctx: &TcContext,
    pkt: &Packet6,
    addr_off: usize,
    old_addr: &[u8; 16],
    new_addr: &[u8; 16],
    port: (usize, u16, u16),
) -> Result<(), Stat> {
    let (csum_off, mangled) = if pkt.key.proto == IPPROTO_TCP {
        (pkt.l4_off + TCP_CSUM_OFF, 0)
    } else {
        (pkt.l4_off + UDP_CSUM_OFF, BPF_F_MARK_MANGLED_0 as u64)
    };
    if old_addr != new_addr {
        let mut from = *old_addr;
        let mut to = *new_addr;
        // SAFETY: both buffers are 16 bytes on this program's stack, as the sizes say.
        let diff = unsafe {
            bpf_csum_diff(
                from.as_mut_ptr() as *mut u32,
                16,
                to.as_mut_ptr() as *mut u32,
                16,
                0,
            )
        };
        if diff < 0 {
            return Err(Stat::RewriteFailed);
        }
        ctx.l4_csum_replace(csum_off, 0, diff as u64, BPF_F_PSEUDO_HDR as u64 | mangled)
            .map_err(|_| Stat::RewriteFailed)?;
        ctx.store(addr_off, new_addr, 0)
            .map_err(|_| Stat::RewriteFailed)?;
    }
    let (port_off, old_port, new_port) = port;
    if old_port != new_port {
        ctx.l4_csum_replace(csum_off, old_port as u64, new_port as u64, mangled | 2)
            .map_err(|_| Stat::RewriteFailed)?;
        ctx.store(port_off, &new_port, 0)
            .map_err(|_| Stat::RewriteFailed)?;
    }
    Ok(())
}
