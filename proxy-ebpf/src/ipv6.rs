//! The IPv6 datapath: tail-called by the IPv4 programs for IPv6 packets, so it has the whole
//! BPF stack to itself.
//!
//! Services are found in `SERVICES6`, backends in the shared `BACKENDS` array (port, flags,
//! generation) with their addresses in `BACKEND_ADDRS6`, flows in `CONNTRACK6`. As for IPv4:
//! destination NAT to a backend, replies restored (at egress only for external frontends),
//! backends that left their service re-balanced, refusals (see `refuse`) for services
//! without endpoints, `sessionAffinity: ClientIP`, `loadBalancerSourceRanges`, and source NAT
//! to the node's IPv6 address (external traffic to another node's endpoint, `masqueradeAll`,
//! `clusterCIDR`), every scheduler (the IPv4 code, over `SERVICES6`, with addresses folded to
//! 32 bits for hashing), hairpin (from `HAIRPIN_SOURCE6`), fragments (a Fragment header
//! right after the fixed header). Other extension headers pass untranslated.
//!
//! Two programs, as for IPv4: `proxy_ingress6`/`proxy_egress6` ([`run`]) translate tracked
//! flows and replies, and tail-call `proxy_new_flow6` ([`run_new_flow`]) for the first
//! packet of a flow to a frontend; as one program (with wrr's search as it was), Debian
//! 6.1's verifier gave up on them (over 1M instructions), now they take 29 000 and 66 000. Each step is a subprogram
//! called from an entry, one level deep: their stack frames are then never stacked on each
//! other, only on the entry's.

use aya_ebpf::{
    bindings::{
        BPF_ANY, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM, TC_ACT_SHOT,
        TC_ACT_UNSPEC,
    },
    helpers::{bpf_csum_diff, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_ns},
    macros::map,
    maps::{lpm_trie::Key as LpmKey, Array, HashMap, LpmTrie, LruHashMap},
    programs::{SockAddrContext, TcContext},
    EbpfContext,
};
use proxy_common::{
    scheduler, tail_calls, AffinityKey6, AffinityValue, BackendAddr6, ConntrackKey6,
    ConntrackValue6, DatapathConfig6, FragmentKey6, FragmentValue6, ServiceKey6, ServiceValue,
    SockRevNatKey, SockRevNatKey6, SockRevNatValue6, SourceRangeKey6, Stat, BACKEND_FLAG_REMOTE,
    BACKEND_INDEX_MASK, CT_FLAG_CLOSING, CT_FLAG_COUNTED, CT_FLAG_EGRESS_ONLY, CT_FLAG_HAIRPIN,
    CT_FLAG_REPLY, CT_FLAG_SEEN_REPLY, CT_FLAG_SNAT, CT_FLAG_SNAT_REPLY, CT_REFRESH_NS,
    FLOW_PATH_TC, FLOW_VERDICT_DENIED, FLOW_VERDICT_DROPPED, FLOW_VERDICT_FORWARDED,
    FLOW_VERDICT_REFUSED, HAIRPIN_SOURCE6, IPPROTO_TCP, IPPROTO_UDP, SCOPE_ALL,
    SERVICE_FLAG_DROP_WHEN_EMPTY, SERVICE_FLAG_EXTERNAL, SERVICE_FLAG_MASQUERADE,
    SERVICE_FLAG_MASQUERADE_ALL, SERVICE_FLAG_SOURCE_RANGES, SERVICE_SCHEDULER_MASK,
    SERVICE_SCHEDULER_SHIFT,
};

use crate::{
    account, backend, bump, config,
    conntrack::{
        clash_free_port, confirm, confirms, forget, forget_reply, get_in, in_use,
        initial_expected_ack, lookup, may_open, note_reply, reply_taken, touch, track, Entry,
        Table, V6,
    },
    count_connection, flows, read, scope_of, scoped_header,
    sock::{choose, node_allowed4, refuse_socket, socket_path, Call, Choice, SOCK_ALLOW},
    tcp_word, Frontend4, Hook, SlotTable, ETH_HLEN, SNAT_PORT_MIN, SNAT_PORT_SPAN, SNAT_PORT_TRIES,
    SOCK_REVNAT, TCP_ACK, TCP_ACK_OFF, TCP_CSUM_OFF, TCP_FIN, TCP_RST, TCP_SEQ_OFF, TCP_SYN,
    UDP_CSUM_OFF,
};

#[map]
pub static SERVICES6: HashMap<ServiceKey6, ServiceValue> = HashMap::with_max_entries(65536, 0);
#[map]
pub static BACKEND_ADDRS6: Array<BackendAddr6> = Array::with_max_entries(65536, 0);
#[map]
pub static CONNTRACK6: LruHashMap<ConntrackKey6, ConntrackValue6> =
    LruHashMap::with_max_entries(65536, 0);
/// Unconfirmed IPv6 flows, as `CT_NEW`.
#[map]
pub static CT_NEW6: LruHashMap<ConntrackKey6, ConntrackValue6> =
    LruHashMap::with_max_entries(16384, 0);
#[map]
static AFFINITY6: LruHashMap<AffinityKey6, AffinityValue> = LruHashMap::with_max_entries(65536, 0);
#[map]
static SOURCE_RANGES6: LpmTrie<SourceRangeKey6, u8> = LpmTrie::with_max_entries(65536, 0);
#[map]
static FRAGMENTS6: LruHashMap<FragmentKey6, FragmentValue6> =
    LruHashMap::with_max_entries(16384, 0);
#[map]
static CONFIG6: Array<DatapathConfig6> = Array::with_max_entries(1, 0);
#[map]
static SOCK_REVNAT6: LruHashMap<SockRevNatKey6, SockRevNatValue6> =
    LruHashMap::with_max_entries(65536, 0);

pub const ETH_P_IPV6: u16 = 0x86dd;
const IPV6_HLEN: usize = 40;
const IP6_SADDR_OFF: usize = ETH_HLEN + 8;
const IP6_DADDR_OFF: usize = ETH_HLEN + 24;
const IPPROTO_FRAGMENT: u8 = 44;
const FRAGMENT_HLEN: usize = 8;

struct Packet6 {
    l4_off: usize,
    key: ConntrackKey6,
    tcp_flags: u8,
    /// First fragment of a fragmented datagram (the rest follow without ports).
    more_fragments: bool,
    /// A fragment after the first: no transport header (ports are 0 in `key`), matched by
    /// its identification. (A flag rather than an enum: the entry's stack is tight.)
    later_fragment: bool,
    /// The Fragment header's identification (network byte order).
    frag_id: u32,
}

#[inline(always)]
pub fn run(ctx: &TcContext, hook: Hook) -> i32 {
    match try_run(ctx, hook) {
        Ok(crate::SEND_BACK) => crate::send_back(ctx),
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
    if pkt.later_fragment {
        return translate_fragment(ctx, &pkt, hook);
    }
    let verdict = translate(ctx, hook, &pkt)?;
    Ok(finish(ctx, hook, &pkt, verdict))
}

/// As `crate::finish`: a hairpin flow's packet goes back out; a first fragment tells the
/// datagram's others what it got.
#[inline(always)]
fn finish(ctx: &TcContext, hook: Hook, pkt: &Packet6, mut verdict: i32) -> i32 {
    if hook == Hook::Ingress && verdict == TC_ACT_UNSPEC && goes_back(ctx, pkt) {
        verdict = crate::SEND_BACK;
    }
    if pkt.more_fragments && (verdict == TC_ACT_UNSPEC || verdict == crate::SEND_BACK) {
        remember_fragment(ctx, pkt, hook.fragment_hook(verdict));
    }
    verdict
}

/// The first packet of a flow to an IPv6 frontend, tail-called by [`translate`]
/// (`tail_calls::NEW_FLOW6`), as `crate::proxy_new_flow` for IPv4: a program of its own,
/// the tracked path stays small, and this one fits Debian 6.1's verifier since wrr's search
/// changed (see `crate::weighted_turn`). It parses the packet again and learns from
/// `cb[1]` whether the flow had an entry.
#[inline(always)]
pub fn run_new_flow(ctx: &TcContext) -> i32 {
    let outcome = match parse(ctx) {
        Some(pkt) if !pkt.later_fragment => {
            // SAFETY: `cb` is the tc program's scratch space, kept across the tail call.
            let known = unsafe { (*ctx.skb.skb).cb[1] } != 0;
            match open_flow(ctx, &pkt, known) {
                Ok(verdict) => Ok(finish(ctx, Hook::Ingress, &pkt, verdict)),
                Err(stat) => Err(stat),
            }
        }
        _ => Ok(TC_ACT_UNSPEC),
    };
    crate::settle(ctx, outcome)
}

/// As `crate::goes_back`: a hairpin flow's packet, translated at ingress (from the hairpin
/// address now, or sent to it and translated).
#[inline(always)]
fn goes_back(ctx: &TcContext, pkt: &Packet6) -> bool {
    match read::<[[u8; 16]; 2]>(ctx, IP6_SADDR_OFF) {
        Some([saddr, daddr]) => {
            (saddr == HAIRPIN_SOURCE6 && pkt.key.saddr != HAIRPIN_SOURCE6)
                || (pkt.key.daddr == HAIRPIN_SOURCE6 && daddr != HAIRPIN_SOURCE6)
        }
        None => false,
    }
}

#[inline(always)]
fn translate(ctx: &TcContext, hook: Hook, pkt: &Packet6) -> Result<i32, Stat> {
    // As for IPv4: a flow that had an entry may take a new backend with any segment.
    let mut known = false;
    if let Some((ct, table)) = lookup::<V6>(&pkt.key) {
        // SAFETY: the pointer is to a map value and valid for this program run.
        let ct = unsafe { &mut *ct };
        let flags = ct.flags;
        // Each kind of entry acts at one hook only; elsewhere the packet passes as it is.
        if flags & CT_FLAG_SNAT != 0 {
            return match hook {
                Hook::Egress => source_nat(ctx, &pkt, ct, IP6_SADDR_OFF),
                Hook::Ingress => Ok(TC_ACT_UNSPEC),
            };
        }
        if flags & CT_FLAG_SNAT_REPLY != 0 {
            return match hook {
                Hook::Ingress => source_nat(ctx, &pkt, ct, IP6_DADDR_OFF),
                Hook::Egress => Ok(TC_ACT_UNSPEC),
            };
        }
        if flags & CT_FLAG_REPLY != 0 {
            if flags & CT_FLAG_EGRESS_ONLY != 0 && hook == Hook::Ingress {
                return Ok(TC_ACT_UNSPEC);
            }
            return translate_reply(ctx, &pkt, ct, table);
        }
        if hook == Hook::Egress {
            return Ok(TC_ACT_UNSPEC);
        }
        if let Some(verdict) = translate_tracked(ctx, &pkt, ct, table)? {
            if confirms(table, ct, pkt.key.proto, pkt.tcp_flags, || {
                tcp_word(ctx, pkt.l4_off, TCP_ACK_OFF)
            }) {
                confirm_flow(&pkt, ct);
            }
            return Ok(verdict);
        }
        known = true;
    }
    if hook == Hook::Egress {
        return Ok(TC_ACT_UNSPEC);
    }
    if pkt.frontend(SCOPE_ALL).slot(0).is_none() {
        forget_clashing_flow(pkt);
        return Ok(TC_ACT_UNSPEC);
    }
    // SAFETY: `cb` is the tc program's scratch space, kept across the tail call.
    unsafe { (*ctx.skb.skb).cb[1] = known as u32 };
    // SAFETY: the slot holds a tc classifier of this object or nothing.
    unsafe { crate::TAIL_CALLS.tail_call(ctx, tail_calls::NEW_FLOW6) };
    Err(Stat::NewFlowFailed)
}

/// A new flow (or a tracked one that needs a new backend: `known`) to a frontend, in
/// `proxy_new_flow6`.
#[inline(always)]
fn open_flow(ctx: &TcContext, pkt: &Packet6, known: bool) -> Result<i32, Stat> {
    let mut header = ServiceValue {
        backend_id: 0,
        service_id: 0,
        count: 0,
        flags: 0,
    };
    if !frontend_header(ctx, pkt, &mut header) {
        return Ok(TC_ACT_UNSPEC);
    }
    match admission(pkt, &header, known) {
        ADMITTED => {}
        UNTRACKED => return Ok(TC_ACT_UNSPEC),
        FLOW_VERDICT_REFUSED => return crate::refuse(ctx),
        _ => return Ok(TC_ACT_SHOT as i32),
    }
    let mut backend_id = sticky_backend(&pkt, &header);
    if backend_id == 0 {
        let slot = schedule_slot(&pkt, &header);
        backend_id = slot_backend_remembered(&pkt, &header, slot);
    }
    if backend_id == 0 {
        return Err(Stat::RewriteFailed);
    }
    if !resolve_clash(ctx, &pkt, backend_id) {
        bump(Stat::TupleClashRefused);
        return crate::refuse_because(ctx, crate::REFUSED_TUPLE_CLASH);
    }
    match new_flow(ctx, &pkt, &header, backend_id) {
        Ok(true) => plan_source_nat(ctx, &pkt, backend_id, header.service_id),
        Ok(false) => {}
        Err(e) => return Err(e),
    }
    Ok(TC_ACT_UNSPEC)
}

const ADMITTED: u8 = 0;
const UNTRACKED: u8 = u8::MAX;

/// Whether a new flow to a frontend with `header` may open: [`ADMITTED`], [`UNTRACKED`]
/// (a segment that opens nothing, left alone), or the `FLOW_VERDICT_*` it gets instead
/// (no endpoint, a Local policy without a local one, outside the source ranges), counted
/// and told. A subprogram of its own: its checks and its telling would otherwise add to
/// the new-flow program's frame, which is at the stack budget's edge.
#[inline(never)]
fn admission(pkt: &Packet6, header: &ServiceValue, known: bool) -> u8 {
    let verdict = if header.count == 0 {
        if header.flags & SERVICE_FLAG_DROP_WHEN_EMPTY != 0 {
            bump(Stat::NoLocalEndpoint);
            FLOW_VERDICT_DROPPED
        } else {
            FLOW_VERDICT_REFUSED
        }
    } else if !known && !may_open(pkt.key.proto, pkt.tcp_flags) {
        bump(Stat::UntrackedSegment);
        return UNTRACKED;
    } else if header.flags & SERVICE_FLAG_SOURCE_RANGES != 0
        && !source_allowed(pkt, header.service_id)
    {
        bump(Stat::SourceRangeDenied);
        FLOW_VERDICT_DENIED
    } else {
        return ADMITTED;
    };
    told(&pkt.key, header.service_id, 0, verdict);
    verdict
}

/// As IPv4's `told`: a follower of new flows hears what the tc path decided.
#[inline(always)]
fn told(key: &ConntrackKey6, service_id: u32, backend_id: u32, verdict: u8) {
    if flows::followed() {
        flows::tell6(
            key,
            service_id,
            backend_id,
            flows::how(verdict, FLOW_PATH_TC),
        );
    }
}

/// IPv6 with TCP or UDP directly after the fixed header, or after a Fragment header;
/// anything else (other extension headers, ICMPv6) passes untouched.
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
    let mut proto: u8 = read(ctx, ETH_HLEN + 6)?;
    let saddr: [u8; 16] = read(ctx, IP6_SADDR_OFF)?;
    let daddr: [u8; 16] = read(ctx, IP6_DADDR_OFF)?;
    let mut l4_off = ETH_HLEN + IPV6_HLEN;
    let (mut more_fragments, mut frag_id) = (false, 0u32);
    if proto == IPPROTO_FRAGMENT {
        // next header, reserved, offset (13 bits) | 2 reserved | M, identification
        let next: u8 = read(ctx, l4_off)?;
        let offset_flags = u16::from_be(read(ctx, l4_off + 2)?);
        frag_id = read(ctx, l4_off + 4)?;
        if next != IPPROTO_TCP && next != IPPROTO_UDP {
            return None;
        }
        if offset_flags & !0x7 != 0 {
            return Some(Packet6 {
                l4_off,
                key: ConntrackKey6::new(saddr, daddr, 0, 0, next),
                tcp_flags: 0,
                more_fragments: false,
                later_fragment: true,
                frag_id,
            });
        }
        more_fragments = offset_flags & 1 != 0;
        proto = next;
        l4_off += FRAGMENT_HLEN;
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return None;
    }
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
        more_fragments,
        later_fragment: false,
        frag_id,
    })
}

/// After the first fragment of a datagram was translated, records the addresses it left
/// with, so the datagram's later fragments get the same at this hook.
// A subprogram of its own: its stack frame is not added to its callers'.
#[inline(never)]
fn remember_fragment(ctx: &TcContext, pkt: &Packet6, hook: u8) {
    // bpf_skb_load_bytes rather than direct packet access: in a subprogram LLVM may
    // narrow the packet pointer to 32 bits, which the verifier rejects.
    let (Ok(saddr), Ok(daddr)) = (
        ctx.load::<[u8; 16]>(IP6_SADDR_OFF),
        ctx.load::<[u8; 16]>(IP6_DADDR_OFF),
    ) else {
        return;
    };
    if saddr == pkt.key.saddr && daddr == pkt.key.daddr {
        return;
    }
    let key = FragmentKey6 {
        saddr: pkt.key.saddr,
        daddr: pkt.key.daddr,
        id: pkt.frag_id,
        proto: pkt.key.proto,
        _pad0: [0; 3],
    };
    let value = FragmentValue6 {
        saddr,
        daddr,
        hook,
        _pad0: [0; 3],
    };
    let _ = FRAGMENTS6.insert(&key, &value, BPF_ANY as u64);
}

/// A fragment after the first: the addresses its first fragment got (no checksum covers
/// them here: IPv6 has no header checksum, and the transport checksum was fixed in the
/// first fragment). Fragments that arrive before their first one pass unchanged.
// A subprogram of its own: its stack frame is not added to its callers'.
#[inline(never)]
fn translate_fragment(ctx: &TcContext, pkt: &Packet6, hook: Hook) -> Result<i32, Stat> {
    let key = FragmentKey6 {
        saddr: pkt.key.saddr,
        daddr: pkt.key.daddr,
        id: pkt.frag_id,
        proto: pkt.key.proto,
        _pad0: [0; 3],
    };
    let Some(to) = (unsafe { FRAGMENTS6.get(&key) }) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let Some(verdict) = crate::fragment_verdict(to.hook, hook) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let (saddr, daddr) = (to.saddr, to.daddr);
    // Nothing else changes with the addresses here, so a receive checksum the NIC computed
    // over the packet (CHECKSUM_COMPLETE) must follow them.
    let recompute = BPF_F_RECOMPUTE_CSUM as u64;
    ctx.store(IP6_SADDR_OFF, &saddr, recompute)
        .map_err(|_| Stat::RewriteFailed)?;
    ctx.store(IP6_DADDR_OFF, &daddr, recompute)
        .map_err(|_| Stat::RewriteFailed)?;
    bump(Stat::FragmentTranslated);
    Ok(verdict)
}

// A subprogram of its own: its stack frame is not added to its callers'.
#[inline(never)]
fn translate_reply(
    ctx: &TcContext,
    pkt: &Packet6,
    ct: &mut ConntrackValue6,
    table: Table,
) -> Result<i32, Stat> {
    // Read here: a sixth argument would not fit in registers.
    let now = unsafe { bpf_ktime_get_ns() };
    let first_reply = ct.flags & CT_FLAG_SEEN_REPLY == 0;
    let closing = pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0 && ct.flags & CT_FLAG_CLOSING == 0;
    let hairpin = ct.flags & CT_FLAG_HAIRPIN != 0;
    // The client's own port, where the flow's source port was translated (a tuple clash).
    let client_port = ct.client_port_or(pkt.key.dport);
    let (nat_addr, nat_port, service_id, backend_id) =
        (ct.nat_addr, ct.nat_port, ct.service_id, ct.backend_id);
    touch(ct, pkt.tcp_flags, now, CT_FLAG_SEEN_REPLY);
    // A hairpin reply goes back to the pod that is also the backend.
    let client = if hairpin {
        pkt.key.saddr
    } else {
        pkt.key.daddr
    };
    if hairpin || client_port != pkt.key.dport {
        rewrite(
            ctx,
            pkt,
            IP6_DADDR_OFF,
            &pkt.key.daddr,
            &client,
            (pkt.l4_off + 2, pkt.key.dport, client_port),
        )?;
    }
    let unconfirmed_syn_ack =
        table == Table::New && pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK;
    if first_reply || closing || unconfirmed_syn_ack {
        // The original-direction entry decides the flow's timeout: tell it what we saw.
        let original = ConntrackKey6::new(client, nat_addr, client_port, nat_port, pkt.key.proto);
        if let Some(orig) = get_in::<V6>(table, &original) {
            // SAFETY: map value pointer, valid for this run.
            let orig = unsafe { &mut *orig };
            touch(orig, pkt.tcp_flags, now, CT_FLAG_SEEN_REPLY);
            if unconfirmed_syn_ack {
                note_reply(orig, pkt.tcp_flags, || {
                    tcp_word(ctx, pkt.l4_off, TCP_SEQ_OFF)
                });
            }
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
    table: Table,
) -> Result<Option<i32>, Stat> {
    // Read here: a sixth argument would not fit in registers.
    let now = unsafe { bpf_ktime_get_ns() };
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
        let reply = reply_key(pkt, ct);
        if ct.flags & CT_FLAG_COUNTED != 0 && backend_alive {
            count_connection(ct.backend_id, u64::MAX);
        }
        forget_reply::<V6>(&reply, pkt.key.daddr, pkt.key.dport);
        forget::<V6>(table, &pkt.key);
        return Ok(None);
    }
    let (nat_addr, nat_port, service_id, backend_id) =
        (ct.nat_addr, ct.nat_port, ct.service_id, ct.backend_id);
    let hairpin = ct.flags & CT_FLAG_HAIRPIN != 0;
    let translated = ct.client_port != 0;
    let sport = source_port(pkt, ct);
    touch(ct, pkt.tcp_flags, now, 0);
    rewrite(
        ctx,
        pkt,
        IP6_DADDR_OFF,
        &pkt.key.daddr,
        &nat_addr,
        (pkt.l4_off + 2, pkt.key.dport, nat_port),
    )?;
    if hairpin || translated {
        translate_source(ctx, pkt, hairpin, (pkt.key.sport, sport))?;
    }
    bump(Stat::EstablishedFlow);
    account(ctx, service_id, backend_id, false);
    Ok(Some(TC_ACT_UNSPEC))
}

/// Moves a flow whose client spoke after a reply to the confirmed map (see `conntrack`).
// A subprogram of its own, called from the entry: its keys stay off the frames below.
#[inline(never)]
fn confirm_flow(pkt: &Packet6, ct: &ConntrackValue6) {
    let to_backend = ConntrackKey6::new(
        pkt.key.saddr,
        ct.nat_addr,
        source_port(pkt, ct),
        ct.nat_port,
        pkt.key.proto,
    );
    confirm::<V6>(&pkt.key, ct, &reply_key(pkt, ct), &to_backend);
}

/// The source port a tracked flow leaves ingress with: its own, or the one given when its
/// tuple clashed.
#[inline(always)]
fn source_port(pkt: &Packet6, ct: &ConntrackValue6) -> u16 {
    ct.client_port_or(pkt.key.sport)
}

/// The reply-direction key of the flow `pkt` belongs to (tracked as `ct`).
#[inline(always)]
fn reply_key(pkt: &Packet6, ct: &ConntrackValue6) -> ConntrackKey6 {
    let client = if ct.flags & CT_FLAG_HAIRPIN != 0 {
        HAIRPIN_SOURCE6
    } else {
        pkt.key.saddr
    };
    ConntrackKey6::new(
        ct.nat_addr,
        client,
        ct.nat_port,
        source_port(pkt, ct),
        pkt.key.proto,
    )
}

/// The backend a client with ClientIP affinity used last, while within the timeout and still
/// serving (its use refreshed); 0: none.
// Subprograms of their own, each called from the entry: their stack frames are never
// stacked on each other (the scheduler's, with its scans, is the largest).
#[inline(never)]
fn sticky_backend(pkt: &Packet6, header: &ServiceValue) -> u32 {
    // The header slot's backend_id is the ClientIP affinity timeout in seconds.
    let affinity_ns = header.backend_id as u64 * 1_000_000_000;
    if affinity_ns == 0 {
        return 0;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let key = AffinityKey6 {
        client: pkt.key.saddr,
        service_id: header.service_id,
    };
    if let Some(last) = unsafe { AFFINITY6.get(&key) } {
        let id = last.backend_id;
        // Still this frontend's backend (as for IPv4).
        let ours = backend(id).is_some_and(|b| b.service_id == header.service_id);
        if now.wrapping_sub(last.last_seen_ns) <= affinity_ns && ours {
            remember_affinity(&key, id, now);
            return id;
        }
    }
    0
}

/// The slot (1..=count) the frontend's scheduler gives a new flow.
#[inline(never)]
fn schedule_slot(pkt: &Packet6, header: &ServiceValue) -> u16 {
    if header.count == 0 {
        return 1;
    }
    let frontend = pkt.frontend(crate::scope_of(header));
    let (client, destination) = (fold_address(&pkt.key.saddr), fold_address(&pkt.key.daddr));
    crate::schedule::<_, true>(frontend, client, destination, header)
}

/// The backend in `slot` (or in slot 1, when a shrinking service just lost `slot`),
/// remembered for the client under affinity; 0: none.
#[inline(never)]
fn slot_backend_remembered(pkt: &Packet6, header: &ServiceValue, slot: u16) -> u32 {
    let scope = crate::scope_of(header);
    let mut id = slot_backend(pkt, scope, slot);
    if id == 0 {
        // The agent lowers the count before it deletes slots; slot 1 exists while count > 0.
        id = slot_backend(pkt, scope, 1);
    }
    if header.backend_id != 0 && id != 0 {
        let key = AffinityKey6 {
            client: pkt.key.saddr,
            service_id: header.service_id,
        };
        remember_affinity(&key, id, unsafe { bpf_ktime_get_ns() });
    }
    id
}

/// An IPv6 frontend, as the schedulers see it (see `SlotTable`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Frontend6 {
    addr: [u8; 16],
    port: u16,
    proto: u8,
    scope: u8,
}

impl Packet6 {
    /// The frontend the packet names, its entry set of `scope`.
    #[inline(always)]
    fn frontend(&self, scope: u8) -> Frontend6 {
        Frontend6 {
            addr: self.key.daddr,
            port: self.key.dport,
            proto: self.key.proto,
            scope,
        }
    }
}

impl SlotTable for Frontend6 {
    #[inline(always)]
    fn slot(self, slot: u16) -> Option<&'static ServiceValue> {
        let key = ServiceKey6::scoped(self.addr, self.port, self.proto, self.scope, slot);
        unsafe { SERVICES6.get(&key) }
    }

    #[inline(always)]
    fn scoped(self, scope: u8) -> Self {
        Frontend6 { scope, ..self }
    }
}

/// An IPv6 address folded to 32 bits (the exclusive or of its words), for the hashing
/// schedulers.
#[inline(always)]
fn fold_address(addr: &[u8; 16]) -> u32 {
    let mut x = 0u32;
    for i in 0..4 {
        x ^= u32::from_ne_bytes([
            addr[i * 4],
            addr[i * 4 + 1],
            addr[i * 4 + 2],
            addr[i * 4 + 3],
        ]);
    }
    x
}

#[inline(always)]
fn remember_affinity(key: &AffinityKey6, backend_id: u32, now: u64) {
    let value = AffinityValue {
        last_seen_ns: now,
        backend_id,
        _pad0: 0,
    };
    let _ = AFFINITY6.insert(key, &value, BPF_ANY as u64);
}

#[inline(always)]
fn slot_backend(pkt: &Packet6, scope: u8, slot: u16) -> u32 {
    match pkt.frontend(scope).slot(slot) {
        Some(entry) if backend(entry.backend_id).is_some() => entry.backend_id,
        _ => 0,
    }
}

#[inline(always)]
fn source_allowed(pkt: &Packet6, service_id: u32) -> bool {
    let key = LpmKey::new(
        32 + 128,
        SourceRangeKey6 {
            service_id,
            addr: pkt.key.saddr,
        },
    );
    SOURCE_RANGES6.get(&key).is_some()
}

/// Tracks the new flow to `backend_id` both ways and sends the packet to it, from
/// the source port the packet has now ([`resolve_clash`] may have changed it). Returns
/// whether the flow is to be source-NATed to the node.
// A subprogram of its own: its stack frame is not added to its callers'.
#[inline(never)]
fn new_flow(
    ctx: &TcContext,
    pkt: &Packet6,
    header: &ServiceValue,
    backend_id: u32,
) -> Result<bool, Stat> {
    let source_port: u16 = read(ctx, pkt.l4_off).ok_or(Stat::RewriteFailed)?;
    let Some(b) = backend(backend_id) else {
        return Err(Stat::RewriteFailed);
    };
    let (backend_port, remote) = (b.port, b.flags & BACKEND_FLAG_REMOTE != 0);
    let Some(addr) = BACKEND_ADDRS6.get(backend_id & BACKEND_INDEX_MASK) else {
        return Err(Stat::RewriteFailed);
    };
    let backend_addr = addr.addr;
    let service_id = header.service_id;
    let now = unsafe { bpf_ktime_get_ns() };
    // A pod reaching itself through its service: it must not see its own address as the
    // source (see `HAIRPIN_SOURCE6`).
    // As for IPv4: a pod of this node given itself.
    let hairpin = if backend_addr == pkt.key.saddr && !remote {
        CT_FLAG_HAIRPIN
    } else {
        0
    };
    let reply_key = ConntrackKey6::new(
        backend_addr,
        if hairpin != 0 {
            HAIRPIN_SOURCE6
        } else {
            pkt.key.saddr
        },
        backend_port,
        source_port,
        pkt.key.proto,
    );
    let translated = source_port != pkt.key.sport;
    let scheduler_id = (header.flags >> SERVICE_SCHEDULER_SHIFT) & SERVICE_SCHEDULER_MASK;
    let counted = if scheduler::counts_connections(scheduler_id) {
        count_connection(backend_id, 1);
        CT_FLAG_COUNTED
    } else {
        0
    };
    let external = header.flags & SERVICE_FLAG_EXTERNAL != 0;
    // One value, the reply entry's and then the original's: two would not fit the frame.
    let mut entry = ConntrackValue6 {
        last_seen_ns: now,
        nat_addr: pkt.key.daddr,
        nat_port: pkt.key.dport,
        flags: crate::reply_flags(hairpin),
        _pad0: 0,
        backend_id,
        service_id,
        expected_ack: 0,
        client_port: if translated { pkt.key.sport } else { 0 },
        _pad1: 0,
        _pad2: 0,
    };
    let mut tracked = track::<V6>(Table::New, &reply_key, &entry);
    if tracked {
        entry.nat_addr = backend_addr;
        entry.nat_port = backend_port;
        entry.flags = counted | hairpin;
        entry.expected_ack = initial_expected_ack(pkt.key.proto, pkt.tcp_flags);
        entry.client_port = if translated { source_port } else { 0 };
        tracked = track::<V6>(Table::New, &pkt.key, &entry);
    }
    if !tracked {
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
    // Here rather than in `open_flow`: its frame is at the stack budget's edge.
    told(&pkt.key, service_id, backend_id, FLOW_VERDICT_FORWARDED);
    if hairpin != 0 {
        // The port stays as `resolve_clash` left it.
        translate_source(ctx, pkt, true, (source_port, source_port))?;
        bump(Stat::NewFlow);
        account(ctx, service_id, backend_id, true);
        return Ok(false);
    }
    bump(Stat::NewFlow);
    account(ctx, service_id, backend_id, true);
    // As for IPv4: always under masqueradeAll; to a cluster IP from other than the pods;
    // external traffic under externalTrafficPolicy: Cluster to another node's endpoint.
    Ok(if header.flags & SERVICE_FLAG_MASQUERADE_ALL != 0 {
        true
    } else if !external {
        match crate::from_pod_interface(ctx) {
            Some(pod) => !pod,
            None => outside_cluster_cidr(&pkt.key.saddr),
        }
    } else {
        header.flags & SERVICE_FLAG_MASQUERADE != 0 && remote
    })
}

/// Where another live flow holds the tuple a new flow to `backend_id` would have (see
/// `conntrack::reply_taken`), gives the packet a free source port; false if none was found
/// (the flow is refused). `new_flow` reads the port back from the packet.
// A subprogram of its own beside `new_flow`: their frames are never stacked (together they
// would not fit), and the port goes through the packet, not the entry's frame.
#[inline(never)]
fn resolve_clash(ctx: &TcContext, pkt: &Packet6, backend_id: u32) -> bool {
    // Without them `new_flow` fails anyway.
    let (Some(b), Some(addr)) = (
        backend(backend_id),
        BACKEND_ADDRS6.get(backend_id & BACKEND_INDEX_MASK),
    ) else {
        return true;
    };
    // As `new_flow` keys the reply entry.
    let client = if addr.addr == pkt.key.saddr {
        HAIRPIN_SOURCE6
    } else {
        pkt.key.saddr
    };
    let mut reply_key = ConntrackKey6::new(addr.addr, client, b.port, pkt.key.sport, pkt.key.proto);
    let now = unsafe { bpf_ktime_get_ns() };
    if !reply_taken::<V6>(&reply_key, &pkt.key, now) {
        return true;
    }
    match clash_free_port::<V6>(&mut reply_key) {
        0 => false,
        port => rewrite_port(ctx, pkt, (pkt.l4_off, pkt.key.sport, port)).is_ok(),
    }
}

#[inline(always)]
fn config6() -> Option<&'static DatapathConfig6> {
    CONFIG6.get(0)
}

/// The header a new flow to the packet's destination uses (see `scoped_header`: a pod of
/// the node takes an `externalTrafficPolicy: Local` frontend's second set), into `out`;
/// false if the destination is no frontend. A call of its own: the keys it builds would not
/// fit in the entry program's stack, and its branches end here for the verifier.
#[inline(never)]
fn frontend_header(ctx: &TcContext, pkt: &Packet6, out: &mut ServiceValue) -> bool {
    let frontend = pkt.frontend(SCOPE_ALL);
    let Some(header) = frontend.slot(0) else {
        return false;
    };
    *out = crate::scoped_header(frontend, header, || match crate::from_pod_interface(ctx) {
        Some(pod) => pod,
        None => inside_cluster_cidr(&pkt.key.saddr),
    });
    true
}

/// Whether an IPv6 source is inside the cluster CIDR (a pod's; false without one). Bits
/// are gathered without a branch per byte, which would multiply the verifier's paths.
#[inline(always)]
fn inside_cluster_cidr(addr: &[u8; 16]) -> bool {
    let Some(c) = config6() else {
        return false;
    };
    let mut set = 0u8;
    let mut outside = 0u8;
    for i in 0..16 {
        let m = c.cluster_cidr_mask[i];
        set |= m;
        outside |= (addr[i] ^ c.cluster_cidr_addr[i]) & m;
    }
    set != 0 && outside == 0
}

#[inline(always)]
fn outside_cluster_cidr(addr: &[u8; 16]) -> bool {
    let Some(c) = config6() else {
        return false;
    };
    let mut set = false;
    let mut inside = true;
    for i in 0..16 {
        let m = c.cluster_cidr_mask[i];
        set |= m != 0;
        inside &= addr[i] & m == c.cluster_cidr_addr[i];
    }
    set && !inside
}

/// Records the source NAT of a new flow (see the IPv4 `plan_masquerade`): at egress the
/// source becomes the node's IPv6 address and a port free for that backend (the client's
/// own when possible); the backend's reply is mapped back at ingress.
#[inline(always)]
fn plan_source_nat(ctx: &TcContext, pkt: &Packet6, backend_id: u32, service_id: u32) {
    // The source port the flow leaves with, read back from the packet `new_flow` rewrote
    // (another than the client's after a tuple clash); kept in the caller instead, it grew
    // the entry's frame past BPF's limit.
    let Some(sport) = read::<u16>(ctx, pkt.l4_off) else {
        return;
    };
    // Two sibling steps, so their frames never stack on each other.
    let port = free_snat_port(pkt, sport, backend_id);
    if port == 0 {
        bump(Stat::SnatPortsExhausted);
        return;
    }
    record_source_nat(pkt, sport, backend_id, service_id, port as u16);
}

/// The node's IPv6 address and the backend, when source NAT can happen: (node, backend
/// address, backend port).
#[inline(always)]
fn snat_ends(backend_id: u32) -> Option<([u8; 16], [u8; 16], u16)> {
    let masq = config6()?.masquerade_addr;
    if masq == [0u8; 16] {
        return None;
    }
    let port = backend(backend_id)?.port;
    let addr = BACKEND_ADDRS6.get(backend_id & BACKEND_INDEX_MASK)?.addr;
    Some((masq, addr, port))
}

/// A source port (network byte order) whose reply tuple from the backend to the node is
/// free: the client's own when possible, else a few random ones; 0: none found (or no
/// source NAT possible).
#[inline(never)]
fn free_snat_port(pkt: &Packet6, sport: u16, backend_id: u32) -> u32 {
    let Some((masq, backend_addr, backend_port)) = snat_ends(backend_id) else {
        return 0;
    };
    let mut port = sport;
    let mut tries = 0;
    while tries < SNAT_PORT_TRIES {
        let reply = ConntrackKey6::new(backend_addr, masq, backend_port, port, pkt.key.proto);
        if !in_use::<V6>(&reply) {
            // A port of 0 is never a client's, nor one of those tried.
            return port as u32;
        }
        port = ((unsafe { bpf_get_prandom_u32() } % SNAT_PORT_SPAN) as u16 + SNAT_PORT_MIN).to_be();
        tries += 1;
    }
    0
}

/// Writes both source-NAT entries of a flow (see the IPv4 `plan_masquerade`).
#[inline(never)]
fn record_source_nat(pkt: &Packet6, sport: u16, backend_id: u32, service_id: u32, port: u16) {
    let Some((masq, backend_addr, backend_port)) = snat_ends(backend_id) else {
        return;
    };
    let now = unsafe { bpf_ktime_get_ns() };
    // Created as established so they live as long as the flow's own entries.
    let snat_key = ConntrackKey6::new(
        pkt.key.saddr,
        backend_addr,
        sport,
        backend_port,
        pkt.key.proto,
    );
    let snat = ConntrackValue6 {
        last_seen_ns: now,
        nat_addr: masq,
        nat_port: port,
        flags: CT_FLAG_SNAT | CT_FLAG_SEEN_REPLY,
        _pad0: 0,
        backend_id,
        service_id,
        expected_ack: 0,
        client_port: 0,
        _pad1: 0,
        _pad2: 0,
    };
    if !track::<V6>(Table::New, &snat_key, &snat) {
        bump(Stat::ConntrackInsertFailed);
        return;
    }
    let unsnat_key = ConntrackKey6::new(backend_addr, masq, backend_port, port, pkt.key.proto);
    let unsnat = ConntrackValue6 {
        nat_addr: pkt.key.saddr,
        nat_port: sport,
        flags: CT_FLAG_SNAT_REPLY | CT_FLAG_SEEN_REPLY,
        ..snat
    };
    if !track::<V6>(Table::New, &unsnat_key, &unsnat) {
        bump(Stat::ConntrackInsertFailed);
    }
}

/// A source-NAT entry at its hook: at egress the source becomes the node (`addr_off` of the
/// source), at ingress the reply's destination goes back to the client.
// A subprogram of its own: its stack frame is not added to its callers'.
#[inline(never)]
fn source_nat(
    ctx: &TcContext,
    pkt: &Packet6,
    ct: &mut ConntrackValue6,
    addr_off: usize,
) -> Result<i32, Stat> {
    let now = unsafe { bpf_ktime_get_ns() };
    let (addr, port) = (ct.nat_addr, ct.nat_port);
    touch(ct, pkt.tcp_flags, now, 0);
    if addr_off == IP6_SADDR_OFF {
        rewrite(
            ctx,
            pkt,
            IP6_SADDR_OFF,
            &pkt.key.saddr,
            &addr,
            (pkt.l4_off, pkt.key.sport, port),
        )?;
    } else {
        rewrite(
            ctx,
            pkt,
            IP6_DADDR_OFF,
            &pkt.key.daddr,
            &addr,
            (pkt.l4_off + 2, pkt.key.dport, port),
        )?;
    }
    Ok(TC_ACT_UNSPEC)
}

/// A new flow that is not for a service may have the reply tuple of an earlier service
/// flow; as for IPv4 (see [`crate::conntrack::forget_clashing_flow`]), the new flow wins.
// A subprogram of its own: its stack frame is not added to its callers'.
#[inline(never)]
fn forget_clashing_flow(pkt: &Packet6) {
    crate::conntrack::forget_clashing_flow::<V6>(&pkt.key, pkt.tcp_flags);
}

/// IPv6 sockets (see [`crate::sock`]): a frontend becomes the backend
/// [`crate::sock::choose`] gives, remembered for replies.
#[inline(always)]
pub fn socket_to_backend(ctx: &SockAddrContext, call: Call) -> i32 {
    // SAFETY: the context pointer is the kernel's bpf_sock_addr for this call.
    let sa = unsafe { &mut *ctx.sock_addr };
    let proto = sa.protocol as u8;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return SOCK_ALLOW;
    }
    let addr = words_to_addr(&sa.user_ip6);
    // user_port holds the port in network byte order in its low 16 bits.
    let port = sa.user_port as u16;
    let chosen = if is_v4_mapped(&addr) {
        // A dual-stack socket naming an IPv4 service as ::ffff:a.b.c.d: the kernel runs
        // only this hook for it, so the IPv4 service is looked up here.
        mapped_backend(ctx, &addr, port, proto, call)
    } else {
        ipv6_backend(ctx, &addr, port, proto, call)
    };
    let (backend_addr, backend_port) = match chosen {
        SocketBackend::Untouched => return SOCK_ALLOW,
        SocketBackend::Refused(service_id) => {
            socket_told(ctx, &addr, port, proto, service_id, 0);
            return refuse_socket();
        }
        SocketBackend::Backend(a, p, id) => {
            socket_told(ctx, &addr, port, proto, 0, id);
            (a, p)
        }
    };
    let key = SockRevNatKey6 {
        cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        addr: backend_addr,
        port: backend_port,
        _pad0: [0; 6],
    };
    let value = SockRevNatValue6 {
        addr,
        port,
        _pad0: [0; 2],
    };
    let _ = SOCK_REVNAT6.insert(&key, &value, BPF_ANY as u64);
    sa.user_ip6 = addr_to_words(&backend_addr);
    sa.user_port = backend_port as u32;
    SOCK_ALLOW
}

enum SocketBackend {
    /// Not a frontend, or left to the tc path.
    Untouched,
    /// Refused, by frontend (service id).
    Refused(u32),
    /// The backend's address (IPv4-mapped for an IPv4 service), port and id.
    Backend([u8; 16], u16, u32),
}

/// A follower of new flows hears what the hooks decided for a socket naming `addr`:`port`
/// (a refusal by frontend `service_id`, or backend `backend_id`, which names its own).
#[inline(always)]
fn socket_told(
    ctx: &SockAddrContext,
    addr: &[u8; 16],
    port: u16,
    proto: u8,
    service_id: u32,
    backend_id: u32,
) {
    if flows::followed() {
        let key = ConntrackKey6::new([0; 16], *addr, 0, port, proto);
        let verdict = if backend_id != 0 {
            FLOW_VERDICT_FORWARDED
        } else {
            FLOW_VERDICT_REFUSED
        };
        flows::tell6(
            &key,
            service_id,
            backend_id,
            flows::how(verdict, socket_path(ctx)),
        );
    }
}

#[inline(always)]
fn is_v4_mapped(addr: &[u8; 16]) -> bool {
    addr[..10] == [0u8; 10] && addr[10] == 0xff && addr[11] == 0xff
}

/// The backend of an IPv6 frontend the hooks choose.
#[inline(always)]
fn ipv6_backend(
    ctx: &SockAddrContext,
    addr: &[u8; 16],
    port: u16,
    proto: u8,
    call: Call,
) -> SocketBackend {
    let frontend = Frontend6 {
        addr: *addr,
        port,
        proto,
        scope: SCOPE_ALL,
    };
    let Some(header) = frontend.slot(0) else {
        return SocketBackend::Untouched;
    };
    // Every socket below the hooks is a client on this node.
    let header = scoped_header(frontend, header, || true);
    let frontend = frontend.scoped(scope_of(&header));
    let destination = fold_address(addr);
    let id = match choose(
        ctx,
        frontend,
        &header,
        proto,
        call,
        destination,
        node_allowed6,
    ) {
        Choice::Leave => return SocketBackend::Untouched,
        Choice::Refuse => return SocketBackend::Refused(header.service_id),
        Choice::Backend(id, _) => id,
    };
    let (Some(b), Some(a)) = (backend(id), BACKEND_ADDRS6.get(id & BACKEND_INDEX_MASK)) else {
        return SocketBackend::Untouched;
    };
    SocketBackend::Backend(a.addr, b.port, id)
}

/// Whether the node's IPv6 address is inside frontend `service_id`'s source ranges.
#[inline(always)]
fn node_allowed6(service_id: u32) -> bool {
    let Some(c) = CONFIG6.get(0) else {
        return false;
    };
    let key = LpmKey::new(
        32 + 128,
        SourceRangeKey6 {
            service_id,
            addr: c.masquerade_addr,
        },
    );
    SOURCE_RANGES6.get(&key).is_some()
}

/// The backend of the IPv4 frontend an IPv4-mapped address names, mapped back.
#[inline(always)]
fn mapped_backend(
    ctx: &SockAddrContext,
    addr: &[u8; 16],
    port: u16,
    proto: u8,
    call: Call,
) -> SocketBackend {
    let v4 = u32::from_ne_bytes([addr[12], addr[13], addr[14], addr[15]]);
    let frontend = Frontend4::new(v4, port, proto);
    let Some(header) = frontend.slot(0) else {
        return SocketBackend::Untouched;
    };
    let header = scoped_header(frontend, header, || true);
    let frontend = frontend.scoped(scope_of(&header));
    let b = match choose(ctx, frontend, &header, proto, call, v4, node_allowed4) {
        Choice::Leave => return SocketBackend::Untouched,
        Choice::Refuse => return SocketBackend::Refused(header.service_id),
        Choice::Backend(_, b) => b,
    };
    let mut mapped = *addr;
    let octets = b.addr.to_ne_bytes();
    mapped[12..16].copy_from_slice(&octets);
    SocketBackend::Backend(mapped, b.port, b.id)
}

/// recvfrom / getpeername on a socket translated above: it sees the frontend it asked for.
#[inline(always)]
pub fn backend_to_service(ctx: &SockAddrContext) -> i32 {
    // SAFETY: as above.
    let sa = unsafe { &mut *ctx.sock_addr };
    let key = SockRevNatKey6 {
        cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        addr: words_to_addr(&sa.user_ip6),
        port: sa.user_port as u16,
        _pad0: [0; 6],
    };
    if let Some(service) = unsafe { SOCK_REVNAT6.get(&key) } {
        sa.user_ip6 = addr_to_words(&service.addr);
        sa.user_port = service.port as u32;
    } else if is_v4_mapped(&key.addr) {
        // A dual-stack socket's datagrams to an IPv4-mapped address go out through the
        // kernel's IPv4 path, so the IPv4 sendmsg hook translated them (and remembered the
        // service in SOCK_REVNAT); replies come back here, mapped.
        let a = key.addr;
        let key4 = SockRevNatKey {
            cookie: key.cookie,
            addr: u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
            port: key.port,
            _pad0: [0; 2],
        };
        if let Some(service) = unsafe { SOCK_REVNAT.get(&key4) } {
            let mut mapped = a;
            mapped[12..16].copy_from_slice(&service.addr.to_ne_bytes());
            sa.user_ip6 = addr_to_words(&mapped);
            sa.user_port = service.port as u32;
        }
    }
    SOCK_ALLOW
}

/// `bpf_sock_addr.user_ip6` holds the address as four 32-bit words in network byte order.
#[inline(always)]
fn words_to_addr(words: &[u32; 4]) -> [u8; 16] {
    let mut addr = [0u8; 16];
    for i in 0..4 {
        let b = words[i].to_ne_bytes();
        addr[i * 4] = b[0];
        addr[i * 4 + 1] = b[1];
        addr[i * 4 + 2] = b[2];
        addr[i * 4 + 3] = b[3];
    }
    addr
}

#[inline(always)]
fn addr_to_words(addr: &[u8; 16]) -> [u32; 4] {
    let mut words = [0u32; 4];
    for i in 0..4 {
        words[i] = u32::from_ne_bytes([
            addr[i * 4],
            addr[i * 4 + 1],
            addr[i * 4 + 2],
            addr[i * 4 + 3],
        ]);
    }
    words
}

/// The source a flow leaves ingress with: [`HAIRPIN_SOURCE6`] for a flow from its own
/// backend, and `ports.1` (the client's, or the one given when its tuple clashed) instead
/// of the packet's `ports.0`.
#[inline(always)]
fn translate_source(
    ctx: &TcContext,
    pkt: &Packet6,
    hairpin: bool,
    ports: (u16, u16),
) -> Result<(), Stat> {
    let port = (pkt.l4_off, ports.0, ports.1);
    if !hairpin {
        // No address to copy: the callers' frames are near BPF's stack limit.
        return rewrite_port(ctx, pkt, port);
    }
    rewrite(
        ctx,
        pkt,
        IP6_SADDR_OFF,
        &pkt.key.saddr,
        &HAIRPIN_SOURCE6,
        port,
    )
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
    let (csum_off, mangled) = l4_checksum(pkt);
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
        // With the pseudo-header flag the helper also moves a CHECKSUM_COMPLETE receive
        // checksum by the difference, as IPv4 needs (its header checksum changes too). IPv6
        // has no header checksum: the address and transport checksum changes cancel out, so
        // the store puts the difference back.
        ctx.store(addr_off, new_addr, BPF_F_RECOMPUTE_CSUM as u64)
            .map_err(|_| Stat::RewriteFailed)?;
    }
    rewrite_port(ctx, pkt, port)
}

/// Where the packet's transport checksum is, and the flags its updates take: a UDP checksum
/// of 0 means "none" and must stay so, and never become 0 for a real one.
#[inline(always)]
fn l4_checksum(pkt: &Packet6) -> (usize, u64) {
    if pkt.key.proto == IPPROTO_TCP {
        (pkt.l4_off + TCP_CSUM_OFF, 0)
    } else {
        (pkt.l4_off + UDP_CSUM_OFF, BPF_F_MARK_MANGLED_0 as u64)
    }
}

/// The port half of [`rewrite`]: `(offset, old, new)`.
#[inline(always)]
fn rewrite_port(ctx: &TcContext, pkt: &Packet6, port: (usize, u16, u16)) -> Result<(), Stat> {
    let (csum_off, mangled) = l4_checksum(pkt);
    let (port_off, old_port, new_port) = port;
    if old_port != new_port {
        ctx.l4_csum_replace(csum_off, old_port as u64, new_port as u64, mangled | 2)
            .map_err(|_| Stat::RewriteFailed)?;
        ctx.store(port_off, &new_port, 0)
            .map_err(|_| Stat::RewriteFailed)?;
    }
    Ok(())
}
