//! Conntrack entries of both families, handled once: creation and removal (counted, so LRU
//! evictions are derived over both maps), the per-packet state update, confirmation, and the
//! clash rule for a new non-service flow that reuses an old service flow's reply tuple.
//!
//! Two tables per family. A new flow's entries go to `CT_NEW`; they move to `CONNTRACK` when
//! the flow is confirmed: its client sends again after the backend replied (for TCP, the last
//! ACK of the handshake), as netfilter's ASSURED. A spoofed source never sees the reply, so a
//! flood of spoofed SYN, ACK or UDP packets churns `CT_NEW` only and the LRU of `CONNTRACK`
//! holds confirmed flows alone: a flood cannot evict them. A spoofer that sends the SYN and
//! then a blind ACK does not confirm either: the ACK must acknowledge the backend's SYN-ACK,
//! which went to the spoofed address. (A TCP segment without SYN that
//! matches nothing creates no entry at all; the caller checks that.)
//!
//! ```text
//!   first packet ──► CT_NEW (original + reply entry, and the source-NAT pair if any)
//!   backend replies ──► the entries are marked SEEN_REPLY, still in CT_NEW
//!                       (TCP: the SYN-ACK's sequence number + 1 noted on the original entry)
//!   client speaks again ──► all of them move to CONNTRACK (Stat::FlowConfirmed);
//!                           TCP only if it acknowledges that SYN-ACK (else Stat::BlindAck)
//! ```
//!
//! The IPv4 and IPv6 maps differ only in their address type; [`Family`] names the maps, the
//! key constructor and the fields these functions read, and each function is written once.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::bpf_get_prandom_u32,
    maps::LruHashMap,
};
use proxy_common::{
    ConntrackKey, ConntrackKey6, ConntrackValue, ConntrackValue6, Stat, CT_FLAG_CLOSING,
    CT_FLAG_COUNTED, CT_FLAG_REPLY, CT_FLAG_SEEN_REPLY, CT_FLAG_SNAT, IPPROTO_TCP,
};

use crate::{
    bump, count_connection,
    ipv6::{CONNTRACK6, CT_NEW6},
    CONNTRACK, CT_NEW, REFRESH_NS, SNAT_PORT_MIN, SNAT_PORT_SPAN, SNAT_PORT_TRIES, TCP_ACK,
    TCP_FIN, TCP_RST, TCP_SYN,
};

/// Which of a family's two maps holds a flow's entries.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Table {
    /// `CONNTRACK`/`CONNTRACK6`: confirmed flows.
    Confirmed,
    /// `CT_NEW`/`CT_NEW6`: flows whose client has not spoken since a reply.
    New,
}

impl Table {
    #[inline(always)]
    fn created(self) -> Stat {
        match self {
            Table::Confirmed => Stat::ConntrackCreated,
            Table::New => Stat::NewEntryCreated,
        }
    }

    #[inline(always)]
    fn removed(self) -> Stat {
        match self {
            Table::Confirmed => Stat::ConntrackRemoved,
            Table::New => Stat::NewEntryRemoved,
        }
    }
}

/// Whether a new flow may create entries: any UDP datagram, but for TCP only a SYN (without
/// ACK). A segment of an unknown connection is passed untranslated and counted, so spoofed
/// ACKs cost no state; kernel conntrack may still carry such a flow after a mode switch or a
/// map rebuild.
#[inline(always)]
pub(crate) fn may_open(proto: u8, tcp_flags: u8) -> bool {
    proto != IPPROTO_TCP || tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
}

/// What the shared functions read and write in a conntrack value of either family.
pub(crate) trait Entry {
    type Addr: Copy;
    fn flags(&self) -> u8;
    fn set_flags(&mut self, flags: u8);
    fn backend_id(&self) -> u32;
    fn last_seen_ns(&self) -> u64;
    fn set_last_seen_ns(&mut self, now: u64);
    fn nat(&self) -> (Self::Addr, u16);
    fn expected_ack(&self) -> u32;
    fn set_expected_ack(&mut self, ack: u32);
    /// `client_port`: the translated source port of a flow whose tuple clashed (original
    /// entry) or the client's own (reply entry); 0 when not translated.
    fn client_port(&self) -> u16;
    /// [`Entry::client_port`], or `port` (the packet's) where the flow's port is not
    /// translated.
    #[inline(always)]
    fn client_port_or(&self, port: u16) -> u16 {
        match self.client_port() {
            0 => port,
            translated => translated,
        }
    }
}

/// One address family's conntrack map and key.
pub(crate) trait Family {
    type Addr: Copy;
    type Key: Copy + PartialEq + 'static;
    type Value: Entry<Addr = Self::Addr> + Copy + 'static;
    fn map() -> &'static LruHashMap<Self::Key, Self::Value>;
    fn new_map() -> &'static LruHashMap<Self::Key, Self::Value>;
    fn key(saddr: Self::Addr, daddr: Self::Addr, sport: u16, dport: u16, proto: u8) -> Self::Key;
    fn reversed(key: &Self::Key) -> Self::Key;
    /// Source address, source port and protocol of a key.
    fn source(key: &Self::Key) -> (Self::Addr, u16, u8);
    /// Sets a key's destination port.
    fn set_dport(key: &mut Self::Key, port: u16);
    /// Whether an entry's NAT address and port are `addr` and `port` (compared in words:
    /// LLVM's BPF backend cannot lower a 16-byte array comparison everywhere).
    fn nat_is(value: &Self::Value, addr: &Self::Addr, port: u16) -> bool;
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
            #[inline(always)]
            fn expected_ack(&self) -> u32 {
                self.expected_ack
            }
            #[inline(always)]
            fn set_expected_ack(&mut self, ack: u32) {
                self.expected_ack = ack;
            }
            #[inline(always)]
            fn client_port(&self) -> u16 {
                self.client_port
            }
        }
    };
}
entry!(ConntrackValue, u32);
entry!(ConntrackValue6, [u8; 16]);

macro_rules! family {
    ($family:ident, $map:ident, $new_map:ident, $key:ty, $value:ty, $addr:ty) => {
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
            fn new_map() -> &'static LruHashMap<$key, $value> {
                &$new_map
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
            #[inline(always)]
            fn set_dport(key: &mut $key, port: u16) {
                key.dport = port;
            }
            #[inline(always)]
            fn nat_is(value: &$value, addr: &$addr, port: u16) -> bool {
                value.nat_port == port && same_addr(&value.nat_addr, addr)
            }
        }
    };
}
#[inline(always)]
fn same_addr<A: Words>(a: &A, b: &A) -> bool {
    a.words() == b.words()
}

/// An address as 64-bit words.
trait Words {
    fn words(&self) -> (u64, u64);
}

impl Words for u32 {
    #[inline(always)]
    fn words(&self) -> (u64, u64) {
        (u64::from(*self), 0)
    }
}

impl Words for [u8; 16] {
    #[inline(always)]
    fn words(&self) -> (u64, u64) {
        let mut hi = [0u8; 8];
        let mut lo = [0u8; 8];
        hi.copy_from_slice(&self[..8]);
        lo.copy_from_slice(&self[8..]);
        (u64::from_ne_bytes(hi), u64::from_ne_bytes(lo))
    }
}

family!(V4, CONNTRACK, CT_NEW, ConntrackKey, ConntrackValue, u32);
family!(
    V6,
    CONNTRACK6,
    CT_NEW6,
    ConntrackKey6,
    ConntrackValue6,
    [u8; 16]
);

#[inline(always)]
fn table_map<F: Family>(table: Table) -> &'static LruHashMap<F::Key, F::Value> {
    match table {
        Table::Confirmed => F::map(),
        Table::New => F::new_map(),
    }
}

/// A flow's entry and the table it is in: confirmed flows first, as nearly every packet
/// belongs to one.
#[inline(always)]
pub(crate) fn lookup<F: Family>(key: &F::Key) -> Option<(*mut F::Value, Table)> {
    if let Some(ct) = F::map().get_ptr_mut(key) {
        return Some((ct, Table::Confirmed));
    }
    F::new_map().get_ptr_mut(key).map(|ct| (ct, Table::New))
}

/// Whether `reply`, the reply key a new flow `this` would take, belongs to another open TCP
/// connection: the same client address and port sent to another frontend whose backend is
/// the same address and port (a client's ephemeral port is unique per destination only,
/// so two Services sharing a pod can bring this about). Both would then be one 4-tuple at
/// the backend, and the reply entry one key: the caller gives the new flow another source
/// port ([`clash_free_port`]), as netfilter resolves a NAT clash, so the open connection
/// is not broken.
///
/// Otherwise the new flow takes the key over: the other connection is closing (a client
/// reuses a port as soon as its own TIME_WAIT allows), expired, re-balanced to another
/// backend, gone (a stale reply entry), or UDP, whose newest exchange is the one waiting
/// for an answer. The other flow's original entry then goes too, so that none of its late
/// segments, nor its reconnection, removes the reply entry that is now the new flow's.
#[inline(always)]
pub(crate) fn reply_taken<F: Family>(reply: &F::Key, this: &F::Key, now: u64) -> bool {
    let Some((entry, table)) = lookup::<F>(reply) else {
        return false;
    };
    // SAFETY: a map value, read before any write to the maps.
    let entry_ref = unsafe { &*entry };
    let (frontend, frontend_port) = entry_ref.nat();
    let (client, client_port, proto) = F::source(this);
    // The other flow may itself have had its source port translated: its original entry
    // is under the client's own port.
    let client_port = entry_ref.client_port_or(client_port);
    let other = F::key(client, frontend, client_port, frontend_port, proto);
    if other != *this {
        if let Some((open, other_table)) = lookup::<F>(&other) {
            // SAFETY: as above; every field is read before the maps are written.
            let open = unsafe { &*open };
            let (backend, backend_port, _) = F::source(reply);
            let same_backend = F::nat_is(open, &backend, backend_port);
            let timeout = crate::flow_timeout_ns(proto, open.flags()) + REFRESH_NS;
            let live = now.wrapping_sub(open.last_seen_ns()) <= timeout;
            if proto == IPPROTO_TCP && open.flags() & CT_FLAG_CLOSING == 0 && same_backend && live {
                bump(Stat::TupleClash);
                return true;
            }
            if same_backend {
                if open.flags() & CT_FLAG_COUNTED != 0 {
                    count_connection(open.backend_id(), u64::MAX);
                }
                forget::<F>(other_table, &other);
            }
        }
    }
    forget::<F>(table, reply);
    false
}

/// A source port (network byte order) for a new flow whose reply key `reply` clashed
/// ([`reply_taken`]): a random one of the upper half of the port range (where the source
/// NAT looks) whose reply key is in neither table, in a few tries. `reply` is changed in
/// place to that port's (no copy: the caller's frame is near BPF's stack limit). 0: none
/// found (the caller refuses the flow).
#[inline(always)]
pub(crate) fn clash_free_port<F: Family>(reply: &mut F::Key) -> u16 {
    let mut tries = 0;
    while tries < SNAT_PORT_TRIES {
        // SAFETY: a helper without arguments.
        let random = unsafe { bpf_get_prandom_u32() };
        let port = ((random % SNAT_PORT_SPAN) as u16 + SNAT_PORT_MIN).to_be();
        F::set_dport(reply, port);
        if !in_use::<F>(reply) {
            return port;
        }
        tries += 1;
    }
    0
}

/// Removes the reply entry of a flow to `frontend`, unless a newer flow has taken its key
/// over ([`reply_taken`]).
#[inline(always)]
pub(crate) fn forget_reply<F: Family>(reply: &F::Key, frontend: F::Addr, frontend_port: u16) {
    if let Some((entry, table)) = lookup::<F>(reply) {
        // SAFETY: a map value, read before the delete.
        if F::nat_is(unsafe { &*entry }, &frontend, frontend_port) {
            forget::<F>(table, reply);
        }
    }
}

/// An entry in a given table.
#[inline(always)]
pub(crate) fn get_in<F: Family>(table: Table, key: &F::Key) -> Option<*mut F::Value> {
    table_map::<F>(table).get_ptr_mut(key)
}

/// Whether either table has an entry for `key`.
#[inline(always)]
pub(crate) fn in_use<F: Family>(key: &F::Key) -> bool {
    // SAFETY: only presence is read.
    unsafe { F::map().get(key).is_some() || F::new_map().get(key).is_some() }
}

/// Removes a conntrack entry, counting it when it was there.
#[inline(always)]
pub(crate) fn forget<F: Family>(table: Table, key: &F::Key) {
    if table_map::<F>(table).remove(key).is_ok() {
        bump(table.removed());
    }
}

/// Stores a conntrack entry; counts it as created when the key was new. Returns false when
/// the map refused it.
#[inline(always)]
pub(crate) fn track<F: Family>(table: Table, key: &F::Key, value: &F::Value) -> bool {
    let map = table_map::<F>(table);
    if map.insert(key, value, BPF_NOEXIST as u64).is_ok() {
        bump(table.created());
        return true;
    }
    // Present already (another CPU raced us, or a clashing reply entry): replace it.
    map.insert(key, value, BPF_ANY as u64).is_ok()
}

/// Moves one entry from `CT_NEW` to `CONNTRACK`, if it is there.
#[inline(always)]
fn promote<F: Family>(key: &F::Key) -> Option<F::Value> {
    // SAFETY: the value is copied out before the maps are written.
    let value = *unsafe { F::new_map().get(key) }?;
    if !track::<F>(Table::Confirmed, key, &value) {
        bump(Stat::ConntrackInsertFailed);
    }
    forget::<F>(Table::New, key);
    Some(value)
}

/// Confirms a flow whose client spoke after a reply: its original entry (`key`, whose
/// current value is `original`), its reply entry and, for a masqueraded flow, its source-NAT
/// pair move from `CT_NEW` to `CONNTRACK`. `to_backend` is the flow as it leaves after DNAT
/// (client to backend), the key of its source-NAT entry.
#[inline(always)]
pub(crate) fn confirm<F: Family>(
    key: &F::Key,
    original: &F::Value,
    reply: &F::Key,
    to_backend: &F::Key,
) {
    // A copy: `original` may point into CT_NEW, whose entry goes below (an LRU map hands a
    // freed element to another CPU's insert at once).
    let original = *original;
    if !track::<F>(Table::Confirmed, key, &original) {
        bump(Stat::ConntrackInsertFailed);
    }
    forget::<F>(Table::New, key);
    promote::<F>(reply);
    // SAFETY: the value is copied out before the maps are written.
    let Some(snat) = (unsafe { F::new_map().get(to_backend) }).copied() else {
        bump(Stat::FlowConfirmed);
        return;
    };
    if snat.flags() & CT_FLAG_SNAT != 0 {
        promote::<F>(to_backend);
        // The backend's replies come to the masquerade address and port.
        let (_, _, proto) = F::source(to_backend);
        let (masq, masq_port) = snat.nat();
        let (backend, backend_port) = original.nat();
        promote::<F>(&F::key(backend, masq, backend_port, masq_port, proto));
    }
    bump(Stat::FlowConfirmed);
}

/// Whether a packet in the original direction confirms a flow: the backend has replied, the
/// entry is still in `CT_NEW`, and for TCP the segment acknowledges the backend's SYN-ACK
/// (`ack`: its acknowledgment number, read only then), which a spoofed source never saw.
#[inline(always)]
pub(crate) fn confirms<E: Entry>(
    table: Table,
    ct: &E,
    proto: u8,
    tcp_flags: u8,
    ack: impl FnOnce() -> Option<u32>,
) -> bool {
    if table != Table::New || ct.flags() & CT_FLAG_SEEN_REPLY == 0 {
        return false;
    }
    // UDP has nothing to check (netfilter's ASSURED is no different).
    if proto != IPPROTO_TCP {
        return true;
    }
    // Only an acknowledgment confirms (a retransmitted SYN or a reset does not, and is no
    // sign of a blind sender either).
    if tcp_flags & (TCP_ACK | TCP_RST) != TCP_ACK {
        return false;
    }
    let expected = ct.expected_ack();
    if expected == ACK_ANY {
        return true;
    }
    let acknowledged =
        expected != 0 && ack().is_some_and(|ack| ack.wrapping_sub(expected) < ACK_WINDOW);
    if !acknowledged {
        bump(Stat::BlindAck);
    }
    acknowledged
}

/// The `expected_ack` a new flow's original entry starts with: 0 (to be noted from the
/// SYN-ACK) for a SYN, [`ACK_ANY`] for a TCP flow taken up mid-stream.
#[inline(always)]
pub(crate) fn initial_expected_ack(proto: u8, tcp_flags: u8) -> u32 {
    if proto == IPPROTO_TCP && tcp_flags & TCP_SYN == 0 {
        ACK_ANY
    } else {
        0
    }
}

/// `expected_ack` of a TCP flow that began mid-stream (its entry had gone, the client is
/// real): there is no handshake to check, so any acknowledgment after a reply confirms.
pub(crate) const ACK_ANY: u32 = u32::MAX;

/// How far past the SYN-ACK a confirming acknowledgment may be: the backend may have sent
/// data already (TCP Fast Open), and a blind guess succeeds once in 65 536.
const ACK_WINDOW: u32 = 1 << 16;

/// At a SYN-ACK while the flow is unconfirmed: its sequence number + 1 is what the client's
/// next segment acknowledges, recorded on the original entry for [`confirms`] (the latest
/// SYN-ACK's, should the backend have answered more than once).
#[inline(always)]
pub(crate) fn note_reply<E: Entry>(
    original: &mut E,
    tcp_flags: u8,
    seq: impl FnOnce() -> Option<u32>,
) {
    if tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK && original.expected_ack() != ACK_ANY {
        if let Some(expected) = seq().map(|seq| seq.wrapping_add(1)) {
            // ACK_ANY and 0 mean something else; such an ISN (2 in 2^32) checks nothing.
            if expected != ACK_ANY {
                original.set_expected_ack(expected);
            }
        }
    }
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
    if !may_open(proto, tcp_flags) {
        return;
    }
    let reply = F::reversed(key);
    if !forget_clash_in::<F>(Table::Confirmed, &reply, saddr, sport, proto) {
        forget_clash_in::<F>(Table::New, &reply, saddr, sport, proto);
    }
}

/// [`forget_clashing_flow`] in one table; true when it found the clash.
#[inline(always)]
fn forget_clash_in<F: Family>(
    table: Table,
    reply: &F::Key,
    saddr: F::Addr,
    sport: u16,
    proto: u8,
) -> bool {
    // Copied out, not held as a pointer: with a map value pointer live here, LLVM shared
    // its register with a 32-bit value of another path and the verifier refused the spill.
    // SAFETY: the value is copied before the map is written.
    let Some(ct) = (unsafe { table_map::<F>(table).get(reply) }).copied() else {
        return false;
    };
    if ct.flags() & CT_FLAG_REPLY == 0 {
        return false;
    }
    let (nat_addr, nat_port) = ct.nat();
    // A flow whose source port was translated has its original entry under the client's
    // own port.
    let original = F::key(saddr, nat_addr, ct.client_port_or(sport), nat_port, proto);
    forget::<F>(table, &original);
    forget::<F>(table, reply);
    bump(Stat::ClashResolved);
    true
}
