//! Types shared by the kernel datapath (`proxy-ebpf`) and the agent (`proxy-agent`).
//!
//! Every map key and value is `#[repr(C)]` with its padding spelled out as named fields, so
//! the kernel hashes exactly the bytes user space wrote (implicit padding is uninitialised
//! memory on one side and zero on the other: lookups would miss at random). The layouts are
//! asserted in this crate's tests; a change here must bump [`MAP_LAYOUT_VERSION`].
//!
//! Addresses and ports are kept in network byte order, as they appear in the packet, so the
//! datapath never swaps bytes on the hot path.
#![no_std]

/// Bumped whenever a map key/value layout below changes. The agent records it beside pinned
/// maps so a newer agent never misreads maps written by an older one.
pub const MAP_LAYOUT_VERSION: u32 = 11;

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;

/// Names of the maps in the eBPF object; the agent sizes and pins them by these names.
pub mod map_names {
    pub const SERVICES: &str = "SERVICES";
    /// Service id → [`super::ServiceName`]: written by the agent only, read by `inspect`.
    pub const SERVICE_NAMES: &str = "SERVICE_NAMES";
    pub const BACKENDS: &str = "BACKENDS";
    pub const CONNTRACK: &str = "CONNTRACK";
    pub const CONFIG: &str = "CONFIG";
    pub const STATS: &str = "STATS";
    pub const SERVICE_STATS: &str = "SERVICE_STATS";
    pub const BACKEND_STATS: &str = "BACKEND_STATS";
    pub const AFFINITY: &str = "AFFINITY";
    pub const SOURCE_RANGES: &str = "SOURCE_RANGES";
    pub const FRAGMENTS: &str = "FRAGMENTS";
    pub const SOCK_REVNAT: &str = "SOCK_REVNAT";
    pub const RR_STATE: &str = "RR_STATE";
    pub const BACKEND_CONNS: &str = "BACKEND_CONNS";
    pub const BACKEND_RELEASED: &str = "BACKEND_RELEASED";
    pub const LBLCR_SETS: &str = "LBLCR_SETS";
    pub const MAGLEV: &str = "MAGLEV";
    /// IPv6 frontends: [`super::ServiceKey6`] -> [`super::ServiceValue`], as `SERVICES`.
    pub const SERVICES6: &str = "SERVICES6";
    /// IPv6 backend addresses, indexed like `BACKENDS` (which holds their port and flags).
    pub const BACKEND_ADDRS6: &str = "BACKEND_ADDRS6";
    /// IPv6 flows, as `CONNTRACK`.
    pub const CONNTRACK6: &str = "CONNTRACK6";
    /// Flows not yet confirmed (their client has not spoken since the first reply): same
    /// layout as `CONNTRACK`, a separate LRU, so a flood of spoofed sources only ever
    /// evicts its own kind and never an established flow.
    pub const CT_NEW: &str = "CT_NEW";
    /// Unconfirmed IPv6 flows, as `CT_NEW`.
    pub const CT_NEW6: &str = "CT_NEW6";
    /// `sessionAffinity: ClientIP` for IPv6 clients, as `AFFINITY`.
    pub const AFFINITY6: &str = "AFFINITY6";
    /// `loadBalancerSourceRanges` of IPv6 frontends, as `SOURCE_RANGES`.
    pub const SOURCE_RANGES6: &str = "SOURCE_RANGES6";
    /// The IPv6 settings ([`super::DatapathConfig6`]).
    pub const CONFIG6: &str = "CONFIG6";
    /// Fragmented IPv6 datagrams, as `FRAGMENTS`.
    pub const FRAGMENTS6: &str = "FRAGMENTS6";
    /// The node's own IPv6 sockets given a backend, as `SOCK_REVNAT`.
    pub const SOCK_REVNAT6: &str = "SOCK_REVNAT6";
    /// The programs the tc programs tail-call into (see [`super::tail_calls`]).
    pub const TAIL_CALLS: &str = "TAIL_CALLS";
    /// `sessionAffinity: ClientIP` for sockets the hooks translate: the client is the
    /// socket's network namespace (a pod, or the node), whose address is not known at
    /// connect time. [`super::SockAffinityKey`] -> [`super::AffinityValue`].
    pub const SOCK_AFFINITY: &str = "SOCK_AFFINITY";
    /// Sockets the hooks counted against a backend for the least-connection schedulers:
    /// socket cookie (u64) -> [`super::SockLbValue`], until the socket is released.
    pub const SOCK_LB: &str = "SOCK_LB";
    /// The node's pod interfaces under an interface-based `detectLocalMode`: ifindex (u32)
    /// -> 1. Read when [`super::DatapathConfig::pods_by_interface`] is set.
    pub const LOCAL_IFACES: &str = "LOCAL_IFACES";
    /// New flows as decided, while someone follows them: a ring buffer of
    /// [`super::FlowEvent`]s (`inspect flows --follow`).
    pub const FLOW_EVENTS: &str = "FLOW_EVENTS";
    /// Whether anyone follows: one [`super::FlowListener`].
    pub const FLOW_LISTENER: &str = "FLOW_LISTENER";
    /// Per CPU: events sent this second and those held back ([`super::FlowRate`]).
    pub const FLOW_RATE: &str = "FLOW_RATE";
}

/// Entries of `LOCAL_IFACES`: more interfaces than a node has pods (kubelet's default is
/// 110 per node; the largest clusters allow a few hundred).
pub const LOCAL_IFACES_MAX: u32 = 4096;

/// Load-time switch (a read-only global the verifier sees as a constant) for per-backend
/// counters: when 0 their code is removed from the program.
pub const BACKEND_STATS_ENABLED: &str = "BACKEND_STATS_ENABLED";

/// Load-time switch: the kernel lets socket hooks choose their error (`bpf_set_retval`,
/// 5.18), so a connect to a service without endpoints fails with ECONNREFUSED; when 0 the
/// call is removed and it fails with the hooks' default, EPERM.
pub const SOCK_SET_RETVAL: &str = "SOCK_SET_RETVAL";

/// Load-time setting: the network namespace cookie of the node's own processes (the
/// agent's). 0: the kernel's initial namespace.
pub const HOST_NETNS_COOKIE: &str = "HOST_NETNS_COOKIE";

/// Load-time switch: 1 translates only the node's own sockets at the hooks (pods' go to the
/// tc path untouched, as service meshes need); 0 translates every process below them.
pub const SOCK_HOST_ONLY: &str = "SOCK_HOST_ONLY";

/// Load-time switch: the socket-release hook is attached (the kernel lets it read a
/// socket's cookie), so sockets may be counted for the least-connection schedulers.
pub const SOCK_RELEASE_ATTACHED: &str = "SOCK_RELEASE_ATTACHED";

/// Names of the programs in the eBPF object.
pub mod program_names {
    /// Attached at tc ingress: translates what a pod (or the outside) sends.
    pub const TC_INGRESS: &str = "proxy_ingress";
    /// Attached at tc egress: translates what the node forwards or sends out.
    pub const TC_EGRESS: &str = "proxy_egress";
    /// Socket-level hooks for the node's own processes (cgroup/connect4, sendmsg4,
    /// recvmsg4, getpeername4): the node's traffic is routed before tc sees it, so a cluster
    /// IP must be replaced by a backend when the socket names it.
    pub const SOCK_CONNECT4: &str = "proxy_connect4";
    pub const SOCK_SENDMSG4: &str = "proxy_sendmsg4";
    pub const SOCK_RECVMSG4: &str = "proxy_recvmsg4";
    pub const SOCK_GETPEERNAME4: &str = "proxy_getpeername4";
    /// IPv6 at tc ingress/egress: tail-called by the programs above when the packet is
    /// IPv6, so each family's path has the whole BPF stack to itself.
    pub const TC_INGRESS6: &str = "proxy_ingress6";
    pub const TC_EGRESS6: &str = "proxy_egress6";
    /// Socket-level hooks for the node's own IPv6 sockets, as the IPv4 ones.
    pub const SOCK_CONNECT6: &str = "proxy_connect6";
    pub const SOCK_SENDMSG6: &str = "proxy_sendmsg6";
    pub const SOCK_RECVMSG6: &str = "proxy_recvmsg6";
    pub const SOCK_GETPEERNAME6: &str = "proxy_getpeername6";
    /// cgroup/sock_release: a socket the hooks counted for a least-connection scheduler is
    /// closed; its backend's count goes down.
    pub const SOCK_RELEASE: &str = "proxy_sock_release";
    /// Answers a new flow to a service without endpoints (TCP reset, ICMP port unreachable);
    /// tail-called by the tc programs of both families.
    pub const REFUSE: &str = "proxy_refuse";
    /// The first packet of an IPv4 flow to a frontend: tail-called by the ingress program,
    /// so the new-flow path has the BPF stack to itself.
    pub const NEW_FLOW: &str = "proxy_new_flow";
    /// The first packet of an IPv6 flow to a frontend, tail-called by [`TC_INGRESS6`]: apart
    /// from the tracked-flow path, each half stays inside Debian 6.1's verifier budget.
    pub const NEW_FLOW6: &str = "proxy_new_flow6";
    /// The IPv6 tc programs, loaded (and refused) together.
    pub const IPV6_TC: [&str; 3] = [TC_INGRESS6, TC_EGRESS6, NEW_FLOW6];
    pub const SOCKET_HOOKS: [&str; 8] = [
        SOCK_CONNECT4,
        SOCK_SENDMSG4,
        SOCK_RECVMSG4,
        SOCK_GETPEERNAME4,
        SOCK_CONNECT6,
        SOCK_SENDMSG6,
        SOCK_RECVMSG6,
        SOCK_GETPEERNAME6,
    ];
}

/// Key of the `SERVICES` hash map. One service port (frontend address, port, protocol) owns
/// `count + 1` entries: slot 0 is the header ([`ServiceValue::count`]), slots `1..=count` each
/// name one backend ([`ServiceValue::backend_id`]). Selecting a backend is then two lookups
/// whatever the number of services or backends.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    /// Frontend IPv4 address, network byte order.
    pub addr: u32,
    /// Frontend port, network byte order.
    pub port: u16,
    pub proto: u8,
    /// Which clients this entry set serves: [`SCOPE_ALL`], or [`SCOPE_IN_CLUSTER`] for the
    /// second set of a frontend whose header has [`SERVICE_FLAG_IN_CLUSTER_SET`].
    pub scope: u8,
    /// 0 for the header, 1..=count for backends (host byte order).
    pub slot: u16,
    pub _pad1: [u8; 2],
}

impl ServiceKey {
    pub const fn new(addr_be: u32, port_be: u16, proto: u8, slot: u16) -> Self {
        Self::scoped(addr_be, port_be, proto, SCOPE_ALL, slot)
    }

    pub const fn scoped(addr_be: u32, port_be: u16, proto: u8, scope: u8, slot: u16) -> Self {
        Self {
            addr: addr_be,
            port: port_be,
            proto,
            scope,
            slot,
            _pad1: [0; 2],
        }
    }
}

/// [`ServiceKey::scope`] of a frontend's entries for every client.
pub const SCOPE_ALL: u8 = 0;
/// [`ServiceKey::scope`] of an `externalTrafficPolicy: Local` frontend's entries for clients
/// on this node (its pods and its own processes): every endpoint cluster traffic may use,
/// as kube-proxy short-circuits such traffic to its cluster chain.
pub const SCOPE_IN_CLUSTER: u8 = 1;

/// Slots of the `TAIL_CALLS` program array: each names the program in it.
pub mod tail_calls {
    /// IPv6 at tc ingress ([`super::program_names::TC_INGRESS6`]).
    pub const INGRESS6: u32 = 0;
    /// IPv6 at tc egress ([`super::program_names::TC_EGRESS6`]).
    pub const EGRESS6: u32 = 1;
    /// Refusals ([`super::program_names::REFUSE`]).
    pub const REFUSE: u32 = 2;
    /// New IPv4 flows at tc ingress ([`super::program_names::NEW_FLOW`]).
    pub const NEW_FLOW: u32 = 3;
    /// New IPv6 flows at tc ingress ([`super::program_names::NEW_FLOW6`]).
    pub const NEW_FLOW6: u32 = 4;
    pub const COUNT: u32 = 5;
}

/// Key of the `SERVICES6` hash map: [`ServiceKey`] with an IPv6 frontend address. The values
/// are [`ServiceValue`]s, and backend ids come from the same `BACKENDS` array, so both
/// families share service ids, slots, weights and counters.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey6 {
    /// Frontend IPv6 address, network byte order.
    pub addr: [u8; 16],
    /// Frontend port, network byte order.
    pub port: u16,
    pub proto: u8,
    /// As [`ServiceKey::scope`].
    pub scope: u8,
    /// 0 for the header, 1..=count for backends (host byte order).
    pub slot: u16,
    pub _pad1: [u8; 2],
}

impl ServiceKey6 {
    pub const fn new(addr: [u8; 16], port_be: u16, proto: u8, slot: u16) -> Self {
        Self::scoped(addr, port_be, proto, SCOPE_ALL, slot)
    }

    pub const fn scoped(addr: [u8; 16], port_be: u16, proto: u8, scope: u8, slot: u16) -> Self {
        Self {
            addr,
            port: port_be,
            proto,
            scope,
            slot,
            _pad1: [0; 2],
        }
    }
}

/// Key of `AFFINITY6`: [`AffinityKey`] for an IPv6 client (values are [`AffinityValue`]s).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityKey6 {
    pub client: [u8; 16],
    pub service_id: u32,
}

/// The data of a `SOURCE_RANGES6` LPM-trie key: as [`SourceRangeKey`], with an IPv6 source.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SourceRangeKey6 {
    pub service_id: u32,
    pub addr: [u8; 16],
}

/// The IPv6 datapath's settings (`CONFIG6`, one entry), beside [`DatapathConfig`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DatapathConfig6 {
    /// The node's IPv6 address masqueraded flows take as their source; all zero: none known,
    /// such flows go out unmasqueraded.
    pub masquerade_addr: [u8; 16],
    /// The IPv6 `clusterCIDR`, address and mask; mask all zero: not set.
    pub cluster_cidr_addr: [u8; 16],
    pub cluster_cidr_mask: [u8; 16],
}

/// Key of `FRAGMENTS6`: one fragmented IPv6 datagram as it arrived (its later fragments
/// carry no ports; the Fragment header's identification matches them).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragmentKey6 {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// Fragment header identification, network byte order.
    pub id: u32,
    pub proto: u8,
    pub _pad0: [u8; 3],
}

/// Value of `FRAGMENTS6`: the addresses the first fragment left with, and the hook.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragmentValue6 {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub hook: u8,
    pub _pad0: [u8; 3],
}

/// Key of `SOCK_REVNAT6`: [`SockRevNatKey`] with an IPv6 backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockRevNatKey6 {
    pub cookie: u64,
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad0: [u8; 6],
}

/// Value of `SOCK_REVNAT6`: the IPv6 frontend the socket asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockRevNatValue6 {
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad0: [u8; 2],
}

/// Value of `BACKEND_ADDRS6`: the address of an IPv6 backend whose port, flags and service
/// sit in `BACKENDS` at the same index (with `addr` 0 there).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BackendAddr6 {
    pub addr: [u8; 16],
}

/// Key of the `CONNTRACK6` LRU map: an IPv6 packet's 5-tuple, as [`ConntrackKey`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConntrackKey6 {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad0: [u8; 3],
}

impl ConntrackKey6 {
    pub const fn new(saddr: [u8; 16], daddr: [u8; 16], sport: u16, dport: u16, proto: u8) -> Self {
        Self {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            _pad0: [0; 3],
        }
    }

    pub const fn reversed(&self) -> Self {
        Self::new(self.daddr, self.saddr, self.dport, self.sport, self.proto)
    }
}

/// Value of `CONNTRACK6`: [`ConntrackValue`] with an IPv6 address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConntrackValue6 {
    pub last_seen_ns: u64,
    /// Original entry: backend address; reply entry: service address.
    pub nat_addr: [u8; 16],
    /// Original entry: backend port; reply entry: service port (network byte order).
    pub nat_port: u16,
    /// `CT_FLAG_*` (REPLY, SEEN_REPLY, CLOSING, EGRESS_ONLY).
    pub flags: u8,
    pub _pad0: u8,
    pub backend_id: u32,
    pub service_id: u32,
    /// As [`ConntrackValue::expected_ack`].
    pub expected_ack: u32,
    /// As [`ConntrackValue::client_port`].
    pub client_port: u16,
    pub _pad1: u16,
    pub _pad2: u32,
}

/// Header flag: an empty service drops new flows instead of refusing them (traffic policy
/// Local with endpoints only on other nodes, as kube-proxy drops them).
pub const SERVICE_FLAG_DROP_WHEN_EMPTY: u16 = 1 << 0;
/// Header flag: an external frontend (NodePort, external IP, load-balancer IP). Its replies
/// get their source restored at egress only: a node address restored on ingress would make
/// the kernel drop the reply as a martian.
pub const SERVICE_FLAG_EXTERNAL: u16 = 1 << 1;
/// Header flag: `externalTrafficPolicy: Cluster`; flows sent to a backend on another node
/// are source-NATed to the node's address so replies come back through this node.
pub const SERVICE_FLAG_MASQUERADE: u16 = 1 << 2;
/// Header flag: masquerade every new flow (`masqueradeAll`), whatever its backend.
pub const SERVICE_FLAG_MASQUERADE_ALL: u16 = 1 << 4;
/// Header flag (of the [`SCOPE_ALL`] header): the frontend has a second entry set under
/// [`SCOPE_IN_CLUSTER`], which new flows from this node and its pods use instead.
pub const SERVICE_FLAG_IN_CLUSTER_SET: u16 = 1 << 5;
/// Header flag: this header is a frontend's [`SCOPE_IN_CLUSTER`] set. The datapath takes
/// the scope of the slots it reads next from here, a value the verifier does not know,
/// rather than from the branch that chose the set: so it walks what follows once, not
/// once per scope.
pub const SERVICE_FLAG_SCOPE_IN_CLUSTER: u16 = 1 << 6;
/// Header: the scheduler (IPVS's names) sits in bits 8..12 of the flags.
pub const SERVICE_SCHEDULER_SHIFT: u16 = 8;
pub const SERVICE_SCHEDULER_MASK: u16 = 0xf;

/// Schedulers the datapath implements, by header id.
pub mod scheduler {
    /// Uniformly random (kube-proxy's iptables and nftables modes).
    pub const RANDOM: u16 = 0;
    /// Round robin: backends in turn.
    pub const RR: u16 = 1;
    /// Weighted round robin: in turn, each backend as often as its weight.
    pub const WRR: u16 = 2;
    /// Source hashing: a client address always maps to the same backend.
    pub const SH: u16 = 3;
    /// Destination hashing: a destination address always maps to the same backend.
    pub const DH: u16 = 4;
    /// Maglev hashing: per-client stability with minimal disruption when backends change.
    pub const MH: u16 = 5;
    /// Least connections: the backend with the fewest active connections.
    pub const LC: u16 = 6;
    /// Weighted least connections: fewest active connections per unit of weight.
    pub const WLC: u16 = 7;
    /// Shortest expected delay: fewest (active + 1) per unit of weight.
    pub const SED: u16 = 8;
    /// Never queue: an idle backend if there is one, else as SED.
    pub const NQ: u16 = 9;
    /// Locality-based least connections: a destination keeps its server until that server
    /// is overloaded, then takes the weighted-least-connection one.
    pub const LBLC: u16 = 10;
    /// Locality-based least connections with replication: a destination has a set of
    /// servers and takes its least-loaded one; when that is overloaded, the
    /// weighted-least-connection server joins the set.
    pub const LBLCR: u16 = 11;

    /// Whether the scheduler needs the datapath to count active connections per backend.
    pub const fn counts_connections(id: u16) -> bool {
        matches!(id, LC | WLC | SED | NQ | LBLC | LBLCR)
    }
}

/// Header flag: `loadBalancerSourceRanges` apply; new flows from sources outside the
/// frontend's ranges in `SOURCE_RANGES` are dropped.
pub const SERVICE_FLAG_SOURCE_RANGES: u16 = 1 << 3;

/// Value of the `SERVICES` map. In slot 0, `count` and `flags` are meaningful; in the backend
/// slots, `backend_id` is, and `flags << 16 | count` is the cumulative weight of slots
/// `1..=slot` (weighted schedulers search it).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceValue {
    /// Backend slots: the backend's id (see [`Backend`]). Header slot: the
    /// `sessionAffinity: ClientIP` timeout in seconds (0: no affinity).
    pub backend_id: u32,
    /// Stable identifier of the service port (for statistics and debugging).
    pub service_id: u32,
    /// Header slot: number of backend slots. 0 means "no ready endpoint": refuse.
    pub count: u16,
    /// Header slot: `SERVICE_FLAG_*`.
    pub flags: u16,
}

/// Backend ids are `index | generation << 24`: the index selects the `BACKENDS` array slot,
/// the generation changes each time the agent reuses the slot, so a conntrack entry that
/// remembers an id never mistakes a later backend in the same slot for its own.
pub const BACKEND_INDEX_BITS: u32 = 24;
pub const BACKEND_INDEX_MASK: u32 = (1 << BACKEND_INDEX_BITS) - 1;
/// Largest `BACKENDS` array the id scheme can address.
pub const MAX_BACKENDS: u32 = 1 << BACKEND_INDEX_BITS;

/// Value of the `BACKENDS` array, indexed by `id & BACKEND_INDEX_MASK`. An array rather than
/// a hash: the lookup is an offset computation the verifier inlines, and the entries a
/// service's flows touch sit together in memory, so checking on every packet that a flow's
/// backend is still alive costs the same with 1 or 100 000 services.
///
/// Ids are allocated per service port, so removing an endpoint from one service never keeps
/// that service's flows on it because another service shares the same pod address.
///
/// A backend may be *draining*: in `BACKENDS` but in no slot of its service, so it takes no
/// new flow while its established ones continue (a terminating or not-ready endpoint still
/// listed in its EndpointSlice).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Backend {
    /// The full id this slot currently holds. A free slot holds only the generation of the
    /// id it held last (index bits 0, see [`Backend::retired`]), so no id can match it and
    /// the next agent, even after a restart, hands the slot out under a new generation.
    pub id: u32,
    /// IPv4 address, network byte order.
    pub addr: u32,
    /// Port, network byte order.
    pub port: u16,
    /// `BACKEND_FLAG_*`.
    pub flags: u8,
    pub _pad0: u8,
    /// The frontend (service id) this backend belongs to: lets an agent that adopts pinned
    /// maps recognise draining backends, which no slot names.
    pub service_id: u32,
}

/// The backend runs on another node (its traffic may need source NAT).
pub const BACKEND_FLAG_REMOTE: u8 = 1 << 0;
/// An IPv6 backend: its address is in `BACKEND_ADDRS6` at the same index (`addr` is 0).
pub const BACKEND_FLAG_IPV6: u8 = 1 << 1;

impl Backend {
    pub const EMPTY: Self = Self {
        id: 0,
        addr: 0,
        port: 0,
        flags: 0,
        _pad0: 0,
        service_id: 0,
    };

    /// What a slot holds once the backend with `id` left it: its generation, nothing else.
    pub const fn retired(id: u32) -> Self {
        Self {
            id: id & !BACKEND_INDEX_MASK,
            ..Self::EMPTY
        }
    }

    /// Whether the slot holds a backend (not free, not retired).
    pub const fn in_use(&self) -> bool {
        self.id & BACKEND_INDEX_MASK != 0
    }

    pub const fn new(id: u32, addr_be: u32, port_be: u16, flags: u8, service_id: u32) -> Self {
        Self {
            id,
            addr: addr_be,
            port: port_be,
            flags,
            _pad0: 0,
            service_id,
        }
    }
}

/// Key of the `CONNTRACK` LRU map: a packet's 5-tuple as it is on the wire.
///
/// A translated flow owns two entries: the *original* tuple (client -> service) whose value
/// names the backend, and the *reply* tuple (backend -> client) whose value names the service
/// address to restore.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConntrackKey {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad0: [u8; 3],
}

impl ConntrackKey {
    pub const fn new(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8) -> Self {
        Self {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            _pad0: [0; 3],
        }
    }

    /// The tuple of the packets travelling the other way.
    pub const fn reversed(&self) -> Self {
        Self::new(self.daddr, self.saddr, self.dport, self.sport, self.proto)
    }
}

/// Entry is a reply-direction entry: rewrite the source back to `nat_addr:nat_port`.
pub const CT_FLAG_REPLY: u8 = 1 << 0;
/// A packet was seen in the reply direction (the flow is established, not just attempted).
pub const CT_FLAG_SEEN_REPLY: u8 = 1 << 1;
/// A FIN or RST was seen: the flow is closing and gets the short timeout.
pub const CT_FLAG_CLOSING: u8 = 1 << 2;
/// Reply entry translated at egress only, after netfilter, whose conntrack saw the flow
/// translated at ingress (every reply entry but a hairpin flow's, which is translated at
/// ingress and sent back out of its interface).
pub const CT_FLAG_EGRESS_ONLY: u8 = 1 << 3;
/// Source-NAT entry, keyed by the translated tuple (client -> backend): at egress, the
/// source becomes `nat_addr:nat_port` (the node's address and a port chosen for the flow).
pub const CT_FLAG_SNAT: u8 = 1 << 4;
/// Its reverse, keyed by (backend -> node:port): at ingress, the destination goes back to
/// `nat_addr:nat_port` (the client).
pub const CT_FLAG_SNAT_REPLY: u8 = 1 << 5;

/// A flow from a pod to a service that chose that same pod ("hairpin"): its source is
/// rewritten to [`HAIRPIN_SOURCE`] (a pod drops packets from its own address as martians),
/// and its reply entry is keyed by that address.
pub const CT_FLAG_HAIRPIN: u8 = 1 << 6;
/// The flow counts toward its backend's active connections (least-connection schedulers)
/// until it closes, expires or is re-balanced.
pub const CT_FLAG_COUNTED: u8 = 1 << 7;

/// The link-local address hairpin flows come from, as the pod sees them. Never on any
/// interface; pods reach it through their default route, i.e. through the node.
pub const HAIRPIN_SOURCE: [u8; 4] = [169, 254, 42, 1];

/// The IPv6 equivalent: 100::1, from the discard-only prefix 100::/64 (RFC 6666), which no
/// network assigns. IPv6 link-local addresses are on-link (a pod would look for the sender on
/// its own link instead of replying through the node), so the IPv4 choice has no twin.
pub const HAIRPIN_SOURCE6: [u8; 16] = [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];

/// Value of the `CONNTRACK` map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConntrackValue {
    /// `bpf_ktime_get_ns()` of the last packet that refreshed the entry (refreshed at most
    /// once per [`CT_REFRESH_NS`] to keep the established path free of cache-line writes).
    pub last_seen_ns: u64,
    /// Original entry: backend address; reply entry: service address (network byte order).
    pub nat_addr: u32,
    /// Original entry: backend port; reply entry: service port (network byte order).
    pub nat_port: u16,
    /// `CT_FLAG_*`.
    pub flags: u8,
    pub _pad0: u8,
    /// Original entry: the backend id chosen, checked against `BACKENDS` on every packet so a
    /// flow never stays on a backend that has left its service.
    pub backend_id: u32,
    /// The service port's id (index into `SERVICE_STATS`), for per-service counters.
    pub service_id: u32,
    /// Original entry of an unconfirmed TCP flow: the acknowledgment number the client's
    /// next segment must carry (the backend's SYN-ACK sequence number + 1, host byte
    /// order; 0 before the SYN-ACK), so a spoofed source that never saw the SYN-ACK
    /// cannot confirm its flow.
    pub expected_ack: u32,
    /// A flow whose tuple clashed with a live flow's gets a new source port (as netfilter
    /// resolves a NAT clash). Original entry: that port; reply entry: the client's own
    /// port, restored on replies. 0: the source port is not translated. Network byte order.
    pub client_port: u16,
    pub _pad1: u16,
}

/// Key of the `AFFINITY` LRU map: one client of one frontend (`sessionAffinity: ClientIP`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    /// Client IPv4 address, network byte order.
    pub client: u32,
    pub service_id: u32,
}

/// Value of the `AFFINITY` map: the backend the client's new flows go to while it keeps
/// opening them within the timeout.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityValue {
    /// When the client last opened a flow to the frontend.
    pub last_seen_ns: u64,
    pub backend_id: u32,
    pub _pad0: u32,
}

/// The data of a `SOURCE_RANGES` LPM-trie key: a frontend's id, then a source address. The
/// key's prefix length is 32 (the whole id) plus the range's prefix length.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SourceRangeKey {
    pub service_id: u32,
    /// IPv4 address, network byte order (so prefixes match its leading bits).
    pub addr: u32,
}

/// Key of the `FRAGMENTS` LRU map: one fragmented IPv4 datagram as it arrived (fragments
/// after the first carry no ports, so they are matched by the IP identification instead).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragmentKey {
    pub saddr: u32,
    pub daddr: u32,
    /// IPv4 identification, network byte order.
    pub id: u16,
    pub proto: u8,
    pub _pad0: u8,
}

/// Value of the `FRAGMENTS` map: the addresses the first fragment left with, and the hook
/// that translated it; the datagram's other fragments get the same there.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragmentValue {
    pub saddr: u32,
    pub daddr: u32,
    /// 0: ingress, 1: egress, 2: ingress and sent back out of the interface (hairpin).
    pub hook: u8,
    pub _pad0: [u8; 3],
}

/// Key of the `SOCK_REVNAT` LRU map: a socket (by cookie) and the backend the socket-level
/// hook gave it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockRevNatKey {
    pub cookie: u64,
    /// Backend address and port, network byte order.
    pub addr: u32,
    pub port: u16,
    pub _pad0: [u8; 2],
}

/// Key of `SOCK_AFFINITY`: a client of a socket-translated frontend, by network namespace.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockAffinityKey {
    /// `bpf_get_netns_cookie` of the socket: one pod (or the node) is one client.
    pub netns: u64,
    pub service_id: u32,
    pub _pad0: u32,
}

/// Value of `SOCK_LB`: the backend a socket was counted against.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockLbValue {
    pub backend_id: u32,
    pub _pad0: u32,
}

/// Value of the `SOCK_REVNAT` map: the service frontend the socket asked for, shown back to
/// it by recvmsg and getpeername.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockRevNatValue {
    pub addr: u32,
    pub port: u16,
    pub _pad0: [u8; 2],
}

/// murmur3's 32-bit finaliser: the hash the hashing schedulers apply to an address (in
/// network byte order, as in packets). Shared so the agent builds Maglev tables with the
/// function the datapath looks them up with.
pub const fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^= x >> 13;
    x = x.wrapping_mul(0xc2b2_ae35);
    x ^= x >> 16;
    x
}

/// The best backend so far in a least-connection scan (datapath stack only).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LcScratch {
    pub cost: u64,
    pub weight: u64,
    pub slot: u32,
    pub _pad0: u32,
}

/// Servers an `lblcr` frontend's set holds at most.
pub const LBLCR_SET_SIZE: usize = 4;

/// Value of the `LBLCR_SETS` array (indexed by service id): an `lblcr` frontend's server
/// set, each member `slot << 32 | backend id` (0: empty), and when the set last changed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LblcrSet {
    pub members: [u64; LBLCR_SET_SIZE],
    pub changed_ns: u64,
}

/// Key of the `MAGLEV` hash map: one entry of one frontend's Maglev lookup table.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MaglevKey {
    pub service_id: u32,
    pub index: u32,
}

/// Entries are refreshed at most this often.
pub const CT_REFRESH_NS: u64 = 1_000_000_000;

/// Index 0 of the `CONFIG` array map: datapath settings the agent writes from its
/// configuration (conntrack timeouts, as kube-proxy's `conntrack` section).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DatapathConfig {
    /// TCP flow that has seen a reply and no FIN/RST.
    pub tcp_established_timeout_ns: u64,
    /// TCP flow still waiting for the backend's SYN-ACK.
    pub tcp_syn_timeout_ns: u64,
    /// TCP flow after FIN or RST.
    pub tcp_closing_timeout_ns: u64,
    /// UDP flow that has seen no reply.
    pub udp_timeout_ns: u64,
    /// UDP flow that has seen replies (a "stream").
    pub udp_stream_timeout_ns: u64,
    /// Must equal [`MAP_LAYOUT_VERSION`]; 0 means the agent has not configured the datapath
    /// yet, and built-in defaults apply.
    pub layout_version: u32,
    /// The node's address that masqueraded flows take as their source (network byte order);
    /// 0: none known, such flows go out unmasqueraded.
    pub masquerade_addr: u32,
    /// `clusterCIDR` (network byte order, address and mask): flows to a cluster IP from
    /// outside it are masqueraded. Mask 0: not set.
    pub cluster_cidr_addr: u32,
    pub cluster_cidr_mask: u32,
    /// Entries of each frontend's Maglev table (a prime); 0: Maglev not in use.
    pub maglev_table_size: u32,
    /// 1: the node's pods are the clients whose packets came in on an interface in
    /// `LOCAL_IFACES` (`detectLocalMode` BridgeInterface or InterfaceNamePrefix), not those
    /// in the cluster CIDR.
    pub pods_by_interface: u32,
}

impl DatapathConfig {
    /// kube-proxy's conntrack defaults (tcpEstablishedTimeout 24h, tcpCloseWaitTimeout 1h,
    /// udpTimeout 30s, udpStreamTimeout 120s), and a SYN timeout like the kernel's 120 s.
    pub const DEFAULT: Self = Self {
        tcp_established_timeout_ns: 24 * 3600 * 1_000_000_000,
        tcp_syn_timeout_ns: 120 * 1_000_000_000,
        tcp_closing_timeout_ns: 3600 * 1_000_000_000,
        udp_timeout_ns: 30 * 1_000_000_000,
        udp_stream_timeout_ns: 120 * 1_000_000_000,
        layout_version: MAP_LAYOUT_VERSION,
        masquerade_addr: 0,
        cluster_cidr_addr: 0,
        cluster_cidr_mask: 0,
        maglev_table_size: 0,
        pods_by_interface: 0,
    };

    /// How long `value` may stay idle before the flow is over.
    pub const fn timeout_ns(&self, proto: u8, flags: u8) -> u64 {
        if proto == IPPROTO_TCP {
            if flags & CT_FLAG_CLOSING != 0 {
                self.tcp_closing_timeout_ns
            } else if flags & CT_FLAG_SEEN_REPLY != 0 {
                self.tcp_established_timeout_ns
            } else {
                self.tcp_syn_timeout_ns
            }
        } else if flags & CT_FLAG_SEEN_REPLY != 0 {
            self.udp_stream_timeout_ns
        } else {
            self.udp_timeout_ns
        }
    }
}

/// Value of the `SERVICE_NAMES` hash map, keyed by service id (the `SERVICE_STATS` index):
/// the service port and kind of frontend an id serves, so `proxy-agent inspect` can name
/// what the pinned maps hold while no agent runs. The agent writes it; the datapath never
/// reads it (allocated as used: `BPF_F_NO_PREALLOC`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceName {
    /// `namespace/name:port` in UTF-8, NUL-padded: Kubernetes bounds it to 63 + 1 + 63 +
    /// 1 + 15 bytes (namespace, Service name, port name).
    pub name: [u8; SERVICE_NAME_BYTES],
    /// [`FRONTEND_KIND_CLUSTER_IP`] and the others.
    pub kind: u8,
    pub _pad: [u8; 3],
}

pub const SERVICE_NAME_BYTES: usize = 144;
pub const FRONTEND_KIND_CLUSTER_IP: u8 = 0;
pub const FRONTEND_KIND_NODE_PORT: u8 = 1;
pub const FRONTEND_KIND_EXTERNAL_IP: u8 = 2;
pub const FRONTEND_KIND_LOAD_BALANCER: u8 = 3;

impl ServiceName {
    /// `text` (cut at the bound, at a character boundary) and `kind`.
    pub fn new(text: &str, kind: u8) -> Self {
        let mut name = [0u8; SERVICE_NAME_BYTES];
        let mut end = text.len().min(SERVICE_NAME_BYTES);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        name[..end].copy_from_slice(&text.as_bytes()[..end]);
        Self {
            name,
            kind,
            _pad: [0; 3],
        }
    }

    /// The name's bytes, without the padding.
    pub fn text(&self) -> &[u8] {
        let end = self
            .name
            .iter()
            .position(|b| *b == 0)
            .unwrap_or(SERVICE_NAME_BYTES);
        &self.name[..end]
    }
}

/// Bytes of the `FLOW_EVENTS` ring buffer (a power of two, a multiple of the page size):
/// about 2 700 [`FlowEvent`]s between two reads of the listener.
pub const FLOW_EVENTS_BYTES: u32 = 256 * 1024;

/// Value of `FLOW_LISTENER[0]`: whether, and how fast, the datapath records new flows in
/// `FLOW_EVENTS` (`proxy-agent inspect flows --follow` writes it; see proxy-ebpf's `flows`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowListener {
    /// Records until this time (`bpf_ktime_get_ns`); 0: no listener.
    pub until_ns: u64,
    /// The listener's process id (one reader at a time).
    pub owner: u32,
    /// Events each CPU may send per second; the rest are counted in [`FlowRate::limited`].
    pub max_per_second: u32,
}

/// Value of the per-CPU `FLOW_RATE[0]`: this CPU's events in the current second, and those
/// it did not send.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowRate {
    /// Start of the current one-second window (`bpf_ktime_get_ns`).
    pub window_ns: u64,
    pub sent: u32,
    /// Not sent: over the listener's rate.
    pub limited: u32,
    /// Not sent: the ring was full (the listener reads too slowly).
    pub lost: u32,
    pub _pad0: u32,
}

/// One decided flow in `FLOW_EVENTS`. Addresses are 16 bytes, an IPv4 one IPv4-mapped
/// (`::ffff:a.b.c.d`); ports in network byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowEvent {
    /// When it was decided (`bpf_ktime_get_ns`).
    pub time_ns: u64,
    /// The client; `::` on the socket path (its source is chosen after connect).
    pub client: [u8; 16],
    pub frontend: [u8; 16],
    /// The chosen backend; `::` when none was ([`FlowEvent::backend_id`] 0).
    pub backend: [u8; 16],
    /// The frontend's service id (`SERVICE_NAMES` key); 0 where the hook did not know it.
    pub service_id: u32,
    pub backend_id: u32,
    pub client_port: u16,
    pub frontend_port: u16,
    pub backend_port: u16,
    pub proto: u8,
    /// `FLOW_VERDICT_*`.
    pub verdict: u8,
    /// `FLOW_PATH_*`.
    pub path: u8,
    pub _pad0: u8,
    pub _pad1: u16,
    pub _pad2: u32,
}

/// Given a backend.
pub const FLOW_VERDICT_FORWARDED: u8 = 1;
/// No endpoint: the client was refused (a reset, an ICMP unreachable, ECONNREFUSED).
pub const FLOW_VERDICT_REFUSED: u8 = 2;
/// `externalTrafficPolicy: Local` without a local endpoint: dropped.
pub const FLOW_VERDICT_DROPPED: u8 = 3;
/// Outside the frontend's `loadBalancerSourceRanges`: dropped.
pub const FLOW_VERDICT_DENIED: u8 = 4;

/// Decided by the tc programs, from a packet.
pub const FLOW_PATH_TC: u8 = 1;
/// Decided by the socket hooks, for a process of the node itself.
pub const FLOW_PATH_SOCKET_NODE: u8 = 2;
/// Decided by the socket hooks, for a process in a pod.
pub const FLOW_PATH_SOCKET_POD: u8 = 3;

/// Value of the per-CPU `SERVICE_STATS` array (indexed by a service port's id) and
/// `BACKEND_STATS` array (indexed by a backend's slot): traffic, both directions.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceStats {
    pub packets: u64,
    pub bytes: u64,
    /// New flows given a backend.
    pub connections: u64,
}

/// Indexes of the per-CPU `STATS` array: what the datapath did, exported as metrics.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stat {
    /// A new flow to a service was given a backend.
    NewFlow = 0,
    /// A packet of a tracked flow was translated to its backend.
    EstablishedFlow = 1,
    /// A reply was translated back to the service address.
    ReplyTranslated = 2,
    /// A packet to a service with no ready endpoint was answered with ICMP port unreachable.
    Refused = 3,
    /// The refusal could not be built (packet too short, IP options): the packet was dropped.
    RefuseFailed = 4,
    /// A tracked flow's backend left the service; the flow was given a new backend.
    BackendGone = 5,
    /// A tracked flow had timed out; it was given a (possibly new) backend.
    FlowExpired = 6,
    /// The conntrack map refused an insert; the packet was translated without tracking.
    ConntrackInsertFailed = 7,
    /// A header could not be rewritten (helper failure): the packet was dropped.
    RewriteFailed = 8,
    /// A new non-service flow had the reply tuple of an earlier service flow, whose
    /// conntrack entries were dropped so the new flow's replies pass untranslated.
    ClashResolved = 9,
    /// Conntrack entries the datapath created (two per tracked flow).
    ConntrackCreated = 10,
    /// Conntrack entries the datapath removed (flows re-balanced or replaced).
    ConntrackRemoved = 11,
    /// Conntrack entries the agent's garbage collector removed. Written by user space only
    /// (the datapath never touches this slot), so the agent can add to it without racing.
    /// With the two counters above and the live entry count, it gives the LRU evictions:
    /// created - removed - collected - live.
    ConntrackCollected = 12,
    /// A new flow to a service whose traffic policy is Local, with no endpoint on this node,
    /// was dropped.
    NoLocalEndpoint = 13,
    /// A masqueraded flow found no free source port (the packet went out unmasqueraded).
    SnatPortsExhausted = 14,
    /// A new flow to a load-balancer IP from outside its `loadBalancerSourceRanges` was
    /// dropped.
    SourceRangeDenied = 15,
    /// A fragment after the first was translated like its datagram's first fragment.
    FragmentTranslated = 16,
    /// A socket of the node's own processes was given a backend instead of a frontend.
    SocketTranslated = 17,
    /// A socket of the node's own processes named a service without endpoints: refused.
    SocketRefused = 18,
    /// Entries the datapath created in `CT_NEW`/`CT_NEW6` (two per new flow, two more per
    /// masqueraded one).
    NewEntryCreated = 19,
    /// Entries the datapath removed from `CT_NEW`/`CT_NEW6` (flows confirmed, re-balanced or
    /// replaced).
    NewEntryRemoved = 20,
    /// Entries of `CT_NEW`/`CT_NEW6` the agent's garbage collector removed (user space
    /// only, as `ConntrackCollected`).
    NewEntryCollected = 21,
    /// A flow's client spoke after a reply: its entries moved to `CONNTRACK`/`CONNTRACK6`.
    FlowConfirmed = 22,
    /// A TCP segment without SYN to a frontend matched no flow: passed untranslated, and
    /// nothing was created (a spoofed ACK flood, or a flow from before a map rebuild).
    UntrackedSegment = 23,
    /// A TCP segment of an unconfirmed flow, after the backend's SYN-ACK, that does not
    /// acknowledge it: translated, but the flow stays unconfirmed (a spoofed source
    /// completing a handshake it never saw).
    BlindAck = 24,
    /// A new flow whose translated tuple is a live flow's: the same client address and
    /// port already talk to the same backend address and port through another frontend.
    /// The new flow gets another source port (`ConntrackValue::client_port`).
    TupleClash = 25,
    /// A tuple clash for which no free source port was found in a few tries: the new
    /// flow was refused.
    TupleClashRefused = 26,
    /// A socket call the hooks left to the tc path, which translates its packets: a pod's
    /// connected UDP socket (re-steered per packet when its backend leaves), a pod's
    /// connect to a load-balancer IP with source ranges (judged by the packet's source),
    /// a frontend whose need this kernel's hooks lack, or a pod under `--socket-lb
    /// host-only`.
    SocketLeftToTc = 27,
    /// `SOCK_LB` was full: a socket was not counted for its least-connection scheduler.
    SocketTableFull = 28,
    /// The new-flow program could not be tail-called (its slot empty): the packet was
    /// dropped. The agent fills the slot before it attaches anything.
    NewFlowFailed = 29,
}

impl Stat {
    pub const COUNT: u32 = 30;
    pub const ALL: [Stat; Self::COUNT as usize] = [
        Stat::NewFlow,
        Stat::EstablishedFlow,
        Stat::ReplyTranslated,
        Stat::Refused,
        Stat::RefuseFailed,
        Stat::BackendGone,
        Stat::FlowExpired,
        Stat::ConntrackInsertFailed,
        Stat::RewriteFailed,
        Stat::ClashResolved,
        Stat::ConntrackCreated,
        Stat::ConntrackRemoved,
        Stat::ConntrackCollected,
        Stat::NoLocalEndpoint,
        Stat::SnatPortsExhausted,
        Stat::SourceRangeDenied,
        Stat::FragmentTranslated,
        Stat::SocketTranslated,
        Stat::SocketRefused,
        Stat::NewEntryCreated,
        Stat::NewEntryRemoved,
        Stat::NewEntryCollected,
        Stat::FlowConfirmed,
        Stat::UntrackedSegment,
        Stat::BlindAck,
        Stat::TupleClash,
        Stat::TupleClashRefused,
        Stat::SocketLeftToTc,
        Stat::SocketTableFull,
        Stat::NewFlowFailed,
    ];

    /// Label used for the metric.
    pub const fn name(self) -> &'static str {
        match self {
            Stat::NewFlow => "new_flow",
            Stat::EstablishedFlow => "established_flow",
            Stat::ReplyTranslated => "reply_translated",
            Stat::Refused => "refused_no_endpoints",
            Stat::RefuseFailed => "refuse_failed",
            Stat::BackendGone => "backend_gone",
            Stat::FlowExpired => "flow_expired",
            Stat::ConntrackInsertFailed => "conntrack_insert_failed",
            Stat::RewriteFailed => "rewrite_failed",
            Stat::ClashResolved => "clash_resolved",
            Stat::ConntrackCreated => "conntrack_created",
            Stat::ConntrackRemoved => "conntrack_removed",
            Stat::ConntrackCollected => "conntrack_collected",
            Stat::NoLocalEndpoint => "dropped_no_local_endpoint",
            Stat::SnatPortsExhausted => "snat_ports_exhausted",
            Stat::SourceRangeDenied => "source_range_denied",
            Stat::FragmentTranslated => "fragment_translated",
            Stat::SocketTranslated => "socket_translated",
            Stat::SocketRefused => "socket_refused",
            Stat::NewEntryCreated => "new_entry_created",
            Stat::NewEntryRemoved => "new_entry_removed",
            Stat::NewEntryCollected => "new_entry_collected",
            Stat::FlowConfirmed => "flow_confirmed",
            Stat::UntrackedSegment => "untracked_segment",
            Stat::BlindAck => "blind_ack",
            Stat::TupleClash => "tuple_clash",
            Stat::TupleClashRefused => "tuple_clash_refused",
            Stat::SocketLeftToTc => "socket_left_to_tc",
            Stat::SocketTableFull => "socket_table_full",
            Stat::NewFlowFailed => "new_flow_failed",
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)] with explicit padding fields, so every byte is
    // initialised and any bit pattern is valid.
    unsafe impl aya::Pod for super::ServiceKey {}
    unsafe impl aya::Pod for super::ServiceValue {}
    unsafe impl aya::Pod for super::Backend {}
    unsafe impl aya::Pod for super::ConntrackKey {}
    unsafe impl aya::Pod for super::ConntrackValue {}
    unsafe impl aya::Pod for super::DatapathConfig {}
    unsafe impl aya::Pod for super::ServiceStats {}
    unsafe impl aya::Pod for super::ServiceName {}
    unsafe impl aya::Pod for super::FlowListener {}
    unsafe impl aya::Pod for super::FlowRate {}
    unsafe impl aya::Pod for super::FlowEvent {}
    unsafe impl aya::Pod for super::AffinityKey {}
    unsafe impl aya::Pod for super::AffinityValue {}
    unsafe impl aya::Pod for super::SourceRangeKey {}
    unsafe impl aya::Pod for super::FragmentKey {}
    unsafe impl aya::Pod for super::FragmentValue {}
    unsafe impl aya::Pod for super::SockRevNatKey {}
    unsafe impl aya::Pod for super::SockRevNatValue {}
    unsafe impl aya::Pod for super::SockAffinityKey {}
    unsafe impl aya::Pod for super::SockLbValue {}
    unsafe impl aya::Pod for super::MaglevKey {}
    unsafe impl aya::Pod for super::LcScratch {}
    unsafe impl aya::Pod for super::LblcrSet {}
    unsafe impl aya::Pod for super::ServiceKey6 {}
    unsafe impl aya::Pod for super::BackendAddr6 {}
    unsafe impl aya::Pod for super::ConntrackKey6 {}
    unsafe impl aya::Pod for super::ConntrackValue6 {}
    unsafe impl aya::Pod for super::AffinityKey6 {}
    unsafe impl aya::Pod for super::SourceRangeKey6 {}
    unsafe impl aya::Pod for super::DatapathConfig6 {}
    unsafe impl aya::Pod for super::SockRevNatKey6 {}
    unsafe impl aya::Pod for super::SockRevNatValue6 {}
    unsafe impl aya::Pod for super::FragmentKey6 {}
    unsafe impl aya::Pod for super::FragmentValue6 {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, offset_of, size_of};

    // The datapath and the agent must agree byte for byte; these are the layouts both sides
    // were written against.
    #[test]
    fn flow_layouts() {
        assert_eq!(size_of::<FlowListener>(), 16);
        assert_eq!(size_of::<FlowRate>(), 24);
        assert_eq!(size_of::<FlowEvent>(), 80);
        assert_eq!(offset_of!(FlowEvent, service_id), 56);
        assert_eq!(offset_of!(FlowEvent, client_port), 64);
        assert_eq!(offset_of!(FlowEvent, proto), 70);
        assert_eq!(offset_of!(FlowEvent, path), 72);
        assert_eq!(align_of::<FlowEvent>(), 8);
        assert!(FLOW_EVENTS_BYTES.is_power_of_two() && FLOW_EVENTS_BYTES.is_multiple_of(4096));
    }

    #[test]
    fn service_name_layout_and_bounds() {
        assert_eq!(size_of::<ServiceName>(), 148);
        assert_eq!(offset_of!(ServiceName, kind), SERVICE_NAME_BYTES);
        let n = ServiceName::new("kube-system/kube-dns:dns-tcp", FRONTEND_KIND_CLUSTER_IP);
        assert_eq!(n.text(), b"kube-system/kube-dns:dns-tcp");
        // Longer than the bound: cut, never split inside a character.
        let long = "é".repeat(100);
        let n = ServiceName::new(&long, FRONTEND_KIND_NODE_PORT);
        assert_eq!(n.text().len(), SERVICE_NAME_BYTES);
        assert!(core::str::from_utf8(n.text()).is_ok());
    }

    #[test]
    fn service_key_layout() {
        assert_eq!(size_of::<ServiceKey>(), 12);
        assert_eq!(offset_of!(ServiceKey, addr), 0);
        assert_eq!(offset_of!(ServiceKey, port), 4);
        assert_eq!(offset_of!(ServiceKey, proto), 6);
        assert_eq!(offset_of!(ServiceKey, scope), 7);
        assert_eq!(offset_of!(ServiceKey, slot), 8);
        assert_eq!(offset_of!(ServiceKey, _pad1), 10);
    }

    #[test]
    fn ipv6_layouts() {
        assert_eq!(size_of::<ServiceKey6>(), 24);
        assert_eq!(offset_of!(ServiceKey6, port), 16);
        assert_eq!(offset_of!(ServiceKey6, proto), 18);
        assert_eq!(offset_of!(ServiceKey6, slot), 20);
        assert_eq!(size_of::<BackendAddr6>(), 16);
        assert_eq!(size_of::<ConntrackKey6>(), 40);
        assert_eq!(offset_of!(ConntrackKey6, daddr), 16);
        assert_eq!(offset_of!(ConntrackKey6, sport), 32);
        assert_eq!(offset_of!(ConntrackKey6, proto), 36);
        assert_eq!(size_of::<ConntrackValue6>(), 48);
        assert_eq!(offset_of!(ConntrackValue6, nat_addr), 8);
        assert_eq!(offset_of!(ConntrackValue6, nat_port), 24);
        assert_eq!(offset_of!(ConntrackValue6, flags), 26);
        assert_eq!(offset_of!(ConntrackValue6, backend_id), 28);
        assert_eq!(offset_of!(ConntrackValue6, service_id), 32);
        assert_eq!(offset_of!(ConntrackValue6, expected_ack), 36);
        assert_eq!(offset_of!(ConntrackValue6, client_port), 40);
        assert_eq!(offset_of!(ConntrackValue6, _pad2), 44);
        assert_eq!(size_of::<AffinityKey6>(), 20);
        assert_eq!(offset_of!(AffinityKey6, service_id), 16);
        assert_eq!(size_of::<SourceRangeKey6>(), 20);
        assert_eq!(offset_of!(SourceRangeKey6, addr), 4);
        assert_eq!(size_of::<DatapathConfig6>(), 48);
        assert_eq!(size_of::<SockRevNatKey6>(), 32);
        assert_eq!(offset_of!(SockRevNatKey6, addr), 8);
        assert_eq!(offset_of!(SockRevNatKey6, port), 24);
        assert_eq!(size_of::<SockRevNatValue6>(), 20);
        assert_eq!(size_of::<FragmentKey6>(), 40);
        assert_eq!(offset_of!(FragmentKey6, id), 32);
        assert_eq!(offset_of!(FragmentKey6, proto), 36);
        assert_eq!(size_of::<FragmentValue6>(), 36);
        assert_eq!(offset_of!(FragmentValue6, hook), 32);
    }

    #[test]
    fn service_value_layout() {
        assert_eq!(size_of::<ServiceValue>(), 12);
        assert_eq!(offset_of!(ServiceValue, backend_id), 0);
        assert_eq!(offset_of!(ServiceValue, service_id), 4);
        assert_eq!(offset_of!(ServiceValue, count), 8);
        assert_eq!(offset_of!(ServiceValue, flags), 10);
    }

    #[test]
    fn backend_layout() {
        assert_eq!(size_of::<Backend>(), 16);
        assert_eq!(offset_of!(Backend, service_id), 12);
        assert_eq!(offset_of!(Backend, id), 0);
        assert_eq!(offset_of!(Backend, addr), 4);
        assert_eq!(offset_of!(Backend, port), 8);
        assert_eq!(offset_of!(Backend, flags), 10);
        assert_eq!(offset_of!(Backend, _pad0), 11);
    }

    #[test]
    fn conntrack_layout() {
        assert_eq!(size_of::<ConntrackKey>(), 16);
        assert_eq!(offset_of!(ConntrackKey, saddr), 0);
        assert_eq!(offset_of!(ConntrackKey, daddr), 4);
        assert_eq!(offset_of!(ConntrackKey, sport), 8);
        assert_eq!(offset_of!(ConntrackKey, dport), 10);
        assert_eq!(offset_of!(ConntrackKey, proto), 12);
        assert_eq!(offset_of!(ConntrackKey, _pad0), 13);

        assert_eq!(size_of::<ConntrackValue>(), 32);
        assert_eq!(align_of::<ConntrackValue>(), 8);
        assert_eq!(offset_of!(ConntrackValue, last_seen_ns), 0);
        assert_eq!(offset_of!(ConntrackValue, nat_addr), 8);
        assert_eq!(offset_of!(ConntrackValue, nat_port), 12);
        assert_eq!(offset_of!(ConntrackValue, flags), 14);
        assert_eq!(offset_of!(ConntrackValue, _pad0), 15);
        assert_eq!(offset_of!(ConntrackValue, backend_id), 16);
        assert_eq!(offset_of!(ConntrackValue, service_id), 20);
        assert_eq!(offset_of!(ConntrackValue, expected_ack), 24);
        assert_eq!(offset_of!(ConntrackValue, client_port), 28);
        assert_eq!(offset_of!(ConntrackValue, _pad1), 30);
        assert_eq!(size_of::<ServiceStats>(), 24);
    }

    #[test]
    fn affinity_and_source_range_layouts() {
        assert_eq!(size_of::<AffinityKey>(), 8);
        assert_eq!(size_of::<AffinityValue>(), 16);
        assert_eq!(offset_of!(AffinityValue, backend_id), 8);
        assert_eq!(size_of::<SourceRangeKey>(), 8);
        assert_eq!(offset_of!(SourceRangeKey, addr), 4);
        assert_eq!(size_of::<FragmentKey>(), 12);
        assert_eq!(offset_of!(FragmentKey, id), 8);
        assert_eq!(size_of::<FragmentValue>(), 12);
        assert_eq!(offset_of!(FragmentValue, hook), 8);
        assert_eq!(size_of::<SockRevNatKey>(), 16);
        assert_eq!(offset_of!(SockRevNatKey, port), 12);
        assert_eq!(size_of::<SockRevNatValue>(), 8);
        assert_eq!(size_of::<SockAffinityKey>(), 16);
        assert_eq!(size_of::<SockLbValue>(), 8);
    }

    #[test]
    fn config_layout() {
        assert_eq!(size_of::<DatapathConfig>(), 64);
        assert_eq!(offset_of!(DatapathConfig, maglev_table_size), 56);
        assert_eq!(offset_of!(DatapathConfig, cluster_cidr_mask), 52);
        assert_eq!(offset_of!(DatapathConfig, udp_stream_timeout_ns), 32);
        assert_eq!(offset_of!(DatapathConfig, layout_version), 40);
        assert_eq!(offset_of!(DatapathConfig, masquerade_addr), 44);
        assert_eq!(offset_of!(DatapathConfig, pods_by_interface), 60);
    }

    #[test]
    fn reversed_tuple_swaps_ends() {
        let k = ConntrackKey::new(1, 2, 3, 4, IPPROTO_UDP);
        let r = k.reversed();
        assert_eq!(
            (r.saddr, r.daddr, r.sport, r.dport, r.proto),
            (2, 1, 4, 3, IPPROTO_UDP)
        );
        assert_eq!(r.reversed(), k);
    }

    #[test]
    fn timeouts_follow_flow_state() {
        let c = DatapathConfig::DEFAULT;
        assert_eq!(c.timeout_ns(IPPROTO_TCP, 0), c.tcp_syn_timeout_ns);
        assert_eq!(
            c.timeout_ns(IPPROTO_TCP, CT_FLAG_SEEN_REPLY),
            c.tcp_established_timeout_ns
        );
        assert_eq!(
            c.timeout_ns(IPPROTO_TCP, CT_FLAG_SEEN_REPLY | CT_FLAG_CLOSING),
            c.tcp_closing_timeout_ns
        );
        assert_eq!(c.timeout_ns(IPPROTO_UDP, 0), c.udp_timeout_ns);
        assert_eq!(
            c.timeout_ns(IPPROTO_UDP, CT_FLAG_SEEN_REPLY),
            c.udp_stream_timeout_ns
        );
    }

    #[test]
    fn stat_indexes_are_dense() {
        for (i, s) in Stat::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i);
        }
    }
}
