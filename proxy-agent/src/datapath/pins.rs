//! The agent's state in bpffs, which outlives the agent: maps under `<root>/maps`, TCX links
//! under `<root>/links`. A stopped agent leaves the datapath serving from these; the next
//! agent adopts them, after checking that their layout is the one it was built for.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use aya::maps::{Array, MapData, MapInfo, MapType};
use proxy_common::{
    map_names, tail_calls, AffinityKey, AffinityValue, Backend, ConntrackKey, ConntrackValue,
    DatapathConfig, FragmentKey, FragmentValue, MaglevKey, ServiceKey, ServiceStats, ServiceValue,
    SockRevNatKey, SockRevNatValue, SourceRangeKey, MAP_LAYOUT_VERSION,
};
use tracing::{info, warn};

use crate::datapath::DatapathSizes;

pub const DEFAULT_BPFFS_ROOT: &str = "/sys/fs/bpf/proxy-agent";
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

fn is_bpffs(path: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-pointer.
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == BPF_FS_MAGIC }
}

fn nearest_existing(path: &Path) -> &Path {
    let mut p = path;
    while !p.exists() {
        match p.parent() {
            Some(parent) => p = parent,
            None => break,
        }
    }
    p
}

/// The bpffs directory holding the agent's pins.
#[derive(Clone, Debug)]
pub struct BpffsRoot {
    pub path: PathBuf,
}

impl BpffsRoot {
    /// Opens the root, mounting a bpffs if it is not on one (at `/sys/fs/bpf` for paths
    /// below it, else at the root itself), and creates its directories.
    pub fn prepare(path: &Path) -> Result<Self> {
        if !is_bpffs(nearest_existing(path)) {
            let mount_point = if path.starts_with("/sys/fs/bpf") {
                PathBuf::from("/sys/fs/bpf")
            } else {
                fs::create_dir_all(path)
                    .with_context(|| format!("creating --bpffs-root {}", path.display()))?;
                path.to_path_buf()
            };
            mount_bpffs(&mount_point)?;
            info!(mount_point = %mount_point.display(), "mounted bpffs");
        }
        let root = BpffsRoot {
            path: path.to_path_buf(),
        };
        for dir in [root.maps_dir(), root.links_dir(), root.qdiscs_dir()] {
            fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        Ok(root)
    }

    pub fn maps_dir(&self) -> PathBuf {
        self.path.join("maps")
    }

    pub fn links_dir(&self) -> PathBuf {
        self.path.join("links")
    }

    /// clsact qdiscs the agent added (netlink mode), one directory each.
    pub fn qdiscs_dir(&self) -> PathBuf {
        self.path.join("qdiscs")
    }

    pub fn map_pin(&self, name: &str) -> PathBuf {
        self.maps_dir().join(name)
    }

    /// Removes every map pin (the maps go when the last program using them does).
    pub fn remove_map_pins(&self) -> Result<usize> {
        remove_files(&self.maps_dir())
    }
}

fn mount_bpffs(at: &Path) -> Result<()> {
    let target = std::ffi::CString::new(at.as_os_str().as_encoded_bytes())?;
    let rc = unsafe {
        libc::mount(
            c"bpf".as_ptr(),
            target.as_ptr(),
            c"bpf".as_ptr(),
            0,
            c"mode=0700".as_ptr().cast(),
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        bail!(
            "mounting bpffs at {}: {err} (mount it on the host, e.g. `mount -t bpf bpf /sys/fs/bpf`, \
             and give the agent a hostPath volume for it, or run with CAP_SYS_ADMIN)",
            at.display()
        );
    }
    Ok(())
}

pub(crate) fn remove_files(dir: &Path) -> Result<usize> {
    let mut removed = 0;
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    for entry in entries {
        let p = entry?.path();
        fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
        removed += 1;
    }
    Ok(removed)
}

/// What the pinned maps must look like for this agent to use them.
struct Expected {
    name: &'static str,
    map_type: MapType,
    key_size: usize,
    value_size: usize,
    /// Sized from configuration (may differ from a pinned map's size).
    configurable: bool,
}

fn expected() -> [Expected; 30] {
    use std::mem::size_of;
    [
        Expected {
            name: map_names::SERVICES,
            map_type: MapType::Hash,
            key_size: size_of::<ServiceKey>(),
            value_size: size_of::<ServiceValue>(),
            configurable: true,
        },
        Expected {
            name: map_names::BACKENDS,
            map_type: MapType::Array,
            key_size: 4,
            value_size: size_of::<Backend>(),
            configurable: true,
        },
        Expected {
            name: map_names::CONNTRACK,
            map_type: MapType::LruHash,
            key_size: size_of::<ConntrackKey>(),
            value_size: size_of::<ConntrackValue>(),
            configurable: true,
        },
        Expected {
            name: map_names::CONFIG,
            map_type: MapType::Array,
            key_size: 4,
            value_size: size_of::<DatapathConfig>(),
            configurable: false,
        },
        Expected {
            name: map_names::STATS,
            map_type: MapType::PerCpuArray,
            key_size: 4,
            value_size: 8,
            configurable: false,
        },
        Expected {
            name: map_names::SERVICE_STATS,
            map_type: MapType::PerCpuArray,
            key_size: 4,
            value_size: size_of::<ServiceStats>(),
            // Sized like SERVICES; checked through that map's size.
            configurable: false,
        },
        Expected {
            name: map_names::BACKEND_STATS,
            map_type: MapType::PerCpuArray,
            key_size: 4,
            value_size: size_of::<ServiceStats>(),
            // Sized like BACKENDS.
            configurable: false,
        },
        Expected {
            name: map_names::AFFINITY,
            map_type: MapType::LruHash,
            key_size: size_of::<AffinityKey>(),
            value_size: size_of::<AffinityValue>(),
            // Sized like CONNTRACK.
            configurable: false,
        },
        Expected {
            name: map_names::SOURCE_RANGES,
            map_type: MapType::LpmTrie,
            key_size: 4 + size_of::<SourceRangeKey>(),
            value_size: 1,
            // Sized like SERVICES.
            configurable: false,
        },
        Expected {
            name: map_names::FRAGMENTS,
            map_type: MapType::LruHash,
            key_size: size_of::<FragmentKey>(),
            value_size: size_of::<FragmentValue>(),
            // Sized from CONNTRACK.
            configurable: false,
        },
        Expected {
            name: map_names::SOCK_REVNAT,
            map_type: MapType::LruHash,
            key_size: size_of::<SockRevNatKey>(),
            value_size: size_of::<SockRevNatValue>(),
            // Sized like CONNTRACK.
            configurable: false,
        },
        Expected {
            name: map_names::RR_STATE,
            map_type: MapType::Array,
            key_size: 4,
            value_size: 8,
            // Sized like SERVICES.
            configurable: false,
        },
        Expected {
            name: map_names::BACKEND_CONNS,
            map_type: MapType::Array,
            key_size: 4,
            value_size: 8,
            // Sized like BACKENDS.
            configurable: false,
        },
        Expected {
            name: map_names::BACKEND_RELEASED,
            map_type: MapType::Array,
            key_size: 4,
            value_size: 8,
            // Sized like BACKENDS.
            configurable: false,
        },
        Expected {
            name: map_names::LBLCR_SETS,
            map_type: MapType::Array,
            key_size: 4,
            value_size: size_of::<proxy_common::LblcrSet>(),
            // Sized like SERVICES.
            configurable: false,
        },
        Expected {
            name: map_names::SERVICES6,
            map_type: MapType::Hash,
            key_size: size_of::<proxy_common::ServiceKey6>(),
            value_size: size_of::<ServiceValue>(),
            // Sized like SERVICES.
            configurable: false,
        },
        Expected {
            name: map_names::BACKEND_ADDRS6,
            map_type: MapType::Array,
            key_size: 4,
            value_size: size_of::<proxy_common::BackendAddr6>(),
            // Sized like BACKENDS.
            configurable: false,
        },
        Expected {
            name: map_names::CONNTRACK6,
            map_type: MapType::LruHash,
            key_size: size_of::<proxy_common::ConntrackKey6>(),
            value_size: size_of::<proxy_common::ConntrackValue6>(),
            // Sized like CONNTRACK.
            configurable: false,
        },
        Expected {
            name: map_names::CT_NEW,
            map_type: MapType::LruHash,
            key_size: size_of::<ConntrackKey>(),
            value_size: size_of::<ConntrackValue>(),
            // Sized from CONNTRACK.
            configurable: false,
        },
        Expected {
            name: map_names::CT_NEW6,
            map_type: MapType::LruHash,
            key_size: size_of::<proxy_common::ConntrackKey6>(),
            value_size: size_of::<proxy_common::ConntrackValue6>(),
            // Sized from CONNTRACK.
            configurable: false,
        },
        Expected {
            name: map_names::AFFINITY6,
            map_type: MapType::LruHash,
            key_size: size_of::<proxy_common::AffinityKey6>(),
            value_size: size_of::<AffinityValue>(),
            // Sized like CONNTRACK.
            configurable: false,
        },
        Expected {
            name: map_names::SOURCE_RANGES6,
            map_type: MapType::LpmTrie,
            key_size: 4 + size_of::<proxy_common::SourceRangeKey6>(),
            value_size: 1,
            // Sized like SERVICES.
            configurable: false,
        },
        Expected {
            name: map_names::FRAGMENTS6,
            map_type: MapType::LruHash,
            key_size: size_of::<proxy_common::FragmentKey6>(),
            value_size: size_of::<proxy_common::FragmentValue6>(),
            // Sized from CONNTRACK.
            configurable: false,
        },
        Expected {
            name: map_names::CONFIG6,
            map_type: MapType::Array,
            key_size: 4,
            value_size: size_of::<proxy_common::DatapathConfig6>(),
            configurable: false,
        },
        Expected {
            name: map_names::SOCK_REVNAT6,
            map_type: MapType::LruHash,
            key_size: size_of::<proxy_common::SockRevNatKey6>(),
            value_size: size_of::<proxy_common::SockRevNatValue6>(),
            // Sized like CONNTRACK.
            configurable: false,
        },
        Expected {
            name: map_names::SOCK_AFFINITY,
            map_type: MapType::LruHash,
            key_size: size_of::<proxy_common::SockAffinityKey>(),
            value_size: size_of::<AffinityValue>(),
            // Sized like CONNTRACK.
            configurable: false,
        },
        Expected {
            name: map_names::SOCK_LB,
            map_type: MapType::Hash,
            key_size: 8,
            value_size: size_of::<proxy_common::SockLbValue>(),
            // Sized like CONNTRACK.
            configurable: false,
        },
        Expected {
            name: map_names::TAIL_CALLS,
            map_type: MapType::ProgramArray,
            key_size: 4,
            value_size: 4,
            configurable: false,
        },
        Expected {
            name: map_names::LOCAL_IFACES,
            map_type: MapType::Hash,
            key_size: 4,
            value_size: 1,
            configurable: false,
        },
        Expected {
            name: map_names::MAGLEV,
            map_type: MapType::Hash,
            key_size: size_of::<MaglevKey>(),
            value_size: 4,
            configurable: true,
        },
    ]
}

/// What was found in bpffs at start.
#[derive(Debug, PartialEq, Eq)]
pub enum Adoption {
    /// No pinned maps: a first start (or after `--cleanup`).
    Fresh,
    /// The pinned maps match this agent's layout and are reused: tracked connections and the
    /// programmed services carry over.
    Adopted,
    /// The pinned maps were written by an agent with another layout; they were removed and
    /// new ones created. Tracked connections are re-balanced.
    Rebuilt { reason: String },
}

fn incompatibility(root: &BpffsRoot, sizes: &mut DatapathSizes) -> Result<Option<String>> {
    for e in expected() {
        let pin = root.map_pin(e.name);
        let info = match MapInfo::from_pin(&pin) {
            Ok(i) => i,
            Err(_) => {
                return Ok(Some(format!(
                    "map {} is missing from {}",
                    e.name,
                    pin.display()
                )))
            }
        };
        let map_type = info.map_type().ok();
        if map_type != Some(e.map_type)
            || info.key_size() as usize != e.key_size
            || info.value_size() as usize != e.value_size
        {
            return Ok(Some(format!(
                "map {} is {:?} with {}-byte keys and {}-byte values; this agent uses {:?} with {} and {}",
                e.name,
                map_type,
                info.key_size(),
                info.value_size(),
                e.map_type,
                e.key_size,
                e.value_size
            )));
        }
        // Its slots are fixed by this build's programs: an older agent's has fewer.
        if e.name == map_names::TAIL_CALLS && info.max_entries() != tail_calls::COUNT {
            return Ok(Some(format!(
                "map {} has {} slots; this agent uses {}",
                e.name,
                info.max_entries(),
                tail_calls::COUNT
            )));
        }
        if e.configurable {
            let wanted = match e.name {
                map_names::SERVICES => &mut sizes.services,
                map_names::BACKENDS => &mut sizes.backends,
                map_names::MAGLEV => &mut sizes.maglev,
                _ => &mut sizes.conntrack,
            };
            if *wanted != info.max_entries() {
                warn!(
                    map = e.name,
                    pinned = info.max_entries(),
                    configured = *wanted,
                    "keeping the pinned map's size; a new size takes effect after `proxy-agent --cleanup`"
                );
                *wanted = info.max_entries();
            }
        }
    }
    let config: Array<MapData, DatapathConfig> = Array::try_from(aya::maps::Map::Array(
        MapData::from_pin(root.map_pin(map_names::CONFIG))?,
    ))?;
    let version = config.get(&0, 0)?.layout_version;
    if version != MAP_LAYOUT_VERSION {
        return Ok(Some(format!(
            "the pinned maps have layout version {version}; this agent uses {MAP_LAYOUT_VERSION}"
        )));
    }
    Ok(None)
}

/// The maps of `inspect flows --follow` hold nothing worth keeping: a pinned one shaped
/// otherwise than this agent's (another build's) is removed, and made anew at load,
/// rather than refusing the others' adoption.
fn remove_unlike_flow_pins(root: &BpffsRoot) -> Result<()> {
    use std::mem::size_of;
    for (name, map_type, value_size, max_entries) in [
        (
            map_names::FLOW_EVENTS,
            MapType::RingBuf,
            0,
            proxy_common::FLOW_EVENTS_BYTES,
        ),
        (
            map_names::FLOW_LISTENER,
            MapType::Array,
            size_of::<proxy_common::FlowListener>(),
            1,
        ),
        (
            map_names::FLOW_RATE,
            MapType::PerCpuArray,
            size_of::<proxy_common::FlowRate>(),
            1,
        ),
    ] {
        let pin = root.map_pin(name);
        let Ok(info) = MapInfo::from_pin(&pin) else {
            continue;
        };
        if info.map_type().ok() != Some(map_type)
            || info.value_size() as usize != value_size
            || info.max_entries() != max_entries
        {
            fs::remove_file(&pin).with_context(|| format!("removing {}", pin.display()))?;
        }
    }
    Ok(())
}

/// Decides whether the pinned maps can be reused, and removes them if not. May lower
/// `sizes` to the pinned maps' sizes.
pub fn adopt_or_rebuild(root: &BpffsRoot, sizes: &mut DatapathSizes) -> Result<Adoption> {
    let any_pinned = fs::read_dir(root.maps_dir())
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    if !any_pinned {
        return Ok(Adoption::Fresh);
    }
    let mut pinned_sizes = *sizes;
    match incompatibility(root, &mut pinned_sizes)? {
        None => {
            *sizes = pinned_sizes;
            remove_unlike_flow_pins(root)?;
            Ok(Adoption::Adopted)
        }
        Some(reason) => {
            root.remove_map_pins()?;
            Ok(Adoption::Rebuilt { reason })
        }
    }
}
