//! Socket-level load balancing: cgroup hooks that give a socket a backend when it names a
//! frontend (connect, or sendmsg on an unconnected UDP socket) and show the frontend back
//! (recvmsg, getpeername). Every process below the cgroup the agent attached them to is
//! served: the node's own, and, with the DaemonSet's root-cgroup placement, every pod's.
//!
//! A socket gets the semantics a packet gets from the tc path, decided by [`choose`]:
//!
//! | case                                                   | what the hook does          |
//! |--------------------------------------------------------|-----------------------------|
//! | not a frontend                                         | nothing                     |
//! | a pod, under `--socket-lb host-only`                   | leaves it to tc (untouched) |
//! | a pod's connected UDP socket                           | leaves it to tc (1)         |
//! | no endpoints, kernel with `bpf_set_retval` (5.18)      | ECONNREFUSED                |
//! | no endpoints, older kernel: a pod / the node           | leaves it to tc (RST) / EPERM |
//! | source ranges: a pod                                   | leaves it to tc (2)         |
//! | `masqueradeAll`: a pod                                 | leaves it to tc (4)         |
//! | source ranges: the node                                | judged by the node's address |
//! | least-connection scheduler, no release hook: a pod     | leaves it to tc (3)         |
//! | least-connection scheduler, no bpf_loop: a pod / the node | leaves it to tc / random (5) |
//! | otherwise                                              | affinity, scheduler, counts |
//!
//! (1) tc moves the flow to a live backend when its backend leaves the Service, packet by
//! packet; a socket connected to a backend would keep it. (2) The source address is chosen
//! by routing after connect; the tc path sees it in the packet. (3) A count that no close
//! takes back would skew the scheduler for good. (4) The operator asked for every service
//! flow to reach its backend from the node's address; a socket connected straight to the
//! backend would not. (5) The `no-bpf-loop` build (kernels before 5.17): the scan's bounded
//! loop in these hooks is more than those verifiers can walk in reasonable time; the tc path
//! scans.
//!
//! A pod connecting to its own Service and given itself reaches itself directly, with its
//! own address as the source, as with Cilium's socket LB (the tc path would source-NAT it
//! to the hairpin address).
//!
//! ClientIP affinity and the hashing schedulers key a socket's client by its network
//! namespace (`bpf_get_netns_cookie`): one pod, or the node, is one client, as its address
//! is on the tc path. Per-service and per-backend counters count the connections (a
//! datagram through sendmsg counts as one); the packets and bytes of a translated socket
//! go to the backend directly and are not counted per service.

use aya_ebpf::{
    bindings::BPF_ANY,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns},
    maps::lpm_trie::Key as LpmKey,
    programs::{SockAddrContext, SockContext},
    EbpfContext,
};
use proxy_common::{
    scheduler, AffinityValue, Backend, ConntrackKey, ServiceStats, ServiceValue, SockAffinityKey,
    SockLbValue, SockRevNatKey, SockRevNatValue, SourceRangeKey, Stat, BACKEND_INDEX_MASK,
    FLOW_PATH_SOCKET_NODE, FLOW_PATH_SOCKET_POD, FLOW_VERDICT_FORWARDED, FLOW_VERDICT_REFUSED,
    IPPROTO_TCP, IPPROTO_UDP, SERVICE_FLAG_MASQUERADE_ALL, SERVICE_FLAG_SOURCE_RANGES,
};

use crate::{
    affinity_timeout_again, backend, bump, config, count_connection, flows, remembered, schedule,
    scheduler_again, scheduler_of, scope_of, scoped_header, Frontend4, SlotTable, BACKEND_STATS,
    BACKEND_STATS_ENABLED, HOST_NETNS_COOKIE, SERVICE_STATS, SOCKET_SCANS, SOCK_AFFINITY,
    SOCK_HOST_ONLY, SOCK_LB, SOCK_RELEASE_ATTACHED, SOCK_REVNAT, SOCK_SET_RETVAL, SOURCE_RANGES,
};

/// cgroup sock_addr verdicts.
pub const SOCK_ALLOW: i32 = 1;
const SOCK_REJECT: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// Which socket call named the address.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Connect,
    /// sendto/sendmsg with an address on an unconnected UDP socket.
    Sendmsg,
}

/// What [`choose`] decided.
pub enum Choice {
    /// Not the hook's: the call goes on untouched (to the tc path if a frontend).
    Leave,
    /// The call fails as a connection to a closed port does.
    Refuse,
    /// This backend (id, entry).
    Backend(u32, Backend),
}

/// The hooks' decision for a socket naming a frontend with header `header` (see the table
/// in the module doc). `node_allowed` says whether the node's own address is inside the
/// frontend's source ranges; `destination` is the frontend address as the destination
/// hashing scheduler hashes it.
#[inline(always)]
pub fn choose<F: SlotTable>(
    ctx: &SockAddrContext,
    frontend: F,
    header: &ServiceValue,
    proto: u8,
    call: Call,
    destination: u32,
    node_allowed: impl FnOnce(u32) -> bool,
) -> Choice {
    // SAFETY: a helper taking the program's context.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let from_node = netns == host_netns();
    if !from_node && (SOCK_HOST_ONLY.load() != 0 || (proto == IPPROTO_UDP && call == Call::Connect))
    {
        return leave();
    }
    if header.count == 0 {
        return if from_node || SOCK_SET_RETVAL.load() != 0 {
            Choice::Refuse
        } else {
            leave()
        };
    }
    let service_id = header.service_id;
    if !from_node && header.flags & SERVICE_FLAG_MASQUERADE_ALL != 0 {
        return leave();
    }
    if header.flags & SERVICE_FLAG_SOURCE_RANGES != 0 {
        if !from_node {
            return leave();
        }
        if !node_allowed(service_id) {
            bump(Stat::SourceRangeDenied);
            return Choice::Refuse;
        }
    }
    if !from_node
        && scheduler::counts_connections(scheduler_of(header))
        && (SOCK_RELEASE_ATTACHED.load() == 0 || !SOCKET_SCANS)
    {
        return leave();
    }
    // What the steps below need from the header is read again rather than kept: the
    // verifier would walk them once per value it knows from the branches above (see
    // `scheduler_again`).
    let Some((backend_id, backend)) = pick(frontend, header, netns, destination) else {
        return leave();
    };
    if call == Call::Connect
        && scheduler::counts_connections(scheduler_again(header))
        && SOCK_RELEASE_ATTACHED.load() != 0
    {
        count_socket(ctx, backend_id);
    }
    count_new_connection(service_id, backend_id);
    bump(Stat::SocketTranslated);
    Choice::Backend(backend_id, backend)
}

/// The backend for a socket of namespace `netns`: the one its affinity remembers, else the
/// scheduler's; the affinity is refreshed.
#[inline(always)]
fn pick<F: SlotTable>(
    frontend: F,
    header: &ServiceValue,
    netns: u64,
    destination: u32,
) -> Option<(u32, Backend)> {
    let now = unsafe { bpf_ktime_get_ns() };
    // The header slot's backend_id is the ClientIP affinity timeout in seconds.
    let affinity_ns = header.backend_id as u64 * 1_000_000_000;
    let key = SockAffinityKey {
        netns,
        service_id: header.service_id,
        _pad0: 0,
    };
    let chosen = match sticky(&key, affinity_ns, now) {
        Some(found) => found,
        None => {
            let client = (netns as u32) ^ ((netns >> 32) as u32);
            let slot = schedule::<_, SOCKET_SCANS>(frontend, client, destination, header);
            // As on the tc path: slot 1 exists while count > 0, a shrinking service's
            // last slots may not.
            slot_backend(frontend, slot).or_else(|| slot_backend(frontend, 1))?
        }
    };
    if affinity_timeout_again(header) != 0 {
        let value = AffinityValue {
            last_seen_ns: now,
            backend_id: chosen.0,
            _pad0: 0,
        };
        let _ = SOCK_AFFINITY.insert(&key, &value, BPF_ANY as u64);
    }
    Some(chosen)
}

#[inline(always)]
fn leave() -> Choice {
    bump(Stat::SocketLeftToTc);
    Choice::Leave
}

/// The network namespace of the node's own processes.
#[inline(always)]
fn host_netns() -> u64 {
    let cookie = HOST_NETNS_COOKIE.load();
    if cookie != 0 {
        return cookie;
    }
    // SAFETY: with no context the helper answers for the initial namespace.
    unsafe { bpf_get_netns_cookie(core::ptr::null_mut()) }
}

/// A backend id and entry in `slot` of `frontend`, if it still holds one.
#[inline(always)]
fn slot_backend<F: SlotTable>(frontend: F, slot: u16) -> Option<(u32, Backend)> {
    let id = frontend.slot(slot)?.backend_id;
    Some((id, backend(id)?))
}

/// The backend a namespace's sockets went to last, while within the affinity timeout and
/// still this frontend's.
#[inline(always)]
fn sticky(key: &SockAffinityKey, timeout_ns: u64, now: u64) -> Option<(u32, Backend)> {
    if timeout_ns == 0 {
        return None;
    }
    remembered(
        unsafe { SOCK_AFFINITY.get(key) },
        key.service_id,
        timeout_ns,
        now,
    )
}

/// Counts the socket against its backend for the least-connection schedulers, until
/// [`release`]. A UDP socket connected again gives back its earlier count first.
#[inline(always)]
fn count_socket(ctx: &SockAddrContext, backend_id: u32) {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if let Some(old) = unsafe { SOCK_LB.get(&cookie) } {
        uncount(old.backend_id);
    }
    let value = SockLbValue {
        backend_id,
        _pad0: 0,
    };
    if SOCK_LB.insert(&cookie, &value, BPF_ANY as u64).is_err() {
        bump(Stat::SocketTableFull);
        return;
    }
    count_connection(backend_id, 1);
}

/// Takes back a socket's count, unless its backend has left (its counts went with it).
#[inline(always)]
fn uncount(backend_id: u32) {
    if backend(backend_id).is_some() {
        count_connection(backend_id, u64::MAX);
    }
}

/// cgroup/sock_release: a socket counted by [`count_socket`] is closed.
#[inline(always)]
pub fn release(ctx: &SockContext) -> i32 {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if let Some(counted) = unsafe { SOCK_LB.get(&cookie) } {
        uncount(counted.backend_id);
        let _ = SOCK_LB.remove(&cookie);
    }
    1
}

/// A new connection through the hooks, on the service's and the backend's counters.
#[inline(always)]
fn count_new_connection(service_id: u32, backend_id: u32) {
    add_connection(SERVICE_STATS.get_ptr_mut(service_id));
    if BACKEND_STATS_ENABLED.load() != 0 {
        add_connection(BACKEND_STATS.get_ptr_mut(backend_id & BACKEND_INDEX_MASK));
    }
}

#[inline(always)]
fn add_connection(slot: Option<*mut ServiceStats>) {
    if let Some(s) = slot {
        // SAFETY: per-CPU slot, no concurrent writer.
        unsafe { (*s).connections += 1 };
    }
}

/// A socket call to a service without endpoints fails as a connection to a closed port
/// does, with ECONNREFUSED, where the kernel lets the hook say so (else EPERM, the hooks'
/// default).
#[inline(always)]
pub fn refuse_socket() -> i32 {
    bump(Stat::SocketRefused);
    if SOCK_SET_RETVAL.load() != 0 {
        // SAFETY: a helper taking a plain integer.
        unsafe { aya_ebpf::helpers::bpf_set_retval(-ECONNREFUSED) };
    }
    SOCK_REJECT
}

/// Whether the node's IPv4 address is inside frontend `service_id`'s source ranges.
#[inline(always)]
pub fn node_allowed4(service_id: u32) -> bool {
    let key = LpmKey::new(
        64,
        SourceRangeKey {
            service_id,
            addr: config().masquerade_addr,
        },
    );
    SOURCE_RANGES.get(&key).is_some()
}

/// An IPv4 socket names an address (connect, or sendto on an unconnected UDP socket): a
/// frontend is replaced by the backend [`choose`] gives, and the socket remembers the
/// frontend for replies.
#[inline(always)]
pub fn socket_to_backend(ctx: &SockAddrContext, call: Call) -> i32 {
    // SAFETY: the context pointer is the kernel's bpf_sock_addr for this call.
    let sa = unsafe { &mut *ctx.sock_addr };
    let proto = sa.protocol as u8;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return SOCK_ALLOW;
    }
    let addr = sa.user_ip4;
    // user_port holds the port in network byte order in its low 16 bits.
    let port = sa.user_port as u16;
    let frontend = Frontend4::new(addr, port, proto);
    let Some(header) = frontend.slot(0) else {
        return SOCK_ALLOW;
    };
    // Every socket below the hooks is a client on this node.
    let header = scoped_header(frontend, header, || true);
    let frontend = frontend.scoped(scope_of(&header));
    let backend = match choose(ctx, frontend, &header, proto, call, addr, node_allowed4) {
        Choice::Leave => return SOCK_ALLOW,
        Choice::Refuse => {
            told(ctx, addr, port, proto, header.service_id, 0);
            return refuse_socket();
        }
        Choice::Backend(id, b) => {
            told(ctx, addr, port, proto, b.service_id, id);
            b
        }
    };
    let key = SockRevNatKey {
        cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        addr: backend.addr,
        port: backend.port,
        _pad0: [0; 2],
    };
    let value = SockRevNatValue {
        addr,
        port,
        _pad0: [0; 2],
    };
    let _ = SOCK_REVNAT.insert(&key, &value, BPF_ANY as u64);
    sa.user_ip4 = backend.addr;
    sa.user_port = backend.port as u32;
    SOCK_ALLOW
}

/// A follower of new flows (`inspect flows --follow`) hears what the hook decided for a
/// socket naming `addr`:`port` (`backend_id` 0: refused).
#[inline(always)]
fn told(ctx: &SockAddrContext, addr: u32, port: u16, proto: u8, service_id: u32, backend_id: u32) {
    if flows::followed() {
        let key = ConntrackKey::new(0, addr, 0, port, proto);
        let verdict = if backend_id != 0 {
            FLOW_VERDICT_FORWARDED
        } else {
            FLOW_VERDICT_REFUSED
        };
        flows::tell4(
            &key,
            service_id,
            backend_id,
            flows::how(verdict, socket_path(ctx)),
        );
    }
}

/// Whose socket it is, as a follower of new flows is told: the node's own process or a pod's.
#[inline(always)]
pub fn socket_path(ctx: &SockAddrContext) -> u8 {
    // SAFETY: a helper taking the program's context.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    if netns == host_netns() {
        FLOW_PATH_SOCKET_NODE
    } else {
        FLOW_PATH_SOCKET_POD
    }
}

/// recvfrom / getpeername on a socket the hook above translated: the frontend it asked for,
/// not the backend, is what it sees.
#[inline(always)]
pub fn backend_to_service(ctx: &SockAddrContext) -> i32 {
    // SAFETY: as above.
    let sa = unsafe { &mut *ctx.sock_addr };
    let key = SockRevNatKey {
        cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        addr: sa.user_ip4,
        port: sa.user_port as u16,
        _pad0: [0; 2],
    };
    if let Some(service) = unsafe { SOCK_REVNAT.get(&key) } {
        sa.user_ip4 = service.addr;
        sa.user_port = service.port as u32;
    }
    SOCK_ALLOW
}
