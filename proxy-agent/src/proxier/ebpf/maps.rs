//! The two maps the agent writes (`SERVICES`, `BACKENDS`) behind a small trait, so the sync
//! logic is tested against [`InMemoryMaps`] without a kernel and runs against [`KernelMaps`]
//! in production.

use std::collections::BTreeMap;

use aya::maps::{HashMap as BpfHashMap, MapData, MapError as AyaMapError};
use proxy_common::{Backend, ServiceKey, ServiceValue};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MapError {
    #[error("eBPF map {map} is full ({capacity} entries); raise its size in the configuration")]
    Full { map: &'static str, capacity: u32 },
    #[error("eBPF map {map}: {message}")]
    Other { map: &'static str, message: String },
}

pub trait ServiceMaps {
    fn set_service(&mut self, key: ServiceKey, value: ServiceValue) -> Result<(), MapError>;
    fn remove_service(&mut self, key: &ServiceKey) -> Result<(), MapError>;
    fn set_backend(&mut self, id: u32, backend: Backend) -> Result<(), MapError>;
    fn remove_backend(&mut self, id: u32) -> Result<(), MapError>;
}

/// A map-shaped model of the kernel maps, with the same capacity behaviour (an insert of a
/// new key into a full map fails; overwriting an existing key does not).
#[derive(Debug, Clone, Default)]
pub struct InMemoryMaps {
    pub services: BTreeMap<ServiceKey, ServiceValue>,
    pub backends: BTreeMap<u32, Backend>,
    pub services_capacity: Option<usize>,
    pub backends_capacity: Option<usize>,
    /// Number of write/delete operations performed, to check that syncs write only the
    /// difference.
    pub operations: usize,
}

impl InMemoryMaps {
    pub fn with_capacity(services: usize, backends: usize) -> Self {
        Self {
            services_capacity: Some(services),
            backends_capacity: Some(backends),
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
        check_capacity(&self.backends, &id, self.backends_capacity, "BACKENDS")?;
        self.operations += 1;
        self.backends.insert(id, backend);
        Ok(())
    }

    fn remove_backend(&mut self, id: u32) -> Result<(), MapError> {
        self.operations += 1;
        self.backends.remove(&id);
        Ok(())
    }
}

/// The kernel's maps, through aya.
pub struct KernelMaps {
    pub services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
    pub backends: BpfHashMap<MapData, u32, Backend>,
    pub services_capacity: u32,
    pub backends_capacity: u32,
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
        self.backends
            .insert(id, backend, 0)
            .map_err(|e| classify("BACKENDS", self.backends_capacity, e))
    }

    fn remove_backend(&mut self, id: u32) -> Result<(), MapError> {
        self.backends
            .remove(&id)
            .or_else(|e| ignore_missing("BACKENDS", self.backends_capacity, e))
    }
}
