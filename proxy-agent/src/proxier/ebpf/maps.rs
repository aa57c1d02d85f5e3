//! The maps the agent writes (`SERVICES`, `BACKENDS`, `SOURCE_RANGES`) behind a small trait, so the sync
//! logic is tested against [`InMemoryMaps`] without a kernel and runs against [`KernelMaps`]
//! in production.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use aya::{
    maps::{
        lpm_trie::{Key as LpmKey, LpmTrie},
        Array, HashMap as BpfHashMap, IterableMap, MapData, MapError as AyaMapError, PerCpuArray,
        PerCpuValues,
    },
    Pod,
};
use proxy_common::{
    map_names, Backend, BackendAddr6, MaglevKey, ServiceKey, ServiceKey6, ServiceName,
    ServiceStats, ServiceValue, SourceRangeKey, SourceRangeKey6, BACKEND_FLAG_IPV6,
    BACKEND_INDEX_MASK,
};

use crate::datapath::{
    batch::{self, update_batch},
    Datapath,
};

/// A key of `SERVICES` (IPv4 frontends) or `SERVICES6` (IPv6 frontends): the two maps share
/// their values, service ids and backend ids, so the sync logic writes them alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ServiceMapKey {
    V4(ServiceKey),
    V6(ServiceKey6),
}

impl ServiceMapKey {
    pub fn slot(&self) -> u16 {
        match self {
            ServiceMapKey::V4(k) => k.slot,
            ServiceMapKey::V6(k) => k.slot,
        }
    }
}

/// One `loadBalancerSourceRanges` entry of a frontend: (service id, network address, prefix
/// length). IPv4 ranges go to `SOURCE_RANGES`, IPv6 ones to `SOURCE_RANGES6`.
pub type SourceRange = (u32, IpAddr, u8);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MapError {
    #[error("eBPF map {map} is full ({capacity} entries); raise its size in the configuration")]
    Full { map: &'static str, capacity: u32 },
    #[error("eBPF map {map}: {message}")]
    Other { map: &'static str, message: String },
}

impl MapError {
    /// A short label for metrics: the map and what went wrong (`services_full`,
    /// `maglev_error`, ...), from a fixed set.
    pub fn reason(&self) -> String {
        match self {
            MapError::Full { map, .. } => format!("{}_full", map.to_ascii_lowercase()),
            MapError::Other { map, .. } => format!("{}_error", map.to_ascii_lowercase()),
        }
    }
}

/// `BACKENDS` is an array: the agent allocates its slots (see `sync::BackendIds`), so only
/// `SERVICES` can be full at write time.
pub trait ServiceMaps {
    fn set_service(&mut self, key: ServiceMapKey, value: ServiceValue) -> Result<(), MapError>;
    fn remove_service(&mut self, key: &ServiceMapKey) -> Result<(), MapError>;
    /// Writes a backend; an IPv6 one (`addr6`) has its address written first, so the datapath
    /// never finds the backend without it.
    fn set_backend(
        &mut self,
        id: u32,
        backend: Backend,
        addr6: Option<BackendAddr6>,
    ) -> Result<(), MapError>;
    fn remove_backend(&mut self, id: u32) -> Result<(), MapError>;
    /// [`Self::set_backend`] for each, in order; the kernel maps write them in batches.
    fn set_backends(
        &mut self,
        backends: &[(u32, Backend, Option<BackendAddr6>)],
    ) -> Result<(), MapError> {
        for (id, backend, addr6) in backends {
            self.set_backend(*id, *backend, *addr6)?;
        }
        Ok(())
    }
    /// [`Self::set_service`] for each, in order; the kernel maps write them in batches.
    fn set_services(&mut self, entries: &[(ServiceMapKey, ServiceValue)]) -> Result<(), MapError> {
        for (key, value) in entries {
            self.set_service(*key, *value)?;
        }
        Ok(())
    }
    /// [`Self::set_maglev`] for each, in order; the kernel maps write them in batches.
    fn set_maglevs(&mut self, entries: &[(MaglevKey, u32)]) -> Result<(), MapError> {
        for (key, slot) in entries {
            self.set_maglev(*key, *slot)?;
        }
        Ok(())
    }
    /// Zeroes the traffic counters of a service id (`SERVICE_STATS`) and of a backend slot
    /// (`BACKEND_STATS`) about to be given out, so they count for their new holder only.
    /// Best effort: a counter is no reason to fail a write.
    fn reset_counters(&mut self, _service_id: Option<u32>, _backend_slot: Option<u32>) {}

    /// Names service ids in `SERVICE_NAMES` for `proxy-agent inspect`. No program reads
    /// it, so it is outside the write-order rules; maps without it ignore this.
    fn set_names(&mut self, _names: &[(u32, ServiceName)]) -> Result<(), MapError> {
        Ok(())
    }
    fn add_source_range(&mut self, range: SourceRange) -> Result<(), MapError>;
    fn remove_source_range(&mut self, range: SourceRange) -> Result<(), MapError>;
    fn set_maglev(&mut self, key: MaglevKey, slot: u32) -> Result<(), MapError>;
    fn remove_maglev(&mut self, key: MaglevKey) -> Result<(), MapError>;
    /// Number of `BACKENDS` slots (slot 0 is never used).
    fn backend_slots(&self) -> u32;
    /// Number of `SERVICE_STATS` slots, which service ids index (slot 0 is never used).
    fn service_slots(&self) -> u32;
    /// `SERVICES`' capacity in entries, and whether `SERVICES6` has as many of its own
    /// (else both families share it); `None`: unbounded.
    fn services_capacity(&self) -> Option<(usize, bool)>;
    /// Everything in the maps, for adopting maps a previous agent left pinned: `SERVICES`
    /// entries, and the `BACKENDS` slots in use.
    fn entries(&self) -> Result<MapContents, MapError>;
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MapContents {
    pub services: Vec<(ServiceMapKey, ServiceValue)>,
    pub backends: Vec<Backend>,
    /// Free `BACKENDS` slots that held a backend: (slot, the id it held last), so ids are
    /// never handed out again while conntrack or affinity entries may name them.
    pub retired: Vec<(u32, u32)>,
    /// Addresses of the IPv6 backends (`BACKEND_FLAG_IPV6`), by backend slot.
    pub backend_addrs6: BTreeMap<u32, BackendAddr6>,
    pub source_ranges: Vec<SourceRange>,
}

/// A map-shaped model of the kernel maps, with the same capacity behaviour (an insert of a
/// new key into a full hash map fails; overwriting an existing key does not). Backends are
/// keyed by their full id; a removed backend is absent, as an emptied array slot is to the
/// datapath.
#[derive(Debug, Clone)]
pub struct InMemoryMaps {
    pub services: BTreeMap<ServiceMapKey, ServiceValue>,
    pub backends: BTreeMap<u32, Backend>,
    /// Free slots' last ids (what the kernel array keeps as [`Backend::retired`]).
    pub retired: BTreeMap<u32, u32>,
    /// `BACKEND_ADDRS6`, by backend slot.
    pub backend_addrs6: BTreeMap<u32, BackendAddr6>,
    pub source_ranges: BTreeSet<SourceRange>,
    /// (service id, entry) -> slot.
    pub maglev: BTreeMap<(u32, u32), u32>,
    pub services_capacity: Option<usize>,
    /// Size of the modelled `BACKENDS` array.
    pub backend_slots: u32,
    /// Number of write/delete operations performed, to check that syncs write only the
    /// difference.
    pub operations: usize,
    /// `SERVICE_NAMES`: service id → (name, kind).
    pub names: BTreeMap<u32, (String, u8)>,
}

impl Default for InMemoryMaps {
    fn default() -> Self {
        Self {
            services: BTreeMap::new(),
            backends: BTreeMap::new(),
            retired: BTreeMap::new(),
            backend_addrs6: BTreeMap::new(),
            source_ranges: BTreeSet::new(),
            maglev: BTreeMap::new(),
            services_capacity: None,
            backend_slots: 65536,
            operations: 0,
            names: BTreeMap::new(),
        }
    }
}

impl InMemoryMaps {
    pub fn with_capacity(services: usize, backend_slots: u32) -> Self {
        Self {
            services_capacity: Some(services),
            backend_slots,
            ..Self::default()
        }
    }
}

fn check_capacity<K: Ord, V>(
    map: &BTreeMap<K, V>,
    key: &K,
    capacity: Option<usize>,
    name: &'static str,
) -> Result<(), MapError> {
    match capacity {
        Some(cap) if !map.contains_key(key) && map.len() >= cap => Err(MapError::Full {
            map: name,
            capacity: cap as u32,
        }),
        _ => Ok(()),
    }
}

impl ServiceMaps for InMemoryMaps {
    fn set_names(&mut self, names: &[(u32, ServiceName)]) -> Result<(), MapError> {
        for (id, name) in names {
            let text = String::from_utf8_lossy(name.text()).into_owned();
            self.names.insert(*id, (text, name.kind));
        }
        Ok(())
    }

    fn set_service(&mut self, key: ServiceMapKey, value: ServiceValue) -> Result<(), MapError> {
        check_capacity(&self.services, &key, self.services_capacity, "SERVICES")?;
        self.operations += 1;
        self.services.insert(key, value);
        Ok(())
    }

    fn remove_service(&mut self, key: &ServiceMapKey) -> Result<(), MapError> {
        self.operations += 1;
        self.services.remove(key);
        Ok(())
    }

    fn set_backend(
        &mut self,
        id: u32,
        backend: Backend,
        addr6: Option<BackendAddr6>,
    ) -> Result<(), MapError> {
        self.operations += 1;
        if let Some(a) = addr6 {
            self.backend_addrs6.insert(id & BACKEND_INDEX_MASK, a);
        }
        self.retired.remove(&(id & BACKEND_INDEX_MASK));
        self.backends.insert(id, backend);
        Ok(())
    }

    fn remove_backend(&mut self, id: u32) -> Result<(), MapError> {
        self.operations += 1;
        self.backends.remove(&id);
        self.retired.insert(id & BACKEND_INDEX_MASK, id);
        Ok(())
    }

    fn add_source_range(&mut self, range: SourceRange) -> Result<(), MapError> {
        self.operations += 1;
        self.source_ranges.insert(range);
        Ok(())
    }

    fn remove_source_range(&mut self, range: SourceRange) -> Result<(), MapError> {
        self.operations += 1;
        self.source_ranges.remove(&range);
        Ok(())
    }

    fn set_maglev(&mut self, key: MaglevKey, slot: u32) -> Result<(), MapError> {
        self.operations += 1;
        self.maglev.insert((key.service_id, key.index), slot);
        Ok(())
    }

    fn remove_maglev(&mut self, key: MaglevKey) -> Result<(), MapError> {
        self.operations += 1;
        self.maglev.remove(&(key.service_id, key.index));
        Ok(())
    }

    fn backend_slots(&self) -> u32 {
        self.backend_slots
    }

    fn service_slots(&self) -> u32 {
        self.services_capacity
            .map(|c| c as u32 + 1)
            .unwrap_or(65536)
    }

    fn services_capacity(&self) -> Option<(usize, bool)> {
        self.services_capacity.map(|c| (c, false))
    }

    fn entries(&self) -> Result<MapContents, MapError> {
        Ok(MapContents {
            services: self.services.iter().map(|(k, v)| (*k, *v)).collect(),
            backends: self.backends.values().copied().collect(),
            retired: self.retired.iter().map(|(s, id)| (*s, *id)).collect(),
            backend_addrs6: self.backend_addrs6.clone(),
            source_ranges: self.source_ranges.iter().copied().collect(),
        })
    }
}

/// The LPM key of a source range: the whole service id, then the range's prefix.
fn lpm_key(service_id: u32, addr: std::net::Ipv4Addr, prefix: u8) -> LpmKey<SourceRangeKey> {
    let addr = u32::from(addr).to_be();
    LpmKey::new(32 + prefix as u32, SourceRangeKey { service_id, addr })
}

fn lpm_key6(service_id: u32, addr: std::net::Ipv6Addr, prefix: u8) -> LpmKey<SourceRangeKey6> {
    let addr = addr.octets();
    LpmKey::new(32 + prefix as u32, SourceRangeKey6 { service_id, addr })
}

/// The kernel's maps, through aya.
pub struct KernelMaps {
    pub services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
    pub services6: BpfHashMap<MapData, ServiceKey6, ServiceValue>,
    pub backends: Array<MapData, Backend>,
    pub backend_addrs6: Array<MapData, BackendAddr6>,
    pub source_ranges: LpmTrie<MapData, SourceRangeKey, u8>,
    pub source_ranges6: LpmTrie<MapData, SourceRangeKey6, u8>,
    pub maglev: BpfHashMap<MapData, MaglevKey, u32>,
    pub maglev_capacity: u32,
    /// Active-connection counters per backend slot, zeroed when a slot takes a new backend.
    pub backend_conns: Array<MapData, u64>,
    pub backend_released: Array<MapData, u64>,
    pub services_capacity: u32,
    /// Whether the kernel takes batch updates (5.6+); after a refusal, one write per entry.
    pub batches: bool,
    /// `SERVICE_NAMES` (absent from an object built before it).
    pub names: Option<BpfHashMap<MapData, u32, ServiceName>>,
    /// `SERVICE_STATS` and `BACKEND_STATS`, to zero what is given out again.
    pub counters: Option<(
        PerCpuArray<MapData, ServiceStats>,
        PerCpuArray<MapData, ServiceStats>,
    )>,
}

/// Every entry of `map`: in batches where the kernel has them (5.6+; an adopting restart
/// reads 120 000 entries at 10 000 services, 364 ms one by one), else `one_by_one`.
fn read_all<K: Pod, V: Pod, E>(
    map: &MapData,
    one_by_one: impl FnOnce() -> Result<Vec<(K, V)>, E>,
) -> Result<Vec<(K, V)>, E> {
    match batch::lookup_all(map) {
        Some(all) => Ok(all),
        None => one_by_one(),
    }
}

impl KernelMaps {
    /// Writes `keys` → `values` into `map` in batches while the kernel takes them; returns
    /// how many were written (the caller writes the rest one by one: a single write reports
    /// a full map or another error precisely).
    fn batch_prefix<K: Pod, V: Pod>(
        batches: &mut bool,
        map: &MapData,
        keys: &[K],
        values: &[V],
    ) -> usize {
        const CHUNK: usize = 4096;
        let mut done = 0;
        while *batches && done < keys.len() {
            let end = (done + CHUNK).min(keys.len());
            match update_batch(map, &keys[done..end], &values[done..end]) {
                Ok(()) => done = end,
                Err((written, e)) => {
                    done += written;
                    // A kernel without batch updates (before 5.6) refuses the first one.
                    if written == 0 && e.raw_os_error() != Some(libc::E2BIG) {
                        tracing::debug!("batch map updates refused ({e}): one write per entry");
                        *batches = false;
                    }
                    break;
                }
            }
        }
        done
    }

    /// Inserts `keys[i]` → `values[i]` into hash map `map` (called `name` in errors): in
    /// batches while the kernel takes them, the rest one by one.
    fn insert_all<K: Pod, V: Pod>(
        batches: &mut bool,
        map: &mut BpfHashMap<MapData, K, V>,
        keys: &[K],
        values: &[V],
        name: &'static str,
        capacity: u32,
    ) -> Result<(), MapError> {
        let done = Self::batch_prefix(batches, map.map(), keys, values);
        for (key, value) in keys[done..].iter().zip(&values[done..]) {
            map.insert(key, value, 0)
                .map_err(|e| classify(name, capacity, e))?;
        }
        Ok(())
    }

    /// Takes the maps the service sync writes out of the loaded datapath. Call once.
    pub fn take(datapath: &mut Datapath) -> anyhow::Result<Self> {
        Ok(Self {
            services: BpfHashMap::try_from(datapath.take_map(map_names::SERVICES)?)?,
            services6: BpfHashMap::try_from(datapath.take_map(map_names::SERVICES6)?)?,
            backends: Array::try_from(datapath.take_map(map_names::BACKENDS)?)?,
            backend_addrs6: Array::try_from(datapath.take_map(map_names::BACKEND_ADDRS6)?)?,
            source_ranges: LpmTrie::try_from(datapath.take_map(map_names::SOURCE_RANGES)?)?,
            source_ranges6: LpmTrie::try_from(datapath.take_map(map_names::SOURCE_RANGES6)?)?,
            maglev: BpfHashMap::try_from(datapath.take_map(map_names::MAGLEV)?)?,
            maglev_capacity: datapath.sizes.maglev,
            // Second handles: the garbage collector keeps using these maps through the
            // datapath.
            backend_conns: Array::try_from(datapath.second_handle(map_names::BACKEND_CONNS)?)?,
            backend_released: Array::try_from(
                datapath.second_handle(map_names::BACKEND_RELEASED)?,
            )?,
            services_capacity: datapath.sizes.services,
            batches: true,
            names: datapath
                .take_map(map_names::SERVICE_NAMES)
                .ok()
                .and_then(|m| BpfHashMap::try_from(m).ok()),
            // Second handles: the runtime reads the counters through the datapath.
            counters: Some((
                PerCpuArray::try_from(datapath.second_handle(map_names::SERVICE_STATS)?)?,
                PerCpuArray::try_from(datapath.second_handle(map_names::BACKEND_STATS)?)?,
            )),
        })
    }
}

impl KernelMaps {
    /// The maps an agent left pinned in `maps_dir`, for reading (`inspect` while no agent
    /// runs): nothing is written through these handles.
    pub fn open_pinned(maps_dir: &std::path::Path) -> anyhow::Result<Self> {
        use anyhow::Context;
        let open = |name: &str| {
            let pin = maps_dir.join(name);
            MapData::from_pin(&pin).with_context(|| format!("opening {}", pin.display()))
        };
        use aya::maps::Map;
        let hash = |name| open(name).map(Map::HashMap);
        let array = |name| open(name).map(Map::Array);
        let trie = |name| open(name).map(Map::LpmTrie);
        let services = BpfHashMap::try_from(hash(map_names::SERVICES)?)?;
        let capacity = services.map().info()?.max_entries();
        Ok(Self {
            services,
            services6: BpfHashMap::try_from(hash(map_names::SERVICES6)?)?,
            backends: Array::try_from(array(map_names::BACKENDS)?)?,
            backend_addrs6: Array::try_from(array(map_names::BACKEND_ADDRS6)?)?,
            source_ranges: LpmTrie::try_from(trie(map_names::SOURCE_RANGES)?)?,
            source_ranges6: LpmTrie::try_from(trie(map_names::SOURCE_RANGES6)?)?,
            maglev: BpfHashMap::try_from(hash(map_names::MAGLEV)?)?,
            maglev_capacity: 0,
            backend_conns: Array::try_from(array(map_names::BACKEND_CONNS)?)?,
            backend_released: Array::try_from(array(map_names::BACKEND_RELEASED)?)?,
            services_capacity: capacity,
            batches: true,
            names: hash(map_names::SERVICE_NAMES)
                .ok()
                .and_then(|m| BpfHashMap::try_from(m).ok()),
            counters: None,
        })
    }

    /// The `SERVICES` or `SERVICES6` entry of `key`.
    pub fn service(&self, key: &ServiceMapKey) -> anyhow::Result<Option<ServiceValue>> {
        let found = match key {
            ServiceMapKey::V4(k) => self.services.get(k, 0),
            ServiceMapKey::V6(k) => self.services6.get(k, 0),
        };
        match found {
            Ok(v) => Ok(Some(v)),
            Err(AyaMapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The address of backend `id`, if its slot still holds it.
    pub fn backend_address(&self, id: u32) -> anyhow::Result<Option<SocketAddr>> {
        let slot = id & BACKEND_INDEX_MASK;
        let b = self.backends.get(&slot, 0)?;
        if b.id != id {
            return Ok(None);
        }
        let addrs6: BTreeMap<u32, BackendAddr6> = if b.flags & BACKEND_FLAG_IPV6 != 0 {
            [(slot, self.backend_addrs6.get(&slot, 0)?)].into()
        } else {
            BTreeMap::new()
        };
        Ok(crate::proxier::ebpf::sync::backend_addr(&b, &addrs6))
    }

    /// Every `SERVICE_NAMES` entry (none without the map).
    pub fn names(&self) -> Vec<(u32, ServiceName)> {
        use aya::maps::IterableMap;
        let Some(map) = &self.names else {
            return Vec::new();
        };
        read_all(map.map(), || map.iter().collect::<Result<Vec<_>, _>>()).unwrap_or_default()
    }
}

fn classify(map: &'static str, capacity: u32, err: AyaMapError) -> MapError {
    if let AyaMapError::SyscallError(ref sys) = err {
        // A full BPF hash map refuses new keys with E2BIG.
        if sys.io_error.raw_os_error() == Some(libc::E2BIG) {
            return MapError::Full { map, capacity };
        }
    }
    MapError::Other {
        map,
        message: err.to_string(),
    }
}

fn ignore_missing(map: &'static str, capacity: u32, err: AyaMapError) -> Result<(), MapError> {
    match err {
        AyaMapError::KeyNotFound => Ok(()),
        AyaMapError::SyscallError(ref sys) if sys.io_error.raw_os_error() == Some(libc::ENOENT) => {
            Ok(())
        }
        other => Err(classify(map, capacity, other)),
    }
}

impl ServiceMaps for KernelMaps {
    fn set_service(&mut self, key: ServiceMapKey, value: ServiceValue) -> Result<(), MapError> {
        match key {
            ServiceMapKey::V4(k) => self
                .services
                .insert(k, value, 0)
                .map_err(|e| classify("SERVICES", self.services_capacity, e)),
            ServiceMapKey::V6(k) => self
                .services6
                .insert(k, value, 0)
                .map_err(|e| classify("SERVICES6", self.services_capacity, e)),
        }
    }

    fn remove_service(&mut self, key: &ServiceMapKey) -> Result<(), MapError> {
        match key {
            ServiceMapKey::V4(k) => self
                .services
                .remove(k)
                .or_else(|e| ignore_missing("SERVICES", self.services_capacity, e)),
            ServiceMapKey::V6(k) => self
                .services6
                .remove(k)
                .or_else(|e| ignore_missing("SERVICES6", self.services_capacity, e)),
        }
    }

    fn set_backend(
        &mut self,
        id: u32,
        backend: Backend,
        addr6: Option<BackendAddr6>,
    ) -> Result<(), MapError> {
        let capacity = self.backends.len();
        let slot = id & BACKEND_INDEX_MASK;
        if let Some(a) = addr6 {
            self.backend_addrs6
                .set(slot, a, 0)
                .map_err(|e| classify("BACKEND_ADDRS6", capacity, e))?;
        }
        // A new backend in the slot starts with no active connections.
        for counters in [&mut self.backend_conns, &mut self.backend_released] {
            counters
                .set(slot, 0, 0)
                .map_err(|e| classify("BACKEND_CONNS", capacity, e))?;
        }
        self.backends
            .set(slot, backend, 0)
            .map_err(|e| classify("BACKENDS", capacity, e))
    }

    fn set_backends(
        &mut self,
        backends: &[(u32, Backend, Option<BackendAddr6>)],
    ) -> Result<(), MapError> {
        let slots: Vec<u32> = backends
            .iter()
            .map(|(id, ..)| id & BACKEND_INDEX_MASK)
            .collect();
        let (slots6, addrs6): (Vec<u32>, Vec<BackendAddr6>) = backends
            .iter()
            .filter_map(|(id, _, a)| Some((id & BACKEND_INDEX_MASK, (*a)?)))
            .unzip();
        let zeros = vec![0u64; slots.len()];
        let values: Vec<Backend> = backends.iter().map(|(_, b, _)| *b).collect();
        let all = backends.len();
        // In the order of single writes: IPv6 addresses, zeroed counters, then the backends.
        let b = &mut self.batches;
        let written = Self::batch_prefix(b, self.backend_addrs6.map(), &slots6, &addrs6)
            == slots6.len()
            && Self::batch_prefix(b, self.backend_conns.map(), &slots, &zeros) == all
            && Self::batch_prefix(b, self.backend_released.map(), &slots, &zeros) == all
            && Self::batch_prefix(b, self.backends.map(), &slots, &values) == all;
        if written {
            return Ok(());
        }
        // What a batch did not write: all of it again one by one (array writes can be
        // repeated), which reports the first failure as single writes do.
        backends
            .iter()
            .try_for_each(|(id, b, a)| self.set_backend(*id, *b, *a))
    }

    fn set_services(&mut self, entries: &[(ServiceMapKey, ServiceValue)]) -> Result<(), MapError> {
        let (mut k4, mut v4, mut k6, mut v6) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (key, value) in entries {
            match key {
                ServiceMapKey::V4(k) => {
                    k4.push(*k);
                    v4.push(*value);
                }
                ServiceMapKey::V6(k) => {
                    k6.push(*k);
                    v6.push(*value);
                }
            }
        }
        let capacity = self.services_capacity;
        let batches = &mut self.batches;
        Self::insert_all(batches, &mut self.services, &k4, &v4, "SERVICES", capacity)?;
        Self::insert_all(
            batches,
            &mut self.services6,
            &k6,
            &v6,
            "SERVICES6",
            capacity,
        )
    }

    fn reset_counters(&mut self, service_id: Option<u32>, backend_slot: Option<u32>) {
        let Some((services, backends)) = self.counters.as_mut() else {
            return;
        };
        let Ok(cpus) = aya::util::nr_cpus() else {
            return;
        };
        let zeros = || PerCpuValues::try_from(vec![ServiceStats::default(); cpus]);
        for (array, index) in [(services, service_id), (backends, backend_slot)] {
            if let (Some(index), Ok(zeros)) = (index, zeros()) {
                if let Err(e) = array.set(index, zeros, 0) {
                    tracing::debug!(index, "zeroing a traffic counter: {e}");
                }
            }
        }
    }

    fn set_names(&mut self, names: &[(u32, ServiceName)]) -> Result<(), MapError> {
        let Some(map) = self.names.as_mut() else {
            return Ok(());
        };
        let (ids, values): (Vec<u32>, Vec<ServiceName>) = names.iter().copied().unzip();
        Self::insert_all(
            &mut self.batches,
            map,
            &ids,
            &values,
            "SERVICE_NAMES",
            self.services_capacity,
        )
    }

    fn set_maglevs(&mut self, entries: &[(MaglevKey, u32)]) -> Result<(), MapError> {
        let (keys, slots): (Vec<MaglevKey>, Vec<u32>) = entries.iter().copied().unzip();
        let capacity = self.maglev_capacity;
        Self::insert_all(
            &mut self.batches,
            &mut self.maglev,
            &keys,
            &slots,
            "MAGLEV",
            capacity,
        )
    }

    fn remove_backend(&mut self, id: u32) -> Result<(), MapError> {
        let capacity = self.backends.len();
        // The generation stays: see `Backend::retired`.
        self.backends
            .set(id & BACKEND_INDEX_MASK, Backend::retired(id), 0)
            .map_err(|e| classify("BACKENDS", capacity, e))
    }

    fn add_source_range(&mut self, (id, addr, prefix): SourceRange) -> Result<(), MapError> {
        match addr {
            IpAddr::V4(a) => self
                .source_ranges
                .insert(&lpm_key(id, a, prefix), 1, 0)
                .map_err(|e| classify("SOURCE_RANGES", self.services_capacity, e)),
            IpAddr::V6(a) => self
                .source_ranges6
                .insert(&lpm_key6(id, a, prefix), 1, 0)
                .map_err(|e| classify("SOURCE_RANGES6", self.services_capacity, e)),
        }
    }

    fn remove_source_range(&mut self, (id, addr, prefix): SourceRange) -> Result<(), MapError> {
        match addr {
            IpAddr::V4(a) => self
                .source_ranges
                .remove(&lpm_key(id, a, prefix))
                .or_else(|e| ignore_missing("SOURCE_RANGES", self.services_capacity, e)),
            IpAddr::V6(a) => self
                .source_ranges6
                .remove(&lpm_key6(id, a, prefix))
                .or_else(|e| ignore_missing("SOURCE_RANGES6", self.services_capacity, e)),
        }
    }

    fn set_maglev(&mut self, key: MaglevKey, slot: u32) -> Result<(), MapError> {
        self.maglev
            .insert(key, slot, 0)
            .map_err(|e| classify("MAGLEV", self.maglev_capacity, e))
    }

    fn remove_maglev(&mut self, key: MaglevKey) -> Result<(), MapError> {
        self.maglev
            .remove(&key)
            .or_else(|e| ignore_missing("MAGLEV", self.maglev_capacity, e))
    }

    fn backend_slots(&self) -> u32 {
        self.backends.len()
    }

    fn service_slots(&self) -> u32 {
        self.services_capacity
    }

    fn services_capacity(&self) -> Option<(usize, bool)> {
        Some((self.services_capacity as usize, true))
    }

    fn entries(&self) -> Result<MapContents, MapError> {
        let other = |map: &'static str| {
            move |e: AyaMapError| MapError::Other {
                map,
                message: e.to_string(),
            }
        };
        use aya::maps::IterableMap;
        let mut contents = MapContents::default();
        let services = read_all(self.services.map(), || self.services.iter().collect())
            .map_err(other("SERVICES"))?;
        let services6 = read_all(self.services6.map(), || self.services6.iter().collect())
            .map_err(other("SERVICES6"))?;
        contents.services.extend(
            (services.into_iter().map(|(k, v)| (ServiceMapKey::V4(k), v))).chain(
                services6
                    .into_iter()
                    .map(|(k, v)| (ServiceMapKey::V6(k), v)),
            ),
        );
        let backends = read_all(self.backends.map(), || {
            (0..)
                .zip(self.backends.iter())
                .map(|(slot, b)| b.map(|b| (slot, b)))
                .collect()
        })
        .map_err(other("BACKENDS"))?;
        for (slot, b) in backends {
            if !b.in_use() {
                if b.id != 0 {
                    contents.retired.push((slot, b.id | slot));
                }
                continue;
            }
            {
                if b.flags & BACKEND_FLAG_IPV6 != 0 {
                    let slot = b.id & BACKEND_INDEX_MASK;
                    let a = self
                        .backend_addrs6
                        .get(&slot, 0)
                        .map_err(other("BACKEND_ADDRS6"))?;
                    contents.backend_addrs6.insert(slot, a);
                }
                contents.backends.push(b);
            }
        }
        for key in self.source_ranges.keys() {
            let key = key.map_err(other("SOURCE_RANGES"))?;
            let data = key.data();
            contents.source_ranges.push((
                data.service_id,
                std::net::Ipv4Addr::from(u32::from_be(data.addr)).into(),
                key.prefix_len().saturating_sub(32) as u8,
            ));
        }
        for key in self.source_ranges6.keys() {
            let key = key.map_err(other("SOURCE_RANGES6"))?;
            let data = key.data();
            contents.source_ranges.push((
                data.service_id,
                std::net::Ipv6Addr::from(data.addr).into(),
                key.prefix_len().saturating_sub(32) as u8,
            ));
        }
        Ok(contents)
    }
}
