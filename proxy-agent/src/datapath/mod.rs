//! Loading the eBPF datapath: the object embedded at build time, maps sized from
//! configuration, programs verified by the kernel.

pub mod attach;
pub mod batch;
pub mod cgroup;
pub mod cleanup;
pub mod features;
pub mod owner;
pub mod pins;
pub mod reuse;
pub mod runtime;
pub mod sockets;

use anyhow::{bail, Context, Result};
use aya::{
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuValues, ProgramArray},
    programs::{Program, ProgramError, SchedClassifier},
    Ebpf, EbpfLoader,
};
use proxy_common::{
    map_names, program_names, tail_calls, ConntrackKey, ConntrackKey6, ConntrackValue,
    ConntrackValue6, DatapathConfig, DatapathConfig6, ServiceStats, Stat, CT_REFRESH_NS,
    MAX_BACKENDS,
};
use std::collections::HashMap;

use pins::BpffsRoot;

/// The object `cargo xtask build-ebpf` produced, or empty when the agent was built first.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf.o"));
/// Its build for kernels without `bpf_loop` (before 5.17), chosen by [`features`].
static EBPF_OBJECT_NO_BPF_LOOP: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf-no-bpf-loop.o"));

/// Map sizes (entries). Hash maps are preallocated by the kernel, so these are also the
/// datapath's memory budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DatapathSizes {
    /// `SERVICES`: one entry per service port plus one per (service port, endpoint).
    pub services: u32,
    /// `BACKENDS`: one entry per (service port, endpoint), plus the unused slot 0; at most
    /// [`proxy_common::MAX_BACKENDS`].
    pub backends: u32,
    /// `CONNTRACK`: two entries per tracked flow; least recently used entries are evicted.
    pub conntrack: u32,
    /// `MAGLEV`: the lookup tables of `mh` frontends (table size entries each). Allocated as
    /// used, so the size is a ceiling, not memory spent up front.
    pub maglev: u32,
}

impl Default for DatapathSizes {
    fn default() -> Self {
        Self {
            services: 262_144,
            backends: 262_144,
            conntrack: 262_144,
            maglev: 16_381 * 64,
        }
    }
}

/// `CT_NEW` (and `CT_NEW6`) entries for a given `CONNTRACK` size: flows between their first
/// packet and their client's first packet after a reply (a round trip, for TCP), so a
/// quarter of the confirmed flows' room is ample; a flood of spoofed sources fills it and
/// evicts only its own kind.
pub fn new_flows_size(conntrack: u32) -> u32 {
    (conntrack / 4).max(1024)
}

/// `FRAGMENTS` entries for a given `CONNTRACK` size.
pub fn fragments_size(conntrack: u32) -> u32 {
    (conntrack / 8).max(1024)
}

/// Optional parts of the classifier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Per-flow debug messages (aya-log), for -v 4.
    pub flow_log: bool,
    /// Per-backend packet/byte/connection counters.
    pub backend_stats: bool,
    /// Skip the IPv6 tc programs (a kernel whose verifier refuses them).
    pub without_ipv6: bool,
    /// The node's network namespace cookie for the socket hooks (0: the initial one).
    pub host_netns_cookie: u64,
    /// The socket hooks translate the node's own sockets only (`--socket-lb host-only`).
    pub sock_host_only: bool,
}

/// The verifier's verdict from a refused load: the error chain's first line and the
/// verifier log's lines that say why (its last ones), not the whole log.
fn verifier_summary(e: &anyhow::Error) -> String {
    let text = format!("{e:#}");
    let first = text.lines().next().unwrap_or_default();
    let first = first.split(". Verifier output").next().unwrap_or(first);
    let why: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| {
            l.starts_with("BPF program is too large")
                || l.starts_with("processed ")
                || l.contains("Too large")
                || l.contains("too complex")
        })
        .collect();
    if why.is_empty() {
        first.to_string()
    } else {
        format!("{first}: {}", why.join("; "))
    }
}

/// Explains the usual reasons a BPF load fails, in one line with the fix.
fn privilege_hint(err: &dyn std::fmt::Display) -> Option<&'static str> {
    let text = err.to_string();
    if text.contains("Operation not permitted") || text.contains("EPERM") {
        Some("the agent needs CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN (run it as root, or grant them: setcap cap_bpf,cap_perfmon,cap_net_admin+ep)")
    } else {
        None
    }
}

/// The loaded datapath: programs verified and loaded (not attached), maps created.
pub struct Datapath {
    pub ebpf: Ebpf,
    /// Programs taken from a previous agent's pins (`reuse`); the object's copies of them
    /// are not loaded.
    reused: HashMap<String, Program>,
    /// Whether the programs were reused rather than verified.
    pub programs_reused: bool,
    pub sizes: DatapathSizes,
    /// What was last written to `CONFIG`.
    pub config: DatapathConfig,
    /// What was last written to `CONFIG6`.
    pub config6: DatapathConfig6,
    /// Whether the IPv6 tc programs are loaded (else IPv6 packets pass untranslated).
    pub ipv6: bool,
}

/// What a conntrack garbage collection found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackSweep {
    /// Expired entries removed, from all four maps.
    pub deleted: usize,
    /// Entries left in `CONNTRACK` (the IPv4 map's fill).
    pub remaining: usize,
    /// Entries left in `CONNTRACK6` (the IPv6 map's fill; the same capacity).
    pub remaining6: usize,
    /// Entries left in `CT_NEW` (unconfirmed IPv4 flows).
    pub remaining_new: usize,
    /// Entries left in `CT_NEW6`.
    pub remaining_new6: usize,
    /// Entries the kernel's LRU evicted to make room, from either confirmed map, since the
    /// maps were created: what the datapath created, less what it removed, what garbage
    /// collection removed, and what is left (both families' entries are counted alike).
    /// Derived, as the kernel does not count evictions; entries created while the maps are
    /// walked make it lag (never lead) by a few.
    pub evicted: u64,
    /// The same for `CT_NEW`/`CT_NEW6`: unconfirmed flows pushed out by newer ones, which a
    /// flood of spoofed sources does; confirmed flows are untouched by it.
    pub evicted_new: u64,
}

/// Removes the expired entries of one conntrack map (IPv4 or IPv6); adds, per backend slot,
/// the removed flows the least-connection schedulers still counted to `released`.
/// `fields` gives an entry's (protocol, flags, last seen, backend id). Returns (entries
/// seen, entries removed).
fn sweep<K: aya::Pod, V: aya::Pod>(
    map: &mut BpfHashMap<&mut MapData, K, V>,
    fields: impl Fn(&K, &V) -> (u8, u8, u64, u32),
    expired: impl Fn(u8, u8, u64) -> bool,
    released: &mut std::collections::HashMap<u32, u64>,
) -> (usize, usize) {
    use aya::maps::IterableMap;
    // A full map is 262 144 entries by default: read in batches, not two system calls each.
    let entries = batch::lookup_all::<K, V>(map.map())
        .unwrap_or_else(|| map.iter().filter_map(|entry| entry.ok()).collect());
    let seen = entries.len();
    let stale: Vec<(K, V)> = entries
        .into_iter()
        .filter(|(k, v)| {
            let (proto, flags, last_seen_ns, _) = fields(k, v);
            expired(proto, flags, last_seen_ns)
        })
        .collect();
    let mut deleted = 0;
    for (key, value) in &stale {
        // Gone already if the datapath replaced the flow meanwhile.
        if map.remove(key).is_ok() {
            deleted += 1;
            let (_, flags, _, backend_id) = fields(key, value);
            if flags & proxy_common::CT_FLAG_COUNTED != 0 {
                *released
                    .entry(backend_id & proxy_common::BACKEND_INDEX_MASK)
                    .or_default() += 1;
            }
        }
    }
    (seen, deleted)
}

/// Another handle on `map`: its descriptor duplicated. (Opening a map by id would need
/// `CAP_SYS_ADMIN`, which the DaemonSet does not grant.)
pub fn duplicate(map: &MapData) -> Result<MapData> {
    use std::os::fd::AsFd;
    let fd = map
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .context("duplicating a map's descriptor")?;
    Ok(MapData::from_fd(fd)?)
}

/// A per-CPU traffic counter's total over the CPUs.
pub fn summed(per_cpu: &aya::maps::PerCpuValues<ServiceStats>) -> ServiceStats {
    per_cpu
        .iter()
        .fold(ServiceStats::default(), |a, s| ServiceStats {
            packets: a.packets + s.packets,
            bytes: a.bytes + s.bytes,
            connections: a.connections + s.connections,
        })
}

/// `CLOCK_MONOTONIC` in ns: the clock of `bpf_ktime_get_ns`, which stamps conntrack entries.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Datapath {
    pub fn object_available() -> bool {
        !EBPF_OBJECT.is_empty()
    }

    /// Every build of the datapath this agent carries: (name, object), empty when not built.
    pub fn embedded_builds() -> [(&'static str, &'static [u8]); 2] {
        [
            ("bpf_loop", EBPF_OBJECT),
            ("no-bpf-loop", EBPF_OBJECT_NO_BPF_LOOP),
        ]
    }

    /// The eBPF object built into this agent for this kernel (empty without one), for
    /// checks of what ships.
    pub fn embedded_object() -> &'static [u8] {
        let build = features::KernelFeatures::get().datapath_build();
        Self::embedded_builds()
            .into_iter()
            .find(|(name, object)| *name == build && !object.is_empty())
            .map_or(EBPF_OBJECT, |(_, object)| object)
    }

    /// Loads the programs and creates the maps; with `pins`, maps are pinned there, or
    /// reused from there when a previous agent left them (see [`crate::datapath::pins`]).
    /// Fails with the fix when the agent was built before the eBPF object.
    pub fn ensure_object() -> Result<()> {
        if !Self::object_available() {
            bail!(
                "this proxy-agent was built without its eBPF object: run `cargo xtask build-ebpf` \
                 (or `cargo xtask setup` on a new machine), then build the agent again"
            );
        }
        Ok(())
    }

    pub fn load(sizes: DatapathSizes, pins: Option<&BpffsRoot>) -> Result<Self> {
        Self::load_with(sizes, pins, LoadOptions::default())
    }

    /// Like [`Datapath::load`], with optional parts of the classifier switched on.
    pub fn load_with(
        sizes: DatapathSizes,
        pins: Option<&BpffsRoot>,
        options: LoadOptions,
    ) -> Result<Self> {
        Self::ensure_object()?;
        Self::load_object(Self::embedded_object(), sizes, pins, options)
    }

    /// Like [`Datapath::load`], with an object from a file (a different build of the
    /// datapath, to test upgrades).
    pub fn load_file(
        path: &std::path::Path,
        sizes: DatapathSizes,
        pins: Option<&BpffsRoot>,
        options: LoadOptions,
    ) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        // ELF parsing wants the object 8-byte aligned; copy it into u64s.
        let mut aligned = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: the u64 buffer has at least bytes.len() bytes.
        let view = unsafe {
            std::slice::from_raw_parts_mut(aligned.as_mut_ptr().cast::<u8>(), bytes.len())
        };
        view.copy_from_slice(&bytes);
        Self::load_object(view, sizes, pins, options)
    }

    fn load_object(
        object: &[u8],
        sizes: DatapathSizes,
        pins: Option<&BpffsRoot>,
        options: LoadOptions,
    ) -> Result<Self> {
        if sizes.backends < 2 || sizes.backends > MAX_BACKENDS {
            bail!(
                "backends map size {} is out of range (2..={MAX_BACKENDS})",
                sizes.backends
            );
        }
        // aya-log levels: 0 off ... 4 debug. Both switches are read-only globals the verifier
        // sees as constants: what is off is removed from the program.
        let log_level: u8 = if options.flow_log { 4 } else { 0 };
        let backend_stats = options.backend_stats as u8;
        let features = features::KernelFeatures::get();
        let set_retval = features.sock_set_retval as u8;
        let release = features.sock_release_cookie as u8;
        let host_only = options.sock_host_only as u8;
        // What a program is made of besides the object, for reusing pinned ones (`reuse`).
        let cookie = options.host_netns_cookie.to_le_bytes();
        let globals: [(&str, &[u8]); 6] = [
            (aya_log::LEVEL, &[log_level]),
            (proxy_common::BACKEND_STATS_ENABLED, &[backend_stats]),
            (proxy_common::SOCK_SET_RETVAL, &[set_retval]),
            (proxy_common::SOCK_RELEASE_ATTACHED, &[release]),
            (proxy_common::SOCK_HOST_ONLY, &[host_only]),
            (proxy_common::HOST_NETNS_COOKIE, &cookie),
        ];
        let mut loader = EbpfLoader::new();
        loader.override_global(aya_log::LEVEL, &log_level, false);
        loader.override_global(proxy_common::BACKEND_STATS_ENABLED, &backend_stats, true);
        loader.override_global(proxy_common::SOCK_SET_RETVAL, &set_retval, true);
        loader.override_global(proxy_common::SOCK_RELEASE_ATTACHED, &release, true);
        loader.override_global(proxy_common::SOCK_HOST_ONLY, &host_only, true);
        loader.override_global(
            proxy_common::HOST_NETNS_COOKIE,
            &options.host_netns_cookie,
            true,
        );
        loader
            .map_max_entries(map_names::SERVICES, sizes.services)
            .map_max_entries(map_names::BACKENDS, sizes.backends)
            .map_max_entries(map_names::CONNTRACK, sizes.conntrack)
            .map_max_entries(map_names::CT_NEW, new_flows_size(sizes.conntrack))
            // Service ids index it; there are never more service ports than SERVICES entries.
            .map_max_entries(map_names::SERVICE_STATS, sizes.services)
            // Named by the same ids (allocated as used).
            .map_max_entries(map_names::SERVICE_NAMES, sizes.services)
            .map_max_entries(map_names::BACKEND_STATS, sizes.backends)
            // One client per flow at most, so never more than conntrack holds.
            .map_max_entries(map_names::AFFINITY, sizes.conntrack)
            // Ranges are per frontend; as many as SERVICES has entries is ample.
            .map_max_entries(map_names::SOURCE_RANGES, sizes.services)
            // Datagrams in flight in pieces: a small share of the flows at any time.
            .map_max_entries(map_names::FRAGMENTS, fragments_size(sizes.conntrack))
            // The node's own sockets: fewer than the flows through it.
            .map_max_entries(map_names::SOCK_REVNAT, sizes.conntrack)
            // Clients (pods) of sockets, and sockets counted for lc: below the flows.
            .map_max_entries(map_names::SOCK_AFFINITY, sizes.conntrack)
            .map_max_entries(map_names::SOCK_LB, sizes.conntrack)
            // Round-robin turns, indexed by service id like SERVICE_STATS.
            .map_max_entries(map_names::RR_STATE, sizes.services)
            .map_max_entries(map_names::BACKEND_CONNS, sizes.backends)
            .map_max_entries(map_names::BACKEND_RELEASED, sizes.backends)
            .map_max_entries(map_names::LBLCR_SETS, sizes.services)
            .map_max_entries(map_names::MAGLEV, sizes.maglev)
            // IPv6 frontends and flows share the budgets of their IPv4 counterparts.
            .map_max_entries(map_names::SERVICES6, sizes.services)
            .map_max_entries(map_names::BACKEND_ADDRS6, sizes.backends)
            .map_max_entries(map_names::CONNTRACK6, sizes.conntrack)
            .map_max_entries(map_names::CT_NEW6, new_flows_size(sizes.conntrack))
            .map_max_entries(map_names::AFFINITY6, sizes.conntrack)
            .map_max_entries(map_names::SOURCE_RANGES6, sizes.services)
            .map_max_entries(map_names::SOCK_REVNAT6, sizes.conntrack)
            .map_max_entries(map_names::FRAGMENTS6, fragments_size(sizes.conntrack));
        if let Some(root) = pins {
            for name in [
                map_names::SERVICES,
                // What `inspect` names the pinned frontends by while no agent runs.
                map_names::SERVICE_NAMES,
                map_names::BACKENDS,
                map_names::CONNTRACK,
                map_names::CONFIG,
                map_names::STATS,
                map_names::SERVICE_STATS,
                map_names::BACKEND_STATS,
                map_names::AFFINITY,
                map_names::SOURCE_RANGES,
                map_names::FRAGMENTS,
                map_names::SOCK_REVNAT,
                map_names::RR_STATE,
                map_names::MAGLEV,
                map_names::BACKEND_CONNS,
                map_names::BACKEND_RELEASED,
                map_names::LBLCR_SETS,
                map_names::SERVICES6,
                map_names::BACKEND_ADDRS6,
                map_names::CONNTRACK6,
                map_names::CT_NEW,
                map_names::CT_NEW6,
                map_names::AFFINITY6,
                map_names::SOURCE_RANGES6,
                map_names::CONFIG6,
                map_names::SOCK_REVNAT6,
                map_names::FRAGMENTS6,
                map_names::SOCK_AFFINITY,
                // Counts of open sockets: the next agent's release hook gives them back.
                map_names::SOCK_LB,
                // Pinned so its slots outlive the agent: the kernel empties a program array
                // when the last user-space reference goes, which would stop IPv6 service
                // traffic (and refusals) while the agent restarts.
                map_names::TAIL_CALLS,
                // Pods stay told apart while the agent restarts.
                map_names::LOCAL_IFACES,
                // What `inspect flows --follow` reads and writes (see `inspect::flows`).
                map_names::FLOW_EVENTS,
                map_names::FLOW_LISTENER,
                map_names::FLOW_RATE,
            ] {
                loader.map_pin_path(name, root.map_pin(name));
            }
        }
        let mut ebpf = loader.load(object).map_err(|e| {
            let hint = privilege_hint(&e);
            let err = anyhow::Error::new(e).context("creating the eBPF maps");
            match hint {
                Some(h) => err.context(h),
                None => err,
            }
        })?;
        // Every program the datapath needs, verified at once (see `verify_all`), or taken
        // from a previous agent of the same build.
        let ipv6_wanted = !options.without_ipv6;
        let mut names: Vec<&str> = vec![
            program_names::TC_INGRESS,
            program_names::TC_EGRESS,
            program_names::REFUSE,
            program_names::NEW_FLOW,
        ];
        names.extend(program_names::SOCKET_HOOKS);
        if features.sock_release_cookie {
            names.push(program_names::SOCK_RELEASE);
        }
        let ipv6_names: &[&str] = if ipv6_wanted {
            &program_names::IPV6_TC
        } else {
            &[]
        };
        // What the programs are made of and bound to (see `reuse`); the flow log reads the
        // log buffer of the programs it loads, so those are never kept.
        let build = match pins {
            Some(root) if !options.flow_log => match reuse::pinned_map_ids(root) {
                Ok(maps) => {
                    let maps: Vec<u8> = maps
                        .iter()
                        .flat_map(|(name, id)| name.bytes().chain([0]).chain(id.to_le_bytes()))
                        .collect();
                    let ipv6 = [ipv6_wanted as u8];
                    let mut parts = globals.to_vec();
                    parts.extend([("ipv6 wanted", &ipv6[..]), ("pinned maps", &maps[..])]);
                    Some(reuse::build_id(object, &parts))
                }
                Err(e) => {
                    tracing::warn!("reading the pinned maps' ids: {e:#}; programs are not kept");
                    None
                }
            },
            Some(root) => {
                // Nothing kept for the next start: what earlier builds kept goes (their
                // programs hold maps that may be no longer pinned).
                let _ = reuse::remove_all_but(&reuse::programs_dir(root), None);
                None
            }
            None => None,
        };
        let reused = match (pins, &build) {
            (Some(root), Some(build)) => match reuse::find(root, build, &names, ipv6_names) {
                Ok(found) => Some(found),
                Err(e) => {
                    tracing::debug!("verifying the programs: pinned ones not reused: {e:#}");
                    None
                }
            },
            _ => None,
        };
        let (reused, ipv6) = match reused {
            Some((programs, ipv6)) => {
                if ipv6_wanted && !ipv6 {
                    tracing::warn!(
                        "the IPv6 datapath is not loaded, IPv6 services are not served by this node: this kernel's verifier refused its programs when this build first loaded; the kernels this build is tested on (5.10, 6.1, 6.18) load it, and --ebpf-ipv6=false skips the attempt"
                    );
                }
                (Some(programs), ipv6)
            }
            None => {
                let all: Vec<&str> = names.iter().chain(ipv6_names).copied().collect();
                let (ipv6, refused) = check_verified(verify_all(&mut ebpf, &all)?, ipv6_wanted)?;
                // IPv6 missing for another reason than the verifier: nothing kept, the next
                // start tries again.
                let complete = ipv6 || !ipv6_wanted || refused;
                if let (Some(root), Some(build), true) = (pins, &build, complete) {
                    let mut loaded = names.clone();
                    if ipv6 {
                        loaded.extend(ipv6_names);
                    }
                    // Only a slower next start if this fails.
                    if let Err(e) = reuse::keep(root, build, &mut ebpf, &loaded, refused) {
                        tracing::warn!("keeping the verified programs for the next start: {e:#}");
                    }
                }
                (None, ipv6)
            }
        };
        let reused = reused.unwrap_or_default();
        // The tc programs tail-call these (IPv6 packets, refusals, new IPv4 flows).
        let mut slots = Vec::new();
        let mut tail_called = vec![
            (tail_calls::REFUSE, program_names::REFUSE),
            (tail_calls::NEW_FLOW, program_names::NEW_FLOW),
        ];
        if ipv6 {
            tail_called.push((tail_calls::INGRESS6, program_names::TC_INGRESS6));
            tail_called.push((tail_calls::EGRESS6, program_names::TC_EGRESS6));
            tail_called.push((tail_calls::NEW_FLOW6, program_names::NEW_FLOW6));
        }
        for (index, name) in tail_called {
            let prog: &SchedClassifier = reused
                .get(name)
                .or_else(|| ebpf.program(name))
                .with_context(|| format!("eBPF object has no program {name}"))?
                .try_into()?;
            slots.push((index, prog.fd()?.try_clone()?));
        }
        let mut jump: ProgramArray<&mut MapData> = ProgramArray::try_from(
            ebpf.map_mut(map_names::TAIL_CALLS)
                .context("eBPF object has no TAIL_CALLS map")?,
        )?;
        for (index, fd) in &slots {
            jump.set(*index, fd, 0)
                .context("installing the tail-called programs")?;
        }
        let mut datapath = Datapath {
            ebpf,
            programs_reused: !reused.is_empty(),
            reused,
            sizes,
            config: DatapathConfig::DEFAULT,
            config6: DatapathConfig6::default(),
            ipv6,
        };
        datapath.configure(&DatapathConfig::DEFAULT)?;
        datapath.configure6(&DatapathConfig6::default())?;
        Ok(datapath)
    }

    pub fn program(&self, name: &str) -> Result<&SchedClassifier> {
        self.reused
            .get(name)
            .or_else(|| self.ebpf.program(name))
            .with_context(|| format!("eBPF object has no program {name}"))?
            .try_into()
            .with_context(|| format!("program {name} is not a tc classifier"))
    }

    /// Program `name`, loaded or reused.
    pub fn program_mut(&mut self, name: &str) -> Result<&mut Program> {
        match self.reused.get_mut(name) {
            Some(program) => Ok(program),
            None => self
                .ebpf
                .program_mut(name)
                .with_context(|| format!("eBPF object has no program {name}")),
        }
    }

    /// Writes the datapath settings (conntrack timeouts).
    pub fn configure(&mut self, config: &DatapathConfig) -> Result<()> {
        let map = self
            .ebpf
            .map_mut(map_names::CONFIG)
            .context("eBPF object has no CONFIG map")?;
        let mut array: Array<&mut MapData, DatapathConfig> = Array::try_from(map)?;
        array
            .set(0, config, 0)
            .context("writing the datapath configuration")?;
        self.config = *config;
        Ok(())
    }

    /// Writes `FLOW_LISTENER` as a follower of new flows does (`inspect flows --follow`
    /// writes it through the pin; the benchmark, with a listener present, here).
    pub fn set_flow_listener(&mut self, listener: proxy_common::FlowListener) -> Result<()> {
        let map = self
            .ebpf
            .map_mut(map_names::FLOW_LISTENER)
            .context("eBPF object has no FLOW_LISTENER map")?;
        let mut array: Array<&mut MapData, proxy_common::FlowListener> = Array::try_from(map)?;
        array.set(0, listener, 0).context("writing FLOW_LISTENER")
    }

    /// Writes the IPv6 datapath settings (masquerade address, cluster CIDR).
    pub fn configure6(&mut self, config: &DatapathConfig6) -> Result<()> {
        let map = self
            .ebpf
            .map_mut(map_names::CONFIG6)
            .context("eBPF object has no CONFIG6 map")?;
        let mut array: Array<&mut MapData, DatapathConfig6> = Array::try_from(map)?;
        array
            .set(0, config, 0)
            .context("writing the IPv6 datapath configuration")?;
        self.config6 = *config;
        Ok(())
    }

    /// Makes `LOCAL_IFACES` hold exactly `wanted` (the node's pod interfaces); returns the
    /// interfaces that did not fit.
    pub fn set_pod_interfaces(
        &mut self,
        wanted: &std::collections::BTreeSet<u32>,
    ) -> Result<usize> {
        let map = self
            .ebpf
            .map_mut(map_names::LOCAL_IFACES)
            .context("eBPF object has no LOCAL_IFACES map")?;
        let mut ifaces: BpfHashMap<&mut MapData, u32, u8> = BpfHashMap::try_from(map)?;
        let present: std::collections::BTreeSet<u32> =
            ifaces.keys().filter_map(|k| k.ok()).collect();
        for gone in present.difference(wanted) {
            ifaces
                .remove(gone)
                .with_context(|| format!("removing ifindex {gone} from LOCAL_IFACES"))?;
        }
        let mut left_out = 0;
        for new in wanted.difference(&present) {
            if ifaces.insert(new, 1, 0).is_err() {
                left_out += 1;
            }
        }
        Ok(left_out)
    }

    /// Takes one of the object's maps out of it (for a writer that owns it from then on,
    /// such as [`crate::proxier::ebpf::maps::KernelMaps`]).
    pub fn take_map(&mut self, name: &str) -> Result<aya::maps::Map> {
        self.ebpf
            .take_map(name)
            .with_context(|| format!("eBPF object has no {name} map"))
    }

    /// Another handle on one of the object's maps (the object keeps its own).
    pub fn second_handle(&self, name: &str) -> Result<aya::maps::Map> {
        let map = self
            .ebpf
            .map(name)
            .with_context(|| format!("eBPF object has no {name} map"))?;
        match map {
            aya::maps::Map::Array(data) => Ok(aya::maps::Map::Array(duplicate(data)?)),
            aya::maps::Map::PerCpuArray(data) => Ok(aya::maps::Map::PerCpuArray(duplicate(data)?)),
            _ => bail!("map {name} is not an array"),
        }
    }

    /// Per program, the instructions the verifier processed to accept it (the kernel's
    /// `verified_insns`, 5.16+); `None` for a program not loaded (IPv6 ones a verifier
    /// refused) or a kernel that does not say. Sorted by name.
    pub fn verified_instructions(&self) -> Vec<(String, Option<u32>)> {
        let mut counts: Vec<(String, Option<u32>)> = self
            .ebpf
            .programs()
            .map(|(name, program)| {
                let count = self
                    .reused
                    .get(name)
                    .unwrap_or(program)
                    .info()
                    .ok()
                    .and_then(|info| info.verified_instruction_count());
                (name.to_string(), count)
            })
            .collect();
        counts.sort();
        counts
    }

    /// Datapath counters summed over CPUs, in [`Stat::ALL`] order.
    pub fn stats(&self) -> Result<Vec<(Stat, u64)>> {
        let map = self
            .ebpf
            .map(map_names::STATS)
            .context("eBPF object has no STATS map")?;
        let array: PerCpuArray<&MapData, u64> = PerCpuArray::try_from(map)?;
        Stat::ALL
            .iter()
            .map(|s| {
                let per_cpu = array.get(&(*s as u32), 0)?;
                Ok((*s, per_cpu.iter().sum()))
            })
            .collect()
    }

    /// Per-service-port traffic, summed over CPUs, for the given service ids.
    pub fn service_stats(&self, ids: &[u32]) -> Result<Vec<ServiceStats>> {
        self.traffic(map_names::SERVICE_STATS, ids)
    }

    /// Per-backend traffic (when loaded with `backend_stats`), for the given backend ids.
    pub fn backend_stats(&self, ids: &[u32]) -> Result<Vec<ServiceStats>> {
        let slots: Vec<u32> = ids
            .iter()
            .map(|id| id & proxy_common::BACKEND_INDEX_MASK)
            .collect();
        self.traffic(map_names::BACKEND_STATS, &slots)
    }

    fn traffic(&self, name: &str, ids: &[u32]) -> Result<Vec<ServiceStats>> {
        let map = self
            .ebpf
            .map(name)
            .with_context(|| format!("eBPF object has no {name} map"))?;
        let array: PerCpuArray<&MapData, ServiceStats> = PerCpuArray::try_from(map)?;
        ids.iter()
            .map(|id| Ok(summed(&array.get(id, 0)?)))
            .collect()
    }

    /// Deletes conntrack entries idle past their timeout (each direction of a flow carries
    /// its own timestamp). The datapath already treats such a flow as new on its next packet;
    /// collecting them returns their memory, so the LRU never has to evict a live flow to
    /// make room for a new one while dead ones linger. Returns how many were deleted.
    pub fn collect_conntrack_garbage(&mut self) -> Result<ConntrackSweep> {
        // Read before the walk, so entries created during it can only lower the estimate.
        let count = |stats: &[(Stat, u64)], which: Stat| {
            stats
                .iter()
                .find(|(s, _)| *s == which)
                .map_or(0, |(_, n)| *n)
        };
        let before = self.stats()?;
        let config = self.config;
        let now = monotonic_ns();
        let expired = |proto: u8, flags: u8, last_seen_ns: u64| {
            now.saturating_sub(last_seen_ns) > config.timeout_ns(proto, flags) + CT_REFRESH_NS
        };
        // Flows still counted as active by the least-connection schedulers, per backend slot.
        let mut released: std::collections::HashMap<u32, u64> = Default::default();
        // (entries seen, entries removed) per map; IPv4 and IPv6 maps alike.
        let mut swept = [(0, 0); 4];
        for (i, name) in [
            map_names::CONNTRACK,
            map_names::CONNTRACK6,
            map_names::CT_NEW,
            map_names::CT_NEW6,
        ]
        .into_iter()
        .enumerate()
        {
            let map = self
                .ebpf
                .map_mut(name)
                .with_context(|| format!("eBPF object has no {name} map"))?;
            swept[i] = if i % 2 == 0 {
                sweep(
                    &mut BpfHashMap::<_, ConntrackKey, ConntrackValue>::try_from(map)?,
                    |k, v| (k.proto, v.flags, v.last_seen_ns, v.backend_id),
                    expired,
                    &mut released,
                )
            } else {
                sweep(
                    &mut BpfHashMap::<_, ConntrackKey6, ConntrackValue6>::try_from(map)?,
                    |k, v| (k.proto, v.flags, v.last_seen_ns, v.backend_id),
                    expired,
                    &mut released,
                )
            };
        }
        if !released.is_empty() {
            let map = self
                .ebpf
                .map_mut(map_names::BACKEND_RELEASED)
                .context("eBPF object has no BACKEND_RELEASED map")?;
            let mut array: Array<&mut MapData, u64> = Array::try_from(map)?;
            for (slot, n) in released {
                let before = array.get(&slot, 0)?;
                array.set(slot, before.wrapping_add(n), 0)?;
            }
        }
        let [(seen, deleted), (seen6, deleted6), (seen_new, deleted_new), (seen_new6, deleted_new6)] =
            swept;
        let collected =
            self.add_collected(Stat::ConntrackCollected, (deleted + deleted6) as u64)?;
        let collected_new =
            self.add_collected(Stat::NewEntryCollected, (deleted_new + deleted_new6) as u64)?;
        let remaining = seen - deleted;
        let remaining6 = seen6 - deleted6;
        let remaining_new = seen_new - deleted_new;
        let remaining_new6 = seen_new6 - deleted_new6;
        let evicted = |created: Stat, removed: Stat, collected: u64, left: usize| {
            count(&before, created)
                .saturating_sub(count(&before, removed))
                .saturating_sub(collected)
                .saturating_sub(left as u64)
        };
        Ok(ConntrackSweep {
            deleted: deleted + deleted6 + deleted_new + deleted_new6,
            remaining,
            remaining6,
            remaining_new,
            remaining_new6,
            evicted: evicted(
                Stat::ConntrackCreated,
                Stat::ConntrackRemoved,
                collected,
                remaining + remaining6,
            ),
            evicted_new: evicted(
                Stat::NewEntryCreated,
                Stat::NewEntryRemoved,
                collected_new,
                remaining_new + remaining_new6,
            ),
        })
    }

    /// Adds to a garbage collector's count in `STATS` (a slot the datapath never writes)
    /// and returns the new total.
    fn add_collected(&mut self, which: Stat, deleted: u64) -> Result<u64> {
        let map = self
            .ebpf
            .map_mut(map_names::STATS)
            .context("eBPF object has no STATS map")?;
        let mut array: PerCpuArray<&mut MapData, u64> = PerCpuArray::try_from(map)?;
        let index = which as u32;
        let mut values: Vec<u64> = array.get(&index, 0)?.iter().copied().collect();
        if deleted > 0 {
            values[0] += deleted;
            array.set(index, PerCpuValues::try_from(values.clone())?, 0)?;
        }
        Ok(values.iter().sum())
    }

    /// The conntrack map, for inspection and garbage collection.
    pub fn conntrack(&mut self) -> Result<BpfHashMap<&mut MapData, ConntrackKey, ConntrackValue>> {
        let map = self
            .ebpf
            .map_mut(map_names::CONNTRACK)
            .context("eBPF object has no CONNTRACK map")?;
        Ok(BpfHashMap::try_from(map)?)
    }
}

/// Verifies (loads) the programs named, each on a thread of its own, and returns each
/// one's outcome in the order given. The kernel verifies programs independently and
/// verification is most of the agent's start-up (~2.6 s of CPU on 6.18 for all of them,
/// the new-flow, IPv6 and socket programs most of it), so the cores share it.
fn verify_all<'a>(
    ebpf: &mut Ebpf,
    names: &[&'a str],
) -> Result<Vec<(&'a str, Result<(), ProgramError>)>> {
    let mut programs: Vec<(&'a str, &mut Program)> = Vec::with_capacity(names.len());
    let mut all: HashMap<&str, &mut Program> = ebpf.programs_mut().collect();
    for name in names {
        let program = all
            .remove(name)
            .with_context(|| format!("eBPF object has no program {name}"))?;
        programs.push((name, program));
    }
    Ok(std::thread::scope(|scope| {
        let running: Vec<_> = programs
            .into_iter()
            .map(|(name, program)| {
                let handle = scope.spawn(move || {
                    let started = std::time::Instant::now();
                    let result = match program {
                        Program::SchedClassifier(p) => p.load(),
                        Program::CgroupSockAddr(p) => p.load(),
                        Program::CgroupSock(p) => p.load(),
                        _ => Err(ProgramError::UnexpectedProgramType),
                    };
                    tracing::debug!(
                        program = name,
                        took_ms = started.elapsed().as_millis() as u64,
                        "verified"
                    );
                    result
                });
                (name, handle)
            })
            .collect();
        running
            .into_iter()
            .map(|(name, handle)| {
                let result = handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                (name, result)
            })
            .collect()
    }))
}

/// What the verifier said, as the agent acts on it: the first refusal of a program it
/// needs fails the start; the IPv6 programs' refusal is a warning and returns false (IPv6
/// packets then pass untranslated, IPv4 is still served: older verifiers, Debian's 6.1,
/// give up on them as too complex). Returns whether the IPv6 programs loaded, and whether
/// a refusal of theirs was the verifier's (not memory or privileges, which another start may
/// not meet).
fn check_verified(
    results: Vec<(&str, Result<(), ProgramError>)>,
    ipv6_wanted: bool,
) -> Result<(bool, bool)> {
    let mut ipv6 = ipv6_wanted;
    let mut verifier_refused = false;
    for (name, result) in results {
        let Err(e) = result else { continue };
        let hint = privilege_hint(&e);
        let by_verifier = matches!(&e, ProgramError::LoadError { io_error, .. }
            if !matches!(io_error.raw_os_error(), Some(libc::ENOMEM | libc::EPERM | libc::EAGAIN)));
        let err = anyhow::Error::new(e).context(format!("the kernel refused eBPF program {name}"));
        if program_names::IPV6_TC.contains(&name) {
            if ipv6 {
                tracing::warn!(
                    "the IPv6 datapath is not loaded, IPv6 services are not served by this node: {}; the kernels this build is tested on (5.10, 6.1, 6.18) load it, and --ebpf-ipv6=false skips the attempt",
                    verifier_summary(&err)
                );
            }
            ipv6 = false;
            verifier_refused |= by_verifier;
            continue;
        }
        return Err(match hint {
            Some(h) => err.context(h),
            None => err,
        });
    }
    Ok((ipv6, verifier_refused))
}

#[cfg(test)]
mod tests {
    /// A refused load is summed up by its first line and the verifier's reason, not the
    /// thousands of lines of its log (as 6.1 refuses the IPv6 programs).
    #[test]
    fn verifier_summary_keeps_the_reason_and_drops_the_log() {
        let log = "the BPF_PROG_LOAD syscall returned Argument list too long (os error 7). Verifier output: 0: R1=ctx(off=0,imm=0) R10=fp0\n       ; unsafe { (*self.skb).data_end as usize }\n       0: (61) r3 = *(u32 *)(r1 +80)\n       BPF program is too large. Processed 1000001 insn\n       verification time 60000000 usec\n       processed 1000001 insns (limit 1000000) max_states_per_insn 17";
        let e = anyhow::anyhow!("{log}").context("the kernel refused eBPF program proxy_ingress6");
        assert_eq!(
            super::verifier_summary(&e),
            "the kernel refused eBPF program proxy_ingress6: the BPF_PROG_LOAD syscall returned Argument list too long (os error 7): BPF program is too large. Processed 1000001 insn; processed 1000001 insns (limit 1000000) max_states_per_insn 17"
        );
    }
}
