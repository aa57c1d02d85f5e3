//! New flows as they are decided, for `proxy-agent inspect flows --follow`: the datapath
//! writes one [`FlowEvent`] per decision into the `FLOW_EVENTS` ring buffer, but only while
//! a listener says it is there.
//!
//! | step | cost while no one listens |
//! |---|---|
//! | [`followed`]: `FLOW_LISTENER[0].until_ns != 0` | one array lookup the verifier inlines, on new flows only (never on a tracked flow's packets) |
//! | [`tell4`] / [`tell6`]: the listener's deadline, this CPU's rate, reserve, fill, submit | none: not reached |
//!
//! A listener writes its deadline (`bpf_ktime_get_ns` clock, a few seconds ahead) and
//! renews it every second; one that dies without clearing it costs a clock read per new
//! flow until someone clears it. Each CPU sends at most the listener's `max_per_second`
//! events per second; the rest are counted in `FLOW_RATE` (`limited`), as are events lost
//! to a full ring (`lost`), so the listener can say how many it did not see.

use core::ptr::addr_of_mut;

use aya_ebpf::{
    helpers::bpf_ktime_get_ns,
    macros::map,
    maps::{Array, PerCpuArray, RingBuf},
};
use proxy_common::{
    ConntrackKey, ConntrackKey6, FlowEvent, FlowListener, FlowRate, BACKEND_FLAG_IPV6,
    BACKEND_INDEX_MASK, FLOW_EVENTS_BYTES,
};

use crate::{ipv6::BACKEND_ADDRS6, BACKENDS};

#[map]
static FLOW_EVENTS: RingBuf = RingBuf::with_byte_size(FLOW_EVENTS_BYTES, 0);

#[map]
static FLOW_LISTENER: Array<FlowListener> = Array::with_max_entries(1, 0);

#[map]
static FLOW_RATE: PerCpuArray<FlowRate> = PerCpuArray::with_max_entries(1, 0);

/// Whether someone may be following new flows: the only test on the new-flow paths.
#[inline(always)]
pub fn followed() -> bool {
    matches!(FLOW_LISTENER.get(0), Some(l) if l.until_ns != 0)
}

/// `how` for [`tell4`] and [`tell6`]: a `FLOW_VERDICT_*` and a `FLOW_PATH_*`.
#[inline(always)]
pub const fn how(verdict: u8, path: u8) -> u32 {
    verdict as u32 | (path as u32) << 8
}

/// An IPv4 flow (`key`: client, frontend, protocol; a socket's client is 0.0.0.0:0) of
/// frontend `service_id` given `backend_id` (0: none) as `how` says. Everything is
/// written straight into the reserved record: this function's frame adds to the new-flow
/// program's, which is near the 512-byte limit (see the `stack_budget` test).
#[inline(never)]
pub fn tell4(key: &ConntrackKey, service_id: u32, backend_id: u32, how: u32) {
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(mut entry) = slot(now) else {
        return;
    };
    let e = entry.as_mut_ptr();
    // SAFETY: `e` is the reserved, FlowEvent-sized record; every field is written before
    // it is submitted.
    unsafe {
        put_mapped(addr_of_mut!((*e).client), key.saddr);
        put_mapped(addr_of_mut!((*e).frontend), key.daddr);
        (*e).client_port = key.sport;
        (*e).frontend_port = key.dport;
        (*e).proto = key.proto;
        finish(e, now, service_id, backend_id, how);
    }
    entry.submit(0);
}

/// As [`tell4`], for an IPv6 flow (an IPv4 service named by a dual-stack socket comes as
/// its IPv4-mapped address).
#[inline(never)]
pub fn tell6(key: &ConntrackKey6, service_id: u32, backend_id: u32, how: u32) {
    // SAFETY: as in tell4.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(mut entry) = slot(now) else {
        return;
    };
    let e = entry.as_mut_ptr();
    // SAFETY: as in tell4.
    unsafe {
        put(addr_of_mut!((*e).client), &key.saddr);
        put(addr_of_mut!((*e).frontend), &key.daddr);
        (*e).client_port = key.sport;
        (*e).frontend_port = key.dport;
        (*e).proto = key.proto;
        finish(e, now, service_id, backend_id, how);
    }
    entry.submit(0);
}

/// The fields both families fill alike: time, verdict, path, and the backend (its address,
/// port and, where the hook did not know it, service id) read from the maps by id.
#[inline(always)]
unsafe fn finish(e: *mut FlowEvent, now: u64, service_id: u32, backend_id: u32, how: u32) {
    (*e).time_ns = now;
    (*e).verdict = how as u8;
    (*e).path = (how >> 8) as u8;
    (*e)._pad0 = 0;
    (*e)._pad1 = 0;
    (*e)._pad2 = 0;
    (*e).service_id = service_id;
    (*e).backend_id = backend_id;
    (*e).backend_port = 0;
    put_zero(addr_of_mut!((*e).backend));
    let index = backend_id & BACKEND_INDEX_MASK;
    let Some(b) = BACKENDS.get(index) else {
        return;
    };
    if backend_id == 0 || b.id != backend_id {
        return;
    }
    (*e).backend_port = b.port;
    if service_id == 0 {
        (*e).service_id = b.service_id;
    }
    if b.flags & BACKEND_FLAG_IPV6 == 0 {
        put_mapped(addr_of_mut!((*e).backend), b.addr);
    } else if let Some(a) = BACKEND_ADDRS6.get(index) {
        put(addr_of_mut!((*e).backend), &a.addr);
    }
}

// The address fields sit at 8-byte offsets of the record (see `FlowEvent`), so they are
// written as four aligned words: no temporary, no memset or memcpy call.

/// `::ffff:a.b.c.d` for an IPv4 address in network byte order.
#[inline(always)]
unsafe fn put_mapped(to: *mut [u8; 16], addr: u32) {
    let w = to.cast::<u32>();
    w.write(0);
    w.add(1).write(0);
    w.add(2).write(u32::from_ne_bytes([0, 0, 0xff, 0xff]));
    w.add(3).write(addr);
}

/// Volatile: four plain zero stores become a call to `memset`, a subprogram whose frame
/// counts against the stack budget before 6.6.
#[inline(always)]
unsafe fn put_zero(to: *mut [u8; 16]) {
    let w = to.cast::<u32>();
    w.write_volatile(0);
    w.add(1).write_volatile(0);
    w.add(2).write_volatile(0);
    w.add(3).write_volatile(0);
}

#[inline(always)]
unsafe fn put(to: *mut [u8; 16], from: &[u8; 16]) {
    let (w, f) = (to.cast::<u32>(), from.as_ptr().cast::<u32>());
    w.write(f.read_unaligned());
    w.add(1).write(f.add(1).read_unaligned());
    w.add(2).write(f.add(2).read_unaligned());
    w.add(3).write(f.add(3).read_unaligned());
}

/// A record in the ring, if the listener's deadline is ahead and this CPU is within its
/// rate; what is not sent is counted.
#[inline(always)]
fn slot(now: u64) -> Option<aya_ebpf::maps::ring_buf::RingBufEntry<FlowEvent>> {
    let listener = FLOW_LISTENER.get(0)?;
    if listener.until_ns < now {
        return None;
    }
    let max = listener.max_per_second;
    let rate = FLOW_RATE.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot; nothing else runs on this CPU meanwhile.
    let rate = unsafe { &mut *rate };
    if now.wrapping_sub(rate.window_ns) >= 1_000_000_000 {
        rate.window_ns = now;
        rate.sent = 0;
    }
    if rate.sent >= max {
        rate.limited += 1;
        return None;
    }
    match FLOW_EVENTS.reserve::<FlowEvent>(0) {
        Some(entry) => {
            rate.sent += 1;
            Some(entry)
        }
        None => {
            rate.lost += 1;
            None
        }
    }
}
