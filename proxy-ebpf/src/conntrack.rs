//! Conntrack entries of both families, handled once: creation and removal (counted, so LRU
//! evictions are derived over both maps), the per-packet state update, and the clash rule
//! for a new non-service flow that reuses an old service flow's reply tuple.
//!
//! The IPv4 and IPv6 maps differ only in their address type; [`Family`] names the map, the
//! key constructor and the fields these functions read, and each function is written once.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    maps::LruHashMap,
};
use proxy_common::{
    ConntrackKey, ConntrackKey6, ConntrackValue, ConntrackValue6, Stat, CT_FLAG_CLOSING,
    CT_FLAG_COUNTED, CT_FLAG_REPLY, IPPROTO_TCP,
};

use crate::{
    bump, count_connection, ipv6::CONNTRACK6, CONNTRACK, REFRESH_NS, TCP_ACK, TCP_FIN, TCP_RST,
    TCP_SYN,
};

/// What the shared functions read and write in a conntrack value of either family.
pub(crate) trait Entry {
    type Addr: Copy;
    fn flags(&self) -> u8;
    fn set_flags(&mut self, flags: u8);
    fn backend_id(&self) -> u32;
    fn last_seen_ns(&self) -> u64;
    fn set_last_seen_ns(&mut self, now: u64);
    fn nat(&self) -> (Self::Addr, u16);
}

/// One address family's conntrack map and key.
pub(crate) trait Family {
    type Addr: Copy;
    type Key: Copy + 'static;
    type Value: Entry<Addr = Self::Addr> + 'static;
    fn map() -> &'static LruHashMap<Self::Key, Self::Value>;
    fn key(saddr: Self::Addr, daddr: Self::Addr, sport: u16, dport: u16, proto: u8) -> Self::Key;
    fn reversed(key: &Self::Key) -> Self::Key;
    /// Source address, source port and protocol of a key.
    fn source(key: &Self::Key) -> (Self::Addr, u16, u8);
}

macro_rules! entry {
    ($value:ty, $addr:ty) => {
        impl Entry for $value {
            type Addr = $addr;
            #[inline(always)]
            fn flags(&self) -> u8 {
                self.flags
            }
            #[inline(always)]
            fn set_flags(&mut self, flags: u8) {
                self.flags = flags;
            }
            #[inline(always)]
            fn backend_id(&self) -> u32 {
                self.backend_id
            }
            #[inline(always)]
            fn last_seen_ns(&self) -> u64 {
                self.last_seen_ns
            }
            #[inline(always)]
            fn set_last_seen_ns(&mut self, now: u64) {
                self.last_seen_ns = now;
            }
            #[inline(always)]
            fn nat(&self) -> ($addr, u16) {
                (self.nat_addr, self.nat_port)
            }
        }
    };
}
entry!(ConntrackValue, u32);
entry!(ConntrackValue6, [u8; 16]);

macro_rules! family {
    ($family:ident, $map:ident, $key:ty, $value:ty, $addr:ty) => {
        pub(crate) struct $family;
        impl Family for $family {
            type Addr = $addr;
            type Key = $key;
            type Value = $value;
            #[inline(always)]
            fn map() -> &'static LruHashMap<$key, $value> {
                &$map
            }
            #[inline(always)]
            fn key(saddr: $addr, daddr: $addr, sport: u16, dport: u16, proto: u8) -> $key {
                <$key>::new(saddr, daddr, sport, dport, proto)
            }
            #[inline(always)]
            fn reversed(key: &$key) -> $key {
                key.reversed()
            }
            #[inline(always)]
            fn source(key: &$key) -> ($addr, u16, u8) {
                (key.saddr, key.sport, key.proto)
            }
        }
    };
}
family!(V4, CONNTRACK, ConntrackKey, ConntrackValue, u32);
family!(V6, CONNTRACK6, ConntrackKey6, ConntrackValue6, [u8; 16]);

/// Removes a conntrack entry, counting it when it was there.
#[inline(always)]
pub(crate) fn forget<K, V>(map: &LruHashMap<K, V>, key: &K) {
    if map.remove(key).is_ok() {
        bump(Stat::ConntrackRemoved);
    }
}

/// Stores a conntrack entry; counts it as created when the key was new. Returns false when
/// the map refused it.
#[inline(always)]
pub(crate) fn track<K, V>(map: &LruHashMap<K, V>, key: &K, value: &V) -> bool {
    if map.insert(key, value, BPF_NOEXIST as u64).is_ok() {
        bump(Stat::ConntrackCreated);
        return true;
    }
    // Present already (another CPU raced us, or a clashing reply entry): replace it.
    map.insert(key, value, BPF_ANY as u64).is_ok()
}

/// Updates an entry's state for a packet with `tcp_flags`; refreshes its timestamp at most
/// once per `REFRESH_NS` so established flows do not dirty a shared cache line per packet.
#[inline(always)]
pub(crate) fn touch<E: Entry>(ct: &mut E, tcp_flags: u8, now: u64, extra_flags: u8) {
    let mut flags = ct.flags() | extra_flags;
    if tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        flags |= CT_FLAG_CLOSING;
        // A closing connection is no longer active for the least-connection schedulers.
        if flags & CT_FLAG_COUNTED != 0 {
            count_connection(ct.backend_id(), u64::MAX);
            flags &= !CT_FLAG_COUNTED;
        }
    }
    if flags != ct.flags() {
        ct.set_flags(flags);
    }
    if now.wrapping_sub(ct.last_seen_ns()) > REFRESH_NS {
        ct.set_last_seen_ns(now);
    }
}

/// A new flow that is not for a service (a pod talking to another pod directly) may have
/// the same reply tuple as an earlier flow through a service: same client port, and the
/// backend the service flow went to. The earlier flow's reply entry would then rewrite this
/// flow's replies to the service address and break it. As netfilter lets a new connection
/// replace a closed one with a clashing tuple, the new flow wins: the old entries go.
/// Checked on TCP SYNs and on UDP (which has no handshake), so established non-service
/// traffic pays nothing.
#[inline(always)]
pub(crate) fn forget_clashing_flow<F: Family>(key: &F::Key, tcp_flags: u8) {
    let (saddr, sport, proto) = F::source(key);
    let opens = match proto {
        IPPROTO_TCP => tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN,
        _ => true,
    };
    if !opens {
        return;
    }
    let reply = F::reversed(key);
    // SAFETY: the value is copied out before the map is written.
    let Some(ct) = (unsafe { F::map().get(&reply) }) else {
        return;
    };
    if ct.flags() & CT_FLAG_REPLY == 0 {
        return;
    }
    let (nat_addr, nat_port) = ct.nat();
    let original = F::key(saddr, nat_addr, sport, nat_port, proto);
    forget(F::map(), &original);
    forget(F::map(), &reply);
    bump(Stat::ClashResolved);
}
