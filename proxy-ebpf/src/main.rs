//! The eBPF datapath: tc classifiers that translate TCP/UDP flows to a Service's frontends
//! (ClusterIP, NodePort, external and load-balancer IPs) into a backend and the replies
//! back, and cgroup socket hooks that translate the node's own sockets at connect time.
//!
//! Per packet: parse Ethernet/IP/L4 with a bounds check before every read (IPv4 here; IPv6
//! in [`ipv6`], tail-called), then
//! 1. a conntrack hit in the reply direction rewrites the source back to the frontend, at
//!    egress, after netfilter (a hairpin flow's at ingress, sent back out: [`send_back`]);
//! 2. a conntrack hit in the original direction rewrites the destination to the flow's
//!    backend, provided the backend is still in the service and the flow has not timed out;
//! 3. otherwise a frontend lookup (`SERVICES`) checks source ranges, ClientIP affinity and
//!    picks a backend with the service's scheduler (random by default, or any of IPVS's
//!    twelve), records both directions in conntrack, source-NATs where the model asked
//!    (Cluster policy to a remote backend, masqueradeAll, hairpin) and rewrites; a frontend
//!    with no backend is refused in [`refuse`] (TCP reset, ICMP/ICMPv6 unreachable).
//!
//! Anything that is not for a service leaves untouched with `TC_ACT_UNSPEC`, which is TCX's
//! "next": programs attached after ours (a CNI's) still see the packet.
#![no_std]
#![no_main]
// BPF has an atomic fetch-and-add instruction, but core's atomics do not expose it for
// this target; the intrinsic emits it.
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod conntrack;
mod flows;
mod ipv6;
mod refuse;
mod sock;

use sock::Call;

use core::mem::size_of;

use conntrack::{
    confirm, confirms, forget, forget_clashing_flow, lookup, touch, track, Entry, Table, V4,
};

use aya_ebpf::{
    bindings::{
        BPF_ANY, BPF_F_MARK_MANGLED_0, BPF_F_NO_PREALLOC, BPF_F_PSEUDO_HDR, TC_ACT_SHOT,
        TC_ACT_UNSPEC,
    },
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_redirect},
    macros::{cgroup_sock, cgroup_sock_addr, classifier, map},
    maps::{
        lpm_trie::Key as LpmKey, Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, ProgramArray,
    },
    programs::{SockAddrContext, SockContext, TcContext},
    Global,
};
use aya_log_ebpf::debug;
use proxy_common::{
    scheduler, tail_calls, AffinityKey, AffinityValue, Backend, ConntrackKey, ConntrackValue,
    DatapathConfig, FragmentKey, FragmentValue, LblcrSet, LcScratch, MaglevKey, ServiceKey,
    ServiceName, ServiceStats, ServiceValue, SockAffinityKey, SockLbValue, SockRevNatKey,
    SockRevNatValue, SourceRangeKey, Stat, BACKEND_FLAG_REMOTE, BACKEND_INDEX_MASK,
    CT_FLAG_CLOSING, CT_FLAG_COUNTED, CT_FLAG_EGRESS_ONLY, CT_FLAG_HAIRPIN, CT_FLAG_REPLY,
    CT_FLAG_SEEN_REPLY, CT_FLAG_SNAT, CT_FLAG_SNAT_REPLY, CT_REFRESH_NS, FLOW_PATH_TC,
    FLOW_VERDICT_DENIED, FLOW_VERDICT_DROPPED, FLOW_VERDICT_FORWARDED, FLOW_VERDICT_REFUSED,
    HAIRPIN_SOURCE, IPPROTO_TCP, IPPROTO_UDP, LBLCR_SET_SIZE, LOCAL_IFACES_MAX, SCOPE_ALL,
    SCOPE_IN_CLUSTER, SERVICE_FLAG_DROP_WHEN_EMPTY, SERVICE_FLAG_EXTERNAL,
    SERVICE_FLAG_IN_CLUSTER_SET, SERVICE_FLAG_MASQUERADE, SERVICE_FLAG_MASQUERADE_ALL,
    SERVICE_FLAG_SCOPE_IN_CLUSTER, SERVICE_FLAG_SOURCE_RANGES, SERVICE_SCHEDULER_MASK,
    SERVICE_SCHEDULER_SHIFT,
};

// Sizes here are defaults for loaders that do not size maps; the agent always sets them from
// its configuration before loading.
#[map]
static SERVICES: HashMap<ServiceKey, ServiceValue> = HashMap::with_max_entries(65536, 0);
#[map]
pub(crate) static BACKENDS: Array<Backend> = Array::with_max_entries(65536, 0);
#[map]
static CONNTRACK: LruHashMap<ConntrackKey, ConntrackValue> =
    LruHashMap::with_max_entries(262144, 0);
/// Flows not yet confirmed (see `conntrack`): a flood of spoofed sources churns this map only.
#[map]
static CT_NEW: LruHashMap<ConntrackKey, ConntrackValue> = LruHashMap::with_max_entries(65536, 0);
#[map]
static CONFIG: Array<DatapathConfig> = Array::with_max_entries(1, 0);
#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Stat::COUNT, 0);
#[map]
static SERVICE_STATS: PerCpuArray<ServiceStats> = PerCpuArray::with_max_entries(65536, 0);
#[map]
static BACKEND_STATS: PerCpuArray<ServiceStats> = PerCpuArray::with_max_entries(65536, 0);
/// Written by the agent for `inspect` only; no program reads it.
#[map]
static SERVICE_NAMES: HashMap<u32, ServiceName> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);
#[map]
static AFFINITY: LruHashMap<AffinityKey, AffinityValue> = LruHashMap::with_max_entries(65536, 0);
#[map]
static FRAGMENTS: LruHashMap<FragmentKey, FragmentValue> = LruHashMap::with_max_entries(16384, 0);
#[map]
static RR_STATE: Array<u64> = Array::with_max_entries(65536, 0);
/// Active connections per backend slot, counted by the datapath (+1 on a new flow of a
/// least-connection frontend, -1 when it closes, expires or moves).
#[map]
static BACKEND_CONNS: Array<u64> = Array::with_max_entries(65536, 0);
/// Flows the agent's garbage collector removed while still counted, per backend slot (the
/// agent is its only writer; active = BACKEND_CONNS - BACKEND_RELEASED).
#[map]
static BACKEND_RELEASED: Array<u64> = Array::with_max_entries(65536, 0);
#[map]
static LBLCR_SETS: Array<LblcrSet> = Array::with_max_entries(65536, 0);
// Allocated as used: only `mh` frontends have tables.
#[map]
static MAGLEV: HashMap<MaglevKey, u32> = HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);
#[map]
static SOCK_REVNAT: LruHashMap<SockRevNatKey, SockRevNatValue> =
    LruHashMap::with_max_entries(65536, 0);
/// The programs tail-called, filled by the agent (see `proxy_common::tail_calls`).
/// ClientIP affinity of sockets the hooks translate, by network namespace (see [`sock`]).
#[map]
static SOCK_AFFINITY: LruHashMap<SockAffinityKey, AffinityValue> =
    LruHashMap::with_max_entries(65536, 0);
/// Sockets counted for a least-connection scheduler, until released. A hash, not an LRU:
/// an evicted entry would never give its count back.
#[map]
static SOCK_LB: HashMap<u64, SockLbValue> = HashMap::with_max_entries(65536, 0);
#[map]
pub(crate) static TAIL_CALLS: ProgramArray = ProgramArray::with_max_entries(tail_calls::COUNT, 0);
#[map]
static SOURCE_RANGES: LpmTrie<SourceRangeKey, u8> = LpmTrie::with_max_entries(65536, 0);
/// The node's pod interfaces, when `detectLocalMode` tells pods by interface.
#[map]
static LOCAL_IFACES: HashMap<u32, u8> = HashMap::with_max_entries(LOCAL_IFACES_MAX, 0);

/// Set by the agent at load time (`--backend-metrics`); read-only, so when it is 0 the
/// verifier drops the per-backend accounting altogether.
#[unsafe(no_mangle)]
static BACKEND_STATS_ENABLED: Global<u8> = Global::new(0);

/// Set by the agent at load time when the kernel has `bpf_set_retval` for socket hooks
/// (`proxy_common::SOCK_SET_RETVAL`); read-only, so when it is 0 the verifier never sees
/// the helper call (an older kernel would refuse it).
#[unsafe(no_mangle)]
static SOCK_SET_RETVAL: Global<u8> = Global::new(0);

/// Set by the agent at load time: its own network namespace's cookie, the one the node's
/// processes share (`proxy_common::HOST_NETNS_COOKIE`); 0: the initial namespace.
#[unsafe(no_mangle)]
static HOST_NETNS_COOKIE: Global<u64> = Global::new(0);

/// Set by the agent at load time (`--socket-lb host-only`): the hooks translate only the
/// node's own sockets.
#[unsafe(no_mangle)]
static SOCK_HOST_ONLY: Global<u8> = Global::new(0);

/// Set by the agent at load time when it attaches `proxy_sock_release` (which needs the
/// socket cookie in cgroup/sock programs): sockets may then be counted for the
/// least-connection schedulers.
#[unsafe(no_mangle)]
static SOCK_RELEASE_ATTACHED: Global<u8> = Global::new(0);

/// How often a tracked flow's timestamp is refreshed. The upgrade-test variant differs here
/// only, which changes the program without changing its behaviour.
#[cfg(not(feature = "upgrade-test-variant"))]
const REFRESH_NS: u64 = CT_REFRESH_NS;
#[cfg(feature = "upgrade-test-variant")]
const REFRESH_NS: u64 = CT_REFRESH_NS / 2;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const IPV4_HLEN: usize = 20;
const IP_CSUM_OFF: usize = ETH_HLEN + 10;
const IP_SADDR_OFF: usize = ETH_HLEN + 12;
const IP_DADDR_OFF: usize = ETH_HLEN + 16;
const TCP_CSUM_OFF: usize = 16;
const UDP_CSUM_OFF: usize = 6;
const IP_MORE_FRAGMENTS: u16 = 0x2000;
const IP_OFFSET_MASK: u16 = 0x1fff;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
/// Offsets in the TCP header of the sequence and acknowledgment numbers.
const TCP_SEQ_OFF: usize = 4;
const TCP_ACK_OFF: usize = 8;

/// A 32-bit field of the TCP header at `l4_off` (host byte order); read through the load
/// helper, only where a flow is being confirmed (not on the established path).
#[inline(always)]
fn tcp_word(ctx: &TcContext, l4_off: usize, field: usize) -> Option<u32> {
    ctx.load::<u32>(l4_off + field).ok().map(u32::from_be)
}

/// Source ports tried for a masqueraded flow when the client's own port is taken for that
/// backend: 32768..=65535. A port is only used when no reply entry from the backend holds it.
const SNAT_PORT_MIN: u16 = 32768;
const SNAT_PORT_SPAN: u32 = 32768;
const SNAT_PORT_TRIES: u32 = 8;
/// Backends a least-connection scheduler compares per new flow (bpf_loop, so the cost is
/// per backend scanned, not per verification).
#[cfg(not(feature = "no-bpf-loop"))]
const LC_SCAN: u32 = 1024;
/// Whether the socket hooks run the least-connection family's scans (see [`schedule`]).
pub(crate) const SOCKET_SCANS: bool = !cfg!(feature = "no-bpf-loop");
/// Without bpf_loop (kernels before 5.17: the `no-bpf-loop` build) the scan is a bounded
/// loop the verifier walks step by step, so it compares fewer backends (from a random start,
/// as the longer scan does).
#[cfg(feature = "no-bpf-loop")]
const LC_SCAN: u32 = 16;

/// One step of a scan over backends (see [`scan_steps`]): non-zero ends the scan.
trait ScanStep {
    fn step(&mut self, index: u64) -> i64;
}

/// A scan step as a `bpf_loop` callback.
#[cfg(not(feature = "no-bpf-loop"))]
extern "C" fn step_callback<S: ScanStep>(index: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: bpf_loop passes back the pointer scan_steps gave it, to the caller's stack.
    let scan = unsafe { &mut *(ctx as *mut S) };
    scan.step(index)
}

/// Runs `scan.step(i)` for i in 0..steps until it returns non-zero: `bpf_loop` (5.17),
/// whose callback is verified once.
#[cfg(not(feature = "no-bpf-loop"))]
#[inline(always)]
fn scan_steps<S: ScanStep>(steps: u32, scan: &mut S) {
    // SAFETY: the callback gets back `scan`, which outlives the call.
    unsafe {
        aya_ebpf::helpers::bpf_loop(
            steps,
            step_callback::<S> as *mut core::ffi::c_void,
            scan as *mut S as *mut core::ffi::c_void,
            0,
        );
    }
}

/// The same as a bounded loop of at most [`LC_SCAN`] steps, in the caller's frame
/// (kernels before 5.17, whose verifiers also reject a callback's function pointer).
#[cfg(feature = "no-bpf-loop")]
#[inline(always)]
fn scan_steps<S: ScanStep>(steps: u32, scan: &mut S) {
    let mut i = 0u32;
    while i < LC_SCAN && i < steps {
        if scan.step(i as u64) != 0 {
            break;
        }
        i += 1;
    }
}

/// A scan's state in the `no-bpf-loop` build: a per-CPU value instead of the stack, whose
/// 512 bytes the packet program and a bounded scan in its frame chain do not both fit.
#[cfg(feature = "no-bpf-loop")]
#[map]
static SCAN_SCRATCH: PerCpuArray<[u64; 16]> = PerCpuArray::with_max_entries(1, 0);

/// `state`, moved to where its scan runs: the per-CPU scratch value (`no-bpf-loop`).
#[cfg(feature = "no-bpf-loop")]
#[inline(always)]
fn scan_state<'a, S>(state: S) -> Option<&'a mut S> {
    const { assert!(core::mem::size_of::<S>() <= core::mem::size_of::<[u64; 16]>()) };
    let place = SCAN_SCRATCH.get_ptr_mut(0)? as *mut S;
    // SAFETY: a map value pointer, valid for this run, large and aligned enough (above);
    // one program runs per CPU at a time, and each scan initialises it before use.
    unsafe {
        place.write(state);
        Some(&mut *place)
    }
}

/// IPVS's default lblcr expiration (net.ipv4.vs.lblcr_expiration): 24 hours.
const LBLCR_EXPIRATION_NS: u64 = 24 * 3600 * 1_000_000_000;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Hook {
    Ingress,
    Egress,
}

// Inlined into the entry point the macro wraps it in: as a subprogram of its own, its frame
// and the entry's (32 bytes on verifiers before 6.6) were summed past 512 on 6.1.
#[classifier]
#[inline(always)]
pub fn proxy_ingress(ctx: TcContext) -> i32 {
    run(&ctx, Hook::Ingress)
}

#[classifier]
pub fn proxy_egress(ctx: TcContext) -> i32 {
    run(&ctx, Hook::Egress)
}

#[classifier]
pub fn proxy_refuse(ctx: TcContext) -> i32 {
    refuse::run(&ctx)
}

#[classifier]
pub fn proxy_ingress6(ctx: TcContext) -> i32 {
    ipv6::run(&ctx, Hook::Ingress)
}

#[classifier]
pub fn proxy_egress6(ctx: TcContext) -> i32 {
    ipv6::run(&ctx, Hook::Egress)
}

#[cgroup_sock_addr(connect6)]
pub fn proxy_connect6(ctx: SockAddrContext) -> i32 {
    ipv6::socket_to_backend(&ctx, Call::Connect)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn proxy_sendmsg6(ctx: SockAddrContext) -> i32 {
    ipv6::socket_to_backend(&ctx, Call::Sendmsg)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn proxy_recvmsg6(ctx: SockAddrContext) -> i32 {
    ipv6::backend_to_service(&ctx)
}

#[cgroup_sock_addr(getpeername6)]
pub fn proxy_getpeername6(ctx: SockAddrContext) -> i32 {
    ipv6::backend_to_service(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn proxy_connect4(ctx: SockAddrContext) -> i32 {
    sock::socket_to_backend(&ctx, Call::Connect)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn proxy_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::socket_to_backend(&ctx, Call::Sendmsg)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn proxy_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::backend_to_service(&ctx)
}

#[cgroup_sock_addr(getpeername4)]
pub fn proxy_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::backend_to_service(&ctx)
}

#[cgroup_sock(sock_release)]
pub fn proxy_sock_release(ctx: SockContext) -> i32 {
    sock::release(&ctx)
}

#[inline(always)]
fn run(ctx: &TcContext, hook: Hook) -> i32 {
    settle(ctx, try_run(ctx, hook))
}

/// The tc action for a translation's outcome.
#[inline(always)]
pub(crate) fn settle(ctx: &TcContext, outcome: Result<i32, Stat>) -> i32 {
    match outcome {
        Ok(SEND_BACK) => send_back(ctx),
        Ok(verdict) => verdict,
        Err(stat) => {
            bump(stat);
            TC_ACT_SHOT as i32
        }
    }
}

#[inline(always)]
fn try_run(ctx: &TcContext, hook: Hook) -> Result<i32, Stat> {
    if read::<u16>(ctx, 12) == Some(ipv6::ETH_P_IPV6.to_be()) {
        let index = match hook {
            Hook::Ingress => tail_calls::INGRESS6,
            Hook::Egress => tail_calls::EGRESS6,
        };
        // SAFETY: the slot holds a tc classifier of this object or nothing; on failure
        // (no IPv6 program loaded) the packet continues as not ours.
        unsafe { TAIL_CALLS.tail_call(ctx, index) };
        return Ok(TC_ACT_UNSPEC);
    }
    match parse(ctx) {
        Some(Parsed::Flow(pkt)) => {
            let verdict = try_translate(ctx, hook, &pkt)?;
            Ok(finish(ctx, hook, &pkt, verdict))
        }
        Some(Parsed::LaterFragment(key)) => translate_fragment(ctx, &key, hook),
        None => Ok(TC_ACT_UNSPEC),
    }
}

/// After a packet's translation: a hairpin flow's goes back out ([`goes_back`]); a first
/// fragment tells the datagram's others what it got.
#[inline(always)]
fn finish(ctx: &TcContext, hook: Hook, pkt: &Packet, mut verdict: i32) -> i32 {
    if hook == Hook::Ingress && verdict == TC_ACT_UNSPEC && goes_back(ctx, pkt) {
        verdict = SEND_BACK;
    }
    if pkt.more_fragments && (verdict == TC_ACT_UNSPEC || verdict == SEND_BACK) {
        remember_fragment(ctx, pkt, hook.fragment_hook(verdict));
    }
    verdict
}

/// The first packet of a flow to an IPv4 frontend, tail-called by [`proxy_ingress`]
/// (`tail_calls::NEW_FLOW`): a program of its own, so the new-flow path's stack is not
/// added to the tracked-flow path's (together they passed Debian 6.1's 512 bytes once the
/// short-circuit's set was chosen here). It parses the packet again (cheaper than passing
/// it) and learns from `cb[1]` whether the flow had an entry (see [`try_translate`]).
#[classifier]
pub fn proxy_new_flow(ctx: TcContext) -> i32 {
    let outcome = match parse(&ctx) {
        Some(Parsed::Flow(pkt)) => {
            // SAFETY: `cb` is the tc program's scratch space, kept across the tail call.
            let known = unsafe { (*ctx.skb.skb).cb[1] } != 0;
            match open_flow(&ctx, &pkt, known) {
                Ok(verdict) => Ok(finish(&ctx, Hook::Ingress, &pkt, verdict)),
                Err(stat) => Err(stat),
            }
        }
        _ => Ok(TC_ACT_UNSPEC),
    };
    settle(&ctx, outcome)
}

/// The first packet of a flow to an IPv6 frontend (`tail_calls::NEW_FLOW6`), tail-called by
/// [`proxy_ingress6`]; see `ipv6::run_new_flow`.
#[classifier]
pub fn proxy_new_flow6(ctx: TcContext) -> i32 {
    ipv6::run_new_flow(&ctx)
}

/// The fields of a packet the translation needs, read once up front.
struct Packet {
    l4_off: usize,
    key: ConntrackKey,
    tcp_flags: u8,
    /// First fragment of a fragmented datagram (the rest follow without ports).
    more_fragments: bool,
    /// IPv4 identification, network byte order.
    ip_id: u16,
}

enum Parsed {
    Flow(Packet),
    /// A fragment after the first: no transport header, matched by IP identification.
    LaterFragment(FragmentKey),
}

const HOOK_INGRESS: u8 = 0;
const HOOK_EGRESS: u8 = 1;
/// Ingress, and then back out of the interface (`FragmentValue::hook`, see [`SEND_BACK`]).
const HOOK_INGRESS_BACK: u8 = 2;

impl Hook {
    fn number(self) -> u8 {
        match self {
            Hook::Ingress => HOOK_INGRESS,
            Hook::Egress => HOOK_EGRESS,
        }
    }

    /// What a datagram's later fragments are told of the hook its first one took.
    pub(crate) fn fragment_hook(self, verdict: i32) -> u8 {
        if verdict == SEND_BACK {
            HOOK_INGRESS_BACK
        } else {
            self.number()
        }
    }
}

/// A translation's verdict that is no tc action: the packet goes back out of the interface
/// it came in on ([`send_back`]).
pub(crate) const SEND_BACK: i32 = 0x100;

/// The verdict for a later fragment whose first fragment left with `fragment_hook`, at `hook`;
/// `None` when it is another hook's.
#[inline(always)]
pub(crate) fn fragment_verdict(fragment_hook: u8, hook: Hook) -> Option<i32> {
    match (fragment_hook, hook) {
        (HOOK_INGRESS_BACK, Hook::Ingress) => Some(SEND_BACK),
        (h, hook) if h == hook.number() => Some(TC_ACT_UNSPEC),
        _ => None,
    }
}

/// Whether a packet translated at ingress belongs to a hairpin flow (a pod of this node
/// reaching itself through its Service), either way: it now comes from the hairpin
/// address, or it was sent to it and was translated. Told from the packet, not the flow:
/// returned from the translation, the flag would keep values alive across it, past 6.1's
/// stack limit.
#[inline(always)]
fn goes_back(ctx: &TcContext, pkt: &Packet) -> bool {
    match read::<[u32; 2]>(ctx, IP_SADDR_OFF) {
        Some([saddr, daddr]) => {
            (saddr == HAIRPIN && pkt.key.saddr != HAIRPIN)
                || (pkt.key.daddr == HAIRPIN && daddr != HAIRPIN)
        }
        None => false,
    }
}

/// Sends a hairpin flow's packet (a pod reaching itself through its Service, and the
/// replies) back out of the interface it came in on, Ethernet addresses swapped, past
/// netfilter: conntrack there would see the reply's translated tuple without ever having
/// seen the flow's, find it INVALID, and a firewall's (or kube-proxy's) INVALID drop would
/// drop it. Other flows keep conntrack's view whole by restoring replies at egress.
#[inline(always)]
pub(crate) fn send_back(ctx: &TcContext) -> i32 {
    let start = ctx.data();
    if start + ETH_HLEN > ctx.data_end() {
        bump(Stat::RewriteFailed);
        return TC_ACT_SHOT;
    }
    // Written in place, a half-word at a time: a copy through the stack would cost the
    // ingress program's frame.
    let macs = start as *mut u16;
    for i in 0..3 {
        // SAFETY: bounds checked above (12 bytes of addresses); unaligned accesses.
        unsafe {
            let (to, from) = (macs.add(i), macs.add(i + 3));
            let dst = to.read_unaligned();
            to.write_unaligned(from.read_unaligned());
            from.write_unaligned(dst);
        }
    }
    // SAFETY: the context's socket buffer is valid for this program run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a helper call without pointers.
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}

/// A reply entry's flags: a hairpin flow's reply is restored at ingress (and sent back),
/// every other at egress, after netfilter, whose conntrack then sees the reply of the
/// tuple it saw leave ingress translated.
#[inline(always)]
fn reply_flags(hairpin: u8) -> u8 {
    if hairpin != 0 {
        CT_FLAG_REPLY | hairpin
    } else {
        CT_FLAG_REPLY | CT_FLAG_EGRESS_ONLY
    }
}

/// After the first fragment of a datagram was translated, records the addresses it left
/// with, so the datagram's other fragments get the same at this hook.
#[inline(always)]
fn remember_fragment(ctx: &TcContext, pkt: &Packet, hook: u8) {
    // One read, one bounds check: with two, the compiler may leave a register unset on a
    // path where only the second succeeds, which cannot happen but which the verifier
    // walks (it refused the program once, seeing a map pointer spilled as the address).
    let Some([saddr, daddr]) = read::<[u32; 2]>(ctx, IP_SADDR_OFF) else {
        return;
    };
    if saddr == pkt.key.saddr && daddr == pkt.key.daddr {
        return;
    }
    let key = FragmentKey {
        saddr: pkt.key.saddr,
        daddr: pkt.key.daddr,
        id: pkt.ip_id,
        proto: pkt.key.proto,
        _pad0: 0,
    };
    let value = FragmentValue {
        saddr,
        daddr,
        hook,
        _pad0: [0; 3],
    };
    let _ = FRAGMENTS.insert(&key, &value, BPF_ANY as u64);
}

/// A fragment after the first: the addresses its first fragment got (only the IPv4
/// checksum covers them here; the transport checksum was fixed in the first fragment).
/// Fragments that arrive before their first one pass unchanged.
#[inline(always)]
fn translate_fragment(ctx: &TcContext, key: &FragmentKey, hook: Hook) -> Result<i32, Stat> {
    let Some(to) = (unsafe { FRAGMENTS.get(key) }) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let Some(verdict) = fragment_verdict(to.hook, hook) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let (saddr, daddr) = (to.saddr, to.daddr);
    for (off, old, new) in [
        (IP_SADDR_OFF, key.saddr, saddr),
        (IP_DADDR_OFF, key.daddr, daddr),
    ] {
        if old != new {
            ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4)
                .map_err(|_| Stat::RewriteFailed)?;
            ctx.store(off, &new, 0).map_err(|_| Stat::RewriteFailed)?;
        }
    }
    bump(Stat::FragmentTranslated);
    Ok(verdict)
}

#[inline(always)]
fn try_translate(ctx: &TcContext, hook: Hook, pkt: &Packet) -> Result<i32, Stat> {
    // A flow that had an entry and needs a new backend may do so with any segment: its
    // client is real (the backend it had left, or it timed out).
    let mut known = false;
    if let Some((ct, table)) = lookup::<V4>(&pkt.key) {
        let now = unsafe { bpf_ktime_get_ns() };
        // SAFETY: the pointer is to a map value and valid for this program run.
        let ct = unsafe { &mut *ct };
        let flags = ct.flags;
        // Each kind of entry acts at one hook only; elsewhere the packet passes as it is.
        if flags & CT_FLAG_SNAT != 0 {
            return match hook {
                Hook::Egress => masquerade(ctx, pkt, ct, now),
                Hook::Ingress => Ok(TC_ACT_UNSPEC),
            };
        }
        if flags & CT_FLAG_SNAT_REPLY != 0 {
            return match hook {
                Hook::Ingress => unmasquerade(ctx, pkt, ct, now),
                Hook::Egress => Ok(TC_ACT_UNSPEC),
            };
        }
        if flags & CT_FLAG_REPLY != 0 {
            if flags & CT_FLAG_EGRESS_ONLY != 0 && hook == Hook::Ingress {
                return Ok(TC_ACT_UNSPEC);
            }
            return translate_reply(ctx, pkt, ct, table, now);
        }
        if hook == Hook::Egress {
            return Ok(TC_ACT_UNSPEC);
        }
        if let Some(verdict) = translate_tracked(ctx, pkt, ct, table, now)? {
            if confirms(table, ct, pkt.key.proto, pkt.tcp_flags, || {
                tcp_word(ctx, pkt.l4_off, TCP_ACK_OFF)
            }) {
                confirm_flow(pkt, ct);
            }
            return Ok(verdict);
        }
        known = true;
    }
    // New flows are taken at ingress, where pods and the outside send them; egress only
    // finishes what ingress started (source NAT, replies to external clients).
    if hook == Hook::Egress {
        return Ok(TC_ACT_UNSPEC);
    }

    if pkt.frontend().slot(0).is_none() {
        forget_clashing_flow::<V4>(&pkt.key, pkt.tcp_flags);
        return Ok(TC_ACT_UNSPEC);
    }
    // SAFETY: `cb` is the tc program's scratch space, kept across the tail call.
    unsafe { (*ctx.skb.skb).cb[1] = known as u32 };
    // SAFETY: the slot holds a tc classifier of this object or nothing.
    unsafe { TAIL_CALLS.tail_call(ctx, tail_calls::NEW_FLOW) };
    Err(Stat::NewFlowFailed)
}

/// A new flow (or a tracked one that needs a new backend: `known`) to a frontend, in
/// [`proxy_new_flow`]. A client on this node (a pod, told as `detectLocalMode` says) of an
/// `externalTrafficPolicy: Local` frontend takes its second set, every endpoint
/// (kube-proxy's short-circuit); the node's own processes are the socket hooks'.
#[inline(always)]
fn open_flow(ctx: &TcContext, pkt: &Packet, known: bool) -> Result<i32, Stat> {
    let Some(header) = pkt.frontend().slot(0) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let header = scoped_header(pkt.frontend(), header, || pod_client(ctx, pkt.key.saddr));
    if header.count == 0 {
        if header.flags & SERVICE_FLAG_DROP_WHEN_EMPTY != 0 {
            bump(Stat::NoLocalEndpoint);
            told(&pkt.key, header.service_id, 0, FLOW_VERDICT_DROPPED);
            return Ok(TC_ACT_SHOT);
        }
        told(&pkt.key, header.service_id, 0, FLOW_VERDICT_REFUSED);
        debug!(
            ctx,
            "refused {:i}:{} -> {:i}:{}: no ready endpoint",
            u32::from_be(pkt.key.saddr),
            u16::from_be(pkt.key.sport),
            u32::from_be(pkt.key.daddr),
            u16::from_be(pkt.key.dport)
        );
        return refuse(ctx);
    }
    if !known && !conntrack::may_open(pkt.key.proto, pkt.tcp_flags) {
        bump(Stat::UntrackedSegment);
        return Ok(TC_ACT_UNSPEC);
    }
    let now = unsafe { bpf_ktime_get_ns() };
    new_flow(
        ctx,
        pkt,
        pkt.frontend().scoped(scope_of(&header)),
        &header,
        now,
    )
}

/// The header of the entry set a new flow to `frontend` uses: a frontend with a second set
/// for clients on this node (`externalTrafficPolicy: Local`, kube-proxy's short-circuit)
/// gives theirs to them when `on_node()` says the client is one; otherwise, or while that
/// set is missing (being written or removed), the frontend's own. A copy: the verifier
/// refuses a map value pointer the compiler spills as half of a pair. Which set it is,
/// [`scope_of`] reads from it.
#[inline(always)]
pub fn scoped_header<F: SlotTable>(
    frontend: F,
    header: &ServiceValue,
    on_node: impl FnOnce() -> bool,
) -> ServiceValue {
    if header.flags & SERVICE_FLAG_IN_CLUSTER_SET != 0 && on_node() {
        if let Some(inner) = frontend.scoped(SCOPE_IN_CLUSTER).slot(0) {
            return *inner;
        }
    }
    *header
}

/// The scope of the set `header` heads (see `SERVICE_FLAG_SCOPE_IN_CLUSTER`): arithmetic,
/// not a branch, so the verifier sees one unknown value rather than two known ones.
#[inline(always)]
pub fn scope_of(header: &ServiceValue) -> u8 {
    const _: () = assert!(SCOPE_ALL == 0 && SCOPE_IN_CLUSTER == 1);
    ((header.flags & SERVICE_FLAG_SCOPE_IN_CLUSTER)
        >> SERVICE_FLAG_SCOPE_IN_CLUSTER.trailing_zeros()) as u8
}

#[inline(always)]
fn parse(ctx: &TcContext) -> Option<Parsed> {
    let eth_proto: u16 = u16::from_be(read(ctx, 12)?);
    if eth_proto != ETH_P_IP {
        return None;
    }
    let ver_ihl: u8 = read(ctx, ETH_HLEN)?;
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    if ver_ihl >> 4 != 4 || ihl < IPV4_HLEN {
        return None;
    }
    let proto: u8 = read(ctx, ETH_HLEN + 9)?;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return None;
    }
    let saddr: u32 = read(ctx, IP_SADDR_OFF)?;
    let daddr: u32 = read(ctx, IP_DADDR_OFF)?;
    let ip_id: u16 = read(ctx, ETH_HLEN + 4)?;
    let frag: u16 = u16::from_be(read(ctx, ETH_HLEN + 6)?);
    if frag & IP_OFFSET_MASK != 0 {
        return Some(Parsed::LaterFragment(FragmentKey {
            saddr,
            daddr,
            id: ip_id,
            proto,
            _pad0: 0,
        }));
    }
    let l4_off = ETH_HLEN + ihl;
    let sport: u16 = read(ctx, l4_off)?;
    let dport: u16 = read(ctx, l4_off + 2)?;
    let tcp_flags: u8 = if proto == IPPROTO_TCP {
        read(ctx, l4_off + 13)?
    } else {
        0
    };
    Some(Parsed::Flow(Packet {
        l4_off,
        key: ConntrackKey::new(saddr, daddr, sport, dport, proto),
        tcp_flags,
        more_fragments: frag & IP_MORE_FRAGMENTS != 0,
        ip_id,
    }))
}

/// Reads a `T` at `off` after checking it lies inside the packet.
#[inline(always)]
fn read<T: Copy>(ctx: &TcContext, off: usize) -> Option<T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + size_of::<T>() > end {
        return None;
    }
    // SAFETY: bounds checked above; packet data has no alignment guarantee.
    Some(unsafe { ((start + off) as *const T).read_unaligned() })
}

#[inline(always)]
fn bump(stat: Stat) {
    if let Some(c) = STATS.get_ptr_mut(stat as u32) {
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe { *c += 1 };
    }
}

/// Tells a follower of new flows (`inspect flows --follow`) what the tc path decided for
/// `key`'s flow; one array lookup while no one follows.
#[inline(always)]
fn told(key: &ConntrackKey, service_id: u32, backend_id: u32, verdict: u8) {
    if flows::followed() {
        flows::tell4(
            key,
            service_id,
            backend_id,
            flows::how(verdict, FLOW_PATH_TC),
        );
    }
}

/// Counts a packet (and, for a new flow, a connection) against its service port, and its
/// backend when per-backend counters are on.
#[inline(always)]
fn account(ctx: &TcContext, service_id: u32, backend_id: u32, new_flow: bool) {
    add(&SERVICE_STATS, service_id, ctx, new_flow);
    if BACKEND_STATS_ENABLED.load() != 0 {
        add(
            &BACKEND_STATS,
            backend_id & BACKEND_INDEX_MASK,
            ctx,
            new_flow,
        );
    }
}

#[inline(always)]
fn add(map: &PerCpuArray<ServiceStats>, index: u32, ctx: &TcContext, new_flow: bool) {
    if let Some(s) = map.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, no concurrent writer.
        let s = unsafe { &mut *s };
        s.packets += 1;
        s.bytes += ctx.len() as u64;
        if new_flow {
            s.connections += 1;
        }
    }
}

#[inline(always)]
fn config() -> DatapathConfig {
    match CONFIG.get(0) {
        Some(c) if c.layout_version != 0 => *c,
        _ => DatapathConfig::DEFAULT,
    }
}

/// A flow's timeout (`DatapathConfig::timeout_ns`), read in place: a copy of the whole
/// configuration would cost the callers' stack.
#[inline(always)]
pub(crate) fn flow_timeout_ns(proto: u8, flags: u8) -> u64 {
    match CONFIG.get(0) {
        Some(c) if c.layout_version != 0 => c.timeout_ns(proto, flags),
        _ => DatapathConfig::DEFAULT.timeout_ns(proto, flags),
    }
}

/// A reply from a backend: restore the service address as the source.
#[inline(always)]
fn translate_reply(
    ctx: &TcContext,
    pkt: &Packet,
    ct: &mut ConntrackValue,
    table: Table,
    now: u64,
) -> Result<i32, Stat> {
    let first_reply = ct.flags & CT_FLAG_SEEN_REPLY == 0;
    let closing = pkt.tcp_flags & (TCP_FIN | TCP_RST) != 0 && ct.flags & CT_FLAG_CLOSING == 0;
    let hairpin = ct.flags & CT_FLAG_HAIRPIN != 0;
    // A hairpin reply goes back to the pod that is also the backend.
    let client = if hairpin {
        pkt.key.saddr
    } else {
        pkt.key.daddr
    };
    // The client's own port, where the flow's source port was translated (a tuple clash).
    let client_port = ct.client_port_or(pkt.key.dport);
    let (nat_addr, nat_port, service_id, backend_id) =
        (ct.nat_addr, ct.nat_port, ct.service_id, ct.backend_id);
    touch(ct, pkt.tcp_flags, now, CT_FLAG_SEEN_REPLY);
    if hairpin || client_port != pkt.key.dport {
        rewrite(
            ctx,
            pkt,
            Side::Destination,
            pkt.key.daddr,
            client,
            pkt.key.dport,
            client_port,
        )?;
    }
    let unconfirmed_syn_ack =
        table == Table::New && pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK;
    if first_reply || closing || unconfirmed_syn_ack {
        // The original-direction entry decides the flow's timeout: tell it what we saw.
        let original = ConntrackKey::new(client, nat_addr, client_port, nat_port, pkt.key.proto);
        if let Some(orig) = conntrack::get_in::<V4>(table, &original) {
            // SAFETY: map value pointer, valid for this run.
            let orig = unsafe { &mut *orig };
            touch(orig, pkt.tcp_flags, now, CT_FLAG_SEEN_REPLY);
            if unconfirmed_syn_ack {
                conntrack::note_reply(orig, pkt.tcp_flags, || {
                    tcp_word(ctx, pkt.l4_off, TCP_SEQ_OFF)
                });
            }
        }
    }
    rewrite(
        ctx,
        pkt,
        Side::Source,
        pkt.key.saddr,
        nat_addr,
        pkt.key.sport,
        nat_port,
    )?;
    bump(Stat::ReplyTranslated);
    account(ctx, service_id, backend_id, false);
    Ok(TC_ACT_UNSPEC)
}

/// A packet of a tracked flow. Returns `None` when the flow must be given a new backend:
/// it timed out, its TCP connection was closed and a new SYN reuses the tuple, or its backend
/// left the service (TCP then gets a reset from the new backend instead of hanging, and UDP
/// moves on instead of black-holing).
#[inline(always)]
fn translate_tracked(
    ctx: &TcContext,
    pkt: &Packet,
    ct: &mut ConntrackValue,
    table: Table,
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
        let reply = reply_key(pkt, ct);
        if ct.flags & CT_FLAG_COUNTED != 0 && backend_alive {
            count_connection(ct.backend_id, u64::MAX);
        }
        conntrack::forget_reply::<V4>(&reply, pkt.key.daddr, pkt.key.dport);
        forget::<V4>(table, &pkt.key);
        return Ok(None);
    }
    let (nat_addr, nat_port, service_id, backend_id) =
        (ct.nat_addr, ct.nat_port, ct.service_id, ct.backend_id);
    let hairpin = ct.flags & CT_FLAG_HAIRPIN != 0;
    if hairpin || ct.client_port != 0 {
        translate_source(ctx, pkt, hairpin, source_port(pkt, ct))?;
    }
    touch(ct, pkt.tcp_flags, now, 0);
    rewrite(
        ctx,
        pkt,
        Side::Destination,
        pkt.key.daddr,
        nat_addr,
        pkt.key.dport,
        nat_port,
    )?;
    bump(Stat::EstablishedFlow);
    account(ctx, service_id, backend_id, false);
    Ok(Some(TC_ACT_UNSPEC))
}

/// Moves a flow whose client spoke after a reply to the confirmed map (see `conntrack`).
// Inlined: the ingress program's frame is near the limit, and a subprogram's frame adds up.
#[inline(always)]
fn confirm_flow(pkt: &Packet, ct: &ConntrackValue) {
    let to_backend = ConntrackKey::new(
        pkt.key.saddr,
        ct.nat_addr,
        source_port(pkt, ct),
        ct.nat_port,
        pkt.key.proto,
    );
    confirm::<V4>(&pkt.key, ct, &reply_key(pkt, ct), &to_backend);
}

/// The source port a tracked flow leaves ingress with: its own, or the one given when its
/// tuple clashed.
#[inline(always)]
fn source_port(pkt: &Packet, ct: &ConntrackValue) -> u16 {
    ct.client_port_or(pkt.key.sport)
}

/// The reply-direction key of the flow `pkt` belongs to (tracked as `ct`).
#[inline(always)]
fn reply_key(pkt: &Packet, ct: &ConntrackValue) -> ConntrackKey {
    ConntrackKey::new(
        ct.nat_addr,
        client_as_seen(pkt.key.saddr, ct.flags),
        ct.nat_port,
        source_port(pkt, ct),
        pkt.key.proto,
    )
}

/// First packet of a flow to a service with `count` backends.
#[inline(always)]
fn new_flow(
    ctx: &TcContext,
    pkt: &Packet,
    frontend: Frontend4,
    header: &ServiceValue,
    now: u64,
) -> Result<i32, Stat> {
    let service_id = header.service_id;
    if header.flags & SERVICE_FLAG_SOURCE_RANGES != 0 && !source_allowed(pkt, service_id) {
        bump(Stat::SourceRangeDenied);
        told(&pkt.key, service_id, 0, FLOW_VERDICT_DENIED);
        return Ok(TC_ACT_SHOT);
    }
    // The header slot's backend_id is the ClientIP affinity timeout in seconds.
    let affinity_ns = header.backend_id as u64 * 1_000_000_000;
    let affinity_key = AffinityKey {
        client: pkt.key.saddr,
        service_id,
    };
    let (backend_id, backend) = match sticky_backend(&affinity_key, affinity_ns, now) {
        Some(found) => found,
        None => {
            let slot = schedule::<_, true>(frontend, pkt.key.saddr, pkt.key.daddr, header);
            match pick(frontend, slot) {
                Some(found) => found,
                // The agent shrinks a service by lowering the header's count before it
                // deletes slots; a packet that read the old count can land on a deleted
                // slot. Slot 1 always exists while count > 0.
                None => pick(frontend, 1).ok_or(Stat::RewriteFailed)?,
            }
        }
    };
    // A pod of this node given itself. (A remote client given itself, through a NodePort
    // say, is an ordinary flow: masqueraded to it, the reply comes back here.)
    let hairpin_flag = if backend.addr == pkt.key.saddr && backend.flags & BACKEND_FLAG_REMOTE == 0
    {
        CT_FLAG_HAIRPIN
    } else {
        0
    };
    let mut reply_key = ConntrackKey::new(
        backend.addr,
        client_as_seen(pkt.key.saddr, hairpin_flag),
        backend.port,
        pkt.key.sport,
        pkt.key.proto,
    );
    // Another live flow from this client port to this backend (through another frontend)
    // holds the tuple: this flow gets another source port, so that flow is not broken
    // (see `conntrack::reply_taken`); refused if none is free.
    let mut source_port = pkt.key.sport;
    if conntrack::reply_taken::<V4>(&reply_key, &pkt.key, now) {
        source_port = clash_port(&mut reply_key);
        if source_port == 0 {
            bump(Stat::TupleClashRefused);
            return refuse_because(ctx, REFUSED_TUPLE_CLASH);
        }
    }
    let translated = source_port != pkt.key.sport;
    if affinity_timeout_again(header) != 0 {
        let value = AffinityValue {
            last_seen_ns: now,
            backend_id,
            _pad0: 0,
        };
        let _ = AFFINITY.insert(&affinity_key, &value, BPF_ANY as u64);
    }
    let counted = if scheduler::counts_connections(scheduler_again(header)) {
        count_connection(backend_id, 1);
        CT_FLAG_COUNTED
    } else {
        0
    };
    let original = ConntrackValue {
        last_seen_ns: now,
        nat_addr: backend.addr,
        nat_port: backend.port,
        flags: hairpin_flag | counted,
        _pad0: 0,
        backend_id,
        service_id,
        expected_ack: conntrack::initial_expected_ack(pkt.key.proto, pkt.tcp_flags),
        client_port: if translated { source_port } else { 0 },
        _pad1: 0,
    };
    let reply = ConntrackValue {
        last_seen_ns: now,
        nat_addr: pkt.key.daddr,
        nat_port: pkt.key.dport,
        flags: reply_flags(hairpin_flag),
        _pad0: 0,
        backend_id,
        service_id,
        expected_ack: 0,
        client_port: if translated { pkt.key.sport } else { 0 },
        _pad1: 0,
    };
    if !track::<V4>(Table::New, &reply_key, &reply) || !track::<V4>(Table::New, &pkt.key, &original)
    {
        bump(Stat::ConntrackInsertFailed);
    }
    if hairpin_flag == 0 && masquerades(ctx, header, pkt, &backend) {
        plan_masquerade(pkt, source_port, &backend, backend_id, service_id, now);
    }
    rewrite(
        ctx,
        pkt,
        Side::Destination,
        pkt.key.daddr,
        backend.addr,
        pkt.key.dport,
        backend.port,
    )?;
    if hairpin_flag != 0 || translated {
        translate_source(ctx, pkt, hairpin_flag != 0, source_port)?;
    }
    bump(Stat::NewFlow);
    account(ctx, service_id, backend_id, true);
    told(&pkt.key, service_id, backend_id, FLOW_VERDICT_FORWARDED);
    // Compiled in, but dead code the verifier removes unless the agent runs with -v 4.
    debug!(
        ctx,
        "new flow proto {} {:i}:{} -> {:i}:{} to backend {:i}:{}",
        pkt.key.proto,
        u32::from_be(pkt.key.saddr),
        u16::from_be(pkt.key.sport),
        u32::from_be(pkt.key.daddr),
        u16::from_be(pkt.key.dport),
        u32::from_be(backend.addr),
        u16::from_be(backend.port)
    );
    Ok(TC_ACT_UNSPEC)
}

/// The slot (1..=count) a new flow goes to, by the frontend's scheduler.
/// `client` and `destination` are the addresses the hashing schedulers hash (an IPv6
/// address folded to 32 bits); `frontend` is where the slots are.
/// `SCANS`: whether the least-connection family scans (else a random slot: the socket
/// hooks of the `no-bpf-loop` build, whose verifiers cannot afford the bounded scan in
/// them; pods' sockets to such frontends are left to the tc path there).
#[inline(always)]
fn schedule<F: SlotTable, const SCANS: bool>(
    frontend: F,
    client: u32,
    destination: u32,
    header: &ServiceValue,
) -> u16 {
    // Never 0: empty services are refused first. The compiler cannot always see that check
    // (the socket hooks call helpers in between, after which the header is read again), and
    // a division by a possible zero is a panic path the verifier rejects.
    let count = (header.count as u32).max(1);
    let id = scheduler_of(header);
    if !SCANS && scheduler::counts_connections(id) {
        return random_below(count) as u16 + 1;
    }
    let slot = match id {
        id @ (scheduler::LC | scheduler::WLC | scheduler::SED | scheduler::NQ) => {
            return least_loaded(frontend, header, id)
        }
        scheduler::RR => next_turn(header.service_id) % count,
        scheduler::WRR => return weighted_turn(frontend, header),
        scheduler::SH => mix(client) % count,
        scheduler::DH => mix(destination) % count,
        scheduler::MH => return maglev(client, header),
        scheduler::LBLC => return locality(frontend, header),
        scheduler::LBLCR => {
            // The weighted-least-connection choice first: its scan is done (and its stack,
            // or scratch value, free again) before the set's scan needs its own.
            let candidate = least_loaded(frontend, header, scheduler::WLC);
            return replicated_locality(frontend, header, unsafe { bpf_ktime_get_ns() }, candidate);
        }
        _ => random_below(count),
    };
    slot as u16 + 1
}

/// A frontend as the schedulers see it: where its slots are. IPv4 and IPv6 frontends keep
/// theirs in different maps; everything else about scheduling is the same.
pub trait SlotTable: Copy {
    fn slot(self, slot: u16) -> Option<&'static ServiceValue>;
    /// The same frontend's entry set of `scope` (`SCOPE_*`).
    fn scoped(self, scope: u8) -> Self;
}

/// An IPv4 frontend (`SERVICES`). Small scalars: they stay in registers, and the packet
/// program's stack plus a scan step's must fit BPF's 512 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Frontend4 {
    addr: u32,
    port: u16,
    proto: u8,
    scope: u8,
}

impl Frontend4 {
    #[inline(always)]
    pub fn new(addr: u32, port: u16, proto: u8) -> Self {
        Frontend4 {
            addr,
            port,
            proto,
            scope: SCOPE_ALL,
        }
    }
}

impl SlotTable for Frontend4 {
    #[inline(always)]
    fn slot(self, slot: u16) -> Option<&'static ServiceValue> {
        let key = ServiceKey::scoped(self.addr, self.port, self.proto, self.scope, slot);
        unsafe { SERVICES.get(key) }
    }

    #[inline(always)]
    fn scoped(self, scope: u8) -> Self {
        Frontend4 { scope, ..self }
    }
}

impl Packet {
    #[inline(always)]
    fn frontend(&self) -> Frontend4 {
        Frontend4::new(self.key.daddr, self.key.dport, self.key.proto)
    }
}

#[inline(always)]
fn scheduler_of(header: &ServiceValue) -> u16 {
    (header.flags >> SERVICE_SCHEDULER_SHIFT) & SERVICE_SCHEDULER_MASK
}

/// [`scheduler_of`], reading the header again. After [`schedule`], the verifier would know the
/// scheduler on each of its branches from a value kept in a register, and walk every step
/// after once per scheduler; read again, the value is one it knows nothing of, and the
/// branches join (figures: docs/benchmarks.md, "The hooks' verifier cost").
#[inline(always)]
pub(crate) fn scheduler_again(header: &ServiceValue) -> u16 {
    // SAFETY: a field of a map value.
    let flags = unsafe { core::ptr::read_volatile(&header.flags) };
    (flags >> SERVICE_SCHEDULER_SHIFT) & SERVICE_SCHEDULER_MASK
}

/// The ClientIP affinity timeout (the header slot's backend_id, in seconds), read again for
/// the same reason as [`scheduler_again`].
#[inline(always)]
pub(crate) fn affinity_timeout_again(header: &ServiceValue) -> u32 {
    // SAFETY: a field of a map value.
    unsafe { core::ptr::read_volatile(&header.backend_id) }
}

/// Adds `delta` (two's complement: u64::MAX is -1) to a backend's active connections.
#[inline(always)]
fn count_connection(backend_id: u32, delta: u64) {
    if let Some(p) = BACKEND_CONNS.get_ptr_mut(backend_id & BACKEND_INDEX_MASK) {
        // SAFETY: a map value pointer, valid for this run; updated atomically.
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                p, delta,
            );
        }
    }
}

/// A backend's active connections (never below 0).
#[inline(always)]
fn active_connections(backend_id: u32) -> u64 {
    let slot = backend_id & BACKEND_INDEX_MASK;
    let opened = BACKEND_CONNS
        .get_ptr(slot)
        .map_or(0, |p| unsafe { core::ptr::read_volatile(p) });
    let released = BACKEND_RELEASED
        .get_ptr(slot)
        .map_or(0, |p| unsafe { core::ptr::read_volatile(p) });
    let active = opened.wrapping_sub(released) as i64;
    if active < 0 {
        0
    } else {
        active as u64
    }
}

/// Least-connection schedulers, as IPVS defines them, over up to [`LC_SCAN`] slots from a
/// random start (a service with more backends is judged on that many):
/// lc: fewest active; wlc: fewest active per weight; sed: fewest (active + 1) per weight;
/// nq: an idle backend if any, else as sed. Weights come from the slots' cumulative weights.
// Without bpf_loop the scan runs here, in a frame of its own: inlined, it would not fit the
// packet program's.
#[cfg_attr(not(feature = "no-bpf-loop"), inline(always))]
#[cfg_attr(feature = "no-bpf-loop", inline(never))]
fn least_loaded<F: SlotTable>(frontend: F, header: &ServiceValue, id: u16) -> u16 {
    let count = header.count as u32;
    // "No best yet" is a slot past the end, and the best's cost and weight start as values
    // the verifier cannot know: verifiers before 6.7 check a bpf_loop step once, with the
    // state of its first call, and would judge a branch that only later steps take (the
    // comparison with a best found earlier) dead and wire it away.
    let none = count + 1;
    let state = LcScan {
        frontend,
        start: random_below(count),
        count,
        id: id as u32,
        best: LcScratch {
            cost: none as u64,
            weight: none as u64,
            slot: none,
            _pad0: 0,
        },
        idle: 0,
    };
    #[cfg(not(feature = "no-bpf-loop"))]
    let mut state = state;
    #[cfg(not(feature = "no-bpf-loop"))]
    let scan = &mut state;
    #[cfg(feature = "no-bpf-loop")]
    let Some(scan) = scan_state(state) else {
        return random_below(count) as u16 + 1;
    };
    // bpf_loop: the step is verified once, whatever the number of backends scanned.
    let steps = if count < LC_SCAN { count } else { LC_SCAN };
    scan_steps(steps, scan);
    let chosen = if scan.idle != 0 {
        scan.idle
    } else {
        scan.best.slot
    };
    if chosen == 0 || chosen > count {
        random_below(count) as u16 + 1
    } else {
        chosen as u16
    }
}

/// The state of a least-connection scan, passed to each step.
#[repr(C)]
struct LcScan<F> {
    frontend: F,
    start: u32,
    count: u32,
    id: u32,
    best: LcScratch,
    /// nq: an idle backend's slot, which ends the scan.
    idle: u32,
}

/// One step of the least-connection scan: records slot `start + index` in the scan's best
/// if it is better; ends the scan at an idle backend under nq.
impl<F: SlotTable> ScanStep for LcScan<F> {
    #[inline(always)]
    fn step(&mut self, index: u64) -> i64 {
        let scan = self;
        if scan.count == 0 {
            return 1;
        }
        let slot = ((scan.start as u64 + index) % scan.count as u64 + 1) as u16;
        let Some((backend_id, weight)) = slot_backend(scan.frontend, slot) else {
            return 0;
        };
        if weight == 0 {
            return 0;
        }
        let active = active_connections(backend_id);
        let id = scan.id as u16;
        if id == scheduler::NQ && active == 0 {
            scan.idle = slot as u32;
            return 1;
        }
        let (cost, w) = match id {
            scheduler::LC => (active, 1),
            scheduler::WLC => (active, weight),
            _ => (active + 1, weight),
        };
        // cost / w < best cost / best weight, without division.
        if scan.best.slot > scan.count || cost * scan.best.weight < scan.best.cost * w {
            scan.best = LcScratch {
                cost,
                weight: w,
                slot: slot as u32,
                _pad0: 0,
            };
        }
        0
    }
}

/// A slot's backend id and weight, if the slot exists.
#[inline(always)]
fn slot_backend<F: SlotTable>(frontend: F, slot: u16) -> Option<(u32, u64)> {
    let v = frontend.slot(slot)?;
    let cumulative = (v.flags as u32) << 16 | v.count as u32;
    let weight = cumulative.saturating_sub(cumulative_weight_at(frontend, slot - 1));
    Some((v.backend_id, weight as u64))
}

/// lblc, IPVS's locality-based least connection: the destination keeps its server unless
/// that server is overloaded (more active connections than its weight) while another is
/// under half of its own; then the weighted-least-connection server becomes the
/// destination's. A frontend has a single destination address, so the assignment (slot and
/// backend id, in the frontend's `RR_STATE` entry) is per frontend.
#[inline(always)]
fn locality<F: SlotTable>(frontend: F, header: &ServiceValue) -> u16 {
    let count = header.count;
    let Some(state) = RR_STATE.get_ptr_mut(header.service_id) else {
        return random_below(count as u32) as u16 + 1;
    };
    // SAFETY: a map value pointer, valid for this run.
    let assigned = unsafe { core::ptr::read_volatile(state) };
    let (slot, id) = ((assigned >> 32) as u16, assigned as u32);
    let current = if slot >= 1 && slot <= count {
        slot_backend(frontend, slot).filter(|(found, _)| *found == id)
    } else {
        None
    };
    if let Some((id, weight)) = current {
        if active_connections(id) <= weight {
            return slot;
        }
    }
    let candidate = least_loaded(frontend, header, scheduler::WLC);
    if let Some((id, weight)) = current {
        if !overloaded(frontend, active_connections(id), weight, candidate) {
            return slot;
        }
    }
    if let Some((cid, _)) = slot_backend(frontend, candidate) {
        let value = (candidate as u64) << 32 | cid as u64;
        unsafe { core::ptr::write_volatile(state, value) };
    }
    candidate
}

/// IPVS's lblc overload test for a member: more active connections than its weight, while
/// the weighted-least-connection `candidate` is under half of its own.
#[inline(always)]
fn overloaded<F: SlotTable>(frontend: F, active: u64, weight: u64, candidate: u16) -> bool {
    active > weight
        && matches!(slot_backend(frontend, candidate), Some((cid, cweight)) if active_connections(cid) * 2 < cweight)
}

/// The scan of an lblcr set, passed to each step (a bpf_loop callback, so the scan is
/// verified once).
// Member indexes are masked with LBLCR_SET_SIZE - 1.
const _: () = assert!(LBLCR_SET_SIZE.is_power_of_two());

#[repr(C)]
struct SetScan<F> {
    frontend: F,
    count: u32,
    set: LblcrSet,
    min_active: u64,
    min_weight: u64,
    max_active: u64,
    max_weight: u64,
    /// The member being looked at (see `member_load`): kept here, in the caller's frame,
    /// so the step's own stack stays within 32 bytes.
    cur_active: u64,
    cur_weight: u64,
    min_slot: u16,
    cur_slot: u16,
    /// Least and most loaded live member: index + 1 (0: none); live members seen.
    min: u8,
    max: u8,
    live: u8,
    _pad0: u8,
}

/// One member of an lblcr set: dropped if its slot no longer holds its backend, else
/// compared (active per weight) with the least and most loaded so far.
impl<F: SlotTable> ScanStep for SetScan<F> {
    #[inline(always)]
    fn step(&mut self, index: u64) -> i64 {
        let scan = self;
        let i = index as usize;
        if i >= LBLCR_SET_SIZE {
            return 1;
        }
        // The member's weight and load go through the scan (the caller's memory), not this
        // callback's stack: on kernels before 6.6 the verifier rounds each frame up to 32
        // bytes and the packet program and this step must share 512.
        if !member_load(scan, i) {
            scan.set.members[i] = 0;
            return 0;
        }
        if scan.cur_weight == 0 {
            return 0;
        }
        scan.live += 1;
        let (active, weight) = (scan.cur_active, scan.cur_weight);
        if scan.min == 0 || active * scan.min_weight < scan.min_active * weight {
            (scan.min, scan.min_slot, scan.min_active, scan.min_weight) =
                (i as u8 + 1, scan.cur_slot, active, weight);
        }
        if scan.max == 0 || active * scan.max_weight > scan.max_active * weight {
            (scan.max, scan.max_active, scan.max_weight) = (i as u8 + 1, active, weight);
        }
        0
    }
}

/// Reads member `i` into the scan's `cur_*` fields; false if the member is gone (its slot
/// no longer holds its backend).
#[inline(always)]
fn member_load<F: SlotTable>(scan: &mut SetScan<F>, i: usize) -> bool {
    let value = scan.set.members[i];
    let (slot, id) = ((value >> 32) as u16, value as u32);
    if value == 0 || slot == 0 || slot as u32 > scan.count {
        return false;
    }
    scan.cur_slot = slot;
    match scan.frontend.slot(slot) {
        Some(v) if v.backend_id == id => {
            scan.cur_weight = ((v.flags as u32) << 16 | v.count as u32) as u64;
        }
        _ => return false,
    }
    scan.cur_active = active_connections(id);
    let previous = cumulative_weight_at(scan.frontend, scan.cur_slot - 1) as u64;
    scan.cur_weight = scan.cur_weight.saturating_sub(previous);
    true
}

/// lblcr, IPVS's locality-based least connection with replication: the destination (the
/// frontend) has a set of servers and takes its least-loaded member (active per weight);
/// when that member is overloaded (see [`overloaded`]) the weighted-least-connection server
/// joins the set and takes the flow. After 24 h without change (IPVS's default expiration)
/// a set of several drops its most loaded member. Sets hold [`LBLCR_SET_SIZE`] members; a
/// full set gives up its most loaded one.
#[inline(always)]
fn replicated_locality<F: SlotTable>(
    frontend: F,
    header: &ServiceValue,
    now: u64,
    candidate: u16,
) -> u16 {
    let count = header.count;
    let Some(set) = LBLCR_SETS.get_ptr_mut(header.service_id) else {
        return random_below(count as u32) as u16 + 1;
    };
    // SAFETY: a map value pointer, valid for this run.
    let members = unsafe { core::ptr::read_volatile(set) };
    // 0, as a value the verifier cannot know (a change time is nanoseconds since boot,
    // below 2^63). Verifiers before 6.7 check a bpf_loop step once, with the state of its
    // first call, and wire away the branches they then judge dead: with "none yet" and "no
    // live member" as constants, every step overwrote the least and most loaded member,
    // and the caller never saw two live members.
    let none = (members.changed_ns >> 63) as u8;
    let state = SetScan {
        frontend,
        count: count as u32,
        set: members,
        min_active: 0,
        min_weight: 1,
        max_active: 0,
        max_weight: 1,
        cur_active: 0,
        cur_weight: 0,
        min_slot: 0,
        cur_slot: 0,
        min: none,
        max: none,
        live: none,
        _pad0: 0,
    };
    #[cfg(not(feature = "no-bpf-loop"))]
    let mut state = state;
    #[cfg(not(feature = "no-bpf-loop"))]
    let scan = &mut state;
    #[cfg(feature = "no-bpf-loop")]
    let Some(scan) = scan_state(state) else {
        return candidate;
    };
    scan_steps(LBLCR_SET_SIZE as u32, scan);
    if scan.live > 1 && scan.max != 0 && now.wrapping_sub(scan.set.changed_ns) > LBLCR_EXPIRATION_NS
    {
        // Masked, not just compared: the verifier must see the bound on the register
        // that indexes (LBLCR_SET_SIZE is a power of two; max is 1..=LBLCR_SET_SIZE here).
        let i = (scan.max as usize).wrapping_sub(1) & (LBLCR_SET_SIZE - 1);
        {
            scan.set.members[i] = 0;
            scan.set.changed_ns = now;
            if scan.min == scan.max {
                scan.min = 0;
            }
        }
    }
    let keep = scan.min != 0 && !overloaded(frontend, scan.min_active, scan.min_weight, candidate);
    let chosen = if keep {
        scan.min_slot
    } else {
        // The candidate joins the set: in an empty place, else instead of the most loaded.
        if let Some((cid, _)) = slot_backend(frontend, candidate) {
            let mut place = if scan.max != 0 {
                (scan.max as usize - 1) & (LBLCR_SET_SIZE - 1)
            } else {
                0
            };
            let mut i = LBLCR_SET_SIZE;
            while i > 0 {
                i -= 1;
                if scan.set.members[i] == 0 {
                    place = i;
                }
            }
            if place < LBLCR_SET_SIZE {
                scan.set.members[place] = (candidate as u64) << 32 | cid as u64;
            }
            scan.set.changed_ns = now;
        }
        candidate
    };
    unsafe { core::ptr::write_volatile(set, scan.set) };
    chosen
}

/// The frontend's next turn, counted in a map value all CPUs share. The increment is atomic;
/// the turn is read back after it (LLVM's BPF backend does not hand back the fetched value
/// here), so two CPUs opening flows at the same instant may share a turn.
#[inline(always)]
fn next_turn(service_id: u32) -> u32 {
    match RR_STATE.get_ptr_mut(service_id) {
        Some(p) => {
            // SAFETY: a map value pointer, valid for this run; updated atomically.
            unsafe {
                core::intrinsics::atomic_xadd::<
                    u64,
                    u64,
                    { core::intrinsics::AtomicOrdering::Relaxed },
                >(p, 1);
                core::ptr::read_volatile(p).wrapping_sub(1) as u32
            }
        }
        None => 0,
    }
}

/// A slot's cumulative weight (weights of slots 1..=slot), written by the agent.
#[inline(always)]
fn cumulative_weight_at<F: SlotTable>(frontend: F, slot: u16) -> u32 {
    // Slot 0 is the header, whose fields mean something else.
    if slot == 0 {
        return 0;
    }
    match frontend.slot(slot) {
        Some(v) => (v.flags as u32) << 16 | v.count as u32,
        None => 0,
    }
}

/// Weighted round robin: turn t of a cycle of W = total weight goes to the slot whose
/// cumulative range holds t mod W, so over each cycle every backend gets exactly its weight.
#[inline(always)]
fn weighted_turn<F: SlotTable>(frontend: F, header: &ServiceValue) -> u16 {
    let count = header.count;
    let total = cumulative_weight_at(frontend, count);
    if total == 0 {
        return 1;
    }
    let t = next_turn(header.service_id) % total;
    // The search's bounds live in a per-CPU value, which the verifier knows nothing of: in
    // registers or on the stack, Debian 6.1's verifier kept the bounds of each of the 2^17
    // ways through the search apart (with an IPv6 frontend it passed a million
    // instructions); read back from the map, every way looks the same to it.
    let Some(bounds) = WRR_SEARCH.get_ptr_mut(0) else {
        return 1;
    };
    // A program interrupted on its CPU (a socket hook, by a packet's softirq) may find the
    // other's bounds here when it resumes: its turn then lands on another slot of 1..=count
    // (checked below), never outside.
    // SAFETY: a map value pointer, valid for this run.
    let bounds = unsafe { &mut *bounds };
    bounds.lo = 1;
    bounds.hi = count as u32;
    // Binary search for the first slot with cumulative weight > t (count < 2^16: 16 steps).
    for _ in 0..17 {
        // SAFETY: fields of the map value above.
        let (lo, hi) = unsafe {
            (
                core::ptr::read_volatile(&bounds.lo),
                core::ptr::read_volatile(&bounds.hi),
            )
        };
        if lo >= hi {
            break;
        }
        let mid = lo + (hi - lo) / 2;
        // SAFETY: as above.
        unsafe {
            if cumulative_weight_at(frontend, mid as u16) > t {
                core::ptr::write_volatile(&mut bounds.hi, mid);
            } else {
                core::ptr::write_volatile(&mut bounds.lo, mid + 1);
            }
        }
    }
    // SAFETY: as above.
    let lo = unsafe { core::ptr::read_volatile(&bounds.lo) };
    if lo == 0 || lo > count as u32 {
        1
    } else {
        lo as u16
    }
}

/// [`weighted_turn`]'s search bounds (see there why in a map).
#[repr(C)]
struct SearchBounds {
    lo: u32,
    hi: u32,
}

#[map]
static WRR_SEARCH: PerCpuArray<SearchBounds> = PerCpuArray::with_max_entries(1, 0);

/// Maglev: the client's entry in the frontend's lookup table, which the agent fills so each
/// backend owns an equal share and a change of backends moves few entries.
#[inline(always)]
fn maglev(client: u32, header: &ServiceValue) -> u16 {
    let size = config().maglev_table_size;
    if size == 0 {
        return random_below(header.count as u32) as u16 + 1;
    }
    let key = MaglevKey {
        service_id: header.service_id,
        index: mix(client) % size,
    };
    match unsafe { MAGLEV.get(key) } {
        Some(slot) if *slot >= 1 && *slot <= header.count as u32 => *slot as u16,
        _ => random_below(header.count as u32) as u16 + 1,
    }
}

/// A 32-bit mix (murmur3's finaliser) of an address, for the hashing schedulers. The agent
/// computes the same function (`proxy_common::mix32`) to build Maglev tables.
#[inline(always)]
fn mix(x: u32) -> u32 {
    proxy_common::mix32(x)
}

/// `loadBalancerSourceRanges`: is the client inside one of the frontend's ranges?
#[inline(always)]
fn source_allowed(pkt: &Packet, service_id: u32) -> bool {
    let key = LpmKey::new(
        64,
        SourceRangeKey {
            service_id,
            addr: pkt.key.saddr,
        },
    );
    SOURCE_RANGES.get(&key).is_some()
}

/// The backend a client with ClientIP affinity used last, while within the timeout and
/// still serving this frontend (ids are per frontend, so a live id is still in it).
#[inline(always)]
fn sticky_backend(key: &AffinityKey, timeout_ns: u64, now: u64) -> Option<(u32, Backend)> {
    if timeout_ns == 0 {
        return None;
    }
    remembered(
        unsafe { AFFINITY.get(key) },
        key.service_id,
        timeout_ns,
        now,
    )
}

/// The backend an affinity entry names, if it is within `timeout_ns` of `now` and still
/// frontend `service_id`'s (ids are never reused while entries may name them, and this
/// holds even if they were).
#[inline(always)]
pub(crate) fn remembered(
    last: Option<&AffinityValue>,
    service_id: u32,
    timeout_ns: u64,
    now: u64,
) -> Option<(u32, Backend)> {
    let last = last?;
    if now.wrapping_sub(last.last_seen_ns) > timeout_ns {
        return None;
    }
    let id = last.backend_id;
    let b = backend(id)?;
    (b.service_id == service_id).then_some((id, b))
}

/// Under an interface-based `detectLocalMode`, whether the packet came in on one of the
/// node's pod interfaces (a locally sent packet has no input interface: not a pod); `None`
/// when pods are told by range.
#[inline(always)]
pub fn from_pod_interface(ctx: &TcContext) -> Option<bool> {
    let c = CONFIG.get(0)?;
    if c.pods_by_interface == 0 {
        return None;
    }
    // SAFETY: the context's socket buffer is valid for the whole program run.
    let ifindex = unsafe { (*ctx.skb.skb).ingress_ifindex };
    // SAFETY: a read of a map value the program does not keep.
    Some(unsafe { LOCAL_IFACES.get(&ifindex) }.is_some())
}

/// Whether a packet's source is one of this node's pods, as `detectLocalMode` tells them:
/// by input interface, else by the cluster CIDR; never when neither is known (kube-proxy's
/// no-op detector).
#[inline(always)]
fn pod_client(ctx: &TcContext, saddr: u32) -> bool {
    if let Some(pod) = from_pod_interface(ctx) {
        return pod;
    }
    let c = config();
    c.cluster_cidr_mask != 0 && saddr & c.cluster_cidr_mask == c.cluster_cidr_addr
}

/// Whether a new flow is source-NATed to the node: always under `masqueradeAll`; to a
/// cluster IP from anything but the node's pods (outside `clusterCIDR`, or not from a pod
/// interface); external traffic (`externalTrafficPolicy: Cluster`) when its backend is on
/// another node.
#[inline(always)]
fn masquerades(ctx: &TcContext, header: &ServiceValue, pkt: &Packet, backend: &Backend) -> bool {
    if header.flags & SERVICE_FLAG_MASQUERADE_ALL != 0 {
        return true;
    }
    if header.flags & SERVICE_FLAG_EXTERNAL == 0 {
        if let Some(pod) = from_pod_interface(ctx) {
            return !pod;
        }
        let c = config();
        return c.cluster_cidr_mask != 0
            && pkt.key.saddr & c.cluster_cidr_mask != c.cluster_cidr_addr;
    }
    header.flags & SERVICE_FLAG_MASQUERADE != 0 && backend.flags & BACKEND_FLAG_REMOTE != 0
}

/// Records the source NAT of a flow sent to a backend on another node, so the backend
/// replies to this node: at egress the source becomes the node's address and a port free for
/// that backend (the client's own port when possible), and the reply is mapped back at
/// ingress. Both steps happen where routing allows them: a node address as the source of a
/// packet still to be routed would be dropped as a martian. `sport`: the flow's source port
/// after ingress (another than the client's after a tuple clash).
#[inline(always)]
fn plan_masquerade(
    pkt: &Packet,
    sport: u16,
    backend: &Backend,
    backend_id: u32,
    service_id: u32,
    now: u64,
) {
    let masq = config().masquerade_addr;
    if masq == 0 {
        return;
    }
    let Some(port) = free_snat_port(pkt.key.proto, sport, backend, masq) else {
        bump(Stat::SnatPortsExhausted);
        return;
    };
    // Created as established so they live as long as the flow's own entries.
    let snat_key = ConntrackKey::new(
        pkt.key.saddr,
        backend.addr,
        sport,
        backend.port,
        pkt.key.proto,
    );
    let snat = ConntrackValue {
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
    };
    let unsnat_key = ConntrackKey::new(backend.addr, masq, backend.port, port, pkt.key.proto);
    let unsnat = ConntrackValue {
        last_seen_ns: now,
        nat_addr: pkt.key.saddr,
        nat_port: sport,
        flags: CT_FLAG_SNAT_REPLY | CT_FLAG_SEEN_REPLY,
        _pad0: 0,
        backend_id,
        service_id,
        expected_ack: 0,
        client_port: 0,
        _pad1: 0,
    };
    if !track::<V4>(Table::New, &unsnat_key, &unsnat) || !track::<V4>(Table::New, &snat_key, &snat)
    {
        bump(Stat::ConntrackInsertFailed);
    }
}

/// Tries the flow's source port, then a few random ones, for a (node address, port) whose
/// reply tuple from `backend` is not in use.
#[inline(always)]
fn free_snat_port(proto: u8, sport: u16, backend: &Backend, masq: u32) -> Option<u16> {
    let mut port = sport;
    let mut tries = 0;
    while tries < SNAT_PORT_TRIES {
        let reply = ConntrackKey::new(backend.addr, masq, backend.port, port, proto);
        if !conntrack::in_use::<V4>(&reply) {
            return Some(port);
        }
        port = ((unsafe { bpf_get_prandom_u32() } % SNAT_PORT_SPAN) as u16 + SNAT_PORT_MIN).to_be();
        tries += 1;
    }
    None
}

/// Egress, a masqueraded flow leaving for its backend's node: the node becomes the source.
#[inline(always)]
fn masquerade(
    ctx: &TcContext,
    pkt: &Packet,
    ct: &mut ConntrackValue,
    now: u64,
) -> Result<i32, Stat> {
    let (addr, port) = (ct.nat_addr, ct.nat_port);
    touch(ct, pkt.tcp_flags, now, 0);
    rewrite(
        ctx,
        pkt,
        Side::Source,
        pkt.key.saddr,
        addr,
        pkt.key.sport,
        port,
    )?;
    Ok(TC_ACT_UNSPEC)
}

/// Ingress, the backend's reply to a masqueraded flow: back to the client as destination;
/// the source becomes the frontend at egress, by the flow's own reply entry.
#[inline(always)]
fn unmasquerade(
    ctx: &TcContext,
    pkt: &Packet,
    ct: &mut ConntrackValue,
    now: u64,
) -> Result<i32, Stat> {
    let (addr, port) = (ct.nat_addr, ct.nat_port);
    touch(ct, pkt.tcp_flags, now, 0);
    rewrite(
        ctx,
        pkt,
        Side::Destination,
        pkt.key.daddr,
        addr,
        pkt.key.dport,
        port,
    )?;
    Ok(TC_ACT_UNSPEC)
}

/// [`HAIRPIN_SOURCE`] as it sits in a packet (network byte order).
const HAIRPIN: u32 = u32::from_ne_bytes(HAIRPIN_SOURCE);

/// The source a flow leaves ingress with: [`HAIRPIN_SOURCE`] for a flow from its own
/// backend, and `port` (the client's, or the one given when its tuple clashed).
#[inline(always)]
fn translate_source(ctx: &TcContext, pkt: &Packet, hairpin: bool, port: u16) -> Result<(), Stat> {
    let addr = if hairpin { HAIRPIN } else { pkt.key.saddr };
    rewrite(
        ctx,
        pkt,
        Side::Source,
        pkt.key.saddr,
        addr,
        pkt.key.sport,
        port,
    )
}

/// [`conntrack::clash_free_port`] for IPv4: a subprogram of its own, so its loop's frame
/// is not added to the packet program's, which is near the 512 bytes.
#[inline(never)]
fn clash_port(reply: &mut ConntrackKey) -> u16 {
    conntrack::clash_free_port::<V4>(reply)
}

/// The client address a backend sees (and replies to): the hairpin address for a flow from
/// the backend itself.
#[inline(always)]
fn client_as_seen(saddr: u32, flags: u8) -> u32 {
    if flags & CT_FLAG_HAIRPIN != 0 {
        HAIRPIN
    } else {
        saddr
    }
}

#[inline(always)]
fn pick(frontend: Frontend4, slot: u16) -> Option<(u32, Backend)> {
    let id = frontend.slot(slot)?.backend_id;
    Some((id, backend(id)?))
}

/// The backend holding `id`, if it still does: its slot is freed (id 0) or reused under a
/// new generation when it leaves its service.
#[inline(always)]
fn backend(id: u32) -> Option<Backend> {
    let b = BACKENDS.get(id & BACKEND_INDEX_MASK)?;
    (id != 0 && b.id == id).then_some(*b)
}

/// A uniformly random integer in `0..n` (n > 0), by Lemire's multiply-and-reject method: the
/// plain `rand % n` favours low values whenever n does not divide 2^32.
#[inline(always)]
fn random_below(n: u32) -> u32 {
    let n64 = n as u64;
    let mut m = unsafe { bpf_get_prandom_u32() } as u64 * n64;
    if (m as u32) < n {
        let threshold = n.wrapping_neg() % n;
        // Each retry is needed with probability < n / 2^32; the bound keeps the verifier
        // happy and leaves a bias below 2^-100 for any service size.
        let mut tries = 0;
        while (m as u32) < threshold && tries < 4 {
            m = unsafe { bpf_get_prandom_u32() } as u64 * n64;
            tries += 1;
        }
    }
    (m >> 32) as u32
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Source,
    Destination,
}

/// Rewrites one end of the packet (address and port) and fixes the IPv4 and L4 checksums
/// with the kernel helpers, which also do the right thing for a checksum still to be
/// completed by offload (CHECKSUM_PARTIAL) and for a packet-wide CHECKSUM_COMPLETE.
/// Hands a packet for a service without endpoints to the refusal program (see `refuse`);
/// returns only if that fails.
#[inline(always)]
fn refuse(ctx: &TcContext) -> Result<i32, Stat> {
    refuse_because(ctx, REFUSED_NO_ENDPOINTS)
}

/// Why a flow is refused, for the refusal program's count (in the packet's `cb[0]`).
pub const REFUSED_NO_ENDPOINTS: u32 = 0;
/// Counted as `Stat::TupleClashRefused` where it was found, not as `Stat::Refused`.
pub const REFUSED_TUPLE_CLASH: u32 = 1;

/// [`refuse`], saying why.
#[inline(always)]
pub(crate) fn refuse_because(ctx: &TcContext, why: u32) -> Result<i32, Stat> {
    // SAFETY: `cb` is the tc program's scratch space, kept across the tail call.
    unsafe { (*ctx.skb.skb).cb[0] = why };
    // SAFETY: the slot holds a tc classifier of this object or nothing.
    unsafe { TAIL_CALLS.tail_call(ctx, tail_calls::REFUSE) };
    Err(Stat::RefuseFailed)
}

#[inline(always)]
fn rewrite(
    ctx: &TcContext,
    pkt: &Packet,
    side: Side,
    old_addr: u32,
    new_addr: u32,
    old_port: u16,
    new_port: u16,
) -> Result<(), Stat> {
    let (addr_off, port_off) = match side {
        Side::Source => (IP_SADDR_OFF, pkt.l4_off),
        Side::Destination => (IP_DADDR_OFF, pkt.l4_off + 2),
    };
    let (csum_off, mangled) = if pkt.key.proto == IPPROTO_TCP {
        (pkt.l4_off + TCP_CSUM_OFF, 0)
    } else {
        // A UDP checksum of 0 means "none": leave it so, and never produce 0 for a real one.
        (pkt.l4_off + UDP_CSUM_OFF, BPF_F_MARK_MANGLED_0 as u64)
    };
    if old_addr != new_addr {
        ctx.l4_csum_replace(
            csum_off,
            old_addr as u64,
            new_addr as u64,
            BPF_F_PSEUDO_HDR as u64 | mangled | 4,
        )
        .map_err(|_| Stat::RewriteFailed)?;
        ctx.l3_csum_replace(IP_CSUM_OFF, old_addr as u64, new_addr as u64, 4)
            .map_err(|_| Stat::RewriteFailed)?;
        ctx.store(addr_off, &new_addr, 0)
            .map_err(|_| Stat::RewriteFailed)?;
    }
    if old_port != new_port {
        ctx.l4_csum_replace(csum_off, old_port as u64, new_port as u64, mangled | 2)
            .map_err(|_| Stat::RewriteFailed)?;
        ctx.store(port_off, &new_port, 0)
            .map_err(|_| Stat::RewriteFailed)?;
    }
    Ok(())
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
