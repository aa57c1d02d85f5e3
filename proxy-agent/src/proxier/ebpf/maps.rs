//! The maps the agent writes (`SERVICES`, `BACKENDS`, `SOURCE_RANGES`) behind a small trait, so the sync
//! logic is tested against [`InMemoryMaps`] without a kernel and runs against [`KernelMaps`]
//! in production.

use std::collections::BTreeMap;

use std::collections::BTreeSet;

use aya::maps::{
    lpm_trie::{Key as LpmKey, LpmTrie},
    Array, HashMap as BpfHashMap, MapData, MapError as AyaMapError,
};
use proxy_common::{
    Backend, MaglevKey, ServiceKey, ServiceValue, SourceRangeKey, BACKEND_INDEX_MASK,
};

/// One `loadBalancerSourceRanges` entry of a frontend: (service id, IPv4 address in network
/// byte order, prefix length).
pub type SourceRange = (u32, u32, u8);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MapError {
    #[error("eBPF map {map} is full ({capacity} entries); raise its size in the configuration")]
    Full { map: &'static str, capacity: u32 },
    #[error("eBPF map {map}: {message}")]
    Other { map: &'static str, message: String },
}

/// `BACKENDS` is an array: the agent allocates its slots (see `sync::BackendIds`), so only
/// `SERVICES` can be full at write time.
pub trait ServiceMaps {
    fn set_service(&mut self, key: ServiceKey, value: ServiceValue) -> Result<(), MapError>;
    fn remove_service(&mut self, key: &ServiceKey) -> Result<(), MapError>;
    fn set_backend(&mut self, id: u32, backend: Backend) -> Result<(), MapError>;
    fn remove_backend(&mut self, id: u32) -> Result<(), MapError>;
    fn add_source_range(&mut self, range: SourceRange) -> Result<(), MapError>;
    fn remove_source_range(&mut self, range: SourceRange) -> Result<(), MapError>;
    fn set_maglev(&mut self, key: MaglevKey, slot: u32) -> Result<(), MapError>;
    fn remove_maglev(&mut self, key: MaglevKey) -> Result<(), MapError>;
    /// Number of `BACKENDS` slots (slot 0 is never used).
    fn backend_slots(&self) -> u32;
    /// Number of `SERVICE_STATS` slots, which service ids index (slot 0 is never used).
    fn service_slots(&self) -> u32;
    /// Everything in the maps, for adopting maps a previous agent left pinned: `SERVICES`
    /// entries, and the `BACKENDS` slots in use.
    fn entries(&self) -> Result<MapContents, MapError>;
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MapContents {
    pub services: Vec<(ServiceKey, ServiceValue)>,
    pub backends: Vec<Backend>,
    pub source_ranges: Vec<SourceRange>,
}

/// A map-shaped model of the kernel maps, with the same capacity behaviour (an insert of a
/// new key into a full hash map fails; overwriting an existing key does not). Backends are
/// keyed by their full id; a removed backend is absent, as an emptied array slot is to the
/// datapath.
#[derive(Debug, Clone)]
pub struct InMemoryMaps {
    pub services: BTreeMap<ServiceKey, ServiceValue>,
    pub backends: BTreeMap<u32, Backend>,
    pub source_ranges: BTreeSet<SourceRange>,
    /// (service id, entry) -> slot.
    pub maglev: BTreeMap<(u32, u32), u32>,
    pub services_capacity: Option<usize>,
    /// Size of the modelled `BACKENDS` array.
    pub backend_slots: u32,
    /// Number of write/delete operations performed, to check that syncs write only the
    /// difference.
    pub operations: usize,
}

impl Default for InMemoryMaps {
    fn default() -> Self {
        Self {
            services: BTreeMap::new(),
            backends: BTreeMap::new(),
            source_ranges: BTreeSet::new(),
            maglev: BTreeMap::new(),
            services_capacity: None,
            backend_slots: 65536,
            operations: 0,
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
    fn set_service(&mut self, key: ServiceKey, value: ServiceValue) -> Result<(), MapError> {
        check_capacity(&self.services, &key, self.services_capacity, "SERVICES")?;
        self.operations += 1;
        self.services.insert(key, value);
        Ok(())
    }

    fn remove_service(&mut self, key: &ServiceKey) -> Result<(), MapError> {
        self.operations += 1;
        self.services.remove(key);
        Ok(())
    }

    fn set_backend(&mut self, id: u32, backend: Backend) -> Result<(), MapError> {
        self.operations += 1;
        self.backends.insert(id, backend);
        Ok(())
    }

    fn remove_backend(&mut self, id: u32) -> Result<(), MapError> {
        self.operations += 1;
        self.backends.remove(&id);
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

    fn entries(&self) -> Result<MapContents, MapError> {
        Ok(MapContents {
            services: self.services.iter().map(|(k, v)| (*k, *v)).collect(),
            backends: self.backends.values().copied().collect(),
            source_ranges: self.source_ranges.iter().copied().collect(),
        })
    }
}

/// The LPM key of a source range: the whole service id, then the range's prefix.
fn lpm_key((service_id, addr, prefix): SourceRange) -> LpmKey<SourceRangeKey> {
    LpmKey::new(32 + prefix as u32, SourceRangeKey { service_id, addr })
}

/// The kernel's maps, through aya.
pub struct KernelMaps {
    pub services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
    pub backends: Array<MapData, Backend>,
    pub source_ranges: LpmTrie<MapData, SourceRangeKey, u8>,
    pub maglev: BpfHashMap<MapData, MaglevKey, u32>,
    pub maglev_capacity: u32,
    /// Active-connection counters per backend slot, zeroed when a slot takes a new backend.
    pub backend_conns: Array<MapData, u64>,
    pub backend_released: Array<MapData, u64>,
    pub services_capacity: u32,
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
    fn set_service(&mut self, key: ServiceKey, value: ServiceValue) -> Result<(), MapError> {
        self.services
            .insert(key, value, 0)
            .map_err(|e| classify("SERVICES", self.services_capacity, e))
    }

    fn remove_service(&mut self, key: &ServiceKey) -> Result<(), MapError> {
        self.services
            .remove(key)
            .or_else(|e| ignore_missing("SERVICES", self.services_capacity, e))
    }

    fn set_backend(&mut self, id: u32, backend: Backend) -> Result<(), MapError> {
        let capacity = self.backends.len();
        let slot = id & BACKEND_INDEX_MASK;
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

    fn remove_backend(&mut self, id: u32) -> Result<(), MapError> {
        let capacity = self.backends.len();
        self.backends
            .set(id & BACKEND_INDEX_MASK, Backend::EMPTY, 0)
            .map_err(|e| classify("BACKENDS", capacity, e))
    }

    fn add_source_range(&mut self, range: SourceRange) -> Result<(), MapError> {
        self.source_ranges
            .insert(&lpm_key(range), 1, 0)
            .map_err(|e| classify("SOURCE_RANGES", self.services_capacity, e))
    }

    fn remove_source_range(&mut self, range: SourceRange) -> Result<(), MapError> {
        self.source_ranges
            .remove(&lpm_key(range))
            .or_else(|e| ignore_missing("SOURCE_RANGES", self.services_capacity, e))
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

    fn entries(&self) -> Result<MapContents, MapError> {
        let other = |map: &'static str| {
            move |e: AyaMapError| MapError::Other {
                map,
                message: e.to_string(),
            }
        };
        let mut contents = MapContents::default();
        for entry in self.services.iter() {
            contents.services.push(entry.map_err(other("SERVICES"))?);
        }
        for b in self.backends.iter() {
            let b = b.map_err(other("BACKENDS"))?;
            if b.id != 0 {
                contents.backends.push(b);
            }
        }
        for key in self.source_ranges.keys() {
            let key = key.map_err(other("SOURCE_RANGES"))?;
            let data = key.data();
            contents.source_ranges.push((
                data.service_id,
                data.addr,
                key.prefix_len().saturating_sub(32) as u8,
            ));
        }
        Ok(contents)
    }
}
