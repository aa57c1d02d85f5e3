//! Turns "this frontend should have these backends" into the fewest map writes, in an order
//! that never lets the datapath see a broken service:
//!
//! 1. new backends are written to `BACKENDS` before any slot names them;
//! 2. slots `1..=n` are written before the header announces `n`;
//! 3. the header shrinks before the slots beyond it are deleted;
//! 4. a backend id is deleted only after no slot names it.
//!
//! So while backends are replaced, every packet finds a header whose slots all lead to a
//! live backend, and a service with backends before and after never shows zero.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use proxy_common::{
    Backend, BackendAddr6, MaglevKey, ServiceKey, ServiceKey6, ServiceValue, BACKEND_FLAG_IPV6,
    BACKEND_FLAG_REMOTE, BACKEND_INDEX_BITS, BACKEND_INDEX_MASK, MAX_BACKENDS, SCOPE_ALL,
    SCOPE_IN_CLUSTER, SERVICE_FLAG_SOURCE_RANGES, SERVICE_SCHEDULER_MASK, SERVICE_SCHEDULER_SHIFT,
};

use super::maps::{MapError, ServiceMapKey, ServiceMaps};
use crate::model::{Frontend, Protocol};

/// One frontend's set of `SERVICES` entries: the frontend, and which clients the set
/// serves (the key's scope). An `externalTrafficPolicy: Local` frontend has two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target {
    pub addr: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    /// The [`SCOPE_IN_CLUSTER`] set: new flows from this node and its pods.
    pub in_cluster: bool,
}

impl Target {
    pub fn frontend(&self) -> Frontend {
        Frontend {
            addr: self.addr,
            port: self.port,
            protocol: self.protocol,
        }
    }

    /// `frontend`'s set for every client.
    pub fn all(frontend: Frontend) -> Self {
        Self {
            addr: frontend.addr,
            port: frontend.port,
            protocol: frontend.protocol,
            in_cluster: false,
        }
    }

    /// `frontend`'s set for clients on this node.
    pub fn in_cluster(frontend: Frontend) -> Self {
        Self {
            in_cluster: true,
            ..Self::all(frontend)
        }
    }
}

impl From<Frontend> for Target {
    fn from(frontend: Frontend) -> Self {
        Self::all(frontend)
    }
}

impl From<&Frontend> for Target {
    fn from(frontend: &Frontend) -> Self {
        Self::all(*frontend)
    }
}

impl From<&Target> for Target {
    fn from(target: &Target) -> Self {
        *target
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.frontend())?;
        if self.in_cluster {
            write!(f, " (clients on this node)")?;
        }
        Ok(())
    }
}

/// What the agent last wrote for one frontend.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Written {
    service_id: u32,
    header: HeaderSettings,
    /// `loadBalancerSourceRanges` written: (network address, prefix).
    source_ranges: RangeSet,
    /// Slot `i + 1` holds `slots[i]`.
    slots: Vec<(u32, SocketAddr)>,
    /// Backends in `BACKENDS` that no slot names: their established flows go on.
    draining: Vec<(u32, SocketAddr)>,
    /// Cumulative weight written in each slot (weighted schedulers).
    cumulative: Vec<u32>,
    /// The Maglev table written (entry -> slot), empty unless the scheduler is `mh`.
    maglev: Vec<u32>,
}

/// Everything one frontend should lead to.
#[derive(Clone, Copy, Debug)]
pub struct FrontendSpec<'a> {
    /// Endpoints that take new flows.
    pub backends: &'a [SocketAddr],
    /// Endpoints that take no new flows but keep their established ones.
    pub draining: &'a [SocketAddr],
    pub header: HeaderSettings,
    /// Endpoints on other nodes.
    pub remote: &'a BTreeSet<SocketAddr>,
    /// `loadBalancerSourceRanges` (network address, prefix) of the frontend's family.
    pub source_ranges: &'a [(IpAddr, u8)],
    /// Backend weights (absent: 1).
    pub weights: &'a BTreeMap<IpAddr, u16>,
}

impl<'a> FrontendSpec<'a> {
    pub fn new(backends: &'a [SocketAddr]) -> Self {
        static NONE: BTreeSet<SocketAddr> = BTreeSet::new();
        static NO_WEIGHTS: BTreeMap<IpAddr, u16> = BTreeMap::new();
        Self {
            backends,
            draining: &[],
            header: HeaderSettings::default(),
            remote: &NONE,
            source_ranges: &[],
            weights: &NO_WEIGHTS,
        }
    }
}

pub fn service_key(frontend: impl Into<Target>, slot: u16) -> ServiceMapKey {
    let frontend = frontend.into();
    let (port, proto) = (frontend.port.to_be(), frontend.protocol.number());
    let scope = if frontend.in_cluster {
        SCOPE_IN_CLUSTER
    } else {
        SCOPE_ALL
    };
    match frontend.addr {
        IpAddr::V4(a) => ServiceMapKey::V4(ServiceKey::scoped(
            u32::from(a).to_be(),
            port,
            proto,
            scope,
            slot,
        )),
        IpAddr::V6(a) => {
            ServiceMapKey::V6(ServiceKey6::scoped(a.octets(), port, proto, scope, slot))
        }
    }
}

pub(crate) fn frontend_of(key: &ServiceMapKey) -> Option<Target> {
    let (addr, port, proto, scope) = match key {
        ServiceMapKey::V4(k) => (
            IpAddr::V4(Ipv4Addr::from(u32::from_be(k.addr))),
            k.port,
            k.proto,
            k.scope,
        ),
        ServiceMapKey::V6(k) => (IpAddr::V6(Ipv6Addr::from(k.addr)), k.port, k.proto, k.scope),
    };
    Some(Target {
        addr,
        port: u16::from_be(port),
        protocol: Protocol::from_number(proto)?,
        in_cluster: match scope {
            SCOPE_ALL => false,
            SCOPE_IN_CLUSTER => true,
            _ => return None,
        },
    })
}

/// A backend's address as written: IPv6 ones have theirs in `BACKEND_ADDRS6`.
pub(crate) fn backend_addr(
    b: &Backend,
    addrs6: &BTreeMap<u32, BackendAddr6>,
) -> Option<SocketAddr> {
    let ip = if b.flags & BACKEND_FLAG_IPV6 != 0 {
        IpAddr::V6(Ipv6Addr::from(
            addrs6.get(&(b.id & BACKEND_INDEX_MASK))?.addr,
        ))
    } else {
        IpAddr::V4(Ipv4Addr::from(u32::from_be(b.addr)))
    };
    Some(SocketAddr::new(ip, u16::from_be(b.port)))
}

/// The `BACKENDS` entry of a backend, and for an IPv6 one its `BACKEND_ADDRS6` entry.
pub fn backend_value(
    id: u32,
    addr: &SocketAddr,
    remote: bool,
    service_id: u32,
) -> (Backend, Option<BackendAddr6>) {
    let mut flags = if remote { BACKEND_FLAG_REMOTE } else { 0 };
    let (v4, v6) = match addr.ip() {
        IpAddr::V4(a) => (u32::from(a).to_be(), None),
        IpAddr::V6(a) => {
            flags |= BACKEND_FLAG_IPV6;
            (0, Some(BackendAddr6 { addr: a.octets() }))
        }
    };
    (
        Backend::new(id, v4, addr.port().to_be(), flags, service_id),
        v6,
    )
}

/// Backends with their ids, as written in slots or as draining.
type IdList = [(u32, SocketAddr)];
/// Source ranges of a frontend: (network address, prefix).
type RangeSet = BTreeSet<(IpAddr, u8)>;
/// (old, new).
type Change<'a, T> = (&'a T, &'a T);

/// One frontend's old and new state, for [`MapSync::write`].
struct Transition<'a> {
    service_id: u32,
    header: HeaderSettings,
    /// The header must be written even if its count stays.
    header_changed: bool,
    slots: Change<'a, IdList>,
    draining: Change<'a, IdList>,
    remote: &'a BTreeSet<SocketAddr>,
    ranges: Change<'a, RangeSet>,
    cumulative: Change<'a, [u32]>,
    maglev: Change<'a, [u32]>,
}

/// What a frontend's header carries besides its count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeaderSettings {
    /// `SERVICE_FLAG_*` (`SERVICE_FLAG_SOURCE_RANGES` is set from the ranges given).
    pub flags: u16,
    /// `sessionAffinity: ClientIP` timeout in seconds; 0: no affinity.
    pub affinity_timeout: u32,
}

/// Hands out slots of an array map: next-fit, so a freed slot is the last to be taken again.
///
/// Backend ids are *tagged*: the slot combined with a per-slot generation that changes on
/// every reuse, so a conntrack entry that still names an old id can never follow it to
/// whatever backend takes the slot later. Service ids are plain slots of `SERVICE_STATS`
/// (the datapath indexes that array with them directly).
#[derive(Debug)]
struct SlotIds {
    map: &'static str,
    tagged: bool,
    /// Generation last handed out per slot; slot 0 is never used, so no id is 0.
    generations: Vec<u8>,
    in_use: Vec<bool>,
    free: u32,
    next: u32,
}

impl SlotIds {
    fn new(map: &'static str, slots: u32, tagged: bool) -> Self {
        let slots = slots.clamp(2, MAX_BACKENDS);
        Self {
            map,
            tagged,
            generations: vec![0; if tagged { slots as usize } else { 0 }],
            in_use: vec![false; slots as usize],
            free: slots - 1,
            next: 0,
        }
    }

    fn index(&self, id: u32) -> usize {
        (if self.tagged {
            id & BACKEND_INDEX_MASK
        } else {
            id
        }) as usize
    }

    fn allocate(&mut self) -> Result<u32, MapError> {
        let slots = self.in_use.len() as u32;
        if self.free == 0 {
            return Err(MapError::Full {
                map: self.map,
                capacity: slots - 1,
            });
        }
        loop {
            self.next = if self.next + 1 >= slots {
                1
            } else {
                self.next + 1
            };
            let i = self.next as usize;
            if !self.in_use[i] {
                self.in_use[i] = true;
                self.free -= 1;
                if !self.tagged {
                    return Ok(self.next);
                }
                self.generations[i] = self.generations[i].wrapping_add(1);
                return Ok(self.next | (self.generations[i] as u32) << BACKEND_INDEX_BITS);
            }
        }
    }

    /// Records an id found in adopted maps as in use.
    fn mark_used(&mut self, id: u32) -> bool {
        let i = self.index(id);
        if i == 0 || i >= self.in_use.len() || self.in_use[i] {
            return false;
        }
        self.in_use[i] = true;
        self.free -= 1;
        if self.tagged {
            self.generations[i] = (id >> BACKEND_INDEX_BITS) as u8;
        }
        true
    }

    /// Records the id a free slot held last (found in adopted maps), so the slot's next id
    /// has a newer generation.
    fn retired(&mut self, id: u32) {
        let i = self.index(id);
        if self.tagged && i != 0 && i < self.in_use.len() && !self.in_use[i] {
            self.generations[i] = (id >> BACKEND_INDEX_BITS) as u8;
        }
    }

    fn release(&mut self, id: u32) {
        let i = self.index(id);
        if i < self.in_use.len() && self.in_use[i] {
            self.in_use[i] = false;
            self.free += 1;
        }
    }
}

pub struct MapSync<M: ServiceMaps> {
    maps: M,
    written: HashMap<Target, Written>,
    /// `SERVICES` (index 0) and `SERVICES6` (1) entries `written` accounts for: a header
    /// and a slot per backend each. Kept with `written` by `take_written`/`put_written`.
    service_entries: [usize; 2],
    backend_ids: SlotIds,
    service_ids: SlotIds,
    maglev_size: u32,
}

impl<M: ServiceMaps> MapSync<M> {
    pub fn new(maps: M) -> Self {
        Self {
            backend_ids: SlotIds::new("BACKENDS", maps.backend_slots(), true),
            service_ids: SlotIds::new("SERVICE_STATS", maps.service_slots(), false),
            maps,
            written: HashMap::new(),
            service_entries: [0; 2],
            maglev_size: 0,
        }
    }

    /// Entries of each Maglev table (a prime; 0: `mh` frontends fall back to random).
    pub fn set_maglev_size(&mut self, size: u32) {
        self.maglev_size = size;
    }

    pub fn maps(&self) -> &M {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut M {
        &mut self.maps
    }

    pub fn frontends(&self) -> impl Iterator<Item = &Target> {
        self.written.keys()
    }

    /// Forgets what it believes is written and takes the maps' contents as the truth again
    /// (a full resync: anything changed behind the agent's back is then corrected by the
    /// writes that follow). Returns the number of frontends found.
    pub fn reload_from_maps(&mut self) -> Result<usize, MapError> {
        self.written.clear();
        self.service_entries = [0; 2];
        self.backend_ids = SlotIds::new("BACKENDS", self.maps.backend_slots(), true);
        self.service_ids = SlotIds::new("SERVICE_STATS", self.maps.service_slots(), false);
        self.adopt()
    }

    /// The service id of `target`, if it is written.
    pub fn service_id(&self, target: &Target) -> Option<u32> {
        self.written.get(target).map(|w| w.service_id)
    }

    /// The service id (index into `SERVICE_STATS`) of every frontend written.
    pub fn service_ids(&self) -> impl Iterator<Item = (&Target, u32)> {
        self.written.iter().map(|(f, w)| (f, w.service_id))
    }

    /// Every backend of every frontend written, draining ones too: its frontend, address
    /// and id.
    pub fn every_backend_id(&self) -> impl Iterator<Item = (&Target, SocketAddr, u32)> {
        self.written.iter().flat_map(|(f, w)| {
            w.slots
                .iter()
                .chain(&w.draining)
                .map(move |(id, addr)| (f, *addr, *id))
        })
    }

    /// Every backend written: its frontend, address and id.
    pub fn backend_ids(&self) -> impl Iterator<Item = (&Target, SocketAddr, u32)> {
        self.written
            .iter()
            .flat_map(|(f, w)| w.slots.iter().map(move |(id, addr)| (f, *addr, *id)))
    }

    /// Frontends and backend slots currently written (a frontend's second set, for clients
    /// on this node, counts its slots but not as another frontend).
    pub fn counts(&self) -> (usize, usize) {
        (
            self.written.keys().filter(|t| !t.in_cluster).count(),
            self.written.values().map(|w| w.slots.len()).sum(),
        )
    }

    /// Takes over maps a previous agent left pinned: rebuilds the record of what is written
    /// from the maps themselves, keeping backend ids (conntrack entries refer to them) and
    /// removing whatever is inconsistent. Returns the number of frontends taken over.
    pub fn adopt(&mut self) -> Result<usize, MapError> {
        let contents = self.maps.entries()?;
        for (_, id) in &contents.retired {
            self.backend_ids.retired(*id);
        }
        let backends: HashMap<u32, Backend> =
            contents.backends.iter().map(|b| (b.id, *b)).collect();
        let mut headers: HashMap<Target, ServiceValue> = HashMap::new();
        let mut slots: HashMap<Target, HashMap<u16, ServiceValue>> = HashMap::new();
        let mut stray = Vec::new();
        for (key, value) in contents.services {
            match frontend_of(&key) {
                Some(f) if key.slot() == 0 => {
                    headers.insert(f, value);
                }
                Some(f) => {
                    slots.entry(f).or_default().insert(key.slot(), value);
                }
                None => stray.push(key),
            }
        }
        let mut ranges: HashMap<u32, RangeSet> = HashMap::new();
        for (id, addr, prefix) in &contents.source_ranges {
            ranges.entry(*id).or_default().insert((*addr, *prefix));
        }
        // Each service's backends, found once (a scan of every backend per frontend was
        // quadratic: minutes at 100 000 services).
        let mut backends_of: HashMap<u32, Vec<&Backend>> = HashMap::new();
        for b in backends.values() {
            backends_of.entry(b.service_id).or_default().push(b);
        }
        let mut referenced = HashSet::new();
        for (frontend, header) in headers {
            let mut found = slots.remove(&frontend).unwrap_or_default();
            let mut cumulative = Vec::new();
            let list: Option<Vec<(u32, SocketAddr)>> = (1..=header.count)
                .map(|slot| {
                    let value = found.remove(&slot)?;
                    cumulative.push((value.flags as u32) << 16 | value.count as u32);
                    let b = backends.get(&value.backend_id)?;
                    Some((value.backend_id, backend_addr(b, &contents.backend_addrs6)?))
                })
                .collect();
            // Slots beyond the count are leftovers of an interrupted shrink.
            for slot in found.keys() {
                stray.push(service_key(frontend, *slot));
            }
            match list {
                Some(list) if list.iter().all(|(id, _)| self.backend_ids.mark_used(*id)) => {
                    referenced.extend(list.iter().map(|s| s.0));
                    let in_slots: HashSet<u32> = list.iter().map(|s| s.0).collect();
                    let mut draining: Vec<(u32, SocketAddr)> = backends_of
                        .get(&header.service_id)
                        .into_iter()
                        .flatten()
                        .filter(|b| !in_slots.contains(&b.id))
                        .filter_map(|b| Some((b.id, backend_addr(b, &contents.backend_addrs6)?)))
                        .filter(|(id, _)| self.backend_ids.mark_used(*id))
                        .collect();
                    draining.sort_by_key(|d| d.1);
                    referenced.extend(draining.iter().map(|d| d.0));
                    self.service_ids.mark_used(header.service_id);
                    self.put_written(
                        frontend,
                        Written {
                            service_id: header.service_id,
                            header: HeaderSettings {
                                flags: header.flags,
                                affinity_timeout: header.backend_id,
                            },
                            source_ranges: ranges.remove(&header.service_id).unwrap_or_default(),
                            cumulative,
                            // Rewritten whole by the first sync (tables are not read back).
                            maglev: Vec::new(),
                            slots: list,
                            draining,
                        },
                    );
                }
                broken => {
                    // A slot leads nowhere, or two slots share an id: start this one over.
                    let count = header.count as usize;
                    let _ = self.purge(&frontend, count, BTreeSet::new());
                    for (id, _) in broken.into_iter().flatten() {
                        if !referenced.contains(&id) {
                            self.backend_ids.release(id);
                        }
                    }
                }
            }
        }
        for (frontend, found) in slots {
            stray.extend(found.keys().map(|slot| service_key(frontend, *slot)));
        }
        for key in stray {
            self.maps.remove_service(&key)?;
        }
        for id in backends.keys().filter(|id| !referenced.contains(id)) {
            self.maps.remove_backend(*id)?;
            self.backend_ids.retired(*id);
        }
        // Ranges of frontends that are gone.
        for (id, set) in ranges {
            for (addr, prefix) in set {
                self.maps.remove_source_range((id, addr, prefix))?;
            }
        }
        Ok(self.written.len())
    }

    fn family_index(frontend: &Target) -> usize {
        usize::from(frontend.addr.is_ipv6())
    }

    fn take_written(&mut self, frontend: &Target) -> Option<Written> {
        let w = self.written.remove(frontend)?;
        self.service_entries[Self::family_index(frontend)] -= 1 + w.slots.len();
        Some(w)
    }

    fn put_written(&mut self, frontend: Target, w: Written) {
        self.service_entries[Self::family_index(&frontend)] += 1 + w.slots.len();
        if let Some(old) = self.written.insert(frontend, w) {
            self.service_entries[Self::family_index(&frontend)] -= 1 + old.slots.len();
        }
    }

    /// Whether `SERVICES` (or `SERVICES6`) has room for `frontend` with `slots` backends
    /// once its current entries (already taken out of the count) are replaced: checked
    /// before writing, so a Service that does not fit leaves what it had untouched.
    fn services_room(&self, frontend: &Target, slots: usize) -> Result<(), MapError> {
        let Some((capacity, per_family)) = self.maps.services_capacity() else {
            return Ok(());
        };
        let used = if per_family {
            self.service_entries[Self::family_index(frontend)]
        } else {
            self.service_entries.iter().sum()
        };
        if used + 1 + slots > capacity {
            return Err(MapError::Full {
                map: if frontend.addr.is_ipv6() && per_family {
                    "SERVICES6"
                } else {
                    "SERVICES"
                },
                capacity: capacity as u32,
            });
        }
        Ok(())
    }

    /// Makes `frontend` select among `backends` (empty: refuse connections). Returns the
    /// number of map operations it took. On error the frontend is removed from the maps (a
    /// half-written service is worse than none) and a later call retries it from scratch.
    pub fn set(
        &mut self,
        frontend: impl Into<Target>,
        backends: &[SocketAddr],
    ) -> Result<usize, MapError> {
        self.set_with(frontend, &FrontendSpec::new(backends))
    }

    /// Like [`MapSync::set`], with everything else a frontend carries.
    pub fn set_with(
        &mut self,
        frontend: impl Into<Target>,
        spec: &FrontendSpec,
    ) -> Result<usize, MapError> {
        let frontend = &frontend.into();
        let backends = spec.backends;
        let mut header = spec.header;
        let ranges: RangeSet = spec.source_ranges.iter().copied().collect();
        if ranges.is_empty() {
            header.flags &= !SERVICE_FLAG_SOURCE_RANGES;
        } else {
            header.flags |= SERVICE_FLAG_SOURCE_RANGES;
        }
        if backends.len() > u16::MAX as usize {
            return Err(MapError::Other {
                map: "SERVICES",
                message: format!(
                    "{} endpoints for {frontend}; a service port can have at most {}",
                    backends.len(),
                    u16::MAX
                ),
            });
        }
        let old = self.take_written(frontend);
        let service_id = match old.as_ref() {
            Some(w) => w.service_id,
            None => {
                let id = self.service_ids.allocate()?;
                // Its counters start from zero, not from the last holder's.
                self.maps.reset_counters(Some(id), None);
                id
            }
        };
        let old_slots = old.as_ref().map(|w| w.slots.clone()).unwrap_or_default();
        let old_draining = old.as_ref().map(|w| w.draining.clone()).unwrap_or_default();
        let old_ranges = old
            .as_ref()
            .map(|w| w.source_ranges.clone())
            .unwrap_or_default();
        // An endpoint moving between the slots and draining keeps its id: its established
        // flows stay on it.
        let mut reusable: HashMap<SocketAddr, u32> =
            old_draining.iter().map(|(id, a)| (*a, *id)).collect();
        let assigned = self
            .assign_slots(&old_slots, backends, &mut reusable)
            .and_then(|slots| {
                let in_slots: HashSet<SocketAddr> = slots.iter().map(|s| s.1).collect();
                reusable.extend(
                    old_slots
                        .iter()
                        .filter(|s| !in_slots.contains(&s.1))
                        .map(|(id, a)| (*a, *id)),
                );
                let wanted: BTreeSet<SocketAddr> = spec
                    .draining
                    .iter()
                    .filter(|a| !in_slots.contains(a))
                    .copied()
                    .collect();
                let mut draining = Vec::new();
                let mut allocated = Vec::new();
                for addr in wanted {
                    match reusable.get(&addr) {
                        Some(id) => draining.push((*id, addr)),
                        None => match self.backend_ids.allocate() {
                            Ok(id) => {
                                self.maps
                                    .reset_counters(None, Some(id & BACKEND_INDEX_MASK));
                                allocated.push(id);
                                draining.push((id, addr));
                            }
                            Err(e) => {
                                let mut fresh: Vec<u32> = slots
                                    .iter()
                                    .map(|s| s.0)
                                    .filter(|id| !old_slots.iter().any(|o| o.0 == *id))
                                    .filter(|id| !old_draining.iter().any(|o| o.0 == *id))
                                    .collect();
                                fresh.extend(allocated);
                                return Err((e, fresh));
                            }
                        },
                    }
                }
                Ok((slots, draining))
            });
        let assigned = assigned.and_then(|(slots, draining)| {
            // Room in SERVICES first: nothing of the old state is touched when there is none.
            match self.services_room(frontend, slots.len()) {
                Ok(()) => Ok((slots, draining)),
                Err(e) => {
                    let fresh: Vec<u32> = slots
                        .iter()
                        .chain(&draining)
                        .map(|s| s.0)
                        .filter(|id| !old_slots.iter().chain(&old_draining).any(|o| o.0 == *id))
                        .collect();
                    Err((e, fresh))
                }
            }
        });
        let (new_slots, new_draining) = match assigned {
            Ok(assigned) => assigned,
            Err((e, allocated)) => {
                for id in allocated {
                    self.backend_ids.release(id);
                }
                if let Some(old) = old {
                    self.put_written(*frontend, old);
                } else {
                    self.service_ids.release(service_id);
                }
                return Err(e);
            }
        };
        let header_changed = old.as_ref().is_none_or(|w| w.header != header);
        let old_cumulative = old
            .as_ref()
            .map(|w| w.cumulative.clone())
            .unwrap_or_default();
        let old_maglev = old.as_ref().map(|w| w.maglev.clone()).unwrap_or_default();
        let mut total = 0u32;
        let cumulative: Vec<u32> = new_slots
            .iter()
            .map(|(_, a)| {
                total += spec.weights.get(&a.ip()).copied().unwrap_or(1) as u32;
                total
            })
            .collect();
        let scheduler = (header.flags >> SERVICE_SCHEDULER_SHIFT) & SERVICE_SCHEDULER_MASK;
        let maglev: Vec<u32> = if scheduler == proxy_common::scheduler::MH && self.maglev_size > 0 {
            let addrs: Vec<SocketAddr> = new_slots.iter().map(|s| s.1).collect();
            super::maglev::table(&addrs, self.maglev_size)
                .into_iter()
                .map(|i| i + 1)
                .collect()
        } else {
            Vec::new()
        };
        let transition = Transition {
            service_id,
            header,
            header_changed,
            slots: (&old_slots, &new_slots),
            draining: (&old_draining, &new_draining),
            remote: spec.remote,
            ranges: (&old_ranges, &ranges),
            cumulative: (&old_cumulative, &cumulative),
            maglev: (&old_maglev, &maglev),
        };
        match self.write(frontend, &transition) {
            Ok(ops) => {
                self.put_written(
                    *frontend,
                    Written {
                        service_id,
                        header,
                        source_ranges: ranges,
                        slots: new_slots,
                        draining: new_draining,
                        cumulative,
                        maglev,
                    },
                );
                Ok(ops)
            }
            Err(e) => {
                let slot_count = old_slots.len().max(new_slots.len());
                let ids: BTreeSet<u32> = old_slots
                    .iter()
                    .chain(&new_slots)
                    .chain(&old_draining)
                    .chain(&new_draining)
                    .map(|s| s.0)
                    .collect();
                let _ = self.purge(frontend, slot_count, ids);
                for (addr, prefix) in old_ranges.union(&ranges) {
                    let _ = self.maps.remove_source_range((service_id, *addr, *prefix));
                }
                for index in 0..old_maglev.len().max(maglev.len()) as u32 {
                    let _ = self.maps.remove_maglev(MaglevKey { service_id, index });
                }
                match old {
                    // An update that failed: what served before is written back, with its
                    // ids (conntrack entries name them), so the Service keeps serving as it
                    // did while the update is retried.
                    Some(old) => self.restore(frontend, old, spec.remote),
                    None => self.service_ids.release(service_id),
                }
                Err(e)
            }
        }
    }

    /// Writes `old` back after a failed update purged `frontend`.
    fn restore(&mut self, frontend: &Target, old: Written, remote: &BTreeSet<SocketAddr>) {
        for (id, _) in old.slots.iter().chain(&old.draining) {
            self.backend_ids.mark_used(*id);
        }
        let none = RangeSet::new();
        let restore = Transition {
            service_id: old.service_id,
            header: old.header,
            header_changed: true,
            slots: (&[], &old.slots),
            draining: (&[], &old.draining),
            remote,
            ranges: (&none, &old.source_ranges),
            cumulative: (&[], &old.cumulative),
            maglev: (&[], &old.maglev),
        };
        match self.write(frontend, &restore) {
            Ok(_) => {
                self.put_written(*frontend, old);
            }
            Err(e) => {
                tracing::error!(%frontend, "the previous state could not be written back: {e}");
                let ids = old.slots.iter().chain(&old.draining).map(|s| s.0).collect();
                let _ = self.purge(frontend, old.slots.len(), ids);
                self.service_ids.release(old.service_id);
            }
        }
    }

    /// The new slot list: surviving backends keep their slots, new ones fill the holes of
    /// departed ones (then go at the end), and remaining holes are closed by moving
    /// backends down from the tail. So a change of one backend costs one slot write.
    #[allow(clippy::type_complexity)]
    fn assign_slots(
        &mut self,
        old: &[(u32, SocketAddr)],
        backends: &[SocketAddr],
        reusable: &mut HashMap<SocketAddr, u32>,
    ) -> Result<Vec<(u32, SocketAddr)>, (MapError, Vec<u32>)> {
        let wanted: BTreeSet<SocketAddr> = backends.iter().copied().collect();
        let mut slots: Vec<Option<(u32, SocketAddr)>> = old
            .iter()
            .map(|s| wanted.contains(&s.1).then_some(*s))
            .collect();
        let present: HashSet<SocketAddr> = slots.iter().flatten().map(|s| s.1).collect();
        let mut allocated = Vec::new();
        let mut fresh_ids = Vec::new();
        for addr in wanted.iter().filter(|a| !present.contains(a)) {
            if let Some(id) = reusable.remove(addr) {
                allocated.push((id, *addr));
                continue;
            }
            match self.backend_ids.allocate() {
                Ok(id) => {
                    self.maps
                        .reset_counters(None, Some(id & BACKEND_INDEX_MASK));
                    fresh_ids.push(id);
                    allocated.push((id, *addr));
                }
                Err(e) => return Err((e, fresh_ids)),
            }
        }
        let mut fresh = allocated.into_iter();
        for slot in slots.iter_mut().filter(|s| s.is_none()) {
            match fresh.next() {
                Some(f) => *slot = Some(f),
                None => break,
            }
        }
        slots.extend(fresh.map(Some));
        let mut i = 0;
        while i < slots.len() {
            if slots[i].is_none() {
                while matches!(slots.last(), Some(None)) {
                    slots.pop();
                }
                if i < slots.len() {
                    // slots[i] is a hole and the last entry is not, so it lies beyond i.
                    slots[i] = slots.pop().flatten();
                }
            }
            i += 1;
        }
        Ok(slots.into_iter().flatten().collect())
    }

    /// Writes `t` in the order that keeps every packet's view consistent (see the module
    /// documentation).
    fn write(&mut self, frontend: &Target, t: &Transition) -> Result<usize, MapError> {
        let Transition {
            service_id,
            header: settings,
            header_changed,
            slots: (old, new),
            draining: (old_draining, new_draining),
            remote,
            ranges: (old_ranges, new_ranges),
            cumulative: (old_cumulative, cumulative),
            maglev: (old_maglev, maglev),
        } = *t;
        let mut ops = 0;
        let old_ids: HashSet<u32> = old.iter().chain(old_draining).map(|s| s.0).collect();
        let new_ids: HashSet<u32> = new.iter().chain(new_draining).map(|s| s.0).collect();
        // Each step's writes go together (one batch in the kernel maps); the steps stay in
        // order.
        // 1. new backends first (draining ones too: they may be new to this agent)
        let backends: Vec<_> = new
            .iter()
            .chain(new_draining)
            .filter(|s| !old_ids.contains(&s.0))
            .map(|(id, addr)| {
                let (value, addr6) = backend_value(*id, addr, remote.contains(addr), service_id);
                (*id, value, addr6)
            })
            .collect();
        self.maps.set_backends(&backends)?;
        ops += backends.len();
        // 2. slots that changed (backend or cumulative weight)
        let slots: Vec<_> = new
            .iter()
            .enumerate()
            .filter(|(i, s)| {
                old.get(*i) != Some(s) || old_cumulative.get(*i) != Some(&cumulative[*i])
            })
            .map(|(i, s)| {
                let value = ServiceValue {
                    backend_id: s.0,
                    service_id,
                    count: cumulative[i] as u16,
                    flags: (cumulative[i] >> 16) as u16,
                };
                (service_key(frontend, i as u16 + 1), value)
            })
            .collect();
        self.maps.set_services(&slots)?;
        ops += slots.len();
        // 2b. source ranges it gains, before the header can ask for them
        for (addr, prefix) in new_ranges.difference(old_ranges) {
            self.maps.add_source_range((service_id, *addr, *prefix))?;
            ops += 1;
        }
        // 2c. the Maglev table's entries that changed, before the header may ask for it
        let table: Vec<_> = maglev
            .iter()
            .enumerate()
            .filter(|(index, slot)| old_maglev.get(*index) != Some(*slot))
            .map(|(index, slot)| {
                let key = MaglevKey {
                    service_id,
                    index: index as u32,
                };
                (key, *slot)
            })
            .collect();
        self.maps.set_maglevs(&table)?;
        ops += table.len();
        // 3. the header, when new or when its count or flags change
        if header_changed || old.len() != new.len() {
            let header = ServiceValue {
                backend_id: settings.affinity_timeout,
                service_id,
                count: new.len() as u16,
                flags: settings.flags,
            };
            self.maps.set_service(service_key(frontend, 0), header)?;
            ops += 1;
        }
        // 4. shrink: slots beyond the new count, then departed backends
        for i in new.len()..old.len() {
            self.maps
                .remove_service(&service_key(frontend, i as u16 + 1))?;
            ops += 1;
        }
        for (id, _) in old
            .iter()
            .chain(old_draining)
            .filter(|s| !new_ids.contains(&s.0))
        {
            self.maps.remove_backend(*id)?;
            self.backend_ids.release(*id);
            ops += 1;
        }
        for (addr, prefix) in old_ranges.difference(new_ranges) {
            self.maps
                .remove_source_range((service_id, *addr, *prefix))?;
            ops += 1;
        }
        for index in maglev.len()..old_maglev.len() {
            let key = MaglevKey {
                service_id,
                index: index as u32,
            };
            self.maps.remove_maglev(key)?;
            ops += 1;
        }
        Ok(ops)
    }

    /// Removes `frontend` from the maps: header first (no new flow picks it), then slots,
    /// then backends.
    pub fn remove(&mut self, frontend: impl Into<Target>) -> Result<usize, MapError> {
        let frontend = &frontend.into();
        let Some(old) = self.take_written(frontend) else {
            return Ok(0);
        };
        self.service_ids.release(old.service_id);
        let mut ops = self.purge(
            frontend,
            old.slots.len(),
            old.slots.iter().chain(&old.draining).map(|s| s.0).collect(),
        )?;
        for (addr, prefix) in &old.source_ranges {
            self.maps
                .remove_source_range((old.service_id, *addr, *prefix))?;
            ops += 1;
        }
        for index in 0..old.maglev.len() as u32 {
            self.maps.remove_maglev(MaglevKey {
                service_id: old.service_id,
                index,
            })?;
            ops += 1;
        }
        Ok(ops)
    }

    fn purge(
        &mut self,
        frontend: &Target,
        slot_count: usize,
        backend_ids: BTreeSet<u32>,
    ) -> Result<usize, MapError> {
        let mut ops = 0;
        let mut first_err = None;
        let mut note = |r: Result<(), MapError>| match r {
            Ok(()) => ops += 1,
            Err(e) => {
                first_err.get_or_insert(e);
            }
        };
        note(self.maps.remove_service(&service_key(frontend, 0)));
        for i in 0..slot_count {
            note(
                self.maps
                    .remove_service(&service_key(frontend, i as u16 + 1)),
            );
        }
        for id in backend_ids {
            note(self.maps.remove_backend(id));
            self.backend_ids.release(id);
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(ops),
        }
    }
}

#[cfg(test)]
mod tests;
