use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr},
};

use proxy_common::{Backend, BackendAddr6, ServiceValue};

use super::*;
use crate::{
    model::Protocol,
    proxier::ebpf::maps::{InMemoryMaps, MapError, ServiceMaps},
};

fn frontend(last: u8) -> Frontend {
    Frontend {
        addr: Ipv4Addr::new(10, 96, 0, last).into(),
        port: 80,
        protocol: Protocol::Tcp,
    }
}

fn pods(range: std::ops::Range<u8>) -> Vec<SocketAddr> {
    range
        .map(|i| SocketAddr::new(Ipv4Addr::new(10, 244, 0, i).into(), 8080))
        .collect()
}

/// What a packet arriving now would be sent to: `None` if the frontend is unknown, else the
/// set of backends reachable through the header's slots (panics on a dangling slot or
/// backend, which a packet would hit).
fn datapath_view(maps: &InMemoryMaps, f: &Frontend) -> Option<Vec<SocketAddr>> {
    let header = maps.services.get(&service_key(f, 0))?;
    let mut out = Vec::new();
    for slot in 1..=header.count {
        let v = maps
            .services
            .get(&service_key(f, slot))
            .unwrap_or_else(|| panic!("{f}: slot {slot} of {} missing", header.count));
        let b = maps
            .backends
            .get(&v.backend_id)
            .unwrap_or_else(|| panic!("{f}: slot {slot} names missing backend {}", v.backend_id));
        out.push(
            backend_addr(b, &maps.backend_addrs6)
                .unwrap_or_else(|| panic!("{f}: backend {} has no IPv6 address", b.id)),
        );
    }
    out.sort();
    Some(out)
}

/// Runs the in-memory maps and, after every single write, checks what a packet would see
/// for `watched`: always a complete service, never zero backends while `nonempty`.
struct CheckedMaps {
    inner: InMemoryMaps,
    watched: Frontend,
    nonempty: bool,
    allowed: Vec<SocketAddr>,
    checks: usize,
}

impl CheckedMaps {
    fn check(&mut self) {
        self.checks += 1;
        // A header that asks for source ranges always finds some: a moment without them
        // would drop every new flow.
        if let Some(h) = self.inner.services.get(&service_key(self.watched, 0)) {
            if h.flags & proxy_common::SERVICE_FLAG_SOURCE_RANGES != 0 {
                assert!(
                    self.inner
                        .source_ranges
                        .iter()
                        .any(|(id, _, _)| *id == h.service_id),
                    "header asks for source ranges that are not written"
                );
            }
        }
        if let Some(view) = datapath_view(&self.inner, &self.watched) {
            if self.nonempty {
                assert!(!view.is_empty(), "service went through zero backends");
            }
            for b in &view {
                assert!(
                    self.allowed.contains(b),
                    "{b} is neither an old nor a new backend"
                );
            }
        }
    }
}

impl ServiceMaps for CheckedMaps {
    fn set_service(&mut self, key: ServiceMapKey, value: ServiceValue) -> Result<(), MapError> {
        self.inner.set_service(key, value)?;
        self.check();
        Ok(())
    }
    fn remove_service(&mut self, key: &ServiceMapKey) -> Result<(), MapError> {
        self.inner.remove_service(key)?;
        self.check();
        Ok(())
    }
    fn set_backend(
        &mut self,
        id: u32,
        backend: Backend,
        addr6: Option<BackendAddr6>,
    ) -> Result<(), MapError> {
        self.inner.set_backend(id, backend, addr6)?;
        self.check();
        Ok(())
    }
    fn remove_backend(&mut self, id: u32) -> Result<(), MapError> {
        self.inner.remove_backend(id)?;
        self.check();
        Ok(())
    }
    fn add_source_range(
        &mut self,
        range: crate::proxier::ebpf::maps::SourceRange,
    ) -> Result<(), MapError> {
        self.inner.add_source_range(range)?;
        self.check();
        Ok(())
    }
    fn remove_source_range(
        &mut self,
        range: crate::proxier::ebpf::maps::SourceRange,
    ) -> Result<(), MapError> {
        self.inner.remove_source_range(range)?;
        self.check();
        Ok(())
    }
    fn set_maglev(&mut self, key: proxy_common::MaglevKey, slot: u32) -> Result<(), MapError> {
        self.inner.set_maglev(key, slot)?;
        self.check();
        Ok(())
    }
    fn remove_maglev(&mut self, key: proxy_common::MaglevKey) -> Result<(), MapError> {
        self.inner.remove_maglev(key)?;
        self.check();
        Ok(())
    }
    fn backend_slots(&self) -> u32 {
        self.inner.backend_slots()
    }
    fn service_slots(&self) -> u32 {
        self.inner.service_slots()
    }

    fn services_capacity(&self) -> Option<(usize, bool)> {
        self.inner.services_capacity()
    }
    fn entries(&self) -> Result<crate::proxier::ebpf::maps::MapContents, MapError> {
        self.inner.entries()
    }
}

#[test]
fn replacing_backends_never_passes_through_zero_or_a_dangling_slot() {
    let f = frontend(1);
    let mut sync = MapSync::new(CheckedMaps {
        inner: InMemoryMaps::default(),
        watched: f,
        nonempty: false,
        allowed: pods(1..200),
        checks: 0,
    });
    sync.set(f, &pods(1..4)).unwrap();
    sync.maps.nonempty = true;
    // Every kind of replacement: all at once, grow, shrink, partial overlap, one swap.
    let steps = [
        pods(10..13),
        pods(10..40),
        pods(35..37),
        pods(36..90),
        pods(1..2),
        pods(2..3),
        pods(50..150),
        pods(100..101),
    ];
    for want in steps {
        sync.set(f, &want).unwrap();
        assert_eq!(datapath_view(&sync.maps.inner, &f).unwrap(), want);
    }
    assert!(sync.maps.checks > 300, "checked after every write");
}

#[test]
fn one_endpoint_change_costs_three_writes_whatever_the_service_size() {
    let f = frontend(1);
    let mut sync = MapSync::new(InMemoryMaps::default());
    let mut backends = pods(1..201);
    sync.set(f, &backends).unwrap();
    backends.retain(|b| b.ip() != std::net::IpAddr::from([10, 244, 0, 57]));
    backends.push(SocketAddr::new(Ipv4Addr::new(10, 244, 1, 1).into(), 8080));
    let ops = sync.set(f, &backends).unwrap();
    // new backend, the departed one's slot, the departed backend's deletion
    assert_eq!(ops, 3);
    assert_eq!(sync.set(f, &backends).unwrap(), 0, "no change, no write");
    backends.sort();
    assert_eq!(datapath_view(sync.maps(), &f).unwrap(), backends);
}

#[test]
fn a_service_without_endpoints_keeps_a_header_with_count_zero() {
    let f = frontend(1);
    let mut sync = MapSync::new(InMemoryMaps::default());
    sync.set(f, &[]).unwrap();
    assert_eq!(datapath_view(sync.maps(), &f), Some(vec![]));
    sync.set(f, &pods(1..3)).unwrap();
    sync.set(f, &[]).unwrap();
    assert_eq!(datapath_view(sync.maps(), &f), Some(vec![]));
    assert_eq!(sync.maps().services.len(), 1, "only the header is left");
    assert!(sync.maps().backends.is_empty());
}

#[test]
fn removal_leaves_nothing_behind() {
    let mut sync = MapSync::new(InMemoryMaps::default());
    for i in 1..5 {
        sync.set(frontend(i), &pods(1..(i * 3))).unwrap();
    }
    for i in 1..5 {
        sync.remove(frontend(i)).unwrap();
    }
    assert!(sync.maps().services.is_empty());
    assert!(sync.maps().backends.is_empty());
    assert_eq!(
        sync.remove(frontend(1)).unwrap(),
        0,
        "removing twice is harmless"
    );
}

#[test]
fn full_map_fails_one_service_cleanly_and_the_others_keep_working() {
    // Room for 2 headers + 8 slots, and 8 backends (slot 0 of BACKENDS is never used).
    let mut sync = MapSync::new(InMemoryMaps::with_capacity(10, 9));
    sync.set(frontend(1), &pods(1..5)).unwrap(); // 5 service entries, 4 backends
    let err = sync.set(frontend(2), &pods(10..16)).unwrap_err(); // needs 6 more backends
    assert_eq!(
        err,
        MapError::Full {
            map: "BACKENDS",
            capacity: 8
        }
    );
    assert!(err.to_string().contains("raise its size"), "{err}");
    assert_eq!(
        datapath_view(sync.maps(), &frontend(2)),
        None,
        "no half-written service"
    );
    assert_eq!(
        datapath_view(sync.maps(), &frontend(1)).unwrap(),
        pods(1..5),
        "the other service is intact"
    );
    // Once room is made, the same call succeeds from scratch.
    sync.remove(frontend(1)).unwrap();
    sync.set(frontend(2), &pods(10..16)).unwrap();
    assert_eq!(
        datapath_view(sync.maps(), &frontend(2)).unwrap(),
        pods(10..16)
    );
}

#[test]
fn backend_ids_are_not_reused_right_away() {
    let f = frontend(1);
    let mut sync = MapSync::new(InMemoryMaps::default());
    sync.set(f, &pods(1..2)).unwrap();
    let first: Vec<u32> = sync.maps().backends.keys().copied().collect();
    sync.set(f, &pods(2..3)).unwrap();
    let second: Vec<u32> = sync.maps().backends.keys().copied().collect();
    assert_ne!(
        first, second,
        "a flow pinned to the old id must not follow it to a new pod"
    );
}

#[test]
fn a_new_agent_adopts_the_maps_keeping_ids_and_writing_nothing_that_is_right() {
    let mut first = MapSync::new(InMemoryMaps::default());
    for i in 1..4 {
        first.set(frontend(i), &pods(1..(i * 4))).unwrap();
    }
    first.set(frontend(9), &[]).unwrap();
    let maps = first.maps().clone();

    let mut second = MapSync::new(maps.clone());
    assert_eq!(second.adopt().unwrap(), 4);
    assert_eq!(
        second.maps().services,
        maps.services,
        "adopting consistent maps changes nothing"
    );
    assert_eq!(second.maps().backends, maps.backends);
    for i in 1..4 {
        assert_eq!(
            second.set(frontend(i), &pods(1..(i * 4))).unwrap(),
            0,
            "already right"
        );
    }
    assert_eq!(second.set(frontend(9), &[]).unwrap(), 0);
    // Conntrack entries name backend ids: a changed service keeps the ids of kept backends
    // and never hands a new backend an id that is still in use.
    let before: BTreeMap<u32, Backend> = second.maps().backends.clone();
    second.set(frontend(3), &pods(1..20)).unwrap();
    for (id, b) in &before {
        assert_eq!(
            second.maps().backends.get(id),
            Some(b),
            "id {id} changed meaning"
        );
    }
    assert_eq!(
        datapath_view(second.maps(), &frontend(3)).unwrap(),
        pods(1..20)
    );
}

#[test]
fn adoption_repairs_what_an_interrupted_agent_left_half_written() {
    let mut first = MapSync::new(InMemoryMaps::default());
    first.set(frontend(1), &pods(1..4)).unwrap();
    first.set(frontend(2), &pods(4..7)).unwrap();
    let mut maps = first.maps().clone();
    // frontend 1 lost a slot; frontend 2 has a leftover slot beyond its count; an orphan
    // backend and a slot without a header exist.
    maps.services.remove(&service_key(frontend(1), 2));
    let v = maps.services[&service_key(frontend(2), 1)];
    maps.services.insert(service_key(frontend(2), 7), v);
    maps.backends.insert(4242, Backend::new(4242, 1, 1, 0, 0));
    maps.services.insert(service_key(frontend(5), 1), v);

    let mut second = MapSync::new(maps);
    assert_eq!(second.adopt().unwrap(), 1, "only frontend 2 is consistent");
    assert_eq!(
        datapath_view(second.maps(), &frontend(1)),
        None,
        "broken frontend removed"
    );
    assert_eq!(
        datapath_view(second.maps(), &frontend(2)).unwrap(),
        pods(4..7)
    );
    assert!(!second
        .maps()
        .services
        .contains_key(&service_key(frontend(2), 7)));
    assert!(!second
        .maps()
        .services
        .contains_key(&service_key(frontend(5), 1)));
    assert!(!second.maps().backends.contains_key(&4242));
    assert_eq!(second.maps().backends.len(), 3);
    // And the sync that follows rebuilds frontend 1 from scratch.
    second.set(frontend(1), &pods(1..4)).unwrap();
    assert_eq!(
        datapath_view(second.maps(), &frontend(1)).unwrap(),
        pods(1..4)
    );
}

#[test]
fn source_ranges_are_written_before_the_header_asks_for_them_and_removed_after() {
    let f = frontend(7);
    let mut sync = MapSync::new(CheckedMaps {
        inner: InMemoryMaps::default(),
        watched: f,
        nonempty: false,
        allowed: pods(1..10),
        checks: 0,
    });
    let a = (Ipv4Addr::new(198, 51, 100, 0).into(), 24);
    let b = (Ipv4Addr::new(203, 0, 113, 7).into(), 32);
    sync.set_with(
        f,
        &FrontendSpec {
            source_ranges: &[a],
            ..FrontendSpec::new(&pods(1..3))
        },
    )
    .unwrap();
    sync.set_with(
        f,
        &FrontendSpec {
            source_ranges: &[a, b],
            ..FrontendSpec::new(&pods(1..3))
        },
    )
    .unwrap();
    sync.set_with(
        f,
        &FrontendSpec {
            source_ranges: &[b],
            ..FrontendSpec::new(&pods(1..3))
        },
    )
    .unwrap();
    let ranges: Vec<_> = sync
        .maps
        .inner
        .source_ranges
        .iter()
        .map(|r| (r.1, r.2))
        .collect();
    assert_eq!(ranges, vec![(b.0, 32)]);
    sync.set_with(
        f,
        &FrontendSpec {
            source_ranges: &[],
            ..FrontendSpec::new(&pods(1..3))
        },
    )
    .unwrap();
    let h = sync.maps.inner.services[&service_key(f, 0)];
    assert_eq!(h.flags & proxy_common::SERVICE_FLAG_SOURCE_RANGES, 0);
    assert!(sync.maps.inner.source_ranges.is_empty());
    sync.set_with(
        f,
        &FrontendSpec {
            source_ranges: &[a],
            ..FrontendSpec::new(&pods(1..3))
        },
    )
    .unwrap();
    sync.remove(f).unwrap();
    assert!(
        sync.maps.inner.source_ranges.is_empty(),
        "removed with the frontend"
    );
}

#[test]
fn a_draining_backend_keeps_its_id_without_a_slot_and_survives_adoption() {
    let f = frontend(9);
    let mut sync = MapSync::new(InMemoryMaps::default());
    let all = pods(1..4);
    sync.set(f, &all).unwrap();
    let id_of = |sync: &MapSync<InMemoryMaps>, addr: SocketAddr| {
        sync.backend_ids()
            .find(|(_, a, _)| *a == addr)
            .map(|(_, _, id)| id)
    };
    let leaving = all[0];
    let id = id_of(&sync, leaving).unwrap();
    // The endpoint turns terminating: no slot, same id, still in BACKENDS.
    let spec = FrontendSpec {
        draining: &[leaving],
        ..FrontendSpec::new(&all[1..])
    };
    sync.set_with(f, &spec).unwrap();
    assert_eq!(datapath_view(&sync.maps, &f).unwrap(), all[1..].to_vec());
    assert_eq!(
        sync.maps.backends[&id].id, id,
        "its established flows go on"
    );
    // A new agent adopts the maps and finds it again.
    let mut adopted = MapSync::new(sync.maps.clone());
    adopted.adopt().unwrap();
    assert!(adopted.maps.backends.contains_key(&id), "kept by adoption");
    // Ready again: back into a slot with the same id.
    adopted.set(f, &all).unwrap();
    assert_eq!(id_of(&adopted, leaving), Some(id));
    // Gone: removed.
    adopted.set_with(f, &spec).unwrap();
    adopted.set(f, &all[1..]).unwrap();
    assert!(!adopted.maps.backends.contains_key(&id));
}

fn frontend6(last: u16) -> Frontend {
    Frontend {
        addr: std::net::Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, last).into(),
        port: 80,
        protocol: Protocol::Tcp,
    }
}

fn pods6(range: std::ops::Range<u16>) -> Vec<SocketAddr> {
    range
        .map(|i| {
            SocketAddr::new(
                std::net::Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, i).into(),
                8080,
            )
        })
        .collect()
}

#[test]
fn ipv6_frontends_go_to_their_own_map_and_share_backend_ids_with_ipv4() {
    let mut sync = MapSync::new(InMemoryMaps::default());
    sync.set(frontend(1), &pods(1..3)).unwrap();
    sync.set(frontend6(1), &pods6(1..4)).unwrap();
    let maps = sync.maps();
    assert!(matches!(
        maps.services.keys().find(|k| k.slot() == 0 && matches!(k, ServiceMapKey::V6(_))),
        Some(ServiceMapKey::V6(k)) if k.addr == std::net::Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 1).octets()
    ));
    assert_eq!(datapath_view(maps, &frontend6(1)), Some(pods6(1..4)));
    assert_eq!(datapath_view(maps, &frontend(1)), Some(pods(1..3)));
    // One id space: no IPv6 backend shares an id with an IPv4 one.
    let ids: Vec<u32> = sync.backend_ids().map(|(_, _, id)| id).collect();
    let unique: std::collections::BTreeSet<u32> = ids.iter().copied().collect();
    assert_eq!(ids.len(), 5);
    assert_eq!(unique.len(), 5);
    for (f, _, id) in sync.backend_ids() {
        let b = maps.backends[&id];
        let v6 = b.flags & proxy_common::BACKEND_FLAG_IPV6 != 0;
        assert_eq!(v6, f.frontend().family() == crate::model::IpFamily::V6);
        assert_eq!(
            maps.backend_addrs6.contains_key(&(id & BACKEND_INDEX_MASK)),
            v6
        );
    }

    // A new agent adopts both families as they are.
    let mut second = MapSync::new(maps.clone());
    assert_eq!(second.adopt().unwrap(), 2);
    assert_eq!(second.set(frontend6(1), &pods6(1..4)).unwrap(), 0);
    assert_eq!(second.set(frontend(1), &pods(1..3)).unwrap(), 0);
    // ... and changes them as usual.
    second.set(frontend6(1), &pods6(2..4)).unwrap();
    assert_eq!(
        datapath_view(second.maps(), &frontend6(1)),
        Some(pods6(2..4))
    );
    second.remove(frontend6(1)).unwrap();
    assert!(second
        .maps()
        .services
        .keys()
        .all(|k| matches!(k, ServiceMapKey::V4(_))));
}

/// Conntrack and affinity entries name backend ids; a removed backend's id must not come
/// back for another backend, neither after a restart (a new agent adopting the maps) nor
/// after a full sync (which reloads what the maps hold). Before, both started every slot
/// at generation 0 again, so the first reuse of a slot repeated an old id.
#[test]
fn removed_backend_ids_never_come_back_after_a_restart_or_a_full_sync() {
    // Four BACKENDS slots (slot 0 is never used), so every set below reuses them.
    let mut sync = MapSync::new(InMemoryMaps::with_capacity(100, 5));
    sync.set(frontend(1), &pods(1..5)).unwrap();
    let mut seen: BTreeSet<u32> = sync.maps().backends.keys().copied().collect();
    sync.remove(frontend(1)).unwrap();

    // A restart: a new agent adopts the maps.
    let mut restarted = MapSync::new(sync.maps().clone());
    restarted.adopt().unwrap();
    restarted.set(frontend(2), &pods(10..14)).unwrap();
    for id in restarted.maps().backends.keys() {
        assert!(
            seen.insert(*id),
            "id {id:#x} handed out again after a restart"
        );
    }
    restarted.remove(frontend(2)).unwrap();

    // A full sync: the same agent reloads from the maps.
    restarted.reload_from_maps().unwrap();
    restarted.set(frontend(3), &pods(20..24)).unwrap();
    for id in restarted.maps().backends.keys() {
        assert!(
            seen.insert(*id),
            "id {id:#x} handed out again after a full sync"
        );
    }
    assert_eq!(seen.len(), 12);
}

/// An update that cannot be written (here SERVICES fills up) leaves the frontend as it was,
/// with the same backend ids, instead of without any state: the Service keeps serving its
/// old endpoints, established flows keep theirs, and the update is retried later.
#[test]
fn a_failed_update_keeps_what_was_serving() {
    // Room for 10 SERVICES entries: f1 (1 + 4) and f2 (1 + 2) use 8.
    let mut sync = MapSync::new(InMemoryMaps::with_capacity(10, 64));
    sync.set(frontend(1), &pods(1..5)).unwrap();
    sync.set(frontend(2), &pods(20..22)).unwrap();
    let before = sync.maps().clone();
    let err = sync.set(frontend(1), &pods(1..8)).unwrap_err();
    assert_eq!(
        sync.maps().operations,
        before.operations,
        "the room is checked first: not one entry was touched, so no packet saw a gap"
    );
    assert!(
        matches!(
            err,
            MapError::Full {
                map: "SERVICES",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        datapath_view(sync.maps(), &frontend(1)).unwrap(),
        pods(1..5),
        "the old endpoints still serve"
    );
    assert_eq!(sync.maps().services, before.services);
    assert_eq!(sync.maps().backends, before.backends, "same ids");
    assert_eq!(
        datapath_view(sync.maps(), &frontend(2)).unwrap(),
        pods(20..22)
    );
    // Once there is room, the update goes through from the old state.
    sync.remove(frontend(2)).unwrap();
    sync.set(frontend(1), &pods(1..8)).unwrap();
    assert_eq!(
        datapath_view(sync.maps(), &frontend(1)).unwrap(),
        pods(1..8)
    );
}
