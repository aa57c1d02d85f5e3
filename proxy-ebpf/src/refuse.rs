//! Refusals: what a client gets for a new flow to a service without endpoints, as
//! kube-proxy's REJECT rule gives it: the connection fails at once instead of timing out.
//!
//! A program of its own, tail-called by the IPv4 and IPv6 programs, so building an answer
//! costs their stack nothing. The packet is turned into its own answer and sent back out of
//! the interface it came in on:
//! - TCP gets a reset. (An ICMP error would do on paper, but a client's kernel drops ICMP
//!   errors that arrive while the connecting socket is locked, which is the case when the
//!   answer comes back within the `connect()` call that sent the SYN: on one node it does,
//!   and the client would wait a second for its SYN's retransmission. A reset is queued to
//!   the socket instead.)
//! - UDP gets ICMP (ICMPv6) port unreachable, quoting the datagram's headers so the client's
//!   kernel finds the socket.
//!
//! Checksums are computed here in full, and made to survive the kernel completing a partial
//! checksum on the way out (the packet may still carry the sender's offload request, which
//! would sum the bytes where its transport header was and store the result in its checksum
//! field).

use aya_ebpf::{
    bindings::{bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, TC_ACT_REDIRECT, TC_ACT_SHOT},
    helpers::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use proxy_common::{Stat, IPPROTO_TCP};

use crate::{
    bump, ipv6::ETH_P_IPV6, read, ETH_HLEN, ETH_P_IP, IPV4_HLEN, TCP_ACK, TCP_CSUM_OFF, TCP_FIN,
    TCP_RST, TCP_SYN, UDP_CSUM_OFF,
};

const IPV6_HLEN: usize = 40;
const TCP_HLEN: usize = 20;
const ICMP_HLEN: usize = 8;
/// Bytes of the refused datagram's transport header quoted in the ICMP error. RFC 792 asks
/// for 8; 40 also keeps a TCP checksum field inside the packet, which the kernel requires when
/// it trims a packet whose checksum is still to be completed by offload (CHECKSUM_PARTIAL).
const QUOTED_L4: usize = 40;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const IPPROTO_ICMPV6: u8 = 58;
const IPPROTO_FRAGMENT: u8 = 44;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;
const REFUSAL4_LEN: usize = ETH_HLEN + IPV4_HLEN + ICMP_HLEN + IPV4_HLEN + QUOTED_L4;
const REFUSAL6_LEN: usize = ETH_HLEN + IPV6_HLEN + ICMP_HLEN + IPV6_HLEN + QUOTED_L4;

pub fn run(ctx: &TcContext) -> i32 {
    match try_refuse(ctx) {
        Ok(true) => {
            // A tuple clash was counted where it was found; `Refused` is the no-endpoints
            // count its alert watches.
            if unsafe { (*ctx.skb.skb).cb[0] } != crate::REFUSED_TUPLE_CLASH {
                bump(Stat::Refused);
            }
            // Back out of the interface it came in on (new flows are only taken at ingress).
            let ifindex = unsafe { (*ctx.skb.skb).ifindex };
            unsafe { bpf_redirect(ifindex, 0) };
            TC_ACT_REDIRECT as i32
        }
        // A reset is never answered.
        Ok(false) => TC_ACT_SHOT as i32,
        Err(stat) => {
            bump(stat);
            TC_ACT_SHOT as i32
        }
    }
}

#[inline(always)]
fn try_refuse(ctx: &TcContext) -> Result<bool, Stat> {
    let eth_proto = u16::from_be(read(ctx, 12).ok_or(Stat::RefuseFailed)?);
    if eth_proto == ETH_P_IP {
        // IP options would shift everything; such packets to a service are not worth it.
        if read::<u8>(ctx, ETH_HLEN) != Some(0x45) {
            return Err(Stat::RefuseFailed);
        }
        let proto: u8 = read(ctx, ETH_HLEN + 9).ok_or(Stat::RefuseFailed)?;
        if proto == IPPROTO_TCP {
            tcp_reset(ctx, false)
        } else {
            icmp4(ctx, proto).map(|_| true)
        }
    } else if eth_proto == ETH_P_IPV6 {
        let proto: u8 = read(ctx, ETH_HLEN + 6).ok_or(Stat::RefuseFailed)?;
        if proto == IPPROTO_TCP {
            tcp_reset(ctx, true)
        } else if proto == IPPROTO_FRAGMENT {
            // A first fragment: ICMPv6 quotes it, Fragment header and all, which the
            // client's kernel parses to find the socket. (TCP is not fragmented in practice;
            // such a segment is dropped rather than answered with a reset built for a header
            // that is not where the reset expects it.)
            let next: u8 = read(ctx, ETH_HLEN + IPV6_HLEN).ok_or(Stat::RefuseFailed)?;
            if next == IPPROTO_TCP {
                return Err(Stat::RefuseFailed);
            }
            icmp6(ctx, proto).map(|_| true)
        } else {
            icmp6(ctx, proto).map(|_| true)
        }
    } else {
        Err(Stat::RefuseFailed)
    }
}

/// The answer RFC 9293 gives a segment for a closed port: a reset that acknowledges it.
/// Returns false for a reset (never answered).
#[inline(always)]
fn tcp_reset(ctx: &TcContext, ipv6: bool) -> Result<bool, Stat> {
    let l3_len = if ipv6 { IPV6_HLEN } else { IPV4_HLEN };
    let l4 = ETH_HLEN + l3_len;
    let failed = Stat::RefuseFailed;
    let flags: u8 = read(ctx, l4 + 13).ok_or(failed)?;
    if flags & TCP_RST != 0 {
        return Ok(false);
    }
    let ports: u32 = read(ctx, l4).ok_or(failed)?;
    let seq = u32::from_be(read(ctx, l4 + 4).ok_or(failed)?);
    let ack: u32 = read(ctx, l4 + 8).ok_or(failed)?;
    let header_len = ((read::<u8>(ctx, l4 + 12).ok_or(failed)? >> 4) as u32) * 4;
    // Segment length: payload, plus one for each of SYN and FIN.
    let l3_payload = if ipv6 {
        u16::from_be(read(ctx, ETH_HLEN + 4).ok_or(failed)?) as u32
    } else {
        (u16::from_be(read(ctx, ETH_HLEN + 2).ok_or(failed)?) as u32).wrapping_sub(IPV4_HLEN as u32)
    };
    let seg_len = l3_payload.wrapping_sub(header_len)
        + (flags & TCP_SYN != 0) as u32
        + (flags & TCP_FIN != 0) as u32;
    let (reply_seq, reply_ack, reply_flags) = if flags & TCP_ACK != 0 {
        (ack, 0, TCP_RST)
    } else {
        (0, seq.wrapping_add(seg_len).to_be(), TCP_RST | TCP_ACK)
    };
    // Both addresses, read before anything moves.
    let addrs: [u8; 32] = if ipv6 {
        read(ctx, ETH_HLEN + 8).ok_or(failed)?
    } else {
        let a: [u8; 8] = read(ctx, ETH_HLEN + 12).ok_or(failed)?;
        let mut all = [0u8; 32];
        all[..8].copy_from_slice(&a);
        all
    };

    if unsafe { bpf_skb_change_tail(ctx.skb.skb, (l4 + TCP_HLEN) as u32, 0) } != 0 {
        return Err(failed);
    }
    let start = ctx.data();
    if start + l4 + TCP_HLEN > ctx.data_end() {
        return Err(failed);
    }
    let p = start as *mut u8;
    // SAFETY: every write below is within the l4 + TCP_HLEN bytes checked above.
    unsafe {
        swap_ethernet(p);
        let ip = p.add(ETH_HLEN);
        // From the service address the client tried, to the client.
        let src = if ipv6 {
            for i in 0..16 {
                *ip.add(8 + i) = addrs[16 + i];
                *ip.add(24 + i) = addrs[i];
            }
            ip.add(8)
        } else {
            for i in 0..4 {
                *ip.add(12 + i) = addrs[4 + i];
                *ip.add(16 + i) = addrs[i];
            }
            ip.add(12)
        };
        let pseudo_len = (TCP_HLEN as u16).to_be() as u32 + (IPPROTO_TCP as u16).to_be() as u32;
        let pseudo = if ipv6 {
            (ip as *mut u32).write_unaligned(0x6000_0000u32.to_be());
            (ip.add(4) as *mut u16).write_unaligned((TCP_HLEN as u16).to_be());
            *ip.add(6) = IPPROTO_TCP;
            *ip.add(7) = 64;
            sum16(src, 32) + pseudo_len
        } else {
            write_ipv4_header(ip, (IPV4_HLEN + TCP_HLEN) as u16, IPPROTO_TCP, 0);
            sum16(src, 8) + pseudo_len
        };

        let tcp = p.add(l4);
        (tcp as *mut u32).write_unaligned(ports.rotate_left(16));
        (tcp.add(4) as *mut u32).write_unaligned(reply_seq);
        (tcp.add(8) as *mut u32).write_unaligned(reply_ack);
        *tcp.add(12) = ((TCP_HLEN / 4) as u8) << 4;
        *tcp.add(13) = reply_flags;
        for i in 14..TCP_HLEN {
            *tcp.add(i) = 0;
        }
        // The window (meaningless in a reset) absorbs the difference that makes the
        // checksum hold both as it is and after a partial-checksum completion (see
        // `survive_completion`).
        let (window, checksum) = survive_completion(pseudo, sum16(tcp, TCP_HLEN));
        (tcp.add(14) as *mut u16).write_unaligned(window);
        (tcp.add(TCP_CSUM_OFF) as *mut u16).write_unaligned(checksum);
    }
    Ok(true)
}

/// ICMP port unreachable quoting the datagram (IPv4 header without options, checked by the
/// caller).
#[inline(always)]
fn icmp4(ctx: &TcContext, proto: u8) -> Result<(), Stat> {
    let failed = Stat::RefuseFailed;
    let addrs: [u8; 8] = read(ctx, ETH_HLEN + 12).ok_or(failed)?;
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, (ETH_HLEN + IPV4_HLEN + QUOTED_L4) as u32, 0) }
        != 0
    {
        return Err(failed);
    }
    ctx.adjust_room((IPV4_HLEN + ICMP_HLEN) as i32, BPF_ADJ_ROOM_MAC, 0)
        .map_err(|_| failed)?;
    let start = ctx.data();
    if start + REFUSAL4_LEN > ctx.data_end() {
        return Err(failed);
    }
    let p = start as *mut u8;
    // SAFETY: all writes below are within the REFUSAL4_LEN bytes checked above.
    unsafe {
        swap_ethernet(p);
        let ip = p.add(ETH_HLEN);
        for i in 0..4 {
            *ip.add(12 + i) = addrs[4 + i];
            *ip.add(16 + i) = addrs[i];
        }
        // Precedence "internetwork control", as the kernel's own ICMP errors.
        write_ipv4_header(ip, (REFUSAL4_LEN - ETH_HLEN) as u16, 1, 0xc0);
        let icmp = ip.add(IPV4_HLEN);
        for i in 0..ICMP_HLEN {
            *icmp.add(i) = 0;
        }
        *icmp = ICMP_DEST_UNREACH;
        *icmp.add(1) = ICMP_PORT_UNREACH;
        quote_survives_completion(icmp.add(ICMP_HLEN + IPV4_HLEN), proto);
        let icmp_csum = fold(sum16(icmp, ICMP_HLEN + IPV4_HLEN + QUOTED_L4));
        (icmp.add(2) as *mut u16).write_unaligned(icmp_csum);
    }
    Ok(())
}

/// ICMPv6 port unreachable quoting the datagram.
#[inline(always)]
fn icmp6(ctx: &TcContext, proto: u8) -> Result<(), Stat> {
    let failed = Stat::RefuseFailed;
    let addrs: [u8; 32] = read(ctx, ETH_HLEN + 8).ok_or(failed)?;
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, (ETH_HLEN + IPV6_HLEN + QUOTED_L4) as u32, 0) }
        != 0
    {
        return Err(failed);
    }
    ctx.adjust_room((IPV6_HLEN + ICMP_HLEN) as i32, BPF_ADJ_ROOM_MAC, 0)
        .map_err(|_| failed)?;
    let start = ctx.data();
    if start + REFUSAL6_LEN > ctx.data_end() {
        return Err(failed);
    }
    let p = start as *mut u8;
    let payload_len = (ICMP_HLEN + IPV6_HLEN + QUOTED_L4) as u16;
    // SAFETY: all writes below are within the REFUSAL6_LEN bytes checked above.
    unsafe {
        swap_ethernet(p);
        let ip = p.add(ETH_HLEN);
        (ip as *mut u32).write_unaligned(0x6000_0000u32.to_be());
        (ip.add(4) as *mut u16).write_unaligned(payload_len.to_be());
        *ip.add(6) = IPPROTO_ICMPV6;
        *ip.add(7) = 64;
        for i in 0..16 {
            *ip.add(8 + i) = addrs[16 + i];
            *ip.add(24 + i) = addrs[i];
        }
        let icmp = ip.add(IPV6_HLEN);
        for i in 0..ICMP_HLEN {
            *icmp.add(i) = 0;
        }
        *icmp = ICMPV6_DEST_UNREACH;
        *icmp.add(1) = ICMPV6_PORT_UNREACH;
        quote_survives_completion(icmp.add(ICMP_HLEN + IPV6_HLEN), proto);
        // ICMPv6's checksum covers a pseudo-header: both addresses, length, next header.
        let pseudo = sum16(ip.add(8), 32)
            + payload_len.to_be() as u32
            + (IPPROTO_ICMPV6 as u16).to_be() as u32;
        let icmp_csum = fold(pseudo + sum16(icmp, payload_len as usize));
        (icmp.add(2) as *mut u16).write_unaligned(icmp_csum);
    }
    Ok(())
}

/// Ethernet: back to where it came from.
#[inline(always)]
unsafe fn swap_ethernet(p: *mut u8) {
    for i in 0..6 {
        let d = *p.add(i);
        *p.add(i) = *p.add(6 + i);
        *p.add(6 + i) = d;
    }
}

/// An IPv4 header without options around `total_len` bytes of `proto`; the addresses at
/// 12..20 must already be in place (they go into the checksum).
#[inline(always)]
unsafe fn write_ipv4_header(ip: *mut u8, total_len: u16, proto: u8, tos: u8) {
    let len = total_len.to_be_bytes();
    let fields: [u8; 12] = [
        0x45, tos, len[0], len[1], 0, 0, 0x40, // don't fragment
        0, 64, proto, 0, 0,
    ];
    for (i, b) in fields.iter().enumerate() {
        *ip.add(i) = *b;
    }
    let csum = fold(sum16(ip, IPV4_HLEN));
    (ip.add(10) as *mut u16).write_unaligned(csum);
}

/// The quoted transport header sits where the refused packet's own was, so a partial
/// checksum the kernel completes on the way out lands in the quote's checksum field, behind
/// the ICMP checksum's back. Give that field the one value such a completion leaves
/// unchanged, so the ICMP checksum holds either way. Receivers of the error read only the
/// quote's first 8 bytes (the ports, and the sequence number or length).
#[inline(always)]
unsafe fn quote_survives_completion(quoted_l4: *mut u8, proto: u8) {
    // Fragments are never left for checksum offload to complete, and their quote starts
    // with a Fragment header, not a transport header.
    if proto == IPPROTO_FRAGMENT {
        return;
    }
    let field = quoted_l4.add(if proto == IPPROTO_TCP {
        TCP_CSUM_OFF
    } else {
        UDP_CSUM_OFF
    }) as *mut u16;
    field.write_unaligned(0);
    let rest = !fold(sum16(quoted_l4, QUOTED_L4)) as u64; // folded sum of the other words
                                                          // F with !fold(rest + F) == F: in one's-complement arithmetic (mod 0xffff) 2F = -rest,
                                                          // and 2 has the inverse 0x8000 (2 * 0x8000 = 0x10000 = 1).
    field.write_unaligned((((0xffff - rest) * 0x8000) % 0xffff) as u16);
}

/// (free word, checksum) for a TCP header whose other words sum to `rest` (with the free
/// word and the checksum at 0), under a pseudo-header summing to `pseudo`, such that the
/// checksum verifies as written *and* a partial-checksum completion (which sums the header
/// alone, checksum field included, and stores the complement) rewrites it unchanged.
///
/// In one's-complement arithmetic: verifying needs P + R + W + F = 0 and completing needs
/// F = -(R + W + F). Subtracting, F = P; then W = -(R + 2P).
#[inline(always)]
fn survive_completion(pseudo: u32, rest: u32) -> (u16, u16) {
    let p = !fold(pseudo); // folded, not complemented
    let window = fold(rest + p as u32 + p as u32);
    (window, p)
}

/// One's-complement sum of `len` bytes (even) as 16-bit words in memory order.
#[inline(always)]
unsafe fn sum16(p: *const u8, len: usize) -> u32 {
    let mut sum: u32 = 0;
    let mut i = 0;
    while i < len {
        sum += (p.add(i) as *const u16).read_unaligned() as u32;
        i += 2;
    }
    sum
}

#[inline(always)]
fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}
